//! The services an HCA runs while a command waits (Linux `pagealloc.c`, `eq.c`, `health.c`): the health clock
//! ([`Clock`], [`Watch`]), draining the EQs and answering firmware page requests on the pages slot, and running
//! commands with all of that in between polls ([`Hca::exec`]).

use core::cell::Cell;

use crate::cmd::Simple;
use crate::cmdq::{CmdError, CmdQueue, Command, SlotKind};
use crate::hal::{DelayNs, Dma, Mmio};
use crate::health::{Health, HealthFailure};
use crate::pages::{ManagePagesGive, ManagePagesTake, PagesError, Reclaim, GIVE_BATCH, RECLAIM_BATCH};
use crate::prm::{consts, ifc, Opcode};
use crate::trace::CmdTrace;

use super::error::Error;
use super::events::EventSink;
use super::{Ctx, Hca, HcaState, PageStats, Tables};

/// Drain passes per call: each pass after the first only exists because serving page requests produced events.
pub(super) const MAX_DRAIN_PASSES: usize = 8;

/// A delay that also counts the time it waited (the health timer runs on it).
pub(super) struct Clock<'a, D: DelayNs + ?Sized> {
    pub(super) inner: &'a mut D,
    pub(super) us: &'a Cell<u64>,
}

impl<D: DelayNs + ?Sized> DelayNs for Clock<'_, D> {
    fn delay_ns(&mut self, ns: u32) {
        self.inner.delay_ns(ns);
        self.us.set(self.us.get() + u64::from(ns / 1000));
    }
    fn delay_us(&mut self, us: u32) {
        self.inner.delay_us(us);
        self.us.set(self.us.get() + u64::from(us));
    }
    fn delay_ms(&mut self, ms: u32) {
        self.inner.delay_ms(ms);
        self.us.set(self.us.get() + u64::from(ms) * 1000);
    }
}

/// The health timer, driven by the time spent waiting.
#[derive(Debug)]
pub(super) struct Watch {
    pub(super) health: Health,
    pub(super) last_poll_us: u64,
    pub(super) interval_us: u64,
    pub(super) failure: Option<HealthFailure>,
    /// The caller's clock (milliseconds) at the last [`Hca::health_tick`] that polled.
    pub(super) tick_ms: u64,
    /// [`Hca::health_tick`]'s period in milliseconds.
    pub(super) tick_interval_ms: u64,
}

impl Watch {
    /// One check between polls of a waiting command: a health tick when one is due.
    fn tick<M: Mmio + ?Sized>(&mut self, mmio: &M, now_us: u64, opcode: Opcode) -> Result<(), CmdError> {
        if self.failure.is_some() {
            return Err(CmdError::DeviceDown { opcode });
        }
        if now_us.saturating_sub(self.last_poll_us) < self.interval_us {
            return Ok(());
        }
        self.last_poll_us = now_us;
        match self.health.poll(mmio) {
            Ok(()) => Ok(()),
            Err(f) => {
                self.failure = Some(f);
                Err(CmdError::DeviceDown { opcode })
            }
        }
    }
}

/// The ops Linux completes locally in internal-error state (`mlx5_internal_err_ret_value`): undoing something is
/// done once the device is dead.
pub fn done_in_internal_error(op: Opcode) -> bool {
    matches!(
        op,
        Opcode::TeardownHca
            | Opcode::DisableHca
            | Opcode::ManagePages
            | Opcode::DestroyMkey
            | Opcode::DestroyEq
            | Opcode::DestroyCq
            | Opcode::DestroyQp
            | Opcode::DestroyPsv
            | Opcode::DestroySrq
            | Opcode::DestroyXrcSrq
            | Opcode::DestroyXrq
            | Opcode::DestroyDct
            | Opcode::DeallocQCounter
            | Opcode::DeallocPd
            | Opcode::DeallocUar
            | Opcode::DetachFromMcg
            | Opcode::DeallocXrcd
            | Opcode::DeallocTransportDomain
            | Opcode::DestroyTir
            | Opcode::DestroyTis
            | Opcode::DestroyRq
            | Opcode::DestroySq
            | Opcode::DestroyRqt
            | Opcode::DestroyRmp
            | Opcode::X2errQp
            | Opcode::X2rstQp
    )
}

/// Picks a free slot for `kind`: the last slot for pages (or any free regular slot if a timed-out page command
/// still holds it), otherwise the first free regular slot (slot 0 unless a timed-out command holds it).
pub(super) fn pick_slot<M: Mmio, D: Dma, T: CmdTrace>(q: &CmdQueue<M, D, T>, kind: SlotKind) -> u8 {
    let last = q.slot(SlotKind::Pages);
    if kind == SlotKind::Pages && q.slot_free(last) {
        return last;
    }
    (0..last).find(|&s| q.slot_free(s)).unwrap_or(q.slot(kind))
}

/// Runs a page command on the pages slot; its wait only ticks health (no EQ draining inside).
fn exec_pages_cmd<M: Mmio, D: Dma, T: CmdTrace, C: Command>(
    watch: &mut Watch,
    q: &mut CmdQueue<M, D, T>,
    d: &mut dyn DelayNs,
    clock: &Cell<u64>,
    cmd: &mut C,
) -> Result<C::Output, CmdError> {
    let slot = pick_slot(q, SlotKind::Pages);
    let opcode = cmd.opcode();
    // `d` already counts waiting time (the caller wrapped it in a `Clock`).
    q.exec_on(slot, cmd, &mut &mut *d, &mut |q, _| watch.tick(q.mmio(), clock.get(), opcode))
}

impl<S: Tables> Ctx<S> {
    /// Between polls of a waiting command on the regular slot: health, then the EQ (page requests are answered
    /// right here, on the pages slot).
    fn on_wait<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        opcode: Opcode,
    ) -> Result<(), CmdError> {
        self.watch.tick(q.mmio(), clock.get(), opcode)?;
        match self.drain(q, d, clock) {
            // Firmware answered a page command and refused it: not the waiting command's failure, which must not
            // be reported as firmware's answer to it (a CREATE's buffer would be freed while firmware may still
            // create the object). Linux's page worker drops the request the same way; the command keeps waiting.
            Err(CmdError::Status { .. } | CmdError::Delivery { .. } | CmdError::BadSignature { .. }) => Ok(()),
            r => r,
        }
    }

    /// Drains the EQ: counts events, serves page requests, re-arms. Serving a request runs commands whose own
    /// completion events land in the EQ, so the drain repeats until a pass finds no request (bounded). Errors
    /// from serving a page request abort.
    fn drain<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
    ) -> Result<(), CmdError> {
        for _ in 0..MAX_DRAIN_PASSES {
            let mut requests: [Option<(u16, i32)>; 8] = [None; 8];
            if !self.drain_pass(q, &mut requests) {
                return Ok(());
            }
            for (func, num) in requests.into_iter().flatten() {
                self.serve_page_request(q, d, clock, func, num)?;
            }
        }
        Ok(())
    }

    /// One pass over the EQs (command, async, pages, then the completion EQs by vector): counts events, records completion and CQ-error events,
    /// and collects page requests; re-arms an EQ when it consumed anything. Returns whether there are page
    /// requests to serve. Bounded by the ring sizes, so a device that keeps writing cannot trap the driver here.
    fn drain_pass<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        requests: &mut [Option<(u16, i32)>; 8],
    ) -> bool {
        let mut sink = EventSink {
            events: &mut self.events,
            stats: &mut self.stats,
            cqs: &mut self.cqs,
            async_events: &mut self.async_events,
            requests,
            nreq: 0,
        };
        for ring in self.eqs.rings_mut() {
            sink.drain_ring(ring, q.mmio());
        }
        sink.nreq > 0
    }

    /// Answers one page request (`pages_work_handler`): give `num` pages, or take `-num` back.
    fn serve_page_request<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        function_id: u16,
        num: i32,
    ) -> Result<(), CmdError> {
        if num > 0 {
            match self.give_all(q, d, clock, function_id, num as usize, |s, k| s.requested += k) {
                Ok(()) => Ok(()),
                Err(GiveError::Cmd(e)) => Err(e),
                Err(GiveError::Pool(_)) => {
                    // `page_notify_fail`: tell firmware it will not get the pages, so it fails the command
                    // that needed them instead of waiting forever.
                    self.stats.cant_give += 1;
                    let mut cmd = Simple::new(
                        Opcode::ManagePages,
                        ifc::manage_pages_in::SIZE_BYTES,
                        ifc::manage_pages_out::SIZE_BYTES,
                    )
                    .op_mod(consts::MLX5_PAGES_CANT_GIVE)
                    .arg(ifc::manage_pages_in::FUNCTION_ID, function_id.into());
                    exec_pages_cmd(&mut self.watch, q, d, clock, &mut cmd).map(|_| ())
                }
            }
        } else if num < 0 {
            // In `optimal_reclaimed_pages` batches, as teardown reclaims, until firmware stops returning.
            let mut left = (num.unsigned_abs() as usize).min(self.pages.given());
            while left > 0 {
                match self.take(q, d, clock, function_id, left.min(RECLAIM_BATCH))? {
                    0 => break,
                    got => left = left.saturating_sub(got),
                }
            }
            Ok(())
        } else {
            Ok(())
        }
    }

    /// Gives `n` fresh pages (`give_pages`) in MANAGE_PAGES of at most [`GIVE_BATCH`] pages each, counting each
    /// given batch with `count`; stops at the first failure (the batches before it stay given).
    pub(super) fn give_all<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        function_id: u16,
        n: usize,
        count: impl Fn(&mut PageStats, usize),
    ) -> Result<(), GiveError> {
        let mut left = n;
        while left > 0 {
            let k = left.min(GIVE_BATCH);
            self.pages.reserve(q.dma(), k).map_err(GiveError::Pool)?;
            let mut cmd = ManagePagesGive { function_id, pages: self.pages.pending_pages() };
            match exec_pages_cmd(&mut self.watch, q, d, clock, &mut cmd) {
                Ok(()) => {
                    self.pages.commit();
                    self.stats.given += k;
                }
                Err(e @ CmdError::Status { .. })
                | Err(e @ CmdError::Delivery { .. })
                | Err(e @ CmdError::BadSignature { .. }) => {
                    // Firmware answered and refused: it holds none of the pages.
                    self.pages.cancel(q.dma());
                    return Err(GiveError::Cmd(e));
                }
                Err(e) => {
                    // No answer (timeout, device down): firmware may hold the pages; keep them as given so they
                    // are never freed while the device could write them. Teardown settles them.
                    self.pages.commit();
                    return Err(GiveError::Cmd(e));
                }
            }
            count(&mut self.stats, k);
            left -= k;
        }
        Ok(())
    }

    /// One MANAGE_PAGES take of up to `want` pages (`reclaim_pages`); returns how many came back.
    pub(super) fn take<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        function_id: u16,
        want: usize,
    ) -> Result<usize, CmdError> {
        let mut sink = Reclaim { pool: &mut self.pages, capacity: want, unknown: 0, first_unknown: None };
        let mut cmd = ManagePagesTake { function_id, pages: &mut sink };
        let r = exec_pages_cmd(&mut self.watch, q, d, clock, &mut cmd);
        let (unknown, first_unknown) = (sink.unknown, sink.first_unknown);
        let n = r?;
        self.pages.free_empty(q.dma());
        let got = n - unknown;
        self.stats.reclaimed += got;
        if let Some(addr) = first_unknown {
            return Err(CmdError::Malformed {
                opcode: Opcode::ManagePages,
                what: "page firmware never had",
                value: addr,
            });
        }
        Ok(got)
    }
}

#[derive(Debug)]
pub(super) enum GiveError {
    Pool(PagesError),
    Cmd(CmdError),
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    /// Maps a command error, moving to internal error when the wait found the device unhealthy.
    pub(crate) fn cmd_error(&mut self, e: CmdError) -> Error {
        if let Some(f) = self.ctx.watch.failure {
            self.enter_internal_error(f);
            return Error::Health(f);
        }
        Error::Cmd(e)
    }

    pub(crate) fn check_state(&self, opcode: Opcode) -> Result<(), Error> {
        match self.state {
            HcaState::Up => Ok(()),
            HcaState::InternalError(cause) => Err(Error::InternalError { cause, opcode }),
        }
    }

    /// `mlx5_enter_error_state`: no command reaches the device from now on, and the caller gets one
    /// `DeviceFatal` async event (`MLX5_DEV_EVENT_SYS_ERROR`, which mlx5_ib dispatches as `IB_EVENT_DEVICE_FATAL`).
    pub(super) fn enter_internal_error(&mut self, cause: HealthFailure) {
        if self.state == HcaState::Up {
            self.state = HcaState::InternalError(cause);
            self.ctx.watch.failure.get_or_insert(cause);
            self.cmdq.set_device_down(true);
            self.ctx.async_events.push(super::AsyncEvent::DeviceFatal);
        }
    }

    /// Runs a command on the first free regular slot, draining the EQ (and answering page requests on the pages
    /// slot) and polling health while it waits. In internal-error state nothing is sent.
    pub fn exec<C: Command>(&mut self, cmd: &mut C, delay: &mut impl DelayNs) -> Result<C::Output, Error> {
        let opcode = cmd.opcode();
        self.check_state(opcode)?;
        let kind = if opcode == Opcode::ManagePages { SlotKind::Pages } else { SlotKind::Regular };
        let slot = pick_slot(&self.cmdq, kind);
        let ctx = &mut self.ctx;
        let clock = &self.clock_us;
        let mut clk = Clock { inner: delay, us: clock };
        let r = self.cmdq.exec_on(slot, cmd, &mut clk, &mut |q, d| ctx.on_wait(q, d, clock, opcode));
        match r {
            Ok(out) => {
                // Events that arrived with the completion (its own command EQE, page requests) are served now.
                // The command itself completed: a failure serving them is not its failure (the caller would give
                // up an object firmware created or destroyed). A health failure still moves the HCA to internal
                // error, which the next command reports.
                let mut clk = Clock { inner: delay, us: clock };
                let ctx = &mut self.ctx;
                if let Err(e) = ctx.drain(&mut self.cmdq, &mut clk, clock) {
                    let _ = self.cmd_error(e);
                }
                Ok(out)
            }
            Err(e) => Err(self.cmd_error(e)),
        }
    }

    /// Runs a destroy-type command; in internal-error state it is treated as done without reaching the device
    /// (`mlx5_internal_err_ret_value`), so cleanup can proceed on a dead device.
    pub fn exec_destroy(&mut self, mut cmd: Simple, delay: &mut impl DelayNs) -> Result<(), Error> {
        if let HcaState::InternalError(_) = self.state {
            if done_in_internal_error(cmd.opcode) {
                return Ok(());
            }
        }
        self.exec(&mut cmd, delay).map(|_| ())
    }

    /// Drains the async EQ, answers page requests, re-arms. Returns EQEs consumed so far in total.
    pub fn process_events(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        self.check_state(Opcode::ManagePages)?;
        let clock = &self.clock_us;
        let mut clk = Clock { inner: delay, us: clock };
        let ctx = &mut self.ctx;
        ctx.drain(&mut self.cmdq, &mut clk, clock).map_err(|e| self.cmd_error(e))
    }

    /// The health timer on the caller's clock (Linux's `poll_health` timer, independent of commands): `now_ms` is
    /// any monotonic millisecond count. When less than the poll interval (2 s, `Config::health_poll_interval_ms`)
    /// has passed since the last poll it costs one subtraction and one branch and touches no register, so the
    /// datapath or a host timer can call it as often as it likes. When due it runs [`Hca::poll_health`]: a fatal
    /// sensor or health syndrome, or a heartbeat that stayed the same for `MAX_MISSES` (3) polls, moves the HCA
    /// to internal error, queues [`AsyncEvent::DeviceFatal`](super::AsyncEvent::DeviceFatal) once, makes every
    /// post fail with `PostErrorKind::DeviceError` and lets [`Hca::poll_cq`] complete the outstanding work
    /// requests with `WR_FLUSH_ERR`. Only a tick that polls reports a failure; [`Hca::state`] says it at any time.
    /// The heartbeat's miss count is shared with the polls made while commands wait.
    #[inline]
    pub fn health_tick(&mut self, now_ms: u64) -> Result<(), Error> {
        if now_ms.wrapping_sub(self.ctx.watch.tick_ms) < self.ctx.watch.tick_interval_ms {
            return Ok(());
        }
        self.health_tick_due(now_ms)
    }

    #[cold]
    fn health_tick_due(&mut self, now_ms: u64) -> Result<(), Error> {
        self.ctx.watch.tick_ms = now_ms;
        self.poll_health()
    }

    /// One tick of the health timer (call it every [`HEALTH_POLL_INTERVAL_MS`](crate::health::HEALTH_POLL_INTERVAL_MS)). A failure moves the HCA to
    /// internal error and is returned.
    pub fn poll_health(&mut self) -> Result<(), Error> {
        if let HcaState::InternalError(f) = self.state {
            return Err(Error::Health(f));
        }
        match self.ctx.watch.health.poll(self.cmdq.mmio()) {
            Ok(()) => Ok(()),
            Err(f) => {
                self.enter_internal_error(f);
                Err(Error::Health(f))
            }
        }
    }
}

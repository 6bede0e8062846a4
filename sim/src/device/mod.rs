//! The device: [`Device`] (everything behind the device lock: the firmware tables, DMA space, registers, the
//! datapath's queues, the links and the logs), [`Shared`] (the lock, plus the hand-off to the device thread in
//! threaded mode) and the run loop: command doorbells ([`Device::ring`], delivery in `cmd.rs`), postponed
//! commands, and after each doorbell or delay the datapath and the links (`link::pump`).

pub(crate) mod cmd;
pub(crate) mod pump;
pub(crate) mod state;
mod station;

use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::config::{Mode, SimConfig};
use crate::dma::DmaSpace;
use crate::events::SimEvent;
use crate::fw::cq::CqInfo;
use crate::fw::eq::{EqPost, EQE_DATA_LEN};
use crate::fw::mkey::{MkeyAccess, MkeyFault};
use crate::fw::{self, Firmware};
use crate::link::{self, Wire};
use crate::regs::{Clock, Health, Regs};
use crate::transport::{Datapath, DpState};
use crate::uar::UarDecoder;

pub use state::EVENT_LOG_MAX;
pub(crate) use state::{lock, Bell, Device, Shared};
use state::{Handoff, Pending};

/// The [`EqPost`] view of a device's fields, as a macro so the caller may borrow the other fields beside it.
macro_rules! eq_post {
    ($d:ident) => {
        EqPost { eqs: &mut $d.fw.eqs, dma: &mut $d.dma, events: &mut $d.events, regs: &mut $d.regs, clock: &$d.clock }
    };
}

impl Device {
    /// Drops the oldest events once the log holds twice [`EVENT_LOG_MAX`], keeping the most recent
    /// `EVENT_LOG_MAX` (amortized: one move per `EVENT_LOG_MAX` events).
    fn trim_logs(&mut self) {
        if self.events.len() > 2 * EVENT_LOG_MAX {
            let n = self.events.len() - EVENT_LOG_MAX;
            self.events.drain(..n);
            self.events_dropped += n as u64;
        }
    }

    /// Device time: virtual in inline mode, wall time since creation in threaded mode.
    pub(crate) fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Whether the firmware is dead or the device gone: nothing executes, nothing is written.
    pub(crate) fn dead(&self) -> bool {
        self.regs.dead()
    }

    /// The firmware dies with health syndrome `synd` (0: a silent stall). Idempotent.
    pub(crate) fn fail(&mut self, synd: u8) {
        fw::health::fail(&mut self.regs, &mut self.events, self.clock.now_ns(), synd);
    }

    /// A function-level reset (what vfio-pci does when the device is released, and Linux's health recovery
    /// asks for): firmware, its registers, every object and the datapath start over as at power-on, back on the
    /// bus if it had left. The host's memory (DMA regions), the logs, the clock, the wire and injected faults stay.
    pub(crate) fn function_reset(&mut self) {
        self.regs = Regs::after_reset(&self.cfg, self.clock.now_ns());
        self.fw = Firmware::new(&self.cfg);
        self.dp = DpState::default();
        self.pending.clear();
        self.stalled.clear();
        self.events.push(SimEvent::FunctionReset);
    }

    /// The device leaves the bus. Idempotent.
    pub(crate) fn vanish(&mut self) {
        if self.regs.health == Health::Gone {
            return;
        }
        self.regs.health = Health::Gone;
        self.events.push(SimEvent::DeviceGone);
    }

    /// The datapath's view of this device (see [`Datapath`]).
    #[inline]
    pub(crate) fn datapath(&mut self) -> Datapath<'_> {
        Datapath {
            cfg: &self.cfg,
            fw: &mut self.fw,
            dma: &mut self.dma,
            events: &mut self.events,
            wire: &mut self.wire,
            dp: &mut self.dp,
            regs: &mut self.regs,
            clock: &self.clock,
        }
    }

    /// A 32-bit write into a UAR page, decoded (see [`UarDecoder::uar_write32`]).
    pub(crate) fn uar_write32(&mut self, off: usize, val: u32) {
        UarDecoder(self.datapath()).uar_write32(off, val);
    }

    /// A 64-bit write into a UAR page, decoded; true when it was a send doorbell that gave the datapath work
    /// (see [`UarDecoder::uar_write64`]).
    pub(crate) fn uar_write64(&mut self, off: usize, v: u64) -> bool {
        UarDecoder(self.datapath()).uar_write64(off, v)
    }

    /// The view an EQE is posted through (see [`EqPost`]).
    #[inline]
    pub(crate) fn eq_post(&mut self) -> EqPost<'_> {
        eq_post!(self)
    }

    /// Posts an EQE to the lowest-numbered EQ subscribed to `event_type`; returns that EQ when it was written.
    pub(crate) fn post_eqe(&mut self, event_type: u8, sub_type: u8, data: &[u8; EQE_DATA_LEN]) -> Option<u8> {
        self.eq_post().post_eqe(event_type, sub_type, data)
    }

    /// Posts the command-completion EQE for `slot` when an EQ subscribes to command events.
    pub(crate) fn post_cmd_completion(&mut self, slot: u8) {
        self.eq_post().post_cmd_completion(slot);
    }

    /// Firmware asks for `num_pages` (negative: offers that many back), now or once an EQ subscribes.
    pub(crate) fn page_request(&mut self, num_pages: i32) {
        let (state, mut held) = (self.fw.state, self.fw.page_request_held);
        let mut post = eq_post!(self);
        post.page_request(&mut self.fw.pages, state, &mut held, num_pages);
        self.fw.page_request_held = held;
    }

    /// Posts the held page request, if any, once an EQ subscribes.
    pub(crate) fn flush_page_requests(&mut self) {
        let mut held = self.fw.page_request_held;
        let mut post = eq_post!(self);
        post.flush_page_requests(&self.fw.pages, &mut held);
        self.fw.page_request_held = held;
    }

    /// A catastrophic error on QP `qpn` (see `SimDevice::fail_qp`).
    pub(crate) fn fail_qp(&mut self, qpn: u32) -> bool {
        let mut post = eq_post!(self);
        self.fw.qps.fail(&mut post, qpn)
    }

    /// The port's link goes down or comes up, with its PORT_CHANGE EQE (see `PortModel::set_up`).
    pub(crate) fn set_port_up(&mut self, up: bool) -> Option<u8> {
        let mut post = eq_post!(self);
        self.fw.port.set_up(&mut post, up)
    }

    /// Posts a PORT_CHANGE EQE of `sub_type` for port 1; returns the EQ it went to.
    pub(crate) fn port_change(&mut self, sub_type: u8) -> Option<u8> {
        self.eq_post().port_change(sub_type)
    }

    /// The state of CQ `cqn`, reading the doorbell record without recording a fault.
    pub(crate) fn cq_info(&self, cqn: u32) -> Option<CqInfo> {
        self.fw.cqs.info(&self.dma, cqn)
    }

    /// Checks an access through `key` and translates it (see `SimDevice::mkey_access`).
    pub(crate) fn mkey_access(
        &self,
        key: u32,
        pd: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<Vec<(u64, u64)>, MkeyFault> {
        self.fw.mkeys.access(&self.dma, key, pd, va, len, access)
    }

    /// Advances virtual time by `ns` and runs the postponed commands that became due (inline mode).
    pub(crate) fn advance_virtual(&mut self, ns: u64) {
        self.clock.advance(ns);
        self.run_due();
    }

    /// Runs every postponed command whose time has come (inline mode).
    fn run_due(&mut self) {
        let now = self.now_ns();
        // Bounded: each pass removes one entry and a re-run never re-postpones (delay faults are skipped).
        for _ in 0..self.pending.len() {
            let Some(i) = self.pending.iter().position(|p| p.due_ns <= now) else { break };
            let p = self.pending.remove(i);
            self.run_slot(p.slot, false);
        }
    }

    /// Handles a doorbell mask; returns the (slot, ms) pairs a threaded device must complete later.
    pub(crate) fn ring(&mut self, mask: u32) -> Vec<(u8, u32)> {
        let mut later = Vec::new();
        for slot in 0..32u8 {
            if mask & (1 << slot) == 0 {
                continue;
            }
            if let Some(ms) = self.run_slot(slot, true) {
                match self.cfg.mode {
                    Mode::Inline => {
                        let due_ns = self.now_ns().saturating_add(u64::from(ms) * 1_000_000);
                        self.pending.push(Pending { due_ns, slot });
                    }
                    Mode::Threaded => later.push((slot, ms)),
                }
            }
        }
        later
    }
}

/// How often the device thread runs the datapath on its own (timers: retries, flushes of late receives).
const WORKER_TICK: Duration = Duration::from_millis(1);

/// How long the device thread polls for the next doorbell after a run that had work, before it parks, when such
/// polls have been finding work ([`SpinPolicy`]).
const WORKER_SPIN: Duration = Duration::from_micros(20);

/// Whether to poll before parking: only while recent polls found the next doorbell in time. A driver that posts
/// again right after its completions (a ping-pong, a bench) then costs no wake-up; on a machine so loaded that
/// the driver's thread is off its CPU when the poll runs, polling only burns the device thread's share and costs
/// it the scheduler's preference for a woken sleeper, so it stops, probing again every [`SpinPolicy::PROBE`] parks
/// (BENCHMARKS.md has both measurements).
#[derive(Debug)]
struct SpinPolicy {
    /// Recent success, a moving average in 1/256ths.
    hits: u32,
    /// Parks without a poll since the last one.
    skipped: u32,
}

impl SpinPolicy {
    const PROBE: u32 = 32;

    fn new() -> Self {
        Self { hits: 256, skipped: 0 }
    }

    fn should(&mut self) -> bool {
        if self.hits >= 128 {
            return true;
        }
        self.skipped += 1;
        if self.skipped >= Self::PROBE {
            self.skipped = 0;
            return true;
        }
        false
    }

    fn record(&mut self, hit: bool) {
        self.hits = self.hits - self.hits / 8 + if hit { 32 } else { 0 };
    }
}

impl Shared {
    /// Delivers a doorbell: executes it now (inline) or hands it to the device thread (threaded).
    pub(crate) fn doorbell(self: &Arc<Self>, mask: u32) {
        match &self.worker {
            Some(w) => w.post(Bell::Cmd(mask)),
            None => {
                lock(self).ring(mask);
                pump::pump(self);
            }
        }
    }

    /// The device runs after an MMIO write or a delay: in-line mode runs the datapath now (due retries,
    /// flushes, and the work a send doorbell brought, when `kick`); threaded mode hands a send doorbell to the
    /// device thread, which also runs on its own every [`WORKER_TICK`]. A threaded doorbell takes no lock.
    pub(crate) fn run(self: &Arc<Self>, kick: bool) {
        match &self.worker {
            Some(w) => {
                if kick {
                    w.kick();
                }
            }
            None => {
                lock(self).trim_logs();
                pump::pump(self);
            }
        }
    }
}

/// Runs doorbells in threaded mode. Holds only a weak reference while parked, so dropping the last handle
/// stops it. Each wake-up drains all posted doorbells in order, runs the datapath, and looks again; with nothing
/// left it polls briefly when that has been paying ([`SpinPolicy`]), then parks until the next doorbell or
/// [`WORKER_TICK`].
fn worker(weak: Weak<Shared>) {
    let mut last_run = Instant::now();
    let mut spin = SpinPolicy::new();
    // The last run had doorbells to take (not only timers): the driver is active, so the next may come soon.
    let mut after_work = false;
    // The bells taken per pass; swapped with the posted list, so neither allocates once grown.
    let mut bells: Vec<Bell> = Vec::with_capacity(64);
    loop {
        let Some(shared) = weak.upgrade() else { break };
        let Some(w) = shared.worker.as_ref() else { break };
        let kick = w.kick.swap(false, Ordering::SeqCst);
        if kick || last_run.elapsed() >= WORKER_TICK {
            after_work = kick;
            std::mem::swap(&mut *w.bells.lock().unwrap_or_else(|e| e.into_inner()), &mut bells);
            let taken = bells.len() as u64;
            // Order the driver's stores (entry, mailboxes, WQEs) before our reads, as the doorbell write does.
            fence(Ordering::SeqCst);
            let mut later = Vec::new();
            if !bells.is_empty() {
                let mut st = lock(&shared);
                for bell in bells.drain(..) {
                    match bell {
                        Bell::Cmd(mask) => later.extend(st.ring(mask)),
                        // A device that left the bus takes no doorbells (as `SimMmio` records a write to it).
                        Bell::Uar32(off, val) if st.regs.health == Health::Gone => {
                            st.events.push(SimEvent::WriteWhileGone { off, val });
                        }
                        Bell::Uar64(off, v) if st.regs.health == Health::Gone => {
                            st.events.push(SimEvent::WriteWhileGone { off, val: (v >> 32) as u32 });
                            st.events.push(SimEvent::WriteWhileGone { off: off.saturating_add(4), val: v as u32 });
                        }
                        Bell::Uar32(off, v) => st.uar_write32(off, v),
                        Bell::Uar64(off, v) => {
                            st.uar_write64(off, v);
                        }
                    }
                }
            }
            for (slot, ms) in later {
                let weak = Arc::downgrade(&shared);
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(u64::from(ms)));
                    if let Some(shared) = weak.upgrade() {
                        lock(&shared).run_slot(slot, false);
                        pump::pump(&shared);
                    }
                });
            }
            // Every run executes the datapath: send doorbells, commands that changed QP states, timers.
            pump::pump(&shared);
            w.done.fetch_add(taken, Ordering::SeqCst);
            lock(&shared).trim_logs();
            last_run = Instant::now();
            continue;
        }
        // Nothing pending: poll for the next doorbell a little while, if that has been finding it.
        if std::mem::take(&mut after_work) && spin.should() {
            let t = Instant::now();
            let mut n = 0u32;
            while !w.pending() {
                std::hint::spin_loop();
                n = n.wrapping_add(1);
                if n.is_multiple_of(32) && t.elapsed() >= WORKER_SPIN {
                    break;
                }
            }
            let hit = w.pending();
            spin.record(hit);
            if hit {
                continue;
            }
        }
        let wait = WORKER_TICK.saturating_sub(last_run.elapsed());
        w.sleeping.store(true, Ordering::SeqCst);
        if w.pending() || wait.is_zero() {
            w.sleeping.store(false, Ordering::SeqCst);
            continue;
        }
        drop(shared);
        std::thread::park_timeout(wait);
        // The device may be gone: the handoff lives in `Shared`, so clear the flag only through a live handle.
        if let Some(shared) = weak.upgrade() {
            if let Some(w) = shared.worker.as_ref() {
                w.sleeping.store(false, Ordering::SeqCst);
            }
        }
    }
}

impl Shared {
    /// A new device: its state behind the lock, and in threaded mode the device thread.
    pub(crate) fn new(cfg: SimConfig) -> Arc<Self> {
        let mode = cfg.mode;
        let state = Device {
            regs: Regs::new(&cfg),
            fw: Firmware::new(&cfg),
            dma: DmaSpace::new(cfg.dma_max_contig),
            events: Vec::new(),
            events_dropped: 0,
            executed: Vec::new(),
            messages: std::collections::VecDeque::new(),
            faults: Vec::new(),
            pending: Vec::new(),
            stalled: Vec::new(),
            clock: Clock::new(cfg.mode),
            wire: Wire::new(&cfg),
            dp: DpState::default(),
            cfg,
        };
        let shared = match mode {
            Mode::Inline => Arc::new(Shared { state: Mutex::new(state), send: Mutex::new(()), worker: None }),
            Mode::Threaded => {
                let uar = state.regs.uar_range();
                let shared = Arc::new(Shared {
                    state: Mutex::new(state),
                    send: Mutex::new(()),
                    worker: Some(Handoff::new(uar)),
                });
                let weak = Arc::downgrade(&shared);
                let handle = std::thread::Builder::new()
                    .name("mlx5-sim-fw".into())
                    .spawn(move || worker(weak))
                    .expect("spawning the simulator's firmware thread");
                if let Some(w) = &shared.worker {
                    let _ = w.thread.set(handle.thread().clone());
                }
                shared
            }
        };
        // Packets name their source device so responses find their way back.
        let me: Arc<dyn std::any::Any + Send + Sync> = shared.clone();
        lock(&shared).wire.me.port = link::Port::Local(Arc::downgrade(&me));
        shared
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim_device::SimDevice;
    use mlx5_core::hal::Mmio;
    use mlx5_core::prm::consts;

    /// The device thread polls before parking while polls find work, stops after a run of misses, then polls
    /// only once every `PROBE` parks until hits bring it back.
    #[test]
    fn spin_policy_stops_polling_when_it_misses_and_comes_back_when_it_hits() {
        let mut p = SpinPolicy::new();
        assert!(p.should());
        p.record(true);
        assert!(p.should());
        let mut misses = 0;
        while p.should() {
            p.record(false);
            misses += 1;
            assert!(misses < 100, "polling never stops");
        }
        assert!(misses >= 3, "one miss does not stop it: {misses}");
        // Stopped: one probe in PROBE parks.
        let polls = (0..4 * SpinPolicy::PROBE).filter(|_| p.should()).count();
        assert_eq!(polls, 4);
        // Probes that hit bring polling back.
        let mut parks = 0;
        loop {
            if p.should() {
                p.record(true);
                if p.hits >= 128 {
                    break;
                }
            }
            parks += 1;
            assert!(parks < 64 * SpinPolicy::PROBE, "hits never bring polling back");
        }
        assert!(p.should());
    }

    // Not under `mmio::`: Miri runs that module's tests, and this one needs the device thread and real time.
    /// In threaded mode a UAR doorbell is a posted write: it returns while the device is busy (its lock held),
    /// and the device thread takes it afterwards, in order.
    #[test]
    fn a_threaded_doorbell_is_posted_without_waiting_for_the_device() {
        let dev = SimDevice::new(SimConfig { mode: Mode::Threaded, ..SimConfig::default() });
        let m = dev.mmio();
        let uar = lock(&dev.shared).regs.uar_range().start;
        let cq_db = uar + consts::MLX5_CQ_DOORBELL as usize;
        let busy = lock(&dev.shared);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let writer = std::thread::spawn(move || {
            m.write64(cq_db, 7);
            m.write64(cq_db, 8);
            let _ = done_tx.send(());
        });
        let posted = done_rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(busy);
        writer.join().unwrap();
        assert!(posted.is_ok(), "the doorbells returned while the device lock was held");
        // The device takes both, in the order written (on a UAR page not allocated, which it reports).
        let start = std::time::Instant::now();
        let seen = loop {
            let seen: Vec<u64> = dev
                .events()
                .iter()
                .filter_map(|e| match e {
                    SimEvent::BadCqDoorbell { off, val, .. } if *off == cq_db => Some(*val),
                    _ => None,
                })
                .collect();
            if seen.len() == 2 || start.elapsed().as_secs() > 10 {
                break seen;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        assert_eq!(seen, [7, 8]);
    }
}

//! A simulated ConnectX (mlx5) HCA for testing `mlx5-core` without hardware.
//!
//! # Handles
//! A [`SimDevice`] is a cheap, clonable handle to one device (`Arc` + `Mutex` inside). The driver talks to it
//! through three handles that implement the `mlx5-core` HAL: [`SimMmio`] (the BAR: initialization segment plus
//! UAR pages), [`SimDma`] (device-visible memory) and [`SimDelay`] (time). Tests use the device handle to
//! configure it ([`SimConfig`]), inject faults ([`Fault`]) and observe it ([`SimDevice::executed`],
//! [`SimDevice::events`], [`SimDevice::dma_faults`], [`SimDevice::eq_info`], [`SimDevice::health`], ...).
//!
//! # Inline and threaded modes
//! In [`Mode::Inline`] (the default) a write to `cmd_dbell` executes the rung commands synchronously inside
//! `write32`, so a test is deterministic and single threaded. In [`Mode::Threaded`] a worker thread takes the
//! doorbells as posted writes, in order (it is woken only when parked), and completes the commands
//! asynchronously, as real firmware does; it exercises the driver's polling and ordering.
//!
//! # Virtual time
//! In inline mode nothing really sleeps: [`SimDelay`] advances a virtual clock and runs device work that became
//! due (commands delayed by [`Fault::Delay`]). The clock also drives `initializing` ([`SimConfig::init_delay_ms`]),
//! the health counter and the internal timer. In threaded mode `SimDelay` really sleeps and the clock is wall time.
//!
//! # DMA and its faults
//! [`SimDma`] hands out zeroed host memory behind fresh IOVAs that are never reused, each followed by an unmapped
//! guard page. The device side reaches memory only through a checked translation: an access that is not fully
//! inside one live region is recorded as a [`DmaFault`] and fails the command (delivery status `FW_ERR`) instead
//! of touching memory. Device DMA is modelled outside the Rust memory model, as real DMA is: the device copies
//! bytes with raw pointer copies under its lock, and the command protocol (owner bit and barriers) is what keeps
//! the CPU and the device off the same bytes.
//!
//! # Firmware
//! The command engine (module `fw`) validates delivery exactly as the PRM describes (entry type, signatures,
//! tokens, block numbers, pointer alignment), then runs the command with firmware-like checks: HCA state machine
//! (ENABLE_HCA, INIT_HCA, TEARDOWN_HCA, DISABLE_HCA), ISSI, page management, capabilities and the first objects
//! (PD, UAR, EQ, CQ). Failures carry a status and a syndrome from [`syndrome`]; a command sent in the wrong HCA
//! state fails with `BAD_SYS_STATE`, as real firmware answers.
//!
//! # Event queues
//! An EQ created with CREATE_EQ really receives EQEs. CREATE_EQ refuses (`BAD_PARAM`, [`syndrome::EQ_EVENT_TYPE`])
//! a bitmask asking for a type the device cannot report: the types Linux subscribes to unconditionally, completion,
//! command, page-request and internal-error events, and the capability-dependent ones its capabilities offer. An
//! event of type `T` goes to the lowest-numbered EQ whose `event_bitmask` has bit `T` (bit `n` of word 0 = type
//! `n`); a type no EQ subscribes to is dropped: the 64-byte `mlx5_eqe` is written at entry
//! `pi & (nent - 1)`, then, after a fence, its owner byte `(pi >> log_nent) & 1` (hardware writes 0 on the first
//! pass; the driver pre-sets 1). A full EQ is never overwritten: the firmware dies with the health syndrome
//! `ASYNCHRONOUS_EQ_BUF_OVERRUN` instead. The EQ doorbell in the EQ's UAR page (`MLX5_EQ_DOORBELL_OFFSET`:
//! update the consumer index and arm; 8 bytes further: update only) takes `(ci & 0xffffff) | eqn << 24`. An armed
//! EQ "interrupts" once on its next EQE (recorded as [`SimEvent::EqInterrupt`] and counted in
//! [`SimDevice::eq_info`]); arming with unconsumed EQEs interrupts at once. Firmware posts:
//! * a command-completion EQE (`MLX5_EVENT_TYPE_CMD`, `data.cmd.vector = 1 << slot`) after every completion of a
//!   command that ran while an EQ subscribed to command events (not for the CREATE_EQ that makes the first one);
//! * page requests (`MLX5_EVENT_TYPE_PAGE_REQUEST`): for the regular pages still needed after INIT_HCA, for
//!   [`Fault::PageRequest`], [`Fault::NeedPages`] and [`SimDevice::request_pages`]. A request made while no EQ
//!   subscribes to page requests is held; when one appears firmware posts one request for the balance then due
//!   (what QUERY_PAGES(regular) reports);
//! * PORT_CHANGE (port 1, sub-type DOWN or ACTIVE) when the link goes down or comes up: a TCP link's far end
//!   going away or plugging in, or [`SimDevice::set_port_up`] (the port state the queries report follows); any
//!   other sub-type on request ([`SimDevice::port_change`]);
//! * COMM_EST (`data.qp_srq`: queue type QP, the QP number) when an RC QP in RTR receives its first packet, once
//!   per entry into RTR; `WQ_CATAS_ERROR` from [`SimDevice::fail_qp`]. The device models neither alternate paths
//!   nor the SQD state, so it never posts PATH_MIG, PATH_MIG_FAILED or SQ_DRAINED.
//!
//! A command hit by [`Fault::NeedPages`] stays with hardware until the driver gives the pages on another slot
//! (the driver uses the last one): the MANAGE_PAGES that covers the need completes first, then the stalled
//! command executes and completes, inside the same doorbell (inline) or worker step (threaded). This is how a
//! physical function behaves: it must serve page requests while a command waits.
//!
//! # Completion queues
//! A CQ created with CREATE_CQ really receives CQEs (from the datapath, and from [`SimDevice::post_cqe`]):
//! CQE `n` is written at entry `n mod nent` through the CQ's `pas[]` pages (scattered pages and pages above
//! 4 KiB both work; a 128-byte CQE carries its `mlx5_cqe64` in its second half), bytes 0..63 first and, after a
//! fence, `op_own` with the owner bit `(n >> log_nent) & 1`. Before writing, firmware reads the consumer index
//! from the doorbell record: a full CQ (`pi - ci == nent`) overruns, unless `oi` is set: the CQ enters
//! `MLX5_CQC_STATUS_CQ_OVERFLOW`, takes no more CQEs and a CQ-error EQE (`MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN`) goes
//! to the EQ subscribed to CQ errors. The CQ doorbell (`MLX5_CQ_DOORBELL` in the CQ's UAR page, one 64-bit write
//! of `(sn << 28 | cmd | ci) << 32 | cqn`) arms for the next CQE or for the next solicited (or error) CQE; an
//! armed CQ fires one completion EQE on its own `c_eqn` EQ, whatever that EQ subscribes to, and arming while
//! matching CQEs are unconsumed fires at once. QUERY_CQ reports the context; MODIFY_CQ changes the moderation or
//! resizes (a `MLX5_CQE_RESIZE_CQ` CQE at the old buffer's next index, then the new buffer continues one index
//! further, as rdma-core's `mlx5_cq_resize_copy_cqes` expects).
//!
//! # Memory keys
//! CREATE_MKEY / DESTROY_MKEY keep PA keys (identity translation) and MTT keys (one page address per page of
//! `start_addr .. start_addr + len`). [`SimDevice::mkey_access`] checks an access (key, variant, PD, bounds,
//! rights, live DMA) and returns the IOVA pieces it touches, for tests now and the datapath later.
//!
//! # Queue pairs and the datapath
//! CREATE_QP makes RC and UD QPs (buffer: RQ at byte 0, SQ after it; doorbell record at `dbr_addr`), moved through
//! RST2INIT, INIT2RTR, RTR2RTS, RTS2RTS, 2ERR and 2RST with firmware's checks (`BAD_QP_STATE` from the wrong
//! state); QUERY_QP reports the context and counters, [`SimDevice::qp_info`] the same for tests. A 64-bit write at
//! offset 0 of a BlueFlame buffer of the QP's UAR page is the send doorbell; the rest of a BlueFlame copy is
//! checked against the WQE in memory ([`SimEvent::BlueFlameMismatch`]). In in-line mode the datapath runs inside
//! the MMIO write; in threaded mode on the device thread. SEND, SEND_IMM, RDMA_WRITE(_IMM), RDMA_READ and the two
//! 8-byte atomics execute in order through the memory keys, with requester, responder and error CQEs, RNR NAKs and
//! transport retries on device time, and flushes of a QP in ERR (module `transport`). Timers are checked whenever
//! the device runs: a doorbell, any MMIO write, a [`SimDelay`] sleep, and every millisecond on the device thread.
//!
//! # Addresses and the wire
//! Port 1 has GID index 0 ([`SimDevice::gid`]: the link-local address of the MAC on Ethernet, fe80::/64 + port
//! GUID on IB) and, on IB, the LID [`SimConfig::lid`]. A packet addressed to the device's own LID or GID (and MAC)
//! is loopback; [`SimDevice::connect`] joins two devices so each reaches the other's address (modules `link` and `wire`).
//!
//! # Health and device loss
//! The health buffer (`mlx5_init_seg.health`) and the heartbeat (`health_counter`, one tick per ms of device
//! time) are live. [`Fault::Fatal`] / [`SimDevice::fail_health`] kill the firmware with a syndrome (health buffer
//! `synd`, `ext_synd`, a valid severity and the recovery-flow bit); [`Fault::Stall`] / [`SimDevice::stall_health`] kill it silently
//! (syndrome 0). A dead firmware freezes the heartbeat, never completes a command (the owner bit stays with
//! hardware) and posts no EQE. [`Fault::DeviceGone`] / [`SimDevice::device_gone`] remove the device from the bus:
//! every BAR read returns all ones, writes are ignored, DMA stops. In both states the driver can still free all
//! its DMA memory; pages a dead firmware still owned are counted in [`SimDevice::pages_abandoned`].
//!
//! # Layout
//! Layers, each using only those below it: `config`, `events`, `fault` and `small` at the bottom; `dma` (device
//! memory) and `mmio` (the BAR registers); `fw` (commands and the objects' tables); `wire` (the packet format) and
//! `link` (how packets travel); `transport` (the datapath); `uar` (doorbell decoding). A send doorbell goes
//! `mmio` -> `uar` -> `transport`. This file is the [`SimDevice`] facade and the lock-protected device state the
//! layers share.

mod config;
mod delay;
mod dma;
mod events;
mod fault;
mod fw;
mod link;
mod mmio;
mod small;
#[cfg(any(test, feature = "test-utils"))]
pub mod testkit;
mod transport;
mod uar;
mod wire;

#[cfg(test)]
mod testutil;

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use mlx5_core::prm::c::mlx5_cqe64 as c_cqe;

pub use config::{Mode, PortInfo, PortType, SimConfig};
pub use delay::SimDelay;
pub use dma::{DmaFault, SimDma};
pub use events::{ExecutedCmd, RetryKind, SimEvent};
pub use fault::Fault;
pub use fw::cq::{CqInfo, PostCqeError};
pub use fw::eq::{EqInfo, EQE_DATA_LEN};
pub use fw::mkey::{MkeyAccess, MkeyFault};
pub use fw::qp::{QpInfo, QpState, QpType, SpecialQp};
pub use fw::{syndrome, HcaState};
pub use link::tcp::{WireError, MAX_FRAME};
pub use link::{pcap, stream};
pub use mmio::Health;
/// The BAR page of UAR 0: the initialization segment's pages come first.
pub use mmio::INIT_SEG_PAGES as FIRST_UAR_PAGE;
/// Bytes of one BlueFlame register, as the capabilities say (`1 << log_bf_reg_size`).
pub const BF_REG_SIZE: usize = 1 << fw::caps::LOG_BF_REG_SIZE;
pub use mmio::SimMmio;
pub use transport::roce_rx::arp_neighbour;
pub use wire::roce;

use dma::DmaSpace;
use fw::Firmware;
use link::Wire;
use mmio::Regs;
use transport::DpState;

#[derive(Debug)]
struct Pending {
    due_ns: u64,
    slot: u8,
}

/// A command held by [`Fault::NeedPages`] until `remaining` more pages are given.
#[derive(Debug)]
pub(crate) struct Stalled {
    pub(crate) slot: u8,
    pub(crate) remaining: u64,
}

/// Everything behind the device lock.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) cfg: SimConfig,
    pub(crate) dma: DmaSpace,
    pub(crate) fw: Firmware,
    pub(crate) regs: Regs,
    pub(crate) events: Vec<SimEvent>,
    /// Events dropped from the front of `events` to keep it bounded ([`EVENT_LOG_MAX`]).
    events_dropped: u64,
    pub(crate) executed: Vec<ExecutedCmd>,
    pub(crate) faults: Vec<Fault>,
    pending: Vec<Pending>,
    pub(crate) stalled: Vec<Stalled>,
    virt_ns: u64,
    start: Instant,
    pub(crate) wire: Wire,
    pub(crate) dp: DpState,
}

/// The most recent events a device keeps: a long-lived device (a ping-pong server, the wire soak's survivor) logs
/// events per completion and would otherwise grow without bound (about 300 bytes per work request were measured).
pub const EVENT_LOG_MAX: usize = 1 << 16;

impl State {
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
        match self.cfg.mode {
            Mode::Inline => self.virt_ns,
            Mode::Threaded => u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// Whether the firmware is dead or the device gone: nothing executes, nothing is written.
    pub(crate) fn dead(&self) -> bool {
        self.regs.health != Health::Ok
    }

    /// The firmware dies with health syndrome `synd` (0: a silent stall). Idempotent.
    pub(crate) fn fail(&mut self, synd: u8) {
        if self.dead() {
            return;
        }
        let now = self.now_ns();
        self.regs.die(synd, syndrome::HEALTH_EXT_SYND, now);
        self.events.push(SimEvent::HealthFailure { synd });
    }

    /// The device leaves the bus. Idempotent.
    pub(crate) fn vanish(&mut self) {
        if self.regs.health == Health::Gone {
            return;
        }
        self.regs.health = Health::Gone;
        self.events.push(SimEvent::DeviceGone);
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

/// A doorbell the device thread has still to take, in the order the driver wrote them (threaded mode).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Bell {
    /// The command doorbell with this mask.
    Cmd(u32),
    /// A 32-bit write into a UAR page (EQ doorbells).
    Uar32(usize, u32),
    /// A 64-bit write into a UAR page (CQ arm, send doorbell, BlueFlame copy).
    Uar64(usize, u64),
}

/// The hand-off between the driver's threads and the device thread (threaded mode).
///
/// A doorbell is a posted write: the driver's thread appends it to `bells` (a lock held only for the push, never
/// while the device works, so a doorbell does not wait for the datapath), sets `kick`, and wakes the thread only
/// if it is parked. No wake-up is lost: the producer's store of `kick` and the worker's store of `sleeping` are
/// both `SeqCst`, each followed by a `SeqCst` load of the other's word. In that total order one of the two loads
/// comes after the other side's store: either the worker sees `kick` and does not park, or the producer sees
/// `sleeping` and unparks. An unpark that lands between the worker's check and its `park` leaves the thread's
/// token set, so that `park` returns at once. The worker clears `kick` before it takes `bells`, so a bell pushed
/// after the take has its `kick` seen on the next pass. (Were a wake-up lost anyway, the work would wait for the thread's
/// next [`WORKER_TICK`], not forever: it parks with that timeout.)
#[derive(Debug)]
pub(crate) struct Handoff {
    bells: Mutex<Vec<Bell>>,
    /// Work is waiting: bells, or a run asked for by a delay or a fault.
    kick: AtomicBool,
    /// The device thread is parked, or about to park.
    sleeping: AtomicBool,
    /// The device thread, once spawned.
    thread: OnceLock<std::thread::Thread>,
    /// The UAR pages' BAR range (fixed by the configuration), to tell a doorbell without the device lock.
    uar: std::ops::Range<usize>,
}

impl Handoff {
    fn new(uar: std::ops::Range<usize>) -> Self {
        Self {
            bells: Mutex::new(Vec::with_capacity(64)),
            kick: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            thread: OnceLock::new(),
            uar,
        }
    }

    /// Whether `off .. off + len` lies in the UAR pages.
    pub(crate) fn in_uar(&self, off: usize, len: usize) -> bool {
        mmio::range_holds(&self.uar, off, len)
    }

    /// Posts a doorbell for the device thread.
    pub(crate) fn post(&self, bell: Bell) {
        self.bells.lock().unwrap_or_else(|e| e.into_inner()).push(bell);
        self.kick();
    }

    /// Asks the device thread to run, waking it if it parks (see the type's comment for why none is lost).
    fn kick(&self) {
        self.kick.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    fn pending(&self) -> bool {
        self.kick.load(Ordering::SeqCst)
    }
}

/// State shared by every handle.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Held while this device's datapath runs and its packets are handed on, so they leave in the order they
    /// were produced (`link::pump`). Never held by a thread holding the device lock.
    pub(crate) send: Mutex<()>,
    /// Work for the device thread (threaded mode only).
    worker: Option<Handoff>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The device thread finds the device gone at its next wake-up; make that now.
        if let Some(t) = self.worker.as_ref().and_then(|w| w.thread.get()) {
            t.unpark();
        }
    }
}

/// Locks the device, recovering from a poisoned lock (a panicking test must not cascade into others).
pub(crate) fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Delivers a doorbell: executes it now (inline) or hands it to the device thread (threaded).
    pub(crate) fn doorbell(self: &Arc<Self>, mask: u32) {
        match &self.worker {
            Some(w) => w.post(Bell::Cmd(mask)),
            None => {
                lock(self).ring(mask);
                link::pump(self);
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
                link::pump(self);
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
                        link::pump(&shared);
                    }
                });
            }
            // Every run executes the datapath: send doorbells, commands that changed QP states, timers.
            link::pump(&shared);
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

/// Handle to one simulated device. Clones share the device.
#[derive(Debug, Clone)]
pub struct SimDevice {
    shared: Arc<Shared>,
}

impl Default for SimDevice {
    fn default() -> Self {
        Self::new(SimConfig::default())
    }
}

impl SimDevice {
    pub fn new(cfg: SimConfig) -> Self {
        let mode = cfg.mode;
        let state = State {
            regs: Regs::new(&cfg),
            fw: Firmware::new(&cfg),
            dma: DmaSpace::new(cfg.dma_max_contig),
            events: Vec::new(),
            events_dropped: 0,
            executed: Vec::new(),
            faults: Vec::new(),
            pending: Vec::new(),
            stalled: Vec::new(),
            virt_ns: 0,
            start: Instant::now(),
            wire: Wire::new(&cfg),
            dp: DpState::default(),
            cfg,
        };
        let dev = match mode {
            Mode::Inline => {
                Self { shared: Arc::new(Shared { state: Mutex::new(state), send: Mutex::new(()), worker: None }) }
            }
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
                Self { shared }
            }
        };
        // Packets name their source device so responses find their way back.
        lock(&dev.shared).wire.me.port = link::Port::Local(Arc::downgrade(&dev.shared));
        dev
    }

    /// The BAR (initialization segment and UAR pages).
    pub fn mmio(&self) -> SimMmio {
        SimMmio { shared: self.shared.clone() }
    }

    /// The device-visible memory allocator.
    pub fn dma(&self) -> SimDma {
        SimDma { shared: self.shared.clone() }
    }

    /// Time: virtual in inline mode, real sleeps in threaded mode.
    pub fn delay(&self) -> SimDelay {
        SimDelay { shared: self.shared.clone() }
    }

    pub fn config(&self) -> SimConfig {
        lock(&self.shared).cfg.clone()
    }

    /// Adds a fault; faults are checked in the order they were injected.
    pub fn inject(&self, fault: Fault) {
        lock(&self.shared).faults.push(fault);
    }

    pub fn clear_faults(&self) {
        lock(&self.shared).faults.clear();
    }

    /// Completed commands, in completion order.
    pub fn executed(&self) -> Vec<ExecutedCmd> {
        lock(&self.shared).executed.clone()
    }

    /// Everything else the device noticed, in order: the most recent ones once there were more than
    /// [`EVENT_LOG_MAX`] (see [`SimDevice::events_dropped`]).
    pub fn events(&self) -> Vec<SimEvent> {
        lock(&self.shared).events.clone()
    }

    /// Events dropped from the front of the log to keep it bounded.
    pub fn events_dropped(&self) -> u64 {
        lock(&self.shared).events_dropped
    }

    /// Device accesses outside live DMA memory, in order.
    pub fn dma_faults(&self) -> Vec<DmaFault> {
        lock(&self.shared).dma.faults.clone()
    }

    /// Live DMA regions: (count, bytes).
    pub fn dma_outstanding(&self) -> (usize, usize) {
        lock(&self.shared).dma.outstanding()
    }

    /// Pages the driver has given to firmware and not taken back.
    pub fn pages_owned(&self) -> usize {
        lock(&self.shared).fw.pages.owned()
    }

    pub fn hca_state(&self) -> HcaState {
        lock(&self.shared).fw.state
    }

    /// Current device time in nanoseconds (virtual in inline mode).
    pub fn now_ns(&self) -> u64 {
        lock(&self.shared).now_ns()
    }

    /// Advances virtual time and runs due work, exactly as [`SimDelay`] does (inline mode; threaded: sleeps).
    pub fn advance_ns(&self, ns: u64) {
        self.delay().advance(ns);
    }

    /// The string SET_DRIVER_VERSION wrote, if any.
    pub fn driver_version(&self) -> Option<String> {
        lock(&self.shared).fw.port.driver_version.clone()
    }

    /// The `he` byte the host-endianness register was written with (`set_hca_ctrl`), if it was.
    pub fn host_endianness(&self) -> Option<u8> {
        lock(&self.shared).fw.port.host_endianness
    }

    /// The `roce_addr_layout` image SET_ROCE_ADDRESS stored at `index` (all zeros when empty), if in range.
    pub fn roce_address(&self, index: usize) -> Option<[u8; mlx5_core::prm::ifc::roce_addr_layout::SIZE_BYTES]> {
        lock(&self.shared).fw.port.roce_table.get(index).copied()
    }

    /// Live objects: (PDs, UARs, EQs, CQs).
    pub fn object_counts(&self) -> (usize, usize, usize, usize) {
        lock(&self.shared).fw.object_counts()
    }

    /// The state of EQ `eqn`, if it exists.
    pub fn eq_info(&self, eqn: u8) -> Option<EqInfo> {
        lock(&self.shared).fw.eqs.info(eqn)
    }

    /// Makes `len` bytes of memory shared with another system (a UML guest's RAM, see `mlx5-uml-bridge`)
    /// reachable by device DMA at bus address `iova`: that system's driver hands the device its own physical
    /// addresses. `Err(Unreachable)` when the range is empty or overlaps mapped memory.
    ///
    /// # Safety
    /// `cpu..cpu + len` must stay mapped, readable and writable for as long as the device exists.
    pub unsafe fn map_guest_memory(
        &self,
        iova: u64,
        cpu: std::ptr::NonNull<u8>,
        len: usize,
    ) -> Result<(), mlx5_core::hal::DmaError> {
        lock(&self.shared).dma.map_fixed(iova, cpu, len).map(|_| ())
    }

    /// The MSI-X vectors (`eqc.intr`) of the EQ interrupts fired since `*cursor`, an index into the event log the
    /// caller keeps (start at 0); advances it. An interrupt of an EQ destroyed since is dropped.
    pub fn interrupts_since(&self, cursor: &mut usize) -> Vec<u16> {
        let st = lock(&self.shared);
        let from = (*cursor).min(st.events.len());
        *cursor = st.events.len();
        st.events[from..]
            .iter()
            .filter_map(|e| match e {
                SimEvent::EqInterrupt { eqn } => st.fw.eqs.info(*eqn).map(|i| i.intr),
                _ => None,
            })
            .collect()
    }

    /// The commands completed since `*cursor` (an index into the completion log the caller keeps); advances it.
    pub fn executed_since(&self, cursor: &mut usize) -> Vec<ExecutedCmd> {
        let st = lock(&self.shared);
        let from = (*cursor).min(st.executed.len());
        *cursor = st.executed.len();
        st.executed[from..].to_vec()
    }

    /// Live memory keys.
    pub fn mkey_count(&self) -> usize {
        lock(&self.shared).fw.mkey_count()
    }

    /// Changes the largest allocation the DMA allocator grants from now on (`None`: no limit). Bring-up needs
    /// large contiguous chunks (firmware pages, EQs); tests fragment later allocations by setting a limit after it.
    pub fn set_dma_max_contig(&self, max: Option<usize>) {
        lock(&self.shared).dma.max_contig = max;
    }

    /// The state of CQ `cqn`, if it exists.
    pub fn cq_info(&self, cqn: u32) -> Option<CqInfo> {
        lock(&self.shared).cq_info(cqn)
    }

    /// Writes `cqe` (a 64-bit `mlx5_cqe64` image; the owner bit is replaced) as the next CQE of CQ `cqn`, with
    /// the overrun check and the completion event the hardware applies. Returns the CQE's counter value `n` (it
    /// sits at entry `n mod nent`).
    pub fn post_cqe(&self, cqn: u32, cqe: [u8; c_cqe::SIZE]) -> Result<u32, PostCqeError> {
        lock(&self.shared).post_cqe(cqn, &cqe)
    }

    /// CQ `cqn` overruns now, as when a whole ring of completions arrives that its consumer has not polled: the CQ
    /// enters overflow (it takes no more CQEs) and a CQ-error event reports it. Returns whether it did (the CQ
    /// exists, was healthy, and the firmware is alive).
    pub fn overrun_cq(&self, cqn: u32) -> bool {
        let mut st = lock(&self.shared);
        !st.dead() && st.cq_overflow(cqn)
    }

    /// The numbers of the CQs that exist, lowest first.
    pub fn cq_numbers(&self) -> Vec<u32> {
        let mut cqns: Vec<u32> = lock(&self.shared).fw.cqs.iter().map(|(cqn, _)| cqn).collect();
        cqns.sort_unstable();
        cqns
    }

    /// Checks an access of `len` bytes at `va` through memory key `key` (from a PD `pd`, when the access comes
    /// from a QP), and returns the IOVA pieces it covers, split where the translation is not contiguous.
    pub fn mkey_access(
        &self,
        key: u32,
        pd: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<Vec<(u64, u64)>, MkeyFault> {
        lock(&self.shared).mkey_access(key, pd, va, len, access)
    }

    /// Posts an EQE of `event_type` now, to the lowest-numbered EQ subscribed to it. Returns that EQ, or `None`
    /// when no EQ subscribes, the firmware is dead or the EQE could not be posted.
    pub fn post_event(&self, event_type: u8, sub_type: u8, data: [u8; EQE_DATA_LEN]) -> Option<u8> {
        lock(&self.shared).post_eqe(event_type, sub_type, &data)
    }

    /// The port's link goes down (`false`) or comes up (`true`), as a cable pulled or plugged: the port state the
    /// queries report follows and firmware posts a PORT_CHANGE event (sub-type DOWN or ACTIVE). Returns the EQ
    /// the event went to; `None` when the state did not change, no EQ subscribes, or the firmware is dead.
    pub fn set_port_up(&self, up: bool) -> Option<u8> {
        lock(&self.shared).set_port_up(up)
    }

    /// Firmware reports a port change of `sub_type` (`MLX5_PORT_CHANGE_SUBTYPE_LID`, `_PKEY`, `_GUID`,
    /// `_CLIENT_REREG`, ...) on port 1, as a subnet manager's change makes it do. Returns the EQ it went to.
    pub fn port_change(&self, sub_type: u8) -> Option<u8> {
        lock(&self.shared).port_change(sub_type)
    }

    /// Firmware asks for `num_pages` now (positive: its need grows; negative: that many pages become returnable
    /// to the next MANAGE_PAGES(take)). Posted at once if an EQ subscribes to page requests, else held.
    pub fn request_pages(&self, num_pages: i32) {
        lock(&self.shared).page_request(num_pages);
    }

    /// Kills the firmware now with health syndrome `synd` (a `MLX5_INITIAL_SEG_HEALTH_SYNDROME_*`; 0 is a
    /// silent stall). No effect when it is already dead or gone.
    pub fn fail_health(&self, synd: u8) {
        lock(&self.shared).fail(synd);
    }

    /// Kills the firmware now without a syndrome: the heartbeat freezes and commands hang.
    pub fn stall_health(&self) {
        lock(&self.shared).fail(0);
    }

    /// Removes the device from the bus now: reads return all ones, writes and DMA stop.
    pub fn device_gone(&self) {
        lock(&self.shared).vanish();
    }

    /// Alive, dead (with its syndrome) or gone.
    pub fn health(&self) -> Health {
        lock(&self.shared).regs.health
    }

    /// Pages firmware owned when the driver freed them after the firmware died or the device left.
    pub fn pages_abandoned(&self) -> usize {
        lock(&self.shared).fw.pages.abandoned()
    }

    /// The state of QP `qpn`, if it exists.
    pub fn qp_info(&self, qpn: u32) -> Option<QpInfo> {
        lock(&self.shared).fw.qps.get(&qpn).map(|q| q.info())
    }

    /// Live QPs.
    pub fn qp_count(&self) -> usize {
        lock(&self.shared).fw.qps.len()
    }

    /// Joins this device and `peer` with a virtual wire (both directions): packets addressed to the peer's LID
    /// (IB) or GID and MAC (RoCE) reach it. Joining a device to itself changes nothing (loopback needs no wire).
    pub fn connect(&self, peer: &SimDevice) {
        link::connect(&self.shared, &peer.shared);
    }

    /// Listens on `addr` (e.g. `"0.0.0.0:18516"`; port 0 picks one) for a simulated device in another process
    /// to plug into this device's port, as [`SimDevice::connect`] joins two devices of one process. Returns the
    /// address bound. While a peer is plugged in, another is turned away (one port, one cable); one whose port
    /// address equals this device's is turned away ([`SimEvent::LinkDown`]). Use [`Mode::Threaded`] for a
    /// linked device, so its retry timers run in real time.
    pub fn wire_listen(&self, addr: &str) -> Result<std::net::SocketAddr, WireError> {
        link::tcp::listen(&self.shared, addr)
    }

    /// Plugs this device's port into the device listening at `addr` (`host:port`) in another process, retrying
    /// a refused connection with backoff for up to `timeout` (the listener may start later:
    /// [`WireError::NoListener`] once the time is up); the handshake swaps port addresses. Packets to the peer's LID (IB) or
    /// GID and MAC (RoCE) then cross the link; when it goes down they are lost, and RC requests time out.
    pub fn wire_connect(&self, addr: &str, timeout: Duration) -> Result<(), WireError> {
        link::tcp::connect(&self.shared, addr, timeout)
    }

    /// Unplugs the link to another process that [`SimDevice::wire_connect`] or a listener plugged in, if any:
    /// frames already queued go out, then the far end sees the connection close ([`SimEvent::LinkDown`] there)
    /// and this port's link is down. A listener keeps listening. Returns whether a link was plugged in.
    pub fn wire_unplug(&self) -> bool {
        link::tcp::unplug(&self.shared)
    }

    /// Listens on the UNIX socket `path` for a QEMU guest NIC (`-netdev stream,server=off,addr.type=unix,
    /// addr.path=PATH`) and plugs the first connection into this device's port: RoCEv2 frames in QEMU's stream
    /// framing, ARP answered for [`SimConfig::ipv4_addrs`]. Returns once listening. Use [`Mode::Threaded`].
    pub fn guest_listen(&self, path: &std::path::Path) -> std::io::Result<()> {
        link::guest::listen(&self.shared, path)
    }

    /// Plugs this device's port into the guest NIC listening on the UNIX socket `path` (QEMU `server=on`),
    /// retrying for up to `timeout`.
    pub fn guest_connect(&self, path: &std::path::Path, timeout: Duration) -> std::io::Result<()> {
        link::guest::connect(&self.shared, path, timeout)
    }

    /// Whether a guest NIC is plugged in and its link is up.
    pub fn guest_plugged(&self) -> bool {
        lock(&self.shared).wire.guest_link().is_some_and(|l| l.is_up())
    }

    /// Makes the guest link drop the `n`-th RoCE frame it sends from now on (1: the next one): a lost frame,
    /// for retransmission tests. Returns false when no guest link is plugged in.
    pub fn guest_drop_frame(&self, n: u64) -> bool {
        let l = lock(&self.shared).wire.guest_link();
        l.map(|l| l.drop_frame(n)).is_some()
    }

    /// Makes the guest link lose the `n`-th RoCE frame it receives from now on (1: the next one), before the port
    /// sees it. Returns false when no guest link is plugged in.
    pub fn guest_drop_frame_in(&self, n: u64) -> bool {
        let l = lock(&self.shared).wire.guest_link();
        l.map(|l| l.drop_frame_in(n)).is_some()
    }

    /// RoCE frames the guest link put on the cable (counting one dropped on purpose) and took from it (counting
    /// one lost on purpose); `None` when no guest link is plugged in.
    pub fn guest_frames(&self) -> Option<(u64, u64)> {
        lock(&self.shared).wire.guest_link().map(|l| l.frames())
    }

    /// Makes the guest link a slow cable: it writes at most `per_ms` frames a millisecond (0: no limit). Returns
    /// false when no guest link is plugged in.
    pub fn guest_pace(&self, per_ms: u64) -> bool {
        let l = lock(&self.shared).wire.guest_link();
        l.map(|l| l.set_pace(per_ms)).is_some()
    }

    /// The most frames the guest link held queued for its writer at once; `None` when no guest link is plugged
    /// in.
    pub fn guest_backlog_peak(&self) -> Option<u64> {
        lock(&self.shared).wire.guest_link().map(|l| l.backlog_peak())
    }

    /// Frames the RoCE port received and accepted (every check passed), from links and from devices of this
    /// process.
    pub fn frames_received(&self) -> u64 {
        lock(&self.shared).wire.frames_in
    }

    /// Frames the RoCE port dropped from its links, per reason.
    pub fn frame_drops(&self) -> roce::frame::DropCounters {
        lock(&self.shared).wire.drops
    }

    /// Waits until a peer in another process is plugged in (true) or `timeout` passes (false).
    pub fn wire_wait_peer(&self, timeout: Duration) -> bool {
        link::tcp::wait_peer(&self.shared, timeout)
    }

    /// The socket address of the peer plugged into this device's link, while the link is up.
    pub fn wire_peer(&self) -> Option<std::net::SocketAddr> {
        lock(&self.shared).wire.remote_link().filter(|l| l.is_up()).map(|l| l.peer)
    }

    /// GID table entry `index` of port 1: index 0 is the default GID (IB: fe80::/64 + port GUID; RoCE: the
    /// IPv6 link-local address of the port MAC, modified EUI-64). No other entry is populated.
    pub fn gid(&self, index: u32) -> Option<[u8; 16]> {
        lock(&self.shared).wire.addr.gid(index)
    }

    /// The port LID (0 on Ethernet).
    pub fn lid(&self) -> u16 {
        lock(&self.shared).wire.addr.lid
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Harness;
    use mlx5_core::hal::{Dma, Mmio};
    use mlx5_core::prm::{c, consts, ifc, MsgBuf};

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

    const HEALTH_COUNTER: usize = c::mlx5_init_seg::HEALTH_COUNTER.off;

    /// The 64-byte health buffer as the driver reads it (big-endian dwords).
    fn health_buffer(m: &SimMmio) -> [u8; c::health_buffer::SIZE] {
        let mut hb = [0u8; c::health_buffer::SIZE];
        for (k, w) in hb.chunks_mut(4).enumerate() {
            w.copy_from_slice(&m.read32(c::mlx5_init_seg::HEALTH.off + 4 * k).to_be_bytes());
        }
        hb
    }

    fn input(opcode: u16, len: usize) -> Vec<u8> {
        let mut inp = vec![0u8; len];
        inp.set(ifc::mbox_in::OPCODE, opcode.into());
        inp
    }

    /// Frees every region the harness handed out (queue and pages); mailboxes are released by the caller.
    fn free_all(h: &mut Harness) {
        for r in h.page_regions.drain(..) {
            // SAFETY: the region came from this allocator; the device is dead or gone and never touches it again.
            unsafe { h.dma.free(r) };
        }
        // SAFETY: every caller is done with the queue page: nothing reads `h.q` after this.
        let q = unsafe { std::mem::ManuallyDrop::take(&mut h.q) };
        // SAFETY: as above, for the command queue page.
        unsafe { h.dma.free(q) };
    }

    #[test]
    fn fault_opcode_covers_every_variant() {
        let faults = [
            Fault::Status { opcode: 1, status: 0, syndrome: 0, times: 0 },
            Fault::Hang { opcode: 1 },
            Fault::Delay { opcode: 1, ms: 0 },
            Fault::Delivery { opcode: 1, status: 0 },
            Fault::CorruptOutput { opcode: 1, offset: 0, value: 0 },
            Fault::PageRequest { opcode: 1, num_pages: -1 },
            Fault::NeedPages { opcode: 1, pages: 1 },
            Fault::Fatal { opcode: 1, synd: 1 },
            Fault::Stall { opcode: 1 },
            Fault::DeviceGone { opcode: 1 },
        ];
        assert!(faults.iter().all(|f| f.opcode() == 1));
    }

    #[test]
    fn fatal_fault_kills_the_firmware() {
        let mut h = Harness::inline();
        h.bring_up();
        let synd = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_HW_FATAL_ERR;
        h.dev.inject(Fault::Fatal { opcode: consts::MLX5_CMD_OP_ALLOC_PD, synd });
        assert_eq!(health_buffer(&h.mmio), [0u8; c::health_buffer::SIZE]);
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ALLOC_PD, 16), 16);
        h.ring(0);
        assert_eq!(h.status_own(0) & 1, 1);
        assert_eq!(h.dev.health(), Health::Failed { synd });
        assert!(h.dev.events().contains(&SimEvent::HealthFailure { synd }));
        let hb = health_buffer(&h.mmio);
        assert_eq!(hb[c::health_buffer::SYND.off], synd);
        let ext = c::health_buffer::EXT_SYND.off;
        assert_eq!(u16::from_be_bytes([hb[ext], hb[ext + 1]]), syndrome::HEALTH_EXT_SYND);
        let sev = hb[c::health_buffer::RFR_SEVERITY.off];
        assert_ne!(sev & consts::MLX5_SEVERITY_VALID_MASK, 0);
        assert_eq!(sev & consts::MLX5_SEVERITY_MASK, 2);
        assert_eq!(sev >> consts::MLX5_RFR_BIT_OFFSET, 1, "firmware asks for the recovery flow");
        // The heartbeat is frozen.
        let beat = h.mmio.read32(HEALTH_COUNTER);
        h.dev.advance_ns(50_000_000);
        assert_eq!(h.mmio.read32(HEALTH_COUNTER), beat);
        // Nothing completes any more, on any slot, however long the driver waits.
        let q = h.post(1, &input(consts::MLX5_CMD_OP_QUERY_ISSI, 16), ifc::query_issi_out::SIZE_BYTES);
        h.ring(1);
        h.dev.advance_ns(120_000_000_000);
        assert_eq!((h.status_own(0) & 1, h.status_own(1) & 1), (1, 1));
        assert!(h.dev.events().contains(&SimEvent::DoorbellWhileDead { slot: 1 }));
        // The last command that ran is bring-up's last: SET_ROCE_ADDRESS of the default GID on this RoCE port.
        assert_eq!(h.dev.executed().last().unwrap().opcode, consts::MLX5_CMD_OP_SET_ROCE_ADDRESS);
        // No more EQEs either, and another failure changes nothing.
        h.dev.request_pages(5);
        assert_eq!(h.dev.post_event(0, 0, [0; EQE_DATA_LEN]), None);
        h.dev.fail_health(1);
        assert_eq!(h.dev.health(), Health::Failed { synd });
        // The driver can still return all its memory; firmware's pages are abandoned, not freed under it.
        h.release(p);
        h.release(q);
        free_all(&mut h);
        assert_eq!(h.dev.dma_outstanding(), (0, 0));
        assert_eq!(h.dev.pages_abandoned(), 8 + 16);
        assert_eq!(h.dev.pages_owned(), 0);
        assert!(!h.dev.events().iter().any(|e| matches!(e, SimEvent::FreedDeviceOwned { .. })));
    }

    #[test]
    fn the_event_log_keeps_the_most_recent_events_only() {
        let dev = SimDevice::new(SimConfig::default());
        let m = dev.mmio();
        // A UAR write before bring-up is ignored and logged: one event per write.
        let other = SimMmio::uar_offset(0) + consts::MLX5_BF_OFFSET as usize;
        let writes = 2 * EVENT_LOG_MAX + 100;
        for i in 0..writes {
            m.write32(other, i as u32);
        }
        let ev = dev.events();
        assert!(ev.len() <= 2 * EVENT_LOG_MAX && dev.events_dropped() > 0, "{} kept", ev.len());
        assert_eq!(ev.len() as u64 + dev.events_dropped(), writes as u64, "one event per write, none lost silently");
        assert_eq!(ev.last(), Some(&SimEvent::IgnoredWrite { off: other, val: (writes - 1) as u32 }));
    }

    #[test]
    fn stall_fault_only_freezes_the_heartbeat() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Stall { opcode: consts::MLX5_CMD_OP_ENABLE_HCA });
        h.dev.advance_ns(3_000_000);
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ENABLE_HCA, 16), 16);
        h.ring(0);
        assert_eq!(h.status_own(0) & 1, 1);
        assert_eq!(h.dev.health(), Health::Failed { synd: 0 });
        assert!(h.dev.events().contains(&SimEvent::HealthFailure { synd: 0 }));
        assert_eq!(health_buffer(&h.mmio), [0u8; c::health_buffer::SIZE]);
        assert_eq!(h.mmio.read32(HEALTH_COUNTER), 3);
        h.dev.advance_ns(10_000_000);
        assert_eq!(h.mmio.read32(HEALTH_COUNTER), 3);
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
        h.release(p);
    }

    #[test]
    fn commands_delayed_before_a_stall_never_complete() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Delay { opcode: consts::MLX5_CMD_OP_ENABLE_HCA, ms: 10 });
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ENABLE_HCA, 16), 16);
        h.ring(0);
        h.dev.stall_health();
        h.dev.advance_ns(20_000_000);
        assert_eq!(h.status_own(0) & 1, 1);
        assert!(h.dev.executed().is_empty());
        h.release(p);
    }

    #[test]
    fn device_gone_reads_all_ones_and_never_touches_memory() {
        let mut h = Harness::inline();
        assert_eq!(h.enable_hca(), 0);
        assert_eq!(h.give_pages(8), (0, 0));
        h.dev.inject(Fault::DeviceGone { opcode: consts::MLX5_CMD_OP_QUERY_PAGES });
        let mut inp = input(consts::MLX5_CMD_OP_QUERY_PAGES, ifc::query_pages_in::SIZE_BYTES);
        inp.set(ifc::query_pages_in::OP_MOD, consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES.into());
        let p = h.post(0, &inp, ifc::query_pages_out::SIZE_BYTES);
        h.ring(0);
        assert_eq!(h.dev.health(), Health::Gone);
        assert!(h.dev.events().contains(&SimEvent::DeviceGone));
        let uar = SimMmio::uar_offset(3);
        for off in [0, c::mlx5_init_seg::HEALTH.off, HEALTH_COUNTER, c::mlx5_init_seg::INITIALIZING.off, uar] {
            assert_eq!(h.mmio.read32(off), u32::MAX, "offset {off:#x}");
        }
        assert_eq!(h.mmio.read64(0), u64::MAX);
        // Writes (a doorbell included) are ignored, and the entry stays as the driver left it.
        h.ring(0);
        assert!(h.dev.events().contains(&SimEvent::WriteWhileGone { off: c::mlx5_init_seg::CMD_DBELL.off, val: 1 }));
        assert_eq!(h.status_own(0), consts::CMD_OWNER_HW);
        h.dev.device_gone();
        assert_eq!(h.dev.events().iter().filter(|e| **e == SimEvent::DeviceGone).count(), 1);
        h.release(p);
        free_all(&mut h);
        assert_eq!(h.dev.dma_outstanding(), (0, 0));
        assert_eq!(h.dev.pages_abandoned(), 8);
        assert!(h.dev.dma_faults().is_empty());
    }

    #[test]
    fn stalled_command_is_never_released_by_a_dead_firmware() {
        let mut h = Harness::inline();
        h.bring_up();
        h.dev.inject(Fault::NeedPages { opcode: consts::MLX5_CMD_OP_ALLOC_PD, pages: 1 });
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ALLOC_PD, 16), 16);
        h.ring(0);
        h.dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR);
        let inp = h.give_input(1);
        let g = h.post(31, &inp, 16);
        h.ring(31);
        assert_eq!((h.status_own(0) & 1, h.status_own(31) & 1), (1, 1));
        h.release(p);
        h.release(g);
        free_all(&mut h);
        assert_eq!(h.dev.dma_outstanding(), (0, 0));
    }

    #[test]
    fn an_injected_overrun_puts_the_cq_in_overflow_and_reports_it_once() {
        let mut r = crate::testutil::Rdma::inline();
        let (a, b) = (r.cq(4), r.cq(4));
        assert_eq!(r.h.dev.cq_numbers(), [a.cqn, b.cqn]);
        assert!(r.h.dev.overrun_cq(b.cqn));
        let info = r.h.dev.cq_info(b.cqn).unwrap();
        assert_eq!(info.status, consts::MLX5_CQC_STATUS_CQ_OVERFLOW);
        assert_eq!(r.h.dev.cq_info(a.cqn).unwrap().status, consts::MLX5_CQC_STATUS_OK);
        // (The CQ-error EQE goes to an EQ that subscribes; this harness has none, the verbs tests see it.)
        let overruns = |ev: Vec<SimEvent>| ev.iter().filter(|e| matches!(e, SimEvent::CqOverrun { .. })).count();
        assert_eq!(overruns(r.h.dev.events()), 1);
        // Already in error, or no such CQ: nothing more happens.
        assert!(!r.h.dev.overrun_cq(b.cqn));
        assert!(!r.h.dev.overrun_cq(0xff_ffff));
        assert_eq!(overruns(r.h.dev.events()), 1);
    }
}

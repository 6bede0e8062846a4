//! The device's state and the hand-off types the device layer's files share: [`Device`] (everything behind the
//! lock), [`Shared`] (the lock and the hand-off to the device thread), [`lock`], and the queued commands.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::config::SimConfig;
use crate::dma::DmaSpace;
use crate::events::{ExecutedCmd, SimEvent};
use crate::fault::Fault;
use crate::fw::Firmware;
use crate::link::Wire;
use crate::regs::{self, Clock, Regs};
use crate::transport::DpState;

#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) due_ns: u64,
    pub(crate) slot: u8,
}

/// A command held by [`Fault::NeedPages`] until `remaining` more pages are given.
#[derive(Debug)]
pub(crate) struct Stalled {
    pub(crate) slot: u8,
    pub(crate) opcode: u16,
    pub(crate) remaining: u64,
}

/// Everything behind the device lock.
#[derive(Debug)]
pub(crate) struct Device {
    pub(crate) cfg: SimConfig,
    pub(crate) dma: DmaSpace,
    pub(crate) fw: Firmware,
    pub(crate) regs: Regs,
    pub(crate) events: Vec<SimEvent>,
    /// Events dropped from the front of `events` to keep it bounded ([`EVENT_LOG_MAX`]).
    pub(crate) events_dropped: u64,
    pub(crate) executed: Vec<ExecutedCmd>,
    /// Commands with their messages, when the configuration records them (taken by the caller; bounded).
    pub(crate) messages: std::collections::VecDeque<crate::events::CmdMessage>,
    pub(crate) faults: Vec<Fault>,
    pub(crate) pending: Vec<Pending>,
    pub(crate) stalled: Vec<Stalled>,
    pub(crate) clock: Clock,
    pub(crate) wire: Wire,
    pub(crate) dp: DpState,
}

/// The most recent events a device keeps: a long-lived device (a ping-pong server, the wire soak's survivor) logs
/// events per completion and would otherwise grow without bound (about 300 bytes per work request were measured).
pub const EVENT_LOG_MAX: usize = 1 << 16;

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
/// next tick (`WORKER_TICK`), not forever: it parks with that timeout.)
#[derive(Debug)]
pub(crate) struct Handoff {
    pub(crate) bells: Mutex<Vec<Bell>>,
    /// Work is waiting: bells, or a run asked for by a delay or a fault.
    pub(crate) kick: AtomicBool,
    /// The device thread is parked, or about to park.
    pub(crate) sleeping: AtomicBool,
    /// The device thread, once spawned.
    pub(crate) thread: OnceLock<std::thread::Thread>,
    /// The UAR pages' BAR range (fixed by the configuration), to tell a doorbell without the device lock.
    pub(crate) uar: std::ops::Range<usize>,
    /// Doorbells posted, and doorbells the device thread has run with the datapath pass after them: what
    /// [`Handoff::settle`] compares.
    pub(crate) posted: AtomicU64,
    pub(crate) done: AtomicU64,
}

impl Handoff {
    pub(crate) fn new(uar: std::ops::Range<usize>) -> Self {
        Self {
            bells: Mutex::new(Vec::with_capacity(64)),
            kick: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            thread: OnceLock::new(),
            uar,
            posted: AtomicU64::new(0),
            done: AtomicU64::new(0),
        }
    }

    /// Whether `off .. off + len` lies in the UAR pages.
    pub(crate) fn in_uar(&self, off: usize, len: usize) -> bool {
        regs::range_holds(&self.uar, off, len)
    }

    /// Posts a doorbell for the device thread.
    pub(crate) fn post(&self, bell: Bell) {
        self.bells.lock().unwrap_or_else(|e| e.into_inner()).push(bell);
        self.posted.fetch_add(1, Ordering::SeqCst);
        self.kick();
    }

    /// Waits (at most `timeout`) until the device thread has run every doorbell posted so far and the datapath
    /// after it, as a NIC takes what was rung. False at the deadline.
    pub(crate) fn settle(&self, timeout: std::time::Duration) -> bool {
        let want = self.posted.load(Ordering::SeqCst);
        let end = std::time::Instant::now() + timeout;
        while self.done.load(Ordering::SeqCst) < want {
            if std::time::Instant::now() >= end {
                return false;
            }
            self.kick();
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }

    /// Asks the device thread to run, waking it if it parks (see the type's comment for why none is lost).
    pub(crate) fn kick(&self) {
        self.kick.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
        }
    }

    pub(crate) fn pending(&self) -> bool {
        self.kick.load(Ordering::SeqCst)
    }
}

/// State shared by every handle.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) state: Mutex<Device>,
    /// Held while this device's datapath runs and its packets are handed on, so they leave in the order they
    /// were produced (`link::pump`). Never held by a thread holding the device lock.
    pub(crate) send: Mutex<()>,
    /// Work for the device thread (threaded mode only).
    pub(crate) worker: Option<Handoff>,
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
pub(crate) fn lock(shared: &Shared) -> MutexGuard<'_, Device> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

//! Event bookkeeping of an HCA: async events waiting for the caller ([`AsyncEvent`], `ibv_get_async_event`), the
//! completion-event state of every CQ (`ibv_get_cq_event` / `ibv_ack_cq_events`, `cq->arm_sn`) and where one EQ
//! drain pass records what the EQEs say (Linux `eq.c` `mlx5_eq_async_int` / `mlx5_eq_comp_int`).

use crate::eq::{EqRing, Event};
use crate::hal::{DelayNs, Dma, Mmio};
use crate::table::Table;
use crate::trace::CmdTrace;
use heapless::Deque;

use super::error::Error;
use super::{EventCounts, Hca, PageStats, Tables};
use crate::cq::Cq;
use crate::cq::Notify;
use crate::eq::{QpErrorKind, QpEventKind};
use crate::prm::consts;

/// The verbs event of a port change (`handle_port_change` in mlx5_ib); `None` for a sub-type verbs has no event
/// for. Linux takes a RoCE port's up and down from its netdev instead; this driver has no netdev, and the port
/// change event reports the same vport state, so it maps them on every link layer.
pub fn port_event(port: u8, sub_type: u8) -> Option<AsyncEvent> {
    Some(match sub_type {
        consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE => AsyncEvent::PortActive { port },
        consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN | consts::MLX5_PORT_CHANGE_SUBTYPE_INITIALIZED => {
            AsyncEvent::PortErr { port }
        }
        consts::MLX5_PORT_CHANGE_SUBTYPE_LID => AsyncEvent::LidChange { port },
        consts::MLX5_PORT_CHANGE_SUBTYPE_PKEY => AsyncEvent::PkeyChange { port },
        consts::MLX5_PORT_CHANGE_SUBTYPE_GUID => AsyncEvent::GidChange { port },
        consts::MLX5_PORT_CHANGE_SUBTYPE_CLIENT_REREG => AsyncEvent::ClientReregister { port },
        _ => return None,
    })
}

/// An affiliated or unaffiliated asynchronous event (`ibv_async_event`), each naming its object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum AsyncEvent {
    /// `IBV_EVENT_CQ_ERR`: the CQ overran (`MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN`) or hit an access error; the
    /// device writes no more completions to it.
    CqError {
        /// The CQ number.
        cqn: u32,
        /// `MLX5_CQ_ERROR_SYNDROME_*`.
        syndrome: u8,
    },
    /// `IBV_EVENT_QP_FATAL` / `_QP_REQ_ERR` / `_QP_ACCESS_ERR`: the device moved the QP to ERR; it flushes the QP's
    /// outstanding work requests.
    QpError {
        /// The QP number.
        qpn: u32,
        /// Which error.
        kind: QpErrorKind,
    },
    /// `IBV_EVENT_COMM_EST`: the RC QP, in RTR, received its first packet (`MLX5_EVENT_TYPE_COMM_EST`).
    CommEst {
        /// The QP number.
        qpn: u32,
    },
    /// `IBV_EVENT_SQ_DRAINED`: the QP, in SQD, has no send WQE outstanding (`MLX5_EVENT_TYPE_SQ_DRAINED`).
    SqDrained {
        /// The QP number.
        qpn: u32,
    },
    /// `IBV_EVENT_PATH_MIG`: the QP now uses its alternate path (`MLX5_EVENT_TYPE_PATH_MIG`).
    PathMig {
        /// The QP number.
        qpn: u32,
    },
    /// `IBV_EVENT_PATH_MIG_ERR`: migrating to the alternate path failed (`MLX5_EVENT_TYPE_PATH_MIG_FAILED`).
    PathMigErr {
        /// The QP number.
        qpn: u32,
    },
    /// `IBV_EVENT_PORT_ACTIVE`: the port came up (`MLX5_PORT_CHANGE_SUBTYPE_ACTIVE`).
    PortActive {
        /// The port.
        port: u8,
    },
    /// `IBV_EVENT_PORT_ERR`: the port went down (`MLX5_PORT_CHANGE_SUBTYPE_DOWN` or `_INITIALIZED`).
    PortErr {
        /// The port.
        port: u8,
    },
    /// `IBV_EVENT_LID_CHANGE` (`MLX5_PORT_CHANGE_SUBTYPE_LID`).
    LidChange {
        /// The port.
        port: u8,
    },
    /// `IBV_EVENT_PKEY_CHANGE` (`MLX5_PORT_CHANGE_SUBTYPE_PKEY`).
    PkeyChange {
        /// The port.
        port: u8,
    },
    /// `IBV_EVENT_GID_CHANGE` (`MLX5_PORT_CHANGE_SUBTYPE_GUID`).
    GidChange {
        /// The port.
        port: u8,
    },
    /// `IBV_EVENT_CLIENT_REREGISTER` (`MLX5_PORT_CHANGE_SUBTYPE_CLIENT_REREG`).
    ClientReregister {
        /// The port.
        port: u8,
    },
    /// `IBV_EVENT_DEVICE_FATAL`: the HCA moved to internal error (health failure, device gone); queued once.
    DeviceFatal,
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`: fewer work requests than the limit set with
    /// [`Hca::modify_srq`](super::Hca::modify_srq) are posted on the SRQ; the limit is 0 again until set anew.
    SrqLimitReached {
        /// The SRQ number.
        srqn: u32,
    },
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`: a QP attached to an SRQ is in ERR and takes no more WQEs from it.
    LastWqeReached {
        /// The QP number.
        qpn: u32,
    },
}

/// Async events waiting for the caller. When more arrive than fit, the oldest are dropped and counted.
#[derive(Debug, Default)]
pub(crate) struct AsyncEvents {
    q: Deque<AsyncEvent, 64>,
    pub(crate) dropped: u32,
}

impl AsyncEvents {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn push(&mut self, e: AsyncEvent) {
        if self.q.is_full() {
            self.q.pop_front();
            self.dropped = self.dropped.saturating_add(1);
        }
        // Cannot fail: room was made above.
        let _ = self.q.push_back(e);
    }
}

/// The completion-event state of one CQ (opaque; a [`Table`] of the HCA's [`Tables`](super::Tables) holds them).
#[derive(Debug, Clone, Copy)]
pub struct CqEntry {
    pub(super) cqn: u32,
    /// Completion events received (`cq->arm_sn`): goes into the next arm so the device can tell a stale arm.
    pub(super) arm_sn: u32,
    /// Events not yet handed out by `get_cq_event`.
    pub(super) pending: u32,
    /// Events handed out and not yet acknowledged.
    pub(super) unacked: u32,
    /// The syndrome of a CQ error event, once one arrived.
    pub(super) error: Option<u8>,
    /// The CQ after this one in the ready list (meaningful while `pending > 0`).
    next_ready: u32,
}

/// Completion-event state of every CQ, in CQ-number order (an EQE's CQ is found by binary search), and the order
/// in which CQs have events to hand out: a list threaded through the entries (`next_ready`), so a CQ sits in it
/// at most once (its count says how many events) and it needs no storage of its own.
#[derive(Debug, Default)]
pub(crate) struct CqEvents<S: Table<CqEntry>> {
    cqs: S,
    /// First and last CQ of the ready list.
    ready: Option<(u32, u32)>,
}

impl<S: Table<CqEntry>> CqEvents<S> {
    pub(crate) fn new() -> Self {
        Self { cqs: S::default(), ready: None }
    }

    fn index(&self, cqn: u32) -> Result<usize, usize> {
        self.cqs.as_slice().binary_search_by_key(&cqn, |e| e.cqn)
    }

    pub(super) fn find(&mut self, cqn: u32) -> Option<&mut CqEntry> {
        let i = self.index(cqn).ok()?;
        self.cqs.as_mut_slice().get_mut(i)
    }

    /// Whether a CQ error event arrived for `cqn`.
    pub(super) fn failed(&self, cqn: u32) -> bool {
        self.index(cqn).is_ok_and(|i| self.cqs.as_slice()[i].error.is_some())
    }

    /// Makes sure one more CQ can be registered (a fixed table has room, a growable one got the memory).
    pub(super) fn has_room(&mut self) -> bool {
        self.cqs.reserve_one()
    }

    /// The most CQs the table can hold (`usize::MAX`: as many as memory allows).
    #[cfg(test)]
    fn capacity() -> usize {
        S::CAPACITY
    }

    /// CQs registered.
    pub(super) fn len(&self) -> usize {
        self.cqs.len()
    }

    pub(super) fn register(&mut self, cqn: u32) -> bool {
        let e = CqEntry { cqn, arm_sn: 0, pending: 0, unacked: 0, error: None, next_ready: 0 };
        match self.index(cqn) {
            // A number firmware handed out again while we still had it: start afresh.
            Ok(i) => {
                self.unlink(cqn);
                self.cqs.as_mut_slice()[i] = e;
                true
            }
            Err(i) => self.cqs.insert(i, e).is_ok(),
        }
    }

    pub(super) fn unregister(&mut self, cqn: u32) {
        self.unlink(cqn);
        if let Ok(i) = self.index(cqn) {
            let _ = self.cqs.remove(i);
        }
    }

    /// Takes `cqn` out of the ready list (a walk: only at destroy time).
    fn unlink(&mut self, cqn: u32) {
        let Some((head, tail)) = self.ready else { return };
        if head == cqn {
            self.ready = if tail == cqn { None } else { self.find(cqn).map(|e| (e.next_ready, tail)) };
            return;
        }
        let mut prev = head;
        while prev != tail {
            let Some(next) = self.find(prev).map(|e| e.next_ready) else { return };
            if next == cqn {
                let after = self.find(cqn).map_or(next, |e| e.next_ready);
                if let Some(p) = self.find(prev) {
                    p.next_ready = after;
                }
                if tail == cqn {
                    self.ready = Some((head, prev));
                }
                return;
            }
            prev = next;
        }
    }

    /// Appends `cqn` (registered, not in the list) to the ready list.
    fn push_ready(&mut self, cqn: u32) {
        match self.ready {
            None => self.ready = Some((cqn, cqn)),
            Some((head, tail)) => {
                if let Some(t) = self.find(tail) {
                    t.next_ready = cqn;
                }
                self.ready = Some((head, cqn));
            }
        }
    }

    /// A completion EQE for `cqn` (`mlx5_eq_comp_int`); `false` when no such CQ exists here.
    pub(crate) fn on_completion(&mut self, cqn: u32) -> bool {
        let Some(e) = self.find(cqn) else { return false };
        e.arm_sn = e.arm_sn.wrapping_add(1);
        e.pending = e.pending.saturating_add(1);
        if e.pending == 1 {
            self.push_ready(cqn);
        }
        true
    }

    pub(crate) fn on_error(&mut self, cqn: u32, syndrome: u8) {
        if let Some(e) = self.find(cqn) {
            e.error = Some(syndrome);
        }
    }

    pub(super) fn get(&mut self) -> Option<u32> {
        let (cqn, tail) = self.ready?;
        let e = self.find(cqn)?;
        let next = e.next_ready;
        e.pending -= 1;
        e.unacked = e.unacked.saturating_add(1);
        let again = e.pending > 0;
        self.ready = if cqn == tail { None } else { Some((next, tail)) };
        if again {
            // Round robin: a CQ with more events goes to the back.
            self.push_ready(cqn);
        }
        Some(cqn)
    }
}

/// Where one drain pass puts what the EQEs say.
pub(super) struct EventSink<'a, C: Table<CqEntry>> {
    pub(super) events: &'a mut EventCounts,
    pub(super) stats: &'a mut PageStats,
    pub(super) cqs: &'a mut CqEvents<C>,
    pub(super) async_events: &'a mut AsyncEvents,
    pub(super) requests: &'a mut [Option<(u16, i32)>; 8],
    pub(super) nreq: usize,
}

impl<C: Table<CqEntry>> EventSink<'_, C> {
    /// Consumes the software-owned EQEs of one ring (at most one ring's worth) and re-arms it.
    pub(super) fn drain_ring<M: Mmio + ?Sized>(&mut self, ring: &mut EqRing, mmio: &M) {
        let mut n = 0u32;
        for _ in 0..ring.nent() {
            let Some(eqe) = ring.next(mmio) else { break };
            n += 1;
            self.handle(eqe.event());
        }
        if n > 0 {
            ring.update_ci(mmio, true);
            self.events.arms += 1;
        }
    }

    fn handle(&mut self, event: Event) {
        let ev = &mut *self.events;
        match event {
            Event::Command { .. } => ev.command += 1,
            Event::PageRequest { function_id, num_pages, .. } => {
                ev.page_request += 1;
                self.stats.page_requests += 1;
                let requests = &mut *self.requests;
                if self.nreq < requests.len() {
                    requests[self.nreq] = Some((function_id, num_pages));
                    self.nreq += 1;
                } else if let Some((_, total)) = requests[self.nreq - 1].as_mut() {
                    // More requests than slots in one pass: fold them (same function in practice).
                    *total = total.saturating_add(num_pages);
                }
            }
            Event::PortChange { port, sub_type } => {
                ev.port_change += 1;
                ev.last_port_change = Some((port, sub_type));
                if let Some(e) = port_event(port, sub_type) {
                    self.async_events.push(e);
                }
            }
            Event::CqError { cqn, syndrome } => {
                ev.cq_error += 1;
                ev.last_cq_error = Some((cqn, syndrome));
                self.cqs.on_error(cqn, syndrome);
                self.async_events.push(AsyncEvent::CqError { cqn, syndrome });
            }
            Event::InternalError => {
                ev.internal_error += 1;
                self.async_events.push(AsyncEvent::DeviceFatal);
            }
            Event::QpError { qpn, kind } => {
                ev.qp_error += 1;
                self.async_events.push(AsyncEvent::QpError { qpn, kind });
            }
            // `mlx5_ib_qp_event`: each affiliated QP event becomes the verbs event of the same name.
            Event::QpEvent { qpn, kind } => {
                ev.qp_event += 1;
                self.async_events.push(match kind {
                    QpEventKind::PathMigrated => AsyncEvent::PathMig { qpn },
                    QpEventKind::CommEst => AsyncEvent::CommEst { qpn },
                    QpEventKind::SqDrained => AsyncEvent::SqDrained { qpn },
                    QpEventKind::PathMigFailed => AsyncEvent::PathMigErr { qpn },
                });
            }
            Event::Completion { cqn } => {
                ev.completion += 1;
                if !self.cqs.on_completion(cqn) {
                    // `mlx5_eq_comp_int`: "Completion event for bogus CQ".
                    ev.bogus_completion += 1;
                }
            }
            Event::Other { .. } => ev.other += 1,
            Event::SrqLimit { srqn } => self.async_events.push(AsyncEvent::SrqLimitReached { srqn }),
            Event::SrqLastWqe { qpn } => self.async_events.push(AsyncEvent::LastWqeReached { qpn }),
        }
    }
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    /// Requests a completion event (`ibv_req_notify_cq`): for the next completion, or the next solicited one.
    pub fn req_notify_cq(&mut self, cq: &Cq, notify: Notify) -> Result<(), Error> {
        let cqn = cq.cqn();
        let sn = self.ctx.cqs.find(cqn).ok_or(Error::UnknownCq { cqn })?.arm_sn;
        cq.arm(self.cmdq.mmio(), sn, notify);
        Ok(())
    }

    /// The next completion event (`ibv_get_cq_event`): the CQ number whose armed notification fired. Drains the
    /// EQs first when none is waiting. Each event must be acknowledged with [`Hca::ack_cq_events`].
    pub fn get_cq_event(&mut self, delay: &mut impl DelayNs) -> Result<Option<u32>, Error> {
        if let Some(cqn) = self.ctx.cqs.get() {
            return Ok(Some(cqn));
        }
        self.process_events(delay)?;
        Ok(self.ctx.cqs.get())
    }

    /// Acknowledges `n` events of `cq` taken with [`Hca::get_cq_event`] (`ibv_ack_cq_events`).
    pub fn ack_cq_events(&mut self, cq: &Cq, n: u32) -> Result<(), Error> {
        let cqn = cq.cqn();
        let e = self.ctx.cqs.find(cqn).ok_or(Error::UnknownCq { cqn })?;
        if n > e.unacked {
            return Err(Error::BadSize { what: "events to acknowledge", requested: n.into(), max: e.unacked.into() });
        }
        e.unacked -= n;
        Ok(())
    }

    /// The CQ error event's syndrome, once the device reported one for `cq` (it writes no more CQEs then).
    pub fn cq_error(&mut self, cq: &Cq) -> Option<u8> {
        self.ctx.cqs.find(cq.cqn()).and_then(|e| e.error)
    }

    /// The next asynchronous event (`ibv_get_async_event`); events arrive as the EQs are drained.
    pub fn get_async_event(&mut self) -> Option<AsyncEvent> {
        self.ctx.async_events.q.pop_front()
    }

    /// Async events dropped because the caller did not take them fast enough (the oldest go first).
    pub fn async_events_dropped(&self) -> u32 {
        self.ctx.async_events.dropped
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    #[cfg(test)]
    use crate::table::growable::Grow;

    /// The ready list's next CQs, up to 16.
    fn drain<S: Table<CqEntry>>(t: &mut CqEvents<S>) -> heapless::Vec<u32, 16> {
        core::iter::from_fn(|| t.get()).take(16).collect()
    }

    // Host-only (testlist::HOST_ONLY): the table is std's Vec.
    #[cfg(test)]
    #[test]
    fn a_growable_cq_table_routes_events_for_thousands_of_cqs_in_arrival_order() {
        let mut t = CqEvents::<Grow<CqEntry>>::new();
        // 20,000 CQs, registered out of number order: past the former 256.
        for k in 0..20_000u32 {
            let cqn = (k * 7919) % 20_000 + 1;
            assert!(t.has_room() && t.register(cqn));
        }
        assert_eq!(CqEvents::<Grow<CqEntry>>::capacity(), usize::MAX);
        assert!(!t.on_completion(20_001), "a CQ it does not have");
        for cqn in [15_000, 3, 20_000, 3, 1, 3] {
            assert!(t.on_completion(cqn));
        }
        // Each CQ once per turn, in the order its first event came; one with more goes to the back.
        assert_eq!(drain(&mut t), [15_000, 3, 20_000, 1, 3, 3]);
        assert_eq!(t.find(3).map(|e| (e.arm_sn, e.unacked)), Some((3, 3)));
    }

    #[test]
    fn a_destroyed_cq_leaves_the_ready_list_wherever_it_stood() {
        for gone in [10, 20, 30] {
            let mut t = CqEvents::<heapless::Vec<CqEntry, 4>>::new();
            for cqn in [10, 20, 30] {
                assert!(t.register(cqn));
            }
            assert!(t.register(40) && !t.has_room(), "a fixed table is full at its capacity");
            for cqn in [10, 20, 30, 20] {
                t.on_completion(cqn);
            }
            t.unregister(gone);
            let want: heapless::Vec<u32, 16> = [10, 20, 30, 20].into_iter().filter(|&c| c != gone).collect();
            assert_eq!(drain(&mut t), want, "without {gone}");
            assert!(t.find(gone).is_none() && !t.on_completion(gone));
            // The list still takes new entries at its end.
            t.on_completion(40);
            t.on_completion(10);
            assert_eq!(&drain(&mut t)[..], if gone == 10 { &[40][..] } else { &[40, 10][..] });
        }
    }
}

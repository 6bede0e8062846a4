//! Firmware side: `fw/qp.rs` (the QP table, its state and counters).
//!
//! The RC requester: a send WQE becomes a request in flight (its PSNs, the ACK and RNR timers, retries and
//! their counts) until a response (ACK, READ data, atomic original value, NAK) completes it (IBA 9.7, the
//! requester side). Requests are pipelined: up to `MAX_IN_FLIGHT` messages are sent before the first is
//! acknowledged (SENDs and WRITEs while they hold less than `MAX_IN_FLIGHT_BYTES`, READs and atomics up to the
//! QP's initiator depth `1 << log_sra_max`); responses complete them in order (an ACK, a NAK, a READ response
//! or an atomic ACK acknowledges every SEND and WRITE before the PSN it names; a READ or an atomic only its own
//! response completes), and a sequence NAK, an RNR NAK, a lost READ response or atomic ACK, or a timeout sends
//! every one not acknowledged again (go-back-N), the oldest from its first missing packet; the responder
//! answers a resent atomic from the results it keeps (`ATOMIC_REPLAY`). A fenced WQE waits until no READ or
//! atomic is in flight.
//!
//! On a link, a message goes out in packets (frames) as a ConnectX sends it: at most `MAX_PACKETS_IN_FLIGHT`
//! of the QP's request packets are on the wire and not acknowledged, AckReq rides every
//! `1 << log_ack_req_freq` packets of a message and on its last, and each ACK of some of them (the responder
//! answers every AckReq, an ACK covering all before it) lets as many more out, restarts the ACK timer (which so
//! measures time without progress, never a message's length) and moves the point a retransmission starts from.

use super::common::*;
use super::cqe::{Completions, Cqs};
use super::keys::Keys;
use super::wqe::{Kind, SendWqe, Wqes};
use crate::fw::caps::Caps;
use crate::fw::cq::CqTable;
use crate::fw::eq::EqTable;
use crate::fw::mkey::MkeyTable;
use crate::fw::port::PortModel;
use crate::fw::qp::QpTable;
use crate::fw::srq::SrqTable;
use crate::link::DevRef;

/// The send side's view of the device (RC here, and the send halves of `uc.rs` and `ud.rs`): the QPs and what
/// completing their WQEs touches, the memory keys, the wire, the GID table and the request sequence numbers.
/// Built per call from a `Datapath` (`Datapath::requester`); the receive side's reads in reassembly are only
/// read, to resume a READ.
pub(super) struct Requester<'a> {
    pub(super) qps: &'a mut QpTable,
    pub(super) srqs: &'a mut SrqTable,
    pub(super) cqs: &'a mut CqTable,
    pub(super) eqs: &'a mut EqTable,
    pub(super) mkeys: &'a mut MkeyTable,
    pub(super) caps: &'a Caps,
    pub(super) port: &'a PortModel,
    pub(super) dma: &'a mut DmaSpace,
    pub(super) inline: &'a mut Vec<u8>,
    pub(super) events: &'a mut Vec<SimEvent>,
    pub(super) wire: &'a mut Wire,
    pub(super) regs: &'a mut Regs,
    pub(super) clock: &'a Clock,
    pub(super) next_seq: &'a mut u64,
    pub(super) rx: &'a RoceRx,
}

impl Requester<'_> {
    /// Device time.
    #[inline]
    fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The view an access through memory keys takes (see `keys.rs`).
    #[inline]
    pub(super) fn keys(&mut self) -> Keys<'_> {
        Keys { mkeys: &*self.mkeys, dma: self.dma, inline: self.inline, qpn: None }
    }

    /// The view completing work requests takes (see `cqe.rs`, `flush.rs`).
    #[inline]
    pub(super) fn completions(&mut self) -> Completions<'_> {
        let eq = EqPost { eqs: self.eqs, dma: self.dma, events: self.events, regs: self.regs, clock: self.clock };
        Completions { qps: self.qps, srqs: self.srqs, cq: Cqs { cqs: self.cqs, caps: self.caps, eq } }
    }

    /// The view reading send WQEs takes (see `wqe.rs`).
    #[inline]
    fn wqes(&mut self) -> Wqes<'_> {
        Wqes { qps: self.qps, srqs: self.srqs, dma: self.dma, inline: self.inline, events: self.events }
    }

    /// The source GID a packet carries for GID table `index`: on RoCE the entry SET_ROCE_ADDRESS programmed, on
    /// InfiniBand the port's default GID.
    pub(super) fn source_gid(&self, index: u32) -> Option<[u8; 16]> {
        if self.wire.addr.ib {
            self.wire.addr.gid(index)
        } else {
            self.port.roce_gid(index)
        }
    }

    /// The device `d` names: [`Wire::route`], and this port for its own MAC with a GID of the RoCE GID table the
    /// driver programmed (SET_ROCE_ADDRESS: the netdev's IP addresses, which the wire's configured addresses do
    /// not list). A UD or RC packet from one QP to another of the same port by its IPv4 GID, as rdma_cm's and
    /// rdma-core's tests send on one port, found no destination before.
    pub(super) fn route(&self, d: &Dest) -> Result<DevRef, &'static str> {
        match *d {
            Dest::Gid { gid, mac } if mac == self.wire.addr.mac && self.port.holds_roce_gid(&gid) => {
                Ok(self.wire.me_here())
            }
            _ => self.wire.route(d),
        }
    }

    /// Sends an RC WQE as a new request in flight. False (nothing done) when it would fail locally while other
    /// requests are in flight: its error CQE must come after their completions, so it waits for them.
    #[inline]
    pub(super) fn execute_rc(&mut self, qpn: u32, w: &SendWqe) -> bool {
        let Some(qp) = self.qps.get(&qpn) else { return true };
        let (pd, retry_count, rnr_retry, max_msg, idle) =
            (qp.pd, qp.retry_count, qp.rnr_retry, qp.max_msg, qp.reqs.is_empty());
        let fail = |st: &mut Requester, s: u8| {
            if idle {
                st.completions().send_error(qpn, w.index, w.opcode, w.nbb, s);
            }
            idle
        };
        let op = match w.kind {
            Kind::Send | Kind::Write { .. } => {
                let data = match self.keys().gather_payload(pd, max_msg, w) {
                    Ok(data) => data,
                    Err(s) => return fail(self, s),
                };
                match w.kind {
                    Kind::Write { raddr, rkey } => RcOp::Write { raddr, rkey, data, imm: w.imm },
                    _ => RcOp::Send { data, imm: w.imm, inv: w.invalidate },
                }
            }
            Kind::Read { raddr, rkey } => match self.keys().check_scatter(pd, &w.segs) {
                Ok(len) => RcOp::Read { raddr, rkey, len },
                Err(s) => return fail(self, s),
            },
            Kind::Atomic { raddr, rkey, op } => match self.keys().check_scatter(pd, &w.segs) {
                Ok(len) if len >= 8 => RcOp::Atomic { raddr, rkey, op },
                Ok(_) => return fail(self, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR),
                Err(s) => return fail(self, s),
            },
            Kind::Nop => {
                self.completions().complete_send(qpn, w.id(), 0);
                return true;
            }
            // Only the UMR QP parses UMR WQEs, and it is no RC QP.
            Kind::Umr { .. } => return fail(self, consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR),
            // `execute` runs window UMRs before this.
            Kind::Window(_) => return true,
        };
        let len = match &op {
            RcOp::Send { data, .. } | RcOp::Write { data, .. } => data.len() as u64,
            RcOp::Read { len, .. } => *len,
            RcOp::Atomic { .. } => 8,
        };
        if len > max_msg {
            return fail(self, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        }
        let seq = *self.next_seq;
        *self.next_seq += 1;
        let sent_ns = self.now_ns();
        let sges = if matches!(w.kind, Kind::Read { .. } | Kind::Atomic { .. }) { w.sges() } else { Sges::new() };
        let solicited = w.solicited;
        let Some(qp) = self.qps.get_mut(&qpn) else { return true };
        // The message takes its PSNs now: the next one sent starts after them.
        let psn = qp.next_send_psn;
        qp.next_send_psn = psn.wrapping_add(packets(len, qp.mtu)) & PSN_MASK;
        qp.reqs.push_back(Outstanding {
            wqe: w.id(),
            psn,
            sges,
            op,
            len,
            seq,
            phase: Phase::InFlight { sent_ns },
            transport_left: retry_count,
            rnr_left: rnr_retry,
            solicited,
            resume: 0,
            sent: 0,
            whole: false,
            xrc_srqn: w.xrc_srqn,
        });
        self.send_window(qpn);
        true
    }

    /// Sends the packets of the requests in flight of `qpn` the window has room for, oldest first: at most
    /// `MAX_PACKETS_IN_FLIGHT` on the wire and not acknowledged. Returns whether it sent any.
    pub(super) fn send_window(&mut self, qpn: u32) -> bool {
        // The first request with packets to send (usually the newest) and where it resumes.
        let next_after = |reqs: &std::collections::VecDeque<Outstanding>, at: usize, mtu: u8| {
            reqs.iter().enumerate().skip(at).find_map(|(j, r)| {
                let (total, from) = (r.packets(mtu), r.sent.max(r.acked()));
                (from < total).then_some((j, total, from))
            })
        };
        let Some(qp) = self.qps.get(&qpn) else { return false };
        let (mtu, was_blocked) = (qp.mtu, qp.window_blocked);
        let out: u32 = qp.reqs.iter().map(|r| r.unacked()).sum();
        let mut room = MAX_PACKETS_IN_FLIGHT.saturating_sub(out);
        let mut next = next_after(&qp.reqs, 0, mtu);
        let mut any = false;
        while let Some((j, total, from)) = next {
            if room == 0 {
                break;
            }
            let (reached, framed) = self.transmit(qpn, j, from, (total - from).min(room));
            room = room.saturating_sub(if framed { reached.saturating_sub(from) } else { 1 });
            any = true;
            let Some(qp) = self.qps.get_mut(&qpn) else { return any };
            if let Some(r) = qp.reqs.get_mut(j) {
                (r.sent, r.whole) = (reached, !framed);
            }
            next = if reached < total { Some((j, total, reached)) } else { next_after(&qp.reqs, j + 1, mtu) };
            if next.is_none() {
                qp.window_blocked = false;
                return any;
            }
        }
        // Packets held back until ACKs make room (or, with nothing to send, no longer).
        if next.is_some() != was_blocked {
            if let Some(qp) = self.qps.get_mut(&qpn) {
                qp.window_blocked = next.is_some();
            }
        }
        any
    }

    /// Puts `count` packets from packet `from` of request `j` in flight of `qpn` (0 is the oldest) on the wire,
    /// along the QP's primary path. Returns the packet it reached (the message's end when it crosses whole: to
    /// this device, on InfiniBand, or lost) and whether it went as frames.
    pub(super) fn transmit(&mut self, qpn: u32, j: usize, from: u32, count: u32) -> (u32, bool) {
        let Some(qp) = self.qps.get(&qpn) else { return (from, false) };
        let Some(req) = qp.reqs.get(j) else { return (from, false) };
        let total = req.packets(qp.mtu);
        let path = &qp.route;
        let addr = &self.wire.addr;
        let me = self.wire.me_here();
        let grh = (path.grh || !addr.ib).then(|| self.source_gid(path.src_addr_index)).flatten().map(|sgid| Grh {
            sgid,
            dgid: path.rgid,
            tclass: path.tclass,
            flow_label: path.flow_label,
            hop_limit: path.hop_limit,
        });
        let dest = if addr.ib { Dest::Lid(path.rlid) } else { Dest::Gid { gid: path.rgid, mac: path.rmac } };
        let body = Body::Rc {
            seq: req.seq,
            psn: req.psn,
            op: req.op.clone(),
            solicited: req.solicited,
            xrc_srqn: req.xrc_srqn,
        };
        let (remote, seq) = (qp.remote_qpn, req.seq);
        let data = matches!(req.op, RcOp::Send { .. } | RcOp::Write { .. });
        let ack_every = 1 << qp.log_ack_req_freq.min(LOG_ACK_REQ_MAX);
        let mut roce = RoceInfo { mtu: qp.mtu, udp_sport: path.udp_sport, ack_every, ..RoceInfo::default() };
        let (mut reached, mut framed) = (total, false);
        let p = match self.route(&dest) {
            Ok(dst) => {
                // Only frames can start inside a message: a packet to this device or on an IB port is the whole
                // message. A READ is asked again from the response packet `resume`.
                framed = !addr.ib && dst.id != me.id;
                if framed {
                    if data {
                        (roce.resume, roce.count, reached) = (from, count, from.saturating_add(count).min(total));
                    } else {
                        roce.resume = req.resume;
                    }
                }
                Packet { src: me, dst, src_qpn: qpn, dst_qpn: remote, slid: addr.lid, sl: path.sl, grh, body, roce }
            }
            // Nothing answers: the ACK timer runs out.
            Err(why) => Packet {
                src: me.clone(),
                dst: me,
                src_qpn: remote,
                dst_qpn: qpn,
                slid: 0,
                sl: 0,
                grh: None,
                body: Body::Resp { seq, resp: Resp::Lost(why) },
                roce: RoceInfo::default(),
            },
        };
        self.wire.send(p);
        (reached, framed)
    }

    /// Retries the requests in flight of `qpn` if the oldest one's timer has expired (the RNR or retry wait, or
    /// the ACK timer of a request nothing answered): go-back-N, every one of them is sent again, the oldest from
    /// the packet the responder is known to lack.
    pub(super) fn retry_due(&mut self, qpn: u32, now: u64) -> bool {
        // Most runs find the oldest request in flight and its ACK timer running: nothing to look up.
        if let Some(qp) = self.qps.get(&qpn) {
            let ack_ns = ack_timeout_ns(qp.route.ack_timeout);
            if let Some(Phase::InFlight { sent_ns }) = qp.reqs.front().map(|r| r.phase) {
                if now.saturating_sub(sent_ns) < ack_ns {
                    return false;
                }
            }
        }
        // A READ is asked again after the response packets already taken.
        let read_taken = self.qps.get(&qpn).and_then(|q| q.reqs.front()).map_or(0, |r| self.rx.read_taken(qpn, r.psn));
        let Some(qp) = self.qps.get_mut(&qpn) else { return false };
        let ack_ns = ack_timeout_ns(qp.route.ack_timeout);
        let Some(req) = qp.reqs.front_mut() else { return false };
        let kind = match req.phase {
            Phase::Wait { at_ns, kind } if at_ns <= now => kind,
            Phase::InFlight { sent_ns } if now.saturating_sub(sent_ns) >= ack_ns => {
                let (index, opcode, nbb) = (req.wqe.index, req.wqe.opcode, req.wqe.nbb);
                let why = "no response before the ACK timeout";
                self.events.push(SimEvent::Unreachable { qpn, wqe_counter: index, why });
                if req.transport_left == 0 {
                    self.completions().send_error(
                        qpn,
                        index,
                        opcode,
                        nbb,
                        consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR,
                    );
                    return true;
                }
                req.transport_left -= 1;
                // After a timeout, a sequence NAK may start a retransmission again.
                qp.retrying = false;
                RetryKind::Transport
            }
            _ => return false,
        };
        let Some(req) = qp.reqs.front_mut() else { return false };
        if matches!(req.op, RcOp::Read { .. }) {
            req.resume = read_taken;
        }
        let wqe_counter = req.wqe.index;
        // Go-back-N: every request is sent again, the oldest from the first packet the responder lacks, as the
        // window lets them out.
        for r in qp.reqs.iter_mut() {
            r.seq = *self.next_seq;
            r.phase = Phase::InFlight { sent_ns: now };
            r.sent = 0;
            *self.next_seq += 1;
        }
        self.events.push(SimEvent::Retry { qpn, wqe_counter, kind });
        self.send_window(qpn);
        true
    }

    /// The `i` oldest requests in flight of `qpn` completed, acknowledged by a response to a later one (IBA
    /// 9.7.5.1.2: an ACK, a NAK or a READ response acknowledges every packet before the PSN it names). Stops at
    /// a READ or an atomic, which only its own response completes. Returns how many.
    pub(super) fn ack_before(&mut self, qpn: u32, i: usize) -> usize {
        let mut done = 0;
        while done < i {
            let Some(qp) = self.qps.get_mut(&qpn) else { break };
            if qp.state != QpState::Rts
                || qp.reqs.front().is_none_or(|r| !matches!(r.op, RcOp::Send { .. } | RcOp::Write { .. }))
            {
                break;
            }
            let Some(req) = qp.reqs.pop_front() else { break };
            qp.retrying = false;
            self.finish_rc(qpn, req, Resp::Ack);
            done += 1;
        }
        if done > 0 {
            let now = self.now_ns();
            self.restart_ack_timer(qpn, now);
        }
        done
    }

    /// An ACK of the oldest request's first `k` packets (AckReq inside it, or coalesced): a retransmission starts
    /// after them, the window has room for as many more, and the ACK timer starts again, as it measures time
    /// without progress.
    pub(super) fn ack_packets(&mut self, qpn: u32, k: u32) {
        let Some(r) = self.qps.get_mut(&qpn).and_then(|q| q.reqs.front_mut()) else { return };
        if k <= r.resume {
            return;
        }
        r.resume = k;
        r.sent = r.sent.max(k);
        let now = self.now_ns();
        self.restart_ack_timer(qpn, now);
    }

    /// A READ response packet of the oldest request of `qpn` arrived in order: progress, as an ACK is, so a READ
    /// whose responses take the link longer than the ACK timeout is not asked again while they come.
    pub(super) fn read_progress(&mut self, qpn: u32) {
        let now = self.now_ns();
        self.restart_ack_timer(qpn, now);
    }

    /// Progress restarts the ACK timer of the oldest request of `qpn` left in flight, gives it its retries back
    /// and ends the retransmission under way, so the next sequence NAK may start another (as rdma_rxe's completer
    /// does: every ACK and READ response packet resets its retry counters and its `started_retry`). A long READ
    /// or WRITE whose packets a lossy, reordering wire keeps cutting short then fails only after `retry_count`
    /// attempts in a row without progress, not after that many in all.
    fn restart_ack_timer(&mut self, qpn: u32, now: u64) {
        let Some(q) = self.qps.get_mut(&qpn) else { return };
        q.retrying = false;
        let (retry_count, rnr_retry) = (q.retry_count, q.rnr_retry);
        if let Some(r) = q.reqs.front_mut() {
            if let Phase::InFlight { sent_ns } = &mut r.phase {
                *sent_ns = now.max(*sent_ns);
            }
            r.transport_left = retry_count;
            r.rnr_left = rnr_retry;
        }
    }

    /// A response for the request in flight `seq` of `qpn` (from `src_qpn`).
    #[inline]
    pub(super) fn rc_response(&mut self, qpn: u32, seq: u64, resp: Resp, src_qpn: u32) {
        let now = self.now_ns();
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if qp.st != QpType::Rc || qp.state != QpState::Rts {
            // Reset, or in error: the flush takes care of the WQEs.
            return;
        }
        // While the oldest waits for its retry, every request after it is sent again with it: nothing from
        // their earlier attempts counts.
        if !matches!(qp.reqs.front().map(|r| r.phase), Some(Phase::InFlight { .. })) {
            return;
        }
        let Some(i) = qp.reqs.iter().position(|r| r.seq == seq) else { return };
        let (rnr_retry, ack_timeout) = (qp.rnr_retry, qp.route.ack_timeout);
        // Every response but a sequence NAK names a request the responder reached in order: the ones before it
        // were executed. (A sequence NAK of a frame names its PSN; `roce_rx` acknowledged what it implies.)
        if !matches!(resp, Resp::Nak(Nak::PsnSequence) | Resp::Lost(_)) && i > 0 && self.ack_before(qpn, i) < i {
            return;
        }
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        if matches!(resp, Resp::Ack | Resp::ReadData(_) | Resp::AtomicOrig(_)) {
            qp.retrying = false;
            let Some(req) = qp.reqs.pop_front() else { return };
            self.finish_rc(qpn, req, resp);
            self.restart_ack_timer(qpn, now);
            return;
        }
        let Some(req) = qp.reqs.front_mut() else { return };
        let (index, opcode, nbb) = (req.wqe.index, req.wqe.opcode, req.wqe.nbb);
        let failure = match resp {
            Resp::Ack | Resp::ReadData(_) | Resp::AtomicOrig(_) => None,
            Resp::RnrNak { timer } => {
                self.events.push(SimEvent::RnrNak { qpn, wqe_counter: index, remote_qpn: src_qpn });
                if req.rnr_left == 0 {
                    Some(consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR)
                } else {
                    if rnr_retry != RNR_RETRY_INFINITE {
                        req.rnr_left -= 1;
                    }
                    req.phase = Phase::Wait { at_ns: now.saturating_add(rnr_timer_ns(timer)), kind: RetryKind::Rnr };
                    None
                }
            }
            Resp::Nak(Nak::PsnSequence) => {
                self.events.push(SimEvent::PsnSequenceNak { qpn, wqe_counter: index, remote_qpn: src_qpn });
                if req.transport_left == 0 {
                    Some(consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR)
                } else {
                    // Retransmitted at once (IBA 9.7.5.1.2); the retry counts like a timeout.
                    req.transport_left -= 1;
                    req.phase = Phase::Wait { at_ns: now, kind: RetryKind::Transport };
                    if let Some(qp) = self.qps.get_mut(&qpn) {
                        qp.retrying = true;
                    }
                    None
                }
            }
            Resp::Nak(n) => Some(match n {
                Nak::RemoteAccess => consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR,
                Nak::InvalidRequest => consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR,
                Nak::RemoteOp | Nak::PsnSequence => consts::MLX5_CQE_SYNDROME_REMOTE_OP_ERR,
            }),
            Resp::Lost(why) => {
                self.events.push(SimEvent::Unreachable { qpn, wqe_counter: index, why });
                if req.transport_left == 0 {
                    Some(consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR)
                } else {
                    req.transport_left -= 1;
                    let at_ns = now.saturating_add(ack_timeout_ns(ack_timeout));
                    req.phase = Phase::Wait { at_ns, kind: RetryKind::Transport };
                    None
                }
            }
        };
        if let Some(s) = failure {
            self.completions().send_error(qpn, index, opcode, nbb, s);
        }
    }

    /// The successful end of an RC request: READ data and atomic results land in the local SGEs.
    pub(super) fn finish_rc(&mut self, qpn: u32, req: Outstanding, resp: Resp) {
        let Some(qp) = self.qps.get(&qpn) else { return };
        let pd = qp.pd;
        let w = req.wqe;
        let result = match (&req.op, resp) {
            (RcOp::Read { len, .. }, Resp::ReadData(d)) if d.len() as u64 == *len => {
                self.keys().scatter(pd, &req.sges, &d)
            }
            (RcOp::Atomic { .. }, Resp::AtomicOrig(v)) => {
                let bytes = self.caps.atomic_bytes(v);
                self.keys().scatter(pd, &req.sges, &bytes)
            }
            (RcOp::Send { .. } | RcOp::Write { .. }, Resp::Ack) => Ok(()),
            _ => Err(consts::MLX5_CQE_SYNDROME_BAD_RESP_ERR),
        };
        match result {
            Ok(()) => self.completions().complete_send(qpn, w, req.len),
            Err(s) => self.completions().send_error(qpn, w.index, w.opcode, w.nbb, s),
        }
    }
}

/// The SQ loop: the send side takes WQEs off a QP's SQ in order (moved from the run loop with issue 30's
/// views, so one `Requester` serves a whole step).
impl Requester<'_> {
    /// Executes send WQEs of a QP in RTS until the SQ is empty, the RC window is full, a WQE must wait for the
    /// ones in flight, or the QP fails.
    pub(super) fn sq_progress(&mut self, qpn: u32) -> bool {
        let mut any = false;
        // One WQE, parsed in place: a WQE built apart and then moved is copied right after its fields were
        // written, and the CPU stalls on such a copy (the store buffer cannot forward it), more than the parse.
        let mut w = SendWqe::default();
        // Bounded: every step moves the execution counter, or fails the QP, or stops.
        for _ in 0..=u16::MAX {
            let Some(qp) = self.qps.get(&qpn) else { break };
            if qp.state != QpState::Rts || qp.sq_next == qp.sq_pi || !self.window_open(qpn) {
                break;
            }
            let (index, idle) = (qp.sq_next, qp.reqs.is_empty());
            match self.wqes().fetch_wqe(qpn, &mut w) {
                Ok(()) if !self.admits(qpn, &w) => break,
                Ok(()) => {
                    if let Some(qp) = self.qps.get_mut(&qpn) {
                        qp.sq_next = index.wrapping_add(w.nbb);
                    }
                    if !self.execute(qpn, &w) {
                        // It fails locally: its error CQE waits until those in flight complete.
                        if let Some(qp) = self.qps.get_mut(&qpn) {
                            qp.sq_next = index;
                        }
                        break;
                    }
                }
                // A malformed WQE fails in order too: after the ones in flight.
                Err(_) if !idle => break,
                Err(b) => self.completions().send_error(qpn, index, b.opcode, b.nbb, b.syndrome),
            }
            any = true;
        }
        any
    }

    /// Whether `qpn` may start another WQE now: the window has room (`MAX_IN_FLIGHT`).
    fn window_open(&self, qpn: u32) -> bool {
        self.qps.get(&qpn).is_some_and(|qp| qp.reqs.len() < MAX_IN_FLIGHT)
    }

    /// Whether WQE `w` of `qpn` may start behind the requests in flight: a SEND or WRITE while they hold less
    /// than `MAX_IN_FLIGHT_BYTES`, a READ or an atomic while fewer of them than the QP's initiator depth
    /// (`log_sra_max`) are in flight; a fenced one only once no READ or atomic is. A NOP waits for all of them,
    /// so it completes in order.
    fn admits(&self, qpn: u32, w: &SendWqe) -> bool {
        let Some(qp) = self.qps.get(&qpn) else { return false };
        if qp.reqs.is_empty() {
            return true;
        }
        if !self.window_open(qpn) || matches!(w.kind, Kind::Nop | Kind::Window(_)) {
            return false;
        }
        // One pass: the READs and atomics, and the payload bytes held.
        let (ordered, bytes) = qp.reqs.iter().fold((0usize, 0u64), |(n, b), r| {
            (n + usize::from(matches!(r.op, RcOp::Read { .. } | RcOp::Atomic { .. })), b + r.len_held())
        });
        if w.fence && ordered > 0 {
            return false;
        }
        match w.kind {
            Kind::Read { .. } | Kind::Atomic { .. } => ordered < qp.sra_limit(),
            _ => bytes < MAX_IN_FLIGHT_BYTES,
        }
    }

    /// A UMR WQE: changes the PD and the access rights of a key in use, as `mlx5r_umr_rereg_pd_access` asks (no
    /// translation entries, no other `mkey_mask` bit: those complete with a local QP operation error).
    fn execute_umr(&mut self, qpn: u32, w: &SendWqe) {
        use crate::fw::mkey::MkeyUpdate;
        let Kind::Umr { key, mask, pd, rights, xlt } = w.kind else { return };
        let bit = |b: u32| u64::from(b);
        let access = [
            (consts::MLX5_MKEY_MASK_LR, MkeyAccess::LOCAL_READ),
            (consts::MLX5_MKEY_MASK_LW, MkeyAccess::LOCAL_WRITE),
            (consts::MLX5_MKEY_MASK_RR, MkeyAccess::REMOTE_READ),
            (consts::MLX5_MKEY_MASK_RW, MkeyAccess::REMOTE_WRITE),
            (consts::MLX5_MKEY_MASK_A, MkeyAccess::REMOTE_ATOMIC),
        ];
        let mut rights_mask = MkeyAccess::empty();
        let mut known = bit(consts::MLX5_MKEY_MASK_PD);
        for (b, r) in access {
            known |= bit(b);
            if mask & bit(b) != 0 {
                rights_mask |= r;
            }
        }
        let update = MkeyUpdate { pd: (mask & bit(consts::MLX5_MKEY_MASK_PD) != 0).then_some(pd), rights_mask, rights };
        let ok = xlt == 0 && mask & !known == 0 && self.mkeys.umr_update(key, update).is_ok();
        if ok {
            self.completions().complete_send(qpn, w.id(), 0);
        } else {
            let syndrome = consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR;
            self.completions().send_error(qpn, w.index, w.opcode, w.nbb, syndrome);
        }
    }

    /// An indirect key's UMR of a user QP (a window's bind, or its free for `IBV_WR_LOCAL_INV`; an mlx5dv mkey's
    /// layout); one the checks refuse completes with a memory window bind error, as on a ConnectX
    /// (`IBV_WC_MW_BIND_ERR`). It runs once the requests before it
    /// completed (`admits`), so its completion comes in order.
    fn execute_window(&mut self, qpn: u32, w: &SendWqe, u: &WindowUmr) {
        use c::mlx5_klm as k;
        use c::mlx5_stride_block_entry as se;
        let Some(pd) = self.qps.get(&qpn).map(|q| q.pd) else { return };
        // The KLM entries (or a repeat block's strided entries) `fetch_wqe` left in the inline bytes.
        let entries: Vec<Klm> = if u.repeat.is_some() {
            self.inline
                .chunks_exact(se::SIZE)
                .map(|e| Klm {
                    key: be(se::KEY, e, 0),
                    addr: be64(e, se::VA.off),
                    len: u64::from(be(se::BCOUNT, e, 0)),
                    stride: u64::from(be(se::STRIDE, e, 0)),
                })
                .collect()
        } else {
            self.inline
                .chunks_exact(k::SIZE)
                .map(|e| Klm {
                    key: be(k::KEY, e, 0),
                    addr: be64(e, k::VA.off),
                    len: u64::from(be(k::BCOUNT, e, 0)),
                    stride: 0,
                })
                .collect()
        };
        match self.mkeys.umr_window(pd, qpn, u, &entries) {
            Ok(()) => self.completions().complete_send(qpn, w.id(), 0),
            Err(_) => {
                let syndrome = consts::MLX5_CQE_SYNDROME_MW_BIND_ERR;
                self.completions().send_error(qpn, w.index, w.opcode, w.nbb, syndrome);
            }
        }
    }

    /// Executes one WQE; false when it would fail locally while RC messages are in flight (it is left for later).
    fn execute(&mut self, qpn: u32, w: &SendWqe) -> bool {
        let Some(qp) = self.qps.get(&qpn) else { return true };
        match (w.kind, qp.st) {
            (Kind::Nop, _) => self.completions().complete_send(qpn, w.id(), 0),
            (Kind::Umr { .. }, _) => self.execute_umr(qpn, w),
            (Kind::Window(u), _) => self.execute_window(qpn, w, &u),
            (_, QpType::Ud) => self.execute_ud(qpn, w),
            (_, QpType::Rc) => return self.execute_rc(qpn, w),
            (_, QpType::Uc) => self.execute_uc(qpn, w),
        }
        true
    }
}

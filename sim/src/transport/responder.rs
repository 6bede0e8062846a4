//! Firmware side: `fw/qp.rs` (the QP table, its state and counters).
//!
//! The RC responder: a request is checked against the expected PSN (execute, answer a duplicate again, or NAK a
//! sequence error), executed through memory keys, and answered (ACK, READ data, atomic original value, RNR NAK,
//! NAK) (IBA 9.7, the responder side).

use super::common::*;
use super::cqe::{flags_rqpn, Completions, CqeOut, Cqs};
use super::keys::Keys;
use super::wqe::Wqes;
use crate::fw::caps::Caps;
use crate::fw::cq::CqTable;
use crate::fw::eq::EqTable;
use crate::fw::mcg::McgTable;
use crate::fw::mkey::MkeyTable;
use crate::fw::port::PortModel;
use crate::fw::qcounter::QCounterTable;
use crate::fw::qp::QpTable;
use crate::fw::srq::SrqTable;

/// The receive side's view of the device (RC here, and the receive halves of `uc.rs` and `ud.rs`): the QPs and
/// their receive queues, what completing their WQEs touches, the memory keys, the Q counters and the port's
/// counters, and the wire. Built per call from a `Datapath` (`Datapath::responder`).
pub(super) struct Responder<'a> {
    pub(super) qps: &'a mut QpTable,
    pub(super) srqs: &'a mut SrqTable,
    /// The port's multicast groups: a UD packet to a multicast GID goes to each QP attached to it.
    pub(super) mcgs: &'a McgTable,
    pub(super) cqs: &'a mut CqTable,
    pub(super) eqs: &'a mut EqTable,
    pub(super) mkeys: &'a mut MkeyTable,
    pub(super) caps: &'a Caps,
    pub(super) port: &'a mut PortModel,
    pub(super) q_counters: &'a mut QCounterTable,
    pub(super) dma: &'a mut DmaSpace,
    pub(super) inline: &'a mut Vec<u8>,
    pub(super) events: &'a mut Vec<SimEvent>,
    pub(super) wire: &'a mut Wire,
    pub(super) regs: &'a mut Regs,
    pub(super) clock: &'a Clock,
}

/// A response to a request from a QP of this device, with no other packet waiting: the requester takes it at
/// once (`Requester::rc_response`), the same order without the trip through the inbox.
#[must_use]
pub(super) struct LocalResponse {
    pub(super) qpn: u32,
    pub(super) seq: u64,
    pub(super) resp: Resp,
    pub(super) src_qpn: u32,
}

impl Responder<'_> {
    /// The view an access through memory keys takes (see `keys.rs`).
    #[inline]
    pub(super) fn keys(&mut self) -> Keys<'_> {
        Keys { mkeys: &*self.mkeys, dma: self.dma, inline: self.inline, qpn: None }
    }

    /// The view a remote access arriving on QP `qpn` takes (an rkey may name a window bound to that QP).
    #[inline]
    pub(super) fn remote_keys(&mut self, qpn: u32) -> Keys<'_> {
        Keys { mkeys: &*self.mkeys, dma: self.dma, inline: self.inline, qpn: Some(qpn) }
    }

    /// The view reading receive WQEs takes (see `wqe.rs`).
    #[inline]
    pub(super) fn wqes(&mut self) -> Wqes<'_> {
        Wqes { qps: self.qps, srqs: self.srqs, dma: self.dma, inline: self.inline, events: self.events }
    }

    #[inline]
    fn eq_post(&mut self) -> EqPost<'_> {
        EqPost { eqs: self.eqs, dma: self.dma, events: self.events, regs: self.regs, clock: self.clock }
    }

    /// The view completing work requests takes (see `cqe.rs`, `flush.rs`).
    #[inline]
    pub(super) fn completions(&mut self) -> Completions<'_> {
        let eq = EqPost { eqs: self.eqs, dma: self.dma, events: self.events, regs: self.regs, clock: self.clock };
        Completions { qps: self.qps, srqs: self.srqs, cq: Cqs { cqs: self.cqs, caps: self.caps, eq } }
    }

    /// Posts an affiliated QP event (see [`EqPost::post_qp_event`]).
    pub(super) fn post_qp_event(&mut self, event_type: u8, qpn: u32) -> Option<u8> {
        self.eq_post().post_qp_event(event_type, qpn)
    }

    /// Answers request `p`. The answer to a request of this device is returned for the requester instead of
    /// sent, when nothing else waits in the inbox.
    pub(super) fn reply(&mut self, p: Packet, resp: Resp) -> Option<LocalResponse> {
        // The responder's MSN goes in the AETH; a PSN sequence NAK names the PSN it expects (IBA 9.7.5.2.2).
        let (msn, expected) = self.qps.get(&p.dst_qpn).map_or((0, 0), |q| (q.msn, q.next_rcv_psn));
        let nak_seq = matches!(resp, Resp::Nak(Nak::PsnSequence));
        let fill = |r: &mut Packet| {
            r.roce.msn = msn;
            if nak_seq {
                r.roce.psn = expected;
            }
        };
        // The response to a request of this device, with no other packet waiting, would be the next one the run
        // handles: it is handled now, the same order without the trip through the inbox.
        if p.src.id == self.wire.me.id && self.wire.inbox.is_empty() {
            if let Body::Rc { seq, .. } = p.body {
                if self.wire.pcap.is_some() {
                    if let Some(mut r) = p.reply(resp.clone()) {
                        fill(&mut r);
                        self.wire.capture(&r, false);
                    }
                }
                return Some(LocalResponse { qpn: p.src_qpn, seq, resp, src_qpn: p.dst_qpn });
            }
        }
        if let Some(mut r) = p.into_reply(resp) {
            fill(&mut r);
            self.wire.send(r);
        }
        None
    }

    /// An RC request arrives at its destination QP. Returns the response a requester of this device takes at
    /// once (see [`Responder::reply`]).
    #[inline]
    pub(super) fn rc_request(&mut self, p: Packet) -> Option<LocalResponse> {
        let Body::Rc { op, solicited, psn, .. } = &p.body else { return None };
        let (solicited, psn) = (*solicited, *psn);
        let dst = p.dst_qpn;
        let ready = self.qps.get(&dst).filter(|q| q.st == QpType::Rc && matches!(q.state, QpState::Rtr | QpState::Rts));
        let Some(qp) = ready else {
            // A responder drops what it cannot take; the requester's ACK timer runs out.
            return self.reply(p, Resp::Lost("no RC QP in RTR/RTS at the destination"));
        };
        let (mut pd, rre, rwe, rae, min_rnr) = (qp.pd, qp.rre, qp.rwe, qp.rae, qp.min_rnr_nak);
        let (xrcd, xrc_srqn) = (qp.xrcd, if let Body::Rc { xrc_srqn, .. } = &p.body { *xrc_srqn } else { None });
        let (expected, counters) = (qp.next_rcv_psn, qp.counter_set_id);
        // An XRC target takes XRC requests only, each into the XRC SRQ of its own domain the XRCETH names, whose
        // PD the receive and memory accesses are checked in (a duplicate's too); anything else is an invalid
        // request, once the PSN is the expected one. An RC QP takes no XRC request.
        let xrc = match (xrcd, xrc_srqn) {
            (None, None) => Ok(None),
            (Some(d), Some(n)) => match self.srqs.get(&n).and_then(|s| Some((s.xrc?, s.pd))) {
                Some((x, srq_pd)) if x.xrcd == d => Ok(Some((n, srq_pd))),
                _ => Err(Some(n)),
            },
            _ => Err(None),
        };
        if let Ok(Some((_, srq_pd))) = xrc {
            pd = srq_pd;
        }
        // IBA 11.6.3: a QP in RTR that receives its first packet reports communication established (an
        // affiliated COMM_EST event), once per RTR.
        if qp.state == QpState::Rtr && !qp.comm_est {
            if let Some(q) = self.qps.get_mut(&dst) {
                q.comm_est = true;
            }
            let _ = self.post_qp_event(consts::MLX5_EVENT_TYPE_COMM_EST, dst);
        }
        let ahead = psn.wrapping_sub(expected) & PSN_MASK;
        if ahead != 0 {
            let resp = if ahead < PSN_WINDOW {
                self.psn_sequence_error(dst, expected, psn);
                Resp::Nak(Nak::PsnSequence)
            } else {
                self.events.push(SimEvent::DuplicateRequest { qpn: dst, psn });
                self.q_counters.count(counters, |c| c.duplicate_request += 1);
                self.duplicate(dst, psn, op, pd, rre)
            };
            return self.reply(p, resp);
        }
        let xrc_rx = match xrc {
            Ok(v) => v.map(|(n, _)| n),
            Err(named) => {
                if let Some(n) = named {
                    self.events.push(SimEvent::XrcRefused { qpn: dst, xrc_srqn: n });
                }
                return self.reply(p, Resp::Nak(Nak::InvalidRequest));
            }
        };
        if let Some(q) = self.qps.get_mut(&dst) {
            q.xrc_rx = xrc_rx;
        }
        let ib = self.wire.addr.ib;
        let mut sges = Sges::new();
        let resp = match op {
            RcOp::Send { data, imm, inv } => match self.wqes().next_recv(dst, &mut sges) {
                None => Resp::RnrNak { timer: min_rnr },
                // A SEND with invalidate frees its rkey once the data is placed; an rkey it may not free (not
                // live, another PD, no `en_rinval`, a window bound to another QP) is an invalid request.
                Some(index) => match self.keys().scatter(pd, &sges, data).and_then(|()| match inv {
                    Some(rkey) => self
                        .mkeys
                        .remote_invalidate(pd, dst, *rkey)
                        .map_err(|_| consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR),
                    None => Ok(()),
                }) {
                    Ok(()) => {
                        let cqe = CqeOut {
                            opcode: match (imm, inv) {
                                (_, Some(_)) => consts::MLX5_CQE_RESP_SEND_INV,
                                (Some(_), None) => consts::MLX5_CQE_RESP_SEND_IMM,
                                (None, None) => consts::MLX5_CQE_RESP_SEND,
                            },
                            solicited,
                            byte_cnt: data.len() as u32,
                            // The CQE's `imm_inval_pkey` carries the invalidated rkey (`IBV_WC_WITH_INV`).
                            imm: inv.map_or(imm.unwrap_or_default(), |k| k.to_be_bytes()),
                            flags_rqpn: flags_rqpn(&p, ib),
                            slid: p.slid,
                            ..CqeOut::default()
                        };
                        self.completions().recv_complete(dst, index, data.len() as u64, cqe);
                        Resp::Ack
                    }
                    Err(s) => {
                        self.completions().recv_error(dst, index, s);
                        Resp::Nak(
                            if s == consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR
                                || s == consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR
                            {
                                Nak::InvalidRequest
                            } else {
                                Nak::RemoteOp
                            },
                        )
                    }
                },
            },
            RcOp::Write { .. } if !rwe => Resp::Nak(Nak::RemoteAccess),
            RcOp::Write { raddr, rkey, data, imm } => {
                // WRITE_IMM needs a receive WQE before anything is written.
                let recv = if imm.is_some() { self.wqes().next_recv(dst, &mut sges).map(Some) } else { Some(None) };
                match recv {
                    None => Resp::RnrNak { timer: min_rnr },
                    Some(recv) => {
                        let written = data.is_empty()
                            || self
                                .remote_keys(dst)
                                .key_write(*rkey, pd, *raddr, data, MkeyAccess::REMOTE_WRITE)
                                .is_ok();
                        match (written, recv) {
                            (false, _) => Resp::Nak(Nak::RemoteAccess),
                            (true, None) => {
                                self.bump_rcv_psn(dst, data.len() as u64);
                                Resp::Ack
                            }
                            (true, Some(index)) => {
                                let cqe = CqeOut {
                                    opcode: consts::MLX5_CQE_RESP_WR_IMM,
                                    solicited,
                                    byte_cnt: data.len() as u32,
                                    imm: imm.unwrap_or_default(),
                                    flags_rqpn: flags_rqpn(&p, ib),
                                    slid: p.slid,
                                    ..CqeOut::default()
                                };
                                self.completions().recv_complete(dst, index, data.len() as u64, cqe);
                                Resp::Ack
                            }
                        }
                    }
                }
            }
            RcOp::Read { raddr, rkey, len } => {
                let data = if !rre {
                    Err(())
                } else if *len == 0 {
                    Ok(Vec::new())
                } else {
                    self.remote_keys(dst).key_read(*rkey, pd, *raddr, *len, MkeyAccess::REMOTE_READ)
                };
                match data {
                    Ok(d) => {
                        self.bump_rcv_psn(dst, *len);
                        Resp::ReadData(d)
                    }
                    Err(()) => Resp::Nak(Nak::RemoteAccess),
                }
            }
            RcOp::Atomic { raddr, rkey, op } => {
                if !rae {
                    Resp::Nak(Nak::RemoteAccess)
                } else if raddr % 8 != 0 {
                    Resp::Nak(Nak::InvalidRequest)
                } else {
                    match self.atomic(pd, dst, *raddr, *rkey, *op) {
                        Ok(orig) => {
                            if let Some(qp) = self.qps.get_mut(&dst) {
                                if qp.atomic_results.len() == crate::fw::qp::ATOMIC_REPLAY {
                                    qp.atomic_results.pop_front();
                                }
                                qp.atomic_results.push_back((psn, orig));
                            }
                            self.bump_rcv_psn(dst, 8);
                            Resp::AtomicOrig(orig)
                        }
                        Err(()) => Resp::Nak(Nak::RemoteAccess),
                    }
                }
            }
        };
        // The port's counter set sees what the responder executed or refused for want of a receive WQE.
        self.q_counters.count(counters, |c| match (op, &resp) {
            (_, Resp::RnrNak { .. }) => c.out_of_buffer += 1,
            (RcOp::Write { .. }, Resp::Ack) => c.rx_write_requests += 1,
            (RcOp::Read { .. }, Resp::ReadData(_)) => c.rx_read_requests += 1,
            (RcOp::Atomic { .. }, Resp::AtomicOrig(_)) => c.rx_atomic_requests += 1,
            _ => {}
        });
        self.reply(p, resp)
    }

    /// A request of QP `qpn` arrived at PSN `got` past the `expected` one (packets were lost): logged, and counted
    /// in the QP's `out_of_sequence` Q counter.
    pub(super) fn psn_sequence_error(&mut self, qpn: u32, expected: u32, got: u32) {
        self.events.push(SimEvent::PsnSequenceError { qpn, expected, got });
        let counters = self.qps.get(&qpn).map_or(0, |q| q.counter_set_id);
        self.q_counters.count(counters, |c| c.out_of_sequence += 1);
    }

    /// The answer to a duplicate request (its PSN is behind the expected one): the message was executed, so a
    /// SEND or WRITE is acknowledged again, a READ is read again, and an atomic returns the original value it
    /// returned the first time (the responder keeps the results of the last `ATOMIC_REPLAY`; an older atomic cannot
    /// be answered).
    pub(super) fn duplicate(&mut self, qpn: u32, psn: u32, op: &RcOp, pd: u32, rre: bool) -> Resp {
        match op {
            RcOp::Send { .. } | RcOp::Write { .. } => Resp::Ack,
            RcOp::Read { raddr, rkey, len } => {
                let data = if !rre {
                    Err(())
                } else if *len == 0 {
                    Ok(Vec::new())
                } else {
                    self.remote_keys(qpn).key_read(*rkey, pd, *raddr, *len, MkeyAccess::REMOTE_READ)
                };
                data.map_or(Resp::Nak(Nak::RemoteAccess), Resp::ReadData)
            }
            RcOp::Atomic { .. } => {
                let qp = self.qps.get(&qpn);
                let replay = qp.and_then(|q| q.atomic_results.iter().find(|(p, _)| *p == psn)).map(|(_, v)| *v);
                replay.map_or(Resp::Nak(Nak::InvalidRequest), Resp::AtomicOrig)
            }
        }
    }

    pub(super) fn bump_rcv_psn(&mut self, qpn: u32, len: u64) {
        if let Some(qp) = self.qps.get_mut(&qpn) {
            qp.next_rcv_psn = qp.next_rcv_psn.wrapping_add(packets(len, qp.mtu)) & PSN_MASK;
            qp.msn = qp.msn.wrapping_add(1) & PSN_MASK;
        }
    }

    /// An 8-byte atomic under the device lock, on memory in the byte order the driver chose
    /// ([`Caps::atomic_bytes`](crate::fw::caps::Caps::atomic_bytes)); returns the original value.
    pub(super) fn atomic(&mut self, pd: u32, qpn: u32, raddr: u64, rkey: u32, op: AtomicOp) -> Result<u64, ()> {
        let old = self.remote_keys(qpn).key_read(rkey, pd, raddr, 8, MkeyAccess::REMOTE_ATOMIC)?;
        let orig = self.caps.atomic_value(old.get(..8).and_then(|b| b.try_into().ok()).ok_or(())?);
        let new = match op {
            AtomicOp::CmpSwap { compare, swap } => (orig == compare).then_some(swap),
            AtomicOp::FetchAdd { add } => Some(orig.wrapping_add(add)),
        };
        if let Some(v) = new {
            let bytes = self.caps.atomic_bytes(v);
            self.remote_keys(qpn).key_write(rkey, pd, raddr, &bytes, MkeyAccess::REMOTE_ATOMIC)?;
        }
        Ok(orig)
    }
}

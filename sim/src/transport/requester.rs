//! The RC requester: a send WQE becomes one outstanding request (its PSN, the ACK and RNR timers, retries and
//! their counts) until its response (ACK, READ data, atomic original value, NAK) completes it (IBA 9.7, the
//! requester side).

use super::wqe::{Kind, SendWqe};
use super::*;

impl State {
    /// The source GID a packet carries for GID table `index`: on RoCE the entry SET_ROCE_ADDRESS programmed, on
    /// InfiniBand the port's default GID.
    pub(super) fn source_gid(&self, index: u32) -> Option<[u8; 16]> {
        if self.wire.addr.ib {
            self.wire.addr.gid(index)
        } else {
            self.fw.port.roce_gid(index)
        }
    }

    pub(super) fn execute_rc(&mut self, qpn: u32, w: &SendWqe) {
        let Some(qp) = self.fw.qps.get(&qpn) else { return };
        let (pd, retry_count, rnr_retry, max_msg) = (qp.pd, qp.retry_count, qp.rnr_retry, qp.max_msg);
        let fail = |st: &mut State, s: u8| st.send_error(qpn, w.index, w.opcode, w.nbb, s);
        let op = match w.kind {
            Kind::Send | Kind::Write { .. } => {
                let data = match self.gather_payload(pd, max_msg, w) {
                    Ok(data) => data,
                    Err(s) => return fail(self, s),
                };
                match w.kind {
                    Kind::Write { raddr, rkey } => RcOp::Write { raddr, rkey, data, imm: w.imm },
                    _ => RcOp::Send { data, imm: w.imm },
                }
            }
            Kind::Read { raddr, rkey } => match self.check_scatter(pd, &w.segs) {
                Ok(len) => RcOp::Read { raddr, rkey, len },
                Err(s) => return fail(self, s),
            },
            Kind::Atomic { raddr, rkey, op } => match self.check_scatter(pd, &w.segs) {
                Ok(len) if len >= 8 => RcOp::Atomic { raddr, rkey, op },
                Ok(_) => return fail(self, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR),
                Err(s) => return fail(self, s),
            },
            Kind::Nop => return self.complete_send(qpn, w.id(), 0),
        };
        let len = match &op {
            RcOp::Send { data, .. } | RcOp::Write { data, .. } => data.len() as u64,
            RcOp::Read { len, .. } => *len,
            RcOp::Atomic { .. } => 8,
        };
        if len > max_msg {
            return fail(self, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        }
        let seq = self.dp.next_seq;
        self.dp.next_seq += 1;
        let sent_ns = self.now_ns();
        let sges = if matches!(w.kind, Kind::Read { .. } | Kind::Atomic { .. }) { w.sges() } else { Sges::new() };
        let solicited = w.solicited;
        if let Some(qp) = self.fw.qps.get_mut(&qpn) {
            let phase = Phase::InFlight { sent_ns };
            let (transport_left, rnr_left) = (retry_count, rnr_retry);
            let resume = 0;
            qp.req = Some(Outstanding {
                wqe: w.id(),
                sges,
                op,
                len,
                seq,
                phase,
                transport_left,
                rnr_left,
                solicited,
                resume,
            });
        }
        self.transmit(qpn);
    }

    /// Puts the outstanding request of `qpn` on the wire, along the QP's primary path.
    pub(super) fn transmit(&mut self, qpn: u32) {
        let Some(qp) = self.fw.qps.get(&qpn) else { return };
        let Some(req) = &qp.req else { return };
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
        let psn = qp.next_send_psn;
        let body = Body::Rc { seq: req.seq, psn, op: req.op.clone(), solicited: req.solicited };
        let (remote, seq) = (qp.remote_qpn, req.seq);
        // Only frames can start inside a message; an IB port's packet is the whole message.
        let resume = if addr.ib { 0 } else { req.resume };
        let roce = RoceInfo { mtu: qp.mtu, udp_sport: path.udp_sport, resume, ..RoceInfo::default() };
        let p = match self.wire.route(&dest) {
            Ok(dst) => {
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
    }

    /// Retries the outstanding request of `qpn` if its timer has expired: the RNR or retry wait, or the ACK
    /// timer of a request nothing answered.
    pub(super) fn retry_due(&mut self, qpn: u32, now: u64) -> bool {
        let seq = self.dp.next_seq;
        // A READ is asked again after the response packets already taken.
        let read_taken = self.fw.qps.get(&qpn).map_or(0, |q| self.read_taken(qpn, q.next_send_psn));
        let Some(qp) = self.fw.qps.get_mut(&qpn) else { return false };
        let ack_ns = ack_timeout_ns(qp.route.ack_timeout);
        let Some(req) = qp.req.as_mut() else { return false };
        let kind = match req.phase {
            Phase::Wait { at_ns, kind } if at_ns <= now => kind,
            Phase::InFlight { sent_ns } if now.saturating_sub(sent_ns) >= ack_ns => {
                let (index, opcode, nbb) = (req.wqe.index, req.wqe.opcode, req.wqe.nbb);
                let why = "no response before the ACK timeout";
                self.events.push(SimEvent::Unreachable { qpn, wqe_counter: index, why });
                if req.transport_left == 0 {
                    self.send_error(qpn, index, opcode, nbb, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR);
                    return true;
                }
                req.transport_left -= 1;
                RetryKind::Transport
            }
            _ => return false,
        };
        req.seq = seq;
        req.phase = Phase::InFlight { sent_ns: now };
        if matches!(req.op, RcOp::Read { .. }) {
            req.resume = read_taken;
        }
        let wqe_counter = req.wqe.index;
        self.dp.next_seq += 1;
        self.events.push(SimEvent::Retry { qpn, wqe_counter, kind });
        self.transmit(qpn);
        true
    }

    /// A response for the outstanding request `seq` of `qpn` (from `src_qpn`).
    pub(super) fn rc_response(&mut self, qpn: u32, seq: u64, resp: Resp, src_qpn: u32) {
        let now = self.now_ns();
        let Some(qp) = self.fw.qps.get_mut(&qpn) else { return };
        if qp.st != QpType::Rc || qp.state != QpState::Rts {
            // Reset, or in error: the flush takes care of the WQE.
            return;
        }
        let (rnr_retry, ack_timeout) = (qp.rnr_retry, qp.route.ack_timeout);
        let Some(req) = qp.req.as_mut() else { return };
        if req.seq != seq || !matches!(req.phase, Phase::InFlight { .. }) {
            return;
        }
        let (index, opcode, nbb) = (req.wqe.index, req.wqe.opcode, req.wqe.nbb);
        let failure = match resp {
            // A SEND or WRITE acknowledged: done, without moving the request out first.
            Resp::Ack if matches!(req.op, RcOp::Send { .. } | RcOp::Write { .. }) => {
                let (wqe, len) = (req.wqe, req.len);
                qp.req = None;
                return self.complete_send(qpn, wqe, len);
            }
            Resp::Ack | Resp::ReadData(_) | Resp::AtomicOrig(_) => {
                let Some(req) = qp.req.take() else { return };
                return self.finish_rc(qpn, req, resp);
            }
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
            self.send_error(qpn, index, opcode, nbb, s);
        }
    }

    /// The successful end of an RC request: READ data and atomic results land in the local SGEs.
    pub(super) fn finish_rc(&mut self, qpn: u32, req: Outstanding, resp: Resp) {
        let Some(qp) = self.fw.qps.get(&qpn) else { return };
        let pd = qp.pd;
        let w = req.wqe;
        let result = match (&req.op, resp) {
            (RcOp::Read { len, .. }, Resp::ReadData(d)) if d.len() as u64 == *len => self.scatter(pd, &req.sges, &d),
            (RcOp::Atomic { .. }, Resp::AtomicOrig(v)) => self.scatter(pd, &req.sges, &v.to_be_bytes()),
            (RcOp::Send { .. } | RcOp::Write { .. }, Resp::Ack) => Ok(()),
            _ => Err(consts::MLX5_CQE_SYNDROME_BAD_RESP_ERR),
        };
        match result {
            Ok(()) => self.complete_send(qpn, w, req.len),
            Err(s) => self.send_error(qpn, w.index, w.opcode, w.nbb, s),
        }
    }
}

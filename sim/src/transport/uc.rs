//! Firmware side: `fw/qp.rs` (the QP table, its state and counters).
//!
//! UC (IBA 9.8, unreliable connected): SEND and RDMA WRITE, with or without immediate, along the QP's path with
//! no acknowledgement. The requester completes a WQE once its message is on the wire; the responder executes a
//! message it can take and silently drops one it cannot (no QP ready, bad rkey or rights, no receive WQE), so
//! nothing is retransmitted and the requester never learns of it. A receive the message does not fit (or whose
//! lkey is bad) still completes in error at the responder, which goes to ERR: that failure is local to it.

use super::common::*;
use super::cqe::{flags_rqpn, CqeOut};
use super::requester::Requester;
use super::responder::Responder;
use super::wqe::{Kind, SendWqe};

impl Requester<'_> {
    /// Executes a send WQE of a UC QP: READ and atomics do not exist on UC (`LOCAL_QP_OP_ERR`); a SEND or
    /// WRITE is gathered, sent at the QP's send PSN and completed at once.
    pub(super) fn execute_uc(&mut self, qpn: u32, w: &SendWqe) {
        let Some(qp) = self.qps.get(&qpn) else { return };
        let (pd, max_msg, psn, remote) = (qp.pd, qp.max_msg, qp.next_send_psn, qp.remote_qpn);
        let fail = |st: &mut Requester, s: u8| st.completions().send_error(qpn, w.index, w.opcode, w.nbb, s);
        let data = match w.kind {
            Kind::Send | Kind::Write { .. } => match self.keys().gather_payload(pd, max_msg, w) {
                Ok(data) => data,
                Err(s) => return fail(self, s),
            },
            Kind::Read { .. } | Kind::Atomic { .. } | Kind::Umr { .. } | Kind::Window(_) => {
                return fail(self, consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR)
            }
            Kind::Nop => return self.completions().complete_send(qpn, w.id(), 0),
        };
        let len = data.len() as u64;
        let op = match w.kind {
            Kind::Write { raddr, rkey } => RcOp::Write { raddr, rkey, data, imm: w.imm },
            _ => RcOp::Send { data, imm: w.imm, inv: None },
        };
        let Some(qp) = self.qps.get(&qpn) else { return };
        let (path, mtu) = (qp.route, qp.mtu);
        let addr = self.wire.addr;
        let grh = (path.grh || !addr.ib).then(|| self.source_gid(path.src_addr_index)).flatten().map(|sgid| Grh {
            sgid,
            dgid: path.rgid,
            tclass: path.tclass,
            flow_label: path.flow_label,
            hop_limit: path.hop_limit,
        });
        let dest = if addr.ib { Dest::Lid(path.rlid) } else { Dest::Gid { gid: path.rgid, mac: path.rmac } };
        match self.route(&dest) {
            Ok(dst) => {
                let me = self.wire.me_here();
                let body = Body::Uc { psn, op, solicited: w.solicited };
                let roce = RoceInfo { mtu, udp_sport: path.udp_sport, ..RoceInfo::default() };
                let (src_qpn, dst_qpn, slid, sl) = (qpn, remote, addr.lid, path.sl);
                let p = Packet { src: me, dst, src_qpn, dst_qpn, slid, sl, grh, body, roce };
                self.wire.send(p);
            }
            Err(why) => self.events.push(SimEvent::UcDropped { qpn: remote, why }),
        }
        // Unacknowledged: done once it is sent, delivered or not.
        self.completions().complete_send(qpn, w.id(), len);
    }
}

impl Responder<'_> {
    /// A UC message arrives at its destination QP.
    pub(super) fn uc_request(&mut self, p: Packet) {
        let Body::Uc { psn, op, solicited } = &p.body else { return };
        let (psn, solicited) = (*psn, *solicited);
        let dst = p.dst_qpn;
        let drop = |st: &mut Responder, why| st.events.push(SimEvent::UcDropped { qpn: dst, why });
        let ready = self.qps.get(&dst).filter(|q| q.st == QpType::Uc && matches!(q.state, QpState::Rtr | QpState::Rts));
        let Some(qp) = ready else { return drop(self, "no UC QP in RTR/RTS at the destination") };
        let (pd, rwe, expected, counters) = (qp.pd, qp.rwe, qp.next_rcv_psn, qp.counter_set_id);
        if qp.state == QpState::Rtr && !qp.comm_est {
            if let Some(q) = self.qps.get_mut(&dst) {
                q.comm_est = true;
            }
            let _ = self.post_qp_event(consts::MLX5_EVENT_TYPE_COMM_EST, dst);
        }
        // A UC responder starts a new message at any First or Only packet: a PSN gap means packets were lost, the
        // message is taken and the expected PSN follows it.
        if psn != expected {
            self.psn_sequence_error(dst, expected, psn);
        }
        let (data, imm, write) = match op {
            RcOp::Send { data, imm, .. } => (data, *imm, None),
            RcOp::Write { raddr, rkey, data, imm } => (data, *imm, Some((*raddr, *rkey))),
            // A requester never sends these on UC; a responder drops what it does not know.
            RcOp::Read { .. } | RcOp::Atomic { .. } => return drop(self, "READ or atomic on UC"),
        };
        let len = data.len() as u64;
        // The expected PSN restarts at the message and moves past it whether it is executed or dropped.
        if let Some(qp) = self.qps.get_mut(&dst) {
            qp.next_rcv_psn = psn;
        }
        // SEND and WRITE with immediate consume a receive WQE; without one the message is dropped (no RNR on UC).
        let mut sges = Sges::new();
        let recv = if write.is_none() || imm.is_some() {
            match self.wqes().next_recv(dst, &mut sges) {
                Some(index) => Some(index),
                None => {
                    self.q_counters.count(counters, |c| c.out_of_buffer += 1);
                    self.bump_rcv_psn(dst, len);
                    return drop(self, "receive queue empty");
                }
            }
        } else {
            None
        };
        if let Some((raddr, rkey)) = write {
            let ok = rwe
                && (data.is_empty()
                    || self.remote_keys(dst).key_write(rkey, pd, raddr, data, MkeyAccess::REMOTE_WRITE).is_ok());
            if !ok {
                self.bump_rcv_psn(dst, len);
                return drop(self, "remote write refused (rights, rkey or bounds)");
            }
            self.q_counters.count(counters, |c| c.rx_write_requests += 1);
        }
        let Some(index) = recv else {
            self.bump_rcv_psn(dst, len);
            return;
        };
        let ib = self.wire.addr.ib;
        let opcode = match (write.is_some(), imm.is_some()) {
            (true, _) => consts::MLX5_CQE_RESP_WR_IMM,
            (false, true) => consts::MLX5_CQE_RESP_SEND_IMM,
            (false, false) => consts::MLX5_CQE_RESP_SEND,
        };
        if write.is_none() {
            if let Err(s) = self.keys().scatter(pd, &sges, data) {
                return self.completions().recv_error(dst, index, s);
            }
        }
        let cqe = CqeOut {
            opcode,
            solicited,
            byte_cnt: len as u32,
            imm: imm.unwrap_or_default(),
            flags_rqpn: flags_rqpn(&p, ib),
            slid: p.slid,
            ..CqeOut::default()
        };
        // `recv_complete` moves the expected PSN past the message.
        self.completions().recv_complete(dst, index, len, cqe);
    }
}

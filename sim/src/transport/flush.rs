//! Firmware side: `fw/qp.rs` (the QP table, its state and counters).
//!
//! QP errors and flushes: an error CQE moves its QP to ERR, and a QP in ERR completes everything outstanding
//! and posted with `WR_FLUSH_ERR`, one CQE per WQE, each time the device runs.

use super::common::*;
use super::cqe::{Completions, CqeOut};

impl Completions<'_> {
    pub(super) fn qp_error(&mut self, qpn: u32, syndrome: u8) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        qp.state = QpState::Err;
        qp.error.get_or_insert(syndrome);
        self.qps.activate(qpn);
        self.cq.eq.events.push(SimEvent::QpError { qpn, syndrome });
    }

    /// Flushes a QP in ERR: the outstanding WQE, the send WQEs up to the last doorbell, the posted receives. A QP
    /// receiving through an SRQ leaves the SRQ's WQEs alone and raises `SRQ_LAST_WQE` once.
    pub(super) fn flush(&mut self, qpn: u32) -> bool {
        use c::mlx5_wqe_ctrl_seg as cs;
        let last_wqe = self.srqs().last_wqe_reached(qpn);
        let Some(qp) = self.qps.get_mut(&qpn) else { return false };
        let (cqn_snd, cqn_rcv) = (qp.cqn_snd, qp.cqn_rcv);
        // The flushed receives are the QP's own RQ's: no SRQ number in CQE version 0.
        let uidx = qp.cqe_srqn_uidx(0);
        let flush = |opcode: u8, wqe_opcode: u8, wqe_counter: u16| CqeOut {
            opcode,
            wqe_opcode,
            qpn,
            wqe_counter,
            srqn: uidx,
            syndrome: consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR,
            ..CqeOut::default()
        };
        let mut cqes = Vec::new();
        // The requests sent and not completed first, oldest first; then the WQEs not yet executed.
        while let Some(req) = qp.reqs.pop_front() {
            qp.sq_ci = qp.sq_ci.wrapping_add(req.wqe.nbb);
            cqes.push((cqn_snd, flush(consts::MLX5_CQE_REQ_ERR, req.wqe.opcode, req.wqe.index)));
        }
        qp.retrying = false;
        // Bounded: the doorbell never lets the producer run more than the SQ size ahead.
        while qp.sq_pi != qp.sq_ci {
            let pending = qp.sq_pi.wrapping_sub(qp.sq_ci);
            let mut ctrl = [0u8; CTRL];
            // An unreadable WQE is flushed as one basic block with opcode 0.
            let _ = qp.read_sq(self.cq.eq.dma, u64::from(qp.sq_ci) * BB, &mut ctrl);
            let opcode = (be(cs::OPMOD_IDX_OPCODE, &ctrl, 0) & OPCODE_MASK) as u8;
            let ds = (be(cs::QPN_DS, &ctrl, 0) & DS_MASK) as usize;
            let nbb = ((ds * DS).div_ceil(BB as usize) as u16).clamp(1, pending);
            cqes.push((cqn_snd, flush(consts::MLX5_CQE_REQ_ERR, opcode, qp.sq_ci)));
            qp.sq_ci = qp.sq_ci.wrapping_add(nbb);
        }
        qp.sq_next = qp.sq_ci;
        let sq = cqes.len();
        if qp.rq_wqes() > 0 {
            let mut rec = [0u8; 4];
            if self.cq.eq.dma.peek(qp.dbr + RCV_DBR, &mut rec) {
                let head = (u32::from_be_bytes(rec) & CTR16) as u16;
                if u32::from(head.wrapping_sub(qp.rq_ci)) <= qp.rq_wqes() {
                    while qp.rq_ci != head {
                        cqes.push((cqn_rcv, flush(consts::MLX5_CQE_RESP_ERR, 0, qp.rq_ci)));
                        qp.rq_ci = qp.rq_ci.wrapping_add(1);
                    }
                }
            }
        }
        let rq = cqes.len() - sq;
        for (cqn, cqe) in cqes {
            self.cq.post(cqn, cqe);
        }
        if sq + rq > 0 {
            self.cq.eq.events.push(SimEvent::Flushed { qpn, sq: sq as u32, rq: rq as u32 });
        }
        sq + rq > 0 || last_wqe
    }
}

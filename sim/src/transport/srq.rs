//! Firmware side: `fw/srq.rs` (the SRQ table and ring).
//!
//! Receives through a shared receive queue: the WQE at the SRQ's head (its data segments after the
//! `mlx5_wqe_srq_next_seg`), taking it (the head follows `next_wqe_index`), and the two events an SRQ raises:
//! `SRQ_RQ_LIMIT` when fewer WQEs than the armed limit remain (once per arm) and `SRQ_LAST_WQE` when a QP
//! attached to it is in ERR (once per stay there).

use super::common::*;
use crate::fw::qp::QpTable;
use crate::fw::srq::SrqTable;

/// The next segment that starts every SRQ WQE.
const NEXT_SEG: usize = c::mlx5_wqe_srq_next_seg::SIZE;

/// The event data of an `mlx5_eqe_qp_srq` naming `n` (a QP for `queue_type` QP).
fn qp_srq_data(n: u32, queue_type: u8) -> [u8; crate::fw::eq::EQE_DATA_LEN] {
    let f = c::mlx5_eqe_qp_srq::QP_SRQ_N;
    let mut d = [0u8; crate::fw::eq::EQE_DATA_LEN];
    d[c::mlx5_eqe_qp_srq::TYPE.off] = queue_type;
    d[f.off..f.end()].copy_from_slice(&(n & QPN_MASK).to_be_bytes());
    d
}

/// The WQE at the head of SRQ `srqn` for a receive on QP `qpn`, without taking it: its index, and its
/// scatter list into `sges`. `None` when nothing is posted (or the doorbell record claims more than the ring).
pub(super) fn next_srq_recv(
    srqs: &SrqTable,
    dma: &mut DmaSpace,
    events: &mut Vec<SimEvent>,
    qpn: u32,
    srqn: u32,
    sges: &mut Sges,
) -> Option<u16> {
    use c::mlx5_wqe_data_seg as d;
    let srq = srqs.get(&srqn)?;
    let counter = srq.counter(dma)?;
    let pending = counter.wrapping_sub(srq.consumed);
    if pending == 0 {
        return None;
    }
    if u32::from(pending) > srq.size() {
        events.push(SimEvent::BadRqCounter { qpn, head: counter });
        return None;
    }
    let index = srq.head;
    let len = srq.stride() - NEXT_SEG;
    let mut stack;
    let mut heap = Vec::new();
    let wqe: &mut [u8] = if len <= WQE_STACK {
        stack = [0u8; WQE_STACK];
        &mut stack[..len]
    } else {
        heap.resize(len, 0);
        &mut heap
    };
    srq.read_wqe(dma, index, NEXT_SEG, wqe).ok()?;
    for seg in wqe.chunks_exact(DATA_SEG) {
        let lkey = be(d::LKEY, seg, 0);
        if lkey == INVALID_LKEY {
            break;
        }
        let bc = be(d::BYTE_COUNT, seg, 0);
        let sge = sges.push_slot();
        sge.addr = be64(seg, d::ADDR.off);
        sge.len = if bc == 0 { ZERO_COUNT_BYTES } else { u64::from(bc) };
        sge.lkey = lkey;
    }
    Some(index)
}

/// What receives through an SRQ borrow from the device: the SRQ table, the QP table (the last-WQE event), and
/// what posting their events takes. The datapath builds one per use (`Datapath::srqs`).
pub(super) struct Srqs<'a> {
    pub(super) srqs: &'a mut SrqTable,
    pub(super) qps: &'a mut QpTable,
    pub(super) post: EqPost<'a>,
}

impl Srqs<'_> {
    /// Takes the head WQE of SRQ `srqn` (a receive consumed it, well or in error); raises the limit event when
    /// fewer WQEs than the armed limit remain, and disarms the limit.
    pub(super) fn srq_take(&mut self, srqn: u32) {
        let Some(srq) = self.srqs.get_mut(&srqn) else { return };
        let pending = srq.counter(self.post.dma).map_or(0, |c| c.wrapping_sub(srq.consumed));
        let left = srq.take(self.post.dma, pending);
        if srq.lwm > 0 && u32::from(left) < srq.lwm {
            srq.lwm = 0;
            // `srq_event_notifier` reads only the number; the queue type stays 0.
            let _ = self.post.post_eqe(consts::MLX5_EVENT_TYPE_SRQ_RQ_LIMIT, 0, &qp_srq_data(srqn, 0));
        }
    }

    /// A QP attached to an SRQ is in ERR: one `SRQ_LAST_WQE` event per stay there. Returns whether it went out now.
    pub(super) fn last_wqe_reached(&mut self, qpn: u32) -> bool {
        let Some(qp) = self.qps.get_mut(&qpn) else { return false };
        if qp.srqn.is_none() || qp.last_wqe_sent {
            return false;
        }
        qp.last_wqe_sent = true;
        let data = qp_srq_data(qpn, consts::MLX5_EVENT_QUEUE_TYPE_QP);
        let _ = self.post.post_eqe(consts::MLX5_EVENT_TYPE_SRQ_LAST_WQE, 0, &data);
        true
    }
}

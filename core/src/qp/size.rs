//! Queue sizing (rdma-core `mlx5_calc_sq_size` / `mlx5_calc_rq_size`): WQE basic blocks, segment sizes and
//! [`qp_sizes`].

use super::attr::{QpCap, QpType};
use crate::prm::{c, consts};

pub(super) const BB: usize = consts::MLX5_SEND_WQE_BB as usize;
pub(super) const DS: usize = consts::MLX5_SEND_WQE_DS as usize;
pub(super) const CTRL: usize = c::mlx5_wqe_ctrl_seg::SIZE;
pub(super) const DATA: usize = c::mlx5_wqe_data_seg::SIZE;
pub(super) const RADDR: usize = c::mlx5_wqe_raddr_seg::SIZE;
pub(super) const ATOMIC: usize = c::mlx5_wqe_atomic_seg::SIZE;
pub(super) const DGRAM: usize = c::mlx5_wqe_datagram_seg::SIZE;
/// Bytes of the inline segment header (`byte_count`).
pub(super) const INL_HDR: usize = c::mlx5_wqe_inline_seg::BYTE_COUNT.len;
/// Most BBs one WQE may span (`MLX5_SEND_WQE_MAX_WQEBBS`).
pub(super) const MAX_WQEBBS: usize = 16;

/// The fixed part of a send WQE before its data (`sq_overhead`).
const fn sq_overhead(ty: QpType) -> usize {
    match ty {
        QpType::Rc => CTRL + RADDR + ATOMIC,
        // rdma-core `sq_overhead` for IBV_QPT_UC: a control and a remote address segment, no atomic segment.
        QpType::Uc => CTRL + RADDR,
        QpType::Ud | QpType::Gsi | QpType::Smi => CTRL + DGRAM,
    }
}

/// Queue geometry chosen for a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpSizes {
    /// Send WQE basic blocks in the ring.
    pub sq_wqe_cnt: u32,
    /// Bytes of the largest send WQE (a multiple of 64).
    pub sq_wqe_size: u32,
    /// Receive WQEs in the ring.
    pub rq_wqe_cnt: u32,
    /// log2 of the receive WQE size (at least 16 bytes).
    pub rq_wqe_shift: u8,
    /// What the caller gets.
    pub cap: QpCap,
}

impl QpSizes {
    /// Bytes of the send queue.
    pub fn sq_bytes(&self) -> usize {
        self.sq_wqe_cnt as usize * BB
    }
    /// Bytes of the receive queue.
    pub fn rq_bytes(&self) -> usize {
        (self.rq_wqe_cnt as usize) << self.rq_wqe_shift
    }

    /// The same sizes without a receive queue, for a QP that receives through an SRQ (`set_rq_size` with no RQ:
    /// no WQEs, and no receive capabilities granted).
    pub fn without_rq(mut self) -> Self {
        self.rq_wqe_cnt = 0;
        self.cap.max_recv_wr = 0;
        self.cap.max_recv_sge = 0;
        self
    }
}

/// Why a QP size cannot be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum SizeError {
    /// The send WQE is larger than the device allows.
    SendWqeTooBig {
        /// Bytes needed.
        bytes: u32,
        /// Bytes allowed.
        max: u32,
    },
    /// The receive WQE is larger than the device allows.
    RecvWqeTooBig {
        /// Bytes needed.
        bytes: u32,
        /// Bytes allowed.
        max: u32,
    },
    /// More WQEs than a queue may have.
    TooManyWqes {
        /// WQEs needed.
        wqes: u32,
        /// WQEs allowed.
        max: u32,
    },
}

/// Sizes the queues for `cap` (rdma-core's calculation): the send WQE fits the overhead plus the larger of the
/// SGEs and the inline data, rounded to BBs; both rings are powers of two; the granted capabilities are what those
/// rings actually hold. No send work requests make no send queue, and no receive work requests no receive queue
/// (a receive-only QP, and a zero-length RQ), with their limits unchecked and granted as 0, as
/// `mlx5_calc_sq_size` / `mlx5_calc_rq_size` and mlx5_ib's `qp_has_rq` make them.
pub fn qp_sizes(
    ty: QpType,
    cap: &QpCap,
    max_wqe_sz_sq: u32,
    max_wqe_sz_rq: u32,
    log_max_qp_sz: u8,
) -> Result<QpSizes, SizeError> {
    let max_wqes = 1u32 << log_max_qp_sz;
    // The arithmetic runs in u64: every request is a u32 (a caller's, or a C program's through the drop-in
    // library), so no product or power of two below can overflow, and anything too large is an error, not a wrap.
    let sat = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    let overhead = sq_overhead(ty);
    // Send queue.
    let (sq_wqe_cnt, wqe_size) = if cap.max_send_wr == 0 {
        (0, 0)
    } else {
        let inl = if cap.max_inline_data > 0 { INL_HDR as u64 + u64::from(cap.max_inline_data) } else { 0 };
        let data = (u64::from(cap.max_send_sge) * DATA as u64).max(inl);
        let wqe_bytes = (overhead as u64 + data).next_multiple_of(BB as u64);
        if wqe_bytes > u64::from(max_wqe_sz_sq) || wqe_bytes > (MAX_WQEBBS * BB) as u64 {
            return Err(SizeError::SendWqeTooBig {
                bytes: sat(wqe_bytes),
                max: max_wqe_sz_sq.min((MAX_WQEBBS * BB) as u32),
            });
        }
        let sq_wqe_cnt = (u64::from(cap.max_send_wr) * wqe_bytes).next_power_of_two() / BB as u64;
        if sq_wqe_cnt > u64::from(max_wqes) {
            return Err(SizeError::TooManyWqes { wqes: sat(sq_wqe_cnt), max: max_wqes });
        }
        (sq_wqe_cnt as u32, wqe_bytes as usize)
    };
    // Receive queue: a power-of-two array of data segments, at least one; none without receive work requests
    // (the shift stays that of one segment, so the stride arithmetic never underflows).
    let (rq_wqe_cnt, rq_wqe_size) = if cap.max_recv_wr == 0 {
        (0, DATA)
    } else {
        let rq_bytes = u64::from(cap.max_recv_sge.max(1)).next_power_of_two() * DATA as u64;
        if rq_bytes > u64::from(max_wqe_sz_rq) {
            return Err(SizeError::RecvWqeTooBig { bytes: sat(rq_bytes), max: max_wqe_sz_rq });
        }
        let rq_wqe_size = rq_bytes as usize;
        // The queue is at least one send WQE basic block long (`set_rq_size`, rdma-core `mlx5_calc_rq_size`).
        let rq_wqe_cnt = u64::from(cap.max_recv_wr).next_power_of_two().max((BB / rq_wqe_size) as u64);
        if rq_wqe_cnt > u64::from(max_wqes) {
            return Err(SizeError::TooManyWqes { wqes: sat(rq_wqe_cnt), max: max_wqes });
        }
        (rq_wqe_cnt as u32, rq_wqe_size)
    };
    let granted = QpCap {
        max_send_wr: if wqe_size == 0 { 0 } else { sq_wqe_cnt / (wqe_size / BB) as u32 },
        max_recv_wr: rq_wqe_cnt,
        max_send_sge: (wqe_size.saturating_sub(overhead) / DATA) as u32,
        max_recv_sge: if rq_wqe_cnt == 0 { 0 } else { (rq_wqe_size / DATA) as u32 },
        // A WQE of only the fixed segments (UD with no SGEs and no inline data) has no room for an inline header.
        max_inline_data: wqe_size.saturating_sub(overhead).saturating_sub(INL_HDR) as u32,
    };
    Ok(QpSizes {
        sq_wqe_cnt,
        sq_wqe_size: wqe_size as u32,
        rq_wqe_cnt,
        rq_wqe_shift: rq_wqe_size.trailing_zeros() as u8,
        cap: granted,
    })
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    #[test]
    fn requests_near_u32_max_are_errors_not_overflows() {
        // Found by the drop-in library: `max_recv_wr = 0xffffffff` overflowed `next_power_of_two`.
        let huge =
            QpCap { max_send_wr: 16, max_recv_wr: u32::MAX, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        assert!(matches!(qp_sizes(QpType::Rc, &huge, 512, 512, 15), Err(SizeError::TooManyWqes { .. })));
        let huge = QpCap { max_send_wr: u32::MAX, ..huge };
        assert!(matches!(qp_sizes(QpType::Rc, &huge, 512, 512, 15), Err(SizeError::TooManyWqes { .. })));
        let huge = QpCap { max_send_wr: 16, max_recv_wr: 16, max_recv_sge: u32::MAX, ..huge };
        assert!(matches!(qp_sizes(QpType::Rc, &huge, 512, 512, 15), Err(SizeError::RecvWqeTooBig { .. })));
        let huge = QpCap { max_recv_sge: 1, max_send_sge: u32::MAX, ..huge };
        assert!(matches!(qp_sizes(QpType::Rc, &huge, 512, 512, 15), Err(SizeError::SendWqeTooBig { .. })));
        let huge = QpCap { max_send_sge: 1, max_inline_data: u32::MAX, ..huge };
        assert!(matches!(qp_sizes(QpType::Rc, &huge, 512, 512, 15), Err(SizeError::SendWqeTooBig { .. })));
    }

    use super::*;

    fn cap(send_wr: u32, recv_wr: u32, send_sge: u32, recv_sge: u32, inline: u32) -> QpCap {
        QpCap {
            max_send_wr: send_wr,
            max_recv_wr: recv_wr,
            max_send_sge: send_sge,
            max_recv_sge: recv_sge,
            max_inline_data: inline,
        }
    }

    #[test]
    fn rc_queues_round_to_basic_blocks_and_powers_of_two() {
        let s = qp_sizes(QpType::Rc, &cap(100, 100, 1, 3, 0), 512, 512, 16).unwrap();
        // Control + remote address + atomic segments and one data segment fill one 64-byte basic block.
        assert_eq!(s.sq_wqe_size as usize, BB);
        assert_eq!(s.sq_wqe_cnt, 128);
        assert_eq!(s.sq_bytes(), 128 * BB);
        assert_eq!((s.rq_wqe_cnt, s.rq_wqe_shift), (128, 6));
        assert_eq!(s.rq_bytes(), 128 << 6);
        assert_eq!(s.cap, cap(128, 128, 1, 4, (BB - CTRL - RADDR - ATOMIC - INL_HDR) as u32));
    }

    #[test]
    fn a_receive_queue_is_at_least_one_basic_block() {
        // One 16-byte WQE would be a 16-byte queue: Linux and rdma-core make it 64 bytes, so four WQEs.
        let s = qp_sizes(QpType::Rc, &cap(1, 1, 1, 1, 0), 512, 512, 16).unwrap();
        assert_eq!((s.rq_wqe_cnt, s.rq_wqe_shift, s.cap.max_recv_wr), (4, 4, 4));
        // Two 32-byte WQEs already fill it.
        let s = qp_sizes(QpType::Rc, &cap(1, 2, 1, 2, 0), 512, 512, 16).unwrap();
        assert_eq!((s.rq_wqe_cnt, s.rq_wqe_shift), (2, 5));
    }

    #[test]
    fn no_work_requests_make_no_queue_and_skip_its_limits() {
        // A receive-only QP (qperf's receivers): no SQ, and its SGE and inline asks are not checked.
        let s = qp_sizes(QpType::Rc, &cap(0, 8, 99, 1, 9999), 512, 512, 16).unwrap();
        assert_eq!((s.sq_wqe_cnt, s.sq_bytes(), s.rq_wqe_cnt), (0, 0, 8));
        assert_eq!(s.cap, cap(0, 8, 0, 1, 0));
        // A send-only QP: a zero-length RQ.
        let s = qp_sizes(QpType::Ud, &cap(4, 0, 1, 99, 0), 512, 512, 16).unwrap();
        assert_eq!((s.rq_wqe_cnt, s.rq_bytes(), s.rq_wqe_shift), (0, 0, 4));
        assert_eq!((s.cap.max_recv_wr, s.cap.max_recv_sge), (0, 0));
        assert!(s.sq_wqe_cnt > 0);
    }

    #[test]
    fn ud_wqes_carry_the_datagram_segment() {
        let s = qp_sizes(QpType::Ud, &cap(10, 1, 2, 1, 0), 512, 512, 16).unwrap();
        assert_eq!(s.sq_wqe_size as usize, (CTRL + DGRAM + 2 * DATA).next_multiple_of(BB));
        assert_eq!(s.cap.max_send_sge as usize, (s.sq_wqe_size as usize - CTRL - DGRAM) / DATA);
        assert_eq!(s.cap.max_send_wr, s.sq_wqe_cnt / (s.sq_wqe_size as usize / BB) as u32);
    }

    #[test]
    fn uc_wqes_have_room_for_a_remote_address_but_no_atomic_segment() {
        let s = qp_sizes(QpType::Uc, &cap(8, 1, 2, 1, 0), 512, 512, 16).unwrap();
        assert_eq!(s.sq_wqe_size as usize, (CTRL + RADDR + 2 * DATA).next_multiple_of(BB));
        assert_eq!(s.cap.max_send_sge as usize, (s.sq_wqe_size as usize - CTRL - RADDR) / DATA);
        assert_eq!(s.cap.max_inline_data as usize, s.sq_wqe_size as usize - CTRL - RADDR - INL_HDR);
    }

    #[test]
    fn inline_data_can_set_the_wqe_size() {
        let s = qp_sizes(QpType::Rc, &cap(1, 1, 1, 1, 100), 1024, 512, 16).unwrap();
        assert_eq!(s.sq_wqe_size as usize, (CTRL + RADDR + ATOMIC + INL_HDR + 100).next_multiple_of(BB));
        assert!(s.cap.max_inline_data >= 100);
    }

    #[test]
    fn limits_are_reported() {
        assert_eq!(
            qp_sizes(QpType::Rc, &cap(1, 1, 20, 1, 0), 256, 512, 16),
            Err(SizeError::SendWqeTooBig { bytes: 384, max: 256 })
        );
        assert_eq!(
            qp_sizes(QpType::Rc, &cap(100, 1, 1, 1, 0), 512, 512, 6),
            Err(SizeError::TooManyWqes { wqes: 128, max: 64 })
        );
        assert_eq!(
            qp_sizes(QpType::Rc, &cap(1, 1, 1, 8, 0), 512, 64, 16),
            Err(SizeError::RecvWqeTooBig { bytes: 128, max: 64 })
        );
    }
}

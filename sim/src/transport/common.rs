//! What the datapath's files share: [`Datapath`] (the view of the device a run borrows), [`DpState`] (the
//! datapath's own state), the WQE and CQE layout constants, and the imports every file of the engine uses.

pub(super) use std::collections::{BTreeMap, BTreeSet};

pub(super) use super::reasm::RoceRx;

pub(super) use mlx5_core::prm::{c, consts, Bytes};

pub(super) use crate::config::SimConfig;
pub(super) use crate::dma::DmaSpace;
pub(super) use crate::events::{RetryKind, SimEvent};
pub(super) use crate::fw::eq::EqPost;
pub(super) use crate::fw::mkey::MkeyAccess;
pub(super) use crate::fw::mkey::{Klm, Mkey, MkeyFault, RepeatBlock, WindowUmr};
pub(super) use crate::fw::qp::{
    Outstanding, Phase, QpState, QpType, Sge, Sges, WqeId, LOG_ACK_REQ_MAX, MAX_IN_FLIGHT, MAX_IN_FLIGHT_BYTES,
    MAX_PACKETS_IN_FLIGHT, PSN_MASK, SEND_WQE_BB,
};
pub(super) use crate::fw::Firmware;
pub(super) use crate::link::Packet;
pub(super) use crate::link::Wire;
pub(super) use crate::regs::{Clock, Regs};
pub(super) use crate::small::Small;
pub(super) use crate::wire::{AtomicOp, Body, Dest, Grh, Nak, Payload, RcOp, Resp, RoceInfo};

pub(super) const BB: u64 = SEND_WQE_BB;
/// PSNs less than half the 24-bit space ahead of the expected one are "ahead" (a sequence error); the rest are
/// behind it (duplicates), as IBA 9.7.5.2 splits the space.
pub(super) const PSN_WINDOW: u32 = 1 << 23;
/// A WQE is counted in 16-byte units (`ds`).
pub(super) const DS: usize = consts::MLX5_SEND_WQE_DS as usize;
pub(super) const CTRL: usize = c::mlx5_wqe_ctrl_seg::SIZE;
pub(super) const DATA_SEG: usize = c::mlx5_wqe_data_seg::SIZE;
pub(super) const RADDR_SEG: usize = c::mlx5_wqe_raddr_seg::SIZE;
pub(super) const ATOMIC_SEG: usize = c::mlx5_wqe_atomic_seg::SIZE;
pub(super) const DGRAM_SEG: usize = c::mlx5_wqe_datagram_seg::SIZE;
pub(super) const XRC_SEG: usize = c::mlx5_wqe_xrc_seg::SIZE;
pub(super) const INLINE_HDR: usize = c::mlx5_wqe_inline_seg::BYTE_COUNT.len;
pub(super) const INLINE_FLAG: u32 = consts::MLX5_INLINE_SEG;
pub(super) const DS_MASK: u32 = consts::MLX5_WQE_CTRL_DS_MASK;
pub(super) const QPN_SHIFT: u32 = consts::MLX5_WQE_CTRL_QPN_SHIFT;
pub(super) const IDX_SHIFT: u32 = consts::MLX5_WQE_CTRL_WQE_INDEX_SHIFT;
pub(super) const OPCODE_MASK: u32 = consts::MLX5_WQE_CTRL_OPCODE_MASK;
pub(super) const SOLICITED: u8 = consts::MLX5_WQE_CTRL_SOLICITED;
/// `fm_ce_se` bits 7:5: the fence mode (`MLX5_FENCE_MODE_*`, already shifted into place).
pub(super) const FENCE_MODE_MASK: u8 = 0xe0;
pub(super) const INVALID_LKEY: u32 = consts::MLX5_INVALID_LKEY;
pub(super) const EXTENDED_AV: u32 = consts::MLX5_EXTENDED_UD_AV;
/// `grh_gid_fl` of an address vector (rdma-core `mlx5_create_ah`): GRH flag in bit 30, source GID index in bits
/// 27:20, flow label in bits 19:0.
pub(super) const AV_GRH: u32 = 1 << 30;
pub(super) const AV_SGID_SHIFT: u32 = 20;
pub(super) const AV_SGID_MASK: u32 = 0xff;
pub(super) const FLOW_LABEL_MASK: u32 = 0xf_ffff;
/// The IB SL is the low 4 bits of `stat_rate_sl` (mlx5_ib `create_ib_ah`).
pub(super) const AV_SL_MASK: u8 = 0xf;
/// A data segment with `byte_count` 0 covers 2 GiB (PRM).
pub(super) const ZERO_COUNT_BYTES: u64 = 1 << 31;
/// A UD qkey with the high bit set means "use the QP's own qkey" (IBA 10.2.5).
pub(super) const QKEY_FROM_QP: u32 = 1 << 31;
/// `rnr_retry` 7: retry forever (IBA 9.7.5.2.8).
pub(super) const RNR_RETRY_INFINITE: u8 = 7;
/// The doorbell record: `MLX5_RCV_DBR` and `MLX5_SND_DBR` are be32 indices.
pub(super) const RCV_DBR: u64 = consts::MLX5_RCV_DBR as u64 * 4;
/// Producer counters are 16 bits in the doorbell record.
pub(super) const CTR16: u32 = 0xffff;
pub(super) const QPN_MASK: u32 = 0xff_ffff;
/// Bits 7:4 of `op_own` hold the CQE opcode; bit 1 the solicited event.
pub(super) const CQE_OPCODE_SHIFT: u32 = 4;
pub(super) const CQE_SE: u8 = 1 << 1;
/// `flags_rqpn`: "GRH present" in bits 29:28 (value 1), the IB SL in bits 27:24 (mlx5_ib `handle_responder`).
pub(super) const CQE_GRH_SHIFT: u32 = 28;
pub(super) const CQE_SL_SHIFT: u32 = 24;
/// Every error CQE carries a non-zero vendor syndrome; the simulator's is its own syndrome with the high bit.
pub(super) const VENDOR_ERR_BIT: u8 = 0x80;

/// The received GRH: 40 bytes, IPv6-shaped (IBA 8.3; RoCE v1 carries the same header).
pub(crate) const GRH_BYTES: usize = 40;
pub(super) const GRH_IP_VERSION: u32 = 6;
/// `NxtHdr` of a GRH followed by the IBA transport header.
pub(super) const GRH_NEXT_BTH: u8 = 0x1b;
/// Headers counted in the GRH payload length after the GRH: BTH, DETH, ImmDt (when present), and the ICRC.
pub(super) const BTH_BYTES: usize = 12;
pub(super) const DETH_BYTES: usize = 8;
pub(super) const IMMDT_BYTES: usize = 4;
pub(super) const ICRC_BYTES: usize = 4;

/// The RNR NAK timer field in microseconds (IBA table 45; 0 is the longest).
pub(super) const RNR_TIMER_US: [u64; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840, 5_120, 7_680,
    10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
];

pub(super) fn rnr_timer_ns(timer: u8) -> u64 {
    RNR_TIMER_US[usize::from(timer & 31)] * 1_000
}

/// The local ACK timeout `4.096 us << ack_timeout` (IBA 9.7.6.1.3). The spec makes 0 infinite; the simulator
/// uses the shortest timeout instead so a lost request always ends.
pub(super) fn ack_timeout_ns(ack_timeout: u8) -> u64 {
    4_096u64 << ack_timeout.min(31)
}

/// Packets a message of `len` bytes takes at path MTU `mtu` (`IB_MTU_*`); at least one.
pub(super) fn packets(len: u64, mtu: u8) -> u32 {
    if !(consts::IB_MTU_256..=consts::IB_MTU_4096).contains(&mtu) {
        return 1;
    }
    let size = 128u64 << mtu;
    u32::try_from(len.div_ceil(size).max(1)).unwrap_or(u32::MAX)
}

#[inline]
pub(super) fn be(m: Bytes, b: &[u8], base: usize) -> u32 {
    m.get_be(b, base)
}

#[inline]
pub(super) fn be64(b: &[u8], off: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[off..off + 8]);
    u64::from_be_bytes(w)
}

/// Largest WQE read into a stack buffer (small sends, a few SGEs or some inline bytes, and receive WQEs); larger ones
/// go to the heap.
pub(super) const WQE_STACK: usize = 256;

/// Largest receive WQE read into the small stack buffer: four SGEs.
pub(super) const RQ_SMALL: usize = 64;

/// Datapath state beyond the QPs: the BlueFlame buffers' current WQEs and the request sequence numbers.
#[derive(Debug, Default)]
pub(crate) struct DpState {
    /// (UAR page, BlueFlame buffer) -> (QPN, WQE index) of the last doorbell written there.
    pub(crate) bf: BTreeMap<(u32, usize), (u32, u16)>,
    /// Ethernet SQs with doorbells not yet executed (`eth/engine.rs`).
    pub(crate) eth_sqs: BTreeSet<u32>,
    pub(super) next_seq: u64,
    /// The inline bytes of the WQE being executed (reused).
    pub(super) inline: Vec<u8>,
    /// Messages in reassembly and ARP neighbours of a RoCE port fed frames.
    pub(crate) rx: RoceRx,
    /// Where the frames of a packet from another device of this process are built (reused).
    pub(super) frame_buf: Vec<u8>,
}

/// The datapath's view of the device: the parts it runs on, borrowed from the device for one run or one
/// doorbell (the device layer builds it). The command engine's logs and queues are not in it.
pub(crate) struct Datapath<'a> {
    pub(crate) cfg: &'a SimConfig,
    pub(crate) fw: &'a mut Firmware,
    pub(crate) dma: &'a mut DmaSpace,
    pub(crate) events: &'a mut Vec<SimEvent>,
    pub(crate) wire: &'a mut Wire,
    pub(crate) dp: &'a mut DpState,
    pub(crate) regs: &'a mut Regs,
    pub(crate) clock: &'a Clock,
}

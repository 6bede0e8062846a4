//! Work requests as the caller writes them (`ibv_send_wr`, `ibv_recv_wr`, `ibv_sge`), address handles and post
//! errors.

use super::attr::{AhAttr, QpState};
use super::cmd::ROCE_UDP_SPORT_MIN;
use crate::prm::{c, consts};

/// A scatter/gather element (`ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Address of the buffer, as the memory key translates it.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// The local key of the memory.
    pub lkey: u32,
}

/// What a send work request does (`ibv_wr_opcode` with its operands).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_SEND`.
    Send,
    /// `IBV_WR_SEND_WITH_IMM`.
    SendImm {
        /// Immediate data.
        imm: u32,
    },
    /// `IBV_WR_RDMA_WRITE`.
    RdmaWrite {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`.
    RdmaWriteImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: u32,
    },
    /// `IBV_WR_RDMA_READ`.
    RdmaRead {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// 8-byte compare and swap; the original value lands in the SGE.
    AtomicCmpSwp {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Value compared with the remote one.
        compare: u64,
        /// Value written when they match.
        swap: u64,
    },
    /// 8-byte fetch and add; the original value lands in the SGE.
    AtomicFetchAdd {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// Value added.
        add: u64,
    },
}

impl SendOp {
    #[inline]
    pub(super) const fn mlx5_opcode(&self) -> u8 {
        match self {
            SendOp::Send => consts::MLX5_OPCODE_SEND,
            SendOp::SendImm { .. } => consts::MLX5_OPCODE_SEND_IMM,
            SendOp::RdmaWrite { .. } => consts::MLX5_OPCODE_RDMA_WRITE,
            SendOp::RdmaWriteImm { .. } => consts::MLX5_OPCODE_RDMA_WRITE_IMM,
            SendOp::RdmaRead { .. } => consts::MLX5_OPCODE_RDMA_READ,
            SendOp::AtomicCmpSwp { .. } => consts::MLX5_OPCODE_ATOMIC_CS,
            SendOp::AtomicFetchAdd { .. } => consts::MLX5_OPCODE_ATOMIC_FA,
        }
    }
}

/// `ibv_send_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    /// `IBV_SEND_FENCE`: wait for earlier RDMA reads and atomics.
    pub const FENCE: SendFlags = SendFlags(1);
    /// `IBV_SEND_SIGNALED`: generate a completion.
    pub const SIGNALED: SendFlags = SendFlags(2);
    /// `IBV_SEND_SOLICITED`: raise a solicited event at the receiver.
    pub const SOLICITED: SendFlags = SendFlags(4);

    /// Whether every flag of `o` is set.
    #[inline]
    pub const fn contains(self, o: SendFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, o: SendFlags) -> SendFlags {
        SendFlags(self.0 | o.0)
    }
}

/// A UD destination: an address handle and the remote QP (`ibv_send_wr.wr.ud`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest<'a> {
    /// The address handle.
    pub ah: &'a Ah,
    /// Remote QP number.
    pub remote_qpn: u32,
    /// Remote Q_Key.
    pub remote_qkey: u32,
}

/// A send work request (`ibv_send_wr`, one element of the list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// Local buffers.
    pub sg_list: &'a [Sge],
    /// Send flags.
    pub flags: SendFlags,
    /// Bytes to carry inside the WQE instead of gathering `sg_list` (`IBV_SEND_INLINE`): the buffer is free
    /// again as soon as the post returns. `sg_list` must be empty then.
    pub inline: Option<&'a [u8]>,
    /// Required on UD QPs.
    pub ud: Option<UdDest<'a>>,
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// Receive buffers.
    pub sg_list: &'a [Sge],
}

/// An address handle: the `mlx5_av` image a UD send carries (`mlx5_ib_create_ah`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ah {
    av: [u8; c::mlx5_av::SIZE],
}

impl Ah {
    /// Builds the address vector for `attr` on a port of `link` type (`create_ib_ah`).
    pub fn new(attr: &AhAttr, link: crate::cq::LinkLayer) -> Self {
        use c::mlx5_av as v;
        let mut av = [0u8; v::SIZE];
        let mut stat_rate_sl = (attr.static_rate & 0xf) << 4;
        if let Some(g) = attr.grh {
            av[v::RGID.off..v::RGID.end()].copy_from_slice(&g.dgid);
            v::GRH_GID_FL.put_be(&mut av, 0, (g.flow_label & 0xf_ffff) | (1 << 30) | u32::from(g.sgid_index) << 20);
            av[v::HOP_LIMIT.off] = g.hop_limit;
            av[v::TCLASS.off] = g.traffic_class;
        }
        match link {
            crate::cq::LinkLayer::Ethernet => {
                v::UDP_SPORT.put_be(&mut av, 0, ROCE_UDP_SPORT_MIN);
                av[v::RMAC.off..v::RMAC.end()].copy_from_slice(&attr.dmac);
                stat_rate_sl |= (attr.sl & 7) << 1;
            }
            crate::cq::LinkLayer::InfiniBand => {
                v::RLID.put_be(&mut av, 0, attr.dlid.into());
                av[v::FL_MLID.off] = attr.src_path_bits & 0x7f;
                stat_rate_sl |= attr.sl & 0xf;
            }
        }
        av[v::STAT_RATE_SL.off] = stat_rate_sl;
        Ah { av }
    }

    /// The address vector bytes.
    pub fn av(&self) -> &[u8; c::mlx5_av::SIZE] {
        &self.av
    }
}

/// Why a work request was not posted. Everything before `index` in the list was posted (and the doorbell rung for
/// it); nothing from `index` on was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PostError {
    /// Position of the first work request not posted (`bad_wr`).
    pub index: usize,
    /// Why.
    pub kind: PostErrorKind,
}

/// Why a post failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum PostErrorKind {
    /// The queue has no room (`ENOMEM`).
    QueueFull {
        /// Work requests outstanding.
        outstanding: u32,
        /// Queue capacity.
        max: u32,
    },
    /// More SGEs than the queue was created for (`EINVAL`).
    TooManySge {
        /// Entries given.
        sge: usize,
        /// Entries allowed.
        max: u32,
    },
    /// More inline bytes than the queue allows.
    InlineTooLong {
        /// Bytes given.
        bytes: usize,
        /// Bytes allowed.
        max: u32,
    },
    /// The QP is not in a state that accepts this queue's work (send needs RTS; receive needs INIT or later).
    BadState {
        /// The QP state.
        state: QpState,
    },
    /// A UD send without a destination, an RC send with one, or an atomic without an 8-byte SGE.
    BadRequest {
        /// What is wrong.
        what: &'static str,
    },
    /// The device is in internal error (`EIO`).
    DeviceError,
}

impl core::fmt::Display for PostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "work request {} not posted: ", self.index)?;
        match self.kind {
            PostErrorKind::QueueFull { outstanding, max } => write!(f, "queue full ({outstanding} of {max})"),
            PostErrorKind::TooManySge { sge, max } => write!(f, "{sge} SGEs, the queue takes {max}"),
            PostErrorKind::InlineTooLong { bytes, max } => write!(f, "{bytes} inline bytes, the queue takes {max}"),
            PostErrorKind::BadState { state } => write!(f, "QP is in state {state:?}"),
            PostErrorKind::BadRequest { what } => write!(f, "{what}"),
            PostErrorKind::DeviceError => write!(f, "device in internal error"),
        }
    }
}

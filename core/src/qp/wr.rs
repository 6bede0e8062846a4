//! Work requests as the caller writes them (`ibv_send_wr`, `ibv_recv_wr`, `ibv_sge`), address handles and post
//! errors.

use super::attr::{AhAttr, QpState};
use super::cmd::ROCE_UDP_SPORT_MIN;
use crate::prm::{c, consts};

/// A scatter/gather element (`ibv_sge`). `repr(C)` with `ibv_sge`'s field order, so a C program's scatter list
/// can be read as a slice of these in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
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
        /// Immediate data in network byte order (`ibv_send_wr.imm_data`, `__be32`): `x.to_be()` sends the number
        /// `x`, and the receiver's `WorkCompletion::imm_data` holds the same value.
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
        /// Immediate data in network byte order, as for [`SendOp::SendImm`].
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

/// The bytes an inline send carries: one slice, or a gather list read in place ([`InlineData::gather`]).
#[derive(Debug, Clone, Copy)]
pub enum InlineData<'a> {
    /// The bytes themselves.
    Bytes(&'a [u8]),
    /// Host memory named by a gather list (`IBV_SEND_INLINE` with `sg_list`): made only by
    /// [`InlineData::gather`].
    Gather(GatherList<'a>),
}

/// A gather list whose addresses are readable host memory (see [`InlineData::gather`]).
#[derive(Debug, Clone, Copy)]
pub struct GatherList<'a>(&'a [Sge]);

impl<'a> GatherList<'a> {
    /// The entries.
    pub fn sges(&self) -> &'a [Sge] {
        self.0
    }
}

impl<'a> InlineData<'a> {
    /// The bytes a C `ibv_send_wr` with `IBV_SEND_INLINE` names: its gather list, read where it is while the
    /// WQE is built, with no copy first.
    ///
    /// # Safety
    /// Each entry's `addr` is a pointer in this address space readable for `length` bytes while `'a` lives (verbs'
    /// contract for inline sends).
    pub unsafe fn gather(sg: &'a [Sge]) -> Self {
        InlineData::Gather(GatherList(sg))
    }

    /// Total bytes (saturating: a length past any queue's inline limit is refused as it is).
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            InlineData::Bytes(b) => b.len(),
            InlineData::Gather(g) => g.0.iter().fold(0usize, |t, s| t.saturating_add(s.length as usize)),
        }
    }

    /// No bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A send work request as the post loop reads it: each part asked for where the caller keeps it, so a caller
/// with its own representation (a C `ibv_send_wr`) is posted without first building a [`SendWr`]. Every method
/// is called at most once per work request; an `Err` refuses the request as the core's own checks do.
pub trait SendWrView {
    /// Returned in the work completion.
    fn wr_id(&self) -> u64;
    /// The operation as the view holds it: a reference to the caller's, or one made from its representation.
    type Op<'a>: core::borrow::Borrow<SendOp>
    where
        Self: 'a;
    /// The operation with its operands.
    fn op(&self) -> Result<Self::Op<'_>, PostErrorKind>;
    /// Send flags.
    fn flags(&self) -> SendFlags;
    /// The gather list (empty when the request is inline).
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind>;
    /// The inline bytes, if the request is inline.
    fn inline(&self) -> Result<Option<InlineData<'_>>, PostErrorKind>;
    /// The UD destination. Asked only of a datagram QP's work requests (`datagram`), so a connected QP's caller
    /// need not read it; a connected QP's request that names one is refused.
    fn ud(&self, datagram: bool) -> Result<Option<UdDest<'_>>, PostErrorKind>;
}

impl SendWrView for SendWr<'_> {
    type Op<'a>
        = &'a SendOp
    where
        Self: 'a;
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    #[inline(always)]
    fn op(&self) -> Result<&SendOp, PostErrorKind> {
        Ok(&self.op)
    }
    #[inline(always)]
    fn flags(&self) -> SendFlags {
        self.flags
    }
    #[inline(always)]
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind> {
        Ok(self.sg_list)
    }
    #[inline(always)]
    fn inline(&self) -> Result<Option<InlineData<'_>>, PostErrorKind> {
        Ok(self.inline.map(InlineData::Bytes))
    }
    #[inline(always)]
    fn ud(&self, _datagram: bool) -> Result<Option<UdDest<'_>>, PostErrorKind> {
        Ok(self.ud)
    }
}

impl<T: RecvWrView + ?Sized> RecvWrView for &T {
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        (**self).wr_id()
    }
    #[inline(always)]
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind> {
        (**self).sg_list()
    }
    #[inline(always)]
    fn one_sge(&self) -> Option<&Sge> {
        (**self).one_sge()
    }
}

impl<T: SendWrView + ?Sized> SendWrView for &T {
    type Op<'a>
        = T::Op<'a>
    where
        Self: 'a;
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        (**self).wr_id()
    }
    #[inline(always)]
    fn op(&self) -> Result<T::Op<'_>, PostErrorKind> {
        (**self).op()
    }
    #[inline(always)]
    fn flags(&self) -> SendFlags {
        (**self).flags()
    }
    #[inline(always)]
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind> {
        (**self).sg_list()
    }
    #[inline(always)]
    fn inline(&self) -> Result<Option<InlineData<'_>>, PostErrorKind> {
        (**self).inline()
    }
    #[inline(always)]
    fn ud(&self, datagram: bool) -> Result<Option<UdDest<'_>>, PostErrorKind> {
        (**self).ud(datagram)
    }
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr<'a> {
    /// Returned in the work completion.
    pub wr_id: u64,
    /// Receive buffers.
    pub sg_list: &'a [Sge],
}

/// A receive work request as the post loop reads it, in place ([`SendWrView`]'s counterpart for
/// [`Qp::post_recv_iter`](super::Qp::post_recv_iter)).
pub trait RecvWrView {
    /// Returned in the work completion.
    fn wr_id(&self) -> u64;
    /// The scatter list.
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind>;
    /// The scatter list's one entry when it has exactly one (the usual receive), else `None`: the post loop's
    /// fast path, which [`RecvWrView::sg_list`] backs. A view over a foreign layout overrides it to test only
    /// what that case needs.
    #[inline(always)]
    fn one_sge(&self) -> Option<&Sge> {
        match self.sg_list() {
            Ok([s]) => Some(s),
            _ => None,
        }
    }
}

impl RecvWrView for RecvWr<'_> {
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    #[inline(always)]
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind> {
        Ok(self.sg_list)
    }
}

/// An address handle: the `mlx5_av` image a UD send carries (`mlx5_ib_create_ah`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ah {
    av: [u8; c::mlx5_av::SIZE],
}

/// What an address vector needs beyond the verbs attributes: the port's link layer, the type of the source GID
/// entry and the static rate already mapped for the device (`mlx5r_ib_rate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AvParams {
    /// The port's link layer.
    pub link: crate::cq::LinkLayer,
    /// RoCE: the source GID entry is RoCE v2 (UDP-encapsulated).
    pub roce_v2: bool,
    /// `stat_rate` in the device's encoding ([`super::cmd::ib_rate_to_mlx5`]).
    pub stat_rate: u8,
}

/// The ECN-capable bit `create_ib_ah` ORs into a RoCE v2 address's traffic class (`MLX5_ECN_ENABLED`, defined in
/// mlx5_ib's `ah.c`, not in the PRM headers).
pub const MLX5_ECN_ENABLED: u8 = 1 << 1;

impl Ah {
    /// Builds the address vector for `attr` on a port of `link` type, as a RoCE v1 / InfiniBand address with the
    /// rate taken as already in the device's encoding. [`Ah::build`] is the whole of `create_ib_ah`
    /// (`Hca::create_ah` calls it).
    pub fn new(attr: &AhAttr, link: crate::cq::LinkLayer) -> Self {
        Self::build(attr, AvParams { link, roce_v2: false, stat_rate: attr.static_rate & 0xf })
    }

    /// The address vector of `create_ib_ah`: on RoCE the destination MAC, the priority, and for a v2 source the
    /// UDP source port from the flow label (`mlx5_ah_get_udp_sport`: the port's minimum without one) and the
    /// ECN-capable traffic class; on InfiniBand the LID, path bits and SL.
    pub fn build(attr: &AhAttr, p: AvParams) -> Self {
        use c::mlx5_av as v;
        let mut av = [0u8; v::SIZE];
        let mut stat_rate_sl = (p.stat_rate & 0xf) << 4;
        if let Some(g) = attr.grh {
            av[v::RGID.off..v::RGID.end()].copy_from_slice(&g.dgid);
            v::GRH_GID_FL.put_be(&mut av, 0, (g.flow_label & 0xf_ffff) | (1 << 30) | u32::from(g.sgid_index) << 20);
            av[v::HOP_LIMIT.off] = g.hop_limit;
            av[v::TCLASS.off] = g.traffic_class;
        }
        match p.link {
            crate::cq::LinkLayer::Ethernet => {
                let fl = attr.grh.map_or(0, |g| g.flow_label & consts::IB_GRH_FLOWLABEL_MASK);
                let sport = if p.roce_v2 && fl != 0 {
                    u32::from(super::cmd::flow_label_to_udp_sport(fl))
                } else {
                    ROCE_UDP_SPORT_MIN
                };
                v::UDP_SPORT.put_be(&mut av, 0, sport);
                av[v::RMAC.off..v::RMAC.end()].copy_from_slice(&attr.dmac);
                stat_rate_sl |= (attr.sl & 7) << 1;
                if p.roce_v2 {
                    av[v::TCLASS.off] |= MLX5_ECN_ENABLED;
                }
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

impl core::error::Error for PostError {}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    use crate::cq::LinkLayer;
    use crate::qp::Grh;

    fn av(fl: u32, roce_v2: bool) -> [u8; c::mlx5_av::SIZE] {
        let grh = Grh { flow_label: fl, traffic_class: 0x60, sgid_index: 3, hop_limit: 64, ..Grh::default() };
        let attr = AhAttr { sl: 2, grh: Some(grh), dmac: [2, 0, 0, 0, 0, 1], ..AhAttr::default() };
        *Ah::build(&attr, AvParams { link: LinkLayer::Ethernet, roce_v2, stat_rate: 8 }).av()
    }

    #[test]
    fn roce_v2_addresses_take_the_port_from_the_flow_label_and_set_ecn() {
        use c::mlx5_av as v;
        let sport = |a: &[u8; c::mlx5_av::SIZE]| u16::from_be_bytes([a[v::UDP_SPORT.off], a[v::UDP_SPORT.off + 1]]);
        // mlx5_ah_get_udp_sport: the folded flow label for v2 with a label, else the port's minimum.
        assert_eq!(sport(&av(0x12345, true)), 0xe341);
        assert_eq!(sport(&av(0, true)), 0xc000);
        assert_eq!(sport(&av(0x12345, false)), 0xc000);
        // A v2 source makes the traffic class ECN-capable; the rate and SL share a byte.
        assert_eq!((av(0, true)[v::TCLASS.off], av(0, false)[v::TCLASS.off]), (0x62, 0x60));
        assert_eq!(av(0, true)[v::STAT_RATE_SL.off], 8 << 4 | 2 << 1);
    }
}

//! Work completions (`ib_wc`, `ib_wc_status`): decoding a CQE into a [`WorkCompletion`] (mlx5_ib `mlx5_poll_one`,
//! rdma-core `mlx5_parse_cqe`).

use super::cqe::{Cqe, CqeFieldsRead, CqeOpcode};
use crate::prm::consts;

/// `ib_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum WcStatus {
    /// `IB_WC_SUCCESS`.
    #[default]
    Success,
    /// `IB_WC_LOC_LEN_ERR`: a message longer than the receive buffer.
    LocLenErr,
    /// `IB_WC_LOC_QP_OP_ERR`.
    LocQpOpErr,
    /// `IB_WC_LOC_EEC_OP_ERR`.
    LocEecOpErr,
    /// `IB_WC_LOC_PROT_ERR`: a local key or access check failed.
    LocProtErr,
    /// `IB_WC_WR_FLUSH_ERR`: flushed because the QP is in ERR.
    WrFlushErr,
    /// `IB_WC_MW_BIND_ERR`.
    MwBindErr,
    /// `IB_WC_BAD_RESP_ERR`.
    BadRespErr,
    /// `IB_WC_LOC_ACCESS_ERR`.
    LocAccessErr,
    /// `IB_WC_REM_INV_REQ_ERR`.
    RemInvReqErr,
    /// `IB_WC_REM_ACCESS_ERR`: the remote key or access check failed.
    RemAccessErr,
    /// `IB_WC_REM_OP_ERR`.
    RemOpErr,
    /// `IB_WC_RETRY_EXC_ERR`: transport retries exhausted.
    RetryExcErr,
    /// `IB_WC_RNR_RETRY_EXC_ERR`: receiver-not-ready retries exhausted.
    RnrRetryExcErr,
    /// `IB_WC_LOC_RDD_VIOL_ERR`.
    LocRddViolErr,
    /// `IB_WC_REM_INV_RD_REQ_ERR`.
    RemInvRdReqErr,
    /// `IB_WC_REM_ABORT_ERR`.
    RemAbortErr,
    /// `IB_WC_INV_EECN_ERR`.
    InvEecnErr,
    /// `IB_WC_INV_EEC_STATE_ERR`.
    InvEecStateErr,
    /// `IB_WC_FATAL_ERR`.
    FatalErr,
    /// `IB_WC_RESP_TIMEOUT_ERR`.
    RespTimeoutErr,
    /// `IB_WC_GENERAL_ERR`: any syndrome without a verbs status.
    GeneralErr,
}

impl WcStatus {
    /// Every status, in `ib_wc_status` order.
    pub const ALL: [WcStatus; 22] = [
        WcStatus::Success,
        WcStatus::LocLenErr,
        WcStatus::LocQpOpErr,
        WcStatus::LocEecOpErr,
        WcStatus::LocProtErr,
        WcStatus::WrFlushErr,
        WcStatus::MwBindErr,
        WcStatus::BadRespErr,
        WcStatus::LocAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::RemAccessErr,
        WcStatus::RemOpErr,
        WcStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::LocRddViolErr,
        WcStatus::RemInvRdReqErr,
        WcStatus::RemAbortErr,
        WcStatus::InvEecnErr,
        WcStatus::InvEecStateErr,
        WcStatus::FatalErr,
        WcStatus::RespTimeoutErr,
        WcStatus::GeneralErr,
    ];

    /// The `IB_WC_*` value.
    pub const fn raw(self) -> u32 {
        match self {
            WcStatus::Success => consts::IB_WC_SUCCESS,
            WcStatus::LocLenErr => consts::IB_WC_LOC_LEN_ERR,
            WcStatus::LocQpOpErr => consts::IB_WC_LOC_QP_OP_ERR,
            WcStatus::LocEecOpErr => consts::IB_WC_LOC_EEC_OP_ERR,
            WcStatus::LocProtErr => consts::IB_WC_LOC_PROT_ERR,
            WcStatus::WrFlushErr => consts::IB_WC_WR_FLUSH_ERR,
            WcStatus::MwBindErr => consts::IB_WC_MW_BIND_ERR,
            WcStatus::BadRespErr => consts::IB_WC_BAD_RESP_ERR,
            WcStatus::LocAccessErr => consts::IB_WC_LOC_ACCESS_ERR,
            WcStatus::RemInvReqErr => consts::IB_WC_REM_INV_REQ_ERR,
            WcStatus::RemAccessErr => consts::IB_WC_REM_ACCESS_ERR,
            WcStatus::RemOpErr => consts::IB_WC_REM_OP_ERR,
            WcStatus::RetryExcErr => consts::IB_WC_RETRY_EXC_ERR,
            WcStatus::RnrRetryExcErr => consts::IB_WC_RNR_RETRY_EXC_ERR,
            WcStatus::LocRddViolErr => consts::IB_WC_LOC_RDD_VIOL_ERR,
            WcStatus::RemInvRdReqErr => consts::IB_WC_REM_INV_RD_REQ_ERR,
            WcStatus::RemAbortErr => consts::IB_WC_REM_ABORT_ERR,
            WcStatus::InvEecnErr => consts::IB_WC_INV_EECN_ERR,
            WcStatus::InvEecStateErr => consts::IB_WC_INV_EEC_STATE_ERR,
            WcStatus::FatalErr => consts::IB_WC_FATAL_ERR,
            WcStatus::RespTimeoutErr => consts::IB_WC_RESP_TIMEOUT_ERR,
            WcStatus::GeneralErr => consts::IB_WC_GENERAL_ERR,
        }
    }

    /// The status for an error CQE's syndrome (`mlx5_handle_error_cqe`); unknown syndromes are general errors.
    #[inline]
    pub const fn from_syndrome(syndrome: u8) -> Self {
        match syndrome {
            consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR => WcStatus::LocLenErr,
            consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR => WcStatus::LocQpOpErr,
            consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR => WcStatus::LocProtErr,
            consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR => WcStatus::WrFlushErr,
            consts::MLX5_CQE_SYNDROME_MW_BIND_ERR => WcStatus::MwBindErr,
            consts::MLX5_CQE_SYNDROME_BAD_RESP_ERR => WcStatus::BadRespErr,
            consts::MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR => WcStatus::LocAccessErr,
            consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR => WcStatus::RemInvReqErr,
            consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR => WcStatus::RemAccessErr,
            consts::MLX5_CQE_SYNDROME_REMOTE_OP_ERR => WcStatus::RemOpErr,
            consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR => WcStatus::RetryExcErr,
            consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
            consts::MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR => WcStatus::RemAbortErr,
            _ => WcStatus::GeneralErr,
        }
    }

    /// The verbs name (`ibv_wc_status_str` style).
    pub const fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocEecOpErr => "local EE context operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::MwBindErr => "memory bind operation error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::LocRddViolErr => "local RDD violation error",
            WcStatus::RemInvRdReqErr => "remote invalid RD request",
            WcStatus::RemAbortErr => "operation aborted",
            WcStatus::InvEecnErr => "invalid EE context number",
            WcStatus::InvEecStateErr => "invalid EE context state",
            WcStatus::FatalErr => "fatal error",
            WcStatus::RespTimeoutErr => "response timeout error",
            WcStatus::GeneralErr => "general error",
        }
    }
}

impl core::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// `ib_wc_opcode`: what the completed work request did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum WcOpcode {
    /// A SEND completed.
    #[default]
    Send,
    /// An RDMA WRITE completed.
    RdmaWrite,
    /// An RDMA READ completed.
    RdmaRead,
    /// An atomic compare-and-swap completed.
    CompSwap,
    /// An atomic fetch-and-add completed.
    FetchAdd,
    /// A masked compare-and-swap completed.
    MaskedCompSwap,
    /// A masked fetch-and-add completed.
    MaskedFetchAdd,
    /// A receive (SEND, SEND with immediate or with invalidate arrived).
    Recv,
    /// An RDMA WRITE with immediate arrived (consumed a receive WQE).
    RecvRdmaWithImm,
    /// A requester completion for a WQE opcode this driver does not post (`MLX5_OPCODE_*` kept raw).
    Unknown(u8),
}

/// `ibv_wc_flags`: the bits libibverbs defines for `ibv_wc.wc_flags` (rdma-core `libibverbs/verbs.h`; the PRM
/// headers carry only the kernel's `ib_wc_flags`, whose values differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct WcFlags(pub u32);

impl WcFlags {
    /// `IBV_WC_GRH` (1 << 0): the receive buffer starts with a GRH.
    pub const GRH: WcFlags = WcFlags(1 << 0);
    /// `IBV_WC_WITH_IMM` (1 << 1): `imm_data` is valid.
    pub const WITH_IMM: WcFlags = WcFlags(1 << 1);
    /// `IBV_WC_IP_CSUM_OK` (1 << `IBV_WC_IP_CSUM_OK_SHIFT`, 2): the device checked the IP and L4 checksums.
    pub const IP_CSUM_OK: WcFlags = WcFlags(1 << 2);
    /// `IBV_WC_WITH_INV` (1 << 3): `invalidated_rkey` is valid.
    pub const WITH_INV: WcFlags = WcFlags(1 << 3);
    /// `IBV_WC_TM_SYNC_REQ` (1 << 4): tag matching asked for a sync (never set: no tag matching here).
    pub const TM_SYNC_REQ: WcFlags = WcFlags(1 << 4);
    /// `IBV_WC_TM_MATCH` (1 << 5): a tag-matching completion matched (never set here).
    pub const TM_MATCH: WcFlags = WcFlags(1 << 5);
    /// `IBV_WC_TM_DATA_VALID` (1 << 6): tag-matching data is valid (never set here).
    pub const TM_DATA_VALID: WcFlags = WcFlags(1 << 6);

    /// Whether every flag of `o` is set.
    pub const fn contains(self, o: WcFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for WcFlags {
    type Output = WcFlags;
    fn bitor(self, o: WcFlags) -> WcFlags {
        WcFlags(self.0 | o.0)
    }
}

impl core::ops::BitOrAssign for WcFlags {
    fn bitor_assign(&mut self, o: WcFlags) {
        self.0 |= o.0;
    }
}

/// A work completion (`ib_wc` / `ibv_wc`). For an error completion only `wr_id`, `status`, `vendor_err` and
/// `qp_num` are meaningful; the rest stay zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkCompletion {
    /// The `wr_id` of the completed work request.
    pub wr_id: u64,
    /// How it completed.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// The device's vendor syndrome of an error completion.
    pub vendor_err: u32,
    /// Bytes transferred (receives, RDMA READ, atomics).
    pub byte_len: u32,
    /// Immediate data in network byte order, as `ibv_wc.imm_data` (`__be32`): the value whose in-memory bytes
    /// are the four bytes on the wire, so `u32::from_be(imm_data)` is the number the sender meant (valid with
    /// [`WcFlags::WITH_IMM`]). rdma-core's mlx5 provider copies the CQE's big-endian field unchanged.
    pub imm_data: u32,
    /// The rkey the sender invalidated (valid with [`WcFlags::WITH_INV`]).
    pub invalidated_rkey: u32,
    /// The local QP.
    pub qp_num: u32,
    /// The remote QP (UD receives).
    pub src_qp: u32,
    /// Which optional fields are valid.
    pub wc_flags: WcFlags,
    /// P_Key index (0 except on the GSI QP).
    pub pkey_index: u16,
    /// Source LID (InfiniBand receives).
    pub slid: u16,
    /// Service level on InfiniBand; on RoCE the received packet's type (bit 3: RoCE v2's UDP header, bits 2:0:
    /// GRH, IPv6 or IPv4), as rdma-core's mlx5 reports it.
    pub sl: u8,
    /// Destination LID path bits.
    pub dlid_path_bits: u8,
    /// The device clock when the CQE was written (`timestamp` of the CQE, raw ticks at `device_frequency_khz`;
    /// 0 for an error CQE, whose syndromes take those bytes, and for a software flush).
    pub timestamp: u64,
    /// VLAN of a tagged RoCE receive (verbs has no `wc_flags` bit for it: `ibv_wc_read_cvlan` of an extended CQ).
    pub vlan_id: Option<u16>,
}

/// The port's link layer decides how the address fields of a receive CQE read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum LinkLayer {
    /// InfiniBand: LIDs and SLs in the CQE.
    InfiniBand,
    /// Ethernet (RoCE): VLAN tags in the CQE.
    #[default]
    Ethernet,
}

/// One completion as a poll writes it, field by field, straight from its CQE: [`WorkCompletion`], or a host's
/// own layout (a C `ibv_wc` in the program's array), so no completion is built and copied in between.
pub trait WcOut {
    /// Starts a completion: these fields, every other one zero (as [`WorkCompletion::default`]).
    fn begin(&mut self, wr_id: u64, qp_num: u32, status: WcStatus, vendor_err: u32, timestamp: u64);
    /// What completed.
    fn set_opcode(&mut self, op: WcOpcode);
    /// Adds `flags` to the completion's flags.
    fn add_flags(&mut self, flags: WcFlags);
    /// Bytes transferred.
    fn set_byte_len(&mut self, n: u32);
    /// Immediate data, in network byte order.
    fn set_imm_data(&mut self, imm: u32);
    /// The rkey the sender invalidated.
    fn set_invalidated_rkey(&mut self, rkey: u32);
    /// The address fields of a receive: remote QP, path bits, P_Key index, source LID, SL.
    fn set_src(&mut self, src_qp: u32, dlid_path_bits: u8, pkey_index: u16, slid: u16, sl: u8);
    /// VLAN of a tagged RoCE receive.
    fn set_vlan_id(&mut self, vlan: u16);
    /// Stores a whole completion (a software flush).
    fn set(&mut self, wc: &WorkCompletion);
    /// Whether [`WcOut::begin`]'s timestamp is kept: a layout without one (C's `ibv_wc`) says no, and the
    /// decoder then does not load it (the CQE is read in place with volatile loads, which are never dropped).
    #[inline(always)]
    fn wants_timestamp(&self) -> bool {
        true
    }
}

impl WcOut for WorkCompletion {
    #[inline(always)]
    fn begin(&mut self, wr_id: u64, qp_num: u32, status: WcStatus, vendor_err: u32, timestamp: u64) {
        *self = WorkCompletion { wr_id, qp_num, status, vendor_err, timestamp, ..WorkCompletion::default() };
    }
    #[inline(always)]
    fn set_opcode(&mut self, op: WcOpcode) {
        self.opcode = op;
    }
    #[inline(always)]
    fn add_flags(&mut self, flags: WcFlags) {
        self.wc_flags |= flags;
    }
    #[inline(always)]
    fn set_byte_len(&mut self, n: u32) {
        self.byte_len = n;
    }
    #[inline(always)]
    fn set_imm_data(&mut self, imm: u32) {
        self.imm_data = imm;
    }
    #[inline(always)]
    fn set_invalidated_rkey(&mut self, rkey: u32) {
        self.invalidated_rkey = rkey;
    }
    #[inline(always)]
    fn set_src(&mut self, src_qp: u32, dlid_path_bits: u8, pkey_index: u16, slid: u16, sl: u8) {
        self.src_qp = src_qp;
        self.dlid_path_bits = dlid_path_bits;
        self.pkey_index = pkey_index;
        self.slid = slid;
        self.sl = sl;
    }
    #[inline(always)]
    fn set_vlan_id(&mut self, vlan: u16) {
        self.vlan_id = Some(vlan);
    }
    #[inline(always)]
    fn set(&mut self, wc: &WorkCompletion) {
        *self = *wc;
    }
}

/// Where a poll stores its completions. A slice of [`WorkCompletion`] is decoded in place; a host's own layout
/// (a C `ibv_wc` array) is written by the decoder itself through [`WcOut`], with no completion in between.
pub trait WcSink {
    /// One entry of the sink.
    type Out: WcOut + ?Sized;
    /// Completions it takes: the poll stops there.
    fn capacity(&self) -> usize;
    /// Runs `decode` on entry `i` (`i < capacity()`, in order); the entry holds a completion when `decode`
    /// answers `Ok(true)` (otherwise its content is unspecified). Returns what `decode` returned.
    fn fill(
        &mut self,
        i: usize,
        decode: impl FnOnce(&mut Self::Out) -> Result<bool, CqeError>,
    ) -> Result<bool, CqeError>;
}

impl WcSink for [WorkCompletion] {
    type Out = WorkCompletion;
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.len()
    }
    #[inline(always)]
    fn fill(
        &mut self,
        i: usize,
        decode: impl FnOnce(&mut WorkCompletion) -> Result<bool, CqeError>,
    ) -> Result<bool, CqeError> {
        decode(&mut self[i])
    }
}

/// Maps a CQE back to the work request it completes. The queue pairs that feed a CQ implement it: a send CQE
/// names the WQE by its counter (and retires every unsignaled WQE before it), a receive CQE completes the oldest
/// posted receive (or WQE `wqe_counter` of an SRQ).
pub trait WrTable {
    /// `wr_id` of the send WQE `wqe_counter` of QP `qpn`; `None` when the QP is not known here.
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64>;
    /// `wr_id` of the receive completed on QP `qpn` (`srqn` non-zero for an SRQ); `None` when unknown.
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64>;
    /// The software completion ([`WcStatus::WrFlushErr`]) of the oldest work request still outstanding on a queue
    /// that completes on CQ `cqn`, which is retired; `None` when there is none. Only asked for when the device
    /// will write no more CQEs to `cqn`: with `dead` (the HCA is in internal error) every such queue is flushed,
    /// otherwise (the CQ failed) only the queues of QPs the driver moved to ERR, whose work the device no longer
    /// executes.
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion>;
    /// The SRQ QP `qpn` receives through, when it has one (its receive completions name SRQ WQEs); `None` for
    /// a QP with its own receive queue or one not known here.
    fn recv_srqn(&self, _qpn: u32) -> Option<u32> {
        None
    }
    /// Whether [`WrTable::recv_done`] reads its `srqn` and `wqe_counter`. A table that completes receives in
    /// posting order (a QP with its own receive queue) says no, and the poll then does not load them.
    fn recv_needs_index(&self) -> bool {
        true
    }
}

/// A CQE the driver cannot accept: the device wrote something it should not have. It is consumed (the ring moves
/// on) and reported; completions before it were returned by the previous poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CqeError {
    /// A CQE for a QP that has no queue on this CQ.
    UnknownQp {
        /// The CQ.
        cqn: u32,
        /// The QP the CQE names.
        qpn: u32,
        /// The CQE index.
        index: u32,
    },
    /// An opcode the driver never asked for (compressed CQEs, tag matching, a resize marker with no resize).
    BadOpcode {
        /// The CQ.
        cqn: u32,
        /// The `op_own` byte.
        op_own: u8,
        /// The CQE index.
        index: u32,
    },
    /// A receive CQE of a QP attached to an SRQ whose `wqe_counter` names no posted WQE of that SRQ.
    BadSrqWqe {
        /// The CQ.
        cqn: u32,
        /// The QP.
        qpn: u32,
        /// The SRQ the QP receives through.
        srqn: u32,
        /// The WQE index the CQE names.
        wqe_counter: u16,
        /// The CQE index.
        index: u32,
    },
}

impl core::fmt::Display for CqeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            CqeError::UnknownQp { cqn, qpn, index } => {
                write!(f, "CQE {index} of CQ {cqn:#x} names QP {qpn:#x}, which has no queue on it")
            }
            CqeError::BadOpcode { cqn, op_own, index } => {
                write!(f, "CQE {index} of CQ {cqn:#x} has op_own {op_own:#04x}, which the driver never enabled")
            }
            CqeError::BadSrqWqe { cqn, qpn, srqn, wqe_counter, index } => write!(
                f,
                "CQE {index} of CQ {cqn:#x} (QP {qpn:#x}) names WQE {wqe_counter} of SRQ {srqn:#x}, which is not posted"
            ),
        }
    }
}

impl core::error::Error for CqeError {}

/// Decodes a software-owned CQE into a work completion (`mlx5_poll_one`): `Ok(None)` for entries that are not
/// completions (a signature error report, a resize marker).
pub fn decode_cqe(
    cqe: &Cqe,
    cqn: u32,
    index: u32,
    link: LinkLayer,
    wq: &mut (impl WrTable + ?Sized),
) -> Result<Option<WorkCompletion>, CqeError> {
    let mut wc = WorkCompletion::default();
    Ok(decode_into(cqe, cqn, index, link, wq, &mut wc)?.then_some(wc))
}

/// [`decode_cqe`] into `out`: `Ok(true)` when `out` now holds the completion; `out` is untouched otherwise.
/// `cqe` is a copy ([`Cqe`]) or the entry in place ([`CqeRef`](super::cqe::CqeRef)); each field is read once.
/// Always inlined: a call per CQE costs a poll about a sixth of its instructions, and a caller with two poll
/// loops (the drop-in's) was left with it out of line.
#[inline(always)]
pub(super) fn decode_into<C: CqeFieldsRead + ?Sized, O: WcOut + ?Sized>(
    cqe: &C,
    cqn: u32,
    index: u32,
    link: LinkLayer,
    wq: &mut (impl WrTable + ?Sized),
    out: &mut O,
) -> Result<bool, CqeError> {
    let op_own = cqe.op_own();
    let bad = || CqeError::BadOpcode { cqn, op_own, index };
    if (op_own >> 2) & 3 == consts::MLX5_COMPRESSED {
        return Err(bad());
    }
    match CqeOpcode::from_raw(op_own >> 4) {
        CqeOpcode::Req => {
            let sop_drop_qpn = cqe.sop_drop_qpn();
            let qpn = sop_drop_qpn & 0xff_ffff;
            let wr_id = wq.send_done(qpn, cqe.wqe_counter()).ok_or(CqeError::UnknownQp { cqn, qpn, index })?;
            // Written in place: every field, the ones a requester completion does not carry as zero.
            out.begin(wr_id, qpn, WcStatus::Success, 0, if out.wants_timestamp() { cqe.timestamp() } else { 0 });
            decode_req(cqe, (sop_drop_qpn >> 24) as u8, out);
        }
        op @ (CqeOpcode::RespWrImm | CqeOpcode::RespSend | CqeOpcode::RespSendImm | CqeOpcode::RespSendInv) => {
            let qpn = cqe.sop_drop_qpn() & 0xff_ffff;
            let (srqn, counter) = if wq.recv_needs_index() { (cqe.srqn(), cqe.wqe_counter()) } else { (0, 0) };
            let wr_id = match wq.recv_done(qpn, srqn, counter) {
                Some(id) => id,
                None => return Err(recv_fault(wq, cqe, cqn, qpn, index)),
            };
            out.begin(wr_id, qpn, WcStatus::Success, 0, if out.wants_timestamp() { cqe.timestamp() } else { 0 });
            decode_resp(cqe, op.raw(), link, out);
        }
        op @ (CqeOpcode::ReqErr | CqeOpcode::RespErr) => {
            let qpn = cqe.err_qpn();
            let wr_id = if op == CqeOpcode::ReqErr {
                wq.send_done(qpn, cqe.wqe_counter()).ok_or(CqeError::UnknownQp { cqn, qpn, index })?
            } else {
                match wq.recv_done(qpn, cqe.srqn(), cqe.wqe_counter()) {
                    Some(id) => id,
                    None => return Err(recv_fault(wq, cqe, cqn, qpn, index)),
                }
            };
            out.begin(wr_id, qpn, WcStatus::from_syndrome(cqe.err_syndrome()), cqe.vendor_err().into(), 0);
        }
        // Signature errors report on a memory key, not a work request (the kernel records and re-polls).
        CqeOpcode::SigErr => return Ok(false),
        CqeOpcode::Resize | CqeOpcode::Invalid | CqeOpcode::Unknown(_) => return Err(bad()),
    }
    Ok(true)
}

/// Why a receive CQE names no work request: a WQE its QP's SRQ does not have posted, or a QP with no receive
/// queue on this CQ.
#[cold]
fn recv_fault<C: CqeFieldsRead + ?Sized>(
    wq: &(impl WrTable + ?Sized),
    cqe: &C,
    cqn: u32,
    qpn: u32,
    index: u32,
) -> CqeError {
    match wq.recv_srqn(qpn) {
        Some(srqn) => CqeError::BadSrqWqe { cqn, qpn, srqn, wqe_counter: cqe.wqe_counter(), index },
        None => CqeError::UnknownQp { cqn, qpn, index },
    }
}

/// Requester fields (`handle_good_req`); `op` is the completed WQE's opcode (`sop_drop_qpn >> 24`).
#[inline]
fn decode_req<C: CqeFieldsRead + ?Sized, O: WcOut + ?Sized>(cqe: &C, op: u8, wc: &mut O) {
    match op {
        consts::MLX5_OPCODE_RDMA_WRITE_IMM => {
            wc.add_flags(WcFlags::WITH_IMM);
            wc.set_opcode(WcOpcode::RdmaWrite);
        }
        consts::MLX5_OPCODE_RDMA_WRITE => wc.set_opcode(WcOpcode::RdmaWrite),
        consts::MLX5_OPCODE_SEND_IMM => {
            wc.add_flags(WcFlags::WITH_IMM);
            wc.set_opcode(WcOpcode::Send);
        }
        consts::MLX5_OPCODE_SEND | consts::MLX5_OPCODE_SEND_INVAL => wc.set_opcode(WcOpcode::Send),
        consts::MLX5_OPCODE_RDMA_READ => {
            wc.set_opcode(WcOpcode::RdmaRead);
            wc.set_byte_len(cqe.byte_cnt());
        }
        consts::MLX5_OPCODE_ATOMIC_CS => {
            wc.set_opcode(WcOpcode::CompSwap);
            wc.set_byte_len(8);
        }
        consts::MLX5_OPCODE_ATOMIC_FA => {
            wc.set_opcode(WcOpcode::FetchAdd);
            wc.set_byte_len(8);
        }
        consts::MLX5_OPCODE_ATOMIC_MASKED_CS => {
            wc.set_opcode(WcOpcode::MaskedCompSwap);
            wc.set_byte_len(8);
        }
        consts::MLX5_OPCODE_ATOMIC_MASKED_FA => {
            wc.set_opcode(WcOpcode::MaskedFetchAdd);
            wc.set_byte_len(8);
        }
        _ => wc.set_opcode(WcOpcode::Unknown(op)),
    }
}

/// Bits of `hds_ip_ext` saying the device verified the L3 and L4 checksums (`CQE_L3_OK`, `CQE_L4_OK`).
const CQE_L3_L4_OK: u8 = (consts::CQE_L3_OK | consts::CQE_L4_OK) as u8;

/// Responder fields (`handle_responder`); `op` is the CQE opcode (one of the `MLX5_CQE_RESP_*` receives).
#[inline]
fn decode_resp<C: CqeFieldsRead + ?Sized, O: WcOut + ?Sized>(cqe: &C, op: u8, link: LinkLayer, wc: &mut O) {
    // `begin` left the flags empty: each case adds its own.
    wc.set_byte_len(cqe.byte_cnt());
    match op {
        consts::MLX5_CQE_RESP_WR_IMM => {
            wc.set_opcode(WcOpcode::RecvRdmaWithImm);
            wc.add_flags(WcFlags::WITH_IMM);
            wc.set_imm_data(cqe.imm_data_be());
        }
        consts::MLX5_CQE_RESP_SEND => {
            wc.set_opcode(WcOpcode::Recv);
            if cqe.hds_ip_ext() & CQE_L3_L4_OK == CQE_L3_L4_OK {
                wc.add_flags(WcFlags::IP_CSUM_OK);
            }
        }
        consts::MLX5_CQE_RESP_SEND_IMM => {
            wc.set_opcode(WcOpcode::Recv);
            wc.add_flags(WcFlags::WITH_IMM);
            wc.set_imm_data(cqe.imm_data_be());
        }
        _ => {
            wc.set_opcode(WcOpcode::Recv);
            wc.add_flags(WcFlags::WITH_INV);
            wc.set_invalidated_rkey(cqe.imm_inval_pkey());
        }
    }
    let fr = cqe.flags_rqpn();
    if (fr >> 28) & 3 != 0 {
        wc.add_flags(WcFlags::GRH);
    }
    // Only the GSI QP sees P_Keys per packet; every other QP has one (`pkey_index` 0).
    // As rdma-core's mlx5 `handle_responder`, on every link layer: bits 27:24 are the SL on InfiniBand and, on
    // RoCE, the packet type (bit 3: UDP, RoCE v2; bits 2:0: `MLX5_CQE_ROCE_L3_HEADER_TYPE_*`), which UD consumers
    // such as UCX read to find an IPv4 header in the GRH room. (mlx5_ib puts the VLAN priority there instead.)
    wc.set_src(fr & 0xff_ffff, cqe.ml_path(), 0, cqe.slid(), ((fr >> 24) & 0xf) as u8);
    if link == LinkLayer::Ethernet && cqe.l4_l3_hdr_type() & 1 != 0 {
        wc.set_vlan_id(cqe.vlan_info() & 0xfff);
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    use crate::cq::cqe::CqeFields;

    /// A work-request table that knows one QP and answers with fixed `wr_id`s, recording what was asked.
    #[derive(Default)]
    struct OneQp {
        qpn: u32,
        sends: u32,
        recvs: u32,
        last_counter: u16,
    }

    impl WrTable for OneQp {
        fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
            self.sends += 1;
            self.last_counter = wqe_counter;
            (qpn == self.qpn).then_some(0x5e0d)
        }
        fn recv_done(&mut self, qpn: u32, _srqn: u32, wqe_counter: u16) -> Option<u64> {
            self.recvs += 1;
            self.last_counter = wqe_counter;
            (qpn == self.qpn).then_some(0x4ec7)
        }
        fn flush_one(&mut self, _cqn: u32, _dead: bool) -> Option<WorkCompletion> {
            None
        }
    }

    fn decode(f: CqeFields, link: LinkLayer, wq: &mut OneQp) -> Result<Option<WorkCompletion>, CqeError> {
        decode_cqe(&f.emit(), 3, 9, link, wq)
    }

    fn req(wqe_opcode: u8) -> CqeFields {
        CqeFields {
            opcode: consts::MLX5_CQE_REQ,
            wqe_opcode,
            qpn: 0x42,
            wqe_counter: 5,
            byte_cnt: 100,
            ..CqeFields::default()
        }
    }

    #[test]
    fn requester_send_completes_the_named_wqe() {
        let mut wq = OneQp { qpn: 0x42, ..OneQp::default() };
        let wc = decode(req(consts::MLX5_OPCODE_SEND), LinkLayer::InfiniBand, &mut wq).unwrap().unwrap();
        assert_eq!((wc.status, wc.opcode, wc.wr_id, wc.qp_num), (WcStatus::Success, WcOpcode::Send, 0x5e0d, 0x42));
        assert_eq!((wq.sends, wq.recvs, wq.last_counter), (1, 0, 5));
    }

    #[test]
    fn requester_byte_len_is_set_for_reads_and_atomics_only() {
        let mut wq = OneQp { qpn: 0x42, ..OneQp::default() };
        let read = decode(req(consts::MLX5_OPCODE_RDMA_READ), LinkLayer::InfiniBand, &mut wq).unwrap().unwrap();
        assert_eq!((read.opcode, read.byte_len), (WcOpcode::RdmaRead, 100));
        let fa = decode(req(consts::MLX5_OPCODE_ATOMIC_FA), LinkLayer::InfiniBand, &mut wq).unwrap().unwrap();
        assert_eq!((fa.opcode, fa.byte_len), (WcOpcode::FetchAdd, 8));
        let write = decode(req(consts::MLX5_OPCODE_RDMA_WRITE_IMM), LinkLayer::InfiniBand, &mut wq).unwrap().unwrap();
        assert_eq!((write.opcode, write.byte_len), (WcOpcode::RdmaWrite, 0));
        assert!(write.wc_flags.contains(WcFlags::WITH_IMM));
    }

    #[test]
    fn responder_send_with_immediate_reports_the_immediate_and_source() {
        let mut wq = OneQp { qpn: 0x42, ..OneQp::default() };
        let f = CqeFields {
            opcode: consts::MLX5_CQE_RESP_SEND_IMM,
            qpn: 0x42,
            byte_cnt: 64,
            imm_inval_pkey: 0x1234_5678,
            flags_rqpn: (2 << 28) | (5 << 24) | 0x77,
            slid: 9,
            ..CqeFields::default()
        };
        let wc = decode(f, LinkLayer::InfiniBand, &mut wq).unwrap().unwrap();
        // ibv_wc.imm_data is __be32: its bytes in memory are the wire's.
        assert_eq!(wc.imm_data.to_ne_bytes(), [0x12, 0x34, 0x56, 0x78]);
        assert_eq!(
            (wc.opcode, wc.byte_len, u32::from_be(wc.imm_data), wc.wr_id),
            (WcOpcode::Recv, 64, 0x1234_5678, 0x4ec7)
        );
        assert!(wc.wc_flags.contains(WcFlags::WITH_IMM) && wc.wc_flags.contains(WcFlags::GRH));
        assert_eq!((wc.src_qp, wc.sl, wc.slid), (0x77, 5, 9));
        assert_eq!(wq.recvs, 1);
    }

    #[test]
    fn responder_on_ethernet_takes_the_vlan_only_when_tagged() {
        let mut wq = OneQp { qpn: 1, ..OneQp::default() };
        let base = CqeFields {
            opcode: consts::MLX5_CQE_RESP_SEND,
            qpn: 1,
            vlan_info: (3 << 13) | 0x123,
            ..CqeFields::default()
        };
        let untagged = decode(base, LinkLayer::Ethernet, &mut wq).unwrap().unwrap();
        assert_eq!(untagged.vlan_id, None);
        let tagged = decode(CqeFields { l4_l3_hdr_type: 1, ..base }, LinkLayer::Ethernet, &mut wq).unwrap().unwrap();
        assert_eq!(tagged.vlan_id, Some(0x123));
    }

    #[test]
    fn responder_on_roce_reports_the_packet_type_as_the_sl() {
        // rdma-core's mlx5 takes `wc->sl` from flags_rqpn bits 27:24 on RoCE too: the RoCE packet type (bit 3 UDP,
        // bits 2:0 the L3 header type). UCX's ud_verbs masks it with 7 and takes 2 for an IPv4 GRH room. Before,
        // the core left sl 0 on Ethernet (or put the VLAN priority there, as mlx5_ib does).
        let mut wq = OneQp { qpn: 1, ..OneQp::default() };
        let udp = 1 << 3;
        for (l3, sl) in [
            (consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV4, 0xa),
            (consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV6, 0x9),
            (consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_GRH, 0),
        ] {
            let roce = if l3 == consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_GRH { 0 } else { udp };
            let f = CqeFields {
                opcode: consts::MLX5_CQE_RESP_SEND,
                qpn: 1,
                flags_rqpn: (1 << 28) | ((roce | l3) << 24) | 0x77,
                l4_l3_hdr_type: 1,
                vlan_info: (5 << 13) | 0x123,
                ..CqeFields::default()
            };
            let wc = decode(f, LinkLayer::Ethernet, &mut wq).unwrap().unwrap();
            assert_eq!((wc.sl, wc.sl & 7, wc.src_qp, wc.vlan_id), (sl, l3 as u8, 0x77, Some(0x123)));
            assert!(wc.wc_flags.contains(WcFlags::GRH));
        }
    }

    #[test]
    fn wc_flags_have_the_ibv_wc_values_of_verbs_h() {
        // libibverbs verbs.h `enum ibv_wc_flags`.
        let bits = [WcFlags::GRH, WcFlags::WITH_IMM, WcFlags::IP_CSUM_OK, WcFlags::WITH_INV, WcFlags::TM_SYNC_REQ];
        assert_eq!(bits.map(|f| f.0), [1, 2, 4, 8, 16]);
        assert_eq!((WcFlags::TM_MATCH.0, WcFlags::TM_DATA_VALID.0), (32, 64));
    }

    #[test]
    fn error_cqe_maps_syndrome_and_keeps_vendor_error() {
        let mut wq = OneQp { qpn: 0x42, ..OneQp::default() };
        let f = CqeFields {
            opcode: consts::MLX5_CQE_REQ_ERR,
            qpn: 0x42,
            syndrome: consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR,
            vendor_err: 0xf5,
            ..CqeFields::default()
        };
        let wc = decode(f, LinkLayer::InfiniBand, &mut wq).unwrap().unwrap();
        assert_eq!((wc.status, wc.vendor_err, wc.qp_num, wc.wr_id), (WcStatus::WrFlushErr, 0xf5, 0x42, 0x5e0d));
        assert_eq!((wq.sends, wq.recvs), (1, 0));
    }

    #[test]
    fn syndromes_map_to_verbs_statuses_and_unknown_ones_are_general() {
        assert_eq!(WcStatus::from_syndrome(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR), WcStatus::LocLenErr);
        assert_eq!(WcStatus::from_syndrome(consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR), WcStatus::RnrRetryExcErr);
        assert_eq!(WcStatus::from_syndrome(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR), WcStatus::RemAccessErr);
        assert_eq!(WcStatus::from_syndrome(0xee), WcStatus::GeneralErr);
    }

    #[test]
    fn completions_of_unknown_qps_are_errors() {
        let mut wq = OneQp { qpn: 0x42, ..OneQp::default() };
        let f = CqeFields { qpn: 0x43, ..req(consts::MLX5_OPCODE_SEND) };
        assert_eq!(decode(f, LinkLayer::InfiniBand, &mut wq), Err(CqeError::UnknownQp { cqn: 3, qpn: 0x43, index: 9 }));
    }

    #[test]
    fn resize_markers_and_compressed_cqes_are_rejected_and_signature_errors_skipped() {
        let mut wq = OneQp { qpn: 0x42, ..OneQp::default() };
        let resize = CqeFields { opcode: consts::MLX5_CQE_RESIZE_CQ, ..CqeFields::default() };
        assert!(matches!(decode(resize, LinkLayer::InfiniBand, &mut wq), Err(CqeError::BadOpcode { index: 9, .. })));
        let sig = CqeFields { opcode: consts::MLX5_CQE_SIG_ERR, ..CqeFields::default() };
        assert_eq!(decode(sig, LinkLayer::InfiniBand, &mut wq), Ok(None));
        let mut compressed = req(consts::MLX5_OPCODE_SEND).emit();
        compressed.0[crate::cq::cqe::field::OP_OWN.off] |= consts::MLX5_COMPRESSED << 2;
        assert!(decode_cqe(&compressed, 3, 9, LinkLayer::InfiniBand, &mut wq).is_err());
        assert_eq!(wq.sends, 0, "nothing was retired");
    }
}

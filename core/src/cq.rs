//! Completion queues (PRM CREATE_CQ / DESTROY_CQ / QUERY_CQ / MODIFY_CQ; Linux `cq.c`, mlx5_ib `cq.c`
//! `mlx5_poll_one`, rdma-core `mlx5_poll_cq`).
//!
//! The ring: `2^log_nent` CQEs of 64 or 128 bytes, owned by the device until it writes one, then by software until
//! the consumer index published in the doorbell record passes it. A CQE at index `n` is software's when its opcode
//! is not `MLX5_CQE_INVALID` and its owner bit equals bit `log_nent` of `n` (`get_sw_cqe`): the device writes
//! owner 0 on its first pass over the ring, 1 on the second, and so on. Buffers start with every `op_own` at 0xF1
//! (invalid opcode, owner 1), so nothing is software-owned before the device writes.

use crate::buf::QueueBuf;
use crate::cmd::{len_with_pas, write_pas, Pas, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::dbr::DbRec;
use crate::hal::{DmaView, Mmio};
use crate::prm::{c, consts, ifc, MsgBuf, Opcode, SubBuf};

/// CQE size (`cqc.cqe_sz`: `CQE_STRIDE_64` = 0, `CQE_STRIDE_128` = 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CqeSize {
    #[default]
    B64,
    B128,
}

impl CqeSize {
    pub const fn bytes(self) -> usize {
        match self {
            CqeSize::B64 => 64,
            CqeSize::B128 => 128,
        }
    }

    const fn raw(self) -> u32 {
        match self {
            CqeSize::B64 => consts::CQE_STRIDE_64,
            CqeSize::B128 => consts::CQE_STRIDE_128,
        }
    }

    pub const fn from_raw(v: u32) -> Option<Self> {
        match v {
            consts::CQE_STRIDE_64 => Some(CqeSize::B64),
            consts::CQE_STRIDE_128 => Some(CqeSize::B128),
            _ => None,
        }
    }
}

/// The `cqc` fields the driver sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CqContext {
    pub cqe_sz: CqeSize,
    /// log2 of the number of CQEs.
    pub log_cq_size: u8,
    pub uar_page: u32,
    /// The EQ completion events go to.
    pub c_eqn: u32,
    /// Page size of `pas[]` relative to 4 KiB.
    pub log_page_size: u8,
    pub page_offset: u8,
    /// Bus address of the CQ doorbell record.
    pub dbr_addr: u64,
    /// Overrun ignore: the device does not report overruns of this CQ.
    pub oi: bool,
}

/// `CREATE_CQ`: context and buffer pages; the output is the 24-bit CQ number.
#[derive(Debug, Clone, Copy)]
pub struct CreateCq<'a> {
    pub ctx: CqContext,
    pub pas: Pas<'a>,
}

impl Command for CreateCq<'_> {
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateCq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_cq_in::PAS, self.pas.len())
    }
    fn outlen(&self) -> usize {
        ifc::create_cq_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::CreateCq, 0);
        {
            let mut cqc = SubBuf::new(msg, ifc::create_cq_in::CQ_CONTEXT);
            cqc.set(ifc::cqc::CQE_SZ, self.ctx.cqe_sz.raw());
            cqc.set(ifc::cqc::OI, self.ctx.oi.into());
            cqc.set(ifc::cqc::LOG_CQ_SIZE, self.ctx.log_cq_size.into());
            cqc.set(ifc::cqc::UAR_PAGE, self.ctx.uar_page);
            cqc.set(ifc::cqc::C_EQN_OR_APU_ELEMENT, self.ctx.c_eqn);
            cqc.set(ifc::cqc::LOG_PAGE_SIZE, self.ctx.log_page_size.into());
            cqc.set(ifc::cqc::PAGE_OFFSET, self.ctx.page_offset.into());
            cqc.set64(ifc::cqc::DBR_ADDR, self.ctx.dbr_addr);
        }
        write_pas(msg, ifc::create_cq_in::PAS, self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u32, CmdError> {
        Ok(out.get(ifc::create_cq_out::CQN))
    }
}

/// `DESTROY_CQ`.
pub fn destroy_cq(cqn: u32) -> Simple {
    Simple::new(Opcode::DestroyCq, ifc::destroy_cq_in::SIZE_BYTES, ifc::destroy_cq_out::SIZE_BYTES)
        .arg(ifc::destroy_cq_in::CQN, cqn)
}

/// The context `QUERY_CQ` reports (`mlx5_core_query_cq`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CqState {
    /// `MLX5_CQC_STATUS_*`: 0 ok, 9 overflow, 10 write fail.
    pub status: u8,
    /// `cqc.st`: armed (9), solicited-armed (6), fired (10), ...
    pub st: u8,
    pub cqe_sz: u8,
    pub oi: bool,
    pub log_cq_size: u8,
    pub uar_page: u32,
    pub c_eqn: u32,
    pub log_page_size: u8,
    pub cq_period: u16,
    pub cq_max_count: u16,
    pub consumer_counter: u32,
    pub producer_counter: u32,
    pub dbr_addr: u64,
}

impl CqState {
    /// Whether the device stopped the CQ because it overran.
    pub fn overflowed(&self) -> bool {
        u32::from(self.status) == consts::MLX5_CQC_STATUS_CQ_OVERFLOW
    }
}

/// `QUERY_CQ`.
#[derive(Debug, Clone, Copy)]
pub struct QueryCq {
    pub cqn: u32,
}

impl Command for QueryCq {
    type Output = CqState;
    fn opcode(&self) -> Opcode {
        Opcode::QueryCq
    }
    fn inlen(&self) -> usize {
        ifc::query_cq_in::SIZE_BYTES
    }
    fn outlen(&self) -> usize {
        // The context only; the page list that follows is not needed.
        ifc::query_cq_out::PAS.byte_off()
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryCq, 0);
        msg.set(ifc::query_cq_in::CQN, self.cqn);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<CqState, CmdError> {
        use ifc::cqc as q;
        let at = |f: crate::prm::Field| out.get(f.at(ifc::query_cq_out::CQ_CONTEXT));
        Ok(CqState {
            status: at(q::STATUS) as u8,
            st: at(q::ST) as u8,
            cqe_sz: at(q::CQE_SZ) as u8,
            oi: at(q::OI) != 0,
            log_cq_size: at(q::LOG_CQ_SIZE) as u8,
            uar_page: at(q::UAR_PAGE),
            c_eqn: at(q::C_EQN_OR_APU_ELEMENT),
            log_page_size: at(q::LOG_PAGE_SIZE) as u8,
            cq_period: at(q::CQ_PERIOD) as u16,
            cq_max_count: at(q::CQ_MAX_COUNT) as u16,
            consumer_counter: at(q::CONSUMER_COUNTER),
            producer_counter: at(q::PRODUCER_COUNTER),
            dbr_addr: out.get64(q::DBR_ADDR.at(ifc::query_cq_out::CQ_CONTEXT)),
        })
    }
}

/// `MODIFY_CQ` changing moderation (`mlx5_core_modify_cq_moderation`): an event after `cq_max_count` CQEs or
/// `cq_period` microseconds, whichever comes first.
#[derive(Debug, Clone, Copy)]
pub struct ModifyCqModeration {
    pub cqn: u32,
    pub cq_period: u16,
    pub cq_max_count: u16,
}

impl Command for ModifyCqModeration {
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ModifyCq
    }
    fn inlen(&self) -> usize {
        ifc::modify_cq_in::PAS.byte_off()
    }
    fn outlen(&self) -> usize {
        ifc::modify_cq_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::modify_cq_in as m;
        write_header(msg, Opcode::ModifyCq, 0);
        msg.set(m::CQN, self.cqn);
        let select = ifc::modify_field_select::MODIFY_FIELD_SELECT.at(m::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT);
        msg.set(select, consts::MLX5_CQ_MODIFY_PERIOD | consts::MLX5_CQ_MODIFY_COUNT);
        msg.set(ifc::cqc::CQ_PERIOD.at(m::CQ_CONTEXT), self.cq_period.into());
        msg.set(ifc::cqc::CQ_MAX_COUNT.at(m::CQ_CONTEXT), self.cq_max_count.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// `MODIFY_CQ` with `MLX5_CQ_OPMOD_RESIZE` (`mlx5_ib_resize_cq`): a new ring size and buffer.
#[derive(Debug, Clone, Copy)]
pub struct ResizeCq<'a> {
    pub cqn: u32,
    /// Unchanged by a resize, but sent again as mlx5_ib does.
    pub cqe_sz: CqeSize,
    pub log_cq_size: u8,
    pub log_page_size: u8,
    pub page_offset: u8,
    pub pas: Pas<'a>,
}

impl Command for ResizeCq<'_> {
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ModifyCq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::modify_cq_in::PAS, self.pas.len())
    }
    fn outlen(&self) -> usize {
        ifc::modify_cq_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::modify_cq_in as m;
        write_header(msg, Opcode::ModifyCq, consts::MLX5_CQ_OPMOD_RESIZE as u16);
        msg.set(m::CQN, self.cqn);
        let select = ifc::resize_field_select::RESIZE_FIELD_SELECT.at(m::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT);
        msg.set(
            select,
            consts::MLX5_MODIFY_CQ_MASK_LOG_SIZE
                | consts::MLX5_MODIFY_CQ_MASK_PG_OFFSET
                | consts::MLX5_MODIFY_CQ_MASK_PG_SIZE,
        );
        msg.set(ifc::cqc::CQE_SZ.at(m::CQ_CONTEXT), self.cqe_sz.raw());
        msg.set(ifc::cqc::LOG_CQ_SIZE.at(m::CQ_CONTEXT), self.log_cq_size.into());
        msg.set(ifc::cqc::LOG_PAGE_SIZE.at(m::CQ_CONTEXT), self.log_page_size.into());
        msg.set(ifc::cqc::PAGE_OFFSET.at(m::CQ_CONTEXT), self.page_offset.into());
        write_pas(msg, m::PAS, self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------------
// CQEs

/// The CQE opcode (upper nibble of `op_own`, `MLX5_CQE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CqeOpcode {
    /// A send-queue WQE completed (`MLX5_CQE_REQ`).
    Req,
    RespWrImm,
    RespSend,
    RespSendImm,
    RespSendInv,
    /// Marks where a resized CQ switched buffers.
    Resize,
    SigErr,
    ReqErr,
    RespErr,
    Invalid,
    Unknown(u8),
}

impl CqeOpcode {
    #[inline]
    pub const fn from_raw(v: u8) -> Self {
        match v as u32 {
            consts::MLX5_CQE_REQ => CqeOpcode::Req,
            consts::MLX5_CQE_RESP_WR_IMM => CqeOpcode::RespWrImm,
            consts::MLX5_CQE_RESP_SEND => CqeOpcode::RespSend,
            consts::MLX5_CQE_RESP_SEND_IMM => CqeOpcode::RespSendImm,
            consts::MLX5_CQE_RESP_SEND_INV => CqeOpcode::RespSendInv,
            consts::MLX5_CQE_RESIZE_CQ => CqeOpcode::Resize,
            consts::MLX5_CQE_SIG_ERR => CqeOpcode::SigErr,
            consts::MLX5_CQE_REQ_ERR => CqeOpcode::ReqErr,
            consts::MLX5_CQE_RESP_ERR => CqeOpcode::RespErr,
            consts::MLX5_CQE_INVALID => CqeOpcode::Invalid,
            _ => CqeOpcode::Unknown(v),
        }
    }

    pub const fn raw(self) -> u8 {
        (match self {
            CqeOpcode::Req => consts::MLX5_CQE_REQ,
            CqeOpcode::RespWrImm => consts::MLX5_CQE_RESP_WR_IMM,
            CqeOpcode::RespSend => consts::MLX5_CQE_RESP_SEND,
            CqeOpcode::RespSendImm => consts::MLX5_CQE_RESP_SEND_IMM,
            CqeOpcode::RespSendInv => consts::MLX5_CQE_RESP_SEND_INV,
            CqeOpcode::Resize => consts::MLX5_CQE_RESIZE_CQ,
            CqeOpcode::SigErr => consts::MLX5_CQE_SIG_ERR,
            CqeOpcode::ReqErr => consts::MLX5_CQE_REQ_ERR,
            CqeOpcode::RespErr => consts::MLX5_CQE_RESP_ERR,
            CqeOpcode::Invalid => consts::MLX5_CQE_INVALID,
            CqeOpcode::Unknown(v) => v as u32,
        }) as u8
    }
}

/// Bytes of the 64-byte CQE image (`struct mlx5_cqe64`).
pub const CQE64_SIZE: usize = c::mlx5_cqe64::SIZE;

/// `op_own` of a CQE nobody wrote: invalid opcode, owner 1.
pub const CQE_INIT_OP_OWN: u8 = ((consts::MLX5_CQE_INVALID as u8) << 4) | consts::MLX5_CQE_OWNER_MASK as u8;

/// A CQE copied out of the ring (`struct mlx5_cqe64`; an error CQE reads the same bytes as `struct mlx5_err_cqe`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE64_SIZE]);

impl core::fmt::Debug for Cqe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Cqe")
            .field("opcode", &self.opcode())
            .field("qpn", &self.qpn())
            .field("wqe_counter", &self.wqe_counter())
            .field("byte_cnt", &self.byte_cnt())
            .finish_non_exhaustive()
    }
}

mod field {
    pub use crate::prm::c::mlx5_cqe64::*;
    pub use crate::prm::c::mlx5_err_cqe::{SYNDROME as ERR_SYNDROME, S_WQE_OPCODE_QPN, VENDOR_ERR_SYND};
}

impl Cqe {
    #[inline]
    fn be(&self, m: crate::prm::Bytes) -> u32 {
        m.get_be(&self.0, 0)
    }

    #[inline]
    pub fn op_own(&self) -> u8 {
        self.0[field::OP_OWN.off]
    }
    #[inline]
    pub fn opcode(&self) -> CqeOpcode {
        CqeOpcode::from_raw(self.op_own() >> 4)
    }
    #[inline]
    pub fn owner(&self) -> u8 {
        self.op_own() & consts::MLX5_CQE_OWNER_MASK as u8
    }
    /// Bits 3:2 of `op_own`: 0 for a normal CQE, `MLX5_COMPRESSED` for a compressed session header.
    #[inline]
    pub fn format(&self) -> u8 {
        (self.op_own() >> 2) & 3
    }
    /// The solicited-event bit (bit 1 of `op_own`).
    #[inline]
    pub fn solicited(&self) -> bool {
        self.op_own() & 2 != 0
    }
    /// The WQE opcode of a requester CQE (`sop_drop_qpn >> 24`).
    #[inline]
    pub fn wqe_opcode(&self) -> u8 {
        (self.be(field::SOP_DROP_QPN) >> 24) as u8
    }
    #[inline]
    pub fn qpn(&self) -> u32 {
        self.be(field::SOP_DROP_QPN) & 0xff_ffff
    }
    #[inline]
    pub fn wqe_counter(&self) -> u16 {
        self.be(field::WQE_COUNTER) as u16
    }
    #[inline]
    pub fn byte_cnt(&self) -> u32 {
        self.be(field::BYTE_CNT)
    }
    /// Immediate data, invalidated rkey or pkey, by opcode.
    #[inline]
    pub fn imm_inval_pkey(&self) -> u32 {
        self.be(field::IMMEDIATE)
    }
    #[inline]
    pub fn flags_rqpn(&self) -> u32 {
        self.be(field::FLAGS_RQPN)
    }
    #[inline]
    pub fn srqn(&self) -> u32 {
        self.be(field::SRQN) & 0xff_ffff
    }
    #[inline]
    pub fn slid(&self) -> u16 {
        self.be(field::SLID) as u16
    }
    #[inline]
    pub fn ml_path(&self) -> u8 {
        self.0[field::ML_PATH.off]
    }
    #[inline]
    pub fn hds_ip_ext(&self) -> u8 {
        self.0[field::HDS_IP_EXT.off]
    }
    #[inline]
    pub fn l4_l3_hdr_type(&self) -> u8 {
        self.0[field::L4_L3_HDR_TYPE.off]
    }
    #[inline]
    pub fn vlan_info(&self) -> u16 {
        self.be(field::VLAN_INFO) as u16
    }
    /// `mlx5_err_cqe.syndrome`.
    #[inline]
    pub fn err_syndrome(&self) -> u8 {
        self.0[field::ERR_SYNDROME.off]
    }
    /// `mlx5_err_cqe.vendor_err_synd`.
    #[inline]
    pub fn vendor_err(&self) -> u8 {
        self.0[field::VENDOR_ERR_SYND.off]
    }
    /// The QP of an error CQE (`s_wqe_opcode_qpn`, low 24 bits; same bytes as `sop_drop_qpn`).
    #[inline]
    pub fn err_qpn(&self) -> u32 {
        self.be(field::S_WQE_OPCODE_QPN) & 0xff_ffff
    }
}

/// Fields to build a CQE image from: what a device (the simulator) writes, and what tests feed the decoder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CqeFields {
    pub opcode: u8,
    pub owner: u8,
    pub solicited: bool,
    pub wqe_opcode: u8,
    pub qpn: u32,
    pub wqe_counter: u16,
    pub byte_cnt: u32,
    pub imm_inval_pkey: u32,
    pub flags_rqpn: u32,
    pub srqn: u32,
    pub slid: u16,
    pub ml_path: u8,
    pub hds_ip_ext: u8,
    pub l4_l3_hdr_type: u8,
    pub vlan_info: u16,
    /// For error CQEs (`mlx5_err_cqe`).
    pub syndrome: u8,
    pub vendor_err: u8,
}

impl CqeFields {
    /// The 64-byte image.
    pub fn emit(&self) -> Cqe {
        let mut b = [0u8; CQE64_SIZE];
        let put = |b: &mut [u8; CQE64_SIZE], m: crate::prm::Bytes, v: u32| m.put_be(b, 0, v);
        put(&mut b, field::SOP_DROP_QPN, u32::from(self.wqe_opcode) << 24 | (self.qpn & 0xff_ffff));
        put(&mut b, field::WQE_COUNTER, self.wqe_counter.into());
        put(&mut b, field::BYTE_CNT, self.byte_cnt);
        put(&mut b, field::IMMEDIATE, self.imm_inval_pkey);
        put(&mut b, field::FLAGS_RQPN, self.flags_rqpn);
        put(&mut b, field::SRQN, self.srqn & 0xff_ffff);
        put(&mut b, field::SLID, self.slid.into());
        put(&mut b, field::VLAN_INFO, self.vlan_info.into());
        b[field::ML_PATH.off] = self.ml_path;
        b[field::HDS_IP_EXT.off] = self.hds_ip_ext;
        b[field::L4_L3_HDR_TYPE.off] = self.l4_l3_hdr_type;
        if matches!(CqeOpcode::from_raw(self.opcode), CqeOpcode::ReqErr | CqeOpcode::RespErr) {
            b[field::ERR_SYNDROME.off] = self.syndrome;
            b[field::VENDOR_ERR_SYND.off] = self.vendor_err;
        }
        b[field::OP_OWN.off] = (self.opcode << 4) | (u8::from(self.solicited) << 1) | (self.owner & 1);
        Cqe(b)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Work completions

/// `ib_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum WcStatus {
    #[default]
    Success,
    LocLenErr,
    LocQpOpErr,
    LocEecOpErr,
    LocProtErr,
    WrFlushErr,
    MwBindErr,
    BadRespErr,
    LocAccessErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
    LocRddViolErr,
    RemInvRdReqErr,
    RemAbortErr,
    InvEecnErr,
    InvEecStateErr,
    FatalErr,
    RespTimeoutErr,
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
        match syndrome as u32 {
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
    #[default]
    Send,
    RdmaWrite,
    RdmaRead,
    CompSwap,
    FetchAdd,
    MaskedCompSwap,
    MaskedFetchAdd,
    /// A receive (SEND, SEND with immediate or with invalidate arrived).
    Recv,
    /// An RDMA WRITE with immediate arrived (consumed a receive WQE).
    RecvRdmaWithImm,
    /// A requester completion for a WQE opcode this driver does not post (`MLX5_OPCODE_*` kept raw).
    Unknown(u8),
}

/// `ib_wc_flags` (kernel values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct WcFlags(pub u32);

impl WcFlags {
    pub const GRH: WcFlags = WcFlags(consts::IB_WC_GRH);
    pub const WITH_IMM: WcFlags = WcFlags(consts::IB_WC_WITH_IMM);
    pub const WITH_INVALIDATE: WcFlags = WcFlags(consts::IB_WC_WITH_INVALIDATE);
    pub const IP_CSUM_OK: WcFlags = WcFlags(consts::IB_WC_IP_CSUM_OK);
    pub const WITH_VLAN: WcFlags = WcFlags(consts::IB_WC_WITH_VLAN);

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
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    /// The device's vendor syndrome of an error completion.
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Immediate data in host order (valid with [`WcFlags::WITH_IMM`]).
    pub imm_data: u32,
    /// The rkey the sender invalidated (valid with [`WcFlags::WITH_INVALIDATE`]).
    pub invalidated_rkey: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: WcFlags,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
    /// VLAN of a RoCE receive (valid with [`WcFlags::WITH_VLAN`]).
    pub vlan_id: u16,
}

/// The port's link layer decides how the address fields of a receive CQE read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum LinkLayer {
    InfiniBand,
    #[default]
    Ethernet,
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
}

/// A CQE the driver cannot accept: the device wrote something it should not have. It is consumed (the ring moves
/// on) and reported; completions before it were returned by the previous poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CqeError {
    /// A CQE for a QP that has no queue on this CQ.
    UnknownQp { cqn: u32, qpn: u32, index: u32 },
    /// An opcode the driver never asked for (compressed CQEs, tag matching, a resize marker with no resize).
    BadOpcode { cqn: u32, op_own: u8, index: u32 },
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
        }
    }
}

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
#[inline]
fn decode_into(
    cqe: &Cqe,
    cqn: u32,
    index: u32,
    link: LinkLayer,
    wq: &mut (impl WrTable + ?Sized),
    out: &mut WorkCompletion,
) -> Result<bool, CqeError> {
    let bad = CqeError::BadOpcode { cqn, op_own: cqe.op_own(), index };
    if u32::from(cqe.format()) == consts::MLX5_COMPRESSED {
        return Err(bad);
    }
    let mut wc = WorkCompletion::default();
    match cqe.opcode() {
        CqeOpcode::Req => {
            wc.qp_num = cqe.qpn();
            wc.wr_id =
                wq.send_done(wc.qp_num, cqe.wqe_counter()).ok_or(CqeError::UnknownQp { cqn, qpn: wc.qp_num, index })?;
            decode_req(cqe, &mut wc);
        }
        op @ (CqeOpcode::RespWrImm | CqeOpcode::RespSend | CqeOpcode::RespSendImm | CqeOpcode::RespSendInv) => {
            wc.qp_num = cqe.qpn();
            wc.wr_id = wq.recv_done(wc.qp_num, cqe.srqn(), cqe.wqe_counter()).ok_or(CqeError::UnknownQp {
                cqn,
                qpn: wc.qp_num,
                index,
            })?;
            decode_resp(cqe, op, link, &mut wc);
        }
        op @ (CqeOpcode::ReqErr | CqeOpcode::RespErr) => {
            wc.qp_num = cqe.err_qpn();
            wc.status = WcStatus::from_syndrome(cqe.err_syndrome());
            wc.vendor_err = cqe.vendor_err().into();
            let id = if op == CqeOpcode::ReqErr {
                wq.send_done(wc.qp_num, cqe.wqe_counter())
            } else {
                wq.recv_done(wc.qp_num, cqe.srqn(), cqe.wqe_counter())
            };
            wc.wr_id = id.ok_or(CqeError::UnknownQp { cqn, qpn: wc.qp_num, index })?;
        }
        // Signature errors report on a memory key, not a work request (the kernel records and re-polls).
        CqeOpcode::SigErr => return Ok(false),
        CqeOpcode::Resize | CqeOpcode::Invalid | CqeOpcode::Unknown(_) => return Err(bad),
    }
    *out = wc;
    Ok(true)
}

/// Requester fields (`handle_good_req`).
#[inline]
fn decode_req(cqe: &Cqe, wc: &mut WorkCompletion) {
    let op = cqe.wqe_opcode();
    match u32::from(op) {
        consts::MLX5_OPCODE_RDMA_WRITE_IMM => {
            wc.wc_flags |= WcFlags::WITH_IMM;
            wc.opcode = WcOpcode::RdmaWrite;
        }
        consts::MLX5_OPCODE_RDMA_WRITE => wc.opcode = WcOpcode::RdmaWrite,
        consts::MLX5_OPCODE_SEND_IMM => {
            wc.wc_flags |= WcFlags::WITH_IMM;
            wc.opcode = WcOpcode::Send;
        }
        consts::MLX5_OPCODE_SEND | consts::MLX5_OPCODE_SEND_INVAL => wc.opcode = WcOpcode::Send,
        consts::MLX5_OPCODE_RDMA_READ => {
            wc.opcode = WcOpcode::RdmaRead;
            wc.byte_len = cqe.byte_cnt();
        }
        consts::MLX5_OPCODE_ATOMIC_CS => {
            wc.opcode = WcOpcode::CompSwap;
            wc.byte_len = 8;
        }
        consts::MLX5_OPCODE_ATOMIC_FA => {
            wc.opcode = WcOpcode::FetchAdd;
            wc.byte_len = 8;
        }
        consts::MLX5_OPCODE_ATOMIC_MASKED_CS => {
            wc.opcode = WcOpcode::MaskedCompSwap;
            wc.byte_len = 8;
        }
        consts::MLX5_OPCODE_ATOMIC_MASKED_FA => {
            wc.opcode = WcOpcode::MaskedFetchAdd;
            wc.byte_len = 8;
        }
        _ => wc.opcode = WcOpcode::Unknown(op),
    }
}

/// Bits of `hds_ip_ext` saying the device verified the L3 and L4 checksums (`CQE_L3_OK`, `CQE_L4_OK`).
const CQE_L3_L4_OK: u8 = (consts::CQE_L3_OK | consts::CQE_L4_OK) as u8;

/// Responder fields (`handle_responder`).
#[inline]
fn decode_resp(cqe: &Cqe, op: CqeOpcode, link: LinkLayer, wc: &mut WorkCompletion) {
    wc.byte_len = cqe.byte_cnt();
    match op {
        CqeOpcode::RespWrImm => {
            wc.opcode = WcOpcode::RecvRdmaWithImm;
            wc.wc_flags = WcFlags::WITH_IMM;
            wc.imm_data = cqe.imm_inval_pkey();
        }
        CqeOpcode::RespSend => {
            wc.opcode = WcOpcode::Recv;
            if cqe.hds_ip_ext() & CQE_L3_L4_OK == CQE_L3_L4_OK {
                wc.wc_flags = WcFlags::IP_CSUM_OK;
            }
        }
        CqeOpcode::RespSendImm => {
            wc.opcode = WcOpcode::Recv;
            wc.wc_flags = WcFlags::WITH_IMM;
            wc.imm_data = cqe.imm_inval_pkey();
        }
        _ => {
            wc.opcode = WcOpcode::Recv;
            wc.wc_flags = WcFlags::WITH_INVALIDATE;
            wc.invalidated_rkey = cqe.imm_inval_pkey();
        }
    }
    let fr = cqe.flags_rqpn();
    wc.src_qp = fr & 0xff_ffff;
    wc.dlid_path_bits = cqe.ml_path();
    if (fr >> 28) & 3 != 0 {
        wc.wc_flags |= WcFlags::GRH;
    }
    // Only the GSI QP sees P_Keys per packet; every other QP has one (`pkey_index` 0).
    wc.pkey_index = 0;
    match link {
        LinkLayer::InfiniBand => {
            wc.slid = cqe.slid();
            wc.sl = ((fr >> 24) & 0xf) as u8;
        }
        LinkLayer::Ethernet => {
            if cqe.l4_l3_hdr_type() & 1 != 0 {
                let v = cqe.vlan_info();
                wc.vlan_id = v & 0xfff;
                wc.sl = (v >> 13) as u8 & 7;
                wc.wc_flags |= WcFlags::WITH_VLAN;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The ring

/// Offset of the CQ doorbell in a UAR page (`MLX5_CQ_DOORBELL`).
pub const CQ_DOORBELL: usize = consts::MLX5_CQ_DOORBELL as usize;

/// Which completions raise the next event (`ib_cq_notify_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Notify {
    /// The next completion of any kind (`MLX5_CQ_DB_REQ_NOT`).
    NextComp,
    /// The next solicited or error completion (`MLX5_CQ_DB_REQ_NOT_SOL`).
    Solicited,
}

/// The arm doorbell value: `sn << 28 | cmd | ci` (`mlx5_cq_arm`).
pub const fn arm_value(arm_sn: u32, notify: Notify, cons_index: u32) -> u32 {
    let cmd = match notify {
        Notify::NextComp => consts::MLX5_CQ_DB_REQ_NOT,
        Notify::Solicited => consts::MLX5_CQ_DB_REQ_NOT_SOL,
    };
    ((arm_sn & 3) << 28) | cmd | (cons_index & 0xff_ffff)
}

/// Doorbell-record dwords (`set_ci_db`, `arm_db`).
const DBR_SET_CI: usize = 0;
const DBR_ARM: usize = 1;

/// A created completion queue: its ring, doorbell record and consumer index.
#[derive(Debug)]
pub struct Cq {
    pub(crate) buf: QueueBuf,
    pub(crate) dbrec: DbRec,
    cqn: u32,
    log_nent: u8,
    cqe_size: CqeSize,
    cons_index: u32,
    /// BAR offset of the CQ doorbell of the UAR page the CQ was created with.
    doorbell: usize,
    link: LinkLayer,
}

impl Cq {
    /// Pre-sets every CQE of `buf` to invalid with owner 1 (`op_own` 0xF1), so nothing is software-owned until the
    /// device writes it.
    pub fn init_buf(buf: &QueueBuf, log_nent: u8, cqe_size: CqeSize) {
        let stride = cqe_size.bytes();
        let own = stride - CQE64_SIZE + field::OP_OWN.off;
        for i in 0..(1usize << log_nent) {
            let (r, o) = buf.locate(i * stride);
            r.write_volatile_u8(o + own, CQE_INIT_OP_OWN);
        }
    }

    /// A ring over an initialised buffer, for CQ `cqn` whose doorbell is in the UAR page at BAR offset `uar_off`.
    pub fn new(
        buf: QueueBuf,
        dbrec: DbRec,
        cqn: u32,
        log_nent: u8,
        cqe_size: CqeSize,
        uar_off: usize,
        link: LinkLayer,
    ) -> Self {
        Self { buf, dbrec, cqn, log_nent, cqe_size, cons_index: 0, doorbell: uar_off + CQ_DOORBELL, link }
    }

    pub fn cqn(&self) -> u32 {
        self.cqn
    }

    /// CQEs in the ring.
    pub fn nent(&self) -> u32 {
        1 << self.log_nent
    }

    pub fn log_nent(&self) -> u8 {
        self.log_nent
    }

    pub fn cqe_size(&self) -> CqeSize {
        self.cqe_size
    }

    pub fn cons_index(&self) -> u32 {
        self.cons_index
    }

    pub fn dbrec(&self) -> &DbRec {
        &self.dbrec
    }

    pub fn buf(&self) -> &QueueBuf {
        &self.buf
    }

    /// The ring as one region when the buffer is a single fragment (the usual case): an entry's address is then a
    /// mask and an add. `None`: entries are found through the fragment table. It borrows only the buffer, so a poll loop can advance the consumer index while it holds the view.
    #[inline]
    fn flat_of(buf: &QueueBuf, bytes: usize) -> Option<DmaView<'_>> {
        buf.frag(0).filter(|r| buf.nfrags() == 1 && r.len() >= bytes)
    }

    /// The 64-byte CQE image of entry `n` (the second half of a 128-byte CQE); `flat` is [`Cq::flat_of`].
    #[inline]
    fn cqe_ptr(&self, flat: Option<&DmaView<'_>>, n: u32) -> *mut u8 {
        let stride = self.cqe_size.bytes();
        let off = ((n & (self.nent() - 1)) as usize) * stride + stride - CQE64_SIZE;
        match flat {
            // SAFETY: `off + 64 <= nent * stride <= r.len` (Cq::flat_of checked the length), inside a live fragment.
            Some(r) => unsafe { r.cpu().as_ptr().add(off) },
            None => self.buf.ptr(off, CQE64_SIZE),
        }
    }

    /// Entry `n` if software owns it (`get_sw_cqe`), copied out after the read barrier.
    #[inline]
    fn sw_cqe<M: Mmio + ?Sized>(&self, mmio: &M, flat: Option<&DmaView<'_>>, n: u32) -> Option<Cqe> {
        let p = self.cqe_ptr(flat, n);
        // SAFETY: p points at 64 bytes inside a live fragment of the ring (QueueBuf::ptr checks the bounds).
        // Volatile: the device writes the byte concurrently.
        let op_own = unsafe { p.add(field::OP_OWN.off).read_volatile() };
        let owner = (n >> self.log_nent) & 1;
        if op_own >> 4 == consts::MLX5_CQE_INVALID as u8 || u32::from(op_own & 1) != owner {
            return None;
        }
        // The ownership byte said the entry is ours: the rest must be loaded after it.
        mmio.dma_rmb();
        // Eight 8-byte volatile loads (a volatile byte array would be copied a byte at a time).
        let mut img = [0u8; CQE64_SIZE];
        let src = p.cast::<u64>().cast_const();
        for (i, b) in img.chunks_exact_mut(8).enumerate() {
            // SAFETY: as above. The entry is 8-byte aligned: fragments are at least 4 KiB aligned (the Dma contract
            // for QueueBuf's requests) and entries sit at multiples of 64 bytes. The device does not write an entry
            // software owns.
            b.copy_from_slice(&unsafe { src.add(i).read_volatile() }.to_ne_bytes());
        }
        Some(Cqe(img))
    }

    /// Polls up to `wc.len()` completions, oldest first (`ibv_poll_cq`), and publishes the new consumer index.
    /// A CQE the driver cannot accept is consumed and returned as an error on a call of its own, so completions
    /// before it are never lost.
    pub fn poll<M: Mmio + ?Sized>(
        &mut self,
        mmio: &M,
        wq: &mut (impl WrTable + ?Sized),
        wc: &mut [WorkCompletion],
    ) -> Result<usize, CqeError> {
        let mut n = 0;
        let start = self.cons_index;
        let mut result = Ok(());
        let flat = Self::flat_of(&self.buf, self.cqe_size.bytes() << self.log_nent);
        while n < wc.len() {
            let Some(cqe) = self.sw_cqe(mmio, flat.as_ref(), self.cons_index) else { break };
            match decode_into(&cqe, self.cqn, self.cons_index, self.link, wq, &mut wc[n]) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    if n > 0 {
                        // Leave it for the next call so these completions are returned first.
                        break;
                    }
                    result = Err(e);
                    self.cons_index = self.cons_index.wrapping_add(1);
                    break;
                }
            }
            self.cons_index = self.cons_index.wrapping_add(1);
        }
        if self.cons_index != start {
            self.update_ci(mmio);
        }
        result.map(|()| n)
    }

    /// Publishes the consumer index in the doorbell record (`mlx5_cq_set_ci`).
    fn update_ci<M: Mmio + ?Sized>(&self, mmio: &M) {
        // The CQE loads must be complete before the store that lets the device reuse those entries.
        mmio.dma_rmb();
        self.dbrec.write_be32(DBR_SET_CI, self.cons_index & 0xff_ffff);
    }

    /// Requests an event for the next (or next solicited) completion (`mlx5_cq_arm`). This function owns the CQ
    /// arm doorbell sequence; `arm_sn` counts the completion events received for this CQ.
    pub fn arm<M: Mmio + ?Sized>(&self, mmio: &M, arm_sn: u32, notify: Notify) {
        let v = arm_value(arm_sn, notify, self.cons_index);
        self.dbrec.write_be32(DBR_ARM, v);
        // The arm record must be in host memory before the doorbell that makes the device read it.
        mmio.wmb();
        // One 64-bit store: the device must never see the command without its CQ number.
        mmio.write64(self.doorbell, u64::from(v) << 32 | u64::from(self.cqn));
    }

    /// After a resize: moves the CQEs not yet polled from the old ring to `new` (at indices one past their old
    /// ones, as the device counts the resize CQE), skips the resize CQE and switches to `new`
    /// (`mlx5_cq_resize_copy_cqes`). Returns the old buffer. `Err` with the old buffer when the resize CQE is not
    /// within one ring of software-owned entries; the switch happens anyway since the device writes `new` now.
    // The buffers are returned by value because the core has no heap to box them in.
    #[allow(clippy::result_large_err)]
    pub fn switch_buffers<M: Mmio + ?Sized>(
        &mut self,
        mmio: &M,
        new: QueueBuf,
        log_nent: u8,
    ) -> Result<QueueBuf, QueueBuf> {
        let stride = self.cqe_size.bytes();
        let new_mask = (1u32 << log_nent) - 1;
        let mut i = self.cons_index;
        let mut found = false;
        let flat = Self::flat_of(&self.buf, self.cqe_size.bytes() << self.log_nent);
        for _ in 0..self.nent() {
            let Some(cqe) = self.sw_cqe(mmio, flat.as_ref(), i) else { break };
            if cqe.opcode() == CqeOpcode::Resize {
                found = true;
                break;
            }
            let dst = i.wrapping_add(1);
            let owner = ((dst >> log_nent) & 1) as u8;
            // The whole entry moves (a 128-byte CQE carries inline data in its first half).
            let src_off = ((i & (self.nent() - 1)) as usize) * stride;
            let dst_off = ((dst & new_mask) as usize) * stride;
            let sp = self.buf.ptr(src_off, stride);
            let dp = new.ptr(dst_off, stride);
            for k in 0..stride {
                // SAFETY: both spans are inside live fragments (QueueBuf::ptr checked them); the old entry is
                // software-owned, and the new ring entry is not yet visible to software or written by the device
                // (it writes from the resize index on).
                unsafe {
                    let mut b = sp.add(k).read_volatile();
                    if k == stride - 1 {
                        b = (b & !1) | owner;
                    }
                    dp.add(k).write_volatile(b);
                }
            }
            i = i.wrapping_add(1);
        }
        let old = core::mem::replace(&mut self.buf, new);
        self.log_nent = log_nent;
        self.cons_index = self.cons_index.wrapping_add(1);
        self.update_ci(mmio);
        if found {
            Ok(old)
        } else {
            Err(old)
        }
    }
}

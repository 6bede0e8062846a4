//! CQ firmware commands (PRM CREATE_CQ, DESTROY_CQ, QUERY_CQ, MODIFY_CQ moderation and resize) and the `cqc`
//! fields.

use crate::cmd::{len_with_pas, write_pas, Pas, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, MsgBuf, Opcode, SubBuf};

/// CQE size (`cqc.cqe_sz`: `CQE_STRIDE_64` = 0, `CQE_STRIDE_128` = 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CqeSize {
    /// 64-byte CQEs.
    #[default]
    B64,
    /// 128-byte CQEs.
    B128,
}

impl CqeSize {
    /// Bytes per CQE.
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

    /// The size from its `cqe_sz` value.
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
    /// CQE size.
    pub cqe_sz: CqeSize,
    /// log2 of the number of CQEs.
    pub log_cq_size: u8,
    /// UAR page the CQ's doorbells use.
    pub uar_page: u32,
    /// The EQ completion events go to.
    pub c_eqn: u32,
    /// Page size of `pas[]` relative to 4 KiB.
    pub log_page_size: u8,
    /// Offset of the ring in its first page (`page_offset`).
    pub page_offset: u8,
    /// Bus address of the CQ doorbell record.
    pub dbr_addr: u64,
    /// Overrun ignore: the device does not report overruns of this CQ.
    pub oi: bool,
}

/// `CREATE_CQ`: context and buffer pages; the output is the 24-bit CQ number.
#[derive(Debug, Clone, Copy)]
pub struct CreateCq<'a> {
    /// The CQ context.
    pub ctx: CqContext,
    /// The ring's pages.
    pub pas: Pas<'a>,
}

impl Command for CreateCq<'_> {
    type In = ifc::create_cq_in::Bits;
    type Out = ifc::create_cq_out::Bits;
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateCq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_cq_in::PAS, self.pas.len())
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
    /// `cqe_sz`.
    pub cqe_sz: u8,
    /// `oi`: overrun ignore.
    pub oi: bool,
    /// `log_cq_size`.
    pub log_cq_size: u8,
    /// `uar_page`.
    pub uar_page: u32,
    /// `c_eqn`: the EQ that gets completion events.
    pub c_eqn: u32,
    /// `log_page_size` (relative to 4 KiB).
    pub log_page_size: u8,
    /// `cq_period`: moderation period in microseconds.
    pub cq_period: u16,
    /// `cq_max_count`: moderation count.
    pub cq_max_count: u16,
    /// `consumer_counter`.
    pub consumer_counter: u32,
    /// `producer_counter`.
    pub producer_counter: u32,
    /// `dbr_addr`: bus address of the doorbell record.
    pub dbr_addr: u64,
}

impl CqState {
    /// Whether the device stopped the CQ because it overran.
    pub fn overflowed(&self) -> bool {
        self.status == consts::MLX5_CQC_STATUS_CQ_OVERFLOW
    }
}

/// `QUERY_CQ`.
#[derive(Debug, Clone, Copy)]
pub struct QueryCq {
    /// The CQ number.
    pub cqn: u32,
}

impl Command for QueryCq {
    type In = ifc::query_cq_in::Bits;
    type Out = ifc::query_cq_out::Bits;
    type Output = CqState;
    fn opcode(&self) -> Opcode {
        Opcode::QueryCq
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
    /// The CQ number.
    pub cqn: u32,
    /// Moderation period in microseconds.
    pub cq_period: u16,
    /// Completions before an event.
    pub cq_max_count: u16,
}

impl Command for ModifyCqModeration {
    type In = ifc::modify_cq_in::Bits;
    type Out = ifc::modify_cq_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ModifyCq
    }
    fn inlen(&self) -> usize {
        ifc::modify_cq_in::PAS.byte_off()
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
    /// The CQ number.
    pub cqn: u32,
    /// Unchanged by a resize, but sent again as mlx5_ib does.
    pub cqe_sz: CqeSize,
    /// `log_cq_size` of the new ring.
    pub log_cq_size: u8,
    /// `log_page_size` of the new ring.
    pub log_page_size: u8,
    /// `page_offset` of the new ring.
    pub page_offset: u8,
    /// The new ring's pages.
    pub pas: Pas<'a>,
}

impl Command for ResizeCq<'_> {
    type In = ifc::modify_cq_in::Bits;
    type Out = ifc::modify_cq_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ModifyCq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::modify_cq_in::PAS, self.pas.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::modify_cq_in as m;
        write_header(msg, Opcode::ModifyCq, consts::MLX5_CQ_OPMOD_RESIZE);
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

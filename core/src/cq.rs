//! Completion queue commands (PRM CREATE_CQ / DESTROY_CQ; Linux `cq.c` `mlx5_create_cq`, mlx5_ib `create_cq_kernel`).

use crate::cmd::{len_with_pas, write_pas, Pas, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{ifc, MsgBuf, Opcode, SubBuf};

/// CQE size (`cqc.cqe_sz`: `CQE_STRIDE_64` = 0, `CQE_STRIDE_128` = 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CqeSize {
    #[default]
    B64,
    B128,
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
            cqc.set(ifc::cqc::CQE_SZ, self.ctx.cqe_sz as u32);
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

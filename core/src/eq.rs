//! Event queue commands (PRM CREATE_EQ / DESTROY_EQ; Linux `eq.c` `create_map_eq`).

use crate::cmd::{len_with_pas, write_pas, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{ifc, MsgBuf, Opcode, SubBuf};

/// The `eqc` fields the driver sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EqContext {
    /// log2 of the number of 64-byte EQEs.
    pub log_eq_size: u8,
    pub uar_page: u32,
    /// MSI-X vector the EQ interrupts on.
    pub intr: u16,
    /// Page size of `pas[]` relative to 4 KiB (`page_shift - MLX5_ADAPTER_PAGE_SHIFT`).
    pub log_page_size: u8,
    pub page_offset: u8,
}

/// `CREATE_EQ`: context, the four 64-bit event masks (bit `n` of word 0 = event type `n`) and the buffer pages.
#[derive(Debug, Clone, Copy)]
pub struct CreateEq<'a> {
    pub ctx: EqContext,
    pub event_bitmask: [u64; 4],
    pub pas: &'a [u64],
}

impl Command for CreateEq<'_> {
    /// The EQ number.
    type Output = u8;
    fn opcode(&self) -> Opcode {
        Opcode::CreateEq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_eq_in::PAS, self.pas.len())
    }
    fn outlen(&self) -> usize {
        ifc::create_eq_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::CreateEq, 0);
        {
            let mut eqc = SubBuf::new(msg, ifc::create_eq_in::EQ_CONTEXT_ENTRY);
            eqc.set(ifc::eqc::LOG_EQ_SIZE, self.ctx.log_eq_size.into());
            eqc.set(ifc::eqc::UAR_PAGE, self.ctx.uar_page);
            eqc.set(ifc::eqc::INTR, self.ctx.intr.into());
            eqc.set(ifc::eqc::LOG_PAGE_SIZE, self.ctx.log_page_size.into());
            eqc.set(ifc::eqc::PAGE_OFFSET, self.ctx.page_offset.into());
        }
        for (i, &mask) in self.event_bitmask.iter().enumerate() {
            msg.set64(ifc::create_eq_in::EVENT_BITMASK.elem(i as u32), mask);
        }
        write_pas(msg, ifc::create_eq_in::PAS, self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u8, CmdError> {
        Ok(out.get(ifc::create_eq_out::EQ_NUMBER) as u8)
    }
}

/// `DESTROY_EQ`.
pub fn destroy_eq(eqn: u8) -> Simple {
    Simple::new(Opcode::DestroyEq, ifc::destroy_eq_in::SIZE_BYTES, ifc::destroy_eq_out::SIZE_BYTES)
        .arg(ifc::destroy_eq_in::EQ_NUMBER, eqn.into())
}

//! User access regions (PRM ALLOC_UAR / DEALLOC_UAR; Linux `uar.c`). A UAR is a 4 KiB page of the BAR holding
//! the doorbells and BlueFlame registers of the queues bound to it.

use crate::cmd::Simple;
use crate::prm::{ifc, Opcode};

/// `ALLOC_UAR`: the output is the UAR index (its page number in the BAR).
pub fn alloc_uar() -> Simple {
    Simple::new(Opcode::AllocUar, ifc::alloc_uar_in::SIZE_BYTES, ifc::alloc_uar_out::SIZE_BYTES)
        .result(ifc::alloc_uar_out::UAR)
}

/// `DEALLOC_UAR`.
pub fn dealloc_uar(uar: u32) -> Simple {
    Simple::new(Opcode::DeallocUar, ifc::dealloc_uar_in::SIZE_BYTES, ifc::dealloc_uar_out::SIZE_BYTES)
        .arg(ifc::dealloc_uar_in::UAR, uar)
}

//! Protection domains (PRM ALLOC_PD / DEALLOC_PD; Linux `mlx5_cmd_alloc_pd`).

use crate::cmd::Simple;
use crate::prm::{ifc, Opcode};

/// `ALLOC_PD`: the output is the 24-bit PD number.
pub fn alloc_pd() -> Simple {
    Simple::new(Opcode::AllocPd, ifc::alloc_pd_in::SIZE_BYTES, ifc::alloc_pd_out::SIZE_BYTES)
        .result(ifc::alloc_pd_out::PD)
}

/// `DEALLOC_PD`.
pub fn dealloc_pd(pd: u32) -> Simple {
    Simple::new(Opcode::DeallocPd, ifc::dealloc_pd_in::SIZE_BYTES, ifc::dealloc_pd_out::SIZE_BYTES)
        .arg(ifc::dealloc_pd_in::PD, pd)
}

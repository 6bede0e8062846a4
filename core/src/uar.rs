//! User access regions (PRM ALLOC_UAR / DEALLOC_UAR; Linux `uar.c`). A UAR is a 4 KiB page of the BAR holding
//! the doorbells and BlueFlame registers of the queues bound to it.

use crate::cmd::Simple;
use crate::prm::{consts, ifc, Opcode};

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

/// Bytes of a UAR page in the BAR (`uar_4k`: the driver runs with 4 KiB UAR pages).
pub const UAR_PAGE_SIZE: usize = 1 << consts::MLX5_ADAPTER_PAGE_SHIFT;

/// BlueFlame registers per UAR page (`MLX5_BFREGS_PER_UAR`).
pub const BFREGS_PER_UAR: usize = consts::MLX5_BFREGS_PER_UAR as usize;

/// An allocated UAR page: where it is in the BAR and the BlueFlame registers it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uar {
    /// The UAR index.
    pub index: u32,
    /// `1 << cmd_hca_cap.log_bf_reg_size`: each register holds two alternating buffers of half this size.
    pub bf_reg_size: usize,
    /// `cmd_hca_cap.bf`: whether BlueFlame writes are supported (otherwise only the 8-byte doorbell is used).
    pub bf: bool,
}

impl Uar {
    /// BAR offset of the page (`uar index * 4 KiB`).
    pub fn bar_offset(&self) -> usize {
        self.index as usize * UAR_PAGE_SIZE
    }

    /// BlueFlame register `n` (0..4) of the page (`map_offset` in uar.c), or `None` past the last one or when
    /// the registers would not fit the page.
    pub fn bfreg(&self, n: usize) -> Option<BfReg> {
        let base = consts::MLX5_BF_OFFSET as usize + n * self.bf_reg_size;
        (n < BFREGS_PER_UAR && self.bf_reg_size >= 2 && base + self.bf_reg_size <= UAR_PAGE_SIZE).then_some(BfReg {
            offset: self.bar_offset() + base,
            buf_size: self.bf_reg_size / 2,
            which: 0,
            bf: self.bf,
        })
    }
}

/// One BlueFlame register: a send queue's doorbell and, when BlueFlame is on, the write-combining window a small
/// WQE is copied through. Consecutive doorbells alternate between its two buffers (`bf->offset ^= buf_size`) so a
/// copy never lands on the buffer the device may still be reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BfReg {
    /// BAR offset of buffer 0.
    pub offset: usize,
    /// Bytes per buffer (the most a BlueFlame copy may carry).
    pub buf_size: usize,
    which: u8,
    /// Whether BlueFlame is available.
    pub bf: bool,
}

impl BfReg {
    /// BAR offset of the buffer to use for this doorbell; the next call returns the other one.
    #[inline]
    pub fn next_offset(&mut self) -> usize {
        let off = self.offset + usize::from(self.which) * self.buf_size;
        self.which ^= 1;
        off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bfregs_sit_after_0x800_and_alternate() {
        // log_bf_reg_size 9: 512-byte registers, two 256-byte buffers each.
        let u = Uar { index: 3, bf_reg_size: 512, bf: true };
        let mut r = u.bfreg(1).unwrap();
        assert_eq!(r.offset, 3 * 4096 + 0x800 + 512);
        assert_eq!((r.next_offset(), r.next_offset(), r.next_offset()), (r.offset, r.offset + 256, r.offset));
        assert!(u.bfreg(3).is_some());
        assert!(u.bfreg(4).is_none());
        // Registers that would run past the page do not exist.
        assert!(Uar { index: 3, bf_reg_size: 1024, bf: true }.bfreg(2).is_none());
    }
}

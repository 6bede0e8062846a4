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
    /// BAR offset of the buffer to use for this doorbell; the next call returns the other one. A shared register
    /// ([`BfReg::shared`]) always answers buffer 0.
    #[inline]
    pub fn next_offset(&mut self) -> usize {
        let off = self.offset + usize::from(self.which & 1) * self.buf_size;
        if self.which != SHARED {
            self.which ^= 1;
        }
        off
    }

    /// This register as one several QPs ring: BlueFlame off and no alternation, so every doorbell is one 8-byte
    /// store at buffer 0. Two QPs that alternate on their own would each think the other's buffer free, and a
    /// BlueFlame copy could land on a buffer the device is still reading; a lone 8-byte store needs no lock.
    pub fn shared(mut self) -> Self {
        self.bf = false;
        self.which = SHARED;
        self
    }

    /// Whether other QPs ring this register too.
    pub fn is_shared(&self) -> bool {
        self.which == SHARED
    }
}

/// `BfReg::which` of a shared register: bit 1 set freezes the alternation bit (bit 0) at 0.
const SHARED: u8 = 2;

/// UAR pages a [`BfregPool`] holds at most: 16 pages, 64 dedicated registers (rdma-core's default is 16 static
/// registers per context, more allocated per thread on demand).
pub const MAX_BF_PAGES: usize = 16;

/// Dedicated BlueFlame registers, one per QP (rdma-core's bfreg allocation, Linux `mlx5_bfreg_info`): each QP
/// gets a register of its own while the pages allocated so far have a free one, a new UAR page (ALLOC_UAR, by the
/// caller) when they do not, and a shared register ([`BfReg::shared`]) only when no page can be had. So two
/// QPs posting from two threads never write the same register or its cache line.
#[derive(Debug, Clone, Default)]
pub struct BfregPool {
    /// UAR index of each page held, in allocation order (the first is the bring-up page).
    pages: [Option<u32>; MAX_BF_PAGES],
    /// Registers in use per page, one bit each.
    used: [u8; MAX_BF_PAGES],
}

impl BfregPool {
    /// Adds an allocated UAR page; false when the pool is full (the caller keeps or frees the page).
    pub fn add_page(&mut self, index: u32) -> bool {
        match self.pages.iter_mut().find(|p| p.is_none()) {
            Some(slot) => {
                *slot = Some(index);
                true
            }
            None => false,
        }
    }

    /// Whether another page would fit.
    pub fn has_room(&self) -> bool {
        self.pages.iter().any(Option::is_none)
    }

    /// Takes a free register of the pages held, lowest page first: its page and the register.
    pub fn take(&mut self, proto: &Uar) -> Option<(Uar, BfReg)> {
        let valid = Self::valid(proto);
        for (slot, used) in self.pages.iter().zip(self.used.iter_mut()) {
            let free = !*used & valid;
            if let (Some(index), true) = (*slot, free != 0) {
                let n = free.trailing_zeros() as usize;
                let page = Uar { index, ..*proto };
                let reg = page.bfreg(n)?;
                *used |= 1 << n;
                return Some((page, reg));
            }
        }
        None
    }

    /// The registers a page of `proto`'s geometry has, one bit each.
    fn valid(proto: &Uar) -> u8 {
        (0..BFREGS_PER_UAR).filter(|&n| proto.bfreg(n).is_some()).fold(0, |m, n| m | 1 << n)
    }

    /// Gives a dedicated register back (a shared one, or one not from this pool, is ignored).
    pub fn give(&mut self, reg: &BfReg, proto: &Uar) {
        let in_page = reg.offset % UAR_PAGE_SIZE;
        let index = (reg.offset / UAR_PAGE_SIZE) as u32;
        let first = consts::MLX5_BF_OFFSET as usize;
        if reg.is_shared() || in_page < first || proto.bf_reg_size == 0 {
            return;
        }
        let n = (in_page - first) / proto.bf_reg_size;
        if n >= BFREGS_PER_UAR || first + n * proto.bf_reg_size != in_page {
            return;
        }
        if let Some(i) = self.pages.iter().position(|p| *p == Some(index)) {
            self.used[i] &= !(1 << n);
        }
    }

    /// UAR pages held.
    pub fn pages(&self) -> usize {
        self.pages.iter().flatten().count()
    }

    /// Registers handed out and not given back.
    pub fn in_use(&self) -> usize {
        self.used.iter().map(|u| u.count_ones() as usize).sum()
    }

    /// The pages allocated after the first (their DEALLOC_UAR is the pool owner's), emptying the pool.
    pub fn drain_extra(&mut self) -> impl Iterator<Item = u32> {
        let pages = core::mem::take(&mut self.pages);
        self.used = [0; MAX_BF_PAGES];
        pages.into_iter().skip(1).flatten()
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
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

    #[test]
    fn a_shared_register_stays_on_buffer_0_without_blueflame() {
        let r = Uar { index: 1, bf_reg_size: 512, bf: true }.bfreg(0).unwrap().shared();
        let mut s = r;
        assert!(s.is_shared() && !s.bf);
        assert_eq!((s.next_offset(), s.next_offset(), s.next_offset()), (r.offset, r.offset, r.offset));
    }

    #[test]
    fn the_pool_hands_out_each_register_once_and_takes_them_back() {
        let proto = Uar { index: 0, bf_reg_size: 512, bf: true };
        let mut pool = BfregPool::default();
        assert!(pool.take(&proto).is_none(), "no page, no register");
        assert!(pool.add_page(5));
        let regs: heapless::Vec<_, BFREGS_PER_UAR> = (0..BFREGS_PER_UAR).map(|_| pool.take(&proto).unwrap()).collect();
        let mut offsets: heapless::Vec<_, BFREGS_PER_UAR> = regs.iter().map(|(_, r)| r.offset).collect();
        offsets.sort_unstable();
        assert!(offsets.windows(2).all(|w| w[0] != w[1]), "distinct registers");
        assert!(regs.iter().all(|(u, _)| u.index == 5));
        assert!(pool.take(&proto).is_none(), "page full");
        assert!(pool.add_page(9));
        let (u, r) = pool.take(&proto).unwrap();
        assert_eq!((u.index, r.offset), (9, 9 * UAR_PAGE_SIZE + consts::MLX5_BF_OFFSET as usize));
        assert_eq!(pool.in_use(), BFREGS_PER_UAR + 1);
        pool.give(&regs[2].1, &proto);
        assert_eq!(pool.take(&proto).unwrap().1.offset, regs[2].1.offset, "the freed register is reused first");
        pool.give(&r.shared(), &proto);
        assert_eq!(pool.in_use(), BFREGS_PER_UAR + 1, "a shared register is not given back");
        assert_eq!(pool.drain_extra().collect::<heapless::Vec<_, 4>>(), [9]);
        assert_eq!(pool.in_use(), 0);
    }

    #[test]
    fn the_pool_is_bounded() {
        let mut pool = BfregPool::default();
        for i in 0..MAX_BF_PAGES as u32 {
            assert!(pool.add_page(i + 1));
        }
        assert!(!pool.has_room() && !pool.add_page(99));
    }
}

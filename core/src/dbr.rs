//! Doorbell records (rdma-core `mlx5_alloc_dbrec` / `mlx5_free_db`, Linux `mlx5_db_alloc`): the few bytes of host
//! memory where the driver publishes a queue's consumer or producer counter for the device to read (`cqc.dbr_addr`,
//! `qpc.dbr_addr`).
//!
//! One DMA page holds many records, each alone on its cache line so that the CPU updating one queue's record never
//! shares a line with another queue's (no false sharing between cores, and no read-modify-write of a line the
//! device is fetching for another queue). A bitmap per page tracks free records; pages that still have free
//! records are used first, a page is added when none has room, and it is returned to the allocator as soon as its
//! last record is freed (rdma-core's `dbrec.c`). The pages are kept in a [`Table`] the pool's user chooses: a
//! fixed one ([`DbrPool`]`<N>`, at most `N` pages) or a growable one ([`DbrPoolOf`] over a host vector).

use crate::hal::{Dma, DmaError, DmaRegion, Span};
use crate::table::Table;

/// Size of one record page.
pub const DBR_PAGE_SIZE: usize = 4096;

/// A record: its page and slot, and where it is for the CPU and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbRec {
    page: u32,
    slot: u8,
    /// The record's page, owned by the pool; the pool frees a page only when its last record is freed.
    region: Span,
    /// Offset of the record in the page.
    pub offset: usize,
}

impl DbRec {
    /// Bus address for the queue context's `dbr_addr`.
    pub fn iova(&self) -> u64 {
        self.region.iova() + self.offset as u64
    }

    /// Pointer to the record's first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.region.ptr_at(self.offset, 8)
    }

    /// Writes dword `i` (0 or 1) of the record, big endian as the device reads it.
    #[inline]
    pub fn write_be32(&self, i: usize, v: u32) {
        let p = self.region.ptr_at(self.offset + 4 * i, 4).cast::<u32>();
        // SAFETY: inside the record page (ptr_at), which the pool keeps until this record is freed (`free`'s
        // contract: no copy of a freed record is used); records are 8-byte aligned (cache-line slots in a page
        // aligned to 4 KiB), so the u32 access is aligned. Volatile: the device reads it concurrently.
        unsafe { p.write_volatile(v.to_be()) }
    }

    /// Reads dword `i` of the record (host order).
    #[inline]
    pub fn read_be32(&self, i: usize) -> u32 {
        let p = self.region.ptr_at(self.offset + 4 * i, 4).cast::<u32>();
        // SAFETY: as in write_be32.
        u32::from_be(unsafe { p.read_volatile() })
    }
}

/// Why a record could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum DbrError {
    /// Every page slot of the pool holds a full page (a fixed pool's capacity), or no memory for another slot.
    Full,
    /// The page could not be allocated.
    Dma(DmaError),
    /// A record this pool did not hand out, or one freed twice.
    NotAllocated,
}

impl core::fmt::Display for DbrError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DbrError::Full => write!(f, "doorbell record pool is full (no room for another record page)"),
            DbrError::Dma(e) => write!(f, "failed to allocate a doorbell record page: {e}"),
            DbrError::NotAllocated => write!(f, "doorbell record was not allocated"),
        }
    }
}

impl core::error::Error for DbrError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        match self {
            Self::Dma(e) => Some(e),
            _ => None,
        }
    }
}

/// One record page of a pool: its memory and which records are free (opaque; a [`Table`] holds them).
#[derive(Debug)]
pub struct DbrPage {
    region: DmaRegion,
    /// Bit i set = slot i free.
    free: u64,
}

/// A pool of record pages in at most `N` slots.
pub type DbrPool<const N: usize> = DbrPoolOf<heapless::Vec<Option<DbrPage>, N>>;

/// Record pages in the slots of `S`; records are `stride` bytes apart (the CPU cache line: 64 or 128). A slot
/// emptied by a freed page is reused by the next page, so the table grows only to the most pages held at once.
#[derive(Debug)]
pub struct DbrPoolOf<S: Table<Option<DbrPage>>> {
    pages: S,
    /// No slot below this one has a page with a free record (so an allocation does not scan the full pages).
    first_free: usize,
    stride: usize,
    per_page: u32,
}

impl<S: Table<Option<DbrPage>>> DbrPoolOf<S> {
    /// A pool placing one record per `cache_line` bytes (a power of two from 8 to 4096; at most 64 records fit
    /// the per-page bitmap, so smaller lines are spaced at 64 bytes).
    pub fn new(cache_line: usize) -> Self {
        let stride = cache_line.clamp(DBR_PAGE_SIZE / 64, DBR_PAGE_SIZE).next_power_of_two();
        Self { pages: S::default(), first_free: 0, stride, per_page: (DBR_PAGE_SIZE / stride) as u32 }
    }

    /// Bytes between records (the cache line size).
    pub fn stride(&self) -> usize {
        self.stride
    }

    fn all_free(&self) -> u64 {
        if self.per_page == 64 {
            u64::MAX
        } else {
            (1u64 << self.per_page) - 1
        }
    }

    /// A zeroed record: from the first page with a free slot, else from a new page (in an empty slot, else in
    /// a slot the table grows by).
    pub fn alloc(&mut self, dma: &impl Dma) -> Result<DbRec, DbrError> {
        let start = self.first_free.min(self.pages.len());
        let found = self.pages.as_slice()[start..].iter().position(|p| p.as_ref().is_some_and(|p| p.free != 0));
        let idx = match found {
            Some(i) => start + i,
            None => {
                let empty = self.pages.as_slice().iter().position(Option::is_none);
                if empty.is_none() && !self.pages.reserve_one() {
                    return Err(DbrError::Full);
                }
                let i = empty.unwrap_or(self.pages.len());
                if u32::try_from(i).is_err() {
                    return Err(DbrError::Full);
                }
                let region = dma.alloc(DBR_PAGE_SIZE, DBR_PAGE_SIZE).map_err(DbrError::Dma)?;
                let page = Some(DbrPage { region, free: self.all_free() });
                if empty.is_some() {
                    self.pages.as_mut_slice()[i] = page;
                } else if let Err(Some(p)) = self.pages.push(page) {
                    // Room was reserved above; should the table refuse anyway, the page goes back.
                    // SAFETY: allocated just above and never shown to the device.
                    unsafe { dma.free(p.region) };
                    return Err(DbrError::Full);
                }
                i
            }
        };
        self.first_free = idx;
        let per_page = self.per_page;
        let Some(Some(page)) = self.pages.as_mut_slice().get_mut(idx) else { unreachable!("page {idx} chosen above") };
        let slot = page.free.trailing_zeros();
        debug_assert!(slot < per_page);
        page.free &= !(1u64 << slot);
        let offset = slot as usize * self.stride;
        // A reused slot may hold the counters of its previous queue.
        page.region.zero(offset, 8);
        let rec = DbRec { page: idx as u32, slot: slot as u8, region: Span::of(page.region.view()), offset };
        Ok(rec)
    }

    /// Frees a record; its page goes back to the allocator when it was the last one in use.
    ///
    /// # Safety
    /// The device no longer reads or writes the record (its queue is destroyed or the function disabled), and
    /// no copy of `rec` is used afterwards (its page may go back to the allocator).
    pub unsafe fn free(&mut self, dma: &impl Dma, rec: DbRec) -> Result<(), DbrError> {
        let all = self.all_free();
        let idx = rec.page as usize;
        let slot = self.pages.as_mut_slice().get_mut(idx).ok_or(DbrError::NotAllocated)?;
        let page = slot.as_mut().ok_or(DbrError::NotAllocated)?;
        let bit = 1u64 << rec.slot;
        if Span::of(page.region.view()) != rec.region || page.free & bit != 0 {
            return Err(DbrError::NotAllocated);
        }
        page.free |= bit;
        if page.free == all {
            if let Some(DbrPage { region, .. }) = slot.take() {
                // SAFETY: the page came from `dma.alloc` in `alloc`, every record in it is free (so no queue's
                // context points at it any more, per the caller's duty), and it is dropped from the pool.
                unsafe { dma.free(region) };
            }
            self.trim();
        }
        self.first_free = self.first_free.min(idx);
        Ok(())
    }

    /// Drops the empty slots at the end, so the table shrinks back as pages go.
    fn trim(&mut self) {
        while matches!(self.pages.as_slice().last(), Some(None)) {
            let _ = self.pages.remove(self.pages.len() - 1);
        }
    }

    /// Pages currently held.
    pub fn pages(&self) -> usize {
        self.pages.as_slice().iter().flatten().count()
    }

    /// Page slots the table holds, filled or not (what it has grown to).
    pub fn slots(&self) -> usize {
        self.pages.len()
    }

    /// Records in use.
    pub fn in_use(&self) -> usize {
        self.pages.as_slice().iter().flatten().map(|p| (self.per_page - p.free.count_ones()) as usize).sum()
    }

    /// Frees every page regardless of use (teardown of a disabled or dead function).
    ///
    /// # Safety
    /// The device no longer accesses any record (the function is disabled or dead), and no record of this pool
    /// is used afterwards.
    pub unsafe fn release_all(&mut self, dma: &impl Dma) {
        self.first_free = 0;
        for p in self.pages.as_mut_slice() {
            if let Some(page) = p.take() {
                // SAFETY: allocated in `alloc`, taken out of the pool so freed once; the caller guarantees the
                // device is done with every record.
                unsafe { dma.free(page.region) };
            }
        }
        self.trim();
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    use crate::hal::tests::TestDma;

    #[test]
    fn records_are_one_per_cache_line_and_pages_come_and_go_with_them() {
        let dma = TestDma::default();
        let mut pool = DbrPool::<2>::new(128);
        assert_eq!(pool.stride(), 128);
        let recs: heapless::Vec<DbRec, 64> = (0..32).map(|_| pool.alloc(&dma).unwrap()).collect();
        // 4096 / 128 = 32 records fill the first page, at consecutive lines.
        assert_eq!((pool.pages(), pool.in_use()), (1, 32));
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(r.offset, i * 128);
            assert_eq!(r.iova(), recs[0].iova() + (i * 128) as u64);
        }
        let extra = pool.alloc(&dma).unwrap();
        assert_eq!((pool.pages(), extra.offset), (2, 0));
        // SAFETY: no device; each record freed once and not used after.
        unsafe { pool.free(&dma, extra).unwrap() };
        assert_eq!((pool.pages(), dma.live()), (1, 1), "an emptied page goes back at once");
        for r in recs {
            // SAFETY: as above.
            unsafe { pool.free(&dma, r).unwrap() };
        }
        assert_eq!((pool.pages(), pool.in_use(), dma.live()), (0, 0, 0));
    }

    #[test]
    fn a_reused_record_is_zeroed_and_reads_back_big_endian() {
        let dma = TestDma::default();
        let mut pool = DbrPool::<1>::new(64);
        let keep = pool.alloc(&dma).unwrap();
        let r = pool.alloc(&dma).unwrap();
        r.write_be32(0, 0x0102_0304);
        r.write_be32(1, 0xa0b0_c0d0);
        // SAFETY: the record's bytes are inside the live page.
        let raw = unsafe { core::slice::from_raw_parts(r.ptr(), 8) };
        assert_eq!(raw, [1, 2, 3, 4, 0xa0, 0xb0, 0xc0, 0xd0]);
        assert_eq!((r.read_be32(0), r.read_be32(1)), (0x0102_0304, 0xa0b0_c0d0));
        let slot = r.offset;
        // SAFETY: no device; freed once and not used after.
        unsafe { pool.free(&dma, r).unwrap() };
        let again = pool.alloc(&dma).unwrap();
        assert_eq!(again.offset, slot, "the free slot of a page with room is used first");
        assert_eq!((again.read_be32(0), again.read_be32(1)), (0, 0), "a previous queue's counters are cleared");
        // SAFETY: as above.
        unsafe {
            pool.free(&dma, again).unwrap();
            pool.free(&dma, keep).unwrap();
        }
    }

    #[test]
    fn small_lines_are_spaced_to_fit_the_bitmap_and_a_full_pool_says_so() {
        let dma = TestDma::default();
        // 16-byte lines would give 256 records a page; the bitmap holds 64, so records sit 64 bytes apart.
        let mut pool = DbrPool::<1>::new(16);
        assert_eq!(pool.stride(), 64);
        let recs: heapless::Vec<DbRec, 64> = (0..64).map(|_| pool.alloc(&dma).unwrap()).collect();
        assert_eq!(pool.alloc(&dma), Err(DbrError::Full));
        // SAFETY: no device; the pool is released and no record is used after.
        unsafe { pool.release_all(&dma) };
        assert_eq!((pool.pages(), dma.live()), (0, 0));
        drop(recs);
    }

    #[test]
    fn a_record_the_pool_did_not_hand_out_is_refused() {
        let dma = TestDma::default();
        let mut a = DbrPool::<1>::new(64);
        let mut b = DbrPool::<1>::new(64);
        let ra = a.alloc(&dma).unwrap();
        let rb = b.alloc(&dma).unwrap();
        // SAFETY: no device; the refused calls free nothing.
        unsafe {
            assert_eq!(a.free(&dma, rb), Err(DbrError::NotAllocated));
            a.free(&dma, ra).unwrap();
            assert_eq!(a.free(&dma, ra), Err(DbrError::NotAllocated), "a copy of a freed record");
            b.free(&dma, rb).unwrap();
        }
        assert_eq!(dma.live(), 0);
    }

    // Host-only (testlist::HOST_ONLY): the table is std's Vec.
    #[cfg(test)]
    #[test]
    fn a_growable_table_holds_more_records_than_any_fixed_pool_and_shrinks_back() {
        extern crate std;
        use crate::table::growable::Grow;
        use std::vec::Vec;
        let dma = TestDma::default();
        let mut pool = DbrPoolOf::<Grow<Option<DbrPage>>>::new(64);
        // 79 full pages: past the 4,096 records of the HCA's former fixed 64 pages.
        let recs: Vec<DbRec> = (0..79 * 64).map(|_| pool.alloc(&dma).unwrap()).collect();
        assert_eq!((pool.pages(), pool.slots(), pool.in_use()), (79, 79, 79 * 64));
        let mut iovas: Vec<u64> = recs.iter().map(DbRec::iova).collect();
        iovas.sort_unstable();
        iovas.dedup();
        assert_eq!(iovas.len(), 79 * 64, "every record distinct");
        // Freeing the records of page 3 frees that page; the next record's new page takes its slot.
        let (page3, rest): (Vec<DbRec>, Vec<DbRec>) = recs.into_iter().partition(|r| r.page == 3);
        for r in page3 {
            // SAFETY: no device; each record freed once and not used after.
            unsafe { pool.free(&dma, r).unwrap() };
        }
        assert_eq!((pool.pages(), dma.live()), (78, 78));
        let again = pool.alloc(&dma).unwrap();
        assert_eq!((again.page, pool.pages(), pool.slots()), (3, 79, 79), "the emptied slot is filled first");
        for r in rest.into_iter().chain([again]) {
            // SAFETY: as above.
            unsafe { pool.free(&dma, r).unwrap() };
        }
        assert_eq!((pool.pages(), pool.slots(), pool.in_use(), dma.live()), (0, 0, 0, 0), "nothing kept");
    }

    #[test]
    fn an_allocator_failure_is_reported_and_leaves_the_pool_as_it_was() {
        let dma = TestDma::limited(1024);
        let mut pool = DbrPool::<1>::new(64);
        assert_eq!(pool.alloc(&dma), Err(DbrError::Dma(DmaError::NoMemory { len: DBR_PAGE_SIZE })));
        assert_eq!((pool.pages(), pool.in_use()), (0, 0));
    }
}

//! Queue buffers and their page lists: how a buffer the device reads or writes is described to firmware as
//! `log_page_size` + `page_offset` + `pas[]` (Linux `mlx5_frag_buf` and `mlx5_fill_page_frag_array`, IB core
//! `ib_umem_find_best_pgsz`, mlx5_ib `populate_pas`).
//!
//! A buffer is one or more DMA segments. The page size chosen is the largest one for which every page lies inside
//! one segment with the same offset in the page on both sides (device address and the buffer's own address), so
//! that one bus address per page describes the whole buffer.

use crate::cmd::PageSource;
use crate::hal::{Dma, DmaError, DmaOwned, DmaRegion, DmaView};
use crate::prm::consts;

/// Firmware's base page: `log_page_size` fields count from here (`MLX5_ADAPTER_PAGE_SHIFT`).
pub const ADAPTER_PAGE_SHIFT: u32 = consts::MLX5_ADAPTER_PAGE_SHIFT;

/// Largest page shift a 5-bit `log_page_size` (relative to 4 KiB) can express in a cqc / eqc / qpc.
pub const MAX_QUEUE_PAGE_SHIFT: u32 = ADAPTER_PAGE_SHIFT + 31;

/// Most fragments one queue buffer may have. Buffers that cannot be allocated in at most this many pieces fail
/// with `NoMemory`; the array lives inline because the core does not allocate.
pub const MAX_FRAGS: usize = 64;

/// A CPU cache line: the granule that keeps per-queue state of two queues (used from two threads) apart.
pub const CACHE_LINE: usize = 64;

/// Largest alignment asked of the DMA allocator for a fragment: enough for 2 MiB pages.
const MAX_FRAG_ALIGN: usize = 2 << 20;

/// One device-contiguous piece of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaSeg {
    /// Bus address of the segment.
    pub iova: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Page sizes `2^min_shift ..= 2^max_shift` as a bitmap (bit n = page size 2^n).
pub const fn page_sizes(min_shift: u32, max_shift: u32) -> u64 {
    let hi = if max_shift >= 63 { u64::MAX } else { (1u64 << (max_shift + 1)) - 1 };
    hi & !((1u64 << min_shift) - 1)
}

/// The largest page shift in `pgsz_bitmap` that maps `segs` (in order) at buffer address `va`, or `None` when no
/// allowed size works (`ib_umem_find_best_pgsz`). `va` is the address the device will be given for the first byte:
/// 0 for a queue buffer, the memory region's virtual address for a memory key.
///
/// Every page must fall inside one segment with matching low bits on both sides, so the low bits where a
/// segment's bus address and its buffer address differ rule out larger pages, and so does the end of every
/// segment but the last. Pages larger than the smallest one covering the whole buffer gain nothing.
pub fn best_page_shift(segs: &[DmaSeg], va: u64, pgsz_bitmap: u64) -> Option<u32> {
    let total: u64 = segs.iter().map(|s| s.len).sum();
    if total == 0 || pgsz_bitmap == 0 {
        return None;
    }
    let end = va.checked_add(total - 1)?;
    // bits_per((end) ^ va): the first bit position that does not change across the buffer.
    let span_bits = 64 - (end ^ va).leading_zeros();
    let mut mask = if span_bits >= 64 { 0 } else { pgsz_bitmap & (u64::MAX << span_bits) };
    let mut at = va;
    for (i, s) in segs.iter().enumerate() {
        mask |= s.iova ^ at;
        at = at.wrapping_add(s.len);
        if i + 1 != segs.len() {
            mask |= at;
        }
    }
    let mut allowed = pgsz_bitmap;
    if mask != 0 {
        let tz = mask.trailing_zeros();
        allowed &= if tz >= 63 { u64::MAX } else { (1u64 << (tz + 1)) - 1 };
    }
    (allowed != 0).then(|| 63 - allowed.leading_zeros())
}

/// The page description of a buffer: page size, where the buffer starts in its first page, and how many pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageLayout {
    /// log2 of the page size in bytes.
    pub page_shift: u32,
    /// Offset of the buffer's first byte inside its first page.
    pub offset: u64,
    /// Pages of that size the memory spans.
    pub npages: usize,
}

impl PageLayout {
    /// Chooses the page size for `segs` at buffer address `va` (see [`best_page_shift`]).
    pub fn choose(segs: &[DmaSeg], va: u64, pgsz_bitmap: u64) -> Option<Self> {
        let page_shift = best_page_shift(segs, va, pgsz_bitmap)?;
        let total: u64 = segs.iter().map(|s| s.len).sum();
        let first = va >> page_shift;
        let last = (va + total - 1) >> page_shift;
        let npages = usize::try_from(last - first + 1).ok()?;
        Some(Self { page_shift, offset: va & ((1u64 << page_shift) - 1), npages })
    }

    /// `log_page_size` as queue contexts take it: relative to 4 KiB.
    pub fn log_page_size(&self) -> u8 {
        (self.page_shift - ADAPTER_PAGE_SHIFT) as u8
    }

    /// The page size in bytes.
    pub fn page_size(&self) -> u64 {
        1u64 << self.page_shift
    }
}

/// The bus address of every page of `segs` under `layout`, in order (`populate_pas`): each segment contributes
/// the pages from its start rounded down to its end rounded up, which [`best_page_shift`] guarantees do not overlap.
#[derive(Debug, Clone, Copy)]
pub struct PageList<'a> {
    /// The memory's DMA segments, in order.
    pub segs: &'a [DmaSeg],
    /// The page size and count the list uses.
    pub layout: PageLayout,
}

impl PageSource for PageList<'_> {
    fn count(&self) -> usize {
        self.layout.npages
    }
    fn each(&self, f: &mut dyn FnMut(usize, u64)) {
        let size = self.layout.page_size();
        let mut i = 0;
        for s in self.segs {
            let mut page = s.iova & !(size - 1);
            let end = s.iova + s.len;
            while page < end && i < self.layout.npages {
                f(i, page);
                i += 1;
                page += size;
            }
        }
    }
}

/// A ring's segments and chosen page layout, from [`QueueBuf::pages`].
#[derive(Debug, Clone, Copy)]
pub struct QueuePages {
    segs: [DmaSeg; MAX_FRAGS],
    n: usize,
    /// The page size and count of the list.
    pub layout: PageLayout,
}

impl QueuePages {
    /// The `pas[]` source.
    pub fn list(&self) -> PageList<'_> {
        PageList { segs: &self.segs[..self.n], layout: self.layout }
    }
}

/// A queue buffer (CQ, QP, SRQ ring) made of equal power-of-two fragments (`mlx5_frag_buf`): one when the DMA
/// allocator can give the whole size contiguously, otherwise the smallest number of pieces it can give.
/// Entry lookup is a shift and a mask whichever it is.
#[derive(Debug)]
pub struct QueueBuf {
    frags: [Option<DmaRegion>; MAX_FRAGS],
    nfrags: usize,
    log_frag: u32,
    len: usize,
}

impl QueueBuf {
    /// Allocates `len` bytes (a power of two, at least 4 KiB is used) as few fragments as the allocator allows,
    /// each aligned to its size (up to 2 MiB) so large pages can describe it. Nothing is kept on failure.
    pub fn alloc(dma: &impl Dma, len: usize) -> Result<Self, DmaError> {
        let len = len.max(1 << ADAPTER_PAGE_SHIFT).next_power_of_two();
        let mut frag = len;
        loop {
            match Self::alloc_frags(dma, len, frag) {
                Ok(b) => return Ok(b),
                Err(DmaError::NoMemory { .. }) if frag > 1 << ADAPTER_PAGE_SHIFT && len / (frag / 2) <= MAX_FRAGS => {
                    frag /= 2;
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn alloc_frags(dma: &impl Dma, len: usize, frag: usize) -> Result<Self, DmaError> {
        let n = len / frag;
        if n > MAX_FRAGS {
            return Err(DmaError::NoMemory { len });
        }
        let mut b = Self { frags: [const { None }; MAX_FRAGS], nfrags: 0, log_frag: frag.trailing_zeros(), len };
        for _ in 0..n {
            let r = match dma.alloc(frag, frag.min(MAX_FRAG_ALIGN)) {
                Err(DmaError::BadAlignment { .. }) => dma.alloc(frag, 1 << ADAPTER_PAGE_SHIFT),
                r => r,
            };
            match r {
                Ok(r) => {
                    b.frags[b.nfrags] = Some(r);
                    b.nfrags += 1;
                }
                Err(e) => {
                    // SAFETY: the fragments were just allocated and never given to the device.
                    unsafe { b.free(dma) };
                    return Err(e);
                }
            }
        }
        Ok(b)
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of DMA fragments.
    pub fn nfrags(&self) -> usize {
        self.nfrags
    }

    /// Fragment `i`, if there is one.
    pub fn frag(&self, i: usize) -> Option<DmaView<'_>> {
        self.frags.get(i).and_then(Option::as_ref).map(DmaRegion::view)
    }

    /// Gives up the buffer for its fragments, for a caller that frees or keeps each one itself.
    pub fn into_frags(self) -> impl Iterator<Item = DmaRegion> {
        self.frags.into_iter().flatten()
    }

    /// The region holding byte `off` and the offset inside it. `off` is reduced modulo the buffer length, so ring
    /// indices can be passed unmasked.
    #[inline]
    pub fn locate(&self, off: usize) -> (DmaView<'_>, usize) {
        let off = off & (self.len - 1);
        let i = off >> self.log_frag;
        let r = self.frags[i].as_ref().unwrap_or_else(|| unreachable!("fragment {i} of a live buffer"));
        (r.view(), off & ((1 << self.log_frag) - 1))
    }

    /// Pointer to `len` bytes at `off`; the span must not cross a fragment (entries are powers of two no larger
    /// than a fragment, so an entry never does).
    #[inline]
    pub fn ptr(&self, off: usize, len: usize) -> *mut u8 {
        let (r, o) = self.locate(off);
        r.ptr_at(o, len)
    }

    /// The buffer as DMA segments for [`PageLayout::choose`]; adjacent fragments are merged.
    pub fn segs(&self, out: &mut [DmaSeg; MAX_FRAGS]) -> usize {
        let mut n = 0;
        for r in self.frags.iter().flatten() {
            if n > 0 && out[n - 1].iova + out[n - 1].len == r.iova() {
                out[n - 1].len += r.len() as u64;
            } else {
                out[n] = DmaSeg { iova: r.iova(), len: r.len() as u64 };
                n += 1;
            }
        }
        n
    }

    /// The page description firmware gets for this ring: the largest page size its fragments allow, with the
    /// ring's own addresses starting at 0.
    pub fn pages(&self) -> QueuePages {
        let mut segs = [DmaSeg { iova: 0, len: 0 }; MAX_FRAGS];
        let n = self.segs(&mut segs);
        let layout = PageLayout::choose(&segs[..n], 0, page_sizes(ADAPTER_PAGE_SHIFT, MAX_QUEUE_PAGE_SHIFT))
            .unwrap_or_else(|| unreachable!("fragments aligned to 4 KiB always map with 4 KiB pages"));
        QueuePages { segs, n, layout }
    }

    /// Returns every fragment to the allocator.
    ///
    /// # Safety
    /// The device no longer accesses the buffer (its queue is destroyed, the function disabled, or it never saw it).
    pub unsafe fn free(&mut self, dma: &impl Dma) {
        for f in self.frags.iter_mut() {
            if let Some(r) = f.take() {
                // SAFETY: allocated by `alloc_frags` from this allocator, taken out so freed once; the caller
                // guarantees the device is done with it.
                unsafe { dma.free(r) };
            }
        }
        self.nfrags = 0;
    }
}

impl DmaOwned for QueueBuf {
    unsafe fn free_to<D: Dma + ?Sized>(mut self, dma: &D) {
        // SAFETY: the caller's duties are `free`'s.
        unsafe { self.free(&dma) }
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    const QUEUE: u64 = page_sizes(12, MAX_QUEUE_PAGE_SHIFT);

    fn seg(iova: u64, len: u64) -> DmaSeg {
        DmaSeg { iova, len }
    }

    fn pages(segs: &[DmaSeg], layout: PageLayout) -> heapless::Vec<u64, 64> {
        let mut v = heapless::Vec::new();
        PageList { segs, layout }.each(&mut |i, a| {
            assert_eq!(i, v.len());
            v.push(a).unwrap();
        });
        v
    }

    #[test]
    fn contiguous_aligned_buffer_is_one_page() {
        let s = [seg(0x1_0001_0000, 0x10000)];
        let l = PageLayout::choose(&s, 0, QUEUE).unwrap();
        assert_eq!((l.page_shift, l.offset, l.npages, l.log_page_size()), (16, 0, 1, 4));
        assert_eq!(pages(&s, l), [0x1_0001_0000]);
    }

    #[test]
    fn alignment_of_the_bus_address_limits_the_page() {
        // 64 KiB at an address aligned only to 8 KiB: 8 pages of 8 KiB.
        let s = [seg(0x1_0000_6000, 0x10000)];
        let l = PageLayout::choose(&s, 0, QUEUE).unwrap();
        assert_eq!((l.page_shift, l.npages), (13, 8));
        assert_eq!(pages(&s, l).first(), Some(&0x1_0000_6000));
        assert_eq!(pages(&s, l).last(), Some(&0x1_0001_4000));
    }

    #[test]
    fn scattered_4k_fragments_use_4k_pages() {
        let s = [seg(0x5000, 0x1000), seg(0x9000, 0x1000), seg(0x2000, 0x1000)];
        let l = PageLayout::choose(&s, 0, QUEUE).unwrap();
        assert_eq!((l.page_shift, l.npages), (12, 3));
        assert_eq!(pages(&s, l), [0x5000, 0x9000, 0x2000]);
    }

    #[test]
    fn scattered_aligned_fragments_keep_their_size() {
        // Two 64 KiB fragments, each 64 KiB aligned, far apart: 64 KiB pages.
        let s = [seg(0x40_0000, 0x10000), seg(0x10_0000, 0x10000)];
        let l = PageLayout::choose(&s, 0, QUEUE).unwrap();
        assert_eq!((l.page_shift, l.npages), (16, 2));
        assert_eq!(pages(&s, l), [0x40_0000, 0x10_0000]);
        // One of them only 4 KiB aligned: everything drops to 4 KiB pages.
        let s = [seg(0x40_0000, 0x10000), seg(0x10_1000, 0x10000)];
        let l = PageLayout::choose(&s, 0, QUEUE).unwrap();
        assert_eq!((l.page_shift, l.npages), (12, 32));
    }

    #[test]
    fn an_interior_segment_end_limits_the_page() {
        // The first segment ends at 12 KiB: pages cannot be larger than 4 KiB.
        let s = [seg(0x10000, 0x3000), seg(0x20000, 0x1000)];
        assert_eq!(best_page_shift(&s, 0, QUEUE), Some(12));
    }

    #[test]
    fn memory_key_va_offset_is_kept() {
        // A 10 000-byte region at VA 0x7f00_0000_1234, bus 0x1_0000_0234: the low 12 bits differ above 0x234's
        // bits only at bit 12, so 4 KiB pages; the first page holds the start at offset 0x234.
        let s = [seg(0x1_0000_0234, 10_000)];
        let l = PageLayout::choose(&s, 0x7f00_0000_1234, page_sizes(12, 30)).unwrap();
        assert_eq!((l.page_shift, l.offset, l.npages), (12, 0x234, 3));
        assert_eq!(pages(&s, l), [0x1_0000_0000, 0x1_0000_1000, 0x1_0000_2000]);
    }

    #[test]
    fn incongruent_low_bits_have_no_page_size() {
        // Bus and virtual addresses differ below 4 KiB: no 4 KiB page maps both.
        let s = [seg(0x1_0000_0100, 0x2000)];
        assert_eq!(best_page_shift(&s, 0x2000, page_sizes(12, 30)), None);
        assert_eq!(best_page_shift(&[], 0, QUEUE), None);
    }

    #[test]
    fn page_size_bitmap() {
        assert_eq!(page_sizes(12, 12), 0x1000);
        assert_eq!(page_sizes(12, 13), 0x3000);
        assert_eq!(page_sizes(12, 63), !0xfff);
    }

    #[test]
    fn a_queue_buffer_is_one_fragment_when_it_can_be_and_pieces_when_not() {
        use crate::hal::tests::TestDma;
        let dma = TestDma::default();
        let mut one = QueueBuf::alloc(&dma, 5000).unwrap();
        // Rounded up to a power of two, in one piece.
        assert_eq!((one.len(), one.nfrags()), (8192, 1));
        let (r, o) = one.locate(8192 + 100);
        assert_eq!((r.iova(), o), (one.frag(0).unwrap().iova(), 100), "ring indices wrap at the length");
        // SAFETY: never given to a device.
        unsafe { one.free(&dma) };

        let small = TestDma::limited(4096);
        let frags = QueueBuf::alloc(&small, 16384).unwrap();
        assert_eq!((frags.len(), frags.nfrags()), (16384, 4));
        let (r, o) = frags.locate(3 * 4096 + 8);
        assert_eq!((r.iova(), o), (frags.frag(3).unwrap().iova(), 8));
        assert_eq!(frags.ptr(4096, 64) as usize, frags.frag(1).unwrap().cpu().as_ptr() as usize);
        let pages = frags.pages();
        assert_eq!(pages.layout.page_shift, 12, "4 KiB pieces describe themselves with 4 KiB pages");
        // Giving up the buffer hands back every fragment exactly once.
        let n = frags.into_frags().map(|r| {
            // SAFETY: never given to a device; each fragment freed once.
            unsafe { small.free(r) }
        });
        assert_eq!(n.count(), 4);
        assert_eq!(small.live(), 0);
    }

    #[test]
    fn a_guarded_queue_buffer_frees_every_fragment() {
        use crate::hal::{tests::TestDma, DmaGuard};
        // Regions of at most 4 KiB: a 16 KiB buffer is four fragments.
        let dma = TestDma::limited(4096);
        let buf = QueueBuf::alloc(&dma, 16384).unwrap();
        assert_eq!((buf.nfrags(), dma.live()), (4, 4));
        // SAFETY: fresh from this allocator, never shown to a device.
        let g = unsafe { DmaGuard::new(&dma, buf) };
        assert_eq!(g.len(), 16384);
        drop(g);
        assert_eq!(dma.live(), 0);
    }

    #[test]
    fn a_failed_fragment_frees_the_ones_before_it() {
        use crate::hal::tests::TestDma;
        // Nothing of 4 KiB or more can be had: the whole allocation fails and nothing stays allocated.
        let none = TestDma::limited(2048);
        assert!(matches!(QueueBuf::alloc(&none, 8192), Err(DmaError::NoMemory { .. })));
        assert_eq!(none.live(), 0);
    }
}

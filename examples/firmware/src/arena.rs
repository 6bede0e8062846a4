//! [`Dma`] from one static arena: a bump pointer plus a free list of holes below it (`heapless`, fixed capacity,
//! no heap), first fit, neighbours coalesced on free.
//!
//! On a microcontroller without an IOMMU the device sees memory at the address the CPU does, so every region's
//! `iova` is its CPU address. Which memory qualifies (reachable through the PCIe controller's inbound window,
//! coherent) is the platform's promise, made once in [`Arena::new`].

use core::cell::RefCell;
use core::mem::MaybeUninit;
use core::ptr::NonNull;

use mlx5_core::hal::{Dma, DmaError, DmaRegion};

/// Smallest unit handed out: sizes and addresses are multiples of it, so holes never become uselessly small.
pub const GRANULE: usize = 8;

/// A span of the arena, by CPU address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: usize,
    /// Bytes the span occupies (the request rounded up to [`GRANULE`]).
    len: usize,
}

impl Span {
    const fn end(self) -> usize {
        self.start + self.len
    }
}

/// A live region: its span and the length the caller asked for.
#[derive(Debug, Clone, Copy)]
struct Live {
    span: Span,
    asked: usize,
}

#[derive(Debug)]
struct State<const HOLES: usize, const LIVE: usize> {
    /// Bump pointer: everything from here to the end of the arena is free.
    top: usize,
    /// Free spans below `top`, sorted by address, never touching each other or `top` (they are merged).
    holes: heapless::Vec<Span, HOLES>,
    live: heapless::Vec<Live, LIVE>,
    /// Highest `top` reached.
    peak: usize,
    /// Bytes given up because the hole list was full when they became free.
    lost: usize,
}

/// What the arena holds right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaStats {
    pub capacity: usize,
    pub live_regions: usize,
    pub live_bytes: usize,
    pub holes: usize,
    /// High-water mark of the bump pointer, in bytes from the arena's start.
    pub peak_bytes: usize,
    pub lost_bytes: usize,
}

/// The allocator. `HOLES` free spans and `LIVE` live regions at most; an allocation that would need more fails
/// with [`DmaError::NoMemory`] like one that does not fit.
#[derive(Debug)]
pub struct Arena<const HOLES: usize = 32, const LIVE: usize = 64> {
    base: usize,
    end: usize,
    st: RefCell<State<HOLES, LIVE>>,
}

const fn align_up(v: usize, align: usize) -> Option<usize> {
    match v.checked_add(align - 1) {
        Some(x) => Some(x & !(align - 1)),
        None => None,
    }
}

impl<const HOLES: usize, const LIVE: usize> Arena<HOLES, LIVE> {
    /// An allocator over `mem`. Its contents do not matter: every region is zeroed when handed out.
    ///
    /// # Safety
    /// The device reaches every byte of `mem` at its CPU address (no IOMMU, or an identity mapping; the PCIe
    /// controller's inbound window covers it), and CPU and device see each other's writes without cache
    /// maintenance (no data cache, or `mem` is mapped non-cacheable). These are what [`Dma`] promises the driver.
    pub unsafe fn new(mem: &'static mut [MaybeUninit<u8>]) -> Self {
        let base = mem.as_mut_ptr() as usize;
        let end = base + mem.len();
        let st = State { top: base, holes: heapless::Vec::new(), live: heapless::Vec::new(), peak: base, lost: 0 };
        Self { base, end, st: RefCell::new(st) }
    }

    pub fn stats(&self) -> ArenaStats {
        let st = self.st.borrow();
        ArenaStats {
            capacity: self.end - self.base,
            live_regions: st.live.len(),
            live_bytes: st.live.iter().map(|l| l.span.len).sum(),
            holes: st.holes.len(),
            peak_bytes: st.peak - self.base,
            lost_bytes: st.lost,
        }
    }

    /// First fit among the holes, else from the bump pointer. Returns the span, with the bookkeeping updated.
    fn carve(&self, st: &mut State<HOLES, LIVE>, len: usize, align: usize) -> Option<Span> {
        for i in 0..st.holes.len() {
            let h = st.holes[i];
            let Some(start) = align_up(h.start, align) else { continue };
            if start.checked_add(len).is_none_or(|e| e > h.end()) {
                continue;
            }
            let head = Span { start: h.start, len: start - h.start };
            let tail = Span { start: start + len, len: h.end() - (start + len) };
            match (head.len, tail.len) {
                (0, 0) => {
                    st.holes.remove(i);
                }
                (0, _) => st.holes[i] = tail,
                (_, 0) => st.holes[i] = head,
                _ => {
                    // Two holes where there was one: needs a free entry.
                    if st.holes.is_full() {
                        continue;
                    }
                    st.holes[i] = head;
                    st.holes.insert(i + 1, tail).ok()?;
                }
            }
            return Some(Span { start, len });
        }
        let start = align_up(st.top, align)?;
        if start.checked_add(len).is_none_or(|e| e > self.end) {
            return None;
        }
        if start > st.top {
            // The alignment gap becomes a hole (merged with a hole that ends at `top`, if any).
            let gap = Span { start: st.top, len: start - st.top };
            match st.holes.last_mut() {
                Some(last) if last.end() == gap.start => last.len += gap.len,
                _ => {
                    if st.holes.push(gap).is_err() {
                        st.lost += gap.len;
                    }
                }
            }
        }
        st.top = start + len;
        st.peak = st.peak.max(st.top);
        Some(Span { start, len })
    }

    /// Returns `s` to the free space: lowers `top` when it is the last span, else becomes a hole merged with its
    /// neighbours.
    fn release(st: &mut State<HOLES, LIVE>, s: Span) {
        if s.end() == st.top {
            st.top = s.start;
            while let Some(last) = st.holes.last().copied() {
                if last.end() != st.top {
                    break;
                }
                st.top = last.start;
                st.holes.pop();
            }
            return;
        }
        let i = st.holes.iter().position(|h| h.start > s.start).unwrap_or(st.holes.len());
        let merge_prev = i > 0 && st.holes[i - 1].end() == s.start;
        let merge_next = i < st.holes.len() && s.end() == st.holes[i].start;
        match (merge_prev, merge_next) {
            (true, true) => {
                let next = st.holes.remove(i);
                st.holes[i - 1].len += s.len + next.len;
            }
            (true, false) => st.holes[i - 1].len += s.len,
            (false, true) => {
                st.holes[i].start = s.start;
                st.holes[i].len += s.len;
            }
            (false, false) => {
                if st.holes.insert(i, s).is_err() {
                    st.lost += s.len;
                }
            }
        }
    }
}

// SAFETY: regions are carved from `mem`, which `new`'s caller promised is device-reachable at its CPU address
// (so `iova == cpu` is the device's address) and coherent. Every region is zeroed before it is returned; its start
// is aligned to `align` (and so is its iova, the same number); spans come from the free space only (bump pointer
// or holes, both disjoint from every live span by construction), so live regions never overlap. A region stays
// valid until `free`, since the arena's memory is `'static` and only `free` returns a span to the free space.
unsafe impl<const HOLES: usize, const LIVE: usize> Dma for Arena<HOLES, LIVE> {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if !align.is_power_of_two() {
            return Err(DmaError::BadAlignment { align });
        }
        let Some(size) = align_up(len.max(1), GRANULE) else { return Err(DmaError::NoMemory { len }) };
        let mut st = self.st.borrow_mut();
        if st.live.is_full() {
            return Err(DmaError::NoMemory { len });
        }
        let span = self.carve(&mut st, size, align.max(GRANULE)).ok_or(DmaError::NoMemory { len })?;
        // Cannot fail: checked for room above.
        let _ = st.live.push(Live { span, asked: len });
        drop(st);
        let cpu = span.start as *mut u8;
        // SAFETY: the span lies inside the arena and belongs to no live region (carve), so nothing else reads or
        // writes it; zeroing all of it, padding included, keeps later reuse clean.
        unsafe { cpu.write_bytes(0, span.len) };
        // The arena never starts at address 0 (it is a Rust allocation), so the pointer is not null.
        let cpu = NonNull::new(cpu).ok_or(DmaError::MapFailed)?;
        // SAFETY: the span is inside the `'static` arena, belongs to no other live region (carve), and only
        // `free` returns it to the free space; the arena's memory is reachable by the device at its CPU address.
        Ok(unsafe { DmaRegion::from_raw_parts(cpu, span.start as u64, len) })
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let a = cpu as usize;
        let end = a.checked_add(len)?;
        let st = self.st.borrow();
        st.live.iter().find(|l| a >= l.span.start && end <= l.span.start + l.asked).map(|_| a as u64)
    }

    unsafe fn free(&self, region: DmaRegion) {
        let mut st = self.st.borrow_mut();
        let start = region.cpu().as_ptr() as usize;
        // A region this arena did not hand out (or one freed twice) breaks the caller's contract; it is ignored
        // rather than trusted, so it can never corrupt the free space.
        let Some(i) = st.live.iter().position(|l| l.span.start == start) else { return };
        let live = st.live.swap_remove(i);
        Self::release(&mut st, live.span);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    extern crate std;
    use std::boxed::Box;
    use std::vec;

    fn arena<const H: usize, const L: usize>(bytes: usize) -> Arena<H, L> {
        let mem = Box::leak(vec![MaybeUninit::new(0xa5u8); bytes].into_boxed_slice());
        // SAFETY: no device in these tests; only the allocator's bookkeeping and the CPU side are exercised.
        unsafe { Arena::new(mem) }
    }

    fn bytes(r: &DmaRegion) -> &[u8] {
        // SAFETY: the region is live and only the test touches it.
        unsafe { core::slice::from_raw_parts(r.cpu().as_ptr(), r.len()) }
    }

    fn fill(r: &DmaRegion, v: u8) {
        // SAFETY: as above.
        unsafe { r.cpu().as_ptr().write_bytes(v, r.len()) }
    }

    #[test]
    fn regions_are_aligned_zeroed_and_identity_mapped() {
        let a: Arena = arena(64 * 1024);
        for align in [1, 8, 64, 1024, 4096, 8192] {
            let r = a.alloc(100, align).unwrap();
            assert_eq!(r.cpu().as_ptr() as usize % align, 0, "cpu aligned to {align}");
            assert_eq!(r.iova() % align as u64, 0, "iova aligned to {align}");
            assert_eq!(r.iova(), r.cpu().as_ptr() as u64, "iova is the CPU address");
            assert_eq!(r.len(), 100);
            assert!(bytes(&r).iter().all(|&b| b == 0), "zeroed although the memory held 0xa5");
        }
        assert_eq!(a.alloc(8, 3), Err(DmaError::BadAlignment { align: 3 }));
        assert_eq!(a.alloc(8, 0), Err(DmaError::BadAlignment { align: 0 }));
    }

    #[test]
    fn live_regions_never_overlap() {
        let a: Arena = arena(256 * 1024);
        let mut live: std::vec::Vec<DmaRegion> = std::vec::Vec::new();
        for i in 0..40usize {
            let r = a.alloc(1 + i * 97 % 5000, 1 << (i % 13)).unwrap();
            for o in &live {
                let (s, e) = (r.iova(), r.iova() + r.len() as u64);
                assert!(e <= o.iova() || s >= o.iova() + o.len() as u64, "{r:?} overlaps {o:?}");
            }
            fill(&r, i as u8);
            live.push(r);
            if i % 3 == 2 {
                // SAFETY: allocated above, freed once, no device.
                unsafe { a.free(live.remove(i % live.len())) };
            }
        }
        for (i, r) in live.iter().enumerate() {
            let b = bytes(r);
            assert!(b.iter().all(|&x| x == b[0]), "region {i} was not overwritten by another");
        }
    }

    #[test]
    fn exhaustion_is_no_memory_and_free_makes_room_again() {
        let a: Arena = arena(16 * 1024);
        let x = a.alloc(8192, 4096).unwrap();
        let y = a.alloc(4096, 4096).unwrap();
        assert_eq!(a.alloc(8192, 4096), Err(DmaError::NoMemory { len: 8192 }));
        assert_eq!(a.alloc(usize::MAX, 8), Err(DmaError::NoMemory { len: usize::MAX }));
        fill(&x, 0xff);
        let x_iova = x.iova();
        // SAFETY: allocated above, freed once, no device.
        unsafe { a.free(x) };
        // The freed hole is reused (first fit), and handed out zeroed again.
        let z = a.alloc(8192, 4096).unwrap();
        assert_eq!(z.iova(), x_iova);
        assert!(bytes(&z).iter().all(|&b| b == 0));
        // SAFETY: as above.
        unsafe {
            a.free(y);
            a.free(z);
        }
        let s = a.stats();
        assert_eq!((s.live_regions, s.live_bytes, s.holes, s.lost_bytes), (0, 0, 0, 0));
        // Everything coalesced: the whole arena (less the base's alignment slack) is one allocation again.
        let big = a.alloc(12 * 1024, 8).unwrap();
        // SAFETY: as above.
        unsafe { a.free(big) };
    }

    #[test]
    fn holes_coalesce_in_any_free_order() {
        let a: Arena = arena(64 * 1024);
        let mut r: std::vec::Vec<Option<DmaRegion>> = (0..6).map(|_| a.alloc(1000, 8).ok()).collect();
        let r0 = r[0].as_ref().map(DmaRegion::iova);
        let keep = a.alloc(8, 8).unwrap();
        for i in [1, 3, 2, 5, 0, 4] {
            let region = r[i].take().unwrap();
            // SAFETY: each allocated above and freed once, no device.
            unsafe { a.free(region) };
        }
        assert_eq!(a.stats().holes, 1, "six neighbours merged into one hole");
        let again = a.alloc(6000, 8).unwrap();
        assert_eq!(Some(again.iova()), r0, "the merged hole fits what the six held");
        // SAFETY: as above.
        unsafe {
            a.free(again);
            a.free(keep);
        }
        assert_eq!(a.stats().holes, 0);
    }

    #[test]
    fn limits_of_the_fixed_tables_fail_cleanly() {
        // Two live regions at most: the third allocation fails although there is memory.
        let a: Arena<4, 2> = arena(64 * 1024);
        let x = a.alloc(64, 8).unwrap();
        let y = a.alloc(64, 8).unwrap();
        assert_eq!(a.alloc(64, 8), Err(DmaError::NoMemory { len: 64 }));
        // Freeing something never handed out, or twice, is ignored rather than trusted.
        // SAFETY: deliberately breaks the contracts (a region the arena never made, and a second handle to `x`) to
        // check the arena does not act on them; neither is read or written, and there is no device.
        unsafe {
            let bogus = DmaRegion::from_raw_parts(NonNull::dangling(), 0, 8);
            let x_again = DmaRegion::from_raw_parts(x.cpu(), x.iova(), x.len());
            a.free(bogus);
            a.free(x);
            a.free(x_again);
        }
        assert_eq!(a.stats().live_regions, 1);
        // SAFETY: as above.
        unsafe { a.free(y) };
        assert_eq!(a.stats().live_regions, 0);
    }

    #[test]
    fn iova_of_covers_live_regions_only() {
        let a: Arena = arena(16 * 1024);
        let r = a.alloc(100, 64).unwrap();
        let p = r.cpu().as_ptr();
        assert_eq!(a.iova_of(p, 100), Some(r.iova()));
        // SAFETY: pointer arithmetic inside the region (no access).
        let mid = unsafe { p.add(10) };
        assert_eq!(a.iova_of(mid, 90), Some(r.iova() + 10));
        assert_eq!(a.iova_of(mid, 91), None, "past the region's length");
        // SAFETY: allocated above, freed once, no device.
        unsafe { a.free(r) };
        assert_eq!(a.iova_of(p, 1), None, "not live any more");
    }
}

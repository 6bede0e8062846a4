//! DMA memory for a VFIO device: the core's [`Dma`] over IOMMU-mapped chunks.
//!
//! Memory comes in 2 MiB chunks, each mapped once with `VFIO_IOMMU_MAP_DMA` at a 2 MiB-aligned IOVA, so a region
//! never straddles two mappings and every alignment up to 2 MiB holds at both the CPU and the device address.
//! Chunks are hugetlb pages when the system has them (one IOMMU entry, one TLB entry); otherwise ordinary 4 KiB
//! pages with a notice. Regions larger than a chunk get a chunk of their own. IOVAs are handed out only inside
//! the ranges the IOMMU reports as valid, below the device's DMA limit.
//!
//! A chunk is unmapped from the IOMMU before its memory is returned to the kernel, so the device can never reach
//! memory the process no longer owns; freeing a region the device still uses is the caller's duty not to do
//! ([`Dma::free`]).

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use mlx5_core::hal::{Dma, DmaError, DmaRegion};

use super::sys::Sys;
use super::{Container, IovaRange, Result, VfioError};

/// Size and alignment of a chunk: one x86-64 huge page.
pub const CHUNK: usize = 2 << 20;

/// Options for [`VfioDma`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaOptions {
    /// Try 2 MiB hugetlb pages first.
    pub hugepages: bool,
    /// Highest IOVA the device can address (its DMA mask); mlx5 functions do 64-bit DMA.
    pub max_iova: u64,
    /// Lowest IOVA handed out; IOVA 0 stays unmapped so a zero address from a bug faults instead of hitting memory.
    pub min_iova: u64,
}

impl Default for DmaOptions {
    fn default() -> Self {
        DmaOptions { hugepages: true, max_iova: u64::MAX, min_iova: CHUNK as u64 }
    }
}

/// What backs the chunks mapped so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// Nothing allocated yet.
    None,
    Huge2M,
    Pages4K,
}

#[derive(Debug)]
struct Chunk {
    /// The mapping as mmap returned it (for munmap).
    map: NonNull<u8>,
    map_len: usize,
    /// The 2 MiB-aligned part handed out and mapped for the device.
    cpu: usize,
    iova: u64,
    len: usize,
    huge: bool,
    /// Free byte ranges `(offset, len)`, sorted and coalesced.
    free: Vec<(usize, usize)>,
    used: usize,
}

#[derive(Debug, Default)]
struct State {
    chunks: Vec<Chunk>,
    /// Live regions by CPU address: `(len, iova)`.
    live: BTreeMap<usize, (usize, u64)>,
    iova_free: Vec<(u64, u64)>,
    hugepages_failed: bool,
    chunks_mapped: u64,
    chunks_unmapped: u64,
}

/// IOMMU-backed DMA memory for one container.
#[derive(Debug)]
pub struct VfioDma {
    sys: Arc<dyn Sys>,
    container: Arc<Container>,
    opts: DmaOptions,
    state: Mutex<State>,
}

// SAFETY: the chunk pointers are owned by the allocator and only handed out as DmaRegion descriptions; all
// bookkeeping is behind the mutex.
unsafe impl Send for VfioDma {}
// SAFETY: as above.
unsafe impl Sync for VfioDma {}

impl VfioDma {
    pub fn new(container: Arc<Container>, opts: DmaOptions) -> VfioDma {
        let iova_free = usable_iova(&container.iova_ranges, opts.min_iova, opts.max_iova);
        VfioDma {
            sys: container.sys.clone(),
            container,
            opts,
            state: Mutex::new(State { iova_free, ..State::default() }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent bookkeeping (every update is a single step).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Live regions and their bytes: 0 / 0 after a clean teardown.
    pub fn outstanding(&self) -> (usize, usize) {
        let s = self.lock();
        (s.live.len(), s.live.values().map(|v| v.0).sum())
    }

    /// Chunks currently mapped for the device.
    pub fn chunks(&self) -> usize {
        self.lock().chunks.len()
    }

    /// `(mapped, unmapped)` chunk counts over the allocator's life.
    pub fn map_counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.chunks_mapped, s.chunks_unmapped)
    }

    /// What the most recent chunk is backed by.
    pub fn backing(&self) -> Backing {
        let s = self.lock();
        match s.chunks.last() {
            None if s.hugepages_failed => Backing::Pages4K,
            None => Backing::None,
            Some(c) if c.huge => Backing::Huge2M,
            Some(_) => Backing::Pages4K,
        }
    }

    /// True once a hugetlb allocation failed and 4 KiB pages are used instead.
    pub fn fell_back_to_small_pages(&self) -> bool {
        self.lock().hugepages_failed
    }

    /// Maps a new chunk of `len` bytes (a multiple of [`CHUNK`]).
    fn new_chunk(&self, s: &mut State, len: usize) -> Result<Chunk> {
        let iova = take_iova(&mut s.iova_free, len as u64).ok_or(VfioError::NoIova(len))?;
        let mut mapping = None;
        if self.opts.hugepages && !s.hugepages_failed {
            match self.sys.mmap_anon(len, true) {
                Ok(p) => mapping = Some((p, len, p.as_ptr() as usize, true)),
                Err(e) => {
                    s.hugepages_failed = true;
                    log::warn!(
                        "no 2 MiB hugepages for DMA memory ({e}); falling back to 4 KiB pages \
                         (reserve some with: echo 64 > /proc/sys/vm/nr_hugepages)"
                    );
                }
            }
        }
        let (map, map_len, cpu, huge) = match mapping {
            Some(m) => m,
            None => {
                // Over-map by one chunk so a 2 MiB-aligned start exists inside the mapping.
                let map_len = len + CHUNK;
                let p = match self.sys.mmap_anon(map_len, false) {
                    Ok(p) => p,
                    Err(e) => {
                        give_iova(&mut s.iova_free, iova, len as u64);
                        return Err(VfioError::Sys { what: "allocate DMA memory".into(), source: e });
                    }
                };
                let cpu = (p.as_ptr() as usize).next_multiple_of(CHUNK);
                (p, map_len, cpu, false)
            }
        };
        // SAFETY: [cpu, cpu + len) lies inside the mapping made above, which stays mapped until release_chunk has
        // unmapped it from the IOMMU (and is kept, leaked, if that fails); regions are carved from it only.
        if let Err(e) = unsafe { self.container.map_dma(cpu as u64, iova, len as u64) } {
            // SAFETY: the mapping was just created above and nothing refers to it.
            unsafe { self.sys.munmap(map, map_len) };
            give_iova(&mut s.iova_free, iova, len as u64);
            return Err(e);
        }
        s.chunks_mapped += 1;
        Ok(Chunk { map, map_len, cpu, iova, len, huge, free: vec![(0, len)], used: 0 })
    }

    /// Unmaps a chunk from the IOMMU, then returns its memory and IOVA. If the unmap fails the memory is kept
    /// (leaked) rather than freed while the device might still reach it.
    fn release_chunk(&self, s: &mut State, c: Chunk) {
        match self.container.unmap_dma(c.iova, c.len as u64) {
            Ok(n) if n == c.len as u64 => {
                // SAFETY: the chunk's mapping came from mmap_anon, no live region points into it (used == 0 or the
                // allocator is being dropped), and the IOMMU no longer translates to it.
                unsafe { self.sys.munmap(c.map, c.map_len) };
                give_iova(&mut s.iova_free, c.iova, c.len as u64);
                s.chunks_unmapped += 1;
            }
            Ok(n) => log::error!("IOMMU unmapped {n} of {} bytes at IOVA {:#x}; keeping the memory", c.len, c.iova),
            Err(e) => log::error!("{e}; keeping {} bytes at IOVA {:#x} allocated", c.len, c.iova),
        }
    }
}

/// Intersects the IOMMU's valid ranges with `[min, max]`, keeping 2 MiB-aligned pieces of at least one chunk.
fn usable_iova(ranges: &[IovaRange], min: u64, max: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for r in ranges {
        let start = r.start.max(min).checked_next_multiple_of(CHUNK as u64);
        let end = r.end.min(max).saturating_add(1) & !(CHUNK as u64 - 1);
        if let Some(start) = start {
            if end > start {
                out.push((start, end));
            }
        }
    }
    out.sort_unstable();
    out
}

/// First fit of `len` bytes (a multiple of CHUNK) in the free IOVA list.
fn take_iova(free: &mut Vec<(u64, u64)>, len: u64) -> Option<u64> {
    let i = free.iter().position(|&(s, e)| e - s >= len)?;
    let start = free[i].0;
    free[i].0 += len;
    if free[i].0 == free[i].1 {
        free.remove(i);
    }
    Some(start)
}

/// Returns an IOVA range, coalescing with its neighbours.
fn give_iova(free: &mut Vec<(u64, u64)>, start: u64, len: u64) {
    let end = start + len;
    let i = free.partition_point(|&(s, _)| s < start);
    free.insert(i, (start, end));
    if i + 1 < free.len() && free[i].1 == free[i + 1].0 {
        free[i].1 = free[i + 1].1;
        free.remove(i + 1);
    }
    if i > 0 && free[i - 1].1 == free[i].0 {
        free[i - 1].1 = free[i].1;
        free.remove(i);
    }
}

/// First fit of `len` bytes at a multiple of `align` in a chunk's free list; returns the offset.
fn carve(free: &mut Vec<(usize, usize)>, len: usize, align: usize) -> Option<usize> {
    for i in 0..free.len() {
        let (off, flen) = free[i];
        let start = off.next_multiple_of(align);
        if start + len > off + flen {
            continue;
        }
        let tail = (start + len, off + flen - (start + len));
        match (start > off, tail.1 > 0) {
            (false, false) => {
                free.remove(i);
            }
            (false, true) => free[i] = tail,
            (true, false) => free[i] = (off, start - off),
            (true, true) => {
                free[i] = (off, start - off);
                free.insert(i + 1, tail);
            }
        }
        return Some(start);
    }
    None
}

/// Returns `(off, len)` to a chunk's free list, coalescing.
fn uncarve(free: &mut Vec<(usize, usize)>, off: usize, len: usize) {
    let i = free.partition_point(|&(o, _)| o < off);
    free.insert(i, (off, len));
    if i + 1 < free.len() && free[i].0 + free[i].1 == free[i + 1].0 {
        free[i].1 += free[i + 1].1;
        free.remove(i + 1);
    }
    if i > 0 && free[i - 1].0 + free[i - 1].1 == free[i].0 {
        free[i - 1].1 += free[i].1;
        free.remove(i);
    }
}

// SAFETY: regions are carved from chunks that stay mapped (CPU and IOMMU) until every region in them is freed;
// chunk memory is zero from mmap and each region is zeroed again on allocation; alignment up to CHUNK holds at
// both addresses because chunks start 2 MiB aligned at both; carving never hands out overlapping ranges; anonymous
// memory on x86-64 and Arm servers is coherent with PCIe DMA.
unsafe impl Dma for VfioDma {
    fn alloc(&self, len: usize, align: usize) -> core::result::Result<DmaRegion, DmaError> {
        let align = align.max(64);
        if !align.is_power_of_two() || align > CHUNK {
            return Err(DmaError::BadAlignment { align });
        }
        let len = len.max(1).next_multiple_of(64);
        let mut s = self.lock();
        let mut found = None;
        if len <= CHUNK {
            for (ci, c) in s.chunks.iter_mut().enumerate() {
                if let Some(off) = carve(&mut c.free, len, align) {
                    found = Some((ci, off));
                    break;
                }
            }
        }
        let (ci, off) = match found {
            Some(f) => f,
            None => {
                let chunk_len = len.next_multiple_of(CHUNK);
                let mut c = self.new_chunk(&mut s, chunk_len).map_err(|e| {
                    log::warn!("DMA allocation of {len} bytes failed: {e}");
                    match e {
                        VfioError::Sys { what, .. } if what.starts_with("map") => DmaError::MapFailed,
                        _ => DmaError::NoMemory { len },
                    }
                })?;
                let off = carve(&mut c.free, len, align).ok_or(DmaError::NoMemory { len })?;
                s.chunks.push(c);
                (s.chunks.len() - 1, off)
            }
        };
        let c = &mut s.chunks[ci];
        c.used += len;
        let cpu = c.cpu + off;
        let iova = c.iova + off as u64;
        // SAFETY: [cpu, cpu + len) lies inside the chunk's live mapping and is handed out to nobody else.
        unsafe { (cpu as *mut u8).write_bytes(0, len) };
        s.live.insert(cpu, (len, iova));
        let cpu = NonNull::new(cpu as *mut u8).ok_or(DmaError::NoMemory { len })?;
        // SAFETY: the range is inside the chunk's mapping, carved for this region alone, and the chunk's CPU mapping
        // stays until the region is freed (an allocator dropped with it live keeps that mapping: see `Drop`).
        Ok(unsafe { DmaRegion::from_raw_parts(cpu, iova, len) })
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let a = cpu as usize;
        let s = self.lock();
        let (&start, &(rlen, iova)) = s.live.range(..=a).next_back()?;
        let end = a.checked_add(len)?;
        (end <= start + rlen).then_some(iova + (a - start) as u64)
    }

    unsafe fn free(&self, region: DmaRegion) {
        let a = region.cpu().as_ptr() as usize;
        let mut s = self.lock();
        let Some((len, _)) = s.live.remove(&a) else {
            log::error!("free of DMA memory this allocator does not hold (cpu {a:#x}); ignored");
            return;
        };
        let Some(ci) = s.chunks.iter().position(|c| a >= c.cpu && a < c.cpu + c.len) else {
            return;
        };
        let c = &mut s.chunks[ci];
        uncarve(&mut c.free, a - c.cpu, len);
        c.used -= len;
        if c.used == 0 {
            let c = s.chunks.swap_remove(ci);
            self.release_chunk(&mut s, c);
        }
    }
}

impl Drop for VfioDma {
    fn drop(&mut self) {
        let mut s = self.lock();
        if !s.live.is_empty() {
            log::warn!(
                "{} DMA regions still allocated at teardown; unmapping them from the device, keeping their memory",
                s.live.len()
            );
            s.live.clear();
        }
        let chunks = std::mem::take(&mut s.chunks);
        for c in chunks {
            if c.used == 0 {
                self.release_chunk(&mut s, c);
            } else if let Err(e) = self.container.unmap_dma(c.iova, c.len as u64) {
                log::error!("{e}; {} bytes at IOVA {:#x} stay mapped", c.len, c.iova);
            }
            // A chunk with live regions keeps its CPU mapping: a `DmaRegion` promises its memory until `free`.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carve_and_uncarve_coalesce() {
        let mut f = vec![(0, 4096)];
        assert_eq!(carve(&mut f, 128, 64), Some(0));
        assert_eq!(carve(&mut f, 64, 1024), Some(1024));
        assert_eq!(f, vec![(128, 896), (1088, 3008)]);
        uncarve(&mut f, 1024, 64);
        assert_eq!(f, vec![(128, 3968)]);
        uncarve(&mut f, 0, 128);
        assert_eq!(f, vec![(0, 4096)]);
        assert_eq!(carve(&mut f, 8192, 64), None);
    }

    #[test]
    fn iova_space_respects_ranges_and_mask() {
        let ranges = [IovaRange { start: 0, end: 0xfedf_ffff }, IovaRange { start: 0xfef0_0000, end: u64::MAX }];
        let free = usable_iova(&ranges, CHUNK as u64, (1 << 28) - 1);
        assert_eq!(free, vec![(CHUNK as u64, 1 << 28)]);
        let free = usable_iova(&ranges, CHUNK as u64, u64::MAX);
        // The hole around the interrupt window is kept out, and pieces are 2 MiB aligned.
        assert_eq!(free[0], (CHUNK as u64, 0xfee0_0000));
        assert_eq!(free[1].0, 0xff00_0000);
        let mut f = vec![(0x20_0000, 0x80_0000)];
        assert_eq!(take_iova(&mut f, 0x20_0000), Some(0x20_0000));
        assert_eq!(take_iova(&mut f, 0x40_0000), Some(0x40_0000));
        assert_eq!(take_iova(&mut f, 0x20_0000), None);
        give_iova(&mut f, 0x20_0000, 0x20_0000);
        give_iova(&mut f, 0x40_0000, 0x40_0000);
        assert_eq!(f, vec![(0x20_0000, 0x80_0000)]);
    }
}

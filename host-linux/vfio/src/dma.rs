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
//!
//! Process memory the allocator did not make (a memory region's buffer) is mapped with [`Dma::map_user`] as
//! rdma-core's `mlx5_vfio_reg_mr` does: the pages covering it are pinned and mapped by `VFIO_IOMMU_MAP_DMA` at an
//! IOVA from the same allocator, aligned as the memory is (so large MTT pages stay usable), and unmapped when the
//! region is freed.

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
    /// How bus addresses are chosen.
    pub iova_mode: IovaMode,
}

impl Default for DmaOptions {
    fn default() -> Self {
        DmaOptions { hugepages: true, max_iova: u64::MAX, min_iova: CHUNK as u64, iova_mode: IovaMode::Allocated }
    }
}

/// How the device's addresses for memory are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IovaMode {
    /// IOVAs from this allocator, inside the IOMMU's valid ranges; the IOMMU translates them.
    Allocated,
    /// IOVA = physical address (from `/proc/self/pagemap`, which needs CAP_SYS_ADMIN), for a device whose DMA
    /// does not go through the IOMMU (QEMU's x-pci-proxy-dev): the IOMMU is still given the same mapping, so
    /// the memory is pinned. Chunks must be hugepages (physically contiguous); process memory must be
    /// physically contiguous over the range mapped.
    Physical,
}

/// The physical address of `cpu` when `cpu .. cpu + len` is present and physically contiguous, read from
/// `/proc/self/pagemap` (bit 63 present, bits 0-54 the page frame; frames read as 0 without CAP_SYS_ADMIN).
pub fn physical_address(cpu: usize, len: usize) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let err = |detail: String, source: Option<std::io::Error>| VfioError::PhysIova { detail, source };
    let f =
        std::fs::File::open("/proc/self/pagemap").map_err(|e| err("cannot open /proc/self/pagemap".into(), Some(e)))?;
    let first = cpu / 4096;
    let last = (cpu + len.max(1) - 1) / 4096;
    let mut base = 0u64;
    for page in first..=last {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, page as u64 * 8)
            .map_err(|e| err(format!("reading the pagemap entry of {:#x}", page * 4096), Some(e)))?;
        let e = u64::from_le_bytes(b);
        let pfn = e & ((1 << 55) - 1);
        if e >> 63 == 0 {
            return Err(err(format!("page {:#x} is not present", page * 4096), None));
        }
        if pfn == 0 {
            return Err(err("the pagemap hides page frames (needs CAP_SYS_ADMIN: run as root)".into(), None));
        }
        let pa = pfn * 4096;
        if page == first {
            base = pa;
        } else if pa != base + ((page - first) * 4096) as u64 {
            return Err(err(format!("{len} bytes at {cpu:#x} are not physically contiguous"), None));
        }
    }
    Ok(base + (cpu % 4096) as u64)
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

/// Process memory mapped for the device by `map_user`.
#[derive(Debug, Clone, Copy)]
struct UserMap {
    /// The region handed out: its length and bus address.
    len: usize,
    iova: u64,
    /// The IOMMU mapping: the covering pages, at `map_iova`.
    map_iova: u64,
    map_len: u64,
    /// IOVA reserved for it (whole chunks from `map_iova`).
    hull_len: u64,
}

/// The largest alignment `map_user` keeps between a mapping's CPU and bus addresses (1 GiB, an IOMMU huge page).
pub const USER_MAP_MAX_ALIGN: u64 = 1 << 30;

#[derive(Debug, Default)]
struct State {
    chunks: Vec<Chunk>,
    /// Mapped process memory by CPU address.
    users: BTreeMap<usize, UserMap>,
    users_mapped: u64,
    users_unmapped: u64,
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

    /// Live regions (allocated or mapped process memory) and their bytes: 0 / 0 after a clean teardown.
    pub fn outstanding(&self) -> (usize, usize) {
        let s = self.lock();
        let users = s.users.values().map(|u| u.len).sum::<usize>();
        (s.live.len() + s.users.len(), s.live.values().map(|v| v.0).sum::<usize>() + users)
    }

    /// `(mapped, unmapped)` counts of process memory over the allocator's life.
    pub fn user_map_counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.users_mapped, s.users_unmapped)
    }

    /// The IOMMU page: the smallest size the container maps (at least 4 KiB).
    fn iommu_page(&self) -> u64 {
        let p = self.container.iova_pgsizes;
        if p == 0 {
            4096
        } else {
            (1u64 << p.trailing_zeros()).max(4096)
        }
    }

    /// Takes the device's access to mapped process memory away; the IOVA goes back only once the IOMMU confirmed
    /// the unmap (otherwise it stays reserved, so it is never handed out while it may still translate).
    fn unmap_user(&self, s: &mut State, u: UserMap) {
        match self.container.unmap_dma(u.map_iova, u.map_len) {
            Ok(n) if n == u.map_len => {
                if self.opts.iova_mode == IovaMode::Allocated {
                    give_iova(&mut s.iova_free, u.map_iova, u.hull_len);
                }
                s.users_unmapped += 1;
            }
            Ok(n) => log::error!("IOMMU unmapped {n} of {} bytes at IOVA {:#x}; IOVA kept", u.map_len, u.map_iova),
            Err(e) => log::error!("{e}; {} bytes of process memory stay mapped at IOVA {:#x}", u.map_len, u.map_iova),
        }
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

    /// Maps a new chunk of hugepages at IOVA = its physical address.
    fn new_physical_chunk(&self, s: &mut State, len: usize) -> Result<Chunk> {
        let map = self.sys.mmap_anon(len, true).map_err(|e| VfioError::PhysIova {
            detail: "needs 2 MiB hugepages (echo 64 > /proc/sys/vm/nr_hugepages)".into(),
            source: Some(e),
        })?;
        let cpu = map.as_ptr() as usize;
        let iova = match physical_address(cpu, len) {
            Ok(pa) => pa,
            Err(e) => {
                // SAFETY: the mapping was just created above and nothing refers to it.
                unsafe { self.sys.munmap(map, len) };
                return Err(e);
            }
        };
        // SAFETY: as in `new_chunk`: the mapping stays until `release_chunk` has unmapped it from the IOMMU.
        if let Err(e) = unsafe { self.container.map_dma(cpu as u64, iova, len as u64) } {
            // SAFETY: the mapping was just created above and nothing refers to it.
            unsafe { self.sys.munmap(map, len) };
            return Err(e);
        }
        s.chunks_mapped += 1;
        Ok(Chunk { map, map_len: len, cpu, iova, len, huge: true, free: vec![(0, len)], used: 0 })
    }

    /// Maps a new chunk of `len` bytes (a multiple of [`CHUNK`]).
    fn new_chunk(&self, s: &mut State, len: usize) -> Result<Chunk> {
        if self.opts.iova_mode == IovaMode::Physical {
            return self.new_physical_chunk(s, len);
        }
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
                if self.opts.iova_mode == IovaMode::Allocated {
                    give_iova(&mut s.iova_free, c.iova, c.len as u64);
                }
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
    take_iova_aligned(free, len, CHUNK as u64)
}

/// First fit of `len` bytes (a multiple of CHUNK) at a multiple of `align` (a power of two, at least CHUNK).
fn take_iova_aligned(free: &mut Vec<(u64, u64)>, len: u64, align: u64) -> Option<u64> {
    let (i, start) = free.iter().enumerate().find_map(|(i, &(s, e))| {
        let start = s.checked_next_multiple_of(align)?;
        (start.checked_add(len)? <= e).then_some((i, start))
    })?;
    let (s, e) = free[i];
    let end = start + len;
    match (start > s, end < e) {
        (false, false) => {
            free.remove(i);
        }
        (false, true) => free[i].0 = end,
        (true, false) => free[i].1 = start,
        (true, true) => {
            free[i].1 = start;
            free.insert(i + 1, (end, e));
        }
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
        let end = a.checked_add(len)?;
        let live = s.live.range(..=a).next_back().map(|(&start, &(rlen, iova))| (start, rlen, iova));
        let user = s.users.range(..=a).next_back().map(|(&start, u)| (start, u.len, u.iova));
        [live, user]
            .into_iter()
            .flatten()
            .find(|&(start, rlen, _)| end <= start + rlen)
            .map(|(start, _, iova)| iova + (a - start) as u64)
    }

    /// Pins and maps the pages covering `ptr .. ptr + len` (`mlx5_vfio_reg_mr`'s `mlx5_vfio_register_mem`). The
    /// IOVA is reserved in whole chunks and aligned as the memory's first page is, up to [`USER_MAP_MAX_ALIGN`]
    /// and the mapping's size. Refused with `Unreachable`, with nothing left mapped or reserved: an empty or
    /// wrapping range, memory already mapped for the device, no IOVA room below the device's limit, or memory the
    /// kernel cannot pin (EFAULT/EINVAL); the locked-memory limit (ENOMEM) is `NoMemory`.
    unsafe fn map_user(&self, ptr: NonNull<u8>, len: usize) -> core::result::Result<DmaRegion, DmaError> {
        let addr = ptr.as_ptr() as usize;
        let refused = DmaError::Unreachable { addr, len };
        let end = addr.checked_add(len).filter(|_| len > 0).ok_or(refused)?;
        let page = self.iommu_page();
        let vbase = addr as u64 & !(page - 1);
        let vend = (end as u64).checked_next_multiple_of(page).ok_or(refused)?;
        let map_len = vend - vbase;
        if vbase == 0 {
            return Err(refused);
        }
        let mut s = self.lock();
        // Regions never overlap one another, so only the last one starting before `end` can reach into the range.
        let hit_live = s.live.range(..end).next_back().is_some_and(|(&a, &(l, _))| a + l > addr);
        let hit_user = s.users.range(..end).next_back().is_some_and(|(&a, u)| a + u.len > addr);
        if hit_live || hit_user {
            return Err(refused);
        }
        if self.opts.iova_mode == IovaMode::Physical {
            let pa = match physical_address(vbase as usize, map_len as usize) {
                Ok(pa) => pa,
                Err(e) => {
                    log::warn!(
                        "process memory at {addr:#x} ({len} bytes) cannot be mapped at its physical address: {e}"
                    );
                    return Err(refused);
                }
            };
            // SAFETY: as below: the caller keeps the memory until the region is freed; `free` unmaps it first.
            if let Err(e) = unsafe { self.container.map_dma(vbase, pa, map_len) } {
                log::warn!("mapping {len} bytes of process memory at {addr:#x} for the device failed: {e}");
                return Err(DmaError::MapFailed);
            }
            let iova = pa + (addr as u64 - vbase);
            s.users.insert(addr, UserMap { len, iova, map_iova: pa, map_len, hull_len: 0 });
            s.users_mapped += 1;
            // SAFETY: the caller vouches for the bytes; the IOMMU (and the bypassing device) reach them at `iova`.
            return Ok(unsafe { DmaRegion::from_raw_parts(ptr, iova, len) });
        }
        let hull_len = map_len.checked_next_multiple_of(CHUNK as u64).ok_or(refused)?;
        let align = (1u64 << vbase.trailing_zeros())
            .min(map_len.checked_next_power_of_two().unwrap_or(USER_MAP_MAX_ALIGN))
            .clamp(CHUNK as u64, USER_MAP_MAX_ALIGN);
        let map_iova = take_iova_aligned(&mut s.iova_free, hull_len, align).ok_or(refused)?;
        // SAFETY: the caller of `map_user` keeps the memory allocated, and lets the device see the covering pages,
        // until the region is freed; `free` unmaps it first.
        if let Err(e) = unsafe { self.container.map_dma(vbase, map_iova, map_len) } {
            give_iova(&mut s.iova_free, map_iova, hull_len);
            log::warn!("mapping {len} bytes of process memory at {addr:#x} for the device failed: {e}");
            return Err(match &e {
                VfioError::Sys { source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                    DmaError::NoMemory { len }
                }
                VfioError::Sys { source, .. }
                    if matches!(source.raw_os_error(), Some(libc::EFAULT) | Some(libc::EINVAL)) =>
                {
                    refused
                }
                _ => DmaError::MapFailed,
            });
        }
        let iova = map_iova + (addr as u64 - vbase);
        s.users.insert(addr, UserMap { len, iova, map_iova, map_len, hull_len });
        s.users_mapped += 1;
        // SAFETY: the caller vouches for the bytes (valid, no other region over them: the overlap check above
        // catches this allocator's own); the IOMMU now translates `iova` to them.
        Ok(unsafe { DmaRegion::from_raw_parts(ptr, iova, len) })
    }

    unsafe fn free(&self, region: DmaRegion) {
        let a = region.cpu().as_ptr() as usize;
        let mut s = self.lock();
        if let Some(u) = s.users.get(&a).copied() {
            if u.len != region.len() || u.iova != region.iova() {
                log::error!("free of a region that does not match the mapping at cpu {a:#x}; ignored");
                return;
            }
            s.users.remove(&a);
            self.unmap_user(&mut s, u);
            return;
        }
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
        // Process memory goes back to being the process's alone.
        for u in std::mem::take(&mut s.users).into_values() {
            self.unmap_user(&mut s, u);
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
    fn aligned_iova_takes_from_the_middle_and_gives_back() {
        let c = CHUNK as u64;
        let mut f = vec![(c, 16 * c)];
        // 4 MiB alignment skips the first chunk and splits the range.
        assert_eq!(take_iova_aligned(&mut f, c, 2 * c), Some(2 * c));
        assert_eq!(f, vec![(c, 2 * c), (3 * c, 16 * c)]);
        assert_eq!(take_iova_aligned(&mut f, 8 * c, 8 * c), Some(8 * c));
        assert_eq!(f, vec![(c, 2 * c), (3 * c, 8 * c)]);
        assert_eq!(take_iova_aligned(&mut f, 8 * c, 8 * c), None);
        give_iova(&mut f, 8 * c, 8 * c);
        give_iova(&mut f, 2 * c, c);
        assert_eq!(f, vec![(c, 16 * c)]);
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

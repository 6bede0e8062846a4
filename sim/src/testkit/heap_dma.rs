//! [`HeapDma`], the kit's one DMA fake: zeroed heap regions with bus addresses of their own, for tests, fuzz
//! targets and benchmarks that need exact bytes and no firmware model behind them.

use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};

use mlx5_core::hal::{Dma, DmaError, DmaRegion};

/// How [`HeapDma`] picks bus addresses (after any scripted ones are used up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Iovas {
    /// Packed: a bump counter rounded up to the alignment asked for, regions back to back.
    Packed,
    /// Guarded: rounded up to at least a page, a guard page after every region, so an overrun lands nowhere.
    Guarded,
    /// The bus address is the CPU address (a host without an IOMMU); every region is page-aligned and larger
    /// alignments are refused.
    Identity,
}

/// The page size of [`Iovas::Guarded`] and [`Iovas::Identity`].
const PAGE: usize = 4096;

/// One live region: the layout it was allocated with and its CPU address (a pointer, so addresses derived from
/// it keep the allocation's provenance, as Miri checks).
#[derive(Debug, Clone, Copy)]
struct Live {
    len: usize,
    align: usize,
    cpu: NonNull<u8>,
}

// SAFETY: `Live` records a heap block owned by the `HeapDma`, used only under its lock; the block is not tied to a
// thread.
unsafe impl Send for Live {}

#[derive(Debug, Default)]
struct State {
    script: VecDeque<u64>,
    next: u64,
    live: BTreeMap<u64, Live>,
    /// Allocations that will still succeed (`None`: no limit).
    budget: Option<usize>,
}

/// Heap memory handed out as DMA regions. Bus addresses are never reused while the counter runs (scripted ones are
/// the test's responsibility); `max_contig` refuses larger regions, so rings come in fragments; a budget and a size
/// cap bound the pool for fuzzing. Whatever is still allocated when the `HeapDma` is dropped (a queue that leaks
/// the pages of a command firmware never returned) is kept, since a region promises its memory until `free`;
/// only the fuzzing pool, whose constructor is `unsafe`, frees it then.
#[derive(Debug)]
pub struct HeapDma {
    st: Mutex<State>,
    iovas: Iovas,
    max_contig: Option<usize>,
    size_cap: Option<usize>,
    /// Free what is still live on drop ([`HeapDma::for_fuzzing`]'s caller vouches that nothing uses it after).
    reclaim_on_drop: bool,
}

impl Default for HeapDma {
    fn default() -> Self {
        Self::new()
    }
}

impl HeapDma {
    /// Packed bus addresses from 0.
    pub fn new() -> Self {
        Self::with(State::default(), Iovas::Packed)
    }

    fn with(st: State, iovas: Iovas) -> Self {
        Self { st: Mutex::new(st), iovas, max_contig: None, size_cap: None, reclaim_on_drop: false }
    }

    /// The bus addresses of the first allocations come from `iovas`, then packed from `0x4000_0000`.
    pub fn scripted(iovas: &[u64]) -> Self {
        let st = State { script: iovas.iter().copied().collect(), next: 0x4000_0000, ..State::default() };
        Self::with(st, Iovas::Packed)
    }

    /// The fuzz targets' pool: guarded bus addresses from `0x10_0000_0000`, no region larger than `max_contig`
    /// (when given) or 256 MiB, and an optional budget ([`set_budget`](Self::set_budget)). Dropping it frees
    /// every region still live, so one fuzz input's leftovers do not pile up over millions of inputs.
    ///
    /// # Safety
    /// No region from this pool, nor anything holding one (a queue, a CQ), is used after the pool is dropped:
    /// declare the pool before them in the same scope so it is dropped last.
    pub unsafe fn for_fuzzing(max_contig: Option<usize>) -> Self {
        let st = State { next: 0x10_0000_0000, ..State::default() };
        Self { st: Mutex::new(st), iovas: Iovas::Guarded, max_contig, size_cap: Some(1 << 28), reclaim_on_drop: true }
    }

    /// Bus address = CPU address, page-aligned regions (the benchmarks' command queue plays firmware through it).
    pub fn identity() -> Self {
        Self::with(State::default(), Iovas::Identity)
    }

    /// The bus-address scheme.
    pub fn iovas(&self) -> Iovas {
        self.iovas
    }

    /// Refuses every allocation after `n` more (`None`: no limit).
    pub fn set_budget(&self, n: Option<usize>) {
        self.lock().budget = n;
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The CPU address of `len` bytes at bus address `iova`, when they lie inside one live region.
    pub fn translate(&self, iova: u64, len: usize) -> Option<*mut u8> {
        let st = self.lock();
        let (&base, l) = st.live.range(..=iova).next_back()?;
        let off = usize::try_from(iova - base).ok()?;
        (off.checked_add(len)? <= l.len).then_some(l.cpu.as_ptr().wrapping_add(off))
    }

    /// Writes `data` at bus address `iova` as the device would; `false` (nothing written) outside live memory.
    pub fn try_write(&self, iova: u64, data: &[u8]) -> bool {
        match self.translate(iova, data.len()) {
            Some(p) => {
                // SAFETY: `p..p + len` is inside a live allocation (translate). The caller plays the device and
                // holds no Rust reference into DMA memory while it writes.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
                true
            }
            None => false,
        }
    }

    /// Reads `len` bytes at bus address `iova`; `None` outside live memory.
    pub fn try_read(&self, iova: u64, len: usize) -> Option<Vec<u8>> {
        let p = self.translate(iova, len)?;
        // SAFETY: inside a live allocation (translate); see `try_write`.
        Some(unsafe { std::slice::from_raw_parts(p, len) }.to_vec())
    }

    /// Writes bytes at bus address `iova`, as a device would.
    ///
    /// # Panics
    /// When the range is not inside one live region.
    pub fn write(&self, iova: u64, data: &[u8]) {
        assert!(self.try_write(iova, data), "write outside a live region at {iova:#x}");
    }

    /// Copies `len` bytes at bus address `iova` out of the memory.
    ///
    /// # Panics
    /// When the range is not inside one live region.
    pub fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        self.try_read(iova, len).unwrap_or_else(|| panic!("read outside a live region at {iova:#x}"))
    }

    /// Regions currently allocated.
    pub fn outstanding(&self) -> usize {
        self.lock().live.len()
    }

    /// The bus address of a new region of `len` bytes at CPU address `cpu`.
    fn next_iova(&self, st: &mut State, cpu: usize, len: usize, align: usize) -> u64 {
        if let Some(v) = st.script.pop_front() {
            return v;
        }
        match self.iovas {
            Iovas::Packed => {
                let v = st.next.next_multiple_of(align as u64);
                st.next = v + len as u64;
                v
            }
            Iovas::Guarded => {
                let v = st.next.next_multiple_of(align.max(PAGE) as u64);
                st.next = v + len.max(1) as u64 + PAGE as u64;
                v
            }
            Iovas::Identity => cpu as u64,
        }
    }
}

/// The one place a [`HeapDma`] region is made.
///
/// # Safety
/// `cpu` is a live allocation of at least `len` bytes recorded in `live`, deallocated only by `free`.
unsafe fn region(cpu: NonNull<u8>, iova: u64, len: usize) -> DmaRegion {
    // SAFETY: the caller's allocation stays valid until `free` (a dropped `HeapDma` keeps what is still live), and
    // no other region covers it.
    unsafe { DmaRegion::from_raw_parts(cpu, iova, len) }
}

// SAFETY: regions are fresh zeroed heap allocations aligned to at least the alignment asked for (at the CPU address
// and at the bus address: packed and guarded addresses are rounded up to it, identity ones are the page-aligned CPU
// address), live until `free` or the `HeapDma` is dropped; counted bus addresses never repeat and identity ones are
// distinct while live. Plain host memory is coherent.
unsafe impl Dma for HeapDma {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if self.max_contig.is_some_and(|m| len > m) {
            return Err(DmaError::NoMemory { len });
        }
        let mut st = self.lock();
        if let Some(b) = st.budget {
            if b == 0 {
                return Err(DmaError::NoMemory { len });
            }
            st.budget = Some(b - 1);
        }
        if self.size_cap.is_some_and(|m| len > m) {
            return Err(DmaError::NoMemory { len });
        }
        let layout = if self.iovas == Iovas::Identity {
            if align > PAGE {
                return Err(DmaError::BadAlignment { align });
            }
            Layout::from_size_align(len.max(1), PAGE).map_err(|_| DmaError::NoMemory { len })?
        } else {
            Layout::from_size_align(len.max(1), align).map_err(|_| DmaError::BadAlignment { align })?
        };
        // SAFETY: the layout has a non-zero size.
        let cpu = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or(DmaError::NoMemory { len })?;
        let addr = cpu.as_ptr() as usize;
        let iova = self.next_iova(&mut st, addr, len, align);
        st.live.insert(iova, Live { len: layout.size(), align: layout.align(), cpu });
        // SAFETY: a fresh zeroed allocation of `layout.size() >= len` bytes, recorded in `live` just above.
        Ok(unsafe { region(cpu, iova, len) })
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        // Only addresses are compared; nothing is dereferenced.
        let p = cpu.addr();
        self.lock().live.iter().find_map(|(&iova, l)| {
            let base = l.cpu.as_ptr().addr();
            (p >= base && p.checked_add(len)? <= base + l.len).then(|| iova + (p - base) as u64)
        })
    }

    unsafe fn free(&self, region: DmaRegion) {
        let l = self.lock().live.remove(&region.iova()).expect("DMA region freed twice");
        // SAFETY: allocated in `alloc` with exactly this layout and freed once (removed from `live`).
        unsafe { std::alloc::dealloc(l.cpu.as_ptr(), Layout::from_size_align_unchecked(l.len, l.align)) };
    }
}

impl Drop for HeapDma {
    /// Regions still live are kept, not freed: a `DmaRegion` for them may still exist, and its contract promises
    /// the memory until `free`. They stay reachable from a process-wide list, so leak checkers see them as held.
    /// The fuzzing pool frees them instead, as its constructor's caller promised.
    fn drop(&mut self) {
        let live = std::mem::take(&mut self.lock().live);
        if self.reclaim_on_drop {
            for l in live.into_values() {
                // SAFETY: allocated in `alloc` with this layout and still live; `for_fuzzing`'s caller guarantees
                // no region of this pool is used after it is dropped.
                unsafe { std::alloc::dealloc(l.cpu.as_ptr(), Layout::from_size_align_unchecked(l.len, l.align)) };
            }
        } else if !live.is_empty() {
            crate::dma::keep_forever(live.into_values().map(|l| l.cpu));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_scripted_guarded_and_identity_addresses() {
        let d = HeapDma::scripted(&[0x7000_0000]);
        let a = d.alloc(100, 64).unwrap();
        let b = d.alloc(100, 64).unwrap();
        assert_eq!((a.iova(), b.iova()), (0x7000_0000, 0x4000_0000));
        d.write(b.iova() + 10, &[1, 2, 3]);
        assert_eq!(d.read(b.iova() + 9, 5), [0, 1, 2, 3, 0]);
        assert_eq!(d.iova_of(a.cpu().as_ptr().wrapping_add(4), 8), Some(0x7000_0004));
        assert!(!d.try_write(b.iova() + 98, &[0; 4]));
        // SAFETY: allocated above and never given to a device.
        unsafe { d.free(a) };
        assert_eq!(d.outstanding(), 1);

        // SAFETY: declared before its regions, so dropped after them.
        let f = unsafe { HeapDma::for_fuzzing(Some(8192)) };
        let x = f.alloc(10, 8).unwrap();
        let y = f.alloc(10, 8).unwrap();
        assert_eq!((x.iova(), y.iova()), (0x10_0000_0000, 0x10_0000_2000));
        assert!(matches!(f.alloc(8193, 8), Err(DmaError::NoMemory { .. })));
        f.set_budget(Some(0));
        assert!(f.alloc(8, 8).is_err());

        let i = HeapDma::identity();
        let r = i.alloc(64, 64).unwrap();
        assert_eq!(r.iova(), r.cpu().as_ptr() as u64);
        assert_eq!(r.iova() % 4096, 0);
        assert!(matches!(i.alloc(64, 8192), Err(DmaError::BadAlignment { align: 8192 })));
    }
}

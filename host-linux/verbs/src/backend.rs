//! The device behind a context: register access, DMA memory and waiting for either a simulated ConnectX or one
//! through VFIO, and the command tracer.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::Arc;

use mlx5_core::dbr::DbrPage;
use mlx5_core::hal::{DelayNs, Dma, DmaError, DmaRegion, DmaView, Mmio};
use mlx5_core::hca::{CqEntry, Hca, Tables};
use mlx5_core::pages::FwChunk;
use mlx5_core::table::Table;
use mlx5_core::trace::{CmdRecord, CmdTrace};
#[cfg(feature = "sim")]
use mlx5_sim::{SimDelay, SimDevice, SimDma, SimMmio};
use mlx5_vfio::{StdDelay, Vfio};

/// Register access for either device: one match per access, nothing next to a register's latency.
#[derive(Debug, Clone)]
pub enum AnyMmio {
    #[cfg(feature = "sim")]
    Sim(SimMmio),
    /// A simulated device's datapath window as plain memory (`MLX5_RS_SIM_DOORBELLS=memory`): doorbells land in it and
    /// the simulator never sees them.
    #[cfg(feature = "sim")]
    Mem(Arc<MemBar>),
    Vfio(Arc<Vfio>),
}

/// With this variable set to `memory`, every simulated device opened by the process rings its datapath doorbells
/// (send doorbells, BlueFlame copies) into plain memory instead of the simulated BAR, as the datapath benchmarks'
/// `MemMmio` does: work posted is never executed. Commands still reach the simulator. For benchmarks of the C
/// ABI (`cargo xtask bench --peer`) only.
#[cfg(feature = "sim")]
pub const MEMORY_DOORBELLS_ENV: &str = "MLX5_RS_SIM_DOORBELLS";

/// A BAR that is a heap array written with volatile stores, with the architecture's default barriers.
#[cfg(feature = "sim")]
#[derive(Debug)]
pub struct MemBar {
    words: Box<[std::cell::UnsafeCell<u64>]>,
}

// SAFETY: the words are only touched with volatile accesses through raw pointers, as device registers are; a
// torn or racing value is what a real BAR would show too, and no reference to a word is ever handed out.
#[cfg(feature = "sim")]
unsafe impl Sync for MemBar {}

#[cfg(feature = "sim")]
impl MemBar {
    /// A zeroed window of `len` bytes (rounded up to 8).
    pub fn new(len: usize) -> MemBar {
        MemBar { words: (0..len.div_ceil(8).max(1)).map(|_| std::cell::UnsafeCell::new(0)).collect() }
    }

    /// The word holding byte `off`, or `None` past the window (such a store is dropped, a load reads all ones,
    /// as on a real bus).
    #[inline(always)]
    fn at(&self, off: usize) -> Option<*mut u8> {
        let w = self.words.get(off / 8)?;
        // SAFETY: `off % 8 < 8`, inside the word.
        Some(unsafe { w.get().cast::<u8>().add(off % 8) })
    }
}

#[cfg(feature = "sim")]
impl Mmio for MemBar {
    fn read32(&self, off: usize) -> u32 {
        match self.at(off).filter(|_| off.is_multiple_of(4)) {
            // SAFETY: an aligned u32 inside one live word.
            Some(p) => u32::from_be(unsafe { p.cast::<u32>().read_volatile() }),
            None => u32::MAX,
        }
    }
    fn write32(&self, off: usize, v: u32) {
        if let Some(p) = self.at(off).filter(|_| off.is_multiple_of(4)) {
            // SAFETY: as read32.
            unsafe { p.cast::<u32>().write_volatile(v.to_be()) }
        }
    }
    fn read64(&self, off: usize) -> u64 {
        match self.at(off).filter(|_| off.is_multiple_of(8)) {
            // SAFETY: an aligned word inside the window.
            Some(p) => u64::from_be(unsafe { p.cast::<u64>().read_volatile() }),
            None => u64::MAX,
        }
    }
    fn write64(&self, off: usize, v: u64) {
        if let Some(p) = self.at(off).filter(|_| off.is_multiple_of(8)) {
            // SAFETY: as read64.
            unsafe { p.cast::<u64>().write_volatile(v.to_be()) }
        }
    }
    #[inline]
    fn write_bf64(&self, off: usize, chunk: &[u64; 8]) {
        // One bounds check for the chunk, then eight stores in address order (as a mapped BAR does).
        let Some(words) = self.words.get(off / 8..off / 8 + 8).filter(|_| off.is_multiple_of(64)) else { return };
        for (w, v) in words.iter().zip(chunk) {
            // SAFETY: a live word of the window, touched only through volatile accesses.
            unsafe { w.get().write_volatile(*v) };
        }
    }
}

macro_rules! each_mmio {
    ($self:ident, $m:ident => $e:expr) => {
        match $self {
            #[cfg(feature = "sim")]
            AnyMmio::Sim($m) => $e,
            #[cfg(feature = "sim")]
            AnyMmio::Mem($m) => $e,
            AnyMmio::Vfio(v) => {
                let $m = &v.bar;
                $e
            }
        }
    };
}

/// Work done with a register access of its own type: [`AnyMmio::with`] matches once and runs it monomorphized for
/// the device's access, so a datapath call pays no match per register access.
pub trait MmioFn {
    type Out;
    fn call<M: Mmio + ?Sized>(self, m: &M) -> Self::Out;
}

impl AnyMmio {
    /// Runs `f` on the register access behind this one, as its own type.
    #[inline(always)]
    pub fn with<F: MmioFn>(&self, f: F) -> F::Out {
        match self {
            #[cfg(feature = "sim")]
            AnyMmio::Sim(m) => f.call(m),
            #[cfg(feature = "sim")]
            AnyMmio::Mem(m) => f.call(&**m),
            AnyMmio::Vfio(v) => f.call(&v.bar),
        }
    }
}

impl Mmio for AnyMmio {
    #[inline]
    fn read32(&self, off: usize) -> u32 {
        each_mmio!(self, m => m.read32(off))
    }
    #[inline]
    fn write32(&self, off: usize, v: u32) {
        each_mmio!(self, m => m.write32(off, v))
    }
    #[inline]
    fn read64(&self, off: usize) -> u64 {
        each_mmio!(self, m => m.read64(off))
    }
    #[inline]
    fn write64(&self, off: usize, v: u64) {
        each_mmio!(self, m => m.write64(off, v))
    }
    #[inline]
    fn write_bf64(&self, off: usize, chunk: &[u64; 8]) {
        each_mmio!(self, m => m.write_bf64(off, chunk))
    }
    #[inline]
    fn dma_wmb(&self) {
        // On x86-64 no backend's DMA write barrier is an instruction (stores are not reordered with stores): the
        // simulator's is a release fence, a BAR's a compiler fence. Both here, so a receive post pays no match.
        #[cfg(target_arch = "x86_64")]
        {
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
        }
        #[cfg(not(target_arch = "x86_64"))]
        each_mmio!(self, m => m.dma_wmb())
    }
    #[inline]
    fn wmb(&self) {
        each_mmio!(self, m => m.wmb())
    }
    #[inline]
    fn wc_start(&self) {
        each_mmio!(self, m => m.wc_start())
    }
    #[inline]
    fn wc_flush(&self) {
        each_mmio!(self, m => m.wc_flush())
    }
    #[inline]
    fn dma_rmb(&self) {
        // On x86-64 no backend's read barrier is an instruction (loads are not reordered with loads): the
        // simulator's is an acquire fence, a BAR's a compiler fence. Both here, so a poll pays no match per CQE.
        #[cfg(target_arch = "x86_64")]
        {
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
        }
        #[cfg(not(target_arch = "x86_64"))]
        each_mmio!(self, m => m.dma_rmb())
    }
    #[inline]
    fn mb(&self) {
        each_mmio!(self, m => m.mb())
    }
}

/// DMA memory for either device.
#[derive(Debug, Clone)]
pub enum AnyDma {
    #[cfg(feature = "sim")]
    Sim(SimDma),
    Vfio(Arc<Vfio>),
}

// SAFETY: forwards to the simulator's or the VFIO allocator, each of which upholds the contract.
unsafe impl Dma for AnyDma {
    fn alloc(&self, len: usize, align: usize) -> std::result::Result<DmaRegion, DmaError> {
        match self {
            #[cfg(feature = "sim")]
            AnyDma::Sim(d) => d.alloc(len, align),
            AnyDma::Vfio(v) => v.dma.alloc(len, align),
        }
    }
    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        match self {
            #[cfg(feature = "sim")]
            AnyDma::Sim(d) => d.iova_of(cpu, len),
            AnyDma::Vfio(v) => v.dma.iova_of(cpu, len),
        }
    }
    unsafe fn map_user(&self, ptr: NonNull<u8>, len: usize) -> std::result::Result<DmaRegion, DmaError> {
        // SAFETY: the caller's duties pass through unchanged.
        unsafe {
            match self {
                #[cfg(feature = "sim")]
                AnyDma::Sim(d) => d.map_user(ptr, len),
                AnyDma::Vfio(v) => v.dma.map_user(ptr, len),
            }
        }
    }
    unsafe fn free(&self, region: DmaRegion) {
        // SAFETY: the caller's duties pass through unchanged.
        unsafe {
            match self {
                #[cfg(feature = "sim")]
                AnyDma::Sim(d) => d.free(region),
                AnyDma::Vfio(v) => v.dma.free(region),
            }
        }
    }
}

/// Waiting for either device: simulated time, or the host's clock.
#[derive(Debug)]
pub enum AnyDelay {
    #[cfg(feature = "sim")]
    Sim(SimDelay),
    Std(StdDelay),
}

impl DelayNs for AnyDelay {
    fn delay_ns(&mut self, ns: u32) {
        match self {
            #[cfg(feature = "sim")]
            AnyDelay::Sim(d) => d.delay_ns(ns),
            AnyDelay::Std(d) => d.delay_ns(ns),
        }
    }
}

/// A command tracer a context hands every firmware command to (the `mlx5` tool's `--trace`), from bring-up to
/// teardown.
pub type Tracer = Box<dyn CmdTrace + Send>;

/// The device's tracer, if any. Without one a firmware command costs one untaken branch; the datapath never
/// reaches it.
pub(crate) struct MaybeTrace(pub(crate) Option<Tracer>);

impl CmdTrace for MaybeTrace {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        if let Some(t) = &mut self.0 {
            t.record(rec);
        }
    }
}

pub(crate) type AnyHca = Hca<AnyMmio, AnyDma, MaybeTrace, HostTables>;

include!("../../../core/src/table/vec.rs");

/// The host's tables for the HCA: the doorbell-record pages, the firmware page pool and the CQ table grow with
/// what is created, so every QP, CQ and firmware page the device advertises can be had (rdma-core's `dbrec.c`
/// adds a record page on demand and frees it when empty; Linux's `pagealloc.c` takes any page count).
#[derive(Debug, Clone, Copy)]
pub struct HostTables;

impl Tables for HostTables {
    type DbrPages = VecTable<Option<DbrPage>>;
    type FwChunks = VecTable<FwChunk>;
    type Cqs = VecTable<CqEntry>;
}

/// Which device a context drives: the simulated ConnectX or a real one through VFIO. The `mlx5` tool's device
/// choice (`--device`) is this type too.
#[derive(Debug, Clone)]
pub enum DeviceKind {
    #[cfg(feature = "sim")]
    Sim(SimDevice),
    Vfio(Arc<Vfio>),
}

impl DeviceKind {
    /// DMA memory the device's allocator has handed out and not taken back, `(regions, bytes)`.
    pub fn dma_outstanding(&self) -> (usize, usize) {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => d.dma_outstanding(),
            DeviceKind::Vfio(v) => v.dma.outstanding(),
        }
    }

    /// Whether registering process memory pins it in the kernel, which refuses what `ib_umem_get` refuses (VFIO's
    /// `VFIO_IOMMU_MAP_DMA`); the simulator pins nothing, so its registrations are checked first
    /// (`usermem::check`).
    pub(crate) fn pins_user_memory(&self) -> bool {
        matches!(self, DeviceKind::Vfio(_))
    }

    /// The window the datapath rings: the device's BAR, or plain memory for a simulated device when
    /// `MLX5_RS_SIM_DOORBELLS=memory` says so.
    pub(crate) fn datapath_mmio(&self) -> AnyMmio {
        #[cfg(feature = "sim")]
        if let DeviceKind::Sim(d) = self {
            if std::env::var(MEMORY_DOORBELLS_ENV).is_ok_and(|v| v == "memory") {
                log::warn!("{MEMORY_DOORBELLS_ENV}=memory: doorbells land in memory, posted work never runs");
                return AnyMmio::Mem(Arc::new(MemBar::new(d.mmio().bar_size())));
            }
        }
        self.mmio()
    }

    pub(crate) fn mmio(&self) -> AnyMmio {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyMmio::Sim(d.mmio()),
            DeviceKind::Vfio(v) => AnyMmio::Vfio(v.clone()),
        }
    }

    pub(crate) fn dma(&self) -> AnyDma {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyDma::Sim(d.dma()),
            DeviceKind::Vfio(v) => AnyDma::Vfio(v.clone()),
        }
    }

    pub(crate) fn delay(&self) -> AnyDelay {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyDelay::Sim(d.delay()),
            DeviceKind::Vfio(_) => AnyDelay::Std(StdDelay),
        }
    }
}

/// One mapping of process memory for the device and how many memory regions use it.
#[derive(Debug)]
struct UserMap {
    region: DmaRegion,
    refs: usize,
}

/// Process memory mapped for the device ([`Dma::map_user`]), by first CPU address. The allocators refuse to map
/// the same bytes twice, so memory regions over overlapping memory share one mapping: a region inside a live
/// mapping takes a reference to it, and the mapping goes when its last region does. Guarded by the control mutex.
#[derive(Debug, Default)]
pub(crate) struct UserMaps {
    maps: BTreeMap<usize, UserMap>,
}

/// A memory region's share of a mapping: the mapping's first CPU address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MapKey(usize);

impl UserMaps {
    /// A share of a mapping covering the `len` bytes at `ptr`: an existing one holding them all, else a new one.
    /// Bytes partly inside a live mapping cannot get a contiguous bus range of their own and are refused.
    ///
    /// # Safety
    /// The bytes stay allocated, and the whole pages covering them hold nothing the device must not reach,
    /// until the share is released.
    pub(crate) unsafe fn acquire(
        &mut self,
        dma: &AnyDma,
        ptr: NonNull<u8>,
        len: usize,
    ) -> Result<MapKey, crate::error::VerbsError> {
        let a = ptr.as_ptr() as usize;
        let end = a.checked_add(len).filter(|_| len > 0).ok_or_else(|| {
            crate::error::VerbsError::Invalid(format!("{len} bytes at {a:#x} are not a memory range"))
        })?;
        // Mappings never overlap one another, so only the last one starting before `end` can reach into the range.
        if let Some((&start, m)) = self.maps.range_mut(..end).next_back() {
            let m_end = start + m.region.len();
            if start <= a && end <= m_end {
                m.refs += 1;
                return Ok(MapKey(start));
            }
            if m_end > a {
                return Err(crate::error::VerbsError::Invalid(format!(
                    "{len} bytes at {a:#x} overlap registered memory ({:#x} bytes at {start:#x}) without lying inside it",
                    m.region.len()
                )));
            }
        }
        // SAFETY: the caller keeps the bytes allocated and their pages fit for the device until the share is
        // released, and no mapping of this table covers any of them (checked above); `release` frees the region.
        let region = unsafe { dma.map_user(ptr, len) }.map_err(crate::error::VerbsError::Dma)?;
        self.maps.insert(a, UserMap { region, refs: 1 });
        Ok(MapKey(a))
    }

    /// The `len` bytes at `ptr` inside the mapping `key` (which `acquire` returned for them).
    pub(crate) fn view(&self, key: MapKey, ptr: NonNull<u8>, len: usize) -> Option<DmaView<'_>> {
        let m = self.maps.get(&key.0)?;
        m.region.slice((ptr.as_ptr() as usize).checked_sub(key.0)?, len)
    }

    /// Gives a share back; the last one unmaps the memory, so the device can no longer reach it.
    pub(crate) fn release(&mut self, dma: &AnyDma, key: MapKey) {
        let Some(m) = self.maps.get_mut(&key.0) else { return };
        m.refs -= 1;
        if m.refs == 0 {
            if let Some(m) = self.maps.remove(&key.0) {
                // SAFETY: the region came from `map_user` of this device's allocator and is freed once (it left
                // the table). For memory from `map_user`, `free` itself takes the device's access away before it
                // returns (the IOMMU unmap), which is what makes giving the memory back to its owner safe even when
                // a key over it could not be destroyed.
                unsafe { dma.free(m.region) };
            }
        }
    }

    /// Live mappings (tests).
    pub(crate) fn len(&self) -> usize {
        self.maps.len()
    }
}

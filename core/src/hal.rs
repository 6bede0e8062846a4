//! Hardware abstraction: register access to a BAR ([`Mmio`]), device-visible memory ([`Dma`]) and the memory
//! barriers that order the two. Delays come from [`embedded_hal::delay::DelayNs`].
//!
//! The same driver code runs over a VFIO-mapped BAR in a Linux process, a fixed physical window on a
//! microcontroller, or the simulated device in `mlx5-sim`: each provides these traits.

use core::ptr::NonNull;

pub use embedded_hal::delay::DelayNs;

/// Register access to one PCI BAR. Offsets are bytes from the start of the BAR.
///
/// Every mlx5 register is big endian (`ioread32be`/`iowrite32be`): `read32` returns the value the device
/// defines, i.e. the four bytes at `off` interpreted big endian, and `write32` stores `v.to_be_bytes()`.
/// `write64` stores `v.to_be_bytes()` as **one** 64-bit access: a doorbell split into two 32-bit writes can be
/// observed half-written by the device (`mlx5_write64`).
///
/// The barrier methods have per-architecture defaults from [`barrier`]; an implementation overrides them only
/// when its transport needs something else (the simulator, for example, orders through its own lock).
pub trait Mmio {
    fn read32(&self, off: usize) -> u32;
    fn write32(&self, off: usize, v: u32);
    fn read64(&self, off: usize) -> u64;
    fn write64(&self, off: usize, v: u64);

    /// Orders stores to DMA memory before a later store to DMA memory that the device polls (a doorbell record,
    /// an owner bit): the WQEs must be visible before the record that says they exist.
    fn dma_wmb(&self) {
        barrier::dma_wmb()
    }

    /// Orders all earlier stores (DMA memory and MMIO) before later MMIO stores: the command entry and its
    /// mailboxes must be visible before the doorbell that hands them to firmware.
    fn wmb(&self) {
        barrier::wmb()
    }

    /// Opens a write-combining burst (BlueFlame copy). Orders earlier stores before the burst.
    fn wc_start(&self) {
        barrier::wc_start()
    }

    /// Closes a write-combining burst: flushes the WC buffer so the BlueFlame copy reaches the device as whole
    /// 64-byte chunks before anything that follows.
    fn wc_flush(&self) {
        barrier::wc_flush()
    }

    /// Orders the load of an owner bit / ownership byte before the loads of the rest of the CQE, EQE or command
    /// entry: without it the CPU may read stale contents that the device wrote just before flipping ownership.
    fn dma_rmb(&self) {
        barrier::dma_rmb()
    }

    /// Full barrier: every earlier load and store before every later one. An EQ consumer-index update needs it:
    /// the EQE loads must be complete before the doorbell store that lets the device overwrite those entries.
    fn mb(&self) {
        barrier::mb()
    }
}

impl<M: Mmio + ?Sized> Mmio for &M {
    fn read32(&self, off: usize) -> u32 {
        (**self).read32(off)
    }
    fn write32(&self, off: usize, v: u32) {
        (**self).write32(off, v)
    }
    fn read64(&self, off: usize) -> u64 {
        (**self).read64(off)
    }
    fn write64(&self, off: usize, v: u64) {
        (**self).write64(off, v)
    }
    fn dma_wmb(&self) {
        (**self).dma_wmb()
    }
    fn wmb(&self) {
        (**self).wmb()
    }
    fn wc_start(&self) {
        (**self).wc_start()
    }
    fn wc_flush(&self) {
        (**self).wc_flush()
    }
    fn dma_rmb(&self) {
        (**self).dma_rmb()
    }
    fn mb(&self) {
        (**self).mb()
    }
}

/// A block of device-visible memory: `len` bytes at `cpu` for the CPU and at `iova` for the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaRegion {
    pub cpu: NonNull<u8>,
    pub iova: u64,
    pub len: usize,
}

// SAFETY: a DmaRegion is a description (pointer, bus address, length); who may access the memory is governed by
// the ownership protocol of the queue that holds it, not by the thread that holds the description.
unsafe impl Send for DmaRegion {}
// SAFETY: as above; shared references only expose the description.
unsafe impl Sync for DmaRegion {}

impl DmaRegion {
    /// Pointer to byte `off`, checked against the region's length.
    ///
    /// # Panics
    /// When `off + len` exceeds the region: offsets are computed by the driver from its own layouts, so this
    /// catches a driver bug, never a device value.
    #[inline]
    pub fn ptr_at(&self, off: usize, len: usize) -> *mut u8 {
        assert!(off.checked_add(len).is_some_and(|end| end <= self.len), "DMA access outside its region");
        // SAFETY: off < self.len (checked above) so the result stays inside the allocation.
        unsafe { self.cpu.as_ptr().add(off) }
    }

    /// Reads one byte the device may be writing concurrently (an owner bit). Volatile, so it is re-read each time.
    #[inline]
    pub fn read_volatile_u8(&self, off: usize) -> u8 {
        let p = self.ptr_at(off, 1);
        // SAFETY: p is inside the region (ptr_at), which the allocator keeps valid until it is freed.
        unsafe { p.read_volatile() }
    }

    /// Writes one byte with a volatile store (an owner bit the device polls).
    #[inline]
    pub fn write_volatile_u8(&self, off: usize, v: u8) {
        let p = self.ptr_at(off, 1);
        // SAFETY: p is inside the region (ptr_at), which the allocator keeps valid until it is freed.
        unsafe { p.write_volatile(v) }
    }

    /// Fills `off..off + len` with zeros.
    pub fn zero(&self, off: usize, len: usize) {
        let p = self.ptr_at(off, len);
        // SAFETY: the range is inside the region (ptr_at); callers only zero memory the device does not own.
        unsafe { p.write_bytes(0, len) }
    }
}

/// Why a DMA allocation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum DmaError {
    /// No memory (or IOVA space) left for `len` bytes.
    NoMemory { len: usize },
    /// The allocator cannot provide this alignment.
    BadAlignment { align: usize },
    /// The platform refused to map the memory for the device.
    MapFailed,
}

impl core::fmt::Display for DmaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DmaError::NoMemory { len } => write!(f, "out of DMA memory allocating {len} bytes"),
            DmaError::BadAlignment { align } => write!(f, "DMA alignment {align} not supported"),
            DmaError::MapFailed => write!(f, "failed to map DMA memory for the device"),
        }
    }
}

/// Allocator of coherent, device-visible memory.
///
/// # Safety
/// Implementers guarantee that a region returned by [`Dma::alloc`]:
/// * is valid for CPU reads and writes of `len` bytes through `cpu` until it is passed to [`Dma::free`];
/// * is zero-filled, aligned to `align` at both `cpu` and `iova`, and overlaps no other live region;
/// * is coherent: CPU stores become visible to the device at `iova` (subject to the [`Mmio`] barriers) and device
///   writes become visible to the CPU without cache maintenance.
///
/// Callers guarantee that they pass to `free` only regions this allocator returned, each once, and only after the
/// device can no longer access them (the owning queue is destroyed, or the function is disabled or reset).
pub unsafe trait Dma {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError>;

    /// The bus address of the `len` bytes at `cpu`, when they lie inside one live region this allocator returned.
    /// Memory registration uses it: a range the device cannot reach must not become a memory key. Allocators that
    /// cannot tell return `None` (the default), which makes registration fail rather than guess.
    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let _ = (cpu, len);
        None
    }

    /// Returns a region to the allocator.
    ///
    /// # Safety
    /// `region` came from this allocator's `alloc`, is freed once, and the device no longer accesses it.
    unsafe fn free(&self, region: DmaRegion);
}

// SAFETY: forwards to the referenced allocator, which upholds the contract.
unsafe impl<D: Dma + ?Sized> Dma for &D {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        (**self).alloc(len, align)
    }
    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        (**self).iova_of(cpu, len)
    }
    unsafe fn free(&self, region: DmaRegion) {
        // SAFETY: the caller's duties are passed through unchanged.
        unsafe { (**self).free(region) }
    }
}

/// Per-architecture barrier defaults, mirroring the kernel's definitions for each.
pub mod barrier {
    #[allow(unused_imports)]
    use core::sync::atomic::{compiler_fence, fence, Ordering};

    /// Full barrier (the kernel's `mb()`): `mfence` on x86-64, `dsb sy` on AArch64, `dsb` on Arm.
    #[inline(always)]
    pub fn mb() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("mfence", options(nostack, preserves_flags))
        };
        #[cfg(target_arch = "aarch64")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dsb sy", options(nostack, preserves_flags))
        };
        #[cfg(target_arch = "arm")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dsb", options(nostack, preserves_flags))
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "arm")))]
        fence(Ordering::SeqCst);
    }

    /// x86-64 keeps stores in order (TSO) and DMA is cache coherent, so ordering DMA stores only needs the compiler
    /// not to reorder (the kernel's `dma_wmb()` is `barrier()` there). Elsewhere a store barrier for the outer
    /// shareable domain the device sits in.
    #[inline(always)]
    pub fn dma_wmb() {
        #[cfg(target_arch = "x86_64")]
        compiler_fence(Ordering::SeqCst);
        #[cfg(target_arch = "aarch64")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dmb oshst", options(nostack, preserves_flags))
        };
        #[cfg(target_arch = "arm")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dmb", options(nostack, preserves_flags))
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "arm")))]
        fence(Ordering::SeqCst);
    }

    /// Full store barrier before an MMIO store: `sfence` on x86-64 (it also drains write-combining buffers),
    /// `dsb st` on Arm.
    #[inline(always)]
    pub fn wmb() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("sfence", options(nostack, preserves_flags))
        };
        #[cfg(target_arch = "aarch64")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dsb st", options(nostack, preserves_flags))
        };
        #[cfg(target_arch = "arm")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dsb", options(nostack, preserves_flags))
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "arm")))]
        fence(Ordering::SeqCst);
    }

    /// Before a write-combining burst: earlier stores (the doorbell record) must not be merged after the burst.
    #[inline(always)]
    pub fn wc_start() {
        wmb()
    }

    /// After a write-combining burst: flush the WC buffer (`mmio_flush_writes`).
    #[inline(always)]
    pub fn wc_flush() {
        wmb()
    }

    /// Load barrier after an ownership check: x86-64 does not reorder loads with loads, so the compiler barrier is
    /// enough (the kernel's `dma_rmb()`); Arm needs `dmb oshld` / `dmb`.
    #[inline(always)]
    pub fn dma_rmb() {
        #[cfg(target_arch = "x86_64")]
        compiler_fence(Ordering::SeqCst);
        #[cfg(target_arch = "aarch64")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dmb oshld", options(nostack, preserves_flags))
        };
        #[cfg(target_arch = "arm")]
        // SAFETY: a barrier instruction; it touches no memory and no registers.
        unsafe {
            core::arch::asm!("dmb", options(nostack, preserves_flags))
        };
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64", target_arch = "arm")))]
        fence(Ordering::SeqCst);
    }
}

impl core::error::Error for DmaError {}

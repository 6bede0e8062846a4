//! Hardware abstraction: register access to a BAR ([`Mmio`]), device-visible memory ([`Dma`]) and the memory
//! barriers that order the two. Delays come from [`embedded_hal::delay::DelayNs`].
//!
//! The same driver code runs over a VFIO-mapped BAR in a Linux process, a fixed physical window on a
//! microcontroller, or the simulated device in `mlx5-sim`: each provides these traits.

use core::marker::PhantomData;
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
    /// Reads the big-endian 32-bit register at byte `off`.
    fn read32(&self, off: usize) -> u32;
    /// Writes the big-endian 32-bit register at byte `off`.
    fn write32(&self, off: usize, v: u32);
    /// Reads the big-endian 64-bit register at byte `off` (one access).
    fn read64(&self, off: usize) -> u64;
    /// Writes the big-endian 64-bit register at byte `off` as one access (a doorbell).
    fn write64(&self, off: usize, v: u64);

    /// Copies one 64-byte chunk of a BlueFlame write into the write-combining window at byte `off` (64-byte
    /// aligned): eight 8-byte stores in address order, each storing the bytes of its word of `chunk` as they lie in
    /// memory. The default is eight [`Mmio::write64`]s; a mapping of the BAR overrides it with one bounds check
    /// and straight-line stores.
    #[inline]
    fn write_bf64(&self, off: usize, chunk: &[u64; 8]) {
        for (i, w) in chunk.iter().enumerate() {
            // `write64` stores its value big-endian: this value's big-endian bytes are `w`'s bytes in memory.
            self.write64(off + 8 * i, u64::from_be(*w));
        }
    }

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
    #[inline]
    fn write_bf64(&self, off: usize, chunk: &[u64; 8]) {
        (**self).write_bf64(off, chunk)
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
///
/// A region is a capability, not a description: it can only be made by [`DmaRegion::from_raw_parts`], whose
/// contract an allocator upholds, and it is neither `Copy` nor `Clone`, so [`Dma::free`] consumes the only handle
/// and no safe code can reach the memory afterwards. Hot paths borrow it as a [`DmaView`].
///
/// A region cannot be forged in safe code:
///
/// ```compile_fail
/// use core::ptr::NonNull;
/// use mlx5_core::hal::DmaRegion;
/// let forged = DmaRegion { cpu: NonNull::dangling(), iova: 0, len: 4096 };
/// forged.zero(0, 4096);
/// ```
///
/// ```compile_fail
/// use core::ptr::NonNull;
/// use mlx5_core::hal::DmaRegion;
/// // The constructor is `unsafe`: its caller vouches for the memory.
/// let forged = DmaRegion::from_raw_parts(NonNull::dangling(), 0, 4096);
/// ```
///
/// Nor duplicated, so a freed region cannot be used again:
///
/// ```compile_fail
/// fn keep_a_copy(r: &mlx5_core::hal::DmaRegion) -> mlx5_core::hal::DmaRegion {
///     r.clone()
/// }
/// ```
#[derive(Debug, PartialEq, Eq)]
pub struct DmaRegion {
    cpu: NonNull<u8>,
    iova: u64,
    len: usize,
}

// SAFETY: a region is the exclusive handle to its memory (it is not `Clone`); moving it to another thread moves
// that ownership, and what the device may access is governed by the queue protocol, not by the owning thread.
unsafe impl Send for DmaRegion {}
// Not `Sync`: the safe methods below write through `&self` (an owner bit, a zeroed range), and two threads doing
// that to the same bytes would race. A structure that holds regions is shared across threads behind a lock.

impl DmaRegion {
    /// Makes a region from its parts. Only a [`Dma`] allocator (or code that owns device-visible memory in the
    /// same way, e.g. a test fake) calls this.
    ///
    /// # Safety
    /// `cpu` must be valid for reads and writes of `len` bytes for as long as the returned region (or the value
    /// it is moved into) exists, and until it is given back to the allocator that made it; `iova` is the address
    /// at which the device reaches the same bytes. No other live `DmaRegion` may cover any of these bytes, except
    /// sub-ranges the owner of this region hands out as borrowed [`DmaView`]s.
    #[inline]
    pub const unsafe fn from_raw_parts(cpu: NonNull<u8>, iova: u64, len: usize) -> Self {
        Self { cpu, iova, len }
    }

    /// The CPU address of the first byte.
    #[inline]
    pub fn cpu(&self) -> NonNull<u8> {
        self.cpu
    }

    /// The bus address (IOVA) of the first byte, as the device sees it.
    #[inline]
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length region.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A borrowed view of the whole region (cheap to copy, cannot outlive the region).
    #[inline]
    pub fn view(&self) -> DmaView<'_> {
        DmaView { cpu: self.cpu, iova: self.iova, len: self.len, _region: PhantomData }
    }

    /// `len` bytes at `off` as a borrowed view, when they lie inside the region.
    #[inline]
    pub fn slice(&self, off: usize, len: usize) -> Option<DmaView<'_>> {
        self.view().slice(off, len)
    }

    /// Pointer to byte `off`, checked against the region's length.
    ///
    /// # Panics
    /// When `off + len` exceeds the region: offsets are computed by the driver from its own layouts, so this
    /// catches a driver bug, never a device value.
    #[inline]
    pub fn ptr_at(&self, off: usize, len: usize) -> *mut u8 {
        self.view().ptr_at(off, len)
    }

    /// Reads one byte the device may be writing concurrently (an owner bit). Volatile, so it is re-read each time.
    #[inline]
    pub fn read_volatile_u8(&self, off: usize) -> u8 {
        self.view().read_volatile_u8(off)
    }

    /// Writes one byte with a volatile store (an owner bit the device polls).
    #[inline]
    pub fn write_volatile_u8(&self, off: usize, v: u8) {
        self.view().write_volatile_u8(off, v)
    }

    /// Fills `off..off + len` with zeros.
    pub fn zero(&self, off: usize, len: usize) {
        self.view().zero(off, len)
    }
}

/// A borrowed part of a [`DmaRegion`]: the hot paths' handle to a ring or a record. It is `Copy` but cannot
/// outlive the region it was taken from, so it never reaches freed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaView<'a> {
    cpu: NonNull<u8>,
    iova: u64,
    len: usize,
    _region: PhantomData<&'a DmaRegion>,
}

impl<'a> DmaView<'a> {
    /// The CPU address of the first byte.
    #[inline]
    pub fn cpu(&self) -> NonNull<u8> {
        self.cpu
    }

    /// The bus address of the first byte.
    #[inline]
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length view.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at `off` of this view, when they lie inside it.
    #[inline]
    pub fn slice(&self, off: usize, len: usize) -> Option<DmaView<'a>> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: off <= self.len (checked above), so the pointer stays inside (or one past) the region.
        let cpu = unsafe { self.cpu.add(off) };
        Some(DmaView { cpu, iova: self.iova + off as u64, len, _region: PhantomData })
    }

    /// Pointer to byte `off`, checked against the view's length.
    ///
    /// # Panics
    /// When `off + len` exceeds the view: offsets are computed by the driver from its own layouts, so this
    /// catches a driver bug, never a device value.
    #[inline]
    pub fn ptr_at(&self, off: usize, len: usize) -> *mut u8 {
        checked_ptr(self.cpu, self.len, off, len)
    }

    /// Reads one byte the device may be writing concurrently (an owner bit). Volatile, so it is re-read each time.
    #[inline]
    pub fn read_volatile_u8(&self, off: usize) -> u8 {
        let p = self.ptr_at(off, 1);
        // SAFETY: p is inside the region (ptr_at), which stays valid while this borrow of it lives.
        unsafe { p.read_volatile() }
    }

    /// Writes one byte with a volatile store (an owner bit the device polls).
    #[inline]
    pub fn write_volatile_u8(&self, off: usize, v: u8) {
        let p = self.ptr_at(off, 1);
        // SAFETY: p is inside the region (ptr_at), which stays valid while this borrow of it lives.
        unsafe { p.write_volatile(v) }
    }

    /// Fills `off..off + len` with zeros.
    pub fn zero(&self, off: usize, len: usize) {
        let p = self.ptr_at(off, len);
        // SAFETY: the range is inside the region (ptr_at), which stays valid while this borrow of it lives.
        unsafe { p.write_bytes(0, len) }
    }
}

/// The pointer to byte `off` of the `size` bytes at `cpu`, when `off..off + len` lies inside them.
///
/// # Panics
/// When it does not: offsets are computed by the driver from its own layouts, so this catches a driver bug.
#[inline]
fn checked_ptr(cpu: NonNull<u8>, size: usize, off: usize, len: usize) -> *mut u8 {
    // Spelled as the check it replaced: clippy's `is_none_or` form moved the receive loop's registers (+1.7
    // instructions per WQE through the C ABI).
    #[allow(clippy::nonminimal_bool)]
    if !off.checked_add(len).is_some_and(|end| end <= size) {
        outside_region();
    }
    // SAFETY: off <= size (checked above), so the result stays inside (or one past) the allocation.
    unsafe { cpu.as_ptr().add(off) }
}

/// [`checked_ptr`]'s panic, out of line: with `assert!` inline the compiler built the panic's arguments on the
/// stack before the check, on every call of the datapath (six instructions per post).
#[cold]
#[inline(never)]
fn outside_region() -> ! {
    panic!("DMA access outside its region")
}

/// A part of a live region remembered by a structure that cannot borrow it: a doorbell record in a pool page, or
/// a queue's one-fragment fast path into its own buffer. Crate-private, made only from a borrowed view, and it
/// hands out raw pointers only; each holder says in its `// SAFETY:` comments why the region outlives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    cpu: NonNull<u8>,
    iova: u64,
    len: usize,
}

// SAFETY: a span is an address and a length and gives no access by itself: every access through it is an unsafe
// operation whose holder shows the region outlives it and the bytes are its own (a queue's fragment, one doorbell
// record of a pool page). Neither depends on the thread, so a queue holding spans may move to another thread.
unsafe impl Send for Span {}

impl Span {
    /// Remembers `view` beyond its borrow; the holder keeps the region alive for as long as it uses the span.
    #[inline]
    pub(crate) fn of(view: DmaView<'_>) -> Self {
        Self { cpu: view.cpu, iova: view.iova, len: view.len }
    }

    /// The CPU address of the first byte.
    #[inline]
    pub(crate) fn cpu(&self) -> NonNull<u8> {
        self.cpu
    }

    /// The bus address of the first byte.
    #[inline]
    pub(crate) fn iova(&self) -> u64 {
        self.iova
    }

    /// The length in bytes.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Pointer to byte `off`, checked against the span's length (a driver bug panics, as in [`DmaView::ptr_at`]).
    #[inline]
    pub(crate) fn ptr_at(&self, off: usize, len: usize) -> *mut u8 {
        checked_ptr(self.cpu, self.len, off, len)
    }
}

/// Why a DMA allocation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum DmaError {
    /// No memory (or IOVA space) left for `len` bytes.
    NoMemory {
        /// The bytes asked for.
        len: usize,
    },
    /// The allocator cannot provide this alignment.
    BadAlignment {
        /// The alignment asked for.
        align: usize,
    },
    /// The platform refused to map the memory for the device.
    MapFailed,
    /// This allocator cannot make memory it did not allocate reachable by the device ([`Dma::map_user`]).
    Unsupported,
    /// The `len` bytes at `addr` cannot be made reachable by the device: an empty or wrapping range, memory
    /// already reachable through another region, memory the platform cannot pin, or no bus address left for it
    /// below the device's limit.
    Unreachable {
        /// The CPU address of the range.
        addr: usize,
        /// Its length in bytes.
        len: usize,
    },
}

impl core::fmt::Display for DmaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DmaError::NoMemory { len } => write!(f, "out of DMA memory allocating {len} bytes"),
            DmaError::BadAlignment { align } => write!(f, "DMA alignment {align} not supported"),
            DmaError::MapFailed => write!(f, "failed to map DMA memory for the device"),
            DmaError::Unsupported => write!(f, "this DMA allocator cannot map process memory for the device"),
            DmaError::Unreachable { addr, len } => {
                write!(f, "{len} bytes at {addr:#x} cannot be made reachable by the device")
            }
        }
    }
}

/// Allocator of coherent, device-visible memory.
///
/// # Safety
/// Implementers guarantee that a region returned by [`Dma::alloc`]:
/// * satisfies [`DmaRegion::from_raw_parts`]'s contract: valid for CPU reads and writes of `len` bytes through
///   `cpu` until it is passed to [`Dma::free`], even if the allocator value is dropped first (an allocator
///   dropped with regions outstanding leaks their memory rather than releasing it);
/// * is zero-filled, aligned to `align` at both `cpu` and `iova`, and overlaps no other live region;
/// * is coherent: CPU stores become visible to the device at `iova` (subject to the [`Mmio`] barriers) and device
///   writes become visible to the CPU without cache maintenance.
///
/// A region returned by [`Dma::map_user`] satisfies the same contract except that its memory is the caller's (not
/// zeroed, aligned as the caller's address is), and that the device reaches it at `iova` until it is passed to
/// [`Dma::free`], which makes it unreachable again before returning.
///
/// Callers guarantee that they pass to `free` only regions this allocator returned (each once, which the type
/// enforces: a region is consumed), and only after the device can no longer access them (the owning queue is
/// destroyed, or the function is disabled or reset).
pub unsafe trait Dma {
    /// `len` zeroed bytes aligned to `align` (a power of two) at both addresses.
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError>;

    /// The bus address of the `len` bytes at `cpu`, when they lie inside one live region this allocator returned.
    /// Memory registration uses it: a range the device cannot reach must not become a memory key. Allocators that
    /// cannot tell return `None` (the default), which makes registration fail rather than guess.
    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let _ = (cpu, len);
        None
    }

    /// Makes the `len` bytes of process memory at `ptr` reachable by the device (rdma-core's `mlx5_vfio_reg_mr`
    /// maps user memory with `VFIO_IOMMU_MAP_DMA` the same way): the returned region describes exactly those bytes,
    /// at a bus address the allocator chose. [`Dma::free`] makes them unreachable again; the memory itself stays
    /// the caller's. Allocators that cannot do this return [`DmaError::Unsupported`] (the default).
    ///
    /// Mappings are made in whole pages (4 KiB, or the platform's IOMMU page): every byte of the pages covering
    /// `ptr .. ptr + len` becomes reachable, not only the range. Implementations place the pages at a bus address
    /// aligned as `ptr`'s page is (up to a limit they document), so large MTT pages stay usable.
    ///
    /// # Safety
    /// For implementers: the region returned satisfies [`DmaRegion::from_raw_parts`] for `ptr .. ptr + len` with
    /// the bus address at which the device reaches those bytes; nothing outside the covering pages becomes
    /// reachable; and [`Dma::free`] of the region removes the device's access before it returns (or, if the
    /// platform refuses, keeps the bus addresses reserved so they are never handed out again).
    ///
    /// For callers: the bytes are valid for reads and writes and stay allocated until the region is passed to
    /// [`Dma::free`]; the whole covering pages hold nothing the device must not see or must not be able to
    /// overwrite, for as long as the region lives; and no other live region covers any of the bytes (register
    /// overlapping memory keys over views of one mapping instead of mapping the same bytes twice).
    unsafe fn map_user(&self, ptr: NonNull<u8>, len: usize) -> Result<DmaRegion, DmaError> {
        let _ = (ptr, len);
        Err(DmaError::Unsupported)
    }

    /// Returns a region to the allocator (or, for a region from [`Dma::map_user`], takes the device's access to it
    /// away).
    ///
    /// # Safety
    /// `region` came from this allocator's `alloc` or `map_user`, is freed once, and the device no longer accesses
    /// it.
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
    unsafe fn map_user(&self, ptr: NonNull<u8>, len: usize) -> Result<DmaRegion, DmaError> {
        // SAFETY: the caller's duties are passed through unchanged.
        unsafe { (**self).map_user(ptr, len) }
    }
    unsafe fn free(&self, region: DmaRegion) {
        // SAFETY: the caller's duties are passed through unchanged.
        unsafe { (**self).free(region) }
    }
}

/// Device-visible memory that goes back to its [`Dma`] in one call: a region, or a buffer made of regions
/// (`QueueBuf`). What a [`DmaGuard`] owns.
pub trait DmaOwned {
    /// Gives the memory back to `dma`.
    ///
    /// # Safety
    /// As [`Dma::free`] for every region it holds: they came from `dma`, are freed once, and the device no longer
    /// accesses them.
    unsafe fn free_to<D: Dma + ?Sized>(self, dma: &D);
}

impl DmaOwned for DmaRegion {
    unsafe fn free_to<D: Dma + ?Sized>(self, dma: &D) {
        // SAFETY: the caller's duties are those of `Dma::free`.
        unsafe { dma.free(self) }
    }
}

/// The owner of memory a create path allocated and has not shown the device yet: it goes back to its allocator
/// when the guard drops (an early return, a `?`, a panic), unless the path gets that far and
/// [`keep`](DmaGuard::keep)s it. It borrows the allocator and lives on the stack, so it needs no heap.
///
/// Keep the memory before the device can reach it (before the command that names its address): from then on
/// only the device's answer says whether it may be freed, which a guard cannot know. The contents are reached
/// through `Deref`; there is no `DerefMut`, so the memory cannot be swapped for memory of another allocator.
#[must_use = "dropping the guard frees the memory at once"]
pub struct DmaGuard<'d, D: Dma + ?Sized, T: DmaOwned = DmaRegion> {
    dma: &'d D,
    /// `None` only once kept (and then the guard is gone).
    mem: Option<T>,
}

impl<'d, D: Dma + ?Sized, T: DmaOwned> DmaGuard<'d, D, T> {
    /// Takes `mem` into a guard that frees it through `dma` on drop.
    ///
    /// # Safety
    /// `mem` came from `dma` and nothing else frees it; the device does not access it while the guard owns it.
    #[inline]
    pub unsafe fn new(dma: &'d D, mem: T) -> Self {
        Self { dma, mem: Some(mem) }
    }

    /// The memory, no longer freed on drop: the create path has got as far as handing it on.
    #[inline]
    pub fn keep(mut self) -> T {
        self.mem.take().unwrap_or_else(|| unreachable!("a guard holds its memory until kept"))
    }
}

impl<D: Dma + ?Sized, T: DmaOwned> core::ops::Deref for DmaGuard<'_, D, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        self.mem.as_ref().unwrap_or_else(|| unreachable!("a guard holds its memory until kept"))
    }
}

impl<D: Dma + ?Sized, T: DmaOwned> Drop for DmaGuard<'_, D, T> {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            // SAFETY: `new`'s caller vouched that the memory came from `self.dma` and that the device does not
            // access it while guarded; it is taken out, so freed once.
            unsafe { mem.free_to(self.dma) }
        }
    }
}

impl<D: Dma + ?Sized, T: DmaOwned + core::fmt::Debug> core::fmt::Debug for DmaGuard<'_, D, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DmaGuard").field("mem", &self.mem).finish_non_exhaustive()
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

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
pub(crate) mod tests {
    #[cfg(test)]
    extern crate std;

    use core::alloc::Layout;
    use core::cell::RefCell;
    #[cfg(test)]
    use std::alloc::{alloc_zeroed, dealloc};

    use super::*;

    /// The memory `TestDma` hands out outside `cargo test` (the harness without std, `crate::testlist`): a bump
    /// allocator over a region the harness gives, taken back whole before each test. Kept as a pointer, so its
    /// provenance is kept.
    // Under `cargo test` without `testlist`, nothing sets or uses it.
    #[cfg_attr(test, allow(dead_code))]
    pub(crate) mod arena {
        use core::ptr::NonNull;
        use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

        static BASE: AtomicPtr<u8> = AtomicPtr::new(core::ptr::null_mut());
        static LEN: AtomicUsize = AtomicUsize::new(0);
        static TOP: AtomicUsize = AtomicUsize::new(0);
        /// Bytes left free before each region.
        const GAP: usize = 64;

        /// # Safety
        ///
        /// As `testlist::set_arena`.
        pub(crate) unsafe fn set(base: *mut u8, len: usize) {
            BASE.store(base, Ordering::Relaxed);
            LEN.store(len, Ordering::Relaxed);
            TOP.store(0, Ordering::Relaxed);
        }

        pub(crate) fn reset() {
            TOP.store(0, Ordering::Relaxed);
        }

        /// A fresh, zeroed, `align`-aligned piece, or `None` when it does not fit (or no arena was given).
        pub(crate) fn alloc(len: usize, align: usize) -> Option<NonNull<u8>> {
            let base = NonNull::new(BASE.load(Ordering::Relaxed))?;
            if !align.is_power_of_two() {
                return None;
            }
            // A gap of unused bytes before each region, as a heap leaves: regions are never adjacent, so no test
            // sees two allocations merge into one larger page by accident, and a small overrun hits nothing.
            let top = TOP.load(Ordering::Relaxed).checked_add(GAP)?;
            let addr = base.as_ptr().addr().checked_add(top)?;
            let start = top + (addr.wrapping_neg() & (align - 1));
            let end = start.checked_add(len.max(1))?;
            if end > LEN.load(Ordering::Relaxed) {
                return None;
            }
            TOP.store(end, Ordering::Relaxed);
            // SAFETY: `start..end` lies inside the arena `set`'s caller vouched for, and past every region handed
            // out since the last `reset`, so no live region is overwritten.
            unsafe {
                let p = base.as_ptr().add(start);
                core::ptr::write_bytes(p, 0, end - start);
                NonNull::new(p)
            }
        }
    }

    /// Under `cargo test` the live regions are heap allocations; without std (the `testlist` harness on a
    /// microcontroller) they come from the harness's arena (`arena`), at most 256 at a time.
    #[cfg(test)]
    type Live = std::vec::Vec<(NonNull<u8>, Layout)>;
    #[cfg(not(test))]
    type Live = heapless::Vec<(NonNull<u8>, Layout), 256>;

    /// A heap allocator for the core's own unit tests: bus address = CPU address, an optional largest region (to
    /// force fragmented queue buffers), a log of what is live. Regions still live when it is dropped are leaked,
    /// as `Dma`'s contract asks.
    #[derive(Debug, Default)]
    pub(crate) struct TestDma {
        /// Live regions by their pointer (kept as a pointer, so its provenance is kept for `dealloc`).
        live: RefCell<Live>,
        max_len: Option<usize>,
    }

    /// Frees what is still live, so Miri's leak check sees tests that hand their objects' memory back with the
    /// allocator. Every test declares its allocator before the objects using it, which are dropped first.
    #[cfg(test)]
    impl Drop for TestDma {
        fn drop(&mut self) {
            for (p, layout) in self.live.get_mut().drain(..) {
                // SAFETY: allocated in `alloc` with this layout and not freed (it is still in `live`); nothing uses
                // it any more (see above).
                unsafe { dealloc(p.as_ptr(), layout) };
            }
        }
    }

    impl TestDma {
        /// An allocator that refuses regions larger than `max_len`.
        pub(crate) fn limited(max_len: usize) -> Self {
            Self { live: RefCell::default(), max_len: Some(max_len) }
        }

        pub(crate) fn live(&self) -> usize {
            self.live.borrow().len()
        }
    }

    // SAFETY: regions are fresh zeroed allocations with the asked alignment (so the bus address, the CPU address,
    // is aligned too), distinct while live, deallocated by `free` or when the allocator goes, after its users.
    unsafe impl Dma for TestDma {
        fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
            if self.max_len.is_some_and(|m| len > m) {
                return Err(DmaError::NoMemory { len });
            }
            let layout = Layout::from_size_align(len.max(1), align).map_err(|_| DmaError::BadAlignment { align })?;
            #[cfg(test)]
            // SAFETY: the layout has a non-zero size.
            let cpu = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or(DmaError::NoMemory { len })?;
            #[cfg(test)]
            self.live.borrow_mut().push((cpu, layout));
            #[cfg(not(test))]
            let cpu = arena::alloc(layout.size(), layout.align()).ok_or(DmaError::NoMemory { len })?;
            #[cfg(not(test))]
            self.live.borrow_mut().push((cpu, layout)).map_err(|_| DmaError::NoMemory { len })?;
            // SAFETY: a fresh allocation of at least `len` bytes, freed only by `free`.
            Ok(unsafe { DmaRegion::from_raw_parts(cpu, cpu.as_ptr() as u64, len) })
        }

        fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
            let a = cpu as usize;
            let live = self.live.borrow();
            live.iter()
                .any(|&(p, l)| a >= p.as_ptr() as usize && a + len <= p.as_ptr() as usize + l.size())
                .then_some(a as u64)
        }

        unsafe fn free(&self, region: DmaRegion) {
            let a = region.cpu();
            let mut live = self.live.borrow_mut();
            let i = live.iter().position(|&(p, _)| p == a).expect("a region this allocator made");
            let (p, layout) = live.swap_remove(i);
            // The arena's memory is taken back between tests (`testlist::before_each`), not region by region.
            #[cfg(not(test))]
            let _ = (p, layout);
            #[cfg(test)]
            // SAFETY: allocated in `alloc` with this layout, and removed from `live` so freed once.
            unsafe {
                dealloc(p.as_ptr(), layout)
            };
        }
    }

    #[test]
    fn views_and_slices_stay_inside_their_region() {
        let dma = TestDma::default();
        let r = dma.alloc(256, 64).unwrap();
        assert_eq!((r.len(), r.is_empty(), r.iova() % 64), (256, false, 0));
        let v = r.view();
        assert_eq!((v.cpu(), v.iova(), v.len()), (r.cpu(), r.iova(), 256));
        let s = r.slice(64, 128).unwrap();
        assert_eq!((s.iova(), s.len()), (r.iova() + 64, 128));
        // A slice of a slice is relative to it, and nothing past the end is ever handed out.
        assert_eq!(s.slice(120, 8).map(|t| t.iova()), Some(r.iova() + 184));
        assert_eq!(s.slice(121, 8), None);
        assert_eq!(r.slice(256, 0).map(|t| t.len()), Some(0));
        assert_eq!(r.slice(200, 57), None);
        assert_eq!(r.slice(usize::MAX, 2), None);
        // SAFETY: from this allocator, freed once, never given to a device.
        unsafe { dma.free(r) };
        assert_eq!(dma.live(), 0);
    }

    #[test]
    fn byte_accessors_write_where_they_say() {
        let dma = TestDma::default();
        let r = dma.alloc(64, 8).unwrap();
        r.write_volatile_u8(63, 0xa5);
        r.slice(32, 32).unwrap().write_volatile_u8(0, 0x5a);
        assert_eq!((r.read_volatile_u8(63), r.read_volatile_u8(32)), (0xa5, 0x5a));
        r.view().zero(32, 32);
        assert_eq!((r.read_volatile_u8(63), r.read_volatile_u8(32), r.read_volatile_u8(31)), (0, 0, 0));
        // SAFETY: as above.
        unsafe { dma.free(r) };
    }

    #[test]
    #[should_panic(expected = "DMA access outside its region")]
    fn an_access_past_the_end_is_a_driver_bug_caught_before_memory_is_touched() {
        let dma = TestDma::default();
        let r = dma.alloc(16, 8).unwrap();
        let _ = r.ptr_at(12, 8);
    }

    #[test]
    fn an_allocator_without_map_user_refuses_process_memory() {
        let dma = TestDma::default();
        let mut buf = [0u8; 64];
        let p = NonNull::new(buf.as_mut_ptr()).unwrap();
        // SAFETY: the default implementation touches nothing.
        assert_eq!(unsafe { dma.map_user(p, 64) }, Err(DmaError::Unsupported));
        // Through the forwarding implementation for references too.
        let r = &dma;
        // SAFETY: as above.
        assert_eq!(unsafe { Dma::map_user(&r, p, 64) }, Err(DmaError::Unsupported));
        assert_eq!(dma.live(), 0);
    }

    #[test]
    fn a_guard_frees_its_region_on_drop_unless_kept() {
        let dma = TestDma::default();
        {
            // SAFETY: fresh from this allocator, never shown to a device.
            let g = unsafe { DmaGuard::new(&dma, dma.alloc(64, 8).unwrap()) };
            g.write_volatile_u8(0, 1);
            assert_eq!((dma.live(), g.len()), (1, 64));
        }
        assert_eq!(dma.live(), 0, "dropped: freed");
        // SAFETY: as above.
        let g = unsafe { DmaGuard::new(&dma, dma.alloc(64, 8).unwrap()) };
        let r = g.keep();
        assert_eq!(dma.live(), 1, "kept: still the caller's");
        // SAFETY: as above.
        unsafe { dma.free(r) };
        assert_eq!(dma.live(), 0);
    }

    #[test]
    fn a_guard_frees_on_an_early_return() {
        fn two(dma: &TestDma, fail_second: bool) -> Result<(DmaRegion, DmaRegion), DmaError> {
            // SAFETY: fresh from this allocator, never shown to a device.
            let a = unsafe { DmaGuard::new(dma, dma.alloc(32, 8)?) };
            let b = if fail_second { Err(DmaError::NoMemory { len: 32 }) } else { dma.alloc(32, 8) }?;
            Ok((a.keep(), b))
        }
        let dma = TestDma::default();
        assert_eq!(two(&dma, true).unwrap_err(), DmaError::NoMemory { len: 32 });
        assert_eq!(dma.live(), 0, "the first region went back with the error");
        let (a, b) = two(&dma, false).unwrap();
        assert_eq!(dma.live(), 2);
        // SAFETY: as above.
        unsafe {
            dma.free(a);
            dma.free(b);
        }
    }

    #[test]
    fn a_span_remembers_its_view() {
        let dma = TestDma::default();
        let r = dma.alloc(128, 64).unwrap();
        let s = Span::of(r.slice(64, 64).unwrap());
        assert_eq!((s.iova(), s.len(), s.cpu().as_ptr() as usize), (r.iova() + 64, 64, r.iova() as usize + 64));
        assert_eq!(s.ptr_at(8, 8) as usize, r.ptr_at(72, 8) as usize);
        // SAFETY: as above; the span is not used after this.
        unsafe { dma.free(r) };
    }
}

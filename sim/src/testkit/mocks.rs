//! Recording wrappers for any [`Mmio`] or [`Dma`]: they forward every call and log it, so a test can assert the
//! exact register and allocation traffic of driver code (ordering of barriers, doorbells, leaks). [`MemMmio`] is a
//! BAR that is nothing but memory, for driving the datapath with no device behind it (benchmarks, allocation
//! checks).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use mlx5_core::hal::{Dma, DmaError, DmaRegion, Mmio};

/// Which barrier was issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarrierKind {
    Mb,
    DmaWmb,
    Wmb,
    WcStart,
    WcFlush,
    DmaRmb,
}

/// One register access or barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmioAccess {
    Read32 { off: usize, val: u32 },
    Write32 { off: usize, val: u32 },
    Read64 { off: usize, val: u64 },
    Write64 { off: usize, val: u64 },
    Barrier(BarrierKind),
}

fn lock_log<T>(log: &Mutex<Vec<T>>) -> std::sync::MutexGuard<'_, Vec<T>> {
    log.lock().unwrap_or_else(|e| e.into_inner())
}

/// An [`Mmio`] that logs every access to a shared log. Clones share the log.
#[derive(Debug, Clone)]
pub struct RecordingMmio<M: Mmio> {
    inner: M,
    log: Arc<Mutex<Vec<MmioAccess>>>,
}

impl<M: Mmio> RecordingMmio<M> {
    pub fn new(inner: M) -> Self {
        Self { inner, log: Arc::default() }
    }

    /// A snapshot of the log.
    pub fn log(&self) -> Vec<MmioAccess> {
        lock_log(&self.log).clone()
    }

    /// The shared log itself (to watch it from elsewhere).
    pub fn log_handle(&self) -> Arc<Mutex<Vec<MmioAccess>>> {
        self.log.clone()
    }

    pub fn clear(&self) {
        lock_log(&self.log).clear();
    }

    pub fn inner(&self) -> &M {
        &self.inner
    }

    fn push(&self, a: MmioAccess) {
        lock_log(&self.log).push(a);
    }
}

impl<M: Mmio> Mmio for RecordingMmio<M> {
    fn read32(&self, off: usize) -> u32 {
        let val = self.inner.read32(off);
        self.push(MmioAccess::Read32 { off, val });
        val
    }
    fn write32(&self, off: usize, v: u32) {
        // Logged before forwarding, so a doorbell appears before whatever its execution records.
        self.push(MmioAccess::Write32 { off, val: v });
        self.inner.write32(off, v);
    }
    fn read64(&self, off: usize) -> u64 {
        let val = self.inner.read64(off);
        self.push(MmioAccess::Read64 { off, val });
        val
    }
    fn write64(&self, off: usize, v: u64) {
        self.push(MmioAccess::Write64 { off, val: v });
        self.inner.write64(off, v);
    }
    fn dma_wmb(&self) {
        self.push(MmioAccess::Barrier(BarrierKind::DmaWmb));
        self.inner.dma_wmb();
    }
    fn wmb(&self) {
        self.push(MmioAccess::Barrier(BarrierKind::Wmb));
        self.inner.wmb();
    }
    fn wc_start(&self) {
        self.push(MmioAccess::Barrier(BarrierKind::WcStart));
        self.inner.wc_start();
    }
    fn wc_flush(&self) {
        self.push(MmioAccess::Barrier(BarrierKind::WcFlush));
        self.inner.wc_flush();
    }
    fn dma_rmb(&self) {
        self.push(MmioAccess::Barrier(BarrierKind::DmaRmb));
        self.inner.dma_rmb();
    }
    fn mb(&self) {
        self.push(MmioAccess::Barrier(BarrierKind::Mb));
        self.inner.mb();
    }
}

/// A BAR that is plain host memory: every register access is one volatile load or store of its width (big endian,
/// as the [`Mmio`] contract says) into a zeroed heap array, and nothing happens behind it. The barrier methods keep
/// the per-architecture defaults, so a doorbell sequence costs what it costs against a real write-combining BAR
/// minus the bus: this is the MMIO target the datapath benchmarks and the allocation test use.
///
/// Accesses must be naturally aligned and inside the array; anything else panics (a driver bug).
#[derive(Debug)]
pub struct MemMmio {
    /// `len / 8` u64 words, owned; accessed only through raw pointers, so `&self` writes are sound.
    base: std::ptr::NonNull<u64>,
    len: usize,
}

impl MemMmio {
    /// A zeroed BAR of `len` bytes (rounded up to 8).
    pub fn new(len: usize) -> Self {
        let words = len.div_ceil(8).max(1);
        let b: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        let base = std::ptr::NonNull::new(Box::into_raw(b).cast::<u64>()).expect("Box pointers are non-null");
        Self { base, len: words * 8 }
    }

    /// Bytes of the BAR.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    fn at(&self, off: usize, width: usize) -> *mut u8 {
        assert!(
            off.is_multiple_of(width) && off.checked_add(width).is_some_and(|e| e <= self.len),
            "MMIO access {off:#x}"
        );
        // SAFETY: `off + width <= len` (checked above), so the pointer stays inside the allocation.
        unsafe { self.base.as_ptr().cast::<u8>().add(off) }
    }
}

impl Drop for MemMmio {
    fn drop(&mut self) {
        let words = self.len / 8;
        // SAFETY: `base` and `words` are exactly what `new` got from `Box::into_raw` of a `[u64]` of that length,
        // and this is the only place it is turned back into a box.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.base.as_ptr(), words)) });
    }
}

impl Mmio for MemMmio {
    #[inline]
    fn read32(&self, off: usize) -> u32 {
        // SAFETY: in bounds and 4-byte aligned (`at`; the array is 8-byte aligned).
        u32::from_be(unsafe { self.at(off, 4).cast::<u32>().read_volatile() })
    }
    #[inline]
    fn write32(&self, off: usize, v: u32) {
        // SAFETY: as in read32.
        unsafe { self.at(off, 4).cast::<u32>().write_volatile(v.to_be()) }
    }
    #[inline]
    fn read64(&self, off: usize) -> u64 {
        // SAFETY: in bounds and 8-byte aligned (`at`).
        u64::from_be(unsafe { self.at(off, 8).cast::<u64>().read_volatile() })
    }
    #[inline]
    fn write64(&self, off: usize, v: u64) {
        // SAFETY: as in read64; one 64-bit store, as the doorbell contract requires.
        unsafe { self.at(off, 8).cast::<u64>().write_volatile(v.to_be()) }
    }
    #[inline]
    fn write_bf64(&self, off: usize, chunk: &[u64; 8]) {
        // One bounds check for the whole chunk, then eight stores in address order.
        let dst = self.at(off, 64).cast::<u64>();
        for (i, w) in chunk.iter().enumerate() {
            // SAFETY: `off..off + 64` is inside the array and 64-byte aligned (`at`), so word i is too.
            unsafe { dst.add(i).write_volatile(*w) };
        }
    }
}

/// One allocator call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaOp {
    Alloc { len: usize, align: usize, iova: u64 },
    AllocFailed { len: usize, align: usize, err: DmaError },
    Free { iova: u64, len: usize },
}

#[derive(Debug, Default)]
struct DmaLog {
    ops: Vec<DmaOp>,
    live: BTreeMap<u64, usize>,
}

/// A [`Dma`] that logs every allocation and free. Clones share the log.
#[derive(Debug, Clone)]
pub struct RecordingDma<D: Dma> {
    inner: D,
    log: Arc<Mutex<DmaLog>>,
}

impl<D: Dma> RecordingDma<D> {
    pub fn new(inner: D) -> Self {
        Self { inner, log: Arc::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DmaLog> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn log(&self) -> Vec<DmaOp> {
        self.lock().ops.clone()
    }

    pub fn clear(&self) {
        self.lock().ops.clear();
    }

    /// Regions allocated through this wrapper and not freed: (count, bytes).
    pub fn outstanding(&self) -> (usize, usize) {
        let l = self.lock();
        (l.live.len(), l.live.values().sum())
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }
}

// SAFETY: every call is forwarded unchanged to the inner allocator, which upholds the contract; the wrapper only
// records descriptions.
unsafe impl<D: Dma> Dma for RecordingDma<D> {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        let r = self.inner.alloc(len, align);
        let mut l = self.lock();
        match &r {
            Ok(reg) => {
                l.ops.push(DmaOp::Alloc { len, align, iova: reg.iova() });
                l.live.insert(reg.iova(), len);
            }
            Err(e) => l.ops.push(DmaOp::AllocFailed { len, align, err: *e }),
        }
        r
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        self.inner.iova_of(cpu, len)
    }

    unsafe fn free(&self, region: DmaRegion) {
        {
            let mut l = self.lock();
            l.ops.push(DmaOp::Free { iova: region.iova(), len: region.len() });
            l.live.remove(&region.iova());
        }
        // SAFETY: the caller's guarantees for `region` are passed through unchanged.
        unsafe { self.inner.free(region) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim_device::SimDevice;
    use mlx5_core::prm::c;

    #[test]
    fn recording_mmio_logs_accesses_and_barriers() {
        let dev = SimDevice::default();
        let m = RecordingMmio::new(dev.mmio());
        let fw = m.read32(c::mlx5_init_seg::FW_REV.off);
        m.wmb();
        m.write32(0x100, 5);
        m.dma_rmb();
        let v = m.read64(c::mlx5_init_seg::FW_REV.off);
        let m2 = m.clone();
        m2.wc_start();
        assert_eq!(
            m.log(),
            vec![
                MmioAccess::Read32 { off: 0, val: fw },
                MmioAccess::Barrier(BarrierKind::Wmb),
                MmioAccess::Write32 { off: 0x100, val: 5 },
                MmioAccess::Barrier(BarrierKind::DmaRmb),
                MmioAccess::Read64 { off: 0, val: v },
                MmioAccess::Barrier(BarrierKind::WcStart),
            ]
        );
        m.clear();
        assert!(m.log().is_empty());
    }

    #[test]
    fn mem_mmio_is_big_endian_memory() {
        let m = MemMmio::new(4096);
        assert_eq!((m.len(), m.read64(0x800)), (4096, 0));
        m.write64(0x800, 0x0102_0304_0506_0708);
        assert_eq!((m.read32(0x800), m.read32(0x804)), (0x0102_0304, 0x0506_0708));
        m.write32(0xffc, 0xdead_beef);
        assert_eq!(m.read32(0xffc), 0xdead_beef);
        assert!(std::panic::catch_unwind(|| MemMmio::new(64).write32(64, 0)).is_err());
    }

    #[test]
    fn recording_dma_tracks_outstanding() {
        let dev = SimDevice::default();
        let d = RecordingDma::new(dev.dma());
        let a = d.alloc(100, 64).unwrap();
        let a_iova = a.iova();
        let b = d.alloc(8192, 4096).unwrap();
        assert_eq!(d.outstanding(), (2, 8292));
        assert_eq!(dev.dma_outstanding(), (2, 8292));
        // SAFETY: `a` came from this allocator and the device never saw it.
        unsafe { d.free(a) };
        assert_eq!(d.outstanding(), (1, 8192));
        assert!(matches!(d.alloc(8, 3), Err(DmaError::BadAlignment { align: 3 })));
        let log = d.log();
        assert_eq!(log[0], DmaOp::Alloc { len: 100, align: 64, iova: a_iova });
        assert_eq!(log[2], DmaOp::Free { iova: a_iova, len: 100 });
        assert!(matches!(log[3], DmaOp::AllocFailed { len: 8, align: 3, .. }));
        // SAFETY: as above.
        unsafe { d.free(b) };
        assert_eq!(dev.dma_outstanding(), (0, 0));
    }
}

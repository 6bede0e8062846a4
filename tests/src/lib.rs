//! Shared helpers for the integration tests: a passive register file and a heap DMA allocator with chosen bus
//! addresses, for tests that need exact bytes without a firmware model behind them.

use std::alloc::Layout;
use std::collections::{BTreeMap, VecDeque};
use std::ptr::NonNull;
use std::sync::Mutex;

use mlx5_core::hal::{Dma, DmaError, DmaRegion, Mmio};
use mlx5_core::prm::c::mlx5_init_seg as iseg;

/// A BAR that is only memory: reads return what was last written (or preset); writes are logged.
#[derive(Debug, Default)]
pub struct RegFile {
    regs: Mutex<BTreeMap<usize, u32>>,
    writes: Mutex<Vec<(usize, u32)>>,
}

impl RegFile {
    /// An init segment that passes the command queue's checks: command interface revision 5, 32 slots of 64 bytes.
    pub fn with_cmdq() -> Self {
        let r = Self::default();
        r.preset(iseg::CMDIF_REV_FW_SUB.off, 5 << 16);
        r.preset(iseg::CMDQ_ADDR_L_SZ.off, (5 << 4) | 6);
        r
    }

    pub fn preset(&self, off: usize, v: u32) {
        self.regs.lock().unwrap().insert(off, v);
    }

    pub fn writes(&self) -> Vec<(usize, u32)> {
        self.writes.lock().unwrap().clone()
    }
}

impl Mmio for RegFile {
    fn read32(&self, off: usize) -> u32 {
        self.regs.lock().unwrap().get(&off).copied().unwrap_or(0)
    }
    fn write32(&self, off: usize, v: u32) {
        self.writes.lock().unwrap().push((off, v));
        self.regs.lock().unwrap().insert(off, v);
    }
    fn read64(&self, off: usize) -> u64 {
        (u64::from(self.read32(off)) << 32) | u64::from(self.read32(off + 4))
    }
    fn write64(&self, off: usize, v: u64) {
        self.write32(off, (v >> 32) as u32);
        self.write32(off + 4, v as u32);
    }
}

/// Heap-backed DMA memory whose bus addresses come from a script (then from a bump counter).
#[derive(Debug, Default)]
pub struct HeapDma {
    script: Mutex<VecDeque<u64>>,
    next: Mutex<u64>,
    live: Mutex<BTreeMap<u64, (usize, usize, usize)>>,
}

impl HeapDma {
    pub fn scripted(iovas: &[u64]) -> Self {
        Self { script: Mutex::new(iovas.iter().copied().collect()), next: Mutex::new(0x4000_0000), ..Self::default() }
    }

    /// Copies `len` bytes at bus address `iova` (inside one live region) out of the memory.
    pub fn read(&self, iova: u64, len: usize) -> Vec<u8> {
        let live = self.live.lock().unwrap();
        let (&base, &(rlen, _, ptr)) = live.range(..=iova).next_back().expect("no region at that address");
        let off = (iova - base) as usize;
        assert!(off + len <= rlen, "read outside the region");
        // SAFETY: the range is inside a live allocation (checked above); tests read it while no command runs.
        unsafe { std::slice::from_raw_parts((ptr + off) as *const u8, len).to_vec() }
    }

    /// Writes bytes at bus address `iova` (inside one live region), as a device would.
    pub fn write(&self, iova: u64, data: &[u8]) {
        let live = self.live.lock().unwrap();
        let (&base, &(rlen, _, ptr)) = live.range(..=iova).next_back().expect("no region at that address");
        let off = (iova - base) as usize;
        assert!(off + data.len() <= rlen, "write outside the region");
        // SAFETY: the range is inside a live allocation (checked above); the test plays the device here.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (ptr + off) as *mut u8, data.len()) };
    }

    pub fn outstanding(&self) -> usize {
        self.live.lock().unwrap().len()
    }
}

// SAFETY: regions are fresh zeroed heap allocations with the requested alignment, live until `free`; their bus
// addresses are distinct (the script is the test's responsibility, the bump counter never repeats).
unsafe impl Dma for HeapDma {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        let layout = Layout::from_size_align(len.max(1), align).map_err(|_| DmaError::BadAlignment { align })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let cpu = NonNull::new(ptr).ok_or(DmaError::NoMemory { len })?;
        let iova = self.script.lock().unwrap().pop_front().unwrap_or_else(|| {
            let mut n = self.next.lock().unwrap();
            let v = n.next_multiple_of(align as u64);
            *n = v + len as u64;
            v
        });
        self.live.lock().unwrap().insert(iova, (len.max(1), align, ptr as usize));
        Ok(DmaRegion { cpu, iova, len })
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let p = cpu as usize;
        let live = self.live.lock().unwrap();
        live.iter().find_map(|(&iova, &(rlen, _, base))| {
            (p >= base && p.checked_add(len)? <= base + rlen).then(|| iova + (p - base) as u64)
        })
    }

    unsafe fn free(&self, region: DmaRegion) {
        let (len, align, _) = self.live.lock().unwrap().remove(&region.iova).expect("freeing a region twice");
        // SAFETY: allocated above with exactly this layout, and freed once (removed from `live`).
        unsafe { std::alloc::dealloc(region.cpu.as_ptr(), Layout::from_size_align_unchecked(len, align)) };
    }
}

/// Decodes a lower-case hex string.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// Encodes bytes as lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub mod soak;

//! Shared pieces of the fuzz targets: a BAR that is plain memory ([`Bar`]) with hooks that let a target play the
//! device, heap DMA memory with bus addresses ([`Mem`]), a virtual-time delay ([`VDelay`]), a work-request table
//! that records what the CQ decoder asked ([`Table`]), and checks shared by several targets.
//!
//! Everything here is single-threaded and deterministic: one fuzz input always runs the same way.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::alloc::Layout;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ptr::NonNull;

use mlx5_core::cq::{WcFlags, WcOpcode, WcStatus, WorkCompletion, WrTable};
use mlx5_core::hal::{DelayNs, Dma, DmaError, DmaRegion, Mmio};

pub use libfuzzer_sys::arbitrary::Unstructured;

/// Bytes of the BAR image: the initialization segment (8 KiB and some) and 16 UAR pages from 16 KiB on.
pub const BAR_LEN: usize = 0x4000 + 16 * 4096;
/// BAR offset of the first UAR page (the one queues' doorbells go to in these targets).
pub const UAR_OFF: usize = 0x4000;

/// A register write as the device saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write {
    pub off: usize,
    pub value: u64,
    /// 4 or 8 bytes.
    pub width: u8,
}

type WriteHook<'a> = Box<dyn FnMut(usize, u32) + 'a>;
type ReadHook<'a> = Box<dyn FnMut(usize, u32) -> u32 + 'a>;

/// A BAR that is only memory (big endian, as the device defines its registers). Every write is logged; a write
/// hook lets a target answer a doorbell, a read hook lets it change what a register reads (an `initializing` bit
/// that clears after some reads).
pub struct Bar<'a> {
    regs: RefCell<Vec<u8>>,
    writes: RefCell<Vec<Write>>,
    reads: Cell<u64>,
    on_write32: RefCell<Option<WriteHook<'a>>>,
    on_read32: RefCell<Option<ReadHook<'a>>>,
}

impl std::fmt::Debug for Bar<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bar").field("writes", &self.writes.borrow().len()).finish_non_exhaustive()
    }
}

impl Default for Bar<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> Bar<'a> {
    pub fn new() -> Self {
        Self {
            regs: RefCell::new(vec![0; BAR_LEN]),
            writes: RefCell::new(Vec::new()),
            reads: Cell::new(0),
            on_write32: RefCell::new(None),
            on_read32: RefCell::new(None),
        }
    }

    /// Copies `bytes` into the BAR image at `off` (clipped to the BAR).
    pub fn load(&self, off: usize, bytes: &[u8]) {
        let mut r = self.regs.borrow_mut();
        let end = (off + bytes.len()).min(BAR_LEN);
        if off < end {
            r[off..end].copy_from_slice(&bytes[..end - off]);
        }
    }

    pub fn preset32(&self, off: usize, v: u32) {
        self.load(off, &v.to_be_bytes());
    }

    /// The register image, without hooks or logging.
    pub fn peek32(&self, off: usize) -> u32 {
        let r = self.regs.borrow();
        r.get(off..off + 4).map_or(0, |b| u32::from_be_bytes(b.try_into().unwrap()))
    }

    pub fn on_write32(&self, hook: impl FnMut(usize, u32) + 'a) {
        *self.on_write32.borrow_mut() = Some(Box::new(hook));
    }

    pub fn on_read32(&self, hook: impl FnMut(usize, u32) -> u32 + 'a) {
        *self.on_read32.borrow_mut() = Some(Box::new(hook));
    }

    pub fn writes(&self) -> Vec<Write> {
        self.writes.borrow().clone()
    }

    pub fn writes_len(&self) -> usize {
        self.writes.borrow().len()
    }

    /// Writes logged from index `from` on.
    pub fn writes_since(&self, from: usize) -> Vec<Write> {
        self.writes.borrow()[from..].to_vec()
    }

    /// 32-bit reads so far.
    pub fn reads(&self) -> u64 {
        self.reads.get()
    }

    fn store(&self, off: usize, bytes: &[u8]) {
        let mut r = self.regs.borrow_mut();
        if let Some(dst) = r.get_mut(off..off + bytes.len()) {
            dst.copy_from_slice(bytes);
        }
    }
}

impl Mmio for Bar<'_> {
    fn read32(&self, off: usize) -> u32 {
        self.reads.set(self.reads.get() + 1);
        let v = self.peek32(off);
        match self.on_read32.borrow_mut().as_mut() {
            Some(h) => h(off, v),
            None => v,
        }
    }
    fn write32(&self, off: usize, v: u32) {
        self.writes.borrow_mut().push(Write { off, value: v.into(), width: 4 });
        self.store(off, &v.to_be_bytes());
        if let Some(h) = self.on_write32.borrow_mut().as_mut() {
            h(off, v);
        }
    }
    fn read64(&self, off: usize) -> u64 {
        (u64::from(self.read32(off)) << 32) | u64::from(self.read32(off + 4))
    }
    fn write64(&self, off: usize, v: u64) {
        // One access, as the trait requires: logged once, never split.
        self.writes.borrow_mut().push(Write { off, value: v, width: 8 });
        self.store(off, &v.to_be_bytes());
    }
}

/// Heap memory handed out as DMA regions with bus addresses of its own (fresh, never reused, a guard page apart).
/// `max_contig` makes larger allocations fail, so rings come in fragments. Whatever is still allocated when the
/// `Mem` is dropped (a queue leaks the pages of a command firmware never returned) is freed then.
#[derive(Debug)]
pub struct Mem {
    live: RefCell<BTreeMap<u64, (usize, usize, usize)>>,
    next: Cell<u64>,
    max_contig: Option<usize>,
    /// Refuse every allocation after this many (`None`: no limit).
    budget: Cell<Option<usize>>,
}

impl Default for Mem {
    fn default() -> Self {
        Self::new(None)
    }
}

impl Mem {
    pub fn new(max_contig: Option<usize>) -> Self {
        Self {
            live: RefCell::new(BTreeMap::new()),
            next: Cell::new(0x10_0000_0000),
            max_contig,
            budget: Cell::new(None),
        }
    }

    /// Allocations that will still succeed.
    pub fn set_budget(&self, n: Option<usize>) {
        self.budget.set(n);
    }

    /// The CPU address of `len` bytes at bus address `iova`, when they lie inside one live region.
    pub fn translate(&self, iova: u64, len: usize) -> Option<*mut u8> {
        let live = self.live.borrow();
        let (&base, &(rlen, _, ptr)) = live.range(..=iova).next_back()?;
        let off = usize::try_from(iova - base).ok()?;
        (off.checked_add(len)? <= rlen).then_some((ptr + off) as *mut u8)
    }

    /// Writes `data` at bus address `iova` as the device would; `false` (nothing written) outside live memory.
    pub fn write(&self, iova: u64, data: &[u8]) -> bool {
        match self.translate(iova, data.len()) {
            Some(p) => {
                // SAFETY: `p..p + len` is inside a live allocation (translate). The fuzz targets are single
                // threaded and hold no Rust reference into DMA memory while the "device" writes.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
                true
            }
            None => false,
        }
    }

    /// Reads `len` bytes at bus address `iova`.
    pub fn read(&self, iova: u64, len: usize) -> Option<Vec<u8>> {
        let p = self.translate(iova, len)?;
        // SAFETY: inside a live allocation (translate); see `write`.
        Some(unsafe { std::slice::from_raw_parts(p, len) }.to_vec())
    }

    /// Regions currently allocated.
    pub fn outstanding(&self) -> usize {
        self.live.borrow().len()
    }
}

// SAFETY: regions are fresh zeroed heap allocations with the requested alignment (at least the alignment asked for
// at both the CPU address and the bus address, since bus addresses are rounded up to it), live until `free` or the
// `Mem` is dropped; bus addresses never repeat. Plain host memory is coherent.
unsafe impl Dma for Mem {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if self.max_contig.is_some_and(|m| len > m) {
            return Err(DmaError::NoMemory { len });
        }
        if let Some(b) = self.budget.get() {
            if b == 0 {
                return Err(DmaError::NoMemory { len });
            }
            self.budget.set(Some(b - 1));
        }
        if len > 1 << 28 {
            return Err(DmaError::NoMemory { len });
        }
        let layout = Layout::from_size_align(len.max(1), align).map_err(|_| DmaError::BadAlignment { align })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let cpu = NonNull::new(ptr).ok_or(DmaError::NoMemory { len })?;
        let iova = self.next.get().next_multiple_of(align.max(4096) as u64);
        self.next.set(iova + len.max(1) as u64 + 4096);
        self.live.borrow_mut().insert(iova, (len.max(1), align, ptr as usize));
        Ok(DmaRegion { cpu, iova, len })
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let p = cpu as usize;
        self.live.borrow().iter().find_map(|(&iova, &(rlen, _, base))| {
            (p >= base && p.checked_add(len)? <= base + rlen).then(|| iova + (p - base) as u64)
        })
    }

    unsafe fn free(&self, region: DmaRegion) {
        let (len, align, _) = self.live.borrow_mut().remove(&region.iova).expect("DMA region freed twice");
        // SAFETY: allocated in `alloc` with exactly this layout and freed once (removed from `live`).
        unsafe { std::alloc::dealloc(region.cpu.as_ptr(), Layout::from_size_align_unchecked(len, align)) };
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        for (_, (len, align, ptr)) in std::mem::take(&mut *self.live.borrow_mut()) {
            // SAFETY: allocated in `alloc` with this layout and still live; nothing uses a `Mem` being dropped.
            unsafe { std::alloc::dealloc(ptr as *mut u8, Layout::from_size_align_unchecked(len, align)) };
        }
    }
}

/// A delay that only counts (virtual time), so waits cost nothing and are measured exactly.
#[derive(Debug, Default)]
pub struct VDelay {
    pub ns: u64,
}

impl DelayNs for VDelay {
    fn delay_ns(&mut self, ns: u32) {
        self.ns += u64::from(ns);
    }
}

/// What the CQ decoder asked a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    pub send: bool,
    pub qpn: u32,
    pub wqe_counter: u16,
    /// What the table answered.
    pub answer: Option<u64>,
}

/// A work-request table for the CQ decoder: QPs in `known` (all of them when `all_known`) answer with a fresh,
/// never-repeated `wr_id` per lookup; every lookup is recorded.
#[derive(Debug, Default)]
pub struct Table {
    pub known: Vec<u32>,
    pub all_known: bool,
    pub lookups: Vec<Lookup>,
    next: u64,
}

impl Table {
    /// Answers for the QPs in `known`, or for every QP when `all_known`.
    pub fn new(known: Vec<u32>, all_known: bool) -> Self {
        Self { known, all_known, lookups: Vec::new(), next: 0 }
    }

    fn answer(&mut self, send: bool, qpn: u32, wqe_counter: u16) -> Option<u64> {
        let answer = (self.all_known || self.known.contains(&qpn)).then(|| {
            self.next += 1;
            // Distinct from every small number a decoder could make up, and never repeated.
            0x5eed_0000_0000_0000 | self.next
        });
        self.lookups.push(Lookup { send, qpn, wqe_counter, answer });
        answer
    }
}

impl WrTable for Table {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        self.answer(true, qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, _srqn: u32, wqe_counter: u16) -> Option<u64> {
        self.answer(false, qpn, wqe_counter)
    }
    fn flush_one(&mut self, _cqn: u32, _dead: bool) -> Option<WorkCompletion> {
        // The targets decode CQEs; software completions are the soak's and the flush tests' business.
        None
    }
}

/// Every `ib_wc_flags` bit the decoder may set.
pub const KNOWN_WC_FLAGS: u32 =
    WcFlags::GRH.0 | WcFlags::WITH_IMM.0 | WcFlags::WITH_INVALIDATE.0 | WcFlags::IP_CSUM_OK.0 | WcFlags::WITH_VLAN.0;

/// Properties every work completion has, whatever CQE it came from.
pub fn assert_wc_well_formed(wc: &WorkCompletion) {
    assert!(wc.qp_num <= 0xff_ffff, "qp_num {:#x} wider than 24 bits", wc.qp_num);
    assert!(wc.src_qp <= 0xff_ffff, "src_qp {:#x} wider than 24 bits", wc.src_qp);
    assert_eq!(wc.wc_flags.0 & !KNOWN_WC_FLAGS, 0, "unknown wc_flags {:#x}", wc.wc_flags.0);
    assert!(wc.vlan_id <= 0xfff, "vlan_id {:#x}", wc.vlan_id);
    assert!(wc.sl <= 0xf, "sl {}", wc.sl);
    assert_eq!(wc.pkey_index, 0);
    if wc.status != WcStatus::Success {
        // An error completion carries only wr_id, status, vendor_err and qp_num.
        assert_eq!(
            (wc.opcode, wc.byte_len, wc.wc_flags, wc.imm_data, wc.src_qp),
            (WcOpcode::default(), 0, WcFlags::default(), 0, 0),
            "error completion with data: {wc:?}"
        );
    } else {
        assert_eq!(wc.vendor_err, 0);
    }
    if !wc.wc_flags.contains(WcFlags::WITH_IMM) {
        assert_eq!(wc.imm_data, 0, "immediate data without WITH_IMM: {wc:?}");
    }
    if !wc.wc_flags.contains(WcFlags::WITH_INVALIDATE) {
        assert_eq!(wc.invalidated_rkey, 0, "invalidated rkey without WITH_INVALIDATE: {wc:?}");
    }
    if !wc.wc_flags.contains(WcFlags::WITH_VLAN) {
        assert_eq!(wc.vlan_id, 0, "vlan without WITH_VLAN: {wc:?}");
    }
}

/// An integer in `range` from the input (the range's start when the input is used up).
pub fn int<T>(u: &mut Unstructured<'_>, range: std::ops::RangeInclusive<T>) -> T
where
    T: libfuzzer_sys::arbitrary::unstructured::Int + Copy,
{
    let lo = *range.start();
    u.int_in_range(range).unwrap_or(lo)
}

/// `n` bytes from the input, zero-padded when it runs out.
pub fn bytes<const N: usize>(u: &mut Unstructured<'_>) -> [u8; N] {
    let mut b = [0u8; N];
    let avail = u.len().min(N);
    if let Ok(s) = u.bytes(avail) {
        b[..avail].copy_from_slice(s);
    }
    b
}

pub fn flag(u: &mut Unstructured<'_>) -> bool {
    u.arbitrary::<bool>().unwrap_or(false)
}

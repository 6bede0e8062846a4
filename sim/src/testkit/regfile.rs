//! [`RegFile`], the kit's register file: a BAR image in plain memory with a log of every write and hooks through
//! which a test or fuzz target plays the device (command-queue tests, golden vectors, ring properties, fuzzing).

use std::cell::{Cell, RefCell};

use mlx5_core::hal::Mmio;
use mlx5_core::prm::c::mlx5_init_seg as iseg;

/// Bytes of the BAR image: the initialization segment (8 KiB and some) and 16 UAR pages from 16 KiB on.
pub const BAR_LEN: usize = 0x4000 + 16 * 4096;
/// BAR offset of the first UAR page (the one queues' doorbells go to in the fuzz targets).
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

/// A BAR that is only memory (big endian, as the device defines its registers): reads return what was last written
/// or preset (0 outside the image; writes there are logged but not kept). Every write is logged, a 64-bit one once;
/// a write hook lets a test answer a doorbell, a read hook change what a register reads (an `initializing` bit that
/// clears after some reads). Single-threaded: the hooks run on the caller's thread.
pub struct RegFile<'a> {
    regs: RefCell<Vec<u8>>,
    writes: RefCell<Vec<Write>>,
    reads: Cell<u64>,
    on_write32: RefCell<Option<WriteHook<'a>>>,
    on_read32: RefCell<Option<ReadHook<'a>>>,
}

impl std::fmt::Debug for RegFile<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegFile").field("writes", &self.writes.borrow().len()).finish_non_exhaustive()
    }
}

impl Default for RegFile<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'a> RegFile<'a> {
    /// A zeroed image of [`BAR_LEN`] bytes.
    pub fn new() -> Self {
        Self {
            regs: RefCell::new(vec![0; BAR_LEN]),
            writes: RefCell::new(Vec::new()),
            reads: Cell::new(0),
            on_write32: RefCell::new(None),
            on_read32: RefCell::new(None),
        }
    }

    /// An init segment that passes the command queue's checks: command interface revision 5, 32 slots of 64 bytes.
    pub fn with_cmdq() -> Self {
        let r = Self::new();
        r.preset32(iseg::CMDIF_REV_FW_SUB.off, 5 << 16);
        r.preset32(iseg::CMDQ_ADDR_L_SZ.off, (5 << 4) | 6);
        r
    }

    /// Copies `bytes` into the image at `off` (clipped to the image), unlogged.
    pub fn load(&self, off: usize, bytes: &[u8]) {
        let mut r = self.regs.borrow_mut();
        let end = off.saturating_add(bytes.len()).min(BAR_LEN);
        if off < end {
            r[off..end].copy_from_slice(&bytes[..end - off]);
        }
    }

    /// Sets a 32-bit register, unlogged.
    pub fn preset32(&self, off: usize, v: u32) {
        self.load(off, &v.to_be_bytes());
    }

    /// The register image, without hooks or counting.
    pub fn peek32(&self, off: usize) -> u32 {
        let r = self.regs.borrow();
        r.get(off..off + 4).map_or(0, |b| u32::from_be_bytes(b.try_into().expect("4 bytes")))
    }

    pub fn on_write32(&self, hook: impl FnMut(usize, u32) + 'a) {
        *self.on_write32.borrow_mut() = Some(Box::new(hook));
    }

    pub fn on_read32(&self, hook: impl FnMut(usize, u32) -> u32 + 'a) {
        *self.on_read32.borrow_mut() = Some(Box::new(hook));
    }

    /// Every write so far.
    pub fn writes(&self) -> Vec<Write> {
        self.writes.borrow().clone()
    }

    /// The writes as 32-bit words `(offset, value)`: a 64-bit write is its high word at `off`, then its low word at
    /// `off + 4`, as a 32-bit bus would carry it.
    pub fn words(&self) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        for w in self.writes.borrow().iter() {
            if w.width == 8 {
                out.push((w.off, (w.value >> 32) as u32));
                out.push((w.off + 4, w.value as u32));
            } else {
                out.push((w.off, w.value as u32));
            }
        }
        out
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
        if let Some(dst) = off.checked_add(bytes.len()).and_then(|end| r.get_mut(off..end)) {
            dst.copy_from_slice(bytes);
        }
    }
}

impl Mmio for RegFile<'_> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_logs_and_splits_words() {
        let r = RegFile::with_cmdq();
        assert_eq!(r.read32(iseg::CMDIF_REV_FW_SUB.off), 5 << 16);
        r.write64(0x4020, 0x0102_0304_0506_0708);
        r.write32(0x18, 1);
        assert_eq!(r.read64(0x4020), 0x0102_0304_0506_0708);
        assert_eq!(r.words(), [(0x4020, 0x0102_0304), (0x4024, 0x0506_0708), (0x18, 1)]);
        assert_eq!(r.writes()[0], Write { off: 0x4020, value: 0x0102_0304_0506_0708, width: 8 });
        r.write32(BAR_LEN, 7);
        assert_eq!((r.read32(BAR_LEN), r.writes_len()), (0, 3));
    }
}

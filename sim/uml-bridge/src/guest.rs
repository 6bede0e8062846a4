//! Guest (UML) memory as the device sees it: the regions SET_MEM_TABLE shared, addressed by UML physical address.

use std::ptr::NonNull;

/// An access that did not fall inside one shared region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfRange {
    pub addr: u64,
    pub len: usize,
}

/// Byte access to guest memory by guest address. Every access is bounds-checked: ring addresses and descriptor
/// addresses are written by the guest and may be anything.
pub trait GuestMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), OutOfRange>;
    fn write(&self, addr: u64, data: &[u8]) -> Result<(), OutOfRange>;

    fn read_u16(&self, addr: u64) -> Result<u16, OutOfRange> {
        let mut b = [0; 2];
        self.read(addr, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }
    fn read_u32(&self, addr: u64) -> Result<u32, OutOfRange> {
        let mut b = [0; 4];
        self.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn read_u64(&self, addr: u64) -> Result<u64, OutOfRange> {
        let mut b = [0; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

/// One region of a memory table: `len` bytes of guest memory from `guest_addr`, mapped at `host` in this process.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    pub guest_addr: u64,
    pub len: usize,
    pub host: NonNull<u8>,
}

/// The shared regions of guest memory.
#[derive(Debug, Default)]
pub struct MappedMem {
    regions: Vec<Region>,
}

// SAFETY: the regions are shared mappings owned by the bridge for its lifetime; they are plain memory any thread
// may access (the guest writes them concurrently anyway, which the byte copies below tolerate).
unsafe impl Send for MappedMem {}

impl MappedMem {
    /// A memory of the given regions.
    ///
    /// # Safety
    /// Each region's `host..host + len` must stay mapped, readable and writable for the life of this value.
    pub unsafe fn new(regions: Vec<Region>) -> Self {
        Self { regions }
    }

    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    fn host(&self, addr: u64, len: usize) -> Result<*mut u8, OutOfRange> {
        let oor = OutOfRange { addr, len };
        for r in &self.regions {
            let Some(off) = addr.checked_sub(r.guest_addr) else { continue };
            let end = off.checked_add(len as u64).ok_or(oor)?;
            if end <= r.len as u64 {
                // SAFETY: `off + len <= r.len`, inside the mapping the constructor's caller vouched for.
                return Ok(unsafe { r.host.as_ptr().add(off as usize) });
            }
        }
        Err(oor)
    }
}

impl GuestMem for MappedMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), OutOfRange> {
        let src = self.host(addr, buf.len())?;
        // SAFETY: `host` checked the range lies in a live mapping; `buf` is a distinct Rust buffer. The guest may
        // write these bytes concurrently, as it may with any DMA; the ring protocol orders the accesses that matter.
        unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), OutOfRange> {
        let dst = self.host(addr, data.len())?;
        // SAFETY: as in `read`, with the copy in the other direction.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }
}

/// Guest memory backed by a vector at a base address, for tests with byte fixtures.
#[derive(Debug)]
pub struct VecMem {
    pub base: u64,
    pub bytes: std::cell::RefCell<Vec<u8>>,
}

impl VecMem {
    pub fn new(base: u64, len: usize) -> Self {
        Self { base, bytes: std::cell::RefCell::new(vec![0; len]) }
    }

    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, OutOfRange> {
        let oor = OutOfRange { addr, len };
        let off = addr.checked_sub(self.base).ok_or(oor)? as usize;
        let end = off.checked_add(len).ok_or(oor)?;
        (end <= self.bytes.borrow().len()).then_some(off..end).ok_or(oor)
    }
}

impl GuestMem for VecMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), OutOfRange> {
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.bytes.borrow()[r]);
        Ok(())
    }

    fn write(&self, addr: u64, data: &[u8]) -> Result<(), OutOfRange> {
        let r = self.range(addr, data.len())?;
        self.bytes.borrow_mut()[r].copy_from_slice(data);
        Ok(())
    }
}

//! DMA buffers and memory regions (`ibv_mr`).

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::qp::Sge;

use crate::backend::AnyDma;
use crate::context::Context;
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::pd::{PdObj, ProtectionDomain};

/// A memory region without borrows: it keeps its PD counted as used until deregistered.
#[derive(Debug)]
pub(crate) struct MrObj {
    pd: Arc<PdObj>,
    /// The key until deregistered.
    mr: Mutex<Option<Mr>>,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
}

impl MrObj {
    /// `ibv_reg_mr` over `len` bytes of device-reachable memory at `addr`.
    pub(crate) fn reg(pd: &Arc<PdObj>, addr: *const u8, len: usize, access: Access) -> Result<MrObj> {
        let mut c = pd.ctx.dev.control();
        let guard = lock(&pd.pd);
        let p = guard.as_ref().ok_or_else(|| VerbsError::Invalid("protection domain deallocated".into()))?;
        let (hca, delay) = c.parts();
        let mr = hca.reg_mr(p, addr, len, access, delay)?;
        pd.users.fetch_add(1, Ordering::AcqRel);
        let (lkey, rkey, addr) = (mr.lkey, mr.rkey, mr.addr);
        Ok(MrObj { pd: pd.clone(), mr: Mutex::new(Some(mr)), lkey, rkey, addr })
    }

    /// `ibv_dereg_mr`. On failure the key may still exist: the PD stays in use and the memory must be kept.
    pub(crate) fn dereg(&self) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        let Some(mr) = lock(&self.mr).take() else { return Ok(()) };
        let (hca, delay) = c.parts();
        hca.dereg_mr(mr, delay).map_err(|e| VerbsError::Destroy(e.error))?;
        self.pd.users.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }
}

impl Context {
    /// DMA memory the device can reach, zero-filled, page aligned. Registered with [`ProtectionDomain::register`]
    /// it becomes a memory region. A large buffer is aligned to its size's power of two, up to 2 MiB, so its
    /// region's MTT can use pages that large and still fit one command (a 1 GiB region: 512 entries, not 262,144).
    pub fn alloc_buffer(&self, len: usize) -> Result<DmaBuffer<'_>> {
        let dma = self.dma();
        let align = len.checked_next_power_of_two().unwrap_or(usize::MAX).clamp(4096, 2 << 20);
        let region = dma.alloc(len.max(1), align).map_err(VerbsError::Dma)?;
        Ok(DmaBuffer { dma, region: ManuallyDrop::new(region), len, leaked: false, _ctx: PhantomData })
    }
}

impl<'ctx> ProtectionDomain<'ctx> {
    /// `ibv_reg_mr` over a whole buffer. The buffer stays borrowed (and so allocated) while the region lives;
    /// its bytes are reached through the region's `read` / `write`.
    ///
    /// ```
    /// use mlx5_verbs::{Access, Context};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mut buf = ctx.alloc_buffer(8192)?;
    /// let mr = pd.register(&mut buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    /// assert_eq!(mr.len(), 8192);
    /// assert_ne!(mr.lkey(), 0);
    /// // Remote write without local write is refused, as verbs refuses it.
    /// drop(mr);
    /// assert!(pd.register(&mut buf, Access::REMOTE_WRITE).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn register<'a>(&'a self, buf: &'a mut DmaBuffer<'ctx>, access: Access) -> Result<MemoryRegion<'a>> {
        let base = buf.region.cpu();
        let obj = MrObj::reg(&self.obj, base.as_ptr(), buf.len, access)?;
        Ok(MemoryRegion { obj, base: Span(base), len: buf.len, leaked: &mut buf.leaked, _pd: PhantomData })
    }
}

/// DMA memory of a context. While no memory region covers it, it is an ordinary byte slice (`Deref`); a region
/// borrows it mutably, so it can be neither touched directly nor freed while the device may reach it.
pub struct DmaBuffer<'ctx> {
    dma: AnyDma,
    /// `ManuallyDrop` only so that `drop` can move it into `Dma::free`.
    region: ManuallyDrop<DmaRegion>,
    len: usize,
    /// Set when deregistration failed: the key may still exist, so the memory is never given back.
    leaked: bool,
    _ctx: PhantomData<&'ctx Context>,
}

impl std::fmt::Debug for DmaBuffer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuffer").field("len", &self.len).field("iova", &self.region.iova()).finish()
    }
}

impl Deref for DmaBuffer<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region is live for self's lifetime and holds at least len bytes; no memory region covers it
        // while this shared borrow exists (registering takes &mut), so the device does not write it.
        unsafe { std::slice::from_raw_parts(self.region.cpu().as_ptr(), self.len) }
    }
}

impl DerefMut for DmaBuffer<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for deref, and &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.region.cpu().as_ptr(), self.len) }
    }
}

impl Drop for DmaBuffer<'_> {
    fn drop(&mut self) {
        if self.leaked {
            return;
        }
        // SAFETY: `drop` runs once and nothing reads `self.region` after this.
        let region = unsafe { ManuallyDrop::take(&mut self.region) };
        // SAFETY: the region came from this allocator and no memory key covers it any more (a region borrowing it
        // has been dropped and deregistered; a failed deregistration sets `leaked`).
        unsafe { self.dma.free(region) };
    }
}

/// Where a remote buffer is: its address and rkey, for RDMA and atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuf {
    pub addr: u64,
    pub rkey: u32,
}

/// The first byte of a registered buffer.
#[derive(Debug)]
struct Span(NonNull<u8>);

// SAFETY: the pointer names memory the region's buffer keeps allocated for the region's lifetime (it is borrowed
// mutably by the region), and every access through it is an atomic byte access (`MemoryRegion::read`/`write`), so
// using it from several threads races neither with itself nor with the buffer's own accessors.
unsafe impl Send for Span {}
// SAFETY: as for Send.
unsafe impl Sync for Span {}

/// A registered memory region (`ibv_mr`). Borrows its PD and its buffer. `Send` and `Sync`: its bytes are read and
/// written with atomic byte accesses, since other threads (and the device) may use them at the same time.
pub struct MemoryRegion<'a> {
    obj: MrObj,
    base: Span,
    len: usize,
    /// The buffer's `leaked` flag: borrowing it mutably keeps the whole buffer borrowed (so neither touched nor
    /// freed) for as long as the region lives, and lets a failed deregistration keep the memory forever.
    leaked: &'a mut bool,
    _pd: PhantomData<&'a ProtectionDomain<'a>>,
}

impl std::fmt::Debug for MemoryRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("mr", &self.obj).finish()
    }
}

impl MemoryRegion<'_> {
    pub fn lkey(&self) -> u32 {
        self.obj.lkey
    }

    pub fn rkey(&self) -> u32 {
        self.obj.rkey
    }

    /// The region's first virtual address (what a peer puts in `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.obj.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A scatter/gather entry for `len` bytes at `offset`.
    ///
    /// # Panics
    /// When the range is outside the region (a caller bug; the device would refuse it with a protection error).
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        assert!(offset.checked_add(len as usize).is_some_and(|e| e <= self.len()), "SGE outside the region");
        Sge { addr: self.addr() + offset as u64, length: len, lkey: self.lkey() }
    }

    /// The remote view of `offset` in this region, for a peer's RDMA.
    pub fn remote(&self, offset: usize) -> RemoteBuf {
        RemoteBuf { addr: self.addr() + offset as u64, rkey: self.rkey() }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(VerbsError::Invalid(format!(
                "{len} bytes at {offset} are outside a {}-byte region",
                self.len()
            )));
        }
        Ok(())
    }

    /// The byte at `offset`, which `check` has put inside the region.
    fn byte(&self, offset: usize) -> &AtomicU8 {
        // SAFETY: offset < len (checked by every caller), so the pointer is inside the live buffer, which stays
        // allocated while the region borrows it; a byte is always aligned for AtomicU8, and all accesses to it
        // while the region lives are atomic (the buffer itself cannot be touched, it is mutably borrowed).
        unsafe { AtomicU8::from_ptr(self.base.0.as_ptr().add(offset)) }
    }

    /// Copies `data` into the region at `offset`. The device may read it concurrently.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        for (i, b) in data.iter().enumerate() {
            self.byte(offset + i).store(*b, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Copies bytes out of the region at `offset`. The device may be writing it.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        for (i, b) in out.iter_mut().enumerate() {
            *b = self.byte(offset + i).load(Ordering::Relaxed);
        }
        Ok(())
    }

    /// `len` bytes at `offset` as a new vector (a convenience for tests and examples).
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn read_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.read(offset, &mut v).expect("range inside the region");
        v
    }

    /// `ibv_dereg_mr`, returning firmware's error (the buffer is then never freed).
    pub fn destroy(mut self) -> Result<()> {
        self.dereg()
    }

    fn dereg(&mut self) -> Result<()> {
        self.obj.dereg().inspect_err(|_| *self.leaked = true)
    }
}

impl Drop for MemoryRegion<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            log::error!("dereg MR: {e}; its buffer is kept");
        }
    }
}

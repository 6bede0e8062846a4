//! DMA buffers and memory regions (`ibv_mr`).

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::hca::Rereg as CoreRereg;
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::qp::Sge;

use crate::backend::{AnyDma, MapKey};
use crate::context::Context;
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::pd::{PdObj, ProtectionDomain};
use crate::shared::Control;

/// A memory region without borrows: it keeps its PD counted as used until deregistered.
#[derive(Debug)]
pub(crate) struct MrObj {
    pd: Arc<PdObj>,
    /// The key until deregistered.
    mr: Mutex<Option<Mr>>,
    /// The mapping of process memory it uses, if it covers process memory rather than a [`DmaBuffer`].
    map: Option<MapKey>,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
    pub(crate) addr: u64,
}

impl MrObj {
    /// `ibv_reg_mr` over `len` bytes of device-reachable memory at `addr`.
    pub(crate) fn reg(pd: &Arc<PdObj>, addr: *const u8, len: usize, access: Access) -> Result<MrObj> {
        let mut c = pd.ctx.dev.control();
        let guard = lock(&pd.pd);
        let p = guard.as_ref().ok_or(VerbsError::Destroyed { what: "protection domain" })?;
        let (hca, delay) = c.parts();
        let mr = hca.reg_mr(p, addr, len, access, delay)?;
        pd.users.fetch_add(1, Ordering::AcqRel);
        Ok(MrObj::made(pd, mr, None))
    }

    fn made(pd: &Arc<PdObj>, mr: Mr, map: Option<MapKey>) -> MrObj {
        let (lkey, rkey, addr) = (mr.lkey, mr.rkey, mr.addr);
        MrObj { pd: pd.clone(), mr: Mutex::new(Some(mr)), map, lkey, rkey, addr }
    }

    /// `ibv_reg_mr_iova` over `len` bytes of process memory at `ptr`, mapped for the device (or sharing the
    /// mapping that already holds them), at `iova` (the address by default).
    ///
    /// # Safety
    /// The bytes stay allocated, and their whole pages hold nothing the device must not reach, until the region
    /// is deregistered.
    pub(crate) unsafe fn reg_user(
        pd: &Arc<PdObj>,
        ptr: NonNull<u8>,
        len: usize,
        iova: Option<u64>,
        access: Access,
    ) -> Result<MrObj> {
        if len == 0 {
            return Err(VerbsError::Invalid("a memory region covers at least one byte".into()));
        }
        let dev = &pd.ctx.dev;
        if !dev.kind.pins_user_memory() {
            crate::usermem::check(ptr.as_ptr() as usize, len, access)?;
        }
        let dma = dev.kind.dma();
        let mut c = dev.control();
        let guard = lock(&pd.pd);
        let p = guard.as_ref().ok_or(VerbsError::Destroyed { what: "protection domain" })?;
        // SAFETY: the caller's duties are `acquire`'s.
        let key = unsafe { c.maps.acquire(&dma, ptr, len) }?;
        let Control { hca, delay, maps, .. } = &mut *c;
        let hca = hca.as_mut().ok_or(VerbsError::Destroyed { what: "device" })?;
        let made = match maps.view(key, ptr, len) {
            Some(view) => hca.reg_user_mr(p, view, iova, access, delay).map_err(VerbsError::from),
            None => Err(VerbsError::Invalid("memory outside its mapping".into())),
        };
        match made {
            Ok(mr) => {
                pd.users.fetch_add(1, Ordering::AcqRel);
                Ok(MrObj::made(pd, mr, Some(key)))
            }
            Err(e) => {
                maps.release(&dma, key);
                Err(e)
            }
        }
    }

    /// `ibv_dereg_mr`. On failure the key may still exist: the PD stays in use and a DMA buffer must be kept;
    /// process memory is unmapped all the same (its owner gets it back), so the device can no longer reach it.
    pub(crate) fn dereg(&self) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        let Some(mr) = lock(&self.mr).take() else { return Ok(()) };
        let (hca, delay) = c.parts();
        let res = hca.dereg_mr(mr, delay).map_err(|e| VerbsError::Destroy(e.error));
        if let Some(key) = self.map {
            let dma = self.pd.ctx.dev.kind.dma();
            c.maps.release(&dma, key);
        }
        res?;
        self.pd.users.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    }
}

impl Context {
    /// Ranges of process memory mapped for the device now (memory regions over overlapping memory share one).
    pub fn user_mappings(&self) -> usize {
        self.dev().control().maps.len()
    }

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
        Ok(MemoryRegion {
            obj,
            base: Span(base),
            len: buf.len,
            leaked: Some(&mut buf.leaked),
            writable: true,
            _borrows: PhantomData,
        })
    }

    /// `ibv_reg_mr` over ordinary process memory (a `Vec`, a `Box`, the stack, any offset and length), registered
    /// at its own address (`iova` = the address, as `ibv_reg_mr`). The memory is mapped for the device (on VFIO
    /// pinned and entered into the IOMMU, as rdma-core's mlx5_vfio does) and stays borrowed while the region
    /// lives; its bytes are reached through the region's [`read`](MemoryRegion::read) /
    /// [`write`](MemoryRegion::write). Memory the device cannot reach is [`VerbsError::Dma`] naming the range.
    ///
    /// ```
    /// use mlx5_verbs::{Access, Context};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mut mem = vec![0u8; 10_000];
    /// let mr = pd.reg_mr(&mut mem[3..9_000], Access::LOCAL_WRITE | Access::RELAXED_ORDERING)?;
    /// assert_eq!(mr.len(), 8_997);
    /// mr.write(0, b"hi")?;
    /// drop(mr);
    /// assert_eq!(&mem[3..5], b"hi");
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn reg_mr<'a>(&'a self, mem: &'a mut [u8], access: Access) -> Result<MemoryRegion<'a>> {
        self.reg_mr_at(mem, None, access)
    }

    /// `ibv_reg_mr_iova`: as [`ProtectionDomain::reg_mr`], with the region starting at virtual address `iova`
    /// (what work requests and peers name) instead of the memory's address. `iova` must agree with the memory's
    /// address within a 4 KiB page, as the MTT pages are chosen from both.
    pub fn reg_mr_iova<'a>(&'a self, mem: &'a mut [u8], iova: u64, access: Access) -> Result<MemoryRegion<'a>> {
        self.reg_mr_at(mem, Some(iova), access)
    }

    fn reg_mr_at<'a>(&'a self, mem: &'a mut [u8], iova: Option<u64>, access: Access) -> Result<MemoryRegion<'a>> {
        let len = mem.len();
        let ptr = NonNull::new(mem.as_mut_ptr()).ok_or(VerbsError::Invalid("null memory".into()))?;
        // SAFETY: the region borrows `mem` mutably for its whole life, so the bytes stay allocated and untouched
        // by other code until it is deregistered (its drop); the pages around them are the process's own memory,
        // as with any `ibv_reg_mr`.
        let obj = unsafe { MrObj::reg_user(&self.obj, ptr, len, iova, access) }?;
        Ok(MemoryRegion { obj, base: Span(ptr), len, leaked: None, writable: true, _borrows: PhantomData })
    }

    /// `ibv_reg_mr` over memory the device only reads (a send source, or a buffer peers read remotely), borrowed
    /// shared: several such regions may cover the same bytes, sharing one mapping. Write rights (local write,
    /// remote write, remote atomic) are refused (`EINVAL`), since the memory is borrowed read-only.
    ///
    /// ```
    /// use mlx5_verbs::{Access, Context};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let data = vec![7u8; 8192];
    /// let a = pd.reg_mr_readonly(&data, Access::REMOTE_READ)?;
    /// let b = pd.reg_mr_readonly(&data[100..200], Access::default())?;
    /// assert_ne!(a.lkey(), b.lkey());
    /// assert!(pd.reg_mr_readonly(&data, Access::LOCAL_WRITE).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn reg_mr_readonly<'a>(&'a self, mem: &'a [u8], access: Access) -> Result<MemoryRegion<'a>> {
        let writes = Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0;
        if access.0 & writes != 0 {
            return Err(VerbsError::Invalid("write access to memory borrowed read-only".into()));
        }
        let len = mem.len();
        let ptr = NonNull::new(mem.as_ptr().cast_mut()).ok_or(VerbsError::Invalid("null memory".into()))?;
        // SAFETY: the region borrows `mem` for its whole life, so the bytes stay allocated until it is
        // deregistered; without write rights the device never stores to them, so the shared borrow holds.
        let obj = unsafe { MrObj::reg_user(&self.obj, ptr, len, None, access) }?;
        Ok(MemoryRegion { obj, base: Span(ptr), len, leaked: None, writable: false, _borrows: PhantomData })
    }

    /// `ibv_reg_mr_iova` over raw memory, for callers that manage its life themselves (a C library). Regions over
    /// overlapping memory share one mapping; memory partly inside another region's mapping is refused.
    ///
    /// # Safety
    /// The `len` bytes at `addr` stay allocated until the region is deregistered (dropped or destroyed), and
    /// nothing in the process relies on them keeping their value while the region grants the device write rights
    /// (the device and peers may write them at any time); the whole pages covering them hold nothing the device
    /// must not reach.
    pub unsafe fn reg_mr_raw(
        &self,
        addr: *mut u8,
        len: usize,
        iova: Option<u64>,
        access: Access,
    ) -> Result<MemoryRegion<'_>> {
        let ptr = NonNull::new(addr).ok_or(VerbsError::Invalid("null memory".into()))?;
        // SAFETY: the caller's duties.
        let obj = unsafe { MrObj::reg_user(&self.obj, ptr, len, iova, access) }?;
        Ok(MemoryRegion { obj, base: Span(ptr), len, leaked: None, writable: true, _borrows: PhantomData })
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
    /// For a [`DmaBuffer`], its `leaked` flag: borrowing it mutably keeps the whole buffer borrowed (so neither
    /// touched nor freed) for as long as the region lives, and lets a failed deregistration keep the memory
    /// forever. Process memory is borrowed through `_borrows` and unmapped whatever happens.
    leaked: Option<&'a mut bool>,
    /// False for memory borrowed shared ([`ProtectionDomain::reg_mr_readonly`]): `write` is refused.
    writable: bool,
    _borrows: PhantomData<(&'a ProtectionDomain<'a>, &'a mut [u8])>,
}

impl std::fmt::Debug for MemoryRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("mr", &self.obj).finish()
    }
}

impl<'a> MemoryRegion<'a> {
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

    /// Copies `data` into the region at `offset`. The device may read it concurrently. Refused for memory
    /// registered read-only ([`ProtectionDomain::reg_mr_readonly`]), which the caller borrowed shared.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        if !self.writable {
            return Err(VerbsError::Invalid("the region's memory is borrowed read-only".into()));
        }
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
        self.obj.dereg().inspect_err(|_| {
            if let Some(l) = self.leaked.as_deref_mut() {
                *l = true;
            }
        })
    }

    /// The access rights granted.
    pub fn access(&self) -> Access {
        lock(&self.obj.mr).as_ref().map_or(Access::default(), |m| m.access)
    }

    /// `ibv_rereg_mr`: changes the region's memory (`IBV_REREG_MR_CHANGE_TRANSLATION`, process memory at its
    /// address or `iova`), protection domain (`_CHANGE_PD`) and access (`_CHANGE_ACCESS`), as `req` says. A new
    /// key is made and the old one destroyed, so both keys change. On failure the old region comes back,
    /// still registered as it was. The new region keeps the old one's borrows (one lifetime covers the PD and the
    /// memory), so old memory is given back to the caller when the new region goes.
    ///
    /// ```
    /// use mlx5_verbs::{Access, Context, Rereg};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mut a = vec![0u8; 4096];
    /// let mut b = vec![0u8; 100];
    /// let mr = pd.reg_mr(&mut a, Access::LOCAL_WRITE)?;
    /// let mr = mr.rereg(Rereg { access: Some(Access::LOCAL_WRITE | Access::REMOTE_READ), ..Rereg::default() })
    ///     .map_err(|e| e.error)?;
    /// assert!(mr.access().contains(Access::REMOTE_READ));
    /// let mr = mr.rereg(Rereg { memory: Some((&mut b, None)), ..Rereg::default() }).map_err(|e| e.error)?;
    /// assert_eq!(mr.len(), 100);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn rereg<'b>(mut self, req: Rereg<'b>) -> std::result::Result<MemoryRegion<'b>, Box<ReregFailure<'a>>>
    where
        'a: 'b,
    {
        let new_mem = req.memory.as_ref().map(|(m, _)| (m.as_ptr().cast_mut(), m.len()));
        let writes = Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0;
        if !self.writable && new_mem.is_none() && req.access.is_some_and(|a| a.0 & writes != 0) {
            // Write rights over memory borrowed shared would let the device store to it.
            let error = VerbsError::Invalid("write access to memory borrowed read-only".into());
            return Err(Box::new(ReregFailure { mr: self, error }));
        }
        match self.rereg_inner(req) {
            Ok(obj) => {
                let (base, len, leaked, writable) = match new_mem {
                    // New memory: the old buffer (if any) is covered by no key any more and may go.
                    Some((p, len)) => (Span(NonNull::new(p).unwrap_or(NonNull::dangling())), len, None, true),
                    None => (Span(self.base.0), self.len, self.leaked.take(), self.writable),
                };
                // `self` holds no key any more: dropping it deregisters nothing.
                Ok(MemoryRegion { obj, base, len, leaked, writable, _borrows: PhantomData })
            }
            Err(error) => Err(Box::new(ReregFailure { mr: self, error })),
        }
    }

    fn rereg_inner(&self, req: Rereg<'_>) -> Result<MrObj> {
        let memory = match &req.memory {
            Some((m, iova)) => {
                let p = NonNull::new(m.as_ptr().cast_mut()).ok_or(VerbsError::Invalid("null memory".into()))?;
                Some((p, m.len(), *iova))
            }
            None => None,
        };
        // SAFETY: the new region borrows the memory mutably for its whole life ('b), as `reg_mr` does.
        unsafe { self.obj.rereg(memory, req.pd.map(|p| &p.obj), req.access) }
    }
}

impl MrObj {
    /// `ibv_rereg_mr` on the key this object holds: new process memory (`memory`: address, length, `iova`),
    /// protection domain and access, each when given. A new key is made and the old one destroyed; on success
    /// this object holds no key any more and the returned one does; on failure this object keeps its key as it
    /// was.
    ///
    /// # Safety
    /// New memory stays allocated, and its whole pages hold nothing the device must not reach, until the
    /// returned region is deregistered.
    pub(crate) unsafe fn rereg(
        &self,
        memory: Option<(NonNull<u8>, usize, Option<u64>)>,
        pd: Option<&Arc<PdObj>>,
        access: Option<Access>,
    ) -> Result<MrObj> {
        let old_pd = &self.pd;
        let new_pd = pd.map_or_else(|| old_pd.clone(), Arc::clone);
        if !Arc::ptr_eq(&new_pd.ctx.dev, &old_pd.ctx.dev) {
            return Err(VerbsError::Invalid("the protection domain is another device's".into()));
        }
        if memory.is_some_and(|(_, len, _)| len == 0) {
            return Err(VerbsError::Invalid("a memory region covers at least one byte".into()));
        }
        let dev = &old_pd.ctx.dev;
        let dma = dev.kind.dma();
        let mut c = dev.control();
        let mut slot = lock(&self.mr);
        let mr = slot.take().ok_or(VerbsError::Destroyed { what: "memory region" })?;
        if let Some((p, len, _)) = memory.filter(|_| !dev.kind.pins_user_memory()) {
            // New memory is pinned with the access it will have: the new one, or the region's own.
            if let Err(e) = crate::usermem::check(p.as_ptr() as usize, len, access.unwrap_or(mr.access)) {
                *slot = Some(mr);
                return Err(e.into());
            }
        }
        let mem = match memory {
            // SAFETY: the caller keeps the memory as `acquire` requires.
            Some((p, len, iova)) => match unsafe { c.maps.acquire(&dma, p, len) } {
                Ok(k) => Some((p, len, k, iova)),
                Err(e) => {
                    *slot = Some(mr);
                    return Err(e);
                }
            },
            None => None,
        };
        let pd_guard = lock(&new_pd.pd);
        let Control { hca, delay, maps, .. } = &mut *c;
        let hca = hca.as_mut().ok_or(VerbsError::Destroyed { what: "device" })?;
        let Some(p) = pd_guard.as_ref() else {
            *slot = Some(mr);
            if let Some((_, _, k, _)) = mem {
                maps.release(&dma, k);
            }
            return Err(VerbsError::Destroyed { what: "protection domain" });
        };
        let view = mem.and_then(|(ptr, len, k, iova)| Some((maps.view(k, ptr, len)?, iova)));
        let core_req = CoreRereg { translation: view, pd: pd.map(|_| p), access };
        match hca.rereg_mr(mr, core_req, delay) {
            Ok(new) => {
                // The old key is gone: its mapping share (when the memory changed) and its PD count go with it.
                let map = match mem {
                    Some((_, _, k, _)) => {
                        if let Some(old) = self.map {
                            maps.release(&dma, old);
                        }
                        Some(k)
                    }
                    None => self.map,
                };
                new_pd.users.fetch_add(1, Ordering::AcqRel);
                old_pd.users.fetch_sub(1, Ordering::AcqRel);
                Ok(MrObj::made(&new_pd, new, map))
            }
            Err(e) => {
                *slot = Some(e.mr);
                if let Some(n) = e.new {
                    // Both keys live: the old one stays (as the caller had it), the new one goes.
                    if let Err(d) = hca.dereg_mr(n, delay) {
                        log::error!("re-registration: the new key {:#x} could not be destroyed", d.obj.lkey);
                    }
                }
                if let Some((_, _, k, _)) = mem {
                    maps.release(&dma, k);
                }
                Err(e.error.into())
            }
        }
    }
}

/// What [`MemoryRegion::rereg`] asks to change; `None` keeps the old value. At least one must be given.
#[derive(Debug, Default)]
pub struct Rereg<'b> {
    /// `IBV_REREG_MR_CHANGE_TRANSLATION`: new process memory, at its address or at the given `iova`.
    pub memory: Option<(&'b mut [u8], Option<u64>)>,
    /// `IBV_REREG_MR_CHANGE_PD`.
    pub pd: Option<&'b ProtectionDomain<'b>>,
    /// `IBV_REREG_MR_CHANGE_ACCESS`.
    pub access: Option<Access>,
}

/// A refused [`MemoryRegion::rereg`]: the region, registered as before, and why.
#[derive(Debug)]
pub struct ReregFailure<'a> {
    pub mr: MemoryRegion<'a>,
    pub error: VerbsError,
}

impl Drop for MemoryRegion<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            log::error!("dereg MR: {e}; its buffer is kept");
        }
    }
}

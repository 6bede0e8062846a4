//! The simulated IOVA space: host allocations given fresh, never reused bus addresses, and the checked
//! translation the device side uses for every DMA access.
//!
//! Process memory the driver did not allocate is made reachable with `Dma::map_user`: the pages covering it get
//! a fresh IOVA range placed as the memory's own alignment allows (see [`DmaSpace::map_user`]), and freeing the
//! region unmaps it, so a later device access to those IOVAs faults like any access to unmapped memory.
//!
//! The process may unmap such memory (or map it read-only) while a memory key still names it: the device must
//! not crash the process then, whatever a registration says. Accesses to `map_user` regions therefore go
//! through the kernel (`process_vm_readv` / `process_vm_writev` on the process itself, which answer `EFAULT`
//! where a plain copy would raise `SIGSEGV`), and a refused access is a fault the datapath turns into the
//! device's error (a protection error CQE, a remote access NAK). Memory the simulator allocated, and a guest's
//! RAM (`map_fixed`), cannot go away under it and keeps the plain copies.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::ptr::{self, NonNull};
use std::sync::atomic::{fence, Ordering};

use mlx5_core::hal::{DmaError, DmaRegion};

/// First IOVA handed out. Far from zero so a null or small bus address is always a fault.
pub(crate) const IOVA_BASE: u64 = 0x1_0000_0000;
/// IOVA granule: every region starts on at least this boundary, like an IOMMU mapping.
pub(crate) const IOVA_PAGE: u64 = 4096;

/// A device access that did not fall entirely inside one live DMA region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaFault {
    pub iova: u64,
    pub len: usize,
    pub write: bool,
}

#[derive(Debug)]
struct Region {
    cpu: NonNull<u8>,
    len: usize,
    /// The allocation behind an allocated region; `None` for process memory mapped with `map_user`, which is the
    /// caller's to free.
    layout: Option<Layout>,
    /// Process memory lent with `map_user`: the program may unmap it at any time, so it is reached only with
    /// accesses that cannot fault the process ([`user_copy`]).
    user: bool,
}

/// The largest alignment `map_user` preserves between a mapping's CPU and bus addresses (1 GiB, the largest MTT
/// page the driver uses below `MR_MAX_PAGE_SHIFT`).
pub(crate) const USER_MAP_MAX_ALIGN: u64 = 1 << 30;

// SAFETY: a Region is the allocator's record of a heap block; it is only dereferenced under the device lock, and
// the block itself is not tied to the thread that allocated it.
unsafe impl Send for Region {}

/// A translation cache entry: (IOVA page number it was filled for, region IOVA, region length, host address,
/// whether the region is lent process memory). The host address is a pointer, not an integer, so what
/// `translate` returns keeps the allocation's provenance.
#[derive(Debug, Clone, Copy)]
struct Recent(u64, u64, usize, *mut u8, bool);

// SAFETY: an entry is a copy of a live region's description, used only under the device lock like the region.
unsafe impl Send for Recent {}

/// An entry that matches nothing (no IOVA page has this number).
const NO_ENTRY: Recent = Recent(u64::MAX, 0, 0, ptr::null_mut(), false);

/// Where a device access lands: the host address, and whether it is lent process memory (reached with
/// [`user_copy`] only).
#[derive(Debug, Clone, Copy)]
struct Target {
    p: *mut u8,
    user: bool,
}

/// Entries of the translation cache, indexed by the low bits of the IOVA page number: the datapath touches a
/// handful of regions (queue buffers, doorbell records, a CQ ring, registered memory) over and over.
const RECENT: usize = 64;

/// Live regions by IOVA (and by host address), the bump pointer and the fault log.
#[derive(Debug)]
pub(crate) struct DmaSpace {
    regions: BTreeMap<u64, Region>,
    /// The region each recently translated IOVA page lies in; cleared whenever a region is freed, so an entry
    /// always names a live region.
    recent: [Cell<Recent>; RECENT],
    /// Host address of each live region's first byte -> its IOVA, for `Dma::iova_of`.
    by_cpu: BTreeMap<usize, u64>,
    next_iova: u64,
    pub(crate) faults: Vec<DmaFault>,
    /// The largest region `alloc` grants ([`crate::config::SimConfig::dma_max_contig`]); `None`: no limit.
    pub(crate) max_contig: Option<usize>,
}

impl DmaSpace {
    pub(crate) fn new(max_contig: Option<usize>) -> Self {
        Self {
            regions: BTreeMap::new(),
            recent: std::array::from_fn(|_| Cell::new(NO_ENTRY)),
            by_cpu: BTreeMap::new(),
            next_iova: IOVA_BASE,
            faults: Vec::new(),
            max_contig,
        }
    }

    pub(crate) fn alloc(&mut self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if !align.is_power_of_two() {
            return Err(DmaError::BadAlignment { align });
        }
        // A fragmented host has no contiguous block this large: the driver must build the buffer from pages.
        if self.max_contig.is_some_and(|max| len > max) {
            return Err(DmaError::NoMemory { len });
        }
        // std::alloc rejects zero-sized layouts; a zero-length region still gets one real byte behind it.
        let layout = Layout::from_size_align(len.max(1), align).map_err(|_| DmaError::BadAlignment { align })?;
        let ialign = (align as u64).max(IOVA_PAGE);
        let iova = self.next_iova.checked_next_multiple_of(ialign).ok_or(DmaError::NoMemory { len })?;
        // Leave an unmapped guard page after every region so an overrun faults instead of hitting a neighbour.
        let span = (len as u64).checked_next_multiple_of(IOVA_PAGE).ok_or(DmaError::NoMemory { len })?;
        let next = iova.checked_add(span).and_then(|v| v.checked_add(IOVA_PAGE)).ok_or(DmaError::NoMemory { len })?;
        // SAFETY: the layout has a non-zero size (len.max(1)) and a valid power-of-two alignment.
        let p = unsafe { alloc_zeroed(layout) };
        let cpu = NonNull::new(p).ok_or(DmaError::NoMemory { len })?;
        self.next_iova = next;
        self.regions.insert(iova, Region { cpu, len, layout: Some(layout), user: false });
        self.by_cpu.insert(cpu.as_ptr() as usize, iova);
        // SAFETY: `cpu` is a fresh zeroed allocation of at least `len` bytes that only `free` deallocates (a space
        // dropped with it outstanding keeps it), `iova` is a fresh address translated to it alone.
        Ok(unsafe { DmaRegion::from_raw_parts(cpu, iova, len) })
    }

    /// Makes the `len` bytes of process memory at `cpu` reachable by the device (`Dma::map_user`).
    ///
    /// The IOVA range is fresh, and placed so that the bus address of the first covering page agrees with the CPU
    /// address in exactly the bits its alignment has (up to [`USER_MAP_MAX_ALIGN`]) and differs in the next one: a
    /// buffer whose page is 64 KiB aligned (and not 128 KiB) can use 64 KiB MTT pages and no larger, as if backed
    /// by memory contiguous in such blocks. Only the `len` bytes themselves are translated, not the rest of their
    /// pages: a real IOMMU would expose the whole pages, but here the rest may be other objects of the test
    /// process, and a stray device access must fault instead of overwriting them.
    ///
    /// Refused with `Unreachable` (nothing mapped): an empty or wrapping range, one at page 0, or one overlapping
    /// a live region (allocated or mapped).
    pub(crate) fn map_user(&mut self, cpu: NonNull<u8>, len: usize) -> Result<DmaRegion, DmaError> {
        let addr = cpu.as_ptr() as usize;
        let refused = DmaError::Unreachable { addr, len };
        let end = addr.checked_add(len).filter(|_| len > 0).ok_or(refused)?;
        let page_base = (addr as u64) & !(IOVA_PAGE - 1);
        if page_base == 0 {
            return Err(refused);
        }
        // Regions never overlap, so the last one starting before `end` is the only one that can reach into the
        // range.
        if let Some((&base, &iova)) = self.by_cpu.range(..end).next_back() {
            if self.regions.get(&iova).is_some_and(|r| base + r.len.max(1) > addr) {
                return Err(refused);
            }
        }
        let off = addr as u64 - page_base;
        let span = (end as u64).checked_next_multiple_of(IOVA_PAGE).ok_or(refused)? - page_base;
        let align = (1u64 << page_base.trailing_zeros()).min(USER_MAP_MAX_ALIGN);
        // Aligned to twice the CPU page's alignment: the two agree below it and differ in its bit.
        let base = self.next_iova.checked_next_multiple_of(2 * align).ok_or(refused)?;
        let next = base.checked_add(span).and_then(|v| v.checked_add(IOVA_PAGE)).ok_or(refused)?;
        self.next_iova = next;
        let iova = base + off;
        self.regions.insert(iova, Region { cpu, len, layout: None, user: true });
        self.by_cpu.insert(addr, iova);
        // SAFETY: the caller of `Dma::map_user` vouches that the bytes stay valid and are covered by no other
        // region until this one is freed (the overlap check above catches the regions this space knows); `iova`
        // is a fresh address translated to them alone.
        Ok(unsafe { DmaRegion::from_raw_parts(cpu, iova, len) })
    }

    /// Makes the `len` bytes at `cpu` reachable by the device at the bus address `iova` chosen by the caller: the
    /// memory of another system (a UML guest's RAM shared over vhost-user) whose driver uses its own physical
    /// addresses as bus addresses. Refused with `Unreachable` (nothing mapped) when empty, wrapping, or
    /// overlapping a live region by bus address.
    pub(crate) fn map_fixed(&mut self, iova: u64, cpu: NonNull<u8>, len: usize) -> Result<DmaRegion, DmaError> {
        let refused = DmaError::Unreachable { addr: cpu.as_ptr() as usize, len };
        let end = iova.checked_add(len as u64).filter(|_| len > 0).ok_or(refused)?;
        if let Some((&base, r)) = self.regions.range(..end).next_back() {
            if base + r.len.max(1) as u64 > iova {
                return Err(refused);
            }
        }
        // Later allocations stay above the guest's memory.
        self.next_iova = self.next_iova.max(end.checked_next_multiple_of(IOVA_PAGE).ok_or(refused)? + IOVA_PAGE);
        self.regions.insert(iova, Region { cpu, len, layout: None, user: false });
        self.by_cpu.insert(cpu.as_ptr() as usize, iova);
        // SAFETY: the caller of `SimDevice::map_guest_memory` vouches that the bytes stay valid for the device's
        // life; the bus range overlaps no live region (checked above).
        Ok(unsafe { DmaRegion::from_raw_parts(cpu, iova, len) })
    }

    /// Takes away a `map_fixed` translation of exactly `iova..iova + len` (an IOMMU unmap); `false`, changing
    /// nothing, when there is none.
    pub(crate) fn unmap_fixed(&mut self, iova: u64, len: usize) -> bool {
        match self.regions.get(&iova) {
            Some(r) if r.len == len && r.layout.is_none() && !r.user => {}
            _ => return false,
        }
        if let Some(r) = self.regions.remove(&iova) {
            self.by_cpu.remove(&(r.cpu.as_ptr() as usize));
        }
        for e in &self.recent {
            e.set(NO_ENTRY);
        }
        true
    }

    /// Releases a region; `Err` when it is not a live region with this exact description (nothing is freed then).
    pub(crate) fn free(&mut self, region: &DmaRegion) -> Result<(), ()> {
        match self.regions.get(&region.iova()) {
            Some(r) if r.cpu == region.cpu() && r.len == region.len() => {}
            _ => return Err(()),
        }
        let r = self.regions.remove(&region.iova()).ok_or(())?;
        self.by_cpu.remove(&(r.cpu.as_ptr() as usize));
        for e in &self.recent {
            e.set(NO_ENTRY);
        }
        if let Some(layout) = r.layout {
            // SAFETY: `r.cpu` was returned by `alloc_zeroed(layout)` in `alloc` and is removed from the map, so it
            // is deallocated exactly once with the same layout.
            unsafe { dealloc(r.cpu.as_ptr(), layout) };
        }
        // A mapped region's memory is the caller's: removing the translation is all there is to undo.
        Ok(())
    }

    /// Host address of `iova..iova + len` when the whole range lies inside one live region.
    #[inline]
    fn translate(&self, iova: u64, len: usize) -> Option<Target> {
        // The region last found for this IOVA page first: the same answer as the lookup below (an entry is a live
        // region, and the same bounds check applies), without walking the tree.
        let page = iova / IOVA_PAGE;
        let Recent(tag, base, rlen, cpu, user) = self.recent[page as usize % RECENT].get();
        let off = iova.wrapping_sub(base);
        if tag == page && iova >= base && off < rlen as u64 && len as u64 <= rlen as u64 - off {
            // SAFETY: `off + len <= rlen`, the length of a live allocation at `cpu` (entries are cleared when any
            // region is freed), so the offset stays inside it.
            return Some(Target { p: unsafe { cpu.add(off as usize) }, user });
        }
        self.translate_slow(iova, len)
    }

    /// The tree lookup behind [`DmaSpace::translate`]; remembers the region found for the IOVA's page.
    fn translate_slow(&self, iova: u64, len: usize) -> Option<Target> {
        let (&base, r) = self.regions.range(..=iova).next_back()?;
        let off = iova - base;
        let end = off.checked_add(len as u64)?;
        if end > r.len as u64 {
            return None;
        }
        let page = iova / IOVA_PAGE;
        self.recent[page as usize % RECENT].set(Recent(page, base, r.len, r.cpu.as_ptr(), r.user));
        // SAFETY: `off + len <= r.len` (checked above), so the offset stays inside the allocation.
        Some(Target { p: unsafe { r.cpu.as_ptr().add(off as usize) }, user: r.user })
    }

    /// Copies `buf.len()` bytes at `iova` without recording a fault (observation by tests, not device DMA).
    pub(crate) fn peek(&self, iova: u64, buf: &mut [u8]) -> bool {
        self.try_read(iova, buf)
    }

    /// A device read whose failure the caller reports itself, so none is recorded here: an access through a
    /// memory key to memory that is no longer mapped is the key's protection error, not a DMA fault.
    #[inline]
    pub(crate) fn try_read(&self, iova: u64, buf: &mut [u8]) -> bool {
        self.translate(iova, buf.len()).is_some_and(|src| copy_from(src, buf))
    }

    /// A device write whose failure the caller reports itself (see [`DmaSpace::try_read`]).
    #[inline]
    pub(crate) fn try_write(&mut self, iova: u64, data: &[u8]) -> bool {
        self.translate(iova, data.len()).is_some_and(|dst| copy_to(dst, data))
    }

    /// The IOVA of the host bytes `cpu..cpu + len` when they lie inside one live region.
    pub(crate) fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        // Only the address is compared; nothing is dereferenced.
        let addr = cpu as usize;
        let (&base, &iova) = self.by_cpu.range(..=addr).next_back()?;
        let r = self.regions.get(&iova)?;
        let off = addr - base;
        (off.checked_add(len)? <= r.len).then_some(iova + off as u64)
    }

    /// Whether the device could access `iova..iova + len`, without recording a fault.
    #[inline]
    pub(crate) fn is_mapped(&self, iova: u64, len: usize) -> bool {
        self.translate(iova, len).is_some()
    }

    /// Live regions: (count, bytes).
    pub(crate) fn outstanding(&self) -> (usize, usize) {
        (self.regions.len(), self.regions.values().map(|r| r.len).sum())
    }

    /// Device read of `buf.len()` bytes at `iova`.
    ///
    /// Device DMA is modelled outside the Rust memory model, as real DMA is: the bytes are copied with
    /// `ptr::copy_nonoverlapping` under the device lock while the CPU may hold pointers into the same memory.
    /// The command protocol (owner bit plus barriers) is what keeps the two sides off the same bytes.
    /// Lent process memory the program unmapped (or made read-only, for a write) is a fault too, not a crash.
    #[inline]
    pub(crate) fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), DmaFault> {
        match self.translate(iova, buf.len()) {
            Some(src) if copy_from(src, buf) => Ok(()),
            _ => Err(self.fault(iova, buf.len(), false)),
        }
    }

    /// Device write of `data` at `iova` (see [`DmaSpace::read`] for the memory model).
    #[inline]
    pub(crate) fn write(&mut self, iova: u64, data: &[u8]) -> Result<(), DmaFault> {
        match self.translate(iova, data.len()) {
            Some(dst) if copy_to(dst, data) => Ok(()),
            _ => Err(self.fault(iova, data.len(), true)),
        }
    }

    /// Device write of one byte with a volatile store: the owner byte the CPU polls.
    #[inline]
    pub(crate) fn write_u8_volatile(&mut self, iova: u64, v: u8) -> Result<(), DmaFault> {
        match self.translate(iova, 1) {
            Some(dst) if dst.user => self.write(iova, &[v]),
            Some(dst) => {
                // SAFETY: `translate` checked that the byte lies inside a live allocation the simulator owns.
                unsafe { dst.p.write_volatile(v) };
                Ok(())
            }
            None => Err(self.fault(iova, 1, true)),
        }
    }

    /// Device write of an entry the driver polls by the byte after `body` (a CQE's `op_own`): `body` first, then,
    /// after a release fence (the device's write ordering), `flag` with a volatile store, so a driver that sees
    /// the flag sees the whole entry. One translation for both when the entry is mapped; otherwise the two
    /// accesses fault as they would one by one.
    #[inline]
    pub(crate) fn write_then_flag(&mut self, iova: u64, body: &[u8], flag: u8) -> Result<(), DmaFault> {
        let dst = match self.translate(iova, body.len() + 1) {
            Some(dst) if !dst.user => dst.p,
            _ => {
                self.write(iova, body)?;
                fence(Ordering::Release);
                return self.write_u8_volatile(iova + body.len() as u64, flag);
            }
        };
        // SAFETY: `translate` checked that `dst..dst + body.len() + 1` lies inside a live allocation the simulator
        // owns, and `body` is a distinct Rust buffer, so the ranges do not overlap.
        unsafe { ptr::copy_nonoverlapping(body.as_ptr(), dst, body.len()) };
        fence(Ordering::Release);
        // SAFETY: the byte after `body`, inside the same checked range.
        unsafe { dst.add(body.len()).write_volatile(flag) };
        Ok(())
    }

    fn fault(&mut self, iova: u64, len: usize, write: bool) -> DmaFault {
        let f = DmaFault { iova, len, write };
        self.faults.push(f);
        f
    }
}

/// Copies the bytes at `src` into `buf`: a plain copy from the simulator's own memory, [`user_copy`] from lent
/// process memory. False when the process no longer has readable memory there.
#[inline]
fn copy_from(src: Target, buf: &mut [u8]) -> bool {
    if src.user {
        return user_copy(src.p, buf.as_mut_ptr(), buf.len(), false);
    }
    // SAFETY: `translate` checked that `src..src + buf.len()` lies inside a live allocation the simulator owns,
    // and `buf` is a distinct Rust buffer, so the ranges do not overlap.
    unsafe { ptr::copy_nonoverlapping(src.p, buf.as_mut_ptr(), buf.len()) };
    true
}

/// Copies `data` to `dst` (see [`copy_from`]). False when the process no longer has writable memory there.
#[inline]
fn copy_to(dst: Target, data: &[u8]) -> bool {
    if dst.user {
        return user_copy(dst.p, data.as_ptr().cast_mut(), data.len(), true);
    }
    // SAFETY: as in `copy_from`, the other way.
    unsafe { ptr::copy_nonoverlapping(data.as_ptr(), dst.p, data.len()) };
    true
}

/// Whether `process_vm_*` works here (a seccomp filter may refuse it); once refused, plain copies are used.
#[cfg(all(target_os = "linux", not(miri)))]
static VM_RW_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Copies `len` bytes between lent process memory at `user` and the simulator's buffer at `local` (from `local`
/// into `user` when `to_user`), without the process faulting: on Linux with `process_vm_readv` /
/// `process_vm_writev` on the process itself, which check the pages as the kernel's own user copies do and
/// answer `EFAULT` for an unmapped page (or a read-only one, for a write) where a plain copy raises `SIGSEGV`.
/// False when any byte could not be copied. One system call per access: lent memory is the drop-in library's
/// registrations, not the simulator's queues, so the fast path is untouched.
#[cfg(all(target_os = "linux", not(miri)))]
fn user_copy(user: *mut u8, local: *mut u8, len: usize, to_user: bool) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    if len == 0 {
        return true;
    }
    if VM_RW_REFUSED.load(Relaxed) {
        return plain_copy(user, local, len, to_user);
    }
    let pid = std::process::id() as libc::pid_t;
    let mut done = 0usize;
    // Bounded: every pass copies at least one byte or ends.
    while done < len {
        let local_iov = libc::iovec { iov_base: local.wrapping_add(done).cast(), iov_len: len - done };
        let remote_iov = libc::iovec { iov_base: user.wrapping_add(done).cast(), iov_len: len - done };
        // SAFETY: the local side is the simulator's own buffer of `len` bytes; the "remote" side is this process's
        // memory, which the kernel checks page by page (it never faults the caller), so any address is safe.
        let n = unsafe {
            if to_user {
                libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0)
            } else {
                libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0)
            }
        };
        if n > 0 {
            done += n as usize;
            continue;
        }
        let err = std::io::Error::last_os_error().raw_os_error();
        if n < 0 && matches!(err, Some(libc::ENOSYS) | Some(libc::EPERM)) && done == 0 {
            // The system call is filtered out: the copy is made as before (the lent memory is trusted).
            VM_RW_REFUSED.store(true, Relaxed);
            return plain_copy(user, local, len, to_user);
        }
        return false;
    }
    true
}

/// Elsewhere (and under Miri, which has no `process_vm_readv`) lent memory is copied as any other.
#[cfg(not(all(target_os = "linux", not(miri))))]
fn user_copy(user: *mut u8, local: *mut u8, len: usize, to_user: bool) -> bool {
    plain_copy(user, local, len, to_user)
}

fn plain_copy(user: *mut u8, local: *mut u8, len: usize, to_user: bool) -> bool {
    // SAFETY: `translate` checked that the `len` bytes at `user` lie inside a live region, whose lender vouched
    // for them (`Dma::map_user`); `local` is the simulator's distinct buffer of `len` bytes.
    unsafe {
        if to_user {
            ptr::copy_nonoverlapping(local.cast_const(), user, len);
        } else {
            ptr::copy_nonoverlapping(user.cast_const(), local, len);
        }
    }
    true
}

// Regions the driver never freed are leaked on purpose when the device goes away: a `DmaRegion` copy may outlive
// every handle, and leaking is always sound while freeing under it would not be.

impl Drop for DmaSpace {
    /// Regions still allocated when the device and every handle to it are gone (a driver that kept memory the
    /// device might still write, as it must when firmware never confirmed a destroy) are kept, not freed: a
    /// `DmaRegion` for them may still exist, and its contract promises the memory until `free`. They stay
    /// reachable from a process-wide list, so leak checkers see them as held, not lost.
    fn drop(&mut self) {
        let allocated = std::mem::take(&mut self.regions).into_values().filter(|r| r.layout.is_some());
        keep_forever(allocated.map(|r| r.cpu));
    }
}

/// A kept allocation: a pointer (not an address), so Miri's leak check, like LeakSanitizer, sees it as held.
struct Kept(#[allow(dead_code)] NonNull<u8>);

// SAFETY: the pointer is never dereferenced; it only keeps the allocation reachable.
unsafe impl Send for Kept {}

/// Regions still allocated when their allocator went away (see `DmaSpace`'s `Drop`).
static KEPT: std::sync::Mutex<Vec<Kept>> = std::sync::Mutex::new(Vec::new());

/// Keeps the allocations at `ptrs` for the rest of the process, reachable so leak checkers see them as held: a
/// `DmaRegion` may still point at them, and its contract promises the memory until `free`.
pub(crate) fn keep_forever(ptrs: impl IntoIterator<Item = NonNull<u8>>) {
    let mut ptrs = ptrs.into_iter().map(Kept).peekable();
    if ptrs.peek().is_some() {
        KEPT.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend(ptrs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_core::hal::Dma;

    #[test]
    fn iova_of_finds_bytes_inside_one_live_region_only() {
        let mut d = DmaSpace::new(None);
        let a = d.alloc(3 * 4096, 4096).unwrap();
        let b = d.alloc(100, 64).unwrap();
        let at = |r: &DmaRegion, off: usize| r.cpu().as_ptr().wrapping_add(off).cast_const();
        assert_eq!(d.iova_of(at(&a, 0), 3 * 4096), Some(a.iova()));
        assert_eq!(d.iova_of(at(&a, 100), 5000), Some(a.iova() + 100));
        assert_eq!(d.iova_of(at(&a, 100), 3 * 4096), None);
        assert_eq!(d.iova_of(at(&b, 99), 1), Some(b.iova() + 99));
        assert_eq!(d.iova_of(at(&b, 99), 2), None);
        d.free(&a).unwrap();
        assert_eq!(d.iova_of(at(&a, 0), 1), None);
        assert_eq!(d.iova_of(at(&b, 0), 100), Some(b.iova()));
        d.free(&b).unwrap();
    }

    /// A heap buffer of `len` bytes whose start is aligned to exactly `align` (not to `2 * align`).
    fn exactly_aligned(len: usize, align: usize) -> (Vec<u8>, usize) {
        let v = vec![0u8; len + 3 * align];
        let a = v.as_ptr() as usize;
        let start = a.next_multiple_of(2 * align) + align;
        (v, start - a)
    }

    #[test]
    fn map_user_translates_the_bytes_until_freed() {
        let mut d = DmaSpace::new(None);
        let (mut v, off) = exactly_aligned(3 * 4096, 4096);
        // Every access below goes through this one pointer, as the device's do.
        let base = v.as_mut_ptr();
        // An odd offset and length inside the buffer.
        let at = off + 5;
        let p = NonNull::new(base.wrapping_add(at)).unwrap();
        let bytes = |o: usize, n: usize| {
            // SAFETY: inside `v`, which outlives this test's accesses; nothing writes while the copy is made.
            unsafe { std::slice::from_raw_parts(base.add(at + o), n).to_vec() }
        };
        let r = d.map_user(p, 9000).unwrap();
        assert_eq!((r.cpu(), r.len()), (p, 9000));
        // The bus address agrees with the CPU address within the page, and in no bit above 4 KiB's alignment.
        assert_eq!(r.iova() % 4096, 5);
        assert_eq!((r.iova() ^ p.as_ptr() as u64) & 0x1fff, 0x1000);
        assert_eq!(d.iova_of(p.as_ptr(), 9000), Some(r.iova()));
        // The device reads and writes the process memory.
        assert!(d.write(r.iova() + 8, b"device").is_ok());
        assert_eq!(bytes(8, 6), b"device");
        // SAFETY: inside `v`; the device is not accessing it now.
        unsafe { p.as_ptr().write(0x5a) };
        let mut b = [0u8; 1];
        assert!(d.read(r.iova(), &mut b).is_ok());
        assert_eq!(b, [0x5a]);
        // Only the mapped bytes: one past the end faults, as does the byte before the start.
        assert!(d.read(r.iova() + 9000, &mut b).is_err());
        assert!(d.read(r.iova() - 1, &mut b).is_err());
        // Mapping the same bytes again, or part of them, is refused.
        assert_eq!(d.map_user(p, 1), Err(DmaError::Unreachable { addr: p.as_ptr() as usize, len: 1 }));
        let inside = NonNull::new(base.wrapping_add(at + 100)).unwrap();
        assert!(d.map_user(inside, 10).is_err());
        assert_eq!(d.outstanding(), (1, 9000));
        let iova = r.iova();
        d.free(&r).unwrap();
        // Unmapped: the device can no longer reach the memory, which is still the process's.
        assert!(d.write(iova + 8, b"late").is_err());
        assert_eq!(bytes(8, 6), b"device");
        assert_eq!(d.faults.last().map(|f| (f.iova, f.write)), Some((iova + 8, true)));
        assert_eq!(d.outstanding(), (0, 0));
        drop(v);
    }

    #[test]
    fn map_user_keeps_the_alignment_the_memory_has() {
        let mut d = DmaSpace::new(None);
        for align in [4096usize, 1 << 16, 2 << 20] {
            let (mut v, off) = exactly_aligned(align, align);
            let p = NonNull::new(v.as_mut_ptr().wrapping_add(off)).unwrap();
            let r = d.map_user(p, align).unwrap();
            let diff = r.iova() ^ p.as_ptr() as u64;
            assert_eq!(diff.trailing_zeros(), align.trailing_zeros(), "aligned to {align:#x}");
            d.free(&r).unwrap();
        }
    }

    #[test]
    fn map_user_refuses_what_cannot_be_reached() {
        let mut d = DmaSpace::new(None);
        let mut v = vec![0u8; 64];
        let p = NonNull::new(v.as_mut_ptr()).unwrap();
        assert!(matches!(d.map_user(p, 0), Err(DmaError::Unreachable { len: 0, .. })));
        assert!(d.map_user(p, usize::MAX).is_err());
        // Memory the space allocated is already reachable: mapping it again is refused.
        let a = d.alloc(4096, 4096).unwrap();
        assert!(d.map_user(a.cpu(), 16).is_err());
        d.free(&a).unwrap();
        assert_eq!(d.outstanding(), (0, 0));
    }

    #[test]
    fn map_fixed_translates_guest_physical_addresses() {
        let mut d = DmaSpace::new(None);
        let mut guest = vec![0u8; 0x3000];
        let p = NonNull::new(guest.as_mut_ptr()).unwrap();
        // A guest RAM region at physical 0x2a09_6000, as UML shares it.
        let r = d.map_fixed(0x2a09_6000, p, guest.len()).unwrap();
        assert_eq!(r.iova(), 0x2a09_6000);
        d.write(0x2a09_7000, &[1, 2, 3]).unwrap();
        let mut b = [0u8; 3];
        d.read(0x2a09_7000, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3]);
        // One byte past the region faults; an overlapping or empty mapping is refused.
        assert!(d.read(0x2a09_8fff, &mut b).is_err());
        assert!(d.map_fixed(0x2a09_8000, p, 16).is_err());
        assert!(d.map_fixed(0x2a09_5ff0, p, 0x20).is_err());
        assert!(d.map_fixed(0x1000, p, 0).is_err());
        assert!(d.map_fixed(u64::MAX - 4, p, 16).is_err());
        // Later allocations land above the guest's memory.
        let a = d.alloc(16, 16).unwrap();
        assert!(a.iova() >= 0x2a09_9000);
        assert!(!d.unmap_fixed(a.iova(), 16), "an allocation is no fixed mapping");
        d.free(&a).unwrap();
        // Unmapped as an IOMMU unmaps: only the exact range, and afterwards the device faults there.
        assert!(!d.unmap_fixed(0x2a09_6000, 0x1000));
        assert!(d.unmap_fixed(r.iova(), guest.len()));
        assert!(d.read(0x2a09_7000, &mut b).is_err());
        assert!(!d.unmap_fixed(r.iova(), guest.len()));
        drop(guest);
    }

    /// An anonymous mapping of `len` bytes (read and write), as a program's buffer.
    #[cfg(all(target_os = "linux", not(miri)))]
    fn mapping(len: usize) -> NonNull<u8> {
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        NonNull::new(p.cast()).unwrap()
    }

    /// Unmaps the program's `len` bytes at `p`, atomically replacing them with an inaccessible reservation: the
    /// pages are gone as after `munmap`, and no other test thread's mapping can land there meanwhile (which would
    /// make the memory reachable again).
    #[cfg(all(target_os = "linux", not(miri)))]
    fn unmap(p: NonNull<u8>, len: usize) {
        let fixed = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
        // SAFETY: `p..p + len` is our own mapping; MAP_FIXED replaces exactly it.
        let q = unsafe { libc::mmap(p.as_ptr().cast(), len, libc::PROT_NONE, fixed, -1, 0) };
        assert_eq!(q, p.as_ptr().cast());
    }

    #[cfg(all(target_os = "linux", not(miri)))]
    #[test]
    fn lent_memory_the_program_unmapped_or_made_read_only_faults_the_access_not_the_process() {
        let mut d = DmaSpace::new(None);
        let p = mapping(8192);
        let r = d.map_user(p, 8192).unwrap();
        let mut b = [0u8; 4];
        assert!(d.write(r.iova() + 4094, b"lent").is_ok());
        assert!(d.read(r.iova() + 4094, &mut b).is_ok());
        assert_eq!(&b, b"lent");
        // The second page read-only: the device reads it, a write there (even one that starts in the first page)
        // is refused and recorded; a plain copy would have raised SIGSEGV.
        // SAFETY: the second page of our own mapping.
        assert_eq!(unsafe { libc::mprotect(p.as_ptr().add(4096).cast(), 4096, libc::PROT_READ) }, 0);
        assert!(d.read(r.iova() + 4096, &mut b).is_ok());
        assert!(d.write(r.iova() + 4094, b"more").is_err());
        assert!(!d.try_write(r.iova() + 4096, b"x"));
        assert!(d.write_u8_volatile(r.iova() + 5000, 1).is_err());
        // Gone altogether: every access fails, none crashes.
        unmap(p, 8192);
        assert!(!d.try_read(r.iova(), &mut b));
        assert!(d.read(r.iova(), &mut b).is_err());
        assert!(d.write(r.iova(), b"late").is_err());
        assert!(d.write_then_flag(r.iova(), &[0; 63], 1).is_err());
        assert_eq!(d.faults.len(), 5);
        assert!(d.faults.iter().all(|f| f.iova >= r.iova() && f.iova < r.iova() + 8192));
        d.free(&r).unwrap();
        // SAFETY: the reservation `unmap` left; nothing names it now.
        assert_eq!(unsafe { libc::munmap(p.as_ptr().cast(), 8192) }, 0);
    }

    /// The datapath over a registration whose memory the program unmapped: an RDMA WRITE into it and a SEND
    /// that scatters into it (from a peer) and a SEND that gathers from it (local) end in the device's errors, as
    /// when the key's memory is not there, and the process keeps running. Before, the first of them killed the
    /// process inside the simulator's copy.
    #[cfg(all(target_os = "linux", not(miri)))]
    #[test]
    fn rdma_on_a_registration_the_program_unmapped_completes_in_error() {
        use crate::testkit::submit::{Bell, QpSpec, RcParams, Rdma, Wqe, ALL_RIGHTS};
        use mlx5_core::prm::consts;
        let mut r = Rdma::new(crate::config::SimConfig::default());
        let (mut scq, mut rcq) = (r.cq(5), r.cq(5));
        let (scqn, rcqn) = (scq.cqn, rcq.cqn);
        let pair = |r: &mut Rdma| {
            let a = r.qp(QpSpec::rc(), scqn, rcqn);
            let b = r.qp(QpSpec::rc(), scqn, rcqn);
            let (ra, rb) = (r.me(a.qpn), r.me(b.qpn));
            r.connect_rc(&a, &rb, RcParams::default());
            r.connect_rc(&b, &ra, RcParams::default());
            (a, b)
        };
        let mr = r.mr(4096);
        mr.write(0, &[7; 64]);
        let lent = mapping(4096);
        // SAFETY: the mapping stays ours; the test then takes it away on purpose, which is what is tested.
        let region = unsafe { r.h.dma.map_user(lent, 4096) }.unwrap();
        let pd = r.pd;
        let umr = r.mr_on(pd, region, ALL_RIGHTS);
        unmap(lent, 4096);
        let (key, base) = (mr.key, mr.addr());
        // A peer's RDMA WRITE into it: remote access error.
        let (mut a, _b) = pair(&mut r);
        r.post_send(
            &mut a,
            &Wqe::new(consts::MLX5_OPCODE_RDMA_WRITE).raddr(umr.addr(), umr.key).data(64, key, base),
            Bell::Db,
        );
        let e = r.poll(&mut scq).expect("WRITE completion");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        // A local SEND gathering from it: local protection error.
        let (mut a, mut b) = pair(&mut r);
        r.post_recv(&mut b, &[(base + 1024, 64, key)]);
        r.post_send(&mut a, &Wqe::new(consts::MLX5_OPCODE_SEND).data(64, umr.key, umr.addr()), Bell::Db);
        let e = r.poll(&mut scq).expect("SEND completion");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR));
        assert!(r.poll(&mut rcq).is_none());
        // A peer's SEND into a receive that scatters into it: local protection error on the receive, remote
        // operational error at the requester.
        let (mut a, mut b) = pair(&mut r);
        r.post_recv(&mut b, &[(umr.addr(), 64, umr.key)]);
        r.post_send(&mut a, &Wqe::new(consts::MLX5_OPCODE_SEND).data(64, key, base), Bell::Db);
        let e = r.poll(&mut rcq).expect("receive completion");
        assert_eq!(e.status(), (consts::MLX5_CQE_RESP_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR));
        let e = r.poll(&mut scq).expect("SEND completion");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_OP_ERR));
    }

    #[test]
    fn max_contig_refuses_larger_allocations() {
        let mut d = DmaSpace::new(Some(8192));
        assert_eq!(d.alloc(8193, 4096), Err(DmaError::NoMemory { len: 8193 }));
        let r = d.alloc(8192, 4096).unwrap();
        d.free(&r).unwrap();
        assert_eq!(d.outstanding(), (0, 0));
    }
}

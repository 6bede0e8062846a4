//! Verbs objects: protection domains, memory regions, completion channels, CQs, QPs, SRQs and address
//! handles. Each is its C structure followed by the Rust handle, boxed; the pointer a program holds is the box.

use std::ffi::{c_int, c_uint, c_void};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use mlx5_core::cq::{CqeSize, LinkLayer};
use mlx5_core::hca::{CqAttr, QpInitAttr as CoreQpInitAttr, SrqAttr};
use mlx5_core::mkey::Access;
use mlx5_core::qp::{AhAttr, Grh, Mtu, QpAttr, QpAttrMask, QpCap, QpState, QpType};
use mlx5_verbs::raw::{self, RawChannel, RawChannelFd, RawCq, RawMr, RawPd};
use mlx5_verbs::SrqAttrMask;

use crate::abi::*;
use crate::device::{ctx_of, gid, hold, is_closed, link, qp_limits, release, Ctx, ObjMap};
use crate::queue::{cq_of, qp_of, srq_of, Ah, Cq, Qp, Srq};
use crate::uobject::{lock, AsyncCount, Held, Kind};
use crate::{errno_of, guard, set_errno};

/// Destroys what a closed context left, in [`Kind`] order, and releases their handles (and so their hold on the
/// device); their C structs stay, refused by every entry point. A failure is logged and the handle released all
/// the same: the device's teardown takes what firmware kept.
///
/// # Safety
/// Each entry is a live object of `ctx`, of its kind, and `ctx` is closed (so nothing else reaches them).
pub(crate) unsafe fn release_leftovers(ctx: &Ctx, mut left: Vec<(usize, Kind)>) {
    left.sort_by_key(|&(_, k)| k);
    let log = |what: &str, e: &dyn std::fmt::Display| log::warn!("close: the {what} left alive: {e}");
    for (p, kind) in left {
        // SAFETY: the caller's promise: `p` is a live box of this kind, reached by nothing else any more; each
        // handle is released once, after its last use here.
        unsafe {
            match kind {
                Kind::Qp => {
                    let q = &*(p as *const Qp);
                    if let Err(e) = q.raw.destroy() {
                        log("QP", &e);
                    }
                    q.raw.release();
                }
                Kind::Srq => {
                    let s = &*(p as *const Srq);
                    if let Err(e) = s.raw.destroy() {
                        log("SRQ", &e);
                    }
                    s.raw.release();
                }
                Kind::Cq => {
                    let c = &*(p as *const Cq);
                    // Completion events taken and not acknowledged are given back, not waited for.
                    if let Some(Err(e)) = c.raw.as_ref().map(RawCq::destroy_now) {
                        log("CQ", &e);
                    }
                    // Its channel counts one CQ fewer (the program may destroy the channel).
                    if let Some(ch) = c.c.cq.channel.as_mut() {
                        ch.refcnt = ch.refcnt.saturating_sub(1).max(0);
                    }
                    c.raw.release();
                }
                Kind::Mr => {
                    let m = &*(p as *const Mr);
                    if let Err(e) = lock(&m.raw).dereg() {
                        log("MR", &e);
                    }
                    m.raw.release();
                }
                // An address handle is an address vector in memory; a thread domain a promise: no firmware.
                Kind::Ah | Kind::Td => {}
                Kind::ParentDomain => (*(p as *const Pd)).raw.release(),
                Kind::Pd => {
                    let d = &*(p as *const Pd);
                    if let Err(e) = d.raw.dealloc() {
                        log("PD", &e);
                    }
                    d.raw.release();
                }
                Kind::Channel => {
                    let ch = &*(p as *const Channel);
                    // The descriptor stays open for the program, which closes it with ibv_destroy_comp_channel.
                    let _ = ch.kept.set(ch.raw.detach());
                    ch.raw.release();
                }
            }
        }
    }
    // Their async events are no longer handed out (those handed out name shells, still readable).
    *lock(&ctx.objs) = ObjMap::default();
}

/// The answer to a verb on an object its entry point refused: `EBADF` for a leftover of a context the program
/// closed, as rdma-core's destroy returns then (its command goes to the context's `cmd_fd`, closed by
/// `ibv_close_device`, and fails before anything is freed); `EINVAL` for anything else.
///
/// # Safety
/// `obj` is NULL or an object of this library not yet freed, whose C struct starts with its `context` (every
/// verbs object's does).
unsafe fn refused<T>(obj: *mut T) -> c_int {
    // SAFETY: the caller's duty: the first field is the object's context, NULL or not freed.
    if !obj.is_null() && unsafe { is_closed(obj.cast::<*mut ibv_context>().read()) } {
        libc::EBADF
    } else {
        libc::EINVAL
    }
}

/// NULL with errno, the verbs way for pointer-returning calls.
fn fail<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

#[repr(C)]
pub(crate) struct Pd {
    pub(crate) c: ibv_pd,
    pub(crate) raw: Held<RawPd>,
    /// For a parent domain: the protection domain it is made on (whose PD objects made through it use), and its
    /// thread domain; NULL for a protection domain.
    pub(crate) protecting: *mut ibv_pd,
    pub(crate) td: *mut ibv_td,
    /// Parent domains on a protection domain; objects made through a parent domain: either keeps it from
    /// being deallocated (`EBUSY`), as libmlx5's reference counts do.
    pub(crate) users: AtomicU32,
    /// `IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT`.
    pub(crate) pd_context: *mut c_void,
    /// `IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS` (used when both are given, as libmlx5 does).
    pub(crate) allocators: Option<(PdAllocFn, PdFreeFn)>,
}

impl Pd {
    fn protection(c: ibv_pd, raw: RawPd) -> Pd {
        Pd {
            c,
            raw: Held::new(raw),
            protecting: ptr::null_mut(),
            td: ptr::null_mut(),
            users: AtomicU32::new(0),
            pd_context: ptr::null_mut(),
            allocators: None,
        }
    }
}

/// Counts an object made through `pd` when it is a parent domain (`delta` +1 at creation, -1 at destroy); a
/// protection domain counts its objects in `mlx5-verbs`.
///
/// # Safety
/// `pd` is NULL or a live PD or parent domain of this library.
pub(crate) unsafe fn count_on_parent(pd: *mut ibv_pd, made: bool) {
    // SAFETY: the caller's duty.
    if let Some(p) = unsafe { pd_of(pd) }.filter(|p| !p.protecting.is_null()) {
        if made {
            p.users.fetch_add(1, Ordering::AcqRel);
        } else {
            p.users.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// libmlx5's resource types for a parent domain's allocator (`MLX5DV_RES_TYPE_*`: `RDMA_DRIVER_MLX5 << 32 | n`).
const RES_TYPE_QP: u64 = 1 << 32 | 1;
const RES_TYPE_DBR: u64 = 1 << 32 | 3;
const RES_TYPE_SRQ: u64 = 1 << 32 | 4;
const RES_TYPE_CQ: u64 = 1 << 32 | 5;
/// The alignment libmlx5 asks for queue buffers: the page size.
const PAGE: usize = 4096;

/// Asks the custom allocator of parent domain `pd` (if it is one, with allocators) for an object's buffers as
/// libmlx5 asks for a QP's, SRQ's or CQ's: its ring (`ring_bytes`, page aligned, resource type `ring_type`), then
/// its doorbell record (8 bytes, `MLX5DV_RES_TYPE_DBR`). Queue memory here always comes from the driver's DMA allocator, so only
/// `IBV_ALLOCATOR_USE_DEFAULT` can be honoured: NULL is `ENOMEM` (as libmlx5), memory is given back to the
/// program's `free` and the creation is `EOPNOTSUPP`. The object exists by then (its sizes are known only
/// once made), and the caller destroys it on an error.
///
/// # Safety
/// `pd` is NULL or a live PD or parent domain of this library.
unsafe fn ask_allocator(pd: *mut ibv_pd, ring_bytes: usize, ring_type: u64) -> Result<(), c_int> {
    // SAFETY: the caller's duty.
    let Some(p) = (unsafe { pd_of(pd) }) else { return Ok(()) };
    let Some((alloc, free)) = p.allocators else { return Ok(()) };
    const USE_DEFAULT: *mut c_void = usize::MAX as *mut c_void;
    for (bytes, align, ty) in [(ring_bytes, PAGE, ring_type), (8, 8, RES_TYPE_DBR)] {
        // SAFETY: the program's allocator, called as libmlx5 calls it.
        let mem = unsafe { alloc(pd, p.pd_context, bytes, align, ty) };
        if mem == USE_DEFAULT {
            continue;
        }
        if mem.is_null() {
            return Err(libc::ENOMEM);
        }
        log::info!("parent domain allocator: program memory for queues is not supported");
        // SAFETY: memory this allocator just gave, returned once.
        unsafe { free(pd, p.pd_context, mem, ty) };
        return Err(libc::EOPNOTSUPP);
    }
    Ok(())
}

/// A thread domain: the promise that the objects made through its parent domains are used by one thread at
/// a time. Nothing here is shared between QPs to begin with (each QP has its own doorbell register), so there is
/// no lock for it to spare.
#[repr(C)]
pub(crate) struct Td {
    pub(crate) c: ibv_td,
    /// Parent domains using it.
    users: AtomicU32,
}

/// `verbs_context.alloc_td`.
pub(crate) unsafe extern "C" fn alloc_td(context: *mut ibv_context, attr: *mut ibv_td_init_attr) -> *mut ibv_td {
    guard("ibv_alloc_td", ptr::null_mut(), || {
        // SAFETY: the caller passes an open context and its attributes.
        let (Some(_), Some(a)) = (unsafe { ctx(context) }, unsafe { attr.as_ref() }) else { return fail(libc::EINVAL) };
        if a.comp_mask != 0 {
            return fail(libc::EINVAL);
        }
        let b = Box::into_raw(Box::new(Td { c: ibv_td { context }, users: AtomicU32::new(0) }));
        hold(context, Kind::Td, b);
        b.cast()
    })
}

/// `verbs_context.dealloc_td`: `EBUSY` while a parent domain uses it.
pub(crate) unsafe extern "C" fn dealloc_td(td: *mut ibv_td) -> c_int {
    guard("ibv_dealloc_td", libc::EIO, || {
        // SAFETY: the caller passes a live TD (its C part is the first field of a boxed Td).
        let Some(t) = (unsafe { td.cast::<Td>().as_ref() }) else { return libc::EINVAL };
        if t.users.load(Ordering::Acquire) > 0 {
            return libc::EBUSY;
        }
        let context = t.c.context;
        // SAFETY: boxed by alloc_td; deallocated once. A thread domain has nothing of the device, so one its
        // closed context left is freed here too (libmlx5's mlx5_dealloc_td sends no command).
        drop(unsafe { Box::from_raw(td.cast::<Td>()) });
        release(context, td);
        0
    })
}

/// `verbs_context.alloc_parent_domain`: a PD that stands for its protection domain wherever a PD is taken, with
/// an optional thread domain and `pd_context`. Custom allocators (`IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS`) are
/// asked for each queue made through it ([`ask_allocator`]); only their `IBV_ALLOCATOR_USE_DEFAULT` answer can
/// be honoured, since queue buffers come from the driver's DMA memory.
pub(crate) unsafe extern "C" fn alloc_parent_domain(
    context: *mut ibv_context,
    attr: *mut ibv_parent_domain_init_attr,
) -> *mut ibv_pd {
    const ALLOCATORS: u32 = 1 << 0;
    const PD_CONTEXT: u32 = 1 << 1;
    guard("ibv_alloc_parent_domain", ptr::null_mut(), || {
        // SAFETY: the caller passes an open context and its attributes.
        let (Some(_), Some(a)) = (unsafe { ctx(context) }, unsafe { attr.as_ref() }) else { return fail(libc::EINVAL) };
        if a.comp_mask & !(ALLOCATORS | PD_CONTEXT) != 0 {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller passes a live PD.
        let Some(p) = (unsafe { pd_of(a.pd) }) else { return fail(libc::EINVAL) };
        if !p.protecting.is_null() || p.c.context != context {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller passes a live TD, or NULL.
        let td = unsafe { a.td.cast::<Td>().as_ref() };
        if td.is_some_and(|t| t.c.context != context) {
            return fail(libc::EINVAL);
        }
        if let Some(t) = td {
            t.users.fetch_add(1, Ordering::AcqRel);
        }
        p.users.fetch_add(1, Ordering::AcqRel);
        let pd_context = if a.comp_mask & PD_CONTEXT != 0 { a.pd_context } else { ptr::null_mut() };
        let c = ibv_pd { context, handle: p.c.handle };
        let allocators = match (a.comp_mask & ALLOCATORS != 0, a.alloc, a.free) {
            (true, Some(alloc), Some(free)) => Some((alloc, free)),
            _ => None,
        };
        let raw = Held::new(p.raw.share());
        let b = Pd { c, raw, protecting: a.pd, td: a.td, users: AtomicU32::new(0), pd_context, allocators };
        let b = Box::into_raw(Box::new(b));
        hold(context, Kind::ParentDomain, b);
        b.cast()
    })
}

/// The [`Pd`] of a program's `ibv_pd` (`None` for one a forked child inherited, as for its context).
///
/// # Safety
/// `p` is NULL or a PD this library returned and not yet deallocated.
pub(crate) unsafe fn pd_of<'a>(p: *mut ibv_pd) -> Option<&'a Pd> {
    // SAFETY: `c` is the first field of a boxed Pd (caller); its context outlives it.
    unsafe { p.cast::<Pd>().as_ref().filter(|p| ctx_of(p.c.context).is_some()) }
}

/// The context of an object's `context` field.
///
/// # Safety
/// `c` is NULL or an open context of this library.
unsafe fn ctx<'a>(c: *mut ibv_context) -> Option<&'a Ctx> {
    // SAFETY: the caller's duty.
    unsafe { ctx_of(c) }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    guard("ibv_alloc_pd", ptr::null_mut(), || {
        // SAFETY: the caller passes an open context.
        let Some(c) = (unsafe { ctx(context) }) else { return fail(libc::EINVAL) };
        match raw::alloc_pd(&c.ctx) {
            Ok(raw) => {
                let handle = raw.pdn();
                let b = Box::into_raw(Box::new(Pd::protection(ibv_pd { context, handle }, raw)));
                hold(context, Kind::Pd, b);
                b.cast()
            }
            Err(e) => fail(errno_of(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    guard("ibv_dealloc_pd", libc::EIO, || {
        // SAFETY: the caller passes a live PD.
        // SAFETY: as above (a PD its closed context left is still allocated).
        let Some(p) = (unsafe { pd_of(pd) }) else { return unsafe { dealloc_left(pd) } };
        if p.users.load(Ordering::Acquire) > 0 {
            return libc::EBUSY;
        }
        if !p.protecting.is_null() {
            // A parent domain: its protection domain and thread domain are used by one fewer.
            // SAFETY: a parent domain keeps its protection and thread domains (EBUSY above on theirs).
            unsafe {
                if let Some(prot) = pd_of(p.protecting) {
                    prot.users.fetch_sub(1, Ordering::AcqRel);
                }
                if let Some(t) = p.td.cast::<Td>().as_ref() {
                    t.users.fetch_sub(1, Ordering::AcqRel);
                }
            }
            let context = p.c.context;
            // SAFETY: boxed by alloc_parent_domain; deallocated once.
            drop(unsafe { Box::from_raw(pd.cast::<Pd>()) });
            release(context, pd);
            return 0;
        }
        match p.raw.dealloc() {
            Ok(()) => {
                let context = p.c.context;
                // SAFETY: boxed by ibv_alloc_pd; deallocated once.
                drop(unsafe { Box::from_raw(pd.cast::<Pd>()) });
                release(context, pd);
                0
            }
            Err(e) => errno_of(&e),
        }
    })
}

/// `ibv_dealloc_pd` of a PD `pd_of` refused. One its closed context left: a protection domain is `EBADF` (its
/// firmware PD went at the close; rdma-core's command fails on the closed `cmd_fd` and frees nothing); a parent
/// domain is freed as libmlx5 frees one (no command), `EBUSY` while objects made through it count on it.
///
/// # Safety
/// `pd` is NULL or a PD or parent domain of this library not yet freed.
unsafe fn dealloc_left(pd: *mut ibv_pd) -> c_int {
    // SAFETY: the caller's duty; the C part is first in the box.
    let Some(p) = (unsafe { pd.cast::<Pd>().as_ref() }) else { return libc::EINVAL };
    // SAFETY: a PD's context is NULL or one of this library's, freed only without objects.
    if !unsafe { is_closed(p.c.context) } {
        return libc::EINVAL;
    }
    if p.protecting.is_null() {
        return libc::EBADF;
    }
    if p.users.load(Ordering::Acquire) > 0 {
        return libc::EBUSY;
    }
    // SAFETY: its thread domain is live (dealloc_td refuses while a parent domain uses it); the box was made by
    // alloc_parent_domain and its handle released at the close, so dropping it drops nothing of the device.
    unsafe {
        if let Some(t) = p.td.cast::<Td>().as_ref() {
            t.users.fetch_sub(1, Ordering::AcqRel);
        }
        drop(Box::from_raw(pd.cast::<Pd>()));
    }
    0
}

#[repr(C)]
pub(crate) struct Mr {
    pub(crate) c: ibv_mr,
    /// Replaced by an `ibv_rereg_mr` that changes the memory (new keys).
    pub(crate) raw: Held<Mutex<RawMr>>,
}

/// The [`Mr`] of a program's `ibv_mr` (`None` for one of a closed context, or inherited across fork).
///
/// # Safety
/// `mr` is NULL or a region this library returned and not yet deregistered.
unsafe fn mr_of<'a>(mr: *mut ibv_mr) -> Option<&'a Mr> {
    // SAFETY: the C part is the first field of a boxed Mr (caller); its context outlives it.
    unsafe { mr.cast::<Mr>().as_ref().filter(|m| ctx_of(m.c.context).is_some()) }
}

/// The access flags of a registration: local write, remote write/read/atomic and relaxed ordering go to the
/// device; `IBV_ACCESS_MW_BIND` is accepted (no memory window can be allocated here, so none binds) and
/// `IBV_ACCESS_HUGETLB` is a hint; the other optional flags (`IBV_ACCESS_OPTIONAL_RANGE`, bits 20..29) are
/// dropped, as libibverbs lets a provider do; zero-based, on-demand paging and flush are `EOPNOTSUPP`; anything
/// else `EINVAL`.
fn access(flags: c_int) -> Result<Access, c_int> {
    const MW_BIND: u32 = 1 << 4;
    const ZERO_BASED: u32 = 1 << 5;
    const ON_DEMAND: u32 = 1 << 6;
    const HUGETLB: u32 = 1 << 7;
    const FLUSH: u32 = (1 << 8) | (1 << 9);
    const OPTIONAL_RANGE: u32 = 0x3ff << 20;
    let f = flags as u32;
    if f & (ZERO_BASED | ON_DEMAND | FLUSH) != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    let optional = f & OPTIONAL_RANGE & !Access::RELAXED_ORDERING.0;
    let a = Access(f & !(MW_BIND | HUGETLB | optional));
    if a.unsupported() != 0 {
        return Err(libc::EINVAL);
    }
    // ib_check_mr_access: remote write or atomic needs local write.
    if (a.contains(Access::REMOTE_WRITE) || a.contains(Access::REMOTE_ATOMIC)) && !a.contains(Access::LOCAL_WRITE) {
        return Err(libc::EINVAL);
    }
    Ok(a)
}

/// libmlx5's `MLX_CQ_ALLOC_TYPE` / `MLX_QP_ALLOC_TYPE` / `MLX_SRQ_ALLOC_TYPE` set to `HUGE` ask for the queue
/// buffer on huge pages, else failure: this driver's queue buffers come from its DMA allocator, never from
/// huge pages, so such a create fails (`ENOMEM`). `PREFER_HUGE` and the others fall back, as libmlx5's do.
fn refuse_huge(var: &str) -> Result<(), c_int> {
    if std::env::var(var).is_ok_and(|v| v == "HUGE") {
        log::info!("{var}=HUGE, and queue buffers are never on huge pages here");
        return Err(libc::ENOMEM);
    }
    Ok(())
}

/// `ibv_reg_mr_iova2`: registers process memory at `iova` (the address when `None`).
unsafe fn reg(pd: *mut ibv_pd, addr: *mut c_void, len: usize, iova: Option<u64>, flags: c_int) -> *mut ibv_mr {
    // SAFETY: the caller passes a live PD.
    let Some(p) = (unsafe { pd_of(pd) }) else { return fail(libc::EINVAL) };
    let a = match access(flags) {
        Ok(a) => a,
        Err(e) => return fail(e),
    };
    let Some(ptr) = NonNull::new(addr.cast::<u8>()) else { return fail(libc::EINVAL) };
    // SAFETY: verbs' contract: the program keeps the memory until ibv_dereg_mr.
    match unsafe { p.raw.reg_mr(ptr, len, iova, a) } {
        Ok(raw) => {
            let c = ibv_mr {
                context: p.c.context,
                pd,
                addr,
                length: len,
                handle: raw.lkey(),
                lkey: raw.lkey(),
                rkey: raw.rkey(),
            };
            let context = c.context;
            // SAFETY: the caller's live PD.
            unsafe { count_on_parent(pd, true) };
            let b = Box::into_raw(Box::new(Mr { c, raw: Held::new(Mutex::new(raw)) }));
            hold(context, Kind::Mr, b);
            b.cast()
        }
        Err(e) => {
            log::info!("reg_mr: {e}");
            fail(errno_of(&e))
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, flags: c_int) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    guard("ibv_reg_mr", ptr::null_mut(), || unsafe { reg(pd, addr, len, None, flags) })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    flags: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    guard("ibv_reg_mr_iova", ptr::null_mut(), || unsafe { reg(pd, addr, len, Some(iova), flags) })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    flags: c_uint,
) -> *mut ibv_mr {
    // SAFETY: forwarded contract.
    guard("ibv_reg_mr_iova2", ptr::null_mut(), || unsafe { reg(pd, addr, len, Some(iova), flags as c_int) })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    guard("ibv_dereg_mr", libc::EIO, || {
        // SAFETY: the caller passes a live MR (or one its closed context left, still allocated).
        let Some(m) = (unsafe { mr_of(mr) }) else { return unsafe { refused(mr) } };
        let res = lock(&m.raw).dereg();
        match res {
            Ok(()) => {
                let context = m.c.context;
                // SAFETY: the region's PD outlives it (EBUSY otherwise).
                unsafe { count_on_parent(m.c.pd, false) };
                // SAFETY: boxed by ibv_reg_mr; deregistered once.
                drop(unsafe { Box::from_raw(mr.cast::<Mr>()) });
                release(context, mr);
                0
            }
            Err(e) => errno_of(&e),
        }
    })
}

/// `ibv_rereg_mr`'s failures: bad arguments (`IBV_REREG_MR_ERR_INPUT`) or the device refused
/// (`IBV_REREG_MR_ERR_CMD`), each with errno set.
const REREG_ERR_INPUT: c_int = -1;
const REREG_ERR_CMD: c_int = -4;

/// `ibv_rereg_mr`. New memory (`IBV_REREG_MR_CHANGE_TRANSLATION`, with or without a new PD or access) re-creates
/// the mkey, as mlx5_ib does when it cannot update the key in place: the region gets new keys (which `lkey` /
/// `rkey` then hold), and `pd`, `addr`, `length` follow. A change of PD or access alone is `EOPNOTSUPP`
/// (`IBV_REREG_MR_ERR_CMD`): mlx5_ib makes it in place with a UMR work request, keeping the keys, and programs
/// (rdma-core's tests among them) keep using the rkey their peer has; re-creating the key would fail those
/// peers' accesses instead. On failure the region stays as it was.
#[no_mangle]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access_flags: c_int,
) -> c_int {
    const TRANSLATION: c_int = 1;
    const CHANGE_PD: c_int = 2;
    const ACCESS: c_int = 4;
    const KEEP_VALID: c_int = 8;
    let input = |e| {
        set_errno(e);
        REREG_ERR_INPUT
    };
    let cmd = |e| {
        set_errno(e);
        REREG_ERR_CMD
    };
    guard("ibv_rereg_mr", REREG_ERR_CMD, || {
        // libibverbs' own checks, before the provider sees the call.
        if flags & !(TRANSLATION | CHANGE_PD | ACCESS | KEEP_VALID) != 0
            || flags & TRANSLATION != 0 && (length == 0 || addr.is_null())
            || access_flags != 0 && flags & ACCESS == 0
        {
            return input(libc::EINVAL);
        }
        // SAFETY: the caller passes a live MR (its C part is the first field of a boxed Mr).
        let Some(m) = (unsafe { mr_of(mr) }) else { return input(libc::EINVAL) };
        // What the kernel refuses before trying: an empty request, a PD of no context of this region, access
        // flags registration refuses; libmlx5 refuses to keep the old key valid.
        if flags == 0 {
            return cmd(libc::EINVAL);
        }
        if flags & KEEP_VALID != 0 {
            return cmd(libc::EOPNOTSUPP);
        }
        let new_pd = if flags & CHANGE_PD != 0 {
            // SAFETY: the caller passes a live PD (or NULL).
            match unsafe { pd_of(pd) } {
                Some(p) if p.c.context == m.c.context => Some(p),
                _ => return cmd(libc::EINVAL),
            }
        } else {
            None
        };
        let new_access = if flags & ACCESS != 0 {
            match access(access_flags) {
                Ok(a) => Some(a),
                Err(e) => return cmd(e),
            }
        } else {
            None
        };
        let Some(ptr) = NonNull::new(addr.cast::<u8>()).filter(|_| flags & TRANSLATION != 0) else {
            log::info!("rereg_mr: a change of PD or access alone would need the key kept (UMR)");
            return cmd(libc::EOPNOTSUPP);
        };
        let mut raw = lock(&m.raw);
        // SAFETY: verbs' contract: the program keeps the new memory until ibv_dereg_mr.
        match unsafe { raw.rereg(Some((ptr, length, None)), new_pd.map(|p| &*p.raw), new_access) } {
            Ok(new) => {
                // SAFETY: the C part is the program's view of the region, which libibverbs updates in place as
                // here (the program does not use the region while re-registering it).
                unsafe {
                    (*mr).lkey = new.lkey();
                    (*mr).rkey = new.rkey();
                    (*mr).handle = new.lkey();
                    if new_pd.is_some() {
                        // A parent domain counts the regions made through it.
                        count_on_parent((*mr).pd, false);
                        count_on_parent(pd, true);
                        (*mr).pd = pd;
                    }
                    (*mr).addr = addr;
                    (*mr).length = length;
                }
                *raw = new;
                0
            }
            Err(e) => {
                log::info!("rereg_mr: {e}");
                cmd(errno_of(&e))
            }
        }
    })
}

#[repr(C)]
pub(crate) struct Channel {
    pub(crate) c: ibv_comp_channel,
    pub(crate) raw: Held<RawChannel>,
    /// The descriptor, once the channel's context is closed (the program still holds it).
    kept: OnceLock<RawChannelFd>,
}

/// The [`Channel`] of a program's `ibv_comp_channel`: `Err(EIO)` for one of a closed context (the kernel's
/// answer to a read of a completion channel whose context is gone), `Err(EINVAL)` for NULL or one inherited
/// across fork.
///
/// # Safety
/// `ch` is NULL or a channel this library returned and not yet destroyed.
unsafe fn channel_of<'a>(ch: *mut ibv_comp_channel) -> Result<&'a Channel, c_int> {
    // SAFETY: the C part is the first field of a boxed Channel (caller); its context outlives it.
    let c = unsafe { ch.cast::<Channel>().as_ref() }.ok_or(libc::EINVAL)?;
    // SAFETY: as above.
    if unsafe { is_closed(c.c.context) } {
        return Err(libc::EIO);
    }
    // SAFETY: as above.
    unsafe { ctx_of(c.c.context) }.map(|_| c).ok_or(libc::EINVAL)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel {
    guard("ibv_create_comp_channel", ptr::null_mut(), || {
        // SAFETY: the caller passes an open context.
        let Some(c) = (unsafe { ctx(context) }) else { return fail(libc::EINVAL) };
        let raw = raw::create_comp_channel(&c.ctx);
        // No descriptor could be made: the kernel's uverbs answers a full descriptor table with EMFILE, and a
        // channel without one would never wake its reader.
        let Some(fd) = raw.fd() else {
            if let Err(e) = raw.destroy() {
                log::error!("create_comp_channel: the channel without a descriptor could not be destroyed: {e}");
            }
            return fail(libc::EMFILE);
        };
        let c = ibv_comp_channel { context, fd, refcnt: 0 };
        let b = Box::into_raw(Box::new(Channel { c, raw: Held::new(raw), kept: OnceLock::new() }));
        hold(context, Kind::Channel, b);
        b.cast()
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    guard("ibv_destroy_comp_channel", libc::EIO, || {
        // SAFETY: the caller passes a live channel.
        let ch = match unsafe { channel_of(channel) } {
            Ok(ch) => ch,
            Err(libc::EIO) => {
                // Its context is closed and its CQs gone: the descriptor is the program's to close, and the
                // struct goes with it (its handle was released at the close, its descriptor closes here).
                // SAFETY: boxed by ibv_create_comp_channel; destroyed once.
                drop(unsafe { Box::from_raw(channel.cast::<Channel>()) });
                return 0;
            }
            Err(e) => return e,
        };
        match ch.raw.destroy() {
            Ok(()) => {
                let context = ch.c.context;
                // SAFETY: boxed by ibv_create_comp_channel; destroyed once.
                drop(unsafe { Box::from_raw(channel.cast::<Channel>()) });
                release(context, channel);
                0
            }
            Err(e) => errno_of(&e),
        }
    })
}

fn make_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> Result<*mut Cq, c_int> {
    // SAFETY: the caller passes an open context.
    let c = unsafe { ctx(context) }.ok_or(libc::EINVAL)?;
    refuse_huge("MLX_CQ_ALLOC_TYPE")?;
    let cqe = u32::try_from(cqe).ok().filter(|n| *n > 0).ok_or(libc::EINVAL)?;
    let comp_vector = u16::try_from(comp_vector).map_err(|_| libc::EINVAL)?;
    // SAFETY: the channel, when given, is a live channel of this library.
    let ch = if channel.is_null() { None } else { Some(unsafe { channel_of(channel) }.map_err(|_| libc::EINVAL)?) };
    // SAFETY: every field of ibv_cq_ex is an integer, array, Option<fn> or raw pointer: zero is valid.
    let mut cx: ibv_cq_ex = unsafe { std::mem::zeroed() };
    cx.cq.context = context;
    cx.cq.channel = channel;
    cx.cq.cq_context = cq_context;
    crate::post::fill_cq_ex(&mut cx);
    let p = Box::into_raw(Box::new(Cq {
        c: cx,
        raw: Held::new(None),
        ctx: c,
        ex: Mutex::new(Default::default()),
        async_events: AsyncCount::default(),
        parent_domain: ptr::null_mut(),
    }));
    let attr = CqAttr { cqe, cqe_size: CqeSize::default(), overrun_ignore: false, comp_vector };
    match raw::create_cq(&c.ctx, attr, p as u64, ch.map(|ch| &*ch.raw)) {
        Ok(raw) => {
            // SAFETY: p is the live box made above, not yet shared.
            let b = unsafe { &mut *p };
            b.c.cq.handle = raw.cqn();
            b.c.cq.cqe = c_int::try_from(raw.nent().saturating_sub(1)).unwrap_or(c_int::MAX);
            lock(&c.objs).cqs.insert(raw.cqn(), p as usize);
            b.raw = Held::new(Some(raw));
            hold(context, Kind::Cq, p);
            if let Some(ch) = ch {
                // SAFETY: the channel is live; refcnt is informational.
                unsafe { (*channel).refcnt = ch.c.refcnt + 1 };
            }
            Ok(p)
        }
        Err(e) => {
            // SAFETY: p is the box made above, never shared.
            drop(unsafe { Box::from_raw(p) });
            log::info!("create_cq: {e}");
            Err(errno_of(&e))
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    guard("ibv_create_cq", ptr::null_mut(), || match make_cq(context, cqe, cq_context, channel, comp_vector) {
        Ok(p) => p.cast(),
        Err(e) => fail(e),
    })
}

/// `verbs_context.create_cq_ex`: the work completion fields `ibv_wc` has and the completion timestamp (raw
/// device clock) are readable; a wall-clock timestamp, flow tag or other extra is `EOPNOTSUPP`.
pub(crate) unsafe extern "C" fn create_cq_ex(
    context: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    guard("ibv_create_cq_ex", ptr::null_mut(), || {
        // SAFETY: the caller passes its attributes.
        let Some(a) = (unsafe { attr.as_ref() }) else { return fail(libc::EINVAL) };
        // IBV_WC_EX_WITH_BYTE_LEN | IMM | QP_NUM | SRC_QP | SLID | SL | DLID_PATH_BITS, and
        // COMPLETION_TIMESTAMP (the CQE's raw device clock).
        const SUPPORTED_WC: u64 = 0x7f | (1 << 7);
        // IBV_CQ_INIT_ATTR_MASK_FLAGS (no flag supported) and _PD (a parent domain of this context).
        const MASK_PD: u32 = 1 << 1;
        if a.wc_flags & !SUPPORTED_WC != 0 || a.comp_mask & !(1 | MASK_PD) != 0 || a.flags != 0 {
            return fail(libc::EOPNOTSUPP);
        }
        let parent = if a.comp_mask & MASK_PD != 0 {
            // SAFETY: the caller passes a live PD (or NULL).
            match unsafe { pd_of(a.parent_domain) } {
                Some(p) if !p.protecting.is_null() && p.c.context == context => a.parent_domain,
                _ => return fail(libc::EINVAL),
            }
        } else {
            ptr::null_mut()
        };
        let Ok(cqe) = c_int::try_from(a.cqe) else { return fail(libc::EINVAL) };
        let vector = c_int::try_from(a.comp_vector).unwrap_or(c_int::MAX);
        match make_cq(context, cqe, a.cq_context, a.channel, vector) {
            Ok(p) => {
                // SAFETY: the CQ was made just now and is not yet the program's; the parent domain is live.
                unsafe {
                    let bytes = (*p).raw.as_ref().map_or(0, RawCq::buf_bytes);
                    if let Err(e) = ask_allocator(parent, bytes, RES_TYPE_CQ) {
                        if ibv_destroy_cq(p.cast()) != 0 {
                            log::error!("create_cq_ex: the CQ refused by the allocator could not be destroyed");
                        }
                        return fail(e);
                    }
                    (*p).parent_domain = parent;
                    count_on_parent(parent, true);
                }
                p.cast()
            }
            Err(e) => fail(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard("ibv_destroy_cq", libc::EIO, || {
        // SAFETY: the caller passes a live CQ (or one its closed context left, still allocated).
        let Some((c, raw)) = (unsafe { cq_of(cq) }) else { return unsafe { refused(cq) } };
        match raw.destroy() {
            Ok(()) => {
                // Completion events were waited for by the destroy; async events naming the CQ are here.
                // SAFETY: the context outlives its objects (verbs' rule).
                c.async_events.retire(&unsafe { &*c.ctx }.objs, |o| {
                    o.cqs.remove(&raw.cqn());
                });
                // SAFETY: a CQ's parent domain outlives it (EBUSY otherwise).
                unsafe { count_on_parent(c.parent_domain, false) };
                let channel = c.c.cq.channel;
                // SAFETY: a CQ's channel outlives it (EBUSY otherwise); libibverbs counts its CQs there.
                if let Some(ch) = unsafe { channel.as_mut() } {
                    ch.refcnt = ch.refcnt.saturating_sub(1).max(0);
                }
                let context = c.c.cq.context;
                // SAFETY: boxed by ibv_create_cq; destroyed once.
                drop(unsafe { Box::from_raw(cq.cast::<Cq>()) });
                release(context, cq);
                0
            }
            Err(e) => {
                log::info!("destroy_cq: {e}");
                errno_of(&e)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    guard("ibv_get_cq_event", -1, || {
        // SAFETY: the caller passes a live channel. One of a closed context reads as EIO, as the kernel's read
        // of a completion channel whose context is gone.
        let ch = match unsafe { channel_of(channel) } {
            Ok(ch) => ch,
            Err(e) => {
                set_errno(e);
                return -1;
            }
        };
        // A descriptor the program made non-blocking: one look, then EAGAIN. A blocking wait ends with EINTR on a
        // program's signal, as libibverbs' read() of the channel does (qperf's timer ends its tests so).
        let next = || ch.raw.get_cq_event(Duration::ZERO).transpose();
        let got = if crate::is_nonblocking(ch.c.fd) {
            next()
        } else {
            match crate::signals::wait_for(CQ_EVENT_STEP, next) {
                Ok(r) => Some(r),
                Err(e) => {
                    set_errno(e);
                    return -1;
                }
            }
        };
        match got {
            Some(Ok(ev)) => {
                let p = ev.cq_context() as *mut Cq;
                // SAFETY: the event's cq_context is the Cq box this library registered; the CQ cannot be
                // destroyed while the event is unacknowledged.
                let user = unsafe { (*p).c.cq.cq_context };
                // SAFETY: the caller's out pointers are writable.
                unsafe {
                    if !cq.is_null() {
                        *cq = p.cast();
                    }
                    if !cq_context.is_null() {
                        *cq_context = user;
                    }
                }
                0
            }
            None => {
                set_errno(libc::EAGAIN);
                -1
            }
            Some(Err(e)) => {
                log::warn!("get_cq_event: {e}");
                set_errno(errno_of(&e));
                -1
            }
        }
    })
}

/// How long a blocking `ibv_get_cq_event` sleeps between looks (as `mlx5-verbs`' own wait does).
const CQ_EVENT_STEP: Duration = Duration::from_micros(50);

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    guard("ibv_ack_cq_events", (), || {
        // SAFETY: the caller passes a live CQ.
        if let Some((c, raw)) = unsafe { cq_of(cq) } {
            if raw.ack_events(nevents).is_ok() {
                // SAFETY: the C part is the program's to read; this is libibverbs' own counter.
                unsafe { (*cq).comp_events_completed = c.c.cq.comp_events_completed.wrapping_add(nevents) };
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    guard("ibv_resize_cq", libc::EIO, || {
        // SAFETY: the caller passes a live CQ.
        let Some((_, raw)) = (unsafe { cq_of(cq) }) else { return libc::EINVAL };
        let Some(n) = u32::try_from(cqe).ok().filter(|n| *n > 0) else { return libc::EINVAL };
        match raw.resize(n) {
            Ok(()) => {
                // SAFETY: the C part's cqe is libibverbs' mirror of the ring's size.
                unsafe { (*cq).cqe = c_int::try_from(raw.nent().saturating_sub(1)).unwrap_or(c_int::MAX) };
                0
            }
            Err(e) => {
                log::info!("resize_cq: {e}");
                errno_of(&e)
            }
        }
    })
}

/// `ibv_modify_cq` (`verbs_context.modify_cq`): moderation, the one attribute (`mlx5_ib_modify_cq`). An
/// unknown attribute bit is `EINVAL`, as libibverbs' `ibv_cmd_modify_cq` refuses it; a device without
/// `cq_moderation` is `EOPNOTSUPP`, a period past 4,095 µs `EINVAL`.
pub(crate) unsafe extern "C" fn modify_cq(cq: *mut ibv_cq, attr: *mut ibv_modify_cq_attr) -> c_int {
    guard("ibv_modify_cq", libc::EIO, || {
        // SAFETY: the caller passes a live CQ.
        let Some((_, raw)) = (unsafe { cq_of(cq) }) else { return libc::EINVAL };
        if attr.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a non-null attr points to the caller's ibv_modify_cq_attr.
        let a = unsafe { *attr };
        if a.attr_mask & !IBV_CQ_ATTR_MODERATE != 0 {
            return libc::EINVAL;
        }
        if a.attr_mask == 0 {
            return 0;
        }
        match raw.modify_moderation(a.moderate.cq_count, a.moderate.cq_period) {
            Ok(()) => 0,
            Err(e) => {
                log::info!("modify_cq: {e}");
                errno_of(&e)
            }
        }
    })
}

/// IBV_QPT_RC (2), UC (3), UD (4).
fn qp_type(t: c_int) -> Result<QpType, c_int> {
    match t {
        2 => Ok(QpType::Rc),
        3 => Ok(QpType::Uc),
        4 => Ok(QpType::Ud),
        _ => Err(libc::EOPNOTSUPP),
    }
}

fn qp_type_num(t: QpType) -> c_int {
    match t {
        QpType::Rc => 2,
        QpType::Uc => 3,
        // No `ibv_create_qp` makes a special QP (libibverbs has no such type); each posts and completes as UD.
        QpType::Ud | QpType::Gsi | QpType::Smi => 4,
    }
}

/// The send operations `ibv_wr_*` supports here (`IBV_QP_EX_WITH_*`): RDMA_WRITE(_WITH_IMM), SEND(_WITH_IMM),
/// RDMA_READ, ATOMIC_CMP_AND_SWP, ATOMIC_FETCH_AND_ADD.
const SEND_OPS: u64 = 0b111_1111;

struct QpReq<'a> {
    pd: *mut ibv_pd,
    qp_context: *mut c_void,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    srq: *mut ibv_srq,
    cap: &'a mut ibv_qp_cap,
    qp_type: c_int,
    sq_sig_all: c_int,
    send_ops: u64,
    /// The port's GSI QP (QP1), asked for by the drop-in librdmacm through [`mlx5_rs_create_gsi_qp`] only.
    gsi: bool,
}

fn make_qp(r: QpReq<'_>) -> Result<*mut Qp, c_int> {
    // SAFETY: the caller passes live objects of this library (or NULL).
    let (pd, send, recv) = unsafe { (pd_of(r.pd), cq_of(r.send_cq), cq_of(r.recv_cq)) };
    let (pd, (_, send), (_, recv)) = (pd.ok_or(libc::EINVAL)?, send.ok_or(libc::EINVAL)?, recv.ok_or(libc::EINVAL)?);
    // SAFETY: as above.
    let srq = if r.srq.is_null() { None } else { Some(unsafe { srq_of(r.srq) }.ok_or(libc::EINVAL)?) };
    let ty = if r.gsi { QpType::Gsi } else { qp_type(r.qp_type)? };
    refuse_huge("MLX_QP_ALLOC_TYPE")?;
    // SAFETY: the PD's context is open.
    let c = unsafe { ctx(pd.c.context) }.ok_or(libc::EINVAL)?;
    // As libmlx5 checks before sizing the queues: no more work requests or SGEs than the device has.
    let (max_wr, max_sge) = qp_limits(c)?;
    let k = &r.cap;
    let recv_too_big = srq.is_none() && (k.max_recv_wr > max_wr || k.max_recv_sge > max_sge);
    if k.max_send_wr > max_wr || k.max_send_sge > max_sge || recv_too_big {
        return Err(libc::EINVAL);
    }
    let cap = QpCap {
        max_send_wr: r.cap.max_send_wr,
        max_recv_wr: if srq.is_some() { 0 } else { r.cap.max_recv_wr },
        max_send_sge: r.cap.max_send_sge,
        max_recv_sge: if srq.is_some() { 0 } else { r.cap.max_recv_sge },
        max_inline_data: r.cap.max_inline_data,
    };
    let attr = CoreQpInitAttr { qp_type: ty, cap, sq_sig_all: r.sq_sig_all != 0 };
    let raw = pd.raw.create_qp(send, recv, attr, srq.map(|s| &*s.raw), r.qp_context as u64).map_err(|e| {
        log::info!("create_qp: {e}");
        errno_of(&e)
    })?;
    // SAFETY: the caller's live PD (a parent domain's allocator is asked for the rings and doorbell record).
    if let Err(e) = unsafe { ask_allocator(r.pd, raw.buf_bytes(), RES_TYPE_QP) } {
        if let Err(d) = raw.destroy() {
            log::error!("create_qp: the QP refused by the allocator could not be destroyed: {d}");
        }
        return Err(e);
    }
    let got = raw.cap();
    *r.cap = ibv_qp_cap {
        max_send_wr: got.max_send_wr,
        max_recv_wr: got.max_recv_wr,
        max_send_sge: got.max_send_sge,
        max_recv_sge: got.max_recv_sge,
        max_inline_data: got.max_inline_data,
    };
    // SAFETY: every field of ibv_qp_ex is an integer, array, Option<fn> or raw pointer: zero is valid.
    let mut qx: ibv_qp_ex = unsafe { std::mem::zeroed() };
    let b = &mut qx.qp_base;
    b.context = pd.c.context;
    b.qp_context = r.qp_context;
    b.pd = r.pd;
    b.send_cq = r.send_cq;
    b.recv_cq = r.recv_cq;
    b.srq = r.srq;
    b.handle = raw.qpn();
    b.qp_num = raw.qpn();
    b.state = 0;
    b.qp_type = qp_type_num(ty);
    crate::post::fill_qp_ex(&mut qx, r.send_ops);
    let qpn = raw.qpn();
    let p = Box::into_raw(Box::new(Qp {
        c: qx,
        raw: Held::new(raw),
        qp_type: ty,
        link: link(c),
        ctx: c,
        wr: Mutex::new(Default::default()),
        async_events: AsyncCount::default(),
    }));
    // SAFETY: p is the live box made above, not yet shared.
    crate::post::set_ops(unsafe { &*p }, r.send_ops);
    lock(&c.objs).qps.insert(qpn, p as usize);
    hold(pd.c.context, Kind::Qp, p);
    // SAFETY: the caller's live PD.
    unsafe { count_on_parent(r.pd, true) };
    Ok(p)
}

/// `ibv_create_qp`'s work, for it and for the GSI QP's private export: the attributes as a `QpReq`, the QP made.
///
/// # Safety
/// `pd` and `attr` as `ibv_create_qp` takes them.
unsafe fn create_qp_from(name: &str, pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr, gsi: bool) -> *mut ibv_qp {
    guard(name, ptr::null_mut(), || {
        // SAFETY: the caller passes its attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else { return fail(libc::EINVAL) };
        let req = QpReq {
            pd,
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: &mut a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
            send_ops: 0,
            gsi,
        };
        match make_qp(req) {
            Ok(p) => p.cast(),
            Err(e) => fail(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    // SAFETY: the caller's contract, passed on.
    unsafe { create_qp_from("ibv_create_qp", pd, attr, false) }
}

/// The port's general services QP (QP1, created as mlx5_ib's hardware GSI QP), for the drop-in `librdmacm.so.1`
/// only: libibverbs has no QP type for it (the kernel's CM owns QP1), so it is a private export
/// (`MLX5_RS_PRIVATE_1`). It posts and completes as a UD QP; `attr.qp_type` is ignored.
#[no_mangle]
pub unsafe extern "C" fn mlx5_rs_create_gsi_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    // SAFETY: the caller's contract, passed on.
    unsafe { create_qp_from("mlx5_rs_create_gsi_qp", pd, attr, true) }
}

/// `verbs_context.create_qp_ex`: a PD, and the `ibv_wr_*` send operations this library builds; anything else
/// (XRC, RSS, TSO, create flags other than the two that ask nothing here, source QPN) is `EOPNOTSUPP`.
pub(crate) unsafe extern "C" fn create_qp_ex(
    _context: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard("ibv_create_qp_ex", ptr::null_mut(), || {
        // SAFETY: the caller passes its attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else { return fail(libc::EINVAL) };
        const PD: u32 = 1 << 0;
        const CREATE_FLAGS: u32 = 1 << 2;
        const MAX_TSO_HEADER: u32 = 1 << 3;
        const SEND_OPS_FLAGS: u32 = 1 << 6;
        // IBV_QP_CREATE_BLOCK_SELF_MCAST_LB holds trivially (no multicast is delivered here, so none loops
        // back); IBV_QP_CREATE_SCATTER_FCS is dropped as mlx5_ib drops it where it does not apply.
        const HARMLESS_FLAGS: u32 = (1 << 1) | (1 << 8);
        // Other create flags and a TSO header size are accepted when they ask for nothing.
        let asks = |bit: u32, v: u64| a.comp_mask & bit != 0 && v != 0;
        if a.comp_mask & !(PD | CREATE_FLAGS | MAX_TSO_HEADER | SEND_OPS_FLAGS) != 0
            || a.comp_mask & PD == 0
            || asks(CREATE_FLAGS, (a.create_flags & !HARMLESS_FLAGS).into())
            || asks(MAX_TSO_HEADER, a.max_tso_header.into())
        {
            return fail(libc::EOPNOTSUPP);
        }
        let send_ops = if a.comp_mask & SEND_OPS_FLAGS != 0 { a.send_ops_flags } else { 0 };
        if send_ops & !SEND_OPS != 0 {
            return fail(libc::EOPNOTSUPP);
        }
        let req = QpReq {
            pd: a.pd,
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: &mut a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
            send_ops,
            gsi: false,
        };
        match make_qp(req) {
            Ok(p) => p.cast(),
            Err(e) => fail(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    // Every QP of this library is an ibv_qp_ex; a QP made without send_ops_flags has every wr_* set to a
    // function that fails the batch.
    qp.cast()
}

fn qp_state(s: c_int) -> Result<QpState, c_int> {
    Ok(match s {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqd,
        5 => QpState::Sqe,
        6 => QpState::Err,
        _ => return Err(libc::EINVAL),
    })
}

fn qp_state_num(s: QpState) -> c_int {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Sqd => 4,
        QpState::Sqe => 5,
        QpState::Err | QpState::Unknown(_) => 6,
    }
}

fn mtu(m: c_int) -> Result<Mtu, c_int> {
    Ok(match m {
        1 => Mtu::M256,
        2 => Mtu::M512,
        3 => Mtu::M1024,
        4 => Mtu::M2048,
        5 => Mtu::M4096,
        _ => return Err(libc::EINVAL),
    })
}

/// How long an address handle to an IPv4 GID waits for an ARP answer on a VDE fabric.
const VDE_RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// The MAC of a RoCE destination GID, as the kernel's neighbour resolution (`ib_resolve_eth_dmac`) would find
/// it: a link-local GID carries it (EUI-64); an IPv4-mapped GID is looked up among the simulated fabric's hosts
/// (`SimConfig::next_host`'s addresses), which is where every peer of a simulated device lives, then among the
/// neighbours a simulated port learned from ARP (a guest on a `wire=qemu` port). Anything else
/// stays unresolved (zero), and firmware refuses the path, as a kernel without a neighbour entry would.
fn resolve_dmac(dgid: &[u8; 16]) -> [u8; 6] {
    if dgid[..8] == [0xfe, 0x80, 0, 0, 0, 0, 0, 0] {
        return mlx5_verbs::mac_of_gid(dgid);
    }
    if dgid[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] {
        let ip = [dgid[12], dgid[13], dgid[14], dgid[15]];
        let mut cfg = mlx5_sim::SimConfig::default();
        for _ in 0..64 {
            if cfg.ipv4_addrs.contains(&ip) {
                return cfg.mac;
            }
            cfg = cfg.next_host();
        }
        // A host outside the simulated fabric (a QEMU guest on a `wire=qemu` port) is known once ARP named it.
        if let Some(mac) = mlx5_sim::arp_neighbour(ip) {
            return mac;
        }
        // A peer on a VDE fabric (`wire=vde`): asked by ARP and waited for, as the kernel's resolution waits.
        if let Some(mac) = mlx5_sim::vde::resolve(ip, VDE_RESOLVE_TIMEOUT) {
            return mac;
        }
    }
    [0; 6]
}

/// An address vector from `ibv_ah_attr`; on RoCE the destination MAC is resolved from the GID.
pub(crate) fn ah_attr(a: &ibv_ah_attr, link: LinkLayer) -> AhAttr {
    let grh = (a.is_global != 0).then_some(Grh {
        dgid: a.grh.dgid.raw,
        flow_label: a.grh.flow_label,
        sgid_index: a.grh.sgid_index,
        hop_limit: a.grh.hop_limit,
        traffic_class: a.grh.traffic_class,
    });
    let dmac = match (&grh, link) {
        (Some(g), LinkLayer::Ethernet) => resolve_dmac(&g.dgid),
        _ => [0; 6],
    };
    AhAttr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        grh,
        dmac,
        port_num: a.port_num.max(1),
    }
}

fn ah_attr_c(a: &AhAttr) -> ibv_ah_attr {
    let mut c = ibv_ah_attr {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        port_num: a.port_num,
        ..Default::default()
    };
    if let Some(g) = a.grh {
        c.is_global = 1;
        c.grh = ibv_global_route {
            dgid: ibv_gid { raw: g.dgid },
            flow_label: g.flow_label,
            sgid_index: g.sgid_index,
            hop_limit: g.hop_limit,
            traffic_class: g.traffic_class,
        };
    }
    c
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    guard("ibv_modify_qp", libc::EIO, || {
        // SAFETY: the caller passes a live QP and its attributes.
        let (Some(q), Some(a)) = (unsafe { qp_of(qp) }, unsafe { attr.as_ref() }) else { return libc::EINVAL };
        let mask = QpAttrMask(mask as u32);
        let mut m = QpAttr::default();
        let has = |bit: QpAttrMask| mask.contains(bit);
        if has(QpAttrMask::STATE) {
            m.qp_state = match qp_state(a.qp_state) {
                Ok(s) => s,
                Err(e) => return e,
            };
        }
        if has(QpAttrMask::PATH_MTU) {
            m.path_mtu = match mtu(a.path_mtu) {
                Ok(v) => v,
                Err(e) => return e,
            };
        }
        m.qp_access_flags = Access(a.qp_access_flags);
        m.pkey_index = a.pkey_index;
        m.port_num = a.port_num;
        m.qkey = a.qkey;
        m.ah_attr = ah_attr(&a.ah_attr, q.link);
        m.timeout = a.timeout;
        m.retry_cnt = a.retry_cnt;
        m.rnr_retry = a.rnr_retry;
        m.rq_psn = a.rq_psn;
        m.sq_psn = a.sq_psn;
        m.max_rd_atomic = a.max_rd_atomic;
        m.max_dest_rd_atomic = a.max_dest_rd_atomic;
        m.min_rnr_timer = a.min_rnr_timer;
        m.dest_qp_num = a.dest_qp_num;
        match q.raw.modify(&m, mask) {
            Ok(()) => {
                if has(QpAttrMask::STATE) {
                    // SAFETY: the C part's state is libibverbs' mirror of the QP's state.
                    unsafe { (*qp).state = a.qp_state };
                }
                0
            }
            Err(e) => {
                log::info!("modify_qp {:#x}: {e}", q.raw.qpn());
                errno_of(&e)
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard("ibv_query_qp", libc::EIO, || {
        // SAFETY: the caller passes a live QP.
        let Some(q) = (unsafe { qp_of(qp) }) else { return libc::EINVAL };
        if attr.is_null() {
            return libc::EINVAL;
        }
        let r = match q.raw.query() {
            Ok(r) => r,
            Err(e) => return errno_of(&e),
        };
        let cap = ibv_qp_cap {
            max_send_wr: r.cap.max_send_wr,
            max_recv_wr: r.cap.max_recv_wr,
            max_send_sge: r.cap.max_send_sge,
            max_recv_sge: r.cap.max_recv_sge,
            max_inline_data: r.cap.max_inline_data,
        };
        let a = ibv_qp_attr {
            qp_state: qp_state_num(r.qp_state),
            cur_qp_state: qp_state_num(r.cur_qp_state),
            path_mtu: c_int::from(r.path_mtu),
            path_mig_state: match r.path_mig_state {
                mlx5_core::qp::MigState::Migrated => 0,
                mlx5_core::qp::MigState::Rearm => 1,
                _ => 2,
            },
            qkey: r.qkey,
            rq_psn: r.rq_psn,
            sq_psn: r.sq_psn,
            dest_qp_num: r.dest_qp_num,
            qp_access_flags: r.qp_access_flags.0,
            cap,
            ah_attr: ah_attr_c(&r.ah_attr),
            alt_ah_attr: ibv_ah_attr::default(),
            pkey_index: r.pkey_index,
            alt_pkey_index: 0,
            en_sqd_async_notify: u8::from(r.en_sqd_async_notify),
            sq_draining: u8::from(r.sq_draining),
            max_rd_atomic: r.max_rd_atomic,
            max_dest_rd_atomic: r.max_dest_rd_atomic,
            min_rnr_timer: r.min_rnr_timer,
            port_num: r.port_num,
            timeout: r.timeout,
            retry_cnt: r.retry_cnt,
            rnr_retry: r.rnr_retry,
            alt_port_num: 0,
            alt_timeout: 0,
            rate_limit: 0,
        };
        // SAFETY: the caller's attr is writable.
        unsafe { attr.write(a) };
        // SAFETY: the caller's init is NULL or writable; the QP's C part is readable.
        if let Some(i) = unsafe { init.as_mut() } {
            let b = &q.c.qp_base;
            i.qp_context = b.qp_context;
            i.send_cq = b.send_cq;
            i.recv_cq = b.recv_cq;
            i.srq = b.srq;
            i.cap = cap;
            i.qp_type = b.qp_type;
            i.sq_sig_all = c_int::from(r.sq_sig_all);
        }
        // SAFETY: as in ibv_modify_qp.
        unsafe { (*qp).state = qp_state_num(r.qp_state) };
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard("ibv_destroy_qp", libc::EIO, || {
        // SAFETY: the caller passes a live QP (or one its closed context left, still allocated).
        let Some(q) = (unsafe { qp_of(qp) }) else { return unsafe { refused(qp) } };
        match q.raw.destroy() {
            Ok(()) => {
                // SAFETY: the context outlives its objects.
                q.async_events.retire(&unsafe { &*q.ctx }.objs, |o| {
                    o.qps.remove(&q.raw.qpn());
                });
                let context = q.c.qp_base.context;
                // SAFETY: the QP's PD outlives it.
                unsafe { count_on_parent(q.c.qp_base.pd, false) };
                // SAFETY: boxed by ibv_create_qp; destroyed once.
                drop(unsafe { Box::from_raw(qp.cast::<Qp>()) });
                release(context, qp);
                0
            }
            Err(e) => errno_of(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    guard("ibv_create_srq", ptr::null_mut(), || {
        // SAFETY: the caller passes a live PD and its attributes.
        let (Some(p), Some(a)) = (unsafe { pd_of(pd) }, unsafe { attr.as_mut() }) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: the PD's context is open.
        let Some(c) = (unsafe { ctx(p.c.context) }) else { return fail(libc::EINVAL) };
        if let Err(e) = refuse_huge("MLX_SRQ_ALLOC_TYPE") {
            return fail(e);
        }
        let sa = SrqAttr { max_wr: a.attr.max_wr, max_sge: a.attr.max_sge, srq_limit: a.attr.srq_limit };
        match p.raw.create_srq(sa) {
            Ok(raw) => {
                // SAFETY: the caller's live PD.
                let asked = unsafe { ask_allocator(pd, raw.buf_bytes(), RES_TYPE_SRQ) };
                if let Err(e) = asked {
                    if let Err(d) = raw.destroy() {
                        log::error!("create_srq: the SRQ refused by the allocator could not be destroyed: {d}");
                    }
                    return fail(e);
                }
                if let Ok(q) = raw.query() {
                    a.attr.max_wr = q.max_wr;
                    a.attr.max_sge = q.max_sge;
                }
                // SAFETY: every field of ibv_srq is an integer, array or raw pointer: zero is valid.
                let mut cs: ibv_srq = unsafe { std::mem::zeroed() };
                cs.context = p.c.context;
                cs.srq_context = a.srq_context;
                cs.pd = pd;
                cs.handle = raw.srqn();
                let srqn = raw.srqn();
                let raw = Held::new(raw);
                let b = Box::into_raw(Box::new(Srq { c: cs, raw, ctx: c, async_events: AsyncCount::default() }));
                lock(&c.objs).srqs.insert(srqn, b as usize);
                hold(p.c.context, Kind::Srq, b);
                // SAFETY: the caller's live PD.
                unsafe { count_on_parent(pd, true) };
                b.cast()
            }
            Err(e) => fail(errno_of(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, mask: c_int) -> c_int {
    guard("ibv_modify_srq", libc::EIO, || {
        // SAFETY: the caller passes a live SRQ and its attributes.
        let (Some(s), Some(a)) = (unsafe { srq_of(srq) }, unsafe { attr.as_ref() }) else {
            return libc::EINVAL;
        };
        let sa = SrqAttr { max_wr: a.max_wr, max_sge: a.max_sge, srq_limit: a.srq_limit };
        match s.raw.modify(sa, SrqAttrMask(mask as u32)) {
            Ok(()) => 0,
            Err(e) => errno_of(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    guard("ibv_query_srq", libc::EIO, || {
        // SAFETY: the caller passes a live SRQ and a writable attribute.
        let (Some(s), Some(a)) = (unsafe { srq_of(srq) }, unsafe { attr.as_mut() }) else {
            return libc::EINVAL;
        };
        match s.raw.query() {
            Ok(q) => {
                *a = ibv_srq_attr { max_wr: q.max_wr, max_sge: q.max_sge, srq_limit: q.srq_limit };
                0
            }
            Err(e) => errno_of(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    guard("ibv_destroy_srq", libc::EIO, || {
        // SAFETY: the caller passes a live SRQ (or one its closed context left, still allocated).
        let Some(s) = (unsafe { srq_of(srq) }) else { return unsafe { refused(srq) } };
        match s.raw.destroy() {
            Ok(()) => {
                // SAFETY: the context outlives its objects.
                s.async_events.retire(&unsafe { &*s.ctx }.objs, |o| {
                    o.srqs.remove(&s.raw.srqn());
                });
                let context = s.c.context;
                // SAFETY: the SRQ's PD outlives it.
                unsafe { count_on_parent(s.c.pd, false) };
                // SAFETY: boxed by ibv_create_srq; destroyed once.
                drop(unsafe { Box::from_raw(srq.cast::<Srq>()) });
                release(context, srq);
                0
            }
            Err(e) => errno_of(&e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    guard("ibv_create_ah", ptr::null_mut(), || {
        // SAFETY: the caller passes a live PD and its attributes.
        let (Some(p), Some(a)) = (unsafe { pd_of(pd) }, unsafe { attr.as_ref() }) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: the PD's context is open.
        let Some(c) = (unsafe { ctx(p.c.context) }) else { return fail(libc::EINVAL) };
        let l = link(c);
        if l == LinkLayer::Ethernet && a.is_global == 0 {
            // RoCE addresses need a GRH (mlx5_ib refuses without one).
            return fail(libc::EINVAL);
        }
        // As the kernel's create_ah checks: a port the device has (`rdma_is_port_valid`), and a GRH's source GID
        // entry holding a GID (`rdma_get_gid_attr`: EINVAL past the table, ENODATA for an empty entry); else
        // the AH would send from an address the port does not own.
        if a.is_global != 0 || a.port_num != 1 {
            match gid(c, a.port_num, c_int::from(a.grh.sgid_index)) {
                Ok(Some(_)) => {}
                Ok(None) => return fail(libc::ENODATA),
                Err(e) => return fail(e),
            }
        }
        match p.raw.create_ah(&ah_attr(a, l)) {
            Ok(ah) => {
                // SAFETY: the caller's live PD.
                unsafe { count_on_parent(pd, true) };
                let b = Box::into_raw(Box::new(Ah { c: ibv_ah { context: p.c.context, pd, handle: 0 }, ah }));
                hold(p.c.context, Kind::Ah, b);
                b.cast()
            }
            Err(e) => fail(errno_of(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    if ah.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: boxed by ibv_create_ah; destroyed once (an AH has no firmware object: mlx5 AVs live in the WQE). One
    // its closed context left is freed here too, as libmlx5 frees an AH it made without the kernel.
    let b = unsafe { Box::from_raw(ah.cast::<Ah>()) };
    let context = b.c.context;
    // SAFETY: the AH's PD outlives it (a closed context's PD is refused, so not counted on).
    unsafe { count_on_parent(b.c.pd, false) };
    drop(b);
    release(context, ah);
    0
}

/// `ibv_init_ah_from_wc`: the reply address of a received UD datagram, as rdma-core finds it
/// (`mlx5_core::ah::init_ah_from_wc`): an IPv6 GRH's addresses swapped, or on RoCE v2 over IPv4 the IPv4 header
/// in the last 20 bytes of the receive buffer's 40, read as IPv4-mapped GIDs.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut c_void,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    guard("ibv_init_ah_from_wc", -1, || {
        // SAFETY: the caller passes a completion and a writable attribute.
        let (Some(w), Some(out)) = (unsafe { wc.as_ref() }, unsafe { ah_attr.as_mut() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: the caller passes an open context.
        let Some(c) = (unsafe { ctx(context) }) else { return -1 };
        // A RoCE datagram always carries its network header (rdma-core asks the GRH flag only on InfiniBand).
        let global = w.wc_flags & 1 != 0 || link(c) == LinkLayer::Ethernet;
        let flags = if global { mlx5_core::cq::WcFlags::GRH } else { mlx5_core::cq::WcFlags::default() };
        let wc = mlx5_core::cq::WorkCompletion {
            slid: w.slid,
            sl: w.sl,
            dlid_path_bits: w.dlid_path_bits,
            wc_flags: flags,
            ..Default::default()
        };
        let g = if global && !grh.is_null() {
            // SAFETY: the caller's receive buffer starts with the 40-byte GRH room.
            Some(unsafe { &*grh.cast::<[u8; 40]>() })
        } else {
            None
        };
        match c.ctx.init_ah_from_wc(port_num, &wc, g) {
            Ok(a) => {
                *out = ibv_ah_attr {
                    dlid: a.dlid,
                    sl: a.sl,
                    src_path_bits: a.src_path_bits,
                    static_rate: a.static_rate,
                    port_num: a.port_num,
                    ..Default::default()
                };
                if let Some(h) = a.grh {
                    out.is_global = 1;
                    out.grh = ibv_global_route {
                        dgid: ibv_gid { raw: h.dgid },
                        flow_label: h.flow_label,
                        sgid_index: h.sgid_index,
                        hop_limit: h.hop_limit,
                        traffic_class: h.traffic_class,
                    };
                }
                0
            }
            Err(e) => {
                log::info!("init_ah_from_wc: {e}");
                set_errno(errno_of(&e));
                -1
            }
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut c_void,
    port_num: u8,
) -> *mut ibv_ah {
    guard("ibv_create_ah_from_wc", ptr::null_mut(), || {
        // SAFETY: the caller passes a live PD.
        let Some(p) = (unsafe { pd_of(pd) }) else { return fail(libc::EINVAL) };
        let mut a = ibv_ah_attr::default();
        // SAFETY: forwarded contract.
        if unsafe { ibv_init_ah_from_wc(p.c.context, port_num, wc, grh, &mut a) } != 0 {
            return ptr::null_mut();
        }
        // SAFETY: forwarded contract.
        unsafe { ibv_create_ah(pd, &mut a) }
    })
}

//! A context's life and its async events: `ibv_open_device` builds the context and plugs the verbs of the
//! layers below into its tables (the objects' extended creates, the datapath's `ibv_context_ops`),
//! `ibv_close_device` destroys what it left, and `ibv_get_async_event` / `ibv_ack_async_event` name the CQ, QP or
//! SRQ an event is about. It sits above `device`, `queue`, `objects` and `post`, which never call up into it.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::Mutex;
use std::time::Duration;

use mlx5_verbs::{AsyncEvent, QpErrorKind};

use crate::abi::*;
use crate::device::{ctx_of, dev_of, of_this_process, query_device_ex, query_port_ex, tracer, Ctx};
use crate::queue::{Cq, Qp, Srq};
use crate::uobject::{lock, AsyncCount, Kind};
use crate::{errno_of, guard, set_errno};

/// Open contexts, for `ibv_ack_async_event` of device events (the event does not name its context).
static OPEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// rdma-core's mlx5 variable: `1` drops the queues' locks (the program uses the verbs from one thread).
const SINGLE_THREADED_ENV: &str = "MLX5_SINGLE_THREADED";

/// Whether the variable's value asks for single-threaded queues: exactly `1`, as rdma-core's
/// `single_threaded_app` reads it.
fn single_threaded(v: Option<&std::ffi::OsStr>) -> bool {
    v.is_some_and(|v| v == "1")
}

#[no_mangle]
pub extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    guard("ibv_open_device", ptr::null_mut(), || {
        let Some(dev) = dev_of(device) else {
            set_errno(libc::ENODEV);
            return ptr::null_mut();
        };
        let faults = match std::env::var(crate::faults::FAULTS_ENV).map(|s| crate::faults::parse(&s)) {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                eprintln!("libibverbs(mlx5-rs): {}: {e}", crate::faults::FAULTS_ENV);
                set_errno(libc::EINVAL);
                return ptr::null_mut();
            }
            Err(_) => Vec::new(),
        };
        // The device's threads start here: with every signal blocked, so a program's signal reaches its own
        // threads (and interrupts its waits in this library, see `signals`).
        let Some(opened) = crate::signals::quiet(|| dev.dev.open_with(tracer(dev.dev.name()))) else {
            log::error!("open {}: no thread to open it on", dev.dev.name());
            set_errno(libc::EAGAIN);
            return ptr::null_mut();
        };
        let ctx = match opened {
            Ok(c) => c,
            Err(e) => {
                // On stderr whatever MLX5_RS_LOG says (as libibverbs prints its warnings): a program shows only
                // "Couldn't get context", so this line is the one place the reason appears.
                eprintln!("libibverbs(mlx5-rs): cannot open {}: {e}", dev.dev.name());
                set_errno(errno_of(&e));
                return ptr::null_mut();
            }
        };
        let single = single_threaded(std::env::var_os(SINGLE_THREADED_ENV).as_deref());
        if single {
            // SAFETY: `MLX5_SINGLE_THREADED=1` is the program's promise that it calls the verbs from one thread at
            // a time, as rdma-core's mlx5 provider reads it; this library's own threads never take a queue's lock.
            unsafe { ctx.set_single_threaded() };
        }
        if let Some(sim) = dev.dev.sim_device() {
            if !faults.is_empty() && !dev.armed.swap(true, std::sync::atomic::Ordering::AcqRel) {
                crate::faults::arm(sim, &faults);
            }
        }
        let vectors = ctx.num_comp_vectors().unwrap_or(1);
        // SAFETY: opens /dev/null: a descriptor with no kernel meaning, standing for uverbs' command fd.
        let cmd_fd = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        let async_fd = ctx.async_fd().unwrap_or(-1);
        // SAFETY: every field of verbs_context is an integer, array, Option<fn> or raw pointer: zero is valid.
        let mut vc: verbs_context = unsafe { std::mem::zeroed() };
        vc.query_port = Some(query_port_ex);
        vc.query_device_ex = Some(query_device_ex);
        vc.create_cq_ex = Some(crate::objects::create_cq_ex);
        vc.modify_cq = Some(crate::objects::modify_cq);
        vc.create_qp_ex = Some(crate::objects::create_qp_ex);
        vc.alloc_parent_domain = Some(crate::objects::alloc_parent_domain);
        vc.alloc_td = Some(crate::objects::alloc_td);
        vc.dealloc_td = Some(crate::objects::dealloc_td);
        vc.sz = std::mem::size_of::<verbs_context>();
        let c = &mut vc.context;
        c.device = device;
        c.ops = crate::post::context_ops(single);
        c.cmd_fd = cmd_fd;
        c.async_fd = async_fd;
        c.num_comp_vectors = c_int::from(vectors);
        c.abi_compat = usize::MAX as *mut c_void;
        let b = Box::new(Ctx::new(vc, dev, ctx));
        let p = Box::into_raw(b);
        lock(&OPEN).push(p as usize);
        // SAFETY: just made from a live box.
        unsafe { (*p).c() }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    guard("ibv_close_device", libc::EIO, || {
        // SAFETY: the caller passes a context it opened.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return libc::EINVAL };
        let p = std::ptr::from_ref(ctx).cast_mut();
        lock(&OPEN).retain(|&x| x != p as usize);
        let left: Vec<(usize, Kind)> = ctx.close();
        if left.is_empty() {
            // SAFETY: the Ctx was boxed by ibv_open_device, is closed and no object refers to it.
            unsafe { free_ctx(p) };
            return 0;
        }
        // As the kernel at the close of a uverbs file: what the context left is destroyed, so the device (and
        // its wire) goes with the last context, and the next open is a fresh one.
        log::info!("ibv_close_device with {} objects alive: destroyed; their structs stay, refused", left.len());
        // SAFETY: the objects are this closed context's; from now on every call on them is refused.
        unsafe { crate::objects::release_leftovers(ctx, left) };
        // The closed context stays allocated (objects still point at it). Its descriptor is closed once, and its
        // Rust context released once, after every object let go of theirs; the last context of a device tears
        // its HCA down here.
        if ctx.vc.context.cmd_fd >= 0 {
            // SAFETY: the descriptor was opened by ibv_open_device and is closed once (the context is closed).
            unsafe { libc::close(ctx.vc.context.cmd_fd) };
        }
        // SAFETY: closed: every entry point refuses the context and its objects before reaching the handle.
        unsafe { ctx.ctx.release() };
        0
    })
}

/// Frees a closed context with no objects.
///
/// # Safety
/// `p` came from `ibv_open_device`, is closed, and nothing refers to it any more.
unsafe fn free_ctx(p: *mut Ctx) {
    // SAFETY: the caller's duty.
    let b = unsafe { Box::from_raw(p) };
    if b.vc.context.cmd_fd >= 0 {
        // SAFETY: the descriptor was opened by ibv_open_device and is closed once.
        unsafe { libc::close(b.vc.context.cmd_fd) };
    }
    // The last context of a device tears its HCA down here (an open racing it waits for that in mlx5-verbs).
    drop(b);
}

/// The C event for `e`, or `None` when it names a CQ, QP or SRQ this context no longer has: destroyed after the
/// event was queued (mlx5-verbs drops queued events at destroy; this closes the race with a destroy on another
/// thread), so the event is dropped as Linux drops it rather than handed out with a NULL element.
fn event_of(ctx: &Ctx, e: AsyncEvent) -> Option<ibv_async_event> {
    let objs = lock(&ctx.objs);
    let obj = |m: &HashMap<u32, usize>, n: u32| m.get(&n).copied().unwrap_or(0) as *mut c_void;
    let port = |p: u8| usize::from(p) as *mut c_void;
    let (element, event_type) = match e {
        AsyncEvent::CqError { cqn, .. } => (obj(&objs.cqs, cqn), 0),
        AsyncEvent::QpError { qpn, kind } => (
            obj(&objs.qps, qpn),
            match kind {
                QpErrorKind::Catastrophic => 1,
                QpErrorKind::InvalidRequest => 2,
                QpErrorKind::AccessError => 3,
            },
        ),
        AsyncEvent::CommEst { qpn } => (obj(&objs.qps, qpn), 4),
        AsyncEvent::SqDrained { qpn } => (obj(&objs.qps, qpn), 5),
        AsyncEvent::PathMig { qpn } => (obj(&objs.qps, qpn), 6),
        AsyncEvent::PathMigErr { qpn } => (obj(&objs.qps, qpn), 7),
        AsyncEvent::DeviceFatal => (ptr::null_mut(), 8),
        AsyncEvent::PortActive { port: p } => (port(p), 9),
        AsyncEvent::PortErr { port: p } => (port(p), 10),
        AsyncEvent::LidChange { port: p } => (port(p), 11),
        AsyncEvent::PkeyChange { port: p } => (port(p), 12),
        AsyncEvent::ClientReregister { port: p } => (port(p), 17),
        AsyncEvent::GidChange { port: p } => (port(p), 18),
        AsyncEvent::SrqLimitReached { srqn } => (obj(&objs.srqs, srqn), 15),
        AsyncEvent::LastWqeReached { qpn } => (obj(&objs.qps, qpn), 16),
    };
    if element.is_null() && element_kind(event_type).is_some() {
        return None;
    }
    // The object the event names counts it as handed out, under the map lock its destroy retires it under.
    // SAFETY: `element` came from the object map just now, under its lock, so the object is live.
    if let Some(o) = unsafe { async_object(element, event_type) } {
        o.count.handed_out();
    }
    Some(ibv_async_event { element, event_type })
}

/// What an async event names: a CQ (IBV_EVENT_CQ_ERR), an SRQ (SRQ_ERR, SRQ_LIMIT_REACHED), a QP (the other
/// QP events), or nothing (port and device events).
enum Element {
    Cq,
    Qp,
    Srq,
}

fn element_kind(event_type: c_int) -> Option<Element> {
    match event_type {
        0 => Some(Element::Cq),
        1..=7 | 16 => Some(Element::Qp),
        14 | 15 => Some(Element::Srq),
        _ => None,
    }
}

/// The object an async event names: its event count, its context, and the counter of acknowledged events
/// libibverbs keeps in its C struct (`events_completed`).
struct AsyncObject<'a> {
    count: &'a AsyncCount,
    ctx: *const Ctx,
    completed: *mut u32,
}

/// The object an event names, if it names one.
///
/// # Safety
/// `element` is NULL or, for an object event, a live object of this library of the kind the type says.
unsafe fn async_object<'a>(element: *mut c_void, event_type: c_int) -> Option<AsyncObject<'a>> {
    if element.is_null() {
        return None;
    }
    // SAFETY: the caller's promise; each object's C struct is the first field of its box.
    unsafe {
        Some(match element_kind(event_type)? {
            Element::Cq => {
                let o = element.cast::<Cq>();
                let completed = &raw mut (*o).c.cq.async_events_completed;
                AsyncObject { count: &(*o).async_events, ctx: (*o).ctx, completed }
            }
            Element::Qp => {
                let o = element.cast::<Qp>();
                let completed = &raw mut (*o).c.qp_base.events_completed;
                AsyncObject { count: &(*o).async_events, ctx: (*o).ctx, completed }
            }
            Element::Srq => {
                let o = element.cast::<Srq>();
                AsyncObject { count: &(*o).async_events, ctx: (*o).ctx, completed: &raw mut (*o).c.events_completed }
            }
        })
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int {
    guard("ibv_get_async_event", -1, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return -1 };
        if event.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // As ibv_get_cq_event: a descriptor the program made non-blocking gets one look, then EAGAIN.
        // SAFETY: the context is open.
        let nonblocking = crate::is_nonblocking(unsafe { (*context).async_fd });
        let next = || {
            while let Some(e) = ctx.ctx.get_async_event(Duration::ZERO) {
                match event_of(ctx, e) {
                    Some(ev) => return Some(ev),
                    // Taken from the queue but never handed out: acknowledged here, and the next one looked for.
                    None => drop(ctx.ctx.ack_async_event(&e)),
                }
            }
            None
        };
        // A blocking wait ends with EINTR on a program's signal, as libibverbs' read() of async_fd does.
        let got =
            if nonblocking { next().ok_or(libc::EAGAIN) } else { crate::signals::wait_for(ASYNC_EVENT_STEP, next) };
        match got {
            Ok(ev) => {
                // SAFETY: the caller's event is writable.
                unsafe { event.write(ev) };
                0
            }
            Err(e) => {
                set_errno(e);
                -1
            }
        }
    })
}

/// How long a blocking `ibv_get_async_event` sleeps between looks (the service thread moves async events every
/// 50 ms).
const ASYNC_EVENT_STEP: Duration = Duration::from_millis(1);

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    guard("ibv_ack_async_event", (), || {
        // SAFETY: the caller passes the event ibv_get_async_event filled.
        let Some(ev) = (unsafe { event.as_ref() }) else { return };
        // An event naming an object: acknowledged on the object's context and counted on the object (its
        // destroy waits for that), with the program-visible counter libibverbs keeps.
        // SAFETY: an object named by an unacknowledged event is live (its destroy waits for this call), or the
        // shell of one its closed context left (never freed).
        if let Some(AsyncObject { count, ctx, completed }) = unsafe { async_object(ev.element, ev.event_type) } {
            // The context first: once the object's count is acknowledged, its destroy may free the object.
            // SAFETY: the context outlives its objects; closed, it has no events left to acknowledge.
            if let Some(ctx) = unsafe { ctx.as_ref() }.filter(|c| !c.is_closed()) {
                let _ = ctx.ctx.ack_async_event(&AsyncEvent::DeviceFatal);
            }
            // SAFETY: the object is live while its count is held (its destroy waits on it).
            count.ack(|done| unsafe { completed.write(done) });
            return;
        }
        // A port or device event does not name its context: acknowledged on the first open context of this
        // process with one outstanding.
        let open = lock(&OPEN).clone();
        for p in open {
            // SAFETY: contexts in OPEN are live (removed before they are freed).
            let ctx = unsafe { &*(p as *const Ctx) };
            if of_this_process(ctx.dev) && ctx.ctx.unacked_async_events() > 0 {
                let _ = ctx.ctx.ack_async_event(&AsyncEvent::DeviceFatal);
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::single_threaded;
    use std::ffi::OsStr;

    #[test]
    fn only_the_value_1_asks_for_single_threaded_queues() {
        assert!(single_threaded(Some(OsStr::new("1"))));
        for v in ["0", "", "yes", "1 ", "01", "true"] {
            assert!(!single_threaded(Some(OsStr::new(v))), "{v:?}");
        }
        assert!(!single_threaded(None));
    }
}

//! Devices and contexts: the device list, open/close, the device, port, GID and P_Key queries, async events,
//! and the sysfs helpers programs call.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use mlx5_core::cq::LinkLayer;
use mlx5_core::hca::{GidType, Hca};
use mlx5_core::trace::CmdTrace;
use mlx5_verbs::devinfo::{self, DevInfo};
use mlx5_verbs::raw::{self, HcaVisitor};
use mlx5_verbs::tracefile::{SharedTrace, TraceSink};
use mlx5_verbs::{AnyDelay, AnyDma, AnyMmio, Context, Device, HostTables};

use crate::abi::*;
use crate::uobject::{lock, Held, Kind};
use crate::{guard, set_errno};

/// The PCI ids a ConnectX-5 reports (`vendor_part_id` 4119 makes perftest pick its ConnectX-5 defaults).
const PCI_IDS: (u16, u16) = (0x15b3, 0x1017);
/// `ibv_device_attr.vendor_id`: Mellanox's IEEE OUI, as the kernel reports it.
const VENDOR_OUI: u32 = 0x02c9;

/// One listed device: the C structure (shaped as libibverbs' `verbs_device`) and the Rust device.
#[repr(C)]
pub(crate) struct Dev {
    pub(crate) vd: verbs_device,
    pub(crate) dev: Device,
    pub(crate) index: usize,
    /// The fork generation whose list holds it ([`mlx5_verbs::fork_generation`]): in a forked child, the
    /// parent's devices and contexts run on threads that do not exist.
    pub(crate) gen: u64,
    /// Whether `MLX5_RS_FAULTS` was armed for this device (once, at its first open).
    pub(crate) armed: std::sync::atomic::AtomicBool,
}

// SAFETY: the C part holds only NULL pointers and bytes written once at creation; the Rust part is Sync.
unsafe impl Sync for Dev {}
// SAFETY: as above.
unsafe impl Send for Dev {}

/// One process's device list, made at its first listing and never freed (programs keep device pointers after
/// `ibv_free_device_list`). A forked child makes its own and keeps its parent's as `prev`, so a device pointer
/// the parent listed still opens the child's device of the same index.
struct DeviceList {
    gen: u64,
    devs: Result<Vec<&'static Dev>, c_int>,
    prev: *const DeviceList,
}

/// The current generation's list.
static DEVICES: AtomicPtr<DeviceList> = AtomicPtr::new(ptr::null_mut());

fn copy_str(dst: &mut [c_char], s: &str) {
    let room = dst.len().saturating_sub(1);
    for (d, b) in dst.iter_mut().zip(s.bytes().take(room)) {
        *d = b as c_char;
    }
}

/// This process's list (see [`DeviceList`]).
fn device_list() -> &'static DeviceList {
    let gen = mlx5_verbs::fork_generation();
    let mut cur = DEVICES.load(Ordering::Acquire);
    loop {
        // SAFETY: a non-null pointer here came from Box::into_raw below and is never freed.
        let old = unsafe { cur.as_ref() };
        if let Some(l) = old.filter(|l| l.gen == gen) {
            return l;
        }
        let made = Box::into_raw(Box::new(DeviceList { gen, devs: make_devices(gen), prev: cur }));
        match DEVICES.compare_exchange(cur, made, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: just published; never freed.
            Ok(_) => return unsafe { &*made },
            Err(now) => {
                // Another thread listed first; the devices made here stay unused (leaked like every `Dev`).
                // SAFETY: `made` came from Box::into_raw above and was never published.
                drop(unsafe { Box::from_raw(made) });
                cur = now;
            }
        }
    }
}

fn devices() -> Result<&'static [&'static Dev], c_int> {
    device_list().devs.as_deref().map_err(|e| *e)
}

fn make_devices(gen: u64) -> Result<Vec<&'static Dev>, c_int> {
    {
        let list = mlx5_verbs::devices().map_err(|e| {
            eprintln!("libibverbs(mlx5-rs): {e}");
            libc::EINVAL
        })?;
        Ok(list
            .into_iter()
            .enumerate()
            .map(|(index, dev)| {
                // SAFETY: every field of verbs_device is an integer, array or raw pointer: all zero is valid.
                let mut vd: verbs_device = unsafe { std::mem::zeroed() };
                let d = &mut vd.device;
                d.node_type = 1; // IBV_NODE_CA
                d.transport_type = 0; // IBV_TRANSPORT_IB
                copy_str(&mut d.name, dev.name());
                copy_str(&mut d.dev_name, &format!("uverbs{index}"));
                copy_str(&mut d.dev_path, &format!("/sys/class/infiniband_verbs/uverbs{index}"));
                copy_str(&mut d.ibdev_path, &format!("/sys/class/infiniband/{}", dev.name()));
                vd.refcount = 1;
                &*Box::leak(Box::new(Dev { vd, dev, index, gen, armed: Default::default() }))
            })
            .collect())
    }
}

/// The listed device behind a C device pointer, if it is one of ours. A pointer a parent process listed names
/// the device of the same index in this process's list.
pub(crate) fn dev_of(device: *mut ibv_device) -> Option<&'static Dev> {
    let now = device_list();
    let mine = |l: &'static DeviceList| l.devs.as_deref().ok()?.iter().copied().find(|d| ptr::eq(&d.vd.device, device));
    if let Some(d) = mine(now) {
        return Some(d);
    }
    let mut l = now.prev;
    // SAFETY: lists are never freed; each `prev` is an older published list or NULL.
    while let Some(old) = unsafe { l.as_ref() } {
        if let Some(d) = mine(old) {
            return now.devs.as_deref().ok()?.get(d.index).copied();
        }
        l = old.prev;
    }
    None
}

/// Whether a device or context of this library belongs to this process (not inherited from a parent across
/// `fork`, whose threads did not come along).
pub(crate) fn of_this_process(d: &Dev) -> bool {
    // The device list that made `d` registered the fork handler: the generation is one load.
    d.gen == mlx5_verbs::fork_generation_now()
}

/// An open context: the `verbs_context` (whose `ibv_context` programs hold), then the Rust state.
///
/// Closed with objects alive (qperf deallocates its PD before deregistering its MR), it destroys them as the
/// kernel's uverbs destroys what a closed file left (`uverbs_destroy_ufile_hw`), lets go of the device, and
/// stays as an inert shell, as do the leftovers' C structs: the program may still hold and pass them (rdma-core
/// leaks them), and every call on them is refused ([`ctx_of`] finds the context closed), never reaching freed
/// memory or the device.
#[repr(C)]
pub(crate) struct Ctx {
    pub(crate) vc: verbs_context,
    pub(crate) dev: &'static Dev,
    /// Released at a close with objects alive (the shell is never freed then).
    pub(crate) ctx: Held<Context>,
    /// The C objects of this context by number, for async events (`element.cq` / `qp` / `srq`).
    pub(crate) objs: Mutex<ObjMap>,
    /// The port's GID table length, read once (GID loops would otherwise query the port per entry).
    gid_tbl_len: OnceLock<c_int>,
    /// `max_qp_wr` and `max_sge`, read once, which QP capabilities are checked against.
    qp_limits: OnceLock<(u32, u32)>,
    /// Objects made in this context and not destroyed (their address and kind), for the cleanup at close.
    life: Mutex<HashMap<usize, Kind>>,
    /// The fork generation it was opened in while open, [`CLOSED`] once the program closed it (only a shell,
    /// closed with objects alive, is ever seen so): one word the datapath compares with the process's generation
    /// for both checks (a forked child's generation differs; no generation reaches `CLOSED`).
    live: AtomicU64,
}

/// [`Ctx::live`] of a closed context.
const CLOSED: u64 = u64::MAX;

#[derive(Default)]
pub(crate) struct ObjMap {
    pub(crate) cqs: HashMap<u32, usize>,
    pub(crate) qps: HashMap<u32, usize>,
    pub(crate) srqs: HashMap<u32, usize>,
}

/// The [`Ctx`] of a program's `ibv_context` pointer; `None` (with a log line) for a context a forked child
/// inherited from its parent: as with rdma-core, a child opens devices of its own, and the parent's context
/// would wait for threads that are not in this process.
///
/// # Safety
/// `c` is NULL or a context this library returned and not yet closed.
pub(crate) unsafe fn ctx_of<'a>(c: *mut ibv_context) -> Option<&'a Ctx> {
    if c.is_null() {
        return None;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    // SAFETY: the context is the `vc.context` field of a live `Ctx` (`vc` is its first field), so stepping back
    // by its offset gives the `Ctx`.
    let ctx = unsafe { &*(c.cast::<u8>().sub(off).cast::<Ctx>()) };
    if ctx.is_closed() {
        log::info!("a call on a closed context, or on an object it left");
        return None;
    }
    if !of_this_process(ctx.dev) {
        log::warn!("a context opened before fork() is not usable in the child: open the device again");
        return None;
    }
    Some(ctx)
}

impl Ctx {
    /// A fresh open context around `vc` (filled by `ibv_open_device`) and the verbs context `ctx`.
    pub(crate) fn new(vc: verbs_context, dev: &'static Dev, ctx: Context) -> Self {
        Ctx {
            vc,
            dev,
            ctx: Held::new(ctx),
            objs: Mutex::new(ObjMap::default()),
            gid_tbl_len: OnceLock::new(),
            qp_limits: OnceLock::new(),
            life: Mutex::new(HashMap::new()),
            live: AtomicU64::new(dev.gen),
        }
    }

    /// Marks the context closed and hands over the objects it still has (their address and kind), under the
    /// lock `hold` and `release` take, so none is recorded after.
    pub(crate) fn close(&self) -> Vec<(usize, Kind)> {
        let mut life = lock(&self.life);
        self.live.store(CLOSED, Ordering::Release);
        life.drain().collect()
    }

    pub(crate) fn c(&self) -> *mut ibv_context {
        ptr::addr_of!(self.vc.context).cast_mut()
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.live.load(Ordering::Acquire) == CLOSED
    }

    /// Open, and in the process that opened it (not a forked child): what every call on its objects checks.
    #[inline(always)]
    pub(crate) fn usable(&self) -> bool {
        self.live.load(Ordering::Acquire) == mlx5_verbs::fork_generation_now()
    }
}

/// Whether `c` is a context the program closed with objects alive (whose shell stays): the answer to a verb on
/// one of those objects is then `EBADF`, as rdma-core's command on the closed `cmd_fd` returns.
///
/// # Safety
/// `c` is NULL or a context this library returned and did not free (open, or closed with objects alive).
pub(crate) unsafe fn is_closed(c: *mut ibv_context) -> bool {
    if c.is_null() {
        return false;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    // SAFETY: as in `ctx_of`; a closed context with leftovers is never freed.
    unsafe { &*(c.cast::<u8>().sub(off).cast::<Ctx>()) }.is_closed()
}

/// The firmware-command trace (`MLX5_RS_TRACE`), flushed at exit.
pub(crate) fn tracer(name: &str) -> Option<mlx5_verbs::Tracer> {
    static TRACE: OnceLock<Option<SharedTrace>> = OnceLock::new();
    let t = TRACE.get_or_init(|| {
        let path = std::env::var_os("MLX5_RS_TRACE")?;
        match TraceSink::json_file(path.as_ref()) {
            Ok(sink) => {
                extern "C" fn flush() {
                    if let Some(Some(t)) = TRACE_FLUSH.get() {
                        let _ = t.finish();
                    }
                }
                let shared = SharedTrace::new(sink);
                let _ = TRACE_FLUSH.set(Some(shared.clone()));
                // SAFETY: registers a plain function with no captured state.
                unsafe { libc::atexit(flush) };
                Some(shared)
            }
            Err(e) => {
                eprintln!("libibverbs(mlx5-rs): MLX5_RS_TRACE: {e}");
                None
            }
        }
    });
    // Lines name their device only when the process has several, as `mlx5 --trace` writes them.
    let several = devices().is_ok_and(|l| l.len() > 1);
    let name: Option<&'static str> = several.then(|| &*Box::leak(name.to_string().into_boxed_str()));
    t.as_ref().map(|t| Box::new(t.device(name)) as mlx5_verbs::Tracer)
}

static TRACE_FLUSH: OnceLock<Option<SharedTrace>> = OnceLock::new();

#[no_mangle]
pub extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard("ibv_get_device_list", ptr::null_mut(), || {
        let list = match devices() {
            Ok(l) => l,
            Err(e) => {
                set_errno(e);
                return ptr::null_mut();
            }
        };
        // SAFETY: calloc of n+1 pointers; freed by ibv_free_device_list.
        let arr =
            unsafe { libc::calloc(list.len() + 1, std::mem::size_of::<*mut ibv_device>()) }.cast::<*mut ibv_device>();
        if arr.is_null() {
            set_errno(libc::ENOMEM);
            return ptr::null_mut();
        }
        for (i, d) in list.iter().enumerate() {
            // SAFETY: i < len + 1 entries allocated above.
            unsafe { *arr.add(i) = ptr::addr_of!(d.vd.device).cast_mut() };
        }
        if !num.is_null() {
            // SAFETY: the caller passes a writable int or NULL.
            unsafe { *num = list.len() as c_int };
        }
        arr
    })
}

#[no_mangle]
pub extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: the array came from calloc in ibv_get_device_list (or is NULL); the devices stay.
    unsafe { libc::free(list.cast()) };
}

#[no_mangle]
pub extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    match dev_of(device) {
        Some(d) => d.vd.device.name.as_ptr(),
        None => {
            set_errno(libc::EINVAL);
            ptr::null()
        }
    }
}

#[no_mangle]
pub extern "C" fn ibv_get_device_guid(device: *mut ibv_device) -> u64 {
    guard("ibv_get_device_guid", 0, || dev_of(device).and_then(|d| d.dev.guid()).unwrap_or(0).to_be())
}

#[no_mangle]
pub extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    dev_of(device).map_or(-1, |d| d.index as c_int)
}

/// Records object `obj` (its box) of `kind`, made in `context`, for the cleanup of a close that finds it alive.
pub(crate) fn hold<T>(context: *mut ibv_context, kind: Kind, obj: *const T) {
    // SAFETY: objects are made in open contexts of this library.
    if let Some(c) = unsafe { ctx_of(context) } {
        lock(&c.life).insert(obj as usize, kind);
    }
}

/// Object `obj` of `context` is destroyed (a closed context's leftovers are no longer recorded).
pub(crate) fn release<T>(context: *mut ibv_context, obj: *const T) {
    // SAFETY: a context with objects is never freed, closed or not.
    if let Some(c) = unsafe { ctx_of(context) } {
        lock(&c.life).remove(&(obj as usize));
    }
}

/// What `ibv_query_device` and `ibv_query_port` show, read from the HCA as `mlx5 devinfo` reads it, and the
/// device clock's frequency in kHz (`device_frequency_khz`), which stamps every CQE.
struct QueryInfo<'a>(&'a str);

impl HcaVisitor for QueryInfo<'_> {
    type Out = Result<(DevInfo, Extra), mlx5_core::hca::Error>;
    fn visit<T: CmdTrace>(self, hca: &mut Hca<AnyMmio, AnyDma, T, HostTables>, delay: &mut AnyDelay) -> Self::Out {
        let info = devinfo::query(hca, delay, self.0, PCI_IDS)?;
        let g = hca.caps().general;
        Ok((info, Extra { clock_khz: g.device_frequency_khz, cq_moderation: g.cq_moderation }))
    }
}

/// What `ibv_query_device_ex` adds to devinfo's attributes.
struct Extra {
    /// The device clock (`device_frequency_khz`; 0: none).
    clock_khz: u32,
    /// `cq_moderation`: MODIFY_CQ takes a count and a period.
    cq_moderation: bool,
}

/// The device's attributes and the extended ones, under one hold of the control lock.
fn info_and_clock(ctx: &Ctx) -> Result<(DevInfo, Extra), c_int> {
    raw::with_hca(&ctx.ctx, QueryInfo(ctx.dev.dev.name())).map_err(|e| {
        log::warn!("query: {e}");
        crate::errno_of(&mlx5_verbs::VerbsError::Hca(e))
    })
}

fn info(ctx: &Ctx) -> Result<DevInfo, c_int> {
    info_and_clock(ctx).map(|(i, _)| i)
}

fn device_attr(i: &DevInfo) -> ibv_device_attr {
    // SAFETY: ibv_device_attr is plain integers: zero is valid.
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    copy_str(&mut a.fw_ver, &i.fw_version);
    a.node_guid = i.node_guid.to_be();
    a.sys_image_guid = i.sys_image_guid.to_be();
    a.max_mr_size = i.max_mr_size;
    a.page_size_cap = i.page_size_cap;
    a.vendor_id = VENDOR_OUI;
    a.vendor_part_id = u32::from(i.device_id);
    let int = |v: u32| c_int::try_from(v).unwrap_or(c_int::MAX);
    a.max_qp = int(i.max_qp);
    a.max_qp_wr = int(i.max_qp_wr);
    // IBV_DEVICE_BAD_PKEY_CNTR | BAD_QKEY_CNTR | CHANGE_PHY_PORT | PORT_ACTIVE_EVENT | SYS_IMAGE_GUID |
    // RC_RNR_NAK_GEN | N_NOTIFY_CQ: mlx5_ib's basic flags.
    a.device_cap_flags = (1 << 1) | (1 << 2) | (1 << 5) | (1 << 10) | (1 << 11) | (1 << 12) | (1 << 14);
    a.max_sge = int(i.max_sge);
    a.max_sge_rd = int(i.max_sge);
    a.max_cq = int(i.max_cq);
    a.max_cqe = int(i.max_cqe);
    a.max_mr = int(i.max_mr);
    a.max_pd = int(i.max_pd);
    a.max_qp_rd_atom = int(i.max_qp_rd_atom);
    a.max_res_rd_atom = int(i.max_qp_rd_atom.saturating_mul(i.max_qp));
    a.max_qp_init_rd_atom = int(i.max_qp_init_rd_atom);
    a.atomic_cap = c_int::from(i.atomic); // IBV_ATOMIC_HCA (1) or IBV_ATOMIC_NONE
    a.max_ah = c_int::MAX;
    a.max_srq = int(i.max_srq);
    a.max_srq_wr = int(i.max_srq_wr);
    a.max_srq_sge = int(i.max_srq_sge);
    a.max_pkeys = u16::try_from(i.max_pkeys).unwrap_or(u16::MAX);
    a.local_ca_ack_delay = 16;
    a.phys_port_cnt = i.phys_port_cnt;
    a
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(context: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    guard("ibv_query_device", libc::EIO, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return libc::EINVAL };
        if attr.is_null() {
            return libc::EINVAL;
        }
        match info(ctx) {
            // SAFETY: the caller's attr points to an ibv_device_attr.
            Ok(i) => unsafe { attr.write(device_attr(&i)) },
            Err(e) => return e,
        }
        0
    })
}

/// Copies `v` into a caller's buffer of `len` bytes: what fits, the rest of the buffer zeroed.
///
/// # Safety
/// `dst` is writable for `len` bytes.
unsafe fn write_sized<T: Copy>(dst: *mut u8, len: usize, v: &T) {
    let n = len.min(std::mem::size_of::<T>());
    // SAFETY: n bytes of `v` are readable; `dst` is writable for len >= n bytes (caller).
    unsafe {
        ptr::copy_nonoverlapping(ptr::from_ref(v).cast::<u8>(), dst, n);
        ptr::write_bytes(dst.add(n), 0, len - n);
    }
}

pub(crate) unsafe extern "C" fn query_device_ex(
    context: *mut ibv_context,
    input: *const c_void,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    guard("ibv_query_device_ex", libc::EIO, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return libc::EINVAL };
        // A non-zero input comp_mask asks for something this library does not know.
        // SAFETY: input is NULL or points to an ibv_query_device_ex_input (a u32 comp_mask).
        if !input.is_null() && unsafe { *input.cast::<u32>() } != 0 {
            return libc::EINVAL;
        }
        if attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
            return libc::EINVAL;
        }
        let (i, Extra { clock_khz: khz, cq_moderation }) = match info_and_clock(ctx) {
            Ok(v) => v,
            Err(e) => return e,
        };
        // SAFETY: ibv_device_attr_ex is plain integers: zero is valid.
        let mut a: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
        a.orig_attr = device_attr(&i);
        a.phys_port_cnt_ex = u32::from(i.phys_port_cnt);
        // Completion timestamps: the CQE's raw device clock, as mlx5_ib reports it (a 63-bit counter at
        // device_frequency_khz); none without a clock.
        if khz != 0 {
            a.completion_timestamp_mask = (1 << 63) - 1;
            a.hca_core_clock = u64::from(khz);
        }
        // mlx5_ib's MLX5_MAX_CQ_COUNT and MLX5_MAX_CQ_PERIOD: the widest values the cqc fields hold.
        if cq_moderation {
            use mlx5_core::prm::ifc::cqc;
            a.cq_mod_caps.max_cq_count = ((1u32 << cqc::CQ_MAX_COUNT.width) - 1) as u16;
            a.cq_mod_caps.max_cq_period = ((1u32 << cqc::CQ_PERIOD.width) - 1) as u16;
        }
        // SAFETY: the caller's buffer holds attr_size bytes.
        unsafe { write_sized(attr.cast(), attr_size, &a) };
        0
    })
}

fn port_attr(ctx: &Ctx, port: u8) -> Result<ibv_port_attr, c_int> {
    let i = info(ctx)?;
    let p = i.ports.iter().find(|p| p.port == port).ok_or(libc::EINVAL)?;
    // SAFETY: ibv_port_attr is plain integers: zero is valid.
    let mut a: ibv_port_attr = unsafe { std::mem::zeroed() };
    a.state = c_int::from(p.state);
    a.max_mtu = c_int::from(p.max_mtu);
    a.active_mtu = c_int::from(p.active_mtu);
    a.gid_tbl_len = c_int::try_from(p.gid_tbl_len).unwrap_or(c_int::MAX);
    let eth = p.link_layer == devinfo::LinkLayer::Ethernet;
    // IB_PORT_CM_SUP, and on RoCE IB_PORT_IP_BASED_GIDS (mlx5_query_port_roce).
    a.port_cap_flags = (1 << 16) | if eth { 1 << 26 } else { 0 };
    a.max_msg_sz = u32::try_from(p.max_msg_sz).unwrap_or(u32::MAX);
    a.pkey_tbl_len = u16::try_from(i.max_pkeys).unwrap_or(u16::MAX);
    a.lid = p.lid;
    a.sm_lid = p.sm_lid;
    a.lmc = p.lmc;
    a.max_vl_num = 4; // IBV_VL_0_7, as mlx5_ib reports for both link layers
    a.active_width = 2; // IBV_WIDTH_4X
    a.active_speed = 32; // EDR: 4X EDR, 100 Gb/s
    a.phys_state = p.phys_state;
    a.link_layer = if eth { 2 } else { 1 }; // IBV_LINK_LAYER_ETHERNET / INFINIBAND
    Ok(a)
}

pub(crate) unsafe extern "C" fn query_port_ex(
    context: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    guard("ibv_query_port", libc::EIO, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return libc::EINVAL };
        if attr.is_null() {
            return libc::EINVAL;
        }
        match port_attr(ctx, port) {
            // SAFETY: the caller's buffer holds len bytes.
            Ok(a) => unsafe { write_sized(attr.cast(), len, &a) },
            Err(e) => return e,
        }
        0
    })
}

/// The legacy export: the caller's `struct _compat_ibv_port_attr` ends before `flags`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(context: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int {
    // SAFETY: the caller's compat struct holds the fields up to `flags`.
    unsafe { query_port_ex(context, port, attr, std::mem::offset_of!(ibv_port_attr, flags)) }
}

/// The GID at `index` and its type; an empty entry inside the table reads as zero (as the kernel's cache
/// reports it), one past the table is `EINVAL`.
pub(crate) fn gid(ctx: &Ctx, port: u8, index: c_int) -> Result<Option<([u8; 16], GidType)>, c_int> {
    let index = u16::try_from(index).map_err(|_| libc::EINVAL)?;
    if port != 1 {
        return Err(libc::EINVAL);
    }
    match ctx.ctx.query_gid_ex(index) {
        Ok(g) => Ok(Some(g)),
        Err(_) => {
            let len = *ctx.gid_tbl_len.get_or_init(|| port_attr(ctx, port).map_or(0, |a| a.gid_tbl_len));
            if c_int::from(index) < len {
                Ok(None)
            } else {
                Err(libc::EINVAL)
            }
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(context: *mut ibv_context, port: u8, index: c_int, out: *mut ibv_gid) -> c_int {
    guard("ibv_query_gid", -1, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return -1 };
        match gid(ctx, port, index) {
            Ok(g) if !out.is_null() => {
                // SAFETY: the caller's out points to a union ibv_gid.
                unsafe { (*out).raw = g.map_or([0; 16], |g| g.0) };
                0
            }
            Ok(_) => -1,
            Err(e) => {
                set_errno(e);
                -1
            }
        }
    })
}

fn gid_type_num(t: GidType) -> u32 {
    match t {
        GidType::Ib => 0,
        GidType::RoceV1 => 1,
        GidType::RoceV2 => 2,
    }
}

/// `ibv_query_gid_type` (private): `IBV_GID_TYPE_SYSFS_IB_ROCE_V1` (0) or `IBV_GID_TYPE_SYSFS_ROCE_V2` (1).
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut ibv_context,
    port: u8,
    index: c_uint,
    out: *mut c_int,
) -> c_int {
    guard("ibv_query_gid_type", -1, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return -1 };
        let Ok(i) = c_int::try_from(index) else { return -1 };
        match gid(ctx, port, i) {
            Ok(g) if !out.is_null() => {
                let v2 = matches!(g, Some((_, GidType::RoceV2)));
                // SAFETY: the caller's out points to an enum (int).
                unsafe { *out = c_int::from(v2) };
                0
            }
            Ok(_) => -1,
            Err(e) => {
                set_errno(e);
                -1
            }
        }
    })
}

fn gid_entry(ctx: &Ctx, port: u8, index: u32) -> Result<ibv_gid_entry, c_int> {
    let i = c_int::try_from(index).map_err(|_| libc::EINVAL)?;
    match gid(ctx, port, i)? {
        Some((g, t)) => Ok(ibv_gid_entry {
            gid: ibv_gid { raw: g },
            gid_index: index,
            port_num: u32::from(port),
            gid_type: gid_type_num(t),
            ndev_ifindex: 0,
        }),
        None => Err(libc::ENODATA),
    }
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard("ibv_query_gid_ex", libc::EIO, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return libc::EINVAL };
        if flags != 0 || entry.is_null() {
            return libc::EINVAL;
        }
        let Ok(port) = u8::try_from(port) else { return libc::EINVAL };
        match gid_entry(ctx, port, index) {
            // SAFETY: the caller's entry holds entry_size bytes.
            Ok(e) => unsafe { write_sized(entry.cast(), entry_size, &e) },
            Err(e) => return e,
        }
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard("ibv_query_gid_table", -(libc::EIO as isize), || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return -(libc::EINVAL as isize) };
        if flags != 0 || entries.is_null() || entry_size == 0 {
            return -(libc::EINVAL as isize);
        }
        let len = match port_attr(ctx, 1) {
            Ok(a) => u32::try_from(a.gid_tbl_len).unwrap_or(0),
            Err(e) => return -(e as isize),
        };
        let mut n = 0usize;
        for index in 0..len {
            let Ok(e) = gid_entry(ctx, 1, index) else { continue };
            if n == max_entries {
                return -(libc::EINVAL as isize);
            }
            // SAFETY: the caller's array holds max_entries entries of entry_size bytes; n < max_entries.
            unsafe { write_sized(entries.cast::<u8>().add(n * entry_size), entry_size, &e) };
            n += 1;
        }
        n as isize
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(context: *mut ibv_context, port: u8, index: c_int, pkey: *mut u16) -> c_int {
    guard("ibv_query_pkey", -1, || {
        // SAFETY: the caller passes an open context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else { return -1 };
        let Ok(a) = port_attr(ctx, port) else { return -1 };
        if index < 0 || index >= c_int::from(a.pkey_tbl_len) || pkey.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // The default partition in entry 0, the others empty (firmware's table for an unmanaged port).
        let v: u16 = if index == 0 { 0xffff } else { 0 };
        // SAFETY: the caller's pkey points to a __be16.
        unsafe { *pkey = v.to_be() };
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(context: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    let mut p0 = 0u16;
    // SAFETY: same contract as ibv_query_pkey; p0 is a live local.
    if unsafe { ibv_query_pkey(context, port, 0, &mut p0) } != 0 {
        return -1;
    }
    if u16::from_be(pkey) & 0x7fff == u16::from_be(p0) & 0x7fff {
        0
    } else {
        set_errno(libc::ENOENT);
        -1
    }
}

#[no_mangle]
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// Reads `dir/file` into `buf`. For a device of this library the files a program reads are served from the
/// device (`board_id`, `fw_ver`, `node_type`); everything else is read from the file system as libibverbs does.
#[no_mangle]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard("ibv_read_sysfs_file", -1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the caller passes NUL-terminated strings.
        let (dir, file) = unsafe { (CStr::from_ptr(dir).to_string_lossy(), CStr::from_ptr(file).to_string_lossy()) };
        let ours = devices().ok().and_then(|l| {
            l.iter().copied().find(|d| {
                // SAFETY: ibdev_path was written NUL-terminated at creation.
                let p = unsafe { CStr::from_ptr(d.vd.device.ibdev_path.as_ptr()) };
                p.to_string_lossy() == dir.trim_end_matches('/')
            })
        });
        let text = match (ours, file.as_ref()) {
            (Some(d), "board_id") => {
                Some(if d.dev.sim_device().is_some() { "MLX5RS_SIM0001".to_string() } else { "MT_0000000000".into() })
            }
            (Some(_), "node_type") => Some("1: CA".to_string()),
            (Some(_), _) => None,
            (None, _) => std::fs::read_to_string(format!("{dir}/{file}")).ok(),
        };
        let Some(text) = text else {
            set_errno(libc::ENOENT);
            return -1;
        };
        let bytes = text.trim_end_matches('\n').as_bytes();
        let n = bytes.len().min(size - 1);
        // SAFETY: buf holds size > n bytes.
        unsafe {
            ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, n);
            *buf.add(n) = 0;
        }
        n as c_int
    })
}

/// `max_qp_wr` and `max_sge` of the context's device (as `ibv_query_device` reports them).
pub(crate) fn qp_limits(ctx: &Ctx) -> Result<(u32, u32), c_int> {
    if let Some(l) = ctx.qp_limits.get() {
        return Ok(*l);
    }
    let i = info(ctx)?;
    Ok(*ctx.qp_limits.get_or_init(|| (i.max_qp_wr, i.max_sge)))
}

/// The link layer of a context's port.
pub(crate) fn link(ctx: &Ctx) -> LinkLayer {
    raw::link_layer(&ctx.ctx)
}

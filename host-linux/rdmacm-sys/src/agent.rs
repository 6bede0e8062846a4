//! The process's connection manager: the opened devices, each with its GSI QP and `mlx5-rdmacm` engine, the IDs
//! and their state, the event channels, and the thread that carries MADs between the engines and QP1.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::net::SocketAddr;
use std::ptr;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mlx5_rdmacm::cm::{self, CmPath, Rep, Req, SidrReq};
use mlx5_rdmacm::engine::{CommId, Engine, EngineConfig, Event};
use mlx5_rdmacm::ip::{self, CmaHdr, CMA_HDR_LEN};
use mlx5_rdmacm::mad::{MAD_LEN, QP1_QKEY};

use crate::abi::verbs::{ibv_device, ibv_mr, ibv_port_attr, ibv_recv_wr, ibv_send_wr, ibv_send_wr_wr, ibv_sge, wr_ud};
use crate::abi::*;
use crate::addr;

/// Receive slots of the GSI QP: GRH room and a MAD each.
const NRECV: usize = 64;
/// Send slots: a MAD each.
const NSEND: usize = 64;
const GRH: usize = 40;
const RECV_SLOT: usize = GRH + MAD_LEN;
/// The agent's clock: MADs are carried and retries run every millisecond.
const TICK: Duration = Duration::from_millis(1);

// The drop-in libibverbs.so.1's exports this library calls (its NEEDED entry).
extern "C" {
    fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device;
    fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context;
    fn ibv_get_device_guid(dev: *mut ibv_device) -> u64;
    pub(crate) fn ibv_query_port(ctx: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int;
    fn ibv_query_gid(ctx: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
    pub(crate) fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    pub(crate) fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
    pub(crate) fn ibv_create_cq(
        ctx: *mut ibv_context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        vector: c_int,
    ) -> *mut ibv_cq;
    pub(crate) fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int;
    pub(crate) fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel;
    pub(crate) fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int;
    pub(crate) fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    pub(crate) fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int;
    pub(crate) fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
    fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah;
    fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int;
    fn ibv_init_ah_from_wc(
        ctx: *mut ibv_context,
        port: u8,
        wc: *mut ibv_wc,
        grh: *mut c_void,
        attr: *mut ibv_ah_attr,
    ) -> c_int;
    fn mlx5_rs_create_gsi_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
}

/// The path's packet life time Linux's rdma_cm gives a RoCE route (`CMA_IBOE_PACKET_LIFETIME`, 4.096 µs·2^16).
pub(crate) const PACKET_LIFE_TIME: u8 = 16;
/// A connected QP's local ACK timeout: the path's packet life time + 1 (Linux's `cm_init_av_by_path`), about
/// half a second, so a busy machine's simulated wire does not use up qperf's retries as 67 ms (14) did.
pub(crate) const ACK_TIMEOUT: u8 = PACKET_LIFE_TIME + 1;
/// The REQ's primary local ACK timeout: Linux's `cm_ack_timeout` of the packet life time and a ConnectX's CA ACK
/// delay (16).
const REQ_LOCAL_ACK_TIMEOUT: u8 = 18;

/// `ibv_access_flags` bits a connected QP is given.
pub(crate) mod access {
    pub const REMOTE_WRITE: u32 = 1 << 1;
    pub const REMOTE_READ: u32 = 1 << 2;
    pub const REMOTE_ATOMIC: u32 = 1 << 3;

    /// What Linux's CM lets the peer do on a connected QP (`cm_init_qp_init_attr`): writes, and reads and
    /// atomics only when the QP has responder resources for them.
    pub fn conn(responder_resources: u8) -> u32 {
        if responder_resources == 0 {
            REMOTE_WRITE
        } else {
            REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC
        }
    }
}

/// `ibv_qp_attr_mask` bits.
pub(crate) mod mask {
    pub const STATE: i32 = 1;
    pub const ACCESS_FLAGS: i32 = 1 << 3;
    pub const PKEY_INDEX: i32 = 1 << 4;
    pub const PORT: i32 = 1 << 5;
    pub const QKEY: i32 = 1 << 6;
    pub const AV: i32 = 1 << 7;
    pub const PATH_MTU: i32 = 1 << 8;
    pub const TIMEOUT: i32 = 1 << 9;
    pub const RETRY_CNT: i32 = 1 << 10;
    pub const RNR_RETRY: i32 = 1 << 11;
    pub const RQ_PSN: i32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: i32 = 1 << 13;
    pub const MIN_RNR_TIMER: i32 = 1 << 15;
    pub const DEST_QPN: i32 = 1 << 20;
    pub const SQ_PSN: i32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
}

/// `enum ibv_qp_state`.
pub(crate) mod qps {
    pub const INIT: i32 = 1;
    pub const RTR: i32 = 2;
    pub const RTS: i32 = 3;
    pub const ERR: i32 = 6;
}

/// An event channel: the C structure (its descriptor an eventfd counting the events not yet taken, so `poll()`
/// wakes while one waits, and a close while a thread reads leaves that thread waiting, as librdmacm's own
/// descriptor does), and the events themselves.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct Channel {
    pub c: rdma_event_channel,
    pub q: Mutex<VecDeque<usize>>,
}

impl Channel {
    /// A new channel.
    pub(crate) fn new() -> Result<*mut Channel, c_int> {
        // SAFETY: no pointer; a semaphore eventfd gives one event per read.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EMFILE));
        }
        let ch = Channel { c: rdma_event_channel { fd }, q: Mutex::new(VecDeque::new()) };
        Ok(Box::into_raw(Box::new(ch)))
    }

    /// Queues an event and counts it on the descriptor.
    pub(crate) fn push(&self, ev: *mut Ev) {
        lock(&self.q).push_back(ev as usize);
        let one = 1u64;
        // SAFETY: eight bytes from a live local to our eventfd.
        let n = unsafe { libc::write(self.c.fd, ptr::addr_of!(one).cast(), 8) };
        if n != 8 {
            log::error!("event channel: the eventfd took no count ({})", std::io::Error::last_os_error());
        }
    }
}

/// An event handed to the program: the C structure and the private data its parameters point into.
#[repr(C)]
#[allow(missing_debug_implementations)]
pub(crate) struct Ev {
    pub c: rdma_cm_event,
    pub data: [u8; MAD_LEN],
}

/// An ID: the C structure and nothing else (its state is in [`Cm::ids`], under the one lock).
pub(crate) type Id = rdma_cm_id;

/// What this library knows of an ID.
#[derive(Debug)]
pub(crate) struct IdState {
    /// Created without a channel: calls wait for their own event on this private one.
    pub sync: bool,
    pub dev: Option<usize>,
    pub src: Option<SocketAddr>,
    pub dst: Option<SocketAddr>,
    /// Services listened on: (device, service ID).
    pub listening: Vec<(usize, u64)>,
    /// The connection (or SIDR exchange) in its device's engine.
    pub comm: Option<(usize, CommId)>,
    /// The peer's port (the path of the connection, and where its CM MADs go).
    pub peer: Option<ibv_ah_attr>,
    /// From the peer's REQ (passive) or REP (active); `remote_psn` is what the QP sends at, `psn` (announced in
    /// the own REQ or REP) what it receives at, as Linux's rdma_cm pairs them.
    pub remote_qpn: u32,
    pub remote_psn: u32,
    pub remote_mtu: u8,
    pub psn: u32,
    /// The listener a passive ID came from.
    pub listener: usize,
    /// PD and CQs this library made for `rdma_create_qp`/`rdma_create_ep` with none given.
    pub own_pd: *mut ibv_pd,
    /// CQs (send, receive) and their completion channels made for a QP created without CQs (rdma_create_ep's
    /// way: `rdma_get_send_comp`/`rdma_get_recv_comp` wait on the channels).
    pub own_cqs: Vec<*mut ibv_cq>,
    pub own_channels: Vec<*mut ibv_comp_channel>,
    /// A passive endpoint's QP attributes (`rdma_create_ep`), applied to each ID `rdma_get_request` returns.
    pub ep_qp: Option<Box<(*mut ibv_pd, ibv_qp_init_attr)>>,
    pub path: Box<ibv_sa_path_rec>,
    pub established: bool,
    /// The ID has had a connection (Linux's `cm_id.ib` exists): a later `rdma_disconnect` is no error.
    pub had_connection: bool,
}

impl IdState {
    pub(crate) fn new(sync: bool) -> IdState {
        IdState {
            sync,
            dev: None,
            src: None,
            dst: None,
            listening: Vec::new(),
            comm: None,
            peer: None,
            remote_qpn: 0,
            remote_psn: 0,
            remote_mtu: 0,
            psn: 0,
            listener: 0,
            own_pd: ptr::null_mut(),
            own_cqs: Vec::new(),
            own_channels: Vec::new(),
            ep_qp: None,
            path: Box::default(),
            established: false,
            had_connection: false,
        }
    }
}

/// One opened device: its port's addresses, its GSI QP and buffers, its CM engine.
#[derive(Debug)]
pub(crate) struct Dev {
    pub ctx: *mut ibv_context,
    pub ib: bool,
    /// The port's IPv4 address: RoCE, the one its GID table holds (a port plugged into a QEMU guest has the
    /// address it was given, not its simulated host's); InfiniBand, its simulated host's.
    pub ipv4: Option<std::net::Ipv4Addr>,
    /// The GID table index of the port's IPv4 GID (RoCE), else 0.
    pub sgid_index: u8,
    pub gid: [u8; 16],
    pub lid: u16,
    pub active_mtu: c_int,
    gsi: Option<Gsi>,
    pub engine: Engine<ibv_ah_attr>,
    /// Engine connection -> ID.
    pub conns: HashMap<CommId, usize>,
    /// Service ID -> listening ID.
    pub listeners: HashMap<u64, usize>,
}

/// The GSI QP, its CQ and registered slots.
#[derive(Debug)]
struct Gsi {
    pd: *mut ibv_pd,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    lkey: u32,
    buf: Box<[u8]>,
    free: Vec<usize>,
    ah: Vec<*mut ibv_ah>,
    backlog: VecDeque<(ibv_ah_attr, [u8; MAD_LEN])>,
}

/// The process's connection manager.
#[derive(Debug)]
pub(crate) struct Cm {
    pub devs: Vec<Dev>,
    pub ids: HashMap<usize, IdState>,
    start: Instant,
    next_port: u16,
}

// SAFETY: the raw pointers name objects of the drop-in libibverbs (thread-safe) and of this library; every use
// is under the one lock.
unsafe impl Send for Cm {}

static CM: OnceLock<Mutex<Cm>> = OnceLock::new();

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Blocks every signal on the calling thread; returns the mask it had.
fn block_all_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; both sets are filled by sigfillset / pthread_sigmask before use.
    unsafe {
        let (mut all, mut old): (libc::sigset_t, libc::sigset_t) = (std::mem::zeroed(), std::mem::zeroed());
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    }
}

/// The connection manager, its devices opened and its thread started on first use.
pub(crate) fn cm() -> MutexGuard<'static, Cm> {
    let m = CM.get_or_init(|| {
        let cm = Cm { devs: open_devices(), ids: HashMap::new(), start: Instant::now(), next_port: 0 };
        // The thread starts with every signal blocked (it inherits the mask), so a program's signal reaches a
        // program thread as with rdma-core's librdmacm, which has no thread: qperf's SIGALRM must interrupt
        // its ibv_get_cq_event, not run its handler here.
        let old = block_all_signals();
        std::thread::Builder::new()
            .name("rdmacm-agent".into())
            .spawn(agent)
            .map_err(|e| log::error!("the CM thread did not start: {e}"))
            .ok();
        // SAFETY: `old` is the mask pthread_sigmask returned.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, ptr::null_mut()) };
        Mutex::new(cm)
    });
    lock(m)
}

impl Cm {
    pub(crate) fn now_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// An ephemeral source port (rdma_cm's range is the kernel's ip_local_port_range; any will do here).
    pub(crate) fn ephemeral_port(&mut self) -> u16 {
        self.next_port = self.next_port.wrapping_add(1) % 20000;
        40000 + self.next_port
    }

    /// The device whose port has `ip`: the own port for loopback and the wildcard.
    pub(crate) fn dev_of_ip(&self, ip: std::net::Ipv4Addr) -> Option<usize> {
        if addr::is_local_alias(ip) {
            return (!self.devs.is_empty()).then_some(0);
        }
        self.devs.iter().position(|d| d.ipv4 == Some(ip))
    }

    /// The path from device `d` to the port that has `ip` (`None`: no simulated port has it, and on RoCE no
    /// neighbour beyond the simulated fabric either: see [`addr::neighbour`]).
    pub(crate) fn path_to(&self, d: usize, ip: std::net::Ipv4Addr) -> Option<ibv_ah_attr> {
        let dev = &self.devs[d];
        let (lid, ip) = if addr::is_local_alias(ip) {
            (dev.lid, dev.ipv4?)
        } else if let Some(h) = addr::host_of_ip(ip) {
            (h.lid, h.ipv4)
        } else if !dev.ib && addr::neighbour(ip) {
            // The GID names it; the port's link finds the MAC (ARP).
            (0, ip)
        } else {
            return None;
        };
        let mut a = ibv_ah_attr { port_num: 1, ..ibv_ah_attr::default() };
        if dev.ib {
            a.dlid = lid;
        } else {
            a.is_global = 1;
            a.grh.dgid.raw = addr::v4_gid(ip);
            a.grh.sgid_index = dev.sgid_index;
            a.grh.hop_limit = 64;
        }
        Some(a)
    }

    /// Connects: a REQ (RC) or SIDR_REQ (UD) for the ID's destination, from its QP (or `qp_num`).
    pub(crate) fn connect(&mut self, id: usize, p: &ConnectArgs<'_>) -> Result<(), c_int> {
        let now = self.now_ns();
        let st = self.ids.get(&id).ok_or(libc::EINVAL)?;
        let (d, peer, src, dst) = match (st.dev, st.peer, st.src, st.dst) {
            (Some(d), Some(peer), Some(s), Some(t)) => (d, peer, s, t),
            _ => return Err(libc::EINVAL),
        };
        let hdr = CmaHdr { src_port: src.port(), src: src.ip(), dst: dst.ip() };
        let svc = ip::service_id(p.ps, dst.port());
        let dev = &mut self.devs[d];
        if dev.gsi.is_none() {
            return Err(libc::ENODEV);
        }
        let psn = (now as u32 ^ std::process::id().wrapping_mul(2_654_435_761)) & 0xff_ffff;
        let comm = if p.ud {
            let mut private_data = [0u8; cm::private_len::SIDR_REQ];
            hdr.write(&mut private_data).map_err(|_| libc::EINVAL)?;
            copy_private(&mut private_data[CMA_HDR_LEN..], p.private_data)?;
            let req = SidrReq { request_id: 0, pkey: 0xffff, service_id: svc, private_data };
            dev.engine.sidr_resolve(now, peer, req, 100_000_000, 5)
        } else {
            let mut private_data = [0u8; cm::private_len::REQ];
            hdr.write(&mut private_data).map_err(|_| libc::EINVAL)?;
            copy_private(&mut private_data[CMA_HDR_LEN..], p.private_data)?;
            let path = CmPath {
                local_lid: if dev.ib { dev.lid } else { 0xffff },
                remote_lid: if dev.ib { peer.dlid } else { 0xffff },
                local_gid: dev.gid,
                remote_gid: if dev.ib { [0; 16] } else { peer.grh.dgid.raw },
                flow_label: 0,
                packet_rate: 0,
                traffic_class: 0,
                hop_limit: if dev.ib { 0 } else { 64 },
                sl: 0,
                subnet_local: true,
                local_ack_timeout: REQ_LOCAL_ACK_TIMEOUT,
            };
            let req = Req {
                local_comm_id: 0,
                service_id: svc,
                local_ca_guid: 0,
                local_qkey: 0,
                local_qpn: p.qpn,
                responder_resources: p.responder_resources,
                initiator_depth: p.initiator_depth,
                remote_cm_response_timeout: 20,
                transport_service_type: 0,
                end_to_end_flow_control: p.flow_control,
                starting_psn: psn,
                local_cm_response_timeout: 20,
                retry_count: p.retry_count.min(7),
                pkey: 0xffff,
                path_mtu: dev.active_mtu as u8,
                rdc_exists: false,
                rnr_retry_count: p.rnr_retry_count.min(7),
                max_cm_retries: 15,
                srq: p.srq,
                path,
                private_data,
            };
            dev.engine.connect(now, peer, req)
        };
        dev.conns.insert(comm, id);
        let st = self.ids.get_mut(&id).ok_or(libc::EINVAL)?;
        st.comm = Some((d, comm));
        st.had_connection = true;
        st.psn = psn;
        Ok(())
    }

    /// Sends a REP (RC) or SIDR_REP (UD) for a passive ID.
    pub(crate) fn accept(&mut self, id: usize, p: &ConnectArgs<'_>) -> Result<(), c_int> {
        let now = self.now_ns();
        let st = self.ids.get(&id).ok_or(libc::EINVAL)?;
        let (d, comm) = st.comm.ok_or(libc::EINVAL)?;
        let psn = st.psn;
        let engine = &mut self.devs[d].engine;
        let r = if p.ud {
            engine.sidr_accept(comm, p.qpn, p.qkey)
        } else {
            let mut private_data = [0u8; cm::private_len::REP];
            copy_private(&mut private_data, p.private_data)?;
            let rep = Rep {
                local_comm_id: 0,
                remote_comm_id: 0,
                local_qkey: 0,
                local_qpn: p.qpn,
                starting_psn: psn,
                responder_resources: p.responder_resources,
                initiator_depth: p.initiator_depth,
                target_ack_delay: 15,
                failover_accepted: 0,
                end_to_end_flow_control: p.flow_control,
                rnr_retry_count: p.rnr_retry_count.min(7),
                srq: p.srq,
                local_ca_guid: 0,
                private_data,
            };
            engine.accept(now, comm, rep)
        };
        r.map_err(|e| {
            log::info!("rdma_accept: {e}");
            libc::EINVAL
        })
    }

    /// Forgets an ID's connection and listeners, here and in the engine.
    pub(crate) fn unlink(&mut self, id: usize) {
        if let Some(st) = self.ids.get_mut(&id) {
            if let Some((d, comm)) = st.comm.take() {
                // An ID destroyed mid-handshake withdraws its REQ or REP (a connected one sends a DREQ), so
                // neither engine keeps the connection.
                self.devs[d].conns.remove(&comm);
                self.devs[d].engine.abort(comm);
            }
            for (d, svc) in std::mem::take(&mut st.listening) {
                self.devs[d].listeners.remove(&svc);
                self.devs[d].engine.unlisten(svc);
            }
        }
    }

    /// Sends what the engines have now (a call that makes a MAD does not wait for the next tick: a program that
    /// disconnects and exits at once still has its DREQ sent).
    pub(crate) fn flush(&mut self) {
        for d in &mut self.devs {
            d.transmit();
        }
    }

    /// Carries MADs, runs timers and hands out events on every device.
    fn service(&mut self) {
        let now = self.now_ns();
        for d in 0..self.devs.len() {
            self.receive(d, now);
            self.devs[d].engine.tick(now);
            while let Some(ev) = self.devs[d].engine.poll_event() {
                self.dispatch(d, ev);
            }
            self.devs[d].transmit();
        }
    }

    fn receive(&mut self, d: usize, now: u64) {
        let dev = &mut self.devs[d];
        let Some(g) = dev.gsi.as_mut() else { return };
        // SAFETY: all-zero is a valid ibv_wc.
        let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: our live CQ of the drop-in library; room for 16 completions.
            let n = unsafe { poll_cq(g.cq, &mut wcs) };
            if n <= 0 {
                break;
            }
            for wc in &mut wcs[..n as usize] {
                let slot = wc.wr_id as usize;
                if slot >= NRECV {
                    if wc.status != 0 {
                        log::info!("QP1: a MAD's send completed with status {}", wc.status);
                    }
                    let s = slot - NRECV;
                    if s < NSEND {
                        // SAFETY: the AH this slot's send used, done now.
                        unsafe { ibv_destroy_ah(g.ah[s]) };
                        g.ah[s] = ptr::null_mut();
                        g.free.push(s);
                    }
                    continue;
                }
                if wc.status == 0 {
                    let off = slot * RECV_SLOT;
                    let mut attr = ibv_ah_attr::default();
                    let grh = g.buf[off..].as_mut_ptr();
                    // SAFETY: our context, a completion of our GSI QP and the slot's GRH bytes.
                    let r = unsafe { ibv_init_ah_from_wc(dev.ctx, 1, wc, grh.cast(), &mut attr) };
                    // Answers leave from the port's own RoCE v2 address, as the request's sender expects.
                    if attr.is_global != 0 && !dev.ib {
                        attr.grh.sgid_index = dev.sgid_index;
                    }
                    let len = (wc.byte_len as usize).saturating_sub(GRH).min(MAD_LEN);
                    let mad = &g.buf[off + GRH..off + GRH + len];
                    log::trace!("QP1: GRH room {:02x?}", &g.buf[off..off + GRH]);
                    log::debug!("QP1: received attribute {:#x} ({len} bytes)", u16::from_be_bytes([mad[16], mad[17]]));
                    if r == 0 {
                        if let Err(e) = dev.engine.recv(now, attr, mad) {
                            log::info!("QP1: {e}");
                        }
                    }
                }
                g.post_recv(slot);
            }
        }
    }

    fn dispatch(&mut self, d: usize, ev: Event) {
        match ev {
            Event::ConnectRequest { id: comm, req } => self.on_request(d, comm, Some(&req), None),
            Event::SidrRequest { id: comm, req } => self.on_request(d, comm, None, Some(&req)),
            Event::Established { id: comm, rep } => {
                let Some(&id) = self.devs[d].conns.get(&comm) else { return };
                let Some(st) = self.ids.get_mut(&id) else { return };
                let mut e = new_ev(id, 0, event::ESTABLISHED, 0);
                if let Some(rep) = rep {
                    // Active: the REP names the peer's QP; the ID's QP goes to RTR and RTS now.
                    st.remote_qpn = rep.local_qpn;
                    st.remote_psn = rep.starting_psn;
                    let conn = rdma_conn_param {
                        private_data: ptr::null(),
                        private_data_len: cm::private_len::REP as u8,
                        responder_resources: rep.initiator_depth,
                        initiator_depth: rep.responder_resources,
                        flow_control: rep.end_to_end_flow_control.into(),
                        retry_count: 0,
                        rnr_retry_count: rep.rnr_retry_count,
                        srq: rep.srq.into(),
                        qp_num: rep.local_qpn,
                    };
                    set_conn(&mut e, conn, &rep.private_data);
                    // SAFETY: a live ID of this library.
                    let qp = unsafe { (*(id as *mut Id)).qp };
                    if qp.is_null() {
                        e.c.event = event::CONNECT_RESPONSE;
                    } else {
                        let dev = &self.devs[d];
                        let (rd, init) = (rep.initiator_depth, rep.responder_resources);
                        // SAFETY: the ID's live QP.
                        if let Err(errno) = unsafe { rc_rtr_rts(qp, dev, st, rd, init, 7, rep.rnr_retry_count) } {
                            e.c.event = event::CONNECT_ERROR;
                            e.c.status = -errno;
                        }
                    }
                }
                st.established = true;
                deliver(id, e);
            }
            Event::Rejected { id: comm, reason } => {
                self.end(d, comm, event::REJECTED, i32::from(reason.code()));
            }
            Event::Unreachable { id: comm } => self.end(d, comm, event::UNREACHABLE, -libc::ETIMEDOUT),
            Event::SidrFailed { id: comm, status } => self.end(d, comm, event::UNREACHABLE, i32::from(status)),
            Event::Disconnected { id: comm } => {
                if let Some(&id) = self.devs[d].conns.get(&comm) {
                    // SAFETY: a live ID of this library.
                    let qp = unsafe { (*(id as *mut Id)).qp };
                    if !qp.is_null() {
                        // SAFETY: the ID's live QP; its outstanding work is flushed, as rdma_cm does.
                        unsafe { to_err(qp) };
                    }
                }
                self.end(d, comm, event::DISCONNECTED, 0);
            }
            Event::SidrResolved { id: comm, qpn, qkey } => {
                let Some(&id) = self.devs[d].conns.get(&comm) else { return };
                self.devs[d].conns.remove(&comm);
                let Some(st) = self.ids.get_mut(&id) else { return };
                st.comm = None;
                st.established = true;
                let mut e = new_ev(id, 0, event::ESTABLISHED, 0);
                e.c.param.ud = rdma_ud_param {
                    private_data: ptr::null(),
                    private_data_len: 0,
                    ah_attr: st.peer.unwrap_or_default(),
                    qp_num: qpn,
                    qkey,
                };
                deliver(id, e);
            }
        }
    }

    /// A connection ended: its event, and the engine's name for it forgotten.
    fn end(&mut self, d: usize, comm: CommId, ev: c_int, status: c_int) {
        let Some(id) = self.devs[d].conns.remove(&comm) else { return };
        if let Some(st) = self.ids.get_mut(&id) {
            st.comm = None;
            st.established = false;
        }
        deliver(id, new_ev(id, 0, ev, status));
    }

    /// A REQ or SIDR_REQ for a listened service: a new ID on the listener's channel, and CONNECT_REQUEST.
    fn on_request(&mut self, d: usize, comm: CommId, req: Option<&Req>, sidr: Option<&SidrReq>) {
        let svc = req.map_or_else(|| sidr.map_or(0, |s| s.service_id), |r| r.service_id);
        let reject = |cm: &mut Cm| {
            let e = &mut cm.devs[d].engine;
            let _ = if sidr.is_some() { e.sidr_reject(comm) } else { e.reject(comm, &[]) };
        };
        let Some(&listener) = self.devs[d].listeners.get(&svc) else { return reject(self) };
        let pd_bytes: &[u8] = match (req, sidr) {
            (Some(r), _) => &r.private_data,
            (_, Some(s)) => &s.private_data,
            _ => return,
        };
        let Ok(hdr) = CmaHdr::parse(pd_bytes) else {
            log::info!("a request without rdma_cm's header: rejected");
            return reject(self);
        };
        let Some(peer) = self.devs[d].engine_peer(comm, req) else { return reject(self) };
        let port = ip::port_of_service(svc).map_or(0, |(_, p)| p);
        // SAFETY: the listener is a live ID of this library.
        let l = unsafe { &*(listener as *mut Id) };
        // SAFETY: all-zero is a valid rdma_cm_id (null pointers, zero numbers).
        let mut c: rdma_cm_id = unsafe { std::mem::zeroed() };
        c.verbs = self.devs[d].ctx;
        c.channel = l.channel;
        c.context = l.context;
        c.ps = l.ps;
        c.port_num = 1;
        c.qp_type = l.qp_type;
        let src = SocketAddr::new(hdr.dst, port);
        let dst = SocketAddr::new(hdr.src, hdr.src_port);
        addr::write_storage(&mut c.route.addr.src_storage, src);
        addr::write_storage(&mut c.route.addr.dst_storage, dst);
        let id = Box::into_raw(Box::new(c)) as usize;
        let mut st = IdState::new(self.ids.get(&listener).is_some_and(|s| s.sync));
        st.dev = Some(d);
        st.src = Some(src);
        st.dst = Some(dst);
        st.peer = Some(peer);
        st.listener = listener;
        st.comm = Some((d, comm));
        st.had_connection = true;
        st.psn = (self.now_ns() as u32 ^ comm.wrapping_mul(2_654_435_761)) & 0xff_ffff;
        let mut e = new_ev(id, listener, event::CONNECT_REQUEST, 0);
        if let Some(r) = req {
            st.remote_qpn = r.local_qpn;
            st.remote_psn = r.starting_psn;
            st.remote_mtu = r.path_mtu;
            let conn = rdma_conn_param {
                private_data: ptr::null(),
                private_data_len: (cm::private_len::REQ - CMA_HDR_LEN) as u8,
                responder_resources: r.initiator_depth,
                initiator_depth: r.responder_resources,
                flow_control: r.end_to_end_flow_control.into(),
                retry_count: r.retry_count,
                rnr_retry_count: r.rnr_retry_count,
                srq: r.srq.into(),
                qp_num: r.local_qpn,
            };
            set_conn(&mut e, conn, &r.private_data[CMA_HDR_LEN..]);
        } else if let Some(s) = sidr {
            let n = cm::private_len::SIDR_REQ - CMA_HDR_LEN;
            e.data[..n].copy_from_slice(&s.private_data[CMA_HDR_LEN..]);
            e.c.param.ud = rdma_ud_param {
                private_data: e.data.as_ptr().cast(),
                private_data_len: n as u8,
                ah_attr: peer,
                qp_num: 0,
                qkey: 0,
            };
        }
        fill_path(&mut st, &self.devs[d]);
        // SAFETY: the new ID is ours; its route points at the path record its state owns.
        unsafe {
            (*(id as *mut Id)).route.path_rec = &mut *st.path;
            (*(id as *mut Id)).route.num_paths = 1;
        }
        self.devs[d].conns.insert(comm, id);
        self.ids.insert(id, st);
        deliver(id, e);
    }
}

impl Dev {
    /// The data path back to a REQ's sender (from its primary path), or the GSI path a SIDR_REQ came on.
    fn engine_peer(&self, comm: CommId, req: Option<&Req>) -> Option<ibv_ah_attr> {
        let mut a = ibv_ah_attr { port_num: 1, ..ibv_ah_attr::default() };
        match req {
            Some(r) if self.ib => a.dlid = r.path.local_lid,
            Some(r) => {
                a.is_global = 1;
                a.grh.dgid.raw = r.path.local_gid;
                a.grh.sgid_index = self.sgid_index;
                a.grh.hop_limit = 64;
            }
            None => return self.engine.sidr_peer(comm).copied(),
        }
        Some(a)
    }

    /// Sends what the engine has, as far as send slots allow.
    fn transmit(&mut self) {
        let Some(g) = self.gsi.as_mut() else {
            while self.engine.poll_output().is_some() {}
            return;
        };
        while let Some(m) = self.engine.poll_output() {
            g.backlog.push_back(m);
        }
        while !g.backlog.is_empty() {
            let Some(s) = g.free.pop() else { break };
            let (mut attr, mad) = g.backlog.pop_front().expect("not empty");
            // SAFETY: our PD; an address this process's devices resolve.
            let ah = unsafe { ibv_create_ah(g.pd, &mut attr) };
            if ah.is_null() {
                log::info!("QP1: no address handle for a MAD ({})", std::io::Error::last_os_error());
                g.free.push(s);
                continue;
            }
            log::debug!("QP1: sending attribute {:#x} to {attr:?}", u16::from_be_bytes([mad[16], mad[17]]));
            let off = NRECV * RECV_SLOT + s * MAD_LEN;
            g.buf[off..off + MAD_LEN].copy_from_slice(&mad);
            let mut sge = ibv_sge { addr: g.buf[off..].as_ptr() as u64, length: MAD_LEN as u32, lkey: g.lkey };
            // SAFETY: all-zero is a valid ibv_send_wr (null pointers, zero numbers).
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = (NRECV + s) as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = 2; // IBV_WR_SEND
            wr.send_flags = 2; // IBV_SEND_SIGNALED
            wr.wr = ibv_send_wr_wr { ud: wr_ud { ah, remote_qpn: 1, remote_qkey: QP1_QKEY } };
            let mut bad = ptr::null_mut();
            // SAFETY: our live GSI QP; the work request and its SGE live through the call.
            let r = unsafe { post_send(g.qp, &mut wr, &mut bad) };
            if r != 0 {
                log::info!("QP1: post_send failed ({r})");
                // SAFETY: the AH made above, unused.
                unsafe { ibv_destroy_ah(ah) };
                g.free.push(s);
                continue;
            }
            g.ah[s] = ah;
        }
    }
}

impl Gsi {
    fn post_recv(&mut self, slot: usize) {
        let off = slot * RECV_SLOT;
        let mut sge = ibv_sge { addr: self.buf[off..].as_ptr() as u64, length: RECV_SLOT as u32, lkey: self.lkey };
        let mut wr = ibv_recv_wr { wr_id: slot as u64, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        // SAFETY: our live GSI QP; the work request and its SGE live through the call.
        let r = unsafe { post_recv(self.qp, &mut wr, &mut bad) };
        if r != 0 {
            log::error!("QP1: post_recv failed ({r})");
        }
    }
}

/// `ibv_poll_cq` (an inline of verbs.h: the context's op).
///
/// # Safety
/// `cq` is a live CQ of the drop-in library.
pub(crate) unsafe fn poll_cq(cq: *mut ibv_cq, wcs: &mut [ibv_wc]) -> c_int {
    // SAFETY: the caller's live CQ and its context.
    let f = unsafe { (*(*cq).context).ops.poll_cq };
    // SAFETY: as above; room for wcs.len() completions.
    f.map_or(-1, |f| unsafe { f(cq, wcs.len() as c_int, wcs.as_mut_ptr()) })
}

/// # Safety
/// `qp` is a live QP of the drop-in library; `wr` a valid list.
pub(crate) unsafe fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    // SAFETY: the caller's live QP and its context.
    let f = unsafe { (*(*qp).context).ops.post_send };
    // SAFETY: as above.
    f.map_or(libc::EOPNOTSUPP, |f| unsafe { f(qp, wr, bad) })
}

/// # Safety
/// `qp` is a live QP of the drop-in library; `wr` a valid list.
unsafe fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    // SAFETY: the caller's live QP and its context.
    let f = unsafe { (*(*qp).context).ops.post_recv };
    // SAFETY: as above.
    f.map_or(libc::EOPNOTSUPP, |f| unsafe { f(qp, wr, bad) })
}

/// What `rdma_connect`/`rdma_accept` pass on to the CM.
#[derive(Debug, Default)]
pub(crate) struct ConnectArgs<'a> {
    pub ps: u16,
    pub ud: bool,
    pub qpn: u32,
    pub qkey: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: bool,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: bool,
    pub private_data: &'a [u8],
}

fn copy_private(to: &mut [u8], from: &[u8]) -> Result<(), c_int> {
    if from.len() > to.len() {
        return Err(libc::EINVAL);
    }
    to[..from.len()].copy_from_slice(from);
    Ok(())
}

fn new_ev(id: usize, listen: usize, ev: c_int, status: c_int) -> Box<Ev> {
    // SAFETY: all-zero is a valid event (null pointers, zero numbers).
    let mut e: Box<Ev> = Box::new(unsafe { std::mem::zeroed() });
    e.c.id = id as *mut Id;
    e.c.listen_id = listen as *mut Id;
    e.c.event = ev;
    e.c.status = status;
    e
}

fn set_conn(e: &mut Ev, mut conn: rdma_conn_param, data: &[u8]) {
    let n = data.len().min(e.data.len());
    e.data[..n].copy_from_slice(&data[..n]);
    conn.private_data = e.data.as_ptr().cast();
    conn.private_data_len = n.min(255) as u8;
    e.c.param.conn = conn;
}

/// Queues an event on the channel of ID `id`.
pub(crate) fn deliver(id: usize, e: Box<Ev>) {
    log::debug!("event {} status {} on ID {id:#x}", e.c.event, e.c.status);
    // SAFETY: a live ID of this library; its channel (a `Channel` of this library) outlives it.
    let ch = unsafe { (*(id as *mut Id)).channel };
    if ch.is_null() {
        return;
    }
    // SAFETY: as above.
    unsafe { (*ch.cast::<Channel>()).push(Box::into_raw(e)) };
}

/// Fills an ID's path record from its state (what `rdma_resolve_route` reports).
pub(crate) fn fill_path(st: &mut IdState, dev: &Dev) {
    let p = &mut st.path;
    **p = ibv_sa_path_rec::default();
    p.sgid.raw = dev.gid;
    if let Some(peer) = st.peer {
        p.dgid = peer.grh.dgid;
        p.dlid = peer.dlid.to_be();
    }
    p.slid = dev.lid.to_be();
    p.hop_limit = if dev.ib { 0 } else { 64 };
    p.pkey = 0xffffu16.to_be();
    p.reversible = 1;
    p.numb_path = 1;
    p.mtu = dev.active_mtu as u8;
    p.mtu_selector = 2; // exactly
    p.rate = 2;
    p.packet_life_time = PACKET_LIFE_TIME;
}

/// Moves an RC QP to INIT on the ID's port (what `rdma_create_qp` leaves it in).
///
/// # Safety
/// `qp` is a live QP of the drop-in library.
pub(crate) unsafe fn qp_init(qp: *mut ibv_qp, ud: bool) -> Result<(), c_int> {
    // SAFETY: every field of ibv_qp_attr is a number.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = qps::INIT;
    a.port_num = 1;
    a.pkey_index = 0;
    let mut m = mask::STATE | mask::PKEY_INDEX | mask::PORT;
    if ud {
        a.qkey = RDMA_UDP_QKEY;
        m |= mask::QKEY;
    } else {
        // The rights of a connection with responder resources; `rc_rtr_rts` sets the connection's own.
        a.qp_access_flags = access::conn(1);
        m |= mask::ACCESS_FLAGS;
    }
    // SAFETY: the caller's live QP.
    check(unsafe { ibv_modify_qp(qp, &mut a, m) })?;
    if ud {
        a.qp_state = qps::RTR;
        // SAFETY: as above.
        check(unsafe { ibv_modify_qp(qp, &mut a, mask::STATE) })?;
        a.qp_state = qps::RTS;
        a.sq_psn = 0;
        // SAFETY: as above.
        check(unsafe { ibv_modify_qp(qp, &mut a, mask::STATE | mask::SQ_PSN) })?;
    }
    Ok(())
}

fn check(r: c_int) -> Result<(), c_int> {
    if r == 0 {
        Ok(())
    } else {
        Err(r)
    }
}

/// Moves a connected ID's RC QP to RTR and RTS toward its peer.
///
/// # Safety
/// `qp` is a live QP of the drop-in library.
pub(crate) unsafe fn rc_rtr_rts(
    qp: *mut ibv_qp,
    dev: &Dev,
    st: &IdState,
    responder_resources: u8,
    initiator_depth: u8,
    retry: u8,
    rnr_retry: u8,
) -> Result<(), c_int> {
    // SAFETY: every field of ibv_qp_attr is a number.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    // INIT→INIT first, as librdmacm does before RTR, with the rights Linux's CM gives a connected QP
    // (`cm_init_qp_init_attr`): remote writes, and reads and atomics when it has responder resources.
    a.qp_state = qps::INIT;
    a.qp_access_flags = access::conn(responder_resources);
    // SAFETY: the caller's live QP.
    check(unsafe { ibv_modify_qp(qp, &mut a, mask::STATE | mask::ACCESS_FLAGS) })?;
    a.qp_state = qps::RTR;
    a.ah_attr = st.peer.ok_or(libc::EINVAL)?;
    let mtu = if st.remote_mtu == 0 { dev.active_mtu } else { dev.active_mtu.min(c_int::from(st.remote_mtu)) };
    a.path_mtu = mtu;
    a.dest_qp_num = st.remote_qpn;
    // As Linux's rdma_cm (rdma_init_qp_attr: RTR's rq_psn is the ID's own seq_num, the PSN its REQ or REP
    // announced): each side receives at the PSN it announced and sends at the peer's.
    a.rq_psn = st.psn;
    a.max_dest_rd_atomic = responder_resources.clamp(1, 16);
    a.min_rnr_timer = 12;
    let m = mask::STATE
        | mask::AV
        | mask::PATH_MTU
        | mask::DEST_QPN
        | mask::RQ_PSN
        | mask::MAX_DEST_RD_ATOMIC
        | mask::MIN_RNR_TIMER;
    // SAFETY: the caller's live QP.
    check(unsafe { ibv_modify_qp(qp, &mut a, m) })?;
    a.qp_state = qps::RTS;
    a.sq_psn = st.remote_psn;
    a.timeout = ACK_TIMEOUT;
    a.retry_cnt = retry.min(7);
    a.rnr_retry = rnr_retry.min(7);
    a.max_rd_atomic = initiator_depth.clamp(1, 16);
    let m = mask::STATE | mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
    // SAFETY: as above.
    check(unsafe { ibv_modify_qp(qp, &mut a, m) })
}

/// Moves a QP to the error state (its work flushed).
///
/// # Safety
/// `qp` is a live QP of the drop-in library.
pub(crate) unsafe fn to_err(qp: *mut ibv_qp) {
    // SAFETY: every field of ibv_qp_attr is a number.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = qps::ERR;
    // SAFETY: the caller's live QP.
    unsafe { ibv_modify_qp(qp, &mut a, mask::STATE) };
}

fn open_devices() -> Vec<Dev> {
    let mut n: c_int = 0;
    // SAFETY: n receives the count.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut devs = Vec::new();
    for i in 0..usize::try_from(n).unwrap_or(0) {
        // SAFETY: the list has n entries (the list is kept: the devices stay while contexts are open).
        let dev = unsafe { *list.add(i) };
        // SAFETY: a device of the list.
        let ctx = unsafe { ibv_open_device(dev) };
        if ctx.is_null() {
            log::warn!("device {i} did not open ({})", std::io::Error::last_os_error());
            continue;
        }
        // SAFETY: as above; the GUID is big-endian.
        let guid = u64::from_be(unsafe { ibv_get_device_guid(dev) });
        // SAFETY: our open context.
        match unsafe { Dev::open(ctx, guid) } {
            Ok(d) => devs.push(d),
            Err(e) => log::warn!("device {i}: {e}"),
        }
    }
    devs
}

/// Whether a RoCE port's IPv4 GID entry for `a` becomes its source GID, given the simulated host's address
/// (`host_ip`) and the address taken so far (`taken`): the last entry of the host's address, RoCE v2's (the v1
/// entry comes first), as perftest picks; without one (a port given another address, or a port whose node GUID is
/// no simulated host's, as on a VDE fabric), the last IPv4 entry. Issue 34: a VDE port took none, so its CM MADs
/// left from a link-local GID to an IPv4 peer, which rdma_rxe ignored.
fn takes_v4_entry(
    a: std::net::Ipv4Addr,
    host_ip: Option<std::net::Ipv4Addr>,
    taken: Option<std::net::Ipv4Addr>,
) -> bool {
    match host_ip {
        Some(h) => a == h || taken != Some(h),
        None => true,
    }
}

impl Dev {
    /// # Safety
    /// `ctx` is an open context of the drop-in library.
    unsafe fn open(ctx: *mut ibv_context, guid: u64) -> Result<Dev, String> {
        // SAFETY: every field of ibv_port_attr is a number.
        let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the caller's context.
        if unsafe { ibv_query_port(ctx, 1, &mut pa) } != 0 {
            return Err("ibv_query_port failed".into());
        }
        let ib = pa.link_layer != 2; // IBV_LINK_LAYER_ETHERNET
        let host = addr::host_of_guid(guid);
        let (mut sgid_index, mut gid) = (0u8, [0u8; 16]);
        let mut ipv4 = host.filter(|_| ib).map(|h| h.ipv4);
        for i in 0..pa.gid_tbl_len.min(256) {
            let mut g = ibv_gid::default();
            // SAFETY: as above.
            if unsafe { ibv_query_gid(ctx, 1, i, &mut g) } != 0 {
                continue;
            }
            if i == 0 {
                gid = g.raw;
            }
            if let Some(a) = addr::gid_v4(&g.raw).filter(|_| !ib) {
                if takes_v4_entry(a, host.map(|h| h.ipv4), ipv4) {
                    (sgid_index, gid, ipv4) = (i as u8, g.raw, Some(a));
                }
            }
        }
        let engine_cfg = EngineConfig { first_comm_id: (guid as u32).rotate_left(16) | 1, ..EngineConfig::default() };
        let mut d = Dev {
            ctx,
            ib,
            ipv4,
            sgid_index,
            gid,
            lid: pa.lid,
            active_mtu: pa.active_mtu,
            gsi: None,
            engine: Engine::new(guid, engine_cfg),
            conns: HashMap::new(),
            listeners: HashMap::new(),
        };
        // SAFETY: the caller's context.
        match unsafe { Gsi::open(ctx) } {
            Ok(g) => d.gsi = Some(g),
            Err(e) => log::warn!("no GSI QP, so no connections: {e}"),
        }
        Ok(d)
    }
}

impl Gsi {
    /// # Safety
    /// `ctx` is an open context of the drop-in library.
    unsafe fn open(ctx: *mut ibv_context) -> Result<Gsi, String> {
        let os = || std::io::Error::last_os_error().to_string();
        // SAFETY: the caller's context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(format!("ibv_alloc_pd: {}", os()));
        }
        // SAFETY: as above.
        let cq = unsafe { ibv_create_cq(ctx, (NRECV + NSEND) as c_int, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(format!("ibv_create_cq: {}", os()));
        }
        let cap = verbs::ibv_qp_cap {
            max_send_wr: NSEND as u32,
            max_recv_wr: NRECV as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut init = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: ptr::null_mut(),
            cap,
            qp_type: IBV_QPT_UD,
            sq_sig_all: 0,
        };
        // SAFETY: our PD and CQ.
        let qp = unsafe { mlx5_rs_create_gsi_qp(pd, &mut init) };
        if qp.is_null() {
            return Err(format!("the GSI QP: {}", os()));
        }
        // SAFETY: every field of ibv_qp_attr is a number.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = qps::INIT;
        a.port_num = 1;
        a.qkey = QP1_QKEY;
        // SAFETY: our QP.
        check(unsafe { ibv_modify_qp(qp, &mut a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY) })
            .map_err(|e| format!("GSI QP to INIT: errno {e}"))?;
        a.qp_state = qps::RTR;
        // SAFETY: as above.
        check(unsafe { ibv_modify_qp(qp, &mut a, mask::STATE) }).map_err(|e| format!("GSI QP to RTR: {e}"))?;
        a.qp_state = qps::RTS;
        // SAFETY: as above.
        check(unsafe { ibv_modify_qp(qp, &mut a, mask::STATE | mask::SQ_PSN) })
            .map_err(|e| format!("GSI QP to RTS: {e}"))?;
        let mut buf = vec![0u8; NRECV * RECV_SLOT + NSEND * MAD_LEN].into_boxed_slice();
        // SAFETY: our PD; the buffer lives as long as the GSI (never freed while the process runs).
        let mr = unsafe { ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), 1) };
        if mr.is_null() {
            return Err(format!("ibv_reg_mr: {}", os()));
        }
        // SAFETY: the MR just registered.
        let lkey = unsafe { (*mr).lkey };
        let mut g = Gsi {
            pd,
            cq,
            qp,
            lkey,
            buf,
            free: (0..NSEND).collect(),
            ah: vec![ptr::null_mut(); NSEND],
            backlog: VecDeque::new(),
        };
        for s in 0..NRECV {
            g.post_recv(s);
        }
        Ok(g)
    }
}

/// The CM thread: every millisecond, MADs in and out, timers, events.
fn agent() {
    loop {
        std::thread::sleep(TICK);
        let Some(m) = CM.get() else { continue };
        lock(m).service();
    }
}

#[cfg(test)]
mod sgid_tests {
    use super::takes_v4_entry;
    use std::net::Ipv4Addr;

    /// The GID table's IPv4 entries in order (v1 then v2 of each address), through the rule: the index taken.
    fn pick(entries: &[Ipv4Addr], host_ip: Option<Ipv4Addr>) -> Option<usize> {
        let (mut taken, mut index) = (None, None);
        for (i, a) in entries.iter().enumerate() {
            if takes_v4_entry(*a, host_ip, taken) {
                (taken, index) = (Some(*a), Some(i));
            }
        }
        index
    }

    #[test]
    fn the_source_gid_is_the_hosts_v2_entry_else_the_last_ipv4_entry() {
        let (host, other) = (Ipv4Addr::new(192, 168, 1, 10), Ipv4Addr::new(10, 0, 0, 2));
        // The simulated host's address, wherever it stands.
        assert_eq!(pick(&[host, host, other, other], Some(host)), Some(1));
        assert_eq!(pick(&[other, other, host, host], Some(host)), Some(3));
        // A port given another address (wire=qemu on host 0): its last entry.
        assert_eq!(pick(&[other, other], Some(host)), Some(1));
        // A port whose GUID is no simulated host's (a VDE identity): its last entry, not none.
        assert_eq!(pick(&[other, other], None), Some(1));
        assert_eq!(pick(&[], None), None);
    }
}

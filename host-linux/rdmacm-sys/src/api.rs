//! The exported functions of `<rdma/rdma_cma.h>` and `<rdma/rdma_verbs.h>`'s library part, as rdma-core 44's
//! librdmacm answers them: 0 or a pointer on success, -1 (or NULL) with `errno` on failure.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ptr;

use mlx5_rdmacm::ip::{self, ps};

use crate::abi::verbs::verbs_context;
use crate::abi::*;
use crate::addr;
use crate::agent::{self, cm, deliver, lock, Channel, ConnectArgs, Ev, IdState};
use crate::{fail, guard, set_errno};

/// Whether the program made descriptor `fd` non-blocking.
pub(crate) fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no pointer.
    let f = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    f >= 0 && f & libc::O_NONBLOCK != 0
}

fn id_ptr(id: *mut rdma_cm_id) -> usize {
    id as usize
}

/// The ID's port space as rdma_cm's service IDs name it.
fn port_space(id: &rdma_cm_id) -> u16 {
    id.ps as u16
}

fn is_ud(id: &rdma_cm_id) -> bool {
    matches!(port_space(id), ps::UDP | ps::IPOIB) || id.qp_type == IBV_QPT_UD
}

#[no_mangle]
pub extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    guard("rdma_create_event_channel", ptr::null_mut(), || match Channel::new() {
        Ok(c) => c.cast(),
        Err(e) => {
            set_errno(e);
            ptr::null_mut()
        }
    })
}

/// # Safety
/// `channel` is a channel of this library with no ID left on it.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    guard("rdma_destroy_event_channel", (), || {
        if channel.is_null() {
            return;
        }
        // SAFETY: the caller gives back a channel made by rdma_create_event_channel.
        let ch = unsafe { Box::from_raw(channel.cast::<Channel>()) };
        // SAFETY: the eventfd, ours.
        unsafe { libc::close(ch.c.fd) };
        for e in lock(&ch.q).drain(..) {
            // SAFETY: events queued and never handed out are ours to free.
            drop(unsafe { Box::from_raw(e as *mut Ev) });
        }
    })
}

/// # Safety
/// `id` points to writable room for an ID pointer; `channel` is NULL or a channel of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: c_int,
) -> c_int {
    guard("rdma_create_id", -1, || {
        let qp_type = match ps as u16 {
            ps::TCP | ps::IB => IBV_QPT_RC,
            ps::UDP | ps::IPOIB => IBV_QPT_UD,
            _ => return fail(libc::EINVAL),
        };
        // SAFETY: the caller's arguments.
        match unsafe { create_id(channel, context, ps, qp_type) } {
            Ok(p) => {
                // SAFETY: the caller's out pointer.
                unsafe { *id = p };
                0
            }
            Err(e) => fail(e),
        }
    })
}

/// # Safety
/// `channel` is NULL or a channel of this library.
unsafe fn create_id(
    channel: *mut rdma_event_channel,
    context: *mut c_void,
    ps: c_int,
    qp_type: c_int,
) -> Result<*mut rdma_cm_id, c_int> {
    let sync = channel.is_null();
    let channel = if sync { Channel::new()?.cast() } else { channel };
    // SAFETY: all-zero is a valid rdma_cm_id.
    let mut c: rdma_cm_id = unsafe { std::mem::zeroed() };
    c.channel = channel;
    c.context = context;
    c.ps = ps;
    c.qp_type = qp_type;
    let p = Box::into_raw(Box::new(c));
    cm().ids.insert(id_ptr(p), IdState::new(sync));
    Ok(p)
}

/// # Safety
/// `id` is an ID of this library, not used again.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    guard("rdma_destroy_id", -1, || {
        let mut g = cm();
        if !g.ids.contains_key(&id_ptr(id)) {
            return fail(libc::EINVAL);
        }
        g.unlink(id_ptr(id));
        g.flush();
        let st = g.ids.remove(&id_ptr(id)).expect("present");
        drop(g);
        // SAFETY: the caller's ID, ours to free now.
        let b = unsafe { Box::from_raw(id) };
        // Its events not yet taken go with it (their counts stay on the descriptor: a read that finds no event
        // reads again), so none handed out later names a freed ID.
        if !b.channel.is_null() {
            // SAFETY: the ID's channel, one of ours, alive while IDs are on it.
            let ch = unsafe { &*b.channel.cast::<Channel>() };
            lock(&ch.q).retain(|&e| {
                let e = e as *mut Ev;
                // SAFETY: queued events are ours until handed out.
                let mine = unsafe { (*e).c.id } == id;
                if mine {
                    // SAFETY: as above; removed from the queue here.
                    drop(unsafe { Box::from_raw(e) });
                }
                !mine
            });
        }
        // SAFETY: what this library made for the ID, no longer used by it.
        unsafe {
            for cq in &st.own_cqs {
                agent::ibv_destroy_cq(*cq);
            }
            for ch in &st.own_channels {
                agent::ibv_destroy_comp_channel(*ch);
            }
            if !st.own_pd.is_null() {
                agent::ibv_dealloc_pd(st.own_pd);
            }
            if st.sync {
                rdma_destroy_event_channel(b.channel);
            }
        }
        0
    })
}

/// Binds an ID to the port that has `ip` (the own port for the wildcard and loopback) and a port number.
fn bind(g: &mut agent::Cm, id: *mut rdma_cm_id, a: SocketAddr) -> Result<(), c_int> {
    let IpAddr::V4(v4) = a.ip() else { return Err(libc::EAFNOSUPPORT) };
    let d = g.dev_of_ip(v4).ok_or(libc::EADDRNOTAVAIL)?;
    let port = if a.port() == 0 { g.ephemeral_port() } else { a.port() };
    let a = SocketAddr::new(a.ip(), port);
    let st = g.ids.get_mut(&id_ptr(id)).ok_or(libc::EINVAL)?;
    st.src = Some(a);
    // The wildcard stays on no device until a request arrives (as Linux leaves `verbs` NULL).
    st.dev = (!v4.is_unspecified()).then_some(d);
    // SAFETY: a live ID of this library.
    let c = unsafe { &mut *id };
    addr::write_storage(&mut c.route.addr.src_storage, a);
    if let Some(d) = st.dev {
        c.verbs = g.devs[d].ctx;
        c.port_num = 1;
    }
    Ok(())
}

/// # Safety
/// `id` is an ID of this library; `addr` a socket address.
#[no_mangle]
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    guard("rdma_bind_addr", -1, || {
        // SAFETY: the caller's address.
        let Some(a) = (unsafe { addr::read_sockaddr(addr) }) else { return fail(libc::EAFNOSUPPORT) };
        match bind(&mut cm(), id, a) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

/// Waits on a synchronous ID's own channel for its next event: Ok for `want`, the failure's errno otherwise.
fn wait_sync(id: *mut rdma_cm_id, want: c_int) -> Result<(), c_int> {
    let sync = cm().ids.get(&id_ptr(id)).is_some_and(|s| s.sync);
    if !sync {
        return Ok(());
    }
    // SAFETY: a live ID of this library.
    let ch = unsafe { (*id).channel };
    let mut ev = ptr::null_mut();
    // SAFETY: the ID's own channel.
    if unsafe { rdma_get_cm_event(ch, &mut ev) } != 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO));
    }
    // SAFETY: the event just taken.
    let (got, status) = unsafe { ((*ev).event, (*ev).status) };
    // SAFETY: as above, acknowledged once.
    unsafe { rdma_ack_cm_event(ev) };
    if got == want {
        return Ok(());
    }
    Err(match got {
        event::REJECTED => libc::ECONNREFUSED,
        _ if status < 0 => -status,
        _ => libc::EIO,
    })
}

/// # Safety
/// `id` is an ID of this library; `src` NULL or and `dst` socket addresses.
#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard("rdma_resolve_addr", -1, || {
        // SAFETY: the caller's addresses.
        let (src, dst) = unsafe { (addr::read_sockaddr(src), addr::read_sockaddr(dst)) };
        let Some(dst) = dst else { return fail(libc::EINVAL) };
        let IpAddr::V4(dst_ip) = dst.ip() else { return fail(libc::EAFNOSUPPORT) };
        let mut g = cm();
        let Some(st) = g.ids.get(&id_ptr(id)) else { return fail(libc::EINVAL) };
        if st.src.is_none() || src.is_some() {
            let at = src.unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
            if let Err(e) = bind(&mut g, id, at) {
                return fail(e);
            }
        }
        let st = g.ids.get(&id_ptr(id)).expect("bound");
        let d = match st.dev.or_else(|| g.dev_of_ip(dst_ip)).or((!g.devs.is_empty()).then_some(0)) {
            Some(d) => d,
            None => return fail(libc::ENODEV),
        };
        let path = g.path_to(d, dst_ip);
        let own_ip = g.devs[d].ipv4.unwrap_or(Ipv4Addr::LOCALHOST);
        let (dgid, sgid) = (path.map(|p| p.grh.dgid).unwrap_or_default(), g.devs[d].gid);
        let ctx = g.devs[d].ctx;
        let st = g.ids.get_mut(&id_ptr(id)).expect("bound");
        let src = st.src.expect("bound");
        let src = if src.ip().is_unspecified() { SocketAddr::new(IpAddr::V4(own_ip), src.port()) } else { src };
        st.src = Some(src);
        st.dst = Some(dst);
        st.dev = Some(d);
        st.peer = path;
        // SAFETY: a live ID of this library.
        let c = unsafe { &mut *id };
        c.verbs = ctx;
        c.port_num = 1;
        addr::write_storage(&mut c.route.addr.src_storage, src);
        addr::write_storage(&mut c.route.addr.dst_storage, dst);
        c.route.addr.ibaddr.sgid.raw = sgid;
        c.route.addr.ibaddr.dgid = dgid;
        c.route.addr.ibaddr.pkey = 0xffffu16.to_be();
        drop(g);
        // An address no simulated port has is unreachable, as a failed neighbour lookup is.
        let (ev, status) = match path {
            Some(_) => (event::ADDR_RESOLVED, 0),
            None => {
                log::info!("rdma_resolve_addr: no simulated port has {dst_ip}");
                (event::ADDR_ERROR, -libc::EHOSTUNREACH)
            }
        };
        deliver(id_ptr(id), new_event(id, ev, status));
        match wait_sync(id, event::ADDR_RESOLVED) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

fn new_event(id: *mut rdma_cm_id, ev: c_int, status: c_int) -> Box<Ev> {
    // SAFETY: all-zero is a valid event.
    let mut e: Box<Ev> = Box::new(unsafe { std::mem::zeroed() });
    e.c.id = id;
    e.c.event = ev;
    e.c.status = status;
    e
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    guard("rdma_resolve_route", -1, || {
        let mut g = cm();
        let agent::Cm { devs, ids, .. } = &mut *g;
        let Some(st) = ids.get_mut(&id_ptr(id)) else { return fail(libc::EINVAL) };
        let (Some(d), Some(_)) = (st.dev, st.peer) else { return fail(libc::EINVAL) };
        agent::fill_path(st, &devs[d]);
        // SAFETY: a live ID; the path record lives in its state.
        unsafe {
            (*id).route.path_rec = &mut *st.path;
            (*id).route.num_paths = 1;
        }
        drop(g);
        deliver(id_ptr(id), new_event(id, event::ROUTE_RESOLVED, 0));
        match wait_sync(id, event::ROUTE_RESOLVED) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, _backlog: c_int) -> c_int {
    guard("rdma_listen", -1, || {
        let mut g = cm();
        let Some(st) = g.ids.get(&id_ptr(id)) else { return fail(libc::EINVAL) };
        if st.src.is_none() {
            if let Err(e) = bind(&mut g, id, SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)) {
                return fail(e);
            }
        }
        let st = g.ids.get(&id_ptr(id)).expect("bound");
        // SAFETY: a live ID.
        let svc = ip::service_id(port_space(unsafe { &*id }), st.src.expect("bound").port());
        let devs: Vec<usize> = match st.dev {
            Some(d) => vec![d],
            None => (0..g.devs.len()).collect(),
        };
        if devs.is_empty() {
            return fail(libc::ENODEV);
        }
        let mut done = Vec::new();
        for d in devs {
            if g.devs[d].engine.listen(svc).is_err() {
                for (d, s) in done {
                    let dev: &mut agent::Dev = &mut g.devs[d];
                    dev.engine.unlisten(s);
                    dev.listeners.remove(&s);
                }
                return fail(libc::EADDRINUSE);
            }
            g.devs[d].listeners.insert(svc, id_ptr(id));
            done.push((d, svc));
        }
        g.ids.get_mut(&id_ptr(id)).expect("bound").listening = done;
        0
    })
}

/// The private data a parameter block names.
///
/// # Safety
/// `p` points to `len` readable bytes or is NULL.
unsafe fn private<'a>(p: *const c_void, len: u8) -> &'a [u8] {
    if p.is_null() || len == 0 {
        return &[];
    }
    // SAFETY: the caller's bytes.
    unsafe { std::slice::from_raw_parts(p.cast(), usize::from(len)) }
}

fn args<'a>(id: &rdma_cm_id, p: Option<&'a rdma_conn_param>) -> ConnectArgs<'a> {
    let d = rdma_conn_param {
        private_data: ptr::null(),
        private_data_len: 0,
        responder_resources: 1,
        initiator_depth: 1,
        flow_control: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    };
    let c = p.copied().unwrap_or(d);
    let qpn = if id.qp.is_null() {
        c.qp_num
    } else {
        // SAFETY: the ID's live QP.
        unsafe { (*id.qp).qp_num }
    };
    ConnectArgs {
        ps: port_space(id),
        ud: is_ud(id),
        qpn,
        qkey: RDMA_UDP_QKEY,
        responder_resources: c.responder_resources,
        initiator_depth: c.initiator_depth,
        flow_control: c.flow_control != 0,
        retry_count: c.retry_count,
        rnr_retry_count: c.rnr_retry_count,
        srq: c.srq != 0 || !id.srq.is_null(),
        // SAFETY: the caller's private data.
        private_data: p.map_or(&[], |p| unsafe { private(p.private_data, p.private_data_len) }),
    }
}

/// # Safety
/// `id` is an ID of this library; `param` NULL or a parameter block.
#[no_mangle]
pub unsafe extern "C" fn rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard("rdma_connect", -1, || {
        // SAFETY: the caller's ID and parameters.
        let (c, p) = unsafe { (&*id, param.as_ref()) };
        let a = args(c, p);
        let mut g = cm();
        let r = g.connect(id_ptr(id), &a);
        g.flush();
        drop(g);
        if let Err(e) = r {
            return fail(e);
        }
        match wait_sync(id, event::ESTABLISHED) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

/// # Safety
/// `id` is an ID of this library; `param` NULL or a parameter block.
#[no_mangle]
pub unsafe extern "C" fn rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard("rdma_accept", -1, || {
        // SAFETY: the caller's ID and parameters.
        let (c, p) = unsafe { (&*id, param.as_ref()) };
        let a = args(c, p);
        let mut g = cm();
        if !a.ud && !c.qp.is_null() {
            let agent::Cm { devs, ids, .. } = &mut *g;
            let Some(st) = ids.get(&id_ptr(id)) else { return fail(libc::EINVAL) };
            let Some(d) = st.dev else { return fail(libc::EINVAL) };
            // Our QP answers with the REP: RTR toward the requester, then RTS, before the REP goes.
            // SAFETY: the ID's live QP.
            let r = unsafe {
                agent::rc_rtr_rts(c.qp, &devs[d], st, a.responder_resources, a.initiator_depth, 7, a.rnr_retry_count)
            };
            if let Err(e) = r {
                return fail(e);
            }
        }
        let r = g.accept(id_ptr(id), &a);
        g.flush();
        if let Err(e) = r {
            return fail(e);
        }
        if a.ud {
            // A SIDR exchange ends with its reply: the ID keeps no connection.
            g.unlink(id_ptr(id));
            return 0;
        }
        drop(g);
        match wait_sync(id, event::ESTABLISHED) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

/// # Safety
/// `id` is an ID of this library; `data` NULL or `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    guard("rdma_reject", -1, || {
        let mut g = cm();
        let Some((d, comm)) = g.ids.get(&id_ptr(id)).and_then(|s| s.comm) else { return fail(libc::EINVAL) };
        // SAFETY: the caller's ID and bytes.
        let (ud, pd) = unsafe { (is_ud(&*id), private(data, len)) };
        let e = &mut g.devs[d].engine;
        let r = if ud { e.sidr_reject(comm) } else { e.reject(comm, pd) };
        g.unlink(id_ptr(id));
        g.flush();
        match r {
            Ok(()) => 0,
            Err(_) => fail(libc::EINVAL),
        }
    })
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    guard("rdma_disconnect", -1, || {
        // SAFETY: the caller's ID.
        let qp = unsafe { (*id).qp };
        if !qp.is_null() {
            // As librdmacm: the QP goes to the error state first, so posted work is flushed.
            // SAFETY: the ID's live QP.
            unsafe { agent::to_err(qp) };
        }
        let mut g = cm();
        let now = g.now_ns();
        let Some(st) = g.ids.get(&id_ptr(id)) else { return fail(libc::EINVAL) };
        match (st.comm, st.established) {
            (Some((d, comm)), true) => {
                // An error means a DREQ already crossed ours: the DISCONNECTED event is on its way.
                let _ = g.devs[d].engine.disconnect(now, comm);
                g.flush();
                0
            }
            // Disconnected already (the peer's DREQ, a REJ, a timeout): nothing to send, as Linux answers 0.
            _ if st.had_connection => 0,
            // Never connected: as Linux, EINVAL.
            _ => fail(libc::EINVAL),
        }
    })
}

/// The attributes that move a program's own QP to `qp_attr.qp_state` for this ID (INIT, RTR or RTS), as rdma_cm
/// would set them on a QP it made.
///
/// # Safety
/// `id` is an ID of this library; `attr` and `mask` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_init_qp_attr(id: *mut rdma_cm_id, attr: *mut ibv_qp_attr, mask: *mut c_int) -> c_int {
    guard("rdma_init_qp_attr", -1, || {
        // SAFETY: the caller's pointers.
        let (Some(a), Some(m)) = (unsafe { attr.as_mut() }, unsafe { mask.as_mut() }) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: the caller's ID.
        let ud = is_ud(unsafe { &*id });
        let g = cm();
        let Some(st) = g.ids.get(&id_ptr(id)) else { return fail(libc::EINVAL) };
        use agent::{mask as k, qps};
        match a.qp_state {
            qps::INIT => {
                a.pkey_index = 0;
                a.port_num = 1;
                *m = k::STATE | k::PKEY_INDEX | k::PORT;
                if ud {
                    a.qkey = RDMA_UDP_QKEY;
                    *m |= k::QKEY;
                } else {
                    // A connection with responder resources (the usual case): writes, reads and atomics.
                    a.qp_access_flags = agent::access::conn(1);
                    *m |= k::ACCESS_FLAGS;
                }
            }
            qps::RTR if ud => *m = k::STATE,
            qps::RTR => {
                let (Some(d), Some(peer)) = (st.dev, st.peer) else { return fail(libc::EINVAL) };
                let dev = &g.devs[d];
                a.ah_attr = peer;
                a.path_mtu =
                    if st.remote_mtu == 0 { dev.active_mtu } else { dev.active_mtu.min(c_int::from(st.remote_mtu)) };
                a.dest_qp_num = st.remote_qpn;
                // Linux's pairing: receive at the own announced PSN, send at the peer's (see agent's RTR).
                a.rq_psn = st.psn;
                a.max_dest_rd_atomic = 1;
                a.min_rnr_timer = 12;
                *m =
                    k::STATE | k::AV | k::PATH_MTU | k::DEST_QPN | k::RQ_PSN | k::MAX_DEST_RD_ATOMIC | k::MIN_RNR_TIMER;
            }
            qps::RTS => {
                a.sq_psn = if ud { 0 } else { st.remote_psn };
                *m = k::STATE | k::SQ_PSN;
                if !ud {
                    a.timeout = agent::ACK_TIMEOUT;
                    a.retry_cnt = 7;
                    a.rnr_retry = 7;
                    a.max_rd_atomic = 1;
                    *m |= k::TIMEOUT | k::RETRY_CNT | k::RNR_RETRY | k::MAX_QP_RD_ATOMIC;
                }
            }
            _ => return fail(libc::EINVAL),
        }
        0
    })
}

/// The RTU went with the REP's answer already (the CM answers a REP at once), so there is nothing left to send.
///
/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_establish(id: *mut rdma_cm_id) -> c_int {
    guard("rdma_establish", -1, || if cm().ids.contains_key(&id_ptr(id)) { 0 } else { fail(libc::EINVAL) })
}

/// # Safety
/// `channel` is a channel of this library; `event` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_cm_event(channel: *mut rdma_event_channel, event: *mut *mut rdma_cm_event) -> c_int {
    guard("rdma_get_cm_event", -1, || {
        if channel.is_null() || event.is_null() {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller's channel, one of ours.
        let ch = unsafe { &*channel.cast::<Channel>() };
        let mut count = 0u64;
        loop {
            // SAFETY: one count into a live local from our eventfd (blocking unless the program set O_NONBLOCK).
            let n = unsafe { libc::read(ch.c.fd, ptr::addr_of_mut!(count).cast(), 8) };
            if n == 8 {
                break;
            }
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
            if n < 0 && e == libc::EINTR {
                continue;
            }
            return fail(if n == 0 { libc::ENODATA } else { e });
        }
        let Some(e) = lock(&ch.q).pop_front() else {
            // The count of an event that went with its destroyed ID: wait for the next one, as a read would.
            if crate::api::nonblocking(ch.c.fd) {
                return fail(libc::EAGAIN);
            }
            // SAFETY: the same channel and out pointer.
            return unsafe { rdma_get_cm_event(channel, event) };
        };
        let e = e as *mut Ev;
        // SAFETY: the event's ID is live until the program destroys it; the event is ours until acked.
        unsafe {
            (*(*e).c.id).event = &mut (*e).c;
            *event = &mut (*e).c;
        }
        0
    })
}

/// # Safety
/// `event` came from `rdma_get_cm_event` and is not used again.
#[no_mangle]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    guard("rdma_ack_cm_event", -1, || {
        if event.is_null() {
            return fail(libc::EINVAL);
        }
        // SAFETY: an `Ev` handed out by rdma_get_cm_event (its C part first).
        drop(unsafe { Box::from_raw(event.cast::<Ev>()) });
        0
    })
}

/// The PD for a QP of `id`: the given one, else one this library makes for the ID.
fn pd_for(id: *mut rdma_cm_id, pd: *mut ibv_pd) -> Result<*mut ibv_pd, c_int> {
    if !pd.is_null() {
        return Ok(pd);
    }
    let mut g = cm();
    let st = g.ids.get_mut(&id_ptr(id)).ok_or(libc::EINVAL)?;
    if st.own_pd.is_null() {
        // SAFETY: a live ID of this library.
        let ctx = unsafe { (*id).verbs };
        if ctx.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the ID's open context.
        st.own_pd = unsafe { agent::ibv_alloc_pd(ctx) };
        if st.own_pd.is_null() {
            return Err(libc::ENOMEM);
        }
    }
    Ok(st.own_pd)
}

/// A CQ with its own completion channel for the ID's QP when the program gave none (as librdmacm's
/// `ucma_create_cqs`: one for sends, one for receives, so `rdma_get_send_comp`/`_recv_comp` wait on their own).
fn cq_for(id: *mut rdma_cm_id, n: u32, send: bool) -> Result<*mut ibv_cq, c_int> {
    let mut g = cm();
    let st = g.ids.get_mut(&id_ptr(id)).ok_or(libc::EINVAL)?;
    // SAFETY: a live ID of this library and its open context.
    let ctx = unsafe { (*id).verbs };
    if ctx.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the ID's open context.
    let ch = unsafe { agent::ibv_create_comp_channel(ctx) };
    if ch.is_null() {
        return Err(libc::ENOMEM);
    }
    st.own_channels.push(ch);
    let n = c_int::try_from(n.max(1)).unwrap_or(c_int::MAX);
    // SAFETY: as above, with the channel just made.
    let cq = unsafe { agent::ibv_create_cq(ctx, n, id.cast(), ch, 0) };
    if cq.is_null() {
        return Err(libc::ENOMEM);
    }
    st.own_cqs.push(cq);
    // SAFETY: the caller's ID.
    unsafe {
        if send {
            (*id).send_cq_channel = ch;
            (*id).send_cq = cq;
        } else {
            (*id).recv_cq_channel = ch;
            (*id).recv_cq = cq;
        }
    }
    Ok(cq)
}

/// Puts a new QP on the ID and moves it to INIT (UD: RTS with rdma_cm's Q_Key).
fn attach_qp(id: *mut rdma_cm_id, qp: *mut ibv_qp, pd: *mut ibv_pd) -> c_int {
    // SAFETY: the QP just made; a live ID.
    unsafe {
        let ud = (*qp).qp_type == IBV_QPT_UD;
        if let Err(e) = agent::qp_init(qp, ud) {
            agent::ibv_destroy_qp(qp);
            return fail(e);
        }
        let c = &mut *id;
        c.qp = qp;
        c.pd = pd;
        c.send_cq = (*qp).send_cq;
        c.recv_cq = (*qp).recv_cq;
    }
    0
}

/// # Safety
/// `id` is an ID of this library with a device; `pd` NULL or a PD of its context; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp(id: *mut rdma_cm_id, pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> c_int {
    guard("rdma_create_qp", -1, || {
        // SAFETY: the caller's attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else { return fail(libc::EINVAL) };
        let pd = match pd_for(id, pd) {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        if a.send_cq.is_null() {
            match cq_for(id, a.cap.max_send_wr, true) {
                Ok(cq) => a.send_cq = cq,
                Err(e) => return fail(e),
            }
        }
        if a.recv_cq.is_null() {
            match cq_for(id, a.cap.max_recv_wr, false) {
                Ok(cq) => a.recv_cq = cq,
                Err(e) => return fail(e),
            }
        }
        // SAFETY: the caller's live PD and attributes.
        let qp = unsafe { agent::ibv_create_qp(pd, a) };
        if qp.is_null() {
            return -1;
        }
        attach_qp(id, qp, pd)
    })
}

/// # Safety
/// `id` is an ID of this library with a device; `attr` valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_qp_ex(id: *mut rdma_cm_id, attr: *mut ibv_qp_init_attr_ex) -> c_int {
    guard("rdma_create_qp_ex", -1, || {
        // SAFETY: the caller's attributes.
        let Some(a) = (unsafe { attr.as_mut() }) else { return fail(libc::EINVAL) };
        const PD: u32 = 1;
        let given = if a.comp_mask & PD != 0 { a.pd } else { ptr::null_mut() };
        let pd = match pd_for(id, given) {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        a.pd = pd;
        a.comp_mask |= PD;
        // SAFETY: a live ID with an open context of the drop-in libibverbs, whose verbs_context precedes it.
        let f = unsafe {
            let ctx = (*id).verbs;
            if ctx.is_null() {
                return fail(libc::EINVAL);
            }
            let vctx = ctx.cast::<u8>().sub(std::mem::offset_of!(verbs_context, context)).cast::<verbs_context>();
            (*vctx).create_qp_ex
        };
        let Some(f) = f else { return fail(libc::EOPNOTSUPP) };
        // SAFETY: the context's create_qp_ex with the caller's attributes.
        let qp = unsafe { f((*id).verbs, a) };
        if qp.is_null() {
            return -1;
        }
        attach_qp(id, qp, pd)
    })
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    guard("rdma_destroy_qp", (), || {
        // SAFETY: the caller's ID and its QP.
        unsafe {
            let c = &mut *id;
            if !c.qp.is_null() {
                agent::ibv_destroy_qp(c.qp);
                c.qp = ptr::null_mut();
            }
        }
    })
}

/// # Safety
/// `id` is an ID of this library; `channel` NULL or a channel of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_migrate_id(id: *mut rdma_cm_id, channel: *mut rdma_event_channel) -> c_int {
    guard("rdma_migrate_id", -1, || {
        let mut g = cm();
        let Some(st) = g.ids.get_mut(&id_ptr(id)) else { return fail(libc::EINVAL) };
        let (ch, sync) = if channel.is_null() {
            match Channel::new() {
                Ok(c) => (c.cast(), true),
                Err(e) => return fail(e),
            }
        } else {
            (channel, false)
        };
        st.sync = sync;
        // SAFETY: the caller's ID.
        unsafe { (*id).channel = ch };
        0
    })
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    _optval: *mut c_void,
    _optlen: usize,
) -> c_int {
    guard("rdma_set_option", -1, || {
        if !cm().ids.contains_key(&id_ptr(id)) {
            return fail(libc::EINVAL);
        }
        // RDMA_OPTION_ID (0): TOS, REUSEADDR, AFONLY, ACK_TIMEOUT change nothing one simulated wire honours.
        match (level, optname) {
            (0, 0..=3) => 0,
            _ => {
                log::warn!("rdma_set_option level {level} option {optname} is not provided (ENOSYS)");
                fail(libc::ENOSYS)
            }
        }
    })
}

/// # Safety
/// `listen` is a listening ID created without a channel; `id` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_request(listen: *mut rdma_cm_id, id: *mut *mut rdma_cm_id) -> c_int {
    guard("rdma_get_request", -1, || {
        if !cm().ids.get(&id_ptr(listen)).is_some_and(|s| s.sync) {
            return fail(libc::EINVAL);
        }
        loop {
            let mut ev = ptr::null_mut();
            // SAFETY: the listener's own channel.
            if unsafe { rdma_get_cm_event((*listen).channel, &mut ev) } != 0 {
                return -1;
            }
            // SAFETY: the event just taken, acknowledged once.
            let (kind, new) = unsafe { ((*ev).event, (*ev).id) };
            // SAFETY: as above.
            unsafe { rdma_ack_cm_event(ev) };
            if kind == event::CONNECT_REQUEST {
                // The new ID waits for its own events on a channel of its own, as the listener does.
                match Channel::new() {
                    // SAFETY: the new ID, ours.
                    Ok(c) => unsafe { (*new).channel = c.cast() },
                    Err(e) => return fail(e),
                }
                if let Some(st) = cm().ids.get_mut(&id_ptr(new)) {
                    st.sync = true;
                }
                let ep = cm().ids.get(&id_ptr(listen)).and_then(|s| s.ep_qp.as_ref().map(|b| (b.0, unsafe_copy(&b.1))));
                if let Some((pd, mut a)) = ep {
                    // SAFETY: the new ID on its device; the listener's saved attributes.
                    if unsafe { rdma_create_qp(new, pd, &mut a) } != 0 {
                        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
                        // SAFETY: the new ID, not handed out.
                        let _ = unsafe { rdma_reject(new, ptr::null(), 0) };
                        // SAFETY: as above.
                        unsafe { rdma_destroy_id(new) };
                        return fail(e);
                    }
                }
                // SAFETY: the caller's out pointer.
                unsafe { *id = new };
                return 0;
            }
        }
    })
}

/// A copy of QP attributes (plain data: numbers and pointers the program owns).
fn unsafe_copy(a: &ibv_qp_init_attr) -> ibv_qp_init_attr {
    // SAFETY: a valid value of a plain C structure, read bit for bit.
    unsafe { ptr::read(a) }
}

/// # Safety
/// `id` writable; `res` an rdma_getaddrinfo result; `pd`, `attr` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard("rdma_create_ep", -1, || {
        // SAFETY: the caller's address information.
        let Some(r) = (unsafe { res.as_ref() }) else { return fail(libc::EINVAL) };
        let qp_type = if r.ai_qp_type != 0 { r.ai_qp_type } else { IBV_QPT_RC };
        // SAFETY: a synchronous ID (no channel).
        let new = match unsafe { create_id(ptr::null_mut(), ptr::null_mut(), r.ai_port_space, qp_type) } {
            Ok(p) => p,
            Err(e) => return fail(e),
        };
        let undo = |e: c_int| {
            // SAFETY: the ID made above.
            unsafe { rdma_destroy_id(new) };
            fail(e)
        };
        let passive = r.ai_flags & RAI_PASSIVE != 0;
        let r2 = if passive {
            // SAFETY: the result's source address.
            match unsafe { addr::read_sockaddr(r.ai_src_addr) } {
                Some(a) => bind(&mut cm(), new, a),
                None => Err(libc::EINVAL),
            }
        } else {
            // SAFETY: our ID and the result's addresses.
            let rc = unsafe { rdma_resolve_addr(new, r.ai_src_addr, r.ai_dst_addr, 2000) };
            // SAFETY: as above.
            let rc = if rc == 0 { unsafe { rdma_resolve_route(new, 2000) } } else { rc };
            if rc == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO))
            }
        };
        if let Err(e) = r2 {
            return undo(e);
        }
        if !attr.is_null() {
            // As librdmacm: the endpoint's QP is of the ID's type, whatever the attributes said.
            // SAFETY: the caller's attributes; the new ID.
            unsafe { (*attr).qp_type = (*new).qp_type };
        }
        if passive && !attr.is_null() {
            // A listener has no QP: each ID rdma_get_request returns gets one with these attributes.
            // SAFETY: the caller's attributes, plain data copied.
            let a = unsafe { ptr::read(attr) };
            if let Some(st) = cm().ids.get_mut(&id_ptr(new)) {
                st.ep_qp = Some(Box::new((pd, a)));
            }
        // SAFETY: the caller's attributes.
        } else if !attr.is_null() && unsafe { rdma_create_qp(new, pd, attr) } != 0 {
            return undo(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO));
        }
        // SAFETY: the caller's out pointer.
        unsafe { *id = new };
        0
    })
}

/// # Safety
/// `id` came from `rdma_create_ep` and is not used again.
#[no_mangle]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    // SAFETY: the caller's ID.
    unsafe {
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
    }
}

/// # Safety
/// `num` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
    guard("rdma_get_devices", ptr::null_mut(), || {
        let g = cm();
        let n = g.devs.len();
        // SAFETY: room for the devices and a NULL.
        let list = unsafe { libc::calloc(n + 1, std::mem::size_of::<*mut ibv_context>()) }.cast::<*mut ibv_context>();
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return ptr::null_mut();
        }
        for (i, d) in g.devs.iter().enumerate() {
            // SAFETY: within the array.
            unsafe { *list.add(i) = d.ctx };
        }
        if !num.is_null() {
            // SAFETY: the caller's out pointer.
            unsafe { *num = n as c_int };
        }
        list
    })
}

/// # Safety
/// `list` came from `rdma_get_devices`.
#[no_mangle]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: calloc'd by rdma_get_devices.
    unsafe { libc::free(list.cast()) };
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: the caller's ID.
    addr::read_storage(unsafe { &(*id).route.addr.src_storage }).map_or(0, |a| a.port().to_be())
}

/// # Safety
/// `id` is an ID of this library.
#[no_mangle]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    // SAFETY: the caller's ID.
    addr::read_storage(unsafe { &(*id).route.addr.dst_storage }).map_or(0, |a| a.port().to_be())
}

#[no_mangle]
pub extern "C" fn rdma_event_str(event: c_int) -> *const c_char {
    let s: &'static CStr = match event {
        event::ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        event::ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        event::ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        event::ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        event::CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        event::CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        event::CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        event::UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        event::REJECTED => c"RDMA_CM_EVENT_REJECTED",
        event::ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        event::DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        event::DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        event::MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        event::MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        event::ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        event::TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    };
    s.as_ptr()
}

/// # Safety
/// `node`, `service` NULL or C strings; `hints` NULL or valid; `res` writable.
#[no_mangle]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard("rdma_getaddrinfo", -1, || {
        if res.is_null() || (node.is_null() && service.is_null()) {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller's hints.
        let h = unsafe { hints.as_ref() };
        let flags = h.map_or(0, |h| h.ai_flags);
        let passive = flags & RAI_PASSIVE != 0;
        // SAFETY: the caller's C strings.
        let port = match unsafe { service.as_ref() }.map(|_| unsafe { CStr::from_ptr(service) }.to_str()) {
            None => 0,
            Some(Ok(s)) => match s.parse::<u16>() {
                Ok(p) => p,
                Err(_) => return fail(libc::EINVAL),
            },
            Some(Err(_)) => return fail(libc::EINVAL),
        };
        let ip = if node.is_null() {
            if passive {
                Ipv4Addr::UNSPECIFIED
            } else {
                Ipv4Addr::LOCALHOST
            }
        } else {
            // SAFETY: the caller's C string.
            match resolve_v4(unsafe { CStr::from_ptr(node) }) {
                Ok(ip) => ip,
                Err(e) => return e,
            }
        };
        let sa = SocketAddr::new(IpAddr::V4(ip), port);
        // SAFETY: one zeroed result (all its fields may be zero/NULL).
        let r = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }.cast::<rdma_addrinfo>();
        if r.is_null() {
            return fail(libc::ENOMEM);
        }
        let a = sockaddr_in_alloc(sa);
        if a.is_null() {
            // SAFETY: calloc'd above.
            unsafe { libc::free(r.cast()) };
            return fail(libc::ENOMEM);
        }
        // SAFETY: the result just allocated.
        let out = unsafe { &mut *r };
        out.ai_flags = flags;
        out.ai_family = libc::AF_INET;
        out.ai_port_space = h.map_or(0, |h| h.ai_port_space);
        if out.ai_port_space == 0 {
            out.ai_port_space = c_int::from(ps::TCP);
        }
        out.ai_qp_type = h.map_or(0, |h| h.ai_qp_type);
        if out.ai_qp_type == 0 {
            out.ai_qp_type = if out.ai_port_space == c_int::from(ps::UDP) { IBV_QPT_UD } else { IBV_QPT_RC };
        }
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if passive {
            out.ai_src_addr = a;
            out.ai_src_len = len;
        } else {
            out.ai_dst_addr = a;
            out.ai_dst_len = len;
        }
        // SAFETY: the caller's out pointer.
        unsafe { *res = r };
        0
    })
}

/// An IPv4 address from a numeric string or a name (`getaddrinfo`, AF_INET); a failure's return value.
fn resolve_v4(node: &CStr) -> Result<Ipv4Addr, c_int> {
    if let Ok(ip) = node.to_str().unwrap_or("").parse::<Ipv4Addr>() {
        return Ok(ip);
    }
    // SAFETY: all-zero is a valid addrinfo hint.
    let mut hint: libc::addrinfo = unsafe { std::mem::zeroed() };
    hint.ai_family = libc::AF_INET;
    let mut out = ptr::null_mut();
    // SAFETY: a C string, our hint, an out pointer.
    let r = unsafe { libc::getaddrinfo(node.as_ptr(), ptr::null(), &hint, &mut out) };
    if r != 0 || out.is_null() {
        // As rdma-core: getaddrinfo's own code.
        return Err(if r != 0 { r } else { libc::EAI_NONAME });
    }
    // SAFETY: getaddrinfo's first result.
    let ip = unsafe { addr::read_sockaddr((*out).ai_addr) };
    // SAFETY: the list getaddrinfo made.
    unsafe { libc::freeaddrinfo(out) };
    match ip {
        Some(SocketAddr::V4(v4)) => Ok(*v4.ip()),
        _ => Err(libc::EAI_FAMILY),
    }
}

fn sockaddr_in_alloc(a: SocketAddr) -> *mut libc::sockaddr {
    // SAFETY: room for a sockaddr_storage (what write_storage fills).
    let p = unsafe { libc::calloc(1, std::mem::size_of::<libc::sockaddr_storage>()) }.cast::<libc::sockaddr_storage>();
    if !p.is_null() {
        // SAFETY: just allocated.
        addr::write_storage(unsafe { &mut *p }, a);
    }
    p.cast()
}

/// # Safety
/// `res` came from `rdma_getaddrinfo`.
#[no_mangle]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut r = res;
    while !r.is_null() {
        // SAFETY: a result of rdma_getaddrinfo, every pointer in it calloc'd (or NULL).
        unsafe {
            let next = (*r).ai_next;
            libc::free((*r).ai_src_addr.cast());
            libc::free((*r).ai_dst_addr.cast());
            libc::free((*r).ai_src_canonname.cast());
            libc::free((*r).ai_dst_canonname.cast());
            libc::free((*r).ai_route);
            libc::free((*r).ai_connect);
            libc::free(r.cast());
            r = next;
        }
    }
}

/// An export that is not provided: -1 with `ENOSYS` and one log line per function.
macro_rules! not_provided {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> isize {
            static ONCE: std::sync::Once = std::sync::Once::new();
            crate::log_init();
            ONCE.call_once(|| log::warn!("{} is not provided by this librdmacm (ENOSYS)", stringify!($name)));
            set_errno(libc::ENOSYS);
            -1
        }
    )*};
}

not_provided!(
    rdma_join_multicast,
    rdma_join_multicast_ex,
    rdma_leave_multicast,
    rdma_notify,
    rdma_create_srq,
    rdma_create_srq_ex,
    rdma_destroy_srq,
    rdma_get_remote_ece,
    rdma_set_local_ece,
    rdma_reject_ece,
    raccept,
    rbind,
    rclose,
    rconnect,
    rfcntl,
    rgetpeername,
    rgetsockname,
    rgetsockopt,
    riomap,
    riounmap,
    riowrite,
    rlisten,
    rpoll,
    rread,
    rreadv,
    rrecv,
    rrecvfrom,
    rrecvmsg,
    rselect,
    rsend,
    rsendmsg,
    rsendto,
    rsetsockopt,
    rshutdown,
    rsocket,
    rwrite,
    rwritev,
);

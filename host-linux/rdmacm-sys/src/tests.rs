//! In-process tests: the exports called as a C program calls them, on the process's simulated device (the
//! drop-in libibverbs linked in from `mlx5-ibverbs`), its CM talking to itself over the port's QP1 (the
//! simulated port delivers a datagram to its own GID).

use std::ffi::{c_int, CStr};
use std::ptr;
use std::time::{Duration, Instant};

use mlx5_ibverbs as _;
use mlx5_rdmacm::ip::ps;

use crate::abi::*;
use crate::api::*;

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn sin(ip: [u8; 4], port: u16) -> libc::sockaddr_in {
    // SAFETY: all-zero is a valid sockaddr_in.
    let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    s.sin_family = libc::AF_INET as libc::sa_family_t;
    s.sin_port = port.to_be();
    s.sin_addr.s_addr = u32::from_be_bytes(ip).to_be();
    s
}

fn sa(s: &mut libc::sockaddr_in) -> *mut libc::sockaddr {
    (s as *mut libc::sockaddr_in).cast()
}

/// The next event on `ch` within `limit` (the channel's descriptor polled, as a program's poll() loop does).
fn next_event(ch: *mut rdma_event_channel, limit: Duration) -> Option<(c_int, c_int, *mut rdma_cm_id)> {
    let end = Instant::now() + limit;
    // SAFETY: a live channel of this library.
    let fd = unsafe { (*ch).fd };
    while Instant::now() < end {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd.
        if unsafe { libc::poll(&mut p, 1, 50) } == 1 {
            let mut ev = ptr::null_mut();
            // SAFETY: the channel is readable.
            assert_eq!(unsafe { rdma_get_cm_event(ch, &mut ev) }, 0);
            // SAFETY: the event just taken.
            let r = unsafe { ((*ev).event, (*ev).status, (*ev).id) };
            // SAFETY: acknowledged once.
            assert_eq!(unsafe { rdma_ack_cm_event(ev) }, 0);
            return Some(r);
        }
    }
    None
}

fn new_id(ch: *mut rdma_event_channel, ps: u16) -> *mut rdma_cm_id {
    let mut id = ptr::null_mut();
    // SAFETY: a live channel; an out pointer.
    assert_eq!(unsafe { rdma_create_id(ch, &mut id, ptr::null_mut(), c_int::from(ps)) }, 0, "{}", errno());
    id
}

const OWN: [u8; 4] = [192, 168, 1, 10];

/// The tests share the process's CM (one port): one at a time, so a test's count of live connections is its own.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn bad_arguments_are_errors_with_rdma_cm_errnos() {
    let _one = serial();
    let ch = rdma_create_event_channel();
    assert!(!ch.is_null());
    let mut id = ptr::null_mut();
    // SAFETY: a live channel; 0x999 is no port space.
    assert_eq!(unsafe { rdma_create_id(ch, &mut id, ptr::null_mut(), 0x999) }, -1);
    assert_eq!(errno(), libc::EINVAL);
    let id = new_id(ch, ps::TCP);
    // An IPv6 bind: the simulated ports have IPv4 addresses only.
    // SAFETY: all-zero is a valid sockaddr_in6.
    let mut s6: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    s6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
    // SAFETY: a live ID and a sockaddr_in6.
    assert_eq!(unsafe { rdma_bind_addr(id, (&mut s6 as *mut libc::sockaddr_in6).cast()) }, -1);
    assert_eq!(errno(), libc::EAFNOSUPPORT);
    // An address no port of this process has.
    let mut other = sin([10, 1, 2, 3], 1);
    // SAFETY: as above.
    assert_eq!(unsafe { rdma_bind_addr(id, sa(&mut other)) }, -1);
    assert_eq!(errno(), libc::EADDRNOTAVAIL);
    // Accepting or disconnecting what is not connected.
    // SAFETY: a live ID.
    assert_eq!((unsafe { rdma_accept(id, ptr::null_mut()) }, errno()), (-1, libc::EINVAL));
    // SAFETY: as above.
    assert_eq!((unsafe { rdma_disconnect(id) }, errno()), (-1, libc::EINVAL));
    // Nothing pending: a non-blocking channel says EAGAIN.
    // SAFETY: the channel's descriptor.
    unsafe { libc::fcntl((*ch).fd, libc::F_SETFL, libc::O_NONBLOCK) };
    let mut ev = ptr::null_mut();
    // SAFETY: a live channel.
    assert_eq!((unsafe { rdma_get_cm_event(ch, &mut ev) }, errno()), (-1, libc::EAGAIN));
    // Multicast is not provided: ENOSYS, never a crash.
    assert_eq!((rdma_join_multicast(), errno()), (-1, libc::ENOSYS));
    // SAFETY: a live ID, then its channel.
    unsafe {
        assert_eq!(rdma_destroy_id(id), 0);
        rdma_destroy_event_channel(ch);
    }
}

#[test]
fn an_address_no_simulated_port_has_is_an_addr_error_event() {
    let _one = serial();
    let ch = rdma_create_event_channel();
    let id = new_id(ch, ps::TCP);
    let mut dst = sin([10, 9, 9, 9], 7000);
    // SAFETY: a live ID and addresses.
    assert_eq!(unsafe { rdma_resolve_addr(id, ptr::null_mut(), sa(&mut dst), 2000) }, 0);
    let (ev, status, _) = next_event(ch, Duration::from_secs(5)).expect("an event");
    assert_eq!((ev, status), (event::ADDR_ERROR, -libc::EHOSTUNREACH));
    // SAFETY: as above.
    unsafe {
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
    }
}

#[test]
fn a_req_for_a_service_nobody_listens_on_is_rejected_with_invalid_service_id() {
    let _one = serial();
    let ch = rdma_create_event_channel();
    let id = new_id(ch, ps::TCP);
    let mut dst = sin(OWN, 7301);
    // SAFETY: a live ID and addresses.
    assert_eq!(unsafe { rdma_resolve_addr(id, ptr::null_mut(), sa(&mut dst), 2000) }, 0);
    assert_eq!(next_event(ch, Duration::from_secs(5)).map(|e| e.0), Some(event::ADDR_RESOLVED));
    // SAFETY: as above.
    assert_eq!(unsafe { rdma_resolve_route(id, 2000) }, 0);
    assert_eq!(next_event(ch, Duration::from_secs(5)).map(|e| e.0), Some(event::ROUTE_RESOLVED));
    // SAFETY: a live, resolved ID; no QP, so the parameter names the QPN.
    let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
    p.qp_num = 0x1234;
    // SAFETY: as above.
    assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0, "{}", errno());
    let (ev, status, _) = next_event(ch, Duration::from_secs(10)).expect("an answer");
    // IBTA 12.6.7.2: reason 8, invalid service ID; rdma_cm reports the reason as the status.
    assert_eq!((ev, status), (event::REJECTED, 8));
    // SAFETY: as above.
    unsafe {
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
    }
}

#[test]
fn listen_connect_accept_disconnect_on_one_port_and_a_second_listener_is_refused() {
    let _one = serial();
    let (sch, cch) = (rdma_create_event_channel(), rdma_create_event_channel());
    let listen = new_id(sch, ps::TCP);
    let mut at = sin(OWN, 7302);
    // SAFETY: live IDs and addresses.
    unsafe {
        assert_eq!(rdma_bind_addr(listen, sa(&mut at)), 0);
        assert_eq!(rdma_listen(listen, 8), 0);
    }
    let again = new_id(sch, ps::TCP);
    // SAFETY: as above.
    unsafe {
        assert_eq!(rdma_bind_addr(again, sa(&mut at)), 0);
        assert_eq!((rdma_listen(again, 8), errno()), (-1, libc::EADDRINUSE));
        rdma_destroy_id(again);
    }
    let client = new_id(cch, ps::TCP);
    // SAFETY: as above.
    unsafe {
        assert_eq!(rdma_resolve_addr(client, ptr::null_mut(), sa(&mut at), 2000), 0);
        assert_eq!(next_event(cch, Duration::from_secs(5)).map(|e| e.0), Some(event::ADDR_RESOLVED));
        assert_eq!(rdma_resolve_route(client, 2000), 0);
        assert_eq!(next_event(cch, Duration::from_secs(5)).map(|e| e.0), Some(event::ROUTE_RESOLVED));
    }
    let hello = b"hello";
    // SAFETY: all-zero is a valid parameter block.
    let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
    p.qp_num = 0x2222;
    p.private_data = hello.as_ptr().cast();
    p.private_data_len = hello.len() as u8;
    // SAFETY: as above.
    assert_eq!(unsafe { rdma_connect(client, &mut p) }, 0);
    // The listener's channel gets the request with the private data after rdma_cm's header.
    let end = Instant::now() + Duration::from_secs(10);
    let mut got = None;
    while got.is_none() && Instant::now() < end {
        let mut ev = ptr::null_mut();
        // SAFETY: blocking read on the listener's channel (an event is coming or the test fails by time).
        if unsafe { rdma_get_cm_event(sch, &mut ev) } == 0 {
            // SAFETY: the event just taken.
            let e = unsafe { &*ev };
            assert_eq!(e.event, event::CONNECT_REQUEST);
            assert_eq!(e.listen_id, listen);
            // SAFETY: a CONNECT_REQUEST carries conn parameters.
            let c = unsafe { e.param.conn };
            // SAFETY: the event's private data.
            let data = unsafe { std::slice::from_raw_parts(c.private_data.cast::<u8>(), 5) };
            assert_eq!((data, c.qp_num), (&hello[..], 0x2222));
            got = Some(e.id);
            // SAFETY: acknowledged once.
            unsafe { rdma_ack_cm_event(ev) };
        }
    }
    let child = got.expect("a connect request");
    // A program's own QP is moved with rdma_init_qp_attr: RTR toward the requester's QPN and PSN.
    // SAFETY: the new ID; a zeroed attribute with the state asked for.
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        let mut m = 0;
        a.qp_state = crate::agent::qps::RTR;
        assert_eq!(rdma_init_qp_attr(child, &mut a, &mut m), 0);
        assert_eq!((a.dest_qp_num, a.ah_attr.is_global, a.ah_attr.port_num), (0x2222, 1, 1));
        assert_ne!(m & crate::agent::mask::DEST_QPN, 0);
        a.qp_state = 99;
        assert_eq!((rdma_init_qp_attr(child, &mut a, &mut m), errno()), (-1, libc::EINVAL));
    }
    // SAFETY: the new ID, on the listener's device; no QP: the parameter names the QPN.
    unsafe {
        assert_eq!((*child).verbs, (*client).verbs, "one process, one port");
        assert!(!(*child).route.path_rec.is_null());
        let mut p: rdma_conn_param = std::mem::zeroed();
        p.qp_num = 0x3333;
        assert_eq!(rdma_accept(child, &mut p), 0, "{}", errno());
    }
    // Without a QP on the active ID, the REP comes as CONNECT_RESPONSE; the passive side sees ESTABLISHED.
    assert_eq!(next_event(cch, Duration::from_secs(10)).map(|e| e.0), Some(event::CONNECT_RESPONSE));
    assert_eq!(next_event(sch, Duration::from_secs(10)).map(|e| e.0), Some(event::ESTABLISHED));
    // PSNs pair as Linux's rdma_cm pairs them (its RTR rq_psn is the ID's own seq_num): each side receives at
    // the PSN its own REQ or REP announced and sends at the peer's.
    let psns = |id: *mut rdma_cm_id| {
        let own = crate::agent::cm().ids.get(&(id as usize)).map(|s| s.psn).expect("a live ID");
        // SAFETY: a live ID; zeroed attributes with the state asked for.
        let (rq, sq) = unsafe {
            let (mut a, mut m) = (std::mem::zeroed::<ibv_qp_attr>(), 0);
            a.qp_state = crate::agent::qps::RTR;
            assert_eq!(rdma_init_qp_attr(id, &mut a, &mut m), 0);
            let rq = a.rq_psn;
            a.qp_state = crate::agent::qps::RTS;
            assert_eq!(rdma_init_qp_attr(id, &mut a, &mut m), 0);
            (rq, a.sq_psn)
        };
        (own, rq, sq)
    };
    let ((c_own, c_rq, c_sq), (s_own, s_rq, s_sq)) = (psns(client), psns(child));
    assert_eq!((c_rq, s_rq), (c_own, s_own), "each receives at its own announced PSN");
    assert_eq!((c_sq, s_sq), (s_own, c_own), "each sends at the peer's");
    // SAFETY: as above.
    unsafe { assert_eq!(rdma_establish(client), 0) };
    // The client ends it: both sides see DISCONNECTED (DREQ, DREP).
    // SAFETY: as above.
    assert_eq!(unsafe { rdma_disconnect(client) }, 0);
    assert_eq!(next_event(sch, Duration::from_secs(10)).map(|e| e.0), Some(event::DISCONNECTED));
    assert_eq!(next_event(cch, Duration::from_secs(10)).map(|e| e.0), Some(event::DISCONNECTED));
    // The passive side's own disconnect after the peer's has nothing left to do (0, as Linux).
    // SAFETY: as above.
    assert_eq!(unsafe { rdma_disconnect(child) }, 0);
    // SAFETY: as above.
    unsafe {
        rdma_destroy_id(child);
        rdma_destroy_id(client);
        rdma_destroy_id(listen);
        rdma_destroy_event_channel(sch);
        rdma_destroy_event_channel(cch);
    }
}

#[test]
fn getaddrinfo_gives_passive_and_active_addresses_and_refuses_bad_services() {
    let _one = serial();
    let mut res = ptr::null_mut();
    // SAFETY: all-zero hints are valid.
    let mut hints: rdma_addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_flags = RAI_PASSIVE;
    hints.ai_port_space = c_int::from(ps::UDP);
    // SAFETY: C strings, hints and an out pointer.
    assert_eq!(unsafe { rdma_getaddrinfo(ptr::null(), c"7174".as_ptr(), &hints, &mut res) }, 0);
    // SAFETY: the result.
    unsafe {
        let r = &*res;
        assert_eq!((r.ai_qp_type, r.ai_port_space, r.ai_dst_addr.is_null()), (IBV_QPT_UD, 0x111, true));
        let s = &*r.ai_src_addr.cast::<libc::sockaddr_in>();
        assert_eq!((u16::from_be(s.sin_port), s.sin_addr.s_addr), (7174, 0));
        rdma_freeaddrinfo(res);
        assert_eq!(rdma_getaddrinfo(c"192.168.1.11".as_ptr(), c"80".as_ptr(), ptr::null(), &mut res), 0);
        let d = &*(*res).ai_dst_addr.cast::<libc::sockaddr_in>();
        assert_eq!(u32::from_be(d.sin_addr.s_addr).to_be_bytes(), [192, 168, 1, 11]);
        assert_eq!((*res).ai_qp_type, IBV_QPT_RC);
        rdma_freeaddrinfo(res);
        assert_eq!(rdma_getaddrinfo(c"localhost".as_ptr(), c"port".as_ptr(), ptr::null(), &mut res), -1);
        assert_eq!(errno(), libc::EINVAL);
        let s = CStr::from_ptr(rdma_event_str(event::ESTABLISHED));
        assert_eq!(s.to_str(), Ok("RDMA_CM_EVENT_ESTABLISHED"));
        assert_eq!(CStr::from_ptr(rdma_event_str(99)).to_str(), Ok("UNKNOWN EVENT"));
    }
}

/// Resolves and connects a new ID on `ch` to `at`, naming QPN `qpn` (no QP on the ID).
fn connect_to(ch: *mut rdma_event_channel, at: &mut libc::sockaddr_in, qpn: u32) -> *mut rdma_cm_id {
    let id = new_id(ch, ps::TCP);
    // SAFETY: a live ID and address; each step's event taken before the next.
    unsafe {
        assert_eq!(rdma_resolve_addr(id, ptr::null_mut(), sa(at), 2000), 0);
        assert_eq!(next_event(ch, Duration::from_secs(5)).map(|e| e.0), Some(event::ADDR_RESOLVED));
        assert_eq!(rdma_resolve_route(id, 2000), 0);
        assert_eq!(next_event(ch, Duration::from_secs(5)).map(|e| e.0), Some(event::ROUTE_RESOLVED));
        let mut p: rdma_conn_param = std::mem::zeroed();
        p.qp_num = qpn;
        assert_eq!(rdma_connect(id, &mut p), 0);
    }
    id
}

#[test]
fn a_flood_of_reqs_past_the_pending_limit_is_rejected_and_destroyed_ids_leave_no_connection() {
    let _one = serial();
    let (sch, cch) = (rdma_create_event_channel(), rdma_create_event_channel());
    let listen = new_id(sch, ps::TCP);
    let mut at = sin(OWN, 7304);
    // SAFETY: live IDs and addresses.
    unsafe {
        assert_eq!(rdma_bind_addr(listen, sa(&mut at)), 0);
        assert_eq!(rdma_listen(listen, 1), 0);
    }
    assert_eq!(crate::agent::cm().devs[0].engine.connections(), 0);
    // 140 requests the listener never answers, in batches the GSI QP's 64 receives take: the engine holds
    // 128 (its pending limit), the rest are REJected with reason 3 (no resources).
    let (mut clients, mut requests, mut rejected) = (Vec::new(), Vec::new(), 0);
    for batch in 0..5 {
        for i in 0..28 {
            clients.push(connect_to(cch, &mut at, 0x100 + batch * 28 + i));
        }
        let end = Instant::now() + Duration::from_secs(10);
        while requests.len() + rejected < clients.len() && Instant::now() < end {
            if let Some((ev, status, id)) = next_event(sch, Duration::from_millis(1)) {
                assert_eq!((ev, status), (event::CONNECT_REQUEST, 0));
                requests.push(id);
            }
            if let Some((ev, status, _)) = next_event(cch, Duration::from_millis(1)) {
                assert_eq!((ev, status), (event::REJECTED, 3), "no resources");
                rejected += 1;
            }
        }
    }
    assert_eq!((requests.len(), rejected), (128, 12));
    // Every requester gives up: each destroyed ID withdraws its REQ (REJ, timeout, its CA GUID in the ARI), so
    // the listener's side hears REJECTED for each held request and no connection stays in either engine.
    for c in clients {
        // SAFETY: our IDs.
        assert_eq!(unsafe { rdma_destroy_id(c) }, 0);
    }
    let mut withdrawn = 0;
    while withdrawn < 128 {
        let Some((ev, _, id)) = next_event(sch, Duration::from_secs(10)) else { break };
        assert_eq!(ev, event::REJECTED);
        // SAFETY: a passive ID this library made.
        unsafe { rdma_destroy_id(id) };
        withdrawn += 1;
    }
    assert_eq!(withdrawn, 128);
    assert_eq!(crate::agent::cm().devs[0].engine.connections(), 0, "no connection left in the engine");
    // SAFETY: as above.
    unsafe {
        rdma_destroy_id(listen);
        rdma_destroy_event_channel(sch);
        rdma_destroy_event_channel(cch);
    }
}

/// A client that goes away between its REQ and the RTU (its ID destroyed, as a process's IDs are when it exits):
/// the CM withdraws the REQ with a REJ of reason 4 (timeout, `IB_CM_REJ_TIMEOUT`), as Linux's `cm_destroy_id` does in REQ_SENT, so the
/// listener's side gets RDMA_CM_EVENT_REJECTED with that status on the new ID, an accept after it is refused, and
/// nothing of either side is left: no connection in the engine, no ID in the library.
#[test]
fn a_client_that_goes_away_before_the_rtu_leaves_the_listener_a_rejected_event_and_nothing_else() {
    let _one = serial();
    let ids_before = crate::agent::cm().ids.len();
    let (sch, cch) = (rdma_create_event_channel(), rdma_create_event_channel());
    let listen = new_id(sch, ps::TCP);
    let mut at = sin(OWN, 7306);
    // SAFETY: live IDs and addresses.
    unsafe {
        assert_eq!(rdma_bind_addr(listen, sa(&mut at)), 0);
        assert_eq!(rdma_listen(listen, 4), 0);
    }
    let client = connect_to(cch, &mut at, 0x321);
    let (ev, status, server) = next_event(sch, Duration::from_secs(5)).expect("the REQ arrived");
    assert_eq!((ev, status), (event::CONNECT_REQUEST, 0));
    assert_eq!(crate::agent::cm().devs[0].engine.connections(), 2, "the REQ on both sides");
    // SAFETY: our ID; the client is gone before any REP or RTU.
    assert_eq!(unsafe { rdma_destroy_id(client) }, 0);
    let (ev, status, id) = next_event(sch, Duration::from_secs(5)).expect("the listener hears of it");
    assert_eq!((ev, status, id), (event::REJECTED, 4, server), "REJECTED, reason 4 (timeout), on the new ID");
    assert!(next_event(cch, Duration::from_millis(50)).is_none(), "nothing for the destroyed client");
    // SAFETY: the passive ID, whose connection is gone.
    unsafe {
        assert_eq!((rdma_accept(server, ptr::null_mut()), errno()), (-1, libc::EINVAL));
        assert_eq!(rdma_destroy_id(server), 0);
        assert_eq!(rdma_destroy_id(listen), 0);
        rdma_destroy_event_channel(sch);
        rdma_destroy_event_channel(cch);
    }
    assert_eq!(crate::agent::cm().devs[0].engine.connections(), 0, "no connection left in the engine");
    assert_eq!(crate::agent::cm().ids.len(), ids_before, "no ID left in the library");
}

/// One RC connection on the port with a QP on each ID (made by `rdma_create_qp`): the client connects with
/// `init` as its initiator depth and responder resources, the server accepts with the same. Returns each QP's
/// state, access flags, read/atomic depths and local ACK timeout once both sides saw ESTABLISHED.
fn connected_qp_attrs(port: u16, init: u8) -> [(c_int, u32, u8, u8, u8); 2] {
    let (sch, cch) = (rdma_create_event_channel(), rdma_create_event_channel());
    let listen = new_id(sch, ps::TCP);
    let mut at = sin(OWN, port);
    // SAFETY: live IDs and addresses; each step's event taken before the next.
    unsafe {
        assert_eq!(rdma_bind_addr(listen, sa(&mut at)), 0);
        assert_eq!(rdma_listen(listen, 8), 0);
    }
    let client = new_id(cch, ps::TCP);
    let qp_attr = || {
        // SAFETY: all-zero is a valid init attribute (rdma_create_qp makes the CQs).
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.qp_type = 2; // IBV_QPT_RC
        a.cap.max_send_wr = 4;
        a.cap.max_recv_wr = 4;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        a
    };
    let param = || {
        // SAFETY: all-zero is a valid parameter block.
        let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
        p.responder_resources = 1;
        p.initiator_depth = init;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        p
    };
    // SAFETY: as above.
    unsafe {
        assert_eq!(rdma_resolve_addr(client, ptr::null_mut(), sa(&mut at), 2000), 0);
        assert_eq!(next_event(cch, Duration::from_secs(5)).map(|e| e.0), Some(event::ADDR_RESOLVED));
        assert_eq!(rdma_resolve_route(client, 2000), 0);
        assert_eq!(next_event(cch, Duration::from_secs(5)).map(|e| e.0), Some(event::ROUTE_RESOLVED));
        assert_eq!(rdma_create_qp(client, ptr::null_mut(), &mut qp_attr()), 0, "{}", errno());
        assert_eq!(rdma_connect(client, &mut param()), 0, "{}", errno());
    }
    let (ev, _, child) = next_event(sch, Duration::from_secs(10)).expect("a connect request");
    assert_eq!(ev, event::CONNECT_REQUEST);
    // SAFETY: the new ID.
    unsafe {
        assert_eq!(rdma_create_qp(child, ptr::null_mut(), &mut qp_attr()), 0, "{}", errno());
        assert_eq!(rdma_accept(child, &mut param()), 0, "{}", errno());
    }
    assert_eq!(next_event(cch, Duration::from_secs(10)).map(|e| e.0), Some(event::ESTABLISHED));
    assert_eq!(next_event(sch, Duration::from_secs(10)).map(|e| e.0), Some(event::ESTABLISHED));
    let query = |id: *mut rdma_cm_id| {
        // SAFETY: zeroed out structures; the ID's live QP.
        unsafe {
            let (mut a, mut i) = (std::mem::zeroed::<ibv_qp_attr>(), std::mem::zeroed::<ibv_qp_init_attr>());
            let m = crate::agent::mask::STATE
                | crate::agent::mask::TIMEOUT
                | crate::agent::mask::ACCESS_FLAGS
                | crate::agent::mask::MAX_QP_RD_ATOMIC
                | crate::agent::mask::MAX_DEST_RD_ATOMIC;
            assert_eq!(wire::ibv_query_qp((*id).qp, &mut a, m, &mut i), 0);
            (a.qp_state, a.qp_access_flags, a.max_rd_atomic, a.max_dest_rd_atomic, a.timeout)
        }
    };
    let got = [query(client), query(child)];
    // SAFETY: as above.
    unsafe {
        assert_eq!(rdma_disconnect(client), 0);
        assert_eq!(next_event(sch, Duration::from_secs(10)).map(|e| e.0), Some(event::DISCONNECTED));
        assert_eq!(next_event(cch, Duration::from_secs(10)).map(|e| e.0), Some(event::DISCONNECTED));
        for id in [child, client] {
            rdma_destroy_qp(id);
            rdma_destroy_id(id);
        }
        rdma_destroy_id(listen);
        rdma_destroy_event_channel(sch);
        rdma_destroy_event_channel(cch);
    }
    got
}

/// As Linux's CM (`cm_init_qp_init_attr`, applied by librdmacm's INIT→INIT step before RTR): a connected QP
/// takes remote writes, and remote reads and atomics too when it has responder resources, so a peer's atomics
/// (qperf's `rc_compare_swap_mr`, `rc_fetch_add_mr`) are not answered with a remote access error.
#[test]
fn a_connected_qp_with_responder_resources_takes_remote_reads_and_atomics() {
    let _one = serial();
    use crate::agent::access::{REMOTE_ATOMIC as ATOMIC, REMOTE_READ as READ, REMOTE_WRITE as WRITE};
    let rts = crate::agent::qps::RTS;
    // Both sides offer one read or atomic each way.
    // The ACK timeout is Linux's for a RoCE route: packet life time 16, plus 1 (about 0.5 s).
    let [c, s] = connected_qp_attrs(7306, 1);
    assert_eq!(c, (rts, WRITE | READ | ATOMIC, 1, 1, 17), "client");
    assert_eq!(s, (rts, WRITE | READ | ATOMIC, 1, 1, 17), "server");
    // An initiator depth of 0 on the server's REP leaves the client without responder resources: it takes
    // remote writes only.
    let [c, s] = connected_qp_attrs(7307, 0);
    assert_eq!(c.1, WRITE, "client without responder resources");
    assert_eq!(s.1, WRITE | READ | ATOMIC, "server");
}

/// The CM's thread blocks every signal a program may handle, so a program's signal (qperf's SIGALRM ending a
/// test) interrupts the program's own thread, not runs its handler on ours: librdmacm has no thread.
#[test]
fn the_cm_thread_blocks_the_programs_signals() {
    let _one = serial();
    drop(crate::agent::cm());
    // The thread names itself once it runs: look until it has.
    let end = Instant::now() + Duration::from_secs(10);
    let mut found = None;
    while found.is_none() && Instant::now() < end {
        for t in std::fs::read_dir("/proc/self/task").expect("/proc/self/task").flatten() {
            let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            if name.trim() == "rdmacm-agent" {
                let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
                let blocked = status.lines().find_map(|l| l.strip_prefix("SigBlk:")).map(|v| v.trim().to_string());
                found = blocked.and_then(|v| u64::from_str_radix(&v, 16).ok());
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let blocked = found.expect("the CM thread and its blocked-signal mask");
    for sig in [libc::SIGALRM, libc::SIGINT, libc::SIGUSR1, libc::SIGURG, libc::SIGCHLD, libc::SIGPIPE] {
        assert_ne!(blocked & (1 << (sig - 1)), 0, "signal {sig} not blocked: SigBlk {blocked:016x}");
    }
}

mod wire {
    use std::ffi::{c_int, c_void};

    use crate::abi::verbs::ibv_mr;
    use crate::abi::*;

    extern "C" {
        pub fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
        pub fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
        pub fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah;
        pub fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int;
        pub fn ibv_query_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int, init: *mut ibv_qp_init_attr)
            -> c_int;
    }
}

/// Datagrams a peer puts on QP1 that are not what they should be, sent from an ordinary UD QP of the port to QP 1
/// with the GSI Q_Key: a truncated MAD, one of another base version, and a REP for a connection nobody has. The
/// first two are dropped and counted as malformed; the REP is answered with a REJ (invalid communication ID).
#[test]
fn bad_mads_on_qp1_are_dropped_and_counted_and_a_stray_rep_is_rejected() {
    use crate::abi::verbs::{ibv_qp_cap, ibv_send_wr, ibv_send_wr_wr, ibv_sge, wr_ud};
    use crate::agent::{self, mask, qps};
    use mlx5_rdmacm::cm::{CmMsg, Rep};
    use mlx5_rdmacm::mad::{MAD_LEN, QP1_QKEY};

    let _one = serial();
    // The port's CM, opened by the first call.
    let ch = rdma_create_event_channel();
    let (ctx, sgid_index, gid) = {
        let g = agent::cm();
        (g.devs[0].ctx, g.devs[0].sgid_index, g.devs[0].gid)
    };
    let before = agent::cm().devs[0].engine.counters();
    // SAFETY: the CM's open context; every object made here is destroyed at the end.
    unsafe {
        let pd = agent::ibv_alloc_pd(ctx);
        let cq = agent::ibv_create_cq(ctx, 8, ptr::null_mut(), ptr::null_mut(), 0);
        let cap = ibv_qp_cap { max_send_wr: 4, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let mut init = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: ptr::null_mut(),
            cap,
            qp_type: IBV_QPT_UD,
            sq_sig_all: 1,
        };
        let qp = agent::ibv_create_qp(pd, &mut init);
        assert!(!qp.is_null());
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = qps::INIT;
        a.port_num = 1;
        // A work request's Q_Key with the high bit set means "the QP's own" (IBA 10.2.4): the GSI Q_Key is
        // a controlled one, so the sending QP holds it.
        a.qkey = QP1_QKEY;
        assert_eq!(agent::ibv_modify_qp(qp, &mut a, mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::QKEY), 0);
        a.qp_state = qps::RTR;
        assert_eq!(agent::ibv_modify_qp(qp, &mut a, mask::STATE), 0);
        a.qp_state = qps::RTS;
        assert_eq!(agent::ibv_modify_qp(qp, &mut a, mask::STATE | mask::SQ_PSN), 0);
        let mut buf = vec![0u8; 3 * MAD_LEN];
        let mr = wire::ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), 1);
        assert!(!mr.is_null());
        let mut to_self = ibv_ah_attr { port_num: 1, is_global: 1, ..ibv_ah_attr::default() };
        to_self.grh.dgid.raw = gid;
        to_self.grh.sgid_index = sgid_index;
        to_self.grh.hop_limit = 64;
        let ah = wire::ibv_create_ah(pd, &mut to_self);
        assert!(!ah.is_null());
        // 0: a REP's first 100 bytes; 1: a whole MAD of base version 9; 2: a REP for comm ID 0xdead_beef.
        let mut rep = [0u8; MAD_LEN];
        let stray = Rep {
            local_comm_id: 7,
            remote_comm_id: 0xdead_beef,
            local_qkey: 0,
            local_qpn: 5,
            starting_psn: 1,
            responder_resources: 1,
            initiator_depth: 1,
            target_ack_delay: 0,
            failover_accepted: 0,
            end_to_end_flow_control: false,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: 1,
            private_data: [0; 196],
        };
        CmMsg::Rep(stray).write(77, &mut rep);
        buf[..MAD_LEN].copy_from_slice(&rep);
        buf[MAD_LEN..2 * MAD_LEN].copy_from_slice(&rep);
        buf[MAD_LEN] = 9;
        buf[2 * MAD_LEN..].copy_from_slice(&rep);
        for (i, len) in [(0usize, 100u32), (1, MAD_LEN as u32), (2, MAD_LEN as u32)] {
            let mut sge = ibv_sge { addr: buf[i * MAD_LEN..].as_ptr() as u64, length: len, lkey: (*mr).lkey };
            let mut wr: ibv_send_wr = std::mem::zeroed();
            wr.wr_id = i as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = 2;
            wr.wr = ibv_send_wr_wr { ud: wr_ud { ah, remote_qpn: 1, remote_qkey: QP1_QKEY } };
            let mut bad = ptr::null_mut();
            assert_eq!(agent::post_send(qp, &mut wr, &mut bad), 0);
        }
        let mut wc = [ibv_wc::default(); 4];
        let (mut done, end) = (0, Instant::now() + Duration::from_secs(5));
        while done < 3 && Instant::now() < end {
            let n = agent::poll_cq(cq, &mut wc);
            assert!(wc[..n.max(0) as usize].iter().all(|w| w.status == 0));
            done += n.max(0);
        }
        assert_eq!(done, 3, "the three datagrams left");
        let end = Instant::now() + Duration::from_secs(5);
        let mut after = agent::cm().devs[0].engine.counters();
        while (after.malformed < before.malformed + 2 || after.stale < before.stale + 1) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
            after = agent::cm().devs[0].engine.counters();
        }
        assert_eq!(after.malformed - before.malformed, 2, "truncated and bad-version MADs dropped, counted");
        assert_eq!(after.rej_unknown_rep - before.rej_unknown_rep, 1, "the stray REP REJected");
        // The REJ went to QP 1 of the REP's sender (this port): a REJ for nothing here is stale.
        assert_eq!(after.stale - before.stale, 1);
        assert_eq!(agent::cm().devs[0].engine.connections(), 0);
        wire::ibv_destroy_ah(ah);
        wire::ibv_dereg_mr(mr);
        agent::ibv_destroy_qp(qp);
        agent::ibv_destroy_cq(cq);
        agent::ibv_dealloc_pd(pd);
        rdma_destroy_event_channel(ch);
    }
}

#[test]
fn events_of_a_destroyed_id_go_with_it() {
    let _one = serial();
    let ch = rdma_create_event_channel();
    let (gone, kept) = (new_id(ch, ps::TCP), new_id(ch, ps::TCP));
    let mut dst = sin(OWN, 7305);
    // SAFETY: live IDs and an address; `gone` is destroyed with its ADDR_RESOLVED not taken.
    unsafe {
        assert_eq!(rdma_resolve_addr(gone, ptr::null_mut(), sa(&mut dst), 2000), 0);
        assert_eq!(rdma_destroy_id(gone), 0);
        assert_eq!(rdma_resolve_addr(kept, ptr::null_mut(), sa(&mut dst), 2000), 0);
    }
    let (ev, _, id) = next_event(ch, Duration::from_secs(5)).expect("an event");
    assert_eq!((ev, id), (event::ADDR_RESOLVED, kept), "only the live ID's event is handed out");
    // SAFETY: as above.
    unsafe {
        rdma_destroy_id(kept);
        rdma_destroy_event_channel(ch);
    }
}

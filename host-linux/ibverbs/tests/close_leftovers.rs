//! Issue 29: `ibv_close_device` with objects still alive. qperf deallocates its PD before deregistering its MR,
//! so its close finds the PD, MR, CQ and QP alive; the library kept the device (and its simulated wire to a
//! peer that had gone) for the next test of the process, which then failed. Now the close destroys what the
//! context left, as the kernel's uverbs does at the close of its file, and lets go of the device: the next open
//! brings a fresh one up and a `wire=connect` end connects afresh. Each case runs in a child process of its own,
//! since the device list is read from `MLX5_RS_DEVICES` once per process.

use std::ffi::c_int;
use std::process::Command;
use std::ptr;
use std::time::{Duration, Instant};

use mlx5_ibverbs::abi::*;
use mlx5_sim::{HcaState, SimDevice};

mod common;
use common::*;

/// Set in the child: which case it runs.
const CASE: &str = "MLX5_RS_TEST_CLOSE_CASE";

/// How long any one wait of a case may take before it fails.
const LIMIT: Duration = Duration::from_secs(20);

/// Runs `case` in a child (this binary again) with `MLX5_RS_DEVICES=devices`; fails with its stderr unless it
/// succeeds.
fn run_child(case: &str, devices: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["cases_in_a_child", "--exact", "--test-threads=1", "--nocapture"])
        .env(CASE, case)
        .env("MLX5_RS_DEVICES", devices)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "case {case}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn cases_in_a_child() {
    match std::env::var(CASE).as_deref() {
        Ok("reopen") => reopen_after_a_close_with_objects_alive(),
        Ok("wire") => the_connecting_end_closes_with_objects_alive_and_connects_again(),
        _ => {}
    }
}

/// The process's listed devices, as the library lists them.
fn devices() -> Vec<*mut ibv_device> {
    let mut n = 0;
    // SAFETY: the list is copied and freed; the devices stay.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        assert!(!list.is_null());
        let v = (0..n as usize).map(|i| *list.add(i)).collect();
        ibv_free_device_list(list);
        v
    }
}

fn open(dev: *mut ibv_device) -> *mut ibv_context {
    // SAFETY: a listed device.
    let ctx = unsafe { ibv_open_device(dev) };
    assert!(!ctx.is_null(), "open: errno {}", errno());
    ctx
}

/// The simulated device behind list entry `i`, and whether a context or object of this process holds it.
fn sim(i: usize) -> (SimDevice, bool) {
    let d = mlx5_verbs::devices().unwrap().remove(i);
    (d.sim_device().unwrap().clone(), d.is_open())
}

/// What a device that nothing holds looks like: its HCA torn down, every DMA region and firmware page back.
fn released(i: usize) {
    let (s, open) = sim(i);
    assert!(!open, "device {i} still held after its last context closed");
    assert_eq!(s.hca_state(), HcaState::Disabled, "device {i}");
    assert_eq!(s.dma_outstanding(), (0, 0), "device {i}: DMA regions left");
    assert_eq!(s.pages_owned(), 0, "device {i}: firmware pages left");
}

/// The port's state and LID (`IBV_PORT_ACTIVE` is 4).
fn port(ctx: *mut ibv_context) -> (c_int, u16) {
    // SAFETY: ibv_port_attr is plain data; an open context.
    unsafe {
        let mut a: ibv_port_attr = std::mem::zeroed();
        assert_eq!(ibv_query_port(ctx, 1, &mut a), 0);
        (a.state, a.lid)
    }
}

/// Waits until `f` holds (at most [`LIMIT`]).
fn until(what: &str, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + LIMIT;
    while !f() {
        assert!(Instant::now() < end, "waited {LIMIT:?} for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An RC endpoint: PD, a 4 KiB region, CQ and QP (the QP in RESET).
struct End {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    mr: *mut ibv_mr,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    mem: Vec<u8>,
}

impl End {
    fn new(ctx: *mut ibv_context) -> End {
        // SAFETY: objects of an open context, kept in the End until destroyed or left to the close.
        unsafe {
            let pd = ibv_alloc_pd(ctx);
            assert!(!pd.is_null());
            let mut mem = vec![0u8; 4096];
            let mr = ibv_reg_mr(pd, mem.as_mut_ptr().cast(), mem.len(), 1);
            let cq = ibv_create_cq(ctx, 8, ptr::null_mut(), ptr::null_mut(), 0);
            assert!(!mr.is_null() && !cq.is_null());
            let mut e = End { ctx, pd, mr, cq, qp: ptr::null_mut(), mem };
            e.new_qp();
            e
        }
    }

    /// A new QP in RESET on the End's CQ.
    fn new_qp(&mut self) {
        let mut init = rc_init(self.cq);
        // SAFETY: the End's live PD and CQ.
        self.qp = unsafe { ibv_create_qp(self.pd, &mut init) };
        assert!(!self.qp.is_null(), "create_qp: errno {}", errno());
    }

    /// RESET → INIT → RTR → RTS towards QP `dest_qpn` at InfiniBand LID `dlid`.
    fn connect(&self, dest_qpn: u32, dlid: u16) {
        // SAFETY: the End's live QP; the attributes live on this stack.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = 1;
            a.port_num = 1;
            a.qp_access_flags = 0b111;
            assert_eq!(ibv_modify_qp(self.qp, &mut a, 1 | 16 | 32 | 8), 0, "INIT");
            a.qp_state = 2;
            a.path_mtu = 3;
            a.dest_qp_num = dest_qpn;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = 12;
            a.ah_attr.dlid = dlid;
            a.ah_attr.port_num = 1;
            assert_eq!(
                ibv_modify_qp(self.qp, &mut a, 1 | 128 | 256 | (1 << 20) | (1 << 12) | (1 << 17) | (1 << 15)),
                0,
                "RTR"
            );
            a.qp_state = 3;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.max_rd_atomic = 1;
            assert_eq!(ibv_modify_qp(self.qp, &mut a, 1 | 512 | 1024 | 2048 | (1 << 16) | (1 << 13)), 0, "RTS");
        }
    }

    fn post_recv(&mut self) {
        // SAFETY: the End's live QP and region; the request lives on this stack for the call.
        unsafe {
            let mut sge = ibv_sge { addr: self.mem.as_ptr() as u64 + 2048, length: 64, lkey: (*self.mr).lkey };
            let mut wr = ibv_recv_wr { wr_id: 1, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
            let mut bad = ptr::null_mut();
            assert_eq!((*self.ctx).ops.post_recv.unwrap()(self.qp, &mut wr, &mut bad), 0);
        }
    }

    fn send(&mut self, msg: &[u8]) {
        self.mem[..msg.len()].copy_from_slice(msg);
        // SAFETY: as in post_recv.
        unsafe {
            let mut sge = ibv_sge { addr: self.mem.as_ptr() as u64, length: msg.len() as u32, lkey: (*self.mr).lkey };
            let mut wr: ibv_send_wr = std::mem::zeroed();
            wr.wr_id = 2;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = 2; // IBV_WR_SEND
            let mut bad = ptr::null_mut();
            assert_eq!((*self.ctx).ops.post_send.unwrap()(self.qp, &mut wr, &mut bad), 0);
        }
    }

    /// The next completion's (wr_id, status), waiting at most [`LIMIT`].
    fn completion(&self) -> (u64, c_int) {
        let mut wc = [ibv_wc::default(); 1];
        // SAFETY: the End's live CQ; one entry to fill.
        until("a completion", || unsafe { (*self.ctx).ops.poll_cq.unwrap()(self.cq, 1, wc.as_mut_ptr()) } == 1);
        (wc[0].wr_id, wc[0].status)
    }

    /// Destroys the End's objects in the order qperf does (its PD first, refused while the rest uses it), then
    /// closes the context with the QP, CQ, MR and PD alive.
    fn close_with_objects_alive(self) {
        // SAFETY: the End's objects; the close is what is tested.
        unsafe {
            assert_eq!(ibv_dealloc_pd(self.pd), libc::EBUSY);
            assert_eq!(ibv_close_device(self.ctx), 0);
        }
    }

    /// Destroys everything, children first, and closes the context.
    fn close(self) {
        // SAFETY: the End's objects, destroyed once.
        unsafe {
            assert_eq!(
                [ibv_destroy_qp(self.qp), ibv_destroy_cq(self.cq), ibv_dereg_mr(self.mr), ibv_dealloc_pd(self.pd)],
                [0; 4]
            );
            assert_eq!(ibv_close_device(self.ctx), 0);
        }
    }
}

/// From `a` to `b`: a SEND of `msg`, received in `b`'s region.
fn exchange(a: &mut End, b: &mut End, msg: &[u8]) {
    b.post_recv();
    a.send(msg);
    assert_eq!(a.completion(), (2, 0), "the send");
    assert_eq!(b.completion(), (1, 0), "the receive");
    assert_eq!(&b.mem[2048..2048 + msg.len()], msg);
}

/// (1) A context closed with a PD, MR, CQ and QP alive (a loopback RC QP that has worked) releases the device:
/// its HCA is torn down and every DMA region and firmware page is back. The next open brings a fresh device up,
/// on which a loopback RC exchange works.
fn reopen_after_a_close_with_objects_alive() {
    let dev = devices()[0];
    for round in 0..2 {
        let ctx = open(dev);
        let mut e = End::new(ctx);
        let (_, lid) = port(ctx);
        // SAFETY: the End's live QP.
        e.connect(unsafe { (*e.qp).qp_num }, lid);
        // A QP to itself: the receive and the send on one QP.
        e.post_recv();
        e.send(b"loopback");
        let mut got = [e.completion(), e.completion()];
        got.sort_unstable();
        assert_eq!(got, [(1, 0), (2, 0)], "round {round}");
        assert_eq!(&e.mem[2048..2056], b"loopback");
        if round == 0 {
            e.close_with_objects_alive();
        } else {
            e.close();
        }
        released(0);
    }
}

/// (3) Two devices of one process joined by the simulated wire (`wire=listen` and `wire=connect`), as qperf's
/// server and client: the connecting end closes with objects alive after an exchange; its device is released
/// and the listener sees the link go down; the connecting end opens again (as qperf's next test does), connects
/// afresh, and the two exchange again.
fn the_connecting_end_closes_with_objects_alive_and_connects_again() {
    let devs = devices();
    assert_eq!(devs.len(), 2);
    let ctx_a = open(devs[0]);
    let mut a = End::new(ctx_a);
    let (listener, _) = sim(0);
    for round in 0..2 {
        let ctx_b = open(devs[1]);
        assert!(listener.wire_wait_peer(LIMIT), "round {round}: no peer plugged into the listener");
        until("the listener's port active", || port(ctx_a).0 == 4);
        let mut b = End::new(ctx_b);
        // SAFETY: live QPs.
        let (qpn_a, qpn_b) = unsafe { ((*a.qp).qp_num, (*b.qp).qp_num) };
        a.connect(qpn_b, port(ctx_b).1);
        b.connect(qpn_a, port(ctx_a).1);
        exchange(&mut b, &mut a, b"to the listener");
        exchange(&mut a, &mut b, b"to the connector");
        b.close_with_objects_alive();
        released(1);
        // The listener sees its peer go: no link, the port down.
        until("the listener's link down", || listener.wire_peer().is_none());
        until("the listener's port down", || port(ctx_a).0 != 4);
        // The listener's QP was connected to a QP that is gone: a new one for the next round.
        // SAFETY: a's live QP.
        assert_eq!(unsafe { ibv_destroy_qp(a.qp) }, 0);
        a.new_qp();
    }
    a.close();
    released(0);
}

#[test]
fn a_close_with_objects_alive_releases_the_device_and_a_reopen_is_fresh() {
    run_child("reopen", "sim:link=ib");
}

#[test]
fn a_wire_connect_end_closed_with_objects_alive_unplugs_and_connects_again_at_reopen() {
    // A port of its own for this run: bound, then given back for the listener.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    run_child(
        "wire",
        &format!("sim:link=ib:wire=listen:127.0.0.1:{port},sim:link=ib:host=1:wire=connect:127.0.0.1:{port}"),
    );
}

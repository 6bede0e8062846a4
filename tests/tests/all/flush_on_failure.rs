//! Work requests the device will never complete are completed by the driver: once the HCA is in internal error
//! (health syndrome, stalled heartbeat, device gone), `Hca::poll_cq` returns the CQEs the device wrote and then one
//! `WR_FLUSH_ERR` completion per outstanding WQE of the QPs on the CQ, in posting order, each exactly once; posts
//! fail with a typed error and teardown returns every DMA allocation. A QP fatal event (`WQ_CATAS_ERROR`) reaches
//! the caller and the device flushes that QP; after a CQ overrun, the QPs the caller moves to ERR are flushed in
//! software (the CQ takes no more CQEs).

use std::collections::BTreeMap;

use embedded_hal::delay::DelayNs;
use mlx5_core::cq::{Cq, WcStatus, WorkCompletion};
use mlx5_core::eq::QpErrorKind;
use mlx5_core::hca::{AsyncEvent, QpInitAttr};
use mlx5_core::hca::{Error, HcaState};
use mlx5_core::health::{HealthFailure, HEALTH_POLL_INTERVAL_MS};
use mlx5_core::mkey::Access;
use mlx5_core::prm::{consts, CmdStatus};
use mlx5_core::qp::{
    AhAttr, Grh, PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
};
use mlx5_sim::testkit::{Node, RcOpts};
use mlx5_sim::SimConfig;

const MEM: usize = 1 << 16;

/// This file's QP shape, loopback connection and teardown checks, on the kit's node.
trait FlushNode {
    fn rc_qp(&mut self, cq: &Cq) -> Qp;
    fn connect(&mut self, qp: &mut Qp, dest: u32);
    fn move_to_err(&mut self, qp: &mut Qp);
    fn finish_all(self, cqs: Vec<Cq>, qps: Vec<Qp>);
}

fn node() -> Node {
    Node::new(SimConfig::default(), MEM)
}

impl FlushNode for Node {
    fn rc_qp(&mut self, cq: &Cq) -> Qp {
        let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 256 };
        self.qp(QpType::Rc, cq, cap, false)
    }

    /// RESET → RTS towards `dest` on this device (loopback). `min_rnr_timer` 0 is the longest RNR timer (655 ms),
    /// so a request the peer cannot take waits, outstanding, until virtual time moves that far.
    fn connect(&mut self, qp: &mut Qp, dest: u32) {
        let gid = self.hca.query_gid(0, &mut self.d).unwrap();
        let ah = AhAttr {
            grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
            dmac: self.dev.config().mac,
            port_num: 1,
            ..AhAttr::default()
        };
        let o = RcOpts {
            access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE,
            min_rnr_timer: 0,
            ..RcOpts::default()
        };
        self.connect_rc(qp, dest, ah, &o);
    }

    fn move_to_err(&mut self, qp: &mut Qp) {
        let a = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
        self.hca.modify_qp(qp, &a, QpAttrMask::STATE, &mut self.d).unwrap();
    }

    /// Everything destroyed, the HCA torn down: every DMA allocation and every firmware page is back.
    fn finish_all(mut self, cqs: Vec<Cq>, qps: Vec<Qp>) {
        for qp in qps {
            self.hca.destroy_qp(qp, &mut self.d).unwrap();
        }
        for cq in cqs {
            self.hca.destroy_cq(cq, &mut self.d).unwrap();
        }
        let (report, dev) = self.finish_with_device();
        assert_eq!(dev.pages_owned(), 0, "no page left with firmware");
        if report.local_only {
            assert!(report.pages_abandoned > 0, "a dead device's pages are reclaimed locally");
        }
    }
}

fn recv(wr_id: u64, sge: &[Sge]) -> RecvWr<'_> {
    RecvWr { wr_id, sg_list: sge }
}

fn send(wr_id: u64, sge: &[Sge], signaled: bool) -> SendWr<'_> {
    let flags = if signaled { SendFlags::SIGNALED } else { SendFlags::default() };
    SendWr { wr_id, op: SendOp::Send, sg_list: sge, flags, inline: None, ud: None }
}

/// Polls until a poll returns nothing (bounded), through the HCA.
fn drain(n: &Node, cq: &mut Cq, qps: &mut [&mut Qp]) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 3];
    for _ in 0..1000 {
        let k = n.hca.poll_cq(cq, qps, &mut wc).unwrap();
        got.extend_from_slice(&wc[..k]);
        if k == 0 {
            return got;
        }
    }
    panic!("the CQ never ran dry: {got:?}");
}

/// A loopback RC pair (a, b) on one CQ with completions waiting in the CQ and work outstanding on all four queues:
/// a's SEND s2 waits on an RNR timer (b had one receive), s3 (unsignaled, 200 bytes inline: several basic blocks)
/// and s4 are queued behind it; b's t3 waits likewise with t4 behind; receives posted after the RNR NAKs wait too.
/// Returns the wr_ids of the completions the device wrote and of the outstanding WRs per queue, in posting order.
struct Scene {
    cq: Cq,
    a: Qp,
    b: Qp,
    done: Vec<u64>,
    outstanding: Vec<(u32, Vec<u64>)>,
}

fn scene(n: &mut Node) -> Scene {
    let cq = n.cq(63);
    let mut a = n.rc_qp(&cq);
    let mut b = n.rc_qp(&cq);
    let (qa, qb) = (a.qpn(), b.qpn());
    n.connect(&mut a, qb);
    n.connect(&mut b, qa);
    let buf = [n.sge(0, 64)];
    n.hca.post_recv(&mut b, &[recv(0xb01, &buf)]).unwrap();
    n.hca.post_recv(&mut a, &[recv(0xa01, &buf), recv(0xa02, &buf)]).unwrap();
    let inline = [7u8; 200];
    let s3 = SendWr { inline: Some(&inline), ..send(0xa13, &[], false) };
    let sends = [send(0xa11, &buf, true), send(0xa12, &buf, true), s3, send(0xa14, &buf, true)];
    n.hca.post_send(&mut a, &sends).unwrap();
    let t = [send(0xb11, &buf, true), send(0xb12, &buf, true), send(0xb13, &buf, true), send(0xb14, &buf, true)];
    n.hca.post_send(&mut b, &t).unwrap();
    // After the RNR NAKs: receives the retries would take once their timer expires.
    n.hca.post_recv(&mut a, &[recv(0xa03, &buf), recv(0xa04, &buf)]).unwrap();
    n.hca.post_recv(&mut b, &[recv(0xb02, &buf), recv(0xb03, &buf)]).unwrap();
    assert_eq!((a.sq_outstanding(), a.rq_outstanding()), (4, 4));
    assert_eq!((b.sq_outstanding(), b.rq_outstanding()), (4, 3));
    Scene {
        cq,
        a,
        b,
        done: vec![0xa11, 0xb01, 0xb11, 0xa01, 0xb12, 0xa02],
        outstanding: vec![
            (qa, vec![0xa12, 0xa13, 0xa14]),
            (qa, vec![0xa03, 0xa04]),
            (qb, vec![0xb13, 0xb14]),
            (qb, vec![0xb02, 0xb03]),
        ],
    }
}

/// The checks after the device died: the CQEs it wrote first (successes), then one flush per outstanding WR in
/// order per queue, nothing twice, nothing after; posts refused; a clean teardown.
fn check_flushed_after_death(n: Node, mut s: Scene) {
    let wcs = drain(&n, &mut s.cq, &mut [&mut s.a, &mut s.b]);
    let hw = s.done.len();
    assert!(wcs.len() >= hw, "{wcs:?}");
    let mut written: Vec<u64> = wcs[..hw].iter().map(|w| w.wr_id).collect();
    written.sort_unstable();
    let mut want = s.done.clone();
    want.sort_unstable();
    assert_eq!(written, want, "the CQEs the device wrote come first");
    assert!(wcs[..hw].iter().all(|w| w.status == WcStatus::Success));
    let flushed = &wcs[hw..];
    assert!(flushed.iter().all(|w| w.status == WcStatus::WrFlushErr), "{flushed:?}");
    assert!(flushed.iter().all(|w| w.vendor_err == u32::from(consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR)));
    let mut by_id: BTreeMap<u64, usize> = BTreeMap::new();
    for w in flushed {
        *by_id.entry(w.wr_id).or_default() += 1;
    }
    let expected: Vec<u64> = s.outstanding.iter().flat_map(|(_, ids)| ids.clone()).collect();
    assert_eq!(flushed.len(), expected.len(), "one flush per outstanding WR: {flushed:?}");
    assert!(expected.iter().all(|id| by_id.get(id) == Some(&1)), "each exactly once: {flushed:?}");
    for (qpn, ids) in &s.outstanding {
        let order: Vec<u64> =
            flushed.iter().filter(|w| w.qp_num == *qpn && ids.contains(&w.wr_id)).map(|w| w.wr_id).collect();
        assert_eq!(&order, ids, "posting order on QP {qpn:#x}");
    }
    assert_eq!((s.a.sq_outstanding(), s.a.rq_outstanding(), s.b.sq_outstanding(), s.b.rq_outstanding()), (0, 0, 0, 0));
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(n.hca.poll_cq(&mut s.cq, &mut [&mut s.a, &mut s.b][..], &mut wc).unwrap(), 0, "nothing twice");
    let buf = [n.sge(0, 64)];
    let e = n.hca.post_send(&mut s.a, &[send(0xdead, &buf, true)]).unwrap_err();
    assert_eq!((e.index, e.kind), (0, PostErrorKind::DeviceError));
    let e = n.hca.post_recv(&mut s.b, &[recv(0xdead, &buf)]).unwrap_err();
    assert_eq!((e.index, e.kind), (0, PostErrorKind::DeviceError));
    assert_eq!(n.hca.poll_cq(&mut s.cq, &mut [&mut s.a, &mut s.b][..], &mut wc).unwrap(), 0);
    n.finish_all(vec![s.cq], vec![s.a, s.b]);
}

#[test]
fn a_health_syndrome_flushes_every_outstanding_wr_once_in_order() {
    let mut n = node();
    let s = scene(&mut n);
    n.dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR);
    // Before the HCA knows, nothing is flushed: the device might still complete the work.
    let mut wc = [WorkCompletion::default(); 16];
    let (mut cq, mut a, mut b) = (s.cq, s.a, s.b);
    assert_eq!(n.hca.poll_cq(&mut cq, &mut [&mut a, &mut b][..], &mut wc[..6]).unwrap(), 6);
    assert_eq!(n.hca.poll_cq(&mut cq, &mut [&mut a, &mut b][..], &mut wc).unwrap(), 0);
    assert!(matches!(n.hca.poll_health(), Err(Error::Health(HealthFailure::Syndrome { .. }))));
    assert!(matches!(n.hca.state(), HcaState::InternalError(_)));
    let s = Scene { cq, a, b, done: vec![], ..s };
    check_flushed_after_death(n, s);
}

#[test]
fn a_vanished_device_flushes_every_outstanding_wr_once_in_order() {
    let mut n = node();
    let s = scene(&mut n);
    n.dev.device_gone();
    assert_eq!(n.hca.poll_health(), Err(Error::Health(HealthFailure::DeviceGone)));
    check_flushed_after_death(n, s);
}

#[test]
fn a_stalled_heartbeat_flushes_every_outstanding_wr_once_in_order() {
    let mut n = node();
    let s = scene(&mut n);
    n.dev.stall_health();
    let mut polls = 0;
    while n.hca.poll_health().is_ok() {
        polls += 1;
        assert!(polls < 10, "a frozen heartbeat is noticed within MAX_MISSES polls");
        n.d.delay_ms(HEALTH_POLL_INTERVAL_MS);
    }
    assert!(matches!(n.hca.state(), HcaState::InternalError(HealthFailure::Stalled { .. })));
    check_flushed_after_death(n, s);
}

#[test]
fn a_command_that_finds_the_device_dead_also_starts_the_flush() {
    let mut n = node();
    let mut s = scene(&mut n);
    n.dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_HW_FATAL_ERR);
    // The command hangs on the dead firmware; its wait polls health and gives up with the failure.
    let e = n.hca.query_qp(&s.a, &mut n.d).unwrap_err();
    assert!(matches!(e, Error::Health(HealthFailure::Syndrome { .. })), "{e:?}");
    let e = n.hca.query_qp(&s.b, &mut n.d).unwrap_err();
    assert!(matches!(e, Error::InternalError { .. }), "{e:?}");
    s.done.clear();
    let got = drain(&n, &mut s.cq, &mut [&mut s.a, &mut s.b]);
    assert_eq!(got.iter().filter(|w| w.status == WcStatus::Success).count(), 6);
    let flushes: Vec<u64> = got.iter().filter(|w| w.status == WcStatus::WrFlushErr).map(|w| w.wr_id).collect();
    let mut all: Vec<u64> = s.outstanding.iter().flat_map(|(_, ids)| ids.clone()).collect();
    let mut seen = flushes.clone();
    all.sort_unstable();
    seen.sort_unstable();
    assert_eq!(seen, all, "every outstanding WR flushed once");
    n.finish_all(vec![s.cq], vec![s.a, s.b]);
}

#[test]
fn a_qp_fatal_event_reaches_the_caller_and_the_device_flushes_the_qp() {
    let mut n = node();
    let mut s = scene(&mut n);
    let qa = s.a.qpn();
    let before = drain(&n, &mut s.cq, &mut [&mut s.a, &mut s.b]);
    assert_eq!(before.len(), s.done.len());
    assert!(n.dev.fail_qp(qa));
    n.hca.process_events(&mut n.d).unwrap();
    assert_eq!(n.hca.get_async_event(), Some(AsyncEvent::QpError { qpn: qa, kind: QpErrorKind::Catastrophic }));
    assert_eq!(n.hca.events().qp_error, 1);
    // The device flushed a's queues with CQEs of its own (the HCA is up: nothing is completed in software).
    let got = drain(&n, &mut s.cq, &mut [&mut s.a, &mut s.b]);
    let of_a: Vec<(u64, WcStatus)> = got.iter().filter(|w| w.qp_num == qa).map(|w| (w.wr_id, w.status)).collect();
    let flush = WcStatus::WrFlushErr;
    assert_eq!(of_a, vec![(0xa12, flush), (0xa13, flush), (0xa14, flush), (0xa03, flush), (0xa04, flush)]);
    assert_eq!((s.a.sq_outstanding(), s.a.rq_outstanding()), (0, 0));
    assert!(n.dev.qp_info(qa).is_some_and(|q| q.state == mlx5_sim::QpState::Err));
    // b is untouched by a's error until its own requests run out of retries: its work is still outstanding.
    assert_eq!(b_outstanding(&s.b), (2, 2));
    n.move_to_err(&mut s.b);
    let got = drain(&n, &mut s.cq, &mut [&mut s.a, &mut s.b]);
    assert_eq!(got.len(), 4);
    assert!(got.iter().all(|w| w.status == flush && w.qp_num == s.b.qpn()));
    n.finish_all(vec![s.cq], vec![s.a, s.b]);
}

fn b_outstanding(b: &Qp) -> (u32, u32) {
    (b.sq_outstanding(), b.rq_outstanding())
}

#[test]
fn after_a_cq_overrun_the_qps_moved_to_err_are_flushed_in_software() {
    let mut n = node();
    // Two CQEs of room; a third QP on the same CQ stays in RTS with a receive outstanding.
    let mut cq = n.cq(1);
    assert_eq!(cq.nent(), 2);
    let mut a = n.rc_qp(&cq);
    let mut b = n.rc_qp(&cq);
    let mut c = n.rc_qp(&cq);
    let (qa, qb) = (a.qpn(), b.qpn());
    n.connect(&mut a, qb);
    n.connect(&mut b, qa);
    n.connect(&mut c, qa);
    let buf = [n.sge(0, 64)];
    n.hca.post_recv(&mut b, &[recv(1, &buf), recv(2, &buf), recv(3, &buf)]).unwrap();
    n.hca.post_recv(&mut c, &[recv(9, &buf)]).unwrap();
    // Six completions for a ring of two, none polled: the third overruns the CQ.
    n.hca.post_send(&mut a, &[send(11, &buf, true), send(12, &buf, true), send(13, &buf, true)]).unwrap();
    let cqn = cq.cqn();
    n.hca.process_events(&mut n.d).unwrap();
    let overrun = consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN;
    assert_eq!(n.hca.get_async_event(), Some(AsyncEvent::CqError { cqn, syndrome: overrun }));
    // The two CQEs in the ring; then nothing, as a and b are still in RTS.
    let got = drain(&n, &mut cq, &mut [&mut a, &mut b, &mut c]);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|w| w.status == WcStatus::Success));
    // The caller stops a and b: their work completes here, once each; c's receive is not touched.
    n.move_to_err(&mut a);
    n.move_to_err(&mut b);
    let flushed = drain(&n, &mut cq, &mut [&mut a, &mut b, &mut c]);
    let mut ids: Vec<u64> = got.iter().chain(&flushed).map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2, 3, 11, 12, 13], "every WR of a and b exactly once");
    assert!(flushed.iter().all(|w| w.status == WcStatus::WrFlushErr));
    assert_eq!(c.rq_outstanding(), 1, "a QP the device may still run is not flushed");
    // Destroying the failed CQ's QPs and the CQ itself works as usual.
    let e = n.hca.query_cq(&cq, &mut n.d).unwrap();
    assert!(e.overflowed());
    n.finish_all(vec![cq], vec![a, b, c]);
}

#[test]
fn a_refused_create_leaks_nothing_and_the_next_one_works() {
    use mlx5_sim::Fault;
    let mut n = node();
    let before = n.dev.dma_outstanding();
    let status = CmdStatus::NoRes.raw();
    n.dev.inject(Fault::Status { opcode: consts::MLX5_CMD_OP_CREATE_QP, status, syndrome: 0x77, times: 1 });
    let cq = n.cq(15);
    let after_cq = n.dev.dma_outstanding();
    let attr = QpInitAttr {
        qp_type: QpType::Rc,
        cap: QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
        sq_sig_all: true,
    };
    let e = n.hca.create_qp(&n.pd, &cq, &cq, attr, &mut n.d).unwrap_err();
    assert!(matches!(e, Error::Cmd(mlx5_core::cmdq::CmdError::Status { syndrome: 0x77, .. })), "{e:?}");
    assert_eq!(n.dev.dma_outstanding(), after_cq, "the refused QP's buffers are back");
    assert!(after_cq.1 > before.1);
    let qp = n.hca.create_qp(&n.pd, &cq, &cq, attr, &mut n.d).unwrap();
    n.finish_all(vec![cq], vec![qp]);
}

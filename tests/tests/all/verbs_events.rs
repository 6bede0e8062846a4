//! Async events through the verbs API: a CQ overrun reaches the CQ's context as CQ_ERR with its CQN, a QP error as
//! a QP event with its QPN, a dead device as DEVICE_FATAL (found by the service thread's health tick, with no
//! command sent), after which posts fail and outstanding work flushes. The event descriptor is pollable.

use std::time::Duration;

use mlx5_core::prm::consts;
use mlx5_verbs::{
    wr, Access, AsyncEvent, Context, Device, PostErrorKind, QpCap, QpErrorKind, QpType, VerbsError, WcStatus,
    WorkCompletion,
};

const CAP: QpCap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

/// Whether `fd` is readable within `ms` milliseconds.
fn readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n == 1 && p.revents & libc::POLLIN != 0
}

#[test]
fn cq_overrun_raises_cq_error_with_its_cqn_on_the_owning_context() {
    let dev = Device::sim(mlx5_sim::SimConfig::default()).unwrap();
    let (ctx, other) = (dev.open().unwrap(), dev.open().unwrap());
    let fd = ctx.async_fd().expect("an eventfd on Linux");
    assert!(!readable(fd, 0), "nothing queued yet");
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1).unwrap();
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    let qp = qp.connect_rc(me, Access::default()).unwrap();
    let mut buf = ctx.alloc_buffer(256).unwrap();
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    // Six completions for a ring of two, none polled.
    for i in 0..3 {
        qp.post_recv(&[wr::recv(i, &[mr.sge(64 * i as usize, 64)])]).unwrap();
    }
    for i in 0..3 {
        qp.post_send(&[wr::send_inline(10 + i, b"overrun")]).unwrap();
    }
    // The service thread drains the EQ on its own: the descriptor becomes readable with no call in between.
    assert!(readable(fd, 5_000), "the CQ error reaches the event descriptor");
    let e = ctx.get_async_event(Duration::from_secs(5));
    let overrun = consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN;
    assert_eq!(e, Some(AsyncEvent::CqError { cqn: cq.cqn(), syndrome: overrun }));
    assert!(!readable(fd, 0), "the queue is empty again");
    assert_eq!(ctx.unacked_async_events(), 1);
    ctx.ack_async_event(&e.unwrap()).unwrap();
    assert!(ctx.ack_async_event(&e.unwrap()).is_err(), "one acknowledgement per event");
    assert_eq!(other.get_async_event(Duration::from_millis(20)), None, "an affiliated event goes to its owner");
    // The two CQEs that fit, then the QP the caller stops completes in software, each WR once.
    let mut wc = [WorkCompletion::default(); 8];
    let mut got = Vec::new();
    let n = cq.poll(&mut wc).unwrap();
    got.extend_from_slice(&wc[..n]);
    assert_eq!(cq.poll(&mut wc).unwrap(), 0, "a QP still in RTS is not flushed");
    let _qp = qp.to_error().map_err(|e| e.error).unwrap();
    loop {
        let n = cq.poll(&mut wc).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&wc[..n]);
    }
    let mut ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [0, 1, 2, 10, 11, 12]);
}

#[test]
fn a_qp_error_names_the_qp() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    let qp = qp.connect_rc(me, Access::default()).unwrap();
    let mlx5_verbs::DeviceKind::Sim(sim) = ctx.device() else { unreachable!("a simulated device") };
    assert!(sim.fail_qp(qp.qpn()));
    let e = ctx.get_async_event(Duration::from_secs(5));
    assert_eq!(e, Some(AsyncEvent::QpError { qpn: qp.qpn(), kind: QpErrorKind::Catastrophic }));
    ctx.ack_async_event(&e.unwrap()).unwrap();
}

#[test]
fn a_dead_device_reports_device_fatal_fails_posts_and_flushes() {
    let dev = Device::sim(mlx5_sim::SimConfig::default()).unwrap();
    let (ctx, other) = (dev.open().unwrap(), dev.open().unwrap());
    {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        let mut buf = ctx.alloc_buffer(256).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        for i in 0..3 {
            qp.post_recv(&[wr::recv(i, &[mr.sge(64 * i as usize, 64)])]).unwrap();
        }
        dev.sim_device().unwrap().fail_health(1);
        // Nothing is sent to the device: the service thread's health tick (every 2 s) finds it.
        let e = ctx.get_async_event(Duration::from_secs(6));
        assert_eq!(e, Some(AsyncEvent::DeviceFatal));
        assert!(ctx.is_dead());
        assert_eq!(other.get_async_event(Duration::from_secs(1)), Some(AsyncEvent::DeviceFatal), "every context");
        assert_eq!(ctx.get_async_event(Duration::from_millis(10)), None, "reported once");
        match qp.post_send(&[wr::send_inline(9, b"late")]) {
            Err(VerbsError::Post(p)) => assert_eq!((p.index, p.kind), (0, PostErrorKind::DeviceError)),
            r => panic!("post on a dead device: {r:?}"),
        }
        assert!(matches!(qp.post_recv(&[wr::recv(9, &[mr.sge(0, 8)])]), Err(VerbsError::Post(_))));
        let mut wc = [WorkCompletion::default(); 8];
        let mut got = Vec::new();
        loop {
            let n = cq.poll(&mut wc).unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&wc[..n]);
        }
        let ids: Vec<(u64, WcStatus)> = got.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(ids, [(0, WcStatus::WrFlushErr), (1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]);
    }
    // Every object still goes, and the device is torn down locally.
    drop((ctx, other));
    assert!(!dev.is_open());
}

#[test]
fn a_device_gone_from_the_bus_is_reported_fatal_to_a_waiting_poll() {
    let ctx = Context::open_sim().unwrap();
    let fd = ctx.async_fd().expect("an eventfd on Linux");
    let mlx5_verbs::DeviceKind::Sim(sim) = ctx.device() else { unreachable!("a simulated device") };
    sim.device_gone();
    // Nobody calls into the context: the service thread's health tick reads all ones and wakes the descriptor.
    assert!(readable(fd, 6_000), "DEVICE_FATAL reaches the event descriptor");
    assert_eq!(ctx.get_async_event(Duration::ZERO), Some(AsyncEvent::DeviceFatal));
    assert!(ctx.is_dead());
    assert!(ctx.alloc_pd().is_err(), "no command reaches a dead device");
}

//! `num_comp_vectors` is true and `comp_vector` is honoured: a CQ made on completion vector `v` raises its
//! completion events through the EQ of that vector, which interrupts on its own MSI-X vector (`1 + v`, vector 0
//! being the async EQs'), as the simulated device's interrupt log shows. CQ moderation (`ibv_modify_cq`'s count
//! and period) reaches the device, which holds an armed CQ's event until either is met.

use std::time::Duration;

use mlx5_sim::{SimConfig, SimDevice};
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, WcStatus, WorkCompletion};

const CAP: QpCap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

#[test]
fn each_completion_vector_interrupts_on_its_own_msix_vector() {
    let sim = SimDevice::new(SimConfig::default());
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = ctx.num_comp_vectors().unwrap();
    assert!(n >= 1 && usize::from(n) <= cpus, "{n} completion vectors on {cpus} CPUs");
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let mut buf = ctx.alloc_buffer(4096).unwrap();
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    for v in 0..n {
        let cq = ctx.create_cq_on(16, u64::from(v), Some(&ch), v).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        let mut cursor = usize::MAX;
        sim.interrupts_since(&mut cursor);
        cq.req_notify(false).unwrap();
        qp.post_recv(&[wr::recv(1, &[mr.sge(0, 64)])]).unwrap();
        qp.post_send(&[wr::send_inline(2, b"vector")]).unwrap();
        let ev = ch.get_cq_event(Duration::from_secs(5)).unwrap().expect("a completion event");
        assert_eq!(ev.cq_context(), u64::from(v));
        let vectors = sim.interrupts_since(&mut cursor);
        assert_eq!(vectors, [1 + v], "comp_vector {v}: the interrupts since the arm");
        ev.ack().unwrap();
        let mut wc = [WorkCompletion::default(); 2];
        assert_eq!(cq.poll_until(&mut wc, 2, Duration::from_secs(5)).unwrap(), 2);
        assert!(wc.iter().all(|w| w.status == WcStatus::Success));
    }
    // One past the last vector is refused.
    assert!(ctx.create_cq_on(16, 0, Some(&ch), n).is_err());
}

#[test]
fn cq_moderation_holds_the_event_until_its_count_or_its_period() {
    let sim = SimDevice::new(SimConfig::default());
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    // Receives complete on the moderated CQ, sends on another.
    let rcq = ctx.create_cq_on(16, 7, Some(&ch), 0).unwrap();
    let scq = ctx.create_cq(16).unwrap();
    let qp = pd.create_qp(QpType::Rc, &scq, &rcq, QpCap { max_recv_wr: 16, ..CAP }).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    let qp = qp.connect_rc(me, Access::default()).unwrap();
    let mut buf = ctx.alloc_buffer(4096).unwrap();
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    let fired = || sim.cq_info(rcq.cqn()).unwrap().events_fired;
    let mut wc = [WorkCompletion::default(); 16];
    let mut send = |i: u64| {
        qp.post_recv(&[wr::recv(i, &[mr.sge(64 * (i as usize % 16), 64)])]).unwrap();
        qp.post_send(&[wr::send_inline(100 + i, b"moderated")]).unwrap();
        assert_eq!(scq.poll_until(&mut wc[..1], 1, Duration::from_secs(5)).unwrap(), 1);
    };

    // Count 4, no period: three receive completions raise nothing, the fourth the event.
    rcq.modify_moderation(4, 0).unwrap();
    let info = sim.cq_info(rcq.cqn()).unwrap();
    assert_eq!((info.cq_max_count, info.cq_period), (4, 0), "MODIFY_CQ reached the device");
    rcq.req_notify(false).unwrap();
    for i in 0..3 {
        send(i);
    }
    assert!(ch.get_cq_event(Duration::from_millis(200)).unwrap().is_none(), "held below the count");
    assert_eq!(fired(), 0);
    send(3);
    let ev = ch.get_cq_event(Duration::from_secs(5)).unwrap().expect("the fourth completion's event");
    assert_eq!((ev.cq_context(), fired()), (7, 1));
    ev.ack().unwrap();
    let mut got = [WorkCompletion::default(); 16];
    assert_eq!(rcq.poll(&mut got).unwrap(), 4);

    // A period of 4 ms, no count: one completion right after the last event is held, then the period fires it.
    rcq.modify_moderation(0, 4000).unwrap();
    rcq.req_notify(false).unwrap();
    send(4);
    assert_eq!(fired(), 1, "held inside the period");
    let ev = ch.get_cq_event(Duration::from_secs(5)).unwrap().expect("the event once the period passed");
    assert_eq!(fired(), 2);
    ev.ack().unwrap();
    assert_eq!(rcq.poll(&mut got).unwrap(), 1);

    // A held event is released when moderation is turned off.
    rcq.modify_moderation(8, 0).unwrap();
    rcq.req_notify(false).unwrap();
    send(5);
    assert_eq!(fired(), 2, "held below the count");
    rcq.modify_moderation(0, 0).unwrap();
    let ev = ch.get_cq_event(Duration::from_secs(5)).unwrap().expect("the event once moderation is off");
    assert_eq!(fired(), 3);
    ev.ack().unwrap();

    // Past the 12-bit period field: refused before the device sees it.
    assert!(rcq.modify_moderation(0, 4096).is_err());
}

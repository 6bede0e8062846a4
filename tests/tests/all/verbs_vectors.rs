//! `num_comp_vectors` is true and `comp_vector` is honoured: a CQ made on completion vector `v` raises its
//! completion events through the EQ of that vector, which interrupts on its own MSI-X vector (`1 + v`, vector 0
//! being the async EQs'), as the simulated device's interrupt log shows.

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

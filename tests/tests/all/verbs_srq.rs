//! Shared receive queues through the verbs API (`ibv_create_srq`, `ibv_post_srq_recv`, `ibv_modify_srq`,
//! `ibv_query_srq`): several QPs consume one SRQ's receives and their completions carry the SRQ's wr_ids; the
//! limit and last-WQE events reach the context that owns the SRQ or QP only.

use std::time::Duration;

use mlx5_verbs::{
    wr, Access, AsyncEvent, Context, Device, QpCap, QpInitAttr, QpType, SrqAttrMask, SrqInitAttr, VerbsError, WcOpcode,
    WcStatus, WorkCompletion,
};

const SEND_CAP: QpCap = QpCap { max_send_wr: 8, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

/// Polls `cq` until `n` completions arrived (or 5 s passed) and returns them.
fn wait(cq: &mlx5_verbs::CompletionQueue<'_>, n: usize) -> Vec<WorkCompletion> {
    let mut wc = vec![WorkCompletion::default(); n];
    let got = cq.poll_until(&mut wc, n, Duration::from_secs(5)).unwrap();
    wc.truncate(got);
    wc
}

#[test]
fn several_qps_receive_through_one_srq_and_completions_name_its_wr_ids() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let srq = pd.create_srq(SrqInitAttr { max_wr: 16, max_sge: 1, srq_limit: 0 }).unwrap();
    let mut mem = vec![0u8; 16 * 64];
    let mr = pd.reg_mr(&mut mem, Access::LOCAL_WRITE).unwrap();
    // Three receivers on the SRQ, each with a sender of its own on the same device.
    let recv_attr = |ctx_val| QpInitAttr {
        srq: Some(&srq),
        qp_context: ctx_val,
        ..QpInitAttr::new(QpType::Rc, &cq, &cq, QpCap { max_send_wr: 1, max_send_sge: 1, ..QpCap::default() })
    };
    let mut pairs = Vec::new();
    for i in 0..3u64 {
        let r = pd.create_qp_with(recv_attr(100 + i)).unwrap();
        assert_eq!((r.cap().max_recv_wr, r.qp_context(), r.srqn()), (0, 100 + i, Some(srq.srqn())));
        let s = pd.create_qp(QpType::Rc, &cq, &cq, SEND_CAP).unwrap();
        let (rs, ss) = (ctx.remote_qp(&r).unwrap(), ctx.remote_qp(&s).unwrap());
        pairs.push((r.connect_rc(ss, Access::default()).unwrap(), s.connect_rc(rs, Access::default()).unwrap()));
    }
    for i in 0..6u64 {
        srq.post_recv(&[wr::recv(1000 + i, &[mr.sge(64 * i as usize, 64)])]).unwrap();
    }
    for (i, (_, s)) in pairs.iter().enumerate() {
        let msg = [b'a' + i as u8; 8];
        s.post_send(&[wr::send_inline(i as u64, &msg)]).unwrap();
        s.post_send(&[wr::send_inline(10 + i as u64, &msg)]).unwrap();
    }
    let wcs = wait(&cq, 12);
    assert_eq!(wcs.len(), 12);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let recvs: Vec<&WorkCompletion> = wcs.iter().filter(|w| w.opcode == WcOpcode::Recv).collect();
    let mut ids: Vec<u64> = recvs.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, (1000..1006).collect::<Vec<_>>(), "every SRQ request completes once");
    // Each receiver got two of them, and each landed in the buffer its request named.
    for (r, _) in &pairs {
        let mine: Vec<&&WorkCompletion> = recvs.iter().filter(|w| w.qp_num == r.qpn()).collect();
        assert_eq!(mine.len(), 2);
        for w in mine {
            let slot = (w.wr_id - 1000) as usize;
            let b = mr.read_vec(64 * slot, 8);
            assert!(b.iter().all(|&x| x == b[0]) && (b'a'..b'd').contains(&b[0]), "{b:?}");
        }
    }
    // Drained: the next message finds nothing posted (RNR, retried forever): the SRQ is reused once refilled.
    srq.post_recv(&[wr::recv(2000, &[mr.sge(0, 64)])]).unwrap();
    pairs[0].1.post_send(&[wr::send_inline(99, b"again")]).unwrap();
    let wcs = wait(&cq, 2);
    assert!(wcs.iter().any(|w| w.wr_id == 2000 && w.opcode == WcOpcode::Recv), "{wcs:?}");
    drop(pairs);
    srq.destroy().unwrap();
}

#[test]
fn the_limit_event_reaches_the_owning_context_only_and_disarms() {
    let dev = Device::sim(mlx5_sim::SimConfig::default()).unwrap();
    let (ctx, other) = (dev.open().unwrap(), dev.open().unwrap());
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(32).unwrap();
    let srq = pd.create_srq(SrqInitAttr { max_wr: 8, max_sge: 1, srq_limit: 0 }).unwrap();
    assert_eq!(srq.query().unwrap().srq_limit, 0);
    let mut mem = vec![0u8; 4096];
    let mr = pd.reg_mr(&mut mem, Access::LOCAL_WRITE).unwrap();
    let attr = QpInitAttr { srq: Some(&srq), ..QpInitAttr::new(QpType::Rc, &cq, &cq, SEND_CAP) };
    let r = pd.create_qp_with(attr).unwrap();
    let s = pd.create_qp(QpType::Rc, &cq, &cq, SEND_CAP).unwrap();
    let (rs, ss) = (ctx.remote_qp(&r).unwrap(), ctx.remote_qp(&s).unwrap());
    let r = r.connect_rc(ss, Access::default()).unwrap();
    let s = s.connect_rc(rs, Access::default()).unwrap();
    for i in 0..4u64 {
        srq.post_recv(&[wr::recv(i, &[mr.sge(64 * i as usize, 64)])]).unwrap();
    }
    srq.modify(SrqInitAttr { srq_limit: 3, ..SrqInitAttr::default() }, SrqAttrMask::LIMIT).unwrap();
    assert_eq!(srq.query().unwrap(), SrqInitAttr { max_wr: srq.max_wr(), max_sge: 1, srq_limit: 3 });
    // Resizing is refused, as mlx5 refuses it.
    let resize = srq.modify(SrqInitAttr { max_wr: 64, ..SrqInitAttr::default() }, SrqAttrMask::MAX_WR);
    assert!(matches!(resize, Err(VerbsError::Invalid(_))));
    // 4 posted -> 3 left: not below the limit.
    s.post_send(&[wr::send_inline(10, b"one")]).unwrap();
    assert_eq!(wait(&cq, 2).len(), 2);
    assert_eq!(ctx.get_async_event(Duration::from_millis(100)), None);
    // 2 left: below 3, one event for the SRQ's context.
    s.post_send(&[wr::send_inline(11, b"two")]).unwrap();
    assert_eq!(wait(&cq, 2).len(), 2);
    let e = ctx.get_async_event(Duration::from_secs(5));
    assert_eq!(e, Some(AsyncEvent::SrqLimitReached { srqn: srq.srqn() }));
    ctx.ack_async_event(&e.unwrap()).unwrap();
    assert_eq!(other.get_async_event(Duration::from_millis(50)), None, "an SRQ event goes to its owner only");
    assert_eq!(srq.query().unwrap().srq_limit, 0, "the event disarms the limit");
    drop((r, s));
}

#[test]
fn an_attached_qp_moved_to_err_reports_last_wqe_to_its_context() {
    let dev = Device::sim(mlx5_sim::SimConfig::default()).unwrap();
    let (ctx, other) = (dev.open().unwrap(), dev.open().unwrap());
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(8).unwrap();
    let srq = pd.create_srq(SrqInitAttr { max_wr: 4, max_sge: 1, srq_limit: 0 }).unwrap();
    let attr = QpInitAttr { srq: Some(&srq), ..QpInitAttr::new(QpType::Rc, &cq, &cq, SEND_CAP) };
    let qp = pd.create_qp_with(attr).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    let qp = qp.connect_rc(me, Access::default()).unwrap();
    let qpn = qp.qpn();
    let _qp = qp.to_error().map_err(|e| e.error).unwrap();
    assert_eq!(ctx.get_async_event(Duration::from_secs(5)), Some(AsyncEvent::LastWqeReached { qpn }));
    assert_eq!(other.get_async_event(Duration::from_millis(50)), None, "a QP event goes to its owner only");
}

#[test]
fn a_posted_srq_request_outside_its_limits_is_refused_with_the_index() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let srq = pd.create_srq(SrqInitAttr { max_wr: 3, max_sge: 1, srq_limit: 0 }).unwrap();
    let mut mem = vec![0u8; 256];
    let mr = pd.reg_mr(&mut mem, Access::LOCAL_WRITE).unwrap();
    let sge = [mr.sge(0, 8)];
    let wrs: Vec<_> = (0..srq.max_wr() as u64 + 1).map(|i| wr::recv(i, &sge)).collect();
    match srq.post_recv(&wrs) {
        Err(VerbsError::Post(e)) => assert_eq!(e.index, srq.max_wr() as usize),
        other => panic!("a full SRQ refuses the rest: {other:?}"),
    }
    assert!(pd.create_srq(SrqInitAttr { max_wr: 1 << 20, max_sge: 1, srq_limit: 0 }).is_err());
    assert!(pd.create_srq(SrqInitAttr { max_wr: 4, max_sge: 1, srq_limit: 100 }).is_err(), "limit above the size");
}

//! The datapath allocates nothing. The binary's counting global allocator (`main.rs`), armed only around the
//! datapath calls and counting only this thread's allocations (other tests run in parallel), must see zero allocations while the core posts sends (BlueFlame, batched, inline, RDMA WRITE with
//! immediate, UD) and receives, polls requester, responder and unknown-QP CQEs, and arms the CQ. QPs and the CQ
//! are created on the simulator; their datapath then runs against a plain-memory BAR (`MemMmio`), so the simulator
//! does not run while the counter is armed and every allocation seen is the core's.

use mlx5_core::cq::{Cq, CqeError, CqeFields, LinkLayer, Notify, WcOpcode, WcStatus, WorkCompletion, CQE64_SIZE};
use mlx5_core::mkey::Access;
use mlx5_core::prm::consts;
use mlx5_core::qp::{
    Ah, AhAttr, Grh, Mtu, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
    UdDest,
};
use mlx5_sim::testkit::alloc_count;
use mlx5_sim::testkit::mocks::MemMmio;
use mlx5_sim::testkit::{Node, SimHca};
use mlx5_sim::{SimConfig, SimDelay};

/// Runs `f` with the counter armed on this thread; returns its result and the allocations it made.
fn counted<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = alloc_count::count();
    let armed = alloc_count::arm();
    let r = f();
    drop(armed);
    (r, (alloc_count::count() - before) as usize)
}

#[test]
fn the_counter_sees_an_allocation() {
    let (v, n) = counted(|| std::hint::black_box(vec![1u8; 16]));
    assert_eq!(v.len(), 16);
    assert!(n >= 1, "the counting allocator must notice a Vec");
}

/// RESET → INIT → RTR → RTS towards `dest` (RC) or with a Q_Key (UD).
fn ready(hca: &mut SimHca, d: &mut SimDelay, qp: &mut Qp, dest: u32, ah: AhAttr) {
    use QpAttrMask as M;
    let a = QpAttr {
        qp_access_flags: Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        path_mtu: Mtu::M1024,
        dest_qp_num: dest,
        ah_attr: ah,
        rnr_retry: 7,
        retry_cnt: 7,
        min_rnr_timer: 1,
        max_dest_rd_atomic: 1,
        max_rd_atomic: 1,
        qkey: 0x1111,
        ..QpAttr::default()
    };
    let steps = if qp.qp_type() == QpType::Rc {
        [
            (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            (
                QpState::Rtr,
                M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
            ),
            (QpState::Rts, M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC),
        ]
    } else {
        [
            (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY),
            (QpState::Rtr, M::STATE),
            (QpState::Rts, M::STATE | M::SQ_PSN),
        ]
    };
    for (s, m) in steps {
        hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, d).unwrap();
    }
}

/// Plays the device: writes CQE `cq.cons_index() + k` with the owner bit of its pass.
fn put_cqe(cq: &Cq, k: u32, f: CqeFields) {
    let idx = cq.cons_index().wrapping_add(k);
    let img = CqeFields { owner: ((idx >> cq.log_nent()) & 1) as u8, ..f }.emit().0;
    let dst = cq.buf().ptr((idx & (cq.nent() - 1)) as usize * CQE64_SIZE, CQE64_SIZE);
    // SAFETY: 64 bytes inside a live fragment of the ring (QueueBuf::ptr checked); nothing else writes the ring.
    unsafe { std::ptr::copy_nonoverlapping(img.as_ptr(), dst, CQE64_SIZE) };
}

#[test]
fn post_send_post_recv_poll_cq_and_arm_allocate_nothing() {
    let mut node = Node::new(SimConfig::default(), 1 << 16);
    let mut cq = node.cq(255);
    let cap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
    let mut a = node.qp(QpType::Rc, &cq, cap, false);
    let mut b = node.qp(QpType::Rc, &cq, cap, false);
    let mut u = node.qp(QpType::Ud, &cq, cap, false);
    let port = node.hca.query_port(&mut node.d).unwrap();
    let gid = node.hca.query_gid(0, &mut node.d).unwrap();
    let ah_attr = AhAttr {
        dlid: port.lid,
        grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
        dmac: node.dev.config().mac,
        port_num: 1,
        ..AhAttr::default()
    };
    let (qa, qb, qu) = (a.qpn(), b.qpn(), u.qpn());
    ready(&mut node.hca, &mut node.d, &mut a, qb, ah_attr);
    ready(&mut node.hca, &mut node.d, &mut b, qa, ah_attr);
    ready(&mut node.hca, &mut node.d, &mut u, 0, ah_attr);
    let ah = Ah::new(&ah_attr, port.link_layer);

    // Everything the calls need is built before the counter is armed (the Vecs are the test's, not the core's).
    let bar = MemMmio::new(node.dev.mmio().bar_size());
    let base = node.addr(0);
    let lkey = node.mr.lkey;
    let sge = [Sge { addr: base, length: 64, lkey }];
    let two = [Sge { addr: base, length: 32, lkey }, Sge { addr: base + 32, length: 32, lkey }];
    let payload = [0x5au8; 48];
    let wr = |wr_id, op, sg_list, flags| SendWr { wr_id, op, sg_list, flags, inline: None, ud: None };
    let batch: Vec<SendWr> = (0..16).map(|i| wr(i, SendOp::Send, &sge[..], SendFlags::default())).collect();
    let mixed = [
        SendWr { inline: Some(&payload[..]), ..wr(100, SendOp::SendImm { imm: 7 }, &[], SendFlags::SOLICITED) },
        wr(101, SendOp::RdmaWriteImm { remote_addr: base + 4096, rkey: node.mr.rkey, imm: 9 }, &two, SendFlags::FENCE),
    ];
    let last = [wr(102, SendOp::Send, &sge[..], SendFlags::SIGNALED)];
    let dgram = [SendWr {
        ud: Some(UdDest { ah: &ah, remote_qpn: qu, remote_qkey: 0x1111 }),
        ..wr(200, SendOp::Send, &sge[..], SendFlags::SIGNALED)
    }];
    let recvs: Vec<RecvWr> = (0..16).map(|i| RecvWr { wr_id: 1000 + i, sg_list: &two[..] }).collect();
    let mut wc = [WorkCompletion::default(); 8];

    let mut allocs = 0;
    // Posting: BlueFlame (one WQE), one doorbell for 16, inline and RDMA WRITE with immediate, UD, receives.
    let (posted, n) = counted(|| {
        let one = a.post_send(&bar, &batch[..1]);
        let many = a.post_send(&bar, &batch[1..]);
        let mixed = a.post_send(&bar, &mixed);
        let at = a.sq_cur_post();
        let last = a.post_send(&bar, &last);
        let uat = u.sq_cur_post();
        let dgram = u.post_send(&bar, &dgram);
        let recv = b.post_recv(&bar, &recvs);
        (one.and(many).and(mixed).and(last).and(dgram).and(recv), at, uat)
    });
    allocs += n;
    let (res, last_at, ud_at) = posted;
    res.unwrap();
    assert_eq!((a.sq_outstanding(), u.sq_outstanding(), b.rq_outstanding()), (19, 1, 16));

    // The device's side, outside the counted window: the send completions, the receives, one CQE for a QP that has
    // no queue on this CQ.
    let req = |qpn, counter: u32| CqeFields {
        opcode: consts::MLX5_CQE_REQ,
        wqe_opcode: consts::MLX5_OPCODE_SEND,
        qpn,
        wqe_counter: counter as u16,
        ..CqeFields::default()
    };
    let resp = |k: u32| CqeFields {
        opcode: consts::MLX5_CQE_RESP_SEND,
        qpn: qb,
        wqe_counter: k as u16,
        byte_cnt: 64,
        flags_rqpn: qa,
        ..CqeFields::default()
    };
    put_cqe(&cq, 0, req(qa, last_at));
    put_cqe(&cq, 1, req(qu, ud_at));
    for k in 0..16 {
        put_cqe(&cq, 2 + k, resp(k));
    }
    put_cqe(&cq, 18, req(0xabcd, 0));

    // Polling (in calls of 8, through the QPs' WrTable), the error CQE, and both arm doorbells.
    let (polled, n) = counted(|| {
        let mut got = 0usize;
        let mut sends = 0usize;
        let mut ok = true;
        let mut err = None;
        for _ in 0..10 {
            match cq.poll(&bar, &mut [&mut a, &mut b, &mut u][..], &mut wc) {
                Ok(0) => break,
                Ok(k) => {
                    got += k;
                    sends += wc[..k].iter().filter(|w| w.opcode == WcOpcode::Send).count();
                    ok &= wc[..k].iter().all(|w| w.status == WcStatus::Success);
                }
                Err(e) => err = Some(e),
            }
        }
        cq.arm(&bar, 0, Notify::NextComp);
        cq.arm(&bar, 1, Notify::Solicited);
        (got, sends, ok, err)
    });
    allocs += n;
    let (got, sends, ok, err) = polled;
    assert_eq!((got, sends, ok), (18, 2, true), "every completion polled");
    assert!(matches!(err, Some(CqeError::UnknownQp { qpn: 0xabcd, .. })), "{err:?}");
    assert_eq!((a.sq_outstanding(), u.sq_outstanding(), b.rq_outstanding()), (0, 0, 0));
    assert_eq!(port.link_layer, LinkLayer::Ethernet);

    assert_eq!(allocs, 0, "the datapath allocated {allocs} times");

    for q in [a, b, u] {
        node.hca.destroy_qp(q, &mut node.d).unwrap();
    }
    node.hca.destroy_cq(cq, &mut node.d).unwrap();
    // Frees the MR, PD and buffer, tears down, and checks that every DMA allocation came back.
    node.finish();
}

/// The extended QP's builder (`wr_start` .. `wr_complete`, inline data copied) and the extended CQ's cursor
/// (`start_poll` / `next_poll` / `read_*` / `end_poll`) allocate nothing either.
#[test]
fn extended_qp_builder_and_cq_cursor_allocate_nothing() {
    use mlx5_core::cq::{CqEx, WcExFlags};
    use mlx5_core::qp::{QpEx, SendOpsFlags};
    let mut node = Node::new(SimConfig::default(), 1 << 16);
    let cq = node.cq(63);
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 64 };
    let mut a = node.qp(QpType::Rc, &cq, cap, false);
    let mut b = node.qp(QpType::Rc, &cq, cap, false);
    let port = node.hca.query_port(&mut node.d).unwrap();
    let gid = node.hca.query_gid(0, &mut node.d).unwrap();
    let ah_attr = AhAttr {
        grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
        dmac: node.dev.config().mac,
        port_num: 1,
        ..AhAttr::default()
    };
    let (qa, qb) = (a.qpn(), b.qpn());
    ready(&mut node.hca, &mut node.d, &mut a, qb, ah_attr);
    ready(&mut node.hca, &mut node.d, &mut b, qa, ah_attr);
    assert_eq!(port.link_layer, LinkLayer::Ethernet);
    let bar = MemMmio::new(node.dev.mmio().bar_size());
    let (base, lkey, rkey) = (node.addr(0), node.mr.lkey, node.mr.rkey);
    let qpx = QpEx::new(QpType::Rc, SendOpsFlags::SEND | SendOpsFlags::RDMA_WRITE_WITH_IMM).unwrap();
    let cqx = CqEx::new(WcExFlags::STANDARD | WcExFlags::COMPLETION_TIMESTAMP).unwrap();
    let payload = [0x5au8; 48];

    let (posted, n) = counted(|| {
        let mut batch = qpx.wr_start();
        batch.wr_id = 1;
        batch.wr_send();
        batch.wr_set_inline_data(&payload);
        batch.wr_id = 2;
        batch.wr_flags = SendFlags::SIGNALED;
        batch.wr_rdma_write_imm(rkey, base + 4096, 7u32.to_be());
        batch.wr_set_sge(lkey, base, 64);
        let r = batch.wr_complete(&mut a, &bar);
        // The write (control, remote address and one data segment: one 64-byte block) is the last WQE.
        (r, a.sq_cur_post().wrapping_sub(1))
    });
    assert_eq!(n, 0, "the builder allocated {n} times");
    let (res, at) = posted;
    res.unwrap();
    assert_eq!(a.sq_outstanding(), 2);

    // The device's side: the signaled request's completion (retiring both) and a receive-with-immediate on b.
    let req = CqeFields {
        opcode: consts::MLX5_CQE_REQ,
        wqe_opcode: consts::MLX5_OPCODE_RDMA_WRITE_IMM,
        qpn: qa,
        wqe_counter: at as u16,
        ..CqeFields::default()
    };
    let b_recv = [Sge { addr: base, length: 64, lkey }];
    b.post_recv(&bar, &[RecvWr { wr_id: 50, sg_list: &b_recv }]).unwrap();
    let resp = CqeFields {
        opcode: consts::MLX5_CQE_RESP_WR_IMM,
        qpn: qb,
        byte_cnt: 64,
        flags_rqpn: qa,
        imm_inval_pkey: 7,
        timestamp: 0x1234,
        ..CqeFields::default()
    };
    put_cqe(&cq, 0, req);
    put_cqe(&cq, 1, resp);
    let mut cq = cq;
    let (polled, n) = counted(|| {
        let mut qps = [&mut a, &mut b];
        let mut seen = [(0u64, WcOpcode::Send, None, None, None); 2];
        let mut k = 0;
        if let Ok(Some(mut p)) = cqx.start_poll_cq(&mut cq, &bar, &mut qps[..]) {
            loop {
                seen[k] = (p.wr_id(), p.read_opcode(), p.read_byte_len(), p.read_src_qp(), p.read_completion_ts());
                k += 1;
                if k == 2 || !p.next_poll().unwrap_or(false) {
                    break;
                }
            }
            p.end_poll();
        }
        (k, seen)
    });
    assert_eq!(n, 0, "the cursor allocated {n} times");
    let (k, seen) = polled;
    assert_eq!(k, 2);
    assert_eq!(seen[0].0, 2, "the signaled write completes");
    assert_eq!(
        seen[1],
        (50, WcOpcode::RecvRdmaWithImm, Some(64), Some(qa), Some(0x1234)),
        "the receive, read field by field"
    );
    for q in [a, b] {
        node.hca.destroy_qp(q, &mut node.d).unwrap();
    }
    node.hca.destroy_cq(cq, &mut node.d).unwrap();
}

//! The extended verbs objects end to end on the simulator: `ibv_create_cq_ex` with `wc_flags`, read field by
//! field between `start_poll` and `end_poll`, and `ibv_create_qp_ex` with `send_ops_flags`, its work requests
//! built with `wr_start` .. `wr_complete` (one doorbell) or dropped with `wr_abort`.

use std::time::{Duration, Instant};

use mlx5_verbs::{
    wr, Access, Context, CqInitAttrEx, QpCap, QpInitAttr, QpType, SendFlags, SendOpsFlags, VerbsError, WcExFlags,
    WcFlags, WcOpcode, WcStatus,
};

/// What one completion read through the extended CQ's accessors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Read {
    wr_id: u64,
    status: WcStatus,
    opcode: WcOpcode,
    byte_len: Option<u32>,
    imm: Option<u32>,
    qp_num: Option<u32>,
    src_qp: Option<u32>,
    flags: WcFlags,
    ts: Option<u64>,
    cvlan: Option<u16>,
}

/// Takes up to `want` completions with start_poll / next_poll / end_poll, waiting up to 5 s.
fn drain(cq: &mlx5_verbs::CompletionQueueEx<'_>, want: usize) -> Vec<Read> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while out.len() < want && Instant::now() < deadline {
        let Some(mut p) = cq.start_poll().unwrap() else {
            std::thread::yield_now();
            continue;
        };
        loop {
            out.push(Read {
                wr_id: p.wr_id(),
                status: p.status(),
                opcode: p.read_opcode(),
                byte_len: p.read_byte_len(),
                imm: p.read_imm_data(),
                qp_num: p.read_qp_num(),
                src_qp: p.read_src_qp(),
                flags: p.read_wc_flags(),
                ts: p.read_completion_ts(),
                cvlan: p.read_cvlan(),
            });
            if out.len() == want || !p.next_poll().unwrap() {
                break;
            }
        }
        p.end_poll();
    }
    out
}

#[test]
fn qp_ex_builder_posts_a_batch_and_cq_ex_reads_it_field_by_field() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let flags = WcExFlags::STANDARD | WcExFlags::COMPLETION_TIMESTAMP;
    let scq = ctx.create_cq_ex(CqInitAttrEx::new(32, flags)).unwrap();
    let rcq = ctx.create_cq_ex(CqInitAttrEx::new(32, flags)).unwrap();
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let ops = SendOpsFlags::SEND | SendOpsFlags::SEND_WITH_IMM | SendOpsFlags::RDMA_WRITE;
    let a = pd.create_qp_ex(QpInitAttr::new(QpType::Rc, &scq, &scq, cap), ops).unwrap();
    let b = pd.create_qp(QpType::Rc, &rcq, &rcq, cap).unwrap();
    assert_eq!((a.send_ops(), b.send_ops()), (Some(ops), None));
    let (ra, rb) = (ctx.remote_qp(&a).unwrap(), ctx.remote_qp(&b).unwrap());
    let a = a.connect_rc(rb, Access::default()).unwrap();
    let b = b.connect_rc(ra, Access::REMOTE_WRITE | Access::LOCAL_WRITE).unwrap();
    let mut mem = vec![0u8; 4096];
    let mr = pd.reg_mr(&mut mem, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    mr.write(0, &[0xab; 256]).unwrap();
    b.post_recv(&[wr::recv(100, &[mr.sge(2048, 128)]), wr::recv(101, &[mr.sge(2048 + 128, 128)])]).unwrap();

    // A plain QP has no builder (EOPNOTSUPP).
    assert!(b.wr_start().is_err());

    // An aborted batch reaches nothing.
    let mut batch = a.wr_start().unwrap();
    batch.wr_id = 9;
    batch.wr_flags = SendFlags::SIGNALED;
    batch.wr_send();
    batch.wr_set_inline_data(b"never sent");
    batch.wr_abort();
    // A batch with an operation the QP was not made for posts nothing and says so.
    let mut batch = a.wr_start().unwrap();
    batch.wr_send();
    batch.wr_rdma_read(mr.rkey(), mr.addr());
    let e = batch.wr_complete().unwrap_err();
    assert!(matches!(&e, VerbsError::Invalid(m) if m.contains("wr_rdma_read")), "{e}");

    // Move the simulated device clock off 0, so the timestamps read below are the device's.
    match ctx.device() {
        mlx5_verbs::DeviceKind::Sim(d) => d.advance_ns(1_000_000),
        _ => unreachable!("open_sim opens a simulated device"),
    }
    // One batch, one doorbell: an RDMA WRITE of 256 bytes, a SEND of inline bytes, a SEND with immediate.
    let mut batch = a.wr_start().unwrap();
    batch.wr_id = 1;
    batch.wr_flags = SendFlags::SIGNALED;
    batch.wr_rdma_write(mr.rkey(), mr.addr() + 1024);
    batch.wr_set_sge(mr.lkey(), mr.addr(), 256);
    batch.wr_id = 2;
    batch.wr_send();
    let mut msg = *b"hello, extended";
    batch.wr_set_inline_data(&msg);
    // The bytes were copied: the buffer is the caller's again.
    msg[0] = b'J';
    assert_eq!(msg[0], b'J');
    batch.wr_id = 3;
    batch.wr_send_imm(0x0102_0304u32.to_be());
    batch.wr_set_sge(mr.lkey(), mr.addr(), 8);
    assert_eq!(batch.len(), 3);
    batch.wr_complete().unwrap();

    let sends = drain(&scq, 3);
    assert_eq!(
        sends.iter().map(|r| (r.wr_id, r.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::Success)]
    );
    assert_eq!(sends[0].opcode, WcOpcode::RdmaWrite);
    assert_eq!(sends[2].flags, WcFlags::WITH_IMM);
    assert!(sends.iter().all(|r| r.qp_num == Some(a.qpn())), "{sends:?}");

    let recvs = drain(&rcq, 2);
    assert_eq!(recvs.len(), 2, "{recvs:?}");
    let (r0, r1) = (recvs[0], recvs[1]);
    assert_eq!((r0.wr_id, r0.opcode, r0.byte_len, r0.src_qp), (100, WcOpcode::Recv, Some(15), Some(a.qpn())));
    assert_eq!((r1.wr_id, r1.byte_len, r1.imm), (101, Some(8), Some(0x0102_0304u32.to_be())));
    // RoCE packets carry a GRH, so receives have IBV_WC_GRH beside IBV_WC_WITH_IMM.
    assert!(r1.flags.contains(WcFlags::WITH_IMM) && r1.flags.contains(WcFlags::GRH), "{:?}", r1.flags);
    // Asked for at creation: the CQE's device clock, which the simulator moves.
    assert!(r0.ts.is_some_and(|t| t > 0) && r1.ts >= r0.ts, "{recvs:?}");
    // Not asked for: absent.
    assert_eq!(r0.cvlan, None);
    assert_eq!(mr.read_vec(2048, 15), b"hello, extended");
    assert_eq!(mr.read_vec(1024, 256), vec![0xab; 256]);
    // Drained: ENOENT.
    assert!(rcq.start_poll().unwrap().is_none());
    // Between start_poll and end_poll the CQ is not held: an ordinary poll (here of the next completion) neither
    // hangs nor takes what the cursor already has.
    b.post_recv(&[wr::recv(102, &[mr.sge(2048, 128)]), wr::recv(103, &[mr.sge(2048 + 128, 128)])]).unwrap();
    let mut batch = a.wr_start().unwrap();
    for id in [4, 5] {
        batch.wr_id = id;
        batch.wr_send();
        batch.wr_set_inline_data(b"x");
    }
    batch.wr_complete().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let p = loop {
        if let Some(p) = rcq.start_poll().unwrap() {
            break p;
        }
        assert!(Instant::now() < deadline, "no receive");
    };
    assert_eq!(p.wr_id(), 102);
    let mut wc = [mlx5_verbs::WorkCompletion::default(); 1];
    assert_eq!(rcq.poll_until(&mut wc, 1, Duration::from_secs(5)).unwrap(), 1);
    assert_eq!(wc[0].wr_id, 103);
    p.end_poll();
}

#[test]
fn create_ex_refuses_what_the_driver_cannot_do() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    for f in [WcExFlags::FLOW_TAG, WcExFlags::TM_INFO, WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK] {
        assert!(ctx.create_cq_ex(CqInitAttrEx::new(8, WcExFlags::STANDARD | f)).is_err(), "{f:?}");
    }
    let cq = ctx.create_cq(8).unwrap();
    let cap = QpCap { max_send_wr: 4, max_send_sge: 1, max_recv_wr: 4, max_recv_sge: 1, ..QpCap::default() };
    let uc = QpInitAttr::new(QpType::Uc, &cq, &cq, cap);
    assert!(pd.create_qp_ex(uc, SendOpsFlags::RDMA_READ).is_err(), "UC has no RDMA READ");
    assert!(pd.create_qp_ex(uc, SendOpsFlags::RDMA_WRITE_WITH_IMM | SendOpsFlags::SEND).is_ok());
    let rc = QpInitAttr::new(QpType::Rc, &cq, &cq, cap);
    assert!(pd.create_qp_ex(rc, SendOpsFlags::BIND_MW).is_err(), "no memory windows");
}

#[test]
fn ud_qp_ex_sends_through_wr_set_ud_addr() {
    use mlx5_verbs::{AhAttr, Grh, GRH_BYTES};
    const QKEY: u32 = 0x1111_1111;
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq_ex(CqInitAttrEx::new(16, WcExFlags::STANDARD)).unwrap();
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let a = pd.create_qp_ex(QpInitAttr::new(QpType::Ud, &cq, &cq, cap), SendOpsFlags::SEND_WITH_IMM).unwrap();
    let b = pd.create_qp(QpType::Ud, &cq, &cq, cap).unwrap();
    let (a, b) = (a.activate_ud(QKEY).unwrap(), b.activate_ud(QKEY).unwrap());
    let gid = ctx.query_gid(0).unwrap();
    let attr = AhAttr {
        grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
        dmac: mlx5_verbs::mac_of_gid(&gid),
        port_num: 1,
        ..AhAttr::default()
    };
    let ah = pd.create_ah(&attr).unwrap();
    let mut mem = vec![0u8; 1024];
    let mr = pd.reg_mr(&mut mem, Access::LOCAL_WRITE).unwrap();
    b.post_recv(&[wr::recv(7, &[mr.sge(512, (GRH_BYTES + 32) as u32)])]).unwrap();
    let mut batch = a.wr_start().unwrap();
    batch.wr_id = 5;
    batch.wr_flags = SendFlags::SIGNALED;
    batch.wr_send_imm(42u32.to_be());
    batch.wr_set_inline_data(b"datagram through the builder");
    batch.wr_set_ud_addr(ah.av(), b.qpn(), QKEY);
    batch.wr_complete().unwrap();
    // The address handle was copied into the batch: it may go now.
    ah.destroy();
    let got = drain(&cq, 2);
    let recv = got.iter().find(|r| r.wr_id == 7).expect("the datagram arrived");
    assert_eq!(
        (recv.opcode, recv.byte_len, recv.imm, recv.src_qp),
        (WcOpcode::Recv, Some((GRH_BYTES + 28) as u32), Some(42u32.to_be()), Some(a.qpn()))
    );
    assert!(got.iter().any(|r| r.wr_id == 5 && r.status == WcStatus::Success), "{got:?}");
    assert_eq!(mr.read_vec(512 + GRH_BYTES, 28), b"datagram through the builder");
    // A UD QP made for sends only has no RDMA WRITE in its builder.
    let mut batch = a.wr_start().unwrap();
    batch.wr_rdma_write(1, 2);
    assert!(batch.wr_complete().is_err());
}

//! What verbs promises beyond the basic datapath, end to end on the simulator: UC queue pairs (`IBV_QPT_UC`),
//! `ibv_query_qp`'s attributes, work completions as `ibv_wc` carries them (network-order immediate, `IBV_WC_*`
//! flags, the CQE timestamp of an extended CQ) and `ibv_init_ah_from_wc` for a UD reply.

use mlx5_core::cq::{Cq, WcFlags, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hca::{Error, QpInitAttr};
use mlx5_core::mkey::Access;
use mlx5_core::qp::{
    required_attrs, AhAttr, ModifyError, Mtu, PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr,
    SendFlags, SendOp, SendWr,
};
use mlx5_sim::testkit::{Node, RcOpts};
use mlx5_sim::{SimConfig, SimEvent};

const MEM: usize = 1 << 20;

fn cap(send: u32, recv: u32) -> QpCap {
    QpCap { max_send_wr: send, max_recv_wr: recv, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 }
}

fn poll_n(n: &Node, cq: &mut Cq, qps: &mut [&mut Qp], want: usize) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    for _ in 0..10_000 {
        let k = cq.poll(n.hca.mmio(), qps, &mut wc).unwrap();
        got.extend_from_slice(&wc[..k]);
        if got.len() >= want {
            break;
        }
        if k == 0 {
            embedded_hal::delay::DelayNs::delay_us(&mut n.dev.delay(), 10);
        }
    }
    assert_eq!(got.len(), want, "completions: {got:?}");
    got
}

/// RESET → INIT → RTR (→ RTS) of a UC QP with exactly the attributes verbs requires for UC
/// (`qp_state_table[..].req_param[IB_QPT_UC]`): no responder resources, RNR timer, timeout or retries.
fn uc_connect(n: &mut Node, qp: &mut Qp, dest: u32, ah: AhAttr, to_rts: bool) {
    let a = QpAttr {
        qp_access_flags: Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        path_mtu: Mtu::M1024,
        dest_qp_num: dest,
        ah_attr: ah,
        rq_psn: 0x100,
        sq_psn: 0x100,
        ..QpAttr::default()
    };
    let steps: &[(QpState, QpState)] = if to_rts {
        &[(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)]
    } else {
        &[(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr)]
    };
    for &(f, s) in steps {
        let m = required_attrs(QpType::Uc, f, s).unwrap();
        n.hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, &mut n.d).unwrap();
    }
}

fn uc_pair(n: &mut Node) -> (Cq, Qp, Qp) {
    let cq = n.cq(64);
    let mut a = n.qp(QpType::Uc, &cq, cap(16, 16), false);
    let mut b = n.qp(QpType::Uc, &cq, cap(16, 16), false);
    let ah = n.ah_attr();
    let (qa, qb) = (a.qpn(), b.qpn());
    uc_connect(n, &mut a, qb, ah, true);
    uc_connect(n, &mut b, qa, ah, true);
    (cq, a, b)
}

fn send_wr<'a>(wr_id: u64, op: SendOp, sge: &'a [mlx5_core::qp::Sge]) -> SendWr<'a> {
    SendWr { wr_id, op, sg_list: sge, flags: SendFlags::SIGNALED, inline: None, ud: None }
}

#[test]
fn uc_send_and_write_with_immediate_arrive_and_the_immediate_is_network_order() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let (mut cq, mut a, mut b) = uc_pair(&mut n);
    let data: Vec<u8> = (0..3000u32).map(|k| (k * 7) as u8).collect();
    n.put(0, &data);
    let r0 = [n.sge(0x10000, 4096)];
    let r1 = [n.sge(0x20000, 64)];
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 10, sg_list: &r0 }, RecvWr { wr_id: 11, sg_list: &r1 }]).unwrap();
    let s0 = [n.sge(0, 3000)];
    let s1 = [n.sge(0, 200)];
    let rkey = n.mr.rkey;
    // ibv_send_wr.imm_data is __be32: the application stores htonl(x).
    let imm = 0x1234_5678u32.to_be();
    let wrs = [
        send_wr(1, SendOp::SendImm { imm }, &s0),
        send_wr(2, SendOp::RdmaWriteImm { remote_addr: n.addr(0x30000), rkey, imm }, &s1),
    ];
    n.hca.post_send(&mut a, &wrs).unwrap();
    let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 4);
    let by_id = |id| *wcs.iter().find(|w| w.wr_id == id).unwrap();
    assert_eq!((by_id(1).status, by_id(1).opcode), (WcStatus::Success, WcOpcode::Send));
    assert_eq!((by_id(2).status, by_id(2).opcode), (WcStatus::Success, WcOpcode::RdmaWrite));
    let (send, write) = (by_id(10), by_id(11));
    assert_eq!((send.opcode, send.byte_len, send.status), (WcOpcode::Recv, 3000, WcStatus::Success));
    assert_eq!((write.opcode, write.byte_len), (WcOpcode::RecvRdmaWithImm, 200));
    for w in [send, write] {
        assert!(w.wc_flags.contains(WcFlags::WITH_IMM));
        // rdma-core copies the CQE's big-endian field: ntohl gives back what the sender meant.
        assert_eq!((w.imm_data, u32::from_be(w.imm_data)), (imm, 0x1234_5678));
        assert_eq!(w.imm_data.to_ne_bytes(), [0x12, 0x34, 0x56, 0x78]);
    }
    assert_eq!(n.bytes(0x10000, 3000), data);
    assert_eq!(n.bytes(0x30000, 200), data[..200]);
    // Nothing acknowledged the messages: no RNR, retry or duplicate machinery ran.
    assert!(!n.dev.events().iter().any(|e| matches!(e, SimEvent::Retry { .. } | SimEvent::RnrNak { .. })));
    n.drop_pair(cq, a, b);
    n.finish();
}

#[test]
fn uc_refuses_rdma_read_and_atomics_at_post_time() {
    // rdma-core's _mlx5_post_send builds no remote-address segment for these on UC and lets the device fail them;
    // the driver refuses them with a typed error instead, and posts nothing.
    let mut n = Node::new(SimConfig::default(), MEM);
    let (cq, mut a, b) = uc_pair(&mut n);
    let s = [n.sge(0, 8)];
    let rkey = n.mr.rkey;
    let ops = [
        SendOp::RdmaRead { remote_addr: n.addr(0x1000), rkey },
        SendOp::AtomicFetchAdd { remote_addr: n.addr(0x1000), rkey, add: 1 },
        SendOp::AtomicCmpSwp { remote_addr: n.addr(0x1000), rkey, compare: 0, swap: 1 },
    ];
    for op in ops {
        let e = n.hca.post_send(&mut a, &[send_wr(5, op, &s)]).unwrap_err();
        assert_eq!((e.index, e.kind), (0, PostErrorKind::BadRequest { what: "RDMA READ or atomic on a UC QP" }));
    }
    assert_eq!(a.sq_outstanding(), 0);
    n.drop_pair(cq, a, b);
    n.finish();
}

#[test]
fn uc_modify_takes_only_the_uc_attributes_of_qp_state_table() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let cq = n.cq(8);
    let mut q = n.qp(QpType::Uc, &cq, cap(4, 4), false);
    let ah = n.ah_attr();
    let a = QpAttr { qp_access_flags: Access::REMOTE_WRITE, dest_qp_num: 0x123, ah_attr: ah, ..QpAttr::default() };
    let init = required_attrs(QpType::Uc, QpState::Reset, QpState::Init).unwrap();
    n.hca.modify_qp(&mut q, &QpAttr { qp_state: QpState::Init, ..a }, init, &mut n.d).unwrap();
    // INIT → RTR with RC's responder attributes is refused before any command.
    let rtr = required_attrs(QpType::Uc, QpState::Init, QpState::Rtr).unwrap();
    let rc_only = QpAttrMask::MAX_DEST_RD_ATOMIC | QpAttrMask::MIN_RNR_TIMER;
    let e = n.hca.modify_qp(&mut q, &QpAttr { qp_state: QpState::Rtr, ..a }, rtr | rc_only, &mut n.d).unwrap_err();
    assert!(matches!(e, Error::Modify(ModifyError::ExtraAttr { extra }) if extra == rc_only.0), "{e:?}");
    n.hca.modify_qp(&mut q, &QpAttr { qp_state: QpState::Rtr, ..a }, rtr, &mut n.d).unwrap();
    let rts = required_attrs(QpType::Uc, QpState::Rtr, QpState::Rts).unwrap();
    assert_eq!(rts, QpAttrMask::STATE | QpAttrMask::SQ_PSN);
    n.hca.modify_qp(&mut q, &QpAttr { qp_state: QpState::Rts, ..a }, rts, &mut n.d).unwrap();
    assert_eq!(n.dev.qp_info(q.qpn()).unwrap().state, mlx5_sim::QpState::Rts);
    n.hca.destroy_qp(q, &mut n.d).map_err(|e| e.error).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).unwrap();
    n.finish();
}

#[test]
fn a_uc_message_the_responder_cannot_take_is_dropped_silently_and_the_sender_still_succeeds() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let mut cq = n.cq(64);
    let mut a = n.qp(QpType::Uc, &cq, cap(16, 16), false);
    let mut b = n.qp(QpType::Uc, &cq, cap(16, 16), false);
    let ah = n.ah_attr();
    let (qa, qb) = (a.qpn(), b.qpn());
    uc_connect(&mut n, &mut a, qb, ah, true);
    // The responder is only in INIT: the message is lost, the requester completes it (no ACK is awaited).
    let m = required_attrs(QpType::Uc, QpState::Reset, QpState::Init).unwrap();
    let a_init = QpAttr { qp_state: QpState::Init, qp_access_flags: Access::REMOTE_WRITE, ..QpAttr::default() };
    n.hca.modify_qp(&mut b, &a_init, m, &mut n.d).unwrap();
    let rb = [n.sge(0x10000, 256)];
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 20, sg_list: &rb }]).unwrap();
    n.put(0, b"first");
    let s = [n.sge(0, 5)];
    n.hca.post_send(&mut a, &[send_wr(1, SendOp::Send, &s)]).unwrap();
    let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1);
    assert_eq!((w[0].wr_id, w[0].status), (1, WcStatus::Success));
    assert!(n.dev.events().iter().any(|e| matches!(e, SimEvent::UcDropped { qpn, .. } if *qpn == qb)));
    // A WRITE with a bad rkey is dropped at a ready responder, which stays in RTS; the next SEND arrives.
    let m = required_attrs(QpType::Uc, QpState::Init, QpState::Rtr).unwrap();
    let to_rtr = QpAttr { qp_state: QpState::Rtr, dest_qp_num: qa, ah_attr: ah, rq_psn: 0x100, ..QpAttr::default() };
    n.hca.modify_qp(&mut b, &to_rtr, m, &mut n.d).unwrap();
    let bad = SendOp::RdmaWrite { remote_addr: n.addr(0x20000), rkey: n.mr.rkey ^ 0x100 };
    n.put(0, b"second");
    let s2 = [n.sge(0, 6)];
    n.hca.post_send(&mut a, &[send_wr(2, bad, &s), send_wr(3, SendOp::Send, &s2)]).unwrap();
    let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 3);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let r = wcs.iter().find(|w| w.wr_id == 20).unwrap();
    assert_eq!(r.byte_len, 6);
    assert_eq!(n.bytes(0x10000, 6), b"second");
    assert_eq!(n.dev.qp_info(qb).unwrap().state, mlx5_sim::QpState::Rtr);
    assert_eq!(n.bytes(0x20000, 5), [0; 5], "the refused write wrote nothing");
    n.drop_pair(cq, a, b);
    n.finish();
}

#[test]
fn query_qp_attr_returns_what_the_modifies_set_as_mlx5_ib_query_qp_decodes_it() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let o = RcOpts {
        rd_atomic: 3,
        path_mtu: Mtu::M2048,
        retry_cnt: 5,
        rnr_retry: 6,
        min_rnr_timer: 9,
        ..RcOpts::default()
    };
    let cq = n.cq(16);
    let attr = QpInitAttr { qp_type: QpType::Rc, cap: cap(8, 8), sq_sig_all: true };
    let mut a = n.hca.create_qp(&n.pd, &cq, &cq, attr, &mut n.d).unwrap();
    let reset = n.hca.query_qp_attr(&a, &mut n.d).unwrap();
    assert_eq!((reset.qp_state, reset.cur_qp_state, reset.path_mtu), (QpState::Reset, QpState::Reset, 0));
    let mut ah = n.ah_attr();
    if let Some(g) = ah.grh.as_mut() {
        g.hop_limit = 17;
        g.traffic_class = 0x28;
        g.flow_label = 0x5_4321;
    }
    n.connect_rc(&mut a, 0x4242, ah, &o);
    let q = n.hca.query_qp_attr(&a, &mut n.d).unwrap();
    assert_eq!(
        (q.qp_state, q.cur_qp_state, q.sq_draining, q.en_sqd_async_notify),
        (QpState::Rts, QpState::Rts, false, false)
    );
    assert_eq!(q.path_mtu, Mtu::M2048 as u8);
    assert_eq!(q.path_mig_state, mlx5_core::qp::MigState::Migrated);
    assert_eq!((q.dest_qp_num, q.rq_psn, q.sq_psn), (0x4242, 0, 0));
    assert_eq!(q.qp_access_flags, Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC);
    // log_sra_max / log_rra_max hold fls(3 - 1) = 2: verbs reads back 1 << 2.
    assert_eq!((q.max_rd_atomic, q.max_dest_rd_atomic), (4, 4));
    assert_eq!((q.min_rnr_timer, q.retry_cnt, q.rnr_retry, q.timeout), (9, 5, 6, 14));
    assert_eq!((q.port_num, q.pkey_index, q.qp_type, q.sq_sig_all), (1, 0, QpType::Rc, true));
    assert_eq!(q.cap, a.cap());
    // to_rdma_ah_attr: a RoCE path always has a GRH; the port is the path's.
    assert_eq!((q.ah_attr.port_num, q.ah_attr.grh), (1, ah.grh));
    assert_eq!(q.ah_attr.dmac, ah.dmac);
    n.hca.destroy_qp(a, &mut n.d).map_err(|e| e.error).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).unwrap();
    n.finish();
}

#[test]
fn query_qp_attr_of_uc_and_ud_qps() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let (cq, a, b) = uc_pair(&mut n);
    let q = n.hca.query_qp_attr(&a, &mut n.d).unwrap();
    assert_eq!(
        (q.qp_type, q.qp_state, q.dest_qp_num, q.rq_psn, q.sq_psn),
        (QpType::Uc, QpState::Rts, b.qpn(), 0x100, 0x100)
    );
    // UC takes remote write only; it has no responder resources.
    assert_eq!((q.qp_access_flags, q.max_dest_rd_atomic, q.path_mtu), (Access::REMOTE_WRITE, 1, Mtu::M1024 as u8));
    assert!(q.ah_attr.grh.is_some());
    n.drop_pair(cq, a, b);
    let cq = n.cq(4);
    let mut u = n.qp(QpType::Ud, &cq, cap(4, 4), false);
    let m = required_attrs(QpType::Ud, QpState::Reset, QpState::Init).unwrap();
    n.hca
        .modify_qp(&mut u, &QpAttr { qp_state: QpState::Init, qkey: 0x1111_2222, ..QpAttr::default() }, m, &mut n.d)
        .unwrap();
    let q = n.hca.query_qp_attr(&u, &mut n.d).unwrap();
    // A UD QP has no address path: to_rdma_ah_attr is not run for it.
    assert_eq!((q.qp_state, q.qkey, q.ah_attr, q.port_num), (QpState::Init, 0x1111_2222, AhAttr::default(), 1));
    n.hca.destroy_qp(u, &mut n.d).map_err(|e| e.error).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).unwrap();
    n.finish();
}

#[test]
fn completions_carry_the_device_clock_of_their_cqe() {
    // rdma-core's mlx5_cq_read_wc_completion_ts returns the CQE's raw timestamp; the simulator stamps every CQE
    // with its virtual time in ticks of device_frequency_khz.
    let mut n = Node::new(SimConfig::default(), MEM);
    let khz = u64::from(n.hca.caps().general.device_frequency_khz);
    assert!(khz > 0);
    let (mut cq, mut a, mut b) = uc_pair(&mut n);
    let s = [n.sge(0, 8)];
    let mut stamps = Vec::new();
    for id in 0..2 {
        n.hca.post_send(&mut a, &[send_wr(id, SendOp::Send, &s)]).ok();
        let r = [n.sge(0x1000, 64)];
        n.hca.post_recv(&mut b, &[RecvWr { wr_id: 100 + id, sg_list: &r }]).unwrap();
        n.hca.post_send(&mut a, &[send_wr(id + 10, SendOp::Send, &s)]).unwrap();
        let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 3);
        let recv = wcs.iter().find(|w| w.wr_id == 100 + id).unwrap();
        stamps.push(recv.timestamp);
        // One millisecond of device time between the two rounds.
        n.dev.advance_ns(1_000_000);
    }
    assert_eq!(stamps[1] - stamps[0], khz, "one millisecond is device_frequency_khz ticks");
    n.drop_pair(cq, a, b);
    n.finish();
}

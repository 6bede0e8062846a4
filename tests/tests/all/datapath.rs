//! The datapath end to end: RC and UD queue pairs of the core over the simulated device (loopback and a wire
//! between two devices), every operation, ring wrap, failures and flushes, exactly-once completions, and the
//! mechanical order of the send doorbell.

use std::collections::BTreeMap;

use mlx5_core::cq::{Cq, LinkLayer, WcFlags, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::Dma;
use mlx5_core::hca::{Config, Error, Hca};
use mlx5_core::hca::{CqAttr, QpInitAttr};
use mlx5_core::mkey::Access;
use mlx5_core::qp::{
    Ah, AhAttr, Grh, PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr,
    Sge, UdDest,
};
use mlx5_sim::testkit::{Node, RcOpts};
use mlx5_sim::{Mode, PortType, SimConfig, SimDevice};

const MEM: usize = 1 << 20;

/// RESET → INIT → RTR → RTS for an RC QP towards `dest` at `ah` (the kit's defaults, with these retry counts).
fn rc_connect(n: &mut Node, qp: &mut Qp, dest: u32, ah: AhAttr, rnr_retry: u8, retry_cnt: u8) {
    n.connect_rc(qp, dest, ah, &RcOpts { rnr_retry, retry_cnt, ..RcOpts::default() });
}

fn ud_ready(n: &mut Node, qp: &mut Qp, qkey: u32) {
    use QpAttrMask as M;
    let a = QpAttr { qkey, ..QpAttr::default() };
    n.hca
        .modify_qp(qp, &QpAttr { qp_state: QpState::Init, ..a }, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY, &mut n.d)
        .unwrap();
    n.hca.modify_qp(qp, &QpAttr { qp_state: QpState::Rtr, ..a }, M::STATE, &mut n.d).unwrap();
    n.hca.modify_qp(qp, &QpAttr { qp_state: QpState::Rts, ..a }, M::STATE | M::SQ_PSN, &mut n.d).unwrap();
}

/// Polls until `want` completions arrived (bounded), routing them to the QPs on the CQ.
fn poll_n(n: &Node, cq: &mut Cq, qps: &mut [&mut Qp], want: usize) -> Vec<WorkCompletion> {
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    for _ in 0..100_000 {
        let k = cq.poll(n.hca.mmio(), qps, &mut wc).unwrap();
        got.extend_from_slice(&wc[..k]);
        if got.len() >= want {
            break;
        }
        if k == 0 {
            // Lets a threaded device (and RNR timers) make progress in virtual time.
            embedded_hal::delay::DelayNs::delay_us(&mut n.dev.delay(), 10);
        }
    }
    assert_eq!(got.len(), want, "completions: {got:?}");
    got
}

fn send(wr_id: u64, sge: &[Sge], flags: SendFlags) -> SendWr<'_> {
    SendWr { wr_id, op: SendOp::Send, sg_list: sge, flags: flags | SendFlags::SIGNALED, inline: None, ud: None }
}

fn rc_pair(n: &mut Node, cap: QpCap) -> (Cq, Qp, Qp) {
    n.rc_pair(cap, 1023, &RcOpts::default())
}

fn cap(wr: u32, sge: u32, inline: u32) -> QpCap {
    QpCap { max_send_wr: wr, max_recv_wr: wr, max_send_sge: sge, max_recv_sge: sge, max_inline_data: inline }
}

fn teardown_pair(n: &mut Node, cq: Cq, a: Qp, b: Qp) {
    n.hca.destroy_qp(a, &mut n.d).unwrap();
    n.hca.destroy_qp(b, &mut n.d).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).unwrap();
}

#[test]
fn rc_pingpong_both_ways_with_verified_data() {
    for (port_type, mode) in
        [(PortType::Eth, Mode::Inline), (PortType::Ib, Mode::Inline), (PortType::Eth, Mode::Threaded)]
    {
        let mut n = Node::new(SimConfig { port_type, mode, ..SimConfig::default() }, MEM);
        let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(16, 2, 0));
        let size = 3000usize;
        let iters = 300u64;
        for i in 0..iters {
            let msg: Vec<u8> = (0..size).map(|k| (k as u64 * 7 + i) as u8).collect();
            n.put(0, &msg);
            // Two receive SGEs on b, one send SGE on a.
            let rsge = [n.sge(0x10000, 1000), n.sge(0x20000, 4000)];
            n.hca.post_recv(&mut b, &[RecvWr { wr_id: 1000 + i, sg_list: &rsge }]).unwrap();
            n.hca.post_send(&mut a, &[send(i, &[n.sge(0, size as u32)], SendFlags::default())]).unwrap();
            let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
            let mut by_id: BTreeMap<u64, WorkCompletion> = wcs.iter().map(|w| (w.wr_id, *w)).collect();
            let s = by_id.remove(&i).unwrap();
            let r = by_id.remove(&(1000 + i)).unwrap();
            assert_eq!((s.status, s.opcode, s.qp_num), (WcStatus::Success, WcOpcode::Send, a.qpn()));
            assert_eq!(
                (r.status, r.opcode, r.byte_len, r.qp_num, r.src_qp),
                (WcStatus::Success, WcOpcode::Recv, size as u32, b.qpn(), a.qpn())
            );
            let mut got = n.bytes(0x10000, 1000);
            got.extend(n.bytes(0x20000, size - 1000));
            assert_eq!(got, msg, "iteration {i}");
            // And back: b answers from where it received.
            let rsge = [n.sge(0x30000, size as u32)];
            n.hca.post_recv(&mut a, &[RecvWr { wr_id: 2000 + i, sg_list: &rsge }]).unwrap();
            n.hca
                .post_send(
                    &mut b,
                    &[send(
                        3000 + i,
                        &[n.sge(0x10000, 1000), n.sge(0x20000, (size - 1000) as u32)],
                        SendFlags::default(),
                    )],
                )
                .unwrap();
            let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
            assert!(wcs.iter().all(|w| w.status == WcStatus::Success));
            assert_eq!(n.bytes(0x30000, size), msg);
        }
        assert_eq!((a.sq_outstanding(), a.rq_outstanding(), b.sq_outstanding(), b.rq_outstanding()), (0, 0, 0, 0));
        teardown_pair(&mut n, cq, a, b);
        n.finish();
    }
}

#[test]
fn rdma_write_read_immediate_and_atomics() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(16, 1, 0));
    let rkey = n.mr.rkey;
    let data: Vec<u8> = (0..5000u32).map(|k| (k * 13) as u8).collect();
    n.put(0, &data);
    // RDMA WRITE: no receive consumed, data lands at the remote address.
    let sge = [n.sge(0, 5000)];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite { remote_addr: n.addr(0x40000), rkey },
        sg_list: &sge,
        flags: SendFlags::SIGNALED,
        inline: None,
        ud: None,
    };
    n.hca.post_send(&mut a, &[wr]).unwrap();
    let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
    assert_eq!((w.wr_id, w.opcode, w.status), (1, WcOpcode::RdmaWrite, WcStatus::Success));
    assert_eq!(n.bytes(0x40000, 5000), data);
    // RDMA WRITE with immediate consumes a receive and carries the immediate.
    let rsge = [n.sge(0x50000, 16)];
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 77, sg_list: &rsge }]).unwrap();
    let sge = [n.sge(0, 100)];
    let wr = SendWr {
        wr_id: 2,
        op: SendOp::RdmaWriteImm { remote_addr: n.addr(0x60000), rkey, imm: 0xfeed_f00d },
        sg_list: &sge,
        flags: SendFlags::SIGNALED,
        inline: None,
        ud: None,
    };
    n.hca.post_send(&mut a, &[wr]).unwrap();
    let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
    let r = wcs.iter().find(|w| w.wr_id == 77).unwrap();
    assert_eq!((r.opcode, r.imm_data, r.byte_len), (WcOpcode::RecvRdmaWithImm, 0xfeed_f00d, 100));
    assert!(r.wc_flags.contains(WcFlags::WITH_IMM));
    assert_eq!(n.bytes(0x60000, 100), data[..100]);
    // RDMA READ brings remote bytes back.
    n.put(0x70000, &data[1000..3000]);
    let sge = [n.sge(0x80000, 2000)];
    let wr = SendWr {
        wr_id: 3,
        op: SendOp::RdmaRead { remote_addr: n.addr(0x70000), rkey },
        sg_list: &sge,
        flags: SendFlags::SIGNALED,
        inline: None,
        ud: None,
    };
    n.hca.post_send(&mut a, &[wr]).unwrap();
    let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
    assert_eq!((w.opcode, w.byte_len), (WcOpcode::RdmaRead, 2000));
    assert_eq!(n.bytes(0x80000, 2000), data[1000..3000]);
    // Atomics: 64-bit words in host order, the old value returned in host order: the bring-up sets host
    // endianness (`atomic_req_8B_endianness_mode`), as Linux does, so programs read them as numbers (issue 29:
    // qperf's ver_rc_fetch_add saw 1 as 0x0100000000000000 when the simulator kept them big-endian).
    n.put(0x90000, &100u64.to_ne_bytes());
    let sge = [n.sge(0x90100, 8)];
    let wr = SendWr {
        wr_id: 4,
        op: SendOp::AtomicFetchAdd { remote_addr: n.addr(0x90000), rkey, add: 23 },
        sg_list: &sge,
        flags: SendFlags::SIGNALED,
        inline: None,
        ud: None,
    };
    n.hca.post_send(&mut a, &[wr]).unwrap();
    let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
    assert_eq!((w.opcode, w.byte_len), (WcOpcode::FetchAdd, 8));
    assert_eq!(
        (n.bytes(0x90100, 8), n.bytes(0x90000, 8)),
        (100u64.to_ne_bytes().to_vec(), 123u64.to_ne_bytes().to_vec())
    );
    let cas = |compare, swap| SendOp::AtomicCmpSwp { remote_addr: n.addr(0x90000), rkey, compare, swap };
    let wrs = [
        SendWr { wr_id: 5, op: cas(1, 5), sg_list: &sge, flags: SendFlags::SIGNALED, inline: None, ud: None },
        SendWr { wr_id: 6, op: cas(123, 9), sg_list: &sge, flags: SendFlags::SIGNALED, inline: None, ud: None },
    ];
    n.hca.post_send(&mut a, &wrs[..1]).unwrap();
    poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1);
    assert_eq!(n.bytes(0x90000, 8), 123u64.to_ne_bytes(), "compare failed: unchanged");
    n.hca.post_send(&mut a, &wrs[1..]).unwrap();
    let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
    assert_eq!((w.opcode, w.status), (WcOpcode::CompSwap, WcStatus::Success));
    assert_eq!(
        (n.bytes(0x90000, 8), n.bytes(0x90100, 8)),
        (9u64.to_ne_bytes().to_vec(), 123u64.to_ne_bytes().to_vec())
    );
    teardown_pair(&mut n, cq, a, b);
    n.finish();
}

#[test]
fn inline_sends_and_post_errors() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(8, 2, 200));
    let granted = a.cap();
    assert!(granted.max_inline_data >= 200);
    // Inline: the bytes travel in the WQE; the source need not be registered memory (a plain Vec).
    let msg: Vec<u8> = (0..200u8).collect();
    let rsge = [n.sge(0x1000, 256)];
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 9, sg_list: &rsge }]).unwrap();
    n.hca.post_send(&mut a, &[SendWr { inline: Some(&msg), ..send(8, &[], SendFlags::default()) }]).unwrap();
    poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
    assert_eq!(n.bytes(0x1000, 200), msg);

    // Too much inline data, too many SGEs, a full queue: typed errors naming the first WR not posted.
    let big = vec![0u8; granted.max_inline_data as usize + 1];
    let e =
        n.hca.post_send(&mut a, &[SendWr { inline: Some(&big), ..send(1, &[], SendFlags::default()) }]).unwrap_err();
    assert_eq!((e.index, e.kind), (0, PostErrorKind::InlineTooLong { bytes: big.len(), max: granted.max_inline_data }));
    let many: Vec<Sge> = (0..=granted.max_send_sge).map(|k| n.sge(k as usize * 64, 8)).collect();
    let ok = [n.sge(0, 8)];
    let e = n
        .hca
        .post_send(&mut a, &[send(1, &ok, SendFlags::default()), send(2, &many, SendFlags::default())])
        .unwrap_err();
    assert_eq!(e.index, 1);
    assert!(matches!(e.kind, PostErrorKind::TooManySge { .. }));
    // The first of those two was posted: b has no receive, so give it one (RNR retries forever meanwhile).
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 10, sg_list: &rsge }]).unwrap();
    poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
    let e = n.hca.post_recv(&mut b, &[RecvWr { wr_id: 0, sg_list: &many }]).unwrap_err();
    assert!(matches!(e.kind, PostErrorKind::TooManySge { .. }));
    let rs: Vec<RecvWr> = (0..20).map(|i| RecvWr { wr_id: i, sg_list: &rsge }).collect();
    let e = n.hca.post_recv(&mut b, &rs).unwrap_err();
    assert_eq!(e.index, granted.max_recv_wr as usize);
    assert!(matches!(e.kind, PostErrorKind::QueueFull { .. }));
    assert_eq!(b.rq_outstanding(), granted.max_recv_wr);

    // A QP not in RTS takes no sends.
    let mut c = n.qp(QpType::Rc, &cq, cap(4, 1, 0), false);
    let e = n.hca.post_send(&mut c, &[send(1, &ok, SendFlags::default())]).unwrap_err();
    assert_eq!(e.kind, PostErrorKind::BadState { state: QpState::Reset });
    // Modify errors come before any command.
    let sent = n.dev.executed().len();
    let bad =
        n.hca.modify_qp(&mut c, &QpAttr { qp_state: QpState::Rts, ..QpAttr::default() }, QpAttrMask::STATE, &mut n.d);
    assert!(matches!(bad, Err(Error::Modify(_))));
    assert_eq!(n.dev.executed().len(), sent);
    n.hca.destroy_qp(c, &mut n.d).unwrap();
    // Flush what b still holds so teardown is clean.
    n.hca
        .modify_qp(&mut b, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE, &mut n.d)
        .unwrap();
    let flushed = poll_n(&n, &mut cq, &mut [&mut a, &mut b], granted.max_recv_wr as usize);
    assert!(flushed.iter().all(|w| w.status == WcStatus::WrFlushErr));
    teardown_pair(&mut n, cq, a, b);
    n.finish();
}

#[test]
fn unsignaled_sends_retire_with_the_next_signaled_one_across_ten_laps() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(16, 1, 0));
    let depth = a.cap().max_send_wr as u64;
    let total = 10 * depth + 3;
    let rsge = [n.sge(0x1000, 64)];
    let mut next_signaled = Vec::new();
    let mut posted = 0u64;
    let mut recv_done = 0u64;
    let mut send_ids = Vec::new();
    while posted < total {
        // Batches of 4 (one doorbell each), the last of every batch signaled.
        let k = 4.min(total - posted);
        let rws: Vec<RecvWr> = (0..k).map(|i| RecvWr { wr_id: 1_000_000 + posted + i, sg_list: &rsge }).collect();
        n.hca.post_recv(&mut b, &rws).unwrap();
        let ssge = [n.sge(0, 64)];
        let wrs: Vec<SendWr> = (0..k)
            .map(|i| SendWr {
                wr_id: posted + i,
                op: SendOp::Send,
                sg_list: &ssge,
                flags: if i + 1 == k { SendFlags::SIGNALED } else { SendFlags::default() },
                inline: None,
                ud: None,
            })
            .collect();
        n.hca.post_send(&mut a, &wrs).unwrap();
        next_signaled.push(posted + k - 1);
        posted += k;
        let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1 + k as usize);
        for w in wcs {
            assert_eq!(w.status, WcStatus::Success);
            if w.qp_num == a.qpn() {
                send_ids.push(w.wr_id);
            } else {
                assert_eq!(w.wr_id, 1_000_000 + recv_done);
                recv_done += 1;
            }
        }
        // The signaled completion retired every WQE before it.
        assert_eq!(a.sq_outstanding(), 0);
    }
    assert_eq!(send_ids, next_signaled);
    assert_eq!(recv_done, total);
    assert!(a.sq_cur_post() as u64 > 10 * depth, "wrapped the ring ten times");
    teardown_pair(&mut n, cq, a, b);
    n.finish();
}

#[test]
fn ud_with_grh_on_loopback_and_across_a_wire() {
    let mut n1 = Node::new(SimConfig::default(), MEM);
    let mut n2 = Node::new(SimConfig { mac: [0x02, 0, 0, 0, 0, 0x22], node_guid: 0x22, ..SimConfig::default() }, MEM);
    n1.dev.connect(&n2.dev);
    let qkey = 0x1111_2222;
    let mut cq1 = n1.cq(63);
    let mut cq2 = n2.cq(63);
    let mut u1 = n1.qp(QpType::Ud, &cq1, cap(8, 1, 0), true);
    let mut u1b = n1.qp(QpType::Ud, &cq1, cap(8, 1, 0), true);
    let mut u2 = n2.qp(QpType::Ud, &cq2, cap(8, 1, 0), true);
    ud_ready(&mut n1, &mut u1, qkey);
    ud_ready(&mut n1, &mut u1b, qkey);
    ud_ready(&mut n2, &mut u2, qkey);
    let msg = b"datagram over the wire".to_vec();
    n1.put(0, &msg);
    let sge = [n1.sge(0, msg.len() as u32)];
    // Loopback: u1 → u1b on the same device; the receive buffer gets the 40-byte GRH first.
    let rsge = [n1.sge(0x1000, 40 + 64)];
    n1.hca.post_recv(&mut u1b, &[RecvWr { wr_id: 5, sg_list: &rsge }]).unwrap();
    let ah_self = Ah::new(&n1.ah_attr(), LinkLayer::Ethernet);
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::Send,
        sg_list: &sge,
        flags: SendFlags::default(),
        inline: None,
        ud: Some(UdDest { ah: &ah_self, remote_qpn: u1b.qpn(), remote_qkey: qkey }),
    };
    n1.hca.post_send(&mut u1, &[wr]).unwrap();
    let wcs = poll_n(&n1, &mut cq1, &mut [&mut u1, &mut u1b], 2);
    let r = wcs.iter().find(|w| w.wr_id == 5).unwrap();
    assert_eq!((r.byte_len, r.src_qp), (40 + msg.len() as u32, u1.qpn()));
    assert!(r.wc_flags.contains(WcFlags::GRH));
    assert_eq!(n1.bytes(0x1000 + 40, msg.len()), msg);
    // Over the wire to the second device.
    let rsge2 = [n2.sge(0x1000, 40 + 64)];
    n2.hca.post_recv(&mut u2, &[RecvWr { wr_id: 6, sg_list: &rsge2 }]).unwrap();
    let ah2 = Ah::new(&n2.ah_attr(), LinkLayer::Ethernet);
    let wr = SendWr {
        wr_id: 2,
        op: SendOp::Send,
        sg_list: &sge,
        flags: SendFlags::default(),
        inline: None,
        ud: Some(UdDest { ah: &ah2, remote_qpn: u2.qpn(), remote_qkey: qkey }),
    };
    n1.hca.post_send(&mut u1, &[wr]).unwrap();
    assert_eq!(poll_n(&n1, &mut cq1, &mut [&mut u1, &mut u1b], 1)[0].wr_id, 2);
    let r = poll_n(&n2, &mut cq2, &mut [&mut u2], 1)[0];
    assert_eq!((r.wr_id, r.src_qp, r.status), (6, u1.qpn(), WcStatus::Success));
    assert_eq!(n2.bytes(0x1000 + 40, msg.len()), msg);
    // A wrong Q_Key is dropped: the sender completes, nothing arrives.
    n2.hca.post_recv(&mut u2, &[RecvWr { wr_id: 7, sg_list: &rsge2 }]).unwrap();
    let wr = SendWr {
        wr_id: 3,
        op: SendOp::Send,
        sg_list: &sge,
        flags: SendFlags::default(),
        inline: None,
        ud: Some(UdDest { ah: &ah2, remote_qpn: u2.qpn(), remote_qkey: 1 }),
    };
    n1.hca.post_send(&mut u1, &[wr]).unwrap();
    assert_eq!(poll_n(&n1, &mut cq1, &mut [&mut u1, &mut u1b], 1)[0].status, WcStatus::Success);
    assert_eq!(cq2.poll(n2.hca.mmio(), &mut u2, &mut [WorkCompletion::default(); 2]).unwrap(), 0);
    n2.hca
        .modify_qp(&mut u2, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE, &mut n2.d)
        .unwrap();
    assert_eq!(poll_n(&n2, &mut cq2, &mut [&mut u2], 1)[0].status, WcStatus::WrFlushErr);
    for q in [u1, u1b] {
        n1.hca.destroy_qp(q, &mut n1.d).unwrap();
    }
    n2.hca.destroy_qp(u2, &mut n2.d).unwrap();
    n1.hca.destroy_cq(cq1, &mut n1.d).unwrap();
    n2.hca.destroy_cq(cq2, &mut n2.d).unwrap();
    n1.finish();
    n2.finish();
}

/// One errored pair: the failing WR's status, then every outstanding and later WR flushed, each exactly once.
#[test]
fn failures_report_their_status_and_flush_the_rest_exactly_once() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let ah = n.ah_attr();
    let rkey = n.mr.rkey;
    let mut cases = 0;
    for kind in ["rnr", "remote_access", "local_length", "local_prot", "retry"] {
        let mut cq = n.cq(255);
        let mut a = n.qp(QpType::Rc, &cq, cap(8, 1, 0), false);
        let mut b = n.qp(QpType::Rc, &cq, cap(8, 1, 0), false);
        let (qa, qb) = (a.qpn(), b.qpn());
        // RNR: no retries left; retry: the peer QP does not exist.
        let dest = if kind == "retry" { 0xfffff } else { qb };
        rc_connect(&mut n, &mut a, dest, ah, 0, 2);
        rc_connect(&mut n, &mut b, qa, ah, 7, 7);
        let ok = [n.sge(0, 64)];
        let small = [n.sge(0x1000, 8)];
        let bad_lkey = [Sge { lkey: n.mr.lkey ^ 0x100, ..n.sge(0, 64) }];
        if kind == "local_length" {
            n.hca.post_recv(&mut b, &[RecvWr { wr_id: 100, sg_list: &small }]).unwrap();
        }
        let first = match kind {
            "remote_access" => SendWr {
                wr_id: 1,
                op: SendOp::RdmaWrite { remote_addr: n.addr(0), rkey: rkey ^ 0xff00 },
                sg_list: &ok,
                flags: SendFlags::default(),
                inline: None,
                ud: None,
            },
            "local_prot" => SendWr {
                wr_id: 1,
                op: SendOp::Send,
                sg_list: &bad_lkey,
                flags: SendFlags::default(),
                inline: None,
                ud: None,
            },
            _ => {
                SendWr { wr_id: 1, op: SendOp::Send, sg_list: &ok, flags: SendFlags::default(), inline: None, ud: None }
            }
        };
        // The failing WR is unsignaled: errors complete anyway. Two more follow and get flushed.
        let wrs = [
            first,
            send(2, &ok, SendFlags::default()),
            SendWr { wr_id: 3, flags: SendFlags::default(), ..send(3, &ok, SendFlags::default()) },
        ];
        n.hca.post_send(&mut a, &wrs).unwrap();
        let want_a = [
            match kind {
                "rnr" => WcStatus::RnrRetryExcErr,
                "remote_access" => WcStatus::RemAccessErr,
                "local_length" => WcStatus::RemInvReqErr,
                "local_prot" => WcStatus::LocProtErr,
                _ => WcStatus::RetryExcErr,
            },
            WcStatus::WrFlushErr,
            WcStatus::WrFlushErr,
        ];
        let expect_b = usize::from(kind == "local_length");
        let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 3 + expect_b);
        let of_a: Vec<(u64, WcStatus)> = wcs.iter().filter(|w| w.qp_num == qa).map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(of_a, vec![(1, want_a[0]), (2, want_a[1]), (3, want_a[2])], "{kind}");
        if kind == "local_length" {
            let r = wcs.iter().find(|w| w.qp_num == qb).unwrap();
            assert_eq!((r.wr_id, r.status), (100, WcStatus::LocLenErr));
            assert_eq!(n.dev.qp_info(qb).unwrap().state, mlx5_sim::QpState::Err);
        }
        assert_eq!(n.dev.qp_info(qa).unwrap().state, mlx5_sim::QpState::Err, "{kind}");
        // The driver learns of the error only from completions, as verbs does: a later WR is accepted and the
        // device flushes it, exactly once.
        n.hca.post_send(&mut a, &[send(4, &ok, SendFlags::default())]).unwrap();
        let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
        assert_eq!((w.wr_id, w.status), (4, WcStatus::WrFlushErr), "{kind}");
        // Moved to ERR by the caller too, a send is accepted and flushed (IBA 10.8.2; the verbs issue's rule).
        n.hca
            .modify_qp(&mut a, &QpAttr { qp_state: QpState::Err, ..QpAttr::default() }, QpAttrMask::STATE, &mut n.d)
            .unwrap();
        n.hca.post_send(&mut a, &[send(5, &ok, SendFlags::default())]).unwrap();
        let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
        assert_eq!((w.wr_id, w.status), (5, WcStatus::WrFlushErr), "{kind}");
        assert_eq!(a.sq_outstanding(), 0);
        let mut extra = [WorkCompletion::default(); 8];
        assert_eq!(cq.poll(n.hca.mmio(), &mut [&mut a, &mut b][..], &mut extra).unwrap(), 0, "{kind}: nothing twice");
        teardown_pair(&mut n, cq, a, b);
        cases += 1;
    }
    assert_eq!(cases, 5);
    n.finish();
}

#[test]
fn the_send_doorbell_is_ordered_and_blueflame_copies_match() {
    use mlx5_sim::testkit::mocks::{BarrierKind, MmioAccess, RecordingMmio};
    let dev = SimDevice::default();
    let rec = RecordingMmio::new(dev.mmio());
    let mut d = dev.delay();
    let mut hca: Hca<&RecordingMmio<mlx5_sim::SimMmio>, mlx5_sim::SimDma> =
        Hca::bring_up(&rec, dev.dma(), (), &mut d, Config::default()).unwrap();
    let pd = hca.alloc_pd(&mut d).unwrap();
    let mem = dev.dma().alloc(4096, 4096).unwrap();
    let mr = hca.reg_mr(&pd, mem.cpu().as_ptr(), 4096, Access::LOCAL_WRITE, &mut d).unwrap();
    let mut cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let attr = QpInitAttr { qp_type: QpType::Rc, cap: cap(8, 4, 0), sq_sig_all: true };
    let mut a = hca.create_qp(&pd, &cq, &cq, attr, &mut d).unwrap();
    let mut b = hca.create_qp(&pd, &cq, &cq, attr, &mut d).unwrap();
    let port = hca.query_port(&mut d).unwrap();
    let gid = hca.query_gid(0, &mut d).unwrap();
    let ah = AhAttr {
        dlid: port.lid,
        grh: Some(Grh { dgid: gid, hop_limit: 1, ..Grh::default() }),
        dmac: dev.config().mac,
        port_num: 1,
        ..AhAttr::default()
    };
    {
        use QpAttrMask as M;
        let (qa, qb) = (a.qpn(), b.qpn());
        for (q, dest) in [(&mut a, qb), (&mut b, qa)] {
            let at = QpAttr { dest_qp_num: dest, ah_attr: ah, ..QpAttr::default() };
            hca.modify_qp(
                q,
                &QpAttr { qp_state: QpState::Init, ..at },
                M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS,
                &mut d,
            )
            .unwrap();
            hca.modify_qp(
                q,
                &QpAttr { qp_state: QpState::Rtr, ..at },
                M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
                &mut d,
            )
            .unwrap();
            hca.modify_qp(
                q,
                &QpAttr { qp_state: QpState::Rts, ..at },
                M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
                &mut d,
            )
            .unwrap();
        }
    }
    let sge = [Sge { addr: mem.cpu().as_ptr() as u64, length: 64, lkey: mr.lkey }];
    let uar = hca.uar_page().unwrap();
    let bf0 = uar.bfreg(0).unwrap();
    for (round, n_wr) in [(0, 1usize), (1, 3), (2, 1)] {
        let rws: Vec<RecvWr> = (0..n_wr).map(|i| RecvWr { wr_id: i as u64, sg_list: &sge }).collect();
        hca.post_recv(&mut b, &rws).unwrap();
        let start = rec.log().len();
        let pi_before = a.sq_cur_post();
        let wrs: Vec<SendWr> = (0..n_wr).map(|i| send(i as u64, &sge, SendFlags::default())).collect();
        hca.post_send(&mut a, &wrs).unwrap();
        let log = rec.log()[start..].to_vec();
        // The doorbell record already holds the new producer counter, and the WQE bytes are in memory.
        assert_eq!(a.dbrec().read_be32(1), a.sq_cur_post() & 0xffff);
        let db_off = bf0.offset + (round % 2) * bf0.buf_size;
        let mut first_wqe = [0u8; 64];
        a.read_sq(pi_before + (n_wr as u32 - 1), &mut first_wqe);
        let ctrl8 = u64::from_be_bytes(first_wqe[..8].try_into().unwrap());
        let mut expect = vec![MmioAccess::Barrier(BarrierKind::DmaWmb), MmioAccess::Barrier(BarrierKind::WcStart)];
        if n_wr == 1 {
            // One small WQE: BlueFlame copies all 64 bytes into the alternating buffer.
            for w in 0..8 {
                let v = u64::from_be_bytes(first_wqe[w * 8..w * 8 + 8].try_into().unwrap());
                expect.push(MmioAccess::Write64 { off: db_off + w * 8, val: v });
            }
        } else {
            // Several WQEs: one 8-byte doorbell of the last WQE's control segment.
            expect.push(MmioAccess::Write64 { off: db_off, val: ctrl8 });
        }
        expect.push(MmioAccess::Barrier(BarrierKind::WcFlush));
        assert_eq!(log, expect, "round {round}");
        let mut wc = [WorkCompletion::default(); 8];
        let mut got = 0;
        for _ in 0..1000 {
            got += cq.poll(hca.mmio(), &mut [&mut a, &mut b][..], &mut wc).unwrap();
            if got == 2 * n_wr {
                break;
            }
        }
        assert_eq!(got, 2 * n_wr);
    }
    assert!(!dev
        .events()
        .iter()
        .any(|e| matches!(e, mlx5_sim::SimEvent::BlueFlameMismatch { .. } | mlx5_sim::SimEvent::BadSqDoorbell { .. })));
    hca.destroy_qp(a, &mut d).unwrap();
    hca.destroy_qp(b, &mut d).unwrap();
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.dereg_mr(mr, &mut d).unwrap();
    hca.dealloc_pd(pd, &mut d).unwrap();
    // SAFETY: the key over it is gone.
    unsafe { dev.dma().free(mem) };
    hca.teardown(&mut d).unwrap();
}

/// The golden send WQE (`wqe_rdma_write_signaled`, re-encoded with the kernel's macros) as the driver builds it at
/// producer index 5: byte for byte, with the QP number the simulated firmware assigned in place of the vector's.
#[test]
fn rdma_write_wqe_matches_the_golden_vector() {
    let v: serde_json::Value = serde_json::from_str(include_str!("../../vectors/vectors.json")).unwrap();
    let vec = v["vectors"].as_array().unwrap().iter().find(|x| x["name"] == "wqe_rdma_write_signaled").unwrap();
    let mut golden = mlx5_tests::unhex(vec["hex"].as_str().unwrap());
    let mut n = Node::new(SimConfig::default(), MEM);
    let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(16, 1, 0));
    // Five one-block sends first, so the WQE lands at index 5.
    let sge = [n.sge(0, 16)];
    for i in 0..5 {
        n.hca.post_recv(&mut b, &[RecvWr { wr_id: i, sg_list: &sge }]).unwrap();
        n.hca.post_send(&mut a, &[send(i, &sge, SendFlags::default())]).unwrap();
    }
    poll_n(&n, &mut cq, &mut [&mut a, &mut b], 10);
    assert_eq!(a.sq_cur_post(), 5);
    let data = [Sge { addr: 0x7f00_0000_1000, length: 256, lkey: 0x5678 }];
    let wr = SendWr {
        wr_id: 99,
        op: SendOp::RdmaWrite { remote_addr: 0x7f00_0000_2000, rkey: 0x1234 },
        sg_list: &data,
        flags: SendFlags::SIGNALED,
        inline: None,
        ud: None,
    };
    n.hca.post_send(&mut a, &[wr]).unwrap();
    let mut wqe = vec![0u8; golden.len()];
    a.read_sq(5, &mut wqe);
    // qpn_ds: the vector's QP 0x123 becomes this QP's number.
    golden[4..7].copy_from_slice(&a.qpn().to_be_bytes()[1..]);
    assert_eq!(mlx5_tests::hex(&wqe), mlx5_tests::hex(&golden));
    // The device finds no such local key and says so.
    let w = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1)[0];
    assert_eq!((w.wr_id, w.status), (99, WcStatus::LocProtErr));
    teardown_pair(&mut n, cq, a, b);
    n.finish();
}

/// The port's Q counter set (ALLOC_Q_COUNTER at bring-up, named by every QP in RST2INIT) counts what the
/// responder saw: one SEND that found no receive WQE (out_of_buffer), one RDMA WRITE, one RDMA READ. Reading with
/// `clear` zeroes it, as `rdma statistic` with a reset would.
#[test]
fn the_port_q_counter_counts_what_the_responder_executed() {
    let mut n = Node::new(SimConfig::default(), MEM);
    assert!(n.hca.q_counter().is_some());
    let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(8, 1, 0));
    let (addr, rkey) = (n.addr(0x2000), n.mr.rkey);
    let ok = [n.sge(0, 64)];
    // The SEND arrives before its receive: RNR NAK (counted), then delivered once the receive is posted.
    n.hca.post_send(&mut a, &[send(1, &ok, SendFlags::default())]).unwrap();
    embedded_hal::delay::DelayNs::delay_us(&mut n.dev.delay(), 10);
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 10, sg_list: &[n.sge(0x1000, 64)] }]).unwrap();
    let wr = |wr_id, op| SendWr { wr_id, op, sg_list: &ok, flags: SendFlags::SIGNALED, inline: None, ud: None };
    n.hca.post_send(&mut a, &[wr(2, SendOp::RdmaWrite { remote_addr: addr, rkey })]).unwrap();
    n.hca.post_send(&mut a, &[wr(3, SendOp::RdmaRead { remote_addr: addr, rkey })]).unwrap();
    let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 4);
    assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
    let c = n.hca.query_q_counters(true, &mut n.d).unwrap().expect("a counter set");
    assert!(c.out_of_buffer >= 1, "{c:?}");
    assert_eq!((c.rx_write_requests, c.rx_read_requests, c.rx_atomic_requests), (1, 1, 0));
    let c = n.hca.query_q_counters(false, &mut n.d).unwrap().unwrap();
    assert_eq!(c, Default::default(), "cleared by the previous read");
    // Firmware keeps a set its QPs name: DEALLOC_Q_COUNTER is refused while they exist.
    let id = n.hca.q_counter().unwrap();
    let e = n.hca.exec(&mut mlx5_core::qcounter::dealloc_q_counter(id), &mut n.d).unwrap_err();
    let Error::Cmd(mlx5_core::cmdq::CmdError::Status { status, syndrome, .. }) = e else { panic!("{e}") };
    assert_eq!((status, syndrome), (mlx5_core::prm::CmdStatus::BadResState, mlx5_sim::syndrome::IN_USE));
    n.drop_pair(cq, a, b);
    n.finish();
}

/// A zero-length receive SGE is skipped, as rdma-core's `mlx5_post_recv` skips it (to the device a byte count of
/// 0 means 2 GiB): the message lands in the next entry.
#[test]
fn a_zero_length_receive_entry_is_skipped() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(4, 2, 0));
    n.put(0, &[0x5a; 64]);
    let sg = [n.sge(0x1000, 0), n.sge(0x2000, 64)];
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 7, sg_list: &sg }]).unwrap();
    n.hca.post_send(&mut a, &[send(1, &[n.sge(0, 64)], SendFlags::default())]).unwrap();
    let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
    let r = wcs.iter().find(|w| w.wr_id == 7).unwrap();
    assert_eq!((r.status, r.byte_len), (WcStatus::Success, 64));
    assert_eq!(n.bytes(0x2000, 64), vec![0x5a; 64]);
    assert_eq!(n.bytes(0x1000, 4), vec![0; 4], "nothing written at the skipped entry");
    n.drop_pair(cq, a, b);
    n.finish();
}

/// UD over RoCE v2 through the core and the simulated device: `wc.sl` carries the packet type as rdma-core's mlx5
/// reports it (bit 3 UDP, bits 2:0 the L3 header: 2 IPv4, 1 IPv6), so a consumer knows where the IP header sits in
/// the GRH room (UCX's ud_verbs drops every datagram whose type it cannot tell). It was 0 on Ethernet.
#[test]
fn ud_over_roce_v2_reports_the_packet_type_as_the_sl() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let qkey = 0x1111_2222;
    let mut cq = n.cq(63);
    let mut a = n.qp(QpType::Ud, &cq, cap(8, 1, 0), true);
    let mut b = n.qp(QpType::Ud, &cq, cap(8, 1, 0), true);
    ud_ready(&mut n, &mut a, qkey);
    ud_ready(&mut n, &mut b, qkey);
    n.put(0, b"which header?");
    let sge = [n.sge(0, 13)];
    // Index 1: the link-local GID as RoCE v2 (IPv6); index 3: the host's IPv4 address as RoCE v2.
    let (v6, _) = n.hca.query_gid_ex(1, &mut n.d).unwrap();
    let (v4, _) = n.hca.query_gid_ex(3, &mut n.d).unwrap();
    for (wr_id, sgid_index, dgid, sl) in [(1u64, 1u8, v6, 0x9u8), (2, 3, v4, 0xa)] {
        let rsge = [n.sge(0x1000, 40 + 64)];
        n.hca.post_recv(&mut b, &[RecvWr { wr_id: 100 + wr_id, sg_list: &rsge }]).unwrap();
        let mut attr = n.ah_attr();
        attr.grh = Some(Grh { dgid, sgid_index, hop_limit: 64, ..Grh::default() });
        let ah = Ah::new(&attr, LinkLayer::Ethernet);
        let wr = SendWr {
            wr_id,
            op: SendOp::Send,
            sg_list: &sge,
            flags: SendFlags::default(),
            inline: None,
            ud: Some(UdDest { ah: &ah, remote_qpn: b.qpn(), remote_qkey: qkey }),
        };
        n.hca.post_send(&mut a, &[wr]).unwrap();
        let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 2);
        let r = wcs.iter().find(|w| w.wr_id == 100 + wr_id).unwrap();
        assert_eq!((r.status, r.src_qp, r.sl, r.sl & 7), (WcStatus::Success, a.qpn(), sl, sl & 7), "sgid {sgid_index}");
        assert!(r.wc_flags.contains(WcFlags::GRH));
        if sl & 7 == 2 {
            // The IPv4 header is the last 20 bytes of the GRH room.
            assert_eq!(n.bytes(0x1000 + 20, 1), [0x45]);
        }
    }
    n.hca.destroy_qp(a, &mut n.d).unwrap();
    n.hca.destroy_qp(b, &mut n.d).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).unwrap();
    n.finish();
}

/// An SGE length with bit 31 set is posted as is (as rdma-core's `set_data_ptr_seg` writes it); in the data
/// segment that bit is the inline flag, and the device completes the WQE with a local length error and moves the
/// QP to ERR, where it used to send nothing and report success.
#[test]
fn an_sge_length_with_bit_31_set_is_a_local_length_error() {
    for lens in [&[0x8000_0000u32][..], &[0x8000_0001], &[0xffff_ffff], &[8, 0x8000_0001], &[0x8000_0004, 8]] {
        let mut n = Node::new(SimConfig::default(), MEM);
        let (mut cq, mut a, mut b) = rc_pair(&mut n, cap(8, 2, 0));
        let rsge = [n.sge(0x1000, 64)];
        n.hca.post_recv(&mut b, &[RecvWr { wr_id: 9, sg_list: &rsge }]).unwrap();
        let sges: Vec<Sge> = lens.iter().map(|&l| Sge { length: l, ..n.sge(0, 8) }).collect();
        n.hca.post_send(&mut a, &[send(1, &sges, SendFlags::default())]).expect("posted as is");
        let wcs = poll_n(&n, &mut cq, &mut [&mut a, &mut b], 1);
        assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::LocLenErr), "{lens:x?}");
        // The device moved the QP to ERR with that syndrome.
        let info = n.dev.qp_info(a.qpn()).unwrap();
        let len_err = Some(mlx5_core::prm::consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        assert_eq!((info.state, info.error), (mlx5_sim::QpState::Err, len_err), "{lens:x?}");
        teardown_pair(&mut n, cq, a, b);
        n.finish();
    }
}

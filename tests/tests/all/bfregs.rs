//! BlueFlame registers per QP (`mlx5_core::uar::BfregPool`): every QP gets a register of its own, on a new UAR
//! page once the pages held are full; a shared register (8-byte doorbells, no alternation) only when firmware has
//! no UAR left. Checked against the simulator, which refuses a doorbell on a page other than the QP's.

use std::collections::BTreeSet;

use mlx5_core::cq::{Cq, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::qp::{Qp, QpCap, QpType, RecvWr, SendFlags, SendOp, SendWr};
use mlx5_core::uar::BFREGS_PER_UAR;
use mlx5_sim::testkit::{Node, RcOpts};
use mlx5_sim::{SimConfig, SimEvent};

const CAP: QpCap = QpCap { max_send_wr: 64, max_recv_wr: 64, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

/// One SEND from `a` to `b` (a single WQE: BlueFlame on a dedicated register), received and completed.
fn one_send(n: &mut Node, cq: &mut mlx5_core::cq::Cq, a: &mut Qp, b: &mut Qp) {
    let sge = [n.sge(0, 64)];
    let rsge = [n.sge(4096, 64)];
    b.post_recv(n.hca.mmio(), &[RecvWr { wr_id: 7, sg_list: &rsge }]).unwrap();
    let wr = SendWr { wr_id: 9, op: SendOp::Send, sg_list: &sge, flags: SendFlags::SIGNALED, inline: None, ud: None };
    a.post_send(n.hca.mmio(), &[wr]).unwrap();
    let mut got = Vec::new();
    let mut wc = [WorkCompletion::default(); 4];
    for _ in 0..10_000 {
        let k = cq.poll(n.hca.mmio(), &mut [&mut *a, &mut *b][..], &mut wc).unwrap();
        got.extend_from_slice(&wc[..k]);
        if got.len() == 2 {
            break;
        }
    }
    let mut ops: Vec<_> = got.iter().map(|w| (w.opcode, w.status, w.wr_id)).collect();
    ops.sort_by_key(|o| o.2);
    assert_eq!(ops, [(WcOpcode::Recv, WcStatus::Success, 7), (WcOpcode::Send, WcStatus::Success, 9)]);
}

#[test]
fn each_qp_gets_its_own_register_and_new_pages_come_on_demand() {
    let mut n = Node::new(SimConfig::default(), 1 << 20);
    let first_page = n.hca.uar().expect("bring-up UAR");
    let mut pairs: Vec<_> = (0..3).map(|_| n.rc_pair(CAP, 63, &RcOpts::default())).collect();
    let regs: Vec<_> = pairs.iter().flat_map(|(_, a, b)| [*a.bfreg(), *b.bfreg()]).collect();
    let offsets: BTreeSet<_> = regs.iter().map(|r| r.offset).collect();
    assert_eq!(offsets.len(), 6, "six QPs, six registers: {regs:?}");
    assert!(regs.iter().all(|r| !r.is_shared() && r.bf));
    // The first page's four registers, then a second page.
    let page = |off: usize| off / mlx5_core::uar::UAR_PAGE_SIZE;
    let pages: BTreeSet<_> = regs.iter().map(|r| page(r.offset)).collect();
    assert_eq!(pages.len(), 2);
    assert_eq!(regs.iter().filter(|r| page(r.offset) == first_page as usize).count(), BFREGS_PER_UAR);
    assert_eq!(n.hca.bfreg_usage(), (6, 2));
    // A QP on the second page posts by BlueFlame there, and the device takes it.
    let (cq, a, b) = pairs.last_mut().unwrap();
    one_send(&mut n, cq, a, b);
    let ev = n.dev.events();
    assert!(!ev.iter().any(|e| matches!(e, SimEvent::BadSqDoorbell { .. } | SimEvent::BlueFlameMismatch { .. })));
    assert!(ev.iter().any(|e| matches!(e, SimEvent::BlueFlameCopy { qpn, .. } if *qpn == a.qpn())));
    for (cq, a, b) in pairs {
        n.drop_pair(cq, a, b);
    }
    assert_eq!(n.hca.bfreg_usage(), (0, 2), "registers come back; pages stay until teardown");
    // The freed registers are handed out again before any new page.
    let (cq, a, b) = n.rc_pair(CAP, 63, &RcOpts::default());
    assert_eq!(page(a.bfreg().offset), first_page as usize);
    assert_eq!(n.hca.bfreg_usage(), (2, 2));
    n.drop_pair(cq, a, b);
    n.finish();
}

#[test]
fn without_uars_left_qps_share_a_register_with_plain_doorbells() {
    // The simulator's UAR table holds only the bring-up page.
    let cfg = SimConfig { num_uars: 1, ..SimConfig::default() };
    let mut n = Node::new(cfg, 1 << 20);
    let mut pairs: Vec<_> = (0..3).map(|_| n.rc_pair(CAP, 63, &RcOpts::default())).collect();
    let regs: Vec<_> = pairs.iter().flat_map(|(_, a, b)| [*a.bfreg(), *b.bfreg()]).collect();
    assert_eq!(regs.iter().filter(|r| !r.is_shared()).count(), BFREGS_PER_UAR);
    assert!(regs.iter().filter(|r| r.is_shared()).all(|r| !r.bf), "a shared register never carries BlueFlame");
    assert_eq!(n.hca.bfreg_usage(), (BFREGS_PER_UAR, 1));
    // Posting through the shared register works: one 8-byte doorbell, no copy.
    let (cq, a, b) = pairs.last_mut().unwrap();
    assert!(a.bfreg().is_shared());
    one_send(&mut n, cq, a, b);
    let ev = n.dev.events();
    assert!(!ev.iter().any(|e| matches!(e, SimEvent::BadSqDoorbell { .. })));
    assert!(!ev.iter().any(|e| matches!(e, SimEvent::BlueFlameCopy { qpn, .. } if *qpn == a.qpn())));
    for (cq, a, b) in pairs {
        n.drop_pair(cq, a, b);
    }
    n.finish();
}

#[test]
fn qps_of_all_types_take_registers_from_the_pool() {
    let mut n = Node::new(SimConfig::default(), 1 << 20);
    let cq = n.cq(63);
    let qps: Vec<Qp> = [QpType::Rc, QpType::Uc, QpType::Ud, QpType::Rc, QpType::Ud]
        .into_iter()
        .map(|t| n.qp(t, &cq, CAP, false))
        .collect();
    let offsets: BTreeSet<_> = qps.iter().map(|q| q.bfreg().offset).collect();
    assert_eq!(offsets.len(), qps.len());
    for q in qps {
        n.hca.destroy_qp(q, &mut n.d).map_err(|e| e.error).unwrap();
    }
    n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).unwrap();
    assert_eq!(n.hca.bfreg_usage().0, 0);
    n.finish();
}

#[test]
fn a_blueflame_copy_through_a_memory_bar_is_the_wqe_byte_for_byte() {
    use mlx5_core::hal::Mmio;
    use mlx5_sim::testkit::mocks::{MemMmio, MmioAccess, RecordingMmio};
    let mut n = Node::new(SimConfig::default(), 1 << 20);
    let (cq, mut a, b) = n.rc_pair(CAP, 63, &RcOpts::default());
    let sge = [n.sge(0, 64)];
    let wr =
        |wr_id| SendWr { wr_id, op: SendOp::Send, sg_list: &sge, flags: SendFlags::SIGNALED, inline: None, ud: None };
    // `MemMmio::write_bf64` (one bounds check, eight stores) against the trait's default (eight `write64`s, seen
    // through the recording wrapper): the same bytes at the same register.
    let bar = MemMmio::new(n.dev.mmio().bar_size());
    let rec = RecordingMmio::new(MemMmio::new(n.dev.mmio().bar_size()));
    let reg = a.bfreg().offset;
    let first = a.sq_cur_post();
    a.post_send(&bar, &[wr(1)]).unwrap();
    let mut wqe = [0u8; 64];
    a.read_sq(first, &mut wqe);
    let mut got = [0u8; 64];
    for (k, chunk) in got.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&bar.read64(reg + 8 * k).to_be_bytes());
    }
    assert_eq!(got, wqe, "the register holds the WQE");
    // The next post alternates to the other buffer; the default path writes it as eight 64-bit stores.
    let second = a.sq_cur_post();
    a.post_send(&rec, &[wr(2)]).unwrap();
    a.read_sq(second, &mut wqe);
    let writes: Vec<_> = rec.log().into_iter().filter(|e| matches!(e, MmioAccess::Write64 { .. })).collect();
    let half = a.bfreg().buf_size;
    let want: Vec<_> = (0..8)
        .map(|k| MmioAccess::Write64 {
            off: reg + half + 8 * k,
            val: u64::from_be_bytes(wqe[8 * k..8 * k + 8].try_into().unwrap()),
        })
        .collect();
    assert_eq!(writes, want);
    for k in 0..8 {
        assert_eq!(rec.inner().read64(reg + half + 8 * k).to_be_bytes(), wqe[8 * k..8 * k + 8]);
    }
    // Both WQEs are outstanding: the completion of the second retires both.
    assert_eq!(a.sq_outstanding(), 2);
    let qpn = a.qpn();
    assert_eq!(mlx5_core::cq::WrTable::send_done(&mut a, qpn, second as u16), Some(2));
    n.drop_pair(cq, a, b);
    n.finish();
}

/// Queues used from different threads share no cache line: each QP's shadow array (wr_ids and send slots), each
/// QP's and CQ's doorbell record and object, and each QP's BlueFlame register lie on 64-byte lines of their own. Small
/// queues make the shadows small, where adjacent heap blocks would otherwise meet inside one line.
#[test]
fn queues_share_no_cache_line() {
    const LINE: usize = 64;
    let tiny = QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let mut n = Node::new(SimConfig::default(), 1 << 20);
    let mut cqs = Vec::new();
    let mut qps = Vec::new();
    for _ in 0..4 {
        let cq = n.cq(1);
        for _ in 0..2 {
            qps.push(n.qp(QpType::Rc, &cq, tiny, false));
        }
        cqs.push(cq);
    }
    let lines = |r: std::ops::Range<usize>| (r.start / LINE..r.end.div_ceil(LINE)).collect::<BTreeSet<_>>();
    let mut host: Vec<(String, BTreeSet<usize>)> = Vec::new();
    for (i, qp) in qps.iter().enumerate() {
        let shadow = qp.shadow_bytes();
        assert!(!shadow.is_empty());
        // Whole lines: what keeps the shadow off its neighbours whatever the allocator places beside it.
        assert_eq!((shadow.start % LINE, shadow.len() % LINE), (0, 0), "QP {i} shadow {shadow:x?}");
        host.push((format!("QP {i} shadow"), lines(shadow)));
        let rec = qp.dbrec().ptr() as usize;
        host.push((format!("QP {i} dbrec"), lines(rec..rec + 8)));
    }
    for (i, cq) in cqs.iter().enumerate() {
        let rec = cq.dbrec().ptr() as usize;
        host.push((format!("CQ {i} dbrec"), lines(rec..rec + 8)));
    }
    // The QP and CQ objects themselves (their counters), kept side by side in a `Vec` as a program may.
    let whole = |p: usize, len: usize| {
        assert_eq!((p % LINE, len % LINE), (0, 0), "an object on whole lines");
        lines(p..p + len)
    };
    for (i, qp) in qps.iter().enumerate() {
        host.push((format!("QP {i} object"), whole(qp as *const Qp as usize, std::mem::size_of::<Qp>())));
    }
    for (i, cq) in cqs.iter().enumerate() {
        host.push((format!("CQ {i} object"), whole(cq as *const Cq as usize, std::mem::size_of::<Cq>())));
    }
    for (i, (a, la)) in host.iter().enumerate() {
        for (b, lb) in &host[i + 1..] {
            assert!(la.is_disjoint(lb), "{a} and {b} share a cache line");
        }
    }
    // BlueFlame registers: BAR addresses, one register (both buffers) per QP, on lines of its own.
    let regs: Vec<BTreeSet<usize>> =
        qps.iter().map(|q| lines(q.bfreg().offset..q.bfreg().offset + 2 * q.bfreg().buf_size)).collect();
    for (i, a) in regs.iter().enumerate() {
        for b in &regs[i + 1..] {
            assert!(a.is_disjoint(b), "two QPs' BlueFlame registers share a line");
        }
    }
    for qp in qps {
        n.hca.destroy_qp(qp, &mut n.d).map_err(|e| e.error).expect("destroy QP");
    }
    for cq in cqs {
        n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).expect("destroy CQ");
    }
    n.finish();
}

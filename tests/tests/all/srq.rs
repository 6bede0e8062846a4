//! Shared receive queues end to end on the simulator: the firmware object Linux picks for the agreed ISSI (RMP
//! commands at ISSI 1, SRQ commands at ISSI 0), RC QPs receiving through one SRQ with each completion resolved to
//! the posted `wr_id` by the SRQ's WQE index, WQE reuse through the free list, the limit event (once per arm),
//! LAST_WQE_REACHED, firmware refusals with their status and syndrome, and the typed errors of a full SRQ and of
//! a device that names a WQE the SRQ does not have posted.

use mlx5_core::cmd::Pas;
use mlx5_core::cmdq::CmdError;
use mlx5_core::cq::{Cq, CqeError, CqeFields, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::Dma;
use mlx5_core::hca::{AsyncEvent, Config, Error, Hca, QpInitAttr, SrqAttr};
use mlx5_core::mkey::Access;
use mlx5_core::prm::{consts, CmdStatus, Opcode};
use mlx5_core::qp::{PostError, PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags};
use mlx5_core::qp::{SendOp, SendWr};
use mlx5_core::srq::{CreateRmp, ModifyRmpLwm, QueryRmp, Srq, SrqContext, SrqKind, WithSrqs};
use mlx5_sim::testkit::mocks::MemMmio;
use mlx5_sim::testkit::{alloc_count, Node, RcOpts};
use mlx5_sim::{syndrome, Fault, SimConfig, SimDevice};

const MEM: usize = 1 << 16;

fn cap() -> QpCap {
    QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 }
}

/// A node whose firmware refuses QUERY_ISSI, so the driver stays at ISSI 0 (as Linux does with such firmware).
fn node_issi0() -> Node {
    let dev = SimDevice::new(SimConfig::default());
    dev.inject(Fault::Status {
        opcode: consts::MLX5_CMD_OP_QUERY_ISSI,
        status: consts::MLX5_CMD_STAT_BAD_OP_ERR,
        syndrome: 0x1234,
        times: 1,
    });
    let mut d = dev.delay();
    let mut hca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).expect("bring-up");
    assert_eq!(hca.issi(), 0);
    let pd = hca.alloc_pd(&mut d).expect("PD");
    let mem = dev.dma().alloc(MEM, 4096).expect("buffer");
    let mr = hca.reg_mr(&pd, mem.cpu().as_ptr(), MEM, Access::ALL, &mut d).expect("MR");
    Node { dev, hca, d, pd, mem, mr }
}

fn srq(n: &mut Node, max_wr: u32, max_sge: u32) -> Srq {
    n.hca.create_srq(&n.pd, SrqAttr { max_wr, max_sge, srq_limit: 0 }, &mut n.d).expect("SRQ")
}

/// An RC QP on `cq` receiving through `srq`.
fn srq_qp(n: &mut Node, cq: &Cq, srq: &Srq) -> Qp {
    let attr = QpInitAttr { qp_type: QpType::Rc, cap: cap(), sq_sig_all: true };
    n.hca.create_qp_with_srq(&n.pd, cq, cq, attr, srq, &mut n.d).expect("QP with SRQ")
}

/// Connects `a` (own RQ) and `b` (on the SRQ) to each other on the loopback.
fn connect(n: &mut Node, a: &mut Qp, b: &mut Qp) {
    let ah = n.ah_attr();
    let o = RcOpts { rnr_retry: 0, ..RcOpts::default() };
    let (qa, qb) = (a.qpn(), b.qpn());
    n.connect_rc(a, qb, ah, &o);
    n.connect_rc(b, qa, ah, &o);
}

fn send(n: &mut Node, qp: &mut Qp, wr_id: u64, off: usize, len: u32) {
    let sge = [n.sge(off, len)];
    let wr = SendWr { wr_id, op: SendOp::Send, sg_list: &sge, flags: SendFlags::SIGNALED, inline: None, ud: None };
    n.hca.post_send(qp, &[wr]).expect("post send");
}

fn opcodes(dev: &SimDevice) -> Vec<u16> {
    dev.executed().iter().map(|c| c.opcode).collect()
}

fn status_of(e: Error) -> (CmdStatus, u32) {
    match e {
        Error::Cmd(CmdError::Status { status, syndrome, .. }) => (status, syndrome),
        other => panic!("not a firmware refusal: {other:?}"),
    }
}

#[test]
fn the_srq_object_follows_the_issi_as_create_srq_split_picks_it() {
    for issi0 in [false, true] {
        let mut n = if issi0 { node_issi0() } else { Node::new(SimConfig::default(), MEM) };
        let before = opcodes(&n.dev).len();
        let mut s = srq(&mut n, 10, 2);
        assert_eq!(s.kind(), if issi0 { SrqKind::Srq } else { SrqKind::Rmp });
        // max_wr rounds up to 2^n - 1 (one spare WQE): 10 asks for 16 WQEs.
        assert_eq!(s.max_wr(), 15);
        n.hca.modify_srq(&mut s, 5, &mut n.d).expect("limit");
        let got = n.hca.query_srq(&s, &mut n.d).expect("query");
        assert_eq!(got, SrqAttr { max_wr: 15, max_sge: 2, srq_limit: 5 });
        // A limit at or above the ring size is refused before any command.
        let bad = n.hca.modify_srq(&mut s, 16, &mut n.d).unwrap_err();
        assert!(matches!(bad, Error::BadSize { what: "SRQ limit", requested: 16, max: 15 }), "{bad:?}");
        n.hca.destroy_srq(s, &mut n.d).map_err(|e| e.error).expect("destroy");
        let sent = &opcodes(&n.dev)[before..];
        use consts as k;
        let want: &[u16] = if issi0 {
            &[k::MLX5_CMD_OP_CREATE_SRQ, k::MLX5_CMD_OP_ARM_RQ, k::MLX5_CMD_OP_QUERY_SRQ, k::MLX5_CMD_OP_DESTROY_SRQ]
        } else {
            &[
                k::MLX5_CMD_OP_CREATE_RMP,
                k::MLX5_CMD_OP_MODIFY_RMP,
                k::MLX5_CMD_OP_QUERY_RMP,
                k::MLX5_CMD_OP_DESTROY_RMP,
            ]
        };
        assert_eq!(sent, want, "ISSI {}", u8::from(!issi0));
        n.finish();
    }
}

#[test]
fn two_rc_qps_share_one_srq_and_its_wqes_are_reused() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let mut scq = n.cq(63);
    let mut rcq = n.cq(63);
    let mut s = srq(&mut n, 3, 1);
    assert_eq!(s.max_wr(), 3);
    let mut a1 = n.qp(QpType::Rc, &scq, cap(), true);
    let mut a2 = n.qp(QpType::Rc, &scq, cap(), true);
    let mut b1 = srq_qp(&mut n, &rcq, &s);
    let mut b2 = srq_qp(&mut n, &rcq, &s);
    // No receive queue of their own: receive capabilities are granted as 0 and a post_recv finds no room.
    assert_eq!((b1.cap().max_recv_wr, b1.cap().max_recv_sge, b1.srqn()), (0, 0, Some(s.srqn())));
    let qinfo = n.dev.qp_info(b1.qpn()).unwrap();
    assert_eq!(qinfo.rq_wqes, 0);
    connect(&mut n, &mut a1, &mut b1);
    connect(&mut n, &mut a2, &mut b2);
    let r = n.hca.post_recv(&mut b1, &[RecvWr { wr_id: 1, sg_list: &[] }]).unwrap_err();
    assert_eq!(r.kind, PostErrorKind::QueueFull { outstanding: 0, max: 0 });
    // Fill the SRQ: each receive buffer is its own 64-byte slot.
    let slot = |k: u64| 0x1000 + (k as usize % 8) * 64;
    let mut next_id = 100u64;
    for _ in 0..3 {
        let sge = [n.sge(slot(next_id), 64)];
        n.hca.post_srq_recv(&mut s, &[RecvWr { wr_id: next_id, sg_list: &sge }]).unwrap();
        next_id += 1;
    }
    let mut posted: Vec<u64> = (100..103).collect();
    let mut wc = [WorkCompletion::default(); 4];
    let mut swc = [WorkCompletion::default(); 4];
    // Many more messages than SRQ WQEs, alternating between the two QPs: every receive is reposted.
    for m in 0..40u64 {
        let payload = [m as u8; 24];
        n.put(0, &payload);
        let (tx, rx) = if m % 2 == 0 { (&mut a1, b1.qpn()) } else { (&mut a2, b2.qpn()) };
        send(&mut n, tx, m, 0, 24);
        let sn = n.hca.poll_cq(&mut scq, &mut [&mut a1, &mut a2][..], &mut swc).unwrap();
        assert_eq!((sn, swc[0].wr_id, swc[0].status), (1, m, WcStatus::Success), "message {m}");
        // The CQE as the device wrote it names the SRQ.
        let ci = rcq.cons_index();
        let (view, off) = rcq.buf().locate((ci as usize & (rcq.nent() as usize - 1)) * 64);
        let mut img = [0u8; 64];
        let p = view.ptr_at(off, 64);
        // SAFETY: 64 bytes inside the live ring (ptr_at checks); the device wrote this entry and writes no other
        // until the driver consumes it.
        unsafe { std::ptr::copy_nonoverlapping(p, img.as_mut_ptr(), 64) };
        assert_eq!(mlx5_core::cq::Cqe(img).srqn(), s.srqn(), "message {m}");
        let got = {
            let mut qps = [&mut b1, &mut b2];
            let mut table = WithSrqs { qps: &mut qps[..], srqs: &mut [&mut s] };
            n.hca.poll_cq(&mut rcq, &mut table, &mut wc).unwrap()
        };
        assert_eq!(got, 1, "message {m}");
        let w = wc[0];
        assert_eq!((w.status, w.opcode, w.byte_len, w.qp_num), (WcStatus::Success, WcOpcode::Recv, 24, rx));
        let i = posted.iter().position(|&id| id == w.wr_id).expect("a posted wr_id");
        // SRQ WQEs are taken in posting order.
        assert_eq!(i, 0, "message {m}");
        posted.remove(i);
        assert_eq!(n.bytes(slot(w.wr_id), 24), payload, "message {m}");
        let sge = [n.sge(slot(next_id), 64)];
        n.hca.post_srq_recv(&mut s, &[RecvWr { wr_id: next_id, sg_list: &sge }]).unwrap();
        posted.push(next_id);
        next_id += 1;
    }
    assert_eq!(s.outstanding(), 3);
    for q in [a1, a2, b1, b2] {
        n.hca.destroy_qp(q, &mut n.d).map_err(|e| e.error).unwrap();
    }
    n.hca.destroy_srq(s, &mut n.d).map_err(|e| e.error).unwrap();
    n.hca.destroy_cq(scq, &mut n.d).map_err(|e| e.error).unwrap();
    n.hca.destroy_cq(rcq, &mut n.d).map_err(|e| e.error).unwrap();
    n.finish();
}

/// One SRQ, one sender and one receiver on it, connected; `k` receives posted.
struct One {
    n: Node,
    cq: Cq,
    s: Srq,
    a: Qp,
    b: Qp,
}

fn one(max_wr: u32, posts: u64) -> One {
    one_on(Node::new(SimConfig::default(), MEM), max_wr, posts)
}

fn one_on(mut n: Node, max_wr: u32, posts: u64) -> One {
    let cq = n.cq(63);
    let mut s = srq(&mut n, max_wr, 1);
    let mut a = n.qp(QpType::Rc, &cq, cap(), true);
    let mut b = srq_qp(&mut n, &cq, &s);
    connect(&mut n, &mut a, &mut b);
    for k in 0..posts {
        let sge = [n.sge(0x2000 + k as usize * 64, 64)];
        n.hca.post_srq_recv(&mut s, &[RecvWr { wr_id: k, sg_list: &sge }]).unwrap();
    }
    One { n, cq, s, a, b }
}

impl One {
    /// Sends one message and polls both completions.
    fn message(&mut self, id: u64) -> Vec<WorkCompletion> {
        send(&mut self.n, &mut self.a, id, 0, 8);
        let mut wc = [WorkCompletion::default(); 4];
        let mut qps = [&mut self.a, &mut self.b];
        let mut table = WithSrqs { qps: &mut qps[..], srqs: &mut [&mut self.s] };
        let got = self.n.hca.poll_cq(&mut self.cq, &mut table, &mut wc).unwrap();
        wc[..got].to_vec()
    }

    fn events(&mut self) -> Vec<AsyncEvent> {
        self.n.hca.process_events(&mut self.n.d).unwrap();
        std::iter::from_fn(|| self.n.hca.get_async_event()).collect()
    }

    fn finish(self) {
        let One { mut n, cq, s, a, b } = self;
        n.hca.destroy_qp(a, &mut n.d).map_err(|e| e.error).unwrap();
        n.hca.destroy_qp(b, &mut n.d).map_err(|e| e.error).unwrap();
        n.hca.destroy_srq(s, &mut n.d).map_err(|e| e.error).unwrap();
        n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).unwrap();
        n.finish();
    }
}

#[test]
fn the_limit_event_fires_once_per_arm_when_fewer_wqes_than_the_limit_remain() {
    let mut o = one(7, 5);
    let srqn = o.s.srqn();
    o.n.hca.modify_srq(&mut o.s, 4, &mut o.n.d).unwrap();
    assert_eq!(o.events(), []);
    // 5 posted -> 4 left: not below the limit.
    assert_eq!(o.message(1).len(), 2);
    assert_eq!(o.events(), []);
    // 3 left: below 4, one event, and the limit reads 0 again.
    assert_eq!(o.message(2).len(), 2);
    assert_eq!(o.events(), [AsyncEvent::SrqLimitReached { srqn }]);
    assert_eq!(o.n.hca.query_srq(&o.s, &mut o.n.d).unwrap().srq_limit, 0);
    // Disarmed: no more events while it drains.
    assert_eq!(o.message(3).len(), 2);
    assert_eq!(o.events(), []);
    // Armed again (2 left, limit 2): the next receive leaves 1 and fires once more.
    o.n.hca.modify_srq(&mut o.s, 2, &mut o.n.d).unwrap();
    assert_eq!(o.message(4).len(), 2);
    assert_eq!(o.events(), [AsyncEvent::SrqLimitReached { srqn }]);
    o.finish();
}

#[test]
fn an_empty_srq_answers_rnr_and_a_full_one_refuses_posts() {
    let mut o = one(3, 0);
    // Nothing posted: the responder sends RNR NAKs, and with rnr_retry 0 the send fails.
    let wcs = o.message(1);
    assert_eq!(wcs.len(), 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WcStatus::RnrRetryExcErr));
    let sge = [o.n.sge(0x2000, 64)];
    let wr = |id| RecvWr { wr_id: id, sg_list: &sge };
    let e = o.n.hca.post_srq_recv(&mut o.s, &[wr(10), wr(11), wr(12), wr(13), wr(14)]).unwrap_err();
    assert_eq!(e, PostError { index: 3, kind: PostErrorKind::QueueFull { outstanding: 3, max: 3 } });
    let two = [o.n.sge(0, 1), o.n.sge(8, 1)];
    let e = o.n.hca.post_srq_recv(&mut o.s, &[RecvWr { wr_id: 20, sg_list: &two }]).unwrap_err();
    assert_eq!(e.kind, PostErrorKind::TooManySge { sge: 2, max: 1 });
    assert_eq!(o.s.outstanding(), 3);
    o.finish();
}

#[test]
fn an_attached_qp_in_err_reports_last_wqe_and_leaves_the_srq_wqes_posted() {
    let mut o = one(7, 4);
    assert_eq!(o.message(0).len(), 2);
    let qpn = o.b.qpn();
    let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
    o.n.hca.modify_qp(&mut o.b, &attr, QpAttrMask::STATE, &mut o.n.d).unwrap();
    assert_eq!(o.events(), [AsyncEvent::LastWqeReached { qpn }]);
    // The QP's flush does not touch the SRQ: its three WQEs stay posted, and nothing completes.
    let mut wc = [WorkCompletion::default(); 8];
    let mut qps = [&mut o.a, &mut o.b];
    let got = o.n.hca.poll_cq(&mut o.cq, &mut WithSrqs { qps: &mut qps[..], srqs: &mut [&mut o.s] }, &mut wc).unwrap();
    assert_eq!(got, 0);
    assert_eq!(o.s.outstanding(), 3);
    // Once per stay in ERR.
    assert_eq!(o.events(), []);
    // Firmware refuses to destroy the SRQ while the QP is attached; the SRQ comes back.
    let One { mut n, cq, s, a, b } = o;
    let e = n.hca.destroy_srq(s, &mut n.d).unwrap_err();
    assert_eq!(status_of(e.error), (CmdStatus::BadResState, syndrome::IN_USE));
    let s = e.obj;
    One { n, cq, s, a, b }.finish();
}

#[test]
fn a_wqe_counter_the_srq_does_not_have_posted_is_a_typed_error() {
    let mut o = one(3, 2);
    let (qpn, srqn, cqn) = (o.b.qpn(), o.s.srqn(), o.cq.cqn());
    for wqe_counter in [2u16, 999] {
        let cqe = CqeFields {
            opcode: consts::MLX5_CQE_RESP_SEND,
            qpn,
            wqe_counter,
            srqn,
            byte_cnt: 4,
            ..CqeFields::default()
        };
        o.n.dev.post_cqe(cqn, cqe.emit().0).unwrap();
        let mut wc = [WorkCompletion::default(); 2];
        let mut qps = [&mut o.a, &mut o.b];
        let mut table = WithSrqs { qps: &mut qps[..], srqs: &mut [&mut o.s] };
        let e = o.n.hca.poll_cq(&mut o.cq, &mut table, &mut wc).unwrap_err();
        assert!(
            matches!(e, CqeError::BadSrqWqe { qpn: q, srqn: s, wqe_counter: w, .. } if q == qpn && s == srqn && w == wqe_counter),
            "{e:?}"
        );
    }
    // The refused CQEs changed nothing: both posted WQEs are still there and complete normally.
    assert_eq!(o.s.outstanding(), 2);
    let wcs = o.message(7);
    assert!(wcs.iter().any(|w| w.wr_id == 0 && w.qp_num == qpn && w.status == WcStatus::Success), "{wcs:?}");
    o.finish();
}

#[test]
fn firmware_refuses_bad_srq_commands_with_status_and_syndrome() {
    let mut n = Node::new(SimConfig::default(), MEM);
    let page = n.dev.dma().alloc(4096, 4096).unwrap();
    let rec = n.dev.dma().alloc(64, 64).unwrap();
    let good = SrqContext {
        log_size: 4,
        wqe_shift: 5,
        log_page_size: 0,
        page_offset: 0,
        lwm: 0,
        pd: n.pd.pdn(),
        dbr_addr: rec.iova(),
    };
    let pages = [page.iova()];
    let bad_param = CmdStatus::BadParam;
    let cases: Vec<(SrqContext, Vec<u64>, (CmdStatus, u32))> = vec![
        (SrqContext { pd: 0x7777, ..good }, pages.to_vec(), (bad_param, syndrome::PD_INVALID)),
        (SrqContext { log_size: 16, ..good }, pages.to_vec(), (bad_param, syndrome::LOG_SIZE)),
        (SrqContext { wqe_shift: 10, ..good }, pages.to_vec(), (bad_param, syndrome::SRQ_STRIDE)),
        (SrqContext { lwm: 16, ..good }, pages.to_vec(), (bad_param, syndrome::SRQ_LWM)),
        (SrqContext { log_size: 8, ..good }, pages.to_vec(), (bad_param, syndrome::PAS_TOO_FEW)),
        (good, vec![0x7000_0000], (bad_param, syndrome::PAS_NOT_MAPPED)),
        (good, vec![page.iova() + 8], (bad_param, syndrome::PAS_MISALIGNED)),
        (SrqContext { dbr_addr: 0x10, ..good }, pages.to_vec(), (bad_param, syndrome::DBR_NOT_MAPPED)),
    ];
    for (k, (ctx, pas, want)) in cases.iter().enumerate() {
        let e = n.hca.exec(&mut CreateRmp { ctx: *ctx, pas: Pas::List(pas) }, &mut n.d).unwrap_err();
        assert_eq!(status_of(e), *want, "case {k}");
    }
    // Unknown RMP numbers.
    let unknown = (bad_param, syndrome::SRQ_INVALID);
    let e = n.hca.exec(&mut ModifyRmpLwm { rmpn: 0x5555, lwm: 1 }, &mut n.d).unwrap_err();
    assert_eq!(status_of(e), unknown);
    let e = n.hca.exec(&mut QueryRmp { rmpn: 0x5555 }, &mut n.d).unwrap_err();
    assert_eq!(status_of(e), unknown);
    let e = n.hca.exec_destroy(mlx5_core::srq::destroy_rmp(0x5555), &mut n.d).unwrap_err();
    assert_eq!(status_of(e), unknown);
    // The ISSI 0 family at ISSI 1.
    let e = n.hca.exec(&mut mlx5_core::srq::CreateSrq { ctx: good, pas: Pas::List(&pages) }, &mut n.d).unwrap_err();
    assert_eq!(status_of(e), (CmdStatus::BadOp, syndrome::SRQ_ISSI));
    // A good one, then a limit at the ring size is refused, one below it taken.
    let rmpn = n.hca.exec(&mut CreateRmp { ctx: good, pas: Pas::List(&pages) }, &mut n.d).unwrap();
    let e = n.hca.exec(&mut ModifyRmpLwm { rmpn, lwm: 16 }, &mut n.d).unwrap_err();
    assert_eq!(status_of(e), (bad_param, syndrome::SRQ_LWM));
    n.hca.exec(&mut ModifyRmpLwm { rmpn, lwm: 15 }, &mut n.d).unwrap();
    let st = n.hca.exec(&mut QueryRmp { rmpn }, &mut n.d).unwrap();
    assert_eq!((st.lwm, st.log_size, st.wqe_shift, st.pd, st.error), (15, 4, 5, n.pd.pdn(), false));
    n.hca.exec_destroy(mlx5_core::srq::destroy_rmp(rmpn), &mut n.d).unwrap();
    assert!(n.hca.exec(&mut QueryRmp { rmpn }, &mut n.d).is_err());
    let creates = opcodes(&n.dev).iter().filter(|&&o| o == Opcode::CreateRmp.raw()).count();
    assert_eq!(creates, cases.len() + 1, "every case reached firmware");
    // SAFETY: the RMP that used them is destroyed; the refused creates never held them.
    unsafe {
        n.dev.dma().free(page);
        n.dev.dma().free(rec);
    }
    n.finish();
}

#[test]
fn an_issi_0_srq_carries_messages_through_its_srqc() {
    let mut o = one_on(node_issi0(), 3, 3);
    assert_eq!(o.s.kind(), SrqKind::Srq);
    let qpn = o.b.qpn();
    for (m, want) in [(1u64, 0u64), (2, 1), (3, 2)] {
        let wcs = o.message(m);
        let recv = wcs.iter().find(|w| w.opcode == WcOpcode::Recv).expect("a receive");
        assert_eq!((recv.wr_id, recv.qp_num, recv.status, recv.byte_len), (want, qpn, WcStatus::Success, 8));
    }
    o.finish();
}

/// Runs `f` with the counter armed on this thread; returns its result and the allocations it made.
fn counted<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = alloc_count::count();
    let armed = alloc_count::arm();
    let r = f();
    drop(armed);
    (r, (alloc_count::count() - before) as usize)
}

#[test]
fn posting_to_and_completing_from_an_srq_allocates_nothing() {
    let mut o = one(7, 0);
    // The SRQ's post writes memory only (no MMIO doorbell), so a plain-memory BAR keeps the simulator out of the
    // counted calls.
    let bar = MemMmio::new(o.n.dev.mmio().bar_size());
    let sge = [o.n.sge(0x2000, 64)];
    let wrs = [RecvWr { wr_id: 1, sg_list: &sge }, RecvWr { wr_id: 2, sg_list: &sge }];
    let (r, allocs) = counted(|| o.s.post_srq_recv(&bar, &wrs));
    assert_eq!((r, allocs), (Ok(()), 0));
    send(&mut o.n, &mut o.a, 9, 0, 8);
    let mut wc = [WorkCompletion::default(); 4];
    let (got, allocs) = counted(|| {
        let mut qps = [&mut o.a, &mut o.b];
        let mut table = WithSrqs { qps: &mut qps[..], srqs: &mut [&mut o.s] };
        o.cq.poll(&bar, &mut table, &mut wc)
    });
    assert_eq!((got, allocs), (Ok(2), 0));
    assert!(wc[..2].iter().any(|w| w.wr_id == 1 && w.opcode == WcOpcode::Recv), "{wc:?}");
    o.finish();
}

#[test]
fn a_receive_error_names_its_srq_wqe_and_the_qp_reports_last_wqe() {
    let mut o = one(7, 0);
    let qpn = o.b.qpn();
    // A receive buffer under a key that does not exist: the responder fails the receive with a protection error.
    let bad = [mlx5_core::qp::Sge { addr: o.n.addr(0x2000), length: 64, lkey: 0x00ab_cd00 }];
    let good = [o.n.sge(0x2100, 64)];
    o.n.hca
        .post_srq_recv(&mut o.s, &[RecvWr { wr_id: 50, sg_list: &bad }, RecvWr { wr_id: 51, sg_list: &good }])
        .unwrap();
    let wcs = o.message(1);
    let recv = wcs.iter().find(|w| w.qp_num == qpn).expect("the receive completes in error");
    assert_eq!((recv.wr_id, recv.status), (50, WcStatus::LocProtErr));
    // The failed WQE went back on the free list; the other stays posted for the SRQ's other users.
    assert_eq!(o.s.outstanding(), 1);
    assert_eq!(o.events(), [AsyncEvent::LastWqeReached { qpn }]);
    o.finish();
}

//! WQE building from arbitrary work-request lists, on an RC (connected to itself) or UD QP of the simulated
//! device, whose datapath executes every WQE the driver posts and acts as the oracle of its format.
//!
//! Asserted: no panic; `post_send` / `post_recv` fail only with a typed `PostError` whose index is the first work
//! request that breaks a rule of the queue (state, room, SGE count, inline size, inline with a gather list, a UD
//! destination on UD only, RDMA and atomics on RC only, an 8-byte SGE for atomics), with a kind that names one of
//! the rules it breaks, and everything before it posted; queue accounting: outstanding counts move by exactly
//! what was posted and what completed, the doorbell records carry the producer counters, a WQE never exceeds
//! the queue's WQE size and the ring never holds more BBs than it has; each WQE's control segment carries its
//! index, opcode, QP, size and flags; completions come back in posting order, each once, successful send
//! completions only for signaled requests and with the opcode posted; the device never finds a WQE malformed
//! (`LOCAL_QP_OP_ERR`), never faults on DMA, and teardown returns every allocation.
#![no_main]

use std::collections::{BTreeMap, VecDeque};

use libfuzzer_sys::fuzz_target;
use mlx5_core::cq::{Cq, LinkLayer, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::Dma;
use mlx5_core::hca::{Config, Hca};
use mlx5_core::hca::{CqAttr, QpInitAttr};
use mlx5_core::mkey::Access;
use mlx5_core::prm::{c, consts};
use mlx5_core::qp::{
    Ah, AhAttr, Grh, Mtu, PostError, PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags,
    SendOp, SendWr, Sge, UdDest,
};
use mlx5_fuzz::{flag, int, Unstructured};
use mlx5_sim::{SimConfig, SimDevice, SimEvent};

type SimHca = Hca<mlx5_sim::SimMmio, mlx5_sim::SimDma>;

const MEM: usize = 64 * 1024;
const QKEY: u32 = 0x1111_2222;
const SEND_TAG: u64 = 1 << 40;
const RECV_TAG: u64 = 2 << 40;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    run(&mut u);
});

/// The rules a work request can break (the discriminants of `PostErrorKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    Full,
    Sge,
    Inline,
    State,
    Request,
}

fn rule(k: &PostErrorKind) -> Rule {
    match k {
        PostErrorKind::QueueFull { .. } => Rule::Full,
        PostErrorKind::TooManySge { .. } => Rule::Sge,
        PostErrorKind::InlineTooLong { .. } => Rule::Inline,
        PostErrorKind::BadState { .. } => Rule::State,
        PostErrorKind::BadRequest { .. } => Rule::Request,
        PostErrorKind::DeviceError => panic!("device error on a healthy device"),
    }
}

fn is_atomic(op: &SendOp) -> bool {
    matches!(op, SendOp::AtomicCmpSwp { .. } | SendOp::AtomicFetchAdd { .. })
}

fn is_rdma(op: &SendOp) -> bool {
    matches!(op, SendOp::RdmaWrite { .. } | SendOp::RdmaWriteImm { .. } | SendOp::RdmaRead { .. })
}

/// Rules `wr` breaks on a QP of `ty` with `cap`, `outstanding` WQEs already in the queue.
fn send_rules(wr: &SendWr<'_>, ty: QpType, cap: &QpCap, outstanding: u32) -> Vec<Rule> {
    let mut v = Vec::new();
    if outstanding >= cap.max_send_wr {
        v.push(Rule::Full);
    }
    if wr.inline.is_some() && !wr.sg_list.is_empty() {
        v.push(Rule::Request);
    }
    if wr.sg_list.len() > cap.max_send_sge as usize {
        v.push(Rule::Sge);
    }
    match (ty, wr.ud.is_some()) {
        (QpType::Ud, false) | (QpType::Rc, true) => v.push(Rule::Request),
        _ => {}
    }
    if ty == QpType::Ud && (is_rdma(&wr.op) || is_atomic(&wr.op)) {
        v.push(Rule::Request);
    }
    if is_atomic(&wr.op) && (wr.sg_list.len() != 1 || wr.sg_list[0].length != 8) {
        v.push(Rule::Request);
    }
    if let Some(d) = wr.inline {
        if matches!(wr.op, SendOp::RdmaRead { .. }) || is_atomic(&wr.op) {
            v.push(Rule::Request);
        }
        if d.len() > cap.max_inline_data as usize {
            v.push(Rule::Inline);
        }
    }
    v
}

/// Bytes of the WQE the driver must build for a valid `wr` (segments in 16-byte units).
fn wqe_bytes(wr: &SendWr<'_>, ty: QpType) -> usize {
    let mut n = c::mlx5_wqe_ctrl_seg::SIZE;
    if ty == QpType::Ud {
        n += c::mlx5_wqe_datagram_seg::SIZE;
    }
    if is_rdma(&wr.op) || is_atomic(&wr.op) {
        n += c::mlx5_wqe_raddr_seg::SIZE;
    }
    if is_atomic(&wr.op) {
        n += c::mlx5_wqe_atomic_seg::SIZE;
    }
    match wr.inline {
        // Linux and rdma-core write no inline segment for no inline data.
        Some([]) => {}
        Some(d) => n += (4 + d.len()).next_multiple_of(16),
        None => n += 16 * wr.sg_list.iter().filter(|s| s.length > 0).count(),
    }
    n
}

fn mlx5_opcode(op: &SendOp) -> (u8, u32) {
    match *op {
        SendOp::Send => (consts::MLX5_OPCODE_SEND, 0),
        SendOp::SendImm { imm } => (consts::MLX5_OPCODE_SEND_IMM, imm),
        SendOp::RdmaWrite { .. } => (consts::MLX5_OPCODE_RDMA_WRITE, 0),
        SendOp::RdmaWriteImm { imm, .. } => (consts::MLX5_OPCODE_RDMA_WRITE_IMM, imm),
        SendOp::RdmaRead { .. } => (consts::MLX5_OPCODE_RDMA_READ, 0),
        SendOp::AtomicCmpSwp { .. } => (consts::MLX5_OPCODE_ATOMIC_CS, 0),
        SendOp::AtomicFetchAdd { .. } => (consts::MLX5_OPCODE_ATOMIC_FA, 0),
    }
}

fn wc_opcode(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendImm { .. } => WcOpcode::Send,
        SendOp::RdmaWrite { .. } | SendOp::RdmaWriteImm { .. } => WcOpcode::RdmaWrite,
        SendOp::RdmaRead { .. } => WcOpcode::RdmaRead,
        SendOp::AtomicCmpSwp { .. } => WcOpcode::CompSwap,
        SendOp::AtomicFetchAdd { .. } => WcOpcode::FetchAdd,
    }
}

/// A posted send as the model remembers it.
#[derive(Debug, Clone, Copy)]
struct Posted {
    seq: u64,
    op: SendOp,
    signaled: bool,
    bbs: u32,
}

struct Model {
    sends: VecDeque<Posted>,
    next_send: u64,
    recv_posted: u64,
    recv_done: u64,
    cur_post: u32,
}

fn run(u: &mut Unstructured<'_>) {
    let ty = if flag(u) { QpType::Ud } else { QpType::Rc };
    let cap = QpCap {
        max_send_wr: int(u, 1u32..=64),
        max_recv_wr: int(u, 1u32..=64),
        max_send_sge: int(u, 0u32..=6),
        max_recv_sge: int(u, 1u32..=6),
        max_inline_data: int(u, 0u32..=400),
    };
    let sig_all = flag(u);
    let dev = SimDevice::new(SimConfig::default());
    let mut d = dev.delay();
    let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).expect("bring-up");
    let pd = hca.alloc_pd(&mut d).expect("pd");
    let mem = dev.dma().alloc(MEM, 4096).expect("memory");
    let mr = hca.reg_mr(&pd, mem.cpu().as_ptr(), MEM, Access::ALL, &mut d).expect("mr");
    let mut cq: Cq = hca.create_cq(CqAttr { cqe: 1023, ..CqAttr::default() }, &mut d).expect("cq");
    let attr = QpInitAttr { qp_type: ty, cap, sq_sig_all: sig_all };
    let mut qp = match hca.create_qp(&pd, &cq, &cq, attr, &mut d) {
        Ok(qp) => Some(qp),
        // Sizes the device cannot have: a typed refusal, and nothing to post on.
        Err(e) => {
            assert!(!e.to_string().is_empty());
            None
        }
    };
    if let Some(qp) = qp.as_mut() {
        connect(&mut hca, &mut d, qp, ty, dev.config().mac);
        let granted = qp.cap();
        assert!(granted.max_send_wr >= cap.max_send_wr && granted.max_recv_wr >= cap.max_recv_wr);
        assert!(granted.max_send_sge >= cap.max_send_sge && granted.max_inline_data >= cap.max_inline_data);
        let port = hca.query_port(&mut d).expect("port");
        let gid = hca.query_gid(0, &mut d).expect("gid");
        let roce = port.link_layer == LinkLayer::Ethernet;
        let ah_attr = AhAttr {
            dlid: port.lid,
            grh: roce.then_some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
            dmac: dev.config().mac,
            port_num: 1,
            ..AhAttr::default()
        };
        let ah = Ah::new(&ah_attr, port.link_layer);
        let base = mem.cpu().as_ptr() as u64;
        let mut m = Model { sends: VecDeque::new(), next_send: 0, recv_posted: 0, recv_done: 0, cur_post: 0 };
        for _ in 0..24 {
            if u.is_empty() {
                break;
            }
            match int(u, 0u8..=4) {
                0 | 1 => post_sends(u, &hca, qp, &mut m, ty, base, mr.lkey, mr.rkey, &ah, sig_all),
                2 => post_recvs(u, &hca, qp, &mut m, base, mr.lkey),
                _ => poll(&hca, &mut cq, qp, &mut m),
            }
        }
        // Drain what the device completed.
        poll(&hca, &mut cq, qp, &mut m);
    }
    if let Some(qp) = qp {
        hca.destroy_qp(qp, &mut d).map_err(|e| e.error).expect("destroy_qp");
    }
    hca.destroy_cq(cq, &mut d).map_err(|e| e.error).expect("destroy_cq");
    hca.dereg_mr(mr, &mut d).map_err(|e| e.error).expect("dereg_mr");
    hca.dealloc_pd(pd, &mut d).map_err(|e| e.error).expect("dealloc_pd");
    // SAFETY: the memory key over the region is destroyed; the device cannot reach it any more.
    unsafe { dev.dma().free(mem) };
    hca.teardown(&mut d).expect("teardown");
    assert_eq!(dev.dma_outstanding(), (0, 0), "every DMA allocation returned");
    assert!(dev.dma_faults().is_empty(), "device DMA faults: {:?}", dev.dma_faults());
    for e in dev.events() {
        assert!(
            !matches!(e, SimEvent::BadFree { .. } | SimEvent::FreedDeviceOwned { .. }),
            "driver freed memory wrongly: {e:?}"
        );
    }
}

fn connect(hca: &mut SimHca, d: &mut mlx5_sim::SimDelay, qp: &mut Qp, ty: QpType, mac: [u8; 6]) {
    use QpAttrMask as M;
    let steps: Vec<(QpState, QpAttrMask)> = match ty {
        QpType::Rc => vec![
            (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            (
                QpState::Rtr,
                M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
            ),
            (QpState::Rts, M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC),
        ],
        QpType::Uc => vec![
            (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            (QpState::Rtr, M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN),
            (QpState::Rts, M::STATE | M::SQ_PSN),
        ],
        QpType::Ud | QpType::Gsi | QpType::Smi => vec![
            (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY),
            (QpState::Rtr, M::STATE),
            (QpState::Rts, M::STATE | M::SQ_PSN),
        ],
    };
    let port = hca.query_port(d).expect("port");
    let gid = hca.query_gid(0, d).expect("gid");
    let roce = port.link_layer == LinkLayer::Ethernet;
    let ah_attr = AhAttr {
        dlid: port.lid,
        grh: roce.then_some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
        dmac: mac,
        port_num: 1,
        ..AhAttr::default()
    };
    let a = QpAttr {
        qp_access_flags: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC | Access::LOCAL_WRITE,
        path_mtu: Mtu::M1024,
        dest_qp_num: qp.qpn(),
        ah_attr,
        rnr_retry: 0,
        retry_cnt: 0,
        min_rnr_timer: 1,
        max_dest_rd_atomic: 4,
        max_rd_atomic: 4,
        qkey: QKEY,
        ..QpAttr::default()
    };
    for (s, m) in steps {
        hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, d).expect("modify_qp");
    }
}

#[allow(clippy::too_many_arguments)]
fn post_sends(
    u: &mut Unstructured<'_>,
    hca: &SimHca,
    qp: &mut Qp,
    m: &mut Model,
    ty: QpType,
    base: u64,
    lkey: u32,
    rkey: u32,
    ah: &Ah,
    sig_all: bool,
) {
    let cap = qp.cap();
    let n = int(u, 0usize..=8);
    // Storage the work requests borrow from.
    let mut sges: Vec<Vec<Sge>> = Vec::new();
    let mut inlines: Vec<Option<Vec<u8>>> = Vec::new();
    let mut ops = Vec::new();
    let mut flags = Vec::new();
    let mut dests = Vec::new();
    for _ in 0..n {
        let addr = |u: &mut Unstructured<'_>| {
            if int(u, 0u8..=7) == 0 {
                int(u, 0u64..=u64::MAX)
            } else {
                (base + int(u, 0u64..=MEM as u64 - 8)) & !7
            }
        };
        let key =
            |u: &mut Unstructured<'_>, good: u32| if int(u, 0u8..=15) == 0 { int(u, 0u32..=u32::MAX) } else { good };
        let op = match int(u, 0u8..=6) {
            0 => SendOp::Send,
            1 => SendOp::SendImm { imm: int(u, 0u32..=u32::MAX) },
            2 => SendOp::RdmaWrite { remote_addr: addr(u), rkey: key(u, rkey) },
            3 => SendOp::RdmaWriteImm { remote_addr: addr(u), rkey: key(u, rkey), imm: int(u, 0u32..=u32::MAX) },
            4 => SendOp::RdmaRead { remote_addr: addr(u), rkey: key(u, rkey) },
            5 => SendOp::AtomicCmpSwp {
                remote_addr: addr(u),
                rkey: key(u, rkey),
                compare: int(u, 0u64..=u64::MAX),
                swap: int(u, 0u64..=u64::MAX),
            },
            _ => SendOp::AtomicFetchAdd { remote_addr: addr(u), rkey: key(u, rkey), add: int(u, 0u64..=u64::MAX) },
        };
        let nsge = int(u, 0usize..=cap.max_send_sge as usize + 1);
        let list: Vec<Sge> = (0..nsge)
            .map(|_| Sge {
                addr: addr(u),
                length: if is_atomic(&op) && flag(u) { 8 } else { int(u, 0u32..=2048) },
                lkey: key(u, lkey),
            })
            .collect();
        let inline = if int(u, 0u8..=3) == 0 {
            let len = int(u, 0usize..=cap.max_inline_data as usize + 20);
            Some((0..len).map(|i| i as u8).collect::<Vec<u8>>())
        } else {
            None
        };
        // Mostly what the QP type needs: UD a destination, RC none.
        let dest = !matches!((ty, int(u, 0u8..=15)), (QpType::Ud, 0) | (QpType::Rc, 1..=15));
        sges.push(list);
        inlines.push(inline);
        ops.push(op);
        flags.push(SendFlags(int(u, 0u32..=7)));
        dests.push(dest);
    }
    let wrs: Vec<SendWr<'_>> = (0..n)
        .map(|i| SendWr {
            wr_id: SEND_TAG | (m.next_send + i as u64),
            op: ops[i],
            sg_list: &sges[i],
            flags: flags[i],
            inline: inlines[i].as_deref(),
            ud: dests[i].then_some(UdDest { ah, remote_qpn: qp.qpn(), remote_qkey: QKEY }),
        })
        .collect();
    // Which request must fail first, and why.
    let out0 = qp.sq_outstanding();
    let mut first_bad = None;
    for (i, wr) in wrs.iter().enumerate() {
        let rules = send_rules(wr, ty, &cap, out0 + i as u32);
        if !rules.is_empty() {
            first_bad = Some((i, rules));
            break;
        }
    }
    // The posted requests get consecutive wr_ids: fix them up to the sequence numbers they will have.
    let cur0 = qp.sq_cur_post();
    let r = hca.post_send(qp, &wrs);
    let posted = match (&r, &first_bad) {
        (Ok(()), None) => n,
        (Err(PostError { index, kind }), Some((i, rules))) => {
            assert_eq!(index, i, "first failing request");
            assert!(rules.contains(&rule(kind)), "request {i} refused with {kind:?}, it breaks {rules:?}");
            *i
        }
        (r, want) => panic!("post_send returned {r:?}, expected failure {want:?}"),
    };
    assert_eq!(qp.sq_outstanding(), out0 + posted as u32, "outstanding sends after posting {posted}");
    let mut at = cur0;
    for wr in &wrs[..posted] {
        let bytes = wqe_bytes(wr, ty);
        assert!(
            bytes <= qp.sizes().sq_wqe_size as usize,
            "a {bytes}-byte WQE in a queue of {}-byte WQEs",
            qp.sizes().sq_wqe_size
        );
        let bbs = bytes.div_ceil(64) as u32;
        // The control segment the device reads.
        let mut ctrl = [0u8; 16];
        qp.read_sq(at, &mut ctrl);
        let (opcode, imm) = mlx5_opcode(&wr.op);
        let w0 = u32::from_be_bytes(ctrl[0..4].try_into().unwrap());
        let w1 = u32::from_be_bytes(ctrl[4..8].try_into().unwrap());
        assert_eq!(w0 & 0xff, u32::from(opcode), "opcode");
        assert_eq!((w0 >> 8) & 0xffff, at & 0xffff, "WQE index");
        assert_eq!(w1 >> 8, qp.qpn(), "QP number");
        assert_eq!((w1 & 0x3f) as usize, bytes / 16, "WQE size in 16-byte units");
        let signaled = sig_all || wr.flags.contains(SendFlags::SIGNALED);
        let fm = ctrl[c::mlx5_wqe_ctrl_seg::FM_CE_SE.off];
        assert_eq!(fm & consts::MLX5_WQE_CTRL_CQ_UPDATE != 0, signaled, "completion requested");
        assert_eq!(fm & consts::MLX5_WQE_CTRL_SOLICITED != 0, wr.flags.contains(SendFlags::SOLICITED));
        assert_eq!(fm & consts::MLX5_WQE_CTRL_FENCE != 0, wr.flags.contains(SendFlags::FENCE));
        // `imm_data` is `__be32` as verbs defines it: its bytes go to the WQE as they lie in memory.
        assert_eq!(ctrl[12..16], imm.to_ne_bytes(), "immediate");
        m.sends.push_back(Posted { seq: m.next_send, op: wr.op, signaled, bbs });
        m.next_send += 1;
        at = at.wrapping_add(bbs);
    }
    assert_eq!(qp.sq_cur_post(), at, "producer counter moved by the WQEs' BBs");
    m.cur_post = at;
    let in_ring: u32 = m.sends.iter().map(|p| p.bbs).sum();
    assert!(in_ring <= qp.sizes().sq_wqe_cnt, "{in_ring} BBs outstanding in a ring of {}", qp.sizes().sq_wqe_cnt);
    assert_eq!(qp.dbrec().read_be32(consts::MLX5_SND_DBR as usize), m.cur_post & 0xffff, "send doorbell record");
}

fn post_recvs(u: &mut Unstructured<'_>, hca: &SimHca, qp: &mut Qp, m: &mut Model, base: u64, lkey: u32) {
    let cap = qp.cap();
    let rq_cnt = qp.sizes().rq_wqe_cnt;
    let n = int(u, 0usize..=8);
    let lists: Vec<Vec<Sge>> = (0..n)
        .map(|_| {
            (0..int(u, 0usize..=cap.max_recv_sge as usize + 1))
                .map(|_| Sge {
                    addr: base + (int(u, 0u64..=MEM as u64 - 1)),
                    length: int(u, 1u32..=4096),
                    lkey: if int(u, 0u8..=15) == 0 { int(u, 0u32..=u32::MAX) } else { lkey },
                })
                .collect()
        })
        .collect();
    let wrs: Vec<RecvWr<'_>> = lists
        .iter()
        .enumerate()
        .map(|(i, l)| RecvWr { wr_id: RECV_TAG | (m.recv_posted + i as u64), sg_list: l })
        .collect();
    let out0 = qp.rq_outstanding();
    let mut first_bad = None;
    for (i, wr) in wrs.iter().enumerate() {
        let mut rules = Vec::new();
        if out0 + i as u32 >= rq_cnt {
            rules.push(Rule::Full);
        }
        if wr.sg_list.len() > cap.max_recv_sge as usize {
            rules.push(Rule::Sge);
        }
        if !rules.is_empty() {
            first_bad = Some((i, rules));
            break;
        }
    }
    let r = hca.post_recv(qp, &wrs);
    let posted = match (&r, &first_bad) {
        (Ok(()), None) => n,
        (Err(PostError { index, kind }), Some((i, rules))) => {
            assert_eq!(index, i);
            assert!(rules.contains(&rule(kind)), "receive {i} refused with {kind:?}, it breaks {rules:?}");
            *i
        }
        (r, want) => panic!("post_recv returned {r:?}, expected failure {want:?}"),
    };
    assert_eq!(qp.rq_outstanding(), out0 + posted as u32);
    m.recv_posted += posted as u64;
    assert_eq!(qp.dbrec().read_be32(consts::MLX5_RCV_DBR as usize), (m.recv_posted & 0xffff) as u32);
}

fn poll(hca: &SimHca, cq: &mut Cq, qp: &mut Qp, m: &mut Model) {
    let mut wc = [WorkCompletion::default(); 16];
    let mut by_seq: BTreeMap<u64, Posted> = m.sends.iter().map(|p| (p.seq, *p)).collect();
    for _ in 0..64 {
        let n = cq.poll(hca.mmio(), &mut *qp, &mut wc).expect("a healthy device writes only good CQEs");
        if n == 0 {
            break;
        }
        for w in &wc[..n] {
            mlx5_fuzz::assert_wc_well_formed(w);
            assert_eq!(w.qp_num, qp.qpn());
            assert_ne!(w.status, WcStatus::LocQpOpErr, "the device found a WQE malformed: {w:?}");
            if w.wr_id & SEND_TAG != 0 {
                let seq = w.wr_id & !SEND_TAG;
                let p = by_seq.remove(&seq).unwrap_or_else(|| panic!("send {seq} completed twice or never posted"));
                // Every WQE before it is retired with it (unsignaled ones complete silently).
                while m.sends.front().is_some_and(|f| f.seq <= seq) {
                    let f = m.sends.pop_front().unwrap();
                    by_seq.remove(&f.seq);
                }
                if w.status == WcStatus::Success {
                    assert!(p.signaled, "unsignaled send {seq} completed");
                    assert_eq!(w.opcode, wc_opcode(&p.op), "completion opcode of send {seq}");
                }
            } else {
                assert_eq!(w.wr_id, RECV_TAG | m.recv_done, "receives complete in order");
                m.recv_done += 1;
            }
        }
    }
    assert_eq!(qp.sq_outstanding() as usize, m.sends.len(), "outstanding sends after completions");
    assert_eq!(u64::from(qp.rq_outstanding()), m.recv_posted - m.recv_done, "outstanding receives");
}

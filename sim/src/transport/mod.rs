//! The transport: the device side of the datapath (c-layouts.md sections 4 and 5), what the ConnectX's send and
//! receive engines do. `wqe.rs` parses send and receive WQEs, `keys.rs` reaches memory through memory keys,
//! `requester.rs` and `responder.rs` are the two ends of RC, `uc.rs` is UC, `ud.rs` is UD, `cqe.rs` writes CQEs, `flush.rs`
//! errors a QP and flushes it, `srq.rs` takes receives from a shared receive queue, `roce_rx.rs` receives RoCE
//! frames into the reassembly state of `reasm.rs`. `common.rs` holds what they share: [`Datapath`], the view of
//! the device a run borrows (the device layer builds it), and [`DpState`]. Only the run loop (here) and the
//! RoCE receive front end (`roce_rx.rs`, which drains the inbox into both engines) run on `Datapath`; each
//! engine runs on a view borrowing only its parts, built per call: `Requester` (`requester.rs`, with the SQ
//! loop, and the send halves of `uc.rs`, `ud.rs`), `Responder` (`responder.rs` and the receive halves; a response to a request of
//! this device comes back to the caller as a `LocalResponse`, not into the requester), and below them `Keys`,
//! `Wqes`, `Srqs`, `Cqs`, `Completions` (`keys.rs`, `wqe.rs`, `srq.rs`, `cqe.rs`, `flush.rs`). Packets are built
//! and read through `wire`; the device layer hands them to `link`.
//!
//! A send doorbell reaches this module one way: `mmio.rs` (the BAR write) -> `device` -> `uar.rs` (decodes it,
//! records the SQ producer counter) -> [`Datapath::run_datapath`] here (run by `device::pump`, in line or on the
//! device thread), which runs every QP's SQ, the packets in the inbox and the timers.
//!
//! # Execution
//! The SQ of a QP in RTS runs in order. A UD send (and a NOP) completes as soon as it is handed to the wire. An
//! RC WQE is in flight until a response acknowledges it: up to `MAX_IN_FLIGHT` at once, READs and atomics up
//! to the initiator depth, a fenced WQE only once no READ or atomic is in flight (`requester.rs`);
//! on a link a message leaves in packets, at most `MAX_PACKETS_IN_FLIGHT` not acknowledged (`send_window`);
//! the QP's `sq_next` is the next WQE to execute and `sq_ci` the next to complete, so completions stay in
//! order (a WQE that fails locally, or a NOP, waits for those in flight). Every device access by key goes through [`MkeyTable::access`](crate::fw::mkey::MkeyTable::access): local SGEs with the QP's PD
//! (`LOCAL_READ` to gather, `LOCAL_WRITE` for READ and atomic results), remote ones with the target QP's PD, its
//! `rre`/`rwe`/`rae` and `REMOTE_*` rights. Atomics run under the target device's lock.
//!
//! # Failures
//! Local: a malformed WQE or an unsupported opcode is `LOCAL_QP_OP_ERR`, a bad lkey `LOCAL_PROT_ERR`, a message
//! above `log_max_msg` `LOCAL_LENGTH_ERR`. Remote: bad rkey/rights/bounds `REMOTE_ACCESS_ERR`; a receive too
//! small `LOCAL_LENGTH_ERR` on that receive and `REMOTE_INVAL_REQ_ERR` at the requester; a bad lkey in the
//! receive `LOCAL_PROT_ERR` there and `REMOTE_OP_ERR` at the requester. An empty RQ (or SRQ) answers an RC SEND or
//! WRITE_IMM with an RNR NAK: the requester waits the responder's `min_rnr_nak` timer (IB table, device time)
//! and retries when the device next runs after it, `rnr_retry` times (7: forever), then `RNR_RETRY_EXC_ERR`. A
//! request that reaches no RC QP in RTR/RTS is retried after the path's ACK timeout (`4.096 us << ack_timeout`)
//! `retry_count` times, then `TRANSPORT_RETRY_EXC_ERR`; so is a request that gets no response at all within the
//! ACK timeout (lost on a link to another process). A UD send that cannot be delivered (unknown address or QP,
//! qkey mismatch, empty RQ) is dropped: the sender completes successfully. An error CQE moves its QP to ERR.
//!
//! # PSNs
//! An RC request carries the requester's send PSN for its message. The responder executes a request at the PSN
//! it expects (`next_rcv_psn`, which moves past the message's packets) and nothing else: a PSN behind it is a
//! duplicate of a message already executed (a retransmission whose response was lost), answered again without
//! executing it a second time (a READ is read again; an atomic returns the original value it returned before,
//! kept for the last `ATOMIC_REPLAY` atomics); a
//! PSN ahead of it is a PSN sequence error NAK, which the requester retransmits until its retry count runs out
//! (`TRANSPORT_RETRY_EXC_ERR`). So two QPs connected with PSNs that do not match fail as they do on hardware.
//!
//! # Errors and flushes
//! Every error CQE is written whether the WQE was signaled or not. A QP in ERR completes its outstanding WQE,
//! every send WQE up to the last doorbell and every posted receive with `WR_FLUSH_ERR`, one CQE per WQE, each
//! time the device runs.

mod common;
pub(crate) mod cqe;
// The Ethernet (NIC) datapath (issue 35).
pub(crate) mod eth;
mod flush;
mod keys;
pub(crate) mod reasm;
mod requester;
mod responder;
pub(crate) mod roce_rx;
mod srq;
mod uc;
mod ud;
mod wqe;

use crate::fw::qp::QpTable;
use crate::fw::srq::SrqTable;
use common::*;
pub(crate) use common::{Datapath, DpState};
use cqe::{Completions, Cqs};
use requester::Requester;
use responder::Responder;
use wqe::Wqes;

impl Datapath<'_> {
    /// Device time.
    #[inline]
    pub(crate) fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// Whether the firmware is dead or the device gone: the datapath does nothing.
    #[inline]
    pub(crate) fn dead(&self) -> bool {
        self.regs.dead()
    }

    /// Checks an access through `key`, without translating it.
    #[inline]
    pub(crate) fn mkey_check(
        &self,
        key: u32,
        pd: Option<u32>,
        qpn: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<&Mkey, MkeyFault> {
        self.fw.mkeys.check(key, pd, qpn, va, len, access)
    }

    /// The CQ writer's view (see `cqe.rs`): CQEs, overruns, completion events.
    #[inline]
    pub(crate) fn cqs(&mut self) -> Cqs<'_> {
        self.queues_and_cqs().2
    }

    /// The view completing work requests takes (see `cqe.rs`, `flush.rs`).
    #[inline]
    fn completions(&mut self) -> Completions<'_> {
        let (qps, srqs, cq) = self.queues_and_cqs();
        Completions { qps, srqs, cq }
    }

    /// The QP and SRQ tables beside the CQ writer: the one place both views above build it.
    #[inline]
    fn queues_and_cqs(&mut self) -> (&mut QpTable, &mut SrqTable, Cqs<'_>) {
        let fw = &mut *self.fw;
        let eq = EqPost { eqs: &mut fw.eqs, dma: self.dma, events: self.events, regs: self.regs, clock: self.clock };
        (&mut fw.qps, &mut fw.srqs, Cqs { cqs: &mut fw.cqs, caps: &fw.caps, eq })
    }

    /// The view reading WQEs takes (see `wqe.rs`).
    #[inline]
    fn wqes(&mut self) -> Wqes<'_> {
        Wqes {
            qps: &mut self.fw.qps,
            srqs: &self.fw.srqs,
            dma: self.dma,
            inline: &mut self.dp.inline,
            events: self.events,
        }
    }

    /// The send side's view (see `requester.rs`): RC requests in flight, UC and UD sends.
    #[inline]
    fn requester(&mut self) -> Requester<'_> {
        let fw = &mut *self.fw;
        Requester {
            qps: &mut fw.qps,
            srqs: &mut fw.srqs,
            cqs: &mut fw.cqs,
            eqs: &mut fw.eqs,
            mkeys: &mut fw.mkeys,
            caps: &fw.caps,
            port: &fw.port,
            dma: self.dma,
            inline: &mut self.dp.inline,
            events: self.events,
            wire: self.wire,
            regs: self.regs,
            clock: self.clock,
            next_seq: &mut self.dp.next_seq,
            rx: &self.dp.rx,
        }
    }

    /// The receive side's view (see `responder.rs`): RC requests executed and answered, UC and UD receives.
    #[inline]
    fn responder(&mut self) -> Responder<'_> {
        let fw = &mut *self.fw;
        Responder {
            qps: &mut fw.qps,
            srqs: &mut fw.srqs,
            mcgs: &fw.mcgs,
            cqs: &mut fw.cqs,
            eqs: &mut fw.eqs,
            mkeys: &mut fw.mkeys,
            caps: &fw.caps,
            port: &mut fw.port,
            q_counters: &mut fw.q_counters,
            dma: self.dma,
            inline: &mut self.dp.inline,
            events: self.events,
            wire: self.wire,
            regs: self.regs,
            clock: self.clock,
        }
    }

    // -----------------------------------------------------------------------------------------------------------
    // The engine

    /// A packet from the wire (the pump delivers it). A dead device answers nothing: an RC requester sees it lost.
    pub(crate) fn receive(&mut self, p: Packet) {
        if self.dead() {
            if let Some(r) = p.reply(Resp::Lost("destination device dead")) {
                self.wire.send(r);
            }
            return;
        }
        self.wire.inbox.push_back(p);
    }

    /// Runs the datapath until nothing more can happen now: packets in the inbox, flushes of QPs in ERR, due
    /// retries, SQs with work. Returns the packets for other devices.
    pub(crate) fn run_datapath(&mut self) -> Vec<Packet> {
        if self.dead() {
            self.wire.inbox.clear();
            return std::mem::take(&mut self.wire.outbox);
        }
        // One instant for the whole run: a retry sent now waits at least one timer tick past it, so a run never
        // spins on retries (in threaded mode the clock moves while we hold the lock).
        let now = self.now_ns();
        // Completion events their CQ's moderation held, now due.
        self.cqs().moderation_due();
        // Bounded: every pass consumes packets or WQEs; the bound only guards against a simulator bug.
        for _ in 0..1_000_000 {
            let mut busy = false;
            while let Some(p) = self.wire.inbox.pop_front() {
                self.handle(p);
                busy = true;
            }
            // Every QP in RTS or ERR with work, in number order (a step creates or destroys none).
            let mut from = 0;
            while let Some(qpn) = self.fw.qps.next_active(from) {
                busy |= self.qp_step(qpn, now);
                let Some(next) = qpn.checked_add(1) else { break };
                from = next;
            }
            busy |= self.eth_sqs_step();
            if !busy {
                break;
            }
        }
        std::mem::take(&mut self.wire.outbox)
    }

    fn handle(&mut self, p: Packet) {
        match p.body {
            Body::Rc { .. } => {
                // The answer to a request of this device goes straight to its requester.
                if let Some(r) = self.responder().rc_request(p) {
                    self.requester().rc_response(r.qpn, r.seq, r.resp, r.src_qpn);
                }
            }
            Body::Ud { .. } => self.responder().ud_receive(p),
            Body::Uc { .. } => self.responder().uc_request(p),
            Body::Resp { seq, resp } => self.requester().rc_response(p.dst_qpn, seq, resp, p.src_qpn),
            // A frame an SQ of this device sent to its own MAC.
            Body::Eth { frame } => self.eth_frame_in(&frame, &p.src),
        }
    }

    fn qp_step(&mut self, qpn: u32, now: u64) -> bool {
        let Some(qp) = self.fw.qps.get(&qpn) else { return false };
        match qp.state {
            QpState::Err => self.completions().flush(qpn),
            QpState::Rts => {
                // Nothing posted, in flight or held back: off the walk until its doorbell rings.
                if !qp.window_blocked && qp.reqs.is_empty() && qp.sq_next == qp.sq_pi {
                    self.fw.qps.deactivate(qpn);
                    return false;
                }
                // Only outstanding requests have timers; only a window that held packets back has more to send.
                let (blocked, idle) = (qp.window_blocked, qp.reqs.is_empty());
                // One send-side view for the whole step: building it costs as much as a small call.
                let mut rq = self.requester();
                let retried = !idle && rq.retry_due(qpn, now);
                let more = blocked && rq.send_window(qpn);
                rq.sq_progress(qpn) || retried || more
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::mmio::SimMmio;
    use crate::testkit::submit::{put, Bell, Cqe, Mr, QpSpec, RcParams, Rdma, Remote, TAv, TCq, TQp, Wqe};
    use mlx5_core::hal::Mmio;
    use mlx5_core::prm::ifc;
    use mlx5_core::prm::MsgBuf;

    use consts::{
        MLX5_CQE_REQ as REQ, MLX5_CQE_REQ_ERR as REQ_ERR, MLX5_CQE_RESP_ERR as RESP_ERR,
        MLX5_CQE_RESP_SEND as RESP_SEND, MLX5_CQE_RESP_SEND_IMM as RESP_SEND_IMM, MLX5_CQE_RESP_WR_IMM as RESP_WR_IMM,
        MLX5_OPCODE_ATOMIC_CS as ATOMIC_CS, MLX5_OPCODE_ATOMIC_FA as ATOMIC_FA, MLX5_OPCODE_RDMA_READ as RDMA_READ,
        MLX5_OPCODE_RDMA_WRITE as RDMA_WRITE, MLX5_OPCODE_RDMA_WRITE_IMM as RDMA_WRITE_IMM, MLX5_OPCODE_SEND as SEND,
        MLX5_OPCODE_SEND_IMM as SEND_IMM,
    };

    /// Two RC QPs of one device connected to each other (loopback), each with a send and a receive CQ, and one
    /// memory region both use.
    struct Pair {
        r: Rdma,
        a: TQp,
        b: TQp,
        a_scq: TCq,
        a_rcq: TCq,
        b_scq: TCq,
        b_rcq: TCq,
        mr: Mr,
    }

    fn pair_with(cfg: SimConfig, spec: QpSpec, pa: RcParams, pb: RcParams) -> Pair {
        let mut r = Rdma::new(cfg);
        let (a_scq, a_rcq, b_scq, b_rcq) = (r.cq(5), r.cq(5), r.cq(5), r.cq(5));
        let a = r.qp(spec, a_scq.cqn, a_rcq.cqn);
        let b = r.qp(spec, b_scq.cqn, b_rcq.cqn);
        let (ra, rb) = (r.me(a.qpn), r.me(b.qpn));
        r.connect_rc(&a, &rb, pa);
        r.connect_rc(&b, &ra, pb);
        let mr = r.mr(64 * 1024);
        Pair { r, a, b, a_scq, a_rcq, b_scq, b_rcq, mr }
    }

    fn pair() -> Pair {
        pair_with(SimConfig::default(), QpSpec::rc(), RcParams::default(), RcParams::default())
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|k| (k as u8).wrapping_mul(7).wrapping_add(seed)).collect()
    }

    fn count(r: &Rdma, f: impl Fn(&SimEvent) -> bool) -> usize {
        r.h.dev.events().iter().filter(|e| f(e)).count()
    }

    #[test]
    fn rc_send_recv_over_loopback_moves_the_data() {
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let src = pattern(200, 1);
        p.mr.write(0, &src);
        p.r.post_recv(&mut p.b, &[(base + 4096, 50, key), (base + 8192, 100, key)]);
        let w = Wqe::new(SEND_IMM).imm(0xdead_beef).solicited().data(30, key, base).data(70, key, base + 100);
        assert_eq!(p.r.post_send(&mut p.a, &w, Bell::Db), 0);
        let e = p.r.poll(&mut p.a_scq).expect("requester CQE");
        assert_eq!((e.status(), e.wqe_opcode(), e.qpn(), e.wqe_counter()), ((REQ, 0), SEND_IMM, p.a.qpn, 0));
        let e = p.r.poll(&mut p.b_rcq).expect("responder CQE");
        assert_eq!(
            (e.opcode(), e.byte_cnt(), e.imm(), e.qpn(), e.wqe_counter()),
            (RESP_SEND_IMM, 100, 0xdead_beef, p.b.qpn, 0)
        );
        // RoCE always carries a GRH (here RoCE v2, bit 27, over IPv6, the L3 header type in bits 26:24); the source
        // QP is the requester.
        let v2_ipv6 = 1 << 3 | consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV6;
        assert_eq!(e.flags_rqpn(), p.a.qpn | 1 << 28 | v2_ipv6 << 24);
        assert!(e.solicited());
        let got = [p.mr.read(4096, 50), p.mr.read(8192, 50)].concat();
        assert_eq!(got, [&src[..30], &src[100..170]].concat());
        // Nothing beyond the message was written.
        assert_eq!(p.mr.read(8192 + 50, 50), vec![0u8; 50]);
        assert!(p.r.h.dev.events().contains(&SimEvent::SqDoorbell { qpn: p.a.qpn, pi: 1 }));
        let (ia, ib) = (p.r.h.dev.qp_info(p.a.qpn).unwrap(), p.r.h.dev.qp_info(p.b.qpn).unwrap());
        assert_eq!((ia.sq_ci, ia.sq_pi, ia.next_send_psn, ia.outstanding), (1, 1, 0x101, false));
        assert_eq!((ib.rq_ci, ib.next_rcv_psn), (1, 0x101));
        assert!(p.r.poll(&mut p.a_scq).is_none() && p.r.poll(&mut p.b_rcq).is_none());
        assert!(p.r.h.dev.dma_faults().is_empty());
    }

    #[test]
    fn rdma_write_write_imm_read_and_atomics() {
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let src = pattern(300, 9);
        p.mr.write(0, &src);
        // WRITE: no receive is consumed, nothing completes at the responder.
        let w = Wqe::new(RDMA_WRITE).raddr(base + 2000, key).data(64, key, base).data(36, key, base + 200);
        p.r.post_send(&mut p.a, &w, Bell::Db);
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!((e.status(), e.wqe_opcode(), e.byte_cnt()), ((REQ, 0), RDMA_WRITE, 100));
        assert_eq!(p.mr.read(2000, 100), [&src[..64], &src[200..236]].concat());
        assert!(p.r.poll(&mut p.b_rcq).is_none());
        assert_eq!(p.r.h.dev.qp_info(p.b.qpn).unwrap().rq_ci, 0);
        // WRITE_IMM consumes a receive (no scatter) and completes it with the immediate.
        p.r.post_recv(&mut p.b, &[]);
        let w = Wqe::new(RDMA_WRITE_IMM).imm(0x1234_5678).raddr(base + 3000, key).data(10, key, base + 50);
        p.r.post_send(&mut p.a, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().wqe_opcode(), RDMA_WRITE_IMM);
        let e = p.r.poll(&mut p.b_rcq).unwrap();
        assert_eq!((e.opcode(), e.byte_cnt(), e.imm(), e.wqe_counter()), (RESP_WR_IMM, 10, 0x1234_5678, 0));
        assert_eq!(p.mr.read(3000, 10), src[50..60]);
        // READ into two local SGEs.
        let remote = pattern(48, 77);
        p.mr.write(5000, &remote);
        let w = Wqe::new(RDMA_READ).raddr(base + 5000, key).data(16, key, base + 6000).data(32, key, base + 7000);
        p.r.post_send(&mut p.a, &w, Bell::Db);
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!((e.status(), e.wqe_opcode(), e.byte_cnt(), e.wqe_counter()), ((REQ, 0), RDMA_READ, 48, 2));
        assert_eq!([p.mr.read(6000, 16), p.mr.read(7000, 32)].concat(), remote);
        // Atomics on big-endian memory; the original value lands in the local SGE.
        p.mr.write(8000, &5u64.to_be_bytes());
        let cs = |swap: u64, cmp: u64| {
            Wqe::new(ATOMIC_CS).raddr(base + 8000, key).atomic(swap, cmp).data(8, key, base + 9000)
        };
        p.r.post_send(&mut p.a, &cs(9, 5), Bell::Db);
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!((e.status(), e.wqe_opcode(), e.byte_cnt()), ((REQ, 0), ATOMIC_CS, 8));
        assert_eq!(
            (p.mr.read(9000, 8), p.mr.read(8000, 8)),
            (5u64.to_be_bytes().to_vec(), 9u64.to_be_bytes().to_vec())
        );
        // A failed compare swaps nothing.
        p.r.post_send(&mut p.a, &cs(11, 5), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        assert_eq!(
            (p.mr.read(9000, 8), p.mr.read(8000, 8)),
            (9u64.to_be_bytes().to_vec(), 9u64.to_be_bytes().to_vec())
        );
        let fa = Wqe::new(ATOMIC_FA).raddr(base + 8000, key).atomic(0x100, 0).data(8, key, base + 9008);
        p.r.post_send(&mut p.a, &fa, Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().wqe_opcode(), ATOMIC_FA);
        assert_eq!(
            (p.mr.read(9008, 8), p.mr.read(8000, 8)),
            (9u64.to_be_bytes().to_vec(), 0x109u64.to_be_bytes().to_vec())
        );
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().state, QpState::Rts);
    }

    #[test]
    fn inline_sends_and_unsignaled_wqes() {
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        p.r.post_recv(&mut p.b, &[(base, 64, key)]);
        p.r.post_recv(&mut p.b, &[(base + 64, 64, key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).unsignaled().inline(b"hello, inline"), Bell::Db);
        // Unsignaled: no requester CQE, but the WQE is done.
        assert!(p.r.poll(&mut p.a_scq).is_none());
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().sq_ci, 1);
        assert_eq!(p.r.poll(&mut p.b_rcq).unwrap().byte_cnt(), 13);
        assert_eq!(p.mr.read(0, 13), b"hello, inline");
        // 60 inline bytes: ctrl + 4 + 60 = 80 bytes, two basic blocks.
        let long = pattern(60, 3);
        assert_eq!(p.r.post_send(&mut p.a, &Wqe::new(SEND).inline(&long), Bell::Db), 1);
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!((e.status(), e.wqe_counter()), ((REQ, 0), 1));
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().sq_ci, 3);
        assert_eq!(p.mr.read(64, 60), long);
        let e = p.r.poll(&mut p.b_rcq).unwrap();
        assert_eq!((e.opcode(), e.byte_cnt(), e.wqe_counter()), (RESP_SEND, 60, 1));
    }

    fn ud_env(cfg: SimConfig) -> (Rdma, TQp, TQp, TCq, TCq, Mr) {
        let mut r = Rdma::new(cfg);
        let (scq, rcq) = (r.cq(5), r.cq(5));
        let ua = r.qp(QpSpec::ud(), scq.cqn, rcq.cqn);
        let ub = r.qp(QpSpec::ud(), scq.cqn, rcq.cqn);
        r.ready_ud(&ua, 0x11);
        r.ready_ud(&ub, 0x11);
        let mr = r.mr(16 * 1024);
        (r, ua, ub, scq, rcq, mr)
    }

    fn roce_av(r: &Rdma, dqpn: u32, qkey: u32) -> TAv {
        let me = r.me(dqpn);
        TAv {
            dqpn,
            qkey,
            grh: true,
            hop_limit: 64,
            tclass: 0x20,
            flow_label: 0x1_2345,
            rgid: me.gid,
            rmac: me.mac,
            ..TAv::default()
        }
    }

    #[test]
    fn ud_send_over_loopback_gets_a_grh_and_checks_the_qkey() {
        let (r, mut ua, mut ub, mut scq, mut rcq, mr) = ud_env(SimConfig::default());
        let (key, base) = (mr.key, mr.addr());
        let payload = pattern(64, 5);
        mr.write(0, &payload);
        r.post_recv(&mut ub, &[(base + 1000, 40 + 64, key)]);
        let av = roce_av(&r, ub.qpn, 0x11);
        r.post_send(&mut ua, &Wqe::new(SEND_IMM).imm(7).av(&av).data(64, key, base), Bell::Db);
        let e = r.poll(&mut scq).unwrap();
        assert_eq!((e.status(), e.wqe_opcode(), e.qpn()), ((REQ, 0), SEND_IMM, ua.qpn));
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!((e.opcode(), e.byte_cnt(), e.imm(), e.qpn()), (RESP_SEND_IMM, 104, 7, ub.qpn));
        // GRH present; RoCE v2 (bit 27) over IPv6 (L3 header type IPv6 in bits 26:24).
        let l3 = 1 << 3 | consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV6;
        assert_eq!(e.flags_rqpn(), ua.qpn | 1 << 28 | l3 << 24);
        let grh = mr.read(1000, GRH_BYTES);
        let w0 = u32::from_be_bytes([grh[0], grh[1], grh[2], grh[3]]);
        assert_eq!((w0 >> 28, (w0 >> 20) & 0xff, w0 & 0xf_ffff), (6, 0x20, 0x1_2345));
        // The IPv6 header: payload length UDP + BTH + DETH + ImmDt + 64 + ICRC, next header UDP.
        assert_eq!((u16::from_be_bytes([grh[4], grh[5]]), grh[6], grh[7]), (8 + 12 + 8 + 4 + 64 + 4, 17, 64));
        let gid = r.h.dev.gid(0).unwrap();
        assert_eq!((&grh[8..24], &grh[24..40]), (&gid[..], &gid[..]));
        assert_eq!(mr.read(1040, 64), payload);
        // A wrong qkey: dropped, the sender still completes.
        r.post_recv(&mut ub, &[(base + 2000, 200, key)]);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&roce_av(&r, ub.qpn, 0x12)).data(8, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        assert!(r.poll(&mut rcq).is_none());
        let dropped = SimEvent::UdDropped { qpn: ua.qpn, dqpn: ub.qpn, why: "qkey mismatch" };
        assert!(r.h.dev.events().contains(&dropped));
        // libmlx5 leaves the GRH bit of a RoCE AV clear (reserved on Ethernet): the GRH fields count all the same.
        let mut no_bit = roce_av(&r, ub.qpn, 0x11);
        no_bit.grh = false;
        r.post_recv(&mut ub, &[(base + 2000, 200, key)]);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&no_bit).data(8, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!((e.opcode(), e.byte_cnt(), e.wqe_counter()), (RESP_SEND, 48, 1));
        assert_eq!(mr.read(2000 + 8, 16), gid[..].to_vec());
        // A qkey with the high bit set uses the sender QP's own qkey (0x11).
        r.post_send(&mut ua, &Wqe::new(SEND).av(&roce_av(&r, ub.qpn, 0x8000_0000)).data(8, key, base), Bell::Db);
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!((e.opcode(), e.byte_cnt(), e.wqe_counter()), (RESP_SEND, 48, 2));
        // An unknown GID, an unknown QP and an empty RQ drop too.
        let mut far = roce_av(&r, ub.qpn, 0x11);
        far.rgid[15] ^= 1;
        r.post_send(&mut ua, &Wqe::new(SEND).av(&far).data(8, key, base), Bell::Db);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&roce_av(&r, 0xfff, 0x11)).data(8, key, base), Bell::Db);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&roce_av(&r, ub.qpn, 0x11)).data(8, key, base), Bell::Db);
        let whys: Vec<&str> =
            r.h.dev
                .events()
                .iter()
                .filter_map(|e| if let SimEvent::UdDropped { why, .. } = e { Some(*why) } else { None })
                .collect();
        assert_eq!(
            whys,
            [
                "qkey mismatch",
                "unknown destination (not connected)",
                "no UD QP in RTR/RTS at the destination",
                "receive queue empty"
            ]
        );
        assert_eq!(r.drain(&mut scq).len(), 4);
        // A receive too small for GRH + payload: local length error there, and that QP goes to ERR.
        r.post_recv(&mut ub, &[(base + 3000, 50, key)]);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&roce_av(&r, ub.qpn, 0x11)).data(64, key, base), Bell::Db);
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!(
            (e.status(), e.wqe_counter(), e.qpn()),
            ((RESP_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR), 3, ub.qpn)
        );
        assert_ne!(e.vendor_err(), 0);
        assert_eq!(r.h.dev.qp_info(ub.qpn).unwrap().error, Some(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR));
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        assert_eq!(r.h.dev.qp_info(ua.qpn).unwrap().state, QpState::Rts);
    }

    #[test]
    fn a_ud_send_to_a_gid_the_driver_programmed_loops_back_on_the_port() {
        // The netdev's IPv4 address as mlx5_ib programs it (SET_ROCE_ADDRESS), not one of the wire's configured
        // addresses: rdma_cm's and rdma-core's tests on one port send to it with the port's own MAC.
        let (mut r, mut ua, mut ub, mut scq, mut rcq, mr) = ud_env(SimConfig::default());
        let ip_gid = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 36, 0, 1];
        let (key, base) = (mr.key, mr.addr());
        let mut av = roce_av(&r, ub.qpn, 0x11);
        av.rgid = ip_gid;
        r.post_recv(&mut ub, &[(base + 1000, 40 + 8, key)]);
        // Before the GID is in the table nobody on the wire has it.
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(8, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        assert!(r.poll(&mut rcq).is_none());
        assert_eq!(r.h.set_roce_address(1, ip_gid), (0, 0));
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(8, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let e = r.poll(&mut rcq).expect("the send came back to the port");
        assert_eq!((e.opcode(), e.qpn(), e.byte_cnt()), (RESP_SEND, ub.qpn, 48));
    }

    #[test]
    fn a_ud_send_to_a_multicast_gid_reaches_every_qp_attached_on_the_port() {
        let (mut r, mut ua, mut ub, mut scq, mut rcq, mr) = ud_env(SimConfig::default());
        let uc = r.qp(QpSpec::ud(), scq.cqn, rcq.cqn);
        r.ready_ud(&uc, 0x11);
        let mut uc = uc;
        let group = [0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xe0, 0, 0, 7];
        let attach = |r: &mut Rdma, op: u16, qpn: u32| {
            use ifc::attach_to_mcg_in as i;
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::OPCODE, op.into());
            inp.set(i::QPN, qpn);
            let at = i::MULTICAST_GID.byte_off();
            inp[at..at + 16].copy_from_slice(&group);
            r.h.cmd(&inp, ifc::attach_to_mcg_out::SIZE_BYTES).0
        };
        assert_eq!(attach(&mut r, consts::MLX5_CMD_OP_ATTACH_TO_MCG, ub.qpn), 0);
        assert_eq!(attach(&mut r, consts::MLX5_CMD_OP_ATTACH_TO_MCG, uc.qpn), 0);
        let (key, base) = (mr.key, mr.addr());
        mr.write(0, &pattern(32, 3));
        r.post_recv(&mut ub, &[(base + 1000, 40 + 32, key)]);
        r.post_recv(&mut uc, &[(base + 2000, 40 + 32, key)]);
        // The multicast QPN and the group's GID; the MAC is the IPv4 multicast one it maps to.
        let mut av = roce_av(&r, 0xff_ffff, 0x11);
        (av.rgid, av.rmac) = (group, [0x01, 0x00, 0x5e, 0, 0, 7]);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(32, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let mut got: Vec<u32> = r.drain(&mut rcq).iter().map(|e| e.qpn()).collect();
        got.sort();
        assert_eq!(got, [ub.qpn, uc.qpn]);
        assert_eq!((mr.read(1040, 32), mr.read(2040, 32)), (pattern(32, 3), pattern(32, 3)));
        // After C leaves the group only B gets the next one; the sender's completion is the same.
        assert_eq!(attach(&mut r, consts::MLX5_CMD_OP_DETACH_FROM_MCG, uc.qpn), 0);
        r.post_recv(&mut ub, &[(base + 3000, 40 + 32, key)]);
        r.post_recv(&mut uc, &[(base + 4000, 40 + 32, key)]);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(32, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let got: Vec<u32> = r.drain(&mut rcq).iter().map(|e| e.qpn()).collect();
        assert_eq!(got, [ub.qpn]);
        // RoCE v2's IPv4 group form (rdma_cm's join of 239.1.2.3) works the same.
        let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 239, 1, 2, 3];
        let mut inp = vec![0u8; ifc::attach_to_mcg_in::SIZE_BYTES];
        inp.set(ifc::attach_to_mcg_in::OPCODE, consts::MLX5_CMD_OP_ATTACH_TO_MCG.into());
        inp.set(ifc::attach_to_mcg_in::QPN, uc.qpn);
        let at = ifc::attach_to_mcg_in::MULTICAST_GID.byte_off();
        inp[at..at + 16].copy_from_slice(&v4);
        assert_eq!(r.h.cmd(&inp, ifc::attach_to_mcg_out::SIZE_BYTES).0, 0);
        r.post_recv(&mut uc, &[(base + 5000, 40 + 32, key)]);
        let mut av4 = av;
        (av4.rgid, av4.rmac) = (v4, [0x01, 0x00, 0x5e, 0x01, 0x02, 0x03]);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av4).data(32, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let got: Vec<u32> = r.drain(&mut rcq).iter().map(|e| e.qpn()).collect();
        assert_eq!(got, [uc.qpn]);
        // With no QP left in the group the packet is dropped, and said why.
        assert_eq!(attach(&mut r, consts::MLX5_CMD_OP_DETACH_FROM_MCG, ub.qpn), 0);
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(32, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        assert!(r.poll(&mut rcq).is_none());
        let why = "no QP attached to the multicast group";
        assert!(r.h.dev.events().iter().any(|e| matches!(e, SimEvent::UdDropped { why: w, .. } if *w == why)));
    }

    #[test]
    fn ib_ud_without_a_grh_gets_zeros_with_the_ip_version() {
        let cfg = SimConfig { port_type: crate::config::PortType::Ib, lid: 5, ..SimConfig::default() };
        let (r, mut ua, mut ub, mut scq, mut rcq, mr) = ud_env(cfg);
        let (key, base) = (mr.key, mr.addr());
        mr.write(0, b"ib datagram");
        mr.write(1000, &[0xee; 40]);
        r.post_recv(&mut ub, &[(base + 1000, 128, key)]);
        let av = TAv { dqpn: ub.qpn, qkey: 0x11, rlid: 5, sl: 6, ..TAv::default() };
        r.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(11, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let e = r.poll(&mut rcq).unwrap();
        // No GRH flag; the SL in bits 27:24; the sender's LID.
        assert_eq!((e.byte_cnt(), e.flags_rqpn(), e.slid()), (51, ua.qpn | 6 << 24, 5));
        let mut grh = vec![0u8; 40];
        grh[0] = 0x60;
        assert_eq!(mr.read(1000, 40), grh);
        assert_eq!(mr.read(1040, 11), b"ib datagram");
        // Another LID is nobody's.
        let far = TAv { rlid: 6, ..av };
        r.post_send(&mut ua, &Wqe::new(SEND).av(&far).data(11, key, base), Bell::Db);
        let why = "unknown destination (not connected)";
        assert!(r.h.dev.events().contains(&SimEvent::UdDropped { qpn: ua.qpn, dqpn: ub.qpn, why }));
    }

    #[test]
    fn the_gsi_qp_is_qpn_1_on_the_wire_both_ways() {
        // mlx5_ib's hardware GSI QP gets an ordinary QPN from CREATE_QP (st QP1); MADs address it as QP1 and it
        // sends as QP1 (IBA 3.5.4). Before, a packet to QPN 1 was dropped and its sends carried the device QPN.
        let cfg = SimConfig { port_type: crate::config::PortType::Ib, lid: 5, ..SimConfig::default() };
        let mut r = Rdma::new(cfg);
        let (mut scq, mut rcq) = (r.cq(5), r.cq(5));
        let mut ua = r.qp(QpSpec::ud(), scq.cqn, rcq.cqn);
        let mut gsi = r.qp(QpSpec { st: consts::MLX5_QP_ST_QP1, ..QpSpec::ud() }, scq.cqn, rcq.cqn);
        const QP1_QKEY: u32 = 0x8001_0000;
        // The high bit of a send's Q_Key means "the QP's own" (a controlled Q_Key): the sender holds QP1's.
        r.ready_ud(&ua, QP1_QKEY);
        r.ready_ud(&gsi, QP1_QKEY);
        let mr = r.mr(16 * 1024);
        let (key, base) = (mr.key, mr.addr());
        mr.write(0, &pattern(256, 3));
        r.post_recv(&mut gsi, &[(base + 4096, 512, key)]);
        let to_qp1 = TAv { dqpn: 1, qkey: QP1_QKEY, rlid: 5, ..TAv::default() };
        r.post_send(&mut ua, &Wqe::new(SEND).av(&to_qp1).data(256, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!((e.qpn(), e.flags_rqpn() & 0xff_ffff, e.byte_cnt()), (gsi.qpn, ua.qpn, 40 + 256));
        // A GSI receive's CQE carries the packet's P_Key (the sender's index 0: the default P_Key) where the
        // immediate goes; mlx5_ib finds its pkey index from it (with 0 there, ib_cm rejected every REQ).
        assert_eq!(e.imm(), 0xffff);
        // The GSI QP answers: the receiver sees source QPN 1.
        r.post_recv(&mut ua, &[(base + 8192, 512, key)]);
        let back = TAv { dqpn: ua.qpn, ..to_qp1 };
        r.post_send(&mut gsi, &Wqe::new(SEND).av(&back).data(256, key, base), Bell::Db);
        assert_eq!(r.poll(&mut scq).unwrap().status(), (REQ, 0));
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!((e.qpn(), e.flags_rqpn() & 0xff_ffff), (ua.qpn, 1));
        // An ordinary UD QP's CQE has no P_Key there: a SEND without immediate leaves the field 0.
        assert_eq!(e.imm(), 0);
        // No SMI QP on this device: a packet to QP0 is dropped.
        let to_qp0 = TAv { dqpn: 0, ..to_qp1 };
        r.post_send(&mut ua, &Wqe::new(SEND).av(&to_qp0).data(256, key, base), Bell::Db);
        let why = "no SMI/GSI QP at the destination";
        assert!(r.h.dev.events().contains(&SimEvent::UdDropped { qpn: ua.qpn, dqpn: 0, why }));
    }

    /// An XRC SRQ of 16 WQEs of 32 bytes in domain `xrcd`, completing to `cqn` with user index `uidx`; its ring
    /// and doorbell record.
    fn xrc_srq(
        r: &mut Rdma,
        xrcd: u32,
        cqn: u32,
        uidx: u32,
    ) -> (u32, mlx5_core::hal::DmaRegion, mlx5_core::hal::DmaRegion) {
        use ifc::xrc_srqc as q;
        use mlx5_core::hal::Dma;
        let (ring, dbr) = (r.h.dma.alloc(4096, 4096).unwrap(), r.h.dma.alloc(64, 64).unwrap());
        let c = ifc::create_xrc_srq_in::XRC_SRQ_CONTEXT_ENTRY;
        let mut inp = vec![0u8; ifc::create_xrc_srq_in::SIZE_BYTES + 8];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_XRC_SRQ.into());
        inp.set(q::LOG_XRC_SRQ_SIZE.at(c), 4);
        inp.set(q::LOG_RQ_STRIDE.at(c), 1);
        inp.set(q::PD.at(c), r.pd);
        inp.set(q::XRCD.at(c), xrcd);
        inp.set(q::CQN.at(c), cqn);
        inp.set(q::USER_INDEX.at(c), uidx);
        inp.set(q::DB_RECORD_ADDR_H.at(c), (dbr.iova() >> 32) as u32);
        inp.set(q::DB_RECORD_ADDR_L.at(c), (dbr.iova() as u32) >> 2);
        inp.set64(ifc::create_xrc_srq_in::PAS.elem(0), ring.iova());
        let (s, y, out) = r.h.cmd(&inp, ifc::create_xrc_srq_out::SIZE_BYTES);
        assert_eq!((s, y), (0, 0), "CREATE_XRC_SRQ");
        (MsgBuf::get(&out[..], ifc::create_xrc_srq_out::XRC_SRQN), ring, dbr)
    }

    /// Posts WQE `index` of an XRC SRQ's 32-byte ring: its next segment, then one data segment; the doorbell
    /// record counts `index + 1` posted.
    fn xrc_srq_post(
        ring: &mlx5_core::hal::DmaRegion,
        dbr: &mlx5_core::hal::DmaRegion,
        index: u16,
        sge: (u64, u32, u32),
    ) {
        use c::mlx5_wqe_data_seg as d;
        let mut w = [0u8; 32];
        let next = c::mlx5_wqe_srq_next_seg::NEXT_WQE_INDEX;
        w[next.off..next.off + 2].copy_from_slice(&(index + 1).to_be_bytes());
        let at = c::mlx5_wqe_srq_next_seg::SIZE;
        d::BYTE_COUNT.put_be(&mut w, at, sge.1);
        d::LKEY.put_be(&mut w, at, sge.2);
        w[at + d::ADDR.off..at + d::ADDR.end()].copy_from_slice(&sge.0.to_be_bytes());
        put(ring, usize::from(index) * 32, &w);
        put(dbr, 0, &u32::from(index + 1).to_be_bytes());
    }

    #[test]
    fn an_xrc_send_goes_from_an_initiator_through_a_target_into_the_xrc_srq_its_wqe_names() {
        // rdma-core's test_xrc: the initiator's WQE names the remote XRC SRQ (`mlx5_wqe_xrc_seg`); the target QP
        // (created as mlx5_ib's create_xrc_tgt_qp does: no SQ, no RQ) receives into that SRQ, whose CQ gets the
        // CQE, carrying the target's QPN and the SRQ's user index (rdma-core's `get_resp_ctx_v1` finds the SRQ by
        // it). An SRQ of another domain, or no SRQ, is an invalid request: the initiator's WQE fails with it.
        use ifc::qpc as q;
        let cfg = SimConfig { port_type: crate::config::PortType::Ib, lid: 5, ..SimConfig::default() };
        let mut r = Rdma::new(cfg);
        let (mut scq, mut xcq, dcq) = (r.cq(5), r.cq(5), r.cq(5));
        let (xrcd, other) = (r.h.alloc_xrcd(), r.h.alloc_xrcd());
        let (srqn, ring, dbr) = xrc_srq(&mut r, xrcd, xcq.cqn, 0x55);
        let (foreign, _fring, _fdbr) = xrc_srq(&mut r, other, xcq.cqn, 0x66);
        let xrc = |srqn: u32, xrcd: u32| {
            move |i: &mut Vec<u8>| {
                let at = |f: mlx5_core::prm::Field| f.at(ifc::create_qp_in::QPC);
                i.set(at(q::RQ_TYPE), consts::MLX5_SRQ_RQ);
                i.set(at(q::SRQN_RMPN_XRQN), srqn);
                i.set(at(q::XRCD), xrcd);
            }
        };
        let st = consts::MLX5_QP_ST_XRC;
        let mut ini = r.qp_with(QpSpec { st, zero_rq: true, ..QpSpec::rc() }, scq.cqn, dcq.cqn, xrc(srqn, other));
        let tgt =
            r.qp_with(QpSpec { st, zero_rq: true, no_sq: true, ..QpSpec::rc() }, dcq.cqn, dcq.cqn, xrc(srqn, xrcd));
        let (to_tgt, to_ini) = (r.me(tgt.qpn), r.me(ini.qpn));
        r.connect_rc(&ini, &to_tgt, RcParams::default());
        r.connect_rc(&tgt, &to_ini, RcParams::default());
        let mr = r.mr(8192);
        let (key, base) = (mr.key, mr.addr());
        mr.write(0, b"across the domain");
        xrc_srq_post(&ring, &dbr, 0, (base + 4096, 64, key));
        let xrc_seg = |n: u32| {
            let mut s = [0u8; c::mlx5_wqe_xrc_seg::SIZE];
            c::mlx5_wqe_xrc_seg::XRC_SRQN.put_be(&mut s, 0, n);
            s
        };
        r.post_send(&mut ini, &Wqe::new(SEND).seg(&xrc_seg(srqn)).data(17, key, base), Bell::Db);
        let e = r.poll(&mut scq).unwrap();
        assert_eq!((e.status(), e.qpn()), ((REQ, 0), ini.qpn));
        let e = r.poll(&mut xcq).expect("the receive completes to the XRC SRQ's CQ");
        assert_eq!((e.status(), e.qpn(), e.srqn_uidx(), e.byte_cnt()), ((RESP_SEND, 0), tgt.qpn, 0x55, 17));
        assert_eq!(mr.read(4096, 17), b"across the domain");
        // An XRC SRQ of another domain: an invalid request NAK, the initiator's WQE fails with it.
        xrc_srq_post(&ring, &dbr, 1, (base + 4096, 64, key));
        r.post_send(&mut ini, &Wqe::new(SEND).seg(&xrc_seg(foreign)).data(17, key, base), Bell::Db);
        let e = r.poll(&mut scq).unwrap();
        assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR));
        assert!(r.h.dev.events().contains(&SimEvent::XrcRefused { qpn: tgt.qpn, xrc_srqn: foreign }));
        assert!(r.poll(&mut xcq).is_none(), "nothing received");
        // A number that is no SRQ at all, from a second pair: the same.
        let mut ini2 = r.qp_with(QpSpec { st, zero_rq: true, ..QpSpec::rc() }, scq.cqn, dcq.cqn, xrc(srqn, other));
        let tgt2 =
            r.qp_with(QpSpec { st, zero_rq: true, no_sq: true, ..QpSpec::rc() }, dcq.cqn, dcq.cqn, xrc(srqn, xrcd));
        let (to_tgt2, to_ini2) = (r.me(tgt2.qpn), r.me(ini2.qpn));
        r.connect_rc(&ini2, &to_tgt2, RcParams::default());
        r.connect_rc(&tgt2, &to_ini2, RcParams::default());
        r.post_send(&mut ini2, &Wqe::new(SEND).seg(&xrc_seg(0x7777)).data(17, key, base), Bell::Db);
        let e = r.poll(&mut scq).unwrap();
        assert_eq!((e.qpn(), e.status()), (ini2.qpn, (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR)));
        assert!(r.h.dev.events().contains(&SimEvent::XrcRefused { qpn: tgt2.qpn, xrc_srqn: 0x7777 }));
        assert!(r.poll(&mut xcq).is_none(), "nothing received");
    }

    #[test]
    fn every_cqe_of_a_qp_carries_its_user_index() {
        // rdma-core's mlx5 provider (cqe_version 1) finds the QP of a CQE by `srqn_uidx`, the user index it gave
        // the QP at creation. With 0 in every CQE, a process with two QPs (perftest's -R: its rdma_cm exchange QP
        // and the test's) took the test QP's completions as the other's and read a wild wr_id.
        let cfg = SimConfig { port_type: crate::config::PortType::Ib, lid: 5, ..SimConfig::default() };
        let mut r = Rdma::new(cfg);
        let (mut scq, mut rcq) = (r.cq(5), r.cq(5));
        let cqns = (scq.cqn, rcq.cqn);
        let with_uidx = |r: &mut Rdma, uidx: u32| {
            let spec = QpSpec::ud();
            let (mut inp, pages, dbr) = r.create_qp_in(spec, cqns.0, cqns.1);
            inp.set(ifc::qpc::USER_INDEX.at(ifc::create_qp_in::QPC), uidx);
            let (s, y, out) = r.h.cmd(&inp, ifc::create_qp_out::SIZE_BYTES);
            assert_eq!((s, y), (0, 0));
            let qpn = MsgBuf::get(&out[..], ifc::create_qp_out::QPN);
            let bf_off = consts::MLX5_BF_OFFSET as usize;
            TQp { qpn, spec, pages, dbr, uar: r.uar, sq_pi: 0, rq_head: 0, bf_off }
        };
        let mut a = with_uidx(&mut r, 7);
        let mut b = with_uidx(&mut r, 0x00ab_cdef);
        r.ready_ud(&a, 0x11);
        r.ready_ud(&b, 0x11);
        let mr = r.mr(8192);
        let (key, base) = (mr.key, mr.addr());
        r.post_recv(&mut b, &[(base + 4096, 512, key)]);
        let av = TAv { dqpn: b.qpn, qkey: 0x11, rlid: 5, ..TAv::default() };
        r.post_send(&mut a, &Wqe::new(SEND).av(&av).data(64, key, base), Bell::Db);
        let e = r.poll(&mut scq).unwrap();
        assert_eq!((e.status(), e.qpn(), e.srqn_uidx()), ((REQ, 0), a.qpn, 7));
        let e = r.poll(&mut rcq).unwrap();
        assert_eq!((e.status(), e.qpn(), e.srqn_uidx()), ((RESP_SEND, 0), b.qpn, 0x00ab_cdef));
        // An error CQE too: a send through a key that does not exist.
        r.post_send(&mut a, &Wqe::new(SEND).av(&av).data(64, key ^ 0x100, base), Bell::Db);
        let e = r.poll(&mut scq).unwrap();
        assert_eq!((e.opcode(), e.srqn_uidx()), (REQ_ERR, 7));
    }

    #[test]
    fn the_rings_wrap_with_wqes_straddling_the_end_of_the_sq() {
        // 8 basic blocks of SQ, 4 receives, CQs of 8 entries: everything wraps several times.
        let spec = QpSpec { log_sq: 3, log_rq: 2, ..QpSpec::rc() };
        let mut p = pair_with(SimConfig::default(), spec, RcParams::default(), RcParams::default());
        let (mut a_scq, mut b_rcq) = (p.r.cq(3), p.r.cq(3));
        // Fresh QPs on the small CQs.
        let a = p.r.qp(spec, a_scq.cqn, a_scq.cqn);
        let b = p.r.qp(spec, b_rcq.cqn, b_rcq.cqn);
        let (ra, rb) = (p.r.me(a.qpn), p.r.me(b.qpn));
        p.r.connect_rc(&a, &rb, RcParams::default());
        p.r.connect_rc(&b, &ra, RcParams::default());
        let (mut a, mut b) = (a, b);
        let (key, base) = (p.mr.key, p.mr.addr());
        p.mr.write(0, &pattern(4096, 11));
        // One 1-BB WQE, then 2-BB WQEs at odd indices: the one at index 7 wraps to index 0.
        let mut expect_index = 0u16;
        for k in 0..21u64 {
            p.r.post_recv(&mut b, &[(base + 8192 + (k % 4) * 512, 512, key)]);
            let nseg: u64 = if k == 0 { 3 } else { 7 };
            let mut w = Wqe::new(SEND);
            for s in 0..nseg {
                w = w.data(8, key, base + k * 64 + s * 8);
            }
            let bell = if k % 3 == 0 { Bell::Bf } else { Bell::Db };
            assert_eq!(p.r.post_send(&mut a, &w, bell), expect_index);
            let e = p.r.poll(&mut a_scq).unwrap_or_else(|| panic!("send {k}"));
            assert_eq!((e.status(), e.wqe_counter()), ((REQ, 0), expect_index));
            let e = p.r.poll(&mut b_rcq).unwrap();
            assert_eq!((e.opcode(), e.byte_cnt(), e.wqe_counter()), (RESP_SEND, nseg as u32 * 8, k as u16));
            let want = p.mr.read((k * 64) as usize, nseg as usize * 8);
            assert_eq!(p.mr.read((8192 + (k % 4) * 512) as usize, nseg as usize * 8), want, "message {k}");
            expect_index = expect_index.wrapping_add(if k == 0 { 1 } else { 2 });
        }
        assert_eq!(p.r.h.dev.qp_info(a.qpn).unwrap().sq_ci, expect_index);
        assert_eq!(p.r.h.dev.qp_info(b.qpn).unwrap().rq_ci, 21);
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::BlueFlameMismatch { .. })), 0);
        // The BlueFlame copies of wrapping WQEs were checked across the wrap.
        let wrapped = count(
            &p.r,
            |e| matches!(e, SimEvent::BlueFlameCopy { qpn, wqe_index, off: 64.. } if *qpn == a.qpn && wqe_index % 8 == 7),
        );
        assert!(wrapped > 0);
        let _ = (&mut p.a, &mut p.b, &mut p.a_scq, &mut p.a_rcq, &mut p.b_scq);
    }

    #[test]
    fn blueflame_copies_are_checked_and_bad_doorbells_refused() {
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        for _ in 0..4 {
            p.r.post_recv(&mut p.b, &[(base + 4096, 256, key)]);
        }
        let w = Wqe::new(SEND).data(16, key, base).data(16, key, base + 16).data(16, key, base + 32);
        p.r.post_send(&mut p.a, &w, Bell::Bf);
        let copies: Vec<u16> =
            p.r.h
                .dev
                .events()
                .iter()
                .filter_map(|e| match e {
                    SimEvent::BlueFlameCopy { qpn, wqe_index: 0, off } if *qpn == p.a.qpn => Some(*off),
                    _ => None,
                })
                .collect();
        assert_eq!(copies, [8, 16, 24, 32, 40, 48, 56]);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        // A corrupted copy is reported (the WQE in memory still runs).
        p.r.post_send(&mut p.a, &w, Bell::BfCorrupt(20));
        let bad = SimEvent::BlueFlameMismatch { qpn: p.a.qpn, wqe_index: 1, off: 16 };
        assert_eq!(count(&p.r, |e| *e == bad), 1);
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::BlueFlameMismatch { .. })), 1);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().wqe_counter(), 1);
        // A doorbell whose value is not the WQE's first 8 bytes.
        p.r.post_send(&mut p.a, &w, Bell::None);
        let db = SimMmio::uar_offset(p.a.uar) + p.a.bf_off;
        p.r.h.mmio.write64(db, u64::from(p.a.qpn) << 8 | 0x1234_0000_0000_0000);
        assert!(p.r.h.dev.events().contains(&SimEvent::BlueFlameMismatch { qpn: p.a.qpn, wqe_index: 0x3400, off: 0 }));
        // It is still a doorbell for that QP: the WQE in memory runs.
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().wqe_counter(), 2);
        // Refused doorbells.
        let why = |r: &Rdma| match r.h.dev.events().last() {
            Some(SimEvent::BadSqDoorbell { why, .. }) => *why,
            other => panic!("expected a refused doorbell, got {other:?}"),
        };
        let uar2 = p.r.h.alloc_uar();
        let bf = |uar: u32| SimMmio::uar_offset(uar) + consts::MLX5_BF_OFFSET as usize;
        p.r.h.mmio.write64(bf(uar2), u64::from(p.a.qpn) << 8 | 1);
        assert_eq!(why(&p.r), "QP uses another UAR page");
        p.r.h.mmio.write64(bf(p.a.uar), 0xfff_fff0 << 8);
        assert_eq!(why(&p.r), "no such QP");
        p.r.h.mmio.write64(bf(uar2 + 3), 0);
        assert_eq!(why(&p.r), "UAR page not allocated");
        p.r.h.mmio.write64(bf(p.a.uar) + 4, 0);
        assert_eq!(why(&p.r), "unaligned BlueFlame write");
        // The last half of the last register: no doorbell went there yet.
        p.r.h.mmio.write64(bf(p.a.uar) + 3 * 512 + 256 + 8, 0);
        assert_eq!(why(&p.r), "BlueFlame copy without a doorbell");
        let spare = p.r.qp(QpSpec::rc(), p.a_scq.cqn, p.a_rcq.cqn);
        p.r.h.mmio.write64(bf(p.a.uar), u64::from(spare.qpn) << 8 | 1);
        assert_eq!(why(&p.r), "QP in RST");
        let rq_only = p.r.qp(QpSpec { no_sq: true, ..QpSpec::rc() }, p.a_scq.cqn, p.a_rcq.cqn);
        p.r.h.mmio.write64(bf(p.a.uar), u64::from(rq_only.qpn) << 8 | 1);
        assert_eq!(why(&p.r), "QP has no send queue");
        p.a.set_sq_dbr(p.a.sq_pi.wrapping_add(65));
        p.r.h.mmio.write64(bf(p.a.uar), u64::from(p.a.qpn) << 8 | 1);
        assert_eq!(why(&p.r), "producer counter beyond the send queue");
        // None of them ran anything; the next proper doorbell works.
        assert!(p.r.poll(&mut p.a_scq).is_none());
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().sq_pi, 3);
        p.a.set_sq_dbr(p.a.sq_pi);
        p.r.post_send(&mut p.a, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().wqe_counter(), 3);
        assert!(p.r.poll(&mut p.a_scq).is_none());
    }

    #[test]
    fn rnr_naks_are_retried_until_a_receive_is_posted() {
        // The responder asks for 1.28 ms (timer 14); the requester retries forever (7).
        let pb = RcParams { min_rnr_nak: 14, ..RcParams::default() };
        let mut p = pair_with(SimConfig::default(), QpSpec::rc(), RcParams::default(), pb);
        let (key, base) = (p.mr.key, p.mr.addr());
        p.mr.write(0, b"patience");
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(8, key, base), Bell::Db);
        let nak = SimEvent::RnrNak { qpn: p.a.qpn, wqe_counter: 0, remote_qpn: p.b.qpn };
        assert_eq!(count(&p.r, |e| *e == nak), 1);
        assert!(p.r.poll(&mut p.a_scq).is_none());
        assert!(p.r.h.dev.qp_info(p.a.qpn).unwrap().outstanding);
        let retries = |r: &Rdma| count(r, |e| matches!(e, SimEvent::Retry { kind: RetryKind::Rnr, .. }));
        p.r.h.dev.advance_ns(1_000_000);
        assert_eq!(retries(&p.r), 0);
        p.r.h.dev.advance_ns(300_000);
        assert_eq!((retries(&p.r), count(&p.r, |e| *e == nak)), (1, 2));
        // A receive is posted (no MMIO); the next retry finds it.
        p.r.post_recv(&mut p.b, &[(base + 100, 8, key)]);
        assert!(p.r.poll(&mut p.b_rcq).is_none());
        p.r.h.dev.advance_ns(1_300_000);
        assert_eq!(retries(&p.r), 2);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.r.poll(&mut p.b_rcq).unwrap().byte_cnt(), 8);
        assert_eq!(p.mr.read(100, 8), b"patience");
        assert!(!p.r.h.dev.qp_info(p.a.qpn).unwrap().outstanding);
    }

    #[test]
    fn rnr_retries_run_out() {
        let pa = RcParams { rnr_retry: 2, ..RcParams::default() };
        let pb = RcParams { min_rnr_nak: 1, ..RcParams::default() };
        let mut p = pair_with(SimConfig::default(), QpSpec::rc(), pa, pb);
        let (key, base) = (p.mr.key, p.mr.addr());
        // Unsignaled: an error completes anyway. The second WQE is flushed.
        p.r.post_send(&mut p.a, &Wqe::new(SEND).unsignaled().data(8, key, base), Bell::Db);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).unsignaled().data(8, key, base), Bell::Db);
        for _ in 0..5 {
            p.r.h.dev.advance_ns(10_000);
        }
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!(
            (e.status(), e.wqe_counter(), e.wqe_opcode()),
            ((REQ_ERR, consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR), 0, SEND)
        );
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!((e.status(), e.wqe_counter()), ((REQ_ERR, consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR), 1));
        assert!(p.r.poll(&mut p.a_scq).is_none());
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::RnrNak { .. })), 3);
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::Retry { kind: RetryKind::Rnr, .. })), 2);
        let info = p.r.h.dev.qp_info(p.a.qpn).unwrap();
        assert_eq!((info.state, info.error), (QpState::Err, Some(consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR)));
        assert!(p
            .r
            .h
            .dev
            .events()
            .contains(&SimEvent::QpError { qpn: p.a.qpn, syndrome: consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR }));
        assert_eq!(p.r.h.dev.qp_info(p.b.qpn).unwrap().state, QpState::Rts);
    }

    /// Runs one WQE from a fresh pair and returns the requester's CQE, the responder's receive CQE (if any)
    /// and the pair.
    fn one(pb: RcParams, setup: impl FnOnce(&mut Pair) -> Wqe) -> (Cqe, Option<Cqe>, Pair) {
        let mut p = pair_with(SimConfig::default(), QpSpec::rc(), RcParams::default(), pb);
        let w = setup(&mut p);
        p.r.post_send(&mut p.a, &w, Bell::Db);
        let e = p.r.poll(&mut p.a_scq).expect("requester CQE");
        let resp = p.r.poll(&mut p.b_rcq);
        (e, resp, p)
    }

    #[test]
    fn remote_and_local_failures_complete_with_the_right_syndrome() {
        let req_err = |s: u8| (REQ_ERR, s);
        // A bad rkey.
        let (e, _, p) = one(RcParams::default(), |p| {
            Wqe::new(RDMA_WRITE).raddr(p.mr.addr(), p.mr.key + 0x100).data(8, p.mr.key, p.mr.addr())
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        let (ia, ib) = (p.r.h.dev.qp_info(p.a.qpn).unwrap(), p.r.h.dev.qp_info(p.b.qpn).unwrap());
        assert_eq!(
            (ia.state, ia.error, ib.state),
            (QpState::Err, Some(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR), QpState::Rts)
        );
        // A key without remote write.
        let (e, _, _) = one(RcParams::default(), |p| {
            let ro = p.r.mr_in(p.r.pd, 64, [true, true, false, false]);
            Wqe::new(RDMA_WRITE).raddr(ro.addr(), ro.key).data(8, p.mr.key, p.mr.addr())
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        // A READ past the key's end.
        let (e, _, _) = one(RcParams::default(), |p| {
            Wqe::new(RDMA_READ).raddr(p.mr.addr() + 65_530, p.mr.key).data(16, p.mr.key, p.mr.addr())
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        // A responder QP without remote read.
        let no_rre = RcParams { access: [false, true, true], ..RcParams::default() };
        let (e, _, _) =
            one(no_rre, |p| Wqe::new(RDMA_READ).raddr(p.mr.addr(), p.mr.key).data(16, p.mr.key, p.mr.addr()));
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        // A key of another PD at the responder.
        let (e, _, _) = one(RcParams::default(), |p| {
            let (s, _, out) = p.r.h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
            assert_eq!(s, 0);
            let other = p.r.mr_in(crate::fw::reply::rd(&out, ifc::alloc_pd_out::PD), 64, [true; 4]);
            Wqe::new(RDMA_WRITE).raddr(other.addr(), other.key).data(8, p.mr.key, p.mr.addr())
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        // A misaligned atomic.
        let (e, _, _) = one(RcParams::default(), |p| {
            Wqe::new(ATOMIC_FA).raddr(p.mr.addr() + 4, p.mr.key).atomic(1, 0).data(8, p.mr.key, p.mr.addr() + 64)
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR));
        // A bad lkey: nothing leaves the requester.
        let (e, resp, p) = one(RcParams::default(), |p| {
            p.r.post_recv(&mut p.b, &[(p.mr.addr(), 64, p.mr.key)]);
            Wqe::new(SEND).data(8, 0x4242, p.mr.addr())
        });
        assert_eq!((e.status(), resp), (req_err(consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR), None));
        assert_eq!(p.r.h.dev.qp_info(p.b.qpn).unwrap().rq_ci, 0);
        // An lkey whose bounds the gather exceeds.
        let (e, _, _) = one(RcParams::default(), |p| Wqe::new(SEND).data(100, p.mr.key, p.mr.addr() + 65_500));
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR));
        // A READ result into a key without local write.
        let (e, _, _) = one(RcParams::default(), |p| {
            let ro = p.r.mr_in(p.r.pd, 64, [false, true, true, true]);
            Wqe::new(RDMA_READ).raddr(p.mr.addr(), p.mr.key).data(16, ro.key, ro.addr())
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR));
        // A receive too small: the responder's receive fails, then the requester; both QPs end in ERR and the
        // responder's other receive is flushed.
        let (e, resp, mut p) = one(RcParams::default(), |p| {
            p.r.post_recv(&mut p.b, &[(p.mr.addr() + 1000, 10, p.mr.key)]);
            p.r.post_recv(&mut p.b, &[(p.mr.addr() + 2000, 100, p.mr.key)]);
            Wqe::new(SEND).data(20, p.mr.key, p.mr.addr())
        });
        assert_eq!(e.status(), req_err(consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR));
        let resp = resp.unwrap();
        assert_eq!(
            (resp.status(), resp.wqe_counter(), resp.qpn()),
            ((RESP_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR), 0, p.b.qpn)
        );
        let flushed = p.r.poll(&mut p.b_rcq).unwrap();
        assert_eq!((flushed.status(), flushed.wqe_counter()), ((RESP_ERR, consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR), 1));
        assert_eq!(p.r.h.dev.qp_info(p.b.qpn).unwrap().error, Some(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR));
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().error, Some(consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR));
        // A bad lkey in the receive: local protection there, remote operational error at the requester.
        let (e, resp, _) = one(RcParams::default(), |p| {
            p.r.post_recv(&mut p.b, &[(p.mr.addr(), 64, 0x777)]);
            Wqe::new(SEND).data(20, p.mr.key, p.mr.addr())
        });
        assert_eq!(
            (e.status(), resp.unwrap().status()),
            (req_err(consts::MLX5_CQE_SYNDROME_REMOTE_OP_ERR), (RESP_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR))
        );
    }

    #[test]
    fn sends_and_writes_are_in_flight_together_and_complete_in_order() {
        use crate::wire::roce::ib::Opcode;
        let (mut p, path) = captured_pair("pipeline", RcParams::default());
        let (key, base) = (p.mr.key, p.mr.addr());
        let src = pattern(8192, 9);
        p.mr.write(0, &src);
        for k in 0..4u64 {
            p.r.post_recv(&mut p.b, &[(base + 16384 + k * 4096, 4096, key)]);
        }
        // Eight messages of three packets at the 1024-byte MTU, SENDs and WRITEs in turn, behind one doorbell.
        for i in 0..8u64 {
            let (off, dst) = (base + i * 512, base + 32768 + (i / 2) * 4096);
            let w = if i % 2 == 0 {
                Wqe::new(SEND).data(3000, key, off)
            } else {
                Wqe::new(RDMA_WRITE).raddr(dst, key).data(3000, key, off)
            };
            p.r.post_send(&mut p.a, &w, if i == 7 { Bell::Db } else { Bell::None });
        }
        let sends: Vec<_> =
            p.r.drain(&mut p.a_scq).iter().map(|e| (e.status(), e.wqe_counter(), e.wqe_opcode())).collect();
        let expect: Vec<_> = (0..8u16).map(|i| ((REQ, 0), i, if i % 2 == 0 { SEND } else { RDMA_WRITE })).collect();
        assert_eq!(sends, expect, "each WQE completed once, in order");
        let recvs: Vec<_> =
            p.r.drain(&mut p.b_rcq).iter().map(|e| (e.opcode(), e.wqe_counter(), e.byte_cnt())).collect();
        assert_eq!(recvs, (0..4u16).map(|k| (RESP_SEND, k, 3000)).collect::<Vec<_>>());
        for k in 0..4usize {
            let (send, write) = (2 * k * 512, (2 * k + 1) * 512);
            assert!(p.mr.read(16384 + k * 4096, 3000) == src[send..send + 3000], "SEND {k}");
            assert!(p.mr.read(32768 + k * 4096, 3000) == src[write..write + 3000], "WRITE {k}");
        }
        let info = p.r.h.dev.qp_info(p.a.qpn).unwrap();
        assert_eq!((info.in_flight, info.sq_ci, info.next_send_psn), (0, 8, 0x100 + 24));
        // The capture shows every request packet on the wire before the first ACK came back.
        let ops = captured(&path);
        let before_ack = ops.iter().take_while(|o| **o != Opcode::RcAck).count();
        assert_eq!(before_ack, 24, "{ops:?}");
        assert_eq!(ops.iter().filter(|o| **o == Opcode::RcAck).count(), 8);
        let _ = (&p.a_rcq, &p.b_scq);
    }

    #[test]
    fn an_rnr_nak_inside_the_window_goes_back_and_completes_each_wqe_once() {
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let src = pattern(1000, 4);
        p.mr.write(0, &src);
        // Two receives for five SENDs: the third draws an RNR NAK, the two after it sequence NAKs.
        for k in 0..2u64 {
            p.r.post_recv(&mut p.b, &[(base + 8192 + k * 256, 256, key)]);
        }
        for i in 0..5u64 {
            let w = Wqe::new(SEND).data(100, key, base + i * 100);
            p.r.post_send(&mut p.a, &w, if i == 4 { Bell::Db } else { Bell::None });
        }
        let done: Vec<u16> = p.r.drain(&mut p.a_scq).iter().map(|e| e.wqe_counter()).collect();
        assert_eq!(done, [0, 1]);
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().in_flight, 3);
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::RnrNak { wqe_counter: 2, .. })), 1);
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::PsnSequenceError { .. })), 2);
        for k in 2..5u64 {
            p.r.post_recv(&mut p.b, &[(base + 8192 + k * 256, 256, key)]);
        }
        // After the RNR timer the three are sent again, from the one NAKed.
        p.r.h.dev.advance_ns(1_000_000_000);
        let e: Vec<_> = p.r.drain(&mut p.a_scq).iter().map(|e| (e.status(), e.wqe_counter())).collect();
        assert_eq!(e, [((REQ, 0), 2), ((REQ, 0), 3), ((REQ, 0), 4)]);
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::Retry { wqe_counter: 2, kind: RetryKind::Rnr, .. })), 1);
        let recvs: Vec<_> = p.r.drain(&mut p.b_rcq).iter().map(|e| (e.wqe_counter(), e.byte_cnt())).collect();
        assert_eq!(recvs, (0..5u16).map(|k| (k, 100)).collect::<Vec<_>>());
        for k in 0..5usize {
            assert!(p.mr.read(8192 + k * 256, 100) == src[k * 100..k * 100 + 100], "SEND {k}");
        }
        let (ia, ib) = (p.r.h.dev.qp_info(p.a.qpn).unwrap(), p.r.h.dev.qp_info(p.b.qpn).unwrap());
        assert_eq!((ia.in_flight, ia.next_send_psn, ib.next_rcv_psn, ib.rq_ci), (0, 0x105, 0x105, 5));
        assert!(p.r.poll(&mut p.a_scq).is_none() && p.r.poll(&mut p.b_rcq).is_none());
    }

    /// The BTH opcodes of every RoCE frame in the capture at `path` (removed after reading).
    fn captured(path: &std::path::Path) -> Vec<crate::wire::roce::ib::Opcode> {
        use crate::wire::roce::frame::{parse, Parsed};
        let bytes = std::fs::read(path).unwrap();
        let _ = std::fs::remove_file(path);
        let frames = crate::pcap::read_frames(&bytes).unwrap();
        frames
            .iter()
            .filter_map(|(_, f)| match parse(f) {
                Ok(Parsed::Roce(r)) => Some(r.bth.opcode),
                _ => None,
            })
            .collect()
    }

    /// A loopback pair whose frames are captured to a fresh file, and the file.
    fn captured_pair(name: &str, pa: RcParams) -> (Pair, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("mlx5-sim-{name}-{}.pcap", std::process::id()));
        let sink = crate::pcap::PcapSink::create(&path).unwrap();
        let cfg = SimConfig { pcap: Some(sink), ..SimConfig::default() };
        (pair_with(cfg, QpSpec::rc(), pa, RcParams::default()), path)
    }

    #[test]
    fn reads_are_pipelined_up_to_the_initiator_depth_behind_writes() {
        use crate::wire::roce::ib::Opcode::*;
        // log_sra_max 1: two READs in flight at most.
        let (mut p, path) = captured_pair("reads", RcParams { log_sra_max: 1, ..RcParams::default() });
        let (key, base) = (p.mr.key, p.mr.addr());
        p.mr.write(0, &pattern(256, 1));
        p.r.post_recv(&mut p.b, &[(base + 12288, 64, key)]);
        // A WRITE, three READs of what it and the bytes after it hold, then a SEND, behind one doorbell.
        p.r.post_send(&mut p.a, &Wqe::new(RDMA_WRITE).raddr(base + 4096, key).data(64, key, base), Bell::None);
        for k in 0..3u64 {
            let read = Wqe::new(RDMA_READ).raddr(base + 4096 + k * 32, key).data(64, key, base + 8192 + k * 64);
            p.r.post_send(&mut p.a, &read, Bell::None);
        }
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(16, key, base + 128), Bell::Db);
        let done: Vec<_> = p.r.drain(&mut p.a_scq).iter().map(|e| (e.status(), e.wqe_counter())).collect();
        assert_eq!(done, (0..5u16).map(|i| ((REQ, 0), i)).collect::<Vec<_>>(), "once each, in order");
        let src = pattern(256, 1);
        // Each READ saw the WRITE before it (the last one reads 32 bytes the WRITE never touched: zeros).
        assert_eq!(p.mr.read(8192, 64), src[..64]);
        assert_eq!(p.mr.read(8192 + 64, 64), [&src[32..64], &[0u8; 32][..]].concat());
        assert_eq!(p.mr.read(8192 + 128, 64), vec![0u8; 64]);
        assert_eq!(p.r.poll(&mut p.b_rcq).map(|e| e.byte_cnt()), Some(16));
        let ops = captured(&path);
        // The WRITE and two READs went before any response; the third READ only after the first READ's data.
        let first_response = ops.iter().position(|o| matches!(o, RcAck | RcReadResponseOnly)).unwrap();
        assert_eq!(ops[..first_response], [RcWriteOnly, RcReadRequest, RcReadRequest], "{ops:?}");
        let third = ops.iter().enumerate().filter(|(_, o)| **o == RcReadRequest).nth(2).unwrap().0;
        assert!(ops[..third].contains(&RcReadResponseOnly), "{ops:?}");
        let _ = (&p.a_rcq, &p.b_scq);
    }

    #[test]
    fn a_fenced_wqe_waits_for_the_reads_before_it() {
        use crate::wire::roce::ib::Opcode::*;
        for fenced in [false, true] {
            let (mut p, path) = captured_pair(if fenced { "fenced" } else { "unfenced" }, RcParams::default());
            let (key, base) = (p.mr.key, p.mr.addr());
            p.mr.write(0, &pattern(64, 3));
            p.r.post_recv(&mut p.b, &[(base + 12288, 64, key)]);
            p.r.post_recv(&mut p.b, &[(base + 12288 + 64, 64, key)]);
            let read = Wqe::new(RDMA_READ).raddr(base, key).data(64, key, base + 8192);
            p.r.post_send(&mut p.a, &read, Bell::None);
            let send = Wqe::new(SEND).data(64, key, base + 8192);
            p.r.post_send(&mut p.a, &if fenced { send.fence() } else { send }, Bell::None);
            p.r.post_send(&mut p.a, &Wqe::new(SEND).data(8, key, base), Bell::Db);
            let done: Vec<_> = p.r.drain(&mut p.a_scq).iter().map(|e| (e.status(), e.wqe_counter())).collect();
            assert_eq!(done, [((REQ, 0), 0), ((REQ, 0), 1), ((REQ, 0), 2)]);
            let ops = captured(&path);
            if fenced {
                // The fenced SEND (and the one after it) left only once the READ's data was back, so it sent
                // the bytes the READ brought.
                assert_eq!(ops[..3], [RcReadRequest, RcReadResponseOnly, RcSendOnly], "{ops:?}");
                assert_eq!(p.mr.read(12288, 64), pattern(64, 3));
            } else {
                assert_eq!(ops[..3], [RcReadRequest, RcSendOnly, RcSendOnly], "{ops:?}");
            }
            let _ = (&p.a_rcq, &p.b_scq, &p.b_rcq);
        }
    }

    #[test]
    fn atomics_are_pipelined_up_to_the_initiator_depth_and_a_bad_wqe_fails_after_those_before_it() {
        use crate::wire::roce::ib::Opcode::*;
        // log_sra_max 1: two READs or atomics in flight at most.
        let (mut p, path) = captured_pair("atomic", RcParams { log_sra_max: 1, ..RcParams::default() });
        let (key, base) = (p.mr.key, p.mr.addr());
        p.mr.write(1024, &5u64.to_be_bytes());
        // A WRITE, three fetch-and-adds of 2, then a WQE with a bad lkey, behind one doorbell: the error completes
        // after every WQE before it.
        p.r.post_send(&mut p.a, &Wqe::new(RDMA_WRITE).raddr(base + 4096, key).data(32, key, base), Bell::None);
        for k in 0..3u64 {
            let fa = Wqe::new(ATOMIC_FA).raddr(base + 1024, key).atomic(2, 0).data(8, key, base + 2048 + k * 8);
            p.r.post_send(&mut p.a, &fa, Bell::None);
        }
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(8, 0x4242, base), Bell::Db);
        let e: Vec<_> = p.r.drain(&mut p.a_scq).iter().map(|e| (e.status(), e.wqe_counter())).collect();
        let prot = (REQ_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR);
        assert_eq!(e, [((REQ, 0), 0), ((REQ, 0), 1), ((REQ, 0), 2), ((REQ, 0), 3), (prot, 4)]);
        // Each atomic ran once, in order: the originals 5, 7, 9, and 11 left.
        let originals: Vec<_> = (0..3).map(|k| p.mr.read(2048 + k * 8, 8)).collect();
        assert_eq!(originals, [5u64, 7, 9].map(|v| v.to_be_bytes().to_vec()));
        assert_eq!(p.mr.read(1024, 8), 11u64.to_be_bytes());
        let ops = captured(&path);
        let first_response = ops.iter().position(|o| matches!(o, RcAck | RcAtomicAck)).unwrap();
        assert_eq!(ops[..first_response], [RcWriteOnly, RcFetchAdd, RcFetchAdd], "{ops:?}");
        let third = ops.iter().enumerate().filter(|(_, o)| **o == RcFetchAdd).nth(2).unwrap().0;
        assert!(ops[..third].contains(&RcAtomicAck), "{ops:?}");
        let _ = (&p.a_rcq, &p.b_scq, &p.b_rcq);
    }

    #[test]
    fn requests_nobody_answers_run_out_of_transport_retries() {
        // 4.096 us << 10 = 4.2 ms per try, 2 retries.
        let pa = RcParams { retry_count: 2, ack_timeout: 10, ..RcParams::default() };
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let a = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        let mut a = a;
        r.connect_rc(&a, &r.me(0xab_cdef), pa);
        let mr = r.mr(4096);
        r.post_send(&mut a, &Wqe::new(SEND).data(8, mr.key, mr.addr()), Bell::Db);
        let lost = SimEvent::Unreachable { qpn: a.qpn, wqe_counter: 0, why: "no RC QP in RTR/RTS at the destination" };
        assert_eq!(count(&r, |e| *e == lost), 1);
        r.h.dev.advance_ns(4_000_000);
        assert_eq!(count(&r, |e| matches!(e, SimEvent::Retry { .. })), 0);
        r.h.dev.advance_ns(300_000);
        assert_eq!(count(&r, |e| matches!(e, SimEvent::Retry { kind: RetryKind::Transport, .. })), 1);
        // An empty poll consumes nothing, so polling the test's own handle leaves its consumer index as it was.
        let mut cq = cq;
        assert!(r.poll(&mut cq).is_none());
        r.h.dev.advance_ns(5_000_000);
        r.h.dev.advance_ns(5_000_000);
        let e = r.poll(&mut cq).unwrap();
        assert_eq!((e.status(), e.wqe_counter()), ((REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR), 0));
        assert_eq!(count(&r, |e| *e == lost), 3);
        assert_eq!(r.h.dev.qp_info(a.qpn).unwrap().error, Some(consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
        // A destination QP not yet ready (INIT) and an unknown GID are the same failure.
        let ready_later = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        let st = r.modify(consts::MLX5_CMD_OP_RST2INIT_QP, ready_later.qpn, 0, |i, c| {
            i.set(ifc::ads::VHCA_PORT_NUM.at(ifc::qpc::PRIMARY_ADDRESS_PATH.at(c)), 1)
        });
        assert_eq!(st, (0, 0));
        let zero = RcParams { retry_count: 0, ..pa };
        for remote in [r.me(ready_later.qpn), Remote { gid: [0xfe; 16], ..r.me(ready_later.qpn) }] {
            let mut q = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
            r.connect_rc(&q, &remote, zero);
            r.post_send(&mut q, &Wqe::new(SEND).data(8, mr.key, mr.addr()), Bell::Db);
            assert_eq!(r.poll(&mut cq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
        }
        assert!(r.h.dev.events().contains(&SimEvent::Unreachable {
            qpn: a.qpn + 3,
            wqe_counter: 0,
            why: "unknown destination (not connected)"
        }));
    }

    #[test]
    fn a_pair_reset_after_a_remote_operation_error_runs_again() {
        // rdma-core's test_mr_rereg_addr: the server's receive names a destroyed key (the MR was re-registered at
        // another address), the client's SEND fails with REMOTE_OP_ERR, both QPs go RST -> RTS, and a SEND with a
        // receive through the new key must then complete.
        let mut p = pair();
        let old = p.r.mr(4096);
        p.r.post_recv(&mut p.b, &[(old.addr(), 64, old.key)]);
        p.r.post_recv(&mut p.b, &[(p.mr.addr(), 64, p.mr.key)]);
        p.r.post_recv(&mut p.a, &[(p.mr.addr(), 64, p.mr.key)]);
        let mut d = vec![0u8; ifc::destroy_mkey_in::SIZE_BYTES];
        d.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_MKEY.into());
        d.set(ifc::destroy_mkey_in::MKEY_INDEX, old.key >> 8);
        assert_eq!(p.r.h.cmd(&d, ifc::destroy_mkey_out::SIZE_BYTES).0, 0);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(8, p.mr.key, p.mr.addr()), Bell::Db);
        let e = p.r.poll(&mut p.a_scq).expect("requester CQE");
        assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_OP_ERR));
        for qp in [&mut p.a, &mut p.b] {
            assert_eq!(p.r.modify(consts::MLX5_CMD_OP_2RST_QP, qp.qpn, 0, |_, _| {}), (0, 0));
            qp.sq_pi = 0;
            qp.rq_head = 0;
            put(&qp.dbr, 0, &[0; 8]);
        }
        let (ra, rb) = (p.r.me(p.a.qpn), p.r.me(p.b.qpn));
        p.r.connect_rc(&p.a, &rb, RcParams::default());
        p.r.connect_rc(&p.b, &ra, RcParams::default());
        p.r.post_recv(&mut p.b, &[(p.mr.addr(), 64, p.mr.key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(8, p.mr.key, p.mr.addr()), Bell::Db);
        // The requester's CQ still holds the flush of A's receive; the new SEND's CQE follows.
        let mut got = Vec::new();
        while let Some(c) = p.r.poll(&mut p.a_scq) {
            got.push(c.status());
        }
        assert_eq!(got.last(), Some(&(REQ, 0)), "{got:?}");
    }

    #[test]
    fn cqes_carry_the_qps_user_index_unless_it_asks_for_cqe_version_0() {
        // Found with rdma-core's test_parent_domain under UML: the provider (CQE version 1) finds a CQE's QP by
        // `srqn_uidx` alone; the simulator wrote the SRQ number or 0 there, so a receive went to whatever held index
        // 0 (the context's SRQ) and polling failed.
        let mut r = Rdma::new(SimConfig::default());
        let (mut scq, mut rcq) = (r.cq(5), r.cq(5));
        let uidx = |n: u32| move |i: &mut Vec<u8>| i.set(ifc::qpc::USER_INDEX.at(ifc::create_qp_in::QPC), n);
        let mut a = r.qp_with(QpSpec::rc(), scq.cqn, rcq.cqn, uidx(7));
        let mut b = r.qp_with(QpSpec::rc(), scq.cqn, rcq.cqn, uidx(consts::MLX5_IB_DEFAULT_UIDX));
        let (ra, rb) = (r.me(a.qpn), r.me(b.qpn));
        r.connect_rc(&a, &rb, RcParams::default());
        r.connect_rc(&b, &ra, RcParams::default());
        let mr = r.mr(4096);
        r.post_recv(&mut b, &[(mr.addr(), 64, mr.key)]);
        r.post_recv(&mut a, &[(mr.addr(), 64, mr.key)]);
        r.post_send(&mut a, &Wqe::new(SEND).data(8, mr.key, mr.addr()), Bell::Db);
        let (send, recv) = (r.poll(&mut scq).unwrap(), r.poll(&mut rcq).unwrap());
        assert_eq!((send.status(), send.srqn_uidx()), ((REQ, 0), 7), "A's index");
        // B asked for version 0: no SRQ, so 0.
        assert_eq!((recv.status(), recv.qpn(), recv.srqn_uidx()), ((RESP_SEND, 0), b.qpn, 0));
        r.post_send(&mut b, &Wqe::new(SEND).data(8, mr.key, mr.addr()), Bell::Db);
        let (send, recv) = (r.poll(&mut scq).unwrap(), r.poll(&mut rcq).unwrap());
        assert_eq!((send.qpn(), send.srqn_uidx()), (b.qpn, 0));
        assert_eq!((recv.qpn(), recv.srqn_uidx()), (a.qpn, 7));
    }

    #[test]
    fn a_umr_wqe_changes_a_keys_pd_and_rights_as_mlx5_ib_rereg_asks() {
        // Found with `linux-drives-sim --python`: mlx5_ib changes an MR's PD and access flags (ibv_rereg_mr)
        // with a UMR WQE on its UMR QP, which the simulator completed with an error (a kernel WARN, EFAULT).
        use crate::config::PortType;
        use crate::fw::mkey::MkeyAccess;
        use c::mlx5_wqe_umr_ctrl_seg as u;
        use ifc::mkc as m;
        let mut r = Rdma::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        let mut cq = r.cq(4);
        let st = consts::MLX5_QP_ST_REG_UMR;
        let mut umr = r.qp(QpSpec { st, ..QpSpec::ud() }, cq.cqn, cq.cqn);
        r.ready_ud(&umr, 0);
        let pd2 = {
            let (s, _, out) = r.h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
            assert_eq!(s, 0);
            MsgBuf::get(&out[..], ifc::alloc_pd_out::PD)
        };
        let mr = r.mr_in(r.pd, 4096, [true, false, false, false]);
        let (pd1, va) = (r.pd, mr.addr());
        let dev = r.h.dev.clone();
        let write = |pd| dev.mkey_access(mr.key, Some(pd), va, 8, MkeyAccess::REMOTE_WRITE);
        assert!(write(pd1).is_err());
        // PD and every access bit in the mask; the new context grants remote read and write in PD 2.
        let umr_wqe = |mask: u64| {
            let mut segs = vec![0u8; u::SIZE + m::SIZE_BYTES];
            segs[u::MKEY_MASK.off..u::MKEY_MASK.end()].copy_from_slice(&mask.to_be_bytes());
            segs[0] = (consts::MLX5_UMR_CHECK_FREE | consts::MLX5_UMR_INLINE) as u8;
            let ctx = &mut segs[u::SIZE..];
            for f in [m::LR, m::LW, m::RR, m::RW] {
                ctx.set(f, 1);
            }
            ctx.set(m::PD, pd2);
            ctx.set(m::QPN, 0xff_ffff);
            Wqe { segs, ..Wqe::new(consts::MLX5_OPCODE_UMR).imm(mr.key) }
        };
        let access = [
            consts::MLX5_MKEY_MASK_LR,
            consts::MLX5_MKEY_MASK_LW,
            consts::MLX5_MKEY_MASK_RR,
            consts::MLX5_MKEY_MASK_RW,
            consts::MLX5_MKEY_MASK_A,
            consts::MLX5_MKEY_MASK_PD,
        ];
        let mask = access.iter().fold(0u64, |a, b| a | u64::from(*b));
        r.post_send(&mut umr, &umr_wqe(mask), Bell::Db);
        assert_eq!(r.poll(&mut cq).unwrap().status(), (REQ, 0));
        assert!(write(pd2).is_ok(), "remote write in the new PD");
        assert_eq!(write(pd1), Err(MkeyFault::PdMismatch));
        let atomic = r.h.dev.mkey_access(mr.key, Some(pd2), va, 8, MkeyAccess::REMOTE_ATOMIC);
        assert!(atomic.is_err(), "the context's `a` 0 took the right away");
        // A mask bit the simulator does not model (the start address) is a local QP operation error.
        r.post_send(&mut umr, &umr_wqe(mask | u64::from(consts::MLX5_MKEY_MASK_START_ADDR)), Bell::Db);
        assert_eq!(r.poll(&mut cq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR));
    }

    #[test]
    fn malformed_wqes_are_local_qp_operation_errors() {
        type Break = fn(&mut Pair) -> Wqe;
        let cases: [(&str, Break); 7] = [
            ("ds 0", |p| Wqe { ds_override: Some(0), ..Wqe::new(SEND).data(8, p.mr.key, p.mr.addr()) }),
            ("ds beyond the producer", |p| Wqe {
                ds_override: Some(20),
                ..Wqe::new(SEND).data(8, p.mr.key, p.mr.addr())
            }),
            ("unknown opcode", |p| Wqe::new(consts::MLX5_OPCODE_UMR).data(8, p.mr.key, p.mr.addr())),
            ("inline longer than the WQE", |_| {
                let mut w = Wqe::new(SEND).inline(&[1; 8]);
                w.segs[..4].copy_from_slice(&(200 | consts::MLX5_INLINE_SEG).to_be_bytes());
                w
            }),
            ("READ into inline data", |p| Wqe::new(RDMA_READ).raddr(p.mr.addr(), p.mr.key).inline(&[0; 8])),
            ("WRITE without its remote address", |_| Wqe::new(RDMA_WRITE)),
            ("atomic without its atomic segment", |p| Wqe::new(ATOMIC_CS).raddr(p.mr.addr(), p.mr.key)),
        ];
        for (what, f) in cases {
            let (e, _, p) = one(RcParams::default(), f);
            assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR), "{what}");
            assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().state, QpState::Err, "{what}");
        }
        // A control segment naming another QP, or another index.
        for patch in [4usize, 1] {
            let mut p = pair();
            let w = Wqe::new(SEND).data(8, p.mr.key, p.mr.addr());
            p.r.post_send(&mut p.a, &w, Bell::None);
            let mut db = [0u8; 8];
            db.copy_from_slice(&p.a.sq_read(0, 8));
            p.a.patch_sq(0, patch, &[0x55]);
            // The doorbell names the QP properly; the WQE in memory does not.
            p.r.h.mmio.write64(SimMmio::uar_offset(p.a.uar) + p.a.bf_off, u64::from_be_bytes(db));
            assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR));
        }
        // Garbage everywhere never panics: every WQE completes or fails, and the QP ends up somewhere valid.
        let mut seed = 0x1234_5678u32;
        for _ in 0..20 {
            let mut p = pair();
            let mut junk = vec![0u8; 64 * 4];
            for b in &mut junk {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                *b = (seed >> 16) as u8;
            }
            let mut w = Wqe::new((seed % 0x30) as u8);
            w.segs = junk[16..64 * 4].to_vec();
            w.ds_override = Some(seed >> 8 & 0x3f);
            p.r.post_send(&mut p.a, &w, Bell::Db);
            p.r.h.dev.advance_ns(1_000_000_000);
            let st = p.r.h.dev.qp_info(p.a.qpn).unwrap().state;
            assert!(matches!(st, QpState::Rts | QpState::Err));
        }
    }

    #[test]
    fn a_qp_in_error_flushes_everything_outstanding_and_later() {
        // b never posts a receive; a retries forever, so its first WQE stays outstanding.
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(8, key, base), Bell::Db);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).unsignaled().data(8, key, base), Bell::Db);
        p.r.post_send(&mut p.a, &Wqe::new(RDMA_WRITE).raddr(base, key).inline(&[1; 40]), Bell::Db);
        p.r.post_recv(&mut p.a, &[(base, 64, key)]);
        p.r.post_recv(&mut p.a, &[(base, 64, key)]);
        assert!(p.r.h.dev.qp_info(p.a.qpn).unwrap().outstanding);
        assert!(p.r.poll(&mut p.a_scq).is_none());
        assert_eq!(p.r.modify(consts::MLX5_CMD_OP_2ERR_QP, p.a.qpn, 0, |_, _| {}), (0, 0));
        // Every WQE gets its flush CQE, signaled or not, in order.
        let sends: Vec<(u8, u16, u8)> =
            p.r.drain(&mut p.a_scq).iter().map(|e| (e.syndrome(), e.wqe_counter(), e.wqe_opcode())).collect();
        let f = consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR;
        assert_eq!(sends, [(f, 0, SEND), (f, 1, SEND), (f, 2, RDMA_WRITE)]);
        let recvs: Vec<(u8, u16)> = p.r.drain(&mut p.a_rcq).iter().map(|e| (e.opcode(), e.wqe_counter())).collect();
        assert_eq!(recvs, [(RESP_ERR, 0), (RESP_ERR, 1)]);
        assert!(p.r.h.dev.events().contains(&SimEvent::Flushed { qpn: p.a.qpn, sq: 3, rq: 2 }));
        let info = p.r.h.dev.qp_info(p.a.qpn).unwrap();
        assert_eq!((info.state, info.error, info.outstanding, info.sq_ci), (QpState::Err, None, false, 4));
        // Later sends flush at their doorbell; later receives the next time the device runs.
        p.r.post_send(&mut p.a, &Wqe::new(SEND).unsignaled().data(8, key, base), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ_ERR, f));
        p.r.post_recv(&mut p.a, &[(base, 64, key)]);
        assert!(p.r.poll(&mut p.a_rcq).is_none());
        p.r.h.dev.advance_ns(1_000);
        assert_eq!(p.r.poll(&mut p.a_rcq).unwrap().wqe_counter(), 2);
        // Back to RST (the driver resets its counters and record) and RTS: the QP works again.
        assert_eq!(p.r.modify(consts::MLX5_CMD_OP_2RST_QP, p.a.qpn, 0, |_, _| {}), (0, 0));
        (p.a.sq_pi, p.a.rq_head) = (0, 0);
        p.a.set_sq_dbr(0);
        p.a.set_rq_dbr(0);
        let rb = p.r.me(p.b.qpn);
        p.r.connect_rc(&p.a, &rb, RcParams::default());
        p.r.post_recv(&mut p.b, &[(base + 512, 64, key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).inline(b"again"), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.mr.read(512, 5), b"again");
        let _ = (&p.b_scq, &p.b_rcq);
    }

    #[test]
    fn mismatched_psns_fail_with_retry_exceeded_and_deliver_nothing() {
        // A expects 0x100 from B but B starts at 0x100 while A starts at 0x300: A's SEND is ahead of what B
        // expects, B NAKs it (sequence error), A retransmits retry_count times and fails.
        let pa = RcParams { sq_psn: 0x300, retry_count: 2, ..RcParams::default() };
        let mut p = pair_with(SimConfig::default(), QpSpec::rc(), pa, RcParams::default());
        let (key, base) = (p.mr.key, p.mr.addr());
        p.mr.write(0, &pattern(64, 3));
        p.r.post_recv(&mut p.b, &[(base + 4096, 64, key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(64, key, base), Bell::Db);
        let e = p.r.poll(&mut p.a_scq).expect("requester CQE");
        assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
        let seq_err = SimEvent::PsnSequenceError { qpn: p.b.qpn, expected: 0x100, got: 0x300 };
        assert_eq!(count(&p.r, |e| *e == seq_err), 3, "the first attempt and two retries");
        assert_eq!(count(&p.r, |e| matches!(e, SimEvent::PsnSequenceNak { .. })), 3);
        // Nothing reached B's receive: it is still posted and the buffer untouched.
        assert!(p.r.poll(&mut p.b_rcq).is_none());
        assert_eq!(p.r.h.dev.qp_info(p.b.qpn).unwrap().rq_ci, 0);
        assert_eq!(p.mr.read(4096, 64), vec![0u8; 64]);
    }

    #[test]
    fn a_duplicate_request_is_answered_without_executing_it_again() {
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        p.mr.write(0, &pattern(32, 5));
        p.mr.write(1024, &7u64.to_be_bytes());
        p.r.post_recv(&mut p.b, &[(base + 4096, 64, key)]);
        p.r.post_recv(&mut p.b, &[(base + 8192, 64, key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(32, key, base), Bell::Db);
        let fa = Wqe::new(ATOMIC_FA).raddr(base + 1024, key).atomic(3, 0).data(8, key, base + 2048);
        p.r.post_send(&mut p.a, &fa, Bell::Db);
        assert_eq!(p.r.drain(&mut p.a_scq).len(), 2);
        assert_eq!(p.r.drain(&mut p.b_rcq).len(), 1);
        assert_eq!(p.mr.read(1024, 8), 10u64.to_be_bytes());
        // The SEND (PSN 0x100) and the atomic (PSN 0x101) arrive again, as a retransmission would bring them.
        let dev = p.r.h.dev.clone();
        let resend = |psn: u32, op: RcOp| {
            let mut st = crate::device::lock(&dev.shared);
            let me = st.wire.me.clone();
            let body = Body::Rc { seq: 1_000 + u64::from(psn), psn, op, solicited: false, xrc_srqn: None };
            let pk = Packet {
                src: me.clone(),
                dst: me,
                src_qpn: p.a.qpn,
                dst_qpn: p.b.qpn,
                slid: 0,
                sl: 0,
                grh: None,
                body,
                roce: RoceInfo::default(),
            };
            st.datapath().receive(pk);
            let out = st.datapath().run_datapath();
            assert!(out.is_empty(), "loopback: nothing leaves the device");
        };
        resend(0x100, RcOp::Send { data: (&b"again"[..]).into(), imm: None, inv: None });
        resend(0x101, RcOp::Atomic { raddr: base + 1024, rkey: key, op: AtomicOp::FetchAdd { add: 3 } });
        for psn in [0x100, 0x101] {
            assert!(p.r.h.dev.events().contains(&SimEvent::DuplicateRequest { qpn: p.b.qpn, psn }));
        }
        // Neither ran twice: the second receive is untouched, the counter still 10.
        assert!(p.r.poll(&mut p.b_rcq).is_none());
        assert_eq!(p.mr.read(8192, 5), vec![0u8; 5]);
        assert_eq!(p.mr.read(1024, 8), 10u64.to_be_bytes());
        assert_eq!(p.r.h.dev.qp_info(p.b.qpn).unwrap().next_rcv_psn, 0x102);
        // A's late responses to attempts it never made are ignored: no CQE, no error.
        assert!(p.r.poll(&mut p.a_scq).is_none());
        assert_eq!(p.r.h.dev.qp_info(p.a.qpn).unwrap().state, QpState::Rts);
    }

    /// An indirect key as `mlx5_ib_alloc_mw` creates a window (free, `umr_en`, KLM mode, `en_rinval` for type 2) in the
    /// rig's PD; its key.
    fn alloc_mw(r: &mut Rdma, type2: bool) -> u32 {
        let pd = r.pd;
        use ifc::create_mkey_in as i;
        use ifc::mkc as m;
        let ctx = i::MEMORY_KEY_MKEY_ENTRY;
        let mut inp = vec![0u8; i::KLM_PAS_MTT.byte_off()];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_MKEY.into());
        inp.set(m::FREE.at(ctx), 1);
        inp.set(m::UMR_EN.at(ctx), 1);
        inp.set(m::LR.at(ctx), 1);
        inp.set(m::ACCESS_MODE_1_0.at(ctx), consts::MLX5_MKC_ACCESS_MODE_KLMS);
        inp.set(m::EN_RINVAL.at(ctx), type2.into());
        inp.set(m::TRANSLATIONS_OCTWORD_SIZE.at(ctx), 4);
        inp.set(m::QPN.at(ctx), 0xff_ffff);
        inp.set(m::PD.at(ctx), pd);
        let (s, syn, out) = r.h.cmd(&inp, ifc::create_mkey_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0), "CREATE_MKEY of a window");
        MsgBuf::get(&out[..], ifc::create_mkey_out::MKEY_INDEX) << 8
    }

    /// What a window UMR binds: `len` bytes at `addr` of key `inner`, with remote write (and `lw` local write).
    struct Bind {
        addr: u64,
        len: u64,
        inner: u32,
    }

    /// A user QP's window UMR as rdma-core's `set_bind_wr` builds it: on window `key`, giving it `variant`, bound
    /// to QP `qpn` (0xffffff for type 1), over `bind` or (`None`) freeing it.
    fn window_umr(key: u32, variant: u8, qpn: u32, bind: Option<Bind>) -> Wqe {
        use c::mlx5_klm as k;
        use c::mlx5_wqe_umr_ctrl_seg as u;
        use ifc::mkc as m;
        let mut mask = consts::MLX5_MKEY_MASK_FREE | consts::MLX5_MKEY_MASK_KEY | consts::MLX5_MKEY_MASK_QPN;
        let mut segs = vec![0u8; u::SIZE + m::SIZE_BYTES];
        segs[u::FLAGS.off] = consts::MLX5_WQE_UMR_CTRL_FLAG_INLINE as u8;
        {
            let ctx = &mut segs[u::SIZE..];
            ctx.set(m::QPN, qpn);
            ctx.set(m::MKEY_7_0, variant.into());
        }
        match bind {
            None => {
                segs[u::FLAGS.off] |= consts::MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN as u8;
                segs[u::SIZE..].set(m::FREE, 1);
            }
            Some(b) => {
                mask |= consts::MLX5_MKEY_MASK_LEN | consts::MLX5_MKEY_MASK_START_ADDR | consts::MLX5_MKEY_MASK_RW;
                segs[u::XLT_OCTOWORDS.off..u::XLT_OCTOWORDS.end()].copy_from_slice(&2u16.to_be_bytes());
                let ctx = &mut segs[u::SIZE..];
                ctx.set(m::RW, 1);
                ctx.set(m::LW, 1);
                ctx.set64(m::START_ADDR, b.addr);
                ctx.set64(m::LEN, b.len);
                let mut klm = [0u8; 64];
                klm[k::BCOUNT.off..k::BCOUNT.end()].copy_from_slice(&(b.len as u32).to_be_bytes());
                klm[k::KEY.off..k::KEY.end()].copy_from_slice(&b.inner.to_be_bytes());
                klm[k::VA.off..k::VA.end()].copy_from_slice(&b.addr.to_be_bytes());
                segs.extend_from_slice(&klm);
            }
        }
        segs[u::MKEY_MASK.off..u::MKEY_MASK.end()].copy_from_slice(&u64::from(mask).to_be_bytes());
        Wqe { segs, ..Wqe::new(consts::MLX5_OPCODE_UMR).imm(key) }
    }

    #[test]
    fn a_type_2_window_is_bound_used_within_its_range_and_invalidated() {
        // rdma-core's MWTest: B binds a window over 4 KiB of its region; A writes through it; a WRITE outside the
        // window's range, and one after B frees the window (IBV_WR_LOCAL_INV), are remote access errors.
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let mw = alloc_mw(&mut p.r, true);
        use crate::fw::mkey::MkeyAccess;
        let bound = mw | 1;
        let w = window_umr(mw, 1, p.b.qpn, Some(Bind { addr: base + 8192, len: 4096, inner: key }));
        p.r.post_send(&mut p.b, &w, Bell::Db);
        let e = p.r.poll(&mut p.b_scq).expect("bind CQE");
        assert_eq!((e.status(), e.wqe_opcode()), ((REQ, 0), consts::MLX5_OPCODE_UMR));
        let src = pattern(64, 3);
        p.mr.write(0, &src);
        let write = |at: u64, rkey: u32| Wqe::new(RDMA_WRITE).raddr(at, rkey).data(64, key, base);
        p.r.post_send(&mut p.a, &write(base + 8192 + 100, bound), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.mr.read(8192 + 100, 64), src, "written through the window");
        // The window's old key (variant 0) no longer names it.
        assert!(p.r.h.dev.mkey_access(mw, Some(p.r.pd), base + 8192, 8, MkeyAccess::REMOTE_WRITE).is_err());
        // B frees the window (its own, so CHECK_QPN passes); A's next WRITE through it is refused.
        p.r.post_send(&mut p.b, &window_umr(bound, 0, 0xff_ffff, None), Bell::Db);
        assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ, 0));
        p.r.post_send(&mut p.a, &write(base + 8192, bound), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
    }

    #[test]
    fn a_write_outside_a_bound_window_or_arriving_on_another_qp_is_a_remote_access_error() {
        // (case, type 2, binding QP is A, offset of the 64-byte WRITE, A's WRITE at B succeeds)
        for (what, type2, on_a, at, ok) in [
            ("inside, type 2 bound to B", true, false, 0, true),
            ("past its end", true, false, 4096 - 32, false),
            ("type 2 bound to A, the WRITE arrives at B", true, true, 0, false),
            ("type 1 bound by A answers on every QP", false, true, 0, true),
        ] {
            let mut p = pair();
            let (key, base) = (p.mr.key, p.mr.addr());
            let mw = alloc_mw(&mut p.r, type2);
            let qpn = match (type2, on_a) {
                (false, _) => 0xff_ffff,
                (true, true) => p.a.qpn,
                (true, false) => p.b.qpn,
            };
            let w = window_umr(mw, 2, qpn, Some(Bind { addr: base, len: 4096, inner: key }));
            let (qp, cq) = if on_a { (&mut p.a, &mut p.a_scq) } else { (&mut p.b, &mut p.b_scq) };
            p.r.post_send(qp, &w, Bell::Db);
            assert_eq!(p.r.poll(cq).unwrap().status(), (REQ, 0), "{what}: bind");
            let w = Wqe::new(RDMA_WRITE).raddr(base + at, mw | 2).data(64, key, base + 8192);
            p.r.post_send(&mut p.a, &w, Bell::Db);
            let want = if ok { (REQ, 0) } else { (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR) };
            assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), want, "{what}");
        }
    }

    #[test]
    fn bad_window_binds_complete_with_a_memory_window_bind_error() {
        type Case = fn(&mut Pair, u32, u32) -> Wqe;
        let cases: [(&str, Case); 6] = [
            ("range past the region", |p, mw, key| {
                window_umr(mw, 1, p.b.qpn, Some(Bind { addr: p.mr.addr() + 60 * 1024, len: 8192, inner: key }))
            }),
            ("remote write over a region without local write", |p, mw, _| {
                let ro = p.r.mr_in(p.r.pd, 4096, [false, true, true, false]);
                window_umr(mw, 1, p.b.qpn, Some(Bind { addr: ro.addr(), len: 4096, inner: ro.key }))
            }),
            ("region of another PD", |p, mw, _| {
                let (s, _, out) = p.r.h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
                assert_eq!(s, 0);
                let pd2 = MsgBuf::get(&out[..], ifc::alloc_pd_out::PD);
                let other = p.r.mr_in(pd2, 4096, ALL);
                window_umr(mw, 1, p.b.qpn, Some(Bind { addr: other.addr(), len: 4096, inner: other.key }))
            }),
            ("type 2 bound to another QP", |p, mw, key| {
                window_umr(mw, 1, p.a.qpn, Some(Bind { addr: p.mr.addr(), len: 4096, inner: key }))
            }),
            ("type 2 window already bound", |p, mw, key| {
                let w = window_umr(mw, 1, p.b.qpn, Some(Bind { addr: p.mr.addr(), len: 4096, inner: key }));
                p.r.post_send(&mut p.b, &w, Bell::Db);
                assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ, 0));
                window_umr(mw, 2, p.b.qpn, Some(Bind { addr: p.mr.addr(), len: 4096, inner: key }))
            }),
            ("no window: a memory region's key", |p, _, key| {
                window_umr(key, 1, p.b.qpn, Some(Bind { addr: p.mr.addr(), len: 4096, inner: key }))
            }),
        ];
        const ALL: [bool; 4] = [true, true, true, true];
        for (what, make) in cases {
            let mut p = pair();
            let mw = alloc_mw(&mut p.r, true);
            let key = p.mr.key;
            let w = make(&mut p, mw, key);
            p.r.post_send(&mut p.b, &w, Bell::Db);
            let e = p.r.poll(&mut p.b_scq).expect(what);
            assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_MW_BIND_ERR), "{what}");
        }
    }

    #[test]
    fn a_send_with_invalidate_frees_a_type_2_window_and_refuses_a_key_it_may_not_free() {
        // rdma-core's test_mw_type2_invalidate_remote: A's SEND with invalidate names B's window; B's receive
        // completes as SEND_INV with that rkey, and A's next WRITE through it is refused.
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let mw = alloc_mw(&mut p.r, true);
        let w = window_umr(mw, 7, p.b.qpn, Some(Bind { addr: base, len: 4096, inner: key }));
        p.r.post_send(&mut p.b, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ, 0));
        p.r.post_recv(&mut p.b, &[(base + 8192, 64, key)]);
        let send_inv = |rkey: u32| Wqe::new(consts::MLX5_OPCODE_SEND_INVAL).imm(rkey).data(16, key, base + 4096);
        p.r.post_send(&mut p.a, &send_inv(mw | 7), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        let e = p.r.poll(&mut p.b_rcq).expect("receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt(), e.imm()), (consts::MLX5_CQE_RESP_SEND_INV, 16, mw | 7));
        let write = Wqe::new(RDMA_WRITE).raddr(base, mw | 7).data(8, key, base + 4096);
        p.r.post_send(&mut p.a, &write, Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
        // A memory region's key (no `en_rinval`) cannot be invalidated remotely: an invalid request, the
        // receive completing with the error and the region still usable.
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        p.r.post_recv(&mut p.b, &[(base + 8192, 64, key)]);
        p.r.post_send(&mut p.a, &send_inv(key), Bell::Db);
        let e = p.r.poll(&mut p.a_scq).unwrap();
        assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR));
        let e = p.r.poll(&mut p.b_rcq).unwrap();
        assert_eq!(e.status(), (RESP_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR));
        assert!(p.r.h.dev.mkey_access(key, Some(p.r.pd), base, 8, crate::fw::mkey::MkeyAccess::REMOTE_WRITE).is_ok());
    }

    #[test]
    fn a_list_mkey_laid_out_by_umr_gathers_and_scatters_across_its_entries() {
        // mlx5dv_wr_mr_list: an indirect key (no QP, no `en_rinval`) laid out over three pieces of a region, zero
        // based, with local write and remote read and write; a SEND gathers through it as an lkey, a WRITE
        // scatters through it as an rkey, and an access past its length is refused.
        use c::mlx5_klm as k;
        use c::mlx5_wqe_umr_ctrl_seg as u;
        use ifc::mkc as m;
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let mkey = alloc_mw(&mut p.r, false);
        let pieces = [(base + 1000, 100u32), (base + 5000, 200), (base + 9000, 300)];
        let mask = consts::MLX5_MKEY_MASK_FREE
            | consts::MLX5_MKEY_MASK_KEY
            | consts::MLX5_MKEY_MASK_LEN
            | consts::MLX5_MKEY_MASK_LW
            | consts::MLX5_MKEY_MASK_RR
            | consts::MLX5_MKEY_MASK_RW;
        let mut segs = vec![0u8; u::SIZE + m::SIZE_BYTES + 64];
        segs[u::FLAGS.off] = consts::MLX5_WQE_UMR_CTRL_FLAG_INLINE as u8;
        segs[u::MKEY_MASK.off..u::MKEY_MASK.end()].copy_from_slice(&u64::from(mask).to_be_bytes());
        segs[u::XLT_OCTOWORDS.off..u::XLT_OCTOWORDS.end()].copy_from_slice(&4u16.to_be_bytes());
        {
            let ctx = &mut segs[u::SIZE..u::SIZE + m::SIZE_BYTES];
            ctx.set(m::QPN, 0xff_ffff);
            ctx.set(m::MKEY_7_0, 0x33);
            for f in [m::LW, m::RR, m::RW] {
                ctx.set(f, 1);
            }
            ctx.set64(m::LEN, 600);
        }
        for (i, (addr, n)) in pieces.iter().enumerate() {
            let e = &mut segs[u::SIZE + m::SIZE_BYTES + i * k::SIZE..][..k::SIZE];
            e[k::BCOUNT.off..k::BCOUNT.end()].copy_from_slice(&n.to_be_bytes());
            e[k::KEY.off..k::KEY.end()].copy_from_slice(&key.to_be_bytes());
            e[k::VA.off..k::VA.end()].copy_from_slice(&addr.to_be_bytes());
        }
        let umr = Wqe { segs, ..Wqe::new(consts::MLX5_OPCODE_UMR).imm(mkey) };
        p.r.post_send(&mut p.a, &umr, Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0), "layout");
        let lkey = mkey | 0x33;
        let src = pattern(600, 9);
        for (i, (addr, n)) in pieces.iter().enumerate() {
            let from: usize = pieces[..i].iter().map(|(_, n)| *n as usize).sum();
            p.mr.write((addr - base) as usize, &src[from..from + *n as usize]);
        }
        // A SEND of the key's 600 bytes (an lkey, zero based) arrives whole at B.
        p.r.post_recv(&mut p.b, &[(base + 20_000, 1024, key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(600, lkey, 0), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.r.poll(&mut p.b_rcq).unwrap().byte_cnt(), 600);
        assert_eq!(p.mr.read(20_000, 600), src);
        // B WRITEs 250 bytes at offset 50 of the key: they land across the first two entries.
        let new = pattern(250, 77);
        p.mr.write(30_000, &new);
        let w = Wqe::new(RDMA_WRITE).raddr(50, lkey).data(250, key, base + 30_000);
        p.r.post_send(&mut p.b, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.mr.read(1050, 50), new[..50]);
        assert_eq!(p.mr.read(5000, 200), new[50..]);
        // Past its 600 bytes: a remote access error.
        let w = Wqe::new(RDMA_WRITE).raddr(550, lkey).data(100, key, base + 30_000);
        p.r.post_send(&mut p.b, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
    }

    /// One strided entry of a repeat block: `bcount` bytes at `addr` of key `key`, `stride` bytes further each cycle.
    struct Strided {
        addr: u64,
        bcount: u16,
        stride: u16,
        key: u32,
    }

    /// An mlx5dv interleaved layout as rdma-core's `umr_strided_seg_create` builds it on indirect key `mkey`
    /// (giving it variant 0x44, local write and remote read and write): the repeat block header (`repeat_count`
    /// cycles, `per_cycle` bytes each, `n` entries named), the entries, zero padding to 64 bytes.
    fn interleaved_umr(mkey: u32, repeat_count: u32, per_cycle: u32, n: u16, entries: &[Strided]) -> Wqe {
        use c::mlx5_stride_block_ctrl_seg as rb;
        use c::mlx5_stride_block_entry as se;
        use c::mlx5_wqe_umr_ctrl_seg as u;
        use ifc::mkc as m;
        let mask = consts::MLX5_MKEY_MASK_FREE
            | consts::MLX5_MKEY_MASK_KEY
            | consts::MLX5_MKEY_MASK_LEN
            | consts::MLX5_MKEY_MASK_LW
            | consts::MLX5_MKEY_MASK_RR
            | consts::MLX5_MKEY_MASK_RW;
        let area = (rb::SIZE + entries.len() * se::SIZE).next_multiple_of(64);
        let mut segs = vec![0u8; u::SIZE + m::SIZE_BYTES + area];
        segs[u::FLAGS.off] = consts::MLX5_WQE_UMR_CTRL_FLAG_INLINE as u8;
        segs[u::MKEY_MASK.off..u::MKEY_MASK.end()].copy_from_slice(&u64::from(mask).to_be_bytes());
        segs[u::XLT_OCTOWORDS.off..u::XLT_OCTOWORDS.end()].copy_from_slice(&((area / 16) as u16).to_be_bytes());
        {
            let ctx = &mut segs[u::SIZE..u::SIZE + m::SIZE_BYTES];
            ctx.set(m::QPN, 0xff_ffff);
            ctx.set(m::MKEY_7_0, 0x44);
            for f in [m::LW, m::RR, m::RW] {
                ctx.set(f, 1);
            }
            ctx.set64(m::LEN, u64::from(per_cycle) * u64::from(repeat_count));
        }
        let at = u::SIZE + m::SIZE_BYTES;
        let put = |segs: &mut Vec<u8>, f: mlx5_core::prm::Bytes, base: usize, v: &[u8]| {
            segs[base + f.off..base + f.end()].copy_from_slice(v);
        };
        put(&mut segs, rb::BCOUNT_PER_CYCLE, at, &per_cycle.to_be_bytes());
        put(&mut segs, rb::OP, at, &consts::MLX5_STRIDE_BLOCK_OP.to_be_bytes());
        put(&mut segs, rb::REPEAT_COUNT, at, &repeat_count.to_be_bytes());
        put(&mut segs, rb::NUM_ENTRIES, at, &n.to_be_bytes());
        for (i, e) in entries.iter().enumerate() {
            let b = at + rb::SIZE + i * se::SIZE;
            put(&mut segs, se::STRIDE, b, &e.stride.to_be_bytes());
            put(&mut segs, se::BCOUNT, b, &e.bcount.to_be_bytes());
            put(&mut segs, se::KEY, b, &e.key.to_be_bytes());
            put(&mut segs, se::VA, b, &e.addr.to_be_bytes());
        }
        Wqe { segs, ..Wqe::new(consts::MLX5_OPCODE_UMR).imm(mkey) }
    }

    #[test]
    fn an_interleaved_mkey_walks_its_repeat_block_cycle_by_cycle() {
        // rdma-core's test_mkey_interleaved: two entries of 8 bytes, each skipping 2 bytes a cycle, 3 cycles (48
        // bytes). A SEND gathers through the key as an lkey, a WRITE scatters through it as an rkey, an access
        // past its 48 bytes is refused.
        let mut p = pair();
        let (key, base) = (p.mr.key, p.mr.addr());
        let mkey = alloc_mw(&mut p.r, false);
        let entries = [
            Strided { addr: base + 1000, bcount: 8, stride: 10, key },
            Strided { addr: base + 1064, bcount: 8, stride: 10, key },
        ];
        p.r.post_send(&mut p.a, &interleaved_umr(mkey, 3, 16, 2, &entries), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0), "layout");
        let lkey = mkey | 0x44;
        let region = pattern(128, 5);
        p.mr.write(1000, &region);
        // The key's bytes: per cycle c, 8 at 1000 + 10c, then 8 at 1064 + 10c (offsets into `region`).
        let order: Vec<usize> = (0..3).flat_map(|c| [10 * c, 64 + 10 * c]).collect();
        let want: Vec<u8> = order.iter().flat_map(|&o| region[o..o + 8].to_vec()).collect();
        p.r.post_recv(&mut p.b, &[(base + 20_000, 1024, key)]);
        p.r.post_send(&mut p.a, &Wqe::new(SEND).data(48, lkey, 0), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.r.poll(&mut p.b_rcq).unwrap().byte_cnt(), 48);
        assert_eq!(p.mr.read(20_000, 48), want);
        // B WRITEs 20 bytes at offset 12 of the key: the last 4 bytes of cycle 0's second entry, then both
        // entries of cycle 1; the skipped bytes between them stay as they were.
        let new = pattern(20, 99);
        p.mr.write(30_000, &new);
        let w = Wqe::new(RDMA_WRITE).raddr(12, lkey).data(20, key, base + 30_000);
        p.r.post_send(&mut p.b, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ, 0));
        assert_eq!(p.mr.read(1068, 4), new[..4]);
        assert_eq!(p.mr.read(1010, 8), new[4..12]);
        assert_eq!(p.mr.read(1074, 8), new[12..]);
        assert_eq!(p.mr.read(1018, 2), region[18..20], "skipped bytes untouched");
        assert_eq!(p.mr.read(1064, 4), region[64..68]);
        // Past its 48 bytes: a remote access error.
        let w = Wqe::new(RDMA_WRITE).raddr(40, lkey).data(16, key, base + 30_000);
        p.r.post_send(&mut p.b, &w, Bell::Db);
        assert_eq!(p.r.poll(&mut p.b_scq).unwrap().status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
    }

    #[test]
    fn bad_repeat_blocks_complete_with_a_memory_window_bind_error() {
        type Case = fn(&mut Pair, u32, u32) -> Wqe;
        let ok = |base: u64, key: u32| Strided { addr: base, bcount: 8, stride: 10, key };
        let cases: [(&str, Case); 7] = [
            ("no entries", |_, mkey, _| interleaved_umr(mkey, 3, 0, 0, &[])),
            ("more entries than the key's 4 descriptors", |p, mkey, key| {
                let e: Vec<Strided> =
                    (0..5).map(|i| Strided { addr: p.mr.addr() + 100 * i, bcount: 8, stride: 10, key }).collect();
                interleaved_umr(mkey, 3, 40, 5, &e)
            }),
            ("an entry of 0 bytes", |p, mkey, key| {
                let e = [
                    Strided { addr: p.mr.addr(), bcount: 8, stride: 10, key },
                    Strided { addr: p.mr.addr() + 64, bcount: 0, stride: 10, key },
                ];
                interleaved_umr(mkey, 3, 8, 2, &e)
            }),
            ("a key of another PD", |p, mkey, _| {
                let (s, _, out) = p.r.h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
                assert_eq!(s, 0);
                let pd2 = MsgBuf::get(&out[..], ifc::alloc_pd_out::PD);
                let other = p.r.mr_in(pd2, 4096, [true, true, true, true]);
                interleaved_umr(mkey, 3, 8, 1, &[Strided { addr: other.addr(), bcount: 8, stride: 10, key: other.key }])
            }),
            ("no cycles", |p, mkey, key| {
                interleaved_umr(mkey, 0, 8, 1, &[Strided { addr: p.mr.addr(), bcount: 8, stride: 10, key }])
            }),
            ("a header whose bytes per cycle disagree with its entries", |p, mkey, key| {
                interleaved_umr(mkey, 3, 12, 1, &[Strided { addr: p.mr.addr(), bcount: 8, stride: 10, key }])
            }),
            ("the last cycle past the region's end", |p, mkey, key| {
                let end = p.mr.addr() + p.mr.region.len() as u64;
                interleaved_umr(mkey, 3, 8, 1, &[Strided { addr: end - 100, bcount: 8, stride: 50, key }])
            }),
        ];
        for (what, make) in cases {
            let mut p = pair();
            let mkey = alloc_mw(&mut p.r, false);
            let key = p.mr.key;
            let w = make(&mut p, mkey, key);
            p.r.post_send(&mut p.a, &w, Bell::Db);
            let e = p.r.poll(&mut p.a_scq).expect(what);
            assert_eq!(e.status(), (REQ_ERR, consts::MLX5_CQE_SYNDROME_MW_BIND_ERR), "{what}");
            // The key stays unusable.
            let access = crate::fw::mkey::MkeyAccess::LOCAL_READ;
            assert!(p.r.h.dev.mkey_access(mkey | 0x44, None, 0, 8, access).is_err(), "{what}");
        }
        // The same layout with its header right binds (the cases above fail for their one fault).
        let mut p = pair();
        let mkey = alloc_mw(&mut p.r, false);
        let (key, base) = (p.mr.key, p.mr.addr());
        p.r.post_send(&mut p.a, &interleaved_umr(mkey, 3, 8, 1, &[ok(base, key)]), Bell::Db);
        assert_eq!(p.r.poll(&mut p.a_scq).unwrap().status(), (REQ, 0));
    }
}

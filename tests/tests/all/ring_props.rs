//! Ring arithmetic as properties (proptest): owner bits per lap, index wrap, counters at the widths the hardware
//! keeps them (16-bit WQE counters, 24-bit consumer indices in doorbell records and doorbells, 32-bit software
//! counters), exactly-once completion delivery for any batch sizes over many laps, and the overflow margins
//! (queue-full refusals, the EQ's spare entries, the 24-bit distance a device computes).
//!
//! The CQ and EQ rings run over plain memory with this file playing the device; the send and receive queues run
//! on the simulated device, whose datapath consumes what the driver posts.

use std::collections::VecDeque;

use mlx5_core::buf::QueueBuf;
use mlx5_core::cq::{
    arm_value, Cq, CqeFields, CqeSize, LinkLayer, Notify, WorkCompletion, WrTable, CQE64_SIZE, CQ_DOORBELL,
};
use mlx5_core::dbr::DbrPool;
use mlx5_core::eq::{eq_doorbell_value, EqRing, EQE_SIZE};
use mlx5_core::hal::{Dma, DmaError, DmaRegion};
use mlx5_core::hca::{Config, Hca};
use mlx5_core::hca::{CqAttr, QpInitAttr};
use mlx5_core::mkey::Access;
use mlx5_core::prm::consts;
use mlx5_core::qp::{
    required_attrs, AhAttr, Grh, Mtu, PostError, PostErrorKind, Qp, QpAttr, QpCap, QpState, QpType, RecvWr, SendFlags,
    SendOp, SendWr, Sge,
};
use mlx5_sim::testkit::{HeapDma, RegFile};
use mlx5_sim::{SimConfig, SimDevice};
use proptest::prelude::*;

/// 24 bits: what doorbell records and doorbells carry of a consumer index.
const M24: u32 = 0xff_ffff;
const UAR: usize = 0x4000;

/// An allocator that has no piece larger than `max`: rings above it come in fragments.
struct Fragmented<'a> {
    dma: &'a HeapDma,
    max: usize,
}

// SAFETY: forwards to `HeapDma`, which upholds the contract; refusing large requests changes nothing about the
// regions it does return.
unsafe impl Dma for Fragmented<'_> {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if len > self.max {
            return Err(DmaError::NoMemory { len });
        }
        self.dma.alloc(len, align)
    }
    unsafe fn free(&self, region: DmaRegion) {
        // SAFETY: the caller's duties are passed through unchanged.
        unsafe { self.dma.free(region) }
    }
}

/// Receive completions carry no WQE counter for a QP: the table hands back the order they arrive in, and the CQE's
/// `byte_cnt` (which the test device sets to the CQE's producer index) identifies them.
struct Any;

impl WrTable for Any {
    fn send_done(&mut self, _qpn: u32, wqe_counter: u16) -> Option<u64> {
        Some(wqe_counter.into())
    }
    fn recv_done(&mut self, _qpn: u32, _srqn: u32, _wqe_counter: u16) -> Option<u64> {
        Some(0)
    }
    fn flush_one(&mut self, _cqn: u32, _dead: bool) -> Option<mlx5_core::cq::WorkCompletion> {
        // Only the ring itself is polled here, never through an HCA.
        None
    }
}

/// A CQ over plain memory and the device that fills it.
struct CqRig {
    dma: HeapDma,
    regs: RegFile<'static>,
    cq: Cq,
    /// The device's producer index.
    pi: u32,
}

impl CqRig {
    fn new(log_nent: u8, size: CqeSize, max_contig: Option<usize>) -> Self {
        let dma = HeapDma::default();
        let buf = match max_contig {
            Some(max) => QueueBuf::alloc(&Fragmented { dma: &dma, max }, size.bytes() << log_nent),
            None => QueueBuf::alloc(&dma, size.bytes() << log_nent),
        }
        .unwrap();
        Cq::init_buf(&buf, log_nent, size);
        let dbrec = DbrPool::<1>::new(64).alloc(&dma).unwrap();
        let cq = Cq::new(buf, dbrec, 0x42, log_nent, size, UAR, LinkLayer::Ethernet);
        CqRig { dma, regs: RegFile::new(), cq, pi: 0 }
    }

    /// Bus address of the 64-byte CQE image of entry `n` (the second half of a 128-byte entry).
    fn entry(&self, n: u32) -> u64 {
        let stride = self.cq.cqe_size().bytes();
        let (r, o) = self.cq.buf().locate((n & (self.cq.nent() - 1)) as usize * stride + stride - CQE64_SIZE);
        r.iova() + o as u64
    }

    /// The device completes a receive: `byte_cnt` is the producer index, the owner bit that of its pass.
    fn produce(&mut self) {
        let f = CqeFields {
            opcode: consts::MLX5_CQE_RESP_SEND,
            owner: ((self.pi >> self.cq.log_nent()) & 1) as u8,
            qpn: 7,
            wqe_counter: self.pi as u16,
            byte_cnt: self.pi,
            ..CqeFields::default()
        };
        self.dma.write(self.entry(self.pi), &f.emit().0);
        self.pi = self.pi.wrapping_add(1);
    }

    fn poll(&mut self, batch: usize) -> Vec<u32> {
        let mut wc = vec![WorkCompletion::default(); batch];
        let n = self.cq.poll(&self.regs, &mut Any, &mut wc).expect("good CQEs");
        wc[..n].iter().map(|w| w.byte_len).collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// For any ring (64- or 128-byte CQEs, one fragment or several) and any interleaving of the device writing
    /// and the consumer polling in batches of any size, over many laps: every completion comes back exactly once,
    /// in order; an entry from the previous lap is never taken for a new one; the doorbell record always holds the
    /// consumer index's low 24 bits.
    #[test]
    fn cq_delivers_each_completion_once_for_any_batches(
        log_nent in 0u8..=6,
        big in any::<bool>(),
        frag in any::<bool>(),
        steps in prop::collection::vec((0u32..=140, 0usize..=140), 1..40),
    ) {
        let size = if big { CqeSize::B128 } else { CqeSize::B64 };
        let mut r = CqRig::new(log_nent, size, frag.then_some(4096));
        let nent = r.cq.nent();
        for (produce, batch) in steps {
            // The device never overruns the consumer.
            let room = nent - r.pi.wrapping_sub(r.cq.cons_index());
            for _ in 0..produce.min(room) {
                r.produce();
            }
            let ci = r.cq.cons_index();
            let got = r.poll(batch);
            let want: Vec<u32> = (0..(r.pi - ci).min(batch as u32)).map(|k| ci + k).collect();
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(r.cq.cons_index(), ci + got.len() as u32);
            prop_assert_eq!(r.cq.dbrec().read_be32(0), r.cq.cons_index() & M24);
        }
        // Everything written comes out; nothing more (the previous lap's entries stay invisible).
        let left = r.pi - r.cq.cons_index();
        let ci = r.cq.cons_index();
        prop_assert_eq!(r.poll(nent as usize + 1), (ci..ci + left).collect::<Vec<u32>>());
        prop_assert!(r.poll(nent as usize + 1).is_empty());
    }

    /// The arm doorbell (`sn << 28 | cmd | ci`, 64-bit with the CQ number) and the EQ doorbell
    /// (`ci & 0xffffff | eqn << 24`) keep exactly the bits the device reads, for consumer indices anywhere,
    /// including across 2^24 and 2^32; consecutive arm sequence numbers differ.
    #[test]
    fn doorbell_values_keep_24_bits_of_the_index(
        ci in prop_oneof![any::<u32>(), 0xff_ff00u32..=0x100_0100, u32::MAX - 256..=u32::MAX, 0u32..=256],
        sn in any::<u32>(),
        eqn in any::<u8>(),
        sol in any::<bool>(),
    ) {
        let (notify, cmd) = if sol {
            (Notify::Solicited, consts::MLX5_CQ_DB_REQ_NOT_SOL)
        } else {
            (Notify::NextComp, consts::MLX5_CQ_DB_REQ_NOT)
        };
        let v = arm_value(sn, notify, ci);
        prop_assert_eq!(v >> 28, sn & 3);
        prop_assert_eq!(v & (0xf << 24), cmd);
        prop_assert_eq!(v & M24, ci & M24);
        prop_assert_ne!(arm_value(sn.wrapping_add(1), notify, ci), v);
        let e = eq_doorbell_value(eqn, ci);
        prop_assert_eq!(e >> 24, u32::from(eqn));
        prop_assert_eq!(e & M24, ci & M24);
    }

    /// What the device can tell from 24 bits: the distance between its producer index and the published consumer
    /// index, wherever the two are (across 2^24 and 2^32), so a full ring and an overrun are recognised.
    #[test]
    fn published_24_bit_index_keeps_the_ring_distance(
        ci in prop_oneof![any::<u32>(), 0xff_ff00u32..=0x100_0100, u32::MAX - 4096..=u32::MAX],
        log_nent in 0u32..=22,
        extra in 0u32..=4096,
    ) {
        let nent = 1u32 << log_nent;
        for d in [0, 1, nent / 2, nent - 1, nent, nent + 1 + extra] {
            let pi = ci.wrapping_add(d);
            let seen = (pi & M24).wrapping_sub(ci & M24) & M24;
            prop_assert_eq!(seen, d, "distance {} at ci {:#x}", d, ci);
            prop_assert_eq!(seen > nent, d > nent, "overrun visible");
        }
    }

    /// `QueueBuf::locate` reduces any ring offset, however large (entry indices past 2^32 included), to the same
    /// place as the offset within the ring; every byte of the ring has exactly one place.
    #[test]
    fn queue_buf_offsets_wrap_at_the_ring(
        log_len in 12u32..=16,
        frag_log in 12u32..=16,
        n in prop_oneof![
            any::<u32>().prop_map(u64::from),
            (1u64 << 32) - 512..(1u64 << 32) + 512,
            any::<u64>().prop_map(|v| v >> 20),
        ],
        big in any::<bool>(),
    ) {
        let dma = HeapDma::default();
        let len = 1usize << log_len;
        let buf = QueueBuf::alloc(&Fragmented { dma: &dma, max: 1 << frag_log.min(log_len) }, len).unwrap();
        let stride = if big { 128u64 } else { 64 };
        let nent = len as u64 / stride;
        let (a, ao) = buf.locate((n * stride) as usize);
        let (b, bo) = buf.locate(((n % nent) * stride) as usize);
        prop_assert_eq!((a.iova(), ao), (b.iova(), bo));
        prop_assert!(ao + stride as usize <= a.len(), "an entry never crosses a fragment");
        let mut seen: Vec<u64> = (0..len)
            .step_by(64)
            .map(|o| {
                let (r, x) = buf.locate(o);
                r.iova() + x as u64
            })
            .collect();
        seen.sort_unstable();
        seen.dedup();
        prop_assert_eq!(seen.len(), len / 64);
    }

    /// An EQ drained while a device keeps writing, the device knowing only the consumer index the driver
    /// published: the device never overruns an unconsumed entry, the driver never holds 128 consumed entries
    /// unpublished (so a long drain never stalls the device), entries come back exactly once, and every doorbell
    /// carries the EQ number and the index's low 24 bits.
    #[test]
    fn eq_drain_publishes_before_the_device_runs_out(
        log_nent in 0u8..=9,
        eqn in any::<u8>(),
        steps in prop::collection::vec((0u32..=600, 0u32..=600, any::<bool>()), 1..12),
    ) {
        let dma = HeapDma::default();
        let regs = RegFile::new();
        let buf = dma.alloc(EqRing::buf_len(log_nent), 4096).unwrap();
        let buf_iova = buf.iova();
        EqRing::init_buf(&buf, log_nent).unwrap();
        let mut eq = EqRing::new(buf, log_nent, eqn, UAR);
        let nent = eq.nent();
        let db = UAR + consts::MLX5_EQ_DOORBELL_OFFSET as usize;
        let mut pi = 0u32;
        let mut published = 0u32;
        let mut writes = 0usize;
        for (produce, drain, arm) in steps {
            for _ in 0..drain {
                // The device writes what the published index allows, one entry per consumer step.
                for _ in 0..produce.min(4) {
                    if pi.wrapping_sub(published) >= nent {
                        break;
                    }
                    let mut e = [0u8; EQE_SIZE];
                    e[0..4].copy_from_slice(&pi.to_be_bytes());
                    e[EQE_SIZE - 1] = ((pi >> log_nent) & 1) as u8;
                    dma.write(buf_iova + u64::from(pi & (nent - 1)) * EQE_SIZE as u64, &e);
                    pi = pi.wrapping_add(1);
                }
                let ci = eq.cons_index();
                match eq.next(&regs) {
                    Some(e) => {
                        prop_assert_eq!(u32::from_be_bytes(e.0[0..4].try_into().unwrap()), ci, "in order, once");
                        prop_assert_eq!(eq.cons_index(), ci + 1);
                    }
                    None => prop_assert_eq!(pi, ci, "a written entry was not handed out"),
                }
                for w in &regs.words()[writes..] {
                    prop_assert!(w.0 == db || w.0 == db + 8);
                    prop_assert_eq!(w.1 >> 24, u32::from(eqn));
                    published = w.1 & M24;
                }
                writes = regs.words().len();
                prop_assert!(eq.cons_index().wrapping_sub(published) & M24 < consts::MLX5_NUM_SPARE_EQE);
                prop_assert!(pi.wrapping_sub(eq.cons_index()) <= nent, "device overran the consumer");
            }
            eq.update_ci(&regs, arm);
            let w = *regs.words().last().unwrap();
            prop_assert_eq!(w, (if arm { db } else { db + 8 }, eq_doorbell_value(eqn, eq.cons_index())));
            published = eq.cons_index() & M24;
            writes = regs.words().len();
        }
    }
}

/// The CQ consumer index past 2^24: the doorbell record and the arm doorbell wrap to small values while
/// completions keep coming exactly once. The first 2^24 entries are signature-error CQEs, which a poll consumes
/// without returning (as the kernel does), a whole ring per poll.
#[test]
fn cq_consumer_index_crosses_2_pow_24() {
    let mut r = CqRig::new(12, CqeSize::B64, None);
    let nent = r.cq.nent();
    let ring = r.cq.buf().frag(0).unwrap().cpu();
    let target = (1u32 << 24) - 3 * nent / 2;
    let sig = consts::MLX5_CQE_SIG_ERR << 4;
    while r.pi < target {
        let owner = ((r.pi >> 12) & 1) as u8;
        for i in 0..nent {
            // SAFETY: the op_own byte of entry i, inside the ring's single fragment; the CQ reads it only in poll.
            unsafe { ring.as_ptr().add(i as usize * 64 + 63).write_volatile(sig | owner) };
        }
        r.pi += nent;
        assert!(r.poll(1).is_empty());
        assert_eq!(r.cq.cons_index(), r.pi);
    }
    // Real completions across 2^24, in uneven batches.
    let mut batch = 1;
    while r.pi < (1 << 24) + 2 * nent {
        let room = nent - (r.pi - r.cq.cons_index());
        for _ in 0..room.min(777) {
            r.produce();
        }
        let ci = r.cq.cons_index();
        let got = r.poll(batch);
        assert_eq!(got, (ci..ci + got.len() as u32).collect::<Vec<u32>>());
        assert_eq!(r.cq.dbrec().read_be32(0), r.cq.cons_index() & M24);
        batch = batch % 300 + 97;
    }
    let ci = r.cq.cons_index();
    assert!(ci > 1 << 24 && r.cq.dbrec().read_be32(0) == ci - (1 << 24), "the record wrapped to {ci:#x} & 0xffffff");
    r.cq.arm(&r.regs, 5, Notify::NextComp);
    let w = r.regs.words();
    let (hi, lo) = (w[w.len() - 2], w[w.len() - 1]);
    assert_eq!((hi.0, lo.0), (UAR + CQ_DOORBELL, UAR + CQ_DOORBELL + 4));
    assert_eq!((hi.1 & M24, hi.1 >> 28, lo.1), (ci & M24, 1, 0x42));
}

// ---------------------------------------------------------------------------------------------------------------
// Send and receive queues on the simulated device

use mlx5_sim::testkit::SimHca;

struct Loop {
    dev: SimDevice,
    d: mlx5_sim::SimDelay,
    hca: SimHca,
    pd: mlx5_core::hca::Pd,
    mem: DmaRegion,
    mr: mlx5_core::mkey::Mr,
    cq: Cq,
    qp: Qp,
}

impl Loop {
    /// An RC QP connected to itself, every send signaled.
    fn new(cap: QpCap) -> Self {
        let dev = SimDevice::new(SimConfig::default());
        let mut d = dev.delay();
        let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
        let pd = hca.alloc_pd(&mut d).unwrap();
        let mem = dev.dma().alloc(1 << 16, 4096).unwrap();
        let mr = hca.reg_mr(&pd, mem.cpu().as_ptr(), 1 << 16, Access::ALL, &mut d).unwrap();
        let cq = hca.create_cq(CqAttr { cqe: 1023, ..CqAttr::default() }, &mut d).unwrap();
        let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: true };
        let mut qp = hca.create_qp(&pd, &cq, &cq, attr, &mut d).unwrap();
        let gid = hca.query_gid(0, &mut d).unwrap();
        let ah_attr = AhAttr {
            grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
            dmac: dev.config().mac,
            port_num: 1,
            ..AhAttr::default()
        };
        let a = QpAttr {
            qp_access_flags: Access::REMOTE_WRITE | Access::LOCAL_WRITE,
            path_mtu: Mtu::M1024,
            dest_qp_num: qp.qpn(),
            ah_attr,
            rnr_retry: 7,
            retry_cnt: 7,
            min_rnr_timer: 1,
            max_dest_rd_atomic: 1,
            max_rd_atomic: 1,
            ..QpAttr::default()
        };
        for (f, s) in [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)] {
            let m = required_attrs(QpType::Rc, f, s).expect("an RC transition");
            hca.modify_qp(&mut qp, &QpAttr { qp_state: s, ..a }, m, &mut d).unwrap();
        }
        Loop { dev, d, hca, pd, mem, mr, cq, qp }
    }

    fn write(&self, wr_id: u64) -> SendWr<'static> {
        SendWr {
            wr_id,
            op: SendOp::RdmaWrite { remote_addr: self.mem.cpu().as_ptr() as u64 + 0x8000, rkey: self.mr.rkey },
            sg_list: &[],
            flags: SendFlags::SIGNALED,
            inline: None,
            ud: None,
        }
    }

    fn poll(&mut self) -> Vec<WorkCompletion> {
        let mut all = Vec::new();
        let mut wc = [WorkCompletion::default(); 64];
        loop {
            let n = self.cq.poll(self.hca.mmio(), &mut self.qp, &mut wc).unwrap();
            all.extend_from_slice(&wc[..n]);
            if n < wc.len() {
                return all;
            }
        }
    }

    fn finish(mut self) {
        let d = &mut self.d;
        self.hca.destroy_qp(self.qp, d).map_err(|e| e.error).unwrap();
        self.hca.destroy_cq(self.cq, d).map_err(|e| e.error).unwrap();
        self.hca.dereg_mr(self.mr, d).map_err(|e| e.error).unwrap();
        self.hca.dealloc_pd(self.pd, d).map_err(|e| e.error).unwrap();
        // SAFETY: the memory key over the region is destroyed.
        unsafe { self.dev.dma().free(self.mem) };
        self.hca.teardown(d).unwrap();
        assert_eq!(self.dev.dma_outstanding(), (0, 0));
    }
}

/// The SQ producer counter past 2^16: WQEs carry its low 16 bits, the device's CQEs name WQEs by those 16 bits,
/// and completions still find their work requests, in order, each once.
#[test]
fn sq_wqe_counter_crosses_2_pow_16() {
    let mut l =
        Loop::new(QpCap { max_send_wr: 64, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 });
    let mut next = 0u64;
    let mut done = 0u64;
    while l.qp.sq_cur_post() < (1 << 16) + 300 {
        let batch = (next % 61 + 1).min(u64::from(64 - l.qp.sq_outstanding()));
        let wrs: Vec<SendWr<'_>> = (0..batch).map(|k| l.write(next + k)).collect();
        let at = l.qp.sq_cur_post();
        l.hca.post_send(&mut l.qp, &wrs).unwrap();
        let mut ctrl = [0u8; 16];
        l.qp.read_sq(at, &mut ctrl);
        assert_eq!(u32::from_be_bytes(ctrl[0..4].try_into().unwrap()) >> 8 & 0xffff, at & 0xffff, "WQE index");
        assert_eq!(l.qp.dbrec().read_be32(consts::MLX5_SND_DBR as usize), l.qp.sq_cur_post() & 0xffff);
        next += batch;
        for w in l.poll() {
            assert_eq!(w.status, mlx5_core::cq::WcStatus::Success);
            assert_eq!(w.wr_id, done, "completions in posting order, each once");
            done += 1;
        }
        assert_eq!(u64::from(l.qp.sq_outstanding()), next - done);
    }
    assert_eq!(done, next);
    l.finish();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any interleaving of posting receives, posting sends (each consuming one receive on this loopback QP) and
    /// polling, in batches of any size, over many laps of small queues: a post is refused with `QueueFull` exactly
    /// at the request that would exceed the queue (and everything before it is posted), outstanding counts and
    /// doorbell records follow the counters, and every completion comes back once, in posting order.
    #[test]
    fn sq_rq_accounting_for_any_batches(
        steps in prop::collection::vec((0u8..=2, 0usize..=12), 1..30),
        sq in 1u32..=8,
        rq in 1u32..=8,
    ) {
        let cap = QpCap { max_send_wr: sq, max_recv_wr: rq, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let mut l = Loop::new(cap);
        let (sq_max, rq_max) = (l.qp.cap().max_send_wr, l.qp.sizes().rq_wqe_cnt);
        let sge = [Sge { addr: l.mem.cpu().as_ptr() as u64, length: 64, lkey: l.mr.lkey }];
        let (mut sends, mut recvs, mut send_done, mut recv_done) = (0u64, 0u64, 0u64, 0u64);
        let mut pending_recv: VecDeque<u64> = VecDeque::new();
        for (what, n) in steps {
            match what {
                0 => {
                    let wrs: Vec<RecvWr<'_>> =
                        (0..n as u64).map(|k| RecvWr { wr_id: 1 << 32 | (recvs + k), sg_list: &sge }).collect();
                    let room = (rq_max - l.qp.rq_outstanding()) as usize;
                    let r = l.hca.post_recv(&mut l.qp, &wrs);
                    let posted = n.min(room);
                    if n > room {
                        let full = PostErrorKind::QueueFull { outstanding: rq_max, max: rq_max };
                        prop_assert_eq!(r, Err(PostError { index: room, kind: full }));
                    } else {
                        prop_assert_eq!(r, Ok(()));
                    }
                    pending_recv.extend((0..posted as u64).map(|k| recvs + k));
                    recvs += posted as u64;
                    prop_assert_eq!(l.qp.dbrec().read_be32(consts::MLX5_RCV_DBR as usize), (recvs & 0xffff) as u32);
                }
                1 => {
                    // Only as many sends as there are receives for them (else the responder runs out: RNR).
                    let n = n.min(pending_recv.len());
                    let wrs: Vec<SendWr<'_>> = (0..n as u64)
                        .map(|k| SendWr {
                            wr_id: sends + k,
                            op: SendOp::Send,
                            sg_list: &sge,
                            flags: SendFlags::SIGNALED,
                            inline: None,
                            ud: None,
                        })
                        .collect();
                    let room = (sq_max - l.qp.sq_outstanding()) as usize;
                    let r = l.hca.post_send(&mut l.qp, &wrs);
                    let posted = n.min(room);
                    if n > room {
                        let full = PostErrorKind::QueueFull { outstanding: sq_max, max: sq_max };
                        prop_assert_eq!(r, Err(PostError { index: room, kind: full }));
                    } else {
                        prop_assert_eq!(r, Ok(()));
                    }
                    for _ in 0..posted {
                        pending_recv.pop_front();
                    }
                    sends += posted as u64;
                    prop_assert_eq!(l.qp.dbrec().read_be32(consts::MLX5_SND_DBR as usize), l.qp.sq_cur_post() & 0xffff);
                }
                _ => {
                    for w in l.poll() {
                        prop_assert_eq!(w.status, mlx5_core::cq::WcStatus::Success);
                        if w.wr_id >> 32 == 1 {
                            prop_assert_eq!(w.wr_id & 0xffff_ffff, recv_done, "receives in order, once");
                            recv_done += 1;
                        } else {
                            prop_assert_eq!(w.wr_id, send_done, "sends in order, once");
                            send_done += 1;
                        }
                    }
                }
            }
            prop_assert!(l.qp.sq_outstanding() <= sq_max && l.qp.rq_outstanding() <= rq_max);
        }
        for w in l.poll() {
            if w.wr_id >> 32 == 1 {
                recv_done += 1
            } else {
                send_done += 1
            }
        }
        prop_assert_eq!((send_done, u64::from(l.qp.sq_outstanding())), (sends, 0));
        prop_assert_eq!(u64::from(l.qp.rq_outstanding()), recvs - recv_done);
        l.finish();
    }
}

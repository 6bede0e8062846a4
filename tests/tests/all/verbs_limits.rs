//! What `ibv_devinfo -v` advertises is what the stack honours: each per-object limit (`max_qp_wr`, `max_sge`,
//! `max_inline_data`, `max_cqe`, `max_srq_wr`, `max_srq_sge`) is created at the limit and refused one past it as a
//! refusal of the arguments (the drop-in's `EINVAL`), not a device or memory failure. The object counts (`max_pd`,
//! `max_cq`, `max_mr`, `max_srq`, `max_qp`) are reached on a device that reports 2^7 of each, so no host table or
//! fixed array stops short of what the device offers and the next one is the device's `NO_RESOURCES`. A ConnectX-5's
//! counts (2^18 QPs, 2^24 CQs, MRs and PDs, 2^23 SRQs) are beyond a test: `cargo xtask bench --scale` makes 65,536
//! QPs, CQs and MRs, and `max_qp_is_reached_and_refused_past_it` (ignored: about a minute in release, gigabytes)
//! all of `max_qp`. `max_ah` (`INT_MAX`, as mlx5_ib) names no device object: an address handle is host memory.

use mlx5_core::hca::Hca;
use mlx5_core::trace::CmdTrace;
use mlx5_sim::{ObjectLimits, SimConfig, SimDevice};
use mlx5_verbs::devinfo::{self, DevInfo};
use mlx5_verbs::raw::{self, HcaVisitor};
use mlx5_verbs::{AnyDelay, AnyDma, AnyMmio, Context, HostTables, QpCap, QpType, SrqInitAttr, VerbsError};

struct Query;

impl HcaVisitor for Query {
    /// What devinfo shows, and the send and receive queues' SGE limits (`max_sge` is the smaller).
    type Out = (DevInfo, u32, u32);
    fn visit<T: CmdTrace>(self, hca: &mut Hca<AnyMmio, AnyDma, T, HostTables>, delay: &mut AnyDelay) -> Self::Out {
        let g = hca.caps().general;
        (devinfo::query(hca, delay, "mlx5_0", (0x15b3, 0x1017)).unwrap(), g.max_sq_sge(), g.max_rq_sge())
    }
}

fn info(ctx: &Context) -> DevInfo {
    raw::with_hca(ctx, Query).0
}

/// A refusal of the arguments (the drop-in's `EINVAL`), not a device or memory failure.
fn is_einval(e: &VerbsError) -> bool {
    use mlx5_core::hca::Error as H;
    match e {
        VerbsError::Invalid(_) => true,
        VerbsError::Hca(h) => !matches!(h, H::Dma(_) | H::Pages(_) | H::Dbr(_) | H::Health(_) | H::Cmd(_)),
        _ => false,
    }
}

const ONE: QpCap = QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

#[test]
fn every_per_object_limit_is_honoured_at_the_limit_and_refused_past_it() {
    let sim = SimDevice::new(SimConfig::default());
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let i = info(&ctx);
    let pd = ctx.alloc_pd().unwrap();

    // max_cqe: a CQ of exactly that many entries, and one more refused.
    let cq = ctx.create_cq(i.max_cqe).unwrap_or_else(|e| panic!("a CQ of max_cqe = {}: {e}", i.max_cqe));
    let e = ctx.create_cq(i.max_cqe + 1).map(drop).expect_err("a CQ past max_cqe");
    assert!(is_einval(&e), "past max_cqe: {e:?}");
    drop(cq);
    let cq = ctx.create_cq(4).unwrap();

    // max_qp_wr, on the send and the receive queue.
    let at = |cap: QpCap| pd.create_qp(QpType::Rc, &cq, &cq, cap).map(drop);
    let n = i.max_qp_wr;
    at(QpCap { max_send_wr: n, ..ONE }).unwrap_or_else(|e| panic!("max_send_wr = max_qp_wr = {n}: {e}"));
    at(QpCap { max_recv_wr: n, ..ONE }).unwrap_or_else(|e| panic!("max_recv_wr = max_qp_wr = {n}: {e}"));
    for cap in [QpCap { max_send_wr: n + 1, ..ONE }, QpCap { max_recv_wr: n + 1, ..ONE }] {
        let e = at(cap).expect_err("past max_qp_wr");
        assert!(is_einval(&e), "{cap:?}: {e}");
    }

    // max_sge on both queues. As mlx5_ib, max_sge is the smaller of the two queues' limits: the RQ's from
    // `max_wqe_sz_rq`, the SQ's from a descriptor of at most 512 bytes (30 entries), while a QP's send queue, sized
    // as rdma-core sizes it, takes entries up to the device's `max_wqe_sz_sq` (1024 bytes): the advertised figure
    // is a promise, the WQE size the bound, in Linux as here.
    let s = i.max_sge;
    at(QpCap { max_send_sge: s, max_recv_sge: s, ..ONE }).unwrap_or_else(|e| panic!("max_sge = {s}: {e}"));
    let (_, sq_sge, rq_sge) = raw::with_hca(&ctx, Query);
    assert_eq!((s, sq_sge), (sq_sge.min(rq_sge), 30));
    at(QpCap { max_recv_sge: rq_sge, ..ONE }).unwrap_or_else(|e| panic!("the RQ's own {rq_sge} SGEs: {e}"));
    let e = at(QpCap { max_recv_sge: rq_sge + 1, ..ONE }).expect_err("past the RQ's SGE limit");
    assert!(is_einval(&e), "past the RQ's SGE limit: {e}");
    // The SQ's bound: the first count refused is past what max_sge promises, and refused as bad arguments.
    let first_refused = (s..=128).find(|&n| at(QpCap { max_send_sge: n, ..ONE }).is_err()).expect("a bound");
    assert!(first_refused > s, "max_send_sge {first_refused} refused");
    let e = at(QpCap { max_send_sge: first_refused, ..ONE }).unwrap_err();
    assert!(is_einval(&e), "past the SQ's WQE size: {e}");
    // max_inline_data, on every QP type (each reserves its own fixed segments before the inline data).
    let d = i.max_inline_data;
    for ty in [QpType::Rc, QpType::Uc, QpType::Ud] {
        let cap = QpCap { max_inline_data: d, ..ONE };
        pd.create_qp(ty, &cq, &cq, cap).map(drop).unwrap_or_else(|e| panic!("{ty:?}, max_inline_data = {d}: {e}"));
    }
    // The largest fixed part (UD's datagram segment) leaves no slack: one byte more does not fit a UD WQE.
    let e = pd.create_qp(QpType::Ud, &cq, &cq, QpCap { max_inline_data: d + 1, ..ONE }).map(drop);
    let e = e.expect_err("a UD QP past max_inline_data");
    assert!(is_einval(&e), "past max_inline_data: {e}");

    // max_srq_wr.
    let w = i.max_srq_wr;
    let srq = pd.create_srq(SrqInitAttr { max_wr: w, max_sge: 1, srq_limit: 0 });
    drop(srq.unwrap_or_else(|e| panic!("an SRQ of max_srq_wr = {w}: {e}")));
    let e =
        pd.create_srq(SrqInitAttr { max_wr: w + 1, max_sge: 1, srq_limit: 0 }).map(drop).expect_err("past max_srq_wr");
    assert!(is_einval(&e), "past max_srq_wr: {e}");

    // max_srq_sge: an SRQ WQE also holds its next-WQE segment, so one entry fewer than the RQ's (as mlx5_ib
    // reports it); the drop-in reported max_sge here, which the firmware refused (WQE stride past
    // max_wqe_sz_rq).
    let g = i.max_srq_sge;
    assert_eq!(g, rq_sge - 1);
    let srq = pd.create_srq(SrqInitAttr { max_wr: 4, max_sge: g, srq_limit: 0 });
    drop(srq.unwrap_or_else(|e| panic!("an SRQ of max_srq_sge = {g}: {e}")));
    let e =
        pd.create_srq(SrqInitAttr { max_wr: 4, max_sge: g + 1, srq_limit: 0 }).map(drop).expect_err("past max_srq_sge");
    assert!(matches!(e, VerbsError::Hca(_) | VerbsError::Invalid(_)), "past max_srq_sge: {e}");

    // Everything went back.
    drop(cq);
    drop(pd);
    drop(ctx);
    assert_eq!(sim.dma_outstanding(), (0, 0));
}

#[test]
#[ignore = "max_qp (262,144) QPs: run in release (`cargo test --release -p mlx5-tests verbs_limits -- --ignored`)"]
fn max_qp_is_reached_and_refused_past_it() {
    let sim = SimDevice::new(SimConfig::default());
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let max = info(&ctx).max_qp as usize;
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4).unwrap();
    // Linux's mlx5_ib and the firmware keep QP numbers below 2^log_max_qp; the device's own QPs (none here) count.
    let qps: Vec<_> = (0..max)
        .map(|k| pd.create_qp(QpType::Rc, &cq, &cq, ONE).unwrap_or_else(|e| panic!("QP {k} of {max}: {e}")))
        .collect();
    assert_eq!(sim.qp_count(), max);
    let e = pd.create_qp(QpType::Rc, &cq, &cq, ONE).map(drop).expect_err("a QP past max_qp");
    eprintln!("QP {} past max_qp: {e}", max + 1);
    drop(qps);
    drop(cq);
    drop(pd);
    drop(ctx);
    assert_eq!(sim.dma_outstanding(), (0, 0));
    assert_eq!(sim.pages_owned(), 0);
}

/// A device reporting 2^LOG of each object, small enough to reach every count here.
const LOG: u8 = 7;

fn small_device() -> SimDevice {
    let object_limits = ObjectLimits {
        log_max_qp: LOG,
        log_max_cq: LOG,
        log_max_pd: LOG,
        log_max_mkey: LOG,
        log_max_srq: LOG,
        ..Default::default()
    };
    SimDevice::new(SimConfig { object_limits, ..SimConfig::default() })
}

/// Creates objects with `make` until it fails: how many it made (kept alive together), and the failure.
fn fill<T>(mut make: impl FnMut(usize) -> Result<T, VerbsError>) -> (Vec<T>, VerbsError) {
    let mut held = Vec::new();
    loop {
        match make(held.len()) {
            Ok(t) => held.push(t),
            Err(e) => return (held, e),
        }
        assert!(held.len() <= 1 << 20, "no limit reached");
    }
}

/// A refusal because the device has no more of an object (`NO_RESOURCES`, the drop-in's `ENOMEM`).
fn is_no_resources(e: &VerbsError) -> bool {
    use mlx5_core::cmdq::CmdError;
    matches!(e, VerbsError::Hca(mlx5_core::hca::Error::Cmd(CmdError::Status { status, .. }))
        if status.raw() == mlx5_core::prm::consts::MLX5_CMD_STAT_NO_RES_ERR)
}

#[test]
fn every_object_count_devinfo_shows_is_created_and_the_next_refused() {
    let sim = small_device();
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let i = info(&ctx);
    eprintln!(
        "2^{LOG} of each: max_pd {} max_cq {} max_mr {} max_srq {} max_qp {}",
        i.max_pd, i.max_cq, i.max_mr, i.max_srq, i.max_qp
    );

    let (pds, e) = fill(|_| ctx.alloc_pd());
    assert_eq!(pds.len(), i.max_pd as usize, "PDs made before {e}");
    assert!(is_no_resources(&e), "past max_pd: {e:?}");
    drop(pds);

    let (cqs, e) = fill(|_| ctx.create_cq(1));
    assert_eq!(cqs.len(), i.max_cq as usize, "CQs made before {e}");
    assert!(is_no_resources(&e), "past max_cq: {e:?}");
    drop(cqs);

    let pd = ctx.alloc_pd().unwrap();
    let mem = vec![0u8; 64];
    let (mrs, e) = fill(|_| pd.reg_mr_readonly(&mem, mlx5_verbs::Access::default()));
    assert_eq!(mrs.len(), i.max_mr as usize, "MRs made before {e}");
    assert!(is_no_resources(&e), "past max_mr: {e:?}");
    drop(mrs);

    let (srqs, e) = fill(|_| pd.create_srq(SrqInitAttr { max_wr: 1, max_sge: 1, srq_limit: 0 }));
    assert_eq!(srqs.len(), i.max_srq as usize, "SRQs made before {e}");
    assert!(is_no_resources(&e), "past max_srq: {e:?}");
    drop(srqs);

    let cq = ctx.create_cq(1).unwrap();
    let (qps, e) = fill(|_| pd.create_qp(QpType::Rc, &cq, &cq, ONE));
    assert_eq!(qps.len(), i.max_qp as usize, "QPs made before {e}");
    assert!(is_no_resources(&e), "past max_qp: {e:?}");
    drop(qps);

    drop(cq);
    drop(pd);
    drop(ctx);
    assert_eq!(sim.dma_outstanding(), (0, 0));
}

//! What the device advertises can be created through the verbs API: the doorbell-record pages, the CQ table the
//! completion events are routed by, and the firmware page pool grow on demand (as rdma-core's `dbrec.c` adds a
//! page per 64 records and frees it when empty), and everything goes back when the objects and the context do.
//!
//! The normal suite creates past each former cap (4,095 records, 256 CQs, 64 MiB of firmware pages);
//! `many_qps_and_cqs_come_and_go_full_count` (ignored: 13 to 27 s in a debug build on a loaded 2-CPU machine, 8 s
//! in release) creates 100,000 RC QPs and 20,000 CQs and prints the rates.

use std::time::Instant;

use mlx5_core::pages::{GIVE_BATCH, RECLAIM_BATCH};
use mlx5_core::prm::consts;
use mlx5_sim::{SimConfig, SimDevice};
use mlx5_verbs::{Context, QpCap, QpType};

/// The smallest RC QP: one send and one receive request of one SGE.
const CAP: QpCap = QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

/// What one run measured.
struct Scale {
    create_s: f64,
    destroy_s: f64,
    /// DMA bytes held while every object lived, less what the open context held before.
    dma_bytes: usize,
}

/// Creates `ncq` CQs and `nqp` RC QPs (QP `i` sends and receives on CQ `i % ncq`), checks the simulator holds them
/// all, destroys them, closes the context, and checks nothing is left: no DMA region, no firmware page.
fn create_and_destroy(nqp: usize, ncq: usize) -> Scale {
    let sim = SimDevice::new(SimConfig::default());
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let (_, base_bytes) = sim.dma_outstanding();
    let t0 = Instant::now();
    let cqs: Vec<_> = (0..ncq).map(|i| ctx.create_cq(1).unwrap_or_else(|e| panic!("CQ {i}: {e}"))).collect();
    let qps: Vec<_> = (0..nqp)
        .map(|i| {
            let cq = &cqs[i % ncq];
            pd.create_qp(QpType::Rc, cq, cq, CAP).unwrap_or_else(|e| panic!("QP {i}: {e}"))
        })
        .collect();
    let create_s = t0.elapsed().as_secs_f64();
    assert_eq!(sim.qp_count(), nqp, "the device holds every QP");
    assert_eq!(sim.cq_numbers().len(), ncq, "the device holds every CQ");
    let (_, peak_bytes) = sim.dma_outstanding();
    let t1 = Instant::now();
    drop(qps);
    drop(cqs);
    let destroy_s = t1.elapsed().as_secs_f64();
    assert_eq!((sim.qp_count(), sim.cq_numbers().len()), (0, 0));
    drop(pd);
    drop(ctx);
    assert_eq!(sim.dma_outstanding(), (0, 0), "every DMA region is given back");
    assert_eq!(sim.pages_owned(), 0, "firmware holds no page");
    Scale { create_s, destroy_s, dma_bytes: peak_bytes - base_bytes }
}

fn report(nqp: usize, ncq: usize, s: &Scale) {
    let objs = (nqp + ncq) as f64;
    eprintln!(
        "{nqp} QPs + {ncq} CQs: created in {:.2} s ({:.0} objects/s), destroyed in {:.2} s ({:.0} objects/s); \
         {} bytes of DMA memory per object",
        s.create_s,
        objs / s.create_s,
        s.destroy_s,
        objs / s.destroy_s,
        s.dma_bytes / (nqp + ncq),
    );
}

#[test]
fn more_qps_and_cqs_than_the_former_fixed_pools_come_and_go() {
    // 4,500 doorbell records past the former 4,095, and 300 CQs past the former 256.
    let (nqp, ncq) = (4_200, 300);
    let s = create_and_destroy(nqp, ncq);
    report(nqp, ncq, &s);
}

#[test]
#[ignore = "100,000 QPs: run in release (`cargo test --release -p mlx5-tests verbs_scale -- --ignored`)"]
fn many_qps_and_cqs_come_and_go_full_count() {
    let (nqp, ncq) = (100_000, 20_000);
    let s = create_and_destroy(nqp, ncq);
    report(nqp, ncq, &s);
}

#[test]
fn firmware_gets_more_than_64_mib_of_pages_and_gives_them_back() {
    let sim = SimDevice::new(SimConfig::default());
    let ctx = Context::open_sim_device(sim.clone()).unwrap();
    let before = sim.pages_owned();
    let mut cursor = sim.executed().len();
    let mut page_cmds = |sim: &SimDevice, op_mod: u16| {
        let cmds = sim.executed_since(&mut cursor);
        cmds.iter()
            .filter(|c| c.opcode == consts::MLX5_CMD_OP_MANAGE_PAGES && c.op_mod == op_mod && c.status == 0)
            .count()
    };
    // 20,000 pages (78 MiB) more than firmware holds: past the former pool of 256 chunks of 64 pages.
    sim.request_pages(20_000);
    // The request is answered while the next command waits, in gives of at most GIVE_BATCH pages.
    let pd = ctx.alloc_pd().unwrap();
    assert_eq!(sim.pages_owned(), before + 20_000);
    assert_eq!(page_cmds(&sim, consts::MLX5_PAGES_GIVE), 20_000usize.div_ceil(GIVE_BATCH));
    // Firmware returns some of them on its own; the pool takes them back, a reclaim batch at a time.
    sim.request_pages(-5_000);
    drop(pd);
    let _pd = ctx.alloc_pd().unwrap();
    assert_eq!(sim.pages_owned(), before + 15_000);
    assert_eq!(page_cmds(&sim, consts::MLX5_PAGES_TAKE), 5_000usize.div_ceil(RECLAIM_BATCH));
    drop(_pd);
    drop(ctx);
    assert_eq!(sim.pages_owned(), 0, "teardown reclaims every page");
    assert_eq!(sim.dma_outstanding(), (0, 0));
}

#[test]
fn a_fixed_cq_table_refuses_past_its_capacity_with_a_typed_error() {
    use mlx5_core::hca::{Config, CqAttr, Error, Fixed, Hca};
    let dev = SimDevice::default();
    let mut d = dev.delay();
    // The core's own choice for a small system: two CQs.
    let mut hca: Hca<_, _, (), Fixed<16, 2>> =
        Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let a = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let b = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    assert_eq!(hca.create_cq(CqAttr::default(), &mut d).unwrap_err(), Error::TooManyCqs { max: 2 });
    hca.destroy_cq(a, &mut d).unwrap();
    let c = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    hca.destroy_cq(b, &mut d).unwrap();
    hca.destroy_cq(c, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

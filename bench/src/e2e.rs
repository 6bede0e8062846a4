//! The core and the simulator together: loopback SEND throughput and bring-up time.

use std::hint::black_box;
use std::time::Instant;

use mlx5_core::cq::{WcStatus, WorkCompletion};
use mlx5_core::hca::{Config, Hca};
use mlx5_core::qp::{QpCap, RecvWr};
use mlx5_sim::{Mode, SimConfig, SimDevice};

use crate::env::{self, SimHca};
use crate::stats::{measure, since, Plan, Stat};

/// What one throughput run did.
#[derive(Debug, Clone, Copy)]
pub struct Throughput {
    /// SENDs per second (median over the windows, and the best window).
    pub median: f64,
    pub max: f64,
}

/// Loopback RC SENDs of `size` bytes through `Hca::post_send` → the simulated device → `Cq::poll`: each round
/// posts `batch` receives on one QP, then `batch` SENDs on the other in one `post_send` (one doorbell; the last
/// SEND signaled), then polls the `batch + 1` completions in calls of up to 64.
pub fn sim_sends(mode: Mode, batch: usize, size: u32, rounds: usize, plan: Plan) -> Throughput {
    let mut env = env::new(mode);
    let depth = (batch as u32).max(64);
    let cap = QpCap { max_send_wr: depth, max_recv_wr: depth, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (mut cq, mut a, mut b) = env::pair(&mut env, cap, 4 * depth - 1);
    let ssge = [env.sge(0, size)];
    let rsge = [env.sge(64 * 1024, size)];
    let wrs = crate::micro::sends(&ssge, batch, false);
    let recvs: Vec<RecvWr> = (0..batch).map(|i| RecvWr { wr_id: 1_000_000 + i as u64, sg_list: &rsge }).collect();
    let mut wc = vec![WorkCompletion::default(); 64];
    let mut bad = 0usize;
    let stat = measure(plan, || {
        let t = Instant::now();
        for _ in 0..rounds {
            env.hca.post_recv(&mut b, &recvs).expect("post_recv");
            env.hca.post_send(&mut a, &wrs).expect("post_send");
            let mut got = 0;
            // Bounded only by the device: in threaded mode its thread completes the work while we spin here.
            while got < batch + 1 {
                let k = cq.poll(env.hca.mmio(), &mut [&mut a, &mut b][..], &mut wc).expect("poll");
                bad += wc[..k].iter().filter(|w| w.status != WcStatus::Success).count();
                got += k;
            }
        }
        let ns = since(t);
        // ns per SEND; turned into a rate below.
        (ns, (rounds * batch) as u64)
    });
    assert_eq!(bad, 0, "every SEND and receive completed successfully");
    assert_eq!((a.sq_outstanding(), b.rq_outstanding()), (0, 0));
    env.drop_pair(cq, a, b);
    env.finish();
    Throughput { median: 1e9 / stat.median, max: 1e9 / stat.min }
}

/// `Hca::bring_up` on a fresh simulated device until the HCA is ready (the device's creation and the teardown
/// after are not timed). Milliseconds.
pub fn bringup(mode: Mode, plan: Plan) -> Stat {
    let ns = measure(plan, || {
        let dev = SimDevice::new(SimConfig { mode, ..SimConfig::default() });
        let mut d = dev.delay();
        let t = Instant::now();
        let hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).expect("bring-up");
        let ns = since(t);
        black_box(&hca);
        hca.teardown(&mut d).expect("teardown");
        assert_eq!(dev.dma_outstanding(), (0, 0));
        (ns, 1)
    });
    Stat { median: ns.median / 1e6, min: ns.min / 1e6 }
}

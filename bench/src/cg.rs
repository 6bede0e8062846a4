//! `mlx5-bench --cg OP CALLS`: `CALLS` calls of one datapath operation, each through an out-of-line `cg_*`
//! wrapper, untimed, for `valgrind --tool=callgrind --toggle-collect='*cg_<op>'` (`cargo xtask bench --peer`
//! counts the instructions of exactly these calls). The C harness (`xtask/peer/harness.c`) has the same wrappers
//! around rdma-core's calls, so both sides pay the same call into the wrapper.

use std::hint::black_box;

use mlx5_core::cq::{Cq, CqeError, WorkCompletion, WrTable};
use mlx5_core::qp::{PostError, Qp, QpCap, RecvWr, SendWr};
use mlx5_sim::testkit::mocks::MemMmio;
use mlx5_sim::Mode;

use crate::{env, micro, DEPTH};

/// One `post_send` call.
#[inline(never)]
fn cg_post_send(qp: &mut Qp, bar: &MemMmio, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
    qp.post_send(bar, wrs)
}

/// One `post_recv` call.
#[inline(never)]
fn cg_post_recv(qp: &mut Qp, bar: &MemMmio, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
    qp.post_recv(bar, wrs)
}

/// One `poll` call.
#[inline(never)]
fn cg_poll_cq(cq: &mut Cq, bar: &MemMmio, qp: &mut Qp, wc: &mut [WorkCompletion]) -> Result<usize, CqeError> {
    cq.poll(bar, qp, wc)
}

/// Runs `calls` calls of `op` (`post_send_1`, `post_send_16`, `post_send_64`, `post_recv` (16 per call) or
/// `poll_cq`: `calls` whole rings, 16 CQEs per call). Returns false for an unknown `op`.
pub fn run(op: &str, calls: usize) -> bool {
    let mut env = env::new(Mode::Inline);
    let cap = QpCap { max_send_wr: DEPTH, max_recv_wr: DEPTH, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (mut cq, mut a, b) = env::pair(&mut env, cap, DEPTH - 1);
    let bar = MemMmio::new(env.dev.mmio().bar_size());
    let sge = [env.sge(0, 64)];
    let qpn = a.qpn();
    let known = match op {
        "post_send_1" | "post_send_16" | "post_send_64" => {
            let batch: usize = op["post_send_".len()..].parse().unwrap_or(1);
            let wrs = micro::sends(&sge, batch, false);
            for _ in 0..calls {
                cg_post_send(&mut a, &bar, black_box(&wrs[..])).expect("post_send");
                let last = a.sq_cur_post().wrapping_sub(1) as u16;
                a.send_done(qpn, last).expect("retire");
            }
            true
        }
        "post_recv" => {
            let wrs: Vec<RecvWr> = (0..16).map(|i| RecvWr { wr_id: i, sg_list: &sge }).collect();
            for _ in 0..calls {
                cg_post_recv(&mut a, &bar, black_box(&wrs[..])).expect("post_recv");
                for _ in 0..wrs.len() {
                    a.recv_done(qpn, 0, 0).expect("retire");
                }
            }
            true
        }
        "poll_cq" => {
            let mut wc = vec![WorkCompletion::default(); 16];
            for _ in 0..calls {
                micro::ready_ring(&mut cq, &mut a, &bar, &sge);
                let mut got = 0;
                while got < cq.nent() as usize {
                    let k = cg_poll_cq(&mut cq, &bar, &mut a, black_box(&mut wc[..])).expect("poll");
                    if k == 0 {
                        break;
                    }
                    got += k;
                }
                assert_eq!(got, cq.nent() as usize, "every CQE polled");
            }
            true
        }
        _ => false,
    };
    env.drop_pair(cq, a, b);
    env.finish();
    known
}

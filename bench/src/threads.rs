//! Threads share nothing on the datapath: one QP and one CQ per thread, each thread posting sends and receives
//! and polling a full ring of completions against plain memory, all threads at once. The rate of 2 threads over
//! the rate of 1 shows whether the datapath touches anything shared (a lock, a counter, a cache line).
//!
//! The QPs and CQs are made on the simulator (the HCA stays on the main thread, as the control path does), then
//! moved to their threads. Every thread rings its QP's own BlueFlame register (`BfregPool`) in one shared
//! plain-memory BAR: the setup checks the registers are dedicated and distinct before any thread starts.

use std::sync::Barrier;
use std::time::Instant;

use mlx5_core::cq::{Cq, WorkCompletion};
use mlx5_core::qp::{Qp, QpCap, RecvWr, Sge};
use mlx5_sim::testkit::mocks::MemMmio;
use mlx5_sim::Mode;

use crate::{env, micro, DEPTH};

/// The BAR the threads share.
struct SharedBar<'a>(&'a MemMmio);

// SAFETY: the threads reach the BAR only through `Qp::post_send`, each at its QP's own BlueFlame register
// (`run` checks the registers are dedicated and do not overlap before starting them): no two threads write the
// same bytes, and nothing reads the BAR while they run. `MemMmio` accesses are raw-pointer volatile stores into
// its array, which stays allocated for the whole scope.
unsafe impl Sync for SharedBar<'_> {}

/// CPU time this thread has run, in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_ns() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the call writes only it.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "CLOCK_THREAD_CPUTIME_ID");
    ts.tv_sec as f64 * 1e9 + ts.tv_nsec as f64
}

/// One thread's work: `windows` times, post a ring's worth of receives and signaled sends (in calls of 64), write
/// the ring's CQEs as the device would (half send, half receive completions), poll them all in calls of 16.
/// Returns (completions, wall-clock nanoseconds, the thread's CPU nanoseconds).
fn worker(cq: &mut Cq, qp: &mut Qp, bar: &MemMmio, sge: &[Sge], windows: usize, start: &Barrier) -> (u64, f64, f64) {
    let half = cq.nent() as usize / 2;
    let sends = micro::sends(sge, 64, true);
    let recvs: Vec<RecvWr> = (0..half).map(|i| RecvWr { wr_id: i as u64, sg_list: sge }).collect();
    let mut wc = vec![WorkCompletion::default(); 16];
    start.wait();
    let t = Instant::now();
    let cpu = thread_cpu_ns();
    let mut done = 0u64;
    for _ in 0..windows {
        micro::ready_ring_with(cq, qp, bar, &sends, &recvs);
        let mut got = 0;
        while got < cq.nent() as usize {
            let k = cq.poll(bar, &mut *qp, &mut wc).expect("poll");
            assert!(k > 0, "every CQE of the ring is ready");
            got += k;
        }
        done += got as u64;
    }
    (done, t.elapsed().as_nanos() as f64, thread_cpu_ns() - cpu)
}

/// Completions per second of `threads` threads together, the median of `reps` runs of `windows` windows each:
/// by the wall clock (total completions over the slowest thread's time), and by CPU time (each thread's
/// completions over the CPU time it ran, summed: what the threads would do if each had a CPU to itself, which a
/// shared datapath cache line or lock would still lower, but time spent descheduled on a busy machine would not).
pub fn run(threads: usize, windows: usize, reps: usize) -> (f64, f64) {
    let mut env = env::new(Mode::Inline);
    let cap = QpCap { max_send_wr: DEPTH, max_recv_wr: DEPTH, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let mut sets: Vec<(Cq, Qp, Qp)> = (0..threads).map(|_| env::pair(&mut env, cap, DEPTH - 1)).collect();
    let bar = MemMmio::new(env.dev.mmio().bar_size());
    let regs: Vec<_> = sets.iter().map(|(_, a, _)| *a.bfreg()).collect();
    for (i, r) in regs.iter().enumerate() {
        assert!(!r.is_shared(), "a dedicated register per QP");
        for s in &regs[i + 1..] {
            let (lo, hi) = if r.offset < s.offset { (r, s) } else { (s, r) };
            assert!(lo.offset + 2 * lo.buf_size <= hi.offset, "registers overlap");
        }
        assert!(r.offset + 2 * r.buf_size <= bar.len(), "register inside the BAR");
    }
    let sge = [env.sge(0, 64)];
    let shared = SharedBar(&bar);
    let mut rates = Vec::with_capacity(reps);
    let mut cpu_rates = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Barrier::new(threads);
        let results: Vec<(u64, f64, f64)> = std::thread::scope(|s| {
            let handles: Vec<_> = sets
                .iter_mut()
                .map(|(cq, a, _)| {
                    let (shared, start, sge) = (&shared, &start, &sge);
                    s.spawn(move || worker(cq, a, shared.0, sge, windows, start))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("worker")).collect()
        });
        let total: u64 = results.iter().map(|r| r.0).sum();
        let slowest = results.iter().map(|r| r.1).fold(0.0, f64::max);
        rates.push(total as f64 * 1e9 / slowest);
        cpu_rates.push(results.iter().map(|r| r.0 as f64 * 1e9 / r.2.max(1.0)).sum::<f64>());
    }
    rates.sort_by(f64::total_cmp);
    cpu_rates.sort_by(f64::total_cmp);
    for (cq, a, b) in sets {
        env.drop_pair(cq, a, b);
    }
    env.finish();
    (rates[rates.len() / 2], cpu_rates[cpu_rates.len() / 2])
}

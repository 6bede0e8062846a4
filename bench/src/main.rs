//! `mlx5-bench`: the datapath near the physical limit, measured side by side.
//!
//! Run in release (`cargo xtask bench` does, and writes `BENCHMARKS.md`): `mlx5-bench [--json] [--quick]`.
//!
//! * `post_send`: ns per one-SGE SEND WQE in calls of 1, 16 and 64 WRs (one doorbell per call; a single WQE goes
//!   by BlueFlame), WQEs into DMA memory, doorbell record, BlueFlame register in a plain-memory BAR
//!   ([`mlx5_sim::testkit::mocks::MemMmio`], default barriers). Baseline: one 64-byte store per WQE into a ring of the same
//!   size plus one 4-byte store per batch.
//! * `post_recv`: ns per one-SGE receive WQE (calls of 16). Baseline: a 16-byte store per WQE, 4 bytes per batch.
//! * `poll_cq`: ns per CQE of a CQ full of ready CQEs (half send, half receive completions, 16 per call).
//!   Baseline: 64-byte volatile loads over the same ring.
//! * `encode_create_cq`: ns to post CREATE_CQ with 1,024 page addresses (entry and mailbox chain, in place).
//! * `sim_sends_per_s`: loopback RC SENDs per second through the core and the simulator, in-line and threaded.
//! * `bringup_ms`: `Hca::bring_up` on the simulator until ready.
//! * `datapath_allocs`: heap allocations seen during every timed datapath call above (a counting allocator).
//! * `threads_2_speedup` (`--only threads`, not in the default run): completions per second with one QP and CQ per
//!   thread, 2 threads over 1.
//!
//! `mlx5-bench --scale N [--json]` runs only the scale test (`scale.rs`): N RC QPs, each with its own CQ and MR.
//!
//! `mlx5-bench --cg OP CALLS` runs one datapath operation untimed for callgrind (`cargo xtask bench --peer`).

mod cg;
mod e2e;
mod env;
mod micro;
mod scale;
mod stats;
mod threads;

use std::io::Write;

use mlx5_core::qp::QpCap;
use mlx5_sim::testkit::mocks::MemMmio;
use mlx5_sim::Mode;
use serde_json::{json, Map, Value};

use stats::{round, Plan, Stat};

use mlx5_sim::testkit::alloc_count;

#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

/// WQEs (and CQEs) per timed window: the ring depth, so a window fills the ring once.
pub(crate) const DEPTH: u32 = 1024;
const SEND_BATCHES: [usize; 3] = [1, 16, 64];
/// The batch the headline figures use.
const HEADLINE_BATCH: usize = 16;
const RECV_BATCH: usize = 16;
const POLL_BATCH: usize = 16;
const SIM_BATCH: usize = 64;
const SIM_MSG: u32 = 64;

fn ratio(core: &Stat, base: &Stat) -> f64 {
    core.median / base.median
}

fn progress(what: &str) {
    eprintln!("mlx5-bench: {what}");
}

/// The sections, in the order they run; `--only NAME` runs one (for profiling).
const SECTIONS: [&str; 6] = ["datapath", "encode", "sim", "sim-threaded", "bringup", "threads"];

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut as_json = false;
    let mut quick = false;
    let mut only: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => as_json = true,
            "--quick" => quick = true,
            "--only" => only = it.next().cloned(),
            "--scale" => {
                let n = it.next().and_then(|n| n.parse::<usize>().ok()).filter(|&n| n > 0);
                let Some(n) = n else {
                    eprintln!("mlx5-bench: --scale N (N: QPs, at least 1)");
                    std::process::exit(2);
                };
                run_scale(n, args.iter().any(|a| a == "--json"));
                return;
            }
            "--cg" => {
                let op = it.next().cloned().unwrap_or_default();
                let calls = it.next().and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
                if calls == 0 || !cg::run(&op, calls) {
                    eprintln!(
                        "mlx5-bench: --cg OP CALLS (OP: post_send_1, post_send_16, post_send_64, post_recv, poll_cq)"
                    );
                    std::process::exit(2);
                }
                return;
            }
            _ => {
                eprintln!("mlx5-bench: unknown argument {a}\nusage: mlx5-bench [--json] [--quick] [--only SECTION]");
                std::process::exit(2);
            }
        }
    }
    if let Some(o) = only.as_deref().filter(|o| !SECTIONS.contains(o)) {
        eprintln!("mlx5-bench: no section {o}; sections: {}", SECTIONS.join(", "));
        std::process::exit(2);
    }
    let run = |s: &str| only.as_deref().is_none_or(|o| o == s);
    let scale = |n: usize| if quick { (n / 10).max(3) } else { n };
    let micro = Plan { warmup: scale(20), reps: scale(301) };
    let cmd = Plan { warmup: scale(50), reps: scale(501) };
    let mut out = Map::new();
    let mut lines = vec![format!("mlx5-bench: medians of the timed windows; ratio = core / baseline, same run")];

    if run("datapath") {
        datapath(micro, &mut out, &mut lines);
    }
    if run("encode") {
        progress("command encoding");
        let (post, flat) = micro::encode_create_cq(cmd);
        out.insert("encode_create_cq_ns".into(), json!(round(post.median)));
        out.insert("encode_create_cq_flat_ns".into(), json!(round(flat.median)));
        lines.push(format!(
            "CREATE_CQ, 1,024 pages: {:.0} ns posted (entry + mailbox chain), {:.0} ns encoded flat",
            post.median, flat.median
        ));
    }
    if run("sim") {
        progress("simulator, in-line");
        let t = e2e::sim_sends(Mode::Inline, SIM_BATCH, SIM_MSG, 200, Plan { warmup: 1, reps: scale(9) });
        out.insert("sim_sends_per_s".into(), json!(t.median.round()));
        out.insert("sim_sends_per_s_best".into(), json!(t.max.round()));
        lines.push(format!("simulator loopback SENDs, in-line: {:.2} M/s", t.median / 1e6));
    }
    if run("sim-threaded") {
        progress("simulator, threaded");
        let t = e2e::sim_sends(Mode::Threaded, SIM_BATCH, SIM_MSG, 50, Plan { warmup: 1, reps: scale(7) });
        out.insert("sim_sends_per_s_threaded".into(), json!(t.median.round()));
        lines.push(format!("simulator loopback SENDs, threaded: {:.2} M/s", t.median / 1e6));
    }
    if run("bringup") {
        progress("bring-up");
        let inline = e2e::bringup(Mode::Inline, Plan { warmup: 2, reps: scale(11) });
        let threaded = e2e::bringup(Mode::Threaded, Plan { warmup: 1, reps: scale(5) });
        out.insert("bringup_ms".into(), json!(round(inline.median)));
        out.insert("bringup_threaded_ms".into(), json!(round(threaded.median)));
        lines.push(format!(
            "bring-up on the simulator: {:.3} ms in-line, {:.3} ms threaded",
            inline.median, threaded.median
        ));
    }
    if only.as_deref() == Some("threads") {
        progress("datapath threads (one QP and CQ each)");
        let windows = scale(200);
        let reps = scale(9).max(3);
        let (one, one_cpu) = threads::run(1, windows, reps);
        let (two, two_cpu) = threads::run(2, windows, reps);
        out.insert("threads_1_completions_per_s".into(), json!(one.round()));
        out.insert("threads_2_completions_per_s".into(), json!(two.round()));
        out.insert("threads_2_speedup".into(), json!(round(two / one)));
        out.insert("threads_2_speedup_cpu".into(), json!(round(two_cpu / one_cpu)));
        lines.push(format!(
            "datapath, one QP and CQ per thread: 1 thread {:.1} M completions/s, 2 threads {:.1} M/s ({:.2}x; \
             by CPU time {:.2}x)",
            one / 1e6,
            two / 1e6,
            two / one,
            two_cpu / one_cpu
        ));
    }
    out.insert(
        "params".into(),
        json!({
            "window_wqes": DEPTH,
            "headline_send_batch": HEADLINE_BATCH,
            "recv_batch": RECV_BATCH,
            "poll_batch": POLL_BATCH,
            "cq_entries": DEPTH,
            "sim_batch": SIM_BATCH,
            "sim_msg_bytes": SIM_MSG,
            "datapath_windows": micro.reps,
            "statistic": "median of the timed windows",
        }),
    );
    let mut stdout = std::io::stdout().lock();
    if as_json {
        let _ = writeln!(stdout, "{}", Value::Object(out));
    } else {
        let _ = writeln!(stdout, "{}", lines.join("\n"));
    }
}

/// `--scale N`: the scale run alone (its peak resident set is its own); exits 1 on any failure.
fn run_scale(n: usize, as_json: bool) {
    progress(&format!("scale: {n} RC QPs, each with its own CQ and MR"));
    let out = match scale::run(n) {
        Ok(o) => o,
        Err(e) => {
            let mut msg = format!("mlx5-bench: scale: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            std::process::exit(1);
        }
    };
    let mut stdout = std::io::stdout().lock();
    if as_json {
        let _ = writeln!(stdout, "{}", Value::Object(out));
    } else {
        for (k, v) in &out {
            let _ = writeln!(stdout, "{k:<16} {v}");
        }
    }
}

/// post_send, post_recv and poll_cq: QPs and a CQ made on the simulator, then driven against plain memory only.
fn datapath(micro: Plan, out: &mut Map<String, Value>, lines: &mut Vec<String>) {
    progress("datapath against plain memory");
    let mut env = env::new(Mode::Inline);
    let cap = QpCap { max_send_wr: DEPTH, max_recv_wr: DEPTH, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (mut cq, mut a, b) = env::pair(&mut env, cap, DEPTH - 1);
    let bar = MemMmio::new(env.dev.mmio().bar_size());
    let sge = [env.sge(0, 64)];
    let window = (a.cap().max_send_wr.min(a.cap().max_recv_wr).min(DEPTH) as usize) / 64 * 64;
    assert!(window >= 64, "the QP holds a window of WQEs");
    let allocs_before = alloc_count::count();
    let mut send = Map::new();
    for batch in SEND_BATCHES {
        let core = micro::post_send(&mut a, &bar, &sge, batch, window, micro);
        let base = micro::post_send_baseline(batch, window, micro);
        send.insert(
            batch.to_string(),
            json!({
                "ns": round(core.median),
                "min_ns": round(core.min),
                "baseline_ns": round(base.median),
                "ratio": round(ratio(&core, &base)),
            }),
        );
        lines.push(format!(
            "post_send  batch {batch:>2}   {:>8.2} ns/WQE   baseline {:>6.2} ns   ratio {:>5.2}",
            core.median,
            base.median,
            ratio(&core, &base)
        ));
        if batch == HEADLINE_BATCH {
            out.insert("post_send_ns".into(), json!(round(core.median)));
            out.insert("post_send_baseline_ns".into(), json!(round(base.median)));
            out.insert("post_send_ratio".into(), json!(round(ratio(&core, &base))));
        }
    }
    out.insert("post_send_batches".into(), Value::Object(send));
    let core = micro::post_recv(&mut a, &bar, &sge, RECV_BATCH, window, micro);
    let base = micro::post_recv_baseline(RECV_BATCH, window, micro);
    out.insert("post_recv_ns".into(), json!(round(core.median)));
    out.insert("post_recv_baseline_ns".into(), json!(round(base.median)));
    out.insert("post_recv_ratio".into(), json!(round(ratio(&core, &base))));
    lines.push(format!(
        "post_recv  batch {RECV_BATCH:>2}   {:>8.2} ns/WQE   baseline {:>6.2} ns   ratio {:>5.2}",
        core.median,
        base.median,
        ratio(&core, &base)
    ));
    assert!(cq.nent() as usize / 2 <= window, "the QP can hold the completions of a full CQ");
    let (core, base) = micro::poll_cq(&mut cq, &mut a, &bar, &sge, POLL_BATCH, micro);
    out.insert("poll_cq_ns".into(), json!(round(core.median)));
    out.insert("poll_cq_baseline_ns".into(), json!(round(base.median)));
    out.insert("poll_cq_ratio".into(), json!(round(ratio(&core, &base))));
    lines.push(format!(
        "poll_cq    batch {POLL_BATCH:>2}   {:>8.2} ns/CQE   baseline {:>6.2} ns   ratio {:>5.2}",
        core.median,
        base.median,
        ratio(&core, &base)
    ));
    let allocs = alloc_count::count() - allocs_before;
    out.insert("datapath_allocs".into(), json!(allocs));
    lines.push(format!("heap allocations in the timed datapath calls (post_send, post_recv, poll_cq, arm): {allocs}"));
    env.drop_pair(cq, a, b);
    env.finish();
}

//! Timing: warm-up windows, then repeated windows, each timed as a whole with `Instant`; a window's cost is
//! divided by the operations it ran. The median is the figure reported, the minimum is kept beside it.

use std::time::Instant;

/// Nanoseconds per operation over the repetitions.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
}

/// Rounds to 3 significant decimals for output.
pub fn round(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// How many windows to run.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub warmup: usize,
    pub reps: usize,
}

/// Runs `window` `plan.warmup` times untimed, then `plan.reps` times. `window` returns the nanoseconds it measured
/// itself (so its setup and teardown stay outside) and the operations done in them.
pub fn measure(plan: Plan, mut window: impl FnMut() -> (f64, u64)) -> Stat {
    for _ in 0..plan.warmup {
        window();
    }
    let mut per_op: Vec<f64> = (0..plan.reps.max(1))
        .map(|_| {
            let (ns, ops) = window();
            ns / ops.max(1) as f64
        })
        .collect();
    per_op.sort_by(f64::total_cmp);
    Stat { median: per_op[per_op.len() / 2], min: per_op[0] }
}

/// Nanoseconds since `t`.
pub fn since(t: Instant) -> f64 {
    t.elapsed().as_nanos() as f64
}

//! `soak --ops N --seed S [--json] [--progress N]`: the fault-injection soak (see the `mlx5_soak` library). Prints
//! the report (one JSON object with `--json`) and exits non-zero when an invariant failed.

use std::process::ExitCode;

use mlx5_soak::{run, Options};

/// `1000000`, `1_000_000`, `1e6` and `10^6` all read as one million.
fn parse_count(s: &str) -> Option<u64> {
    let s = s.replace('_', "");
    if let Some((m, e)) = s.split_once(['e', 'E']) {
        return m.parse::<u64>().ok()?.checked_mul(10u64.checked_pow(e.parse().ok()?)?);
    }
    if let Some((b, e)) = s.split_once('^') {
        return b.parse::<u64>().ok()?.checked_pow(e.parse().ok()?);
    }
    s.parse().ok()
}

fn main() -> ExitCode {
    let mut opts = Options { ops: 100_000, seed: 1, progress_every: 0 };
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |what: &str| args.next().and_then(|v| parse_count(&v)).ok_or(format!("{a} needs {what}"));
        let r = match a.as_str() {
            "--ops" => value("a count").map(|v| opts.ops = v),
            "--seed" => value("a number").map(|v| opts.seed = v),
            "--progress" => value("a count").map(|v| opts.progress_every = v),
            "--json" => {
                json = true;
                Ok(())
            }
            _ => Err(format!("unknown argument {a}")),
        };
        if let Err(e) = r {
            eprintln!("soak: {e}\nusage: soak --ops N --seed S [--json] [--progress N]");
            return ExitCode::from(2);
        }
    }
    let rep = run(opts);
    if json {
        println!("{}", rep.to_json());
    } else {
        print!("{}", rep.render());
    }
    if rep.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

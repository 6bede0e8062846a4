//! `soak [--ops N] [--seed S] [--json] [--progress N] [--threaded] [--wire [--kills K] [--loss PCT]]`: the fault-injection soak
//! (see the `mlx5_soak` library; `--threaded`: on threaded simulated devices), or with `--wire` the two-process
//! wire soak (`mlx5_soak::wire`). Prints the report (one
//! JSON object with `--json`) and exits 1 when an invariant failed, 2 on a usage error. `--wire-peer ADDR` is
//! the peer process the wire soak starts (this binary again).

use std::process::ExitCode;

use mlx5_args::{ArgError, Argv};
use mlx5_soak::wire::{peer_main, run_wire, WireOptions};
use mlx5_soak::{run, Options};

const USAGE: &str =
    "usage: soak [--ops N] [--seed S] [--json] [--progress N] [--threaded] [--wire [--kills K] [--loss PCT]]

  --ops N        work requests to post in total (default 100000; 1e6, 10^6 and 1_000_000 read as a million)
  --seed S       the seed everything derives from (default 1)
  --json         the report as one JSON object
  --progress N   a progress line on standard error every N work requests (in-process soak)
  --threaded     the in-process soak on threaded simulated devices (worker threads, real time)
  --wire         the two-process wire soak: RC traffic to a peer process that is killed and restarted
  --kills K      peers killed during a --wire run (default 4)
  --loss PCT     --wire over a VDE fabric with wirefilter between the two processes losing PCT % of the frames,
                 duplicating 2 % and reordering them
                 (1..50; needs Debian's vde2), the retransmissions in the report";

/// `1000000`, `1_000_000`, `1e6` and `10^6` all read as one million; anything else (signs, blanks, overflow) is
/// refused.
fn parse_count(option: &str, text: &str) -> Result<u64, ArgError> {
    let bad = || ArgError::Invalid { option: option.into(), why: format!("{text:?} is not a count") };
    let s = text.replace('_', "");
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let n = if let Some((m, e)) = s.split_once(['e', 'E']) {
        if !digits(m) || !digits(e) {
            return Err(bad());
        }
        let e: u32 = e.parse().map_err(|_| bad())?;
        m.parse::<u64>().ok().and_then(|m| m.checked_mul(10u64.checked_pow(e)?))
    } else if let Some((b, e)) = s.split_once('^') {
        if !digits(b) || !digits(e) {
            return Err(bad());
        }
        let e: u32 = e.parse().map_err(|_| bad())?;
        b.parse::<u64>().ok().and_then(|b| b.checked_pow(e))
    } else if digits(&s) {
        s.parse().ok()
    } else {
        return Err(bad());
    };
    n.ok_or_else(|| ArgError::Invalid { option: option.into(), why: format!("{text:?} is too large") })
}

enum Role {
    Soak { opts: Options, json: bool },
    Wire { opts: WireOptions, json: bool },
    Peer { addr: String, seed: u64 },
}

fn parse(mut argv: Argv) -> Result<Role, ArgError> {
    let mut opts = Options { ops: 100_000, seed: 1, progress_every: 0, threaded: false };
    let (mut json, mut wire, mut kills, mut peer, mut loss) = (false, false, None, None, None);
    while let Some(a) = argv.next() {
        let a = a?;
        match a.as_str() {
            h if mlx5_args::is_help(h) => return Err(ArgError::Help),
            "--ops" => opts.ops = parse_count("--ops", &argv.value("--ops", "a count")?)?,
            "--seed" => opts.seed = parse_count("--seed", &argv.value("--seed", "a number")?)?,
            "--progress" => opts.progress_every = parse_count("--progress", &argv.value("--progress", "a count")?)?,
            "--json" => json = true,
            "--wire" => wire = true,
            "--threaded" => opts.threaded = true,
            "--kills" => kills = Some(argv.number("--kills", 0u32, 10_000)?),
            "--loss" => loss = Some(argv.number("--loss", 1u32, 50)?),
            "--wire-peer" => peer = Some(argv.value("--wire-peer", "the wire's address")?),
            o if o.starts_with('-') => return Err(ArgError::Unknown(o.into())),
            o => return Err(ArgError::Other(format!("unexpected argument {o:?}"))),
        }
    }
    if let Some(addr) = peer {
        return Ok(Role::Peer { addr, seed: opts.seed });
    }
    if opts.ops == 0 {
        return Err(ArgError::Invalid { option: "--ops".into(), why: "a run posts at least one work request".into() });
    }
    if !wire {
        if kills.is_some() || loss.is_some() {
            let option = if loss.is_some() { "--loss" } else { "--kills" };
            return Err(ArgError::NotApplicable { option: option.into(), command: "the in-process soak".into() });
        }
        return Ok(Role::Soak { opts, json });
    }
    if opts.progress_every != 0 || opts.threaded {
        let option = if opts.threaded { "--threaded" } else { "--progress" };
        // The wire soak's devices are always threaded (their link runs in real time).
        return Err(ArgError::NotApplicable { option: option.into(), command: "--wire".into() });
    }
    Ok(Role::Wire { opts: WireOptions { ops: opts.ops, seed: opts.seed, kills: kills.unwrap_or(4), loss }, json })
}

fn main() -> ExitCode {
    let role = match parse(Argv::from_env()) {
        Ok(r) => r,
        Err(e) => return mlx5_args::usage_exit("soak", &e, USAGE),
    };
    let (ok, text) = match role {
        Role::Peer { addr, seed } => return peer_main(&addr, seed),
        Role::Soak { opts, json } => {
            let rep = run(opts);
            (rep.ok(), if json { format!("{}\n", rep.to_json()) } else { rep.render() })
        }
        Role::Wire { opts, json } => {
            let exe = match std::env::current_exe() {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("soak: cannot find this program to start the peer: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let rep = run_wire(&opts, &exe);
            (rep.ok(), if json { format!("{}\n", rep.to_json()) } else { rep.render() })
        }
    };
    print!("{text}");
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_read_strictly() {
        for (t, n) in [("1000000", 1_000_000), ("1_000_000", 1_000_000), ("1e6", 1_000_000), ("10^7", 10_000_000)] {
            assert_eq!(parse_count("--ops", t).ok(), Some(n), "{t}");
        }
        for bad in ["", "-1", "+1", "1e", "e6", "1e-3", "2^", " 1", "1.5", "10^99", "1e30"] {
            assert!(parse_count("--ops", bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn options_that_do_not_apply_are_refused() {
        let p = |a: &[&str]| parse(Argv::new(a.iter().copied()));
        assert!(matches!(p(&["--kills", "2"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["--wire", "--progress", "5"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["--wire", "--threaded"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["--threaded"]), Ok(Role::Soak { opts: Options { threaded: true, .. }, .. })));
        assert!(matches!(p(&["--ops", "0"]), Err(ArgError::Invalid { .. })));
        assert!(matches!(p(&["--frob"]), Err(ArgError::Unknown(_))));
        assert!(matches!(p(&["--wire", "--kills", "3"]), Ok(Role::Wire { opts: WireOptions { kills: 3, .. }, .. })));
        assert!(matches!(
            p(&["--wire", "--loss", "3"]),
            Ok(Role::Wire { opts: WireOptions { loss: Some(3), .. }, .. })
        ));
        assert!(matches!(p(&["--loss", "3"]), Err(ArgError::NotApplicable { .. })));
        assert!(p(&["--wire", "--loss", "0"]).is_err() && p(&["--wire", "--loss", "51"]).is_err());
    }
}

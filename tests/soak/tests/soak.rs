//! A short fault-injection soak on every `cargo test` (the long ones are `cargo xtask soak`; SOAK.md): every
//! invariant holds, every posted work request is accounted for by exactly one completion, the run repeats exactly
//! from its seed, and the terminal faults (health, device gone) ran with work outstanding.

use mlx5_soak::{run, Options};

#[test]
fn a_short_soak_holds_every_invariant_and_accounts_for_every_work_request() {
    let rep = run(Options { ops: 30_000, seed: 0x5eed, progress_every: 0, threaded: false });
    assert!(rep.ok(), "{}", rep.render());
    assert!(rep.ops >= 30_000);
    assert_eq!(rep.sends + rep.recvs, rep.ops);
    let completed: u64 = rep.completions.values().sum();
    assert_eq!(completed, rep.ops, "one completion per work request: {:?}", rep.completions);
    let posted: u64 = rep.opcodes.values().sum();
    assert_eq!(posted, rep.ops);
    // Faults were injected and explain every error status seen.
    assert!(rep.faults.values().sum::<u64>() > 0, "{:?}", rep.faults);
    let errors: u64 = rep.completions.iter().filter(|(k, _)| *k != "success").map(|(_, v)| v).sum();
    assert!(errors > 0 && rep.recoveries > 0, "faults produced error completions and recoveries");
    // The JSON form carries the keys `cargo xtask soak --json` promises.
    let j = rep.to_json();
    for k in
        ["ops", "faults", "completions", "lost", "duplicated", "data_mismatches", "leaked_dma_bytes", "leaked_fw_pages"]
    {
        assert!(j.get(k).is_some(), "missing {k}");
    }
}

#[test]
fn a_soak_repeats_exactly_from_its_seed() {
    let a = run(Options { ops: 5_000, seed: 77, progress_every: 0, threaded: false });
    let b = run(Options { ops: 5_000, seed: 77, progress_every: 0, threaded: false });
    assert!(a.ok() && b.ok(), "{}\n{}", a.render(), b.render());
    assert_eq!((a.ops, &a.opcodes, &a.faults, &a.completions), (b.ops, &b.opcodes, &b.faults, &b.completions));
    let c = run(Options { ops: 5_000, seed: 78, progress_every: 0, threaded: false });
    assert_ne!(a.opcodes, c.opcodes, "another seed, another run");
}

#[test]
fn the_terminal_faults_drain_with_flushes_made_by_the_driver() {
    // Enough epochs that some end with the device dying under traffic.
    let rep = run(Options { ops: 60_000, seed: 3, progress_every: 0, threaded: false });
    assert!(rep.ok(), "{}", rep.render());
    let terminal: u64 = rep
        .faults
        .iter()
        .filter(|(k, _)| k.starts_with("health_") || k.starts_with("device_gone"))
        .map(|(_, v)| v)
        .sum();
    assert!(terminal > 0, "{:?}", rep.faults);
    assert!(rep.software_flushes > 0, "the dead devices' work was completed by the driver");
}

/// The wider soak, small: threaded devices (RC and UD, SOAK.md) hold every invariant.
#[test]
fn a_short_threaded_soak_holds_every_invariant() {
    let rep = run(Options { ops: 3_000, seed: 11, progress_every: 0, threaded: true });
    assert!(rep.ok(), "{}", rep.render());
    let completed: u64 = rep.completions.values().sum();
    assert_eq!(completed, rep.ops, "one completion per work request: {:?}", rep.completions);
    // UD runs threaded too, now that the in-process link keeps each device's datagrams in order.
    for k in ["ud_send", "ud_recv"] {
        assert!(rep.opcodes.get(k).copied().unwrap_or(0) > 0, "no {k} ran threaded: {:?}", rep.opcodes);
    }
}

/// Two processes: the peer (this package's `soak` binary) is killed twice with work outstanding; each kill ends
/// in exactly one request out of retries and the rest flushed, within the retry budget, nothing lost or leaked.
#[test]
fn a_killed_peer_gives_retry_exceeded_and_flushes_within_the_budget() {
    use mlx5_soak::wire::{run_wire, WireOptions};
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_soak"));
    let rep = run_wire(&WireOptions { ops: 3_000, seed: 7, kills: 2, loss: None }, exe);
    assert!(rep.ok(), "{}", rep.render());
    assert_eq!((rep.sessions, rep.kills), (3, 2));
    assert_eq!(rep.completions.get("retry_exc_err"), Some(&2), "{:?}", rep.completions);
    let completed: u64 = rep.completions.values().sum();
    assert_eq!(completed, rep.ops, "one completion per work request: {:?}", rep.completions);
    assert!(rep.max_drain_ms > 0 && rep.budget_ms == 536);
}

/// `--loss`: the two processes on a VDE fabric with wirefilter losing 3 % of the frames between them, duplicating
/// and reordering some (Debian's vde2 must be installed: `cargo xtask ci` installs it). The same invariants hold,
/// and the loss was recovered from by retransmission.
#[test]
fn a_lossy_vde_fabric_keeps_every_invariant_and_counts_the_recoveries() {
    use mlx5_soak::wire::{run_wire, WireOptions};
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_soak"));
    let rep = run_wire(&WireOptions { ops: 2_000, seed: 3, kills: 1, loss: Some(3) }, exe);
    assert!(rep.ok(), "{}", rep.render());
    assert_eq!(rep.completions.get("retry_exc_err"), Some(&1), "{:?}", rep.completions);
    let completed: u64 = rep.completions.values().sum();
    assert_eq!(completed, rep.ops, "one completion per work request: {:?}", rep.completions);
    assert!(rep.retries + rep.sequence_naks > 0, "{}", rep.render());
}

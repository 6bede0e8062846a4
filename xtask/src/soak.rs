//! `cargo xtask soak [--ops N] [--seed S] [--json] [--progress N] [--threaded] [--wire [--kills K]]`: the
//! fault-injection soak (the `soak` binary of
//! `mlx5-soak`, `tests/soak/`), in release. Its exit status is the verdict: non-zero when an invariant
//! failed. See SOAK.md.

use std::path::Path;
use std::process::Command;

/// The CI run: a million work requests on one seed (about 3 s in release on a 2-CPU machine; SOAK.md).
pub const CI_ARGS: &[&str] = &["--ops", "1000000", "--seed", "1"];

/// The CI runs of the wider soak (SOAK.md): threaded devices in real time (about 20 s), and the two-process wire
/// with three peers killed (about 3 s).
pub const CI_WIDER_ARGS: &[&[&str]] =
    &[&["--threaded", "--ops", "20000", "--seed", "1"], &["--wire", "--ops", "20000", "--kills", "3", "--seed", "1"]];

pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = vec!["run", "--release", "-q", "-p", "mlx5-soak", "--bin", "soak", "--"];
    cmd.extend(args.iter().map(String::as_str));
    // On standard error, so that `--json` leaves one JSON object alone on standard output.
    eprintln!("$ cargo {}", cmd.join(" "));
    let status = Command::new(cargo)
        .args(&cmd)
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo {}: {e}", cmd.join(" ")))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("soak failed ({status}): an invariant did not hold, or the soak could not run"))
    }
}

//! `cargo xtask`: the project's automation (the cargo xtask pattern).
//!
//! * `vendor`: copy PRM facts from `../shared/prm` into the repository.
//! * `codegen [--check]`: generate `core/src/prm/generated.rs` from the vendored facts, or check it is current.
//! * `ci`: everything CI runs: format, lints, codegen freshness, tests, the `no_std` firmware build, the VFIO
//!   test in a QEMU guest.
//! * `vfio-test`: the host crate's VFIO layer against the real Linux VFIO stack, in a QEMU guest with QEMU's
//!   `edu` device behind an emulated IOMMU.
//! * `bench [--json]`: the datapath, encoding and simulator benchmarks and the core's size; writes `BENCHMARKS.md`.
//! * `fuzz [--seconds N] [--target NAME]`: the cargo-fuzz targets in `fuzz/`, N seconds each (default 30), then
//!   their corpus replayed; see FUZZING.md.
//! * `modcheck [--graph]`: no import cycle between sibling modules of `mlx5-core` and `mlx5-sim`.
//! * `soak [--ops N] [--seed S] [--json]`: random traffic between two simulated devices under injected faults,
//!   with its invariants checked; see SOAK.md.

mod bench;
mod codegen;
mod fuzz;
mod modcheck;
mod soak;
mod vfio_test;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The embedded target `mlx5-core` must build for, without alloc.
const EMBEDDED_TARGET: &str = "thumbv7em-none-eabihf";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}

fn cargo(root: &Path, args: &[&str]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("$ cargo {}", args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo {}: {e}", args.join(" ")))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed ({status})", args.join(" ")))
    }
}

/// Installs what CI needs from rustup (the embedded target, rustfmt, clippy) when it is missing.
fn ensure_toolchain() -> Result<(), String> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .map_err(|e| format!("failed to run rustup: {e}"))?;
    if !String::from_utf8_lossy(&installed.stdout).lines().any(|l| l.trim() == EMBEDDED_TARGET) {
        println!("$ rustup target add {EMBEDDED_TARGET}");
        let ok = Command::new("rustup").args(["target", "add", EMBEDDED_TARGET]).status().map_err(|e| e.to_string())?;
        if !ok.success() {
            return Err(format!("rustup could not add {EMBEDDED_TARGET}"));
        }
    }
    let ok =
        Command::new("rustup").args(["component", "add", "rustfmt", "clippy"]).status().map_err(|e| e.to_string())?;
    if !ok.success() {
        return Err("rustup could not add rustfmt and clippy".into());
    }
    Ok(())
}

fn ci(root: &Path) -> Result<(), String> {
    ensure_toolchain()?;
    cargo(root, &["fmt", "--all", "--check"])?;
    codegen::run_codegen(root, true)?;
    modcheck::run(root, false)?;
    cargo(root, &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(root, &["test", "--workspace"])?;
    // Rustdoc of the libraries a user reads, with every intra-doc link resolved.
    let deny = r#"build.rustdocflags=["-D", "warnings"]"#;
    let mut doc = vec!["doc", "--no-deps", "--config", deny];
    for lib in ["mlx5-core", "mlx5-sim", "mlx5-vfio", "mlx5-verbs", "mlx5-tool"] {
        doc.extend(["-p", lib]);
    }
    cargo(root, &doc)?;
    // The verbs API without the simulator (VFIO only), as a program that drives only real devices builds it.
    cargo(root, &["clippy", "-p", "mlx5-verbs", "--no-default-features", "--", "-D", "warnings"])?;
    cargo(root, &["build", "-p", "mlx5-core", "--target", EMBEDDED_TARGET])?;
    cargo(root, &["build", "-p", "mlx5-core", "--target", EMBEDDED_TARGET, "--features", "defmt"])?;
    cargo(
        root,
        &["clippy", "-p", "mlx5-core", "--target", EMBEDDED_TARGET, "--features", "defmt", "--", "-D", "warnings"],
    )?;
    // The firmware example: a linked no_std image (cortex-m-rt, memory.x) running the core's bring-up.
    cargo(root, &["build", "--release", "-p", "mlx5-firmware-example", "--target", EMBEDDED_TARGET])?;
    cargo(root, &["clippy", "-p", "mlx5-firmware-example", "--target", EMBEDDED_TARGET, "--", "-D", "warnings"])?;
    // The examples run on the simulator, each verifying its data (doctests ran with `cargo test`).
    for example in ["rc_pingpong", "ud_pingpong", "rdma_write_read", "event_driven"] {
        cargo(root, &["run", "--release", "-q", "-p", "mlx5-verbs", "--example", example])?;
    }
    // The fault-injection soak at CI size: every invariant must hold.
    soak::run(root, &soak::CI_ARGS.iter().map(|a| a.to_string()).collect::<Vec<_>>())?;
    vfio_test::run_vfio_test(root)?;
    fuzz::run_fuzz(root, &["--seconds".to_string(), "20".to_string()])?;
    println!("xtask ci: all steps passed");
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = root();
    let result = match args.first().map(String::as_str) {
        Some("vendor") => codegen::run_vendor(&root),
        Some("codegen") => codegen::run_codegen(&root, args.iter().any(|a| a == "--check")),
        Some("ci") => ci(&root),
        Some("vfio-test") => vfio_test::run_vfio_test(&root),
        Some("bench") => bench::run(&root, args.iter().any(|a| a == "--json")),
        Some("fuzz") => fuzz::run_fuzz(&root, &args[1..]),
        Some("soak") => soak::run(&root, &args[1..]),
        Some("modcheck") => {
            // `--root DIR` checks another checkout (a worktree) with this build of the checker.
            let other = args.iter().position(|a| a == "--root").and_then(|i| args.get(i + 1)).map(PathBuf::from);
            modcheck::run(other.as_deref().unwrap_or(&root), args.iter().any(|a| a == "--graph"))
        }
        _ => Err("usage: cargo xtask <vendor | codegen [--check] | ci | vfio-test | bench [--json] \
                  | fuzz [--seconds N] [--target NAME] | modcheck [--graph] [--root DIR] | soak [--ops N] [--seed S] [--json]>"
            .to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

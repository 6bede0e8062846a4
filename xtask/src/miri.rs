//! `cargo xtask miri`: the unsafe code under Miri on the nightly toolchain, sized to fit CI. Measured wall time on
//! the 2-CPU development machine, Miri's standard library already built, the simulator compiled for Miri within
//! it: 166 s with one fuzzer running beside it, 337 s when five other builds shared the machine (load average 11).
//! Test by test: `testkit::fixture` about 30 s, `fw::mkey` about 10 s, the rest a second or two each (the "finished
//! in" figures the test harness prints under Miri are Miri's virtual clock, not wall time). A fresh machine adds a
//! minute or two for `cargo miri setup`.
//!
//! What runs, and why:
//! * every library test of `mlx5-core`: the heap-backed test HAL, `MsgBuf` over DMA memory, the doorbell record
//!   pool, CQ/EQ/QP/SRQ rings, the command queue over a fake BAR;
//! * the simulator's unsafe-heavy parts (`mlx5-sim` with `test-utils`): its DMA space (`dma::`), the test kit
//!   (`HeapDma`, the MMIO mocks, the register file, the counting allocator, and `testkit::fixture`, two devices
//!   brought up and an RC pair connected: rings, doorbell records and mailboxes over the simulated DMA space end
//!   to end), the BAR (`mmio::`), the datapath's small tables (`small::`) and memory keys over process memory
//!   (`fw::mkey`, `map_user`).
//!
//! Left out, each for its reason:
//! * the simulator's other firmware tests (`fw::cq`, `fw::eq`, `fw::qp`, `fw::srq`, `fw::caps`, `fw::tests`):
//!   each brings a device up through some thirty commands, 10 to 20 s apiece under Miri (`fw::cq` alone took
//!   187 s), and their unsafe code is the DMA space the fixture already drives;
//! * `link::` (TCP and stream links, pcap): real sockets, threads and wall-clock timeouts, which Miri's isolation
//!   refuses or makes minutes long; the link holds no `unsafe`;
//! * `wire::`, `transport::`, `testkit::wire`, `fault::`, the device-level tests in `tests`: safe code (parsers,
//!   the datapath's state machines), covered by the fuzz targets and the ordinary test run;
//! * the cross-crate suite (`tests/`) and the tool: hours under Miri; the unsafe code they reach is the above.
//! * the core's golden-vector tests (`golden::`, `#[cfg_attr(miri, ignore)]`): safe encoders checked against a
//!   scan of 60 KB of JSON per vector, slow under Miri for no unsafe code.

use std::path::Path;
use std::process::Command;

/// The simulator's test filters Miri runs (substrings of test paths; see the module documentation).
const SIM_FILTERS: &[&str] = &["dma::", "testkit::", "mmio::", "small::", "fw::mkey"];

fn rustup(args: &[&str]) -> Result<bool, String> {
    println!("$ rustup {}", args.join(" "));
    Command::new("rustup").args(args).status().map(|s| s.success()).map_err(|e| format!("failed to run rustup: {e}"))
}

/// Installs the nightly toolchain and Miri when they are missing (a fresh CI machine has neither).
fn ensure_miri() -> Result<(), String> {
    let have = Command::new("rustup")
        .args(["+nightly", "component", "list", "--installed"])
        .output()
        .map_err(|e| format!("failed to run rustup: {e}"))?;
    if !have.status.success() && !rustup(&["toolchain", "install", "nightly", "--profile", "minimal"])? {
        return Err("rustup could not install the nightly toolchain".into());
    }
    if !String::from_utf8_lossy(&have.stdout).lines().any(|l| l.starts_with("miri"))
        && !rustup(&["+nightly", "component", "add", "miri", "rust-src"])?
    {
        return Err("rustup could not add miri to the nightly toolchain".into());
    }
    Ok(())
}

fn cargo_miri(root: &Path, args: &[&str]) -> Result<(), String> {
    println!("$ cargo {}", args.join(" "));
    let status = Command::new("cargo")
        .args(args)
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo miri: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed ({status})", args.join(" ")))
    }
}

/// Runs the core's library tests and the simulator's subset under Miri.
pub fn run(root: &Path) -> Result<(), String> {
    ensure_miri()?;
    let start = std::time::Instant::now();
    cargo_miri(root, &["+nightly", "miri", "test", "-p", "mlx5-core", "--lib"])?;
    let mut sim = vec!["+nightly", "miri", "test", "-p", "mlx5-sim", "--features", "test-utils", "--lib", "--"];
    sim.extend(SIM_FILTERS);
    cargo_miri(root, &sim)?;
    println!("xtask miri: passed in {:.0} s", start.elapsed().as_secs_f64());
    Ok(())
}

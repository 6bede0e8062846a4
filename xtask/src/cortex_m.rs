//! `cargo xtask cortex-m`: the core's device-free unit tests on a Cortex-M4F.
//!
//! `core/tests-m4` (the list `mlx5_core::testlist`, run without std) is built for `thumbv7em-none-eabihf` and run
//! on QEMU's `mps2-an386` (Debian's `qemu-system-arm`, installed when missing) with semihosting for its output and
//! exit status; the same list runs on the host. Steps:
//! 1. the harness's planted failures (feature `selftest`) on the M4: exactly `2 passed, 3 failed`, each failure
//!    named, and a failing exit status, so a failing test is known to fail the run and not stop it;
//! 2. the core's list on the host, then on the M4: both must pass, report the same count, and at least
//!    [`MIN_TESTS`].
//!
//! Both builds use the dev profile, as `cargo test` does, so overflow checks and debug assertions hold on the M4.

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::vfio_test::{apt_install, have, wait_until};
use crate::{cargo, EMBEDDED_TARGET};

const PACKAGE: &str = "mlx5-core-tests-m4";
/// Fewer tests than this on the M4 is a failure: the list must not quietly shrink.
pub(crate) const MIN_TESTS: u32 = 100;
/// The whole M4 run takes about a second; a hung test is stopped here.
const QEMU_TIMEOUT: Duration = Duration::from_secs(120);

/// A run's closing `N passed, N failed` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Summary {
    pub(crate) passed: u32,
    pub(crate) failed: u32,
}

/// The last `N passed, N failed` line of a run's output, if there is one.
pub(crate) fn summary(output: &str) -> Option<Summary> {
    output.lines().rev().find_map(|l| {
        let (p, f) = l.trim().split_once(" passed, ")?;
        let f = f.strip_suffix(" failed")?;
        Some(Summary { passed: p.parse().ok()?, failed: f.parse().ok()? })
    })
}

pub(crate) fn run(root: &Path) -> Result<(), String> {
    let start = Instant::now();
    crate::ensure_toolchain()?;
    if !have("qemu-system-arm") {
        apt_install(&["qemu-system-arm"])?;
    }
    let elf = root.join("target").join(EMBEDDED_TARGET).join("debug").join(PACKAGE);

    cargo(root, &["build", "-q", "-p", PACKAGE, "--target", EMBEDDED_TARGET, "--features", "selftest"])?;
    let (ok, out) = qemu(root, &elf)?;
    let planted = ["fails_an_assertion", "fails_to_panic", "fails_with_a_fault"];
    let named = planted.iter().all(|t| out.contains(&format!("test selftest::{t} ... FAILED")));
    if ok || summary(&out) != Some(Summary { passed: 2, failed: 3 }) || !named {
        return Err(format!(
            "the harness's self-test on the M4 should end `2 passed, 3 failed` with a failing status, naming {}; \
             it printed:\n{out}",
            planted.join(", ")
        ));
    }
    println!("cortex-m: the harness's planted failures were each reported and failed the run");

    println!("$ cargo run -q -p {PACKAGE}");
    let host = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["run", "-q", "-p", PACKAGE])
        .current_dir(root)
        .output()
        .map_err(|e| format!("failed to run cargo run -p {PACKAGE}: {e}"))?;
    let host_out = String::from_utf8_lossy(&host.stdout).into_owned();
    let host_sum = summary(&host_out);
    if !host.status.success() || host_sum.is_none() {
        return Err(format!(
            "the list failed on the host ({}):\n{host_out}{}",
            host.status,
            String::from_utf8_lossy(&host.stderr)
        ));
    }

    cargo(root, &["build", "-q", "-p", PACKAGE, "--target", EMBEDDED_TARGET])?;
    let (ok, out) = qemu(root, &elf)?;
    print!("{out}");
    let m4 = summary(&out).ok_or_else(|| "the M4 run printed no `N passed, N failed` line".to_string())?;
    if !ok || m4.failed > 0 {
        return Err(format!("{} of the core's tests failed on the Cortex-M4F", m4.failed));
    }
    if Some(m4) != host_sum {
        return Err(format!("the M4 ran {m4:?} but the host {host_sum:?} of the same list"));
    }
    if m4.passed < MIN_TESTS {
        return Err(format!("only {} tests ran on the M4 (at least {MIN_TESTS} expected)", m4.passed));
    }
    println!(
        "cortex-m: {} tests passed on the Cortex-M4F and on the host ({:.1} s)",
        m4.passed,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs `elf` on the mps2-an386: whether it exited 0, and what it printed (semihosting writes to stderr).
fn qemu(root: &Path, elf: &Path) -> Result<(bool, String), String> {
    let log = root.join("target").join("cortex-m-qemu.log");
    let file = File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let args = [
        "-M",
        "mps2-an386",
        "-display",
        "none",
        "-monitor",
        "none",
        "-serial",
        "none",
        "-semihosting-config",
        "enable=on,target=native",
        "-kernel",
    ];
    println!("$ qemu-system-arm {} {}", args.join(" "), elf.display());
    let mut child = Command::new("qemu-system-arm")
        .args(args)
        .arg(elf)
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("failed to run qemu-system-arm: {e}"))?;
    let status = wait_until(&mut child, Instant::now() + QEMU_TIMEOUT, Duration::from_millis(20))?;
    let out = std::fs::read_to_string(&log).map_err(|e| format!("reading {}: {e}", log.display()))?;
    match status {
        Some(s) => Ok((s.success(), out)),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("the M4 run did not end within {} s; it printed:\n{out}", QEMU_TIMEOUT.as_secs()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_closing_line_is_found_and_nothing_else_passes_for_it() {
        let out = "running 3 tests\ntest a ... ok\n\n2 passed, 1 failed\n";
        assert_eq!(summary(out), Some(Summary { passed: 2, failed: 1 }));
        assert_eq!(summary("test a ... ok\n"), None);
        assert_eq!(summary("x passed, 1 failed\n"), None);
        assert_eq!(summary("2 passed, 1 failed, 3 skipped\n"), None);
    }
}

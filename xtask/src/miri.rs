//! `cargo xtask miri`: the core's unit tests under Miri on the nightly toolchain, so every `unsafe` block they
//! reach (the heap-backed test HAL, rings over DMA memory, `MsgBuf`) is checked for undefined behaviour.

use std::path::Path;
use std::process::Command;

/// Runs `cargo +nightly miri test` on the core's library tests, installing Miri first when it is missing.
pub fn run(root: &Path) -> Result<(), String> {
    let have = Command::new("rustup")
        .args(["+nightly", "component", "list", "--installed"])
        .output()
        .map_err(|e| format!("failed to run rustup: {e}"))?;
    if !String::from_utf8_lossy(&have.stdout).lines().any(|l| l.starts_with("miri")) {
        println!("$ rustup +nightly component add miri rust-src");
        let ok = Command::new("rustup")
            .args(["+nightly", "component", "add", "miri", "rust-src"])
            .status()
            .map_err(|e| format!("failed to run rustup: {e}"))?;
        if !ok.success() {
            return Err("rustup could not add miri to the nightly toolchain".into());
        }
    }
    let args = ["+nightly", "miri", "test", "-p", "mlx5-core", "--lib"];
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

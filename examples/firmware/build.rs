//! For the bare-metal Arm target only: put `memory.x` where cortex-m-rt's `link.x` finds it and link the firmware
//! binary with `link.x` and defmt's `defmt.x`. Host builds (the tests against the simulator) link nothing special.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=memory.x");
    println!("cargo:rerun-if-changed=build.rs");
    let target = std::env::var("TARGET").unwrap_or_default();
    if !(target.starts_with("thumb") && target.contains("-none-")) {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::copy("memory.x", out.join("memory.x")).expect("copying memory.x to OUT_DIR");
    // The search path for the binary only: a dependent image (core/tests-m4 runs `run_with` on its own board)
    // links with its own memory.x, which a package-wide search path would shadow.
    println!("cargo:rustc-link-arg-bins=-L{}", out.display());
    println!("cargo:rustc-link-arg-bins=-Tlink.x");
    // defmt's log strings live in a section its linker script places (the interned format strings).
    println!("cargo:rustc-link-arg-bins=-Tdefmt.x");
}

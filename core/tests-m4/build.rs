//! For the bare-metal Arm target only: put `memory.x` (the mps2-an386 layout) where cortex-m-rt's `link.x` finds
//! it and link the harness with `link.x`. The host build (the same list run with std) links nothing special.

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
    println!("cargo:rustc-link-search={}", out.display());
    println!("cargo:rustc-link-arg-bins=-Tlink.x");
}

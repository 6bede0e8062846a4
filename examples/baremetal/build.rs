//! The image's memory layout (`link.ld`: loaded at 1 MiB, the PVH entry note) for the bare-metal target only.

fn main() {
    println!("cargo:rerun-if-changed=link.ld");
    if std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-none") {
        let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
        println!("cargo:rustc-link-arg-bins=-T{dir}/link.ld");
    }
}

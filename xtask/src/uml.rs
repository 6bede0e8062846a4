//! `cargo xtask uml`: a User-Mode Linux kernel (`ARCH=um`) with NVIDIA's mlx5 drivers and virt-pci, built from
//! Debian's `linux-source-6.12` with our config fragment and patches (`xtask/uml/`).
//!
//! The result is cached in `target/uml/<hash>/linux`, the hash covering the source package's name, the patches and
//! the fragment; the build tree `target/uml/build` is reused while that hash holds, so a rebuild after a patch to
//! one file costs seconds, and an unchanged recipe costs nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::vfio_test::{apt_install, run};

/// The Debian source package.
pub(crate) const SOURCE_PKG: &str = "linux-source-6.12";
/// Host packages the kernel build needs (`busybox-static` is for the initramfs of `linux-drives-sim`).
const HOST_PKGS: &[&str] =
    &["build-essential", "flex", "bison", "bc", "libelf-dev", "libssl-dev", "cpio", "busybox-static", "xz-utils"];

/// 64-bit FNV-1a: enough to name a cache entry (not a security boundary).
fn fnv(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= u64::from(*b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

/// Whether dpkg has `pkg` installed (a file or program check can be fooled by another version's leftovers).
pub(crate) fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

pub(crate) fn ensure_host_packages() -> Result<(), String> {
    let need: Vec<&str> = HOST_PKGS.iter().copied().filter(|p| !installed(p)).collect();
    if need.is_empty() {
        Ok(())
    } else {
        apt_install(&need)
    }
}

/// The source package: `target/uml/dl/linux-source-6.12_*.deb`, downloaded with `apt-get download` when absent
/// (or copied from `$UML_SOURCE_DEB`, a cached copy).
pub(crate) fn source_deb(dl: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dl).map_err(|e| format!("{}: {e}", dl.display()))?;
    let find = || -> Option<PathBuf> {
        let mut debs: Vec<PathBuf> = std::fs::read_dir(dl)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(SOURCE_PKG) && n.ends_with(".deb"))
            })
            .collect();
        debs.sort();
        debs.pop()
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    if let Some(cached) = std::env::var_os("UML_SOURCE_DEB") {
        let cached = PathBuf::from(cached);
        let name = cached.file_name().ok_or("UML_SOURCE_DEB names no file")?;
        std::fs::copy(&cached, dl.join(name)).map_err(|e| format!("copying {}: {e}", cached.display()))?;
    } else {
        println!("uml: apt-get download {SOURCE_PKG}");
        let dl_ok =
            Command::new("apt-get").arg("download").arg(SOURCE_PKG).current_dir(dl).status().is_ok_and(|s| s.success());
        if !dl_ok {
            run(Command::new("apt-get").args(["update", "-q"]))?;
            run(Command::new("apt-get").arg("download").arg(SOURCE_PKG).current_dir(dl))?;
        }
    }
    find().ok_or_else(|| format!("no {SOURCE_PKG} package in {}", dl.display()))
}

/// The recipe's inputs: the patches (sorted by name) and the config fragment.
fn recipe(root: &Path) -> Result<(Vec<PathBuf>, PathBuf), String> {
    let dir = root.join("xtask/uml");
    let mut patches: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "patch"))
        .collect();
    patches.sort();
    Ok((patches, dir.join("config.fragment")))
}

fn make(tree: &Path, args: &[&str]) -> Result<(), String> {
    let status =
        Command::new("make").arg("ARCH=um").args(args).current_dir(tree).status().map_err(|e| format!("make: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("make ARCH=um {} failed ({status})", args.join(" ")))
    }
}

/// Builds (or finds cached) the UML kernel; returns the `linux` binary.
pub(crate) fn build(root: &Path) -> Result<PathBuf, String> {
    ensure_host_packages()?;
    let base = root.join("target/uml");
    let deb = source_deb(&base.join("dl"))?;
    let (patches, fragment) = recipe(root)?;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut h, deb.file_name().and_then(|n| n.to_str()).unwrap_or_default().as_bytes());
    for p in patches.iter().chain([&fragment]) {
        fnv(&mut h, p.file_name().and_then(|n| n.to_str()).unwrap_or_default().as_bytes());
        fnv(&mut h, &std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    let key = format!("{h:016x}");
    let out = base.join(&key).join("linux");
    if out.exists() {
        println!("uml: cached kernel {}", out.display());
        return Ok(out);
    }
    let tree = base.join("build");
    let stamp = tree.join(".xtask-recipe");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(key.as_str()) {
        // A different recipe: start again from pristine source.
        prepare(&base, &tree, &deb, &patches, &fragment)?;
        std::fs::write(&stamp, &key).map_err(|e| e.to_string())?;
    }
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    let started = std::time::Instant::now();
    make(&tree, &[&format!("-j{jobs}"), "linux"])?;
    println!("uml: make linux took {:.0} s", started.elapsed().as_secs_f64());
    std::fs::create_dir_all(out.parent().unwrap_or(&base)).map_err(|e| e.to_string())?;
    // A hard link costs no space; copy when the file system refuses one.
    if std::fs::hard_link(tree.join("linux"), &out).is_err() {
        std::fs::copy(tree.join("linux"), &out).map_err(|e| format!("{}: {e}", out.display()))?;
    }
    println!("uml: kernel {}", out.display());
    Ok(out)
}

/// Unpacks the source package `deb` into the scratch directory `x` (emptied first); the kernel tarball in it.
pub(crate) fn source_tarball(deb: &Path, x: &Path) -> Result<PathBuf, String> {
    let _ = std::fs::remove_dir_all(x);
    std::fs::create_dir_all(x).map_err(|e| format!("{}: {e}", x.display()))?;
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(x))?;
    Ok(x.join(format!("usr/src/{SOURCE_PKG}.tar.xz")))
}

/// A configured source tree at `tree` from the package, our patches and the fragment (no compilation).
fn prepare(base: &Path, tree: &Path, deb: &Path, patches: &[PathBuf], fragment: &Path) -> Result<(), String> {
    println!("uml: preparing {} from {}", tree.display(), deb.display());
    let _ = std::fs::remove_dir_all(tree);
    let x = base.join("dl/x");
    let tarball = source_tarball(deb, &x)?;
    let unpack = base.join("unpack");
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::create_dir_all(&unpack).map_err(|e| e.to_string())?;
    run(Command::new("tar").arg("xf").arg(&tarball).arg("-C").arg(&unpack))?;
    let _ = std::fs::remove_dir_all(&x);
    std::fs::rename(unpack.join(SOURCE_PKG), tree).map_err(|e| format!("renaming the source tree: {e}"))?;
    let _ = std::fs::remove_dir_all(&unpack);
    for p in patches {
        println!("uml: applying {}", p.display());
        run(Command::new("patch").args(["-p1", "--forward", "-i"]).arg(p).current_dir(tree))?;
    }
    make(tree, &["defconfig"])?;
    let mut config = std::fs::read_to_string(tree.join(".config")).map_err(|e| e.to_string())?;
    config.push_str(&std::fs::read_to_string(fragment).map_err(|e| format!("{}: {e}", fragment.display()))?);
    std::fs::write(tree.join(".config"), config).map_err(|e| e.to_string())?;
    make(tree, &["olddefconfig"])?;
    let config = std::fs::read_to_string(tree.join(".config")).map_err(|e| e.to_string())?;
    for want in [
        "CONFIG_UML_PCI_OVER_VIRTIO=y",
        "CONFIG_MLX5_CORE=y",
        "CONFIG_MLX5_INFINIBAND=y",
        "CONFIG_INFINIBAND_USER_MAD=y",
    ] {
        if !config.lines().any(|l| l == want) {
            return Err(format!("the configured kernel lacks {want} (a patch or the fragment no longer applies)"));
        }
    }
    Ok(())
}

/// `uml --check`: the recipe still applies to the source package (extract, patch, configure in a scratch tree,
/// then remove it); a minute or two, no compilation.
pub fn check_recipe(root: &Path) -> Result<(), String> {
    ensure_host_packages()?;
    let base = root.join("target/uml");
    let deb = source_deb(&base.join("dl"))?;
    let (patches, fragment) = recipe(root)?;
    let scratch = base.join("check");
    let r = prepare(&base, &scratch, &deb, &patches, &fragment);
    let _ = std::fs::remove_dir_all(&scratch);
    r?;
    println!("uml: the patches and the config fragment apply to {}", deb.display());
    Ok(())
}

pub fn run_uml(root: &Path) -> Result<(), String> {
    build(root).map(|_| ())
}

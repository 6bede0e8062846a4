//! Debian's rdma-core userspace in a guest's initramfs: verbs programs (`ibverbs-utils`), the providers they
//! dlopen (`ibverbs-providers`), each provider's `.driver` file, and the library closure `ldd` names. Shared by
//! the rdma_rxe guest (`rxe.rs`) and the UML guest of `linux-drives-sim`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::vfio_test::{apt_install, have, run, Cpio};

/// Where Debian keeps the libraries (the guest uses the same layout).
pub(crate) const LIBDIR: &str = "usr/lib/x86_64-linux-gnu";

/// The provider library for `name` (`rxe`, `mlx5`): `libibverbs/lib<name>-rdmav*.so` on this host.
fn provider(name: &str) -> Option<PathBuf> {
    let dir = Path::new("/").join(LIBDIR).join("libibverbs");
    let prefix = format!("lib{name}-rdmav");
    std::fs::read_dir(dir).ok()?.flatten().map(|e| e.path()).find(|p| {
        p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&prefix) && n.to_string_lossy().ends_with(".so"))
    })
}

/// Installs `ibverbs-utils` and `ibverbs-providers` (and busybox-static) when missing.
pub(crate) fn ensure_packages(providers: &[&str]) -> Result<(), String> {
    let mut need = Vec::new();
    if !Path::new("/bin/busybox").exists() {
        need.push("busybox-static");
    }
    if !have("ibv_rc_pingpong") {
        need.push("ibverbs-utils");
    }
    if providers.iter().any(|p| provider(p).is_none()) {
        need.push("ibverbs-providers");
    }
    if need.is_empty() {
        Ok(())
    } else {
        apt_install(&need)
    }
}

fn which(program: &str) -> Result<PathBuf, String> {
    let out = run(Command::new("sh").arg("-c").arg(format!("command -v {program}")))?;
    Ok(PathBuf::from(out.trim()))
}

/// `ldd`'s answer for `bin`: (name the loader looks for, file on this host); the interpreter is named by its path.
fn ldd(bin: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let out = run(Command::new("ldd").arg(bin))?;
    let mut libs = Vec::new();
    for line in out.lines().map(str::trim) {
        if let Some((name, rest)) = line.split_once(" => ") {
            if let Some(path) = rest.split_whitespace().next().filter(|p| p.starts_with('/')) {
                libs.push((name.to_string(), PathBuf::from(path)));
            }
        } else if let Some(path) = line.split_whitespace().next().filter(|p| p.starts_with('/')) {
            libs.push((path.to_string(), PathBuf::from(path)));
        }
    }
    Ok(libs)
}

/// Adds to `c` the directories, `binaries` (in `usr/bin`; names on PATH or paths), the `providers` with their `.driver` files, and the
/// library closure (the loader under `usr/lib64`, `lib` and `lib64` as links into `usr`). Returns how many
/// libraries went in.
pub(crate) fn add_userspace(c: &mut Cpio, binaries: &[&str], providers: &[&str]) -> Result<usize, String> {
    for d in
        ["etc", "etc/libibverbs.d", "usr", "usr/bin", "usr/lib", LIBDIR, &format!("{LIBDIR}/libibverbs"), "usr/lib64"]
    {
        c.dir(d);
    }
    c.symlink("lib", "usr/lib");
    c.symlink("lib64", "usr/lib64");
    let mut libs: Vec<(String, PathBuf)> = Vec::new();
    for b in binaries {
        // A name is looked up on PATH; a path (a program unpacked from a Debian package) is taken as it is.
        let path = if b.contains('/') { PathBuf::from(b) } else { which(b)? };
        let name = path.file_name().ok_or("a binary path without a name")?.to_string_lossy().into_owned();
        c.file(
            &format!("usr/bin/{name}"),
            true,
            &std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?,
        );
        libs.extend(ldd(&path)?);
    }
    // Providers are dlopen'ed, so no binary's ldd names them.
    for p in providers {
        let lib = provider(p).ok_or_else(|| format!("no {p} provider (ibverbs-providers)"))?;
        libs.extend(ldd(&lib)?);
        let name = lib.file_name().ok_or("provider path")?.to_string_lossy().into_owned();
        c.file(&format!("{LIBDIR}/libibverbs/{name}"), false, &std::fs::read(&lib).map_err(|e| e.to_string())?);
        c.file(&format!("etc/libibverbs.d/{p}.driver"), false, format!("driver {p}\n").as_bytes());
    }
    libs.sort();
    libs.dedup_by(|a, b| a.0 == b.0);
    for (name, path) in &libs {
        let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if name.starts_with('/') {
            let file = Path::new(name).file_name().ok_or("interpreter path")?.to_string_lossy().into_owned();
            c.file(&format!("usr/lib64/{file}"), true, &data);
        } else {
            c.file(&format!("{LIBDIR}/{name}"), true, &data);
        }
    }
    Ok(libs.len())
}

//! `cargo xtask ci --fresh`: `.ci/run` on a fresh clone of the committed HEAD inside a minimal Debian bookworm
//! root, so nothing installed on this host (libraries, tools, caches) is visible to CI.
//!
//! 1. The root: `mmdebstrap --variant=minbase` with only what a new CI machine has ([`PACKAGES`]), reaching the
//!    Debian mirror this host reaches (its apt sources, and its apt settings that say how: a proxy, a CA file,
//!    a snapshot mirror's date checks). Built once into `target/fresh/root-<hash>.tar`, the hash covering the package list, the
//!    sources and those settings; `mmdebstrap` is installed with apt-get when missing.
//! 2. Each run unpacks a pristine copy into `target/fresh/run/root` (the previous run's tree is removed first),
//!    clones HEAD into `/ci/main`, copies `../shared` beside it as `/ci/shared` (mounted read-only, as CI has
//!    it), and takes this host's `/etc/resolv.conf`, `/etc/hosts` and local certificate authorities
//!    (`/usr/local/share/ca-certificates`): the machine's network, as a container runtime gives it.
//! 3. In a new mount and PID namespace (`unshare`): `/proc`; `/sys` and `/dev` bound recursively (`/dev/kvm`,
//!    `/dev/net/tun`, `/dev/vfio`, `/dev/shm` when the host has them); the host's `~/.rustup` and `~/.cargo/bin` as
//!    overlays (CI may add targets, components and `cargo-fuzz`; the host's files stay as they were); an empty
//!    `CARGO_HOME` otherwise, so crates are downloaded as on a new machine. Then `bash .ci/run` runs as root with
//!    `CI=true` and no stdin; its output goes to the terminal and `target/fresh/ci.log`.
//!
//! The mounts and every process of a run go with the namespaces however the run ends: the namespace's first
//! process is killed when `unshare` dies (`--kill-child`), `unshare` when this process dies (`setpriv
//! --pdeathsig`), and the kernel kills a PID namespace's processes when its first one exits. The mounts are never
//! visible outside (private propagation), so removing a run's tree never reaches the host's toolchain.
//!
//! `--command CMD` runs `bash -c CMD` in the clone instead of `.ci/run`: a smoke test, or one CI step.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::vfio_test::{apt_install, have, run};

/// Debian's release: the one the project's Debian packages (rdma-core 44, Linux 6.12's source) come from.
const SUITE: &str = "bookworm";

/// What a new CI machine has on top of Debian's minimal base (`apt` is in it): the C toolchain, Python 3.11
/// with pip, git, TLS roots, curl and xz.
const PACKAGES: &[&str] =
    &["gcc", "g++", "make", "python3", "python3-pip", "git", "ca-certificates", "apt", "curl", "xz-utils"];

/// Where the clone and `../shared` are inside the root.
const CLONE: &str = "/ci/main";
const SHARED: &str = "/ci/shared";

/// Runs in the new namespaces as their first process: the mounts, then the command (`$5...`) chrooted. It stays
/// the parent of the command (no `exec`), so it is not the command that carries PID 1's signal rules.
const NAMESPACE_SCRIPT: &str = r#"set -eu
exec 2>&1
R=$1 RUN=$2 RUSTUP=$3 CARGOBIN=$4
shift 4
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
mount -t overlay overlay -o "lowerdir=$RUSTUP,upperdir=$RUN/rustup.upper,workdir=$RUN/rustup.work" "$R/root/.rustup"
mount -t overlay overlay -o "lowerdir=$CARGOBIN,upperdir=$RUN/cargo-bin.upper,workdir=$RUN/cargo-bin.work" \
    "$R/root/.cargo/bin"
if [ -n "$(ls -A "$R/usr/local/share/ca-certificates" 2>/dev/null)" ]; then
    # Quiet: it warns about the bundle it writes on every run; a failure still stops the script.
    chroot "$R" update-ca-certificates >/dev/null 2>&1
fi
if [ -d "$R/ci/shared" ]; then
    mount --bind "$R/ci/shared" "$R/ci/shared"
    mount -o remount,bind,ro "$R/ci/shared"
fi
set +e
chroot "$R" "$@"
rc=$?
exit $rc
"#;

fn fnv(h: &mut u64, bytes: &[u8]) {
    for b in bytes {
        *h ^= u64::from(*b);
        *h = h.wrapping_mul(0x100_0000_01b3);
    }
}

/// The host's apt sources: `/etc/apt/sources.list` when it names a source, and `sources.list.d/*.list` and
/// `*.sources` (the other files there are not read by apt). Empty: mmdebstrap's default mirror.
fn host_sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let main = Path::new("/etc/apt/sources.list");
    let names_source = |p: &Path| {
        std::fs::read_to_string(p).is_ok_and(|t| t.lines().any(|l| !l.trim().is_empty() && !l.trim().starts_with('#')))
    };
    if names_source(main) {
        files.push(main.to_path_buf());
    }
    let mut more: Vec<PathBuf> = std::fs::read_dir("/etc/apt/sources.list.d")
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    more.retain(|p| p.extension().is_some_and(|x| x == "list" || x == "sources") && names_source(p));
    more.sort();
    files.extend(more);
    files
}

/// The host's apt settings that say how it reaches its mirror (proxies, a CA file, the validity checks a snapshot
/// mirror needs off), not how it trims its own images. Credentials (`auth.conf.d`) are not taken.
fn host_apt_settings() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        std::fs::read_dir("/etc/apt/apt.conf.d").map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    files.push(PathBuf::from("/etc/apt/apt.conf"));
    files.retain(|p| std::fs::read_to_string(p).is_ok_and(|t| sets_mirror_access(&t)));
    files.sort();
    files
}

/// Whether an apt configuration text sets, outside comments, an option that decides whether the mirror is
/// reached: a proxy, a CA file, or the release file's date checks.
fn sets_mirror_access(text: &str) -> bool {
    const KEYS: &[&str] = &["Proxy", "CaInfo", "Check-Valid-Until", "Check-Date"];
    text.lines()
        .map(str::trim)
        .any(|l| !l.starts_with("//") && !l.starts_with('#') && KEYS.iter().any(|k| l.contains(k)))
}

/// The cache key of the root: the suite, the package list, and the content of each source and setting file.
fn root_key(packages: &[&str], files: &[PathBuf]) -> Result<String, String> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    fnv(&mut h, SUITE.as_bytes());
    for p in packages {
        fnv(&mut h, p.as_bytes());
        fnv(&mut h, b"\0");
    }
    for f in files {
        fnv(&mut h, f.as_os_str().as_encoded_bytes());
        fnv(&mut h, &std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?);
    }
    Ok(format!("{h:016x}"))
}

/// The root's tarball under `dir`, built with mmdebstrap unless a run with the same key built it before.
fn root_tarball(dir: &Path) -> Result<PathBuf, String> {
    let sources = host_sources();
    let settings = host_apt_settings();
    let files: Vec<PathBuf> = sources.iter().chain(&settings).cloned().collect();
    let tar = dir.join(format!("root-{}.tar", root_key(PACKAGES, &files)?));
    if tar.is_file() {
        println!("ci --fresh: reusing the root {}", tar.display());
        return Ok(tar);
    }
    if !have("mmdebstrap") {
        apt_install(&["mmdebstrap"])?;
    }
    // mmdebstrap takes the format from the name: the partial file ends in .tar too.
    let partial = dir.join("root.partial.tar");
    let mut cmd = Command::new("mmdebstrap");
    cmd.args(["--variant=minbase", &format!("--include={}", PACKAGES.join(","))]);
    for s in &settings {
        cmd.arg(format!("--aptopt={}", s.display()));
    }
    cmd.arg(SUITE).arg(&partial).args(&sources).stdin(Stdio::null());
    println!("$ {cmd:?}");
    let start = Instant::now();
    let status = cmd.status().map_err(|e| format!("failed to run mmdebstrap: {e}"))?;
    if !status.success() {
        let _ = std::fs::remove_file(&partial);
        return Err(format!("mmdebstrap failed ({status})"));
    }
    std::fs::rename(&partial, &tar).map_err(|e| e.to_string())?;
    // One root is kept: those of older package lists or mirrors are removed.
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("root-") && name.ends_with(".tar") && e.path() != tar {
            let _ = std::fs::remove_file(e.path());
        }
    }
    println!("ci --fresh: built the root {} in {} s", tar.display(), start.elapsed().as_secs());
    Ok(tar)
}

/// The mount points in `mountinfo` (the kernel's `/proc/self/mountinfo`) at or under `dir`.
fn mounts_under(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mountinfo(m)))
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// mountinfo writes space, tab, newline and backslash in paths as three octal digits after a backslash.
fn unescape_mountinfo(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Unpacks a pristine root into `run/root` with the clone of `head`, `../shared` and the host's network files.
fn prepare(repo: &Path, tar: &Path, run_dir: &Path, head: &str) -> Result<PathBuf, String> {
    // The mounts live in the run's own namespace, so none should be visible here; if one is, deleting the tree
    // could reach through it (the host's toolchain): refuse.
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let live = mounts_under(&info, run_dir);
    if !live.is_empty() {
        return Err(format!("mounts remain under {} (a run still going?): {live:?}", run_dir.display()));
    }
    if run_dir.exists() {
        println!("ci --fresh: removing the previous run's tree");
        std::fs::remove_dir_all(run_dir).map_err(|e| format!("removing {}: {e}", run_dir.display()))?;
    }
    let r = run_dir.join("root");
    for d in ["rustup.upper", "rustup.work", "cargo-bin.upper", "cargo-bin.work", "root"] {
        std::fs::create_dir_all(run_dir.join(d)).map_err(|e| e.to_string())?;
    }
    run(Command::new("tar").args(["--numeric-owner", "-xf"]).arg(tar).arg("-C").arg(&r))?;
    for d in ["root/.rustup", "root/.cargo/bin", "ci"] {
        std::fs::create_dir_all(r.join(d)).map_err(|e| e.to_string())?;
    }
    // This machine's own certificate authorities (a TLS-inspecting egress proxy's, say): CI reaches crates.io
    // and the rest through the same network. update-ca-certificates adds them inside, before the command.
    let local_cas = Path::new("/usr/local/share/ca-certificates");
    if local_cas.read_dir().is_ok_and(|mut d| d.next().is_some()) {
        let to = r.join("usr/local/share/ca-certificates");
        std::fs::create_dir_all(&to).map_err(|e| e.to_string())?;
        run(Command::new("cp").arg("-a").arg(local_cas.join(".")).arg(&to))?;
    }
    for f in ["etc/resolv.conf", "etc/hosts"] {
        let host = Path::new("/").join(f);
        if let Ok(text) = std::fs::read(&host) {
            // The root's file may be a link into /run, which the root does not have.
            let _ = std::fs::remove_file(r.join(f));
            std::fs::write(r.join(f), text).map_err(|e| format!("{f}: {e}"))?;
        }
    }
    let clone = r.join(CLONE.trim_start_matches('/'));
    run(Command::new("git").args(["clone", "--quiet", "--no-hardlinks", "--no-checkout"]).arg(repo).arg(&clone))?;
    run(Command::new("git").arg("-C").arg(&clone).args(["checkout", "--quiet", "--detach", head]))?;
    let shared = repo.parent().map(|p| p.join("shared")).filter(|p| p.is_dir());
    match shared {
        Some(s) => {
            run(Command::new("cp").arg("-a").arg(&s).arg(r.join(SHARED.trim_start_matches('/'))))?;
        }
        None => println!("ci --fresh: no ../shared beside the repository; the clone runs without it"),
    }
    Ok(r)
}

/// The environment inside: a login's minimum, the toolchain's homes, CI's flag, and the host's proxy variables.
fn environment() -> Vec<String> {
    let mut env = vec![
        "PATH=/root/.cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        "HOME=/root".into(),
        "USER=root".into(),
        "LOGNAME=root".into(),
        "SHELL=/bin/bash".into(),
        "LANG=C.UTF-8".into(),
        "CI=true".into(),
        "RUSTUP_HOME=/root/.rustup".into(),
        "CARGO_HOME=/root/.cargo".into(),
    ];
    for v in ["TERM", "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"] {
        if let Ok(x) = std::env::var(v) {
            env.push(format!("{v}={x}"));
        }
    }
    env
}

/// Copies everything `from` yields to the terminal and the log until it ends.
fn tee(mut from: impl Read, log: &mut std::fs::File) -> Result<(), String> {
    let mut buf = [0u8; 8192];
    let mut out = std::io::stdout();
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("reading the run's output: {e}")),
        };
        // A closed terminal must not stop the run or its log.
        let _ = out.write_all(&buf[..n]).and_then(|()| out.flush());
        log.write_all(&buf[..n]).map_err(|e| format!("writing the log: {e}"))?;
    }
}

/// One run at a time: a second would remove the tree the first runs in. The file holds the running xtask's
/// pid; a file whose process is gone (killed) is taken over.
struct RunLock(PathBuf);

impl RunLock {
    fn take(path: &Path) -> Result<RunLock, String> {
        if let Ok(pid) = std::fs::read_to_string(path) {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", pid.trim())).unwrap_or_default();
            if pid.trim() != std::process::id().to_string() && String::from_utf8_lossy(&cmdline).contains("xtask") {
                return Err(format!("another ci --fresh (pid {}) is running in {}", pid.trim(), path.display()));
            }
        }
        std::fs::write(path, std::process::id().to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(RunLock(path.to_path_buf()))
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().find_map(|l| l.strip_prefix("Uid:")).is_some_and(|u| u.split_whitespace().nth(1) == Some("0"))
    })
}

/// `cargo xtask ci --fresh [--command CMD]`.
pub fn run_fresh(repo: &Path, command: Option<&str>) -> Result<(), String> {
    let start = Instant::now();
    if !is_root() {
        return Err("ci --fresh needs root (it builds a root with mmdebstrap, mounts and chroots)".into());
    }
    let home = PathBuf::from(std::env::var_os("HOME").ok_or("HOME is not set")?);
    let rustup = std::env::var_os("RUSTUP_HOME").map_or_else(|| home.join(".rustup"), PathBuf::from);
    let cargo_bin = std::env::var_os("CARGO_HOME").map_or_else(|| home.join(".cargo"), PathBuf::from).join("bin");
    for (what, d) in [("RUSTUP_HOME", &rustup), ("CARGO_HOME/bin", &cargo_bin)] {
        if !d.is_dir() {
            return Err(format!("no Rust toolchain to bind in: {what} {} is not a directory", d.display()));
        }
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo.join("target"), PathBuf::from);
    let dir = target.join("fresh");
    let run_dir = dir.join("run");
    // The overlay options separate paths with ',' and ':'.
    for p in [&rustup, &cargo_bin, &run_dir] {
        if p.to_string_lossy().contains([',', ':']) {
            return Err(format!("ci --fresh cannot mount a path with ',' or ':': {}", p.display()));
        }
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let _lock = RunLock::take(&dir.join("run.pid"))?;
    let head = run(Command::new("git").arg("-C").arg(repo).args(["rev-parse", "HEAD"]))?.trim().to_string();
    let dirty = run(Command::new("git").arg("-C").arg(repo).args(["status", "--porcelain", "--untracked-files=no"]))?;
    let tar = root_tarball(&dir)?;
    let prepared = Instant::now();
    let r = prepare(repo, &tar, &run_dir, &head)?;
    println!(
        "ci --fresh: HEAD {head} cloned into {}{CLONE} ({} s to prepare){}",
        r.display(),
        prepared.elapsed().as_secs(),
        if dirty.trim().is_empty() { "" } else { "; uncommitted changes of this tree are not in it" }
    );

    let script = match command {
        Some(c) => format!("cd {CLONE} || exit 1\n{c}"),
        None => format!("cd {CLONE} && exec bash .ci/run"),
    };
    let mut cmd = Command::new("setpriv");
    cmd.args(["--pdeathsig", "KILL", "--", "unshare", "--mount", "--pid", "--fork", "--kill-child"])
        .args(["--propagation", "private", "sh", "-c", NAMESPACE_SCRIPT, "sh"])
        .arg(&r)
        .arg(&run_dir)
        .arg(&rustup)
        .arg(&cargo_bin)
        .args(["/usr/bin/env", "-i"])
        .args(environment())
        .args(["/bin/bash", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let log_path = dir.join("ci.log");
    let mut log = std::fs::File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let _ = writeln!(log, "ci --fresh: HEAD {head}, root {}, {}", tar.display(), command.unwrap_or("bash .ci/run"));
    let ran = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("failed to run setpriv/unshare: {e}"))?;
    let copied = match child.stdout.take() {
        Some(out) => tee(out, &mut log),
        None => Ok(()),
    };
    let status = child.wait().map_err(|e| e.to_string())?;
    copied?;
    let what = command.map_or_else(|| ".ci/run".to_string(), |c| format!("`{c}`"));
    let secs = start.elapsed().as_secs();
    let verdict = if status.success() {
        format!("ci --fresh: passed in {secs} s ({what}: {} s)", ran.elapsed().as_secs())
    } else {
        format!("ci --fresh: failed in {secs} s ({what}: {status}); log: {}", log_path.display())
    };
    let _ = writeln!(log, "{verdict}");
    if status.success() {
        println!("{verdict}");
        Ok(())
    } else {
        Err(verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_under_a_directory_are_found_with_escaped_names() {
        let info = "22 1 8:1 / / rw - ext4 /dev/vda rw\n\
                    90 22 0:5 / /work/t/fresh/run/root/dev rw - devtmpfs udev rw\n\
                    91 22 0:6 / /work/t/fresh/run\\040x/root rw - tmpfs t rw\n\
                    92 22 0:7 / /work/t/fresh/running rw - tmpfs t rw\n";
        assert_eq!(mounts_under(info, Path::new("/work/t/fresh/run")), [PathBuf::from("/work/t/fresh/run/root/dev")]);
        assert_eq!(mounts_under(info, Path::new("/work/t/fresh/run x")), [PathBuf::from("/work/t/fresh/run x/root")]);
        assert!(mounts_under(info, Path::new("/elsewhere")).is_empty());
    }

    #[test]
    fn the_root_is_rebuilt_when_its_packages_or_mirror_change() {
        let base = root_key(PACKAGES, &[]).unwrap();
        assert_eq!(base, root_key(PACKAGES, &[]).unwrap());
        let mut more = PACKAGES.to_vec();
        more.push("libnl-3-200");
        assert_ne!(base, root_key(&more, &[]).unwrap());
        let f = std::env::temp_dir().join(format!("xtask-fresh-key-{}", std::process::id()));
        std::fs::write(&f, "Acquire::http::Proxy \"http://a:3142\";\n").unwrap();
        let with_a = root_key(PACKAGES, std::slice::from_ref(&f)).unwrap();
        std::fs::write(&f, "Acquire::http::Proxy \"http://b:3142\";\n").unwrap();
        let with_b = root_key(PACKAGES, std::slice::from_ref(&f)).unwrap();
        let _ = std::fs::remove_file(&f);
        assert!(with_a != base && with_a != with_b);
        assert!(sets_mirror_access("Acquire::Check-Valid-Until \"false\";"));
        assert!(sets_mirror_access("Acquire::http { Proxy \"http://127.0.0.1:3142\"; };"));
        assert!(!sets_mirror_access("// Acquire::http::Proxy \"x\";\nAcquire::Languages \"none\";"));
    }
}

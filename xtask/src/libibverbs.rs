//! `cargo xtask libibverbs`: links `mlx5-ibverbs` into `target/libibverbs/libibverbs.so.1` with rdma-core 44's
//! version nodes and checks its exports. `cargo xtask verbs-apps`: runs Debian's unmodified verbs programs on it
//! (two processes joined by the simulated wire on 127.0.0.1) and checks what they print.

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::vfio_test::wait_until;

mod mpi;
pub mod rdmacm;

/// Every default-version export of Debian bookworm's libibverbs (`name VERSION` a line).
const SYMBOLS: &str = include_str!("../../host-linux/ibverbs/symbols.txt");

/// The version nodes in order; the public ones each inherit from the one before, as in rdma-core's
/// `libibverbs.map.in`.
const VERSIONS: &[&str] = &[
    "IBVERBS_1.0",
    "IBVERBS_1.1",
    "IBVERBS_1.5",
    "IBVERBS_1.6",
    "IBVERBS_1.7",
    "IBVERBS_1.8",
    "IBVERBS_1.9",
    "IBVERBS_1.10",
    "IBVERBS_1.11",
    "IBVERBS_1.12",
    "IBVERBS_1.13",
    "IBVERBS_1.14",
    "IBVERBS_PRIVATE_34",
];

/// The Debian packages the programs come from, with the libraries perftest and pyverbs need (downloaded and
/// unpacked, never installed; the unpacked real libibverbs comes after ours in the search path). pyverbs'
/// modules link libpython3.11, which a machine with only python3 lacks.
const DEBS: &[&str] = &[
    "ibverbs-utils",
    "perftest",
    "python3-pyverbs",
    "libpython3.11",
    "ibverbs-providers",
    "librdmacm1",
    "libpci3",
    "libibumad3",
    "libnl-3-200",
    "libnl-route-3-200",
];

/// The programs' directory and the library search path to run them with.
struct Programs {
    bin: PathBuf,
    path: String,
    /// pyverbs' `dist-packages` and rdma-core's Python tests (`.../tests`, some files gzip-compressed).
    pyverbs: PathBuf,
    tests: PathBuf,
}

fn symbols() -> BTreeSet<(String, String)> {
    SYMBOLS.lines().filter_map(|l| l.split_once(' ')).map(|(n, v)| (n.to_string(), v.to_string())).collect()
}

/// The exports of our own, outside rdma-core's table (`name VERSION`): the GSI QP the drop-in librdmacm asks
/// for (libibverbs has no such QP type).
const PRIVATE: &[(&str, &str)] = &[("mlx5_rs_create_gsi_qp", "MLX5_RS_PRIVATE_1")];

/// The linker version script: one node per version, everything not listed local.
fn version_script() -> String {
    let syms = symbols();
    let mut out = String::new();
    for (i, v) in VERSIONS.iter().enumerate() {
        out.push_str(&format!("{v} {{\n  global:\n"));
        for (n, _) in syms.iter().filter(|(_, sv)| sv == v) {
            out.push_str(&format!("    {n};\n"));
        }
        if i == 0 {
            out.push_str("  local: *;\n");
        }
        match i {
            0 => out.push_str("};\n"),
            _ if v.starts_with("IBVERBS_PRIVATE") => out.push_str("};\n"),
            _ => out.push_str(&format!("}} {};\n", VERSIONS[i - 1])),
        }
    }
    for (n, v) in PRIVATE {
        out.push_str(&format!("{v} {{\n  global:\n    {n};\n}};\n"));
    }
    out
}

pub(crate) fn run(cmd: &mut Command) -> Result<Output, String> {
    let out = cmd.output().map_err(|e| format!("failed to run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(out)
}

/// The default-version dynamic exports of an ELF shared object, as `readelf` lists them.
fn exports(lib: &Path) -> Result<BTreeSet<(String, String)>, String> {
    let out = run(Command::new("readelf").args(["--dyn-syms", "-W"]).arg(lib))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut set = BTreeSet::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Num: Value Size Type Bind Vis Ndx Name
        if f.len() < 8 || f[6] == "UND" || f[6] == "ABS" || f[4] != "GLOBAL" {
            continue;
        }
        if let Some((name, ver)) = f[7].split_once("@@") {
            set.insert((name.to_string(), ver.to_string()));
        } else if !f[7].contains('@') {
            set.insert((f[7].to_string(), String::new()));
        }
    }
    Ok(set)
}

/// Builds the static library and links `libibverbs.so.1`; returns its directory.
pub fn build(root: &Path, release: bool) -> Result<PathBuf, String> {
    build_for(root, release, None)
}

/// A build of the library for another target: its Rust triple, the C compiler that links for it, and the cargo
/// target directory (the library goes to `libibverbs/` there).
pub struct Cross<'a> {
    pub triple: &'a str,
    pub cc: &'a str,
    pub target_dir: PathBuf,
}

/// [`build`], for `cross`'s target when given.
pub fn build_for(root: &Path, release: bool, cross: Option<&Cross<'_>>) -> Result<PathBuf, String> {
    let mut args = vec!["build", "-p", "mlx5-ibverbs", "--lib"];
    if release {
        args.push("--release");
    }
    if let Some(c) = cross {
        args.extend(["--target", c.triple]);
    }
    println!("$ cargo {}", args.join(" "));
    let mut cargo = Command::new("cargo");
    let target = match cross {
        Some(c) => {
            cargo.env("CARGO_TARGET_DIR", &c.target_dir);
            c.target_dir.clone()
        }
        None => std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from),
    };
    let status = cargo.args(&args).current_dir(root).status().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err("building mlx5-ibverbs failed".into());
    }
    let out = cross.map_or_else(|| target.clone(), |c| target.join(c.triple));
    let archive = out.join(if release { "release" } else { "debug" }).join("libmlx5_ibverbs.a");
    let dir = target.join("libibverbs");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let map = dir.join("libibverbs.map");
    std::fs::write(&map, version_script()).map_err(|e| e.to_string())?;
    let lib = dir.join("libibverbs.so.1");
    let mut cc = Command::new(cross.map_or("cc", |c| c.cc));
    cc.arg("-shared")
        .arg("-o")
        .arg(&lib)
        .arg("-Wl,--whole-archive")
        .arg(&archive)
        .arg("-Wl,--no-whole-archive")
        .arg(format!("-Wl,--version-script={}", map.display()))
        .args(["-Wl,-soname,libibverbs.so.1", "-Wl,-z,now", "-lgcc_s", "-lpthread", "-ldl", "-lm", "-lc"]);
    println!("$ {cc:?}");
    run(&mut cc)?;
    let link = dir.join("libibverbs.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("libibverbs.so.1", &link).map_err(|e| e.to_string())?;
    check_exports(&lib)?;
    Ok(dir)
}

/// The library's exports are exactly [`SYMBOLS`] (and the real library's, when it is installed).
fn check_exports(lib: &Path) -> Result<(), String> {
    let mut ours = exports(lib)?;
    for (n, v) in PRIVATE {
        if !ours.remove(&(n.to_string(), v.to_string())) {
            return Err(format!("the private export {n}@@{v} is missing"));
        }
    }
    let want = symbols();
    let extra: Vec<_> = ours.difference(&want).collect();
    let missing: Vec<_> = want.difference(&ours).collect();
    if !extra.is_empty() || !missing.is_empty() {
        return Err(format!("exports differ from rdma-core 44's: extra {extra:?}, missing {missing:?}"));
    }
    println!("exports: {} names, each at rdma-core 44's version node", ours.len());
    let system = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1");
    if system.exists() {
        let real = exports(system)?;
        if real != want {
            return Err(format!(
                "the installed {} differs from the recorded table: {:?}",
                system.display(),
                real.symmetric_difference(&want).collect::<Vec<_>>()
            ));
        }
        println!("exports: identical to the installed {}", system.display());
    }
    Ok(())
}

/// `cargo xtask libibverbs [--debug]`.
pub fn run_libibverbs(root: &Path, args: &[String]) -> Result<(), String> {
    let release = !args.iter().any(|a| a == "--debug");
    let dir = build(root, release)?;
    println!(
        "built {}/libibverbs.so.1\n\nuse it with:\n  LD_LIBRARY_PATH={} ibv_devinfo -v\n\
         two processes over the simulated wire:\n  \
         MLX5_RS_DEVICES=sim:wire=listen:127.0.0.1:18600 LD_LIBRARY_PATH={0} ibv_rc_pingpong -g 0\n  \
         MLX5_RS_DEVICES=sim:host=1:wire=connect:127.0.0.1:18600 LD_LIBRARY_PATH={0} ibv_rc_pingpong -g 0 127.0.0.1",
        dir.display(),
        dir.display()
    );
    Ok(())
}

/// Where Debian's programs are: `/usr/bin` when ibverbs-utils, perftest and pyverbs are installed with every
/// library they need, else the packages downloaded with `apt-get download` and unpacked under
/// `target/libibverbs/debs`, whose libraries must then all be found (so a half-installed host hides nothing).
fn programs(lib: &Path) -> Result<Programs, String> {
    let system = Path::new("/");
    let have = |root: &Path| {
        ["usr/bin/ibv_rc_pingpong", "usr/bin/ib_write_bw", "usr/share/doc/rdma-core/tests/run_tests.py"]
            .iter()
            .all(|p| root.join(p).exists())
            && root.join("usr/lib/python3/dist-packages/pyverbs").exists()
    };
    let at = |root: &Path, path: String| Programs {
        bin: root.join("usr/bin"),
        path,
        pyverbs: root.join("usr/lib/python3/dist-packages"),
        tests: root.join("usr/share/doc/rdma-core/tests"),
    };
    if have(system) {
        let p = at(system, lib.display().to_string());
        let missing = unresolved(&p)?;
        if missing.is_empty() {
            return Ok(p);
        }
        println!("the installed verbs programs lack {}: using Debian's packages instead", missing.join(", "));
    }
    let debs = lib.join("debs");
    let root = debs.join("root");
    if !have(&root) {
        std::fs::create_dir_all(&debs).map_err(|e| e.to_string())?;
        apt_download(DEBS, &debs)?;
        for e in std::fs::read_dir(&debs).map_err(|e| e.to_string())? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.extension().is_some_and(|x| x == "deb") {
                run(Command::new("dpkg").arg("-x").arg(&p).arg(&root))?;
            }
        }
    }
    let p = at(&root, search_path(lib, &root));
    let missing = unresolved(&p)?;
    if !missing.is_empty() {
        return Err(format!(
            "Debian's verbs programs unpacked under {} still lack {} (a package missing from DEBS?)",
            root.display(),
            missing.join(", ")
        ));
    }
    Ok(p)
}

/// `apt-get download` into `dir`, with one `apt-get update` when the first attempt fails (a new machine may have
/// no package lists yet).
pub(crate) fn apt_download(pkgs: &[&str], dir: &Path) -> Result<(), String> {
    println!("$ apt-get download {}", pkgs.join(" "));
    let download = || {
        let mut c = Command::new("apt-get");
        c.args(["download", "-q"]).args(pkgs).current_dir(dir);
        c
    };
    let first = download().output().map_err(|e| format!("failed to run apt-get: {e}"))?;
    if first.status.success() {
        return Ok(());
    }
    println!("apt-get download failed ({}); $ apt-get update", String::from_utf8_lossy(&first.stderr).trim());
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(&mut download()).map(drop)
}

/// The libraries the loader cannot find for the programs the parts run and pyverbs' extension modules, with
/// the programs' search path (`name (needed by program)` each).
fn unresolved(p: &Programs) -> Result<Vec<String>, String> {
    let mut objects: Vec<PathBuf> = ["ibv_rc_pingpong", "ib_write_bw"].iter().map(|b| p.bin.join(b)).collect();
    let pyverbs = p.pyverbs.join("pyverbs");
    for e in std::fs::read_dir(&pyverbs).map_err(|e| format!("{}: {e}", pyverbs.display()))?.flatten() {
        if e.path().extension().is_some_and(|x| x == "so") {
            objects.push(e.path());
        }
    }
    let mut missing = Vec::new();
    for o in &objects {
        let name = o.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        for lib in missing_libraries(o, &p.path)? {
            missing.push(format!("{lib} (needed by {name})"));
        }
    }
    Ok(missing)
}

/// The shared libraries `ldd` reports "not found" for `object` with `ld_path` as `LD_LIBRARY_PATH`.
fn missing_libraries(object: &Path, ld_path: &str) -> Result<Vec<String>, String> {
    let out = Command::new("ldd")
        .arg(object)
        .env("LD_LIBRARY_PATH", ld_path)
        .env_remove("LD_PRELOAD")
        .output()
        .map_err(|e| format!("failed to run ldd: {e}"))?;
    // ldd exits non-zero when a library is missing, so its status says nothing more than its lines.
    let text = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_suffix("=> not found"))
        .map(|name| name.trim().to_string())
        .collect();
    if missing.is_empty() && !out.status.success() {
        return Err(format!("ldd {}: {}", object.display(), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(missing)
}

/// The programs' library search path: the drop-in's directory, then every directory of the unpacked packages
/// that holds a shared library (`lib*.so*`). Packages do not agree on one: libnl's go to `lib/x86_64-linux-gnu`,
/// rdma-core's to `usr/lib/x86_64-linux-gnu`. The loader's own directories come first, in its order.
fn search_path(lib: &Path, root: &Path) -> String {
    const LOADER_ORDER: &[&str] = &["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib"];
    let mut dirs = Vec::new();
    library_dirs(root, &mut dirs, 0);
    let rank = |d: &PathBuf| LOADER_ORDER.iter().position(|o| root.join(o) == *d).unwrap_or(LOADER_ORDER.len());
    dirs.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
    let mut path = lib.display().to_string();
    for d in dirs {
        path.push(':');
        path.push_str(&d.display().to_string());
    }
    path
}

/// Adds `dir` and its subdirectories that hold a shared library to `out` (symbolic links to directories are not
/// followed; an unpacked package tree is a few levels deep, the bound keeps a link loop or a stray tree finite).
fn library_dirs(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut holds = false;
    for e in entries.flatten() {
        let Ok(kind) = e.file_type() else { continue };
        let name = e.file_name();
        let name = name.to_string_lossy();
        if kind.is_dir() && depth < 8 {
            library_dirs(&e.path(), out, depth + 1);
        } else if !kind.is_dir() && name.starts_with("lib") && name.contains(".so") {
            holds = true;
        }
    }
    if holds {
        out.push(dir.to_path_buf());
    }
}

/// A program run with the library and a device configuration.
fn app(p: &Programs, name: &str, devices: &str) -> Command {
    let mut c = Command::new(p.bin.join(name));
    on_dropin(&mut c, &p.path, devices);
    c
}

/// Makes `c` load the drop-in library from `ld_path` (and nothing preloaded) and see the devices `devices`
/// (`MLX5_RS_DEVICES`).
pub(crate) fn on_dropin<'c>(c: &'c mut Command, ld_path: impl AsRef<OsStr>, devices: &str) -> &'c mut Command {
    c.env("LD_LIBRARY_PATH", ld_path).env("MLX5_RS_DEVICES", devices).env_remove("LD_PRELOAD")
}

/// Waits for a child with a deadline, killing it when the deadline passes.
pub(crate) fn wait(mut child: Child, limit: Duration, what: &str) -> Result<Output, String> {
    if wait_until(&mut child, Instant::now() + limit, Duration::from_millis(50))?.is_some() {
        return child.wait_with_output().map_err(|e| e.to_string());
    }
    let _ = child.kill();
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    Err(format!(
        "{what}: no exit after {limit:?}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

/// The program succeeded, the loader did not complain, and its output holds each needle (compared with runs of
/// white space collapsed to one space).
pub(crate) fn expect(out: &Output, what: &str, needles: &[&str]) -> Result<(), String> {
    let text = String::from_utf8_lossy(&out.stdout);
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return Err(format!("{what} failed ({}):\nstdout:\n{text}\nstderr:\n{err}", out.status));
    }
    if err.contains("no version information") {
        return Err(format!("{what}: the loader complained about versioning:\n{err}"));
    }
    for n in needles {
        if !flat.contains(n) {
            return Err(format!("{what}: expected {n:?} in its output:\n{text}\nstderr:\n{err}"));
        }
    }
    println!("{what}: ok");
    Ok(())
}

/// Waits until a TCP socket listens on `port` (read from `/proc/net/tcp` and `tcp6`, so nothing connects to
/// it), or `limit` passes.
pub(crate) fn wait_listening(port: u16, limit: Duration) {
    let start = Instant::now();
    let needle = format!(":{port:04X} ");
    while start.elapsed() < limit {
        // The calling thread's namespace (a thread of `private_net` has its own).
        let listening = ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"].iter().any(|f| {
            std::fs::read_to_string(f).is_ok_and(|t| {
                // local_address rem_address st: LISTEN is 0A.
                t.lines().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() > 3 && format!("{} ", f[1]).ends_with(&needle) && f[3] == "0A"
                })
            })
        });
        if listening {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server and a client of one of the pingpong programs, each with its own simulated device, joined by the
/// simulated wire; `port` is the programs' own TCP port, `wire` the wire's.
fn pingpong(p: &Programs, link: &str, prog: &str, args: &[&str], port: u16, done: [&[&str]; 2]) -> Result<(), String> {
    match pingpong_once(p, link, prog, args, port, done) {
        // RC retries run on real time: on a heavily loaded host a simulated peer can be starved past the
        // program's ACK timeout (rc_pingpong's is fixed at 67 ms x 7). Such a run is repeated once, and said so.
        Err(e) if e.contains("retry counter exceeded") || e.contains("Failed status 12") => {
            println!("{prog}: RC retries exhausted (loaded host?); running it again once");
            pingpong_once(p, link, prog, args, port + 200, done)
        }
        r => r,
    }
}

fn pingpong_once(
    p: &Programs,
    link: &str,
    prog: &str,
    args: &[&str],
    port: u16,
    done: [&[&str]; 2],
) -> Result<(), String> {
    let what = format!("{prog} {} (sim{link})", args.join(" "));
    let port_s = port.to_string();
    let wire = port + 100;
    let server = app(p, prog, &format!("sim{link}:wire=listen:127.0.0.1:{wire}"))
        .args(args)
        .args(["-p", &port_s])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    // The server opens its device (and the wire's listener) before it listens on its own port; the client
    // connects once, so it starts only when the server listens.
    wait_listening(port, Duration::from_secs(60));
    let client = app(p, prog, &format!("sim{link}:host=1:wire=connect:127.0.0.1:{wire}"))
        .args(args)
        .args(["-p", &port_s, "127.0.0.1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let limit = Duration::from_secs(120);
    let c = wait(client, limit, &format!("{what} (client)"));
    // A failed client leaves the server waiting for a peer: stop it and report the client.
    let s = match &c {
        Ok(out) if !out.status.success() => {
            wait(server, Duration::from_secs(5), &format!("{what} (server)")).map_err(|_| "killed".to_string())
        }
        _ => wait(server, limit, &format!("{what} (server)")),
    };
    let c = c?;
    expect(&c, &format!("{what} (client)"), done[1])?;
    let s = s?;
    expect(&s, &format!("{what} (server)"), done[0])?;
    Ok(())
}

/// `MLX5_RS_FAULTS`: the server's device leaves the bus 2.5 s into a long ping-pong; the program must see its
/// outstanding work requests flushed (and exit with its error), as it would on hardware.
fn fault_injection(p: &Programs) -> Result<(), String> {
    let (port, wire) = ("18580", 18680);
    let args = ["-g", "0", "-n", "100000000", "-p", port];
    let server = app(p, "ibv_rc_pingpong", &format!("sim:wire=listen:127.0.0.1:{wire}"))
        .env("MLX5_RS_FAULTS", "device_gone@2500")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    wait_listening(18580, Duration::from_secs(60));
    let mut client = app(p, "ibv_rc_pingpong", &format!("sim:host=1:wire=connect:127.0.0.1:{wire}"))
        .args(args)
        .arg("127.0.0.1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let s = wait(server, Duration::from_secs(60), "ibv_rc_pingpong with device_gone (server)");
    // The client waits for a peer that is gone, as it would on hardware: it is stopped here.
    let _ = client.kill();
    let _ = client.wait();
    let s = s?;
    let err = String::from_utf8_lossy(&s.stderr);
    if s.status.success() || !err.contains("Work Request Flushed Error (5)") {
        return Err(format!("device_gone: expected a flushed completion and a failed exit, got {}:\n{err}", s.status));
    }
    println!("ibv_rc_pingpong with MLX5_RS_FAULTS=device_gone@2500: flushed completion reported: ok");
    port_events(p)
}

/// `MLX5_RS_FAULTS=port_down@..,port_up@..`: `ibv_asyncwatch` (which prints async events until killed) sees the
/// link go down and come back, as a pulled and replugged cable shows on hardware.
fn port_events(p: &Programs) -> Result<(), String> {
    let mut c = app(p, "ibv_asyncwatch", "sim")
        .env("MLX5_RS_FAULTS", "port_down@300,port_up@600")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_secs(3));
    let _ = c.kill();
    let out = c.wait_with_output().map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    let want = ["event_type IBV_EVENT_PORT_ERR (10), port 1", "event_type IBV_EVENT_PORT_ACTIVE (9), port 1"];
    let at: Vec<Option<usize>> = want.iter().map(|w| text.find(w)).collect();
    match at[..] {
        [Some(down), Some(up)] if down < up => {
            println!("ibv_asyncwatch with MLX5_RS_FAULTS=port_down@300,port_up@600: PORT_ERR then PORT_ACTIVE: ok");
            Ok(())
        }
        _ => Err(format!(
            "ibv_asyncwatch: expected PORT_ERR then PORT_ACTIVE:\n{text}{}",
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// rdma-core's Python tests as Debian ships them, with the system python3, on one simulated device: every
/// test passes or skips (a feature the library reports unsupported); none fails or errors.
fn python_suite(p: &Programs, lib: &Path) -> Result<(), String> {
    // A copy, decompressed: the shipped directory holds some modules gzip-compressed.
    let dir = lib.join("pytests");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    run(Command::new("cp").arg("-r").arg(&p.tests).arg(&dir))?;
    run(Command::new("sh").arg("-c").arg("gunzip -f tests/*.gz").current_dir(&dir))?;
    let child = Command::new("/usr/bin/python3")
        .args(["tests/run_tests.py", "--dev", "mlx5_0", "-v"])
        .current_dir(&dir)
        .env("PYTHONPATH", &p.pyverbs)
        .env("LD_LIBRARY_PATH", &p.path)
        .env("MLX5_RS_DEVICES", "sim")
        .env_remove("LD_PRELOAD")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("python3: {e}"))?;
    let out = wait(child, Duration::from_secs(900), "rdma-core Python tests")?;
    // unittest reports on stderr.
    let err = String::from_utf8_lossy(&out.stderr);
    let ran = err.lines().find(|l| l.starts_with("Ran ")).unwrap_or("Ran ? tests");
    let verdict = err.lines().rev().find(|l| l.starts_with("OK") || l.starts_with("FAILED")).unwrap_or("?");
    if !out.status.success() || !verdict.starts_with("OK") {
        let bad: Vec<&str> = err.lines().filter(|l| l.starts_with("ERROR:") || l.starts_with("FAIL:")).collect();
        return Err(format!("rdma-core Python tests: {ran}, {verdict}\n{}", bad.join("\n")));
    }
    println!("rdma-core Python tests: {ran}, {verdict}: ok");
    Ok(())
}

/// The struct-layout test of `mlx5-ibverbs` against `<infiniband/verbs.h>`: the system's when libibverbs-dev is
/// installed, else Debian's package unpacked next to the library.
fn abi_test(root: &Path, lib: &Path) -> Result<(), String> {
    let include = if Path::new("/usr/include/infiniband/verbs.h").exists() {
        PathBuf::from("/usr/include")
    } else {
        let dev = lib.join("debs/dev");
        if !dev.join("usr/include/infiniband/verbs.h").exists() {
            std::fs::create_dir_all(&dev).map_err(|e| e.to_string())?;
            apt_download(&["libibverbs-dev"], &dev)?;
            for e in std::fs::read_dir(&dev).map_err(|e| e.to_string())? {
                let p = e.map_err(|e| e.to_string())?.path();
                if p.extension().is_some_and(|x| x == "deb") {
                    run(Command::new("dpkg").arg("-x").arg(&p).arg(&dev))?;
                }
            }
        }
        dev.join("usr/include")
    };
    let args = ["test", "-p", "mlx5-ibverbs-abi", "--lib", "tests::abi_matches_the_verbs_header"];
    println!("$ MLX5_IBVERBS_INCLUDE={} cargo {}", include.display(), args.join(" "));
    let out = run(Command::new("cargo").args(args).env("MLX5_IBVERBS_INCLUDE", &include).current_dir(root))?;
    if String::from_utf8_lossy(&out.stdout).contains("SKIPPED")
        || String::from_utf8_lossy(&out.stderr).contains("SKIPPED")
    {
        return Err("the layout test did not find <infiniband/verbs.h>".into());
    }
    println!("struct layouts against {}/infiniband/verbs.h: ok", include.display());
    Ok(())
}

/// The Debian packages the `ibverbs` crate's build needs (its `ibverbs-sys` configures rdma-core 55 with cmake
/// and runs bindgen on its headers).
const CRATE_BUILD_DEBS: &[&str] = &["cmake", "libclang-dev", "libnl-3-dev", "libnl-route-3-dev", "pkg-config"];

/// A Rust program written against the `ibverbs` crate (`host-linux/ibverbs/rust-app`, not a workspace member)
/// links this libibverbs and runs its ping-pong on RoCE and on InfiniBand.
fn ibverbs_crate(root: &Path, lib: &Path) -> Result<(), String> {
    // Asked of dpkg, package by package: a CI machine with some `llvm-config` but no libclang once passed a
    // program check and then failed in bindgen.
    let need: Vec<&str> = CRATE_BUILD_DEBS.iter().copied().filter(|p| !crate::uml::installed(p)).collect();
    if !need.is_empty() {
        crate::vfio_test::apt_install(&need)?;
    }
    let app = root.join("host-linux/ibverbs/rust-app");
    let target = lib.join("rust-app");
    let build = |extra: Option<&Path>| {
        let mut c = Command::new("cargo");
        c.args(["build", "--release", "--manifest-path"])
            .arg(app.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", &target)
            // Link against this library (ibverbs-sys points the linker at a build directory it does not fill).
            .env("RUSTFLAGS", format!("-L {}", lib.display()));
        if let Some(inc) = extra {
            // ibverbs-sys looks for rdma-core's generated headers one directory off; give bindgen the right one.
            c.env("BINDGEN_EXTRA_CLANG_ARGS", format!("-I{}", inc.display()));
        }
        c.output().map_err(|e| e.to_string())
    };
    println!("$ cargo build --release --manifest-path {}", app.join("Cargo.toml").display());
    let mut out = build(None)?;
    if !out.status.success() {
        let inc = find_file(&target.join("release/build"), "verbs_api.h")
            .and_then(|p| p.parent()?.parent().map(Path::to_path_buf))
            .ok_or_else(|| format!("building the ibverbs crate failed:\n{}", String::from_utf8_lossy(&out.stderr)))?;
        out = build(Some(&inc))?;
    }
    if !out.status.success() {
        return Err(format!("building the ibverbs crate failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    let exe = target.join("release/ibverbs-crate-pingpong");
    for devices in ["sim", "sim:link=ib"] {
        let mut c = Command::new(&exe);
        c.env("LD_LIBRARY_PATH", lib).env("MLX5_RS_DEVICES", devices).stdout(Stdio::piped()).stderr(Stdio::piped());
        let child = c.spawn().map_err(|e| e.to_string())?;
        let out = wait(child, Duration::from_secs(120), "ibverbs crate ping-pong")?;
        expect(&out, &format!("ibverbs crate ping-pong ({devices})"), &["1000 ping-pongs", "every payload checked"])?;
    }
    Ok(())
}

/// The first file named `name` under `dir` (depth-first).
fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_file(&p, name) {
                return Some(f);
            }
        } else if p.file_name().is_some_and(|n| n == name) {
            return Some(p);
        }
    }
    None
}

/// What every part of `verbs-apps` runs with: the repository, the built library and Debian's programs.
pub struct Apps<'a> {
    root: &'a Path,
    lib: PathBuf,
    p: Programs,
    /// Built with `--release` (the drop-in librdmacm is built the same way).
    release: bool,
}

/// One part of `verbs-apps`.
pub type Part = fn(&Apps<'_>) -> Result<(), String>;

/// The parts of `verbs-apps`, in the order they run; `--only PART` runs one.
pub const PARTS: &[(&str, Part)] = &[
    ("devinfo", |a| devinfo(&a.p)),
    ("pingpong", |a| pingpongs(&a.p)),
    ("perftest", |a| perftest(&a.p)),
    ("faults", |a| fault_injection(&a.p)),
    ("python", |a| python_suite(&a.p, &a.lib)),
    ("abi", |a| abi_test(a.root, &a.lib)),
    ("crate", |a| ibverbs_crate(a.root, &a.lib)),
    ("qperf", |a| qperf(a, &peers(&a.lib)?)),
    ("ucx", |a| ucx(&peers(&a.lib)?)),
    ("rdmacm", rdmacm::rdmacm_part),
    ("mpi", |a| mpi::run(&a.lib)),
];

/// `cargo xtask verbs-apps [--debug] [--only PART]`: Debian's programs on the library.
pub fn run_verbs_apps(root: &Path, args: &[String]) -> Result<(), String> {
    let release = !args.iter().any(|a| a == "--debug");
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1));
    let lib = build(root, release)?;
    let p = programs(&lib)?;
    println!("programs from {}", p.bin.display());
    let apps = Apps { root, lib, p, release };
    for (name, run_part) in PARTS {
        if only.is_none_or(|o| o == name) {
            run_part(&apps)?;
        }
    }
    println!("verbs-apps: {}", only.map_or("all programs ran".to_string(), |o| format!("{o} ran")));
    Ok(())
}

/// `ibv_devices` and `ibv_devinfo` on RoCE and InfiniBand.
fn devinfo(p: &Programs) -> Result<(), String> {
    let out = app(p, "ibv_devices", "sim").output().map_err(|e| e.to_string())?;
    expect(&out, "ibv_devices", &["mlx5_0 b8cef603"])?;
    let out = app(p, "ibv_devinfo", "sim").arg("-v").output().map_err(|e| e.to_string())?;
    expect(
        &out,
        "ibv_devinfo -v",
        &[
            "hca_id: mlx5_0",
            "transport: InfiniBand (0)",
            "fw_ver: 16.35.2000",
            "vendor_part_id: 4119",
            "state: PORT_ACTIVE (4)",
            "active_mtu: 1024 (3)",
            "link_layer: Ethernet",
            "GID[ 0]: fe80:0000:0000:0000:bace:f6ff:fe12:3456, RoCE v1",
            "GID[ 1]: fe80::bace:f6ff:fe12:3456, RoCE v2",
            "GID[ 3]: ::ffff:192.168.1.10, RoCE v2",
        ],
    )?;
    let out = app(p, "ibv_devinfo", "sim:link=ib").output().map_err(|e| e.to_string())?;
    expect(&out, "ibv_devinfo (InfiniBand)", &["link_layer: InfiniBand", "state: PORT_ACTIVE (4)", "port_lid: 1"])
}

/// rdma-core's ping-pong programs, RoCE and InfiniBand.
fn pingpongs(p: &Programs) -> Result<(), String> {
    // (link, program, arguments): RoCE needs `-g` (a GRH), InfiniBand addresses by LID.
    let runs: &[(&str, &str, &[&str])] = &[
        ("", "ibv_rc_pingpong", &["-g", "0", "-n", "1000", "-c"]),
        ("", "ibv_rc_pingpong", &["-g", "0", "-n", "1000", "-s", "1", "-c"]),
        ("", "ibv_rc_pingpong", &["-g", "0", "-n", "1000", "-s", "65536", "-e", "-c"]),
        ("", "ibv_rc_pingpong", &["-g", "1", "-n", "200", "-N", "-c"]),
        ("", "ibv_rc_pingpong", &["-g", "0", "-n", "200", "-t", "-c"]),
        (":link=ib", "ibv_rc_pingpong", &["-n", "1000", "-c"]),
        (":link=ib", "ibv_rc_pingpong", &["-n", "1000", "-s", "65536", "-e", "-c"]),
        ("", "ibv_uc_pingpong", &["-g", "0", "-n", "500", "-c"]),
        (":link=ib", "ibv_uc_pingpong", &["-n", "500", "-c", "-e"]),
        ("", "ibv_ud_pingpong", &["-g", "0", "-n", "500", "-c"]),
        (":link=ib", "ibv_ud_pingpong", &["-n", "500", "-c", "-e"]),
        ("", "ibv_srq_pingpong", &["-g", "0", "-n", "500", "-c"]),
        ("", "ibv_srq_pingpong", &["-g", "0", "-n", "200", "-e"]),
    ];
    let done: &[&str] = &["bytes in", "iters in"];
    for (i, (link, prog, args)) in runs.iter().enumerate() {
        pingpong(p, link, prog, args, 18515 + i as u16, [done, done])?;
    }
    Ok(())
}

/// perftest's bandwidth and latency tests.
fn perftest(p: &Programs) -> Result<(), String> {
    // perftest picks its GID itself: the IPv4-mapped RoCE v2 one (index 3), which the simulated wire delivers
    // to the port that holds it; one run names the RoCE v2 link-local GID with `-x 1` instead. ConnectX-5's part
    // id turns its ibv_wr_* API on. `-u 20` (4 s ACK timeout instead of 67 ms) keeps a simulated wire on a loaded
    // machine from exhausting RC retries.
    let perf: &[(&str, &[&str], &str, &str)] = &[
        ("ib_write_bw", &["-u", "20", "-n", "200"], "65536 200", "GID index : 3"),
        ("ib_write_bw", &["-x", "1", "-u", "20", "-n", "200"], "65536 200", "GID index : 1"),
        ("ib_write_bw", &["-u", "20", "-n", "200", "--use_old_post_send"], "65536 200", "GID index : 3"),
        ("ib_read_bw", &["-u", "20", "-n", "200"], "65536 200", "GID index : 3"),
        ("ib_send_bw", &["-u", "20", "-n", "200"], "65536 200", "GID index : 3"),
        ("ib_atomic_bw", &["-u", "20", "-n", "200"], "8 200", "GID index : 3"),
        ("ib_send_lat", &["-u", "20", "-n", "200"], "2 200", "GID index : 3"),
        ("ib_write_lat", &["-u", "20", "-n", "200"], "2 200", "GID index : 3"),
        ("ib_read_lat", &["-u", "20", "-n", "200"], "2 200", "GID index : 3"),
        ("ib_write_lat", &["-u", "20", "-n", "10", "-a"], "8388608 10", "GID index : 3"),
        ("ib_read_bw", &["-u", "20", "-n", "10", "-a", "--use_old_post_send"], "8388608 10", "GID index : 3"),
    ];
    for (i, (prog, args, row, gid)) in perf.iter().enumerate() {
        // The client prints the result table (`#bytes #iterations ...` rows); the server only has to succeed.
        pingpong(p, "", prog, args, 18540 + i as u16, [&[], &["#bytes", row, gid]])?;
    }
    Ok(())
}

/// The Debian packages of the peer programs (`qperf`, UCX's `ucx_perftest` with its transports and libraries),
/// downloaded and unpacked under `target/libibverbs/peers` (never installed) when they are not there yet.
const PEER_DEBS: &[&str] = &[
    "qperf",
    "ucx-utils",
    "libucx0",
    "libnuma1",
    "librdmacm1",
    "ibverbs-providers",
    "libnl-3-200",
    "libnl-route-3-200",
];

/// The peer programs' directory and the library search path to run them with (the drop-in first).
struct Peers {
    bin: PathBuf,
    path: String,
}

/// `qperf` and `ucx_perftest` from Debian's packages, with every library they and UCX's IB transports need.
fn peers(lib: &Path) -> Result<Peers, String> {
    let dir = lib.join("peers");
    let root = dir.join("root");
    // UCX loads its transports from `ucx/` next to libucs, so the IB module is found without UCX_MODULE_DIR.
    let objects = ["usr/bin/qperf", "usr/bin/ucx_perftest", "usr/lib/x86_64-linux-gnu/ucx/libuct_ib.so.0"];
    if !objects.iter().all(|o| root.join(o).exists()) {
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        apt_download(PEER_DEBS, &dir)?;
        for e in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.extension().is_some_and(|x| x == "deb") {
                run(Command::new("dpkg").arg("-x").arg(&p).arg(&root))?;
            }
        }
    }
    let path = search_path(lib, &root);
    for o in objects {
        let missing = missing_libraries(&root.join(o), &path)?;
        if !missing.is_empty() {
            return Err(format!("{o} unpacked under {} lacks {} (PEER_DEBS?)", root.display(), missing.join(", ")));
        }
    }
    Ok(Peers { bin: root.join("usr/bin"), path })
}

/// Every RC, UC and UD test of qperf 0.4.11 (its XRC tests need XRC, which the library answers EOPNOTSUPP).
const QPERF_TESTS: &[&str] = &[
    "rc_bi_bw",
    "rc_bw",
    "rc_compare_swap_mr",
    "rc_fetch_add_mr",
    "rc_lat",
    "rc_rdma_read_bw",
    "rc_rdma_read_lat",
    "rc_rdma_write_bw",
    "rc_rdma_write_lat",
    "rc_rdma_write_poll_lat",
    "uc_bi_bw",
    "uc_bw",
    "uc_lat",
    "uc_rdma_write_bw",
    "uc_rdma_write_lat",
    "uc_rdma_write_poll_lat",
    "ud_bi_bw",
    "ud_bw",
    "ud_lat",
    "ver_rc_compare_swap",
    "ver_rc_fetch_add",
];

/// How a qperf client reaches its server: the library path, the server's name and qperf's own options.
struct QperfWay<'a> {
    /// `LD_LIBRARY_PATH`: the drop-in libibverbs (and for `-cm1` the drop-in librdmacm) first.
    path: &'a str,
    /// The name the client gives qperf: its control connection and, with `-cm1`, rdma_cm's address.
    server: &'a str,
    /// Options before the tests (`-cm1`).
    opts: &'a [&'a str],
}

/// A qperf server and one client run of `tests`, each process with its own simulated device, joined by the
/// simulated wire. qperf's server forks a child per test, which opens the device (and the wire's listener)
/// while the client opens its own: the connecting end waits for the listener. Returns the client's output.
fn qperf_run(
    p: &Peers,
    way: &QperfWay<'_>,
    link: &str,
    port: u16,
    secs: &str,
    tests: &[&str],
) -> Result<(Output, Output), String> {
    let wire = port + 100;
    let port_s = port.to_string();
    let qperf = p.bin.join("qperf");
    let mut server = Command::new(&qperf);
    on_dropin(&mut server, way.path, &format!("sim{link}:wire=listen:127.0.0.1:{wire}"));
    let server = server
        .args(["-lp", &port_s])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("qperf: {e}"))?;
    wait_listening(port, Duration::from_secs(30));
    let mut client = Command::new(&qperf);
    on_dropin(&mut client, way.path, &format!("sim{link}:host=1:wire=connect:127.0.0.1:{wire}"));
    let client = client
        .args(["-lp", &port_s, way.server, "-t", secs])
        .args(way.opts)
        .args(tests)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("qperf: {e}"))?;
    let limit = Duration::from_secs(10 + 5 * tests.len() as u64);
    let c = wait(client, limit, &format!("qperf {} (client)", tests.join(" ")));
    // qperf's server serves until it is stopped.
    let mut server = server;
    let _ = server.kill();
    let s = server.wait_with_output().map_err(|e| e.to_string())?;
    Ok((c?, s))
}

/// The figures qperf printed for `test` (`name = value unit` lines under `test:`), each checked positive.
fn qperf_figures(out: &str, test: &str) -> Result<Vec<(String, String)>, String> {
    let header = format!("{test}:");
    let mut lines = out.lines().skip_while(|l| l.trim() != header).skip(1);
    let mut figures = Vec::new();
    for l in lines.by_ref().take_while(|l| l.starts_with(' ')) {
        let Some((name, rest)) = l.split_once('=') else { continue };
        let mut words = rest.split_whitespace();
        let value: Option<f64> = words.next().and_then(|v| v.parse().ok());
        match value {
            Some(v) if v > 0.0 => {
                figures.push((name.trim().to_string(), format!("{v} {}", words.next().unwrap_or(""))))
            }
            _ => return Err(format!("qperf {test}: {:?} is not a positive figure", l.trim())),
        }
    }
    if figures.is_empty() {
        return Err(format!("qperf {test}: no figures in its output:\n{out}"));
    }
    Ok(figures)
}

/// Debian's qperf, unmodified, between two processes on the simulated wire, one client run per test (a client's
/// close destroys what qperf left, its PD freed before its MR, and unplugs its wire; its next open connects afresh,
/// but that open can still reach the previous server child while it exits).
///
/// InfiniBand: every RC, UC and UD test, each printing positive figures (the verifying atomics check their values).
///
/// RoCE: qperf 0.4.11 addresses its peer by LID without a GRH unless it connects with rdma_cm (`-cm1`), and it
/// takes rdma_cm for RC tests only (`rd_params` clears `use_cm` for UC and UD and warns "-cm1 set but not used";
/// it has no option for a GID). So its RC tests run with `-cm1` through the drop-in librdmacm as well, and its UC
/// and UD tests are refused with EINVAL as a ConnectX refuses them (mlx5_ib's `mlx5_set_path`, rdma-core's
/// `mlx5_create_ah`), which the part checks. With `-cm1` qperf hands rdma_cm the name of its control connection,
/// so the server's name must be both a TCP address and the server's RoCE address (192.168.1.10): the RoCE runs
/// happen in a private network namespace whose loopback holds the simulated hosts' addresses.
fn qperf(a: &Apps<'_>, p: &Peers) -> Result<(), String> {
    let ib = QperfWay { path: &p.path, server: "127.0.0.1", opts: &[] };
    let start = Instant::now();
    let mut shown = Vec::new();
    for (i, t) in QPERF_TESTS.iter().enumerate() {
        let (c, s) = qperf_run(p, &ib, ":link=ib", 18950 + i as u16, "1", &[t])?;
        shown.push(qperf_checked(&c, &s, t, "InfiniBand")?);
    }
    println!(
        "qperf, {} tests over the simulated InfiniBand wire: ok ({:.1} s)\n  {}",
        QPERF_TESTS.len(),
        start.elapsed().as_secs_f64(),
        shown.join(", ")
    );
    let cm = rdmacm::build(a.root, a.release, &a.lib)?;
    let path = format!("{}:{}", cm.display(), p.path);
    // rdma_cm's service IDs, MADs and the namespace's ports are private to the thread's namespace.
    std::thread::scope(|s| s.spawn(|| qperf_roce(p, &path)).join()).map_err(|_| "qperf RoCE thread panicked")?
}

/// qperf's RC tests with `-cm1` over RoCE, then the UC and UD tests' refusal, in a network namespace of this
/// thread (and the processes it starts) whose loopback has the simulated hosts' addresses.
fn qperf_roce(p: &Peers, path: &str) -> Result<(), String> {
    private_net(&[SIM_HOST_IPS[0], SIM_HOST_IPS[1]])?;
    let cm = QperfWay { path, server: SIM_HOST_IPS[0], opts: &["-cm1"] };
    let start = Instant::now();
    let mut shown = Vec::new();
    let rc: Vec<&str> =
        QPERF_TESTS.iter().copied().filter(|t| !t.starts_with("uc_") && !t.starts_with("ud_")).collect();
    for (i, t) in rc.iter().enumerate() {
        let (c, s) = qperf_run(p, &cm, "", 19000 + i as u16, "1", &[t])?;
        shown.push(qperf_checked(&c, &s, t, "RoCE, -cm1")?);
    }
    println!(
        "qperf -cm1, {} RC tests over the simulated RoCE wire (drop-in librdmacm): ok ({:.1} s)\n  {}",
        rc.len(),
        start.elapsed().as_secs_f64(),
        shown.join(", ")
    );
    // UC and UD: refused as on hardware, in the program's own words; with -cm1 qperf says it did not use it.
    let lid = QperfWay { path, server: SIM_HOST_IPS[0], opts: &[] };
    let runs = [
        ("rc_lat", &lid, "failed to modify QP to RTR"),
        ("ud_lat", &lid, "failed to create address handle"),
        ("uc_lat", &cm, "failed to modify QP to RTR"),
        ("ud_lat", &cm, "failed to create address handle"),
    ];
    for (i, (test, way, refusal)) in runs.iter().enumerate() {
        let (c, s) = qperf_run(p, way, "", 19050 + i as u16, "1", &[test])?;
        let all = format!(
            "{}{}{}",
            String::from_utf8_lossy(&c.stdout),
            String::from_utf8_lossy(&c.stderr),
            String::from_utf8_lossy(&s.stderr)
        );
        let unused = format!("-cm1 set but not used in test {test}");
        let cm_said = way.opts.is_empty() || all.contains(&unused);
        if c.status.success() || !all.contains(refusal) || !cm_said {
            return Err(format!(
                "qperf {test} {} on RoCE: expected {refusal:?} (no GRH){}, got ({}):\n{all}",
                way.opts.join(" "),
                if way.opts.is_empty() { String::new() } else { format!(" after {unused:?}") },
                c.status
            ));
        }
    }
    println!(
        "qperf on RoCE: LID-only RC, UC and UD (qperf takes -cm1 for RC only) refused with EINVAL, as a ConnectX \
         refuses them: ok"
    );
    Ok(())
}

/// A client's run of one test: it and the server succeeded with nothing on stderr; the test's first figure.
fn qperf_checked(c: &Output, s: &Output, t: &str, how: &str) -> Result<String, String> {
    let text = String::from_utf8_lossy(&c.stdout).into_owned();
    let errs = format!("{}{}", String::from_utf8_lossy(&c.stderr), String::from_utf8_lossy(&s.stderr));
    if !c.status.success() || !errs.trim().is_empty() {
        return Err(format!("qperf {t} ({how}) failed ({}):\n{text}\nstderr:\n{errs}", c.status));
    }
    let f = qperf_figures(&text, t)?;
    Ok(format!("{t} {} {}", f[0].0, f[0].1))
}

/// The simulated hosts' IPv4 addresses (`SimConfig::next_host`: host 0, host 1), which the drop-in librdmacm
/// resolves to their ports.
const SIM_HOST_IPS: [&str; 2] = ["192.168.1.10", "192.168.1.11"];

/// Moves the calling thread into a new network namespace (the processes it starts follow) with its loopback up
/// and holding `addrs`, so a program's TCP connection to a simulated host's address stays in the namespace.
/// Needs root (`CAP_SYS_ADMIN`); `ip` comes from iproute2, installed when missing.
fn private_net(addrs: &[&str]) -> Result<(), String> {
    extern "C" {
        fn unshare(flags: std::ffi::c_int) -> std::ffi::c_int;
    }
    const CLONE_NEWNET: std::ffi::c_int = 0x4000_0000;
    if !crate::vfio_test::have("ip") {
        crate::vfio_test::apt_install(&["iproute2"])?;
    }
    // SAFETY: unshare takes flags only; CLONE_NEWNET affects the calling thread alone (allowed in a threaded
    // process), and this thread serves nothing else.
    if unsafe { unshare(CLONE_NEWNET) } != 0 {
        return Err(format!(
            "qperf over RoCE needs root: a network namespace (unshare CLONE_NEWNET: {})",
            std::io::Error::last_os_error()
        ));
    }
    run(Command::new("ip").args(["link", "set", "lo", "up"]))?;
    for a in addrs {
        run(Command::new("ip").args(["addr", "add", &format!("{a}/32"), "dev", "lo"]))?;
    }
    Ok(())
}

/// UCX looks a device up as `/dev/infiniband/<dev_name>` and skips it unless that is a character device it may
/// read and write (`uct_ib_device_is_accessible`, UCX 1.13); the library has no kernel device to offer there. This
/// script gives the program a private mount namespace whose `/dev/infiniband/uverbs0` is a character-device
/// stand-in (`/dev/null` bound there: UCX only checks it, the library never opens it), then runs it. A machine
/// without RDMA hardware has no `/dev/infiniband` to mount on, so an empty one is made (as a host with an RDMA
/// device has). The namespace's mounts are made private before anything is mounted, so nothing reaches the host;
/// where `/` is no mount point (a chroot, as `ci --fresh` runs in, already in a private namespace of its own)
/// there is nothing to make private.
pub(crate) const UVERBS_STANDIN: &str = "{ [ -d /dev/infiniband ] || mkdir /dev/infiniband; } && \
     { ! mountpoint -q / || mount --make-rprivate /; } && \
     mount -t tmpfs -o size=16k,mode=755 mlx5-rs /dev/infiniband && \
     touch /dev/infiniband/uverbs0 && mount --bind /dev/null /dev/infiniband/uverbs0 && exec \"$@\"";

/// `prog args` on the drop-in with `devices`, inside the stand-in's mount namespace.
fn ucx_app(p: &Peers, prog: &str, devices: &str, args: &[&str]) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "unchanged", "sh", "-c", UVERBS_STANDIN, "sh"])
        .arg(p.bin.join(prog))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    on_dropin(&mut c, &p.path, devices);
    c
}

/// One `ucx_perftest` run of `test` on transport `tl` between a server and a client process, each with its own
/// simulated device, joined by the simulated wire. Both must exit 0 with nothing logged at WARN or above
/// (a clean teardown); returns the client's `Final:` row (iterations, latency and rate figures).
fn ucx_perftest(p: &Peers, tl: &str, test: &str, iters: &str, port: u16) -> Result<Vec<f64>, String> {
    ucx_perftest_on(p, &UcxTest { tl, test, args: &[], iters, warmup: "20" }, port, None)
}

/// One `ucx_perftest` test: a UCT test names its transport (`-x tl`); a UCP test (`tl` empty) lets UCP pick
/// among the transports `UCX_TLS` allows. `args` are the client's further options (`-D`, `-s`).
struct UcxTest<'a> {
    tl: &'a str,
    test: &'a str,
    args: &'a [&'a str],
    iters: &'a str,
    warmup: &'a str,
}

/// The transports a UCP test may use: the drop-in's verbs ones only (RC for the data, UD for UCP's wire-up),
/// so a run that passes went through the simulated device, never shared memory or TCP.
const UCP_TLS: &str = "rc_verbs,ud_verbs";

/// On which fabric a [`ucx_perftest_on`] runs: the VDE switch in a runtime directory, with Ethernet or
/// InfiniBand ports.
#[derive(Clone, Copy)]
struct Vde<'a> {
    dir: &'a Path,
    ib: bool,
}

/// [`ucx_perftest`], both processes on the VDE fabric whose default switch lives in `vde` (`wire=vde`, the
/// first process starting it) instead of the TCP link: no listener, no connector, no `host=`.
fn ucx_perftest_on(p: &Peers, t: &UcxTest, port: u16, vde: Option<Vde>) -> Result<Vec<f64>, String> {
    let UcxTest { tl, test, iters, .. } = *t;
    let what = format!(
        "ucx_perftest {}-t {test} {}-n {iters}{}",
        if tl.is_empty() { format!("(UCX_TLS={UCP_TLS}) ") } else { format!("-x {tl} ") },
        t.args.iter().map(|a| format!("{a} ")).collect::<String>(),
        match vde {
            Some(Vde { ib: true, .. }) => " (InfiniBand on VDE)",
            Some(_) => " (VDE)",
            None => "",
        }
    );
    let (port_s, wire) = (port.to_string(), port + 100);
    let (server_dev, client_dev) = match vde {
        Some(Vde { ib: false, .. }) => ("sim:wire=vde".to_string(), "sim:wire=vde".to_string()),
        Some(Vde { ib: true, .. }) => ("sim:link=ib:wire=vde".to_string(), "sim:link=ib:wire=vde".to_string()),
        None => (format!("sim:wire=listen:127.0.0.1:{wire}"), format!("sim:host=1:wire=connect:127.0.0.1:{wire}")),
    };
    let app = |devices: &str, args: &[&str]| {
        let mut c = ucx_app(p, "ucx_perftest", devices, args);
        if let Some(v) = vde {
            c.env("XDG_RUNTIME_DIR", v.dir);
        }
        if tl.is_empty() {
            c.env("UCX_TLS", UCP_TLS).env("UCX_NET_DEVICES", "mlx5_0:1");
        }
        c
    };
    let mut server_args = vec!["-p", &port_s];
    let mut client_args = vec!["127.0.0.1", "-p", &port_s];
    if !tl.is_empty() {
        server_args.extend(["-d", "mlx5_0:1", "-x", tl]);
        client_args.extend(["-d", "mlx5_0:1", "-x", tl]);
    }
    client_args.extend(["-t", test, "-n", iters, "-w", t.warmup]);
    client_args.extend(t.args);
    let server = app(&server_dev, &server_args).spawn().map_err(|e| format!("{what}: {e}"))?;
    wait_listening(port, Duration::from_secs(30));
    // Both open their device after their own TCP handshake: on the TCP link the connecting end waits for the
    // listener; on the fabric there is no order.
    let client = app(&client_dev, &client_args).spawn().map_err(|e| format!("{what}: {e}"))?;
    let c = wait(client, Duration::from_secs(30), &format!("{what} (client)"));
    let s = wait(server, Duration::from_secs(if c.is_ok() { 30 } else { 5 }), &format!("{what} (server)"));
    let (c, s) = (c?, s?);
    let text = String::from_utf8_lossy(&c.stdout).into_owned();
    let logs = [&c, &s].iter().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).collect::<Vec<_>>();
    let noisy = |t: &str| {
        t.lines().any(|l| l.contains("UCX  ERROR") || l.contains("UCX  WARN") || l.contains("libibverbs(mlx5-rs)"))
    };
    if !c.status.success() || !s.status.success() || logs.iter().any(|l| noisy(l)) || noisy(&text) {
        return Err(format!(
            "{what}: client {}, server {}:\n{text}\nclient stderr:\n{}\nserver stderr:\n{}",
            c.status, s.status, logs[0], logs[1]
        ));
    }
    // `Final: ITERS p50 avg overall(lat us) avg overall(MB/s) avg overall(msg/s)`.
    let row: Vec<f64> = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Final:"))
        .map(|r| r.split_whitespace().filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    let want: f64 = iters.parse().unwrap_or(0.0);
    // The whole run's ("overall") latency and message rate positive and finite; the bandwidth of 8-byte messages
    // may print as 0.00 MB/s. The "avg" columns are the last report interval's, `nan` when it held no iteration
    // (seen on put_bw -D zcopy), so they are not checked (NaN is no failure of `<= 0.0`: hence `positive`).
    let positive = |v: f64| v.is_finite() && v > 0.0;
    if row.len() != 8 || row[0] != want || ![3, 7].iter().all(|&i| positive(row[i])) {
        return Err(format!("{what}: expected a Final row of {iters} iterations, latencies and rates:\n{text}"));
    }
    // Sized messages (`-s`) must show their bandwidth too.
    if t.args.contains(&"-s") && !positive(row[5]) {
        return Err(format!("{what}: expected a positive bandwidth in the Final row:\n{text}"));
    }
    Ok(row)
}

/// UCX's `ucx_perftest` over the drop-in between two processes on the simulated wire (RoCE): rc_verbs and
/// ud_verbs latency and bandwidth tests with real figures, then rc_verbs twenty times for a clean teardown
/// (both ends exit 0, nothing logged; an async event of a destroyed QP once crashed it), then on one VDE fabric
/// with UCT `put_bw` and `get` of 64 KiB zcopy (`-D zcopy`: RDMA WRITE and READ of registered memory) and UCP
/// `tag_lat`/`tag_bw` of 1 MiB added, then rc_verbs (with both zcopy tests), ud_verbs and UCP `tag_bw` between
/// two InfiniBand ports on that fabric.
fn ucx(p: &Peers) -> Result<(), String> {
    let start = Instant::now();
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|t| t.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")));
    if !root {
        return Err("ucx: needs root, for the private mount namespace that gives UCX its /dev/infiniband/uverbs0 \
                    character device (UCX skips a device without one)"
            .into());
    }
    let made = !Path::new("/dev/infiniband").exists();
    if made {
        // The namespace's mount point; removed again below.
        std::fs::create_dir("/dev/infiniband").map_err(|e| format!("ucx: /dev/infiniband: {e} (needs root)"))?;
    }
    let r = ucx_runs(p);
    if made {
        let _ = std::fs::remove_dir("/dev/infiniband");
    }
    r?;
    println!("ucx_perftest: ok ({:.1} s)", start.elapsed().as_secs_f64());
    Ok(())
}

fn ucx_runs(p: &Peers) -> Result<(), String> {
    let out = ucx_app(p, "ucx_info", "sim", &["-d"]).output().map_err(|e| format!("ucx_info: {e}"))?;
    expect(&out, "ucx_info -d", &["Memory domain: mlx5_0", "Transport: rc_verbs", "Transport: ud_verbs"])?;
    let runs = [
        ("rc_verbs", "put_lat", "1000"),
        ("rc_verbs", "am_lat", "1000"),
        ("rc_verbs", "put_bw", "1000"),
        ("rc_verbs", "am_bw", "1000"),
        ("ud_verbs", "am_lat", "1000"),
        ("ud_verbs", "am_bw", "1000"),
    ];
    for (i, (tl, test, n)) in runs.iter().enumerate() {
        let row = ucx_perftest(p, tl, test, n, 18910 + i as u16)?;
        println!(
            "ucx_perftest -x {tl} -t {test}: {n} iterations, {:.1} us, {:.2} MB/s, {:.0} msg/s: ok",
            row[3], row[5], row[7]
        );
    }
    for i in 0..20u16 {
        ucx_perftest(p, "rc_verbs", "am_lat", "200", 18920 + i)
            .map_err(|e| format!("rc_verbs teardown, run {} of 20: {e}", i + 1))?;
    }
    println!("ucx_perftest -x rc_verbs: 20 of 20 runs exit 0 with a clean teardown: ok");
    // The same program, both processes on one VDE fabric (the default switch of a private runtime directory).
    crate::vde::ensure_vde()?;
    let dir = std::env::temp_dir().join(format!("xtask-ucx-vde-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let r = (|| -> Result<(), String> {
        let t = |tl, test, args, iters, warmup| UcxTest { tl, test, args, iters, warmup };
        let runs = [
            t("rc_verbs", "am_lat", &[], "1000", "20"),
            t("rc_verbs", "put_bw", &[], "1000", "20"),
            // RDMA WRITE of 64 KiB from a registered buffer (UCT's put_zcopy).
            t("rc_verbs", "put_bw", &["-D", "zcopy", "-s", "65536"], "200", "20"),
            // RDMA READ of 64 KiB into a registered buffer (UCT's get_zcopy).
            t("rc_verbs", "get", &["-D", "zcopy", "-s", "65536"], "200", "20"),
            t("ud_verbs", "am_lat", &[], "1000", "20"),
            t("ud_verbs", "am_bw", &[], "1000", "20"),
            // UCP tag matching of 1 MiB messages: rendezvous, the data moved by RDMA over RC.
            t("", "tag_lat", &["-s", "1048576"], "20", "5"),
            t("", "tag_bw", &["-s", "1048576"], "20", "5"),
        ];
        // The same between two InfiniBand ports (by LID) on the same fabric.
        let ib_runs = [
            t("rc_verbs", "am_lat", &[], "1000", "20"),
            t("rc_verbs", "put_bw", &[], "1000", "20"),
            t("rc_verbs", "put_bw", &["-D", "zcopy", "-s", "65536"], "200", "20"),
            t("rc_verbs", "get", &["-D", "zcopy", "-s", "65536"], "200", "20"),
            t("ud_verbs", "am_lat", &[], "1000", "20"),
            t("", "tag_bw", &["-s", "1048576"], "20", "5"),
        ];
        let all = runs.iter().map(|r| (r, false)).chain(ib_runs.iter().map(|r| (r, true)));
        for (i, (run, ib)) in all.enumerate() {
            let started = Instant::now();
            let row = ucx_perftest_on(p, run, 18950 + i as u16, Some(Vde { dir: &dir, ib }))?;
            let mut label = if run.tl.is_empty() { "(UCP)".to_string() } else { format!("-x {}", run.tl) };
            for a in [&["-t", run.test][..], run.args].concat() {
                label.push(' ');
                label.push_str(a);
            }
            println!(
                "ucx_perftest {label} over VDE{}: {} iterations, {:.1} us, {:.2} MB/s: ok ({:.1} s)",
                if ib { " (InfiniBand)" } else { "" },
                run.iters,
                row[3],
                row[5],
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    })();
    if let Ok(pid) = std::fs::read_to_string(dir.join("mlx5-sim.pid")) {
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
    }
    let _ = std::fs::remove_dir_all(&dir);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory of this test process, emptied first.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn touch(root: &Path, file: &str) {
        let p = root.join(file);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }

    /// Issue 29: libnl-3-200 and libnl-route-3-200 unpack into `lib/x86_64-linux-gnu`, which was not on the
    /// programs' path, so perftest failed to load on a machine without libnl installed.
    #[test]
    fn every_library_directory_of_the_unpacked_packages_is_searched() {
        let root = scratch("libdirs");
        touch(&root, "lib/x86_64-linux-gnu/libnl-3.so.200.26.0");
        touch(&root, "usr/lib/x86_64-linux-gnu/librdmacm.so.1");
        touch(&root, "usr/lib/python3/dist-packages/pyverbs/device.cpython-311-x86_64-linux-gnu.so");
        touch(&root, "usr/bin/ib_write_bw");
        let path = search_path(Path::new("/dropin"), &root);
        let dirs: Vec<&str> = path.split(':').collect();
        let want = [
            "/dropin".to_string(),
            root.join("lib/x86_64-linux-gnu").display().to_string(),
            root.join("usr/lib/x86_64-linux-gnu").display().to_string(),
        ];
        assert_eq!(
            dirs, want,
            "the drop-in first, then each directory holding a shared library, in the loader's order"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Issue 29: a host with the programs installed but a library of theirs missing was taken as complete; the
    /// check names what the loader cannot find, and nothing once the library is on the path.
    #[test]
    fn a_program_whose_library_is_missing_is_reported() {
        let dir = scratch("ldd");
        std::fs::write(dir.join("stub.c"), "int xtask_stub(void) { return 7; }\n").unwrap();
        std::fs::write(dir.join("main.c"), "int xtask_stub(void);\nint main(void) { return xtask_stub(); }\n").unwrap();
        let cc = |args: &[&str]| {
            let ok = Command::new("cc").args(args).current_dir(&dir).status().unwrap();
            assert!(ok.success(), "cc {args:?}");
        };
        cc(&["-shared", "-fPIC", "-o", "libxtaskstub.so.1", "-Wl,-soname,libxtaskstub.so.1", "stub.c"]);
        std::fs::create_dir(dir.join("lib")).unwrap();
        std::os::unix::fs::symlink("../libxtaskstub.so.1", dir.join("lib/libxtaskstub.so")).unwrap();
        cc(&["-o", "prog", "main.c", "-Llib", "-lxtaskstub"]);
        let prog = dir.join("prog");
        assert_eq!(missing_libraries(&prog, "").unwrap(), ["libxtaskstub.so.1"]);
        assert!(missing_libraries(&prog, &dir.display().to_string()).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

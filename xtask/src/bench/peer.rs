//! `cargo xtask bench --peer`: the core's datapath calls side by side with rdma-core's mlx5 provider.
//!
//! rdma-core's source comes from the `ibverbs-sys` crate, which vendors it (fetched with `cargo fetch` from a
//! throwaway manifest under `target/peer/`). Its `providers/mlx5/qp.c` and `cq.c` are compiled with rdma-core's
//! own release flags (CMake `Release`: `-O2 -g -DNDEBUG`, `-std=gnu11`, `-D_GNU_SOURCE=`, `-fPIC` for the shared
//! provider) over an include tree laid out as its build lays it out, and linked with `xtask/peer/harness.c`,
//! which sets up a QP and CQ in plain memory as `mlx5-bench` does. `cq.c` is compiled a second time with the x86
//! read barrier (`lfence`) made a compiler barrier (the `nofence` figures). C and Rust then run interleaved, and
//! callgrind counts the instructions of one call on each side through the same kind of out-of-line wrapper.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};

/// The crate that vendors rdma-core, and the version whose tree the harness was written against.
const IBVERBS_SYS: &str = "ibverbs-sys";
const IBVERBS_SYS_VERSION: &str = "=0.3.2";

/// rdma-core's release flags for a provider (see the module documentation).
const RELEASE_FLAGS: [&str; 6] = ["-O2", "-g", "-DNDEBUG", "-std=gnu11", "-fPIC", "-D_GNU_SOURCE="];

/// Interleaved rounds of C and Rust, and timed windows per figure in each round. Every round starts each program
/// afresh, so each is one draw of the process's address layout, which moves some calls by up to a quarter on
/// this machine's CPUs (two modes a process keeps for its life; see BENCHMARKS.md): many short rounds, combined
/// by a trimmed mean, weigh the modes as programs meet them.
const ROUNDS: usize = 21;
const REPS: usize = 101;
/// Rounds dropped at each end before the mean (a burst of the shared host's load).
const TRIM: usize = 2;
/// Rounds of the threads and simulator-mode figures (each several seconds).
const SCALING_ROUNDS: usize = 5;

/// The operations compared: key suffix, `mlx5-peer count` / `mlx5-bench --cg` name, the wrapper callgrind
/// collects, and the work items (WQEs or CQEs) one counted call handles.
const OPS: [(&str, &str, &str, u64); 5] = [
    ("post_send_1", "post_send_1", "cg_post_send", 1),
    ("post_send_16", "post_send_16", "cg_post_send", 16),
    ("post_send_64", "post_send_64", "cg_post_send", 64),
    ("post_recv", "post_recv", "cg_post_recv", 16),
    ("poll_cq", "poll_cq", "cg_poll_cq", 1024),
];

fn run_ok(cmd: &mut Command, what: &str) -> Result<String, String> {
    let out = cmd.stderr(Stdio::piped()).output().map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo"))
}

/// The vendored rdma-core tree in the registry's unpacked sources, if `ibverbs-sys` was fetched.
fn find_rdma_core() -> Option<PathBuf> {
    let src = cargo_home().join("registry").join("src");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&src)
        .ok()?
        .flatten()
        .flat_map(|index| std::fs::read_dir(index.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("ibverbs-sys-0.3.2")))
        .map(|p| p.join("vendor").join("rdma-core"))
        .filter(|p| p.join("providers/mlx5/qp.c").is_file())
        .collect();
    found.sort();
    found.pop()
}

/// Finds rdma-core's tree, fetching `ibverbs-sys` through cargo (from a throwaway manifest) when it is missing.
fn rdma_core(work: &Path) -> Result<PathBuf, String> {
    if let Some(p) = find_rdma_core() {
        return Ok(p);
    }
    let dir = work.join("fetch");
    std::fs::create_dir_all(dir.join("src")).map_err(|e| e.to_string())?;
    let manifest = format!(
        "[package]\nname = \"peer-fetch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[dependencies]\n\
         {IBVERBS_SYS} = \"{IBVERBS_SYS_VERSION}\"\n\n[workspace]\n"
    );
    std::fs::write(dir.join("Cargo.toml"), manifest).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("src/lib.rs"), "").map_err(|e| e.to_string())?;
    eprintln!("$ cargo fetch ({IBVERBS_SYS} {IBVERBS_SYS_VERSION}, for rdma-core's source)");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run_ok(Command::new(cargo).arg("fetch").current_dir(&dir), "cargo fetch")?;
    find_rdma_core().ok_or_else(|| format!("{IBVERBS_SYS} was fetched but its vendor/rdma-core was not found"))
}

/// rdma-core's `buildlib/make_abi_structs.py`: each top-level struct of a kernel ABI header becomes a
/// `#define _STRUCT_name struct { ... }` so the provider can embed the kernel's layout in its own structs.
fn abi_structs(header: &str) -> String {
    let mut out = String::new();
    let mut depth: Option<i32> = None;
    for raw in header.lines() {
        let mut ln = raw.trim().to_string();
        // The script's two substitutions: a one-line block comment, then a line comment.
        if let (Some(a), Some(b)) = (ln.find("/*"), ln.rfind("*/")) {
            if b > a {
                ln.replace_range(a..b + 2, "");
            }
        }
        if let Some(a) = ln.find("//") {
            ln.truncate(a);
        }
        match depth {
            None => {
                if ln.starts_with("struct ") || ln.starts_with("union ") {
                    let mut w = ln.split_whitespace();
                    let (kind, name) = (w.next().unwrap_or(""), w.next().unwrap_or(""));
                    if w.next() == Some("{") {
                        out.push_str(&format!("#define _STRUCT_{name} {kind} {{ \\\n"));
                        depth = Some(0);
                    }
                }
            }
            Some(n) => {
                let closes = ln.starts_with('}') && ln.ends_with(';');
                if n == 0 && closes {
                    out.push_str(&ln[..ln.len() - 1]);
                    out.push_str("\n\n");
                    depth = None;
                    continue;
                }
                out.push_str(&ln);
                out.push_str(" \\\n");
                depth = Some(if ln == "struct {" || ln == "union {" {
                    n + 1
                } else if closes {
                    n - 1
                } else {
                    n
                });
            }
        }
    }
    out
}

fn link(src: &Path, dst: &Path) -> Result<(), String> {
    if dst.symlink_metadata().is_ok() {
        std::fs::remove_file(dst).map_err(|e| format!("{}: {e}", dst.display()))?;
    }
    std::os::unix::fs::symlink(src, dst).map_err(|e| format!("{}: {e}", dst.display()))
}

/// Lays out rdma-core's build include tree (`build/include` of its CMake build) under `work/include`, and the
/// no-fence variant of `util/udma_barrier.h` under `work/nofence`.
fn include_tree(rc: &Path, root: &Path, work: &Path) -> Result<(), String> {
    let inc = work.join("include");
    for d in ["infiniband", "kernel-abi", "valgrind", "util"] {
        std::fs::create_dir_all(inc.join(d)).map_err(|e| e.to_string())?;
    }
    link(&rc.join("ccan"), &inc.join("ccan"))?;
    link(&rc.join("kernel-headers/rdma"), &inc.join("rdma"))?;
    link(&rc.join("kernel-headers/linux"), &inc.join("linux"))?;
    for e in std::fs::read_dir(rc.join("util")).map_err(|e| e.to_string())?.flatten() {
        if e.path().extension().is_some_and(|x| x == "h") {
            link(&e.path(), &inc.join("util").join(e.file_name()))?;
        }
    }
    // publish_headers(infiniband ...) of libibverbs, the kernel headers and the mlx5 provider.
    let mut published: Vec<PathBuf> = std::fs::read_dir(rc.join("libibverbs"))
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    for f in [
        "kernel-headers/rdma/ib_user_ioctl_verbs.h",
        "kernel-headers/rdma/mlx5_user_ioctl_verbs.h",
        "providers/mlx5/mlx5dv.h",
        "providers/mlx5/mlx5_api.h",
    ] {
        published.push(rc.join(f));
    }
    for p in published {
        link(&p, &inc.join("infiniband").join(p.file_name().unwrap_or_default()))?;
    }
    for h in ["ib_user_verbs.h", "mlx5-abi.h"] {
        let text = std::fs::read_to_string(rc.join("kernel-headers/rdma").join(h)).map_err(|e| e.to_string())?;
        std::fs::write(inc.join("kernel-abi").join(h), abi_structs(&text)).map_err(|e| e.to_string())?;
    }
    // ENABLE_VALGRIND=0: rdma-core's own no-op annotations (its documented faster build).
    std::fs::copy(rc.join("buildlib/fixup-include/valgrind-memcheck.h"), inc.join("valgrind/memcheck.h"))
        .map_err(|e| e.to_string())?;
    std::fs::copy(root.join("xtask/peer/config.h"), inc.join("config.h")).map_err(|e| e.to_string())?;
    let barrier = std::fs::read_to_string(rc.join("util/udma_barrier.h")).map_err(|e| e.to_string())?;
    let lfence = "#define udma_from_device_barrier() asm volatile(\"lfence\" ::: \"memory\")";
    if barrier.matches(lfence).count() != 1 {
        return Err("rdma-core's util/udma_barrier.h no longer has the x86-64 lfence read barrier".into());
    }
    let nofence = barrier.replace(lfence, "#define udma_from_device_barrier() asm volatile(\"\" ::: \"memory\")");
    std::fs::create_dir_all(work.join("nofence/util")).map_err(|e| e.to_string())?;
    std::fs::write(work.join("nofence/util/udma_barrier.h"), nofence).map_err(|e| e.to_string())
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

fn compile(rc: &Path, work: &Path, src: &Path, obj: &str, nofence: bool) -> Result<PathBuf, String> {
    let out = work.join(obj);
    let mut c = Command::new(cc());
    c.args(RELEASE_FLAGS);
    if nofence {
        c.arg(format!("-I{}", work.join("nofence").display()));
    }
    c.arg(format!("-I{}", work.join("include").display()))
        .arg(format!("-I{}", rc.join("providers/mlx5").display()))
        .arg("-c")
        .arg(src)
        .arg("-o")
        .arg(&out);
    run_ok(&mut c, &format!("compiling {}", src.display()))?;
    Ok(out)
}

/// Builds `mlx5-peer` (rdma-core as built) and `mlx5-peer-nofence`; returns their paths.
fn build_peer(root: &Path) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let work = root.join("target/peer");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let rc = rdma_core(&work)?;
    eprintln!("xtask bench --peer: rdma-core from {}", rc.display());
    include_tree(&rc, root, &work)?;
    let mlx5 = rc.join("providers/mlx5");
    let qp = compile(&rc, &work, &mlx5.join("qp.c"), "qp.o", false)?;
    let cq = compile(&rc, &work, &mlx5.join("cq.c"), "cq.o", false)?;
    let cq_nf = compile(&rc, &work, &mlx5.join("cq.c"), "cq-nofence.o", true)?;
    let harness = compile(&rc, &work, &root.join("xtask/peer/harness.c"), "harness.o", false)?;
    let mut bins = Vec::new();
    for (name, cqo) in [("mlx5-peer", &cq), ("mlx5-peer-nofence", &cq_nf)] {
        let bin = work.join(name);
        let mut l = Command::new(cc());
        l.arg("-o").arg(&bin).arg(&harness).arg(&qp).arg(cqo).arg("-lpthread");
        run_ok(&mut l, &format!("linking {name}"))?;
        bins.push(bin);
    }
    let bench = build_bench(root)?;
    Ok((bins.remove(0), bins.remove(0), bench))
}

/// Debian bookworm's `dpkg-buildflags` for rdma-core (`DEB_BUILD_MAINT_OPTIONS=hardening=+all`): debhelper's
/// CMake build system hands CPPFLAGS to CMake inside CFLAGS.
const DEBIAN_CFLAGS: &str =
    "-g -O2 -fstack-protector-strong -Wformat -Werror=format-security -Wdate-time -D_FORTIFY_SOURCE=2";
const DEBIAN_LDFLAGS: &str = "-Wl,-z,relro -Wl,-z,now";

/// The two CMake builds: name, and `CMAKE_C_FLAGS_RELEASE` (which CMake puts after CFLAGS, so its `-O` wins).
/// `O2` is the Release flags rdma-core's `RDMA_BuildType` means to set (RelWithDebInfo's, `-O2 -g -DNDEBUG`);
/// `O3` is CMake's own Release default, which is what the build gets when that substitution does not happen.
const CMAKE_BUILDS: [(&str, &str); 2] = [("O2", "-O2 -g -DNDEBUG"), ("O3", "-O3 -DNDEBUG")];

/// Debian packages the CMake builds need, installed with apt-get when missing (cmake, ninja, and the libraries
/// rdma-core's configuration requires as Debian configures it).
fn cmake_packages() -> Result<(), String> {
    let nl = Command::new("pkg-config")
        .args(["--exists", "libnl-3.0", "libnl-route-3.0"])
        .status()
        .is_ok_and(|s| s.success());
    if crate::vfio_test::have("cmake") && crate::vfio_test::have("ninja") && nl {
        return Ok(());
    }
    crate::vfio_test::apt_install(&["cmake", "ninja-build", "pkg-config", "libnl-3-dev", "libnl-route-3-dev"])
}

/// rdma-core configured by its own CMake as `debian/rules` configures it (Ninja, `DISTRO_FLAVOUR=Debian`,
/// `CMAKE_BUILD_TYPE=Release`, static libraries, Debian's flags), with `release` as `CMAKE_C_FLAGS_RELEASE`,
/// and the mlx5 provider's `qp.c` and `cq.c` objects (as the shared provider builds them) and the util library
/// built. Returns the build directory.
fn cmake_build(rc: &Path, work: &Path, name: &str, release: &str) -> Result<PathBuf, String> {
    let dir = work.join(format!("cmake-{name}"));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    // Configured every run (seconds once the cache exists), so a change of flags always takes effect.
    {
        eprintln!("$ cmake -GNinja ... {} (CMAKE_C_FLAGS_RELEASE={release})", rc.display());
        let mut c = Command::new("cmake");
        c.args(["-GNinja", "-DDISTRO_FLAVOUR=Debian", "-DCMAKE_BUILD_TYPE=Release", "-DENABLE_STATIC=1"])
            // Neither is part of a provider: manual pages need pandoc, pyverbs Cython.
            .args(["-DNO_MAN_PAGES=1", "-DNO_PYVERBS=1"])
            .arg(format!("-DCMAKE_C_FLAGS_RELEASE={release}"))
            .arg(rc)
            .env("CFLAGS", DEBIAN_CFLAGS)
            .env("LDFLAGS", DEBIAN_LDFLAGS)
            .current_dir(&dir);
        run_ok(&mut c, "configuring rdma-core with cmake")?;
    }
    let mut n = Command::new("ninja");
    n.arg("-C").arg(&dir).args([
        "providers/mlx5/CMakeFiles/mlx5.dir/qp.c.o",
        "providers/mlx5/CMakeFiles/mlx5.dir/cq.c.o",
        "util/librdma_util_pic.a",
    ]);
    eprintln!("$ ninja -C {} (mlx5 qp.c, cq.c, util)", dir.display());
    run_ok(&mut n, "building rdma-core with ninja")?;
    Ok(dir)
}

/// `src` compiled with rdma-core's release flags against a CMake build's own include tree (its generated
/// `config.h`).
fn compile_cmake(rc: &Path, build: &Path, src: &Path, out: &Path) -> Result<(), String> {
    let mut c = Command::new(cc());
    c.args(RELEASE_FLAGS)
        .arg(format!("-I{}", build.join("include").display()))
        .arg(format!("-I{}", rc.join("providers/mlx5").display()))
        .arg("-c")
        .arg(src)
        .arg("-o")
        .arg(out);
    run_ok(&mut c, &format!("compiling {}", src.display())).map(drop)
}

/// Links `main` (an object) with a CMake build's provider objects and util library.
fn link_cmake(build: &Path, main: &Path, bin: &Path) -> Result<(), String> {
    let mut l = Command::new(cc());
    l.arg("-o")
        .arg(bin)
        .arg(main)
        .arg(build.join("providers/mlx5/CMakeFiles/mlx5.dir/qp.c.o"))
        .arg(build.join("providers/mlx5/CMakeFiles/mlx5.dir/cq.c.o"))
        .arg(build.join("util/librdma_util_pic.a"))
        .arg("-lpthread");
    run_ok(&mut l, &format!("linking {}", bin.display())).map(drop)
}

/// `mlx5-peer` over each CMake build: (name, binary), `-O2` first.
fn build_cmake_peers(root: &Path) -> Result<Vec<(String, PathBuf)>, String> {
    let work = root.join("target/peer");
    let rc = rdma_core(&work)?;
    cmake_packages()?;
    let mut out = Vec::new();
    for (name, release) in CMAKE_BUILDS {
        let build = cmake_build(&rc, &work, name, release)?;
        let obj = work.join(format!("harness-cmake-{name}.o"));
        compile_cmake(&rc, &build, &root.join("xtask/peer/harness.c"), &obj)?;
        let bin = work.join(format!("mlx5-peer-cmake-{name}"));
        link_cmake(&build, &obj, &bin)?;
        out.push((name.to_string(), bin));
    }
    Ok(out)
}

/// The C-ABI program (`xtask/peer/abi.c`) built twice: over rdma-core's provider (its `harness.c` set-up, the
/// context's ops filled) and over the drop-in `libibverbs.so.1`, both with rdma-core's `verbs.h` and release flags.
/// Returns (rdma-core's, the drop-in's).
fn build_abi(root: &Path) -> Result<(PathBuf, PathBuf), String> {
    let work = root.join("target/peer");
    let rc = rdma_core(&work)?;
    let abi_c = root.join("xtask/peer/abi.c");
    // rdma-core's side over its CMake -O2 build (what `build_cmake_peers` configured).
    let build = cmake_build(&rc, &work, CMAKE_BUILDS[0].0, CMAKE_BUILDS[0].1)?;
    let abi_rc = work.join("abi-rdma-core.o");
    compile_cmake(&rc, &build, &abi_c, &abi_rc)?;
    let rc_bin = work.join("abi-rdma-core");
    link_cmake(&build, &abi_rc, &rc_bin)?;
    // `cargo xtask libibverbs` in a child whose output goes to stderr: stdout carries only `--json`'s object.
    eprintln!("$ cargo xtask libibverbs");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut b = Command::new(cargo);
    b.args(["xtask", "libibverbs"]).current_dir(root).stdout(std::io::stderr());
    run_ok(&mut b, "building the drop-in libibverbs.so.1")?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let lib = target.join("libibverbs");
    let drop_bin = work.join("abi-dropin");
    let mut c = Command::new(cc());
    c.args(RELEASE_FLAGS)
        .arg("-DABI_DROPIN")
        .arg(format!("-I{}", work.join("include").display()))
        .arg(&abi_c)
        .arg("-o")
        .arg(&drop_bin)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-l:libibverbs.so.1");
    run_ok(&mut c, "building abi-dropin")?;
    Ok((rc_bin, drop_bin))
}

/// Runs the drop-in's ABI program: `what` is `post` (doorbells into memory) or `poll` (the simulator running).
fn abi_dropin(bin: &Path, what: &str, reps: &str, single_threaded: bool) -> Result<Map<String, Value>, String> {
    let mut c = Command::new(bin);
    c.args(["time", what, "0", reps]).env_remove("MLX5_RS_DEVICES").env_remove("MLX5_RS_LOG");
    // The drop-in reads rdma-core's variable as rdma-core does: `1` drops the queues' locks.
    if single_threaded {
        c.env("MLX5_SINGLE_THREADED", "1");
    } else {
        c.env_remove("MLX5_SINGLE_THREADED");
    }
    if what == "post" {
        c.env("MLX5_RS_SIM_DOORBELLS", "memory");
    } else {
        c.env_remove("MLX5_RS_SIM_DOORBELLS");
    }
    json_line(&run_ok(&mut c, "abi-dropin")?, "abi-dropin")
}

fn build_bench(root: &Path) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo build --release -p mlx5-bench");
    let mut c = Command::new(cargo);
    c.args(["build", "--release", "-p", "mlx5-bench"]).current_dir(root);
    run_ok(&mut c, "building mlx5-bench")?;
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    Ok(target.join("release/mlx5-bench"))
}

fn json_line(text: &str, what: &str) -> Result<Map<String, Value>, String> {
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or(format!("{what}: no JSON"))?;
    match serde_json::from_str(line) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(format!("{what}: invalid JSON")),
    }
}

fn f(m: &Map<String, Value>, k: &str) -> Result<f64, String> {
    m.get(k).and_then(Value::as_f64).ok_or(format!("missing figure {k}"))
}

/// The mean of `v` without its `TRIM` lowest and highest values.
fn trimmed_mean(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let kept = &v[TRIM.min(v.len() / 2)..v.len() - TRIM.min(v.len() / 2)];
    kept.iter().sum::<f64>() / kept.len() as f64
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Per figure, the medians of every round.
type Series = std::collections::BTreeMap<String, Vec<f64>>;

fn push(s: &mut Series, k: &str, v: f64) {
    s.entry(k.to_string()).or_default().push(v);
}

/// C (without and with its locks, and without the lfence) and Rust, `ROUNDS` times in turn.
fn timed(
    peer: &Path,
    nofence: &Path,
    bench: &Path,
    abi: &(PathBuf, PathBuf),
    cmake: &[(String, PathBuf)],
) -> Result<Series, String> {
    let mut s = Series::new();
    let reps = REPS.to_string();
    for round in 0..ROUNDS {
        eprintln!("xtask bench --peer: round {}/{ROUNDS}", round + 1);
        let c = json_line(&run_ok(Command::new(peer).args(["time", "0", &reps]), "mlx5-peer")?, "mlx5-peer")?;
        if c.get("checked") != Some(&Value::Bool(true)) {
            return Err("mlx5-peer did not confirm its path checks".into());
        }
        let rust = json_line(
            &run_ok(Command::new(bench).args(["--only", "datapath", "--json"]), "mlx5-bench")?,
            "mlx5-bench",
        )?;
        let locked = json_line(&run_ok(Command::new(peer).args(["time", "1", &reps]), "mlx5-peer")?, "mlx5-peer")?;
        let nf = json_line(&run_ok(Command::new(nofence).args(["time", "0", &reps]), "mlx5-peer")?, "mlx5-peer")?;
        for (key, _, _, _) in OPS {
            push(&mut s, &format!("c_{key}"), f(&c, &format!("{key}_ns"))?);
            push(&mut s, &format!("c_locked_{key}"), f(&locked, &format!("{key}_ns"))?);
        }
        push(&mut s, "c_nofence_poll_cq", f(&nf, "poll_cq_ns")?);
        for (name, bin) in cmake {
            let m = json_line(&run_ok(Command::new(bin).args(["time", "0", &reps]), "mlx5-peer")?, "mlx5-peer")?;
            if m.get("checked") != Some(&Value::Bool(true)) {
                return Err("mlx5-peer (CMake build) did not confirm its path checks".into());
            }
            for (key, _, _, _) in OPS {
                push(&mut s, &format!("c_cmake_{}_{key}", name.to_lowercase()), f(&m, &format!("{key}_ns"))?);
            }
        }
        let b = rust.get("post_send_batches").and_then(Value::as_object).ok_or("mlx5-bench: no post_send_batches")?;
        for batch in ["1", "16", "64"] {
            let ns = b.get(batch).and_then(|v| v["ns"].as_f64()).ok_or("mlx5-bench: no post_send ns")?;
            push(&mut s, &format!("rust_post_send_{batch}"), ns);
        }
        push(&mut s, "rust_post_recv", f(&rust, "post_recv_ns")?);
        push(&mut s, "rust_poll_cq", f(&rust, "poll_cq_ns")?);
        // The C ABI: rdma-core's (without and with its locks), then the drop-in's, in the same round.
        let (abi_rc, abi_drop) = abi;
        let rc0 = json_line(&run_ok(Command::new(abi_rc).args(["time", "all", "0", &reps]), "abi")?, "abi")?;
        let rc1 = json_line(&run_ok(Command::new(abi_rc).args(["time", "all", "1", &reps]), "abi")?, "abi")?;
        let dp = abi_dropin(abi_drop, "post", &reps, true)?;
        let dq = abi_dropin(abi_drop, "poll", &reps, true)?;
        let dpl = abi_dropin(abi_drop, "post", &reps, false)?;
        let dql = abi_dropin(abi_drop, "poll", &reps, false)?;
        for (key, _, _, _) in OPS {
            let k = format!("{key}_ns");
            push(&mut s, &format!("abi_c_{key}"), f(&rc0, &k)?);
            push(&mut s, &format!("abi_c_locked_{key}"), f(&rc1, &k)?);
            push(&mut s, &format!("abi_dropin_{key}"), f(if key == "poll_cq" { &dq } else { &dp }, &k)?);
            push(&mut s, &format!("abi_dropin_locked_{key}"), f(if key == "poll_cq" { &dql } else { &dpl }, &k)?);
        }
    }
    Ok(s)
}

/// Instructions of `calls` calls of `op` through `wrapper`, counted by callgrind, or `None` without valgrind.
fn callgrind(work: &Path, cmd: &[String], wrapper: &str) -> Result<Option<u64>, String> {
    callgrind_env(work, cmd, wrapper, &[])
}

/// [`callgrind`] with `env` set for the program.
fn callgrind_env(work: &Path, cmd: &[String], wrapper: &str, env: &[(&str, &str)]) -> Result<Option<u64>, String> {
    if Command::new("valgrind").arg("--version").output().is_err() {
        return Ok(None);
    }
    let out = work.join("callgrind.out");
    let mut c = Command::new("valgrind");
    c.args(["--tool=callgrind", "--collect-atstart=no"])
        .arg(format!("--toggle-collect=*{wrapper}"))
        .arg(format!("--callgrind-out-file={}", out.display()))
        .args(cmd)
        .envs(env.iter().copied())
        .stdout(Stdio::null());
    run_ok(&mut c, "valgrind")?;
    let text = std::fs::read_to_string(&out).map_err(|e| e.to_string())?;
    let total = text
        .lines()
        .find_map(|l| l.strip_prefix("summary:"))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .ok_or("callgrind wrote no summary")?;
    Ok(Some(total))
}

/// Instructions per work item through the C ABI, rdma-core's and the drop-in's (`cg_abi_*`).
fn abi_instructions(root: &Path, abi: &(PathBuf, PathBuf)) -> Result<Map<String, Value>, String> {
    let work = root.join("target/peer");
    let mut m = Map::new();
    for (key, op, wrapper, items) in OPS {
        // Whole rings, so the drop-in's untimed retire (commands to the simulator) falls outside the counted calls.
        let calls: u64 = if key == "poll_cq" { 4 } else { 4 * 1024 / items };
        let per_item = (calls * items) as f64;
        let wrapper = wrapper.replace("cg_", "cg_abi_");
        for (side, bin) in [("c", &abi.0), ("dropin", &abi.1), ("dropin_locked", &abi.1)] {
            let cmd = vec![bin.display().to_string(), "count".into(), "0".into(), calls.to_string(), op.into()];
            let mut env = Vec::new();
            if side != "c" && key != "poll_cq" {
                env.push(("MLX5_RS_SIM_DOORBELLS", "memory"));
            }
            if side == "dropin" {
                env.push(("MLX5_SINGLE_THREADED", "1"));
            }
            let env = &env[..];
            if let Some(n) = callgrind_env(&work, &cmd, &wrapper, env)? {
                m.insert(format!("abi_{side}_{key}_instr"), json!((n as f64 / per_item * 10.0).round() / 10.0));
            }
        }
    }
    Ok(m)
}

/// Instructions per work item (WQE or CQE) for each operation, C and Rust.
fn instructions(root: &Path, peer: &Path, bench: &Path) -> Result<Map<String, Value>, String> {
    let work = root.join("target/peer");
    let mut m = Map::new();
    for (key, op, wrapper, items) in OPS {
        let calls: u64 = if key == "poll_cq" { 20 } else { 2000 };
        let per_item = (calls * items) as f64;
        let p = |s: &Path| s.display().to_string();
        let c_cmd = vec![p(peer), "count".into(), "0".into(), calls.to_string(), op.into()];
        let r_cmd = vec![p(bench), "--cg".into(), op.into(), calls.to_string()];
        let c = callgrind(&work, &c_cmd, wrapper)?;
        let r = callgrind(&work, &r_cmd, wrapper)?;
        if let (Some(c), Some(r)) = (c, r) {
            m.insert(format!("c_{key}_instr"), json!((c as f64 / per_item * 10.0).round() / 10.0));
            m.insert(format!("rust_{key}_instr"), json!((r as f64 / per_item * 10.0).round() / 10.0));
        }
    }
    Ok(m)
}

/// One figure of `mlx5-bench --only SECTION --json [--quick]`.
fn bench_figure(bench: &Path, section: &str, quick: bool, key: &str) -> Result<f64, String> {
    let mut c = Command::new(bench);
    c.args(["--only", section, "--json"]);
    if quick {
        c.arg("--quick");
    }
    f(&json_line(&run_ok(&mut c, "mlx5-bench")?, "mlx5-bench")?, key)
}

/// The threads bench (2 threads over 1, each with its own QP and CQ) and the threaded simulator's rate over the
/// in-line one, each the median of `SCALING_ROUNDS` runs (the simulator's two modes run in turn).
fn scaling(bench: &Path) -> Result<Map<String, Value>, String> {
    let mut speedup = Vec::new();
    let mut speedup_cpu = Vec::new();
    let mut sim = Vec::new();
    for round in 0..SCALING_ROUNDS {
        eprintln!("xtask bench --peer: threads and simulator modes, round {}/{SCALING_ROUNDS}", round + 1);
        let mut c = Command::new(bench);
        c.args(["--only", "threads", "--json", "--quick"]);
        let t = json_line(&run_ok(&mut c, "mlx5-bench")?, "mlx5-bench")?;
        speedup.push(f(&t, "threads_2_speedup")?);
        speedup_cpu.push(f(&t, "threads_2_speedup_cpu")?);
        let inline = bench_figure(bench, "sim", true, "sim_sends_per_s")?;
        let threaded = bench_figure(bench, "sim-threaded", true, "sim_sends_per_s_threaded")?;
        sim.push(threaded / inline);
    }
    let range = |v: &[f64]| (v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(0.0, f64::max));
    let (s_lo, s_hi) = range(&speedup);
    let (m_lo, m_hi) = range(&sim);
    let mut m = Map::new();
    m.insert("threads_2_speedup".into(), json!(round3(median(&mut speedup))));
    m.insert("threads_2_speedup_range".into(), json!([round3(s_lo), round3(s_hi)]));
    let (c_lo, c_hi) = range(&speedup_cpu);
    m.insert("threads_2_speedup_cpu".into(), json!(round3(median(&mut speedup_cpu))));
    m.insert("threads_2_speedup_cpu_range".into(), json!([round3(c_lo), round3(c_hi)]));
    m.insert("sim_threaded_ratio".into(), json!(round3(median(&mut sim))));
    m.insert("sim_threaded_ratio_range".into(), json!([round3(m_lo), round3(m_hi)]));
    m.insert("load_average".into(), json!(load_average()));
    Ok(m)
}

/// The 1-minute load average, to say how busy the shared machine was.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// Runs the comparison; returns the figures (the `peer_*` keys the issue names and the details behind them).
pub fn run(root: &Path) -> Result<Map<String, Value>, String> {
    let (peer, nofence, bench) = build_peer(root)?;
    let cmake = build_cmake_peers(root)?;
    let abi = build_abi(root)?;
    let mut s = timed(&peer, &nofence, &bench, &abi, &cmake)?;
    let mut out = Map::new();
    let mut detail = Map::new();
    for (k, v) in s.iter_mut() {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(0.0, f64::max);
        let mean = trimmed_mean(v);
        let med = median(v);
        detail.insert(
            k.clone(),
            json!({ "mean_ns": round3(mean), "median_ns": round3(med), "min_ns": round3(lo), "max_ns": round3(hi) }),
        );
    }
    // Every ratio is of the rounds' trimmed means.
    let mean = |k: &str| detail[k]["mean_ns"].as_f64().unwrap_or(f64::NAN);
    for (key, _, _, _) in OPS {
        let rust = mean(&format!("rust_{key}"));
        // Against rdma-core as its CMake builds it (-O2, and -O3), and against the hand-made build of earlier runs.
        out.insert(format!("peer_{key}_ratio"), json!(round3(rust / mean(&format!("c_cmake_o2_{key}")))));
        out.insert(format!("peer_o3_{key}_ratio"), json!(round3(rust / mean(&format!("c_cmake_o3_{key}")))));
        out.insert(format!("peer_handmade_{key}_ratio"), json!(round3(rust / mean(&format!("c_{key}")))));
    }
    out.insert("peer_poll_cq_nofence_ratio".into(), json!(round3(mean("rust_poll_cq") / mean("c_nofence_poll_cq"))));
    for (key, _, _, _) in OPS {
        // Like with like: each side single-threaded (MLX5_SINGLE_THREADED=1, no lock), then each with its locks.
        // The core's Rust API takes no lock (the QP is `&mut`).
        let dropin = mean(&format!("abi_dropin_{key}"));
        let dropin_locked = mean(&format!("abi_dropin_locked_{key}"));
        out.insert(format!("abi_{key}_ratio"), json!(round3(dropin / mean(&format!("abi_c_{key}")))));
        out.insert(
            format!("abi_{key}_locked_ratio"),
            json!(round3(dropin_locked / mean(&format!("abi_c_locked_{key}")))),
        );
        out.insert(format!("abi_overhead_{key}"), json!(round3(dropin / mean(&format!("rust_{key}")))));
        out.insert(format!("abi_overhead_locked_{key}"), json!(round3(dropin_locked / mean(&format!("rust_{key}")))));
    }
    out.insert("abi_instructions".into(), Value::Object(abi_instructions(root, &abi)?));
    out.insert("peer_times".into(), Value::Object(detail));
    out.insert("peer_instructions".into(), Value::Object(instructions(root, &peer, &bench)?));
    out.extend(scaling(&bench)?);
    out.insert(
        "peer_params".into(),
        json!({ "rounds": ROUNDS, "windows_per_round": REPS, "trimmed": TRIM, "rdma_core": "ibverbs-sys 0.3.2 (rdma-core 55.0)",
                "cflags": RELEASE_FLAGS.join(" "), "debian_cflags": DEBIAN_CFLAGS,
                "cmake_release_flags": CMAKE_BUILDS.iter().map(|(n, f)| json!({ "build": n, "flags": f })).collect::<Vec<_>>() }),
    );
    Ok(out)
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// The Markdown section `--peer` writes into BENCHMARKS.md (between its markers, in the kept part).
pub fn markdown(r: &Map<String, Value>) -> String {
    let t = &r["peer_times"];
    let i = &r["peer_instructions"];
    let cell = |k: &str| {
        let v = &t[k];
        format!(
            "{:.2} ({:.2}–{:.2})",
            v["mean_ns"].as_f64().unwrap_or(f64::NAN),
            v["min_ns"].as_f64().unwrap_or(f64::NAN),
            v["max_ns"].as_f64().unwrap_or(f64::NAN)
        )
    };
    let ins = |k: &str| i.get(k).and_then(Value::as_f64).map_or("–".to_string(), |v| format!("{v:.0}"));
    let mut s = String::new();
    s.push_str(PEER_BEGIN);
    s.push_str("\n## Against rdma-core's mlx5 provider (`cargo xtask bench --peer`)\n\n");
    s.push_str(
        "rdma-core 55.0 (vendored by the `ibverbs-sys` 0.3.2 crate). The hand-made build (`c_*`, the baseline of \
         earlier runs): `providers/mlx5/qp.c` and `cq.c` compiled with its release flags over a hand-written \
         `config.h` (`-O2 -g -DNDEBUG -std=gnu11 -fPIC -D_GNU_SOURCE=`), linked with `xtask/peer/harness.c`: \
         an RC QP in RTS with 1024 one-SGE send and receive WQEs, a 1024-entry CQ of 64-byte CQEs (CQE version 1), \
         a dedicated BlueFlame register with `MLX5_POST_SEND_PREFER_BF` (a single WQE goes by BlueFlame, as ours), \
         64-byte SENDs with only the last WR of a call signaled, the CQ half send and half receive completions. \
         Both sides write a plain-memory BAR. C and Rust run in turn, ",
    );
    s.push_str(&format!(
        "{} rounds of {} timed windows each, every program started afresh in each; the cell is the mean of the \
         rounds' medians without the {} lowest and {} highest (the range of the rounds in brackets), ns per WQE or \
         CQE. Instructions: callgrind, per WQE or CQE, of the call through one \
         out-of-line wrapper on each side (`cg_*`). The machine is shared: only ratios from one run mean anything.\n\n",
        r["peer_params"]["rounds"],
        r["peer_params"]["windows_per_round"],
        r["peer_params"]["trimmed"],
        r["peer_params"]["trimmed"]
    ));
    s.push_str(
        "rdma-core as its own CMake builds it (`c_cmake_*`): configured as `debian/rules` configures it \
         (`-GNinja -DDISTRO_FLAVOUR=Debian -DCMAKE_BUILD_TYPE=Release -DENABLE_STATIC=1`, Debian bookworm's \
         `dpkg-buildflags` as CFLAGS/LDFLAGS, with `-DNO_MAN_PAGES=1 -DNO_PYVERBS=1`), its generated `config.h`, \
         the shared provider's `qp.c.o` and `cq.c.o` and `librdma_util_pic.a` linked with the same harness (no \
         lock). Two builds: `-O2`, the Release flags rdma-core's `RDMA_BuildType` means to set (`-O2 -g -DNDEBUG`), \
         and `-O3`, CMake's own Release default. With bookworm's CMake 3.25 that substitution does not happen (it \
         compares the cached flags with `CMAKE_C_FLAGS_RELEASE_INIT`, which CMake now builds with a leading space), \
         so a build configured as Debian configures it compiles with `-O2 … -O3 -DNDEBUG`: the `-O3` column is that \
         build; the shipped package (rdma-core 44 in bookworm) was not inspected. The peer ratios divide by the \
         `-O2` build (`peer_*_ratio`) and the `-O3` build (`peer_o3_*_ratio`).\n\n",
    );
    s.push_str("| call | rdma-core CMake -O2 ns | CMake -O3 ns | hand-made build ns, no lock | hand-made, its locks | ours ns | ours / -O2, / -O3 | instructions rdma-core (hand-made) / ours |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (key, label) in [
        ("post_send_1", "post_send, 1 per call (BlueFlame)"),
        ("post_send_16", "post_send, 16 per call"),
        ("post_send_64", "post_send, 64 per call"),
        ("post_recv", "post_recv, 16 per call"),
        ("poll_cq", "poll_cq, 16 per call"),
    ] {
        s.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} | {:.2}, {:.2} | {} / {} |\n",
            cell(&format!("c_cmake_o2_{key}")),
            cell(&format!("c_cmake_o3_{key}")),
            cell(&format!("c_{key}")),
            cell(&format!("c_locked_{key}")),
            cell(&format!("rust_{key}")),
            r[&format!("peer_{key}_ratio")].as_f64().unwrap_or(f64::NAN),
            r[&format!("peer_o3_{key}_ratio")].as_f64().unwrap_or(f64::NAN),
            ins(&format!("c_{key}_instr")),
            ins(&format!("rust_{key}_instr")),
        ));
    }
    s.push_str(&format!(
        "| poll_cq, 16 per call, hand-made rdma-core without its `lfence` | | | {} | | {} | {:.2} | |\n\n",
        cell("c_nofence_poll_cq"),
        cell("rust_poll_cq"),
        r["peer_poll_cq_nofence_ratio"].as_f64().unwrap_or(f64::NAN)
    ));
    s.push_str(
        "### Through the C ABI\n\n\
         `xtask/peer/abi.c` times `ibv_post_send`, `ibv_post_recv` and `ibv_poll_cq` (the inline functions of \
         rdma-core's `verbs.h`, which call through the context's ops) with the shapes above, built twice with the \
         same flags: over rdma-core's provider (its CMake `-O2` build) as set up by `harness.c` (its context's ops filled as \
         `mlx5_alloc_context` fills them; no kernel, so rdma-core's `libibverbs.so` itself is never entered on \
         these calls), and over the drop-in `libibverbs.so.1` on a simulated device opened as any program opens \
         one. For the posts the drop-in runs with `MLX5_RS_SIM_DOORBELLS=memory` (doorbells and BlueFlame copies \
         land in plain memory; between windows, untimed, the QP goes to RESET and back to RTS); for `poll_cq` the \
         in-line simulator runs the QP's SENDs to itself as their doorbells ring, and the timed polls take the \
         1024 completions it wrote into a 1024-entry CQ right after (no sleep; the timed loop reads no completion, \
         as on the other sides; warm-up windows check every one). Each \
         round runs both programs after the figures above, each side twice: with `MLX5_SINGLE_THREADED=1` (rdma-core's \
         variable, which both read: no lock is taken, only an in-use flag is set and cleared) and without it (each \
         takes its QP's or CQ's spin lock on every call). The ratios pair like with like; the core's Rust API takes \
         no lock (its QP is `&mut`).\n\n",
    );
    s.push_str("| call | rdma-core ns, no lock | rdma-core ns, its locks | drop-in ns, no lock | drop-in ns, its locks | drop-in / rdma-core (no lock, locks) | drop-in / core's Rust API (no lock, locks) | instructions rdma-core / drop-in (no lock, locks) |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    let ai = r.get("abi_instructions");
    let ains =
        |k: &str| ai.and_then(|m| m.get(k)).and_then(Value::as_f64).map_or("–".to_string(), |v| format!("{v:.0}"));
    for (key, label) in [
        ("post_send_1", "`ibv_post_send`, 1 per call (BlueFlame)"),
        ("post_send_16", "`ibv_post_send`, 16 per call"),
        ("post_send_64", "`ibv_post_send`, 64 per call"),
        ("post_recv", "`ibv_post_recv`, 16 per call"),
        ("poll_cq", "`ibv_poll_cq`, 16 per call"),
    ] {
        let g = |k: String| r[&k].as_f64().unwrap_or(f64::NAN);
        s.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {:.2}, {:.2} | {:.2}, {:.2} | {} / {}, {} |\n",
            cell(&format!("abi_c_{key}")),
            cell(&format!("abi_c_locked_{key}")),
            cell(&format!("abi_dropin_{key}")),
            cell(&format!("abi_dropin_locked_{key}")),
            g(format!("abi_{key}_ratio")),
            g(format!("abi_{key}_locked_ratio")),
            g(format!("abi_overhead_{key}")),
            g(format!("abi_overhead_locked_{key}")),
            ains(&format!("abi_c_{key}_instr")),
            ains(&format!("abi_dropin_{key}_instr")),
            ains(&format!("abi_dropin_locked_{key}_instr")),
        ));
    }
    s.push('\n');
    s.push_str(&format!(
        "Threads (`mlx5-bench --only threads`: one QP and CQ per thread, each posting and polling a ring of \
         completions against plain memory, every QP on its own BlueFlame register): 2 threads do **{:.2}×** the \
         completions per second of 1 by the wall clock (runs: {:.2}–{:.2}), **{:.2}×** by each thread's CPU time \
         (runs: {:.2}–{:.2}; what sharing would lower, and being descheduled on this busy machine would not). The \
         threaded simulator runs **{:.2}×** the in-line one's loopback SENDs per second (runs: {:.2}–{:.2}). Load \
         average during the run: {}.\n\n",
        r["threads_2_speedup"].as_f64().unwrap_or(f64::NAN),
        r["threads_2_speedup_range"][0].as_f64().unwrap_or(f64::NAN),
        r["threads_2_speedup_range"][1].as_f64().unwrap_or(f64::NAN),
        r["threads_2_speedup_cpu"].as_f64().unwrap_or(f64::NAN),
        r["threads_2_speedup_cpu_range"][0].as_f64().unwrap_or(f64::NAN),
        r["threads_2_speedup_cpu_range"][1].as_f64().unwrap_or(f64::NAN),
        r["sim_threaded_ratio"].as_f64().unwrap_or(f64::NAN),
        r["sim_threaded_ratio_range"][0].as_f64().unwrap_or(f64::NAN),
        r["sim_threaded_ratio_range"][1].as_f64().unwrap_or(f64::NAN),
        r["load_average"].as_f64().map_or("unknown".to_string(), |l| format!("{l:.1} (2 CPUs)")),
    ));
    s.push_str(
        "The harness takes the provider's real paths: before timing, `mlx5-peer` checks that a single WQE's 64 bytes \
         are in the BlueFlame register's current half and the half alternates, that a batch of 16 writes only the \
         8-byte doorbell of its last control segment, the doorbell records, the receive segment, and the SEND and \
         RECV work completions a ring of CQEs gives (wr_id, length, QP numbers), and exits otherwise; every provider \
         function outside those paths that qp.c and cq.c call (SRQs, inline scatter, lookups by QPN, buffer \
         allocation) is linked to a stub that aborts.\n",
    );
    s.push_str(PEER_END);
    s.push('\n');
    s
}

pub const PEER_BEGIN: &str = "<!-- peer: written by `cargo xtask bench --peer` -->";
pub const PEER_END: &str = "<!-- peer: end -->";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abi_structs_defines_each_top_level_struct() {
        // The expected text is what rdma-core's script writes for this input (comments leave their spaces).
        let h = "struct a {\n\t__u32 x; /* c */\n\tunion {\n\t\t__u32 y;\n\t};\n};\nstruct b {\n__u8 z; // c\n};\n";
        let out = abi_structs(h);
        assert_eq!(
            out,
            "#define _STRUCT_a struct { \\\n__u32 x;  \\\nunion { \\\n__u32 y; \\\n}; \\\n}\n\n\
             #define _STRUCT_b struct { \\\n__u8 z;  \\\n}\n\n"
        );
    }
}

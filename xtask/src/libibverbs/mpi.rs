//! `cargo xtask verbs-apps --only mpi`: Open MPI 4.1 from Debian, unmodified, on the drop-in library. Four ranks
//! (`mpirun -np 4`), each a process with its own simulated ConnectX-5 on one VDE fabric (`wire=vde`, the default
//! switch of a private runtime directory), run `mpi/pingsum.c`: 64 KiB ping-pongs between rank pairs, every byte
//! checked, and an `MPI_Allreduce` whose sum every rank checks. MPI's traffic can only cross the simulated
//! devices: the UCX PML (`--mca pml ucx`), no byte transfer layer but `self`, and UCX limited to its verbs
//! transports (`UCX_TLS=rc_verbs,ud_verbs`: without that limit UCX would join ranks of one machine through shared
//! memory). Like the `ucx` part it needs root, for the private mount namespace that gives UCX its
//! `/dev/infiniband/uverbs0`.
//!
//! Installs Debian's `openmpi-bin` (which brings `libopenmpi3` and UCX) and `ibverbs-providers` (the `libmlx5.so.1`
//! UCX's IB transports link) when missing. The program is
//! built with gcc against `mpi.h` from `libopenmpi-dev`, which is only unpacked (installing it would pull in
//! gfortran).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{apt_download, on_dropin, run as run_cmd, wait, UVERBS_STANDIN};

/// Debian's Open MPI library (`libopenmpi3`).
const LIBMPI: &str = "/usr/lib/x86_64-linux-gnu/libmpi.so.40";

/// Where `libopenmpi-dev` puts `mpi.h`, under the directory it is unpacked in.
const MPI_INCLUDE: &str = "usr/lib/x86_64-linux-gnu/openmpi/include";

/// The longest the four ranks may take (they take about a second here).
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// rdma-core's mlx5 provider library, which UCX's IB transports link (`ibverbs-providers`, only recommended by
/// the packages Open MPI pulls in).
const LIBMLX5: &str = "/usr/lib/x86_64-linux-gnu/libmlx5.so.1";

/// The packages [`ensure_openmpi`] installs.
const MPI_DEBS: &[&str] = &["openmpi-bin", "libopenmpi3", "ibverbs-providers"];

/// Installs Open MPI (and the mlx5 provider library UCX links) when `mpirun`, libmpi or libmlx5 is missing.
fn ensure_openmpi() -> Result<(), String> {
    if [Path::new("/usr/bin/mpirun"), Path::new(LIBMPI), Path::new(LIBMLX5)].iter().all(|p| p.exists()) {
        return Ok(());
    }
    let install = || {
        let mut c = Command::new("apt-get");
        c.args(["install", "-y", "-q", "--no-install-recommends"]).args(MPI_DEBS);
        c.env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    println!("$ apt-get install {}", MPI_DEBS.join(" "));
    if install().status().map_err(|e| format!("failed to run apt-get: {e}"))?.success() {
        return Ok(());
    }
    println!("apt-get install failed; $ apt-get update");
    run_cmd(Command::new("apt-get").args(["update", "-q"]))?;
    match install().status().map_err(|e| e.to_string())?.success() {
        true => Ok(()),
        false => Err(format!("apt-get install {} failed", MPI_DEBS.join(" "))),
    }
}

/// `mpi.h` from `libopenmpi-dev`, unpacked under `dir`; the include directory.
fn mpi_header(dir: &Path) -> Result<PathBuf, String> {
    let include = dir.join("root").join(MPI_INCLUDE);
    if include.join("mpi.h").exists() {
        return Ok(include);
    }
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    apt_download(&["libopenmpi-dev"], dir)?;
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.extension().is_some_and(|x| x == "deb") {
            run_cmd(Command::new("dpkg").arg("-x").arg(&p).arg(dir.join("root")))?;
        }
    }
    if !include.join("mpi.h").exists() {
        return Err(format!("libopenmpi-dev unpacked in {} has no {MPI_INCLUDE}/mpi.h", dir.display()));
    }
    Ok(include)
}

/// Builds `mpi/pingsum.c` in `dir`; the program.
fn build(dir: &Path) -> Result<PathBuf, String> {
    let include = mpi_header(&dir.join("dev"))?;
    let src = dir.join("pingsum.c");
    std::fs::write(&src, include_str!("mpi/pingsum.c")).map_err(|e| e.to_string())?;
    let prog = dir.join("pingsum");
    run_cmd(
        Command::new("gcc")
            .args(["-O2", "-Wall", "-Werror", "-o"])
            .arg(&prog)
            .arg(&src)
            .arg("-I")
            .arg(include)
            .arg(LIBMPI),
    )?;
    Ok(prog)
}

/// `verbs-apps` part `mpi`: see the module's documentation. `lib` is the drop-in's directory.
pub fn run(lib: &Path) -> Result<(), String> {
    let start = Instant::now();
    let root = std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|t| t.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")));
    if !root {
        return Err("mpi: needs root, for the private mount namespace that gives UCX its /dev/infiniband/uverbs0 \
                    character device, and for mpirun --allow-run-as-root"
            .into());
    }
    ensure_openmpi()?;
    crate::vde::ensure_vde()?;
    let dir = lib.join("mpi");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let prog = build(&dir)?;
    let made = !Path::new("/dev/infiniband").exists();
    if made {
        // The namespace's mount point; removed again below.
        std::fs::create_dir("/dev/infiniband").map_err(|e| format!("mpi: /dev/infiniband: {e}"))?;
    }
    let runtime = std::env::temp_dir().join(format!("xtask-mpi-vde-{}", std::process::id()));
    let r = std::fs::create_dir_all(&runtime).map_err(|e| e.to_string()).and_then(|()| ranks(lib, &prog, &runtime));
    if let Ok(pid) = std::fs::read_to_string(runtime.join("mlx5-sim.pid")) {
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
    }
    let _ = std::fs::remove_dir_all(&runtime);
    if made {
        let _ = std::fs::remove_dir("/dev/infiniband");
    }
    let secs = r?;
    println!("mpi: mpirun -np 4 (Open MPI over UCX rc_verbs/ud_verbs, one VDE fabric) in {secs:.1} s: ok");
    println!("mpi: {:.1} s in all", start.elapsed().as_secs_f64());
    Ok(())
}

/// `mpirun -np 4` of `prog` in the stand-in's mount namespace, every rank on the drop-in and the fabric of
/// `runtime`; its time in seconds.
fn ranks(lib: &Path, prog: &Path, runtime: &Path) -> Result<f64, String> {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "unchanged", "sh", "-c", UVERBS_STANDIN, "sh", "mpirun"])
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4", "--mca", "pml", "ucx", "--mca", "btl", "self"])
        .arg(prog)
        .env("XDG_RUNTIME_DIR", runtime)
        .env("UCX_TLS", "rc_verbs,ud_verbs")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    on_dropin(&mut c, lib, "sim:wire=vde");
    let start = Instant::now();
    let child = c.spawn().map_err(|e| format!("mpi: cannot start mpirun: {e}"))?;
    let out = wait(child, RUN_TIMEOUT, "mpirun -np 4")?;
    let secs = start.elapsed().as_secs_f64();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let noisy =
        text.lines().any(|l| l.contains("UCX  ERROR") || l.contains("UCX  WARN") || l.contains("libibverbs(mlx5-rs)"));
    let ranks_ok = (0..4).all(|r| text.contains(&format!("rank {r} of 4: ping-pong ok, allreduce 10 (want 10)")));
    if !out.status.success() || noisy || !ranks_ok {
        return Err(format!("mpi: mpirun -np 4 {}:\n{text}", out.status));
    }
    for l in text.lines().filter(|l| l.starts_with("rank ")) {
        println!("mpi: {l}");
    }
    Ok(secs)
}

//! `cargo xtask pci-sim`: the simulated ConnectX on a real PCI bus. A QEMU q35 guest (TCG, Debian's 6.1 kernel,
//! the one vfio-test boots) gets `-device x-pci-proxy-dev` backed by `mlx5-pci-proxy` (sim/pci-proxy), with
//! its RAM in a shared memfd so the device DMAs into it. Inside, the guest's own vfio-pci takes the function
//! (`mlx5 bind`), and the `mlx5` tool drives it through our VFIO crate: `devinfo`, then an RC ping-pong of
//! 1,000 × 4 KiB on the device with every byte checked (`--full`: also a `bench write_bw` loopback). A second
//! guest runs the ping-pong against `mlx5 pingpong --server` on the host over the simulated wire (`--wire`), a
//! third against Debian's ibv_rc_pingpong on the drop-in library on the host, a fourth runs that ibv_rc_pingpong
//! on the drop-in inside the guest over VFIO;
//! the bare-metal image (examples/baremetal) boots on the same bus and exchanges 1,000 x 4 KiB RC SENDs and RDMA
//! WRITEs each way with a host process over the simulated wire, its command trace compared with that process's.
//!
//! The proxy has no MSI or MSI-X and its DMA bypasses the guest's IOMMU, so the guest runs the tool with
//! `MLX5_RS_IOVA_MODE=pa` (IOVA = guest-physical address) and the driver polls (the VFIO crate says so).
//!
//! It prints a summary and writes it to `target/pci-sim/summary.json`: per guest `passed`, `commands` (firmware
//! commands the device completed, from the proxy's trace), `bytes_checked`, what was enumerated and the time.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::vfio_test::{apt_install, ensure_kernel, find_module, have, module_bytes, run, wait_until, Cpio};

/// VFIO modules in load order (6.1 has vfio_virqfd separate).
const MODULES: &[&str] = &["irqbypass", "vfio", "vfio_virqfd", "vfio_iommu_type1", "vfio-pci-core", "vfio-pci"];
/// Set when a QEMU process of the current attempt died of a signal (QEMU's own crash, not the guest's failure).
static QEMU_CRASHED: AtomicBool = AtomicBool::new(false);

/// Runs one guest scenario (its host side included), and once more if QEMU itself crashed in it: Debian's QEMU
/// 7.2 was seen to die of SIGSEGV during a Linux guest's boot, before the device is touched, about once in 16
/// boots. A failure of anything else is the result, not retried.
fn once_more_if_qemu_crashed<T>(
    what: &str,
    mut attempt: impl FnMut() -> Result<T, String>,
    passed: impl Fn(&T) -> bool,
) -> Result<T, String> {
    QEMU_CRASHED.store(false, Ordering::SeqCst);
    let first = attempt();
    if !QEMU_CRASHED.load(Ordering::SeqCst) || first.as_ref().is_ok_and(&passed) {
        return first;
    }
    println!("pci-sim: QEMU itself crashed in the {what} run; running it once more");
    QEMU_CRASHED.store(false, Ordering::SeqCst);
    attempt()
}

const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";
const TIMEOUT: Duration = Duration::from_secs(900);
/// The ping-pong: iterations and bytes per message (each iteration checks a message each way).
const PP_ITERS: u64 = 1000;
const PP_SIZE: u64 = 4096;

fn ensure_packages() -> Result<(), String> {
    let mut need = Vec::new();
    if !have("qemu-system-x86_64") {
        need.push("qemu-system-x86");
    }
    if !Path::new("/bin/busybox").exists() {
        need.push("busybox-static");
    }
    if !need.is_empty() {
        apt_install(&need)?;
    }
    let devices = run(Command::new("qemu-system-x86_64").args(["-device", "help"]))?;
    if !devices.contains("\"x-pci-proxy-dev\"") {
        return Err("this qemu-system-x86_64 has no x-pci-proxy-dev (multi-process QEMU)".into());
    }
    Ok(())
}

/// Builds the proxy for the host and the tool for the guest; `guest_target_dir` is vfio-test's, whose static
/// build of the same dependencies it shares.
fn build(root: &Path, guest_target_dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("pci-sim: building mlx5-pci-proxy and a static mlx5 for the guest");
    let st = Command::new(&cargo)
        .args(["build", "--release", "-p", "mlx5-pci-proxy"])
        .current_dir(root)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err("building mlx5-pci-proxy failed".into());
    }
    let target_dir = guest_target_dir;
    let st = Command::new(&cargo)
        .args(["build", "--release", "-p", "mlx5-tool", "--bin", "mlx5", "--target", GUEST_TARGET])
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env("CARGO_TARGET_DIR", target_dir)
        .current_dir(root)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err("building the guest's mlx5 failed".into());
    }
    let host_target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    Ok((host_target.join("release/mlx5-pci-proxy"), target_dir.join(GUEST_TARGET).join("release/mlx5")))
}

/// The guest's `/init`: VFIO up, the proxy function found by its ids, bound to vfio-pci, driven by the tool.
/// Each step prints one `pci-sim:` line the xtask reads; the verdict goes out through isa-debug-exit.
/// The exchange port of the wire run's host-side `mlx5 pingpong --server` (its simulated wire listens one above).
const WIRE_PORT: u16 = 18830;

fn init_script(modules: &[String], full: bool, remote: bool, rcpp: bool) -> String {
    let mut s =
        String::from("#!/bin/sh\nmount -t proc proc /proc\nmount -t sysfs sys /sys\nmount -t devtmpfs dev /dev\n");
    for m in modules {
        s.push_str(&format!("insmod /modules/{m}.ko || echo \"init: insmod {m} failed\"\n"));
    }
    s.push_str(&format!(
        r#"echo 64 > /proc/sys/vm/nr_hugepages
fail=0
bdf=
for d in /sys/bus/pci/devices/*; do
  if [ "$(cat $d/vendor)" = 0x15b3 ] && [ "$(cat $d/device)" = 0x1017 ]; then bdf=${{d##*/}}; fi
done
if [ -z "$bdf" ]; then echo "pci-sim: enumerated none"; fail=1; else
  d=/sys/bus/pci/devices/$bdf
  echo "pci-sim: enumerated $bdf $(cat $d/vendor):$(cat $d/device) class $(cat $d/class) bar0 $(head -n 1 $d/resource)"
  /mlx5 bind $bdf || fail=1
  echo "pci-sim: driver $(basename $(readlink $d/driver))"
  export MLX5_RS_IOVA_MODE=pa
  if [ -n "$REMOTE" ]; then
    ip link set lo up; ip link set eth0 up; ip addr add 10.0.2.15/24 dev eth0
  fi
  if [ -n "$RCPP" ]; then
    # Debian's ibv_rc_pingpong on the drop-in library, which finds the device bound to vfio-pci.
    if LD_LIBRARY_PATH=/dropin MLX5_RS_DEVICES=vfio /usr/bin/ibv_rc_pingpong -g 0 -c -s {PP_SIZE} -n {PP_ITERS} -p $REMOTE 10.0.2.2 > /tmp/rc.txt 2>&1; then
      while read l; do echo "pci-sim: rcpp $l"; done < /tmp/rc.txt
    else while read l; do echo "pci-sim: rcpp $l"; done < /tmp/rc.txt; echo "pci-sim: rcpp failed"; fail=1; fi
  elif [ -n "$REMOTE" ]; then
    if /mlx5 -v --device $bdf pingpong --client 10.0.2.2:$REMOTE --gid-idx 0 --chk --size {PP_SIZE} --iters {PP_ITERS} --timeout 300 --json > /tmp/rpp.json; then
      echo "pci-sim: remote $(cat /tmp/rpp.json)"
    else echo "pci-sim: remote failed"; fail=1; fi
  elif /mlx5 -v --device $bdf devinfo --json > /tmp/devinfo.json; then
    echo "pci-sim: devinfo $(cat /tmp/devinfo.json)"
  else echo "pci-sim: devinfo failed"; fail=1; fi
  if [ -z "$REMOTE" ]; then
    if /mlx5 --device $bdf pingpong --size {PP_SIZE} --iters {PP_ITERS} --json > /tmp/pp.json; then
      echo "pci-sim: pingpong $(cat /tmp/pp.json)"
    else echo "pci-sim: pingpong failed"; fail=1; fi
  fi
"#
    ));
    s = s.replacen(
        "fail=0\n",
        &format!(
            "fail=0\nREMOTE={}\nRCPP={}\n",
            if remote { WIRE_PORT.to_string() } else { String::new() },
            if rcpp { "1" } else { "" }
        ),
        1,
    );
    if full && !remote {
        s.push_str(
            "  if /mlx5 --device $bdf bench write_bw --size 4096 --iters 1000 --json > /tmp/bw.json; then\n\
             \x20   echo \"pci-sim: bench $(cat /tmp/bw.json)\"\n\
             \x20 else echo \"pci-sim: bench failed\"; fail=1; fi\n",
        );
    }
    s.push_str(
        "fi\n\
         if [ $fail -eq 0 ]; then v='\\001'; else v='\\002'; fi\n\
         printf \"$v\" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null\n\
         poweroff -f\n",
    );
    s
}

/// The Linux guests run on one vCPU: x-pci-proxy-dev drops QEMU's big lock while the proxy answers, and QEMU 7.2's
/// re-entrancy guard is per device, not per vCPU, so a second vCPU's BAR access meanwhile is refused ("Blocked
/// re-entrant IO on MemoryRegion: bar-region-0"): a doorbell lost, and a ping-pong that waits for its timeout.
/// Seen here with `-smp 2`: mlx5-verbs' service thread (health, events) reads BAR0 while the datapath rings doorbells.
const GUEST_CPUS: u32 = 1;

/// The guest NIC's modules (virtio-net), for the wire run's exchange with the host.
const NET_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
];

/// `dropin`: also Debian's `ibv_rc_pingpong` with its library closure and the drop-in `libibverbs.so.1` from this
/// directory in `/dropin`, run as the guest side of the wire run.
fn build_initramfs(
    work: &Path,
    modules_dir: &Path,
    tool: &Path,
    full: bool,
    remote: bool,
    dropin: Option<&Path>,
) -> Result<PathBuf, String> {
    let mut c = Cpio::default();
    for d in ["bin", "sbin", "dev", "proc", "sys", "modules", "tmp"] {
        c.dir(d);
    }
    let busybox = std::fs::read("/bin/busybox").map_err(|e| format!("/bin/busybox: {e}"))?;
    c.file("bin/busybox", true, &busybox);
    for applet in [
        "sh", "mount", "insmod", "echo", "cat", "dd", "printf", "poweroff", "head", "readlink", "basename", "dmesg",
        "ip",
    ] {
        c.symlink(&format!("bin/{applet}"), "busybox");
    }
    let mut loaded = Vec::new();
    let net: &[&str] = if remote { NET_MODULES } else { &[] };
    for m in MODULES.iter().chain(net) {
        match find_module(modules_dir, m) {
            Some(p) => {
                c.file(&format!("modules/{m}.ko"), false, &module_bytes(&p)?);
                loaded.push(m.to_string());
            }
            // vfio_virqfd exists only up to 6.1; some virtio parts may be built in.
            None if *m == "vfio_virqfd" || net.contains(m) => {}
            None => return Err(format!("module {m} not found under {}", modules_dir.display())),
        }
    }
    if let Some(dir) = dropin {
        crate::verbs_guest::add_userspace(&mut c, &["ibv_rc_pingpong"], &[])?;
        c.dir("dropin");
        let lib = dir.join("libibverbs.so.1");
        c.file("dropin/libibverbs.so.1", true, &std::fs::read(&lib).map_err(|e| format!("{}: {e}", lib.display()))?);
        // What the drop-in links besides libc (libgcc_s), beside it.
        let ldd = run(Command::new("ldd").arg(&lib))?;
        for l in ldd.lines() {
            let Some((name, rest)) = l.trim().split_once(" => ") else { continue };
            let Some(path) = rest.split_whitespace().next().filter(|p| p.starts_with('/')) else { continue };
            if !name.starts_with("libc.so") {
                c.file(&format!("dropin/{name}"), true, &std::fs::read(path).map_err(|e| format!("{path}: {e}"))?);
            }
        }
    }
    c.file("init", true, init_script(&loaded, full, remote, dropin.is_some()).as_bytes());
    c.file("mlx5", true, &std::fs::read(tool).map_err(|e| format!("{}: {e}", tool.display()))?);
    let out = work.join(match (remote, dropin.is_some()) {
        (_, true) => "initramfs-wire-rc.cpio",
        (true, false) => "initramfs-wire.cpio",
        (false, false) => "initramfs.cpio",
    });
    std::fs::write(&out, c.finish()).map_err(|e| e.to_string())?;
    Ok(out)
}

/// What the guest run showed.
struct GuestRun {
    passed: bool,
    lines: Vec<String>,
    secs: f64,
    commands: Vec<(String, u64)>,
    proxy_log: String,
}

/// What sees each console line as it arrives (the bare-metal run hands the image's facts to the host side).
type LineHook = Box<dyn FnMut(&str) + Send>;

/// Boots a guest (QEMU arguments `machine`, after the shared ones) with the proxy and collects its console, the
/// proxy's command trace (`(opcode, op_mod)` in completion order) and its log.
fn boot(work: &Path, proxy: &Path, proxy_args: &[&str], name: &str, machine: &str) -> Result<GuestRun, String> {
    boot_with(work, proxy, proxy_args, name, machine, None, TIMEOUT)
}

/// [`boot`], each console line also given to `hook`, the guest killed after `timeout`.
fn boot_with(
    work: &Path,
    proxy: &Path,
    proxy_args: &[&str],
    name: &str,
    machine: &str,
    mut hook: Option<LineHook>,
    timeout: Duration,
) -> Result<GuestRun, String> {
    let (q, p) = std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    let trace = work.join(format!("{name}-commands.jsonl"));
    let proxy_log = work.join(format!("{name}-proxy.log"));
    // The proxy's end is its stdin (`--fd 0`), so nothing has to be un-CLOEXEC'd.
    let mut server = Command::new(proxy)
        .args(["--fd", "0", "--trace"])
        .arg(&trace)
        .args(proxy_args)
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(p)))
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&proxy_log).map_err(|e| e.to_string())?))
        .spawn()
        .map_err(|e| format!("starting mlx5-pci-proxy: {e}"))?;
    // QEMU's end arrives as the shell's stdin and becomes its fd 3 (x-pci-proxy-dev,fd=3). Its log records every
    // CPU reset and a triple fault, so a guest that ends without a word says whether it crashed or rebooted.
    let qemu_log = work.join(format!("{name}-qemu.log"));
    let _ = std::fs::remove_file(&qemu_log);
    let qemu = format!(
        "exec qemu-system-x86_64 -accel tcg -nographic -no-reboot -nodefaults -serial stdio \
         -device isa-debug-exit,iobase=0xf4,iosize=0x04 {machine} -device x-pci-proxy-dev,id=mlx5,fd=3 \
         -d cpu_reset -D '{}' 3<&0 0</dev/null",
        qemu_log.display()
    );
    println!("pci-sim: booting the {name} guest: {qemu}");
    let start = Instant::now();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(&qemu)
        .stdin(Stdio::from(std::os::fd::OwnedFd::from(q)))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting qemu: {e}"))?;
    let stdout = child.stdout.take().ok_or("no qemu stdout")?;
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).split(b'\n').map_while(Result::ok) {
            let l = String::from_utf8_lossy(&line).trim_end_matches('\r').to_string();
            println!("guest| {l}");
            let _ = std::io::stdout().flush();
            if let Some(h) = hook.as_mut() {
                h(&l);
            }
            lines.push(l);
        }
        lines
    });
    let status = match wait_until(&mut child, start + timeout, Duration::from_millis(100))? {
        Some(s) => s,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            let _ = server.kill();
            let _ = server.wait();
            return Err(format!("the {name} guest did not finish within {} s", timeout.as_secs()));
        }
    };
    let secs = start.elapsed().as_secs_f64();
    println!("pci-sim: the {name} guest ended after {secs:.1} s: qemu {status}");
    let lines = reader.join().map_err(|_| "console reader panicked")?;
    // QEMU closed its end: the proxy ends on its own.
    let server_status =
        match wait_until(&mut server, Instant::now() + Duration::from_secs(30), Duration::from_millis(50))? {
            Some(s) => s,
            None => {
                let _ = server.kill();
                let _ = server.wait();
                return Err("mlx5-pci-proxy did not exit after QEMU did".into());
            }
        };
    let proxy_log = std::fs::read_to_string(&proxy_log).unwrap_or_default();
    print!("{}", proxy_log.lines().map(|l| format!("proxy| {l}\n")).collect::<String>());
    let commands: Vec<(String, u64)> = std::fs::read_to_string(&trace)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|v| (v["opcode"].as_str().unwrap_or("?").to_string(), v["op_mod"].as_u64().unwrap_or(u64::MAX)))
        .collect();
    // isa-debug-exit: 1 (pass) → 3.
    let passed = status.code() == Some(3) && server_status.success();
    if !passed {
        use std::os::unix::process::ExitStatusExt;
        let how = match status.signal() {
            // QEMU itself crashed: nothing the guest or the proxy can do about it (seen here as a SIGSEGV during
            // the guest kernel's boot, before any BAR access, about once in 15 Linux guests).
            Some(sig) => {
                QEMU_CRASHED.store(true, Ordering::SeqCst);
                format!("QEMU itself died of signal {sig} ({})", qemu_reset_note(&qemu_log))
            }
            None => qemu_reset_note(&qemu_log),
        };
        println!("pci-sim: the {name} guest failed: {how}");
    }
    Ok(GuestRun { passed, lines, secs, commands, proxy_log })
}

/// What QEMU's `-d cpu_reset` log says about how a failed guest ended: QEMU resets each CPU twice at power-on
/// (a dump each, seen here); more dumps mean the guest reset the machine (with `-no-reboot` QEMU then exits), after a triple
/// fault or on its own (a kernel panic with `panic=-1` reboots).
fn qemu_reset_note(log: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(log) else {
        return format!("no QEMU log at {}", log.display());
    };
    let resets = text.matches("CPU Reset").count();
    if text.contains("Triple fault") {
        format!("a CPU triple-faulted ({} CPU resets in {})", resets, log.display())
    } else {
        format!(
            "no triple fault; {} CPU resets in {} (power-on makes two per CPU; more: the guest reset the machine)",
            resets,
            log.display()
        )
    }
}

/// The last `pci-sim: KEY ...` line's rest (the console may put terminal escapes before it).
fn line<'a>(lines: &'a [String], key: &str) -> Option<&'a str> {
    const TAG: &str = "pci-sim: ";
    lines.iter().rev().find_map(|l| l[l.find(TAG)? + TAG.len()..].strip_prefix(key)).map(str::trim)
}

pub fn run_pci_sim(root: &Path, full: bool) -> Result<(), String> {
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let work = target.join("pci-sim");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let work = work.canonicalize().map_err(|e| e.to_string())?;
    // The kernel vfio-test downloads, shared.
    let kwork = target.join("vfio-test");
    std::fs::create_dir_all(&kwork).map_err(|e| e.to_string())?;
    let started = Instant::now();
    ensure_packages()?;
    let kwork = kwork.canonicalize().map_err(|e| e.to_string())?;
    let (vmlinuz, modules) = ensure_kernel(&kwork)?;
    let (proxy, tool) = build(root, &kwork.join("target"))?;
    let initrd = build_initramfs(&work, &modules, &tool, full, false, None)?;
    let machine = format!(
        "-machine q35,kernel-irqchip=split,memory-backend=ram -object memory-backend-memfd,id=ram,size=1G,share=on \
         -m 1G -device intel-iommu,intremap=on,caching-mode=on -smp {GUEST_CPUS} -kernel '{}' -initrd '{}' \
         -append 'console=ttyS0 panic=-1 quiet intel_iommu=on'",
        vmlinuz.display(),
        initrd.display()
    );
    let g = once_more_if_qemu_crashed("vfio", || boot(&work, &proxy, &[], "vfio", &machine), |g| g.passed)?;
    let bm = once_more_if_qemu_crashed("bare-metal", || baremetal(root, &work, &proxy), |b| b.passed)?;
    let wire = once_more_if_qemu_crashed(
        "wire",
        || wire_run(&work, &proxy, &tool, &vmlinuz, &modules, &Host::Tool, None),
        |w| w.passed,
    )?;
    // Debian's unmodified ibv_rc_pingpong on the drop-in libibverbs.so.1 as the host side.
    if !have("ibv_rc_pingpong") {
        apt_install(&["ibverbs-utils"])?;
    }
    let dropin = crate::libibverbs::build(root, false)?;
    let wire_rc = once_more_if_qemu_crashed(
        "ibv_rc_pingpong host",
        || wire_run(&work, &proxy, &tool, &vmlinuz, &modules, &Host::RcPingpong(&dropin), None),
        |w| w.passed,
    )?;
    // And the other way round: Debian's ibv_rc_pingpong on the drop-in over VFIO in the guest, our tool on the host.
    let wire_gr = once_more_if_qemu_crashed(
        "ibv_rc_pingpong guest",
        || wire_run(&work, &proxy, &tool, &vmlinuz, &modules, &Host::Tool, Some(&dropin)),
        |w| w.passed,
    )?;
    let pp: Option<serde_json::Value> = line(&g.lines, "pingpong").and_then(|j| serde_json::from_str(j).ok());
    let verified = pp.as_ref().and_then(|v| v["verified"].as_bool()) == Some(true);
    let iters = pp.as_ref().and_then(|v| v["iters"].as_u64()).unwrap_or(0);
    let size = pp.as_ref().and_then(|v| v["size"].as_u64()).unwrap_or(0);
    // Each iteration checks one message each way.
    let bytes_checked = if verified { iters * size * 2 } else { 0 };
    let enumerated = line(&g.lines, "enumerated").unwrap_or("nothing").to_string();
    let driver = line(&g.lines, "driver");
    let passed = g.passed
        && verified
        && iters == PP_ITERS
        && size == PP_SIZE
        && !g.commands.is_empty()
        && enumerated.contains("0x15b3:0x1017")
        && driver == Some("vfio-pci");
    let polled = g.lines.iter().any(|l| l.contains("completions and events are polled"));
    let summary = serde_json::json!({
        "vfio_guest": {
            "passed": passed,
            "commands": g.commands.len(),
            "bytes_checked": bytes_checked,
            "enumerated": enumerated,
            "driver": driver,
            "polling_notice": polled,
            "pingpong": pp,
            "bench": line(&g.lines, "bench").and_then(|j| serde_json::from_str::<serde_json::Value>(j).ok()),
            "guest_seconds": g.secs,
        },
        "baremetal_guest": {
            "passed": bm.passed,
            "commands": bm.commands,
            "bytes_checked": bm.bytes_checked,
            "host_bytes_checked": bm.host_bytes_checked,
            "same_trace_as_host": bm.same_trace,
            "host_commands": bm.host_commands,
            "first_difference": bm.first_difference,
            "guest_seconds": bm.secs,
        },
        "wire_guest": {
            "passed": wire.passed,
            "commands": wire.commands,
            "bytes_checked": wire.bytes_checked,
            "guest": wire.guest,
            "host": wire.host,
            "guest_seconds": wire.secs,
        },
        "wire_guest_vs_ibv_rc_pingpong": {
            "passed": wire_rc.passed,
            "commands": wire_rc.commands,
            "bytes_checked": wire_rc.bytes_checked,
            "guest": wire_rc.guest,
            "host": wire_rc.host_text,
            "guest_seconds": wire_rc.secs,
        },
        "wire_guest_ibv_rc_pingpong_over_vfio": {
            "passed": wire_gr.passed,
            "commands": wire_gr.commands,
            "bytes_checked": wire_gr.bytes_checked,
            "guest": wire_gr.guest,
            "host": wire_gr.host,
            "guest_seconds": wire_gr.secs,
        },
        "total_seconds": started.elapsed().as_secs_f64(),
        "full": full,
    });
    let text = serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?;
    std::fs::write(work.join("summary.json"), &text).map_err(|e| e.to_string())?;
    println!("pci-sim: summary (also {}):", work.join("summary.json").display());
    println!("  enumerated:   {enumerated}");
    println!("  vfio guest:   {}", if passed { "passed" } else { "FAILED" });
    println!("  commands:     {} firmware commands completed by the simulated device", g.commands.len());
    println!("  bytes:        {bytes_checked} bytes checked ({iters} x {size} B each way)");
    println!(
        "  polling:      {}",
        if polled { "the VFIO crate noticed no MSI-X/MSI and polled" } else { "no notice seen" }
    );
    println!("  time:         guest {:.1} s, whole run {:.1} s", g.secs, started.elapsed().as_secs_f64());
    println!(
        "  bare metal:   {}: {} commands, 1,000 x 4 KiB SENDs and RDMA WRITEs each way with a host process over the \
         wire, {} bytes checked by the image, {} by the host side; same trace as the host side's run_peer(): {} ({} \
         commands there){}",
        if bm.passed { "passed" } else { "FAILED" },
        bm.commands,
        bm.bytes_checked,
        bm.host_bytes_checked,
        bm.same_trace,
        bm.host_commands,
        bm.first_difference.as_deref().map(|d| format!(", first difference: {d}")).unwrap_or_default()
    );
    println!("  time:         bare-metal guest {:.1} s", bm.secs);
    println!(
        "  over the wire: {}: the guest's VFIO device against a host process's simulated one, {} bytes checked (both \
         ways), {} commands, guest {:.1} s",
        if wire.passed { "passed" } else { "FAILED" },
        wire.bytes_checked,
        wire.commands,
        wire.secs
    );
    if g.proxy_log.contains("rejected") && !passed {
        println!("  proxy:        see the proxy| lines above");
    }
    println!(
        "  vs ibv_rc_pingpong: {}: the guest's VFIO device against Debian's ibv_rc_pingpong -c on the drop-in \
         library, {} bytes checked by the guest side, guest {:.1} s",
        if wire_rc.passed { "passed" } else { "FAILED" },
        wire_rc.bytes_checked,
        wire_rc.secs
    );
    println!(
        "  ibv_rc_pingpong over VFIO: {}: Debian's ibv_rc_pingpong -c on the drop-in in the guest against mlx5 \
         pingpong --chk on the host, {} bytes checked by the host side, guest {:.1} s",
        if wire_gr.passed { "passed" } else { "FAILED" },
        wire_gr.bytes_checked,
        wire_gr.secs
    );
    if passed && bm.passed && bm.same_trace && wire.passed && wire_rc.passed && wire_gr.passed {
        Ok(())
    } else {
        Err("pci-sim failed (see the guest| and proxy| lines above)".into())
    }
}

/// What the bare-metal run showed.
struct Baremetal {
    passed: bool,
    commands: usize,
    /// Checked by the image.
    bytes_checked: u64,
    /// Checked by the host side.
    host_bytes_checked: u64,
    same_trace: bool,
    host_commands: usize,
    first_difference: Option<String>,
    secs: f64,
}

const BAREMETAL_TARGET: &str = "x86_64-unknown-none";

fn ensure_rust_target(t: &str) -> Result<(), String> {
    let installed = run(Command::new("rustup").args(["target", "list", "--installed"]))?;
    if !installed.lines().any(|l| l.trim() == t) {
        println!("pci-sim: rustup target add {t}");
        run(Command::new("rustup").args(["target", "add", t]))?;
    }
    Ok(())
}

/// The port the bare-metal run's host side listens on for the proxy's wire.
const BAREMETAL_WIRE_PORT: u16 = 18840;
/// How long the bare-metal guest may take in all (the image bounds each of its own waits at 60 s).
const BAREMETAL_TIMEOUT: Duration = Duration::from_secs(300);
/// What the exchange moves each way: 1,000 SENDs and 1,000 RDMA WRITEs of 4 KiB (examples/firmware's peer.rs).
const BAREMETAL_BYTES: u64 = 2 * 1000 * 4096;

/// The core on bare metal: `examples/baremetal` built for x86_64-unknown-none, booted with `-kernel` (PVH) with
/// the proxy as its PCI device, exchanging RC SENDs and RDMA WRITEs with a host process over the simulated wire.
/// The host side is the same crate's host binary (`--peer`): the same `run_peer()` on a simulated device whose
/// wire listens on 127.0.0.1, so its device trace is the reference the image's is compared with. The host's
/// facts reach the image on its command line (`-append mlx5.peer=...`); the image's come back on its serial line
/// (`baremetal: ready ...`) and go to the host's stdin.
fn baremetal(root: &Path, work: &Path, proxy: &Path) -> Result<Baremetal, String> {
    ensure_rust_target(BAREMETAL_TARGET)?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target_dir = work.join("baremetal-target");
    println!("pci-sim: building the bare-metal image and its host side");
    let st = Command::new(&cargo)
        .args(["build", "--release", "-p", "mlx5-baremetal-example", "--target", BAREMETAL_TARGET])
        .env("RUSTFLAGS", "-C relocation-model=static")
        .env("CARGO_TARGET_DIR", &target_dir)
        .current_dir(root)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err("building the bare-metal image failed".into());
    }
    let st = Command::new(&cargo)
        .args(["build", "--release", "-p", "mlx5-baremetal-example"])
        .current_dir(root)
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !st.success() {
        return Err("building the bare-metal example's host side failed".into());
    }
    let image = target_dir.join(BAREMETAL_TARGET).join("release/mlx5-baremetal-example");
    let host_target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let host_bin = host_target.join("release/mlx5-baremetal-example");
    let wire_at = format!("127.0.0.1:{BAREMETAL_WIRE_PORT}");
    let mut host = Command::new(&host_bin)
        .args(["--peer", &wire_at])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting {}: {e}", host_bin.display()))?;
    // Its stdout, line by line, on a channel: the first line is its facts, the rest its verdict and trace.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = host.stdout.take().ok_or("no stdout of the host side")?;
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let facts = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(l) if l.starts_with("peer ") => l["peer ".len()..].trim().to_string(),
        other => {
            let _ = host.kill();
            let _ = host.wait();
            return Err(format!("the bare-metal run's host side gave no facts: {other:?}"));
        }
    };
    println!("pci-sim: bare-metal host side: peer {facts}");
    // The image's facts, once its QP is ready, go to the host side's stdin.
    let stdin = std::sync::Arc::new(std::sync::Mutex::new(host.stdin.take()));
    let to_host = std::sync::Arc::clone(&stdin);
    let hook: LineHook = Box::new(move |l: &str| {
        const TAG: &str = "baremetal: ready ";
        if let Some(i) = l.find(TAG) {
            if let Ok(mut g) = to_host.lock() {
                if let Some(mut w) = g.take() {
                    let _ = writeln!(w, "{}", l[i + TAG.len()..].trim());
                }
            }
        }
    });
    let machine = format!(
        "-machine q35,memory-backend=ram -object memory-backend-memfd,id=ram,size=256M,share=on -m 256M -kernel '{}' \
         -append 'mlx5.peer={facts}'",
        image.display()
    );
    let g = boot_with(work, proxy, &["--wire", &wire_at], "baremetal", &machine, Some(hook), BAREMETAL_TIMEOUT);
    // A host side still waiting for facts sees its stdin close.
    if let Ok(mut s) = stdin.lock() {
        s.take();
    }
    let host_status = wait_until(&mut host, Instant::now() + Duration::from_secs(150), Duration::from_millis(50))?;
    if host_status.is_none() {
        let _ = host.kill();
        let _ = host.wait();
    }
    let _ = reader.join();
    let host_lines: Vec<String> = rx.try_iter().collect();
    let g = g?;
    let host_ok = host_status.is_some_and(|s| s.success());
    println!(
        "pci-sim: bare-metal host side: {}",
        host_lines.iter().find(|l| l.starts_with("passed")).map_or("failed", String::as_str)
    );
    // Its verdict, then its device's trace.
    let host_bytes = host_lines
        .iter()
        .find_map(|l| {
            l.strip_prefix("passed ")?.split_once("bytes_checked ")?.1.split_whitespace().next()?.parse().ok()
        })
        .filter(|_| host_ok)
        .unwrap_or(0u64);
    let host_trace: Vec<(String, u64)> = host_lines
        .iter()
        .filter(|l| l.starts_with("0x"))
        .filter_map(|l| {
            let (op, m) = l.split_once(' ')?;
            Some((op.to_string(), m.trim().parse().ok()?))
        })
        .collect();
    // Torn down with no page leaked: the device holds none of the image's pages at the end.
    let passed_line =
        g.lines.iter().any(|l| l.contains("baremetal: passed")) && g.proxy_log.contains(", 0 firmware pages held");
    let first_difference = g
        .commands
        .iter()
        .zip(&host_trace)
        .position(|(a, b)| a != b)
        .or((g.commands.len() != host_trace.len()).then(|| g.commands.len().min(host_trace.len())))
        .map(|i| format!("command {i}: image {:?}, host {:?}", g.commands.get(i), host_trace.get(i)));
    let same_trace = host_ok && !host_trace.is_empty() && first_difference.is_none();
    // The image reports the payload bytes it received and checked.
    let bytes_checked = g
        .lines
        .iter()
        .find_map(|l| {
            const TAG: &str = "baremetal: bytes_checked ";
            l[l.find(TAG)? + TAG.len()..].trim().parse::<u64>().ok()
        })
        .filter(|_| passed_line && g.passed)
        .unwrap_or(0);
    Ok(Baremetal {
        passed: g.passed && passed_line && host_ok && bytes_checked == BAREMETAL_BYTES && host_bytes == BAREMETAL_BYTES,
        commands: g.commands.len(),
        bytes_checked,
        host_bytes_checked: host_bytes,
        same_trace,
        host_commands: host_trace.len(),
        first_difference,
        secs: g.secs,
    })
}

/// What the wire run showed.
struct WireRun {
    passed: bool,
    commands: usize,
    bytes_checked: u64,
    guest: Option<serde_json::Value>,
    host: Option<serde_json::Value>,
    host_text: String,
    secs: f64,
}

/// The host side of a wire run.
enum Host<'a> {
    /// `mlx5 pingpong --server`.
    Tool,
    /// Debian's `ibv_rc_pingpong` on the drop-in library in this directory.
    RcPingpong(&'a Path),
}

/// The guest's VFIO device against a host process: `mlx5 pingpong --server` on the host (a simulated device whose
/// wire listens on 127.0.0.1), the proxy's device plugged into that wire, and `mlx5 --device BDF pingpong
/// --client` in the guest exchanging over QEMU's user network (10.0.2.2 is the host). Both sides check every byte.
fn wire_run(
    work: &Path,
    proxy: &Path,
    tool: &Path,
    kernel: &Path,
    modules: &Path,
    side: &Host<'_>,
    guest_dropin: Option<&Path>,
) -> Result<WireRun, String> {
    let initrd = build_initramfs(work, modules, tool, false, true, guest_dropin)?;
    let (size, iters, port) = (PP_SIZE.to_string(), PP_ITERS.to_string(), WIRE_PORT.to_string());
    let mut cmd =
        match side {
            Host::Tool => {
                let mut c = Command::new(tool);
                c.args(["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port, "--gid-idx", "0", "--chk"])
                    .args(["--size", &size, "--iters", &iters, "--timeout", "300", "--json"]);
                c
            }
            Host::RcPingpong(lib) => {
                let mut c = Command::new("ibv_rc_pingpong");
                crate::libibverbs::on_dropin(&mut c, lib, &format!("sim:wire=listen:127.0.0.1:{}", WIRE_PORT + 1));
                c.args(["-g", "0", "-c", "-s", &size, "-n", &iters, "-p", &port]);
                c
            }
        };
    let mut host = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting the host side of the wire run: {e}"))?;
    let wire_at = format!("127.0.0.1:{}", WIRE_PORT + 1);
    let machine = format!(
        "-machine q35,kernel-irqchip=split,memory-backend=ram -object memory-backend-memfd,id=ram,size=1G,share=on \
         -m 1G -device intel-iommu,intremap=on,caching-mode=on -smp {GUEST_CPUS} -kernel '{}' -initrd '{}' \
         -append 'console=ttyS0 panic=-1 quiet intel_iommu=on' -netdev user,id=n0 -device virtio-net-pci,netdev=n0",
        kernel.display(),
        initrd.display()
    );
    let g = boot(work, proxy, &["--wire", &wire_at], "wire", &machine);
    let host_status = wait_until(&mut host, Instant::now() + Duration::from_secs(30), Duration::from_millis(50))?;
    if host_status.is_none() {
        let _ = host.kill();
        let _ = host.wait();
    }
    let mut out = String::new();
    if let Some(mut o) = host.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut o, &mut out);
    }
    println!("pci-sim: host side: {}", out.trim());
    let g = g?;
    let guest: Option<serde_json::Value> = match guest_dropin {
        None => line(&g.lines, "remote").and_then(|j| serde_json::from_str(j).ok()),
        // ibv_rc_pingpong's own report, line by line.
        Some(_) => Some(serde_json::Value::from(
            g.lines.iter().filter_map(|l| Some(l[l.find("pci-sim: rcpp ")? + 14..].to_string())).collect::<Vec<_>>(),
        )),
    };
    let host: Option<serde_json::Value> = out.lines().rev().find_map(|l| serde_json::from_str(l).ok());
    let ok = |v: &Option<serde_json::Value>| {
        v.as_ref().is_some_and(|v| {
            v["verified"].as_bool() == Some(true)
                && v["iters"].as_u64() == Some(PP_ITERS)
                && v["size"].as_u64() == Some(PP_SIZE)
        })
    };
    let guest_ok = match guest_dropin {
        None => ok(&guest),
        Some(_) => {
            g.lines.iter().any(|l| l.contains(&format!("pci-sim: rcpp {PP_ITERS} iters in")))
                && !g.lines.iter().any(|l| l.contains("pci-sim: rcpp failed") || l.contains("invalid data"))
        }
    };
    // ibv_rc_pingpong reports `N iters in S seconds`; with -c it checks every buffer it receives.
    let host_ok = match side {
        Host::Tool => ok(&host),
        Host::RcPingpong(_) => out.contains(&format!("{PP_ITERS} iters in")) && !out.contains("invalid data"),
    };
    let passed = g.passed && host_status.is_some_and(|s| s.success()) && guest_ok && host_ok;
    Ok(WireRun {
        passed,
        commands: g.commands.len(),
        // Every byte each side receives is checked by our tool; ibv_rc_pingpong -c checks only its pattern's
        // page-start bytes, so its side is not counted.
        bytes_checked: match (passed, side) {
            (false, _) => 0,
            // Only the host tool checks every byte when the guest side is ibv_rc_pingpong.
            (true, Host::Tool) if guest_dropin.is_some() => PP_ITERS * PP_SIZE,
            (true, Host::Tool) => PP_ITERS * PP_SIZE * 2,
            (true, Host::RcPingpong(_)) => PP_ITERS * PP_SIZE,
        },
        guest,
        host,
        host_text: out.trim().to_string(),
        secs: g.secs,
    })
}

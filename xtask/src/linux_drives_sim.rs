//! `cargo xtask linux-drives-sim`: NVIDIA's own `mlx5_core` (and `mlx5_ib`) drive the simulator.
//!
//! Boots the UML kernel of `cargo xtask uml` with a busybox initramfs and `virtio_uml.device=<socket>:1234`; the
//! socket is served by `mlx5-uml-bridge`, which presents the simulated ConnectX as PCI device 0000:00:00.0. The
//! guest's `/init` prints what the probe left behind (PCI binding, RDMA devices, dmesg) and powers off. Kept in
//! `target/linux-drives-sim/`: `dmesg.txt` (the guest's kernel log), `trace.jsonl` (every firmware command the
//! simulator completed), `console.txt` and `bridge.log`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod eth;
mod opensm;
mod python;
pub use eth::Roce;

use crate::verbs_guest::{self, LIBDIR};
use crate::vfio_test::{wait_until, Cpio};
use crate::Reap;

/// `CONFIG_UML_PCI_OVER_VIRTIO_DEVICE_ID` in `xtask/uml/config.fragment`.
const VIRTIO_DEVICE_ID: u32 = 1234;
/// Bounds the whole guest run (the boot takes about a second; each verbs program is bounded in the guest too).
const BOOT_TIMEOUT: Duration = Duration::from_secs(600);
const DMESG_BEGIN: &str = "=== dmesg begin ===";
const DMESG_END: &str = "=== dmesg end ===";
const DONE: &str = "=== linux-drives-sim done ===";
/// The host file behind user mappings of the BAR window (`xtask/uml/0002-um-virt-pci-bar-file.patch`): a marker
/// the guest must read through a mapping of BAR0, and the offset where the guest stores a value we must find.
const BAR_MARK: [u8; 4] = *b"UMLB";
const BAR_STORE_OFF: u64 = 0x10;
const BAR_STORE_VAL: u32 = 0x5a5a_a5a5;

/// Lines the check reports but never fails on, each with why: harness limits, not driver/device disagreements.
/// UML's virt-pci bus has no root port (link speed, PTM) and the function models no vendor-specific capability.
const HARNESS: &[(&str, &str)] = &[
    ("Failed to get valid vendor specific ID", "no vendor-specific (VSC) capability modelled"),
    ("PTM is not supported", "no PCIe root port under UML's virt-pci"),
    ("Gb/s available PCIe bandwidth", "no PCIe root port under UML's virt-pci"),
];

/// Kernel log lines that mean the driver and the device disagreed (case-insensitive substrings).
const BAD: &[&str] =
    &["mlx5", "infiniband", "virt-pci", "virtio", "warning", "bug:", "call trace", "oops", "panic", "genirq"];
const BAD_WORDS: &[&str] = &["fail", "error", "err ", "timeout", "invalid", "unable", "can't", "cannot", "bad "];

/// rc_pingpong's exchange port (18515) as `/proc/net/tcp` prints it; the server is up when a socket on it is in
/// LISTEN (`0A`, remote address all zeros), not when the previous run's connection lingers in TIME_WAIT.
const PINGPONG_PORT_HEX: &str = "4853";
/// Each verbs program is bounded in the guest (busybox `timeout`).
const PROGRAM_TIMEOUT_S: u32 = 120;
/// The ping-pong runs: (program, message size, iterations, extra options). With `-e` the programs sleep on
/// completion events (CQ arm doorbells through the BAR file, EQEs, MSI-X into uverbs); without it they poll the
/// CQ, and UML's 100 Hz scheduler tick between two spinning processes makes an iteration take about 20 ms, so
/// that run is short.
const PINGPONGS: &[(&str, u32, u32, &str)] = &[
    ("ibv_rc_pingpong", 4096, 1000, " -e"),
    ("ibv_ud_pingpong", 2048, 1000, " -e"),
    ("ibv_rc_pingpong", 4096, 100, ""),
];
/// What goes into the guest from Debian's rdma-core.
const GUEST_BINARIES: &[&str] = &["ibv_devinfo", "ibv_rc_pingpong", "ibv_ud_pingpong"];

/// The console lines around `ibv_devinfo -v`'s output; the exit status follows the second.
const DEVINFO_BEGIN: &str = "=== ibv_devinfo begin ===";
const DEVINFO_EXIT: &str = "=== ibv_devinfo exit ";

/// How the guest names a ping-pong run on the console (its output lines, its exit line).
fn run_label(prog: &str, iters: u32, opts: &str) -> String {
    format!("{prog} -n {iters}{opts}")
}

/// What every guest's `/init` starts with: busybox's applets, the library path, the kernel's file systems, and a
/// line per PCI function with the driver bound to it.
fn init_prelude() -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin LD_LIBRARY_PATH=/{LIBDIR}
mkdir -p /proc /sys /dev /tmp
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
for d in /sys/bus/pci/devices/*; do
  [ -e "$d/vendor" ] || continue
  drv=none
  [ -e "$d/driver" ] && drv=$(basename $(readlink $d/driver))
  echo "pci: $(basename $d) vendor=$(cat $d/vendor) device=$(cat $d/device) class=$(cat $d/class) driver=$drv"
done
"#
    )
}

/// The guest's `/init`; `pingpongs`: run the ping-pongs after `ibv_devinfo` (an InfiniBand port).
fn init_script(pingpongs: bool) -> String {
    let mut pp = String::new();
    pp.push_str(&format!(
        r#"ip link set lo up
echo "{DEVINFO_BEGIN}"
timeout {PROGRAM_TIMEOUT_S} ibv_devinfo -v
echo "{DEVINFO_EXIT}$? ==="
"#
    ));
    for (prog, size, iters, opts) in PINGPONGS.iter().filter(|_| pingpongs) {
        let run = run_label(prog, *iters, opts);
        pp.push_str(&format!(
            r#"timeout {PROGRAM_TIMEOUT_S} {prog} -d mlx5_0 -s {size} -n {iters} -c{opts} > /tmp/server.txt 2>&1 &
spid=$!
n=0
while ! grep -Eq ':{PINGPONG_PORT_HEX} 0+:0000 0A' /proc/net/tcp /proc/net/tcp6 2>/dev/null && [ $n -lt 200 ]; do sleep 0.1; n=$((n+1)); done
timeout {PROGRAM_TIMEOUT_S} {prog} -d mlx5_0 -s {size} -n {iters} -c{opts} 127.0.0.1 > /tmp/client.txt 2>&1
crc=$?
wait $spid
src=$?
sed 's/^/{run} server: /' /tmp/server.txt
sed 's/^/{run} client: /' /tmp/client.txt
echo "=== {run} exit server=$src client=$crc ==="
"#
        ));
    }
    let prelude = init_prelude();
    format!(
        r#"{prelude}bar=$(head -n 1 /sys/bus/pci/devices/0000:00:00.0/resource | cut -d' ' -f1)
echo "barfile: read $(devmem $bar 32)"
devmem $((bar + {BAR_STORE_OFF})) 32 {BAR_STORE_VAL}
for i in /sys/class/infiniband/*; do [ -e "$i" ] && echo "rdma: $(basename $i) fw=$(cat $i/fw_ver 2>/dev/null) node_guid=$(cat $i/node_guid 2>/dev/null)"; done
{pp}echo "{DMESG_BEGIN}"
dmesg
echo "{DMESG_END}"
echo "{DONE}"
poweroff -f
"#
    )
}

fn initramfs(work: &Path, pingpongs: bool) -> Result<PathBuf, String> {
    initramfs_with(work, &init_script(pingpongs), GUEST_BINARIES)
}

/// The initramfs with `init` as its `/init` and the host's `binaries` (with their libraries).
fn initramfs_with(work: &Path, init: &str, binaries: &[&str]) -> Result<PathBuf, String> {
    let busybox = std::fs::read("/bin/busybox").map_err(|e| format!("/bin/busybox (busybox-static): {e}"))?;
    let mut c = Cpio::default();
    for d in ["bin", "dev", "proc", "sys", "tmp"] {
        c.dir(d);
    }
    c.file("bin/busybox", true, &busybox);
    c.symlink("bin/sh", "busybox");
    verbs_guest::ensure_packages(&["mlx5"])?;
    verbs_guest::add_userspace(&mut c, binaries, &["mlx5"])?;
    // glibc loads libgcc_s when a thread exits or is cancelled (rping's and perftest's threads): no ldd names it,
    // and without it the program aborts ("libgcc_s.so.1 must be installed for pthread_exit to work").
    let gcc_s = Path::new("/").join(LIBDIR).join("libgcc_s.so.1");
    let lib = std::fs::read(&gcc_s).map_err(|e| format!("{}: {e}", gcc_s.display()))?;
    c.file(&format!("{LIBDIR}/libgcc_s.so.1"), true, &lib);
    c.file("init", true, init.as_bytes());
    let p = work.join("initramfs.cpio");
    std::fs::write(&p, c.finish()).map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(p)
}

fn build_bridge(root: &Path) -> Result<PathBuf, String> {
    crate::cargo(root, &["build", "-q", "-p", "mlx5-uml-bridge"])?;
    Ok(root.join("target/debug/mlx5-uml-bridge"))
}

/// Waits (10 s at most) for a bridge `name` to create its socket `sock`, which UML connects to.
fn wait_for_socket(sock: &Path, name: &str) -> Result<(), String> {
    let t0 = Instant::now();
    while !sock.exists() {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(format!("mlx5-uml-bridge ({name}) did not create its socket"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Boots the UML kernel `linux` with `mem` of memory, `initrd`, one virtio-uml device per socket in `sockets` and
/// the shared BAR file; its consoles (UML's kernel messages go to its stderr console) go to the file `console`.
fn spawn_uml(
    linux: &Path,
    mem: &str,
    initrd: &Path,
    sockets: &[PathBuf],
    bar_file: &Path,
    tmpdir: &Path,
    console: &Path,
) -> Result<Reap, String> {
    let console = std::fs::File::create(console).map_err(|e| format!("{}: {e}", console.display()))?;
    let child = Command::new(linux)
        .arg(format!("mem={mem}"))
        .arg(format!("initrd={}", initrd.display()))
        .arg("con0=fd:0,fd:1")
        .arg("con=null")
        .args(sockets.iter().map(|s| format!("virtio_uml.device={}:{VIRTIO_DEVICE_ID}", s.display())))
        .arg("virt_pci.max_delay_us=2000000")
        .arg(format!("virt_pci_bar_file={}", bar_file.display()))
        .env("TMPDIR", tmpdir)
        .stdin(Stdio::null())
        .stdout(Stdio::from(console.try_clone().map_err(|e| e.to_string())?))
        .stderr(Stdio::from(console))
        .spawn()
        .map_err(|e| format!("{}: {e}", linux.display()))?;
    Ok(Reap(child))
}

/// The dmesg lines that report a disagreement.
pub(crate) fn bad_lines(dmesg: &str) -> Vec<&str> {
    dmesg
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            let about_us = BAD.iter().any(|k| l.contains(k));
            let bad = BAD_WORDS.iter().any(|w| l.contains(w)) || l.contains("warning") || l.contains("call trace");
            about_us && bad
        })
        .collect()
}

/// The text between `begin` and `end` in `s`.
fn between<'a>(s: &'a str, begin: &str, end: &str) -> Option<&'a str> {
    let a = s.find(begin)? + begin.len();
    let b = a + s[a..].find(end)?;
    Some(&s[a..b])
}

/// What `ibv_devinfo -v` must show of the simulated port (`ibv_devinfo`'s own spelling).
fn check_devinfo(console: &str, eth: bool, problems: &mut Vec<String>) {
    let Some(out) = between(console, DEVINFO_BEGIN, DEVINFO_EXIT) else {
        problems.push("ibv_devinfo did not run".into());
        return;
    };
    let exit = console.split(DEVINFO_EXIT).nth(1).and_then(|r| r.split_whitespace().next());
    if exit != Some("0") {
        problems.push(format!("ibv_devinfo -v exited {}", exit.unwrap_or("?")));
    }
    let want: &[(&str, &str)] = if eth {
        // RoCE: no netdev (mlx5e does not load), so only what the device itself says.
        &[
            ("hca_id:", "mlx5_0"),
            ("transport:", "InfiniBand (0)"),
            ("max_mtu:", "4096 (5)"),
            ("link_layer:", "Ethernet"),
        ]
    } else {
        &[
            ("hca_id:", "mlx5_0"),
            ("transport:", "InfiniBand (0)"),
            ("state:", "PORT_ACTIVE (4)"),
            ("max_mtu:", "4096 (5)"),
            ("link_layer:", "InfiniBand"),
            ("max_vl_num:", "8 (4)"),
        ]
    };
    for (key, val) in want {
        let ok = out.lines().any(|l| l.trim_start().starts_with(key) && l.trim_end().ends_with(val));
        if !ok {
            problems.push(format!("ibv_devinfo -v: no line `{key} ... {val}`"));
        }
    }
    println!("linux-drives-sim: ibv_devinfo -v shows mlx5_0 ({} lines)", out.lines().count());
}

/// Each ping-pong: both sides exit 0, and the client reports every byte and iteration.
fn check_pingpongs(console: &str, problems: &mut Vec<String>) {
    for (prog, size, iters, opts) in PINGPONGS {
        let run = run_label(prog, *iters, opts);
        let marker = format!("=== {run} exit server=");
        let Some(rest) = console.split(&marker).nth(1) else {
            problems.push(format!("{run} did not run"));
            continue;
        };
        let line = rest.lines().next().unwrap_or_default();
        if line != "0 client=0 ===" {
            problems.push(format!("{run}: exit server={line}"));
        }
        // The programs count both directions.
        let bytes = format!("{} bytes in", 2 * u64::from(*size) * u64::from(*iters));
        let client = format!("{run} client: ");
        let report = console.lines().filter(|l| l.starts_with(&client)).find(|l| l.contains(&bytes));
        match report {
            Some(r) => println!("linux-drives-sim: {r}"),
            None => {
                problems.push(format!("{prog}: the client did not report {bytes} ({iters} iterations of {size} B)"))
            }
        }
    }
}

/// Boots, checks, keeps the logs. On an InfiniBand port (the default), every check: `mlx5_core` and `mlx5_ib`
/// probe with no unexplained dmesg line, `ibv_devinfo -v` shows the device, `ibv_rc_pingpong` and
/// `ibv_ud_pingpong` run between two processes over 127.0.0.1, and the poweroff tears the function down cleanly.
/// `eth`: two Ethernet ports, each in its own UML, mlx5e's netdevs pinging each other (`linux_drives_sim/eth.rs`).
pub fn run(root: &Path, strict: bool, eth: bool) -> Result<(), String> {
    if eth {
        return eth::run(root, Roce::Cm);
    }
    let started = Instant::now();
    let linux = crate::uml::build(root)?;
    let bridge = build_bridge(root)?;
    let work = root.join("target/linux-drives-sim");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let verbs = !eth;
    let initrd = initramfs(&work, verbs)?;
    let sock = work.join("mlx5.sock");
    let _ = std::fs::remove_file(&sock);
    let trace = work.join("trace.jsonl");
    // The BAR file: sparse, BAR-sized, with the marker at offset 0.
    let bar_file = work.join("bar0.file");
    {
        let f = std::fs::File::create(&bar_file).map_err(|e| e.to_string())?;
        f.set_len(32 << 20).map_err(|e| e.to_string())?;
        std::os::unix::fs::FileExt::write_all_at(&f, &BAR_MARK, 0).map_err(|e| e.to_string())?;
    }
    let bridge_log = std::fs::File::create(work.join("bridge.log")).map_err(|e| e.to_string())?;
    let mut bridge_proc = Reap(
        Command::new(&bridge)
            .arg("--socket")
            .arg(&sock)
            .arg("--trace")
            .arg(&trace)
            .arg("--bar-file")
            .arg(&bar_file)
            .args(["--port", if eth { "eth" } else { "ib" }])
            .stderr(bridge_log)
            .spawn()
            .map_err(|e| format!("{}: {e}", bridge.display()))?,
    );
    wait_for_socket(&sock, "mlx5_0")?;
    let console_path = work.join("console.txt");
    let boot = Instant::now();
    let mut uml = spawn_uml(&linux, "256M", &initrd, std::slice::from_ref(&sock), &bar_file, &work, &console_path)?;
    let timed_out = wait_until(&mut uml.0, boot + BOOT_TIMEOUT, Duration::from_millis(50))?.is_none();
    if timed_out {
        let _ = uml.0.kill();
    }
    let boot_time = boot.elapsed();
    drop(uml);
    // The bridge ends when UML disconnects and then logs its counters; give it a moment.
    let _ = wait_until(&mut bridge_proc.0, Instant::now() + Duration::from_secs(10), Duration::from_millis(20));
    drop(bridge_proc);
    let console = String::from_utf8_lossy(&std::fs::read(&console_path).map_err(|e| e.to_string())?).into_owned();
    let mut dmesg = between(&console, DMESG_BEGIN, DMESG_END)
        .map_or(console.clone(), |d| d.trim_start_matches(['\r', '\n']).to_string());
    // What the kernel logged after the guest's dmesg: the poweroff, with the drivers' teardown.
    let after = console.split(DONE).nth(1).unwrap_or_default().to_string();
    dmesg.push_str("--- after the init script: poweroff (console) ---\n");
    dmesg.push_str(after.trim_start_matches(['\r', '\n']));
    std::fs::write(work.join("dmesg.txt"), &dmesg).map_err(|e| e.to_string())?;
    let trace_text = std::fs::read_to_string(&trace).unwrap_or_default();
    println!(
        "linux-drives-sim: guest ran {:.2} s, {} firmware commands; total {:.1} s; logs in {}",
        boot_time.as_secs_f64(),
        trace_text.lines().count(),
        started.elapsed().as_secs_f64(),
        work.display()
    );
    let mut problems = Vec::new();
    if !console.contains(DONE) {
        let why = if timed_out { format!("within {} s", BOOT_TIMEOUT.as_secs()) } else { "(UML exited)".into() };
        problems.push(format!("the guest did not finish its init script {why}"));
    }
    for l in console.lines().filter(|l| l.starts_with("pci: ") || l.starts_with("rdma: ")) {
        println!("  {l}");
    }
    if !console.lines().any(|l| l.starts_with("pci: 0000:00:00.0 vendor=0x15b3") && l.ends_with("driver=mlx5_core")) {
        problems.push("0000:00:00.0 is not bound to mlx5_core".into());
    }
    // A user process mapped BAR0 (devmem) and reached the host file both ways: the BAR-file patch works.
    let mark = u32::from_le_bytes(BAR_MARK);
    if !console.contains(&format!("barfile: read 0x{mark:08X}")) {
        problems.push(format!("a user mapping of BAR0 did not read the BAR file's marker 0x{mark:08X}"));
    }
    let mut stored = [0u8; 4];
    let f = std::fs::File::open(&bar_file).map_err(|e| e.to_string())?;
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut stored, BAR_STORE_OFF).map_err(|e| e.to_string())?;
    if u32::from_le_bytes(stored) != BAR_STORE_VAL {
        problems.push(format!("a user store to BAR0+0x{BAR_STORE_OFF:x} did not reach the BAR file"));
    } else {
        println!("linux-drives-sim: a user mapping of BAR0 reads and writes the shared BAR file");
    }
    // Every virt-pci request was well formed (a refused one is logged with its bytes).
    let bridge_log = std::fs::read_to_string(work.join("bridge.log")).unwrap_or_default();
    match bridge_log.lines().find(|l| l.contains("mlx5-uml-bridge: done:")) {
        Some(l) if l.contains(" 0 rejected,") => {}
        Some(l) => problems.push(format!("the bridge refused virt-pci requests: {}", l.trim())),
        None => problems.push("the bridge did not finish cleanly (no summary in bridge.log)".into()),
    }
    let mut known = Vec::new();
    for l in bad_lines(&dmesg) {
        if let Some((_, why)) = HARNESS.iter().find(|(k, _)| l.contains(k)) {
            known.push(format!("{} ({why})", l.trim()));
            continue;
        }
        problems.push(format!("dmesg: {}", l.trim()));
    }
    let ib = console.lines().any(|l| l.starts_with("rdma: "));
    println!("linux-drives-sim: mlx5_ib {}", if ib { "registered an RDMA device" } else { "did not register" });
    if (strict || verbs) && !ib {
        problems.push("mlx5_ib registered no RDMA device".into());
    }
    check_devinfo(&console, eth, &mut problems);
    if verbs {
        check_pingpongs(&console, &mut problems);
    }
    // The poweroff reached the firmware: the function was torn down and disabled, both accepted.
    for name in ["TEARDOWN_HCA", "DISABLE_HCA"] {
        let ok =
            trace_text.lines().any(|l| l.contains(&format!("\"name\":\"{name}\"")) && l.contains("\"status\":\"OK\""));
        if !ok {
            problems.push(format!("no successful {name} in trace.jsonl: the poweroff did not tear the function down"));
        }
    }
    for k in &known {
        println!("  known, not failing: {k}");
    }
    if problems.is_empty() {
        println!("linux-drives-sim: every check passed");
        Ok(())
    } else {
        Err(format!("linux-drives-sim: {} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

/// The step for `cargo xtask ci`: the default (InfiniBand) run, every check. The first run builds the UML kernel
/// (cached by recipe hash under `target/uml/`).
pub fn ci_step(root: &Path) -> Result<(), String> {
    run(root, false, false)
}

/// The `--eth` step for `cargo xtask ci`, whole: ping, iperf3 and ethtool -S between the two netdevs, then
/// `ibv_devinfo` and `ibv_rc_pingpong -g` over RoCEv2 (the first user context runs mlx5_core's write-combining
/// test), and over Linux's rdma_cm `rping`, `ib_send_bw -R` and `ib_write_bw -R`.
pub fn ci_step_eth(root: &Path) -> Result<(), String> {
    eth::run(root, Roce::Cm)
}

/// `linux-drives-sim --opensm`: opensm in the guest brings two simulated InfiniBand ports on one cable to Active
/// (`linux_drives_sim/opensm.rs`).
pub fn run_opensm(root: &Path) -> Result<(), String> {
    opensm::run(root)
}

/// `linux-drives-sim --python [--eth]`: rdma-core's Python test suite in the guest, on an InfiniBand or a RoCE
/// port (`linux_drives_sim/python.rs`).
pub fn run_python(root: &Path, eth: bool) -> Result<(), String> {
    python::run(root, eth)
}

/// `linux-drives-sim --eth [--no-cm | --no-rdma]`: the two-port Ethernet run (`linux_drives_sim/eth.rs`).
pub fn run_eth(root: &Path, roce: Roce) -> Result<(), String> {
    eth::run(root, roce)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmesg_error_lines_are_found_and_benign_ones_kept() {
        let d = "[    0.3] mlx5_core 0000:00:00.0: firmware version: 16.35.2000\n\
                 [    0.4] mlx5_core 0000:00:00.0: mlx5_cmd_out_err:838: QUERY_ADAPTER(0x101) op_mod(0x0) failed, status bad operation(0x2)\n\
                 [    0.5] Run /init as init process\n\
                 [    0.6] WARNING: CPU: 0 PID: 1 at drivers/infiniband/core/device.c:100\n";
        let bad = bad_lines(d);
        assert_eq!(bad.len(), 2);
        assert!(bad[0].contains("QUERY_ADAPTER"));
        assert!(bad[1].contains("WARNING"));
    }
}

//! `cargo xtask linux-drives-sim --python [--eth]`: rdma-core's own Python test suite (Debian's python3-pyverbs
//! and the tests it ships in `/usr/share/doc/rdma-core/tests`) inside UML, on Linux's `mlx5_ib` and rdma-core's
//! mlx5 provider over the simulated ConnectX-5: an InfiniBand port, or with `--eth` a RoCE port (mlx5e's netdev
//! up with an IPv4 address, so the GID table holds RoCEv2 GIDs).
//!
//! The guest's initramfs is busybox only. Its `/init` mounts the host's root read-only through hostfs, with the
//! guest's own proc, sysfs, devtmpfs and tmpfs over it, mounts the work directory read-write at `/tmp/out`, and
//! chroots into it: the suite runs with the host's Debian python3, pyverbs, libibverbs and mlx5 provider. The
//! guest side (`pyverbs_runner.py`) runs each test module in a child process and reports every test; a child
//! that dies or hangs costs only the test it was running (recorded as an error with why), and a new child runs
//! the rest.
//!
//! Writes `target/linux-drives-sim/python-ib.json` (or `python-eth.json`): `passed`, `failed` (failures and
//! errors), `skipped`, `tests` (each test's status, reason and seconds) and `skip_classes` (the skips grouped by
//! what they need). Kept in `target/linux-drives-sim/python-{ib,eth}/`: `console.txt`, `dmesg.txt`,
//! `results.jsonl`, `tests.log` (the tests' own output), `trace.jsonl`, `bridge.log`. To rerun some modules
//! while debugging, `MLX5_PYTHON_ONLY=test_mr,test_qp` runs only those (the JSON then counts only them).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{
    bad_lines, build_bridge, init_prelude, initramfs_with, spawn_uml, wait_for_socket, Reap, DMESG_BEGIN, DMESG_END,
    DONE, HARNESS,
};
use crate::vfio_test::{self, wait_until};

/// The guest side: runs the suite module by module and writes one JSON line per test.
const RUNNER: &str = include_str!("pyverbs_runner.py");
/// Where Debian's python3-pyverbs puts rdma-core's tests (some gzip-compressed).
const TESTS: &str = "/usr/share/doc/rdma-core/tests";
/// One test's bound in the guest: a test that gives no result in this time is killed and recorded as an error.
const TEST_TIMEOUT_S: u32 = 180;
/// The whole guest run.
const SUITE_TIMEOUT: Duration = Duration::from_secs(3600);
/// The RoCE port's netdev address (its RoCEv2 GIDs follow from it).
const ETH_ADDR: &str = "10.36.0.1/24";
const ETH_MAC: &str = "02:36:00:00:00:01";
/// The BAR file's size (sparse), as the other runs make it.
const BAR_FILE_BYTES: u64 = 32 << 20;
/// `mlx5-uml-bridge --memic-size`: 256 KiB of device memory.
const MEMIC_BYTES: &str = "262144";

/// Skip reasons (case-insensitive substrings of the test's own message), each with what the test needs that this
/// setup lacks: another vendor's or another port type's hardware, host hardware UML has not, or a device feature
/// the simulator does not model and so does not report (mlx5_ib or rdma-core then answers EOPNOTSUPP). A skip
/// whose reason matches none is a problem of the run.
const SKIP_CLASSES: &[(&str, &str)] = &[
    ("over non EFA device", "an AWS EFA device (another vendor's provider)"),
    ("on Ethernet link layer with Eswitch", "an Ethernet port in switchdev (eswitch) mode"),
    ("must be in switchdev mode", "an Ethernet port in switchdev (eswitch) mode"),
    ("QP UDP sport", "setting a RoCE QP's UDP source port (`rts2rts_qp_udp_sport`, `opt_param_mask_95_32`: rdma-core's layouts only, not modelled)"),
    ("root on Ethernet link layer", "an Ethernet link layer: raw packet QPs and flow steering (a RoCE port, --eth)"),
    ("is InfiniBand , skip RoCE", "an Ethernet link layer (a RoCE port, --eth)"),
    ("doesn't have net interface", "a netdev with an IP address for rdma_cm (a RoCE port, --eth)"),
    ("No supported port is up", "a RoCEv2 GID (the test filters for one; a RoCE port, --eth)"),
    ("ODP", "on-demand paging (no ODP capabilities: not modelled)"),
    ("additional access flags", "on-demand paging access (IBV_ACCESS_ON_DEMAND: not modelled)"),
    // Device memory is offered (--memic-size below), but no MEMIC operation (`memic_operations` 0: MODIFY_MEMIC
    // and its atomic operation addresses are not modelled). Under UML they could not work as they are: a
    // test-and-set is a load with a side effect on a user mapping of BAR pages, which UML backs with a plain file
    // that the bridge only polls for changed doorbells; no load reaches the simulator.
    ("MEMIC atomic operations", "MEMIC atomic operations (memic_operations 0, MODIFY_MEMIC: not modelled)"),
    ("dmabuf", "a GPU render node that exports dma-bufs (none in UML)"),
    ("cuda-python", "an NVIDIA GPU with cuda-python (none in UML)"),
    ("Crypto login", "the crypto engine and its login credentials (not modelled)"),
    // DevX creates mlx5dv mkeys and their list and interleaved UMRs run; only signature keys are refused.
    ("Create Mkey is not supported", "mlx5dv signature mkeys (signature offload, BSF: not modelled)"),
    // The UMR send ops are modelled; what still refuses the QP is DMA memcpy, signature pipelining or crypto.
    ("Create Mlx5DV QP is not supported", "mlx5dv QP features: DMA memcpy, signature pipelining, crypto (not modelled)"),
    ("DC QP is not supported", "the DC transport (no `dct` capability: not modelled)"),
    ("DCI caps", "the DC transport with DCI streams (not modelled)"),
    // The rdma_cm tests run each side in a process of its own and report only that the active one skipped; the
    // one test here that does so is test_rdmacm_async_traffic_dc_external_qp, whose active side makes a DC QP.
    ("SkipTest occurred on active side", "the DC transport, on the rdma_cm test's active side (not modelled)"),
    // On a RoCE port the raw packet QPs now work, so test_mlx5_dr gets as far as its software steering domain,
    // which rdma-core builds through DevX (EOPNOTSUPP without it).
    ("DrTable creation failed", "mlx5dv direct rule (software steering) tables, built through DevX (not modelled)"),
    // DevX user contexts are modelled (sim/src/fw/uctx.rs); the DevX traffic test builds its commands with scapy,
    // which the guest does not have: with it, it would need CQs and QPs on UMEM (cq_umem_id, dbr_umem_id: fields
    // only rdma-core's mlx5_ifc.h names, not vendored).
    ("scapy package", "scapy for the DevX tests' commands (not installed: CQs and QPs on UMEM are not modelled)"),
    ("NIC flow table does not support reformat", "packet reformat (encap) actions in NIC flow tables (not modelled)"),
    ("reserved QP number", "reserved QP numbers (a DevX general object named only in rdma-core's layouts: not modelled)"),
    ("schedule elements", "QoS scheduling elements (DevX general objects of rdma-core's layouts: not modelled)"),
    // The test asks for the BlueFlame type first; mlx5_ib offers it only where mlx5_core's write-combining test found
    // write combining (`mlx5_wc_support_get`), which the simulator never reports (ARCHITECTURE.md).
    ("UAR allocation", "BlueFlame UARs through DevX (no write combining: the device runs WQEs from memory)"),
    ("VAR allocation", "VirtIO access regions (VAR: not modelled)"),
    ("Tag matching", "tag matching (XRQ, TM offload: not modelled)"),
    ("LAG affinity", "LAG: two ports bonded (one port simulated)"),
    ("Huge pages", "2 MiB huge pages in the guest (none reserved in UML)"),
    ("PCI device must be passed", "a PCI function handed to rdma-core's mlx5 VFIO driver (--pci-dev)"),
    // Only rdma-core's rxe provider offers it: neither Linux 6.12's mlx5_ib nor rdma-core's mlx5 provider does.
    ("Extended QP is not supported", "RDMA atomic write (IBV_QP_EX_WITH_ATOMIC_WRITE: no mlx5 driver offers it)"),
];

fn init_script(eth: bool, out: &Path, only: &str) -> String {
    let prelude = init_prelude();
    let out = out.display();
    let net = if eth {
        format!(
            r#"for n in /sys/class/infiniband/mlx5_0/device/net/*; do nd=$(basename $n); done
ip link set $nd up
ip addr add {ETH_ADDR} dev $nd
n=0
while [ "$(cat /sys/class/infiniband/mlx5_0/ports/1/state)" != "4: ACTIVE" ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n+1)); done
sleep 1
echo "netdev: $nd $(cat /sys/class/net/$nd/operstate) port $(cat /sys/class/infiniband/mlx5_0/ports/1/state)"
"#
        )
    } else {
        String::new()
    };
    format!(
        r#"{prelude}ip link set lo up
{net}mkdir -p /host
mount -t hostfs -o ro none /host || echo "hostfs: mount failed"
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -t devtmpfs dev /host/dev
mkdir -p /host/dev/shm /host/dev/pts
mount -t tmpfs shm /host/dev/shm
mount -t devpts pts /host/dev/pts
mount -t tmpfs tmp /host/tmp
mount -t tmpfs run /host/run
mkdir -p /host/tmp/out
mount -t hostfs -o {out} none /host/tmp/out || echo "hostfs: mount of the work directory failed"
for i in /sys/class/infiniband/*; do [ -e "$i" ] && echo "rdma: $(basename $i) state=$(cat $i/ports/1/state) link_layer=$(cat $i/ports/1/link_layer)"; done
chroot /host /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/tmp PYTHONDONTWRITEBYTECODE=1 \
  /usr/bin/python3 /tmp/out/tests/runner.py --tests /tmp/out/tests --dev mlx5_0 \
  --out /tmp/out/results.jsonl --log /tmp/out/tests.log --timeout {TEST_TIMEOUT_S} --only "{only}"
echo "=== runner exit $? ==="
echo "{DMESG_BEGIN}"
dmesg
echo "{DMESG_END}"
echo "{DONE}"
poweroff -f
"#
    )
}

/// A fresh copy of the shipped tests, decompressed, with the runner beside them.
fn prepare_tests(dir: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(dir);
    vfio_test::run(Command::new("cp").arg("-r").arg(TESTS).arg(dir))?;
    vfio_test::run(Command::new("sh").arg("-c").arg("gunzip -f *.gz").current_dir(dir))?;
    std::fs::write(dir.join("runner.py"), RUNNER).map_err(|e| format!("{}: {e}", dir.display()))
}

/// What a test skipped for `reason` needs, when the reason is a known one.
fn skip_needs(reason: &str) -> Option<&'static str> {
    let r = reason.to_ascii_lowercase();
    SKIP_CLASSES.iter().find(|(k, _)| r.contains(&k.to_ascii_lowercase())).map(|(_, n)| *n)
}

/// The report from the runner's lines: counts, the tests, and the skips by what they need (`needs` empty for a
/// reason no class names).
fn report(results: &str, port: &str) -> Value {
    let mut tests = Vec::new();
    let (mut passed, mut failed, mut skipped) = (0u32, 0u32, 0u32);
    // (needs, the reasons given, the tests)
    let mut classes: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
    for line in results.lines() {
        let Ok(t) = serde_json::from_str::<Value>(line) else { continue };
        let id = t["id"].as_str().unwrap_or_default().to_string();
        let status = t["status"].as_str().unwrap_or_default();
        let reason = t["reason"].as_str().unwrap_or_default().trim().to_string();
        match status {
            "passed" => passed += 1,
            "skipped" => {
                skipped += 1;
                let needs = skip_needs(&reason).unwrap_or_default().to_string();
                // An unnamed reason is a class of its own.
                let key = |c: &(String, Vec<String>, Vec<String>)| {
                    if needs.is_empty() {
                        c.0.is_empty() && c.1.contains(&reason)
                    } else {
                        c.0 == needs
                    }
                };
                match classes.iter_mut().find(|c| key(c)) {
                    Some(c) => {
                        if !c.1.contains(&reason) {
                            c.1.push(reason);
                        }
                        c.2.push(id.clone());
                    }
                    None => classes.push((needs, vec![reason], vec![id.clone()])),
                }
            }
            _ => failed += 1,
        }
        tests.push(t);
    }
    classes.sort_by(|a, b| b.2.len().cmp(&a.2.len()).then(a.0.cmp(&b.0)));
    let skip_classes: Vec<Value> = classes
        .into_iter()
        .map(|(needs, reasons, ids)| json!({"needs": needs, "count": ids.len(), "reasons": reasons, "tests": ids}))
        .collect();
    json!({
        "port": port,
        "passed": passed,
        "failed": failed,
        "skipped": skipped,
        "skip_classes": skip_classes,
        "tests": tests,
    })
}

pub(super) fn run(root: &Path, eth: bool) -> Result<(), String> {
    let started = Instant::now();
    let port = if eth { "eth" } else { "ib" };
    let linux = crate::uml::build(root)?;
    let bridge = build_bridge(root)?;
    if !crate::uml::installed("python3-pyverbs") {
        vfio_test::apt_install(&["python3-pyverbs"])?;
    }
    let base = root.join("target/linux-drives-sim");
    let work = base.join(format!("python-{port}"));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let work = work.canonicalize().map_err(|e| format!("{}: {e}", work.display()))?;
    prepare_tests(&work.join("tests"))?;
    for f in ["results.jsonl", "tests.log"] {
        let _ = std::fs::remove_file(work.join(f));
    }
    // Module names only: letters, digits, `_` and `,` (the value goes into the guest's shell script).
    let only = std::env::var("MLX5_PYTHON_ONLY").unwrap_or_default();
    if !only.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ',') {
        return Err(format!("MLX5_PYTHON_ONLY={only:?}: module names separated by commas"));
    }
    let initrd = initramfs_with(&work, &init_script(eth, &work, &only), &["ibv_devinfo"])?;
    let sock = work.join("mlx5.sock");
    let _ = std::fs::remove_file(&sock);
    let bar_file = work.join("bar0.file");
    std::fs::File::create(&bar_file)
        .and_then(|f| f.set_len(BAR_FILE_BYTES))
        .map_err(|e| format!("{}: {e}", bar_file.display()))?;
    let log = std::fs::File::create(work.join("bridge.log")).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(&bridge);
    cmd.arg("--socket").arg(&sock).arg("--trace").arg(work.join("trace.jsonl")).arg("--bar-file").arg(&bar_file);
    if eth {
        cmd.args(["--port", "eth", "--mac", ETH_MAC]);
    } else {
        cmd.args(["--port", "ib"]);
    }
    // Device memory (MEMIC): 256 KiB in the BAR file, where rdma-core maps it (DMTest, DM MRs).
    cmd.args(["--memic-size", MEMIC_BYTES]);
    let mut bridge_proc = Reap(cmd.stderr(log).spawn().map_err(|e| format!("{}: {e}", bridge.display()))?);
    wait_for_socket(&sock, "mlx5_0")?;
    let console_path = work.join("console.txt");
    let boot = Instant::now();
    let mut uml = spawn_uml(&linux, "1G", &initrd, std::slice::from_ref(&sock), &bar_file, &work, &console_path)?;
    let timed_out = wait_until(&mut uml.0, boot + SUITE_TIMEOUT, Duration::from_millis(200))?.is_none();
    if timed_out {
        let _ = uml.0.kill();
    }
    let guest_time = boot.elapsed();
    drop(uml);
    let _ = wait_until(&mut bridge_proc.0, Instant::now() + Duration::from_secs(10), Duration::from_millis(20));
    drop(bridge_proc);
    let console = String::from_utf8_lossy(&std::fs::read(&console_path).map_err(|e| e.to_string())?).into_owned();
    let dmesg = super::between(&console, DMESG_BEGIN, DMESG_END).unwrap_or(&console).to_string();
    std::fs::write(work.join("dmesg.txt"), &dmesg).map_err(|e| e.to_string())?;
    let results = std::fs::read_to_string(work.join("results.jsonl")).unwrap_or_default();
    let rep = report(&results, port);
    let json_path = base.join(format!("python-{port}.json"));
    let text = serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?;
    std::fs::write(&json_path, text + "\n").map_err(|e| format!("{}: {e}", json_path.display()))?;
    let (passed, failed, skipped) = (&rep["passed"], &rep["failed"], &rep["skipped"]);
    println!(
        "linux-drives-sim --python{}: {passed} passed, {failed} failed, {skipped} skipped; guest ran {:.0} s, \
         total {:.0} s; {}",
        if eth { " --eth" } else { "" },
        guest_time.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        json_path.display()
    );
    for c in rep["skip_classes"].as_array().into_iter().flatten() {
        let needs = c["needs"].as_str().filter(|n| !n.is_empty()).unwrap_or("?");
        println!("  skipped {:>3}: needs {needs}", c["count"]);
    }
    let mut problems = Vec::new();
    if !console.contains(DONE) {
        problems.push(format!("the guest did not finish{}", if timed_out { " in time" } else { " (UML exited)" }));
    }
    for t in rep["tests"].as_array().into_iter().flatten() {
        let status = t["status"].as_str().unwrap_or_default();
        if status != "passed" && status != "skipped" {
            let reason = t["reason"].as_str().unwrap_or_default().trim();
            let last = reason.lines().last().unwrap_or_default();
            problems.push(format!("{} {status}: {last}", t["id"].as_str().unwrap_or_default()));
        }
    }
    for c in rep["skip_classes"].as_array().into_iter().flatten() {
        if c["needs"].as_str().unwrap_or_default().is_empty() {
            problems.push(format!("a skip no class names with what it needs: {}", c["reasons"]));
        }
    }
    if rep["passed"].as_u64().unwrap_or(0) == 0 {
        problems.push("no test passed".into());
    }
    // The suite makes the driver refuse bad requests on purpose; what counts here is a kernel-level problem.
    for l in bad_lines(&dmesg) {
        let ll = l.to_ascii_lowercase();
        if HARNESS.iter().any(|(k, _)| l.contains(k)) {
            continue;
        }
        if ["call trace", "oops", "panic", "bug:", "warning"].iter().any(|k| ll.contains(k)) {
            problems.push(format!("dmesg: {}", l.trim()));
        }
    }
    if problems.is_empty() {
        println!("linux-drives-sim --python: every check passed");
        Ok(())
    } else {
        Err(format!("linux-drives-sim --python: {} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_counts_and_groups_skips() {
        let lines = r#"{"id": "tests.a.A.test_1", "status": "passed", "reason": "", "seconds": 0.1}
{"id": "tests.a.A.test_2", "status": "error", "reason": "the test process died (signal 11)", "seconds": null}
{"id": "tests.a.A.test_3", "status": "skipped", "reason": "something new", "seconds": 0.0}
{"id": "tests.a.A.test_5", "status": "skipped", "reason": "Test is not supported on Ethernet link layer with Eswitch", "seconds": 0.0}
{"id": "tests.a.A.test_6", "status": "skipped", "reason": "Device must be in switchdev mode", "seconds": 0.0}
{"id": "tests.a.A.test_4", "status": "failed", "reason": "AssertionError", "seconds": 0.2}
not json
"#;
        let r = report(lines, "ib");
        assert_eq!((r["passed"].as_u64(), r["failed"].as_u64(), r["skipped"].as_u64()), (Some(1), Some(2), Some(3)));
        assert_eq!(r["tests"].as_array().map(Vec::len), Some(6));
        // Two reasons, one need; the unknown reason is its own class with no need named.
        let c = &r["skip_classes"][0];
        assert_eq!(c["needs"], "an Ethernet port in switchdev (eswitch) mode");
        assert_eq!((c["count"].as_u64(), c["reasons"].as_array().map(Vec::len)), (Some(2), Some(2)));
        let c = &r["skip_classes"][1];
        assert_eq!((c["needs"].as_str(), c["reasons"][0].as_str()), (Some(""), Some("something new")));
    }

    #[test]
    fn the_dr_table_skip_is_classed_as_needing_devx() {
        let r = "Operation not supported (DrTable creation failed.. Errno: 95, Operation not supported)";
        assert!(skip_needs(r).is_some_and(|n| n.starts_with("mlx5dv direct rule")));
    }

    #[test]
    fn the_init_scripts_parse() {
        for eth in [false, true] {
            let s = init_script(eth, Path::new("/w"), "test_mr,test_qp");
            let ok = Command::new("/bin/busybox").args(["sh", "-n", "-c", &s]).status().is_ok_and(|st| st.success());
            assert!(ok || !Path::new("/bin/busybox").exists(), "busybox sh -n refuses the init script");
        }
    }
}

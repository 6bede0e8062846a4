//! The `mlx5` tool as a user runs it: `devinfo`, `devinfo --json`, the global `--trace`, and error exits.

use std::process::Command;

fn mlx5(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mlx5")).args(args).output().expect("running mlx5")
}

#[test]
fn devinfo_prints_what_ibv_devinfo_users_expect() {
    let o = mlx5(&["devinfo"]);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    for needle in ["hca_id:\tmlx5_0", "fw_ver:\t\t\t\t16.35.2000", "vendor_part_id:\t\t\t4119", "max_qp:\t\t\t\t262144"]
    {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert!(text.contains("state:\t\t\tPORT_ACTIVE (4)") && text.contains("link_layer:\t\tEthernet"), "{text}");
}

#[test]
fn devinfo_json_has_the_documented_keys() {
    let o = mlx5(&["devinfo", "--json"]);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    for key in ["fw_version", "vendor_id", "device_id", "max_qp", "max_cqe", "max_mr", "max_sge", "max_inline_data"] {
        assert!(!v[key].is_null(), "key {key} missing: {v}");
    }
    assert_eq!(v["fw_version"], "16.35.2000");
    assert_eq!(v["device_id"], "0x1017");
    assert_eq!(v["max_cqe"], (1u64 << 22) - 1);
    let ports = v["ports"].as_array().expect("ports is a list");
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0]["state"], "PORT_ACTIVE");
    assert_eq!(ports[0]["active_mtu"], 1024);
    assert_eq!(ports[0]["link_layer"], "Ethernet");
}

#[test]
fn trace_is_a_global_option_writing_json_lines() {
    let dir = std::env::temp_dir().join(format!("mlx5-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.jsonl");
    let o = mlx5(&["--trace", path.to_str().unwrap(), "devinfo"]);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() > 30, "the whole life cycle is traced ({} lines)", lines.len());
    for l in &lines {
        for key in ["opcode", "op_mod", "input", "output", "status", "syndrome"] {
            assert!(l.get(key).is_some(), "key {key} missing in {l}");
        }
    }
    assert_eq!(lines[0]["opcode"], "ENABLE_HCA");
    assert_eq!(lines.last().unwrap()["opcode"], "DISABLE_HCA");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn errors_are_one_line_and_a_failing_exit() {
    let o = mlx5(&["no-such-command"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("mlx5: unknown command"), "{err}");

    let o = mlx5(&["--trace", "/nonexistent-dir/t.jsonl", "devinfo"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("failed to write the command trace"), "{err}");
}

#[test]
fn pingpong_verifies_data_and_reports_figures() {
    let out = mlx5(&["pingpong", "--size", "2048", "--iters", "50", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["iters"].as_u64(), v["size"].as_u64(), v["verified"].as_bool()), (Some(50), Some(2048), Some(true)));
    assert!(v["avg_latency_us"].as_f64().unwrap() > 0.0);
    assert!(v["bandwidth_mbps"].as_f64().unwrap() > 0.0);
    let out = mlx5(&["--threaded", "pingpong", "--size", "1", "--iters", "10"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("data verified"));
    let out = mlx5(&["pingpong", "--size", "0"]);
    assert!(!out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);
}

/// `--device` on a machine without such a VFIO device: one line naming why, a failing exit, no panic. Which reason
/// depends on the machine (no device at that address, no IOMMU, not bound to vfio-pci), so the test accepts each.
#[test]
fn a_vfio_device_that_cannot_be_opened_is_one_clear_line() {
    for cmd in ["devinfo", "pingpong", "fw-tour"] {
        let o = mlx5(&["--device", "0000:00:00.0", cmd]);
        assert!(!o.status.success());
        let err = String::from_utf8(o.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("mlx5: "), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        let known = ["no PCI device", "no IOMMU group", "not vfio-pci", "not viable", "not loaded", "permission"];
        assert!(known.iter().any(|k| err.contains(k)), "{err}");
        assert!(o.stdout.is_empty());
    }
    let o = mlx5(&["--device", "3:0", "devinfo"]);
    assert_eq!(
        String::from_utf8(o.stderr).unwrap(),
        "mlx5: \"3:0\" is not a PCI address (expected DDDD:BB:DD.F, e.g. 0000:03:00.0)\n"
    );
    let o = mlx5(&["--device", "0000:7f:1f.7", "devinfo"]);
    assert_eq!(
        String::from_utf8(o.stderr).unwrap(),
        "mlx5: no PCI device 0000:7f:1f.7 (nothing at /sys/bus/pci/devices/0000:7f:1f.7)\n"
    );
}

#[test]
fn bind_needs_an_address_and_refuses_other_vendors() {
    let o = mlx5(&["bind"]);
    assert!(!o.status.success());
    assert_eq!(String::from_utf8(o.stderr).unwrap(), "mlx5: bind needs a PCI address\n");
    let o = mlx5(&["unbind", "0000:7f:1f.7"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
}

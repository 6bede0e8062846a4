//! The `mlx5` tool as a user runs it: `devinfo`, `devinfo --json`, the global `--trace`, and error exits.

use std::process::Command;

fn mlx5(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mlx5")).args(args).output().expect("running mlx5")
}

/// The error's lines: a failed run prints one line; a usage error prints one line, then the usage.
fn error_lines(err: &str) -> usize {
    err.lines().take_while(|l| !l.starts_with("usage: ")).count()
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
    assert_eq!(error_lines(&err), 1, "{err}");
    assert!(err.starts_with("mlx5: unknown command"), "{err}");

    let o = mlx5(&["--trace", "/nonexistent-dir/t.jsonl", "devinfo"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(error_lines(&err), 1, "{err}");
    assert!(err.contains("cannot create the trace file"), "{err}");
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
    assert_eq!(error_lines(&String::from_utf8_lossy(&out.stderr)), 1);
}

/// `--device` on a machine without such a VFIO device: one line naming why, a failing exit, no panic. Which reason
/// depends on the machine (no device at that address, no IOMMU, not bound to vfio-pci), so the test accepts each.
#[test]
fn a_vfio_device_that_cannot_be_opened_is_one_clear_line() {
    for cmd in ["devinfo", "pingpong", "fw-tour"] {
        let o = mlx5(&["--device", "0000:00:00.0", cmd]);
        assert!(!o.status.success());
        let err = String::from_utf8(o.stderr).unwrap();
        assert_eq!(error_lines(&err), 1, "{err}");
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
    assert!(String::from_utf8(o.stderr).unwrap().starts_with("mlx5: bind needs a PCI address\nusage: "));
    let o = mlx5(&["unbind", "0000:7f:1f.7"]);
    assert!(!o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(error_lines(&err), 1, "{err}");
}

/// A fresh directory for one test's files.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mlx5-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn trace_decode_prints_commands_with_their_fields_by_name() {
    let dir = scratch("decode");
    let path = dir.join("t.jsonl");
    let o = mlx5(&["--trace", path.to_str().unwrap(), "devinfo"]);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));

    let o = mlx5(&["trace", "decode", path.to_str().unwrap()]);
    assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
    assert!(o.stderr.is_empty());
    let text = String::from_utf8(o.stdout).unwrap();
    // One block per command, headed by opcode, op_mod, status and syndrome.
    assert!(text.starts_with("#0 ENABLE_HCA(0x104) op_mod 0x0 status OK(0x0) syndrome 0x0\n"), "{text}");
    assert!(text.contains("  input (enable_hca_in, 16 bytes):\n    opcode = 0x104\n"), "{text}");
    let blocks: Vec<&str> = text.split("\n\n").collect();
    let traced = std::fs::read_to_string(&path).unwrap().lines().count();
    assert_eq!(blocks.len(), traced, "one block per traced command");
    assert!(blocks.last().unwrap().starts_with(&format!("#{} DISABLE_HCA(0x105)", traced - 1)));
    // QUERY_HCA_CAP: the general capabilities by dotted path (the capability type comes from op_mod).
    // The last current image: after SET_HCA_CAP gave log_max_qp 18 (firmware's own default is 14).
    let cur_caps = blocks.iter().rfind(|b| b.contains(" QUERY_HCA_CAP(0x100) op_mod 0x1 ")).expect("current caps");
    assert!(cur_caps.contains("    capability.cmd_hca_cap.log_max_qp = 0x12\n"), "{cur_caps}");
    assert!(cur_caps.contains("    capability.cmd_hca_cap.log_max_cq_sz = 0x16\n"), "{cur_caps}");
    // op_mod 0x41: MLX5_CAP_GENERAL_2 (0x20 << 1 | current), decoded as cmd_hca_cap_2.
    let caps2 = blocks.iter().find(|b| b.contains(" QUERY_HCA_CAP(0x100) op_mod 0x41 ")).expect("caps 2");
    assert!(!caps2.contains("cmd_hca_cap.") && !caps2.contains("roce_cap."), "{caps2}");
    // Nested contexts, register data by register id, strings, scalars in hex.
    assert!(text.contains("    eq_context_entry.log_eq_size = 0x"), "{text}");
    assert!(text.contains("    register_data.pmtu_reg.oper_mtu = 0x5dc\n"), "{text}");
    assert!(text.contains("    driver_version = \"Rust,mlx5-core,"), "{text}");
    assert!(text.contains("  output (query_pages_out, 16 bytes):\n    num_pages = 0x8\n"), "{text}");
    // Zero fields are hidden unless --all: a uid shows only where it is not 0 (the shared uid 0xffff the driver
    // gives its EQs and Q counter on a device with DevX user contexts).
    assert!(!text.contains("\n    uid = 0x0\n"), "zero fields hidden");
    assert!(text.contains("\n    uid = 0xffff\n"), "{text}");
    let all = String::from_utf8(mlx5(&["trace", "decode", "--all", path.to_str().unwrap()]).stdout).unwrap();
    assert!(all.contains("    uid = 0x0\n") && all.contains("    capability.cmd_hca_cap.log_max_qp = 0x12\n"));
    assert!(all.lines().count() > text.lines().count());
    // --hexdump: Linux's command dump instead of fields.
    let o = mlx5(&["trace", "decode", path.to_str().unwrap(), "--hexdump"]);
    assert!(o.status.success());
    let dump = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = dump.lines().collect();
    assert_eq!(lines[0], "cmd[0]: dump command data ENABLE_HCA(0x104) INPUT");
    assert_eq!(lines[1], "cmd[0]: 000: 01040000 00000000 00000000 00000000");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn trace_decode_bad_input_is_one_line_never_a_panic() {
    let dir = scratch("decode-bad");
    let one_line_error = |args: &[&str], want: &str| {
        let o = mlx5(args);
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        assert_eq!(error_lines(&err), 1, "{args:?}: {err}");
        assert!(err.starts_with("mlx5: ") && err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    let missing = dir.join("missing.jsonl");
    one_line_error(&["trace", "decode", missing.to_str().unwrap()], "cannot read trace");
    one_line_error(&["trace", "decode", dir.to_str().unwrap()], "cannot read trace");
    let not_json = dir.join("not.jsonl");
    std::fs::write(&not_json, "{\"opcode_raw\":260,\"input\":\"01040000\"}\nhello\n").unwrap();
    one_line_error(&["trace", "decode", not_json.to_str().unwrap()], "not.jsonl:2: not a trace line");
    let binary = dir.join("bin.jsonl");
    std::fs::write(&binary, [0xffu8, 0xfe, 0x00]).unwrap();
    one_line_error(&["trace", "decode", binary.to_str().unwrap()], "not UTF-8");
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    one_line_error(&["trace", "decode", empty.to_str().unwrap()], "no commands");
    one_line_error(&["trace", "decode"], "trace decode needs a file name");
    one_line_error(&["trace"], "trace needs a subcommand");
    one_line_error(&["trace", "encode", "x"], "unknown trace subcommand");

    // An opcode the headers do not name: an `unknown opcode` line, its common header decoded, success.
    let unknown = dir.join("unknown.jsonl");
    std::fs::write(&unknown, "{\"opcode_raw\":30583,\"op_mod\":1,\"input\":\"77770000000000010000000000000000\",\"output\":\"0000000000000000\",\"status_raw\":0,\"syndrome\":0}\n").unwrap();
    let o = mlx5(&["trace", "decode", unknown.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.starts_with("#0 unknown opcode 0x7777 op_mod 0x1 status OK(0x0) syndrome 0x0\n"), "{text}");
    assert!(text.contains("opcode = 0x7777"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn verbose_logs_bring_up_and_commands_on_stderr() {
    // Without -v: nothing on standard error.
    let o = mlx5(&["devinfo"]);
    assert!(o.status.success());
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
    // -v: milestones at info, no per-command lines.
    let o = mlx5(&["-v", "devinfo"]);
    assert!(o.status.success());
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("mlx5: info: device: simulated ConnectX-5"), "{err}");
    assert!(err.contains("mlx5: info: bring-up: done: firmware 16.35.2000"), "{err}");
    assert!(err.contains("mlx5: info: teardown: done"), "{err}");
    assert!(!err.contains("debug"), "{err}");
    // -vv (and -v -v, --verbose --verbose): every command and bring-up step at debug.
    for args in [&["-vv", "devinfo"][..], &["-v", "--verbose", "devinfo"][..]] {
        let o = mlx5(args);
        assert!(o.status.success());
        let err = String::from_utf8(o.stderr).unwrap();
        assert!(err.contains("mlx5: debug: bring-up step: enable hca\n"), "{err}");
        assert!(err.contains("mlx5: debug: cmd[0] ENABLE_HCA(0x104) op_mod 0x0: OK(0x0), syndrome 0x0"), "{err}");
        assert!(err.contains("mlx5: debug: bring-up step: init hca\n"), "{err}");
        assert!(err.contains("DISABLE_HCA(0x105)"), "{err}");
        // Standard output is untouched by logging.
        assert!(String::from_utf8(o.stdout).unwrap().contains("hca_id:\tmlx5_0"));
    }
    // Errors stay one line without -v.
    let o = mlx5(&["--trace", "/nonexistent-dir/t.jsonl", "devinfo"]);
    assert_eq!(String::from_utf8(o.stderr).unwrap().lines().count(), 1);
}

/// `mlx5 bench ... --json`, parsed; the run must succeed and print nothing on standard error.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    all.push("--json");
    let o = mlx5(&all);
    assert!(o.status.success(), "{all:?}: {}", String::from_utf8_lossy(&o.stderr));
    assert!(o.stderr.is_empty(), "{all:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{all:?}: {e}: {}", String::from_utf8_lossy(&o.stdout)))
}

fn f(v: &serde_json::Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} missing or not a number in {v}"))
}

/// Bandwidth figures are positive and the peak is at least the average.
fn check_bw_row(r: &serde_json::Value) {
    let (peak, avg, rate) = (f(r, "bw_peak_mb_per_sec"), f(r, "bw_avg_mb_per_sec"), f(r, "msg_rate_mpps"));
    assert!(avg > 0.0 && peak >= avg && rate > 0.0, "{r}");
    // MsgRate and BW average describe the same messages: bytes * Mpps = MB/sec * 2^20 / 10^6.
    let bytes = f(r, "bytes");
    assert!((bytes * rate * 1e6 / 1048576.0 - avg).abs() <= avg * 1e-6, "{r}");
}

/// Latency statistics are ordered as statistics must be.
fn check_lat_row(r: &serde_json::Value) {
    let [min, max, typ, avg, stdev, p99, p999] =
        ["t_min_us", "t_max_us", "t_typical_us", "t_avg_us", "t_stdev_us", "t_p99_us", "t_p99_9_us"].map(|k| f(r, k));
    assert!(min > 0.0 && min <= typ && typ <= max, "{r}");
    assert!(min <= avg && avg <= max, "{r}");
    assert!(typ <= p99 && p99 <= p999 && p999 <= max, "{r}");
    assert!(stdev >= 0.0 && stdev <= max - min, "{r}");
}

#[test]
fn bench_runs_each_test_and_reports_perftest_figures() {
    for test in ["send_bw", "write_bw", "read_bw", "send_lat", "write_lat"] {
        let v = bench_json(&[test, "--size", "256", "--iters", "50"]);
        assert_eq!(v["test"], test);
        assert_eq!((v["device"].as_str(), v["transport"].as_str()), (Some("sim"), Some("RC")), "{v}");
        assert_eq!(v["verified"], true);
        let rows = v["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 1, "{v}");
        assert_eq!((rows[0]["bytes"].as_u64(), rows[0]["iterations"].as_u64()), (Some(256), Some(50)), "{v}");
        if test.ends_with("_bw") {
            check_bw_row(&rows[0]);
            assert_eq!(v["tx_depth"], 50, "the depth is lowered to the iteration count, as perftest does");
        } else {
            check_lat_row(&rows[0]);
        }
    }
}

#[test]
fn bench_all_sweeps_powers_of_two() {
    let v = bench_json(&["write_bw", "--all", "--max-size", "4096", "--iters", "20", "--tx-depth", "8"]);
    let rows = v["rows"].as_array().unwrap();
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, (1..=12).map(|k| 1u64 << k).collect::<Vec<_>>());
    rows.iter().for_each(check_bw_row);
    let v = bench_json(&["send_lat", "--all", "--max-size", "64", "--iters", "20"]);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "{v}");
    rows.iter().for_each(check_lat_row);
    // Past the inline size too: messages then come from the registered buffer.
    let v = bench_json(&["write_lat", "--all", "--max-size", "1024", "--iters", "10", "--inline", "16"]);
    assert_eq!(v["rows"].as_array().unwrap().len(), 10);
    assert_eq!(v["inline"], 16);
}

#[test]
fn bench_on_one_device_runs_the_same_code_in_loopback() {
    for test in ["send_bw", "read_bw", "write_lat"] {
        let v = bench_json(&["--device", "sim", test, "--size", "1024", "--iters", "30"][..]);
        assert_eq!(v["device"], "sim-loopback", "{v}");
        assert_eq!(v["rows"][0]["iterations"], 30);
    }
    // The simulated firmware and datapath on their own threads: completions arrive asynchronously.
    let v = bench_json(&["--threaded", "send_bw", "--size", "4096", "--iters", "200", "--tx-depth", "16"]);
    check_bw_row(&v["rows"][0]);
}

#[test]
fn bench_prints_perftest_tables() {
    let o = mlx5(&["bench", "write_bw", "--size", "4096", "--iters", "20"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    for needle in ["RDMA_Write BW Test", " Device          : sim", "Connection type : RC", " TX depth        : 20"] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let lines: Vec<&str> = text.lines().collect();
    let heading = lines.iter().position(|l| l.contains("#bytes")).expect("a heading");
    assert_eq!(lines[heading], " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]");
    let row: Vec<&str> = lines[heading + 1].split_whitespace().collect();
    assert_eq!(row.len(), 5, "{text}");
    assert_eq!(&row[..2], ["4096", "20"]);
    assert!(lines[heading + 2].starts_with("-----"), "{text}");

    let o = mlx5(&["bench", "send_lat", "--iters", "20"]);
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("Send Latency Test"), "{text}");
    assert!(text.contains(concat!(
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]",
        "   99% percentile[usec]   99.9% percentile[usec]\n"
    )));
    let row = text.lines().find(|l| l.starts_with(" 2 ")).expect("a row for perftest's default 2 bytes");
    assert_eq!(row.split_whitespace().count(), 9, "{row}");
}

#[test]
fn bench_progress_goes_to_stderr_and_leaves_stdout_alone() {
    // --duration longer than the second after which the bar appears; --progress draws it without a terminal.
    let o = mlx5(&["bench", "write_bw", "--size", "4096", "--duration", "1.4", "--progress", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("% write_bw 4096 bytes") && err.contains("\r["), "{err:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is only the JSON object");
    assert!(v["rows"][0]["iterations"].as_u64().unwrap() > 0);
}

#[test]
fn bench_bad_arguments_are_one_line_and_a_failing_exit() {
    let one_line_error = |args: &[&str], want: &str| {
        let o = mlx5(args);
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        assert_eq!(error_lines(&err), 1, "{args:?}: {err}");
        assert!(err.starts_with("mlx5: ") && err.contains(want), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?}");
    };
    one_line_error(&["bench", "write_bw", "--size", "0"], "bench: --size must be between 1 and 8388608, not 0");
    one_line_error(&["bench", "write_bw", "--size", "lots"], "bench: --size: \"lots\" is not a byte count");
    one_line_error(&["bench", "write_bw", "--iters"], "bench: --iters needs a number");
    one_line_error(&["bench", "write_bw", "--all", "--duration", "2"], "not --duration");
    one_line_error(&["bench", "write_bw", "--max-size", "16777216", "--all"], "--max-size must be between");
    one_line_error(&["bench", "send_lat", "--tx-depth", "4"], "apply to the bandwidth tests");
    one_line_error(&["bench", "atomic_bw"], "bench: unknown test \"atomic_bw\"");
    one_line_error(&["bench"], "bench: which test?");
    one_line_error(&["bench", "write_bw", "--server"], "bench: unknown option --server");
    one_line_error(&["--trace", "/nonexistent-dir/t.jsonl", "bench", "write_bw"], "cannot create the trace file");
    one_line_error(&["--device", "0000:7f:1f.7", "bench", "write_bw"], "no PCI device 0000:7f:1f.7");
}

/// The opcodes of a trace file, with the device each line names (if any).
fn trace_opcodes(path: &std::path::Path) -> Vec<(Option<String>, String)> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["device"].as_str().map(str::to_string), v["opcode"].as_str().unwrap().to_string())
        })
        .collect()
}

const QP_COMMANDS: [&str; 4] = ["CREATE_QP", "RST2INIT_QP", "INIT2RTR_QP", "RTR2RTS_QP"];

#[test]
fn bench_traces_both_devices_into_one_file_each_line_naming_its_device() {
    let dir = scratch("bench-trace");
    let path = dir.join("bench.jsonl");
    let o = mlx5(&["--trace", path.to_str().unwrap(), "bench", "send_bw", "--iters", "50", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ops = trace_opcodes(&path);
    for dev in ["mlx5_0", "mlx5_1"] {
        let mine: Vec<&str> =
            ops.iter().filter(|(d, _)| d.as_deref() == Some(dev)).map(|(_, op)| op.as_str()).collect();
        assert_eq!(mine.first(), Some(&"ENABLE_HCA"), "{dev}");
        assert_eq!(mine.last(), Some(&"DISABLE_HCA"), "{dev}");
        for op in QP_COMMANDS {
            assert!(mine.contains(&op), "{dev}: no {op}");
        }
    }
    assert!(ops.iter().all(|(d, _)| d.is_some()), "every line names its device");
    // -vv logs every command of both devices, each by name.
    let o = mlx5(&["-vv", "bench", "send_lat", "--iters", "5"]);
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(o.status.success() && err.contains("mlx5: debug: mlx5_1: bring-up step: enable hca"), "{err}");
    assert!(err.lines().any(|l| l.starts_with("mlx5: debug: mlx5_0: cmd[") && l.contains("CREATE_QP(0x500)")));
    // The decoder shows the device in each header.
    let o = mlx5(&["trace", "decode", path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.starts_with("#0 mlx5_0: ENABLE_HCA(0x104)"), "{}", &text[..80]);
    assert!(text.lines().any(|l| l.starts_with('#') && l.contains(" mlx5_1: INIT2RTR_QP(0x503)")));
    // One device (loopback): the lines are a one-device trace, without the field.
    let o = mlx5(&["--device", "sim", "--trace", path.to_str().unwrap(), "bench", "write_lat", "--iters", "20"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ops = trace_opcodes(&path);
    assert!(ops.iter().all(|(d, _)| d.is_none()));
    assert!(QP_COMMANDS.iter().all(|q| ops.iter().any(|(_, op)| op == q)));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn link_ib_makes_the_simulated_port_infiniband() {
    let o = mlx5(&["--link", "ib", "devinfo"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8(o.stdout).unwrap().contains("link_layer:\t\tInfiniBand"));
    let o = mlx5(&["--link", "ib", "devinfo", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ports"][0]["link_layer"], "InfiniBand");
    let o = mlx5(&["--link", "eth", "devinfo", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["ports"][0]["link_layer"], "Ethernet");
    // Every subcommand on the simulator takes it, bench too (after TEST as well).
    let o = mlx5(&["--link", "ib", "pingpong", "--iters", "20"]);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("data verified"));
    let v = bench_json(&["send_lat", "--iters", "20", "--link", "ib"]);
    assert_eq!(v["link_layer"], "IB");
}

#[test]
fn ud_pingpong_verifies_data_in_text_and_json() {
    let o = mlx5(&["pingpong", "--ud", "--iters", "30"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // RoCE at the simulated 1500-byte MTU: active MTU 1024, so the default 2048 becomes 1024.
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.starts_with("1024 bytes in 30 iterations: ") && text.ends_with("data verified\n"), "{text}");
    let o = mlx5(&["--link", "ib", "pingpong", "--ud", "--iters", "30", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((v["iters"].as_u64(), v["size"].as_u64(), v["verified"].as_bool()), (Some(30), Some(2048), Some(true)));
    assert!(v["avg_latency_us"].as_f64().unwrap() > 0.0 && v["bandwidth_mbps"].as_f64().unwrap() > 0.0);
    let o = mlx5(&["--threaded", "pingpong", "--ud", "--size", "1", "--iters", "10"]);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("data verified"));
    // Traced: the UD QPs' commands are in the file.
    let dir = scratch("ud-trace");
    let path = dir.join("ud.jsonl");
    let o = mlx5(&["--trace", path.to_str().unwrap(), "pingpong", "--ud", "--iters", "5"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ops = trace_opcodes(&path);
    assert!(QP_COMMANDS.iter().all(|q| ops.iter().any(|(_, op)| op == q)));
    assert_eq!(ops.last().map(|(_, op)| op.as_str()), Some("DISABLE_HCA"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_link_and_ud_combinations_are_one_line_and_a_failing_exit() {
    for (args, want) in [
        (&["--device", "0000:03:00.0", "--link", "ib", "devinfo"][..], "with --device BDF the real port decides"),
        (&["--link", "eth", "--device", "0000:03:00.0", "bench", "send_bw"][..], "the real port decides"),
        (&["devinfo", "--ud"][..], "--ud does not apply to devinfo"),
        (&["pingpong", "--ud", "--size", "1025"][..], "larger than the port's active MTU (1024 bytes)"),
        (&["pingpong", "--ud", "--size", "0"][..], "is not between 1 and"),
    ] {
        let o = mlx5(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want) && error_lines(&err) == 1, "{args:?}: {err}");
    }
    // A link that is neither: a usage error.
    let o = mlx5(&["--link", "fc", "devinfo"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("mlx5: --link: \"fc\" is neither eth nor ib\n"));
}

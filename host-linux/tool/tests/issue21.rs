//! Issue 21's command-line defects, one test each: every one is a clear one-line error with the documented exit
//! code (2 for a usage error, followed by the usage; 1 for a run that fails) within a bounded time, or it works.

use std::ffi::OsStr;
use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Generous: each case is refused before anything runs, in milliseconds; a hang would take forever.
const BOUND: Duration = Duration::from_secs(20);

fn run<S: AsRef<OsStr>>(args: &[S]) -> (Output, Duration) {
    let start = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_mlx5")).args(args).output().expect("running mlx5");
    (o, start.elapsed())
}

/// Runs `args` and checks: exit `code`, the first line of standard error is `mlx5: ` + an error containing
/// `want`, a usage error (2) has the usage after it and nothing else, a failed run (1) has only that line.
fn refused<S: AsRef<OsStr> + std::fmt::Debug>(args: &[S], code: i32, want: &str) {
    let (o, took) = run(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
    assert!(took < BOUND, "{args:?} took {took:?}");
    let mut lines = err.lines();
    let first = lines.next().unwrap_or_default();
    assert!(first.starts_with("mlx5: ") && first.contains(want), "{args:?}: {err}");
    match code {
        2 => assert!(lines.next().is_some_and(|l| l.starts_with("usage: mlx5")), "{args:?}: {err}"),
        _ => assert_eq!(lines.next(), None, "{args:?}: {err}"),
    }
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    // A usage error runs nothing; `trace decode` streams, so the lines before a bad one are already out.
    if code == 2 {
        assert!(o.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn numbers_out_of_range_are_usage_errors_not_overflows() {
    let max = "18446744073709551615";
    refused(
        &["pingpong", "--client", "127.0.0.1:9", "--timeout", max],
        2,
        "--timeout: \"18446744073709551615\" is not between 1 and 86400",
    );
    refused(&["pingpong", "--server", "--timeout", max], 2, "is not between 1 and 86400");
    refused(&["pingpong", "--server", "--timeout", "0"], 2, "--timeout: \"0\" is not between 1 and 86400");
    refused(&["pingpong", "--server", "--port", "0"], 2, "--port: \"0\" is not between 1 and 65534");
    refused(&["pingpong", "--size", max], 2, "--size: \"18446744073709551615\" is not between 1 and 2147483648");
    refused(&["pingpong", "--iters", "+5"], 2, "--iters: \"+5\" is not a number");
    refused(&["bench", "send_bw", "--duration", "1e-300"], 2, "--duration: \"1e-300\" is not a number of seconds");
    refused(&["bench", "send_bw", "--duration", "0.0001"], 2, "is not between 0.001 and 86400 seconds");
    refused(&["bench", "send_bw", "--size", "+5"], 2, "--size: \"+5\" is not a byte count");
}

#[cfg(unix)]
#[test]
fn arguments_that_are_not_utf8_are_errors_and_file_names_need_not_be_text() {
    use std::os::unix::ffi::OsStrExt;
    let bad = OsStr::from_bytes(b"\xff\xfe");
    refused(&[OsStr::new("devinfo"), bad], 2, "argument 2 (\"\u{fffd}\u{fffd}\") is not UTF-8 text");
    refused(&[OsStr::new("pingpong"), OsStr::new("--client"), bad], 2, "is not UTF-8 text");
    // A file name is an OS string: it is used as it is, and a missing one is a run error naming it.
    refused(&[OsStr::new("trace"), OsStr::new("decode"), bad], 1, "cannot read trace");
}

#[test]
fn unknown_commands_and_options_share_one_exit_code() {
    refused(&["no-such-command"], 2, "unknown command \"no-such-command\"");
    refused(&["devinfo", "--no-such-option"], 2, "unknown option --no-such-option");
    refused(&[] as &[&str], 2, "no command given");
    let (o, took) = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("usage: mlx5") && took < BOUND);
    let (o, _) = run(&["bench", "--help"]);
    assert_eq!(o.status.code(), Some(0), "--help reads the same after a command");
}

#[test]
fn an_argument_with_control_characters_is_still_a_one_line_error() {
    // Found by the `args` fuzz target: the option was echoed as typed, newline and all.
    refused(&["--lin\nib", "devinfo"], 2, "unknown option --lin\\nib");
    refused(&["bench", "send_bw", "--x\r\x1b[2J"], 2, "unknown option --x\\r\\u{1b}[2J");
    refused(&["bench", "send_bw", "a\nb"], 2, "unexpected argument \"a\\nb\"");
}

#[test]
fn errors_are_in_words_and_a_client_keeps_to_its_timeout() {
    // Raw errno text ("No such file or directory (os error 2)", "Connection refused (os error 111)") is gone.
    refused(
        &["--trace", "/nonexistent-dir/t.jsonl", "devinfo"],
        1,
        "cannot create the trace file /nonexistent-dir/t.jsonl: its directory does not exist",
    );
    // Port 1 on loopback has no server: refused connections until the deadline, then one line, within --timeout.
    let start = Instant::now();
    refused(&["pingpong", "--client", "127.0.0.1:1", "--timeout", "1"], 1, "connection refused (nobody listening)");
    assert!(start.elapsed() < Duration::from_millis(1900), "took {:?} for --timeout 1", start.elapsed());
}

#[test]
fn options_that_do_not_apply_are_refused() {
    refused(&["fw-tour", "--json"], 2, "--json does not apply to fw-tour");
    refused(&["devinfo", "--size", "5"], 2, "--size does not apply to devinfo");
    refused(&["trace", "decode", "x", "--json"], 2, "--json does not apply to trace decode");
    refused(&["pingpong", "--timeout", "3"], 2, "--timeout goes with --server / --client");
    refused(&["pingpong", "--client", "h:1", "--bind", "127.0.0.1"], 2, "--bind goes with --server");
}

#[test]
fn arguments_are_checked_before_waiting_for_anyone() {
    // The server would wait for a client; the client would wait for a server: both refuse at once.
    refused(&["pingpong", "--server", "--bind", "127.0.0.1", "--port", "1", "--size", "0"], 2, "--size");
    refused(&["pingpong", "--client", "127.0.0.1:1", "--iters", "0"], 2, "--iters");
}

#[test]
fn a_size_too_large_for_the_device_is_refused_before_any_allocation() {
    // 2^30 + 1: one byte above the device's largest message. Refused before 4 GiB of buffers are allocated, as an
    // argument error (issue 29).
    refused(
        &["pingpong", "--size", "1073741825", "--iters", "1"],
        2,
        "too large for this device: its largest message (max_msg_sz) is 1073741824 bytes",
    );
}

/// A big message works: its buffers are aligned so the MTT takes 2 MiB pages and fits one command (it failed with
/// CREATE_MKEY IN_LENGTH before). 64 MiB keeps the test's memory small (4 buffers of 64 MiB).
#[test]
fn a_large_ping_pong_registers_its_buffers() {
    let (o, took) = run(&["pingpong", "--size", "67108864", "--iters", "1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("data verified"));
    assert!(took < Duration::from_secs(120));
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mlx5-issue21-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn trace_decode_is_strict_and_names_the_file_and_line() {
    let dir = scratch("strict");
    let f = dir.join("t.jsonl");
    let good = r#"{"opcode_raw":260,"input":"01040000","output":"00000000","status_raw":0}"#;
    for (line, want) in [
        (r#"{"input":"+1+4"}"#, "`input` is not a hex string"),
        (r#"{"input":"01040000","output":"0x00"}"#, "`output` is not a hex string"),
        (r#"{"input":"01040000","delivery":7}"#, "`delivery` is not a string"),
        (r#"{"input":"01040000","status_raw":"0"}"#, "`status_raw` is not a number"),
        (r#"{"input":"01040000","slot":-1}"#, "`slot` is not a number"),
    ] {
        std::fs::write(&f, format!("{good}\n{line}\n")).unwrap();
        let p = f.to_str().unwrap();
        refused(&["trace", "decode", p], 1, &format!("{p}:2: {want}"));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn trace_decode_reads_standard_input_with_a_dash() {
    let line =
        r#"{"opcode_raw":260,"input":"01040000000000000000000000000000","output":"0000000000000000","status_raw":0}"#;
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx5"))
        .args(["trace", "decode", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(format!("{line}\n{line}\n").as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.starts_with("#0 ENABLE_HCA(0x104)") && text.contains("\n#1 ENABLE_HCA(0x104)"), "{text}");
}

/// `/dev/zero` has no line end: the line limit stops it with an error, in bounded memory and time.
#[cfg(target_os = "linux")]
#[test]
fn trace_decode_of_an_endless_line_stops_at_the_line_limit() {
    refused(&["trace", "decode", "/dev/zero"], 1, "/dev/zero:1: longer than 67108864 bytes");
}

#[test]
fn a_five_digit_pci_domain_is_refused() {
    refused(&["--device", "00000:03:00.0", "devinfo"], 1, "\"00000:03:00.0\" is not a PCI address");
}

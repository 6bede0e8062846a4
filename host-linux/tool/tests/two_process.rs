//! `mlx5 pingpong --server` and `--client` as two processes, their simulated devices joined by the simulated
//! wire over TCP on loopback.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn mlx5() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlx5"))
}

/// A port P with P + 1 free too (the exchange and the simulated wire), as far as one can tell without holding
/// them.
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < u16::MAX && TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            drop(l);
            return p;
        }
    }
    panic!("no two consecutive free ports");
}

/// The error's lines: a failed run prints one line; a usage error prints one line, then the usage.
fn error_lines(err: &str) -> usize {
    err.lines().take_while(|l| !l.starts_with("usage: ")).count()
}

fn json(out: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(out);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text:?}"))
}

#[test]
fn server_and_client_ping_pong_across_two_processes() {
    let port = free_port_pair();
    let server = mlx5()
        .args([
            "pingpong",
            "--server",
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--size",
            "1000",
            "--iters",
            "300",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The client retries until the server is up.
    let client = mlx5()
        .args(["pingpong", "--client", &format!("127.0.0.1:{port}"), "--size", "1000", "--iters", "300", "--json"])
        .output()
        .unwrap();
    let server = server.wait_with_output().unwrap();
    assert!(client.status.success(), "client: {}", String::from_utf8_lossy(&client.stderr));
    assert!(server.status.success(), "server: {}", String::from_utf8_lossy(&server.stderr));
    for out in [&client.stdout, &server.stdout] {
        let r = json(out);
        assert_eq!(
            (r["iters"].as_u64(), r["size"].as_u64(), r["verified"].as_bool()),
            (Some(300), Some(1000), Some(true))
        );
        assert!(r["avg_latency_us"].as_f64().unwrap() > 0.0);
    }
    assert!(String::from_utf8_lossy(&server.stderr).contains(&format!("waiting for a client on port {port}")));
}

#[test]
fn a_client_whose_server_dies_fails_with_one_line_and_does_not_hang() {
    let port = free_port_pair();
    let mut server = mlx5()
        .args(["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port.to_string(), "--iters", "100000000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let client = mlx5()
        .args(["pingpong", "--client", &format!("127.0.0.1:{port}"), "--iters", "100000000", "--timeout", "5"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let start = Instant::now();
    server.kill().unwrap();
    let _ = server.wait();
    let out = client.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    // Within the QP's retry budget (0.54 s) and the link-down grace, far below the 5 s --timeout.
    assert!(start.elapsed() < Duration::from_secs(4), "the client noticed the link go down: {:?}", start.elapsed());
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    // The peer's device is gone: the outstanding SEND runs out of retries, or (no request outstanding, a receive
    // waiting) the port's link-down event ends the wait.
    assert!(
        err.starts_with("mlx5: work request") && err.contains("transport retry counter exceeded")
            || err.starts_with("mlx5: the link to the peer went down"),
        "{err}"
    );
}

#[test]
fn bad_two_process_arguments_are_one_line_errors() {
    for (args, want) in [
        (&["pingpong", "--server", "--client", "h:1"][..], "--server and --client exclude each other"),
        (&["pingpong", "--client", "h:x"][..], "is not HOST:PORT"),
        (&["pingpong", "--client", "h:1", "--port", "2"][..], "--port goes with --server"),
        (&["pingpong", "--port", "2"][..], "--port goes with --server"),
        (&["pingpong", "--server", "--threaded"][..], "--threaded does not apply to --server / --client"),
    ] {
        let out = mlx5().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want) && error_lines(&err) == 1, "{args:?}: {err}");
    }
    // Refused before waiting for anyone.
    let port = free_port_pair().to_string();
    for (args, want) in [
        (
            &["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port, "--ud", "--size", "1025"][..],
            "larger than the port's active MTU",
        ),
        (&["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port, "--iters", "0"][..], "is not between 1 and"),
    ] {
        let out = mlx5().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want) && error_lines(&err) == 1, "{args:?}: {err}");
    }
    // Nobody at the address: the client gives up after --timeout.
    let port = free_port_pair();
    let out = mlx5().args(["pingpong", "--client", &format!("127.0.0.1:{port}"), "--timeout", "1"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("cannot reach the server's simulated wire at 127.0.0.1:"), "{err}");
}

#[test]
fn a_ud_ping_pong_across_two_processes_verifies_every_byte() {
    for link in ["eth", "ib"] {
        let port = free_port_pair();
        let server = mlx5()
            .args([
                "--link",
                link,
                "pingpong",
                "--ud",
                "--server",
                "--bind",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--iters",
                "100",
            ])
            .arg("--json")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let client = mlx5()
            .args(["--link", link, "pingpong", "--ud", "--client", &format!("127.0.0.1:{port}"), "--iters", "100"])
            .output()
            .unwrap();
        let server = server.wait_with_output().unwrap();
        assert!(client.status.success(), "{link} client: {}", String::from_utf8_lossy(&client.stderr));
        assert!(server.status.success(), "{link} server: {}", String::from_utf8_lossy(&server.stderr));
        // ud_pingpong's 2048 bytes, or the simulated RoCE port's active MTU, 1024.
        let size = if link == "eth" { 1024 } else { 2048 };
        let r = json(&server.stdout);
        assert_eq!(
            (r["iters"].as_u64(), r["size"].as_u64(), r["verified"].as_bool()),
            (Some(100), Some(size), Some(true))
        );
        let text = String::from_utf8_lossy(&client.stdout);
        assert!(text.starts_with(&format!("{size} bytes in 100 iterations: ")) && text.ends_with("data verified\n"));
    }
}

#[test]
fn both_sides_trace_their_device_and_take_the_link_type() {
    let dir = std::env::temp_dir().join(format!("mlx5-two-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (st, ct) = (dir.join("server.jsonl"), dir.join("client.jsonl"));
    let port = free_port_pair();
    let server = mlx5()
        .args([
            "--link",
            "ib",
            "--trace",
            st.to_str().unwrap(),
            "pingpong",
            "--server",
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args(["--iters", "20", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let client = mlx5()
        .args(["--link", "ib", "--trace", ct.to_str().unwrap(), "pingpong", "--client", &format!("127.0.0.1:{port}")])
        .args(["--iters", "20", "--json"])
        .output()
        .unwrap();
    let server = server.wait_with_output().unwrap();
    assert!(client.status.success(), "client: {}", String::from_utf8_lossy(&client.stderr));
    assert!(server.status.success(), "server: {}", String::from_utf8_lossy(&server.stderr));
    for out in [&client.stdout, &server.stdout] {
        assert_eq!(json(out)["verified"].as_bool(), Some(true));
    }
    for path in [&st, &ct] {
        let text = std::fs::read_to_string(path).unwrap();
        let ops: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["opcode"].as_str().unwrap().to_string())
            .collect();
        for op in ["ENABLE_HCA", "CREATE_QP", "RST2INIT_QP", "INIT2RTR_QP", "RTR2RTS_QP", "DESTROY_QP"] {
            assert!(ops.iter().any(|o| o == op), "{}: no {op}", path.display());
        }
        assert_eq!(ops.last().map(String::as_str), Some("DISABLE_HCA"), "{}", path.display());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Issue 21: a server nobody connects to gives up after `--timeout`, with one line.
#[test]
fn a_server_without_a_client_gives_up_after_its_timeout() {
    let port = free_port_pair().to_string();
    let start = Instant::now();
    let out = mlx5()
        .args(["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port, "--timeout", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(start.elapsed() < Duration::from_secs(15), "{:?}", start.elapsed());
    // The waiting notice, then the error.
    assert!(err.ends_with("mlx5: no client connected within 1 s (--timeout)\n"), "{err}");
    assert_eq!(err.lines().count(), 2, "{err}");
}

/// Issue 21's remote panic: a 52-byte exchange message whose GID is not ASCII is a one-line error on the server.
#[test]
fn a_hostile_exchange_message_is_one_line_not_a_panic() {
    use std::io::Write;
    let port = free_port_pair();
    let server = mlx5()
        .args(["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port.to_string(), "--timeout", "20"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let msg = format!("0000:000000:000000:a{}a\0", "\u{e9}".repeat(15));
    assert_eq!(msg.len(), 52);
    let start = Instant::now();
    let mut s = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(15) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("the server never listened: {e}"),
        }
    };
    s.write_all(msg.as_bytes()).unwrap();
    let out = server.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(start.elapsed() < Duration::from_secs(15));
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("mlx5: the peer sent \"") && last.contains("not LID:QPN:PSN:GID"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Issue 21: a second client cannot cut a running session's simulated wire; it is refused with one line, and the
/// running session finishes with its data verified.
#[test]
fn a_second_client_is_refused_and_the_running_session_goes_on() {
    let port = free_port_pair();
    let iters = "40000";
    let server = mlx5()
        .args(["pingpong", "--server", "--bind", "127.0.0.1", "--port", &port.to_string(), "--iters", iters])
        .args(["--size", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let first = mlx5()
        .args(["pingpong", "--client", &format!("127.0.0.1:{port}"), "--iters", iters, "--size", "1000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let start = Instant::now();
    let second =
        mlx5().args(["pingpong", "--client", &format!("127.0.0.1:{port}"), "--timeout", "5"]).output().unwrap();
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(err.starts_with("mlx5: the server at 127.0.0.1:") && err.contains("has a client already"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let first = first.wait_with_output().unwrap();
    let server = server.wait_with_output().unwrap();
    assert!(first.status.success(), "first client: {}", String::from_utf8_lossy(&first.stderr));
    assert!(server.status.success(), "server: {}", String::from_utf8_lossy(&server.stderr));
    assert!(String::from_utf8_lossy(&first.stdout).contains("data verified"));
}

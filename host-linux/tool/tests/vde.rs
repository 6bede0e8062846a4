//! `mlx5 pingpong --wire vde`: the two sides on a VDE fabric, started in either order, the first one starting
//! the default switch of a private runtime directory (Debian's vde2 and libvdeplug2 must be installed:
//! `cargo xtask ci` installs them).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn mlx5() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mlx5"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A runtime directory of the test's own, so the default switch it gets is private; the switch is ended when
/// dropped.
struct Runtime(PathBuf);

impl Runtime {
    fn new(name: &str) -> Runtime {
        let d = std::env::temp_dir().join(format!("mlx5-tool-vde-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Runtime(d)
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let pid = std::fs::read_to_string(self.0.join("mlx5-sim.pid")).ok();
        if let Some(pid) = pid.as_deref().map(str::trim).filter(|p| p.parse::<u32>().is_ok()) {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn side(rt: &Path, args: &[&str]) -> Command {
    let mut c = mlx5();
    c.arg("pingpong").args(args).args(["--wire", "vde", "--json"]).env("XDG_RUNTIME_DIR", rt);
    c
}

fn verified(out: &std::process::Output, iters: u64) {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}{text}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert_eq!((r["iters"].as_u64(), r["verified"].as_bool()), (Some(iters), Some(true)), "{r}");
}

#[test]
fn rc_and_ud_across_two_processes_on_the_default_switch_client_first() {
    let rt = Runtime::new("pair");
    for extra in [&["--size", "3000"][..], &["--ud", "--size", "1000"][..]] {
        let port = free_port().to_string();
        // The client first: it waits for the server's exchange port; the fabric needs no order.
        let client = side(&rt.0, &[&["--client", &format!("127.0.0.1:{port}"), "--iters", "50"][..], extra].concat())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        let server =
            side(&rt.0, &[&["--server", "--bind", "127.0.0.1", "--port", &port, "--iters", "50"][..], extra].concat())
                .output()
                .unwrap();
        let client = client.wait_with_output().unwrap();
        verified(&server, 50);
        verified(&client, 50);
    }
    assert!(rt.0.join("mlx5-sim.vde").exists(), "the first process started the default switch");
}

#[test]
fn ib_rc_and_ud_across_two_processes_on_the_default_switch() {
    let rt = Runtime::new("ib");
    // Two InfiniBand ports by LID: RC messages of several frames, UD datagrams of one.
    for extra in [&["--size", "5000"][..], &["--ud", "--size", "1000"][..]] {
        let port = free_port().to_string();
        let ib = ["--link", "ib"];
        let server = side(
            &rt.0,
            &[&["--server", "--bind", "127.0.0.1", "--port", &port, "--iters", "50"][..], &ib, extra].concat(),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        let client =
            side(&rt.0, &[&["--client", &format!("127.0.0.1:{port}"), "--iters", "50"][..], &ib, extra].concat())
                .output()
                .unwrap();
        let server = server.wait_with_output().unwrap();
        verified(&server, 50);
        verified(&client, 50);
        let err = String::from_utf8_lossy(&client.stderr);
        assert!(err.contains(" 0 malformed, 0 LID conflicts"), "{err}");
    }
}

#[test]
fn bad_vde_arguments_are_one_line_errors() {
    for (args, want) in [
        (&["pingpong", "--server", "--wire", "tcp"][..], "is neither vde nor vde:URL"),
        (&["pingpong", "--wire", "vde"][..], "--wire vde goes with --server / --client"),
    ] {
        let out = mlx5().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let lines = err.lines().take_while(|l| !l.starts_with("usage: ")).count();
        assert!(!out.status.success() && err.contains(want) && lines == 1, "{args:?}: {err}");
    }
    // Nothing at the URL: a clear error, not a wait.
    let port = free_port().to_string();
    let out = mlx5()
        .args(["pingpong", "--server", "--port", &port, "--wire", "vde:vde:///nonexistent/mlx5-switch"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("cannot plug into the VDE fabric vde:///nonexistent"), "{err}");
}

#[test]
fn eight_processes_on_one_fabric_four_rc_pairs_and_four_ud_pairs_at_once() {
    let rt = Runtime::new("eight");
    // UD has no retransmission: a datagram a loaded switch drops (its sockets queue 10 frames) fails the run, so
    // the UD round is short.
    for (extra, iters) in [(&["--size", "3000"][..], "30"), (&["--ud", "--size", "1000"][..], "10")] {
        // Eight processes at once on the one default switch: four servers, four clients, each pair its own
        // exchange port.
        let mut running = Vec::new();
        for _ in 0..4 {
            let port = free_port().to_string();
            for role in [
                &["--client", &format!("127.0.0.1:{port}")][..],
                &["--server", "--bind", "127.0.0.1", "--port", &port][..],
            ] {
                let c = side(&rt.0, &[role, &["--iters", iters][..], extra].concat())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap();
                running.push(c);
            }
        }
        for c in running {
            verified(&c.wait_with_output().unwrap(), iters.parse().unwrap());
        }
    }
}

/// Issue 34: `--ipv4` names the port's address on the fabric too (a guest's subnet): RoCE v2 from GID index 3
/// then leaves from and goes to the named addresses, resolved by ARP; `--qp-timeout` sets the RC ACK timeout.
#[test]
fn ipv4_names_the_roce_address_on_the_fabric() {
    let rt = Runtime::new("ipv4");
    let port = free_port().to_string();
    let pcap = rt.0.join("server.pcap");
    let common = ["--gid-idx", "3", "--qp-timeout", "16", "--iters", "20", "--size", "3000"];
    let client =
        side(&rt.0, &[&["--client", &format!("127.0.0.1:{port}"), "--ipv4", "10.7.0.2"][..], &common].concat())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    let mut s = side(
        &rt.0,
        &[&["--server", "--bind", "127.0.0.1", "--port", &port, "--ipv4", "10.7.0.1"][..], &common].concat(),
    );
    let server = s.arg("--pcap").arg(&pcap).output().unwrap();
    let client = client.wait_with_output().unwrap();
    verified(&server, 20);
    verified(&client, 20);
    // Every IPv4 RoCE frame the server sent or received is between the two named addresses.
    let bytes = std::fs::read(&pcap).unwrap();
    let (mut at, mut roce) = (24, 0);
    while at + 16 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let f = &bytes[at + 16..at + 16 + len];
        at += 16 + len;
        if f.len() >= 42 && f[12..14] == [0x08, 0x00] && f[23] == 17 && f[36..38] == [0x12, 0xb7] {
            let (src, dst) = (&f[26..30], &f[30..34]);
            assert!(
                (src, dst) == (&[10, 7, 0, 1][..], &[10, 7, 0, 2][..])
                    || (src, dst) == (&[10, 7, 0, 2][..], &[10, 7, 0, 1][..]),
                "a RoCE frame from {src:?} to {dst:?}"
            );
            roce += 1;
        }
    }
    assert!(roce >= 40, "{roce} RoCE frames in the server's capture");
}

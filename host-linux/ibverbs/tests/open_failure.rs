//! Issue 29: a failed `ibv_open_device` was silent unless `MLX5_RS_LOG` was set (a program prints only
//! "Couldn't get context for mlx5_0"); the reason is now one line on stderr. And the two ends of a simulated
//! wire are different hosts without `host=`. Each case runs in a child process of its own, since the device
//! list is read from `MLX5_RS_DEVICES` once per process.

use std::process::Command;

mod common;
use common::*;

/// Set in the child: which case it runs.
const CASE: &str = "MLX5_RS_TEST_OPEN_CASE";

/// Runs this test binary again as a child with `MLX5_RS_DEVICES=devices` (and no `MLX5_RS_LOG`), the child
/// running `case`; returns its exit success and stderr.
fn child(case: &str, devices: &str) -> (bool, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["cases_in_a_child", "--exact", "--test-threads=1", "--nocapture"])
        .env(CASE, case)
        .env("MLX5_RS_DEVICES", devices)
        .env_remove("MLX5_RS_LOG")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Opens every listed device in order; returns how many opened (stopping at the first that does not).
fn open_all() -> usize {
    let mut n = 0;
    // SAFETY: the list and its devices come from this library; contexts are closed once.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        assert!(!list.is_null());
        let mut ctxs = Vec::new();
        for i in 0..n as usize {
            let c = ibv_open_device(*list.add(i));
            if c.is_null() {
                break;
            }
            ctxs.push(c);
        }
        let opened = ctxs.len();
        for c in ctxs {
            assert_eq!(ibv_close_device(c), 0);
        }
        ibv_free_device_list(list);
        opened
    }
}

#[test]
fn cases_in_a_child() {
    match std::env::var(CASE).as_deref() {
        Ok("no-listener") => assert_eq!(open_all(), 0),
        Ok("both-ends") => assert_eq!(open_all(), 2),
        _ => {}
    }
}

#[test]
fn an_open_that_fails_says_why_on_stderr_without_mlx5_rs_log() {
    // Nobody listens on port 1: the open gives up after connect_timeout.
    let (ok, err) = child("no-listener", "sim:connect_timeout=1:wire=connect:127.0.0.1:1");
    assert!(ok, "{err}");
    let line = err.lines().find(|l| l.starts_with("libibverbs(mlx5-rs): ")).unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.starts_with(
            "libibverbs(mlx5-rs): cannot open mlx5_0: simulated wire: no listener at 127.0.0.1:1 after 1."
        ) && line.contains(" attempts): "),
        "{err}"
    );
}

#[test]
fn the_two_ends_of_a_wire_need_no_host_option() {
    // One process holds both ends here (two programs would each hold one): listen, then connect, no host=.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let devices = format!("sim:wire=listen:127.0.0.1:{port},sim:wire=connect:127.0.0.1:{port}");
    let (ok, err) = child("both-ends", &devices);
    assert!(ok && !err.contains("cannot open"), "{err}");
}

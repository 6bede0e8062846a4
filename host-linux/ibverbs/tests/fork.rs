//! `fork()` with the drop-in library, in a binary of its own (one test: no other test's threads or locks are
//! copied into the child). The parent has a device with a simulated wire open (its firmware and wire run on
//! threads the child does not get); the child opens the device afresh and does an RC exchange, the parent's
//! context keeps working, and the parent's wait is bounded so a hang fails the test.

use std::ffi::c_int;
use std::time::{Duration, Instant};

use mlx5_ibverbs::abi::*;

mod common;
use common::*;

/// The child's part; returns the exit status (0: everything held).
fn child(parent_dev: *mut ibv_device, parent_ctx: *mut ibv_context) -> c_int {
    // SAFETY: contexts opened here are this process's; the parent's are only handed to calls that must refuse them.
    unsafe {
        // The parent's context is not usable here: refused at once, not waited on.
        if !ibv_alloc_pd(parent_ctx).is_null() || errno() != libc::EINVAL {
            return 10;
        }
        if ibv_close_device(parent_ctx) != libc::EINVAL {
            return 11;
        }
        // A device pointer the parent listed opens this process's device of the same index.
        let ctx = ibv_open_device(parent_dev);
        if ctx.is_null() {
            eprintln!("child: open of the parent's device pointer: errno {}", errno());
            return 20;
        }
        if let Err(e) = exchange(ctx) {
            eprintln!("child: exchange: {e}");
            return 21;
        }
        // A second context on the child's device, from a list of its own.
        let ctx2 = ibv_open_device(first_device());
        if ctx2.is_null() {
            return 30;
        }
        if let Err(e) = exchange(ctx2) {
            eprintln!("child: exchange on a second context: {e}");
            return 31;
        }
        if ibv_close_device(ctx2) != 0 || ibv_close_device(ctx) != 0 {
            return 40;
        }
        0
    }
}

#[test]
fn a_forked_child_opens_a_wired_device_afresh_and_the_parent_keeps_working() {
    // A wired device: threaded firmware and a wire listener, both on threads a child does not inherit.
    std::env::set_var("MLX5_RS_DEVICES", "sim:wire=listen:127.0.0.1:0");
    // SAFETY: plain calls of the library's exports.
    unsafe {
        // As rdma-core on a kernel with copy-on-fork: nothing to set up (IBV_FORK_UNNEEDED).
        assert_eq!(ibv_fork_init(), 0);
        assert_eq!(ibv_is_fork_initialized(), 2);
    }
    let dev = first_device();
    // SAFETY: a device of the list.
    let ctx = unsafe { ibv_open_device(dev) };
    assert!(!ctx.is_null());
    // SAFETY: an open context of this process.
    unsafe { exchange(ctx) }.expect("the parent's exchange before the fork");

    // SAFETY: the child runs only `child` and leaves with _exit, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let status = std::panic::catch_unwind(|| child(dev, ctx)).unwrap_or(99);
        // SAFETY: ends the child without running the parent's exit handlers or destructors.
        unsafe { libc::_exit(status) };
    }
    // Bounded wait: a child that hangs fails the test instead of hanging it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child without blocking; `status` is a live local.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(r >= 0, "waitpid failed");
        if r == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: kills and reaps our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the forked child hung (killed after 60 s)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(libc::WIFEXITED(status), "the child did not exit normally: status {status:#x}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "the child failed at step {}", libc::WEXITSTATUS(status));
    // The parent's context is untouched by the child.
    // SAFETY: the parent's open context.
    unsafe {
        exchange(ctx).expect("the parent's exchange after the fork");
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

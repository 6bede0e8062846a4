//! `fork()` with the drop-in library, in a binary of its own (one test: no other test's threads or locks are
//! copied into the child). The parent has a device with a simulated wire open (its firmware and wire run on
//! threads the child does not get); the child opens the device afresh and does an RC exchange, the parent's
//! context keeps working, and the parent's wait is bounded so a hang fails the test.

use std::ffi::c_int;
use std::ptr;
use std::time::{Duration, Instant};

use mlx5_ibverbs::abi::*;

mod common;
use common::*;

/// One RC SEND of 16 bytes from a QP to itself (loopback through the device), checked at the receiver.
///
/// # Safety
/// `ctx` is an open context of this process.
unsafe fn exchange(ctx: *mut ibv_context) -> Result<(), String> {
    // SAFETY: every object is made from `ctx` here and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        if pd.is_null() {
            return Err(format!("alloc_pd: errno {}", errno()));
        }
        let mut mem = vec![0u8; 4096];
        mem[..16].copy_from_slice(b"hello from fork!");
        let mr = ibv_reg_mr(pd, mem.as_mut_ptr().cast(), mem.len(), 1);
        let cq = ibv_create_cq(ctx, 8, ptr::null_mut(), ptr::null_mut(), 0);
        let mut init = rc_init(cq);
        let qp = if mr.is_null() || cq.is_null() { ptr::null_mut() } else { ibv_create_qp(pd, &mut init) };
        if qp.is_null() {
            return Err(format!("reg_mr / create_cq / create_qp: errno {}", errno()));
        }
        let r = connect_to_self(ctx, qp).and_then(|()| send_to_self(ctx, qp, cq, mr, &mem));
        let destroyed = [ibv_destroy_qp(qp), ibv_destroy_cq(cq), ibv_dereg_mr(mr), ibv_dealloc_pd(pd)];
        r?;
        if destroyed != [0; 4] {
            return Err(format!("destroy: {destroyed:?}"));
        }
        if &mem[2048..2064] != b"hello from fork!" {
            return Err(format!("received {:?}", &mem[2048..2064]));
        }
        Ok(())
    }
}

/// RESET → INIT → RTR → RTS towards the QP itself, over RoCE (GRH to the port's link-local GID).
///
/// # Safety
/// `qp` is a live QP of `ctx`.
unsafe fn connect_to_self(ctx: *mut ibv_context, qp: *mut ibv_qp) -> Result<(), String> {
    // SAFETY: the caller's context and QP; the attributes live on this stack.
    unsafe {
        let mut gid = ibv_gid::default();
        if ibv_query_gid(ctx, 1, 0, &mut gid) != 0 {
            return Err("query_gid".into());
        }
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = 1;
        a.port_num = 1;
        a.qp_access_flags = 0b111;
        let init = ibv_modify_qp(qp, &mut a, 1 | 16 | 32 | 8);
        a.qp_state = 2;
        a.path_mtu = 3;
        a.dest_qp_num = (*qp).qp_num;
        a.max_dest_rd_atomic = 1;
        a.min_rnr_timer = 12;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = gid;
        a.ah_attr.grh.hop_limit = 1;
        a.ah_attr.port_num = 1;
        let rtr = ibv_modify_qp(qp, &mut a, 1 | 128 | 256 | (1 << 20) | (1 << 12) | (1 << 17) | (1 << 15));
        a.qp_state = 3;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.max_rd_atomic = 1;
        let rts = ibv_modify_qp(qp, &mut a, 1 | 512 | 1024 | 2048 | (1 << 16) | (1 << 13));
        match (init, rtr, rts) {
            (0, 0, 0) => Ok(()),
            r => Err(format!("modify_qp (INIT, RTR, RTS): {r:?}")),
        }
    }
}

/// Posts a receive at offset 2048 and a SEND of the first 16 bytes, and polls both completions (at most 10 s).
///
/// # Safety
/// `qp`, `cq` and `mr` are live objects of `ctx`; `mr` covers `mem`.
unsafe fn send_to_self(
    ctx: *mut ibv_context,
    qp: *mut ibv_qp,
    cq: *mut ibv_cq,
    mr: *mut ibv_mr,
    mem: &[u8],
) -> Result<(), String> {
    // SAFETY: the caller's objects; requests and SGEs live on this stack for the calls.
    unsafe {
        let ops = (*ctx).ops;
        let base = mem.as_ptr() as u64;
        let mut rsge = ibv_sge { addr: base + 2048, length: 16, lkey: (*mr).lkey };
        let mut rwr = ibv_recv_wr { wr_id: 1, next: ptr::null_mut(), sg_list: &mut rsge, num_sge: 1 };
        let mut bad_r = ptr::null_mut();
        if ops.post_recv.unwrap()(qp, &mut rwr, &mut bad_r) != 0 {
            return Err("post_recv".into());
        }
        let mut ssge = ibv_sge { addr: base, length: 16, lkey: (*mr).lkey };
        let mut swr: ibv_send_wr = std::mem::zeroed();
        swr.wr_id = 2;
        swr.sg_list = &mut ssge;
        swr.num_sge = 1;
        swr.opcode = 2; // IBV_WR_SEND
        let mut bad_s = ptr::null_mut();
        if ops.post_send.unwrap()(qp, &mut swr, &mut bad_s) != 0 {
            return Err("post_send".into());
        }
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        while got.len() < 2 && Instant::now() < end {
            let mut wc = [ibv_wc::default(); 2];
            let n = ops.poll_cq.unwrap()(cq, 2, wc.as_mut_ptr());
            if n < 0 {
                return Err(format!("poll_cq: {n}"));
            }
            got.extend(wc[..n as usize].iter().map(|w| (w.wr_id, w.status)));
            std::thread::sleep(Duration::from_millis(1));
        }
        got.sort_unstable();
        if got != [(1, 0), (2, 0)] {
            return Err(format!("completions (wr_id, status): {got:?}"));
        }
        Ok(())
    }
}

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

//! What the drop-in's integration tests share: the library's exports as a C program links them, errno, the
//! first listed device, an RC QP's attributes and a loopback exchange. Each test binary uses a part of it.
#![allow(dead_code)]

use std::ffi::{c_int, c_void};
use std::ptr;
use std::time::{Duration, Instant};

use mlx5_ibverbs::abi::*;

// The library's exports, as a C program links them.
extern "C" {
    pub fn ibv_fork_init() -> c_int;
    pub fn ibv_is_fork_initialized() -> c_int;
    pub fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device;
    pub fn ibv_free_device_list(list: *mut *mut ibv_device);
    pub fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context;
    pub fn ibv_close_device(context: *mut ibv_context) -> c_int;
    pub fn ibv_query_port(context: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int;
    pub fn ibv_query_gid(context: *mut ibv_context, port: u8, index: c_int, gid: *mut ibv_gid) -> c_int;
    pub fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd;
    pub fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int;
    pub fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr;
    pub fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
    pub fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel;
    pub fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int;
    pub fn ibv_create_cq(
        context: *mut ibv_context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        vector: c_int,
    ) -> *mut ibv_cq;
    pub fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int;
    pub fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    pub fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int;
    pub fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
    pub fn ibv_get_cq_event(channel: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, ctx: *mut *mut c_void) -> c_int;
    pub fn ibv_get_async_event(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int;
}

pub fn errno() -> c_int {
    // SAFETY: the calling thread's errno slot.
    unsafe { *libc::__errno_location() }
}

/// The first device of a fresh list.
pub fn first_device() -> *mut ibv_device {
    let mut n = 0;
    // SAFETY: a writable count; the list is freed below and the device stays.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        assert!(!list.is_null() && n >= 1, "no device listed");
        let dev = *list;
        ibv_free_device_list(list);
        dev
    }
}

/// An RC QP's attributes with both queues on `cq`: one send, one receive, one SGE each, every request signaled.
pub fn rc_init(cq: *mut ibv_cq) -> ibv_qp_init_attr {
    ibv_qp_init_attr {
        qp_context: ptr::null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: ptr::null_mut(),
        cap: ibv_qp_cap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
        qp_type: 2,
        sq_sig_all: 1,
    }
}

/// One RC SEND of 16 bytes from a QP to itself (loopback through the device), checked at the receiver.
///
/// # Safety
/// `ctx` is an open context of this process.
pub unsafe fn exchange(ctx: *mut ibv_context) -> Result<(), String> {
    // SAFETY: every object is made from `ctx` here and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        if pd.is_null() {
            return Err(format!("alloc_pd: errno {}", errno()));
        }
        let mut mem = vec![0u8; 4096];
        mem[..16].copy_from_slice(b"hello, loopback!");
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
        if &mem[2048..2064] != b"hello, loopback!" {
            return Err(format!("received {:?}", &mem[2048..2064]));
        }
        Ok(())
    }
}

/// RESET → INIT → RTR → RTS towards the QP itself, over RoCE (GRH to the port's link-local GID).
///
/// # Safety
/// `qp` is a live QP of `ctx`.
pub unsafe fn connect_to_self(ctx: *mut ibv_context, qp: *mut ibv_qp) -> Result<(), String> {
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
pub unsafe fn send_to_self(
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

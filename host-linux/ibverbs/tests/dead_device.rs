//! Posts on a dead device answer `EIO` and name the first work request as `bad_wr`, through the entries of a
//! context whose queues lock and of one opened with `MLX5_SINGLE_THREADED=1`. A binary of its own: the fault
//! (`MLX5_RS_FAULTS`) kills the process's one simulated device, and both variables are read at open.

use std::ffi::c_int;
use std::ptr;

use mlx5_ibverbs::abi::*;

mod common;
use common::*;

extern "C" {
    fn ibv_ack_async_event(event: *mut ibv_async_event);
}

/// `IBV_EVENT_DEVICE_FATAL`.
const DEVICE_FATAL: u32 = 8;

#[test]
fn posts_on_a_dead_device_are_eio_with_bad_wr_set() {
    // Fired 1.5 s after the device is first opened: the set-up below is done by then. Set before any thread of
    // the library exists.
    std::env::set_var("MLX5_RS_FAULTS", "health_failure@1500");
    let mut mem = vec![0u8; 4096];
    // SAFETY: plain calls of the library's exports, on objects this test made; requests live on this stack.
    unsafe {
        let locking = ibv_open_device(first_device());
        assert!(!locking.is_null(), "open: errno {}", errno());
        std::env::set_var("MLX5_SINGLE_THREADED", "1");
        let single = ibv_open_device(first_device());
        assert!(!single.is_null(), "open: errno {}", errno());
        let mut qps = Vec::new();
        for ctx in [locking, single] {
            let pd = ibv_alloc_pd(ctx);
            let cq = ibv_create_cq(ctx, 8, ptr::null_mut(), ptr::null_mut(), 0);
            assert!(!pd.is_null() && !cq.is_null());
            let mut init = rc_init(cq);
            let qp = ibv_create_qp(pd, &mut init);
            assert!(!qp.is_null(), "create_qp: errno {}", errno());
            let mr = ibv_reg_mr(pd, mem.as_mut_ptr().cast(), mem.len(), 1);
            assert!(!mr.is_null());
            connect_to_self(ctx, qp).expect("connect");
            qps.push((ctx, qp, mr));
        }
        // The device's fatal event comes after the dead HCA is published to the datapath.
        for ctx in [locking, single] {
            let mut ev: ibv_async_event = std::mem::zeroed();
            assert_eq!(ibv_get_async_event(ctx, &mut ev), 0, "errno {}", errno());
            assert_eq!(ev.event_type as u32, DEVICE_FATAL);
            ibv_ack_async_event(&mut ev);
        }
        for (i, &(ctx, qp, mr)) in qps.iter().enumerate() {
            let ops = (*ctx).ops;
            let mut sge = ibv_sge { addr: mem.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
            // One send (the single-WR entry) and a list of two.
            let mut w: [ibv_send_wr; 2] = std::mem::zeroed();
            for (k, s) in w.iter_mut().enumerate() {
                (s.wr_id, s.sg_list, s.num_sge, s.opcode, s.send_flags) = (k as u64, &mut sge, 1, 2, 2);
            }
            let mut bad = ptr::null_mut();
            let r: c_int = ops.post_send.unwrap()(qp, &mut w[0], &mut bad);
            assert_eq!((r, bad), (libc::EIO, &mut w[0] as *mut _), "context {i}: one send");
            w[0].next = &mut w[1];
            bad = ptr::null_mut();
            let r = ops.post_send.unwrap()(qp, &mut w[0], &mut bad);
            assert_eq!((r, bad), (libc::EIO, &mut w[0] as *mut _), "context {i}: a list");
            let mut rw = ibv_recv_wr { wr_id: 9, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
            let mut bad_r = ptr::null_mut();
            let r = ops.post_recv.unwrap()(qp, &mut rw, &mut bad_r);
            assert_eq!((r, bad_r), (libc::EIO, &mut rw as *mut _), "context {i}: a receive");
        }
    }
}

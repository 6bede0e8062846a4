//! The C API called as a C program calls it, in process, on the default simulated device (`mlx5_0`): a
//! loopback RC exchange through the `ibv_context_ops` pointers, the extended ops, and the error conventions.

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::ptr;

use crate::abi::*;
use crate::context::*;
use crate::device::*;
use crate::objects::*;
use crate::strings::ibv_wc_status_str;

pub(crate) fn errno() -> c_int {
    // SAFETY: the calling thread's errno slot.
    unsafe { *libc::__errno_location() }
}

/// Opens `mlx5_0`.
pub(crate) fn open() -> *mut ibv_context {
    let mut n = 0;
    let list = ibv_get_device_list(&mut n);
    assert!(!list.is_null() && n >= 1);
    // SAFETY: the list holds n devices and a NULL.
    let dev = unsafe { *list };
    // SAFETY: a device of the list.
    let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) };
    assert_eq!(name.to_str().unwrap(), "mlx5_0");
    let ctx = ibv_open_device(dev);
    ibv_free_device_list(list);
    assert!(!ctx.is_null());
    ctx
}

/// The `verbs_context` around a context.
fn vctx(ctx: *mut ibv_context) -> &'static verbs_context {
    // SAFETY: contexts of this library sit at the end of a verbs_context.
    unsafe { &*ctx.cast::<u8>().sub(std::mem::offset_of!(verbs_context, context)).cast::<verbs_context>() }
}

#[test]
fn context_is_an_extended_verbs_context() {
    let ctx = open();
    let v = vctx(ctx);
    // SAFETY: the context is open.
    let c = unsafe { &*ctx };
    assert_eq!(c.abi_compat as usize, usize::MAX);
    assert_eq!(v.sz, std::mem::size_of::<verbs_context>());
    assert!(c.async_fd >= 0 && c.cmd_fd >= 0 && c.num_comp_vectors >= 1);
    assert!(c.ops.poll_cq.is_some() && c.ops.post_send.is_some() && c.ops.alloc_mw.is_none());
    // The port as the inline ibv_query_port reaches it, with a caller larger than this library's struct: the
    // tail is zeroed.
    let mut big = [0xffu8; 64];
    let qp = v.query_port.unwrap();
    // SAFETY: a 64-byte buffer for a 52-byte struct.
    assert_eq!(unsafe { qp(ctx, 1, big.as_mut_ptr().cast(), big.len()) }, 0);
    assert_eq!(big[0], 4, "PORT_ACTIVE");
    assert!(big[std::mem::size_of::<ibv_port_attr>()..].iter().all(|b| *b == 0));
    // SAFETY: port 2 does not exist.
    assert_eq!(unsafe { qp(ctx, 2, big.as_mut_ptr().cast(), big.len()) }, libc::EINVAL);
    let mut gid = ibv_gid::default();
    // SAFETY: open context, writable GID.
    assert_eq!(unsafe { ibv_query_gid(ctx, 1, 0, &mut gid) }, 0);
    assert_eq!(&gid.raw[..2], &[0xfe, 0x80]);
    // SAFETY: as above; 100000 is past the table.
    assert_eq!(unsafe { ibv_query_gid(ctx, 1, 100_000, &mut gid) }, -1);
    // SAFETY: the context is open and closed once.
    assert_eq!(unsafe { ibv_close_device(ctx) }, 0);
}

#[test]
fn errors_follow_the_verbs_conventions() {
    // SAFETY: NULL arguments are refused, not dereferenced.
    unsafe {
        assert!(ibv_alloc_pd(ptr::null_mut()).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(ibv_dealloc_pd(ptr::null_mut()), libc::EINVAL);
        assert!(ibv_create_cq(ptr::null_mut(), 1, ptr::null_mut(), ptr::null_mut(), 0).is_null());
    }
    let ctx = open();
    // SAFETY: an open context; bad sizes and flags are refused.
    unsafe {
        assert!(ibv_create_cq(ctx, 0, ptr::null_mut(), ptr::null_mut(), 0).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert!(ibv_create_cq(ctx, 16, ptr::null_mut(), ptr::null_mut(), 999).is_null());
        let pd = ibv_alloc_pd(ctx);
        assert!(!pd.is_null());
        let mut buf = vec![0u8; 64];
        assert!(ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), 1 << 30).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // XRC is not offered: EOPNOTSUPP, which test suites turn into a skip.
        let cq = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        let mut attr = ibv_qp_init_attr { qp_type: 9, sq_sig_all: 0, ..rc_init(cq, 1) };
        assert!(ibv_create_qp(pd, &mut attr).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        // More work requests than the device has: refused before any queue is sized.
        attr.qp_type = 4;
        attr.cap.max_recv_wr = u32::MAX;
        assert!(ibv_create_qp(pd, &mut attr).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // A resize keeps the CQ usable and reports the new size.
        let rc = ibv_resize_cq(cq, 100);
        assert!(rc == 0 || rc == libc::EOPNOTSUPP, "resize: {rc}");
        if rc == 0 {
            assert!((*cq).cqe >= 100);
        }
        assert_eq!(ibv_resize_cq(cq, 0), libc::EINVAL);
        // A CQ in use by nothing goes; a PD goes.
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(CStr::from_ptr(ibv_wc_status_str(12)).to_str().unwrap(), "transport retry counter exceeded");
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

/// An RC QP's attributes with both queues on `cq`: `max_send_wr` sends, one receive, one SGE each, every request
/// signaled.
fn rc_init(cq: *mut ibv_cq, max_send_wr: u32) -> ibv_qp_init_attr {
    ibv_qp_init_attr {
        qp_context: ptr::null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: ptr::null_mut(),
        cap: ibv_qp_cap { max_send_wr, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
        qp_type: 2,
        sq_sig_all: 1,
    }
}

/// Posts an RDMA WRITE of `sge` to `remote` on `qp` through its context's ops; what `post_send` returned.
///
/// # Safety
/// `qp` is a live QP; `sge` and `remote` lie in registered memory that lives until the write completes.
unsafe fn post_write(qp: *mut ibv_qp, wr_id: u64, mut sge: ibv_sge, remote: wr_rdma) -> c_int {
    // SAFETY: ibv_send_wr is plain data.
    let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = wr_id;
    w.sg_list = &mut sge;
    w.num_sge = 1;
    w.opcode = 0;
    w.wr.rdma = remote;
    let mut bad = ptr::null_mut();
    // SAFETY: a live QP of an open context; the request and its SGE live on this stack for the call.
    unsafe { (*(*qp).context).ops.post_send.unwrap()(qp, &mut w, &mut bad) }
}

/// Moves a QP through RESET → INIT → RTR → RTS towards `dest` on RoCE (GRH to our own link-local GID).
///
/// # Safety
/// `qp` is a live QP of `ctx`.
unsafe fn connect(ctx: *mut ibv_context, qp: *mut ibv_qp, dest: u32) {
    let mut gid = ibv_gid::default();
    // SAFETY: open context.
    assert_eq!(unsafe { ibv_query_gid(ctx, 1, 0, &mut gid) }, 0);
    // SAFETY: ibv_qp_attr is plain data.
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = 1;
    a.port_num = 1;
    a.qp_access_flags = 0b111;
    // IBV_QP_STATE | PKEY_INDEX | PORT | ACCESS_FLAGS.
    // SAFETY: live QP, attributes on the stack.
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, 1 | 16 | 32 | 8) }, 0);
    a.qp_state = 2;
    a.path_mtu = 3;
    a.dest_qp_num = dest;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.hop_limit = 1;
    a.ah_attr.port_num = 1;
    // STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER.
    // SAFETY: as above.
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, 1 | 128 | 256 | (1 << 20) | (1 << 12) | (1 << 17) | (1 << 15)) }, 0);
    a.qp_state = 3;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = 0;
    a.max_rd_atomic = 1;
    // STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC.
    // SAFETY: as above.
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, 1 | 512 | 1024 | 2048 | (1 << 16) | (1 << 13)) }, 0);
    // SAFETY: the C part mirrors the state.
    assert_eq!(unsafe { (*qp).state }, 3);
}

/// What most tests stand on: an open `mlx5_0`, a PD, a buffer registered for local and remote access, a CQ
/// (on a completion channel when asked) and an RC QP connected to itself.
struct Loopback {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    mem: Vec<u8>,
    mr: *mut ibv_mr,
    /// NULL when the CQ has no channel.
    ch: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    /// NULL when the test makes its own QPs (and destroys them before `close`).
    qp: *mut ibv_qp,
}

impl Loopback {
    /// Opens `mlx5_0` with a CQ of `cqe` entries (on a new channel when `channel`), `mem_len` bytes registered
    /// and a QP of `max_send_wr` sends.
    fn new(mem_len: usize, cqe: c_int, channel: bool, max_send_wr: u32) -> Loopback {
        let mut l = Loopback::without_qp(mem_len, cqe, channel);
        // SAFETY: the Loopback's live PD and CQ.
        unsafe { l.connect_qp(max_send_wr) };
        l
    }

    /// As `new`, with no QP.
    fn without_qp(mem_len: usize, cqe: c_int, channel: bool) -> Loopback {
        let ctx = open();
        // SAFETY: an open context; the channel and CQ are made here and kept in the Loopback.
        unsafe {
            let ch = if channel { ibv_create_comp_channel(ctx) } else { ptr::null_mut() };
            assert!(!channel || !ch.is_null(), "errno {}", errno());
            let cq = ibv_create_cq(ctx, cqe, ptr::null_mut(), ch, 0);
            Loopback::on(ctx, ch, cq, mem_len)
        }
    }

    /// The PD and region on `ctx`, around its `cq` (which the Loopback then owns, with `ch`); no QP.
    ///
    /// # Safety
    /// `ctx` is open; `cq` is a live CQ of it on `ch` (or NULL).
    unsafe fn on(ctx: *mut ibv_context, ch: *mut ibv_comp_channel, cq: *mut ibv_cq, mem_len: usize) -> Loopback {
        assert!(!cq.is_null(), "errno {}", errno());
        // SAFETY: the caller's open context; the objects made here live until `close`.
        unsafe {
            let pd = ibv_alloc_pd(ctx);
            let mut mem = vec![0u8; mem_len];
            let mr = ibv_reg_mr(pd, mem.as_mut_ptr().cast(), mem.len(), 0b111);
            assert!(!pd.is_null() && !mr.is_null(), "errno {}", errno());
            Loopback { ctx, pd, mem, mr, ch, cq, qp: ptr::null_mut() }
        }
    }

    /// Makes the QP, of `max_send_wr` sends on the CQ, and connects it to itself.
    ///
    /// # Safety
    /// The PD and CQ are live.
    unsafe fn connect_qp(&mut self, max_send_wr: u32) {
        let mut init = rc_init(self.cq, max_send_wr);
        // SAFETY: the Loopback's live PD and CQ; the QP lives until `close`.
        unsafe {
            self.qp = ibv_create_qp(self.pd, &mut init);
            assert!(!self.qp.is_null(), "errno {}", errno());
            connect(self.ctx, self.qp, (*self.qp).qp_num);
        }
    }

    /// Destroys the objects, children first, and closes the context: each answers 0.
    ///
    /// # Safety
    /// The objects are live: the test destroyed none of them.
    unsafe fn close(self) {
        // SAFETY: the Loopback's objects, destroyed once each.
        unsafe {
            if !self.qp.is_null() {
                assert_eq!(ibv_destroy_qp(self.qp), 0);
            }
            assert_eq!(ibv_destroy_cq(self.cq), 0);
            if !self.ch.is_null() {
                assert_eq!(ibv_destroy_comp_channel(self.ch), 0);
            }
            assert_eq!(ibv_dereg_mr(self.mr), 0);
            assert_eq!(ibv_dealloc_pd(self.pd), 0);
            assert_eq!(ibv_close_device(self.ctx), 0);
        }
    }
}

#[test]
fn loopback_send_and_rdma_write_through_the_ops() {
    let ctx = open();
    // SAFETY: every pointer below is made by this library from this context and destroyed once, children first.
    unsafe {
        let ops = (*ctx).ops;
        let pd = ibv_alloc_pd(ctx);
        let mut mem = vec![0u8; 8192];
        let mr = ibv_reg_mr(pd, mem.as_mut_ptr().cast(), mem.len(), 0b111);
        assert!(!mr.is_null());
        assert_eq!((*mr).addr, mem.as_mut_ptr().cast::<c_void>());
        let ch = ibv_create_comp_channel(ctx);
        assert!((*ch).fd >= 0);
        let user = 0x5a5a as *mut c_void;
        let cq = ibv_create_cq(ctx, 16, user, ch, 0);
        assert!((*cq).cqe >= 16);
        let mut init = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: ptr::null_mut(),
            cap: ibv_qp_cap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 },
            qp_type: 2,
            sq_sig_all: 0,
        };
        let a = ibv_create_qp(pd, &mut init);
        let b = ibv_create_qp(pd, &mut init);
        assert!(!a.is_null() && !b.is_null());
        assert!(init.cap.max_send_wr >= 4 && init.cap.max_inline_data >= 64);
        connect(ctx, a, (*b).qp_num);
        connect(ctx, b, (*a).qp_num);

        // B receives into the second half; A sends "hello" inline, gathered from two places (and an empty entry)
        // as the core reads the program's list in place, then RDMA-writes 4 bytes at offset 4096 + 100.
        let base = mem.as_mut_ptr() as u64;
        let mut rsge = ibv_sge { addr: base + 4096, length: 64, lkey: (*mr).lkey };
        let mut rwr = ibv_recv_wr { wr_id: 7, next: ptr::null_mut(), sg_list: &mut rsge, num_sge: 1 };
        let mut bad_r = ptr::null_mut();
        assert_eq!(ops.post_recv.unwrap()(b, &mut rwr, &mut bad_r), 0);
        mem[..3].copy_from_slice(b"hel");
        mem[16..18].copy_from_slice(b"lo");
        mem[8..12].copy_from_slice(b"RDMA");
        let mut s1 = [
            ibv_sge { addr: base, length: 3, lkey: (*mr).lkey },
            ibv_sge { addr: base + 32, length: 0, lkey: (*mr).lkey },
            ibv_sge { addr: base + 16, length: 2, lkey: (*mr).lkey },
        ];
        let mut s2 = ibv_sge { addr: base + 8, length: 4, lkey: (*mr).lkey };
        let mut w2: ibv_send_wr = std::mem::zeroed();
        w2.wr_id = 2;
        w2.sg_list = &mut s2;
        w2.num_sge = 1;
        w2.opcode = 0; // IBV_WR_RDMA_WRITE
        w2.send_flags = 2; // SIGNALED
        w2.wr.rdma = wr_rdma { remote_addr: base + 4096 + 100, rkey: (*mr).rkey };
        let mut w1: ibv_send_wr = std::mem::zeroed();
        w1.wr_id = 1;
        w1.next = &mut w2;
        w1.sg_list = s1.as_mut_ptr();
        w1.num_sge = 3;
        w1.opcode = 2; // IBV_WR_SEND
        w1.send_flags = 2 | 8; // SIGNALED | INLINE
        assert_eq!(ops.req_notify_cq.unwrap()(cq, 0), 0);
        let mut bad = ptr::null_mut();
        assert_eq!(ops.post_send.unwrap()(a, &mut w1, &mut bad), 0);

        // One completion event names the CQ and its context.
        let (mut ev_cq, mut ev_ctx) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!(ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), 0);
        assert_eq!((ev_cq, ev_ctx), (cq, user));
        ibv_ack_cq_events(cq, 1);

        let mut wc = [ibv_wc::default(); 8];
        let mut got = Vec::new();
        for _ in 0..10_000 {
            let n = ops.poll_cq.unwrap()(cq, wc.len() as c_int, wc.as_mut_ptr());
            assert!(n >= 0);
            got.extend_from_slice(&wc[..n as usize]);
            if got.len() == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got.iter().all(|w| w.status == 0));
        let recv = got.iter().find(|w| w.opcode == 128).expect("a receive");
        assert_eq!((recv.wr_id, recv.byte_len, recv.qp_num), (7, 5, (*b).qp_num));
        assert_eq!(&mem[4096..4101], b"hello");
        assert_eq!(&mem[4196..4200], b"RDMA");
        let mut sent: Vec<u64> = got.iter().filter(|w| w.opcode != 128).map(|w| w.wr_id).collect();
        sent.sort();
        assert_eq!(sent, [1, 2]);

        // query_qp reports what was set.
        let mut qa: ibv_qp_attr = std::mem::zeroed();
        let mut qi: ibv_qp_init_attr = std::mem::zeroed();
        assert_eq!(ibv_query_qp(a, &mut qa, 0, &mut qi), 0);
        assert_eq!((qa.qp_state, qa.dest_qp_num, qa.path_mtu, qi.qp_type), (3, (*b).qp_num, 3, 2));

        // A CQ with QPs on it, or a PD with objects, stays (EBUSY); then everything goes.
        assert_eq!(ibv_destroy_cq(cq), libc::EBUSY);
        assert_eq!(ibv_dealloc_pd(pd), libc::EBUSY);
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

/// Issue 29: a context closed with objects alive (qperf deallocates its PD before deregistering its MR) destroys
/// them, as the kernel's uverbs does at the close of its file, and keeps their structs as shells the program may
/// still pass: a destroy of a firmware object answers EBADF, as rdma-core's command on the closed `cmd_fd` does
/// (nothing freed, so nothing freed twice); an AH, a thread domain, a parent domain and a completion channel,
/// which libibverbs and libmlx5 free without a command, answer 0 and go; every other call is refused.
#[test]
fn a_context_closed_with_objects_alive_leaves_shells_that_refuse_every_call() {
    let ctx = open();
    let v = vctx(ctx);
    // SAFETY: the objects are this library's; calls on them after the close (a program error) are what is tested.
    unsafe {
        let ops = (*ctx).ops;
        let pd = ibv_alloc_pd(ctx);
        let mut mem = vec![0u8; 4096];
        let mr = ibv_reg_mr(pd, mem.as_mut_ptr().cast(), mem.len(), 0b111);
        let ch = ibv_create_comp_channel(ctx);
        let cq = ibv_create_cq(ctx, 8, ptr::null_mut(), ch, 0);
        let mut init = rc_init(cq, 2);
        let qp = ibv_create_qp(pd, &mut init);
        let mut sa = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr { max_wr: 4, max_sge: 1, srq_limit: 0 },
        };
        let srq = ibv_create_srq(pd, &mut sa);
        let mut gid = ibv_gid::default();
        assert_eq!(ibv_query_gid(ctx, 1, 0, &mut gid), 0);
        let mut aa = ibv_ah_attr { is_global: 1, port_num: 1, ..Default::default() };
        aa.grh.dgid = gid;
        let ah = ibv_create_ah(pd, &mut aa);
        let mut ta = ibv_td_init_attr { comp_mask: 0 };
        let td = v.alloc_td.unwrap()(ctx, &mut ta);
        let mut pa =
            ibv_parent_domain_init_attr { pd, td, comp_mask: 0, alloc: None, free: None, pd_context: ptr::null_mut() };
        let parent = v.alloc_parent_domain.unwrap()(ctx, &mut pa);
        let used = v.alloc_parent_domain.unwrap()(ctx, &mut pa);
        let on_parent = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        let mut pinit = rc_init(on_parent, 1);
        let qp_on_parent = ibv_create_qp(used, &mut pinit);
        for p in [pd.cast::<c_void>(), mr.cast(), ch.cast(), cq.cast(), qp.cast(), srq.cast(), ah.cast(), td.cast()] {
            assert!(!p.is_null());
        }
        assert!(!parent.is_null() && !used.is_null() && !on_parent.is_null() && !qp_on_parent.is_null());
        connect(ctx, qp, (*qp).qp_num);
        // qperf's order: its PD first (refused while used), then the close.
        assert_eq!(ibv_dealloc_pd(pd), libc::EBUSY);
        assert_eq!(ibv_close_device(ctx), 0);
        // The leftovers' firmware objects are gone.
        let sim = crate::device::dev_of(vctx(ctx).context.device).unwrap().dev.sim_device().unwrap();
        assert!(sim.qp_info((*qp).qp_num).is_none(), "the QP left alive is destroyed at close");
        assert!(sim.qp_info((*qp_on_parent).qp_num).is_none());

        // Calls on the shells: refused, never reaching the device or freed memory.
        let sge = ibv_sge { addr: mem.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
        assert_eq!(
            post_write(qp, 1, sge, wr_rdma { remote_addr: mem.as_ptr() as u64, rkey: (*mr).rkey }),
            libc::EINVAL
        );
        let mut wc = [ibv_wc::default(); 1];
        assert!(ops.poll_cq.unwrap()(cq, 1, wc.as_mut_ptr()) < 0);
        assert_eq!(ops.req_notify_cq.unwrap()(cq, 0), libc::EINVAL);
        let mut qa: ibv_qp_attr = std::mem::zeroed();
        assert_eq!(ibv_modify_qp(qp, &mut qa, 1), libc::EINVAL);
        assert!(ibv_alloc_pd(ctx).is_null());
        assert!(ibv_reg_mr(pd, mem.as_mut_ptr().cast(), 64, 1).is_null());
        assert!(ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0).is_null());
        assert_eq!(ibv_close_device(ctx), libc::EINVAL, "a second close");
        let (mut ev_cq, mut ev_ctx) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!(ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), -1);
        assert_eq!(errno(), libc::EIO, "the kernel's read of a channel whose context is gone");
        ibv_ack_cq_events(cq, 1);
        // Destroys, twice each: firmware objects EBADF (the shell stays), the others 0 and freed (once).
        for _ in 0..2 {
            assert_eq!(ibv_destroy_qp(qp), libc::EBADF);
            assert_eq!(ibv_destroy_qp(qp_on_parent), libc::EBADF);
            assert_eq!(ibv_destroy_srq(srq), libc::EBADF);
            assert_eq!(ibv_destroy_cq(cq), libc::EBADF);
            assert_eq!(ibv_destroy_cq(on_parent), libc::EBADF);
            assert_eq!(ibv_dereg_mr(mr), libc::EBADF);
            assert_eq!(ibv_dealloc_pd(pd), libc::EBADF);
            // Objects made through it still count on it, as libmlx5's reference count says.
            assert_eq!(ibv_dealloc_pd(used), libc::EBUSY);
        }
        assert_eq!(ibv_dealloc_pd(parent), 0);
        assert_eq!(v.dealloc_td.unwrap()(td), libc::EBUSY, "the other parent domain still uses it");
        assert_eq!(ibv_destroy_ah(ah), 0);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
        // A fresh context of the same device works.
        let ctx2 = open();
        let pd2 = ibv_alloc_pd(ctx2);
        assert!(!pd2.is_null());
        assert_eq!(ibv_dealloc_pd(pd2), 0);
        assert_eq!(ibv_close_device(ctx2), 0);
    }
}

#[test]
fn a_cq_with_an_event_never_taken_is_destroyed() {
    let l = Loopback::new(64, 4, true, 1);
    let (ctx, mr, ch, cq, qp) = (l.ctx, l.mr, l.ch, l.cq, l.qp);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let ops = (*ctx).ops;
        let mem = &l.mem;
        // An armed CQ completes a write: its event reaches the channel, and the program never takes it.
        assert_eq!(ops.req_notify_cq.unwrap()(cq, 0), 0);
        let sge = ibv_sge { addr: mem.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
        assert_eq!(post_write(qp, 0, sge, wr_rdma { remote_addr: mem.as_ptr() as u64 + 32, rkey: (*mr).rkey }), 0);
        let mut wc = [ibv_wc::default(); 1];
        let mut n = 0;
        for _ in 0..10_000 {
            n = ops.poll_cq.unwrap()(cq, 1, wc.as_mut_ptr());
            if n != 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        assert_eq!((n, wc[0].status), (1, 0));
        // The device's service thread moves the event to the channel within its 50 ms period.
        let mut fds = libc::pollfd { fd: (*ch).fd, events: libc::POLLIN, revents: 0 };
        assert_eq!(libc::poll(&mut fds, 1, 2000), 1, "the channel's descriptor becomes readable");
        l.close();
    }
}

/// Polls `cq` until one completion arrives (or 10,000 tries pass).
///
/// # Safety
/// `cq` is a live CQ of `ctx`.
unsafe fn poll_one(ctx: *mut ibv_context, cq: *mut ibv_cq) -> Option<ibv_wc> {
    let mut wc = [ibv_wc::default(); 1];
    for _ in 0..10_000 {
        // SAFETY: the caller's CQ, one entry.
        let n = unsafe { (*ctx).ops.poll_cq.unwrap()(cq, 1, wc.as_mut_ptr()) };
        assert!(n >= 0);
        if n == 1 {
            return Some(wc[0]);
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    None
}

#[test]
fn rereg_mr_moves_a_region_to_new_memory_with_new_keys_and_refuses_in_place_changes() {
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        let pd2 = ibv_alloc_pd(ctx);
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 8192];
        let mr = ibv_reg_mr(pd, a.as_mut_ptr().cast(), a.len(), 1);
        assert!(!mr.is_null());
        let (lkey, rkey) = ((*mr).lkey, (*mr).rkey);
        let rereg = |flags, pd, addr: *mut c_void, len, access| ibv_rereg_mr(mr, flags, pd, addr, len, access);
        // libibverbs' input checks (IBV_REREG_MR_ERR_INPUT, -1).
        assert_eq!((rereg(16, ptr::null_mut(), ptr::null_mut(), 0, 0), errno()), (-1, libc::EINVAL));
        assert_eq!((rereg(1, ptr::null_mut(), b.as_mut_ptr().cast(), 0, 0), errno()), (-1, libc::EINVAL));
        assert_eq!((rereg(2, pd2, ptr::null_mut(), 0, 1), errno()), (-1, libc::EINVAL));
        // What the kernel refuses (IBV_REREG_MR_ERR_CMD, -4): nothing asked, no PD, an access bit verbs does
        // not define; and what mlx5_ib changes in place, keeping the keys (access or PD alone): EOPNOTSUPP.
        assert_eq!((rereg(0, ptr::null_mut(), ptr::null_mut(), 0, 0), errno()), (-4, libc::EINVAL));
        assert_eq!((rereg(2, ptr::null_mut(), ptr::null_mut(), 0, 0), errno()), (-4, libc::EINVAL));
        assert_eq!((rereg(4, ptr::null_mut(), ptr::null_mut(), 0, 1 << 30), errno()), (-4, libc::EINVAL));
        assert_eq!((rereg(4, ptr::null_mut(), ptr::null_mut(), 0, 3), errno()), (-4, libc::EOPNOTSUPP));
        assert_eq!((rereg(2, pd2, ptr::null_mut(), 0, 0), errno()), (-4, libc::EOPNOTSUPP));
        assert_eq!(((*mr).lkey, (*mr).rkey, (*mr).pd), (lkey, rkey, pd), "the region is as it was");

        // New memory and remote write: the key is re-created, the C struct follows.
        assert_eq!(rereg(1 | 4, ptr::null_mut(), b.as_mut_ptr().cast(), b.len(), 3), 0);
        assert_ne!((*mr).lkey, lkey);
        assert_eq!(((*mr).addr, (*mr).length, (*mr).pd), (b.as_mut_ptr().cast::<c_void>(), b.len(), pd));
        // An RDMA write (loopback) with the new rkey lands in the new memory; one with the old rkey fails.
        let cq = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        let mut init = rc_init(cq, 2);
        let qp = ibv_create_qp(pd, &mut init);
        connect(ctx, qp, (*qp).qp_num);
        b[..6].copy_from_slice(b"rereg!");
        let base = b.as_ptr() as u64;
        let sge = ibv_sge { addr: base, length: 6, lkey: (*mr).lkey };
        assert_eq!(post_write(qp, 0, sge, wr_rdma { remote_addr: base + 4096, rkey: (*mr).rkey }), 0);
        assert_eq!(poll_one(ctx, cq).map(|c| c.status), Some(0));
        assert_eq!(&b[4096..4102], b"rereg!");
        assert_eq!(post_write(qp, 0, sge, wr_rdma { remote_addr: base + 4096, rkey }), 0);
        assert_eq!(poll_one(ctx, cq).map(|c| c.status), Some(10), "IBV_WC_REM_ACCESS_ERR with the old rkey");

        // New memory on another PD: the region counts on that one now.
        assert_eq!(rereg(1 | 2, pd2, a.as_mut_ptr().cast(), a.len(), 0), 0);
        assert_eq!(((*mr).pd, (*mr).addr), (pd2, a.as_mut_ptr().cast::<c_void>()));
        assert_eq!(ibv_dealloc_pd(pd2), libc::EBUSY);
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_dealloc_pd(pd2), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

/// Sets `O_NONBLOCK` on a descriptor, as a program does with `fcntl`.
fn set_nonblocking(fd: c_int) {
    // SAFETY: F_GETFL / F_SETFL take no pointers.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        assert!(flags >= 0);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK), 0);
    }
}

#[test]
fn non_blocking_descriptors_give_eagain_when_nothing_waits() {
    let l = Loopback::new(64, 4, true, 1);
    let (ctx, mr, ch, cq, qp) = (l.ctx, l.mr, l.ch, l.cq, l.qp);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let ops = (*ctx).ops;
        // Made blocking: the flag is the program's to set.
        assert_eq!(libc::fcntl((*ch).fd, libc::F_GETFL) & libc::O_NONBLOCK, 0);
        assert_eq!(libc::fcntl((*ctx).async_fd, libc::F_GETFL) & libc::O_NONBLOCK, 0);
        set_nonblocking((*ch).fd);
        let (mut ev_cq, mut ev_ctx) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!((ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), errno()), (-1, libc::EAGAIN));

        // An armed CQ completes a write: the descriptor becomes readable and the event is taken at once.
        let mem = &l.mem;
        assert_eq!(ops.req_notify_cq.unwrap()(cq, 0), 0);
        let sge = ibv_sge { addr: mem.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
        assert_eq!(post_write(qp, 0, sge, wr_rdma { remote_addr: mem.as_ptr() as u64 + 32, rkey: (*mr).rkey }), 0);
        assert_eq!(poll_one(ctx, cq).map(|c| c.status), Some(0));
        let mut fds = libc::pollfd { fd: (*ch).fd, events: libc::POLLIN, revents: 0 };
        assert_eq!(libc::poll(&mut fds, 1, 2000), 1, "the channel's descriptor becomes readable");
        assert_eq!(ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), 0);
        assert_eq!(ev_cq, cq);
        ibv_ack_cq_events(cq, 1);
        assert_eq!((ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), errno()), (-1, libc::EAGAIN));

        // The async descriptor: whatever the device reported at open is taken, then EAGAIN.
        set_nonblocking((*ctx).async_fd);
        let mut ev: ibv_async_event = std::mem::zeroed();
        let mut again = false;
        for _ in 0..64 {
            if ibv_get_async_event(ctx, &mut ev) == 0 {
                ibv_ack_async_event(&mut ev);
            } else {
                assert_eq!(errno(), libc::EAGAIN);
                again = true;
                break;
            }
        }
        assert!(again, "EAGAIN once no async event waits");
        l.close();
    }
}

/// Waits (up to 2 s per event) for the async event of `event_type` naming `element`, taking every other
/// event that comes first (other tests share the device) and acknowledging those. Returns the event, not
/// acknowledged, or `None`.
///
/// # Safety
/// `ctx` is an open context.
unsafe fn wait_async(ctx: *mut ibv_context, event_type: c_int, element: *mut c_void) -> Option<ibv_async_event> {
    for _ in 0..32 {
        // SAFETY: the caller's open context; one pollfd and one event on the stack.
        unsafe {
            let mut fds = libc::pollfd { fd: (*ctx).async_fd, events: libc::POLLIN, revents: 0 };
            if libc::poll(&mut fds, 1, 2000) != 1 {
                return None;
            }
            let mut ev: ibv_async_event = std::mem::zeroed();
            assert_eq!(ibv_get_async_event(ctx, &mut ev), 0);
            if ev.event_type == event_type && ev.element == element {
                return Some(ev);
            }
            ibv_ack_async_event(&mut ev);
        }
    }
    None
}

#[test]
fn an_injected_cq_overrun_is_an_async_cq_error_and_destroy_waits_for_its_ack() {
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once.
    unsafe {
        let a = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        let b = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        assert!(!a.is_null() && !b.is_null());
        let sim = dev_of((*ctx).device).and_then(|d| d.dev.sim_device()).expect("a simulated device");
        // Only these CQs: other tests share the device. IBV_EVENT_CQ_ERR (0) names the CQ.
        crate::faults::fire(sim, crate::faults::Kind::CqOverrun(Some((*a).handle)));
        let mut ev = wait_async(ctx, 0, a.cast()).expect("IBV_EVENT_CQ_ERR for the first CQ");
        ibv_ack_async_event(&mut ev);
        assert_eq!((*a).async_events_completed, 1, "libibverbs' counter");
        assert_eq!(ibv_destroy_cq(a), 0);

        // An event not yet acknowledged holds the destroy of the CQ it names, as libibverbs documents.
        crate::faults::fire(sim, crate::faults::Kind::CqOverrun(Some((*b).handle)));
        let mut ev = wait_async(ctx, 0, b.cast()).expect("IBV_EVENT_CQ_ERR for the second CQ");
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d, cq) = (done.clone(), b as usize);
        let destroyer = std::thread::spawn(move || {
            // The CQ is live; this thread destroys it once (inside the test's unsafe block).
            let rc = ibv_destroy_cq(cq as *mut ibv_cq);
            d.store(true, std::sync::atomic::Ordering::SeqCst);
            rc
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!done.load(std::sync::atomic::Ordering::SeqCst), "destroy waits for the acknowledgement");
        ibv_ack_async_event(&mut ev);
        assert_eq!(destroyer.join().unwrap(), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

/// Allocator calls seen by the test allocators: (size, alignment, resource type), and frees.
static ALLOC_CALLS: std::sync::Mutex<Vec<(usize, usize, u64)>> = std::sync::Mutex::new(Vec::new());
static FREES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Answers `IBV_ALLOCATOR_USE_DEFAULT`, and records the call.
unsafe extern "C" fn default_alloc(
    _pd: *mut ibv_pd,
    ctx: *mut c_void,
    size: usize,
    align: usize,
    ty: u64,
) -> *mut c_void {
    assert_eq!(ctx as usize, 0x77, "the parent domain's pd_context");
    ALLOC_CALLS.lock().unwrap().push((size, align, ty));
    usize::MAX as *mut c_void
}

/// Gives memory of its own (which the library must give back).
unsafe extern "C" fn memory_alloc(
    _pd: *mut ibv_pd,
    _ctx: *mut c_void,
    size: usize,
    _align: usize,
    _ty: u64,
) -> *mut c_void {
    // SAFETY: malloc of a positive size; freed by `memory_free`.
    unsafe { libc::malloc(size.max(1)) }
}

unsafe extern "C" fn memory_free(_pd: *mut ibv_pd, _ctx: *mut c_void, p: *mut c_void, _ty: u64) {
    FREES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: memory `memory_alloc` gave.
    unsafe { libc::free(p) };
}

#[test]
fn parent_domain_allocators_are_asked_and_only_their_default_answer_is_taken() {
    let ctx = open();
    let v = vctx(ctx);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        let cq = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        let mut a = ibv_parent_domain_init_attr {
            pd,
            td: ptr::null_mut(),
            comp_mask: 1 | 2, // ALLOCATORS | PD_CONTEXT
            alloc: Some(default_alloc),
            free: Some(memory_free),
            pd_context: 0x77 as *mut c_void,
        };
        let parent = v.alloc_parent_domain.unwrap()(ctx, &mut a);
        assert!(!parent.is_null());
        let mut init = rc_init(cq, 1);
        let qp = ibv_create_qp(parent, &mut init);
        assert!(!qp.is_null(), "USE_DEFAULT: the driver's own memory");
        let calls = ALLOC_CALLS.lock().unwrap().clone();
        // libmlx5's MLX5DV_RES_TYPE_QP and _DBR: the rings (page aligned) and the doorbell record.
        assert_eq!(calls.len(), 2);
        assert!(calls[0].0 >= 64 && calls[0].1 == 4096 && calls[0].2 == (1 << 32 | 1), "{calls:?}");
        assert_eq!(calls[1], (8, 8, 1 << 32 | 3));
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_dealloc_pd(parent), 0);
        // An allocator that gives memory: it is given back and the creation is EOPNOTSUPP.
        a.alloc = Some(memory_alloc);
        let parent = v.alloc_parent_domain.unwrap()(ctx, &mut a);
        assert!(ibv_create_qp(parent, &mut init).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        assert_eq!(FREES.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(ibv_dealloc_pd(parent), 0, "nothing stays counted on it");
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

#[test]
fn parent_domains_stand_for_their_pd_with_a_thread_domain() {
    let ctx = open();
    let v = vctx(ctx);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let (alloc_pd, alloc_td, dealloc_td) =
            (v.alloc_parent_domain.unwrap(), v.alloc_td.unwrap(), v.dealloc_td.unwrap());
        let pd = ibv_alloc_pd(ctx);
        let mut tia = ibv_td_init_attr { comp_mask: 0 };
        let td = alloc_td(ctx, &mut tia);
        assert!(!td.is_null());
        let user = 0x77 as *mut c_void;
        let mut a = ibv_parent_domain_init_attr { pd, td, comp_mask: 4, alloc: None, free: None, pd_context: user };
        assert!(alloc_pd(ctx, &mut a).is_null());
        assert_eq!(errno(), libc::EINVAL, "an unknown comp_mask bit");
        a.comp_mask = 2; // PD_CONTEXT
        let parent = alloc_pd(ctx, &mut a);
        assert!(!parent.is_null());
        assert_eq!(((*parent).context, (*parent).handle), (ctx, (*pd).handle));
        // A parent domain is not a protection domain for another one.
        a.pd = parent;
        assert!(alloc_pd(ctx, &mut a).is_null());
        assert_eq!(errno(), libc::EINVAL);

        // Objects made through the parent domain: an MR, an extended CQ on it, a QP; a loopback RDMA write.
        let mut mem = vec![0u8; 64];
        let mr = ibv_reg_mr(parent, mem.as_mut_ptr().cast(), mem.len(), 0b111);
        assert!(!mr.is_null());
        let mut cia: ibv_cq_init_attr_ex = std::mem::zeroed();
        cia.cqe = 4;
        cia.wc_flags = 1; // BYTE_LEN
        cia.comp_mask = 2; // IBV_CQ_INIT_ATTR_MASK_PD
        cia.parent_domain = pd;
        assert!(v.create_cq_ex.unwrap()(ctx, &mut cia).is_null(), "a protection domain is no parent domain");
        assert_eq!(errno(), libc::EINVAL);
        cia.parent_domain = parent;
        let cq = v.create_cq_ex.unwrap()(ctx, &mut cia).cast::<ibv_cq>();
        assert!(!cq.is_null());
        let mut init = rc_init(cq, 1);
        let qp = ibv_create_qp(parent, &mut init);
        assert!(!qp.is_null());
        connect(ctx, qp, (*qp).qp_num);
        mem[..4].copy_from_slice(b"pdom");
        let sge = ibv_sge { addr: mem.as_ptr() as u64, length: 4, lkey: (*mr).lkey };
        assert_eq!(post_write(qp, 0, sge, wr_rdma { remote_addr: mem.as_ptr() as u64 + 32, rkey: (*mr).rkey }), 0);
        assert_eq!(poll_one(ctx, cq).map(|c| c.status), Some(0));
        assert_eq!(&mem[32..36], b"pdom");

        // Each keeps what it is made on: EBUSY until they go, children first.
        assert_eq!(ibv_dealloc_pd(parent), libc::EBUSY);
        assert_eq!(ibv_dealloc_pd(pd), libc::EBUSY);
        assert_eq!(dealloc_td(td), libc::EBUSY);
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_dealloc_pd(parent), 0);
        assert_eq!(dealloc_td(td), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

#[test]
fn completions_carry_the_device_clock_when_asked() {
    let ctx = open();
    let v = vctx(ctx);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let mut attr: ibv_device_attr_ex = std::mem::zeroed();
        let size = std::mem::size_of::<ibv_device_attr_ex>();
        assert_eq!(v.query_device_ex.unwrap()(ctx, ptr::null(), &mut attr, size), 0);
        assert_eq!(attr.completion_timestamp_mask, (1 << 63) - 1);
        assert!(attr.hca_core_clock > 0, "the device clock's kHz");
        let mut cia: ibv_cq_init_attr_ex = std::mem::zeroed();
        cia.cqe = 4;
        cia.wc_flags = 1 | (1 << 7); // BYTE_LEN | COMPLETION_TIMESTAMP
        let cqx = v.create_cq_ex.unwrap()(ctx, &mut cia);
        assert!(!cqx.is_null());
        let cq = cqx.cast::<ibv_cq>();
        cia.wc_flags |= 1 << 11; // COMPLETION_TIMESTAMP_WALLCLOCK: no real-time clock here
        assert!(v.create_cq_ex.unwrap()(ctx, &mut cia).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);

        let mut l = Loopback::on(ctx, ptr::null_mut(), cq, 64);
        l.connect_qp(1);
        let (mem, mr, qp) = (&l.mem, l.mr, l.qp);
        let sge = ibv_sge { addr: mem.as_ptr() as u64, length: 8, lkey: (*mr).lkey };
        assert_eq!(post_write(qp, 0, sge, wr_rdma { remote_addr: mem.as_ptr() as u64 + 32, rkey: (*mr).rkey }), 0);
        let mut got = None;
        for _ in 0..10_000 {
            if (*cqx).start_poll.unwrap()(cqx, ptr::null_mut()) == 0 {
                got = Some(((*cqx).status, (*cqx).read_completion_ts.unwrap()(cqx)));
                (*cqx).end_poll.unwrap()(cqx);
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        let (status, ts) = got.expect("a completion");
        assert_eq!(status, 0);
        assert!(ts > 0, "the device clock when the CQE was written");
        l.close();
    }
}

#[test]
fn a_move_to_reset_takes_the_qps_unpolled_completions_out_of_its_cq() {
    let mut l = Loopback::new(256, 8, false, 4);
    let (ctx, pd, mr, cq, a) = (l.ctx, l.pd, l.mr, l.cq, l.qp);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let ops = (*ctx).ops;
        let mut init = rc_init(cq, 4);
        let b = ibv_create_qp(pd, &mut init);
        connect(ctx, b, (*b).qp_num);
        let mem = &mut l.mem;
        // A, B, A: three writes, each completing on the one CQ; nobody polls yet.
        mem[..8].copy_from_slice(b"complete");
        let base = mem.as_ptr() as u64;
        for (i, qp) in [a, b, a].into_iter().enumerate() {
            let sge = ibv_sge { addr: base, length: 8, lkey: (*mr).lkey };
            let remote = wr_rdma { remote_addr: base + 64 + 8 * i as u64, rkey: (*mr).rkey };
            assert_eq!(post_write(qp, i as u64, sge, remote), 0);
        }
        // The device writes all three CQEs; the third write is in memory once they are.
        for _ in 0..2000 {
            if mem[80..88] == mem[..8] && mem[64..72] == mem[..8] {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        // A moves to RESET: its two completions go, B's stays.
        let mut attr: ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = 0;
        assert_eq!(ibv_modify_qp(a, &mut attr, 1), 0);
        let wc = poll_one(ctx, cq).expect("B's completion");
        assert_eq!((wc.wr_id, wc.qp_num, wc.status), (1, (*b).qp_num, 0));
        let mut more = [ibv_wc::default(); 4];
        assert_eq!(ops.poll_cq.unwrap()(cq, 4, more.as_mut_ptr()), 0, "nothing of A's is left");
        assert_eq!(ibv_destroy_qp(b), 0);
        l.close();
    }
}

/// Waits (at most `ms` milliseconds) until `fd` is readable.
fn readable_within(fd: c_int, ms: c_int) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n == 1 && p.revents & libc::POLLIN != 0
}

/// UCX's rc_verbs teardown: a QP on an SRQ moved to ERR raises IBV_EVENT_QP_LAST_WQE_REACHED; the QP is destroyed
/// before the event is taken. The event goes with the QP, as Linux drops it, instead of reaching the program
/// with `element.qp == NULL` (which UCX dereferenced).
#[test]
fn an_async_event_of_a_destroyed_qp_is_dropped_not_handed_out_with_a_null_qp() {
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        let cq = ibv_create_cq(ctx, 8, ptr::null_mut(), ptr::null_mut(), 0);
        let mut sa = ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ibv_srq_attr { max_wr: 4, max_sge: 1, srq_limit: 0 },
        };
        let srq = ibv_create_srq(pd, &mut sa);
        assert!(!srq.is_null());
        let mut init = rc_init(cq, 1);
        init.srq = srq;
        init.cap.max_recv_wr = 0;
        let qp = ibv_create_qp(pd, &mut init);
        assert!(!qp.is_null());
        connect(ctx, qp, (*qp).qp_num);
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = 6; // IBV_QPS_ERR
        assert_eq!(ibv_modify_qp(qp, &mut a, 1), 0);
        assert!(readable_within((*ctx).async_fd, 10_000), "LAST_WQE_REACHED is queued");
        assert_eq!(ibv_destroy_qp(qp), 0);
        set_nonblocking((*ctx).async_fd);
        let mut ev: ibv_async_event = std::mem::zeroed();
        let got = ibv_get_async_event(ctx, &mut ev);
        assert_eq!(
            (got, errno()),
            (-1, libc::EAGAIN),
            "an event of a destroyed QP was handed out: type {}, element {:?}",
            ev.event_type,
            ev.element
        );
        assert_eq!(ibv_destroy_srq(srq), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

/// Posts one signaled SEND of `sge` on `qp`; what `post_send` returned.
///
/// # Safety
/// `qp` is a live QP; `sge` lies in registered memory (or is inline) and lives until the send completes.
unsafe fn post_send_one(qp: *mut ibv_qp, mut sge: ibv_sge, flags: c_uint) -> c_int {
    // SAFETY: ibv_send_wr is plain data.
    let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
    w.sg_list = &mut sge;
    w.num_sge = 1;
    w.opcode = 2;
    w.send_flags = 2 | flags;
    let mut bad = ptr::null_mut();
    // SAFETY: a live QP of an open context; the request and its SGE live on this stack for the call.
    unsafe { (*(*qp).context).ops.post_send.unwrap()(qp, &mut w, &mut bad) }
}

/// Posts one receive of `sge` on `qp`; what `post_recv` returned.
///
/// # Safety
/// `qp` is a live QP; `sge` lies in registered memory that lives until the receive completes.
unsafe fn post_recv_one(qp: *mut ibv_qp, mut sge: ibv_sge) -> c_int {
    let mut w = ibv_recv_wr { wr_id: 9, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
    let mut bad = ptr::null_mut();
    // SAFETY: as above.
    unsafe { (*(*qp).context).ops.post_recv.unwrap()(qp, &mut w, &mut bad) }
}

#[test]
fn a_receive_only_and_a_send_only_qp_are_created_and_talk() {
    let mut l = Loopback::without_qp(256, 8, false);
    let (ctx, pd, mr, cq) = (l.ctx, l.pd, l.mr, l.cq);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let mem = &mut l.mem;
        // qperf's receiver: no send queue. rdma-core's mlx5 sizes no SQ and reports max_send_wr 0.
        let mut rx_init = rc_init(cq, 0);
        rx_init.cap.max_recv_wr = 4;
        let rx = ibv_create_qp(pd, &mut rx_init);
        assert!(!rx.is_null(), "receive-only QP refused: errno {}", errno());
        assert_eq!(rx_init.cap.max_send_wr, 0);
        assert!(rx_init.cap.max_recv_wr >= 4);
        // No receive queue and no SRQ: rdma-core's mlx5 makes a zero-length RQ and reports max_recv_wr 0.
        let mut tx_init = rc_init(cq, 4);
        tx_init.cap.max_recv_wr = 0;
        let tx = ibv_create_qp(pd, &mut tx_init);
        assert!(!tx.is_null(), "send-only QP refused: errno {}", errno());
        assert_eq!((tx_init.cap.max_recv_wr, tx_init.cap.max_recv_sge), (0, 0));
        assert!(tx_init.cap.max_send_wr >= 4);
        connect(ctx, rx, (*tx).qp_num);
        connect(ctx, tx, (*rx).qp_num);
        let base = mem.as_mut_ptr() as u64;
        let lkey = (*mr).lkey;
        // Each queue that does not exist is full, as libmlx5's overflow check finds it: ENOMEM.
        assert_eq!(post_send_one(rx, ibv_sge { addr: base, length: 4, lkey }, 0), libc::ENOMEM);
        assert_eq!(post_recv_one(tx, ibv_sge { addr: base + 128, length: 64, lkey }), libc::ENOMEM);
        // The send-only QP's SEND lands in the receive-only QP's buffer.
        assert_eq!(post_recv_one(rx, ibv_sge { addr: base + 128, length: 64, lkey }), 0);
        mem[..4].copy_from_slice(b"qprf");
        assert_eq!(post_send_one(tx, ibv_sge { addr: base, length: 4, lkey }, 0), 0);
        let mut got = [poll_one(ctx, cq).expect("a completion"), poll_one(ctx, cq).expect("a second completion")];
        got.sort_by_key(|w| w.opcode);
        assert_eq!((got[0].opcode, got[0].status, got[0].qp_num), (0, 0, (*tx).qp_num));
        assert_eq!((got[1].opcode, got[1].status, got[1].byte_len, got[1].qp_num), (128, 0, 4, (*rx).qp_num));
        assert_eq!(&mem[128..132], b"qprf");
        // query_qp reports the queues as made.
        let mut qa: ibv_qp_attr = std::mem::zeroed();
        let mut qi: ibv_qp_init_attr = std::mem::zeroed();
        assert_eq!(ibv_query_qp(rx, &mut qa, 0, &mut qi), 0);
        assert_eq!(qa.cap.max_send_wr, 0);
        assert_eq!(ibv_destroy_qp(rx), 0);
        assert_eq!(ibv_destroy_qp(tx), 0);
        l.close();
    }
}

/// Set in the child process `a_comp_channel_at_the_descriptor_limit_is_null_with_emfile` runs itself in.
const FD_LIMIT_CHILD: &str = "MLX5_RS_TEST_FD_LIMIT_CHILD";

#[test]
fn a_comp_channel_at_the_descriptor_limit_is_null_with_emfile() {
    const NAME: &str = "tests::a_comp_channel_at_the_descriptor_limit_is_null_with_emfile";
    if std::env::var_os(FD_LIMIT_CHILD).is_none() {
        // The descriptor limit is the process's: lowered in a child of its own, so other tests keep theirs.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([NAME, "--exact", "--test-threads=1", "--nocapture"])
            .env(FD_LIMIT_CHILD, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "child: {text}");
        return;
    }
    let ctx = open();
    // SAFETY: an open context; the limit is restored before anything else runs in this process.
    unsafe {
        // Every descriptor below the lowest free one is in use: a limit there leaves none to make.
        let lowest = libc::dup(0);
        assert!(lowest >= 0);
        libc::close(lowest);
        let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let low = libc::rlimit { rlim_cur: lowest as libc::rlim_t, rlim_max: old.rlim_max };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
        let ch = ibv_create_comp_channel(ctx);
        let e = errno();
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &old), 0);
        assert!(ch.is_null(), "a channel with fd {}", (*ch).fd);
        assert_eq!(e, libc::EMFILE);
        // With descriptors again, a channel is made.
        let ch = ibv_create_comp_channel(ctx);
        assert!(!ch.is_null() && (*ch).fd >= 0);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

#[test]
fn reset_to_err_is_a_valid_transition() {
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        let cq = ibv_create_cq(ctx, 8, ptr::null_mut(), ptr::null_mut(), 0);
        let mut init = rc_init(cq, 4);
        let qp = ibv_create_qp(pd, &mut init);
        // IBTA 10.3.1: any state may go to ERR; mlx5 firmware's 2ERR_QP takes a QP from RESET too.
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = 6;
        assert_eq!(ibv_modify_qp(qp, &mut a, 1), 0);
        assert_eq!((*qp).state, 6);
        let mut qa: ibv_qp_attr = std::mem::zeroed();
        let mut qi: ibv_qp_init_attr = std::mem::zeroed();
        assert_eq!(ibv_query_qp(qp, &mut qa, 1, &mut qi), 0);
        assert_eq!(qa.qp_state, 6);
        // And back to RESET, then on to INIT as usual.
        a.qp_state = 0;
        assert_eq!(ibv_modify_qp(qp, &mut a, 1), 0);
        a.qp_state = 1;
        a.port_num = 1;
        assert_eq!(ibv_modify_qp(qp, &mut a, 1 | 16 | 32 | 8), 0);
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

#[test]
fn create_ah_refuses_a_port_that_does_not_exist_and_an_empty_gid() {
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        let mut gid = ibv_gid::default();
        assert_eq!(ibv_query_gid(ctx, 1, 0, &mut gid), 0);
        let mut port: ibv_port_attr = std::mem::zeroed();
        assert_eq!(ibv_query_port(ctx, 1, &mut port), 0);
        let mut attr = ibv_ah_attr { is_global: 1, port_num: 1, ..Default::default() };
        attr.grh.dgid = gid;
        attr.grh.hop_limit = 1;
        let ah = ibv_create_ah(pd, &mut attr);
        assert!(!ah.is_null(), "errno {}", errno());
        assert_eq!(ibv_destroy_ah(ah), 0);
        // A port the device does not have: EINVAL (the kernel's rdma_is_port_valid).
        for p in [0, 2, 7] {
            attr.port_num = p;
            assert!(ibv_create_ah(pd, &mut attr).is_null(), "port {p}");
            assert_eq!(errno(), libc::EINVAL, "port {p}");
        }
        attr.port_num = 1;
        // An index in the table whose entry is empty: ENODATA (rdma_get_gid_attr, which create_ah asks).
        let empty = (0..port.gid_tbl_len)
            .find(|&i| {
                let mut g = ibv_gid::default();
                ibv_query_gid(ctx, 1, i, &mut g) == 0 && g.raw == [0; 16]
            })
            .expect("an empty GID entry");
        attr.grh.sgid_index = empty as u8;
        assert!(ibv_create_ah(pd, &mut attr).is_null(), "sgid_index {empty}");
        assert_eq!(errno(), libc::ENODATA);
        // An index past the table: EINVAL.
        if port.gid_tbl_len <= 255 {
            attr.grh.sgid_index = port.gid_tbl_len as u8;
            assert!(ibv_create_ah(pd, &mut attr).is_null());
            assert_eq!(errno(), libc::EINVAL);
        }
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

#[test]
fn access_flags_and_lengths_are_refused_as_the_kernel_refuses_them() {
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        let mut mem = vec![0u8; 4096];
        let p = mem.as_mut_ptr().cast::<c_void>();
        // Bits outside IB_ACCESS_SUPPORTED (0..9 and the optional range 20..29): EINVAL.
        for bit in [10, 12, 19, 30, 31] {
            assert!(ibv_reg_mr(pd, p, mem.len(), 1 | (1 << bit)).is_null(), "bit {bit}");
            assert_eq!(errno(), libc::EINVAL, "bit {bit}");
        }
        // Remote write or atomic without local write: EINVAL (ib_check_mr_access).
        for f in [2, 8] {
            assert!(ibv_reg_mr(pd, p, mem.len(), f).is_null(), "flags {f}");
            assert_eq!(errno(), libc::EINVAL, "flags {f}");
        }
        // ib_umem_get's arithmetic, before any page is pinned: an end that wraps the address space, or more than
        // u32::MAX pages (2^50 bytes), is EINVAL.
        for len in [usize::MAX - 100, 1 << 50, (u32::MAX as usize + 1) * 4096] {
            assert!(ibv_reg_mr(pd, p, len, 1).is_null(), "length {len:#x}");
            assert_eq!(errno(), libc::EINVAL, "length {len:#x}");
        }
        let mr = ibv_reg_mr(pd, p, mem.len(), 1 | (1 << 20));
        assert!(!mr.is_null(), "relaxed ordering is optional: errno {}", errno());
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

#[test]
fn oversize_inline_is_enomem_at_post_and_einval_at_create() {
    let mut l = Loopback::without_qp(4096, 8, false);
    let (ctx, pd, mr, cq) = (l.ctx, l.pd, l.mr, l.cq);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let mem = &mut l.mem;
        // More inline data than a WQE holds: mlx5_calc_send_wqe's EINVAL.
        let mut init = rc_init(cq, 4);
        init.cap.max_inline_data = 4096;
        assert!(ibv_create_qp(pd, &mut init).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // Made as ibv_create_qp_ex makes it, with the SEND builder (IBV_QP_INIT_ATTR_PD | SEND_OPS_FLAGS).
        let i = rc_init(cq, 4);
        let mut init: ibv_qp_init_attr_ex = std::mem::zeroed();
        (init.send_cq, init.recv_cq, init.cap, init.qp_type, init.sq_sig_all) = (cq, cq, i.cap, 2, 1);
        init.cap.max_inline_data = 64;
        (init.comp_mask, init.pd, init.send_ops_flags) = (1 | (1 << 6), pd, 1 << 2);
        let qp = vctx(ctx).create_qp_ex.unwrap()(ctx, &mut init);
        assert!(!qp.is_null(), "errno {}", errno());
        let max = init.cap.max_inline_data;
        connect(ctx, qp, (*qp).qp_num);
        let base = mem.as_mut_ptr() as u64;
        // An inline send over the QP's max_inline_data: _mlx5_post_send's ENOMEM, and nothing is posted.
        let sge = ibv_sge { addr: base, length: max + 1, lkey: (*mr).lkey };
        assert_eq!(post_send_one(qp, sge, 8), libc::ENOMEM);
        let sge = ibv_sge { addr: base, length: 2000, lkey: (*mr).lkey };
        assert_eq!(post_send_one(qp, sge, 8), libc::ENOMEM);
        // The extended builder's ibv_wr_set_inline_data likewise (mlx5's _mlx5_send_wr_set_inline_data).
        let qx = ibv_qp_to_qp_ex(qp);
        let set_inline = (*qx).wr_set_inline_data.unwrap();
        (*qx).wr_start.unwrap()(qx);
        (*qx).wr_id = 5;
        (*qx).wr_flags = 2;
        (*qx).wr_send.unwrap()(qx);
        set_inline(qx, mem.as_mut_ptr().cast(), max as usize + 1);
        assert_eq!((*qx).wr_complete.unwrap()(qx), libc::ENOMEM);
        let mut wc = [ibv_wc::default(); 2];
        assert_eq!((*ctx).ops.poll_cq.unwrap()(cq, 2, wc.as_mut_ptr()), 0, "nothing was posted");
        assert_eq!(ibv_destroy_qp(qp), 0);
        l.close();
    }
}

#[test]
fn poll_cq_with_a_negative_count_polls_nothing_and_returns_zero() {
    let mut l = Loopback::new(64, 8, false, 4);
    let (ctx, mr, cq, qp) = (l.ctx, l.mr, l.cq, l.qp);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let mem = &mut l.mem;
        mem[..8].copy_from_slice(b"negative");
        let base = mem.as_ptr() as u64;
        let sge = ibv_sge { addr: base, length: 8, lkey: (*mr).lkey };
        assert_eq!(post_write(qp, 3, sge, wr_rdma { remote_addr: base + 32, rkey: (*mr).rkey }), 0);
        // mlx5_poll_cq's loop runs while npolled < ne: a negative count polls nothing and answers 0, with the
        // completion left for the next poll.
        let poll = (*ctx).ops.poll_cq.unwrap();
        let mut wc = [ibv_wc::default(); 1];
        for _ in 0..10_000 {
            assert_eq!(poll(cq, -1, wc.as_mut_ptr()), 0);
            assert_eq!(poll(cq, c_int::MIN, ptr::null_mut()), 0);
            if mem[32..40] == mem[..8] {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        let w = poll_one(ctx, cq).expect("the write's completion");
        assert_eq!((w.wr_id, w.status), (3, 0));
        l.close();
    }
}

#[test]
fn too_many_gather_entries_are_enomem_on_send_and_einval_on_receive() {
    let mut l = Loopback::new(256, 8, false, 4);
    let (ctx, mr, cq, qp) = (l.ctx, l.mr, l.cq, l.qp);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let base = l.mem.as_mut_ptr() as u64;
        // Two entries where the QP takes one, and more than any QP takes: _mlx5_post_send's ENOMEM.
        for n in [2usize, 65, 1000] {
            let mut sgl: Vec<ibv_sge> = (0..n).map(|_| ibv_sge { addr: base, length: 1, lkey: (*mr).lkey }).collect();
            let mut w: ibv_send_wr = std::mem::zeroed();
            (w.sg_list, w.num_sge, w.opcode, w.send_flags) = (sgl.as_mut_ptr(), n as c_int, 2, 2);
            let mut bad = ptr::null_mut();
            assert_eq!((*ctx).ops.post_send.unwrap()(qp, &mut w, &mut bad), libc::ENOMEM, "{n} entries");
            assert_eq!(bad, &mut w as *mut _, "the refused request is named");
            // mlx5_post_recv's EINVAL for the same list.
            let mut r = ibv_recv_wr { wr_id: 1, next: ptr::null_mut(), sg_list: sgl.as_mut_ptr(), num_sge: n as c_int };
            let mut bad = ptr::null_mut();
            assert_eq!((*ctx).ops.post_recv.unwrap()(qp, &mut r, &mut bad), libc::EINVAL, "{n} entries");
        }
        let mut wc = [ibv_wc::default(); 2];
        assert_eq!((*ctx).ops.poll_cq.unwrap()(cq, 2, wc.as_mut_ptr()), 0, "nothing was posted");
        l.close();
    }
}

#[test]
fn a_receive_with_a_null_scatter_list_is_einval_and_an_empty_one_is_posted() {
    let l = Loopback::new(256, 8, false, 4);
    let (ctx, cq, qp) = (l.ctx, l.cq, l.qp);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        // One entry at a NULL list: refused and named, nothing posted.
        let mut r = ibv_recv_wr { wr_id: 1, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 1 };
        let mut bad = ptr::null_mut();
        assert_eq!((*ctx).ops.post_recv.unwrap()(qp, &mut r, &mut bad), libc::EINVAL);
        assert_eq!(bad, &mut r as *mut _);
        // No entries: posted, and a SEND of nothing lands in it.
        (r.wr_id, r.num_sge) = (2, 0);
        assert_eq!((*ctx).ops.post_recv.unwrap()(qp, &mut r, &mut bad), 0);
        let mut w: ibv_send_wr = std::mem::zeroed();
        (w.wr_id, w.opcode, w.send_flags) = (3, 2, 2);
        let mut bad_s = ptr::null_mut();
        assert_eq!((*ctx).ops.post_send.unwrap()(qp, &mut w, &mut bad_s), 0);
        let mut ids = poll_ids(cq, 2);
        ids.sort_unstable();
        assert_eq!(ids, [2, 3], "the empty receive took the SEND");
        l.close();
    }
}

/// The send doorbells the simulated device saw for `qpn`: (producer counter, BlueFlame bytes copied with it).
fn sq_doorbells(ctx: *mut ibv_context, qpn: u32) -> Vec<(u16, usize)> {
    use mlx5_sim::SimEvent as E;
    // SAFETY: an open context of this library.
    let c = unsafe { ctx_of(ctx) }.expect("open context");
    let dev = c.dev.dev.sim_device().expect("mlx5_0 is simulated");
    let mut out: Vec<(u16, usize)> = Vec::new();
    for e in dev.events() {
        match e {
            E::SqDoorbell { qpn: q, pi } if q == qpn => out.push((pi, 0)),
            // A BlueFlame copy's 8-byte writes follow its doorbell write.
            E::BlueFlameCopy { qpn: q, .. } if q == qpn => {
                if let Some(last) = out.last_mut() {
                    last.1 += 8;
                }
            }
            _ => {}
        }
    }
    out
}

/// `n` signaled RDMA WRITEs of 8 bytes each, linked as one list (`wrs[i].next = &wrs[i + 1]`); the SGEs live in
/// `sges`, which must outlive the list.
fn write_list(l: &Loopback, sges: &mut [ibv_sge], wrs: &mut [ibv_send_wr]) {
    let base = l.mem.as_ptr() as u64;
    // SAFETY: a live MR of the Loopback.
    let (lkey, rkey) = unsafe { ((*l.mr).lkey, (*l.mr).rkey) };
    for (i, s) in sges.iter_mut().enumerate() {
        *s = ibv_sge { addr: base + 8 * i as u64, length: 8, lkey };
    }
    let n = wrs.len();
    for i in 0..n {
        // SAFETY: ibv_send_wr is plain data.
        let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
        w.wr_id = 100 + i as u64;
        w.sg_list = &mut sges[i];
        w.num_sge = 1;
        w.opcode = 0;
        w.send_flags = 2;
        w.wr.rdma = wr_rdma { remote_addr: base + 4096 + 8 * i as u64, rkey };
        wrs[i] = w;
    }
    for i in 0..n.saturating_sub(1) {
        let next: *mut ibv_send_wr = &mut wrs[i + 1];
        wrs[i].next = next;
    }
}

/// Polls `want` completions (or gives up after a while), returning their wr_ids.
unsafe fn poll_ids(cq: *mut ibv_cq, want: usize) -> Vec<u64> {
    let mut wc = [ibv_wc::default(); 16];
    let mut got = Vec::new();
    for _ in 0..10_000 {
        // SAFETY: a live CQ of this library (caller).
        let n = unsafe { (*(*cq).context).ops.poll_cq.unwrap()(cq, wc.len() as c_int, wc.as_mut_ptr()) };
        assert!(n >= 0);
        for w in &wc[..n as usize] {
            assert_eq!(w.status, 0, "{w:?}");
            got.push(w.wr_id);
        }
        if got.len() >= want {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    got
}

/// Issue 38: `ibv_post_send` posts a list as rdma-core does, one doorbell for the whole of it, counted at the
/// simulated UAR; a single small WR goes by BlueFlame (its WQE copied with the doorbell), a list never does.
#[test]
fn a_list_of_16_sends_rings_exactly_one_doorbell() {
    let l = Loopback::new(8192, 64, false, 32);
    // SAFETY: the Loopback's live objects; the list and its SGEs live on this stack during the calls.
    unsafe {
        let qpn = (*l.qp).qp_num;
        let mut sges = [ibv_sge { addr: 0, length: 0, lkey: 0 }; 16];
        let mut wrs: [ibv_send_wr; 16] = std::mem::zeroed();
        write_list(&l, &mut sges, &mut wrs);
        let before = sq_doorbells(l.ctx, qpn);
        let mut bad = ptr::null_mut();
        assert_eq!((*l.ctx).ops.post_send.unwrap()(l.qp, wrs.as_mut_ptr(), &mut bad), 0);
        let after = sq_doorbells(l.ctx, qpn);
        assert_eq!(after.len(), before.len() + 1, "one doorbell for 16 WRs: {:?}", &after[before.len()..]);
        // The doorbell names the producer counter after all 16 WQEs (one BB each), with no BlueFlame copy.
        assert_eq!(after.last(), Some(&(16, 0)));
        let mut ids = poll_ids(l.cq, 16);
        ids.sort();
        assert_eq!(ids, (100..116).collect::<Vec<_>>());

        // One WR alone: one doorbell, its 64-byte WQE by BlueFlame.
        let mut one = ptr::read(&wrs[0]);
        one.next = ptr::null_mut();
        assert_eq!((*l.ctx).ops.post_send.unwrap()(l.qp, &mut one, &mut bad), 0);
        let last = sq_doorbells(l.ctx, qpn);
        assert_eq!(last.len(), after.len() + 1);
        assert_eq!(last.last(), Some(&(17, 56)), "the doorbell word and the other 56 bytes of the BB");
        assert_eq!(poll_ids(l.cq, 1), [100]);
        l.close();
    }
}

/// Issue 38: an error in the middle of a list leaves `bad_wr` at the first WR not posted, with the ones before it
/// posted (and rung, once) and none after, as rdma-core's `_mlx5_post_send` and `mlx5_post_recv` do.
#[test]
fn an_error_mid_list_sets_bad_wr_and_posts_the_wrs_before_it() {
    let l = Loopback::new(8192, 64, false, 32);
    // SAFETY: the Loopback's live objects; the lists and their SGEs live on this stack during the calls.
    unsafe {
        let qpn = (*l.qp).qp_num;
        let mut sges = [ibv_sge { addr: 0, length: 0, lkey: 0 }; 16];
        let mut wrs: [ibv_send_wr; 16] = std::mem::zeroed();
        write_list(&l, &mut sges, &mut wrs);
        // WR 5 has an opcode that does not exist.
        wrs[5].opcode = 99;
        let before = sq_doorbells(l.ctx, qpn);
        let mut bad = ptr::null_mut();
        assert_eq!((*l.ctx).ops.post_send.unwrap()(l.qp, wrs.as_mut_ptr(), &mut bad), libc::EINVAL);
        assert_eq!(bad, &mut wrs[5] as *mut ibv_send_wr);
        let after = sq_doorbells(l.ctx, qpn);
        assert_eq!(&after[before.len()..], &[(5, 0)], "one doorbell, for the 5 WQEs before the bad one");
        let mut ids = poll_ids(l.cq, 5);
        ids.sort();
        assert_eq!(ids, (100..105).collect::<Vec<_>>());

        // Too many SGEs for the QP (it takes 1) is ENOMEM at WR 3.
        write_list(&l, &mut sges, &mut wrs);
        wrs[3].num_sge = 2;
        bad = ptr::null_mut();
        assert_eq!((*l.ctx).ops.post_send.unwrap()(l.qp, wrs.as_mut_ptr(), &mut bad), libc::ENOMEM);
        assert_eq!(bad, &mut wrs[3] as *mut ibv_send_wr);
        assert_eq!(poll_ids(l.cq, 3).len(), 3);

        // Receives: WR 1 with a negative SGE count is EINVAL; WR 0 is posted, as a SEND that lands in it shows.
        let base = l.mem.as_ptr() as u64;
        let lkey = (*l.mr).lkey;
        let mut rs = [ibv_sge { addr: base + 4096, length: 64, lkey }; 3];
        let mut rw: [ibv_recv_wr; 3] = std::mem::zeroed();
        for (i, w) in rw.iter_mut().enumerate() {
            *w = ibv_recv_wr { wr_id: 200 + i as u64, next: ptr::null_mut(), sg_list: &mut rs[i], num_sge: 1 };
        }
        for i in 0..2 {
            let next: *mut ibv_recv_wr = &mut rw[i + 1];
            rw[i].next = next;
        }
        rw[1].num_sge = -1;
        let mut bad_r = ptr::null_mut();
        assert_eq!((*l.ctx).ops.post_recv.unwrap()(l.qp, rw.as_mut_ptr(), &mut bad_r), libc::EINVAL);
        assert_eq!(bad_r, &mut rw[1] as *mut ibv_recv_wr);
        let mut send = ptr::read(&wrs[0]);
        send.next = ptr::null_mut();
        send.opcode = 2;
        send.wr_id = 300;
        assert_eq!((*l.ctx).ops.post_send.unwrap()(l.qp, &mut send, &mut bad), 0);
        let mut ids = poll_ids(l.cq, 2);
        ids.sort();
        assert_eq!(ids, [200, 300], "the receive posted before the bad WR took the SEND");
        l.close();
    }
}

/// Issue 38: a receive list longer than the room left in the ring posts what fits and stops with ENOMEM at the
/// first WR that does not, on an empty ring and on one already partly full, as `mlx5_post_recv` does; the posted
/// receives are the ones that take the next SENDs, in order.
#[test]
fn a_receive_list_that_fills_the_ring_midway_posts_what_fits() {
    let l = Loopback::without_qp(8192, 64, false);
    // SAFETY: the Loopback's live objects; the lists and their SGEs live on this stack during the calls; the QP
    // made here is destroyed before `close`.
    unsafe {
        let mut init = rc_init(l.cq, 16);
        init.cap.max_recv_wr = 4;
        let qp = ibv_create_qp(l.pd, &mut init);
        assert!(!qp.is_null(), "errno {}", errno());
        connect(l.ctx, qp, (*qp).qp_num);
        let (base, lkey) = (l.mem.as_ptr() as u64, (*l.mr).lkey);
        let mut rs = [ibv_sge { addr: base + 4096, length: 64, lkey }; 16];
        let mut rw: [ibv_recv_wr; 16] = std::mem::zeroed();
        let mut list = |first_id: u64, rw: &mut [ibv_recv_wr; 16]| {
            for (i, w) in rw.iter_mut().enumerate() {
                *w = ibv_recv_wr { wr_id: first_id + i as u64, next: ptr::null_mut(), sg_list: &mut rs[i], num_sge: 1 };
            }
            for i in 0..15 {
                let next: *mut ibv_recv_wr = &mut rw[i + 1];
                rw[i].next = next;
            }
        };
        let post = |rw: &mut [ibv_recv_wr; 16]| {
            let mut bad = ptr::null_mut();
            let r = (*l.ctx).ops.post_recv.unwrap()(qp, rw.as_mut_ptr(), &mut bad);
            (r, if bad.is_null() { None } else { Some(bad.offset_from(rw.as_mut_ptr()) as usize) })
        };
        // Empty ring: as many as it holds, then ENOMEM at the first one that does not fit.
        list(200, &mut rw);
        let (r, bad) = post(&mut rw);
        assert_eq!(r, libc::ENOMEM);
        let room = bad.expect("bad_wr is set");
        assert!((4..16).contains(&room), "the ring holds at least max_recv_wr: {room}");
        let sends = |n: usize, first_id: u64| {
            let mut sges = [ibv_sge { addr: 0, length: 0, lkey: 0 }; 16];
            let mut wrs: [ibv_send_wr; 16] = std::mem::zeroed();
            write_list(&l, &mut sges, &mut wrs);
            for (i, w) in wrs.iter_mut().enumerate().take(n) {
                (w.opcode, w.wr_id) = (2, first_id + i as u64);
            }
            wrs[n - 1].next = ptr::null_mut();
            let mut bad = ptr::null_mut();
            assert_eq!((*l.ctx).ops.post_send.unwrap()(qp, wrs.as_mut_ptr(), &mut bad), 0);
        };
        sends(room, 300);
        let mut ids = poll_ids(l.cq, 2 * room);
        ids.sort();
        let want: Vec<u64> = (200..200 + room as u64).chain(300..300 + room as u64).collect();
        assert_eq!(ids, want, "every receive that fitted took a SEND");
        // One receive outstanding: the list stops one earlier.
        list(400, &mut rw);
        rw[0].next = ptr::null_mut();
        assert_eq!(post(&mut rw), (0, None));
        list(500, &mut rw);
        assert_eq!(post(&mut rw), (libc::ENOMEM, Some(room - 1)));
        sends(room, 600);
        let mut ids = poll_ids(l.cq, 2 * room);
        ids.sort();
        let want: Vec<u64> =
            [400].into_iter().chain(500..500 + room as u64 - 1).chain(600..600 + room as u64).collect();
        assert_eq!(ids, want);
        assert_eq!(ibv_destroy_qp(qp), 0);
        l.close();
    }
}

/// Issue 38: an `ibv_wr_start` … `ibv_wr_complete` batch is posted as one list (one doorbell for 8 WRs, with
/// their gather lists and inline bytes as set), a batch of one by BlueFlame.
#[test]
fn a_wr_batch_rings_one_doorbell() {
    let mut l = Loopback::without_qp(8192, 64, false);
    let (ctx, pd, mr, cq) = (l.ctx, l.pd, l.mr, l.cq);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let i = rc_init(cq, 16);
        let mut init: ibv_qp_init_attr_ex = std::mem::zeroed();
        (init.send_cq, init.recv_cq, init.cap, init.qp_type, init.sq_sig_all) = (cq, cq, i.cap, 2, 1);
        init.cap.max_inline_data = 64;
        // IBV_QP_INIT_ATTR_PD | SEND_OPS_FLAGS; RDMA_WRITE.
        (init.comp_mask, init.pd, init.send_ops_flags) = (1 | (1 << 6), pd, 1);
        let qp = vctx(ctx).create_qp_ex.unwrap()(ctx, &mut init);
        assert!(!qp.is_null(), "errno {}", errno());
        connect(ctx, qp, (*qp).qp_num);
        let qpn = (*qp).qp_num;
        let base = l.mem.as_mut_ptr() as u64;
        l.mem[..8].copy_from_slice(b"gathered");
        let inl = *b"inline!!";
        let (lkey, rkey) = ((*mr).lkey, (*mr).rkey);
        let qx = ibv_qp_to_qp_ex(qp);
        let before = sq_doorbells(ctx, qpn);
        (*qx).wr_start.unwrap()(qx);
        for k in 0..8u64 {
            (*qx).wr_id = 400 + k;
            (*qx).wr_flags = 2;
            (*qx).wr_rdma_write.unwrap()(qx, rkey, base + 4096 + 8 * k);
            if k % 2 == 0 {
                (*qx).wr_set_sge.unwrap()(qx, lkey, base, 8);
            } else {
                (*qx).wr_set_inline_data.unwrap()(qx, inl.as_ptr().cast_mut().cast(), 8);
            }
        }
        assert_eq!((*qx).wr_complete.unwrap()(qx), 0);
        let after = sq_doorbells(ctx, qpn);
        assert_eq!(&after[before.len()..], &[(8, 0)], "one doorbell for the 8 WRs of the batch");
        let mut ids = poll_ids(cq, 8);
        ids.sort();
        assert_eq!(ids, (400..408).collect::<Vec<_>>());
        for k in 0..8 {
            let want: &[u8] = if k % 2 == 0 { b"gathered" } else { b"inline!!" };
            assert_eq!(&l.mem[4096 + 8 * k..4104 + 8 * k], want, "write {k}");
        }
        // A batch of one goes by BlueFlame.
        (*qx).wr_start.unwrap()(qx);
        (*qx).wr_id = 408;
        (*qx).wr_rdma_write.unwrap()(qx, rkey, base + 4096);
        (*qx).wr_set_sge.unwrap()(qx, lkey, base, 8);
        assert_eq!((*qx).wr_complete.unwrap()(qx), 0);
        assert_eq!(sq_doorbells(ctx, qpn).last(), Some(&(9, 56)));
        assert_eq!(poll_ids(cq, 1), [408]);
        // A gather list longer than any WQE holds fails the batch (ENOMEM) without being read; nothing is posted.
        let one = ibv_sge { addr: base, length: 8, lkey };
        (*qx).wr_start.unwrap()(qx);
        (*qx).wr_rdma_write.unwrap()(qx, rkey, base + 4096);
        (*qx).wr_set_sge_list.unwrap()(qx, usize::MAX, &one);
        assert_eq!((*qx).wr_complete.unwrap()(qx), libc::ENOMEM);
        assert_eq!(sq_doorbells(ctx, qpn).last(), Some(&(9, 56)), "no doorbell for a failed batch");
        assert_eq!(ibv_destroy_qp(qp), 0);
        l.close();
    }
}

#[global_allocator]
static ALLOC: mlx5_sim::testkit::alloc_count::Counting = mlx5_sim::testkit::alloc_count::Counting;

/// Issue 38: the C ABI's datapath calls allocate nothing: `ibv_post_send` (1 and 16 per call), `ibv_post_recv`
/// (16), `ibv_poll_cq` (16) and a warm `ibv_wr_*` batch, counted by a global allocator armed on this thread only.
/// The simulated device runs in line, on this thread, when a doorbell rings: its own work is counted too, so a
/// zero here holds for the library and the simulator together.
#[test]
fn the_c_datapath_calls_allocate_nothing() {
    use mlx5_sim::testkit::alloc_count;
    let mut l = Loopback::without_qp(8192, 256, false);
    let (ctx, pd, cq) = (l.ctx, l.pd, l.cq);
    // SAFETY: every pointer is made by this library from this context and destroyed once, children first.
    unsafe {
        let i = rc_init(cq, 64);
        let mut init: ibv_qp_init_attr_ex = std::mem::zeroed();
        (init.send_cq, init.recv_cq, init.cap, init.qp_type, init.sq_sig_all) = (cq, cq, i.cap, 2, 0);
        init.cap.max_recv_wr = 64;
        (init.comp_mask, init.pd, init.send_ops_flags) = (1 | (1 << 6), pd, 1 | (1 << 2));
        let qp = vctx(ctx).create_qp_ex.unwrap()(ctx, &mut init);
        assert!(!qp.is_null(), "errno {}", errno());
        connect(ctx, qp, (*qp).qp_num);
        l.qp = qp;
        let ops = (*ctx).ops;
        let base = l.mem.as_mut_ptr() as u64;
        let lkey = (*l.mr).lkey;
        let mut sges = [ibv_sge { addr: 0, length: 0, lkey: 0 }; 16];
        let mut wrs: [ibv_send_wr; 16] = std::mem::zeroed();
        write_list(&l, &mut sges, &mut wrs);
        let mut rs = [ibv_sge { addr: base + 4096, length: 64, lkey }; 16];
        let mut rw: [ibv_recv_wr; 16] = std::mem::zeroed();
        for (k, w) in rw.iter_mut().enumerate() {
            *w = ibv_recv_wr { wr_id: 500 + k as u64, next: ptr::null_mut(), sg_list: &mut rs[k], num_sge: 1 };
        }
        for k in 0..15 {
            let next: *mut ibv_recv_wr = &mut rw[k + 1];
            rw[k].next = next;
        }
        let qx = ibv_qp_to_qp_ex(qp);
        let mut wc = [ibv_wc::default(); 16];
        let mut bad = ptr::null_mut();
        let mut bad_r = ptr::null_mut();
        // One round of every call; the first warms the builder's storage.
        let mut round = |bad: &mut *mut ibv_send_wr, bad_r: &mut *mut ibv_recv_wr, wrs: &mut [ibv_send_wr; 16]| {
            let mut wc = [ibv_wc::default(); 16];
            let mut polled = 0;
            assert_eq!(ops.post_recv.unwrap()(qp, rw.as_mut_ptr(), bad_r), 0);
            assert_eq!(ops.post_send.unwrap()(qp, wrs.as_mut_ptr(), bad), 0);
            let one: *mut ibv_send_wr = &mut wrs[15];
            assert_eq!(ops.post_send.unwrap()(qp, one, bad), 0);
            (*qx).wr_start.unwrap()(qx);
            (*qx).wr_id = 7;
            (*qx).wr_flags = 2;
            (*qx).wr_rdma_write.unwrap()(qx, (*l.mr).rkey, base + 4096);
            (*qx).wr_set_sge.unwrap()(qx, lkey, base, 8);
            assert_eq!((*qx).wr_complete.unwrap()(qx), 0);
            // 16 + 1 + 1 signaled writes complete (the receives stay posted for the next round's count).
            for _ in 0..1000 {
                let n = ops.poll_cq.unwrap()(cq, 16, wc.as_mut_ptr());
                assert!(n >= 0);
                polled += n;
                if polled >= 18 {
                    break;
                }
            }
            assert_eq!(polled, 18);
        };
        round(&mut bad, &mut bad_r, &mut wrs);
        // Each iteration's receives are consumed by 16 SENDs of the QP to itself.
        let mut iteration = |wrs: &mut [ibv_send_wr; 16]| {
            for w in wrs.iter_mut() {
                w.opcode = 0;
            }
            round(&mut bad, &mut bad_r, wrs);
            for w in wrs.iter_mut() {
                w.opcode = 2;
            }
            assert_eq!(ops.post_send.unwrap()(qp, wrs.as_mut_ptr(), &mut bad), 0);
            let mut got = 0;
            for _ in 0..1000 {
                let n = ops.poll_cq.unwrap()(cq, 16, wc.as_mut_ptr());
                assert!(n >= 0);
                got += n;
                if got >= 32 {
                    break;
                }
            }
            assert_eq!(got, 32, "16 sends and the 16 receives they landed in");
        };
        // Warm-up, uncounted: the builder's storage, and the simulator's own event log (a Vec that grows until it
        // holds twice its bound, then drops its oldest half in place), which runs on this thread at each doorbell.
        let sim = ctx_of(ctx).expect("open context").dev.dev.sim_device().expect("mlx5_0 is simulated");
        let mut warm = 0;
        while sim.events_dropped() == 0 {
            iteration(&mut wrs);
            warm += 1;
            assert!(warm < 100_000, "the simulator's event log never reached its bound");
        }
        iteration(&mut wrs);
        let n0 = alloc_count::count();
        {
            let _armed = alloc_count::arm();
            for _ in 0..4 {
                iteration(&mut wrs);
            }
        }
        assert_eq!(alloc_count::count() - n0, 0, "heap allocations in the C datapath calls");
        l.close();
    }
}

#[test]
fn modify_cq_passes_moderation_to_the_device() {
    let ctx = open();
    let v = vctx(ctx);
    let modify = v.modify_cq.expect("verbs_context.modify_cq");
    // SAFETY: every pointer is made by this library from this context and destroyed once.
    unsafe {
        let mut dattr: ibv_device_attr_ex = std::mem::zeroed();
        let size = std::mem::size_of::<ibv_device_attr_ex>();
        assert_eq!(v.query_device_ex.unwrap()(ctx, ptr::null(), &mut dattr, size), 0);
        assert_eq!((dattr.cq_mod_caps.max_cq_count, dattr.cq_mod_caps.max_cq_period), (65535, 4095));
        let cq = ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0);
        assert!(!cq.is_null());
        let mut attr = ibv_modify_cq_attr {
            attr_mask: IBV_CQ_ATTR_MODERATE,
            moderate: ibv_moderate_cq { cq_count: 8, cq_period: 100 },
        };
        assert_eq!(modify(cq, &mut attr), 0);
        let sim = dev_of((*ctx).device).and_then(|d| d.dev.sim_device()).expect("a simulated device");
        let info = sim.cq_info((*cq).handle).unwrap();
        assert_eq!((info.cq_max_count, info.cq_period), (8, 100));
        // A period past the 12-bit field, an unknown attribute, no attributes.
        attr.moderate.cq_period = 4096;
        assert_eq!(modify(cq, &mut attr), libc::EINVAL);
        attr.attr_mask = 2;
        assert_eq!(modify(cq, &mut attr), libc::EINVAL);
        assert_eq!(modify(cq, ptr::null_mut()), libc::EINVAL);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}

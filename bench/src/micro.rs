//! The core's datapath and command encoding against plain memory, each beside the raw memory traffic it cannot do
//! without (the baseline): QPs and CQs are created on the simulator, then driven through [`MemMmio`], so the
//! simulator does not run while anything is timed.

use std::hint::black_box;
use std::time::Instant;

use mlx5_core::cmd::Pas;
use mlx5_core::cmdq::{CmdQueue, Command};
use mlx5_core::cq::{Cq, CqContext, CqeFields, CqeSize, CreateCq, Notify, WorkCompletion, WrTable, CQE64_SIZE};
use mlx5_core::hal::Mmio;
use mlx5_core::prm::{c, consts};
use mlx5_core::qp::{Qp, RecvWr, SendFlags, SendOp, SendWr, Sge};
use mlx5_sim::testkit::mocks::MemMmio;
use mlx5_sim::testkit::HeapDma;

use crate::alloc_count;
use crate::stats::{measure, since, Plan, Stat};

/// One 64-byte store's worth (a send WQE basic block, a CQE).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u64; 8]);

/// One 16-byte receive WQE (a data segment).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Seg16([u64; 2]);

pub fn sends(sge: &[Sge], batch: usize, all_signaled: bool) -> Vec<SendWr<'_>> {
    (0..batch)
        .map(|i| SendWr {
            wr_id: i as u64,
            op: SendOp::Send,
            sg_list: sge,
            // Selective signaling, as throughput code posts: the last WR of each batch asks for a completion.
            flags: if all_signaled || i + 1 == batch { SendFlags::SIGNALED } else { SendFlags::default() },
            inline: None,
            ud: None,
        })
        .collect()
}

/// `Qp::post_send` of `window` one-SGE SENDs in calls of `batch` (one doorbell each), into DMA memory and a
/// BlueFlame register in plain memory. The ring is emptied between windows (untimed).
pub fn post_send(qp: &mut Qp, bar: &MemMmio, sge: &[Sge], batch: usize, window: usize, plan: Plan) -> Stat {
    assert_eq!(window % batch, 0);
    let wrs = sends(sge, batch, false);
    let qpn = qp.qpn();
    measure(plan, || {
        let calls = window / batch;
        let armed = alloc_count::arm();
        let t = Instant::now();
        for _ in 0..calls {
            qp.post_send(bar, black_box(&wrs[..])).expect("post_send");
        }
        let ns = since(t);
        drop(armed);
        // One completion of the last WQE retires every WQE before it.
        let last = qp.sq_cur_post().wrapping_sub(1) as u16;
        qp.send_done(qpn, last).expect("retire the window");
        (ns, window as u64)
    })
}

/// The baseline of [`post_send`]: a 64-byte store per WQE into a ring of the same size, one 4-byte store per batch.
pub fn post_send_baseline(batch: usize, window: usize, plan: Plan) -> Stat {
    assert_eq!(window % batch, 0);
    let mut ring = vec![Line([0; 8]); window];
    let mut bell = Box::new(Line([0; 8]));
    measure(plan, || {
        let p = black_box(ring.as_mut_ptr());
        let db = black_box(bell.0.as_mut_ptr().cast::<u32>());
        let t = Instant::now();
        let mut i = 0;
        while i < window {
            for _ in 0..batch {
                // SAFETY: i < window == ring.len() (window is a multiple of batch).
                unsafe { p.add(i).write(Line([i as u64, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77])) };
                i += 1;
            }
            // SAFETY: `db` points at the first word of a live, aligned 64-byte box.
            unsafe { db.write_volatile(i as u32) };
        }
        (since(t), window as u64)
    })
}

/// `Qp::post_recv` of `window` one-SGE receives in calls of `batch`. The ring is emptied between windows.
pub fn post_recv(qp: &mut Qp, bar: &MemMmio, sge: &[Sge], batch: usize, window: usize, plan: Plan) -> Stat {
    assert_eq!(window % batch, 0);
    let wrs: Vec<RecvWr> = (0..batch).map(|i| RecvWr { wr_id: i as u64, sg_list: sge }).collect();
    let qpn = qp.qpn();
    measure(plan, || {
        let calls = window / batch;
        let armed = alloc_count::arm();
        let t = Instant::now();
        for _ in 0..calls {
            qp.post_recv(bar, black_box(&wrs[..])).expect("post_recv");
        }
        let ns = since(t);
        drop(armed);
        for _ in 0..window {
            qp.recv_done(qpn, 0, 0).expect("retire the window");
        }
        (ns, window as u64)
    })
}

/// The baseline of [`post_recv`]: a 16-byte store per WQE into a ring of the same size, one 4-byte store per batch.
pub fn post_recv_baseline(batch: usize, window: usize, plan: Plan) -> Stat {
    assert_eq!(window % batch, 0);
    let mut ring = vec![Seg16([0; 2]); window];
    let mut rec = Box::new(Line([0; 8]));
    measure(plan, || {
        let p = black_box(ring.as_mut_ptr());
        let db = black_box(rec.0.as_mut_ptr().cast::<u32>());
        let t = Instant::now();
        let mut i = 0;
        while i < window {
            for _ in 0..batch {
                // SAFETY: i < window == ring.len().
                unsafe { p.add(i).write(Seg16([i as u64, 0x1234])) };
                i += 1;
            }
            // SAFETY: `db` points at the first word of a live, aligned 64-byte box.
            unsafe { db.write_volatile(i as u32) };
        }
        (since(t), window as u64)
    })
}

/// Writes a whole ring of ready CQEs from the consumer index on, alternating a requester CQE for send WQE
/// `send_first + k` and a responder CQE, each with the owner bit of its pass (as the device writes them).
fn fill_cqes(cq: &Cq, qpn: u32, send_first: u32) {
    let n = cq.nent();
    let log = cq.log_nent();
    for k in 0..n {
        let idx = cq.cons_index().wrapping_add(k);
        let owner = ((idx >> log) & 1) as u8;
        let f = if k % 2 == 0 {
            CqeFields {
                opcode: consts::MLX5_CQE_REQ,
                owner,
                wqe_opcode: consts::MLX5_OPCODE_SEND,
                qpn,
                wqe_counter: send_first.wrapping_add(k / 2) as u16,
                byte_cnt: 64,
                ..CqeFields::default()
            }
        } else {
            CqeFields {
                opcode: consts::MLX5_CQE_RESP_SEND,
                owner,
                qpn,
                wqe_counter: (k / 2) as u16,
                byte_cnt: 64,
                flags_rqpn: qpn,
                ..CqeFields::default()
            }
        };
        let img = f.emit().0;
        let dst = cq.buf().ptr((idx & (n - 1)) as usize * CQE64_SIZE, CQE64_SIZE);
        // SAFETY: 64 bytes inside a live fragment of the ring (QueueBuf::ptr checked); we play the device, and the
        // driver does not own these entries until the owner byte says so.
        unsafe { std::ptr::copy_nonoverlapping(img.as_ptr(), dst, CQE64_SIZE) };
    }
}

/// Posts the work requests a full ring of completions names (half sends, all signaled, in calls of 64; half
/// receives), then writes the ring's CQEs (untimed setup of a `poll_cq` window).
pub fn ready_ring(cq: &mut Cq, qp: &mut Qp, bar: &MemMmio, sge: &[Sge]) {
    let half = cq.nent() as usize / 2;
    let sends = sends(sge, 64.min(half), true);
    let recvs: Vec<RecvWr> = (0..half).map(|i| RecvWr { wr_id: i as u64, sg_list: sge }).collect();
    ready_ring_with(cq, qp, bar, &sends, &recvs);
}

pub fn ready_ring_with(cq: &mut Cq, qp: &mut Qp, bar: &MemMmio, sends: &[SendWr<'_>], recvs: &[RecvWr<'_>]) {
    let half = cq.nent() as usize / 2;
    let first = qp.sq_cur_post();
    for _ in 0..half / sends.len() {
        qp.post_send(bar, sends).expect("post_send");
    }
    qp.post_recv(bar, recvs).expect("post_recv");
    fill_cqes(cq, qp.qpn(), first);
}

/// `Cq::poll` of a CQ full of ready CQEs (half send, half receive completions, routed through the QP's
/// `WrTable`), `batch` work completions per call, and its baseline: 64-byte volatile loads over the same ring.
pub fn poll_cq(cq: &mut Cq, qp: &mut Qp, bar: &MemMmio, sge: &[Sge], batch: usize, plan: Plan) -> (Stat, Stat) {
    let n = cq.nent() as usize;
    let half = n / 2;
    let sends = sends(sge, 64.min(half), true);
    let recvs: Vec<RecvWr> = (0..half).map(|i| RecvWr { wr_id: i as u64, sg_list: sge }).collect();
    let qpn = qp.qpn();
    let mut wc = vec![WorkCompletion::default(); batch];
    let core = measure(plan, || {
        // Untimed: the WRs the completions name, then the CQEs.
        ready_ring_with(cq, qp, bar, &sends, &recvs);
        let armed = alloc_count::arm();
        let t = Instant::now();
        let mut got = 0;
        while got < n {
            let k = cq.poll(bar, &mut *qp, black_box(&mut wc[..])).expect("poll");
            if k == 0 {
                break;
            }
            got += k;
        }
        let ns = since(t);
        drop(armed);
        black_box(&wc);
        assert_eq!((got, qp.sq_outstanding(), qp.rq_outstanding()), (n, 0, 0), "every CQE polled");
        (ns, n as u64)
    });
    let ring = cq.buf().frag(0).expect("one fragment");
    assert!(cq.buf().nfrags() == 1 && ring.len() >= n * CQE64_SIZE);
    let base = measure(plan, || {
        fill_cqes(cq, qpn, 0);
        let p = black_box(ring.cpu().as_ptr().cast::<u64>().cast_const());
        let t = Instant::now();
        let mut acc = 0u64;
        for i in 0..n * CQE64_SIZE / 8 {
            // SAFETY: inside the ring's single fragment (checked above), 8-byte aligned (4 KiB-aligned fragment).
            acc ^= unsafe { p.add(i).read_volatile() };
        }
        black_box(acc);
        (since(t), n as u64)
    });
    // The arm doorbell is datapath too (counted by the allocation check, not timed).
    {
        let _armed = alloc_count::arm();
        cq.arm(bar, 0, Notify::NextComp);
    }
    (core, base)
}

/// CREATE_CQ with 1,024 page addresses: `CmdQueue::post` into slot 0 (entry, a chain of mailboxes linked and
/// filled in place, the entry signature, the doorbell) over plain-memory registers, the entry handed back between
/// posts as firmware would; and the same command encoded into one flat zeroed buffer.
pub fn encode_create_cq(plan: Plan) -> (Stat, Stat) {
    let bar = MemMmio::new(4096);
    // An initialization segment the queue accepts: interface revision 5, 32 slots of 64 bytes.
    bar.write32(c::mlx5_init_seg::CMDIF_REV_FW_SUB.off, 5 << 16);
    bar.write32(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, (5 << 4) | 6);
    let dma = HeapDma::identity();
    let mut q = CmdQueue::new(&bar, &dma, ()).expect("command queue");
    let pas: Vec<u64> = (0..1024u64).map(|i| 0x1_0000_0000 + i * 4096).collect();
    let cmd = CreateCq {
        ctx: CqContext {
            cqe_sz: CqeSize::B64,
            log_cq_size: 16,
            uar_page: 1,
            c_eqn: 3,
            log_page_size: 0,
            page_offset: 0,
            dbr_addr: 0x1234_5000,
            oi: false,
        },
        pas: Pas::List(&pas),
    };
    let status_own = q.iova() as usize as *mut u8;
    let post = measure(plan, || {
        let t = Instant::now();
        q.post(0, black_box(&cmd)).expect("post");
        let ns = since(t);
        // SAFETY: slot 0's entry is the first 64 bytes of the live queue page (`HeapDma::identity`: bus address = CPU
        // address); we play firmware handing it back, so the next post finds the slot free.
        unsafe { status_own.add(c::mlx5_cmd_layout::STATUS_OWN.off).write_volatile(0) };
        (ns, 1)
    });
    let mut buf = vec![0u8; cmd.inlen()];
    let flat = measure(plan, || {
        buf.fill(0);
        let t = Instant::now();
        black_box(&cmd).encode(&mut buf[..]);
        let ns = since(t);
        black_box(&buf);
        (ns, 1)
    });
    (post, flat)
}

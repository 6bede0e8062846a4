//! SRQ ping-pong in the manner of rdma-core's `ibv_srq_pingpong`: each side has `--num-qp` RC QPs that all
//! receive through one shared receive queue. Every iteration each QP of side A sends a message whose bytes name
//! the iteration and the QP; side B finds the QP a receive arrived on from its completion (`qp_num`), checks the
//! bytes, and echoes them back on the same QP; A checks the echo the same way. Consumed SRQ entries are posted
//! again, so the SRQ holds `--rx-depth` receives (fewer than the QPs times the iterations) for the whole run. By
//! default the two sides are two simulated ConnectX-5s joined by a simulated wire; `--device BDF` runs both on one
//! ConnectX through VFIO (loopback).
//!
//! `cargo run -p mlx5-verbs --example srq_pingpong -- [--device BDF] [--num-qp N] [--size N] [--iters N]
//! [--rx-depth N]`

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mlx5_verbs::{
    wr, Access, CompletionQueue, Context, MemoryRegion, QpCap, QpInitAttr, QpType, QueuePair, Rts, SharedReceiveQueue,
    SrqInitAttr, VerbsError, WcOpcode, WcStatus, WorkCompletion,
};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| default.into())
}

fn num(name: &str, default: &str) -> Result<usize, VerbsError> {
    arg(name, default).parse().map_err(|_| VerbsError::Invalid(format!("{name}: not a number")))
}

/// The bytes QP `qp` sends in iteration `iter`: every message differs from every other of the run.
fn message(iter: usize, qp: usize, size: usize) -> Vec<u8> {
    (0..size).map(|k| (iter.wrapping_mul(31) ^ qp.wrapping_mul(7) ^ k) as u8).collect()
}

/// Send `wr_id`s are `SEND_ID + qp`; receive `wr_id`s are SRQ slot numbers.
const SEND_ID: u64 = 1 << 32;

/// One side: its QPs (by QPN, in creation order), the SRQ they share, the CQ of both, the buffer (one send area
/// per QP, then the SRQ's receive slots).
struct Side<'a> {
    name: &'static str,
    cq: &'a CompletionQueue<'a>,
    srq: &'a SharedReceiveQueue<'a>,
    mr: &'a MemoryRegion<'a>,
    qps: Vec<QueuePair<'a, Rts>>,
    index: HashMap<u32, usize>,
    size: usize,
}

impl<'a> Side<'a> {
    fn new(
        name: &'static str,
        cq: &'a CompletionQueue<'a>,
        srq: &'a SharedReceiveQueue<'a>,
        mr: &'a MemoryRegion<'a>,
        qps: Vec<QueuePair<'a, Rts>>,
        size: usize,
    ) -> Self {
        let index = qps.iter().enumerate().map(|(i, q)| (q.qpn(), i)).collect();
        Side { name, cq, srq, mr, qps, index, size }
    }

    fn slot_off(&self, slot: u64) -> usize {
        (self.qps.len() + slot as usize) * self.size
    }

    fn post_slot(&self, slot: u64) -> Result<(), VerbsError> {
        self.srq.post_recv(&[wr::recv(slot, &[self.mr.sge(self.slot_off(slot), self.size as u32)])])
    }

    /// Sends `msg` on QP `qp` from that QP's send area.
    fn send(&self, qp: usize, msg: &[u8]) -> Result<(), VerbsError> {
        self.mr.write(qp * self.size, msg)?;
        self.qps[qp].post_send(&[wr::send(SEND_ID + qp as u64, &[self.mr.sge(qp * self.size, self.size as u32)])])
    }

    /// Waits for `want` receives (send completions met meanwhile are checked and counted) and returns, for each,
    /// the QP index it arrived on and its bytes; each slot is posted again once read.
    fn receive(&self, want: usize, sends: &mut usize) -> Result<Vec<(usize, Vec<u8>)>, VerbsError> {
        let mut got = Vec::with_capacity(want);
        let mut wc = [WorkCompletion::default(); 16];
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < want {
            let n = self.cq.poll(&mut wc)?;
            for w in &wc[..n] {
                if w.status != WcStatus::Success {
                    return Err(VerbsError::Invalid(format!(
                        "{}: wr_id {:#x} completed with {:?} (vendor error {:#x})",
                        self.name, w.wr_id, w.status, w.vendor_err
                    )));
                }
                match w.opcode {
                    WcOpcode::Recv => {
                        let qp = *self.index.get(&w.qp_num).ok_or_else(|| {
                            VerbsError::Invalid(format!("{}: receive on unknown QP {:#x}", self.name, w.qp_num))
                        })?;
                        if w.byte_len as usize != self.size {
                            return Err(VerbsError::Invalid(format!("{}: {} bytes received", self.name, w.byte_len)));
                        }
                        got.push((qp, self.mr.read_vec(self.slot_off(w.wr_id), self.size)));
                        self.post_slot(w.wr_id)?;
                    }
                    _ => *sends += 1,
                }
            }
            if n == 0 && Instant::now() > deadline {
                return Err(VerbsError::Invalid(format!("{}: {} of {want} receives in 10 s", self.name, got.len())));
            }
        }
        Ok(got)
    }
}

fn main() -> Result<(), VerbsError> {
    let num_qp = num("--num-qp", "4")?.max(1);
    let size = num("--size", "4096")?.max(1);
    let iters = num("--iters", "100")?;
    // Enough for one round of every QP (ibv_srq_pingpong defaults to 500 for 16 QPs).
    let rx_depth = num("--rx-depth", &(2 * num_qp).to_string())?.max(num_qp);
    let device = arg("--device", "sim");
    let (ctx_a, ctx_b_owned);
    let ctx_b: &Context;
    if device == "sim" {
        let (a, b) = Context::open_sim_pair()?;
        ctx_a = a;
        ctx_b_owned = Some(b);
        ctx_b = ctx_b_owned.as_ref().unwrap();
    } else {
        ctx_a = Context::open(&device)?;
        ctx_b_owned = None;
        let _ = &ctx_b_owned;
        ctx_b = &ctx_a;
    }
    let cqe = (rx_depth + num_qp) as u32;
    let cap = QpCap { max_send_wr: 2, max_send_sge: 1, ..QpCap::default() };
    let srq_attr = SrqInitAttr { max_wr: rx_depth as u32, max_sge: 1, srq_limit: 0 };
    let len = (num_qp + rx_depth) * size;

    let (pd_a, pd_b) = (ctx_a.alloc_pd()?, ctx_b.alloc_pd()?);
    let (cq_a, cq_b) = (ctx_a.create_cq(cqe)?, ctx_b.create_cq(cqe)?);
    let (srq_a, srq_b) = (pd_a.create_srq(srq_attr)?, pd_b.create_srq(srq_attr)?);
    let (mut buf_a, mut buf_b) = (ctx_a.alloc_buffer(len)?, ctx_b.alloc_buffer(len)?);
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE)?;
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE)?;
    let mut reset_a = Vec::new();
    let mut reset_b = Vec::new();
    for _ in 0..num_qp {
        reset_a.push(
            pd_a.create_qp_with(QpInitAttr { srq: Some(&srq_a), ..QpInitAttr::new(QpType::Rc, &cq_a, &cq_a, cap) })?,
        );
        reset_b.push(
            pd_b.create_qp_with(QpInitAttr { srq: Some(&srq_b), ..QpInitAttr::new(QpType::Rc, &cq_b, &cq_b, cap) })?,
        );
    }
    // What ibv_srq_pingpong exchanges per QP: QPN, PSN, LID, GID; QP i of A talks to QP i of B.
    let remote_a = reset_a.iter().map(|q| ctx_a.remote_qp(q)).collect::<Result<Vec<_>, _>>()?;
    let remote_b = reset_b.iter().map(|q| ctx_b.remote_qp(q)).collect::<Result<Vec<_>, _>>()?;
    let qps_a = reset_a.into_iter().zip(&remote_b).map(|(q, r)| q.connect_rc(*r, Access::default()));
    let qps_a = qps_a.collect::<Result<Vec<_>, _>>()?;
    let qps_b = reset_b.into_iter().zip(&remote_a).map(|(q, r)| q.connect_rc(*r, Access::default()));
    let qps_b = qps_b.collect::<Result<Vec<_>, _>>()?;
    let a = Side::new("A", &cq_a, &srq_a, &mr_a, qps_a, size);
    let b = Side::new("B", &cq_b, &srq_b, &mr_b, qps_b, size);
    for slot in 0..rx_depth as u64 {
        a.post_slot(slot)?;
        b.post_slot(slot)?;
    }

    let (mut sends_a, mut sends_b) = (0, 0);
    let start = Instant::now();
    for iter in 0..iters {
        for qp in 0..num_qp {
            a.send(qp, &message(iter, qp, size))?;
        }
        // B: each message must carry the bytes of the QP it came in on; echo it on that QP.
        for (qp, bytes) in b.receive(num_qp, &mut sends_b)? {
            if bytes != message(iter, qp, size) {
                return Err(VerbsError::Invalid(format!("iteration {iter}: B got wrong bytes on QP {qp}")));
            }
            b.send(qp, &bytes)?;
        }
        for (qp, bytes) in a.receive(num_qp, &mut sends_a)? {
            if bytes != message(iter, qp, size) {
                return Err(VerbsError::Invalid(format!("iteration {iter}: A got a wrong echo on QP {qp}")));
            }
        }
    }
    // The last round's send completions may still be on their way.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wc = [WorkCompletion::default(); 16];
    while (sends_a < iters * num_qp || sends_b < iters * num_qp) && Instant::now() < deadline {
        for (cq, sends) in [(&cq_a, &mut sends_a), (&cq_b, &mut sends_b)] {
            let n = cq.poll(&mut wc)?;
            if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success || w.opcode != WcOpcode::Send) {
                return Err(VerbsError::Invalid(format!("unexpected completion {w:?}")));
            }
            *sends += n;
        }
    }
    if sends_a != iters * num_qp || sends_b != iters * num_qp {
        return Err(VerbsError::Invalid(format!("send completions: A {sends_a}, B {sends_b} of {}", iters * num_qp)));
    }
    let secs = start.elapsed().as_secs_f64();
    let bytes = 2 * iters * num_qp * size;
    println!(
        "{num_qp} QPs on one SRQ per side (rx depth {rx_depth}): {} messages of {size} bytes in {secs:.3} s \
         ({:.1} MB/s), every byte verified",
        2 * iters * num_qp,
        bytes as f64 / secs.max(1e-9) / 1e6
    );
    Ok(())
}

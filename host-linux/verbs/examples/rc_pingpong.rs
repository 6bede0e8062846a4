//! RC ping-pong in the manner of rdma-core's `ibv_rc_pingpong`: two QPs exchange SENDs of `--size` bytes
//! `--iters` times, every byte checked. By default the two sides are two simulated ConnectX-5s joined by a
//! simulated wire; `--device BDF` runs both QPs on one real ConnectX through VFIO (loopback).
//!
//! `cargo run -p mlx5-verbs --example rc_pingpong -- [--device BDF] [--size N] [--iters N]`

use std::time::{Duration, Instant};

use mlx5_args::{Opts, Takes};
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, VerbsError, WcStatus, WorkCompletion};

const USAGE: &str = "usage: rc_pingpong [--device BDF|sim] [--size BYTES] [--iters N]";

fn main() -> std::process::ExitCode {
    let o = Opts::from_env_or_exit(
        "rc_pingpong",
        USAGE,
        &[
            ("--device", Takes::Text("a PCI address, or sim")),
            ("--size", Takes::Number(1, 1 << 30)),
            ("--iters", Takes::Number(1, 1 << 31)),
        ],
    );
    match run(o.text("--device").unwrap_or("sim"), o.number("--size", 4096) as usize, o.number("--iters", 1000) as u32)
    {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rc_pingpong: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(device: &str, size: usize, iters: u32) -> Result<(), VerbsError> {
    let (ctx_a, ctx_b_owned);
    let ctx_b: &Context;
    if device == "sim" {
        let (a, b) = Context::open_sim_pair()?;
        ctx_a = a;
        ctx_b_owned = Some(b);
        ctx_b = ctx_b_owned.as_ref().unwrap();
    } else {
        ctx_a = Context::open(device)?;
        ctx_b_owned = None;
        let _ = &ctx_b_owned;
        ctx_b = &ctx_a;
    }
    let cap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

    let (pd_a, pd_b) = (ctx_a.alloc_pd()?, ctx_b.alloc_pd()?);
    let (cq_a, cq_b) = (ctx_a.create_cq(32)?, ctx_b.create_cq(32)?);
    let (mut buf_a, mut buf_b) = (ctx_a.alloc_buffer(2 * size)?, ctx_b.alloc_buffer(2 * size)?);
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE)?;
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE)?;
    let qa = pd_a.create_qp(QpType::Rc, &cq_a, &cq_a, cap)?;
    let qb = pd_b.create_qp(QpType::Rc, &cq_b, &cq_b, cap)?;
    // What rc_pingpong exchanges over TCP: QPN, PSN, LID, GID.
    let (ra, rb) = (ctx_a.remote_qp(&qa)?, ctx_b.remote_qp(&qb)?);
    let qa = qa.connect_rc(rb, Access::default())?;
    let qb = qb.connect_rc(ra, Access::default())?;

    // Receive into the second half of each buffer, send from the first.
    let mut wc = [WorkCompletion::default(); 4];
    qb.post_recv(&[wr::recv(1, &[mr_b.sge(size, size as u32)])])?;
    let start = Instant::now();
    for i in 0..iters {
        let ping: Vec<u8> = (0..size).map(|k| (k as u32 ^ i) as u8).collect();
        mr_a.write(0, &ping)?;
        qa.post_recv(&[wr::recv(1, &[mr_a.sge(size, size as u32)])])?;
        qa.post_send(&[wr::send(2, &[mr_a.sge(0, size as u32)])])?;
        // B receives the ping, sends it back, A receives the pong.
        let n = cq_b.poll_until(&mut wc, 1, Duration::from_secs(10))?;
        check(&wc[..n], 1)?;
        if mr_b.read_vec(size, size) != ping {
            return Err(VerbsError::Invalid(format!("iteration {i}: ping corrupted")));
        }
        mr_b.write(0, &ping)?;
        qb.post_recv(&[wr::recv(1, &[mr_b.sge(size, size as u32)])])?;
        qb.post_send(&[wr::send(2, &[mr_b.sge(0, size as u32)])])?;
        let n = cq_b.poll_until(&mut wc, 1, Duration::from_secs(10))?;
        check(&wc[..n], 1)?;
        let n = cq_a.poll_until(&mut wc, 2, Duration::from_secs(10))?;
        check(&wc[..n], 2)?;
        if mr_a.read_vec(size, size) != ping {
            return Err(VerbsError::Invalid(format!("iteration {i}: pong corrupted")));
        }
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / f64::from(iters) / 2.0;
    println!("{size} bytes x {iters} round trips on {device}: {us:.2} us one-way, every byte verified");
    Ok(())
}

fn check(wc: &[WorkCompletion], want: usize) -> Result<(), VerbsError> {
    if wc.len() != want || wc.iter().any(|w| w.status != WcStatus::Success) {
        return Err(VerbsError::Invalid(format!("expected {want} good completions, got {wc:?}")));
    }
    Ok(())
}

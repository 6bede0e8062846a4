//! Event-driven completions, as `ibv_rc_pingpong -e` does: arm the CQ, sleep on the completion channel until an
//! event names it, acknowledge it, poll, re-arm. On VFIO the wait sleeps on the EQ's MSI-X vector.
//!
//! `cargo run -p mlx5-verbs --example event_driven -- [--device BDF] [--iters N]`

use std::time::Duration;

use mlx5_args::{Opts, Takes};
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, VerbsError, WcStatus, WorkCompletion};

const USAGE: &str = "usage: event_driven [--device BDF|sim] [--iters N]";

fn main() -> std::process::ExitCode {
    let o = Opts::from_env_or_exit(
        "event_driven",
        USAGE,
        &[("--device", Takes::Text("a PCI address, or sim")), ("--iters", Takes::Number(1, 1 << 31))],
    );
    match run(o.text("--device").unwrap_or("sim"), o.number("--iters", 100) as u32) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("event_driven: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(device: &str, iters: u32) -> Result<(), VerbsError> {
    let ctx = Context::open(device)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(16)?;
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let mut buf = ctx.alloc_buffer(4096)?;
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap)?;
    let me = ctx.remote_qp(&qp)?;
    let qp = qp.connect_rc(me, Access::default())?;

    let mut wc = [WorkCompletion::default(); 4];
    let (mut events, mut completions) = (0u32, 0u32);
    cq.req_notify(false)?;
    for i in 0..iters {
        qp.post_recv(&[wr::recv(u64::from(i), &[mr.sge(0, 64)])])?;
        let msg = format!("message {i}");
        qp.post_send(&[wr::send_inline(u64::from(i), msg.as_bytes())])?;
        // Sleep until the CQ's event; then drain it completely before re-arming (arming with completions still
        // queued raises an event at once, which is what keeps a waiter from missing one).
        while completions < 2 * (i + 1) {
            let cqn =
                ctx.get_cq_event(Duration::from_secs(10))?.ok_or(VerbsError::Invalid("no event in 10 s".into()))?;
            if cqn != cq.cqn() {
                return Err(VerbsError::Invalid(format!("event for CQ {cqn:#x}")));
            }
            events += 1;
            cq.ack_events(1)?;
            cq.req_notify(false)?;
            loop {
                let n = cq.poll(&mut wc)?;
                if n == 0 {
                    break;
                }
                if let Some(w) = wc[..n].iter().find(|w| w.status != WcStatus::Success) {
                    return Err(VerbsError::Invalid(format!("completion failed: {w:?}")));
                }
                completions += n as u32;
            }
        }
        if mr.read_vec(0, msg.len()) != msg.as_bytes() {
            return Err(VerbsError::Invalid(format!("message {i} corrupted")));
        }
    }
    println!("{iters} messages, {completions} completions, {events} completion events, every message verified");
    Ok(())
}

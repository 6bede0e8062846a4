//! Async events, as an application's event thread handles them (`ibv_get_async_event` / `ibv_ack_async_event`):
//! a CQ too small for its traffic overruns on the simulator, the device reports CQ_ERR naming it, and the
//! application moves the CQ's QP to the error state, takes back every work request (the completions that fit, then
//! the flushed rest) and carries on with a larger CQ.
//!
//! The event thread waits with `poll(2)` on the context's event descriptor, as programs wait on `async_fd`.
//!
//! `cargo run -p mlx5-verbs --example async_events`

use std::time::Duration;

use mlx5_args::Opts;
use mlx5_verbs::{wr, Access, AsyncEvent, Context, QpCap, QpType, VerbsError, WcStatus, WorkCompletion};

const USAGE: &str = "usage: async_events";

fn main() -> std::process::ExitCode {
    // No options: anything given is refused with the usage.
    Opts::from_env_or_exit("async_events", USAGE, &[]);
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("async_events: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), VerbsError> {
    let ctx = Context::open_sim()?;
    let pd = ctx.alloc_pd()?;
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let mut buf = ctx.alloc_buffer(4096)?;
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;

    // Two CQEs of room for eight completions.
    let small = ctx.create_cq(1)?;
    let qp = pd.create_qp(QpType::Rc, &small, &small, cap)?;
    let me = ctx.remote_qp(&qp)?;
    let qp = qp.connect_rc(me, Access::default())?;

    let event = std::thread::scope(|s| {
        // The event thread: sleeps on the descriptor until an event is queued, then takes it.
        let waiter = s.spawn(|| -> Result<AsyncEvent, VerbsError> {
            let fd = ctx.async_fd().ok_or(VerbsError::Invalid("no event descriptor".into()))?;
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            let ready = unsafe { libc::poll(&mut p, 1, 10_000) };
            if ready != 1 {
                return Err(VerbsError::Invalid("no async event in 10 s".into()));
            }
            ctx.get_async_event(Duration::ZERO).ok_or(VerbsError::Invalid("readable but empty".into()))
        });
        for i in 0..4u64 {
            qp.post_recv(&[wr::recv(i, &[mr.sge(64 * i as usize, 64)])])?;
            qp.post_send(&[wr::send_inline(100 + i, format!("msg {i}").as_bytes())])?;
        }
        waiter.join().expect("event thread")
    })?;
    println!("async event: {event:?}");
    let AsyncEvent::CqError { cqn, .. } = event else {
        return Err(VerbsError::Invalid(format!("expected a CQ error, got {event:?}")));
    };
    if cqn != small.cqn() {
        return Err(VerbsError::Invalid(format!("CQ error for {cqn:#x}, not {:#x}", small.cqn())));
    }
    ctx.ack_async_event(&event)?;

    // The device writes nothing more to the CQ: stop its QP, and every work request comes back exactly once.
    let qp = qp.to_error().map_err(|e| e.error)?;
    let mut wc = [WorkCompletion::default(); 8];
    let (mut ok, mut flushed) = (0, 0);
    loop {
        let n = small.poll(&mut wc)?;
        if n == 0 {
            break;
        }
        for w in &wc[..n] {
            match w.status {
                WcStatus::Success => ok += 1,
                WcStatus::WrFlushErr => flushed += 1,
                s => return Err(VerbsError::Invalid(format!("wr {}: {s:?}", w.wr_id))),
            }
        }
    }
    println!("CQ {cqn:#x} overran: {ok} completions fit, {flushed} flushed");
    if ok + flushed != 8 {
        return Err(VerbsError::Invalid(format!("{} of 8 work requests came back", ok + flushed)));
    }
    drop(qp);
    drop(small);

    // Carry on with a CQ sized for the traffic.
    let cq = ctx.create_cq(64)?;
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap)?;
    let me = ctx.remote_qp(&qp)?;
    let qp = qp.connect_rc(me, Access::default())?;
    qp.post_recv(&[wr::recv(1, &[mr.sge(0, 64)])])?;
    qp.post_send(&[wr::send_inline(2, b"again")])?;
    let n = cq.poll_until(&mut wc, 2, Duration::from_secs(5))?;
    println!("after recovery: {n} completions, received {:?}", String::from_utf8_lossy(&mr.read_vec(0, 5)));
    Ok(())
}

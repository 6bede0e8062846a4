//! The subnet management agent of a port this stack drives: QP0 served by `SmiAgent` (SMPs through MAD_IFC to the
//! firmware's SMA, the responses back on QP0) for `--seconds`, printing the port's LID and state each time a
//! subnet manager changes them, then what the agent did. With a simulated port that waits for an SM and is wired
//! to another process's port, an SM there (opensm in a UML guest: `cargo xtask linux-drives-sim --opensm`) sweeps
//! this port to ACTIVE:
//!
//! `MLX5_RS_DEVICES=sim:link=ib:sm=wait:wire=connect:127.0.0.1:PORT cargo run -p mlx5-verbs --example sma`

use std::time::{Duration, Instant};

use mlx5_args::{Opts, Takes};
use mlx5_verbs::{Access, Context, SmiAgent, VerbsError};

const USAGE: &str = "usage: sma [--device NAME] [--seconds N]";

fn main() -> std::process::ExitCode {
    let o = Opts::from_env_or_exit(
        "sma",
        USAGE,
        &[("--device", Takes::Text("a device name (mlx5_0) or PCI address")), ("--seconds", Takes::Number(1, 86_400))],
    );
    let run_for = Duration::from_secs(o.number("--seconds", 60));
    match run(o.text("--device").unwrap_or("mlx5_0"), run_for) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sma: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The port state's name, as `ibstat` prints it.
fn state_name(s: u8) -> &'static str {
    match s {
        1 => "Down",
        2 => "Initializing",
        3 => "Armed",
        4 => "Active",
        _ => "?",
    }
}

fn run(device: &str, run_for: Duration) -> Result<(), VerbsError> {
    let ctx = Context::open(device)?;
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(64)?;
    let mut buf = ctx.alloc_buffer(SmiAgent::BUF_LEN)?;
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;
    let mut agent = SmiAgent::new(&pd, &cq, &mr)?;
    println!("sma: {device} node_guid={:016x} serving QP0 (qpn {:#x})", ctx.node_guid()?, agent.qpn());
    let end = Instant::now() + run_for;
    let mut last = None;
    while Instant::now() < end {
        let p = ctx.query_port()?;
        if last != Some((p.lid, p.sm_lid, p.state)) {
            println!(
                "sma: port 1: lid={:#x} sm_lid={:#x} state={} ({})",
                p.lid,
                p.sm_lid,
                p.state,
                state_name(p.state)
            );
            last = Some((p.lid, p.sm_lid, p.state));
        }
        agent.serve(Duration::from_millis(100))?;
    }
    let s = agent.stats();
    println!(
        "sma: done: {} answered, {} without reply, {} dropped, {} MAD_IFC failures, {} receive errors, {} send errors",
        s.answered, s.no_reply, s.dropped, s.mad_ifc_failed, s.recv_errors, s.send_errors
    );
    Ok(())
}

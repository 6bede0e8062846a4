//! UD ping-pong in the manner of `ibv_ud_pingpong`: datagrams through address handles, each receive carrying the
//! 40-byte GRH in front of the payload (RoCE). Two simulated ConnectX-5s on a simulated wire by default. A knows
//! B's address; B answers through an address handle built from A's first datagram (`ibv_create_ah_from_wc`: the
//! completion and the GRH in front of the data), as a UD server replies to clients it has not been told of.
//!
//! `cargo run -p mlx5-verbs --example ud_pingpong -- [--device BDF] [--size N] [--iters N]`

use std::time::{Duration, Instant};

use mlx5_args::{Opts, Takes};
use mlx5_verbs::{
    wr, Access, AhAttr, Context, Grh, LinkLayer, QpCap, QpType, VerbsError, WcFlags, WcStatus, WorkCompletion,
};

const QKEY: u32 = 0x1111_1111;
const GRH: usize = 40;

const USAGE: &str = "usage: ud_pingpong [--device BDF|sim] [--size BYTES] [--iters N]";

fn main() -> std::process::ExitCode {
    let o = Opts::from_env_or_exit(
        "ud_pingpong",
        USAGE,
        &[
            ("--device", Takes::Text("a PCI address, or sim")),
            ("--size", Takes::Number(1, 4096)),
            ("--iters", Takes::Number(1, 1 << 31)),
        ],
    );
    match run(o.text("--device").unwrap_or("sim"), o.number("--size", 1024) as usize, o.number("--iters", 500) as u32) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ud_pingpong: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(device: &str, size: usize, iters: u32) -> Result<(), VerbsError> {
    let pair;
    let single;
    let (a, b): (&Context, &Context) = match device {
        "sim" => {
            pair = Context::open_sim_pair()?;
            (&pair.0, &pair.1)
        }
        d => {
            single = Context::open(d)?;
            (&single, &single)
        }
    };
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
    let (cq_a, cq_b) = (a.create_cq(16)?, b.create_cq(16)?);
    let (mut buf_a, mut buf_b) = (a.alloc_buffer(2 * size + GRH)?, b.alloc_buffer(2 * size + GRH)?);
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE)?;
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE)?;
    let qa = pd_a.create_qp(QpType::Ud, &cq_a, &cq_a, cap)?.activate_ud(QKEY)?;
    let qb = pd_b.create_qp(QpType::Ud, &cq_b, &cq_b, cap)?.activate_ud(QKEY)?;
    let rb = b.remote_qp(&qb)?;
    let route = |r: &mlx5_verbs::RemoteQp, ctx: &Context| match ctx.link_layer() {
        LinkLayer::Ethernet => AhAttr {
            grh: Some(Grh { dgid: r.gid, hop_limit: 64, ..Grh::default() }),
            dmac: r.mac,
            port_num: 1,
            ..AhAttr::default()
        },
        LinkLayer::InfiniBand => AhAttr { dlid: r.lid, port_num: 1, ..AhAttr::default() },
    };
    let ah_to_b = pd_a.create_ah(&route(&rb, a))?;
    // B's way back to A, learnt from A's first datagram.
    let mut reply = None;
    let mut wc = [WorkCompletion::default(); 4];
    let recv_len = (size + GRH) as u32;
    let start = Instant::now();
    for i in 0..iters {
        let ping: Vec<u8> = (0..size).map(|k| (k as u32 + i) as u8).collect();
        mr_a.write(0, &ping)?;
        qb.post_recv(&[wr::recv(1, &[mr_b.sge(size, recv_len)])])?;
        qa.post_recv(&[wr::recv(1, &[mr_a.sge(size, recv_len)])])?;
        qa.post_send(&[wr::ud_send(2, &[mr_a.sge(0, size as u32)], ah_to_b.dest(rb.qpn, QKEY))])?;
        let n = cq_b.poll_until(&mut wc, 1, Duration::from_secs(10))?;
        if n != 1 || wc[0].status != WcStatus::Success || mr_b.read_vec(size + GRH, size) != ping {
            return Err(VerbsError::Invalid(format!("iteration {i}: ping lost or corrupted: {:?}", &wc[..n])));
        }
        if reply.is_none() {
            let grh: [u8; GRH] = mr_b.read_vec(size, GRH).try_into().expect("40 bytes");
            let has_grh = wc[0].wc_flags.contains(WcFlags::GRH);
            reply = Some((pd_b.create_ah_from_wc(&wc[0], has_grh.then_some(&grh), 1)?, wc[0].src_qp));
        }
        let (ah_to_a, a_qpn) = reply.as_ref().expect("set above");
        mr_b.write(0, &ping)?;
        qb.post_send(&[wr::ud_send(2, &[mr_b.sge(0, size as u32)], ah_to_a.dest(*a_qpn, QKEY))])?;
        let n = cq_a.poll_until(&mut wc, 2, Duration::from_secs(10))?;
        let got = cq_b.poll_until(&mut wc[n..], 1, Duration::from_secs(10))?;
        if n != 2 || got != 1 || mr_a.read_vec(size + GRH, size) != ping {
            return Err(VerbsError::Invalid(format!("iteration {i}: pong lost or corrupted")));
        }
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / f64::from(iters) / 2.0;
    println!("UD {size}-byte datagrams x {iters} round trips: {us:.2} us one-way, every byte verified");
    Ok(())
}

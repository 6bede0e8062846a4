//! A ping-pong written against the `ibverbs` crate, as a Rust RDMA user writes one: two RC queue pairs of the
//! first device connected to each other, `ROUNDS` messages each way, every payload checked. Run with
//! `LD_LIBRARY_PATH=target/libibverbs` it goes through mlx5-ibverbs to the simulated ConnectX.

use std::time::{Duration, Instant};

const ROUNDS: u64 = 1000;

fn main() {
    if let Err(e) = run() {
        eprintln!("ibverbs-crate-pingpong: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let devices = ibverbs::devices().map_err(|e| format!("device list: {e}"))?;
    let dev = devices.iter().next().ok_or("no RDMA device")?;
    let name = dev.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let ctx = dev.open().map_err(|e| format!("open: {e}"))?;
    let cq = ctx.create_cq(64, 0).map_err(|e| format!("create_cq: {e}"))?;
    let pd = ctx.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
    // On RoCE (a table of link-local and IP GIDs) a GRH is needed: GID index 1, the RoCE v2 link-local address.
    // On InfiniBand (one GID) the peer is addressed by LID.
    let roce = ctx.gid_table().len() > 1;
    let qp = || {
        let mut builder = pd.create_qp(&cq, &cq, ibverbs::ibv_qp_type::IBV_QPT_RC);
        if roce {
            builder.set_gid_index(1);
        }
        builder.build().map_err(|e| format!("create_qp: {e}"))
    };
    let (a, b) = (qp()?, qp()?);
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let mut a = a.handshake(eb).map_err(|e| format!("connect A: {e}"))?;
    let mut b = b.handshake(ea).map_err(|e| format!("connect B: {e}"))?;
    // Slot 0: A's receive buffer, 1: A's send buffer, 2: B's receive buffer, 3: B's send buffer.
    let mut mr = pd.allocate::<u64>(4).map_err(|e| format!("reg_mr: {e}"))?;
    let start = Instant::now();
    for round in 0..ROUNDS {
        // Ping: A -> B.
        mr[1] = 0x5049_4e47_0000_0000 | round;
        // SAFETY (for the crate's unsafe posts): the buffers stay registered and untouched until completed.
        unsafe { b.post_receive(&mut mr, 2..3, 2) }.map_err(|e| format!("post_recv: {e}"))?;
        unsafe { a.post_send(&mut mr, 1..2, 1) }.map_err(|e| format!("post_send: {e}"))?;
        wait(&cq, &[1, 2])?;
        if mr[2] != mr[1] {
            return Err(format!("round {round}: B received {:#x}, A sent {:#x}", mr[2], mr[1]));
        }
        // Pong: B -> A.
        mr[3] = 0x504f_4e47_0000_0000 | round;
        unsafe { a.post_receive(&mut mr, 0..1, 3) }.map_err(|e| format!("post_recv: {e}"))?;
        unsafe { b.post_send(&mut mr, 3..4, 4) }.map_err(|e| format!("post_send: {e}"))?;
        wait(&cq, &[3, 4])?;
        if mr[0] != mr[3] {
            return Err(format!("round {round}: A received {:#x}, B sent {:#x}", mr[0], mr[3]));
        }
    }
    let t = start.elapsed();
    println!(
        "{name}: {ROUNDS} ping-pongs through the ibverbs crate in {:.2} s, every payload checked",
        t.as_secs_f64()
    );
    Ok(())
}

/// Polls until the completions with these work request ids arrived, each successful.
fn wait(cq: &ibverbs::CompletionQueue<'_>, ids: &[u64]) -> Result<(), String> {
    let mut left: Vec<u64> = ids.to_vec();
    let mut wc = [ibverbs::ibv_wc::default(); 16];
    let deadline = Instant::now() + Duration::from_secs(30);
    while !left.is_empty() {
        if Instant::now() > deadline {
            return Err(format!("no completion for work requests {left:?}"));
        }
        for c in cq.poll(&mut wc).map_err(|e| format!("poll_cq: {e}"))?.iter() {
            if let Some((status, vendor)) = c.error() {
                return Err(format!("work request {} failed: {status:?} (vendor error {vendor:#x})", c.wr_id()));
            }
            left.retain(|id| *id != c.wr_id());
        }
    }
    Ok(())
}

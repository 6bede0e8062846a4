//! RDMA WRITE, RDMA READ and atomics between two hosts, every result verified: A writes a pattern into B's
//! buffer, reads it back into a second buffer of its own, then adds to and compare-and-swaps a counter in B.
//! Two simulated ConnectX-5s on a simulated wire by default; `--device BDF` runs both sides on one ConnectX.
//!
//! `cargo run -p mlx5-verbs --example rdma_write_read -- [--device BDF] [--size N]`

use std::time::Duration;

use mlx5_args::{Opts, Takes};
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, VerbsError, WcOpcode, WcStatus, WorkCompletion};

const USAGE: &str = "usage: rdma_write_read [--device BDF] [--size BYTES]";

fn main() -> std::process::ExitCode {
    let o = Opts::from_env_or_exit(
        "rdma_write_read",
        USAGE,
        &[("--device", Takes::Text("a PCI address")), ("--size", Takes::Number(8, 1 << 30))],
    );
    match run(o.text("--device"), o.number("--size", 65536) as usize) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rdma_write_read: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(device: Option<&str>, size: usize) -> Result<(), VerbsError> {
    let pair;
    let single;
    let (a, b): (&Context, &Context) = match device {
        None => {
            pair = Context::open_sim_pair()?;
            (&pair.0, &pair.1)
        }
        Some(d) => {
            single = Context::open(d)?;
            (&single, &single)
        }
    };
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
    let (cq_a, cq_b) = (a.create_cq(16)?, b.create_cq(16)?);
    let mut local = a.alloc_buffer(2 * size)?;
    let mut target = b.alloc_buffer(size + 8)?;
    let local_mr = pd_a.register(&mut local, Access::LOCAL_WRITE)?;
    let remote = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    let target_mr = pd_b.register(&mut target, remote)?;
    let qa = pd_a.create_qp(QpType::Rc, &cq_a, &cq_a, cap)?;
    let qb = pd_b.create_qp(QpType::Rc, &cq_b, &cq_b, cap)?;
    let (ra, rb) = (a.remote_qp(&qa)?, b.remote_qp(&qb)?);
    let qa = qa.connect_rc(rb, Access::default())?;
    let _qb = qb.connect_rc(ra, remote)?;

    let pattern: Vec<u8> = (0..size).map(|i| (i * 7 + 3) as u8).collect();
    local_mr.write(0, &pattern)?;
    let counter = target_mr.remote(size);
    // Atomic operands are in host order in memory: the bring-up sets host-endian atomics
    // (`atomic_req_8B_endianness_mode`) as Linux does when the device offers them, as ConnectX-5 does.
    target_mr.write(size, &40u64.to_ne_bytes())?;
    let sz = size as u32;
    qa.post_send(&[
        wr::rdma_write(1, &[local_mr.sge(0, sz)], target_mr.remote(0)),
        wr::rdma_read(2, &[local_mr.sge(size, sz)], target_mr.remote(0)),
        wr::fetch_add(3, &[local_mr.sge(0, 8)], counter, 2),
        wr::cmp_swap(4, &[local_mr.sge(8, 8)], counter, 42, 1000),
    ])?;
    let mut wc = [WorkCompletion::default(); 4];
    let n = cq_a.poll_until(&mut wc, 4, Duration::from_secs(10))?;
    let ops: Vec<(u64, WcOpcode, WcStatus)> = wc[..n].iter().map(|w| (w.wr_id, w.opcode, w.status)).collect();
    if n != 4 || wc.iter().any(|w| w.status != WcStatus::Success) {
        return Err(VerbsError::Invalid(format!("completions: {ops:?}")));
    }
    let wrote = target_mr.read_vec(0, size) == pattern;
    let read = local_mr.read_vec(size, size) == pattern;
    let old_add = u64::from_ne_bytes(local_mr.read_vec(0, 8).try_into().unwrap());
    let old_cas = u64::from_ne_bytes(local_mr.read_vec(8, 8).try_into().unwrap());
    let now = u64::from_ne_bytes(target_mr.read_vec(size, 8).try_into().unwrap());
    println!("RDMA WRITE {size} bytes: {}", if wrote { "verified" } else { "MISMATCH" });
    println!("RDMA READ  {size} bytes: {}", if read { "verified" } else { "MISMATCH" });
    println!("FETCH_ADD 40 + 2: returned {old_add}; CMP_SWAP 42 -> 1000: returned {old_cas}; counter now {now}");
    if !(wrote && read && old_add == 40 && old_cas == 42 && now == 1000) {
        return Err(VerbsError::Invalid("a result differs from what was sent".into()));
    }
    Ok(())
}

//! `mlx5-bench --scale N`: N RC QPs on one simulated ConnectX-5, each with its own CQ and its own registered
//! memory region, made through the verbs API (`mlx5-verbs`) as an application makes them; one message on a sample
//! of them; then everything destroyed and the device checked for anything left behind.
//!
//! What the figures mean:
//! * `create_per_s`: QPs per second, each counted with its CQ, its MR and its way to RTS (CREATE_CQ,
//!   CREATE_MKEY, CREATE_QP and the three transitions RST→INIT→RTR→RTS: six firmware commands per QP).
//! * `destroy_per_s`: QPs per second torn down, each with its MR and its CQ.
//! * `peak_rss_mb`: the process's peak resident set (`VmHWM`), which holds the simulator's device memory too.
//! * `leaked`: QPs, CQs and memory keys the device still holds after every object is destroyed, plus DMA regions
//!   and firmware pages still out after the context is closed. Anything but 0 fails `cargo xtask bench --scale`.

use std::time::{Duration, Instant};

use mlx5_sim::{SimConfig, SimDevice};
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, RemoteQp, WcStatus, WorkCompletion};
use serde_json::{json, Map, Value};

/// Bytes of each QP's memory region: the receive half (first) and the send half.
const SLOT: usize = 64;
const HALF: usize = SLOT / 2;
/// QPs that pass a message, spread evenly over the whole range (the first and the last among them).
const SAMPLE: usize = 256;
/// The smallest RC QP: one send and one receive request of one SGE, nothing inline, so the send reads its MR.
const CAP: QpCap = QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

/// Why the run stopped.
#[derive(Debug)]
pub enum ScaleError {
    /// A verbs call failed; `what` names the object and its index.
    Verbs { what: String, source: mlx5_verbs::VerbsError },
    /// A check on what the device holds, or on a sample message, did not hold.
    Check(String),
}

impl std::fmt::Display for ScaleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScaleError::Verbs { what, .. } => write!(f, "{what} failed"),
            ScaleError::Check(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for ScaleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ScaleError::Verbs { source, .. } => Some(source),
            ScaleError::Check(_) => None,
        }
    }
}

fn verbs<T>(r: mlx5_verbs::Result<T>, what: impl FnOnce() -> String) -> Result<T, ScaleError> {
    r.map_err(|source| ScaleError::Verbs { what: what(), source })
}

fn check(ok: bool, why: impl FnOnce() -> String) -> Result<(), ScaleError> {
    if ok {
        Ok(())
    } else {
        Err(ScaleError::Check(why()))
    }
}

/// The process's peak resident set in MiB (`VmHWM` of `/proc/self/status`), if the kernel reports it.
fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb / 1024.0)
}

/// The indices of the sampled QPs: `SAMPLE` of them (or all, when fewer), evenly spaced, the last one included.
fn sample(n: usize) -> Vec<usize> {
    if n <= SAMPLE {
        return (0..n).collect();
    }
    (0..SAMPLE).map(|k| k * (n - 1) / (SAMPLE - 1)).collect()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64().max(1e-9)
}

/// Runs the whole scale test with `n` QPs and returns its figures.
pub fn run(n: usize) -> Result<Map<String, Value>, ScaleError> {
    check(n > 0, || "--scale needs at least one QP".into())?;
    let sim = SimDevice::new(SimConfig::default());
    let ctx = verbs(Context::open_sim_device(sim.clone()), || "opening the simulated device".into())?;
    let pd = verbs(ctx.alloc_pd(), || "ibv_alloc_pd".into())?;
    let mkeys_before = sim.mkey_count();
    let (_, dma_before) = sim.dma_outstanding();
    // The application's buffers: one allocation, a 64-byte slot per QP, each registered on its own.
    let mut mem = vec![0u8; n * SLOT];

    let t_create = Instant::now();
    let cqs =
        (0..n).map(|i| verbs(ctx.create_cq(2), || format!("ibv_create_cq {i}"))).collect::<Result<Vec<_>, _>>()?;
    let t_cq = t_create.elapsed();
    let mrs = mem
        .chunks_mut(SLOT)
        .enumerate()
        .map(|(i, slot)| verbs(pd.reg_mr(slot, Access::LOCAL_WRITE), || format!("ibv_reg_mr {i}")))
        .collect::<Result<Vec<_>, _>>()?;
    let t_mr = t_create.elapsed() - t_cq;
    // Every QP is connected to itself on the port's loopback: the address is the port's, asked once.
    let mut qps = Vec::with_capacity(n);
    let mut me: Option<RemoteQp> = None;
    for (i, cq) in cqs.iter().enumerate() {
        let qp = verbs(pd.create_qp(QpType::Rc, cq, cq, CAP), || format!("ibv_create_qp {i}"))?;
        let peer = match &me {
            Some(r) => RemoteQp { qpn: qp.qpn(), ..*r },
            None => verbs(ctx.remote_qp(&qp), || "querying the port's address".into())?,
        };
        me.get_or_insert(peer);
        qps.push(verbs(qp.connect_rc(peer, Access::default()), || format!("ibv_modify_qp to RTS, QP {i}"))?);
    }
    let create = t_create.elapsed();
    let t_qp = create - t_cq - t_mr;

    check(sim.qp_count() == n, || format!("the device holds {} QPs, not {n}", sim.qp_count()))?;
    let cqs_held = sim.cq_numbers().len();
    check(cqs_held == n, || format!("the device holds {cqs_held} CQs, not {n}"))?;
    let mkeys = sim.mkey_count() - mkeys_before;
    check(mkeys == n, || format!("the device holds {mkeys} new memory keys, not {n}"))?;
    let (_, dma_peak) = sim.dma_outstanding();

    // One SEND on each sampled QP, from the second half of its MR into the first: both completions on its own CQ,
    // and the bytes where the receive said.
    let picked = sample(n);
    for &i in &picked {
        let (qp, cq, mr) = (&qps[i], &cqs[i], &mrs[i]);
        let payload: [u8; HALF] = std::array::from_fn(|k| (i as u8) ^ (k as u8).wrapping_mul(31) ^ 0x5a);
        verbs(mr.write(HALF, &payload), || format!("writing MR {i}"))?;
        verbs(qp.post_recv(&[wr::recv(2 << 32 | i as u64, &[mr.sge(0, HALF as u32)])]), || format!("post_recv {i}"))?;
        verbs(qp.post_send(&[wr::send(1 << 32 | i as u64, &[mr.sge(HALF, HALF as u32)])]), || {
            format!("post_send {i}")
        })?;
        let mut wc = [WorkCompletion::default(); 2];
        let got = verbs(cq.poll_until(&mut wc, 2, Duration::from_secs(10)), || format!("ibv_poll_cq {i}"))?;
        check(got == 2, || format!("QP {i}: {got} of 2 completions in 10 s"))?;
        for w in &wc {
            check(w.status == WcStatus::Success, || format!("QP {i}: wr_id {:#x} completed {:?}", w.wr_id, w.status))?;
        }
        let mut ids = [wc[0].wr_id, wc[1].wr_id];
        ids.sort_unstable();
        check(ids == [1 << 32 | i as u64, 2 << 32 | i as u64], || format!("QP {i}: completions {ids:x?}"))?;
        let mut back = [0u8; HALF];
        verbs(mr.read(0, &mut back), || format!("reading MR {i}"))?;
        check(back == payload, || format!("QP {i}: the received bytes differ from the sent ones"))?;
    }

    let t_destroy = Instant::now();
    drop(qps);
    drop(mrs);
    drop(cqs);
    let destroy = t_destroy.elapsed();
    let rss = peak_rss_mb();

    let left_qps = sim.qp_count();
    let left_cqs = sim.cq_numbers().len();
    let left_mkeys = sim.mkey_count().saturating_sub(mkeys_before);
    drop(pd);
    drop(ctx);
    let (left_dma, _) = sim.dma_outstanding();
    let left_pages = sim.pages_owned();
    let leaked = left_qps + left_cqs + left_mkeys + left_dma + left_pages;

    let mut out = Map::new();
    out.insert("scale_qps".into(), json!(n));
    out.insert("create_per_s".into(), json!((n as f64 / secs(create)).round() as u64));
    out.insert("destroy_per_s".into(), json!((n as f64 / secs(destroy)).round() as u64));
    out.insert("peak_rss_mb".into(), json!(rss.map(|r| (r * 10.0).round() / 10.0)));
    out.insert("leaked".into(), json!(leaked));
    out.insert("sampled_qps".into(), json!(picked.len()));
    out.insert(
        "phases_s".into(),
        json!({
            "create_cq": round3(secs(t_cq)),
            "reg_mr": round3(secs(t_mr)),
            "create_qp_to_rts": round3(secs(t_qp)),
            "destroy_all": round3(secs(destroy)),
        }),
    );
    out.insert("dma_bytes_per_qp".into(), json!(dma_peak.saturating_sub(dma_before) / n));
    out.insert(
        "leak_detail".into(),
        json!({ "qps": left_qps, "cqs": left_cqs, "mkeys": left_mkeys, "dma_regions": left_dma, "fw_pages": left_pages }),
    );
    Ok(out)
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sample_spans_the_range() {
        assert_eq!(sample(3), [0, 1, 2]);
        let s = sample(65_536);
        assert_eq!(s.len(), SAMPLE);
        assert_eq!((s[0], s[SAMPLE - 1]), (0, 65_535));
        assert!(s.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn a_small_run_passes_its_messages_and_leaks_nothing() {
        let r = run(300).unwrap();
        assert_eq!(r["scale_qps"], 300);
        assert_eq!(r["leaked"], 0);
        assert_eq!(r["sampled_qps"], SAMPLE);
        assert!(r["create_per_s"].as_f64().unwrap() > 0.0);
    }
}

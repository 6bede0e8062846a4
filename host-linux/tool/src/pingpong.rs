//! An RC ping-pong between two queue pairs of one device (`ibv_rc_pingpong` on loopback): each iteration the
//! client SENDs `size` bytes, the server receives them, checks them and SENDs them back, and the client checks
//! what came back. Generic over the core's traits, so it runs on the simulator or on a real device.

use std::time::Instant;

use mlx5_core::cq::{Cq, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::{DelayNs, Dma, DmaRegion, Mmio};
use mlx5_core::hca::{CqAttr, Pd, QpInitAttr};
use mlx5_core::hca::{Hca, Tables};
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::qp::{
    AhAttr, Grh, Mtu, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
};
use mlx5_core::trace::CmdTrace;

use crate::error::{CoreError, ToolError};

/// The largest message of a device whose `log_max_msg` is `log` (`max_msg_sz`: 2^30 on a ConnectX-5).
pub fn max_message(log: u8) -> u64 {
    1u64 << log.min(63)
}

/// Checks a ping-pong's message size against the device's largest message, before any buffer is allocated:
/// a size above it is an argument error naming the limit.
pub fn check_size(size: usize, max_msg_sz: u64) -> Result<(), ToolError> {
    if size as u64 > max_msg_sz {
        return Err(ToolError::Usage(format!(
            "--size {size} is too large for this device: its largest message (max_msg_sz) is {max_msg_sz} bytes"
        )));
    }
    Ok(())
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub size: usize,
    pub iters: u32,
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    pub iters: u32,
    pub size: usize,
    /// Half a round trip, averaged.
    pub avg_latency_us: f64,
    /// Payload bytes moved both ways per second, in megabits.
    pub bandwidth_mbps: f64,
    /// Half the median round trip (perftest's `t_typical`), when each was timed: unlike the average, a few
    /// round trips stalled by the scheduler of a loaded machine do not move it.
    pub typical_latency_us: Option<f64>,
    /// Every message arrived intact, both ways.
    pub verified: bool,
}

impl Report {
    /// The figures of `iters` round trips of `size` bytes that took `secs`.
    pub fn from_run(iters: u32, size: usize, secs: f64, verified: bool) -> Report {
        let secs = secs.max(1e-9);
        let n = f64::from(iters);
        Report {
            iters,
            size,
            avg_latency_us: secs * 1e6 / n / 2.0,
            bandwidth_mbps: (size as f64) * 2.0 * n * 8.0 / secs / 1e6,
            typical_latency_us: None,
            verified,
        }
    }

    /// With the median of `round_trips` (nanoseconds each; sorted here) as the typical latency.
    pub fn with_round_trips(mut self, round_trips: &mut [u64]) -> Report {
        round_trips.sort_unstable();
        self.typical_latency_us = round_trips.get(round_trips.len() / 2).map(|&ns| ns as f64 / 2e3);
        self
    }

    pub fn json(&self) -> String {
        serde_json::json!({
            "iters": self.iters,
            "size": self.size,
            "avg_latency_us": self.avg_latency_us,
            "bandwidth_mbps": self.bandwidth_mbps,
            "typical_latency_us": self.typical_latency_us,
            "verified": self.verified,
        })
        .to_string()
    }

    pub fn text(&self) -> String {
        format!(
            "{} bytes in {} iterations: {:.2} us average one-way latency, {}{:.2} Mbit/s, data {}\n",
            self.size,
            self.iters,
            self.avg_latency_us,
            self.typical_latency_us.map(|t| format!("{t:.2} us typical (median), ")).unwrap_or_default(),
            self.bandwidth_mbps,
            if self.verified { "verified" } else { "CORRUPTED" }
        )
    }
}

/// One side: its buffer, key, CQ and QP. As in `ibv_rc_pingpong`, one buffer both sends and receives: a message
/// arrives only after the peer had this side's last one, so the two never overlap, and the run's memory is two
/// buffers of `size` (four, and a copy between them, made 1 GiB need 6.3 GB).
struct Side {
    buf: DmaRegion,
    mr: Mr,
    cq: Cq,
    qp: Qp,
}

/// A core call that failed: what the ping-pong was doing, and the core's error as the source.
fn err(what: &str, e: impl Into<CoreError>) -> ToolError {
    ToolError::Core { what: what.to_string(), source: e.into() }
}

/// Runs the ping-pong on a brought-up HCA and frees everything it created. A size the device cannot take is a
/// [`ToolError::Usage`], found before anything is created.
pub fn run<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    dma: &D,
    delay: &mut impl DelayNs,
    opts: Options,
) -> Result<Report, ToolError> {
    if opts.size == 0 || opts.iters == 0 {
        return Err(ToolError::Usage("size and iterations must be at least 1".into()));
    }
    // Refused before any buffer is allocated: the device's largest message (`max_msg_sz`).
    check_size(opts.size, max_message(hca.caps().general.log_max_msg))?;
    let pd = hca.alloc_pd(delay).map_err(|e| err("alloc PD", e))?;
    let mut a = side(hca, dma, &pd, delay, opts.size)?;
    let mut b = side(hca, dma, &pd, delay, opts.size)?;
    connect(hca, &mut a.qp, b.qp.qpn(), delay)?;
    connect(hca, &mut b.qp, a.qp.qpn(), delay)?;
    let result = exchange(hca, &mut a, &mut b, opts);
    let mut cleanup = Ok(());
    for s in [a, b] {
        let r = destroy_side(hca, dma, s, delay);
        cleanup = cleanup.and(r);
    }
    let r = hca.dealloc_pd(pd, delay).map_err(|e| err("dealloc PD", e.error));
    cleanup = cleanup.and(r);
    let report = result?;
    cleanup?;
    Ok(report)
}

fn side<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    dma: &D,
    pd: &Pd,
    delay: &mut impl DelayNs,
    size: usize,
) -> Result<Side, ToolError> {
    // Aligned to the size's power of two up to 2 MiB, so the MTT uses pages that large and fits one command.
    let align = size.checked_next_power_of_two().unwrap_or(usize::MAX).clamp(4096, 2 << 20);
    let buf = dma.alloc(size, align).map_err(|e| err("allocate the buffer", e))?;
    let mr = hca
        .reg_mr(pd, buf.cpu().as_ptr(), size, Access::LOCAL_WRITE, delay)
        .map_err(|e| err("register the buffer", e))?;
    let cq = hca.create_cq(CqAttr { cqe: 16, ..CqAttr::default() }, delay).map_err(|e| err("create CQ", e))?;
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: true };
    let qp = hca.create_qp(pd, &cq, &cq, attr, delay).map_err(|e| err("create QP", e))?;
    Ok(Side { buf, mr, cq, qp })
}

/// RESET → INIT → RTR → RTS towards `dest_qpn` on this same port.
fn connect<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    qp: &mut Qp,
    dest_qpn: u32,
    delay: &mut impl DelayNs,
) -> Result<(), ToolError> {
    let port = hca.query_port(delay).map_err(|e| err("query port", e))?;
    let gid = hca.query_gid(0, delay).map_err(|e| err("query GID", e))?;
    let roce = port.link_layer == mlx5_core::cq::LinkLayer::Ethernet;
    // On loopback the next hop is this port itself.
    let dmac = if roce {
        hca.exec(&mut mlx5_core::vport::QueryNicVportContext, delay).map_err(|e| err("query MAC", e))?.permanent_address
    } else {
        [0; 6]
    };
    let ah = AhAttr {
        dlid: port.lid,
        dmac,
        grh: roce.then_some(Grh { dgid: gid, hop_limit: 1, ..Grh::default() }),
        port_num: 1,
        ..AhAttr::default()
    };
    let attr = QpAttr {
        qp_state: QpState::Init,
        qp_access_flags: Access::REMOTE_READ | Access::REMOTE_WRITE,
        path_mtu: if port.active_mtu >= 1 { mtu_of(port.active_mtu) } else { Mtu::M1024 },
        dest_qp_num: dest_qpn,
        ah_attr: ah,
        ..QpAttr::default()
    };
    use QpAttrMask as M;
    let steps = [
        (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
        (
            QpState::Rtr,
            M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
        ),
        (QpState::Rts, M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC),
    ];
    for (state, mask) in steps {
        hca.modify_qp(qp, &QpAttr { qp_state: state, ..attr }, mask, delay)
            .map_err(|e| err(&format!("move QP {:#x} to {state:?}", qp.qpn()), e))?;
    }
    Ok(())
}

fn mtu_of(e: u8) -> Mtu {
    match e {
        1 => Mtu::M256,
        2 => Mtu::M512,
        3 => Mtu::M1024,
        4 => Mtu::M2048,
        _ => Mtu::M4096,
    }
}

fn fill(buf: &DmaRegion, seed: u32) {
    // SAFETY: the buffer is ours and not posted while we write it.
    let b = unsafe { std::slice::from_raw_parts_mut(buf.cpu().as_ptr(), buf.len()) };
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u32).wrapping_mul(31).wrapping_add(seed) as u8;
    }
}

/// Whether `buf` holds what [`fill`] wrote with `seed` (compared in place: no copy of a large message).
fn holds(buf: &DmaRegion, seed: u32) -> bool {
    // SAFETY: the buffer is ours; its receive completed, so the device is done writing it.
    let b = unsafe { std::slice::from_raw_parts(buf.cpu().as_ptr(), buf.len()) };
    b.iter().enumerate().all(|(i, &x)| x == (i as u32).wrapping_mul(31).wrapping_add(seed) as u8)
}

fn post_recv<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(hca: &Hca<M, D, T, S>, s: &mut Side) -> Result<(), ToolError> {
    let sge = [Sge { addr: s.buf.cpu().as_ptr() as u64, length: s.buf.len() as u32, lkey: s.mr.lkey }];
    hca.post_recv(&mut s.qp, &[RecvWr { wr_id: 2, sg_list: &sge }]).map_err(|e| err("post receive", e))
}

fn post_send<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(hca: &Hca<M, D, T, S>, s: &mut Side) -> Result<(), ToolError> {
    let sge = [Sge { addr: s.buf.cpu().as_ptr() as u64, length: s.buf.len() as u32, lkey: s.mr.lkey }];
    let wr = SendWr { wr_id: 1, op: SendOp::Send, sg_list: &sge, flags: SendFlags::SIGNALED, inline: None, ud: None };
    hca.post_send(&mut s.qp, &[wr]).map_err(|e| err("post send", e))
}

/// Polls `s`'s CQ until both its send and its receive completed (bounded).
fn wait_both<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(hca: &Hca<M, D, T, S>, s: &mut Side) -> Result<(), ToolError> {
    let mut wc = [WorkCompletion::default(); 4];
    let (mut sent, mut got) = (false, false);
    for _ in 0..10_000_000u32 {
        let n = s.cq.poll(hca.mmio(), &mut s.qp, &mut wc).map_err(|e| err("poll CQ", e))?;
        for w in &wc[..n] {
            if w.status != WcStatus::Success {
                return Err(ToolError::Run(format!(
                    "work request {} completed with {} (vendor error {:#x})",
                    w.wr_id, w.status, w.vendor_err
                )));
            }
            match w.opcode {
                WcOpcode::Send => sent = true,
                WcOpcode::Recv => got = true,
                o => return Err(ToolError::Run(format!("unexpected completion {o:?}"))),
            }
        }
        if sent && got {
            return Ok(());
        }
        std::hint::spin_loop();
    }
    Err(ToolError::Run("timed out waiting for completions".into()))
}

fn exchange<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    a: &mut Side,
    b: &mut Side,
    opts: Options,
) -> Result<Report, ToolError> {
    let mut verified = true;
    post_recv(hca, a)?;
    post_recv(hca, b)?;
    let start = Instant::now();
    for i in 0..opts.iters {
        fill(&a.buf, i);
        post_send(hca, a)?;
        // The server's receive completes once the client's send arrived; it answers with the same bytes.
        let mut wc = [WorkCompletion::default(); 2];
        let mut n = 0;
        for _ in 0..10_000_000u32 {
            n = b.cq.poll(hca.mmio(), &mut b.qp, &mut wc).map_err(|e| err("poll CQ", e))?;
            if n > 0 {
                break;
            }
            std::hint::spin_loop();
        }
        if n == 0 || wc[0].opcode != WcOpcode::Recv || wc[0].status != WcStatus::Success {
            return Err(ToolError::Run(format!("server: expected a receive, got {:?}", &wc[..n])));
        }
        verified &= wc[0].byte_len as usize == opts.size && holds(&b.buf, i);
        // The next ping lands in the same buffer, after the client had this pong.
        post_recv(hca, b)?;
        post_send(hca, b)?;
        wait_both(hca, a)?;
        verified &= holds(&a.buf, i);
        post_recv(hca, a)?;
        // The server's send completion.
        let mut got = false;
        for _ in 0..10_000_000u32 {
            let n = b.cq.poll(hca.mmio(), &mut b.qp, &mut wc).map_err(|e| err("poll CQ", e))?;
            if n > 0 {
                if wc[0].status != WcStatus::Success {
                    return Err(ToolError::Run(format!("server send completed with {}", wc[0].status)));
                }
                got = true;
                break;
            }
        }
        if !got {
            return Err(ToolError::Run("server send never completed".into()));
        }
    }
    Ok(Report::from_run(opts.iters, opts.size, start.elapsed().as_secs_f64(), verified))
}

fn destroy_side<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    dma: &D,
    s: Side,
    delay: &mut impl DelayNs,
) -> Result<(), ToolError> {
    hca.destroy_qp(s.qp, delay).map_err(|e| err("destroy QP", e.error))?;
    hca.destroy_cq(s.cq, delay).map_err(|e| err("destroy CQ", e.error))?;
    hca.dereg_mr(s.mr, delay).map_err(|e| err("deregister", e.error))?;
    // SAFETY: the key over the buffer is destroyed, so the device cannot reach it.
    unsafe { dma.free(s.buf) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_typical_latency_is_half_the_median_round_trip_and_stalls_do_not_move_it() {
        // 99 round trips of 20 us and one stalled for 10 ms: the average moves, the median does not.
        let mut rtts = vec![20_000u64; 99];
        rtts.insert(3, 10_000_000);
        let secs = rtts.iter().sum::<u64>() as f64 / 1e9;
        let r = Report::from_run(100, 1000, secs, true).with_round_trips(&mut rtts);
        assert_eq!(r.typical_latency_us, Some(10.0));
        assert!(r.avg_latency_us > 50.0, "{}", r.avg_latency_us);
        assert!(r.text().contains("10.00 us typical (median), "), "{}", r.text());
        // Nothing timed: no typical latency, and the line is as before.
        let none = Report::from_run(1, 1000, 1.0, true).with_round_trips(&mut []);
        assert_eq!(none.typical_latency_us, None);
        assert!(!none.text().contains("typical"));
    }
}

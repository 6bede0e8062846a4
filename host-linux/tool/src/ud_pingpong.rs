//! The UD ping-pong (`mlx5 pingpong --ud`) between two UD queue pairs of one device, as `ibv_ud_pingpong` runs
//! it on loopback: datagrams sent through an address handle carrying the peer's GID (RoCE) or LID (InfiniBand),
//! the remote QPN and ud_pingpong's Q_Key, each received behind 40 bytes of room for the GRH. The client SENDs
//! `size` bytes, the server checks them and SENDs them back, and the client checks what came back.

use std::time::{Duration, Instant};

use mlx5_verbs::{wr, Access, AhAttr, Context, Grh, LinkLayer, QpCap, QpType, RemoteQp, WcStatus, WorkCompletion};

use crate::error::{SizeError, ToolError};
use crate::pingpong::Report;

/// ud_pingpong's Q_Key.
pub const QKEY: u32 = 0x1111_1111;
/// The room in front of every received payload for the Global Routing Header.
pub const GRH: usize = 40;
/// ud_pingpong's default message size.
pub const DEFAULT_SIZE: usize = 2048;

/// How long one datagram may take before the run fails.
const WAIT: Duration = Duration::from_secs(10);

/// The bytes of an IB MTU enum (`IB_MTU_256` = 1 .. `IB_MTU_4096` = 5); anything else is treated as 256.
pub fn mtu_bytes(active_mtu: u8) -> usize {
    128 << active_mtu.clamp(1, 5)
}

/// The message size to run: `size` when it fits one packet of the port's active MTU (ud_pingpong refuses a
/// larger one), by default 2048 bytes or the MTU when that is smaller.
pub fn message_size(size: Option<usize>, active_mtu: u8) -> Result<usize, SizeError> {
    let mtu = mtu_bytes(active_mtu);
    match size {
        Some(s) if s > mtu => Err(SizeError { size: s, mtu }),
        Some(s) => Ok(s),
        None => Ok(DEFAULT_SIZE.min(mtu)),
    }
}

fn verbs(what: &'static str) -> impl Fn(mlx5_verbs::VerbsError) -> ToolError {
    move |source| ToolError::Verbs { what, source }
}

/// The address of `r` as a sender on `ctx`'s port reaches it, from GID table entry `sgid_index` (RoCE).
pub fn route(ctx: &Context, r: &RemoteQp, sgid_index: u8) -> AhAttr {
    match ctx.link_layer() {
        LinkLayer::Ethernet => AhAttr {
            grh: Some(Grh { dgid: r.gid, hop_limit: 1, sgid_index, ..Grh::default() }),
            dmac: r.mac,
            port_num: 1,
            ..AhAttr::default()
        },
        LinkLayer::InfiniBand => AhAttr { dlid: r.lid, port_num: 1, ..AhAttr::default() },
    }
}

/// Waits for one successful completion on `cq`, returning its byte count.
fn one(cq: &mlx5_verbs::CompletionQueue<'_>, what: &str) -> Result<u32, ToolError> {
    let mut wc = [WorkCompletion::default(); 1];
    let n = cq.poll_until(&mut wc, 1, WAIT).map_err(verbs("poll CQ"))?;
    if n == 0 {
        return Err(ToolError::Run(format!("timed out after {WAIT:?} waiting for the {what}")));
    }
    if wc[0].status != WcStatus::Success {
        return Err(ToolError::Run(format!(
            "the {what} completed with {} (vendor error {:#x})",
            wc[0].status, wc[0].vendor_err
        )));
    }
    Ok(wc[0].byte_len)
}

/// Runs the UD ping-pong on one open device; `size` as [`message_size`] takes it.
pub fn run(ctx: &Context, size: Option<usize>, iters: u32) -> Result<Report, ToolError> {
    let port = ctx.query_port().map_err(verbs("query port"))?;
    let size = message_size(size, port.active_mtu)?;
    if size == 0 || iters == 0 {
        return Err(ToolError::Run("size and iterations must be at least 1".into()));
    }
    let len = u32::try_from(size).map_err(|_| ToolError::Run("--size must fit in 32 bits".into()))?;
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let pd = ctx.alloc_pd().map_err(verbs("alloc PD"))?;
    let (cq_c, cq_s) = (ctx.create_cq(16).map_err(verbs("create CQ"))?, ctx.create_cq(16).map_err(verbs("create CQ"))?);
    // Each side sends from the first `size` bytes and receives behind them: GRH room, then the payload.
    let mut buf_c = ctx.alloc_buffer(2 * size + GRH).map_err(verbs("allocate a buffer"))?;
    let mut buf_s = ctx.alloc_buffer(2 * size + GRH).map_err(verbs("allocate a buffer"))?;
    let mr_c = pd.register(&mut buf_c, Access::LOCAL_WRITE).map_err(verbs("register a buffer"))?;
    let mr_s = pd.register(&mut buf_s, Access::LOCAL_WRITE).map_err(verbs("register a buffer"))?;
    let ud = |cq| {
        pd.create_qp(QpType::Ud, cq, cq, cap)
            .map_err(verbs("create QP"))?
            .activate_ud(QKEY)
            .map_err(verbs("move to RTS"))
    };
    let (qc, qs) = (ud(&cq_c)?, ud(&cq_s)?);
    let (rc, rs) = (ctx.remote_qp(&qc).map_err(verbs("query port"))?, ctx.remote_qp(&qs).map_err(verbs("query port"))?);
    let ah_to_s = pd.create_ah(&route(ctx, &rs, 0)).map_err(verbs("create address handle"))?;
    let ah_to_c = pd.create_ah(&route(ctx, &rc, 0)).map_err(verbs("create address handle"))?;
    let recv_len = len + GRH as u32;
    let post_recv = |qp: &mlx5_verbs::QueuePair<'_, mlx5_verbs::Rts>, mr: &mlx5_verbs::MemoryRegion<'_>| {
        qp.post_recv(&[wr::recv(1, &[mr.sge(size, recv_len)])]).map_err(verbs("post receive"))
    };
    post_recv(&qs, &mr_s)?;
    post_recv(&qc, &mr_c)?;
    let mut ping = vec![0u8; size];
    let mut verified = true;
    let start = Instant::now();
    for i in 0..iters {
        for (k, b) in ping.iter_mut().enumerate() {
            *b = (k as u32).wrapping_mul(31).wrapping_add(i.wrapping_mul(7)) as u8;
        }
        mr_c.write(0, &ping).map_err(verbs("write the ping"))?;
        qc.post_send(&[wr::ud_send(2, &[mr_c.sge(0, len)], ah_to_s.dest(rs.qpn, QKEY))]).map_err(verbs("post send"))?;
        // A UD receive counts the GRH room in its length.
        verified &= one(&cq_s, "ping")? == recv_len;
        let got = mr_s.read_vec(size + GRH, size);
        verified &= got == ping;
        post_recv(&qs, &mr_s)?;
        mr_s.write(0, &got).map_err(verbs("copy the ping"))?;
        qs.post_send(&[wr::ud_send(2, &[mr_s.sge(0, len)], ah_to_c.dest(rc.qpn, QKEY))]).map_err(verbs("post send"))?;
        one(&cq_s, "server's send")?;
        // The client's send and the pong, in either order.
        let a = one(&cq_c, "client's completions")?;
        let b = one(&cq_c, "client's completions")?;
        verified &= a.max(b) == recv_len && mr_c.read_vec(size + GRH, size) == ping;
        post_recv(&qc, &mr_c)?;
    }
    let secs = start.elapsed().as_secs_f64();
    // Address handles belong to the PD: they go before it (ibv_destroy_ah before ibv_dealloc_pd).
    drop((ah_to_s, ah_to_c));
    // The last receives posted are still outstanding; destroying the QPs flushes them.
    qc.destroy().map_err(verbs("destroy QP"))?;
    qs.destroy().map_err(verbs("destroy QP"))?;
    mr_c.destroy().map_err(verbs("deregister a buffer"))?;
    mr_s.destroy().map_err(verbs("deregister a buffer"))?;
    cq_c.destroy().map_err(verbs("destroy CQ"))?;
    cq_s.destroy().map_err(verbs("destroy CQ"))?;
    pd.destroy().map_err(verbs("dealloc PD"))?;
    Ok(Report::from_run(iters, size, secs, verified))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_defaults_to_ud_pingpongs_and_must_fit_the_mtu() {
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        assert_eq!(message_size(None, 5), Ok(2048));
        assert_eq!(message_size(None, 3), Ok(1024));
        assert_eq!(message_size(Some(1024), 3), Ok(1024));
        assert!(message_size(Some(1025), 3)
            .unwrap_err()
            .to_string()
            .contains("larger than the port's active MTU (1024 bytes)"));
    }
}

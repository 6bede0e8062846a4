//! [`run_peer`]: the driver's life on one device whose RC QP talks to a QP of another machine over the port's
//! link, instead of the loopback [`run`] uses. Both ends run this same function (so their command
//! traces are the same commands in the same order); they differ only in who sends first. The connection facts
//! ([`PeerInfo`]: QPN, LID, GID, MAC, rkey, address) cross out of band through a [`Rendezvous`] the caller gives:
//! a host process prints and reads lines, a bare-metal image reads its boot command line and prints on serial.
//!
//! The exchange is a lock-step ping-pong of [`PEER_ITERS`] rounds: in each, one side posts an RDMA WRITE of
//! [`PEER_MSG`] bytes into the other's write area and then a SEND of [`PEER_MSG`] bytes (RC keeps them in order, so
//! when the SEND's receive completes the WRITE's bytes are in place); the other side checks both, reposts its
//! receive and answers the same way. Every byte of every message is checked against [`peer_byte`].

use super::*;

/// Rounds of the exchange; each side sends one SEND and one RDMA WRITE per round.
pub const PEER_ITERS: u32 = 1000;
/// Bytes of each SEND and each RDMA WRITE.
pub const PEER_MSG: usize = 4096;
/// The buffer's areas: the SEND source, the WRITE source, the receive target, the area the peer writes into.
const SEND_SRC: usize = 0;
const WRITE_SRC: usize = PEER_MSG;
const RECV_DST: usize = 2 * PEER_MSG;
/// Offset of the area the peer's RDMA WRITEs land in, announced as [`PeerInfo::addr`].
pub const WRITE_DST: usize = 3 * PEER_MSG;
const _: () = assert!(4 * PEER_MSG <= BUF_BYTES);

/// `wr_id`s of the exchange's work requests.
const PEER_SEND_ID: u64 = 0x5e00;
const PEER_WRITE_ID: u64 = 0x3e00;
const PEER_RECV_ID: u64 = 0x4e00;

/// Byte `j` of the message the side that sends first (`first`) sends in round `round`, as a SEND (`write` false)
/// or an RDMA WRITE: each message differs from every other of the run, so a stale or misplaced one shows.
pub fn peer_byte(round: u32, first: bool, write: bool, j: usize) -> u8 {
    let seq = (round as usize) * 4 + usize::from(!first) * 2 + usize::from(write);
    pattern(j.wrapping_add(seq.wrapping_mul(257))) ^ (seq as u8)
}

/// What one side tells the other: its QP, its port's address and where the other may write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeerInfo {
    pub qpn: u32,
    /// The port's LID (InfiniBand; 0 on Ethernet).
    pub lid: u16,
    /// The GID of the entry this side's QP sends from (RoCE; zero on InfiniBand).
    pub gid: [u8; 16],
    /// The MAC of that GID entry (RoCE).
    pub mac: [u8; 6],
    /// The rkey over [`PeerInfo::addr`].
    pub rkey: u32,
    /// The address of the [`PEER_MSG`]-byte area the other side's RDMA WRITEs go to.
    pub addr: u64,
}

/// `qpn=HEX,lid=HEX,gid=32 HEX DIGITS,mac=12 HEX DIGITS,rkey=HEX,addr=HEX`: one token without spaces, so it fits a
/// kernel-style command line.
impl core::fmt::Display for PeerInfo {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "qpn={:x},lid={:x},gid=", self.qpn, self.lid)?;
        for b in self.gid {
            write!(f, "{b:02x}")?;
        }
        f.write_str(",mac=")?;
        for b in self.mac {
            write!(f, "{b:02x}")?;
        }
        write!(f, ",rkey={:x},addr={:x}", self.rkey, self.addr)
    }
}

/// Why a [`PeerInfo`] text was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerInfoError {
    /// A `key=value` item is missing.
    Missing(&'static str),
    /// The value of this key is not the hexadecimal number or byte string it must be.
    Bad(&'static str),
}

impl core::fmt::Display for PeerInfoError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PeerInfoError::Missing(k) => write!(f, "peer facts: no {k}="),
            PeerInfoError::Bad(k) => write!(f, "peer facts: {k}= is not valid hexadecimal of the right size"),
        }
    }
}

fn hex_bytes<const N: usize>(s: &str, key: &'static str) -> Result<[u8; N], PeerInfoError> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return Err(PeerInfoError::Bad(key));
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        let pair = core::str::from_utf8(&s[2 * i..2 * i + 2]).map_err(|_| PeerInfoError::Bad(key))?;
        *o = u8::from_str_radix(pair, 16).map_err(|_| PeerInfoError::Bad(key))?;
    }
    Ok(out)
}

impl core::str::FromStr for PeerInfo {
    type Err = PeerInfoError;

    /// Parses what `Display` writes; items in any order, unknown keys refused as missing ones are.
    fn from_str(s: &str) -> Result<Self, PeerInfoError> {
        let get = |key: &'static str| {
            s.split(',')
                .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
                .ok_or(PeerInfoError::Missing(key))
        };
        let num =
            |key: &'static str| get(key).and_then(|v| u64::from_str_radix(v, 16).map_err(|_| PeerInfoError::Bad(key)));
        let narrow = |key: &'static str, max: u64| {
            num(key).and_then(|v| if v <= max { Ok(v) } else { Err(PeerInfoError::Bad(key)) })
        };
        Ok(PeerInfo {
            qpn: narrow("qpn", 0xff_ffff)? as u32,
            lid: narrow("lid", 0xffff)? as u16,
            gid: hex_bytes(get("gid")?, "gid")?,
            mac: hex_bytes(get("mac")?, "mac")?,
            rkey: narrow("rkey", u64::from(u32::MAX))? as u32,
            addr: num("addr")?,
        })
    }
}

/// How the connection facts cross between the two sides.
pub trait Rendezvous {
    /// Called once this side's QP exists: returns the other side's facts (this side's, `mine`, may go out now),
    /// or `None` when none can be had.
    fn peer(&mut self, mine: &PeerInfo) -> Option<PeerInfo>;
    /// Called once this side's QP is at RTS with its first receive posted: the other side may now send.
    fn ready(&mut self, mine: &PeerInfo);
}

/// What [`run_peer`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerReport {
    pub fw_rev: (u16, u16, u16),
    pub link_layer: LinkLayer,
    pub mine: PeerInfo,
    pub theirs: PeerInfo,
    /// Rounds completed.
    pub rounds: u32,
    /// Payload bytes received and checked (every SEND and every RDMA WRITE of the other side).
    pub bytes_checked: u64,
    pub pages_reclaimed: usize,
}

/// Brings the HCA up, creates a PD, a registered [`BUF_BYTES`] buffer, a CQ and an RC QP, trades [`PeerInfo`]s
/// through `rv`, connects the QP to the other side's (RESET → INIT → RTR → RTS, the values of `run`), runs the
/// [`PEER_ITERS`]-round exchange (`first`: this side sends first) with every completion and byte checked, then
/// destroys everything and tears the HCA down with every firmware page returned. `timeout_us` bounds each wait for
/// a completion (the caller's `DelayNs` time).
pub fn run_peer<M: Mmio, D: Dma, T: CmdTrace>(
    mmio: M,
    dma: D,
    trace: T,
    delay: &mut impl DelayNs,
    rv: &mut impl Rendezvous,
    first: bool,
    timeout_us: u32,
) -> Result<PeerReport, RunError> {
    let mut hca: FwHca<M, D, T> = Hca::bring_up(mmio, dma, trace, delay, config()).map_err(RunError::BringUp)?;
    let mut objs = Objects::default();
    let mut report = PeerReport {
        fw_rev: hca.fw_rev(),
        link_layer: LinkLayer::default(),
        mine: PeerInfo::default(),
        theirs: PeerInfo::default(),
        rounds: 0,
        bytes_checked: 0,
        pages_reclaimed: 0,
    };
    let ran = peer_objects(&mut hca, &mut objs, &mut report, rv, first, timeout_us, delay);
    let released = objs.release(&mut hca, delay);
    let down = hca.teardown(delay);
    ran?;
    released?;
    let down = down.map_err(RunError::Teardown)?;
    if down.pages_abandoned != 0 {
        return Err(RunError::PagesKept { pages: down.pages_abandoned });
    }
    report.pages_reclaimed = down.pages_reclaimed;
    Ok(report)
}

fn peer_objects<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    objs: &mut Objects,
    report: &mut PeerReport,
    rv: &mut impl Rendezvous,
    first: bool,
    timeout_us: u32,
    delay: &mut impl DelayNs,
) -> Result<(), RunError> {
    let pd = &*objs.pd.insert(hca.alloc_pd(delay).map_err(step("ALLOC_PD"))?);
    let buf = &*objs.buf.insert(hca.cmdq().dma().alloc(BUF_BYTES, 4096).map_err(RunError::Buffer)?);
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mr =
        &*objs.mr.insert(hca.reg_mr(pd, buf.cpu().as_ptr(), BUF_BYTES, access, delay).map_err(step("CREATE_MKEY"))?);
    let cq_attr = CqAttr { cqe: 15, ..CqAttr::default() };
    let cq = objs.cq_a.insert(hca.create_cq(cq_attr, delay).map_err(step("CREATE_CQ"))?);
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: false };
    let qp = objs.qp_a.insert(hca.create_qp(pd, cq, cq, attr, delay).map_err(step("CREATE_QP"))?);

    // The link may come up only once the other side plugs in, so the port's state is not required here: a dead
    // link shows as a timed-out completion.
    let port = hca.query_port(delay).map_err(step("query port"))?;
    report.link_layer = port.link_layer;
    // This side's own address, the same entry `run` picks for its loopback.
    let own = loopback_address(hca, port.link_layer, port.lid, delay)?;
    let base = buf.cpu().as_ptr() as u64;
    report.mine = PeerInfo {
        qpn: qp.qpn(),
        lid: port.lid,
        gid: own.grh.map(|g| g.dgid).unwrap_or_default(),
        mac: own.dmac,
        rkey: mr.rkey,
        addr: base + WRITE_DST as u64,
    };
    let theirs = rv.peer(&report.mine).ok_or(RunError::NoPeer)?;
    report.theirs = theirs;
    let ah = match own.grh {
        None => AhAttr { dlid: theirs.lid, port_num: 1, ..AhAttr::default() },
        Some(g) => AhAttr { grh: Some(Grh { dgid: theirs.gid, ..g }), dmac: theirs.mac, ..own },
    };
    connect(hca, qp, theirs.qpn, ah, mtu_of(port.active_mtu), delay)?;

    // The sources of this side's messages are rewritten each round; the receive is posted before the other side
    // may send.
    let recv_sge = Sge { addr: base + RECV_DST as u64, length: PEER_MSG as u32, lkey: mr.lkey };
    let post_recv = |hca: &mut FwHca<M, D, T>, qp: &mut Qp| {
        let wr = RecvWr { wr_id: PEER_RECV_ID, sg_list: core::slice::from_ref(&recv_sge) };
        hca.post_recv(qp, &[wr]).map_err(|error| RunError::Post { what: "receive queue", error })
    };
    post_recv(hca, qp)?;
    rv.ready(&report.mine);

    let mut waiter = Waiter { waited: 0, timeout_us };
    for round in 0..PEER_ITERS {
        if first {
            send_round(hca, buf, mr, cq, qp, &theirs, round, true, &mut waiter, delay)?;
            receive_round(hca, buf, cq, qp, round, false, &mut waiter, delay)?;
            post_recv(hca, qp)?;
        } else {
            receive_round(hca, buf, cq, qp, round, true, &mut waiter, delay)?;
            post_recv(hca, qp)?;
            send_round(hca, buf, mr, cq, qp, &theirs, round, false, &mut waiter, delay)?;
        }
        report.rounds = round + 1;
        report.bytes_checked += 2 * PEER_MSG as u64;
    }
    Ok(())
}

/// The time spent in empty polls, against the bound of one wait.
struct Waiter {
    waited: u32,
    timeout_us: u32,
}

/// Polls until one completion arrives, for at most [`Waiter::timeout_us`] of empty polls.
fn one_completion<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    cq: &mut Cq,
    qp: &mut Qp,
    w: &mut Waiter,
    round: u32,
    delay: &mut impl DelayNs,
) -> Result<WorkCompletion, RunError> {
    let since = w.waited;
    let mut wc = [WorkCompletion::default()];
    loop {
        if hca.poll_cq(cq, qp, &mut wc).map_err(RunError::Poll)? == 1 {
            return Ok(wc[0]);
        }
        if w.waited - since >= w.timeout_us {
            return Err(RunError::PeerTimeout { round });
        }
        delay.delay_us(POLL_INTERVAL_US);
        w.waited = w.waited.saturating_add(POLL_INTERVAL_US);
        // As in `run`: health on the datapath's own clock, so a dead device ends the wait with flushes.
        hca.health_tick(u64::from(w.waited / 1000)).map_err(step("health poll"))?;
    }
}

fn expect(w: &WorkCompletion, index: usize, wr_id: u64, opcode: WcOpcode, byte_len: u32) -> Result<(), RunError> {
    let len_ok = opcode != WcOpcode::Recv || w.byte_len == byte_len;
    if w.status == WcStatus::Success && w.wr_id == wr_id && w.opcode == opcode && len_ok {
        return Ok(());
    }
    Err(RunError::Completion { index, wr_id: w.wr_id, status: w.status, opcode: w.opcode, byte_len: w.byte_len })
}

/// This side's round: both sources filled, the RDMA WRITE and the SEND posted in one call, both completions
/// awaited in order.
#[allow(clippy::too_many_arguments)]
fn send_round<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    buf: &DmaRegion,
    mr: &Mr,
    cq: &mut Cq,
    qp: &mut Qp,
    theirs: &PeerInfo,
    round: u32,
    first: bool,
    w: &mut Waiter,
    delay: &mut impl DelayNs,
) -> Result<(), RunError> {
    for (off, write) in [(SEND_SRC, false), (WRITE_SRC, true)] {
        let p = buf.ptr_at(off, PEER_MSG);
        for j in 0..PEER_MSG {
            // SAFETY: `p` covers this source area of the live buffer (ptr_at checked it); the previous round's
            // work requests that read it have completed.
            unsafe { p.add(j).write(peer_byte(round, first, write, j)) };
        }
    }
    let base = buf.cpu().as_ptr() as u64;
    let sge = |off: usize| Sge { addr: base + off as u64, length: PEER_MSG as u32, lkey: mr.lkey };
    let (ws, ss) = (sge(WRITE_SRC), sge(SEND_SRC));
    let wrs = [
        SendWr {
            wr_id: PEER_WRITE_ID,
            op: SendOp::RdmaWrite { remote_addr: theirs.addr, rkey: theirs.rkey },
            sg_list: core::slice::from_ref(&ws),
            flags: SendFlags::SIGNALED,
            inline: None,
            ud: None,
        },
        SendWr {
            wr_id: PEER_SEND_ID,
            op: SendOp::Send,
            sg_list: core::slice::from_ref(&ss),
            flags: SendFlags::SIGNALED,
            inline: None,
            ud: None,
        },
    ];
    hca.post_send(qp, &wrs).map_err(|error| RunError::Post { what: "send queue", error })?;
    let c = one_completion(hca, cq, qp, w, round, delay)?;
    expect(&c, 0, PEER_WRITE_ID, WcOpcode::RdmaWrite, PEER_MSG as u32)?;
    let c = one_completion(hca, cq, qp, w, round, delay)?;
    expect(&c, 1, PEER_SEND_ID, WcOpcode::Send, PEER_MSG as u32)
}

/// The other side's round: its SEND's receive completion, then the received bytes and the area its RDMA WRITE
/// filled, every byte checked (`sender_first`: whether the sender is the side that sends first).
#[allow(clippy::too_many_arguments)]
fn receive_round<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    buf: &DmaRegion,
    cq: &mut Cq,
    qp: &mut Qp,
    round: u32,
    sender_first: bool,
    w: &mut Waiter,
    delay: &mut impl DelayNs,
) -> Result<(), RunError> {
    let c = one_completion(hca, cq, qp, w, round, delay)?;
    expect(&c, 2, PEER_RECV_ID, WcOpcode::Recv, PEER_MSG as u32)?;
    for (transfer, off, write) in [(0, RECV_DST, false), (1, WRITE_DST, true)] {
        let p = buf.ptr_at(off, PEER_MSG);
        // SAFETY: the area lies inside the live buffer (ptr_at checked it); the receive completed, and the RDMA
        // WRITE the other side posted before its SEND landed before it (RC order), so nothing writes it until
        // this side answers; the poll ordered the CQE read before these loads.
        let area = unsafe { core::slice::from_raw_parts(p, PEER_MSG) };
        for (offset, &got) in area.iter().enumerate() {
            let expected = peer_byte(round, sender_first, write, offset);
            if got != expected {
                return Err(RunError::Data { transfer, offset, expected, got });
            }
        }
    }
    Ok(())
}

//! The two-process wire soak (`soak --wire`): this process (the survivor) drives RC traffic over the verbs API to
//! a simulated device in a child process (the peer, `soak --wire-peer ADDR`), the two devices joined by the
//! simulated wire over TCP on 127.0.0.1, both with threaded firmware (retry timers in real time). Mid-run the
//! peer is killed (SIGKILL) with work outstanding, then a new peer is started and a new QP connected to it. The
//! peer may have answered everything outstanding before the signal lands, so one SEND is posted once it is
//! reaped: every kill leaves work that only the QP's retry budget can end.
//!
//! Checked, per session: every posted wr_id completes exactly once (a ledger); before the kill every completion
//! is a success and every RDMA READ returns what the WRITE before it put there; after the kill the survivor's
//! outstanding requests end with `RETRY_EXC_ERR` or `WR_FLUSH_ERR` (or success, for what the peer answered before
//! it died), all within the QP's retry budget; the peer checks every SEND it received (length and bytes, named
//! by the immediate) and exits with a failure otherwise; the last session ends cleanly and the peer must exit 0.
//! At the end every object is destroyed and the survivor's device must hold no DMA memory.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mlx5_sim::{Mode, SimConfig, SimDevice};
use mlx5_verbs::wr;
use mlx5_verbs::{
    Access, Context, InitAttr, QpCap, QpType, RemoteBuf, RemoteQp, RtrAttr, RtsAttr, WcStatus, WorkCompletion,
};

use crate::{mix, pattern_byte_chunks, Rng};

/// The ACK timeout exponent and retry count the survivor's QPs use (rc_pingpong's: 4.096 us << 14 = 67 ms,
/// 7 retries), so the retry budget is 8 × 67 ms.
const ACK_TIMEOUT: u8 = 14;
const RETRY_CNT: u8 = 7;
/// What the budget may be exceeded by: scheduling on a loaded two-CPU machine, and the poll loop's sleeps.
const BUDGET_SLACK: Duration = Duration::from_millis(1500);
/// How long the peer may take to come up and name its QP, and a clean end to be confirmed.
const PEER_WAIT: Duration = Duration::from_secs(30);
/// Requests outstanding at most (the peer keeps more receives posted than this, so no RNR).
const DEPTH: usize = 32;
/// Receives the peer keeps posted.
const PEER_RECVS: usize = 128;
/// Bytes per slot of either side's buffer: the largest message.
const SLOT: usize = 2048;
/// Slots of the survivor's buffer for outgoing data and READ landing areas, and of the peer's for WRITE targets.
const SLOTS: usize = 64;

/// How a wire run is sized.
#[derive(Debug, Clone)]
pub struct WireOptions {
    /// Work requests to post in total.
    pub ops: u64,
    pub seed: u64,
    /// Peers killed (and restarted) during the run; the run has `kills + 1` sessions.
    pub kills: u32,
    /// `--loss PCT`: the two processes on a VDE fabric, `wirefilter` between them losing PCT % of the frames.
    pub loss: Option<u32>,
}

/// What a wire run saw.
#[derive(Debug, Default, Clone)]
pub struct WireReport {
    pub seed: u64,
    pub sessions: u32,
    pub kills: u32,
    /// Kills that found every outstanding request answered already, so the SEND posted after the kill was the
    /// one to fail with retry-exceeded.
    pub answered_at_kill: u32,
    pub ops: u64,
    pub completions: HashMap<&'static str, u64>,
    pub lost: u64,
    pub duplicated: u64,
    pub data_mismatches: u64,
    /// Errors before a kill, or after it of a kind other than retry-exceeded and flush.
    pub unexpected: u64,
    /// Drains after a kill that took longer than the retry budget (plus slack).
    pub over_budget: u64,
    /// The longest drain after a kill, in ms, and the budget.
    pub max_drain_ms: u64,
    /// Every drain after a kill, in ms (for the median and the 99th percentile).
    pub drains_ms: Vec<u64>,
    pub budget_ms: u64,
    /// `--loss`: the loss wirefilter applied, and the survivor's recoveries from the device's event log (which
    /// keeps its last events only, so these are lower bounds): retransmissions (after an ACK timeout or a sequence
    /// NAK; RNR retries too) and sequence NAKs it received.
    pub loss_pct: Option<u32>,
    pub retries: u64,
    pub sequence_naks: u64,
    /// What the longest drain waited for: its session, the time from the kill to the first error completion
    /// (the device's retries running out), the time to the last completion, and the longest gap between two
    /// polls of the survivor's loop (its own thread descheduled or stalled), all in ms.
    pub longest_drain: Option<serde_json::Value>,
    /// Peers that failed on their own (a data mismatch they saw, an error, a non-zero exit at a clean end).
    pub peer_failures: u64,
    pub hangs: u64,
    pub leaked_dma_regions: u64,
    pub leaked_dma_bytes: u64,
    pub elapsed_s: f64,
    pub problems: Vec<String>,
}

impl WireReport {
    fn problem(&mut self, s: String) {
        if self.problems.len() < 20 {
            self.problems.push(s);
        }
    }

    /// Whether every invariant held.
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.data_mismatches == 0
            && self.unexpected == 0
            && self.over_budget == 0
            && self.peer_failures == 0
            && self.hangs == 0
            && self.leaked_dma_regions == 0
            && self.leaked_dma_bytes == 0
            && self.problems.is_empty()
    }

    pub fn to_json(&self) -> serde_json::Value {
        let mut completions: Vec<_> = self.completions.iter().collect();
        completions.sort();
        serde_json::json!({
            "mode": "wire",
            "seed": self.seed,
            "ok": self.ok(),
            "sessions": self.sessions,
            "kills": self.kills,
            "answered_at_kill": self.answered_at_kill,
            "ops": self.ops,
            "completions": completions.into_iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect::<serde_json::Map<_, _>>(),
            "lost": self.lost,
            "duplicated": self.duplicated,
            "data_mismatches": self.data_mismatches,
            "unexpected": self.unexpected,
            "over_budget": self.over_budget,
            "max_drain_ms": self.max_drain_ms,
            "drain_ms_p50": self.drain_percentile(50),
            "drain_ms_p99": self.drain_percentile(99),
            "budget_ms": self.budget_ms,
            "loss_pct": self.loss_pct,
            "retries": self.retries,
            "sequence_naks": self.sequence_naks,
            "longest_drain": self.longest_drain,
            "peer_failures": self.peer_failures,
            "hangs": self.hangs,
            "leaked_dma_regions": self.leaked_dma_regions,
            "leaked_dma_bytes": self.leaked_dma_bytes,
            "elapsed_s": self.elapsed_s,
            "ops_per_s": if self.elapsed_s > 0.0 { self.ops as f64 / self.elapsed_s } else { 0.0 },
            "problems": self.problems,
        })
    }

    /// The `p`th percentile of the drains after a kill, in ms (0 without kills).
    pub fn drain_percentile(&self, p: usize) -> u64 {
        let mut d = self.drains_ms.clone();
        d.sort_unstable();
        d.get((d.len() * p / 100).min(d.len().saturating_sub(1))).copied().unwrap_or(0)
    }

    pub fn render(&self) -> String {
        let mut completions: Vec<_> = self.completions.iter().map(|(k, v)| format!("{k} {v}")).collect();
        completions.sort();
        let mut s = match self.loss_pct {
            Some(l) => format!(
                "VDE fabric, wirefilter losing {l} %: at least {} retransmissions and {} sequence NAKs recovered\n",
                self.retries, self.sequence_naks
            ),
            None => String::new(),
        };
        s += &format!(
            "wire soak, seed {}: {} ops in {} sessions ({} peers killed, {} with everything answered) in {:.1} s\n\
             completions: {}\n\
             drain after a kill: median {} ms, 99th percentile {} ms, longest {} ms (budget {} ms)\n\
             lost {}, duplicated {}, data mismatches {}, unexpected {}, over budget {}, peer failures {}, hangs {}, \
             leaked DMA {} regions / {} bytes\n",
            self.seed,
            self.ops,
            self.sessions,
            self.kills,
            self.answered_at_kill,
            self.elapsed_s,
            completions.join(", "),
            self.drain_percentile(50),
            self.drain_percentile(99),
            self.max_drain_ms,
            self.budget_ms,
            self.lost,
            self.duplicated,
            self.data_mismatches,
            self.unexpected,
            self.over_budget,
            self.peer_failures,
            self.hangs,
            self.leaked_dma_regions,
            self.leaked_dma_bytes,
        );
        for p in &self.problems {
            s.push_str(&format!("problem: {p}\n"));
        }
        s.push_str(if self.ok() { "invariants hold\n" } else { "INVARIANTS VIOLATED\n" });
        s
    }
}

/// `ib_wc_status` names, for the report.
fn status_name(s: WcStatus) -> &'static str {
    match s {
        WcStatus::Success => "success",
        WcStatus::WrFlushErr => "wr_flush_err",
        WcStatus::RetryExcErr => "retry_exc_err",
        WcStatus::RnrRetryExcErr => "rnr_retry_exc_err",
        WcStatus::RemAccessErr => "rem_access_err",
        WcStatus::LocLenErr => "loc_len_err",
        WcStatus::LocQpOpErr => "loc_qp_op_err",
        WcStatus::LocProtErr => "loc_prot_err",
        WcStatus::RemInvReqErr => "rem_inv_req_err",
        WcStatus::RemOpErr => "rem_op_err",
        _ => "other_error",
    }
}

/// One side's address line: `QPN LID GID RKEY ADDR`, the numbers in hex.
fn addr_line(me: &RemoteQp, at: RemoteBuf) -> String {
    let gid: String = me.gid.iter().map(|b| format!("{b:02x}")).collect();
    format!("{:x} {:x} {gid} {:x} {:x}\n", me.qpn, me.lid, at.rkey, at.addr)
}

/// Parses an address line strictly; the error names what was wrong.
fn parse_addr_line(line: &str) -> Result<(RemoteQp, RemoteBuf), String> {
    let f: Vec<&str> = line.split_ascii_whitespace().collect();
    let [qpn, lid, gid, rkey, addr] = f.as_slice() else { return Err(format!("not an address line: {line:?}")) };
    let hex = |s: &str, bits: u32| {
        u64::from_str_radix(s, 16)
            .ok()
            .filter(|v| s.bytes().all(|b| b.is_ascii_hexdigit()) && (bits == 64 || *v >> bits == 0))
            .ok_or_else(|| format!("bad field {s:?} in {line:?}"))
    };
    if gid.len() != 32 || !gid.is_ascii() {
        return Err(format!("bad GID in {line:?}"));
    }
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = hex(&gid[2 * i..2 * i + 2], 8)? as u8;
    }
    let peer = RemoteQp {
        qpn: hex(qpn, 24)? as u32,
        psn: 0,
        lid: hex(lid, 16)? as u16,
        gid: g,
        mac: mlx5_verbs::mac_of_gid(&g),
    };
    Ok((peer, RemoteBuf { rkey: hex(rkey, 32)? as u32, addr: hex(addr, 64)? }))
}

/// The bytes of the message with immediate `imm`: both sides compute them.
fn payload(seed: u64, imm: u32, len: usize) -> Vec<u8> {
    pattern_byte_chunks(seed, u64::from(imm), len).take(len).collect()
}

/// The length of SEND `imm`, 1 to `SLOT` bytes.
fn send_len(seed: u64, imm: u32) -> usize {
    1 + (mix(seed ^ u64::from(imm) ^ 0x5e4d) % SLOT as u64) as usize
}

/// The peer's role: connect to `addr`, name its QP on standard output, take the survivor's from standard input,
/// then keep receives posted and check every SEND until killed, or until standard input closes (a clean end,
/// exit 0). Any error or mismatch is one line on standard error and exit 3.
pub fn peer_main(addr: &str, seed: u64) -> ExitCode {
    match peer(addr, seed) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("soak peer: {e}");
            ExitCode::from(3)
        }
    }
}

fn peer(addr: &str, seed: u64) -> Result<(), String> {
    let v = |what: &'static str| move |e: mlx5_verbs::VerbsError| format!("{what}: {e}");
    let dev = SimDevice::new(SimConfig { mode: Mode::Threaded, ..SimConfig::default() }.next_host());
    // The survivor's link may still be noticing the previous peer's death: retry until it takes this one.
    let end = Instant::now() + PEER_WAIT;
    // `--loss`: the address is the VDE fabric's URL (the far side of the wirefilter).
    while addr.starts_with("vde://") {
        match dev.vde_plug(Some(addr)) {
            Ok(()) => break,
            Err(e) if Instant::now() < end => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("cannot plug into the fabric at {addr}: {e}")),
        }
    }
    while !addr.starts_with("vde://") {
        match dev.wire_connect(addr, Duration::from_secs(1)) {
            Ok(()) => break,
            Err(e) if Instant::now() < end => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("cannot plug into the wire at {addr}: {e}")),
        }
    }
    let ctx = Context::open_sim_device(dev).map_err(v("open the device"))?;
    let pd = ctx.alloc_pd().map_err(v("alloc PD"))?;
    let cq = ctx.create_cq(2 * PEER_RECVS as u32).map_err(v("create CQ"))?;
    let mut buf = ctx.alloc_buffer((PEER_RECVS + SLOTS) * SLOT).map_err(v("allocate"))?;
    let mr = pd
        .register(&mut buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
        .map_err(v("register"))?;
    let cap =
        QpCap { max_send_wr: 1, max_recv_wr: PEER_RECVS as u32, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap).map_err(v("create QP"))?;
    let qp = qp.to_init(InitAttr::rc(Access::REMOTE_WRITE | Access::REMOTE_READ)).map_err(|e| e.error.to_string())?;
    for i in 0..PEER_RECVS {
        qp.post_recv(&[wr::recv(i as u64, &[mr.sge(i * SLOT, SLOT as u32)])]).map_err(v("post receive"))?;
    }
    let me = ctx.remote_qp(&qp).map_err(v("query port"))?;
    let mut out = std::io::stdout().lock();
    out.write_all(addr_line(&me, mr.remote(PEER_RECVS * SLOT)).as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| format!("cannot name the QP to the survivor: {e}"))?;
    // Standard input: the survivor's address line, then nothing until it closes (the clean end).
    let (tx, rx) = mpsc::channel::<Option<String>>();
    std::thread::spawn(move || {
        let mut lines = std::io::stdin().lock().lines();
        let _ = tx.send(lines.next().and_then(Result::ok));
        for _ in lines.by_ref() {}
        let _ = tx.send(None);
    });
    let line = rx.recv_timeout(PEER_WAIT).ok().flatten().ok_or("no address from the survivor")?;
    let (survivor, _) = parse_addr_line(&line)?;
    let qp = qp
        .to_rtr(RtrAttr::rc(survivor).max_dest_rd_atomic(16))
        .map_err(|e| e.error.to_string())?
        .to_rts(RtsAttr::rc(0).max_rd_atomic(16))
        .map_err(|e| e.error.to_string())?;
    let mut wc = vec![WorkCompletion::default(); 32];
    let mut got = 0u64;
    loop {
        let n = cq.poll(&mut wc).map_err(v("poll"))?;
        for c in &wc[..n] {
            if c.status != WcStatus::Success {
                return Err(format!("receive {} completed with {:?} after {got} messages", c.wr_id, c.status));
            }
            let imm = u32::from_be(c.imm_data);
            let len = send_len(seed, imm);
            let slot = usize::try_from(c.wr_id).ok().filter(|&s| s < PEER_RECVS).ok_or("a receive nobody posted")?;
            if c.byte_len as usize != len || mr.read_vec(slot * SLOT, len) != payload(seed, imm, len) {
                return Err(format!("SEND {imm:#x}: {} bytes received, data differ from what was sent", c.byte_len));
            }
            got += 1;
            qp.post_recv(&[wr::recv(c.wr_id, &[mr.sge(slot * SLOT, SLOT as u32)])]).map_err(v("post receive"))?;
        }
        match rx.try_recv() {
            Ok(None) | Err(mpsc::TryRecvError::Disconnected) => break,
            _ => {}
        }
        if n == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    qp.destroy().map_err(v("destroy QP"))?;
    mr.destroy().map_err(v("deregister"))?;
    cq.destroy().map_err(v("destroy CQ"))?;
    pd.destroy().map_err(v("dealloc PD"))?;
    Ok(())
}

/// What a posted request was, to check its completion.
#[derive(Debug, Clone, Copy)]
enum Posted {
    Send,
    Write,
    /// A READ into landing slot `slot` of what WRITE `tag` put there.
    Read {
        slot: usize,
        tag: u64,
        len: usize,
    },
}

/// A peer process and its pipes.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Peer {
    fn spawn(exe: &Path, addr: &str, seed: u64) -> Result<(Self, mpsc::Receiver<String>), String> {
        let mut child = Command::new(exe)
            .args(["--wire-peer", addr, "--seed", &seed.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the peer {}: {e}", exe.display()))?;
        let stdout = child.stdout.take().ok_or("the peer has no standard output")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        Ok((Peer { child, stdin }, rx))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // A peer is never left running: killed and reaped (an error means it already exited).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the survivor side with the peer binary `exe` (this soak binary).
pub fn run_wire(opts: &WireOptions, exe: &Path) -> WireReport {
    let start = Instant::now();
    let mut rep = WireReport { seed: opts.seed, ..WireReport::default() };
    let budget = Duration::from_nanos(4096 << ACK_TIMEOUT) * (u32::from(RETRY_CNT) + 1);
    rep.budget_ms = budget.as_millis() as u64;
    let dev = SimDevice::new(SimConfig { mode: Mode::Threaded, ..SimConfig::default() });
    let watch = dev.clone();
    if let Err(e) = survivor(opts, exe, dev, &mut rep, budget) {
        rep.problem(e);
    }
    if opts.loss.is_some() {
        rep.loss_pct = opts.loss;
        let events = watch.events();
        let count = |f: fn(&mlx5_sim::SimEvent) -> bool| events.iter().filter(|e| f(e)).count() as u64;
        rep.retries = count(|e| matches!(e, mlx5_sim::SimEvent::Retry { .. }));
        rep.sequence_naks = count(|e| matches!(e, mlx5_sim::SimEvent::PsnSequenceNak { .. }));
    }
    // Every context and object is gone: the device must hold no DMA memory.
    let (regions, bytes) = watch.dma_outstanding();
    rep.leaked_dma_regions = regions as u64;
    rep.leaked_dma_bytes = bytes as u64;
    rep.elapsed_s = start.elapsed().as_secs_f64();
    rep
}

fn survivor(
    opts: &WireOptions,
    exe: &Path,
    dev: SimDevice,
    rep: &mut WireReport,
    budget: Duration,
) -> Result<(), String> {
    let v = |what: &'static str| move |e: mlx5_verbs::VerbsError| format!("{what}: {e}");
    let _fabric;
    let at = match opts.loss {
        None => dev.wire_listen("127.0.0.1:0").map_err(|e| e.to_string())?.to_string(),
        Some(pct) => {
            let f = Fabric::start(pct)?;
            dev.vde_plug(Some(&format!("vde://{}", f.dirs[0].display()))).map_err(|e| e.to_string())?;
            let peer_side = format!("vde://{}", f.dirs[1].display());
            _fabric = f;
            peer_side
        }
    };
    let ctx = Context::open_sim_device(dev).map_err(v("open the device"))?;
    let pd = ctx.alloc_pd().map_err(v("alloc PD"))?;
    let cq = ctx.create_cq(4 * DEPTH as u32).map_err(v("create CQ"))?;
    // Outgoing data in the first half, READ landing areas in the second.
    let mut buf = ctx.alloc_buffer(2 * SLOTS * SLOT).map_err(v("allocate"))?;
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).map_err(v("register"))?;
    let mut rng = Rng::new(opts.seed);
    let sessions = u64::from(opts.kills) + 1;
    let mut next_wr = 1u64;
    let mut wc = vec![WorkCompletion::default(); 32];
    for session in 0..sessions {
        let last = session + 1 == sessions;
        // A WRITE and its READ post together, so the count may pass the total by one.
        let quota = opts.ops.saturating_sub(rep.ops) / (sessions - session);
        // The kill lands somewhere in the session's second half, with work outstanding.
        let kill_at = if last { u64::MAX } else { quota / 2 + rng.below(quota / 2 + 1) };
        let (mut peer, lines) = Peer::spawn(exe, &at, opts.seed)?;
        rep.sessions += 1;
        let line = lines.recv_timeout(PEER_WAIT).map_err(|_| {
            rep.hangs += 1;
            format!("session {session}: the peer did not name its QP within {PEER_WAIT:?}")
        })?;
        let (remote, target) = parse_addr_line(&line)?;
        let qp = pd
            .create_qp(
                QpType::Rc,
                &cq,
                &cq,
                QpCap {
                    max_send_wr: 2 * DEPTH as u32,
                    max_recv_wr: 1,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
            )
            .map_err(v("create QP"))?;
        let me = ctx.remote_qp(&qp).map_err(v("query port"))?;
        let qp = qp
            .to_init(InitAttr::rc(Access::default()))
            .map_err(|e| e.error.to_string())?
            .to_rtr(RtrAttr::rc(remote).max_dest_rd_atomic(16))
            .map_err(|e| e.error.to_string())?
            .to_rts(RtsAttr::rc(0).retry(RETRY_CNT, 7).max_rd_atomic(16))
            .map_err(|e| e.error.to_string())?;
        let stdin = peer.stdin.as_mut().ok_or("the peer has no standard input")?;
        stdin
            .write_all(addr_line(&me, mr.remote(0)).as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("cannot name our QP to the peer: {e}"))?;

        // A SEND with immediate `id` of the bytes both sides derive from it, from slot `slot`.
        let post_send = |id: u64, slot: usize| -> Result<(), String> {
            let imm = id as u32;
            let len = send_len(opts.seed, imm);
            mr.write(slot * SLOT, &payload(opts.seed, imm, len)).map_err(v("write"))?;
            qp.post_send(&[wr::send_imm(id, &[mr.sge(slot * SLOT, len as u32)], imm.to_be())]).map_err(v("post SEND"))
        };
        let mut ledger: HashMap<u64, Posted> = HashMap::new();
        // Slots in use by an outstanding request (outgoing data or a WRITE target and its READ landing area).
        let mut busy = [false; SLOTS];
        let mut slot_of: HashMap<u64, usize> = HashMap::new();
        let mut posted = 0u64;
        let mut killed_at: Option<Instant> = None;
        // The SEND posted after the kill.
        let mut after_kill: Option<u64> = None;
        let mut idle_since = Instant::now();
        // The drain's timeline: the first error completion after the kill, and the longest gap between polls.
        let mut first_error: Option<Duration> = None;
        let mut max_gap = Duration::ZERO;
        let mut last_poll = Instant::now();
        loop {
            let draining = killed_at.is_some() || posted >= quota;
            // Fill the queue each round, so a kill finds up to `DEPTH` requests outstanding.
            while !draining && posted < quota && ledger.len() + 2 <= DEPTH {
                let Some(slot) = (0..SLOTS).find(|&s| !busy[s]) else { break };
                {
                    let id = next_wr;
                    next_wr += 2;
                    if rng.one_in(2) {
                        post_send(id, slot)?;
                        ledger.insert(id, Posted::Send);
                        slot_of.insert(id, slot);
                        posted += 1;
                        rep.ops += 1;
                    } else {
                        // A WRITE of a fresh pattern to the peer's slot, and a READ of it back: RC executes them in
                        // order, so the READ must return the WRITE's bytes.
                        let len = 1 + rng.below(SLOT as u64) as usize;
                        let tag = mix(opts.seed ^ id);
                        let data: Vec<u8> = pattern_byte_chunks(opts.seed, tag, len).take(len).collect();
                        mr.write(slot * SLOT, &data).map_err(v("write"))?;
                        mr.write((SLOTS + slot) * SLOT, &vec![0u8; len]).map_err(v("write"))?;
                        let far = RemoteBuf { addr: target.addr + (slot * SLOT) as u64, rkey: target.rkey };
                        let src = [mr.sge(slot * SLOT, len as u32)];
                        let land = [mr.sge((SLOTS + slot) * SLOT, len as u32)];
                        qp.post_send(&[wr::rdma_write(id, &src, far), wr::rdma_read(id + 1, &land, far)])
                            .map_err(v("post WRITE and READ"))?;
                        ledger.insert(id, Posted::Write);
                        ledger.insert(id + 1, Posted::Read { slot, tag, len });
                        slot_of.insert(id + 1, slot);
                        posted += 2;
                        rep.ops += 2;
                    }
                    busy[slot] = true;
                }
            }
            if killed_at.is_none() && posted >= kill_at && !ledger.is_empty() {
                peer.child.kill().map_err(|e| format!("cannot kill the peer: {e}"))?;
                rep.kills += 1;
                // What is outstanding here may all have been answered before the signal landed (a loaded machine
                // shows it). One SEND posted once the peer is reaped cannot have been, so every kill leaves work
                // only the retry budget can end: the oldest unanswered request fails with retry-exceeded.
                peer.child.wait().map_err(|e| format!("cannot reap the killed peer: {e}"))?;
                // The drain is timed from here: the reap (a peer's exit tears down its whole simulated device, seconds
                // on a loaded machine; a fresh CI run saw 4.8 s) is the kernel's time, not the retry budget's.
                killed_at = Some(Instant::now());
                last_poll = Instant::now();
                let slot = (0..SLOTS).find(|&s| !busy[s]).ok_or("no free slot for the request after the kill")?;
                let id = next_wr;
                next_wr += 2;
                post_send(id, slot)?;
                ledger.insert(id, Posted::Send);
                slot_of.insert(id, slot);
                busy[slot] = true;
                after_kill = Some(id);
                rep.ops += 1;
            }
            let n = cq.poll(&mut wc).map_err(v("poll"))?;
            if killed_at.is_some() {
                max_gap = max_gap.max(last_poll.elapsed());
            }
            last_poll = Instant::now();
            for c in &wc[..n] {
                *rep.completions.entry(status_name(c.status)).or_default() += 1;
                let Some(what) = ledger.remove(&c.wr_id) else {
                    rep.duplicated += 1;
                    rep.problem(format!("session {session}: wr_id {} completed twice or never posted", c.wr_id));
                    continue;
                };
                if let Some(s) = slot_of.remove(&c.wr_id) {
                    busy[s] = false;
                }
                match (c.status, killed_at) {
                    (WcStatus::Success, _) => {
                        if let Posted::Read { slot, tag, len } = what {
                            let want: Vec<u8> = pattern_byte_chunks(opts.seed, tag, len).take(len).collect();
                            if mr.read_vec((SLOTS + slot) * SLOT, len) != want {
                                rep.data_mismatches += 1;
                                rep.problem(format!("session {session}: READ {} differs from its WRITE", c.wr_id));
                            }
                        }
                    }
                    (WcStatus::RetryExcErr | WcStatus::WrFlushErr, Some(t)) => {
                        if first_error.is_none() && c.status == WcStatus::RetryExcErr && after_kill == Some(c.wr_id) {
                            rep.answered_at_kill += 1;
                        }
                        first_error.get_or_insert_with(|| t.elapsed());
                    }
                    (s, _) => {
                        rep.unexpected += 1;
                        rep.problem(format!("session {session}: {what:?} {} completed with {s:?}", c.wr_id));
                    }
                }
            }
            if n > 0 {
                idle_since = Instant::now();
            }
            if let Some(t) = killed_at {
                if ledger.is_empty() {
                    let took = t.elapsed();
                    if rep.longest_drain.is_none() || took.as_millis() as u64 > rep.max_drain_ms {
                        rep.longest_drain = Some(serde_json::json!({
                            "session": session,
                            "drain_ms": took.as_millis() as u64,
                            "first_error_ms": first_error.map(|d| d.as_millis() as u64),
                            "max_poll_gap_ms": max_gap.as_millis() as u64,
                        }));
                    }
                    rep.max_drain_ms = rep.max_drain_ms.max(took.as_millis() as u64);
                    rep.drains_ms.push(took.as_millis() as u64);
                    if took > budget + BUDGET_SLACK {
                        rep.over_budget += 1;
                        rep.problem(format!(
                            "session {session}: the drain after the kill took {took:?} (first error after {first_error:?}, \
                             longest gap between polls {max_gap:?})"
                        ));
                    }
                    break;
                }
                if t.elapsed() > budget * 4 + PEER_WAIT {
                    rep.hangs += 1;
                    rep.lost += ledger.len() as u64;
                    rep.problem(format!("session {session}: {} requests never completed after the kill", ledger.len()));
                    break;
                }
            } else if draining && ledger.is_empty() {
                break;
            } else if idle_since.elapsed() > PEER_WAIT {
                rep.hangs += 1;
                rep.lost += ledger.len() as u64;
                rep.problem(format!("session {session}: no completion for {PEER_WAIT:?} with the peer alive"));
                break;
            }
            if n == 0 {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        qp.destroy().map_err(v("destroy QP"))?;
        if killed_at.is_none() {
            // The clean end: the peer checked every SEND and must exit 0 once its input closes.
            drop(peer.stdin.take());
            let end = Instant::now() + PEER_WAIT;
            let status = loop {
                match peer.child.try_wait() {
                    Ok(Some(s)) => break Some(s),
                    Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(10)),
                    _ => break None,
                }
            };
            match status {
                Some(s) if s.success() => {}
                Some(s) => {
                    rep.peer_failures += 1;
                    rep.problem(format!("session {session}: the peer exited with {s}"));
                }
                None => {
                    rep.hangs += 1;
                    rep.problem(format!("session {session}: the peer did not end within {PEER_WAIT:?}"));
                }
            }
        } else if let Ok(Some(s)) = peer.child.try_wait() {
            // Killed: anything but the kill means it failed first (a mismatch it saw).
            use std::os::unix::process::ExitStatusExt;
            if s.signal() != Some(9) {
                rep.peer_failures += 1;
                rep.problem(format!("session {session}: the peer ended with {s} before it was killed"));
            }
        }
        drop(peer);
    }
    mr.destroy().map_err(v("deregister"))?;
    cq.destroy().map_err(v("destroy CQ"))?;
    pd.destroy().map_err(v("dealloc PD"))?;
    Ok(())
}

/// `--loss`: two `vde_switch`es in a private directory, `wirefilter` between them losing a share of the frames,
/// duplicating 2 % and delaying each by 1-3 ms without FIFO order (so frames overtake each other); the survivor
/// plugs into the first, each peer into the second. Ended when dropped.
struct Fabric {
    dirs: [std::path::PathBuf; 2],
    pids: Vec<std::path::PathBuf>,
}

impl Fabric {
    fn start(loss_pct: u32) -> Result<Fabric, String> {
        let base = std::env::temp_dir().join(format!("mlx5-soak-vde-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).map_err(|e| e.to_string())?;
        let dirs = [base.join("a.vde"), base.join("b.vde")];
        let mut f = Fabric { dirs: dirs.clone(), pids: Vec::new() };
        let run = |c: &mut Command, what: &str| -> Result<(), String> {
            let ok = c.status().map_err(|e| format!("cannot run {what} (Debian: vde2): {e}"))?.success();
            if ok {
                Ok(())
            } else {
                Err(format!("{what} failed"))
            }
        };
        for d in &dirs {
            let pid = d.with_extension("pid");
            run(Command::new("vde_switch").arg("-s").arg(d).arg("-d").arg("-p").arg(&pid), "vde_switch")?;
            f.pids.push(pid);
        }
        let pid = base.join("wirefilter.pid");
        let plugs = format!("{}:{}", dirs[0].display(), dirs[1].display());
        run(
            Command::new("wirefilter")
                .args([
                    "-v",
                    &plugs,
                    "-l",
                    &loss_pct.to_string(),
                    "-D",
                    "2",
                    "-d",
                    "2+1",
                    "-N",
                    "--daemon",
                    "--pidfile",
                ])
                .arg(&pid),
            "wirefilter",
        )?;
        f.pids.push(pid);
        Ok(f)
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        for p in &self.pids {
            if let Some(pid) = std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()) {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        }
        if let Some(base) = self.dirs[0].parent() {
            let _ = std::fs::remove_dir_all(base);
        }
    }
}

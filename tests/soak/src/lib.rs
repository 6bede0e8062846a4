//! The fault-injection soak (`cargo xtask soak --ops N --seed S`): random traffic between two simulated
//! ConnectX devices joined by a wire, driven through `mlx5-core` directly, while the simulator injects faults at
//! random, and the invariants checked throughout.
//!
//! A run is a series of epochs, each on a fresh device pair: bring-up, a protection domain and one registered
//! buffer per device, CQs (three large ones and one of eight entries), three RC pairs and one UD pair; then random
//! work requests (SEND, SEND with immediate, RDMA WRITE, WRITE with immediate, READ, compare-and-swap, fetch-and-add;
//! receives), polls, event drains and health ticks, with faults injected among them; then either a clean end
//! (every QP moved to ERR and drained) or a terminal fault (health syndrome, frozen heartbeat or device gone, on its
//! own or hit by a command) with work outstanding; then teardown and the leak checks. Everything derives from the
//! seed, so a run repeats exactly.
//!
//! Invariants, counted in the [`Report`]: every posted work request completes exactly once, successfully or with
//! an error or flush status (`lost`, `duplicated`); what arrives is what was sent (receive buffers, WRITE targets,
//! READ results, atomic originals, immediates, lengths: `data_mismatches`); no status the faults injected cannot
//! explain, and every API error typed as the fault predicts (`unexpected`); no panic; no wait without a bound
//! (`hangs`); after teardown no DMA allocation and no firmware page outstanding; the device never touched memory
//! that was not live and the driver never freed memory firmware owned.

pub mod wire;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use embedded_hal::delay::DelayNs;
use mlx5_core::cmdq::CmdError;
use mlx5_core::cq::{Cq, LinkLayer, WcFlags, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::{Dma, DmaRegion, DmaView};
use mlx5_core::hca::{AsyncEvent, CqAttr, Pd, QpInitAttr};
use mlx5_core::hca::{Config, Error, Hca, HcaState};
use mlx5_core::health::HealthFailure;
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::prm::{consts, CmdStatus, DeliveryStatus};
use mlx5_core::qp::{
    required_attrs, Ah, AhAttr, Grh, Mtu, PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr,
    SendFlags, SendOp, SendWr, Sge, UdDest,
};
use mlx5_sim::{Fault, Mode, PortType, SimConfig, SimDelay, SimDevice, SimDma, SimEvent, SimMmio};

type SimHca = Hca<SimMmio, SimDma>;

/// RC pairs per epoch; slot `NRC` of each device is its UD QP.
const NRC: usize = 3;
const UD_SLOT: usize = NRC;
const NSLOTS: usize = NRC + 1;
/// The RC pair whose four queues complete on the small CQs (the overrun candidate).
const SMALL_PAIR: usize = 0;
/// CQs per device: `NBIG` large ones, then the small one.
const NBIG: usize = 3;
const SMALL_CQ: usize = NBIG;
/// 256 entries: more than every queue that can complete on it holds (six queues of `DEPTH`).
const BIG_CQE: u32 = 255;
/// 8 entries: the soak keeps the small pair within it, except when it overruns it on purpose.
const SMALL_CQE: u32 = 7;
/// Work requests per queue.
const DEPTH: u32 = 16;
/// Buffers per queue and purpose, used round robin: twice `DEPTH`, so a buffer is reused only after the work
/// request that used it was polled (and checked).
const SLOTS: usize = 32;
const MAX_RC_MSG: usize = 2048;
const MAX_UD_MSG: usize = 1024;
/// A UD receive starts with the 40-byte GRH (zeros when the sender sent none).
const GRH_BYTES: usize = 40;
const MAX_INLINE: u32 = 128;
const QKEY: u32 = 0x1111_2222;
/// Per-slot memory layout (offsets inside a partition of `PART` bytes).
const SEND_OFF: usize = 0;
const SEND_STRIDE: usize = MAX_RC_MSG;
const RECV_OFF: usize = SEND_OFF + SLOTS * SEND_STRIDE;
const RECV_STRIDE: usize = 4096;
/// What the peer's WRITEs land in.
const WRITE_OFF: usize = RECV_OFF + SLOTS * RECV_STRIDE;
const LAND_OFF: usize = WRITE_OFF + SLOTS * MAX_RC_MSG;
/// What the peer's READs read (filled once per epoch).
const RSRC_OFF: usize = LAND_OFF + SLOTS * MAX_RC_MSG;
const RSRC_LEN: usize = 64 * 1024;
/// The peer's atomic target (one 8-byte word), then this QP's atomic results.
const ATOM_OFF: usize = RSRC_OFF + RSRC_LEN;
const ARES_OFF: usize = ATOM_OFF + 64;
const PART: usize = 512 * 1024;
const MEM: usize = NSLOTS * PART;
/// Command timeout in the soak (virtual time): long enough for a wait to notice a frozen heartbeat (three missed
/// health polls, 2 s apart), short enough that a hung command costs little.
const CMD_TIMEOUT_MS: u32 = 20_000;
/// The command timeout in threaded mode, where it is real time: long enough for any answer a loaded machine gives
/// (commands complete in microseconds), short enough that an unanswered command costs little of the run (each
/// hang waits this long, and the threaded soak is bound by such waits, not by CPU). Well above the three health
/// polls ([`THREADED_HEALTH_POLL_MS`] apart) that notice a frozen heartbeat, so a command that finds the firmware
/// dead reports that rather than a timeout.
const THREADED_CMD_TIMEOUT_MS: u32 = 500;
/// The health poll period of a waiting command in threaded mode (Linux's 2 s in virtual time). The heartbeat is
/// read from the device's clock, so a short period cannot see a live device as stalled.
const THREADED_HEALTH_POLL_MS: u32 = 50;
/// Commands that get no answer (hang, delivery failure) per epoch: each may leave a buffer with the HCA until
/// the function is disabled, and the HCA keeps eight.
const MAX_UNANSWERED: u32 = 2;
/// Bound on drain loops (polls of every CQ); reaching it is a hang.
const DRAIN_ROUNDS: usize = 20_000;
/// Problems kept verbatim in the report.
const MAX_PROBLEMS: usize = 20;

// ---------------------------------------------------------------------------------------------------------------
// Determinism

/// SplitMix64: a tiny, fast generator; the whole soak derives from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// The bytes a work request carries: a stream derived from the run's seed and a tag (the wr_id), so whoever
/// receives them can tell whether they are intact.
fn pattern_byte_chunks(seed: u64, tag: u64, len: usize) -> impl Iterator<Item = u8> {
    let base = mix(seed ^ mix(tag));
    (0..len.div_ceil(8) as u64).flat_map(move |i| mix(base ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes())
}

// ---------------------------------------------------------------------------------------------------------------
// The report

/// What a run saw and whether every invariant held.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub seed: u64,
    /// Work requests posted (sends and receives).
    pub ops: u64,
    pub sends: u64,
    pub recvs: u64,
    pub epochs: u64,
    /// QP pairs (and CQs) torn down and rebuilt after an error.
    pub recoveries: u64,
    /// Posted work requests by opcode and transport.
    pub opcodes: BTreeMap<String, u64>,
    /// Faults injected, by kind.
    pub faults: BTreeMap<String, u64>,
    /// Wall-clock milliseconds spent from each kind of fault's injection to the check of its outcome (in threaded
    /// mode, where the waits are real: what bounds the run's speed).
    pub fault_ms: BTreeMap<String, u64>,
    /// Completions by status (`ib_wc_status` names).
    pub completions: BTreeMap<String, u64>,
    /// Flush completions the driver made itself (the device was dead or the CQ had failed). They carry the
    /// vendor syndrome `MLX5_CQE_SYNDROME_WR_FLUSH_ERR` exactly; the simulator marks its own with a vendor bit.
    pub software_flushes: u64,
    /// Work requests posted and never completed.
    pub lost: u64,
    /// Completions for a work request already completed or never posted.
    pub duplicated: u64,
    /// Completions whose data, length, opcode, immediate or QP differ from what was sent.
    pub data_mismatches: u64,
    pub leaked_dma_bytes: u64,
    pub leaked_dma_regions: u64,
    pub leaked_fw_pages: u64,
    pub panics: u64,
    /// Drains that reached their bound with work still outstanding.
    pub hangs: u64,
    /// Statuses and API results the injected faults do not explain.
    pub unexpected: u64,
    /// CQEs the driver refused (a well-behaved device never writes one).
    pub cqe_errors: u64,
    /// Device accesses to memory that was not live, frees of memory firmware owned, double frees.
    pub memory_faults: u64,
    /// The driver's count of firmware pages and the device's disagreed after the events were served.
    pub page_mismatches: u64,
    pub elapsed_s: f64,
    /// The first problems, described.
    pub problems: Vec<String>,
}

/// `ib_wc_status` as the kernel names it, lower case.
fn status_key(s: WcStatus) -> &'static str {
    match s {
        WcStatus::Success => "success",
        WcStatus::LocLenErr => "loc_len_err",
        WcStatus::LocQpOpErr => "loc_qp_op_err",
        WcStatus::LocEecOpErr => "loc_eec_op_err",
        WcStatus::LocProtErr => "loc_prot_err",
        WcStatus::WrFlushErr => "wr_flush_err",
        WcStatus::MwBindErr => "mw_bind_err",
        WcStatus::BadRespErr => "bad_resp_err",
        WcStatus::LocAccessErr => "loc_access_err",
        WcStatus::RemInvReqErr => "rem_inv_req_err",
        WcStatus::RemAccessErr => "rem_access_err",
        WcStatus::RemOpErr => "rem_op_err",
        WcStatus::RetryExcErr => "retry_exc_err",
        WcStatus::RnrRetryExcErr => "rnr_retry_exc_err",
        WcStatus::LocRddViolErr => "loc_rdd_viol_err",
        WcStatus::RemInvRdReqErr => "rem_inv_rd_req_err",
        WcStatus::RemAbortErr => "rem_abort_err",
        WcStatus::InvEecnErr => "inv_eecn_err",
        WcStatus::InvEecStateErr => "inv_eec_state_err",
        WcStatus::FatalErr => "fatal_err",
        WcStatus::RespTimeoutErr => "resp_timeout_err",
        WcStatus::GeneralErr => "general_err",
    }
}

impl Report {
    /// Every invariant held.
    pub fn ok(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.data_mismatches == 0
            && self.leaked_dma_bytes == 0
            && self.leaked_dma_regions == 0
            && self.leaked_fw_pages == 0
            && self.panics == 0
            && self.hangs == 0
            && self.unexpected == 0
            && self.cqe_errors == 0
            && self.memory_faults == 0
            && self.page_mismatches == 0
    }

    fn problem(&mut self, what: String) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(what);
        }
    }

    fn bump(map: &mut BTreeMap<String, u64>, key: &str) {
        *map.entry(key.to_string()).or_default() += 1;
    }

    pub fn ops_per_s(&self) -> f64 {
        if self.elapsed_s > 0.0 {
            self.ops as f64 / self.elapsed_s
        } else {
            0.0
        }
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok": self.ok(),
            "seed": self.seed,
            "ops": self.ops,
            "sends": self.sends,
            "recvs": self.recvs,
            "epochs": self.epochs,
            "recoveries": self.recoveries,
            "opcodes": self.opcodes,
            "faults": self.faults,
            "fault_ms": self.fault_ms,
            "completions": self.completions,
            "software_flushes": self.software_flushes,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "data_mismatches": self.data_mismatches,
            "leaked_dma_bytes": self.leaked_dma_bytes,
            "leaked_dma_regions": self.leaked_dma_regions,
            "leaked_fw_pages": self.leaked_fw_pages,
            "panics": self.panics,
            "hangs": self.hangs,
            "unexpected": self.unexpected,
            "cqe_errors": self.cqe_errors,
            "memory_faults": self.memory_faults,
            "page_mismatches": self.page_mismatches,
            "elapsed_s": self.elapsed_s,
            "ops_per_s": self.ops_per_s(),
            "problems": self.problems,
        })
    }

    /// The report as text.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ =
            writeln!(s, "soak: seed {}, {} ops ({} sends, {} receives)", self.seed, self.ops, self.sends, self.recvs);
        let _ = writeln!(
            s,
            "  {} epochs, {} recoveries, {:.1} s, {:.0} ops/s",
            self.epochs,
            self.recoveries,
            self.elapsed_s,
            self.ops_per_s()
        );
        let table = |s: &mut String, title: &str, m: &BTreeMap<String, u64>| {
            let _ = writeln!(s, "  {title}:");
            for (k, v) in m {
                let _ = writeln!(s, "    {k:<28} {v}");
            }
        };
        table(&mut s, "work requests by opcode", &self.opcodes);
        table(&mut s, "faults injected", &self.faults);
        table(&mut s, "time in each kind of fault (ms)", &self.fault_ms);
        table(&mut s, "completions by status", &self.completions);
        let _ = writeln!(s, "    {:<28} {}", "(of the flushes, by the driver)", self.software_flushes);
        let _ = writeln!(s, "  invariants:");
        for (k, v) in [
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("data_mismatches", self.data_mismatches),
            ("leaked_dma_bytes", self.leaked_dma_bytes),
            ("leaked_dma_regions", self.leaked_dma_regions),
            ("leaked_fw_pages", self.leaked_fw_pages),
            ("panics", self.panics),
            ("hangs", self.hangs),
            ("unexpected", self.unexpected),
            ("cqe_errors", self.cqe_errors),
            ("memory_faults", self.memory_faults),
            ("page_mismatches", self.page_mismatches),
        ] {
            let _ = writeln!(s, "    {k:<28} {v}");
        }
        for p in &self.problems {
            let _ = writeln!(s, "  problem: {p}");
        }
        let _ = writeln!(s, "  {}", if self.ok() { "all invariants held" } else { "INVARIANTS VIOLATED" });
        s
    }
}

/// How a run is sized.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Work requests to post in total.
    pub ops: u64,
    pub seed: u64,
    /// Print a progress line to standard error every this many ops (0: never).
    pub progress_every: u64,
    /// The simulated devices run threaded: firmware and datapath on worker threads, delays and timers in real
    /// time (SOAK.md lists what changes).
    pub threaded: bool,
}

/// Runs the soak: epochs on fresh device pairs until `opts.ops` work requests were posted.
pub fn run(opts: Options) -> Report {
    let start = Instant::now();
    let mut rep = Report { seed: opts.seed, ..Report::default() };
    let mut rng = Rng::new(opts.seed);
    let mut next_wr = 1u64;
    let mut next_progress = opts.progress_every;
    // Bounded: every epoch posts work or counts as a failed one, and failed epochs are capped.
    let mut failed_epochs = 0u32;
    while rep.ops < opts.ops && failed_epochs < 100 {
        let budget = (opts.ops - rep.ops).min(rng.range(2_000, 12_000));
        let epoch_seed = rng.next_u64();
        let before = rep.ops;
        let r = catch_unwind(AssertUnwindSafe(|| {
            let mut e = Epoch::new(opts, epoch_seed, &mut rep, next_wr)?;
            e.run(budget);
            next_wr = e.next_wr;
            Ok::<(), String>(())
        }));
        rep.epochs += 1;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                rep.unexpected += 1;
                rep.problem(format!("epoch {}: {why}", rep.epochs));
            }
            Err(p) => {
                rep.panics += 1;
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                rep.problem(format!("epoch {}: panic: {msg}", rep.epochs));
            }
        }
        if rep.ops == before {
            failed_epochs += 1;
        }
        if opts.progress_every > 0 && rep.ops >= next_progress {
            next_progress = rep.ops + opts.progress_every;
            eprintln!(
                "soak: {} ops, {} epochs, {:.0} s, {}",
                rep.ops,
                rep.epochs,
                start.elapsed().as_secs_f64(),
                if rep.ok() { "invariants hold" } else { "INVARIANTS VIOLATED" }
            );
        }
    }
    rep.elapsed_s = start.elapsed().as_secs_f64();
    rep
}

// ---------------------------------------------------------------------------------------------------------------
// An epoch

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Recv,
    Send,
    SendImm,
    Write,
    WriteImm,
    Read,
    CmpSwap,
    FetchAdd,
}

impl Op {
    fn consumes_recv(self) -> bool {
        matches!(self, Op::Send | Op::SendImm | Op::WriteImm)
    }
    fn name(self) -> &'static str {
        match self {
            Op::Recv => "recv",
            Op::Send => "send",
            Op::SendImm => "send_imm",
            Op::Write => "rdma_write",
            Op::WriteImm => "rdma_write_imm",
            Op::Read => "rdma_read",
            Op::CmpSwap => "atomic_cmp_swap",
            Op::FetchAdd => "atomic_fetch_add",
        }
    }
}

/// One posted work request, until its completion.
#[derive(Debug, Clone, Copy)]
struct Wr {
    node: usize,
    slot: usize,
    qpn: u32,
    op: Op,
    len: u32,
    /// Offset in the poster's memory: its receive buffer, READ landing or atomic result.
    local: usize,
    /// Offset in the peer's memory: the WRITE target or READ source.
    remote: usize,
    compare: u64,
    swap_add: u64,
    /// The error status a fault made certain (a bad rkey, a starved receiver); `None`: success.
    expect: Option<WcStatus>,
}

/// A message on its way to a QP's receive queue, in the order the peer posted them.
#[derive(Debug, Clone, Copy)]
struct Msg {
    wr_id: u64,
    op: Op,
    len: u32,
    imm: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Ready,
    /// An error was seen: the pair is rebuilt at the next chance.
    Broken,
    /// Could not be rebuilt; no more traffic this epoch.
    Dead,
}

#[derive(Debug)]
struct QpSlot {
    qp: Option<Qp>,
    ty: QpType,
    scq: usize,
    rcq: usize,
    state: SlotState,
    /// A fault touched this QP or its peer: error and flush statuses are explained.
    faulted: bool,
    sig_all: bool,
    rnr_retry: u8,
    /// Receives posted and receive-consuming messages sent since the QP was created (the credit count).
    rq_posted: u64,
    consumers_sent: u64,
    /// No receives are posted here until the pair is rebuilt (the RNR fault).
    starved: bool,
    expect: VecDeque<Msg>,
    send_rr: usize,
    recv_rr: usize,
    write_rr: usize,
    land_rr: usize,
    ares_rr: usize,
    /// The value of this QP's atomic target at the peer, when known.
    atomic_model: Option<u64>,
    /// QP fatal events injected for this QP and not yet seen.
    fatal_pending: u32,
}

impl QpSlot {
    fn new(ty: QpType, scq: usize, rcq: usize, sig_all: bool, rnr_retry: u8) -> Self {
        QpSlot {
            qp: None,
            ty,
            scq,
            rcq,
            state: SlotState::Ready,
            faulted: false,
            sig_all,
            rnr_retry,
            rq_posted: 0,
            consumers_sent: 0,
            starved: false,
            expect: VecDeque::new(),
            send_rr: 0,
            recv_rr: 0,
            write_rr: 0,
            land_rr: 0,
            ares_rr: 0,
            atomic_model: None,
            fatal_pending: 0,
        }
    }

    fn reset_traffic(&mut self) {
        self.rq_posted = 0;
        self.consumers_sent = 0;
        self.starved = false;
        self.expect.clear();
        self.fatal_pending = 0;
    }
}

#[derive(Debug)]
struct CqSlot {
    cq: Option<Cq>,
    cqe: u32,
    /// A CQ error event arrived: the device writes no more CQEs to it.
    failed: bool,
    /// Being overrun on purpose: not polled until its error event arrives.
    overrun: bool,
    /// Was overrun on purpose at some point: its error event is explained.
    overrun_tried: bool,
}

struct Node {
    dev: SimDevice,
    hca: Option<SimHca>,
    d: SimDelay,
    pd: Option<Pd>,
    /// The node's registered buffer; taken only to free it at teardown.
    mem: Option<DmaRegion>,
    mr: Option<Mr>,
    cqs: Vec<CqSlot>,
    qps: Vec<QpSlot>,
    /// How a peer reaches this device.
    addr: AhAttr,
    link: LinkLayer,
    /// The HCA is in internal error (the soak killed the device).
    dead: bool,
    /// Objects whose destroy failed, kept for a retry at teardown.
    leftover_qps: Vec<Qp>,
    leftover_cqs: Vec<Cq>,
}

impl Node {
    fn hca(&mut self) -> &mut SimHca {
        self.hca.as_mut().expect("the HCA lives until teardown")
    }
}

struct Epoch<'r> {
    seed: u64,
    /// Threaded devices (real time): command timeouts, health polls and delays are shorter.
    threaded: bool,
    rng: Rng,
    rep: &'r mut Report,
    nodes: Vec<Node>,
    ledger: HashMap<u64, Wr>,
    next_wr: u64,
    /// Commands left unanswered this epoch (hangs and delivery failures).
    unanswered: u32,
    /// The kind of the fault injected last (for `Report::fault_ms`).
    last_fault: Option<String>,
    scratch: Vec<u8>,
    wcs: Vec<WorkCompletion>,
}

/// A DMA read of the soak's own memory.
impl Node {
    /// The node's buffer (present from bring-up until teardown).
    fn mem(&self) -> DmaView<'_> {
        self.mem.as_ref().expect("buffer lives until teardown").view()
    }
}

fn read_mem(mem: &DmaView<'_>, off: usize, out: &mut [u8]) {
    assert!(off + out.len() <= mem.len());
    // SAFETY: the range is inside the live region (checked above); the device writes it only while a doorbell or a
    // delay runs it, never during this copy (in-line simulator, one thread).
    unsafe { std::ptr::copy_nonoverlapping(mem.cpu().as_ptr().add(off), out.as_mut_ptr(), out.len()) };
}

fn write_mem(mem: &DmaView<'_>, off: usize, data: &[u8]) {
    assert!(off + data.len() <= mem.len());
    // SAFETY: as in `read_mem`; no posted work request reads or writes these bytes while they are written (buffers
    // are reused only after their work request completed).
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), mem.cpu().as_ptr().add(off), data.len()) };
}

fn part(slot: usize) -> usize {
    slot * PART
}

impl<'r> Epoch<'r> {
    fn new(opts: Options, epoch_seed: u64, rep: &'r mut Report, next_wr: u64) -> Result<Self, String> {
        let (seed, threaded) = (opts.seed, opts.threaded);
        let mut rng = Rng::new(epoch_seed);
        let port_type = if rng.one_in(3) { PortType::Ib } else { PortType::Eth };
        let mode = if threaded { Mode::Threaded } else { Mode::Inline };
        let base = SimConfig { port_type, mode, ..SimConfig::default() };
        let second = base.next_host();
        let (da, db) = (SimDevice::new(base), SimDevice::new(second));
        da.connect(&db);
        let mut nodes = Vec::new();
        for dev in [da, db] {
            nodes.push(Self::bring_up(dev, &mut rng, threaded)?);
        }
        let mut e = Epoch {
            seed,
            threaded,
            rng,
            rep,
            nodes,
            ledger: HashMap::new(),
            next_wr,
            unanswered: 0,
            last_fault: None,
            scratch: vec![0u8; MAX_RC_MSG + GRH_BYTES],
            wcs: vec![WorkCompletion::default(); 16],
        };
        e.build()?;
        Ok(e)
    }

    fn bring_up(dev: SimDevice, rng: &mut Rng, threaded: bool) -> Result<Node, String> {
        let mut d = dev.delay();
        let cfg = if threaded {
            Config { health_poll_interval_ms: THREADED_HEALTH_POLL_MS, ..Config::default() }
        } else {
            Config::default()
        };
        let mut hca: SimHca =
            Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, cfg).map_err(|e| format!("bring-up: {e}"))?;
        hca.cmdq().set_timeout_ms(if threaded { THREADED_CMD_TIMEOUT_MS } else { CMD_TIMEOUT_MS });
        let pd = hca.alloc_pd(&mut d).map_err(|e| format!("alloc_pd: {e}"))?;
        let mem = dev.dma().alloc(MEM, 4096).map_err(|e| format!("memory: {e}"))?;
        let mr = hca.reg_mr(&pd, mem.cpu().as_ptr(), MEM, Access::ALL, &mut d).map_err(|e| format!("reg_mr: {e}"))?;
        let port = hca.query_port(&mut d).map_err(|e| format!("query_port: {e}"))?;
        let gid = hca.query_gid(0, &mut d).map_err(|e| format!("query_gid: {e}"))?;
        let link = port.link_layer;
        let addr = AhAttr {
            dlid: port.lid,
            grh: (link == LinkLayer::Ethernet || rng.one_in(2)).then_some(Grh {
                dgid: gid,
                hop_limit: 64,
                ..Grh::default()
            }),
            dmac: dev.config().mac,
            port_num: 1,
            ..AhAttr::default()
        };
        let mut cqs = Vec::new();
        for c in 0..=NBIG {
            let cqe = if c == SMALL_CQ { SMALL_CQE } else { BIG_CQE };
            cqs.push(CqSlot { cq: None, cqe, failed: false, overrun: false, overrun_tried: false });
        }
        let mut qps = Vec::new();
        for i in 0..NSLOTS {
            let (scq, rcq) = if i == SMALL_PAIR {
                (SMALL_CQ, SMALL_CQ)
            } else {
                (rng.below(NBIG as u64) as usize, rng.below(NBIG as u64) as usize)
            };
            let ty = if i == UD_SLOT { QpType::Ud } else { QpType::Rc };
            qps.push(QpSlot::new(ty, scq, rcq, rng.one_in(2), rng.range(0, 2) as u8));
        }
        Ok(Node {
            dev,
            hca: Some(hca),
            d,
            pd: Some(pd),
            mem: Some(mem),
            mr: Some(mr),
            cqs,
            qps,
            addr,
            link,
            dead: false,
            leftover_qps: Vec::new(),
            leftover_cqs: Vec::new(),
        })
    }

    /// CQs, QPs, connections and the memory each epoch starts from.
    fn build(&mut self) -> Result<(), String> {
        for x in 0..2 {
            for c in 0..=NBIG {
                self.create_cq(x, c).map_err(|e| format!("create_cq: {e}"))?;
            }
            for i in 0..NSLOTS {
                // Read sources and atomic targets start as known patterns.
                let tag = self.rng.next_u64();
                let src: Vec<u8> = pattern_byte_chunks(self.seed, tag, RSRC_LEN).take(RSRC_LEN).collect();
                let mem = self.nodes[x].mem();
                write_mem(&mem, part(i) + RSRC_OFF, &src);
                write_mem(&mem, part(i) + ATOM_OFF, &self.rng.next_u64().to_ne_bytes());
                self.create_qp(x, i).map_err(|e| format!("create_qp: {e}"))?;
            }
        }
        for i in 0..NSLOTS {
            self.connect(i).map_err(|e| format!("connect: {e}"))?;
        }
        Ok(())
    }

    fn create_cq(&mut self, x: usize, c: usize) -> Result<(), Error> {
        let n = &mut self.nodes[x];
        let cqe = n.cqs[c].cqe;
        let cq = n.hca.as_mut().expect("live HCA").create_cq(CqAttr { cqe, ..CqAttr::default() }, &mut n.d)?;
        n.cqs[c] = CqSlot { cq: Some(cq), cqe, failed: false, overrun: false, overrun_tried: false };
        Ok(())
    }

    fn qp_cap() -> QpCap {
        QpCap { max_send_wr: DEPTH, max_recv_wr: DEPTH, max_send_sge: 2, max_recv_sge: 1, max_inline_data: MAX_INLINE }
    }

    fn create_qp(&mut self, x: usize, i: usize) -> Result<(), Error> {
        let n = &mut self.nodes[x];
        let s = &n.qps[i];
        let attr = QpInitAttr { qp_type: s.ty, cap: Self::qp_cap(), sq_sig_all: s.sig_all };
        let (scq, rcq) = (s.scq, s.rcq);
        let Node { hca, pd, cqs, d, .. } = n;
        let hca = hca.as_mut().expect("live HCA");
        let (Some(pd), Some(sc), Some(rc)) = (pd.as_ref(), cqs[scq].cq.as_ref(), cqs[rcq].cq.as_ref()) else {
            return Err(Error::NotSupported { what: "a QP without its PD or CQs" });
        };
        let qp = hca.create_qp(pd, sc, rc, attr, d)?;
        n.qps[i].qp = Some(qp);
        Ok(())
    }

    /// Both ends of slot `i` to RTS, towards each other.
    fn connect(&mut self, i: usize) -> Result<(), Error> {
        for x in 0..2 {
            let y = 1 - x;
            let dest = self.nodes[y].qps[i].qp.as_ref().map(Qp::qpn).unwrap_or(0);
            let ah = self.nodes[y].addr;
            let n = &mut self.nodes[x];
            let rnr_retry = n.qps[i].rnr_retry;
            let Node { hca, qps, d, .. } = n;
            let hca = hca.as_mut().expect("live HCA");
            let Some(qp) = qps[i].qp.as_mut() else { continue };
            if qp.qp_type() == QpType::Rc {
                let a = QpAttr {
                    qp_access_flags: Access::REMOTE_READ
                        | Access::REMOTE_WRITE
                        | Access::REMOTE_ATOMIC
                        | Access::LOCAL_WRITE,
                    path_mtu: Mtu::M1024,
                    dest_qp_num: dest,
                    ah_attr: ah,
                    rnr_retry,
                    retry_cnt: 2,
                    // About 1 ms in virtual time; in real time (threaded) a thread descheduled for 3 ms would run a
                    // healthy QP out of retries, so there 67 ms.
                    timeout: if self.threaded { 14 } else { 8 },
                    min_rnr_timer: 1,
                    max_dest_rd_atomic: 4,
                    max_rd_atomic: 4,
                    ..QpAttr::default()
                };
                for (f, s) in
                    [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)]
                {
                    let m = required_attrs(QpType::Rc, f, s).unwrap_or(QpAttrMask::STATE);
                    hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, d)?;
                }
            } else {
                use QpAttrMask as M;
                let a = QpAttr { qkey: QKEY, ..QpAttr::default() };
                let init = M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY;
                hca.modify_qp(qp, &QpAttr { qp_state: QpState::Init, ..a }, init, d)?;
                hca.modify_qp(qp, &QpAttr { qp_state: QpState::Rtr, ..a }, M::STATE, d)?;
                hca.modify_qp(qp, &QpAttr { qp_state: QpState::Rts, ..a }, M::STATE | M::SQ_PSN, d)?;
            }
        }
        // Each side's atomic target at the other starts from what is in memory now (in host order: the bring-up
        // sets host-endian atomics).
        for x in 0..2 {
            let mut w = [0u8; 8];
            read_mem(&self.nodes[1 - x].mem(), part(i) + ATOM_OFF, &mut w);
            self.nodes[x].qps[i].atomic_model = Some(u64::from_ne_bytes(w));
        }
        Ok(())
    }

    fn problem(&mut self, what: String) {
        self.rep.problem(what);
    }

    fn unexpected(&mut self, what: String) {
        self.rep.unexpected += 1;
        self.problem(what);
    }

    fn fault(&mut self, kind: &str) {
        Report::bump(&mut self.rep.faults, kind);
        self.last_fault = Some(kind.to_string());
    }

    /// Runs `f`, which may inject a fault, and charges the time it took to that fault's kind.
    fn timed_fault(&mut self, f: impl FnOnce(&mut Self)) {
        self.last_fault = None;
        let t = Instant::now();
        f(self);
        if let Some(k) = self.last_fault.take() {
            *self.rep.fault_ms.entry(k).or_default() += t.elapsed().as_millis() as u64;
        }
    }

    // -- the epoch's course ----------------------------------------------------------------------------------

    fn run(&mut self, budget: u64) {
        let start_ops = self.rep.ops;
        // Most epochs end with the device dying under traffic; the rest end cleanly.
        let ending = self.rng.below(10);
        let terminal_at = start_ops + budget / 2 + self.rng.below(budget / 2 + 1);
        let mut steps = 0u64;
        let max_steps = budget * 20 + 1_000;
        while self.rep.ops < start_ops + budget && steps < max_steps {
            steps += 1;
            if ending < 7 && self.rep.ops >= terminal_at {
                self.timed_fault(|e| e.terminal(ending));
                self.teardown();
                return;
            }
            if self.rng.one_in(250) {
                self.timed_fault(Self::inject);
            }
            self.traffic();
            if self.rng.one_in(2) {
                let (x, c) = (self.rng.below(2) as usize, self.rng.below(NBIG as u64 + 1) as usize);
                self.poll(x, c);
            }
            if steps.is_multiple_of(16) {
                self.poll_all();
            }
            if steps.is_multiple_of(128) {
                self.serve_events();
            }
            if steps.is_multiple_of(1024) {
                self.health_tick();
            }
            self.repair();
        }
        if steps >= max_steps {
            self.rep.hangs += 1;
            self.problem(format!("epoch stuck after {steps} steps at {} of {budget} ops", self.rep.ops - start_ops));
        }
        self.close_clean();
        self.teardown();
    }

    // -- traffic ---------------------------------------------------------------------------------------------

    fn usable(&self, x: usize, i: usize) -> bool {
        let s = &self.nodes[x].qps[i];
        let p = &self.nodes[1 - x].qps[i];
        !self.nodes[x].dead
            && !self.nodes[1 - x].dead
            && s.state == SlotState::Ready
            && p.state == SlotState::Ready
            && s.qp.is_some()
            && p.qp.is_some()
            && !self.nodes[x].cqs[s.scq].overrun
            && !self.nodes[x].cqs[s.rcq].overrun
    }

    /// Outstanding work on the queues completing on CQ `c` of node `x`.
    fn cq_load(&self, x: usize, c: usize) -> u32 {
        self.nodes[x]
            .qps
            .iter()
            .filter_map(|s| s.qp.as_ref().map(|q| (s, q)))
            .map(|(s, q)| {
                (if s.scq == c { q.sq_outstanding() } else { 0 }) + (if s.rcq == c { q.rq_outstanding() } else { 0 })
            })
            .sum()
    }

    fn cq_room(&self, x: usize, c: usize) -> bool {
        self.cq_load(x, c) < self.nodes[x].cqs[c].cqe + 1
    }

    fn send_room(&self, x: usize, i: usize) -> bool {
        let s = &self.nodes[x].qps[i];
        s.qp.as_ref().is_some_and(|q| q.sq_outstanding() < DEPTH) && self.cq_room(x, s.scq)
    }

    fn recv_room(&self, x: usize, i: usize) -> bool {
        let s = &self.nodes[x].qps[i];
        !s.starved && s.qp.as_ref().is_some_and(|q| q.rq_outstanding() < DEPTH) && self.cq_room(x, s.rcq)
    }

    fn credit(&self, x: usize, i: usize) -> u64 {
        self.nodes[1 - x].qps[i].rq_posted.saturating_sub(self.nodes[x].qps[i].consumers_sent)
    }

    /// One random step of traffic: a receive, or a batch of one to three sends on one QP.
    fn traffic(&mut self) {
        let x = self.rng.below(2) as usize;
        let i = self.rng.below(NSLOTS as u64) as usize;
        if !self.usable(x, i) {
            return;
        }
        if self.rng.below(100) < 35 {
            if self.recv_room(x, i) {
                self.post_recv(x, i);
            } else {
                self.poll_all();
            }
            return;
        }
        let batch = if self.rng.one_in(4) { self.rng.range(2, 3) as usize } else { 1 };
        let mut ops = Vec::with_capacity(batch);
        let mut credit = self.credit(x, i);
        for _ in 0..batch {
            let op = if i == UD_SLOT {
                self.rng.pick(&[Op::Send, Op::SendImm])
            } else {
                self.rng.pick(&[
                    Op::Send,
                    Op::Send,
                    Op::SendImm,
                    Op::Write,
                    Op::WriteImm,
                    Op::Read,
                    Op::CmpSwap,
                    Op::FetchAdd,
                ])
            };
            if op.consumes_recv() {
                if credit == 0 {
                    break;
                }
                credit -= 1;
            }
            ops.push(op);
        }
        if ops.is_empty() {
            // No receive waits at the peer: post one there instead (or make room for one).
            if self.recv_room(1 - x, i) {
                self.post_recv(1 - x, i);
            } else {
                self.poll_all();
            }
            return;
        }
        self.post_sends(x, i, &ops, None);
    }

    fn new_wr_id(&mut self) -> u64 {
        let id = self.next_wr;
        self.next_wr += 1;
        id
    }

    fn post_recv(&mut self, x: usize, i: usize) {
        if !self.recv_room(x, i) {
            return;
        }
        let wr_id = self.new_wr_id();
        let n = &mut self.nodes[x];
        let base = n.mem().cpu().as_ptr() as u64;
        let s = &mut n.qps[i];
        let local = part(i) + RECV_OFF + (s.recv_rr % SLOTS) * RECV_STRIDE;
        s.recv_rr += 1;
        let sge =
            [Sge { addr: base + local as u64, length: RECV_STRIDE as u32, lkey: n.mr.as_ref().map_or(0, |m| m.lkey) }];
        let Some(qp) = s.qp.as_mut() else { return };
        let qpn = qp.qpn();
        match n.hca.as_ref().expect("live HCA").post_recv(qp, &[RecvWr { wr_id, sg_list: &sge }]) {
            Ok(()) => {
                s.rq_posted += 1;
                let wr = Wr {
                    node: x,
                    slot: i,
                    qpn,
                    op: Op::Recv,
                    len: 0,
                    local,
                    remote: 0,
                    compare: 0,
                    swap_add: 0,
                    expect: None,
                };
                self.ledger.insert(wr_id, wr);
                self.rep.ops += 1;
                self.rep.recvs += 1;
                Report::bump(&mut self.rep.opcodes, if i == UD_SLOT { "ud_recv" } else { "rc_recv" });
            }
            Err(e) => {
                let dead = n.dead;
                if !(dead && e.kind == PostErrorKind::DeviceError) {
                    self.unexpected(format!("post_recv on node {x} slot {i}: {e}"));
                }
            }
        }
    }

    /// Posts `ops` on QP `i` of node `x` in one call. `bad_rkey`: every remote operation uses this key instead
    /// (the remote-access fault) and is expected to fail with `REM_ACCESS_ERR`.
    fn post_sends(&mut self, x: usize, i: usize, ops: &[Op], bad_rkey: Option<u32>) -> usize {
        let y = 1 - x;
        let (peer_mem, peer_rkey, peer_qpn) = {
            let p = &self.nodes[y];
            (p.mem().cpu(), p.mr.as_ref().map_or(0, |m| m.rkey), p.qps[i].qp.as_ref().map_or(0, Qp::qpn))
        };
        let ud = i == UD_SLOT;
        let max_msg = if ud { MAX_UD_MSG } else { MAX_RC_MSG };
        // Everything each work request needs, decided before any borrow of the QP.
        struct Plan {
            wr_id: u64,
            wr: Wr,
            imm: u32,
            inline: bool,
            two_sges: bool,
            signaled_flag: bool,
            fence: bool,
            solicited: bool,
        }
        let mut plans = Vec::with_capacity(ops.len());
        let mut sq_left = {
            let s = &self.nodes[x].qps[i];
            let q = s.qp.as_ref().map_or(DEPTH, Qp::sq_outstanding);
            DEPTH.saturating_sub(q)
        };
        // Room on the send CQ for the whole batch, not just its first request.
        let scq = self.nodes[x].qps[i].scq;
        let mut cq_left = (self.nodes[x].cqs[scq].cqe + 1).saturating_sub(self.cq_load(x, scq));
        for &op in ops {
            if sq_left == 0 || cq_left == 0 {
                break;
            }
            sq_left -= 1;
            cq_left -= 1;
            let wr_id = self.new_wr_id();
            let len = match op {
                Op::CmpSwap | Op::FetchAdd => 8,
                // A zero-length RDMA operation checks no key: the bad-key fault needs a byte at least.
                _ => match self.rng.below(10) {
                    0 if bad_rkey.is_none() => 0,
                    0 => 1,
                    1..=4 => self.rng.range(1, 64) as u32,
                    _ => self.rng.range(1, max_msg as u64) as u32,
                },
            };
            let s = &mut self.nodes[x].qps[i];
            let (local, remote) = match op {
                Op::Send | Op::SendImm => {
                    let l = part(i) + SEND_OFF + (s.send_rr % SLOTS) * SEND_STRIDE;
                    s.send_rr += 1;
                    (l, 0)
                }
                Op::Write | Op::WriteImm => {
                    let l = part(i) + SEND_OFF + (s.send_rr % SLOTS) * SEND_STRIDE;
                    s.send_rr += 1;
                    let r = part(i) + WRITE_OFF + (s.write_rr % SLOTS) * MAX_RC_MSG;
                    s.write_rr += 1;
                    (l, r)
                }
                Op::Read => {
                    let l = part(i) + LAND_OFF + (s.land_rr % SLOTS) * MAX_RC_MSG;
                    s.land_rr += 1;
                    let r = part(i) + RSRC_OFF + self.rng.below((RSRC_LEN - len as usize + 1) as u64) as usize;
                    (l, r)
                }
                Op::CmpSwap | Op::FetchAdd => {
                    let l = part(i) + ARES_OFF + (s.ares_rr % SLOTS) * 8;
                    s.ares_rr += 1;
                    (l, part(i) + ATOM_OFF)
                }
                Op::Recv => unreachable!("receives are posted by post_recv"),
            };
            let model = s.atomic_model;
            let compare = match (op, model) {
                (Op::CmpSwap, Some(m)) if self.rng.one_in(2) => m,
                _ => self.rng.next_u64(),
            };
            let swap_add = self.rng.next_u64();
            let remote_op = matches!(op, Op::Write | Op::WriteImm | Op::Read | Op::CmpSwap | Op::FetchAdd);
            let expect = if bad_rkey.is_some() && remote_op { Some(WcStatus::RemAccessErr) } else { None };
            let inline = matches!(op, Op::Send | Op::SendImm | Op::Write | Op::WriteImm)
                && len <= MAX_INLINE
                && self.rng.one_in(3);
            let two_sges = !inline
                && len >= 2
                && matches!(op, Op::Send | Op::SendImm | Op::Write | Op::WriteImm)
                && self.rng.one_in(4);
            let imm = mix(self.seed ^ wr_id) as u32;
            let wr = Wr { node: x, slot: i, qpn: 0, op, len, local, remote, compare, swap_add, expect };
            plans.push(Plan {
                wr_id,
                wr,
                imm,
                inline,
                two_sges,
                signaled_flag: !self.nodes[x].qps[i].sig_all || self.rng.one_in(2),
                fence: self.rng.one_in(8),
                solicited: self.rng.one_in(8),
            });
        }
        if plans.is_empty() {
            return 0;
        }
        // Source bytes for sends and writes.
        let mem = self.nodes[x].mem();
        for p in &plans {
            if matches!(p.wr.op, Op::Send | Op::SendImm | Op::Write | Op::WriteImm) {
                let bytes: Vec<u8> =
                    pattern_byte_chunks(self.seed, p.wr_id, p.wr.len as usize).take(p.wr.len as usize).collect();
                write_mem(&mem, p.wr.local, &bytes);
            }
        }
        let inline_data: Vec<Vec<u8>> = plans
            .iter()
            .map(|p| {
                if p.inline {
                    pattern_byte_chunks(self.seed, p.wr_id, p.wr.len as usize).take(p.wr.len as usize).collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let lkey = self.nodes[x].mr.as_ref().map_or(0, |m| m.lkey);
        let base = mem.cpu().as_ptr() as u64;
        let peer_base = peer_mem.as_ptr() as u64;
        let sges: Vec<[Sge; 2]> = plans
            .iter()
            .map(|p| {
                let (a, len) = (base + p.wr.local as u64, p.wr.len);
                if p.two_sges {
                    let h = len / 2;
                    [Sge { addr: a, length: h, lkey }, Sge { addr: a + u64::from(h), length: len - h, lkey }]
                } else {
                    [Sge { addr: a, length: len, lkey }, Sge::default()]
                }
            })
            .collect();
        let ah = if ud { Some(Ah::new(&self.nodes[y].addr, self.nodes[x].link)) } else { None };
        let rkey = bad_rkey.unwrap_or(peer_rkey);
        let wrs: Vec<SendWr<'_>> = plans
            .iter()
            .zip(&sges)
            .zip(&inline_data)
            .map(|((p, sg), inl)| {
                let raddr = peer_base + p.wr.remote as u64;
                let op = match p.wr.op {
                    Op::Send => SendOp::Send,
                    Op::SendImm => SendOp::SendImm { imm: p.imm },
                    Op::Write => SendOp::RdmaWrite { remote_addr: raddr, rkey },
                    Op::WriteImm => SendOp::RdmaWriteImm { remote_addr: raddr, rkey, imm: p.imm },
                    Op::Read => SendOp::RdmaRead { remote_addr: raddr, rkey },
                    Op::CmpSwap => {
                        SendOp::AtomicCmpSwp { remote_addr: raddr, rkey, compare: p.wr.compare, swap: p.wr.swap_add }
                    }
                    Op::FetchAdd => SendOp::AtomicFetchAdd { remote_addr: raddr, rkey, add: p.wr.swap_add },
                    Op::Recv => SendOp::Send,
                };
                let mut flags = SendFlags::default();
                if p.signaled_flag {
                    flags = flags | SendFlags::SIGNALED;
                }
                if p.fence {
                    flags = flags | SendFlags::FENCE;
                }
                if p.solicited {
                    flags = flags | SendFlags::SOLICITED;
                }
                let sg_list: &[Sge] = if p.inline || p.wr.len == 0 {
                    &[]
                } else if p.two_sges {
                    &sg[..]
                } else {
                    &sg[..1]
                };
                SendWr {
                    wr_id: p.wr_id,
                    op,
                    sg_list,
                    flags,
                    inline: p.inline.then_some(inl.as_slice()),
                    ud: ah.as_ref().map(|ah| UdDest { ah, remote_qpn: peer_qpn, remote_qkey: QKEY }),
                }
            })
            .collect();
        let n = &mut self.nodes[x];
        let Node { hca, qps, dead, .. } = n;
        let Some(qp) = qps[i].qp.as_mut() else { return 0 };
        let qpn = qp.qpn();
        let r = hca.as_ref().expect("live HCA").post_send(qp, &wrs);
        let posted = match r {
            Ok(()) => plans.len(),
            Err(e) => {
                let explained = *dead && e.kind == PostErrorKind::DeviceError;
                if !explained {
                    self.rep.unexpected += 1;
                    self.rep.problem(format!("post_send on node {x} slot {i}: {e}"));
                }
                e.index
            }
        };
        drop(wrs);
        for p in plans.into_iter().take(posted) {
            let s = &mut self.nodes[x].qps[i];
            if p.wr.op.consumes_recv() {
                s.consumers_sent += 1;
                self.nodes[y].qps[i].expect.push_back(Msg { wr_id: p.wr_id, op: p.wr.op, len: p.wr.len, imm: p.imm });
            }
            self.ledger.insert(p.wr_id, Wr { qpn, ..p.wr });
            self.rep.ops += 1;
            self.rep.sends += 1;
            let key = format!("{}_{}", if ud { "ud" } else { "rc" }, p.wr.op.name());
            Report::bump(&mut self.rep.opcodes, &key);
        }
        posted
    }

    // -- completions -----------------------------------------------------------------------------------------

    /// Polls CQ `c` of node `x` until it is empty (bounded); returns the completions handled.
    fn poll(&mut self, x: usize, c: usize) -> usize {
        let mut total = 0;
        for _ in 0..64 {
            let n = &mut self.nodes[x];
            if n.cqs[c].overrun {
                return total;
            }
            let Node { hca, cqs, qps, .. } = n;
            let Some(cq) = cqs[c].cq.as_mut() else { return total };
            let mut table: Vec<&mut Qp> = qps.iter_mut().filter_map(|s| s.qp.as_mut()).collect();
            let r = hca.as_ref().expect("live HCA").poll_cq(cq, &mut table[..], &mut self.wcs);
            drop(table);
            match r {
                Ok(0) => return total,
                Ok(k) => {
                    total += k;
                    for j in 0..k {
                        let wc = self.wcs[j];
                        self.complete(x, &wc);
                    }
                }
                Err(e) => {
                    self.rep.cqe_errors += 1;
                    self.problem(format!("node {x} CQ {c}: {e}"));
                }
            }
        }
        total
    }

    fn poll_all(&mut self) -> usize {
        let mut n = 0;
        for x in 0..2 {
            for c in 0..=NBIG {
                n += self.poll(x, c);
            }
        }
        n
    }

    fn mismatch(&mut self, what: String) {
        self.rep.data_mismatches += 1;
        self.problem(what);
    }

    fn check_pattern(&mut self, node: usize, off: usize, tag: u64, len: usize) -> bool {
        let mem = self.nodes[node].mem();
        let buf = &mut self.scratch[..len];
        read_mem(&mem, off, buf);
        buf.iter().copied().eq(pattern_byte_chunks(self.seed, tag, len).take(len))
    }

    fn complete(&mut self, x: usize, wc: &WorkCompletion) {
        let Some(wr) = self.ledger.remove(&wc.wr_id) else {
            self.rep.duplicated += 1;
            self.problem(format!("node {x}: completion for wr_id {} which is not outstanding: {wc:?}", wc.wr_id));
            return;
        };
        Report::bump(&mut self.rep.completions, status_key(wc.status));
        if wc.status == WcStatus::WrFlushErr && wc.vendor_err == u32::from(consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR) {
            self.rep.software_flushes += 1;
        }
        if wr.node != x || wr.qpn != wc.qp_num {
            self.mismatch(format!(
                "wr_id {} of node {} QP {:#x} completed on node {x} QP {:#x}",
                wc.wr_id, wr.node, wr.qpn, wc.qp_num
            ));
            return;
        }
        let i = wr.slot;
        if wc.status != WcStatus::Success {
            let any_dead = self.nodes.iter().any(|n| n.dead);
            let s = &mut self.nodes[x].qps[i];
            if matches!(wr.op, Op::CmpSwap | Op::FetchAdd) {
                s.atomic_model = None;
            }
            let explained = s.faulted || wr.expect == Some(wc.status) || any_dead;
            if s.state == SlotState::Ready {
                s.state = SlotState::Broken;
            }
            if !explained {
                self.unexpected(format!(
                    "node {x} slot {i} {} wr_id {}: {:?} with no fault behind it",
                    wr.op.name(),
                    wc.wr_id,
                    wc.status
                ));
            }
            return;
        }
        if let Some(want) = wr.expect {
            self.unexpected(format!(
                "node {x} slot {i} {} wr_id {} succeeded; {want:?} was certain",
                wr.op.name(),
                wc.wr_id
            ));
            return;
        }
        let y = 1 - x;
        match wr.op {
            Op::Recv => self.check_recv(x, i, &wr, wc),
            Op::Send | Op::SendImm => {
                if wc.opcode != WcOpcode::Send {
                    self.mismatch(format!("send wr_id {} completed as {:?}", wc.wr_id, wc.opcode));
                }
            }
            Op::Write | Op::WriteImm => {
                if wc.opcode != WcOpcode::RdmaWrite {
                    self.mismatch(format!("write wr_id {} completed as {:?}", wc.wr_id, wc.opcode));
                }
                if !self.check_pattern(y, wr.remote, wc.wr_id, wr.len as usize) {
                    self.mismatch(format!("RDMA WRITE wr_id {} ({} bytes): the target differs", wc.wr_id, wr.len));
                }
            }
            Op::Read => {
                if (wc.opcode, wc.byte_len) != (WcOpcode::RdmaRead, wr.len) {
                    self.mismatch(format!("read wr_id {}: {:?} of {} bytes", wc.wr_id, wc.opcode, wc.byte_len));
                }
                let len = wr.len as usize;
                let mut want = vec![0u8; len];
                read_mem(&self.nodes[y].mem(), wr.remote, &mut want);
                let mut got = vec![0u8; len];
                read_mem(&self.nodes[x].mem(), wr.local, &mut got);
                if want != got {
                    self.mismatch(format!(
                        "RDMA READ wr_id {} ({len} bytes): the data differs from the source",
                        wc.wr_id
                    ));
                }
            }
            Op::CmpSwap | Op::FetchAdd => {
                let want_op = if wr.op == Op::CmpSwap { WcOpcode::CompSwap } else { WcOpcode::FetchAdd };
                if (wc.opcode, wc.byte_len) != (want_op, 8) {
                    self.mismatch(format!("atomic wr_id {}: {:?} of {} bytes", wc.wr_id, wc.opcode, wc.byte_len));
                }
                let mut w = [0u8; 8];
                read_mem(&self.nodes[x].mem(), wr.local, &mut w);
                let original = u64::from_ne_bytes(w);
                let s = &mut self.nodes[x].qps[i];
                if let Some(m) = s.atomic_model {
                    s.atomic_model = Some(match wr.op {
                        Op::CmpSwap if original == wr.compare => wr.swap_add,
                        Op::CmpSwap => original,
                        _ => original.wrapping_add(wr.swap_add),
                    });
                    if original != m {
                        self.mismatch(format!(
                            "{} wr_id {}: original {original:#x}, the target held {m:#x}",
                            wr.op.name(),
                            wc.wr_id
                        ));
                    }
                }
            }
        }
    }

    fn check_recv(&mut self, x: usize, i: usize, wr: &Wr, wc: &WorkCompletion) {
        let Some(msg) = self.nodes[x].qps[i].expect.pop_front() else {
            self.mismatch(format!("node {x} slot {i}: receive wr_id {} completed, nothing was sent", wc.wr_id));
            return;
        };
        let ud = i == UD_SLOT;
        let grh = if ud { GRH_BYTES } else { 0 };
        let want_len = if msg.op == Op::WriteImm { msg.len } else { msg.len + grh as u32 };
        let want_op = if msg.op == Op::WriteImm { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
        let with_imm = matches!(msg.op, Op::SendImm | Op::WriteImm);
        if wc.byte_len != want_len || wc.opcode != want_op || wc.wc_flags.contains(WcFlags::WITH_IMM) != with_imm {
            self.mismatch(format!(
                "node {x} slot {i}: receive of wr_id {} ({:?}, {} bytes) reads {:?} of {} bytes, flags {:?}",
                msg.wr_id, msg.op, msg.len, wc.opcode, wc.byte_len, wc.wc_flags
            ));
            return;
        }
        if with_imm && wc.imm_data != msg.imm {
            self.mismatch(format!("receive of wr_id {}: immediate {:#x}, sent {:#x}", msg.wr_id, wc.imm_data, msg.imm));
        }
        if ud {
            let peer = self.nodes[1 - x].qps[i].qp.as_ref().map_or(0, Qp::qpn);
            if wc.src_qp != peer {
                self.mismatch(format!(
                    "UD receive of wr_id {}: source QP {:#x}, sent by {peer:#x}",
                    msg.wr_id, wc.src_qp
                ));
            }
        }
        if msg.op != Op::WriteImm && !self.check_pattern(x, wr.local + grh, msg.wr_id, msg.len as usize) {
            self.mismatch(format!(
                "receive of wr_id {} ({} bytes): the data differs from what was sent",
                msg.wr_id, msg.len
            ));
        }
    }

    // -- events and health -----------------------------------------------------------------------------------

    /// Drains both devices' EQs and handles their async events; checks the page counts agree after.
    fn serve_events(&mut self) {
        for x in 0..2 {
            if self.nodes[x].dead {
                continue;
            }
            let n = &mut self.nodes[x];
            let Node { hca, d, .. } = n;
            let hca = hca.as_mut().expect("live HCA");
            if let Err(e) = hca.process_events(d) {
                self.unexpected(format!("node {x} process_events: {e}"));
                continue;
            }
            let (given, owned) = (hca.pages_given(), n.dev.pages_owned());
            if given != owned {
                self.rep.page_mismatches += 1;
                self.problem(format!("node {x}: the driver counts {given} pages given, the device owns {owned}"));
            }
            while let Some(ev) = self.nodes[x].hca().get_async_event() {
                self.async_event(x, ev);
            }
        }
    }

    fn async_event(&mut self, x: usize, ev: AsyncEvent) {
        match ev {
            AsyncEvent::CqError { cqn, .. } => {
                let n = &mut self.nodes[x];
                let Some(c) = n.cqs.iter().position(|s| s.cq.as_ref().is_some_and(|q| q.cqn() == cqn)) else { return };
                if !n.cqs[c].overrun_tried {
                    self.unexpected(format!("node {x}: CQ {cqn:#x} failed and was never overrun"));
                }
                let n = &mut self.nodes[x];
                n.cqs[c].failed = true;
                n.cqs[c].overrun = false;
                let hit: Vec<usize> = (0..NSLOTS).filter(|&i| n.qps[i].scq == c || n.qps[i].rcq == c).collect();
                for i in hit {
                    self.break_pair(i);
                }
            }
            AsyncEvent::QpError { qpn, .. } => {
                let n = &mut self.nodes[x];
                let Some(i) = n.qps.iter().position(|s| s.qp.as_ref().is_some_and(|q| q.qpn() == qpn)) else { return };
                if n.qps[i].fatal_pending == 0 {
                    self.unexpected(format!("node {x}: QP {qpn:#x} error event with no fault behind it"));
                }
                let s = &mut self.nodes[x].qps[i];
                s.fatal_pending = s.fatal_pending.saturating_sub(1);
                self.break_pair(i);
            }
            // Port, communication-established and the other informational events change nothing the soak checks.
            _ => {}
        }
    }

    fn break_pair(&mut self, i: usize) {
        for n in &mut self.nodes {
            let s = &mut n.qps[i];
            s.faulted = true;
            if s.state == SlotState::Ready {
                s.state = SlotState::Broken;
            }
        }
    }

    /// A health-timer tick on both devices (virtual time moves on first, as the heartbeat needs).
    fn health_tick(&mut self) {
        for x in 0..2 {
            let n = &mut self.nodes[x];
            if n.dead {
                continue;
            }
            n.d.delay_ms(2);
            if let Err(e) = n.hca().poll_health() {
                self.unexpected(format!("node {x}: health failed with no fault behind it: {e}"));
                self.nodes[x].dead = true;
            }
        }
    }

    /// Lets device time move (RNR and ACK timers) on both devices.
    fn tick(&mut self, us: u32) {
        for n in &mut self.nodes {
            n.d.delay_us(us);
        }
    }

    // -- faults ----------------------------------------------------------------------------------------------

    fn inject(&mut self) {
        match self.rng.below(100) {
            0..=14 => self.fault_command(),
            15..=24 => self.fault_pages(),
            25..=39 => self.fault_rnr(),
            40..=54 => self.fault_remote_access(),
            55..=64 => self.fault_cq_overrun(),
            65..=79 => self.fault_qp_fatal(),
            _ => self.fault_command(),
        }
    }

    /// A command failure: a status, a hang (timeout), a late answer, a delivery failure or a page request that
    /// must be served before it completes, on one command of a scratch object's life.
    fn fault_command(&mut self) {
        let x = self.rng.below(2) as usize;
        let kind =
            self.rng.pick(&[Scratch::Pd, Scratch::Mr, Scratch::Cq, Scratch::Qp, Scratch::QueryQp, Scratch::QueryCq]);
        let ops = kind.opcodes();
        let what = self.rng.below(10);
        let unanswered_ok = self.unanswered < MAX_UNANSWERED;
        let creates: Vec<u16> = ops.iter().copied().filter(|&o| !is_destroy(o)).collect();
        let (name, fault, want): (&str, Fault, Want) = match what {
            0..=4 => {
                let opcode = self.rng.pick(ops);
                let status = self.rng.pick(&[
                    CmdStatus::BadParam,
                    CmdStatus::BadResState,
                    CmdStatus::NoRes,
                    CmdStatus::BadSysState,
                    CmdStatus::Int,
                ]);
                let syndrome = self.rng.next_u64() as u32;
                let f = Fault::Status { opcode, status: status.raw(), syndrome, times: 1 };
                ("cmd_status", f, Want::Status(syndrome))
            }
            5 if unanswered_ok => {
                self.unanswered += 1;
                ("cmd_timeout", Fault::Hang { opcode: self.rng.pick(&creates) }, Want::Timeout)
            }
            6 if unanswered_ok => {
                self.unanswered += 1;
                let status = self.rng.pick(&[
                    DeliveryStatus::Tok,
                    DeliveryStatus::BadBlkNum,
                    DeliveryStatus::Fw,
                    DeliveryStatus::InLength,
                ]);
                (
                    "cmd_delivery",
                    Fault::Delivery { opcode: self.rng.pick(&creates), status: status.raw() },
                    Want::Delivery,
                )
            }
            7 | 8 => {
                let timeout = if self.threaded { THREADED_CMD_TIMEOUT_MS } else { CMD_TIMEOUT_MS };
                let ms = self.rng.range(1, u64::from(timeout) / 4) as u32;
                ("cmd_delay", Fault::Delay { opcode: self.rng.pick(&creates), ms }, Want::Ok)
            }
            _ => {
                let pages = self.rng.range(1, 8) as u32;
                ("need_pages", Fault::NeedPages { opcode: creates[0], pages }, Want::Ok)
            }
        };
        if self.nodes[x].dead || !self.scratch_possible(x, kind) {
            return;
        }
        self.fault(name);
        self.nodes[x].dev.inject(fault);
        let r = self.scratch_op(x, kind);
        self.nodes[x].dev.clear_faults();
        let fine = match (&want, &r) {
            (Want::Ok, Ok(())) => true,
            (Want::Status(s), Err(Error::Cmd(CmdError::Status { syndrome, .. }))) => syndrome == s,
            (Want::Timeout, Err(Error::Cmd(CmdError::Timeout { .. }))) => true,
            (Want::Delivery, Err(Error::Cmd(CmdError::Delivery { .. }))) => true,
            _ => false,
        };
        if !fine {
            self.unexpected(format!("node {x} {name} on {kind:?} ({fault:?}): {r:?}"));
        }
    }

    fn scratch_possible(&self, x: usize, kind: Scratch) -> bool {
        let n = &self.nodes[x];
        match kind {
            Scratch::QueryQp => n.qps.iter().any(|s| s.qp.is_some()),
            Scratch::QueryCq | Scratch::Qp => n.cqs[0].cq.is_some(),
            _ => true,
        }
    }

    /// One scratch object's life (or one query); the first error comes back, after whatever was created is
    /// destroyed again.
    fn scratch_op(&mut self, x: usize, kind: Scratch) -> Result<(), Error> {
        let n = &mut self.nodes[x];
        let Node { hca, pd, mem, cqs, qps, d, addr, leftover_qps, leftover_cqs, .. } = n;
        let hca = hca.as_mut().expect("live HCA");
        let pd = pd.as_ref().expect("PD lives until teardown");
        match kind {
            Scratch::Pd => {
                let p = hca.alloc_pd(d)?;
                match hca.dealloc_pd(p, d) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let first = e.error;
                        hca.dealloc_pd(e.obj, d).map_err(|e| e.error)?;
                        Err(first)
                    }
                }
            }
            Scratch::Mr => {
                let mr = hca.reg_mr(
                    pd,
                    mem.as_ref().expect("buffer lives until teardown").cpu().as_ptr(),
                    8192,
                    Access::LOCAL_WRITE | Access::REMOTE_READ,
                    d,
                )?;
                match hca.dereg_mr(mr, d) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let first = e.error;
                        hca.dereg_mr(e.obj, d).map_err(|e| e.error)?;
                        Err(first)
                    }
                }
            }
            Scratch::Cq => {
                let cq = hca.create_cq(CqAttr { cqe: 15, ..CqAttr::default() }, d)?;
                match hca.destroy_cq(cq, d) {
                    Ok(()) => Ok(()),
                    Err(e) => {
                        let first = e.error;
                        if let Err(e) = hca.destroy_cq(e.obj, d) {
                            leftover_cqs.push(e.obj);
                        }
                        Err(first)
                    }
                }
            }
            Scratch::Qp => {
                let cq = cqs[0].cq.as_ref().expect("checked by scratch_possible");
                let cap =
                    QpCap { max_send_wr: 2, max_recv_wr: 2, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
                let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: true };
                let mut qp = hca.create_qp(pd, cq, cq, attr, d)?;
                let a = QpAttr {
                    qp_access_flags: Access::REMOTE_READ,
                    dest_qp_num: qp.qpn(),
                    ah_attr: *addr,
                    ..QpAttr::default()
                };
                let mut first = Ok(());
                for (f, s) in [
                    (QpState::Reset, QpState::Init),
                    (QpState::Init, QpState::Rtr),
                    (QpState::Rtr, QpState::Rts),
                    (QpState::Rts, QpState::Err),
                ] {
                    let m = required_attrs(QpType::Rc, f, s).unwrap_or(QpAttrMask::STATE);
                    if let Err(e) = hca.modify_qp(&mut qp, &QpAttr { qp_state: s, ..a }, m, d) {
                        first = Err(e);
                        break;
                    }
                }
                match hca.destroy_qp(qp, d) {
                    Ok(()) => first,
                    Err(e) => {
                        let err = e.error;
                        if let Err(e) = hca.destroy_qp(e.obj, d) {
                            leftover_qps.push(e.obj);
                        }
                        first.and(Err(err))
                    }
                }
            }
            Scratch::QueryQp => {
                let qp = qps.iter().find_map(|s| s.qp.as_ref()).expect("checked by scratch_possible");
                hca.query_qp(qp, d).map(|_| ())
            }
            Scratch::QueryCq => {
                let cq = cqs[0].cq.as_ref().expect("checked by scratch_possible");
                hca.query_cq(cq, d).map(|_| ())
            }
        }
    }

    /// Firmware asks for pages, or offers some back, in the middle of traffic; served at the next drain.
    fn fault_pages(&mut self) {
        let x = self.rng.below(2) as usize;
        if self.nodes[x].dead {
            return;
        }
        let given = self.nodes[x].hca().pages_given();
        if self.rng.one_in(2) || given < 8 {
            self.fault("page_give");
            self.nodes[x].dev.request_pages(self.rng.range(1, 16) as i32);
        } else {
            self.fault("page_take");
            self.nodes[x].dev.request_pages(-(self.rng.range(1, 4) as i32));
        }
        if self.rng.one_in(2) {
            self.serve_events();
        }
    }

    /// A receiver stops posting receives and its peer sends anyway: RNR NAKs until the retries run out.
    fn fault_rnr(&mut self) {
        let i = self.rng.below(NRC as u64) as usize;
        let x = self.rng.below(2) as usize;
        if !self.usable(x, i) || self.credit(x, i) != 0 || !self.send_room(x, i) {
            return;
        }
        self.fault("rnr");
        for n in &mut self.nodes {
            n.qps[i].faulted = true;
        }
        self.nodes[1 - x].qps[i].starved = true;
        let before = self.ledger.len();
        let id = self.next_wr;
        if self.post_sends(x, i, &[Op::Send], None) == 1 && self.ledger.len() > before {
            if let Some(w) = self.ledger.get_mut(&id) {
                w.expect = Some(WcStatus::RnrRetryExcErr);
            }
        }
    }

    /// A remote operation with a key the peer never issued.
    fn fault_remote_access(&mut self) {
        let i = self.rng.below(NRC as u64) as usize;
        let x = self.rng.below(2) as usize;
        if !self.usable(x, i) || !self.send_room(x, i) {
            return;
        }
        self.fault("remote_access");
        for n in &mut self.nodes {
            n.qps[i].faulted = true;
        }
        let rkey = self.nodes[1 - x].mr.as_ref().map_or(0, |m| m.rkey) ^ 0x80;
        let op = self.rng.pick(&[Op::Write, Op::Read, Op::CmpSwap, Op::FetchAdd]);
        self.post_sends(x, i, &[op], Some(rkey));
    }

    /// More completions than the small CQs hold, none polled: both overrun, report a CQ error and take no more.
    fn fault_cq_overrun(&mut self) {
        let i = SMALL_PAIR;
        let x = self.rng.below(2) as usize;
        let y = 1 - x;
        if !self.usable(x, i) {
            return;
        }
        let k = SMALL_CQE as usize + 4;
        let (sq, rq) = {
            let s = self.nodes[x].qps[i].qp.as_ref().map_or(DEPTH, Qp::sq_outstanding);
            let r = self.nodes[y].qps[i].qp.as_ref().map_or(DEPTH, Qp::rq_outstanding);
            (s, r)
        };
        // Every send must find its receive, so that all of them complete now and both CQs overrun at once.
        let starved = self.nodes.iter().any(|n| n.qps[i].starved || n.qps[i].fatal_pending > 0);
        if starved || sq as usize + k > DEPTH as usize || rq as usize + k > DEPTH as usize {
            return;
        }
        self.fault("cq_overrun");
        for n in &mut self.nodes {
            n.qps[i].faulted = true;
            n.cqs[SMALL_CQ].overrun = true;
            n.cqs[SMALL_CQ].overrun_tried = true;
        }
        // The capacity rule is what this fault breaks: lift it for these posts.
        for n in &mut self.nodes {
            n.cqs[SMALL_CQ].cqe = u32::MAX - 1;
        }
        for _ in 0..k {
            self.post_recv(y, i);
        }
        let ops = vec![Op::Send; k];
        let mut posted = 0;
        while posted < k {
            let chunk = (k - posted).min(3);
            let p = self.post_sends(x, i, &ops[..chunk], None);
            if p == 0 {
                break;
            }
            posted += p;
        }
        for n in &mut self.nodes {
            n.cqs[SMALL_CQ].cqe = SMALL_CQE;
        }
        // The error events arrive with the next drain; serve them now so the pair is rebuilt soon.
        self.serve_events();
        // A side that did not overrun now (its QP was already in error, say, so the sends were flushed and the
        // peer got nothing) is polled again; its error, should it come later, is still explained.
        for n in &mut self.nodes {
            n.cqs[SMALL_CQ].overrun = false;
        }
    }

    /// Firmware reports a QP's work queue broken: the QP goes to ERR with a catastrophic-error event.
    fn fault_qp_fatal(&mut self) {
        let x = self.rng.below(2) as usize;
        let i = self.rng.below(NSLOTS as u64) as usize;
        if !self.usable(x, i) {
            return;
        }
        let Some(qpn) = self.nodes[x].qps[i].qp.as_ref().map(Qp::qpn) else { return };
        self.fault("qp_fatal");
        for n in &mut self.nodes {
            n.qps[i].faulted = true;
        }
        self.nodes[x].qps[i].fatal_pending += 1;
        if !self.nodes[x].dev.fail_qp(qpn) {
            self.unexpected(format!("node {x}: the simulator refused to fail QP {qpn:#x}"));
        }
    }

    // -- recovery --------------------------------------------------------------------------------------------

    /// Rebuilds every broken pair: both QPs to ERR, drained (flush completions from the device, or from the
    /// driver when their CQ failed), destroyed; failed CQs destroyed and created again; new QPs connected.
    fn repair(&mut self) {
        let broken: Vec<usize> =
            (0..NSLOTS).filter(|&i| self.nodes.iter().any(|n| n.qps[i].state == SlotState::Broken)).collect();
        if broken.is_empty() || self.nodes.iter().any(|n| n.dead) {
            return;
        }
        // A QP fatal event is waited for before its QP is destroyed (it names the QP).
        if broken.iter().any(|&i| self.nodes.iter().any(|n| n.qps[i].fatal_pending > 0)) {
            self.serve_events();
        }
        for &i in &broken {
            for x in 0..2 {
                self.move_to_err(x, i);
            }
        }
        let pending = |e: &Self| {
            broken.iter().any(|&i| {
                e.nodes
                    .iter()
                    .any(|n| n.qps[i].qp.as_ref().is_some_and(|q| q.sq_outstanding() + q.rq_outstanding() > 0))
            })
        };
        if !self.drain_until(pending) {
            // Counted as a hang; these pairs carry no more traffic (their QPs are destroyed at teardown).
            for &i in &broken {
                for n in &mut self.nodes {
                    n.qps[i].state = SlotState::Dead;
                }
            }
            return;
        }
        for &i in &broken {
            for x in 0..2 {
                let n = &mut self.nodes[x];
                if n.qps[i].fatal_pending > 0 {
                    // Served above: every injected event has arrived by now.
                    let (missing, qpn) = (n.qps[i].fatal_pending, n.qps[i].qp.as_ref().map_or(0, Qp::qpn));
                    n.qps[i].fatal_pending = 0;
                    self.rep.unexpected += 1;
                    self.rep.problem(format!("node {x} QP {qpn:#x}: {missing} QP fatal events never arrived"));
                }
                let n = &mut self.nodes[x];
                if let Some(qp) = n.qps[i].qp.take() {
                    let Node { hca, d, leftover_qps, .. } = n;
                    if let Err(e) = hca.as_mut().expect("live HCA").destroy_qp(qp, d) {
                        self.rep.unexpected += 1;
                        self.rep.problem(format!("node {x} slot {i}: destroy_qp: {}", e.error));
                        leftover_qps.push(e.obj);
                    }
                }
            }
        }
        // CQs that failed, once no QP uses them.
        for x in 0..2 {
            for c in 0..=NBIG {
                let n = &self.nodes[x];
                if !n.cqs[c].failed || n.qps.iter().any(|s| s.qp.is_some() && (s.scq == c || s.rcq == c)) {
                    continue;
                }
                let n = &mut self.nodes[x];
                if let Some(cq) = n.cqs[c].cq.take() {
                    let Node { hca, d, leftover_cqs, .. } = n;
                    if let Err(e) = hca.as_mut().expect("live HCA").destroy_cq(cq, d) {
                        self.rep.unexpected += 1;
                        self.rep.problem(format!("node {x} CQ {c}: destroy_cq: {}", e.error));
                        leftover_cqs.push(e.obj);
                    }
                }
                if let Err(e) = self.create_cq(x, c) {
                    self.unexpected(format!("node {x} CQ {c}: create_cq: {e}"));
                }
            }
        }
        for &i in &broken {
            let mut ok = true;
            for x in 0..2 {
                self.nodes[x].qps[i].reset_traffic();
                if let Err(e) = self.create_qp(x, i) {
                    self.unexpected(format!("node {x} slot {i}: create_qp: {e}"));
                    ok = false;
                }
            }
            if ok {
                if let Err(e) = self.connect(i) {
                    self.unexpected(format!("slot {i}: connect: {e}"));
                    ok = false;
                }
            }
            for n in &mut self.nodes {
                let s = &mut n.qps[i];
                s.state = if ok { SlotState::Ready } else { SlotState::Dead };
                s.faulted = false;
            }
            self.rep.recoveries += 1;
        }
    }

    fn move_to_err(&mut self, x: usize, i: usize) {
        let n = &mut self.nodes[x];
        if n.dead {
            return;
        }
        let Node { hca, qps, d, .. } = n;
        let Some(qp) = qps[i].qp.as_mut() else { return };
        if matches!(qp.state(), QpState::Err | QpState::Reset) {
            return;
        }
        let a = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
        if let Err(e) = hca.as_mut().expect("live HCA").modify_qp(qp, &a, QpAttrMask::STATE, d) {
            self.rep.unexpected += 1;
            self.rep.problem(format!("node {x} slot {i}: modify to ERR: {e}"));
        }
    }

    /// Polls everything (and lets device time move when nothing came) until `pending` is false; `false` after
    /// the bound, counted as a hang.
    fn drain_until(&mut self, pending: impl Fn(&Self) -> bool) -> bool {
        for round in 0..DRAIN_ROUNDS {
            if !pending(self) {
                return true;
            }
            if self.poll_all() == 0 {
                self.tick(if round < 100 { 50 } else { 2_000 });
                if round.is_multiple_of(64) {
                    self.serve_events();
                }
            }
        }
        self.rep.hangs += 1;
        let left: Vec<(usize, usize, u32)> =
            (0..2)
                .flat_map(|x| {
                    self.nodes[x].qps.iter().enumerate().filter_map(move |(i, s)| {
                        s.qp.as_ref().map(|q| (x, i, q.sq_outstanding() + q.rq_outstanding()))
                    })
                })
                .filter(|t| t.2 > 0)
                .collect();
        self.problem(format!("a drain found no end: outstanding (node, slot, WRs) {left:?}"));
        false
    }

    // -- the end of an epoch ---------------------------------------------------------------------------------

    /// Every QP to ERR and every work request completed.
    fn close_clean(&mut self) {
        self.serve_events();
        for n in &mut self.nodes {
            for s in &mut n.qps {
                s.faulted = true;
            }
        }
        for i in 0..NSLOTS {
            for x in 0..2 {
                self.move_to_err(x, i);
            }
        }
        self.drain_until(|e| !e.ledger.is_empty());
    }

    /// One device dies with work outstanding on both: health syndrome, frozen heartbeat or removal, on its own or
    /// hit by a command. Its HCA must notice, refuse new work and complete every outstanding request itself; the
    /// survivor's requests to it run out of retries.
    fn terminal(&mut self, ending: u64) {
        self.serve_events();
        // Requests that wait on RNR timers are outstanding at the moment of death.
        for i in 0..NRC {
            let x = self.rng.below(2) as usize;
            if self.usable(x, i) && self.credit(x, i) == 0 && self.send_room(x, i) && self.rng.one_in(2) {
                self.post_sends(x, i, &[Op::Send], None);
            }
        }
        for n in &mut self.nodes {
            for s in &mut n.qps {
                s.faulted = true;
            }
        }
        let x = self.rng.below(2) as usize;
        let synd = self.rng.pick(&[
            consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR,
            consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_HW_FATAL_ERR,
            consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_DEAD_IRISC,
        ]);
        let query = consts::MLX5_CMD_OP_QUERY_CQ;
        let in_command = self.rng.one_in(3);
        // A stalled heartbeat is noticed after three missed health polls (in threaded mode 50 ms apart).
        let (kind, fault) = match (ending % 3, in_command) {
            (0, false) => ("health_failure", None),
            (1, false) => ("health_stall", None),
            (_, false) => ("device_gone", None),
            (0, true) => ("health_failure_in_command", Some(Fault::Fatal { opcode: query, synd })),
            (1, true) => ("health_stall_in_command", Some(Fault::Stall { opcode: query })),
            (_, true) => ("device_gone_in_command", Some(Fault::DeviceGone { opcode: query })),
        };
        self.fault(kind);
        let n = &mut self.nodes[x];
        let noticed = match fault {
            Some(f) => {
                n.dev.inject(f);
                let Node { hca, cqs, d, .. } = n;
                let cq = cqs.iter().find_map(|c| c.cq.as_ref());
                match cq.map(|cq| hca.as_mut().expect("live HCA").query_cq(cq, d)) {
                    Some(Err(Error::Health(_))) => true,
                    other => {
                        self.rep.unexpected += 1;
                        self.rep.problem(format!("node {x} {kind}: the command returned {other:?}"));
                        false
                    }
                }
            }
            None => {
                match kind {
                    "health_failure" => n.dev.fail_health(synd),
                    "health_stall" => n.dev.stall_health(),
                    _ => n.dev.device_gone(),
                }
                let mut seen = false;
                for _ in 0..8 {
                    // Virtual time jumps; real time needs only a moment (a syndrome or all-ones reads are seen
                    // at the first poll).
                    n.d.delay_ms(if self.threaded { 10 } else { 2_000 });
                    if n.hca().poll_health().is_err() {
                        seen = true;
                        break;
                    }
                }
                seen
            }
        };
        let state = self.nodes[x].hca().state();
        let want_gone = kind.starts_with("device_gone");
        let cause_ok = match state {
            HcaState::InternalError(HealthFailure::DeviceGone) => want_gone,
            HcaState::InternalError(_) => !want_gone,
            HcaState::Up => false,
        };
        if !noticed || !cause_ok {
            self.unexpected(format!("node {x} {kind}: the HCA is {state:?} (noticed: {noticed})"));
        }
        self.nodes[x].dead = true;
        // New work is refused with a typed error and never reaches the ledger.
        if let Some(i) = (0..NSLOTS).find(|&i| self.nodes[x].qps[i].qp.is_some()) {
            let n = &mut self.nodes[x];
            let sge = [Sge { addr: n.mem().cpu().as_ptr() as u64, length: 8, lkey: 0 }];
            let Node { hca, qps, .. } = n;
            if let Some(qp) = qps[i].qp.as_mut() {
                let hca = hca.as_ref().expect("live HCA");
                let r = hca.post_recv(qp, &[RecvWr { wr_id: u64::MAX, sg_list: &sge }]);
                if !matches!(r, Err(e) if e.kind == PostErrorKind::DeviceError) {
                    self.rep.unexpected += 1;
                    self.rep.problem(format!("node {x}: post_recv on a dead device: {r:?}"));
                }
            }
        }
        // The dead device's work completes in software; the survivor's requests to it run out of retries first,
        // then the survivor moves its QPs to ERR so the receives no one will fill are flushed too.
        let dead_pending = |e: &Self| e.ledger.values().any(|w| w.node == x);
        self.drain_until(dead_pending);
        let y = 1 - x;
        for _ in 0..50 {
            self.tick(2_000);
            self.poll_all();
        }
        for i in 0..NSLOTS {
            self.move_to_err(y, i);
        }
        self.drain_until(|e| !e.ledger.is_empty());
    }

    /// Everything destroyed, both HCAs torn down, then the leak and memory checks.
    fn teardown(&mut self) {
        self.rep.lost += self.ledger.len() as u64;
        for (id, w) in self.ledger.iter().take(3) {
            let msg = format!("lost: wr_id {id} {} on node {} slot {}", w.op.name(), w.node, w.slot);
            self.rep.problem(msg);
        }
        self.ledger.clear();
        // Every QP fatal event injected was seen (the epoch's last drain ran before any device died).
        let missing: u32 = self.nodes.iter().flat_map(|n| n.qps.iter()).map(|s| s.fatal_pending).sum();
        if missing > 0 {
            self.unexpected(format!("{missing} QP fatal events never arrived"));
        }
        for x in 0..2 {
            let n = &mut self.nodes[x];
            let mut errors = Vec::new();
            let Node { hca, d, qps, cqs, leftover_qps, leftover_cqs, pd, mr, mem, dev, .. } = n;
            let Some(mut h) = hca.take() else { continue };
            for s in qps.iter_mut() {
                if let Some(qp) = s.qp.take() {
                    leftover_qps.push(qp);
                }
            }
            for qp in leftover_qps.drain(..) {
                if let Err(e) = h.destroy_qp(qp, d) {
                    errors.push(format!("destroy_qp: {}", e.error));
                }
            }
            for c in cqs.iter_mut() {
                if let Some(cq) = c.cq.take() {
                    leftover_cqs.push(cq);
                }
            }
            for cq in leftover_cqs.drain(..) {
                if let Err(e) = h.destroy_cq(cq, d) {
                    errors.push(format!("destroy_cq: {}", e.error));
                }
            }
            if let Some(m) = mr.take() {
                if let Err(e) = h.dereg_mr(m, d) {
                    errors.push(format!("dereg_mr: {}", e.error));
                }
            }
            if let Some(p) = pd.take() {
                if let Err(e) = h.dealloc_pd(p, d) {
                    errors.push(format!("dealloc_pd: {}", e.error));
                }
            }
            // SAFETY: the key over the buffer is destroyed (or the device is dead), and every work request that
            // used it has completed: nothing reaches it any more.
            if let Some(mem) = mem.take() {
                // SAFETY: as above.
                unsafe { dev.dma().free(mem) };
            }
            if let Err(e) = h.teardown(d) {
                errors.push(format!("teardown: {e}"));
            }
            let (regions, bytes) = dev.dma_outstanding();
            self.rep.leaked_dma_regions += regions as u64;
            self.rep.leaked_dma_bytes += bytes as u64;
            self.rep.leaked_fw_pages += dev.pages_owned() as u64;
            let bad = dev
                .events()
                .iter()
                .filter(|e| matches!(e, SimEvent::FreedDeviceOwned { .. } | SimEvent::BadFree { .. }))
                .count()
                + dev.dma_faults().len();
            self.rep.memory_faults += bad as u64;
            if bytes > 0 || bad > 0 {
                errors.push(format!("{regions} regions ({bytes} bytes) outstanding, {bad} memory faults"));
            }
            for e in errors {
                self.unexpected(format!("node {x} teardown: {e}"));
            }
        }
    }
}

/// What a command fault must produce.
#[derive(Debug)]
enum Want {
    Ok,
    Status(u32),
    Timeout,
    Delivery,
}

/// A scratch object whose life carries a command fault.
#[derive(Debug, Clone, Copy)]
enum Scratch {
    Pd,
    Mr,
    Cq,
    Qp,
    QueryQp,
    QueryCq,
}

impl Scratch {
    /// The commands of its life, creates first.
    fn opcodes(self) -> &'static [u16] {
        use consts::*;
        match self {
            Scratch::Pd => &[MLX5_CMD_OP_ALLOC_PD, MLX5_CMD_OP_DEALLOC_PD],
            Scratch::Mr => &[MLX5_CMD_OP_CREATE_MKEY, MLX5_CMD_OP_DESTROY_MKEY],
            Scratch::Cq => &[MLX5_CMD_OP_CREATE_CQ, MLX5_CMD_OP_DESTROY_CQ],
            Scratch::Qp => &[
                MLX5_CMD_OP_CREATE_QP,
                MLX5_CMD_OP_RST2INIT_QP,
                MLX5_CMD_OP_INIT2RTR_QP,
                MLX5_CMD_OP_RTR2RTS_QP,
                MLX5_CMD_OP_2ERR_QP,
                MLX5_CMD_OP_DESTROY_QP,
            ],
            Scratch::QueryQp => &[MLX5_CMD_OP_QUERY_QP],
            Scratch::QueryCq => &[MLX5_CMD_OP_QUERY_CQ],
        }
    }
}

/// Destroy-type commands: not hung or failed in delivery by the soak (an object whose destroy got no answer
/// stays with the device until the function is disabled, and its memory with the caller).
fn is_destroy(op: u16) -> bool {
    use consts::*;
    matches!(op, MLX5_CMD_OP_DEALLOC_PD | MLX5_CMD_OP_DESTROY_MKEY | MLX5_CMD_OP_DESTROY_CQ | MLX5_CMD_OP_DESTROY_QP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_deterministic_and_bounded() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<u64> = (0..100).map(|_| a.below(10)).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.below(10)).collect();
        assert_eq!(xs, ys);
        assert!(xs.iter().all(|&x| x < 10));
        assert!((0..10).all(|v| xs.contains(&v)), "every value shows up in 100 draws: {xs:?}");
        assert_ne!(Rng::new(8).next_u64(), Rng::new(7).next_u64());
    }

    #[test]
    fn patterns_depend_on_seed_and_tag() {
        let p = |s, t| pattern_byte_chunks(s, t, 37).take(37).collect::<Vec<u8>>();
        assert_eq!(p(1, 2), p(1, 2));
        assert_ne!(p(1, 2), p(1, 3));
        assert_ne!(p(1, 2), p(2, 2));
        assert_eq!(p(1, 2).len(), 37);
    }
}

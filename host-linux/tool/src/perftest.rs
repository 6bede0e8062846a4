//! `mlx5 bench`: bandwidth and latency tests in the manner of perftest (`ib_send_bw`, `ib_write_bw`, `ib_read_bw`,
//! `ib_send_lat`, `ib_write_lat`), written over the verbs API ([`mlx5_verbs`]), printing perftest's table or one
//! JSON object.
//!
//! # Endpoints
//! Two RC QPs, a client (the requester) and a server, each with its own PD, CQ and one registered buffer (a
//! source half and a destination half). On the simulator (the default) they live on two simulated ConnectX-5s
//! joined by the simulated wire, like two hosts; with a device (`--device BDF`, or `--device sim` for one
//! simulated device) both live on that one device and talk through its loopback. The code is the same either way:
//! [`bench()`] takes two contexts, which may be the same one.
//!
//! # Bandwidth tests
//! The client keeps up to `tx_depth` work requests outstanding (the first `tx_depth` are posted as one batch, then
//! each poll's freed room is refilled as one batch, one doorbell per batch). Every `cq_mod`-th request is
//! signaled, and the last one, as perftest's CQ moderation does; a completion retires every request up to it (RC
//! completes in order). `cq_mod` is clamped to `tx_depth` so a signaled request is always outstanding. For
//! `send_bw` the server's receives are posted before the sends that consume them, so no SEND meets an empty
//! receive queue (no RNR NAK). Figures:
//! - `BW average` = bytes × messages / (last completion − first post).
//! - `BW peak`: the best rate over any `tx_depth` consecutive messages, each window timed from the post of its first
//!   message to the completion of its last (perftest takes the best window of every length, which costs O(n²);
//!   one queue's depth is the steady state and costs O(n)), or the average if that is better: the whole run is
//!   a window too. An unsignaled request counts as completed when the signaled one after it does, so with CQ
//!   moderation (and on the in-line simulator, where a doorbell runs the whole batch before `post_send`
//!   returns) the peak is usually the average; `--cq-mod 1` times every message.
//! - `MsgRate` = messages / (last completion − first post), in millions per second.
//! - `MB/sec` is perftest's unit: 2^20 bytes per second.
//!
//! Data is checked after the last completion of each size: the source is filled with a pattern that differs per
//! size and per slot (the buffer holds several message-sized slots, used round robin), the destination is zeroed,
//! and afterwards every slot used must equal its source (`read_bw`: the server's buffer is the source). A mismatch
//! is an error naming the first differing byte.
//!
//! # Latency tests
//! A ping-pong, one message in flight: the client sends (`send_lat`: a SEND into a posted receive; `write_lat`: an
//! RDMA WRITE whose last byte carries the iteration's tag, which the server sees by polling the last byte of its
//! buffer, as perftest does), the server answers the same way, and the sample is half the time from the client's
//! post to the answer's arrival (std [`Instant`]). Every request is signaled; the send completions are reaped
//! after the sample is taken. Messages up to `inline` bytes travel inside the WQE (perftest's defaults: 236 for
//! `send_lat`, 220 for `write_lat`). Figures over the samples: min, max, typical (the median), average, standard
//! deviation (population), and the 99% and 99.9% percentiles (nearest rank).
//!
//! # Bounds
//! Every wait gives up after `--timeout` ([`STALL_TIMEOUT`] unless told) without progress
//! ([`BenchError::Timeout`]); every completion's status is checked ([`BenchError::Completion`] names the work request, the status and the vendor error).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use mlx5_sim::{Mode, PortType, SimConfig, SimDevice};

use mlx5_verbs::tracefile::SharedTrace;

use mlx5_verbs::wr::{self, WrExt};
use mlx5_verbs::{
    Access, CompletionQueue, Context, LinkLayer, MemoryRegion, QpCap, QpType, QueuePair, RecvWr, RemoteBuf, Rts,
    SendWr, Sge, VerbsError, WcOpcode, WcStatus, WorkCompletion,
};

/// The largest message (perftest's `-a` limit, 8 MiB).
pub const MAX_SIZE: usize = 1 << 23;
/// The largest message of a `--all` sweep unless `--max-size` says otherwise (the simulator copies every byte).
pub const DEFAULT_MAX_SIZE: usize = 1 << 20;
/// Iterations per size unless told (perftest runs 5000 for bandwidth and 1000 for latency; one figure for both
/// keeps a simulated sweep short).
pub const DEFAULT_ITERS: u64 = 1000;
/// perftest's default queue depth for bandwidth tests.
pub const DEFAULT_TX_DEPTH: u32 = 128;
/// perftest's default CQ moderation: every 100th request signaled.
pub const DEFAULT_CQ_MOD: u32 = 100;
const MAX_TX_DEPTH: u32 = 8192;
/// How long any wait may go without a completion or an arrival before the run is abandoned.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for message slots in each buffer half (bandwidth tests), so several messages land in distinct places.
const SLOT_BUDGET: usize = 4 << 20;
/// Completions taken per poll.
const POLL_BATCH: usize = 64;
/// Receives kept posted on each side of `send_lat` (one is consumed per iteration and replaced).
const LAT_RECVS: u32 = 2;
/// perftest's "MB": 2^20 bytes.
const MB: f64 = 1048576.0;
const RULE: &str = "---------------------------------------------------------------------------------------";
/// perftest's column headings.
const BW_HEADING: &str = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";
const BW_COLUMNS: [&str; 5] = ["#bytes", "#iterations", "BW peak[MB/sec]", "BW average[MB/sec]", "MsgRate[Mpps]"];
const LAT_HEADING: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
                           t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]";
const LAT_COLUMNS: [&str; 9] = [
    "#bytes",
    "#iterations",
    "t_min[usec]",
    "t_max[usec]",
    "t_typical[usec]",
    "t_avg[usec]",
    "t_stdev[usec]",
    "99% percentile[usec]",
    "99.9% percentile[usec]",
];

/// What a benchmark can fail with; each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A bad command line.
    #[error("bench: {0}")]
    Usage(String),
    #[error("{0}")]
    Verbs(#[from] VerbsError),
    /// A completion with an error status.
    #[error(
        "{test}: work request {wr_id} ({op} of {bytes} bytes on the {side}) completed with {status} (vendor error \
         {vendor_err:#x})"
    )]
    Completion {
        test: &'static str,
        side: &'static str,
        wr_id: u64,
        op: &'static str,
        bytes: usize,
        status: WcStatus,
        vendor_err: u32,
    },
    /// A completion the test never asked for.
    #[error("{test}: unexpected completion on the {side}: work request {wr_id}, {opcode:?}, {byte_len} bytes")]
    Unexpected { test: &'static str, side: &'static str, wr_id: u64, opcode: WcOpcode, byte_len: u32 },
    #[error("{test}: no progress for {:.1} s while waiting for {what}", .after.as_secs_f64())]
    Timeout { test: &'static str, what: String, after: Duration },
    /// Data that arrived differs from what was sent.
    #[error(
        "{test}: data mismatch at {bytes} bytes: byte {offset} of the {side}'s buffer is {got:#04x}, expected \
         {want:#04x}"
    )]
    Mismatch { test: &'static str, bytes: usize, side: &'static str, offset: usize, got: u8, want: u8 },
    /// Standard output could not be written.
    #[error("failed to write output: {0}")]
    Output(#[source] std::io::Error),
}

type Result<T> = std::result::Result<T, BenchError>;

/// The five tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    SendBw,
    WriteBw,
    ReadBw,
    SendLat,
    WriteLat,
}

impl Test {
    pub const ALL: [Test; 5] = [Test::SendBw, Test::WriteBw, Test::ReadBw, Test::SendLat, Test::WriteLat];

    /// The name on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Test::SendBw => "send_bw",
            Test::WriteBw => "write_bw",
            Test::ReadBw => "read_bw",
            Test::SendLat => "send_lat",
            Test::WriteLat => "write_lat",
        }
    }

    /// perftest's banner.
    fn title(self) -> &'static str {
        match self {
            Test::SendBw => "Send BW Test",
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::SendLat => "Send Latency Test",
            Test::WriteLat => "RDMA_Write Latency Test",
        }
    }

    pub fn is_bw(self) -> bool {
        matches!(self, Test::SendBw | Test::WriteBw | Test::ReadBw)
    }

    fn is_send(self) -> bool {
        matches!(self, Test::SendBw | Test::SendLat)
    }

    /// perftest's default message size: 64 KiB for bandwidth, 2 bytes for latency.
    pub fn default_size(self) -> usize {
        if self.is_bw() {
            65536
        } else {
            2
        }
    }

    /// perftest's default inline size (latency tests only here).
    pub fn default_inline(self) -> u32 {
        match self {
            Test::SendLat => 236,
            Test::WriteLat => 220,
            _ => 0,
        }
    }

    /// The client's operation, for error messages.
    fn op(self) -> &'static str {
        match self {
            Test::SendBw | Test::SendLat => "SEND",
            Test::WriteBw | Test::WriteLat => "RDMA WRITE",
            Test::ReadBw => "RDMA READ",
        }
    }
}

impl std::str::FromStr for Test {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Test> {
        Test::ALL.into_iter().find(|t| t.name() == s).ok_or_else(|| {
            BenchError::Usage(format!(
                "unknown test {s:?} (expected send_bw, write_bw, read_bw, send_lat or write_lat)"
            ))
        })
    }
}

/// How long each size runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    Iters(u64),
    Duration(Duration),
}

/// What to run (`mlx5 bench` options).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub test: Test,
    /// Message sizes, one table row each.
    pub sizes: Vec<usize>,
    pub limit: Limit,
    /// Outstanding work requests of a bandwidth test.
    pub tx_depth: u32,
    /// Every `cq_mod`-th request of a bandwidth test is signaled.
    pub cq_mod: u32,
    /// Latency-test messages up to this many bytes are sent inline.
    pub inline: u32,
    pub json: bool,
    /// Draw the progress bar even when standard error is not a terminal.
    pub progress: bool,
    /// `None`: two simulated devices on a wire; `"sim"`: one simulated device (loopback); else a PCI address.
    pub device: Option<String>,
    /// Simulated firmware and datapath on their own threads.
    pub threaded: bool,
    /// The longest any wait may go without progress.
    pub timeout: Duration,
    /// The simulated ports' link layer.
    pub port_type: PortType,
    /// Where every firmware command goes (`--trace`); with two devices each line names its device.
    pub trace: Option<SharedTrace>,
    /// The capture simulated ports write their frames to (`--pcap`).
    pub pcap: Option<mlx5_sim::pcap::PcapSink>,
}

/// A number as the workspace's argument layer reads it: digits only (no sign or blank); a value past the type's
/// range is refused by the caller's range check as "must be between".
fn number<T: mlx5_args::Number>(opt: &str, v: Option<&str>, what: &str) -> Result<T> {
    let v = v.ok_or_else(|| BenchError::Usage(format!("{opt} needs {what}")))?;
    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(BenchError::Usage(format!("{opt}: {v:?} is not {what}")));
    }
    v.parse().map_err(|_| BenchError::Usage(format!("{opt}: {v:?} is too large")))
}

/// The shortest `--duration` / `--timeout`: long enough to time at least one message.
const MIN_SECONDS: f64 = 0.001;

/// A plain decimal number of seconds (no exponent, `inf` or `nan`), from a millisecond to a day.
fn seconds(opt: &str, v: Option<&str>) -> Result<Duration> {
    let v = v.ok_or_else(|| BenchError::Usage(format!("{opt} needs a number of seconds")))?;
    mlx5_args::seconds(opt, v, MIN_SECONDS, 86400.0).map_err(|e| BenchError::Usage(e.to_string()))
}

fn in_range<T: PartialOrd + std::fmt::Display>(opt: &str, v: T, lo: T, hi: T) -> Result<T> {
    if v < lo || v > hi {
        return Err(BenchError::Usage(format!("{opt} must be between {lo} and {hi}, not {v}")));
    }
    Ok(v)
}

impl Options {
    /// Parses what follows `bench` on the command line: the test name and its options.
    ///
    /// ```
    /// use mlx5_tool::perftest::{Limit, Options, Test};
    /// let o = Options::parse(&["write_bw", "--all", "--max-size", "4096", "--iters", "10"])?;
    /// assert_eq!((o.test, o.sizes.len(), o.limit), (Test::WriteBw, 12, Limit::Iters(10))); // 2, 4, .. 4096
    /// assert!(Options::parse(&["write_bw", "--size", "0"]).is_err());
    /// # Ok::<(), mlx5_tool::perftest::BenchError>(())
    /// ```
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Options> {
        let mut test = None;
        let (mut size, mut all, mut max_size) = (None, false, None);
        let (mut iters, mut duration) = (None, None);
        let (mut tx_depth, mut cq_mod, mut inline) = (None, None, None);
        let (mut json, mut progress, mut timeout) = (false, false, STALL_TIMEOUT);
        let mut it = args.iter().map(AsRef::as_ref);
        while let Some(a) = it.next() {
            match a {
                "--size" | "-s" => {
                    size = Some(in_range(a, number::<usize>(a, it.next(), "a byte count")?, 1, MAX_SIZE)?)
                }
                "--all" | "-a" => all = true,
                "--max-size" => {
                    max_size = Some(in_range(a, number::<usize>(a, it.next(), "a byte count")?, 2, MAX_SIZE)?)
                }
                "--iters" | "-n" => iters = Some(in_range(a, number::<u64>(a, it.next(), "a number")?, 1, 1 << 40)?),
                "--duration" | "-D" => duration = Some(seconds(a, it.next())?),
                "--tx-depth" | "-t" => {
                    tx_depth = Some(in_range(a, number(a, it.next(), "a number")?, 1, MAX_TX_DEPTH)?)
                }
                "--cq-mod" | "-Q" => cq_mod = Some(in_range(a, number(a, it.next(), "a number")?, 1, MAX_TX_DEPTH)?),
                "--inline" | "-I" => inline = Some(in_range(a, number(a, it.next(), "a byte count")?, 0, 912)?),
                "--timeout" => timeout = seconds(a, it.next())?,
                "--json" => json = true,
                "--progress" => progress = true,
                s if s.starts_with('-') => {
                    return Err(BenchError::Usage(format!("unknown option {}", mlx5_args::one_line(s))))
                }
                s if test.is_none() => test = Some(s.parse::<Test>()?),
                s => return Err(BenchError::Usage(format!("unexpected argument {s:?}"))),
            }
        }
        let test = test
            .ok_or_else(|| BenchError::Usage("which test? send_bw, write_bw, read_bw, send_lat or write_lat".into()))?;
        if all && size.is_some() {
            return Err(BenchError::Usage("--size and --all exclude each other".into()));
        }
        if max_size.is_some() && !all {
            return Err(BenchError::Usage("--max-size goes with --all".into()));
        }
        if iters.is_some() && duration.is_some() {
            return Err(BenchError::Usage("--iters and --duration exclude each other".into()));
        }
        if all && duration.is_some() {
            return Err(BenchError::Usage("--all runs a fixed number of iterations per size, not --duration".into()));
        }
        if inline.is_some() && test.is_bw() {
            return Err(BenchError::Usage("--inline applies to the latency tests".into()));
        }
        if (tx_depth.is_some() || cq_mod.is_some()) && !test.is_bw() {
            return Err(BenchError::Usage(
                "--tx-depth and --cq-mod apply to the bandwidth tests (a latency test has one message in flight)"
                    .into(),
            ));
        }
        let sizes = if all {
            let max = max_size.unwrap_or(DEFAULT_MAX_SIZE);
            std::iter::successors(Some(2usize), |s| Some(s * 2)).take_while(|&s| s <= max).collect()
        } else {
            vec![size.unwrap_or(test.default_size())]
        };
        let limit = match duration {
            Some(d) => Limit::Duration(d),
            None => Limit::Iters(iters.unwrap_or(DEFAULT_ITERS)),
        };
        Ok(Options {
            test,
            sizes,
            limit,
            tx_depth: tx_depth.unwrap_or(DEFAULT_TX_DEPTH),
            cq_mod: cq_mod.unwrap_or(DEFAULT_CQ_MOD),
            inline: inline.unwrap_or(test.default_inline()),
            json,
            progress,
            device: None,
            threaded: false,
            timeout,
            port_type: PortType::default(),
            trace: None,
            pcap: None,
        })
    }

    /// The queue depth used: perftest lowers it to the iteration count.
    pub fn depth(&self) -> u32 {
        match self.limit {
            Limit::Iters(n) => self.tx_depth.min(u32::try_from(n).unwrap_or(u32::MAX)),
            Limit::Duration(_) => self.tx_depth,
        }
    }

    /// The CQ moderation used: at most the depth, so a signaled request is always outstanding.
    pub fn moderation(&self) -> u32 {
        self.cq_mod.min(self.depth())
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Results and their statistics

/// One bandwidth table row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BwRow {
    pub bytes: usize,
    pub iterations: u64,
    /// MB/sec (2^20 bytes per second).
    pub bw_peak: f64,
    pub bw_avg: f64,
    /// Millions of messages per second.
    pub msg_rate: f64,
}

impl BwRow {
    /// The figures of `msgs` messages of `bytes` each, the first posted at `first_post_ns` and the last completed
    /// at `last_done_ns`; `peak` is the best window, `(messages, ns)`, if one was measured.
    pub fn compute(bytes: usize, msgs: u64, first_post_ns: u64, last_done_ns: u64, peak: Option<(u64, u64)>) -> BwRow {
        let secs = (last_done_ns.saturating_sub(first_post_ns).max(1)) as f64 / 1e9;
        let bw_avg = bytes as f64 * msgs as f64 / secs / MB;
        let bw_peak = match peak {
            Some((n, ns)) => bytes as f64 * n as f64 / (ns.max(1) as f64 / 1e9) / MB,
            None => bw_avg,
        };
        BwRow { bytes, iterations: msgs, bw_peak: bw_peak.max(bw_avg), bw_avg, msg_rate: msgs as f64 / secs / 1e6 }
    }
}

/// Latency statistics over samples in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatStats {
    pub min: f64,
    pub max: f64,
    /// The median.
    pub typical: f64,
    pub avg: f64,
    /// Population standard deviation.
    pub stdev: f64,
    pub p99: f64,
    pub p99_9: f64,
}

impl LatStats {
    /// `None` without samples.
    pub fn of(samples: &[f64]) -> Option<LatStats> {
        let mut s = Samples::new(samples.len().max(1));
        samples.iter().for_each(|&x| s.push(x));
        s.stats()
    }
}

/// Latency samples in bounded memory: min, max, mean and variance over every sample (Welford's running update),
/// the median and percentiles over at most `cap` of them, a uniform random subset once there are more (reservoir
/// sampling), so a long `--duration` run cannot exhaust memory. Up to `cap` samples every figure is exact.
#[derive(Debug, Clone)]
pub struct Samples {
    count: u64,
    mean: f64,
    m2: f64,
    min: f64,
    max: f64,
    kept: Vec<f64>,
    cap: usize,
    rng: u64,
}

/// Samples kept for the percentiles of one row (8 MiB).
const KEPT_SAMPLES: usize = 1 << 20;

impl Samples {
    pub fn new(cap: usize) -> Samples {
        let cap = cap.max(1);
        Samples {
            count: 0,
            mean: 0.0,
            m2: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
            kept: Vec::with_capacity(cap.min(KEPT_SAMPLES)),
            cap,
            rng: 0x2545_f491_4f6c_dd1d,
        }
    }

    pub fn push(&mut self, x: f64) {
        self.count += 1;
        let d = x - self.mean;
        self.mean += d / self.count as f64;
        self.m2 += d * (x - self.mean);
        self.min = self.min.min(x);
        self.max = self.max.max(x);
        if self.kept.len() < self.cap {
            self.kept.push(x);
        } else {
            // Sample k (1-based) replaces a kept one with probability cap / k.
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            let j = self.rng % self.count;
            if let Some(slot) = self.kept.get_mut(j as usize) {
                *slot = x;
            }
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// `None` without samples.
    pub fn stats(&self) -> Option<LatStats> {
        if self.count == 0 {
            return None;
        }
        let mut s = self.kept.clone();
        s.sort_by(f64::total_cmp);
        Some(LatStats {
            min: self.min,
            max: self.max,
            typical: median(&s),
            avg: self.mean,
            stdev: (self.m2 / self.count as f64).max(0.0).sqrt(),
            p99: percentile(&s, 990),
            p99_9: percentile(&s, 999),
        })
    }
}

/// The median of sorted samples (the mean of the middle two for an even count); 0 for none.
pub fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n.is_multiple_of(2) => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
        _ => sorted[n / 2],
    }
}

/// The nearest-rank percentile of sorted samples, `per_mille` thousandths (990 is the 99th percentile): the
/// smallest sample with at least that share of samples at or below it. Integer rank arithmetic, so 99.9% of 1000
/// samples is exactly the 999th. 0 for none.
pub fn percentile(sorted: &[f64], per_mille: u32) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let n = sorted.len() as u64;
    let rank = (n * u64::from(per_mille.min(1000))).div_ceil(1000).clamp(1, n);
    sorted[(rank - 1) as usize]
}

/// One latency table row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatRow {
    pub bytes: usize,
    pub iterations: u64,
    pub stats: LatStats,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Row {
    Bw(BwRow),
    Lat(LatRow),
}

impl Row {
    /// The row under perftest's heading, each figure starting below its column title.
    pub fn text(&self) -> String {
        match self {
            Row::Bw(r) => columns(
                BW_HEADING,
                &BW_COLUMNS,
                &[
                    r.bytes.to_string(),
                    r.iterations.to_string(),
                    format!("{:.2}", r.bw_peak),
                    format!("{:.2}", r.bw_avg),
                    format!("{:.6}", r.msg_rate),
                ],
            ),
            Row::Lat(r) => {
                let s = &r.stats;
                let f = |v: f64| format!("{v:.2}");
                columns(
                    LAT_HEADING,
                    &LAT_COLUMNS,
                    &[
                        r.bytes.to_string(),
                        r.iterations.to_string(),
                        f(s.min),
                        f(s.max),
                        f(s.typical),
                        f(s.avg),
                        f(s.stdev),
                        f(s.p99),
                        f(s.p99_9),
                    ],
                )
            }
        }
    }

    pub fn json(&self) -> serde_json::Value {
        match self {
            Row::Bw(r) => serde_json::json!({
                "bytes": r.bytes,
                "iterations": r.iterations,
                "bw_peak_mb_per_sec": r.bw_peak,
                "bw_avg_mb_per_sec": r.bw_avg,
                "msg_rate_mpps": r.msg_rate,
            }),
            Row::Lat(r) => serde_json::json!({
                "bytes": r.bytes,
                "iterations": r.iterations,
                "t_min_us": r.stats.min,
                "t_max_us": r.stats.max,
                "t_typical_us": r.stats.typical,
                "t_avg_us": r.stats.avg,
                "t_stdev_us": r.stats.stdev,
                "t_p99_us": r.stats.p99,
                "t_p99_9_us": r.stats.p99_9,
            }),
        }
    }
}

/// Places each value at the column where its title starts in `heading` (at least one space apart).
fn columns(heading: &str, titles: &[&str], values: &[String]) -> String {
    let mut line = String::new();
    for (title, v) in titles.iter().zip(values) {
        let at = heading.find(title).unwrap_or(line.len());
        if line.len() < at {
            line.push_str(&" ".repeat(at - line.len()));
        } else if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(v);
    }
    line
}

/// A whole run: the setup and one row per size.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub test: Test,
    /// `sim`, `sim-loopback` or the PCI address.
    pub device: String,
    pub link_layer: LinkLayer,
    pub tx_depth: u32,
    pub cq_mod: u32,
    pub inline: u32,
    pub mtu: u32,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn json(&self) -> String {
        serde_json::json!({
            "test": self.test.name(),
            "device": self.device,
            "transport": "RC",
            "link_layer": link_name(self.link_layer),
            "mtu": self.mtu,
            "tx_depth": self.tx_depth,
            "cq_mod": self.cq_mod,
            "inline": self.inline,
            "verified": true,
            "rows": self.rows.iter().map(Row::json).collect::<Vec<_>>(),
        })
        .to_string()
    }
}

fn link_name(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::Ethernet => "Ethernet",
        LinkLayer::InfiniBand => "IB",
    }
}

/// perftest's banner: the test, the device and the connection's parameters, then the column heading.
fn header(r: &Report, about: &str, limit: Limit) -> String {
    let mut h = format!("{RULE}\n{:>width$}\n", r.test.title(), width = 20 + r.test.title().len());
    h += &format!(" Device          : {} ({about})\n", r.device);
    h += " Number of qps   : 1\t\tTransport type : IB\n";
    h += " Connection type : RC\t\tUsing SRQ      : OFF\n";
    if r.test.is_bw() {
        h += &format!(" TX depth        : {}\n", r.tx_depth);
        h += &format!(" CQ Moderation   : {}\n", r.cq_mod);
    }
    h += &format!(" Mtu             : {}[B]\n", r.mtu);
    h += &format!(" Link type       : {}\n", link_name(r.link_layer));
    h += &format!(" Max inline data : {}[B]\n", r.inline);
    match limit {
        Limit::Iters(n) => h += &format!(" Iterations      : {n} per size\n"),
        Limit::Duration(d) => h += &format!(" Duration        : {:.1} s\n", d.as_secs_f64()),
    }
    h += " Data check      : ON\n";
    h += RULE;
    h.push('\n');
    h += if r.test.is_bw() { BW_HEADING } else { LAT_HEADING };
    h.push('\n');
    h
}

// ---------------------------------------------------------------------------------------------------------------
// Progress on standard error

/// A progress bar on standard error, drawn only once a run has taken a second, at most ten times a second, and
/// wiped before anything goes to standard output.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    next_draw: Instant,
    drawn: usize,
}

impl Progress {
    /// Enabled when `forced` or standard error is a terminal.
    pub fn new(forced: bool) -> Progress {
        Progress {
            enabled: forced || std::io::stderr().is_terminal(),
            next_draw: Instant::now() + Duration::from_secs(1),
            drawn: 0,
        }
    }

    /// Shows `fraction` (0..=1) of the whole run done, with `label`.
    pub fn update(&mut self, fraction: f64, label: &str) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if now < self.next_draw {
            return;
        }
        self.next_draw = now + Duration::from_millis(100);
        let bar = bar(fraction, label);
        let pad = " ".repeat(self.drawn.saturating_sub(bar.len()));
        // Progress is a courtesy: a closed standard error loses it and nothing else.
        let mut e = std::io::stderr().lock();
        let _ = write!(e, "\r{bar}{pad}");
        let _ = e.flush();
        self.drawn = bar.len();
    }

    /// Wipes the bar, if drawn.
    pub fn clear(&mut self) {
        if self.drawn > 0 {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r{}\r", " ".repeat(self.drawn));
            let _ = e.flush();
            self.drawn = 0;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.clear();
    }
}

/// `[#########...........]  45% label`, 30 cells.
pub fn bar(fraction: f64, label: &str) -> String {
    const CELLS: usize = 30;
    let f = if fraction.is_finite() { fraction.clamp(0.0, 1.0) } else { 0.0 };
    let full = (f * CELLS as f64).round() as usize;
    format!("[{}{}] {:>3}% {label}", "#".repeat(full), ".".repeat(CELLS - full), (f * 100.0).floor() as u32)
}

// ---------------------------------------------------------------------------------------------------------------
// Running

/// Opens the endpoints `opts` names, runs the test, and writes the table (row by row) or the JSON object through
/// `emit`.
pub fn run(opts: &Options, emit: &mut dyn FnMut(&str) -> std::io::Result<()>) -> Result<Report> {
    let cfg = SimConfig {
        mode: if opts.threaded { Mode::Threaded } else { Mode::Inline },
        port_type: opts.port_type,
        pcap: opts.pcap.clone(),
        ..SimConfig::default()
    };
    let how = if opts.threaded { "threaded" } else { "in-line" };
    let trace = |name| opts.trace.as_ref().map(|t| Box::new(t.device(name)) as mlx5_verbs::Tracer);
    match opts.device.as_deref() {
        None => {
            // Two devices: one trace, each line naming its device.
            let (da, db) = (SimDevice::new(cfg.clone()), SimDevice::new(cfg.next_host()));
            da.connect(&db);
            let a = Context::open_sim_device_with(da, trace(Some("mlx5_0")))?;
            let b = Context::open_sim_device_with(db, trace(Some("mlx5_1")))?;
            let about = format!("two simulated ConnectX-5 on a simulated wire, {how} firmware");
            bench(&a, &b, opts, "sim", &about, emit)
        }
        Some("sim") => {
            let c = Context::open_sim_device_with(SimDevice::new(cfg), trace(None))?;
            let about = format!("one simulated ConnectX-5, loopback, {how} firmware");
            bench(&c, &c, opts, "sim-loopback", &about, emit)
        }
        Some(spec) => {
            let c = Context::open_vfio_with(spec.parse().map_err(VerbsError::Vfio)?, trace(None))?;
            bench(&c, &c, opts, spec, "both QPs on this device, loopback", emit)
        }
    }
}

/// One side of the connection: what its datapath calls go through.
struct Side<'a> {
    name: &'static str,
    cq: &'a CompletionQueue<'a>,
    qp: &'a QueuePair<'a, Rts>,
    mr: &'a MemoryRegion<'a>,
}

/// Both sides and the run's parameters. Each buffer is `2 * half` bytes: the source half, then the destination.
struct Pair<'a> {
    test: Test,
    client: Side<'a>,
    server: Side<'a>,
    half: usize,
    depth: u32,
    cq_mod: u32,
    inline: usize,
    limit: Limit,
    stall: Duration,
}

/// What a run keeps fixed and the tests of failure paths change: the rights of the server's buffer, and how long a
/// wait may go without progress.
struct Tuning {
    server_rights: Access,
    stall: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning { server_rights: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ, stall: STALL_TIMEOUT }
    }
}

/// Sets up both sides of `opts.test` (client on `a`, server on `b`; the same context for loopback), connects them
/// and hands the pair to `f`. Everything is destroyed when `f` returns.
fn with_pair<R>(
    a: &Context,
    b: &Context,
    opts: &Options,
    tuning: Tuning,
    f: impl FnOnce(&Pair<'_>) -> Result<R>,
) -> Result<R> {
    let test = opts.test;
    // A latency test has one message in flight, each signaled.
    let depth = if test.is_bw() { opts.depth() } else { 1 };
    let max_size = opts.sizes.iter().copied().max().unwrap_or(1);
    let half = if test.is_bw() { max_size * (SLOT_BUDGET / max_size).clamp(1, depth as usize) } else { max_size };
    let inline = if test.is_bw() { 0 } else { opts.inline };
    let cap = QpCap {
        max_send_wr: depth,
        max_recv_wr: depth.max(LAT_RECVS),
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: inline,
    };
    let rights = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
    let (pd_a, pd_b) = (a.alloc_pd()?, b.alloc_pd()?);
    let cqe = 2 * cap.max_send_wr + cap.max_recv_wr;
    let (cq_a, cq_b) = (a.create_cq(cqe)?, b.create_cq(cqe)?);
    let (mut buf_a, mut buf_b) = (a.alloc_buffer(2 * half)?, b.alloc_buffer(2 * half)?);
    let mr_a = pd_a.register(&mut buf_a, rights)?;
    let mr_b = pd_b.register(&mut buf_b, tuning.server_rights)?;
    let qa = pd_a.create_qp(QpType::Rc, &cq_a, &cq_a, cap)?;
    let qb = pd_b.create_qp(QpType::Rc, &cq_b, &cq_b, cap)?;
    let (ra, rb) = (a.remote_qp(&qa)?, b.remote_qp(&qb)?);
    let qa = qa.connect_rc(rb, rights)?;
    let qb = qb.connect_rc(ra, rights)?;
    let pair = Pair {
        test,
        client: Side { name: "client", cq: &cq_a, qp: &qa, mr: &mr_a },
        server: Side { name: "server", cq: &cq_b, qp: &qb, mr: &mr_b },
        half,
        depth,
        cq_mod: if test.is_bw() { opts.moderation() } else { 1 },
        inline: inline as usize,
        limit: opts.limit,
        stall: tuning.stall,
    };
    if test == Test::SendLat {
        // Each iteration consumes one receive per side and posts its replacement, so these stay for the run.
        for side in [&pair.client, &pair.server] {
            let sge = recv_sge(side, half);
            let rs: Vec<RecvWr<'_>> = (0..u64::from(LAT_RECVS)).map(|i| wr::recv(i, &sge)).collect();
            side.qp.post_recv(&rs)?;
        }
    }
    f(&pair)
}

/// Runs `opts.test` between a client QP on `a` and a server QP on `b` (the same context for loopback), every size
/// in turn. `device` names the endpoints in the report, `about` describes them in the banner.
pub fn bench(
    a: &Context,
    b: &Context,
    opts: &Options,
    device: &str,
    about: &str,
    emit: &mut dyn FnMut(&str) -> std::io::Result<()>,
) -> Result<Report> {
    with_pair(a, b, opts, Tuning { stall: opts.timeout, ..Tuning::default() }, |pair| {
        let test = opts.test;
        let mut report = Report {
            test,
            device: device.to_string(),
            link_layer: a.link_layer(),
            tx_depth: pair.depth,
            cq_mod: pair.cq_mod,
            inline: pair.inline as u32,
            // The MTU `connect_rc` sets (`RtrAttr::rc`).
            mtu: 1024,
            rows: Vec::new(),
        };
        let mut progress = Progress::new(opts.progress);
        let mut say = |p: &mut Progress, text: &str| {
            p.clear();
            emit(text).map_err(BenchError::Output)
        };
        if !opts.json {
            say(&mut progress, &header(&report, about, opts.limit))?;
        }
        let n = opts.sizes.len();
        for (k, &size) in opts.sizes.iter().enumerate() {
            let label = format!("{} {size} bytes", test.name());
            let mut tick = |f: f64| progress.update((k as f64 + f) / n as f64, &label);
            let row = if test.is_bw() {
                Row::Bw(run_bw(pair, size, &mut tick)?)
            } else {
                Row::Lat(run_lat(pair, size, &mut tick)?)
            };
            report.rows.push(row);
            if !opts.json {
                say(&mut progress, &format!("{}\n", row.text()))?;
            }
        }
        if opts.json {
            say(&mut progress, &format!("{}\n", report.json()))?;
        } else {
            say(&mut progress, &format!("{RULE}\n"))?;
        }
        Ok(report)
    })
}

fn ns_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A pattern that differs per seed and never repeats with a short period, so a message in the wrong slot or from
/// another size is caught.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((i ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8).collect()
}

/// Compares the bytes at `offset` of `side`'s buffer `mr` with `want`.
fn verify(
    test: Test,
    size: usize,
    mr: &MemoryRegion<'_>,
    side: &'static str,
    offset: usize,
    want: &[u8],
) -> Result<()> {
    let mut got = vec![0; want.len()];
    mr.read(offset, &mut got)?;
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None => Ok(()),
        Some(i) => Err(BenchError::Mismatch {
            test: test.name(),
            bytes: size,
            side,
            offset: offset + i,
            got: got[i],
            want: want[i],
        }),
    }
}

/// A wait without progress lasts at most `stall` (`--timeout`).
struct Watchdog {
    test: Test,
    stall: Duration,
    last: Instant,
}

impl Watchdog {
    fn new(p: &Pair<'_>) -> Self {
        Watchdog { test: p.test, stall: p.stall, last: Instant::now() }
    }

    fn progressed(&mut self) {
        self.last = Instant::now();
    }

    fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        if self.last.elapsed() >= self.stall {
            return Err(BenchError::Timeout { test: self.test.name(), what: what(), after: self.stall });
        }
        Ok(())
    }
}

/// The best rate over `window` consecutive messages: post times kept in a ring of twice the window (at most
/// `window` messages are outstanding, so a window's first post is still there when its last completes).
#[derive(Debug)]
pub struct PeakWindow {
    window: u64,
    posts: Vec<u64>,
    best_ns: u64,
}

impl PeakWindow {
    /// Windows of `window` messages (at least one), with at most `window` outstanding at any time.
    pub fn new(window: u64) -> Self {
        let window = window.max(1);
        PeakWindow { window, posts: vec![0; (2 * window) as usize], best_ns: u64::MAX }
    }

    fn slot(&self, msg: u64) -> usize {
        (msg % (2 * self.window)) as usize
    }

    /// Message `msg` was posted at `ns`.
    pub fn posted(&mut self, msg: u64, ns: u64) {
        let s = self.slot(msg);
        self.posts[s] = ns;
    }

    /// Message `msg` completed at `ns`.
    pub fn completed(&mut self, msg: u64, ns: u64) {
        if msg + 1 >= self.window {
            let first = self.posts[self.slot(msg + 1 - self.window)];
            self.best_ns = self.best_ns.min(ns.saturating_sub(first));
        }
    }

    /// `(messages, ns)` of the best window, once one has completed.
    pub fn best(&self) -> Option<(u64, u64)> {
        (self.best_ns != u64::MAX).then_some((self.window, self.best_ns))
    }
}

/// Checks a completion's status; the error names the request.
fn check_status(test: Test, side: &Side<'_>, w: &WorkCompletion, size: usize) -> Result<()> {
    if w.status == WcStatus::Success {
        return Ok(());
    }
    let op = if side.name == "server" && test.is_send() { "RECV" } else { test.op() };
    Err(BenchError::Completion {
        test: test.name(),
        side: side.name,
        wr_id: w.wr_id,
        op,
        bytes: size,
        status: w.status,
        vendor_err: w.vendor_err,
    })
}

fn unexpected(test: Test, side: &Side<'_>, w: &WorkCompletion) -> BenchError {
    BenchError::Unexpected {
        test: test.name(),
        side: side.name,
        wr_id: w.wr_id,
        opcode: w.opcode,
        byte_len: w.byte_len,
    }
}

fn requester_opcode(test: Test) -> WcOpcode {
    match test {
        Test::SendBw | Test::SendLat => WcOpcode::Send,
        Test::WriteBw | Test::WriteLat => WcOpcode::RdmaWrite,
        Test::ReadBw => WcOpcode::RdmaRead,
    }
}

/// One bandwidth measurement at `size`.
fn run_bw(p: &Pair<'_>, size: usize, tick: &mut dyn FnMut(f64)) -> Result<BwRow> {
    let test = p.test;
    let send = test == Test::SendBw;
    let slots = (p.half / size).clamp(1, p.depth as usize);
    let used = slots * size;
    // The source: the client's for SEND and WRITE, the server's for READ; the destination is the other half.
    let (src, dst) = if test == Test::ReadBw { (&p.server, &p.client) } else { (&p.client, &p.server) };
    let want = pattern(size as u64 * 0x1_0000, used);
    src.mr.write(0, &want)?;
    dst.mr.write(p.half, &vec![0; used])?;
    let sz = size as u32;
    let local: Vec<Sge> =
        (0..slots)
            .map(|s| {
                if test == Test::ReadBw {
                    p.client.mr.sge(p.half + s * size, sz)
                } else {
                    p.client.mr.sge(s * size, sz)
                }
            })
            .collect();
    let remote: Vec<RemoteBuf> = (0..slots)
        .map(
            |s| if test == Test::ReadBw { p.server.mr.remote(s * size) } else { p.server.mr.remote(p.half + s * size) },
        )
        .collect();
    let recv_sges: Vec<Sge> =
        if send { (0..slots).map(|s| p.server.mr.sge(p.half + s * size, sz)).collect() } else { Vec::new() };

    let depth = u64::from(p.depth);
    let cq_mod = u64::from(p.cq_mod);
    let (mut target, duration) = match p.limit {
        Limit::Iters(n) => (n, None),
        Limit::Duration(d) => (u64::MAX, Some(d)),
    };
    let mut peak = PeakWindow::new(if duration.is_some() { depth } else { depth.min(target) });
    let (mut posted, mut completed, mut recv_posted, mut recv_done) = (0u64, 0u64, 0u64, 0u64);
    let mut last_done_ns = 0;
    let mut wrs: Vec<SendWr<'_>> = Vec::with_capacity(p.depth as usize);
    let mut rwrs: Vec<RecvWr<'_>> = Vec::with_capacity(p.depth as usize);
    let mut wc = [WorkCompletion::default(); POLL_BATCH];
    let mut dog = Watchdog::new(p);
    let start = Instant::now();
    loop {
        if let Some(d) = duration {
            if target == u64::MAX && start.elapsed() >= d {
                // Time is up: stop after the next signaled request, so nothing is left unretired.
                // At least one request: a run that measured nothing would report nothing as verified.
                target = if posted.is_multiple_of(cq_mod) { posted } else { posted + 1 }.max(1);
            }
        }
        if completed == target && (!send || recv_done == target) {
            break;
        }
        // Receives go first, so every SEND finds one.
        if send {
            let n = (depth - (recv_posted - recv_done)).min(target - recv_posted);
            if n > 0 {
                rwrs.clear();
                for i in recv_posted..recv_posted + n {
                    let s = (i % slots as u64) as usize;
                    rwrs.push(wr::recv(i, &recv_sges[s..s + 1]));
                }
                p.server.qp.post_recv(&rwrs)?;
                recv_posted += n;
            }
        }
        let mut n = (depth - (posted - completed)).min(target - posted);
        if send {
            n = n.min(recv_posted - posted);
        }
        if n > 0 {
            wrs.clear();
            for i in posted..posted + n {
                let s = (i % slots as u64) as usize;
                let sg = &local[s..s + 1];
                let w = match test {
                    Test::SendBw => wr::send(i, sg),
                    Test::ReadBw => wr::rdma_read(i, sg, remote[s]),
                    _ => wr::rdma_write(i, sg, remote[s]),
                };
                let signaled = (i + 1).is_multiple_of(cq_mod) || i + 1 == target;
                wrs.push(if signaled { w } else { w.unsignaled() });
            }
            let t = ns_since(start);
            for i in posted..posted + n {
                peak.posted(i, t);
            }
            p.client.qp.post_send(&wrs)?;
            posted += n;
        }
        let got = p.client.cq.poll(&mut wc)?;
        if got > 0 {
            let t = ns_since(start);
            for w in &wc[..got] {
                check_status(test, &p.client, w, size)?;
                if w.opcode != requester_opcode(test) || w.wr_id < completed || w.wr_id >= posted {
                    return Err(unexpected(test, &p.client, w));
                }
                for i in completed..=w.wr_id {
                    peak.completed(i, t);
                }
                completed = w.wr_id + 1;
                last_done_ns = t;
            }
            dog.progressed();
        }
        if send {
            let got = p.server.cq.poll(&mut wc)?;
            for w in &wc[..got] {
                check_status(test, &p.server, w, size)?;
                if w.opcode != WcOpcode::Recv || w.wr_id != recv_done || w.byte_len as usize != size {
                    return Err(unexpected(test, &p.server, w));
                }
                recv_done += 1;
            }
            if got > 0 {
                dog.progressed();
            }
        }
        dog.check(|| format!("completions ({posted} posted, {completed} completed, {recv_done} received)"))?;
        tick(match (duration, p.limit) {
            (Some(d), _) => start.elapsed().as_secs_f64() / d.as_secs_f64(),
            (None, Limit::Iters(n)) => completed as f64 / n as f64,
            _ => 0.0,
        });
    }
    let checked = (slots as u64).min(completed) as usize * size;
    verify(test, size, dst.mr, dst.name, p.half, &want[..checked])?;
    Ok(BwRow::compute(size, completed, 0, last_done_ns, peak.best()))
}

/// Per-side counts of a latency test.
#[derive(Debug, Default)]
struct Counts {
    sent: u64,
    send_done: u64,
    received: u64,
}

/// Takes what `side`'s CQ holds: send completions and (SEND tests) receives, each checked.
fn reap(test: Test, side: &Side<'_>, n: &mut Counts, size: usize, wc: &mut [WorkCompletion]) -> Result<bool> {
    let got = side.cq.poll(wc)?;
    for w in &wc[..got] {
        check_status(test, side, w, size)?;
        match w.opcode {
            o if o == requester_opcode(test) => n.send_done += 1,
            WcOpcode::Recv if test == Test::SendLat && w.byte_len as usize == size => n.received += 1,
            _ => return Err(unexpected(test, side, w)),
        }
    }
    Ok(got > 0)
}

/// A `send_lat` receive: the whole destination half, so the receives left posted after one size of a sweep fit
/// any later size.
fn recv_sge(side: &Side<'_>, half: usize) -> [Sge; 1] {
    [side.mr.sge(half, half as u32)]
}

/// One latency measurement at `size`.
fn run_lat(p: &Pair<'_>, size: usize, tick: &mut dyn FnMut(f64)) -> Result<LatRow> {
    let test = p.test;
    let send = test == Test::SendLat;
    let inline = size <= p.inline;
    let sz = size as u32;
    // Each side sends from its source half into the peer's destination half; the last byte carries a tag.
    let mut msg = [pattern(size as u64 * 0x1_0000 + 1, size), pattern(size as u64 * 0x1_0000 + 2, size)];
    let sides = [&p.client, &p.server];
    for (s, m) in sides.iter().zip(&msg) {
        s.mr.write(0, m)?;
        s.mr.write(p.half, &vec![0; size])?;
    }
    let sges = [[p.client.mr.sge(0, sz)], [p.server.mr.sge(0, sz)]];
    let to = [p.server.mr.remote(p.half), p.client.mr.remote(p.half)];
    let recv_sges = [recv_sge(&p.client, p.half), recv_sge(&p.server, p.half)];
    let mut n = [Counts::default(), Counts::default()];
    let mut wc = [WorkCompletion::default(); POLL_BATCH];
    let mut samples = Samples::new(match p.limit {
        Limit::Iters(it) => usize::try_from(it).unwrap_or(usize::MAX).min(KEPT_SAMPLES),
        Limit::Duration(_) => KEPT_SAMPLES,
    });
    let start = Instant::now();
    let mut i = 0u64;
    loop {
        let more = match p.limit {
            Limit::Iters(it) => i < it,
            Limit::Duration(d) => i == 0 || start.elapsed() < d,
        };
        if !more {
            break;
        }
        let tag = (i % 255 + 1) as u8;
        let t0 = Instant::now();
        for (from, to_side) in [(0usize, 1usize), (1, 0)] {
            msg[from][size - 1] = tag;
            let w = if inline {
                let op = wr::send(i, &[]);
                let w = if send { op } else { wr::rdma_write(i, &[], to[from]) };
                SendWr { inline: Some(&msg[from][..]), ..w }
            } else {
                sides[from].mr.write(size - 1, &[tag])?;
                if send {
                    wr::send(i, &sges[from])
                } else {
                    wr::rdma_write(i, &sges[from], to[from])
                }
            };
            sides[from].qp.post_send(&[w])?;
            n[from].sent += 1;
            // Wait for the message at the other side: a receive completion, or the tag in the last byte.
            let mut dog = Watchdog::new(p);
            let want = n[to_side].received + 1;
            loop {
                let arrived = if send {
                    n[to_side].received >= want
                } else {
                    let mut last = [0u8];
                    sides[to_side].mr.read(p.half + size - 1, &mut last)?;
                    last[0] == tag
                };
                if arrived {
                    break;
                }
                let (a, b) = n.split_at_mut(1);
                let (nf, nt) = if from == 0 { (&mut a[0], &mut b[0]) } else { (&mut b[0], &mut a[0]) };
                if reap(test, sides[from], nf, size, &mut wc)? | reap(test, sides[to_side], nt, size, &mut wc)? {
                    dog.progressed();
                }
                dog.check(|| format!("iteration {i}'s message at the {}", sides[to_side].name))?;
            }
            if send {
                sides[to_side].qp.post_recv(&[wr::recv(i, &recv_sges[to_side])])?;
            }
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e6 / 2.0);
        // Reap both sends before the next ping: one message in flight each way at most.
        let mut dog = Watchdog::new(p);
        while n[0].send_done < n[0].sent || n[1].send_done < n[1].sent {
            let (a, b) = n.split_at_mut(1);
            if reap(test, sides[0], &mut a[0], size, &mut wc)? | reap(test, sides[1], &mut b[0], size, &mut wc)? {
                dog.progressed();
            }
            dog.check(|| format!("iteration {i}'s send completions"))?;
        }
        i += 1;
        tick(match p.limit {
            Limit::Iters(it) => i as f64 / it as f64,
            Limit::Duration(d) => start.elapsed().as_secs_f64() / d.as_secs_f64(),
        });
    }
    verify(test, size, p.server.mr, p.server.name, p.half, &msg[0])?;
    verify(test, size, p.client.mr, p.client.name, p.half, &msg[1])?;
    // The loop above runs at least once, so there is a sample.
    let stats = samples.stats().ok_or_else(|| BenchError::Usage("no latency samples".into()))?;
    Ok(LatRow { bytes: size, iterations: i, stats })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_verbs::DeviceKind;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let s: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&s, 990), 990.0);
        assert_eq!(percentile(&s, 999), 999.0);
        assert_eq!(percentile(&s, 1000), 1000.0);
        assert_eq!(percentile(&s, 0), 1.0);
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        // 99% of 10 samples: rank ceil(9.9) = 10; 50%: rank 5.
        assert_eq!(percentile(&s, 990), 10.0);
        assert_eq!(percentile(&s, 500), 5.0);
        assert_eq!(percentile(&[7.0], 999), 7.0);
        assert_eq!(percentile(&[], 990), 0.0);
    }

    #[test]
    fn samples_beyond_the_cap_keep_exact_moments_and_a_uniform_subset() {
        let mut s = Samples::new(100);
        for k in 0..10_000 {
            s.push(f64::from(k % 1000));
        }
        assert_eq!((s.count(), s.kept.len()), (10_000, 100));
        let st = s.stats().unwrap();
        // Min, max, mean and deviation are over every sample: 0..999 ten times.
        assert_eq!((st.min, st.max), (0.0, 999.0));
        assert!(close(st.avg, 499.5), "{st:?}");
        assert!((st.stdev - 288.674_990_9).abs() < 1e-6, "{st:?}");
        // The kept subset spans the range: a median near the middle, not the first hundred samples (0..99).
        assert!(st.typical > 250.0 && st.typical < 750.0, "{st:?}");
        assert!(st.min <= st.typical && st.typical <= st.p99 && st.p99 <= st.p99_9 && st.p99_9 <= st.max);
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[1.0, 2.0, 3.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn stats_on_known_samples() {
        // The textbook set: mean 5, population standard deviation 2.
        let s = LatStats::of(&[9.0, 2.0, 5.0, 4.0, 4.0, 4.0, 7.0, 5.0]).unwrap();
        assert!(close(s.avg, 5.0) && close(s.stdev, 2.0), "{s:?}");
        assert_eq!((s.min, s.max, s.typical), (2.0, 9.0, 4.5));
        assert_eq!((s.p99, s.p99_9), (9.0, 9.0));
        let one = LatStats::of(&[3.5]).unwrap();
        assert_eq!((one.min, one.max, one.typical, one.avg, one.stdev), (3.5, 3.5, 3.5, 3.5, 0.0));
        assert!(LatStats::of(&[]).is_none());
        // Order does not matter, and the min <= typical <= max chain holds.
        let s = LatStats::of(&[5.0, 1.0, 3.0]).unwrap();
        assert!(s.min <= s.typical && s.typical <= s.max && s.min <= s.avg && s.avg <= s.max);
    }

    #[test]
    fn bandwidth_figures() {
        // 1000 messages of 1 MiB in one second: 1000 MB/sec, 0.001 Mpps.
        let r = BwRow::compute(1 << 20, 1000, 0, 1_000_000_000, Some((100, 50_000_000)));
        assert!(close(r.bw_avg, 1000.0) && close(r.msg_rate, 0.001), "{r:?}");
        // The best window: 100 MiB in 50 ms.
        assert!(close(r.bw_peak, 2000.0), "{r:?}");
        // Without a window the peak is the average, and it is never below it.
        let r = BwRow::compute(1 << 20, 10, 0, 1_000_000_000, None);
        assert!(close(r.bw_peak, r.bw_avg));
        let r = BwRow::compute(1 << 20, 10, 0, 1_000_000_000, Some((2, 1_000_000_000)));
        assert!(close(r.bw_peak, r.bw_avg));
    }

    #[test]
    fn peak_window_finds_the_fastest_run() {
        let mut w = PeakWindow::new(2);
        // Messages posted at 0, 10, 20, 30; completed at 100, 105, 200, 210.
        for (i, t) in [0, 10, 20, 30].into_iter().enumerate() {
            w.posted(i as u64, t);
        }
        for (i, t) in [100, 105, 200, 210].into_iter().enumerate() {
            w.completed(i as u64, t);
        }
        // Windows: [0,1] 105-0, [1,2] 200-10, [2,3] 210-20; the best is 105 ns for two messages.
        assert_eq!(w.best(), Some((2, 105)));
        let mut w = PeakWindow::new(4);
        w.posted(0, 0);
        w.completed(0, 10);
        assert_eq!(w.best(), None, "no full window yet");
    }

    #[test]
    fn rows_line_up_under_the_headings() {
        let r = Row::Bw(BwRow { bytes: 65536, iterations: 1000, bw_peak: 1234.5, bw_avg: 1200.25, msg_rate: 0.019204 });
        let t = r.text();
        assert_eq!(t.find("65536"), BW_HEADING.find("#bytes"));
        assert_eq!(t.find("1000"), BW_HEADING.find("#iterations"));
        assert_eq!(t.find("1234.50"), BW_HEADING.find("BW peak"));
        assert_eq!(t.find("1200.25"), BW_HEADING.find("BW average"));
        assert_eq!(t.find("0.019204"), BW_HEADING.find("MsgRate"));
        let s = LatStats { min: 1.0, max: 9.0, typical: 2.0, avg: 3.0, stdev: 0.5, p99: 8.0, p99_9: 9.0 };
        let t = Row::Lat(LatRow { bytes: 8388608, iterations: 5, stats: s }).text();
        // A value wider than its column still leaves a space.
        assert!(t.starts_with(" 8388608 5 "), "{t:?}");
        assert_eq!(t.find("9.00"), LAT_HEADING.find("t_max"));
    }

    #[test]
    fn options_defaults_and_errors() {
        let o = Options::parse(&["send_lat"]).unwrap();
        assert_eq!((o.sizes.clone(), o.limit, o.inline), (vec![2], Limit::Iters(1000), 236));
        let o = Options::parse(&["read_bw", "--tx-depth", "16", "--iters", "8"]).unwrap();
        assert_eq!((o.sizes.clone(), o.depth(), o.moderation()), (vec![65536], 8, 8));
        let o = Options::parse(&["write_bw", "-a"]).unwrap();
        assert_eq!((o.sizes[0], *o.sizes.last().unwrap(), o.sizes.len()), (2, DEFAULT_MAX_SIZE, 20));
        let o = Options::parse(&["write_lat", "--duration", "0.5"]).unwrap();
        assert_eq!(o.limit, Limit::Duration(Duration::from_millis(500)));
        for bad in [
            &["write_bw", "--size", "0"][..],
            &["write_bw", "--size"],
            &["write_bw", "--size", "x"],
            &["write_bw", "--size", "4", "--all"],
            &["write_bw", "--max-size", "64"],
            &["write_bw", "--iters", "5", "--duration", "1"],
            &["write_bw", "--tx-depth", "0"],
            &["write_bw", "--duration", "-1"],
            &["write_bw", "--timeout", "0"],
            &["write_bw", "--timeout", "inf"],
            &["write_bw", "--inline", "64"],
            &["send_lat", "--tx-depth", "4"],
            &["write_lat", "--cq-mod", "1"],
            &["write_bw", "--bogus"],
            &["nope_bw"],
            &[],
        ] {
            let e = Options::parse(bad).expect_err(&format!("{bad:?}"));
            assert_eq!(e.to_string().lines().count(), 1, "{e}");
        }
    }

    #[test]
    fn progress_bar_text() {
        assert_eq!(bar(0.5, "x"), format!("[{}{}]  50% x", "#".repeat(15), ".".repeat(15)));
        assert_eq!(bar(2.0, "x"), format!("[{}] 100% x", "#".repeat(30)));
        assert_eq!(bar(f64::NAN, "x"), format!("[{}]   0% x", ".".repeat(30)));
    }

    fn small(t: Test) -> Options {
        Options::parse(&[t.name(), "--size", "4096", "--iters", "10"]).unwrap()
    }

    #[test]
    fn an_error_completion_names_the_request_status_and_vendor_error() {
        // The server's buffer grants no remote rights, so the client's first RDMA is refused.
        let (a, b) = Context::open_sim_pair().unwrap();
        for t in [Test::WriteBw, Test::ReadBw, Test::WriteLat] {
            let tuning = Tuning { server_rights: Access::LOCAL_WRITE, ..Tuning::default() };
            let r = with_pair(&a, &b, &small(t), tuning, |p| {
                if t.is_bw() {
                    run_bw(p, 4096, &mut |_| {}).map(|_| ())
                } else {
                    run_lat(p, 4096, &mut |_| {}).map(|_| ())
                }
            });
            let e = r.expect_err(t.name());
            assert!(matches!(e, BenchError::Completion { wr_id: 0, status: WcStatus::RemAccessErr, .. }), "{e}");
            let line = e.to_string();
            assert!(line.starts_with(&format!("{}: work request 0 (", t.name())), "{line}");
            assert!(line.contains("on the client) completed with remote access error (vendor error 0x"), "{line}");
            assert_eq!(line.lines().count(), 1);
        }
    }

    #[test]
    fn a_peer_that_stops_answering_is_a_timeout_not_a_hang() {
        let (a, b) = Context::open_sim_pair().unwrap();
        let tuning = Tuning { stall: Duration::from_millis(200), ..Tuning::default() };
        let t0 = Instant::now();
        let r = with_pair(&a, &b, &small(Test::WriteLat), tuning, |p| {
            let DeviceKind::Sim(dev) = b.device() else { unreachable!("a simulated pair") };
            dev.device_gone();
            run_lat(p, 4096, &mut |_| {})
        });
        let e = r.expect_err("the server's device is gone");
        assert!(matches!(e, BenchError::Timeout { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "write_lat: no progress for 0.2 s while waiting for iteration 0's message at the server"
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn data_changed_after_it_landed_is_a_mismatch() {
        // The progress callback runs after each poll, the last one after the last completion: flipping a byte of
        // the destination there must fail the end-of-run check.
        let (a, b) = Context::open_sim_pair().unwrap();
        for t in Test::ALL {
            let r = with_pair(&a, &b, &small(t), Tuning::default(), |p| {
                let dst = if t == Test::ReadBw { p.client.mr } else { p.server.mr };
                let mut flip = |_: f64| {
                    let mut x = [0u8];
                    dst.read(p.half, &mut x).unwrap();
                    dst.write(p.half, &[!x[0]]).unwrap();
                };
                if t.is_bw() {
                    run_bw(p, 4096, &mut flip).map(|_| ())
                } else {
                    run_lat(p, 4096, &mut flip).map(|_| ())
                }
            });
            let e = r.expect_err(t.name());
            // The destination half starts after ten slots of 4096 bytes (a depth of ten iterations), or one message.
            let half = if t.is_bw() { 40960 } else { 4096 };
            assert!(matches!(e, BenchError::Mismatch { bytes: 4096, offset, .. } if offset == half), "{e}");
        }
    }

    #[test]
    fn verify_names_the_first_differing_byte() {
        let ctx = Context::open_sim().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mut buf = ctx.alloc_buffer(64).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        let data = pattern(7, 32);
        mr.write(16, &data).unwrap();
        verify(Test::SendBw, 32, &mr, "server", 16, &data).unwrap();
        let mut want = data.clone();
        want[5] ^= 0xff;
        let e = verify(Test::SendBw, 32, &mr, "server", 16, &want).unwrap_err();
        assert!(matches!(e, BenchError::Mismatch { offset: 21, .. }), "{e}");
        assert!(e.to_string().starts_with("send_bw: data mismatch at 32 bytes: byte 21 of the server's buffer is"));
        // The pattern differs with the seed and has no short period.
        assert_ne!(pattern(1, 64), pattern(2, 64));
        let p = pattern(3, 4096);
        assert!((1..=64).all(|period| p[..64] != p[period..period + 64]));
    }

    #[test]
    fn every_test_runs_on_a_simulated_pair() {
        for t in Test::ALL {
            let mut o = Options::parse(&[t.name(), "--size", "64", "--iters", "20", "--json"]).unwrap();
            o.tx_depth = 8;
            let mut out = String::new();
            let r = run(&o, &mut |s| {
                out.push_str(s);
                Ok(())
            })
            .unwrap_or_else(|e| panic!("{}: {e}", t.name()));
            assert_eq!(r.rows.len(), 1);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(v["test"], t.name());
        }
    }
}

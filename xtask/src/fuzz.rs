//! `cargo xtask fuzz [--seconds N] [--target NAME]`: the libFuzzer targets in `fuzz/` (cargo-fuzz, nightly).
//!
//! 1. installs cargo-fuzz when `cargo +nightly fuzz` is missing (`cargo install cargo-fuzz --locked`);
//! 2. regenerates the seed corpora `fuzz/corpus/<target>/seed-*` from the golden vectors in
//!    `tests/vectors/vectors.json` (CQE, EQE, command outputs and entries, a send WQE) and hand-made edge cases,
//!    each encoded in the input format its target reads (`Unstructured::int_in_range` and byte arrays);
//! 3. runs every target (or the one named) for N seconds (default 30) with `-max_total_time=N`, new inputs going to
//!    the git-ignored `fuzz/work/<target>`, and prints libFuzzer's final figures;
//! 4. replays the seeds and the working corpus once (`-runs=0`).
//!
//! Fails when any target crashes (a panic, a sanitizer report, a leak or a timeout: libFuzzer's artifact lands in
//! `fuzz/artifacts/<target>/`).

use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::Value;

/// Every target, in the order they run.
pub const TARGETS: &[&str] = &[
    "cqe",
    "eqe",
    "cmd_output",
    "init_seg_health",
    "wqe_build",
    "roce_frame",
    "exchange",
    "wire",
    "trace_line",
    "args",
    "cm_mad",
];

/// Seconds per target in `cargo xtask ci`: eleven targets at 12 s, plus builds and replays, keep the CI fuzz step
/// near three minutes on two CPUs (FUZZING.md).
pub const CI_SECONDS: u32 = 12;

/// libFuzzer's own limit on one input, in seconds: far above any legitimate run, so only a real hang trips it.
const PER_INPUT_TIMEOUT_S: u32 = 60;

/// `cargo +nightly ...` through the rustup proxy, with the fuzz crate's own target directory (`fuzz/target`) even
/// when the caller exported `CARGO_TARGET_DIR` for the workspace.
fn nightly(root: &Path) -> Command {
    let mut c = Command::new("cargo");
    c.arg("+nightly").current_dir(root).env_remove("CARGO_TARGET_DIR").env_remove("RUSTUP_TOOLCHAIN");
    c
}

fn ensure_tools(root: &Path) -> Result<(), String> {
    let have_nightly = nightly(root).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !have_nightly.is_ok_and(|s| s.success()) {
        println!("$ rustup toolchain install nightly --profile minimal");
        let ok = Command::new("rustup")
            .args(["toolchain", "install", "nightly", "--profile", "minimal"])
            .status()
            .map_err(|e| format!("failed to run rustup: {e}"))?;
        if !ok.success() {
            return Err("rustup could not install the nightly toolchain cargo fuzz needs".into());
        }
    }
    let have_fuzz = nightly(root).args(["fuzz", "--version"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !have_fuzz.is_ok_and(|s| s.success()) {
        println!("$ cargo install cargo-fuzz --locked");
        let ok = Command::new("cargo")
            .args(["install", "cargo-fuzz", "--locked"])
            .env_remove("CARGO_TARGET_DIR")
            .status()
            .map_err(|e| format!("failed to run cargo install: {e}"))?;
        if !ok.success() {
            return Err("cargo install cargo-fuzz failed".into());
        }
    }
    Ok(())
}

/// libFuzzer's final figures for one run.
#[derive(Debug, Default, Clone)]
struct Stats {
    execs: Option<u64>,
    exec_per_s: Option<u64>,
    corpus: Option<String>,
    cov: Option<u64>,
    ft: Option<u64>,
}

/// Reads the last status line (`#N DONE cov: C ft: F corp: K/S exec/s: E ...`) and the `-print_final_stats`
/// lines.
fn parse_stats(log: &str) -> Stats {
    let mut s = Stats::default();
    let field = |line: &str, key: &str| -> Option<String> {
        let i = line.find(key)? + key.len();
        line[i..].split_whitespace().next().map(str::to_string)
    };
    for line in log.lines() {
        if line.starts_with('#') && line.contains("cov:") {
            s.cov = field(line, "cov:").and_then(|v| v.parse().ok()).or(s.cov);
            s.ft = field(line, "ft:").and_then(|v| v.parse().ok()).or(s.ft);
            s.corpus = field(line, "corp:").or(s.corpus.take());
            s.exec_per_s = field(line, "exec/s:").and_then(|v| v.parse().ok()).or(s.exec_per_s);
        }
        if let Some(v) = line.strip_prefix("stat::number_of_executed_units:") {
            s.execs = v.trim().parse().ok();
        }
        if let Some(v) = line.strip_prefix("stat::average_exec_per_sec:") {
            s.exec_per_s = v.trim().parse().ok();
        }
    }
    s
}

fn show(v: &Option<impl std::fmt::Display>) -> String {
    v.as_ref().map_or_else(|| "?".to_string(), ToString::to_string)
}

/// Runs `cargo +nightly fuzz run ...`, echoing libFuzzer's output to the terminal and keeping it for the stats.
fn fuzz_run(root: &Path, target: &str, corpora: &[String], flags: &[String], log: &Path) -> Result<String, String> {
    let mut c = nightly(root);
    c.args(["fuzz", "run", target]).args(corpora).arg("--").args(flags);
    println!("$ cargo +nightly fuzz run {target} {} -- {}", corpora.join(" "), flags.join(" "));
    let out = c.stdin(Stdio::null()).output().map_err(|e| format!("failed to run cargo fuzz: {e}"))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    std::fs::write(log, &text).map_err(|e| format!("writing {}: {e}", log.display()))?;
    // The tail is what matters on a terminal: the final figures, or the crash report.
    let lines: Vec<&str> = text.lines().collect();
    for l in &lines[lines.len().saturating_sub(if out.status.success() { 4 } else { 60 })..] {
        println!("    {l}");
    }
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("fuzz target `{target}` failed ({}); full log in {}", out.status, log.display()))
    }
}

pub fn run_fuzz(root: &Path, args: &[String]) -> Result<(), String> {
    let mut seconds = 30u32;
    let mut only: Option<String> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                // libFuzzer reads 0 as "no limit": a run must end.
                seconds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|s| (1..=86_400).contains(s))
                    .ok_or("--seconds takes a number of seconds from 1 to 86400")?;
            }
            "--target" => only = Some(it.next().ok_or("--target takes a target name")?.clone()),
            other => return Err(format!("fuzz: unknown argument `{other}`")),
        }
    }
    let targets: Vec<&str> = match &only {
        Some(t) if TARGETS.contains(&t.as_str()) => vec![t.as_str()],
        Some(t) => return Err(format!("no fuzz target `{t}` (targets: {})", TARGETS.join(", "))),
        None => TARGETS.to_vec(),
    };
    ensure_tools(root)?;
    write_seeds(root)?;
    let mut failed = Vec::new();
    let mut summary = Vec::new();
    for t in &targets {
        let work = root.join("fuzz/work").join(t);
        std::fs::create_dir_all(&work).map_err(|e| format!("creating {}: {e}", work.display()))?;
        let corpora = [format!("fuzz/work/{t}"), format!("fuzz/corpus/{t}")];
        let flags = [
            format!("-max_total_time={seconds}"),
            format!("-timeout={PER_INPUT_TIMEOUT_S}"),
            "-print_final_stats=1".to_string(),
        ];
        let log = root.join(format!("fuzz/work/{t}.log"));
        let run = fuzz_run(root, t, &corpora, &flags, &log);
        // Replay everything once: the seeds (which a long run never re-executes) and what this run found.
        let replay_log = root.join(format!("fuzz/work/{t}.replay.log"));
        let replay = fuzz_run(
            root,
            t,
            &[format!("fuzz/corpus/{t}"), format!("fuzz/work/{t}")],
            &["-runs=0".to_string(), format!("-timeout={PER_INPUT_TIMEOUT_S}")],
            &replay_log,
        );
        match (&run, &replay) {
            (Ok(text), Ok(_)) => {
                let s = parse_stats(text);
                summary.push(format!(
                    "{t:16} {seconds:>5} s  execs {:>10}  exec/s {:>7}  corpus {:>12}  cov {:>6}  ft {:>7}  crashes 0",
                    show(&s.execs),
                    show(&s.exec_per_s),
                    show(&s.corpus),
                    show(&s.cov),
                    show(&s.ft)
                ));
            }
            _ => {
                for e in [run.err(), replay.err()].into_iter().flatten() {
                    summary.push(format!("{t:16} FAILED: {e}"));
                    failed.push(e);
                }
            }
        }
    }
    println!("xtask fuzz: summary");
    for l in &summary {
        println!("  {l}");
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("{} fuzz run(s) failed; crashing inputs are in fuzz/artifacts/", failed.len()))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Seed corpora

/// An input under construction, in the encoding the targets read with `arbitrary::Unstructured`.
#[derive(Default, Clone)]
struct Enc(Vec<u8>);

impl Enc {
    /// `v` in `lo..=hi` as `int_in_range` reads it: the offset from `lo`, big endian, in as many bytes as the width
    /// of the range needs (none for a one-value range).
    fn int(&mut self, v: u64, lo: u64, hi: u64) -> &mut Self {
        assert!(lo <= v && v <= hi, "{v} outside {lo}..={hi}");
        let (delta, off) = (hi - lo, v - lo);
        let n = (0..8).take_while(|k| delta >> (8 * k) > 0).count();
        for k in (0..n).rev() {
            self.0.push((off >> (8 * k)) as u8);
        }
        self
    }
    /// A signed `v` in `lo..=hi` (same encoding, on the two's-complement offset).
    fn int_i(&mut self, v: i64, lo: i64, hi: i64) -> &mut Self {
        self.int((v - lo) as u64, 0, (hi - lo) as u64)
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.int(v.into(), 0, u8::MAX.into())
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.int(v.into(), 0, u16::MAX.into())
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.int(v.into(), 0, u32::MAX.into())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.int(v, 0, u64::MAX)
    }
    fn flag(&mut self, b: bool) -> &mut Self {
        self.0.push(b.into());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    /// `b` padded with zeros (or cut) to `n` bytes.
    fn fixed(&mut self, b: &[u8], n: usize) -> &mut Self {
        let mut v = b.to_vec();
        v.resize(n, 0);
        self.bytes(&v)
    }
    fn take(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0)).collect()
}

/// The golden vectors by name.
fn vectors(root: &Path) -> Result<std::collections::BTreeMap<String, Vec<u8>>, String> {
    let p = root.join("tests/vectors/vectors.json");
    let text = std::fs::read_to_string(&p).map_err(|e| format!("reading {}: {e}", p.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", p.display()))?;
    let list = v["vectors"].as_array().ok_or("vectors.json has no `vectors` array")?;
    Ok(list.iter().filter_map(|v| Some((v["name"].as_str()?.to_string(), unhex(v["hex"].as_str()?)))).collect())
}

fn vector<'a>(v: &'a std::collections::BTreeMap<String, Vec<u8>>, name: &str) -> Result<&'a [u8], String> {
    v.get(name).map(Vec::as_slice).ok_or_else(|| format!("golden vector `{name}` missing"))
}

/// Named seed inputs of one target.
type Seeds = Vec<(String, Vec<u8>)>;

/// Writes `fuzz/corpus/<target>/seed-<name>` for every target, replacing the previous seeds.
pub fn write_seeds(root: &Path) -> Result<(), String> {
    let v = vectors(root)?;
    let sets: [(&str, Seeds); 11] = [
        ("cqe", seeds_cqe(&v)?),
        ("eqe", seeds_eqe(&v)?),
        ("cmd_output", seeds_cmd_output(&v)?),
        ("init_seg_health", seeds_init_seg()),
        ("wqe_build", seeds_wqe(&v)?),
        ("roce_frame", seeds_roce()),
        ("exchange", seeds_exchange()),
        ("wire", seeds_wire()),
        ("trace_line", seeds_trace_line(&v)?),
        ("args", seeds_args()),
        ("cm_mad", seeds_cm_mad()),
    ];
    let mut total = 0;
    for (target, seeds) in sets {
        let dir = root.join("fuzz/corpus").join(target);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        for entry in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
            let p = entry.map_err(|e| e.to_string())?.path();
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("seed-")) {
                std::fs::remove_file(&p).map_err(|e| format!("removing {}: {e}", p.display()))?;
            }
        }
        for (name, bytes) in &seeds {
            let p = dir.join(format!("seed-{name}"));
            std::fs::write(&p, bytes).map_err(|e| format!("writing {}: {e}", p.display()))?;
        }
        total += seeds.len();
    }
    println!("xtask fuzz: {total} seed inputs written to fuzz/corpus/");
    Ok(())
}

// --- exchange: rc_pingpong's 52-byte message (fuzz_targets/exchange.rs) ---

/// `text` NUL-padded to the message's 52 bytes (cut when longer).
fn exchange_msg(text: &[u8]) -> Vec<u8> {
    let mut m = text.to_vec();
    m.resize(52, 0);
    m
}

/// A message as rc_pingpong writes it, one in upper case, the remote-panic input of issue 21 (non-ASCII in the
/// GID), a sign in a field, a field one digit short, no NUL, and the wrong length.
fn seeds_exchange() -> Seeds {
    let good = b"0000:000123:abcdef:fe800000000000000200000000000001";
    let mut panic = b"0000:000000:000000:a".to_vec();
    for _ in 0..15 {
        panic.extend_from_slice("\u{e9}".as_bytes());
    }
    panic.extend_from_slice(b"a\0");
    vec![
        ("rc_pingpong".into(), exchange_msg(good)),
        ("upper_case".into(), exchange_msg(&good.to_ascii_uppercase())),
        ("gid_not_ascii".into(), panic),
        ("signed_field".into(), exchange_msg(b"+000:000123:abcdef:fe800000000000000200000000000001")),
        ("short_field".into(), exchange_msg(b"000:000123:abcdef:fe800000000000000200000000000001")),
        ("no_nul".into(), vec![b'0'; 52]),
        ("short".into(), good[..20].to_vec()),
    ]
}

// --- cm_mad: a CM MAD on QP1 (fuzz_targets/cm_mad.rs) ---

/// A 256-byte CM MAD (base version 1, class 0x07 version 2, method Send, transaction 1) of attribute `attr`, its
/// data (after the 24-byte header) set at the given offsets (IBA 12.6's tables).
fn cm_mad(attr: u16, data: &[(usize, &[u8])]) -> Vec<u8> {
    let mut m = vec![0u8; 256];
    m[..4].copy_from_slice(&[1, 0x07, 2, 0x03]);
    m[15] = 1;
    m[16..18].copy_from_slice(&attr.to_be_bytes());
    for (off, bytes) in data {
        m[24 + off..24 + off + bytes.len()].copy_from_slice(bytes);
    }
    m
}

/// A REQ for the listened service (TCP port 20000), a REP and a REJ answering the fuzz target's REQ (its
/// communication ID is 1), a DREQ, a SIDR_REQ, and a truncated MAD, a base version 2, a REJ with an over-long info
/// length.
fn seeds_cm_mad() -> Seeds {
    let svc = 0x0106_4e20u64.to_be_bytes();
    let req = cm_mad(0x0010, &[(0, &[0, 0, 0, 9]), (8, &svc), (32, &[0, 0, 1, 1]), (43, &[20 << 3]), (51, &[0xf0])]);
    let rep = cm_mad(0x0013, &[(0, &[0, 0, 0, 5]), (4, &[0, 0, 0, 1]), (12, &[0, 0, 2, 0])]);
    let rej = cm_mad(0x0012, &[(4, &[0, 0, 0, 1]), (10, &[0, 8])]);
    let mut bad_version = req.clone();
    bad_version[0] = 2;
    vec![
        ("req".into(), req.clone()),
        ("rep".into(), rep),
        ("rej".into(), rej),
        ("dreq".into(), cm_mad(0x0015, &[(0, &[0, 0, 0, 5]), (4, &[0, 0, 0, 1])])),
        ("sidr_req".into(), cm_mad(0x0017, &[(0, &[0, 0, 0, 3]), (4, &[0xff, 0xff]), (8, &svc)])),
        ("truncated".into(), req[..100].to_vec()),
        ("base_version_2".into(), bad_version),
        ("rej_long_info".into(), cm_mad(0x0012, &[(4, &[0, 0, 0, 1]), (9, &[73 << 1])])),
    ]
}

// --- wire: the TCP link's byte stream (fuzz_targets/wire.rs) ---

/// `body` behind its 4-byte big-endian length, as the link frames it.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

/// The hello a simulated port sends when the cable is plugged in (frame type 1, magic, version 1, IB flag, LID,
/// GID, MAC), one for each link layer, a hello of another version, and a stream of a hello, a frame of another
/// type, a truncated frame.
fn seeds_wire() -> Seeds {
    let hello = |version: u8, ib: u8| {
        let mut h = vec![1u8];
        h.extend_from_slice(b"MLX5SIMW");
        h.extend_from_slice(&[version, ib, 0x00, 0x07]);
        h.extend_from_slice(&[0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0, 0, 0xff, 0xfe, 0, 0, 0x01]);
        h.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]);
        h
    };
    let mut stream = framed(&hello(1, 0));
    stream.extend(framed(&[2, 0, 1, 2, 3]));
    stream.extend_from_slice(&[0, 0, 0, 40, 1, 2]);
    vec![
        ("hello_eth".into(), framed(&hello(1, 0))),
        ("hello_ib".into(), framed(&hello(1, 1))),
        ("hello_v2".into(), framed(&hello(2, 0))),
        ("stream".into(), stream),
    ]
}

// --- trace_line: a --trace file (fuzz_targets/trace_line.rs) ---

/// Trace lines as `CmdRecord::write_json` writes them, from the golden CREATE_CQ and QUERY_PAGES vectors, and the
/// lines issue 21 found accepted or crashing: a hex field with signs, a field of the wrong type, a blank line, a
/// device name, a timeout. The first byte picks the rendering (fields, all fields, hexdump).
fn seeds_trace_line(v: &std::collections::BTreeMap<String, Vec<u8>>) -> Result<Seeds, String> {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let line = |input: &[u8], output: &[u8], extra: &str| {
        format!(
            r#"{{"slot":0,"token":1,"input":"{}","output":"{}","status_raw":0,"syndrome":0{extra}}}"#,
            hex(input),
            hex(output)
        )
    };
    let cq = line(vector(v, "create_cq_in")?, vector(v, "create_cq_out_ok")?, "");
    let pages = line(&[0x01, 0x07, 0, 0, 0, 0, 0, 1], vector(v, "query_pages_out_boot")?, r#","device":"mlx5_0""#);
    let two = format!("{cq}\n\n{pages}\n");
    let mut seeds = Vec::new();
    for (mode, name) in [(0u8, "fields"), (1, "all"), (2, "hexdump")] {
        let mut b = vec![mode];
        b.extend_from_slice(two.as_bytes());
        seeds.push((format!("two_commands_{name}"), b));
    }
    for (name, text) in [
        ("signed_hex", r#"{"input":"+1+4"}"#.to_string()),
        ("wrong_type", r#"{"input":"0107","status_raw":"0"}"#.to_string()),
        ("timeout", r#"{"input":"0107000000000001","output":null,"delivery":"TIMEOUT","waited_us":60000000}"#.into()),
        ("not_json", "0107 0000".to_string()),
    ] {
        let mut b = vec![0u8];
        b.extend_from_slice(text.as_bytes());
        seeds.push((name.to_string(), b));
    }
    Ok(seeds)
}

// --- args: the mlx5 tool's command line, arguments split at NUL bytes (fuzz_targets/args.rs) ---

/// Command lines of every command, with the issue 21 defects among them: a timeout past `Instant`'s range, port
/// 0, an argument that is not UTF-8, options that do not apply.
fn seeds_args() -> Seeds {
    let lines: &[(&str, &[&[u8]])] = &[
        ("pingpong", &[b"pingpong", b"--size", b"4096", b"--iters", b"10", b"--json"]),
        ("server", &[b"pingpong", b"--server", b"--port", b"18515", b"--bind", b"::1", b"--timeout", b"5"]),
        ("client", &[b"-vv", b"pingpong", b"--client", b"localhost:18515", b"--ud"]),
        ("bench", &[b"--link", b"ib", b"bench", b"write_bw", b"--all", b"--max-size", b"4096", b"--duration", b"0.5"]),
        ("trace", &[b"trace", b"decode", b"-", b"--all", b"--hexdump"]),
        ("timeout_overflow", &[b"pingpong", b"--client", b"h", b"--timeout", b"18446744073709551615"]),
        ("port_zero", &[b"pingpong", b"--server", b"--port", b"0"]),
        ("not_utf8", &[b"trace", b"decode", b"\xff\xfe"]),
        ("not_applicable", &[b"fw-tour", b"--json"]),
        ("device", &[b"--device", b"0000:03:00.0", b"devinfo", b"--json"]),
        // The fuzzer's first find: an option with a newline in it made a two-line error.
        ("newline_in_option", &[b"--lin\nib<", b"40965"]),
    ];
    lines.iter().map(|(n, args)| (n.to_string(), args.join(&0u8))).collect()
}

// --- roce_frame: bare Ethernet frames (fuzz_targets/roce_frame.rs) ---

/// An RC SEND ONLY over IPv4 (the ICRC fixture of sim/src/wire/roce/icrc.rs behind an Ethernet header) and an ARP
/// request: frames that pass every check, for the fuzzer to mutate.
fn seeds_roce() -> Seeds {
    let send_only = "525400000001020000000002080045000030000140004011\
                     26ba0a0000020a000001c12112b7001c00000400ffff0000001180123456cafebabe5132190a";
    let arp = "ffffffffffff5254000000010806000108000604000152540000000\
               10a0000010000000000000a000002";
    [("send_only", send_only), ("arp_request", arp)]
        .into_iter()
        .map(|(n, h)| (n.to_string(), unhex(&h.split_whitespace().collect::<String>())))
        .collect()
}

// --- cqe: images, then a ring and its operations (fuzz_targets/cqe.rs) ---

/// A 64-byte CQE image with only `op_own` (its last byte) set.
fn cqe_op_own(op_own: u8) -> Vec<u8> {
    let mut b = vec![0u8; 64];
    b[63] = op_own;
    b
}

fn cqe_image(e: &mut Enc, img: &[u8], ib: bool, cqn: u32, index: u32, table: u8) {
    e.fixed(img, 64).flag(ib).int(cqn.into(), 0, 0xff_ffff).u32(index).int(table.into(), 0, 2);
}

/// A well-formed CQE the target's device writes: opcode index (REQ, RESP_WR_IMM, RESP_SEND, RESP_SEND_IMM,
/// RESP_SEND_INV, REQ_ERR, RESP_ERR), then its fields.
fn cqe_good(e: &mut Enc, op: u8, wqe_opcode: u8, byte_cnt: u32, syndrome: u8) {
    e.int(0, 0, 7).int(op.into(), 0, 6).flag(false).u8(wqe_opcode).u32(byte_cnt).u32(0xfeed_f00d).u32(0x1000_0042);
    e.u16(7).u8(0).u8(0x06).u8(0x01).u16(0x2005).u8(syndrome).u8(0x33);
}

fn cqe_poll(e: &mut Enc, k: u8) {
    e.int(5, 0, 7).int(k.into(), 0, 8);
}

fn seeds_cqe(v: &std::collections::BTreeMap<String, Vec<u8>>) -> Result<Seeds, String> {
    let golden = vector(v, "cqe64_req_rdma_write_ok")?;
    let mut out = Vec::new();
    let mut e = Enc::default();

    // The golden requester CQE decoded alone (its QP known), then a 64-byte ring of 8 filled and polled.
    e.int(1, 0, 3);
    cqe_image(&mut e, golden, false, 0x1a, 0, 1);
    e.flag(false).int(3, 0, 7).flag(false).int(0x1a, 0, 0xff_ffff).flag(false);
    for (op, wop) in [(0, 8), (2, 0), (0, 0x10), (5, 0), (3, 0), (6, 0)] {
        cqe_good(&mut e, op, wop, 4096, 0x05);
    }
    cqe_poll(&mut e, 4);
    e.int(7, 0, 7).flag(true).u32(0x1234_5677).flag(true);
    cqe_poll(&mut e, 8);
    out.push(("cqe64-req-rdma-write-ok".into(), e.take()));

    // Edge images: nobody wrote it (0xF1), all ones, all zeros (REQ for QP 0), a compressed session, a resize
    // marker, a signature error, error CQEs, reserved opcodes; for an unknown QP and for any QP.
    let edges: [(&str, Vec<u8>); 10] = [
        ("init-invalid", cqe_op_own(0xf1)),
        ("all-ones", vec![0xff; 64]),
        ("all-zero", vec![0; 64]),
        ("compressed", cqe_op_own(0x0c)),
        ("resize", cqe_op_own(0x50)),
        ("sig-err", cqe_op_own(0xc0)),
        ("req-err", {
            let mut b = golden.to_vec();
            b[63] = 0xd0;
            b[55] = 0x05;
            b
        }),
        ("resp-err", {
            let mut b = golden.to_vec();
            b[63] = 0xe0;
            b[55] = 0x15;
            b
        }),
        ("reserved-opcode-6", cqe_op_own(0x60)),
        ("resp-send-inv", {
            let mut b = golden.to_vec();
            b[63] = 0x40;
            b
        }),
    ];
    for (name, img) in edges {
        e.int(3, 0, 3);
        cqe_image(&mut e, &img, false, 1, 0, 0);
        cqe_image(&mut e, &img, true, 0xff_ffff, u32::MAX, 1);
        cqe_image(&mut e, &img, false, 0, 0x0100_0000, 2);
        out.push((format!("image-{name}"), e.take()));
    }

    // 128-byte CQEs in a 2-entry fragmented ring: many laps, so the owner bit flips every second CQE.
    e.int(0, 0, 3).flag(true).int(1, 0, 7).flag(true).int(5, 0, 0xff_ffff).flag(true);
    for _ in 0..6 {
        cqe_good(&mut e, 2, 0, 64, 0);
        cqe_good(&mut e, 0, 0x0a, 0, 0);
        cqe_poll(&mut e, 2);
    }
    out.push(("ring-128-wrap".into(), e.take()));

    // A ring of 128 128-byte CQEs (16 KiB, four 4 KiB fragments): write past a fragment, poll across it.
    e.int(0, 0, 3).flag(true).int(7, 0, 7).flag(true).int(0x42, 0, 0xff_ffff).flag(false);
    for i in 0..40 {
        cqe_good(&mut e, (i % 7) as u8, 0x08, i, 0x04);
    }
    cqe_poll(&mut e, 8);
    cqe_poll(&mut e, 8);
    out.push(("ring-128x128-fragments".into(), e.take()));

    // A hostile device: the golden image written at entry 5, an owner byte flipped, polls, a resize.
    e.int(0, 0, 3).flag(false).int(2, 0, 7).flag(false).int(9, 0, 0xff_ffff).flag(false);
    cqe_good(&mut e, 0, 8, 0, 0);
    e.int(3, 0, 7).u32(5).fixed(golden, 128).flag(true).int(0x123, 0, 0xff_ffff);
    e.int(4, 0, 7).u32(0).u8(0x00);
    cqe_poll(&mut e, 8);
    e.int(7, 0, 7).flag(false).int(4, 0, 7);
    cqe_poll(&mut e, 8);
    out.push(("ring-hostile-resize".into(), e.take()));
    Ok(out)
}

// --- eqe: images, then a ring or the HCA's consumer (fuzz_targets/eqe.rs) ---

/// A 64-byte EQE image: `type` at byte 1, `sub_type` at 3, `data` from 32, owner at 63.
fn eqe_image(ty: u8, sub: u8, data: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; 64];
    b[1] = ty;
    b[3] = sub;
    b[32..32 + data.len().min(28)].copy_from_slice(&data[..data.len().min(28)]);
    b
}

fn seeds_eqe(v: &std::collections::BTreeMap<String, Vec<u8>>) -> Result<Seeds, String> {
    let golden = vector(v, "eqe_completion_cq1a")?;
    let mut out = Vec::new();
    let mut e = Enc::default();

    // The golden completion EQE, then a 4-entry ring filled by a well-behaved device, drained and re-armed.
    e.int(1, 0, 3).fixed(golden, 64).flag(false).int(2, 0, 9).int(5, 0, 15).u8(7);
    for _ in 0..3 {
        e.int(0, 0, 7).fixed(golden, 64);
    }
    e.int(4, 0, 7).int(4, 1, 8).int(7, 0, 7).flag(true);
    out.push(("eqe-completion-cq1a".into(), e.take()));

    // One image per event type the driver decodes, and some it does not.
    let page_req = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20];
    let types: [(&str, Vec<u8>); 8] = [
        ("command", eqe_image(0x0a, 0, &[0, 0, 0, 1])),
        ("page-request", eqe_image(0x0b, 0, &[0, 0, 0, 0, 0, 0, 0, 8])),
        ("page-request-negative", eqe_image(0x0b, 0, &[0, 1, 0, 0, 0xff, 0xff, 0xff, 0xf0])),
        ("cq-error", eqe_image(0x04, 0, &[0, 0, 0, 0x1a, 0, 0, 0, 1])),
        ("port-change", eqe_image(0x09, 4, &[0, 0, 0, 0, 0x10])),
        ("internal-error", eqe_image(0x08, 0, &[])),
        ("unknown-type", eqe_image(0xfe, 0x7f, &page_req)),
        ("all-ones", vec![0xff; 64]),
    ];
    for (name, img) in types {
        e.int(1, 0, 3).fixed(&img, 64).flag(false).int(0, 0, 9).int(1, 0, 15).u8(0);
        e.int(0, 0, 7).fixed(&img, 64).int(4, 0, 7).int(1, 1, 2);
        out.push((format!("image-{name}"), e.take()));
    }

    // A one-entry ring over many laps (owner parity flips each time), and a 512-entry ring drained past the
    // 128-entry publishing step.
    e.int(0, 0, 3).flag(false).int(0, 0, 9).int(3, 0, 15).u8(1);
    for _ in 0..140 {
        e.int(0, 0, 7).fixed(golden, 64).int(4, 0, 7).int(1, 1, 2);
    }
    out.push(("ring-1-laps".into(), e.take()));
    e.int(0, 0, 3).flag(false).int(9, 0, 9).int(3, 0, 15).u8(2);
    for _ in 0..300 {
        e.int(0, 0, 7).fixed(golden, 64);
    }
    e.int(4, 0, 7).int(1023, 1, 1024).int(7, 0, 7).flag(false);
    out.push(("ring-512-spare-eqe".into(), e.take()));

    // A buffer one entry short, which the ring refuses.
    e.int(0, 0, 3).flag(false).int(3, 0, 9).int(0, 0, 15);
    out.push(("ring-short-buffer".into(), e.take()));

    // The HCA's consumer: page requests both ways, a port change, a CQ error, a real completion event.
    e.int(0, 0, 3).flag(true);
    let post = |e: &mut Enc, idx: u8, sub: u8, data: &[u8]| {
        e.int(0, 0, 5).int(idx.into(), 0, 4).u8(sub).fixed(data, 28);
    };
    post(&mut e, 0, 0, &[]);
    e.flag(true).int_i(5, -64, 64);
    e.int(4, 0, 5);
    post(&mut e, 2, 1, &[0, 0, 0, 0, 0x10]);
    post(&mut e, 3, 0, &[0, 0, 0, 0x1a, 0, 0, 0, 1]);
    e.int(3, 0, 5).int(4, 0, 5);
    post(&mut e, 0, 0, &[]);
    e.flag(true).int_i(-3, -64, 64);
    post(&mut e, 1, 0, &[0, 0, 0, 1]);
    e.int(5, 0, 5);
    out.push(("hca-events".into(), e.take()));
    Ok(out)
}

// --- cmd_output: commands answered by a fake device, or the simulator with faults (fuzz_targets/cmd_output.rs) ---

/// Commands by the target's numbering.
const CMD_QUERY_HCA_CAP: u8 = 0;
const CMD_QUERY_PAGES: u8 = 3;
const CMD_MANAGE_PAGES_TAKE: u8 = 4;
const CMD_CREATE_CQ: u8 = 5;
const CMD_QUERY_CQ: u8 = 6;
const CMD_ACCESS_REG: u8 = 8;
const CMD_ALLOC_PD: u8 = 11;

fn cmd_header(e: &mut Enc, checksum: bool, timeout_ms: u32, cmds: &[(u8, u32)]) {
    e.int(1, 0, 7).flag(checksum).int(timeout_ms.into(), 1, 20).int(cmds.len() as u64, 1, 6);
    for &(k, _) in cmds {
        e.int(k.into(), 0, 11);
    }
    for &(_, p) in cmds {
        e.u32(p);
    }
}

/// One answer: not kept, signed or not, the 16 inline output bytes (`keep_status`: the status byte as given,
/// else forced to 0), a delivery status (0 = OK), the mailbox data blocks, the entry left alone.
fn cmd_answer(e: &mut Enc, sign: bool, inline: &[u8], keep_status: bool, delivery: u8, blocks: &[&[u8]]) {
    e.int(1, 0, 15).flag(sign).fixed(inline, 16).int(u64::from(!keep_status), 0, 3);
    if delivery == 0 {
        e.int(1, 0, 7);
    } else {
        e.int(0, 0, 7).int(delivery.into(), 1, 0x7f);
    }
    for b in blocks {
        e.fixed(b, 512).int(1, 0, 7);
    }
    e.int(1, 0, 7);
}

fn seeds_cmd_output(v: &std::collections::BTreeMap<String, Vec<u8>>) -> Result<Seeds, String> {
    let cq_ok = vector(v, "create_cq_out_ok")?;
    let pages_boot = vector(v, "query_pages_out_boot")?;
    let bad_param = vector(v, "mbox_out_bad_param")?;
    let entry = vector(v, "cmd_layout_create_cq")?;
    let create_cq_in = vector(v, "create_cq_in")?;
    let manage_give = vector(v, "manage_pages_in_give2")?;
    let mut out = Vec::new();
    let mut e = Enc::default();

    cmd_header(&mut e, false, 5, &[(CMD_CREATE_CQ, 0)]);
    cmd_answer(&mut e, false, cq_ok, true, 0, &[]);
    out.push(("create-cq-out-ok".into(), e.take()));

    cmd_header(&mut e, false, 5, &[(CMD_QUERY_PAGES, 0)]);
    cmd_answer(&mut e, false, pages_boot, true, 0, &[]);
    out.push(("query-pages-out-boot".into(), e.take()));

    cmd_header(&mut e, false, 5, &[(CMD_ALLOC_PD, 0), (CMD_CREATE_CQ, 0)]);
    cmd_answer(&mut e, false, bad_param, true, 0, &[]);
    cmd_answer(&mut e, false, cq_ok, true, 0, &[]);
    out.push(("mbox-out-bad-param".into(), e.take()));

    // Checksums on, every signature right; then one the device got wrong.
    cmd_header(&mut e, true, 5, &[(CMD_CREATE_CQ, 0), (CMD_QUERY_CQ, 0x1a), (CMD_QUERY_CQ, 0x1a)]);
    cmd_answer(&mut e, true, cq_ok, true, 0, &[]);
    cmd_answer(&mut e, true, &[], true, 0, &[create_cq_in]);
    cmd_answer(&mut e, false, &[], true, 0, &[create_cq_in]);
    out.push(("checksum-signed-and-not".into(), e.take()));

    // Delivery errors: bad token, then an unknown code.
    cmd_header(&mut e, false, 5, &[(CMD_ALLOC_PD, 0), (CMD_ALLOC_PD, 0)]);
    cmd_answer(&mut e, false, &[], true, 0x02, &[]);
    cmd_answer(&mut e, false, &[], true, 0x55, &[]);
    out.push(("delivery-errors".into(), e.take()));

    // Slot 0 kept (timeout), the next command finds it busy, then MANAGE_PAGES on slot 31 rings and the device
    // answers slot 0 late as well.
    cmd_header(
        &mut e,
        false,
        3,
        &[(CMD_ALLOC_PD, 0), (CMD_ALLOC_PD, 0), (CMD_MANAGE_PAGES_TAKE, 2), (CMD_ALLOC_PD, 0)],
    );
    e.int(0, 0, 15);
    e.int(0, 0, 3);
    cmd_answer(&mut e, false, &[], true, 0, &[]);
    let mut take = vec![0u8; 16];
    take[11] = 2;
    cmd_answer(&mut e, false, &take, true, 0, &[&[0, 0, 0, 1, 0, 0, 0x10, 0, 0, 0, 0, 1, 0, 0, 0x20, 0]]);
    cmd_answer(&mut e, false, &[], true, 0, &[]);
    out.push(("hang-busy-late-answer".into(), e.take()));

    // MANAGE_PAGES take: a misaligned page, and more pages claimed than asked for.
    cmd_header(&mut e, false, 5, &[(CMD_MANAGE_PAGES_TAKE, 2), (CMD_MANAGE_PAGES_TAKE, 2)]);
    cmd_answer(&mut e, false, &take, true, 0, &[&[0, 0, 0, 1, 0, 0, 0x10, 0x08, 0, 0, 0, 1, 0, 0, 0x20, 0]]);
    let mut too_many = take.clone();
    too_many[10] = 0x10;
    cmd_answer(&mut e, false, &too_many, true, 0, &[&[]]);
    out.push(("manage-pages-take-malformed".into(), e.take()));

    // QUERY_HCA_CAP over eight mailboxes of vector bytes, one block's control part rewritten, the entry rewritten
    // with the golden CREATE_CQ entry.
    cmd_header(&mut e, false, 5, &[(CMD_QUERY_HCA_CAP, 0), (CMD_ACCESS_REG, 0)]);
    e.int(1, 0, 15).flag(false).fixed(&[], 16).int(1, 0, 3).int(1, 0, 7);
    for i in 0..8 {
        e.fixed(if i % 2 == 0 { create_cq_in } else { manage_give }, 512);
        if i == 3 {
            e.int(0, 0, 7).fixed(&entry[..64], 64);
        } else {
            e.int(1, 0, 7);
        }
    }
    e.int(0, 0, 7).fixed(&entry[..61], 61);
    cmd_answer(&mut e, false, &[], true, 0, &[&[0, 0, 0x05, 0xdc, 0, 0, 0x05, 0xdc, 0, 0, 0x05, 0xdc]]);
    out.push(("query-hca-cap-mailboxes".into(), e.take()));

    // Mode B: the simulator, with an output byte of QUERY_HCA_CAP and of CREATE_EQ corrupted.
    e.int(0, 0, 7).flag(false).int(2, 1, 4);
    e.int(6, 0, 21).int(0, 0, 5).int(0x30, 0, 0x1100).u8(0xff);
    e.int(11, 0, 21).int(1, 0, 5).int(0x0b, 0, 0x1100).u8(0x07);
    e.int(16, 1, 64);
    out.push(("sim-corrupt-outputs".into(), e.take()));
    e.int(0, 0, 7).flag(true).int(1, 1, 4).int(4, 0, 21).int(5, 0, 5).int_i(7, -32, 32).int(8, 1, 64);
    out.push(("sim-checksum-page-requests".into(), e.take()));
    Ok(out)
}

// --- init_seg_health: the initialization segment, health polls, a bring-up (fuzz_targets/init_seg_health.rs) ---

#[derive(Clone, Copy)]
struct Seg {
    fw_rev: u32,
    cmdif: u32,
    l_sz: u32,
    initializing: u32,
    exec_to: u32,
    q_init_to: u32,
    health: [u8; 64],
    counter: u32,
}

/// A ConnectX-5 as the simulator models it: firmware 16.35.2000, command interface 5, 32 slots of 64 bytes.
const CX5: Seg = Seg {
    fw_rev: (35 << 16) | 16,
    cmdif: (5 << 16) | 2000,
    l_sz: (5 << 4) | 6,
    initializing: 0,
    exec_to: 0,
    q_init_to: 0,
    health: [0; 64],
    counter: 1,
};

/// The segment; `raw`: keep `cmdif` and `l_sz` as given instead of the valid revision and geometry.
fn seg(e: &mut Enc, s: &Seg, raw: bool) {
    e.u32(s.fw_rev).u32(s.cmdif).u32(s.l_sz).u32(s.initializing).u32(s.exec_to).u32(s.q_init_to);
    e.bytes(&s.health).u32(s.counter);
    if raw {
        e.int(3, 0, 3);
    } else {
        e.int(0, 0, 3).int((s.l_sz >> 4 & 0xf).clamp(1, 5).into(), 1, 5);
    }
}

/// Health polls: each a heartbeat step (`Some(n)`), or nothing changing (`None`).
fn polls(e: &mut Enc, steps: &[Option<u32>]) {
    e.int(steps.len() as u64, 1, 12);
    for s in steps {
        match s {
            Some(n) => e.int(0, 0, 7).int((*n).into(), 1, 3),
            None => e.int(6, 0, 7),
        };
    }
}

/// The bring-up: `initializing` clears after `clears` reads (or never) and comes back after `relapse` more; the
/// status byte of each command answered.
fn bring(e: &mut Enc, clears: Option<u8>, relapse: Option<u8>, statuses: &[u8]) {
    match clears {
        None => e.int(7, 0, 7),
        Some(n) => {
            e.int(0, 0, 7).int(n.into(), 0, 40);
            match relapse {
                Some(k) => e.int(3, 0, 3).int(k.into(), 1, 4),
                None => e.int(0, 0, 3),
            }
        }
    };
    e.int(statuses.len() as u64, 0, 40);
    for &s in statuses {
        e.u8(s);
    }
}

fn seeds_init_seg() -> Seeds {
    let mut out = Vec::new();
    let mut e = Enc::default();
    let beat = [Some(1), Some(1), Some(2), Some(1), Some(3), Some(1)];

    seg(&mut e, &CX5, false);
    polls(&mut e, &beat);
    bring(&mut e, Some(3), None, &[]);
    out.push(("connectx5".into(), e.take()));

    // QUERY_ISSI refused (ISSI 0, as old firmware), everything else answered OK with zero outputs.
    seg(&mut e, &CX5, false);
    polls(&mut e, &beat);
    bring(&mut e, Some(0), None, &[0, 0x02]);
    out.push(("issi-0-zero-outputs".into(), e.take()));

    // A device that left the bus: all ones everywhere.
    let gone = Seg {
        fw_rev: u32::MAX,
        cmdif: u32::MAX,
        l_sz: u32::MAX,
        initializing: u32::MAX,
        exec_to: u32::MAX,
        q_init_to: u32::MAX,
        health: [0xff; 64],
        counter: u32::MAX,
    };
    seg(&mut e, &gone, true);
    polls(&mut e, &[None, None]);
    bring(&mut e, Some(0), None, &[]);
    out.push(("device-gone".into(), e.take()));

    // NIC interface disabled, then in software reset.
    for (name, nic) in [("nic-disabled", 1u32), ("nic-sw-reset", 7)] {
        seg(&mut e, &Seg { l_sz: (nic << 8) | (5 << 4) | 6, ..CX5 }, true);
        polls(&mut e, &beat[..2]);
        bring(&mut e, Some(1), None, &[]);
        out.push((name.into(), e.take()));
    }

    // A health syndrome with a valid severity and recovery flow required.
    let mut h = [0u8; 64];
    h[48..52].copy_from_slice(&((35 << 16) | 16u32).to_be_bytes());
    h[56] = 0x80 | 0x08 | 0x03;
    h[60] = 2;
    h[61] = 0x01;
    h[62..64].copy_from_slice(&0x1234u16.to_be_bytes());
    seg(&mut e, &Seg { health: h, ..CX5 }, false);
    polls(&mut e, &beat[..3]);
    bring(&mut e, Some(2), None, &[]);
    out.push(("health-syndrome".into(), e.take()));

    // A heartbeat that stops: stalled after MAX_MISSES polls.
    seg(&mut e, &CX5, false);
    polls(&mut e, &[Some(1), None, None, None, None]);
    bring(&mut e, Some(2), None, &[]);
    out.push(("heartbeat-stalls".into(), e.take()));

    // Timeouts in seconds; `initializing` sets again after the queue is up and the init timeout runs out.
    seg(&mut e, &Seg { exec_to: (1 << 29) | 5, q_init_to: 1500, ..CX5 }, false);
    polls(&mut e, &beat[..1]);
    bring(&mut e, Some(1), Some(1), &[]);
    out.push(("init-timeout-relapse".into(), e.take()));

    // Firmware never leaves pre-initialization.
    seg(&mut e, &Seg { initializing: 1 << 31, ..CX5 }, false);
    polls(&mut e, &beat[..1]);
    bring(&mut e, None, None, &[]);
    out.push(("pre-init-never".into(), e.take()));

    // Wrong command interface revision, impossible geometries.
    for (name, cmdif, l_sz) in [("cmdif-rev-4", 4u32 << 16, (5 << 4) | 6), ("geometry-6-7", 5 << 16, (6 << 4) | 7)] {
        seg(&mut e, &Seg { cmdif, l_sz, ..CX5 }, true);
        polls(&mut e, &beat[..1]);
        bring(&mut e, Some(0), None, &[]);
        out.push((name.into(), e.take()));
    }
    out
}

// --- wqe_build: a QP on the simulator and work-request lists (fuzz_targets/wqe_build.rs) ---

const MEM_WQE: u64 = 64 * 1024;

/// An address: inside the registered region at `off`, or anywhere (`Err`).
fn addr(e: &mut Enc, a: Result<u64, u64>) {
    match a {
        Ok(off) => e.int(1, 0, 7).int(off, 0, MEM_WQE - 8),
        Err(any) => e.int(0, 0, 7).u64(any),
    };
}

/// A key: the region's (`None`) or any other.
fn key(e: &mut Enc, k: Option<u32>) {
    match k {
        None => e.int(1, 0, 15),
        Some(v) => e.int(0, 0, 15).u32(v),
    };
}

#[derive(Clone, Copy)]
enum Op {
    Send,
    SendImm(u32),
    Write(Result<u64, u64>, Option<u32>),
    WriteImm(Result<u64, u64>, Option<u32>, u32),
    Read(Result<u64, u64>, Option<u32>),
    CmpSwp(Result<u64, u64>, u64, u64),
    FetchAdd(Result<u64, u64>, u64),
}

/// One send request. `max_sge` / `max_inline` are the QP's granted capabilities (the target draws counts from
/// them); `sges` are (address, length, key); `inline` a length.
struct Wr {
    op: Op,
    sges: Vec<(Result<u64, u64>, u32, Option<u32>)>,
    inline: Option<u32>,
    dest: bool,
    flags: u32,
}

fn sends(e: &mut Enc, ud: bool, max_sge: u32, max_inline: u32, wrs: &[Wr]) {
    e.int(0, 0, 4).int(wrs.len() as u64, 0, 8);
    for w in wrs {
        let atomic = matches!(w.op, Op::CmpSwp(..) | Op::FetchAdd(..));
        match w.op {
            Op::Send => {
                e.int(0, 0, 6);
            }
            Op::SendImm(imm) => {
                e.int(1, 0, 6).u32(imm);
            }
            Op::Write(a, k) => {
                e.int(2, 0, 6);
                addr(e, a);
                key(e, k);
            }
            Op::WriteImm(a, k, imm) => {
                e.int(3, 0, 6);
                addr(e, a);
                key(e, k);
                e.u32(imm);
            }
            Op::Read(a, k) => {
                e.int(4, 0, 6);
                addr(e, a);
                key(e, k);
            }
            Op::CmpSwp(a, c, s) => {
                e.int(5, 0, 6);
                addr(e, a);
                key(e, None);
                e.u64(c).u64(s);
            }
            Op::FetchAdd(a, add) => {
                e.int(6, 0, 6);
                addr(e, a);
                key(e, None);
                e.u64(add);
            }
        }
        e.int(w.sges.len() as u64, 0, u64::from(max_sge) + 1);
        for &(a, len, k) in &w.sges {
            addr(e, a);
            if atomic {
                e.flag(len == 8);
                if len != 8 {
                    e.int(len.into(), 0, 2048);
                }
            } else {
                e.int(len.into(), 0, 2048);
            }
            key(e, k);
        }
        match w.inline {
            Some(n) => e.int(0, 0, 3).int(n.into(), 0, u64::from(max_inline) + 20),
            None => e.int(1, 0, 3),
        };
        // The target draws 0..=15: on UD, 0 means no destination; on RC, 0 means one (a mistake).
        e.int(if w.dest == ud { 1 } else { 0 }, 0, 15).int(w.flags.into(), 0, 7);
    }
}

fn recvs(e: &mut Enc, max_sge: u32, lists: &[&[(u64, u32)]]) {
    e.int(2, 0, 4).int(lists.len() as u64, 0, 8);
    for l in lists {
        e.int(l.len() as u64, 0, u64::from(max_sge) + 1);
        for &(off, len) in *l {
            e.int(off, 0, MEM_WQE - 1).int(len.into(), 1, 4096).int(1, 0, 15);
        }
    }
}

fn poll_wqe(e: &mut Enc) {
    e.int(3, 0, 4);
}

/// QP type and requested capabilities: (UD, send_wr, recv_wr, send_sge, recv_sge, inline, sig_all).
fn qp(e: &mut Enc, ud: bool, wr: u32, sge: u32, inline: u32, sig_all: bool) {
    e.flag(ud).int(wr.into(), 1, 64).int(wr.into(), 1, 64).int(sge.into(), 0, 6).int(sge.max(1).into(), 1, 6);
    e.int(inline.into(), 0, 400).flag(sig_all);
}

const SIGNALED: u32 = 2;
const SOLICITED: u32 = 4;
const FENCE: u32 = 1;

fn wr(op: Op, sges: Vec<(Result<u64, u64>, u32, Option<u32>)>, flags: u32) -> Wr {
    Wr { op, sges, inline: None, dest: false, flags }
}

fn seeds_wqe(v: &std::collections::BTreeMap<String, Vec<u8>>) -> Result<Seeds, String> {
    let golden = vector(v, "wqe_rdma_write_signaled")?;
    let be32 = |o: usize| u32::from_be_bytes(golden[o..o + 4].try_into().unwrap_or([0; 4]));
    let be64 = |o: usize| u64::from_be_bytes(golden[o..o + 8].try_into().unwrap_or([0; 8]));
    // ctrl (16) + raddr {raddr, rkey} + data {byte_count, lkey, addr}.
    let (raddr, rkey, len, lkey, laddr) = (be64(16), be32(24), be32(32), be32(36), be64(40));
    let mut out = Vec::new();
    let mut e = Enc::default();

    // RC connected to itself, 16 WRs of 2 SGEs or 64 inline bytes (a 128-byte WQE: 5 SGEs or 76 inline bytes
    // granted).
    let (rc_sge, rc_inline) = (5, 76);
    qp(&mut e, false, 16, 2, 64, false);
    recvs(&mut e, 2, &[&[(0x8000, 4096)], &[(0x9000, 100), (0xa000, 4000)]]);
    sends(
        &mut e,
        false,
        rc_sge,
        rc_inline,
        &[
            wr(Op::Send, vec![(Ok(0), 1024, None)], SIGNALED),
            Wr { op: Op::SendImm(0xfeed), sges: vec![], inline: Some(32), dest: false, flags: SIGNALED | SOLICITED },
        ],
    );
    poll_wqe(&mut e);
    sends(
        &mut e,
        false,
        rc_sge,
        rc_inline,
        &[
            wr(Op::Write(Ok(0x4000), None), vec![(Ok(0), 256, None), (Ok(0x100), 256, None)], 0),
            wr(Op::WriteImm(Ok(0x5000), None, 7), vec![(Ok(0), 16, None)], SIGNALED),
            wr(Op::Read(Ok(0x6000), None), vec![(Ok(0x7000), 64, None)], SIGNALED | FENCE),
            wr(Op::CmpSwp(Ok(0x100), 0, 1), vec![(Ok(0x200), 8, None)], SIGNALED),
            wr(Op::FetchAdd(Ok(0x100), 5), vec![(Ok(0x208), 8, None)], SIGNALED),
        ],
    );
    poll_wqe(&mut e);
    out.push(("rc-every-opcode".into(), e.take()));

    // The golden RDMA WRITE (remote address, rkey, lkey and local address as the vector has them: outside the
    // registered region, so the device reports access errors), signaled.
    qp(&mut e, false, 8, 1, 0, false);
    sends(
        &mut e,
        false,
        1,
        12,
        &[wr(Op::Write(Err(raddr), Some(rkey)), vec![(Err(laddr), len.min(2048), Some(lkey))], SIGNALED)],
    );
    poll_wqe(&mut e);
    out.push(("wqe-rdma-write-signaled".into(), e.take()));

    // UD to itself: receives, sends with and without a destination, inline data.
    qp(&mut e, true, 8, 1, 32, true);
    recvs(&mut e, 1, &[&[(0, 2048)], &[(0x1000, 2048)], &[(0x2000, 2048)]]);
    sends(
        &mut e,
        true,
        4,
        60,
        &[
            Wr { op: Op::Send, sges: vec![(Ok(0x3000), 512, None)], inline: None, dest: true, flags: 0 },
            Wr { op: Op::SendImm(9), sges: vec![], inline: Some(40), dest: true, flags: SOLICITED },
            Wr { op: Op::Send, sges: vec![], inline: None, dest: false, flags: 0 },
        ],
    );
    poll_wqe(&mut e);
    out.push(("ud-self".into(), e.take()));

    // UD with no SGEs and no inline data (64-byte WQEs): inline data refused, an empty inline list accepted.
    qp(&mut e, true, 10, 0, 0, false);
    sends(
        &mut e,
        true,
        0,
        0,
        &[
            Wr { op: Op::Send, sges: vec![], inline: Some(0), dest: true, flags: SIGNALED },
            Wr { op: Op::Send, sges: vec![], inline: Some(10), dest: true, flags: SIGNALED },
        ],
    );
    poll_wqe(&mut e);
    out.push(("ud-64-byte-wqe".into(), e.take()));

    // A 4-WR RC queue filled, refused when full, drained, refilled: the ring wraps several times.
    qp(&mut e, false, 4, 1, 0, false);
    for _ in 0..6 {
        let one = || wr(Op::Write(Ok(0x100), None), vec![(Ok(0), 64, None)], SIGNALED);
        sends(&mut e, false, 1, 12, &[one(), one(), one(), one(), one()]);
        poll_wqe(&mut e);
    }
    out.push(("rc-wrap-full".into(), e.take()));

    // Rule breakers: too many SGEs, an atomic without its 8-byte SGE, inline with a gather list, inline on a READ,
    // a UD destination on RC.
    qp(&mut e, false, 8, 1, 16, false);
    let bad = [
        wr(Op::Send, vec![(Ok(0), 1, None); 6], 0),
        wr(Op::CmpSwp(Ok(0), 1, 2), vec![(Ok(0), 4, None)], 0),
        Wr { op: Op::Send, sges: vec![(Ok(0), 8, None)], inline: Some(4), dest: false, flags: 0 },
        Wr { op: Op::Read(Ok(0), None), sges: vec![], inline: Some(4), dest: false, flags: 0 },
        Wr { op: Op::Send, sges: vec![], inline: None, dest: true, flags: 0 },
    ];
    for b in bad {
        sends(&mut e, false, 5, 76, &[wr(Op::Send, vec![(Ok(0), 8, None)], SIGNALED), b]);
    }
    poll_wqe(&mut e);
    out.push(("rc-rule-breakers".into(), e.take()));
    Ok(out)
}

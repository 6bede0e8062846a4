//! `cargo xtask bench [--json]`: runs the benchmarks (`mlx5-bench`, in release), measures the code size of
//! `mlx5-core` for the embedded target, and regenerates `BENCHMARKS.md` with the figures, their targets and the
//! machine they were measured on. `--json` prints one JSON object on stdout (progress goes to stderr).
//!
//! `cargo xtask bench --peer [--json]` instead compares the datapath calls with rdma-core's mlx5 provider
//! (`bench/peer.rs`) and rewrites only its own section of `BENCHMARKS.md`.
//!
//! `cargo xtask bench --scale [--json]` opens [`SCALE_QPS`] RC QPs, each with its own CQ and MR, on one simulated
//! device through the verbs API (`bench/src/scale.rs`), and rewrites only its own section of `BENCHMARKS.md`; CI
//! runs the same with [`CI_SCALE_QPS`] and writes nothing ([`ci_scale`]). Both fail when anything leaked.
//!
//! The size is read straight from the release rlib: an `ar` archive whose object members are ELF32 files; the
//! `.text*` section sizes of every member are summed. No external tool is involved.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Map, Value};

use crate::EMBEDDED_TARGET;

mod peer;

/// Everything below this line in `BENCHMARKS.md` is hand-written analysis, kept when the file is regenerated.
const KEEP_MARKER: &str = "<!-- Analysis: everything below this line is kept by `cargo xtask bench`. -->";

fn cargo_cmd(root: &Path, args: &[&str]) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let mut c = Command::new(cargo);
    c.args(args).current_dir(root).stderr(Stdio::inherit());
    c
}

/// Runs `mlx5-bench --json` in release and returns its JSON object.
fn run_bench(root: &Path) -> Result<Map<String, Value>, String> {
    run_bench_with(root, &[])
}

/// Runs `mlx5-bench ARGS --json` in release and returns its JSON object.
fn run_bench_with(root: &Path, extra: &[&str]) -> Result<Map<String, Value>, String> {
    let mut args = vec!["run", "--release", "-p", "mlx5-bench", "--"];
    args.extend_from_slice(extra);
    args.push("--json");
    let out = cargo_cmd(root, &args).output().map_err(|e| format!("failed to run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("mlx5-bench failed ({})", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or("mlx5-bench printed no JSON")?;
    match serde_json::from_str(line) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("mlx5-bench printed JSON that is not an object".into()),
        Err(e) => Err(format!("mlx5-bench printed invalid JSON: {e}")),
    }
}

/// Section sizes of the core's object code.
#[derive(Debug, Default, Clone, Copy)]
struct CoreSize {
    text: u64,
    rodata: u64,
    data: u64,
    bss: u64,
    objects: usize,
}

/// Builds `mlx5-core` in release for the embedded target and returns the rlib's path.
fn build_core_rlib(root: &Path) -> Result<PathBuf, String> {
    let installed = Command::new("rustup").args(["target", "list", "--installed"]).output();
    if let Ok(o) = installed {
        if !String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == EMBEDDED_TARGET) {
            eprintln!("$ rustup target add {EMBEDDED_TARGET}");
            let ok = Command::new("rustup")
                .args(["target", "add", EMBEDDED_TARGET])
                .stdout(Stdio::null())
                .status()
                .map_err(|e| e.to_string())?;
            if !ok.success() {
                return Err(format!("rustup could not add {EMBEDDED_TARGET}"));
            }
        }
    }
    let args = ["build", "--release", "-p", "mlx5-core", "--target", EMBEDDED_TARGET, "--message-format=json"];
    let out = cargo_cmd(root, &args).output().map_err(|e| format!("failed to run cargo: {e}"))?;
    if !out.status.success() {
        return Err(format!("building mlx5-core for {EMBEDDED_TARGET} failed ({})", out.status));
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<Value>(line) else { continue };
        if msg["reason"] != "compiler-artifact" || msg["target"]["name"] != "mlx5_core" {
            continue;
        }
        let files = msg["filenames"].as_array().into_iter().flatten();
        if let Some(f) = files.filter_map(Value::as_str).find(|f| f.ends_with(".rlib")) {
            return Ok(PathBuf::from(f));
        }
    }
    Err("cargo reported no mlx5_core rlib".into())
}

/// The members of an `ar` archive (System V / GNU names, BSD `#1/` names): (name, contents).
fn ar_members(data: &[u8]) -> Result<Vec<(String, &[u8])>, String> {
    const MAGIC: &[u8] = b"!<arch>\n";
    if !data.starts_with(MAGIC) {
        return Err("not an ar archive".into());
    }
    let mut pos = MAGIC.len();
    let mut long_names: &[u8] = &[];
    let mut out = Vec::new();
    while pos + 60 <= data.len() {
        let hdr = &data[pos..pos + 60];
        if &hdr[58..60] != b"`\n" {
            return Err(format!("bad ar member header at {pos}"));
        }
        let field = |r: std::ops::Range<usize>| String::from_utf8_lossy(&hdr[r]).trim().to_string();
        let size: usize = field(48..58).parse().map_err(|_| format!("bad ar member size at {pos}"))?;
        let start = pos + 60;
        let end = start.checked_add(size).filter(|&e| e <= data.len()).ok_or("ar member runs past the archive")?;
        let mut body = &data[start..end];
        let raw = field(0..16);
        let name = if raw == "/" || raw == "/SYM64/" {
            None
        } else if raw == "//" {
            long_names = body;
            None
        } else if let Some(off) = raw.strip_prefix('/').and_then(|n| n.parse::<usize>().ok()) {
            let rest = long_names.get(off..).unwrap_or_default();
            let n = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            Some(String::from_utf8_lossy(&rest[..n]).trim_end_matches('/').to_string())
        } else if let Some(n) = raw.strip_prefix("#1/").and_then(|n| n.parse::<usize>().ok()) {
            let n = n.min(body.len());
            let name = String::from_utf8_lossy(&body[..n]).trim_end_matches('\0').to_string();
            body = &body[n..];
            Some(name)
        } else {
            Some(raw.trim_end_matches('/').to_string())
        };
        if let Some(name) = name {
            out.push((name, body));
        }
        pos = end + (size & 1);
    }
    Ok(out)
}

/// Adds the section sizes of one little-endian ELF32 relocatable object (the Arm EABI objects of the target).
fn elf32_sections(obj: &[u8], size: &mut CoreSize) -> Result<(), String> {
    let u16_at = |o: usize| obj.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| obj.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    // e_ident: class 1 = ELFCLASS32, data 1 = little endian.
    if obj.get(4) != Some(&1) || obj.get(5) != Some(&1) {
        return Err("not a little-endian ELF32 object".into());
    }
    let bad = || "truncated ELF header".to_string();
    let shoff = u32_at(0x20).ok_or_else(bad)? as usize;
    let shentsize = u16_at(0x2e).ok_or_else(bad)? as usize;
    let shnum = u16_at(0x30).ok_or_else(bad)? as usize;
    let shstrndx = u16_at(0x32).ok_or_else(bad)? as usize;
    let sh = |i: usize, field: usize| u32_at(shoff + i * shentsize + field).ok_or("truncated section header");
    let strtab = sh(shstrndx, 16)? as usize;
    for i in 0..shnum {
        let name_off = strtab + sh(i, 0)? as usize;
        let name = obj.get(name_off..).unwrap_or_default();
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        let bytes = u64::from(sh(i, 20)?);
        let is = |s: &[u8]| name == s || (name.starts_with(s) && name.get(s.len()) == Some(&b'.'));
        if is(b".text") {
            size.text += bytes;
        } else if is(b".rodata") {
            size.rodata += bytes;
        } else if is(b".data") {
            size.data += bytes;
        } else if is(b".bss") {
            size.bss += bytes;
        }
    }
    Ok(())
}

fn core_size(root: &Path) -> Result<(CoreSize, PathBuf), String> {
    let rlib = build_core_rlib(root)?;
    let data = std::fs::read(&rlib).map_err(|e| format!("reading {}: {e}", rlib.display()))?;
    let mut size = CoreSize::default();
    for (name, body) in ar_members(&data)? {
        if body.starts_with(b"\x7fELF") {
            elf32_sections(body, &mut size).map_err(|e| format!("{name}: {e}"))?;
            size.objects += 1;
        }
    }
    if size.objects == 0 {
        return Err(format!("{} holds no object code", rlib.display()));
    }
    Ok((size, rlib))
}

fn run_text(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new(args[0]).args(&args[1..]).current_dir(root).stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The civil date (UTC) of a Unix time in seconds (Howard Hinnant's `civil_from_days`).
fn utc_date(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let tod = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02} UTC", tod / 3600, tod / 60 % 60)
}

fn machine(root: &Path) -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| "unknown".into());
    let logical = cpuinfo.lines().filter(|l| l.starts_with("processor")).count();
    let available = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let commit = run_text(root, &["git", "rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = run_text(root, &["git", "status", "--porcelain"]).is_some_and(|s| !s.is_empty());
    let rustc = run_text(root, &["rustc", "--version"]).unwrap_or_else(|| "unknown".into());
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    json!({
        "cpu": model,
        "logical_cpus": logical,
        "available_cpus": available,
        "commit": commit,
        "uncommitted_changes": dirty,
        "rustc": rustc,
        "date": utc_date(now),
    })
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(f64::NAN)
}

fn yes(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**missed**"
    }
}

/// The targets of the issue, each with whether the figures meet it.
fn targets(r: &Value) -> Vec<(String, String, bool)> {
    let sends = num(r, "sim_sends_per_s");
    vec![
        (
            "post_send ≤ 10 ns/WQE at batch 16".into(),
            format!("{:.2} ns", num(r, "post_send_ns")),
            num(r, "post_send_ns") <= 10.0,
        ),
        (
            "post_send ≤ 2× its baseline at batch 16".into(),
            format!("{:.2}×", num(r, "post_send_ratio")),
            num(r, "post_send_ratio") <= 2.0,
        ),
        ("post_recv ≤ 5 ns/WQE".into(), format!("{:.2} ns", num(r, "post_recv_ns")), num(r, "post_recv_ns") <= 5.0),
        ("poll_cq ≤ 5 ns/CQE".into(), format!("{:.2} ns", num(r, "poll_cq_ns")), num(r, "poll_cq_ns") <= 5.0),
        (
            "poll_cq ≤ 2× its baseline".into(),
            format!("{:.2}×", num(r, "poll_cq_ratio")),
            num(r, "poll_cq_ratio") <= 2.0,
        ),
        (
            "no allocation on the datapath".into(),
            format!("{} allocations", r["datapath_allocs"]),
            r["datapath_allocs"].as_u64() == Some(0),
        ),
        ("≥ 5 M loopback SENDs/s in-line on the simulator".into(), format!("{:.2} M/s", sends / 1e6), sends >= 5e6),
    ]
}

fn markdown(r: &Value, kept: &str) -> String {
    let m = &r["machine"];
    let sz = &r["core_size"];
    let b = &r["post_send_batches"];
    let p = &r["params"];
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(&l);
        s.push('\n');
    };
    line("# Benchmarks".into());
    line(String::new());
    line(
        "Generated by `cargo xtask bench` (`--json` prints the same figures as one JSON object). Do not edit above"
            .into(),
    );
    line("the analysis marker: the next run rewrites it.".into());
    line(String::new());
    line(format!(
        "- Measured: {} at commit `{}`{}",
        m["date"].as_str().unwrap_or("?"),
        m["commit"].as_str().unwrap_or("?"),
        if m["uncommitted_changes"] == true { " plus uncommitted changes" } else { "" }
    ));
    line(format!(
        "- Machine: {}, {} logical CPUs ({} available to the process); {}",
        m["cpu"].as_str().unwrap_or("?"),
        m["logical_cpus"],
        m["available_cpus"],
        m["rustc"].as_str().unwrap_or("?")
    ));
    line(format!(
        "- Method: release build; warm-up, then {} timed windows per datapath figure, each window a whole ring of \
         {} WQEs or CQEs timed with `Instant`; the figure is the median ns per operation. Every ratio divides by a \
         baseline measured in the same run, right after.",
        p["datapath_windows"], p["window_wqes"]
    ));
    line(String::new());
    line("## Datapath against plain memory".into());
    line(String::new());
    line(
        "QPs and the CQ are created on the simulator, then driven through `mlx5_sim::testkit::mocks::MemMmio`: a BAR that is"
            .into(),
    );
    line(
        "a plain heap array written with volatile stores, with the default (x86-64: `sfence`) barriers, so the".into(),
    );
    line(
        "simulator does not run while anything is timed. WQEs go to DMA memory, the doorbell record to its page,"
            .into(),
    );
    line("the doorbell or the BlueFlame copy to the BAR.".into());
    line(String::new());
    line("| operation | ns / op | baseline ns | ratio |".into());
    line("|---|---:|---:|---:|".into());
    for batch in ["1", "16", "64"] {
        let e = &b[batch];
        let how = if batch == "1" { "BlueFlame copy" } else { "one 8-byte doorbell" };
        line(format!(
            "| `post_send`, 1-SGE SEND, {batch} per call ({how}) | {:.2} | {:.2} | {:.2} |",
            num(e, "ns"),
            num(e, "baseline_ns"),
            num(e, "ratio")
        ));
    }
    line(format!(
        "| `post_recv`, 1 SGE, {} per call | {:.2} | {:.2} | {:.2} |",
        p["recv_batch"],
        num(r, "post_recv_ns"),
        num(r, "post_recv_baseline_ns"),
        num(r, "post_recv_ratio")
    ));
    line(format!(
        "| `poll_cq`, {} CQEs ready, {} per call | {:.2} | {:.2} | {:.2} |",
        p["cq_entries"],
        p["poll_batch"],
        num(r, "poll_cq_ns"),
        num(r, "poll_cq_baseline_ns"),
        num(r, "poll_cq_ratio")
    ));
    line(String::new());
    line(
        "Baselines: `post_send` — one 64-byte store per WQE into a ring of the same size plus one 4-byte volatile"
            .into(),
    );
    line(
        "store per batch; `post_recv` — one 16-byte store per WQE plus 4 bytes per batch; `poll_cq` — eight 8-byte"
            .into(),
    );
    line("volatile loads per CQE over the same ring, just refilled. The CQ holds half send and half receive".into());
    line("completions, routed to their work requests through the QP's `WrTable`.".into());
    line(String::new());
    line(format!(
        "Heap allocations seen by a counting allocator during every timed `post_send`, `post_recv` and `poll_cq` call \
         and an `arm`: **{}** (the same property is a test, `tests/tests/all/no_alloc.rs`, run by `cargo test`).",
        r["datapath_allocs"]
    ));
    line(String::new());
    line("## Command encoding".into());
    line(String::new());
    line("| CREATE_CQ with 1,024 page addresses | ns |".into());
    line("|---|---:|".into());
    line(format!(
        "| `CmdQueue::post`: entry and mailbox chain linked and filled in place, signature, doorbell | {:.0} |",
        num(r, "encode_create_cq_ns")
    ));
    line(format!("| `Command::encode` into one flat zeroed buffer | {:.0} |", num(r, "encode_create_cq_flat_ns")));
    line(String::new());
    line("## The core and the simulator together".into());
    line(String::new());
    line("| figure | value |".into());
    line("|---|---:|".into());
    line(format!(
        "| loopback RC SENDs per second, in-line mode ({} B, {} per `post_send`, receives pre-posted) | {:.2} M |",
        p["sim_msg_bytes"],
        p["sim_batch"],
        num(r, "sim_sends_per_s") / 1e6
    ));
    line(format!("| the same, threaded mode | {:.2} M |", num(r, "sim_sends_per_s_threaded") / 1e6));
    line(format!("| `Hca::bring_up` to ready, in-line mode | {:.3} ms |", num(r, "bringup_ms")));
    line(format!("| `Hca::bring_up` to ready, threaded mode | {:.3} ms |", num(r, "bringup_threaded_ms")));
    line(String::new());
    line("## Size of `mlx5-core`".into());
    line(String::new());
    line(format!(
        "`.text` of the release rlib for `{EMBEDDED_TARGET}`: **{} bytes**, summed over the `.text*` sections of its {} \
         object members (also `.rodata*` {} bytes, `.data*` {}, `.bss*` {}).",
        sz["text"], sz["objects"], sz["rodata"], sz["data"], sz["bss"]
    ));
    line(
        "What this measures: the code the core compiles on its own. Generic functions (the command queue, the HCA,"
            .into(),
    );
    line(
        "the datapath, all generic over `Mmio`/`Dma`) are compiled where they are instantiated, so they are not in"
            .into(),
    );
    line("the rlib; a linked firmware image holds them for its own HAL and will be larger.".into());
    line(String::new());
    line("## Targets".into());
    line(String::new());
    line("| target | measured | |".into());
    line("|---|---:|---|".into());
    for (t, v, ok) in targets(r) {
        line(format!("| {t} | {v} | {} |", yes(ok)));
    }
    line(String::new());
    line(KEEP_MARKER.into());
    s.push_str(kept);
    s
}

fn text_summary(r: &Value) -> String {
    let mut s = String::new();
    for (k, v) in [
        ("post_send_ns (batch 16)", r["post_send_ns"].clone()),
        ("post_send_ratio", r["post_send_ratio"].clone()),
        ("post_recv_ns", r["post_recv_ns"].clone()),
        ("poll_cq_ns", r["poll_cq_ns"].clone()),
        ("poll_cq_ratio", r["poll_cq_ratio"].clone()),
        ("encode_create_cq_ns", r["encode_create_cq_ns"].clone()),
        ("sim_sends_per_s", r["sim_sends_per_s"].clone()),
        ("sim_sends_per_s_threaded", r["sim_sends_per_s_threaded"].clone()),
        ("bringup_ms", r["bringup_ms"].clone()),
        ("datapath_allocs", r["datapath_allocs"].clone()),
        ("core_text_bytes", r["core_text_bytes"].clone()),
    ] {
        s.push_str(&format!("{k:<28} {v}\n"));
    }
    for (t, v, ok) in targets(r) {
        s.push_str(&format!("target: {t}: {v} ({})\n", if ok { "met" } else { "missed" }));
    }
    s
}

pub fn run(root: &Path, as_json: bool) -> Result<(), String> {
    let mut r = run_bench(root)?;
    let (size, rlib) = core_size(root)?;
    r.insert("core_text_bytes".into(), json!(size.text));
    r.insert(
        "core_size".into(),
        json!({
            "target": EMBEDDED_TARGET,
            "rlib": rlib.file_name().map(|f| f.to_string_lossy().into_owned()),
            "objects": size.objects,
            "text": size.text,
            "rodata": size.rodata,
            "data": size.data,
            "bss": size.bss,
            "measured": "sum of .text* section sizes of the object members of the release rlib (non-generic code)",
        }),
    );
    r.insert("machine".into(), machine(root));
    let r = Value::Object(r);
    let path = root.join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    let kept = old.split_once(KEEP_MARKER).map(|(_, k)| k.to_string()).unwrap_or_else(|| "\n".into());
    std::fs::write(&path, markdown(&r, &kept)).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("xtask bench: wrote {}", path.display());
    if as_json {
        println!("{r}");
    } else {
        print!("{}", text_summary(&r));
    }
    Ok(())
}

/// `--peer`: the comparison with rdma-core; its section of BENCHMARKS.md (in the kept analysis) is replaced, or
/// added right after the analysis marker.
pub fn run_peer(root: &Path, as_json: bool) -> Result<(), String> {
    let r = peer::run(root)?;
    let path = root.join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let section = peer::markdown(&r);
    let new = match (old.find(peer::PEER_BEGIN), old.find(peer::PEER_END)) {
        (Some(a), Some(b)) if b > a => {
            format!("{}{}{}", &old[..a], section.trim_end(), &old[b + peer::PEER_END.len()..])
        }
        _ => match old.split_once(KEEP_MARKER) {
            Some((head, kept)) => format!("{head}{KEEP_MARKER}\n\n{section}{kept}"),
            None => format!("{old}\n{section}"),
        },
    };
    std::fs::write(&path, new).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("xtask bench --peer: wrote its section of {}", path.display());
    if as_json {
        println!("{}", Value::Object(r));
    } else {
        for (k, v) in r.iter().filter(|(k, _)| k.ends_with("_ratio") || k.ends_with("_speedup")) {
            println!("{k:<32} {v}");
        }
    }
    Ok(())
}

/// QPs of `bench --scale`: what an MPI job or a storage target with thousands of peers holds on one port.
pub const SCALE_QPS: usize = 65_536;
/// QPs of the CI form: past every former fixed pool (256 CQs, 4,095 doorbell records), about a second.
pub const CI_SCALE_QPS: usize = 4_096;
const SCALE_BEGIN: &str = "<!-- scale: written by `cargo xtask bench --scale` -->";
const SCALE_END: &str = "<!-- /scale -->";
/// The keys the issue names, each required in the result.
const SCALE_KEYS: [&str; 5] = ["scale_qps", "create_per_s", "destroy_per_s", "peak_rss_mb", "leaked"];

/// Runs `mlx5-bench --scale n` and checks its result: every key there, every object created, none leaked.
fn scale(root: &Path, n: usize) -> Result<Map<String, Value>, String> {
    let r = run_bench_with(root, &["--scale", &n.to_string()])?;
    if let Some(k) = SCALE_KEYS.iter().find(|k| !r.contains_key(**k)) {
        return Err(format!("mlx5-bench --scale printed no {k:?}"));
    }
    if r["scale_qps"].as_u64() != Some(n as u64) {
        return Err(format!("mlx5-bench --scale made {} QPs, not {n}", r["scale_qps"]));
    }
    if r["leaked"].as_u64() != Some(0) {
        return Err(format!("{} objects leaked at scale: {}", r["leaked"], r["leak_detail"]));
    }
    Ok(r)
}

/// The CI form: [`CI_SCALE_QPS`] QPs, checked as the full run is; `BENCHMARKS.md` untouched.
pub fn ci_scale(root: &Path) -> Result<(), String> {
    let r = scale(root, CI_SCALE_QPS)?;
    eprintln!("xtask bench --scale (CI form): {}", Value::Object(r));
    Ok(())
}

fn scale_markdown(r: &Map<String, Value>, m: &Value) -> String {
    let ph = &r["phases_s"];
    format!(
        "{SCALE_BEGIN}\n## Scale (`cargo xtask bench --scale`)\n\n\
         Measured {} at commit `{}` ({}, {} CPUs). {} RC QPs on one simulated ConnectX-5 (in-line mode), through the \
         verbs API as an application makes them: each QP with its own 2-entry CQ and its own 64-byte registered MR \
         (slots of one buffer), connected to itself on the port's loopback and brought to RTS. One SEND from each \
         MR's second half into its first on {} QPs spread over the range, both completions and the bytes checked. \
         Then every QP, MR and CQ destroyed, the context closed, and the device asked what it still holds. CI runs \
         the same with {CI_SCALE_QPS} QPs (`xtask ci`, about a second).\n\n\
         | figure | value |\n|---|---:|\n\
         | `scale_qps` | {} |\n\
         | `create_per_s` (QP + CQ + MR, to RTS: 6 commands each) | {} |\n\
         | `destroy_per_s` (QP + MR + CQ) | {} |\n\
         | `peak_rss_mb` (the process, simulated device memory included) | {} |\n\
         | `leaked` (QPs, CQs, memory keys, DMA regions, firmware pages left) | {} |\n\
         | phases, s: CQs / MRs / QPs to RTS / destroy all | {} / {} / {} / {} |\n\
         | DMA bytes per QP (its WQ, CQ buffer, doorbell records, firmware pages) | {} |\n{SCALE_END}\n",
        m["date"].as_str().unwrap_or("?"),
        m["commit"].as_str().unwrap_or("?"),
        m["cpu"].as_str().unwrap_or("?"),
        m["available_cpus"],
        r["scale_qps"],
        r["sampled_qps"],
        r["scale_qps"],
        r["create_per_s"],
        r["destroy_per_s"],
        r["peak_rss_mb"],
        r["leaked"],
        ph["create_cq"],
        ph["reg_mr"],
        ph["create_qp_to_rts"],
        ph["destroy_all"],
        r["dma_bytes_per_qp"],
    )
}

/// `--scale`: [`SCALE_QPS`] QPs; its section of BENCHMARKS.md (in the kept analysis) is replaced, or added right
/// after the analysis marker.
pub fn run_scale(root: &Path, as_json: bool) -> Result<(), String> {
    let mut r = scale(root, SCALE_QPS)?;
    let m = machine(root);
    let path = root.join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let section = scale_markdown(&r, &m);
    let new = match (old.find(SCALE_BEGIN), old.find(SCALE_END)) {
        (Some(a), Some(b)) if b > a => format!("{}{}{}", &old[..a], section.trim_end(), &old[b + SCALE_END.len()..]),
        _ => match old.split_once(KEEP_MARKER) {
            Some((head, kept)) => format!("{head}{KEEP_MARKER}\n\n{section}{kept}"),
            None => format!("{old}\n{section}"),
        },
    };
    std::fs::write(&path, new).map_err(|e| format!("writing {}: {e}", path.display()))?;
    eprintln!("xtask bench --scale: wrote its section of {}", path.display());
    r.insert("machine".into(), m);
    if as_json {
        println!("{}", Value::Object(r));
    } else {
        for k in SCALE_KEYS {
            println!("{k:<16} {}", r[k]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc_date(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc_date(951_782_400 + 3_600 + 120), "2000-02-29 01:02 UTC");
        assert_eq!(utc_date(1_767_225_599), "2025-12-31 23:59 UTC");
    }

    #[test]
    fn ar_members_resolve_gnu_long_names() {
        let mut a = b"!<arch>\n".to_vec();
        let mut member = |name: &str, body: &[u8]| {
            a.extend_from_slice(
                format!("{name:<16}{:<12}{:<6}{:<6}{:<8}{:<10}`\n", 0, 0, 0, 644, body.len()).as_bytes(),
            );
            a.extend_from_slice(body);
            if body.len() % 2 == 1 {
                a.push(b'\n');
            }
        };
        member("/", b"\0\0\0\0");
        member("//", b"a-very-long-member-name.o/\n");
        member("lib.rmeta/", b"xyz");
        member("/0", b"\x7fELF");
        let m = ar_members(&a).unwrap();
        let names: Vec<&str> = m.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["lib.rmeta", "a-very-long-member-name.o"]);
        assert_eq!(m[1].1, b"\x7fELF");
    }
}

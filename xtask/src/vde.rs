//! `cargo xtask vde`: the simulated ports on one VDE fabric across processes. Installs Debian's `vde2` (which
//! brings `libvdeplug2`) when `vde_switch` or `libvdeplug.so.2` is missing, so the simulator's VDE tests (run by
//! `cargo test --workspace`) and this job find them. Then, with the default switch of a private runtime directory
//! (the one the first process starts), it runs `mlx5 pingpong --wire vde` as RC and UD pairs: each client
//! starts before its server (no start order), and three pairs run at once on the one fabric (six processes): two
//! of Ethernet ports (RoCE) and one of InfiniBand ports (`--link ib`, by LID, in frames of their own ethertype).
//! The switch this job's processes started is ended afterwards.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian puts libvdeplug.
const LIBVDEPLUG: &str = "/usr/lib/x86_64-linux-gnu/libvdeplug.so.2";

/// The longest one ping-pong process may run.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// Whether a program is on the PATH.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
}

/// Installs `vde2` (and with it `libvdeplug2`) from Debian when `vde_switch` or libvdeplug is missing.
pub fn ensure_vde() -> Result<(), String> {
    let lib = Path::new(LIBVDEPLUG).exists() || !cfg!(target_arch = "x86_64");
    // `vde_plug` (Debian's `vdeplug`, which `vde2` brings) joins rxe-interop's guest to a switch.
    if on_path("vde_switch") && on_path("wirefilter") && on_path("vde_plug") && lib {
        return Ok(());
    }
    let install = || {
        let mut c = Command::new("apt-get");
        c.args(["install", "-y", "-q", "--no-install-recommends", "vde2", "libvdeplug2"]);
        c.env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    println!("$ apt-get install vde2 libvdeplug2");
    let first = install().status().map_err(|e| format!("failed to run apt-get: {e}"))?;
    if first.success() {
        return Ok(());
    }
    println!("apt-get install failed; $ apt-get update");
    let upd = Command::new("apt-get").args(["update", "-q"]).status().map_err(|e| e.to_string())?;
    if !upd.success() {
        return Err("apt-get update failed".into());
    }
    match install().status().map_err(|e| e.to_string())?.success() {
        true => Ok(()),
        false => Err("apt-get install vde2 libvdeplug2 failed".into()),
    }
}

fn build_tool(root: &Path, release: bool) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let ok = Command::new(cargo)
        .args(["build", "-q", "-p", "mlx5-tool", "--bin", "mlx5"])
        .args(release.then_some("--release"))
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo: {e}"))?
        .success();
    if !ok {
        return Err("building mlx5 failed".into());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    Ok(target.join(if release { "release/mlx5" } else { "debug/mlx5" }))
}

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// One side of a ping-pong on the default switch of `runtime`.
fn side(tool: &Path, runtime: &Path, args: &[String]) -> Result<Child, String> {
    Command::new(tool)
        .arg("pingpong")
        .args(args)
        .args(["--wire", "vde"])
        .env("XDG_RUNTIME_DIR", runtime)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", tool.display()))
}

/// Waits for `c` (killing it after [`RUN_TIMEOUT`]); its output, or why it failed.
fn finish(name: &str, mut c: Child) -> Result<String, String> {
    let end = Instant::now() + RUN_TIMEOUT;
    while c.try_wait().map_err(|e| e.to_string())?.is_none() {
        if Instant::now() >= end {
            let _ = c.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = c.wait_with_output().map_err(|e| e.to_string())?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() || !text.contains("data verified") {
        return Err(format!("vde: {name} failed ({}):\n{text}", out.status));
    }
    Ok(text)
}

/// The frames a side sent and those past the switch, from its `mlx5: VDE fabric:` line.
fn fabric_counts(text: &str) -> Result<(u64, u64), String> {
    let line = text.lines().find_map(|l| l.strip_prefix("mlx5: VDE fabric: "));
    let num = |s: Option<&str>| s.and_then(|s| s.split_whitespace().next()).and_then(|n| n.parse().ok());
    let sent = num(line);
    let direct = num(line.and_then(|l| l.split_once(" frames sent (")).map(|(_, r)| r));
    sent.zip(direct).ok_or_else(|| format!("vde: no fabric counters in:\n{text}"))
}

/// Ends the switch a run started in `runtime` (its pid file), and removes its directory.
fn end_switch(runtime: &Path) {
    let pid = runtime.join("mlx5-sim.pid");
    if let Some(pid) = std::fs::read_to_string(&pid).ok().and_then(|p| p.trim().parse::<i32>().ok()) {
        let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
    }
    let _ = std::fs::remove_dir_all(runtime);
}

pub fn run(root: &Path, args: &[String]) -> Result<(), String> {
    ensure_vde()?;
    if args.iter().any(|a| a == "--bench") {
        return bench(root);
    }
    if let Some(a) = args.first() {
        return Err(format!("vde: unknown option {a} (--bench)"));
    }
    let tool = build_tool(root, false)?;
    let runtime = root.join("target/vde-run");
    end_switch(&runtime);
    std::fs::create_dir_all(&runtime).map_err(|e| e.to_string())?;
    let result = (|| -> Result<(), String> {
        for ud in [false, true] {
            let mode = if ud { "UD" } else { "RC" };
            // Three pairs at once on the one fabric, each client started before its server: two of Ethernet
            // (RoCE) ports and one of InfiniBand ports, whose frames (their own ethertype) the others drop.
            let mut pairs = Vec::new();
            for link in ["eth", "eth", "ib"] {
                let port = free_port()?;
                // RC: three RoCE packets a message (or four IB fragments); UD: one, at most the 1024-byte MTU.
                let mut extra: Vec<String> = match (ud, link) {
                    (true, _) => vec!["--ud", "--size", "1000", "--iters", "50"],
                    (false, "ib") => vec!["--size", "5000", "--iters", "200"],
                    (false, _) => vec!["--size", "3000", "--iters", "200"],
                }
                .into_iter()
                .map(String::from)
                .collect();
                extra.extend(["--link".to_string(), link.to_string()]);
                let client =
                    side(&tool, &runtime, &[&["--client".into(), format!("127.0.0.1:{port}")][..], &extra].concat())?;
                std::thread::sleep(Duration::from_millis(300));
                let server = side(
                    &tool,
                    &runtime,
                    &[&["--server".into(), "--port".into(), port.to_string()][..], &extra].concat(),
                )?;
                pairs.push((link, client, server));
            }
            for (i, (link, client, server)) in pairs.into_iter().enumerate() {
                let s = finish(&format!("{mode} {link} server {i}"), server)?;
                let c = finish(&format!("{mode} {link} client {i}"), client)?;
                let last = |t: &str| t.lines().find(|l| l.contains("data verified")).unwrap_or_default().to_string();
                println!("vde: {mode} {link} pair {i}: server: {}; client: {}", last(&s), last(&c));
                for (who, text) in [("server", &s), ("client", &c)] {
                    let (sent, direct) = fabric_counts(text)?;
                    println!("vde: {mode} {link} pair {i} {who}: {sent} frames sent, {direct} past the switch");
                    // Two processes of one machine on one switch: their frames go straight to each other.
                    if direct == 0 {
                        return Err(format!("vde: {mode} {link} {who} {i} sent nothing past the switch:\n{text}"));
                    }
                    // Nothing malformed and no LID taken twice, with the other link layer's frames around.
                    if !text.contains(" 0 malformed, 0 LID conflicts") {
                        return Err(format!("vde: {mode} {link} {who} {i} dropped frames:\n{text}"));
                    }
                }
            }
        }
        if !runtime.join("mlx5-sim.vde").exists() {
            return Err("vde: the first process did not start the default switch".into());
        }
        Ok(())
    })();
    end_switch(&runtime);
    result?;
    println!(
        "vde: RC and UD ping-pong, two RoCE pairs and an InfiniBand pair at once on the default switch, clients \
         first: passed"
    );
    Ok(())
}

/// The wires the bench compares.
#[derive(Clone, Copy, PartialEq)]
enum Wire {
    /// The fabric's link over a TCP stream (`wire=listen` / `wire=connect`, the tool's default wire).
    Tcp,
    /// The VDE fabric with every frame through the switch (`MLX5_SIM_VDE_DIRECT=0`).
    Switch,
    /// The VDE fabric as it runs by default: ports of this machine past the switch.
    Vde,
}

/// One ping-pong pair (release build) on `wire`; the client's "Mbit/s" and typical (median) one-way latency.
fn pair_mbits(tool: &Path, runtime: &Path, wire: Wire, extra: &[&str]) -> Result<(f64, f64), String> {
    let port = free_port()?;
    let spawn = |role: &[String]| {
        let mut c = Command::new(tool);
        c.arg("pingpong").args(role).args(extra).env("XDG_RUNTIME_DIR", runtime);
        if wire != Wire::Tcp {
            c.args(["--wire", "vde"]);
        }
        if wire == Wire::Switch {
            c.env("MLX5_SIM_VDE_DIRECT", "0");
        }
        c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| e.to_string())
    };
    let server = spawn(&["--server".into(), "--port".into(), port.to_string()])?;
    std::thread::sleep(Duration::from_millis(300));
    let client = spawn(&["--client".into(), format!("127.0.0.1:{port}")])?;
    let text = finish("bench client", client)?;
    finish("bench server", server)?;
    let line = text.lines().find(|l| l.contains("Mbit/s")).unwrap_or_default();
    let field = |unit: &str| line.split(", ").find_map(|f| f.strip_suffix(unit)).and_then(|v| v.trim().parse().ok());
    let mbits = field(" Mbit/s").ok_or_else(|| format!("vde bench: no Mbit/s in {line:?}"))?;
    let typical = field(" us typical (median)").ok_or_else(|| format!("vde bench: no typical latency in {line:?}"))?;
    Ok((mbits, typical))
}

/// A row of the bench's table: each wire's median of `runs` (in [`Wire`] order, one per round) with the
/// slowest and fastest run, the median and range of the rounds' own ratios to the TCP stream, and how many rounds
/// the VDE fabric lost (`worse` says of a ratio whether it is a loss).
fn bench_row(name: &str, mut runs: [Vec<f64>; 3], worse: fn(f64) -> bool) -> String {
    let ratios = |w: usize| -> Vec<f64> { runs[w].iter().zip(&runs[0]).map(|(x, t)| x / t).collect() };
    let (mut sw_t, mut vde_t) = (ratios(1), ratios(2));
    let (rs, rv) = (median(&mut sw_t), median(&mut vde_t));
    let lost = vde_t.iter().filter(|r| worse(**r)).count();
    // The spread of the runs beside each median (sorted by `median`).
    let cell = |r: &mut Vec<f64>| {
        let m = median(r);
        format!("{m:.1} ({:.0}–{:.0})", r[0], r[r.len() - 1])
    };
    let ratio = |m: f64, r: &[f64]| format!("{m:.2} ({:.2}–{:.2})", r[0], r[r.len() - 1]);
    let [t, s, v] = &mut runs;
    format!(
        "| {name} | {} | {} | {} | {} | {} | {lost} of {} |",
        cell(t),
        cell(s),
        cell(v),
        ratio(rs, &sw_t),
        ratio(rv, &vde_t),
        vde_t.len()
    )
}

/// Rounds of the bench: each runs every wire once, so a load that comes and goes on the machine falls on all
/// three alike.
const BENCH_ROUNDS: usize = 9;

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `--bench`: RC (64 KiB) and UD (1000 B) ping-pong throughput between two processes, over a TCP stream, over
/// the VDE fabric through the switch only, and over the VDE fabric as it runs (past the switch), in
/// [`BENCH_ROUNDS`] rounds of one run each, the order of the three turning from round to round (none always
/// runs first or right after another); the median of each wire (and its slowest and fastest run), and the
/// median of the rounds' own ratios to the TCP stream (a round's wires ran within a second or two of each other,
/// so its ratio is less subject to the machine's load than the ratio of medians), with their range.
fn bench(root: &Path) -> Result<(), String> {
    let tool = build_tool(root, true)?;
    let runtime = root.join("target/vde-bench");
    end_switch(&runtime);
    std::fs::create_dir_all(&runtime).map_err(|e| e.to_string())?;
    let result = (|| -> Result<(), String> {
        let cases: [(&str, &[&str]); 2] = [
            ("RC 64 KiB", &["--size", "65536", "--iters", "300"]),
            ("UD 1000 B", &["--ud", "--size", "1000", "--iters", "3000"]),
        ];
        let wires = [Wire::Tcp, Wire::Switch, Wire::Vde];
        let (mut rows, mut lat_rows) = (Vec::new(), Vec::new());
        for (name, extra) in cases {
            // Mbit/s and typical latency of each wire (in `wires` order), one per round.
            let (mut mbits, mut typical): ([Vec<f64>; 3], [Vec<f64>; 3]) = Default::default();
            for round in 0..BENCH_ROUNDS {
                // Turning the order: rounds 0, 3, 6 run TCP, switch, VDE; 1, 4, 7 switch, VDE, TCP; ...
                for k in 0..wires.len() {
                    let w = (round + k) % wires.len();
                    let (m, t) = pair_mbits(&tool, &runtime, wires[w], extra)?;
                    mbits[w].push(m);
                    typical[w].push(t);
                }
                let (m, t) = (&mbits, &typical);
                println!(
                    "vde bench: {name} round {}: TCP {:.1}, switch {:.1}, VDE {:.1} Mbit/s; typical one-way \
                     latency TCP {:.1}, switch {:.1}, VDE {:.1} us",
                    round + 1,
                    m[0][round],
                    m[1][round],
                    m[2][round],
                    t[0][round],
                    t[1][round],
                    t[2][round]
                );
            }
            rows.push(bench_row(name, mbits, |r| r < 1.0));
            lat_rows.push(bench_row(name, typical, |r| r > 1.0));
        }
        println!(
            "| ping-pong, two processes | TCP stream (Mbit/s) | VDE, all through the switch (Mbit/s) | VDE (Mbit/s) \
             | switch / TCP | VDE / TCP | rounds VDE slower |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for r in rows {
            println!("{r}");
        }
        println!(
            "\n| typical one-way latency (median round trip / 2) | TCP stream (us) | VDE, all through the switch (us) \
             | VDE (us) | switch / TCP | VDE / TCP | rounds VDE slower |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for r in lat_rows {
            println!("{r}");
        }
        Ok(())
    })();
    end_switch(&runtime);
    result
}

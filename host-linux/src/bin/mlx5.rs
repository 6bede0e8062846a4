//! `mlx5`: the command-line tool. Runs on the simulated device unless told otherwise.
//!
//! ```text
//! mlx5 [--trace FILE] [--hexdump] [--threaded] devinfo [--json]
//! mlx5 [--trace FILE] [--hexdump] [--threaded] fw-tour
//! mlx5 [--trace FILE] [--hexdump] [--threaded] pingpong [--size N] [--iters N] [--json]
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use mlx5_core::cmdq::CmdQueue;
use mlx5_core::hca::{Config, Hca};
use mlx5_host::tour::run_tour;
use mlx5_host::tracefile::TraceSink;
use mlx5_sim::{Mode, SimConfig, SimDevice};

const USAGE: &str = "usage: mlx5 [--trace FILE] [--hexdump] [--threaded] <command> [--json]

commands:
  devinfo    bring the device up as Linux does and print what ibv_devinfo -v shows (--json: one JSON object)
  fw-tour    run every implemented firmware command on the device, in driver order, and report
  pingpong   RC ping-pong between two QPs of the device: SEND/RECV both ways, data verified; latency and
             bandwidth (--size BYTES, default 4096; --iters N, default 1000; --json: one JSON object)

options:
  --trace FILE   write every firmware command as a JSON line to FILE
  --hexdump      print every firmware command as the Linux mlx5 command hexdump
  --threaded     simulated firmware completes commands on its own thread (default: in line)";

struct Args {
    trace: Option<PathBuf>,
    hexdump: bool,
    threaded: bool,
    json: bool,
    size: usize,
    iters: u32,
    command: String,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        trace: None,
        hexdump: false,
        threaded: false,
        json: false,
        size: 4096,
        iters: 1000,
        command: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--trace" => args.trace = Some(it.next().ok_or("--trace needs a file name")?.into()),
            "--hexdump" => args.hexdump = true,
            "--threaded" => args.threaded = true,
            "--json" => args.json = true,
            "--size" => {
                let v = it.next().ok_or("--size needs a byte count")?;
                args.size = v.parse().map_err(|_| format!("--size: {v:?} is not a byte count"))?;
            }
            "--iters" => {
                let v = it.next().ok_or("--iters needs a number")?;
                args.iters = v.parse().map_err(|_| format!("--iters: {v:?} is not a number"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if args.command.is_empty() => args.command = s.to_string(),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    if args.command.is_empty() {
        return Err("no command given".into());
    }
    Ok(args)
}

fn sim_device(args: &Args) -> SimDevice {
    SimDevice::new(SimConfig {
        mode: if args.threaded { Mode::Threaded } else { Mode::Inline },
        ..SimConfig::default()
    })
}

fn trace_sink(args: &Args) -> Result<TraceSink, String> {
    Ok(match &args.trace {
        Some(p) => TraceSink::json_file(p).map_err(|e| e.to_string())?,
        None => TraceSink::default(),
    }
    .with_hexdump(args.hexdump))
}

/// Brings the device up, queries it, tears it down, then prints. The trace covers the whole life cycle.
fn devinfo(args: &Args) -> Result<(), String> {
    let dev = sim_device(args);
    let mut sink = trace_sink(args)?;
    let mut delay = dev.delay();
    let info = {
        let mut hca: Hca<_, _, _> = Hca::bring_up(dev.mmio(), dev.dma(), &mut sink, &mut delay, Config::default())
            .map_err(|e| e.to_string())?;
        let pci = dev.config().pci_ids;
        let info = mlx5_host::devinfo::query(&mut hca, &mut delay, "mlx5_0", pci);
        let down = hca.teardown(&mut delay);
        let info = info.map_err(|e| format!("query failed: {e}"))?;
        down.map_err(|e| format!("teardown failed: {e}"))?;
        info
    };
    sink.finish().map_err(|e| e.to_string())?;
    let (regions, bytes) = dev.dma_outstanding();
    if regions != 0 || dev.pages_owned() != 0 {
        return Err(format!(
            "teardown left {regions} DMA regions ({bytes} bytes), {} firmware pages",
            dev.pages_owned()
        ));
    }
    if args.json {
        out(&format!("{}\n", info.json()))
    } else {
        out(&info.text())
    }
}

/// Brings the device up, runs the ping-pong, tears down, and checks nothing was left allocated.
fn pingpong(args: &Args) -> Result<(), String> {
    let dev = sim_device(args);
    let mut sink = trace_sink(args)?;
    let mut delay = dev.delay();
    let dma = dev.dma();
    let report = {
        let mut hca: Hca<_, _, _> = Hca::bring_up(dev.mmio(), dev.dma(), &mut sink, &mut delay, Config::default())
            .map_err(|e| e.to_string())?;
        let opts = mlx5_host::pingpong::Options { size: args.size, iters: args.iters };
        let r = mlx5_host::pingpong::run(&mut hca, &dma, &mut delay, opts);
        let down = hca.teardown(&mut delay);
        let r = r?;
        down.map_err(|e| format!("teardown failed: {e}"))?;
        r
    };
    sink.finish().map_err(|e| e.to_string())?;
    let (regions, bytes) = dev.dma_outstanding();
    if regions != 0 || dev.pages_owned() != 0 {
        return Err(format!(
            "teardown left {regions} DMA regions ({bytes} bytes), {} firmware pages",
            dev.pages_owned()
        ));
    }
    if !report.verified {
        return Err(format!("data corrupted: {}", report.text().trim_end()));
    }
    if args.json {
        out(&format!("{}\n", report.json()))
    } else {
        out(&report.text())
    }
}

fn fw_tour(args: &Args) -> Result<(), String> {
    let cfg = SimConfig { mode: if args.threaded { Mode::Threaded } else { Mode::Inline }, ..SimConfig::default() };
    let dev = SimDevice::new(cfg);
    let sink = match &args.trace {
        Some(p) => TraceSink::json_file(p).map_err(|e| e.to_string())?,
        None => TraceSink::default(),
    }
    .with_hexdump(args.hexdump);
    let mut q = CmdQueue::new(dev.mmio(), dev.dma(), sink).map_err(|e| format!("command queue: {e}"))?;
    let mut delay = dev.delay();
    let report = run_tour(&mut q, &mut delay).map_err(|e| e.to_string())?;
    let (regions, bytes) = dev.dma_outstanding();
    let sink = std::mem::take(q.tracer());
    drop(q);
    let count = sink.finish().map_err(|e| e.to_string())?;
    let (after_regions, after_bytes) = dev.dma_outstanding();
    let mode = if args.threaded { "threaded" } else { "in-line" };
    let mut text = format!(
        "device            simulated ConnectX-5 ({mode} firmware)\n\
         ISSI              {}\n\
         pages             boot {}, init {}, given {}, taken back {}\n\
         caps (max)        log_max_qp {}, log_max_cq_sz {}\n\
         objects           uar {}, pd {}, eqn {}, cqn {:#x}\n\
         commands          {count} executed, all OK\n\
         DMA outstanding   {regions} regions / {bytes} bytes with the queue up, {after_regions} / {after_bytes} after\n",
        report.issi,
        report.boot_pages,
        report.init_pages,
        report.pages_given,
        report.pages_taken,
        report.log_max_qp,
        report.log_max_cq_sz,
        report.uar,
        report.pd,
        report.eqn,
        report.cqn,
    );
    if let Some(p) = &args.trace {
        text.push_str(&format!("trace             {}\n", p.display()));
    }
    out(&text)
}

/// Prints to standard output; a closed pipe (`mlx5 ... | head`) ends the output quietly.
fn out(text: &str) -> Result<(), String> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(format!("failed to write output: {e}")),
        _ => Ok(()),
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            return if out(&format!("{USAGE}\n")).is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE };
        }
        Err(e) => {
            eprintln!("mlx5: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = match args.command.as_str() {
        "devinfo" => devinfo(&args),
        "fw-tour" => fw_tour(&args),
        "pingpong" => pingpong(&args),
        other => Err(format!("unknown command {other:?}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlx5: {e}");
            ExitCode::FAILURE
        }
    }
}

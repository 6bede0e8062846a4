//! `mlx5`: the command-line tool. Runs on the simulated device unless told otherwise.
//!
//! ```text
//! mlx5 [--device BDF] [--link eth|ib] [--trace FILE] [--hexdump] [--threaded] devinfo [--json]
//! mlx5 [--device BDF] [--link eth|ib] [--trace FILE] [--hexdump] [--threaded] fw-tour
//! mlx5 [--device BDF] [--link eth|ib] [--trace FILE] [--pcap FILE] [--hexdump] [--threaded] pingpong [--ud]
//!      [--size N] [--iters N] [--json]
//! mlx5 [--device BDF] [--link eth|ib] [--trace FILE] [--pcap FILE] [--hexdump] pingpong
//!      --server [--port P] | --client HOST[:P] [--size N] [--iters N] [--json] [--gid-idx N] [--qemu-sock PATH]
//!      [--ipv4 ADDR] [--chk] [--wire vde[:URL]] [--qp-timeout N]
//! mlx5 devices
//! mlx5 bind BDF | unbind BDF
//! mlx5 trace decode FILE [--all] [--hexdump]
//! mlx5 [--device BDF|sim] [--link eth|ib] [--trace FILE] [--hexdump] [--threaded] bench TEST
//!      [--size N | --all [--max-size N]] [--iters N | --duration S] [--tx-depth N] [--cq-mod N] [--inline N]
//!      [--timeout S] [--json] [--progress]
//! ```
//!
//! `-v` logs bring-up milestones (info), `-vv` also every firmware command and bring-up step (debug), on
//! standard error through the `log` crate. Without it errors stay one line.

use std::process::ExitCode;
use std::sync::{Arc, OnceLock};

use mlx5_core::cmdq::CmdQueue;
use mlx5_core::hal::{DelayNs, Dma, Mmio};
use mlx5_core::hca::{Config, Hca};
use mlx5_sim::pcap::PcapSink;
use mlx5_sim::{Mode, SimConfig, SimDevice};
use mlx5_tool::cli::Args;
use mlx5_tool::error::ToolError;
use mlx5_tool::pingpong::Report;
use mlx5_tool::tour::{run_tour, TourReport};
use mlx5_verbs::devinfo::DevInfo;
use mlx5_verbs::tracefile::{SharedTrace, TraceSink};
use mlx5_verbs::DeviceKind;
use mlx5_vfio::{bind, Bdf, StdDelay, Vfio, VfioOptions};

const USAGE: &str =
    "usage: mlx5 [-v|-vv] [--device BDF] [--link eth|ib] [--trace FILE] [--pcap FILE] [--hexdump] [--threaded]
            <command> [--json]

commands:
  devices    list the devices as ibv_devices does (name, node GUID, where), without bringing any up;
             MLX5_RS_DEVICES sets the list (default: one simulated device and every ConnectX on vfio-pci)
  devinfo    bring the device up as Linux does and print what ibv_devinfo -v shows (--json: one JSON object)
  fw-tour    run every implemented firmware command on the device, in driver order, and report
  pingpong   RC ping-pong between two QPs of the device: SEND/RECV both ways, data verified; latency and
             bandwidth (--size BYTES, default 4096; --iters N, default 1000; --json: one JSON object)
             --server [--port P] / --client HOST[:P]: the two sides in two processes (or hosts), which swap
             LID, QPN, PSN and GID over TCP port P (default 18515) as ibv_rc_pingpong does; on the
             simulator their devices are joined by a simulated wire over TCP port P + 1 (--timeout SECS,
             default 30: how long to wait for the peer and for each completion; --gid-idx N: the GID entry
             advertised and sent from, rc_pingpong's -g; --qemu-sock PATH: the simulated port is plugged into a
             QEMU guest NIC listening there (-netdev stream,server=on) instead, RoCEv2 frames on the socket,
             e.g. to reach ibv_rc_pingpong over rdma_rxe, whose -c buffer the messages then are; --ipv4 ADDR:
             the simulated port's IPv4 address; --chk: the peer is ibv_rc_pingpong -c, whose buffer the
             messages are and are checked against; --wire vde[:URL]: the simulated port is plugged into a VDE
             fabric instead, any libvdeplug URL or this user's default switch, started by the first process,
             so the two sides start in any order; --qp-timeout N: the RC QP's ACK timeout, 4.096 us * 2^N,
             default 14, 18 with --qemu-sock)
             --ud: a UD ping-pong between two UD QPs of the device instead, as ibv_ud_pingpong does it
             (address handles, Q_Key 0x11111111, 40 bytes of GRH room before each received payload;
             --size default 2048 or the port's active MTU if smaller, at most the MTU); with --server /
             --client too
  bench TEST perftest-style benchmark between two RC QPs, data verified; TEST is send_bw, write_bw, read_bw,
             send_lat or write_lat. Two simulated devices on a simulated wire by default; both QPs on one
             device (loopback) with --device BDF, or --device sim. Options after TEST: --size BYTES (default
             65536 for bw, 2 for lat) or --all (sizes 2, 4, .. --max-size, default 1 MiB, at most 8 MiB);
             --iters N (default 1000) or --duration SECS; --tx-depth N (bw: outstanding requests, default
             128); --cq-mod N (bw: every Nth request signaled, default 100); --inline BYTES (lat: default 236
             for send, 220 for write); --timeout SECS (the longest wait without progress, default 10);
             --json: one JSON object; --progress: progress bar on standard error even when it is not a
             terminal
  bind BDF   hand a ConnectX to vfio-pci (driver_override, unbind, probe), as dpdk-devbind does
  unbind BDF give it back to its kernel driver (mlx5_core)
  trace decode FILE
             print each command of a --trace file with its input and output fields by name, decoded from the
             PRM layouts (--all: zero fields too; --hexdump: the Linux command hexdump instead)

options:
  --device BDF   use the ConnectX at PCI address BDF through VFIO (e.g. 0000:03:00.0); default: simulated
  --link eth|ib  the simulated port's link layer: Ethernet (RoCE, the default) or InfiniBand; refused with
                 --device BDF (the real port decides)
  --trace FILE   write every firmware command as a JSON line to FILE; when bench runs two simulated devices
                 both go to FILE, each line naming its device (\"device\": \"mlx5_0\" or \"mlx5_1\")
  --pcap FILE    write every frame the simulated ports send and receive to FILE as a pcap, in RoCEv2 form
                 (Ethernet ports; tshark/Wireshark decode it; an InfiniBand port's frames on a VDE fabric, of
                 EtherType 0x88B5, too); refused with --device BDF
  --hexdump      print every firmware command as the Linux mlx5 command hexdump
  --threaded     simulated firmware completes commands on its own thread (default: in line)
  -v, --verbose  log bring-up milestones to standard error; -vv also every firmware command";

/// The device a command runs on (the library's [`DeviceKind`]): the simulated ConnectX, or with `--device BDF`
/// a real one through VFIO.
fn open(args: &Args) -> Result<DeviceKind, ToolError> {
    let Some(addr) = &args.device else {
        log::info!("device: simulated ConnectX-5 ({} firmware)", if args.threaded { "threaded" } else { "in-line" });
        return Ok(DeviceKind::Sim(SimDevice::new(sim_config(args))));
    };
    let bdf: Bdf = addr.parse()?;
    let v = Vfio::open(bdf, VfioOptions::from_env()?)?;
    let ids = v.device.pci_ids()?;
    if ids.vendor != bind::MELLANOX_VENDOR_ID {
        return Err(ToolError::Run(format!(
            "{bdf} is not a Mellanox device (vendor {:#06x}, expected 0x15b3)",
            ids.vendor
        )));
    }
    log::info!("device: {bdf} through VFIO ({:04x}:{:04x})", ids.vendor, ids.device);
    Ok(DeviceKind::Vfio(Arc::new(v)))
}

/// The simulated device `args` ask for: firmware mode and port type.
fn sim_config(args: &Args) -> SimConfig {
    SimConfig {
        mode: if args.threaded { Mode::Threaded } else { Mode::Inline },
        port_type: args.link.unwrap_or_default(),
        pcap: PCAP.get().cloned(),
        ..SimConfig::default()
    }
}

/// The capture `--pcap FILE` opened, shared by every simulated device of the run.
static PCAP: OnceLock<PcapSink> = OnceLock::new();

/// Opens the `--pcap` file before any device exists.
fn open_pcap(args: &Args) -> Result<(), ToolError> {
    let Some(path) = &args.pcap else { return Ok(()) };
    let sink = PcapSink::create(path).map_err(|source| ToolError::Pcap { path: path.clone(), source })?;
    log::info!("capturing every simulated frame to {}", path.display());
    let _ = PCAP.set(sink);
    Ok(())
}

/// Whether the capture was written whole.
fn check_pcap() -> Result<(), ToolError> {
    match PCAP.get().and_then(|s| s.error()) {
        Some(e) => Err(ToolError::Run(format!("--pcap: writing the capture failed ({e})"))),
        None => Ok(()),
    }
}

fn pci_ids(dev: &DeviceKind) -> (u16, u16) {
    match dev {
        DeviceKind::Sim(d) => d.config().pci_ids,
        DeviceKind::Vfio(v) => v.device.pci_ids().map(|i| (i.vendor, i.device)).unwrap_or_default(),
    }
}

/// Checks nothing was left allocated after teardown: DMA regions (firmware pages included) and, on the
/// simulator, pages firmware still holds.
fn check_released(dev: &DeviceKind) -> Result<(), ToolError> {
    let (regions, bytes) = dev.dma_outstanding();
    let fw_pages = match dev {
        DeviceKind::Sim(d) => d.pages_owned(),
        DeviceKind::Vfio(_) => 0,
    };
    if regions != 0 || fw_pages != 0 {
        return Err(ToolError::Run(format!(
            "teardown left {regions} DMA regions ({bytes} bytes), {fw_pages} firmware pages"
        )));
    }
    Ok(())
}

fn notice(dev: &DeviceKind) {
    if let DeviceKind::Vfio(v) = dev {
        if v.dma.fell_back_to_small_pages() {
            eprintln!(
                "mlx5: notice: no 2 MiB hugepages, DMA memory uses 4 KiB pages (echo 64 > /proc/sys/vm/nr_hugepages)"
            );
        }
    }
}

fn trace_sink(args: &Args) -> Result<TraceSink, ToolError> {
    Ok(match &args.trace {
        Some(p) => {
            log::info!("tracing every firmware command to {}", p.display());
            TraceSink::json_file(p)?
        }
        None => TraceSink::default(),
    }
    .with_hexdump(args.hexdump))
}

/// `Hca::bring_up` with the milestones logged (`-v`); the commands themselves are logged by the trace sink (`-vv`).
fn bring_up<'s, M: Mmio, D: Dma>(
    mmio: M,
    dma: D,
    sink: &'s mut TraceSink,
    delay: &mut impl DelayNs,
) -> Result<Hca<M, D, &'s mut TraceSink>, ToolError> {
    log::info!("bring-up: starting, in Linux's order");
    let hca: Hca<_, _, _> = Hca::bring_up(mmio, dma, sink, delay, Config::default())?;
    let (major, minor, sub) = hca.fw_rev();
    log::info!(
        "bring-up: done: firmware {major}.{minor}.{sub}, ISSI {}, {} firmware pages given, {} us waiting for firmware",
        hca.issi(),
        hca.pages_given(),
        hca.waited_us()
    );
    Ok(hca)
}

/// `Hca::teardown` with the outcome logged.
fn teardown<M: Mmio, D: Dma>(hca: Hca<M, D, &mut TraceSink>, delay: &mut impl DelayNs) -> Result<(), ToolError> {
    log::info!("teardown: starting");
    let r = hca.teardown(delay).map_err(ToolError::Teardown)?;
    log::info!(
        "teardown: done: {} firmware pages reclaimed, {} abandoned{}",
        r.pages_reclaimed,
        r.pages_abandoned,
        if r.local_only { " (device in internal error: local teardown only)" } else { "" }
    );
    Ok(())
}

/// Brings the device up, queries it, tears it down. The trace covers the whole life cycle.
fn devinfo_on<M: Mmio, D: Dma>(
    mmio: M,
    dma: D,
    delay: &mut impl DelayNs,
    sink: &mut TraceSink,
    pci: (u16, u16),
) -> Result<DevInfo, ToolError> {
    let mut hca = bring_up(mmio, dma, sink, delay)?;
    let info = mlx5_verbs::devinfo::query(&mut hca, delay, "mlx5_0", pci);
    let down = teardown(hca, delay);
    let info = info.map_err(ToolError::Query)?;
    down?;
    Ok(info)
}

fn devinfo(args: &Args) -> Result<(), ToolError> {
    let dev = open(args)?;
    let mut sink = trace_sink(args)?;
    let pci = pci_ids(&dev);
    let info = match &dev {
        DeviceKind::Sim(d) => devinfo_on(d.mmio(), d.dma(), &mut d.delay(), &mut sink, pci),
        DeviceKind::Vfio(v) => devinfo_on(&v.bar, &v.dma, &mut StdDelay, &mut sink, pci),
    };
    sink.finish()?;
    notice(&dev);
    let info = info?;
    check_released(&dev)?;
    if args.json {
        out(&format!("{}\n", info.json()))
    } else {
        out(&info.text())
    }
}

/// Brings the device up, runs the ping-pong, tears down.
fn pingpong_on<M: Mmio, D: Dma>(
    mmio: M,
    dma: &D,
    delay: &mut impl DelayNs,
    sink: &mut TraceSink,
    opts: mlx5_tool::pingpong::Options,
) -> Result<Report, ToolError> {
    let mut hca = bring_up(mmio, dma, sink, delay)?;
    let r = mlx5_tool::pingpong::run(&mut hca, &dma, delay, opts);
    let down = teardown(hca, delay);
    let r = r?;
    down?;
    Ok(r)
}

fn pingpong(args: &Args) -> Result<(), ToolError> {
    if args.server || args.client.is_some() {
        return remote_pingpong(args);
    }
    if args.ud {
        return ud_pingpong(args);
    }
    let dev = open(args)?;
    let mut sink = trace_sink(args)?;
    let opts = mlx5_tool::pingpong::Options { size: args.size.unwrap_or(4096), iters: args.iters.unwrap_or(1000) };
    let report = match &dev {
        DeviceKind::Sim(d) => pingpong_on(d.mmio(), &d.dma(), &mut d.delay(), &mut sink, opts),
        DeviceKind::Vfio(v) => pingpong_on(&v.bar, &&v.dma, &mut StdDelay, &mut sink, opts),
    };
    sink.finish()?;
    notice(&dev);
    let report = report?;
    check_released(&dev)?;
    print_pingpong(args, &report)
}

/// The trace shared by the devices of a verbs run, when `--trace`, `--hexdump` or `-vv` (every command logged)
/// asks for one.
fn shared_trace(args: &Args) -> Result<Option<SharedTrace>, ToolError> {
    let wanted = args.trace.is_some() || args.hexdump || args.verbose >= 2;
    Ok(if wanted { Some(SharedTrace::new(trace_sink(args)?)) } else { None })
}

/// A context on the device `args` name, its commands going to `trace`.
fn open_context(args: &Args, trace: &Option<SharedTrace>) -> Result<mlx5_verbs::Context, ToolError> {
    let tracer = trace.as_ref().map(|t| Box::new(t.device(None)) as mlx5_verbs::Tracer);
    match &args.device {
        None => mlx5_verbs::Context::open_sim_device_with(SimDevice::new(sim_config(args)), tracer),
        Some(bdf) => {
            let bdf: Bdf = bdf.parse()?;
            mlx5_verbs::Context::open_vfio_with(bdf, tracer)
        }
    }
    .map_err(ToolError::from)
}

/// `pingpong --ud`: two UD QPs of one device, through the verbs API.
fn ud_pingpong(args: &Args) -> Result<(), ToolError> {
    let trace = shared_trace(args)?;
    let ctx = open_context(args, &trace)?;
    let dev = ctx.device().clone();
    let report = mlx5_tool::ud_pingpong::run(&ctx, args.size, args.iters.unwrap_or(1000));
    // Closing the context tears the device down; the trace gets those commands too.
    drop(ctx);
    if let Some(t) = &trace {
        t.finish()?;
    }
    notice(&dev);
    let report = report?;
    check_released(&dev)?;
    print_pingpong(args, &report)
}

/// A ping-pong's report: an error if any byte was wrong, else the line (or the JSON object).
fn print_pingpong(args: &Args, report: &Report) -> Result<(), ToolError> {
    if !report.verified {
        return Err(ToolError::Run(format!("data corrupted: {}", report.text().trim_end())));
    }
    if args.json {
        out(&format!("{}\n", report.json()))
    } else {
        out(&report.text())
    }
}

/// One side of the two-process ping-pong, through the verbs API.
fn remote_pingpong(args: &Args) -> Result<(), ToolError> {
    use mlx5_tool::remote_pingpong::{self as rp, Role};
    use mlx5_verbs::Context;
    let role = match &args.client {
        Some(c) => Role::client(c)?,
        None => Role::Server { port: args.port.unwrap_or(rp::DEFAULT_PORT), bind: args.bind },
    };
    let timeout = args.timeout.unwrap_or(std::time::Duration::from_secs(30));
    let opts = rp::Options {
        size: args.size,
        iters: args.iters.unwrap_or(1000),
        timeout,
        ud: args.ud,
        gid_index: args.gid_index.unwrap_or(0),
        rc_pingpong_data: args.qemu_sock.is_some() || args.chk,
        // A TCG guest stalls for half a second under load: 1 s per try there (8.6 s in all), 67 ms elsewhere;
        // `--qp-timeout` says otherwise (a guest on a VDE switch).
        ack_timeout: args.qp_timeout.unwrap_or(if args.qemu_sock.is_some() { 18 } else { 14 }),
    };
    let trace = shared_trace(args)?;
    let tracer = || trace.as_ref().map(|t| Box::new(t.device(None)) as mlx5_verbs::Tracer);
    let (ctx, sim) = match &args.device {
        None if args.qemu_sock.is_some() => {
            let sock = args.qemu_sock.as_deref().unwrap_or(std::path::Path::new(""));
            let dev = rp::open_sim_guest(sock, args.ipv4, timeout, PCAP.get().cloned())?;
            (Context::open_sim_device_with(dev.clone(), tracer())?, Some(dev))
        }
        None if args.vde.is_some() => {
            let dev = rp::sim_vde_device(args.link.unwrap_or_default(), PCAP.get().cloned(), args.ipv4);
            (Context::open_sim_device_with(dev.clone(), tracer())?, Some(dev))
        }
        None => {
            // Plugged into the wire only once the arguments are checked against the device (below).
            let dev = rp::sim_device(&role, args.link.unwrap_or_default(), PCAP.get().cloned());
            (Context::open_sim_device_with(dev.clone(), tracer())?, Some(dev))
        }
        Some(bdf) => {
            let bdf: Bdf = bdf.parse()?;
            (Context::open_vfio_with(bdf, tracer())?, None)
        }
    };
    rp::message_size(&ctx, &opts)?;
    match (&sim, &args.qemu_sock, &args.device, &args.vde) {
        (Some(dev), None, None, Some(url)) => dev.vde_plug(url.as_deref())?,
        (Some(dev), None, None, None) => rp::plug_wire(dev, &role, timeout)?,
        _ => {}
    }
    if let Role::Server { port, .. } = &role {
        eprintln!("mlx5: waiting for a client on port {port}");
    }
    let report = rp::run(&ctx, &role, opts);
    drop(ctx);
    if let Some(t) = &trace {
        t.finish()?;
    }
    if let (Err(_), Some(dev), true) = (&report, &sim, args.qemu_sock.is_some()) {
        // What crossed the guest link, so a failed interop run shows whether the peer's frames arrived.
        let (sent, received) = dev.guest_frames().unwrap_or((0, 0));
        let drops = dev.frame_drops();
        let why: Vec<String> = mlx5_sim::roce::frame::DropReason::ALL
            .iter()
            .filter(|r| drops.get(**r) != 0)
            .map(|r| format!("{} {}", r.name(), drops.get(*r)))
            .collect();
        eprintln!(
            "mlx5: guest link: {sent} RoCE frames sent, {received} received, {} accepted; dropped: {}",
            dev.frames_received(),
            if why.is_empty() { "none".to_string() } else { why.join(", ") }
        );
    }
    if let (Some(dev), Some(_)) = (&sim, &args.vde) {
        // What crossed the fabric and how much was sent again, so a slow run shows whether frames were lost.
        let retries = dev.events().iter().filter(|e| matches!(e, mlx5_sim::SimEvent::Retry { .. })).count();
        if let Some(c) = dev.vde_counters() {
            eprintln!(
                "mlx5: VDE fabric: {} frames sent ({} past the switch, {} of them without the writer thread, {} \
                 timed out), {} received ({} past the switch), {} not for this port, {} of the other link layer, \
                 {} malformed, {} LID conflicts; {retries} retransmissions",
                c.tx_frames,
                c.tx_direct,
                c.tx_direct_now,
                c.tx_direct_timeout,
                c.rx_frames,
                c.rx_direct,
                c.rx_not_mine,
                c.rx_other_link_layer,
                c.rx_ib_malformed,
                c.lid_conflicts
            );
        }
        // Leaves the fabric (its direct socket goes with it) once the last frames are out.
        dev.vde_unplug();
    }
    let report = report?;
    if let Some(dev) = sim {
        let (regions, bytes) = dev.dma_outstanding();
        if regions != 0 || dev.pages_owned() != 0 {
            let pages = dev.pages_owned();
            return Err(ToolError::Run(format!(
                "teardown left {regions} DMA regions ({bytes} bytes), {pages} firmware pages"
            )));
        }
    }
    print_pingpong(args, &report)
}

/// Runs the tour on a fresh command queue; returns the report, the commands traced and the DMA regions / bytes
/// outstanding while the queue was up.
fn tour_on<M: Mmio, D: Dma + Clone>(
    mmio: M,
    dma: D,
    delay: &mut impl DelayNs,
    sink: TraceSink,
    outstanding: impl Fn() -> (usize, usize),
) -> Result<(TourReport, usize, (usize, usize)), ToolError> {
    let mut q = CmdQueue::new(mmio, dma, sink).map_err(ToolError::CmdQueue)?;
    let report = run_tour(&mut q, delay)?;
    let during = outstanding();
    let sink = std::mem::take(q.tracer());
    drop(q);
    let count = sink.finish()?;
    Ok((report, count, during))
}

fn fw_tour(args: &Args) -> Result<(), ToolError> {
    let dev = open(args)?;
    let sink = trace_sink(args)?;
    let (report, count, (regions, bytes)) = match &dev {
        DeviceKind::Sim(d) => tour_on(d.mmio(), d.dma(), &mut d.delay(), sink, || d.dma_outstanding())?,
        DeviceKind::Vfio(v) => tour_on(&v.bar, &v.dma, &mut StdDelay, sink, || v.dma.outstanding())?,
    };
    let (after_regions, after_bytes) = dev.dma_outstanding();
    let what = match (&dev, args.threaded) {
        (DeviceKind::Sim(_), false) => "simulated ConnectX-5 (in-line firmware)".to_string(),
        (DeviceKind::Sim(_), true) => "simulated ConnectX-5 (threaded firmware)".to_string(),
        (DeviceKind::Vfio(v), _) => format!("{} through VFIO", v.device.bdf),
    };
    let mut text = format!(
        "device            {what}\n\
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

/// `mlx5 bench TEST [options]`: perftest-style bandwidth and latency tests through the verbs API.
fn bench(args: &Args) -> Result<(), ToolError> {
    use mlx5_tool::perftest;
    let mut opts = perftest::Options::parse(&args.operands)?;
    opts.json |= args.json;
    opts.device = args.device.clone();
    opts.threaded = args.threaded;
    opts.port_type = args.link.unwrap_or_default();
    opts.trace = shared_trace(args)?;
    opts.pcap = PCAP.get().cloned();
    let r = perftest::run(&opts, &mut |text: &str| write_out(text)).map(drop).map_err(ToolError::from);
    if let Some(t) = &opts.trace {
        t.finish()?;
    }
    r
}

/// `mlx5 bind BDF` / `mlx5 unbind BDF`.
fn bind_cmd(args: &Args, bind_it: bool) -> Result<(), ToolError> {
    let addr = args
        .operands
        .first()
        .map(String::as_str)
        .ok_or_else(|| ToolError::Run(format!("{} needs a PCI address", args.command)))?;
    let bdf: Bdf = addr.parse()?;
    let sys = mlx5_vfio::sys::LinuxSys;
    if bind_it {
        match bind::bind(&sys, bdf, Some(bind::MELLANOX_VENDOR_ID))? {
            bind::Bound::AlreadyBound => out(&format!("{bdf} is already bound to vfio-pci\n")),
            bind::Bound::From(d) => out(&format!("{bdf}: {} -> vfio-pci\n", d.as_deref().unwrap_or("no driver"))),
        }
    } else {
        let now = bind::unbind(&sys, bdf)?;
        out(&format!("{bdf}: vfio-pci -> {}\n", now.as_deref().unwrap_or("no driver")))
    }
}

/// `mlx5 trace decode FILE`: the trace read back, command by command, streamed (`-` reads standard input).
fn trace_cmd(args: &Args) -> Result<(), ToolError> {
    let file = args
        .file
        .as_deref()
        .ok_or_else(|| ToolError::Run("trace decode needs a file name (- for standard input)".into()))?;
    log::info!("trace decode: reading {}", file.display());
    let opts = mlx5_tool::decode::Options { all: args.all, hexdump: args.hexdump };
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    match mlx5_tool::decode::decode_path(file, opts, &mut w) {
        Err(mlx5_tool::decode::DecodeError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.map(drop).map_err(ToolError::from),
    }
}

/// The `-v` logger: one line per record on standard error, `mlx5: LEVEL: message`.
struct StderrLogger;

impl log::Log for StderrLogger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            use std::io::Write;
            let level = r.level().as_str().to_ascii_lowercase();
            // A closed standard error has nowhere to report to; the log line is dropped.
            let _ = writeln!(std::io::stderr().lock(), "mlx5: {level}: {}", r.args());
        }
    }

    fn flush(&self) {}
}

static LOGGER: StderrLogger = StderrLogger;

/// No `-v`: only errors the driver logs (memory it keeps because the device might still use it). `-v`: warnings
/// and info (bring-up milestones); `-vv`: debug (every firmware command and bring-up step).
fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => log::LevelFilter::Error,
        1 => log::LevelFilter::Info,
        _ => log::LevelFilter::Debug,
    };
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
}

/// `ibv_devices`: the verbs device list, nothing brought up.
fn devices() -> Result<(), ToolError> {
    let list = mlx5_verbs::devices()?;
    let mut text = format!("    {:<16}\t{:<16}\t{}\n", "device", "node GUID", "where");
    text.push_str(&format!("    {:<16}\t{:<16}\t{}\n", "------", "---------", "-----"));
    for d in &list {
        let guid = d.guid().map_or_else(|| "(after open)".to_string(), |g| format!("{g:016x}"));
        let at = d.pci_address().map_or_else(|| "simulated".to_string(), |b| format!("{b} (VFIO)"));
        text.push_str(&format!("    {:<16}\t{guid:<16}\t{at}\n", d.name()));
    }
    out(&text)
}

/// Prints to standard output; a closed pipe (`mlx5 ... | head`) ends the output quietly.
fn write_out(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e),
        _ => Ok(()),
    }
}

/// [`write_out`] for a command's result.
fn out(text: &str) -> Result<(), ToolError> {
    write_out(text).map_err(ToolError::Output)
}

fn main() -> ExitCode {
    let args = match mlx5_tool::cli::parse(mlx5_args::Argv::from_env()) {
        Ok(a) => a,
        Err(e) => return mlx5_args::usage_exit("mlx5", &e, USAGE),
    };
    // bench's own options are usage too: checked before anything runs.
    if args.command == "bench" {
        if let Err(e) = mlx5_tool::perftest::Options::parse(&args.operands) {
            return mlx5_args::usage_exit("mlx5", &mlx5_args::ArgError::Other(e.to_string()), USAGE);
        }
    }
    init_logging(args.verbose);
    let result = open_pcap(&args)
        .and_then(|()| match args.command.as_str() {
            "devices" => devices(),
            "devinfo" => devinfo(&args),
            "fw-tour" => fw_tour(&args),
            "pingpong" => pingpong(&args),
            "bench" => bench(&args),
            "bind" => bind_cmd(&args, true),
            "unbind" => bind_cmd(&args, false),
            "trace" => trace_cmd(&args),
            other => Err(ToolError::Run(format!("unknown command {other:?}"))),
        })
        .and_then(|()| check_pcap());
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // An argument the device cannot take (found once it is open) is a usage error like any other.
        Err(ToolError::Usage(e)) => mlx5_args::usage_exit("mlx5", &mlx5_args::ArgError::Other(e), USAGE),
        Err(e) => {
            eprintln!("mlx5: {e}");
            ExitCode::FAILURE
        }
    }
}

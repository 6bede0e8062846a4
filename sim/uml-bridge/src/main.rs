//! `mlx5-uml-bridge --socket PATH [--port ib|eth] [--mac MAC] [--wire-listen ADDR | --wire-connect ADDR | --wire-vde URL]
//! [--trace FILE] [--bar-file FILE] [--verbose]`: listens on PATH, serves one UML instance started with
//! `virtio_uml.device=PATH:1234`, and exits when it disconnects. With `--bar-file`, the file UML was given as
//! `virt_pci_bar_file=` is watched for user doorbells. An Ethernet port offers the NIC half (mlx5e loads); its
//! cable goes to another bridge's device over TCP (`--wire-listen` on one, `--wire-connect` on the other), so two
//! UML instances' netdevs reach each other. `--subnet-manager` leaves an InfiniBand port in Init without a LID
//! until a subnet manager (opensm in the guest) activates it through MAD_IFC; `--node-guid` tells two ports of
//! one fabric apart; `--bar-file-offset` is where this device's BAR starts in the BAR file (the second device
//! of one guest). `--wire-vde URL` plugs the port into a VDE fabric instead (`vde:///dir`: a cable to a port of
//! the simulated switch, `mlx5_sim::IbSwitch`). `--memic-size BYTES` offers that much device memory (MEMIC) in a
//! BAR region after the UAR pages, backed by the BAR file's pages there (0, the default: none).

use std::fs::File;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;

use mlx5_sim::{PortType, SimConfig, SimDevice};
use mlx5_uml_bridge::barfile::{BarFile, FileRegion};
use mlx5_uml_bridge::device::Device;
use mlx5_uml_bridge::server::Server;

const USAGE: &str = "mlx5-uml-bridge --socket PATH [--port ib|eth] [--mac MAC] [--node-guid HEX] [--subnet-manager] [--wire-listen ADDR | --wire-connect ADDR | --wire-vde URL] [--trace FILE] [--bar-file FILE [--bar-file-offset HEX]] [--memic-size BYTES] [--verbose]";
/// How long `--wire-connect` waits for the other bridge's `--wire-listen`.
const WIRE_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The wire options: a MAC for the port and where its cable goes.
#[derive(Default)]
struct WireOpts {
    mac: Option<[u8; 6]>,
    node_guid: Option<u64>,
    subnet_manager: bool,
    listen: Option<String>,
    connect: Option<String>,
    /// A VDE fabric's libvdeplug URL (`vde:///dir`: a cable to a simulated switch's port, `mlx5_sim::IbSwitch`).
    vde: Option<String>,
}

/// `aa:bb:cc:dd:ee:ff`.
fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let v: Vec<u8> = s.split(':').map(|b| u8::from_str_radix(b, 16).ok()).collect::<Option<_>>()?;
    v.try_into().ok()
}
/// UAR pages: enough for mlx5_core, mlx5_ib's kernel UARs and a few user contexts (rdma-core allocates its own).
const NUM_UARS: u32 = 256;
/// The most device memory `--memic-size` takes: the region must end below the MSI-X table (`pci::MSIX_TABLE`).
const MAX_MEMIC: u32 = 1 << 22;
const _: () = assert!(
    ((mlx5_sim::FIRST_UAR_PAGE as u64 + NUM_UARS as u64) * 4096 + MAX_MEMIC as u64) <= mlx5_uml_bridge::pci::MSIX_TABLE
);

fn main() -> ExitCode {
    let mut argv = mlx5_args::Argv::from_env();
    let mut socket: Option<PathBuf> = None;
    let mut port = PortType::Ib;
    let mut trace: Option<PathBuf> = None;
    let mut verbose = false;
    let mut bar_file: Option<PathBuf> = None;
    let mut bar_offset = 0u64;
    let mut memic_size = 0u32;
    let mut wire = WireOpts::default();
    while let Some(a) = argv.next() {
        let r = a.and_then(|a| {
            match a.as_str() {
                "--socket" => socket = Some(argv.path("--socket")?),
                "--trace" => trace = Some(argv.path("--trace")?),
                "--bar-file" => bar_file = Some(argv.path("--bar-file")?),
                "--verbose" => verbose = true,
                "--mac" => {
                    let v = argv.value("--mac", "a MAC address")?;
                    let m = parse_mac(&v)
                        .ok_or_else(|| mlx5_args::ArgError::Other(format!("--mac: {v:?} is not aa:bb:cc:dd:ee:ff")))?;
                    wire.mac = Some(m);
                }
                "--node-guid" => {
                    let v = argv.value("--node-guid", "a GUID in hex")?;
                    let g = u64::from_str_radix(v.trim_start_matches("0x"), 16)
                        .map_err(|e| mlx5_args::ArgError::Other(format!("--node-guid {v:?}: {e}")))?;
                    wire.node_guid = Some(g);
                }
                "--subnet-manager" => wire.subnet_manager = true,
                "--memic-size" => {
                    let v = argv.value("--memic-size", "bytes of device memory, a multiple of 4096")?;
                    memic_size =
                        v.parse::<u32>().ok().filter(|n| n.is_multiple_of(4096) && *n <= MAX_MEMIC).ok_or_else(
                            || {
                                mlx5_args::ArgError::Other(format!(
                                    "--memic-size {v:?}: not a multiple of 4096 up to {MAX_MEMIC}"
                                ))
                            },
                        )?;
                }
                "--bar-file-offset" => {
                    let v = argv.value("--bar-file-offset", "a byte offset in hex")?;
                    bar_offset = u64::from_str_radix(v.trim_start_matches("0x"), 16)
                        .map_err(|e| mlx5_args::ArgError::Other(format!("--bar-file-offset {v:?}: {e}")))?;
                }
                "--wire-listen" => wire.listen = Some(argv.value("--wire-listen", "HOST:PORT")?),
                "--wire-connect" => wire.connect = Some(argv.value("--wire-connect", "HOST:PORT")?),
                "--wire-vde" => wire.vde = Some(argv.value("--wire-vde", "a libvdeplug URL")?),
                "--port" => {
                    port = match argv.value("--port", "ib or eth")?.as_str() {
                        "ib" => PortType::Ib,
                        "eth" => PortType::Eth,
                        o => return Err(mlx5_args::ArgError::Other(format!("--port: {o:?} is neither ib nor eth"))),
                    }
                }
                a if mlx5_args::is_help(a) => return Err(mlx5_args::ArgError::Help),
                o => return Err(mlx5_args::ArgError::Other(format!("unexpected argument {o:?}"))),
            }
            Ok(())
        });
        if let Err(e) = r {
            return mlx5_args::usage_exit("mlx5-uml-bridge", &e, USAGE);
        }
    }
    let Some(socket) = socket else {
        return mlx5_args::usage_exit(
            "mlx5-uml-bridge",
            &mlx5_args::ArgError::Other("--socket is required".into()),
            USAGE,
        );
    };
    if [wire.listen.is_some(), wire.connect.is_some(), wire.vde.is_some()].iter().filter(|&&w| w).count() > 1 {
        let e = mlx5_args::ArgError::Other("--wire-listen, --wire-connect and --wire-vde exclude each other".into());
        return mlx5_args::usage_exit("mlx5-uml-bridge", &e, USAGE);
    }
    match run(&socket, port, &wire, trace.as_deref(), bar_file.as_deref().map(|p| (p, bar_offset)), memic_size, verbose)
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlx5-uml-bridge: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    socket: &std::path::Path,
    port: PortType,
    wire: &WireOpts,
    trace: Option<&std::path::Path>,
    bar_file: Option<(&std::path::Path, u64)>,
    memic_size: u32,
    verbose: bool,
) -> std::io::Result<()> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)?;
    eprintln!("mlx5-uml-bridge: listening on {}", socket.display());
    let (conn, _) = listener.accept()?;
    let class = match port {
        PortType::Ib => 0x02_07_00,
        PortType::Eth => 0x02_00_00,
    };
    let eth = port == PortType::Eth;
    let defaults = SimConfig::default();
    let cfg = SimConfig {
        port_type: port,
        num_uars: NUM_UARS,
        eth_netdev: eth,
        mac: wire.mac.unwrap_or(defaults.mac),
        node_guid: wire.node_guid.unwrap_or(defaults.node_guid),
        subnet_manager: wire.subnet_manager,
        memic_size,
        // The trace carries every command's messages, so `mlx5 trace decode` shows them field by field.
        record_messages: trace.is_some(),
        ..defaults
    };
    let sim = SimDevice::new(cfg);
    if let Some(a) = &wire.listen {
        let at = sim.wire_listen(a).map_err(|e| std::io::Error::other(format!("--wire-listen {a}: {e}")))?;
        eprintln!("mlx5-uml-bridge: wire listening on {at}");
    }
    if let Some(a) = wire.connect.clone() {
        // On its own thread: the guest's virt-pci requests are served meanwhile (a guest left unanswered while
        // the other side is not up yet gives up on the device).
        let s = sim.clone();
        std::thread::spawn(move || match s.wire_connect(&a, WIRE_CONNECT_TIMEOUT) {
            Ok(()) => eprintln!("mlx5-uml-bridge: wire connected to {a}"),
            Err(e) => eprintln!("mlx5-uml-bridge: --wire-connect {a}: {e}"),
        });
    }
    if let Some(url) = &wire.vde {
        sim.vde_plug(Some(url)).map_err(|e| std::io::Error::other(format!("--wire-vde {url}: {e}")))?;
        eprintln!("mlx5-uml-bridge: wire plugged into {url}");
    }
    // Only the UAR pages carry doorbells; device memory after them is the user's own data.
    let uar_end = sim.mmio().uar_end();
    let trace = trace.map(File::create).transpose()?;
    let mut dev = Device::new(sim, class);
    dev.verbose = verbose;
    // Device memory lives in the BAR file, where user processes map it; it must outlive the server and its device.
    let mut _device_memory: Option<FileRegion> = None;
    let mut server = Server::new(conn, dev, trace, verbose);
    if let Some((p, off)) = bar_file {
        let f = std::fs::OpenOptions::new().read(true).write(true).open(p)?;
        if memic_size > 0 {
            let r = FileRegion::map(&f, off + uar_end as u64, memic_size as usize)?;
            // SAFETY: `r` stays mapped in `_device_memory` until after `server`, which owns the device, is dropped.
            unsafe { server.dev.sim.map_device_memory(r.ptr(), r.len()) }
                .map_err(|e| std::io::Error::other(format!("mapping device memory: {e:?}")))?;
            _device_memory = Some(r);
        }
        // The initialization segment comes first; UAR pages follow.
        let first = mlx5_sim::FIRST_UAR_PAGE;
        server.bar_file = Some(BarFile::open_at(&f, off, first, uar_end, mlx5_sim::BF_REG_SIZE)?);
    }
    let r = server.run();
    // What the simulated port dropped or failed on, counted by reason (its own counters say how much, not why),
    // and what its RDMA transport NAKed, retried or failed.
    let mut why: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
    for e in server.dev.sim.events() {
        let k = match e {
            mlx5_sim::SimEvent::FrameDropped { why } => format!("frame dropped: {why}"),
            mlx5_sim::SimEvent::EthRecvError { why, syndrome, .. } => format!("receive error {syndrome:#x}: {why}"),
            mlx5_sim::SimEvent::EthSendError { syndrome, .. } => format!("send error {syndrome:#x}"),
            // The RDMA transport's trouble: NAKs, retries, requests it could not execute, QPs that failed.
            mlx5_sim::SimEvent::RnrNak { .. } => "RNR NAK received".into(),
            mlx5_sim::SimEvent::PsnSequenceNak { .. } => "PSN sequence NAK received".into(),
            mlx5_sim::SimEvent::PsnSequenceError { .. } => "request ahead of the expected PSN (NAKed)".into(),
            mlx5_sim::SimEvent::DuplicateRequest { .. } => "duplicate request answered again".into(),
            mlx5_sim::SimEvent::Unreachable { why, .. } => format!("RC request unreachable: {why}"),
            mlx5_sim::SimEvent::Retry { kind, .. } => format!("retry after the {kind:?} timer"),
            mlx5_sim::SimEvent::QpError { syndrome, .. } => format!("QP to error, CQE syndrome {syndrome:#x}"),
            mlx5_sim::SimEvent::UdDropped { why, .. } => format!("UD message dropped: {why}"),
            mlx5_sim::SimEvent::UcDropped { why, .. } => format!("UC message dropped: {why}"),
            mlx5_sim::SimEvent::SmpStatus { attr_id, method, status } => {
                format!("SMP answered with MAD status {status:#06x}: method {method:#04x} attribute {attr_id:#06x}")
            }
            _ => continue,
        };
        *why.entry(k).or_default() += 1;
    }
    for (k, n) in why {
        eprintln!("mlx5-uml-bridge: {n} x {k}");
    }
    // The event log is bounded: the counts above are of its most recent events only.
    let dropped = server.dev.sim.events_dropped();
    if dropped > 0 {
        eprintln!("mlx5-uml-bridge: {dropped} earlier events not counted (the log keeps the most recent)");
    }
    let s = server.dev.stats;
    eprintln!(
        "mlx5-uml-bridge: done: {} cfg reads, {} cfg writes, {} BAR reads, {} BAR writes, {} EQ interrupts, {} MSIs, {} rejected, {} narrow writes, {} user doorbells ({} BAR-file scans), at most {} requests waiting, {} passes found the queue full",
        s.cfg_reads, s.cfg_writes, s.mmio_reads, s.mmio_writes, s.interrupts, s.msis, s.rejected, s.narrow_writes,
        s.user_doorbells, s.bar_scans, s.max_backlog, s.full_queue
    );
    r
}

//! `mlx5-pci-proxy --fd N [--port ib|eth] [--trace FILE] [--wire HOST:PORT] [--verbose]`: serves the simulated
//! ConnectX on the inherited UNIX stream socket N, whose other end QEMU was given as
//! `-device x-pci-proxy-dev,fd=M`; exits when QEMU closes it. `--trace` writes every completed command as a JSON
//! line. `--wire` plugs the port into another process's simulated wire (threaded firmware, the next host's
//! addresses), e.g. `mlx5 pingpong --server --port P` listening on P + 1.

use std::fs::File;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;

use mlx5_pci_proxy::server::{chain, Server};
use mlx5_sim::{Mode, PortType, SimConfig};

const USAGE: &str = "mlx5-pci-proxy --fd N [--port ib|eth] [--trace FILE] [--wire HOST:PORT] [--verbose]";
/// UAR pages: enough for a kernel driver and a few user contexts.
const NUM_UARS: u32 = 256;

fn main() -> ExitCode {
    let mut argv = mlx5_args::Argv::from_env();
    let mut fd: Option<RawFd> = None;
    let mut port = PortType::Eth;
    let mut trace: Option<PathBuf> = None;
    let mut verbose = false;
    let mut wire: Option<String> = None;
    while let Some(a) = argv.next() {
        let r = a.and_then(|a| {
            match a.as_str() {
                "--fd" => fd = Some(argv.number::<u32>("--fd", 0, 1 << 20)? as RawFd),
                "--trace" => trace = Some(argv.path("--trace")?),
                "--verbose" => verbose = true,
                "--wire" => wire = Some(argv.value("--wire", "HOST:PORT of a simulated wire listener")?),
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
            return mlx5_args::usage_exit("mlx5-pci-proxy", &e, USAGE);
        }
    }
    let Some(fd) = fd else {
        return mlx5_args::usage_exit("mlx5-pci-proxy", &mlx5_args::ArgError::Other("--fd is required".into()), USAGE);
    };
    // SAFETY: an all-zero stat is a valid out-buffer; fstat only writes it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on a descriptor number; a bad number is EBADF, checked.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        eprintln!("mlx5-pci-proxy: --fd {fd} is not an open socket");
        return ExitCode::FAILURE;
    }
    // SAFETY: the descriptor is open, a socket (checked above), inherited for this process to own.
    let sock = unsafe { UnixStream::from_raw_fd(fd) };
    let trace = match trace.map(File::create).transpose() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("mlx5-pci-proxy: --trace: {e}");
            return ExitCode::FAILURE;
        }
    };
    let class = match port {
        PortType::Ib => 0x02_07_00,
        PortType::Eth => 0x02_00_00,
    };
    let base = SimConfig { port_type: port, num_uars: NUM_UARS, ..SimConfig::default() };
    // On a wire the peer is host 0 (a listener's default): this device takes the next host's addresses.
    let cfg = if wire.is_some() { SimConfig { mode: Mode::Threaded, ..base.next_host() } } else { base };
    let mut server = Server::new(sock, cfg, class, trace);
    server.verbose = verbose;
    if let Some(w) = &wire {
        if let Err(e) = server.plug_wire(w) {
            eprintln!("mlx5-pci-proxy: --wire {w}: {}", chain(&e));
            return ExitCode::FAILURE;
        }
        eprintln!("mlx5-pci-proxy: port plugged into the simulated wire at {w}");
    }
    let r = server.run();
    let s = server.stats;
    eprintln!(
        "mlx5-pci-proxy: done: {} cfg reads, {} cfg writes, {} BAR reads, {} BAR writes, {} rejected, {} narrow \
         writes, {} memory syncs ({} MiB of guest RAM, {} bad regions, {} stale), {} resets, {} commands, {} DMA faults, \
         {} firmware pages held",
        s.cfg_reads,
        s.cfg_writes,
        s.bar_reads,
        s.bar_writes,
        s.rejected,
        s.narrow_writes,
        s.syncs,
        server.ram.bytes() >> 20,
        s.bad_regions,
        server.ram.stale,
        s.resets,
        server.commands.len(),
        server.sim.dma_faults().len(),
        server.sim.pages_owned()
    );
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlx5-pci-proxy: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

//! The `mlx5` tool's command line, over the workspace's one argument layer (`mlx5-args`): every option is
//! checked against the command it is given to, every number against its range, before anything runs or waits.
//! A usage error exits with [`mlx5_args::USAGE_EXIT`]; a run that fails exits 1.

use std::path::PathBuf;
use std::time::Duration;

use mlx5_args::{applies, is_help, ArgError, Argv};
use mlx5_sim::PortType;

/// The largest `--size` of a ping-pong: the largest message verbs allows (`max_msg_sz` is at most 2^31); the
/// device's own limit (2^30 on ConnectX) is checked once it is open, before any buffer is allocated.
pub const MAX_MESSAGE: usize = 1 << 31;
/// The longest `--timeout`, a day: long enough for anything, short enough that no deadline overflows.
pub const MAX_TIMEOUT_S: u64 = 86_400;

/// A parsed command line.
#[derive(Debug, Clone, Default)]
pub struct Args {
    pub device: Option<String>,
    pub trace: Option<PathBuf>,
    /// `--pcap FILE`: every frame the simulated ports send and receive, as RoCEv2, in a pcap file.
    pub pcap: Option<PathBuf>,
    pub hexdump: bool,
    pub threaded: bool,
    pub json: bool,
    /// `None`: the command's default (4096 for RC, 2048 or the MTU for UD).
    pub size: Option<usize>,
    pub link: Option<PortType>,
    pub ud: bool,
    /// `None`: 1000.
    pub iters: Option<u32>,
    pub all: bool,
    pub verbose: u8,
    pub command: String,
    /// What follows the command: `bench`'s test and options, `bind`'s address, `trace`'s subcommand.
    pub operands: Vec<String>,
    /// `trace decode FILE`: the file (`-` is standard input); need not be UTF-8.
    pub file: Option<PathBuf>,
    pub server: bool,
    pub client: Option<String>,
    pub port: Option<u16>,
    /// `--bind ADDR`: the server's listening address (default: every address).
    pub bind: Option<std::net::IpAddr>,
    pub timeout: Option<Duration>,
    /// `--gid-idx N`: the GID table entry the QP advertises and sends from (rc_pingpong's `-g`).
    pub gid_index: Option<u8>,
    /// `--qemu-sock PATH`: plug the simulated port into a QEMU guest NIC (`-netdev stream`, `server=on`).
    pub qemu_sock: Option<PathBuf>,
    /// `--ipv4 ADDR`: the simulated port's IPv4 address (a RoCE v2 GID entry; answered in ARP).
    pub ipv4: Option<std::net::Ipv4Addr>,
    /// `--chk`: the peer is `ibv_rc_pingpong -c` (`--chk`): send its buffer pattern and check the received one
    /// against it, instead of this tool's own per-message pattern.
    pub chk: bool,
    /// `--wire vde[:URL]`: plug the simulated port into a VDE fabric (`Some(None)`: the default switch).
    pub vde: Option<Option<String>>,
    /// `--qp-timeout N`: the RC QP's ACK timeout, 4.096 us << N (perftest's `--qp-timeout`).
    pub qp_timeout: Option<u8>,
}

/// The commands and the options each takes besides the global ones.
const COMMANDS: &[(&str, &[&str])] = &[
    ("devices", &[]),
    ("devinfo", &["--json"]),
    ("fw-tour", &[]),
    (
        "pingpong",
        &[
            "--ud",
            "--size",
            "--iters",
            "--json",
            "--server",
            "--client",
            "--port",
            "--bind",
            "--timeout",
            "--gid-idx",
            "--qemu-sock",
            "--ipv4",
            "--chk",
            "--wire",
            "--qp-timeout",
        ],
    ),
    ("bench", &[]),
    ("bind", &[]),
    ("unbind", &[]),
    ("trace", &["--all"]),
];

/// The global options (before or after the command) and the commands they do not apply to.
fn global_applies(option: &str, command: &str) -> bool {
    match option {
        "--device" => !matches!(command, "devices" | "bind" | "unbind" | "trace"),
        "--link" | "--trace" | "--threaded" | "--pcap" => !matches!(command, "devices" | "bind" | "unbind" | "trace"),
        "--hexdump" => !matches!(command, "devices" | "bind" | "unbind"),
        _ => true,
    }
}

fn is_verbose(s: &str) -> bool {
    s.len() > 1 && s.starts_with('-') && s[1..].bytes().all(|c| c == b'v')
}

/// Parses the command line (without the program name).
pub fn parse(mut argv: Argv) -> Result<Args, ArgError> {
    let mut a = Args::default();
    // The options seen, in order, to check against the command once it is known.
    let mut seen: Vec<&'static str> = Vec::new();
    loop {
        // `trace decode FILE`: the file may be any OS string (`-` is standard input), before or after options.
        if a.command == "trace" && a.operands.len() == 1 && a.file.is_none() {
            if let Some(p) = argv.peek_os() {
                if p == "-" || !p.to_string_lossy().starts_with('-') {
                    a.file = Some(argv.path("decode")?);
                    continue;
                }
            }
        }
        let Some(arg) = argv.next() else { break };
        let arg = arg?;
        let s = arg.as_str();
        if is_help(s) {
            return Err(ArgError::Help);
        }
        // What follows `bench TEST` is the benchmark's (perftest parses it), but for the global options.
        if a.command == "bench" && !is_global(s) {
            a.operands.push(arg);
            continue;
        }
        let opt: &'static str = match s {
            "--device" | "-d" => {
                a.device = Some(argv.value("--device", "a PCI address")?);
                "--device"
            }
            "--trace" => {
                a.trace = Some(argv.path("--trace")?);
                "--trace"
            }
            "--pcap" => {
                a.pcap = Some(argv.path("--pcap")?);
                "--pcap"
            }
            "--hexdump" => {
                a.hexdump = true;
                "--hexdump"
            }
            "--threaded" => {
                a.threaded = true;
                "--threaded"
            }
            "--link" => {
                a.link = Some(match argv.value("--link", "eth or ib")?.as_str() {
                    "eth" => PortType::Eth,
                    "ib" => PortType::Ib,
                    v => {
                        return Err(ArgError::Invalid {
                            option: "--link".into(),
                            why: format!("{v:?} is neither eth nor ib"),
                        })
                    }
                });
                "--link"
            }
            "--verbose" => {
                a.verbose = a.verbose.saturating_add(1);
                continue;
            }
            v if is_verbose(v) => {
                a.verbose = a.verbose.saturating_add(u8::try_from(v.len() - 1).unwrap_or(u8::MAX));
                continue;
            }
            "--server" => {
                a.server = true;
                "--server"
            }
            "--client" => {
                a.client = Some(argv.value("--client", "HOST[:PORT]")?);
                "--client"
            }
            "--timeout" => {
                a.timeout = Some(Duration::from_secs(argv.number("--timeout", 1, MAX_TIMEOUT_S)?));
                "--timeout"
            }
            "--port" => {
                // The simulated wire takes PORT + 1; port 0 (any port) cannot be told to the client.
                a.port = Some(argv.number("--port", 1, u16::MAX - 1)?);
                "--port"
            }
            "--bind" => {
                let v = argv.value("--bind", "an IP address")?;
                a.bind = Some(v.parse().map_err(|_| ArgError::Invalid {
                    option: "--bind".into(),
                    why: format!("{v:?} is not an IP address"),
                })?);
                "--bind"
            }
            "--ud" => {
                a.ud = true;
                "--ud"
            }
            "--gid-idx" => {
                a.gid_index = Some(argv.number("--gid-idx", 0, u8::MAX)?);
                "--gid-idx"
            }
            "--qemu-sock" => {
                a.qemu_sock = Some(argv.path("--qemu-sock")?);
                "--qemu-sock"
            }
            "--chk" => {
                a.chk = true;
                "--chk"
            }
            "--qp-timeout" => {
                // The QP context's 5-bit field.
                a.qp_timeout = Some(argv.number("--qp-timeout", 0, 31)?);
                "--qp-timeout"
            }
            "--wire" => {
                let v = argv.value("--wire", "vde or vde:URL")?;
                a.vde = Some(match v.split_once(':') {
                    None if v == "vde" => None,
                    Some(("vde", url)) if !url.is_empty() => Some(url.to_string()),
                    _ => {
                        return Err(ArgError::Invalid {
                            option: "--wire".into(),
                            why: format!("{v:?} is neither vde nor vde:URL"),
                        })
                    }
                });
                "--wire"
            }
            "--ipv4" => {
                let v = argv.value("--ipv4", "an IPv4 address")?;
                a.ipv4 = Some(v.parse().map_err(|_| ArgError::Invalid {
                    option: "--ipv4".into(),
                    why: format!("{v:?} is not an IPv4 address"),
                })?);
                "--ipv4"
            }
            "--json" => {
                a.json = true;
                "--json"
            }
            "--all" => {
                a.all = true;
                "--all"
            }
            "--size" => {
                a.size = Some(argv.number("--size", 1, MAX_MESSAGE)?);
                "--size"
            }
            "--iters" => {
                a.iters = Some(argv.number("--iters", 1, u32::MAX)?);
                "--iters"
            }
            s if s.starts_with('-') && s != "-" => return Err(ArgError::Unknown(s.to_string())),
            _ if a.command.is_empty() => {
                if !COMMANDS.iter().any(|(c, _)| *c == s) {
                    return Err(ArgError::Other(format!("unknown command {s:?}")));
                }
                a.command = arg;
                continue;
            }
            _ if a.operands.is_empty() && matches!(a.command.as_str(), "bind" | "unbind") => {
                a.operands.push(arg);
                continue;
            }
            _ if a.command == "trace" && a.operands.is_empty() => {
                if s != "decode" {
                    return Err(ArgError::Other(format!("unknown trace subcommand {s:?} (expected decode)")));
                }
                a.operands.push(arg);
                continue;
            }
            _ => return Err(ArgError::Other(format!("unexpected argument {s:?}"))),
        };
        seen.push(opt);
    }
    if a.command.is_empty() {
        return Err(ArgError::Other("no command given".into()));
    }
    let allowed = COMMANDS.iter().find(|(c, _)| *c == a.command).map_or(&[][..], |(_, o)| o);
    let command = if a.command == "trace" { "trace decode" } else { a.command.as_str() };
    for opt in seen {
        if !(is_global(opt) && global_applies(opt, &a.command)) {
            applies(opt, command, allowed)?;
        }
    }
    check(&a)?;
    Ok(a)
}

/// The options every command takes, wherever they stand.
fn is_global(s: &str) -> bool {
    matches!(s, "--device" | "-d" | "--link" | "--trace" | "--pcap" | "--hexdump" | "--threaded" | "--verbose")
        || is_verbose(s)
}

/// Combinations no command takes.
fn check(a: &Args) -> Result<(), ArgError> {
    let other = |s: &str| Err(ArgError::Other(s.to_string()));
    if a.link.is_some() && a.device.as_deref().is_some_and(|d| d != "sim") {
        return other("--link sets the simulated port; with --device BDF the real port decides");
    }
    if a.pcap.is_some() && a.device.as_deref().is_some_and(|d| d != "sim") {
        return other("--pcap records the simulated ports; a real port's frames are not visible to the driver");
    }
    match a.command.as_str() {
        "pingpong" => {
            let remote = a.server || a.client.is_some();
            if a.server && a.client.is_some() {
                return other("--server and --client exclude each other");
            }
            if a.bind.is_some() && !a.server {
                return other("--bind goes with --server");
            }
            if a.port.is_some() && !a.server {
                return other("--port goes with --server (the client names the port in --client HOST:PORT)");
            }
            if a.timeout.is_some() && !remote {
                return other("--timeout goes with --server / --client");
            }
            if (a.gid_index.is_some() || a.qemu_sock.is_some() || a.chk) && !remote {
                return other("--gid-idx, --qemu-sock and --chk go with --server / --client");
            }
            if a.qp_timeout.is_some() && (!remote || a.ud) {
                return other("--qp-timeout goes with an RC --server / --client");
            }
            if (a.qemu_sock.is_some() || a.ipv4.is_some()) && a.device.as_deref().is_some_and(|d| d != "sim") {
                return other(
                    "--qemu-sock and --ipv4 set up the simulated port; with --device BDF the real port decides",
                );
            }
            if a.vde.is_some() && (!remote || a.qemu_sock.is_some() || a.device.as_deref().is_some_and(|d| d != "sim"))
            {
                return other("--wire vde goes with --server / --client on the simulated port, without --qemu-sock");
            }
            if a.qemu_sock.is_some() && a.link == Some(PortType::Ib) {
                return other("--qemu-sock joins an Ethernet port (RoCE) to a guest NIC");
            }
            if a.ipv4.is_some() && a.link == Some(PortType::Ib) {
                return other("--ipv4 sets a RoCE port's address; an InfiniBand port has none");
            }
            if remote && a.threaded {
                return other(
                    "--threaded does not apply to --server / --client (their simulated firmware is threaded)",
                );
            }
        }
        "trace" if a.operands.is_empty() => return other("trace needs a subcommand: trace decode FILE"),
        "trace" if a.file.is_none() => return other("trace decode needs a file name (- for standard input)"),
        "bind" | "unbind" if a.operands.is_empty() => return other(&format!("{} needs a PCI address", a.command)),
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Args, ArgError> {
        parse(Argv::new(args.iter().copied()))
    }

    #[test]
    fn options_that_do_not_apply_are_refused() {
        for (args, want) in [
            (&["fw-tour", "--json"][..], "--json does not apply to fw-tour"),
            (&["devinfo", "--size", "5"], "--size does not apply to devinfo"),
            (&["trace", "decode", "f", "--json"], "--json does not apply to trace decode"),
            (&["devices", "--trace", "t"], "--trace does not apply to devices"),
            (&["devices", "--pcap", "p"], "--pcap does not apply to devices"),
            (&["pingpong", "--qemu-sock", "s"], "--gid-idx, --qemu-sock and --chk go with --server / --client"),
            (&["pingpong", "--chk"], "--gid-idx, --qemu-sock and --chk go with --server / --client"),
            (&["pingpong", "--qp-timeout", "18"], "--qp-timeout goes with an RC --server / --client"),
            (
                &["pingpong", "--server", "--ud", "--qp-timeout", "18"],
                "--qp-timeout goes with an RC --server / --client",
            ),
            (&["pingpong", "--server", "--qp-timeout", "32"], "--qp-timeout: \"32\" is not between 0 and 31"),
            (&["devinfo", "--chk"], "--chk does not apply to devinfo"),
            (&["pingpong", "--server", "--ipv4", "10.0.0"], "--ipv4: \"10.0.0\" is not an IPv4 address"),
            (
                &["pingpong", "--server", "--wire", "vde", "--link", "ib", "--ipv4", "10.0.2.5"],
                "--ipv4 sets a RoCE port's address; an InfiniBand port has none",
            ),
            (&["pingpong", "--server", "--gid-idx", "256"], "--gid-idx: \"256\" is not between 0 and 255"),
            (&["devinfo", "--gid-idx", "1"], "--gid-idx does not apply to devinfo"),
            (
                &["--device", "0000:03:00.0", "--pcap", "p", "devinfo"],
                "--pcap records the simulated ports; a real port's frames are not visible to the driver",
            ),
        ] {
            assert_eq!(p(args).unwrap_err().to_string(), want);
        }
    }

    #[test]
    fn numbers_are_checked_before_anything_runs() {
        for args in [
            &["pingpong", "--server", "--timeout", "18446744073709551615"][..],
            &["pingpong", "--server", "--timeout", "0"],
            &["pingpong", "--server", "--port", "0"],
            &["pingpong", "--server", "--port", "65535"],
            &["pingpong", "--size", "18446744073709551615"],
            &["pingpong", "--size", "0"],
            &["pingpong", "--iters", "+5"],
        ] {
            assert!(matches!(p(args), Err(ArgError::Invalid { .. })), "{args:?}");
        }
        let a = p(&["pingpong", "--server", "--timeout", "86400", "--port", "65534"]).unwrap();
        assert_eq!((a.timeout, a.port), (Some(Duration::from_secs(86400)), Some(65534)));
    }

    #[test]
    fn commands_and_help_parse_the_same_way_everywhere() {
        assert_eq!(p(&["--help"]).unwrap_err(), ArgError::Help);
        assert_eq!(p(&["devinfo", "-h"]).unwrap_err(), ArgError::Help);
        assert!(p(&["nonsense"]).unwrap_err().to_string().contains("unknown command"));
        assert_eq!(p(&["devinfo", "--nope"]).unwrap_err(), ArgError::Unknown("--nope".into()));
        let t = p(&["trace", "decode", "-", "--all"]).unwrap();
        assert_eq!((t.file, t.all), (Some(PathBuf::from("-")), true));
        let b = p(&["-vv", "bench", "send_lat", "--iters", "3", "--trace", "x"]).unwrap();
        assert_eq!((b.verbose, b.operands.len(), b.trace), (2, 3, Some(PathBuf::from("x"))));
    }
}

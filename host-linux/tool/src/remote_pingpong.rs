//! The two-process RC ping-pong (`mlx5 pingpong --server` / `--client HOST:PORT`), as rdma-core's
//! `ibv_rc_pingpong` runs it: each side opens its device, creates a QP, and the two swap what the other needs
//! to connect (LID, QPN, PSN, GID) over a TCP connection in rc_pingpong's text form
//! (`"LLLL:QQQQQQ:PPPPPP:GGGG…"`, hexadecimal, the GID as 32 digits). Then the client SENDs, the server checks
//! the bytes and SENDs them back, and the client checks what came back, `iters` times.
//!
//! On the simulator the two processes' devices are joined by the simulated wire over TCP
//! ([`mlx5_sim::SimDevice::wire_listen`]): the server's device listens on the port after the exchange port
//! (`PORT + 1`), the client's plugs into it. Each side starts at a random PSN, so PSNs that were exchanged wrong
//! would fail the first SEND, as on hardware.
//!
//! With `ud` the QPs are UD, as `ibv_ud_pingpong` runs them: the same exchange, then every SEND goes through an
//! address handle to the peer's GID (RoCE) or LID (InfiniBand) with its QPN and ud_pingpong's Q_Key, and lands
//! behind 40 bytes of GRH room.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use mlx5_sim::{Mode, PortType, SimConfig, SimDevice, WireError};

use crate::error::{BadClient, ToolError};
use crate::exchange::{decode_dest, encode_dest, MSG_LEN};
use crate::pingpong::Report;
use crate::ud_pingpong::{self as ud, GRH, QKEY};
use mlx5_verbs::{
    wr, Access, CanRecv, Context, Init, InitAttr, QpCap, QpType, QueuePair, RemoteQp, RtrAttr, Rts, RtsAttr, WcStatus,
    WorkCompletion,
};

/// rc_pingpong's default port.
pub const DEFAULT_PORT: u16 = 18515;

/// What the client writes once it has connected its QP, so the server knows it may start.
const DONE: &[u8; 5] = b"done\0";

/// Which side this process is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Listens for one client on `port` at `bind` (default: every address, IPv6 and IPv4).
    Server { port: u16, bind: Option<IpAddr> },
    /// Connects to the server at `host:port`.
    Client { host: String, port: u16 },
}

impl Role {
    /// Parses `--client`'s `HOST:PORT` (or `HOST`, with the default port). An IPv6 host goes in brackets.
    pub fn client(spec: &str) -> Result<Role, BadClient> {
        let bad = || BadClient { spec: spec.to_string() };
        let (host, port) = match spec.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && (!h.contains(':') || h.starts_with('[')) => {
                (h.trim_start_matches('[').trim_end_matches(']'), p.parse().map_err(|_| bad())?)
            }
            None if !spec.is_empty() => (spec, DEFAULT_PORT),
            _ => return Err(bad()),
        };
        Ok(Role::Client { host: host.to_string(), port })
    }

    fn port(&self) -> u16 {
        match self {
            Role::Server { port, .. } | Role::Client { port, .. } => *port,
        }
    }

    /// The simulated wire's port: the one after the exchange port.
    pub fn wire_port(&self) -> Result<u16, ToolError> {
        self.port()
            .checked_add(1)
            .ok_or_else(|| ToolError::Run("the port must leave room for the simulated wire at PORT + 1".into()))
    }
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// `None`: 4096 for RC; for UD 2048, or the port's MTU when smaller.
    pub size: Option<usize>,
    pub iters: u32,
    /// How long to wait for the peer: the client for the server to be up, the server for a client, and each
    /// side for every completion.
    pub timeout: Duration,
    /// UD queue pairs, as `ibv_ud_pingpong`, instead of RC.
    pub ud: bool,
    /// The GID table entry advertised and sent from (rc_pingpong's `-g`; 0 by default).
    pub gid_index: u8,
    /// Every message is `ibv_rc_pingpong -c`'s buffer (0x7b, with a zero byte at each 4 KiB page offset) rather
    /// than the per-iteration pattern, so the peer may be rdma-core's own ping-pong.
    pub rc_pingpong_data: bool,
    /// The RC QP's local ACK timeout (4.096 us << it; rc_pingpong's 14 by default). A peer in a TCG guest can
    /// stall for longer than 7 retries of 67 ms.
    pub ack_timeout: u8,
}

/// rc_pingpong's buffer fill, and the zero its `-c` check expects at each page offset.
const RC_PINGPONG_FILL: u8 = 0x7b;
const RC_PINGPONG_PAGE: usize = 4096;

/// With `--qemu-sock`: the link loses the N-th RoCE frame it sends (a test of the peer's recovery).
pub const DROP_OUT_ENV: &str = "MLX5_SIM_DROP_OUT";
/// With `--qemu-sock`: the link loses the N-th RoCE frame it receives.
pub const DROP_IN_ENV: &str = "MLX5_SIM_DROP_IN";

/// A simulated device whose port is plugged into a QEMU guest's NIC: QEMU listens on the UNIX socket `sock`
/// (`-netdev stream,server=on,addr.type=unix,addr.path=SOCK`) and the device connects, retrying until `timeout`.
/// RoCEv2 frames cross it (`mlx5_sim::SimDevice::guest_connect`); `ipv4` is the port's address (a RoCE v2 GID
/// entry, answered in ARP), so a Linux RoCE stack in the guest (rdma_rxe) can reach it.
pub fn open_sim_guest(
    sock: &std::path::Path,
    ipv4: Option<Ipv4Addr>,
    timeout: Duration,
    pcap: Option<mlx5_sim::pcap::PcapSink>,
) -> Result<SimDevice, ToolError> {
    let mut cfg = SimConfig { mode: Mode::Threaded, port_type: PortType::Eth, pcap, ..SimConfig::default() };
    if let Some(ip) = ipv4 {
        // The configuration holds static address lists; one process opens one such device.
        cfg.ipv4_addrs = Box::leak(Box::new([ip.octets()]));
    }
    let dev = SimDevice::new(cfg);
    dev.guest_connect(sock, timeout).map_err(|source| ToolError::Socket {
        what: format!("cannot reach the guest NIC at {}", sock.display()),
        source,
    })?;
    // Lost-frame tests (`cargo xtask rxe-interop`): the link loses the N-th RoCE frame it sends or receives.
    let nth = |var: &str| std::env::var(var).ok().and_then(|v| v.parse::<u64>().ok()).filter(|&n| n > 0);
    if let Some(n) = nth(DROP_OUT_ENV) {
        dev.guest_drop_frame(n);
    }
    if let Some(n) = nth(DROP_IN_ENV) {
        dev.guest_drop_frame_in(n);
    }
    Ok(dev)
}

/// The simulated device for `role`, not yet plugged in ([`plug_wire`] does that once the run's arguments are
/// checked against it): the two roles get different MACs, GUIDs and LIDs, as two hosts have. Threaded firmware,
/// so retry timers run in real time; the port is `port_type` (both sides must agree, as two ports on one cable
/// do); `pcap` records its frames.
pub fn sim_device(role: &Role, port_type: PortType, pcap: Option<mlx5_sim::pcap::PcapSink>) -> SimDevice {
    let base = SimConfig { mode: Mode::Threaded, port_type, pcap, ..SimConfig::default() };
    match role {
        Role::Server { .. } => SimDevice::new(base),
        Role::Client { .. } => SimDevice::new(base.next_host()),
    }
}

/// The simulated device of a side on a VDE fabric (`--wire vde[:URL]`): either role, Ethernet or InfiniBand, its
/// MAC, GUID, IPv4 address and LID from the process's identity ([`mlx5_verbs::vde_identity`]), so any number of
/// processes meet on the fabric; `ipv4` (`--ipv4`) replaces the address, e.g. to share a subnet with a QEMU guest
/// on the same switch. [`SimDevice::vde_plug`] plugs it in.
pub fn sim_vde_device(
    port_type: PortType,
    pcap: Option<mlx5_sim::pcap::PcapSink>,
    ipv4: Option<Ipv4Addr>,
) -> SimDevice {
    let base = SimConfig { mode: Mode::Threaded, port_type, pcap, ..SimConfig::default() };
    let mut cfg = mlx5_verbs::vde_identity(base, 0);
    if let Some(ip) = ipv4 {
        // The configuration holds static address lists; one process opens one such device.
        cfg.ipv4_addrs = Box::leak(Box::new([ip.octets()]));
    }
    SimDevice::new(cfg)
}

/// Plugs `dev` into the simulated wire: the server's listens on `PORT + 1`, the client's connects there
/// (retrying until `timeout`, as the server may still be starting).
pub fn plug_wire(dev: &SimDevice, role: &Role, timeout: Duration) -> Result<(), ToolError> {
    let wire = role.wire_port()?;
    match role {
        Role::Server { bind, .. } => {
            let at = listen_addrs(*bind, wire)
                .into_iter()
                .map(|a| dev.wire_listen(&a.to_string()))
                .reduce(|first, next| first.or(next))
                .unwrap_or_else(|| unreachable!("listen_addrs gives at least one address"))?;
            log::info!("simulated wire: listening on {at}");
            Ok(())
        }
        Role::Client { host, .. } => {
            let at = format!("{host}:{wire}");
            // The server may still be starting: the wire retries a refused connection until `timeout`.
            match dev.wire_connect(&at, timeout) {
                Ok(()) => {}
                Err(WireError::NoListener { addr, source, .. }) => {
                    let what = format!("cannot reach the server's simulated wire at {addr} within {}", secs(timeout));
                    return Err(ToolError::Peer { what, source });
                }
                Err(WireError::Handshake { .. }) => {
                    return Err(ToolError::Run(format!(
                        "the server at {at} turned the simulated wire away: it has a client already \
                         (or it is not an mlx5 simulated wire)"
                    )))
                }
                Err(e) => return Err(e.into()),
            }
            log::info!("simulated wire: plugged into {at}");
            Ok(())
        }
    }
}

/// Round trips timed one by one at most (8 MiB); the typical latency is the median of the first this many.
const TIMED_ROUND_TRIPS: usize = 1 << 20;

/// rc_pingpong's PSN: 24 random bits (here from the clock and the process id, which is random enough to tell
/// two runs apart; it is not a secret).
fn random_psn() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let x = (t as u64 ^ u64::from(std::process::id()).rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x >> 40) as u32 & 0xff_ffff
}

/// Byte `k` of ping `i`: both sides compute it, so each checks what it received. With `rc_pingpong_data` it is
/// `ibv_rc_pingpong -c`'s buffer instead.
fn ping_byte(i: u32, k: usize, rc_pingpong_data: bool) -> u8 {
    if rc_pingpong_data {
        return if k.is_multiple_of(RC_PINGPONG_PAGE) { 0 } else { RC_PINGPONG_FILL };
    }
    (k as u32).wrapping_mul(31).wrapping_add(i.wrapping_mul(7)) as u8
}

/// How much of a message is made, checked or echoed at a time: a large message is never copied whole out of
/// its buffer (three such copies a round made a 1 GiB ping-pong's memory several times its size).
const CHUNK: usize = 1 << 20;

/// Where a server listens: `bind`, or every address, IPv6 (which on Linux takes IPv4 too) then IPv4 alone for a
/// host without IPv6.
fn listen_addrs(bind: Option<IpAddr>, port: u16) -> Vec<SocketAddr> {
    match bind {
        Some(ip) => vec![SocketAddr::new(ip, port)],
        None => vec![
            SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port),
            SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port),
        ],
    }
}

/// How often a wait with nothing to do looks again: it sleeps in between, so a wait costs no CPU.
const WAIT_POLL: Duration = Duration::from_millis(10);

/// Connects the exchange socket: the server accepts one client within `timeout` (later ones are refused: the
/// listener is closed once it has one), the client retries until `timeout` (the server may still be starting).
fn rendezvous(role: &Role, timeout: Duration) -> Result<TcpStream, ToolError> {
    let end = Instant::now() + timeout;
    let stream = match role {
        Role::Server { port, bind } => {
            let l = listen_addrs(*bind, *port)
                .into_iter()
                .map(TcpListener::bind)
                .reduce(|first, next| first.or(next))
                .unwrap_or_else(|| unreachable!("listen_addrs gives at least one address"))
                .map_err(|source| ToolError::Socket { what: format!("cannot listen on port {port}"), source })?;
            l.set_nonblocking(true)
                .map_err(|source| ToolError::Socket { what: format!("cannot listen on port {port}"), source })?;
            loop {
                match l.accept() {
                    Ok((s, at)) => {
                        log::info!("client {at} connected");
                        s.set_nonblocking(false)
                            .map_err(|source| ToolError::Socket { what: "socket setup failed".into(), source })?;
                        break s;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if Instant::now() >= end {
                            return Err(ToolError::Run(format!("no client connected within {}", secs(timeout))));
                        }
                        std::thread::sleep(WAIT_POLL);
                    }
                    Err(source) => {
                        return Err(ToolError::Socket { what: "accepting the client failed".into(), source })
                    }
                }
            }
        }
        Role::Client { host, port } => {
            let addrs: Vec<_> = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|source| ToolError::Socket { what: format!("cannot resolve {host}"), source })?
                .collect();
            loop {
                let mut last = None;
                for a in &addrs {
                    match TcpStream::connect_timeout(a, Duration::from_secs(1)) {
                        Ok(s) => return finish(s, timeout),
                        Err(e) => last = Some(e),
                    }
                }
                if Instant::now() >= end {
                    let what = format!("couldn't connect to {host}:{port}");
                    return Err(match last {
                        Some(source) => ToolError::Peer { what, source },
                        None => ToolError::Run(format!("{what}: no address")),
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    finish(stream, timeout)
}

/// `timeout` as `--timeout` says it.
fn secs(d: Duration) -> String {
    format!("{} s (--timeout)", d.as_secs())
}

fn finish(s: TcpStream, timeout: Duration) -> Result<TcpStream, ToolError> {
    let _ = s.set_nodelay(true);
    s.set_read_timeout(Some(timeout))
        .map_err(|source| ToolError::Socket { what: "socket setup failed".into(), source })?;
    Ok(s)
}

fn read_msg(s: &mut TcpStream, len: usize, what: &str) -> Result<Vec<u8>, ToolError> {
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)
        .map_err(|source| ToolError::Peer { what: format!("reading the peer's {what} failed"), source })?;
    Ok(buf)
}

fn write_msg(s: &mut TcpStream, msg: &[u8], what: &str) -> Result<(), ToolError> {
    s.write_all(msg).map_err(|source| ToolError::Peer { what: format!("sending our {what} failed"), source })
}

fn verbs(what: &'static str) -> impl Fn(mlx5_verbs::VerbsError) -> ToolError {
    move |source| ToolError::Verbs { what, source }
}

/// How long after the port went down a wait still expects completions: the QP's whole retry budget (`RtsAttr::rc`:
/// 7 retries of a 67 ms ACK timeout, 8 tries in all, 0.54 s) and as much again, so an outstanding request ends
/// with its own completion (`transport retry counter exceeded`) before the wait gives up on the link.
pub const LINK_DOWN_GRACE: Duration = Duration::from_millis(2 * 8 * 68);

/// Waits for `want` successful completions within `timeout` in all (one deadline, not one per completion); any
/// other status is an error naming the work request. It polls without pause for a millisecond (a ping-pong's
/// answer comes in microseconds), then sleeps between polls, so a wait for a peer that is gone costs no CPU.
/// The port going down (the peer's cable pulled: `IBV_EVENT_PORT_ERR`) ends the wait after [`LINK_DOWN_GRACE`]:
/// a receive waits for nobody then.
fn complete(
    ctx: &Context,
    cq: &mlx5_verbs::CompletionQueue<'_>,
    want: usize,
    timeout: Duration,
) -> Result<(), ToolError> {
    let mut wc = [WorkCompletion::default(); 4];
    let mut got = 0;
    let start = Instant::now();
    let mut end = start + timeout;
    let mut link_down = false;
    while got < want {
        let room = (want - got).min(wc.len());
        let n = cq.poll(&mut wc[..room]).map_err(verbs("poll CQ"))?;
        for w in &wc[..n] {
            if w.status != WcStatus::Success {
                return Err(ToolError::Run(format!(
                    "work request {} completed with {} (vendor error {:#x})",
                    w.wr_id, w.status, w.vendor_err
                )));
            }
        }
        got += n;
        if n == 0 {
            let now = Instant::now();
            if !link_down && now - start >= Duration::from_millis(1) {
                while let Some(ev) = ctx.get_async_event(Duration::ZERO) {
                    let _ = ctx.ack_async_event(&ev);
                    if matches!(ev, mlx5_verbs::AsyncEvent::PortErr { .. }) {
                        link_down = true;
                        end = end.min(now + LINK_DOWN_GRACE);
                    }
                }
            }
            if now >= end && link_down {
                return Err(ToolError::Run(
                    "the link to the peer went down (port error event): the peer is gone".into(),
                ));
            }
            if now >= end {
                return Err(ToolError::Run(format!(
                    "timed out after {} waiting for a completion (is the peer still there?)",
                    secs(timeout)
                )));
            }
            if now - start < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200).min(end - now));
            }
        }
    }
    Ok(())
}

/// Posting receives in any state that allows it (INIT, then RTS), behind one signature.
trait PostRecv {
    fn post_one(&self, wrs: &[mlx5_verbs::RecvWr<'_>]) -> Result<(), ToolError>;
}

impl<S: CanRecv> PostRecv for QueuePair<'_, S> {
    fn post_one(&self, wrs: &[mlx5_verbs::RecvWr<'_>]) -> Result<(), ToolError> {
        self.post_recv(wrs).map_err(verbs("post receive"))
    }
}

/// The message size `opts` ask for on `ctx`'s port (a UD message must fit its MTU, an RC one the device's
/// largest message), checked with the iteration count before anything is created or anyone waited for. A size
/// the port cannot take is a [`ToolError::Usage`].
pub fn message_size(ctx: &Context, opts: &Options) -> Result<usize, ToolError> {
    let port = ctx.query_port().map_err(verbs("query port"))?;
    let n = match (opts.ud, opts.size) {
        (true, size) => ud::message_size(size, port.active_mtu).map_err(|e| ToolError::Usage(e.to_string()))?,
        (false, size) => size.unwrap_or(4096),
    };
    if n == 0 || opts.iters == 0 {
        return Err(ToolError::Usage("size and iterations must be at least 1".into()));
    }
    // `max_msg_sz` is 0 when the device's limit (2^32 and up) does not fit it: nothing to refuse then.
    let max = match port.max_msg_sz {
        0 => u64::MAX,
        m => u64::from(m),
    };
    crate::pingpong::check_size(n, max)?;
    Ok(n)
}

/// The QP once it can receive: an RC one in INIT (connected after the exchange), a UD one already in RTS.
enum Ready<'a> {
    Rc(QueuePair<'a, Init>),
    Ud(QueuePair<'a, Rts>),
}

impl<'a> Ready<'a> {
    /// RTS: an RC QP connected to `peer` (starting at `psn`), a UD one as it is.
    fn connect(self, peer: RemoteQp, psn: u32, opts: &Options) -> Result<QueuePair<'a, Rts>, ToolError> {
        match self {
            Ready::Rc(qp) => qp
                .to_rtr(RtrAttr::rc(peer).max_dest_rd_atomic(1).sgid_index(opts.gid_index))
                .map_err(|e| verbs("move the QP to RTR")(e.error))?
                .to_rts(RtsAttr::rc(psn).max_rd_atomic(1).timeout(opts.ack_timeout))
                .map_err(|e| verbs("move the QP to RTS")(e.error)),
            Ready::Ud(qp) => Ok(qp),
        }
    }
}

/// Runs one side on an open context. The exchange socket is set up first (the server waits for its client
/// here), then the QP is connected and the ping-pong runs.
pub fn run(ctx: &Context, role: &Role, opts: Options) -> Result<Report, ToolError> {
    let n = message_size(ctx, &opts)?;
    let size = u32::try_from(n).map_err(|_| ToolError::Run("--size must fit in 32 bits".into()))?;
    // UD receives carry the GRH room in front of the payload.
    let grh = if opts.ud { GRH } else { 0 };
    let pd = ctx.alloc_pd().map_err(verbs("alloc PD"))?;
    let cq = ctx.create_cq(16).map_err(verbs("create CQ"))?;
    // The message goes out from the first part of the buffer and lands in the second (behind the GRH room).
    let mut buf = ctx.alloc_buffer(2 * n + grh).map_err(verbs("allocate the buffer"))?;
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).map_err(verbs("register the buffer"))?;
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let qp = pd.create_qp(if opts.ud { QpType::Ud } else { QpType::Rc }, &cq, &cq, cap).map_err(verbs("create QP"))?;
    let ready = if opts.ud {
        Ready::Ud(qp.activate_ud(QKEY).map_err(verbs("move the QP to RTS"))?)
    } else {
        Ready::Rc(qp.to_init(InitAttr::rc(Access::default())).map_err(|e| verbs("move the QP to INIT")(e.error))?)
    };
    let recv_len = size + grh as u32;
    let recv = |qp: &dyn PostRecv| qp.post_one(&[wr::recv(1, &[mr.sge(n, recv_len)])]);
    // A receive is up before the peer can learn our QPN, as rc_pingpong does.
    let mut me = match &ready {
        Ready::Rc(qp) => {
            recv(qp)?;
            ctx.remote_qp(qp)
        }
        Ready::Ud(qp) => {
            recv(qp)?;
            ctx.remote_qp(qp)
        }
    }
    .map_err(verbs("query port"))?;
    me.psn = random_psn();
    if opts.gid_index != 0 {
        me.gid = ctx.query_gid(opts.gid_index.into()).map_err(verbs("query GID"))?;
    }

    let mut s = rendezvous(role, opts.timeout)?;
    let server = matches!(role, Role::Server { .. });
    let peer = if server {
        decode_dest(&read_msg(&mut s, MSG_LEN, "address")?)?
    } else {
        write_msg(&mut s, &encode_dest(&me), "address")?;
        decode_dest(&read_msg(&mut s, MSG_LEN, "address")?)?
    };
    log::info!("local address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}", me.lid, me.qpn, me.psn);
    log::info!("remote address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}", peer.lid, peer.qpn, peer.psn);
    let qp = ready.connect(peer, me.psn, &opts)?;
    let ah = if opts.ud {
        Some(pd.create_ah(&ud::route(ctx, &peer, opts.gid_index)).map_err(verbs("create address handle"))?)
    } else {
        None
    };
    let sge = [mr.sge(0, size)];
    let send = || match &ah {
        Some(ah) => qp.post_send(&[wr::ud_send(2, &sge, ah.dest(peer.qpn, QKEY))]),
        None => qp.post_send(&[wr::send(2, &sge)]),
    };
    if server {
        write_msg(&mut s, &encode_dest(&me), "address")?;
        let done = read_msg(&mut s, DONE.len(), "go-ahead")?;
        if done != DONE {
            return Err(ToolError::Run("the client did not confirm the connection".into()));
        }
    } else {
        write_msg(&mut s, DONE, "go-ahead")?;
    }

    let mut chunk = vec![0u8; n.min(CHUNK)];
    let mut verified = true;
    let at = n + grh;
    // Each iteration's time (a round trip), room taken before the loop so the loop allocates nothing; at most
    // TIMED_ROUND_TRIPS of them (memory stays bounded whatever --iters says).
    let mut round_trips = Vec::with_capacity((opts.iters as usize).min(TIMED_ROUND_TRIPS));
    let start = Instant::now();
    for i in 0..opts.iters {
        let began = Instant::now();
        let expected = |off: usize, c: &[u8]| {
            c.iter().enumerate().all(|(k, &b)| b == ping_byte(i, off + k, opts.rc_pingpong_data))
        };
        if server {
            // The ping arrives in the second part; it must be ping i; it goes back from the first part.
            complete(ctx, &cq, 1, opts.timeout)?;
            for off in (0..n).step_by(CHUNK) {
                let c = &mut chunk[..CHUNK.min(n - off)];
                mr.read(at + off, c).map_err(verbs("read the ping"))?;
                verified &= expected(off, c);
                mr.write(off, c).map_err(verbs("copy the ping"))?;
            }
            recv(&qp)?;
            send().map_err(verbs("post send"))?;
            complete(ctx, &cq, 1, opts.timeout)?;
        } else {
            for off in (0..n).step_by(CHUNK) {
                let c = &mut chunk[..CHUNK.min(n - off)];
                for (k, b) in c.iter_mut().enumerate() {
                    *b = ping_byte(i, off + k, opts.rc_pingpong_data);
                }
                mr.write(off, c).map_err(verbs("write the ping"))?;
            }
            send().map_err(verbs("post send"))?;
            // The send's completion and the pong's, in either order.
            complete(ctx, &cq, 2, opts.timeout)?;
            for off in (0..n).step_by(CHUNK) {
                let c = &mut chunk[..CHUNK.min(n - off)];
                mr.read(at + off, c).map_err(verbs("read the pong"))?;
                verified &= expected(off, c);
            }
            recv(&qp)?;
        }
        if round_trips.len() < TIMED_ROUND_TRIPS {
            round_trips.push(began.elapsed().as_nanos() as u64);
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // The last receive posted is still outstanding; destroying the QP flushes it.
    qp.destroy().map_err(verbs("destroy QP"))?;
    mr.destroy().map_err(verbs("deregister the buffer"))?;
    cq.destroy().map_err(verbs("destroy CQ"))?;
    // The address handle belongs to the PD: it goes before it (ibv_destroy_ah before ibv_dealloc_pd).
    drop(ah);
    pd.destroy().map_err(verbs("dealloc PD"))?;
    Ok(Report::from_run(opts.iters, n, secs, verified).with_round_trips(&mut round_trips))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_addresses_parse() {
        let c = |h: &str, port| Ok(Role::Client { host: h.into(), port });
        assert_eq!(Role::client("localhost:9000"), c("localhost", 9000));
        assert_eq!(Role::client("10.0.0.1"), c("10.0.0.1", DEFAULT_PORT));
        assert_eq!(Role::client("[::1]:7"), c("::1", 7));
        assert!(Role::client("host:port").is_err());
        assert!(Role::client(":1").is_err());
        assert!(Role::Server { port: u16::MAX, bind: None }.wire_port().is_err());
    }
}

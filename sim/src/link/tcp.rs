//! The fabric over TCP: a simulated device in another process at the far end of a TCP connection, so two
//! programs (`mlx5 pingpong --server` and `--client`, `wire=listen` / `wire=connect`) talk through two simulated
//! ConnectX without a NIC and without libvdeplug (the aarch64 tests under qemu-user have none).
//!
//! One device listens ([`crate::sim_device::SimDevice::wire_listen`]), the other connects
//! ([`crate::sim_device::SimDevice::wire_connect`]). The connection is a point-to-point stream of Ethernet frames
//! in QEMU's stream framing (`stream.rs`), and the link on it is the fabric's (`vde.rs`): RoCEv2 frames between
//! Ethernet ports (destination MACs from link-local GIDs or ARP), an InfiniBand port's packets in IB frames
//! (`vde_ib.rs`), the same counters and bounded queues as on a VDE switch. Only meeting is this file's: each end
//! first sends a hello frame ([`Hello`]: its link layer, LID, GID and MAC), so a listener knows a fabric port connected
//! and both refuse a peer with their own address ([`WireError::SameAddress`]). The stream is trusted no more than
//! a cable: a length that is not the framing's ends the link ([`crate::events::SimEvent::LinkDown`]), and
//! requests it carried time out at the requester like any lost packet.
//!
//! The listener's accept thread never waits on a peer: each connection's handshake runs on a thread of its own,
//! at most [`MAX_PENDING`] at once (a further connection closes the oldest pending one), and a peer that says
//! nothing within the handshake timeout is dropped. So silent connections, however many, neither lock a real peer
//! out nor grow threads or memory without bound. The connecting side retries a refused connection with backoff
//! until its timeout, so the two programs of a pair may start in either order.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use super::port::{log, wire, Cable, Station, DRAIN_TIMEOUT};
use super::stream::{read_frame, write_frame, Hello, Sock, StreamConn, HELLO_LEN};
use super::vde::plug_with;
use crate::events::SimEvent;

/// How long the handshake may take once the TCP connection is up.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes the listener runs at once. A connection beyond them closes the oldest pending one: a peer that
/// speaks completes its handshake in microseconds, so it still gets through a flood of silent connections.
pub const MAX_PENDING: usize = 8;

/// How long the accept thread waits for a closed handshake's thread to end before it turns the new connection
/// away instead (a closed socket ends its handshake at once, so this is a bound, not a pace).
const EVICT_WAIT: Duration = Duration::from_secs(1);

/// The connecting side's first pause between refused attempts; it doubles up to [`CONNECT_BACKOFF_MAX`].
const CONNECT_BACKOFF: Duration = Duration::from_millis(10);
const CONNECT_BACKOFF_MAX: Duration = Duration::from_millis(500);
/// The longest one connection attempt may take (an address that drops SYNs), so the retries keep going.
const CONNECT_ATTEMPT_MAX: Duration = Duration::from_secs(2);

/// How often the listener looks whether its device still exists.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

/// Why a link could not be set up.
#[derive(Debug)]
pub enum WireError {
    /// The listening socket could not be opened.
    Listen { addr: String, source: io::Error },
    /// The address did not resolve.
    Connect { addr: String, source: io::Error },
    /// Nothing accepted a connection at the address, however often it was tried until the timeout.
    NoListener { addr: String, waited: Duration, attempts: u32, source: io::Error },
    /// The peer spoke, but not this protocol (or not this version), or went away during the handshake.
    Handshake { peer: String, why: &'static str },
    /// The peer's port has this device's own address: two simulated devices need different MACs, GUIDs and LIDs.
    SameAddress { peer: String },
    /// This device is gone (its last handle was dropped while the link was being set up).
    DeviceGone,
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::Listen { addr, source } => write!(f, "cannot listen for a simulated wire on {addr}: {source}"),
            WireError::Connect { addr, source } => write!(f, "cannot reach the simulated wire at {addr}: {source}"),
            WireError::NoListener { addr, waited, attempts, source } => {
                write!(f, "no listener at {addr} after {:.1} s ({attempts} attempts): {source}", waited.as_secs_f64())
            }
            WireError::Handshake { peer, why } => write!(f, "simulated wire handshake with {peer} failed: {why}"),
            WireError::SameAddress { peer } => write!(
                f,
                "the simulated device at {peer} has this device's own port address (give the two devices \
                 different MACs, GUIDs and LIDs)"
            ),
            WireError::DeviceGone => write!(f, "the simulated device went away"),
        }
    }
}

impl std::error::Error for WireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            WireError::Listen { source, .. }
            | WireError::Connect { source, .. }
            | WireError::NoListener { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Listens on `addr` for a peer; returns the bound address. While a peer is plugged in, another is turned away
/// (closed before the hello, and recorded), so it cannot cut a running session's cable; once the first is gone a
/// new one may plug in.
pub(crate) fn listen<S: Station>(station: &Arc<S>, addr: &str) -> Result<SocketAddr, WireError> {
    listen_with(station, addr, HANDSHAKE_TIMEOUT)
}

/// [`listen`] with the time a connection has to say hello.
pub(crate) fn listen_with<S: Station>(
    station: &Arc<S>,
    addr: &str,
    handshake: Duration,
) -> Result<SocketAddr, WireError> {
    let err = |source| WireError::Listen { addr: addr.to_string(), source };
    let listener = TcpListener::bind(addr).map_err(err)?;
    let local = listener.local_addr().map_err(err)?;
    listener.set_nonblocking(true).map_err(err)?;
    let state = Arc::new(Listening {
        station: Arc::downgrade(station),
        handshake,
        pending: Mutex::default(),
        room: Condvar::new(),
        plugging: Mutex::new(()),
    });
    std::thread::Builder::new()
        .name("mlx5-sim-listen".into())
        .spawn(move || accept_loop(state, listener))
        .map_err(|source| WireError::Listen { addr: local.to_string(), source })?;
    Ok(local)
}

/// What the accept thread shares with its handshake threads.
#[derive(Debug)]
struct Listening<S> {
    station: Weak<S>,
    /// How long a connection may take to say hello.
    handshake: Duration,
    pending: Mutex<Pending>,
    /// Signalled when a handshake ends.
    room: Condvar,
    /// Held from a hello's arrival until its link is plugged in, so two handshakes finishing together cannot
    /// both plug in (the second one sees the first's link and is turned away).
    plugging: Mutex<()>,
}

/// The handshakes running (one thread each): each one's number and a handle on its socket, to close it when
/// evicted.
#[derive(Debug, Default)]
struct Pending {
    next: u64,
    /// Oldest first; an evicted one is closed already and its thread ending.
    open: VecDeque<(u64, TcpStream, bool)>,
}

impl<S> Listening<S> {
    /// A number for one more handshake, once fewer than [`MAX_PENDING`] run: the oldest is closed to make room
    /// and its thread waited for. `None` (turn the connection away) if it does not end within [`EVICT_WAIT`].
    fn admit(&self, handle: TcpStream) -> Option<u64> {
        let mut p = held(&self.pending);
        if p.open.len() >= MAX_PENDING {
            if let Some(oldest) = p.open.iter_mut().find(|(_, _, evicted)| !evicted) {
                let _ = oldest.1.shutdown(Shutdown::Both);
                oldest.2 = true;
            }
            p = self.room.wait_timeout_while(p, EVICT_WAIT, |p| p.open.len() >= MAX_PENDING).ok()?.0;
            if p.open.len() >= MAX_PENDING {
                return None;
            }
        }
        let id = p.next;
        p.next += 1;
        p.open.push_back((id, handle, false));
        Some(id)
    }

    /// Handshake `id` has ended.
    fn done(&self, id: u64) {
        held(&self.pending).open.retain(|(n, _, _)| *n != id);
        self.room.notify_all();
    }
}

fn accept_loop<S: Station>(state: Arc<Listening<S>>, listener: TcpListener) {
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                let Some(station) = state.station.upgrade() else { return };
                if wire(&*station, |w| w.remote_link()).is_some_and(|l| l.is_up()) {
                    let _ = stream.shutdown(Shutdown::Both);
                    log(&*station, SimEvent::LinkDown { peer, why: "a peer is plugged in already" });
                    continue;
                }
                drop(station);
                start_handshake(&state, stream, peer);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if state.station.strong_count() == 0 {
                    return;
                }
                std::thread::sleep(ACCEPT_POLL);
            }
            Err(_) => std::thread::sleep(ACCEPT_POLL),
        }
    }
}

/// Runs a new connection's handshake on a thread of its own (the accept thread goes straight back to
/// accepting); a connection that cannot get one is turned away and recorded.
fn start_handshake<S: Station>(state: &Arc<Listening<S>>, stream: TcpStream, peer: SocketAddr) {
    let refuse = |why: &'static str| {
        let _ = stream.shutdown(Shutdown::Both);
        if let Some(station) = state.station.upgrade() {
            log(&*station, SimEvent::LinkDown { peer, why });
        }
    };
    let handle = match stream.set_nonblocking(false).and_then(|()| stream.try_clone()) {
        Ok(h) => h,
        Err(_) => return refuse("socket setup failed"),
    };
    let Some(id) = state.admit(handle) else { return refuse("too many handshakes pending") };
    let st = state.clone();
    let spawned = std::thread::Builder::new().name("mlx5-sim-hello".into()).spawn(move || {
        let r = accept_peer(&st, stream, peer);
        st.done(id);
        // A peer that fails the handshake is turned away (and recorded); the listener keeps listening.
        if let (Err(e), Some(station)) = (r, st.station.upgrade()) {
            log(&*station, SimEvent::LinkDown { peer, why: handshake_reason(&e) });
        }
    });
    if spawned.is_err() {
        state.done(id);
        if let Some(station) = state.station.upgrade() {
            log(&*station, SimEvent::LinkDown { peer, why: "could not start the handshake" });
        }
    }
}

/// The listening side of a handshake: the peer's hello (within the timeout, holding no reference to the
/// device), then ours, then the link plugged in, unless a peer plugged in meanwhile.
fn accept_peer<S: Station>(state: &Listening<S>, stream: TcpStream, peer: SocketAddr) -> Result<(), WireError> {
    let hs = |why: &'static str| WireError::Handshake { peer: peer.to_string(), why };
    let mut r = hello_stream(&stream, state.handshake).map_err(|_| hs("socket setup failed"))?;
    let theirs = hear_hello(&mut r).map_err(hs)?;
    let station = state.station.upgrade().ok_or(WireError::DeviceGone)?;
    let _plugging = held(&state.plugging);
    if wire(&*station, |w| w.remote_link()).is_some_and(|l| l.is_up()) {
        let _ = stream.shutdown(Shutdown::Both);
        return Err(hs("a peer is plugged in already"));
    }
    plug(&station, stream, peer, theirs, false)
}

/// A listener's own lock (its holders never panic while holding it; a poisoned one is taken as it is).
fn held<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn handshake_reason(e: &WireError) -> &'static str {
    match e {
        WireError::Handshake { why, .. } => why,
        WireError::SameAddress { .. } => "the peer has this device's own port address",
        _ => "the link could not be set up",
    }
}

/// Connects to the device listening at `addr` and plugs the link in. A refused (or failed) connection is tried
/// again with backoff until `timeout` has passed, so this side may start before the listener; then the error
/// says how long and how often it tried.
pub(crate) fn connect<S: Station>(station: &Arc<S>, addr: &str, timeout: Duration) -> Result<(), WireError> {
    let addrs: Vec<SocketAddr> =
        addr.to_socket_addrs().map_err(|source| WireError::Connect { addr: addr.to_string(), source })?.collect();
    if addrs.is_empty() {
        let source = io::Error::new(io::ErrorKind::NotFound, "the name resolved to no address");
        return Err(WireError::Connect { addr: addr.to_string(), source });
    }
    let start = Instant::now();
    let end = start + timeout;
    let (mut attempts, mut pause) = (0u32, CONNECT_BACKOFF);
    loop {
        let mut last = None;
        for a in &addrs {
            attempts = attempts.saturating_add(1);
            let left =
                end.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(1), CONNECT_ATTEMPT_MAX);
            match TcpStream::connect_timeout(a, left) {
                // Retrying towards a free local port can pick that very port as the source and connect to itself
                // (TCP's simultaneous open): no listener answered, and holding the socket would keep the port
                // from the listener about to bind it.
                Ok(stream) if connected_to_itself(&stream) => {
                    drop(stream);
                    last = Some(io::Error::new(io::ErrorKind::ConnectionRefused, "connected to itself"));
                }
                // A listener that closes the connection before its hello, or before ours went out, is going away (a program's previous
                // server process exiting while the next one starts): tried again like a refused connection.
                Ok(stream) => match say_hello(station, stream, *a) {
                    Err(WireError::Handshake { why: why @ (NO_HELLO | HELLO_UNSENT), .. }) if Instant::now() < end => {
                        last = Some(io::Error::new(io::ErrorKind::ConnectionAborted, why));
                    }
                    r => return r,
                },
                Err(e) => last = Some(e),
            }
        }
        let now = Instant::now();
        if now >= end {
            let source = last.unwrap_or_else(|| io::ErrorKind::TimedOut.into());
            return Err(WireError::NoListener { addr: addr.to_string(), waited: now - start, attempts, source });
        }
        std::thread::sleep(pause.min(end - now));
        pause = (pause * 2).min(CONNECT_BACKOFF_MAX);
    }
}

/// Whether the stream's two ends are one address: a connection a retry made to itself.
fn connected_to_itself(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(l), Ok(p)) if l == p)
}

/// The connecting side of a handshake: our hello first, then the listener's, then the link plugged in.
fn say_hello<S: Station>(station: &Arc<S>, stream: TcpStream, peer: SocketAddr) -> Result<(), WireError> {
    let hs = |why: &'static str| WireError::Handshake { peer: peer.to_string(), why };
    let mut r = hello_stream(&stream, HANDSHAKE_TIMEOUT).map_err(|_| hs("socket setup failed"))?;
    let mine = my_hello(&**station);
    write_frame(&mut r, &mine.frame()).map_err(|_| hs(HELLO_UNSENT))?;
    let theirs = hear_hello(&mut r).map_err(hs)?;
    plug(station, stream, peer, theirs, true)
}

/// The socket's stream, reads timing out after `timeout` (for the hello).
fn hello_stream(stream: &TcpStream, timeout: Duration) -> io::Result<TcpStream> {
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(timeout))?;
    stream.try_clone()
}

/// The far end's hello: the first frame, which must be one. A frame longer than a hello is refused before it is
/// read.
fn hear_hello(r: &mut TcpStream) -> Result<Hello, &'static str> {
    let mut buf = [0u8; HELLO_LEN];
    match read_frame(r, &mut buf) {
        Ok(Some(n)) => match Hello::parse(&buf[..n]) {
            Some(Ok(h)) => Ok(h),
            _ => Err(NOT_OURS),
        },
        Err(e) if e.kind() == io::ErrorKind::InvalidData => Err(NOT_OURS),
        Ok(None) | Err(_) => Err(NO_HELLO),
    }
}

/// This port's hello.
fn my_hello(station: &impl Station) -> Hello {
    wire(station, |w| Hello { ib: w.addr.ib, lid: w.addr.lid, gid: w.addr.gid, mac: w.addr.mac })
}

/// Why a handshake failed when the peer closed (or said nothing) before its hello.
const NO_HELLO: &str = "no hello from the peer";
/// Why a handshake failed when the far end reset the connection before our hello went out (a listener that
/// accepted and closed, as one going away does).
const HELLO_UNSENT: &str = "could not send the hello";
/// Why a handshake failed when the first frame was not a hello.
const NOT_OURS: &str = "the peer is not a simulated mlx5 wire";

/// Plugs the stream into the device as its fabric link once hellos are swapped (the listener answers only a
/// valid hello, after reading it).
fn plug<S: Station>(
    station: &Arc<S>,
    mut stream: TcpStream,
    peer: SocketAddr,
    theirs: Hello,
    we_connect: bool,
) -> Result<(), WireError> {
    let hs = |why: &'static str| WireError::Handshake { peer: peer.to_string(), why };
    let mine = my_hello(&**station);
    if !we_connect {
        write_frame(&mut stream, &mine.frame()).map_err(|_| hs(HELLO_UNSENT))?;
    }
    if theirs.same_port(&mine) {
        let _ = stream.shutdown(Shutdown::Both);
        return Err(WireError::SameAddress { peer: peer.to_string() });
    }
    let conn = StreamConn::new(Sock::Tcp(stream)).map_err(|_| hs("socket setup failed"))?;
    let cable = Cable { peer: Some(peer), ..Cable::default() };
    let link = plug_with(station, Box::new(conn), &format!("tcp:{peer}"), None, Some(cable))
        .map_err(|_| hs("could not start the link threads"))?;
    // The far end learns this port's IPv4 address's MAC now, not by losing its first packet to an ARP request.
    link.announce();
    log(&**station, SimEvent::LinkUp { peer });
    Ok(())
}

/// Unplugs the link to another process, if one is plugged in (this device's driver went away): what was queued
/// goes out first, then the far end sees the connection close. The port's link is then down. Returns whether a
/// link was plugged in.
pub(crate) fn unplug(station: &impl Station) -> bool {
    let Some(link) = wire(station, |w| w.remote_link()) else { return false };
    link.drain(DRAIN_TIMEOUT);
    let was_up = link.is_up();
    link.close();
    station.with_wire(|wire, events| {
        wire.unplug_remote(link.id);
        if !was_up {
            return ((), None);
        }
        if let Some(peer) = link.cable.as_ref().and_then(|c| c.peer) {
            events.push(SimEvent::LinkDown { peer, why: "unplugged by this side" });
        }
        ((), Some(false))
    });
    true
}

/// Waits until a link is up (true) or `timeout` passes (false).
pub(crate) fn wait_peer(station: &impl Station, timeout: Duration) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if wire(station, |w| w.remote_link()).is_some_and(|l| l.is_up()) {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::config::SimConfig;
    use crate::link::port::PortAddr;
    use crate::link::stream::MAX_STREAM_FRAME;
    use crate::testkit::submit::{Bell, QpSpec, RcParams, Rdma, TAv, Wqe};
    use crate::wire::roce::frame::{parse, Parsed};
    use crate::wire::roce::ib::Opcode;
    use mlx5_core::prm::consts;
    use std::io::{Read, Write};

    /// The next frame on a fake far end's stream.
    fn next_frame(s: &mut TcpStream) -> Vec<u8> {
        let mut buf = vec![0u8; MAX_STREAM_FRAME];
        let n = read_frame(s, &mut buf).unwrap().expect("a frame");
        buf.truncate(n);
        buf
    }

    /// The listener's first frames on a fake far end's stream: its hello, then the gratuitous ARP that announces its
    /// IPv4 address (checked).
    fn hello_and_announcement(s: &mut TcpStream, mine: &SimConfig) -> Option<Result<Hello, &'static str>> {
        let heard = Hello::parse(&next_frame(s));
        let f = next_frame(s);
        let Ok(Parsed::Arp(eth, arp)) = parse(&f) else { panic!("not the announcement: {:?}", parse(&f)) };
        let ip = mine.ipv4_addrs[0];
        assert_eq!(
            (eth.dst, arp.operation, arp.sender_mac, arp.sender_ip, arp.target_ip),
            ([0xff; 6], crate::wire::roce::arp::Operation::Request, mine.mac, ip, ip)
        );
        heard
    }

    /// A fake far end's hello as the port of `c` would send it.
    fn hello_of(c: &SimConfig) -> Vec<u8> {
        let a = PortAddr::new(c);
        Hello { ib: a.ib, lid: a.lid, gid: a.gid, mac: a.mac }.frame()
    }

    const SEND: u8 = consts::MLX5_OPCODE_SEND;
    const WAIT: Duration = Duration::from_secs(5);

    fn cfg(n: u8) -> SimConfig {
        let mut mac = SimConfig::default().mac;
        mac[5] = n;
        SimConfig { mac, node_guid: 0x3000 + u64::from(n), mode: Mode::Threaded, ..SimConfig::default() }
    }

    /// Two devices, as two processes would have them: B plugged into A's listening port.
    fn linked() -> (Rdma, Rdma) {
        let (a, b) = (Rdma::new(cfg(1)), Rdma::new(cfg(2)));
        let at = a.h.dev.wire_listen("127.0.0.1:0").expect("listen");
        b.h.dev.wire_connect(&at.to_string(), WAIT).expect("connect");
        assert!(a.h.dev.wire_wait_peer(WAIT), "A sees B plugged in");
        assert_eq!(b.h.dev.wire_peer(), Some(at));
        (a, b)
    }

    fn events_until(r: &Rdma, f: impl Fn(&SimEvent) -> bool) -> bool {
        let end = Instant::now() + WAIT;
        while Instant::now() < end {
            if r.h.dev.events().iter().any(&f) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[test]
    fn rc_and_ud_cross_a_link_between_two_devices() {
        let (mut a, mut b) = linked();
        let (mut a_cq, mut b_cq) = (a.cq(5), b.cq(5));
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        // What crosses is the point here, not the timer: a 1 s ACK timeout (8 s in all) rides out a loaded machine
        // under emulation, where the default 67 ms ran out of retries (the aarch64 job in a fresh CI run).
        let patient = RcParams { ack_timeout: 18, ..RcParams::default() };
        a.connect_rc(&qa, &rb, patient);
        b.connect_rc(&qb, &ra, patient);
        let (ma, mb) = (a.mr(1 << 20), b.mr(1 << 20));
        // A message larger than a socket buffer, and a READ and an atomic back.
        let big: Vec<u8> = (0..300_000u32).map(|i| (i * 13 + 1) as u8).collect();
        ma.write(0, &big);
        b.post_recv(&mut qb, &[(mb.addr(), 400_000, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).data(300_000, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.wait_cqe(&mut b_cq).expect("receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, 300_000));
        assert!(mb.read(0, 300_000) == big, "the payload crossed intact");
        mb.write(500_000, b"read me back");
        mb.write(600_000, &41u64.to_be_bytes());
        let rd = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(mb.addr() + 500_000, mb.key).data(
            12,
            ma.key,
            ma.addr() + 700_000,
        );
        a.post_send(&mut qa, &rd, Bell::Db);
        let fa = Wqe::new(consts::MLX5_OPCODE_ATOMIC_FA).raddr(mb.addr() + 600_000, mb.key).atomic(1, 0).data(
            8,
            ma.key,
            ma.addr() + 800_000,
        );
        a.post_send(&mut qa, &fa, Bell::Db);
        for _ in 0..2 {
            assert_eq!(a.wait_cqe(&mut a_cq).expect("CQE").status(), (consts::MLX5_CQE_REQ, 0));
        }
        assert_eq!(ma.read(700_000, 12), b"read me back");
        assert_eq!(
            (ma.read(800_000, 8), mb.read(600_000, 8)),
            (41u64.to_be_bytes().to_vec(), 42u64.to_be_bytes().to_vec())
        );
        // UD from B to A by GID and MAC.
        let (mut ua, mut ub) = (a.qp(QpSpec::ud(), a_cq.cqn, a_cq.cqn), b.qp(QpSpec::ud(), b_cq.cqn, b_cq.cqn));
        a.ready_ud(&ua, 0x11);
        b.ready_ud(&ub, 0x11);
        a.post_recv(&mut ua, &[(ma.addr() + 900_000, 256, ma.key)]);
        mb.write(900_000, b"datagram");
        let dst = a.me(ua.qpn);
        let av =
            TAv { dqpn: ua.qpn, qkey: 0x11, grh: true, hop_limit: 1, rgid: dst.gid, rmac: dst.mac, ..TAv::default() };
        b.post_send(&mut ub, &Wqe::new(SEND).av(&av).data(8, mb.key, mb.addr() + 900_000), Bell::Db);
        assert_eq!(b.wait_cqe(&mut b_cq).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = a.wait_cqe(&mut a_cq).expect("UD receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt(), e.flags_rqpn() & 0xff_ffff), (consts::MLX5_CQE_RESP_SEND, 48, ub.qpn));
        assert_eq!(ma.read(900_000 + 40, 8), b"datagram");
    }

    #[test]
    fn a_peer_that_goes_away_is_unplugged_and_requests_to_it_fail() {
        let (mut a, b) = linked();
        let mut a_cq = a.cq(4);
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let rb = b.me(0x99);
        a.connect_rc(&qa, &rb, RcParams { retry_count: 1, ack_timeout: 1, ..RcParams::default() });
        let peer = a.h.dev.wire_peer().expect("plugged in");
        drop(b);
        assert!(events_until(&a, |e| matches!(
            e,
            SimEvent::LinkDown { why: "the far end closed the stream (or broke its framing)", .. }
        )));
        assert_eq!(a.h.dev.wire_peer(), None);
        assert!(!crate::device::lock(&a.h.dev.shared).fw.port.up, "the port's link went down with the cable");
        let ma = a.mr(64);
        a.post_send(&mut qa, &Wqe::new(SEND).data(8, ma.key, ma.addr()), Bell::Db);
        let e = a.wait_cqe(&mut a_cq).expect("error CQE");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
        assert!(a.h.dev.events().contains(&SimEvent::LinkUp { peer }));
    }

    /// A fake far end: it plugs in with a real hello and then reads frames without ever answering.
    #[test]
    fn a_request_nobody_answers_times_out_and_is_retransmitted_at_the_same_psn() {
        let mut a = Rdma::new(cfg(1));
        let at = a.h.dev.wire_listen("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(at).unwrap();
        let far = PortAddr::new(&cfg(7));
        write_frame(&mut s, &hello_of(&cfg(7))).unwrap();
        let mine = PortAddr::new(&a.h.dev.config());
        let heard = hello_and_announcement(&mut s, &a.h.dev.config());
        assert_eq!(heard, Some(Ok(Hello { ib: false, lid: 0, gid: mine.gid, mac: mine.mac })));
        assert!(a.h.dev.wire_wait_peer(WAIT));
        let mut a_cq = a.cq(4);
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let rb = crate::testkit::submit::Remote { qpn: 0x77, lid: 0, gid: far.gid, mac: far.mac };
        a.connect_rc(&qa, &rb, RcParams { retry_count: 2, ack_timeout: 8, ..RcParams::default() });
        let ma = a.mr(64);
        ma.write(0, b"hello?");
        a.post_send(&mut qa, &Wqe::new(SEND).data(6, ma.key, ma.addr()), Bell::Db);
        let e = a.wait_cqe(&mut a_cq).expect("error CQE");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
        // Three attempts reached the far end as RoCEv2 frames: one SEND ONLY each, at one PSN, the same bytes.
        for _ in 0..3 {
            let f = next_frame(&mut s);
            let Ok(Parsed::Roce(p)) = parse(&f) else { panic!("not a RoCE frame: {:?}", parse(&f)) };
            assert_eq!((p.eth.src, p.eth.dst), (a.h.dev.config().mac, far.mac));
            assert_eq!(
                (p.bth.opcode, p.bth.dest_qpn, p.bth.psn, p.bth.ack_req, p.payload),
                (Opcode::RcSendOnly, 0x77, 0x100, true, &b"hello?"[..])
            );
        }
        let timeouts =
            a.h.dev
                .events()
                .iter()
                .filter(|e| matches!(e, SimEvent::Unreachable { why: "no response before the ACK timeout", .. }))
                .count();
        assert_eq!(timeouts, 3);
        let _ = &mut qa;
    }

    #[test]
    fn a_peer_with_the_same_address_or_another_protocol_is_turned_away() {
        let a = Rdma::new(cfg(1));
        let at = a.h.dev.wire_listen("127.0.0.1:0").unwrap().to_string();
        let twin = Rdma::new(cfg(1));
        match twin.h.dev.wire_connect(&at, WAIT) {
            Err(e @ WireError::SameAddress { .. }) => assert!(e.to_string().contains("own port address"), "{e}"),
            other => panic!("{other:?}"),
        }
        // Something that is not a simulated device: its hello is refused, the listener stays up.
        let mut s = TcpStream::connect(&at).unwrap();
        write_frame(&mut s, b"\x01GET / HTTP/1.1").unwrap();
        assert!(events_until(&a, |e| matches!(
            e,
            SimEvent::LinkDown { why: "the peer is not a simulated mlx5 wire", .. }
        )));
        let b = Rdma::new(cfg(2));
        b.h.dev.wire_connect(&at, WAIT).expect("a real peer still plugs in");
        assert!(a.h.dev.wire_wait_peer(WAIT));
        // Nobody listening: a connection error that names the address.
        drop(a);
        let c = Rdma::new(cfg(3));
        let e = c.h.dev.wire_connect("127.0.0.1:1", Duration::from_millis(500)).unwrap_err();
        let WireError::NoListener { attempts, .. } = e else { panic!("{e:?}") };
        assert!(attempts > 1, "refused connections are retried: {e}");
        assert!(e.to_string().starts_with("no listener at 127.0.0.1:1 after 0.5 s ("), "{e}");
        assert!(e.to_string().contains(" attempts): "), "{e}");
    }

    /// One RC SEND from `b` to `a` across their link, its bytes checked.
    fn rc_send(a: &mut Rdma, b: &mut Rdma) {
        let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        a.connect_rc(&qa, &rb, RcParams::default());
        b.connect_rc(&qb, &ra, RcParams::default());
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        mb.write(0, b"across the wire");
        a.post_recv(&mut qa, &[(ma.addr(), 4096, ma.key)]);
        b.post_send(&mut qb, &Wqe::new(SEND).data(15, mb.key, mb.addr()), Bell::Db);
        assert_eq!(b.wait_cqe(&mut b_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = a.wait_cqe(&mut a_cq).expect("receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, 15));
        assert_eq!(ma.read(0, 15), b"across the wire");
    }

    /// Whether the far end closed `s` (EOF or reset); the read timeout only keeps a failing test from hanging.
    fn closed_by_far_end(s: &mut TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        match s.read(&mut [0u8; 1]) {
            Ok(0) => true,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    }

    fn link_downs(r: &Rdma, why: &str) -> usize {
        r.h.dev.events().iter().filter(|e| matches!(e, SimEvent::LinkDown { why: w, .. } if *w == why)).count()
    }

    /// Issue 29: handshakes ran on the accept thread, 5 s each, so three silent connections kept a real peer out
    /// ("it has a client already"). Now each has its own thread and the silent ones are dropped at their timeout.
    #[test]
    fn silent_connections_do_not_lock_a_real_peer_out_and_are_dropped() {
        let (mut a, mut b) = (Rdma::new(cfg(1)), Rdma::new(cfg(2)));
        let at = a.h.dev.wire_listen("127.0.0.1:0").unwrap();
        let mut silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(at).unwrap()).collect();
        b.h.dev.wire_connect(&at.to_string(), WAIT).expect("the real peer plugs in past the silent ones");
        assert!(a.h.dev.wire_wait_peer(WAIT));
        rc_send(&mut a, &mut b);
        for s in &mut silent {
            assert!(closed_by_far_end(s), "a silent connection is dropped");
        }
        let end = Instant::now() + WAIT;
        while link_downs(&a, "no hello from the peer") < 3 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(link_downs(&a, "no hello from the peer"), 3);
        assert!(a.h.dev.wire_peer().is_some(), "the real peer stays plugged in");
    }

    /// A flood of silent connections holds at most `MAX_PENDING` handshakes (threads): each one beyond closes
    /// the oldest. The handshake timeout here is ten minutes, so only that bound can close them.
    #[test]
    fn a_flood_of_silent_connections_is_bounded_and_a_real_peer_still_plugs_in() {
        let (mut a, mut b) = (Rdma::new(cfg(1)), Rdma::new(cfg(2)));
        let at = listen_with(&a.h.dev.shared, "127.0.0.1:0", Duration::from_secs(600)).unwrap();
        let mut flood: Vec<TcpStream> = (0..3 * MAX_PENDING).map(|_| TcpStream::connect(at).unwrap()).collect();
        for (i, s) in flood.iter_mut().enumerate().take(2 * MAX_PENDING) {
            assert!(closed_by_far_end(s), "connection {i} is closed to make room");
        }
        b.h.dev.wire_connect(&at.to_string(), WAIT).expect("the real peer plugs in");
        assert!(a.h.dev.wire_wait_peer(WAIT));
        rc_send(&mut a, &mut b);
        // The real peer took the oldest remaining one's place.
        assert!(closed_by_far_end(&mut flood[2 * MAX_PENDING]));
    }

    /// Issue 29: `wire=connect` failed at once when its listener was not up yet; it now retries until its
    /// timeout, so two programs may start in either order.
    #[test]
    fn a_connector_started_before_its_listener_plugs_in_once_it_listens() {
        // A port free now, which the listener binds later.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (mut a, mut b) = (Rdma::new(cfg(1)), Rdma::new(cfg(2)));
        let dev = b.h.dev.clone();
        let connecting = std::thread::spawn(move || dev.wire_connect(&format!("127.0.0.1:{port}"), WAIT * 6));
        // Only orders the two starts (the connector is refused first); nothing here depends on how long it is.
        std::thread::sleep(Duration::from_millis(300));
        a.h.dev.wire_listen(&format!("127.0.0.1:{port}")).unwrap();
        connecting.join().unwrap().expect("the connector plugs in once the listener is up");
        assert!(a.h.dev.wire_wait_peer(WAIT));
        rc_send(&mut a, &mut b);
    }

    /// Issue 29: qperf's server runs each test in a new process, listening on the same port; the client's next
    /// open could reach the previous one as it exited, which closed the connection before its hello, and the open
    /// failed. A listener that goes away during the handshake is now tried again until the timeout.
    #[test]
    fn a_listener_that_closes_before_its_hello_is_tried_again() {
        let exiting = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = exiting.local_addr().unwrap();
        let (mut a, mut b) = (Rdma::new(cfg(1)), Rdma::new(cfg(2)));
        let dev = a.h.dev.clone();
        let next = std::thread::spawn(move || {
            // The exiting server: takes the connection and closes it, then its port is free for the next one.
            let (s, _) = exiting.accept().unwrap();
            drop(s);
            drop(exiting);
            dev.wire_listen(&at.to_string()).unwrap();
        });
        b.h.dev.wire_connect(&at.to_string(), WAIT * 6).expect("plugs into the next listener");
        next.join().unwrap();
        assert!(a.h.dev.wire_wait_peer(WAIT));
        rc_send(&mut a, &mut b);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_connection_to_itself_is_told_apart_from_a_listener() {
        use std::os::fd::FromRawFd;
        // The socket a retry can end up with: bound to the port it then connects to (simultaneous open).
        // SAFETY: a fresh socket; every pointer is to a local of the right size; on success the descriptor is
        // handed to one TcpStream, which owns and closes it.
        let stream = unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            assert_eq!(libc::bind(fd, (&raw const sa).cast(), len), 0);
            let mut got = len;
            assert_eq!(libc::getsockname(fd, (&raw mut sa).cast(), &mut got), 0);
            assert_eq!(libc::connect(fd, (&raw const sa).cast(), len), 0, "{}", io::Error::last_os_error());
            TcpStream::from_raw_fd(fd)
        };
        assert!(connected_to_itself(&stream));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert!(!connected_to_itself(&other));
    }

    /// Each end announces its IPv4 address as it plugs in (a gratuitous ARP), so a packet to the other's IPv4
    /// GID goes out at once instead of being lost to an ARP request.
    #[test]
    fn each_end_learns_the_others_ipv4_address_as_the_stream_plugs_in() {
        let a = Rdma::new(SimConfig { ipv4_addrs: &[[10, 77, 0, 1]], ..cfg(1) });
        let b = Rdma::new(SimConfig { ipv4_addrs: &[[10, 77, 0, 2]], ..cfg(2) });
        let at = a.h.dev.wire_listen("127.0.0.1:0").unwrap();
        b.h.dev.wire_connect(&at.to_string(), WAIT).unwrap();
        assert!(a.h.dev.wire_wait_peer(WAIT));
        let end = Instant::now() + WAIT;
        let learned = |r: &Rdma, ip: [u8; 4]| {
            let l = r.h.dev.vde_link_for_test();
            crate::link::vde::resolve(ip, Duration::ZERO).is_some() && l.counters().arp_requests == 0
        };
        while !(learned(&a, [10, 77, 0, 2]) && learned(&b, [10, 77, 0, 1])) {
            assert!(Instant::now() < end, "both ends learned the other's address without asking");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(crate::link::vde::resolve([10, 77, 0, 2], Duration::ZERO), Some(b.h.dev.config().mac));
        assert_eq!(crate::link::vde::resolve([10, 77, 0, 1], Duration::ZERO), Some(a.h.dev.config().mac));
        assert_eq!(a.h.dev.frame_drops().total() + b.h.dev.frame_drops().total(), 0);
    }

    /// Garbage in a well-framed frame is dropped and counted; a length that is not the framing's ends the link
    /// before anything is allocated, as does a peer that stops in the middle of a frame.
    #[test]
    fn garbage_is_counted_and_a_broken_framing_takes_the_link_down() {
        let a = Rdma::new(cfg(1));
        let at = a.h.dev.wire_listen("127.0.0.1:0").unwrap();
        let mut s = TcpStream::connect(at).unwrap();
        write_frame(&mut s, &hello_of(&cfg(9))).unwrap();
        let _ = hello_and_announcement(&mut s, &a.h.dev.config());
        assert!(a.h.dev.wire_wait_peer(WAIT));
        // To the port's MAC, an ethertype nobody speaks; a jumbo frame longer than the fabric carries; a runt.
        let mut f = PortAddr::new(&cfg(1)).mac.to_vec();
        f.extend_from_slice(&[2, 0, 0, 0, 0, 9, 0x12, 0x34]);
        f.extend_from_slice(&[0xab; 50]);
        write_frame(&mut s, &f).unwrap();
        let mut jumbo = f.clone();
        jumbo.resize(9000, 0xcd);
        write_frame(&mut s, &jumbo).unwrap();
        write_frame(&mut s, &[1, 2, 3]).unwrap();
        let end = Instant::now() + WAIT;
        let counted = || {
            let c = a.h.dev.vde_counters().unwrap_or_default();
            (c.rx_oversize, a.h.dev.frame_drops().total())
        };
        while counted() != (1, 2) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(counted(), (1, 2), "the jumbo frame counted by the link, the other two by the port");
        assert!(a.h.dev.wire_peer().is_some(), "the link stays up");
        // A length beyond the framing's limit.
        s.write_all(&(MAX_STREAM_FRAME as u32 + 1).to_be_bytes()).unwrap();
        let broken = |e: &SimEvent| {
            matches!(e, SimEvent::LinkDown { why: "the far end closed the stream (or broke its framing)", .. })
        };
        assert!(events_until(&a, broken));
        assert_eq!(a.h.dev.wire_peer(), None);
        assert!(closed_by_far_end(&mut s));
    }
}

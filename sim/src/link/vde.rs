//! The link to a Virtual Distributed Ethernet fabric (VDE): the port plugs into whatever a libvdeplug URL names
//! (`vde:///path` for a `vde_switch` on a UNIX socket; `vxvde://239.1.2.3` for a switchless fabric across a LAN;
//! `udp://`, `tap://`, ...) and exchanges bare Ethernet frames with every other port on it, in any number and
//! started in any order. An Ethernet port's packets cross as the RoCEv2 frames `wire::roce_map` makes; what arrives
//! goes through the port's receive side (`transport/roce_rx.rs`: ARP answered, RoCE reassembled and checked,
//! anything else dropped and counted). An InfiniBand port's cross as frames of their own EtherType, addressed by
//! LID (`vde_ib.rs`); each kind of port drops the other's frames before they reach it (counted).
//!
//! libvdeplug (`libvdeplug.so.2`, Debian's `libvdeplug2`) is opened at run time with `dlopen`, so the crate builds
//! and runs without it; plugging in then fails with [`VdeError::Library`].
//!
//! Addressing: the destination MAC of a frame is that of its destination GID: a link-local GID carries it (modified
//! EUI-64); an IPv4-mapped GID is resolved by ARP over the fabric. Until a neighbour answers, a packet to it is lost
//! (the ARP request goes instead), as on a NIC whose neighbour entry is not resolved yet; the requester's timer
//! sends it again. The neighbours learned from every ARP frame seen are kept, at most [`MAX_NEIGHBOURS`].
//!
//! A `vde_switch` carries frames of at most [`MAX_ETH_FRAME`] bytes (it truncates longer ones): a frame longer than
//! that is not sent (counted), so a path MTU above 1024 does not cross the fabric. Frames received longer than that
//! (another kind of fabric) are dropped and counted. The writer's queue holds at most [`TX_QUEUE`] frames; beyond
//! that a frame is dropped and counted (an ARP flood cannot grow memory). When the fabric goes away (the switch
//! ends) the port's link goes down (a PORT_CHANGE) and its packets are lost, so requesters end in retry errors.
//!
//! The direct path: on a `vde_switch` (a `vde://` URL naming its directory) each port also binds a UNIX datagram
//! socket of its own in the switch's directory, named by its MAC ([`Direct`]). A unicast frame to a MAC whose
//! socket is there goes straight to that port instead of through the switch: one hop and no third process to
//! schedule per frame, frames queued for one port packed into one datagram (each still checked on its own at the
//! receiver), sent by the thread that made them when the writer has nothing queued (no hand-off to the writer:
//! a ping-pong's frame wakes one thread, the receiver's, not two), and a receiver that falls behind makes the sender wait (a bounded time) instead of the switch
//! dropping the frame. Broadcasts (ARP) and frames to anything else (a QEMU guest, a port across
//! `wirefilter`, which is another switch) still cross the switch, which stays the meeting point. A capture on
//! the switch (`vde_pcapplug`) sees only those: set `MLX5_SIM_VDE_DIRECT=0` to send everything through it.

use std::ffi::{c_char, c_int, c_void, CString};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::direct::{dst_mac, unpack_frames, Direct, DirectSend, DirectTx};
use super::port::{log, next_device_id, wire, Cable, Datagrams, DevRef, Packet, Port, Station, TxCount, VdeLink};
use super::stream::Hello;
use crate::events::SimEvent;
use crate::wire::roce::arp::{ArpRepr, Operation};
use crate::wire::roce::ether::{EtherType, EthernetRepr, BROADCAST};
use crate::wire::roce::frame::{emit_arp, parse, Parsed};
use crate::wire::roce_map;
use crate::wire::PERMISSIVE_LID;

pub(crate) use super::vde_ib::IbSide;
use super::vde_ib::Kind;
pub use super::vde_ib::{lid_mac, ETHERTYPE_IB};
#[cfg(test)]
use super::vde_ib::{IB_FRAGMENT, MAX_PARTIAL};

pub use super::datagrams::MAX_ETH_FRAME;

/// Frames waiting for the writer at most (so at most 24 MiB); more are dropped and counted. Room for several
/// InfiniBand messages of 1 MiB (717 frames each) at once: with 4,096, UCP's `tag_bw` of 1 MiB over IB, whose
/// rendezvous has several 1 MiB READ responses in flight, lost hundreds to thousands of frames a run, each loss
/// a whole message that only the requester's ACK timer (UCX: 1 s) recovered (7.6-15 MB/s against 91-100 without
/// a drop, debug build).
pub const TX_QUEUE: usize = 16384;

/// IPv4 neighbours remembered at most (the oldest goes first).
pub const MAX_NEIGHBOURS: usize = 256;

/// How long the reader waits in `poll` before it looks whether the link was unplugged.
const POLL_MS: c_int = 50;

/// How long plugging into the default switch waits for a switch this process started to listen.
const SWITCH_START: Duration = Duration::from_secs(5);

/// The name of the switch program (Debian's `vde2`).
const VDE_SWITCH: &str = "vde_switch";

/// Frames the reader hands to the port before it runs the port's datapath once (what is queued is taken first).
const RX_BATCH: usize = 32;

/// Why a port could not be plugged into a VDE fabric.
#[derive(Debug)]
pub enum VdeError {
    /// libvdeplug could not be loaded (install Debian's `libvdeplug2`).
    Library { why: String },
    /// The URL holds a NUL byte.
    BadUrl { url: String },
    /// libvdeplug could not open the URL (no switch at that path, a URL it does not know, ...).
    Open { url: String, source: io::Error },
    /// The default switch could not be started (install Debian's `vde2`).
    Switch { path: PathBuf, source: io::Error },
    /// An InfiniBand port's LID is not a unicast LID (0x0001-0xBFFF).
    BadLid { lid: u16 },
    /// Another port on the fabric answered for this port's LID when it plugged in: two ports with one LID would
    /// take each other's packets.
    LidInUse { lid: u16, guid: u64 },
    /// The link's threads could not be started.
    Threads { source: io::Error },
}

impl std::fmt::Display for VdeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VdeError::Library { why } => write!(f, "cannot load libvdeplug.so.2 (Debian: libvdeplug2): {why}"),
            VdeError::BadUrl { url } => write!(f, "VDE URL {url:?} holds a NUL byte"),
            VdeError::Open { url, source } => write!(f, "cannot plug into the VDE fabric {url}: {source}"),
            VdeError::Switch { path, source } => {
                write!(f, "cannot start {VDE_SWITCH} on {} (Debian: vde2): {source}", path.display())
            }
            VdeError::BadLid { lid } => write!(f, "LID {lid:#x} is not a unicast LID (0x1-0xbfff)"),
            VdeError::LidInUse { lid, guid } => write!(
                f,
                "LID {lid:#x} is taken on the VDE fabric by the port with GUID {guid:016x} (the LID comes from the \
                 process's identity: start the process again, or give the device host=N)"
            ),
            VdeError::Threads { source } => write!(f, "cannot start the VDE link's threads: {source}"),
        }
    }
}

impl std::error::Error for VdeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VdeError::Open { source, .. } | VdeError::Switch { source, .. } | VdeError::Threads { source } => {
                Some(source)
            }
            _ => None,
        }
    }
}

/// What a VDE link counted (besides what the port's receive side counts in its drop counters).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VdeCounters {
    /// Frames put on the fabric.
    pub tx_frames: u64,
    /// Frames taken from the fabric and handed to the port.
    pub rx_frames: u64,
    /// Unicast frames for another MAC (a switch floods frames to a MAC it has not learned).
    pub rx_not_mine: u64,
    /// Frames received longer than [`MAX_ETH_FRAME`].
    pub rx_oversize: u64,
    /// Frames not sent: longer than [`MAX_ETH_FRAME`].
    pub tx_oversize: u64,
    /// Frames not sent: the writer's queue was full.
    pub tx_queue_full: u64,
    /// ARP requests sent to resolve a destination.
    pub arp_requests: u64,
    /// Of `tx_frames`, those sent on the direct path (past the switch, to a port of this machine).
    pub tx_direct: u64,
    /// Of `tx_direct`, those the sending thread put on the peer's socket itself (the writer had nothing
    /// queued), with no hand-off to the writer thread.
    pub tx_direct_now: u64,
    /// Frames received on the direct path (before the checks `rx_frames` counts).
    pub rx_direct: u64,
    /// Frames not sent: a peer's direct socket did not take them within 50 ms.
    pub tx_direct_timeout: u64,
    /// Datagrams on the direct socket whose frames did not add up (the rest of such a datagram is dropped).
    pub rx_direct_malformed: u64,
    /// Frames of the other link layer, dropped: IB frames ([`ETHERTYPE_IB`]) at an Ethernet port, anything else
    /// at an InfiniBand port.
    pub rx_other_link_layer: u64,
    /// IB frames that failed a check (LRH, header, fragment geometry, packet encoding), dropped.
    pub rx_ib_malformed: u64,
    /// IB frames from another port with this port's LID (a probe, its answer, or data), dropped.
    pub lid_conflicts: u64,
    /// IB messages of which some fragment never arrived (given up when newer ones needed the room).
    pub rx_ib_incomplete: u64,
}

/// `vde_open_real(char *url, char *descr, int interface_version, struct vde_open_args *)`.
type OpenFn = unsafe extern "C" fn(*const c_char, *const c_char, c_int, *mut c_void) -> *mut c_void;
/// `vde_recv(VDECONN *, void *, size_t, int)`.
type RecvFn = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> isize;
/// `vde_send(VDECONN *, const void *, size_t, int)`.
type SendFn = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> isize;
/// `vde_datafd`, `vde_ctlfd`, `vde_close(VDECONN *)`.
type ConnFn = unsafe extern "C" fn(*mut c_void) -> c_int;

/// libvdeplug's entry points (`libvdeplug.h`, interface version 1).
struct Lib {
    open: OpenFn,
    recv: RecvFn,
    send: SendFn,
    datafd: ConnFn,
    ctlfd: ConnFn,
    close: ConnFn,
}

/// `LIBVDEPLUG_INTERFACE_VERSION`, which `vde_open` passes to `vde_open_real`.
const INTERFACE_VERSION: c_int = 1;

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

fn lib() -> Result<&'static Lib, VdeError> {
    LIB.get_or_init(load).as_ref().map_err(|why| VdeError::Library { why: why.clone() })
}

fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on this thread.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return "unknown error".into();
    }
    // SAFETY: non-NULL, NUL-terminated (above); copied out at once.
    unsafe { std::ffi::CStr::from_ptr(e) }.to_string_lossy().into_owned()
}

fn load() -> Result<Lib, String> {
    // SAFETY: a constant NUL-terminated name; the handle is kept for the life of the process (never dlclosed),
    // so the symbols stay valid.
    let h = unsafe { libc::dlopen(c"libvdeplug.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(dlerror());
    }
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(h, name.as_ptr()) };
        if p.is_null() {
            Err(format!("{}: {}", name.to_string_lossy(), dlerror()))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol is the libvdeplug function of that name, whose C prototype (libvdeplug.h) is the
    // function pointer type it is turned into: vde_open_real(char *, char *, int, struct vde_open_args *),
    // vde_recv / vde_send(VDECONN *, void *, size_t, int) -> ssize_t, vde_datafd / vde_ctlfd / vde_close(VDECONN *)
    // -> int.
    unsafe {
        Ok(Lib {
            open: std::mem::transmute::<*mut c_void, OpenFn>(sym(c"vde_open_real")?),
            recv: std::mem::transmute::<*mut c_void, RecvFn>(sym(c"vde_recv")?),
            send: std::mem::transmute::<*mut c_void, SendFn>(sym(c"vde_send")?),
            datafd: std::mem::transmute::<*mut c_void, ConnFn>(sym(c"vde_datafd")?),
            ctlfd: std::mem::transmute::<*mut c_void, ConnFn>(sym(c"vde_ctlfd")?),
            close: std::mem::transmute::<*mut c_void, ConnFn>(sym(c"vde_close")?),
        })
    }
}

/// One open libvdeplug connection; closed when dropped (after both link threads let go of it).
#[derive(Debug)]
pub(crate) struct Conn {
    ptr: NonNull<c_void>,
}

// SAFETY: the connection is used by two threads at once only as vde_send (writer) and vde_recv (reader), which
// libvdeplug's modules implement as a send and a recv on the connection's own sockets; it is closed only in
// Drop, when no thread holds it any more.
unsafe impl Send for Conn {}
// SAFETY: as above.
unsafe impl Sync for Conn {}

impl Conn {
    pub(crate) fn open(url: &str) -> Result<Conn, VdeError> {
        let lib = lib()?;
        let c_url = CString::new(url).map_err(|_| VdeError::BadUrl { url: url.into() })?;
        // SAFETY: valid NUL-terminated strings, NULL open arguments (libvdeplug's defaults).
        let p = unsafe { (lib.open)(c_url.as_ptr(), c"mlx5-sim".as_ptr(), INTERFACE_VERSION, std::ptr::null_mut()) };
        let err = io::Error::last_os_error();
        NonNull::new(p).map(|ptr| Conn { ptr }).ok_or(VdeError::Open { url: url.into(), source: err })
    }

    fn lib() -> &'static Lib {
        // A Conn exists only once the library loaded.
        match LIB.get() {
            Some(Ok(l)) => l,
            _ => unreachable!("a VDE connection without libvdeplug"),
        }
    }
}

impl Datagrams for Conn {
    fn send(&self, frame: &[u8]) -> isize {
        // SAFETY: a live connection and a valid buffer of `frame.len()` bytes.
        unsafe { (Self::lib().send)(self.ptr.as_ptr(), frame.as_ptr().cast(), frame.len(), 0) }
    }

    fn recv(&self, buf: &mut [u8]) -> isize {
        // SAFETY: a live connection and a writable buffer of `buf.len()` bytes.
        unsafe { (Self::lib().recv)(self.ptr.as_ptr(), buf.as_mut_ptr().cast(), buf.len(), 0) }
    }

    fn fds(&self) -> (c_int, c_int) {
        // SAFETY: a live connection.
        unsafe { ((Self::lib().datafd)(self.ptr.as_ptr()), (Self::lib().ctlfd)(self.ptr.as_ptr())) }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: the connection is live and no thread uses it any more (it is dropped with its last holder).
        unsafe { (Self::lib().close)(self.ptr.as_ptr()) };
    }
}

/// The default fabric's switch directory: `$XDG_RUNTIME_DIR/mlx5-sim.vde`, else `/tmp/mlx5-sim-UID.vde`, so
/// every process of one user on one machine meets on it and no other user's.
pub fn default_switch_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| Path::new(d).is_dir()) {
        Some(d) => Path::new(&d).join("mlx5-sim.vde"),
        // SAFETY: getuid has no preconditions and cannot fail.
        None => std::env::temp_dir().join(format!("mlx5-sim-{}.vde", unsafe { libc::getuid() })),
    }
}

/// The `vde://` URL of a switch directory.
pub fn switch_url(dir: &Path) -> String {
    format!("vde://{}", dir.display())
}

/// Opens the switch at `dir`, starting one (`vde_switch -d`, which outlives this process) if none answers.
/// Processes that find no switch at once start it one at a time (an exclusive `flock` on `dir` with the extension
/// `lock`): two `vde_switch` started together on one directory, the second took the control socket the first had
/// bound but not yet listened on, and neither answered (`ucx_perftest`'s two ends, 1 run in 6).
pub(crate) fn open_or_start(dir: &Path) -> Result<Conn, VdeError> {
    let url = switch_url(dir);
    if let Ok(c) = Conn::open(&url) {
        return Ok(c);
    }
    lib()?;
    let err = |source| VdeError::Switch { path: dir.to_path_buf(), source };
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.with_extension("lock"))
        .map_err(err)?;
    // SAFETY: flock on a descriptor this function owns; the lock goes when `lock` is closed on return. The holder
    // keeps it at most until its switch answers or SWITCH_START passes.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    // Started by the process that held the lock before.
    if let Ok(c) = Conn::open(&url) {
        return Ok(c);
    }
    // A stale directory (a switch that died) is taken over: vde_switch refuses a control socket nobody answers
    // only if it is live.
    let status = std::process::Command::new(VDE_SWITCH)
        .arg("-s")
        .arg(dir)
        .arg("-d")
        .arg("-p")
        .arg(dir.with_extension("pid"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map_err(err)?;
    let end = Instant::now() + SWITCH_START;
    loop {
        match Conn::open(&url) {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() >= end => {
                return Err(match (status.success(), e) {
                    (true, e) => e,
                    (false, _) => err(io::Error::other(format!("{VDE_SWITCH} exited with {status}"))),
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The IPv4 address in an IPv4-mapped GID.
fn v4(gid: &[u8; 16]) -> Option<[u8; 4]> {
    (gid[..10] == [0; 10] && gid[10..12] == [0xff, 0xff]).then(|| [gid[12], gid[13], gid[14], gid[15]])
}

/// The MAC in a link-local GID (modified EUI-64).
fn link_local_mac(gid: &[u8; 16]) -> Option<[u8; 6]> {
    (gid[..8] == [0xfe, 0x80, 0, 0, 0, 0, 0, 0] && gid[11] == 0xff && gid[12] == 0xfe)
        .then(|| [gid[8] ^ 2, gid[9], gid[10], gid[13], gid[14], gid[15]])
}

pub(crate) use super::datagrams::ETH_HEADER;
const ETHERTYPE_ARP: [u8; 2] = [0x08, 0x06];

impl VdeLink {
    pub(crate) fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Unplugs: the threads end (within [`POLL_MS`]) and the connection closes (a stream's at once).
    pub(crate) fn close(&self) {
        self.up.store(false, Ordering::Release);
        self.conn.shut();
        if let Some(d) = &self.direct {
            d.unlink();
        }
    }

    /// Waits (at most `timeout`) until every frame queued is on the fabric.
    pub(crate) fn drain(&self, timeout: Duration) -> bool {
        self.count.drain(|| self.is_up(), timeout)
    }

    pub(crate) fn counters(&self) -> VdeCounters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Acquire);
        VdeCounters {
            tx_frames: get(&c[0]),
            rx_frames: get(&c[1]),
            rx_not_mine: get(&c[2]),
            rx_oversize: get(&c[3]),
            tx_oversize: get(&c[4]),
            tx_queue_full: get(&c[5]),
            arp_requests: get(&c[6]),
            tx_direct: get(&c[C_TX_DIRECT]),
            tx_direct_now: get(&c[C_TX_DIRECT_NOW]),
            rx_direct: get(&c[C_RX_DIRECT]),
            tx_direct_timeout: get(&c[C_DIRECT_TIMEOUT]),
            rx_direct_malformed: get(&c[C_RX_DIRECT_MALFORMED]),
            rx_other_link_layer: get(&c[C_RX_OTHER_LINK]),
            rx_ib_malformed: get(&c[C_RX_IB_MALFORMED]),
            lid_conflicts: get(&c[C_LID_CONFLICT]),
            rx_ib_incomplete: get(&c[C_RX_IB_INCOMPLETE]),
        }
    }

    /// An InfiniBand port's LID changed (a subnet manager assigned it).
    pub(crate) fn set_lid(&self, lid: u16) {
        if let Some(ib) = &self.ib {
            ib.set_lid(lid);
        }
    }

    fn bump(&self, which: usize) {
        self.counters[which].fetch_add(1, Ordering::AcqRel);
    }

    /// The MAC learned for `ip` by ARP.
    fn neighbour(&self, ip: [u8; 4]) -> Option<[u8; 6]> {
        let t = self.neighbours.lock().ok()?;
        t.iter().find(|(a, _)| *a == ip).map(|(_, m)| *m)
    }

    fn learn(&self, ip: [u8; 4], mac: [u8; 6]) {
        if mac[0] & 1 != 0 || ip == [0; 4] {
            return;
        }
        if let Ok(mut t) = self.neighbours.lock() {
            t.retain(|(a, _)| *a != ip);
            if t.len() >= MAX_NEIGHBOURS {
                t.remove(0);
            }
            t.push((ip, mac));
        }
    }

    /// Queues a frame for the writer (dropped and counted when too long for the fabric or the queue is full).
    fn queue(&self, frame: &[u8], record: bool) -> Result<(), &'static str> {
        self.check(frame, record)?;
        self.enqueue(frame.to_vec())
    }

    /// Refuses (and counts) a frame too long for the fabric; records one that goes out when `record`.
    fn check(&self, frame: &[u8], record: bool) -> Result<(), &'static str> {
        if frame.len() > MAX_ETH_FRAME {
            self.bump(C_TX_OVERSIZE);
            return Err("frame longer than the VDE fabric carries (path MTU above 1024)");
        }
        if record {
            if let Some(s) = &self.pcap {
                s.record(|_, out| out(frame));
            }
        }
        Ok(())
    }

    /// Hands a checked frame to the writer.
    fn enqueue(&self, frame: Vec<u8>) -> Result<(), &'static str> {
        self.count.queued();
        match self.tx.try_send(frame) {
            Ok(()) => Ok(()),
            Err(mpsc::TrySendError::Full(_)) => {
                // Never written: counted as written so a drain does not wait for it.
                self.count.taken();
                self.count.written(1);
                self.bump(C_TX_QUEUE_FULL);
                Err("VDE link queue full")
            }
            Err(mpsc::TrySendError::Disconnected(_)) => Err("link down"),
        }
    }

    /// Puts `p` on the fabric as RoCEv2 frames to its destination GID's MAC. Never blocks.
    pub(crate) fn transmit(&self, p: &Packet) -> Result<(), &'static str> {
        if !self.is_up() {
            return Err("link down");
        }
        if let Some(ib) = &self.ib {
            let Port::Vde(_, dlid) = p.dst.port else { return Err("unknown destination") };
            let frames = ib.frames(p, dlid, self.cable.is_some())?;
            if let Some(s) = &self.pcap {
                for f in &frames {
                    s.record(|_, out| out(f));
                }
            }
            return self.send_frames(frames);
        }
        // A frame an Ethernet SQ made (a netdev's, a raw packet QP's) crosses as it is.
        if let crate::wire::Body::Eth { frame } = &p.body {
            self.check(frame, true)?;
            return self.send_frames(vec![frame.clone()]);
        }
        let grh = p.grh.ok_or("no GRH: not a RoCE packet")?;
        let dst = match link_local_mac(&grh.dgid).or_else(|| v4(&grh.dgid).and_then(|ip| self.neighbour(ip))) {
            Some(m) => m,
            None => return self.resolve(&grh.sgid, &grh.dgid),
        };
        let mut buf = Vec::new();
        let mut result = Ok(());
        let mut frames = Vec::new();
        roce_map::emit_frames(p, self.mine, dst, &mut buf, &mut |f| {
            // A frame a test asked the cable to lose, before the capture sees it.
            if self.cable.as_ref().is_some_and(|c| c.lose(&c.sent, &c.drop_nth)) {
                return;
            }
            match self.check(f, true) {
                Ok(()) => frames.push(f.to_vec()),
                Err(e) => result = Err(e),
            }
        })?;
        let sent = self.send_frames(frames);
        result.and(sent)
    }

    /// Sends checked frames (one packet's, to one MAC): at once on the direct path if it is idle, else through
    /// the writer.
    fn send_frames(&self, frames: Vec<Vec<u8>>) -> Result<(), &'static str> {
        let mut result = Ok(());
        let sent = self.send_now(&frames);
        for f in frames.into_iter().skip(sent) {
            if let Err(e) = self.enqueue(f) {
                result = Err(e);
            }
        }
        result
    }

    /// Sends `frames` (one packet's, to one MAC) on the direct path from the calling thread when the writer has
    /// nothing left to write, without waiting: how many went (the rest goes to the writer). A ping-pong's frame
    /// then costs no hand-off to the writer thread and its wake-up, which on a loaded machine is most of a
    /// frame's latency; the TCP link has the same hand-off, so this is where the fabric gains on it.
    fn send_now(&self, frames: &[Vec<u8>]) -> usize {
        let Some(d) = &self.direct else { return 0 };
        // Busy (the writer is sending, or another sender): the writer takes them in order.
        let Ok(mut tx) = d.tx.try_lock() else { return 0 };
        // Frames still queued go first: these wait behind them.
        if !self.count.idle() || frames.is_empty() {
            return 0;
        }
        let DirectTx { peers, pack } = &mut *tx;
        let (sent, _) = peers.send(d, frames, pack, false);
        for _ in 0..sent {
            self.bump(C_TX_DIRECT_NOW);
            self.bump(C_TX_DIRECT);
            self.bump(C_TX);
        }
        sent
    }

    /// Broadcasts an ARP request for the IPv4 address in `dgid` (from the one in `sgid`); the packet that needed
    /// it is lost, as on a NIC whose neighbour entry is not resolved yet.
    fn resolve(&self, sgid: &[u8; 16], dgid: &[u8; 16]) -> Result<(), &'static str> {
        let (Some(sender_ip), Some(target_ip)) = (v4(sgid), v4(dgid)) else {
            return Err("no MAC for the destination GID");
        };
        self.bump(C_ARP);
        let arp =
            ArpRepr { operation: Operation::Request, sender_mac: self.mine, sender_ip, target_mac: [0; 6], target_ip };
        let eth = EthernetRepr { dst: BROADCAST, src: self.mine, ethertype: EtherType::Arp };
        let mut buf = [0u8; 64];
        let n = emit_arp(&eth, &arp, &mut buf).map_err(|_| "ARP request does not fit")?;
        self.queue(&buf[..n], true)
    }

    /// Announces the port's IPv4 address (a gratuitous ARP request for it, as a host sends when its link comes
    /// up), so the far end of a stream learns its MAC before the first packet to it, which would otherwise be lost
    /// to an ARP request (a CM REQ then waits for its retry timer, seconds).
    pub(crate) fn announce(&self) {
        let Some(ip) = self.ipv4 else { return };
        let arp = ArpRepr {
            operation: Operation::Request,
            sender_mac: self.mine,
            sender_ip: ip,
            target_mac: [0; 6],
            target_ip: ip,
        };
        let eth = EthernetRepr { dst: BROADCAST, src: self.mine, ethertype: EtherType::Arp };
        let mut buf = [0u8; 64];
        if let Ok(n) = emit_arp(&eth, &arp, &mut buf) {
            let _ = self.queue(&buf[..n], true);
        }
    }

    /// Whether the link takes a received frame to the port: broadcast, multicast or its own MAC, of a length
    /// the fabric carries. Others are counted; ARP frames teach the neighbour table.
    fn admit(&self, frame: &[u8]) -> bool {
        if frame.len() > MAX_ETH_FRAME {
            self.bump(C_RX_OVERSIZE);
            return false;
        }
        let ib_frame = frame.len() >= ETH_HEADER && frame[12..14] == ETHERTYPE_IB.to_be_bytes();
        if self.ib.is_none() && frame.len() >= ETH_HEADER && frame[12..14] == ETHERTYPE_ARP {
            if let Ok(Parsed::Arp(_, arp)) = parse(frame) {
                self.learn(arp.sender_ip, arp.sender_mac);
            }
        }
        // A runt goes to the port, whose parser drops and counts it (an IB port's link counts it itself). On a
        // point-to-point stream whatever an IB port's partner sends is for it, whichever LID it has now; on a
        // switch an IB port takes its LID's MAC and the permissive LID's (a directed-route SMP).
        let cable_ib = self.cable.is_some() && self.ib.is_some();
        let mine = match &self.ib {
            Some(ib) => cable_ib || frame.len() < 6 || ib.owns_mac(&frame[..6]),
            None => frame.len() < 6 || frame[..6] == self.mine,
        };
        if frame.len() >= 6 && frame[0] & 1 == 0 && !mine {
            self.bump(C_RX_NOT_MINE);
            return false;
        }
        if frame.len() >= ETH_HEADER && ib_frame != self.ib.is_some() {
            self.bump(C_RX_OTHER_LINK);
            return false;
        }
        self.bump(C_RX);
        true
    }

    /// An IB port's received frame (admitted: its ethertype, or a runt): a fragment of a packet for the port, or a
    /// probe or answer about a LID (a probe for this port's LID is answered). The packet once it is whole, with
    /// the sender's LID.
    fn take_ib(&self, ib: &IbSide, frame: &[u8]) -> Result<Option<(Packet, u16)>, &'static str> {
        let f = super::vde_ib::parse_lids(frame, self.cable.is_none())?;
        let other = f.instance != ib.instance;
        let lid = ib.lid();
        // A stream has one port at its far end (whose address its hello told): LIDs need no guarding, and a
        // subnet manager's packets come to the permissive LID or before it assigned one.
        if self.cable.is_some() {
            return match f.kind {
                Kind::Data => self.reassemble(ib, &f),
                Kind::Probe | Kind::InUse => Ok(None),
            };
        }
        match f.kind {
            Kind::Probe | Kind::InUse if f.dlid == lid && other => {
                self.bump(C_LID_CONFLICT);
                // A link being unplugged holds the LID no more (its port may be plugging in again).
                if f.kind == Kind::Probe && self.is_up() {
                    let _ = self.queue(&ib.in_use(), false);
                }
                return Err(LID_CONFLICT);
            }
            Kind::Probe | Kind::InUse => {
                ib.claimed(f.dlid, f.instance);
                return Ok(None);
            }
            Kind::Data => {}
        }
        // A directed-route SMP comes to the permissive LID: whoever is at the end of the cable.
        if f.dlid != lid && f.dlid != PERMISSIVE_LID {
            return Err("IB frame for another LID behind this port's MAC");
        }
        // From a port with this port's LID, or with the LID of another port this one has heard from (a port
        // without a LID sends from the permissive LID, which nobody holds).
        let unicast = super::port::is_unicast_lid(f.slid);
        if unicast && ((f.slid == lid && other) || !ib.sender_holds(f.slid, f.instance)) {
            self.bump(C_LID_CONFLICT);
            return Err(LID_CONFLICT);
        }
        self.reassemble(ib, &f)
    }

    /// A checked data fragment: the packet once it is whole, with the sender's LID.
    fn reassemble(&self, ib: &IbSide, f: &super::vde_ib::IbFrame<'_>) -> Result<Option<(Packet, u16)>, &'static str> {
        let nobody = DevRef { id: 0, port: Port::Local(Weak::<()>::new()) };
        let mut reasm = ib.reasm.lock().unwrap_or_else(|e| e.into_inner());
        // A message in one frame (the common case) is decoded where it lies.
        if f.offset == 0 && f.fragment.len() == f.total {
            reasm.remember(f.instance, f.msg);
            drop(reasm);
            return super::vde_ib::decode(f.fragment, nobody).map(|p| Some((p, f.slid)));
        }
        let mut given_up = 0;
        let whole = reasm.add(f, &mut given_up);
        drop(reasm);
        for _ in 0..given_up {
            self.bump(C_RX_IB_INCOMPLETE);
        }
        match whole {
            Some(body) => super::vde_ib::decode(&body, nobody).map(|p| Some((p, f.slid))),
            None => Ok(None),
        }
    }
}

/// Why the reader ended when its connection failed.
const FABRIC_GONE: &str = "the VDE fabric went away";

/// Why an IB frame from another port with this port's LID is dropped.
const LID_CONFLICT: &str = "another port on the VDE fabric has this port's LID";

/// Indices of [`VdeLink::counters`].
const C_TX: usize = 0;
const C_RX: usize = 1;
const C_RX_NOT_MINE: usize = 2;
const C_RX_OVERSIZE: usize = 3;
const C_TX_OVERSIZE: usize = 4;
const C_TX_QUEUE_FULL: usize = 5;
const C_ARP: usize = 6;
const C_TX_DIRECT: usize = 7;
const C_RX_DIRECT: usize = 8;
const C_DIRECT_TIMEOUT: usize = 9;
const C_RX_DIRECT_MALFORMED: usize = 10;
const C_TX_DIRECT_NOW: usize = 11;
const C_RX_OTHER_LINK: usize = 12;
const C_RX_IB_MALFORMED: usize = 13;
const C_LID_CONFLICT: usize = 14;
const C_RX_IB_INCOMPLETE: usize = 15;

/// Frames the writer takes from its queue and sends at once, at most.
const TX_BATCH: usize = 32;

/// Every VDE link of this process, for [`resolve`].
static LINKS: Mutex<Vec<Weak<VdeLink>>> = Mutex::new(Vec::new());

/// How often [`resolve`] asks again while it waits.
const ARP_RETRY: Duration = Duration::from_millis(200);

/// The MAC of `ip` on any VDE fabric a port of this process is plugged into: learned already, or asked for by ARP
/// (from the port's own IPv4 address) and waited for up to `timeout`, as the kernel's neighbour resolution does
/// for a RoCE address handle. `None` when nobody answered.
pub fn resolve(ip: [u8; 4], timeout: Duration) -> Option<[u8; 6]> {
    let links: Vec<Arc<VdeLink>> = {
        let mut l = LINKS.lock().ok()?;
        l.retain(|w| w.strong_count() > 0);
        l.iter().filter_map(Weak::upgrade).filter(|l| l.is_up()).collect()
    };
    // A port's own address is its own MAC, as the kernel resolves a local address (UCX's UD endpoint to its own
    // interface waited 30 s for an ARP answer nobody sends).
    if let Some(l) = links.iter().find(|l| l.ipv4 == Some(ip)) {
        return Some(l.mine);
    }
    let end = Instant::now() + timeout;
    let mut asked: Option<Instant> = None;
    loop {
        if let Some(mac) = links.iter().find_map(|l| l.neighbour(ip)) {
            return Some(mac);
        }
        let now = Instant::now();
        if links.is_empty() || now >= end {
            return None;
        }
        if asked.is_none_or(|t| now >= t + ARP_RETRY) {
            for l in &links {
                if let Some(mine) = l.ipv4 {
                    let _ = l.resolve(&crate::wire::roce::frame::mapped(mine), &crate::wire::roce::frame::mapped(ip));
                }
            }
            asked = Some(now);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Plugs the port of `station` into the fabric at `url` (`None`: the default switch, started if needed).
pub(crate) fn plug<S: Station>(station: &Arc<S>, url: Option<&str>) -> Result<(), VdeError> {
    let (conn, dir) = match url {
        Some(u) => (Conn::open(u)?, Direct::switch_dir(u)),
        None => {
            let dir = default_switch_dir();
            (open_or_start(&dir)?, Some(dir))
        }
    };
    let url = url.map_or_else(|| switch_url(&default_switch_dir()), str::to_string);
    plug_conn(station, conn, &url, dir)
}

/// Plugs into the switch at `dir`, starting it if none answers (tests use a private directory).
#[cfg(test)]
pub(crate) fn plug_dir<S: Station>(station: &Arc<S>, dir: &Path) -> Result<(), VdeError> {
    plug_conn(station, open_or_start(dir)?, &switch_url(dir), Some(dir.to_path_buf()))
}

fn plug_conn<S: Station>(station: &Arc<S>, conn: Conn, url: &str, dir: Option<PathBuf>) -> Result<(), VdeError> {
    plug_with(station, Box::new(conn), url, dir, None).map(|_| ())
}

/// Plugs the port into the fabric `conn` reaches (`dir`: the switch's directory, for the direct path; `cable`: a
/// point-to-point stream's side, `tcp.rs` and `guest.rs`). On a switch an IB port first makes sure no other port
/// on the fabric holds its LID (`vde_ib.rs`); on a stream the far end's hello told its address instead, and the
/// LID may be 0 until a subnet manager assigns one. An IB port goes by its LID's MAC.
pub(crate) fn plug_with<S: Station>(
    station: &Arc<S>,
    conn: Box<dyn Datagrams>,
    url: &str,
    dir: Option<PathBuf>,
    cable: Option<Cable>,
) -> Result<Arc<VdeLink>, VdeError> {
    let (addr, pcap, ipv4) = wire(&**station, |w| {
        (w.addr, if w.addr.ib { w.ib_pcap.clone() } else { w.pcap.clone() }, w.ipv4().first().copied())
    });
    let ib = match addr.ib {
        false => None,
        true if cable.is_some() => {
            let guid = u64::from_be_bytes(addr.gid[8..].try_into().unwrap_or_default());
            Some(IbSide::new(addr.lid, guid))
        }
        true if addr.lid != 0 && !super::port::is_unicast_lid(addr.lid) => {
            return Err(VdeError::BadLid { lid: addr.lid })
        }
        true => {
            let guid = u64::from_be_bytes(addr.gid[8..].try_into().unwrap_or_default());
            let side = IbSide::new(addr.lid, guid);
            // A port waiting for a subnet manager (LID 0) has no LID to probe for: the SM keeps LIDs unique.
            let probed = if addr.lid == 0 { Ok(None) } else { super::vde_ib::probe(&*conn, &side, addr.mac) };
            match probed {
                Ok(None) => {}
                Ok(Some(guid)) => return Err(VdeError::LidInUse { lid: addr.lid, guid }),
                Err(source) => return Err(VdeError::Open { url: url.into(), source }),
            }
            Some(side)
        }
    };
    // An IB port neither sends nor answers ARP.
    let (mine, ipv4) = if ib.is_some() { (lid_mac(addr.lid), None) } else { (addr.mac, ipv4) };
    // A port waiting for an SM takes its MAC from a LID it does not have yet: no direct path (its cable's far
    // end is a switch, which has none either).
    let direct = dir.filter(|_| ib.as_ref().is_none_or(|s| s.lid() != 0)).and_then(|d| Direct::open(&d, mine));
    let (tx, rx) = mpsc::sync_channel(TX_QUEUE);
    let id = next_device_id();
    let link = Arc::new(VdeLink {
        id,
        conn,
        direct,
        tx,
        up: AtomicBool::new(true),
        mine,
        ipv4,
        pcap,
        neighbours: Mutex::new(Vec::new()),
        counters: Default::default(),
        ib,
        count: TxCount::default(),
        cable,
    });
    let old = station.with_wire(|wire, _| {
        let old = wire.vde_link();
        wire.plug_vde(DevRef { id, port: Port::Vde(link.clone(), 0) });
        (old, Some(true))
    });
    if let Some(old) = old {
        old.close();
    }
    if let Ok(mut l) = LINKS.lock() {
        l.retain(|w| w.strong_count() > 0);
        l.push(Arc::downgrade(&link));
    }
    let threads = |source| VdeError::Threads { source };
    let writer = link.clone();
    std::thread::Builder::new()
        .name("mlx5-sim-vde-tx".into())
        .spawn(move || write_loop(&writer, rx))
        .map_err(threads)?;
    let weak = Arc::downgrade(station);
    let reader = link.clone();
    std::thread::Builder::new()
        .name("mlx5-sim-vde-rx".into())
        .spawn(move || read_loop(weak, reader))
        .map_err(threads)?;
    Ok(link)
}

/// Whether a frame is UDP to the RoCEv2 port (IPv4 without options, or IPv6), by its headers alone.
fn is_roce(f: &[u8]) -> bool {
    let udp_dport = |at: usize| f.get(at + 2..at + 4) == Some(&4791u16.to_be_bytes()[..]);
    match f.get(12..14) {
        Some([0x08, 0x00]) => f.get(14) == Some(&0x45) && f.get(23) == Some(&17) && udp_dport(34),
        Some([0x86, 0xdd]) => f.get(20) == Some(&17) && udp_dport(54),
        _ => false,
    }
}

impl Cable {
    /// Counts a RoCE frame on `count`; true when it is the one `nth` names (a loss a test asked for).
    fn lose(&self, count: &AtomicU64, nth: &AtomicU64) -> bool {
        count.fetch_add(1, Ordering::AcqRel) + 1 == nth.load(Ordering::Acquire)
    }

    /// Takes a frame from the stream that is the cable's own business: a hello (`true`: consumed), or a RoCE
    /// frame a test asked to lose.
    fn intercept<S: Station>(&self, station: &S, link: &VdeLink, frame: &[u8]) -> bool {
        match Hello::parse(frame) {
            Some(Ok(theirs)) => {
                let mine =
                    wire(station, |w| Hello { ib: w.addr.ib, lid: w.addr.lid, gid: w.addr.gid, mac: w.addr.mac });
                if theirs.same_port(&mine) {
                    self.same_address.store(true, Ordering::Release);
                    if let Some(peer) = self.peer {
                        log(station, SimEvent::LinkDown { peer, why: "the peer has this port's own address" });
                    }
                    link.close();
                } else {
                    self.heard.store(true, Ordering::Release);
                }
                true
            }
            Some(Err(why)) => {
                log(station, SimEvent::FrameDropped { why });
                true
            }
            None => is_roce(frame) && self.lose(&self.received, &self.drop_in_nth),
        }
    }
}

/// Hands a received frame to the port if the link admits it (its answer, an ARP reply, is queued): whether it
/// did, or `None` when the device is gone.
fn take<S: Station>(weak: &Weak<S>, link: &VdeLink, src: &DevRef, frame: &[u8]) -> Option<bool> {
    if let Some(c) = &link.cable {
        if c.intercept(&*weak.upgrade()?, link, frame) {
            return Some(false);
        }
    }
    if !link.admit(frame) {
        return Some(false);
    }
    if let (Some(ib), Port::Vde(l, _)) = (&link.ib, &src.port) {
        // Every IB frame the link takes is recorded, as a port records what its receive side takes.
        if let Some(s) = &link.pcap {
            s.record(|_, out| out(frame));
        }
        return match link.take_ib(ib, frame) {
            Ok(None) => Some(false),
            Ok(Some((p, slid))) => {
                let station = weak.upgrade()?;
                // Responses go back to the sender's LID.
                let src = DevRef { id: src.id, port: Port::Vde(l.clone(), slid) };
                station.receive_packet(Packet { src, ..p });
                Some(true)
            }
            Err(why) => {
                if why != LID_CONFLICT {
                    link.bump(C_RX_IB_MALFORMED);
                }
                let station = weak.upgrade()?;
                log(&*station, SimEvent::FrameDropped { why });
                Some(false)
            }
        };
    }
    let station = weak.upgrade()?;
    if let Some(back) = station.receive_frame(frame, src) {
        // The port recorded its answer itself.
        let _ = link.queue(&back, false);
    }
    Some(true)
}

fn write_loop(link: &VdeLink, rx: mpsc::Receiver<Vec<u8>>) {
    let mut batch: Vec<Vec<u8>> = Vec::with_capacity(TX_BATCH);
    // A paced cable's schedule: when its first frame went and how many went since.
    let mut paced: Option<(Instant, u64)> = None;
    while link.is_up() {
        let pace = link.cable.as_ref().map_or(0, |c| c.pace.load(Ordering::Acquire));
        // A paced cable writes one frame at a time.
        let most = if pace == 0 { TX_BATCH } else { 1 };
        // What is queued goes out together: a run of frames to one port of this machine in one call, so its
        // reader wakes once for them.
        batch.clear();
        match rx.recv_timeout(Duration::from_millis(POLL_MS as u64)) {
            Ok(f) => batch.push(f),
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        while batch.len() < most {
            match rx.try_recv() {
                Ok(f) => batch.push(f),
                Err(_) => break,
            }
        }
        for _ in &batch {
            link.count.taken();
        }
        // Held until the batch is written, so a sender that sends at once sees it written or waits behind it.
        let mut direct = link.direct.as_ref().map(|d| (d, d.tx.lock().unwrap_or_else(|e| e.into_inner())));
        let mut i = 0;
        while i < batch.len() {
            let dst = dst_mac(&batch[i]);
            let run = batch[i..].iter().take_while(|f| dst_mac(f) == dst).count();
            let (sent, next) = match &mut direct {
                Some((d, tx)) => {
                    let DirectTx { peers, pack } = &mut **tx;
                    peers.send(d, &batch[i..i + run], pack, true)
                }
                None => (0, DirectSend::Switch),
            };
            for _ in 0..sent {
                link.bump(C_TX_DIRECT);
                link.bump(C_TX);
            }
            link.count.written(sent as u64);
            i += sent;
            match next {
                // A waiting send never comes back busy.
                DirectSend::Sent | DirectSend::Busy => {}
                DirectSend::TimedOut(k) => {
                    for _ in 0..k {
                        link.bump(C_DIRECT_TIMEOUT);
                    }
                    link.count.written(k as u64);
                    i += k;
                }
                // A datagram fabric takes each frame whole or not at all; a failed send means the fabric went
                // away.
                DirectSend::Switch => {
                    // No direct path (a stream, a fabric that is no switch): the rest in as few calls as the
                    // transport allows.
                    let n = if link.direct.is_none() { batch.len() - i } else { 1 };
                    if link.conn.send_many(&batch[i..i + n]) < 0 {
                        link.close();
                        return;
                    }
                    for _ in 0..n {
                        link.bump(C_TX);
                    }
                    link.count.written(n as u64);
                    i += n;
                }
            }
        }
        // Paced: the n-th frame since the pace was set goes n / pace milliseconds after the first.
        if let Some(us) = (paced.map_or(0, |(_, n)| n) + 1).saturating_mul(1000).checked_div(pace) {
            let start = paced.map_or_else(Instant::now, |(t, _)| t);
            paced = Some((start, paced.map_or(0, |(_, n)| n) + 1));
            if let Some(wait) = (start + Duration::from_micros(us)).checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
    }
}

fn read_loop<S: Station>(weak: Weak<S>, link: Arc<VdeLink>) {
    // Room for any datagram, so a longer one is seen (and counted) rather than cut.
    let mut buf = vec![0u8; 1 << 16];
    let src = DevRef { id: link.id, port: Port::Vde(link.clone(), 0) };
    let (data, ctl) = link.conn.fds();
    let direct = link.direct.as_ref().map_or(-1, |d| d.rx.as_raw_fd());
    let mut dbuf = vec![0u8; 1 << 16];
    let mut why = "unplugged";
    // Frames handed to the port since its datapath last ran: it runs once what is queued is taken (or after
    // RX_BATCH frames), not once a frame.
    let mut unrun = 0;
    while link.is_up() {
        let mut fds = [
            libc::pollfd { fd: data, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: ctl, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: direct, events: libc::POLLIN, revents: 0 },
        ];
        // Frames a stream read ahead are taken without waiting for the socket.
        let pending = link.conn.pending();
        let wait = if unrun > 0 || pending { 0 } else { POLL_MS };
        // SAFETY: three valid pollfd entries (a negative fd is ignored by poll).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, wait) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            why = "poll failed";
            break;
        }
        if (n == 0 && !pending) || unrun >= RX_BATCH {
            if unrun > 0 {
                let Some(station) = weak.upgrade() else { break };
                station.run();
                unrun = 0;
            }
            continue;
        }
        // The control connection says something only when the switch goes away.
        if ctl >= 0 && fds[1].revents != 0 {
            why = "the VDE switch went away";
            break;
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
            && fds[0].revents & libc::POLLIN == 0
            && !pending
        {
            why = FABRIC_GONE;
            break;
        }
        if fds[0].revents & libc::POLLIN != 0 || pending {
            let got = link.conn.recv(&mut buf);
            if got <= 0 {
                why = FABRIC_GONE;
                break;
            }
            match take(&weak, &link, &src, &buf[..got as usize]) {
                Some(taken) => unrun += usize::from(taken),
                None => break,
            }
        }
        if let (Some(d), true) = (&link.direct, fds[2].revents & libc::POLLIN != 0) {
            // Non-blocking: what is queued, up to a batch of datagrams (none: a spurious wake).
            let (mut gone, mut drained) = (false, false);
            for _ in 0..RX_BATCH {
                let Ok(got) = d.rx.recv(&mut dbuf) else {
                    drained = true;
                    break;
                };
                let each = |frame: &[u8]| {
                    link.bump(C_RX_DIRECT);
                    match take(&weak, &link, &src, frame) {
                        Some(taken) => {
                            unrun += usize::from(taken);
                            true
                        }
                        None => {
                            gone = true;
                            false
                        }
                    }
                };
                if unpack_frames(&dbuf[..got], each).is_err() {
                    link.bump(C_RX_DIRECT_MALFORMED);
                }
                if gone {
                    break;
                }
            }
            if gone {
                break;
            }
            // Nothing more queued here nor on the switch's side: the port runs now rather than after one more
            // poll (a ping-pong's frame is alone).
            if drained && unrun > 0 && fds[0].revents & libc::POLLIN == 0 {
                let Some(station) = weak.upgrade() else { break };
                station.run();
                unrun = 0;
            }
        }
    }
    if unrun > 0 {
        if let Some(station) = weak.upgrade() {
            station.run();
        }
    }
    let gone = link.is_up();
    link.close();
    if let Some(station) = weak.upgrade() {
        match (gone, link.cable.as_ref()) {
            (false, _) => {}
            (true, Some(c)) => {
                let why = if why == FABRIC_GONE { "the far end closed the stream (or broke its framing)" } else { why };
                match c.peer {
                    Some(peer) => log(&*station, SimEvent::LinkDown { peer, why }),
                    None => log(&*station, SimEvent::FabricDown { why }),
                }
            }
            (true, None) => log(&*station, SimEvent::FabricDown { why }),
        }
        station.with_wire(|wire, _| {
            let plugged = wire.vde_link().is_some_and(|l| Arc::ptr_eq(&l, &link));
            if plugged {
                wire.unplug_remote(link.id);
            }
            ((), plugged.then_some(false))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Mode, SimConfig};
    use crate::sim_device::SimDevice;
    use crate::testkit::submit::{Bell, QpSpec, RcParams, Rdma, Remote, TAv, TCq, TQp, Wqe};
    use crate::wire::roce::frame::{mapped, DropReason};
    use mlx5_core::prm::consts;
    use std::os::unix::net::UnixDatagram;

    const SEND: u8 = consts::MLX5_OPCODE_SEND;

    /// A switch of the test's own in a fresh directory, started by the first port plugged in, ended when dropped.
    struct Switch(PathBuf);

    impl Switch {
        fn new(name: &str) -> Switch {
            let dir = std::env::temp_dir().join(format!("mlx5-vde-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            Switch(dir)
        }

        fn url(&self) -> String {
            switch_url(&self.0)
        }

        /// Ends the switch (SIGKILL to the pid it wrote: a daemonized vde_switch here ignored SIGTERM and SIGINT).
        fn kill(&self) {
            let pid = std::fs::read_to_string(self.0.with_extension("pid")).ok().and_then(|p| p.trim().parse().ok());
            if let Some(pid) = pid {
                // SAFETY: kill has no memory preconditions; the pid is the switch this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }

    impl Drop for Switch {
        fn drop(&mut self) {
            self.kill();
            let _ = std::fs::remove_file(self.0.with_extension("pid"));
            let _ = std::fs::remove_file(self.0.with_extension("lock"));
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn cfg(n: u8) -> SimConfig {
        let mut mac = SimConfig::default().mac;
        mac[5] = 0x40 + n;
        SimConfig { mac, node_guid: 0x5000 + u64::from(n), mode: Mode::Threaded, ..SimConfig::default() }
    }

    fn plugged(sw: &Switch, c: SimConfig) -> Rdma {
        let r = Rdma::new(c);
        r.h.dev.vde_plug_dir(&sw.0).expect("plugged into the test's switch (Debian: vde2, libvdeplug2)");
        assert!(r.h.dev.vde_plugged());
        r
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
    }

    /// An RC QP on each of `a` and `b`, connected through `to_b` / `to_a` (their GIDs), and a CQ each.
    fn rc_pair(a: &mut Rdma, b: &mut Rdma, gids: Option<([u8; 16], [u8; 16])>, p: RcParams) -> (TQp, TQp, TCq, TCq) {
        let (a_cq, b_cq) = (a.cq(6), b.cq(6));
        let qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (mut ra, mut rb) = (a.me(qa.qpn), b.me(qb.qpn));
        if let Some((ga, gb)) = gids {
            (ra, rb) = (Remote { gid: ga, ..ra }, Remote { gid: gb, ..rb });
        }
        a.connect_rc(&qa, &rb, p);
        b.connect_rc(&qb, &ra, p);
        (qa, qb, a_cq, b_cq)
    }

    /// A SEND of `n` bytes from `a` to `b` on a connected pair; checks both completions and every byte.
    fn send_checked(a: &mut Rdma, b: &mut Rdma, q: &mut (TQp, TQp, TCq, TCq), n: usize, seed: u8) {
        let (ma, mb) = (a.mr(1 << 14), b.mr(1 << 14));
        let msg = pattern(n, seed);
        ma.write(0, &msg);
        b.post_recv(&mut q.1, &[(mb.addr(), 1 << 14, mb.key)]);
        a.post_send(&mut q.0, &Wqe::new(SEND).data(n as u32, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut q.2).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.wait_cqe(&mut q.3).expect("receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, n as u32));
        assert!(mb.read(0, n) == msg, "every byte");
    }

    #[test]
    fn three_ports_on_one_switch_exchange_rc_and_ud_in_any_order() {
        let sw = Switch::new("three");
        // The first port starts the switch; the others find it.
        let (mut a, mut b, mut c) = (plugged(&sw, cfg(1)), plugged(&sw, cfg(2)), plugged(&sw, cfg(3)));
        // A <-> B and C <-> B over RC, three packets at the 1024-byte MTU each.
        let mut ab = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut ab, 3000, 1);
        let mut cb = rc_pair(&mut c, &mut b, None, RcParams::default());
        send_checked(&mut c, &mut b, &mut cb, 2500, 2);
        // UD C -> A.
        let (mut ca, mut aa) = (c.cq(4), a.cq(4));
        let (mut uc, mut ua) = (c.qp(QpSpec::ud(), ca.cqn, ca.cqn), a.qp(QpSpec::ud(), aa.cqn, aa.cqn));
        c.ready_ud(&uc, 0x33);
        a.ready_ud(&ua, 0x33);
        let (mc, ma) = (c.mr(4096), a.mr(4096));
        mc.write(0, b"over the switch");
        a.post_recv(&mut ua, &[(ma.addr(), 256, ma.key)]);
        let dst = a.me(ua.qpn);
        let av =
            TAv { dqpn: ua.qpn, qkey: 0x33, grh: true, hop_limit: 1, rgid: dst.gid, rmac: dst.mac, ..TAv::default() };
        c.post_send(&mut uc, &Wqe::new(SEND).av(&av).data(15, mc.key, mc.addr()), Bell::Db);
        assert_eq!(c.wait_cqe(&mut ca).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(a.wait_cqe(&mut aa).expect("UD receive CQE").byte_cnt(), 40 + 15);
        assert_eq!(ma.read(40, 15), b"over the switch");
        for r in [&a, &b, &c] {
            assert_eq!(r.h.dev.frame_drops().total(), 0);
            let n = r.h.dev.vde_counters().unwrap();
            assert!(n.tx_frames > 0 && n.rx_frames > 0, "{n:?}");
        }
    }

    #[test]
    fn eight_ports_on_one_fabric_exchange_rc_and_ud_between_every_pair() {
        const N: usize = 8;
        let sw = Switch::new("eight");
        let mut r: Vec<Rdma> = (0..N).map(|i| plugged(&sw, cfg(20 + i as u8))).collect();
        // One UD QP and CQ per port; each port's UD receives land in its own region, one slot per sender.
        let cqs: Vec<TCq> = r.iter_mut().map(|x| x.cq(8)).collect();
        let mut cqs = cqs;
        let mut uds: Vec<TQp> = (0..N).map(|i| r[i].qp(QpSpec::ud(), cqs[i].cqn, cqs[i].cqn)).collect();
        let mrs: Vec<_> = r.iter_mut().map(|x| x.mr(1 << 14)).collect();
        for i in 0..N {
            r[i].ready_ud(&uds[i], 0x88);
            for _ in 0..N - 1 {
                // Slot k of port i gets the datagram of the k-th sender.
                let at = mrs[i].addr() + 256 * u64::from(uds[i].rq_head);
                r[i].post_recv(&mut uds[i], &[(at, 256, mrs[i].key)]);
            }
        }
        for i in 0..N {
            for j in (0..N).filter(|&j| j != i) {
                let dst = r[j].me(uds[j].qpn);
                let msg = [i as u8, j as u8, 0xee];
                mrs[i].write(8192, &msg);
                let av = TAv {
                    dqpn: uds[j].qpn,
                    qkey: 0x88,
                    grh: true,
                    hop_limit: 1,
                    rgid: dst.gid,
                    rmac: dst.mac,
                    ..TAv::default()
                };
                let (ri, qi) = (&mut r[i], &mut uds[i]);
                ri.post_send(qi, &Wqe::new(SEND).av(&av).data(3, mrs[i].key, mrs[i].addr() + 8192), Bell::Db);
                assert_eq!(r[i].wait_cqe(&mut cqs[i]).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
                let e = r[j].wait_cqe(&mut cqs[j]).unwrap_or_else(|| panic!("UD {i} -> {j} delivered"));
                assert_eq!((e.byte_cnt(), e.flags_rqpn() & 0xff_ffff), (43, uds[i].qpn));
            }
        }
        // Every port got one datagram from each of the others, each naming its sender and itself.
        for (j, m) in mrs.iter().enumerate() {
            let mut from: Vec<u8> = (0..N - 1)
                .map(|k| m.read(256 * k + 40, 3))
                .inspect(|d| assert_eq!(d[1..], [j as u8, 0xee]))
                .map(|d| d[0])
                .collect();
            from.sort_unstable();
            assert_eq!(from, (0..N as u8).filter(|&i| i != j as u8).collect::<Vec<_>>());
        }
        // RC between every pair, a two-packet SEND each way.
        for i in 0..N {
            for j in i + 1..N {
                let (lo, hi) = r.split_at_mut(j);
                let (a, b) = (&mut lo[i], &mut hi[0]);
                let mut q = rc_pair(a, b, None, RcParams::default());
                send_checked(a, b, &mut q, 1500, (i * N + j) as u8);
                send_checked(b, a, &mut (q.1, q.0, q.3, q.2), 1500, (j * N + i) as u8);
            }
        }
        for x in &r {
            assert_eq!(x.h.dev.frame_drops().total(), 0);
        }
    }

    #[test]
    fn ipv4_gids_are_resolved_by_arp_over_the_fabric() {
        let sw = Switch::new("arp");
        let (ia, ib) = ([10, 9, 0, 1], [10, 9, 0, 2]);
        let mut a = plugged(&sw, SimConfig { ipv4_addrs: &[[10, 9, 0, 1]], ..cfg(4) });
        let mut b = plugged(&sw, SimConfig { ipv4_addrs: &[[10, 9, 0, 2]], ..cfg(5) });
        // GID entry 1 of each port is its IPv4 address.
        assert_eq!(a.h.set_roce_address(1, mapped(ia)), (0, 0));
        assert_eq!(b.h.set_roce_address(1, mapped(ib)), (0, 0));
        let (mut ac, mut bc) = (a.cq(8), b.cq(8));
        let (mut ua, mut ub) = (a.qp(QpSpec::ud(), ac.cqn, ac.cqn), b.qp(QpSpec::ud(), bc.cqn, bc.cqn));
        a.ready_ud(&ua, 0x44);
        b.ready_ud(&ub, 0x44);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, b"to 10.9.0.2");
        mb.write(0, b"to 10.9.0.1");
        // The MAC in the address vector is not used: the link resolves the GID.
        let av = |dqpn, ip| TAv {
            dqpn,
            qkey: 0x44,
            grh: true,
            hop_limit: 64,
            sgid_index: 1,
            rgid: mapped(ip),
            ..TAv::default()
        };
        for k in 0..2 {
            b.post_recv(&mut ub, &[(mb.addr() + 1024 + 256 * k, 256, mb.key)]);
        }
        // The first datagram goes as an ARP request instead and is lost, as on a NIC resolving its neighbour.
        let to_b = Wqe::new(SEND).av(&av(ub.qpn, ib)).data(11, ma.key, ma.addr());
        a.post_send(&mut ua, &to_b, Bell::Db);
        assert_eq!(a.wait_cqe(&mut ac).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let link = a.h.dev.vde_link_for_test();
        let end = Instant::now() + Duration::from_secs(5);
        while link.neighbour(ib).is_none() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(link.neighbour(ib), Some(cfg(5).mac), "B answered A's ARP request");
        // A port's own address needs no request.
        assert_eq!(resolve(ia, Duration::ZERO), Some(cfg(4).mac));
        assert!(b.poll(&mut bc).is_none(), "the datagram that needed the ARP request was lost");
        a.post_send(&mut ua, &to_b, Bell::Db);
        assert_eq!(a.wait_cqe(&mut ac).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.wait_cqe(&mut bc).expect("UD receive CQE").byte_cnt(), 40 + 11);
        assert_eq!(mb.read(1024 + 40, 11), b"to 10.9.0.2");
        // B learned A from A's request: its first datagram back needs no request of its own.
        a.post_recv(&mut ua, &[(ma.addr() + 1024, 256, ma.key)]);
        b.post_send(&mut ub, &Wqe::new(SEND).av(&av(ua.qpn, ia)).data(11, mb.key, mb.addr()), Bell::Db);
        assert_eq!(b.wait_cqe(&mut bc).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(a.wait_cqe(&mut ac).expect("UD receive CQE").byte_cnt(), 40 + 11);
        assert_eq!(ma.read(1024 + 40, 11), b"to 10.9.0.1");
        let (na, nb) = (a.h.dev.vde_counters().unwrap(), b.h.dev.vde_counters().unwrap());
        assert_eq!((na.arp_requests, nb.arp_requests), (1, 0));
        // What a driver's address resolution calls: nobody has 10.9.0.3 yet; once a port with it plugs in, ARP
        // finds it.
        assert_eq!(resolve([10, 9, 0, 3], Duration::from_millis(300)), None);
        let c = plugged(&sw, SimConfig { ipv4_addrs: &[[10, 9, 0, 3]], ..cfg(15) });
        assert_eq!(resolve([10, 9, 0, 3], Duration::from_secs(5)), Some(cfg(15).mac));
        drop(c);
    }

    #[test]
    fn frames_that_are_not_ours_are_dropped_and_counted() {
        let sw = Switch::new("foreign");
        let mut a = plugged(&sw, SimConfig { ipv4_addrs: &[[10, 9, 1, 1]], ..cfg(6) });
        let mut b = plugged(&sw, cfg(7));
        let raw = Conn::open(&sw.url()).unwrap();
        let am = a.h.dev.vde_counters().unwrap();
        let a_mac = cfg(6).mac;
        let frame = |dst: [u8; 6], ethertype: [u8; 2], len: usize| {
            let mut f = vec![0x5au8; len.max(14)];
            f[..6].copy_from_slice(&dst);
            f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
            f[12..14].copy_from_slice(&ethertype);
            f
        };
        // A foreign ethertype (LLDP's), garbage IPv4, a runt (the switch drops it itself), a jumbo frame (the switch
        // cuts it to 1518 bytes, so its IPv6 length is wrong), and an IB port's frame (dropped by the link).
        let sent = [
            frame(a_mac, [0x88, 0xcc], 60),
            frame(a_mac, ETHERTYPE_IB.to_be_bytes(), 60),
            frame(a_mac, [0x08, 0x00], 200),
            frame(a_mac, [0x86, 0xdd], 14)[..13].to_vec(),
            frame(a_mac, [0x86, 0xdd], 9000),
        ];
        for f in &sent {
            assert_eq!(raw.send(f), f.len() as isize);
        }
        // A unicast frame to a MAC nobody has (the switch floods it): not for A's port.
        assert!(raw.send(&frame([0x02, 1, 2, 3, 4, 5], [0x88, 0xcc], 60)) > 0);
        // A flood of ARP requests for A's address, each from another sender: A answers (queue bounded), its
        // neighbour table keeps at most MAX_NEIGHBOURS.
        let flood = 20_000u32;
        for i in 0..flood {
            let ip = (0x0a64_0000 + i).to_be_bytes();
            let smac = [0x02, 0x77, 0, (i >> 16) as u8, (i >> 8) as u8, i as u8];
            let arp = ArpRepr {
                operation: Operation::Request,
                sender_mac: smac,
                sender_ip: ip,
                target_mac: [0; 6],
                target_ip: [10, 9, 1, 1],
            };
            let mut buf = [0u8; 64];
            let n = emit_arp(&EthernetRepr { dst: BROADCAST, src: smac, ethertype: EtherType::Arp }, &arp, &mut buf)
                .unwrap();
            // A datagram socket to a busy switch may push back; a dropped request is fine for a flood.
            let _ = raw.send(&buf[..n]);
        }
        let end = Instant::now() + Duration::from_secs(10);
        let want_drops = 3;
        while a.h.dev.frame_drops().total() < want_drops && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let drops = a.h.dev.frame_drops();
        assert_eq!(drops.total(), want_drops, "{drops:?}");
        for r in [DropReason::EtherType, DropReason::Ipv4, DropReason::Ipv6] {
            assert_eq!(drops.get(r), 1, "{r:?}: {drops:?}");
        }
        let n = a.h.dev.vde_counters().unwrap();
        assert!(n.rx_not_mine > am.rx_not_mine, "{n:?}");
        assert_eq!(n.rx_other_link_layer, 1, "{n:?}");
        let link = a.h.dev.vde_link_for_test();
        assert!(link.neighbours.lock().unwrap().len() <= MAX_NEIGHBOURS);
        // Still a working port: an RC message both ways.
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 3000, 5);
    }

    #[test]
    fn a_peer_that_goes_away_ends_in_a_retry_error() {
        let sw = Switch::new("vanish");
        let (mut a, mut b) = (plugged(&sw, cfg(8)), plugged(&sw, cfg(9)));
        // rc_pingpong's timer (67 ms, 7 retries): a shorter budget ran out under load before the fault.
        let p = RcParams::default();
        let mut q = rc_pair(&mut a, &mut b, None, p);
        send_checked(&mut a, &mut b, &mut q, 1000, 6);
        drop(b);
        let ma = a.mr(1 << 16);
        a.post_send(&mut q.0, &Wqe::new(SEND).data(1 << 16, ma.key, ma.addr()), Bell::Db);
        let e = a.wait_cqe(&mut q.2).expect("an error CQE, not a hang");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
    }

    #[test]
    fn a_switch_that_goes_away_takes_the_port_down() {
        let sw = Switch::new("gone");
        let (mut a, mut b) = (plugged(&sw, cfg(10)), plugged(&sw, cfg(11)));
        // rc_pingpong's timer (67 ms, 7 retries): a shorter budget ran out under load before the fault.
        let p = RcParams::default();
        let mut q = rc_pair(&mut a, &mut b, None, p);
        send_checked(&mut a, &mut b, &mut q, 1000, 7);
        sw.kill();
        let end = Instant::now() + Duration::from_secs(10);
        while a.h.dev.vde_plugged() && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!a.h.dev.vde_plugged(), "the port saw the fabric go");
        assert!(a.h.dev.events().iter().any(|e| matches!(e, SimEvent::FabricDown { .. })));
        let ma = a.mr(4096);
        a.post_send(&mut q.0, &Wqe::new(SEND).data(100, ma.key, ma.addr()), Bell::Db);
        let e = a.wait_cqe(&mut q.2).expect("an error CQE, not a hang");
        assert_eq!(e.opcode(), consts::MLX5_CQE_REQ_ERR);
        // Plugging in again fails clearly once nothing answers at the URL.
        let err = SimDevice::new(cfg(12)).vde_plug(Some(&sw.url())).unwrap_err();
        assert!(matches!(err, VdeError::Open { .. }), "{err}");
    }

    /// `wirefilter` between two switches: loss, duplicates and a delay that varies (so frames overtake each
    /// other). Ended when dropped.
    struct Filter(PathBuf);

    impl Filter {
        fn new(a: &Switch, b: &Switch, args: &[&str]) -> Filter {
            let pid = a.0.with_extension("wf.pid");
            let plugs = format!("{}:{}", a.0.display(), b.0.display());
            let ok = std::process::Command::new("wirefilter")
                .args(["-v", &plugs])
                .args(args)
                .args(["--daemon", "--pidfile"])
                .arg(&pid)
                .status()
                .expect("wirefilter runs (Debian: vde2)")
                .success();
            assert!(ok, "wirefilter started");
            Filter(pid)
        }
    }

    impl Drop for Filter {
        fn drop(&mut self) {
            if let Some(pid) = std::fs::read_to_string(&self.0).ok().and_then(|p| p.trim().parse().ok()) {
                // SAFETY: kill has no memory preconditions; the pid is the wirefilter this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn rc_through_wirefilter_loss_duplicates_and_reordering_delivers_every_message_once() {
        let (s1, s2) = (Switch::new("wf-a"), Switch::new("wf-b"));
        let (mut a, mut b) = (plugged(&s1, cfg(30)), plugged(&s2, cfg(31)));
        // 3 % loss, 2 % duplicates, 1-3 ms of delay without FIFO order.
        let _wf = Filter::new(&s1, &s2, &["-l", "3", "-D", "2", "-d", "2+1", "-N"]);
        // rc_pingpong's timer (67 ms, 7 retries): 16 ms ran out of retries once on a loaded machine.
        let p = RcParams::default();
        let (mut qa, mut qb, mut a_cq, mut b_cq) = rc_pair(&mut a, &mut b, None, p);
        let (ma, mb) = (a.mr(1 << 16), b.mr(1 << 16));
        const MSGS: usize = 60;
        const LEN: usize = 3000;
        for m in 0..MSGS {
            let msg = pattern(LEN, m as u8);
            ma.write(0, &msg);
            let at = 4096 * (m % 8);
            b.post_recv(&mut qb, &[(mb.addr() + at as u64, 4096, mb.key)]);
            a.post_send(&mut qa, &Wqe::new(SEND).data(LEN as u32, ma.key, ma.addr()), Bell::Db);
            assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0), "message {m}");
            let e = b.wait_cqe(&mut b_cq).expect("receive CQE");
            assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, LEN as u32), "message {m}");
            assert!(mb.read(at, LEN) == msg, "message {m}: every byte");
        }
        // Nothing delivered twice: no receive CQE beyond one per message, and the receive queue consumed once each.
        assert!(b.poll(&mut b_cq).is_none());
        assert_eq!(b.h.dev.qp_info(qb.qpn).unwrap().rq_ci as usize, MSGS);
        let count = |r: &Rdma, f: fn(&SimEvent) -> bool| r.h.dev.events().iter().filter(|e| f(e)).count();
        let retries = count(&a, |e| matches!(e, SimEvent::Retry { .. }));
        let naks = count(&a, |e| matches!(e, SimEvent::PsnSequenceNak { .. }));
        let dups = count(&b, |e| matches!(e, SimEvent::DuplicateRequest { .. }));
        println!("wirefilter: {MSGS} messages of {LEN} B: {retries} timer retries, {naks} sequence NAKs, {dups} duplicate requests answered");
        // About 8 frames a message cross the filter: with 3 % loss some recovery is certain (0.97^480 < 1e-6).
        assert!(retries + naks > 0, "the loss was recovered from");
    }

    #[test]
    fn reads_of_sixteen_packets_reordered_on_the_wire_complete_as_long_as_attempts_make_progress() {
        let (s1, s2) = (Switch::new("wfr-a"), Switch::new("wfr-b"));
        let (mut a, mut b) = (plugged(&s1, cfg(32)), plugged(&s2, cfg(33)));
        // No loss: only 1-3 ms of delay without FIFO order, so the 16 response packets of a READ arrive
        // shuffled. The requester takes them in order up to the first one missing and asks again from there:
        // attempts that make progress give the READ its retries back (as rdma_rxe does). Before, a READ failed
        // with retry exceeded once its attempts in all passed `retry_count` (rping's 8-packet READs did through
        // wirefilter), and a late packet of the attempt before could throw away what was taken.
        let _wf = Filter::new(&s1, &s2, &["-d", "2+1", "-N"]);
        let p = RcParams::default();
        let (mut qa, _qb, mut a_cq, _b_cq) = rc_pair(&mut a, &mut b, None, p);
        let (ma, mb) = (a.mr(1 << 14), b.mr(1 << 14));
        const READS: usize = 12;
        const LEN: usize = 16000;
        for m in 0..READS {
            let data = pattern(LEN, m as u8);
            mb.write(0, &data);
            let w =
                Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(mb.addr(), mb.key).data(LEN as u32, ma.key, ma.addr());
            a.post_send(&mut qa, &w, Bell::Db);
            let e = a.wait_cqe(&mut a_cq).expect("READ CQE");
            assert_eq!((e.status(), e.byte_cnt()), ((consts::MLX5_CQE_REQ, 0), LEN as u32), "READ {m}");
            assert!(ma.read(0, LEN) == data, "READ {m}: every byte");
        }
        let r = crate::events::Recoveries::count(&a.h.dev.events(), 0);
        println!("wirefilter -N: {READS} READs of {LEN} B: {r}");
        // 192 response packets with 1-3 ms of jitter each: some arrive out of order for certain.
        assert!(r.retransmissions > 0, "the reordering made the requester ask again: {r}");
    }

    #[test]
    fn an_ib_port_that_leaves_and_comes_back_with_its_lid_is_its_holder_again() {
        let sw = Switch::new("ib-back");
        let (mut a, mut b) = (plugged(&sw, ib_cfg(0x601)), plugged(&sw, ib_cfg(0x602)));
        let (qa, qb, ca, cb) = rc_pair(&mut a, &mut b, None, RcParams::default());
        // B's side first: B sends to A.
        let mut r = (qb, qa, cb, ca);
        send_checked(&mut b, &mut a, &mut r, 2000, 1);
        // B leaves and plugs in again (a program that closes its device and opens it again): a new instance with
        // the same LID, which A has heard from before; its probe tells A who holds the LID now.
        assert!(b.h.dev.vde_unplug());
        b.h.dev.vde_plug_dir(&sw.0).expect("plugged in again");
        send_checked(&mut b, &mut a, &mut r, 2000, 2);
        let mut q = (r.1, r.0, r.3, r.2);
        send_checked(&mut a, &mut b, &mut q, 2000, 3);
        assert_eq!(a.h.dev.vde_counters().unwrap().lid_conflicts, 0);
    }

    #[test]
    fn ib_rc_through_wirefilter_loss_and_duplicates_delivers_every_message_once() {
        let (s1, s2) = (Switch::new("wf-ib-a"), Switch::new("wf-ib-b"));
        let (mut a, mut b) = (plugged(&s1, ib_cfg(0x501)), plugged(&s2, ib_cfg(0x502)));
        // 3 % loss, 2 % duplicates, 1-3 ms of delay without FIFO order (as the RoCE run: without a delay
        // wirefilter here held frames back for half a second at a time): a message of four fragments is lost
        // whole when one is, and sent again; its fragments may arrive in any order.
        let _wf = Filter::new(&s1, &s2, &["-l", "3", "-D", "2", "-d", "2+1", "-N"]);
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        const MSGS: usize = 40;
        for m in 0..MSGS {
            send_checked(&mut a, &mut b, &mut q, 5000, m as u8);
        }
        assert!(b.poll(&mut q.3).is_none(), "nothing delivered twice");
        assert_eq!(b.h.dev.qp_info(q.1.qpn).unwrap().rq_ci as usize, MSGS);
        let retries = a.h.dev.events().iter().filter(|e| matches!(e, SimEvent::Retry { .. })).count();
        let n = b.h.dev.vde_counters().unwrap();
        println!(
            "wirefilter, IB: {MSGS} messages of 5000 B: {retries} retries, {} given up half-way",
            n.rx_ib_incomplete
        );
        // About 5 frames a message cross the filter: some loss is certain (0.97^200 < 0.003).
        assert!(retries > 0, "the loss was recovered from");
        assert_eq!((n.rx_ib_malformed, n.lid_conflicts), (0, 0), "{n:?}");
    }

    #[test]
    fn pcap_records_every_frame_the_port_sends_and_receives_on_the_fabric() {
        use crate::wire::roce::ib::Opcode;
        let sw = Switch::new("pcap");
        let path = std::env::temp_dir().join(format!("mlx5-vde-{}-pcap.pcap", std::process::id()));
        let sink = crate::pcap::PcapSink::create(&path).unwrap();
        let mut a = plugged(&sw, SimConfig { pcap: Some(sink), ..cfg(32) });
        let mut b = plugged(&sw, cfg(33));
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 3000, 9);
        drop(q);
        drop(a);
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let ops: Vec<Opcode> = crate::pcap::read_frames(&bytes)
            .unwrap()
            .iter()
            .map(|(_, f)| match parse(f) {
                Ok(Parsed::Roce(r)) => r.bth.opcode,
                other => panic!("a frame that is not RoCE with a good ICRC: {other:?}"),
            })
            .collect();
        // The three packets A sent at the 1024-byte MTU, and B's ACK A received.
        assert_eq!(ops, [Opcode::RcSendFirst, Opcode::RcSendMiddle, Opcode::RcSendLast, Opcode::RcAck]);
    }

    #[test]
    fn pcap_records_an_ib_ports_frames_on_the_fabric() {
        let sw = Switch::new("ib-pcap");
        let path = std::env::temp_dir().join(format!("mlx5-vde-{}-ib.pcap", std::process::id()));
        let sink = crate::pcap::PcapSink::create(&path).unwrap();
        let mut a = plugged(&sw, SimConfig { pcap: Some(sink), ..ib_cfg(0x801) });
        let mut b = plugged(&sw, ib_cfg(0x802));
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 3000, 9);
        drop(q);
        drop(a);
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let frames: Vec<(u16, u16, u16)> = crate::pcap::read_frames(&bytes)
            .unwrap()
            .iter()
            .map(|(_, f)| {
                let r = super::super::vde_ib::parse(f).expect("an IB frame");
                (u16::from_be_bytes([f[12], f[13]]), r.slid, r.dlid)
            })
            .collect();
        // B's probes for its LID as it plugged in, the message's three fragments (3000 bytes and the encoding's
        // header) to B, and B's ACK.
        let (probe, to_b, to_a) =
            ((ETHERTYPE_IB, 0x802, 0x802), (ETHERTYPE_IB, 0x801, 0x802), (ETHERTYPE_IB, 0x802, 0x801));
        assert_eq!(frames, [probe, probe, probe, to_b, to_b, to_b, to_a]);
    }

    /// The link-local GID of a MAC (modified EUI-64).
    fn link_local(mac: [u8; 6]) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[..2].copy_from_slice(&[0xfe, 0x80]);
        g[8..].copy_from_slice(&[mac[0] ^ 2, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]]);
        g
    }

    #[test]
    fn ports_of_one_machine_go_past_the_switch_and_anything_else_through_it() {
        let sw = Switch::new("direct");
        let mut a = plugged(&sw, SimConfig { ipv4_addrs: &[[10, 9, 2, 1]], ..cfg(40) });
        let mut b = plugged(&sw, cfg(41));
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 3000, 11);
        // A's ACK arrives before B's sending thread has counted it (the count follows the send): wait for B's
        // count, a bounded time, before reading both.
        let end = Instant::now() + Duration::from_secs(5);
        while b.h.dev.vde_counters().unwrap().tx_frames == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        let (na, nb) = (a.h.dev.vde_counters().unwrap(), b.h.dev.vde_counters().unwrap());
        // A's three packets and B's ACK, each straight to the other's socket.
        assert_eq!((na.tx_direct, na.rx_direct, nb.tx_direct, nb.rx_direct), (3, 1, 1, 3), "{na:?} {nb:?}");
        // Nothing was queued for either writer, so the datapath's thread sent them itself, the three packets of
        // the message in one datagram (B's reader counts a frame per packet and took them in one go).
        assert_eq!((na.tx_direct_now, nb.tx_direct_now), (3, 1), "{na:?} {nb:?}");
        assert_eq!((na.tx_frames, nb.tx_frames), (3, 1));
        // A plug with no direct socket (a QEMU guest's NIC would be one) asks for A's address: the request is
        // a broadcast and A's answer goes to a MAC with no socket, so both cross the switch.
        let raw = Conn::open(&sw.url()).unwrap();
        let smac = [0x02, 0x77, 0, 0, 0, 1];
        let arp = ArpRepr {
            operation: Operation::Request,
            sender_mac: smac,
            sender_ip: [10, 9, 2, 9],
            target_mac: [0; 6],
            target_ip: [10, 9, 2, 1],
        };
        let mut buf = [0u8; 64];
        let n =
            emit_arp(&EthernetRepr { dst: BROADCAST, src: smac, ethertype: EtherType::Arp }, &arp, &mut buf).unwrap();
        assert_eq!(raw.send(&buf[..n]), n as isize);
        let mut got = vec![0u8; 2048];
        let (fd, _) = raw.fds();
        let reply = loop {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            assert_eq!(unsafe { libc::poll(&mut p, 1, 5000) }, 1, "A's ARP reply reached the plain plug");
            let len = raw.recv(&mut got);
            assert!(len > 0);
            if let Ok(Parsed::Arp(eth, r)) = parse(&got[..len as usize]) {
                if r.operation == Operation::Reply {
                    break (eth, r);
                }
            }
        };
        assert_eq!((reply.0.dst, reply.1.sender_mac, reply.1.sender_ip), (smac, cfg(40).mac, [10, 9, 2, 1]));
        // As above, the writer counts the reply after sending it.
        let end = Instant::now() + Duration::from_secs(5);
        while a.h.dev.vde_counters().unwrap().tx_frames < 4 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(1));
        }
        let na2 = a.h.dev.vde_counters().unwrap();
        assert_eq!((na2.tx_direct, na2.tx_frames), (3, 4), "the reply crossed the switch: {na2:?}");
        // A datagram on B's socket whose frames do not add up is counted and dropped; a well-formed one with a
        // runt in it reaches B's port, which drops and counts the runt.
        let poke = UnixDatagram::unbound().unwrap();
        let b_sock = Direct::socket(&sw.0, cfg(41).mac);
        let runts = b.h.dev.frame_drops().total();
        poke.send_to(&[0xff, 0xff, 1, 2, 3], &b_sock).unwrap();
        poke.send_to(&[0, 3, 1, 2, 3], &b_sock).unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while b.h.dev.frame_drops().total() == runts && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        let nb = b.h.dev.vde_counters().unwrap();
        assert_eq!(nb.rx_direct_malformed, 1, "{nb:?}");
        assert_eq!(b.h.dev.frame_drops().total(), runts + 1);
        // Each port's socket is in the switch's directory, and goes when the port leaves the fabric.
        let sock = Direct::socket(&sw.0, cfg(41).mac);
        assert!(sock.exists());
        assert!(b.h.dev.vde_unplug());
        assert!(!sock.exists(), "B's socket removed as it left");
    }

    #[test]
    fn a_peer_that_does_not_read_costs_one_bounded_wait_then_frames_go_through_the_switch() {
        let sw = Switch::new("stuck");
        let mut a = plugged(&sw, cfg(42));
        // A socket with a port's name that nobody reads (a process stopped in a debugger): its queue fills.
        let mac = [0x02, 0x66, 0, 0, 0, 2];
        let stuck = UnixDatagram::bind(Direct::socket(&sw.0, mac)).unwrap();
        let mut ac = a.cq(6);
        let mut ua = a.qp(QpSpec::ud(), ac.cqn, ac.cqn);
        a.ready_ud(&ua, 0x55);
        let ma = a.mr(4096);
        let av = TAv { dqpn: 0x99, qkey: 0x55, grh: true, hop_limit: 1, rgid: link_local(mac), ..TAv::default() };
        const SENT: u64 = 40;
        let start = Instant::now();
        let link = a.h.dev.vde_link_for_test();
        for _ in 0..SENT {
            a.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(100, ma.key, ma.addr()), Bell::Db);
            assert_eq!(a.wait_cqe(&mut ac).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
            // Each frame out before the next, so each is a datagram of its own (frames queued together would
            // share one).
            assert!(link.drain(Duration::from_secs(5)));
        }
        assert!(link.drain(Duration::from_secs(5)), "every frame left the writer");
        let n = a.h.dev.vde_counters().unwrap();
        // The socket's queue took some datagrams; the next waited DIRECT_SEND_TIMEOUT and its frame was dropped;
        // the rest went to the switch (which floods them to nobody).
        assert_eq!(n.tx_direct_timeout, 1, "{n:?}");
        assert!(n.tx_direct > 0 && n.tx_direct < SENT, "{n:?}");
        assert_eq!(n.tx_frames + n.tx_direct_timeout, SENT, "{n:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
        drop(stuck);
    }

    #[test]
    fn a_socket_left_behind_by_a_port_that_ended_is_swept() {
        let sw = Switch::new("stale");
        let a = plugged(&sw, cfg(43));
        // A socket file nobody is bound to any more (its process was killed), one with A's own MAC among them.
        let stale = [Direct::socket(&sw.0, [0x02, 0x55, 0, 0, 0, 1]), Direct::socket(&sw.0, cfg(44).mac)];
        for p in &stale {
            drop(UnixDatagram::bind(p).unwrap());
            assert!(p.exists());
        }
        let mut b = plugged(&sw, cfg(44));
        assert!(!stale[0].exists(), "swept");
        assert!(b.h.dev.vde_link_for_test().direct.is_some(), "B took its name over");
        let mut a = a;
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 2000, 12);
        assert!(a.h.dev.vde_counters().unwrap().tx_direct > 0);
    }

    #[test]
    fn ports_that_find_no_switch_at_once_start_one_and_all_plug_into_it() {
        let sw = Switch::new("race");
        let devs: Vec<SimDevice> = (0..6).map(|i| SimDevice::new(cfg(50 + i))).collect();
        let results: Vec<Result<(), VdeError>> = std::thread::scope(|s| {
            let joins: Vec<_> = devs.iter().map(|d| s.spawn(|| d.vde_plug_dir(&sw.0))).collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for r in &results {
            assert!(r.is_ok(), "{r:?}");
        }
        assert!(devs.iter().all(SimDevice::vde_plugged));
    }

    /// An InfiniBand port with LID `lid`.
    fn ib_cfg(lid: u16) -> SimConfig {
        SimConfig {
            port_type: crate::config::PortType::Ib,
            lid,
            node_guid: 0x6000 + u64::from(lid),
            mode: Mode::Threaded,
            ..SimConfig::default()
        }
    }

    /// A UD datagram of `msg` from `a` to `b` by LID; checks the receive's length, sender and bytes.
    fn ud_by_lid(a: &mut Rdma, b: &mut Rdma, msg: &[u8]) {
        let (mut ac, mut bc) = (a.cq(4), b.cq(4));
        let (mut ua, mut ub) = (a.qp(QpSpec::ud(), ac.cqn, ac.cqn), b.qp(QpSpec::ud(), bc.cqn, bc.cqn));
        a.ready_ud(&ua, 0x66);
        b.ready_ud(&ub, 0x66);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, msg);
        b.post_recv(&mut ub, &[(mb.addr(), 4096, mb.key)]);
        let av = TAv { dqpn: ub.qpn, qkey: 0x66, rlid: b.h.dev.lid(), sl: 2, ..TAv::default() };
        a.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(msg.len() as u32, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut ac).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.wait_cqe(&mut bc).expect("UD receive CQE");
        // No GRH: the SL in bits 27:24 and the sender's LID, as on an IB link.
        assert_eq!((e.byte_cnt(), e.flags_rqpn(), e.slid()), (40 + msg.len() as u32, ua.qpn | 2 << 24, a.h.dev.lid()));
        assert!(mb.read(40, msg.len()) == msg, "every byte");
    }

    #[test]
    fn two_ib_ports_on_one_switch_exchange_rc_and_ud_by_lid() {
        let sw = Switch::new("ib");
        let (mut a, mut b) = (plugged(&sw, ib_cfg(0x101)), plugged(&sw, ib_cfg(0x102)));
        // RC both ways: a message of one frame, and one of several fragments.
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 100, 1);
        send_checked(&mut a, &mut b, &mut q, 10_000, 2);
        send_checked(&mut b, &mut a, &mut (q.1, q.0, q.3, q.2), 5000, 3);
        ud_by_lid(&mut a, &mut b, b"by LID over VDE");
        ud_by_lid(&mut b, &mut a, &pattern(3000, 4));
        for r in [&a, &b] {
            let n = r.h.dev.vde_counters().unwrap();
            // Frames of the port's own link layer only, each well formed, and past the switch (the direct path
            // finds the LID's MAC).
            assert!(n.tx_direct > 0 && n.rx_frames > 0, "{n:?}");
            assert_eq!((n.rx_ib_malformed, n.lid_conflicts, n.rx_ib_incomplete, n.rx_other_link_layer), (0, 0, 0, 0));
            assert_eq!(r.h.dev.frame_drops().total(), 0);
        }
        // Each port is at its LID's MAC.
        assert_eq!(a.h.dev.vde_link_for_test().mine, lid_mac(0x101));
    }

    #[test]
    fn ib_and_roce_ports_on_one_switch_do_not_take_each_others_frames() {
        let sw = Switch::new("mixed");
        let (mut ea, mut eb) = (plugged(&sw, cfg(60)), plugged(&sw, cfg(61)));
        // The IB ports' LID probes are broadcasts the Ethernet ports see.
        let (mut ia, mut ib) = (plugged(&sw, ib_cfg(0x201)), plugged(&sw, ib_cfg(0x202)));
        // An ARP broadcast (what an Ethernet port sends to resolve an IPv4 GID) reaches the IB ports.
        let raw = Conn::open(&sw.url()).unwrap();
        let smac = [0x02, 0x77, 0, 0, 0, 2];
        let arp = ArpRepr {
            operation: Operation::Request,
            sender_mac: smac,
            sender_ip: [10, 9, 3, 9],
            target_mac: [0; 6],
            target_ip: [10, 9, 3, 1],
        };
        let mut buf = [0u8; 64];
        let n =
            emit_arp(&EthernetRepr { dst: BROADCAST, src: smac, ethertype: EtherType::Arp }, &arp, &mut buf).unwrap();
        assert_eq!(raw.send(&buf[..n]), n as isize);
        let mut qe = rc_pair(&mut ea, &mut eb, None, RcParams::default());
        let mut qi = rc_pair(&mut ia, &mut ib, None, RcParams::default());
        send_checked(&mut ea, &mut eb, &mut qe, 3000, 5);
        send_checked(&mut ia, &mut ib, &mut qi, 3000, 6);
        ud_by_lid(&mut ib, &mut ia, b"IB beside RoCE");
        let end = Instant::now() + Duration::from_secs(5);
        while ia.h.dev.vde_counters().unwrap().rx_other_link_layer == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        for r in [&ea, &eb, &ia, &ib] {
            let n = r.h.dev.vde_counters().unwrap();
            // Each saw a broadcast of the other link layer and dropped it before its port.
            assert!(n.rx_other_link_layer > 0, "{n:?}");
            assert_eq!((n.rx_ib_malformed, n.lid_conflicts), (0, 0), "{n:?}");
            assert_eq!(r.h.dev.frame_drops().total(), 0);
        }
        // No IB frame reached an Ethernet port's receive side, nor an Ethernet frame an IB port's.
        for r in [&ea, &eb, &ia, &ib] {
            assert!(!r.h.dev.events().iter().any(|e| matches!(e, SimEvent::FrameDropped { .. })));
        }
    }

    /// Waits until `r`'s VDE counters satisfy `f`.
    fn counted(r: &Rdma, f: impl Fn(&VdeCounters) -> bool) -> VdeCounters {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let n = r.h.dev.vde_counters().unwrap();
            if f(&n) || Instant::now() >= end {
                return n;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn malformed_ib_frames_are_dropped_and_counted_and_the_port_goes_on() {
        use super::super::vde_ib::{emit, Ident};
        let sw = Switch::new("ib-bad");
        let (mut a, mut b) = (plugged(&sw, ib_cfg(0x301)), plugged(&sw, ib_cfg(0x302)));
        let raw = Conn::open(&sw.url()).unwrap();
        let (to, from) = (lid_mac(0x302), [0x02, 0x77, 0, 0, 0, 3]);
        let me = Ident { lid: 0x303, guid: 0x77, instance: 0x77 };
        let good = emit(to, from, Kind::Data, 0, 0x302, &me, 1, 0, 5, b"hello");
        let mut bad: Vec<Vec<u8>> = Vec::new();
        // A runt with the IB ethertype.
        bad.push(good[..20].to_vec());
        // LNH 2 (an IBA transport header: not what the fabric carries).
        let mut lnh = good.clone();
        lnh[15] |= 2;
        bad.push(lnh);
        // A fragment beyond its message's end.
        bad.push(emit(to, from, Kind::Data, 0, 0x302, &me, 2, 2 * IB_FRAGMENT, 100, &[]));
        // Well framed, but the packet encoding is garbage.
        bad.push(good);
        // A frame for another LID behind B's MAC.
        bad.push(emit(to, from, Kind::Data, 0, 0x305, &me, 3, 0, 5, b"hello"));
        for f in &bad {
            assert_eq!(raw.send(f), f.len() as isize);
        }
        let n = counted(&b, |n| n.rx_ib_malformed >= bad.len() as u64);
        assert_eq!(n.rx_ib_malformed, bad.len() as u64, "{n:?}");
        assert!(b.h.dev.events().iter().any(|e| matches!(e, SimEvent::FrameDropped { .. })));
        // Half a message (its second fragment never comes) is given up once newer ones need the room.
        for m in 0..=MAX_PARTIAL as u32 {
            let f = emit(to, from, Kind::Data, 0, 0x302, &me, 100 + m, 0, 2 * IB_FRAGMENT, &[0; IB_FRAGMENT]);
            assert_eq!(raw.send(&f), f.len() as isize);
        }
        assert_eq!(counted(&b, |n| n.rx_ib_incomplete > 0).rx_ib_incomplete, 1);
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 4000, 7);
    }

    #[test]
    fn a_lid_already_on_the_fabric_is_refused_and_its_frames_from_another_port_dropped() {
        use super::super::vde_ib::{emit, Ident};
        let sw = Switch::new("ib-lid");
        let (mut a, mut b) = (plugged(&sw, ib_cfg(0x401)), plugged(&sw, ib_cfg(0x402)));
        // Another port with A's LID (another GUID), and one with A's very configuration (another process with
        // the same host=N): both refused, named by the holder's GUID.
        for c in [SimConfig { node_guid: 0x9999, ..ib_cfg(0x401) }, ib_cfg(0x401)] {
            let err = SimDevice::new(c).vde_plug_dir(&sw.0).unwrap_err();
            assert!(matches!(err, VdeError::LidInUse { lid: 0x401, guid: 0x6401 }), "{err}");
        }
        assert!(counted(&a, |n| n.lid_conflicts >= 2).lid_conflicts >= 2);
        // A port that got onto the fabric with A's LID anyway (its probe lost): its frames to B are dropped by B,
        // not taken as A's.
        let raw = Conn::open(&sw.url()).unwrap();
        let twin = Ident { lid: 0x401, guid: 0x9999, instance: 0x5 };
        let f = emit(lid_mac(0x402), [0x02, 0x77, 0, 0, 0, 4], Kind::Data, 0, 0x402, &twin, 1, 0, 5, b"hello");
        assert_eq!(raw.send(&f), f.len() as isize);
        let n = counted(&b, |n| n.lid_conflicts > 0);
        assert_eq!((n.lid_conflicts, n.rx_ib_malformed), (1, 0), "{n:?}");
        assert!(b.h.dev.events().contains(&SimEvent::FrameDropped { why: LID_CONFLICT }));
        // A and B still work; a LID that is nobody's is refused before any probe.
        let mut q = rc_pair(&mut a, &mut b, None, RcParams::default());
        send_checked(&mut a, &mut b, &mut q, 2000, 8);
        let err = SimDevice::new(ib_cfg(0xc001)).vde_plug_dir(&sw.0).unwrap_err();
        assert!(matches!(err, VdeError::BadLid { lid: 0xc001 }), "{err}");
    }

    #[test]
    fn a_bad_url_is_a_clear_error() {
        let dev = SimDevice::new(cfg(13));
        let err = dev.vde_plug(Some("vde:///nonexistent/mlx5-no-switch")).unwrap_err();
        assert!(matches!(err, VdeError::Open { .. }), "{err}");
        assert!(matches!(dev.vde_plug(Some("vde://a\0b")).unwrap_err(), VdeError::BadUrl { .. }));
    }
}

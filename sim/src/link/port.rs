//! What the links share: a packet's ends ([`DevRef`], [`Port`]), port addresses, the wire state of one device
//! ([`Wire`]: routing, peers, capture), [`Station`] (what a link reports to, implemented by the device layer),
//! and the fabric link a [`Port`] may hold (its threads and framing are `vde.rs`; over a point-to-point stream,
//! its [`Cable`] side is `tcp.rs` and `guest.rs`).

use std::any::Any;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};
use std::sync::{Arc, Weak};

use crate::config::{PortType, SimConfig};
use crate::events::SimEvent;
use crate::wire::roce::frame::mapped;
use crate::wire::{self, roce_map, Dest, GID_ENTRIES, GID_LEN, PERMISSIVE_LID};

use crate::pcap::PcapSink;
use crate::wire::roce::frame::DropCounters;

/// A packet between two devices, each named by its [`DevRef`].
pub(crate) type Packet = wire::Packet<DevRef>;

/// Device ids are unique in the process, so a packet can tell loopback from the wire.
static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) fn next_device_id() -> u64 {
    NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed)
}

/// How long a device going away waits for its link's writer to put what is queued on the socket.
pub(crate) const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Frames a link's writer thread was given and those it wrote, so a device that goes away can let the last ones
/// out first: the ACK of a peer's final message is often queued at that moment, and a peer that never gets it
/// retransmits to nobody (rdma_rxe forever, as it reads retry_cnt 7 as unlimited).
#[derive(Debug, Default)]
pub(crate) struct TxCount {
    queued: AtomicU64,
    written: AtomicU64,
    /// Frames the writer took from the queue (a frame it is writing no longer waits, though it may not be flushed
    /// yet, and its answer can come back and let the next frame in before the writer counts it written).
    taken: AtomicU64,
    /// The most frames queued and not yet taken by the writer at once (the backlog a slow link builds).
    peak: AtomicU64,
}

impl TxCount {
    /// One frame handed to the writer.
    pub(crate) fn queued(&self) {
        let queued = self.queued.fetch_add(1, Ordering::AcqRel) + 1;
        let backlog = queued.saturating_sub(self.taken.load(Ordering::Acquire));
        self.peak.fetch_max(backlog, Ordering::AcqRel);
    }

    /// One frame taken from the queue by the writer.
    pub(crate) fn taken(&self) {
        self.taken.fetch_add(1, Ordering::AcqRel);
    }

    /// The most frames that waited for the writer at once.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// `n` frames written and flushed to the socket.
    pub(crate) fn written(&self, n: u64) {
        self.written.fetch_add(n, Ordering::AcqRel);
    }

    /// Whether the writer wrote everything queued (nothing waits for it).
    pub(crate) fn idle(&self) -> bool {
        self.written.load(Ordering::Acquire) >= self.queued.load(Ordering::Acquire)
    }

    /// Waits until the writer wrote everything queued, the link went down (`up` false) or `timeout` passed.
    /// Returns whether everything was written.
    pub(crate) fn drain(&self, up: impl Fn() -> bool, timeout: std::time::Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        loop {
            if self.written.load(Ordering::Acquire) >= self.queued.load(Ordering::Acquire) {
                return true;
            }
            if !up() || std::time::Instant::now() >= end {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// The device a link is plugged into, as the link sees it: the device layer implements it (`device/station.rs`),
/// so a link carries frames and reports what happened without locking a device or running its datapath.
pub(crate) trait Station: Send + Sync + 'static {
    /// Runs `f` on the device's wire state and event log under the device lock. When `f` returns `Some(up)`,
    /// the port's link then goes up or down under the same lock (firmware posts the PORT_CHANGE).
    fn with_wire<R>(&self, f: impl FnOnce(&mut Wire, &mut Vec<SimEvent>) -> (R, Option<bool>)) -> R;
    /// An Ethernet frame from `src` arrived: the device takes it; returns a frame to answer on the link (ARP).
    fn receive_frame(&self, frame: &[u8], src: &DevRef) -> Option<Vec<u8>>;
    /// A packet arrived: the device takes it as addressed to itself.
    fn receive_packet(&self, p: Packet);
    /// The device runs its datapath and hands on what it produced (after a delivery).
    fn run(self: &Arc<Self>);
}

/// Runs `f` on the wire state of `station`'s device.
pub(crate) fn wire<R>(station: &impl Station, f: impl FnOnce(&mut Wire) -> R) -> R {
    station.with_wire(|w, _| (f(w), None))
}

/// Logs `e` on the device of `station`.
pub(crate) fn log(station: &impl Station, e: SimEvent) {
    station.with_wire(|_, events| {
        events.push(e);
        ((), None)
    })
}

/// Where a device on the wire is: in this process (a handle that does not keep it alive), or at the far end of
/// a link to another process.
#[derive(Debug, Clone)]
pub(crate) enum Port {
    /// A device of this process, as the device layer hands it over: a link only holds it and compares it.
    Local(Weak<dyn Any + Send + Sync>),
    /// The fabric (`vde.rs`), on a VDE switch or a point-to-point stream (another process over TCP, a QEMU
    /// guest's NIC): RoCEv2 frames to any number of ports, or from an InfiniBand port IB frames to the port with
    /// the LID given (the destination of a packet, the source of one received; 0 on Ethernet).
    Vde(Arc<VdeLink>, u16),
}

/// A device on the wire: its id and where it is.
#[derive(Debug, Clone)]
pub(crate) struct DevRef {
    pub(crate) id: u64,
    pub(crate) port: Port,
}

pub(crate) use crate::wire::is_unicast_lid;

/// The address of port 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PortAddr {
    pub(crate) ib: bool,
    /// The port LID (IB; 0 on Ethernet).
    pub(crate) lid: u16,
    /// GID index 0.
    pub(crate) gid: [u8; GID_LEN],
    pub(crate) mac: [u8; 6],
}

/// The IPv6 link-local prefix fe80::/64, the subnet prefix of GID index 0.
const LINK_LOCAL: [u8; 8] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0];

impl PortAddr {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        let ib = cfg.port_type == PortType::Ib;
        let mut gid = [0u8; GID_LEN];
        gid[..8].copy_from_slice(&LINK_LOCAL);
        if ib {
            // The default GID: subnet prefix + port GUID (the simulator's port GUID is the node GUID).
            gid[8..].copy_from_slice(&cfg.node_guid.to_be_bytes());
        } else {
            // The link-local IPv6 address of the MAC (modified EUI-64: U/L bit flipped, ff:fe in the middle).
            let m = cfg.mac;
            gid[8..].copy_from_slice(&[m[0] ^ 0x02, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]]);
        }
        // A port that waits for a subnet manager has no LID until the SM's Set(PortInfo) (`Wire::set_lid`).
        Self { ib, lid: if ib && !cfg.subnet_manager { cfg.lid } else { 0 }, gid, mac: cfg.mac }
    }

    /// GID table entry `index` (only index 0 is populated).
    pub(crate) fn gid(&self, index: u32) -> Option<[u8; GID_LEN]> {
        (index < GID_ENTRIES).then_some(self.gid)
    }

    fn matches(&self, d: &Dest) -> bool {
        match *d {
            Dest::Lid(lid) => self.ib && lid != 0 && lid == self.lid,
            // By MAC: which of its GIDs the packet names is the receiving port's to check.
            Dest::Gid { mac, .. } => !self.ib && mac == self.mac,
        }
    }
}

/// A device joined by the wire, with its address (fixed by its configuration).
#[derive(Debug)]
struct Peer {
    dev: DevRef,
    addr: PortAddr,
    /// Every destination this port does not own goes to this peer (a guest NIC, whose addresses are not known).
    default: bool,
    /// A device of this process: its LID as its SMA now has it (a subnet manager assigns LIDs after the cable
    /// is plugged in), read instead of `addr.lid`.
    lid: Option<Arc<AtomicU16>>,
}

impl Peer {
    fn matches(&self, d: &Dest) -> bool {
        match (&self.lid, *d) {
            (Some(cell), Dest::Lid(lid)) => self.addr.ib && lid != 0 && lid == cell.load(Ordering::Relaxed),
            _ => self.addr.matches(d),
        }
    }
}

/// A device's side of the wire: its own address, its peers, and the packets waiting to be handled or carried.
#[derive(Debug)]
pub(crate) struct Wire {
    pub(crate) me: DevRef,
    pub(crate) addr: PortAddr,
    /// `addr.lid` as the devices plugged into this one read it ([`Wire::set_lid`]).
    lid_cell: Arc<AtomicU16>,
    peers: Vec<Peer>,
    /// Packets for this device (loopback, or delivered by the pump).
    pub(crate) inbox: VecDeque<Packet>,
    /// Packets for other devices, for the pump.
    pub(crate) outbox: Vec<Packet>,
    /// Where the port records its frames (`SimConfig::pcap`).
    pub(crate) pcap: Option<PcapSink>,
    /// `SimConfig::pcap` whatever the link layer: an InfiniBand port's VDE link records its frames there.
    pub(crate) ib_pcap: Option<PcapSink>,
    /// Frames from links that failed a check, and those that passed.
    pub(crate) drops: DropCounters,
    pub(crate) frames_in: u64,
    /// The port's IP addresses (`SimConfig::ipv4_addrs`, `ipv6_addrs`), from which a driver builds its GID table.
    ipv4: &'static [[u8; 4]],
    ipv6: &'static [[u8; GID_LEN]],
}

impl Wire {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        Self {
            me: DevRef { id: next_device_id(), port: Port::Local(Weak::<()>::new()) },
            addr: PortAddr::new(cfg),
            lid_cell: Arc::new(AtomicU16::new(PortAddr::new(cfg).lid)),
            peers: Vec::new(),
            inbox: VecDeque::new(),
            outbox: Vec::new(),
            // An InfiniBand port's packets have no Ethernet form to record; on a VDE fabric its link records
            // the frames it sends and takes (`ib_pcap`).
            pcap: if cfg.port_type == PortType::Eth { cfg.pcap.clone() } else { None },
            ib_pcap: if cfg.port_type == PortType::Ib { cfg.pcap.clone() } else { None },
            drops: DropCounters::default(),
            frames_in: 0,
            ipv4: cfg.ipv4_addrs,
            ipv6: cfg.ipv6_addrs,
        }
    }

    /// The port's IPv4 addresses (`SimConfig::ipv4_addrs`).
    pub(crate) fn ipv4(&self) -> &'static [[u8; 4]] {
        self.ipv4
    }

    /// Whether `gid` is an address of this port: its link-local GID or one of its IP addresses (IPv4-mapped).
    pub(crate) fn owns(&self, gid: &[u8; GID_LEN]) -> bool {
        *gid == self.addr.gid || self.ipv4.iter().any(|a| mapped(*a) == *gid) || self.ipv6.contains(gid)
    }

    /// The MAC of the port a device is plugged in with (this port's own for loopback).
    pub(crate) fn mac_of(&self, id: u64) -> [u8; 6] {
        if id == self.me.id {
            return self.addr.mac;
        }
        match self.peers.iter().find(|p| p.dev.id == id) {
            Some(Peer { dev: DevRef { port: Port::Vde(..), .. }, .. }) => [0xff; 6],
            Some(p) => p.addr.mac,
            None => [0; 6],
        }
    }

    /// Records a frame as it is.
    #[cold]
    pub(crate) fn capture_raw(&self, frame: &[u8]) {
        if let Some(sink) = &self.pcap {
            sink.record(|_, out| out(frame));
        }
    }

    /// Records the frames of a packet this port sends (or receives, when `received`) in its capture, if any. A
    /// packet with no frame form (the simulator's "lost" marker) is not recorded.
    #[cold]
    pub(crate) fn capture(&self, p: &Packet, received: bool) {
        let Some(sink) = &self.pcap else { return };
        let (src, dst) =
            if received { (self.mac_of(p.src.id), self.addr.mac) } else { (self.addr.mac, self.mac_of(p.dst.id)) };
        sink.record(|buf, out| {
            let _ = roce_map::emit_frames(p, src, dst, buf, out);
        });
    }

    /// This device as the address of a packet that stays in it (loopback). Its handle is empty, so cloning and
    /// dropping it moves no reference count; [`Wire::send`] gives a packet that leaves the real handle instead.
    pub(crate) fn me_here(&self) -> DevRef {
        DevRef { id: self.me.id, port: Port::Local(Weak::<()>::new()) }
    }

    /// Where a multicast packet goes: this port (its QPs attached to the group) and every peer, which each
    /// deliver to their own members.
    pub(crate) fn route_multicast(&self) -> Vec<DevRef> {
        std::iter::once(self.me_here()).chain(self.peers.iter().map(|p| p.dev.clone())).collect()
    }

    /// The device a destination address names.
    #[inline]
    pub(crate) fn route(&self, d: &Dest) -> Result<DevRef, &'static str> {
        // Loopback: the sender is the receiving port and checks the GID itself.
        if self.addr.matches(d) && !matches!(d, Dest::Gid { gid, .. } if !self.owns(gid)) {
            return Ok(self.me_here());
        }
        if let Some(p) = self.peers.iter().find(|p| p.matches(d)) {
            return Ok(p.dev.clone());
        }
        if self.addr.ib && *d == Dest::Lid(PERMISSIVE_LID) {
            // A cable has one other end; with several peers and no switch modelled there is no "next hop".
            return match self.peers.as_slice() {
                // On a VDE cable the frames go to the permissive LID's MAC: the switch or port at its far end.
                [p] => match &p.dev.port {
                    Port::Vde(l, _) => Ok(DevRef { id: p.dev.id, port: Port::Vde(l.clone(), PERMISSIVE_LID) }),
                    _ => Ok(p.dev.clone()),
                },
                [] => Err("unknown destination (not connected)"),
                _ => Err("a permissive LID needs a single link partner"),
            };
        }
        if let Some(p) = self.peers.iter().find(|p| p.default) {
            match (&p.dev.port, *d) {
                // On a VDE fabric an IB port reaches any unicast LID; the link frames the packet for it.
                (Port::Vde(l, _), Dest::Lid(lid)) if self.addr.ib && is_unicast_lid(lid) => {
                    return Ok(DevRef { id: p.dev.id, port: Port::Vde(l.clone(), lid) });
                }
                _ if !self.addr.ib => return Ok(p.dev.clone()),
                _ => {}
            }
        }
        // A known GID behind another MAC: the frame goes to a port that does not own the GID.
        let gid_known = |a: &PortAddr| matches!(d, Dest::Gid { gid, .. } if !a.ib && *gid == a.gid);
        if gid_known(&self.addr) || self.peers.iter().any(|p| gid_known(&p.addr)) {
            return Err("destination MAC is not the GID's port");
        }
        Err(if self.peers.is_empty() { "unknown destination (not connected)" } else { "unknown destination" })
    }

    /// Where an Ethernet frame for `mac` goes: this port (its own MAC), the peer with that MAC, or for a
    /// broadcast or multicast MAC every peer; a guest or VDE cable takes what no known port owns.
    pub(crate) fn route_mac(&self, mac: [u8; 6]) -> Vec<DevRef> {
        if mac[0] & 1 != 0 {
            return self.peers.iter().map(|p| p.dev.clone()).collect();
        }
        if mac == self.addr.mac {
            return vec![self.me_here()];
        }
        let p = self.peers.iter().find(|p| !p.addr.ib && p.addr.mac == mac).or(self.peers.iter().find(|p| p.default));
        p.map(|p| vec![p.dev.clone()]).unwrap_or_default()
    }

    /// Queues a packet: into the own inbox (loopback) or out for the pump. In line, so the packet (a few hundred
    /// bytes) is copied once, into the queue, rather than again on the way in.
    #[inline]
    pub(crate) fn send(&mut self, mut p: Packet) {
        // A fabric link records the frames it writes itself (they depend on what ARP resolved).
        if self.pcap.is_some() && !matches!(p.dst.port, Port::Vde(..)) {
            self.capture(&p, false);
        }
        if p.dst.id == self.me.id {
            self.inbox.push_back(p);
        } else {
            // The response to a packet that leaves must find its way back: its source is the real handle.
            if p.src.id == self.me.id {
                p.src = self.me.clone();
            }
            self.outbox.push(p);
        }
    }

    /// Adds a device of this process as a peer, its LID read live from `lid`.
    pub(crate) fn add_local_peer(&mut self, dev: DevRef, addr: PortAddr, lid: Arc<AtomicU16>) {
        if dev.id != self.me.id && !self.peers.iter().any(|p| p.dev.id == dev.id) {
            self.peers.push(Peer { dev, addr, default: false, lid: Some(lid) });
        }
    }

    /// The port's LID changed (a subnet manager's Set(PortInfo)): its packets carry it as their SLID and the
    /// devices plugged into it route to it from now on.
    pub(crate) fn set_lid(&mut self, lid: u16) {
        self.addr.lid = lid;
        self.lid_cell.store(lid, Ordering::Relaxed);
        // An InfiniBand port's fabric link sends from it from now on.
        if let Some(l) = self.vde_link() {
            l.set_lid(lid);
        }
    }

    /// The cell [`set_lid`](Self::set_lid) keeps current, for [`add_local_peer`](Self::add_local_peer).
    pub(crate) fn lid_cell(&self) -> Arc<AtomicU16> {
        Arc::clone(&self.lid_cell)
    }

    /// Plugs a fabric link in (a VDE switch or a point-to-point stream), replacing the cable plugged in before:
    /// every destination the port does not own goes out on it.
    pub(crate) fn plug_vde(&mut self, dev: DevRef) {
        self.peers.retain(|p| !p.default);
        let addr = PortAddr { ib: false, lid: 0, gid: [0; GID_LEN], mac: [0; 6] };
        self.peers.push(Peer { dev, addr, default: true, lid: None });
    }

    /// The fabric link plugged in, if any.
    pub(crate) fn vde_link(&self) -> Option<Arc<VdeLink>> {
        self.peers.iter().find_map(|p| match &p.dev.port {
            Port::Vde(l, _) => Some(l.clone()),
            _ => None,
        })
    }

    /// The fabric link over a TCP stream to another process (`tcp.rs`), if one is plugged in.
    pub(crate) fn remote_link(&self) -> Option<Arc<VdeLink>> {
        self.vde_link().filter(|l| l.cable.as_ref().is_some_and(|c| c.peer.is_some()))
    }

    /// The fabric link over a UNIX stream to a guest NIC (`guest.rs`), if one is plugged in.
    pub(crate) fn guest_link(&self) -> Option<Arc<VdeLink>> {
        self.vde_link().filter(|l| l.cable.as_ref().is_some_and(|c| c.peer.is_none()))
    }

    /// Unplugs the link `id` (its far end went away).
    pub(crate) fn unplug_remote(&mut self, id: u64) {
        self.peers.retain(|p| p.dev.id != id);
    }
}

impl Drop for Wire {
    /// A device that goes away unplugs its link once what it queued is on the socket: the far end gets those
    /// frames, then sees the connection close.
    fn drop(&mut self) {
        if let Some(l) = self.vde_link() {
            l.drain(DRAIN_TIMEOUT);
            l.close();
        }
    }
}

/// A fabric link's point-to-point side (`tcp.rs`, `guest.rs`): who is at the other end of the stream, and the
/// faults tests inject on it.
#[derive(Debug, Default)]
pub(crate) struct Cable {
    /// The TCP peer (`None`: a UNIX socket, a QEMU guest's NIC).
    pub(crate) peer: Option<SocketAddr>,
    /// The far end said hello (`tcp.rs`): a listener keeps such a peer and turns newcomers away.
    pub(crate) heard: AtomicBool,
    /// The far end's hello named this port's own address: the link was taken down.
    pub(crate) same_address: AtomicBool,
    /// RoCE frames sent so far, and the one (1-based) to drop on purpose (0: none), for lost-frame tests.
    pub(crate) sent: AtomicU64,
    pub(crate) drop_nth: AtomicU64,
    /// The same for RoCE frames received.
    pub(crate) received: AtomicU64,
    pub(crate) drop_in_nth: AtomicU64,
    /// Frames the writer puts on the stream per millisecond at most (0: as fast as it can): a slow cable, for
    /// tests of messages that take the link longer than the ACK timeout.
    pub(crate) pace: AtomicU64,
}

/// The link to the fabric (`vde.rs`): one frame connection (libvdeplug's, or a point-to-point stream's), any
/// number of far ends.
#[derive(Debug)]
pub(crate) struct VdeLink {
    /// The fabric's id on this side's wire.
    pub(crate) id: u64,
    pub(crate) conn: Box<dyn Datagrams>,
    /// The port's own socket for frames from ports of this machine on the same switch, past the switch
    /// (`vde.rs`: the direct path); `None` when the URL names no switch directory.
    pub(crate) direct: Option<super::direct::Direct>,
    /// Frames for the writer thread (bounded: a full queue drops).
    pub(crate) tx: mpsc::SyncSender<Vec<u8>>,
    pub(crate) up: AtomicBool,
    pub(crate) mine: [u8; 6],
    /// The port's first IPv4 address, the sender of the ARP requests `vde::resolve` makes.
    pub(crate) ipv4: Option<[u8; 4]>,
    /// Where the frames this link writes are recorded (the port's capture).
    pub(crate) pcap: Option<PcapSink>,
    /// IPv4 neighbours learned from ARP on the fabric, oldest first.
    pub(crate) neighbours: Mutex<Vec<([u8; 4], [u8; 6])>>,
    /// What `vde.rs` counts (`VdeCounters`).
    pub(crate) counters: [AtomicU64; VDE_COUNTERS],
    /// An InfiniBand port's side of the link (its LID, GUID, reassembly); `None` on Ethernet.
    pub(crate) ib: Option<super::vde_ib::IbSide>,
    /// Frames given to the writer thread and written.
    pub(crate) count: TxCount,
    /// On a point-to-point stream (TCP, a guest's UNIX socket): its side; `None` on a VDE switch.
    pub(crate) cable: Option<Cable>,
}

/// How many counters a VDE link keeps (`vde.rs` names them).
pub(crate) const VDE_COUNTERS: usize = 16;

pub(crate) use super::datagrams::Datagrams;

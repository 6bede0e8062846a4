//! The device list (`ibv_get_device_list`, `ibv_get_device_name`, `ibv_get_device_guid`) and opening a device
//! (`ibv_open_device`).
//!
//! A process's devices are its simulated ConnectX devices, in the order configured, then every PCI function
//! given by address or found bound to vfio-pci with the Mellanox vendor id (0x15b3), in address order; they are
//! named `mlx5_0`, `mlx5_1`, ... in that order. The configuration is the environment variable `MLX5_RS_DEVICES`,
//! a comma list of specs (see [`DeviceSpec`]); unset, it is `sim,vfio`. Listing reads sysfs only: no device is
//! brought up, no command is sent.
//!
//! Opening a device that is already open in this process shares its HCA: every [`Context`] and object holds it,
//! and it is torn down when the last of them goes (rdma-core's tests open server and client as two contexts on
//! one device).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, Weak};

use mlx5_core::hca::{Config, Hca};
#[cfg(feature = "sim")]
use mlx5_sim::{Mode, PortType, SimConfig, SimDevice};
use mlx5_vfio::{Bdf, Vfio, VfioOptions};

use crate::backend::{DeviceKind, MaybeTrace, Tracer};
use crate::context::Context;
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::shared::{DeviceShared, UpGate};

/// The PCI vendor id of Mellanox / NVIDIA networking.
pub const MELLANOX_VENDOR_ID: u16 = 0x15b3;

/// The environment variable naming the process's devices.
pub const DEVICES_ENV: &str = "MLX5_RS_DEVICES";

/// One entry of a device configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `sim[:link=eth|ib][:host=N][:ipv4=A.B.C.D][:connect_timeout=S][:sm=wait][:wire=...]` (the wires: [`WireSpec`]): a
    /// simulated ConnectX-5 (RoCE unless `link=ib`); `host=N` gives it the addresses of the N-th simulated host
    /// (N times [`SimConfig::next_host`] from the default; by default 1 for `wire=connect` and 0 otherwise, so
    /// the two ends of a wire differ without it); `wire=` joins its port to a simulated device of another
    /// process over TCP when it is first opened (the device's firmware then runs on its own thread, so its retry
    /// timers run in real time), a connecting one waiting up to `connect_timeout` seconds (default 30) for its
    /// listener to come up. A connecting end is unplugged when the device's last context closes and connects
    /// again at its next open. `ipv4=` sets the RoCE port's IPv4 address (its RoCE GIDs, answered in ARP) in
    /// place of the one `host=` or the VDE identity gives, so the port can share a subnet with a Linux host on the
    /// same fabric (a QEMU guest's rdma_rxe on a VDE switch). `sm=wait` (InfiniBand) starts the port as a
    /// fabric with a subnet manager has it before the first sweep: state Init, no LID, until an SM sets them
    /// through QP0 (served by [`SmiAgent`](crate::SmiAgent)).
    #[cfg(feature = "sim")]
    Sim {
        /// InfiniBand or Ethernet.
        link: PortType,
        /// Which simulated host's addresses.
        host: u32,
        /// The RoCE port's IPv4 address, when `ipv4=` names it.
        ipv4: Option<std::net::Ipv4Addr>,
        /// The simulated wire to another process, if any.
        wire: Option<WireSpec>,
        /// How long a first open waits for the far end of the wire (a `wire=connect` listener, a QEMU socket).
        connect_timeout: std::time::Duration,
        /// `sm=wait`: the port waits for a subnet manager (Init, no LID).
        subnet_manager: bool,
    },
    /// A PCI address (`0000:03:00.0` or `03:00.0`): that function through VFIO.
    Pci(Bdf),
    /// `vfio`: every ConnectX function bound to vfio-pci.
    AllVfio,
}

impl DeviceSpec {
    /// Parses a comma list of specs, as `MLX5_RS_DEVICES` holds them.
    ///
    /// ```
    /// use mlx5_verbs::DeviceSpec;
    /// let specs = DeviceSpec::parse_list("sim,sim:link=ib:host=1,0000:03:00.0,vfio")?;
    /// assert_eq!(specs.len(), 4);
    /// assert!(DeviceSpec::parse_list("sim:colour=blue").is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn parse_list(s: &str) -> Result<Vec<DeviceSpec>> {
        s.split(',').map(str::trim).filter(|t| !t.is_empty()).map(DeviceSpec::parse).collect()
    }

    /// Parses one spec.
    pub fn parse(s: &str) -> Result<DeviceSpec> {
        let bad = |why: &str| VerbsError::Invalid(format!("device spec {s:?}: {why}"));
        match s.split(':').next() {
            Some("vfio") if s == "vfio" => Ok(DeviceSpec::AllVfio),
            #[cfg(feature = "sim")]
            Some("sim") => {
                // The wire's address holds colons itself, so it is the last option and takes the rest.
                let (opts, wire) = match s.split_once(":wire=") {
                    Some((opts, w)) => {
                        let wire = match w.split_once(':') {
                            Some(("listen", at)) if !at.is_empty() => WireSpec::Listen(at.to_string()),
                            Some(("connect", at)) if !at.is_empty() => WireSpec::Connect(at.to_string()),
                            // `wire=vde` (the default switch) or `wire=vde:URL` (any libvdeplug URL).
                            None if w == "vde" => WireSpec::Vde(None),
                            Some(("vde", url)) if !url.is_empty() => WireSpec::Vde(Some(url.to_string())),
                            Some(("qemu", rest)) => match rest.split_once(':') {
                                Some((ip, path)) if !path.is_empty() => WireSpec::Qemu {
                                    ipv4: ip.parse::<std::net::Ipv4Addr>().map_err(|_| bad("wire=qemu: bad IPv4"))?,
                                    path: path.into(),
                                },
                                _ => return Err(bad("wire=qemu:IPV4:SOCKET")),
                            },
                            _ => {
                                return Err(bad("wire=vde[:URL], wire=listen:ADDR:PORT, wire=connect:HOST:PORT or \
                                     wire=qemu:IPV4:SOCKET"))
                            }
                        };
                        (opts, Some(wire))
                    }
                    None => (s, None),
                };
                let (mut link, mut host, mut connect_timeout) = (PortType::Eth, None, WIRE_CONNECT_TIMEOUT);
                let (mut ipv4, mut subnet_manager) = (None, false);
                for opt in opts.split(':').skip(1) {
                    match opt.split_once('=') {
                        Some(("link", "eth")) => link = PortType::Eth,
                        Some(("link", "ib")) => link = PortType::Ib,
                        Some(("sm", "wait")) => subnet_manager = true,
                        Some(("host", n)) => host = Some(n.parse().map_err(|_| bad("host is not a number"))?),
                        Some(("ipv4", a)) => {
                            ipv4 =
                                Some(a.parse::<std::net::Ipv4Addr>().map_err(|_| bad("ipv4 is not an IPv4 address"))?)
                        }
                        Some(("connect_timeout", n)) => {
                            let secs = n.parse::<u64>().ok().filter(|s| (1..=MAX_CONNECT_TIMEOUT_S).contains(s));
                            let secs = secs.ok_or_else(|| {
                                bad(&format!(
                                    "connect_timeout is not a number of seconds from 1 to {MAX_CONNECT_TIMEOUT_S}"
                                ))
                            })?;
                            connect_timeout = std::time::Duration::from_secs(secs);
                        }
                        _ => {
                            return Err(bad("unknown option (link=eth|ib, host=N, ipv4=A.B.C.D, connect_timeout=S, \
                                 sm=wait, wire=...)"))
                        }
                    }
                }
                if subnet_manager && link != PortType::Ib {
                    return Err(bad("sm=wait is an InfiniBand port's (link=ib)"));
                }
                if ipv4.is_some() && link == PortType::Ib {
                    return Err(bad("ipv4= is a RoCE port's address (link=eth)"));
                }
                if ipv4.is_some() && matches!(wire, Some(WireSpec::Qemu { .. })) {
                    return Err(bad("wire=qemu names the port's address itself; leave out ipv4="));
                }
                // The two ends of a wire are two hosts: the connecting one is host 1 unless told otherwise, so two
                // programs with `wire=listen` and `wire=connect` differ in MACs, GUIDs and LIDs with no `host=`.
                let host = host.unwrap_or(match wire {
                    Some(WireSpec::Connect(_)) => 1,
                    _ => 0,
                });
                Ok(DeviceSpec::Sim { link, host, ipv4, wire, connect_timeout, subnet_manager })
            }
            _ => s.parse::<Bdf>().map(DeviceSpec::Pci).map_err(|_| bad("neither sim, vfio nor a PCI address")),
        }
    }

    /// The simulated device's configuration.
    #[cfg(feature = "sim")]
    fn sim_config(link: PortType, host: u32, wired: bool) -> SimConfig {
        let mode = if wired { Mode::Threaded } else { Mode::Inline };
        let mut cfg = SimConfig { port_type: link, mode, ..SimConfig::default() };
        for _ in 0..host {
            cfg = cfg.next_host();
        }
        cfg
    }
}

/// How a simulated device's port reaches another process's (`wire=` of a [`DeviceSpec`]).
#[cfg(feature = "sim")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireSpec {
    /// Listen on `ADDR:PORT` (port 0 picks one; [`Device::wire_addr`] tells which): the VDE fabric's link on
    /// the TCP stream a `wire=connect` device opens (QEMU's stream framing; no libvdeplug needed).
    Listen(String),
    /// Connect to the device listening at `HOST:PORT`, retrying until `connect_timeout`.
    Connect(String),
    /// `wire=vde` or `wire=vde:URL`: plug into a VDE fabric: the libvdeplug URL (`vde:///path` for a
    /// `vde_switch`, `vxvde://239.1.2.3` across a LAN), or by default this user's switch, which the first
    /// process starts. Any number of processes meet on one fabric in any order. Without `host=`, the port's MAC,
    /// GUID, IPv4 address and (InfiniBand) LID come from the process's identity ([`vde_identity`]), so no two
    /// processes need telling apart by hand.
    Vde(Option<String>),
    /// `wire=qemu:IPV4:SOCKET`: plug into a QEMU guest NIC listening on the UNIX socket `SOCKET`
    /// (`-netdev stream,server=on,addr.type=unix`), the port's address `IPV4` (answered in ARP, a RoCE v2 GID):
    /// the VDE fabric's link on that stream, RoCEv2 frames to a RoCE stack in the guest such as rdma_rxe.
    Qemu {
        /// The simulated port's IPv4 address.
        ipv4: std::net::Ipv4Addr,
        /// The socket QEMU listens on.
        path: PathBuf,
    },
}

/// Whether a spec named its host (`host=N`); parsing keeps only the number.
#[cfg(feature = "sim")]
fn host_given(s: &DeviceSpec) -> bool {
    matches!(s, DeviceSpec::Sim { host, .. } if *host != 0)
}

/// A `wire=vde` port's addresses, unique on a fabric without configuration: a locally administered MAC
/// `02:4d:xx:xx:xx:xx` from a hash of the machine's name, the process id and the device's place in the list; the
/// node GUID is the MAC's EUI-64, the IPv4 address `10.x.y.z` the MAC's last three bytes (z never 0 or 255), and
/// an InfiniBand port's LID `1 + (16 more bits of the hash) mod 0xbfff`, a unicast LID. Two ports collide only
/// when 32 hash bits do (MAC, GUID) or 16 (LID): a port whose LID another port on the fabric holds is refused as
/// it plugs in (`VdeError::LidInUse`: start it again, and its new process id gives another LID). `host=N` gives
/// fixed addresses instead.
#[cfg(feature = "sim")]
pub fn vde_identity(cfg: SimConfig, index: u32) -> SimConfig {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default().hash(&mut h);
    std::process::id().hash(&mut h);
    index.hash(&mut h);
    let hash = h.finish();
    let x = (hash as u32).to_be_bytes();
    let lid = 1 + ((hash >> 32) as u16) % 0xbfff;
    let last = x[3].clamp(1, 254);
    let mac = [0x02, 0x4d, x[0], x[1], x[2], last];
    let guid = u64::from_be_bytes([mac[0] ^ 2, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]]);
    // The configuration holds a static list: one leaked address per such device.
    let ipv4: &'static [[u8; 4]] = Box::leak(Box::new([[10, x[1], x[2], last]]));
    SimConfig { mac, node_guid: guid, ipv4_addrs: ipv4, lid, ..cfg }
}

/// How long a first open waits for the listening device of a `wire=connect` spec (or a guest's socket) unless
/// `connect_timeout=` says otherwise: long enough for two programs started together (qperf, ucx_perftest) to
/// come up in either order.
#[cfg(feature = "sim")]
const WIRE_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The longest `connect_timeout=`, in seconds.
#[cfg(feature = "sim")]
const MAX_CONNECT_TIMEOUT_S: u64 = 3600;

/// The ConnectX functions bound to vfio-pci under a sysfs tree (`/sys` on a live system): the entries of
/// `bus/pci/drivers/vfio-pci` that are PCI addresses whose `vendor` reads 0x15b3, sorted. A missing driver
/// directory (vfio-pci not loaded) is an empty list.
pub fn scan_vfio_pci(sysfs: &Path) -> Vec<Bdf> {
    let drv = sysfs.join("bus/pci/drivers/vfio-pci");
    let Ok(dir) = std::fs::read_dir(&drv) else { return Vec::new() };
    let mut found: Vec<Bdf> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let bdf: Bdf = e.file_name().to_str()?.parse().ok()?;
            let vendor = std::fs::read_to_string(e.path().join("vendor")).ok()?;
            let vendor = u16::from_str_radix(vendor.trim().trim_start_matches("0x"), 16).ok()?;
            (vendor == MELLANOX_VENDOR_ID).then_some(bdf)
        })
        .collect();
    found.sort();
    found
}

/// Where a listed device comes from.
#[derive(Debug)]
enum Source {
    #[cfg(feature = "sim")]
    Sim(SimDevice),
    Pci(Bdf),
}

/// A simulated device's wire: what to do at the first open, and the address it listens on once done.
#[cfg(feature = "sim")]
#[derive(Debug)]
struct Wire {
    spec: WireSpec,
    /// The device's simulated host, for the error when both ends are the same one.
    host: u32,
    /// How long the first open waits for the far end.
    timeout: std::time::Duration,
    /// Set once the first open plugged the wire in (`Some(addr)` for a listener, `None` for a connector).
    done: Option<Option<std::net::SocketAddr>>,
}

/// A listed device: the same entry for every listing, so an open made through one is shared with the next.
#[derive(Debug)]
struct Entry {
    source: Source,
    /// The opened HCA while any context or object holds it.
    open: Mutex<Weak<DeviceShared>>,
    /// Up from a bring-up until that HCA's teardown has finished.
    gate: Arc<UpGate>,
    #[cfg(feature = "sim")]
    wire: Mutex<Option<Wire>>,
}

impl Entry {
    fn new(source: Source) -> Arc<Entry> {
        Arc::new(Entry {
            source,
            open: Mutex::new(Weak::new()),
            gate: Arc::default(),
            #[cfg(feature = "sim")]
            wire: Mutex::new(None),
        })
    }

    /// Plugs a simulated device's wire in at a bring-up: a listener once (it keeps listening across bring-ups),
    /// a `wire=connect` end at every bring-up (its teardown unplugs it, see [`Entry::unplug`]).
    #[cfg(feature = "sim")]
    fn plug(&self, dev: &SimDevice) -> Result<()> {
        let mut w = lock(&self.wire);
        let Some(wire) = w.as_mut().filter(|w| w.done.is_none()) else { return Ok(()) };
        let host = wire.host;
        let failed = |e: mlx5_sim::WireError| {
            VerbsError::Invalid(match e {
                mlx5_sim::WireError::SameAddress { peer } => format!(
                    "simulated wire: the device at {peer} is simulated host {host} too (both ends have the same \
                     MAC, GUID and LID): give one end another host= in {DEVICES_ENV} (e.g. host={})",
                    host + 1
                ),
                mlx5_sim::WireError::NoListener { .. } => {
                    format!("simulated wire: {e} (connect_timeout=S in {DEVICES_ENV} waits longer)")
                }
                e => format!("simulated wire: {e}"),
            })
        };
        wire.done = Some(match &wire.spec {
            WireSpec::Listen(at) => Some(dev.wire_listen(at).map_err(failed)?),
            WireSpec::Connect(at) => {
                dev.wire_connect(at, wire.timeout).map_err(failed)?;
                None
            }
            WireSpec::Qemu { path, .. } => {
                dev.guest_connect(path, wire.timeout)
                    .map_err(|source| VerbsError::GuestNic { path: path.clone(), source })?;
                None
            }
            WireSpec::Vde(url) => {
                dev.vde_plug(url.as_deref()).map_err(VerbsError::Fabric)?;
                None
            }
        });
        Ok(())
    }

    /// After the HCA's teardown: a `wire=connect` device unplugs its wire (the listener sees its link go down),
    /// and its next bring-up connects afresh. A program that closes a device and opens it again (qperf, one
    /// test after another) so reaches the listener of that moment, not one that may have exited since.
    #[cfg(feature = "sim")]
    fn unplug(&self) {
        let Source::Sim(dev) = &self.source else { return };
        let mut w = lock(&self.wire);
        if let Some(wire) = w.as_mut().filter(|w| matches!(w.spec, WireSpec::Connect(_))) {
            dev.wire_unplug();
            wire.done = None;
        }
        // A VDE port lets its last frames out and leaves the fabric; its next bring-up plugs in again.
        if let Some(wire) = w.as_mut().filter(|w| matches!(w.spec, WireSpec::Vde(_))) {
            // What the fabric carried and lost on this side, logged before the counters go with the link: a
            // program that closes its device before it exits (UCX) has none left for the exit log.
            if let Some(c) = dev.vde_counters().filter(|_| log::log_enabled!(log::Level::Info)) {
                log::info!(
                    "VDE port leaves the fabric: {} frames sent, {} received; dropped: {} as a peer's socket was \
                     full, {} as the send queue was, {} IB messages incomplete, {} IB frames malformed",
                    c.tx_frames,
                    c.rx_frames,
                    c.tx_direct_timeout,
                    c.tx_queue_full,
                    c.rx_ib_incomplete,
                    c.rx_ib_malformed
                );
            }
            dev.vde_unplug();
            wire.done = None;
        }
    }
}

/// A device of the list (`ibv_device`). Cheap to clone; opening it never brings it up twice in one process.
#[derive(Debug, Clone)]
pub struct Device {
    name: String,
    entry: Arc<Entry>,
}

impl Device {
    /// `ibv_get_device_name`: `mlx5_0`, `mlx5_1`, ... in list order.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ibv_get_device_guid`: the node GUID. Simulated devices report the configured one. A VFIO device's GUID
    /// needs a firmware command (a vport query after bring-up): it is known while the device is open in this
    /// process ([`Context::node_guid`]) and `None` otherwise, as listing brings nothing up.
    pub fn guid(&self) -> Option<u64> {
        match &self.entry.source {
            #[cfg(feature = "sim")]
            Source::Sim(d) => Some(d.config().node_guid),
            Source::Pci(_) => lock(&self.entry.open).upgrade().and_then(|d| d.node_guid().ok()),
        }
    }

    /// The PCI address of a VFIO device.
    pub fn pci_address(&self) -> Option<Bdf> {
        match &self.entry.source {
            #[cfg(feature = "sim")]
            Source::Sim(_) => None,
            Source::Pci(b) => Some(*b),
        }
    }

    /// The simulated device behind this entry (its counters and fault injection), if it is one.
    #[cfg(feature = "sim")]
    pub fn sim_device(&self) -> Option<&SimDevice> {
        match &self.entry.source {
            Source::Sim(d) => Some(d),
            Source::Pci(_) => None,
        }
    }

    /// The address a `wire=listen` simulated device listens on, once opened.
    #[cfg(feature = "sim")]
    pub fn wire_addr(&self) -> Option<std::net::SocketAddr> {
        lock(&self.entry.wire).as_ref().and_then(|w| w.done.flatten())
    }

    /// Whether a context or object of this process holds the device open.
    pub fn is_open(&self) -> bool {
        lock(&self.entry.open).strong_count() > 0
    }

    /// `ibv_open_device`: a new context. The first open brings the device up; while anything made from a context
    /// of it lives, further opens share that HCA.
    pub fn open(&self) -> Result<Context> {
        self.open_with(None)
    }

    /// [`Device::open`] handing every firmware command to `trace` when this open brings the device up (a shared
    /// HCA keeps the tracer it was brought up with).
    pub fn open_with(&self, trace: Option<Tracer>) -> Result<Context> {
        let mut slot = lock(&self.entry.open);
        if let Some(dev) = slot.upgrade() {
            return Ok(Context::attach(dev));
        }
        // The last context may be dropping right now on another thread: its teardown finishes first.
        self.entry.gate.wait_down();
        let dev = match &self.entry.source {
            #[cfg(feature = "sim")]
            Source::Sim(d) => {
                self.entry.plug(d)?;
                // A device that died (or left the bus) under its last contexts is reset before it comes up again,
                // as vfio-pci resets a function whose fd was released: the process opens it again without
                // restarting. A live one keeps its state, so what its last user left behind stays visible.
                if d.health() != mlx5_sim::Health::Ok {
                    d.function_reset();
                }
                bring_up_sim(d.clone(), trace)?
            }
            Source::Pci(bdf) => bring_up_vfio(*bdf, trace)?,
        };
        dev.hold_up(&self.entry.gate);
        #[cfg(feature = "sim")]
        {
            let entry = self.entry.clone();
            dev.after_teardown(Box::new(move || entry.unplug()));
        }
        *slot = Arc::downgrade(&dev);
        Ok(Context::attach(dev))
    }

    /// Adds a simulated device configured as `cfg` to this process's list (after the others) and returns it.
    #[cfg(feature = "sim")]
    pub fn sim(cfg: SimConfig) -> Result<Device> {
        Self::register_sim(SimDevice::new(cfg))
    }

    /// Adds a given simulated device (e.g. one wired to another) to this process's list and returns it.
    #[cfg(feature = "sim")]
    pub fn register_sim(dev: SimDevice) -> Result<Device> {
        Ok(DeviceRegistry::global()?.add_sim(dev))
    }
}

/// `ibv_get_device_list`: this process's devices (see the module documentation). Lists without bringing
/// anything up.
///
/// ```
/// let devs = mlx5_verbs::devices()?;
/// assert!(devs.iter().any(|d| d.name() == "mlx5_0"));
/// # Ok::<(), mlx5_verbs::VerbsError>(())
/// ```
pub fn devices() -> Result<Vec<Device>> {
    Ok(DeviceRegistry::global()?.devices())
}

#[derive(Debug)]
struct Registered {
    sims: Vec<Arc<Entry>>,
    /// Every PCI function listed so far, so an open survives a new listing.
    pci: BTreeMap<Bdf, Arc<Entry>>,
    /// PCI functions named in the configuration.
    named: Vec<Bdf>,
    /// Whether the configuration asks for every ConnectX bound to vfio-pci.
    scan: bool,
}

/// A set of devices: the process's own ([`DeviceRegistry::global`], from `MLX5_RS_DEVICES`), or one built from
/// given specs and a sysfs tree (tests use a fake tree in a temporary directory).
#[derive(Debug)]
pub struct DeviceRegistry {
    sysfs: PathBuf,
    reg: Mutex<Registered>,
}

impl DeviceRegistry {
    /// Devices as `specs` name them, PCI functions looked up under `sysfs`. Simulated devices are made (not
    /// brought up) now.
    pub fn new(specs: &[DeviceSpec], sysfs: impl Into<PathBuf>) -> DeviceRegistry {
        let mut reg = Registered { sims: Vec::new(), pci: BTreeMap::new(), named: Vec::new(), scan: false };
        for s in specs {
            match s {
                #[cfg(feature = "sim")]
                DeviceSpec::Sim { link, host, ipv4, wire, connect_timeout, subnet_manager } => {
                    let mut cfg = DeviceSpec::sim_config(*link, *host, wire.is_some());
                    cfg.subnet_manager = *subnet_manager;
                    if matches!(wire, Some(WireSpec::Vde(_))) && !host_given(s) {
                        cfg = vde_identity(cfg, reg.sims.len() as u32);
                    }
                    let named = match wire {
                        Some(WireSpec::Qemu { ipv4, .. }) => Some(ipv4),
                        _ => ipv4.as_ref(),
                    };
                    if let Some(ip) = named {
                        // The configuration holds a static list: one leaked address per such device.
                        cfg.ipv4_addrs = Box::leak(Box::new([ip.octets()]));
                    }
                    let entry = Entry::new(Source::Sim(SimDevice::new(cfg)));
                    *lock(&entry.wire) =
                        wire.clone().map(|spec| Wire { spec, host: *host, timeout: *connect_timeout, done: None });
                    reg.sims.push(entry);
                }
                DeviceSpec::Pci(b) => reg.named.push(*b),
                DeviceSpec::AllVfio => reg.scan = true,
            }
        }
        DeviceRegistry { sysfs: sysfs.into(), reg: Mutex::new(reg) }
    }

    /// The process's devices, configured by `MLX5_RS_DEVICES` (read once per process) and found under `/sys`.
    /// A forked child gets a list of its own at its first call (see [`fork_generation`](crate::fork_generation)):
    /// the parent's devices run on threads the child does not have.
    pub fn global() -> Result<&'static DeviceRegistry> {
        #[cfg(target_os = "linux")]
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        #[cfg(target_os = "linux")]
        AT_EXIT.call_once(|| {
            // SAFETY: registers a plain function; it only reads the leaked registry.
            if unsafe { libc::atexit(drain_wires_at_exit) } != 0 {
                log::warn!("atexit failed: frames queued on a wire at exit may be lost");
            }
        });
        let gen = crate::fork::generation();
        let mut cur = GLOBAL.load(Ordering::Acquire);
        loop {
            // SAFETY: a non-null pointer here came from `Box::into_raw` below and is never freed.
            if let Some(g) = unsafe { cur.as_ref() }.filter(|g| g.gen == gen) {
                return g.reg.as_ref().map_err(|e| VerbsError::Invalid(e.clone()));
            }
            let specs = match std::env::var(DEVICES_ENV) {
                Ok(s) => DeviceSpec::parse_list(&s).map_err(|e| format!("{DEVICES_ENV}: {e}")),
                Err(_) => DeviceSpec::parse_list(default_specs()).map_err(|e| e.to_string()),
            };
            let made = Box::new(Generation { gen, reg: specs.map(|s| DeviceRegistry::new(&s, "/sys")) });
            let made = Box::into_raw(made);
            match GLOBAL.compare_exchange(cur, made, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => cur = made,
                Err(now) => {
                    // Another thread made this generation's first: ours goes, nothing of it was handed out.
                    // SAFETY: `made` came from Box::into_raw above and was never published.
                    drop(unsafe { Box::from_raw(made) });
                    cur = now;
                }
            }
        }
    }

    /// The devices, named in list order: simulated ones first, then PCI functions by address.
    pub fn devices(&self) -> Vec<Device> {
        let mut reg = lock(&self.reg);
        let mut pci: Vec<Bdf> = reg.named.clone();
        if reg.scan {
            pci.extend(scan_vfio_pci(&self.sysfs));
        }
        pci.sort();
        pci.dedup();
        let mut entries: Vec<Arc<Entry>> = reg.sims.clone();
        for b in pci {
            entries.push(reg.pci.entry(b).or_insert_with(|| Entry::new(Source::Pci(b))).clone());
        }
        entries.into_iter().enumerate().map(|(i, entry)| Device { name: format!("mlx5_{i}"), entry }).collect()
    }

    /// Adds a simulated device after the others.
    #[cfg(feature = "sim")]
    pub fn add_sim(&self, dev: SimDevice) -> Device {
        let mut reg = lock(&self.reg);
        let entry = Entry::new(Source::Sim(dev));
        reg.sims.push(entry.clone());
        Device { name: format!("mlx5_{}", reg.sims.len() - 1), entry }
    }

    /// The entry of a PCI function, listed or not (opening by address shares an HCA opened from the list).
    fn pci(&self, bdf: Bdf) -> Device {
        let list = self.devices();
        if let Some(d) = list.iter().find(|d| d.pci_address() == Some(bdf)) {
            return d.clone();
        }
        let entry = lock(&self.reg).pci.entry(bdf).or_insert_with(|| Entry::new(Source::Pci(bdf))).clone();
        Device { name: bdf.to_string(), entry }
    }
}

/// One process's registry; leaked, so a child never drops (and joins the threads of) its parent's.
struct Generation {
    gen: u64,
    reg: std::result::Result<DeviceRegistry, String>,
}

/// The registry of [`DeviceRegistry::global`], null until its first call.
static GLOBAL: AtomicPtr<Generation> = AtomicPtr::new(std::ptr::null_mut());

/// Waits (at most `timeout` per device) until the frames this process's simulated devices queued for their
/// wires' far ends are on the sockets. A program that exits right after its last post (qperf's server child
/// after a CM's DREP went on QP1) would otherwise take them along; a NIC sends what was posted. Nothing is
/// made: devices of a registry not yet made (or a forked child's parent) are left alone.
pub fn drain_wires(timeout: std::time::Duration) {
    #[cfg(feature = "sim")]
    for e in made_sims() {
        if let Source::Sim(dev) = &e.source {
            dev.wire_drain(timeout);
        }
    }
    #[cfg(not(feature = "sim"))]
    let _ = timeout;
}

/// The simulated devices this process's registry holds, without making the registry: none when it was never made
/// or was made by a forked child's parent.
#[cfg(feature = "sim")]
fn made_sims() -> Vec<Arc<Entry>> {
    // SAFETY: a non-null pointer here came from `Box::into_raw` in `global` and is never freed.
    let Some(g) = (unsafe { GLOBAL.load(Ordering::Acquire).as_ref() }) else { return Vec::new() };
    if g.gen != crate::fork::generation_now() {
        return Vec::new();
    }
    let Ok(reg) = &g.reg else { return Vec::new() };
    lock(&reg.reg).sims.clone()
}

/// Logs (at info) what each simulated port on a wire recovered from (ACK-timer retries, sequence NAKs,
/// duplicates; `mlx5_sim::Recoveries`), so a program run over a lossy wire shows its retransmissions on stderr
/// with `MLX5_RS_LOG=info`, as rdma_rxe's `hw_counters` show a peer's. An exiting process logs them after its
/// drain. Nothing is made, as in [`drain_wires`].
pub fn log_wire_recoveries() {
    #[cfg(feature = "sim")]
    if log::log_enabled!(log::Level::Info) {
        // Simulated devices come first in the list, so their names are their places.
        for (i, e) in made_sims().iter().enumerate() {
            if let (Source::Sim(dev), true) = (&e.source, lock(&e.wire).is_some()) {
                // What the fabric lost on our side too: frames a busy peer's socket did not take in time (then
                // sent through the switch for a while) and a full send queue.
                let frames = dev.vde_counters().map_or_else(String::new, |c| {
                    format!(
                        "; VDE fabric: {} frames sent, {} received, {} dropped as the peer's socket was full, {} as \
                         the send queue was",
                        c.tx_frames, c.rx_frames, c.tx_direct_timeout, c.tx_queue_full
                    )
                });
                log::info!("mlx5_{i}: wire recoveries: {}{frames}", dev.recoveries());
            }
        }
    }
}

/// How long an exiting process waits for each device's wire ([`drain_wires`]).
#[cfg(target_os = "linux")]
const EXIT_DRAIN: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(target_os = "linux")]
extern "C" fn drain_wires_at_exit() {
    // A panic must not unwind into libc's exit.
    let _ = std::panic::catch_unwind(|| {
        drain_wires(EXIT_DRAIN);
        log_wire_recoveries();
    });
}

/// The configuration when `MLX5_RS_DEVICES` is unset: one simulated device (with the `sim` feature) and every
/// ConnectX bound to vfio-pci.
fn default_specs() -> &'static str {
    if cfg!(feature = "sim") {
        "sim,vfio"
    } else {
        "vfio"
    }
}

/// Brings a device up and starts its shared state.
fn bring_up(kind: DeviceKind, trace: Option<Tracer>, cfg: Config) -> Result<Arc<DeviceShared>> {
    let mut delay = kind.delay();
    let mut hca =
        Hca::bring_up(kind.mmio(), kind.dma(), MaybeTrace(trace), &mut delay, cfg).map_err(VerbsError::Bringup)?;
    let link = match hca.query_port(&mut delay) {
        Ok(p) => p.link_layer,
        Err(e) => {
            let _ = hca.teardown(&mut delay);
            return Err(e.into());
        }
    };
    Ok(DeviceShared::start(hca, delay, kind, link))
}

/// The CPU's cache line in bytes, as Linux reports it under a sysfs tree (`/sys` on a live system):
/// `devices/system/cpu/cpu0/cache/index0/coherency_line_size`; 64 when it cannot be read (no such file, not a
/// number, or not a power of two).
///
/// ```
/// let dir = std::env::temp_dir().join(format!("mlx5-cl-doc-{}", std::process::id()));
/// let idx = dir.join("devices/system/cpu/cpu0/cache/index0");
/// std::fs::create_dir_all(&idx).unwrap();
/// std::fs::write(idx.join("coherency_line_size"), "128\n").unwrap();
/// assert_eq!(mlx5_verbs::cache_line_size(&dir), 128);
/// std::fs::remove_dir_all(&dir).unwrap();
/// assert_eq!(mlx5_verbs::cache_line_size(&dir), 64);
/// ```
pub fn cache_line_size(sysfs: &Path) -> usize {
    let f = sysfs.join("devices/system/cpu/cpu0/cache/index0/coherency_line_size");
    std::fs::read_to_string(f)
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|n| n.is_power_of_two() && *n >= 16)
        .unwrap_or(64)
}

/// The host's part of the configuration: the doorbell records spaced by the CPU's cache line (and
/// `cache_line_128byte` set when it is 128 bytes, as Linux's `cache_line_size()` decides), and one completion
/// vector per CPU, as Linux makes one completion EQ per online CPU (the core caps it at the device's EQs).
pub fn host_config(sysfs: &Path) -> Config {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    Config {
        cache_line_128: cache_line_size(sysfs) >= 128,
        num_comp_vectors: u16::try_from(cpus).unwrap_or(u16::MAX),
        ..Config::default()
    }
}

#[cfg(feature = "sim")]
fn bring_up_sim(dev: SimDevice, trace: Option<Tracer>) -> Result<Arc<DeviceShared>> {
    // The simulated host's addresses become GID entries, as a Linux host's netdev addresses do.
    let c = dev.config();
    let host = host_config(Path::new("/sys"));
    // Vectors as VFIO would grant them on a ConnectX-5 (64 MSI-X per function): vector 0 for the async EQs and
    // one per completion vector, so the simulator's interrupt log shows which EQ each completion event took.
    let (num_irqs, num_comp_vectors) =
        vfio_vector_split(vfio_vectors_wanted(host.num_comp_vectors).min(64) as usize, host.num_comp_vectors);
    let cfg = Config { ipv4_addrs: c.ipv4_addrs, ipv6_addrs: c.ipv6_addrs, num_irqs, num_comp_vectors, ..host };
    bring_up(DeviceKind::Sim(dev), trace, cfg)
}

fn bring_up_vfio(bdf: Bdf, trace: Option<Tracer>) -> Result<Arc<DeviceShared>> {
    bring_up_vfio_on(
        Arc::new(mlx5_vfio::sys::LinuxSys),
        bdf,
        trace,
        host_config(Path::new("/sys")),
        VfioOptions::from_env()?,
    )
}

/// Opens `bdf` through VFIO with every system call made through `sys` and brings it up: the MSI-X vectors asked
/// for are one for the control EQs and one per completion vector `host` wants, and the completion vectors offered
/// are what VFIO enabled.
fn bring_up_vfio_on(
    sys: Arc<dyn mlx5_vfio::sys::Sys>,
    bdf: Bdf,
    trace: Option<Tracer>,
    host: Config,
    opts: VfioOptions,
) -> Result<Arc<DeviceShared>> {
    let (ipv4_addrs, ipv6_addrs) = vfio_port_addrs()?;
    let opts = VfioOptions { vectors: vfio_vectors_wanted(host.num_comp_vectors), ..opts };
    let v = Arc::new(Vfio::open_with(sys, bdf, opts)?);
    let enabled = v.irqs.as_ref().map_or(1, |i| i.count());
    let (num_irqs, num_comp_vectors) = vfio_vector_split(enabled, host.num_comp_vectors);
    let cfg = Config { ipv4_addrs, ipv6_addrs, num_irqs, num_comp_vectors, ..host };
    bring_up(DeviceKind::Vfio(v), trace, cfg)
}

/// MSI-X vectors to ask VFIO for: one for the control EQs (`MLX5_IRQ_VEC_COMP_BASE`) and one per completion
/// vector wanted, as mlx5_core asks for `num_online_cpus() + MLX5_IRQ_VEC_COMP_BASE` (VFIO grants at most what
/// the function has).
pub fn vfio_vectors_wanted(comp_vectors: u16) -> u32 {
    1 + u32::from(comp_vectors.max(1))
}

/// What the bring-up is told once VFIO enabled `enabled` vectors: `(num_irqs, num_comp_vectors)`. The async EQs
/// keep vector 0 and each completion vector gets its own of the rest; with a single vector every EQ shares it
/// and one completion vector is offered.
pub fn vfio_vector_split(enabled: usize, comp_wanted: u16) -> (u16, u16) {
    let irqs = u16::try_from(enabled.max(1)).unwrap_or(u16::MAX);
    (irqs, comp_wanted.max(1).min((irqs - 1).max(1)))
}

/// The IP addresses of a VFIO device's port. A ConnectX on vfio-pci has no netdev whose addresses Linux's GID
/// cache would turn into RoCE GID entries, so they are configuration: `MLX5_RS_ADDRS`, a comma list of IPv4 and
/// IPv6 addresses (read once per process; the link-local entries are always made).
fn vfio_port_addrs() -> Result<(&'static [[u8; 4]], &'static PortV6)> {
    static ADDRS: std::sync::OnceLock<std::result::Result<PortAddrs, String>> = std::sync::OnceLock::new();
    let parsed = ADDRS.get_or_init(|| parse_port_addrs(&std::env::var("MLX5_RS_ADDRS").unwrap_or_default()));
    match parsed {
        Ok((v4, v6)) => Ok((v4.as_slice(), v6.as_slice())),
        Err(e) => Err(VerbsError::Invalid(e.clone())),
    }
}

/// A port's IPv4 and IPv6 addresses, each list in the order configured.
type PortAddrs = (Vec<[u8; 4]>, Vec<[u8; 16]>);

/// A port's IPv6 addresses.
type PortV6 = [[u8; 16]];

/// `MLX5_RS_ADDRS`: a comma list of IP addresses, IPv4 and IPv6 apart in the order given.
fn parse_port_addrs(list: &str) -> std::result::Result<PortAddrs, String> {
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        match a.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V4(ip)) => v4.push(ip.octets()),
            Ok(std::net::IpAddr::V6(ip)) => v6.push(ip.octets()),
            Err(_) => return Err(format!("MLX5_RS_ADDRS: {a:?} is not an IPv4 or IPv6 address")),
        }
    }
    Ok((v4, v6))
}

impl Context {
    /// Opens a new simulated ConnectX-5 (RoCE, in-line firmware) of its own and brings it up. It is not in the
    /// device list; [`Device::sim`] adds one that is.
    ///
    /// ```
    /// let ctx = mlx5_verbs::Context::open_sim()?;
    /// assert_eq!(ctx.query_port()?.state, 4); // IB_PORT_ACTIVE
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim() -> Result<Context> {
        Self::open_sim_device(SimDevice::new(SimConfig::default()))
    }

    /// Brings up a given simulated device (for a chosen configuration, or one wired to another). Each call brings
    /// it up anew: open a device twice through [`Device::open`] to share one HCA.
    #[cfg(feature = "sim")]
    pub fn open_sim_device(dev: SimDevice) -> Result<Context> {
        Self::open_sim_device_with(dev, None)
    }

    /// [`Context::open_sim_device`] handing every firmware command, bring-up and teardown included, to `trace`
    /// when there is one.
    ///
    /// ```
    /// use mlx5_verbs::{CmdRecord, CmdTrace, Context};
    /// struct Count(std::sync::Arc<std::sync::atomic::AtomicUsize>);
    /// impl CmdTrace for Count {
    ///     fn record(&mut self, _: &CmdRecord<'_>) {
    ///         self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ///     }
    /// }
    /// let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    /// let dev = mlx5_sim::SimDevice::new(mlx5_sim::SimConfig::default());
    /// drop(Context::open_sim_device_with(dev, Some(Box::new(Count(n.clone()))))?);
    /// assert!(n.load(std::sync::atomic::Ordering::Relaxed) > 30);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim_device_with(dev: SimDevice, trace: Option<Tracer>) -> Result<Context> {
        Ok(Context::attach(bring_up_sim(dev, trace)?))
    }

    /// Two simulated ConnectX-5s joined by a simulated wire, with distinct MACs / GUIDs / LIDs: two hosts on a
    /// laptop.
    ///
    /// ```
    /// let (a, b) = mlx5_verbs::Context::open_sim_pair()?;
    /// assert_ne!(a.query_gid(0)?, b.query_gid(0)?);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim_pair() -> Result<(Context, Context)> {
        Self::open_sim_pair_with(SimConfig::default())
    }

    /// [`Context::open_sim_pair`] with both devices configured as `base` (e.g. threaded firmware); the second
    /// gets the next GUID, MAC and LID.
    ///
    /// ```
    /// use mlx5_sim::{Mode, SimConfig};
    /// let threaded = SimConfig { mode: Mode::Threaded, ..SimConfig::default() };
    /// let (a, b) = mlx5_verbs::Context::open_sim_pair_with(threaded)?;
    /// assert_ne!(a.query_gid(0)?, b.query_gid(0)?);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim_pair_with(base: SimConfig) -> Result<(Context, Context)> {
        let second = base.next_host();
        let (da, db) = (SimDevice::new(base), SimDevice::new(second));
        da.connect(&db);
        Ok((Self::open_sim_device(da)?, Self::open_sim_device(db)?))
    }

    /// Opens the ConnectX at `bdf` through VFIO (bound to vfio-pci); shares the HCA when this process has it
    /// open already.
    pub fn open_vfio(bdf: Bdf) -> Result<Context> {
        Self::open_vfio_with(bdf, None)
    }

    /// [`Context::open_vfio`] handing every firmware command to `trace` when this open brings the device up.
    pub fn open_vfio_with(bdf: Bdf, trace: Option<Tracer>) -> Result<Context> {
        DeviceRegistry::global()?.pci(bdf).open_with(trace)
    }

    /// Opens the function at `bdf` through VFIO as [`Context::open_vfio`] does, with every system call made
    /// through `sys` (in tests the kernel's twin, `mlx5_vfio::twin::Twin`, with a simulated device behind it),
    /// asking for `comp_vectors` completion vectors as a host with that many CPUs does. The device is not in the
    /// device list and its HCA is not shared: each call brings it up anew.
    #[cfg(feature = "twin")]
    pub fn open_vfio_on(sys: Arc<dyn mlx5_vfio::sys::Sys>, bdf: Bdf, comp_vectors: u16) -> Result<Context> {
        let host = Config { num_comp_vectors: comp_vectors, ..host_config(Path::new("/sys")) };
        Ok(Context::attach(bring_up_vfio_on(sys, bdf, None, host, VfioOptions::default())?))
    }

    /// `"sim"` for a new simulated device, a device name of the list (`mlx5_0`, ...), else a PCI address for
    /// VFIO. Without the `sim` feature `"sim"` is refused as not being a PCI address.
    pub fn open(spec: &str) -> Result<Context> {
        #[cfg(feature = "sim")]
        if spec == "sim" {
            return Self::open_sim();
        }
        if spec.starts_with("mlx5_") {
            let d = devices()?.into_iter().find(|d| d.name() == spec);
            return d.ok_or_else(|| VerbsError::Invalid(format!("no device {spec}")))?.open();
        }
        Self::open_vfio(spec.parse()?)
    }
}

#[cfg(test)]
mod addr_tests {
    #[test]
    fn port_addresses_parse_as_a_comma_list_and_refuse_garbage() {
        let (v4, v6) = super::parse_port_addrs("192.168.1.5, fe80::1,10.0.0.2").unwrap();
        assert_eq!(v4, [[192, 168, 1, 5], [10, 0, 0, 2]]);
        assert_eq!(v6.len(), 1);
        assert_eq!(v6[0][0..2], [0xfe, 0x80]);
        assert_eq!(super::parse_port_addrs("").unwrap(), (vec![], vec![]));
        let e = super::parse_port_addrs("192.168.1.5,not-an-ip").unwrap_err();
        assert!(e.contains("not-an-ip"), "{e}");
    }
}

#[cfg(all(test, feature = "sim"))]
mod qemu_spec_tests {
    use super::{vde_identity, DeviceSpec, WireSpec};
    use mlx5_sim::{Mode, SimConfig};

    #[test]
    fn a_qemu_wire_names_the_port_address_and_the_socket() {
        let s = DeviceSpec::parse("sim:wire=qemu:10.0.0.2:/tmp/roce.sock").unwrap();
        let DeviceSpec::Sim { wire: Some(WireSpec::Qemu { ipv4, path }), .. } = s else { panic!("{s:?}") };
        assert_eq!((ipv4.octets(), path.to_str()), ([10, 0, 0, 2], Some("/tmp/roce.sock")));
        for bad in ["sim:wire=qemu:10.0.0.2", "sim:wire=qemu:10.0.0.2:", "sim:wire=qemu:10.0.0:/s", "sim:wire=qemu"] {
            assert!(DeviceSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_vde_wire_takes_the_default_switch_or_any_url() {
        let wire = |s: &str| match DeviceSpec::parse(s).unwrap() {
            DeviceSpec::Sim { wire, host, .. } => (wire, host),
            other => panic!("{other:?}"),
        };
        assert_eq!(wire("sim:wire=vde"), (Some(WireSpec::Vde(None)), 0));
        assert_eq!(wire("sim:link=eth:wire=vde:vde:///tmp/sw"), (Some(WireSpec::Vde(Some("vde:///tmp/sw".into()))), 0));
        assert_eq!(
            wire("sim:host=3:wire=vde:vxvde://239.1.2.3").0,
            Some(WireSpec::Vde(Some("vxvde://239.1.2.3".into())))
        );
        assert!(DeviceSpec::parse("sim:wire=vde:").is_err());
        // Two processes (here: two places in one list) get different addresses without host=.
        let cfg = || SimConfig { mode: Mode::Threaded, ..SimConfig::default() };
        let (a, b) = (vde_identity(cfg(), 0), vde_identity(cfg(), 1));
        assert_ne!((a.mac, a.node_guid, a.ipv4_addrs), (b.mac, b.node_guid, b.ipv4_addrs));
        // Locally administered unicast, the GUID its EUI-64, the IPv4 address in 10/8 and not .0 or .255.
        assert_eq!((a.mac[0], a.mac[1]), (0x02, 0x4d));
        assert_eq!(a.node_guid.to_be_bytes()[3..5], [0xff, 0xfe]);
        let ip = a.ipv4_addrs[0];
        assert!(ip[0] == 10 && ip[3] != 0 && ip[3] != 255 && ip[3] == a.mac[5], "{ip:?}");
        // LIDs: always unicast (0x1-0xbfff), and spread over that range (2000 ports share a LID about 40 times;
        // the fabric refuses the second holder as it plugs in).
        let lids: std::collections::BTreeSet<u16> = (0..2000).map(|i| vde_identity(cfg(), i).lid).collect();
        assert!(lids.iter().all(|l| (1..0xc000).contains(l)), "{lids:?}");
        assert!(lids.len() > 1800, "{} distinct LIDs of 2000", lids.len());
    }

    /// Issue 34: a port on a VDE switch with a QEMU guest's rdma_rxe needs an address in the guest's subnet; the
    /// MAC and GUID still come from the identity, so two such ports stay apart.
    #[test]
    fn ipv4_sets_the_roce_address_and_keeps_the_vde_identity() {
        let reg = super::DeviceRegistry::new(
            &[DeviceSpec::parse("sim:ipv4=10.0.0.2:wire=vde:vde:///tmp/sw").unwrap()],
            "/nonexistent",
        );
        let cfg = reg.devices()[0].sim_device().unwrap().config();
        assert_eq!(cfg.ipv4_addrs, &[[10, 0, 0, 2]]);
        assert_eq!((cfg.mac[0], cfg.mac[1]), (0x02, 0x4d), "the MAC is the identity's");
        let plain = super::DeviceRegistry::new(&[DeviceSpec::parse("sim:ipv4=192.0.2.7").unwrap()], "/nonexistent");
        assert_eq!(plain.devices()[0].sim_device().unwrap().config().ipv4_addrs, &[[192, 0, 2, 7]]);
        for (bad, why) in [
            ("sim:ipv4=10.0.0", "ipv4 is not an IPv4 address"),
            ("sim:link=ib:ipv4=10.0.0.2", "ipv4= is a RoCE port's address (link=eth)"),
            ("sim:ipv4=10.0.0.3:wire=qemu:10.0.0.2:/tmp/s", "wire=qemu names the port's address itself"),
        ] {
            let e = DeviceSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}

#[cfg(all(test, feature = "sim"))]
mod wire_spec_tests {
    use super::{DeviceRegistry, DeviceSpec, WIRE_CONNECT_TIMEOUT};
    use std::time::Duration;

    fn parse(s: &str) -> DeviceSpec {
        DeviceSpec::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn host_and_timeout(s: &str) -> (u32, Duration) {
        match parse(s) {
            DeviceSpec::Sim { host, connect_timeout, .. } => (host, connect_timeout),
            other => panic!("{other:?}"),
        }
    }

    /// A registry of `spec` alone, as one program's `MLX5_RS_DEVICES` makes it (no VFIO scan).
    fn registry(spec: &str) -> DeviceRegistry {
        DeviceRegistry::new(&[parse(spec)], "/nonexistent")
    }

    /// What the process run by [`frames_queued_on_a_wire_at_exit_reach_the_far_end`] does when
    /// `MLX5_RS_EXIT_SENDS` names the far end (`LID:QPN`): opens the process's device (`MLX5_RS_DEVICES`),
    /// posts [`EXIT_SENDS`] datagrams of 1 KiB to it and exits at once, before any has completed.
    fn send_then_exit(to: &str) -> ! {
        use crate::{wr, Access, AhAttr, QpCap, QpType};
        let (lid, qpn) = to.split_once(':').expect("LID:QPN");
        let (lid, qpn): (u16, u32) = (lid.parse().unwrap(), qpn.parse().unwrap());
        let ctx = DeviceRegistry::global().unwrap().devices().remove(0).open().unwrap();
        let cap =
            QpCap { max_send_wr: EXIT_SENDS, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(2 * EXIT_SENDS).unwrap());
        let mut buf = ctx.alloc_buffer(1024).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(QpType::Ud, &cq, &cq, cap).unwrap().activate_ud(EXIT_QKEY).unwrap();
        let ah = pd.create_ah(&AhAttr { dlid: lid, port_num: 1, ..AhAttr::default() }).unwrap();
        let sge = [mr.sge(0, 1024)];
        for i in 0..EXIT_SENDS {
            qp.post_send(&[wr::ud_send(u64::from(i), &sge, ah.dest(qpn, EXIT_QKEY))]).unwrap();
        }
        std::process::exit(0)
    }

    const EXIT_SENDS: u32 = 64;
    const EXIT_QKEY: u32 = 0x1111_1111;

    /// A process that exits right after posting (qperf's server child, whose CM had just posted a DREP) lost
    /// what its wire had not written yet: a NIC sends what was posted. At exit the library now waits for the
    /// wire to take it. The sending process is this test binary again, run for this test with
    /// `MLX5_RS_EXIT_SENDS` set.
    #[test]
    fn frames_queued_on_a_wire_at_exit_reach_the_far_end() {
        use crate::{wr, Access, QpCap, QpType, WorkCompletion};
        if let Ok(to) = std::env::var("MLX5_RS_EXIT_SENDS") {
            send_then_exit(&to);
        }
        let a = registry("sim:link=ib:wire=listen:127.0.0.1:0");
        let da = a.devices().remove(0);
        let ctx = da.open().unwrap();
        let at = da.wire_addr().expect("listening after the open");
        let n = EXIT_SENDS;
        let cap = QpCap { max_send_wr: 1, max_recv_wr: n, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(2 * n).unwrap());
        // Room for each datagram and its GRH slot.
        let slot = 1024 + 40;
        let mut buf = ctx.alloc_buffer(slot * n as usize).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(QpType::Ud, &cq, &cq, cap).unwrap().activate_ud(EXIT_QKEY).unwrap();
        for i in 0..n {
            qp.post_recv(&[wr::recv(u64::from(i), &[mr.sge(i as usize * slot, slot as u32)])]).unwrap();
        }
        let me = ctx.remote_qp(&qp).unwrap();
        let module = module_path!().split_once("::").map_or("", |(_, m)| m);
        let this_test = format!("{module}::frames_queued_on_a_wire_at_exit_reach_the_far_end");
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &this_test, "--test-threads=1"])
            .env("MLX5_RS_DEVICES", format!("sim:link=ib:host=1:wire=connect:{at}"))
            .env("MLX5_RS_EXIT_SENDS", format!("{}:{}", me.lid, me.qpn))
            .output()
            .unwrap();
        assert!(out.status.success(), "the sender: {}", String::from_utf8_lossy(&out.stderr));
        let mut wc = vec![WorkCompletion::default(); n as usize];
        let got = cq.poll_until(&mut wc, n as usize, Duration::from_secs(10)).unwrap();
        assert_eq!(got, n as usize, "datagrams that reached this end of the {n} posted before the sender's exit");
        assert!(wc.iter().all(|w| w.status == crate::WcStatus::Success), "{wc:?}");
    }

    /// Issue 29: both ends of a wire were host 0 unless one said `host=1`, and the connecting open failed.
    #[test]
    fn the_two_ends_of_a_wire_are_different_hosts_without_host() {
        assert_eq!(host_and_timeout("sim").0, 0);
        assert_eq!(host_and_timeout("sim:wire=listen:127.0.0.1:0").0, 0);
        assert_eq!(host_and_timeout("sim:wire=connect:127.0.0.1:9").0, 1);
        // An explicit host= is kept, whichever end.
        assert_eq!(host_and_timeout("sim:host=0:wire=connect:127.0.0.1:9").0, 0);
        assert_eq!(host_and_timeout("sim:host=3:wire=listen:127.0.0.1:0").0, 3);
        // Two programs' configurations, neither naming a host: the connecting open plugs in.
        let a = registry("sim:wire=listen:127.0.0.1:0");
        let da = a.devices().remove(0);
        let ca = da.open().unwrap();
        let at = da.wire_addr().expect("listening after the open");
        let b = registry(&format!("sim:wire=connect:{at}"));
        let cb = b.devices()[0].open().expect("the connecting end plugs in with no host=");
        assert!(da.sim_device().unwrap().wire_wait_peer(Duration::from_secs(10)));
        assert_ne!(ca.query_gid(0).unwrap(), cb.query_gid(0).unwrap(), "two hosts");
    }

    #[test]
    fn both_ends_on_one_host_is_an_error_that_names_the_option() {
        let a = registry("sim:host=1:wire=listen:127.0.0.1:0");
        let da = a.devices().remove(0);
        let _ca = da.open().unwrap();
        let at = da.wire_addr().unwrap();
        let b = registry(&format!("sim:wire=connect:{at}"));
        let e = b.devices()[0].open().unwrap_err().to_string();
        assert!(
            e.contains("is simulated host 1 too") && e.contains("another host= in MLX5_RS_DEVICES (e.g. host=2)"),
            "{e}"
        );
    }

    /// Issue 29: `wire=connect` failed at once when its listener was not up; it now waits `connect_timeout`.
    #[test]
    fn a_connecting_end_waits_connect_timeout_for_its_listener_and_says_so() {
        assert_eq!(host_and_timeout("sim:wire=connect:127.0.0.1:9").1, WIRE_CONNECT_TIMEOUT);
        assert_eq!(host_and_timeout("sim:connect_timeout=7:wire=connect:127.0.0.1:9").1, Duration::from_secs(7));
        for bad in ["sim:connect_timeout=0", "sim:connect_timeout=x:wire=connect:h:1", "sim:connect_timeout=3601"] {
            let e = DeviceSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains("connect_timeout is not a number of seconds from 1 to 3600"), "{bad}: {e}");
        }
        // Nobody listens on port 1: the open gives up after a second, saying how long and how often it tried.
        let e = registry("sim:connect_timeout=1:wire=connect:127.0.0.1:1").devices()[0].open().unwrap_err().to_string();
        assert!(e.contains("no listener at 127.0.0.1:1 after 1.") && e.contains(" attempts): "), "{e}");
        assert!(e.contains("connect_timeout=S in MLX5_RS_DEVICES waits longer"), "{e}");
        // The connecting program started first: its open plugs in once the listener comes up.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let connecting = std::thread::spawn(move || {
            let b = registry(&format!("sim:wire=connect:127.0.0.1:{port}"));
            let dev = b.devices().remove(0);
            dev.open().map(|_| ()).map_err(|e| e.to_string())
        });
        // Only orders the two starts; nothing depends on how long it is.
        std::thread::sleep(Duration::from_millis(300));
        let a = registry(&format!("sim:wire=listen:127.0.0.1:{port}"));
        let da = a.devices().remove(0);
        let _ca = da.open().unwrap();
        connecting.join().unwrap().expect("the connecting end plugs in once the listener is up");
    }

    /// Issue 29: a `wire=connect` device kept its first connection across bring-ups, so a program that closed
    /// and opened it again (qperf, one test after another) talked to a listener that had gone. Its teardown now
    /// unplugs the wire (the listener sees its link go down) and its next open connects afresh.
    #[test]
    fn a_connecting_end_unplugs_at_teardown_and_connects_again_at_its_next_open() {
        let a = registry("sim:wire=listen:127.0.0.1:0");
        let da = a.devices().remove(0);
        let _ca = da.open().unwrap();
        let listener = da.sim_device().unwrap().clone();
        let b = registry(&format!("sim:wire=connect:{}", da.wire_addr().unwrap()));
        let db = b.devices().remove(0);
        let mut peers = Vec::new();
        for _ in 0..2 {
            let cb = db.open().unwrap();
            assert!(listener.wire_wait_peer(Duration::from_secs(10)));
            peers.push(listener.wire_peer().unwrap());
            drop(cb);
            assert!(!db.is_open());
            // The connecting end unplugged before its close returned; the listener's reader sees it soon after.
            let end = std::time::Instant::now() + Duration::from_secs(10);
            while listener.wire_peer().is_some() {
                assert!(std::time::Instant::now() < end, "the listener's link stayed up");
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(db.sim_device().unwrap().wire_peer(), None);
        }
        assert_ne!(peers[0], peers[1], "a new connection at the second open");
    }
}

#[cfg(test)]
mod vector_tests {
    use mlx5_vfio::twin::Twin;
    use mlx5_vfio::{Vfio, VfioOptions};

    const BDF: &str = "0000:03:00.0";

    fn opts_for(cpus: u16) -> VfioOptions {
        VfioOptions { vectors: super::vfio_vectors_wanted(cpus), ..VfioOptions::default() }
    }

    #[test]
    fn vfio_gives_each_completion_vector_its_own_msix_vector_and_the_async_eqs_vector_0() {
        let t = std::sync::Arc::new(Twin::new());
        t.add_device(BDF, 0x15b3, 0x1017, 7, Some("vfio-pci"), 1 << 20);
        // Eight CPUs: nine vectors asked for, nine eventfds wired, eight completion vectors offered.
        let v = Vfio::open_with(t.clone(), BDF.parse().unwrap(), opts_for(8)).unwrap();
        let n = v.irqs.as_ref().unwrap().count();
        assert_eq!((n, t.state().devices[BDF].irq_fds.len()), (9, 9));
        assert_eq!(super::vfio_vector_split(n, 8), (9, 8));
        drop(v);
        // A function with only four: three completion vectors, none sharing the async EQs' vector 0.
        t.state().devices.get_mut(BDF).unwrap().msix = 4;
        let v = Vfio::open_with(t.clone(), BDF.parse().unwrap(), opts_for(8)).unwrap();
        let n = v.irqs.as_ref().unwrap().count();
        assert_eq!(super::vfio_vector_split(n, 8), (4, 3));
        drop(v);
        // One vector: every EQ shares it, one completion vector.
        assert_eq!(super::vfio_vector_split(1, 8), (1, 1));
        assert_eq!(super::vfio_vector_split(0, 0), (1, 1));
    }
}

//! How an IP address names a simulated port: every simulated host's addresses are fixed by
//! `SimConfig::next_host` (host N: 192.168.1.(10+N), node GUID and LID counted up from the default), so the
//! address of a peer gives its port's LID and GID without ARP, and a device's node GUID gives its own addresses.
//! Beyond the simulated fabric (RoCE only), a peer is reachable when a port learned it from ARP or
//! `MLX5_RS_RDMACM_ADDRS` names it; a RoCE port's own address is the one its GID table holds.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};

use mlx5_sim::SimConfig;

/// How many simulated hosts are looked through (the drop-in libibverbs resolves RoCE MACs over the same range).
const HOSTS: usize = 64;

/// A simulated host's port, as a peer's address names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SimHost {
    /// Its index (`MLX5_RS_DEVICES=sim:host=N`).
    pub index: usize,
    /// Its port's LID (InfiniBand).
    pub lid: u16,
    /// Its node GUID.
    pub node_guid: u64,
    /// Its first IPv4 address.
    pub ipv4: Ipv4Addr,
}

fn hosts() -> impl Iterator<Item = (usize, SimConfig)> {
    let mut cfg = SimConfig::default();
    (0..HOSTS).map(move |i| {
        let c = cfg.clone();
        cfg = cfg.next_host();
        (i, c)
    })
}

fn host(i: usize, c: &SimConfig) -> Option<SimHost> {
    let ip = c.ipv4_addrs.first()?;
    Some(SimHost { index: i, lid: c.lid, node_guid: c.node_guid, ipv4: Ipv4Addr::from(*ip) })
}

/// The simulated host whose port has `ip`.
pub(crate) fn host_of_ip(ip: Ipv4Addr) -> Option<SimHost> {
    hosts().find(|(_, c)| c.ipv4_addrs.contains(&ip.octets())).and_then(|(i, c)| host(i, &c))
}

/// The simulated host of a device's node GUID.
pub(crate) fn host_of_guid(node_guid: u64) -> Option<SimHost> {
    hosts().find(|(_, c)| c.node_guid == node_guid).and_then(|(i, c)| host(i, &c))
}

/// The environment variable naming IPv4 peers beyond the simulated fabric, reachable through a RoCE port
/// (comma-separated, e.g. a QEMU guest's `10.0.0.1` on a `wire=qemu` port or on a port's VDE switch): a static neighbour table, as
/// librdmacm's address resolution would find them in the kernel's. The GID is `::ffff:a.b.c.d`; the port's link
/// finds the MAC by ARP.
pub(crate) const ADDRS_ENV: &str = "MLX5_RS_RDMACM_ADDRS";

/// An entry of [`ADDRS_ENV`] that is not an IPv4 address.
#[derive(Debug)]
pub(crate) struct BadAddr {
    pub entry: String,
    pub source: std::net::AddrParseError,
}

impl std::fmt::Display for BadAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{ADDRS_ENV}: {:?} is not an IPv4 address", self.entry)
    }
}

impl std::error::Error for BadAddr {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// The addresses of an [`ADDRS_ENV`] value (empty entries skipped).
pub(crate) fn parse_addrs(v: &str) -> Result<Vec<Ipv4Addr>, BadAddr> {
    v.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|e| e.parse().map_err(|source| BadAddr { entry: e.to_string(), source }))
        .collect()
}

/// The static table, read once; a bad value is logged and leaves it empty (no address is guessed).
fn static_addrs() -> &'static [Ipv4Addr] {
    static T: std::sync::OnceLock<Vec<Ipv4Addr>> = std::sync::OnceLock::new();
    T.get_or_init(|| match std::env::var(ADDRS_ENV) {
        Ok(v) => parse_addrs(&v).unwrap_or_else(|e| {
            log::error!("{e}: the table is ignored");
            Vec::new()
        }),
        Err(_) => Vec::new(),
    })
}

/// Whether `ip`, which no simulated host has, is a neighbour of this process's RoCE ports: learned from ARP on a
/// port's link (a guest that asked for our address), or named by [`ADDRS_ENV`].
pub(crate) fn neighbour(ip: Ipv4Addr) -> bool {
    mlx5_sim::arp_neighbour(ip.octets()).is_some() || static_addrs().contains(&ip)
}

/// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
pub(crate) fn gid_v4(gid: &[u8; 16]) -> Option<Ipv4Addr> {
    (gid[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]).then(|| Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15]))
}

/// Whether `ip` names the process's own port whatever its address: loopback and the wildcard.
pub(crate) fn is_local_alias(ip: Ipv4Addr) -> bool {
    ip.is_loopback() || ip.is_unspecified()
}

/// The RoCE GID of an IPv4 address (`::ffff:a.b.c.d`, the GID table's IPv4 entries).
pub(crate) fn v4_gid(ip: Ipv4Addr) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&ip.octets());
    g
}

/// A `sockaddr_in` (or `sockaddr_in6`) read from C; `None` for another family or a NULL pointer.
///
/// # Safety
/// `sa` is NULL or points to a socket address at least as long as its family's structure.
pub(crate) unsafe fn read_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's socket address; its family says how long it is.
    match c_int::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(s.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            let ip = std::net::Ipv6Addr::from(s.sin6_addr.s6_addr);
            Some(SocketAddr::new(IpAddr::V6(ip), u16::from_be(s.sin6_port)))
        }
        _ => None,
    }
}

use std::ffi::c_int;

/// Writes `a` as a `sockaddr_in`/`sockaddr_in6` into a `sockaddr_storage`.
pub(crate) fn write_storage(out: &mut libc::sockaddr_storage, a: SocketAddr) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    *out = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v4) => {
            let p: *mut libc::sockaddr_storage = out;
            // SAFETY: a sockaddr_storage is large and aligned enough for every socket address.
            let s = unsafe { &mut *p.cast::<libc::sockaddr_in>() };
            s.sin_family = libc::AF_INET as libc::sa_family_t;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
        }
        SocketAddr::V6(v6) => {
            let p: *mut libc::sockaddr_storage = out;
            // SAFETY: as above.
            let s = unsafe { &mut *p.cast::<libc::sockaddr_in6>() };
            s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
        }
    }
}

/// The socket address a `sockaddr_storage` holds.
pub(crate) fn read_storage(s: &libc::sockaddr_storage) -> Option<SocketAddr> {
    let p: *const libc::sockaddr_storage = s;
    // SAFETY: a sockaddr_storage holds any family's address in full.
    unsafe { read_sockaddr(p.cast()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_static_neighbour_table_takes_ipv4_addresses_only() {
        let t = parse_addrs(" 10.0.0.1,,10.0.0.3 ").unwrap();
        assert_eq!(t, [Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 3)]);
        assert!(parse_addrs("").unwrap().is_empty());
        let e = parse_addrs("10.0.0.1,fe80::1").unwrap_err();
        assert_eq!(e.entry, "fe80::1");
        assert!(e.to_string().contains(ADDRS_ENV));
        assert!(std::error::Error::source(&e).is_some());
        assert!(parse_addrs("10.0.0.256").is_err());
    }

    #[test]
    fn addresses_name_simulated_hosts() {
        let h0 = host_of_ip(Ipv4Addr::new(192, 168, 1, 10)).unwrap();
        let h1 = host_of_ip(Ipv4Addr::new(192, 168, 1, 11)).unwrap();
        let d = SimConfig::default();
        assert_eq!((h0.index, h0.lid, h0.node_guid), (0, d.lid, d.node_guid));
        assert_eq!((h1.index, h1.lid, h1.node_guid), (1, d.lid + 1, d.node_guid + 1));
        assert_eq!(host_of_guid(d.node_guid + 1), Some(h1));
        assert_eq!(host_of_ip(Ipv4Addr::new(10, 0, 0, 1)), None, "no simulated host has it");
        assert!(is_local_alias(Ipv4Addr::LOCALHOST) && is_local_alias(Ipv4Addr::UNSPECIFIED));
        assert_eq!(v4_gid(h1.ipv4)[10..], [0xff, 0xff, 192, 168, 1, 11]);
        assert_eq!(gid_v4(&v4_gid(h1.ipv4)), Some(h1.ipv4));
        let mut link_local = [0u8; 16];
        link_local[..2].copy_from_slice(&[0xfe, 0x80]);
        assert_eq!(gid_v4(&link_local), None);
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut s: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let a: SocketAddr = "192.168.1.11:7174".parse().unwrap();
        write_storage(&mut s, a);
        assert_eq!(read_storage(&s), Some(a));
    }
}

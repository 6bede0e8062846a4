//! How rdma_cm names IP connections in the CM (what Linux's `cma.c` puts on the wire, so a peer running Linux's
//! rdma_cm understands ours): the service ID from the port space and port, and the header at the start of a
//! REQ's (and SIDR_REQ's) private data carrying both IP addresses and the source port.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::mad::MadError;

/// Port spaces (`enum rdma_ucm_port_space`).
pub mod ps {
    /// `RDMA_PS_IPOIB`.
    pub const IPOIB: u16 = 0x0002;
    /// `RDMA_PS_IB`.
    pub const IB: u16 = 0x013f;
    /// `RDMA_PS_TCP`: connected (RC) services.
    pub const TCP: u16 = 0x0106;
    /// `RDMA_PS_UDP`: datagram services (SIDR).
    pub const UDP: u16 = 0x0111;
}

/// The header's length: version, IP version, port, two 16-byte addresses.
pub const CMA_HDR_LEN: usize = 36;
/// `cma_version` of every header (`CMA_VERSION`).
pub const CMA_VERSION: u8 = 0;

/// The service ID of a port in a port space (`cma_get_service_id`): the space above the port in the low 32 bits.
pub fn service_id(port_space: u16, port: u16) -> u64 {
    u64::from(port_space) << 16 | u64::from(port)
}

/// The port space and port a service ID names, if it is one of rdma_cm's (high 32 bits zero).
pub fn port_of_service(service_id: u64) -> Option<(u16, u16)> {
    (service_id >> 32 == 0).then_some(((service_id >> 16) as u16, service_id as u16))
}

/// rdma_cm's header in a REQ's private data (`struct cma_hdr`): the requester's source port and both addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmaHdr {
    /// The requester's port (the destination port is in the service ID).
    pub src_port: u16,
    /// The requester's address.
    pub src: IpAddr,
    /// The address it connects to.
    pub dst: IpAddr,
}

impl CmaHdr {
    /// Writes the header into the first [`CMA_HDR_LEN`] bytes of `b`; both addresses must be of one family.
    pub fn write(&self, b: &mut [u8]) -> Result<(), MadError> {
        let ipv = match (self.src, self.dst) {
            (IpAddr::V4(_), IpAddr::V4(_)) => 4u8,
            (IpAddr::V6(_), IpAddr::V6(_)) => 6,
            _ => return Err(MadError::InvalidField { what: "cma_hdr address families", value: 0 }),
        };
        if b.len() < CMA_HDR_LEN {
            return Err(MadError::Truncated { len: b.len(), need: CMA_HDR_LEN });
        }
        b[..CMA_HDR_LEN].fill(0);
        b[0] = CMA_VERSION;
        b[1] = ipv << 4;
        b[2..4].copy_from_slice(&self.src_port.to_be_bytes());
        for (off, a) in [(4, self.src), (20, self.dst)] {
            match a {
                // IPv4 sits in the last 4 bytes of its 16 (`cma_ip_addr.ip4`).
                IpAddr::V4(v4) => b[off + 12..off + 16].copy_from_slice(&v4.octets()),
                IpAddr::V6(v6) => b[off..off + 16].copy_from_slice(&v6.octets()),
            }
        }
        Ok(())
    }

    /// Reads the header from a REQ's private data: version 0, IP version 4 or 6 (`cma_check_hdr`).
    pub fn parse(b: &[u8]) -> Result<CmaHdr, MadError> {
        if b.len() < CMA_HDR_LEN {
            return Err(MadError::Truncated { len: b.len(), need: CMA_HDR_LEN });
        }
        if b[0] != CMA_VERSION {
            return Err(MadError::InvalidField { what: "cma_version", value: b[0].into() });
        }
        let addr = |off: usize, v4: bool| -> IpAddr {
            if v4 {
                IpAddr::V4(Ipv4Addr::new(b[off + 12], b[off + 13], b[off + 14], b[off + 15]))
            } else {
                let mut o = [0u8; 16];
                o.copy_from_slice(&b[off..off + 16]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
        };
        let v4 = match b[1] >> 4 {
            4 => true,
            6 => false,
            n => return Err(MadError::InvalidField { what: "cma_hdr IP version", value: n.into() }),
        };
        Ok(CmaHdr { src_port: u16::from_be_bytes([b[2], b[3]]), src: addr(4, v4), dst: addr(20, v4) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_ids_are_the_port_space_above_the_port() {
        // rping's default port 7174 in the TCP space.
        assert_eq!(service_id(ps::TCP, 7174), 0x0106_1c06);
        assert_eq!(port_of_service(0x0106_1c06), Some((ps::TCP, 7174)));
        assert_eq!(port_of_service(0x0002_c903_0000_0001), None, "not one of rdma_cm's");
    }

    #[test]
    fn the_cma_header_round_trips_and_bad_ones_are_refused() {
        let h = CmaHdr { src_port: 40000, src: "192.168.7.1".parse().unwrap(), dst: "192.168.7.2".parse().unwrap() };
        let mut b = [0xffu8; 92];
        h.write(&mut b).unwrap();
        assert_eq!(&b[..4], &[0, 0x40, 0x9c, 0x40]);
        assert_eq!(&b[4..20], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 168, 7, 1]);
        assert_eq!(&b[36..], &[0xff; 56], "the application's bytes after the header are kept");
        assert_eq!(CmaHdr::parse(&b), Ok(h));
        let h6 = CmaHdr { src_port: 1, src: "fe80::1".parse().unwrap(), dst: "fe80::2".parse().unwrap() };
        h6.write(&mut b).unwrap();
        assert_eq!(CmaHdr::parse(&b), Ok(h6));
        let mixed = CmaHdr { dst: "fe80::2".parse().unwrap(), ..h };
        assert!(mixed.write(&mut b).is_err());
        assert_eq!(CmaHdr::parse(&b[..35]), Err(MadError::Truncated { len: 35, need: CMA_HDR_LEN }));
        let mut bad = b;
        bad[1] = 5 << 4;
        assert!(matches!(CmaHdr::parse(&bad), Err(MadError::InvalidField { value: 5, .. })));
        let mut bad = b;
        bad[0] = 1;
        assert!(matches!(CmaHdr::parse(&bad), Err(MadError::InvalidField { what: "cma_version", .. })));
    }
}

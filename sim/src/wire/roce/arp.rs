//! ARP for IPv4 over Ethernet (RFC 826): the only kind a RoCE port needs, to answer for its own addresses and to
//! resolve its peer's MAC. Other hardware or protocol types are [`Error::Malformed`] for this view.

use super::error::Error;
use super::ether::{mac, Mac};

wire_code! {
    /// The ARP operation.
    pub Operation: u16 { Request = 1, Reply = 2, }
}

mod field {
    pub(super) type Field = core::ops::Range<usize>;
    pub(super) const HTYPE: Field = 0..2;
    pub(super) const PTYPE: Field = 2..4;
    pub(super) const HLEN: usize = 4;
    pub(super) const PLEN: usize = 5;
    pub(super) const OPER: Field = 6..8;
    pub(super) const SHA: Field = 8..14;
    pub(super) const SPA: Field = 14..18;
    pub(super) const THA: Field = 18..24;
    pub(super) const TPA: Field = 24..28;
}

/// Bytes of an Ethernet/IPv4 ARP packet.
pub const PACKET_LEN: usize = 28;
const HTYPE_ETHERNET: u16 = 1;
const PTYPE_IPV4: u16 = 0x0800;

/// A checked view of an ARP packet.
#[derive(Debug, Clone, Copy)]
pub struct ArpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> ArpPacket<T> {
    /// The bytes as a packet, unchecked.
    pub fn new_unchecked(buffer: T) -> Self {
        ArpPacket { buffer }
    }

    /// The bytes as a packet, after checking the length and that it is Ethernet/IPv4.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = ArpPacket { buffer };
        let b = p.buffer.as_ref();
        if b.len() < PACKET_LEN {
            return Err(Error::Truncated);
        }
        if be16(&b[field::HTYPE]) != HTYPE_ETHERNET
            || be16(&b[field::PTYPE]) != PTYPE_IPV4
            || b[field::HLEN] != 6
            || b[field::PLEN] != 4
        {
            return Err(Error::Malformed);
        }
        Ok(p)
    }

    /// The operation.
    pub fn operation(&self) -> Operation {
        Operation::from(be16(&self.buffer.as_ref()[field::OPER]))
    }

    /// Sender hardware address.
    pub fn sender_mac(&self) -> Mac {
        mac(&self.buffer.as_ref()[field::SHA])
    }

    /// Sender protocol address.
    pub fn sender_ip(&self) -> [u8; 4] {
        ip4(&self.buffer.as_ref()[field::SPA])
    }

    /// Target hardware address.
    pub fn target_mac(&self) -> Mac {
        mac(&self.buffer.as_ref()[field::THA])
    }

    /// Target protocol address.
    pub fn target_ip(&self) -> [u8; 4] {
        ip4(&self.buffer.as_ref()[field::TPA])
    }
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

fn ip4(b: &[u8]) -> [u8; 4] {
    [b[0], b[1], b[2], b[3]]
}

/// An Ethernet/IPv4 ARP packet as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArpRepr {
    /// Request or reply.
    pub operation: Operation,
    /// Who sends it.
    pub sender_mac: Mac,
    /// The sender's IPv4 address.
    pub sender_ip: [u8; 4],
    /// The MAC asked about (zero in a request).
    pub target_mac: Mac,
    /// The IPv4 address asked about.
    pub target_ip: [u8; 4],
}

impl ArpRepr {
    /// The values of a checked packet; an unknown operation is refused.
    pub fn parse<T: AsRef<[u8]>>(p: &ArpPacket<T>) -> Result<ArpRepr, Error> {
        let operation = p.operation();
        if let Operation::Unknown(_) = operation {
            return Err(Error::Malformed);
        }
        Ok(ArpRepr {
            operation,
            sender_mac: p.sender_mac(),
            sender_ip: p.sender_ip(),
            target_mac: p.target_mac(),
            target_ip: p.target_ip(),
        })
    }

    /// Writes the packet into the first [`PACKET_LEN`] bytes of `buf` (which must be that long).
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..PACKET_LEN];
        b[field::HTYPE].copy_from_slice(&HTYPE_ETHERNET.to_be_bytes());
        b[field::PTYPE].copy_from_slice(&PTYPE_IPV4.to_be_bytes());
        b[field::HLEN] = 6;
        b[field::PLEN] = 4;
        b[field::OPER].copy_from_slice(&u16::from(self.operation).to_be_bytes());
        b[field::SHA].copy_from_slice(&self.sender_mac);
        b[field::SPA].copy_from_slice(&self.sender_ip);
        b[field::THA].copy_from_slice(&self.target_mac);
        b[field::TPA].copy_from_slice(&self.target_ip);
    }

    /// The reply a port with `mac` owning `ip` gives to this packet: `Some` only for a request for `ip`.
    pub fn answer(&self, mac: Mac, ip: [u8; 4]) -> Option<ArpRepr> {
        if self.operation != Operation::Request || self.target_ip != ip {
            return None;
        }
        Some(ArpRepr {
            operation: Operation::Reply,
            sender_mac: mac,
            sender_ip: ip,
            target_mac: self.sender_mac,
            target_ip: self.sender_ip,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Who has 10.0.0.2? Tell 10.0.0.1 (52:54:00:00:00:01).
    static REQUEST: [u8; 28] = [
        0x00, 0x01, 0x08, 0x00, 0x06, 0x04, 0x00, 0x01, // Ethernet, IPv4, 6, 4, request
        0x52, 0x54, 0x00, 0x00, 0x00, 0x01, 10, 0, 0, 1, // sender
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 10, 0, 0, 2, // target
    ];

    fn request() -> ArpRepr {
        ArpRepr {
            operation: Operation::Request,
            sender_mac: [0x52, 0x54, 0, 0, 0, 1],
            sender_ip: [10, 0, 0, 1],
            target_mac: [0; 6],
            target_ip: [10, 0, 0, 2],
        }
    }

    #[test]
    fn parse_fixture() {
        let p = ArpPacket::new_checked(&REQUEST[..]).unwrap();
        assert_eq!(ArpRepr::parse(&p).unwrap(), request());
    }

    #[test]
    fn emit_fixture() {
        let mut b = [0xeeu8; 28];
        request().emit(&mut b);
        assert_eq!(b, REQUEST);
    }

    #[test]
    fn answers_only_for_its_address() {
        let me = [2, 0, 0, 0, 0, 2];
        let reply = request().answer(me, [10, 0, 0, 2]).unwrap();
        assert_eq!(reply.operation, Operation::Reply);
        assert_eq!((reply.sender_mac, reply.sender_ip), (me, [10, 0, 0, 2]));
        assert_eq!((reply.target_mac, reply.target_ip), ([0x52, 0x54, 0, 0, 0, 1], [10, 0, 0, 1]));
        assert_eq!(request().answer(me, [10, 0, 0, 3]), None);
        assert_eq!(reply.answer(me, [10, 0, 0, 2]), None);
    }

    #[test]
    fn refuses_other_kinds() {
        assert_eq!(ArpPacket::new_checked(&REQUEST[..27]).unwrap_err(), Error::Truncated);
        let mut b = REQUEST;
        b[1] = 6; // IEEE 802 hardware
        assert_eq!(ArpPacket::new_checked(&b[..]).unwrap_err(), Error::Malformed);
        let mut b = REQUEST;
        b[7] = 9;
        let p = ArpPacket::new_checked(&b[..]).unwrap();
        assert_eq!(p.operation(), Operation::Unknown(9));
        assert_eq!(ArpRepr::parse(&p).unwrap_err(), Error::Malformed);
    }
}

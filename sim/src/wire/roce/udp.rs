//! UDP (RFC 768). RoCEv2 runs over destination port 4791; the sender sends checksum 0 (as `rdma_rxe` does, the
//! ICRC protecting the payload), and a receiver checks a non-zero checksum.

use super::error::Error;
use super::ip::{fold, sum};

/// The RoCEv2 destination port.
pub const ROCE_PORT: u16 = 4791;
/// Bytes of the UDP header.
pub const HEADER_LEN: usize = 8;

mod field {
    pub(super) type Field = core::ops::Range<usize>;
    pub(super) const SRC_PORT: Field = 0..2;
    pub(super) const DST_PORT: Field = 2..4;
    pub(super) const LENGTH: Field = 4..6;
    pub(super) const CHECKSUM: Field = 6..8;
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// A checked view of a UDP datagram: the header is complete and its length is at least the header and at most
/// the buffer.
#[derive(Debug, Clone, Copy)]
pub struct UdpPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> UdpPacket<T> {
    /// The bytes as a datagram, unchecked.
    pub fn new_unchecked(buffer: T) -> Self {
        UdpPacket { buffer }
    }

    /// The bytes as a datagram, after the length checks.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = UdpPacket { buffer };
        let b = p.buffer.as_ref();
        if b.len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        let len = usize::from(p.len());
        if len < HEADER_LEN {
            return Err(Error::Malformed);
        }
        if len > b.len() {
            return Err(Error::Truncated);
        }
        Ok(p)
    }

    /// Source port.
    pub fn src_port(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::SRC_PORT])
    }

    /// Destination port.
    pub fn dst_port(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::DST_PORT])
    }

    /// Length of header and payload.
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::LENGTH])
    }

    /// The checksum as carried (0: none).
    pub fn checksum(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::CHECKSUM])
    }

    /// Whether the checksum is absent (0) or right for the pseudo-header sum `pseudo` (from
    /// [`Ipv4Repr::pseudo_sum`](super::ip::Ipv4Repr::pseudo_sum) or the IPv6 one).
    pub fn verify_checksum(&self, pseudo: u32) -> bool {
        self.checksum() == 0 || fold(sum(pseudo, &self.buffer.as_ref()[..usize::from(self.len())])) == 0
    }

    /// The payload, as long as the length says.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.len())]
    }
}

/// A UDP header as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpRepr {
    /// Source port (RoCEv2: the sender's flow entropy).
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Bytes after the header.
    pub payload_len: u16,
}

impl UdpRepr {
    /// The values of a checked datagram whose checksum is absent or right for `pseudo`.
    pub fn parse<T: AsRef<[u8]>>(p: &UdpPacket<T>, pseudo: u32) -> Result<UdpRepr, Error> {
        if !p.verify_checksum(pseudo) {
            return Err(Error::Checksum);
        }
        Ok(Self::parse_trusted(p))
    }

    /// The values of a checked datagram, its checksum taken as right (a datagram this process just built).
    pub fn parse_trusted<T: AsRef<[u8]>>(p: &UdpPacket<T>) -> UdpRepr {
        UdpRepr { src_port: p.src_port(), dst_port: p.dst_port(), payload_len: p.len() - HEADER_LEN as u16 }
    }

    /// Writes the header, checksum 0, into the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..HEADER_LEN];
        b[field::SRC_PORT].copy_from_slice(&self.src_port.to_be_bytes());
        b[field::DST_PORT].copy_from_slice(&self.dst_port.to_be_bytes());
        b[field::LENGTH].copy_from_slice(&(self.payload_len + HEADER_LEN as u16).to_be_bytes());
        b[field::CHECKSUM].copy_from_slice(&[0, 0]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::ip::{Ipv4Repr, PROTO_UDP};
    use super::*;

    // 49441 -> 4791, 4 bytes of payload, no checksum.
    static BYTES: [u8; 12] = [0xc1, 0x21, 0x12, 0xb7, 0x00, 0x0c, 0x00, 0x00, 1, 2, 3, 4];

    #[test]
    fn fixtures_both_ways() {
        let p = UdpPacket::new_checked(&BYTES[..]).unwrap();
        let r = UdpRepr::parse(&p, 0).unwrap();
        assert_eq!(r, UdpRepr { src_port: 49441, dst_port: ROCE_PORT, payload_len: 4 });
        assert_eq!(p.payload(), &[1, 2, 3, 4]);
        let mut b = [0u8; 12];
        b[8..].copy_from_slice(&[1, 2, 3, 4]);
        r.emit(&mut b);
        assert_eq!(b, BYTES);
    }

    #[test]
    fn a_carried_checksum_is_checked() {
        let ip = Ipv4Repr {
            src: [10, 0, 0, 2],
            dst: [10, 0, 0, 1],
            protocol: PROTO_UDP,
            payload_len: 12,
            tos: 0,
            ttl: 64,
            ident: 0,
            dont_frag: true,
        };
        let pseudo = ip.pseudo_sum(12);
        let mut b = BYTES;
        let c = fold(sum(pseudo, &b));
        b[6..8].copy_from_slice(&c.to_be_bytes());
        let p = UdpPacket::new_checked(&b[..]).unwrap();
        assert!(UdpRepr::parse(&p, pseudo).is_ok());
        b[11] ^= 0x80;
        let p = UdpPacket::new_checked(&b[..]).unwrap();
        assert_eq!(UdpRepr::parse(&p, pseudo).unwrap_err(), Error::Checksum);
    }

    #[test]
    fn length_checks() {
        assert_eq!(UdpPacket::new_checked(&BYTES[..7]).unwrap_err(), Error::Truncated);
        assert_eq!(UdpPacket::new_checked(&BYTES[..11]).unwrap_err(), Error::Truncated);
        let mut b = BYTES;
        b[5] = 7;
        assert_eq!(UdpPacket::new_checked(&b[..]).unwrap_err(), Error::Malformed);
    }
}

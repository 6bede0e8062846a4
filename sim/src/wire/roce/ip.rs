//! IPv4 (RFC 791, a 20-byte header: RoCEv2 never sends options or fragments) and IPv6 (RFC 8200, the fixed header,
//! no extension headers), and the Internet checksum both use.

use super::error::Error;

/// IP protocol number of UDP.
pub const PROTO_UDP: u8 = 17;

/// Bytes of the IPv4 header this view accepts (IHL 5).
pub const IPV4_HEADER_LEN: usize = 20;
/// Bytes of the IPv6 fixed header.
pub const IPV6_HEADER_LEN: usize = 40;

/// Adds `data` to a ones-complement running sum (odd lengths padded with a zero byte). The result is folded to
/// 16 bits, so a caller may add a few more 16-bit values before [`fold`].
pub fn sum(acc: u32, data: &[u8]) -> u32 {
    // Eight bytes at a time: the ones-complement sum of the 32-bit big-endian words, in a 64-bit accumulator
    // that cannot overflow (a frame is far below 2^32 words), folds to that of the 16-bit words.
    let mut wide = u64::from(acc);
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_be_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        wide += (v >> 32) + (v & 0xffff_ffff);
    }
    let mut pairs = words.remainder().chunks_exact(2);
    for c in &mut pairs {
        wide += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = pairs.remainder() {
        wide += u64::from(*last) << 8;
    }
    while wide > 0xffff {
        wide = (wide & 0xffff) + (wide >> 16);
    }
    wide as u32
}

/// Folds a running sum into the 16-bit ones-complement checksum.
pub fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

mod v4 {
    pub(super) type Field = core::ops::Range<usize>;
    pub(super) const VER_IHL: usize = 0;
    pub(super) const TOS: usize = 1;
    pub(super) const LENGTH: Field = 2..4;
    pub(super) const IDENT: Field = 4..6;
    pub(super) const FLAGS_FRAG: Field = 6..8;
    pub(super) const TTL: usize = 8;
    pub(super) const PROTOCOL: usize = 9;
    pub(super) const CHECKSUM: Field = 10..12;
    pub(super) const SRC: Field = 12..16;
    pub(super) const DST: Field = 16..20;
}

const DF: u16 = 0x4000;
const MF: u16 = 0x2000;
const FRAG_OFFSET: u16 = 0x1fff;

/// A checked view of an IPv4 packet: version 4, IHL 5, a total length within the buffer, and not a fragment. The
/// header checksum is checked by [`Ipv4Repr::parse`].
#[derive(Debug, Clone, Copy)]
pub struct Ipv4Packet<T: AsRef<[u8]>> {
    buffer: T,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

impl<T: AsRef<[u8]>> Ipv4Packet<T> {
    /// The bytes as a packet, unchecked.
    pub fn new_unchecked(buffer: T) -> Self {
        Ipv4Packet { buffer }
    }

    /// The bytes as a packet, after the length and shape checks.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Ipv4Packet { buffer };
        let b = p.buffer.as_ref();
        if b.len() < IPV4_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if b[v4::VER_IHL] != 0x45 {
            return Err(Error::Malformed);
        }
        let total = usize::from(p.total_len());
        if total < IPV4_HEADER_LEN {
            return Err(Error::Malformed);
        }
        if total > b.len() {
            return Err(Error::Truncated);
        }
        let ff = be16(&b[v4::FLAGS_FRAG]);
        if ff & (MF | FRAG_OFFSET) != 0 {
            return Err(Error::Malformed);
        }
        Ok(p)
    }

    /// Total length (header and payload).
    pub fn total_len(&self) -> u16 {
        be16(&self.buffer.as_ref()[v4::LENGTH])
    }

    /// The type-of-service byte: DSCP in the upper six bits, ECN in the lower two.
    pub fn tos(&self) -> u8 {
        self.buffer.as_ref()[v4::TOS]
    }

    /// Identification.
    pub fn ident(&self) -> u16 {
        be16(&self.buffer.as_ref()[v4::IDENT])
    }

    /// Don't-fragment flag.
    pub fn dont_frag(&self) -> bool {
        be16(&self.buffer.as_ref()[v4::FLAGS_FRAG]) & DF != 0
    }

    /// Time to live.
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[v4::TTL]
    }

    /// The payload's protocol.
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[v4::PROTOCOL]
    }

    /// The header checksum as carried.
    pub fn checksum(&self) -> u16 {
        be16(&self.buffer.as_ref()[v4::CHECKSUM])
    }

    /// Source address.
    pub fn src(&self) -> [u8; 4] {
        let b = &self.buffer.as_ref()[v4::SRC];
        [b[0], b[1], b[2], b[3]]
    }

    /// Destination address.
    pub fn dst(&self) -> [u8; 4] {
        let b = &self.buffer.as_ref()[v4::DST];
        [b[0], b[1], b[2], b[3]]
    }

    /// Whether the header checksum is right.
    pub fn verify_checksum(&self) -> bool {
        fold(sum(0, &self.buffer.as_ref()[..IPV4_HEADER_LEN])) == 0
    }

    /// The payload, as long as the total length says (bytes after it, e.g. Ethernet padding, are not part of it).
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[IPV4_HEADER_LEN..usize::from(self.total_len())]
    }
}

/// An IPv4 header as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv4Repr {
    /// Source address.
    pub src: [u8; 4],
    /// Destination address.
    pub dst: [u8; 4],
    /// The payload's protocol.
    pub protocol: u8,
    /// Bytes after the header.
    pub payload_len: u16,
    /// DSCP (upper six bits) and ECN.
    pub tos: u8,
    /// Time to live.
    pub ttl: u8,
    /// Identification.
    pub ident: u16,
    /// Don't fragment.
    pub dont_frag: bool,
}

impl Ipv4Repr {
    /// The values of a checked packet whose header checksum is right.
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv4Packet<T>) -> Result<Ipv4Repr, Error> {
        if !p.verify_checksum() {
            return Err(Error::Checksum);
        }
        Ok(Ipv4Repr {
            src: p.src(),
            dst: p.dst(),
            protocol: p.protocol(),
            payload_len: p.total_len() - IPV4_HEADER_LEN as u16,
            tos: p.tos(),
            ttl: p.ttl(),
            ident: p.ident(),
            dont_frag: p.dont_frag(),
        })
    }

    /// Writes the 20-byte header, checksum included, into the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..IPV4_HEADER_LEN];
        b[v4::VER_IHL] = 0x45;
        b[v4::TOS] = self.tos;
        b[v4::LENGTH].copy_from_slice(&(self.payload_len + IPV4_HEADER_LEN as u16).to_be_bytes());
        b[v4::IDENT].copy_from_slice(&self.ident.to_be_bytes());
        b[v4::FLAGS_FRAG].copy_from_slice(&(if self.dont_frag { DF } else { 0 }).to_be_bytes());
        b[v4::TTL] = self.ttl;
        b[v4::PROTOCOL] = self.protocol;
        b[v4::CHECKSUM].copy_from_slice(&[0, 0]);
        b[v4::SRC].copy_from_slice(&self.src);
        b[v4::DST].copy_from_slice(&self.dst);
        let c = fold(sum(0, b));
        b[v4::CHECKSUM].copy_from_slice(&c.to_be_bytes());
    }

    /// The UDP pseudo-header sum for a UDP datagram of `udp_len` bytes.
    pub fn pseudo_sum(&self, udp_len: u16) -> u32 {
        let acc = sum(sum(0, &self.src), &self.dst);
        acc + u32::from(self.protocol) + u32::from(udp_len)
    }
}

mod v6 {
    pub(super) type Field = core::ops::Range<usize>;
    pub(super) const VER_TC_FLOW: Field = 0..4;
    pub(super) const LENGTH: Field = 4..6;
    pub(super) const NEXT_HEADER: usize = 6;
    pub(super) const HOP_LIMIT: usize = 7;
    pub(super) const SRC: Field = 8..24;
    pub(super) const DST: Field = 24..40;
}

/// A checked view of an IPv6 packet: version 6 and a payload length within the buffer.
#[derive(Debug, Clone, Copy)]
pub struct Ipv6Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    /// The bytes as a packet, unchecked.
    pub fn new_unchecked(buffer: T) -> Self {
        Ipv6Packet { buffer }
    }

    /// The bytes as a packet, after the length and version checks.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Ipv6Packet { buffer };
        let b = p.buffer.as_ref();
        if b.len() < IPV6_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if b[0] >> 4 != 6 {
            return Err(Error::Malformed);
        }
        if IPV6_HEADER_LEN + usize::from(p.payload_len()) > b.len() {
            return Err(Error::Truncated);
        }
        Ok(p)
    }

    fn word0(&self) -> u32 {
        let b = &self.buffer.as_ref()[v6::VER_TC_FLOW];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Traffic class (DSCP and ECN).
    pub fn traffic_class(&self) -> u8 {
        (self.word0() >> 20) as u8
    }

    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        self.word0() & 0xf_ffff
    }

    /// Payload length.
    pub fn payload_len(&self) -> u16 {
        be16(&self.buffer.as_ref()[v6::LENGTH])
    }

    /// Next header.
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[v6::NEXT_HEADER]
    }

    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[v6::HOP_LIMIT]
    }

    /// Source address.
    pub fn src(&self) -> [u8; 16] {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.buffer.as_ref()[v6::SRC]);
        a
    }

    /// Destination address.
    pub fn dst(&self) -> [u8; 16] {
        let mut a = [0u8; 16];
        a.copy_from_slice(&self.buffer.as_ref()[v6::DST]);
        a
    }

    /// The payload, as long as the payload length says.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[IPV6_HEADER_LEN..IPV6_HEADER_LEN + usize::from(self.payload_len())]
    }
}

/// An IPv6 fixed header as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Repr {
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
    /// Next header (the payload's protocol).
    pub next_header: u8,
    /// Bytes after the header.
    pub payload_len: u16,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
}

impl Ipv6Repr {
    /// The values of a checked packet.
    pub fn parse<T: AsRef<[u8]>>(p: &Ipv6Packet<T>) -> Ipv6Repr {
        Ipv6Repr {
            src: p.src(),
            dst: p.dst(),
            next_header: p.next_header(),
            payload_len: p.payload_len(),
            traffic_class: p.traffic_class(),
            flow_label: p.flow_label(),
            hop_limit: p.hop_limit(),
        }
    }

    /// Writes the 40-byte header into the start of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..IPV6_HEADER_LEN];
        let w0 = 6u32 << 28 | u32::from(self.traffic_class) << 20 | (self.flow_label & 0xf_ffff);
        b[v6::VER_TC_FLOW].copy_from_slice(&w0.to_be_bytes());
        b[v6::LENGTH].copy_from_slice(&self.payload_len.to_be_bytes());
        b[v6::NEXT_HEADER] = self.next_header;
        b[v6::HOP_LIMIT] = self.hop_limit;
        b[v6::SRC].copy_from_slice(&self.src);
        b[v6::DST].copy_from_slice(&self.dst);
    }

    /// The UDP pseudo-header sum for a UDP datagram of `udp_len` bytes.
    pub fn pseudo_sum(&self, udp_len: u16) -> u32 {
        let acc = sum(sum(0, &self.src), &self.dst);
        acc + u32::from(self.next_header) + u32::from(udp_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // 10.0.0.2 -> 10.0.0.1, UDP, 108 bytes of payload, TOS 0x68 (DSCP 26), DF, TTL 64, ID 0x1234.
    static V4: [u8; 20] =
        [0x45, 0x68, 0x00, 0x80, 0x12, 0x34, 0x40, 0x00, 0x40, 0x11, 0x13, 0xcf, 10, 0, 0, 2, 10, 0, 0, 1];

    fn v4() -> Ipv4Repr {
        Ipv4Repr {
            src: [10, 0, 0, 2],
            dst: [10, 0, 0, 1],
            protocol: PROTO_UDP,
            payload_len: 108,
            tos: 0x68,
            ttl: 64,
            ident: 0x1234,
            dont_frag: true,
        }
    }

    #[test]
    fn the_wide_sum_is_the_sum_of_16_bit_words() {
        // The plain definition: 16-bit big-endian words, an odd byte padded with zero.
        fn words(acc: u32, d: &[u8]) -> u32 {
            let mut a = acc;
            for c in d.chunks(2) {
                a += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
            }
            a
        }
        let mut x = 0x1234_5678u32;
        let data: Vec<u8> = (0..3000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        for len in [0, 1, 2, 7, 8, 9, 15, 16, 17, 1023, 1024, 2999, 3000] {
            for acc in [0, 1, 0xffff, 0x1_2345] {
                assert_eq!(fold(sum(acc, &data[..len])), fold(words(acc, &data[..len])), "len {len}, acc {acc:#x}");
            }
        }
        assert_eq!(fold(sum(0, &[0xff; 64])), 0, "all ones sum to negative zero");
    }

    #[test]
    fn v4_parse_fixture() {
        let mut b = [0u8; 128];
        b[..20].copy_from_slice(&V4);
        let p = Ipv4Packet::new_checked(&b[..]).unwrap();
        assert_eq!(Ipv4Repr::parse(&p).unwrap(), v4());
        assert_eq!(p.payload().len(), 108);
    }

    #[test]
    fn v4_emit_fixture() {
        let mut b = [0u8; 20];
        v4().emit(&mut b);
        assert_eq!(b, V4);
    }

    #[test]
    fn v4_checks() {
        let mut b = [0u8; 128];
        b[..20].copy_from_slice(&V4);
        assert_eq!(Ipv4Packet::new_checked(&b[..127]).unwrap_err(), Error::Truncated);
        let mut bad = b;
        bad[11] ^= 1;
        let p = Ipv4Packet::new_checked(&bad[..]).unwrap();
        assert_eq!(Ipv4Repr::parse(&p).unwrap_err(), Error::Checksum);
        let mut frag = b;
        frag[6] = 0x20; // MF
        assert_eq!(Ipv4Packet::new_checked(&frag[..]).unwrap_err(), Error::Malformed);
        let mut opts = b;
        opts[0] = 0x46;
        assert_eq!(Ipv4Packet::new_checked(&opts[..]).unwrap_err(), Error::Malformed);
        let mut short = b;
        short[2..4].copy_from_slice(&19u16.to_be_bytes());
        assert_eq!(Ipv4Packet::new_checked(&short[..]).unwrap_err(), Error::Malformed);
    }

    // fe80::2 -> fe80::1, UDP, 100 bytes, traffic class 0x68, flow label 0x12345, hop limit 64.
    static V6: [u8; 40] = [
        0x66, 0x81, 0x23, 0x45, 0x00, 0x64, 0x11, 0x40, //
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, //
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1,
    ];

    fn v6() -> Ipv6Repr {
        let mut src = [0u8; 16];
        src[0] = 0xfe;
        src[1] = 0x80;
        let mut dst = src;
        src[15] = 2;
        dst[15] = 1;
        Ipv6Repr {
            src,
            dst,
            next_header: PROTO_UDP,
            payload_len: 100,
            traffic_class: 0x68,
            flow_label: 0x12345,
            hop_limit: 64,
        }
    }

    #[test]
    fn v6_fixtures_both_ways() {
        let mut b = [0u8; 140];
        b[..40].copy_from_slice(&V6);
        let p = Ipv6Packet::new_checked(&b[..]).unwrap();
        assert_eq!(Ipv6Repr::parse(&p), v6());
        assert_eq!(p.payload().len(), 100);
        let mut e = [0u8; 40];
        v6().emit(&mut e);
        assert_eq!(e, V6);
        assert_eq!(Ipv6Packet::new_checked(&b[..139]).unwrap_err(), Error::Truncated);
        b[0] = 0x46;
        assert_eq!(Ipv6Packet::new_checked(&b[..]).unwrap_err(), Error::Malformed);
    }

    #[test]
    fn checksum_of_odd_length() {
        // RFC 1071's example words, plus a trailing odd byte.
        assert_eq!(fold(sum(0, &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7])), !0xddf2);
        assert_eq!(sum(0, &[0x12]), 0x1200);
    }
}

//! A whole frame on a RoCE port: Ethernet II carrying either ARP or IPv4/IPv6, UDP 4791, BTH, extended headers,
//! payload, pad and ICRC. [`parse`] runs every check and names the first that failed as a [`DropReason`];
//! [`DropCounters`] counts them (a frame that fails is dropped and counted, never a panic). [`RoceRepr::emit`]
//! writes a frame with the IPv4 checksum, zero UDP checksum, pad and ICRC filled in. Neither allocates.

use super::arp::{ArpPacket, ArpRepr, PACKET_LEN as ARP_LEN};
use super::error::Error;
use super::ether::{self, EtherType, EthernetFrame, EthernetRepr};
use super::ib::{BthPacket, BthRepr, Ext, BTH_LEN};
use super::icrc::{self, ICRC_LEN};
use super::ip::{Ipv4Packet, Ipv4Repr, Ipv6Packet, Ipv6Repr, IPV4_HEADER_LEN, IPV6_HEADER_LEN, PROTO_UDP};
use super::udp::{self, UdpPacket, UdpRepr, ROCE_PORT};

/// Why a frame was dropped: the first check it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Shorter than an Ethernet header.
    Ethernet,
    /// An EtherType other than IPv4, IPv6 and ARP.
    EtherType,
    /// ARP that is not a well-formed Ethernet/IPv4 request or reply.
    Arp,
    /// A bad IPv4 header: length, version, options, fragment.
    Ipv4,
    /// A wrong IPv4 header checksum.
    Ipv4Checksum,
    /// A bad IPv6 header.
    Ipv6,
    /// IP carrying something other than UDP.
    NotUdp,
    /// A bad UDP header.
    Udp,
    /// A wrong (non-zero) UDP checksum.
    UdpChecksum,
    /// UDP to a port other than 4791.
    NotRoce,
    /// Too short for a BTH and ICRC, or a transport version other than 0.
    Bth,
    /// An opcode this port does not support.
    Opcode,
    /// Shorter than the extended headers the opcode implies, or not a multiple of four bytes.
    Headers,
    /// A pad count larger than the payload, or a payload on an opcode that carries none.
    Payload,
    /// A wrong invariant CRC.
    Icrc,
}

impl DropReason {
    /// Every reason, in the order of [`DropCounters`].
    pub const ALL: [DropReason; 15] = [
        DropReason::Ethernet,
        DropReason::EtherType,
        DropReason::Arp,
        DropReason::Ipv4,
        DropReason::Ipv4Checksum,
        DropReason::Ipv6,
        DropReason::NotUdp,
        DropReason::Udp,
        DropReason::UdpChecksum,
        DropReason::NotRoce,
        DropReason::Bth,
        DropReason::Opcode,
        DropReason::Headers,
        DropReason::Payload,
        DropReason::Icrc,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// A short description, for events and logs.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::Ethernet => "frame shorter than an Ethernet header",
            DropReason::EtherType => "EtherType neither IPv4, IPv6 nor ARP",
            DropReason::Arp => "malformed ARP",
            DropReason::Ipv4 => "bad IPv4 header",
            DropReason::Ipv4Checksum => "bad IPv4 header checksum",
            DropReason::Ipv6 => "bad IPv6 header",
            DropReason::NotUdp => "IP payload is not UDP",
            DropReason::Udp => "bad UDP header",
            DropReason::UdpChecksum => "bad UDP checksum",
            DropReason::NotRoce => "UDP port is not 4791",
            DropReason::Bth => "bad BTH",
            DropReason::Opcode => "unsupported opcode",
            DropReason::Headers => "extended headers cut short",
            DropReason::Payload => "bad pad or payload",
            DropReason::Icrc => "bad ICRC",
        }
    }
}

/// Frames dropped, per reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounters {
    counts: [u64; DropReason::ALL.len()],
}

impl DropCounters {
    /// Counts one drop.
    pub fn count(&mut self, r: DropReason) {
        self.counts[r.index()] += 1;
    }

    /// Drops for `r`.
    pub fn get(&self, r: DropReason) -> u64 {
        self.counts[r.index()]
    }

    /// All drops.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// The IP header of a RoCEv2 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpRepr {
    /// IPv4 (RoCEv2 GIDs `::ffff:a.b.c.d`).
    V4(Ipv4Repr),
    /// IPv6.
    V6(Ipv6Repr),
}

impl IpRepr {
    fn header_len(&self) -> usize {
        match self {
            IpRepr::V4(_) => IPV4_HEADER_LEN,
            IpRepr::V6(_) => IPV6_HEADER_LEN,
        }
    }

    /// The source address as a GID (IPv4 mapped into `::ffff:0:0/96`).
    pub fn src_gid(&self) -> [u8; 16] {
        match self {
            IpRepr::V4(r) => mapped(r.src),
            IpRepr::V6(r) => r.src,
        }
    }

    /// The destination address as a GID.
    pub fn dst_gid(&self) -> [u8; 16] {
        match self {
            IpRepr::V4(r) => mapped(r.dst),
            IpRepr::V6(r) => r.dst,
        }
    }
}

/// An IPv4 address as an IPv4-mapped IPv6 address (the RoCEv2 GID of an IPv4 address).
pub fn mapped(a: [u8; 4]) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&a);
    g
}

/// A RoCEv2 packet as values; the payload borrows the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoceRepr<'a> {
    /// The Ethernet header (EtherType IPv4 or IPv6, matching `ip`).
    pub eth: EthernetRepr,
    /// The IP header; its payload length is recomputed on emit.
    pub ip: IpRepr,
    /// The UDP header; its payload length is recomputed on emit.
    pub udp: UdpRepr,
    /// The BTH; its pad count is recomputed on emit.
    pub bth: BthRepr,
    /// The extended headers the opcode implies.
    pub ext: Ext,
    /// The payload, without pad.
    pub payload: &'a [u8],
}

/// A frame a RoCE port accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// ARP.
    Arp(EthernetRepr, ArpRepr),
    /// A RoCEv2 packet whose checks, ICRC included, all passed.
    Roce(RoceRepr<'a>),
}

/// Parses one bare Ethernet frame (no FCS; bytes after the IP packet's length are ignored).
pub fn parse(frame: &[u8]) -> Result<Parsed<'_>, DropReason> {
    parse_with(frame, Integrity::Check)
}

/// What [`parse_with`] checks besides the frame's structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integrity {
    /// The UDP checksum and the ICRC too: a frame that came over a cable.
    Check,
    /// The UDP checksum and the ICRC are taken as right: a frame this process built a moment ago for another of
    /// its devices, which crossed no cable (its sums were computed, and a capture shows them). Every other check
    /// still applies.
    Trusted,
}

/// [`parse`], with the UDP checksum and ICRC checks as `integrity` says.
pub fn parse_with(frame: &[u8], integrity: Integrity) -> Result<Parsed<'_>, DropReason> {
    let eth = EthernetFrame::new_checked(frame).map_err(|_| DropReason::Ethernet)?;
    let eth_repr = EthernetRepr::parse(&eth);
    let l3 = &frame[ether::HEADER_LEN..];
    let (ip, ip_payload, l3_len) = match eth_repr.ethertype {
        EtherType::Arp => {
            let p = ArpPacket::new_checked(l3).map_err(|_| DropReason::Arp)?;
            return Ok(Parsed::Arp(eth_repr, ArpRepr::parse(&p).map_err(|_| DropReason::Arp)?));
        }
        EtherType::Ipv4 => {
            let p = Ipv4Packet::new_checked(l3).map_err(|_| DropReason::Ipv4)?;
            let r = Ipv4Repr::parse(&p).map_err(|_| DropReason::Ipv4Checksum)?;
            if r.protocol != PROTO_UDP {
                return Err(DropReason::NotUdp);
            }
            let total = usize::from(p.total_len());
            (IpRepr::V4(r), &l3[IPV4_HEADER_LEN..total], total)
        }
        EtherType::Ipv6 => {
            let p = Ipv6Packet::new_checked(l3).map_err(|_| DropReason::Ipv6)?;
            let r = Ipv6Repr::parse(&p);
            if r.next_header != PROTO_UDP {
                return Err(DropReason::NotUdp);
            }
            let total = IPV6_HEADER_LEN + usize::from(p.payload_len());
            (IpRepr::V6(r), &l3[IPV6_HEADER_LEN..total], total)
        }
        EtherType::Unknown(_) => return Err(DropReason::EtherType),
    };
    let u = UdpPacket::new_checked(ip_payload).map_err(|_| DropReason::Udp)?;
    let pseudo = match &ip {
        IpRepr::V4(r) => r.pseudo_sum(u.len()),
        IpRepr::V6(r) => r.pseudo_sum(u.len()),
    };
    // RoCE puts nothing after the ICRC: an IP packet longer than its UDP datagram would carry bytes the ICRC
    // covers (through the IP length) yet no header describes, and could not be re-emitted as it came.
    if usize::from(u.len()) != ip_payload.len() {
        return Err(DropReason::Udp);
    }
    let udp_repr = match integrity {
        Integrity::Check => UdpRepr::parse(&u, pseudo).map_err(|_| DropReason::UdpChecksum)?,
        Integrity::Trusted => UdpRepr::parse_trusted(&u),
    };
    if udp_repr.dst_port != ROCE_PORT {
        return Err(DropReason::NotRoce);
    }
    // The IB packet is the rest of the UDP datagram.
    let ib = &ip_payload[udp::HEADER_LEN..usize::from(u.len())];
    let l3 = &l3[..l3_len.min(ip.header_len() + usize::from(u.len()))];
    if ib.len() < BTH_LEN + ICRC_LEN {
        return Err(DropReason::Bth);
    }
    let bth = BthRepr::parse(&BthPacket::new_unchecked(ib)).map_err(|_| DropReason::Bth)?;
    let headers = bth.opcode.headers().ok_or(DropReason::Opcode)?;
    let body = &ib[BTH_LEN..ib.len() - ICRC_LEN];
    if body.len() < headers.len() || ib.len() % 4 != 0 {
        return Err(DropReason::Headers);
    }
    let ext = Ext::parse(headers, body).map_err(|_| DropReason::Headers)?;
    let padded = &body[headers.len()..];
    let pad = usize::from(bth.pad_count);
    if padded.len() < pad || (!headers.payload && !padded.is_empty()) {
        return Err(DropReason::Payload);
    }
    let payload = &padded[..padded.len() - pad];
    if integrity == Integrity::Check {
        let crc_at = l3.len() - ICRC_LEN;
        let want = icrc::compute(&l3[..crc_at], matches!(ip, IpRepr::V6(_))).map_err(|_| DropReason::Bth)?;
        if want.to_le_bytes() != l3[crc_at..] {
            return Err(DropReason::Icrc);
        }
    }
    Ok(Parsed::Roce(RoceRepr { eth: eth_repr, ip, udp: udp_repr, bth, ext, payload }))
}

/// [`parse`], counting a drop in `counters`.
pub fn parse_counted<'a>(frame: &'a [u8], counters: &mut DropCounters) -> Option<Parsed<'a>> {
    match parse(frame) {
        Ok(p) => Some(p),
        Err(r) => {
            counters.count(r);
            None
        }
    }
}

/// Writes an ARP frame into `buf`; returns its length (42), or `Truncated` if `buf` is shorter.
pub fn emit_arp(eth: &EthernetRepr, arp: &ArpRepr, buf: &mut [u8]) -> Result<usize, Error> {
    let len = ether::HEADER_LEN + ARP_LEN;
    let buf = buf.get_mut(..len).ok_or(Error::Truncated)?;
    let e = EthernetRepr { ethertype: EtherType::Arp, ..*eth };
    e.emit(&mut EthernetFrame::new_unchecked(&mut *buf));
    arp.emit(&mut buf[ether::HEADER_LEN..]);
    Ok(len)
}

impl RoceRepr<'_> {
    /// The pad that brings the payload to a multiple of four bytes.
    pub fn pad(&self) -> usize {
        (4 - self.payload.len() % 4) % 4
    }

    fn ib_len(&self) -> usize {
        BTH_LEN + self.ext.headers().len() + self.payload.len() + self.pad() + ICRC_LEN
    }

    /// Bytes of the whole frame.
    pub fn frame_len(&self) -> usize {
        ether::HEADER_LEN + self.ip.header_len() + udp::HEADER_LEN + self.ib_len()
    }

    /// Writes the frame into `buf`; returns its length, or `Truncated` if `buf` is shorter than
    /// [`frame_len`](Self::frame_len) or `Malformed` if the lengths do not fit the IP and UDP length fields. The
    /// EtherType follows `ip`, the lengths and pad count follow the contents; checksums and the ICRC are computed.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, Error> {
        self.emit_with(buf, Integrity::Check)
    }

    /// [`emit`](Self::emit); with [`Integrity::Trusted`] the ICRC is left zero (a frame for another device of
    /// this process, which parses it trusted).
    pub fn emit_with(&self, buf: &mut [u8], integrity: Integrity) -> Result<usize, Error> {
        let len = self.frame_len();
        let buf = buf.get_mut(..len).ok_or(Error::Truncated)?;
        let udp_payload = u16::try_from(self.ib_len()).map_err(|_| Error::Malformed)?;
        let udp_len = udp_payload.checked_add(udp::HEADER_LEN as u16).ok_or(Error::Malformed)?;
        let mut at = ether::HEADER_LEN;
        let ethertype = match self.ip {
            IpRepr::V4(_) => EtherType::Ipv4,
            IpRepr::V6(_) => EtherType::Ipv6,
        };
        EthernetRepr { ethertype, ..self.eth }.emit(&mut EthernetFrame::new_unchecked(&mut *buf));
        match self.ip {
            IpRepr::V4(r) => {
                if usize::from(udp_len) + IPV4_HEADER_LEN > usize::from(u16::MAX) {
                    return Err(Error::Malformed);
                }
                Ipv4Repr { payload_len: udp_len, protocol: PROTO_UDP, ..r }.emit(&mut buf[at..]);
                at += IPV4_HEADER_LEN;
            }
            IpRepr::V6(r) => {
                Ipv6Repr { payload_len: udp_len, next_header: PROTO_UDP, ..r }.emit(&mut buf[at..]);
                at += IPV6_HEADER_LEN;
            }
        }
        UdpRepr { payload_len: udp_payload, ..self.udp }.emit(&mut buf[at..]);
        at += udp::HEADER_LEN;
        BthRepr { pad_count: self.pad() as u8, ..self.bth }.emit(&mut buf[at..]);
        at += BTH_LEN;
        at += self.ext.emit(&mut buf[at..]);
        buf[at..at + self.payload.len()].copy_from_slice(self.payload);
        at += self.payload.len();
        buf[at..at + self.pad()].fill(0);
        at += self.pad();
        let crc = match integrity {
            Integrity::Check => icrc::compute(&buf[ether::HEADER_LEN..at], matches!(self.ip, IpRepr::V6(_)))?,
            Integrity::Trusted => 0,
        };
        buf[at..at + ICRC_LEN].copy_from_slice(&crc.to_le_bytes());
        Ok(len)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::ib::{Aeth, NakCode, Opcode, Syndrome, DEFAULT_PKEY};
    use super::*;

    const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
    const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0, 0, 0, 0x01];

    /// The ICRC module's independent fixture behind an Ethernet header.
    pub(crate) fn send_only_frame() -> [u8; 62] {
        let mut f = [0u8; 62];
        f[..6].copy_from_slice(&GUEST_MAC);
        f[6..12].copy_from_slice(&HOST_MAC);
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14..].copy_from_slice(&super::super::icrc::tests::SEND_ONLY_V4);
        f
    }

    fn send_only() -> RoceRepr<'static> {
        RoceRepr {
            eth: EthernetRepr { dst: GUEST_MAC, src: HOST_MAC, ethertype: EtherType::Ipv4 },
            ip: IpRepr::V4(Ipv4Repr {
                src: [10, 0, 0, 2],
                dst: [10, 0, 0, 1],
                protocol: PROTO_UDP,
                payload_len: 28,
                tos: 0,
                ttl: 64,
                ident: 1,
                dont_frag: true,
            }),
            udp: UdpRepr { src_port: 49441, dst_port: ROCE_PORT, payload_len: 20 },
            bth: BthRepr {
                opcode: Opcode::RcSendOnly,
                solicited: false,
                migreq: false,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qpn: 0x11,
                ack_req: true,
                psn: 0x123456,
            },
            ext: Ext::default(),
            payload: &[0xca, 0xfe, 0xba, 0xbe],
        }
    }

    #[test]
    fn parse_fixture() {
        let f = send_only_frame();
        assert_eq!(parse(&f), Ok(Parsed::Roce(send_only())));
        // Ethernet padding after the IP packet is ignored.
        let mut padded = [0u8; 64];
        padded[..62].copy_from_slice(&f);
        assert_eq!(parse(&padded), Ok(Parsed::Roce(send_only())));
    }

    #[test]
    fn emit_fixture() {
        let mut b = [0u8; 100];
        let n = send_only().emit(&mut b).unwrap();
        assert_eq!(n, 62);
        assert_eq!(b[..62], send_only_frame());
        assert_eq!(send_only().emit(&mut b[..61]).unwrap_err(), Error::Truncated);
    }

    #[test]
    fn every_check_drops_and_counts() {
        let good = send_only_frame();
        let mut c = DropCounters::default();
        // (byte, value, reseal the IPv4 checksum so the later check is reached, expected reason)
        let cases: [(usize, u8, bool, DropReason); 9] = [
            (12, 0x88, false, DropReason::EtherType),
            (14, 0x46, false, DropReason::Ipv4),
            (24, 0x00, false, DropReason::Ipv4Checksum),
            (23, 6, true, DropReason::NotUdp),
            (36, 0x13, false, DropReason::NotRoce),
            (43, 0x01, false, DropReason::Bth),    // TVer 1
            (42, 0x40, false, DropReason::Opcode), // RD SEND FIRST
            (58, 0x00, false, DropReason::Icrc),   // the ICRC itself
            (57, 0xbf, false, DropReason::Icrc),   // a payload bit
        ];
        for (at, v, fix, want) in cases {
            let mut f = good;
            f[at] = v;
            if fix {
                f[24..26].fill(0);
                let c = super::super::ip::fold(super::super::ip::sum(0, &f[14..34]));
                f[24..26].copy_from_slice(&c.to_be_bytes());
            }
            assert_eq!(parse(&f).unwrap_err(), want, "byte {at} = {v:#x}");
            assert!(parse_counted(&f, &mut c).is_none());
        }
        assert_eq!(c.get(DropReason::Icrc), 2);
        assert_eq!(c.total(), 9);
        assert_eq!(parse(&good[..13]).unwrap_err(), DropReason::Ethernet);
        assert_eq!(parse(&good[..61]).unwrap_err(), DropReason::Ipv4);
        // A UDP length shorter than BTH + ICRC, and a pad count larger than the payload.
        let mut short = send_only();
        short.bth.opcode = Opcode::RcAck;
        short.payload = &[];
        let mut b = [0u8; 100];
        let n = short.emit(&mut b).unwrap();
        assert_eq!(parse(&b[..n]).unwrap_err(), DropReason::Headers);
        // A payload on an ACK, with a correct ICRC: the opcode carries none.
        let mut eight = send_only();
        eight.payload = &[0x1f, 0, 0, 1, 9, 9, 9, 9]; // read as AETH, then four payload bytes
        let n = eight.emit(&mut b).unwrap();
        b[42] = u8::from(Opcode::RcAck);
        reseal(&mut b[..n], false);
        assert_eq!(parse(&b[..n]).unwrap_err(), DropReason::Payload);
        b[42] = u8::from(Opcode::RcReadResponseOnly); // the same bytes are fine where a payload may follow
        reseal(&mut b[..n], false);
        assert!(matches!(parse(&b[..n]), Ok(Parsed::Roce(r)) if r.payload == [9, 9, 9, 9]));
    }

    /// Recomputes the ICRC of a frame a test altered, so a later check is reached.
    fn reseal(f: &mut [u8], v6: bool) {
        let end = f.len() - ICRC_LEN;
        let crc = icrc::compute(&f[ether::HEADER_LEN..end], v6).unwrap();
        f[end..].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn an_ip_packet_longer_than_its_udp_datagram_is_dropped() {
        // Found by the roce_frame fuzz target: the IPv4 total length claimed 4 bytes past the UDP datagram, the
        // ICRC (which covers the IP length) still matched, and the frame could not be re-emitted as it came.
        let good = send_only_frame();
        let mut f = [0u8; 66];
        f[..62].copy_from_slice(&good);
        let total = u16::from_be_bytes([f[16], f[17]]) + 4;
        f[16..18].copy_from_slice(&total.to_be_bytes());
        f[24..26].fill(0);
        let c = super::super::ip::fold(super::super::ip::sum(0, &f[14..34]));
        f[24..26].copy_from_slice(&c.to_be_bytes());
        assert_eq!(parse(&f).unwrap_err(), DropReason::Udp);
        assert!(matches!(parse(&good), Ok(Parsed::Roce(_))));
    }

    #[test]
    fn roundtrip_nak_with_pad_and_ipv6() {
        let mut r = send_only();
        r.bth.opcode = Opcode::RcAck;
        r.ext.aeth = Some(Aeth { syndrome: Syndrome::Nak(NakCode::PsnSequence), msn: 7 });
        r.payload = &[];
        let mut b = [0u8; 128];
        let n = r.emit(&mut b).unwrap();
        assert_eq!(n, 62); // the NAK rxe sends is 62 bytes
        assert_eq!(b[42 + 12], 0x60);
        let mut want = r;
        if let IpRepr::V4(ip) = &mut want.ip {
            ip.payload_len = 28;
        }
        want.udp.payload_len = 20;
        assert_eq!(parse(&b[..n]), Ok(Parsed::Roce(want)));

        let mut s = send_only();
        s.payload = &[1, 2, 3, 4, 5];
        s.ip = IpRepr::V6(Ipv6Repr {
            src: mapped([10, 0, 0, 2]),
            dst: mapped([10, 0, 0, 1]),
            next_header: PROTO_UDP,
            payload_len: 0,
            traffic_class: 0x68,
            flow_label: 0x12345,
            hop_limit: 64,
        });
        let n = s.emit(&mut b).unwrap();
        assert_eq!(n, 14 + 40 + 8 + 12 + 8 + 4);
        let Ok(Parsed::Roce(p)) = parse(&b[..n]) else { panic!("{:?}", parse(&b[..n])) };
        assert_eq!(p.payload, &[1, 2, 3, 4, 5]);
        assert_eq!(p.bth.pad_count, 3);
        assert_eq!(p.eth.ethertype, EtherType::Ipv6);
        assert_eq!(p.ip.src_gid(), mapped([10, 0, 0, 2]));
        // A pad count the payload cannot hold (an ACK with pad 3 and no payload), correctly sealed.
        let mut r = send_only();
        r.bth.opcode = Opcode::RcAck;
        r.ext.aeth = Some(Aeth { syndrome: Syndrome::Ack { credit: 0x1f }, msn: 1 });
        r.payload = &[];
        let n = r.emit(&mut b).unwrap();
        b[42 + 1] = 0x30;
        reseal(&mut b[..n], false);
        assert_eq!(parse(&b[..n]).unwrap_err(), DropReason::Payload);
    }

    #[test]
    fn arp_frames() {
        let eth = EthernetRepr { dst: ether::BROADCAST, src: GUEST_MAC, ethertype: EtherType::Arp };
        let arp = ArpRepr {
            operation: super::super::arp::Operation::Request,
            sender_mac: GUEST_MAC,
            sender_ip: [10, 0, 0, 1],
            target_mac: [0; 6],
            target_ip: [10, 0, 0, 2],
        };
        let mut b = [0u8; 64];
        assert_eq!(emit_arp(&eth, &arp, &mut b), Ok(42));
        assert_eq!(b[12..14], [0x08, 0x06]);
        assert_eq!(parse(&b[..42]), Ok(Parsed::Arp(eth, arp)));
        assert_eq!(parse(&b[..41]).unwrap_err(), DropReason::Arp);
        assert_eq!(emit_arp(&eth, &arp, &mut b[..41]), Err(Error::Truncated));
    }
}

//! Replying to a UD sender (`ibv_init_ah_from_wc`, libibverbs `verbs.c`): the address attributes of the sender
//! of a receive completion, from the completion and the 40 bytes of GRH the device wrote in front of the data.
//! A pure function over those bytes; the caller supplies the GID table lookup (`ibv_find_gid_index`).
//!
//! On RoCE v2 over IPv4 the 40 bytes hold the IPv4 header in their last 20 (rdma-core's
//! `get_grh_header_version` tells the two apart by the IPv6 version nibble and, when both could match, by the
//! IPv4 header checksum).

use crate::cq::{WcFlags, WorkCompletion};
use crate::qp::{AhAttr, Grh};

/// Bytes of GRH room in front of a UD receive's data (`struct ibv_grh`).
pub const GRH_BYTES: usize = 40;

/// Where the IPv4 header of a RoCE v2 IPv4 packet sits in the GRH room (the last 20 of the 40 bytes).
const IPV4_OFF: usize = 20;
/// IPv4 header bytes without options (`ihl` 5).
const IPV4_LEN: usize = 20;
/// `IPPROTO_UDP`: the next header of RoCE v2 over IPv6.
const NEXT_HDR_UDP: u8 = 17;
/// `IB_NEXT_HDR`: the next header of an InfiniBand or RoCE v1 GRH (the BTH).
const NEXT_HDR_IB: u8 = 0x1b;

/// The GID type an entry must have to be the local address a packet was sent to (`IBV_GID_TYPE_SYSFS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SgidType {
    /// An InfiniBand or RoCE v1 entry (`IBV_GID_TYPE_SYSFS_IB_ROCE_V1`).
    IbOrRoceV1,
    /// A RoCE v2 entry (`IBV_GID_TYPE_SYSFS_ROCE_V2`).
    RoceV2,
}

/// Why no reply address could be built (`ibv_init_ah_from_wc` returning an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum AhFromWcError {
    /// The completion says a GRH is present but none was given.
    NoGrh,
    /// The packet went to a multicast address (`EINVAL`: no point searching the GID table for it).
    Multicast,
    /// Neither an IPv6/GRH nor a valid IPv4 header (`EPROTONOSUPPORT`).
    UnknownHeader,
    /// An IPv6 header whose next header is neither UDP nor the BTH (`EPROTONOSUPPORT`).
    UnsupportedNextHeader(u8),
    /// The destination address is not in the local GID table with the needed type.
    SgidNotFound,
}

impl core::fmt::Display for AhFromWcError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NoGrh => f.write_str("the completion has a GRH but no GRH bytes were given"),
            Self::Multicast => f.write_str("the packet was sent to a multicast address"),
            Self::UnknownHeader => f.write_str("the GRH room holds neither an IPv6/GRH nor an IPv4 header"),
            Self::UnsupportedNextHeader(n) => write!(f, "unsupported next header {n:#x} in the GRH"),
            Self::SgidNotFound => f.write_str("the destination GID is not in the local GID table"),
        }
    }
}

impl core::error::Error for AhFromWcError {}

/// The IP version `get_grh_header_version` finds in the GRH room: 6 for an IPv6 header or GRH, 4 for an IPv4
/// header in the last 20 bytes (its checksum decides when the first 20 also read as IPv6).
pub fn grh_header_version(grh: &[u8; GRH_BYTES]) -> Option<u8> {
    let ip4 = &grh[IPV4_OFF..IPV4_OFF + IPV4_LEN];
    if grh[0] >> 4 != 6 {
        return (ip4[0] >> 4 == 4).then_some(4);
    }
    if ip4[0] & 0xf != 5 {
        return Some(6);
    }
    let stored = u16::from_be_bytes([ip4[10], ip4[11]]);
    Some(if ipv4_checksum(ip4) == stored { 4 } else { 6 })
}

/// The IPv4 header checksum of a 20-byte header (RFC 791), computed with its checksum field taken as 0.
pub fn ipv4_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for (i, w) in h.chunks_exact(2).enumerate().take(IPV4_LEN / 2) {
        if i != 5 {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// `::ffff:a.b.c.d` for an IPv4 address (`map_ipv4_addr_to_ipv6`).
fn v4_mapped(a: &[u8]) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&a[..4]);
    g
}

/// `ibv_init_ah_from_wc`: the address attributes that reach the sender of `wc` from port `port_num`. `grh` is
/// the 40 bytes in front of the received data (needed when `wc` has [`WcFlags::GRH`]); `find_gid` returns the
/// index of a local GID of the given type (`ibv_find_gid_index`). The LID, SL and path bits come from the
/// completion; with a GRH the destination GID is the packet's source, the source GID index the entry the packet
/// was sent to, hop limit and traffic class the received ones (TTL and TOS over IPv4).
pub fn init_ah_from_wc(
    wc: &WorkCompletion,
    grh: Option<&[u8; GRH_BYTES]>,
    port_num: u8,
    mut find_gid: impl FnMut(&[u8; 16], SgidType) -> Option<u8>,
) -> Result<AhAttr, AhFromWcError> {
    let mut ah = AhAttr { dlid: wc.slid, sl: wc.sl, src_path_bits: wc.dlid_path_bits, port_num, ..AhAttr::default() };
    if !wc.wc_flags.contains(WcFlags::GRH) {
        return Ok(ah);
    }
    let grh = grh.ok_or(AhFromWcError::NoGrh)?;
    let vtf = u32::from_be_bytes([grh[0], grh[1], grh[2], grh[3]]);
    // rdma-core takes the flow label from the first word whatever the version (0 over IPv4).
    let flow_label = vtf & 0xf_ffff;
    let g = match grh_header_version(grh) {
        Some(4) => {
            let ip4 = &grh[IPV4_OFF..IPV4_OFF + IPV4_LEN];
            let (saddr, daddr) = (&ip4[12..16], &ip4[16..20]);
            // Class D (224.0.0.0/4) is multicast.
            if daddr[0] >> 4 == 0xe {
                return Err(AhFromWcError::Multicast);
            }
            let sgid_index = find_gid(&v4_mapped(daddr), SgidType::RoceV2).ok_or(AhFromWcError::SgidNotFound)?;
            Grh { dgid: v4_mapped(saddr), flow_label, sgid_index, hop_limit: ip4[8], traffic_class: ip4[1] }
        }
        Some(_) => {
            let mut sgid = [0u8; 16];
            sgid.copy_from_slice(&grh[8..24]);
            let mut dgid = [0u8; 16];
            dgid.copy_from_slice(&grh[24..40]);
            if dgid[0] == 0xff {
                return Err(AhFromWcError::Multicast);
            }
            let ty = match grh[6] {
                NEXT_HDR_UDP => SgidType::RoceV2,
                NEXT_HDR_IB => SgidType::IbOrRoceV1,
                n => return Err(AhFromWcError::UnsupportedNextHeader(n)),
            };
            let sgid_index = find_gid(&dgid, ty).ok_or(AhFromWcError::SgidNotFound)?;
            Grh { dgid: sgid, flow_label, sgid_index, hop_limit: grh[7], traffic_class: (vtf >> 20) as u8 }
        }
        None => return Err(AhFromWcError::UnknownHeader),
    };
    ah.grh = Some(g);
    Ok(ah)
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    fn wc_with_grh() -> WorkCompletion {
        WorkCompletion { wc_flags: WcFlags::GRH, slid: 7, sl: 3, dlid_path_bits: 1, ..WorkCompletion::default() }
    }

    fn ipv6_grh(next: u8, sgid: [u8; 16], dgid: [u8; 16]) -> [u8; GRH_BYTES] {
        let mut g = [0u8; GRH_BYTES];
        g[..4].copy_from_slice(&(6u32 << 28 | 0x2a << 20 | 0x12345).to_be_bytes());
        g[6] = next;
        g[7] = 63;
        g[8..24].copy_from_slice(&sgid);
        g[24..].copy_from_slice(&dgid);
        g
    }

    #[test]
    fn without_grh_only_the_completion_fields() {
        let wc = WorkCompletion { wc_flags: WcFlags(0), ..wc_with_grh() };
        let ah = init_ah_from_wc(&wc, None, 1, |_, _| panic!("no GID lookup without a GRH")).unwrap();
        assert_eq!((ah.dlid, ah.sl, ah.src_path_bits, ah.port_num, ah.grh), (7, 3, 1, 1, None));
    }

    #[test]
    fn ipv6_grh_swaps_addresses_and_keeps_the_received_hop_limit() {
        let (s, d) = ([0xfe; 16], [0x20; 16]);
        let g = ipv6_grh(NEXT_HDR_UDP, s, d);
        let ah = init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |gid, ty| {
            assert_eq!((gid, ty), (&d, SgidType::RoceV2));
            Some(3)
        })
        .unwrap();
        let grh = ah.grh.unwrap();
        assert_eq!((grh.dgid, grh.sgid_index, grh.hop_limit), (s, 3, 63));
        assert_eq!((grh.traffic_class, grh.flow_label), (0x2a, 0x12345));
        let g = ipv6_grh(NEXT_HDR_IB, s, d);
        init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |_, ty| (ty == SgidType::IbOrRoceV1).then_some(0)).unwrap();
    }

    #[test]
    fn refusals_are_typed() {
        let g = ipv6_grh(6, [1; 16], [2; 16]);
        let r = init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |_, _| Some(0));
        assert_eq!(r, Err(AhFromWcError::UnsupportedNextHeader(6)));
        let g = ipv6_grh(NEXT_HDR_UDP, [1; 16], [0xff; 16]);
        assert_eq!(init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |_, _| Some(0)), Err(AhFromWcError::Multicast));
        let g = ipv6_grh(NEXT_HDR_UDP, [1; 16], [2; 16]);
        assert_eq!(init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |_, _| None), Err(AhFromWcError::SgidNotFound));
        assert_eq!(init_ah_from_wc(&wc_with_grh(), None, 1, |_, _| Some(0)), Err(AhFromWcError::NoGrh));
        assert_eq!(
            init_ah_from_wc(&wc_with_grh(), Some(&[0; GRH_BYTES]), 1, |_, _| Some(0)),
            Err(AhFromWcError::UnknownHeader)
        );
    }

    #[test]
    fn ipv4_header_in_the_last_20_bytes() {
        let mut g = [0u8; GRH_BYTES];
        let h = &mut g[IPV4_OFF..];
        h[0] = 0x45;
        h[1] = 0x10; // TOS
        h[8] = 32; // TTL
        h[9] = NEXT_HDR_UDP;
        h[12..16].copy_from_slice(&[10, 0, 0, 1]);
        h[16..20].copy_from_slice(&[10, 0, 0, 2]);
        let c = ipv4_checksum(h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        assert_eq!(grh_header_version(&g), Some(4));
        let ah = init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |gid, ty| {
            assert_eq!((gid, ty), (&v4_mapped(&[10, 0, 0, 2]), SgidType::RoceV2));
            Some(2)
        })
        .unwrap();
        let grh = ah.grh.unwrap();
        assert_eq!(
            (grh.dgid, grh.sgid_index, grh.hop_limit, grh.traffic_class),
            (v4_mapped(&[10, 0, 0, 1]), 2, 32, 0x10)
        );
        // Multicast destination.
        g[IPV4_OFF + 16] = 239;
        let c = ipv4_checksum(&g[IPV4_OFF..]);
        g[IPV4_OFF + 10..IPV4_OFF + 12].copy_from_slice(&c.to_be_bytes());
        assert_eq!(init_ah_from_wc(&wc_with_grh(), Some(&g), 1, |_, _| Some(0)), Err(AhFromWcError::Multicast));
    }

    #[test]
    fn checksum_of_a_known_header() {
        // The classic example header (RFC 1071 style): 4500 0073 0000 4000 4011 [b861] c0a8 0001 c0a8 00c7.
        let h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8,
            0x00, 0xc7,
        ];
        assert_eq!(ipv4_checksum(&h), 0xb861);
    }
}

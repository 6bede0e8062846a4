//! The receive side's first step: a frame's outer headers as NIC receive steering matches them (the
//! `fte_match_set_lyr_2_4` of a `fte_match_param`), and the RQ the steered-to TIR delivers to, directly or by
//! the RSS hash of the fields its selector names. Frames too short for what their headers claim classify as far
//! as they go (an IPv4 header cut short matches on L2 fields only), never read past the frame.

use mlx5_core::prm::{consts, ifc, MsgBuf};

use super::rss::toeplitz;
use crate::fw::flow_table::{FlowTables, Steer, MATCH_LEN};
use crate::fw::rqt::RqtTable;
use crate::fw::tir::{Dispatch, Tir, TirTable};

const ETH_HLEN: usize = 14;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// What a frame's headers say, as far as steering and RSS look.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Headers {
    pub(crate) vid: Option<u16>,
    pub(crate) ethertype: u16,
    /// 4 or 6 when an IP header was read whole.
    pub(crate) ip_version: u8,
    pub(crate) src_ip: [u8; 16],
    pub(crate) dst_ip: [u8; 16],
    pub(crate) protocol: u8,
    /// Source and destination ports of a TCP or UDP header read whole (first fragment only).
    pub(crate) ports: Option<(u16, u16)>,
    /// The match image steering compares.
    pub(crate) image: Vec<u8>,
}

/// Reads `frame`'s outer headers.
pub(crate) fn headers(frame: &[u8]) -> Option<Headers> {
    use ifc::fte_match_set_lyr_2_4 as l;
    let o = ifc::fte_match_param::OUTER_HEADERS;
    let at = |f: mlx5_core::prm::Field| f.at(o);
    if frame.len() < ETH_HLEN {
        return None;
    }
    let mut h = Headers { image: vec![0; MATCH_LEN], ..Headers::default() };
    let img = &mut h.image[..];
    img.set(at(l::DMAC_47_16), u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]));
    img.set(at(l::DMAC_15_0), u16::from_be_bytes([frame[4], frame[5]]).into());
    img.set(at(l::SMAC_47_16), u32::from_be_bytes([frame[6], frame[7], frame[8], frame[9]]));
    img.set(at(l::SMAC_15_0), u16::from_be_bytes([frame[10], frame[11]]).into());
    let mut ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let mut off = ETH_HLEN;
    if ethertype == ETH_P_8021Q && frame.len() >= off + 4 {
        let tci = u16::from_be_bytes([frame[off], frame[off + 1]]);
        h.vid = Some(tci & 0xfff);
        img.set(at(l::CVLAN_TAG), 1);
        img.set(at(l::FIRST_PRIO), (tci >> 13).into());
        img.set(at(l::FIRST_VID), (tci & 0xfff).into());
        ethertype = u16::from_be_bytes([frame[off + 2], frame[off + 3]]);
        off += 4;
    }
    h.ethertype = ethertype;
    img.set(at(l::ETHERTYPE), ethertype.into());
    let ip = &frame[off..];
    let l4 = match ethertype {
        ETH_P_IP if ip.len() >= 20 && ip[0] >> 4 == 4 && usize::from(ip[0] & 0xf) * 4 <= ip.len() => {
            h.ip_version = 4;
            h.src_ip[12..].copy_from_slice(&ip[12..16]);
            h.dst_ip[12..].copy_from_slice(&ip[16..20]);
            h.protocol = ip[9];
            // Only a first fragment carries the L4 header.
            let first = u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff == 0;
            first.then(|| &ip[usize::from(ip[0] & 0xf) * 4..])
        }
        ETH_P_IPV6 if ip.len() >= 40 && ip[0] >> 4 == 6 => {
            h.ip_version = 6;
            h.src_ip.copy_from_slice(&ip[8..24]);
            h.dst_ip.copy_from_slice(&ip[24..40]);
            h.protocol = ip[6];
            Some(&ip[40..])
        }
        _ => None,
    };
    if h.ip_version != 0 {
        let img = &mut h.image[..];
        img.set(at(l::IP_VERSION), h.ip_version.into());
        img.set(at(l::IP_PROTOCOL), h.protocol.into());
        let (src, dst) = (l::SRC_IPV4_SRC_IPV6.at(o), l::DST_IPV4_DST_IPV6.at(o));
        img[src.off..src.off + 16].copy_from_slice(&h.src_ip);
        img[dst.off..dst.off + 16].copy_from_slice(&h.dst_ip);
    }
    if let Some(l4) = l4.filter(|b| b.len() >= 4 && matches!(h.protocol, IPPROTO_TCP | IPPROTO_UDP)) {
        let (sport, dport) = (u16::from_be_bytes([l4[0], l4[1]]), u16::from_be_bytes([l4[2], l4[3]]));
        h.ports = Some((sport, dport));
        let (s, d) =
            if h.protocol == IPPROTO_TCP { (l::TCP_SPORT, l::TCP_DPORT) } else { (l::UDP_SPORT, l::UDP_DPORT) };
        h.image[..].set(at(s), sport.into());
        h.image[..].set(at(d), dport.into());
    }
    Some(h)
}

/// Where a received frame goes: its RQ, the RSS hash (0 unless an RSS TIR hashed it) and the entry's flow tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RxTarget {
    /// The TIR steering chose (its transport domain decides self loopback).
    pub(crate) tirn: u32,
    pub(crate) rqn: u32,
    pub(crate) hash: u32,
    pub(crate) flow_tag: u32,
}

/// The Toeplitz input a TIR's selector takes from `h`: the addresses, then the ports, each when selected.
/// `None` when the packet is not of the selector's L3 (or, with ports selected, L4) type.
fn hash_input(tir: &Tir, h: &Headers) -> Option<Vec<u8>> {
    let l3 = match h.ip_version {
        4 => consts::MLX5_L3_PROT_TYPE_IPV4,
        6 => consts::MLX5_L3_PROT_TYPE_IPV6,
        _ => return None,
    };
    if tir.l3_prot_type != l3 {
        return None;
    }
    let sel = tir.selected_fields;
    let mut v = Vec::with_capacity(36);
    let addr = |a: &[u8; 16]| if l3 == consts::MLX5_L3_PROT_TYPE_IPV4 { a[12..].to_vec() } else { a.to_vec() };
    if sel & consts::MLX5_HASH_FIELD_SEL_SRC_IP != 0 {
        v.extend(addr(&h.src_ip));
    }
    if sel & consts::MLX5_HASH_FIELD_SEL_DST_IP != 0 {
        v.extend(addr(&h.dst_ip));
    }
    let ports = sel & (consts::MLX5_HASH_FIELD_SEL_L4_SPORT | consts::MLX5_HASH_FIELD_SEL_L4_DPORT);
    if ports != 0 {
        let l4 = if tir.l4_prot_type == consts::MLX5_L4_PROT_TYPE_TCP { IPPROTO_TCP } else { IPPROTO_UDP };
        let (s, d) = h.ports.filter(|_| h.protocol == l4)?;
        if sel & consts::MLX5_HASH_FIELD_SEL_L4_SPORT != 0 {
            v.extend_from_slice(&s.to_be_bytes());
        }
        if sel & consts::MLX5_HASH_FIELD_SEL_L4_DPORT != 0 {
            v.extend_from_slice(&d.to_be_bytes());
        }
    }
    Some(v)
}

/// The RQ NIC receive steering delivers `frame` to, if any: the flow tables from their root to a TIR, then the
/// TIR's RQ, or its RQT's entry at the hash modulo the table's size. A TIR whose selector does not fit the
/// packet (an IPv6 packet to an IPv4 TIR) takes the table's first entry, as a hash of nothing would.
pub(crate) fn rx_target(flows: &FlowTables, tirs: &TirTable, rqts: &RqtTable, frame: &[u8]) -> Option<RxTarget> {
    let h = headers(frame)?;
    let img: &[u8; MATCH_LEN] = h.image.as_slice().try_into().ok()?;
    let Steer::Tir { tirn, flow_tag } = flows.steer(img) else { return None };
    let tir = tirs.map.get(&tirn)?;
    match tir.dispatch {
        Dispatch::Direct { rqn } => Some(RxTarget { tirn, rqn, hash: 0, flow_tag }),
        Dispatch::Indirect { rqtn, hash_fn } => {
            let rqt = rqts.map.get(&rqtn)?;
            let hash = match (hash_fn, hash_input(tir, &h)) {
                (consts::MLX5_RX_HASH_FN_TOEPLITZ, Some(input)) => toeplitz(&tir.toeplitz_key, &input),
                _ => 0,
            };
            let rqn = *rqt.rqns.get(hash as usize % rqt.rqns.len().max(1))?;
            Some(RxTarget { tirn, rqn, hash, flow_tag })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::eth::Eth;
    use ifc::fte_match_set_lyr_2_4 as l;

    fn tcp4(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> Vec<u8> {
        let mut f = vec![0u8; ETH_HLEN + 20 + 20];
        f[..6].copy_from_slice(&[0x02, 0, 0, 0, 0, 1]);
        f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 2]);
        f[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
        let ip = &mut f[ETH_HLEN..];
        ip[0] = 0x45;
        ip[9] = IPPROTO_TCP;
        ip[12..16].copy_from_slice(&src);
        ip[16..20].copy_from_slice(&dst);
        ip[20..22].copy_from_slice(&sport.to_be_bytes());
        ip[22..24].copy_from_slice(&dport.to_be_bytes());
        f
    }

    #[test]
    fn headers_fill_the_match_image_and_short_frames_stop_at_what_they_carry() {
        let f = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 5001, 80);
        let h = headers(&f).unwrap();
        let o = ifc::fte_match_param::OUTER_HEADERS;
        assert_eq!((h.ip_version, h.protocol, h.ports), (4, IPPROTO_TCP, Some((5001, 80))));
        assert_eq!(MsgBuf::get(&h.image[..], l::TCP_DPORT.at(o)), 80);
        assert_eq!(MsgBuf::get(&h.image[..], l::ETHERTYPE.at(o)), u32::from(ETH_P_IP));
        let src = l::SRC_IPV4_SRC_IPV6.at(o);
        assert_eq!(&h.image[src.off + 12..src.off + 16], &[10, 0, 0, 1]);
        // Cut inside the IP header: L2 only. Cut inside the Ethernet header: nothing.
        let h = headers(&f[..ETH_HLEN + 10]).unwrap();
        assert_eq!((h.ip_version, h.ports), (0, None));
        assert!(headers(&f[..10]).is_none());
    }

    #[test]
    fn an_rss_tir_spreads_flows_over_its_rqt_by_the_toeplitz_hash() {
        let mut e = Eth::new();
        let rqs: Vec<u32> = (0..4).map(|_| e.rq().2).collect();
        let (_, _, rqtn) = e.rqt(4, &rqs);
        // An RSS TIR over IPv4 TCP 4-tuples, reached from a root that forwards everything.
        let (s, _, tirn) = e.tir(true, rqtn);
        assert_eq!(s, 0);
        let mut m = vec![0u8; ifc::modify_tir_in::SIZE_BYTES];
        m.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_MODIFY_TIR.into());
        m.set(ifc::modify_tir_in::TIRN, tirn);
        m.set(ifc::modify_tir_bitmask::HASH.at(ifc::modify_tir_in::BITMASK), 1);
        let ctx = ifc::modify_tir_in::CTX;
        m.set(ifc::tirc::RX_HASH_FN.at(ctx), consts::MLX5_RX_HASH_FN_TOEPLITZ);
        let sel = ifc::tirc::RX_HASH_FIELD_SELECTOR_OUTER.at(ctx);
        let all = consts::MLX5_HASH_FIELD_SEL_SRC_IP
            | consts::MLX5_HASH_FIELD_SEL_DST_IP
            | consts::MLX5_HASH_FIELD_SEL_L4_SPORT
            | consts::MLX5_HASH_FIELD_SEL_L4_DPORT;
        m.set(ifc::rx_hash_field_select::SELECTED_FIELDS.at(sel), all);
        let key = ifc::tirc::RX_HASH_TOEPLITZ_KEY.at(ctx).byte_off();
        for (k, b) in m[key..key + 40].iter_mut().enumerate() {
            *b = (k as u8).wrapping_mul(37) ^ 0x5a;
        }
        assert_eq!(e.r.h.cmd(&m, ifc::modify_tir_out::SIZE_BYTES).1, 0);
        let (_, _, root) = e.table(0, 1, None);
        let (_, _, g) = e.group(root, 0, 0, |_| {});
        assert_eq!(e.fte(root, g, 0, &[(consts::MLX5_IFC_FLOW_DESTINATION_TYPE_TIR, tirn)], |_| {}), (0, 0));
        assert_eq!(e.set_root(root), (0, 0));
        let mut seen = std::collections::BTreeSet::new();
        for port in 0..64u16 {
            let f = tcp4([10, 0, 0, 1], [10, 0, 0, 2], 40000 + port, 5201);
            let t = e.r.h.dev.with_fw(|fw| rx_target(&fw.flows, &fw.tirs, &fw.rqts, &f)).unwrap();
            // The RQ is the RQT's entry at the hash, and the hash is the Toeplitz of the 4-tuple.
            let key: [u8; 40] = std::array::from_fn(|k| (k as u8).wrapping_mul(37) ^ 0x5a);
            let input =
                [&[10, 0, 0, 1][..], &[10, 0, 0, 2], &(40000 + port).to_be_bytes(), &5201u16.to_be_bytes()].concat();
            assert_eq!(t.hash, toeplitz(&key, &input));
            assert_eq!(t.rqn, rqs[t.hash as usize % 4]);
            seen.insert(t.rqn);
        }
        assert!(seen.len() > 1, "64 flows all hashed to one RQ: {seen:?}");
    }
}

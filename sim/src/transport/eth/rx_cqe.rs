//! The receive CQE of an Ethernet packet (`mlx5_cqe64`, what mlx5e's `mlx5e_build_rx_skb` reads): byte count,
//! the L3/L4 header types and their OK bits, the checksum mlx5e uses as CHECKSUM_COMPLETE (the ones' complement
//! sum from the IP header to the IP packet's end: no Ethernet or VLAN header, no tail padding), the RSS hash
//! and its type, the flow tag and the WQE counter. The CQE writer sets the owner bit.

use mlx5_core::prm::{c, consts};

use super::classify::{headers, RxTarget};
use super::send::csum_add;

const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
/// `l4_l3_hdr_type`'s L4 types (bits 6:4), as `get_cqe_l4_hdr_type` reads them.
const L4_NONE: u8 = 0;
const L4_TCP_NO_ACK: u8 = 1;
const L4_UDP: u8 = 2;
const L4_TCP_ACK_NO_DATA: u8 = 3;
const L4_TCP_ACK_AND_DATA: u8 = 4;

/// The CQE64 of `frame` (as received, VLAN tag in place) delivered to `t`, the `wqe_counter`th receive WQE.
/// `strip`: the RQ strips VLAN tags (its `vsd` clear): a tagged frame was written without its tag, which the
/// CQE reports instead (`cvlan_tag_present`, bit 0 of `l4_l3_hdr_type`, and the whole TCI in `vlan_info`, as
/// mlx5e's `mlx5e_build_rx_skb` and mlx5_ib's `handle_responder` read it); the byte count is what was written.
pub(crate) fn rx_cqe(frame: &[u8], t: &RxTarget, wqe_counter: u16, strip: bool) -> [u8; c::mlx5_cqe64::SIZE] {
    use c::mlx5_cqe64 as q;
    let mut e = [0u8; c::mlx5_cqe64::SIZE];
    let put = |e: &mut [u8; 64], m: mlx5_core::prm::Bytes, v: &[u8]| e[m.off..m.off + m.len].copy_from_slice(v);
    let stripped = strip && headers(frame).is_some_and(|h| h.vid.is_some());
    let written = frame.len() - if stripped { VLAN_HLEN } else { 0 };
    put(&mut e, q::BYTE_CNT, &(written as u32).to_be_bytes());
    put(&mut e, q::SOP_DROP_QPN, &(t.flow_tag & 0xff_ffff).to_be_bytes());
    put(&mut e, q::WQE_COUNTER, &wqe_counter.to_be_bytes());
    e[q::OP_OWN.off] = consts::MLX5_CQE_RESP_SEND << 4;
    let Some(h) = headers(frame) else { return e };
    let mut ok = consts::CQE_L2_OK as u8;
    let mut types = u8::from(stripped);
    if stripped {
        put(&mut e, q::VLAN_INFO, &frame[ETH_HLEN..ETH_HLEN + 2]);
    }
    let ip = ETH_HLEN + if h.vid.is_some() { 4 } else { 0 };
    let (l3, rss_l3) = match h.ip_version {
        4 => (consts::MLX5_CQE_L3_HDR_TYPE_IPV4 as u8, consts::CQE_RSS_IPV4 as u8),
        6 => (consts::MLX5_CQE_L3_HDR_TYPE_IPV6 as u8, consts::CQE_RSS_IPV6 as u8),
        _ => return finish(e, ok, types),
    };
    types |= l3 << 2;
    // The IP packet's end (tail padding excluded) from its own length field; one past the frame is a truncated
    // packet, whose headers are not OK.
    let claimed = match h.ip_version {
        4 => ip + usize::from(u16::from_be_bytes([frame[ip + 2], frame[ip + 3]])),
        _ => ip + 40 + usize::from(u16::from_be_bytes([frame[ip + 4], frame[ip + 5]])),
    };
    let end = claimed.min(frame.len());
    if claimed > frame.len() {
        put(&mut e, q::CHECK_SUM, &(csum_add(0, &frame[ip..end]) as u16).to_be_bytes());
        return finish(e, ok, types);
    }
    let ihl = if h.ip_version == 4 { usize::from(frame[ip] & 0xf) * 4 } else { 40 };
    let sum = csum_add(0, &frame[ip..end.max(ip)]) as u16;
    put(&mut e, q::CHECK_SUM, &sum.to_be_bytes());
    if h.ip_version == 6 || csum_add(0, &frame[ip..ip + ihl]) == 0xffff {
        ok |= consts::CQE_L3_OK as u8;
    }
    let l4_at = ip + ihl;
    let (l4, rss_l4) = match (h.protocol, h.ports) {
        (6, Some(_)) if frame.len() >= l4_at + 20 => {
            let ack = frame[l4_at + 13] & 0x10 != 0;
            let data = end > l4_at + usize::from(frame[l4_at + 12] >> 4) * 4;
            let ty = match (ack, data) {
                (false, _) => L4_TCP_NO_ACK,
                (true, false) => L4_TCP_ACK_NO_DATA,
                (true, true) => L4_TCP_ACK_AND_DATA,
            };
            (ty, consts::CQE_RSS_L4_TCP as u8)
        }
        (17, Some(_)) => (L4_UDP, consts::CQE_RSS_L4_UDP as u8),
        _ => (L4_NONE, consts::CQE_RSS_L4_NONE as u8),
    };
    types |= l4 << 4;
    // A length field that ends the packet inside its own headers leaves L4 unverified (and unread).
    if l4 != L4_NONE && end >= l4_at {
        // The L4 checksum verifies when the pseudo-header's sum completes the segment's to all ones.
        let mut pseudo = Vec::with_capacity(40);
        let a = if h.ip_version == 4 { 12 } else { 0 };
        pseudo.extend_from_slice(&h.src_ip[a..]);
        pseudo.extend_from_slice(&h.dst_ip[a..]);
        pseudo.extend_from_slice(&[0, h.protocol]);
        pseudo.extend_from_slice(&((end - l4_at) as u16).to_be_bytes());
        if csum_add(csum_add(0, &pseudo), &frame[l4_at..end]) == 0xffff {
            ok |= consts::CQE_L4_OK as u8;
        }
    }
    if t.hash != 0 {
        put(&mut e, q::RSS_HASH_RESULT, &t.hash.to_be_bytes());
        e[q::RSS_HASH_TYPE.off] = (rss_l3 << 2) | (rss_l4 << 6);
    }
    finish(e, ok, types)
}

fn finish(mut e: [u8; 64], ok: u8, types: u8) -> [u8; 64] {
    e[c::mlx5_cqe64::HDS_IP_EXT.off] = ok;
    e[c::mlx5_cqe64::L4_L3_HDR_TYPE.off] = types;
    e
}

#[cfg(test)]
mod tests {
    use super::super::send::checksum;
    use super::*;

    fn tcp4(payload: usize, pad: usize) -> Vec<u8> {
        let mut f = vec![0u8; ETH_HLEN + 40 + payload + pad];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        let ip = ETH_HLEN;
        f[ip] = 0x45;
        f[ip + 2..ip + 4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        f[ip + 8] = 64;
        f[ip + 9] = 6;
        f[ip + 12..ip + 16].copy_from_slice(&[10, 0, 0, 1]);
        f[ip + 16..ip + 20].copy_from_slice(&[10, 0, 0, 2]);
        f[ip + 20 + 12] = 5 << 4;
        f[ip + 20 + 13] = 0x10;
        for (k, b) in f[ip + 40..ip + 40 + payload].iter_mut().enumerate() {
            *b = (k * 7) as u8;
        }
        // The checksums over the IP packet, as the sender's offload fills them (padding is not part of it).
        let mut p = f[..ip + 40 + payload].to_vec();
        checksum(&mut p, (consts::MLX5_ETH_WQE_L3_CSUM | consts::MLX5_ETH_WQE_L4_CSUM) as u8);
        f[..p.len()].copy_from_slice(&p);
        f
    }

    #[test]
    fn an_rx_cqe_reports_types_ok_bits_hash_and_a_checksum_the_kernel_can_complete() {
        use c::mlx5_cqe64 as q;
        let f = tcp4(100, 0);
        let t = RxTarget { tirn: 1, rqn: 1, hash: 0xdead_beef, flow_tag: 0x123 };
        let e = rx_cqe(&f, &t, 7, true);
        assert_eq!(q::BYTE_CNT.get_be(&e, 0) as usize, f.len());
        assert_eq!(q::WQE_COUNTER.get_be(&e, 0), 7);
        assert_eq!(q::SOP_DROP_QPN.get_be(&e, 0), 0x123);
        assert_eq!(e[q::OP_OWN.off] >> 4, consts::MLX5_CQE_RESP_SEND);
        assert_eq!(u32::from(e[q::HDS_IP_EXT.off]), consts::CQE_L2_OK | consts::CQE_L3_OK | consts::CQE_L4_OK);
        let ty = e[q::L4_L3_HDR_TYPE.off];
        assert_eq!(((ty >> 4) & 7, (ty >> 2) & 3), (L4_TCP_ACK_AND_DATA, consts::MLX5_CQE_L3_HDR_TYPE_IPV4 as u8));
        assert_eq!(q::RSS_HASH_RESULT.get_be(&e, 0), 0xdead_beef);
        // CHECKSUM_COMPLETE: the IP header sums to all ones, so the CQE's sum plus the pseudo-header's is all
        // ones exactly when the TCP checksum verifies, which is how the kernel checks it.
        let sum = q::CHECK_SUM.get_be(&e, 0);
        let pseudo = [10, 0, 0, 1, 10, 0, 0, 2, 0, 6, 0, 120];
        assert_eq!(csum_add(sum, &pseudo), 0xffff);
        // Tail padding is not summed; a corrupted byte clears L4 OK and changes the sum.
        let padded = tcp4(100, 6);
        assert_eq!(q::CHECK_SUM.get_be(&rx_cqe(&padded, &t, 0, true), 0), sum);
        let mut bad = f.clone();
        bad[ETH_HLEN + 50] ^= 0xff;
        let e = rx_cqe(&bad, &t, 0, true);
        assert_eq!(u32::from(e[q::HDS_IP_EXT.off]) & consts::CQE_L4_OK, 0);
        // IPv4 total lengths that end inside the headers or past the frame are read without panicking.
        for tot in [0u16, 20, 30, 0xffff] {
            let mut odd = f.clone();
            odd[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&tot.to_be_bytes());
            let e = rx_cqe(&odd, &t, 0, true);
            assert_eq!(u32::from(e[q::HDS_IP_EXT.off]) & consts::CQE_L4_OK, 0, "tot_len {tot}");
        }
        // A frame too short for an Ethernet header reports its length and nothing parsed.
        let e = rx_cqe(&f[..10], &t, 0, true);
        assert_eq!((q::BYTE_CNT.get_be(&e, 0), e[q::HDS_IP_EXT.off]), (10, 0));
    }
}

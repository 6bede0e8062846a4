//! The Ethernet send WQE (what mlx5e's `mlx5e_sq_xmit_wqe` builds): a control segment, an Ethernet segment
//! (checksum flags, LSO `mss`, the inline headers), then data segments; and what the send engine makes of one:
//! checksum offload (IPv4 header, TCP/UDP over the pseudo-header) and LSO, which cuts a TCP payload into
//! `mss`-byte segments, each with rebuilt IPv4 and TCP headers and checksums. A malformed WQE is an
//! [`EthWqeError`], which the engine completes with `MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR`, as a ConnectX does.

use mlx5_core::prm::{c, consts};

const CTRL: usize = c::mlx5_wqe_ctrl_seg::SIZE;
const DS: usize = consts::MLX5_SEND_WQE_DS as usize;
/// Where the inline headers start: `inline_hdr.start`, in the Ethernet segment after the control segment.
const INLINE_START: usize = CTRL + c::mlx5_wqe_eth_seg::START.off;
const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
/// The customer and service VLAN tags' TPIDs (802.1Q, 802.1ad).
pub(crate) const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_HLEN: usize = 4;
const IPV6_HLEN: usize = 40;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// Why an Ethernet send WQE cannot be executed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EthWqeError {
    /// The control segment's `ds` is too small to hold an Ethernet segment, or larger than the WQE.
    SegmentCount { ds: usize },
    /// An opcode an SQ does not execute.
    Opcode(u8),
    /// LSO (`MLX5_OPCODE_TSO`) with no inline headers to replicate.
    LsoWithoutHeader,
    /// LSO with an `mss` of 0.
    MssZero,
    /// The inline headers run past the WQE's `ds` units.
    InlineTooLong { sz: usize, room: usize },
}

impl std::fmt::Display for EthWqeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SegmentCount { ds } => write!(f, "ds {ds} cannot hold a control and an Ethernet segment"),
            Self::Opcode(op) => write!(f, "opcode {op:#x} is not an SQ send"),
            Self::LsoWithoutHeader => f.write_str("LSO without inline headers"),
            Self::MssZero => f.write_str("LSO with mss 0"),
            Self::InlineTooLong { sz, room } => write!(f, "{sz} inline header bytes, room for {room}"),
        }
    }
}

impl std::error::Error for EthWqeError {}

/// A parsed Ethernet send WQE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EthSend {
    pub(crate) opcode: u8,
    /// `cs_flags`: `MLX5_ETH_WQE_L3_CSUM`, `MLX5_ETH_WQE_L4_CSUM`.
    pub(crate) cs_flags: u8,
    /// LSO segment size (TSO only).
    pub(crate) mss: u16,
    /// The inline headers (the frame's first bytes).
    pub(crate) inline: Vec<u8>,
    /// A VLAN tag to insert after the MAC addresses (`insert.type` with `MLX5_ETH_WQE_INSERT_VLAN`, which
    /// mlx5e sets instead of inline headers when its inline mode is none): the TPID and the TCI.
    pub(crate) insert_vlan: Option<(u16, u16)>,
    /// The data segments: (byte count, lkey, address).
    pub(crate) data: Vec<(u32, u32, u64)>,
}

/// Parses the WQE in `wqe` (its basic blocks, in order).
pub(crate) fn parse(wqe: &[u8]) -> Result<EthSend, EthWqeError> {
    use c::mlx5_wqe_ctrl_seg as ctrl;
    use c::mlx5_wqe_eth_seg as eseg;
    if wqe.len() < CTRL {
        return Err(EthWqeError::SegmentCount { ds: 0 });
    }
    let opcode = (ctrl::OPMOD_IDX_OPCODE.get_be(wqe, 0) & 0xff) as u8;
    let ds = (ctrl::QPN_DS.get_be(wqe, 0) & 0x3f) as usize;
    if opcode == consts::MLX5_OPCODE_NOP {
        return Ok(EthSend { opcode, cs_flags: 0, mss: 0, inline: Vec::new(), insert_vlan: None, data: Vec::new() });
    }
    if opcode != consts::MLX5_OPCODE_SEND && opcode != consts::MLX5_OPCODE_TSO {
        return Err(EthWqeError::Opcode(opcode));
    }
    let len = ds * DS;
    if ds < 2 || len > wqe.len() {
        return Err(EthWqeError::SegmentCount { ds });
    }
    let cs_flags = eseg::CS_FLAGS.get_be(wqe, CTRL) as u8;
    let mss = eseg::MSS.get_be(wqe, CTRL) as u16;
    // `insert.type` shares its place with `inline_hdr.sz`: its top bit says a VLAN tag is to be inserted and
    // there are no inline headers.
    let ty = eseg::TYPE.get_be(wqe, CTRL);
    let (sz, insert_vlan) = if ty & consts::MLX5_ETH_WQE_INSERT_VLAN != 0 {
        let tpid = if ty & consts::MLX5_ETH_WQE_SVLAN != 0 { ETH_P_8021AD } else { ETH_P_8021Q };
        (0, Some((tpid, eseg::VLAN_TCI.get_be(wqe, CTRL) as u16)))
    } else {
        (ty as usize, None)
    };
    if opcode == consts::MLX5_OPCODE_TSO {
        if sz == 0 {
            return Err(EthWqeError::LsoWithoutHeader);
        }
        if mss == 0 {
            return Err(EthWqeError::MssZero);
        }
    }
    let room = len - INLINE_START;
    if sz > room {
        return Err(EthWqeError::InlineTooLong { sz, room });
    }
    let inline = wqe[INLINE_START..INLINE_START + sz].to_vec();
    // The data segments start at the first 16-byte unit after the inline headers.
    let mut off = (INLINE_START + sz).next_multiple_of(DS).max(CTRL + DS);
    let mut data = Vec::new();
    let d = c::mlx5_wqe_data_seg::SIZE;
    while off + d <= len {
        let bc = c::mlx5_wqe_data_seg::BYTE_COUNT.get_be(wqe, off);
        let lkey = c::mlx5_wqe_data_seg::LKEY.get_be(wqe, off);
        let a = c::mlx5_wqe_data_seg::ADDR.off + off;
        let addr = u64::from_be_bytes(wqe[a..a + 8].try_into().unwrap_or([0; 8]));
        data.push((bc, lkey, addr));
        off += d;
    }
    Ok(EthSend { opcode, cs_flags, mss, inline, insert_vlan, data })
}

/// Inserts the VLAN tag `tpid`/`tci` after the MAC addresses of `frame`; `None` when the frame has none.
pub(crate) fn insert_vlan(frame: &mut Vec<u8>, (tpid, tci): (u16, u16)) -> Option<()> {
    if frame.len() < 12 {
        return None;
    }
    let mut tag = [0u8; VLAN_HLEN];
    tag[..2].copy_from_slice(&tpid.to_be_bytes());
    tag[2..].copy_from_slice(&tci.to_be_bytes());
    frame.splice(12..12, tag);
    Some(())
}

/// The ones' complement sum of `b` (16-bit big-endian words, an odd byte padded), folded.
pub(crate) fn csum_add(mut sum: u32, b: &[u8]) -> u32 {
    let mut chunks = b.chunks_exact(2);
    for w in &mut chunks {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// An untagged IP frame's layout: where the IP and L4 headers start, the L4 protocol, and the IP version.
#[derive(Debug, Clone, Copy)]
struct IpAt {
    ip: usize,
    l4: usize,
    proto: u8,
    v6: bool,
}

/// The layout of an IPv4 frame, or IPv6 whose first next header is the L4 one, untagged or with one VLAN tag
/// (mlx5e puts the tag into the inline headers); `None` otherwise.
fn ip_at(frame: &[u8]) -> Option<IpAt> {
    let mut ip = ETH_HLEN;
    let mut ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        ethertype = u16::from_be_bytes([*frame.get(16)?, *frame.get(17)?]);
        ip += VLAN_HLEN;
    }
    match ethertype {
        ETH_P_IP => {
            let ihl = usize::from(frame.get(ip)? & 0xf) * 4;
            if frame[ip] >> 4 != 4 || ihl < 20 || frame.len() < ip + ihl {
                return None;
            }
            Some(IpAt { ip, l4: ip + ihl, proto: frame[ip + 9], v6: false })
        }
        ETH_P_IPV6 if frame.len() >= ip + IPV6_HLEN && frame[ip] >> 4 == 6 => {
            Some(IpAt { ip, l4: ip + IPV6_HLEN, proto: frame[ip + 6], v6: true })
        }
        _ => None,
    }
}

/// The ones' complement sum of the L4 pseudo-header of `frame` for an L4 segment of `len` bytes.
fn pseudo_sum(frame: &[u8], at: IpAt, len: usize) -> u32 {
    if at.v6 {
        let mut tail = [0u8; 8];
        tail[..4].copy_from_slice(&(len as u32).to_be_bytes());
        tail[7] = at.proto;
        csum_add(csum_add(0, &frame[at.ip + 8..at.ip + 40]), &tail)
    } else {
        let mut tail = [0u8; 4];
        tail[1] = at.proto;
        tail[2..].copy_from_slice(&(len as u16).to_be_bytes());
        csum_add(csum_add(0, &frame[at.ip + 12..at.ip + 20]), &tail)
    }
}

/// Fills in the checksums `cs_flags` asks for in an IPv4 or IPv6 frame (the IPv4 header's; TCP's or UDP's over
/// the pseudo-header), as the device does on transmit. Other frames leave unchanged.
pub(crate) fn checksum(frame: &mut [u8], cs_flags: u8) {
    let Some(at) = ip_at(frame) else { return };
    let IpAt { ip, l4, proto, v6 } = at;
    if u32::from(cs_flags) & consts::MLX5_ETH_WQE_L3_CSUM != 0 && !v6 {
        frame[ip + 10..ip + 12].fill(0);
        let s = !csum_add(0, &frame[ip..l4]) as u16;
        frame[ip + 10..ip + 12].copy_from_slice(&s.to_be_bytes());
    }
    let sum_at = match proto {
        IPPROTO_TCP if frame.len() >= l4 + 20 => l4 + 16,
        IPPROTO_UDP if frame.len() >= l4 + 8 => l4 + 6,
        _ => return,
    };
    if u32::from(cs_flags) & consts::MLX5_ETH_WQE_L4_CSUM == 0 {
        return;
    }
    frame[sum_at..sum_at + 2].fill(0);
    let mut s = !csum_add(pseudo_sum(frame, at, frame.len() - l4), &frame[l4..]) as u16;
    // UDP sends a zero checksum as all ones (zero means none).
    if proto == IPPROTO_UDP && s == 0 {
        s = 0xffff;
    }
    frame[sum_at..sum_at + 2].copy_from_slice(&s.to_be_bytes());
}

/// LSO: cuts a TCP `frame` over IPv4 or IPv6 (headers then payload) into frames of at most `mss` payload bytes.
/// Each gets the headers with its IPv4 total length and an identification one above the previous (IPv6: its
/// payload length), its TCP sequence number, FIN and PSH only on the last, CWR only on the first, and its
/// checksums. `None` when the frame is not TCP with a whole TCP header (the engine then fails the WQE), or `mss`
/// is 0.
pub(crate) fn segment(frame: &[u8], mss: u16) -> Option<Vec<Vec<u8>>> {
    let IpAt { ip, l4, proto, v6 } = ip_at(frame)?;
    if proto != IPPROTO_TCP || mss == 0 || frame.len() < l4 + 20 {
        return None;
    }
    let hdr = l4 + usize::from(frame[l4 + 12] >> 4) * 4;
    if hdr < l4 + 20 || frame.len() < hdr {
        return None;
    }
    let payload = &frame[hdr..];
    let seq0 = u32::from_be_bytes([frame[l4 + 4], frame[l4 + 5], frame[l4 + 6], frame[l4 + 7]]);
    let id0 = u16::from_be_bytes([frame[ip + 4], frame[ip + 5]]);
    let flags = frame[l4 + 13];
    let (fin_psh, cwr) = (0x01 | 0x08, 0x80);
    let n = payload.len().div_ceil(usize::from(mss)).max(1);
    let mut out = Vec::with_capacity(n);
    for (k, chunk) in payload.chunks(usize::from(mss)).chain((payload.is_empty()).then_some(&[][..])).enumerate() {
        let mut f = Vec::with_capacity(hdr + chunk.len());
        f.extend_from_slice(&frame[..hdr]);
        f.extend_from_slice(chunk);
        if v6 {
            let payload_len = (f.len() - l4) as u16;
            f[ip + 4..ip + 6].copy_from_slice(&payload_len.to_be_bytes());
        } else {
            let total = (f.len() - ip) as u16;
            f[ip + 2..ip + 4].copy_from_slice(&total.to_be_bytes());
            f[ip + 4..ip + 6].copy_from_slice(&id0.wrapping_add(k as u16).to_be_bytes());
        }
        let seq = seq0.wrapping_add((k * usize::from(mss)) as u32);
        f[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
        let mut fl = flags;
        if k + 1 < n {
            fl &= !fin_psh;
        }
        if k > 0 {
            fl &= !cwr;
        }
        f[l4 + 13] = fl;
        checksum(&mut f, (consts::MLX5_ETH_WQE_L3_CSUM | consts::MLX5_ETH_WQE_L4_CSUM) as u8);
        out.push(f);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WQE of `ds` units: opcode, Ethernet segment with `cs_flags`, `mss` and the inline headers `hdr`, then
    /// one data segment.
    fn wqe(opcode: u8, ds: u32, cs_flags: u8, mss: u16, hdr: &[u8]) -> Vec<u8> {
        let mut w = vec![0u8; 4 * consts::MLX5_SEND_WQE_BB as usize];
        w[..4].copy_from_slice(&u32::from(opcode).to_be_bytes());
        w[4..8].copy_from_slice(&ds.to_be_bytes());
        w[CTRL + c::mlx5_wqe_eth_seg::CS_FLAGS.off] = cs_flags;
        w[CTRL + 6..CTRL + 8].copy_from_slice(&mss.to_be_bytes());
        w[CTRL + 12..CTRL + 14].copy_from_slice(&(hdr.len() as u16).to_be_bytes());
        w[INLINE_START..INLINE_START + hdr.len()].copy_from_slice(hdr);
        w
    }

    /// An IPv4/TCP frame of `payload` bytes with valid-looking headers (checksums zero).
    fn tcp_frame(payload: usize, flags: u8) -> Vec<u8> {
        let mut f = vec![0u8; ETH_HLEN + 40 + payload];
        f[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
        let ip = ETH_HLEN;
        f[ip] = 0x45;
        f[ip + 2..ip + 4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        f[ip + 4..ip + 6].copy_from_slice(&0x1234u16.to_be_bytes());
        f[ip + 8] = 64;
        f[ip + 9] = IPPROTO_TCP;
        f[ip + 12..ip + 16].copy_from_slice(&[10, 0, 0, 1]);
        f[ip + 16..ip + 20].copy_from_slice(&[10, 0, 0, 2]);
        let t = ip + 20;
        f[t..t + 2].copy_from_slice(&5001u16.to_be_bytes());
        f[t + 2..t + 4].copy_from_slice(&5201u16.to_be_bytes());
        f[t + 4..t + 8].copy_from_slice(&1000u32.to_be_bytes());
        f[t + 12] = 5 << 4;
        f[t + 13] = flags;
        for (k, b) in f[t + 20..].iter_mut().enumerate() {
            *b = k as u8;
        }
        f
    }

    /// A frame's checksums verify: the IPv4 header and the TCP segment over its pseudo-header sum to all ones.
    fn verifies(f: &[u8]) -> bool {
        let at = ip_at(f).unwrap();
        let l4_ok = csum_add(pseudo_sum(f, at, f.len() - at.l4), &f[at.l4..]) == 0xffff;
        l4_ok && (at.v6 || csum_add(0, &f[at.ip..at.l4]) == 0xffff)
    }

    #[test]
    fn a_send_wqe_parses_into_its_inline_headers_and_data_segments() {
        let hdr = [0xaa; 18];
        let mut w = wqe(consts::MLX5_OPCODE_SEND, 4, 0xc0, 0, &hdr);
        // Inline headers end at byte 48: the data segment is the fourth unit.
        w[48..52].copy_from_slice(&100u32.to_be_bytes());
        w[52..56].copy_from_slice(&7u32.to_be_bytes());
        w[56..64].copy_from_slice(&0x1000u64.to_be_bytes());
        let s = parse(&w).unwrap();
        assert_eq!((s.cs_flags, s.inline.len(), s.data.as_slice()), (0xc0, 18, &[(100, 7, 0x1000)][..]));
    }

    #[test]
    fn malformed_ethernet_wqes_are_typed_errors() {
        let hdr = [0u8; 54];
        let tso = consts::MLX5_OPCODE_TSO;
        // Bad segment counts: too few for an Ethernet segment, more than the WQE.
        assert_eq!(parse(&wqe(consts::MLX5_OPCODE_SEND, 1, 0, 0, &[])), Err(EthWqeError::SegmentCount { ds: 1 }));
        assert_eq!(parse(&wqe(consts::MLX5_OPCODE_SEND, 63, 0, 0, &[])), Err(EthWqeError::SegmentCount { ds: 63 }));
        // LSO with no header, LSO with mss 0.
        assert_eq!(parse(&wqe(tso, 8, 0, 1460, &[])), Err(EthWqeError::LsoWithoutHeader));
        assert_eq!(parse(&wqe(tso, 8, 0, 0, &hdr)), Err(EthWqeError::MssZero));
        // Inline headers longer than the WQE's units: 54 bytes from byte 30 end at 84, in the sixth unit.
        assert_eq!(parse(&wqe(tso, 3, 0, 1460, &hdr)), Err(EthWqeError::InlineTooLong { sz: 54, room: 18 }));
        assert_eq!(parse(&wqe(tso, 5, 0, 1460, &hdr)), Err(EthWqeError::InlineTooLong { sz: 54, room: 50 }));
        assert_eq!(parse(&wqe(tso, 6, 0, 1460, &hdr)).map(|s| (s.mss, s.inline.len())), Ok((1460, 54)));
        // An RDMA opcode on an SQ; a WQE shorter than its control segment.
        assert_eq!(parse(&wqe(consts::MLX5_OPCODE_RDMA_WRITE, 4, 0, 0, &[])), Err(EthWqeError::Opcode(8)));
        assert_eq!(parse(&[0u8; 8]), Err(EthWqeError::SegmentCount { ds: 0 }));
    }

    #[test]
    fn checksum_offload_fills_both_checksums() {
        let mut f = tcp_frame(333, 0x18);
        assert!(!verifies(&f));
        checksum(&mut f, (consts::MLX5_ETH_WQE_L3_CSUM | consts::MLX5_ETH_WQE_L4_CSUM) as u8);
        assert!(verifies(&f));
    }

    #[test]
    fn lso_cuts_the_payload_and_rebuilds_each_segment_s_headers() {
        // PSH|ACK|FIN|CWR on a 4000-byte payload at mss 1448: three segments.
        let f = tcp_frame(4000, 0x80 | 0x10 | 0x08 | 0x01);
        let segs = segment(&f, 1448).unwrap();
        assert_eq!(segs.len(), 3);
        let t = ETH_HLEN + 20;
        let mut payload = Vec::new();
        for (k, s) in segs.iter().enumerate() {
            assert!(verifies(s), "segment {k}");
            let len = s.len() - ETH_HLEN - 40;
            assert_eq!(u16::from_be_bytes([s[ETH_HLEN + 2], s[ETH_HLEN + 3]]) as usize, 40 + len);
            assert_eq!(u16::from_be_bytes([s[ETH_HLEN + 4], s[ETH_HLEN + 5]]), 0x1234 + k as u16);
            let seq = u32::from_be_bytes([s[t + 4], s[t + 5], s[t + 6], s[t + 7]]);
            assert_eq!(seq, 1000 + 1448 * k as u32);
            let last = k == 2;
            assert_eq!(s[t + 13] & 0x09 != 0, last, "FIN/PSH on the last only");
            assert_eq!(s[t + 13] & 0x80 != 0, k == 0, "CWR on the first only");
            payload.extend_from_slice(&s[t + 20..]);
        }
        assert_eq!(payload, f[t + 20..]);
        // Not TCP, or mss 0: no segmentation.
        assert!(segment(&f, 0).is_none());
        assert!(segment(&f[..ETH_HLEN + 10], 1448).is_none());
    }

    #[test]
    fn ipv6_lso_and_checksums_use_the_payload_length_and_the_ipv6_pseudo_header() {
        let payload = 2500;
        let mut f = vec![0u8; ETH_HLEN + IPV6_HLEN + 20 + payload];
        f[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
        let ip = ETH_HLEN;
        f[ip] = 0x60;
        f[ip + 4..ip + 6].copy_from_slice(&((20 + payload) as u16).to_be_bytes());
        f[ip + 6] = IPPROTO_TCP;
        f[ip + 7] = 64;
        f[ip + 8] = 0xfd;
        f[ip + 24] = 0xfd;
        f[ip + 39] = 2;
        let t = ip + IPV6_HLEN;
        f[t + 12] = 5 << 4;
        f[t + 13] = 0x18;
        for (k, b) in f[t + 20..].iter_mut().enumerate() {
            *b = k as u8;
        }
        let segs = segment(&f, 1000).unwrap();
        assert_eq!(segs.iter().map(Vec::len).collect::<Vec<_>>(), [1074, 1074, 574]);
        for s in &segs {
            assert!(verifies(s));
            assert_eq!(usize::from(u16::from_be_bytes([s[ip + 4], s[ip + 5]])), s.len() - t);
        }
        let mut one = f.clone();
        checksum(&mut one, consts::MLX5_ETH_WQE_L4_CSUM as u8);
        assert!(verifies(&one));
    }
}

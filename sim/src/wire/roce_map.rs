//! A simulated packet as the RoCEv2 frames a ConnectX port puts on Ethernet for it: an RC or UC message cut at the
//! path MTU into FIRST/MIDDLE/LAST (or ONLY) packets with one PSN each and AckReq on the last RC packet (and every
//! `RoceInfo::ack_every` packets; the requester's window sends a part of them, `resume` and `count`), RETH on
//! the first WRITE packet, a READ request answered by one response packet per PSN with AETH on the first and last,
//! atomics with AtomicETH and their AtomicAckETH answer, ACKs and NAKs (RNR with its timer, PSN sequence error with
//! the expected PSN, remote access, invalid request, remote operational) in AETH, and UD sends with DETH and the
//! Q_Key. IP addresses come from the GIDs (IPv4-mapped GIDs give IPv4), the DSCP/ECN byte from the traffic class,
//! the UDP source port from the QP's path (or, as Linux derives it, from the flow label and QPNs).
//!
//! Used for captures (`--pcap`): the message-level packets the simulated transport exchanges are written out as
//! the frames they stand for. A packet with no frame form (an IB port's packet without a GRH, or the simulator's
//! "lost" marker) is refused with a reason.

use super::packet::{AtomicOp, Body, Nak, Packet, RcOp, Resp, GID_LEN};
use super::roce::ether::{self, EtherType, EthernetRepr, Mac};
use super::roce::frame::{Integrity, IpRepr, RoceRepr};
use super::roce::ib::{Aeth, AtomicEth, BthRepr, Deth, Ext, NakCode, Opcode, Reth, Syndrome, XrcEth, DEFAULT_PKEY};
use super::roce::ip::{fold, sum, Ipv4Repr, Ipv6Repr, IPV6_HEADER_LEN, PROTO_UDP};
use super::roce::rc::{mtu_bytes, MsgKind, Segmenter, PSN_MASK};
use super::roce::udp::{UdpRepr, ROCE_PORT};

/// The AETH credit code of an ACK that does not limit credits (0x1f, as `rdma_rxe` and ConnectX send).
const UNLIMITED_CREDIT: u8 = 0x1f;
/// Flow labels are 20 bits (IBA 8.3).
const FLOW_LABEL_MASK: u32 = 0xf_ffff;
/// The RoCEv2 UDP source port range Linux uses (`IB_ROCE_UDP_ENCAP_VALID_PORT_MIN`).
const UDP_SPORT_MIN: u16 = 0xc000;
/// Where the checksum is in the UDP header.
const UDP_CHECKSUM: usize = 6;
/// The IPv4-mapped IPv6 prefix `::ffff:0:0/96`.
const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// The UDP source port of a flow, as Linux's `rdma_get_udp_sport`: the flow label (or, when it is 0, one computed
/// from the two QPNs, `rdma_calc_flow_label`) folded into 14 bits above 0xC000.
pub(crate) fn udp_sport(flow_label: u32, lqpn: u32, rqpn: u32) -> u16 {
    let mut fl = flow_label & FLOW_LABEL_MASK;
    if fl == 0 {
        let mut v = u64::from(lqpn) * u64::from(rqpn);
        v ^= v >> 20;
        v ^= v >> 40;
        fl = (v as u32) & FLOW_LABEL_MASK;
    }
    let low = (fl & 0x3fff) ^ ((fl & 0xf_c000) >> 14);
    UDP_SPORT_MIN | low as u16
}

/// Whether RoCE v2 between two GIDs travels on IPv4: both are IPv4-mapped.
pub(crate) fn is_ipv4(sgid: &[u8; GID_LEN], dgid: &[u8; GID_LEN]) -> bool {
    sgid[..12] == V4_MAPPED && dgid[..12] == V4_MAPPED
}

/// The IP header between two GIDs: IPv4 when both are IPv4-mapped ([`is_ipv4`]), else IPv6.
pub(crate) fn ip_header(
    sgid: &[u8; GID_LEN],
    dgid: &[u8; GID_LEN],
    tclass: u8,
    hop_limit: u8,
    flow_label: u32,
) -> IpRepr {
    if is_ipv4(sgid, dgid) {
        let (mut src, mut dst) = ([0u8; 4], [0u8; 4]);
        src.copy_from_slice(&sgid[12..]);
        dst.copy_from_slice(&dgid[12..]);
        IpRepr::V4(Ipv4Repr {
            src,
            dst,
            protocol: PROTO_UDP,
            payload_len: 0,
            tos: tclass,
            ttl: hop_limit,
            ident: 0,
            dont_frag: true,
        })
    } else {
        IpRepr::V6(Ipv6Repr {
            src: *sgid,
            dst: *dgid,
            next_header: PROTO_UDP,
            payload_len: 0,
            traffic_class: tclass,
            flow_label: flow_label & FLOW_LABEL_MASK,
            hop_limit,
        })
    }
}

/// One frame to write: its BTH fields, extended headers and the part of the message it carries.
struct Piece<'a> {
    opcode: Opcode,
    psn: u32,
    ack_req: bool,
    solicited: bool,
    ext: Ext,
    payload: &'a [u8],
}

fn piece(opcode: Opcode, psn: u32, ext: Ext) -> Piece<'static> {
    Piece { opcode, psn, ack_req: false, solicited: false, ext, payload: &[] }
}

fn aeth(syndrome: Syndrome, msn: u32) -> Ext {
    Ext { aeth: Some(Aeth { syndrome, msn: msn & PSN_MASK }), ..Ext::default() }
}

/// Writes the RoCEv2 frames of `p`, from the port with MAC `src` to the one with MAC `dst`, into `buf` one after
/// another, handing each to `out`. Returns the number of frames, or why the packet has no frame form.
pub(crate) fn emit_frames<D>(
    p: &Packet<D>,
    src: Mac,
    dst: Mac,
    buf: &mut Vec<u8>,
    out: &mut dyn FnMut(&[u8]),
) -> Result<u32, &'static str> {
    emit_frames_with(p, src, dst, buf, Integrity::Check, out)
}

/// [`emit_frames`]; with [`Integrity::Trusted`] the UDP checksum and ICRC are not computed (zero): frames for
/// another device of this process, which takes them trusted, as they cross no cable.
/// The transport bits of XRC's opcodes (RC's are 000).
const XRC_TRANSPORT: u8 = 0xa0;

pub(crate) fn emit_frames_with<D>(
    p: &Packet<D>,
    src: Mac,
    dst: Mac,
    buf: &mut Vec<u8>,
    integrity: Integrity,
    out: &mut dyn FnMut(&[u8]),
) -> Result<u32, &'static str> {
    // An Ethernet frame from an SQ is already its own form.
    if let Body::Eth { frame } = &p.body {
        out(frame);
        return Ok(1);
    }
    let grh = p.grh.ok_or("no GRH: not a RoCE packet")?;
    let ip = ip_header(&grh.sgid, &grh.dgid, grh.tclass, grh.hop_limit, grh.flow_label);
    let sport = match p.roce.udp_sport {
        0 => udp_sport(grh.flow_label, p.src_qpn, p.dst_qpn),
        s => s,
    };
    let eth = EthernetRepr { dst, src, ethertype: EtherType::Ipv4 };
    let udp = UdpRepr { src_port: sport, dst_port: ROCE_PORT, payload_len: 0 };
    // A UD send carries the P_Key its QP's index names; the rest the default one (one partition).
    let pkey = match &p.body {
        Body::Ud { pkey, .. } => *pkey,
        _ => DEFAULT_PKEY,
    };
    let mut frames = 0u32;
    let mut ident = 0u16;
    // An XRC request: RC's packets with XRC's opcodes (transport 101) and the XRCETH on each.
    let xrc = match &p.body {
        Body::Rc { xrc_srqn: Some(n), .. } => Some(XrcEth { xrc_srqn: *n }),
        _ => None,
    };
    let mut put = |mut pc: Piece<'_>| -> Result<(), &'static str> {
        if let Some(x) = xrc {
            pc.opcode = Opcode::from(u8::from(pc.opcode) | XRC_TRANSPORT);
            pc.ext.xrceth = Some(x);
        }
        let bth = BthRepr {
            opcode: pc.opcode,
            solicited: pc.solicited,
            migreq: false,
            pad_count: 0,
            pkey,
            fecn: false,
            becn: false,
            dest_qpn: p.dst_qpn,
            ack_req: pc.ack_req,
            psn: pc.psn & PSN_MASK,
        };
        let ip = match ip {
            IpRepr::V4(r) => IpRepr::V4(Ipv4Repr { ident, ..r }),
            v6 => v6,
        };
        ident = ident.wrapping_add(1);
        let repr = RoceRepr { eth, ip, udp, bth, ext: pc.ext, payload: pc.payload };
        let len = repr.frame_len();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        let n = repr.emit_with(buf, integrity).map_err(|_| "message larger than one frame carries")?;
        // IPv6 forbids a zero UDP checksum (RFC 8200), so over IPv6 it is computed, as Linux does; the ICRC
        // masks it either way.
        if let (IpRepr::V6(r), Integrity::Check) = (repr.ip, integrity) {
            let at = ether::HEADER_LEN + IPV6_HEADER_LEN;
            let udp_len = u16::try_from(n - at).map_err(|_| "message larger than one frame carries")?;
            let c = match fold(sum(r.pseudo_sum(udp_len), &buf[at..n])) {
                0 => 0xffff,
                c => c,
            };
            buf[at + UDP_CHECKSUM..at + UDP_CHECKSUM + 2].copy_from_slice(&c.to_be_bytes());
        }
        out(&buf[..n]);
        frames += 1;
        Ok(())
    };
    let mtu = mtu_bytes(p.roce.mtu);
    match &p.body {
        Body::Rc { psn, op, solicited, .. } | Body::Uc { psn, op, solicited } => {
            let uc = matches!(p.body, Body::Uc { .. });
            let inv = match op {
                RcOp::Send { inv, .. } => *inv,
                _ => None,
            };
            let (data, kind, imm) = match op {
                RcOp::Send { data, inv: Some(_), .. } => (&data[..], MsgKind::SendInv, None),
                RcOp::Send { data, imm, .. } => (&data[..], MsgKind::Send { imm: imm.is_some() }, *imm),
                RcOp::Write { data, imm, .. } => (&data[..], MsgKind::Write { imm: imm.is_some() }, *imm),
                RcOp::Read { raddr, rkey, len } => {
                    // Asked again from response packet `resume`: the PSN, address and length move on as far.
                    let skip = match mtu {
                        Some(size) if u64::from(p.roce.resume) * (size as u64) < *len => {
                            u64::from(p.roce.resume) * size as u64
                        }
                        _ => 0,
                    };
                    let dma_len = u32::try_from(*len - skip).map_err(|_| "READ longer than a RETH says")?;
                    let reth = Reth { va: raddr.wrapping_add(skip), rkey: *rkey, dma_len };
                    let at = match mtu {
                        Some(size) => psn.wrapping_add((skip / size as u64) as u32),
                        None => *psn,
                    };
                    let mut pc = piece(Opcode::RcReadRequest, at, Ext { reth: Some(reth), ..Ext::default() });
                    pc.ack_req = true;
                    put(pc)?;
                    return Ok(frames);
                }
                RcOp::Atomic { raddr, rkey, op } => {
                    let (opcode, swap_add, compare) = match *op {
                        AtomicOp::CmpSwap { compare, swap } => (Opcode::RcCompareSwap, swap, compare),
                        AtomicOp::FetchAdd { add } => (Opcode::RcFetchAdd, add, 0),
                    };
                    let a = AtomicEth { va: *raddr, rkey: *rkey, swap_add, compare };
                    let mut pc = piece(opcode, *psn, Ext { atomic_eth: Some(a), ..Ext::default() });
                    pc.ack_req = true;
                    put(pc)?;
                    return Ok(frames);
                }
            };
            // An unknown MTU is one packet, as the transport counts it.
            let size = mtu.unwrap_or(data.len().max(1));
            let reth = match op {
                RcOp::Write { raddr, rkey, .. } => Some(Reth {
                    va: *raddr,
                    rkey: *rkey,
                    dma_len: u32::try_from(data.len()).map_err(|_| "WRITE longer than a RETH says")?,
                }),
                _ => None,
            };
            let segs = Segmenter::new(kind, uc, data.len(), size, *psn);
            let count = Segmenter::count(&segs);
            // A retransmission resumes at packet `resume` (the whole message when that is past its end); the
            // requester's window may send `count` packets from there.
            let resume = if p.roce.resume < count { p.roce.resume } else { 0 };
            let take = match p.roce.count {
                0 => count,
                n => n,
            };
            let every = p.roce.ack_every;
            for (i, s) in segs.enumerate().skip(resume as usize).take(take as usize) {
                let (first, last) = (i == 0, i as u32 + 1 == count);
                let ext = Ext {
                    reth: if first { reth } else { None },
                    immdt: if last { imm } else { None },
                    ieth: if last { inv } else { None },
                    ..Ext::default()
                };
                put(Piece {
                    opcode: s.opcode,
                    psn: s.psn,
                    // UC has no acknowledgements; an RC requester asks every `every` packets too.
                    ack_req: (s.ack_req || (every != 0 && (i as u32 + 1).is_multiple_of(every))) && !uc,
                    solicited: last && *solicited,
                    ext,
                    payload: &data[s.offset..s.offset + s.len],
                })?;
            }
        }
        Body::Ud { qkey, data, imm, solicited, .. } => {
            let opcode = if imm.is_some() { Opcode::UdSendOnlyImm } else { Opcode::UdSendOnly };
            let ext = Ext { deth: Some(Deth { qkey: *qkey, src_qpn: p.src_qpn }), immdt: *imm, ..Ext::default() };
            put(Piece { opcode, psn: p.roce.psn, ack_req: false, solicited: *solicited, ext, payload: data })?;
        }
        // Sent as it is, above.
        Body::Eth { .. } => {}
        Body::Resp { resp, .. } => {
            let (psn, msn) = (p.roce.psn, p.roce.msn);
            match resp {
                Resp::Ack => put(piece(Opcode::RcAck, psn, aeth(Syndrome::Ack { credit: UNLIMITED_CREDIT }, msn)))?,
                Resp::AtomicOrig(v) => {
                    let ext = Ext { atomic_ack: Some(*v), ..aeth(Syndrome::Ack { credit: UNLIMITED_CREDIT }, msn) };
                    put(piece(Opcode::RcAtomicAck, psn, ext))?;
                }
                Resp::RnrNak { timer } => {
                    put(piece(Opcode::RcAck, psn, aeth(Syndrome::RnrNak { timer: *timer }, msn)))?
                }
                Resp::Nak(n) => {
                    let code = match n {
                        Nak::PsnSequence => NakCode::PsnSequence,
                        Nak::InvalidRequest => NakCode::InvalidRequest,
                        Nak::RemoteAccess => NakCode::RemoteAccess,
                        Nak::RemoteOp => NakCode::RemoteOperational,
                    };
                    put(piece(Opcode::RcAck, psn, aeth(Syndrome::Nak(code), msn)))?;
                }
                Resp::ReadData(d) => {
                    let size = mtu.unwrap_or(d.len().max(1));
                    let segs = Segmenter::new(MsgKind::ReadResponse, false, d.len(), size, psn);
                    let count = Segmenter::count(&segs);
                    for (i, s) in segs.enumerate() {
                        // AETH on the first and last (or only) response.
                        let ends = i == 0 || i as u32 + 1 == count;
                        let ext =
                            if ends { aeth(Syndrome::Ack { credit: UNLIMITED_CREDIT }, msn) } else { Ext::default() };
                        let mut pc = piece(s.opcode, s.psn, ext);
                        pc.payload = &d[s.offset..s.offset + s.len];
                        put(pc)?;
                    }
                }
                Resp::Lost(_) => return Err("not a frame: the requester's ACK timer stands for it"),
            }
        }
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::super::roce::frame::{parse, Parsed};
    use super::super::roce::rc::psn_count;
    use super::super::{Grh, Payload, RoceInfo};
    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        super::super::roce::frame::mapped(a)
    }

    fn packet(body: Body, roce: RoceInfo) -> Packet<()> {
        let grh = Grh { sgid: v4([10, 0, 0, 2]), dgid: v4([10, 0, 0, 1]), tclass: 0x68, flow_label: 0, hop_limit: 64 };
        Packet { src: (), dst: (), src_qpn: 0x11, dst_qpn: 0x321, slid: 0, sl: 0, grh: Some(grh), body, roce }
    }

    /// Every frame of `p`, parsed back (each must pass every check, the ICRC included): (opcode, PSN, AckReq,
    /// extended headers, payload length).
    fn frames(p: &Packet<()>) -> Vec<(Opcode, u32, bool, Ext, usize)> {
        let mut got = Vec::new();
        let mut buf = Vec::new();
        let n = emit_frames(p, [2, 0, 0, 0, 0, 2], [0x52, 0x54, 0, 0, 0, 1], &mut buf, &mut |f| {
            let Ok(Parsed::Roce(r)) = parse(f) else { panic!("frame does not parse: {:?}", parse(f)) };
            let IpRepr::V4(ip) = r.ip else { panic!("not IPv4") };
            assert_eq!(
                (ip.src, ip.dst, ip.tos, ip.ttl, r.udp.dst_port),
                ([10, 0, 0, 2], [10, 0, 0, 1], 0x68, 64, 4791)
            );
            assert_eq!((r.eth.src, r.bth.dest_qpn, r.bth.pkey), ([2, 0, 0, 0, 0, 2], 0x321, 0xffff));
            got.push((r.bth.opcode, r.bth.psn, r.bth.ack_req, r.ext, r.payload.len()));
        })
        .unwrap();
        assert_eq!(n as usize, got.len());
        got
    }

    const MTU_1024: u8 = 3;

    #[test]
    fn a_send_is_cut_at_the_mtu_with_ack_req_on_the_last_packet() {
        let data: Vec<u8> = (0..3000).map(|i| i as u8).collect();
        let body = Body::Rc {
            seq: 1,
            psn: 0xff_fffe,
            op: RcOp::Send { data: Payload::from(&data[..]), imm: None, inv: None },
            solicited: true,
            xrc_srqn: None,
        };
        let f = frames(&packet(body, RoceInfo { mtu: MTU_1024, ..RoceInfo::default() }));
        let ops: Vec<_> = f.iter().map(|x| (x.0, x.1, x.2, x.4)).collect();
        assert_eq!(
            ops,
            [
                (Opcode::RcSendFirst, 0xff_fffe, false, 1024),
                (Opcode::RcSendMiddle, 0xff_ffff, false, 1024),
                (Opcode::RcSendLast, 0, true, 952)
            ]
        );
    }

    #[test]
    fn an_xrc_request_takes_xrc_opcodes_and_an_xrceth_on_every_packet() {
        // A 2053-byte XRC WRITE cut at 1024: XRC WRITE FIRST/MIDDLE/LAST, each with the XRCETH, the RETH on the
        // first (IBA's order: XRCETH before RETH).
        let data = vec![7u8; 2048 + 5];
        let op = RcOp::Write { raddr: 0x1000, rkey: 0x42, data: Payload::from(&data[..]), imm: None };
        let f = frames(&packet(
            Body::Rc { seq: 1, psn: 10, op, solicited: false, xrc_srqn: Some(0x41) },
            RoceInfo { mtu: MTU_1024, ..RoceInfo::default() },
        ));
        let ops: Vec<_> = f.iter().map(|x| (x.0, x.3.xrceth.map(|e| e.xrc_srqn), x.4)).collect();
        assert_eq!(
            ops,
            [
                (Opcode::XrcWriteFirst, Some(0x41), 1024),
                (Opcode::XrcWriteMiddle, Some(0x41), 1024),
                (Opcode::XrcWriteLast, Some(0x41), 5)
            ]
        );
        assert_eq!(f[0].3.reth, Some(Reth { va: 0x1000, rkey: 0x42, dma_len: 2053 }));
    }

    #[test]
    fn a_write_carries_reth_on_the_first_packet_and_the_immediate_on_the_last() {
        let data = vec![7u8; 2048 + 5];
        let op = RcOp::Write { raddr: 0x1000, rkey: 0x42, data: Payload::from(&data[..]), imm: Some([1, 2, 3, 4]) };
        let f = frames(&packet(
            Body::Rc { seq: 1, psn: 10, op, solicited: false, xrc_srqn: None },
            RoceInfo { mtu: MTU_1024, ..RoceInfo::default() },
        ));
        assert_eq!(f.len(), 3);
        assert_eq!((f[0].0, f[0].3.reth), (Opcode::RcWriteFirst, Some(Reth { va: 0x1000, rkey: 0x42, dma_len: 2053 })));
        assert_eq!((f[1].0, f[1].3.reth, f[1].3.immdt), (Opcode::RcWriteMiddle, None, None));
        assert_eq!(
            (f[2].0, f[2].1, f[2].2, f[2].3.immdt, f[2].4),
            (Opcode::RcWriteLastImm, 12, true, Some([1, 2, 3, 4]), 5)
        );
        // UC: the same cut with the UC opcodes and no AckReq.
        let op = RcOp::Write { raddr: 0x1000, rkey: 0x42, data: Payload::from(&data[..]), imm: None };
        let f = frames(&packet(
            Body::Uc { psn: 10, op, solicited: false },
            RoceInfo { mtu: MTU_1024, ..RoceInfo::default() },
        ));
        assert_eq!(
            f.iter().map(|x| (x.0, x.2)).collect::<Vec<_>>(),
            [(Opcode::UcWriteFirst, false), (Opcode::UcWriteMiddle, false), (Opcode::UcWriteLast, false)]
        );
    }

    #[test]
    fn frames_between_devices_of_one_process_skip_only_their_sums() {
        use super::super::roce::frame::{parse_with, DropReason};
        let data = vec![9u8; 1500];
        let op = RcOp::Send { data: Payload::from(&data[..]), imm: None, inv: None };
        let p = packet(
            Body::Rc { seq: 1, psn: 3, op, solicited: false, xrc_srqn: None },
            RoceInfo { mtu: MTU_1024, ..RoceInfo::default() },
        );
        let (mut checked, mut trusted) = (Vec::new(), Vec::new());
        let mut buf = Vec::new();
        let (src, dst) = ([2, 0, 0, 0, 0, 2], [0x52, 0x54, 0, 0, 0, 1]);
        emit_frames(&p, src, dst, &mut buf, &mut |f| checked.push(f.to_vec())).unwrap();
        emit_frames_with(&p, src, dst, &mut buf, Integrity::Trusted, &mut |f| trusted.push(f.to_vec())).unwrap();
        assert_eq!(trusted.len(), 2);
        for (c, t) in checked.iter().zip(&trusted) {
            // The same frame but for the ICRC, which only a cable needs; a port checking it refuses the frame.
            let n = c.len();
            assert_eq!((&c[..n - 4], &t[n - 4..]), (&t[..n - 4], &[0u8; 4][..]));
            assert_eq!(parse(t).err(), Some(DropReason::Icrc));
            let (Ok(Parsed::Roce(a)), Ok(Parsed::Roce(b))) = (parse(c), parse_with(t, Integrity::Trusted)) else {
                panic!("both parse")
            };
            assert_eq!((a.bth, a.payload), (b.bth, b.payload));
        }
        // Every other check still applies to a trusted frame.
        let mut cut = trusted[0].clone();
        cut.truncate(cut.len() - 10);
        assert!(parse_with(&cut, Integrity::Trusted).is_err());
    }

    #[test]
    fn a_retransmission_resumes_at_its_packet_with_the_read_reth_moved_on() {
        let data: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let resume = RoceInfo { mtu: MTU_1024, resume: 1, ..RoceInfo::default() };
        // A WRITE from its second packet: MIDDLE (no RETH: the responder has it from FIRST) and LAST.
        let op = RcOp::Write { raddr: 0x1000, rkey: 0x42, data: Payload::from(&data[..]), imm: None };
        let f = frames(&packet(Body::Rc { seq: 2, psn: 10, op, solicited: false, xrc_srqn: None }, resume));
        let got: Vec<_> = f.iter().map(|x| (x.0, x.1, x.2, x.3.reth, x.4)).collect();
        assert_eq!(got, [(Opcode::RcWriteMiddle, 11, false, None, 1024), (Opcode::RcWriteLast, 12, true, None, 952)]);
        // A READ asked again from its second response: PSN, address and length move on by one MTU.
        let op = RcOp::Read { raddr: 0x8000, rkey: 9, len: 3000 };
        let f =
            frames(&packet(Body::Rc { seq: 2, psn: 100, op: op.clone(), solicited: false, xrc_srqn: None }, resume));
        let reth = Reth { va: 0x8000 + 1024, rkey: 9, dma_len: 3000 - 1024 };
        assert_eq!(
            f.iter().map(|x| (x.0, x.1, x.3.reth)).collect::<Vec<_>>(),
            [(Opcode::RcReadRequest, 101, Some(reth))]
        );
        // A resume point past the end is the whole message again.
        let past = RoceInfo { resume: 3, ..resume };
        let f = frames(&packet(Body::Rc { seq: 2, psn: 100, op, solicited: false, xrc_srqn: None }, past));
        assert_eq!((f[0].1, f[0].3.reth.map(|r| r.dma_len)), (100, Some(3000)));
        let op = RcOp::Send { data: Payload::from(&data[..]), imm: None, inv: None };
        assert_eq!(frames(&packet(Body::Rc { seq: 2, psn: 5, op, solicited: false, xrc_srqn: None }, past)).len(), 3);
    }

    #[test]
    fn read_responses_take_one_psn_each_with_aeth_on_the_first_and_last() {
        let req = Body::Rc {
            seq: 1,
            psn: 100,
            op: RcOp::Read { raddr: 8, rkey: 9, len: 3000 },
            solicited: false,
            xrc_srqn: None,
        };
        let f = frames(&packet(req, RoceInfo { mtu: MTU_1024, ..RoceInfo::default() }));
        assert_eq!((f.len(), f[0].0, f[0].2, f[0].3.reth.unwrap().dma_len), (1, Opcode::RcReadRequest, true, 3000));
        let resp = Body::Resp { seq: 1, resp: Resp::ReadData(vec![3; 3000]) };
        let f = frames(&packet(resp, RoceInfo { mtu: MTU_1024, psn: 100, msn: 5, ..RoceInfo::default() }));
        let got: Vec<_> = f.iter().map(|x| (x.0, x.1, x.3.aeth.map(|a| a.msn), x.4)).collect();
        assert_eq!(
            got,
            [
                (Opcode::RcReadResponseFirst, 100, Some(5), 1024),
                (Opcode::RcReadResponseMiddle, 101, None, 1024),
                (Opcode::RcReadResponseLast, 102, Some(5), 952)
            ]
        );
    }

    #[test]
    fn acks_naks_and_atomics() {
        let info = RoceInfo { mtu: MTU_1024, psn: 7, msn: 3, ..RoceInfo::default() };
        let resp = |r| frames(&packet(Body::Resp { seq: 1, resp: r }, info))[0];
        let syn = |r| resp(r).3.aeth.unwrap().syndrome;
        assert_eq!(syn(Resp::Ack), Syndrome::Ack { credit: 0x1f });
        assert_eq!(syn(Resp::RnrNak { timer: 14 }), Syndrome::RnrNak { timer: 14 });
        assert_eq!(syn(Resp::Nak(Nak::PsnSequence)), Syndrome::Nak(NakCode::PsnSequence));
        assert_eq!(syn(Resp::Nak(Nak::RemoteAccess)), Syndrome::Nak(NakCode::RemoteAccess));
        assert_eq!(syn(Resp::Nak(Nak::InvalidRequest)), Syndrome::Nak(NakCode::InvalidRequest));
        assert_eq!(syn(Resp::Nak(Nak::RemoteOp)), Syndrome::Nak(NakCode::RemoteOperational));
        let a = resp(Resp::AtomicOrig(0x1122_3344_5566_7788));
        assert_eq!(
            (a.0, a.1, a.3.atomic_ack, a.3.aeth.unwrap().msn),
            (Opcode::RcAtomicAck, 7, Some(0x1122_3344_5566_7788), 3)
        );
        let op = RcOp::Atomic { raddr: 16, rkey: 1, op: AtomicOp::CmpSwap { compare: 5, swap: 9 } };
        let f = frames(&packet(Body::Rc { seq: 1, psn: 4, op, solicited: false, xrc_srqn: None }, info));
        assert_eq!(
            (f[0].0, f[0].3.atomic_eth),
            (Opcode::RcCompareSwap, Some(AtomicEth { va: 16, rkey: 1, swap_add: 9, compare: 5 }))
        );
        let lost = packet(Body::Resp { seq: 1, resp: Resp::Lost("x") }, info);
        assert!(emit_frames(&lost, [0; 6], [0; 6], &mut Vec::new(), &mut |_| ()).is_err());
    }

    #[test]
    fn ud_carries_deth_with_the_qkey_and_no_grh_means_no_frame() {
        // A UD BTH carries the sender's P_Key (a limited member's here), which a GSI receiver reports.
        let limited = Body::Ud { qkey: 1, pkey: 0x7fff, data: vec![1; 64], imm: None, solicited: false };
        let mut pkeys = Vec::new();
        emit_frames(&packet(limited, RoceInfo::default()), [0; 6], [0; 6], &mut Vec::new(), &mut |f| {
            let Ok(Parsed::Roce(r)) = parse(f) else { panic!("{:?}", parse(f)) };
            pkeys.push(r.bth.pkey);
        })
        .unwrap();
        assert_eq!(pkeys, [0x7fff]);
        let body = Body::Ud { qkey: 0x1111_1111, pkey: 0xffff, data: vec![1; 64], imm: None, solicited: false };
        let f = frames(&packet(body.clone(), RoceInfo { psn: 9, ..RoceInfo::default() }));
        assert_eq!(
            (f[0].0, f[0].1, f[0].3.deth, f[0].4),
            (Opcode::UdSendOnly, 9, Some(Deth { qkey: 0x1111_1111, src_qpn: 0x11 }), 64)
        );
        let ib = Packet { grh: None, ..packet(body, RoceInfo::default()) };
        assert!(emit_frames(&ib, [0; 6], [0; 6], &mut Vec::new(), &mut |_| ()).is_err());
    }

    #[test]
    fn over_ipv6_the_udp_checksum_is_computed() {
        let grh = Grh { sgid: [0xfe; 16], dgid: [0x80; 16], tclass: 0, flow_label: 0x1234, hop_limit: 1 };
        let body = Body::Ud { qkey: 1, pkey: 0xffff, data: vec![5; 33], imm: None, solicited: false };
        let p = Packet { grh: Some(grh), ..packet(body, RoceInfo::default()) };
        let mut seen = 0;
        emit_frames(&p, [0; 6], [0; 6], &mut Vec::new(), &mut |f| {
            // parse() checks a non-zero UDP checksum, and the ICRC.
            let Ok(Parsed::Roce(r)) = parse(f) else { panic!("{:?}", parse(f)) };
            let IpRepr::V6(ip) = r.ip else { panic!("not IPv6") };
            assert_eq!((ip.flow_label, ip.hop_limit, r.payload.len()), (0x1234, 1, 33));
            let at = ether::HEADER_LEN + IPV6_HEADER_LEN + UDP_CHECKSUM;
            assert_ne!(&f[at..at + 2], &[0, 0]);
            seen += 1;
        })
        .unwrap();
        assert_eq!(seen, 1);
    }

    #[test]
    fn the_udp_source_port_follows_linux() {
        // rdma_get_udp_sport: flow label 0 -> computed from the QPNs; always in 0xC000..=0xFFFF.
        let fl = {
            let mut v = 0x11u64 * 0x321;
            v ^= v >> 20;
            v ^= v >> 40;
            (v & 0xf_ffff) as u32
        };
        assert_eq!(udp_sport(0, 0x11, 0x321), udp_sport(fl, 0, 0));
        assert_eq!(udp_sport(0xf_ffff, 1, 1), 0xc000 | (0x3fff ^ 0x3f));
        let p = packet(
            Body::Ud { qkey: 1, pkey: 0xffff, data: vec![], imm: None, solicited: false },
            RoceInfo { udp_sport: 0xc123, ..RoceInfo::default() },
        );
        let mut sport = 0;
        emit_frames(&p, [0; 6], [0; 6], &mut Vec::new(), &mut |f| {
            let Ok(Parsed::Roce(r)) = parse(f) else { panic!() };
            sport = r.udp.src_port;
        })
        .unwrap();
        assert_eq!(sport, 0xc123);
        assert_eq!(psn_count(3000, MTU_1024), 3);
        assert_eq!(psn_count(0, MTU_1024), 1);
    }
}

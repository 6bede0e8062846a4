//! The receive side of a RoCE port: a bare Ethernet frame from a link becomes what the transport handles. ARP is
//! answered for the port's IPv4 addresses and teaches the port its neighbours' MACs; a RoCEv2 frame that passes
//! every check (`wire::roce::frame`, ICRC included) is taken apart by opcode: UD sends go to their QP with the
//! DETH's Q_Key and source QP; RC and UC request packets are put back together at their QP (FIRST, MIDDLE..,
//! LAST in PSN order; RETH from the first) into one message at the first packet's PSN, which the responder then
//! checks as it checks any request (execute, answer a duplicate, NAK a sequence error); responses are matched to
//! the QP's outstanding request by PSN (an ACK must name its last PSN, READ responses come one PSN per packet from
//! the first, an atomic ACK names the request's PSN). A frame that fails a check is dropped and recorded as
//! [`SimEvent::FrameDropped`], never a panic.

use super::*;
use crate::link::DevRef;
use crate::wire::roce::arp::{ArpRepr, Operation};
use crate::wire::roce::ether::{EthernetRepr, BROADCAST};
use crate::wire::roce::frame::{emit_arp, parse, IpRepr, Parsed, RoceRepr};
use crate::wire::roce::ib::{NakCode, Opcode, Syndrome};
use crate::wire::roce::rc::{psn_add, psn_diff, Position};
use crate::wire::roce_map::psn_count;

/// A message whose packets are arriving.
#[derive(Debug)]
pub(crate) struct Partial {
    first_psn: u32,
    next_psn: u32,
    kind: PartialKind,
    data: Vec<u8>,
    /// A sequence NAK went out for the gap at `next_psn` (one per gap, as a responder sends).
    nak_sent: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PartialKind {
    Send { uc: bool },
    Write { uc: bool, raddr: u64, rkey: u32 },
    ReadResponse,
}

/// Where the port keeps messages in reassembly and what it learned from ARP.
#[derive(Debug, Default)]
pub(crate) struct RoceRx {
    /// Requests being reassembled, by responder QP.
    requests: BTreeMap<u32, Partial>,
    /// READ responses being reassembled, by requester QP.
    reads: BTreeMap<u32, Partial>,
    /// IPv4 neighbours (ARP): address and MAC.
    pub(crate) neighbours: Vec<([u8; 4], [u8; 6])>,
}

/// The most neighbours remembered (the oldest is forgotten first).
const MAX_NEIGHBOURS: usize = 64;

impl RoceRx {
    fn learn(&mut self, ip: [u8; 4], mac: [u8; 6]) {
        self.neighbours.retain(|(a, _)| *a != ip);
        if self.neighbours.len() == MAX_NEIGHBOURS {
            self.neighbours.remove(0);
        }
        self.neighbours.push((ip, mac));
    }
}

fn ext_grh(r: &RoceRepr<'_>) -> Grh {
    let (tclass, flow_label, hop_limit) = match r.ip {
        IpRepr::V4(v) => (v.tos, 0, v.ttl),
        IpRepr::V6(v) => (v.traffic_class, v.flow_label, v.hop_limit),
    };
    Grh { sgid: r.ip.src_gid(), dgid: r.ip.dst_gid(), tclass, flow_label, hop_limit }
}

impl State {
    /// A bare Ethernet frame arrived from the link `from`. Returns frames to send straight back (ARP replies).
    pub(crate) fn receive_frame(&mut self, frame: &[u8], from: &DevRef) -> Option<Vec<u8>> {
        if self.dead() || self.wire.addr.ib {
            return None;
        }
        let parsed = match parse(frame) {
            Ok(p) => p,
            Err(why) => {
                self.wire.drops.count(why);
                self.events.push(SimEvent::FrameDropped { why: why.name() });
                return None;
            }
        };
        if self.wire.pcap.is_some() {
            self.wire.capture_raw(frame);
        }
        match parsed {
            Parsed::Arp(eth, arp) => self.rx_arp(&eth, &arp),
            Parsed::Roce(r) => {
                if r.eth.dst != self.wire.addr.mac {
                    self.events.push(SimEvent::FrameDropped { why: "not for this port's MAC" });
                } else {
                    self.rx_roce(&r, from);
                }
                None
            }
        }
    }

    /// ARP: remember the sender; answer a request for one of the port's IPv4 addresses.
    fn rx_arp(&mut self, eth: &EthernetRepr, arp: &ArpRepr) -> Option<Vec<u8>> {
        self.dp.rx.learn(arp.sender_ip, arp.sender_mac);
        let mine = self.cfg.ipv4_addrs.contains(&arp.target_ip);
        if arp.operation != Operation::Request || !mine || (eth.dst != BROADCAST && eth.dst != self.wire.addr.mac) {
            return None;
        }
        let me = self.wire.addr.mac;
        let reply = ArpRepr {
            operation: Operation::Reply,
            sender_mac: me,
            sender_ip: arp.target_ip,
            target_mac: arp.sender_mac,
            target_ip: arp.sender_ip,
        };
        let mut buf = [0u8; 64];
        let eth = EthernetRepr { dst: arp.sender_mac, src: me, ethertype: eth.ethertype };
        let n = emit_arp(&eth, &reply, &mut buf).ok()?;
        if self.wire.pcap.is_some() {
            self.wire.capture_raw(&buf[..n]);
        }
        Some(buf[..n].to_vec())
    }

    fn rx_drop(&mut self, why: &'static str) {
        self.events.push(SimEvent::FrameDropped { why });
    }

    fn rx_deliver(&mut self, from: &DevRef, src_qpn: u32, r: &RoceRepr<'_>, body: Body, mtu: u8) {
        let roce = RoceInfo { mtu, udp_sport: r.udp.src_port, psn: r.bth.psn, msn: 0 };
        let dst = self.wire.me.clone();
        let p = Packet {
            src: from.clone(),
            dst,
            src_qpn,
            dst_qpn: r.bth.dest_qpn,
            slid: 0,
            sl: 0,
            grh: Some(ext_grh(r)),
            body,
            roce,
        };
        self.wire.inbox.push_back(p);
    }

    fn rx_roce(&mut self, r: &RoceRepr<'_>, from: &DevRef) {
        use Opcode::*;
        let qpn = r.bth.dest_qpn;
        match r.bth.opcode {
            UdSendOnly | UdSendOnlyImm => {
                let Some(deth) = r.ext.deth else { return self.rx_drop("UD send without a DETH") };
                let body = Body::Ud {
                    qkey: deth.qkey,
                    data: r.payload.to_vec(),
                    imm: r.ext.immdt,
                    solicited: r.bth.solicited,
                };
                self.rx_deliver(from, deth.src_qpn, r, body, 0);
            }
            RcAck | RcAtomicAck | RcReadResponseFirst | RcReadResponseMiddle | RcReadResponseLast
            | RcReadResponseOnly => self.rx_response(qpn, r),
            RcSendLastInv | RcSendOnlyInv => self.rx_drop("SEND with invalidate is not supported"),
            _ => self.rx_request(qpn, r, from),
        }
    }

    /// A request packet at the responder QP `qpn`.
    fn rx_request(&mut self, qpn: u32, r: &RoceRepr<'_>, from: &DevRef) {
        use Opcode::*;
        let Some(qp) = self.fw.qps.get(&qpn) else { return self.rx_drop("no such QP") };
        let (st, remote, mtu, max_msg, expected) = (qp.st, qp.remote_qpn, qp.mtu, qp.max_msg, qp.next_rcv_psn);
        let op = r.bth.opcode;
        let uc = (u8::from(op) >> 5) == 1;
        if st != if uc { QpType::Uc } else { QpType::Rc } {
            return self.rx_drop("request for a QP of another transport");
        }
        let (psn, solicited) = (r.bth.psn, r.bth.solicited);
        let whole =
            |op: RcOp| if uc { Body::Uc { psn, op, solicited } } else { Body::Rc { seq: 0, psn, op, solicited } };
        match op {
            RcReadRequest => {
                let Some(reth) = r.ext.reth else { return self.rx_drop("READ without a RETH") };
                let op = RcOp::Read { raddr: reth.va, rkey: reth.rkey, len: u64::from(reth.dma_len) };
                return self.rx_deliver(from, remote, r, whole(op), mtu);
            }
            RcCompareSwap | RcFetchAdd => {
                let Some(a) = r.ext.atomic_eth else { return self.rx_drop("atomic without an AtomicETH") };
                let aop = if op == RcCompareSwap {
                    AtomicOp::CmpSwap { compare: a.compare, swap: a.swap_add }
                } else {
                    AtomicOp::FetchAdd { add: a.swap_add }
                };
                let op = RcOp::Atomic { raddr: a.va, rkey: a.rkey, op: aop };
                return self.rx_deliver(from, remote, r, whole(op), mtu);
            }
            _ => {}
        }
        let Some(pos) = op.position() else { return self.rx_drop("not a request opcode") };
        let write = matches!(
            op,
            RcWriteFirst
                | RcWriteMiddle
                | RcWriteLast
                | RcWriteLastImm
                | RcWriteOnly
                | RcWriteOnlyImm
                | UcWriteFirst
                | UcWriteMiddle
                | UcWriteLast
                | UcWriteLastImm
                | UcWriteOnly
                | UcWriteOnlyImm
        );
        let kind_of = |reth: Option<crate::wire::roce::ib::Reth>| match (write, reth) {
            (true, Some(h)) => Some(PartialKind::Write { uc, raddr: h.va, rkey: h.rkey }),
            (true, None) => None,
            (false, _) => Some(PartialKind::Send { uc }),
        };
        let imm = r.ext.immdt;
        let finish = |kind: PartialKind, data: Vec<u8>| -> RcOp {
            let data = Payload::from(&data[..]);
            match kind {
                PartialKind::Write { raddr, rkey, .. } => RcOp::Write { raddr, rkey, data, imm },
                _ => RcOp::Send { data, imm },
            }
        };
        match pos {
            Position::Only | Position::First => {
                let Some(kind) = kind_of(r.ext.reth) else { return self.rx_drop("WRITE without a RETH") };
                if pos == Position::Only {
                    self.dp.rx.requests.remove(&qpn);
                    let op = finish(kind, r.payload.to_vec());
                    return self.rx_deliver(from, remote, r, whole(op), mtu);
                }
                let data = r.payload.to_vec();
                // A new FIRST replaces a message that never finished (its requester started again).
                self.dp
                    .rx
                    .requests
                    .insert(qpn, Partial { first_psn: psn, next_psn: psn_add(psn, 1), kind, data, nak_sent: false });
            }
            Position::Middle | Position::Last => {
                let fits = |p: &Partial| {
                    p.next_psn == psn
                        && kind_of(None).is_none_or(|k| k == p.kind)
                        && matches!(p.kind, PartialKind::Write { .. }) == write
                        && (p.data.len() + r.payload.len()) as u64 <= max_msg
                };
                match self.dp.rx.requests.get_mut(&qpn) {
                    Some(p) if fits(p) => {
                        p.data.extend_from_slice(r.payload);
                        p.next_psn = psn_add(psn, 1);
                        p.nak_sent = false;
                        if pos == Position::Last {
                            let Some(p) = self.dp.rx.requests.remove(&qpn) else { return };
                            let op = finish(p.kind, p.data);
                            let body = if uc {
                                Body::Uc { psn: p.first_psn, op, solicited }
                            } else {
                                Body::Rc { seq: 0, psn: p.first_psn, op, solicited }
                            };
                            self.rx_deliver(from, remote, r, body, mtu);
                        }
                    }
                    Some(p) if !uc && psn_diff(psn, p.next_psn) > 0 => {
                        // A packet of this message was lost: NAK the PSN expected next and keep what arrived, so
                        // the requester resends from there (IBA 9.7.5.2.2). An RC responder sends one such NAK
                        // per gap; the packets after it are dropped until the expected one comes.
                        if !p.nak_sent {
                            p.nak_sent = true;
                            let expected = p.next_psn;
                            self.rx_nak_sequence(qpn, expected, psn, r, from);
                        }
                    }
                    Some(p) if psn_diff(psn, p.next_psn) < 0 && psn_diff(psn, p.first_psn) >= 0 => {
                        // A packet of this message arrived again (the requester went back): already taken.
                    }
                    _ => {
                        // Out of sequence: the message is lost. On RC the responder still judges the PSN (a
                        // duplicate is acknowledged again, a PSN ahead draws a sequence NAK); the expected PSN
                        // cannot be a middle or last packet, so it is only dropped.
                        self.dp.rx.requests.remove(&qpn);
                        if uc || psn == expected {
                            return self.rx_drop("packet out of sequence in a message");
                        }
                        let probe = Body::Rc {
                            seq: 0,
                            psn,
                            op: RcOp::Send { data: Payload::from(&[][..]), imm: None },
                            solicited: false,
                        };
                        self.rx_deliver(from, remote, r, probe, mtu);
                    }
                }
            }
        }
    }

    /// NAKs a sequence gap inside a message at responder QP `qpn`: `expected` is the PSN of the packet missing.
    fn rx_nak_sequence(&mut self, qpn: u32, expected: u32, got: u32, r: &RoceRepr<'_>, from: &DevRef) {
        let Some(qp) = self.fw.qps.get(&qpn) else { return };
        let (remote, msn, mtu, counters) = (qp.remote_qpn, qp.msn, qp.mtu, qp.counter_set_id);
        self.events.push(SimEvent::PsnSequenceError { qpn, expected, got });
        self.fw.q_counters.count(counters, |c| c.out_of_sequence += 1);
        let me = self.wire.me.clone();
        let nak = Packet {
            src: me,
            dst: from.clone(),
            src_qpn: qpn,
            dst_qpn: remote,
            slid: 0,
            sl: 0,
            grh: Some(ext_grh(r).reversed()),
            body: Body::Resp { seq: 0, resp: Resp::Nak(Nak::PsnSequence) },
            roce: RoceInfo { mtu, udp_sport: r.udp.src_port, psn: expected, msn },
        };
        self.wire.send(nak);
    }

    /// A response packet for the requester QP `qpn`: matched to its outstanding request by PSN.
    fn rx_response(&mut self, qpn: u32, r: &RoceRepr<'_>) {
        use Opcode::*;
        let Some(qp) = self.fw.qps.get(&qpn) else { return self.rx_drop("no such QP") };
        let Some(req) = qp.req.as_ref().filter(|_| qp.st == QpType::Rc) else {
            return self.rx_drop("response with no request outstanding");
        };
        let (first, seq, remote) = (qp.next_send_psn, req.seq, qp.remote_qpn);
        let n = psn_count(req.len, qp.mtu);
        let last = psn_add(first, n - 1);
        let psn = r.bth.psn;
        let in_range = (0..i64::from(n)).contains(&i64::from(psn_diff(psn, first)));
        let (is_read, is_atomic) = (matches!(req.op, RcOp::Read { .. }), matches!(req.op, RcOp::Atomic { .. }));
        let syndrome = r.ext.aeth.map(|a| a.syndrome);
        let resp = match r.bth.opcode {
            RcAck => match syndrome {
                Some(Syndrome::Ack { .. }) if psn == last && !is_read && !is_atomic => Resp::Ack,
                // An ACK of earlier packets, or of a message already done: nothing to complete.
                Some(Syndrome::Ack { .. }) => return,
                Some(Syndrome::RnrNak { timer }) if in_range => Resp::RnrNak { timer },
                Some(Syndrome::Nak(NakCode::PsnSequence)) => Resp::Nak(Nak::PsnSequence),
                Some(Syndrome::Nak(c)) if in_range => Resp::Nak(match c {
                    NakCode::RemoteAccess => Nak::RemoteAccess,
                    NakCode::RemoteOperational => Nak::RemoteOp,
                    _ => Nak::InvalidRequest,
                }),
                _ => return self.rx_drop("ACK that names no outstanding PSN"),
            },
            RcAtomicAck => match r.ext.atomic_ack {
                Some(v) if is_atomic && psn == first => Resp::AtomicOrig(v),
                _ => return self.rx_drop("atomic ACK for no outstanding atomic"),
            },
            op => {
                if !is_read {
                    return self.rx_drop("READ response for no outstanding READ");
                }
                let pos = op.position().unwrap_or(Position::Only);
                let data = match pos {
                    Position::Only if psn == first => r.payload.to_vec(),
                    Position::First if psn == first => {
                        let p = Partial {
                            first_psn: psn,
                            next_psn: psn_add(psn, 1),
                            kind: PartialKind::ReadResponse,
                            data: r.payload.to_vec(),
                            nak_sent: false,
                        };
                        self.dp.rx.reads.insert(qpn, p);
                        return;
                    }
                    Position::Middle | Position::Last => match self.dp.rx.reads.get_mut(&qpn) {
                        Some(p) if p.next_psn == psn && (p.data.len() + r.payload.len()) as u64 <= req.len => {
                            p.data.extend_from_slice(r.payload);
                            p.next_psn = psn_add(psn, 1);
                            if pos == Position::Middle {
                                return;
                            }
                            match self.dp.rx.reads.remove(&qpn) {
                                Some(p) if p.first_psn == first => p.data,
                                _ => return,
                            }
                        }
                        _ => {
                            // A lost response packet: the READ is retried when its ACK timer runs out.
                            self.dp.rx.reads.remove(&qpn);
                            return self.rx_drop("READ response out of sequence");
                        }
                    },
                    _ => return self.rx_drop("READ response at the wrong PSN"),
                };
                Resp::ReadData(data)
            }
        };
        self.rc_response(qpn, seq, resp, remote);
    }
}

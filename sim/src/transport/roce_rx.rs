//! Firmware side: `fw/qp.rs` (the QP table, its state and counters).
//!
//! The receive side of a RoCE port: a bare Ethernet frame from a link becomes what the transport handles. ARP is
//! answered for the port's IPv4 addresses and teaches the port its neighbours' MACs; a RoCEv2 frame that passes
//! every check (`wire::roce::frame`, ICRC included) is taken apart by opcode: UD sends go to their QP with the
//! DETH's Q_Key and source QP; RC and UC request packets are put back together at their QP (FIRST, MIDDLE..,
//! LAST in PSN order; RETH from the first; an AckReq inside a message answered with an ACK of every packet
//! taken) into one message at the first packet's PSN, which the responder then
//! checks as it checks any request (execute, answer a duplicate, NAK a sequence error); responses are matched to
//! the QP's outstanding request by PSN (an ACK must name its last PSN, READ responses come one PSN per packet from
//! the first, an atomic ACK names the request's PSN). A frame that fails a check is dropped and recorded as
//! [`SimEvent::FrameDropped`], never a panic.

use super::common::*;
use super::reasm::{Partial, PartialKind, Rest, NOT_OUR_GID, SPARE_BYTES};
use crate::link::DevRef;
use crate::wire::roce::arp::{ArpRepr, Operation};
use crate::wire::roce::ether::{EthernetRepr, BROADCAST};
use crate::wire::roce::frame::{emit_arp, parse_with, Integrity, IpRepr, Parsed, RoceRepr};
use crate::wire::roce::ib::{NakCode, Opcode, Syndrome};
use crate::wire::roce::rc::psn_count;
use crate::wire::roce::rc::{psn_add, psn_diff, Position};
use crate::wire::roce_map;

fn ext_grh(r: &RoceRepr<'_>) -> Grh {
    let (tclass, flow_label, hop_limit) = match r.ip {
        IpRepr::V4(v) => (v.tos, 0, v.ttl),
        IpRepr::V6(v) => (v.traffic_class, v.flow_label, v.hop_limit),
    };
    Grh { sgid: r.ip.src_gid(), dgid: r.ip.dst_gid(), tclass, flow_label, hop_limit }
}

impl Datapath<'_> {
    /// A packet from another device of this process: on an Ethernet port it crosses as the RoCEv2 frames it
    /// stands for and goes through the port's receive side, as on a real cable. What has no frame form (the
    /// simulator's "lost" marker), or reaches a dead device or an IB port, is handed over as the packet; so is a
    /// request for a QP that cannot take it, so that its requester learns at once, as in-process tests expect,
    /// what a requester across a real link learns from its ACK timer.
    pub(crate) fn receive_over_wire(&mut self, p: Packet) {
        if let Body::Eth { frame } = &p.body {
            return self.eth_frame_in(frame, &p.src);
        }
        // A request for a GID this port does not hold goes no further, whichever form it crosses in.
        if let (Some(g), false) = (&p.grh, matches!(p.body, Body::Resp { .. })) {
            if !self.wire.addr.ib && !self.dead() && !self.owns_gid(&g.dgid) {
                return self.rx_drop(NOT_OUR_GID);
            }
        }
        let ready = |st: QpType| {
            self.fw.qps.get(&p.dst_qpn).is_some_and(|q| q.st == st && matches!(q.state, QpState::Rtr | QpState::Rts))
        };
        let takes = match p.body {
            Body::Rc { .. } => ready(QpType::Rc),
            Body::Uc { .. } => ready(QpType::Uc),
            Body::Ud { .. } | Body::Resp { .. } => true,
            Body::Eth { .. } => false,
        };
        if !takes || self.dead() || self.wire.addr.ib || p.grh.is_none() {
            return self.receive(p);
        }
        let (src, dst) = (self.wire.mac_of(p.src.id), self.wire.addr.mac);
        // Each frame is taken in as soon as it is built, in the one reused buffer.
        let mut buf = std::mem::take(&mut self.dp.frame_buf);
        // Built and taken without their sums: they cross no cable (a capture computes them).
        let made = roce_map::emit_frames_with(&p, src, dst, &mut buf, Integrity::Trusted, &mut |f| {
            let _ = self.receive_frame_with(f, &p.src, Integrity::Trusted);
        });
        self.dp.frame_buf = buf;
        if made.is_err() {
            // Nothing was built (the packet has no frame form): it goes as it is.
            self.receive(p);
        }
    }

    /// A bare Ethernet frame arrived from the link `from`. Returns frames to send straight back (ARP replies).
    pub(crate) fn receive_frame(&mut self, frame: &[u8], from: &DevRef) -> Option<Vec<u8>> {
        self.receive_frame_with(frame, from, Integrity::Check)
    }

    /// [`Datapath::receive_frame`], checking the frame's sums as `integrity` says.
    fn receive_frame_with(&mut self, frame: &[u8], from: &DevRef, integrity: Integrity) -> Option<Vec<u8>> {
        if self.dead() || self.wire.addr.ib {
            return None;
        }
        // A netdev owns the port: what is not RoCE goes through its receive steering.
        if self.netdev_owns_port() && !super::eth::engine::is_roce_v2(frame) {
            if self.wire.pcap.is_some() && !matches!(from.port, crate::link::Port::Local(_)) {
                self.wire.capture_raw(frame);
            }
            self.eth_receive(frame);
            return None;
        }
        let parsed = match parse_with(frame, integrity) {
            Ok(p) => p,
            Err(why) => {
                self.wire.drops.count(why);
                self.events.push(SimEvent::FrameDropped { why: why.name() });
                return None;
            }
        };
        self.wire.frames_in += 1;
        // A frame from this process was recorded by its sender.
        if self.wire.pcap.is_some() && !matches!(from.port, crate::link::Port::Local(_)) {
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
        let roce = RoceInfo { mtu, udp_sport: r.udp.src_port, psn: r.bth.psn, ..RoceInfo::default() };
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

    /// Whether `gid` is one of this port's addresses: its link-local GID or IP addresses (`Wire::owns`), an
    /// entry of the RoCE GID table the driver programmed (SET_ROCE_ADDRESS), or a multicast group with a QP of
    /// this port attached (ATTACH_TO_MCG).
    pub(crate) fn owns_gid(&self, gid: &[u8; 16]) -> bool {
        self.wire.owns(gid) || self.fw.port.holds_roce_gid(gid) || !self.fw.mcgs.members(gid).is_empty()
    }

    fn rx_roce(&mut self, r: &RoceRepr<'_>, from: &DevRef) {
        use Opcode::*;
        if !self.owns_gid(&r.ip.dst_gid()) {
            return self.rx_drop(NOT_OUR_GID);
        }
        let qpn = r.bth.dest_qpn;
        match r.bth.opcode {
            UdSendOnly | UdSendOnlyImm => {
                let Some(deth) = r.ext.deth else { return self.rx_drop("UD send without a DETH") };
                let body = Body::Ud {
                    qkey: deth.qkey,
                    pkey: r.bth.pkey,
                    data: r.payload.to_vec(),
                    imm: r.ext.immdt,
                    solicited: r.bth.solicited,
                };
                self.rx_deliver(from, deth.src_qpn, r, body, 0);
            }
            RcAck | RcAtomicAck | RcReadResponseFirst | RcReadResponseMiddle | RcReadResponseLast
            | RcReadResponseOnly => self.rx_response(qpn, r),
            // The wire layer knows XRC's headers; no QP of this port receives or answers XRC packets yet.
            op if op.is_xrc() => self.rx_drop("XRC packet on a port without XRC QPs"),
            _ => self.rx_request(qpn, r, from),
        }
    }

    /// A request packet at the responder QP `qpn`.
    fn rx_request(&mut self, qpn: u32, r: &RoceRepr<'_>, from: &DevRef) {
        use Opcode::*;
        let Some(qp) = self.fw.qps.get(&qpn) else {
            self.dp.rx.requests.remove(&qpn);
            return self.rx_drop("no such QP");
        };
        let (st, remote, mtu, max_msg, expected) = (qp.st, qp.remote_qpn, qp.mtu, qp.max_msg, qp.next_rcv_psn);
        if !matches!(qp.state, QpState::Rtr | QpState::Rts) {
            // A QP that cannot receive keeps nothing of a message (nor what an earlier QP of its number left).
            self.dp.rx.requests.remove(&qpn);
            return self.rx_drop("request for a QP not ready to receive");
        }
        let op = r.bth.opcode;
        let uc = (u8::from(op) >> 5) == 1;
        if st != if uc { QpType::Uc } else { QpType::Rc } {
            return self.rx_drop("request for a QP of another transport");
        }
        let (psn, solicited) = (r.bth.psn, r.bth.solicited);
        let whole = |op: RcOp| {
            if uc {
                Body::Uc { psn, op, solicited }
            } else {
                Body::Rc { seq: 0, psn, op, solicited, xrc_srqn: None }
            }
        };
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
        let (imm, inv) = (r.ext.immdt, r.ext.ieth);
        let finish = |kind: PartialKind, data: Payload| -> RcOp {
            match kind {
                PartialKind::Write { raddr, rkey, .. } => RcOp::Write { raddr, rkey, data, imm },
                _ => RcOp::Send { data, imm, inv },
            }
        };
        match pos {
            Position::Only | Position::First => {
                let Some(kind) = kind_of(r.ext.reth) else { return self.rx_drop("WRITE without a RETH") };
                // The next message of a pipelined requester while this one lacks a packet: it is ahead of the
                // gap, so the message in reassembly is kept and the gap NAKed (once), as for a packet of it.
                let current = |p: &&mut Partial| !uc && p.first_psn == expected && psn_diff(psn, p.next_psn) > 0;
                if let Some(p) = self.dp.rx.requests.get_mut(&qpn).filter(current) {
                    if !p.nak_sent {
                        p.nak_sent = true;
                        let expected = p.next_psn;
                        self.rx_nak_gap(qpn, expected, psn, r, from);
                    }
                    return self.rx_drop("message ahead of a gap in the one before");
                }
                if pos == Position::Only {
                    self.dp.rx.requests.remove(&qpn);
                    let op = finish(kind, Payload::from(r.payload));
                    return self.rx_deliver(from, remote, r, whole(op), mtu);
                }
                // A new FIRST replaces a message that never finished (its requester started again).
                if let Some(old) = self.dp.rx.requests.remove(&qpn) {
                    self.dp.rx.recycle(old.data);
                }
                let (limit, rest) = self.rx_first(qpn, kind, r, from);
                let mut p = Partial {
                    first_psn: psn,
                    next_psn: psn_add(psn, 1),
                    kind,
                    data: Vec::new(),
                    nak_sent: false,
                    limit: limit.min(max_msg),
                    rest,
                };
                if rest == Rest::Keep {
                    if r.payload.len() as u64 > p.limit {
                        self.rx_too_long(qpn, &mut p, r, from);
                    } else {
                        p.data = self.dp.rx.buffer(r.payload, p.limit);
                    }
                }
                // AckReq on a FIRST (a requester asking every packet) is answered as on a MIDDLE.
                let ack = r.bth.ack_req && !uc && p.rest != Rest::Drop;
                self.dp.rx.requests.insert(qpn, p);
                if ack {
                    self.rx_reply(qpn, Resp::Ack, psn, r, from);
                }
            }
            Position::Middle | Position::Last => {
                let fits = |p: &Partial| {
                    p.next_psn == psn
                        && kind_of(None).is_none_or(|k| k == p.kind)
                        && matches!(p.kind, PartialKind::Write { .. }) == write
                };
                match self.dp.rx.requests.get_mut(&qpn) {
                    Some(p) if p.rest == Rest::Drop => {
                        // The rest of a refused message: nothing is kept or answered until a new FIRST or ONLY.
                        if pos == Position::Last {
                            self.dp.rx.requests.remove(&qpn);
                        }
                        self.rx_drop("packet of a message refused at its first packet");
                    }
                    Some(p) if p.rest == Rest::Duplicate => {
                        if !fits(p) {
                            // Not the next packet of the duplicate being replayed (its other packets were lost,
                            // or a duplicated FIRST came late): judged on its own, as the requester may go back
                            // to a middle PSN and never send that FIRST again (dropping it, the QP ran out of
                            // retries through wirefilter).
                            return self.rx_stray(qpn, uc, psn, expected, remote, mtu, r, from);
                        }
                        p.next_psn = psn_add(psn, 1);
                        if pos == Position::Last {
                            // Executed before: acknowledged again, as the responder answers a duplicate.
                            self.dp.rx.requests.remove(&qpn);
                            self.events.push(SimEvent::DuplicateRequest { qpn, psn });
                            self.rx_reply(qpn, Resp::Ack, psn, r, from);
                        } else if r.bth.ack_req && !uc {
                            self.rx_reply(qpn, Resp::Ack, psn, r, from);
                        }
                    }
                    Some(p) if fits(p) && (p.data.len() + r.payload.len()) as u64 > p.limit => {
                        // Longer than the receive it will take (or its RETH): refused now, as a ConnectX does,
                        // rather than held until its LAST.
                        let Some(mut p) = self.dp.rx.requests.remove(&qpn) else { return };
                        self.rx_too_long(qpn, &mut p, r, from);
                        self.dp.rx.recycle(std::mem::take(&mut p.data));
                        if pos == Position::Middle {
                            self.dp.rx.requests.insert(qpn, p);
                        }
                    }
                    Some(p) if fits(p) => {
                        p.data.extend_from_slice(r.payload);
                        p.next_psn = psn_add(psn, 1);
                        p.nak_sent = false;
                        if pos == Position::Middle && r.bth.ack_req && !uc {
                            // The requester asks for an ACK inside the message (rxe does every 64 packets).
                            self.rx_reply(qpn, Resp::Ack, psn, r, from);
                            return;
                        }
                        if pos == Position::Last {
                            let Some(mut p) = self.dp.rx.requests.remove(&qpn) else { return };
                            let data = std::mem::take(&mut p.data);
                            // A buffer too large to keep for the next message becomes the payload as it is (no
                            // copy of a large message); a smaller one is copied and kept.
                            let data = if data.capacity() > SPARE_BYTES {
                                Payload::from_vec(data)
                            } else {
                                let d = Payload::from(&data[..]);
                                self.dp.rx.recycle(data);
                                d
                            };
                            let op = finish(p.kind, data);
                            let body = if uc {
                                Body::Uc { psn: p.first_psn, op, solicited }
                            } else {
                                Body::Rc { seq: 0, psn: p.first_psn, op, solicited, xrc_srqn: None }
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
                            self.rx_nak_gap(qpn, expected, psn, r, from);
                        }
                    }
                    Some(p) if psn_diff(psn, p.next_psn) < 0 && psn_diff(psn, p.first_psn) >= 0 => {
                        // A packet of this message arrived again (the requester went back): already taken. Its
                        // AckReq is answered with every packet held so far (an ACK was lost).
                        if r.bth.ack_req && !uc && p.rest == Rest::Keep {
                            let last = psn_add(p.next_psn, PSN_MASK);
                            self.rx_reply(qpn, Resp::Ack, last, r, from);
                        }
                    }
                    _ => self.rx_stray(qpn, uc, psn, expected, remote, mtu, r, from),
                }
            }
        }
    }

    /// A MIDDLE or LAST packet that belongs to no message in reassembly at QP `qpn`: that message is lost. On RC
    /// the responder still judges the PSN (a duplicate is acknowledged again, a PSN ahead draws a sequence NAK);
    /// the expected PSN cannot be a middle or last packet, so it is only dropped.
    #[allow(clippy::too_many_arguments)]
    fn rx_stray(
        &mut self,
        qpn: u32,
        uc: bool,
        psn: u32,
        expected: u32,
        remote: u32,
        mtu: u8,
        r: &RoceRepr<'_>,
        from: &DevRef,
    ) {
        self.dp.rx.requests.remove(&qpn);
        if uc || psn == expected {
            return self.rx_drop("packet out of sequence in a message");
        }
        let probe = Body::Rc {
            seq: 0,
            psn,
            op: RcOp::Send { data: Payload::from(&[][..]), imm: None, inv: None },
            solicited: false,
            xrc_srqn: None,
        };
        self.rx_deliver(from, remote, r, probe, mtu);
    }

    /// A packet at `got` past the gap before `expected`: counted, and NAKed with the PSN the responder expects.
    fn rx_nak_gap(&mut self, qpn: u32, expected: u32, got: u32, r: &RoceRepr<'_>, from: &DevRef) {
        self.responder().psn_sequence_error(qpn, expected, got);
        self.rx_reply(qpn, Resp::Nak(Nak::PsnSequence), expected, r, from);
    }

    /// The first packet of a multi-packet request at QP `qpn`, judged as a ConnectX judges it before taking more
    /// (earlier messages in the inbox are executed first, so the QP's expected PSN and receive queue are
    /// current): returns the bound on the message's bytes and whether its packets are kept. RC: a duplicate keeps
    /// nothing; a PSN ahead is NAKed (sequence error); a SEND with no receive posted gets an RNR NAK; a WRITE with
    /// a bad rkey, rights or range a remote access NAK. UC drops what it cannot take, silently.
    fn rx_first(&mut self, qpn: u32, kind: PartialKind, r: &RoceRepr<'_>, from: &DevRef) -> (u64, Rest) {
        while let Some(p) = self.wire.inbox.pop_front() {
            self.handle(p);
        }
        let Some(qp) = self.fw.qps.get(&qpn).filter(|q| matches!(q.state, QpState::Rtr | QpState::Rts)) else {
            return (0, Rest::Drop);
        };
        let (expected, pd, rwe, min_rnr, counters) =
            (qp.next_rcv_psn, qp.pd, qp.rwe, qp.min_rnr_nak, qp.counter_set_id);
        let psn = r.bth.psn;
        let uc = matches!(kind, PartialKind::Send { uc: true } | PartialKind::Write { uc: true, .. });
        if !uc && psn != expected {
            if psn_diff(psn, expected) < 0 {
                return (0, Rest::Duplicate);
            }
            self.rx_nak_gap(qpn, expected, psn, r, from);
            return (0, Rest::Drop);
        }
        let refuse = |st: &mut Datapath, resp: Resp, why: &'static str| {
            if uc {
                st.events.push(SimEvent::UcDropped { qpn, why });
            } else {
                st.rx_reply(qpn, resp, psn, r, from);
            }
            (0, Rest::Drop)
        };
        match kind {
            PartialKind::Write { raddr, rkey, .. } => {
                let len = r.ext.reth.map_or(0, |h| u64::from(h.dma_len));
                let ok =
                    rwe && self.mkey_check(rkey, Some(pd), Some(qpn), raddr, len, MkeyAccess::REMOTE_WRITE).is_ok();
                if !ok {
                    return refuse(self, Resp::Nak(Nak::RemoteAccess), "remote write refused (rights, rkey or bounds)");
                }
                (len, Rest::Keep)
            }
            _ => {
                let mut sges = Sges::new();
                if self.wqes().next_recv(qpn, &mut sges).is_none() {
                    self.fw.q_counters.count(counters, |c| c.out_of_buffer += 1);
                    return refuse(self, Resp::RnrNak { timer: min_rnr }, "receive queue empty");
                }
                (sges.iter().fold(0u64, |a, g| a.saturating_add(g.len)), Rest::Keep)
            }
        }
    }

    /// Message `p` of QP `qpn` outgrew its bound: a SEND takes its receive with a local length error (the QP
    /// goes to ERR) and, on RC, the requester gets an invalid request NAK; an RC WRITE longer than its RETH is
    /// an invalid request too; UC drops it silently. Its later packets are dropped.
    fn rx_too_long(&mut self, qpn: u32, p: &mut Partial, r: &RoceRepr<'_>, from: &DevRef) {
        p.rest = Rest::Drop;
        let uc = matches!(p.kind, PartialKind::Send { uc: true } | PartialKind::Write { uc: true, .. });
        if matches!(p.kind, PartialKind::Send { .. }) {
            while let Some(q) = self.wire.inbox.pop_front() {
                self.handle(q);
            }
            let mut sges = Sges::new();
            if let Some(index) = self.wqes().next_recv(qpn, &mut sges) {
                self.completions().recv_error(qpn, index, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
            }
        }
        if uc {
            self.events.push(SimEvent::UcDropped { qpn, why: "message longer than its receive or RETH" });
        } else {
            self.rx_reply(qpn, Resp::Nak(Nak::InvalidRequest), p.first_psn, r, from);
        }
    }

    /// Answers from inside a message at responder QP `qpn`: an ACK of the packet at `psn`, or the NAK of a
    /// sequence gap whose missing packet is at `psn`.
    fn rx_reply(&mut self, qpn: u32, resp: Resp, psn: u32, r: &RoceRepr<'_>, from: &DevRef) {
        let Some(qp) = self.fw.qps.get(&qpn) else { return };
        let (remote, msn, mtu) = (qp.remote_qpn, qp.msn, qp.mtu);
        let me = self.wire.me.clone();
        let reply = Packet {
            src: me,
            dst: from.clone(),
            src_qpn: qpn,
            dst_qpn: remote,
            slid: 0,
            sl: 0,
            grh: Some(ext_grh(r).reversed()),
            body: Body::Resp { seq: 0, resp },
            roce: RoceInfo { mtu, udp_sport: r.udp.src_port, psn, msn, ..RoceInfo::default() },
        };
        self.wire.send(reply);
    }

    /// A response packet for the requester QP `qpn`: matched by PSN to its requests in flight. An ACK, a NAK or
    /// a READ response acknowledges every SEND and WRITE before the PSN it names; a READ before it that lacks
    /// response packets is asked again from the first one missing (with everything after it). READ responses
    /// are taken for the oldest request, once those before it are done.
    fn rx_response(&mut self, qpn: u32, r: &RoceRepr<'_>) {
        use Opcode::*;
        let Some(qp) = self.fw.qps.get(&qpn) else { return self.rx_drop("no such QP") };
        let Some(req) = qp.reqs.front().filter(|_| qp.st == QpType::Rc) else {
            return self.rx_drop("response with no request outstanding");
        };
        if !matches!(req.phase, Phase::InFlight { .. }) {
            // The requests wait for their retry: whatever answers their earlier attempt counts for nothing.
            return;
        }
        let (first, seq, remote, resume, len, end) =
            (req.psn, req.seq, qp.remote_qpn, req.resume, req.len, qp.next_send_psn);
        let psn = r.bth.psn;
        // Which request in flight holds `psn`, its packet there, its sequence number and whether it is a SEND or
        // WRITE.
        let mtu = qp.mtu;
        let found = qp.reqs.iter().enumerate().find_map(|(i, q)| {
            let n = psn_count(q.len, mtu);
            let k = u32::try_from(psn_diff(psn, q.psn)).ok().filter(|&k| k < n)?;
            let data = matches!(q.op, RcOp::Send { .. } | RcOp::Write { .. });
            Some((i, k, n, q.seq, data))
        });
        // Whether `psn` falls in the oldest request's PSNs (the requests' ranges follow one another).
        let in_range = matches!(found, Some((0, ..)));
        let (is_read, is_atomic) = (matches!(req.op, RcOp::Read { .. }), matches!(req.op, RcOp::Atomic { .. }));
        let syndrome = r.ext.aeth.map(|a| a.syndrome);
        let read_response = matches!(
            r.bth.opcode,
            RcReadResponseFirst | RcReadResponseMiddle | RcReadResponseLast | RcReadResponseOnly
        );
        let own_response = read_response || r.bth.opcode == RcAtomicAck;
        if let Some((i, ..)) = found.filter(|f| f.0 > 0 && (own_response || r.bth.opcode == RcAck)) {
            // A response to a later request: the SENDs and WRITEs before it are done (for a READ response or
            // an atomic ACK, it is then the oldest, taken below); a READ or an atomic before it lost its
            // response.
            if self.requester().ack_before(qpn, i) < i {
                return self.read_gap(qpn, remote);
            }
            if own_response {
                return self.rx_response(qpn, r);
            }
        }
        let resp = match r.bth.opcode {
            RcAck => match (syndrome, found) {
                (Some(Syndrome::Ack { .. }), Some((_, k, n, seq, true))) => {
                    if k + 1 == n {
                        return self.requester().rc_response(qpn, seq, Resp::Ack, remote);
                    }
                    // An ACK of some packets of this SEND or WRITE (coalesced, or asked for inside it): the ones
                    // before it are done, a retransmission of it starts after them, and the window moves on.
                    self.requester().ack_packets(qpn, k + 1);
                    return;
                }
                // An ACK inside a READ or an atomic completes nothing, nor one of a message already done (a
                // duplicate, or one an ACK after it covered).
                (Some(Syndrome::Ack { .. }), Some(_)) => return,
                (Some(Syndrome::Ack { .. }), None) if psn_diff(psn, first) < 0 => return,
                (Some(Syndrome::RnrNak { timer }), Some((_, _, _, seq, _))) => {
                    return self.requester().rc_response(qpn, seq, Resp::RnrNak { timer }, remote);
                }
                (Some(Syndrome::Nak(NakCode::PsnSequence)), found) => {
                    // The responder has every packet before the one it names: the messages before it are done
                    // and the retransmission starts there (a READ is asked again from there). The PSN after
                    // every message sent acknowledges them all; any other PSN outside them resends them all.
                    let seq = match found {
                        Some((_, k, _, _, _)) => {
                            self.set_resume(qpn, k);
                            self.fw.qps.get(&qpn).and_then(|q| q.reqs.front()).map_or(seq, |q| q.seq)
                        }
                        None if psn == end => {
                            let all = self.fw.qps.get(&qpn).map_or(0, |q| q.reqs.len());
                            if self.requester().ack_before(qpn, all) < all {
                                self.read_gap(qpn, remote);
                            }
                            return;
                        }
                        None => {
                            self.set_resume(qpn, 0);
                            seq
                        }
                    };
                    if let Some(q) = self.fw.qps.get(&qpn).filter(|q| q.retrying) {
                        // The responder's answer to a packet sent before we went back (nothing was acknowledged
                        // since): the retransmission under way, or the ACK timer, takes care of it (rdma_rxe's
                        // completer does the same).
                        let wqe_counter = q.reqs.front().map_or(0, |r| r.wqe.index);
                        self.events.push(SimEvent::PsnSequenceNak { qpn, wqe_counter, remote_qpn: remote });
                        return;
                    }
                    return self.requester().rc_response(qpn, seq, Resp::Nak(Nak::PsnSequence), remote);
                }
                (Some(Syndrome::Nak(c)), Some((_, _, _, seq, _))) => {
                    let nak = match c {
                        NakCode::RemoteAccess => Nak::RemoteAccess,
                        NakCode::RemoteOperational => Nak::RemoteOp,
                        _ => Nak::InvalidRequest,
                    };
                    return self.requester().rc_response(qpn, seq, Resp::Nak(nak), remote);
                }
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
                // The responses of a READ asked again from packet `resume` start there, after the data taken.
                let start = psn_add(first, resume);
                let taken = |p: &Partial| p.first_psn == first && p.next_psn == psn;
                let resp = match pos {
                    Position::Only | Position::First if psn == start => {
                        // A READ asked again from `resume` goes on from the data taken, when it ends there. When it
                        // does not (a late packet of the attempt before was taken past `resume` meanwhile), the
                        // data is kept and this packet dropped: the next ones of this attempt go on from it.
                        let mut data = match self.dp.rx.reads.get(&qpn) {
                            Some(p) if resume > 0 && taken(p) => {
                                self.dp.rx.reads.remove(&qpn).map(|p| p.data).unwrap_or_default()
                            }
                            _ if resume == 0 => {
                                self.dp.rx.reads.remove(&qpn);
                                self.dp.rx.buffer(&[], len)
                            }
                            _ => return self.rx_drop("READ response at the wrong PSN"),
                        };
                        data.extend_from_slice(r.payload);
                        if (data.len() as u64) > len {
                            return self.rx_drop("READ response longer than the request");
                        }
                        if pos == Position::First {
                            let p = Partial {
                                first_psn: first,
                                next_psn: psn_add(psn, 1),
                                kind: PartialKind::ReadResponse,
                                data,
                                nak_sent: false,
                                limit: len,
                                rest: Rest::Keep,
                            };
                            self.dp.rx.reads.insert(qpn, p);
                            self.requester().read_progress(qpn);
                            return;
                        }
                        Resp::ReadData(data)
                    }
                    Position::Middle | Position::Last => match self.dp.rx.reads.get_mut(&qpn) {
                        Some(p) if taken(p) && (p.data.len() + r.payload.len()) as u64 <= len => {
                            p.data.extend_from_slice(r.payload);
                            p.next_psn = psn_add(psn, 1);
                            p.nak_sent = false;
                            if pos == Position::Middle {
                                return self.requester().read_progress(qpn);
                            }
                            match self.dp.rx.reads.remove(&qpn) {
                                Some(p) => Resp::ReadData(p.data),
                                None => return,
                            }
                        }
                        Some(p) if p.first_psn == first && in_range && psn_diff(psn, p.next_psn) > 0 => {
                            // A response packet was lost: what arrived is kept, and the READ is asked again at
                            // once from the missing PSN, as for a sequence NAK (once per gap; the packets after
                            // it are dropped).
                            let (got, asked) = (psn_diff(p.next_psn, first), p.nak_sent);
                            p.nak_sent = true;
                            self.rx_drop("READ response out of sequence");
                            // Nor while the READ is being asked again with nothing taken since (a late packet
                            // of the attempt before): the ACK timer takes care, as for a sequence NAK then.
                            if asked || self.fw.qps.get(&qpn).is_some_and(|q| q.retrying) {
                                return;
                            }
                            self.set_resume(qpn, got as u32);
                            Resp::Nak(Nak::PsnSequence)
                        }
                        _ => return self.rx_drop("READ response out of sequence"),
                    },
                    _ => return self.rx_drop("READ response at the wrong PSN"),
                };
                resp
            }
        };
        self.requester().rc_response(qpn, seq, resp, remote);
    }

    /// A response names a request after the oldest one in flight of `qpn`, a READ that still lacks response
    /// packets or an atomic without its ACK: they were lost, so the READ is asked again from the first one
    /// missing (the atomic sent again, which the responder answers from its results) and the requests after it
    /// are sent again, as after a sequence NAK (and, as then, once until something is acknowledged).
    fn read_gap(&mut self, qpn: u32, remote: u32) {
        let Some(head) = self.fw.qps.get(&qpn).filter(|q| !q.retrying).and_then(|q| q.reqs.front()) else { return };
        if !matches!(head.op, RcOp::Read { .. } | RcOp::Atomic { .. }) {
            return;
        }
        let (first, seq) = (head.psn, head.seq);
        let taken = if matches!(head.op, RcOp::Read { .. }) { self.dp.rx.read_taken(qpn, first) } else { 0 };
        self.set_resume(qpn, taken);
        self.requester().rc_response(qpn, seq, Resp::Nak(Nak::PsnSequence), remote);
    }

    /// The oldest request in flight of `qpn` is retransmitted from its packet `k` on.
    fn set_resume(&mut self, qpn: u32, k: u32) {
        if let Some(req) = self.fw.qps.get_mut(&qpn).and_then(|q| q.reqs.front_mut()) {
            req.resume = k;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::link::Port;
    use crate::testkit::submit::{QpSpec, RcParams, Rdma, Remote};
    use crate::wire::roce::ib::{Aeth, BthRepr, Ext, DEFAULT_PKEY};
    use crate::wire::roce::ip::{Ipv6Repr, PROTO_UDP};
    use crate::wire::roce::udp::{UdpRepr, ROCE_PORT};
    use std::sync::Weak;

    const FAR_QPN: u32 = 0x77;
    const FAR_MAC: [u8; 6] = [2, 0, 0, 0, 0, 9];
    const FAR_GID: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe, 0, 0, 9];

    /// A device with an RC QP in RTS connected to a QP nobody runs, and an RC QP left in RESET: frames are fed to
    /// its port by hand, as a hostile or broken peer would send them.
    struct Port1 {
        r: Rdma,
        rc: u32,
        idle: u32,
        mac: [u8; 6],
        gid: [u8; 16],
        mr: crate::testkit::submit::Mr,
        rc_qp: crate::testkit::submit::TQp,
        cq: crate::testkit::submit::TCq,
    }

    fn port() -> Port1 {
        let mut r = Rdma::new(SimConfig::default());
        let cq = r.cq(6);
        let mut rc = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        let far = Remote { qpn: FAR_QPN, lid: 0, gid: FAR_GID, mac: FAR_MAC };
        r.connect_rc(&rc, &far, RcParams::default());
        let idle = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        let mr = r.mr(1 << 16);
        r.post_recv(&mut rc, &[(mr.addr(), 8192, mr.key)]);
        let me = r.me(rc.qpn);
        Port1 { rc: rc.qpn, idle: idle.qpn, mac: me.mac, gid: me.gid, mr, r, rc_qp: rc, cq }
    }

    fn frame(p: &Port1, opcode: Opcode, qpn: u32, psn: u32, ext: Ext, payload: &[u8]) -> Vec<u8> {
        frame_ack(p, opcode, qpn, psn, ext, payload, false)
    }

    fn frame_ack(p: &Port1, opcode: Opcode, qpn: u32, psn: u32, ext: Ext, payload: &[u8], ack_req: bool) -> Vec<u8> {
        let repr = RoceRepr {
            eth: EthernetRepr { dst: p.mac, src: FAR_MAC, ethertype: crate::wire::roce::ether::EtherType::Ipv6 },
            ip: IpRepr::V6(Ipv6Repr {
                src: FAR_GID,
                dst: p.gid,
                next_header: PROTO_UDP,
                payload_len: 0,
                traffic_class: 0,
                flow_label: 0,
                hop_limit: 64,
            }),
            udp: UdpRepr { src_port: 0xc000, dst_port: ROCE_PORT, payload_len: 0 },
            bth: BthRepr {
                opcode,
                solicited: false,
                migreq: false,
                pad_count: 0,
                pkey: DEFAULT_PKEY,
                fecn: false,
                becn: false,
                dest_qpn: qpn,
                ack_req,
                psn,
            },
            ext,
            payload,
        };
        let mut buf = vec![0u8; repr.frame_len()];
        repr.emit(&mut buf).unwrap();
        buf
    }

    /// Feeds one frame; returns the packets the port sent back and the drop events it recorded.
    fn feed(p: &Port1, f: &[u8]) -> (Vec<crate::link::Packet>, Vec<&'static str>) {
        let from = DevRef { id: u64::MAX, port: Port::Local(Weak::<()>::new()) };
        let mut st = crate::device::lock(&p.r.h.dev.shared);
        let before = st.events.len();
        let _ = st.datapath().receive_frame(f, &from);
        let out = st.datapath().run_datapath();
        let drops = st.events[before..]
            .iter()
            .filter_map(|e| if let SimEvent::FrameDropped { why } = e { Some(*why) } else { None })
            .collect();
        (out, drops)
    }

    fn nak_psn(out: &[crate::link::Packet]) -> Option<u32> {
        out.iter()
            .find_map(|p| matches!(p.body, Body::Resp { resp: Resp::Nak(Nak::PsnSequence), .. }).then_some(p.roce.psn))
    }

    #[test]
    fn a_message_in_packets_is_put_together_and_acknowledged() {
        let p = port();
        let expected = p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn;
        let data: Vec<u8> = (0..2500u32).map(|i| i as u8).collect();
        let (f, m, l) = (&data[..1024], &data[1024..2048], &data[2048..]);
        assert!(feed(&p, &frame(&p, Opcode::RcSendFirst, p.rc, expected, Ext::default(), f)).0.is_empty());
        // AckReq inside the message (rxe sets it every 64 packets): an ACK of that PSN, nothing completed.
        let (out, _) = feed(&p, &frame_ack(&p, Opcode::RcSendMiddle, p.rc, expected + 1, Ext::default(), m, true));
        let acks: Vec<_> = out.iter().filter(|q| matches!(q.body, Body::Resp { resp: Resp::Ack, .. })).collect();
        assert_eq!(acks.iter().map(|q| (q.roce.psn, q.roce.msn)).collect::<Vec<_>>(), [(expected + 1, 0)]);
        let (out, drops) = feed(&p, &frame(&p, Opcode::RcSendLast, p.rc, expected + 2, Ext::default(), l));
        assert!(drops.is_empty(), "{drops:?}");
        let ack = out.iter().find(|q| matches!(q.body, Body::Resp { resp: Resp::Ack, .. })).expect("an ACK");
        // The ACK names the last PSN, with MSN 1, to the QP the RC QP is connected to.
        assert_eq!((ack.roce.psn, ack.roce.msn, ack.dst_qpn), (expected + 2, 1, FAR_QPN));
        assert!(p.mr.read(0, 2500) == data);
        assert_eq!(p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn, expected + 3);
    }

    #[test]
    fn hostile_frames_are_dropped_or_naked_never_executed() {
        let p = port();
        let e = p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn;
        let kb = [7u8; 1024];
        // A MIDDLE with no message begun, PSN ahead: a sequence NAK naming the expected PSN.
        let (out, _) = feed(&p, &frame(&p, Opcode::RcSendMiddle, p.rc, e + 5, Ext::default(), &kb));
        assert_eq!(nak_psn(&out), Some(e));
        // A LAST at the expected PSN with no FIRST: dropped.
        let (out, drops) = feed(&p, &frame(&p, Opcode::RcSendLast, p.rc, e, Ext::default(), &kb[..10]));
        assert!(out.is_empty() && drops == ["packet out of sequence in a message"], "{drops:?}");
        // A gap inside a message: one NAK naming the missing PSN, then silence until it comes.
        feed(&p, &frame(&p, Opcode::RcSendFirst, p.rc, e, Ext::default(), &kb));
        let (out, _) = feed(&p, &frame(&p, Opcode::RcSendMiddle, p.rc, e + 2, Ext::default(), &kb));
        assert_eq!(nak_psn(&out), Some(e + 1));
        let (out, _) = feed(&p, &frame(&p, Opcode::RcSendLast, p.rc, e + 3, Ext::default(), &kb[..1]));
        assert!(out.is_empty());
        // Wrong transport, unknown QP, responses with nothing outstanding, another port's MAC, garbage.
        let (_, drops) = feed(&p, &frame(&p, Opcode::UcSendOnly, p.rc, e, Ext::default(), b"x"));
        assert_eq!(drops, ["request for a QP of another transport"]);
        let (_, drops) = feed(&p, &frame(&p, Opcode::RcSendOnly, 0xabcd, e, Ext::default(), b"x"));
        assert_eq!(drops, ["no such QP"]);
        let (_, drops) = feed(&p, &frame(&p, Opcode::RcSendOnly, p.idle, 0, Ext::default(), b"x"));
        assert_eq!(drops, ["request for a QP not ready to receive"]);
        let ack = Ext { aeth: Some(Aeth { syndrome: Syndrome::Ack { credit: 0x1f }, msn: 1 }), ..Ext::default() };
        let (_, drops) = feed(&p, &frame(&p, Opcode::RcAck, p.rc, 0, ack, &[]));
        assert_eq!(drops, ["response with no request outstanding"]);
        let (_, drops) = feed(&p, &frame(&p, Opcode::RcReadResponseOnly, p.idle, 0, ack, b"data"));
        assert_eq!(drops, ["response with no request outstanding"]);
        let mut other = frame(&p, Opcode::RcSendOnly, p.rc, e, Ext::default(), b"x");
        other[0] ^= 0x02;
        assert_eq!(feed(&p, &other).1, ["not for this port's MAC"]);
        let mut bad = frame(&p, Opcode::RcSendOnly, p.rc, e, Ext::default(), b"x");
        let n = bad.len();
        bad[n - 1] ^= 1;
        assert_eq!(feed(&p, &bad).1, ["bad ICRC"]);
        for cut in 0..bad.len() {
            let _ = feed(&p, &bad[..cut]);
        }
        // Nothing was executed: the receive is still posted and the expected PSN has not moved.
        let info = p.r.h.dev.qp_info(p.rc).unwrap();
        assert_eq!((info.rq_ci, info.next_rcv_psn), (0, e));
        assert!(p.r.h.dev.frame_drops().total() > 0);
    }

    /// The NAKs (other than sequence errors) among `out`: (code, PSN, destination QP).
    fn naks(out: &[crate::link::Packet]) -> Vec<(Nak, u32, u32)> {
        out.iter()
            .filter_map(|p| match p.body {
                Body::Resp { resp: Resp::Nak(n), .. } if n != Nak::PsnSequence => Some((n, p.roce.psn, p.dst_qpn)),
                _ => None,
            })
            .collect()
    }

    /// Bytes held in reassembly, and the capacity of its buffers.
    fn held(p: &Port1) -> (usize, usize) {
        crate::device::lock(&p.r.h.dev.shared).dp.rx.held()
    }

    #[test]
    fn a_send_longer_than_its_receive_is_naked_at_once_and_never_held() {
        // The RC QP has one receive of 8 KiB posted. A peer sends SEND FIRST and then MIDDLE after MIDDLE: a
        // ConnectX NAKs (invalid request) as soon as the message passes the receive's scatter list and completes
        // the receive with a local length error; before, every packet was kept until a LAST that never came.
        let mut p = port();
        let e = p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn;
        let kb = [7u8; 1024];
        assert!(feed(&p, &frame(&p, Opcode::RcSendFirst, p.rc, e, Ext::default(), &kb)).0.is_empty());
        for k in 1..8 {
            let (out, drops) = feed(&p, &frame(&p, Opcode::RcSendMiddle, p.rc, psn_add(e, k), Ext::default(), &kb));
            assert!(out.is_empty() && drops.is_empty(), "{drops:?}");
            let (bytes, cap) = held(&p);
            assert!(bytes == 1024 * (k as usize + 1) && cap <= 8192, "{bytes} held in {cap}");
        }
        // The ninth KiB is one more than the receive holds.
        let (out, _) = feed(&p, &frame(&p, Opcode::RcSendMiddle, p.rc, psn_add(e, 8), Ext::default(), &kb));
        assert_eq!(naks(&out), [(Nak::InvalidRequest, e, FAR_QPN)]);
        let cqe = p.r.poll(&mut p.cq).expect("the receive completes");
        let len_err = (consts::MLX5_CQE_RESP_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        assert_eq!((cqe.status(), cqe.qpn(), cqe.wqe_counter()), (len_err, p.rc, 0));
        assert_eq!(p.r.h.dev.qp_info(p.rc).unwrap().state, QpState::Err);
        // The endless rest: dropped, nothing held, nothing answered.
        for k in 9..2000 {
            let (out, _) = feed(&p, &frame(&p, Opcode::RcSendMiddle, p.rc, psn_add(e, k), Ext::default(), &kb));
            assert!(out.is_empty());
        }
        assert_eq!(held(&p), (0, 0));
        // Longer than the receive at its first packet already: refused there.
        let mut q = port();
        q.r.post_recv(&mut q.rc_qp, &[(q.mr.addr() + 0x8000, 512, q.mr.key)]);
        let e = q.r.h.dev.qp_info(q.rc).unwrap().next_rcv_psn;
        // The first receive (8 KiB) takes a message of two packets; the next one (512 bytes) cannot take 1 KiB.
        feed(&q, &frame(&q, Opcode::RcSendFirst, q.rc, e, Ext::default(), &kb));
        let (out, _) = feed(&q, &frame(&q, Opcode::RcSendLast, q.rc, psn_add(e, 1), Ext::default(), &kb));
        assert!(out.iter().any(|a| matches!(a.body, Body::Resp { resp: Resp::Ack, .. })));
        let (out, _) = feed(&q, &frame(&q, Opcode::RcSendFirst, q.rc, psn_add(e, 2), Ext::default(), &kb));
        assert_eq!(naks(&out), [(Nak::InvalidRequest, psn_add(e, 2), FAR_QPN)]);
        assert_eq!(held(&q), (0, 0));
    }

    #[test]
    fn a_write_with_a_bad_rkey_or_range_is_naked_at_its_first_packet_and_the_rest_dropped() {
        use crate::wire::roce::ib::Reth;
        let p = port();
        let e = p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn;
        let kb = [9u8; 1024];
        let first = |va: u64, rkey: u32, dma_len: u32| Ext { reth: Some(Reth { va, rkey, dma_len }), ..Ext::default() };
        // A bad rkey: a remote access NAK at once; then a thousand MIDDLEs, none kept, none answered.
        let (out, _) = feed(&p, &frame(&p, Opcode::RcWriteFirst, p.rc, e, first(p.mr.addr(), 0xbad, 1 << 30), &kb));
        assert_eq!(naks(&out), [(Nak::RemoteAccess, e, FAR_QPN)]);
        for k in 1..1000 {
            let (out, drops) = feed(&p, &frame(&p, Opcode::RcWriteMiddle, p.rc, psn_add(e, k), Ext::default(), &kb));
            assert!(out.is_empty() && drops == ["packet of a message refused at its first packet"], "{drops:?}");
        }
        assert_eq!(held(&p), (0, 0));
        // The right key past the registration's end: the same.
        let (out, _) = feed(&p, &frame(&p, Opcode::RcWriteFirst, p.rc, e, first(p.mr.addr(), p.mr.key, 1 << 17), &kb));
        assert_eq!(naks(&out), [(Nak::RemoteAccess, e, FAR_QPN)]);
        // More data than the RETH says: an invalid request NAK when it passes it, nothing written.
        let (out, _) = feed(&p, &frame(&p, Opcode::RcWriteFirst, p.rc, e, first(p.mr.addr(), p.mr.key, 1500), &kb));
        assert!(out.is_empty());
        assert!(held(&p).1 <= 1500);
        let (out, _) = feed(&p, &frame(&p, Opcode::RcWriteMiddle, p.rc, psn_add(e, 1), Ext::default(), &kb));
        assert_eq!(naks(&out), [(Nak::InvalidRequest, e, FAR_QPN)]);
        assert_eq!((held(&p), p.mr.read(0, 4)), ((0, 0), vec![0; 4]));
        // The QP still takes a proper WRITE at the PSN it expects.
        feed(&p, &frame(&p, Opcode::RcWriteFirst, p.rc, e, first(p.mr.addr(), p.mr.key, 2048), &kb));
        let (out, _) = feed(&p, &frame(&p, Opcode::RcWriteLast, p.rc, psn_add(e, 1), Ext::default(), &kb));
        assert!(out
            .iter()
            .any(|a| matches!(a.body, Body::Resp { resp: Resp::Ack, .. }) && a.roce.psn == psn_add(e, 1)));
        assert_eq!(p.mr.read(0, 2048), vec![9; 2048]);
        assert_eq!(p.r.h.dev.qp_info(p.rc).unwrap().state, QpState::Rts);
    }

    /// A small deterministic generator (xorshift), so the sequence below is the same on every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn thousands_of_well_formed_but_arbitrary_frames_leave_the_port_working() {
        use crate::wire::roce::ib::{AtomicEth, Deth, Reth, XrcEth};
        let mut p = port();
        let ops = [
            Opcode::RcSendFirst,
            Opcode::RcSendMiddle,
            Opcode::RcSendLast,
            Opcode::RcSendLastImm,
            Opcode::RcSendOnly,
            Opcode::RcWriteFirst,
            Opcode::RcWriteMiddle,
            Opcode::RcWriteLast,
            Opcode::RcWriteOnlyImm,
            Opcode::RcReadRequest,
            Opcode::RcReadResponseFirst,
            Opcode::RcReadResponseMiddle,
            Opcode::RcReadResponseLast,
            Opcode::RcReadResponseOnly,
            Opcode::RcAck,
            Opcode::RcAtomicAck,
            Opcode::RcCompareSwap,
            Opcode::RcFetchAdd,
            Opcode::UcSendFirst,
            Opcode::UcWriteOnly,
            Opcode::UdSendOnly,
            Opcode::XrcSendOnly,
            Opcode::XrcWriteFirst,
            Opcode::XrcAck,
        ];
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let base = p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn;
        let payload = [0x5au8; 2048];
        for _ in 0..3000 {
            let r = rng.next();
            let op = ops[(r % ops.len() as u64) as usize];
            let qpn = [p.rc, p.idle, 0x4242][((r >> 8) % 3) as usize];
            let psn = base.wrapping_add(((r >> 16) % 9) as u32).wrapping_sub(4) & 0xff_ffff;
            let h = op.headers().unwrap();
            let ext = Ext {
                deth: h.deth.then_some(Deth { qkey: (r >> 20) as u32, src_qpn: 9 }),
                xrceth: h.xrceth.then_some(XrcEth { xrc_srqn: (r >> 12) as u32 & 0xff_ffff }),
                reth: h.reth.then_some(Reth {
                    va: p.mr.addr().wrapping_add((r >> 24) % 0x2_0000),
                    rkey: if r & 1 == 0 { p.mr.key } else { (r >> 32) as u32 },
                    dma_len: ((r >> 40) % 5000) as u32,
                }),
                atomic_eth: h.atomic_eth.then_some(AtomicEth {
                    va: p.mr.addr() + ((r >> 24) % 64) * 8,
                    rkey: p.mr.key,
                    swap_add: r,
                    compare: 0,
                }),
                aeth: h.aeth.then_some(Aeth { syndrome: Syndrome::from((r >> 48) as u8), msn: 1 }),
                atomic_ack: h.atomic_ack_eth.then_some(r),
                immdt: h.immdt.then_some([1, 2, 3, 4]),
                ieth: None,
            };
            let len = if h.payload { ((r >> 52) % 1100) as usize } else { 0 };
            let _ = feed(&p, &frame_ack(&p, op, qpn, psn, ext, &payload[..len], r >> 63 == 1));
        }
        // Every frame passed the frame checks; the port judged each one by its transport rules.
        assert_eq!(p.r.h.dev.frames_received(), 3000);
        let dropped = p.r.h.dev.events().iter().filter(|e| matches!(e, SimEvent::FrameDropped { .. })).count();
        assert!(dropped > 100 && dropped < 3000, "{dropped} of 3000 dropped");
        // The port still takes a message: whatever the RC QP expects now, a SEND ONLY at that PSN (with a receive
        // posted) is executed and acknowledged.
        let e = p.r.h.dev.qp_info(p.rc).unwrap().next_rcv_psn;
        p.r.post_recv(&mut p.rc_qp, &[(p.mr.addr() + 0x8000, 64, p.mr.key)]);
        let (out, drops) = feed(&p, &frame(&p, Opcode::RcSendOnly, p.rc, e, Ext::default(), b"still here"));
        assert!(drops.is_empty(), "{drops:?}");
        assert!(out.iter().any(|q| matches!(q.body, Body::Resp { resp: Resp::Ack, .. }) && q.roce.psn == e));
        assert_eq!(p.mr.read(0x8000, 10), b"still here");
    }
}

//! The byte encoding of a packet, for the link between processes (`link/tcp.rs`): one frame per packet, a type
//! byte, a fixed header (QPNs, SLID, SL, GRH flag; the GRH when flagged; byte ranges in `field`), then the body in a
//! fixed order, big endian, lengths before variable data. The device addresses are not encoded: the link is them.
//! [`Frame`] is a checked view of a frame's bytes; [`Packet::parse`] and [`Packet::emit`] turn it into the in-process
//! packet and back, each the other's inverse. A code this side does not know parses as `Unknown(n)` and is refused;
//! a frame that does not parse is an error, never a panic.

use super::packet::{AtomicOp, Body, Grh, Nak, Packet, RcOp, Resp, RoceInfo};

/// The frame type of a packet (the link's hello is type 1).
pub(crate) const FRAME_PACKET: u8 = 2;

/// Why a request was lost, as a code on the link (the reasons are static strings on each side).
pub(crate) const LOST: [&str; 5] = [
    "destination device dead",
    "destination device gone",
    "no RC QP in RTR/RTS at the destination",
    "link down",
    "message too large for the simulated link",
];
pub(crate) const LOST_OTHER: &str = "lost at the far end of the link";

wire_code! {
    /// What a packet carries (the byte after the GRH).
    pub(crate) BodyKind: u8 { Rc = 1, Ud = 2, Resp = 3, Uc = 4, Eth = 5, Xrc = 6, }
}

wire_code! {
    /// The operation of an RC request.
    pub(crate) RcKind: u8 { Send = 1, Write = 2, Read = 3, Atomic = 4, SendInv = 5, }
}

wire_code! {
    /// The operation of an atomic request.
    pub(crate) AtomicKind: u8 { CmpSwap = 1, FetchAdd = 2, }
}

wire_code! {
    /// The kind of an RC response.
    pub(crate) RespKind: u8 { Ack = 1, ReadData = 2, AtomicOrig = 3, RnrNak = 4, Nak = 5, Lost = 6, }
}

wire_code! {
    /// The code of a NAK.
    pub(crate) NakCode: u8 { RemoteAccess = 1, InvalidRequest = 2, RemoteOp = 3, PsnSequence = 4, }
}

/// Byte ranges of the fixed part of a packet frame (after the frame type byte), then of the GRH that follows it
/// when the GRH flag is 1 (offsets relative to the GRH). The variable part (the body) comes after them.
mod field {
    pub(super) type Field = core::ops::Range<usize>;

    pub(super) const SRC_QPN: Field = 0..4;
    pub(super) const DST_QPN: Field = 4..8;
    pub(super) const SLID: Field = 8..10;
    pub(super) const SL: usize = 10;
    pub(super) const GRH_FLAG: usize = 11;
    pub(super) const HEADER_LEN: usize = 12;

    pub(super) const SGID: Field = 0..16;
    pub(super) const DGID: Field = 16..32;
    pub(super) const TCLASS: usize = 32;
    pub(super) const FLOW_LABEL: Field = 33..37;
    pub(super) const HOP_LIMIT: usize = 37;
    pub(super) const GRH_LEN: usize = 38;
}

/// A view of a packet frame's bytes (after the frame type byte). [`Frame::new_checked`] makes sure the fixed
/// header (and the GRH its flag announces) is there, so the accessors cannot go out of bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// The bytes as a frame, unchecked: the accessors may panic on a short buffer. Only for buffers this side
    /// sized itself.
    pub(crate) fn new_unchecked(buffer: T) -> Self {
        Frame { buffer }
    }

    /// The bytes as a frame, after checking the header and the GRH are complete and the GRH flag is 0 or 1.
    pub(crate) fn new_checked(buffer: T) -> Result<Self, &'static str> {
        let f = Frame::new_unchecked(buffer);
        f.check_len()?;
        Ok(f)
    }

    fn check_len(&self) -> Result<(), &'static str> {
        let b = self.buffer.as_ref();
        if b.len() < field::HEADER_LEN {
            return Err(SHORT);
        }
        if b[field::GRH_FLAG] > 1 {
            return Err("bad GRH flag in a link frame");
        }
        if b.len() < self.body_offset() {
            return Err(SHORT);
        }
        Ok(())
    }

    fn be<const N: usize>(&self, f: field::Field) -> [u8; N] {
        let mut w = [0u8; N];
        w.copy_from_slice(&self.buffer.as_ref()[f]);
        w
    }

    pub(crate) fn src_qpn(&self) -> u32 {
        u32::from_be_bytes(self.be(field::SRC_QPN))
    }

    pub(crate) fn dst_qpn(&self) -> u32 {
        u32::from_be_bytes(self.be(field::DST_QPN))
    }

    pub(crate) fn slid(&self) -> u16 {
        u16::from_be_bytes(self.be(field::SLID))
    }

    pub(crate) fn sl(&self) -> u8 {
        self.buffer.as_ref()[field::SL]
    }

    pub(crate) fn has_grh(&self) -> bool {
        self.buffer.as_ref()[field::GRH_FLAG] == 1
    }

    /// The GRH, when the flag announces one.
    pub(crate) fn grh(&self) -> Option<Grh> {
        if !self.has_grh() {
            return None;
        }
        let g = &self.buffer.as_ref()[field::HEADER_LEN..field::HEADER_LEN + field::GRH_LEN];
        let arr = |r: field::Field| {
            let mut a = [0u8; 16];
            a.copy_from_slice(&g[r]);
            a
        };
        let mut fl = [0u8; 4];
        fl.copy_from_slice(&g[field::FLOW_LABEL]);
        Some(Grh {
            sgid: arr(field::SGID),
            dgid: arr(field::DGID),
            tclass: g[field::TCLASS],
            flow_label: u32::from_be_bytes(fl),
            hop_limit: g[field::HOP_LIMIT],
        })
    }

    fn body_offset(&self) -> usize {
        field::HEADER_LEN + if self.has_grh() { field::GRH_LEN } else { 0 }
    }

    /// The body: the kind byte and what follows it.
    pub(crate) fn body(&self) -> &[u8] {
        &self.buffer.as_ref()[self.body_offset()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    fn put(&mut self, f: field::Field, v: &[u8]) {
        self.buffer.as_mut()[f].copy_from_slice(v);
    }

    pub(crate) fn set_src_qpn(&mut self, v: u32) {
        self.put(field::SRC_QPN, &v.to_be_bytes());
    }

    pub(crate) fn set_dst_qpn(&mut self, v: u32) {
        self.put(field::DST_QPN, &v.to_be_bytes());
    }

    pub(crate) fn set_slid(&mut self, v: u16) {
        self.put(field::SLID, &v.to_be_bytes());
    }

    pub(crate) fn set_sl(&mut self, v: u8) {
        self.buffer.as_mut()[field::SL] = v;
    }

    /// Writes the GRH flag and, for `Some`, the GRH after the header (the buffer must have room for it).
    pub(crate) fn set_grh(&mut self, grh: Option<&Grh>) {
        let b = self.buffer.as_mut();
        b[field::GRH_FLAG] = grh.is_some().into();
        let Some(h) = grh else { return };
        let g = &mut b[field::HEADER_LEN..field::HEADER_LEN + field::GRH_LEN];
        g[field::SGID].copy_from_slice(&h.sgid);
        g[field::DGID].copy_from_slice(&h.dgid);
        g[field::TCLASS] = h.tclass;
        g[field::FLOW_LABEL].copy_from_slice(&h.flow_label.to_be_bytes());
        g[field::HOP_LIMIT] = h.hop_limit;
    }
}

/// Writes an RC or UC operation (its kind, then its fields).
fn emit_op(e: &mut Enc, op: &RcOp) {
    match op {
        RcOp::Send { data, imm, inv: None } => {
            e.u8(RcKind::Send.into());
            e.imm(imm);
            e.data(data);
        }
        RcOp::Send { data, inv: Some(rkey), .. } => {
            e.u8(RcKind::SendInv.into());
            e.u32(*rkey);
            e.data(data);
        }
        RcOp::Write { raddr, rkey, data, imm } => {
            e.u8(RcKind::Write.into());
            e.u64(*raddr);
            e.u32(*rkey);
            e.imm(imm);
            e.data(data);
        }
        RcOp::Read { raddr, rkey, len } => {
            e.u8(RcKind::Read.into());
            e.u64(*raddr);
            e.u32(*rkey);
            e.u64(*len);
        }
        RcOp::Atomic { raddr, rkey, op } => {
            e.u8(RcKind::Atomic.into());
            e.u64(*raddr);
            e.u32(*rkey);
            match *op {
                AtomicOp::CmpSwap { compare, swap } => {
                    e.u8(AtomicKind::CmpSwap.into());
                    e.u64(compare);
                    e.u64(swap);
                }
                AtomicOp::FetchAdd { add } => {
                    e.u8(AtomicKind::FetchAdd.into());
                    e.u64(add);
                }
            }
        }
    }
}

/// Reads what [`emit_op`] wrote, every length checked against the frame.
fn parse_op(d: &mut Dec<'_>) -> Result<RcOp, &'static str> {
    Ok(match RcKind::from(d.u8()?) {
        RcKind::Send => {
            let imm = d.imm()?;
            RcOp::Send { data: d.data()?.into(), imm, inv: None }
        }
        RcKind::SendInv => {
            let rkey = d.u32()?;
            RcOp::Send { data: d.data()?.into(), imm: None, inv: Some(rkey) }
        }
        RcKind::Write => {
            let (raddr, rkey, imm) = (d.u64()?, d.u32()?, d.imm()?);
            RcOp::Write { raddr, rkey, data: d.data()?.into(), imm }
        }
        RcKind::Read => RcOp::Read { raddr: d.u64()?, rkey: d.u32()?, len: d.u64()? },
        RcKind::Atomic => {
            let (raddr, rkey) = (d.u64()?, d.u32()?);
            let op = match AtomicKind::from(d.u8()?) {
                AtomicKind::CmpSwap => AtomicOp::CmpSwap { compare: d.u64()?, swap: d.u64()? },
                AtomicKind::FetchAdd => AtomicOp::FetchAdd { add: d.u64()? },
                AtomicKind::Unknown(_) => return Err("bad atomic kind in a link frame"),
            };
            RcOp::Atomic { raddr, rkey, op }
        }
        RcKind::Unknown(_) => return Err("bad RC operation in a link frame"),
    })
}

impl<D> Packet<D> {
    /// The bytes of the fixed header and the GRH this packet's frame has.
    fn header_len(&self) -> usize {
        field::HEADER_LEN + if self.grh.is_some() { field::GRH_LEN } else { 0 }
    }

    /// Writes the packet as a frame (type byte included). The addresses of the two devices are not sent: the
    /// link is them.
    pub(crate) fn emit(&self) -> Vec<u8> {
        let payload = match &self.body {
            Body::Rc { op: RcOp::Send { data, .. } | RcOp::Write { data, .. }, .. }
            | Body::Uc { op: RcOp::Send { data, .. } | RcOp::Write { data, .. }, .. } => data.len(),
            Body::Ud { data, .. } => data.len(),
            Body::Resp { resp: Resp::ReadData(d), .. } => d.len(),
            Body::Eth { frame } => frame.len(),
            _ => 0,
        };
        let head = 1 + self.header_len();
        let mut buf = Vec::with_capacity(head + 48 + payload);
        buf.resize(head, 0);
        buf[0] = FRAME_PACKET;
        let mut f = Frame::new_unchecked(&mut buf[1..head]);
        f.set_src_qpn(self.src_qpn);
        f.set_dst_qpn(self.dst_qpn);
        f.set_slid(self.slid);
        f.set_sl(self.sl);
        f.set_grh(self.grh.as_ref());
        let mut e = Enc(buf);
        self.emit_body(&mut e);
        // What the RoCE form of the packet needs (captures on the far side), after the body.
        e.u8(self.roce.mtu);
        e.u16(self.roce.udp_sport);
        e.u32(self.roce.psn);
        e.u32(self.roce.msn);
        e.0
    }

    fn emit_body(&self, e: &mut Enc) {
        match &self.body {
            Body::Rc { seq, psn, op, solicited, xrc_srqn } => {
                // An XRC request is an RC one with its XRC SRQ after the flags.
                e.u8(if xrc_srqn.is_some() { BodyKind::Xrc } else { BodyKind::Rc }.into());
                e.u64(*seq);
                e.u32(*psn);
                e.u8((*solicited).into());
                if let Some(n) = xrc_srqn {
                    e.u32(*n);
                }
                emit_op(e, op);
            }
            Body::Uc { psn, op, solicited } => {
                e.u8(BodyKind::Uc.into());
                e.u32(*psn);
                e.u8((*solicited).into());
                emit_op(e, op);
            }
            Body::Ud { qkey, pkey, data, imm, solicited } => {
                e.u8(BodyKind::Ud.into());
                e.u32(*qkey);
                e.u16(*pkey);
                e.u8((*solicited).into());
                e.imm(imm);
                e.data(data);
            }
            Body::Eth { frame } => {
                e.u8(BodyKind::Eth.into());
                e.data(frame);
            }
            Body::Resp { seq, resp } => {
                e.u8(BodyKind::Resp.into());
                e.u64(*seq);
                match resp {
                    Resp::Ack => e.u8(RespKind::Ack.into()),
                    Resp::ReadData(d) => {
                        e.u8(RespKind::ReadData.into());
                        e.data(d);
                    }
                    Resp::AtomicOrig(v) => {
                        e.u8(RespKind::AtomicOrig.into());
                        e.u64(*v);
                    }
                    Resp::RnrNak { timer } => {
                        e.u8(RespKind::RnrNak.into());
                        e.u8(*timer);
                    }
                    Resp::Nak(n) => {
                        e.u8(RespKind::Nak.into());
                        e.u8(NakCode::from(*n).into());
                    }
                    Resp::Lost(why) => {
                        e.u8(RespKind::Lost.into());
                        e.u8(LOST.iter().position(|l| l == why).map_or(u8::MAX, |i| i as u8));
                    }
                }
            }
        }
    }
}

impl<D: Clone> Packet<D> {
    /// The packet a checked frame holds; the source and destination are the caller's to fill in (here both are
    /// `nobody`). Every length in the body is checked against the frame.
    pub(crate) fn parse<T: AsRef<[u8]>>(f: &Frame<T>, nobody: D) -> Result<Self, &'static str> {
        let mut d = Dec(f.body());
        let body = match BodyKind::from(d.u8()?) {
            kind @ (BodyKind::Rc | BodyKind::Xrc) => {
                let (seq, psn, solicited) = (d.u64()?, d.u32()?, d.bool()?);
                let xrc_srqn = if kind == BodyKind::Xrc { Some(d.u32()?) } else { None };
                let op = parse_op(&mut d)?;
                Body::Rc { seq, psn, op, solicited, xrc_srqn }
            }
            BodyKind::Uc => {
                let (psn, solicited) = (d.u32()?, d.bool()?);
                let op = parse_op(&mut d)?;
                Body::Uc { psn, op, solicited }
            }
            BodyKind::Ud => {
                let (qkey, pkey, solicited, imm) = (d.u32()?, d.u16()?, d.bool()?, d.imm()?);
                Body::Ud { qkey, pkey, data: d.data()?.to_vec(), imm, solicited }
            }
            BodyKind::Eth => Body::Eth { frame: d.data()?.to_vec() },
            BodyKind::Resp => {
                let seq = d.u64()?;
                let resp = match RespKind::from(d.u8()?) {
                    RespKind::Ack => Resp::Ack,
                    RespKind::ReadData => Resp::ReadData(d.data()?.to_vec()),
                    RespKind::AtomicOrig => Resp::AtomicOrig(d.u64()?),
                    RespKind::RnrNak => Resp::RnrNak { timer: d.u8()? },
                    RespKind::Nak => Resp::Nak(Nak::try_from(NakCode::from(d.u8()?))?),
                    RespKind::Lost => Resp::Lost(LOST.get(usize::from(d.u8()?)).copied().unwrap_or(LOST_OTHER)),
                    RespKind::Unknown(_) => return Err("bad response kind in a link frame"),
                };
                Body::Resp { seq, resp }
            }
            BodyKind::Unknown(_) => return Err("bad packet kind in a link frame"),
        };
        // Whole messages cross this format: nothing resumes.
        let roce = RoceInfo { mtu: d.u8()?, udp_sport: d.u16()?, psn: d.u32()?, msn: d.u32()?, ..RoceInfo::default() };
        d.end()?;
        Ok(Packet {
            src: nobody.clone(),
            dst: nobody,
            src_qpn: f.src_qpn(),
            dst_qpn: f.dst_qpn(),
            slid: f.slid(),
            sl: f.sl(),
            grh: f.grh(),
            body,
            roce,
        })
    }
}

impl From<Nak> for NakCode {
    fn from(n: Nak) -> Self {
        match n {
            Nak::RemoteAccess => NakCode::RemoteAccess,
            Nak::InvalidRequest => NakCode::InvalidRequest,
            Nak::RemoteOp => NakCode::RemoteOp,
            Nak::PsnSequence => NakCode::PsnSequence,
        }
    }
}

impl TryFrom<NakCode> for Nak {
    type Error = &'static str;
    fn try_from(c: NakCode) -> Result<Self, Self::Error> {
        Ok(match c {
            NakCode::RemoteAccess => Nak::RemoteAccess,
            NakCode::InvalidRequest => Nak::InvalidRequest,
            NakCode::RemoteOp => Nak::RemoteOp,
            NakCode::PsnSequence => Nak::PsnSequence,
            NakCode::Unknown(_) => return Err("bad NAK code in a link frame"),
        })
    }
}

/// The frame for `p` (type byte included): [`Packet::emit`].
pub(crate) fn encode_packet<D>(p: &Packet<D>) -> Vec<u8> {
    p.emit()
}

/// A packet from a frame body (after the type byte): [`Frame::new_checked`], then [`Packet::parse`].
pub(crate) fn decode_packet<D: Clone>(b: &[u8], nobody: D) -> Result<Packet<D>, &'static str> {
    Packet::parse(&Frame::new_checked(b)?, nobody)
}

/// Big-endian encoder.
pub(crate) struct Enc(pub(crate) Vec<u8>);

impl Enc {
    pub(crate) fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub(crate) fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    pub(crate) fn imm(&mut self, imm: &Option<[u8; 4]>) {
        match imm {
            None => self.u8(0),
            Some(i) => {
                self.u8(1);
                self.bytes(i);
            }
        }
    }
    /// A length-prefixed payload (the frame limit keeps every length within 32 bits).
    pub(crate) fn data(&mut self, b: &[u8]) {
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.bytes(b);
    }
}

/// Big-endian decoder over untrusted bytes: every read is bounds-checked.
pub(crate) struct Dec<'a>(pub(crate) &'a [u8]);

pub(crate) const SHORT: &str = "truncated link frame";

impl<'a> Dec<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err(SHORT);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], &'static str> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.array::<1>()?[0])
    }
    pub(crate) fn bool(&mut self) -> Result<bool, &'static str> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err("bad flag in a link frame"),
        }
    }
    pub(crate) fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    pub(crate) fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    pub(crate) fn imm(&mut self) -> Result<Option<[u8; 4]>, &'static str> {
        Ok(if self.bool()? { Some(self.array()?) } else { None })
    }
    pub(crate) fn data(&mut self) -> Result<&'a [u8], &'static str> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(crate) fn end(&self) -> Result<(), &'static str> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err("trailing bytes in a link frame")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Packet<()> {
        Packet {
            src: (),
            dst: (),
            src_qpn: 0x12,
            dst_qpn: 0x345678,
            slid: 0x0102,
            sl: 3,
            grh: Some(Grh { sgid: [0xa; 16], dgid: [0xb; 16], tclass: 4, flow_label: 0x5_6789, hop_limit: 64 }),
            body: Body::Rc {
                seq: 0x1122_3344_5566_7788,
                psn: 0xabcdef,
                op: RcOp::Write { raddr: 0x1000, rkey: 0x99, data: (&b"xy"[..]).into(), imm: Some([1, 2, 3, 4]) },
                solicited: true,
                xrc_srqn: None,
            },
            roce: RoceInfo { mtu: 3, udp_sport: 0xc001, psn: 0xabcdef, msn: 7, ..RoceInfo::default() },
        }
    }

    #[test]
    fn a_packet_frame_has_a_fixed_layout() {
        let f = encode_packet(&sample());
        let mut want = vec![FRAME_PACKET, 0, 0, 0, 0x12, 0, 0x34, 0x56, 0x78, 1, 2, 3, 1];
        want.extend([0xa; 16]);
        want.extend([0xb; 16]);
        want.extend([4, 0, 5, 0x67, 0x89, 64]);
        want.extend([1, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0, 0xab, 0xcd, 0xef, 1]);
        want.extend([2, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0x99, 1, 1, 2, 3, 4, 0, 0, 0, 2, b'x', b'y']);
        // The RoCE facts: MTU code, UDP source port, PSN, MSN.
        want.extend([3, 0xc0, 0x01, 0, 0xab, 0xcd, 0xef, 0, 0, 0, 7]);
        assert_eq!(f, want);
        let p = decode_packet(&want[1..], ()).unwrap();
        let s = sample();
        assert_eq!(
            (p.src_qpn, p.dst_qpn, p.slid, p.sl, p.grh, &p.body, p.roce),
            (s.src_qpn, s.dst_qpn, s.slid, s.sl, s.grh, &s.body, s.roce)
        );
    }

    #[test]
    fn an_xrc_request_is_an_rc_body_of_its_own_kind_with_its_srq_after_the_flags() {
        // SEND "ab" to XRC SRQ 0x41: kind 6, seq, PSN, solicited, the SRQ number, then the operation as RC's.
        let body = Body::Rc {
            seq: 2,
            psn: 0x10,
            op: RcOp::Send { data: (&b"ab"[..]).into(), imm: None, inv: None },
            solicited: false,
            xrc_srqn: Some(0x41),
        };
        let p = Packet { grh: None, body, ..sample() };
        let f = encode_packet(&p);
        let mut rc = p.clone();
        rc.body = Body::Rc {
            seq: 2,
            psn: 0x10,
            op: RcOp::Send { data: (&b"ab"[..]).into(), imm: None, inv: None },
            solicited: false,
            xrc_srqn: None,
        };
        let plain = encode_packet(&rc);
        let at = 1 + field::HEADER_LEN;
        let head = [6, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0x10, 0, 0, 0, 0, 0x41];
        assert_eq!(&f[at..at + head.len()], &head);
        // The rest is the RC body's after its flags: the same bytes.
        assert_eq!(plain[at], u8::from(BodyKind::Rc));
        assert_eq!(&f[at + head.len()..], &plain[at + head.len() - 4..]);
        assert_eq!(decode_packet(&f[1..], ()).unwrap().body, p.body);
    }

    #[test]
    fn every_body_round_trips_and_every_truncation_is_an_error() {
        let bodies = [
            Body::Rc {
                seq: 1,
                psn: 2,
                op: RcOp::Send { data: (&[7u8; 9][..]).into(), imm: None, inv: None },
                solicited: false,
                xrc_srqn: None,
            },
            Body::Rc {
                seq: 2,
                psn: 3,
                op: RcOp::Send { data: (&[4u8; 5][..]).into(), imm: None, inv: Some(0x1234_5601) },
                solicited: false,
                xrc_srqn: None,
            },
            Body::Rc { seq: 3, psn: 4, op: RcOp::Read { raddr: 5, rkey: 6, len: 7 }, solicited: false, xrc_srqn: None },
            Body::Rc {
                seq: 8,
                psn: 9,
                op: RcOp::Atomic { raddr: 8, rkey: 1, op: AtomicOp::CmpSwap { compare: 2, swap: 3 } },
                solicited: false,
                xrc_srqn: None,
            },
            Body::Rc {
                seq: 8,
                psn: 9,
                op: RcOp::Atomic { raddr: 8, rkey: 1, op: AtomicOp::FetchAdd { add: 5 } },
                solicited: true,
                xrc_srqn: None,
            },
            Body::Rc {
                seq: 1,
                psn: 2,
                op: RcOp::Send { data: (&[6u8; 3][..]).into(), imm: None, inv: None },
                solicited: false,
                xrc_srqn: Some(0x41),
            },
            Body::Ud { qkey: 0x1111, pkey: 0x8001, data: vec![1, 2, 3], imm: Some([9; 4]), solicited: true },
            Body::Uc {
                psn: 0xab_cdef,
                op: RcOp::Send { data: (&[3u8; 4][..]).into(), imm: Some([1; 4]), inv: None },
                solicited: true,
            },
            Body::Uc {
                psn: 1,
                op: RcOp::Write { raddr: 0x1000, rkey: 7, data: (&[5u8; 70][..]).into(), imm: None },
                solicited: false,
            },
            Body::Eth { frame: vec![0xff; 60] },
            Body::Resp { seq: 5, resp: Resp::Ack },
            Body::Resp { seq: 5, resp: Resp::ReadData(vec![4; 5]) },
            Body::Resp { seq: 5, resp: Resp::AtomicOrig(u64::MAX) },
            Body::Resp { seq: 5, resp: Resp::RnrNak { timer: 12 } },
            Body::Resp { seq: 5, resp: Resp::Nak(Nak::PsnSequence) },
            Body::Resp { seq: 5, resp: Resp::Nak(Nak::RemoteAccess) },
            Body::Resp { seq: 5, resp: Resp::Lost("no RC QP in RTR/RTS at the destination") },
        ];
        for body in bodies {
            let p = Packet { grh: None, body, ..sample() };
            let f = encode_packet(&p);
            let back = decode_packet(&f[1..], ()).unwrap();
            assert_eq!((back.grh, &back.body), (None, &p.body));
            for cut in 1..f.len() - 1 {
                assert!(decode_packet(&f[1..cut], ()).is_err(), "{:?} cut at {cut}", p.body);
            }
            let mut longer = f.clone();
            longer.push(0);
            assert_eq!(decode_packet(&longer[1..], ()).err(), Some("trailing bytes in a link frame"));
        }
        // A reason the far end knows and we do not still reads as a loss.
        let mut f = encode_packet(&Packet {
            grh: None,
            body: Body::Resp { seq: 1, resp: Resp::Lost("link down") },
            ..sample()
        });
        // The reason code is the last byte before the 11 bytes of RoCE facts.
        let at = f.len() - 12;
        f[at] = 200;
        assert_eq!(decode_packet(&f[1..], ()).unwrap().body, Body::Resp { seq: 1, resp: Resp::Lost(LOST_OTHER) });
    }

    #[test]
    fn the_header_view_reads_and_writes_the_fixed_fields() {
        let f = encode_packet(&sample());
        let v = Frame::new_checked(&f[1..]).unwrap();
        assert_eq!((v.src_qpn(), v.dst_qpn(), v.slid(), v.sl(), v.grh()), (0x12, 0x34_5678, 0x0102, 3, sample().grh));
        assert_eq!(v.body()[0], u8::from(BodyKind::Rc));
        let mut head = [0u8; 12];
        let mut w = Frame::new_unchecked(&mut head[..]);
        w.set_src_qpn(0x12);
        w.set_dst_qpn(0x34_5678);
        w.set_slid(0x0102);
        w.set_sl(3);
        w.set_grh(None);
        assert_eq!(head, [0, 0, 0, 0x12, 0, 0x34, 0x56, 0x78, 1, 2, 3, 0]);
        assert!(Frame::new_checked(&head[..]).unwrap().grh().is_none());
        // Short headers, a GRH announced but cut, and a flag that is neither 0 nor 1 are refused.
        assert_eq!(Frame::new_checked(&head[..11]).err(), Some(SHORT));
        head[11] = 1;
        assert_eq!(Frame::new_checked(&head[..]).err(), Some(SHORT));
        head[11] = 2;
        assert_eq!(Frame::new_checked(&head[..]).err(), Some("bad GRH flag in a link frame"));
    }

    #[test]
    fn codes_round_trip_and_unknown_values_are_kept() {
        for v in 0..=u8::MAX {
            assert_eq!(u8::from(BodyKind::from(v)), v);
            assert_eq!(u8::from(RcKind::from(v)), v);
            assert_eq!(u8::from(AtomicKind::from(v)), v);
            assert_eq!(u8::from(RespKind::from(v)), v);
            assert_eq!(u8::from(NakCode::from(v)), v);
        }
        assert_eq!((BodyKind::from(3), BodyKind::from(9)), (BodyKind::Resp, BodyKind::Unknown(9)));
        assert_eq!(Nak::try_from(NakCode::from(4)), Ok(Nak::PsnSequence));
        assert_eq!(Nak::try_from(NakCode::from(0)).err(), Some("bad NAK code in a link frame"));
        let mut f = encode_packet(&Packet { grh: None, body: Body::Resp { seq: 1, resp: Resp::Ack }, ..sample() });
        f[13] = 7;
        assert_eq!(decode_packet(&f[1..], ()).err(), Some("bad packet kind in a link frame"));
    }
}

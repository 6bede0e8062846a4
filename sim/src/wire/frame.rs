//! The byte encoding of a packet, for the link between processes (`link/tcp.rs`): one frame per packet, a type
//! byte then the packet's fields in a fixed order, big endian, lengths before variable data. The device addresses
//! are not encoded: the link is them. [`encode_packet`] and [`decode_packet`] are each other's inverse; a frame
//! that does not parse is an error, never a panic.

use super::{AtomicOp, Body, Grh, Nak, Packet, RcOp, Resp};

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

/// The frame for `p` (type byte included). The addresses of the two devices are not sent: the link is them.
pub(crate) fn encode_packet<D>(p: &Packet<D>) -> Vec<u8> {
    let payload = match &p.body {
        Body::Rc { op: RcOp::Send { data, .. } | RcOp::Write { data, .. }, .. } => data.len(),
        Body::Ud { data, .. } => data.len(),
        Body::Resp { resp: Resp::ReadData(d), .. } => d.len(),
        _ => 0,
    };
    let mut e = Enc(Vec::with_capacity(96 + payload));
    e.u8(FRAME_PACKET);
    e.u32(p.src_qpn);
    e.u32(p.dst_qpn);
    e.u16(p.slid);
    e.u8(p.sl);
    match &p.grh {
        None => e.u8(0),
        Some(g) => {
            e.u8(1);
            e.bytes(&g.sgid);
            e.bytes(&g.dgid);
            e.u8(g.tclass);
            e.u32(g.flow_label);
            e.u8(g.hop_limit);
        }
    }
    match &p.body {
        Body::Rc { seq, psn, op, solicited } => {
            e.u8(1);
            e.u64(*seq);
            e.u32(*psn);
            e.u8((*solicited).into());
            match op {
                RcOp::Send { data, imm } => {
                    e.u8(1);
                    e.imm(imm);
                    e.data(data);
                }
                RcOp::Write { raddr, rkey, data, imm } => {
                    e.u8(2);
                    e.u64(*raddr);
                    e.u32(*rkey);
                    e.imm(imm);
                    e.data(data);
                }
                RcOp::Read { raddr, rkey, len } => {
                    e.u8(3);
                    e.u64(*raddr);
                    e.u32(*rkey);
                    e.u64(*len);
                }
                RcOp::Atomic { raddr, rkey, op } => {
                    e.u8(4);
                    e.u64(*raddr);
                    e.u32(*rkey);
                    match *op {
                        AtomicOp::CmpSwap { compare, swap } => {
                            e.u8(1);
                            e.u64(compare);
                            e.u64(swap);
                        }
                        AtomicOp::FetchAdd { add } => {
                            e.u8(2);
                            e.u64(add);
                        }
                    }
                }
            }
        }
        Body::Ud { qkey, data, imm, solicited } => {
            e.u8(2);
            e.u32(*qkey);
            e.u8((*solicited).into());
            e.imm(imm);
            e.data(data);
        }
        Body::Resp { seq, resp } => {
            e.u8(3);
            e.u64(*seq);
            match resp {
                Resp::Ack => e.u8(1),
                Resp::ReadData(d) => {
                    e.u8(2);
                    e.data(d);
                }
                Resp::AtomicOrig(v) => {
                    e.u8(3);
                    e.u64(*v);
                }
                Resp::RnrNak { timer } => {
                    e.u8(4);
                    e.u8(*timer);
                }
                Resp::Nak(n) => {
                    e.u8(5);
                    e.u8(match n {
                        Nak::RemoteAccess => 1,
                        Nak::InvalidRequest => 2,
                        Nak::RemoteOp => 3,
                        Nak::PsnSequence => 4,
                    });
                }
                Resp::Lost(why) => {
                    e.u8(6);
                    e.u8(LOST.iter().position(|l| l == why).map_or(u8::MAX, |i| i as u8));
                }
            }
        }
    }
    e.0
}

/// A packet from a frame body (after the type byte); the source and destination are the caller's to fill in
/// (here both are `nobody`). Every length is checked against the frame.
pub(crate) fn decode_packet<D: Clone>(b: &[u8], nobody: D) -> Result<Packet<D>, &'static str> {
    let mut d = Dec(b);
    let src_qpn = d.u32()?;
    let dst_qpn = d.u32()?;
    let slid = d.u16()?;
    let sl = d.u8()?;
    let grh = match d.u8()? {
        0 => None,
        1 => {
            Some(Grh { sgid: d.array()?, dgid: d.array()?, tclass: d.u8()?, flow_label: d.u32()?, hop_limit: d.u8()? })
        }
        _ => return Err("bad GRH flag in a link frame"),
    };
    let body = match d.u8()? {
        1 => {
            let (seq, psn, solicited) = (d.u64()?, d.u32()?, d.bool()?);
            let op = match d.u8()? {
                1 => {
                    let imm = d.imm()?;
                    RcOp::Send { data: d.data()?.into(), imm }
                }
                2 => {
                    let (raddr, rkey, imm) = (d.u64()?, d.u32()?, d.imm()?);
                    RcOp::Write { raddr, rkey, data: d.data()?.into(), imm }
                }
                3 => RcOp::Read { raddr: d.u64()?, rkey: d.u32()?, len: d.u64()? },
                4 => {
                    let (raddr, rkey) = (d.u64()?, d.u32()?);
                    let op = match d.u8()? {
                        1 => AtomicOp::CmpSwap { compare: d.u64()?, swap: d.u64()? },
                        2 => AtomicOp::FetchAdd { add: d.u64()? },
                        _ => return Err("bad atomic kind in a link frame"),
                    };
                    RcOp::Atomic { raddr, rkey, op }
                }
                _ => return Err("bad RC operation in a link frame"),
            };
            Body::Rc { seq, psn, op, solicited }
        }
        2 => {
            let (qkey, solicited, imm) = (d.u32()?, d.bool()?, d.imm()?);
            Body::Ud { qkey, data: d.data()?.to_vec(), imm, solicited }
        }
        3 => {
            let seq = d.u64()?;
            let resp = match d.u8()? {
                1 => Resp::Ack,
                2 => Resp::ReadData(d.data()?.to_vec()),
                3 => Resp::AtomicOrig(d.u64()?),
                4 => Resp::RnrNak { timer: d.u8()? },
                5 => Resp::Nak(match d.u8()? {
                    1 => Nak::RemoteAccess,
                    2 => Nak::InvalidRequest,
                    3 => Nak::RemoteOp,
                    4 => Nak::PsnSequence,
                    _ => return Err("bad NAK code in a link frame"),
                }),
                6 => Resp::Lost(LOST.get(usize::from(d.u8()?)).copied().unwrap_or(LOST_OTHER)),
                _ => return Err("bad response kind in a link frame"),
            };
            Body::Resp { seq, resp }
        }
        _ => return Err("bad packet kind in a link frame"),
    };
    d.end()?;
    Ok(Packet { src: nobody.clone(), dst: nobody, src_qpn, dst_qpn, slid, sl, grh, body })
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
            },
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
        assert_eq!(f, want);
        let p = decode_packet(&want[1..], ()).unwrap();
        let s = sample();
        assert_eq!(
            (p.src_qpn, p.dst_qpn, p.slid, p.sl, p.grh, &p.body),
            (s.src_qpn, s.dst_qpn, s.slid, s.sl, s.grh, &s.body)
        );
    }

    #[test]
    fn every_body_round_trips_and_every_truncation_is_an_error() {
        let bodies = [
            Body::Rc { seq: 1, psn: 2, op: RcOp::Send { data: (&[7u8; 9][..]).into(), imm: None }, solicited: false },
            Body::Rc { seq: 3, psn: 4, op: RcOp::Read { raddr: 5, rkey: 6, len: 7 }, solicited: false },
            Body::Rc {
                seq: 8,
                psn: 9,
                op: RcOp::Atomic { raddr: 8, rkey: 1, op: AtomicOp::CmpSwap { compare: 2, swap: 3 } },
                solicited: false,
            },
            Body::Rc {
                seq: 8,
                psn: 9,
                op: RcOp::Atomic { raddr: 8, rkey: 1, op: AtomicOp::FetchAdd { add: 5 } },
                solicited: true,
            },
            Body::Ud { qkey: 0x1111, data: vec![1, 2, 3], imm: Some([9; 4]), solicited: true },
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
        *f.last_mut().unwrap() = 200;
        assert_eq!(decode_packet(&f[1..], ()).unwrap().body, Body::Resp { seq: 1, resp: Resp::Lost(LOST_OTHER) });
    }
}

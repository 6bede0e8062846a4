//! How RC and UC messages become packets and back, as the IBA (chapter 9) and `rdma_rxe` do it: a message is cut
//! at the path MTU into FIRST, MIDDLE.. and LAST packets (or one ONLY packet), one PSN each; RETH rides on the
//! first packet of a WRITE (its length is the whole message's); the requester sets AckReq on the last packet
//! only; a READ request consumes one PSN per response packet, whose responses carry AETH on the first and last
//! (or only) packet. PSNs are 24-bit and compared modulo 2^24.

use super::ib::Opcode;

/// PSNs are 24 bits.
pub const PSN_MASK: u32 = 0xff_ffff;

/// `psn + n` modulo 2^24.
pub fn psn_add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & PSN_MASK
}

/// `a - b` as a signed distance in the 24-bit PSN space (positive: `a` is after `b`).
pub fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// The path MTUs IBA defines, in bytes (256 to 4096).
pub fn mtu_bytes(ib_mtu: u8) -> Option<usize> {
    match ib_mtu {
        1..=5 => Some(128 << ib_mtu),
        _ => None,
    }
}

/// Packets a message of `len` bytes needs at `mtu` (an empty message is one packet).
pub fn packets(len: usize, mtu: usize) -> u32 {
    len.div_ceil(mtu.max(1)).max(1) as u32
}

/// What a message is, for choosing its opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgKind {
    /// SEND (with immediate data on the last packet when `imm`).
    Send {
        /// Carries immediate data.
        imm: bool,
    },
    /// SEND with invalidate (RC only): the IETH on the last packet.
    SendInv,
    /// RDMA WRITE (RETH on the first packet; immediate data on the last when `imm`).
    Write {
        /// Carries immediate data.
        imm: bool,
    },
    /// The responses to a READ request.
    ReadResponse,
}

/// One packet of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The packet's opcode.
    pub opcode: Opcode,
    /// Its PSN.
    pub psn: u32,
    /// Where its payload starts in the message.
    pub offset: usize,
    /// Bytes of payload.
    pub len: usize,
    /// Whether the requester asks for an acknowledgement (the last packet of a request).
    pub ack_req: bool,
}

/// The packets of one message, in order.
#[derive(Debug, Clone)]
pub struct Segmenter {
    kind: MsgKind,
    uc: bool,
    len: usize,
    mtu: usize,
    first_psn: u32,
    index: u32,
    count: u32,
}

impl Segmenter {
    /// The packets of a `len`-byte message starting at `psn`, cut at `mtu` bytes; `uc` picks the UC opcodes
    /// (no READ on UC: a read response with `uc` uses the RC opcodes).
    pub fn new(kind: MsgKind, uc: bool, len: usize, mtu: usize, psn: u32) -> Segmenter {
        Segmenter { kind, uc, len, mtu: mtu.max(1), first_psn: psn & PSN_MASK, index: 0, count: packets(len, mtu) }
    }

    /// PSNs the message uses.
    pub fn count(&self) -> u32 {
        self.count
    }

    fn opcode(&self, first: bool, last: bool) -> Opcode {
        use Opcode::*;
        let (f, m, l, li, o, oi) = match (self.kind, self.uc) {
            (MsgKind::Send { .. }, false) => {
                (RcSendFirst, RcSendMiddle, RcSendLast, RcSendLastImm, RcSendOnly, RcSendOnlyImm)
            }
            (MsgKind::SendInv, _) => {
                (RcSendFirst, RcSendMiddle, RcSendLastInv, RcSendLastInv, RcSendOnlyInv, RcSendOnlyInv)
            }
            (MsgKind::Send { .. }, true) => {
                (UcSendFirst, UcSendMiddle, UcSendLast, UcSendLastImm, UcSendOnly, UcSendOnlyImm)
            }
            (MsgKind::Write { .. }, false) => {
                (RcWriteFirst, RcWriteMiddle, RcWriteLast, RcWriteLastImm, RcWriteOnly, RcWriteOnlyImm)
            }
            (MsgKind::Write { .. }, true) => {
                (UcWriteFirst, UcWriteMiddle, UcWriteLast, UcWriteLastImm, UcWriteOnly, UcWriteOnlyImm)
            }
            (MsgKind::ReadResponse, _) => (
                RcReadResponseFirst,
                RcReadResponseMiddle,
                RcReadResponseLast,
                RcReadResponseLast,
                RcReadResponseOnly,
                RcReadResponseOnly,
            ),
        };
        let imm = matches!(self.kind, MsgKind::Send { imm: true } | MsgKind::Write { imm: true });
        match (first, last, imm) {
            (true, true, false) => o,
            (true, true, true) => oi,
            (true, false, _) => f,
            (false, false, _) => m,
            (false, true, false) => l,
            (false, true, true) => li,
        }
    }
}

impl Iterator for Segmenter {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.index == self.count {
            return None;
        }
        let i = self.index;
        self.index += 1;
        let first = i == 0;
        let last = self.index == self.count;
        let offset = i as usize * self.mtu;
        let len = if last { self.len - offset } else { self.mtu };
        let ack_req = last && self.kind != MsgKind::ReadResponse;
        Some(Segment { opcode: self.opcode(first, last), psn: psn_add(self.first_psn, i), offset, len, ack_req })
    }
}

/// Where a packet stands in its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    /// The first of several.
    First,
    /// Neither first nor last.
    Middle,
    /// The last of several.
    Last,
    /// The whole message.
    Only,
}

impl Opcode {
    /// The position of a SEND, WRITE or READ response packet in its message; `None` for other opcodes.
    pub fn position(self) -> Option<Position> {
        use Opcode::*;
        Some(match self {
            RcSendFirst | UcSendFirst | RcWriteFirst | UcWriteFirst | RcReadResponseFirst => Position::First,
            RcSendMiddle | UcSendMiddle | RcWriteMiddle | UcWriteMiddle | RcReadResponseMiddle => Position::Middle,
            RcSendLast | RcSendLastImm | RcSendLastInv | UcSendLast | UcSendLastImm | RcWriteLast | RcWriteLastImm
            | UcWriteLast | UcWriteLastImm | RcReadResponseLast => Position::Last,
            RcSendOnly | RcSendOnlyImm | RcSendOnlyInv | UcSendOnly | UcSendOnlyImm | RcWriteOnly | RcWriteOnlyImm
            | UcWriteOnly | UcWriteOnlyImm | RcReadResponseOnly | UdSendOnly | UdSendOnlyImm => Position::Only,
            _ => return None,
        })
    }
}

/// How a receiver's PSN check classifies a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PsnCheck {
    /// The expected PSN: execute it.
    Expected,
    /// Before the expected PSN: a duplicate, answered without executing it again.
    Duplicate,
    /// After the expected PSN: a PSN sequence error (NAK with the expected PSN; on UC, drop the message).
    Ahead,
}

/// Classifies `psn` against the expected `epsn`.
pub fn check_psn(psn: u32, epsn: u32) -> PsnCheck {
    match psn_diff(psn, epsn) {
        0 => PsnCheck::Expected,
        d if d < 0 => PsnCheck::Duplicate,
        _ => PsnCheck::Ahead,
    }
}

/// The receiver's view of a multi-packet message: whether the packet's position may follow the previous one,
/// and whether its length is right for the MTU (FIRST and MIDDLE exactly one MTU, LAST 1..=MTU, ONLY at most
/// one MTU), as `rdma_rxe`'s responder checks them; a violation is an invalid request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reassembly {
    in_message: bool,
    bytes: usize,
}

impl Reassembly {
    /// Accepts the next in-sequence packet at `pos` with `len` payload bytes; returns the message's bytes so far
    /// (this packet included), or `Err(())` for an out-of-order position or a wrong length (nothing changes).
    #[allow(clippy::result_unit_err)]
    pub fn accept(&mut self, pos: Position, len: usize, mtu: usize) -> Result<usize, ()> {
        let ok = match pos {
            Position::First => !self.in_message && len == mtu,
            Position::Middle => self.in_message && len == mtu,
            Position::Last => self.in_message && (1..=mtu).contains(&len),
            Position::Only => !self.in_message && len <= mtu,
        };
        if !ok {
            return Err(());
        }
        self.bytes = if matches!(pos, Position::First | Position::Only) { len } else { self.bytes + len };
        self.in_message = matches!(pos, Position::First | Position::Middle);
        Ok(self.bytes)
    }

    /// Whether a message is partly received.
    pub fn in_message(&self) -> bool {
        self.in_message
    }
}

/// PSNs a message of `len` bytes uses at the path MTU `mtu` (an `IB_MTU_*` code): one per MTU-sized packet, at
/// least one. An unknown code counts one, as the simulated transport does.
pub(crate) fn psn_count(len: u64, mtu: u8) -> u32 {
    match mtu_bytes(mtu) {
        Some(size) => u32::try_from(len.div_ceil(size as u64).max(1)).unwrap_or(u32::MAX),
        None => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn_add(0xff_fffe, 3), 1);
        assert_eq!(psn_diff(1, 0xff_fffe), 3);
        assert_eq!(psn_diff(0xff_fffe, 1), -3);
        assert_eq!(check_psn(5, 5), PsnCheck::Expected);
        assert_eq!(check_psn(0xff_ffff, 0), PsnCheck::Duplicate);
        assert_eq!(check_psn(10, 5), PsnCheck::Ahead);
        assert_eq!((mtu_bytes(3), mtu_bytes(5), mtu_bytes(6)), (Some(1024), Some(4096), None));
    }

    #[test]
    fn a_3000_byte_send_at_1024_is_first_middle_last() {
        // The reference capture: 1024 B per packet, PSN +1 each, AckReq only on LAST.
        let s: Vec<Segment> = Segmenter::new(MsgKind::Send { imm: false }, false, 3000, 1024, 0xff_ffff).collect();
        assert_eq!(
            s,
            [
                Segment { opcode: Opcode::RcSendFirst, psn: 0xff_ffff, offset: 0, len: 1024, ack_req: false },
                Segment { opcode: Opcode::RcSendMiddle, psn: 0, offset: 1024, len: 1024, ack_req: false },
                Segment { opcode: Opcode::RcSendLast, psn: 1, offset: 2048, len: 952, ack_req: true },
            ]
        );
    }

    #[test]
    fn only_packets_and_immediates() {
        let one = |k, uc, len| Segmenter::new(k, uc, len, 1024, 7).collect::<Vec<_>>();
        assert_eq!(one(MsgKind::Send { imm: false }, false, 0)[0].opcode, Opcode::RcSendOnly);
        assert_eq!(one(MsgKind::Send { imm: true }, false, 1024)[0].opcode, Opcode::RcSendOnlyImm);
        assert_eq!(one(MsgKind::Write { imm: false }, true, 64)[0].opcode, Opcode::UcWriteOnly);
        let w = one(MsgKind::Write { imm: true }, false, 2048);
        assert_eq!((w[0].opcode, w[1].opcode), (Opcode::RcWriteFirst, Opcode::RcWriteLastImm));
        let r = one(MsgKind::ReadResponse, false, 4096);
        let ops: Vec<Opcode> = r.iter().map(|s| s.opcode).collect();
        assert_eq!(
            ops,
            [
                Opcode::RcReadResponseFirst,
                Opcode::RcReadResponseMiddle,
                Opcode::RcReadResponseMiddle,
                Opcode::RcReadResponseLast
            ]
        );
        // AETH on first and last response only; no AckReq on responses.
        let aeth: Vec<bool> = ops.iter().map(|o| o.headers().unwrap().aeth).collect();
        assert_eq!(aeth, [true, false, false, true]);
        assert!(r.iter().all(|s| !s.ack_req));
        assert_eq!(Segmenter::new(MsgKind::ReadResponse, false, 4097, 1024, 0).count(), 5);
    }

    #[test]
    fn reassembly_checks_order_and_lengths() {
        let mut r = Reassembly::default();
        assert_eq!(r.accept(Position::Middle, 1024, 1024), Err(()));
        assert_eq!(r.accept(Position::First, 1000, 1024), Err(()));
        assert_eq!(r.accept(Position::First, 1024, 1024), Ok(1024));
        assert!(r.in_message());
        assert_eq!(r.accept(Position::Only, 10, 1024), Err(()));
        assert_eq!(r.accept(Position::Middle, 1024, 1024), Ok(2048));
        assert_eq!(r.accept(Position::Last, 0, 1024), Err(()));
        assert_eq!(r.accept(Position::Last, 952, 1024), Ok(3000));
        assert!(!r.in_message());
        assert_eq!(r.accept(Position::Only, 0, 1024), Ok(0));
        assert_eq!(r.accept(Position::Only, 1025, 1024), Err(()));
        assert_eq!(Opcode::RcAck.position(), None);
        assert_eq!(Opcode::UdSendOnlyImm.position(), Some(Position::Only));
    }
}

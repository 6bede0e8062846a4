//! The InfiniBand transport headers RoCEv2 carries after UDP: the base transport header (BTH, 12 bytes) and the
//! extended headers an opcode implies, in wire order: DETH, XRCETH, RETH, AtomicETH, AETH, AtomicAckETH, ImmDt,
//! IETH. [`Opcode::headers`] is the table of which opcode carries which (IBA 9.2 and `rdma_rxe`'s opcode table;
//! the XRC opcodes, transport 101, are RC's operations with an XRCETH on every request, IBA 9.2 and Wireshark's
//! `packet-infiniband.c`); the reliable-datagram opcodes are not supported and parse as `Unknown(n)`.

use super::error::Error;

wire_code! {
    /// The BTH opcode: transport in the upper three bits (RC 000, UC 001, UD 011), operation in the lower five.
    pub Opcode: u8 {
        RcSendFirst = 0x00, RcSendMiddle = 0x01, RcSendLast = 0x02, RcSendLastImm = 0x03, RcSendOnly = 0x04,
        RcSendOnlyImm = 0x05, RcWriteFirst = 0x06, RcWriteMiddle = 0x07, RcWriteLast = 0x08,
        RcWriteLastImm = 0x09, RcWriteOnly = 0x0a, RcWriteOnlyImm = 0x0b, RcReadRequest = 0x0c,
        RcReadResponseFirst = 0x0d, RcReadResponseMiddle = 0x0e, RcReadResponseLast = 0x0f,
        RcReadResponseOnly = 0x10, RcAck = 0x11, RcAtomicAck = 0x12, RcCompareSwap = 0x13, RcFetchAdd = 0x14,
        RcSendLastInv = 0x16, RcSendOnlyInv = 0x17,
        UcSendFirst = 0x20, UcSendMiddle = 0x21, UcSendLast = 0x22, UcSendLastImm = 0x23, UcSendOnly = 0x24,
        UcSendOnlyImm = 0x25, UcWriteFirst = 0x26, UcWriteMiddle = 0x27, UcWriteLast = 0x28,
        UcWriteLastImm = 0x29, UcWriteOnly = 0x2a, UcWriteOnlyImm = 0x2b,
        UdSendOnly = 0x64, UdSendOnlyImm = 0x65,
        XrcSendFirst = 0xa0, XrcSendMiddle = 0xa1, XrcSendLast = 0xa2, XrcSendLastImm = 0xa3, XrcSendOnly = 0xa4,
        XrcSendOnlyImm = 0xa5, XrcWriteFirst = 0xa6, XrcWriteMiddle = 0xa7, XrcWriteLast = 0xa8,
        XrcWriteLastImm = 0xa9, XrcWriteOnly = 0xaa, XrcWriteOnlyImm = 0xab, XrcReadRequest = 0xac,
        XrcReadResponseFirst = 0xad, XrcReadResponseMiddle = 0xae, XrcReadResponseLast = 0xaf,
        XrcReadResponseOnly = 0xb0, XrcAck = 0xb1, XrcAtomicAck = 0xb2, XrcCompareSwap = 0xb3, XrcFetchAdd = 0xb4,
        XrcSendLastInv = 0xb6, XrcSendOnlyInv = 0xb7,
    }
}

/// Which extended headers follow the BTH, and whether a payload may.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Headers {
    /// Datagram ETH (UD).
    pub deth: bool,
    /// XRC ETH (every XRC request: the XRC SRQ at the target).
    pub xrceth: bool,
    /// RDMA ETH (first or only WRITE packet, READ request).
    pub reth: bool,
    /// Atomic ETH (compare-swap, fetch-add).
    pub atomic_eth: bool,
    /// ACK ETH (ACK, atomic ACK, READ response first/last/only).
    pub aeth: bool,
    /// Atomic ACK ETH.
    pub atomic_ack_eth: bool,
    /// Immediate data.
    pub immdt: bool,
    /// Invalidate ETH.
    pub ieth: bool,
    /// Whether the packet may carry a payload.
    pub payload: bool,
}

impl Headers {
    /// Bytes of the extended headers.
    pub fn len(&self) -> usize {
        let f = |b: bool, n: usize| if b { n } else { 0 };
        f(self.deth, DETH_LEN)
            + f(self.xrceth, XRCETH_LEN)
            + f(self.reth, RETH_LEN)
            + f(self.atomic_eth, ATOMIC_ETH_LEN)
            + f(self.aeth, AETH_LEN)
            + f(self.atomic_ack_eth, ATOMIC_ACK_ETH_LEN)
            + f(self.immdt, IMMDT_LEN)
            + f(self.ieth, IETH_LEN)
    }

    /// Whether there are no extended headers.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Opcode {
    /// The headers this opcode carries; `None` for an unknown opcode.
    pub fn headers(self) -> Option<Headers> {
        use Opcode::*;
        let p = Headers { payload: true, ..Headers::default() };
        let h = match self {
            RcSendFirst | RcSendMiddle | RcSendLast | RcSendOnly | UcSendFirst | UcSendMiddle | UcSendLast
            | UcSendOnly | RcWriteMiddle | RcWriteLast | UcWriteMiddle | UcWriteLast | RcReadResponseMiddle => p,
            RcSendLastImm | RcSendOnlyImm | UcSendLastImm | UcSendOnlyImm | RcWriteLastImm | UcWriteLastImm => {
                Headers { immdt: true, ..p }
            }
            RcWriteFirst | RcWriteOnly | UcWriteFirst | UcWriteOnly => Headers { reth: true, ..p },
            RcWriteOnlyImm | UcWriteOnlyImm => Headers { reth: true, immdt: true, ..p },
            RcReadRequest => Headers { reth: true, ..Headers::default() },
            RcReadResponseFirst | RcReadResponseLast | RcReadResponseOnly => Headers { aeth: true, ..p },
            RcAck => Headers { aeth: true, ..Headers::default() },
            RcAtomicAck => Headers { aeth: true, atomic_ack_eth: true, ..Headers::default() },
            RcCompareSwap | RcFetchAdd => Headers { atomic_eth: true, ..Headers::default() },
            RcSendLastInv | RcSendOnlyInv => Headers { ieth: true, ..p },
            UdSendOnly => Headers { deth: true, ..p },
            UdSendOnlyImm => Headers { deth: true, immdt: true, ..p },
            Unknown(_) => return None,
            // XRC: RC's operation of the same low five bits; its requests add the XRCETH, its responses do not.
            _ => {
                let rc = Opcode::from(u8::from(self) & OP_MASK).headers()?;
                let response = rc.aeth;
                Headers { xrceth: !response, ..rc }
            }
        };
        Some(h)
    }

    /// Whether the opcode is a known one of XRC (transport 101).
    pub fn is_xrc(self) -> bool {
        !matches!(self, Opcode::Unknown(_)) && u8::from(self) & !OP_MASK == XRC_TRANSPORT
    }
}

/// The operation bits of an opcode (the upper three are the transport).
const OP_MASK: u8 = 0x1f;
/// The transport bits of XRC.
const XRC_TRANSPORT: u8 = 0xa0;

/// The XRC SRQ number an XRCETH carries: 24 bits after a reserved byte.
const XRC_SRQN_MASK: u32 = 0xff_ffff;

/// XRC extended transport header: the XRC SRQ the target QP receives into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XrcEth {
    /// The XRC SRQ number (24 bits).
    pub xrc_srqn: u32,
}

impl XrcEth {
    /// Reads an XRCETH from the start of `b` (its reserved byte ignored).
    pub fn parse(b: &[u8]) -> Result<XrcEth, Error> {
        let b = b.get(..XRCETH_LEN).ok_or(Error::Truncated)?;
        Ok(XrcEth { xrc_srqn: be24(&b[1..4]) })
    }

    /// Writes it to the start of `b` (reserved byte zero).
    pub fn emit(&self, b: &mut [u8]) {
        b[0] = 0;
        put24(&mut b[1..4], self.xrc_srqn & XRC_SRQN_MASK);
    }
}

/// Bytes of the BTH.
pub const BTH_LEN: usize = 12;
/// Bytes of a RETH.
pub const RETH_LEN: usize = 16;
/// Bytes of an AETH.
pub const AETH_LEN: usize = 4;
/// Bytes of an AtomicETH.
pub const ATOMIC_ETH_LEN: usize = 28;
/// Bytes of an AtomicAckETH.
pub const ATOMIC_ACK_ETH_LEN: usize = 8;
/// Bytes of a DETH.
pub const DETH_LEN: usize = 8;
/// Bytes of an XRCETH.
pub const XRCETH_LEN: usize = 4;
/// Bytes of ImmDt.
pub const IMMDT_LEN: usize = 4;
/// Bytes of an IETH.
pub const IETH_LEN: usize = 4;
/// The default partition key.
pub const DEFAULT_PKEY: u16 = 0xffff;

mod bth {
    pub(super) type Field = core::ops::Range<usize>;
    pub(super) const OPCODE: usize = 0;
    pub(super) const FLAGS: usize = 1;
    pub(super) const PKEY: Field = 2..4;
    /// FECN, BECN and six reserved bits (`resv8a`, masked in the ICRC).
    pub(super) const RESV8A: usize = 4;
    pub(super) const DEST_QP: Field = 5..8;
    pub(super) const ACK_REQ: usize = 8;
    pub(super) const PSN: Field = 9..12;
}

const SE: u8 = 0x80;
const MIG: u8 = 0x40;
const PAD_SHIFT: u8 = 4;
const PAD_MASK: u8 = 0x30;
const TVER_MASK: u8 = 0x0f;
const FECN: u8 = 0x80;
const BECN: u8 = 0x40;
const ACK_REQ: u8 = 0x80;

fn be24(b: &[u8]) -> u32 {
    u32::from_be_bytes([0, b[0], b[1], b[2]])
}

fn put24(b: &mut [u8], v: u32) {
    b.copy_from_slice(&v.to_be_bytes()[1..]);
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn be64(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_be_bytes(w)
}

/// A checked view of a BTH.
#[derive(Debug, Clone, Copy)]
pub struct BthPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> BthPacket<T> {
    /// The bytes as a BTH, unchecked.
    pub fn new_unchecked(buffer: T) -> Self {
        BthPacket { buffer }
    }

    /// The bytes as a BTH, after checking the length.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        if buffer.as_ref().len() < BTH_LEN {
            return Err(Error::Truncated);
        }
        Ok(BthPacket { buffer })
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The opcode.
    pub fn opcode(&self) -> Opcode {
        Opcode::from(self.b()[bth::OPCODE])
    }

    /// Solicited event.
    pub fn solicited(&self) -> bool {
        self.b()[bth::FLAGS] & SE != 0
    }

    /// Migration state.
    pub fn migreq(&self) -> bool {
        self.b()[bth::FLAGS] & MIG != 0
    }

    /// Pad bytes after the payload (0 to 3).
    pub fn pad_count(&self) -> u8 {
        (self.b()[bth::FLAGS] & PAD_MASK) >> PAD_SHIFT
    }

    /// Transport header version (0).
    pub fn tver(&self) -> u8 {
        self.b()[bth::FLAGS] & TVER_MASK
    }

    /// Partition key.
    pub fn pkey(&self) -> u16 {
        u16::from_be_bytes([self.b()[bth::PKEY.start], self.b()[bth::PKEY.start + 1]])
    }

    /// Forward explicit congestion notification.
    pub fn fecn(&self) -> bool {
        self.b()[bth::RESV8A] & FECN != 0
    }

    /// Backward explicit congestion notification.
    pub fn becn(&self) -> bool {
        self.b()[bth::RESV8A] & BECN != 0
    }

    /// Destination QP number (24 bits).
    pub fn dest_qpn(&self) -> u32 {
        be24(&self.b()[bth::DEST_QP])
    }

    /// Acknowledge request.
    pub fn ack_req(&self) -> bool {
        self.b()[bth::ACK_REQ] & ACK_REQ != 0
    }

    /// Packet sequence number (24 bits).
    pub fn psn(&self) -> u32 {
        be24(&self.b()[bth::PSN])
    }
}

/// A BTH as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BthRepr {
    /// The opcode.
    pub opcode: Opcode,
    /// Solicited event.
    pub solicited: bool,
    /// Migration state.
    pub migreq: bool,
    /// Pad bytes after the payload.
    pub pad_count: u8,
    /// Partition key.
    pub pkey: u16,
    /// Forward ECN.
    pub fecn: bool,
    /// Backward ECN.
    pub becn: bool,
    /// Destination QP (24 bits).
    pub dest_qpn: u32,
    /// Acknowledge request.
    pub ack_req: bool,
    /// PSN (24 bits).
    pub psn: u32,
}

impl BthRepr {
    /// The values of a checked BTH; a transport version other than 0 is refused.
    pub fn parse<T: AsRef<[u8]>>(p: &BthPacket<T>) -> Result<BthRepr, Error> {
        if p.tver() != 0 {
            return Err(Error::Malformed);
        }
        Ok(BthRepr {
            opcode: p.opcode(),
            solicited: p.solicited(),
            migreq: p.migreq(),
            pad_count: p.pad_count(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qpn: p.dest_qpn(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    /// Writes the BTH into the first [`BTH_LEN`] bytes of `buf` (reserved bits zero; QPN and PSN to 24 bits).
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..BTH_LEN];
        b[bth::OPCODE] = u8::from(self.opcode);
        b[bth::FLAGS] = if self.solicited { SE } else { 0 }
            | if self.migreq { MIG } else { 0 }
            | (self.pad_count << PAD_SHIFT) & PAD_MASK;
        b[bth::PKEY].copy_from_slice(&self.pkey.to_be_bytes());
        b[bth::RESV8A] = if self.fecn { FECN } else { 0 } | if self.becn { BECN } else { 0 };
        put24(&mut b[bth::DEST_QP], self.dest_qpn & 0xff_ffff);
        b[bth::ACK_REQ] = if self.ack_req { ACK_REQ } else { 0 };
        put24(&mut b[bth::PSN], self.psn & 0xff_ffff);
    }
}

/// RDMA extended transport header: the remote buffer of a WRITE or READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Bytes of the whole message.
    pub dma_len: u32,
}

impl Reth {
    /// Reads a RETH from the start of `b`.
    pub fn parse(b: &[u8]) -> Result<Reth, Error> {
        let b = b.get(..RETH_LEN).ok_or(Error::Truncated)?;
        Ok(Reth { va: be64(&b[0..8]), rkey: be32(&b[8..12]), dma_len: be32(&b[12..16]) })
    }

    /// Writes it to the start of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..16].copy_from_slice(&self.dma_len.to_be_bytes());
    }
}

wire_code! {
    /// The code of a NAK (the AETH syndrome's low five bits when its type is NAK).
    pub NakCode: u8 { PsnSequence = 0, InvalidRequest = 1, RemoteAccess = 2, RemoteOperational = 3, InvalidRdRequest = 4, }
}

/// The AETH syndrome: bit 7 reserved, bits 6..5 the type, bits 4..0 its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syndrome {
    /// ACK with a credit count (0x1f: credits not limited, as `rdma_rxe` sends).
    Ack {
        /// The 5-bit credit code.
        credit: u8,
    },
    /// Receiver not ready, retry after the 5-bit RNR timer code.
    RnrNak {
        /// The 5-bit timer code.
        timer: u8,
    },
    /// NAK.
    Nak(NakCode),
    /// The reserved type (or bit 7 set): kept, refused by a receiver.
    Unknown(u8),
}

impl From<u8> for Syndrome {
    fn from(v: u8) -> Self {
        match v >> 5 {
            0 => Syndrome::Ack { credit: v & 0x1f },
            1 => Syndrome::RnrNak { timer: v & 0x1f },
            3 => Syndrome::Nak(NakCode::from(v & 0x1f)),
            _ => Syndrome::Unknown(v),
        }
    }
}

impl From<Syndrome> for u8 {
    fn from(s: Syndrome) -> u8 {
        match s {
            Syndrome::Ack { credit } => credit & 0x1f,
            Syndrome::RnrNak { timer } => 0x20 | timer & 0x1f,
            Syndrome::Nak(c) => 0x60 | u8::from(c) & 0x1f,
            Syndrome::Unknown(v) => v,
        }
    }
}

/// ACK extended transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aeth {
    /// What the response says.
    pub syndrome: Syndrome,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

impl Aeth {
    /// Reads an AETH from the start of `b`.
    pub fn parse(b: &[u8]) -> Result<Aeth, Error> {
        let b = b.get(..AETH_LEN).ok_or(Error::Truncated)?;
        Ok(Aeth { syndrome: Syndrome::from(b[0]), msn: be24(&b[1..4]) })
    }

    /// Writes it to the start of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0] = u8::from(self.syndrome);
        put24(&mut b[1..4], self.msn & 0xff_ffff);
    }
}

/// Atomic extended transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtomicEth {
    /// Remote virtual address (8-byte aligned).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// The swap value (compare-swap) or the addend (fetch-add).
    pub swap_add: u64,
    /// The compare value (compare-swap).
    pub compare: u64,
}

impl AtomicEth {
    /// Reads an AtomicETH from the start of `b`.
    pub fn parse(b: &[u8]) -> Result<AtomicEth, Error> {
        let b = b.get(..ATOMIC_ETH_LEN).ok_or(Error::Truncated)?;
        Ok(AtomicEth {
            va: be64(&b[0..8]),
            rkey: be32(&b[8..12]),
            swap_add: be64(&b[12..20]),
            compare: be64(&b[20..28]),
        })
    }

    /// Writes it to the start of `b`.
    pub fn emit(&self, b: &mut [u8]) {
        b[0..8].copy_from_slice(&self.va.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..20].copy_from_slice(&self.swap_add.to_be_bytes());
        b[20..28].copy_from_slice(&self.compare.to_be_bytes());
    }
}

/// Datagram extended transport header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deth {
    /// Queue key.
    pub qkey: u32,
    /// Source QP (24 bits).
    pub src_qpn: u32,
}

impl Deth {
    /// Reads a DETH from the start of `b`.
    pub fn parse(b: &[u8]) -> Result<Deth, Error> {
        let b = b.get(..DETH_LEN).ok_or(Error::Truncated)?;
        Ok(Deth { qkey: be32(&b[0..4]), src_qpn: be24(&b[5..8]) })
    }

    /// Writes it to the start of `b` (reserved byte zero).
    pub fn emit(&self, b: &mut [u8]) {
        b[0..4].copy_from_slice(&self.qkey.to_be_bytes());
        b[4] = 0;
        put24(&mut b[5..8], self.src_qpn & 0xff_ffff);
    }
}

/// The extended headers of one packet, each present when its opcode carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ext {
    /// Datagram ETH.
    pub deth: Option<Deth>,
    /// XRC ETH.
    pub xrceth: Option<XrcEth>,
    /// RDMA ETH.
    pub reth: Option<Reth>,
    /// Atomic ETH.
    pub atomic_eth: Option<AtomicEth>,
    /// ACK ETH.
    pub aeth: Option<Aeth>,
    /// Atomic ACK ETH: the original remote value.
    pub atomic_ack: Option<u64>,
    /// Immediate data, as carried.
    pub immdt: Option<[u8; 4]>,
    /// Invalidate ETH: the R_Key to invalidate.
    pub ieth: Option<u32>,
}

impl Ext {
    /// Reads the headers `h` names, in wire order, from the start of `b`.
    pub fn parse(h: Headers, b: &[u8]) -> Result<Ext, Error> {
        if b.len() < h.len() {
            return Err(Error::Truncated);
        }
        let mut at = 0;
        let mut take = |present: bool, n: usize| {
            let s = at;
            if present {
                at += n;
            }
            present.then(|| &b[s..s + n])
        };
        let deth = take(h.deth, DETH_LEN).map(Deth::parse).transpose()?;
        let xrceth = take(h.xrceth, XRCETH_LEN).map(XrcEth::parse).transpose()?;
        let reth = take(h.reth, RETH_LEN).map(Reth::parse).transpose()?;
        let atomic_eth = take(h.atomic_eth, ATOMIC_ETH_LEN).map(AtomicEth::parse).transpose()?;
        let aeth = take(h.aeth, AETH_LEN).map(Aeth::parse).transpose()?;
        let atomic_ack = take(h.atomic_ack_eth, ATOMIC_ACK_ETH_LEN).map(be64);
        let immdt = take(h.immdt, IMMDT_LEN).map(|s| [s[0], s[1], s[2], s[3]]);
        let ieth = take(h.ieth, IETH_LEN).map(be32);
        Ok(Ext { deth, xrceth, reth, atomic_eth, aeth, atomic_ack, immdt, ieth })
    }

    /// Which headers are present.
    pub fn headers(&self) -> Headers {
        Headers {
            deth: self.deth.is_some(),
            xrceth: self.xrceth.is_some(),
            reth: self.reth.is_some(),
            atomic_eth: self.atomic_eth.is_some(),
            aeth: self.aeth.is_some(),
            atomic_ack_eth: self.atomic_ack.is_some(),
            immdt: self.immdt.is_some(),
            ieth: self.ieth.is_some(),
            payload: false,
        }
    }

    /// Writes the present headers, in wire order, to the start of `b` (at least [`Headers::len`] long); returns
    /// the bytes written.
    pub fn emit(&self, b: &mut [u8]) -> usize {
        let mut at = 0;
        if let Some(d) = self.deth {
            d.emit(&mut b[at..at + DETH_LEN]);
            at += DETH_LEN;
        }
        if let Some(x) = self.xrceth {
            x.emit(&mut b[at..at + XRCETH_LEN]);
            at += XRCETH_LEN;
        }
        if let Some(r) = self.reth {
            r.emit(&mut b[at..at + RETH_LEN]);
            at += RETH_LEN;
        }
        if let Some(a) = self.atomic_eth {
            a.emit(&mut b[at..at + ATOMIC_ETH_LEN]);
            at += ATOMIC_ETH_LEN;
        }
        if let Some(a) = self.aeth {
            a.emit(&mut b[at..at + AETH_LEN]);
            at += AETH_LEN;
        }
        if let Some(v) = self.atomic_ack {
            b[at..at + ATOMIC_ACK_ETH_LEN].copy_from_slice(&v.to_be_bytes());
            at += ATOMIC_ACK_ETH_LEN;
        }
        if let Some(i) = self.immdt {
            b[at..at + IMMDT_LEN].copy_from_slice(&i);
            at += IMMDT_LEN;
        }
        if let Some(k) = self.ieth {
            b[at..at + IETH_LEN].copy_from_slice(&k.to_be_bytes());
            at += IETH_LEN;
        }
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // RC SEND ONLY, SE, pad 2, P_Key 0xffff, QP 0x000011, AckReq, PSN 0xabcdef.
    static BTH: [u8; 12] = [0x04, 0xa0, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0xab, 0xcd, 0xef];

    fn bth() -> BthRepr {
        BthRepr {
            opcode: Opcode::RcSendOnly,
            solicited: true,
            migreq: false,
            pad_count: 2,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qpn: 0x11,
            ack_req: true,
            psn: 0xabcdef,
        }
    }

    #[test]
    fn bth_fixtures_both_ways() {
        let p = BthPacket::new_checked(&BTH[..]).unwrap();
        assert_eq!(BthRepr::parse(&p).unwrap(), bth());
        let mut b = [0xeeu8; 12];
        bth().emit(&mut b);
        assert_eq!(b, BTH);
    }

    #[test]
    fn bth_checks() {
        assert_eq!(BthPacket::new_checked(&BTH[..11]).unwrap_err(), Error::Truncated);
        let mut b = BTH;
        b[1] |= 1; // TVer 1
        assert_eq!(BthRepr::parse(&BthPacket::new_unchecked(&b[..])).unwrap_err(), Error::Malformed);
        let mut b = BTH;
        b[0] = 0x40; // RD: not supported
        b[4] = 0xc0;
        let r = BthRepr::parse(&BthPacket::new_unchecked(&b[..])).unwrap();
        assert_eq!(r.opcode, Opcode::Unknown(0x40));
        assert!(r.fecn && r.becn);
        assert_eq!(r.opcode.headers(), None);
    }

    #[test]
    fn opcode_table_lengths() {
        // Header bytes after the BTH for the opcodes the RoCEv2 reference capture shows.
        let len = |o: Opcode| o.headers().unwrap().len();
        assert_eq!(len(Opcode::RcSendOnly), 0);
        assert_eq!(len(Opcode::RcWriteOnly), 16);
        assert_eq!(len(Opcode::RcWriteOnlyImm), 20);
        assert_eq!(len(Opcode::RcReadRequest), 16);
        assert_eq!(len(Opcode::RcReadResponseMiddle), 0);
        assert_eq!(len(Opcode::RcReadResponseFirst), 4);
        assert_eq!(len(Opcode::RcAck), 4);
        assert_eq!(len(Opcode::RcAtomicAck), 12);
        assert_eq!(len(Opcode::RcFetchAdd), 28);
        assert_eq!(len(Opcode::UdSendOnly), 8);
        assert_eq!(len(Opcode::UdSendOnlyImm), 12);
        assert_eq!(len(Opcode::RcSendOnlyInv), 4);
        assert!(!Opcode::RcAck.headers().unwrap().payload);
        for v in 0..=255u8 {
            assert_eq!(u8::from(Opcode::from(v)), v);
        }
    }

    #[test]
    fn aeth_syndromes() {
        assert_eq!(Syndrome::from(0x1f), Syndrome::Ack { credit: 0x1f });
        assert_eq!(Syndrome::from(0x60), Syndrome::Nak(NakCode::PsnSequence));
        assert_eq!(Syndrome::from(0x61), Syndrome::Nak(NakCode::InvalidRequest));
        assert_eq!(Syndrome::from(0x62), Syndrome::Nak(NakCode::RemoteAccess));
        assert_eq!(Syndrome::from(0x63), Syndrome::Nak(NakCode::RemoteOperational));
        assert_eq!(Syndrome::from(0x2e), Syndrome::RnrNak { timer: 14 });
        assert_eq!(Syndrome::from(0x40), Syndrome::Unknown(0x40));
        assert_eq!(Syndrome::from(0x7f), Syndrome::Nak(NakCode::Unknown(0x1f)));
        for v in 0..=255u8 {
            assert_eq!(u8::from(Syndrome::from(v)), v);
        }
    }

    // ATOMIC ACK's headers: AETH (ACK, MSN 1) then AtomicAckETH (original 0x0102030405060708).
    static ATOMIC_ACK: [u8; 12] = [0x1f, 0x00, 0x00, 0x01, 1, 2, 3, 4, 5, 6, 7, 8];

    #[test]
    fn ext_fixtures_both_ways() {
        let h = Opcode::RcAtomicAck.headers().unwrap();
        let e = Ext::parse(h, &ATOMIC_ACK).unwrap();
        let want = Ext {
            aeth: Some(Aeth { syndrome: Syndrome::Ack { credit: 0x1f }, msn: 1 }),
            atomic_ack: Some(0x0102030405060708),
            ..Ext::default()
        };
        assert_eq!(e, want);
        let mut b = [0u8; 12];
        assert_eq!(want.emit(&mut b), 12);
        assert_eq!(b, ATOMIC_ACK);
        assert_eq!(Ext::parse(h, &ATOMIC_ACK[..11]).unwrap_err(), Error::Truncated);
    }

    // WRITE ONLY with immediate: RETH (VA, R_Key, length) then ImmDt.
    static WRITE_IMM: [u8; 20] = [
        0, 0, 0x7f, 0xff, 0x12, 0x34, 0x50, 0x00, // VA
        0x00, 0x00, 0x12, 0x34, // R_Key
        0x00, 0x00, 0x00, 0x40, // DMA length 64
        0xde, 0xad, 0xbe, 0xef,
    ];

    #[test]
    fn reth_immdt_fixture() {
        let e = Ext::parse(Opcode::RcWriteOnlyImm.headers().unwrap(), &WRITE_IMM).unwrap();
        let want = Ext {
            reth: Some(Reth { va: 0x7fff_1234_5000, rkey: 0x1234, dma_len: 64 }),
            immdt: Some([0xde, 0xad, 0xbe, 0xef]),
            ..Ext::default()
        };
        assert_eq!(e, want);
        let mut b = [0u8; 20];
        want.emit(&mut b);
        assert_eq!(b, WRITE_IMM);
    }

    // FETCH_ADD's AtomicETH, and UD's DETH (Q_Key 0x11111111, source QP 0x11; reserved byte ignored on parse).
    static ATOMIC: [u8; 28] =
        [0, 0, 0, 0, 0, 0, 0x10, 0x00, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
    static DETH: [u8; 8] = [0x11, 0x11, 0x11, 0x11, 0x00, 0x00, 0x00, 0x11];

    #[test]
    fn atomic_eth_and_deth_fixtures() {
        let a = AtomicEth { va: 0x1000, rkey: 7, swap_add: 1, compare: 0 };
        assert_eq!(AtomicEth::parse(&ATOMIC).unwrap(), a);
        let mut b = [0xffu8; 28];
        a.emit(&mut b);
        assert_eq!(b, ATOMIC);
        let d = Deth { qkey: 0x1111_1111, src_qpn: 0x11 };
        assert_eq!(Deth::parse(&DETH).unwrap(), d);
        let mut b = [0xffu8; 8];
        d.emit(&mut b);
        assert_eq!(b, DETH);
        let mut resv = DETH;
        resv[4] = 0x55;
        assert_eq!(Deth::parse(&resv).unwrap(), d);
        let e = Ext::parse(Opcode::RcSendOnlyInv.headers().unwrap(), &[0, 0, 0x12, 0x34]).unwrap();
        assert_eq!(e.ieth, Some(0x1234));
    }

    // XRC WRITE ONLY with immediate: XRCETH (XRC SRQ 0x000041; reserved byte zero), RETH (VA, R_Key, length 64),
    // then ImmDt, in IBA's order.
    static XRC_WRITE_IMM: [u8; 24] = [
        0x00, 0x00, 0x00, 0x41, // XRCETH
        0, 0, 0x7f, 0xff, 0x12, 0x34, 0x50, 0x00, // VA
        0x00, 0x00, 0x12, 0x34, // R_Key
        0x00, 0x00, 0x00, 0x40, // DMA length 64
        0xde, 0xad, 0xbe, 0xef,
    ];

    #[test]
    fn xrceth_fixtures_both_ways() {
        let h = Opcode::XrcWriteOnlyImm.headers().unwrap();
        assert_eq!(h.len(), 24);
        let want = Ext {
            xrceth: Some(XrcEth { xrc_srqn: 0x41 }),
            reth: Some(Reth { va: 0x7fff_1234_5000, rkey: 0x1234, dma_len: 64 }),
            immdt: Some([0xde, 0xad, 0xbe, 0xef]),
            ..Ext::default()
        };
        assert_eq!(Ext::parse(h, &XRC_WRITE_IMM).unwrap(), want);
        let mut b = [0xffu8; 24];
        assert_eq!(want.emit(&mut b), 24);
        assert_eq!(b, XRC_WRITE_IMM);
        assert_eq!(Ext::parse(h, &XRC_WRITE_IMM[..23]).unwrap_err(), Error::Truncated);
        // The reserved byte is ignored on parse and the number kept to 24 bits on emit.
        let x = XrcEth::parse(&[0x55, 0xab, 0xcd, 0xef]).unwrap();
        assert_eq!(x, XrcEth { xrc_srqn: 0xab_cdef });
        let mut b = [0xffu8; 4];
        XrcEth { xrc_srqn: 0x1ab_cdef }.emit(&mut b);
        assert_eq!(b, [0x00, 0xab, 0xcd, 0xef]);
        assert_eq!(XrcEth::parse(&[0, 0, 0]).unwrap_err(), Error::Truncated);
        // XRC SEND ONLY: the XRCETH alone before the payload.
        let send = Opcode::from(0xa4);
        assert_eq!(send, Opcode::XrcSendOnly);
        let e = Ext::parse(send.headers().unwrap(), &[0x00, 0x00, 0x00, 0x41]).unwrap();
        assert_eq!(e, Ext { xrceth: Some(XrcEth { xrc_srqn: 0x41 }), ..Ext::default() });
    }

    #[test]
    fn xrc_opcodes_are_rcs_with_an_xrceth_on_requests() {
        // Every XRC opcode the table knows has RC's headers (same low five bits), plus the XRCETH when it is a
        // request; responses (READ response, ACK, atomic ACK) carry none.
        let mut known = 0;
        for v in 0xa0..=0xbfu8 {
            let (x, rc) = (Opcode::from(v), Opcode::from(v & 0x1f));
            assert_eq!(x.is_xrc(), !matches!(x, Opcode::Unknown(_)), "{v:#x}");
            let Some(h) = x.headers() else {
                assert_eq!(rc.headers(), None, "{v:#x}");
                continue;
            };
            known += 1;
            let r = rc.headers().unwrap();
            assert_eq!(h.xrceth, !r.aeth, "{v:#x}");
            assert_eq!(Headers { xrceth: false, ..h }, r, "{v:#x}");
        }
        assert_eq!(known, 23);
        assert_eq!(Opcode::XrcAck.headers().unwrap().len(), 4);
        assert_eq!(Opcode::XrcSendOnly.headers().unwrap().len(), 4);
        assert_eq!(Opcode::XrcFetchAdd.headers().unwrap().len(), 32);
        assert!(!Opcode::RcSendOnly.is_xrc() && !Opcode::UdSendOnly.is_xrc());
    }
}

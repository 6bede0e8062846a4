//! The packet between devices: a whole message per packet, its addresses, payload and transport body.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Bytes of a GID.
pub(crate) const GID_LEN: usize = 16;

/// Whether `lid` names one port: 0x0001-0xBFFF (IBA 4.1.3; 0 is reserved, 0xC000 up are multicast and the
/// permissive LID).
pub(crate) fn is_unicast_lid(lid: u16) -> bool {
    (1..0xc000).contains(&lid)
}

/// Entries of port 1's GID table (index 0, the default GID).
pub(crate) const GID_ENTRIES: u32 = 1;
/// The permissive LID (IBA 4.1.3): a directed-route SMP's DLID, taken by the port at the cable's other end.
pub(crate) const PERMISSIVE_LID: u16 = 0xffff;
/// Where a packet goes, as the sender's path or address vector names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dest {
    /// IB: the destination LID.
    Lid(u16),
    /// RoCE: the destination GID and MAC.
    Gid { gid: [u8; GID_LEN], mac: [u8; 6] },
}

/// The global route header a packet carries (always on RoCE, when the path asks for it on IB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grh {
    pub(crate) sgid: [u8; GID_LEN],
    pub(crate) dgid: [u8; GID_LEN],
    pub(crate) tclass: u8,
    pub(crate) flow_label: u32,
    pub(crate) hop_limit: u8,
}

/// A remote atomic operation (8 bytes, big endian in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtomicOp {
    CmpSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

/// The largest payload a packet carries inline: a cache line.
pub(crate) const INLINE_PAYLOAD: usize = 64;

/// The payload of an RC SEND or WRITE. The requester keeps the request for retries while a copy travels: a small
/// payload is copied with the packet (cheaper than an allocation and a shared count), a larger one is shared.
#[derive(Clone)]
pub(crate) enum Payload {
    Inline {
        len: u8,
        bytes: [u8; INLINE_PAYLOAD],
    },
    Shared(Arc<[u8]>),
    /// A buffer taken as it is (a large reassembled message), so it is not copied once more.
    Owned(Arc<Vec<u8>>),
}

impl Payload {
    /// The payload holding `b`: moved when it is larger than a cache line.
    pub(crate) fn from_vec(b: Vec<u8>) -> Self {
        if b.len() > INLINE_PAYLOAD {
            Payload::Owned(Arc::new(b))
        } else {
            Payload::from(&b[..])
        }
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Payload::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Payload::Shared(b) => b,
            Payload::Owned(b) => b,
        }
    }
}

impl From<&[u8]> for Payload {
    fn from(b: &[u8]) -> Self {
        if b.len() > INLINE_PAYLOAD {
            return Payload::Shared(Arc::from(b));
        }
        let mut bytes = [0u8; INLINE_PAYLOAD];
        bytes[..b.len()].copy_from_slice(b);
        // At most `INLINE_PAYLOAD` (64), so the length fits.
        Payload::Inline { len: b.len() as u8, bytes }
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Payload {}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

/// An RC request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RcOp {
    /// `inv`: a SEND with invalidate (RC only), the rkey the responder frees (the IETH).
    Send {
        data: Payload,
        imm: Option<[u8; 4]>,
        inv: Option<u32>,
    },
    Write {
        raddr: u64,
        rkey: u32,
        data: Payload,
        imm: Option<[u8; 4]>,
    },
    Read {
        raddr: u64,
        rkey: u32,
        len: u64,
    },
    Atomic {
        raddr: u64,
        rkey: u32,
        op: AtomicOp,
    },
}

/// A NAK the responder sends for a request it cannot execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nak {
    /// Bad rkey, rights or bounds: the requester completes with `REMOTE_ACCESS_ERR`.
    RemoteAccess,
    /// The request's PSN is ahead of the one the responder expects (IBA 9.7.5.2.2, "PSN sequence error"): the
    /// requester retransmits, which counts against its retry count.
    PsnSequence,
    /// A request the responder cannot accept (receive too small, misaligned atomic): `REMOTE_INVAL_REQ_ERR`.
    InvalidRequest,
    /// The responder failed locally (its receive buffer's key): `REMOTE_OP_ERR`.
    RemoteOp,
}

/// What comes back for an RC request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resp {
    Ack,
    ReadData(Vec<u8>),
    AtomicOrig(u64),
    /// Receiver not ready; retry after the RNR timer `timer` (the responder's `min_rnr_nak`).
    RnrNak {
        timer: u8,
    },
    Nak(Nak),
    /// The request reached no RC QP ready to receive it (unknown address or QP, wrong state or type, device
    /// gone). Not a packet: it stands for the requester's ACK timer starting, which the simulator knows at once.
    Lost(&'static str),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Body {
    /// An RC request; `seq` identifies the attempt, so a late response to an earlier attempt is ignored. `psn`
    /// is the requester's send PSN for the message (the same on every attempt): the responder executes a message
    /// once, at the PSN it expects, and answers a duplicate without executing it again.
    /// `xrc_srqn` is an XRC request's XRCETH: the XRC SRQ the target QP receives into.
    Rc { seq: u64, psn: u32, op: RcOp, solicited: bool, xrc_srqn: Option<u32> },
    /// A UC message (SEND or WRITE, with or without immediate): no sequence number, as nothing answers it; the
    /// responder takes the message whatever its PSN (a UC responder starts a new message at any First or Only
    /// packet) and drops it silently when it cannot execute it.
    Uc { psn: u32, op: RcOp, solicited: bool },
    /// A UD send; `pkey` is its BTH's P_Key (a GSI receive's CQE reports it).
    Ud { qkey: u32, pkey: u16, data: Vec<u8>, imm: Option<[u8; 4]>, solicited: bool },
    /// A response to the RC request `seq`.
    Resp { seq: u64, resp: Resp },
    /// A whole Ethernet frame an SQ sent (the NIC half): it crosses as it is and the receiving port steers it.
    Eth { frame: Vec<u8> },
}

/// What a RoCEv2 encoding of a packet needs beyond the message (`roce_map.rs`): the path MTU it is cut at, the
/// UDP source port, the BTH PSN of its first frame when the body has none (UD, responses) and the responder's MSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RoceInfo {
    /// The path MTU as an `IB_MTU_*` code (0: one frame per message).
    pub(crate) mtu: u8,
    /// The UDP source port (0: derived from the QPNs as Linux's `rdma_get_udp_sport` does).
    pub(crate) udp_sport: u16,
    /// A response's first PSN (an ACK names the last PSN of the request; a PSN sequence NAK the expected one);
    /// a UD send's PSN.
    pub(crate) psn: u32,
    /// The responder's message sequence number (24 bits) after the request.
    pub(crate) msn: u32,
    /// An RC request's first packet to put on the wire: a retransmission resumes at the PSN the responder NAKed
    /// (or the oldest one not acknowledged), the packets before it are not sent again; a READ is asked again
    /// from that response PSN, its RETH moved on as far. 0: the whole message.
    pub(crate) resume: u32,
    /// How many of an RC or UC SEND's or WRITE's packets from `resume` to put on the wire (the requester's
    /// window lets a long message out in parts); 0: every one to its end.
    pub(crate) count: u32,
    /// AckReq on every `ack_every`-th packet of an RC message (counted from its first), besides its last; 0: on
    /// the last only.
    pub(crate) ack_every: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Packet<D> {
    pub(crate) src: D,
    pub(crate) dst: D,
    pub(crate) src_qpn: u32,
    pub(crate) dst_qpn: u32,
    /// The sender's LID (IB) and service level.
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) grh: Option<Grh>,
    pub(crate) body: Body,
    pub(crate) roce: RoceInfo,
}

impl<D: Clone> Packet<D> {
    /// [`Packet::reply`] consuming the request: its addresses move into the response instead of being cloned.
    #[inline]
    pub(crate) fn into_reply(self, resp: Resp) -> Option<Packet<D>> {
        let Body::Rc { seq, .. } = self.body else { return None };
        let (grh, roce) = (self.grh.map(|g| g.reversed()), self.reply_info(&resp));
        Some(Packet {
            src: self.dst,
            dst: self.src,
            src_qpn: self.dst_qpn,
            dst_qpn: self.src_qpn,
            slid: 0,
            sl: 0,
            grh,
            body: Body::Resp { seq, resp },
            roce,
        })
    }

    /// The response `resp` to this packet, addressed back to its sender; `None` unless it is an RC request.
    pub(crate) fn reply(&self, resp: Resp) -> Option<Packet<D>> {
        let Body::Rc { seq, .. } = self.body else { return None };
        let roce = self.reply_info(&resp);
        Some(Packet {
            src: self.dst.clone(),
            dst: self.src.clone(),
            src_qpn: self.dst_qpn,
            dst_qpn: self.src_qpn,
            slid: 0,
            sl: 0,
            grh: self.grh.map(|g| g.reversed()),
            body: Body::Resp { seq, resp },
            roce,
        })
    }

    /// The RoCE facts of a response to this request: an ACK names the request's last PSN, everything else its
    /// first (IBA 9.7.5.1); the MSN is the responder's to fill in.
    fn reply_info(&self, resp: &Resp) -> RoceInfo {
        let Body::Rc { psn, op, .. } = &self.body else { return RoceInfo::default() };
        let last = match (resp, op) {
            (Resp::Ack, RcOp::Send { data, .. } | RcOp::Write { data, .. }) => {
                super::roce::rc::psn_count(data.len() as u64, self.roce.mtu) - 1
            }
            _ => 0,
        };
        RoceInfo {
            psn: psn.wrapping_add(last) & super::roce::rc::PSN_MASK,
            resume: 0,
            count: 0,
            ack_every: 0,
            ..self.roce
        }
    }
}

impl Grh {
    /// The GRH of a packet going back the way this one came.
    pub(crate) fn reversed(self) -> Grh {
        Grh { sgid: self.dgid, dgid: self.sgid, ..self }
    }
}

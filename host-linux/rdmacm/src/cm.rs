//! Communication management messages (IBA 12.6): REQ, MRA, REJ, REP, RTU, DREQ, DREP, SIDR_REQ and SIDR_REP in
//! the CM class (0x07, version 2, method Send), each read from and written to a 256-byte MAD. Offsets are IBA
//! 12.6's tables, counted from the end of the MAD header; a field narrower than its bytes sits in their high bits.
//! Alternate paths (LAP, APR and a REQ's alternate path) are not offered: they are written as zeros and not read.

use crate::mad::{self, be16, be32, be64, set_be16, set_be32, set_be64, MadError, MadHdr, HDR_LEN, MAD_LEN};

/// The CM class version (IBA 12.6.1, `IB_CM_CLASS_VERSION`).
pub const CLASS_VERSION: u8 = 2;

/// The CM's attribute IDs (IBA 12.6.1 table 104, `CM_*_ATTR_ID`).
pub mod attr {
    /// ClassPortInfo.
    pub const CLASS_PORT_INFO: u16 = 0x0001;
    /// Connection request.
    pub const REQ: u16 = 0x0010;
    /// Message receipt acknowledgement.
    pub const MRA: u16 = 0x0011;
    /// Reject.
    pub const REJ: u16 = 0x0012;
    /// Reply to a request.
    pub const REP: u16 = 0x0013;
    /// Ready to use.
    pub const RTU: u16 = 0x0014;
    /// Disconnect request.
    pub const DREQ: u16 = 0x0015;
    /// Disconnect reply.
    pub const DREP: u16 = 0x0016;
    /// Service ID resolution request.
    pub const SIDR_REQ: u16 = 0x0017;
    /// Service ID resolution reply.
    pub const SIDR_REP: u16 = 0x0018;
    /// Load alternate path (not offered).
    pub const LAP: u16 = 0x0019;
    /// Alternate path response (not offered).
    pub const APR: u16 = 0x001a;
}

/// Private data room of each message (IBA 12.6 tables 106-120): always carried whole on the wire.
pub mod private_len {
    /// REQ.
    pub const REQ: usize = 92;
    /// MRA.
    pub const MRA: usize = 222;
    /// REJ.
    pub const REJ: usize = 148;
    /// REP.
    pub const REP: usize = 196;
    /// RTU.
    pub const RTU: usize = 224;
    /// DREQ.
    pub const DREQ: usize = 220;
    /// DREP.
    pub const DREP: usize = 224;
    /// SIDR_REQ.
    pub const SIDR_REQ: usize = 216;
    /// SIDR_REP.
    pub const SIDR_REP: usize = 136;
}

/// Reject reasons (IBA 12.6.7.2 table 112), named as Linux's `ib_cm_rej_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejReason {
    /// `IB_CM_REJ_NO_QP` (1).
    NoQp,
    /// `IB_CM_REJ_NO_RESOURCES` (3).
    NoResources,
    /// `IB_CM_REJ_TIMEOUT` (4): the peer did not answer in time.
    Timeout,
    /// `IB_CM_REJ_UNSUPPORTED` (5).
    Unsupported,
    /// `IB_CM_REJ_INVALID_COMM_ID` (6): a message names a connection the receiver does not have.
    InvalidCommId,
    /// `IB_CM_REJ_INVALID_COMM_INSTANCE` (7).
    InvalidCommInstance,
    /// `IB_CM_REJ_INVALID_SERVICE_ID` (8): nobody listens on the service.
    InvalidServiceId,
    /// `IB_CM_REJ_INVALID_TRANSPORT_TYPE` (9).
    InvalidTransportType,
    /// `IB_CM_REJ_STALE_CONN` (10).
    StaleConn,
    /// `IB_CM_REJ_CONSUMER_DEFINED` (28): the application refused (`rdma_reject`).
    ConsumerDefined,
    /// `IB_CM_REJ_DUPLICATE_LOCAL_COMM_ID` (30).
    DuplicateLocalCommId,
    /// `IB_CM_REJ_INVALID_CLASS_VERSION` (31).
    InvalidClassVersion,
    /// Any other reason.
    Unknown(u16),
}

impl RejReason {
    /// The reason's number on the wire.
    pub fn code(self) -> u16 {
        match self {
            RejReason::NoQp => 1,
            RejReason::NoResources => 3,
            RejReason::Timeout => 4,
            RejReason::Unsupported => 5,
            RejReason::InvalidCommId => 6,
            RejReason::InvalidCommInstance => 7,
            RejReason::InvalidServiceId => 8,
            RejReason::InvalidTransportType => 9,
            RejReason::StaleConn => 10,
            RejReason::ConsumerDefined => 28,
            RejReason::DuplicateLocalCommId => 30,
            RejReason::InvalidClassVersion => 31,
            RejReason::Unknown(n) => n,
        }
    }

    /// The reason a number names.
    pub fn from_code(n: u16) -> RejReason {
        match n {
            1 => RejReason::NoQp,
            3 => RejReason::NoResources,
            4 => RejReason::Timeout,
            5 => RejReason::Unsupported,
            6 => RejReason::InvalidCommId,
            7 => RejReason::InvalidCommInstance,
            8 => RejReason::InvalidServiceId,
            9 => RejReason::InvalidTransportType,
            10 => RejReason::StaleConn,
            28 => RejReason::ConsumerDefined,
            30 => RejReason::DuplicateLocalCommId,
            31 => RejReason::InvalidClassVersion,
            n => RejReason::Unknown(n),
        }
    }
}

/// Which message a REJ or MRA answers (IBA 12.6.7, `CM_MSG_RESPONSE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgRejected {
    /// The REQ.
    Req,
    /// The REP.
    Rep,
    /// Another message (the LAP for an MRA, none for a REJ).
    Other,
}

impl MsgRejected {
    fn code(self) -> u8 {
        match self {
            MsgRejected::Req => 0,
            MsgRejected::Rep => 1,
            MsgRejected::Other => 2,
        }
    }

    fn from_code(n: u8) -> Result<MsgRejected, MadError> {
        match n {
            0 => Ok(MsgRejected::Req),
            1 => Ok(MsgRejected::Rep),
            2 => Ok(MsgRejected::Other),
            n => Err(MadError::InvalidField { what: "message rejected/MRAed", value: n.into() }),
        }
    }
}

/// The connection's path as a REQ carries it (IBA 12.6.5 table 106, the primary path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CmPath {
    /// Primary Local Port LID (the requester's; 0xffff, the permissive LID, on RoCE).
    pub local_lid: u16,
    /// Primary Remote Port LID.
    pub remote_lid: u16,
    /// Primary Local Port GID.
    pub local_gid: [u8; 16],
    /// Primary Remote Port GID.
    pub remote_gid: [u8; 16],
    /// Primary Flow Label (20 bits).
    pub flow_label: u32,
    /// Primary Packet Rate (6 bits, `ib_rate`).
    pub packet_rate: u8,
    /// Primary Traffic Class.
    pub traffic_class: u8,
    /// Primary Hop Limit.
    pub hop_limit: u8,
    /// Primary SL (4 bits).
    pub sl: u8,
    /// Primary Subnet Local.
    pub subnet_local: bool,
    /// Primary Local ACK Timeout (5 bits).
    pub local_ack_timeout: u8,
}

/// A connection request (IBA 12.6.5 table 106).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Req {
    /// Local Communication ID: the requester's name for the connection.
    pub local_comm_id: u32,
    /// ServiceID: what the passive side listens on (rdma_cm: port space and port).
    pub service_id: u64,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Local Q_Key (UD-style services only; 0 for RC).
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Responder Resources: RDMA reads and atomics the requester accepts at once.
    pub responder_resources: u8,
    /// Initiator Depth: those it sends at once.
    pub initiator_depth: u8,
    /// Remote CM Response Timeout (5 bits: 4.096 us * 2^n).
    pub remote_cm_response_timeout: u8,
    /// Transport Service Type (2 bits: 0 RC, 1 UC, 3 the extended type, 2 RD is not offered).
    pub transport_service_type: u8,
    /// End-to-End Flow Control.
    pub end_to_end_flow_control: bool,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Local CM Response Timeout (5 bits).
    pub local_cm_response_timeout: u8,
    /// Retry Count (3 bits).
    pub retry_count: u8,
    /// Partition Key.
    pub pkey: u16,
    /// Path Packet Payload MTU (4 bits, `ib_mtu`).
    pub path_mtu: u8,
    /// RDC Exists.
    pub rdc_exists: bool,
    /// RNR Retry Count (3 bits).
    pub rnr_retry_count: u8,
    /// Max CM Retries (4 bits).
    pub max_cm_retries: u8,
    /// SRQ: the requester's QP receives through a shared receive queue.
    pub srq: bool,
    /// The primary path.
    pub path: CmPath,
    /// Private data (rdma_cm puts its IP addresses and ports in the first 36 bytes).
    pub private_data: [u8; private_len::REQ],
}

/// A reply to a REQ (IBA 12.6.8 table 110).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rep {
    /// Local Communication ID: the replier's.
    pub local_comm_id: u32,
    /// Remote Communication ID: the requester's, from its REQ.
    pub remote_comm_id: u32,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Responder Resources.
    pub responder_resources: u8,
    /// Initiator Depth.
    pub initiator_depth: u8,
    /// Target ACK Delay (5 bits).
    pub target_ack_delay: u8,
    /// Failover Accepted (2 bits).
    pub failover_accepted: u8,
    /// End-to-End Flow Control.
    pub end_to_end_flow_control: bool,
    /// RNR Retry Count (3 bits).
    pub rnr_retry_count: u8,
    /// SRQ.
    pub srq: bool,
    /// Local CA GUID.
    pub local_ca_guid: u64,
    /// Private data.
    pub private_data: [u8; private_len::REP],
}

/// A reject (IBA 12.6.7 table 108).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rej {
    /// Local Communication ID: the rejecter's (0 when it kept no state).
    pub local_comm_id: u32,
    /// Remote Communication ID: the rejected side's.
    pub remote_comm_id: u32,
    /// Which message is rejected.
    pub message_rejected: MsgRejected,
    /// Rejected Info Length (7 bits, at most 72).
    pub ari_len: u8,
    /// Reason.
    pub reason: RejReason,
    /// Additional Rejection Information.
    pub ari: [u8; 72],
    /// Private data.
    pub private_data: [u8; private_len::REJ],
}

/// A message receipt acknowledgement (IBA 12.6.6 table 107): "answer coming, wait longer".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mra {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// Which message is acknowledged.
    pub message_mraed: MsgRejected,
    /// Service Timeout (5 bits).
    pub service_timeout: u8,
    /// Private data.
    pub private_data: [u8; private_len::MRA],
}

/// RTU, DREP: two communication IDs and private data (IBA 12.6.9 table 111, 12.6.11 table 113).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommIds<const N: usize> {
    /// Local Communication ID: the sender's.
    pub local_comm_id: u32,
    /// Remote Communication ID: the receiver's.
    pub remote_comm_id: u32,
    /// Private data.
    pub private_data: [u8; N],
}

/// A disconnect request (IBA 12.6.10 table 112).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dreq {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// Remote QPN/EECN (24 bits): the receiver's QP.
    pub remote_qpn: u32,
    /// Private data.
    pub private_data: [u8; private_len::DREQ],
}

/// A service ID resolution request (IBA 12.11.1 table 119): UD's "which QP serves this".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SidrReq {
    /// RequestID.
    pub request_id: u32,
    /// Partition Key.
    pub pkey: u16,
    /// ServiceID.
    pub service_id: u64,
    /// Private data.
    pub private_data: [u8; private_len::SIDR_REQ],
}

/// A service ID resolution reply (IBA 12.11.2 table 120).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SidrRep {
    /// RequestID, from the request.
    pub request_id: u32,
    /// Status (0 valid, 1 service ID not supported, 2 rejected, 3 no QP, 4 redirect, 5 class version).
    pub status: u8,
    /// Additional Information Length.
    pub ari_len: u8,
    /// QPN (24 bits).
    pub qpn: u32,
    /// ServiceID.
    pub service_id: u64,
    /// Q_Key.
    pub qkey: u32,
    /// Private data.
    pub private_data: [u8; private_len::SIDR_REP],
}

/// One CM message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)] // Every message fills a 256-byte MAD: none is much smaller.
pub enum CmMsg {
    /// REQ.
    Req(Req),
    /// MRA.
    Mra(Mra),
    /// REJ.
    Rej(Rej),
    /// REP.
    Rep(Rep),
    /// RTU.
    Rtu(CommIds<{ private_len::RTU }>),
    /// DREQ.
    Dreq(Dreq),
    /// DREP.
    Drep(CommIds<{ private_len::DREP }>),
    /// SIDR_REQ.
    SidrReq(SidrReq),
    /// SIDR_REP.
    SidrRep(SidrRep),
}

/// The high `width` bits of byte `off` of the message data, starting `from` bits below its top bit.
fn bits(d: &[u8], off: usize, from: u32, width: u32) -> u8 {
    (d[off] >> (8 - from - width)) & ((1u16 << width) - 1) as u8
}

fn set_bits(d: &mut [u8], off: usize, from: u32, width: u32, v: u8) {
    let shift = 8 - from - width;
    let mask = (((1u16 << width) - 1) as u8) << shift;
    d[off] = (d[off] & !mask) | ((v << shift) & mask);
}

/// A 24-bit field in the high bits of the 32-bit word at `off`.
fn be24(d: &[u8], off: usize) -> u32 {
    be32(d, off) >> 8
}

fn set_be24(d: &mut [u8], off: usize, v: u32) {
    let low = d[off + 3];
    set_be32(d, off, (v & 0xff_ffff) << 8 | u32::from(low));
}

fn arr<const N: usize>(d: &[u8], off: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&d[off..off + N]);
    a
}

impl CmMsg {
    /// The attribute ID that carries this message.
    pub fn attr_id(&self) -> u16 {
        match self {
            CmMsg::Req(_) => attr::REQ,
            CmMsg::Mra(_) => attr::MRA,
            CmMsg::Rej(_) => attr::REJ,
            CmMsg::Rep(_) => attr::REP,
            CmMsg::Rtu(_) => attr::RTU,
            CmMsg::Dreq(_) => attr::DREQ,
            CmMsg::Drep(_) => attr::DREP,
            CmMsg::SidrReq(_) => attr::SIDR_REQ,
            CmMsg::SidrRep(_) => attr::SIDR_REP,
        }
    }

    /// Reads a CM message from a received MAD: exactly a MAD long, the CM class at version 2, method Send, an
    /// attribute this stack speaks, and fields within their definitions. The header comes back for its `tid`.
    pub fn parse(b: &[u8]) -> Result<(MadHdr, CmMsg), MadError> {
        let h = MadHdr::parse(b)?;
        if b.len() < MAD_LEN {
            return Err(MadError::Truncated { len: b.len(), need: MAD_LEN });
        }
        if h.mgmt_class != mad::class::CM {
            return Err(MadError::UnsupportedAttribute { class: h.mgmt_class, method: h.method, attr_id: h.attr_id });
        }
        if h.class_version != CLASS_VERSION {
            return Err(MadError::BadClassVersion { class: h.mgmt_class, version: h.class_version });
        }
        let unsupported = MadError::UnsupportedAttribute { class: h.mgmt_class, method: h.method, attr_id: h.attr_id };
        if h.method != mad::method::SEND {
            return Err(unsupported);
        }
        let d = &b[HDR_LEN..];
        let msg = match h.attr_id {
            attr::REQ => {
                let tst = bits(d, 43, 5, 2);
                if tst == 2 {
                    // RD: no RDC exists here, so its REQ layout is not offered.
                    return Err(MadError::InvalidField { what: "REQ transport service type", value: tst.into() });
                }
                CmMsg::Req(Req {
                    local_comm_id: be32(d, 0),
                    service_id: be64(d, 8),
                    local_ca_guid: be64(d, 16),
                    local_qkey: be32(d, 28),
                    local_qpn: be24(d, 32),
                    responder_resources: d[35],
                    initiator_depth: d[39],
                    remote_cm_response_timeout: bits(d, 43, 0, 5),
                    transport_service_type: tst,
                    end_to_end_flow_control: bits(d, 43, 7, 1) != 0,
                    starting_psn: be24(d, 44),
                    local_cm_response_timeout: bits(d, 47, 0, 5),
                    retry_count: bits(d, 47, 5, 3),
                    pkey: be16(d, 48),
                    path_mtu: bits(d, 50, 0, 4),
                    rdc_exists: bits(d, 50, 4, 1) != 0,
                    rnr_retry_count: bits(d, 50, 5, 3),
                    max_cm_retries: bits(d, 51, 0, 4),
                    srq: bits(d, 51, 4, 1) != 0,
                    path: CmPath {
                        local_lid: be16(d, 52),
                        remote_lid: be16(d, 54),
                        local_gid: arr(d, 56),
                        remote_gid: arr(d, 72),
                        flow_label: be32(d, 88) >> 12,
                        packet_rate: bits(d, 91, 2, 6),
                        traffic_class: d[92],
                        hop_limit: d[93],
                        sl: bits(d, 94, 0, 4),
                        subnet_local: bits(d, 94, 4, 1) != 0,
                        local_ack_timeout: bits(d, 95, 0, 5),
                    },
                    private_data: arr(d, 140),
                })
            }
            attr::MRA => CmMsg::Mra(Mra {
                local_comm_id: be32(d, 0),
                remote_comm_id: be32(d, 4),
                message_mraed: MsgRejected::from_code(bits(d, 8, 0, 2))?,
                service_timeout: bits(d, 9, 0, 5),
                private_data: arr(d, 10),
            }),
            attr::REJ => {
                let ari_len = bits(d, 9, 0, 7);
                if ari_len > 72 {
                    return Err(MadError::InvalidField { what: "REJ rejected info length", value: ari_len.into() });
                }
                CmMsg::Rej(Rej {
                    local_comm_id: be32(d, 0),
                    remote_comm_id: be32(d, 4),
                    message_rejected: MsgRejected::from_code(bits(d, 8, 0, 2))?,
                    ari_len,
                    reason: RejReason::from_code(be16(d, 10)),
                    ari: arr(d, 12),
                    private_data: arr(d, 84),
                })
            }
            attr::REP => CmMsg::Rep(Rep {
                local_comm_id: be32(d, 0),
                remote_comm_id: be32(d, 4),
                local_qkey: be32(d, 8),
                local_qpn: be24(d, 12),
                starting_psn: be24(d, 20),
                responder_resources: d[24],
                initiator_depth: d[25],
                target_ack_delay: bits(d, 26, 0, 5),
                failover_accepted: bits(d, 26, 5, 2),
                end_to_end_flow_control: bits(d, 26, 7, 1) != 0,
                rnr_retry_count: bits(d, 27, 0, 3),
                srq: bits(d, 27, 3, 1) != 0,
                local_ca_guid: be64(d, 28),
                private_data: arr(d, 36),
            }),
            attr::RTU => {
                CmMsg::Rtu(CommIds { local_comm_id: be32(d, 0), remote_comm_id: be32(d, 4), private_data: arr(d, 8) })
            }
            attr::DREQ => CmMsg::Dreq(Dreq {
                local_comm_id: be32(d, 0),
                remote_comm_id: be32(d, 4),
                remote_qpn: be24(d, 8),
                private_data: arr(d, 12),
            }),
            attr::DREP => {
                CmMsg::Drep(CommIds { local_comm_id: be32(d, 0), remote_comm_id: be32(d, 4), private_data: arr(d, 8) })
            }
            attr::SIDR_REQ => CmMsg::SidrReq(SidrReq {
                request_id: be32(d, 0),
                pkey: be16(d, 4),
                service_id: be64(d, 8),
                private_data: arr(d, 16),
            }),
            attr::SIDR_REP => CmMsg::SidrRep(SidrRep {
                request_id: be32(d, 0),
                status: d[4],
                ari_len: d[5],
                qpn: be24(d, 8),
                service_id: be64(d, 12),
                qkey: be32(d, 20),
                private_data: arr(d, 96),
            }),
            _ => return Err(unsupported),
        };
        Ok((h, msg))
    }

    /// Writes the message as a CM MAD (class 0x07, version 2, method Send) of transaction `tid`.
    pub fn write(&self, tid: u64, b: &mut [u8; MAD_LEN]) {
        *b = [0u8; MAD_LEN];
        let h = MadHdr {
            base_version: mad::BASE_VERSION,
            mgmt_class: mad::class::CM,
            class_version: CLASS_VERSION,
            method: mad::method::SEND,
            tid,
            attr_id: self.attr_id(),
            ..MadHdr::default()
        };
        h.write(b);
        let d = &mut b[HDR_LEN..];
        match self {
            CmMsg::Req(r) => {
                set_be32(d, 0, r.local_comm_id);
                set_be64(d, 8, r.service_id);
                set_be64(d, 16, r.local_ca_guid);
                set_be32(d, 28, r.local_qkey);
                set_be24(d, 32, r.local_qpn);
                d[35] = r.responder_resources;
                d[39] = r.initiator_depth;
                set_bits(d, 43, 0, 5, r.remote_cm_response_timeout);
                set_bits(d, 43, 5, 2, r.transport_service_type);
                set_bits(d, 43, 7, 1, r.end_to_end_flow_control.into());
                set_be24(d, 44, r.starting_psn);
                set_bits(d, 47, 0, 5, r.local_cm_response_timeout);
                set_bits(d, 47, 5, 3, r.retry_count);
                set_be16(d, 48, r.pkey);
                set_bits(d, 50, 0, 4, r.path_mtu);
                set_bits(d, 50, 4, 1, r.rdc_exists.into());
                set_bits(d, 50, 5, 3, r.rnr_retry_count);
                set_bits(d, 51, 0, 4, r.max_cm_retries);
                set_bits(d, 51, 4, 1, r.srq.into());
                let p = &r.path;
                set_be16(d, 52, p.local_lid);
                set_be16(d, 54, p.remote_lid);
                d[56..72].copy_from_slice(&p.local_gid);
                d[72..88].copy_from_slice(&p.remote_gid);
                let rate_byte = d[91];
                set_be32(d, 88, (p.flow_label & 0xf_ffff) << 12 | u32::from(rate_byte));
                set_bits(d, 91, 2, 6, p.packet_rate);
                d[92] = p.traffic_class;
                d[93] = p.hop_limit;
                set_bits(d, 94, 0, 4, p.sl);
                set_bits(d, 94, 4, 1, p.subnet_local.into());
                set_bits(d, 95, 0, 5, p.local_ack_timeout);
                d[140..140 + private_len::REQ].copy_from_slice(&r.private_data);
            }
            CmMsg::Mra(m) => {
                set_be32(d, 0, m.local_comm_id);
                set_be32(d, 4, m.remote_comm_id);
                set_bits(d, 8, 0, 2, m.message_mraed.code());
                set_bits(d, 9, 0, 5, m.service_timeout);
                d[10..10 + private_len::MRA].copy_from_slice(&m.private_data);
            }
            CmMsg::Rej(r) => {
                set_be32(d, 0, r.local_comm_id);
                set_be32(d, 4, r.remote_comm_id);
                set_bits(d, 8, 0, 2, r.message_rejected.code());
                set_bits(d, 9, 0, 7, r.ari_len.min(72));
                set_be16(d, 10, r.reason.code());
                d[12..84].copy_from_slice(&r.ari);
                d[84..84 + private_len::REJ].copy_from_slice(&r.private_data);
            }
            CmMsg::Rep(r) => {
                set_be32(d, 0, r.local_comm_id);
                set_be32(d, 4, r.remote_comm_id);
                set_be32(d, 8, r.local_qkey);
                set_be24(d, 12, r.local_qpn);
                set_be24(d, 20, r.starting_psn);
                d[24] = r.responder_resources;
                d[25] = r.initiator_depth;
                set_bits(d, 26, 0, 5, r.target_ack_delay);
                set_bits(d, 26, 5, 2, r.failover_accepted);
                set_bits(d, 26, 7, 1, r.end_to_end_flow_control.into());
                set_bits(d, 27, 0, 3, r.rnr_retry_count);
                set_bits(d, 27, 3, 1, r.srq.into());
                set_be64(d, 28, r.local_ca_guid);
                d[36..36 + private_len::REP].copy_from_slice(&r.private_data);
            }
            CmMsg::Rtu(c) | CmMsg::Drep(c) => {
                set_be32(d, 0, c.local_comm_id);
                set_be32(d, 4, c.remote_comm_id);
                d[8..8 + private_len::RTU].copy_from_slice(&c.private_data);
            }
            CmMsg::Dreq(r) => {
                set_be32(d, 0, r.local_comm_id);
                set_be32(d, 4, r.remote_comm_id);
                set_be24(d, 8, r.remote_qpn);
                d[12..12 + private_len::DREQ].copy_from_slice(&r.private_data);
            }
            CmMsg::SidrReq(r) => {
                set_be32(d, 0, r.request_id);
                set_be16(d, 4, r.pkey);
                set_be64(d, 8, r.service_id);
                d[16..16 + private_len::SIDR_REQ].copy_from_slice(&r.private_data);
            }
            CmMsg::SidrRep(r) => {
                set_be32(d, 0, r.request_id);
                d[4] = r.status;
                d[5] = r.ari_len;
                set_be24(d, 8, r.qpn);
                set_be64(d, 12, r.service_id);
                set_be32(d, 20, r.qkey);
                d[96..96 + private_len::SIDR_REP].copy_from_slice(&r.private_data);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn req(local_comm_id: u32, service_id: u64) -> Req {
        let mut private_data = [0u8; private_len::REQ];
        private_data[..4].copy_from_slice(b"rdma");
        Req {
            local_comm_id,
            service_id,
            local_ca_guid: 0x0002_c903_0000_0001,
            local_qkey: 0,
            local_qpn: 0x12_3456,
            responder_resources: 4,
            initiator_depth: 4,
            remote_cm_response_timeout: 20,
            transport_service_type: 0,
            end_to_end_flow_control: true,
            starting_psn: 0xab_cdef,
            local_cm_response_timeout: 20,
            retry_count: 7,
            pkey: 0xffff,
            path_mtu: 5,
            rdc_exists: false,
            rnr_retry_count: 7,
            max_cm_retries: 15,
            srq: false,
            path: CmPath {
                local_lid: 0xffff,
                remote_lid: 0xffff,
                local_gid: [0xfe; 16],
                remote_gid: [0xfd; 16],
                flow_label: 0xf_1234,
                packet_rate: 0x2a,
                traffic_class: 0x10,
                hop_limit: 64,
                sl: 3,
                subnet_local: true,
                local_ack_timeout: 18,
            },
            private_data,
        }
    }

    fn round_trip(m: CmMsg) -> [u8; MAD_LEN] {
        let mut b = [0u8; MAD_LEN];
        m.write(0x77, &mut b);
        let (h, back) = CmMsg::parse(&b).unwrap();
        assert_eq!((h.tid, h.attr_id, back), (0x77, m.attr_id(), m));
        b
    }

    #[test]
    fn every_message_round_trips_and_packed_fields_land_in_their_bits() {
        let b = round_trip(CmMsg::Req(req(0x1111_2222, 0x0106_0000_0000_4e20)));
        let d = &b[HDR_LEN..];
        // Local QPN fills the top 24 bits of its word, Responder Resources the byte after.
        assert_eq!(&d[32..36], &[0x12, 0x34, 0x56, 4]);
        // Remote CM Response Timeout 20 (10100), transport RC (00), end-to-end flow control 1.
        assert_eq!(d[43], 0b1010_0001);
        // Flow label 0xf1234 in the top 20 bits, packet rate 0x2a in the low 6 of byte 91.
        assert_eq!(&d[88..92], &[0xf1, 0x23, 0x40, 0x2a]);
        let rep = Rep {
            local_comm_id: 5,
            remote_comm_id: 0x1111_2222,
            local_qkey: 0,
            local_qpn: 0x65_4321,
            starting_psn: 0x12_3456,
            responder_resources: 1,
            initiator_depth: 2,
            target_ack_delay: 15,
            failover_accepted: 0,
            end_to_end_flow_control: true,
            rnr_retry_count: 7,
            srq: true,
            local_ca_guid: 9,
            private_data: [3; private_len::REP],
        };
        round_trip(CmMsg::Rep(rep));
        round_trip(CmMsg::Rtu(CommIds { local_comm_id: 1, remote_comm_id: 5, private_data: [1; private_len::RTU] }));
        round_trip(CmMsg::Drep(CommIds { local_comm_id: 5, remote_comm_id: 1, private_data: [0; private_len::DREP] }));
        round_trip(CmMsg::Dreq(Dreq { local_comm_id: 1, remote_comm_id: 5, remote_qpn: 77, private_data: [2; 220] }));
        let rej = Rej {
            local_comm_id: 0,
            remote_comm_id: 1,
            message_rejected: MsgRejected::Req,
            ari_len: 0,
            reason: RejReason::InvalidServiceId,
            ari: [0; 72],
            private_data: [0; private_len::REJ],
        };
        let b = round_trip(CmMsg::Rej(rej));
        assert_eq!(&b[HDR_LEN + 10..HDR_LEN + 12], &[0, 8], "reason 8: invalid service ID");
        let mra = Mra {
            local_comm_id: 5,
            remote_comm_id: 1,
            message_mraed: MsgRejected::Rep,
            service_timeout: 31,
            private_data: [0; private_len::MRA],
        };
        round_trip(CmMsg::Mra(mra));
        let sreq = SidrReq { request_id: 9, pkey: 0xffff, service_id: 0x0111_0000_0000_0001, private_data: [4; 216] };
        round_trip(CmMsg::SidrReq(sreq));
        let srep = SidrRep {
            request_id: 9,
            status: 0,
            ari_len: 0,
            qpn: 0x44,
            service_id: sreq.service_id,
            qkey: 0x1234_5678,
            private_data: [5; private_len::SIDR_REP],
        };
        round_trip(CmMsg::SidrRep(srep));
    }

    #[test]
    fn malformed_cm_mads_are_refused_with_the_status_they_earn() {
        let mut good = [0u8; MAD_LEN];
        CmMsg::Req(req(1, 2)).write(1, &mut good);
        // Truncated anywhere: header or body.
        for len in [0, 10, HDR_LEN, 100, MAD_LEN - 1] {
            assert!(matches!(CmMsg::parse(&good[..len]), Err(MadError::Truncated { .. })), "{len}");
        }
        let mut b = good;
        b[2] = 1;
        let e = CmMsg::parse(&b).unwrap_err();
        assert_eq!((e, e.status()), (MadError::BadClassVersion { class: 7, version: 1 }, mad::status::BAD_VERSION));
        let mut b = good;
        b[3] = mad::method::GET;
        assert_eq!(CmMsg::parse(&b).unwrap_err().status(), mad::status::UNSUPPORTED_METHOD_ATTRIB);
        let mut b = good;
        b[17] = 0x19; // LAP: not offered.
        assert!(matches!(CmMsg::parse(&b), Err(MadError::UnsupportedAttribute { attr_id: attr::LAP, .. })));
        let mut b = good;
        b[1] = mad::class::PERF_MGMT;
        assert!(matches!(CmMsg::parse(&b), Err(MadError::UnsupportedAttribute { class: 4, .. })));
        // A REQ for the reliable datagram service.
        let mut b = good;
        b[HDR_LEN + 43] = (b[HDR_LEN + 43] & !0b110) | 0b100;
        assert!(matches!(CmMsg::parse(&b), Err(MadError::InvalidField { what: "REQ transport service type", .. })));
        // A REJ whose info length overruns the ARI field, and one rejecting message type 3.
        let mut rej = [0u8; MAD_LEN];
        let r = Rej {
            local_comm_id: 0,
            remote_comm_id: 1,
            message_rejected: MsgRejected::Rep,
            ari_len: 0,
            reason: RejReason::Timeout,
            ari: [0; 72],
            private_data: [0; private_len::REJ],
        };
        CmMsg::Rej(r).write(3, &mut rej);
        let mut b = rej;
        b[HDR_LEN + 9] = 73 << 1;
        assert!(matches!(CmMsg::parse(&b), Err(MadError::InvalidField { value: 73, .. })));
        let mut b = rej;
        b[HDR_LEN + 8] = 0b11 << 6;
        assert!(matches!(CmMsg::parse(&b), Err(MadError::InvalidField { value: 3, .. })));
        // Reasons this stack does not name survive as numbers.
        assert_eq!(RejReason::from_code(999), RejReason::Unknown(999));
        assert_eq!(RejReason::from_code(RejReason::ConsumerDefined.code()), RejReason::ConsumerDefined);
    }
}

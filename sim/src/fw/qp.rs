//! Datapath side: `transport/` (`mod.rs` the engine, `wqe.rs`, `requester.rs`, `responder.rs`, `uc.rs`, `ud.rs`,
//! `flush.rs`, `roce_rx.rs`), `uar.rs` (the send doorbell and BlueFlame copies).
//!
//! Queue pairs on the device side: [`QpTable`] with CREATE/DESTROY/QUERY_QP and the state-machine commands
//! (RST2INIT, INIT2INIT, INIT2RTR, RTR2RTS, RTS2RTS, 2ERR, 2RST) with firmware-style checks over the narrow [`QpFw`] view, and
//! the context each transition stores (the kernel's `qp.c` from the device side). The QP also holds the state
//! the transport keeps per QP (counters, the outstanding RC request).
//!
//! Buffer layout (as mlx5_ib lays out a kernel QP): the RQ at byte 0 (`1 << log_rq_size` WQEs of
//! `16 << log_rq_stride` bytes), the SQ right after it (`1 << log_sq_size` basic blocks of
//! `MLX5_SEND_WQE_BB` bytes), the whole buffer described by `pas[]` in pages of `4 KiB << log_page_size`. The
//! doorbell record at `dbr_addr` holds the RQ head (`MLX5_RCV_DBR`) and the SQ producer counter (`MLX5_SND_DBR`).
//!
//! Transitions store what mlx5_ib sends with them. Required fields: RST2INIT the port (must be 1), the pkey
//! index, the remote access rights (RC) or the qkey (UD); INIT2RTR (RC) the MTU, `log_msg_max`, the remote QPN,
//! `next_rcv_psn`, `log_rra_max`, `min_rnr_nak` and the primary path (IB: `rlid`, `sl`, optional GRH; RoCE:
//! `grh` with `rgid_rip`, `hop_limit`, `src_addr_index`, `rmac`, `udp_sport`); RTR2RTS (RC) `next_send_psn`,
//! `retry_count`, `rnr_retry`, `log_sra_max` and the path's `ack_timeout` (UD: `next_send_psn`); a UD INIT2RTR
//! needs an MTU (mlx5_ib sends `IB_MTU_4096` with every UD modify). Optional
//! parameters (`opt_param_mask`, `MLX5_QP_OPTPAR_*`) are honoured where mlx5_ib sends them: access rights, pkey
//! index, qkey, `min_rnr_nak`, the primary path, the ACK timeout and the retry counts. INIT2INIT changes only
//! what its options name (mlx5_ib's INIT→INIT column: access rights, pkey index, qkey, the port).

use std::collections::{BTreeSet, VecDeque};
use std::ops::{Deref, DerefMut};

use mlx5_core::prm::{consts, ifc, CmdStatus, Field, MsgBuf, Sub};

use super::caps::Caps;
use super::eq::EqPost;
use super::ids::{alloc_id, IdSet};
use super::pas::{check_pas, read_paged};
use super::port::GID_ENTRIES;
use super::reply::{bad_param, err, rd, rd8, CmdErr};
use super::syndrome;
use crate::config::PortType;
use crate::dma::{DmaFault, DmaSpace};
use crate::events::RetryKind;
use crate::small::{IdMap, Small};
use crate::wire::RcOp;

/// The first QPN handed out (lower numbers are special QPs on real hardware).
const QPN_FIRST: u32 = 0x100;
/// QPNs are 24 bits.
const QPN_END: u32 = 1 << 24;
/// An RQ WQE is `16 << log_rq_stride` bytes (`qp->rq.wqe_shift - 4`).
const RQ_STRIDE_SHIFT: u32 = 4;
/// Send WQE basic block.
pub(crate) const SEND_WQE_BB: u64 = consts::MLX5_SEND_WQE_BB as u64;
const ADAPTER_PAGE_SHIFT: u32 = consts::MLX5_ADAPTER_PAGE_SHIFT;
/// `qpc.page_offset` counts 1/64ths of a page (the `scale` mlx5_ib quantizes with).
const PAGE_OFFSET_QUANTA: u32 = 64;
/// The only port.
const PORT: u32 = 1;
/// The doorbell record: RQ head then SQ producer counter, one be32 each.
const DBR_BYTES: usize = 8;
/// The primary address path (`struct mlx5_ifc_ads_bits`).
const PATH_BYTES: usize = ifc::ads::SIZE_BYTES;
/// PSNs are 24 bits.
pub(crate) const PSN_MASK: u32 = 0xff_ffff;

/// State of a QP (`MLX5_QP_STATE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QpState {
    #[default]
    Rst,
    Init,
    Rtr,
    Rts,
    Err,
}

impl QpState {
    /// The `qpc.state` encoding.
    pub fn raw(self) -> u8 {
        match self {
            QpState::Rst => consts::MLX5_QP_STATE_RST,
            QpState::Init => consts::MLX5_QP_STATE_INIT,
            QpState::Rtr => consts::MLX5_QP_STATE_RTR,
            QpState::Rts => consts::MLX5_QP_STATE_RTS,
            QpState::Err => consts::MLX5_QP_STATE_ERR,
        }
    }
}

/// Transport service of a QP (`qpc.st`); the simulator models RC, UC and UD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
}

impl QpType {
    pub fn raw(self) -> u32 {
        match self {
            QpType::Rc => consts::MLX5_QP_ST_RC,
            QpType::Uc => consts::MLX5_QP_ST_UC,
            QpType::Ud => consts::MLX5_QP_ST_UD,
        }
    }
}

/// A QP of a special transport service that firmware handles as a datagram QP (`qpc.st` QP0, QP1 or REG_UMR):
/// Linux's mlx5_ib creates the SMI (QP0) and hardware GSI (QP1) QPs of an InfiniBand port when it registers, and
/// its UMR QP on the first user memory registration, and modifies all three as it modifies UD QPs (an MTU, a
/// port, a Q_Key). The datapath treats them as UD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialQp {
    Qp0,
    Qp1,
    RegUmr,
}

impl SpecialQp {
    /// The QPN the port's SMI and GSI QPs answer to and send as on the wire (IBA 3.5.4), whatever their QPNs in
    /// the device.
    pub fn wire_qpn(self) -> Option<u32> {
        match self {
            SpecialQp::Qp0 => Some(0),
            SpecialQp::Qp1 => Some(1),
            SpecialQp::RegUmr => None,
        }
    }

    /// The special QP that wire QPN `qpn` names, if any.
    pub fn of_wire_qpn(qpn: u32) -> Option<Self> {
        match qpn {
            0 => Some(SpecialQp::Qp0),
            1 => Some(SpecialQp::Qp1),
            _ => None,
        }
    }

    pub fn raw(self) -> u32 {
        match self {
            SpecialQp::Qp0 => consts::MLX5_QP_ST_QP0,
            SpecialQp::Qp1 => consts::MLX5_QP_ST_QP1,
            SpecialQp::RegUmr => consts::MLX5_QP_ST_REG_UMR,
        }
    }
}

/// The state of one QP, as [`crate::sim_device::SimDevice::qp_info`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    pub qpn: u32,
    pub state: QpState,
    pub st: QpType,
    /// The special service `qpc.st` named, when it is one (`st` is then [`QpType::Ud`]).
    pub special: Option<SpecialQp>,
    pub pd: u32,
    pub uar: u32,
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    /// SQ size in basic blocks (0 without an SQ).
    pub sq_wqebbs: u32,
    /// RQ size in WQEs (0 with a zero-length RQ) and the bytes per RQ WQE.
    pub rq_wqes: u32,
    pub rq_stride: u32,
    /// The device's SQ consumer counter (basic blocks, wrapping 16 bits): every WQE before it is done.
    pub sq_ci: u16,
    /// The SQ producer counter read at the last accepted doorbell.
    pub sq_pi: u16,
    /// The device's RQ consumer counter (WQEs, wrapping 16 bits).
    pub rq_ci: u16,
    pub remote_qpn: u32,
    pub next_send_psn: u32,
    pub next_rcv_psn: u32,
    pub q_key: u32,
    pub min_rnr_nak: u8,
    pub retry_count: u8,
    pub rnr_retry: u8,
    pub ack_timeout: u8,
    /// Remote read, write and atomic enabled (`rre`, `rwe`, `rae`).
    pub remote_access: (bool, bool, bool),
    /// The completion syndrome that moved the QP to ERR (`MLX5_CQE_SYNDROME_*`); `None` when it went there by
    /// command or is not in error.
    pub error: Option<u8>,
    /// A send WQE is outstanding (RC: waiting for its response or for a retry).
    pub outstanding: bool,
    /// RC messages sent and not yet acknowledged (at most 16).
    pub in_flight: u32,
}

/// The primary address path, as the image the driver wrote (`ads`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Path(pub(crate) [u8; PATH_BYTES]);

impl Default for Path {
    fn default() -> Self {
        Self([0; PATH_BYTES])
    }
}

impl Path {
    fn from_ctx(inp: &[u8], qpc: Sub) -> Self {
        let s = ifc::qpc::PRIMARY_ADDRESS_PATH.at(qpc);
        let mut p = [0u8; PATH_BYTES];
        p.copy_from_slice(&inp[s.off..s.off + s.len]);
        Self(p)
    }

    fn get(&self, f: Field) -> u32 {
        MsgBuf::get(&self.0[..], f)
    }

    fn put(&mut self, f: Field, v: u32) {
        self.0[..].set(f, v);
    }

    pub(crate) fn grh(&self) -> bool {
        self.get(ifc::ads::GRH) != 0
    }
    pub(crate) fn rlid(&self) -> u16 {
        self.get(ifc::ads::RLID) as u16
    }
    pub(crate) fn sl(&self) -> u8 {
        self.get(ifc::ads::SL) as u8
    }
    pub(crate) fn hop_limit(&self) -> u8 {
        self.get(ifc::ads::HOP_LIMIT) as u8
    }
    pub(crate) fn tclass(&self) -> u8 {
        self.get(ifc::ads::TCLASS) as u8
    }
    pub(crate) fn flow_label(&self) -> u32 {
        self.get(ifc::ads::FLOW_LABEL)
    }
    pub(crate) fn src_addr_index(&self) -> u32 {
        self.get(ifc::ads::SRC_ADDR_INDEX)
    }
    pub(crate) fn ack_timeout(&self) -> u8 {
        self.get(ifc::ads::ACK_TIMEOUT) as u8
    }
    pub(crate) fn udp_sport(&self) -> u16 {
        self.get(ifc::ads::UDP_SPORT) as u16
    }
    fn port(&self) -> u32 {
        self.get(ifc::ads::VHCA_PORT_NUM)
    }
    fn pkey_index(&self) -> u32 {
        self.get(ifc::ads::PKEY_INDEX)
    }
    pub(crate) fn rgid(&self) -> [u8; 16] {
        let off = ifc::ads::RGID_RIP.byte_off();
        let mut g = [0u8; 16];
        g.copy_from_slice(&self.0[off..off + 16]);
        g
    }
    pub(crate) fn rmac(&self) -> [u8; 6] {
        let hi = (self.get(ifc::ads::RMAC_47_32) as u16).to_be_bytes();
        let lo = self.get(ifc::ads::RMAC_31_0).to_be_bytes();
        [hi[0], hi[1], lo[0], lo[1], lo[2], lo[3]]
    }
}

/// The fields of the primary path the datapath reads for every RC request, decoded from the image once per
/// command that changes it rather than bit by bit per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PathFields {
    pub(crate) grh: bool,
    pub(crate) rlid: u16,
    pub(crate) sl: u8,
    pub(crate) hop_limit: u8,
    pub(crate) tclass: u8,
    pub(crate) flow_label: u32,
    pub(crate) src_addr_index: u32,
    pub(crate) ack_timeout: u8,
    pub(crate) rgid: [u8; 16],
    pub(crate) rmac: [u8; 6],
    /// The RoCEv2 UDP source port (mlx5_ib: `rdma_get_udp_sport`; 0 when the driver left it).
    pub(crate) udp_sport: u16,
    /// The index of the P_Key the QP's packets carry in their BTH (the port's table).
    pub(crate) pkey_index: u16,
}

impl Path {
    fn fields(&self) -> PathFields {
        PathFields {
            grh: self.grh(),
            rlid: self.rlid(),
            sl: self.sl(),
            hop_limit: self.hop_limit(),
            tclass: self.tclass(),
            flow_label: self.flow_label(),
            src_addr_index: self.src_addr_index(),
            ack_timeout: self.ack_timeout(),
            pkey_index: self.pkey_index() as u16,
            rgid: self.rgid(),
            rmac: self.rmac(),
            udp_sport: self.udp_sport(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The requester's state the transport keeps in each QP (defined with the QP, which owns it).

/// A scatter/gather entry of a data segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Sge {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkey: u32,
}

/// The scatter list of a receive WQE.
pub(crate) type Sges = Small<Sge, 2>;

/// What a send WQE's completion needs of it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WqeId {
    /// The WQE's index (its first basic block, the device's consumer counter).
    pub(crate) index: u16,
    pub(crate) nbb: u16,
    pub(crate) opcode: u8,
    pub(crate) signaled: bool,
}

/// Where an outstanding RC request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The request went on the wire at `sent_ns` (device time); its response (or loss) is coming, or the ACK
    /// timer runs out.
    InFlight { sent_ns: u64 },
    /// Waiting to retry at `at_ns` (device time).
    Wait { at_ns: u64, kind: RetryKind },
}

/// The most RC messages a QP has sent and not yet seen acknowledged. Each keeps its payload for a
/// retransmission, so the window is counted in messages (and bytes, [`MAX_IN_FLIGHT_BYTES`]) rather than PSNs:
/// what bounds it is the memory held, not the 2^23 PSNs the sequence space allows.
pub(crate) const MAX_IN_FLIGHT: usize = 16;
/// Atomic results a responder keeps for duplicates: as many as a requester of this simulator has in flight (a
/// ConnectX keeps `rra_max`).
pub(crate) const ATOMIC_REPLAY: usize = MAX_IN_FLIGHT;
/// A message joins a non-empty window only while the messages in it hold less than this many bytes.
pub(crate) const MAX_IN_FLIGHT_BYTES: u64 = 1 << 20;
/// The most request packets (frames) a QP has on a link and not yet acknowledged, over all its messages: a
/// message of any size goes out this many packets ahead of the responder's ACKs, so what waits on a link stays
/// bounded and the ACK timer sees progress while the link carries the message (a ConnectX keeps a bounded number
/// of packets in flight too). Messages that cross as one packet (loopback, InfiniBand ports) are not cut.
pub(crate) const MAX_PACKETS_IN_FLIGHT: u32 = 1024;
/// AckReq comes every `1 << log_ack_req_freq` packets of a message, at most every this many (log2), so several
/// ACKs come back per window whatever the context asks.
pub(crate) const LOG_ACK_REQ_MAX: u8 = MAX_PACKETS_IN_FLIGHT.trailing_zeros() as u8 - 2;

/// An RC send WQE between its request and its response.
#[derive(Debug, Clone)]
pub(crate) struct Outstanding {
    pub(crate) wqe: WqeId,
    /// The message's first PSN.
    pub(crate) psn: u32,
    pub(crate) solicited: bool,
    /// Where a READ's data or an atomic's original value lands (empty for SEND and WRITE).
    pub(crate) sges: Sges,
    pub(crate) op: RcOp,
    pub(crate) len: u64,
    pub(crate) seq: u64,
    pub(crate) phase: Phase,
    pub(crate) transport_left: u8,
    pub(crate) rnr_left: u8,
    /// Packets of the message the responder has (acknowledged, or implied by a sequence NAK naming a later
    /// PSN) or, for a READ, response packets taken: a retransmission starts after them (RoCE only).
    pub(crate) resume: u32,
    /// Request packets of this attempt put on the wire (the next one to send is the later of this and
    /// `resume`): the window ([`MAX_PACKETS_IN_FLIGHT`]) lets the rest out as ACKs come.
    pub(crate) sent: u32,
    /// The message went as one packet (to this device, on InfiniBand, or lost): it counts one in the window.
    pub(crate) whole: bool,
    /// An XRC initiator's request: the XRC SRQ at the target (the XRCETH every attempt carries).
    pub(crate) xrc_srqn: Option<u32>,
}

impl Outstanding {
    /// Payload bytes the request keeps for a retransmission (a READ or an atomic keeps none).
    pub(crate) fn len_held(&self) -> u64 {
        match self.op {
            RcOp::Send { .. } | RcOp::Write { .. } => self.len,
            RcOp::Read { .. } | RcOp::Atomic { .. } => 0,
        }
    }

    /// Request packets the message takes at path MTU `mtu` (a READ or an atomic is one request packet).
    pub(crate) fn packets(&self, mtu: u8) -> u32 {
        match (&self.op, mtu) {
            // `psn_count` with a shift for the division: the MTUs (`IB_MTU_256` 1 to `IB_MTU_4096` 5) are
            // `128 << mtu` bytes. The datapath asks this for every message it sends.
            (RcOp::Send { .. } | RcOp::Write { .. }, 1..=5) => {
                let shift = 7 + u32::from(mtu);
                let n = self.len.saturating_add((1 << shift) - 1) >> shift;
                u32::try_from(n.max(1)).unwrap_or(u32::MAX)
            }
            _ => 1,
        }
    }

    /// Request packets the responder has confirmed: a READ's `resume` counts its response packets instead.
    pub(crate) fn acked(&self) -> u32 {
        match self.op {
            RcOp::Send { .. } | RcOp::Write { .. } => self.resume,
            RcOp::Read { .. } | RcOp::Atomic { .. } => 0,
        }
    }

    /// Packets of this attempt on the wire and not acknowledged.
    pub(crate) fn unacked(&self) -> u32 {
        if self.whole {
            return u32::from(self.sent > 0);
        }
        self.sent.saturating_sub(self.acked())
    }
}

/// A queue pair.
#[derive(Debug)]
pub(crate) struct Qp {
    pub(crate) qpn: u32,
    pub(crate) st: QpType,
    pub(crate) special: Option<SpecialQp>,
    pub(crate) state: QpState,
    pub(crate) pd: u32,
    pub(crate) uar: u32,
    pub(crate) cqn_snd: u32,
    pub(crate) cqn_rcv: u32,
    pub(crate) dbr: u64,
    /// Where the WQ buffer starts in the first page (`qpc.page_offset`, in quanta of 1/64 page): user buffers
    /// need not start on a page.
    buf_off: u64,
    /// Bus addresses of the buffer pages, `1 << page_shift` bytes each.
    pas: Vec<u64>,
    page_shift: u32,
    log_rq_size: u32,
    log_rq_stride: u32,
    has_rq: bool,
    log_sq_size: u32,
    has_sq: bool,
    // Context the transitions set.
    path: Path,
    /// `path` decoded; every change of `path` updates it.
    pub(crate) route: PathFields,
    pub(crate) mtu: u8,
    log_msg_max: u32,
    pub(crate) remote_qpn: u32,
    pub(crate) next_rcv_psn: u32,
    pub(crate) next_send_psn: u32,
    /// The responder's message sequence number: messages executed (IBA 9.7.6.1.1), 24 bits.
    pub(crate) msn: u32,
    log_rra_max: u32,
    log_sra_max: u32,
    pub(crate) min_rnr_nak: u8,
    pub(crate) retry_count: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) rre: bool,
    pub(crate) rwe: bool,
    pub(crate) rae: bool,
    pub(crate) q_key: u32,
    // Datapath.
    pub(crate) sq_ci: u16,
    /// The next send WQE to execute: the RC WQEs between `sq_ci` and here are in `reqs`, sent and not yet
    /// completed.
    pub(crate) sq_next: u16,
    pub(crate) sq_pi: u16,
    pub(crate) rq_ci: u16,
    /// RC requests sent and not yet completed, oldest first (at most [`MAX_IN_FLIGHT`]).
    pub(crate) reqs: VecDeque<Outstanding>,
    /// A retransmission after a PSN sequence NAK is under way and nothing was acknowledged since: further
    /// sequence NAKs in frames (the responder's answers to packets sent before it went back, which name no
    /// attempt) start no other one. A packet's response names its attempt, so a stale one is simply unmatched.
    pub(crate) retrying: bool,
    /// Some request in `reqs` has packets the window held back: the datapath sends them as ACKs free room.
    pub(crate) window_blocked: bool,
    /// `qpc.log_ack_req_freq` (RTR2RTS): the requester asks for an ACK every `1 << it` packets of a message
    /// (mlx5_ib writes 8), and on each message's last packet.
    pub(crate) log_ack_req_freq: u8,
    /// The PSNs and original values of the last atomics executed as a responder (at most
    /// [`ATOMIC_REPLAY`]), oldest first: a duplicate of one is answered with the value it returned.
    pub(crate) atomic_results: VecDeque<(u32, u64)>,
    /// COMM_EST was posted since the QP last entered RTR.
    pub(crate) comm_est: bool,
    pub(crate) error: Option<u8>,
    /// The Q counter set RST2INIT named (0: none).
    pub(crate) counter_set_id: u8,
    /// The largest send WQE (`max_wqe_sz_sq`) and message (`1 << log_max_msg`) the device executes, read from the
    /// capabilities once here rather than per WQE: they are fixed once the HCA is initialized, before any QP.
    pub(crate) max_wqe: usize,
    pub(crate) max_msg: u64,
    /// The SRQ the QP receives through (`rq_type` SRQ); it then has no RQ of its own.
    pub(crate) srqn: Option<u32>,
    /// An XRC QP (`st` XRC) and its domain: the RC transport, whose sends carry the XRC SRQ their WQE's
    /// `mlx5_wqe_xrc_seg` names (an initiator) and whose receives go into the XRC SRQ of this domain a request's
    /// XRCETH names (a target, which mlx5_ib creates with `no_sq`); never through `srqn`.
    pub(crate) xrcd: Option<u32>,
    /// The XRC SRQ the request an XRC target executes now receives into (checked against `xrcd`).
    pub(crate) xrc_rx: Option<u32>,
    /// `qpc.user_index`: what the QP's CQEs carry in `srqn_uidx` (CQE version 1), unless it is
    /// `MLX5_IB_DEFAULT_UIDX`, which asks for version 0 (the SRQ number of a receive through an SRQ, else 0).
    user_index: u32,
    /// The LAST_WQE_REACHED event went out for the QP's current stay in ERR.
    pub(crate) last_wqe_sent: bool,
}

impl Qp {
    /// The `srqn_uidx` of the QP's CQEs: its user index, or in CQE version 0 `legacy` (the SRQ a receive took its
    /// WQE from, 0 for a send). rdma-core's mlx5 provider finds the QP of a version 1 CQE by this index alone
    /// (found with rdma-core's tests under UML: a context whose SRQ took index 0 lost its receives).
    pub(crate) fn cqe_srqn_uidx(&self, legacy: u32) -> u32 {
        if self.user_index == consts::MLX5_IB_DEFAULT_UIDX {
            legacy
        } else {
            self.user_index
        }
    }

    /// The SRQ a receive takes its WQE from: the QP's SRQ, or an XRC target's for the request it executes.
    pub(crate) fn recv_srq(&self) -> Option<u32> {
        self.srqn.or(self.xrc_rx)
    }

    /// READs and atomics the QP may have in flight as a requester: `1 << log_sra_max`, at least one, within the
    /// window.
    pub(crate) fn sra_limit(&self) -> usize {
        (1usize << self.log_sra_max.min(MAX_IN_FLIGHT.trailing_zeros())).min(MAX_IN_FLIGHT)
    }

    pub(crate) fn rq_wqes(&self) -> u32 {
        if self.has_rq {
            1 << self.log_rq_size
        } else {
            0
        }
    }

    pub(crate) fn rq_stride(&self) -> u64 {
        1u64 << (self.log_rq_stride + RQ_STRIDE_SHIFT)
    }

    fn rq_bytes(&self) -> u64 {
        u64::from(self.rq_wqes()) * self.rq_stride()
    }

    pub(crate) fn sq_bbs(&self) -> u32 {
        if self.has_sq {
            1 << self.log_sq_size
        } else {
            0
        }
    }

    fn sq_bytes(&self) -> u64 {
        u64::from(self.sq_bbs()) * SEND_WQE_BB
    }

    /// Reads `out.len()` bytes at byte `off` of the buffer, page by page through `pas[]`.
    fn read_buf(&self, dma: &mut DmaSpace, off: u64, out: &mut [u8]) -> Result<(), DmaFault> {
        read_paged(dma, &self.pas, self.page_shift, self.buf_off + off, out)
    }

    /// Reads from the SQ ring at byte `off` (taken modulo the SQ size), wrapping from the end to the start.
    pub(crate) fn read_sq(&self, dma: &mut DmaSpace, off: u64, out: &mut [u8]) -> Result<(), DmaFault> {
        let size = self.sq_bytes();
        if size == 0 {
            return Err(DmaFault { iova: 0, len: out.len(), write: false });
        }
        let mut done = 0usize;
        while done < out.len() {
            let at = (off + done as u64) % size;
            let n = ((size - at) as usize).min(out.len() - done);
            self.read_buf(dma, self.rq_bytes() + at, &mut out[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Reads the basic block `index` of the SQ (taken modulo the SQ size) into `bb` with one fixed-size copy, when
    /// it lies in one page (it does unless the RQ before it ends off a basic-block boundary) and is mapped. Records
    /// no fault: on `false` the caller reads as [`Qp::read_sq`] does, and that records what failed.
    pub(crate) fn try_read_sq_bb(&self, dma: &DmaSpace, index: u16, bb: &mut [u8; SEND_WQE_BB as usize]) -> bool {
        let size = self.sq_bytes();
        if size == 0 {
            return false;
        }
        let off = self.buf_off + self.rq_bytes() + u64::from(index) * SEND_WQE_BB % size;
        let page = 1u64 << self.page_shift;
        let in_page = off & (page - 1);
        let pa = usize::try_from(off >> self.page_shift).ok().and_then(|k| self.pas.get(k));
        match pa {
            Some(&pa) if in_page + SEND_WQE_BB <= page => dma.try_read(pa + in_page, bb),
            _ => false,
        }
    }

    /// Reads RQ WQE `index` (taken modulo the RQ size).
    pub(crate) fn read_rq(&self, dma: &mut DmaSpace, index: u16, out: &mut [u8]) -> Result<(), DmaFault> {
        let n = self.rq_wqes();
        if n == 0 {
            return Err(DmaFault { iova: 0, len: out.len(), write: false });
        }
        let off = u64::from(u32::from(index) & (n - 1)) * self.rq_stride();
        self.read_buf(dma, off, out)
    }

    /// Back to RST: the datapath forgets everything (the driver resets its counters and doorbell record).
    fn reset(&mut self) {
        self.state = QpState::Rst;
        self.sq_ci = 0;
        self.sq_next = 0;
        self.sq_pi = 0;
        self.rq_ci = 0;
        self.reqs.clear();
        self.retrying = false;
        self.window_blocked = false;
        self.error = None;
        self.last_wqe_sent = false;
    }

    pub(crate) fn info(&self) -> QpInfo {
        QpInfo {
            qpn: self.qpn,
            state: self.state,
            st: self.st,
            special: self.special,
            pd: self.pd,
            uar: self.uar,
            cqn_snd: self.cqn_snd,
            cqn_rcv: self.cqn_rcv,
            sq_wqebbs: self.sq_bbs(),
            rq_wqes: self.rq_wqes(),
            rq_stride: self.rq_stride() as u32,
            sq_ci: self.sq_ci,
            sq_pi: self.sq_pi,
            rq_ci: self.rq_ci,
            remote_qpn: self.remote_qpn,
            next_send_psn: self.next_send_psn,
            next_rcv_psn: self.next_rcv_psn,
            q_key: self.q_key,
            min_rnr_nak: self.min_rnr_nak,
            retry_count: self.retry_count,
            rnr_retry: self.rnr_retry,
            ack_timeout: self.path.ack_timeout(),
            remote_access: (self.rre, self.rwe, self.rae),
            error: self.error,
            outstanding: !self.reqs.is_empty(),
            in_flight: self.reqs.len() as u32,
        }
    }
}

/// A state-changing QP command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transition {
    Rst2Init,
    Init2Init,
    Init2Rtr,
    Rtr2Rts,
    Rts2Rts,
}

impl Transition {
    fn from_opcode(op: u16) -> Option<Self> {
        Some(match op {
            consts::MLX5_CMD_OP_RST2INIT_QP => Transition::Rst2Init,
            consts::MLX5_CMD_OP_INIT2INIT_QP => Transition::Init2Init,
            consts::MLX5_CMD_OP_INIT2RTR_QP => Transition::Init2Rtr,
            consts::MLX5_CMD_OP_RTR2RTS_QP => Transition::Rtr2Rts,
            consts::MLX5_CMD_OP_RTS2RTS_QP => Transition::Rts2Rts,
            _ => return None,
        })
    }

    /// The state the command starts from and the one it reaches.
    fn states(self) -> (QpState, QpState) {
        match self {
            Transition::Rst2Init => (QpState::Rst, QpState::Init),
            Transition::Init2Init => (QpState::Init, QpState::Init),
            Transition::Init2Rtr => (QpState::Init, QpState::Rtr),
            Transition::Rtr2Rts => (QpState::Rtr, QpState::Rts),
            Transition::Rts2Rts => (QpState::Rts, QpState::Rts),
        }
    }

    /// (qpn, opt_param_mask, qpc) of the command's input layout.
    fn layout(self) -> (Field, Field, Sub) {
        match self {
            Transition::Rst2Init => {
                use ifc::rst2init_qp_in as i;
                (i::QPN, i::OPT_PARAM_MASK, i::QPC)
            }
            Transition::Init2Init => {
                use ifc::init2init_qp_in as i;
                (i::QPN, i::OPT_PARAM_MASK, i::QPC)
            }
            Transition::Init2Rtr => {
                use ifc::init2rtr_qp_in as i;
                (i::QPN, i::OPT_PARAM_MASK, i::QPC)
            }
            Transition::Rtr2Rts => {
                use ifc::rtr2rts_qp_in as i;
                (i::QPN, i::OPT_PARAM_MASK, i::QPC)
            }
            Transition::Rts2Rts => {
                use ifc::rts2rts_qp_in as i;
                (i::QPN, i::OPT_PARAM_MASK, i::QPC)
            }
        }
    }
}

fn qp_state_err() -> CmdErr {
    err(CmdStatus::BadQpState, syndrome::QP_STATE)
}

/// The QP table: every QP by number (the datapath looks QPs up here and steps them in number order), and the
/// number CREATE_QP tries next.
#[derive(Debug)]
pub(crate) struct QpTable {
    map: IdMap<Qp>,
    next: u32,
    /// The QPs the datapath steps, ascending: every one that entered RTS or ERR (the only states with work), or
    /// whose send doorbell rang. A QP that left them, was destroyed, or sits in RTS with nothing to send and
    /// nothing in flight is dropped when the datapath next meets it, so a device holding many idle QPs does not
    /// walk them all on every command and doorbell (65,536 connected QPs made their creation quadratic).
    active: BTreeSet<u32>,
}

impl QpTable {
    pub(crate) fn new() -> Self {
        QpTable { map: IdMap::new(), next: 0, active: BTreeSet::new() }
    }

    /// QP `qpn` entered RTS or ERR: the datapath steps it from now on.
    pub(crate) fn activate(&mut self, qpn: u32) {
        self.active.insert(qpn);
    }

    /// QP `qpn` is idle in RTS: the datapath skips it until its doorbell rings or it changes state.
    pub(crate) fn deactivate(&mut self, qpn: u32) {
        self.active.remove(&qpn);
    }

    /// The first QP at or after `from` the datapath steps, dropping those that left RTS and ERR on the way.
    pub(crate) fn next_active(&mut self, from: u32) -> Option<u32> {
        loop {
            let qpn = *self.active.range(from..).next()?;
            if self.map.get(&qpn).is_some_and(|qp| matches!(qp.state, QpState::Rts | QpState::Err)) {
                return Some(qpn);
            }
            self.active.remove(&qpn);
        }
    }

    /// Every QP gone (the function is torn down).
    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.active.clear();
    }
}

impl Deref for QpTable {
    type Target = IdMap<Qp>;
    #[inline]
    fn deref(&self) -> &IdMap<Qp> {
        &self.map
    }
}

impl DerefMut for QpTable {
    #[inline]
    fn deref_mut(&mut self) -> &mut IdMap<Qp> {
        &mut self.map
    }
}

/// What the QP commands need of the rest of the firmware, and nothing more.
pub(crate) struct QpFw<'a> {
    pub(crate) caps: &'a Caps,
    /// The port's link layer (what a path must name).
    pub(crate) port_type: PortType,
    /// The allocated protection domains and UAR pages.
    pub(crate) pds: &'a IdSet,
    pub(crate) uars: &'a IdSet,
    /// Whether a CQ exists.
    pub(crate) cq_exists: &'a dyn Fn(u32) -> bool,
    /// Whether a RoCE GID table entry is programmed.
    pub(crate) roce_gid_set: &'a dyn Fn(u32) -> bool,
    /// Whether a QP may name a Q counter set (0, or an allocated one).
    pub(crate) q_counter_valid: &'a dyn Fn(u8) -> bool,
    /// Whether an SRQ (or RMP) exists.
    pub(crate) srq_exists: &'a dyn Fn(u32) -> bool,
    /// Whether an XRC domain exists.
    pub(crate) xrcd_exists: &'a dyn Fn(u32) -> bool,
    /// The UMEMs a buffer may live on.
    pub(crate) umems: &'a super::umem::UmemTable,
}

/// Whether a QP may use timestamp format `fmt` on a device whose capability is `cap`
/// (`MLX5_TIMESTAMP_FORMAT_CAP_*`): the default always, free-running and real-time only where supported.
fn ts_format_ok(cap: u32, fmt: u32) -> bool {
    use consts as k;
    match fmt {
        k::MLX5_TIMESTAMP_FORMAT_DEFAULT => true,
        k::MLX5_TIMESTAMP_FORMAT_FREE_RUNNING => cap != k::MLX5_TIMESTAMP_FORMAT_CAP_REAL_TIME,
        k::MLX5_TIMESTAMP_FORMAT_REAL_TIME => cap != k::MLX5_TIMESTAMP_FORMAT_CAP_FREE_RUNNING,
        _ => false,
    }
}

#[cfg(test)]
#[test]
fn timestamp_formats_follow_the_capability() {
    use consts as k;
    let (fr, rt, both) = (
        k::MLX5_TIMESTAMP_FORMAT_CAP_FREE_RUNNING,
        k::MLX5_TIMESTAMP_FORMAT_CAP_REAL_TIME,
        k::MLX5_TIMESTAMP_FORMAT_CAP_FREE_RUNNING_AND_REAL_TIME,
    );
    let (f_fr, f_def, f_rt) =
        (k::MLX5_TIMESTAMP_FORMAT_FREE_RUNNING, k::MLX5_TIMESTAMP_FORMAT_DEFAULT, k::MLX5_TIMESTAMP_FORMAT_REAL_TIME);
    let table: Vec<[bool; 3]> =
        [fr, rt, both].iter().map(|&c| [f_fr, f_def, f_rt].map(|f| ts_format_ok(c, f))).collect();
    assert_eq!(table, [[true, true, false], [false, true, true], [true, true, true]]);
    assert!(!ts_format_ok(both, 3));
}

impl QpFw<'_> {
    /// The QP timestamp formats the device has: RoCE's `qp_ts_format` on an Ethernet port, the general
    /// `sq_ts_format` on InfiniBand (what `mlx5_get_qp_default_ts` reads).
    fn ts_format_cap(&self) -> u32 {
        match self.port_type {
            PortType::Eth => self.caps.roce(ifc::roce_cap::QP_TS_FORMAT),
            PortType::Ib => self.caps.gen(ifc::cmd_hca_cap::SQ_TS_FORMAT),
        }
    }
}

impl QpTable {
    pub(crate) fn create(&mut self, fw: &QpFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_qp_in as i;
        use ifc::qpc as q;
        let ctx = i::QPC;
        let get = |f: Field| rd(inp, f.at(ctx));
        let ib = fw.port_type == PortType::Ib;
        let xrc = get(q::ST) == consts::MLX5_QP_ST_XRC;
        let (st, special) = match get(q::ST) {
            consts::MLX5_QP_ST_RC => (QpType::Rc, None),
            // XRC runs RC's transport; `xrcd` below tells the two apart.
            consts::MLX5_QP_ST_XRC if fw.caps.gen(ifc::cmd_hca_cap::XRC) != 0 => (QpType::Rc, None),
            consts::MLX5_QP_ST_UD => (QpType::Ud, None),
            // UC only on a device that reports the transport (`cmd_hca_cap.uc`).
            consts::MLX5_QP_ST_UC if fw.caps.gen(ifc::cmd_hca_cap::UC) != 0 => (QpType::Uc, None),
            // The subnet management QP exists on InfiniBand ports only, the GSI QP on RoCE too; one each per port.
            consts::MLX5_QP_ST_QP0 if ib => (QpType::Ud, Some(SpecialQp::Qp0)),
            consts::MLX5_QP_ST_QP1 => (QpType::Ud, Some(SpecialQp::Qp1)),
            consts::MLX5_QP_ST_REG_UMR => (QpType::Ud, Some(SpecialQp::RegUmr)),
            _ => return Err(bad_param(syndrome::QP_TYPE)),
        };
        if let Some(sp) = special.filter(|s| *s != SpecialQp::RegUmr) {
            if self.map.values().any(|q| q.special == Some(sp)) {
                return Err(bad_param(syndrome::QP_TYPE));
            }
        }
        let unsupported = rd(inp, i::QPC_EXT) != 0
            || rd(inp, i::INPUT_QPN) != 0
            // A doorbell record on a UMEM names it in `qpc.dbr_umem_id`, a field Linux 6.12's layouts do not
            // carry (only rdma-core's do): not modelled.
            || get(q::DBR_UMEM_VALID) != 0;
        if unsupported {
            return Err(bad_param(syndrome::QP_FEATURE));
        }
        // mlx5_ib names one of its default XRC domains (and its default SRQ, whatever the RQ type) in every QP it
        // creates; the domain must exist, and both are unused unless the QP is XRC or receives from the SRQ
        // (found under UML: the simulator refused them, so no QP0, GSI or UMR QP).
        let xrcd = get(q::XRCD);
        if (xrcd != 0 || xrc) && !(fw.xrcd_exists)(xrcd) {
            return Err(bad_param(syndrome::XRCD_INVALID));
        }
        if get(q::PM_STATE) != consts::MLX5_QP_PM_MIGRATED {
            return Err(bad_param(syndrome::QP_PM_STATE));
        }
        if !ts_format_ok(fw.ts_format_cap(), get(q::TS_FORMAT)) {
            return Err(bad_param(syndrome::QP_TS_FORMAT));
        }
        let pd = get(q::PD);
        // mlx5_ib creates its UMR QP with no PD (pd 0, `latency_sensitive` instead; create_kernel_qp): the
        // simulator refused it as PD_INVALID, so no user memory could be registered (found under UML).
        let umr_without_pd = special == Some(SpecialQp::RegUmr) && pd == 0;
        if !fw.pds.contains(pd) && !umr_without_pd {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        let (has_rq, srqn) = match get(q::RQ_TYPE) {
            consts::MLX5_NON_ZERO_RQ => (true, None),
            consts::MLX5_ZERO_LEN_RQ => (false, None),
            // Receives come from the SRQ, which must exist; the QP has no RQ of its own.
            consts::MLX5_SRQ_RQ => {
                let n = get(q::SRQN_RMPN_XRQN);
                if !(fw.srq_exists)(n) {
                    return Err(bad_param(syndrome::SRQ_INVALID));
                }
                (false, Some(n))
            }
            _ => return Err(bad_param(syndrome::QP_RQ_TYPE)),
        };
        let has_sq = get(q::NO_SQ) == 0;
        let (cqn_snd, cqn_rcv) = (get(q::CQN_SND), get(q::CQN_RCV));
        let receives = has_rq || srqn.is_some();
        if (has_sq && !(fw.cq_exists)(cqn_snd)) || (receives && !(fw.cq_exists)(cqn_rcv)) {
            return Err(bad_param(syndrome::CQ_INVALID));
        }
        let uar = get(q::UAR_PAGE);
        // An XRC target has no SQ to ring and mlx5_ib names no UAR for it (create_xrc_tgt_qp).
        if (has_sq || !xrc) && !fw.uars.contains(uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        let (log_rq_size, log_rq_stride, log_sq_size) =
            (get(q::LOG_RQ_SIZE), get(q::LOG_RQ_STRIDE), get(q::LOG_SQ_SIZE));
        let max_log = fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_QP_SZ);
        if (has_rq && log_rq_size > max_log) || (has_sq && log_sq_size > max_log) {
            return Err(bad_param(syndrome::LOG_SIZE));
        }
        let rq_stride = 1u64 << (log_rq_stride + RQ_STRIDE_SHIFT);
        if has_rq && rq_stride > u64::from(fw.caps.gen(ifc::cmd_hca_cap::MAX_WQE_SZ_RQ)) {
            return Err(bad_param(syndrome::QP_WQE_SIZE));
        }
        let mut page_shift = ADAPTER_PAGE_SHIFT + get(q::LOG_PAGE_SIZE);
        // mlx5_ib sends the offset of a user buffer in its first page (mlx5_umem_find_best_quantized_pgoff, 64
        // quanta a page); the simulator refused any, so a user QP whose buffer did not start on a page failed
        // (found under UML, 1 run in 4).
        let page_offset = get(q::PAGE_OFFSET);
        let mut buf_off = u64::from(page_offset) << page_shift >> PAGE_OFFSET_QUANTA.trailing_zeros();
        let rq_bytes = if has_rq { rq_stride << log_rq_size } else { 0 };
        let sq_bytes = if has_sq { SEND_WQE_BB << log_sq_size } else { 0 };
        // A buffer on a UMEM (DevX) takes its pages and their size from it, `wq_umem_offset` bytes in.
        let umem_pas = if rd(inp, i::WQ_UMEM_VALID) != 0 {
            let offset = inp.get64(i::WQ_UMEM_OFFSET);
            let (pas, shift) = fw.umems.ring(rd(inp, i::WQ_UMEM_ID), offset, rq_bytes + sq_bytes)?;
            (page_shift, buf_off) = (shift, 0);
            Some(pas)
        } else {
            None
        };
        // The pages cover the offset too.
        let bytes = buf_off + rq_bytes + sq_bytes;
        if umem_pas.is_none() {
            check_pas(dma, inp, i::PAS, bytes, 1 << page_shift)?;
        }
        let dbr = inp.get64(q::DBR_ADDR.at(ctx));
        // Nor a doorbell record: it has neither queue (create_xrc_tgt_qp passes a `db` it never allocated).
        if (has_sq || has_rq || !xrc) && !dma.is_mapped(dbr, DBR_BYTES) {
            return Err(bad_param(syndrome::DBR_NOT_MAPPED));
        }
        let max_qps = 1usize << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_QP).min(24);
        if self.map.len() >= max_qps {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        let qpn = alloc_id(&self.map, &mut self.next, QPN_FIRST, QPN_END)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let pas = umem_pas.unwrap_or_else(|| {
            (0..bytes.div_ceil(1 << page_shift)).map(|k| inp.get64(i::PAS.elem(k as u32))).collect()
        });
        let qp = Qp {
            qpn,
            st,
            special,
            state: QpState::Rst,
            pd,
            uar,
            cqn_snd,
            cqn_rcv,
            dbr,
            pas,
            page_shift,
            buf_off,
            log_rq_size,
            log_rq_stride,
            has_rq,
            log_sq_size,
            has_sq,
            path: Path::default(),
            route: Path::default().fields(),
            mtu: 0,
            log_msg_max: 0,
            remote_qpn: 0,
            next_rcv_psn: 0,
            next_send_psn: 0,
            msn: 0,
            log_rra_max: 0,
            log_sra_max: 0,
            min_rnr_nak: 0,
            retry_count: 0,
            rnr_retry: 0,
            rre: false,
            rwe: false,
            rae: false,
            q_key: 0,
            sq_ci: 0,
            sq_next: 0,
            sq_pi: 0,
            rq_ci: 0,
            reqs: VecDeque::new(),
            retrying: false,
            window_blocked: false,
            log_ack_req_freq: 0,
            atomic_results: VecDeque::new(),
            comm_est: false,
            error: None,
            counter_set_id: 0,
            max_wqe: fw.caps.gen(ifc::cmd_hca_cap::MAX_WQE_SZ_SQ) as usize,
            max_msg: 1u64 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_MSG).min(31),
            // An XRC QP names mlx5_ib's default SRQ but receives through the SRQs of its domain only.
            srqn: srqn.filter(|_| !xrc),
            xrcd: xrc.then_some(xrcd),
            xrc_rx: None,
            user_index: get(q::USER_INDEX),
            last_wqe_sent: false,
        };
        self.map.insert(qpn, qp);
        out.set(ifc::create_qp_out::QPN, qpn);
        Ok(())
    }

    pub(crate) fn destroy(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let qpn = rd(inp, ifc::destroy_qp_in::QPN);
        // Requests in flight to or from it are dropped when they arrive: nothing refers to it any more.
        self.map.remove(&qpn).map(|_| ()).ok_or(bad_param(syndrome::QP_INVALID))
    }

    /// 2ERR and 2RST, each from any state: IBTA lets any state go to ERR, and mlx5_ib's transition table sends
    /// 2ERR_QP from RST too.
    pub(crate) fn move_to_err_or_rst(&mut self, opcode: u16, inp: &[u8]) -> Result<(), CmdErr> {
        let qpn = if opcode == consts::MLX5_CMD_OP_2ERR_QP {
            rd(inp, ifc::qp_2err_in::QPN)
        } else {
            rd(inp, ifc::qp_2rst_in::QPN)
        };
        let qp = self.map.get_mut(&qpn).ok_or(bad_param(syndrome::QP_INVALID))?;
        if opcode == consts::MLX5_CMD_OP_2ERR_QP {
            // Outstanding and posted WQEs are flushed the next time the datapath runs (right after this command).
            qp.state = QpState::Err;
            self.activate(qpn);
        } else {
            qp.reset();
        }
        Ok(())
    }

    /// Checks a primary path for the link layer: IB needs a LID (and, with a GRH, a valid source GID index);
    /// RoCE needs a GRH with a destination GID and MAC and a valid source GID index.
    fn check_path(fw: &QpFw, p: &Path) -> Result<(), CmdErr> {
        if p.port() != 0 && p.port() != PORT {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        if fw.port_type == PortType::Eth && !(fw.roce_gid_set)(p.src_addr_index()) {
            return Err(bad_param(syndrome::GID_NOT_SET));
        }
        let gid_ok = p.src_addr_index() < GID_ENTRIES || fw.port_type == PortType::Eth;
        let ok = match fw.port_type {
            PortType::Ib => p.rlid() != 0 && (!p.grh() || gid_ok),
            // A RoCE path leaves `grh` 0 (mlx5_set_path sets it on InfiniBand only): every RoCE packet has one.
            PortType::Eth => gid_ok && p.rgid() != [0; 16] && p.rmac() != [0; 6],
        };
        if ok {
            Ok(())
        } else {
            Err(bad_param(syndrome::QP_PATH))
        }
    }

    /// RST2INIT, INIT2INIT, INIT2RTR, RTR2RTS, RTS2RTS.
    pub(crate) fn modify(&mut self, fw: &QpFw, opcode: u16, inp: &[u8]) -> Result<(), CmdErr> {
        use consts as k;
        use ifc::qpc as q;
        let t = Transition::from_opcode(opcode).ok_or(err(CmdStatus::BadOp, syndrome::BAD_OPCODE))?;
        let (qpn_f, opt_f, ctx) = t.layout();
        let qpn = rd(inp, qpn_f);
        let opt = rd(inp, opt_f);
        let get = |f: Field| rd(inp, f.at(ctx));
        let qp = self.map.get(&qpn).ok_or(bad_param(syndrome::QP_INVALID))?;
        let (from, to) = t.states();
        if qp.state != from {
            return Err(qp_state_err());
        }
        let rc = qp.st == QpType::Rc;
        // RC and UC are connected: a path, a remote QPN and PSNs; UC has no responder resources, ACK timer or
        // retries, and no remote read or atomics.
        let connected = qp.st != QpType::Ud;
        let uc = qp.st == QpType::Uc;
        let path = Path::from_ctx(inp, ctx);
        let cap = |f: Field| fw.caps.gen(f);
        // Validate everything before changing anything.
        // A UC context takes remote write only (the UC column of mlx5_ib's `opt_mask`): firmware refuses the
        // options UC has no use for, and remote read or atomic rights.
        let uc_refused = k::MLX5_QP_OPTPAR_RRE
            | k::MLX5_QP_OPTPAR_RAE
            | k::MLX5_QP_OPTPAR_RNR_TIMEOUT
            | k::MLX5_QP_OPTPAR_ACK_TIMEOUT
            | k::MLX5_QP_OPTPAR_RETRY_COUNT
            | k::MLX5_QP_OPTPAR_RNR_RETRY
            | k::MLX5_QP_OPTPAR_SRA_MAX
            | k::MLX5_QP_OPTPAR_RRA_MAX
            | k::MLX5_QP_OPTPAR_Q_KEY;
        let uc_sets_access = t == Transition::Rst2Init || opt & k::MLX5_QP_OPTPAR_RWE != 0;
        if uc && (opt & uc_refused != 0 || (uc_sets_access && (get(q::RRE) != 0 || get(q::RAE) != 0))) {
            return Err(bad_param(syndrome::QP_CONTEXT));
        }
        match t {
            Transition::Rst2Init if path.port() != PORT => return Err(bad_param(syndrome::BAD_PORT)),
            // INIT2INIT names the port only with PRI_PORT; there is one.
            Transition::Init2Init if opt & k::MLX5_QP_OPTPAR_PRI_PORT != 0 && path.port() != PORT => {
                return Err(bad_param(syndrome::BAD_PORT));
            }
            // mlx5_ib sends IB_MTU_4096 with every UD modify; firmware refuses a UD QP without an MTU.
            Transition::Init2Rtr if !rc && !(k::IB_MTU_256..=k::IB_MTU_4096).contains(&rd8(inp, q::MTU.at(ctx))) => {
                return Err(bad_param(syndrome::QP_MTU));
            }
            Transition::Init2Rtr if connected => {
                if !(k::IB_MTU_256..=k::IB_MTU_4096).contains(&rd8(inp, q::MTU.at(ctx))) {
                    return Err(bad_param(syndrome::QP_MTU));
                }
                if get(q::LOG_MSG_MAX) > cap(ifc::cmd_hca_cap::LOG_MAX_MSG)
                    || (rc && get(q::LOG_RRA_MAX) > cap(ifc::cmd_hca_cap::LOG_MAX_RA_RES_QP))
                {
                    return Err(bad_param(syndrome::QP_CONTEXT));
                }
                Self::check_path(fw, &path)?;
            }
            Transition::Rtr2Rts if rc && get(q::LOG_SRA_MAX) > cap(ifc::cmd_hca_cap::LOG_MAX_RA_REQ_QP) => {
                return Err(bad_param(syndrome::QP_CONTEXT));
            }
            Transition::Rts2Rts if opt & k::MLX5_QP_OPTPAR_PRIMARY_ADDR_PATH != 0 && rc => Self::check_path(fw, &path)?,
            _ => {}
        }
        // A context that sets the access bits (RST2INIT, or the RRE/RWE/RAE options) with `rae` must name an atomic
        // mode the device has; `set_qpc_atomic_flags` always does.
        let sets_access = (t == Transition::Rst2Init && connected)
            || opt & (k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE) != 0;
        if sets_access && get(q::RAE) != 0 && !fw.caps.atomic_mode_ok(get(q::ATOMIC_MODE)) {
            return Err(bad_param(syndrome::QP_ATOMIC_MODE));
        }
        let counter_set_id = get(q::COUNTER_SET_ID) as u8;
        if t == Transition::Rst2Init && !(fw.q_counter_valid)(counter_set_id) {
            return Err(bad_param(syndrome::Q_COUNTER_INVALID));
        }
        let pkey_entries = 128u32 << cap(ifc::cmd_hca_cap::PKEY_TABLE_SIZE).min(8);
        let sets_pkey = t == Transition::Rst2Init || opt & k::MLX5_QP_OPTPAR_PKEY_INDEX != 0;
        if sets_pkey && path.pkey_index() >= pkey_entries {
            return Err(bad_param(syndrome::QP_PKEY_INDEX));
        }
        let qp = self.map.get_mut(&qpn).ok_or(bad_param(syndrome::QP_INVALID))?;
        let has = |bit: u32| opt & bit != 0;
        let access = |qp: &mut Qp| {
            qp.rre = get(q::RRE) != 0;
            qp.rwe = get(q::RWE) != 0;
            qp.rae = get(q::RAE) != 0;
        };
        if sets_pkey {
            qp.path.put(ifc::ads::PKEY_INDEX, path.pkey_index());
        }
        match t {
            Transition::Rst2Init => {
                qp.path.put(ifc::ads::VHCA_PORT_NUM, PORT);
                qp.counter_set_id = counter_set_id;
                if connected {
                    access(qp);
                } else {
                    qp.q_key = get(q::Q_KEY);
                }
            }
            // Only what the options name changes (the pkey index is stored above).
            Transition::Init2Init => {
                if connected {
                    if has(k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE) {
                        access(qp);
                    }
                } else if has(k::MLX5_QP_OPTPAR_Q_KEY) {
                    qp.q_key = get(q::Q_KEY);
                }
            }
            Transition::Init2Rtr => {
                qp.comm_est = false;
                if connected {
                    let (pkey, port) = (qp.path.pkey_index(), qp.path.port());
                    qp.path = path;
                    // The port and pkey index stay what RST2INIT (or the optional pkey) set.
                    qp.path.put(ifc::ads::PKEY_INDEX, pkey);
                    qp.path.put(ifc::ads::VHCA_PORT_NUM, port);
                    qp.mtu = rd8(inp, q::MTU.at(ctx));
                    qp.log_msg_max = get(q::LOG_MSG_MAX);
                    qp.remote_qpn = get(q::REMOTE_QPN);
                    qp.next_rcv_psn = get(q::NEXT_RCV_PSN);
                    if rc {
                        qp.log_rra_max = get(q::LOG_RRA_MAX);
                        qp.min_rnr_nak = get(q::MIN_RNR_NAK) as u8;
                    }
                    if has(k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE) {
                        access(qp);
                    }
                } else {
                    qp.mtu = rd8(inp, q::MTU.at(ctx));
                    qp.log_msg_max = get(q::LOG_MSG_MAX);
                    if has(k::MLX5_QP_OPTPAR_Q_KEY) {
                        qp.q_key = get(q::Q_KEY);
                    }
                }
            }
            Transition::Rtr2Rts => {
                qp.next_send_psn = get(q::NEXT_SEND_PSN);
                if uc {
                    if has(k::MLX5_QP_OPTPAR_RWE) {
                        access(qp);
                    }
                } else if rc {
                    qp.retry_count = get(q::RETRY_COUNT) as u8;
                    qp.rnr_retry = get(q::RNR_RETRY) as u8;
                    qp.log_sra_max = get(q::LOG_SRA_MAX);
                    qp.log_ack_req_freq = get(q::LOG_ACK_REQ_FREQ) as u8;
                    qp.path.put(ifc::ads::ACK_TIMEOUT, path.ack_timeout().into());
                    if has(k::MLX5_QP_OPTPAR_RNR_TIMEOUT) {
                        qp.min_rnr_nak = get(q::MIN_RNR_NAK) as u8;
                    }
                    if has(k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE) {
                        access(qp);
                    }
                } else if has(k::MLX5_QP_OPTPAR_Q_KEY) {
                    qp.q_key = get(q::Q_KEY);
                }
            }
            Transition::Rts2Rts => {
                if uc {
                    if has(k::MLX5_QP_OPTPAR_RWE) {
                        access(qp);
                    }
                } else if rc {
                    if has(k::MLX5_QP_OPTPAR_PRIMARY_ADDR_PATH) {
                        let (pkey, port, ack) = (qp.path.pkey_index(), qp.path.port(), qp.path.ack_timeout());
                        qp.path = path;
                        qp.path.put(ifc::ads::PKEY_INDEX, pkey);
                        qp.path.put(ifc::ads::VHCA_PORT_NUM, port);
                        qp.path.put(ifc::ads::ACK_TIMEOUT, ack.into());
                    }
                    if has(k::MLX5_QP_OPTPAR_ACK_TIMEOUT) {
                        qp.path.put(ifc::ads::ACK_TIMEOUT, path.ack_timeout().into());
                    }
                    if has(k::MLX5_QP_OPTPAR_RNR_TIMEOUT) {
                        qp.min_rnr_nak = get(q::MIN_RNR_NAK) as u8;
                    }
                    if has(k::MLX5_QP_OPTPAR_RETRY_COUNT) {
                        qp.retry_count = get(q::RETRY_COUNT) as u8;
                    }
                    if has(k::MLX5_QP_OPTPAR_RNR_RETRY) {
                        qp.rnr_retry = get(q::RNR_RETRY) as u8;
                    }
                    if has(k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE) {
                        access(qp);
                    }
                } else if has(k::MLX5_QP_OPTPAR_Q_KEY) {
                    qp.q_key = get(q::Q_KEY);
                }
            }
        }
        qp.route = qp.path.fields();
        qp.state = to;
        if matches!(to, QpState::Rts | QpState::Err) {
            self.activate(qpn);
        }
        Ok(())
    }

    /// QUERY_QP: the context with the live state and counters (the SQ producer counter as of the last doorbell,
    /// the RQ head as the doorbell record holds it now).
    pub(crate) fn query(&self, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::qpc as q;
        let qpn = rd(inp, ifc::query_qp_in::QPN);
        let qp = self.map.get(&qpn).ok_or(bad_param(syndrome::QP_INVALID))?;
        let ctx = ifc::query_qp_out::QPC;
        let mut head = [0u8; 4];
        let rq_head = if dma.peek(qp.dbr, &mut head) { u32::from_be_bytes(head) & 0xffff } else { 0 };
        let fields = [
            (q::STATE, qp.state.raw().into()),
            (
                q::ST,
                if qp.xrcd.is_some() { consts::MLX5_QP_ST_XRC } else { qp.special.map_or(qp.st.raw(), SpecialQp::raw) },
            ),
            (q::PM_STATE, consts::MLX5_QP_PM_MIGRATED),
            (q::PD, qp.pd),
            (q::MTU, qp.mtu.into()),
            (q::LOG_MSG_MAX, qp.log_msg_max),
            (q::LOG_RQ_SIZE, qp.log_rq_size),
            (q::LOG_RQ_STRIDE, qp.log_rq_stride),
            (q::NO_SQ, (!qp.has_sq).into()),
            (q::LOG_SQ_SIZE, qp.log_sq_size),
            (q::UAR_PAGE, qp.uar),
            (q::LOG_PAGE_SIZE, qp.page_shift - ADAPTER_PAGE_SHIFT),
            (q::PAGE_OFFSET, (qp.buf_off >> (qp.page_shift - PAGE_OFFSET_QUANTA.trailing_zeros())) as u32),
            (q::REMOTE_QPN, qp.remote_qpn),
            (q::LOG_SRA_MAX, qp.log_sra_max),
            (q::RETRY_COUNT, qp.retry_count.into()),
            (q::LOG_ACK_REQ_FREQ, qp.log_ack_req_freq.into()),
            (q::RNR_RETRY, qp.rnr_retry.into()),
            (q::NEXT_SEND_PSN, qp.next_send_psn),
            (q::CQN_SND, qp.cqn_snd),
            (q::LOG_RRA_MAX, qp.log_rra_max),
            (q::RRE, qp.rre.into()),
            (q::RWE, qp.rwe.into()),
            (q::RAE, qp.rae.into()),
            (q::MIN_RNR_NAK, qp.min_rnr_nak.into()),
            (q::NEXT_RCV_PSN, qp.next_rcv_psn),
            (q::CQN_RCV, qp.cqn_rcv),
            (q::Q_KEY, qp.q_key),
            (q::COUNTER_SET_ID, qp.counter_set_id.into()),
            (
                q::RQ_TYPE,
                match (qp.has_rq, qp.srqn) {
                    (_, Some(_)) => consts::MLX5_SRQ_RQ,
                    _ if qp.xrcd.is_some() => consts::MLX5_SRQ_RQ,
                    (true, None) => consts::MLX5_NON_ZERO_RQ,
                    (false, None) => consts::MLX5_ZERO_LEN_RQ,
                },
            ),
            (q::SRQN_RMPN_XRQN, qp.srqn.unwrap_or(0)),
            (q::USER_INDEX, qp.user_index),
            (q::XRCD, qp.xrcd.unwrap_or(0)),
            (q::HW_SQ_WQEBB_COUNTER, qp.sq_ci.into()),
            (q::SW_SQ_WQEBB_COUNTER, qp.sq_pi.into()),
            (q::HW_RQ_COUNTER, qp.rq_ci.into()),
            (q::SW_RQ_COUNTER, rq_head),
        ];
        for (f, v) in fields {
            out.set(f.at(ctx), v);
        }
        out.set64(q::DBR_ADDR.at(ctx), qp.dbr);
        let path = q::PRIMARY_ADDRESS_PATH.at(ctx);
        out[path.off..path.off + path.len].copy_from_slice(&qp.path.0);
        Ok(())
    }
}

impl QpTable {
    /// A catastrophic error on QP `qpn` (see `SimDevice::fail_qp`): the QP to ERR and a `WQ_CATAS_ERROR` EQE naming
    /// it. Returns `false`, changing nothing, when there is no such QP or the device is dead or gone.
    pub(crate) fn fail(&mut self, post: &mut EqPost, qpn: u32) -> bool {
        if post.regs.dead() {
            return false;
        }
        let Some(qp) = self.get_mut(&qpn) else { return false };
        qp.state = QpState::Err;
        self.activate(qpn);
        // No EQ subscribed (or a full one, which kills the firmware): the QP is in ERR all the same.
        let _ = post.post_qp_event(consts::MLX5_EVENT_TYPE_WQ_CATAS_ERROR, qpn);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::sim_device::SimDevice;
    use crate::testkit::submit::{QpSpec, Rdma, Remote};
    use mlx5_core::hal::Dma;

    fn create(r: &mut Rdma, inp: &[u8]) -> (u8, u32, u32) {
        let (s, syn, out) = r.h.cmd(inp, ifc::create_qp_out::SIZE_BYTES);
        (s, syn, rd(&out, ifc::create_qp_out::QPN))
    }

    fn destroy(r: &mut Rdma, op: u16, f: Field, n: u32) -> (u8, u32) {
        let mut inp = vec![0u8; 16];
        inp.set(ifc::mbox_in::OPCODE, op.into());
        inp.set(f, n);
        let (s, syn, _) = r.h.cmd(&inp, 16);
        (s, syn)
    }

    #[test]
    fn uc_qps_take_remote_write_only_and_exist_only_where_the_caps_say_uc() {
        use consts as k;
        use ifc::qpc as q;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let uc = QpSpec { st: k::MLX5_QP_ST_UC, ..QpSpec::rc() };
        let n = r.qp(uc, cq.cqn, cq.cqn).qpn;
        assert_eq!(r.h.dev.qp_info(n).unwrap().st, QpType::Uc);
        let port = |i: &mut Vec<u8>, c: Sub| i.set(ifc::ads::VHCA_PORT_NUM.at(q::PRIMARY_ADDRESS_PATH.at(c)), PORT);
        // Remote read (or atomic) rights on a UC QP: firmware refuses the context.
        let read = |i: &mut Vec<u8>, c: Sub| {
            port(i, c);
            i.set(q::RRE.at(c), 1);
        };
        let refused = (k::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_CONTEXT);
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, read), refused);
        let write = |i: &mut Vec<u8>, c: Sub| {
            port(i, c);
            i.set(q::RWE.at(c), 1);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, write), (0, 0));
        assert_eq!(r.h.dev.qp_info(n).unwrap().remote_access, (false, true, false));
        // An RC-only option (the RNR timer) on a UC modify is refused as well.
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2RTR_QP, n, k::MLX5_QP_OPTPAR_RNR_TIMEOUT, |_, _| {}), refused);
        // A device without `uc` has no UC QPs.
        crate::device::lock(&r.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::UC, 0);
        let (inp, _, _) = r.create_qp_in(uc, cq.cqn, cq.cqn);
        assert_eq!(create(&mut r, &inp).0, k::MLX5_CMD_STAT_BAD_PARAM_ERR);
    }

    #[test]
    fn special_qps_of_an_ib_port_are_created_and_modified_as_mlx5_ib_does() {
        // Found under UML: mlx5_ib's IB port registration creates QP0 (SMI) and the hardware GSI QP (QP1), and
        // the first user memory registration its UMR QP (st REG_UMR); the simulator refused all three as QP_TYPE.
        use consts as k;
        use ifc::qpc as q;
        let mut r = Rdma::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        let cq = r.cq(4);
        for (st, special) in [
            (k::MLX5_QP_ST_QP0, SpecialQp::Qp0),
            (k::MLX5_QP_ST_QP1, SpecialQp::Qp1),
            (k::MLX5_QP_ST_REG_UMR, SpecialQp::RegUmr),
        ] {
            let n = r.qp(QpSpec { st, ..QpSpec::ud() }, cq.cqn, cq.cqn).qpn;
            let info = r.h.dev.qp_info(n).unwrap();
            assert_eq!((info.st, info.special), (QpType::Ud, Some(special)));
            if special == SpecialQp::RegUmr {
                // mlx5_ib's UMR QP names no PD.
                let (mut inp, _, _) = r.create_qp_in(QpSpec { st, ..QpSpec::ud() }, cq.cqn, cq.cqn);
                inp.set(q::PD.at(ifc::create_qp_in::QPC), 0);
                assert_eq!(create(&mut r, &inp).1, 0);
            }
            // __mlx5_ib_modify_qp for these: the port, then MTU 256 (QP0/QP1) or 4096 (UMR), a Q_Key.
            let init = |i: &mut Vec<u8>, c: Sub| {
                i.set(ifc::ads::VHCA_PORT_NUM.at(q::PRIMARY_ADDRESS_PATH.at(c)), PORT);
                i.set(q::Q_KEY.at(c), 0x8001_0000);
            };
            assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, init), (0, 0));
            let mtu = if special == SpecialQp::RegUmr { k::IB_MTU_4096 } else { k::IB_MTU_256 };
            assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2RTR_QP, n, 0, |i, c| i.set(q::MTU.at(c), mtu.into())), (0, 0));
            assert_eq!(r.modify(k::MLX5_CMD_OP_RTR2RTS_QP, n, 0, |_, _| {}), (0, 0));
            let mut inp = vec![0u8; ifc::query_qp_in::SIZE_BYTES];
            inp.set(ifc::mbox_in::OPCODE, k::MLX5_CMD_OP_QUERY_QP.into());
            inp.set(ifc::query_qp_in::QPN, n);
            let (s, _, out) = r.h.cmd(&inp, ifc::query_qp_out::SIZE_BYTES);
            assert_eq!(s, 0);
            assert_eq!(rd(&out, q::ST.at(ifc::query_qp_out::QPC)), st, "QUERY_QP reports the service created");
        }
        // One SMI and one GSI QP per port.
        let (inp, _, _) = r.create_qp_in(QpSpec { st: k::MLX5_QP_ST_QP1, ..QpSpec::ud() }, cq.cqn, cq.cqn);
        assert_eq!(create(&mut r, &inp), (k::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_TYPE, 0));
        // An Ethernet port has no subnet management QP.
        let mut e = Rdma::inline();
        let cq = e.cq(4);
        let (inp, _, _) = e.create_qp_in(QpSpec { st: k::MLX5_QP_ST_QP0, ..QpSpec::ud() }, cq.cqn, cq.cqn);
        assert_eq!(create(&mut e, &inp).1, syndrome::QP_TYPE);
    }

    #[test]
    fn a_qp_buffer_on_a_umem_takes_its_pages_and_holds_the_umem() {
        use consts as k;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let spec = QpSpec::rc();
        let npages = (spec.rq_bytes() + spec.sq_bytes()).div_ceil(4096);
        let region = r.h.dma.alloc(npages * 4096, 4096).unwrap();
        let mtt = ifc::umem::MTT.at(ifc::create_umem_in::UMEM);
        let mut u = vec![0u8; mtt.byte_off() + 8 * npages];
        u.set(ifc::mbox_in::OPCODE, k::MLX5_CMD_OP_CREATE_UMEM.into());
        u.set64(ifc::umem::NUM_OF_MTT.at(ifc::create_umem_in::UMEM), npages as u64);
        let pages: Vec<u64> = (0..npages as u64).map(|p| region.iova() + p * 4096).collect();
        for (p, pa) in pages.iter().enumerate() {
            // mlx5_ib marks every entry readable and writable.
            u.set64(mtt.elem(p as u32), pa | u64::from(k::MLX5_IB_MTT_PRESENT));
        }
        let (s, syn, out) = r.h.cmd(&u, ifc::create_umem_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0));
        let umem = rd(&out, ifc::create_umem_out::UMEM_ID);
        let (mut inp, _, _) = r.create_qp_in(spec, cq.cqn, cq.cqn);
        inp.truncate(ifc::create_qp_in::PAS.byte_off());
        inp.set(ifc::create_qp_in::WQ_UMEM_VALID, 1);
        inp.set(ifc::create_qp_in::WQ_UMEM_ID, umem);
        // A page in, the buffer runs past the UMEM's end.
        inp.set64(ifc::create_qp_in::WQ_UMEM_OFFSET, 4096);
        assert_eq!(create(&mut r, &inp).1, syndrome::UMEM_TOO_SMALL);
        inp.set64(ifc::create_qp_in::WQ_UMEM_OFFSET, 0);
        // A doorbell record on a UMEM is not modelled (its id field is not in Linux's layouts).
        let mut dbr_umem = inp.clone();
        dbr_umem.set(ifc::qpc::DBR_UMEM_VALID.at(ifc::create_qp_in::QPC), 1);
        assert_eq!(create(&mut r, &dbr_umem).1, syndrome::QP_FEATURE);
        let (s, syn, n) = create(&mut r, &inp);
        assert_eq!((s, syn), (0, 0));
        assert_eq!(r.h.dev.with_fw(|fw| fw.qps.get(&n).map(|q| q.pas.clone())), Some(pages));
        let destroy_umem = |r: &mut Rdma| {
            let mut d = vec![0u8; ifc::destroy_umem_in::SIZE_BYTES];
            d.set(ifc::mbox_in::OPCODE, k::MLX5_CMD_OP_DESTROY_UMEM.into());
            d.set(ifc::destroy_umem_in::UMEM_ID, umem);
            r.h.cmd(&d, ifc::destroy_umem_out::SIZE_BYTES).1
        };
        assert_eq!(destroy_umem(&mut r), syndrome::IN_USE);
        assert_eq!(destroy(&mut r, k::MLX5_CMD_OP_DESTROY_QP, ifc::destroy_qp_in::QPN, n), (0, 0));
        assert_eq!(destroy_umem(&mut r), 0);
        // A destroyed UMEM carries no QP.
        assert_eq!(create(&mut r, &inp).1, syndrome::UMEM_INVALID);
    }

    #[test]
    fn a_qp_naming_mlx5_ibs_default_xrc_domain_and_srq_is_created() {
        // mlx5_ib sets qpc.xrcd to one of its two XRC domains and srqn_rmpn_xrqn to its default SRQ in every
        // non-XRC QP, with a non-zero RQ (create_kernel_qp, create_user_qp); firmware uses neither then.
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let xrcd = r.h.alloc_xrcd();
        let (mut inp, _, _) = r.create_qp_in(QpSpec::rc(), cq.cqn, cq.cqn);
        inp.set(ifc::qpc::XRCD.at(ifc::create_qp_in::QPC), xrcd);
        inp.set(ifc::qpc::SRQN_RMPN_XRQN.at(ifc::create_qp_in::QPC), 0x77);
        let (s, syn, n) = create(&mut r, &inp);
        assert_eq!((s, syn), (0, 0));
        // The QP receives into its own RQ, not from the SRQ it named.
        assert_eq!(r.h.dev.qp_info(n).unwrap().rq_wqes, 1 << QpSpec::rc().log_rq);
    }

    #[test]
    fn xrc_initiator_and_target_qps_are_created_as_mlx5_ib_makes_them() {
        // An initiator (create_user_qp): an SQ, rq_type SRQ naming the default SRQ, xrcd the default domain. A
        // target (create_xrc_tgt_qp): no_sq, rq_type SRQ, the user's domain, and no UAR, buffer or doorbell record.
        use consts as k;
        use ifc::qpc as q;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let (x0, x1) = (r.h.alloc_xrcd(), r.h.alloc_xrcd());
        let srq = {
            // An SRQ for the default one mlx5_ib names: 16 WQEs of 32 bytes in one page.
            use ifc::srqc as sq;
            let (page, dbr) = (r.h.dma.alloc(4096, 4096).unwrap(), r.h.dma.alloc(64, 64).unwrap());
            let c = ifc::create_srq_in::SRQ_CONTEXT_ENTRY;
            let mut inp = vec![0u8; ifc::create_srq_in::SIZE_BYTES + 8];
            inp.set(ifc::mbox_in::OPCODE, k::MLX5_CMD_OP_CREATE_SRQ.into());
            inp.set(sq::LOG_SRQ_SIZE.at(c), 4);
            inp.set(sq::LOG_RQ_STRIDE.at(c), 1);
            inp.set(sq::PD.at(c), r.pd);
            inp.set64(sq::DBR_ADDR.at(c), dbr.iova());
            inp.set64(ifc::create_srq_in::PAS.elem(0), page.iova());
            let (s, _, out) = r.h.cmd(&inp, ifc::create_srq_out::SIZE_BYTES);
            assert_eq!(s, 0);
            rd(&out, ifc::create_srq_out::SRQN)
        };
        let (mut ini, _, _) = r.create_qp_in(QpSpec { st: k::MLX5_QP_ST_XRC, ..QpSpec::rc() }, cq.cqn, cq.cqn);
        let at = |f: Field| f.at(ifc::create_qp_in::QPC);
        ini.set(at(q::RQ_TYPE), k::MLX5_SRQ_RQ);
        ini.set(at(q::SRQN_RMPN_XRQN), srq);
        ini.set(at(q::XRCD), x1);
        let (s, syn, ini_n) = create(&mut r, &ini);
        assert_eq!((s, syn), (0, 0));
        let mut tgt = vec![0u8; ifc::create_qp_in::SIZE_BYTES];
        tgt.set(ifc::mbox_in::OPCODE, k::MLX5_CMD_OP_CREATE_QP.into());
        for (f, v) in [
            (q::ST, k::MLX5_QP_ST_XRC),
            (q::PM_STATE, k::MLX5_QP_PM_MIGRATED),
            (q::PD, r.pd),
            (q::RQ_TYPE, k::MLX5_SRQ_RQ),
            (q::NO_SQ, 1),
            (q::CQN_RCV, cq.cqn),
            (q::CQN_SND, cq.cqn),
            (q::SRQN_RMPN_XRQN, srq),
            (q::XRCD, x0),
            (q::USER_INDEX, 9),
        ] {
            tgt.set(at(f), v);
        }
        let (s, syn, tgt_n) = create(&mut r, &tgt);
        assert_eq!((s, syn), (0, 0));
        {
            let dev = crate::device::lock(&r.h.dev.shared);
            let (i, t) = (dev.fw.qps.get(&ini_n).unwrap(), dev.fw.qps.get(&tgt_n).unwrap());
            // Both run RC's transport in their domain; neither receives through the SRQ its context names.
            assert_eq!((i.st, i.xrcd, i.srqn, i.has_sq), (QpType::Rc, Some(x1), None, true));
            assert_eq!((t.st, t.xrcd, t.srqn, t.has_sq, t.has_rq), (QpType::Rc, Some(x0), None, false, false));
        }
        // QUERY_QP gives the transport and domain back.
        let mut qin = vec![0u8; ifc::query_qp_in::SIZE_BYTES];
        qin.set(ifc::mbox_in::OPCODE, k::MLX5_CMD_OP_QUERY_QP.into());
        qin.set(ifc::query_qp_in::QPN, tgt_n);
        let (_, _, out) = r.h.cmd(&qin, ifc::query_qp_out::SIZE_BYTES);
        let got = |f: Field| rd(&out, f.at(ifc::query_qp_out::QPC));
        assert_eq!(
            (got(q::ST), got(q::XRCD), got(q::RQ_TYPE), got(q::NO_SQ)),
            (k::MLX5_QP_ST_XRC, x0, k::MLX5_SRQ_RQ, 1)
        );
        // A domain that does not exist, or a device without `xrc`, is refused.
        tgt.set(at(q::XRCD), x1 + 5);
        assert_eq!(create(&mut r, &tgt).1, syndrome::XRCD_INVALID);
        tgt.set(at(q::XRCD), x0);
        crate::device::lock(&r.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::XRC, 0);
        assert_eq!(create(&mut r, &tgt).1, syndrome::QP_TYPE);
    }

    #[test]
    fn a_user_buffer_may_start_inside_its_first_page() {
        // qpc.page_offset counts 1/64ths of a page: the WQ starts there, and the pages must cover it.
        use ifc::qpc as q;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        // 16 x 64-byte receives and 16 send basic blocks: 2 KiB, one page.
        let spec = QpSpec { log_rq: 4, log_sq: 4, ..QpSpec::rc() };
        let (mut inp, _, _) = r.create_qp_in(spec, cq.cqn, cq.cqn);
        inp.set(q::PAGE_OFFSET.at(ifc::create_qp_in::QPC), 1);
        let (s, syn, n) = create(&mut r, &inp);
        assert_eq!((s, syn), (0, 0));
        let mut qin = vec![0u8; ifc::query_qp_in::SIZE_BYTES];
        qin.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_QP.into());
        qin.set(ifc::query_qp_in::QPN, n);
        let (_, _, out) = r.h.cmd(&qin, ifc::query_qp_out::SIZE_BYTES);
        assert_eq!(rd(&out, q::PAGE_OFFSET.at(ifc::query_qp_out::QPC)), 1);
        // 63/64 of a page in, the 2 KiB no longer fit the one page given.
        inp.set(q::PAGE_OFFSET.at(ifc::create_qp_in::QPC), 63);
        assert_eq!(create(&mut r, &inp).1, syndrome::PAS_TOO_FEW);
    }

    #[test]
    fn create_qp_validates_its_context() {
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        const CTX: Sub = ifc::create_qp_in::QPC;
        let spec = QpSpec::rc();
        // The 4-bit log sizes cannot exceed the default log_max_qp_sz (15): lower the capability.
        crate::device::lock(&r.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::LOG_MAX_QP_SZ, 12);
        let try_with = |r: &mut Rdma, spec: QpSpec, f: &dyn Fn(&mut Vec<u8>)| {
            let (mut inp, _, _) = r.create_qp_in(spec, cq.cqn, cq.cqn);
            f(&mut inp);
            create(r, &inp)
        };
        type Edit = Box<dyn Fn(&mut Vec<u8>)>;
        let cases: Vec<(Edit, u8, u32)> = vec![
            // An XRC QP names a domain that exists.
            (
                Box::new(|i| i.set(ifc::qpc::ST.at(CTX), consts::MLX5_QP_ST_XRC)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::XRCD_INVALID,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::PM_STATE.at(CTX), consts::MLX5_QP_PM_ARMED)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::QP_PM_STATE,
            ),
            (Box::new(|i| i.set(ifc::qpc::PD.at(CTX), 999)), consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::PD_INVALID),
            (
                Box::new(|i| i.set(ifc::qpc::CQN_SND.at(CTX), 999)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::CQ_INVALID,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::CQN_RCV.at(CTX), 999)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::CQ_INVALID,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::UAR_PAGE.at(CTX), 999)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::UAR_INVALID,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::LOG_SQ_SIZE.at(CTX), 13)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::LOG_SIZE,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::LOG_RQ_SIZE.at(CTX), 13)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::LOG_SIZE,
            ),
            // 16 << 6 = 1024 bytes per RQ WQE, above max_wqe_sz_rq (512).
            (
                Box::new(|i| i.set(ifc::qpc::LOG_RQ_STRIDE.at(CTX), 6)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::QP_WQE_SIZE,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::RQ_TYPE.at(CTX), consts::MLX5_CRQ_RQ)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::QP_RQ_TYPE,
            ),
            // An SRQ RQ needs an SRQ that exists; an XRC domain named must exist.
            (
                Box::new(|i| {
                    i.set(ifc::qpc::RQ_TYPE.at(CTX), consts::MLX5_SRQ_RQ);
                    i.set(ifc::qpc::SRQN_RMPN_XRQN.at(CTX), 0x77);
                }),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::SRQ_INVALID,
            ),
            (
                Box::new(|i| i.set(ifc::qpc::XRCD.at(CTX), 0x77)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::XRCD_INVALID,
            ),
            (
                Box::new(|i| i.set64(ifc::qpc::DBR_ADDR.at(CTX), 0x10)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::DBR_NOT_MAPPED,
            ),
            (
                Box::new(|i| i.set(ifc::create_qp_in::INPUT_QPN, 0x200)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::QP_FEATURE,
            ),
            // The device's RoCE timestamps are free-running only (qp_ts_format 0): real-time is refused.
            (
                Box::new(|i| i.set(ifc::qpc::TS_FORMAT.at(CTX), consts::MLX5_TIMESTAMP_FORMAT_REAL_TIME)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::QP_TS_FORMAT,
            ),
            (Box::new(|i| i.truncate(i.len() - 8)), consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::PAS_TOO_FEW),
            (
                Box::new(|i| i.set64(ifc::create_qp_in::PAS.elem(1), 0x7000)),
                consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
                syndrome::PAS_NOT_MAPPED,
            ),
        ];
        for (k, (f, status, synd)) in cases.iter().enumerate() {
            let (s, syn, _) = try_with(&mut r, spec, f.as_ref());
            assert_eq!((s, syn), (*status, *synd), "case {k}");
        }
        assert_eq!(r.h.dev.qp_count(), 0);
        // A good one: QPNs are 24 bits from 0x100, sizes as asked.
        let qp = r.qp(spec, cq.cqn, cq.cqn);
        assert!((QPN_FIRST..QPN_END).contains(&qp.qpn));
        let info = r.h.dev.qp_info(qp.qpn).unwrap();
        assert_eq!(
            (info.state, info.st, info.sq_wqebbs, info.rq_wqes, info.rq_stride),
            (QpState::Rst, QpType::Rc, 64, 16, 64)
        );
        assert_eq!((info.pd, info.uar, info.cqn_snd, info.cqn_rcv), (r.pd, r.uar, cq.cqn, cq.cqn));
        // A UD QP without an RQ and an RC QP without an SQ need no buffer for them.
        let ud = r.qp(QpSpec { zero_rq: true, ..QpSpec::ud() }, cq.cqn, 0);
        assert_eq!(r.h.dev.qp_info(ud.qpn).unwrap().rq_wqes, 0);
        let rq_only = r.qp(QpSpec { no_sq: true, ..QpSpec::rc() }, 0, cq.cqn);
        assert_eq!(r.h.dev.qp_info(rq_only.qpn).unwrap().sq_wqebbs, 0);
        // The CQ, PD and UAR are in use while a QP refers to them.
        let in_use = (consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR, syndrome::IN_USE);
        assert_eq!(destroy(&mut r, consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cq.cqn), in_use);
        let (pd, uar) = (r.pd, r.uar);
        assert_eq!(destroy(&mut r, consts::MLX5_CMD_OP_DEALLOC_PD, ifc::dealloc_pd_in::PD, pd), in_use);
        assert_eq!(destroy(&mut r, consts::MLX5_CMD_OP_DEALLOC_UAR, ifc::dealloc_uar_in::UAR, uar), in_use);
        for q in [qp.qpn, ud.qpn, rq_only.qpn] {
            assert_eq!(destroy(&mut r, consts::MLX5_CMD_OP_DESTROY_QP, ifc::destroy_qp_in::QPN, q), (0, 0));
        }
        let again = destroy(&mut r, consts::MLX5_CMD_OP_DESTROY_QP, ifc::destroy_qp_in::QPN, qp.qpn);
        assert_eq!(again, (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_INVALID));
        assert_eq!(r.h.dev.qp_info(qp.qpn), None);
        assert_eq!(destroy(&mut r, consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cq.cqn), (0, 0));
    }

    #[test]
    fn the_state_machine_refuses_wrong_states_and_stores_each_transition() {
        use consts as k;
        use ifc::qpc as q;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let qp = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        let n = qp.qpn;
        let wrong = (consts::MLX5_CMD_STAT_BAD_QP_STATE_ERR, syndrome::QP_STATE);
        let state = |r: &Rdma| r.h.dev.qp_info(n).unwrap().state;
        // From RST only RST2INIT, 2ERR and 2RST go.
        for op in [k::MLX5_CMD_OP_INIT2RTR_QP, k::MLX5_CMD_OP_RTR2RTS_QP, k::MLX5_CMD_OP_RTS2RTS_QP] {
            assert_eq!(r.modify(op, n, 0, |_, _| {}), wrong, "opcode {op:#x}");
        }
        assert_eq!(r.modify(k::MLX5_CMD_OP_2ERR_QP, n, 0, |_, _| {}), (0, 0));
        assert_eq!(state(&r), QpState::Err);
        assert_eq!(r.modify(k::MLX5_CMD_OP_2RST_QP, n, 0, |_, _| {}), (0, 0));
        assert_eq!(state(&r), QpState::Rst);
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n + 1, 0, |_, _| {}),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_INVALID)
        );
        // Port 2 does not exist; pkey index 200 is beyond the 128-entry table.
        let port =
            |p: u32| move |i: &mut Vec<u8>, c: Sub| i.set(ifc::ads::VHCA_PORT_NUM.at(q::PRIMARY_ADDRESS_PATH.at(c)), p);
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, port(2)),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::BAD_PORT)
        );
        let big_pkey = |i: &mut Vec<u8>, c: Sub| {
            port(1)(i, c);
            i.set(ifc::ads::PKEY_INDEX.at(q::PRIMARY_ADDRESS_PATH.at(c)), 200);
        };
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, big_pkey),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_PKEY_INDEX)
        );
        assert_eq!(state(&r), QpState::Rst);
        let no_mode = |i: &mut Vec<u8>, c: Sub| {
            port(1)(i, c);
            i.set(q::RRE.at(c), 1);
            i.set(q::RAE.at(c), 1);
        };
        // Remote atomics need an atomic mode the device has (it has IB-compatible 8-byte atomics only).
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, no_mode),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_ATOMIC_MODE)
        );
        let wide_mode = |i: &mut Vec<u8>, c: Sub| {
            no_mode(i, c);
            i.set(q::ATOMIC_MODE.at(c), k::MLX5_ATOMIC_MODE_16B);
        };
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, wide_mode),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_ATOMIC_MODE)
        );
        // A counter set nobody allocated is refused too.
        let stray_counter = |i: &mut Vec<u8>, c: Sub| {
            port(1)(i, c);
            i.set(q::COUNTER_SET_ID.at(c), 5);
        };
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, stray_counter),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::Q_COUNTER_INVALID)
        );
        let access = |i: &mut Vec<u8>, c: Sub| {
            no_mode(i, c);
            i.set(q::ATOMIC_MODE.at(c), k::MLX5_ATOMIC_MODE_IB_COMP);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, access), (0, 0));
        assert_eq!(r.h.dev.qp_info(n).unwrap().remote_access, (true, false, true));
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, access), wrong);
        assert_eq!(r.modify(k::MLX5_CMD_OP_RTR2RTS_QP, n, 0, |_, _| {}), wrong);
        // INIT2RTR checks the MTU, the caps and the RoCE path.
        let me = r.me(0x4242);
        // `rgid`: whether the path names the remote GID (a RoCE path without one is refused; its `grh` bit is 0,
        // as mlx5_set_path leaves it on RoCE).
        let rtr = |mtu: u32, rgid: bool, rra: u32| {
            let path_r = me;
            move |r: &Rdma, i: &mut Vec<u8>, c: Sub| {
                r.path(i, c, &path_r);
                let p = q::PRIMARY_ADDRESS_PATH.at(c);
                i.set(ifc::ads::GRH.at(p), 0);
                if !rgid {
                    let g = ifc::ads::RGID_RIP.byte_off() + p.off;
                    i[g..g + 16].fill(0);
                }
                i.set(q::MTU.at(c), mtu);
                i.set(q::LOG_MSG_MAX.at(c), 20);
                i.set(q::REMOTE_QPN.at(c), path_r.qpn);
                i.set(q::NEXT_RCV_PSN.at(c), 0x77);
                i.set(q::LOG_RRA_MAX.at(c), rra);
                i.set(q::MIN_RNR_NAK.at(c), 5);
            }
        };
        // The qpc is prepared apart (filling a path needs the device) and copied into the command.
        let fix = |r: &mut Rdma, op: u16, opt: u32, f: &dyn Fn(&Rdma, &mut Vec<u8>, Sub)| {
            let mut inp = vec![0u8; ifc::init2rtr_qp_in::SIZE_BYTES];
            f(r, &mut inp, ifc::init2rtr_qp_in::QPC);
            r.modify(op, n, opt, move |i, c| i[c.off..c.off + c.len].copy_from_slice(&inp[c.off..c.off + c.len]))
        };
        assert_eq!(
            fix(&mut r, k::MLX5_CMD_OP_INIT2RTR_QP, 0, &rtr(0, true, 2)),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_MTU)
        );
        assert_eq!(
            fix(&mut r, k::MLX5_CMD_OP_INIT2RTR_QP, 0, &rtr(3, false, 2)),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_PATH)
        );
        // log_max_ra_res_qp is 4.
        assert_eq!(
            fix(&mut r, k::MLX5_CMD_OP_INIT2RTR_QP, 0, &rtr(3, true, 5)),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_CONTEXT)
        );
        assert_eq!(state(&r), QpState::Init);
        assert_eq!(fix(&mut r, k::MLX5_CMD_OP_INIT2RTR_QP, 0, &rtr(3, true, 2)), (0, 0));
        let info = r.h.dev.qp_info(n).unwrap();
        assert_eq!((info.state, info.remote_qpn, info.next_rcv_psn, info.min_rnr_nak), (QpState::Rtr, 0x4242, 0x77, 5));
        let rts = |i: &mut Vec<u8>, c: Sub| {
            i.set(q::NEXT_SEND_PSN.at(c), 0x99);
            i.set(q::RETRY_COUNT.at(c), 6);
            i.set(q::RNR_RETRY.at(c), 5);
            i.set(q::LOG_SRA_MAX.at(c), 1);
            i.set(ifc::ads::ACK_TIMEOUT.at(q::PRIMARY_ADDRESS_PATH.at(c)), 14);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_RTR2RTS_QP, n, 0, rts), (0, 0));
        let info = r.h.dev.qp_info(n).unwrap();
        assert_eq!(
            (info.state, info.next_send_psn, info.retry_count, info.rnr_retry, info.ack_timeout),
            (QpState::Rts, 0x99, 6, 5, 14)
        );
        // RTS2RTS changes only what its optional parameters name.
        let rts2rts = |i: &mut Vec<u8>, c: Sub| {
            i.set(q::MIN_RNR_NAK.at(c), 20);
            i.set(q::RETRY_COUNT.at(c), 1);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_RTS2RTS_QP, n, k::MLX5_QP_OPTPAR_RNR_TIMEOUT, rts2rts), (0, 0));
        let info = r.h.dev.qp_info(n).unwrap();
        assert_eq!((info.min_rnr_nak, info.retry_count), (20, 6));
        // QUERY_QP reports the context.
        let (s, out) = r.query_qp(n);
        assert_eq!(s, 0);
        let c = ifc::query_qp_out::QPC;
        let get = |f: Field| rd(&out, f.at(c));
        assert_eq!((get(q::STATE), get(q::ST), get(q::PD)), (k::MLX5_QP_STATE_RTS.into(), k::MLX5_QP_ST_RC, r.pd));
        assert_eq!((get(q::REMOTE_QPN), get(q::NEXT_SEND_PSN), get(q::NEXT_RCV_PSN)), (0x4242, 0x99, 0x77));
        assert_eq!((get(q::MTU), get(q::MIN_RNR_NAK), get(q::RRE), get(q::RWE)), (3, 20, 1, 0));
        assert_eq!((get(q::LOG_SQ_SIZE), get(q::LOG_RQ_SIZE), get(q::CQN_SND)), (6, 4, cq.cqn));
        let p = q::PRIMARY_ADDRESS_PATH.at(c);
        // The path as INIT2RTR set it: a RoCE path's `grh` stays 0.
        assert_eq!((rd(&out, ifc::ads::GRH.at(p)), rd(&out, ifc::ads::ACK_TIMEOUT.at(p))), (0, 14));
        assert_eq!(rd(&out, ifc::ads::VHCA_PORT_NUM.at(p)), 1);
        let g = p.off + ifc::ads::RGID_RIP.byte_off();
        assert_eq!(out[g..g + 16], r.h.dev.gid(0).unwrap());
        // 2ERR from any state but RST; 2RST from any.
        assert_eq!(r.modify(k::MLX5_CMD_OP_2ERR_QP, n, 0, |_, _| {}), (0, 0));
        assert_eq!(state(&r), QpState::Err);
        assert_eq!(r.modify(k::MLX5_CMD_OP_RTS2RTS_QP, n, 0, |_, _| {}), wrong);
        assert_eq!(r.modify(k::MLX5_CMD_OP_2ERR_QP, n, 0, |_, _| {}), (0, 0));
        assert_eq!(r.modify(k::MLX5_CMD_OP_2RST_QP, n, 0, |_, _| {}), (0, 0));
        assert_eq!(r.modify(k::MLX5_CMD_OP_2RST_QP, n, 0, |_, _| {}), (0, 0));
        assert_eq!(state(&r), QpState::Rst);
        assert_eq!(rd(&r.query_qp(n).1, q::STATE.at(c)), k::MLX5_QP_STATE_RST.into());
        // The whole way again after the reset.
        r.connect_rc(&qp, &me, Default::default());
        assert_eq!(state(&r), QpState::Rts);
    }

    #[test]
    fn ud_and_ib_transitions() {
        use consts as k;
        use ifc::qpc as q;
        let mut r = Rdma::new(SimConfig { port_type: PortType::Ib, lid: 7, ..SimConfig::default() });
        let cq = r.cq(4);
        // A UD INIT2RTR without an MTU is refused (mlx5_ib sends IB_MTU_4096 with every UD modify).
        let bare = r.qp(QpSpec::ud(), cq.cqn, cq.cqn);
        let init = |i: &mut Vec<u8>, c: Sub| i.set(ifc::ads::VHCA_PORT_NUM.at(q::PRIMARY_ADDRESS_PATH.at(c)), 1);
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, bare.qpn, 0, init), (0, 0));
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_INIT2RTR_QP, bare.qpn, 0, |_, _| {}),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_MTU)
        );
        assert_eq!(r.h.dev.qp_info(bare.qpn).unwrap().state, QpState::Init);
        let ud = r.qp(QpSpec::ud(), cq.cqn, cq.cqn);
        r.ready_ud(&ud, 0x1111_2222);
        let (_, out) = r.query_qp(ud.qpn);
        let c = ifc::query_qp_out::QPC;
        assert_eq!((rd(&out, q::MTU.at(c)), rd(&out, q::LOG_MSG_MAX.at(c))), (k::IB_MTU_4096.into(), 12));
        let info = r.h.dev.qp_info(ud.qpn).unwrap();
        assert_eq!((info.state, info.st, info.q_key, info.next_send_psn), (QpState::Rts, QpType::Ud, 0x1111_2222, 1));
        // A new qkey as an optional parameter of RTS2RTS.
        let st = r.modify(k::MLX5_CMD_OP_RTS2RTS_QP, ud.qpn, k::MLX5_QP_OPTPAR_Q_KEY, |i, c| i.set(q::Q_KEY.at(c), 5));
        assert_eq!(st, (0, 0));
        assert_eq!(r.h.dev.qp_info(ud.qpn).unwrap().q_key, 5);
        // IB RC paths need a LID.
        let rc = r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, rc.qpn, 0, init), (0, 0));
        let no_lid = |i: &mut Vec<u8>, c: Sub| i.set(q::MTU.at(c), k::IB_MTU_2048.into());
        assert_eq!(
            r.modify(k::MLX5_CMD_OP_INIT2RTR_QP, rc.qpn, 0, no_lid),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::QP_PATH)
        );
        let me = Remote { qpn: ud.qpn, lid: 7, gid: [0; 16], mac: [0; 6] };
        assert_eq!(r.h.dev.lid(), 7);
        let mut inp = vec![0u8; ifc::init2rtr_qp_in::SIZE_BYTES];
        r.path(&mut inp, ifc::init2rtr_qp_in::QPC, &me);
        let st = r.modify(k::MLX5_CMD_OP_INIT2RTR_QP, rc.qpn, 0, |i, c| {
            i[c.off..c.off + c.len].copy_from_slice(&inp[c.off..c.off + c.len]);
            i.set(q::MTU.at(c), k::IB_MTU_2048.into());
        });
        assert_eq!(st, (0, 0));
        assert_eq!(r.h.dev.qp_info(rc.qpn).unwrap().state, QpState::Rtr);
    }

    #[test]
    fn init2init_changes_only_what_its_options_name() {
        // rping -q moves its own QP INIT to INIT (rdma_init_qp_attr's attributes through ibv_modify_qp).
        use consts as k;
        use ifc::qpc as q;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let n = r.qp(QpSpec::rc(), cq.cqn, cq.cqn).qpn;
        let ads = |f: Field, c: Sub| f.at(q::PRIMARY_ADDRESS_PATH.at(c));
        let wrong = (k::MLX5_CMD_STAT_BAD_QP_STATE_ERR, syndrome::QP_STATE);
        // Only from INIT.
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, n, 0, |_, _| {}), wrong);
        let init = |i: &mut Vec<u8>, c: Sub| {
            i.set(ads(ifc::ads::VHCA_PORT_NUM, c), PORT);
            i.set(q::RWE.at(c), 1);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, n, 0, init), (0, 0));
        // Without options, a context that says otherwise changes nothing.
        let other = |i: &mut Vec<u8>, c: Sub| {
            i.set(q::RRE.at(c), 1);
            i.set(ads(ifc::ads::PKEY_INDEX, c), 5);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, n, 0, other), (0, 0));
        let info = r.h.dev.qp_info(n).unwrap();
        assert_eq!((info.state, info.remote_access), (QpState::Init, (false, true, false)));
        let pkey = |r: &mut Rdma| rd(&r.query_qp(n).1, ads(ifc::ads::PKEY_INDEX, ifc::query_qp_out::QPC));
        assert_eq!(pkey(&mut r), 0);
        // A port that does not exist, or a pkey index past the table: refused, nothing changed.
        let access = k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE;
        let all = access | k::MLX5_QP_OPTPAR_PKEY_INDEX | k::MLX5_QP_OPTPAR_PRI_PORT;
        let port2 = |i: &mut Vec<u8>, c: Sub| {
            other(i, c);
            i.set(ads(ifc::ads::VHCA_PORT_NUM, c), 2);
        };
        let refused = |syn| (k::MLX5_CMD_STAT_BAD_PARAM_ERR, syn);
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, n, all, port2), refused(syndrome::BAD_PORT));
        let pkey200 = |i: &mut Vec<u8>, c: Sub| i.set(ads(ifc::ads::PKEY_INDEX, c), 200);
        let st = r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, n, k::MLX5_QP_OPTPAR_PKEY_INDEX, pkey200);
        assert_eq!(st, refused(syndrome::QP_PKEY_INDEX));
        assert_eq!(r.h.dev.qp_info(n).unwrap().remote_access, (false, true, false));
        // With the options: the access rights and the pkey index as the context gives them.
        let port1 = |i: &mut Vec<u8>, c: Sub| {
            other(i, c);
            i.set(ads(ifc::ads::VHCA_PORT_NUM, c), PORT);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, n, all, port1), (0, 0));
        let info = r.h.dev.qp_info(n).unwrap();
        assert_eq!((info.state, info.remote_access), (QpState::Init, (true, false, false)));
        assert_eq!(pkey(&mut r), 5);
        // A UD QP takes a new qkey, and goes on to RTR from there.
        let ud = r.qp(QpSpec::ud(), cq.cqn, cq.cqn).qpn;
        let ud_init = |i: &mut Vec<u8>, c: Sub| {
            i.set(ads(ifc::ads::VHCA_PORT_NUM, c), PORT);
            i.set(q::Q_KEY.at(c), 0x1111);
        };
        assert_eq!(r.modify(k::MLX5_CMD_OP_RST2INIT_QP, ud, 0, ud_init), (0, 0));
        let st =
            r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, ud, k::MLX5_QP_OPTPAR_Q_KEY, |i, c| i.set(q::Q_KEY.at(c), 0x2222));
        assert_eq!(st, (0, 0));
        assert_eq!(r.h.dev.qp_info(ud).unwrap().q_key, 0x2222);
        let rtr = |i: &mut Vec<u8>, c: Sub| i.set(q::MTU.at(c), k::IB_MTU_4096.into());
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2RTR_QP, ud, 0, rtr), (0, 0));
        assert_eq!(r.modify(k::MLX5_CMD_OP_INIT2INIT_QP, ud, 0, |_, _| {}), wrong);
        assert_eq!(r.h.dev.qp_info(ud).unwrap().state, QpState::Rtr);
    }

    #[test]
    fn teardown_destroys_qps() {
        let mut r = Rdma::inline();
        let cq = r.cq(3);
        r.qp(QpSpec::rc(), cq.cqn, cq.cqn);
        assert_eq!(r.h.dev.qp_count(), 1);
        let (s, _, _) = r.h.simple(consts::MLX5_CMD_OP_TEARDOWN_HCA, 0, 16, 16);
        assert_eq!(s, 0);
        assert_eq!(r.h.dev.qp_count(), 0);
        // Nothing is left that could touch the buffers.
        let region = r.h.dma.alloc(64, 64).unwrap();
        // SAFETY: the region came from this allocator and nothing refers to it.
        unsafe { r.h.dma.free(region) };
        let _ = SimDevice::default();
    }
}

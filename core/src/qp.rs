//! Queue pairs (PRM CREATE_QP / RST2INIT / INIT2RTR / RTR2RTS / RTS2RTS / 2ERR / 2RST / QUERY_QP / DESTROY_QP;
//! mlx5_ib `qp.c` and `wr.c`, rdma-core `providers/mlx5/qp.c` and `verbs.c`).
//!
//! One buffer holds the receive queue (from byte 0) and the send queue (right after it). Send WQEs are made of
//! 16-byte segments in 64-byte basic blocks (BBs) and may wrap from the end of the SQ to its start; receive WQEs
//! are arrays of data segments. The driver's own bookkeeping (`wr_id` per WQE, which WQE a completion retires up
//! to) lives in a host-only array, allocated from the DMA allocator because the core has no heap; the device never
//! sees it.

use crate::buf::QueueBuf;
use crate::cmd::{len_with_pas, write_pas, Pas};
use crate::cmdq::{write_header, CmdError, Command};
use crate::cq::{WcOpcode, WcStatus, WorkCompletion, WrTable};
use crate::dbr::DbRec;
use crate::hal::{DmaRegion, Mmio, Span};
use crate::mkey::Access;
use crate::prm::{c, consts, ifc, Bytes, Field, MsgBuf, Opcode, Sub, SubBuf};
use crate::uar::BfReg;

// ---------------------------------------------------------------------------------------------------------------
// Types and attributes

/// Transport service (`qpc.st`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable datagram.
    Ud,
}

impl QpType {
    const fn st(self) -> u32 {
        match self {
            QpType::Rc => consts::MLX5_QP_ST_RC,
            QpType::Ud => consts::MLX5_QP_ST_UD,
        }
    }
}

/// QP state (`ibv_qp_state`; `MLX5_QP_STATE_*` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
    Unknown(u8),
}

impl QpState {
    pub const fn from_raw(v: u8) -> Self {
        match v as u32 {
            consts::MLX5_QP_STATE_RST => QpState::Reset,
            consts::MLX5_QP_STATE_INIT => QpState::Init,
            consts::MLX5_QP_STATE_RTR => QpState::Rtr,
            consts::MLX5_QP_STATE_RTS => QpState::Rts,
            consts::MLX5_QP_STATE_SQD => QpState::Sqd,
            consts::MLX5_QP_STATE_SQER => QpState::Sqe,
            consts::MLX5_QP_STATE_ERR => QpState::Err,
            _ => QpState::Unknown(v),
        }
    }
}

/// Requested capabilities (`ibv_qp_cap`); [`Qp::cap`] reports what was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// Path MTU (`ib_mtu`: 1 = 256 ... 5 = 4096 bytes, the `qpc.mtu` encoding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Mtu {
    M256 = 1,
    M512 = 2,
    M1024 = 3,
    M2048 = 4,
    M4096 = 5,
}

impl Mtu {
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// Global routing header of an address (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grh {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// Where packets go (`ibv_ah_attr`): LID and SL on InfiniBand; GRH and destination MAC for RoCE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub grh: Option<Grh>,
    /// RoCE only: the next hop's MAC address.
    pub dmac: [u8; 6],
    pub port_num: u8,
}

/// Which [`QpAttr`] fields a modify sets (`ibv_qp_attr_mask`, same bit values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttrMask(pub u32);

impl QpAttrMask {
    pub const STATE: QpAttrMask = QpAttrMask(1 << 0);
    pub const ACCESS_FLAGS: QpAttrMask = QpAttrMask(1 << 3);
    pub const PKEY_INDEX: QpAttrMask = QpAttrMask(1 << 4);
    pub const PORT: QpAttrMask = QpAttrMask(1 << 5);
    pub const QKEY: QpAttrMask = QpAttrMask(1 << 6);
    pub const AV: QpAttrMask = QpAttrMask(1 << 7);
    pub const PATH_MTU: QpAttrMask = QpAttrMask(1 << 8);
    pub const TIMEOUT: QpAttrMask = QpAttrMask(1 << 9);
    pub const RETRY_CNT: QpAttrMask = QpAttrMask(1 << 10);
    pub const RNR_RETRY: QpAttrMask = QpAttrMask(1 << 11);
    pub const RQ_PSN: QpAttrMask = QpAttrMask(1 << 12);
    pub const MAX_QP_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 13);
    pub const MIN_RNR_TIMER: QpAttrMask = QpAttrMask(1 << 15);
    pub const SQ_PSN: QpAttrMask = QpAttrMask(1 << 16);
    pub const MAX_DEST_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 17);
    pub const DEST_QPN: QpAttrMask = QpAttrMask(1 << 20);

    pub const fn empty() -> Self {
        QpAttrMask(0)
    }
    pub const fn contains(self, o: QpAttrMask) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for QpAttrMask {
    type Output = QpAttrMask;
    fn bitor(self, o: QpAttrMask) -> QpAttrMask {
        QpAttrMask(self.0 | o.0)
    }
}

/// Attributes of a state transition (`ibv_qp_attr`); [`QpAttrMask`] says which are meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    pub qp_state: QpState,
    /// Remote read / write / atomic rights of the responder.
    pub qp_access_flags: Access,
    pub pkey_index: u16,
    pub port_num: u8,
    pub qkey: u32,
    pub ah_attr: AhAttr,
    pub path_mtu: Mtu,
    /// Local ACK timeout: 4.096 µs × 2^timeout.
    pub timeout: u8,
    pub retry_cnt: u8,
    /// 7 means retry forever.
    pub rnr_retry: u8,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub dest_qp_num: u32,
}

impl Default for QpAttr {
    fn default() -> Self {
        Self {
            qp_state: QpState::Reset,
            qp_access_flags: Access::default(),
            pkey_index: 0,
            port_num: 1,
            qkey: 0,
            ah_attr: AhAttr::default(),
            path_mtu: Mtu::M1024,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            rq_psn: 0,
            sq_psn: 0,
            max_rd_atomic: 1,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            dest_qp_num: 0,
        }
    }
}

/// Why a modify was refused before any command was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum ModifyError {
    /// Not a transition verbs allows (`ib_modify_qp_is_ok`).
    BadTransition { from: QpState, to: QpState },
    /// Attributes this transition requires are missing.
    MissingAttr { missing: u32 },
    /// Attributes this transition does not take.
    ExtraAttr { extra: u32 },
    /// A value out of range (port, rnr_retry, ...).
    BadValue { what: &'static str, value: u32 },
}

impl core::fmt::Display for ModifyError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ModifyError::BadTransition { from, to } => write!(f, "QP transition {from:?} -> {to:?} is not allowed"),
            ModifyError::MissingAttr { missing } => write!(f, "QP transition misses attributes (mask {missing:#x})"),
            ModifyError::ExtraAttr { extra } => write!(f, "QP transition does not take attributes (mask {extra:#x})"),
            ModifyError::BadValue { what, value } => write!(f, "QP attribute {what} = {value} is out of range"),
        }
    }
}

/// Required and optional attributes of each transition (verbs' `qp_state_table`, for RC and UD).
fn transition_masks(ty: QpType, from: QpState, to: QpState) -> Option<(QpAttrMask, QpAttrMask)> {
    use QpAttrMask as M;
    use QpState::*;
    let rc = ty == QpType::Rc;
    let none = M::empty();
    Some(match (from, to) {
        (_, Reset) | (_, Err) if !matches!(from, Unknown(_)) => (none, none),
        (Reset, Init) if rc => (M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none),
        (Reset, Init) => (M::PKEY_INDEX | M::PORT | M::QKEY, none),
        (Init, Init) if rc => (none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
        (Init, Init) => (none, M::PKEY_INDEX | M::PORT | M::QKEY),
        (Init, Rtr) if rc => (
            M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER,
            M::ACCESS_FLAGS | M::PKEY_INDEX,
        ),
        (Init, Rtr) => (none, M::PKEY_INDEX | M::QKEY),
        (Rtr, Rts) if rc => (
            M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
            M::ACCESS_FLAGS | M::MIN_RNR_TIMER,
        ),
        (Rtr, Rts) => (M::SQ_PSN, M::QKEY),
        (Rts, Rts) if rc => (none, M::ACCESS_FLAGS | M::MIN_RNR_TIMER),
        (Rts, Rts) => (none, M::QKEY),
        _ => return None,
    })
}

/// The mask a `from` → `to` modify must carry: the state bit and verbs' required attributes (`ibv_modify_qp`'s
/// table, the one [`check_modify`] enforces); `None` for a transition verbs does not allow.
pub fn required_attrs(ty: QpType, from: QpState, to: QpState) -> Option<QpAttrMask> {
    transition_masks(ty, from, to).map(|(req, _)| QpAttrMask::STATE | req)
}

/// Checks a modify against the transition table (before any command is sent).
pub fn check_modify(ty: QpType, from: QpState, attr: &QpAttr, mask: QpAttrMask) -> Result<(), ModifyError> {
    let to = if mask.contains(QpAttrMask::STATE) { attr.qp_state } else { from };
    let (req, opt) = transition_masks(ty, from, to).ok_or(ModifyError::BadTransition { from, to })?;
    let given = QpAttrMask(mask.0 & !QpAttrMask::STATE.0);
    let missing = req.0 & !given.0;
    if missing != 0 {
        return Err(ModifyError::MissingAttr { missing });
    }
    let extra = given.0 & !(req.0 | opt.0);
    if extra != 0 {
        return Err(ModifyError::ExtraAttr { extra });
    }
    if given.contains(QpAttrMask::PORT) && attr.port_num != 1 {
        return Err(ModifyError::BadValue { what: "port_num", value: attr.port_num.into() });
    }
    for (m, what, v, max) in [
        (QpAttrMask::RNR_RETRY, "rnr_retry", attr.rnr_retry, 7u8),
        (QpAttrMask::RETRY_CNT, "retry_cnt", attr.retry_cnt, 7),
        (QpAttrMask::TIMEOUT, "timeout", attr.timeout, 31),
        (QpAttrMask::MIN_RNR_TIMER, "min_rnr_timer", attr.min_rnr_timer, 31),
    ] {
        if given.contains(m) && v > max {
            return Err(ModifyError::BadValue { what, value: v.into() });
        }
    }
    for (m, what, v) in [(QpAttrMask::RQ_PSN, "rq_psn", attr.rq_psn), (QpAttrMask::SQ_PSN, "sq_psn", attr.sq_psn)] {
        if given.contains(m) && v > 0xff_ffff {
            return Err(ModifyError::BadValue { what, value: v });
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// Commands

/// The `qpc` of CREATE_QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpContext {
    pub qp_type: QpType,
    pub pd: u32,
    pub uar_page: u32,
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    pub log_sq_size: u8,
    pub log_rq_size: u8,
    /// RQ WQE size is `16 << log_rq_stride`.
    pub log_rq_stride: u8,
    pub no_sq: bool,
    pub log_page_size: u8,
    pub dbr_addr: u64,
}

/// `CREATE_QP`; the output is the QP number.
#[derive(Debug, Clone, Copy)]
pub struct CreateQp<'a> {
    pub ctx: QpContext,
    pub pas: Pas<'a>,
}

impl Command for CreateQp<'_> {
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateQp
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_qp_in::PAS, self.pas.len())
    }
    fn outlen(&self) -> usize {
        ifc::create_qp_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::qpc as q;
        write_header(msg, Opcode::CreateQp, 0);
        {
            let mut c = SubBuf::new(msg, ifc::create_qp_in::QPC);
            let x = &self.ctx;
            c.set(q::ST, x.qp_type.st());
            c.set(q::PM_STATE, consts::MLX5_QP_PM_MIGRATED);
            c.set(q::PD, x.pd);
            c.set(q::UAR_PAGE, x.uar_page);
            c.set(q::LOG_PAGE_SIZE, x.log_page_size.into());
            c.set(q::LOG_RQ_SIZE, x.log_rq_size.into());
            c.set(q::LOG_RQ_STRIDE, x.log_rq_stride.into());
            if x.no_sq {
                c.set(q::NO_SQ, 1);
            } else {
                c.set(q::LOG_SQ_SIZE, x.log_sq_size.into());
            }
            c.set(q::CQN_SND, x.cqn_snd);
            c.set(q::CQN_RCV, x.cqn_rcv);
            c.set64(q::DBR_ADDR, x.dbr_addr);
        }
        write_pas(msg, ifc::create_qp_in::PAS, self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u32, CmdError> {
        Ok(out.get(ifc::create_qp_out::QPN))
    }
}

/// `DESTROY_QP`.
pub fn destroy_qp(qpn: u32) -> crate::cmd::Simple {
    crate::cmd::Simple::new(Opcode::DestroyQp, ifc::destroy_qp_in::SIZE_BYTES, ifc::destroy_qp_out::SIZE_BYTES)
        .arg(ifc::destroy_qp_in::QPN, qpn)
}

/// One firmware state-transition command (`mlx5_core_qp_modify`): which opcode, and where its fields are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Rst2Init,
    Init2Init,
    Init2Rtr,
    Rtr2Rts,
    Rts2Rts,
    ToErr,
    ToRst,
}

impl Transition {
    /// The command for `from` → `to`, if there is one.
    pub fn of(from: QpState, to: QpState) -> Option<Self> {
        use QpState::*;
        Some(match (from, to) {
            (_, Reset) => Transition::ToRst,
            (_, Err) => Transition::ToErr,
            (Reset, Init) => Transition::Rst2Init,
            (Init, Init) => Transition::Init2Init,
            (Init, Rtr) => Transition::Init2Rtr,
            (Rtr, Rts) => Transition::Rtr2Rts,
            (Rts, Rts) => Transition::Rts2Rts,
            _ => return None,
        })
    }

    fn opcode(self) -> Opcode {
        match self {
            Transition::Rst2Init => Opcode::Rst2initQp,
            Transition::Init2Init => Opcode::Init2initQp,
            Transition::Init2Rtr => Opcode::Init2rtrQp,
            Transition::Rtr2Rts => Opcode::Rtr2rtsQp,
            Transition::Rts2Rts => Opcode::Rts2rtsQp,
            Transition::ToErr => Opcode::X2errQp,
            Transition::ToRst => Opcode::X2rstQp,
        }
    }

    /// (inlen, outlen, qpn field, opt_param_mask field, qpc) of the command's layout.
    fn layout(self) -> (usize, usize, Field, Option<Field>, Option<Sub>) {
        use ifc::*;
        match self {
            Transition::Rst2Init => (
                rst2init_qp_in::SIZE_BYTES,
                rst2init_qp_out::SIZE_BYTES,
                rst2init_qp_in::QPN,
                Some(rst2init_qp_in::OPT_PARAM_MASK),
                Some(rst2init_qp_in::QPC),
            ),
            // INIT2INIT shares RST2INIT's layout in mlx5_ifc.
            Transition::Init2Init => (
                rst2init_qp_in::SIZE_BYTES,
                rst2init_qp_out::SIZE_BYTES,
                rst2init_qp_in::QPN,
                Some(rst2init_qp_in::OPT_PARAM_MASK),
                Some(rst2init_qp_in::QPC),
            ),
            Transition::Init2Rtr => (
                init2rtr_qp_in::SIZE_BYTES,
                init2rtr_qp_out::SIZE_BYTES,
                init2rtr_qp_in::QPN,
                Some(init2rtr_qp_in::OPT_PARAM_MASK),
                Some(init2rtr_qp_in::QPC),
            ),
            Transition::Rtr2Rts => (
                rtr2rts_qp_in::SIZE_BYTES,
                rtr2rts_qp_out::SIZE_BYTES,
                rtr2rts_qp_in::QPN,
                Some(rtr2rts_qp_in::OPT_PARAM_MASK),
                Some(rtr2rts_qp_in::QPC),
            ),
            Transition::Rts2Rts => (
                rts2rts_qp_in::SIZE_BYTES,
                rts2rts_qp_out::SIZE_BYTES,
                rts2rts_qp_in::QPN,
                Some(rts2rts_qp_in::OPT_PARAM_MASK),
                Some(rts2rts_qp_in::QPC),
            ),
            Transition::ToErr => (qp_2err_in::SIZE_BYTES, qp_2err_out::SIZE_BYTES, qp_2err_in::QPN, None, None),
            Transition::ToRst => (qp_2rst_in::SIZE_BYTES, qp_2rst_out::SIZE_BYTES, qp_2rst_in::QPN, None, None),
        }
    }
}

/// A state-transition command with the qpc fields it carries (`__mlx5_ib_modify_qp` → `mlx5_core_qp_modify`).
#[derive(Debug, Clone, Copy)]
pub struct ModifyQp {
    pub qpn: u32,
    pub qp_type: QpType,
    pub transition: Transition,
    pub attr: QpAttr,
    pub mask: QpAttrMask,
    pub link: crate::cq::LinkLayer,
}

impl ModifyQp {
    /// `opt_param_mask`: the optional fields this command changes (`MLX5_QP_OPTPAR_*`, from `ib_mask_to_mlx5_opt`).
    fn opt_param_mask(&self) -> u32 {
        let mut m = 0;
        if self.mask.contains(QpAttrMask::ACCESS_FLAGS) && self.qp_type == QpType::Rc {
            m |= consts::MLX5_QP_OPTPAR_RRE | consts::MLX5_QP_OPTPAR_RAE | consts::MLX5_QP_OPTPAR_RWE;
        }
        if self.mask.contains(QpAttrMask::PKEY_INDEX) {
            m |= consts::MLX5_QP_OPTPAR_PKEY_INDEX;
        }
        if self.mask.contains(QpAttrMask::QKEY) {
            m |= consts::MLX5_QP_OPTPAR_Q_KEY;
        }
        if self.mask.contains(QpAttrMask::MIN_RNR_TIMER) {
            m |= consts::MLX5_QP_OPTPAR_RNR_TIMEOUT;
        }
        // Mandatory fields of the transition are not "optional parameters".
        match self.transition {
            Transition::Rst2Init => 0,
            Transition::Init2Rtr | Transition::Init2Init => m & !consts::MLX5_QP_OPTPAR_RNR_TIMEOUT,
            _ => m & !consts::MLX5_QP_OPTPAR_PKEY_INDEX,
        }
    }
}

/// Writes the address path (`mlx5_set_path` for the primary path).
fn set_path<B: MsgBuf + ?Sized>(c: &mut SubBuf<'_, B>, base: Sub, ah: &AhAttr, link: crate::cq::LinkLayer) {
    use ifc::ads as a;
    let at = |f: Field| f.at(base);
    match link {
        crate::cq::LinkLayer::InfiniBand => {
            c.set(at(a::RLID), ah.dlid.into());
            c.set(at(a::SL), u32::from(ah.sl & 0xf));
            c.set(at(a::MLID), u32::from(ah.src_path_bits & 0x7f));
        }
        crate::cq::LinkLayer::Ethernet => {
            c.set(at(a::RMAC_47_32), u32::from(u16::from_be_bytes([ah.dmac[0], ah.dmac[1]])));
            c.set(at(a::RMAC_31_0), u32::from_be_bytes([ah.dmac[2], ah.dmac[3], ah.dmac[4], ah.dmac[5]]));
            c.set(at(a::ETH_PRIO), u32::from(ah.sl & 7));
            c.set(at(a::UDP_SPORT), ROCE_UDP_SPORT_MIN);
        }
    }
    if let Some(g) = ah.grh {
        c.set(at(a::GRH), 1);
        c.set(at(a::SRC_ADDR_INDEX), g.sgid_index.into());
        c.set(at(a::HOP_LIMIT), g.hop_limit.into());
        c.set(at(a::TCLASS), g.traffic_class.into());
        c.set(at(a::FLOW_LABEL), g.flow_label & 0xf_ffff);
        for (i, b) in g.dgid.iter().enumerate() {
            c.set(a::RGID_RIP.elem(i as u32).at(base), u32::from(*b));
        }
    }
    c.set(at(a::STAT_RATE), u32::from(ah.static_rate & 0xf));
    c.set(at(a::VHCA_PORT_NUM), ah.port_num.max(1).into());
}

/// The lowest RoCE v2 UDP source port (`r_roce_min_src_udp_port` of the simulated and real ConnectX-5: 0xc000).
pub const ROCE_UDP_SPORT_MIN: u32 = 0xc000;

/// `log2` rounded up, for the `log_*_max` fields (`log_rra_max`, `log_sra_max`).
fn log2_ceil(v: u8) -> u32 {
    if v <= 1 {
        0
    } else {
        32 - (u32::from(v) - 1).leading_zeros()
    }
}

impl Command for ModifyQp {
    type Output = ();
    fn opcode(&self) -> Opcode {
        self.transition.opcode()
    }
    fn inlen(&self) -> usize {
        self.transition.layout().0
    }
    fn outlen(&self) -> usize {
        self.transition.layout().1
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::qpc as q;
        let (_, _, qpn, opt, qpc) = self.transition.layout();
        write_header(msg, self.transition.opcode(), 0);
        msg.set(qpn, self.qpn);
        if let Some(f) = opt {
            msg.set(f, self.opt_param_mask());
        }
        let Some(qpc) = qpc else { return };
        let a = &self.attr;
        let m = self.mask;
        let mut c = SubBuf::new(msg, qpc);
        let path = q::PRIMARY_ADDRESS_PATH;
        if m.contains(QpAttrMask::PKEY_INDEX) {
            c.set(ifc::ads::PKEY_INDEX.at(path), a.pkey_index.into());
        }
        if m.contains(QpAttrMask::PORT) || self.transition == Transition::Rst2Init {
            c.set(ifc::ads::VHCA_PORT_NUM.at(path), a.port_num.max(1).into());
        }
        if m.contains(QpAttrMask::ACCESS_FLAGS) && self.qp_type == QpType::Rc {
            let acc = a.qp_access_flags;
            c.set(q::RRE, acc.contains(Access::REMOTE_READ).into());
            c.set(q::RWE, acc.contains(Access::REMOTE_WRITE).into());
            c.set(q::RAE, acc.contains(Access::REMOTE_ATOMIC).into());
        }
        if m.contains(QpAttrMask::QKEY) {
            c.set(q::Q_KEY, a.qkey);
        }
        if m.contains(QpAttrMask::AV) {
            set_path(&mut c, path, &a.ah_attr, self.link);
        }
        if m.contains(QpAttrMask::PATH_MTU) {
            c.set(q::MTU, a.path_mtu as u32);
            // Messages up to 2^30 bytes (`log_max_msg` of the device).
            c.set(q::LOG_MSG_MAX, 30);
        }
        if m.contains(QpAttrMask::DEST_QPN) {
            c.set(q::REMOTE_QPN, a.dest_qp_num & 0xff_ffff);
        }
        if m.contains(QpAttrMask::RQ_PSN) {
            c.set(q::NEXT_RCV_PSN, a.rq_psn);
        }
        if m.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            c.set(q::LOG_RRA_MAX, log2_ceil(a.max_dest_rd_atomic));
        }
        if m.contains(QpAttrMask::MIN_RNR_TIMER) {
            c.set(q::MIN_RNR_NAK, a.min_rnr_timer.into());
        }
        if m.contains(QpAttrMask::TIMEOUT) {
            c.set(ifc::ads::ACK_TIMEOUT.at(path), a.timeout.into());
        }
        if m.contains(QpAttrMask::RETRY_CNT) {
            c.set(q::RETRY_COUNT, a.retry_cnt.into());
        }
        if m.contains(QpAttrMask::RNR_RETRY) {
            c.set(q::RNR_RETRY, a.rnr_retry.into());
        }
        if m.contains(QpAttrMask::SQ_PSN) {
            c.set(q::NEXT_SEND_PSN, a.sq_psn);
        }
        if m.contains(QpAttrMask::MAX_QP_RD_ATOMIC) {
            c.set(q::LOG_SRA_MAX, log2_ceil(a.max_rd_atomic));
        }
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// What `QUERY_QP` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpQuery {
    pub state: QpState,
    pub remote_qpn: u32,
    pub next_send_psn: u32,
    pub next_rcv_psn: u32,
    pub mtu: u8,
    pub qkey: u32,
    pub hw_sq_wqebb_counter: u16,
    pub hw_rq_counter: u32,
}

/// `QUERY_QP` (the context only).
#[derive(Debug, Clone, Copy)]
pub struct QueryQp {
    pub qpn: u32,
}

impl Command for QueryQp {
    type Output = QpQuery;
    fn opcode(&self) -> Opcode {
        Opcode::QueryQp
    }
    fn inlen(&self) -> usize {
        ifc::query_qp_in::SIZE_BYTES
    }
    fn outlen(&self) -> usize {
        ifc::query_qp_out::QP_PAS_OR_QPC_EXT_AND_PAS.off
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryQp, 0);
        msg.set(ifc::query_qp_in::QPN, self.qpn);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<QpQuery, CmdError> {
        use ifc::qpc as q;
        let at = |f: Field| out.get(f.at(ifc::query_qp_out::QPC));
        Ok(QpQuery {
            state: QpState::from_raw(at(q::STATE) as u8),
            remote_qpn: at(q::REMOTE_QPN),
            next_send_psn: at(q::NEXT_SEND_PSN),
            next_rcv_psn: at(q::NEXT_RCV_PSN),
            mtu: at(q::MTU) as u8,
            qkey: at(q::Q_KEY),
            hw_sq_wqebb_counter: at(q::HW_SQ_WQEBB_COUNTER) as u16,
            hw_rq_counter: at(q::HW_RQ_COUNTER),
        })
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Sizing (rdma-core `mlx5_calc_sq_size` / `mlx5_calc_rq_size`)

const BB: usize = consts::MLX5_SEND_WQE_BB as usize;
const DS: usize = consts::MLX5_SEND_WQE_DS as usize;
const CTRL: usize = c::mlx5_wqe_ctrl_seg::SIZE;
const DATA: usize = c::mlx5_wqe_data_seg::SIZE;
const RADDR: usize = c::mlx5_wqe_raddr_seg::SIZE;
const ATOMIC: usize = c::mlx5_wqe_atomic_seg::SIZE;
const DGRAM: usize = c::mlx5_wqe_datagram_seg::SIZE;
/// Bytes of the inline segment header (`byte_count`).
const INL_HDR: usize = c::mlx5_wqe_inline_seg::BYTE_COUNT.len;
/// Most BBs one WQE may span (`MLX5_SEND_WQE_MAX_WQEBBS`).
const MAX_WQEBBS: usize = 16;

/// The fixed part of a send WQE before its data (`sq_overhead`).
const fn sq_overhead(ty: QpType) -> usize {
    match ty {
        QpType::Rc => CTRL + RADDR + ATOMIC,
        QpType::Ud => CTRL + DGRAM,
    }
}

/// Queue geometry chosen for a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpSizes {
    pub sq_wqe_cnt: u32,
    /// Bytes of the largest send WQE (a multiple of 64).
    pub sq_wqe_size: u32,
    pub rq_wqe_cnt: u32,
    /// log2 of the receive WQE size (at least 16 bytes).
    pub rq_wqe_shift: u8,
    /// What the caller gets.
    pub cap: QpCap,
}

impl QpSizes {
    pub fn sq_bytes(&self) -> usize {
        self.sq_wqe_cnt as usize * BB
    }
    pub fn rq_bytes(&self) -> usize {
        (self.rq_wqe_cnt as usize) << self.rq_wqe_shift
    }
}

/// Why a QP size cannot be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum SizeError {
    SendWqeTooBig { bytes: u32, max: u32 },
    RecvWqeTooBig { bytes: u32, max: u32 },
    TooManyWqes { wqes: u32, max: u32 },
    NoSendQueue,
}

/// Sizes the queues for `cap` (rdma-core's calculation): the send WQE fits the overhead plus the larger of the
/// SGEs and the inline data, rounded to BBs; both rings are powers of two; the granted capabilities are what those
/// rings actually hold.
pub fn qp_sizes(
    ty: QpType,
    cap: &QpCap,
    max_wqe_sz_sq: u32,
    max_wqe_sz_rq: u32,
    log_max_qp_sz: u8,
) -> Result<QpSizes, SizeError> {
    let max_wqes = 1u32 << log_max_qp_sz;
    // Send queue.
    let inl = if cap.max_inline_data > 0 { INL_HDR + cap.max_inline_data as usize } else { 0 };
    let data = (cap.max_send_sge as usize * DATA).max(inl);
    let wqe_size = (sq_overhead(ty) + data).next_multiple_of(BB);
    if wqe_size as u32 > max_wqe_sz_sq || wqe_size > MAX_WQEBBS * BB {
        return Err(SizeError::SendWqeTooBig {
            bytes: wqe_size as u32,
            max: max_wqe_sz_sq.min((MAX_WQEBBS * BB) as u32),
        });
    }
    if cap.max_send_wr == 0 {
        return Err(SizeError::NoSendQueue);
    }
    let sq_bytes = (cap.max_send_wr as usize * wqe_size).next_power_of_two();
    let sq_wqe_cnt = (sq_bytes / BB) as u32;
    if sq_wqe_cnt > max_wqes {
        return Err(SizeError::TooManyWqes { wqes: sq_wqe_cnt, max: max_wqes });
    }
    // Receive queue: a power-of-two array of data segments, at least one.
    let rq_wqe_size = (cap.max_recv_sge.max(1) as usize).next_power_of_two() * DATA;
    if rq_wqe_size as u32 > max_wqe_sz_rq {
        return Err(SizeError::RecvWqeTooBig { bytes: rq_wqe_size as u32, max: max_wqe_sz_rq });
    }
    let rq_wqe_cnt = cap.max_recv_wr.max(1).next_power_of_two();
    if rq_wqe_cnt > max_wqes {
        return Err(SizeError::TooManyWqes { wqes: rq_wqe_cnt, max: max_wqes });
    }
    let overhead = sq_overhead(ty);
    let granted = QpCap {
        max_send_wr: sq_wqe_cnt / (wqe_size / BB) as u32,
        max_recv_wr: rq_wqe_cnt,
        max_send_sge: ((wqe_size - overhead) / DATA) as u32,
        max_recv_sge: (rq_wqe_size / DATA) as u32,
        // A WQE of only the fixed segments (UD with no SGEs and no inline data) has no room for an inline header.
        max_inline_data: (wqe_size - overhead).saturating_sub(INL_HDR) as u32,
    };
    Ok(QpSizes {
        sq_wqe_cnt,
        sq_wqe_size: wqe_size as u32,
        rq_wqe_cnt,
        rq_wqe_shift: rq_wqe_size.trailing_zeros() as u8,
        cap: granted,
    })
}

// ---------------------------------------------------------------------------------------------------------------
// Work requests

/// A scatter/gather element (`ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// What a send work request does (`ibv_wr_opcode` with its operands).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    Send,
    SendImm {
        imm: u32,
    },
    RdmaWrite {
        remote_addr: u64,
        rkey: u32,
    },
    RdmaWriteImm {
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    },
    RdmaRead {
        remote_addr: u64,
        rkey: u32,
    },
    /// 8-byte compare and swap; the original value lands in the SGE.
    AtomicCmpSwp {
        remote_addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
    /// 8-byte fetch and add; the original value lands in the SGE.
    AtomicFetchAdd {
        remote_addr: u64,
        rkey: u32,
        add: u64,
    },
}

impl SendOp {
    #[inline]
    const fn mlx5_opcode(&self) -> u32 {
        match self {
            SendOp::Send => consts::MLX5_OPCODE_SEND,
            SendOp::SendImm { .. } => consts::MLX5_OPCODE_SEND_IMM,
            SendOp::RdmaWrite { .. } => consts::MLX5_OPCODE_RDMA_WRITE,
            SendOp::RdmaWriteImm { .. } => consts::MLX5_OPCODE_RDMA_WRITE_IMM,
            SendOp::RdmaRead { .. } => consts::MLX5_OPCODE_RDMA_READ,
            SendOp::AtomicCmpSwp { .. } => consts::MLX5_OPCODE_ATOMIC_CS,
            SendOp::AtomicFetchAdd { .. } => consts::MLX5_OPCODE_ATOMIC_FA,
        }
    }
}

/// `ibv_send_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendFlags(pub u32);

impl SendFlags {
    pub const FENCE: SendFlags = SendFlags(1);
    pub const SIGNALED: SendFlags = SendFlags(2);
    pub const SOLICITED: SendFlags = SendFlags(4);

    #[inline]
    pub const fn contains(self, o: SendFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, o: SendFlags) -> SendFlags {
        SendFlags(self.0 | o.0)
    }
}

/// A UD destination: an address handle and the remote QP (`ibv_send_wr.wr.ud`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdDest<'a> {
    pub ah: &'a Ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// A send work request (`ibv_send_wr`, one element of the list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub sg_list: &'a [Sge],
    pub flags: SendFlags,
    /// Bytes to carry inside the WQE instead of gathering `sg_list` (`IBV_SEND_INLINE`): the buffer is free
    /// again as soon as the post returns. `sg_list` must be empty then.
    pub inline: Option<&'a [u8]>,
    /// Required on UD QPs.
    pub ud: Option<UdDest<'a>>,
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sg_list: &'a [Sge],
}

/// An address handle: the `mlx5_av` image a UD send carries (`mlx5_ib_create_ah`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ah {
    av: [u8; c::mlx5_av::SIZE],
}

impl Ah {
    /// Builds the address vector for `attr` on a port of `link` type (`create_ib_ah`).
    pub fn new(attr: &AhAttr, link: crate::cq::LinkLayer) -> Self {
        use c::mlx5_av as v;
        let mut av = [0u8; v::SIZE];
        let mut stat_rate_sl = (attr.static_rate & 0xf) << 4;
        if let Some(g) = attr.grh {
            av[v::RGID.off..v::RGID.end()].copy_from_slice(&g.dgid);
            v::GRH_GID_FL.put_be(&mut av, 0, (g.flow_label & 0xf_ffff) | (1 << 30) | u32::from(g.sgid_index) << 20);
            av[v::HOP_LIMIT.off] = g.hop_limit;
            av[v::TCLASS.off] = g.traffic_class;
        }
        match link {
            crate::cq::LinkLayer::Ethernet => {
                v::UDP_SPORT.put_be(&mut av, 0, ROCE_UDP_SPORT_MIN);
                av[v::RMAC.off..v::RMAC.end()].copy_from_slice(&attr.dmac);
                stat_rate_sl |= (attr.sl & 7) << 1;
            }
            crate::cq::LinkLayer::InfiniBand => {
                v::RLID.put_be(&mut av, 0, attr.dlid.into());
                av[v::FL_MLID.off] = attr.src_path_bits & 0x7f;
                stat_rate_sl |= attr.sl & 0xf;
            }
        }
        av[v::STAT_RATE_SL.off] = stat_rate_sl;
        Ah { av }
    }

    /// The address vector bytes.
    pub fn av(&self) -> &[u8; c::mlx5_av::SIZE] {
        &self.av
    }
}

/// Why a work request was not posted. Everything before `index` in the list was posted (and the doorbell rung for
/// it); nothing from `index` on was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PostError {
    /// Position of the first work request not posted (`bad_wr`).
    pub index: usize,
    pub kind: PostErrorKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum PostErrorKind {
    /// The queue has no room (`ENOMEM`).
    QueueFull { outstanding: u32, max: u32 },
    /// More SGEs than the queue was created for (`EINVAL`).
    TooManySge { sge: usize, max: u32 },
    /// More inline bytes than the queue allows.
    InlineTooLong { bytes: usize, max: u32 },
    /// The QP is not in a state that accepts this queue's work (send needs RTS; receive needs INIT or later).
    BadState { state: QpState },
    /// A UD send without a destination, an RC send with one, or an atomic without an 8-byte SGE.
    BadRequest { what: &'static str },
    /// The device is in internal error (`EIO`).
    DeviceError,
}

impl core::fmt::Display for PostError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "work request {} not posted: ", self.index)?;
        match self.kind {
            PostErrorKind::QueueFull { outstanding, max } => write!(f, "queue full ({outstanding} of {max})"),
            PostErrorKind::TooManySge { sge, max } => write!(f, "{sge} SGEs, the queue takes {max}"),
            PostErrorKind::InlineTooLong { bytes, max } => write!(f, "{bytes} inline bytes, the queue takes {max}"),
            PostErrorKind::BadState { state } => write!(f, "QP is in state {state:?}"),
            PostErrorKind::BadRequest { what } => write!(f, "{what}"),
            PostErrorKind::DeviceError => write!(f, "device in internal error"),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The QP

/// Per-WQE bookkeeping in the host-only shadow array. Every field is an integer, so no byte pattern is invalid
/// even if a device wrote over the array (it is DMA memory the device could reach).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
struct SqSlot {
    wr_id: u64,
    /// `head` after this WQE: a completion of it retires every WQE before it (`wqe_head`).
    head_after: u32,
    /// `cur_post` after this WQE: where the next WQE starts (`w_list[].next`), so a software flush can walk the
    /// outstanding WQEs in order.
    next: u32,
}

/// A created queue pair: its rings, doorbell record, BlueFlame register and work-request bookkeeping.
#[derive(Debug)]
pub struct Qp {
    pub(crate) buf: QueueBuf,
    pub(crate) dbrec: DbRec,
    /// Host-only shadow: `sq_wqe_cnt` `SqSlot`s, then `rq_wqe_cnt` receive wr_ids.
    pub(crate) shadow: DmaRegion,
    qpn: u32,
    ty: QpType,
    pub(crate) state: QpState,
    sizes: QpSizes,
    sq_offset: usize,
    /// SQ producer counter in BBs (`cur_post`); the low 16 bits go into WQEs and the doorbell record.
    sq_cur_post: u32,
    /// WQEs posted and retired (`sq.head`, `sq.tail`).
    sq_head: u32,
    sq_tail: u32,
    /// `cur_post` of the oldest outstanding WQE (`sq.last_poll`).
    sq_tail_bb: u32,
    rq_head: u32,
    rq_tail: u32,
    /// The CQs the send and receive queues complete on.
    cqn_snd: u32,
    cqn_rcv: u32,
    bf: BfReg,
    sig_all: bool,
    /// The SQ as one region when it lies inside one fragment of `buf` (the usual case): a WQE segment's address
    /// is then a mask and an add instead of a fragment lookup. `None`: every access goes through `buf`.
    sq_flat: Option<Span>,
    /// The RQ likewise.
    rq_flat: Option<Span>,
}

/// `len` bytes at `off` of `buf` as one span, when they lie inside one fragment. The QP keeps the span beside the
/// buffer it owns, so the fragment lives as long as the span is used.
fn flat_span(buf: &QueueBuf, off: usize, len: usize) -> Option<Span> {
    if len == 0 || off.checked_add(len)? > buf.len() {
        return None;
    }
    let (r, o) = buf.locate(off);
    r.slice(o, len).map(Span::of)
}

impl Qp {
    /// Bytes of the shadow array for `sizes`.
    pub fn shadow_len(sizes: &QpSizes) -> usize {
        sizes.sq_wqe_cnt as usize * core::mem::size_of::<SqSlot>() + sizes.rq_wqe_cnt as usize * 8
    }

    /// A QP over its created objects. `shadow` is zeroed host memory of [`Qp::shadow_len`] bytes, 8-byte aligned;
    /// `cqns` are the send and receive CQs it was created with.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        buf: QueueBuf,
        dbrec: DbRec,
        shadow: DmaRegion,
        qpn: u32,
        ty: QpType,
        sizes: QpSizes,
        bf: BfReg,
        sig_all: bool,
        cqns: (u32, u32),
    ) -> Self {
        let sq_offset = sizes.rq_bytes();
        let sq_flat = flat_span(&buf, sq_offset, sizes.sq_bytes());
        let rq_flat = flat_span(&buf, 0, sizes.rq_bytes());
        Self {
            buf,
            dbrec,
            shadow,
            qpn,
            ty,
            state: QpState::Reset,
            sizes,
            sq_offset,
            sq_cur_post: 0,
            sq_head: 0,
            sq_tail: 0,
            sq_tail_bb: 0,
            rq_head: 0,
            rq_tail: 0,
            cqn_snd: cqns.0,
            cqn_rcv: cqns.1,
            bf,
            sig_all,
            sq_flat,
            rq_flat,
        }
    }

    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    pub fn qp_type(&self) -> QpType {
        self.ty
    }
    pub fn state(&self) -> QpState {
        self.state
    }
    /// The capabilities granted.
    pub fn cap(&self) -> QpCap {
        self.sizes.cap
    }
    pub fn sizes(&self) -> &QpSizes {
        &self.sizes
    }
    pub fn dbrec(&self) -> &DbRec {
        &self.dbrec
    }
    /// Send WQEs posted and not yet completed (unsignaled ones count until a later signaled one completes).
    pub fn sq_outstanding(&self) -> u32 {
        self.sq_head.wrapping_sub(self.sq_tail)
    }
    pub fn rq_outstanding(&self) -> u32 {
        self.rq_head.wrapping_sub(self.rq_tail)
    }
    /// The SQ producer counter in BBs.
    pub fn sq_cur_post(&self) -> u32 {
        self.sq_cur_post
    }
    /// The CQs the send and receive queues complete on.
    pub fn cqns(&self) -> (u32, u32) {
        (self.cqn_snd, self.cqn_rcv)
    }

    /// Completes the oldest outstanding work request of the queues on CQ `cqn` in software (sends first): retired
    /// here, returned with [`WcStatus::WrFlushErr`]; `None` when nothing is outstanding. Only for work the device
    /// will never complete ([`Hca::poll_cq`](crate::hca::Hca::poll_cq) decides when): a CQE the device wrote later
    /// for it would be refused as naming nothing outstanding.
    pub fn flush_next(&mut self, cqn: u32) -> Option<WorkCompletion> {
        let mut wc = WorkCompletion {
            status: WcStatus::WrFlushErr,
            vendor_err: consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR,
            qp_num: self.qpn,
            ..WorkCompletion::default()
        };
        if cqn == self.cqn_snd && self.sq_outstanding() > 0 {
            // SAFETY: inside the live shadow region, aligned; only the driver touches it.
            let slot = unsafe { self.sq_slot_ptr(self.sq_tail_bb).read() };
            // One WQE per completion, whatever the slot says: the count stays exact even over a damaged shadow.
            self.sq_tail = self.sq_tail.wrapping_add(1);
            self.sq_tail_bb = slot.next;
            wc.wr_id = slot.wr_id;
            return Some(wc);
        }
        if cqn == self.cqn_rcv && self.rq_outstanding() > 0 {
            // SAFETY: inside the live shadow region, aligned; only the driver touches it.
            wc.wr_id = unsafe { self.rq_wrid_ptr(self.rq_tail).read() };
            wc.opcode = WcOpcode::Recv;
            self.rq_tail = self.rq_tail.wrapping_add(1);
            return Some(wc);
        }
        None
    }

    /// Back to a fresh ring after a move to RESET (the device forgot its counters too).
    pub(crate) fn reset_rings(&mut self) {
        self.sq_cur_post = 0;
        self.sq_head = 0;
        self.sq_tail = 0;
        self.sq_tail_bb = 0;
        self.rq_head = 0;
        self.rq_tail = 0;
        self.dbrec.write_be32(consts::MLX5_RCV_DBR as usize, 0);
        self.dbrec.write_be32(consts::MLX5_SND_DBR as usize, 0);
    }

    #[inline]
    fn sq_slot_ptr(&self, idx: u32) -> *mut SqSlot {
        let i = (idx & (self.sizes.sq_wqe_cnt - 1)) as usize;
        let sz = core::mem::size_of::<SqSlot>();
        self.shadow.ptr_at(i * sz, sz).cast::<SqSlot>()
    }

    #[inline]
    fn rq_wrid_ptr(&self, idx: u32) -> *mut u64 {
        let i = (idx & (self.sizes.rq_wqe_cnt - 1)) as usize;
        let base = self.sizes.sq_wqe_cnt as usize * core::mem::size_of::<SqSlot>();
        self.shadow.ptr_at(base + i * 8, 8).cast::<u64>()
    }

    /// Writes `data` at byte `pos` of the SQ, wrapping at its end (a WQE continues at the start of the ring).
    fn sq_write(&self, pos: usize, data: &[u8]) {
        let sq = self.sizes.sq_bytes();
        let mut done = 0;
        while done < data.len() {
            let p = (pos + done) & (sq - 1);
            // Never cross the ring's end or a BB (fragments are whole numbers of BBs).
            let n = (data.len() - done).min(sq - p).min(BB - p % BB);
            let dst = self.buf.ptr(self.sq_offset + p, n);
            // SAFETY: `dst..dst + n` is inside one live fragment of the ring (QueueBuf::ptr checked it); software
            // owns SQ entries beyond the device's consumer counter, which the overflow check keeps us within.
            unsafe { core::ptr::copy_nonoverlapping(data[done..].as_ptr(), dst, n) };
            done += n;
        }
    }

    /// Pointer to the 16 bytes (`DS`) at SQ byte `pos`, wrapping at the ring's end. Segments start on `DS`
    /// boundaries; the mask also rounds any other `pos` down to one, so the span is always inside the SQ.
    #[inline(always)]
    fn sq_ds_ptr(&self, pos: usize) -> *mut u8 {
        // The SQ is a power of two of at least one BB, so this mask keeps `p + DS <= sq_bytes`.
        let p = pos & (self.sizes.sq_bytes() - DS);
        match &self.sq_flat {
            // SAFETY: `p + DS <= sq_bytes == r.len` (mask above), and `r` lies inside a fragment of `buf`, which this QP owns.
            Some(r) => unsafe { r.cpu().as_ptr().add(p) },
            None => self.buf.ptr(self.sq_offset + p, DS),
        }
    }

    /// Writes whole 16-byte segments at SQ byte `pos` (a multiple of `DS`): one 16-byte store each, wrapping at
    /// the ring's end between segments.
    #[inline(always)]
    fn sq_put<const N: usize>(&self, pos: usize, seg: &[u8; N]) {
        const { assert!(N / DS * DS == N, "whole segments only") };
        for k in 0..N / DS {
            let dst = self.sq_ds_ptr(pos + k * DS);
            let mut chunk = [0u8; DS];
            chunk.copy_from_slice(&seg[k * DS..(k + 1) * DS]);
            // SAFETY: `dst..dst + DS` is inside the SQ (sq_ds_ptr); software owns SQ entries beyond the device's
            // consumer counter, which the overflow check keeps us within.
            unsafe { dst.cast::<[u8; DS]>().write_unaligned(chunk) };
        }
    }

    /// Reads the 16 bytes at SQ byte `pos` (see [`Qp::sq_ds_ptr`]).
    #[inline(always)]
    fn sq_get16(&self, pos: usize) -> [u8; DS] {
        let src = self.sq_ds_ptr(pos);
        // SAFETY: inside the SQ (sq_ds_ptr); these are bytes this driver wrote.
        unsafe { src.cast::<[u8; DS]>().read_unaligned() }
    }

    /// Writes a 16-byte receive segment at RQ byte `pos` (a multiple of `DS` below the RQ size).
    #[inline(always)]
    fn rq_put(&self, pos: usize, seg: &[u8; DS]) {
        let dst = match &self.rq_flat {
            Some(r) => {
                // The RQ is a power of two of at least one WQE of at least DS bytes: `p + DS <= rq_bytes`.
                let p = pos & (r.len() - DS);
                // SAFETY: `p + DS <= r.len` (mask above), and `r` lies inside a fragment of `buf`, which this QP owns.
                unsafe { r.cpu().as_ptr().add(p) }
            }
            None => self.buf.ptr(pos, DS),
        };
        // SAFETY: inside one live fragment (a receive WQE never crosses one); software owns unposted RQ entries.
        unsafe { dst.cast::<[u8; DS]>().write_unaligned(*seg) };
    }

    /// Copies the SQ bytes of the WQE that starts at basic block `wqe_index` (wrapping at the ring's end): what
    /// the device reads, for diagnostics and tests.
    pub fn read_sq(&self, wqe_index: u32, out: &mut [u8]) {
        for (k, chunk) in out.chunks_mut(8).enumerate() {
            let b = self.sq_read8(wqe_index as usize * BB + k * 8);
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }

    /// Reads 8 bytes at SQ byte `pos` (for the BlueFlame copy).
    fn sq_read8(&self, pos: usize) -> [u8; 8] {
        let sq = self.sizes.sq_bytes();
        let p = pos & (sq - 1);
        let src = self.buf.ptr(self.sq_offset + p, 8);
        // SAFETY: 8 bytes inside a BB of a live fragment; these are bytes this function's caller just wrote.
        unsafe { src.cast::<[u8; 8]>().read() }
    }

    /// Posts send work requests (`mlx5_ib_post_send` / `_mlx5_post_send`) and rings the doorbell once.
    pub fn post_send<M: Mmio + ?Sized>(&mut self, mmio: &M, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let mut nreq = 0usize;
        let mut last_ctrl = 0usize;
        let mut last_size_ds = 0usize;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            match self.build_send(wr) {
                Ok((pos, ds)) => {
                    last_ctrl = pos;
                    last_size_ds = ds;
                    nreq += 1;
                }
                Err(kind) => {
                    result = Err(PostError { index: i, kind });
                    break;
                }
            }
        }
        if nreq > 0 {
            self.ring_sq(mmio, last_ctrl, last_size_ds, nreq == 1);
        }
        result
    }

    /// Writes one send WQE at the producer counter. Returns (SQ byte offset of its ctrl segment, size in DS).
    fn build_send(&mut self, wr: &SendWr<'_>) -> Result<(usize, usize), PostErrorKind> {
        use PostErrorKind as K;
        if self.state != QpState::Rts {
            return Err(K::BadState { state: self.state });
        }
        let max_post = self.sizes.cap.max_send_wr;
        if self.sq_outstanding() >= max_post {
            return Err(K::QueueFull { outstanding: self.sq_outstanding(), max: max_post });
        }
        if wr.inline.is_some() && !wr.sg_list.is_empty() {
            return Err(K::BadRequest { what: "inline data and a gather list in one work request" });
        }
        if wr.sg_list.len() > self.sizes.cap.max_send_sge as usize {
            return Err(K::TooManySge { sge: wr.sg_list.len(), max: self.sizes.cap.max_send_sge });
        }
        let start = (self.sq_cur_post as usize) * BB;
        let mut off = CTRL;
        match (self.ty, &wr.ud) {
            (QpType::Ud, Some(d)) => {
                let mut seg = *d.ah.av();
                c::mlx5_av::DQP_DCT.put_be(&mut seg, 0, (d.remote_qpn & 0xff_ffff) | consts::MLX5_EXTENDED_UD_AV);
                c::mlx5_av::QKEY.put_be(&mut seg, 0, d.remote_qkey);
                self.sq_put(start + off, &seg);
                off += DGRAM;
            }
            (QpType::Ud, None) => return Err(K::BadRequest { what: "UD send without an address handle" }),
            (QpType::Rc, Some(_)) => return Err(K::BadRequest { what: "RC send with a UD destination" }),
            (QpType::Rc, None) => {}
        }
        let raddr = |addr: u64, rkey: u32| {
            let mut s = [0u8; RADDR];
            put64(&mut s, c::mlx5_wqe_raddr_seg::RADDR, addr);
            c::mlx5_wqe_raddr_seg::RKEY.put_be(&mut s, 0, rkey);
            s
        };
        let mut imm = 0u32;
        match wr.op {
            SendOp::Send => {}
            SendOp::SendImm { imm: v } => imm = v,
            SendOp::RdmaWrite { remote_addr, rkey } | SendOp::RdmaRead { remote_addr, rkey } => {
                self.need_rc()?;
                self.sq_put(start + off, &raddr(remote_addr, rkey));
                off += RADDR;
            }
            SendOp::RdmaWriteImm { remote_addr, rkey, imm: v } => {
                self.need_rc()?;
                imm = v;
                self.sq_put(start + off, &raddr(remote_addr, rkey));
                off += RADDR;
            }
            SendOp::AtomicCmpSwp { remote_addr, rkey, compare, swap } => {
                self.need_atomic(wr)?;
                self.sq_put(start + off, &raddr(remote_addr, rkey));
                off += RADDR;
                let mut a = [0u8; ATOMIC];
                put64(&mut a, c::mlx5_wqe_atomic_seg::SWAP_ADD, swap);
                put64(&mut a, c::mlx5_wqe_atomic_seg::COMPARE, compare);
                self.sq_put(start + off, &a);
                off += ATOMIC;
            }
            SendOp::AtomicFetchAdd { remote_addr, rkey, add } => {
                self.need_atomic(wr)?;
                self.sq_put(start + off, &raddr(remote_addr, rkey));
                off += RADDR;
                let mut a = [0u8; ATOMIC];
                put64(&mut a, c::mlx5_wqe_atomic_seg::SWAP_ADD, add);
                self.sq_put(start + off, &a);
                off += ATOMIC;
            }
        }
        if let Some(data) = wr.inline {
            if matches!(wr.op, SendOp::RdmaRead { .. } | SendOp::AtomicCmpSwp { .. } | SendOp::AtomicFetchAdd { .. }) {
                return Err(K::BadRequest { what: "inline data on a READ or atomic" });
            }
            let total = data.len();
            if total > self.sizes.cap.max_inline_data as usize {
                return Err(K::InlineTooLong { bytes: total, max: self.sizes.cap.max_inline_data });
            }
            // No segment for no data (`set_data_inl_seg`): an empty one would not fit a WQE sized for none.
            if total > 0 {
                let mut hdr = [0u8; INL_HDR];
                c::mlx5_wqe_inline_seg::BYTE_COUNT.put_be(&mut hdr, 0, total as u32 | consts::MLX5_INLINE_SEG);
                self.sq_write(start + off, &hdr);
                self.sq_write(start + off + INL_HDR, data);
                off = (off + INL_HDR + total).next_multiple_of(DS);
            }
        } else {
            for s in wr.sg_list.iter().filter(|s| s.length > 0) {
                let mut d = [0u8; DATA];
                c::mlx5_wqe_data_seg::BYTE_COUNT.put_be(&mut d, 0, s.length);
                c::mlx5_wqe_data_seg::LKEY.put_be(&mut d, 0, s.lkey);
                put64(&mut d, c::mlx5_wqe_data_seg::ADDR, s.addr);
                self.sq_put(start + off, &d);
                off += DATA;
            }
        }
        let ds = off / DS;
        let bbs = off.div_ceil(BB);
        let signaled = self.sig_all || wr.flags.contains(SendFlags::SIGNALED);
        let mut fm_ce_se = 0u8;
        if signaled {
            fm_ce_se |= consts::MLX5_WQE_CTRL_CQ_UPDATE as u8;
        }
        if wr.flags.contains(SendFlags::SOLICITED) {
            fm_ce_se |= consts::MLX5_WQE_CTRL_SOLICITED as u8;
        }
        if wr.flags.contains(SendFlags::FENCE) {
            fm_ce_se |= consts::MLX5_WQE_CTRL_FENCE as u8;
        }
        let ctrl = ctrl_seg(self.sq_cur_post as u16, wr.op.mlx5_opcode() as u8, self.qpn, ds as u8, fm_ce_se, imm);
        self.sq_put(start, &ctrl);
        let idx = self.sq_cur_post;
        let next = self.sq_cur_post.wrapping_add(bbs as u32);
        let slot = SqSlot { wr_id: wr.wr_id, head_after: self.sq_head.wrapping_add(1), next };
        // SAFETY: the shadow slot is inside the live shadow region (ptr_at) and aligned (8-byte aligned region,
        // 16-byte slots); only the driver touches it.
        unsafe { self.sq_slot_ptr(idx).write(slot) };
        self.sq_cur_post = self.sq_cur_post.wrapping_add(bbs as u32);
        self.sq_head = self.sq_head.wrapping_add(1);
        Ok((start, ds))
    }

    fn need_rc(&self) -> Result<(), PostErrorKind> {
        if self.ty != QpType::Rc {
            return Err(PostErrorKind::BadRequest { what: "RDMA or atomic on a UD QP" });
        }
        Ok(())
    }

    fn need_atomic(&self, wr: &SendWr<'_>) -> Result<(), PostErrorKind> {
        self.need_rc()?;
        if wr.sg_list.len() != 1 || wr.sg_list[0].length != 8 {
            return Err(PostErrorKind::BadRequest { what: "an atomic needs one 8-byte SGE for the result" });
        }
        Ok(())
    }

    /// The send doorbell (`mlx5r_ring_db` / rdma-core `post_send_db`). This function owns the SQ doorbell
    /// sequence.
    fn ring_sq<M: Mmio + ?Sized>(&mut self, mmio: &M, last_ctrl: usize, size_ds: usize, single: bool) {
        // The WQEs must be visible in memory before the record that says they exist.
        mmio.dma_wmb();
        self.dbrec.write_be32(consts::MLX5_SND_DBR as usize, self.sq_cur_post & 0xffff);
        // The record must be visible before the doorbell write, and the write-combining burst must not merge with
        // anything earlier.
        mmio.wc_start();
        let reg = self.bf.next_offset();
        let bytes = size_ds * DS;
        if single && self.bf.bf && bytes <= self.bf.buf_size {
            // BlueFlame: the whole WQE through the write-combining window, 64 bytes at a time, so the device can
            // start without fetching it.
            for at in (0..bytes.div_ceil(BB) * BB).step_by(DS) {
                // Each 8-byte half as the big-endian value whose `write64` stores exactly those bytes.
                let v = u128::from_be_bytes(self.sq_get16(last_ctrl + at));
                mmio.write64(reg + at, (v >> 64) as u64);
                mmio.write64(reg + at + 8, v as u64);
            }
        } else {
            mmio.write64(reg, (u128::from_be_bytes(self.sq_get16(last_ctrl)) >> 64) as u64);
        }
        // Flush the write-combining buffer so the doorbell reaches the device now, as whole 64-byte chunks.
        mmio.wc_flush();
    }

    /// Posts receive work requests (`mlx5_ib_post_recv`): scatter entries, terminated with the invalid lkey when
    /// shorter than the queue's maximum, then the doorbell record.
    pub fn post_recv<M: Mmio + ?Sized>(&mut self, mmio: &M, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        use PostErrorKind as K;
        let mut nreq = 0u32;
        let mut result = Ok(());
        let max_gs = self.sizes.cap.max_recv_sge as usize;
        for (i, wr) in wrs.iter().enumerate() {
            if matches!(self.state, QpState::Reset) {
                result = Err(PostError { index: i, kind: K::BadState { state: self.state } });
                break;
            }
            let outstanding = self.rq_outstanding() + nreq;
            if outstanding >= self.sizes.rq_wqe_cnt {
                result = Err(PostError { index: i, kind: K::QueueFull { outstanding, max: self.sizes.rq_wqe_cnt } });
                break;
            }
            if wr.sg_list.len() > max_gs {
                result = Err(PostError { index: i, kind: K::TooManySge { sge: wr.sg_list.len(), max: max_gs as u32 } });
                break;
            }
            let idx = self.rq_head.wrapping_add(nreq);
            let base = ((idx & (self.sizes.rq_wqe_cnt - 1)) as usize) << self.sizes.rq_wqe_shift;
            for (k, s) in wr.sg_list.iter().enumerate() {
                let mut d = [0u8; DATA];
                c::mlx5_wqe_data_seg::BYTE_COUNT.put_be(&mut d, 0, s.length);
                c::mlx5_wqe_data_seg::LKEY.put_be(&mut d, 0, s.lkey);
                put64(&mut d, c::mlx5_wqe_data_seg::ADDR, s.addr);
                self.rq_put(base + k * DATA, &d);
            }
            if wr.sg_list.len() < max_gs {
                let mut d = [0u8; DATA];
                c::mlx5_wqe_data_seg::LKEY.put_be(&mut d, 0, consts::MLX5_INVALID_LKEY);
                self.rq_put(base + wr.sg_list.len() * DATA, &d);
            }
            // SAFETY: the slot is inside the live shadow region and 8-byte aligned; only the driver touches it.
            unsafe { self.rq_wrid_ptr(idx).write(wr.wr_id) };
            nreq += 1;
        }
        if nreq > 0 {
            self.rq_head = self.rq_head.wrapping_add(nreq);
            // The receive WQEs must be visible before the record that hands them to the device.
            mmio.dma_wmb();
            self.dbrec.write_be32(consts::MLX5_RCV_DBR as usize, self.rq_head & 0xffff);
        }
        result
    }
}

/// The 16-byte control segment (`mlx5_wqe_ctrl_seg`).
#[inline]
pub fn ctrl_seg(wqe_index: u16, opcode: u8, qpn: u32, ds: u8, fm_ce_se: u8, imm: u32) -> [u8; CTRL] {
    use c::mlx5_wqe_ctrl_seg as s;
    let mut b = [0u8; CTRL];
    s::OPMOD_IDX_OPCODE.put_be(&mut b, 0, u32::from(wqe_index) << 8 | u32::from(opcode));
    s::QPN_DS.put_be(&mut b, 0, (qpn & 0xff_ffff) << 8 | u32::from(ds & 0x3f));
    b[s::FM_CE_SE.off] = fm_ce_se;
    s::IMM.put_be(&mut b, 0, imm);
    b
}

#[inline]
fn put64(buf: &mut [u8], m: Bytes, v: u64) {
    buf[m.off..m.off + 8].copy_from_slice(&v.to_be_bytes());
}

impl WrTable for Qp {
    #[inline]
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        if qpn != self.qpn {
            return None;
        }
        // The counter names the WQE by its first BB (16 bits of `cur_post`).
        // SAFETY: inside the live shadow region, aligned; only the driver touches it.
        let slot = unsafe { self.sq_slot_ptr(wqe_counter.into()).read() };
        // A completion for a slot with nothing outstanding is a device fault.
        let retired = slot.head_after.wrapping_sub(self.sq_tail);
        if retired == 0 || retired > self.sq_outstanding() {
            return None;
        }
        self.sq_tail = slot.head_after;
        self.sq_tail_bb = slot.next;
        Some(slot.wr_id)
    }

    #[inline]
    fn recv_done(&mut self, qpn: u32, _srqn: u32, _wqe_counter: u16) -> Option<u64> {
        if qpn != self.qpn || self.rq_outstanding() == 0 {
            return None;
        }
        // SAFETY: inside the live shadow region, aligned; only the driver touches it.
        let id = unsafe { self.rq_wrid_ptr(self.rq_tail).read() };
        self.rq_tail = self.rq_tail.wrapping_add(1);
        Some(id)
    }

    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        if !dead && self.state != QpState::Err {
            return None;
        }
        self.flush_next(cqn)
    }
}

/// Several QPs sharing a CQ: completions are routed by QP number.
impl WrTable for [&mut Qp] {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        self.iter_mut().find(|q| q.qpn == qpn)?.send_done(qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        self.iter_mut().find(|q| q.qpn == qpn)?.recv_done(qpn, srqn, wqe_counter)
    }
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        self.iter_mut().find_map(|q| WrTable::flush_one(&mut **q, cqn, dead))
    }
}

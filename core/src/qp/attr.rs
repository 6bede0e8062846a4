//! QP types, states and attributes (`ibv_qp_type`, `ibv_qp_state`, `ibv_qp_attr` and its mask) and verbs' modify
//! table (`qp_state_table`, `ib_modify_qp_is_ok`) that [`check_modify`] enforces.

use crate::mkey::Access;
use crate::prm::consts;

/// Transport service (`qpc.st`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpType {
    /// Reliable connected.
    Rc,
    /// Unreliable connected (`IBV_QPT_UC`): SEND and RDMA WRITE (with or without immediate) only, no
    /// acknowledgements, a lost or damaged message is dropped at the responder.
    Uc,
    /// Unreliable datagram.
    Ud,
    /// The port's general services QP (`IB_QPT_GSI`, QP1): a datagram QP created with `qpc.st` QP1 as mlx5_ib's
    /// hardware GSI QP (`MLX5_IB_QPT_HW_GSI`). Whatever QPN CREATE_QP gives it, MADs reach it as QP 1 and it sends
    /// as QP 1 (IBA 3.5.4); it posts and completes as a UD QP.
    Gsi,
    /// The port's subnet management QP (`IB_QPT_SMI`, QP0): a datagram QP created with `qpc.st` QP0, as mlx5_ib
    /// creates it for `ib_mad` on an InfiniBand port. SMPs reach it as QP 0 and it sends as QP 0 with Q_Key 0
    /// (IBA 3.5.4); `process_mad` hands what it receives to MAD_IFC. It posts and completes as a UD QP.
    Smi,
}

impl QpType {
    pub(super) const fn st(self) -> u32 {
        match self {
            QpType::Rc => consts::MLX5_QP_ST_RC,
            QpType::Uc => consts::MLX5_QP_ST_UC,
            QpType::Ud => consts::MLX5_QP_ST_UD,
            QpType::Gsi => consts::MLX5_QP_ST_QP1,
            QpType::Smi => consts::MLX5_QP_ST_QP0,
        }
    }

    /// Whether work requests carry an address (UD and the special QPs): the datagram segment, no RDMA, Q_Keys.
    pub const fn is_datagram(self) -> bool {
        matches!(self, QpType::Ud | QpType::Gsi | QpType::Smi)
    }

    /// Whether this is one of the port's special QPs (`is_sqp` in mlx5_ib: QP0 or the hardware GSI QP).
    pub const fn is_special(self) -> bool {
        matches!(self, QpType::Gsi | QpType::Smi)
    }
}

/// QP state (`ibv_qp_state`; `MLX5_QP_STATE_*` on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpState {
    /// `IBV_QPS_RESET`: just created or reset; no work is processed.
    Reset,
    /// `IBV_QPS_INIT`: receives may be posted, nothing is processed yet.
    Init,
    /// `IBV_QPS_RTR`: ready to receive.
    Rtr,
    /// `IBV_QPS_RTS`: ready to send.
    Rts,
    /// `IBV_QPS_SQD`: send queue drained.
    Sqd,
    /// `IBV_QPS_SQE`: send queue error.
    Sqe,
    /// `IBV_QPS_ERR`: outstanding work is flushed with errors.
    Err,
    /// A state value the headers do not name.
    Unknown(u8),
}

impl QpState {
    /// The state from its `MLX5_QP_STATE_*` wire value.
    pub const fn from_raw(v: u8) -> Self {
        match v {
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

/// Requested capabilities (`ibv_qp_cap`); `Qp::cap` reports what was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCap {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send work request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive work request.
    pub max_recv_sge: u32,
    /// Bytes of inline data a send work request may carry.
    pub max_inline_data: u32,
}

/// Path MTU (`ib_mtu`: 1 = 256 ... 5 = 4096 bytes, the `qpc.mtu` encoding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Mtu {
    /// 256 bytes.
    M256 = 1,
    /// 512 bytes.
    M512 = 2,
    /// 1024 bytes.
    M1024 = 3,
    /// 2048 bytes.
    M2048 = 4,
    /// 4096 bytes.
    M4096 = 5,
}

impl Mtu {
    /// The MTU in bytes.
    pub const fn bytes(self) -> u32 {
        128 << (self as u32)
    }
}

/// Global routing header of an address (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grh {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// IPv6 flow label (20 bits).
    pub flow_label: u32,
    /// Index of the source GID in the port's GID table.
    pub sgid_index: u8,
    /// Hop limit (IPv6) / TTL.
    pub hop_limit: u8,
    /// Traffic class (IPv6) / DSCP and ECN.
    pub traffic_class: u8,
}

/// Where packets go (`ibv_ah_attr`): LID and SL on InfiniBand; GRH and destination MAC for RoCE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    /// Destination LID (InfiniBand).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits (the low LID bits of the source port).
    pub src_path_bits: u8,
    /// Static rate limit (`ibv_rate`, 0 = port rate).
    pub static_rate: u8,
    /// The global route header, required on RoCE and for routed InfiniBand traffic.
    pub grh: Option<Grh>,
    /// RoCE only: the next hop's MAC address.
    pub dmac: [u8; 6],
    /// The local port (1).
    pub port_num: u8,
}

/// Which [`QpAttr`] fields a modify sets (`ibv_qp_attr_mask`, same bit values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttrMask(pub u32);

impl QpAttrMask {
    /// `IBV_QP_STATE`: the new state.
    pub const STATE: QpAttrMask = QpAttrMask(1 << 0);
    /// `IBV_QP_ACCESS_FLAGS`: remote access rights.
    pub const ACCESS_FLAGS: QpAttrMask = QpAttrMask(1 << 3);
    /// `IBV_QP_PKEY_INDEX`.
    pub const PKEY_INDEX: QpAttrMask = QpAttrMask(1 << 4);
    /// `IBV_QP_PORT`.
    pub const PORT: QpAttrMask = QpAttrMask(1 << 5);
    /// `IBV_QP_QKEY` (UD).
    pub const QKEY: QpAttrMask = QpAttrMask(1 << 6);
    /// `IBV_QP_AV`: the address vector of the remote side.
    pub const AV: QpAttrMask = QpAttrMask(1 << 7);
    /// `IBV_QP_PATH_MTU`.
    pub const PATH_MTU: QpAttrMask = QpAttrMask(1 << 8);
    /// `IBV_QP_TIMEOUT`: local ACK timeout.
    pub const TIMEOUT: QpAttrMask = QpAttrMask(1 << 9);
    /// `IBV_QP_RETRY_CNT`.
    pub const RETRY_CNT: QpAttrMask = QpAttrMask(1 << 10);
    /// `IBV_QP_RNR_RETRY`.
    pub const RNR_RETRY: QpAttrMask = QpAttrMask(1 << 11);
    /// `IBV_QP_RQ_PSN`.
    pub const RQ_PSN: QpAttrMask = QpAttrMask(1 << 12);
    /// `IBV_QP_MAX_QP_RD_ATOMIC`: outstanding RDMA reads and atomics as initiator.
    pub const MAX_QP_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 13);
    /// `IBV_QP_MIN_RNR_TIMER`.
    pub const MIN_RNR_TIMER: QpAttrMask = QpAttrMask(1 << 15);
    /// `IBV_QP_SQ_PSN`.
    pub const SQ_PSN: QpAttrMask = QpAttrMask(1 << 16);
    /// `IBV_QP_MAX_DEST_RD_ATOMIC`: outstanding RDMA reads and atomics as responder.
    pub const MAX_DEST_RD_ATOMIC: QpAttrMask = QpAttrMask(1 << 17);
    /// `IBV_QP_DEST_QPN`.
    pub const DEST_QPN: QpAttrMask = QpAttrMask(1 << 20);

    /// No attributes.
    pub const fn empty() -> Self {
        QpAttrMask(0)
    }
    /// Whether every bit of `o` is set.
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
    /// The state to move to (with [`QpAttrMask::STATE`]).
    pub qp_state: QpState,
    /// Remote read / write / atomic rights of the responder.
    pub qp_access_flags: Access,
    /// P_Key index.
    pub pkey_index: u16,
    /// Local port (1).
    pub port_num: u8,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Address of the remote side (RC).
    pub ah_attr: AhAttr,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Local ACK timeout: 4.096 µs × 2^timeout.
    pub timeout: u8,
    /// Transport retries before an error (0..=7).
    pub retry_cnt: u8,
    /// 7 means retry forever.
    pub rnr_retry: u8,
    /// Receive packet sequence number (24 bits).
    pub rq_psn: u32,
    /// Send packet sequence number (24 bits).
    pub sq_psn: u32,
    /// Outstanding RDMA reads and atomics this QP initiates.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads and atomics this QP answers.
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR NAK timer (`ib_rnr_timeout` encoding, 0..=31).
    pub min_rnr_timer: u8,
    /// Remote QP number (RC).
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
    BadTransition {
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// Attributes this transition requires are missing.
    MissingAttr {
        /// The missing `QpAttrMask` bits.
        missing: u32,
    },
    /// Attributes this transition does not take.
    ExtraAttr {
        /// The `QpAttrMask` bits not taken.
        extra: u32,
    },
    /// A value out of range (port, rnr_retry, ...).
    BadValue {
        /// The attribute.
        what: &'static str,
        /// Its value.
        value: u32,
    },
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

impl core::error::Error for ModifyError {}

/// Required and optional attributes of each transition (verbs' `qp_state_table`, for RC, UC and UD; the
/// alternate path, `CUR_STATE` and `PATH_MIG_STATE` are not offered, so they are left out).
fn transition_masks(ty: QpType, from: QpState, to: QpState) -> Option<(QpAttrMask, QpAttrMask)> {
    use QpAttrMask as M;
    use QpState::*;
    let rc = ty == QpType::Rc;
    let none = M::empty();
    if ty == QpType::Uc {
        // `qp_state_table[...].req_param[IB_QPT_UC]` / `.opt_param[IB_QPT_UC]`.
        return Some(match (from, to) {
            (_, Reset) | (_, Err) if !matches!(from, Unknown(_)) => (none, none),
            (Reset, Init) => (M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, none),
            (Init, Init) => (none, M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS),
            (Init, Rtr) => (M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN, M::ACCESS_FLAGS | M::PKEY_INDEX),
            (Rtr, Rts) => (M::SQ_PSN, M::ACCESS_FLAGS),
            (Rts, Rts) => (none, M::ACCESS_FLAGS),
            _ => return None,
        });
    }
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

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    use QpAttrMask as M;

    fn to(state: QpState) -> QpAttr {
        QpAttr { qp_state: state, port_num: 1, ..QpAttr::default() }
    }

    #[test]
    fn qp_state_from_raw_knows_the_wire_values() {
        assert_eq!(QpState::from_raw(consts::MLX5_QP_STATE_RST), QpState::Reset);
        assert_eq!(QpState::from_raw(consts::MLX5_QP_STATE_RTS), QpState::Rts);
        assert_eq!(QpState::from_raw(consts::MLX5_QP_STATE_ERR), QpState::Err);
        assert_eq!(QpState::from_raw(0xee), QpState::Unknown(0xee));
    }

    #[test]
    fn rc_reset_to_init_needs_pkey_port_and_access() {
        let req = required_attrs(QpType::Rc, QpState::Reset, QpState::Init).unwrap();
        assert_eq!(req, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS);
        let ud = required_attrs(QpType::Ud, QpState::Reset, QpState::Init).unwrap();
        assert_eq!(ud, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY);
        assert_eq!(check_modify(QpType::Rc, QpState::Reset, &to(QpState::Init), req), Ok(()));
    }

    #[test]
    fn a_missing_required_attribute_is_named() {
        let mask = M::STATE | M::PKEY_INDEX | M::PORT;
        assert_eq!(
            check_modify(QpType::Rc, QpState::Reset, &to(QpState::Init), mask),
            Err(ModifyError::MissingAttr { missing: M::ACCESS_FLAGS.0 })
        );
    }

    #[test]
    fn an_attribute_the_transition_does_not_take_is_refused() {
        let mask = M::STATE | M::SQ_PSN | M::QKEY | M::DEST_QPN;
        assert_eq!(
            check_modify(QpType::Ud, QpState::Rtr, &to(QpState::Rts), mask),
            Err(ModifyError::ExtraAttr { extra: M::DEST_QPN.0 })
        );
    }

    #[test]
    fn transitions_outside_the_table_are_refused_and_reset_or_err_always_allowed() {
        assert_eq!(
            check_modify(QpType::Rc, QpState::Reset, &to(QpState::Rts), M::STATE),
            Err(ModifyError::BadTransition { from: QpState::Reset, to: QpState::Rts })
        );
        assert_eq!(required_attrs(QpType::Rc, QpState::Init, QpState::Rts), None);
        for from in [QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts, QpState::Err] {
            assert_eq!(check_modify(QpType::Rc, from, &to(QpState::Err), M::STATE), Ok(()));
            assert_eq!(check_modify(QpType::Ud, from, &to(QpState::Reset), M::STATE), Ok(()));
        }
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let rtr_to_rts = M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC;
        let bad_retry = QpAttr { retry_cnt: 8, ..to(QpState::Rts) };
        assert_eq!(
            check_modify(QpType::Rc, QpState::Rtr, &bad_retry, rtr_to_rts),
            Err(ModifyError::BadValue { what: "retry_cnt", value: 8 })
        );
        let bad_psn = QpAttr { sq_psn: 0x100_0000, ..to(QpState::Rts) };
        assert_eq!(
            check_modify(QpType::Rc, QpState::Rtr, &bad_psn, rtr_to_rts),
            Err(ModifyError::BadValue { what: "sq_psn", value: 0x100_0000 })
        );
        let bad_port = QpAttr { port_num: 2, ..to(QpState::Init) };
        let init = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
        assert_eq!(
            check_modify(QpType::Rc, QpState::Reset, &bad_port, init),
            Err(ModifyError::BadValue { what: "port_num", value: 2 })
        );
    }

    #[test]
    fn uc_transitions_follow_the_uc_column_of_qp_state_table() {
        // ib_modify_qp_is_ok: UC needs no responder resources, RNR timer, timeouts or retries.
        let rtr = required_attrs(QpType::Uc, QpState::Init, QpState::Rtr).unwrap();
        assert_eq!(rtr, M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN);
        let rts = required_attrs(QpType::Uc, QpState::Rtr, QpState::Rts).unwrap();
        assert_eq!(rts, M::STATE | M::SQ_PSN);
        let init = required_attrs(QpType::Uc, QpState::Reset, QpState::Init).unwrap();
        assert_eq!(init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS);
        // An RC-only attribute is refused on UC.
        assert_eq!(
            check_modify(QpType::Uc, QpState::Rtr, &to(QpState::Rts), rts | M::RETRY_CNT),
            Err(ModifyError::ExtraAttr { extra: M::RETRY_CNT.0 })
        );
        assert_eq!(check_modify(QpType::Uc, QpState::Rtr, &to(QpState::Rts), rts | M::ACCESS_FLAGS), Ok(()));
        assert_eq!(QpType::Uc.st(), consts::MLX5_QP_ST_UC);
    }

    #[test]
    fn attr_masks_combine_and_contain() {
        let m = M::AV | M::PATH_MTU;
        assert!(m.contains(M::AV) && m.contains(M::PATH_MTU) && !m.contains(M::STATE));
        assert!(m.contains(M::empty()));
        assert_eq!(Mtu::M4096.bytes(), 4096);
    }
}

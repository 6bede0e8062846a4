//! QP firmware commands (PRM CREATE_QP, the modify transitions RST2INIT to 2RST, QUERY_QP, DESTROY_QP) and the
//! `qpc` / address-path encoding.

use super::attr::{AhAttr, QpAttr, QpAttrMask, QpState, QpType};
use crate::cmd::{len_with_pas, write_pas, Pas};
use crate::cmdq::{write_header, CmdError, Command};
use crate::mkey::Access;
use crate::prm::{consts, ifc, Field, MsgBuf, Opcode, Sub, SubBuf};

/// The `qpc` of CREATE_QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpContext {
    /// RC or UD.
    pub qp_type: QpType,
    /// The protection domain.
    pub pd: u32,
    /// UAR page the QP's doorbells use.
    pub uar_page: u32,
    /// CQ of the send queue.
    pub cqn_snd: u32,
    /// CQ of the receive queue.
    pub cqn_rcv: u32,
    /// log2 of the send queue's WQE basic blocks.
    pub log_sq_size: u8,
    /// log2 of the receive queue's WQEs.
    pub log_rq_size: u8,
    /// RQ WQE size is `16 << log_rq_stride`.
    pub log_rq_stride: u8,
    /// The QP has no send queue.
    pub no_sq: bool,
    /// The QP has no receive queue and no SRQ (`rq_type` ZERO_LEN_RQ, as mlx5_ib makes one without receive work
    /// requests).
    pub zero_len_rq: bool,
    /// `log_page_size` (relative to 4 KiB).
    pub log_page_size: u8,
    /// Bus address of the doorbell record.
    pub dbr_addr: u64,
    /// `ts_format`: the device's default timestamp format when it reports one (`mlx5_get_qp_default_ts`).
    pub ts_format: u8,
    /// `user_index`: `MLX5_IB_DEFAULT_UIDX` on a device with `cqe_version` 1 (CQEs then carry it, not a user
    /// index), `None` on version 0.
    pub user_index: Option<u32>,
    /// The SRQ (or RMP) the QP receives through: `rq_type` SRQ and `srqn_rmpn_xrqn`, and no receive queue of its
    /// own (`create_kernel_qp` with `init_attr->srq`).
    pub srqn: Option<u32>,
}

/// `CREATE_QP`; the output is the QP number.
#[derive(Debug, Clone, Copy)]
pub struct CreateQp<'a> {
    /// The QP context.
    pub ctx: QpContext,
    /// The buffer's pages.
    pub pas: Pas<'a>,
}

impl Command for CreateQp<'_> {
    type In = ifc::create_qp_in::Bits;
    type Out = ifc::create_qp_out::Bits;
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateQp
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_qp_in::PAS, self.pas.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::qpc as q;
        write_header(msg, Opcode::CreateQp, 0);
        {
            let mut c = SubBuf::new(msg, ifc::create_qp_in::QPC);
            let x = &self.ctx;
            c.set(q::ST, x.qp_type.st());
            c.set(q::PM_STATE, consts::MLX5_QP_PM_MIGRATED);
            c.set(q::TS_FORMAT, x.ts_format.into());
            // `_create_kernel_qp`: fast registration enabled and the reserved lkey allowed, for every kernel QP.
            c.set(q::FRE, 1);
            c.set(q::RLKY, 1);
            if let Some(uidx) = x.user_index {
                c.set(q::USER_INDEX, uidx);
            }
            c.set(q::PD, x.pd);
            c.set(q::UAR_PAGE, x.uar_page);
            c.set(q::LOG_PAGE_SIZE, x.log_page_size.into());
            match x.srqn {
                // mlx5_ib writes the RQ size only for a QP with its own RQ (`qp->rq.wqe_cnt`).
                Some(srqn) => {
                    c.set(q::RQ_TYPE, consts::MLX5_SRQ_RQ);
                    c.set(q::SRQN_RMPN_XRQN, srqn);
                }
                None if x.zero_len_rq => c.set(q::RQ_TYPE, consts::MLX5_ZERO_LEN_RQ),
                None => {
                    c.set(q::LOG_RQ_SIZE, x.log_rq_size.into());
                    c.set(q::LOG_RQ_STRIDE, x.log_rq_stride.into());
                }
            }
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
    /// RST2INIT_QP.
    Rst2Init,
    /// INIT2INIT_QP.
    Init2Init,
    /// INIT2RTR_QP.
    Init2Rtr,
    /// RTR2RTS_QP.
    Rtr2Rts,
    /// RTS2RTS_QP.
    Rts2Rts,
    /// 2ERR_QP.
    ToErr,
    /// 2RST_QP.
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
    /// The QP number.
    pub qpn: u32,
    /// RC or UD.
    pub qp_type: QpType,
    /// The command to send.
    pub transition: Transition,
    /// The attributes.
    pub attr: QpAttr,
    /// Which attributes are set.
    pub mask: QpAttrMask,
    /// The port's link layer (address paths differ).
    pub link: crate::cq::LinkLayer,
    /// The device's `log_max_msg`, sent as `log_msg_max` with a path MTU (as `__mlx5_ib_modify_qp` does).
    pub log_max_msg: u8,
    /// The address's `static_rate` in the `ads.stat_rate` encoding ([`ib_rate_to_mlx5`]).
    pub stat_rate: u8,
    /// RoCE: the source GID is a RoCE v2 (UDP-encapsulated) entry, so the path gets a UDP source port (RC with a
    /// remote QPN) and a DSCP (`sgid_attr->gid_type == IB_GID_TYPE_ROCE_UDP_ENCAP` in `mlx5_set_path`).
    pub roce_v2: bool,
    /// The QP's protection domain and CQs, sent with every modify.
    pub pd: u32,
    /// The send queue's CQ.
    pub cqn_snd: u32,
    /// The receive queue's CQ.
    pub cqn_rcv: u32,
    /// The doorbell record, sent with RST2INIT when the QP has a receive queue.
    pub dbr_addr: Option<u64>,
    /// The access rights the QP has now (what the last modify with [`QpAttrMask::ACCESS_FLAGS`] set).
    pub cur_access: Access,
    /// The responder depth the QP has now (what the last modify with [`QpAttrMask::MAX_DEST_RD_ATOMIC`] set).
    pub cur_resp_depth: u8,
    /// `qpc.pm_state`, written with every context: the driver has no alternate path, so Linux's
    /// `MLX5_QP_PM_MIGRATED` ([`ModifyQp::linux_defaults`]).
    pub pm_state: u8,
    /// `qpc.log_ack_req_freq`, written with every context (Linux: [`MLX5_IB_ACK_REQ_FREQ`]).
    pub log_ack_req_freq: u8,
    /// `qpc.atomic_mode`, written together with `rae` (`set_qpc_atomic_flags`: the device's mode from
    /// `get_atomic_mode`).
    pub atomic_mode: u8,
    /// `qpc.counter_set_id` of RST2INIT: the port's Q counter, when the device has one.
    pub counter_set_id: Option<u8>,
    /// The QP's port (`qp->port`), where a path goes when this modify names no port.
    pub qp_port: u8,
}

/// What `__mlx5_ib_modify_qp` writes to `log_ack_req_freq` (an enum in mlx5_ib's `qp.c`, not in the PRM headers).
pub const MLX5_IB_ACK_REQ_FREQ: u8 = 8;

impl ModifyQp {
    /// The QP-independent values Linux writes in every modify: `pm_state` MIGRATED and `log_ack_req_freq` 8.
    pub const fn linux_defaults() -> (u8, u8) {
        (consts::MLX5_QP_PM_MIGRATED as u8, MLX5_IB_ACK_REQ_FREQ)
    }

    /// `opt_param_mask` as `__mlx5_ib_modify_qp` computes it: every optional parameter the verbs mask names
    /// (`ib_mask_to_mlx5_opt`), kept where the transition and service take it (`opt_mask`).
    fn opt_param_mask(&self) -> u32 {
        mask_to_optpar(self.mask) & allowed_optpar(self.transition, self.qp_type)
    }
}

/// The `MLX5_QP_OPTPAR_*` bits each verbs attribute stands for (`ib_nr_to_mlx5_nr`).
fn mask_to_optpar(mask: QpAttrMask) -> u32 {
    use consts as k;
    use QpAttrMask as M;
    let table = [
        (M::ACCESS_FLAGS, k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RAE),
        (M::PKEY_INDEX, k::MLX5_QP_OPTPAR_PKEY_INDEX),
        (M::PORT, k::MLX5_QP_OPTPAR_PRI_PORT),
        (M::QKEY, k::MLX5_QP_OPTPAR_Q_KEY),
        (M::AV, k::MLX5_QP_OPTPAR_PRIMARY_ADDR_PATH | k::MLX5_QP_OPTPAR_PRI_PORT),
        (M::TIMEOUT, k::MLX5_QP_OPTPAR_ACK_TIMEOUT),
        (M::RETRY_CNT, k::MLX5_QP_OPTPAR_RETRY_COUNT),
        (M::RNR_RETRY, k::MLX5_QP_OPTPAR_RNR_RETRY),
        (M::MAX_QP_RD_ATOMIC, k::MLX5_QP_OPTPAR_SRA_MAX),
        (M::MIN_RNR_TIMER, k::MLX5_QP_OPTPAR_RNR_TIMEOUT),
        (
            M::MAX_DEST_RD_ATOMIC,
            k::MLX5_QP_OPTPAR_RRA_MAX | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RAE,
        ),
    ];
    table.iter().filter(|(m, _)| mask.contains(*m)).fold(0, |acc, (_, bits)| acc | bits)
}

/// The optional parameters a transition takes for RC, UC and UD (mlx5_ib's `opt_mask` table); RST2INIT, 2ERR and
/// 2RST take none.
fn allowed_optpar(t: Transition, ty: QpType) -> u32 {
    use consts as k;
    let access = k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RAE | k::MLX5_QP_OPTPAR_RWE;
    match (t, ty) {
        (Transition::Init2Init, QpType::Rc) => {
            access | k::MLX5_QP_OPTPAR_PKEY_INDEX | k::MLX5_QP_OPTPAR_PRI_PORT | k::MLX5_QP_OPTPAR_LAG_TX_AFF
        }
        (Transition::Init2Init, QpType::Ud) => {
            k::MLX5_QP_OPTPAR_PKEY_INDEX | k::MLX5_QP_OPTPAR_Q_KEY | k::MLX5_QP_OPTPAR_PRI_PORT
        }
        (Transition::Init2Rtr, QpType::Rc) => {
            k::MLX5_QP_OPTPAR_ALT_ADDR_PATH | access | k::MLX5_QP_OPTPAR_PKEY_INDEX | k::MLX5_QP_OPTPAR_LAG_TX_AFF
        }
        (Transition::Init2Rtr, QpType::Ud) => k::MLX5_QP_OPTPAR_PKEY_INDEX | k::MLX5_QP_OPTPAR_Q_KEY,
        (Transition::Rtr2Rts, QpType::Rc) | (Transition::Rts2Rts, QpType::Rc) => {
            k::MLX5_QP_OPTPAR_ALT_ADDR_PATH | access | k::MLX5_QP_OPTPAR_PM_STATE | k::MLX5_QP_OPTPAR_RNR_TIMEOUT
        }
        (Transition::Rtr2Rts, QpType::Ud) => k::MLX5_QP_OPTPAR_Q_KEY,
        (Transition::Rts2Rts, QpType::Ud) => {
            k::MLX5_QP_OPTPAR_Q_KEY | k::MLX5_QP_OPTPAR_SRQN | k::MLX5_QP_OPTPAR_CQN_RCV
        }
        // UC: remote write is its only remote access (`opt_mask[...][MLX5_QP_ST_UC]`).
        (Transition::Init2Init, QpType::Uc) => {
            k::MLX5_QP_OPTPAR_RWE
                | k::MLX5_QP_OPTPAR_PKEY_INDEX
                | k::MLX5_QP_OPTPAR_PRI_PORT
                | k::MLX5_QP_OPTPAR_LAG_TX_AFF
        }
        (Transition::Init2Rtr, QpType::Uc) => {
            k::MLX5_QP_OPTPAR_ALT_ADDR_PATH
                | k::MLX5_QP_OPTPAR_RWE
                | k::MLX5_QP_OPTPAR_PKEY_INDEX
                | k::MLX5_QP_OPTPAR_LAG_TX_AFF
        }
        (Transition::Rtr2Rts, QpType::Uc) | (Transition::Rts2Rts, QpType::Uc) => {
            k::MLX5_QP_OPTPAR_ALT_ADDR_PATH | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_PM_STATE
        }
        // `opt_mask` has no column for `MLX5_QP_ST_QP0` or `_QP1`: mlx5_ib sends the special QPs' modifies with no
        // optional bits.
        (_, QpType::Gsi | QpType::Smi) => 0,
        (Transition::Rst2Init | Transition::ToErr | Transition::ToRst, _) => 0,
    }
}

/// The `ads.stat_rate` encoding of an `ib_rate` (`ib_to_mlx5_rate_map`).
fn ib_to_mlx5_rate_map(rate: u8) -> u8 {
    match u32::from(rate) {
        consts::IB_RATE_PORT_CURRENT => 0,
        consts::IB_RATE_56_GBPS => 1,
        consts::IB_RATE_25_GBPS => 2,
        consts::IB_RATE_100_GBPS => 3,
        consts::IB_RATE_200_GBPS => 4,
        consts::IB_RATE_50_GBPS => 5,
        consts::IB_RATE_400_GBPS => 6,
        _ => rate + consts::MLX5_STAT_RATE_OFFSET as u8,
    }
}

/// An address's `static_rate` (`ib_rate`) as `ads.stat_rate` (`mlx5r_ib_rate`): 0 (the port's rate) for the port's
/// current rate and for 800 Gb/s, otherwise the fastest rate the device supports (`stat_rate_support`) at or
/// below the request; `None` for a value that is not an `ib_rate`.
pub fn ib_rate_to_mlx5(rate: u8, stat_rate_support: u16) -> Option<u8> {
    let r = u32::from(rate);
    if r == consts::IB_RATE_PORT_CURRENT || r == consts::IB_RATE_800_GBPS {
        return Some(0);
    }
    if !(consts::IB_RATE_2_5_GBPS..=consts::IB_RATE_800_GBPS).contains(&r) {
        return None;
    }
    let mut rate = rate;
    // Linux steps down through the enum's values, not through speeds; the loop ends at the port rate at worst.
    while u32::from(rate) != consts::IB_RATE_PORT_CURRENT
        && (1u32 << ib_to_mlx5_rate_map(rate)) & u32::from(stat_rate_support) == 0
    {
        rate -= 1;
    }
    Some(ib_to_mlx5_rate_map(rate))
}

/// The symmetric flow label of a connection from its two QPNs (`rdma_calc_flow_label`), for a GRH without one.
pub fn calc_flow_label(lqpn: u32, rqpn: u32) -> u32 {
    let mut v = u64::from(lqpn) * u64::from(rqpn);
    v ^= v >> 20;
    v ^= v >> 40;
    (v as u32) & consts::IB_GRH_FLOWLABEL_MASK
}

/// The RoCE v2 UDP source port of a flow label (`rdma_flow_label_to_udp_sport`): the label folded to 14 bits in
/// the range from `IB_ROCE_UDP_ENCAP_VALID_PORT_MIN` up.
pub fn flow_label_to_udp_sport(fl: u32) -> u16 {
    let (low, high) = (fl & 0x3fff, fl & 0xf_c000);
    ((low ^ (high >> 14)) | consts::IB_ROCE_UDP_ENCAP_VALID_PORT_MIN) as u16
}

/// What the address path takes beyond the address itself.
struct PathExtra {
    /// `ads.stat_rate` (already mapped).
    stat_rate: u8,
    /// The source GID is RoCE v2.
    roce_v2: bool,
    /// The UDP source port, when `mlx5_set_path` sets one.
    udp_sport: Option<u16>,
    /// `vhca_port_num`.
    port: u8,
}

/// Writes the address path (`mlx5_set_path` for the primary path).
fn set_path<B: MsgBuf + ?Sized>(
    c: &mut SubBuf<'_, B>,
    base: Sub,
    ah: &AhAttr,
    link: crate::cq::LinkLayer,
    x: &PathExtra,
) {
    use ifc::ads as a;
    let at = |f: Field| f.at(base);
    match link {
        crate::cq::LinkLayer::InfiniBand => {
            c.set(at(a::RLID), ah.dlid.into());
            c.set(at(a::SL), u32::from(ah.sl & 0xf));
            c.set(at(a::MLID), u32::from(ah.src_path_bits & 0x7f));
            // Only an InfiniBand path says whether a GRH follows; on RoCE every packet has one.
            c.set(at(a::GRH), ah.grh.is_some().into());
        }
        crate::cq::LinkLayer::Ethernet => {
            c.set(at(a::RMAC_47_32), u32::from(u16::from_be_bytes([ah.dmac[0], ah.dmac[1]])));
            c.set(at(a::RMAC_31_0), u32::from_be_bytes([ah.dmac[2], ah.dmac[3], ah.dmac[4], ah.dmac[5]]));
            c.set(at(a::ETH_PRIO), u32::from(ah.sl & 7));
            if let Some(sport) = x.udp_sport {
                c.set(at(a::UDP_SPORT), sport.into());
            }
            if x.roce_v2 {
                let tclass = ah.grh.map_or(0, |g| g.traffic_class);
                c.set(at(a::DSCP), u32::from(tclass >> 2));
            }
        }
    }
    if let Some(g) = ah.grh {
        c.set(at(a::SRC_ADDR_INDEX), g.sgid_index.into());
        c.set(at(a::HOP_LIMIT), g.hop_limit.into());
        c.set(at(a::TCLASS), g.traffic_class.into());
        c.set(at(a::FLOW_LABEL), g.flow_label & 0xf_ffff);
        for (i, b) in g.dgid.iter().enumerate() {
            c.set(a::RGID_RIP.elem(i as u32).at(base), u32::from(*b));
        }
    }
    c.set(at(a::STAT_RATE), x.stat_rate.into());
    c.set(at(a::VHCA_PORT_NUM), x.port.max(1).into());
}

/// `log_msg_max` of every UD modify: 4 KiB, one MTU (`__mlx5_ib_modify_qp`).
pub const UD_LOG_MSG_MAX: u8 = 12;

/// `log_msg_max` of every modify of the SMI and GSI QPs: 256 bytes, one MAD (`__mlx5_ib_modify_qp`).
pub const GSI_LOG_MSG_MAX: u8 = 8;

/// The lowest RoCE v2 UDP source port (`r_roce_min_src_udp_port` of the simulated and real ConnectX-5: 0xc000).
pub const ROCE_UDP_SPORT_MIN: u32 = 0xc000;

/// `fls(v - 1)`, what `__mlx5_ib_modify_qp` writes to `log_sra_max` / `log_rra_max` for `v` outstanding reads and
/// atomics: log2 rounded up, so the device allows at least `v` (3 gives 2, that is 4).
fn log_rd_atomic(v: u8) -> u32 {
    32 - u32::from(v.saturating_sub(1)).leading_zeros()
}

impl ModifyQp {
    /// The remote access rights this modify writes (`set_qpc_atomic_flags`), `None` when it writes none: from
    /// this modify's attributes or the QP's stored ones, and without responder resources only remote write stays.
    pub fn remote_access(&self) -> Option<Access> {
        let (a, m) = (&self.attr, self.mask);
        if !m.contains(QpAttrMask::ACCESS_FLAGS) && !m.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            return None;
        }
        let depth = if m.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) { a.max_dest_rd_atomic } else { self.cur_resp_depth };
        let acc = if m.contains(QpAttrMask::ACCESS_FLAGS) { a.qp_access_flags } else { self.cur_access };
        Some(if depth == 0 { Access(acc.0 & Access::REMOTE_WRITE.0) } else { acc })
    }

    /// `rre` / `rwe` / `rae` as `set_qpc_atomic_flags` writes them.
    fn set_access<B: MsgBuf + ?Sized>(&self, c: &mut SubBuf<'_, B>) {
        use ifc::qpc as q;
        let Some(acc) = self.remote_access() else { return };
        c.set(q::RRE, acc.contains(Access::REMOTE_READ).into());
        if acc.contains(Access::REMOTE_ATOMIC) {
            c.set(q::RAE, 1);
            c.set(q::ATOMIC_MODE, self.atomic_mode.into());
        }
        c.set(q::RWE, acc.contains(Access::REMOTE_WRITE).into());
    }
}

impl Command for ModifyQp {
    type In = ifc::mbox_in::Bits;
    type Out = ifc::mbox_out::Bits;
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
        c.set(q::ST, self.qp_type.st());
        c.set(q::PM_STATE, self.pm_state.into());
        c.set(q::LOG_ACK_REQ_FREQ, self.log_ack_req_freq.into());
        if self.qp_type == QpType::Ud {
            // Every UD modify carries the largest MTU and 4 KiB messages, whatever the mask.
            c.set(q::MTU, consts::IB_MTU_4096.into());
            c.set(q::LOG_MSG_MAX, UD_LOG_MSG_MAX.into());
        } else if self.qp_type.is_special() {
            // The special QPs run at the smallest MTU with one-MTU messages: a MAD is 256 bytes.
            c.set(q::MTU, consts::IB_MTU_256.into());
            c.set(q::LOG_MSG_MAX, GSI_LOG_MSG_MAX.into());
        }
        if m.contains(QpAttrMask::PKEY_INDEX) {
            c.set(ifc::ads::PKEY_INDEX.at(path), a.pkey_index.into());
        }
        if m.contains(QpAttrMask::PORT) || self.transition == Transition::Rst2Init {
            c.set(ifc::ads::VHCA_PORT_NUM.at(path), a.port_num.max(1).into());
        }
        self.set_access(&mut c);
        c.set(q::PD, self.pd);
        c.set(q::CQN_SND, self.cqn_snd);
        c.set(q::CQN_RCV, self.cqn_rcv);
        if self.transition == Transition::Rst2Init {
            if let Some(dbr) = self.dbr_addr {
                c.set64(q::DBR_ADDR, dbr);
            }
            if let Some(id) = self.counter_set_id {
                c.set(q::COUNTER_SET_ID, id.into());
            }
            // The driver is the kernel consumer: its QPs may use the reserved lkey.
            c.set(q::RLKY, 1);
        }
        if m.contains(QpAttrMask::QKEY) {
            c.set(q::Q_KEY, a.qkey);
        }
        if m.contains(QpAttrMask::AV) {
            // Linux derives the port for connected QPs only, and only with the remote QPN in the same modify.
            let connected = matches!(self.qp_type, QpType::Rc | QpType::Uc) && m.contains(QpAttrMask::DEST_QPN);
            let udp_sport = (self.roce_v2 && connected).then(|| {
                let fl = a.ah_attr.grh.map_or(0, |g| g.flow_label);
                let fl = if fl == 0 { calc_flow_label(self.qpn, a.dest_qp_num) } else { fl };
                flow_label_to_udp_sport(fl)
            });
            // The path goes out on the port this modify names, else on the QP's (`__mlx5_ib_modify_qp`), whatever
            // the address handle says.
            let port = if m.contains(QpAttrMask::PORT) { a.port_num } else { self.qp_port };
            let x = PathExtra { stat_rate: self.stat_rate, roce_v2: self.roce_v2, udp_sport, port };
            set_path(&mut c, path, &a.ah_attr, self.link, &x);
        }
        if m.contains(QpAttrMask::PATH_MTU) && !self.qp_type.is_datagram() {
            c.set(q::MTU, a.path_mtu as u32);
            c.set(q::LOG_MSG_MAX, self.log_max_msg.into());
        }
        if m.contains(QpAttrMask::DEST_QPN) {
            c.set(q::REMOTE_QPN, a.dest_qp_num & 0xff_ffff);
        }
        if m.contains(QpAttrMask::RQ_PSN) {
            c.set(q::NEXT_RCV_PSN, a.rq_psn);
        }
        // Linux leaves the field 0 for a count of 0, which is what `log_rd_atomic` gives.
        if m.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            c.set(q::LOG_RRA_MAX, log_rd_atomic(a.max_dest_rd_atomic));
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
            c.set(q::LOG_SRA_MAX, log_rd_atomic(a.max_rd_atomic));
        }
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// The primary address path as `QUERY_QP` reports it (`ads`, the fields `to_rdma_ah_attr` reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathQuery {
    /// `grh`: the path carries a GRH (InfiniBand; RoCE paths always do).
    pub grh: bool,
    /// `rlid`.
    pub rlid: u16,
    /// `mlid`: the source path bits.
    pub mlid: u8,
    /// `sl`.
    pub sl: u8,
    /// `stat_rate` in the device's encoding.
    pub stat_rate: u8,
    /// `src_addr_index`: the source GID index.
    pub src_addr_index: u8,
    /// `hop_limit`.
    pub hop_limit: u8,
    /// `tclass`.
    pub tclass: u8,
    /// `flow_label`.
    pub flow_label: u32,
    /// `rgid_rip`: the destination GID.
    pub rgid: [u8; 16],
    /// `rmac_47_32:rmac_31_0`: the next hop's MAC (RoCE).
    pub rmac: [u8; 6],
    /// `pkey_index`.
    pub pkey_index: u16,
    /// `vhca_port_num`.
    pub port: u8,
    /// `ack_timeout`.
    pub ack_timeout: u8,
}

/// The `ib_rate` of an `ads.stat_rate` (mlx5_ib `mlx5_to_ib_rate_map`, the inverse of `ib_to_mlx5_rate_map`).
pub fn mlx5_to_ib_rate_map(rate: u8) -> u8 {
    const RATES: [u32; 7] = [
        consts::IB_RATE_PORT_CURRENT,
        consts::IB_RATE_56_GBPS,
        consts::IB_RATE_25_GBPS,
        consts::IB_RATE_100_GBPS,
        consts::IB_RATE_200_GBPS,
        consts::IB_RATE_50_GBPS,
        consts::IB_RATE_400_GBPS,
    ];
    match RATES.get(usize::from(rate)) {
        Some(&r) => r as u8,
        None => rate.wrapping_sub(consts::MLX5_STAT_RATE_OFFSET as u8),
    }
}

/// What `QUERY_QP` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpQuery {
    /// The current state.
    pub state: QpState,
    /// `state` was `MLX5_QP_STATE_SQ_DRAINING` (reported as [`QpState::Sqd`] with `sq_draining`).
    pub sq_draining: bool,
    /// `pm_state` (`MLX5_QP_PM_*`).
    pub pm_state: u8,
    /// `rre`, `rwe`, `rae`.
    pub remote_access: Access,
    /// `log_sra_max`.
    pub log_sra_max: u8,
    /// `log_rra_max`.
    pub log_rra_max: u8,
    /// `min_rnr_nak`.
    pub min_rnr_nak: u8,
    /// `retry_count`.
    pub retry_count: u8,
    /// `rnr_retry`.
    pub rnr_retry: u8,
    /// The primary address path.
    pub path: PathQuery,
    /// Remote QP number.
    pub remote_qpn: u32,
    /// Next send PSN.
    pub next_send_psn: u32,
    /// Next expected receive PSN.
    pub next_rcv_psn: u32,
    /// Path MTU (`ib_mtu`).
    pub mtu: u8,
    /// Q_Key.
    pub qkey: u32,
    /// Send WQE basic blocks the device has consumed.
    pub hw_sq_wqebb_counter: u16,
    /// Receive WQEs the device has consumed.
    pub hw_rq_counter: u32,
}

/// Path migration state (`ibv_mig_state`, from `qpc.pm_state` as `to_ib_mig_state` maps it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum MigState {
    /// `IBV_MIG_MIGRATED`.
    Migrated,
    /// `IBV_MIG_REARM`.
    Rearm,
    /// `IBV_MIG_ARMED`.
    Armed,
    /// A `pm_state` the headers do not name.
    Unknown(u8),
}

impl MigState {
    /// `to_ib_mig_state`.
    pub const fn from_pm_state(pm: u8) -> Self {
        match pm as u32 {
            consts::MLX5_QP_PM_MIGRATED => MigState::Migrated,
            consts::MLX5_QP_PM_REARM => MigState::Rearm,
            consts::MLX5_QP_PM_ARMED => MigState::Armed,
            _ => MigState::Unknown(pm),
        }
    }
}

/// Every attribute `ibv_query_qp` returns (`ibv_qp_attr` without the alternate path, which the driver never sets,
/// and the QP's init attributes that matter), decoded from QUERY_QP as `query_qp_attr` / `mlx5_ib_query_qp` do;
/// the capabilities are the driver's own sizes (rdma-core's `mlx5_query_qp` reports them from the queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpQueryAttr {
    /// `qp_state`.
    pub qp_state: QpState,
    /// `cur_qp_state` (the same, as mlx5_ib reports it).
    pub cur_qp_state: QpState,
    /// `path_mtu` as `ib_mtu` (0 before INIT2RTR; 5 on UD, which always runs at 4096).
    pub path_mtu: u8,
    /// `path_mig_state`.
    pub path_mig_state: MigState,
    /// `qkey`.
    pub qkey: u32,
    /// `rq_psn`: the next PSN the responder expects.
    pub rq_psn: u32,
    /// `sq_psn`: the next PSN the requester sends.
    pub sq_psn: u32,
    /// `dest_qp_num`.
    pub dest_qp_num: u32,
    /// `qp_access_flags` from `rre` / `rwe` / `rae`.
    pub qp_access_flags: Access,
    /// `cap`: what the driver's queues hold.
    pub cap: super::attr::QpCap,
    /// `ah_attr`: the primary path of a connected QP (`to_rdma_ah_attr`; all zero for UD, or a path with no port).
    pub ah_attr: AhAttr,
    /// `pkey_index`.
    pub pkey_index: u16,
    /// `en_sqd_async_notify` (mlx5_ib leaves it 0).
    pub en_sqd_async_notify: bool,
    /// `sq_draining`: the device reported `SQ_DRAINING`.
    pub sq_draining: bool,
    /// `max_rd_atomic`: `1 << log_sra_max`.
    pub max_rd_atomic: u8,
    /// `max_dest_rd_atomic`: `1 << log_rra_max`.
    pub max_dest_rd_atomic: u8,
    /// `min_rnr_timer`.
    pub min_rnr_timer: u8,
    /// `port_num`.
    pub port_num: u8,
    /// `timeout`: the path's ACK timeout.
    pub timeout: u8,
    /// `retry_cnt`.
    pub retry_cnt: u8,
    /// `rnr_retry`.
    pub rnr_retry: u8,
    /// `qp_init_attr.qp_type`.
    pub qp_type: QpType,
    /// `qp_init_attr.sq_sig_all`.
    pub sq_sig_all: bool,
}

impl QpQueryAttr {
    /// The verbs attributes of a QP of `qp_type` from its QUERY_QP output (`query_qp_attr`, `to_rdma_ah_attr`)
    /// on a port of `link` type; `cap` and `sq_sig_all` are the driver's.
    pub fn decode(
        q: &QpQuery,
        qp_type: QpType,
        cap: super::attr::QpCap,
        sq_sig_all: bool,
        link: crate::cq::LinkLayer,
    ) -> Self {
        let p = &q.path;
        let connected = matches!(qp_type, QpType::Rc | QpType::Uc);
        // The device has one port: a path naming another (or none) gives an empty address, as Linux's check
        // against `num_ports` does.
        let ah_attr = if connected && p.port == 1 {
            let roce = link == crate::cq::LinkLayer::Ethernet;
            AhAttr {
                dlid: p.rlid,
                sl: p.sl,
                src_path_bits: p.mlid,
                static_rate: mlx5_to_ib_rate_map(p.stat_rate),
                grh: (p.grh || roce).then_some(super::attr::Grh {
                    dgid: p.rgid,
                    flow_label: p.flow_label,
                    sgid_index: p.src_addr_index,
                    hop_limit: p.hop_limit,
                    traffic_class: p.tclass,
                }),
                // Not part of Linux's decode (it has no field for it); the device holds it, so it is kept.
                dmac: if roce { p.rmac } else { [0; 6] },
                port_num: p.port,
            }
        } else {
            AhAttr::default()
        };
        Self {
            qp_state: q.state,
            cur_qp_state: q.state,
            path_mtu: q.mtu,
            path_mig_state: MigState::from_pm_state(q.pm_state),
            qkey: q.qkey,
            rq_psn: q.next_rcv_psn,
            sq_psn: q.next_send_psn,
            dest_qp_num: q.remote_qpn,
            qp_access_flags: q.remote_access,
            cap,
            ah_attr,
            pkey_index: p.pkey_index,
            en_sqd_async_notify: false,
            sq_draining: q.sq_draining,
            max_rd_atomic: 1u8.checked_shl(q.log_sra_max.into()).unwrap_or(0),
            max_dest_rd_atomic: 1u8.checked_shl(q.log_rra_max.into()).unwrap_or(0),
            min_rnr_timer: q.min_rnr_nak,
            port_num: p.port,
            timeout: p.ack_timeout,
            retry_cnt: q.retry_count,
            rnr_retry: q.rnr_retry,
            qp_type,
            sq_sig_all,
        }
    }
}

/// `QUERY_QP` (the context only).
#[derive(Debug, Clone, Copy)]
pub struct QueryQp {
    /// The QP number.
    pub qpn: u32,
}

impl Command for QueryQp {
    type In = ifc::query_qp_in::Bits;
    type Out = ifc::query_qp_out::Bits;
    type Output = QpQuery;
    fn opcode(&self) -> Opcode {
        Opcode::QueryQp
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
        let path = q::PRIMARY_ADDRESS_PATH.at(ifc::query_qp_out::QPC);
        let ads = |f: Field| out.get(f.at(path));
        let raw_state = at(q::STATE) as u8;
        // `to_ib_qp_state`: a draining SQ is SQD.
        let sq_draining = raw_state == consts::MLX5_QP_STATE_SQ_DRAINING;
        let state = if sq_draining { QpState::Sqd } else { QpState::from_raw(raw_state) };
        let mut rgid = [0u8; 16];
        for (i, b) in rgid.iter_mut().enumerate() {
            *b = ads(ifc::ads::RGID_RIP.elem(i as u32)) as u8;
        }
        let (mac_hi, mac_lo) =
            ((ads(ifc::ads::RMAC_47_32) as u16).to_be_bytes(), ads(ifc::ads::RMAC_31_0).to_be_bytes());
        let mut remote_access = Access::default();
        for (f, a) in [(q::RRE, Access::REMOTE_READ), (q::RWE, Access::REMOTE_WRITE), (q::RAE, Access::REMOTE_ATOMIC)] {
            if at(f) != 0 {
                remote_access = Access(remote_access.0 | a.0);
            }
        }
        Ok(QpQuery {
            state,
            sq_draining,
            pm_state: at(q::PM_STATE) as u8,
            remote_access,
            log_sra_max: at(q::LOG_SRA_MAX) as u8,
            log_rra_max: at(q::LOG_RRA_MAX) as u8,
            min_rnr_nak: at(q::MIN_RNR_NAK) as u8,
            retry_count: at(q::RETRY_COUNT) as u8,
            rnr_retry: at(q::RNR_RETRY) as u8,
            path: PathQuery {
                grh: ads(ifc::ads::GRH) != 0,
                rlid: ads(ifc::ads::RLID) as u16,
                mlid: ads(ifc::ads::MLID) as u8,
                sl: ads(ifc::ads::SL) as u8,
                stat_rate: ads(ifc::ads::STAT_RATE) as u8,
                src_addr_index: ads(ifc::ads::SRC_ADDR_INDEX) as u8,
                hop_limit: ads(ifc::ads::HOP_LIMIT) as u8,
                tclass: ads(ifc::ads::TCLASS) as u8,
                flow_label: ads(ifc::ads::FLOW_LABEL),
                rgid,
                rmac: [mac_hi[0], mac_hi[1], mac_lo[0], mac_lo[1], mac_lo[2], mac_lo[3]],
                pkey_index: ads(ifc::ads::PKEY_INDEX) as u16,
                port: ads(ifc::ads::VHCA_PORT_NUM) as u8,
                ack_timeout: ads(ifc::ads::ACK_TIMEOUT) as u8,
            },
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

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn outstanding_reads_round_up_as_fls() {
        // fls(v - 1): 1 -> 0, 2 -> 1, 3 -> 2 (room for 4), 16 -> 4, 0 -> 0.
        let got: [u32; 6] = [0, 1, 2, 3, 16, 17].map(log_rd_atomic);
        assert_eq!(got, [0, 0, 1, 2, 4, 5]);
    }

    #[test]
    fn optional_parameters_follow_opt_mask() {
        use consts as k;
        use QpAttrMask as M;
        let opt = |t, ty, m: QpAttrMask| mask_to_optpar(m) & allowed_optpar(t, ty);
        let access = k::MLX5_QP_OPTPAR_RRE | k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_RAE;
        // INIT2INIT takes the port (PRI_PORT) and the pkey index; RST2INIT takes nothing.
        let m = M::PORT | M::PKEY_INDEX | M::ACCESS_FLAGS;
        let want = k::MLX5_QP_OPTPAR_PRI_PORT | k::MLX5_QP_OPTPAR_PKEY_INDEX | access;
        assert_eq!(opt(Transition::Init2Init, QpType::Rc, m), want);
        assert_eq!(opt(Transition::Rst2Init, QpType::Rc, m), 0);
        let ud = k::MLX5_QP_OPTPAR_PRI_PORT | k::MLX5_QP_OPTPAR_Q_KEY;
        assert_eq!(opt(Transition::Init2Init, QpType::Ud, M::PORT | M::QKEY), ud);
        // MAX_DEST_RD_ATOMIC brings the access bits; RRA_MAX, the path and RNR_TIMEOUT are not INIT2RTR options.
        let rtr = M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER;
        assert_eq!(opt(Transition::Init2Rtr, QpType::Rc, rtr), access);
        let rts = M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC | M::MIN_RNR_TIMER;
        assert_eq!(opt(Transition::Rtr2Rts, QpType::Rc, rts), k::MLX5_QP_OPTPAR_RNR_TIMEOUT);
        // UC takes only the remote-write bit of the access flags.
        assert_eq!(opt(Transition::Rtr2Rts, QpType::Uc, M::SQ_PSN | M::ACCESS_FLAGS), k::MLX5_QP_OPTPAR_RWE);
        let uc_init = k::MLX5_QP_OPTPAR_RWE | k::MLX5_QP_OPTPAR_PKEY_INDEX | k::MLX5_QP_OPTPAR_PRI_PORT;
        assert_eq!(opt(Transition::Init2Init, QpType::Uc, M::PORT | M::PKEY_INDEX | M::ACCESS_FLAGS), uc_init);
        // The GSI QP (`MLX5_QP_ST_QP1`) has no `opt_mask` column: none of its modifies carries an optional bit.
        for t in [Transition::Init2Init, Transition::Init2Rtr, Transition::Rtr2Rts, Transition::Rts2Rts] {
            assert_eq!(opt(t, QpType::Gsi, M::PORT | M::PKEY_INDEX | M::QKEY), 0, "{t:?}");
        }
        assert_eq!(QpType::Gsi.st(), k::MLX5_QP_ST_QP1);
        assert!(QpType::Gsi.is_datagram() && QpType::Ud.is_datagram() && !QpType::Uc.is_datagram());
    }

    #[test]
    fn stat_rates_map_back_as_mlx5_to_ib_rate_map() {
        let all = 0xffff;
        for r in
            [consts::IB_RATE_PORT_CURRENT, consts::IB_RATE_10_GBPS, consts::IB_RATE_25_GBPS, consts::IB_RATE_400_GBPS]
        {
            let r = r as u8;
            assert_eq!(mlx5_to_ib_rate_map(ib_rate_to_mlx5(r, all).unwrap()), r);
        }
    }

    #[test]
    fn udp_source_ports_fold_the_flow_label() {
        assert_eq!(calc_flow_label(0x100, 0x101), 0x10100);
        assert_eq!(calc_flow_label(0x101, 0x100), 0x10100);
        assert_eq!(calc_flow_label(0xab_cdef, 0x12_3456), 0xac3e3);
        assert_eq!(flow_label_to_udp_sport(0x10100), 0xc104);
        assert_eq!(flow_label_to_udp_sport(0xac3e3), 0xc3c8);
        assert_eq!(flow_label_to_udp_sport(0x12345), 0xe341);
    }

    #[test]
    fn static_rates_map_as_mlx5r_ib_rate() {
        let all = 0xffff;
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_PORT_CURRENT as u8, all), Some(0));
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_800_GBPS as u8, all), Some(0));
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_10_GBPS as u8, all), Some(8));
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_25_GBPS as u8, all), Some(2));
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_100_GBPS as u8, all), Some(3));
        assert_eq!(ib_rate_to_mlx5(1, all), None);
        assert_eq!(ib_rate_to_mlx5(24, all), None);
        // Without 40 Gb/s (encoding 12) the request steps down to the enum's previous value, 20 Gb/s (11).
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_40_GBPS as u8, all & !(1 << 12)), Some(11));
        // Nothing supported: the port's rate.
        assert_eq!(ib_rate_to_mlx5(consts::IB_RATE_40_GBPS as u8, 0), Some(0));
    }
}

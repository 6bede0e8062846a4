//! Linux parity of the QP modify commands: for RC (RST2INIT, INIT2RTR, RTR2RTS, RTS2RTS) and UD (RST2INIT,
//! INIT2RTR, RTR2RTS) on RoCE and on InfiniBand, a table of rows (the verbs call and its input, the PRM field, the
//! value Linux 6.12 mlx5_ib sets, the kernel function it comes from) checked against the command bytes the driver
//! put on the command queue, read back with the generated `ifc::` descriptors. A row where the driver deliberately
//! differs says so, with the value the driver sends and the reason.

use std::cell::RefCell;
use std::rc::Rc;

use mlx5_core::cq::Cq;
use mlx5_core::hca::{Config, CqAttr, Hca, Pd, QpInitAttr};
use mlx5_core::mkey::Access;
use mlx5_core::prm::{consts, ifc, Field, MsgBuf, Opcode, Sub};
use mlx5_core::qp::{AhAttr, Grh, Mtu, Qp, QpAttr, QpAttrMask as M, QpCap, QpState, QpType};
use mlx5_core::trace::{CmdRecord, CmdTrace};
use mlx5_sim::{PortType, SimConfig, SimDevice, SimDma, SimMmio};

/// A command's opcode and input bytes.
type Sent = (Opcode, Vec<u8>);

/// Every command sent, in order.
#[derive(Clone, Default)]
struct Recorder(Rc<RefCell<Vec<Sent>>>);

impl CmdTrace for Recorder {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        let mut bytes = Vec::with_capacity(rec.input.len());
        while bytes.len() < rec.input.len() {
            let chunk = rec.input.chunk(bytes.len());
            let n = chunk.len().min(rec.input.len() - bytes.len());
            bytes.extend_from_slice(&chunk[..n]);
        }
        self.0.borrow_mut().push((rec.opcode, bytes));
    }
}

/// Where a row's field is: in the command, in its `qpc`, or in the `qpc`'s primary address path.
#[derive(Clone, Copy)]
enum At {
    Cmd(Field),
    Qpc(Field),
    Path(Field),
}

/// What the row expects: Linux's value, or a deliberate difference.
#[derive(Clone, Copy)]
enum Expect {
    Linux(u64),
    Differs { ours: u64, linux: &'static str, why: &'static str },
}

struct Row {
    call: &'static str,
    field: &'static str,
    at: At,
    expect: Expect,
    kernel: &'static str,
}

fn row(call: &'static str, field: &'static str, at: At, v: u64, kernel: &'static str) -> Row {
    Row { call, field, at, expect: Expect::Linux(v), kernel }
}

/// The rows every modify with a `qpc` shares.
fn every_modify(call: &'static str, st: u32, pd: u32, cqn: u32) -> Vec<Row> {
    vec![
        row(call, "qpc.st", At::Qpc(ifc::qpc::ST), st.into(), "__mlx5_ib_modify_qp (to_mlx5_st)"),
        row(call, "qpc.pd", At::Qpc(ifc::qpc::PD), pd.into(), "__mlx5_ib_modify_qp"),
        row(call, "qpc.cqn_snd", At::Qpc(ifc::qpc::CQN_SND), cqn.into(), "__mlx5_ib_modify_qp (get_cqs)"),
        row(call, "qpc.cqn_rcv", At::Qpc(ifc::qpc::CQN_RCV), cqn.into(), "__mlx5_ib_modify_qp (get_cqs)"),
        row(call, "qpc.pm_state", At::Qpc(ifc::qpc::PM_STATE), 3, "__mlx5_ib_modify_qp (MLX5_QP_PM_MIGRATED)"),
        row(
            call,
            "qpc.log_ack_req_freq",
            At::Qpc(ifc::qpc::LOG_ACK_REQ_FREQ),
            8,
            "__mlx5_ib_modify_qp (MLX5_IB_ACK_REQ_FREQ)",
        ),
    ]
}

/// The flow label and UDP source port of `rdma_calc_flow_label` / `rdma_flow_label_to_udp_sport`, written out
/// from include/rdma/ib_verbs.h independently of the driver.
fn linux_udp_sport(lqpn: u32, rqpn: u32) -> u64 {
    let mut v = u64::from(lqpn) * u64::from(rqpn);
    v ^= v >> 20;
    v ^= v >> 40;
    let fl = v & 0xf_ffff;
    ((fl & 0x3fff) ^ ((fl & 0xf_c000) >> 14)) | 0xc000
}

fn check(cmds: &[Sent], op: Opcode, rows: &[Row]) {
    let (_, inp) = cmds.iter().rev().find(|(o, _)| *o == op).unwrap_or_else(|| panic!("no {op:?} sent"));
    let qpc: Sub = match op {
        Opcode::Rst2initQp => ifc::rst2init_qp_in::QPC,
        Opcode::Init2rtrQp => ifc::init2rtr_qp_in::QPC,
        Opcode::Rtr2rtsQp => ifc::rtr2rts_qp_in::QPC,
        Opcode::Rts2rtsQp => ifc::rts2rts_qp_in::QPC,
        Opcode::CreateQp => ifc::create_qp_in::QPC,
        _ => panic!("{op:?} has no qpc"),
    };
    let path = ifc::qpc::PRIMARY_ADDRESS_PATH.at(qpc);
    for r in rows {
        let f = match r.at {
            At::Cmd(f) => f,
            At::Qpc(f) => f.at(qpc),
            At::Path(f) => f.at(path),
        };
        let got = if f.width > 32 { MsgBuf::get64(&inp[..], f) } else { MsgBuf::get(&inp[..], f).into() };
        let want = match r.expect {
            Expect::Linux(v) => v,
            Expect::Differs { ours, .. } => ours,
        };
        assert_eq!(got, want, "{op:?} {} after {}: {} ({})", r.field, r.call, r.kernel, describe(&r.expect));
    }
}

fn describe(e: &Expect) -> String {
    match e {
        Expect::Linux(v) => format!("Linux sets {v:#x}"),
        Expect::Differs { linux, why, .. } => format!("deliberate difference: Linux sets {linux}; {why}"),
    }
}

type RecHca = Hca<SimMmio, SimDma, Recorder>;

struct Setup {
    dev: SimDevice,
    hca: RecHca,
    d: mlx5_sim::SimDelay,
    rec: Recorder,
}

fn setup(cfg: SimConfig) -> Setup {
    let dev = SimDevice::new(cfg);
    let mut d = dev.delay();
    let rec = Recorder::default();
    let hca = Hca::bring_up(dev.mmio(), dev.dma(), rec.clone(), &mut d, Config::default()).expect("bring-up");
    Setup { dev, hca, d, rec }
}

/// A PD, a CQ and two RC QPs in RESET on it, as the RC rows start from.
fn rc_qps(s: &mut Setup) -> (Pd, Cq, Qp, Qp) {
    let pd = s.hca.alloc_pd(&mut s.d).unwrap();
    let cq = s.hca.create_cq(CqAttr::default(), &mut s.d).unwrap();
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let init = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: false };
    let a = s.hca.create_qp(&pd, &cq, &cq, init, &mut s.d).unwrap();
    let b = s.hca.create_qp(&pd, &cq, &cq, init, &mut s.d).unwrap();
    (pd, cq, a, b)
}

fn rc_parity(port: PortType) {
    let roce = port == PortType::Eth;
    let mut s = setup(SimConfig { port_type: port, lid: 7, ..SimConfig::default() });
    let (pd, cq, mut a, b) = rc_qps(&mut s);
    let (pdn, cqn, dbr) = (pd.pdn(), cq.cqn(), a.dbrec().iova());
    // The counter set bring-up allocated (mlx5_ib_alloc_counters): ALLOC_Q_COUNTER is in the trace.
    let counter = u64::from(s.hca.q_counter().expect("the simulated device has counter sets"));
    assert!(s.rec.0.borrow().iter().any(|(op, _)| *op == Opcode::AllocQCounter));
    // On RoCE the source is GID entry 1, the RoCE v2 link-local entry (entry 0 is its v1 twin): v2 is what gives
    // the path a UDP source port and a DSCP.
    let sgid_index = if roce { 1 } else { 0 };
    let dgid = s.hca.query_gid(sgid_index.into(), &mut s.d).unwrap();
    let ah = AhAttr {
        dlid: 7,
        sl: 3,
        static_rate: consts::IB_RATE_10_GBPS as u8,
        grh: roce.then_some(Grh { dgid, sgid_index, hop_limit: 64, traffic_class: 0x68, ..Grh::default() }),
        dmac: s.dev.config().mac,
        port_num: 1,
        ..AhAttr::default()
    };
    let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
    let attr = QpAttr {
        qp_access_flags: all,
        path_mtu: Mtu::M1024,
        dest_qp_num: b.qpn(),
        rq_psn: 0x123,
        sq_psn: 0x456,
        max_dest_rd_atomic: 3,
        max_rd_atomic: 3,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 6,
        rnr_retry: 5,
        ah_attr: ah,
        ..QpAttr::default()
    };
    let k = consts::MLX5_QP_OPTPAR_RRE | consts::MLX5_QP_OPTPAR_RWE | consts::MLX5_QP_OPTPAR_RAE;
    let rc = consts::MLX5_QP_ST_RC;

    // RST2INIT.
    let call = "ibv_modify_qp(RC RESET->INIT; PKEY_INDEX|PORT|ACCESS_FLAGS = LW|RR|RW|RA)";
    let m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
    s.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Init, ..attr }, m, &mut s.d).unwrap();
    let mut rows = every_modify(call, rc, pdn, cqn);
    rows.extend([
        row(call, "opt_param_mask", At::Cmd(ifc::rst2init_qp_in::OPT_PARAM_MASK), 0, "opt_mask (no RST2INIT entry)"),
        row(call, "qpc.rre", At::Qpc(ifc::qpc::RRE), 0, "set_qpc_atomic_flags (resp_depth 0: write only)"),
        row(call, "qpc.rwe", At::Qpc(ifc::qpc::RWE), 1, "set_qpc_atomic_flags"),
        row(call, "qpc.rae", At::Qpc(ifc::qpc::RAE), 0, "set_qpc_atomic_flags (resp_depth 0: write only)"),
        row(call, "qpc.dbr_addr", At::Qpc(ifc::qpc::DBR_ADDR), dbr, "__mlx5_ib_modify_qp (RST2INIT with an RQ)"),
        row(call, "qpc.rlky", At::Qpc(ifc::qpc::RLKY), 1, "__mlx5_ib_modify_qp (kernel QP at RST2INIT)"),
        row(call, "ads.vhca_port_num", At::Path(ifc::ads::VHCA_PORT_NUM), 1, "__mlx5_ib_modify_qp (IB_QP_PORT)"),
        row(call, "ads.pkey_index", At::Path(ifc::ads::PKEY_INDEX), 0, "__mlx5_ib_modify_qp (IB_QP_PKEY_INDEX)"),
        row(call, "qpc.counter_set_id", At::Qpc(ifc::qpc::COUNTER_SET_ID), counter, "mlx5_ib_get_counters_id"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rst2initQp, &rows);

    // INIT2RTR.
    let call = "ibv_modify_qp(RC INIT->RTR; AV|PATH_MTU|DEST_QPN|RQ_PSN|MAX_DEST_RD_ATOMIC=3|MIN_RNR_TIMER=12)";
    let m = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER;
    s.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Rtr, ..attr }, m, &mut s.d).unwrap();
    let mut rows = every_modify(call, rc, pdn, cqn);
    rows.extend([
        row(
            call,
            "opt_param_mask",
            At::Cmd(ifc::init2rtr_qp_in::OPT_PARAM_MASK),
            k.into(),
            "ib_mask_to_mlx5_opt & opt_mask",
        ),
        row(call, "qpc.mtu", At::Qpc(ifc::qpc::MTU), consts::IB_MTU_1024.into(), "__mlx5_ib_modify_qp"),
        row(call, "qpc.log_msg_max", At::Qpc(ifc::qpc::LOG_MSG_MAX), 30, "__mlx5_ib_modify_qp (cap log_max_msg)"),
        row(call, "qpc.remote_qpn", At::Qpc(ifc::qpc::REMOTE_QPN), b.qpn().into(), "__mlx5_ib_modify_qp"),
        row(call, "qpc.next_rcv_psn", At::Qpc(ifc::qpc::NEXT_RCV_PSN), 0x123, "__mlx5_ib_modify_qp"),
        row(call, "qpc.log_rra_max", At::Qpc(ifc::qpc::LOG_RRA_MAX), 2, "__mlx5_ib_modify_qp (fls(3 - 1))"),
        row(call, "qpc.min_rnr_nak", At::Qpc(ifc::qpc::MIN_RNR_NAK), 12, "__mlx5_ib_modify_qp"),
        row(call, "qpc.rre", At::Qpc(ifc::qpc::RRE), 1, "set_qpc_atomic_flags (stored access)"),
        row(call, "qpc.rwe", At::Qpc(ifc::qpc::RWE), 1, "set_qpc_atomic_flags (stored access)"),
        row(call, "qpc.rae", At::Qpc(ifc::qpc::RAE), 1, "set_qpc_atomic_flags (stored access)"),
        row(call, "qpc.dbr_addr", At::Qpc(ifc::qpc::DBR_ADDR), 0, "__mlx5_ib_modify_qp (RST2INIT only)"),
        row(call, "ads.stat_rate", At::Path(ifc::ads::STAT_RATE), 8, "mlx5r_ib_rate (10 Gb/s)"),
        row(call, "ads.vhca_port_num", At::Path(ifc::ads::VHCA_PORT_NUM), 1, "mlx5_set_path"),
        row(
            call,
            "qpc.atomic_mode",
            At::Qpc(ifc::qpc::ATOMIC_MODE),
            1,
            "set_qpc_atomic_flags (get_atomic_mode: IB_COMP)",
        ),
    ]);
    if roce {
        let sport = linux_udp_sport(a.qpn(), b.qpn());
        rows.extend([
            row(call, "ads.udp_sport", At::Path(ifc::ads::UDP_SPORT), sport, "mlx5_set_path_udp_sport"),
            row(call, "ads.dscp", At::Path(ifc::ads::DSCP), 0x68 >> 2, "mlx5_set_path (RoCE v2)"),
            row(call, "ads.eth_prio", At::Path(ifc::ads::ETH_PRIO), 3, "mlx5_set_path (sl & 7)"),
            row(call, "ads.tclass", At::Path(ifc::ads::TCLASS), 0x68, "mlx5_set_path"),
            row(call, "ads.hop_limit", At::Path(ifc::ads::HOP_LIMIT), 64, "mlx5_set_path"),
            row(call, "ads.flow_label", At::Path(ifc::ads::FLOW_LABEL), 0, "mlx5_set_path (the caller's label)"),
            row(call, "ads.rlid", At::Path(ifc::ads::RLID), 0, "mlx5_set_path (IB only)"),
            row(call, "ads.grh", At::Path(ifc::ads::GRH), 0, "mlx5_set_path (set on InfiniBand only)"),
        ]);
    } else {
        rows.extend([
            row(call, "ads.rlid", At::Path(ifc::ads::RLID), 7, "mlx5_set_path"),
            row(call, "ads.sl", At::Path(ifc::ads::SL), 3, "mlx5_set_path"),
            row(call, "ads.grh", At::Path(ifc::ads::GRH), 0, "mlx5_set_path"),
            row(call, "ads.udp_sport", At::Path(ifc::ads::UDP_SPORT), 0, "mlx5_set_path (RoCE only)"),
            row(call, "ads.dscp", At::Path(ifc::ads::DSCP), 0, "mlx5_set_path (RoCE v2 only)"),
        ]);
    }
    check(&s.rec.0.borrow(), Opcode::Init2rtrQp, &rows);

    // RTR2RTS.
    let call = "ibv_modify_qp(RC RTR->RTS; TIMEOUT=14|RETRY_CNT=6|RNR_RETRY=5|SQ_PSN|MAX_QP_RD_ATOMIC=3)";
    let m = M::STATE | M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC;
    s.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Rts, ..attr }, m, &mut s.d).unwrap();
    let mut rows = every_modify(call, rc, pdn, cqn);
    rows.extend([
        row(call, "opt_param_mask", At::Cmd(ifc::rtr2rts_qp_in::OPT_PARAM_MASK), 0, "ib_mask_to_mlx5_opt & opt_mask"),
        row(call, "ads.ack_timeout", At::Path(ifc::ads::ACK_TIMEOUT), 14, "__mlx5_ib_modify_qp"),
        row(call, "qpc.retry_count", At::Qpc(ifc::qpc::RETRY_COUNT), 6, "__mlx5_ib_modify_qp"),
        row(call, "qpc.rnr_retry", At::Qpc(ifc::qpc::RNR_RETRY), 5, "__mlx5_ib_modify_qp"),
        row(call, "qpc.next_send_psn", At::Qpc(ifc::qpc::NEXT_SEND_PSN), 0x456, "__mlx5_ib_modify_qp"),
        row(call, "qpc.log_sra_max", At::Qpc(ifc::qpc::LOG_SRA_MAX), 2, "__mlx5_ib_modify_qp (fls(3 - 1))"),
        row(call, "qpc.rre", At::Qpc(ifc::qpc::RRE), 0, "__mlx5_ib_modify_qp (access not in the mask)"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rtr2rtsQp, &rows);

    // RTS2RTS.
    let call = "ibv_modify_qp(RC RTS->RTS; MIN_RNR_TIMER=5|ACCESS_FLAGS = LW|RW)";
    let m = M::STATE | M::MIN_RNR_TIMER | M::ACCESS_FLAGS;
    let w = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let new = QpAttr { qp_state: QpState::Rts, min_rnr_timer: 5, qp_access_flags: w, ..attr };
    s.hca.modify_qp(&mut a, &new, m, &mut s.d).unwrap();
    let mut rows = every_modify(call, rc, pdn, cqn);
    let opt = k | consts::MLX5_QP_OPTPAR_RNR_TIMEOUT;
    rows.extend([
        row(
            call,
            "opt_param_mask",
            At::Cmd(ifc::rts2rts_qp_in::OPT_PARAM_MASK),
            opt.into(),
            "ib_mask_to_mlx5_opt & opt_mask",
        ),
        row(call, "qpc.min_rnr_nak", At::Qpc(ifc::qpc::MIN_RNR_NAK), 5, "__mlx5_ib_modify_qp"),
        row(call, "qpc.rre", At::Qpc(ifc::qpc::RRE), 0, "set_qpc_atomic_flags (stored resp_depth 3)"),
        row(call, "qpc.rwe", At::Qpc(ifc::qpc::RWE), 1, "set_qpc_atomic_flags"),
        row(call, "qpc.rae", At::Qpc(ifc::qpc::RAE), 0, "set_qpc_atomic_flags"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rts2rtsQp, &rows);
}

fn ud_parity(port: PortType) {
    let mut s = setup(SimConfig { port_type: port, lid: 7, ..SimConfig::default() });
    let pd = s.hca.alloc_pd(&mut s.d).unwrap();
    let cq = s.hca.create_cq(CqAttr::default(), &mut s.d).unwrap();
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let init = QpInitAttr { qp_type: QpType::Ud, cap, sq_sig_all: false };
    let mut u = s.hca.create_qp(&pd, &cq, &cq, init, &mut s.d).unwrap();
    let (pdn, cqn, dbr) = (pd.pdn(), cq.cqn(), u.dbrec().iova());
    let attr = QpAttr { qkey: 0x1111_2222, sq_psn: 0x77, ..QpAttr::default() };
    let ud = consts::MLX5_QP_ST_UD;
    let mtu =
        |call| row(call, "qpc.mtu", At::Qpc(ifc::qpc::MTU), consts::IB_MTU_4096.into(), "__mlx5_ib_modify_qp (UD)");
    let msg = |call| row(call, "qpc.log_msg_max", At::Qpc(ifc::qpc::LOG_MSG_MAX), 12, "__mlx5_ib_modify_qp (UD)");

    let call = "ibv_modify_qp(UD RESET->INIT; PKEY_INDEX|PORT|QKEY)";
    let m = M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY;
    s.hca.modify_qp(&mut u, &QpAttr { qp_state: QpState::Init, ..attr }, m, &mut s.d).unwrap();
    let mut rows = every_modify(call, ud, pdn, cqn);
    rows.extend([
        mtu(call),
        msg(call),
        row(call, "opt_param_mask", At::Cmd(ifc::rst2init_qp_in::OPT_PARAM_MASK), 0, "opt_mask (no RST2INIT entry)"),
        row(call, "qpc.q_key", At::Qpc(ifc::qpc::Q_KEY), 0x1111_2222, "__mlx5_ib_modify_qp"),
        row(call, "qpc.dbr_addr", At::Qpc(ifc::qpc::DBR_ADDR), dbr, "__mlx5_ib_modify_qp (RST2INIT with an RQ)"),
        row(call, "qpc.rlky", At::Qpc(ifc::qpc::RLKY), 1, "__mlx5_ib_modify_qp (kernel QP at RST2INIT)"),
        row(call, "ads.vhca_port_num", At::Path(ifc::ads::VHCA_PORT_NUM), 1, "__mlx5_ib_modify_qp (IB_QP_PORT)"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rst2initQp, &rows);

    let call = "ibv_modify_qp(UD INIT->RTR; STATE only)";
    s.hca.modify_qp(&mut u, &QpAttr { qp_state: QpState::Rtr, ..attr }, M::STATE, &mut s.d).unwrap();
    let mut rows = every_modify(call, ud, pdn, cqn);
    rows.extend([
        mtu(call),
        msg(call),
        row(call, "opt_param_mask", At::Cmd(ifc::init2rtr_qp_in::OPT_PARAM_MASK), 0, "ib_mask_to_mlx5_opt & opt_mask"),
        row(call, "qpc.dbr_addr", At::Qpc(ifc::qpc::DBR_ADDR), 0, "__mlx5_ib_modify_qp (RST2INIT only)"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Init2rtrQp, &rows);

    let call = "ibv_modify_qp(UD RTR->RTS; SQ_PSN)";
    s.hca.modify_qp(&mut u, &QpAttr { qp_state: QpState::Rts, ..attr }, M::STATE | M::SQ_PSN, &mut s.d).unwrap();
    let mut rows = every_modify(call, ud, pdn, cqn);
    rows.extend([
        mtu(call),
        msg(call),
        row(call, "opt_param_mask", At::Cmd(ifc::rtr2rts_qp_in::OPT_PARAM_MASK), 0, "ib_mask_to_mlx5_opt & opt_mask"),
        row(call, "qpc.next_send_psn", At::Qpc(ifc::qpc::NEXT_SEND_PSN), 0x77, "__mlx5_ib_modify_qp"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rtr2rtsQp, &rows);
}

/// The hardware GSI QP (`MLX5_IB_QPT_HW_GSI`): created with `qpc.st` QP1; every modify at MTU 256 with 256-byte
/// messages; no optional-parameter bits, even for a Q_Key in INIT->RTR that a UD QP would flag.
fn gsi_parity(port: PortType) {
    let mut s = setup(SimConfig { port_type: port, lid: 7, ..SimConfig::default() });
    let pd = s.hca.alloc_pd(&mut s.d).unwrap();
    let cq = s.hca.create_cq(CqAttr::default(), &mut s.d).unwrap();
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let init = QpInitAttr { qp_type: QpType::Gsi, cap, sq_sig_all: false };
    let mut g = s.hca.create_qp(&pd, &cq, &cq, init, &mut s.d).unwrap();
    let qp1 = consts::MLX5_QP_ST_QP1;
    let call = "ib_create_qp(IB_QPT_GSI) -> mlx5_ib_create_gsi's hardware GSI QP";
    let st = row(call, "qpc.st", At::Qpc(ifc::qpc::ST), qp1.into(), "create_qp_common (to_mlx5_st: HW_GSI -> QP1)");
    check(&s.rec.0.borrow(), Opcode::CreateQp, &[st]);
    let (pdn, cqn) = (pd.pdn(), cq.cqn());
    let attr = QpAttr { qkey: 0x8001_0000, sq_psn: 0, ..QpAttr::default() };
    let mtu =
        |call| row(call, "qpc.mtu", At::Qpc(ifc::qpc::MTU), consts::IB_MTU_256.into(), "__mlx5_ib_modify_qp (GSI)");
    let msg = |call| row(call, "qpc.log_msg_max", At::Qpc(ifc::qpc::LOG_MSG_MAX), 8, "__mlx5_ib_modify_qp (GSI)");

    let call = "modify GSI RESET->INIT; PKEY_INDEX|PORT|QKEY";
    let m = M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY;
    s.hca.modify_qp(&mut g, &QpAttr { qp_state: QpState::Init, ..attr }, m, &mut s.d).unwrap();
    let mut rows = every_modify(call, qp1, pdn, cqn);
    rows.extend([
        mtu(call),
        msg(call),
        row(call, "qpc.q_key", At::Qpc(ifc::qpc::Q_KEY), 0x8001_0000, "__mlx5_ib_modify_qp (IB_QP1_QKEY)"),
        row(call, "ads.vhca_port_num", At::Path(ifc::ads::VHCA_PORT_NUM), 1, "__mlx5_ib_modify_qp (IB_QP_PORT)"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rst2initQp, &rows);

    let call = "modify GSI INIT->RTR; QKEY";
    s.hca.modify_qp(&mut g, &QpAttr { qp_state: QpState::Rtr, ..attr }, M::STATE | M::QKEY, &mut s.d).unwrap();
    let mut rows = every_modify(call, qp1, pdn, cqn);
    rows.extend([
        mtu(call),
        msg(call),
        row(call, "opt_param_mask", At::Cmd(ifc::init2rtr_qp_in::OPT_PARAM_MASK), 0, "opt_mask (no QP1 column)"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Init2rtrQp, &rows);

    let call = "modify GSI RTR->RTS; SQ_PSN";
    s.hca.modify_qp(&mut g, &QpAttr { qp_state: QpState::Rts, ..attr }, M::STATE | M::SQ_PSN, &mut s.d).unwrap();
    let mut rows = every_modify(call, qp1, pdn, cqn);
    rows.extend([
        mtu(call),
        msg(call),
        row(call, "opt_param_mask", At::Cmd(ifc::rtr2rts_qp_in::OPT_PARAM_MASK), 0, "opt_mask (no QP1 column)"),
    ]);
    check(&s.rec.0.borrow(), Opcode::Rtr2rtsQp, &rows);
}

#[test]
fn gsi_modify_commands_match_linux_on_roce() {
    gsi_parity(PortType::Eth);
}

#[test]
fn gsi_modify_commands_match_linux_on_infiniband() {
    gsi_parity(PortType::Ib);
}

#[test]
fn rc_modify_commands_match_linux_on_roce() {
    rc_parity(PortType::Eth);
}

#[test]
fn rc_modify_commands_match_linux_on_infiniband() {
    rc_parity(PortType::Ib);
}

#[test]
fn ud_modify_commands_match_linux_on_roce() {
    ud_parity(PortType::Eth);
}

#[test]
fn ud_modify_commands_match_linux_on_infiniband() {
    ud_parity(PortType::Ib);
}

/// The atomic mode Linux would send for the simulated device (the `atomic_mode` rows' value): compare-and-swap
/// and fetch-and-add without the extended operations, still reported after bring-up's atomic SET_HCA_CAP.
#[test]
fn the_simulated_device_has_linux_ib_compatible_atomic_mode() {
    let s = setup(SimConfig::default());
    let c = s.hca.caps();
    let ops = consts::MLX5_ATOMIC_OPS_CMP_SWAP | consts::MLX5_ATOMIC_OPS_FETCH_ADD;
    assert_eq!(c.atomic_operations, Some(ops as u16));
    assert_eq!(c.atomic_mode(), Some(consts::MLX5_ATOMIC_MODE_IB_COMP as u8));
}

/// A RoCE v1 source GID (entry 0) gives the path neither a UDP source port nor a DSCP: `mlx5_set_path` sets both
/// only for a RoCE v2 (`IB_GID_TYPE_ROCE_UDP_ENCAP`) GID, whose type the driver remembers from programming the table.
#[test]
fn a_roce_v1_source_gid_has_no_udp_source_port() {
    let mut s = setup(SimConfig { port_type: PortType::Eth, ..SimConfig::default() });
    let (_pd, _cq, mut a, b) = rc_qps(&mut s);
    let dgid = s.hca.query_gid(0, &mut s.d).unwrap();
    let ah = AhAttr {
        grh: Some(Grh { dgid, sgid_index: 0, hop_limit: 64, traffic_class: 0x68, ..Grh::default() }),
        dmac: s.dev.config().mac,
        port_num: 1,
        ..AhAttr::default()
    };
    let attr = QpAttr {
        qp_access_flags: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        path_mtu: Mtu::M1024,
        dest_qp_num: b.qpn(),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ah_attr: ah,
        ..QpAttr::default()
    };
    let m = M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS;
    s.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Init, ..attr }, m, &mut s.d).unwrap();
    let m = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER;
    s.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Rtr, ..attr }, m, &mut s.d).unwrap();
    let call = "ibv_modify_qp(RC INIT->RTR over RoCE v1 GID 0)";
    check(
        &s.rec.0.borrow(),
        Opcode::Init2rtrQp,
        &[
            row(call, "ads.src_addr_index", At::Path(ifc::ads::SRC_ADDR_INDEX), 0, "mlx5_set_path"),
            row(call, "ads.udp_sport", At::Path(ifc::ads::UDP_SPORT), 0, "mlx5_set_path (RoCE v2 only)"),
            row(call, "ads.dscp", At::Path(ifc::ads::DSCP), 0, "mlx5_set_path (RoCE v2 only)"),
            row(call, "ads.tclass", At::Path(ifc::ads::TCLASS), 0x68, "mlx5_set_path"),
        ],
    );
}

/// CREATE_QP of an RC and a UD QP against `create_kernel_qp` / `_create_kernel_qp` (the driver owns its queues as
/// a kernel consumer does).
#[test]
fn create_qp_matches_linux() {
    let mut s = setup(SimConfig::default());
    let (pd, cq, a, _b) = rc_qps(&mut s);
    let caps = s.hca.caps().general;
    assert_eq!(caps.cqe_version, 1, "the simulated device reports CQE version 1, as CX-4 and later do");
    let create = |call: &'static str, st: u32, dbr: u64| {
        let mut rows = vec![
            row(call, "qpc.st", At::Qpc(ifc::qpc::ST), st.into(), "create_kernel_qp (to_mlx5_st)"),
            row(call, "qpc.pm_state", At::Qpc(ifc::qpc::PM_STATE), 3, "create_kernel_qp (MLX5_QP_PM_MIGRATED)"),
            row(call, "qpc.pd", At::Qpc(ifc::qpc::PD), pd.pdn().into(), "create_kernel_qp"),
            row(call, "qpc.cqn_snd", At::Qpc(ifc::qpc::CQN_SND), cq.cqn().into(), "create_kernel_qp"),
            row(call, "qpc.cqn_rcv", At::Qpc(ifc::qpc::CQN_RCV), cq.cqn().into(), "create_kernel_qp"),
            row(call, "qpc.dbr_addr", At::Qpc(ifc::qpc::DBR_ADDR), dbr, "create_kernel_qp"),
            row(call, "qpc.rq_type", At::Qpc(ifc::qpc::RQ_TYPE), 0, "get_rx_type (MLX5_NON_ZERO_RQ: the QP has an RQ)"),
            row(call, "qpc.ts_format", At::Qpc(ifc::qpc::TS_FORMAT), 0, "mlx5_get_qp_default_ts (no RT capability)"),
            row(call, "qpc.fre", At::Qpc(ifc::qpc::FRE), 1, "_create_kernel_qp (every kernel QP)"),
            row(call, "qpc.rlky", At::Qpc(ifc::qpc::RLKY), 1, "_create_kernel_qp"),
            row(call, "qpc.user_index", At::Qpc(ifc::qpc::USER_INDEX), 0xff_ffff, "create_kernel_qp (cqe_version 1)"),
        ];
        for (field, f) in [("qpc.xrcd", ifc::qpc::XRCD), ("qpc.srqn_rmpn_xrqn", ifc::qpc::SRQN_RMPN_XRQN)] {
            rows.push(Row {
                call,
                field,
                at: At::Qpc(f),
                expect: Expect::Differs {
                    ours: 0,
                    linux: "the device resources' xrcdn1 and dummy SRQ s1 (created on the first QP)",
                    why: "firmware ignores them for a QP with its own RQ; mlx5_core's own kernel QPs \
                          (dr_send.c, fpga/conn.c, vfio/pci/mlx5/cmd.c) leave them 0 too",
                },
                kernel: "create_kernel_qp",
            });
        }
        rows
    };
    let cmds = s.rec.0.borrow().clone();
    let rc_rows = create("ibv_create_qp(RC, 8/8 WRs, 1/1 SGE)", consts::MLX5_QP_ST_RC, a.dbrec().iova());
    // The first CREATE_QP is `a`'s.
    let first = cmds.iter().position(|(op, _)| *op == Opcode::CreateQp).unwrap();
    check(&cmds[..=first], Opcode::CreateQp, &rc_rows);
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let init = QpInitAttr { qp_type: QpType::Ud, cap, sq_sig_all: false };
    let ud = s.hca.create_qp(&pd, &cq, &cq, init, &mut s.d).unwrap();
    let ud_rows = create("ibv_create_qp(UD, 4/4 WRs, 1/1 SGE)", consts::MLX5_QP_ST_UD, ud.dbrec().iova());
    check(&s.rec.0.borrow(), Opcode::CreateQp, &ud_rows);
}

/// `mlx5_ib_modify_qp` sends nothing for RESET to RESET, and refuses a RoCE address without a GRH before any
/// command (`mlx5_set_path`).
#[test]
fn reset_to_reset_sends_nothing_and_roce_paths_need_a_grh() {
    let mut s = setup(SimConfig::default());
    let (_pd, _cq, mut a, b) = rc_qps(&mut s);
    let before = s.rec.0.borrow().len();
    s.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Reset, ..QpAttr::default() }, M::STATE, &mut s.d).unwrap();
    assert_eq!(s.rec.0.borrow().len(), before, "no 2RST_QP for a QP already in RESET");
    let init = QpAttr { qp_state: QpState::Init, port_num: 1, ..QpAttr::default() };
    s.hca.modify_qp(&mut a, &init, M::STATE | M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS, &mut s.d).unwrap();
    let rtr = QpAttr { qp_state: QpState::Rtr, path_mtu: Mtu::M1024, dest_qp_num: b.qpn(), ..QpAttr::default() };
    let m = M::STATE | M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN | M::MAX_DEST_RD_ATOMIC | M::MIN_RNR_TIMER;
    let sent = s.rec.0.borrow().len();
    assert!(s.hca.modify_qp(&mut a, &rtr, m, &mut s.d).is_err());
    assert_eq!(s.rec.0.borrow().len(), sent, "refused before INIT2RTR_QP is sent");
}

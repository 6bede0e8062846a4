//! The firmware: [`Firmware`] (the HCA state machine, ISSI, capabilities, and one table per object type), the
//! dispatch of a delivered command to its handler, and the `syndrome` of every refusal. Delivery is `device/cmd.rs`,
//! pages `pages.rs`; each object type is a table in its own file (`pd.rs`: PD and UAR, `eq.rs`, `cq.rs`,
//! `mkey.rs`, `qp.rs`, `srq.rs`; the Ethernet objects `tis.rs`, `tir.rs`, `rqt.rs`, `rq.rs`, `sq.rs` over `wq.rs`, and
//! NIC receive steering `flow_table.rs`) whose commands get a narrow view of the rest of the firmware (`CqFw`, `QpFw`, ...: the
//! capabilities and the other tables they check), built here per command; `port.rs` is the port model and
//! `reply.rs` builds results. This is the firmware side of the kernel's `cmd.c` / `main.c`.
//!
//! Delivery failures are reported in `status_own >> 1` (`MLX5_CMD_DELIVERY_STAT_*`); a delivered command reports
//! its result in `mbox_out.status` / `mbox_out.syndrome`. Status choices:
//! * unknown opcode: `BAD_OP`; input shorter than the command's layout (plus declared `pas[]` entries):
//!   `BAD_INP_LEN`; output shorter than needed: `BAD_OUTP_LEN`;
//! * a command not allowed in the current HCA state: `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`;
//! * an invalid value, including an unknown handle on destroy/dealloc: `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`;
//! * a limit reached (`log_max_*`, UAR pages): `NO_RES`;
//! * destroying an object another one still uses: `BAD_RES_STATE`.
//!
//! Each failure carries a distinct syndrome from [`syndrome`].

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use crate::config::SimConfig;
use crate::dma::DmaSpace;
use crate::events::SimEvent;
use crate::regs::INIT_SEG_PAGES;

mod adapter;
pub(crate) mod caps;
pub(crate) mod cq;
pub(crate) mod eq;
pub(crate) mod hca;
pub(crate) mod health;
mod ib_vport;
pub(crate) mod ids;
pub(crate) mod mad_ifc;
pub(crate) mod mcg;
pub(crate) mod memic;
pub(crate) mod mkey;
mod nic_vport;
pub(crate) mod packet_pacing;
mod pages;
pub(crate) mod pas;
mod pd;
pub(crate) mod port;
pub(crate) mod qcounter;
pub(crate) mod qp;
pub(crate) mod reply;
pub(crate) mod srq;
pub mod syndrome;
mod td;
pub(crate) mod uctx;
pub(crate) mod umem;
mod xrcd;
// The Ethernet (NIC) objects mlx5e drives (issue 35).
pub(crate) mod flow_table;
pub(crate) mod rq;
pub(crate) mod rqt;
pub(crate) mod sq;
pub(crate) mod tir;
pub(crate) mod tis;
pub(crate) mod wq;

pub use hca::HcaState;

use caps::{Caps, SetCapError};
use cq::{CqFw, CqTable};
use eq::{EqFw, EqTable};
use mcg::{McgFw, McgTable};
use memic::MemicTable;
use mkey::{MkeyFw, MkeyTable};
use pages::Pages;
use pd::{PdTable, UarTable};
use port::PortModel;
use qcounter::QCounterTable;
use qp::{QpFw, QpTable};
use reply::{bad_param, err, rd, rd16, CmdErr};
use srq::{Family, SrqFw, SrqTable};
use td::TdTable;
use uctx::UctxTable;
use umem::UmemTable;
use xrcd::XrcdTable;
// The Ethernet objects.
use flow_table::{FlowFw, FlowTables};
use rq::{RqFw, RqTable};
use rqt::{RqtFw, RqtTable};
use sq::{SqFw, SqTable};
use tir::{TirFw, TirTable};
use tis::TisTable;

/// Which HCA states a command is accepted in.
#[derive(Debug, Clone, Copy)]
enum Gate {
    /// Any state (QUERY_ISSI).
    Any,
    /// Disabled only (ENABLE_HCA).
    Disabled,
    /// Enabled, before INIT_HCA (SET_ISSI, SET_HCA_CAP, INIT_HCA, DISABLE_HCA).
    PreInit,
    /// Enabled or initialized (QUERY_PAGES, MANAGE_PAGES, QUERY_HCA_CAP).
    Enabled,
    /// Initialized (objects, TEARDOWN_HCA).
    Initialized,
}

/// Firmware state: the HCA state machine, owned pages, capabilities and objects.
#[derive(Debug)]
pub(crate) struct Firmware {
    pub(crate) state: HcaState,
    issi: u16,
    pub(crate) pages: Pages,
    /// A page request is waiting for an EQ subscribed to page requests.
    pub(crate) page_request_held: bool,
    pub(crate) caps: Caps,
    pub(crate) port: PortModel,
    pub(crate) pds: PdTable,
    pub(crate) xrcds: XrcdTable,
    pub(crate) tds: TdTable,
    pub(crate) uars: UarTable,
    pub(crate) eqs: EqTable,
    pub(crate) cqs: CqTable,
    pub(crate) mkeys: MkeyTable,
    pub(crate) qps: QpTable,
    pub(crate) q_counters: QCounterTable,
    pub(crate) srqs: SrqTable,
    pub(crate) mcgs: McgTable,
    /// DevX user contexts and the `uid` that owns each object.
    pub(crate) uctxs: UctxTable,
    /// DevX user memories and the queues on them.
    pub(crate) umems: UmemTable,
    pub(crate) memics: MemicTable,
    /// Packet pacing's rate limit table.
    pub(crate) pps: packet_pacing::PpTable,
    // The Ethernet objects.
    pub(crate) tises: TisTable,
    pub(crate) tirs: TirTable,
    pub(crate) rqts: RqtTable,
    pub(crate) rqs: RqTable,
    pub(crate) sqs: SqTable,
    pub(crate) flows: FlowTables,
}

/// The narrow view of the firmware an EQ command gets (see [`EqFw`]).
macro_rules! eq_fw {
    ($fw:ident) => {
        EqFw { caps: &$fw.caps, uars: &$fw.uars, in_use: &|eqn| $fw.cqs.values().any(|c| c.eqn == eqn) }
    };
}

/// The narrow view of the firmware a QP command gets (see [`QpFw`]).
macro_rules! qp_fw {
    ($fw:ident) => {
        QpFw {
            caps: &$fw.caps,
            port_type: $fw.port.port_type,
            pds: &$fw.pds,
            uars: &$fw.uars,
            cq_exists: &|cqn| $fw.cqs.contains_key(&cqn),
            roce_gid_set: &|index| $fw.port.roce_gid_set(index),
            q_counter_valid: &|id| $fw.q_counters.valid(id),
            srq_exists: &|srqn| $fw.srqs.get(&srqn).is_some(),
            xrcd_exists: &|x| $fw.xrcds.contains(x),
            umems: &$fw.umems,
        }
    };
}

/// The narrow view of the firmware an MCG command gets (see [`McgFw`]).
macro_rules! mcg_fw {
    ($fw:ident) => {
        McgFw { caps: &$fw.caps, qp_type: &|qpn| $fw.qps.get(&qpn).map(|q| q.st) }
    };
}

/// The narrow view of the firmware an SRQ command gets (see [`SrqFw`]).
macro_rules! srq_fw {
    ($fw:ident) => {
        SrqFw {
            caps: &$fw.caps,
            pds: &$fw.pds,
            issi: $fw.issi,
            in_use: &|srqn| $fw.qps.values().any(|q| q.srqn == Some(srqn)),
            xrcd_exists: &|x| $fw.xrcds.contains(x),
            cq_exists: &|cqn| $fw.cqs.contains_key(&cqn),
        }
    };
}

/// The narrow view of the firmware a CQ command gets (see [`CqFw`]), borrowed from the tables it does not change.
macro_rules! cq_fw {
    ($fw:ident) => {
        CqFw {
            caps: &$fw.caps,
            uars: &$fw.uars,
            eq_exists: &|eqn| $fw.eqs.contains_key(&eqn),
            in_use: &|cqn| {
                let eth = $fw.rqs.map.values().any(|r| r.cqn == cqn) || $fw.sqs.map.values().any(|s| s.cqn == cqn);
                eth || $fw.qps.values().any(|q| q.cqn_snd == cqn || q.cqn_rcv == cqn)
            },
        }
    };
}

/// The narrow view of the firmware an RQ command gets (see [`RqFw`]).
macro_rules! rq_fw {
    ($fw:ident) => {
        RqFw {
            caps: &$fw.caps,
            cq_exists: &|cqn| $fw.cqs.contains_key(&cqn),
            pd_exists: &|pd| $fw.pds.contains(pd),
            umems: &$fw.umems,
            in_use: &|rqn| $fw.tirs.uses_rq(rqn) || $fw.rqts.uses_rq(rqn),
        }
    };
}

/// The narrow view of the firmware a TIR command gets (see [`TirFw`]).
macro_rules! tir_fw {
    ($fw:ident) => {
        TirFw {
            caps: &$fw.caps,
            td_exists: &|td| $fw.tds.contains(td),
            rq_exists: &|rqn| $fw.rqs.map.contains_key(&rqn),
            rqt_exists: &|rqtn| $fw.rqts.map.contains_key(&rqtn),
            in_use: &|tirn| $fw.flows.forwards_to_tir(tirn),
        }
    };
}

/// The narrow view of the firmware an RQT command gets (see [`RqtFw`]).
macro_rules! rqt_fw {
    ($fw:ident) => {
        RqtFw {
            caps: &$fw.caps,
            rq_exists: &|rqn| $fw.rqs.map.contains_key(&rqn),
            in_use: &|rqtn| $fw.tirs.uses_rqt(rqtn),
        }
    };
}

impl Firmware {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        Self {
            state: HcaState::Disabled,
            issi: 0,
            pages: Pages::new(cfg),
            page_request_held: false,
            caps: Caps::new(cfg),
            port: PortModel::new(cfg),
            pds: PdTable::new(),
            xrcds: XrcdTable::new(),
            tds: TdTable::new(),
            uars: UarTable::new(INIT_SEG_PAGES as u32, cfg.num_uars),
            eqs: EqTable::new(),
            cqs: CqTable::new(),
            mkeys: MkeyTable::new(),
            qps: QpTable::new(),
            q_counters: QCounterTable::new(),
            srqs: SrqTable::new(),
            mcgs: McgTable::new(),
            uctxs: UctxTable::new(),
            umems: UmemTable::new(),
            memics: MemicTable::new(caps::memic_bar_start(cfg), cfg.memic_size.into()),
            pps: packet_pacing::PpTable::new(),
            tises: TisTable::new(),
            tirs: TirTable::new(),
            rqts: RqtTable::new(),
            rqs: RqTable::new(),
            sqs: SqTable::new(),
            flows: FlowTables::new(),
        }
    }

    pub(crate) fn object_counts(&self) -> (usize, usize, usize, usize) {
        (self.pds.len(), self.uars.len(), self.eqs.len(), self.cqs.len())
    }

    pub(crate) fn mkey_count(&self) -> usize {
        self.mkeys.len()
    }

    /// Whether the firmware implements `opcode` (capability audits in tests).
    #[cfg(test)]
    pub(crate) fn implements(opcode: u16) -> bool {
        Self::spec(opcode).is_some()
    }

    /// Input size, output size and accepted states of an opcode; `None` when not implemented.
    fn spec(opcode: u16) -> Option<(usize, usize, Gate)> {
        use ifc::*;
        Some(match opcode {
            consts::MLX5_CMD_OP_ENABLE_HCA => (enable_hca_in::SIZE_BYTES, enable_hca_out::SIZE_BYTES, Gate::Disabled),
            consts::MLX5_CMD_OP_DISABLE_HCA => (disable_hca_in::SIZE_BYTES, disable_hca_out::SIZE_BYTES, Gate::PreInit),
            consts::MLX5_CMD_OP_QUERY_ISSI => (query_issi_in::SIZE_BYTES, query_issi_out::SIZE_BYTES, Gate::Any),
            consts::MLX5_CMD_OP_QUERY_ADAPTER => {
                (query_adapter_in::SIZE_BYTES, query_adapter_out::SIZE_BYTES, Gate::Enabled)
            }
            consts::MLX5_CMD_OP_SET_ISSI => (set_issi_in::SIZE_BYTES, set_issi_out::SIZE_BYTES, Gate::PreInit),
            consts::MLX5_CMD_OP_QUERY_PAGES => (query_pages_in::SIZE_BYTES, query_pages_out::SIZE_BYTES, Gate::Enabled),
            consts::MLX5_CMD_OP_MANAGE_PAGES => {
                (manage_pages_in::SIZE_BYTES, manage_pages_out::SIZE_BYTES, Gate::Enabled)
            }
            consts::MLX5_CMD_OP_QUERY_HCA_CAP => {
                (query_hca_cap_in::SIZE_BYTES, query_hca_cap_out::SIZE_BYTES, Gate::Enabled)
            }
            consts::MLX5_CMD_OP_SET_HCA_CAP => (set_hca_cap_in::SIZE_BYTES, set_hca_cap_out::SIZE_BYTES, Gate::PreInit),
            consts::MLX5_CMD_OP_INIT_HCA => (init_hca_in::SIZE_BYTES, init_hca_out::SIZE_BYTES, Gate::PreInit),
            consts::MLX5_CMD_OP_TEARDOWN_HCA => {
                (teardown_hca_in::SIZE_BYTES, teardown_hca_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ALLOC_PD => (alloc_pd_in::SIZE_BYTES, alloc_pd_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DEALLOC_PD => {
                (dealloc_pd_in::SIZE_BYTES, dealloc_pd_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ALLOC_UAR => (alloc_uar_in::SIZE_BYTES, alloc_uar_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_ALLOC_XRCD => {
                (alloc_xrcd_in::SIZE_BYTES, alloc_xrcd_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DEALLOC_XRCD => {
                (dealloc_xrcd_in::SIZE_BYTES, dealloc_xrcd_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN => {
                (alloc_transport_domain_in::SIZE_BYTES, alloc_transport_domain_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DEALLOC_TRANSPORT_DOMAIN => {
                (dealloc_transport_domain_in::SIZE_BYTES, dealloc_transport_domain_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DEALLOC_UAR => {
                (dealloc_uar_in::SIZE_BYTES, dealloc_uar_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_EQ => (create_eq_in::SIZE_BYTES, create_eq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_EQ => {
                (destroy_eq_in::SIZE_BYTES, destroy_eq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_CQ => (create_cq_in::SIZE_BYTES, create_cq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_CQ => {
                (destroy_cq_in::SIZE_BYTES, destroy_cq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_CQ => (query_cq_in::SIZE_BYTES, query_cq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_MODIFY_CQ => (modify_cq_in::SIZE_BYTES, modify_cq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_CREATE_MKEY => {
                (create_mkey_in::SIZE_BYTES, create_mkey_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_MKEY => {
                (destroy_mkey_in::SIZE_BYTES, destroy_mkey_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ACCESS_REG => {
                (access_register_in::SIZE_BYTES, access_register_out::SIZE_BYTES, Gate::Enabled)
            }
            consts::MLX5_CMD_OP_SET_DRIVER_VERSION => {
                (set_driver_version_in::SIZE_BYTES, set_driver_version_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_VPORT_STATE => {
                (query_vport_state_in::SIZE_BYTES, query_vport_state_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_SET_ROCE_ADDRESS => {
                (set_roce_address_in::SIZE_BYTES, set_roce_address_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_ROCE_ADDRESS => {
                (query_roce_address_in::SIZE_BYTES, query_roce_address_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT => {
                (query_nic_vport_context_in::SIZE_BYTES, query_nic_vport_context_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_VPORT_COUNTER => {
                (query_vport_counter_in::SIZE_BYTES, query_vport_counter_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_MODIFY_NIC_VPORT_CONTEXT => {
                (modify_nic_vport_context_in::SIZE_BYTES, modify_nic_vport_context_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_GID => {
                (query_hca_vport_gid_in::SIZE_BYTES, query_hca_vport_gid_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_PKEY => {
                (query_hca_vport_pkey_in::SIZE_BYTES, query_hca_vport_pkey_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT => {
                (query_hca_vport_context_in::SIZE_BYTES, query_hca_vport_context_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_MAD_IFC => (mad_ifc_in::SIZE_BYTES, mad_ifc_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_MODIFY_HCA_VPORT_CONTEXT => {
                (modify_hca_vport_context_in::SIZE_BYTES, modify_hca_vport_context_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_QP => (create_qp_in::SIZE_BYTES, create_qp_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_QP => {
                (destroy_qp_in::SIZE_BYTES, destroy_qp_out::SIZE_BYTES, Gate::Initialized)
            }
            // The context is all QUERY_QP returns (no `pas[]`), so an output that ends with it is enough.
            consts::MLX5_CMD_OP_QUERY_QP => {
                (query_qp_in::SIZE_BYTES, query_qp_out::QP_PAS_OR_QPC_EXT_AND_PAS.off, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_RST2INIT_QP => {
                (rst2init_qp_in::SIZE_BYTES, rst2init_qp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_INIT2INIT_QP => {
                (init2init_qp_in::SIZE_BYTES, init2init_qp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_INIT2RTR_QP => {
                (init2rtr_qp_in::SIZE_BYTES, init2rtr_qp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_RTR2RTS_QP => {
                (rtr2rts_qp_in::SIZE_BYTES, rtr2rts_qp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_RTS2RTS_QP => {
                (rts2rts_qp_in::SIZE_BYTES, rts2rts_qp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ALLOC_Q_COUNTER => {
                (alloc_q_counter_in::SIZE_BYTES, alloc_q_counter_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DEALLOC_Q_COUNTER => {
                (dealloc_q_counter_in::SIZE_BYTES, dealloc_q_counter_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_Q_COUNTER => {
                (query_q_counter_in::SIZE_BYTES, query_q_counter_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ATTACH_TO_MCG => {
                (attach_to_mcg_in::SIZE_BYTES, attach_to_mcg_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DETACH_FROM_MCG => {
                (detach_from_mcg_in::SIZE_BYTES, detach_from_mcg_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_2ERR_QP => (qp_2err_in::SIZE_BYTES, qp_2err_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_2RST_QP => (qp_2rst_in::SIZE_BYTES, qp_2rst_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_CREATE_RMP => {
                (create_rmp_in::SIZE_BYTES, create_rmp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_MODIFY_RMP => {
                (modify_rmp_in::SIZE_BYTES, modify_rmp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_QUERY_RMP => (query_rmp_in::SIZE_BYTES, query_rmp_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_RMP => {
                (destroy_rmp_in::SIZE_BYTES, destroy_rmp_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_SRQ => {
                (create_srq_in::SIZE_BYTES, create_srq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_XRC_SRQ => {
                (create_xrc_srq_in::SIZE_BYTES, create_xrc_srq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_XRC_SRQ => {
                (destroy_xrc_srq_in::SIZE_BYTES, destroy_xrc_srq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ARM_RQ => (arm_rq_in::SIZE_BYTES, arm_rq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_QUERY_SRQ => (query_srq_in::SIZE_BYTES, query_srq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_SRQ => {
                (destroy_srq_in::SIZE_BYTES, destroy_srq_out::SIZE_BYTES, Gate::Initialized)
            }
            // The Ethernet objects.
            consts::MLX5_CMD_OP_CREATE_TIS => {
                (create_tis_in::SIZE_BYTES, create_tis_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_TIS => {
                (destroy_tis_in::SIZE_BYTES, destroy_tis_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_TIR => {
                (create_tir_in::SIZE_BYTES, create_tir_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_MODIFY_TIR => {
                (modify_tir_in::SIZE_BYTES, modify_tir_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_TIR => {
                (destroy_tir_in::SIZE_BYTES, destroy_tir_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_RQT => {
                (create_rqt_in::SIZE_BYTES, create_rqt_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_MODIFY_RQT => {
                (modify_rqt_in::SIZE_BYTES, modify_rqt_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_RQT => {
                (destroy_rqt_in::SIZE_BYTES, destroy_rqt_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_RQ => (create_rq_in::SIZE_BYTES, create_rq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_MODIFY_RQ => (modify_rq_in::SIZE_BYTES, modify_rq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_QUERY_RQ => (query_rq_in::SIZE_BYTES, query_rq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_RQ => {
                (destroy_rq_in::SIZE_BYTES, destroy_rq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_SQ => (create_sq_in::SIZE_BYTES, create_sq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_MODIFY_SQ => (modify_sq_in::SIZE_BYTES, modify_sq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_QUERY_SQ => (query_sq_in::SIZE_BYTES, query_sq_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_DESTROY_SQ => {
                (destroy_sq_in::SIZE_BYTES, destroy_sq_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_FLOW_TABLE => {
                (create_flow_table_in::SIZE_BYTES, create_flow_table_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_MODIFY_FLOW_TABLE => {
                (modify_flow_table_in::SIZE_BYTES, modify_flow_table_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_FLOW_TABLE => {
                (destroy_flow_table_in::SIZE_BYTES, destroy_flow_table_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_SET_FLOW_TABLE_ROOT => {
                (set_flow_table_root_in::SIZE_BYTES, set_flow_table_root_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_FLOW_GROUP => {
                (create_flow_group_in::SIZE_BYTES, create_flow_group_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_FLOW_GROUP => {
                (destroy_flow_group_in::SIZE_BYTES, destroy_flow_group_out::SIZE_BYTES, Gate::Initialized)
            }
            // The destination list is the input's flexible tail: set_fte checks it against its declared size.
            consts::MLX5_CMD_OP_SET_FLOW_TABLE_ENTRY => (
                ifc::flow_context::DESTINATION.at(set_fte_in::FLOW_CONTEXT).byte_off(),
                set_fte_out::SIZE_BYTES,
                Gate::Initialized,
            ),
            consts::MLX5_CMD_OP_DELETE_FLOW_TABLE_ENTRY => {
                (delete_fte_in::SIZE_BYTES, delete_fte_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_CREATE_UCTX => {
                (create_uctx_in::SIZE_BYTES, create_uctx_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_UCTX => {
                (destroy_uctx_in::SIZE_BYTES, destroy_uctx_out::SIZE_BYTES, Gate::Initialized)
            }
            // The MTT list is the input's flexible tail: create checks it against `num_of_mtt`.
            consts::MLX5_CMD_OP_CREATE_UMEM => {
                (create_umem_in::SIZE_BYTES, create_umem_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DESTROY_UMEM => {
                (destroy_umem_in::SIZE_BYTES, destroy_umem_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_ALLOC_MEMIC => {
                (alloc_memic_in::SIZE_BYTES, alloc_memic_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_DEALLOC_MEMIC => {
                (dealloc_memic_in::SIZE_BYTES, dealloc_memic_out::SIZE_BYTES, Gate::Initialized)
            }
            consts::MLX5_CMD_OP_SET_PP_RATE_LIMIT => {
                (set_pp_rate_limit_in::SIZE_BYTES, set_pp_rate_limit_out::SIZE_BYTES, Gate::Initialized)
            }
            _ => return None,
        })
    }

    fn check_gate(&self, gate: Gate) -> Result<(), CmdErr> {
        use HcaState::*;
        let state_err = |s| Err(err(CmdStatus::BadSysState, s));
        match (gate, self.state) {
            (Gate::Any, _)
            | (Gate::Disabled, Disabled)
            | (Gate::PreInit, Enabled)
            | (Gate::Enabled, Enabled | Initialized)
            | (Gate::Initialized, Initialized) => Ok(()),
            (Gate::Disabled, _) => state_err(syndrome::ALREADY_ENABLED),
            (_, Disabled) => state_err(syndrome::NOT_ENABLED),
            (Gate::PreInit, Initialized) => state_err(syndrome::ALREADY_INITIALIZED),
            (Gate::Initialized, Enabled) => state_err(syndrome::NOT_INITIALIZED),
        }
    }

    /// Executes one delivered command. `inp` is the whole input; `out` is zeroed and at least `outlen` (and 16)
    /// bytes; on error the caller zeroes it again and writes status and syndrome.
    pub(crate) fn execute(
        &mut self,
        dma: &mut DmaSpace,
        events: &mut Vec<SimEvent>,
        inp: &[u8],
        out: &mut [u8],
        outlen: usize,
    ) -> Result<(), CmdErr> {
        let opcode = rd16(inp, ifc::mbox_in::OPCODE);
        let Some((in_size, out_size, gate)) = Self::spec(opcode) else {
            return Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE));
        };
        if inp.len() < in_size {
            return Err(err(CmdStatus::BadInpLen, syndrome::BAD_INPUT_LEN));
        }
        if outlen < out_size {
            return Err(err(CmdStatus::BadOutpLen, syndrome::BAD_OUTPUT_LEN));
        }
        // The DISABLE_HCA / SET_ISSI "pre-init" gate differs only in which state error it reports.
        if opcode == consts::MLX5_CMD_OP_DISABLE_HCA && self.state == HcaState::Initialized {
            return Err(err(CmdStatus::BadSysState, syndrome::STILL_INITIALIZED));
        }
        self.check_gate(gate)?;
        // DevX: the header's uid must be a live user context, and a context touches only what it created.
        let uid = rd16(inp, ifc::mbox_in::UID);
        let owned = uctx::role(opcode);
        if opcode != consts::MLX5_CMD_OP_DESTROY_UCTX {
            self.uctxs.check_uid(uid)?;
        }
        if let Some((kind, role)) = owned {
            self.uctxs.check_access(uid, kind, role, inp)?;
        }
        self.dispatch(opcode, dma, events, inp, out, outlen)?;
        if let Some((kind, role)) = owned {
            self.uctxs.record(uid, kind, role, inp, out);
            self.umems.record(opcode, kind, role, inp, out);
        }
        Ok(())
    }

    fn dispatch(
        &mut self,
        opcode: u16,
        dma: &mut DmaSpace,
        events: &mut Vec<SimEvent>,
        inp: &[u8],
        out: &mut [u8],
        outlen: usize,
    ) -> Result<(), CmdErr> {
        match opcode {
            consts::MLX5_CMD_OP_ENABLE_HCA => self.enable_hca(inp),
            consts::MLX5_CMD_OP_DISABLE_HCA => self.disable_hca(inp, events),
            consts::MLX5_CMD_OP_QUERY_ISSI => self.query_issi(out),
            consts::MLX5_CMD_OP_QUERY_ADAPTER => adapter::query_adapter(out),
            consts::MLX5_CMD_OP_SET_ISSI => self.set_issi(inp),
            consts::MLX5_CMD_OP_QUERY_PAGES => self.pages.query_pages(inp, out),
            consts::MLX5_CMD_OP_MANAGE_PAGES => self.pages.manage_pages(self.state, dma, inp, out, outlen),
            consts::MLX5_CMD_OP_QUERY_HCA_CAP => self.query_hca_cap(inp, out),
            consts::MLX5_CMD_OP_SET_HCA_CAP => self.set_hca_cap(inp),
            consts::MLX5_CMD_OP_INIT_HCA => self.init_hca(),
            consts::MLX5_CMD_OP_TEARDOWN_HCA => self.teardown_hca(inp, out, events),
            consts::MLX5_CMD_OP_ALLOC_PD => self.pds.alloc(&self.caps, out),
            consts::MLX5_CMD_OP_DEALLOC_PD => {
                let (mkeys, qps) = (&self.mkeys, &self.qps);
                let srqs = &self.srqs;
                let in_use = |pd| {
                    let srq_uses = srqs.map.values().any(|s| s.pd == pd);
                    srq_uses || mkeys.values().any(|m| m.pd == pd) || qps.values().any(|q| q.pd == pd)
                };
                self.pds.dealloc(&in_use, inp)
            }
            consts::MLX5_CMD_OP_ALLOC_UAR => self.uars.alloc(out),
            consts::MLX5_CMD_OP_ALLOC_XRCD => self.xrcds.alloc(&self.caps, out),
            consts::MLX5_CMD_OP_DEALLOC_XRCD => self.xrcds.dealloc(inp),
            consts::MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN => self.tds.alloc(&self.caps, out),
            consts::MLX5_CMD_OP_DEALLOC_TRANSPORT_DOMAIN => {
                let (tises, tirs) = (&self.tises, &self.tirs);
                let in_use = |td| tises.map.values().any(|t| t.td == td) || tirs.map.values().any(|t| t.td == td);
                self.tds.dealloc(&in_use, inp)
            }
            consts::MLX5_CMD_OP_DEALLOC_UAR => {
                let (qps, eqs, cqs) = (&self.qps, &self.eqs, &self.cqs);
                let in_use = |uar| {
                    let qp_uses = qps.values().any(|q| q.uar == uar);
                    qp_uses || eqs.values().any(|e| e.uar == uar) || cqs.values().any(|c| c.uar == uar)
                };
                self.uars.dealloc(&in_use, inp)
            }
            consts::MLX5_CMD_OP_CREATE_EQ => self.eqs.create(&eq_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_EQ => self.eqs.destroy(&eq_fw!(self), inp),
            consts::MLX5_CMD_OP_CREATE_CQ => self.cqs.create(&cq_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_CQ => self.cqs.destroy(&cq_fw!(self), inp),
            consts::MLX5_CMD_OP_QUERY_CQ => self.cqs.query(dma, inp, out, outlen),
            consts::MLX5_CMD_OP_MODIFY_CQ => self.cqs.modify(&cq_fw!(self), dma, inp),
            consts::MLX5_CMD_OP_CREATE_MKEY => {
                self.mkeys.create(&MkeyFw { caps: &self.caps, pds: &self.pds }, dma, inp, out)
            }
            consts::MLX5_CMD_OP_DESTROY_MKEY => self.mkeys.destroy(inp),
            consts::MLX5_CMD_OP_ACCESS_REG => match ib_vport::access_reg(inp, out) {
                Some(r) => r,
                None => self.port.access_reg(inp, out),
            },
            consts::MLX5_CMD_OP_MODIFY_NIC_VPORT_CONTEXT => {
                nic_vport::modify_nic_vport_context(&mut self.port, &self.caps, inp)
            }
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_GID => ib_vport::query_hca_vport_gid(&self.port, inp, out, outlen),
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_PKEY => ib_vport::query_hca_vport_pkey(&self.port, inp, out, outlen),
            consts::MLX5_CMD_OP_MAD_IFC => mad_ifc::mad_ifc(&mut self.port, events, inp, out),
            consts::MLX5_CMD_OP_SET_DRIVER_VERSION => {
                let supported = self.caps.gen(ifc::cmd_hca_cap::DRIVER_VERSION) != 0;
                self.port.set_driver_version(inp, supported)
            }
            consts::MLX5_CMD_OP_QUERY_VPORT_STATE => self.port.query_vport_state(inp, out),
            consts::MLX5_CMD_OP_SET_ROCE_ADDRESS => self.port.set_roce_address(inp),
            consts::MLX5_CMD_OP_QUERY_ROCE_ADDRESS => self.port.query_roce_address(inp, out),
            consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT => self.port.query_nic_vport_context(inp, out),
            consts::MLX5_CMD_OP_QUERY_VPORT_COUNTER => self.port.query_vport_counter(inp, out),
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT => self.port.query_hca_vport_context(inp, out),
            consts::MLX5_CMD_OP_MODIFY_HCA_VPORT_CONTEXT => self.port.modify_hca_vport_context(inp),
            consts::MLX5_CMD_OP_CREATE_QP => self.qps.create(&qp_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_QP => {
                self.qps.destroy(inp)?;
                self.mcgs.forget_qp(rd(inp, ifc::destroy_qp_in::QPN));
                Ok(())
            }
            consts::MLX5_CMD_OP_ATTACH_TO_MCG => self.mcgs.attach(&mcg_fw!(self), inp),
            consts::MLX5_CMD_OP_DETACH_FROM_MCG => self.mcgs.detach(&mcg_fw!(self), inp),
            consts::MLX5_CMD_OP_QUERY_QP => self.qps.query(dma, inp, out),
            op @ (consts::MLX5_CMD_OP_RST2INIT_QP
            | consts::MLX5_CMD_OP_INIT2INIT_QP
            | consts::MLX5_CMD_OP_INIT2RTR_QP
            | consts::MLX5_CMD_OP_RTR2RTS_QP
            | consts::MLX5_CMD_OP_RTS2RTS_QP) => self.qps.modify(&qp_fw!(self), op, inp),
            op @ (consts::MLX5_CMD_OP_2ERR_QP | consts::MLX5_CMD_OP_2RST_QP) => self.qps.move_to_err_or_rst(op, inp),
            consts::MLX5_CMD_OP_ALLOC_Q_COUNTER => self.q_counters.alloc(&self.caps, out),
            consts::MLX5_CMD_OP_DEALLOC_Q_COUNTER => {
                let qps = &self.qps;
                self.q_counters.dealloc(&|id| qps.values().any(|q| q.counter_set_id == id), inp)
            }
            consts::MLX5_CMD_OP_QUERY_Q_COUNTER => self.q_counters.query(inp, out),
            consts::MLX5_CMD_OP_CREATE_RMP => self.srqs.create_rmp(&srq_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_MODIFY_RMP => self.srqs.modify_rmp(&srq_fw!(self), inp),
            consts::MLX5_CMD_OP_QUERY_RMP => self.srqs.query_rmp(&srq_fw!(self), inp, out),
            consts::MLX5_CMD_OP_DESTROY_RMP => self.srqs.destroy(&srq_fw!(self), Family::Rmp, inp),
            consts::MLX5_CMD_OP_CREATE_SRQ => self.srqs.create_srq(&srq_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_ARM_RQ => self.srqs.arm_rq(&srq_fw!(self), inp),
            consts::MLX5_CMD_OP_QUERY_SRQ => self.srqs.query_srq(&srq_fw!(self), inp, out),
            consts::MLX5_CMD_OP_DESTROY_SRQ => self.srqs.destroy(&srq_fw!(self), Family::Srq, inp),
            consts::MLX5_CMD_OP_CREATE_XRC_SRQ => self.srqs.create_xrc_srq(&srq_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_XRC_SRQ => self.srqs.destroy(&srq_fw!(self), Family::XrcSrq, inp),
            consts::MLX5_CMD_OP_CREATE_UCTX => self.uctxs.create(&self.caps, inp, out),
            consts::MLX5_CMD_OP_DESTROY_UCTX => self.uctxs.destroy(inp),
            consts::MLX5_CMD_OP_CREATE_UMEM => self.umems.create(dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_UMEM => self.umems.destroy(inp),
            consts::MLX5_CMD_OP_ALLOC_MEMIC => self.memics.alloc(inp, out),
            consts::MLX5_CMD_OP_DEALLOC_MEMIC => self.memics.dealloc(inp),
            consts::MLX5_CMD_OP_SET_PP_RATE_LIMIT => self.pps.set(&self.caps, inp),
            op if Self::is_eth_object(op) => self.execute_eth(op, dma, inp, out),
            _ => Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE)),
        }
    }

    /// Live Ethernet objects: TISes, TIRs, RQTs, RQs, SQs and steering (tables, groups, entries).
    fn eth_object_count(&self) -> usize {
        let queues = self.rqs.map.len() + self.sqs.map.len();
        self.tises.map.len() + self.tirs.map.len() + self.rqts.map.len() + queues + self.flows.len()
    }

    fn clear_eth_objects(&mut self) {
        (self.tises, self.tirs, self.rqts) = (TisTable::new(), TirTable::new(), RqtTable::new());
        (self.rqs, self.sqs, self.flows) = (RqTable::new(), SqTable::new(), FlowTables::new());
    }

    fn is_eth_object(op: u16) -> bool {
        use consts::*;
        matches!(
            op,
            MLX5_CMD_OP_CREATE_TIS
                | MLX5_CMD_OP_DESTROY_TIS
                | MLX5_CMD_OP_CREATE_TIR
                | MLX5_CMD_OP_MODIFY_TIR
                | MLX5_CMD_OP_DESTROY_TIR
                | MLX5_CMD_OP_CREATE_RQT
                | MLX5_CMD_OP_MODIFY_RQT
                | MLX5_CMD_OP_DESTROY_RQT
                | MLX5_CMD_OP_CREATE_RQ
                | MLX5_CMD_OP_MODIFY_RQ
                | MLX5_CMD_OP_QUERY_RQ
                | MLX5_CMD_OP_DESTROY_RQ
                | MLX5_CMD_OP_CREATE_SQ
                | MLX5_CMD_OP_MODIFY_SQ
                | MLX5_CMD_OP_QUERY_SQ
                | MLX5_CMD_OP_DESTROY_SQ
                | MLX5_CMD_OP_CREATE_FLOW_TABLE
                | MLX5_CMD_OP_MODIFY_FLOW_TABLE
                | MLX5_CMD_OP_DESTROY_FLOW_TABLE
                | MLX5_CMD_OP_SET_FLOW_TABLE_ROOT
                | MLX5_CMD_OP_CREATE_FLOW_GROUP
                | MLX5_CMD_OP_DESTROY_FLOW_GROUP
                | MLX5_CMD_OP_SET_FLOW_TABLE_ENTRY
                | MLX5_CMD_OP_DELETE_FLOW_TABLE_ENTRY
        )
    }

    /// The Ethernet objects' commands (TIS, TIR, RQT, RQ, SQ and NIC receive steering).
    fn execute_eth(&mut self, op: u16, dma: &mut DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use consts::*;
        match op {
            MLX5_CMD_OP_CREATE_TIS => {
                let tds = &self.tds;
                self.tises.create(&self.caps, &|td| tds.contains(td), inp, out)
            }
            MLX5_CMD_OP_DESTROY_TIS => {
                let sqs = &self.sqs;
                self.tises.destroy(&|tisn| sqs.map.values().any(|s| s.tisn == tisn), inp)
            }
            MLX5_CMD_OP_CREATE_TIR => self.tirs.create(&tir_fw!(self), inp, out),
            MLX5_CMD_OP_MODIFY_TIR => self.tirs.modify(inp),
            MLX5_CMD_OP_DESTROY_TIR => self.tirs.destroy(&tir_fw!(self), inp),
            MLX5_CMD_OP_CREATE_RQT => self.rqts.create(&rqt_fw!(self), inp, out),
            MLX5_CMD_OP_MODIFY_RQT => self.rqts.modify(&rqt_fw!(self), inp),
            MLX5_CMD_OP_DESTROY_RQT => self.rqts.destroy(&rqt_fw!(self), inp),
            MLX5_CMD_OP_CREATE_RQ => self.rqs.create(&rq_fw!(self), dma, inp, out),
            MLX5_CMD_OP_MODIFY_RQ => self.rqs.modify(inp),
            MLX5_CMD_OP_QUERY_RQ => self.rqs.query(rd(inp, ifc::query_rq_in::RQN), ifc::query_rq_out::RQ_CONTEXT, out),
            MLX5_CMD_OP_DESTROY_RQ => self.rqs.destroy(&rq_fw!(self), inp),
            MLX5_CMD_OP_CREATE_SQ => {
                let fw = SqFw {
                    caps: &self.caps,
                    cq_exists: &|cqn| self.cqs.contains_key(&cqn),
                    pd_exists: &|pd| self.pds.contains(pd),
                    tis_exists: &|tisn| self.tises.map.contains_key(&tisn),
                    uar_exists: &|uar| self.uars.contains(uar),
                    umems: &self.umems,
                };
                self.sqs.create(&fw, dma, inp, out)
            }
            MLX5_CMD_OP_MODIFY_SQ => self.sqs.modify(inp),
            MLX5_CMD_OP_QUERY_SQ => self.sqs.query(rd(inp, ifc::query_sq_in::SQN), ifc::query_sq_out::SQ_CONTEXT, out),
            MLX5_CMD_OP_DESTROY_SQ => self.sqs.destroy(inp),
            MLX5_CMD_OP_CREATE_FLOW_TABLE => self.flows.create_table(&self.caps, inp, out),
            MLX5_CMD_OP_MODIFY_FLOW_TABLE => self.flows.modify_table(inp),
            MLX5_CMD_OP_DESTROY_FLOW_TABLE => self.flows.destroy_table(inp),
            MLX5_CMD_OP_SET_FLOW_TABLE_ROOT => self.flows.set_root(inp),
            MLX5_CMD_OP_CREATE_FLOW_GROUP => self.flows.create_group(inp, out),
            MLX5_CMD_OP_DESTROY_FLOW_GROUP => self.flows.destroy_group(inp),
            MLX5_CMD_OP_SET_FLOW_TABLE_ENTRY => {
                let tirs = &self.tirs;
                self.flows.set_fte(&FlowFw { caps: &self.caps, tir_exists: &|t| tirs.map.contains_key(&t) }, inp)
            }
            MLX5_CMD_OP_DELETE_FLOW_TABLE_ENTRY => self.flows.delete_fte(inp),
            _ => Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE)),
        }
    }

    fn enable_hca(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::enable_hca_in as i;
        if rd(inp, i::FUNCTION_ID) != 0 || rd(inp, i::EMBEDDED_CPU_FUNCTION) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        self.state = HcaState::Enabled;
        Ok(())
    }

    fn disable_hca(&mut self, inp: &[u8], events: &mut Vec<SimEvent>) -> Result<(), CmdErr> {
        use ifc::disable_hca_in as i;
        if rd(inp, i::FUNCTION_ID) != 0 || rd(inp, i::EMBEDDED_CPU_FUNCTION) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let pages = self.pages.release_all();
        if pages > 0 {
            events.push(SimEvent::DisableWithPages { pages });
        }
        self.state = HcaState::Disabled;
        Ok(())
    }

    fn query_issi(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_issi_out as o;
        out.set(o::CURRENT_ISSI, self.issi.into());
        // supported_issi is a bitmask of ISSI values; bit n = ISSI n. ISSI 0 and 1 are supported.
        out.set(o::SUPPORTED_ISSI_DW0, 0b11);
        Ok(())
    }

    fn set_issi(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let issi = rd(inp, ifc::set_issi_in::CURRENT_ISSI);
        if issi > 1 {
            return Err(bad_param(syndrome::BAD_ISSI));
        }
        self.issi = issi as u16;
        Ok(())
    }

    fn query_hca_cap(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_hca_cap_in as i;
        if rd(inp, i::OTHER_FUNCTION) != 0 || rd(inp, i::FUNCTION_ID) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let op_mod = rd(inp, ifc::mbox_in::OP_MOD);
        let current = op_mod & 1 == consts::HCA_CAP_OPMOD_GET_CUR;
        let img = self.caps.query((op_mod >> 1) as u16, current).ok_or(bad_param(syndrome::CAP_TYPE))?;
        let cap = ifc::query_hca_cap_out::CAPABILITY;
        out[cap.off..cap.off + cap.len].copy_from_slice(&img[..cap.len]);
        Ok(())
    }

    fn set_hca_cap(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::set_hca_cap_in as i;
        if rd(inp, i::OTHER_FUNCTION) != 0 || rd(inp, i::FUNCTION_ID) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let op_mod = rd(inp, ifc::mbox_in::OP_MOD);
        if op_mod & 1 != 0 {
            return Err(bad_param(syndrome::BAD_OP_MOD));
        }
        let cap = i::CAPABILITY;
        self.caps.set((op_mod >> 1) as u16, &inp[cap.off..cap.off + cap.len]).map_err(|e| {
            bad_param(match e {
                SetCapError::UnsupportedType => syndrome::CAP_TYPE,
                SetCapError::ReadOnlyField => syndrome::CAP_READ_ONLY,
                SetCapError::AboveMax => syndrome::CAP_ABOVE_MAX,
            })
        })
    }

    fn init_hca(&mut self) -> Result<(), CmdErr> {
        if (self.pages.owned() as i64) < self.pages.startup_pages() {
            return Err(err(CmdStatus::BadSysState, syndrome::PAGES_MISSING));
        }
        self.state = HcaState::Initialized;
        // The regular pages are asked for by event, as soon as an EQ subscribes to page requests.
        self.page_request_held = true;
        Ok(())
    }

    fn teardown_hca(&mut self, inp: &[u8], out: &mut [u8], events: &mut Vec<SimEvent>) -> Result<(), CmdErr> {
        match rd(inp, ifc::teardown_hca_in::PROFILE) {
            consts::MLX5_TEARDOWN_HCA_IN_PROFILE_GRACEFUL_CLOSE | consts::MLX5_TEARDOWN_HCA_IN_PROFILE_FORCE_CLOSE => {}
            _ => return Err(bad_param(syndrome::BAD_PROFILE)),
        }
        let (pds, uars, eqs, cqs) = self.object_counts();
        let objects = pds
            + uars
            + eqs
            + cqs
            + self.mkeys.len()
            + self.qps.len()
            + self.srqs.len()
            + self.xrcds.len()
            + self.tds.len()
            + self.uctxs.len()
            + self.umems.len()
            + self.memics.len()
            + self.eth_object_count();
        if objects > 0 {
            events.push(SimEvent::TeardownWithObjects { objects });
        }
        self.pds.clear();
        self.xrcds.clear();
        self.tds.clear();
        self.uars.clear();
        self.eqs.clear();
        self.cqs.clear();
        self.mkeys.clear();
        self.qps.clear();
        self.srqs.clear();
        self.uctxs.clear();
        self.umems.clear();
        self.memics.clear();
        self.pps.clear();
        self.clear_eth_objects();
        self.state = HcaState::Enabled;
        self.pages.reset_needs();
        self.page_request_held = false;
        out.set(ifc::teardown_hca_out::STATE, consts::MLX5_TEARDOWN_HCA_OUT_FORCE_STATE_SUCCESS);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::config::SimConfig;
    use crate::device::cmd::xor8;
    use crate::fault::Fault;
    use crate::testkit::submit::{put, Harness};
    use mlx5_core::hal::{DelayNs, Dma, DmaRegion};
    use mlx5_core::prm::{c, DeliveryStatus, Field};
    use std::time::{Duration, Instant};

    fn query_pages_in(op_mod: u32) -> Vec<u8> {
        let mut inp = vec![0u8; ifc::query_pages_in::SIZE_BYTES];
        inp.set(ifc::query_pages_in::OPCODE, consts::MLX5_CMD_OP_QUERY_PAGES.into());
        inp.set(ifc::query_pages_in::OP_MOD, op_mod);
        inp
    }

    #[test]
    fn advertised_xrc_commands_are_implemented() {
        // caps.rs's `no_capability_promises_an_unimplemented_command` keeps xrc on; its domains must execute.
        let c = Caps::new(&SimConfig::default());
        assert_eq!(c.gen(ifc::cmd_hca_cap::XRC), 1);
        for op in [consts::MLX5_CMD_OP_ALLOC_XRCD, consts::MLX5_CMD_OP_DEALLOC_XRCD] {
            assert!(Firmware::implements(op), "xrc is advertised: opcode {op:#x}");
        }
    }

    #[test]
    fn enable_hca_ok() {
        let mut h = Harness::inline();
        assert_eq!(h.enable_hca(), 0);
        assert_eq!(h.dev.hca_state(), HcaState::Enabled);
        let ex = h.dev.executed();
        assert_eq!(ex.len(), 1);
        assert_eq!((ex[0].opcode, ex[0].status, ex[0].delivery), (consts::MLX5_CMD_OP_ENABLE_HCA, 0, 0));
        // A second ENABLE_HCA is refused.
        assert_eq!(h.enable_hca(), consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR);
        assert_eq!(h.dev.executed()[1].syndrome, syndrome::ALREADY_ENABLED);
    }

    #[test]
    fn commands_before_enable_hca_fail_except_query_issi() {
        let mut h = Harness::inline();
        let (s, syn, _) = h.cmd(&query_pages_in(1), ifc::query_pages_out::SIZE_BYTES);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR, syndrome::NOT_ENABLED));
        let (s, _, out) = h.simple(
            consts::MLX5_CMD_OP_QUERY_ISSI,
            0,
            ifc::query_issi_in::SIZE_BYTES,
            ifc::query_issi_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        assert_eq!(rd(&out, ifc::query_issi_out::SUPPORTED_ISSI_DW0) & 0b11, 0b11);
        assert_eq!(rd(&out, ifc::query_issi_out::CURRENT_ISSI), 0);
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
    }

    #[test]
    fn unknown_opcode_is_bad_op() {
        let mut h = Harness::inline();
        let (s, syn, _) = h.simple(0x7777, 0, 16, 16);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_OP_ERR, syndrome::BAD_OPCODE));
        assert_eq!(h.dev.executed()[0].opcode, 0x7777);
    }

    #[test]
    fn length_checks() {
        let mut h = Harness::inline();
        h.enable_hca();
        let (s, _, _) = h.cmd(&query_pages_in(1)[..12], ifc::query_pages_out::SIZE_BYTES);
        assert_eq!(s, consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR);
        let (s, _, _) = h.cmd(&query_pages_in(1), 8);
        assert_eq!(s, consts::MLX5_CMD_STAT_BAD_OUTP_LEN_ERR);
        let (d, _) = h.exec(&[0u8; 4], 16);
        assert_eq!(d, DeliveryStatus::InLength.raw());
    }

    #[test]
    fn bad_token_in_mailbox_is_tok_delivery_error() {
        let mut h = Harness::inline();
        h.enable_hca();
        let mut inp = vec![0u8; ifc::manage_pages_in::PAS.byte_off() + 8 * 100];
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES.into());
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_GIVE.into());
        let p = h.post(0, &inp, 16);
        let blk = &p.in_blocks[1];
        put(blk, c::mlx5_cmd_prot_block::TOKEN.off, &[h.token ^ 0x5a]);
        h.ring(0);
        assert_eq!(h.status_own(0), DeliveryStatus::Tok.raw() << 1);
        assert_eq!(h.dev.executed()[1].delivery, DeliveryStatus::Tok.raw());
        assert_eq!(h.dev.pages_owned(), 0);
    }

    #[test]
    fn bad_block_number_and_alignment_and_type() {
        let mut h = Harness::inline();
        let inp = vec![0u8; 600];
        let p = h.post(0, &inp, 16);
        put(&p.in_blocks[1], c::mlx5_cmd_prot_block::BLOCK_NUM.off, &7u32.to_be_bytes());
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::BadBlkNum.raw());

        h.post(0, &inp, 16);
        h.patch_entry(0, |e| {
            let p = e.read_u64(c::mlx5_cmd_layout::IN_PTR.off);
            e.write_u64(c::mlx5_cmd_layout::IN_PTR.off, p + 512);
        });
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::InPtrAlign.raw());

        h.post(0, &inp[..16], 600);
        h.patch_entry(0, |e| {
            let p = e.read_u64(c::mlx5_cmd_layout::OUT_PTR.off);
            e.write_u64(c::mlx5_cmd_layout::OUT_PTR.off, p + 64);
        });
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::OutPtrAlign.raw());

        h.post(0, &inp[..16], 16);
        h.patch_entry(0, |e| e[c::mlx5_cmd_layout::TYPE.off] = 3);
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::CmdDescr.raw());
    }

    #[test]
    fn manage_pages_give_1000_pages_over_16_blocks() {
        let mut h = Harness::inline();
        h.enable_hca();
        let n = 1000u32;
        let inlen = ifc::manage_pages_in::PAS.byte_off() + 8 * n as usize;
        assert_eq!(inlen.saturating_sub(16).div_ceil(512), 16);
        assert_eq!(h.give_pages(n), (0, 0));
        assert_eq!(h.dev.pages_owned(), 1000);
        // Giving the same page twice is refused.
        let mut h2 = Harness::inline();
        h2.enable_hca();
        let page = h2.dma.alloc(4096, 4096).unwrap();
        let mut inp = vec![0u8; ifc::manage_pages_in::PAS.byte_off() + 16];
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES.into());
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_GIVE.into());
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 2);
        inp.set64(ifc::manage_pages_in::PAS.elem(0), page.iova());
        inp.set64(ifc::manage_pages_in::PAS.elem(1), page.iova());
        let (s, syn, _) = h2.cmd(&inp, 16);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::PAGE_ALREADY_OWNED));
        // An unmapped or misaligned page is refused too, and nothing is taken.
        inp.set64(ifc::manage_pages_in::PAS.elem(1), page.iova() + 0x10_0000);
        assert_eq!(h2.cmd(&inp, 16).1, syndrome::PAGE_NOT_MAPPED);
        inp.set64(ifc::manage_pages_in::PAS.elem(1), page.iova() + 8);
        assert_eq!(h2.cmd(&inp, 16).1, syndrome::PAGE_MISALIGNED);
        // Declaring more entries than inlen holds is an input-length error.
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 3);
        assert_eq!(h2.cmd(&inp, 16).0, consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR);
        assert_eq!(h2.dev.pages_owned(), 0);
    }

    #[test]
    fn manage_pages_take_returns_pages() {
        let mut h = Harness::inline();
        h.enable_hca();
        h.give_pages(100);
        let mut inp = vec![0u8; ifc::manage_pages_in::SIZE_BYTES];
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES.into());
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_TAKE.into());
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 64);
        let outlen = ifc::manage_pages_out::PAS.byte_off() + 64 * 8;
        assert_eq!(h.cmd(&inp, outlen - 8).0, consts::MLX5_CMD_STAT_BAD_OUTP_LEN_ERR);
        let (s, _, out) = h.cmd(&inp, outlen);
        assert_eq!(s, 0);
        assert_eq!(rd(&out, ifc::manage_pages_out::OUTPUT_NUM_ENTRIES), 64);
        let first = out.get64(ifc::manage_pages_out::PAS.elem(0));
        let last = out.get64(ifc::manage_pages_out::PAS.elem(63));
        assert_eq!(last - first, 63 * 4096);
        assert_eq!(h.dev.pages_owned(), 36);
    }

    #[test]
    fn dma_outside_iova_space_is_a_fault() {
        let mut h = Harness::inline();
        let inp = vec![0u8; 600];
        h.post(0, &inp, 16);
        // Point the input chain at 1024-aligned memory nobody allocated.
        h.patch_entry(0, |e| e.write_u64(c::mlx5_cmd_layout::IN_PTR.off, 0x7700_0000_0400));
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::Fw.raw());
        let faults = h.dev.dma_faults();
        assert_eq!(faults, vec![crate::dma::DmaFault { iova: 0x7700_0000_0400, len: 576, write: false }]);
        // A freed region faults as well: IOVAs are never reused.
        let r = h.dma.alloc(4096, 4096).unwrap();
        let iova = r.iova();
        // SAFETY: `r` came from this allocator and the device never saw it.
        unsafe { h.dma.free(r) };
        h.post(0, &inp, 16);
        h.patch_entry(0, |e| e.write_u64(c::mlx5_cmd_layout::IN_PTR.off, iova));
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::Fw.raw());
        assert_eq!(h.dev.dma_faults().len(), 2);
    }

    #[test]
    fn hang_leaves_owner_bit_set() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Hang { opcode: consts::MLX5_CMD_OP_ENABLE_HCA });
        let mut inp = vec![0u8; ifc::enable_hca_in::SIZE_BYTES];
        inp.set(ifc::enable_hca_in::OPCODE, consts::MLX5_CMD_OP_ENABLE_HCA.into());
        h.post(0, &inp, ifc::enable_hca_out::SIZE_BYTES);
        h.ring(0);
        h.dev.delay().delay_ms(120_000);
        assert_eq!(h.status_own(0) & 1, 1);
        assert!(h.dev.executed().is_empty());
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
        assert!(h.dev.events().contains(&SimEvent::Hung { slot: 0, opcode: consts::MLX5_CMD_OP_ENABLE_HCA }));
    }

    #[test]
    fn delay_completes_only_after_virtual_time() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Delay { opcode: consts::MLX5_CMD_OP_ENABLE_HCA, ms: 10 });
        let mut inp = vec![0u8; ifc::enable_hca_in::SIZE_BYTES];
        inp.set(ifc::enable_hca_in::OPCODE, consts::MLX5_CMD_OP_ENABLE_HCA.into());
        h.post(3, &inp, ifc::enable_hca_out::SIZE_BYTES);
        h.ring(3);
        let mut d = h.dev.delay();
        assert_eq!(h.status_own(3) & 1, 1);
        d.delay_ms(9);
        assert_eq!(h.status_own(3) & 1, 1);
        d.delay_us(999);
        assert_eq!(h.status_own(3) & 1, 1);
        d.delay_us(1);
        assert_eq!(h.status_own(3), 0);
        assert_eq!(h.dev.hca_state(), HcaState::Enabled);
        assert_eq!(h.dev.executed()[0].slot, 3);
    }

    #[test]
    fn doorbell_for_software_owned_slot_is_ignored() {
        let h = Harness::inline();
        h.ring(2);
        assert!(h.dev.events().contains(&SimEvent::DoorbellNotOwned { slot: 2 }));
        assert!(h.dev.executed().is_empty());
    }

    #[test]
    fn threaded_mode_completes_asynchronously() {
        let mut h = Harness::new(SimConfig { mode: Mode::Threaded, ..SimConfig::default() });
        h.dev.inject(Fault::Delay { opcode: consts::MLX5_CMD_OP_ENABLE_HCA, ms: 30 });
        let mut inp = vec![0u8; ifc::enable_hca_in::SIZE_BYTES];
        inp.set(ifc::enable_hca_in::OPCODE, consts::MLX5_CMD_OP_ENABLE_HCA.into());
        h.post(1, &inp, ifc::enable_hca_out::SIZE_BYTES);
        h.ring(1);
        // The doorbell returned before the (delayed) completion.
        assert_eq!(h.status_own(1) & 1, 1);
        let start = Instant::now();
        while h.status_own(1) & 1 == 1 {
            assert!(start.elapsed() < Duration::from_secs(10), "threaded completion timed out");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(h.status_own(1), 0);
        assert_eq!(h.dev.hca_state(), HcaState::Enabled);
        assert_eq!(h.dev.executed().len(), 1);
    }

    #[test]
    fn checksums_are_verified_and_produced() {
        let mut h = Harness::new(SimConfig { checksum: true, ..SimConfig::default() });
        h.bring_up();
        // A big output over a mailbox chain comes back signed.
        let mut inp = vec![0u8; ifc::query_hca_cap_in::SIZE_BYTES];
        inp.set(ifc::query_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_CAP.into());
        inp.set(ifc::query_hca_cap_in::OP_MOD, consts::HCA_CAP_OPMOD_GET_CUR);
        let p = h.post(0, &inp, ifc::query_hca_cap_out::SIZE_BYTES);
        h.ring(0);
        assert_eq!(h.status_own(0), 0);
        let mut e = [0u8; c::mlx5_cmd_layout::SIZE];
        crate::testkit::submit::get(&h.q, 0, &mut e);
        assert_eq!(xor8(&e), 0xff);
        for b in &p.out_blocks {
            let mut blk = vec![0u8; c::mlx5_cmd_prot_block::SIZE];
            crate::testkit::submit::get(b, 0, &mut blk);
            assert_eq!(xor8(&blk), 0xff);
            assert_eq!(xor8(&blk[c::mlx5_cmd_prot_block::DATA.end()..c::mlx5_cmd_prot_block::SIG.off]), 0xff);
        }
        let out = h.output(&p);
        let cap = ifc::query_hca_cap_out::CAPABILITY;
        assert_eq!(rd(&out, ifc::cmd_hca_cap::LOG_MAX_CQ_SZ.at(cap)), 22);
        // A broken entry signature is a delivery error.
        h.post(0, &inp, ifc::query_hca_cap_out::SIZE_BYTES);
        h.patch_entry(0, |e| e[c::mlx5_cmd_layout::SIG.off] ^= 1);
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::Signat.raw());
        // So is a broken block signature.
        let p = h.post(0, &vec![0u8; 600], 16);
        put(&p.in_blocks[0], 3, &[0xaa]);
        h.ring(0);
        assert_eq!(h.status_own(0) >> 1, DeliveryStatus::Signat.raw());
    }

    #[test]
    fn init_hca_requires_pages_and_objects_require_init() {
        let mut h = Harness::inline();
        h.enable_hca();
        let (s, _, _) = h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
        assert_eq!(s, consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR);
        let (s, syn, _) = h.simple(consts::MLX5_CMD_OP_INIT_HCA, 0, ifc::init_hca_in::SIZE_BYTES, 16);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR, syndrome::PAGES_MISSING));
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES), 8);
        h.give_pages(8);
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES), 0);
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES), 16);
        h.give_pages(16);
        let (s, _, _) = h.simple(consts::MLX5_CMD_OP_INIT_HCA, 0, ifc::init_hca_in::SIZE_BYTES, 16);
        assert_eq!(s, 0);
        assert_eq!(h.dev.hca_state(), HcaState::Initialized);
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES), 4);
        // DISABLE_HCA needs TEARDOWN_HCA first.
        let (s, syn, _) = h.simple(consts::MLX5_CMD_OP_DISABLE_HCA, 0, 16, 12);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR, syndrome::STILL_INITIALIZED));
        let (s, _, _) = h.simple(consts::MLX5_CMD_OP_TEARDOWN_HCA, 0, 16, 16);
        assert_eq!(s, 0);
        let (s, _, _) = h.simple(consts::MLX5_CMD_OP_DISABLE_HCA, 0, 16, 12);
        assert_eq!(s, 0);
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
        assert!(h.dev.events().contains(&SimEvent::DisableWithPages { pages: 24 }));
        assert_eq!(h.dev.pages_owned(), 0, "disabling released the pages");
    }

    #[test]
    fn out_of_order_steps_are_bad_sys_state() {
        let mut h = Harness::inline();
        let state_err = |h: &mut Harness, op: u16, inlen: usize, outlen: usize| {
            let (s, syn, _) = h.simple(op, 0, inlen, outlen);
            assert_eq!(s, consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR, "opcode {op:#x}");
            syn
        };
        // Before ENABLE_HCA only QUERY_ISSI and ENABLE_HCA run.
        for op in [consts::MLX5_CMD_OP_ALLOC_PD, consts::MLX5_CMD_OP_ALLOC_UAR, consts::MLX5_CMD_OP_SET_ISSI] {
            assert_eq!(state_err(&mut h, op, 16, 16), syndrome::NOT_ENABLED);
        }
        let create_eq_in = ifc::create_eq_in::SIZE_BYTES;
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_CREATE_EQ, create_eq_in, 16), syndrome::NOT_ENABLED);
        h.enable_hca();
        // Objects need INIT_HCA.
        for op in [consts::MLX5_CMD_OP_ALLOC_PD, consts::MLX5_CMD_OP_ALLOC_UAR] {
            assert_eq!(state_err(&mut h, op, 16, 16), syndrome::NOT_INITIALIZED);
        }
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_CREATE_EQ, create_eq_in, 16), syndrome::NOT_INITIALIZED);
        // The init need shows only once the boot pages are in; INIT_HCA needs both.
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES), 0);
        let init_in = ifc::init_hca_in::SIZE_BYTES;
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_INIT_HCA, init_in, 16), syndrome::PAGES_MISSING);
        h.give_pages(4);
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES), 0);
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES), 4);
        h.give_pages(4);
        assert_eq!(h.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES), 16);
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_INIT_HCA, init_in, 16), syndrome::PAGES_MISSING);
        h.give_pages(16);
        assert_eq!(h.simple(consts::MLX5_CMD_OP_INIT_HCA, 0, init_in, 16).0, 0);
        // Negotiation is over once the HCA is initialized.
        let set_cap_in = ifc::set_hca_cap_in::SIZE_BYTES;
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_SET_HCA_CAP, set_cap_in, 16), syndrome::ALREADY_INITIALIZED);
        let set_issi_in = ifc::set_issi_in::SIZE_BYTES;
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_SET_ISSI, set_issi_in, 16), syndrome::ALREADY_INITIALIZED);
        assert_eq!(state_err(&mut h, consts::MLX5_CMD_OP_INIT_HCA, init_in, 16), syndrome::ALREADY_INITIALIZED);
        assert_eq!(h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16).0, 0);
    }

    #[test]
    fn set_hca_cap_rules() {
        let mut h = Harness::inline();
        h.enable_hca();
        let mut q = vec![0u8; ifc::query_hca_cap_in::SIZE_BYTES];
        q.set(ifc::query_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_CAP.into());
        q.set(ifc::query_hca_cap_in::OP_MOD, consts::HCA_CAP_OPMOD_GET_CUR);
        let (s, _, out) = h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!(s, 0);
        let cap = ifc::query_hca_cap_out::CAPABILITY;
        let mut set = vec![0u8; ifc::set_hca_cap_in::SIZE_BYTES];
        set.set(ifc::set_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_SET_HCA_CAP.into());
        let scap = ifc::set_hca_cap_in::CAPABILITY;
        set[scap.off..scap.off + scap.len].copy_from_slice(&out[cap.off..cap.off + cap.len]);
        set.set(ifc::cmd_hca_cap::LOG_MAX_QP.at(scap), 12);
        assert_eq!(h.cmd(&set, 16).0, 0);
        set.set(ifc::cmd_hca_cap::LOG_MAX_MKEY.at(scap), 3);
        assert_eq!(h.cmd(&set, 16).1, syndrome::CAP_READ_ONLY);
        let (_, _, out) = h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!(rd(&out, ifc::cmd_hca_cap::LOG_MAX_QP.at(cap)), 12);
        q.set(ifc::query_hca_cap_in::OP_MOD, 0x7e << 1);
        assert_eq!(h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES).1, syndrome::CAP_TYPE);
        // Device memory is answered, and says there is none.
        q.set(ifc::query_hca_cap_in::OP_MOD, u32::from(consts::MLX5_CAP_DEV_MEM << 1) | consts::HCA_CAP_OPMOD_GET_CUR);
        let (s, syn, out) = h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0));
        assert!(out[cap.off..cap.off + cap.len].iter().all(|&b| b == 0));
    }

    fn create_eq(h: &mut Harness, uar: u32, log_size: u32) -> (u8, u32, u32) {
        use ifc::create_eq_in as i;
        let ctx = i::EQ_CONTEXT_ENTRY;
        let bytes = (64usize << log_size).max(4096);
        let buf = h.dma.alloc(bytes, 4096).unwrap();
        let npages = bytes / 4096;
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * npages];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_EQ.into());
        inp.set(ifc::eqc::LOG_EQ_SIZE.at(ctx), log_size);
        inp.set(ifc::eqc::UAR_PAGE.at(ctx), uar);
        for k in 0..npages {
            inp.set64(i::PAS.elem(k as u32), buf.iova() + 4096 * k as u64);
        }
        let (s, syn, out) = h.cmd(&inp, ifc::create_eq_out::SIZE_BYTES);
        (s, syn, rd(&out, ifc::create_eq_out::EQ_NUMBER))
    }

    fn create_cq(h: &mut Harness, uar: u32, eqn: u32, cqe_sz: u32) -> (u8, u32, u32) {
        use ifc::create_cq_in as i;
        let ctx = i::CQ_CONTEXT;
        let buf = h.dma.alloc(4096 * 4, 4096).unwrap();
        let dbr = h.dma.alloc(64, 64).unwrap();
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * 4];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_CQ.into());
        inp.set(ifc::cqc::LOG_CQ_SIZE.at(ctx), 8);
        inp.set(ifc::cqc::CQE_SZ.at(ctx), cqe_sz);
        inp.set(ifc::cqc::UAR_PAGE.at(ctx), uar);
        inp.set(ifc::cqc::C_EQN_OR_APU_ELEMENT.at(ctx), eqn);
        inp.set64(ifc::cqc::DBR_ADDR.at(ctx), dbr.iova());
        for k in 0..4u32 {
            inp.set64(i::PAS.elem(k), buf.iova() + 4096 * u64::from(k));
        }
        let (s, syn, out) = h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
        (s, syn, rd(&out, ifc::create_cq_out::CQN))
    }

    #[test]
    fn objects_pd_uar_eq_cq() {
        let mut h = Harness::inline();
        h.bring_up();
        let (s, _, out) = h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
        assert_eq!(s, 0);
        let pd = rd(&out, ifc::alloc_pd_out::PD);
        assert_ne!(pd, 0);
        let (s, _, out) = h.simple(consts::MLX5_CMD_OP_ALLOC_UAR, 0, 16, 16);
        assert_eq!(s, 0);
        let uar = rd(&out, ifc::alloc_uar_out::UAR);
        assert!(crate::mmio::SimMmio::uar_offset(uar) + 4096 <= h.mmio.bar_size());

        assert_eq!(create_eq(&mut h, uar + 100, 7).1, syndrome::UAR_INVALID);
        assert_eq!(create_eq(&mut h, uar, 23).1, syndrome::LOG_SIZE);
        let (s, _, eqn) = create_eq(&mut h, uar, 7);
        assert_eq!(s, 0);
        // 256 CQEs of 128 bytes need 8 pages; only 4 are given.
        assert_eq!(create_cq(&mut h, uar, eqn, consts::CQE_STRIDE_128).1, syndrome::PAS_TOO_FEW);
        assert_eq!(create_cq(&mut h, uar, eqn, 5).1, syndrome::CQE_SIZE);
        assert_eq!(create_cq(&mut h, uar, eqn + 1, consts::CQE_STRIDE_64).1, syndrome::EQ_INVALID);
        let (s, _, cqn) = create_cq(&mut h, uar, eqn, consts::CQE_STRIDE_64);
        assert_eq!(s, 0);
        assert!(cqn > 0 && cqn < 1 << 24);
        assert_eq!(h.dev.object_counts(), (1, 1, 1, 1));

        let destroy = |h: &mut Harness, op: u16, f: Field, n: u32| {
            let mut inp = vec![0u8; 16];
            inp.set(ifc::mbox_in::OPCODE, op.into());
            inp.set(f, n);
            let (s, syn, _) = h.cmd(&inp, 16);
            (s, syn)
        };
        let eq_in_use = destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_EQ, ifc::destroy_eq_in::EQ_NUMBER, eqn);
        assert_eq!(eq_in_use, (consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR, syndrome::IN_USE));
        let uar_in_use = destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_UAR, ifc::dealloc_uar_in::UAR, uar);
        assert_eq!(uar_in_use.1, syndrome::IN_USE);
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cqn), (0, 0));
        let again = destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cqn);
        assert_eq!(again, (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::CQ_INVALID));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_EQ, ifc::destroy_eq_in::EQ_NUMBER, eqn), (0, 0));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_UAR, ifc::dealloc_uar_in::UAR, uar), (0, 0));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_PD, ifc::dealloc_pd_in::PD, pd), (0, 0));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_PD, ifc::dealloc_pd_in::PD, pd).1, syndrome::PD_INVALID);
        assert_eq!(h.dev.object_counts(), (0, 0, 0, 0));
    }

    #[test]
    fn injected_status_delivery_and_corruption() {
        let mut h = Harness::inline();
        let op = consts::MLX5_CMD_OP_ENABLE_HCA;
        h.dev.inject(Fault::Status { opcode: op, status: 0x5, syndrome: 0x1234, times: 2 });
        assert_eq!(h.enable_hca(), 0x5);
        assert_eq!(h.enable_hca(), 0x5);
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
        h.dev.inject(Fault::Delivery { opcode: op, status: DeliveryStatus::Fw.raw() });
        let mut inp = vec![0u8; 16];
        inp.set(ifc::mbox_in::OPCODE, op.into());
        assert_eq!(h.exec(&inp, 12).0, DeliveryStatus::Fw.raw());
        h.dev.clear_faults();
        h.dev.inject(Fault::CorruptOutput { opcode: op, offset: 0, value: 0xee });
        assert_eq!(h.enable_hca(), 0xee);
        // The command itself ran: only its output was damaged.
        assert_eq!(h.dev.hca_state(), HcaState::Enabled);
        let ex = h.dev.executed();
        assert_eq!(ex.len(), 4);
        assert_eq!(ex[0].syndrome, 0x1234);
        assert_eq!(ex[2].delivery, DeliveryStatus::Fw.raw());
    }

    #[test]
    fn freeing_device_owned_pages_is_reported() {
        let mut h = Harness::inline();
        h.enable_hca();
        let page = h.dma.alloc(4096, 4096).unwrap();
        let mut inp = vec![0u8; ifc::manage_pages_in::PAS.byte_off() + 8];
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES.into());
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_GIVE.into());
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 1);
        inp.set64(ifc::manage_pages_in::PAS.elem(0), page.iova());
        assert_eq!(h.cmd(&inp, 16).0, 0);
        let iova = page.iova();
        // SAFETY: deliberately a second handle to the same page, to check a double free is refused; the test never
        // reads or writes through either handle.
        let again = unsafe { DmaRegion::from_raw_parts(page.cpu(), page.iova(), page.len()) };
        // SAFETY: the region came from this allocator; the test deliberately frees a page firmware owns, which the
        // simulator must report rather than corrupt.
        unsafe { h.dma.free(page) };
        assert!(h.dev.events().contains(&SimEvent::FreedDeviceOwned { iova, len: 4096, pages: 1 }));
        // SAFETY: a double free must be rejected and reported, not executed.
        unsafe { h.dma.free(again) };
        assert!(h.dev.events().contains(&SimEvent::BadFree { iova, len: 4096 }));
    }

    /// QUERY_HCA_CAP (current) of `cap_type`: the capability bytes.
    fn query_cap(h: &mut Harness, cap_type: u16) -> Vec<u8> {
        let mut inp = vec![0u8; ifc::query_hca_cap_in::SIZE_BYTES];
        inp.set(ifc::query_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_CAP.into());
        inp.set(ifc::query_hca_cap_in::OP_MOD, u32::from(cap_type) << 1 | consts::HCA_CAP_OPMOD_GET_CUR);
        let (s, _, out) = h.cmd(&inp, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!(s, 0);
        let cap = ifc::query_hca_cap_out::CAPABILITY;
        out[cap.off..cap.off + cap.len].to_vec()
    }

    #[test]
    fn device_memory_is_allocated_in_the_bar_region_its_capabilities_name() {
        use ifc::device_mem_cap as d;
        let at = ifc::hca_cap_union::DEVICE_MEM_CAP;
        // Without device memory the type answers all zero and the commands are unknown.
        let mut h = Harness::inline();
        h.bring_up();
        assert!(query_cap(&mut h, consts::MLX5_CAP_DEV_MEM).iter().all(|&b| b == 0));
        let g = query_cap(&mut h, consts::MLX5_CAP_GENERAL);
        assert_eq!(rd(&g, ifc::cmd_hca_cap::DEVICE_MEMORY.at(ifc::hca_cap_union::CMD_HCA_CAP)), 0);
        let (_, syn, _) = h.simple(
            consts::MLX5_CMD_OP_ALLOC_MEMIC,
            0,
            ifc::alloc_memic_in::SIZE_BYTES,
            ifc::alloc_memic_out::SIZE_BYTES,
        );
        assert_eq!(syn, syndrome::BAD_OPCODE);

        let mut h = Harness::new(SimConfig { memic_size: 0x8000, ..SimConfig::default() });
        h.bring_up();
        let g = query_cap(&mut h, consts::MLX5_CAP_GENERAL);
        assert_eq!(rd(&g, ifc::cmd_hca_cap::DEVICE_MEMORY.at(ifc::hca_cap_union::CMD_HCA_CAP)), 1);
        let dm = query_cap(&mut h, consts::MLX5_CAP_DEV_MEM);
        assert_eq!(rd(&dm, d::MEMIC.at(at)), 1);
        assert_eq!(rd(&dm, d::MEMIC_BAR_SIZE.at(at)), 0x8000);
        assert_eq!(rd(&dm, d::MAX_MEMIC_SIZE.at(at)), 0x8000);
        let start = dm.get64(d::MEMIC_BAR_START_ADDR.at(at));
        // The region follows the last UAR page, so no UAR overlaps it.
        let last_uar = SimConfig::default().num_uars - 1 + INIT_SEG_PAGES as u32;
        assert_eq!(start, crate::mmio::SimMmio::uar_offset(last_uar) as u64 + 4096);

        // Linux's mlx5_cmd_alloc_memic: one page of range, 128 bytes.
        let alloc = |h: &mut Harness, range: u64, size: u32| {
            use ifc::alloc_memic_in as i;
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::OPCODE, consts::MLX5_CMD_OP_ALLOC_MEMIC.into());
            inp.set64(i::RANGE_START_ADDR, range);
            inp.set(i::RANGE_SIZE, 4096);
            inp.set(i::MEMIC_SIZE, size);
            let (s, syn, out) = h.cmd(&inp, ifc::alloc_memic_out::SIZE_BYTES);
            (s, syn, out.get64(ifc::alloc_memic_out::MEMIC_START_ADDR))
        };
        let dealloc = |h: &mut Harness, addr: u64, size: u32| {
            use ifc::dealloc_memic_in as i;
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::OPCODE, consts::MLX5_CMD_OP_DEALLOC_MEMIC.into());
            inp.set64(i::MEMIC_START_ADDR, addr);
            inp.set(i::MEMIC_SIZE, size);
            let (s, syn, _) = h.cmd(&inp, ifc::dealloc_memic_out::SIZE_BYTES);
            (s, syn)
        };
        assert_eq!(alloc(&mut h, start, 128), (0, 0, start));
        assert_eq!(alloc(&mut h, start, 128), (0, 0, start + 128));
        assert_eq!(alloc(&mut h, start, 0).1, syndrome::MEMIC_SIZE);
        assert_eq!(alloc(&mut h, start + 0x8000, 64).1, syndrome::MEMIC_RANGE);
        assert_eq!(dealloc(&mut h, start, 128), (0, 0));
        let bad_param = consts::MLX5_CMD_STAT_BAD_PARAM_ERR;
        assert_eq!(dealloc(&mut h, start, 128), (bad_param, syndrome::MEMIC_INVALID));
        assert_eq!(alloc(&mut h, start, 64), (0, 0, start));
    }
}

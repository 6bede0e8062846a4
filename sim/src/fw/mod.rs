//! The firmware: [`Firmware`] (the HCA state machine, ISSI, capabilities, and one table per object type), the
//! dispatch of a delivered command to its handler, and the `syndrome` of every refusal. Delivery is `cmd.rs`,
//! pages `pages.rs`; each object type is a table in its own file (`pd.rs`: PD and UAR, `eq.rs`, `cq.rs`,
//! `mkey.rs`, `qp.rs`, `srq.rs`) whose commands get a narrow view of the rest of the firmware (`CqFw`, `QpFw`, ...: the
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

use std::collections::{BTreeMap, BTreeSet};

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use crate::config::SimConfig;
use crate::dma::DmaSpace;
use crate::events::SimEvent;
use crate::mmio::INIT_SEG_PAGES;
use crate::small::IdMap;
use crate::Stalled;

mod adapter;
pub(crate) mod caps;
mod cmd;
pub(crate) mod cq;
pub(crate) mod eq;
mod ib_vport;
pub(crate) mod mkey;
mod nic_vport;
mod pages;
mod pd;
pub(crate) mod port;
pub(crate) mod qcounter;
pub(crate) mod qp;
pub(crate) mod reply;
pub(crate) mod srq;
mod td;
mod xrcd;

use caps::{Caps, SetCapError};
use cq::{CqFw, CqTable};
use eq::{EqFw, EqTable};
use mkey::{MkeyFw, MkeyTable};
use pd::{PdTable, UarTable};
use port::PortModel;
use qcounter::QCounterTable;
use qp::{QpFw, QpTable};
use reply::{bad_param, err, rd, rd16, CmdErr};
use srq::{Family, SrqFw, SrqTable};
use td::TdTable;
use xrcd::XrcdTable;

/// Syndromes the simulated firmware reports with a failing status. Values are the simulator's own (real
/// firmware syndromes are undocumented); each check has its own so a test can tell them apart.
pub mod syndrome {
    /// `BAD_OP`: the opcode is not implemented.
    pub const BAD_OPCODE: u32 = 0x51a0_0001;
    /// `BAD_INP_LEN`: `inlen` is shorter than the command's input (with its declared `pas[]`).
    pub const BAD_INPUT_LEN: u32 = 0x51a0_0002;
    /// `BAD_OUTP_LEN`: `outlen` is shorter than the command's output (with the `pas[]` it may return).
    pub const BAD_OUTPUT_LEN: u32 = 0x51a0_0003;
    /// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: a command other than QUERY_ISSI / ENABLE_HCA before ENABLE_HCA.
    pub const NOT_ENABLED: u32 = 0x51a0_0010;
    /// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: ENABLE_HCA on an enabled function.
    pub const ALREADY_ENABLED: u32 = 0x51a0_0011;
    /// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: an object command or TEARDOWN_HCA before INIT_HCA.
    pub const NOT_INITIALIZED: u32 = 0x51a0_0012;
    /// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: INIT_HCA, SET_ISSI or SET_HCA_CAP after INIT_HCA.
    pub const ALREADY_INITIALIZED: u32 = 0x51a0_0013;
    /// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: DISABLE_HCA before TEARDOWN_HCA.
    pub const STILL_INITIALIZED: u32 = 0x51a0_0014;
    /// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: INIT_HCA before the boot and init pages were given.
    pub const PAGES_MISSING: u32 = 0x51a0_0015;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an op_mod the command does not define.
    pub const BAD_OP_MOD: u32 = 0x51a0_0020;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_ISSI with an ISSI other than 0 or 1.
    pub const BAD_ISSI: u32 = 0x51a0_0021;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a function other than our own (function_id, other_function, embedded_cpu_function).
    pub const BAD_FUNCTION: u32 = 0x51a0_0022;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: MODIFY_CQ with a field_select bit the simulator does not know, or a resize without
    /// `MLX5_MODIFY_CQ_MASK_LOG_SIZE`.
    pub const FIELD_SELECT: u32 = 0x51a0_0023;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a MANAGE_PAGES page address not 4 KiB aligned.
    pub const PAGE_MISALIGNED: u32 = 0x51a0_0030;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a MANAGE_PAGES page not inside live DMA memory.
    pub const PAGE_NOT_MAPPED: u32 = 0x51a0_0031;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a MANAGE_PAGES page firmware already owns (or listed twice).
    pub const PAGE_ALREADY_OWNED: u32 = 0x51a0_0032;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unsupported capability type.
    pub const CAP_TYPE: u32 = 0x51a0_0040;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_HCA_CAP changes a field that is not settable.
    pub const CAP_READ_ONLY: u32 = 0x51a0_0041;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_HCA_CAP sets a value above the maximum capability.
    pub const CAP_ABOVE_MAX: u32 = 0x51a0_0042;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: TEARDOWN_HCA with an unsupported profile.
    pub const BAD_PROFILE: u32 = 0x51a0_0043;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown PD.
    pub const PD_INVALID: u32 = 0x51a0_0050;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown XRC domain.
    pub const XRCD_INVALID: u32 = 0x51a0_0057;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown transport domain.
    pub const TD_INVALID: u32 = 0x51a0_0058;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: MODIFY_NIC_VPORT_CONTEXT selects a field the device does not modify.
    pub const NIC_VPORT_FIELD: u32 = 0x51a0_0085;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown UAR page.
    pub const UAR_INVALID: u32 = 0x51a0_0051;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown EQ.
    pub const EQ_INVALID: u32 = 0x51a0_0052;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown CQ.
    pub const CQ_INVALID: u32 = 0x51a0_0053;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown memory key index.
    pub const MKEY_INVALID: u32 = 0x51a0_0054;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CREATE_EQ `event_bitmask` asks for an event type the device does
    /// not report (one its capabilities do not offer).
    pub const EQ_EVENT_TYPE: u32 = 0x51a0_0056;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: log_eq_size / log_cq_size above the `log_max_*_sz` capability.
    pub const LOG_SIZE: u32 = 0x51a0_0060;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: cqe_sz other than 64 or 128 bytes.
    pub const CQE_SIZE: u32 = 0x51a0_0061;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: fewer `pas[]` entries than the queue needs (or, for CREATE_MKEY, fewer MTT entries than
    /// the pages the key covers, in the input or in `translations_octword_size`).
    pub const PAS_TOO_FEW: u32 = 0x51a0_0062;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a `pas[]` (or MTT) entry not aligned to the page size.
    pub const PAS_MISALIGNED: u32 = 0x51a0_0063;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a `pas[]` (or MTT) page not inside live DMA memory.
    pub const PAS_NOT_MAPPED: u32 = 0x51a0_0064;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a non-zero page_offset (not supported by the simulator).
    pub const PAGE_OFFSET: u32 = 0x51a0_0065;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CQ doorbell record not inside live DMA memory.
    pub const DBR_NOT_MAPPED: u32 = 0x51a0_0066;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CQ bound to an APU element (not supported).
    pub const APU_CQ: u32 = 0x51a0_0067;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: MODIFY_CQ(resize) to fewer entries than the CQEs the driver has not consumed yet.
    pub const CQ_TOO_SMALL: u32 = 0x51a0_0068;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CQ feature the simulator does not model (a collapsed CQ, `cc`).
    pub const CQ_FEATURE: u32 = 0x51a0_0069;
    /// `NO_RES`: the object limit (`log_max_*`, UAR pages in the BAR) is reached.
    pub const NO_RESOURCES: u32 = 0x51a0_0070;
    /// `BAD_RES_STATE`: the object is still used (an EQ by a CQ, a UAR by an EQ or CQ, a PD by a memory key).
    pub const IN_USE: u32 = 0x51a0_0071;
    /// `BAD_RES_STATE`: MODIFY_CQ(resize) of a CQ in error (overflow or write failure).
    pub const CQ_IN_ERROR: u32 = 0x51a0_0072;
    /// `BAD_RES_STATE`: MODIFY_CQ(resize) while the old buffer is full: the resize CQE has no free entry.
    pub const CQ_FULL: u32 = 0x51a0_0073;
    /// ACCESS_REGISTER of a register the device does not model, or in the wrong direction.
    pub const REG_ACCESS: u32 = 0x51a0_0080;
    /// A port number the device does not have (it has port 1), or a query for the other link layer.
    pub const BAD_PORT: u32 = 0x51a0_0081;
    /// SET_ROCE_ADDRESS or QUERY_ROCE_ADDRESS with an index at or past `roce_address_table_size`.
    pub const GID_INDEX: u32 = 0x51a0_0083;
    /// SET_ROCE_ADDRESS with a `roce_version` or `roce_l3_type` the PRM does not define.
    pub const ROCE_ADDRESS: u32 = 0x51a0_0084;
    /// A command needing a capability firmware does not report (SET_DRIVER_VERSION without `driver_version`).
    pub const CAP_NOT_SET: u32 = 0x51a0_0082;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY with an access mode other than PA or MTT.
    pub const MKEY_ACCESS_MODE: u32 = 0x51a0_0090;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY with `qpn` other than 0xffffff (keys bound to a QP are not supported).
    pub const MKEY_QPN: u32 = 0x51a0_0091;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY(MTT) with `log_page_size` below 12 or above 63.
    pub const MKEY_PAGE_SIZE: u32 = 0x51a0_0092;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY whose range wraps around 2^64, or an MTT key with `length64`.
    pub const MKEY_LENGTH: u32 = 0x51a0_0093;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY asking for what the simulator does not model (a free key, umem, BSF, crossing).
    pub const MKEY_FEATURE: u32 = 0x51a0_0094;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown QP.
    pub const QP_INVALID: u32 = 0x51a0_00a0;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with a transport service other than RC, UD or (where `uc` is reported) UC.
    pub const QP_TYPE: u32 = 0x51a0_00a1;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with `pm_state` other than `MLX5_QP_PM_MIGRATED`.
    pub const QP_PM_STATE: u32 = 0x51a0_00a2;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with an RQ type other than a regular, a zero-length or an SRQ RQ.
    pub const QP_RQ_TYPE: u32 = 0x51a0_00a3;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQ WQE (`16 << log_rq_stride`) above `max_wqe_sz_rq`.
    pub const QP_WQE_SIZE: u32 = 0x51a0_00a4;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP asking for what the simulator does not model (umem, XRC, an SRQ number
    /// without the SRQ RQ type, a chosen QPN,
    /// the extended context).
    pub const QP_FEATURE: u32 = 0x51a0_00a5;
    /// `BAD_QP_STATE`: a transition from a state it does not start from (2ERR from RST included).
    pub const QP_STATE: u32 = 0x51a0_00a6;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a pkey index beyond the pkey table.
    pub const QP_PKEY_INDEX: u32 = 0x51a0_00a7;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an address path the link layer cannot use (IB: no LID; RoCE: no GRH, GID or MAC; a source
    /// GID index beyond the table).
    pub const QP_PATH: u32 = 0x51a0_00a8;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: INIT2RTR (RC or UD) with an MTU other than `IB_MTU_256..=IB_MTU_4096`.
    pub const QP_MTU: u32 = 0x51a0_00a9;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a context value above its capability (`log_msg_max`, `log_rra_max`, `log_sra_max`), or a UC
    /// modify with an option or a remote right UC does not take (read, atomic, RNR, ACK and retry parameters, qkey).
    pub const QP_CONTEXT: u32 = 0x51a0_00aa;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: INIT2RTR of a RoCE QP whose `src_addr_index` names a GID table entry
    /// SET_ROCE_ADDRESS never programmed (or cleared).
    pub const GID_NOT_SET: u32 = 0x51a0_00ab;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a Q counter set id that is not allocated (DEALLOC/QUERY_Q_COUNTER, or a
    /// QP's `counter_set_id` in RST2INIT).
    pub const Q_COUNTER_INVALID: u32 = 0x51a0_00ac;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: remote atomics enabled (`rae`) with an `atomic_mode` the device does not
    /// report (0, or a mode above the caps' `atomic_size_qp`), as `set_qpc_atomic_flags` never sends.
    pub const QP_ATOMIC_MODE: u32 = 0x51a0_00ad;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with a `ts_format` the device's timestamp capability does not
    /// include (free-running on a real-time-only device, real-time on a free-running one, or an undefined value).
    pub const QP_TS_FORMAT: u32 = 0x51a0_00ae;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown SRQ or RMP (or one of the other command family).
    pub const SRQ_INVALID: u32 = 0x51a0_00b0;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an SRQ WQE stride below 32 bytes or above `max_wqe_sz_rq`.
    pub const SRQ_STRIDE: u32 = 0x51a0_00b1;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an SRQ limit (`lwm`) not below the ring size.
    pub const SRQ_LWM: u32 = 0x51a0_00b2;
    /// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RMP not RDY or whose `wq` is not a linked list, an SRQ not GOOD.
    pub const SRQ_CONTEXT: u32 = 0x51a0_00b3;
    /// `BAD_OP`: an RMP command at ISSI 0, or an SRQ command (CREATE_SRQ, ARM_RQ, ...) at ISSI 1.
    pub const SRQ_ISSI: u32 = 0x51a0_00b4;
    /// `ext_synd` in the health buffer of a firmware that died with a non-zero syndrome.
    pub const HEALTH_EXT_SYND: u16 = 0x51a0;
}

/// Lifecycle of the function, as ENABLE_HCA / INIT_HCA / TEARDOWN_HCA / DISABLE_HCA move it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HcaState {
    /// Before ENABLE_HCA (or after DISABLE_HCA).
    #[default]
    Disabled,
    /// After ENABLE_HCA: ISSI, pages and capabilities may be negotiated.
    Enabled,
    /// After INIT_HCA: objects may be created.
    Initialized,
}

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
    pages: BTreeSet<u64>,
    boot_pages: i64,
    init_pages: i64,
    regular_pages: i64,
    /// The configured init and regular needs, restored by TEARDOWN_HCA.
    cfg_pages: (i64, i64),
    /// Needed pages firmware has offered back (negative page requests), for the next MANAGE_PAGES(take).
    returnable: u64,
    /// Pages accepted by MANAGE_PAGES(give), ever: commands waiting for pages count what each give adds.
    pub(crate) given: u64,
    /// Pages the driver freed while a dead firmware still owned them.
    abandoned: usize,
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
}

/// A table of objects by number, as [`alloc_id`] sees it.
pub(crate) trait Ids {
    fn count(&self) -> usize;
    fn holds(&self, id: u32) -> bool;
}

impl<V> Ids for BTreeMap<u32, V> {
    fn count(&self) -> usize {
        self.len()
    }
    fn holds(&self, id: u32) -> bool {
        self.contains_key(&id)
    }
}

impl<V> Ids for IdMap<V> {
    fn count(&self) -> usize {
        self.len()
    }
    fn holds(&self, id: u32) -> bool {
        self.contains_key(&id)
    }
}

/// Picks a free id in `lo..hi`, starting at `*next` and wrapping, so freed ids are not reused at once.
/// Bounded: with `used.count()` ids taken, one of the next `used.count() + 1` candidates is free.
pub(crate) fn alloc_id(used: &impl Ids, next: &mut u32, lo: u32, hi: u32) -> Option<u32> {
    let span = hi.checked_sub(lo)?;
    if used.count() as u64 >= u64::from(span) {
        return None;
    }
    let mut id = (*next).clamp(lo, hi - 1);
    for _ in 0..=used.count() {
        if !used.holds(id) {
            *next = if id + 1 >= hi { lo } else { id + 1 };
            return Some(id);
        }
        id = if id + 1 >= hi { lo } else { id + 1 };
    }
    None
}

impl Ids for BTreeSet<u32> {
    fn count(&self) -> usize {
        self.len()
    }
    fn holds(&self, id: u32) -> bool {
        self.contains(&id)
    }
}

/// Numbers an ALLOC command hands out and its DEALLOC takes back (PDs, UAR pages, transport and XRC domains),
/// and the number the next ALLOC tries first, so a freed one is not reused at once.
#[derive(Debug)]
pub(crate) struct IdSet {
    set: BTreeSet<u32>,
    next: u32,
}

impl IdSet {
    pub(crate) fn new(first: u32) -> Self {
        Self { set: BTreeSet::new(), next: first }
    }

    /// Takes a free number in `lo..hi`; `None` when every one is taken.
    pub(crate) fn take(&mut self, lo: u32, hi: u32) -> Option<u32> {
        let id = alloc_id(&self.set, &mut self.next, lo, hi)?;
        self.set.insert(id);
        Some(id)
    }

    /// Gives `id` back; false when it was not taken.
    pub(crate) fn give_back(&mut self, id: u32) -> bool {
        self.set.remove(&id)
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.set.contains(&id)
    }

    pub(crate) fn len(&self) -> usize {
        self.set.len()
    }

    pub(crate) fn clear(&mut self) {
        self.set.clear();
    }
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
        }
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
            in_use: &|cqn| $fw.qps.values().any(|q| q.cqn_snd == cqn || q.cqn_rcv == cqn),
        }
    };
}

impl Firmware {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        Self {
            state: HcaState::Disabled,
            issi: 0,
            pages: BTreeSet::new(),
            boot_pages: cfg.boot_pages.into(),
            init_pages: cfg.init_pages.into(),
            regular_pages: cfg.regular_pages.into(),
            cfg_pages: (cfg.init_pages.into(), cfg.regular_pages.into()),
            returnable: 0,
            given: 0,
            abandoned: 0,
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
        match opcode {
            consts::MLX5_CMD_OP_ENABLE_HCA => self.enable_hca(inp),
            consts::MLX5_CMD_OP_DISABLE_HCA => self.disable_hca(inp, events),
            consts::MLX5_CMD_OP_QUERY_ISSI => self.query_issi(out),
            consts::MLX5_CMD_OP_QUERY_ADAPTER => adapter::query_adapter(out),
            consts::MLX5_CMD_OP_SET_ISSI => self.set_issi(inp),
            consts::MLX5_CMD_OP_QUERY_PAGES => self.query_pages(inp, out),
            consts::MLX5_CMD_OP_MANAGE_PAGES => self.manage_pages(dma, inp, out, outlen),
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
            consts::MLX5_CMD_OP_DEALLOC_TRANSPORT_DOMAIN => self.tds.dealloc(inp),
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
            consts::MLX5_CMD_OP_MODIFY_NIC_VPORT_CONTEXT => nic_vport::modify_nic_vport_context(&mut self.port, inp),
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_GID => ib_vport::query_hca_vport_gid(&self.port, inp, out, outlen),
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_PKEY => ib_vport::query_hca_vport_pkey(&self.port, inp, out, outlen),
            consts::MLX5_CMD_OP_SET_DRIVER_VERSION => {
                let supported = self.caps.gen(ifc::cmd_hca_cap::DRIVER_VERSION) != 0;
                self.port.set_driver_version(inp, supported)
            }
            consts::MLX5_CMD_OP_QUERY_VPORT_STATE => self.port.query_vport_state(inp, out),
            consts::MLX5_CMD_OP_SET_ROCE_ADDRESS => self.port.set_roce_address(inp),
            consts::MLX5_CMD_OP_QUERY_ROCE_ADDRESS => self.port.query_roce_address(inp, out),
            consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT => self.port.query_nic_vport_context(inp, out),
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT => self.port.query_hca_vport_context(inp, out),
            consts::MLX5_CMD_OP_CREATE_QP => self.qps.create(&qp_fw!(self), dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_QP => self.qps.destroy(inp),
            consts::MLX5_CMD_OP_QUERY_QP => self.qps.query(dma, inp, out),
            op @ (consts::MLX5_CMD_OP_RST2INIT_QP
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
        if !self.pages.is_empty() {
            // Disabling resets the function: firmware lets go of every page it still held.
            events.push(SimEvent::DisableWithPages { pages: self.pages.len() });
            self.pages.clear();
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
        if (self.pages.len() as i64) < self.startup_pages() {
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
            + self.tds.len();
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
        self.state = HcaState::Enabled;
        // The needs grown while running end with it; a later INIT_HCA starts from the configured ones.
        (self.init_pages, self.regular_pages) = self.cfg_pages;
        self.returnable = 0;
        self.page_request_held = false;
        out.set(ifc::teardown_hca_out::STATE, consts::MLX5_TEARDOWN_HCA_OUT_FORCE_STATE_SUCCESS);
        Ok(())
    }

    /// Checks that the `pas[]` array of `inp` covers `bytes` with live pages of `page_bytes`.
    pub(crate) fn check_pas(
        dma: &DmaSpace,
        inp: &[u8],
        pas: mlx5_core::prm::Array,
        bytes: u64,
        page_bytes: u64,
    ) -> Result<(), CmdErr> {
        let given = inp.len().saturating_sub(pas.byte_off()) as u64 / u64::from(pas.elem_bits / 8);
        let needed = bytes.div_ceil(page_bytes);
        if given < needed {
            return Err(bad_param(syndrome::PAS_TOO_FEW));
        }
        for k in 0..needed {
            let pa = inp.get64(pas.elem(k as u32));
            if !pa.is_multiple_of(page_bytes) {
                return Err(bad_param(syndrome::PAS_MISALIGNED));
            }
            let len = page_bytes.min(bytes - k * page_bytes);
            if !dma.is_mapped(pa, len as usize) {
                return Err(bad_param(syndrome::PAS_NOT_MAPPED));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::cmd::xor8;
    use super::*;
    use crate::fault::Fault;
    use crate::testutil::{put, Harness};
    use crate::{Mode, SimConfig};
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
        assert_eq!(faults, vec![crate::DmaFault { iova: 0x7700_0000_0400, len: 576, write: false }]);
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
        crate::testutil::get(&h.q, 0, &mut e);
        assert_eq!(xor8(&e), 0xff);
        for b in &p.out_blocks {
            let mut blk = vec![0u8; c::mlx5_cmd_prot_block::SIZE];
            crate::testutil::get(b, 0, &mut blk);
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
        assert!(crate::SimMmio::uar_offset(uar) + 4096 <= h.mmio.bar_size());

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
}

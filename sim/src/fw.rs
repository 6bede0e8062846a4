//! The firmware command engine: delivery (entry, mailboxes, signatures, tokens) and command execution.
//!
//! Delivery failures are reported in `status_own >> 1` (`MLX5_CMD_DELIVERY_STAT_*`); a delivered command reports
//! its result in `mbox_out.status` / `mbox_out.syndrome`. Status choices:
//! * unknown opcode: `BAD_OP`; input shorter than the command's layout (plus declared `pas[]` entries):
//!   `BAD_INP_LEN`; output shorter than needed: `BAD_OUTP_LEN`;
//! * a command not allowed in the current HCA state: `BAD_SYS_STATE`;
//! * an invalid value, including an unknown handle on destroy/dealloc: `BAD_PARAM`;
//! * a limit reached (`log_max_*`, UAR pages): `NO_RES`;
//! * destroying an object another one still uses: `BAD_RES_STATE`.
//!
//! Each failure carries a distinct syndrome from [`syndrome`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{fence, Ordering};

use mlx5_core::prm::{c, consts, ifc, CmdStatus, DeliveryStatus, Field, MsgBuf};

use crate::caps::{Caps, SetCapError};
use crate::cq::Cq;
use crate::dma::DmaSpace;
use crate::mkey::Mkey;
use crate::mmio::INIT_SEG_PAGES;
use crate::port::PortModel;
use crate::qp::Qp;
use crate::small::IdMap;
use crate::{ExecutedCmd, Fault, SimConfig, SimEvent, State};

/// Syndromes the simulated firmware reports with a failing status. Values are the simulator's own (real
/// firmware syndromes are undocumented); each check has its own so a test can tell them apart.
pub mod syndrome {
    /// `BAD_OP`: the opcode is not implemented.
    pub const BAD_OPCODE: u32 = 0x51a0_0001;
    /// `BAD_INP_LEN`: `inlen` is shorter than the command's input (with its declared `pas[]`).
    pub const BAD_INPUT_LEN: u32 = 0x51a0_0002;
    /// `BAD_OUTP_LEN`: `outlen` is shorter than the command's output (with the `pas[]` it may return).
    pub const BAD_OUTPUT_LEN: u32 = 0x51a0_0003;
    /// `BAD_SYS_STATE`: a command other than QUERY_ISSI / ENABLE_HCA before ENABLE_HCA.
    pub const NOT_ENABLED: u32 = 0x51a0_0010;
    /// `BAD_SYS_STATE`: ENABLE_HCA on an enabled function.
    pub const ALREADY_ENABLED: u32 = 0x51a0_0011;
    /// `BAD_SYS_STATE`: an object command or TEARDOWN_HCA before INIT_HCA.
    pub const NOT_INITIALIZED: u32 = 0x51a0_0012;
    /// `BAD_SYS_STATE`: INIT_HCA, SET_ISSI or SET_HCA_CAP after INIT_HCA.
    pub const ALREADY_INITIALIZED: u32 = 0x51a0_0013;
    /// `BAD_SYS_STATE`: DISABLE_HCA before TEARDOWN_HCA.
    pub const STILL_INITIALIZED: u32 = 0x51a0_0014;
    /// `BAD_SYS_STATE`: INIT_HCA before the boot and init pages were given.
    pub const PAGES_MISSING: u32 = 0x51a0_0015;
    /// `BAD_PARAM`: an op_mod the command does not define.
    pub const BAD_OP_MOD: u32 = 0x51a0_0020;
    /// `BAD_PARAM`: SET_ISSI with an ISSI other than 0 or 1.
    pub const BAD_ISSI: u32 = 0x51a0_0021;
    /// `BAD_PARAM`: a function other than our own (function_id, other_function, embedded_cpu_function).
    pub const BAD_FUNCTION: u32 = 0x51a0_0022;
    /// `BAD_PARAM`: MODIFY_CQ with a field_select bit the simulator does not know, or a resize without
    /// `MLX5_MODIFY_CQ_MASK_LOG_SIZE`.
    pub const FIELD_SELECT: u32 = 0x51a0_0023;
    /// `BAD_PARAM`: a MANAGE_PAGES page address not 4 KiB aligned.
    pub const PAGE_MISALIGNED: u32 = 0x51a0_0030;
    /// `BAD_PARAM`: a MANAGE_PAGES page not inside live DMA memory.
    pub const PAGE_NOT_MAPPED: u32 = 0x51a0_0031;
    /// `BAD_PARAM`: a MANAGE_PAGES page firmware already owns (or listed twice).
    pub const PAGE_ALREADY_OWNED: u32 = 0x51a0_0032;
    /// `BAD_PARAM`: an unsupported capability type.
    pub const CAP_TYPE: u32 = 0x51a0_0040;
    /// `BAD_PARAM`: SET_HCA_CAP changes a field that is not settable.
    pub const CAP_READ_ONLY: u32 = 0x51a0_0041;
    /// `BAD_PARAM`: SET_HCA_CAP sets a value above the maximum capability.
    pub const CAP_ABOVE_MAX: u32 = 0x51a0_0042;
    /// `BAD_PARAM`: TEARDOWN_HCA with an unsupported profile.
    pub const BAD_PROFILE: u32 = 0x51a0_0043;
    /// `BAD_PARAM`: unknown PD.
    pub const PD_INVALID: u32 = 0x51a0_0050;
    /// `BAD_PARAM`: unknown UAR page.
    pub const UAR_INVALID: u32 = 0x51a0_0051;
    /// `BAD_PARAM`: unknown EQ.
    pub const EQ_INVALID: u32 = 0x51a0_0052;
    /// `BAD_PARAM`: unknown CQ.
    pub const CQ_INVALID: u32 = 0x51a0_0053;
    /// `BAD_PARAM`: unknown memory key index.
    pub const MKEY_INVALID: u32 = 0x51a0_0054;
    /// `BAD_PARAM`: log_eq_size / log_cq_size above the `log_max_*_sz` capability.
    pub const LOG_SIZE: u32 = 0x51a0_0060;
    /// `BAD_PARAM`: cqe_sz other than 64 or 128 bytes.
    pub const CQE_SIZE: u32 = 0x51a0_0061;
    /// `BAD_PARAM`: fewer `pas[]` entries than the queue needs (or, for CREATE_MKEY, fewer MTT entries than
    /// the pages the key covers, in the input or in `translations_octword_size`).
    pub const PAS_TOO_FEW: u32 = 0x51a0_0062;
    /// `BAD_PARAM`: a `pas[]` (or MTT) entry not aligned to the page size.
    pub const PAS_MISALIGNED: u32 = 0x51a0_0063;
    /// `BAD_PARAM`: a `pas[]` (or MTT) page not inside live DMA memory.
    pub const PAS_NOT_MAPPED: u32 = 0x51a0_0064;
    /// `BAD_PARAM`: a non-zero page_offset (not supported by the simulator).
    pub const PAGE_OFFSET: u32 = 0x51a0_0065;
    /// `BAD_PARAM`: a CQ doorbell record not inside live DMA memory.
    pub const DBR_NOT_MAPPED: u32 = 0x51a0_0066;
    /// `BAD_PARAM`: a CQ bound to an APU element (not supported).
    pub const APU_CQ: u32 = 0x51a0_0067;
    /// `BAD_PARAM`: MODIFY_CQ(resize) to fewer entries than the CQEs the driver has not consumed yet.
    pub const CQ_TOO_SMALL: u32 = 0x51a0_0068;
    /// `BAD_PARAM`: a CQ feature the simulator does not model (a collapsed CQ, `cc`).
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
    /// A command needing a capability firmware does not report (SET_DRIVER_VERSION without `driver_version`).
    pub const CAP_NOT_SET: u32 = 0x51a0_0082;
    /// `BAD_PARAM`: CREATE_MKEY with an access mode other than PA or MTT.
    pub const MKEY_ACCESS_MODE: u32 = 0x51a0_0090;
    /// `BAD_PARAM`: CREATE_MKEY with `qpn` other than 0xffffff (keys bound to a QP are not supported).
    pub const MKEY_QPN: u32 = 0x51a0_0091;
    /// `BAD_PARAM`: CREATE_MKEY(MTT) with `log_page_size` below 12 or above 63.
    pub const MKEY_PAGE_SIZE: u32 = 0x51a0_0092;
    /// `BAD_PARAM`: CREATE_MKEY whose range wraps around 2^64, or an MTT key with `length64`.
    pub const MKEY_LENGTH: u32 = 0x51a0_0093;
    /// `BAD_PARAM`: CREATE_MKEY asking for what the simulator does not model (a free key, umem, BSF, crossing).
    pub const MKEY_FEATURE: u32 = 0x51a0_0094;
    /// `BAD_PARAM`: unknown QP.
    pub const QP_INVALID: u32 = 0x51a0_00a0;
    /// `BAD_PARAM`: CREATE_QP with a transport service other than RC or UD.
    pub const QP_TYPE: u32 = 0x51a0_00a1;
    /// `BAD_PARAM`: CREATE_QP with `pm_state` other than `MLX5_QP_PM_MIGRATED`.
    pub const QP_PM_STATE: u32 = 0x51a0_00a2;
    /// `BAD_PARAM`: CREATE_QP with an RQ type other than a regular or a zero-length RQ (no SRQ).
    pub const QP_RQ_TYPE: u32 = 0x51a0_00a3;
    /// `BAD_PARAM`: an RQ WQE (`16 << log_rq_stride`) above `max_wqe_sz_rq`.
    pub const QP_WQE_SIZE: u32 = 0x51a0_00a4;
    /// `BAD_PARAM`: CREATE_QP asking for what the simulator does not model (umem, XRC, SRQ, a chosen QPN,
    /// the extended context).
    pub const QP_FEATURE: u32 = 0x51a0_00a5;
    /// `BAD_QP_STATE`: a transition from a state it does not start from (2ERR from RST included).
    pub const QP_STATE: u32 = 0x51a0_00a6;
    /// `BAD_PARAM`: a pkey index beyond the pkey table.
    pub const QP_PKEY_INDEX: u32 = 0x51a0_00a7;
    /// `BAD_PARAM`: an address path the link layer cannot use (IB: no LID; RoCE: no GRH, GID or MAC; a source
    /// GID index beyond the table).
    pub const QP_PATH: u32 = 0x51a0_00a8;
    /// `BAD_PARAM`: INIT2RTR (RC) with an MTU other than `IB_MTU_256..=IB_MTU_4096`.
    pub const QP_MTU: u32 = 0x51a0_00a9;
    /// `BAD_PARAM`: a context value above its capability (`log_msg_max`, `log_rra_max`, `log_sra_max`).
    pub const QP_CONTEXT: u32 = 0x51a0_00aa;
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

/// The most mailbox blocks one message may span (bounds every chain walk; 2 MiB of data).
const MAX_BLOCKS: usize = 4096;
/// Bytes of a message carried in the entry itself (`in[4]` / `out[4]`).
const INLINE_BYTES: usize = c::mlx5_cmd_layout::IN.len;
/// Data bytes per mailbox block (`MLX5_CMD_DATA_BLOCK_SIZE`).
const BLOCK_DATA: usize = consts::MLX5_CMD_DATA_BLOCK_SIZE as usize;
/// Mailbox blocks are 1024-byte aligned (`roundup_pow_of_two(sizeof(block))`, c-layouts.md 2.2).
const BLOCK_ALIGN: u64 = c::mlx5_cmd_prot_block::SIZE.next_power_of_two() as u64;
/// Firmware pages are 4 KiB.
const FW_PAGE: u64 = consts::MLX5_ADAPTER_PAGE_SIZE as u64;
/// The owner bit in `status_own` (`CMD_OWNER_HW`).
const OWNER_HW: u8 = consts::CMD_OWNER_HW;

fn xor8(b: &[u8]) -> u8 {
    b.iter().fold(0, |a, x| a ^ x)
}

pub(crate) fn rd(b: &[u8], f: Field) -> u32 {
    MsgBuf::get(b, f)
}

fn nblocks(len: usize) -> usize {
    len.saturating_sub(INLINE_BYTES).div_ceil(BLOCK_DATA)
}

/// A failing command: status and syndrome for `mbox_out`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CmdErr {
    status: CmdStatus,
    syndrome: u32,
}

pub(crate) fn err(status: CmdStatus, syndrome: u32) -> CmdErr {
    CmdErr { status, syndrome }
}

pub(crate) fn bad_param(syndrome: u32) -> CmdErr {
    err(CmdStatus::BadParam, syndrome)
}

/// An event queue: its buffer, subscriptions and indices.
#[derive(Debug)]
pub(crate) struct Eq {
    pub(crate) uar: u32,
    /// Bus addresses of the buffer pages (`pas[]`), `page_bytes` each.
    pub(crate) pas: Vec<u64>,
    /// `4 KiB << log_page_size`. `page_offset` is always 0 (CREATE_EQ refuses anything else).
    pub(crate) page_bytes: u64,
    pub(crate) log_nent: u32,
    /// `event_bitmask[4]`: bit `n` of word 0 = event type `n`.
    pub(crate) bitmask: [u64; 4],
    /// EQEs posted (wrapping).
    pub(crate) pi: u32,
    /// The consumer index the driver last wrote, extended to 32 bits.
    pub(crate) ci: u32,
    /// The next EQE interrupts (starts disarmed).
    pub(crate) armed: bool,
    pub(crate) interrupts: u64,
    pub(crate) overruns: u64,
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
    pub(crate) pds: BTreeSet<u32>,
    next_pd: u32,
    pub(crate) uars: BTreeSet<u32>,
    next_uar: u32,
    uar_first: u32,
    uar_count: u32,
    pub(crate) eqs: BTreeMap<u32, Eq>,
    next_eqn: u32,
    pub(crate) cqs: IdMap<Cq>,
    pub(crate) next_cqn: u32,
    pub(crate) mkeys: IdMap<Mkey>,
    pub(crate) next_mkey: u32,
    pub(crate) qps: IdMap<Qp>,
    pub(crate) next_qpn: u32,
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

fn alloc_id_set(used: &BTreeSet<u32>, next: &mut u32, lo: u32, hi: u32) -> Option<u32> {
    let map: BTreeMap<u32, ()> = used.iter().map(|&k| (k, ())).collect();
    alloc_id(&map, next, lo, hi)
}

impl Firmware {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        let uar_first = INIT_SEG_PAGES as u32;
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
            pds: BTreeSet::new(),
            next_pd: 1,
            uars: BTreeSet::new(),
            next_uar: uar_first,
            uar_first,
            uar_count: cfg.num_uars,
            eqs: BTreeMap::new(),
            next_eqn: 1,
            cqs: IdMap::new(),
            next_cqn: 1,
            mkeys: IdMap::new(),
            next_mkey: 1,
            qps: IdMap::new(),
            next_qpn: 0,
        }
    }

    pub(crate) fn pages_owned(&self) -> usize {
        self.pages.len()
    }

    /// Firmware-owned pages inside `iova..iova + len`.
    pub(crate) fn pages_in(&self, iova: u64, len: u64) -> usize {
        self.pages.range(iova..iova.saturating_add(len)).count()
    }

    pub(crate) fn object_counts(&self) -> (usize, usize, usize, usize) {
        (self.pds.len(), self.uars.len(), self.eqs.len(), self.cqs.len())
    }

    pub(crate) fn mkey_count(&self) -> usize {
        self.mkeys.len()
    }

    /// Pages needed before INIT_HCA.
    fn startup_pages(&self) -> i64 {
        self.boot_pages.max(0) + self.init_pages.max(0)
    }

    /// Every page firmware needs to run: startup pages plus the regular need.
    fn need(&self) -> i64 {
        self.startup_pages() + self.regular_pages
    }

    /// Pages firmware still wants (negative: pages it would return), as QUERY_PAGES(regular) reports.
    pub(crate) fn page_balance(&self) -> i64 {
        self.need() - self.returnable as i64 - self.pages.len() as i64
    }

    /// The accounting of a page request: a positive one grows the need of the current stage (regular once
    /// initialized, init before), a negative one marks needed pages returnable.
    pub(crate) fn account_page_request(&mut self, num_pages: i32) {
        let n = i64::from(num_pages);
        if n > 0 {
            if self.state == HcaState::Initialized {
                self.regular_pages += n;
            } else {
                self.init_pages += n;
            }
        } else {
            let most = self.need().max(0) as u64;
            self.returnable = self.returnable.saturating_add(n.unsigned_abs()).min(most);
        }
    }

    /// Forgets the pages in `iova..iova + len` a dead firmware owned: the driver freed them.
    pub(crate) fn abandon(&mut self, iova: u64, len: u64) {
        let gone: Vec<u64> = self.pages.range(iova..iova.saturating_add(len)).copied().collect();
        for pa in &gone {
            self.pages.remove(pa);
        }
        self.abandoned += gone.len();
    }

    pub(crate) fn pages_abandoned(&self) -> usize {
        self.abandoned
    }

    pub(crate) fn uar_allocated(&self, uar: u32) -> bool {
        self.uars.contains(&uar)
    }

    /// The lowest-numbered EQ subscribed to `event_type`.
    pub(crate) fn subscriber(&self, event_type: u8) -> Option<u32> {
        let (word, bit) = (usize::from(event_type / 64), event_type % 64);
        self.eqs.iter().find(|(_, eq)| eq.bitmask[word] >> bit & 1 == 1).map(|(&eqn, _)| eqn)
    }

    pub(crate) fn eq_info(&self, eqn: u8) -> Option<crate::EqInfo> {
        let eq = self.eqs.get(&u32::from(eqn))?;
        Some(crate::EqInfo {
            nent: 1 << eq.log_nent,
            pi: eq.pi,
            ci: eq.ci,
            armed: eq.armed,
            interrupts: eq.interrupts,
            overruns: eq.overruns,
            uar_page: eq.uar,
            event_bitmask: eq.bitmask,
        })
    }

    /// Input size, output size and accepted states of an opcode; `None` when not implemented.
    fn spec(opcode: u16) -> Option<(usize, usize, Gate)> {
        use ifc::*;
        Some(match u32::from(opcode) {
            consts::MLX5_CMD_OP_ENABLE_HCA => (enable_hca_in::SIZE_BYTES, enable_hca_out::SIZE_BYTES, Gate::Disabled),
            consts::MLX5_CMD_OP_DISABLE_HCA => (disable_hca_in::SIZE_BYTES, disable_hca_out::SIZE_BYTES, Gate::PreInit),
            consts::MLX5_CMD_OP_QUERY_ISSI => (query_issi_in::SIZE_BYTES, query_issi_out::SIZE_BYTES, Gate::Any),
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
            consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT => {
                (query_nic_vport_context_in::SIZE_BYTES, query_nic_vport_context_out::SIZE_BYTES, Gate::Initialized)
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
            consts::MLX5_CMD_OP_2ERR_QP => (qp_2err_in::SIZE_BYTES, qp_2err_out::SIZE_BYTES, Gate::Initialized),
            consts::MLX5_CMD_OP_2RST_QP => (qp_2rst_in::SIZE_BYTES, qp_2rst_out::SIZE_BYTES, Gate::Initialized),
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
        let opcode = rd(inp, ifc::mbox_in::OPCODE) as u16;
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
        if u32::from(opcode) == consts::MLX5_CMD_OP_DISABLE_HCA && self.state == HcaState::Initialized {
            return Err(err(CmdStatus::BadSysState, syndrome::STILL_INITIALIZED));
        }
        self.check_gate(gate)?;
        match u32::from(opcode) {
            consts::MLX5_CMD_OP_ENABLE_HCA => self.enable_hca(inp),
            consts::MLX5_CMD_OP_DISABLE_HCA => self.disable_hca(inp, events),
            consts::MLX5_CMD_OP_QUERY_ISSI => self.query_issi(out),
            consts::MLX5_CMD_OP_SET_ISSI => self.set_issi(inp),
            consts::MLX5_CMD_OP_QUERY_PAGES => self.query_pages(inp, out),
            consts::MLX5_CMD_OP_MANAGE_PAGES => self.manage_pages(dma, inp, out, outlen),
            consts::MLX5_CMD_OP_QUERY_HCA_CAP => self.query_hca_cap(inp, out),
            consts::MLX5_CMD_OP_SET_HCA_CAP => self.set_hca_cap(inp),
            consts::MLX5_CMD_OP_INIT_HCA => self.init_hca(),
            consts::MLX5_CMD_OP_TEARDOWN_HCA => self.teardown_hca(inp, out, events),
            consts::MLX5_CMD_OP_ALLOC_PD => self.alloc_pd(out),
            consts::MLX5_CMD_OP_DEALLOC_PD => self.dealloc_pd(inp),
            consts::MLX5_CMD_OP_ALLOC_UAR => self.alloc_uar(out),
            consts::MLX5_CMD_OP_DEALLOC_UAR => self.dealloc_uar(inp),
            consts::MLX5_CMD_OP_CREATE_EQ => self.create_eq(dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_EQ => self.destroy_eq(inp),
            consts::MLX5_CMD_OP_CREATE_CQ => self.create_cq(dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_CQ => self.destroy_cq(inp),
            consts::MLX5_CMD_OP_QUERY_CQ => self.query_cq(dma, inp, out, outlen),
            consts::MLX5_CMD_OP_MODIFY_CQ => self.modify_cq(dma, inp),
            consts::MLX5_CMD_OP_CREATE_MKEY => self.create_mkey(dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_MKEY => self.destroy_mkey(inp),
            consts::MLX5_CMD_OP_ACCESS_REG => self.port.access_reg(inp, out),
            consts::MLX5_CMD_OP_SET_DRIVER_VERSION => {
                let supported = self.caps.gen(ifc::cmd_hca_cap::DRIVER_VERSION) != 0;
                self.port.set_driver_version(inp, supported)
            }
            consts::MLX5_CMD_OP_QUERY_VPORT_STATE => self.port.query_vport_state(inp, out),
            consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT => self.port.query_nic_vport_context(inp, out),
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT => self.port.query_hca_vport_context(inp, out),
            consts::MLX5_CMD_OP_CREATE_QP => self.create_qp(dma, inp, out),
            consts::MLX5_CMD_OP_DESTROY_QP => self.destroy_qp(inp),
            consts::MLX5_CMD_OP_QUERY_QP => self.query_qp(dma, inp, out),
            op @ (consts::MLX5_CMD_OP_RST2INIT_QP
            | consts::MLX5_CMD_OP_INIT2RTR_QP
            | consts::MLX5_CMD_OP_RTR2RTS_QP
            | consts::MLX5_CMD_OP_RTS2RTS_QP) => self.modify_qp(op, inp),
            op @ (consts::MLX5_CMD_OP_2ERR_QP | consts::MLX5_CMD_OP_2RST_QP) => self.qp_to_err_or_rst(op, inp),
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

    fn query_pages(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_pages_in as i;
        use ifc::query_pages_out as o;
        if rd(inp, i::FUNCTION_ID) != 0 || rd(inp, i::EMBEDDED_CPU_FUNCTION) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let owned = self.pages.len() as i64;
        let boot = self.boot_pages.max(0);
        let init = self.startup_pages();
        // Boot and init requests never go negative; the regular count does when firmware has pages to spare.
        // The init need is reported only once the boot pages are in: firmware cannot use init pages before.
        let owed = match rd(inp, ifc::mbox_in::OP_MOD) {
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES => (boot - owned).max(0),
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES if owned < boot => 0,
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES => (init - owned).max(0),
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES => self.page_balance(),
            _ => return Err(bad_param(syndrome::BAD_OP_MOD)),
        };
        let owed = owed.clamp(i32::MIN.into(), i32::MAX.into()) as i32;
        out.set(o::FUNCTION_ID, 0);
        out.set(o::NUM_PAGES, owed as u32);
        Ok(())
    }

    fn manage_pages(&mut self, dma: &DmaSpace, inp: &[u8], out: &mut [u8], outlen: usize) -> Result<(), CmdErr> {
        use ifc::manage_pages_in as i;
        use ifc::manage_pages_out as o;
        if rd(inp, i::FUNCTION_ID) != 0 || rd(inp, i::EMBEDDED_CPU_FUNCTION) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let n = u64::from(rd(inp, i::INPUT_NUM_ENTRIES));
        let pas_bytes = n * u64::from(i::PAS.elem_bits / 8);
        match rd(inp, ifc::mbox_in::OP_MOD) {
            consts::MLX5_PAGES_CANT_GIVE => Ok(()),
            consts::MLX5_PAGES_GIVE => {
                if (inp.len() as u64) < i::PAS.byte_off() as u64 + pas_bytes {
                    return Err(err(CmdStatus::BadInpLen, syndrome::BAD_INPUT_LEN));
                }
                // Validate every page before taking any, so a failed command changes nothing.
                let mut new = BTreeSet::new();
                for k in 0..n as u32 {
                    let pa = inp.get64(i::PAS.elem(k));
                    if !pa.is_multiple_of(FW_PAGE) {
                        return Err(bad_param(syndrome::PAGE_MISALIGNED));
                    }
                    if !dma.is_mapped(pa, FW_PAGE as usize) {
                        return Err(bad_param(syndrome::PAGE_NOT_MAPPED));
                    }
                    if self.pages.contains(&pa) || !new.insert(pa) {
                        return Err(bad_param(syndrome::PAGE_ALREADY_OWNED));
                    }
                }
                self.given += new.len() as u64;
                self.pages.extend(new);
                Ok(())
            }
            consts::MLX5_PAGES_TAKE => {
                if (outlen as u64) < o::PAS.byte_off() as u64 + pas_bytes {
                    return Err(err(CmdStatus::BadOutpLen, syndrome::BAD_OUTPUT_LEN));
                }
                // An initialized HCA keeps what it needs to run: it returns the pages it offered back plus those
                // above its need. Before INIT_HCA and after TEARDOWN_HCA it returns everything.
                let owned = self.pages.len() as u64;
                let (keep, above) = if self.state == HcaState::Initialized {
                    let need = self.need().max(0) as u64;
                    (need.saturating_sub(self.returnable), owned.saturating_sub(need))
                } else {
                    (0, owned)
                };
                let count = n.min(owned.saturating_sub(keep)) as u32;
                for k in 0..count {
                    let Some(pa) = self.pages.pop_first() else { break };
                    out.set64(o::PAS.elem(k), pa);
                }
                // Pages above the need come back first; the rest were offered back and leave the need with it.
                let offered = u64::from(count).saturating_sub(above);
                if self.state == HcaState::Initialized && offered > 0 {
                    self.returnable -= offered.min(self.returnable);
                    self.regular_pages -= offered as i64;
                }
                out.set(o::OUTPUT_NUM_ENTRIES, count);
                Ok(())
            }
            _ => Err(bad_param(syndrome::BAD_OP_MOD)),
        }
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
        let objects = pds + uars + eqs + cqs + self.mkeys.len() + self.qps.len();
        if objects > 0 {
            events.push(SimEvent::TeardownWithObjects { objects });
        }
        self.pds.clear();
        self.uars.clear();
        self.eqs.clear();
        self.cqs.clear();
        self.mkeys.clear();
        self.qps.clear();
        self.state = HcaState::Enabled;
        // The needs grown while running end with it; a later INIT_HCA starts from the configured ones.
        (self.init_pages, self.regular_pages) = self.cfg_pages;
        self.returnable = 0;
        self.page_request_held = false;
        out.set(ifc::teardown_hca_out::STATE, consts::MLX5_TEARDOWN_HCA_OUT_FORCE_STATE_SUCCESS);
        Ok(())
    }

    fn alloc_pd(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        let limit = 1u32 << self.caps.gen(ifc::cmd_hca_cap::LOG_MAX_PD).min(24);
        let pd = alloc_id_set(&self.pds, &mut self.next_pd, 1, limit)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.pds.insert(pd);
        out.set(ifc::alloc_pd_out::PD, pd);
        Ok(())
    }

    fn dealloc_pd(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let pd = rd(inp, ifc::dealloc_pd_in::PD);
        if !self.pds.contains(&pd) {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        if self.mkeys.values().any(|m| m.pd == pd) || self.qps.values().any(|q| q.pd == pd) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.pds.remove(&pd);
        Ok(())
    }

    fn alloc_uar(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        let hi = self.uar_first.saturating_add(self.uar_count);
        let uar = alloc_id_set(&self.uars, &mut self.next_uar, self.uar_first, hi)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.uars.insert(uar);
        out.set(ifc::alloc_uar_out::UAR, uar);
        Ok(())
    }

    fn dealloc_uar(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let uar = rd(inp, ifc::dealloc_uar_in::UAR);
        if !self.uars.contains(&uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        let qp_uses = self.qps.values().any(|q| q.uar == uar);
        if qp_uses || self.eqs.values().any(|e| e.uar == uar) || self.cqs.values().any(|c| c.uar == uar) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.uars.remove(&uar);
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

    fn create_eq(&mut self, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_eq_in as i;
        use ifc::eqc as q;
        let ctx = i::EQ_CONTEXT_ENTRY;
        let log_size = rd(inp, q::LOG_EQ_SIZE.at(ctx));
        if log_size > self.caps.gen(ifc::cmd_hca_cap::LOG_MAX_EQ_SZ) {
            return Err(bad_param(syndrome::LOG_SIZE));
        }
        let uar = rd(inp, q::UAR_PAGE.at(ctx));
        if !self.uars.contains(&uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        if rd(inp, q::PAGE_OFFSET.at(ctx)) != 0 {
            return Err(bad_param(syndrome::PAGE_OFFSET));
        }
        let page_bytes = FW_PAGE << rd(inp, q::LOG_PAGE_SIZE.at(ctx));
        let bytes = (1u64 << log_size) * c::mlx5_eqe::SIZE as u64;
        Self::check_pas(dma, inp, i::PAS, bytes, page_bytes)?;
        let pas = (0..bytes.div_ceil(page_bytes)).map(|k| inp.get64(i::PAS.elem(k as u32))).collect();
        let mut bitmask = [0u64; 4];
        for (k, w) in bitmask.iter_mut().enumerate() {
            *w = inp.get64(i::EVENT_BITMASK.elem(k as u32));
        }
        let max = 1u32 << self.caps.gen(ifc::cmd_hca_cap::LOG_MAX_EQ).min(8);
        if self.eqs.len() as u32 >= max {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        // eq_number is an 8-bit field.
        let eqn = alloc_id(&self.eqs, &mut self.next_eqn, 0, 1 << ifc::create_eq_out::EQ_NUMBER.width)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let eq = Eq {
            uar,
            pas,
            page_bytes,
            log_nent: log_size,
            bitmask,
            pi: 0,
            ci: 0,
            armed: false,
            interrupts: 0,
            overruns: 0,
        };
        self.eqs.insert(eqn, eq);
        out.set(ifc::create_eq_out::EQ_NUMBER, eqn);
        Ok(())
    }

    fn destroy_eq(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let eqn = rd(inp, ifc::destroy_eq_in::EQ_NUMBER);
        if !self.eqs.contains_key(&eqn) {
            return Err(bad_param(syndrome::EQ_INVALID));
        }
        if self.cqs.values().any(|c| c.eqn == eqn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.eqs.remove(&eqn);
        Ok(())
    }
}

/// A mailbox chain read during delivery: the block addresses and their contents.
struct Chain {
    iovas: Vec<u64>,
    blocks: Vec<Vec<u8>>,
}

impl State {
    /// Reads and checks `n` chained mailbox blocks starting at `first`.
    fn read_chain(&mut self, first: u64, n: usize, token: u8) -> Result<Chain, DeliveryStatus> {
        use c::mlx5_cmd_prot_block as b;
        let mut chain = Chain { iovas: Vec::with_capacity(n), blocks: Vec::with_capacity(n) };
        let mut at = first;
        for k in 0..n {
            let mut blk = vec![0u8; b::SIZE];
            self.dma.read(at, &mut blk).map_err(|_| DeliveryStatus::Fw)?;
            if self.cfg.checksum {
                let ctrl_ok = xor8(&blk[b::DATA.end()..b::SIG.off]) == 0xff;
                if !ctrl_ok || xor8(&blk) != 0xff {
                    return Err(DeliveryStatus::Signat);
                }
            }
            if blk[b::TOKEN.off] != token {
                return Err(DeliveryStatus::Tok);
            }
            if blk.read_u32(b::BLOCK_NUM.off) as usize != k {
                return Err(DeliveryStatus::BadBlkNum);
            }
            let next = blk.read_u64(b::NEXT.off);
            chain.iovas.push(at);
            chain.blocks.push(blk);
            at = next;
        }
        Ok(chain)
    }

    /// Entry-level delivery checks and input gathering. Returns the input message and the output chain.
    fn deliver(&mut self, e: &[u8]) -> Result<(Vec<u8>, Chain), DeliveryStatus> {
        use c::mlx5_cmd_layout as l;
        if e[l::TYPE.off] != consts::MLX5_PCI_CMD_XPORT {
            return Err(DeliveryStatus::CmdDescr);
        }
        if self.cfg.checksum && xor8(e) != 0xff {
            return Err(DeliveryStatus::Signat);
        }
        let inlen = e.read_u32(l::INLEN.off) as usize;
        let outlen = e.read_u32(l::OUTLEN.off) as usize;
        // The input must at least hold the header firmware decodes: opcode and op_mod (8 bytes).
        let header = (ifc::mbox_in::OP_MOD.off + ifc::mbox_in::OP_MOD.width) as usize / 8;
        if inlen < header || nblocks(inlen) > MAX_BLOCKS {
            return Err(DeliveryStatus::InLength);
        }
        if nblocks(outlen) > MAX_BLOCKS {
            return Err(DeliveryStatus::OutLength);
        }
        let in_ptr = e.read_u64(l::IN_PTR.off);
        let out_ptr = e.read_u64(l::OUT_PTR.off);
        if inlen > INLINE_BYTES && !in_ptr.is_multiple_of(BLOCK_ALIGN) {
            return Err(DeliveryStatus::InPtrAlign);
        }
        if outlen > INLINE_BYTES && !out_ptr.is_multiple_of(BLOCK_ALIGN) {
            return Err(DeliveryStatus::OutPtrAlign);
        }
        let token = e[l::TOKEN.off];
        let in_chain = self.read_chain(in_ptr, nblocks(inlen), token)?;
        let out_chain = self.read_chain(out_ptr, nblocks(outlen), token)?;
        let mut input = vec![0u8; inlen.max(INLINE_BYTES)];
        input[..INLINE_BYTES].copy_from_slice(&e[l::IN.off..l::IN.end()]);
        for (k, blk) in in_chain.blocks.iter().enumerate() {
            let start = INLINE_BYTES + k * BLOCK_DATA;
            let n = BLOCK_DATA.min(inlen - start);
            input[start..start + n].copy_from_slice(&blk[c::mlx5_cmd_prot_block::DATA.off..][..n]);
        }
        input.truncate(inlen);
        Ok((input, out_chain))
    }

    /// Writes the output blocks, the entry's `out`, its signature and finally `status_own`.
    fn complete(&mut self, slot: u8, entry_iova: u64, e: &mut [u8], delivery: u8, output: Option<(&[u8], Chain)>) {
        use c::mlx5_cmd_layout as l;
        use c::mlx5_cmd_prot_block as b;
        let mut delivery = delivery;
        if let Some((out, chain)) = output {
            for (k, (iova, mut blk)) in chain.iovas.into_iter().zip(chain.blocks).enumerate() {
                let start = INLINE_BYTES + k * BLOCK_DATA;
                let n = BLOCK_DATA.min(out.len().saturating_sub(start));
                blk[b::DATA.off..b::DATA.off + n].copy_from_slice(&out[start..start + n]);
                let mut res = self.dma.write(iova + b::DATA.off as u64, &blk[b::DATA.off..b::DATA.end()]);
                if self.cfg.checksum && res.is_ok() {
                    blk[b::CTRL_SIG.off] = 0;
                    blk[b::SIG.off] = 0;
                    blk[b::CTRL_SIG.off] = !xor8(&blk[b::DATA.end()..b::SIG.off]);
                    blk[b::SIG.off] = !xor8(&blk);
                    res = self.dma.write(iova + b::CTRL_SIG.off as u64, &blk[b::CTRL_SIG.off..b::SIG.end()]);
                }
                if res.is_err() {
                    delivery = DeliveryStatus::Fw.raw();
                    break;
                }
            }
            if delivery == DeliveryStatus::Ok.raw() {
                e[l::OUT.off..l::OUT.end()].copy_from_slice(&out[..INLINE_BYTES]);
                if self.dma.write(entry_iova + l::OUT.off as u64, &e[l::OUT.off..l::OUT.end()]).is_err() {
                    delivery = DeliveryStatus::Fw.raw();
                }
            }
        }
        // Delivery status in bits 7:1, owner bit (bit 0) handed back to software.
        let status_own = delivery << 1;
        e[l::STATUS_OWN.off] = status_own;
        let mut ok = true;
        if self.cfg.checksum {
            e[l::SIG.off] = 0;
            e[l::SIG.off] = !xor8(e);
            ok &= self.dma.write(entry_iova + l::SIG.off as u64, &e[l::SIG.off..l::SIG.end()]).is_ok();
        }
        // Everything else must be visible before the owner byte flips.
        fence(Ordering::SeqCst);
        ok &= self.dma.write_u8_volatile(entry_iova + l::STATUS_OWN.off as u64, status_own).is_ok();
        if !ok {
            self.events.push(SimEvent::CompletionUnwritable { slot });
        }
    }

    fn take_status_fault(&mut self, opcode: u16) -> Option<(u8, u32)> {
        let i = self.faults.iter().position(|f| matches!(f, Fault::Status { .. }) && f.opcode() == opcode)?;
        let Fault::Status { status, syndrome, times, .. } = self.faults[i] else { return None };
        match times {
            0 => {}
            1 => {
                self.faults.remove(i);
            }
            n => self.faults[i] = Fault::Status { opcode, status, syndrome, times: n - 1 },
        }
        Some((status, syndrome))
    }

    /// Runs one rung slot. `first` is false when a postponed command finally executes (delay faults are then
    /// not applied again). Returns `Some(ms)` when the command must be completed `ms` later.
    pub(crate) fn run_slot(&mut self, slot: u8, first: bool) -> Option<u32> {
        use c::mlx5_cmd_layout as l;
        if self.dead() {
            // A dead firmware never looks at the queue again (and a vanished device cannot).
            if first {
                self.events.push(SimEvent::DoorbellWhileDead { slot });
            }
            return None;
        }
        if first && self.stalled.iter().any(|s| s.slot == slot) {
            self.events.push(SimEvent::DoorbellBusy { slot });
            return None;
        }
        let Some(q) = self.regs.cmdq_iova else {
            self.events.push(SimEvent::DoorbellNoQueue { mask: 1 << slot });
            return None;
        };
        if u32::from(slot) >= 1u32 << self.regs.log_cmdq_size.min(5) {
            self.events.push(SimEvent::DoorbellBadSlot { slot });
            return None;
        }
        let Some(entry_iova) =
            u64::from(slot).checked_shl(self.regs.log_cmdq_stride.into()).and_then(|off| q.checked_add(off))
        else {
            self.events.push(SimEvent::DoorbellBadSlot { slot });
            return None;
        };
        // Order the driver's stores to the entry before our reads of it.
        fence(Ordering::SeqCst);
        let mut e = [0u8; c::mlx5_cmd_layout::SIZE];
        if self.dma.read(entry_iova, &mut e).is_err() {
            self.events.push(SimEvent::EntryUnreadable { slot, iova: entry_iova });
            return None;
        }
        if e[l::STATUS_OWN.off] & OWNER_HW == 0 {
            self.events.push(SimEvent::DoorbellNotOwned { slot });
            return None;
        }
        let head = &e[l::IN.off..l::IN.end()];
        let opcode = rd(head, ifc::mbox_in::OPCODE) as u16;
        let op_mod = rd(head, ifc::mbox_in::OP_MOD) as u16;
        if first {
            let death = self.faults.iter().find_map(|f| match *f {
                Fault::Fatal { opcode: o, synd } if o == opcode => Some(Some(synd)),
                Fault::Stall { opcode: o } if o == opcode => Some(Some(0)),
                Fault::DeviceGone { opcode: o } if o == opcode => Some(None),
                _ => None,
            });
            match death {
                Some(Some(synd)) => {
                    self.fail(synd);
                    return None;
                }
                Some(None) => {
                    self.vanish();
                    return None;
                }
                None => {}
            }
            if self.faults.iter().any(|f| matches!(f, Fault::Hang { .. }) && f.opcode() == opcode) {
                self.events.push(SimEvent::Hung { slot, opcode });
                return None;
            }
            let need = self.faults.iter().position(|f| matches!(f, Fault::NeedPages { .. }) && f.opcode() == opcode);
            // A need of zero pages is already met: the command runs at once.
            if let Some(Fault::NeedPages { pages: pages @ 1.., .. }) = need.map(|i| self.faults.remove(i)) {
                self.events.push(SimEvent::WaitingForPages { slot, opcode, pages });
                self.stalled.push(crate::Stalled { slot, remaining: pages.into() });
                self.page_request(i32::try_from(pages).unwrap_or(i32::MAX));
                return None;
            }
            let delay = self.faults.iter().find_map(|f| match *f {
                Fault::Delay { opcode: o, ms } if o == opcode => Some(ms),
                _ => None,
            });
            if let Some(ms) = delay {
                self.events.push(SimEvent::Delayed { slot, opcode, ms });
                return Some(ms);
            }
        }
        let mut rec = ExecutedCmd { slot, opcode, op_mod, status: 0, syndrome: 0, delivery: 0 };
        let injected_delivery = self.faults.iter().find_map(|f| match *f {
            Fault::Delivery { opcode: o, status } if o == opcode => Some(status),
            _ => None,
        });
        let delivered = match injected_delivery {
            Some(d) => Err(DeliveryStatus::from_raw(d)),
            None => self.deliver(&e),
        };
        let given_before = self.fw.given;
        match delivered {
            Err(d) => {
                rec.delivery = d.raw();
                self.complete(slot, entry_iova, &mut e, d.raw(), None);
            }
            Ok((input, out_chain)) => {
                let outlen = e.read_u32(l::OUTLEN.off) as usize;
                let mut out = vec![0u8; outlen.max(INLINE_BYTES)];
                let result = match self.take_status_fault(opcode) {
                    Some((status, syndrome)) => Err(err(CmdStatus::from_raw(status), syndrome)),
                    None => self.fw.execute(&mut self.dma, &mut self.events, &input, &mut out, outlen),
                };
                if let Err(CmdErr { status, syndrome }) = result {
                    out.fill(0);
                    out.set(ifc::mbox_out::STATUS, status.raw().into());
                    out.set(ifc::mbox_out::SYNDROME, syndrome);
                }
                for f in &self.faults {
                    if let Fault::CorruptOutput { opcode: o, offset, value } = *f {
                        if o == opcode && offset < out.len() {
                            out[offset] = value;
                        }
                    }
                }
                rec.status = rd(&out, ifc::mbox_out::STATUS) as u8;
                rec.syndrome = rd(&out, ifc::mbox_out::SYNDROME);
                self.complete(slot, entry_iova, &mut e, DeliveryStatus::Ok.raw(), Some((&out, out_chain)));
                rec.delivery = e[l::STATUS_OWN.off] >> 1;
            }
        }
        self.executed.push(rec);
        let given = self.fw.given - given_before;
        self.after_completion(slot, opcode, given);
        None
    }

    /// What firmware does once a command has completed: the command-completion EQE, page requests the command
    /// triggered (or that waited for an EQ it created), and the commands that were waiting for the pages a
    /// MANAGE_PAGES(give) just brought (`given`).
    fn after_completion(&mut self, slot: u8, opcode: u16, given: u64) {
        self.post_cmd_completion(slot);
        let requests: Vec<i32> = self
            .faults
            .iter()
            .filter_map(|f| match *f {
                Fault::PageRequest { opcode: o, num_pages } if o == opcode => Some(num_pages),
                _ => None,
            })
            .collect();
        for n in requests {
            self.page_request(n);
        }
        self.flush_page_requests();
        if given == 0 || self.stalled.is_empty() {
            return;
        }
        // The pages go to the waiting commands in the order they stalled.
        let mut left = given;
        for s in &mut self.stalled {
            let take = left.min(s.remaining);
            s.remaining -= take;
            left -= take;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.stalled).into_iter().partition(|s| s.remaining == 0);
        self.stalled = waiting;
        for s in ready {
            self.run_slot(s.slot, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{put, Harness};
    use crate::{Mode, SimConfig};
    use mlx5_core::hal::{DelayNs, Dma};
    use std::time::{Duration, Instant};

    const BAD_SYS_STATE: u8 = consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR as u8;
    const BAD_PARAM: u8 = consts::MLX5_CMD_STAT_BAD_PARAM_ERR as u8;

    fn query_pages_in(op_mod: u32) -> Vec<u8> {
        let mut inp = vec![0u8; ifc::query_pages_in::SIZE_BYTES];
        inp.set(ifc::query_pages_in::OPCODE, consts::MLX5_CMD_OP_QUERY_PAGES);
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
        assert_eq!((ex[0].opcode, ex[0].status, ex[0].delivery), (consts::MLX5_CMD_OP_ENABLE_HCA as u16, 0, 0));
        // A second ENABLE_HCA is refused.
        assert_eq!(h.enable_hca(), BAD_SYS_STATE);
        assert_eq!(h.dev.executed()[1].syndrome, syndrome::ALREADY_ENABLED);
    }

    #[test]
    fn commands_before_enable_hca_fail_except_query_issi() {
        let mut h = Harness::inline();
        let (s, syn, _) = h.cmd(&query_pages_in(1), ifc::query_pages_out::SIZE_BYTES);
        assert_eq!((s, syn), (BAD_SYS_STATE, syndrome::NOT_ENABLED));
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
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_OP_ERR as u8, syndrome::BAD_OPCODE));
        assert_eq!(h.dev.executed()[0].opcode, 0x7777);
    }

    #[test]
    fn length_checks() {
        let mut h = Harness::inline();
        h.enable_hca();
        let (s, _, _) = h.cmd(&query_pages_in(1)[..12], ifc::query_pages_out::SIZE_BYTES);
        assert_eq!(s, consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR as u8);
        let (s, _, _) = h.cmd(&query_pages_in(1), 8);
        assert_eq!(s, consts::MLX5_CMD_STAT_BAD_OUTP_LEN_ERR as u8);
        let (d, _) = h.exec(&[0u8; 4], 16);
        assert_eq!(d, DeliveryStatus::InLength.raw());
    }

    #[test]
    fn bad_token_in_mailbox_is_tok_delivery_error() {
        let mut h = Harness::inline();
        h.enable_hca();
        let mut inp = vec![0u8; ifc::manage_pages_in::PAS.byte_off() + 8 * 100];
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES);
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_GIVE);
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
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES);
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_GIVE);
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 2);
        inp.set64(ifc::manage_pages_in::PAS.elem(0), page.iova);
        inp.set64(ifc::manage_pages_in::PAS.elem(1), page.iova);
        let (s, syn, _) = h2.cmd(&inp, 16);
        assert_eq!((s, syn), (BAD_PARAM, syndrome::PAGE_ALREADY_OWNED));
        // An unmapped or misaligned page is refused too, and nothing is taken.
        inp.set64(ifc::manage_pages_in::PAS.elem(1), page.iova + 0x10_0000);
        assert_eq!(h2.cmd(&inp, 16).1, syndrome::PAGE_NOT_MAPPED);
        inp.set64(ifc::manage_pages_in::PAS.elem(1), page.iova + 8);
        assert_eq!(h2.cmd(&inp, 16).1, syndrome::PAGE_MISALIGNED);
        // Declaring more entries than inlen holds is an input-length error.
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 3);
        assert_eq!(h2.cmd(&inp, 16).0, consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR as u8);
        assert_eq!(h2.dev.pages_owned(), 0);
    }

    #[test]
    fn manage_pages_take_returns_pages() {
        let mut h = Harness::inline();
        h.enable_hca();
        h.give_pages(100);
        let mut inp = vec![0u8; ifc::manage_pages_in::SIZE_BYTES];
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES);
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_TAKE);
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 64);
        let outlen = ifc::manage_pages_out::PAS.byte_off() + 64 * 8;
        assert_eq!(h.cmd(&inp, outlen - 8).0, consts::MLX5_CMD_STAT_BAD_OUTP_LEN_ERR as u8);
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
        let iova = r.iova;
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
        h.dev.inject(Fault::Hang { opcode: consts::MLX5_CMD_OP_ENABLE_HCA as u16 });
        let mut inp = vec![0u8; ifc::enable_hca_in::SIZE_BYTES];
        inp.set(ifc::enable_hca_in::OPCODE, consts::MLX5_CMD_OP_ENABLE_HCA);
        h.post(0, &inp, ifc::enable_hca_out::SIZE_BYTES);
        h.ring(0);
        h.dev.delay().delay_ms(120_000);
        assert_eq!(h.status_own(0) & 1, 1);
        assert!(h.dev.executed().is_empty());
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
        assert!(h.dev.events().contains(&SimEvent::Hung { slot: 0, opcode: consts::MLX5_CMD_OP_ENABLE_HCA as u16 }));
    }

    #[test]
    fn delay_completes_only_after_virtual_time() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Delay { opcode: consts::MLX5_CMD_OP_ENABLE_HCA as u16, ms: 10 });
        let mut inp = vec![0u8; ifc::enable_hca_in::SIZE_BYTES];
        inp.set(ifc::enable_hca_in::OPCODE, consts::MLX5_CMD_OP_ENABLE_HCA);
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
        h.dev.inject(Fault::Delay { opcode: consts::MLX5_CMD_OP_ENABLE_HCA as u16, ms: 30 });
        let mut inp = vec![0u8; ifc::enable_hca_in::SIZE_BYTES];
        inp.set(ifc::enable_hca_in::OPCODE, consts::MLX5_CMD_OP_ENABLE_HCA);
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
        inp.set(ifc::query_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_CAP);
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
        assert_eq!(s, BAD_SYS_STATE);
        let (s, syn, _) = h.simple(consts::MLX5_CMD_OP_INIT_HCA, 0, ifc::init_hca_in::SIZE_BYTES, 16);
        assert_eq!((s, syn), (BAD_SYS_STATE, syndrome::PAGES_MISSING));
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
        assert_eq!((s, syn), (BAD_SYS_STATE, syndrome::STILL_INITIALIZED));
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
        let state_err = |h: &mut Harness, op: u32, inlen: usize, outlen: usize| {
            let (s, syn, _) = h.simple(op, 0, inlen, outlen);
            assert_eq!(s, BAD_SYS_STATE, "opcode {op:#x}");
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
        q.set(ifc::query_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_CAP);
        q.set(ifc::query_hca_cap_in::OP_MOD, consts::HCA_CAP_OPMOD_GET_CUR);
        let (s, _, out) = h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!(s, 0);
        let cap = ifc::query_hca_cap_out::CAPABILITY;
        let mut set = vec![0u8; ifc::set_hca_cap_in::SIZE_BYTES];
        set.set(ifc::set_hca_cap_in::OPCODE, consts::MLX5_CMD_OP_SET_HCA_CAP);
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
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_EQ);
        inp.set(ifc::eqc::LOG_EQ_SIZE.at(ctx), log_size);
        inp.set(ifc::eqc::UAR_PAGE.at(ctx), uar);
        for k in 0..npages {
            inp.set64(i::PAS.elem(k as u32), buf.iova + 4096 * k as u64);
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
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_CQ);
        inp.set(ifc::cqc::LOG_CQ_SIZE.at(ctx), 8);
        inp.set(ifc::cqc::CQE_SZ.at(ctx), cqe_sz);
        inp.set(ifc::cqc::UAR_PAGE.at(ctx), uar);
        inp.set(ifc::cqc::C_EQN_OR_APU_ELEMENT.at(ctx), eqn);
        inp.set64(ifc::cqc::DBR_ADDR.at(ctx), dbr.iova);
        for k in 0..4u32 {
            inp.set64(i::PAS.elem(k), buf.iova + 4096 * u64::from(k));
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

        let destroy = |h: &mut Harness, op: u32, f: Field, n: u32| {
            let mut inp = vec![0u8; 16];
            inp.set(ifc::mbox_in::OPCODE, op);
            inp.set(f, n);
            let (s, syn, _) = h.cmd(&inp, 16);
            (s, syn)
        };
        let eq_in_use = destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_EQ, ifc::destroy_eq_in::EQ_NUMBER, eqn);
        assert_eq!(eq_in_use, (consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR as u8, syndrome::IN_USE));
        let uar_in_use = destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_UAR, ifc::dealloc_uar_in::UAR, uar);
        assert_eq!(uar_in_use.1, syndrome::IN_USE);
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cqn), (0, 0));
        let again = destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cqn);
        assert_eq!(again, (BAD_PARAM, syndrome::CQ_INVALID));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DESTROY_EQ, ifc::destroy_eq_in::EQ_NUMBER, eqn), (0, 0));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_UAR, ifc::dealloc_uar_in::UAR, uar), (0, 0));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_PD, ifc::dealloc_pd_in::PD, pd), (0, 0));
        assert_eq!(destroy(&mut h, consts::MLX5_CMD_OP_DEALLOC_PD, ifc::dealloc_pd_in::PD, pd).1, syndrome::PD_INVALID);
        assert_eq!(h.dev.object_counts(), (0, 0, 0, 0));
    }

    #[test]
    fn injected_status_delivery_and_corruption() {
        let mut h = Harness::inline();
        let op = consts::MLX5_CMD_OP_ENABLE_HCA as u16;
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
        inp.set(ifc::manage_pages_in::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES);
        inp.set(ifc::manage_pages_in::OP_MOD, consts::MLX5_PAGES_GIVE);
        inp.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, 1);
        inp.set64(ifc::manage_pages_in::PAS.elem(0), page.iova);
        assert_eq!(h.cmd(&inp, 16).0, 0);
        let iova = page.iova;
        // SAFETY: the region came from this allocator; the test deliberately frees a page firmware owns, which the
        // simulator must report rather than corrupt.
        unsafe { h.dma.free(page) };
        assert!(h.dev.events().contains(&SimEvent::FreedDeviceOwned { iova, len: 4096, pages: 1 }));
        // SAFETY: a double free must be rejected and reported, not executed.
        unsafe { h.dma.free(page) };
        assert!(h.dev.events().contains(&SimEvent::BadFree { iova, len: 4096 }));
    }
}

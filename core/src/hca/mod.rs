//! HCA bring-up and teardown in Linux's order, firmware page requests, the async EQ and health (Linux `main.c`
//! `mlx5_function_enable` / `mlx5_function_open` / `mlx5_load`, `pagealloc.c`, `eq.c`, `health.c`).
//!
//! [`Hca::bring_up`] takes a function from reset to a usable HCA with Linux's EQs (command, async and pages EQ;
//! a completion EQ per vector on first use); [`Hca::teardown`] undoes it and returns every firmware page and every
//! DMA allocation. While a command waits, the waiting loop drains the EQs and answers page requests on the
//! reserved last command slot (a physical function's slot-0 command cannot finish until its page request is
//! served), and polls health every [`HEALTH_POLL_INTERVAL_MS`] of waiting; [`Hca::health_tick`] polls it on the
//! caller's clock, independent of commands.
//!
//! A health failure (stalled heartbeat, health syndrome, all-ones reads) moves the HCA to the internal-error
//! state: new commands fail at once with [`Error::InternalError`], destroy-type commands are treated as done
//! without reaching the device ([`Hca::exec_destroy`]), and firmware pages are reclaimed locally, as Linux does.
//! Posts fail with a typed error, and the work the device will never complete is completed with flush status by
//! [`Hca::poll_cq`].
//!
//! The `impl Hca` is spread over the submodules: `bringup` (bring-up and teardown), `wait` (what runs while a
//! command waits), `events` (completion and async events), `objects` (PD, MR, CQ, QP, ports), `error`.

mod bringup;
mod error;
pub(crate) mod events;
mod objects;
mod queue_mem;
mod srq;
mod wait;

pub use error::{BringupError, Error, Step};
pub use events::{port_event, AsyncEvent, CqEntry};
pub use objects::{
    gid_table, link_local_gid, mac_to_eui64, poll_cq_into, poll_cq_with, CqAttr, DestroyError, GidType, Pd, PortAttr,
    QpInitAttr, Rereg, ReregError, MR_MAX_PAGE_SHIFT,
};
pub use srq::SrqAttr;
pub use wait::done_in_internal_error;

use core::cell::Cell;

use crate::caps::DeviceCaps;
use crate::cmdq::CmdQueue;
use crate::dbr::{DbrPage, DbrPoolOf};
use crate::eq::EqRing;
use crate::hal::{Dma, DmaRegion, Mmio};
use crate::health::{HealthFailure, HEALTH_POLL_INTERVAL_MS};
use crate::pages::{FwChunk, FwPagesOf};
use crate::prm::consts;
use crate::table::Table;
use crate::trace::CmdTrace;

use events::{AsyncEvents, CqEvents};
use wait::Watch;

/// Doorbell-record pages a [`Fixed`] HCA holds by default (each holds 64 records with 64-byte cache lines, 32 with
/// 128).
pub const DBR_PAGES: usize = 64;

/// Where an [`Hca`] keeps the bookkeeping that grows with the objects created: one [`Table`] per pool. The core
/// has no heap, so its user chooses: [`Fixed`] capacities (firmware, small systems), or a host's growable vectors
/// so that every object the device advertises can be created (`mlx5-verbs` does this).
pub trait Tables {
    /// The doorbell-record pages (64 records each with 64-byte cache lines): one slot per page held.
    type DbrPages: Table<Option<DbrPage>>;
    /// The firmware page pool's chunks (`CHUNK_PAGES` pages each): one entry per chunk held.
    type FwChunks: Table<FwChunk>;
    /// The completion-event state of every CQ (the EQ to CQ lookup): one entry per CQ.
    type Cqs: Table<CqEntry>;
}

/// Fixed capacities: up to `P` firmware-page chunks (`P * CHUNK_PAGES` pages: 64 MiB by default), `NCQ` CQs and
/// `DBR` doorbell-record pages (4,096 QPs, CQs and SRQs with 64-byte cache lines). What does not fit fails with a
/// typed error ([`Error::TooManyCqs`], [`crate::dbr::DbrError::Full`], [`crate::pages::PagesError::Exhausted`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Fixed<const P: usize = 256, const NCQ: usize = 256, const DBR: usize = DBR_PAGES>;

impl<const P: usize, const NCQ: usize, const DBR: usize> Tables for Fixed<P, NCQ, DBR> {
    type DbrPages = heapless::Vec<Option<DbrPage>, DBR>;
    type FwChunks = heapless::Vec<FwChunk, P>;
    type Cqs = heapless::Vec<CqEntry, NCQ>;
}

/// Waiting for `initializing` before the command queue exists (`MLX5_TO_FW_PRE_INIT_TIMEOUT_MS`, lib/tout.c).
pub const FW_PRE_INIT_TIMEOUT_MS: u32 = 120_000;
/// Poll period while waiting for `initializing` (`MLX5_TO_FW_PRE_INIT_WAIT_MS`).
pub const FW_PRE_INIT_WAIT_MS: u32 = 2;
/// Waiting for `initializing` after the queue address is set, unless the init segment says otherwise
/// (`MLX5_TO_FW_INIT_MS`).
pub const FW_INIT_TIMEOUT_MS: u32 = 2_000;
/// Linux's default profile caps `log_max_qp` at 18 (`MLX5_DEFAULT_PROF` with `LOG_MAX_SUPPORTED_QPS`).
pub const PROFILE_LOG_MAX_QP: u8 = 18;
/// `atomic_req_8B_endianness_mode` value for host endianness: "mode 1" of
/// `supported_atomic_req_8B_endianness_mode_1` (main.c `MLX5_ATOMIC_REQ_MODE_HOST_ENDIANNESS`; a value the
/// vendored constants do not carry).
const ATOMIC_REQ_MODE_HOST_ENDIANNESS: u32 = 1;

/// How to bring the function up.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// This function's id (0 for the physical function itself).
    pub function_id: u16,
    /// Usable entries in the async EQ (`MLX5_NUM_ASYNC_EQE`); the ring gets `MLX5_NUM_SPARE_EQE` more, rounded
    /// up to a power of two. The command EQ gets `MLX5_NUM_CMD_EQE` and the pages EQ one, as in Linux.
    pub async_eq_nent: u32,
    /// Usable entries in each completion EQ (`MLX5_COMP_EQ_SIZE`).
    pub comp_eq_nent: u32,
    /// Completion vectors wanted (one completion EQ each, created on first use). The HCA offers
    /// `min(this, EQs the device allows less the three async ones, MAX_COMP_VECTORS)`, at least 1; a VFIO host
    /// also caps it by its MSI-X vectors before passing it here.
    pub num_comp_vectors: u16,
    /// Interrupt vectors (MSI-X) the host enabled for this function. With one, every EQ interrupts on vector 0
    /// (as Linux shares its single vector); with more, the control EQs use vector 0 and completion vector `v`
    /// uses `1 + v % (num_irqs - 1)` (`MLX5_IRQ_VEC_COMP_BASE`).
    pub num_irqs: u16,
    /// Written with SET_DRIVER_VERSION when firmware supports it.
    pub driver_version: &'static str,
    /// `log_max_qp` to set; `None` means Linux's default profile (`min(18, max)`).
    pub log_max_qp: Option<u8>,
    /// The CPU's cache line is 128 bytes (sets `cache_line_128byte` when the device supports it).
    pub cache_line_128: bool,
    /// Host page shift (`log_uar_page_sz = page_shift - 12`; `uar_4k` only when pages are bigger than 4 KiB).
    pub page_shift: u8,
    /// Waiting for firmware before the command queue exists, in milliseconds.
    pub pre_init_timeout_ms: u32,
    /// Health poll period in milliseconds of waiting.
    pub health_poll_interval_ms: u32,
    /// The port's IPv4 addresses: each gets a RoCE v1 and a v2 GID entry (as `::ffff:a.b.c.d`) after the
    /// link-local pair, in this order, as Linux's GID cache fills the table from the netdev's addresses.
    pub ipv4_addrs: &'static [[u8; 4]],
    /// The port's IPv6 addresses (after the IPv4 ones), each with a RoCE v1 and a v2 entry.
    pub ipv6_addrs: &'static [[u8; 16]],
}

impl Default for Config {
    fn default() -> Self {
        Self {
            function_id: 0,
            async_eq_nent: consts::MLX5_NUM_ASYNC_EQE,
            comp_eq_nent: consts::MLX5_COMP_EQ_SIZE,
            num_comp_vectors: 1,
            num_irqs: 1,
            driver_version: concat!("Rust,mlx5-core,", env!("CARGO_PKG_VERSION")),
            log_max_qp: None,
            cache_line_128: false,
            page_shift: 12,
            pre_init_timeout_ms: FW_PRE_INIT_TIMEOUT_MS,
            health_poll_interval_ms: HEALTH_POLL_INTERVAL_MS,
            ipv4_addrs: &[],
            ipv6_addrs: &[],
        }
    }
}

/// Where the HCA stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum HcaState {
    /// Working normally.
    Up,
    /// `MLX5_DEVICE_STATE_INTERNAL_ERROR`.
    InternalError(HealthFailure),
}

/// Firmware page accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageStats {
    /// Pages given at boot.
    pub boot: usize,
    /// Pages given at init.
    pub init: usize,
    /// Pages given in answer to page-request events.
    pub requested: usize,
    /// Pages given in total.
    pub given: usize,
    /// Pages firmware returned.
    pub reclaimed: usize,
    /// Pages freed without firmware returning them (internal error, or firmware kept them past DISABLE_HCA).
    pub abandoned: usize,
    /// Page-request events seen (give and take).
    pub page_requests: u32,
    /// MANAGE_PAGES(CANT_GIVE) sent because the pool could not provide pages.
    pub cant_give: u32,
}

/// Counts of the async events seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EventCounts {
    /// Command completion events.
    pub command: u32,
    /// Page-request events.
    pub page_request: u32,
    /// Port change events.
    pub port_change: u32,
    /// CQ error events.
    pub cq_error: u32,
    /// Affiliated QP errors (catastrophic, invalid request, access).
    pub qp_error: u32,
    /// Affiliated QP events that are no error (path migration, COMM_EST, SQ_DRAINED, path migration failed).
    pub qp_event: u32,
    /// Internal error events.
    pub internal_error: u32,
    /// Completion events.
    pub completion: u32,
    /// Completion events for a CQ number the driver does not have.
    pub bogus_completion: u32,
    /// Events of other types.
    pub other: u32,
    /// The last port change: (port, `MLX5_PORT_CHANGE_SUBTYPE_*`).
    pub last_port_change: Option<(u8, u8)>,
    /// The last CQ error: (cqn, syndrome).
    pub last_cq_error: Option<(u32, u8)>,
    /// Times the EQ was armed.
    pub arms: u32,
}

/// What teardown did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TeardownReport {
    /// Pages firmware returned.
    pub pages_reclaimed: usize,
    /// Pages freed without firmware returning them.
    pub pages_abandoned: usize,
    /// Set when teardown could not talk to firmware (internal error): commands were treated as done.
    pub local_only: bool,
    /// The first error met; teardown continued past it.
    pub first_error: Option<Error>,
}

/// Completion vectors an HCA can have (one completion EQ each).
pub const MAX_COMP_VECTORS: usize = 32;

/// EQs Linux reserves for its async EQs when it sizes the completion vectors (`MLX5_MAX_ASYNC_EQS` without ODP:
/// command, async, pages).
pub const MAX_ASYNC_EQS: u32 = 3;

/// The event queues, as Linux's `mlx5_eq_table` holds them: the command EQ, the async EQ, the pages EQ (created
/// at bring-up, in that order) and one completion EQ per vector (created on first use, `mlx5_comp_eqn_get`).
#[derive(Debug)]
pub(crate) struct EqTable {
    pub(crate) cmd: Option<EqRing>,
    pub(crate) async_eq: Option<EqRing>,
    pub(crate) pages: Option<EqRing>,
    pub(crate) comp: [Option<EqRing>; MAX_COMP_VECTORS],
    /// Completion vectors on offer.
    pub(crate) num_comp: u16,
}

impl EqTable {
    fn new() -> Self {
        Self { cmd: None, async_eq: None, pages: None, comp: [const { None }; MAX_COMP_VECTORS], num_comp: 1 }
    }

    /// Every EQ that exists, the control EQs first.
    pub(crate) fn rings_mut(&mut self) -> impl Iterator<Item = &mut EqRing> {
        [&mut self.cmd, &mut self.async_eq, &mut self.pages].into_iter().flatten().chain(self.comp.iter_mut().flatten())
    }
}

/// Everything besides the command queue, so a waiting command (which borrows the queue) can still reach it.
/// Its methods take a delay that already counts waiting time into the `clock` cell (a [`Clock`]).
pub(crate) struct Ctx<S: Tables> {
    cfg: Config,
    pages: FwPagesOf<S::FwChunks>,
    watch: Watch,
    /// The capabilities the async EQ's event mask is gathered from (`gather_async_events_mask`).
    event_caps: crate::eq::AsyncEventCaps,
    /// The device sends no page requests (`page_request_disable`): no pages EQ.
    page_request_disable: bool,
    pub(crate) eqs: EqTable,
    /// Completion-event bookkeeping of every CQ (arm sequence numbers, events not yet taken or acknowledged).
    pub(crate) cqs: CqEvents<S::Cqs>,
    pub(crate) async_events: AsyncEvents,
    stats: PageStats,
    pub(crate) events: EventCounts,
}

/// An mlx5 function brought up to a usable HCA.
///
/// Call [`Hca::teardown`] when done: dropping an `Hca` that is still up leaks the EQ buffer and the firmware
/// pages (the device may still write them) rather than freeing them under it.
///
/// `S` says where its growing bookkeeping lives ([`Tables`]): [`Fixed`] capacities by default.
pub struct Hca<M: Mmio, D: Dma, T: CmdTrace = (), S: Tables = Fixed> {
    pub(crate) cmdq: CmdQueue<M, D, T>,
    pub(crate) ctx: Ctx<S>,
    /// Doorbell records of the CQs, QPs and SRQs created on this HCA.
    pub(crate) dbr: DbrPoolOf<S::DbrPages>,
    /// The next `mkey_7_0` variant byte.
    pub(crate) mkey_variant: u8,
    clock_us: Cell<u64>,
    state: HcaState,
    enabled: bool,
    initialized: bool,
    pub(crate) uar: Option<u32>,
    /// The QPs' BlueFlame registers: the bring-up page's, then pages allocated as QPs need them.
    pub(crate) bfregs: crate::uar::BfregPool,
    /// The interface step-sequence ID agreed on (0 or 1).
    issi: u16,
    /// Device-visible buffers whose owner object may still exist in firmware (a CREATE that got no answer, a
    /// DESTROY that failed): freed once the function is disabled or dead, never before.
    orphans: [Option<DmaRegion>; 8],
    /// Which RoCE GID entries this driver programmed as RoCE v2, one bit per index (the type Linux's GID cache
    /// keeps, so a modify picks the UDP source port without asking firmware).
    roce_v2_gids: [u64; 4],
    /// The port's Q counter set (`counter_set_id` of every QP), when the device has counter sets.
    pub(crate) q_counter: Option<u8>,
    pub(crate) caps: DeviceCaps,
    fw_rev: (u16, u16, u16),
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> core::fmt::Debug for Hca<M, D, T, S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Hca")
            .field("state", &self.state)
            .field("fw_rev", &self.fw_rev)
            .field("uar", &self.uar)
            .field("eqn", &self.eqn())
            .field("pages", &self.ctx.pages)
            .finish_non_exhaustive()
    }
}
impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    /// The register window (for the datapath: polling CQs, ringing doorbells).
    pub fn mmio(&self) -> &M {
        self.cmdq.mmio()
    }

    /// Where the HCA stands.
    pub fn state(&self) -> HcaState {
        self.state
    }

    /// The device capabilities queried at bring-up.
    pub fn caps(&self) -> &DeviceCaps {
        &self.caps
    }

    /// Firmware version (major, minor, subminor) from the init segment.
    pub fn fw_rev(&self) -> (u16, u16, u16) {
        self.fw_rev
    }

    /// The port's Q counter set (`counter_set_id` of every QP; ALLOC_Q_COUNTER at bring-up), when the device has
    /// counter sets.
    pub fn q_counter(&self) -> Option<u8> {
        self.q_counter
    }

    /// The interface step-sequence ID in use (1 unless firmware only knows 0).
    pub fn issi(&self) -> u16 {
        self.issi
    }

    /// The UAR index allocated at bring-up.
    pub fn uar(&self) -> Option<u32> {
        self.uar
    }

    /// The async EQ's number, once created.
    pub fn eqn(&self) -> Option<u8> {
        self.ctx.eqs.async_eq.as_ref().map(|r| r.eqn())
    }

    /// The command EQ's number (`MLX5_EVENT_TYPE_CMD` only), once created.
    pub fn cmd_eqn(&self) -> Option<u8> {
        self.ctx.eqs.cmd.as_ref().map(|r| r.eqn())
    }

    /// The pages EQ's number (`MLX5_EVENT_TYPE_PAGE_REQUEST` only), once created.
    pub fn pages_eqn(&self) -> Option<u8> {
        self.ctx.eqs.pages.as_ref().map(|r| r.eqn())
    }

    /// The event mask the async EQ was created with.
    pub fn async_event_mask(&self) -> [u64; 4] {
        crate::eq::async_event_mask(&self.ctx.event_caps)
    }

    /// Completion vectors a CQ may name in [`CqAttr::comp_vector`] (`ibv_context.num_comp_vectors`).
    pub fn num_comp_vectors(&self) -> u16 {
        self.ctx.eqs.num_comp
    }

    /// The completion EQ of `vector`, once a CQ on that vector created it.
    pub fn comp_eqn_of(&self, vector: u16) -> Option<u8> {
        self.ctx.eqs.comp.get(usize::from(vector))?.as_ref().map(|r| r.eqn())
    }

    /// Firmware page accounting.
    pub fn page_stats(&self) -> PageStats {
        self.ctx.stats
    }

    /// Pages firmware holds right now.
    pub fn pages_given(&self) -> usize {
        self.ctx.pages.given()
    }

    /// Counts of the events seen.
    pub fn events(&self) -> EventCounts {
        self.ctx.events
    }

    /// Time the driver has spent waiting on this device, in microseconds.
    pub fn waited_us(&self) -> u64 {
        self.clock_us.get()
    }

    /// The command queue itself, for callers that drive commands directly (no internal-error check, no EQ
    /// draining while they wait).
    pub fn cmdq(&mut self) -> &mut CmdQueue<M, D, T> {
        &mut self.cmdq
    }
}

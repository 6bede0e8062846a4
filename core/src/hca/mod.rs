//! HCA bring-up and teardown in Linux's order, firmware page requests, the async EQ and health (Linux `main.c`
//! `mlx5_function_enable` / `mlx5_function_open` / `mlx5_load`, `pagealloc.c`, `eq.c`, `health.c`).
//!
//! [`Hca::bring_up`] takes a function from reset to a usable HCA with one async EQ; [`Hca::teardown`] undoes it
//! and returns every firmware page and every DMA allocation. While a command waits, the waiting loop drains the EQ
//! and answers page requests on the reserved last command slot (a physical function's slot-0 command cannot
//! finish until its page request is served), and polls health every [`HEALTH_POLL_INTERVAL_MS`] of waiting.
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
mod events;
mod objects;
mod wait;

pub use error::{BringupError, Error, Step};
pub use events::AsyncEvent;
pub use objects::{
    gid_table, link_local_gid, mac_to_eui64, poll_cq_with, CqAttr, DestroyError, GidType, Pd, PortAttr, QpInitAttr,
    MR_MAX_PAGE_SHIFT,
};
pub use wait::done_in_internal_error;

use core::cell::Cell;

use crate::caps::DeviceCaps;
use crate::cmdq::CmdQueue;
use crate::dbr::DbrPool;
use crate::eq::EqRing;
use crate::hal::{Dma, DmaRegion, Mmio};
use crate::health::{HealthFailure, HEALTH_POLL_INTERVAL_MS};
use crate::pages::FwPages;
use crate::prm::{consts, EventType};
use crate::trace::CmdTrace;

use events::{AsyncEvents, CqEvents};
use wait::Watch;

/// Doorbell-record pages an HCA can hold (each holds 64 records with 64-byte cache lines, 32 with 128).
pub const DBR_PAGES: usize = 64;

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
    /// Usable entries in the async EQ; the ring gets `MLX5_NUM_SPARE_EQE` more, rounded up to a power of two.
    pub async_eq_nent: u32,
    /// Usable entries in the completion EQ (`MLX5_COMP_EQ_SIZE`).
    pub comp_eq_nent: u32,
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
            async_eq_nent: 256,
            comp_eq_nent: consts::MLX5_COMP_EQ_SIZE,
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

/// The event types the async EQ subscribes to (Linux's async mask, less the path-migration, SRQ and DCT events
/// of objects this driver never creates).
pub const ASYNC_EVENTS: [EventType; 8] = [
    EventType::PageRequest,
    EventType::Cmd,
    EventType::PortChange,
    EventType::CqError,
    EventType::WqCatasError,
    EventType::WqInvalReqError,
    EventType::WqAccessError,
    EventType::InternalError,
];

/// The async EQ and its buffer.
#[derive(Debug)]
struct AsyncEq {
    ring: EqRing,
}

/// Everything besides the command queue, so a waiting command (which borrows the queue) can still reach it.
/// Its methods take a delay that already counts waiting time into the `clock` cell (a [`Clock`]).
pub(crate) struct Ctx<const P: usize, const NCQ: usize> {
    cfg: Config,
    pages: FwPages<P>,
    watch: Watch,
    eq: Option<AsyncEq>,
    /// The completion EQ, created with the first CQ (as Linux 6.12 creates completion EQs on first use).
    pub(crate) comp_eq: Option<EqRing>,
    /// Completion-event bookkeeping of every CQ (arm sequence numbers, events not yet taken or acknowledged).
    pub(crate) cqs: CqEvents<NCQ>,
    pub(crate) async_events: AsyncEvents,
    stats: PageStats,
    pub(crate) events: EventCounts,
}

/// An mlx5 function brought up to a usable HCA.
///
/// Call [`Hca::teardown`] when done: dropping an `Hca` that is still up leaks the EQ buffer and the firmware
/// pages (the device may still write them) rather than freeing them under it.
pub struct Hca<M: Mmio, D: Dma, T: CmdTrace = (), const P: usize = 256, const NCQ: usize = 256> {
    pub(crate) cmdq: CmdQueue<M, D, T>,
    pub(crate) ctx: Ctx<P, NCQ>,
    /// Doorbell records of the CQs (and later QPs) created on this HCA.
    pub(crate) dbr: DbrPool<DBR_PAGES>,
    /// The next `mkey_7_0` variant byte.
    pub(crate) mkey_variant: u8,
    clock_us: Cell<u64>,
    state: HcaState,
    enabled: bool,
    initialized: bool,
    pub(crate) uar: Option<u32>,
    /// The interface step-sequence ID agreed on (0 or 1).
    issi: u16,
    /// Device-visible buffers whose owner object may still exist in firmware (a CREATE that got no answer, a
    /// DESTROY that failed): freed once the function is disabled or dead, never before.
    orphans: [Option<DmaRegion>; 8],
    /// Which RoCE GID entries this driver programmed as RoCE v2, one bit per index (the type Linux's GID cache
    /// keeps, so a modify picks the UDP source port without asking firmware).
    roce_v2_gids: [u64; 4],
    pub(crate) caps: DeviceCaps,
    fw_rev: (u16, u16, u16),
}

impl<M: Mmio, D: Dma, T: CmdTrace, const P: usize, const NCQ: usize> core::fmt::Debug for Hca<M, D, T, P, NCQ> {
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
impl<M: Mmio, D: Dma, T: CmdTrace, const P: usize, const NCQ: usize> Hca<M, D, T, P, NCQ> {
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
        self.ctx.eq.as_ref().map(|e| e.ring.eqn())
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

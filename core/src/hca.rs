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

use core::cell::Cell;

use crate::caps::{DeviceCaps, GeneralCaps};
use crate::cmd::Simple;
use crate::cmdq::{iseg_timeout_ms, CmdError, CmdQueue, Command, SlotKind};
use crate::dbr::DbrPool;
use crate::eq::{destroy_eq, event_bitmask, log_eq_size, CreateEq, EqContext, EqError, EqRing, Event};
use crate::hal::{DelayNs, Dma, DmaError, DmaRegion, Mmio};
use crate::health::{Health, HealthFailure, HEALTH_POLL_INTERVAL_MS};
use crate::init::{
    disable_hca, enable_hca, init_hca, set_issi, teardown_hca, CapBlock, CapMode, CapType, QueryHcaCap, QueryIssi,
    SetDriverVersion, SetHcaCap,
};
use crate::pages::{
    FwPages, ManagePagesGive, ManagePagesTake, PageStage, PagesError, QueryPages, Reclaim, RECLAIM_BATCH,
};
use crate::prm::{c, consts, ifc, EventType, MsgBuf, Opcode};
use crate::trace::CmdTrace;
use crate::uar::{alloc_uar, dealloc_uar};
use crate::verbs::{AsyncEvent, AsyncEvents, CqEvents};

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
    pub pre_init_timeout_ms: u32,
    pub health_poll_interval_ms: u32,
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
        }
    }
}

/// A bring-up step, named as Linux logs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Step {
    PreInitializing,
    CmdqInit,
    Initializing,
    EnableHca,
    SetIssi,
    BootPages,
    HcaCtrl,
    SetHcaCaps,
    InitPages,
    InitHca,
    DriverVersion,
    QueryCaps,
    AllocUar,
    CreateEq,
    RegularPages,
}

impl core::fmt::Display for Step {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Step::PreInitializing => "wait for firmware (pre-initializing)",
            Step::CmdqInit => "command queue init",
            Step::Initializing => "wait for firmware (initializing)",
            Step::EnableHca => "enable hca",
            Step::SetIssi => "set issi",
            Step::BootPages => "boot pages",
            Step::HcaCtrl => "set hca ctrl",
            Step::SetHcaCaps => "set hca caps",
            Step::InitPages => "init pages",
            Step::InitHca => "init hca",
            Step::DriverVersion => "set driver version",
            Step::QueryCaps => "query hca caps",
            Step::AllocUar => "alloc uar",
            Step::CreateEq => "create async eq",
            Step::RegularPages => "regular pages",
        })
    }
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Error {
    Cmd(CmdError),
    Dma(DmaError),
    Pages(PagesError),
    Eq(EqError),
    /// `initializing` stayed set.
    FwInitTimeout {
        state: &'static str,
        waited_ms: u32,
    },
    /// Health failed just now; the HCA moved to internal error.
    Health(HealthFailure),
    /// The HCA is in internal error (since `cause`); the command was not sent.
    InternalError {
        cause: HealthFailure,
        opcode: Opcode,
    },
    /// Firmware supports neither ISSI 1 nor ISSI 0.
    NoIssi {
        supported: u32,
    },
    /// Firmware kept pages after teardown asked for all of them.
    PagesNotReturned {
        pages: usize,
    },
    Dbr(crate::dbr::DbrError),
    /// A size outside what the device supports (checked before any command is sent).
    BadSize {
        what: &'static str,
        requested: u64,
        max: u64,
    },
    /// The device lacks the capability this needs.
    NotSupported {
        what: &'static str,
    },
    /// The completion-event table is full (the `C` parameter of [`Hca`]).
    TooManyCqs {
        max: usize,
    },
    /// A CQ this HCA does not know.
    UnknownCq {
        cqn: u32,
    },
    /// Completion events taken and not acknowledged.
    UnackedEvents {
        cqn: u32,
        unacked: u32,
    },
    /// Memory registration of a range that is not inside one region of the DMA allocator.
    NotDmaMemory {
        addr: usize,
        len: usize,
    },
    /// The virtual and bus addresses of a memory region differ within 4 KiB, so no page size maps it.
    NoPageSize {
        addr: usize,
        iova: u64,
    },
    /// Remote write or atomic access without local write (`ib_check_mr_access`).
    BadAccess {
        access: u32,
    },
    /// After MODIFY_CQ(resize) the old ring held no resize CQE.
    ResizeCqeMissing {
        cqn: u32,
    },
    /// The requested QP capabilities exceed the device's.
    QpSize(crate::qp::SizeError),
    /// A QP state transition refused before any command was sent.
    Modify(crate::qp::ModifyError),
}

impl From<CmdError> for Error {
    fn from(e: CmdError) -> Self {
        Error::Cmd(e)
    }
}
impl From<DmaError> for Error {
    fn from(e: DmaError) -> Self {
        Error::Dma(e)
    }
}
impl From<PagesError> for Error {
    fn from(e: PagesError) -> Self {
        Error::Pages(e)
    }
}
impl From<EqError> for Error {
    fn from(e: EqError) -> Self {
        Error::Eq(e)
    }
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::Cmd(e) => write!(f, "{e}"),
            Error::Dma(e) => write!(f, "DMA allocation failed: {e}"),
            Error::Pages(e) => write!(f, "{e}"),
            Error::Eq(e) => write!(f, "bad event queue: {e:?}"),
            Error::FwInitTimeout { state, waited_ms } => {
                write!(f, "firmware over {waited_ms} ms in {state} state, aborting")
            }
            Error::Health(h) => write!(f, "device health failure: {h}"),
            Error::InternalError { cause, opcode } => write!(
                f,
                "device is in internal error ({cause}); {} not sent",
                crate::prm::Named(opcode.name(), opcode.raw().into())
            ),
            Error::NoIssi { supported } => write!(f, "firmware supports neither ISSI 1 nor 0 (mask 0x{supported:x})"),
            Error::PagesNotReturned { pages } => write!(f, "firmware did not return {pages} pages"),
            Error::Dbr(e) => write!(f, "{e}"),
            Error::BadSize { what, requested, max } => write!(f, "{what} {requested} out of range (max {max})"),
            Error::NotSupported { what } => write!(f, "not supported by the device: {what}"),
            Error::TooManyCqs { max } => write!(f, "too many CQs for the event table ({max})"),
            Error::UnknownCq { cqn } => write!(f, "CQ {cqn:#x} does not belong to this HCA"),
            Error::UnackedEvents { cqn, unacked } => {
                write!(f, "CQ {cqn:#x} has {unacked} completion events not acknowledged")
            }
            Error::NotDmaMemory { addr, len } => {
                write!(f, "{len} bytes at {addr:#x} are not inside one DMA region; the device cannot reach them")
            }
            Error::NoPageSize { addr, iova } => {
                write!(f, "address {addr:#x} and bus address {iova:#x} differ within a 4 KiB page; cannot register")
            }
            Error::BadAccess { access } => {
                write!(f, "access flags {access:#x}: remote write or atomic needs local write")
            }
            Error::ResizeCqeMissing { cqn } => write!(f, "CQ {cqn:#x} resized but the resize CQE never appeared"),
            Error::QpSize(e) => write!(f, "QP capabilities not available: {e:?}"),
            Error::Modify(e) => write!(f, "{e}"),
        }
    }
}

impl core::error::Error for Error {}

/// A failed bring-up: the step, the cause, and whether the cleanup that followed was itself clean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BringupError {
    pub step: Step,
    pub error: Error,
    /// The first error the cleanup met (it carried on regardless, and returned all memory it could).
    pub cleanup: Option<Error>,
}

impl core::fmt::Display for BringupError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "bring-up failed at {}: {}", self.step, self.error)?;
        if let Some(c) = &self.cleanup {
            write!(f, " (cleanup: {c})")?;
        }
        Ok(())
    }
}

impl core::error::Error for BringupError {}

/// Where the HCA stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum HcaState {
    Up,
    /// `MLX5_DEVICE_STATE_INTERNAL_ERROR`.
    InternalError(HealthFailure),
}

/// Firmware page accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageStats {
    pub boot: usize,
    pub init: usize,
    /// Pages given in answer to page-request events.
    pub requested: usize,
    pub given: usize,
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
    pub command: u32,
    pub page_request: u32,
    pub port_change: u32,
    pub cq_error: u32,
    /// Affiliated QP errors (catastrophic, invalid request, access).
    pub qp_error: u32,
    pub internal_error: u32,
    pub completion: u32,
    /// Completion events for a CQ number the driver does not have.
    pub bogus_completion: u32,
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
    pub pages_reclaimed: usize,
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

/// Drain passes per call: each pass after the first only exists because serving page requests produced events.
const MAX_DRAIN_PASSES: usize = 8;

/// A delay that also counts the time it waited (the health timer runs on it).
struct Clock<'a, D: DelayNs + ?Sized> {
    inner: &'a mut D,
    us: &'a Cell<u64>,
}

impl<D: DelayNs + ?Sized> DelayNs for Clock<'_, D> {
    fn delay_ns(&mut self, ns: u32) {
        self.inner.delay_ns(ns);
        self.us.set(self.us.get() + u64::from(ns / 1000));
    }
    fn delay_us(&mut self, us: u32) {
        self.inner.delay_us(us);
        self.us.set(self.us.get() + u64::from(us));
    }
    fn delay_ms(&mut self, ms: u32) {
        self.inner.delay_ms(ms);
        self.us.set(self.us.get() + u64::from(ms) * 1000);
    }
}

/// The health timer, driven by the time spent waiting.
#[derive(Debug)]
struct Watch {
    health: Health,
    last_poll_us: u64,
    interval_us: u64,
    failure: Option<HealthFailure>,
}

impl Watch {
    /// One check between polls of a waiting command: a health tick when one is due.
    fn tick<M: Mmio + ?Sized>(&mut self, mmio: &M, now_us: u64, opcode: Opcode) -> Result<(), CmdError> {
        if self.failure.is_some() {
            return Err(CmdError::DeviceDown { opcode });
        }
        if now_us.saturating_sub(self.last_poll_us) < self.interval_us {
            return Ok(());
        }
        self.last_poll_us = now_us;
        match self.health.poll(mmio) {
            Ok(()) => Ok(()),
            Err(f) => {
                self.failure = Some(f);
                Err(CmdError::DeviceDown { opcode })
            }
        }
    }
}

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

/// Waits for `initializing` (bit 31 at 0x1fc) to clear (`wait_fw_init`). All-ones reads mean the device is gone.
fn wait_fw_init<M: Mmio + ?Sized>(
    mmio: &M,
    delay: &mut impl DelayNs,
    timeout_ms: u32,
    state: &'static str,
) -> Result<(), Error> {
    let reg = c::mlx5_init_seg::INITIALIZING.off;
    let bit = 32 - ifc::initial_seg::INITIALIZING.width - (ifc::initial_seg::INITIALIZING.off % 32);
    let mut waited = 0u32;
    loop {
        let v = mmio.read32(reg);
        if v == u32::MAX && mmio.read32(c::mlx5_init_seg::FW_REV.off) == u32::MAX {
            return Err(Error::Health(HealthFailure::DeviceGone));
        }
        if (v >> bit) & 1 == 0 {
            return Ok(());
        }
        if waited >= timeout_ms {
            return Err(Error::FwInitTimeout { state, waited_ms: waited });
        }
        delay.delay_ms(FW_PRE_INIT_WAIT_MS);
        waited += FW_PRE_INIT_WAIT_MS;
    }
}

/// The ops Linux completes locally in internal-error state (`mlx5_internal_err_ret_value`): undoing something is
/// done once the device is dead.
pub fn done_in_internal_error(op: Opcode) -> bool {
    matches!(
        op,
        Opcode::TeardownHca
            | Opcode::DisableHca
            | Opcode::ManagePages
            | Opcode::DestroyMkey
            | Opcode::DestroyEq
            | Opcode::DestroyCq
            | Opcode::DestroyQp
            | Opcode::DestroyPsv
            | Opcode::DestroySrq
            | Opcode::DestroyXrcSrq
            | Opcode::DestroyXrq
            | Opcode::DestroyDct
            | Opcode::DeallocQCounter
            | Opcode::DeallocPd
            | Opcode::DeallocUar
            | Opcode::DetachFromMcg
            | Opcode::DeallocXrcd
            | Opcode::DeallocTransportDomain
            | Opcode::DestroyTir
            | Opcode::DestroyTis
            | Opcode::DestroyRq
            | Opcode::DestroySq
            | Opcode::DestroyRqt
            | Opcode::DestroyRmp
            | Opcode::X2errQp
            | Opcode::X2rstQp
    )
}

/// Picks a free slot for `kind`: the last slot for pages (or any free regular slot if a timed-out page command
/// still holds it), otherwise the first free regular slot (slot 0 unless a timed-out command holds it).
fn pick_slot<M: Mmio, D: Dma, T: CmdTrace>(q: &CmdQueue<M, D, T>, kind: SlotKind) -> u8 {
    let last = q.slot(SlotKind::Pages);
    if kind == SlotKind::Pages && q.slot_free(last) {
        return last;
    }
    (0..last).find(|&s| q.slot_free(s)).unwrap_or(q.slot(kind))
}

impl<const P: usize, const NCQ: usize> Ctx<P, NCQ> {
    /// Between polls of a waiting command on the regular slot: health, then the EQ (page requests are answered
    /// right here, on the pages slot).
    fn on_wait<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        opcode: Opcode,
    ) -> Result<(), CmdError> {
        self.watch.tick(q.mmio(), clock.get(), opcode)?;
        match self.drain(q, d, clock) {
            // Firmware answered a page command and refused it: not the waiting command's failure, which must not
            // be reported as firmware's answer to it (a CREATE's buffer would be freed while firmware may still
            // create the object). Linux's page worker drops the request the same way; the command keeps waiting.
            Err(CmdError::Status { .. } | CmdError::Delivery { .. } | CmdError::BadSignature { .. }) => Ok(()),
            r => r,
        }
    }

    /// Drains the EQ: counts events, serves page requests, re-arms. Serving a request runs commands whose own
    /// completion events land in the EQ, so the drain repeats until a pass finds no request (bounded). Errors
    /// from serving a page request abort.
    fn drain<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
    ) -> Result<(), CmdError> {
        for _ in 0..MAX_DRAIN_PASSES {
            let mut requests: [Option<(u16, i32)>; 8] = [None; 8];
            if !self.drain_pass(q, &mut requests) {
                return Ok(());
            }
            for (func, num) in requests.into_iter().flatten() {
                self.serve_page_request(q, d, clock, func, num)?;
            }
        }
        Ok(())
    }

    /// One pass over the EQs (async, then completion): counts events, records completion and CQ-error events,
    /// and collects page requests; re-arms an EQ when it consumed anything. Returns whether there are page
    /// requests to serve. Bounded by the ring sizes, so a device that keeps writing cannot trap the driver here.
    fn drain_pass<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        requests: &mut [Option<(u16, i32)>; 8],
    ) -> bool {
        let mut sink = EventSink {
            events: &mut self.events,
            stats: &mut self.stats,
            cqs: &mut self.cqs,
            async_events: &mut self.async_events,
            requests,
            nreq: 0,
        };
        if let Some(eq) = self.eq.as_mut() {
            sink.drain_ring(&mut eq.ring, q.mmio());
        }
        if let Some(ring) = self.comp_eq.as_mut() {
            sink.drain_ring(ring, q.mmio());
        }
        sink.nreq > 0
    }

    /// Answers one page request (`pages_work_handler`): give `num` pages, or take `-num` back.
    fn serve_page_request<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        function_id: u16,
        num: i32,
    ) -> Result<(), CmdError> {
        if num > 0 {
            let n = num as usize;
            match self.give(q, d, clock, function_id, n) {
                Ok(()) => {
                    self.stats.requested += n;
                    Ok(())
                }
                Err(GiveError::Cmd(e)) => Err(e),
                Err(GiveError::Pool(_)) => {
                    // `page_notify_fail`: tell firmware it will not get the pages, so it fails the command
                    // that needed them instead of waiting forever.
                    self.stats.cant_give += 1;
                    let mut cmd = Simple::new(
                        Opcode::ManagePages,
                        ifc::manage_pages_in::SIZE_BYTES,
                        ifc::manage_pages_out::SIZE_BYTES,
                    )
                    .op_mod(consts::MLX5_PAGES_CANT_GIVE as u16)
                    .arg(ifc::manage_pages_in::FUNCTION_ID, function_id.into());
                    self.exec_pages_cmd(q, d, clock, &mut cmd).map(|_| ())
                }
            }
        } else if num < 0 {
            let want = (num.unsigned_abs() as usize).min(self.pages.given());
            if want == 0 {
                return Ok(());
            }
            self.take(q, d, clock, function_id, want).map(|_| ())
        } else {
            Ok(())
        }
    }

    /// Runs a page command on the pages slot; its wait only ticks health (no EQ draining inside).
    fn exec_pages_cmd<M: Mmio, D: Dma, T: CmdTrace, C: Command>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        cmd: &mut C,
    ) -> Result<C::Output, CmdError> {
        let slot = pick_slot(q, SlotKind::Pages);
        let opcode = cmd.opcode();
        let watch = &mut self.watch;
        // `d` already counts waiting time (the caller wrapped it in a `Clock`).
        q.exec_on(slot, cmd, &mut &mut *d, &mut |q, _| watch.tick(q.mmio(), clock.get(), opcode))
    }

    /// MANAGE_PAGES give of `n` fresh pages (`give_pages`).
    fn give<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        function_id: u16,
        n: usize,
    ) -> Result<(), GiveError> {
        self.pages.reserve(q.dma(), n).map_err(GiveError::Pool)?;
        let slot = pick_slot(q, SlotKind::Pages);
        let watch = &mut self.watch;
        let mut cmd = ManagePagesGive { function_id, pages: self.pages.pending_pages() };
        let r =
            q.exec_on(slot, &mut cmd, &mut &mut *d, &mut |q, _| watch.tick(q.mmio(), clock.get(), Opcode::ManagePages));
        match r {
            Ok(()) => {
                self.pages.commit();
                self.stats.given += n;
                Ok(())
            }
            Err(e @ CmdError::Status { .. })
            | Err(e @ CmdError::Delivery { .. })
            | Err(e @ CmdError::BadSignature { .. }) => {
                // Firmware answered and refused: it holds none of the pages.
                self.pages.cancel(q.dma());
                Err(GiveError::Cmd(e))
            }
            Err(e) => {
                // No answer (timeout, device down): firmware may hold the pages; keep them as given so they are
                // never freed while the device could write them. Teardown settles them.
                self.pages.commit();
                Err(GiveError::Cmd(e))
            }
        }
    }

    /// One MANAGE_PAGES take of up to `want` pages (`reclaim_pages`); returns how many came back.
    fn take<M: Mmio, D: Dma, T: CmdTrace>(
        &mut self,
        q: &mut CmdQueue<M, D, T>,
        d: &mut dyn DelayNs,
        clock: &Cell<u64>,
        function_id: u16,
        want: usize,
    ) -> Result<usize, CmdError> {
        let slot = pick_slot(q, SlotKind::Pages);
        let watch = &mut self.watch;
        let mut sink = Reclaim { pool: &mut self.pages, capacity: want, unknown: 0, first_unknown: None };
        let mut cmd = ManagePagesTake { function_id, pages: &mut sink };
        let r =
            q.exec_on(slot, &mut cmd, &mut &mut *d, &mut |q, _| watch.tick(q.mmio(), clock.get(), Opcode::ManagePages));
        let (unknown, first_unknown) = (sink.unknown, sink.first_unknown);
        let n = r?;
        self.pages.free_empty(q.dma());
        let got = n - unknown;
        self.stats.reclaimed += got;
        if let Some(addr) = first_unknown {
            return Err(CmdError::Malformed {
                opcode: Opcode::ManagePages,
                what: "page firmware never had",
                value: addr,
            });
        }
        Ok(got)
    }
}

/// Where one drain pass puts what the EQEs say.
struct EventSink<'a, const NCQ: usize> {
    events: &'a mut EventCounts,
    stats: &'a mut PageStats,
    cqs: &'a mut CqEvents<NCQ>,
    async_events: &'a mut AsyncEvents,
    requests: &'a mut [Option<(u16, i32)>; 8],
    nreq: usize,
}

impl<const NCQ: usize> EventSink<'_, NCQ> {
    /// Consumes the software-owned EQEs of one ring (at most one ring's worth) and re-arms it.
    fn drain_ring<M: Mmio + ?Sized>(&mut self, ring: &mut EqRing, mmio: &M) {
        let mut n = 0u32;
        for _ in 0..ring.nent() {
            let Some(eqe) = ring.next(mmio) else { break };
            n += 1;
            self.handle(eqe.event());
        }
        if n > 0 {
            ring.update_ci(mmio, true);
            self.events.arms += 1;
        }
    }

    fn handle(&mut self, event: Event) {
        let ev = &mut *self.events;
        match event {
            Event::Command { .. } => ev.command += 1,
            Event::PageRequest { function_id, num_pages, .. } => {
                ev.page_request += 1;
                self.stats.page_requests += 1;
                let requests = &mut *self.requests;
                if self.nreq < requests.len() {
                    requests[self.nreq] = Some((function_id, num_pages));
                    self.nreq += 1;
                } else if let Some((_, total)) = requests[self.nreq - 1].as_mut() {
                    // More requests than slots in one pass: fold them (same function in practice).
                    *total = total.saturating_add(num_pages);
                }
            }
            Event::PortChange { port, sub_type } => {
                ev.port_change += 1;
                ev.last_port_change = Some((port, sub_type));
                self.async_events.push(AsyncEvent::PortChange { port, sub_type });
            }
            Event::CqError { cqn, syndrome } => {
                ev.cq_error += 1;
                ev.last_cq_error = Some((cqn, syndrome));
                self.cqs.on_error(cqn, syndrome);
                self.async_events.push(AsyncEvent::CqError { cqn, syndrome });
            }
            Event::InternalError => {
                ev.internal_error += 1;
                self.async_events.push(AsyncEvent::DeviceFatal);
            }
            Event::QpError { qpn, kind } => {
                ev.qp_error += 1;
                self.async_events.push(AsyncEvent::QpError { qpn, kind });
            }
            Event::Completion { cqn } => {
                ev.completion += 1;
                if !self.cqs.on_completion(cqn) {
                    // `mlx5_eq_comp_int`: "Completion event for bogus CQ".
                    ev.bogus_completion += 1;
                }
            }
            Event::Other { .. } => ev.other += 1,
        }
    }
}

#[derive(Debug)]
enum GiveError {
    Pool(PagesError),
    Cmd(CmdError),
}

impl<M: Mmio, D: Dma, T: CmdTrace, const P: usize, const NCQ: usize> Hca<M, D, T, P, NCQ> {
    /// Brings the function up in Linux's order. On failure everything done so far is undone (pages reclaimed,
    /// function disabled, memory returned) before the error comes back.
    pub fn bring_up(mmio: M, dma: D, trace: T, delay: &mut impl DelayNs, cfg: Config) -> Result<Self, BringupError> {
        let fail = |step, error| BringupError { step, error, cleanup: None };
        wait_fw_init(&mmio, delay, cfg.pre_init_timeout_ms, "pre-initializing")
            .map_err(|e| fail(Step::PreInitializing, e))?;
        let fw_rev = {
            use ifc::initial_seg as s;
            let w0 = mmio.read32(c::mlx5_init_seg::FW_REV.off).to_be_bytes();
            let w1 = mmio.read32(c::mlx5_init_seg::CMDIF_REV_FW_SUB.off).to_be_bytes();
            let mut img = [0u8; 8];
            img[..4].copy_from_slice(&w0);
            img[4..].copy_from_slice(&w1);
            (img.get(s::FW_REV_MAJOR) as u16, img.get(s::FW_REV_MINOR) as u16, img.get(s::FW_REV_SUBMINOR) as u16)
        };
        let cmdq = CmdQueue::new(mmio, dma, trace).map_err(|e| fail(Step::CmdqInit, e.into()))?;
        let init_to = if cmdq.mmio().read32(c::mlx5_init_seg::CMD_Q_INIT_TO.off) != 0 {
            iseg_timeout_ms(cmdq.mmio().read32(c::mlx5_init_seg::CMD_Q_INIT_TO.off)).min(u64::from(u32::MAX)) as u32
        } else {
            FW_INIT_TIMEOUT_MS
        };
        let mut hca = Hca {
            cmdq,
            ctx: Ctx {
                cfg,
                pages: FwPages::new(),
                watch: Watch {
                    health: Health::new(),
                    last_poll_us: 0,
                    interval_us: u64::from(cfg.health_poll_interval_ms) * 1000,
                    failure: None,
                },
                eq: None,
                comp_eq: None,
                cqs: CqEvents::new(),
                async_events: AsyncEvents::new(),
                stats: PageStats::default(),
                events: EventCounts::default(),
            },
            dbr: DbrPool::new(if cfg.cache_line_128 { 128 } else { 64 }),
            mkey_variant: 0,
            clock_us: Cell::new(0),
            state: HcaState::Up,
            enabled: false,
            initialized: false,
            uar: None,
            issi: 0,
            orphans: [const { None }; 8],
            caps: DeviceCaps::default(),
            fw_rev,
        };
        let mut step = Step::Initializing;
        let r = (|| -> Result<(), Error> {
            wait_fw_init(hca.cmdq.mmio(), delay, init_to, "initializing")?;
            hca.setup(delay, &mut step)
        })();
        match r {
            Ok(()) => Ok(hca),
            Err(error) => {
                let report = hca.shutdown(delay);
                Err(BringupError { step, error, cleanup: report.first_error })
            }
        }
    }

    /// The steps after the command queue is up (`mlx5_function_enable` from ENABLE_HCA, `mlx5_function_open`,
    /// the start of `mlx5_load`).
    fn setup(&mut self, delay: &mut impl DelayNs, step: &mut Step) -> Result<(), Error> {
        let func = self.ctx.cfg.function_id;
        *step = Step::EnableHca;
        self.exec(&mut enable_hca(func), delay)?;
        self.enabled = true;

        *step = Step::SetIssi;
        match self.exec(&mut QueryIssi, delay) {
            Ok(issi) if issi.supports(1) => {
                self.exec(&mut set_issi(1), delay)?;
                self.issi = 1;
            }
            Ok(issi) if !issi.supports(0) => return Err(Error::NoIssi { supported: issi.supported }),
            Ok(_) => self.issi = 0,
            // Firmware that answers QUERY_ISSI with an error status predates it: ISSI 0 (`mlx5_core_set_issi`).
            Err(Error::Cmd(CmdError::Status { .. })) => self.issi = 0,
            Err(e) => return Err(e),
        }

        *step = Step::BootPages;
        self.ctx.stats.boot = self.startup_pages(PageStage::Boot, delay)?;

        *step = Step::HcaCtrl;
        let mut he = [0u8; crate::reg::HOST_ENDIANNESS_LEN];
        self.exec(&mut crate::reg::host_endianness(&mut he), delay)?;

        *step = Step::SetHcaCaps;
        self.set_hca_caps(delay)?;

        *step = Step::InitPages;
        self.ctx.stats.init = self.startup_pages(PageStage::Init, delay)?;

        *step = Step::InitHca;
        self.exec(&mut init_hca(), delay)?;
        self.initialized = true;

        *step = Step::DriverVersion;
        if self.caps.general.driver_version {
            let v = self.ctx.cfg.driver_version;
            // Informational only: Linux ignores a refusal (`mlx5_set_driver_version` returns nothing). A device
            // that does not answer at all still fails the bring-up.
            match self.exec(&mut SetDriverVersion { version: v }, delay) {
                Ok(()) | Err(Error::Cmd(CmdError::Status { .. })) => {}
                Err(e) => return Err(e),
            }
        }

        *step = Step::QueryCaps;
        self.query_hca_caps(delay)?;

        *step = Step::AllocUar;
        self.uar = Some(self.exec(&mut alloc_uar(), delay)?);

        *step = Step::CreateEq;
        self.create_async_eq(delay)?;

        // Firmware asks for its regular pages through the EQ as soon as it can; serve them now.
        *step = Step::RegularPages;
        self.process_events(delay)?;
        Ok(())
    }

    /// QUERY_PAGES for a stage, then MANAGE_PAGES give (`mlx5_satisfy_startup_pages`). Returns pages given.
    fn startup_pages(&mut self, stage: PageStage, delay: &mut impl DelayNs) -> Result<usize, Error> {
        let req = self.exec(&mut QueryPages { stage }, delay)?;
        if req.num_pages <= 0 {
            return Ok(0);
        }
        let n = req.num_pages as usize;
        self.check_state(Opcode::ManagePages)?;
        let mut clk = Clock { inner: delay, us: &self.clock_us };
        let r = self.ctx.give(&mut self.cmdq, &mut clk, &self.clock_us, req.function_id, n);
        match r {
            Ok(()) => Ok(n),
            Err(GiveError::Pool(e)) => Err(Error::Pages(e)),
            Err(GiveError::Cmd(e)) => Err(self.cmd_error(e)),
        }
    }

    /// Maps a command error, moving to internal error when the wait found the device unhealthy.
    pub(crate) fn cmd_error(&mut self, e: CmdError) -> Error {
        if let Some(f) = self.ctx.watch.failure {
            self.enter_internal_error(f);
            return Error::Health(f);
        }
        Error::Cmd(e)
    }

    pub(crate) fn check_state(&self, opcode: Opcode) -> Result<(), Error> {
        match self.state {
            HcaState::Up => Ok(()),
            HcaState::InternalError(cause) => Err(Error::InternalError { cause, opcode }),
        }
    }

    /// `mlx5_enter_error_state`: no command reaches the device from now on.
    fn enter_internal_error(&mut self, cause: HealthFailure) {
        if self.state == HcaState::Up {
            self.state = HcaState::InternalError(cause);
            self.ctx.watch.failure.get_or_insert(cause);
            self.cmdq.set_device_down(true);
        }
    }

    /// `set_hca_cap`: general (as `handle_hca_cap` sets it), atomic, RoCE, general 2 (ODP is not used by this
    /// driver, as in a kernel built without `CONFIG_INFINIBAND_ON_DEMAND_PAGING`).
    fn set_hca_caps(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        use ifc::cmd_hca_cap as g;
        let max = self.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, delay)?;
        let maxg = GeneralCaps::parse(&max);
        let max_of = |f| max.get(f);
        let mut set: CapBlock = self.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Current }, delay)?;
        let cur = GeneralCaps::parse(&set);
        set.set(g::PKEY_TABLE_SIZE, consts::MLX5_CMD_HCA_CAP_PKEY_TABLE_SIZE_128_ENTRIES);
        let log_max_qp = self.ctx.cfg.log_max_qp.unwrap_or(PROFILE_LOG_MAX_QP).min(maxg.log_max_qp);
        set.set(g::LOG_MAX_QP, log_max_qp.into());
        // Command signatures stay off (`cmdif_checksum` 0), as Linux runs.
        set.set(g::CMDIF_CHECKSUM, 0);
        if max_of(g::UAR_4K) != 0 && self.ctx.cfg.page_shift > 12 {
            set.set(g::UAR_4K, 1);
        }
        set.set(g::LOG_UAR_PAGE_SZ, u32::from(self.ctx.cfg.page_shift.saturating_sub(12)));
        if max_of(g::CACHE_LINE_128BYTE) != 0 {
            set.set(g::CACHE_LINE_128BYTE, self.ctx.cfg.cache_line_128.into());
        }
        for f in [g::DCT, g::PCI_SYNC_FOR_FW_UPDATE_EVENT, g::PCI_SYNC_FOR_FW_UPDATE_WITH_DRIVER_UNLOAD] {
            if max_of(f) != 0 {
                set.set(f, 1);
            }
        }
        if max_of(g::NUM_VHCA_PORTS) != 0 {
            set.set(g::NUM_VHCA_PORTS, max_of(g::NUM_VHCA_PORTS));
        }
        for f in [g::RELEASE_ALL_PAGES, g::MKEY_BY_NAME] {
            if max_of(f) != 0 {
                set.set(f, 1);
            }
        }
        // `mlx5_vhca_state_cap_handle`.
        if max_of(g::VHCA_STATE) != 0 {
            for f in [
                g::EVENT_ON_VHCA_STATE_TEARDOWN_REQUEST,
                g::EVENT_ON_VHCA_STATE_IN_USE,
                g::EVENT_ON_VHCA_STATE_ACTIVE,
                g::EVENT_ON_VHCA_STATE_ALLOCATED,
                g::EVENT_ON_VHCA_STATE_INVALID,
            ] {
                set.set(f, 1);
            }
        }
        if max_of(g::NUM_TOTAL_DYNAMIC_VF_MSIX) != 0 {
            set.set(g::NUM_TOTAL_DYNAMIC_VF_MSIX, max_of(g::NUM_TOTAL_DYNAMIC_VF_MSIX));
        }
        // RoCE on (devlink `enable_roce` defaults to true).
        if set.get(g::ROCE_RW_SUPPORTED) != 0 && maxg.roce {
            set.set(g::ROCE, 1);
        }
        self.exec(&mut SetHcaCap { cap: CapType::General, block: &set }, delay)?;
        self.caps.general = GeneralCaps::parse(&set);

        // `handle_hca_cap_atomic`: the current general caps (as queried before the set) decide.
        if cur.atomic {
            let _ = self.exec(&mut QueryHcaCap { cap: CapType::Atomic, mode: CapMode::Max }, delay)?;
            let acur = self.exec(&mut QueryHcaCap { cap: CapType::Atomic, mode: CapMode::Current }, delay)?;
            if acur.get(ifc::atomic_caps::SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1) == ATOMIC_REQ_MODE_HOST_ENDIANNESS
            {
                let mut aset = [0u8; crate::init::CAP_BYTES];
                aset.set(ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE, ATOMIC_REQ_MODE_HOST_ENDIANNESS);
                self.exec(&mut SetHcaCap { cap: CapType::Atomic, block: &aset }, delay)?;
            }
        }
        // `handle_hca_cap_roce`: turn on software-chosen RoCE source ports when the device allows it.
        if cur.roce {
            let rmax = self.exec(&mut QueryHcaCap { cap: CapType::Roce, mode: CapMode::Max }, delay)?;
            let mut rset = self.exec(&mut QueryHcaCap { cap: CapType::Roce, mode: CapMode::Current }, delay)?;
            use ifc::roce_cap as r;
            if rset.get(r::SW_R_ROCE_SRC_UDP_PORT) == 0 && rmax.get(r::SW_R_ROCE_SRC_UDP_PORT) != 0 {
                rset.set(r::SW_R_ROCE_SRC_UDP_PORT, 1);
                if rmax.get(r::QP_OOO_TRANSMIT_DEFAULT) != 0 {
                    rset.set(r::QP_OOO_TRANSMIT_DEFAULT, 1);
                }
                self.exec(&mut SetHcaCap { cap: CapType::Roce, block: &rset }, delay)?;
            }
        }
        // `handle_hca_cap_2`: read; `sw_vhca_id` is only set for devices with software vhca ids.
        if maxg.hca_cap_2 {
            self.exec(&mut QueryHcaCap { cap: CapType::General2, mode: CapMode::Max }, delay)?;
            self.exec(&mut QueryHcaCap { cap: CapType::General2, mode: CapMode::Current }, delay)?;
            // Linux then sets `sw_vhca_id` when the maximum image offers software vhca ids, a multi-function
            // feature this driver does not use (ConnectX-5 does not offer it).
        }
        Ok(())
    }

    /// `mlx5_query_hca_caps`, for the capability types this driver uses: general, general 2, Ethernet offloads,
    /// ODP, atomic, RoCE (current values), in Linux's order.
    fn query_hca_caps(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        let gen = self.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Current }, delay)?;
        let g = GeneralCaps::parse(&gen);
        self.caps.general = g;
        let cur = |cap| QueryHcaCap { cap, mode: CapMode::Current };
        if g.hca_cap_2 {
            self.exec(&mut cur(CapType::General2), delay)?;
        }
        if g.eth_net_offloads {
            self.exec(&mut cur(CapType::EthernetOffloads), delay)?;
        }
        if g.pg {
            self.exec(&mut cur(CapType::Odp), delay)?;
        }
        if g.atomic {
            let a = self.exec(&mut cur(CapType::Atomic), delay)?;
            self.caps.atomic_operations = Some(a.get(ifc::atomic_caps::ATOMIC_OPERATIONS) as u16);
            self.caps.atomic_size_qp = Some(a.get(ifc::atomic_caps::ATOMIC_SIZE_QP) as u16);
        }
        if g.roce {
            let r = self.exec(&mut cur(CapType::Roce), delay)?;
            self.caps.roce_version = Some(r.get(ifc::roce_cap::ROCE_VERSION) as u8);
            self.caps.roce_address_table_size = Some(r.get(ifc::roce_cap::ROCE_ADDRESS_TABLE_SIZE) as u16);
        }
        // Signatures follow what firmware now says.
        self.cmdq.set_checksum(g.cmdif_checksum != 0);
        Ok(())
    }

    /// One async EQ for page requests, command completions, port changes, CQ errors, the affiliated QP errors
    /// and internal errors.
    fn create_async_eq(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        let mask = event_bitmask(&ASYNC_EVENTS);
        let ring = self.create_eq_ring(self.ctx.cfg.async_eq_nent, mask, delay)?;
        self.ctx.eq = Some(AsyncEq { ring });
        Ok(())
    }

    /// The completion EQ (`create_comp_eq`): no async events, CQs name it in `c_eqn`. Created on first use.
    pub(crate) fn comp_eqn(&mut self, delay: &mut impl DelayNs) -> Result<u8, Error> {
        if let Some(r) = &self.ctx.comp_eq {
            return Ok(r.eqn());
        }
        let ring = self.create_eq_ring(self.ctx.cfg.comp_eq_nent, [0; 4], delay)?;
        let eqn = ring.eqn();
        self.ctx.comp_eq = Some(ring);
        Ok(eqn)
    }

    /// An EQ of at least `nent` usable entries on the HCA's UAR: buffer with owner bits pre-set, CREATE_EQ, then
    /// armed.
    fn create_eq_ring(&mut self, nent: u32, mask: [u64; 4], delay: &mut impl DelayNs) -> Result<EqRing, Error> {
        let uar = self.uar.unwrap_or(0);
        let log_nent = log_eq_size(nent);
        let len = EqRing::buf_len(log_nent);
        let buf = self.cmdq.dma().alloc(len, crate::pages::FW_PAGE_SIZE)?;
        buf.zero(0, len);
        if let Err(e) = EqRing::init_buf(&buf, log_nent) {
            // SAFETY: allocated just above and never shown to the device.
            unsafe { self.cmdq.dma().free(buf) };
            return Err(e.into());
        }
        let npages = len / crate::pages::FW_PAGE_SIZE;
        let mut cmd = CreateEq {
            ctx: EqContext { log_eq_size: log_nent, uar_page: uar, intr: 0, log_page_size: 0, page_offset: 0 },
            event_bitmask: mask,
            pas: crate::cmd::Pas::Contiguous { base: buf.iova(), count: npages },
        };
        match self.exec(&mut cmd, delay) {
            Ok(eqn) => {
                let uar_off = uar as usize * crate::pages::FW_PAGE_SIZE;
                let mut ring = EqRing::new(buf, log_nent, eqn, uar_off);
                ring.update_ci(self.cmdq.mmio(), true);
                self.ctx.events.arms += 1;
                Ok(ring)
            }
            Err(e) => {
                self.release_unless_held(buf, &e);
                Err(e)
            }
        }
    }

    /// After a CREATE failed: frees `buf` when firmware answered with a status (it never used the buffer),
    /// otherwise keeps it until the function is disabled (firmware may have created the object and may write it).
    pub(crate) fn release_unless_held(&mut self, buf: DmaRegion, e: &Error) {
        if matches!(e, Error::Cmd(CmdError::Status { .. })) {
            // SAFETY: CREATE failed with a status, so the device holds no reference to the buffer.
            unsafe { self.cmdq.dma().free(buf) };
        } else {
            self.orphan(buf);
        }
    }

    /// Runs a command on the first free regular slot, draining the EQ (and answering page requests on the pages
    /// slot) and polling health while it waits. In internal-error state nothing is sent.
    pub fn exec<C: Command>(&mut self, cmd: &mut C, delay: &mut impl DelayNs) -> Result<C::Output, Error> {
        let opcode = cmd.opcode();
        self.check_state(opcode)?;
        let kind = if opcode == Opcode::ManagePages { SlotKind::Pages } else { SlotKind::Regular };
        let slot = pick_slot(&self.cmdq, kind);
        let ctx = &mut self.ctx;
        let clock = &self.clock_us;
        let mut clk = Clock { inner: delay, us: clock };
        let r = self.cmdq.exec_on(slot, cmd, &mut clk, &mut |q, d| ctx.on_wait(q, d, clock, opcode));
        match r {
            Ok(out) => {
                // Events that arrived with the completion (its own command EQE, page requests) are served now.
                // The command itself completed: a failure serving them is not its failure (the caller would give
                // up an object firmware created or destroyed). A health failure still moves the HCA to internal
                // error, which the next command reports.
                let mut clk = Clock { inner: delay, us: clock };
                let ctx = &mut self.ctx;
                if let Err(e) = ctx.drain(&mut self.cmdq, &mut clk, clock) {
                    let _ = self.cmd_error(e);
                }
                Ok(out)
            }
            Err(e) => Err(self.cmd_error(e)),
        }
    }

    /// Runs a destroy-type command; in internal-error state it is treated as done without reaching the device
    /// (`mlx5_internal_err_ret_value`), so cleanup can proceed on a dead device.
    pub fn exec_destroy(&mut self, mut cmd: Simple, delay: &mut impl DelayNs) -> Result<(), Error> {
        if let HcaState::InternalError(_) = self.state {
            if done_in_internal_error(cmd.opcode) {
                return Ok(());
            }
        }
        self.exec(&mut cmd, delay).map(|_| ())
    }

    /// Drains the async EQ, answers page requests, re-arms. Returns EQEs consumed so far in total.
    pub fn process_events(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        self.check_state(Opcode::ManagePages)?;
        let clock = &self.clock_us;
        let mut clk = Clock { inner: delay, us: clock };
        let ctx = &mut self.ctx;
        ctx.drain(&mut self.cmdq, &mut clk, clock).map_err(|e| self.cmd_error(e))
    }

    /// One tick of the health timer (call it every [`HEALTH_POLL_INTERVAL_MS`]). A failure moves the HCA to
    /// internal error and is returned.
    pub fn poll_health(&mut self) -> Result<(), Error> {
        if let HcaState::InternalError(f) = self.state {
            return Err(Error::Health(f));
        }
        match self.ctx.watch.health.poll(self.cmdq.mmio()) {
            Ok(()) => Ok(()),
            Err(f) => {
                self.enter_internal_error(f);
                Err(Error::Health(f))
            }
        }
    }

    /// The register window (for the datapath: polling CQs, ringing doorbells).
    pub fn mmio(&self) -> &M {
        self.cmdq.mmio()
    }

    pub fn state(&self) -> HcaState {
        self.state
    }

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

    pub fn eqn(&self) -> Option<u8> {
        self.ctx.eq.as_ref().map(|e| e.ring.eqn())
    }

    pub fn page_stats(&self) -> PageStats {
        self.ctx.stats
    }

    /// Pages firmware holds right now.
    pub fn pages_given(&self) -> usize {
        self.ctx.pages.given()
    }

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

    /// Tears the HCA down (`mlx5_unload` + `mlx5_function_teardown`): DESTROY_EQ, DEALLOC_UAR, TEARDOWN_HCA,
    /// MANAGE_PAGES take until firmware has returned every page, DISABLE_HCA; every DMA allocation goes back.
    pub fn teardown(mut self, delay: &mut impl DelayNs) -> Result<TeardownReport, Error> {
        let report = self.shutdown(delay);
        match report.first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// The teardown steps, each attempted whatever happened before (a failure is remembered, not returned early).
    /// A command that gets no answer does not stop the rest: its slot stays taken and the next command uses
    /// another one, so a firmware that hangs on one opcode is still disabled properly. Only when DISABLE_HCA itself
    /// gets no answer does the driver give up on the firmware and finish locally.
    fn shutdown(&mut self, delay: &mut impl DelayNs) -> TeardownReport {
        let mut rep = TeardownReport::default();
        let note = |rep: &mut TeardownReport, e: Error| {
            rep.first_error.get_or_insert(e);
        };
        if let Some(ring) = self.ctx.comp_eq.take() {
            match self.exec_destroy(destroy_eq(ring.eqn()), delay) {
                Ok(()) => {
                    // SAFETY: the EQ is destroyed (or the device is dead), so the device no longer writes it.
                    unsafe { self.cmdq.dma().free(ring.into_buf()) };
                }
                Err(e) => {
                    // CQs left alive still point at it: its buffer waits for DISABLE_HCA.
                    note(&mut rep, e);
                    self.orphan(ring.into_buf());
                }
            }
        }
        if let Some(eq) = self.ctx.eq.take() {
            match self.exec_destroy(destroy_eq(eq.ring.eqn()), delay) {
                Ok(()) => {
                    // SAFETY: the EQ is destroyed (or the device is dead), so the device no longer writes it.
                    unsafe { self.cmdq.dma().free(eq.ring.into_buf()) };
                }
                Err(e) => {
                    note(&mut rep, e);
                    // The EQ may still be live: its buffer waits for DISABLE_HCA (or the dead device).
                    self.orphan(eq.ring.into_buf());
                }
            }
        }
        if let Some(uar) = self.uar.take() {
            if let Err(e) = self.exec_destroy(dealloc_uar(uar), delay) {
                note(&mut rep, e);
            }
        }
        if self.initialized {
            match self.exec_destroy(teardown_hca(), delay) {
                Ok(()) => self.initialized = false,
                Err(e) => note(&mut rep, e),
            }
        }
        self.reclaim_all(delay, &mut rep);
        if self.enabled {
            match self.exec_destroy(disable_hca(self.ctx.cfg.function_id), delay) {
                Ok(()) => self.enabled = false,
                Err(e) => {
                    note(&mut rep, e);
                    if let Error::Cmd(CmdError::Timeout { .. }) = e {
                        self.enter_internal_error(HealthFailure::Unresponsive);
                    }
                }
            }
        }
        let dead = matches!(self.state, HcaState::InternalError(_));
        // Disabling the function (or its death) releases everything firmware held: pages it did not hand back,
        // objects whose destroy failed, the command queue.
        let released = !self.enabled || dead;
        if released && (self.ctx.pages.given() > 0 || self.ctx.pages.chunks() > 0) {
            let held = self.ctx.pages.abandon_all(self.cmdq.dma());
            self.ctx.stats.abandoned += held;
            rep.pages_abandoned += held;
            if held > 0 && !dead {
                note(&mut rep, Error::PagesNotReturned { pages: held });
            }
        }
        for slot in self.orphans.iter_mut() {
            if let Some(buf) = slot.take_if(|_| released) {
                // SAFETY: the function is disabled (DISABLE_HCA completed, or it was never enabled) or the device is
                // dead, so firmware no longer writes buffers of objects it may still have had.
                unsafe { self.cmdq.dma().free(buf) };
            }
        }
        if released {
            // SAFETY: the function is disabled or dead, so the device reads no doorbell record any more (records
            // of CQs the caller never destroyed included).
            unsafe { self.dbr.release_all(self.cmdq.dma()) };
        }
        rep.local_only = dead;
        rep.pages_reclaimed = self.ctx.stats.reclaimed;
        if released {
            // Firmware released the queue too, so its memory can go even if a timed-out command holds a slot.
            self.cmdq.set_device_down(true);
        }
        // Otherwise firmware refused DISABLE_HCA and still owns its pages and objects: they are leaked, never
        // freed under it.
        rep
    }

    /// Keeps a buffer firmware may still write until the function is disabled. With no room left it is leaked,
    /// which is safe.
    pub(crate) fn orphan(&mut self, buf: DmaRegion) {
        if let Some(slot) = self.orphans.iter_mut().find(|o| o.is_none()) {
            *slot = Some(buf);
        }
    }

    /// `mlx5_reclaim_startup_pages`: MANAGE_PAGES take in `optimal_reclaimed_pages` batches until firmware has
    /// returned everything or stops returning (or answering); in internal error the pages are reclaimed locally.
    fn reclaim_all(&mut self, delay: &mut impl DelayNs, rep: &mut TeardownReport) {
        let func = self.ctx.cfg.function_id;
        while self.ctx.pages.given() > 0 {
            if let HcaState::InternalError(_) = self.state {
                let held = self.ctx.pages.abandon_all(self.cmdq.dma());
                self.ctx.stats.abandoned += held;
                rep.pages_abandoned += held;
                break;
            }
            let want = self.ctx.pages.given().min(RECLAIM_BATCH);
            let clock = &self.clock_us;
            let mut clk = Clock { inner: &mut *delay, us: clock };
            let r = self.ctx.take(&mut self.cmdq, &mut clk, clock, func, want);
            match r {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    let e = self.cmd_error(e);
                    rep.first_error.get_or_insert(e);
                    // A dead device is handled at the top of the loop; anything else ends reclaiming here and
                    // DISABLE_HCA settles the rest.
                    if !matches!(self.state, HcaState::InternalError(_)) {
                        return;
                    }
                }
            }
        }
        self.ctx.pages.free_empty(self.cmdq.dma());
    }
}

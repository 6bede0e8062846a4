//! The objects the datapath reaches: CQs, QPs and SRQs (each its C struct, then the Rust handle, boxed), the
//! address handles UD sends name, and the lookups from a program's pointer. With them, the state the extended
//! verbs keep between calls (an extended poll's completion, a `ibv_wr_*` batch). `post` works on these and
//! `objects` makes them: both sit above this module, which only the context (`device`) is below.

use std::ffi::{c_int, c_uint};
use std::ops::Range;
use std::sync::Mutex;

use mlx5_core::cq::{LinkLayer, WorkCompletion};
use mlx5_core::qp::{QpType, SendOp, Sge};
use mlx5_verbs::raw::{RawCq, RawQp, RawSrq};

use crate::abi::*;
use crate::device::Ctx;
use crate::uobject::{AsyncCount, Held};

/// A CQ: `ibv_cq_ex` (whose prefix is `ibv_cq`), the handle, and the state of an extended poll.
#[repr(C)]
pub(crate) struct Cq {
    pub(crate) c: ibv_cq_ex,
    pub(crate) raw: Held<Option<RawCq>>,
    pub(crate) ctx: *const Ctx,
    pub(crate) ex: Mutex<ExPoll>,
    pub(crate) async_events: AsyncCount,
    /// The parent domain an extended CQ was made on (`IBV_CQ_INIT_ATTR_MASK_PD`), counted on it; else NULL.
    pub(crate) parent_domain: *mut ibv_pd,
}

/// The [`Cq`] of a program's `ibv_cq` (or `ibv_cq_ex`).
///
/// # Safety
/// `cq` is NULL or a CQ this library returned and not yet destroyed.
pub(crate) unsafe fn cq_of<'a>(cq: *mut ibv_cq) -> Option<(&'a Cq, &'a RawCq)> {
    // SAFETY: `c.cq` is the first field of a boxed Cq (caller).
    let c = unsafe { cq.cast::<Cq>().as_ref() }?;
    // A CQ a forked child inherited is not usable there, as its context is not; nor one a closed context left.
    // SAFETY: a CQ's context outlives it.
    unsafe { c.ctx.as_ref() }.filter(|x| x.usable())?;
    Some((c, c.raw.as_ref()?))
}

/// A QP: `ibv_qp_ex` (whose prefix is `ibv_qp`), the handle, and the work request being built through the
/// `ibv_wr_*` API.
#[repr(C)]
pub(crate) struct Qp {
    pub(crate) c: ibv_qp_ex,
    pub(crate) raw: Held<RawQp>,
    pub(crate) qp_type: QpType,
    pub(crate) link: LinkLayer,
    pub(crate) ctx: *const Ctx,
    pub(crate) wr: Mutex<WrBatch>,
    pub(crate) async_events: AsyncCount,
}

/// The [`Qp`] of a program's `ibv_qp` (or `ibv_qp_ex`).
///
/// # Safety
/// `qp` is NULL or a QP this library returned and not yet destroyed.
pub(crate) unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> Option<&'a Qp> {
    // SAFETY: `c.qp_base` is the first field of a boxed Qp (caller); its `ctx` is set at creation to its context
    // (never NULL), which outlives it.
    unsafe { qp.cast::<Qp>().as_ref().filter(|q| (*q.ctx).usable()) }
}

/// An SRQ: `ibv_srq` and the handle.
#[repr(C)]
pub(crate) struct Srq {
    pub(crate) c: ibv_srq,
    pub(crate) raw: Held<RawSrq>,
    pub(crate) ctx: *const Ctx,
    pub(crate) async_events: AsyncCount,
}

/// The [`Srq`] of a program's `ibv_srq` (`None` for one of a closed context, or inherited across fork).
///
/// # Safety
/// `srq` is NULL or an SRQ this library returned and not yet destroyed.
pub(crate) unsafe fn srq_of<'a>(srq: *mut ibv_srq) -> Option<&'a Srq> {
    // SAFETY: the C part is the first field of a boxed Srq (caller); its context outlives it.
    unsafe { srq.cast::<Srq>().as_ref().filter(|s| s.ctx.as_ref().is_some_and(|c| c.usable())) }
}

/// An address handle: `ibv_ah` and the core's address, which a UD send copies into its WQE.
#[repr(C)]
pub(crate) struct Ah {
    pub(crate) c: ibv_ah,
    pub(crate) ah: mlx5_core::qp::Ah,
}

/// The completion an extended poll is on.
#[derive(Debug, Default)]
pub(crate) struct ExPoll {
    pub(crate) cur: WorkCompletion,
}

/// One work request built through `ibv_wr_*`: its gather list and inline bytes are ranges of the batch's
/// arenas ([`WrBatch::sges`], [`WrBatch::bytes`]).
#[derive(Debug)]
pub(crate) struct PendingWr {
    pub(crate) wr_id: u64,
    pub(crate) flags: c_uint,
    pub(crate) op: SendOp,
    pub(crate) sg: Range<usize>,
    pub(crate) inline: Option<Range<usize>>,
    pub(crate) ud: Option<(*const Ah, u32, u32)>,
}

/// The work requests between `ibv_wr_start` and `ibv_wr_complete`, and the first error met building them
/// (the builders return nothing; `ibv_wr_complete` reports it). The vectors are cleared, never freed, between
/// batches: once they have grown to a program's batch, building one allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct WrBatch {
    pub(crate) wrs: Vec<PendingWr>,
    /// The gather entries of every work request of the batch.
    pub(crate) sges: Vec<Sge>,
    /// The inline bytes of every work request of the batch (copied when set, as verbs specifies).
    pub(crate) bytes: Vec<u8>,
    pub(crate) err: c_int,
    /// The `IBV_QP_EX_WITH_*` operations the QP was created with.
    pub(crate) ops: u64,
}

// SAFETY: the AH pointers are the program's, used only under the QP's batch lock by the thread posting.
unsafe impl Send for WrBatch {}

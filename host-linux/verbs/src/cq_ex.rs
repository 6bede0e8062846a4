//! Extended completion queues (`ibv_create_cq_ex`, `ibv_cq_ex`): completions read field by field between
//! `start_poll` and `end_poll`, over the core's [`CqEx`] model. Each completion is taken under the CQ's lock as
//! `poll` takes it; the cursor is the caller's own, so nothing is held between the calls (rdma-core's mlx5 holds
//! its CQ lock from `start_poll` to `end_poll`; here another verbs call on the CQ in between cannot deadlock).

use std::ops::Deref;
use std::sync::Arc;

use mlx5_core::cq::{CqEx, CqeError, ExPoll, ExPoller, WcExFlags, WorkCompletion};

use crate::context::Context;
use crate::cq::{CompChannel, CompletionQueue};
use crate::error::{Result, VerbsError};

/// What `ibv_create_cq_ex` takes (`ibv_cq_init_attr_ex`): size, context, channel, vector and the fields
/// completions carry.
#[derive(Debug, Clone, Copy)]
pub struct CqInitAttrEx<'a, 'ctx> {
    pub cqe: u32,
    pub cq_context: u64,
    pub channel: Option<&'a CompChannel<'ctx>>,
    pub comp_vector: u16,
    /// `IBV_WC_EX_WITH_*`: fields beyond `wr_id`, status, opcode, vendor error and `wc_flags`.
    pub wc_flags: WcExFlags,
}

impl<'a, 'ctx> CqInitAttrEx<'a, 'ctx> {
    /// A CQ for at least `cqe` completions carrying `wc_flags`, no channel, vector 0, context 0.
    pub fn new(cqe: u32, wc_flags: WcExFlags) -> Self {
        CqInitAttrEx { cqe, cq_context: 0, channel: None, comp_vector: 0, wc_flags }
    }
}

/// An extended CQ (`ibv_cq_ex`). It is a [`CompletionQueue`] too (`ibv_cq_ex_to_cq`), so QPs complete on it and
/// `poll` works as on any CQ.
#[derive(Debug)]
pub struct CompletionQueueEx<'ctx> {
    cq: CompletionQueue<'ctx>,
    ex: CqEx,
}

impl Context {
    /// `ibv_create_cq_ex`: as [`Context::create_cq_on`] (no channel: no completion events). Fields this driver cannot report (flow tag, tag matching, wall-clock timestamps) are
    /// refused before anything is created (`EOPNOTSUPP`).
    ///
    /// ```
    /// use mlx5_verbs::{Context, CqInitAttrEx, WcExFlags};
    /// let ctx = Context::open_sim()?;
    /// let cq = ctx.create_cq_ex(CqInitAttrEx::new(16, WcExFlags::STANDARD | WcExFlags::COMPLETION_TIMESTAMP))?;
    /// assert!(cq.start_poll()?.is_none(), "an empty CQ is ENOENT");
    /// assert!(ctx.create_cq_ex(CqInitAttrEx::new(16, WcExFlags::FLOW_TAG)).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn create_cq_ex(&self, a: CqInitAttrEx<'_, '_>) -> Result<CompletionQueueEx<'_>> {
        let ex = CqEx::new(a.wc_flags).map_err(VerbsError::CqExFlags)?;
        let cq = self.create_cq_on(a.cqe, a.cq_context, a.channel, a.comp_vector)?;
        Ok(CompletionQueueEx { cq, ex })
    }
}

impl<'ctx> Deref for CompletionQueueEx<'ctx> {
    type Target = CompletionQueue<'ctx>;
    fn deref(&self) -> &CompletionQueue<'ctx> {
        &self.cq
    }
}

impl CompletionQueueEx<'_> {
    /// The fields its completions carry.
    pub fn wc_flags(&self) -> WcExFlags {
        self.ex.wc_flags()
    }

    /// `ibv_start_poll`: `None` when the CQ is empty (`ENOENT`), else a cursor on the oldest completion whose
    /// `next_poll` moves on; `end_poll` (or a drop) ends it. A CQE the device should not have written is this
    /// call's (or `next_poll`'s) error, as with `poll`. Allocates nothing.
    pub fn start_poll(&self) -> Result<Option<ExPoll<impl ExPoller + '_>>> {
        let obj: &Arc<_> = &self.cq.obj;
        if obj.ring.lock().cq.is_none() {
            return Err(VerbsError::Destroyed { what: "completion queue" });
        }
        let poll = move |wc: &mut [WorkCompletion]| -> std::result::Result<usize, CqeError> {
            match obj.poll(wc) {
                Ok(n) => Ok(n),
                Err(VerbsError::Cqe(e)) => Err(e),
                // The CQ cannot be destroyed while this borrow of it lives: nothing else can fail.
                Err(_) => Ok(0),
            }
        };
        self.ex.start_poll(poll).map_err(VerbsError::Cqe)
    }
}

//! Shared receive queues (`ibv_srq`): receives posted once and consumed by every QP attached to the queue.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mlx5_core::hca::SrqAttr;
use mlx5_core::qp::{PostError, PostErrorKind, RecvWr};
use mlx5_core::srq::SrqRecvBatch;

use crate::backend::AnyMmio;

use crate::cq::SrqCell;
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::pd::{PdObj, ProtectionDomain};

/// What `ibv_create_srq` takes (`ibv_srq_init_attr.attr`): work requests and SGEs per request to hold, and the
/// limit below which [`AsyncEvent::SrqLimitReached`](crate::AsyncEvent::SrqLimitReached) is raised (0: none).
pub type SrqInitAttr = SrqAttr;

/// Which attributes [`SharedReceiveQueue::modify`] changes (`ibv_srq_attr_mask`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SrqAttrMask(pub u32);

impl SrqAttrMask {
    /// `IBV_SRQ_MAX_WR`: resize the queue (mlx5 does not support it: `EINVAL`).
    pub const MAX_WR: SrqAttrMask = SrqAttrMask(1 << 0);
    /// `IBV_SRQ_LIMIT`: arm the limit event.
    pub const LIMIT: SrqAttrMask = SrqAttrMask(1 << 1);

    pub fn contains(self, other: SrqAttrMask) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for SrqAttrMask {
    type Output = SrqAttrMask;
    fn bitor(self, rhs: SrqAttrMask) -> SrqAttrMask {
        SrqAttrMask(self.0 | rhs.0)
    }
}

/// An SRQ without borrows. `users` counts the QPs attached (changed under the control mutex).
#[derive(Debug)]
pub(crate) struct SrqObj {
    pd: Arc<PdObj>,
    srqn: u32,
    max_wr: u32,
    max_sge: u32,
    /// The ring behind its own lock, shared with the CQs whose QPs receive through it.
    pub(crate) ring: SrqCell,
    pub(crate) users: AtomicUsize,
}

impl SrqObj {
    /// `ibv_create_srq`.
    pub(crate) fn create(pd: &Arc<PdObj>, attr: SrqInitAttr) -> Result<Arc<SrqObj>> {
        let mut c = pd.ctx.dev.control();
        let guard = lock(&pd.pd);
        let p = guard.as_ref().ok_or(VerbsError::Destroyed { what: "protection domain" })?;
        let (hca, delay) = c.parts();
        let srq = hca.create_srq(p, attr, delay)?;
        let (srqn, max_wr, max_sge) = (srq.srqn(), srq.max_wr(), srq.sizes().max_gs);
        c.route_srq(srqn, pd.ctx.id);
        pd.users.fetch_add(1, Ordering::AcqRel);
        Ok(Arc::new(SrqObj {
            pd: pd.clone(),
            srqn,
            max_wr,
            max_sge,
            ring: Arc::new(Mutex::new(Some(srq))),
            users: AtomicUsize::new(0),
        }))
    }

    pub(crate) fn srqn(&self) -> u32 {
        self.srqn
    }

    /// `ibv_post_srq_recv`: the SRQ's lock only. A dead device fails the post.
    pub(crate) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let mut g = lock(&self.ring);
        // Made only when needed: the error has drop glue the hot path would run.
        let Some(srq) = g.as_mut() else { return Err(VerbsError::Destroyed { what: "shared receive queue" }) };
        let dev = &self.pd.ctx.dev;
        if dev.is_dead() {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError }.into());
        }
        Ok(srq.post_srq_recv(&dev.mmio, wrs)?)
    }

    /// `ibv_post_srq_recv` of a list the caller translates itself: `f` pushes into the core's batch, whose
    /// doorbell record is written once when `f` returns. The SRQ's lock only; allocates nothing.
    pub(crate) fn with_recv_batch<R>(&self, f: impl FnOnce(&mut SrqRecvBatch<'_, AnyMmio>) -> R) -> Result<R> {
        let mut g = lock(&self.ring);
        // Made only when needed: the error has drop glue the hot path would run.
        let Some(srq) = g.as_mut() else { return Err(VerbsError::Destroyed { what: "shared receive queue" }) };
        let dev = &self.pd.ctx.dev;
        if dev.is_dead() {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError }.into());
        }
        let mut b = srq.recv_batch(&dev.mmio);
        let r = f(&mut b);
        // The batch rings (drops) while the lock is held.
        drop(b);
        Ok(r)
    }

    /// `ibv_modify_srq`.
    pub(crate) fn modify(&self, attr: SrqAttr, mask: SrqAttrMask) -> Result<()> {
        if mask.contains(SrqAttrMask::MAX_WR) {
            return Err(VerbsError::Invalid("resizing a shared receive queue (mlx5 does not support it)".into()));
        }
        if !mask.contains(SrqAttrMask::LIMIT) {
            return Err(VerbsError::Invalid("nothing to modify".into()));
        }
        let mut c = self.pd.ctx.dev.control();
        let mut g = lock(&self.ring);
        let srq = g.as_mut().ok_or(VerbsError::Destroyed { what: "shared receive queue" })?;
        let (hca, delay) = c.parts();
        Ok(hca.modify_srq(srq, attr.srq_limit, delay)?)
    }

    /// `ibv_query_srq`.
    pub(crate) fn query(&self) -> Result<SrqAttr> {
        let mut c = self.pd.ctx.dev.control();
        let g = lock(&self.ring);
        let srq = g.as_ref().ok_or(VerbsError::Destroyed { what: "shared receive queue" })?;
        let (hca, delay) = c.parts();
        Ok(hca.query_srq(srq, delay)?)
    }

    /// `ibv_destroy_srq`: refused with [`VerbsError::Busy`] (`EBUSY`) while QPs receive through it. Idempotent.
    pub(crate) fn destroy(&self) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        let users = self.users.load(Ordering::Acquire);
        if users > 0 {
            return Err(VerbsError::Busy { what: "shared receive queue", users });
        }
        let mut g = lock(&self.ring);
        let Some(srq) = g.take() else { return Ok(()) };
        let (hca, delay) = c.parts();
        match hca.destroy_srq(srq, delay) {
            Ok(()) => {
                drop(g);
                c.unroute_srq(self.srqn);
                self.pd.users.fetch_sub(1, Ordering::AcqRel);
                Ok(())
            }
            Err(e) => {
                // Firmware still holds it: it stays usable, and its PD counted.
                *g = Some(e.obj);
                Err(VerbsError::Destroy(e.error))
            }
        }
    }
}

/// A shared receive queue (`ibv_srq`). Borrows its PD; QPs attached to it borrow it. `Send` and `Sync`: posting
/// takes only the SRQ's own lock.
#[derive(Debug)]
pub struct SharedReceiveQueue<'pd> {
    pub(crate) obj: Arc<SrqObj>,
    _pd: PhantomData<&'pd ProtectionDomain<'pd>>,
}

impl ProtectionDomain<'_> {
    /// `ibv_create_srq`: a shared receive queue holding at least `attr.max_wr` requests of `attr.max_sge` SGEs,
    /// with the limit event armed at `attr.srq_limit` (0: not armed). QPs receive through it when created with
    /// [`QpInitAttr::srq`](crate::QpInitAttr::srq).
    ///
    /// ```
    /// use mlx5_verbs::{Context, SrqAttrMask, SrqInitAttr};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let srq = pd.create_srq(SrqInitAttr { max_wr: 100, max_sge: 1, srq_limit: 0 })?;
    /// assert!(srq.max_wr() >= 100);
    /// srq.modify(SrqInitAttr { srq_limit: 10, ..Default::default() }, SrqAttrMask::LIMIT)?;
    /// assert_eq!(srq.query()?.srq_limit, 10);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn create_srq(&self, attr: SrqInitAttr) -> Result<SharedReceiveQueue<'_>> {
        Ok(SharedReceiveQueue { obj: SrqObj::create(&self.obj, attr)?, _pd: PhantomData })
    }
}

impl SharedReceiveQueue<'_> {
    pub fn srqn(&self) -> u32 {
        self.obj.srqn()
    }

    /// Work requests it holds at once (at least those asked for).
    pub fn max_wr(&self) -> u32 {
        self.obj.max_wr
    }

    /// SGEs per work request.
    pub fn max_sge(&self) -> u32 {
        self.obj.max_sge
    }

    /// `ibv_post_srq_recv`. Allocates nothing and takes only the SRQ's lock. On error, the requests before
    /// `PostError::index` are posted.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.obj.post_recv(wrs)
    }

    /// `ibv_modify_srq`: with [`SrqAttrMask::LIMIT`], arms the limit event at `attr.srq_limit` (one event when
    /// fewer requests than that are posted, then disarmed); [`SrqAttrMask::MAX_WR`] is refused.
    pub fn modify(&self, attr: SrqAttr, mask: SrqAttrMask) -> Result<()> {
        self.obj.modify(attr, mask)
    }

    /// `ibv_query_srq`: `max_wr`, `max_sge` and the limit as firmware holds it (0 once the event fired).
    pub fn query(&self) -> Result<SrqAttr> {
        self.obj.query()
    }

    /// `ibv_destroy_srq`, returning firmware's error.
    pub fn destroy(self) -> Result<()> {
        self.obj.destroy()
    }
}

impl Drop for SharedReceiveQueue<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.obj.destroy() {
            log::error!("destroy SRQ {:#x}: {e}", self.obj.srqn());
        }
    }
}

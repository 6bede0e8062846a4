//! Completion queues (`ibv_cq`): polling without the control mutex, the completion channel's arming and
//! acknowledgement.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mlx5_core::cq::{Cq, Notify, WorkCompletion, WrTable};
use mlx5_core::hca::{poll_cq_with, CqAttr};
use mlx5_core::qp::Qp;

use crate::context::{Context, ContextShared};
use crate::error::{Result, VerbsError};
use crate::event::lock;

/// A QP's ring behind its own mutex, shared by the QP and the CQs it completes on; `None` once destroyed.
pub(crate) type QpCell = Arc<Mutex<Option<Qp>>>;

/// What a CQ's mutex guards: the ring and the QPs completing on it, by QPN.
#[derive(Debug)]
pub(crate) struct CqRing {
    /// The CQ until destroyed.
    pub(crate) cq: Option<Cq>,
    pub(crate) qps: HashMap<u32, QpCell>,
}

/// The work-request tables of a CQ's QPs, looked up by QPN when a CQE names one. The CQ's lock is held; each QP's
/// is taken for one lookup (lock order CQ then QP).
struct QpTable<'a>(&'a HashMap<u32, QpCell>);

impl WrTable for QpTable<'_> {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        lock(self.0.get(&qpn)?).as_mut()?.send_done(qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        lock(self.0.get(&qpn)?).as_mut()?.recv_done(qpn, srqn, wqe_counter)
    }
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        self.0.values().find_map(|q| lock(q).as_mut().and_then(|q| WrTable::flush_one(q, cqn, dead)))
    }
}

/// A completion queue without borrows. `users` counts the QPs completing on it (changed under the control mutex).
#[derive(Debug)]
pub(crate) struct CqObj {
    pub(crate) ctx: Arc<ContextShared>,
    cqn: u32,
    pub(crate) ring: Mutex<CqRing>,
    /// Set by a CQ error event: the device writes no more CQEs here.
    failed: Arc<AtomicBool>,
    pub(crate) users: AtomicUsize,
}

impl CqObj {
    pub(crate) fn create(ctx: &Arc<ContextShared>, attr: CqAttr) -> Result<Arc<CqObj>> {
        let mut c = ctx.dev.control();
        let (hca, delay) = c.parts();
        let cq = hca.create_cq(attr, delay)?;
        let cqn = cq.cqn();
        let failed = Arc::new(AtomicBool::new(false));
        c.route_cq(cqn, ctx.id, failed.clone());
        Ok(Arc::new(CqObj {
            ctx: ctx.clone(),
            cqn,
            ring: Mutex::new(CqRing { cq: Some(cq), qps: HashMap::new() }),
            failed,
            users: AtomicUsize::new(0),
        }))
    }

    pub(crate) fn cqn(&self) -> u32 {
        self.cqn
    }

    /// `ibv_poll_cq`. Takes this CQ's lock and the locks of the QPs its CQEs name, never the control mutex; the
    /// device state it needs is two atomic loads, made only when the ring is empty.
    pub(crate) fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        let dev = &self.ctx.dev;
        let mut r = lock(&self.ring);
        let CqRing { cq, qps } = &mut *r;
        let cq = cq.as_mut().ok_or_else(|| VerbsError::Invalid("CQ destroyed".into()))?;
        // Once the device is dead or the CQ failed, outstanding work requests complete here as flushed.
        poll_cq_with(&dev.mmio, cq, &mut QpTable(qps), wc, || {
            let dead = dev.is_dead();
            (dead || self.failed.load(Ordering::Acquire)).then_some(dead)
        })
        .map_err(|e| VerbsError::Cqe(e.to_string()))
    }

    pub(crate) fn req_notify(&self, notify: Notify) -> Result<()> {
        let mut c = self.ctx.dev.control();
        let r = lock(&self.ring);
        let cq = r.cq.as_ref().ok_or_else(|| VerbsError::Invalid("CQ destroyed".into()))?;
        Ok(c.hca().req_notify_cq(cq, notify)?)
    }

    pub(crate) fn ack_events(&self, n: u32) -> Result<()> {
        let mut c = self.ctx.dev.control();
        let r = lock(&self.ring);
        let cq = r.cq.as_ref().ok_or_else(|| VerbsError::Invalid("CQ destroyed".into()))?;
        Ok(c.hca().ack_cq_events(cq, n)?)
    }

    /// `ibv_destroy_cq`: refused with [`VerbsError::Busy`] while QPs complete on it.
    pub(crate) fn destroy(&self) -> Result<()> {
        let mut c = self.ctx.dev.control();
        let users = self.users.load(Ordering::Acquire);
        if users > 0 {
            return Err(VerbsError::Busy { what: "completion queue", users });
        }
        let Some(cq) = lock(&self.ring).cq.take() else { return Ok(()) };
        c.unroute_cq(self.cqn);
        let (hca, delay) = c.parts();
        if let Err(e) = hca.destroy_cq(cq, delay) {
            c.orphan_cqs.push(e.obj);
            return Err(VerbsError::Destroy(e.error));
        }
        Ok(())
    }
}

/// A completion queue (`ibv_cq`). `Send` and `Sync`: it may be polled on one thread while others post to its
/// QPs, or polled from several (each poll takes the CQ's own lock).
#[derive(Debug)]
pub struct CompletionQueue<'ctx> {
    _ctx: &'ctx Context,
    pub(crate) obj: Arc<CqObj>,
}

impl Context {
    /// `ibv_create_cq` for at least `cqe` completions, with 64-byte CQEs.
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue<'_>> {
        self.create_cq_with(CqAttr { cqe, ..CqAttr::default() })
    }

    pub fn create_cq_with(&self, attr: CqAttr) -> Result<CompletionQueue<'_>> {
        Ok(CompletionQueue { _ctx: self, obj: CqObj::create(&self.shared, attr)? })
    }
}

impl CompletionQueue<'_> {
    pub fn cqn(&self) -> u32 {
        self.obj.cqn()
    }

    /// `ibv_poll_cq`: fills the front of `wc` with completions, returns how many. Allocates nothing and takes no
    /// lock but the CQ's (and, for each CQE, its QP's).
    pub fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        self.obj.poll(wc)
    }

    /// Polls until `want` completions arrived or `timeout` passed; returns how many were written to `wc`.
    pub fn poll_until(&self, wc: &mut [WorkCompletion], want: usize, timeout: Duration) -> Result<usize> {
        let want = want.min(wc.len());
        let deadline = Instant::now() + timeout;
        let mut n = 0;
        while n < want {
            n += self.poll(&mut wc[n..want])?;
            if n < want {
                if Instant::now() >= deadline {
                    break;
                }
                // Other threads may be posting to or polling this CQ's QPs: let them run.
                std::thread::yield_now();
            }
        }
        Ok(n)
    }

    /// `ibv_req_notify_cq`: the next completion (or the next solicited one) raises an event on the channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        self.obj.req_notify(if solicited_only { Notify::Solicited } else { Notify::NextComp })
    }

    /// `ibv_ack_cq_events`.
    pub fn ack_events(&self, n: u32) -> Result<()> {
        self.obj.ack_events(n)
    }

    /// `ibv_destroy_cq`, returning firmware's error.
    pub fn destroy(self) -> Result<()> {
        self.obj.destroy()
    }
}

impl Drop for CompletionQueue<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.obj.destroy() {
            log::error!("destroy CQ {:#x}: {e}", self.obj.cqn());
        }
    }
}

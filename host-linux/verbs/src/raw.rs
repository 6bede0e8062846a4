//! Borrow-free handles for a C ABI (the drop-in `libibverbs.so.1`, crate `mlx5-ibverbs`): the same objects as
//! the safe API, but their lifetime is the caller's. Nothing is destroyed on drop; the caller calls `destroy`
//! (or `dealloc`/`dereg`) as a C program calls `ibv_destroy_*`, and a handle dropped without it leaves the object
//! to the device's teardown. Every call checks that its object still exists, so a handle used after its destroy
//! fails with [`VerbsError::Destroyed`] instead of reaching freed state.

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use mlx5_core::cq::{LinkLayer, Notify, WorkCompletion};
use mlx5_core::hca::{CqAttr, Hca, QpInitAttr as CoreQpInitAttr, SrqAttr};
use mlx5_core::mkey::Access;
use mlx5_core::qp::{Ah, AhAttr, QpAttr, QpAttrMask, QpCap, QpQueryAttr, RecvBatch, RecvWr, SendBatch, SendWr};
use mlx5_core::srq::SrqRecvBatch;
use mlx5_core::trace::CmdTrace;

use crate::backend::{AnyDelay, AnyDma, AnyMmio, HostTables};
use crate::context::Context;
use crate::cq::{wait_cq_event, CqObj};
use crate::error::{Result, VerbsError};
use crate::event::{lock, ChannelShared};
use crate::mr::MrObj;
use crate::pd::PdObj;
use crate::qp::QpObj;
use crate::shared::CqEventTarget;
use crate::srq::{SrqAttrMask, SrqObj};

/// Work on the context's HCA under the control mutex (queries the handles do not cover, such as
/// `ibv_query_device`'s capabilities). The HCA's tracer type stays private, hence the generic method.
pub trait HcaVisitor {
    /// What the visit returns.
    type Out;
    /// Called once with the HCA and its delay.
    fn visit<T: CmdTrace>(self, hca: &mut Hca<AnyMmio, AnyDma, T, HostTables>, delay: &mut AnyDelay) -> Self::Out;
}

/// Runs `v` on `ctx`'s HCA under the control mutex.
pub fn with_hca<V: HcaVisitor>(ctx: &Context, v: V) -> V::Out {
    let mut c = ctx.dev().control();
    let (hca, delay) = c.parts();
    v.visit(hca, delay)
}

/// The link layer of the context's port.
pub fn link_layer(ctx: &Context) -> LinkLayer {
    ctx.link_layer()
}

/// A protection domain (`ibv_pd`).
#[derive(Debug)]
pub struct RawPd(Arc<PdObj>);

/// `ibv_alloc_pd`.
pub fn alloc_pd(ctx: &Context) -> Result<RawPd> {
    Ok(RawPd(PdObj::alloc(&ctx.shared)?))
}

impl RawPd {
    pub fn pdn(&self) -> u32 {
        self.0.pdn()
    }

    /// Another handle on the same PD (a parent domain's): objects made through it count on the PD; only the
    /// PD's own handle should deallocate it.
    pub fn share(&self) -> RawPd {
        RawPd(self.0.clone())
    }

    /// `ibv_dealloc_pd`: `EBUSY` while memory regions, QPs or SRQs use it.
    pub fn dealloc(&self) -> Result<()> {
        self.0.dealloc()
    }

    /// `ibv_reg_mr_iova2` over process memory (`iova` defaults to the address).
    ///
    /// # Safety
    /// The `len` bytes at `ptr` stay allocated, and their whole pages hold nothing the device must not reach,
    /// until the region is deregistered.
    pub unsafe fn reg_mr(&self, ptr: NonNull<u8>, len: usize, iova: Option<u64>, access: Access) -> Result<RawMr> {
        // SAFETY: the caller's duties are `reg_user`'s.
        Ok(RawMr(unsafe { MrObj::reg_user(&self.0, ptr, len, iova, access) }?))
    }

    /// `ibv_create_ah`: the address vector a UD send names (mlx5_ib's `create_ib_ah`).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<Ah> {
        if lock(&self.0.pd).is_none() {
            return Err(VerbsError::Destroyed { what: "protection domain" });
        }
        let mut c = self.0.ctx.dev.control();
        Ok(c.hca().create_ah(attr)?)
    }

    /// `ibv_create_srq`.
    pub fn create_srq(&self, attr: SrqAttr) -> Result<RawSrq> {
        Ok(RawSrq(SrqObj::create(&self.0, attr)?))
    }

    /// `ibv_create_qp`: a QP in RESET on these CQs, receiving through `srq` if given.
    pub fn create_qp(
        &self,
        send_cq: &RawCq,
        recv_cq: &RawCq,
        attr: CoreQpInitAttr,
        srq: Option<&RawSrq>,
        qp_context: u64,
    ) -> Result<RawQp> {
        Ok(RawQp(QpObj::create(&self.0, &send_cq.0, &recv_cq.0, attr, srq.map(|s| &s.0), qp_context)?))
    }
}

/// A memory region (`ibv_mr`).
#[derive(Debug)]
pub struct RawMr(MrObj);

impl RawMr {
    pub fn lkey(&self) -> u32 {
        self.0.lkey
    }
    pub fn rkey(&self) -> u32 {
        self.0.rkey
    }
    /// The region's start address as the device sees it (its `iova`).
    pub fn addr(&self) -> u64 {
        self.0.addr
    }
    /// `ibv_dereg_mr`.
    pub fn dereg(&self) -> Result<()> {
        self.0.dereg()
    }

    /// `ibv_rereg_mr` by re-creating the key: new process memory (`memory`: address, length, `iova` or the
    /// address), protection domain and access, each when given. On success this handle holds no key any more
    /// (the returned one does, with new keys); on failure it keeps its key as it was.
    ///
    /// # Safety
    /// New memory stays allocated, and its whole pages hold nothing the device must not reach, until the
    /// returned region is deregistered.
    pub unsafe fn rereg(
        &self,
        memory: Option<(NonNull<u8>, usize, Option<u64>)>,
        pd: Option<&RawPd>,
        access: Option<Access>,
    ) -> Result<RawMr> {
        // SAFETY: the caller's duties are `MrObj::rereg`'s.
        Ok(RawMr(unsafe { self.0.rereg(memory, pd.map(|p| &p.0), access) }?))
    }
}

/// A completion channel (`ibv_comp_channel`).
#[derive(Debug)]
pub struct RawChannel {
    ctx: Context,
    shared: Arc<ChannelShared>,
}

/// `ibv_create_comp_channel`.
pub fn create_comp_channel(ctx: &Context) -> RawChannel {
    let shared = Arc::new(ChannelShared::new(ctx.dev().new_context_id()));
    ctx.dev().control().add_channel(&shared);
    RawChannel { ctx: Context { shared: ctx.shared.clone() }, shared }
}

/// The descriptor of a completion channel whose context is closed ([`RawChannel::detach`]), closed when dropped.
#[derive(Debug)]
pub struct RawChannelFd(Arc<ChannelShared>);

impl RawChannelFd {
    /// The descriptor.
    pub fn fd(&self) -> Option<i32> {
        self.0.raw_fd()
    }
}

/// A completion event taken from a channel: the CQ's `cq_context` (the value given at creation).
#[derive(Debug)]
pub struct RawCqEvent(Arc<dyn CqEventTarget>);

impl RawCqEvent {
    pub fn cq_context(&self) -> u64 {
        self.0.cq_context()
    }
    pub fn cqn(&self) -> u32 {
        self.0.cqn()
    }
}

impl RawChannel {
    /// The eventfd, readable while an event waits.
    pub fn fd(&self) -> Option<i32> {
        self.shared.raw_fd()
    }

    /// `ibv_get_cq_event`, waiting up to `timeout`.
    pub fn get_cq_event(&self, timeout: Duration) -> Result<Option<RawCqEvent>> {
        Ok(wait_cq_event(self.ctx.dev(), self.shared.id, timeout)?.map(RawCqEvent))
    }

    /// The channel leaves its device (its context is closed, its CQs gone) and keeps only its descriptor, which
    /// the program still holds: what comes back is that descriptor, readable never again. The handle then holds
    /// nothing of the device once dropped.
    pub fn detach(&self) -> RawChannelFd {
        self.ctx.dev().control().remove_channel(self.shared.id);
        self.shared.clear();
        RawChannelFd(self.shared.clone())
    }

    /// `ibv_destroy_comp_channel`: `EBUSY` while CQs report to it.
    pub fn destroy(&self) -> Result<()> {
        let mut c = self.ctx.dev().control();
        let users = c.channel_users(self.shared.id);
        if users > 0 {
            return Err(VerbsError::Busy { what: "completion channel", users });
        }
        c.remove_channel(self.shared.id);
        Ok(())
    }
}

/// A completion queue (`ibv_cq`).
#[derive(Debug)]
pub struct RawCq(Arc<CqObj>);

/// `ibv_create_cq`: events go to `channel` (none: no events) carrying `cq_context`.
pub fn create_cq(ctx: &Context, attr: CqAttr, cq_context: u64, channel: Option<&RawChannel>) -> Result<RawCq> {
    if let Some(ch) = channel {
        if !Arc::ptr_eq(&ch.ctx.shared, &ctx.shared) {
            return Err(VerbsError::Invalid("the completion channel belongs to another context".into()));
        }
    }
    let vectors = ctx.num_comp_vectors()?;
    if attr.comp_vector >= vectors {
        return Err(VerbsError::Invalid(format!("completion vector {} of {vectors}", attr.comp_vector)));
    }
    let ch = channel.map(|c| (c.shared.id, Some(c.shared.clone())));
    Ok(RawCq(CqObj::create(&ctx.shared, attr, cq_context, ch)?))
}

impl RawCq {
    /// Bytes of the CQ's ring (0 once destroyed): what a provider asks a parent domain's allocator for.
    pub fn buf_bytes(&self) -> usize {
        self.0.ring.lock().cq.as_ref().map_or(0, |c| c.buf().len())
    }

    pub fn cqn(&self) -> u32 {
        self.0.cqn()
    }

    /// Entries the ring holds (`ibv_cq.cqe`: one less, as mlx5 reports it).
    pub fn nent(&self) -> u32 {
        self.0.ring.lock().cq.as_ref().map_or(0, |c| c.nent())
    }

    /// `ibv_resize_cq`: at least `cqe` entries (the completions not yet polled move to the new ring).
    pub fn resize(&self, cqe: u32) -> Result<()> {
        let mut c = self.0.ctx.dev.control();
        let mut r = self.0.ring.lock();
        let cq = r.cq.as_mut().ok_or(VerbsError::Destroyed { what: "completion queue" })?;
        let (hca, delay) = c.parts();
        Ok(hca.resize_cq(cq, cqe, delay)?)
    }

    /// `ibv_modify_cq` with `IBV_CQ_ATTR_MODERATE` (see `CompletionQueue::modify_moderation`).
    pub fn modify_moderation(&self, cq_count: u16, cq_period: u16) -> Result<()> {
        self.0.moderate(cq_count, cq_period)
    }

    /// `ibv_poll_cq`.
    pub fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        self.0.poll(wc)
    }

    /// `ibv_poll_cq` into any [`WcSink`](mlx5_core::cq::WcSink): a C `ibv_wc` array written as each CQE is
    /// decoded, under one lock of the CQ for the whole call.
    #[inline]
    pub fn poll_into<S: mlx5_core::cq::WcSink + ?Sized>(&self, wc: &mut S) -> Result<usize> {
        self.0.poll_into(wc)
    }

    /// `ibv_req_notify_cq`.
    pub fn req_notify(&self, notify: Notify) -> Result<()> {
        self.0.req_notify(notify)
    }

    /// `ibv_ack_cq_events`.
    pub fn ack_events(&self, n: u32) -> Result<()> {
        self.0.ack_events(n)
    }

    /// `ibv_destroy_cq`, first waiting until every event taken for it is acknowledged.
    pub fn destroy(&self) -> Result<()> {
        self.0.destroy(true)
    }

    /// Destroys the CQ without waiting for its events' acknowledgements (they are given back): the cleanup of a
    /// context closed with the CQ alive, as the kernel's uverbs destroys what a closed file left.
    pub fn destroy_now(&self) -> Result<()> {
        self.0.destroy(false)
    }
}

/// A queue pair (`ibv_qp`).
#[derive(Debug)]
pub struct RawQp(QpObj);

impl RawQp {
    /// Bytes of the QP's send and receive rings (0 once destroyed).
    pub fn buf_bytes(&self) -> usize {
        self.0.buf_bytes()
    }

    pub fn qpn(&self) -> u32 {
        self.0.qpn()
    }

    /// The queues' sizes as granted.
    pub fn cap(&self) -> QpCap {
        self.0.cap()
    }

    /// `ibv_modify_qp`.
    pub fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        self.0.modify(attr, mask)
    }

    /// `ibv_query_qp`.
    pub fn query(&self) -> Result<QpQueryAttr> {
        self.0.query_attr()
    }

    /// `ibv_post_send`.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.0.post_send(wrs)
    }

    /// `ibv_post_recv`.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.0.post_recv(wrs)
    }

    /// `ibv_post_send` of a list translated one work request at a time: `f` pushes into the core's batch, rung
    /// once when `f` returns (a C `ibv_send_wr` chain, with no slice built first).
    pub fn post_send_with<R>(&self, f: impl FnOnce(&mut SendBatch<'_, AnyMmio>) -> R) -> Result<R> {
        self.0.with_send_batch(f)
    }

    /// [`RawQp::post_send_with`] monomorphized for the device's register access: one match per call, none per
    /// register access.
    #[inline]
    pub fn post_send_each<F: crate::qp::SendBatchFn>(&self, f: F) -> Result<F::Out> {
        self.0.with_send_batch_each(f)
    }

    /// `f` on the core's QP with the device's own register access, under the QP's lock, after the checks every
    /// post makes (destroyed, device dead, which `f` answers itself: [`QpFnOr`](crate::qp::QpFnOr)): a caller
    /// posting its own list through `Qp::post_send_iter`. `LOCKED` for a caller that knows the QP's lock is not
    /// single-threaded (made in a context not set so): the lock's mode is then not tested. Without it the caller
    /// expects a single-threaded lock (its context was set so), taken with its flag alone; a QP whose lock locks
    /// is then taken with its word alone, out of line (another thread's bias on it revoked). Either is right on
    /// any QP.
    #[inline]
    pub fn post_each_or<F: crate::qp::QpFnOr, const LOCKED: bool>(&self, f: F) -> F::Out {
        self.0.with_qp_each_or::<F, LOCKED, false>(f)
    }

    /// [`RawQp::post_each_or`] for work whose only register-side step is a barrier (a receive list): run once,
    /// not once per backend.
    #[inline]
    pub fn post_recvs_or<F: crate::qp::QpFnOr, const LOCKED: bool>(&self, f: F) -> F::Out {
        self.0.with_qp_each_or::<F, LOCKED, true>(f)
    }

    /// [`RawQp::post_recv_with`] monomorphized likewise.
    #[inline]
    pub fn post_recv_each<F: crate::qp::RecvBatchFn>(&self, f: F) -> Result<F::Out> {
        self.0.with_recv_batch_each(f)
    }

    /// `ibv_post_recv` likewise: the doorbell record is written once when `f` returns.
    pub fn post_recv_with<R>(&self, f: impl FnOnce(&mut RecvBatch<'_, AnyMmio>) -> R) -> Result<R> {
        self.0.with_recv_batch(f)
    }

    /// `ibv_destroy_qp`.
    pub fn destroy(&self) -> Result<()> {
        self.0.destroy()
    }
}

/// A shared receive queue (`ibv_srq`).
#[derive(Debug)]
pub struct RawSrq(Arc<SrqObj>);

impl RawSrq {
    /// Bytes of the SRQ's ring (0 once destroyed).
    pub fn buf_bytes(&self) -> usize {
        lock(&self.0.ring).as_ref().map_or(0, |s| s.sizes().buf_bytes())
    }

    pub fn srqn(&self) -> u32 {
        self.0.srqn()
    }

    /// `ibv_post_srq_recv`.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.0.post_recv(wrs)
    }

    /// `ibv_post_srq_recv` of a list translated one work request at a time; the doorbell record is written once
    /// when `f` returns.
    pub fn post_recv_with<R>(&self, f: impl FnOnce(&mut SrqRecvBatch<'_, AnyMmio>) -> R) -> Result<R> {
        self.0.with_recv_batch(f)
    }

    /// `ibv_modify_srq`.
    pub fn modify(&self, attr: SrqAttr, mask: SrqAttrMask) -> Result<()> {
        self.0.modify(attr, mask)
    }

    /// `ibv_query_srq`.
    pub fn query(&self) -> Result<SrqAttr> {
        self.0.query()
    }

    /// `ibv_destroy_srq`.
    pub fn destroy(&self) -> Result<()> {
        self.0.destroy()
    }
}

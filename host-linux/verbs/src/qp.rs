//! Queue pairs (`ibv_qp`) whose states are types, their attributes, and the datapath's posts.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use mlx5_core::cq::LinkLayer;
use mlx5_core::hca::QpInitAttr as CoreQpInitAttr;
use mlx5_core::mkey::Access;
use mlx5_core::qp::{
    required_attrs, AhAttr, Grh, Mtu, PostError, PostErrorKind, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvBatch,
    RecvWr, SendBatch, SendWr,
};

use mlx5_core::hal::Mmio;

use crate::backend::{AnyMmio, MmioFn};
use crate::context::Context;
use crate::cq::{CompletionQueue, CqObj, QpCell, QpEntry};
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::pd::{PdObj, ProtectionDomain};
use crate::shared::DeviceShared;
use crate::srq::{SharedReceiveQueue, SrqObj};

/// QP states as types: a QP can post sends only in [`Rts`], receives from [`Init`] on.
#[derive(Debug)]
pub enum Reset {}
#[derive(Debug)]
pub enum Init {}
#[derive(Debug)]
pub enum Rtr {}
#[derive(Debug)]
pub enum Rts {}
/// The error state (moved there by the caller; the device also moves a QP there on a fatal error, which shows
/// in completions with flush status).
#[derive(Debug)]
pub enum ErrState {}

/// States in which receives may be posted.
pub trait CanRecv {}
impl CanRecv for Init {}
impl CanRecv for Rtr {}
impl CanRecv for Rts {}
impl CanRecv for ErrState {}

/// What the peer of an RC QP (or the target of an exchange) is: QPN, first PSN, and its address on the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteQp {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub mac: [u8; 6],
}

/// Whether an InfiniBand peer's GID lies in another subnet than ours (its 64-bit prefix differs; a zero GID
/// says nothing), which needs a GRH to be routed.
fn crosses_subnet(mine: &[u8; 16], peer: &[u8; 16]) -> bool {
    peer != &[0; 16] && mine[..8] != peer[..8]
}

/// The mask verbs requires for a transition of this API's typed path (every such transition is in the table).
fn required(ty: QpType, from: QpState, to: QpState) -> QpAttrMask {
    required_attrs(ty, from, to).unwrap_or(QpAttrMask::STATE)
}

/// RESET → INIT attributes.
#[derive(Debug, Clone, Copy)]
pub struct InitAttr {
    attr: QpAttr,
    mask: QpAttrMask,
}

impl InitAttr {
    /// An RC QP on port 1, pkey 0, granting `remote` rights to its peer.
    pub fn rc(remote: Access) -> Self {
        let attr = QpAttr { qp_state: QpState::Init, qp_access_flags: remote, ..QpAttr::default() };
        InitAttr { attr, mask: required(QpType::Rc, QpState::Reset, QpState::Init) }
    }

    /// A UD QP on port 1, pkey 0, accepting datagrams carrying `qkey`.
    pub fn ud(qkey: u32) -> Self {
        let attr = QpAttr { qp_state: QpState::Init, qkey, ..QpAttr::default() };
        InitAttr { attr, mask: required(QpType::Ud, QpState::Reset, QpState::Init) }
    }
}

/// INIT → RTR attributes.
#[derive(Debug, Clone, Copy)]
pub struct RtrAttr {
    attr: QpAttr,
    mask: QpAttrMask,
    /// Filled from the context's link layer when the transition runs (GRH for RoCE, LID for InfiniBand).
    remote: Option<RemoteQp>,
    /// The GRH's hop limit and source GID index, and whether the caller asked for a GRH on InfiniBand.
    hop_limit: u8,
    sgid_index: u8,
    global: bool,
}

impl RtrAttr {
    /// An RC QP towards `remote`: MTU 1024, one outstanding read, RNR timer 12 (0.64 ms), as rc_pingpong.
    pub fn rc(remote: RemoteQp) -> Self {
        let attr = QpAttr {
            qp_state: QpState::Rtr,
            path_mtu: Mtu::M1024,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..QpAttr::default()
        };
        RtrAttr {
            attr,
            mask: required(QpType::Rc, QpState::Init, QpState::Rtr),
            remote: Some(remote),
            hop_limit: 64,
            sgid_index: 0,
            global: false,
        }
    }

    /// The GRH's hop limit (`ah_attr.grh.hop_limit`; 64 unless set).
    pub fn hop_limit(mut self, hop_limit: u8) -> Self {
        self.hop_limit = hop_limit;
        self
    }

    /// The source GID index for the GRH (`ah_attr.grh.sgid_index`; 0 unless set).
    pub fn sgid_index(mut self, index: u8) -> Self {
        self.sgid_index = index;
        self
    }

    /// On InfiniBand, address the peer by its GID with a GRH (`ah_attr.is_global`, as rc_pingpong does when given
    /// a GID index). Without it a GRH is used only when the peer's GID is in another subnet. RoCE always has one.
    pub fn global(mut self) -> Self {
        self.global = true;
        self
    }

    /// A UD QP: nothing but the state.
    pub fn ud() -> Self {
        let attr = QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() };
        RtrAttr {
            attr,
            mask: required(QpType::Ud, QpState::Init, QpState::Rtr),
            remote: None,
            hop_limit: 64,
            sgid_index: 0,
            global: false,
        }
    }

    pub fn mtu(mut self, mtu: Mtu) -> Self {
        self.attr.path_mtu = mtu;
        self
    }

    /// Reads / atomics the peer may have outstanding towards this QP.
    pub fn max_dest_rd_atomic(mut self, n: u8) -> Self {
        self.attr.max_dest_rd_atomic = n;
        self
    }
}

/// RTR → RTS attributes.
#[derive(Debug, Clone, Copy)]
pub struct RtsAttr {
    attr: QpAttr,
    mask: QpAttrMask,
}

impl RtsAttr {
    /// An RC QP starting at `sq_psn`: timeout 14 (67 ms), 7 retries, RNR retry forever, one outstanding read.
    pub fn rc(sq_psn: u32) -> Self {
        let attr = QpAttr { qp_state: QpState::Rts, sq_psn, ..QpAttr::default() };
        RtsAttr { attr, mask: required(QpType::Rc, QpState::Rtr, QpState::Rts) }
    }

    pub fn ud(sq_psn: u32) -> Self {
        let attr = QpAttr { qp_state: QpState::Rts, sq_psn, ..QpAttr::default() };
        RtsAttr { attr, mask: required(QpType::Ud, QpState::Rtr, QpState::Rts) }
    }

    pub fn retry(mut self, retry_cnt: u8, rnr_retry: u8) -> Self {
        self.attr.retry_cnt = retry_cnt;
        self.attr.rnr_retry = rnr_retry;
        self
    }

    /// The local ACK timeout, 4.096 us << `timeout` (14 by default).
    pub fn timeout(mut self, timeout: u8) -> Self {
        self.attr.timeout = timeout;
        self
    }

    /// Reads / atomics this QP may have outstanding.
    pub fn max_rd_atomic(mut self, n: u8) -> Self {
        self.attr.max_rd_atomic = n;
        self
    }
}

/// A queue pair without borrows. Its ring sits behind its own mutex ([`QpCell`]), which the CQs it completes on
/// share; it keeps its PD and CQs counted as used until destroyed.
#[derive(Debug)]
pub(crate) struct QpObj {
    pd: Arc<PdObj>,
    /// The device, also reached through `pd`: every post reads it, one load away here instead of three.
    dev: Arc<DeviceShared>,
    send_cq: Arc<CqObj>,
    recv_cq: Arc<CqObj>,
    /// The SRQ it receives through, if any.
    srq: Option<Arc<SrqObj>>,
    qpn: u32,
    cap: QpCap,
    qp_context: u64,
    ring: QpCell,
    /// The builder model of a QP made by `create_qp_ex` (`send_ops_flags`); unset for `create_qp`.
    pub(crate) ex: std::sync::OnceLock<mlx5_core::qp::QpEx>,
}

/// The order a QP's two CQs are locked in: lower CQN first, and the second `None` when both queues share one
/// CQ. Every path that holds both (create, destroy, cleaning a QP's completions) takes them so.
fn cq_lock_order<'c>(send_cq: &'c Arc<CqObj>, recv_cq: &'c Arc<CqObj>) -> (&'c Arc<CqObj>, Option<&'c Arc<CqObj>>) {
    let (first, second) = if send_cq.cqn() <= recv_cq.cqn() { (send_cq, recv_cq) } else { (recv_cq, send_cq) };
    (first, (!Arc::ptr_eq(first, second)).then_some(second))
}

impl QpObj {
    /// `ibv_create_qp`: locks the control path, then both CQs (ascending CQN), then creates the QP in RESET and
    /// enters it into the CQs' tables.
    pub(crate) fn create(
        pd: &Arc<PdObj>,
        send_cq: &Arc<CqObj>,
        recv_cq: &Arc<CqObj>,
        attr: CoreQpInitAttr,
        srq: Option<&Arc<SrqObj>>,
        qp_context: u64,
    ) -> Result<QpObj> {
        let mut c = pd.ctx.dev.control();
        let (first, second) = cq_lock_order(send_cq, recv_cq);
        let mut g1 = first.ring.lock();
        let mut g2 = second.map(|c| c.ring.lock());
        let pd_guard = lock(&pd.pd);
        let p = pd_guard.as_ref().ok_or(VerbsError::Destroyed { what: "protection domain" })?;
        let destroyed = || VerbsError::Destroyed { what: "completion queue" };
        // Control → CQs → SRQ: the SRQ's lock is taken last and no QP lock is held.
        let srq_guard = srq.map(|s| lock(&s.ring));
        let qp = {
            let c1 = g1.cq.as_ref().ok_or_else(destroyed)?;
            let c2 = match &g2 {
                Some(g) => g.cq.as_ref().ok_or_else(destroyed)?,
                None => c1,
            };
            let (s, r) = if Arc::ptr_eq(first, send_cq) { (c1, c2) } else { (c2, c1) };
            let (hca, delay) = c.parts();
            match &srq_guard {
                Some(g) => {
                    let sq = g.as_ref().ok_or(VerbsError::Destroyed { what: "shared receive queue" })?;
                    hca.create_qp_with_srq(p, s, r, attr, sq, delay)?
                }
                None => hca.create_qp(p, s, r, attr, delay)?,
            }
        };
        drop(srq_guard);
        let (qpn, cap) = (qp.qpn(), qp.cap());
        let srqn = srq.map(|s| s.srqn());
        let ring: QpCell = Arc::new(pd.ctx.queue_lock(Some(qp)));
        g1.qps.insert(qpn, QpEntry { cell: ring.clone(), srqn });
        if let Some(g) = &mut g2 {
            g.qps.insert(qpn, QpEntry { cell: ring.clone(), srqn });
        }
        if let Some(s) = srq {
            // Receive completions arrive on the receive CQ, which resolves them through the SRQ.
            let g = if Arc::ptr_eq(first, recv_cq) { &mut *g1 } else { g2.as_deref_mut().unwrap_or(&mut *g1) };
            g.srqs.entry(s.srqn()).or_insert_with(|| (s.ring.clone(), 0)).1 += 1;
            s.users.fetch_add(1, Ordering::AcqRel);
        }
        g1.settle();
        if let Some(g) = &mut g2 {
            g.settle();
        }
        pd.users.fetch_add(1, Ordering::AcqRel);
        send_cq.users.fetch_add(1, Ordering::AcqRel);
        recv_cq.users.fetch_add(1, Ordering::AcqRel);
        c.route_qp(qpn, pd.ctx.id);
        Ok(QpObj {
            pd: pd.clone(),
            dev: pd.ctx.dev.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: srq.cloned(),
            qpn,
            cap,
            qp_context,
            ring,
            ex: std::sync::OnceLock::new(),
        })
    }

    /// `ibv_modify_qp`. A move to RESET also takes the QP's unpolled completions out of its CQs, as libmlx5
    /// does (`mlx5_cq_clean`): the reset QP's work request tables start over, so an old completion would name
    /// the wrong work request.
    pub(crate) fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        {
            let mut g = self.ring.lock();
            let qp = g.as_mut().ok_or(VerbsError::Destroyed { what: "queue pair" })?;
            let (hca, delay) = c.parts();
            hca.modify_qp(qp, attr, mask, delay)?;
        }
        if mask.0 & QpAttrMask::STATE.0 != 0 && attr.qp_state == QpState::Reset {
            // The QP's lock is released first: a poll holds a CQ's lock, then its QPs'.
            self.clean_cqs();
        }
        Ok(())
    }

    /// Removes this QP's unpolled completions from its CQs (each once, in ascending CQN order as `create`
    /// locks them); receives through an SRQ give their WQEs back to it.
    fn clean_cqs(&self) {
        let mmio = &self.pd.ctx.dev.mmio;
        let (first, second) = cq_lock_order(&self.send_cq, &self.recv_cq);
        let srq = self.srq.as_ref();
        for cq in [Some(first), second].into_iter().flatten() {
            let mut r = cq.ring.lock();
            let Some(ring) = r.cq.as_mut() else { continue };
            ring.clean(mmio, self.qpn, |wqe_counter| {
                if let Some(s) = srq {
                    if let Some(s) = lock(&s.ring).as_mut() {
                        let _ = s.srq_done(wqe_counter);
                    }
                }
            });
        }
    }

    /// `ibv_query_qp`'s state.
    pub(crate) fn query_state(&self) -> Result<QpState> {
        let mut c = self.pd.ctx.dev.control();
        let g = self.ring.lock();
        let qp = g.as_ref().ok_or(VerbsError::Destroyed { what: "queue pair" })?;
        let (hca, delay) = c.parts();
        Ok(hca.query_qp(qp, delay)?.state)
    }

    pub(crate) fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Bytes of the send and receive rings (0 once destroyed).
    pub(crate) fn buf_bytes(&self) -> usize {
        self.ring.lock().as_ref().map_or(0, |q| q.sizes().sq_bytes() + q.sizes().rq_bytes())
    }

    pub(crate) fn cap(&self) -> QpCap {
        self.cap
    }

    /// `ibv_query_qp`: every attribute.
    pub(crate) fn query_attr(&self) -> Result<mlx5_core::qp::QpQueryAttr> {
        let mut c = self.pd.ctx.dev.control();
        let g = self.ring.lock();
        let qp = g.as_ref().ok_or(VerbsError::Destroyed { what: "queue pair" })?;
        let (hca, delay) = c.parts();
        Ok(hca.query_qp_attr(qp, delay)?)
    }

    /// Runs `f` on the QP under its lock, with its device: the one check every post makes first (destroyed, or
    /// the device dead, which fails the post as `Hca::post_send` does).
    #[inline(always)]
    fn with_live<R>(&self, f: impl FnOnce(&mut mlx5_core::qp::Qp, &DeviceShared) -> Result<R>) -> Result<R> {
        self.with_live_as::<false, R>(f)
    }

    /// [`QpObj::with_live`] for a caller that knows the QP's lock is not single-threaded (`LOCKED`:
    /// [`SpinLock::lock_as`](crate::spin::SpinLock::lock_as)).
    #[inline(always)]
    fn with_live_as<const LOCKED: bool, R>(
        &self,
        f: impl FnOnce(&mut mlx5_core::qp::Qp, &DeviceShared) -> Result<R>,
    ) -> Result<R> {
        let mut g = self.ring.lock_as::<LOCKED>();
        // Made only when needed: the error has drop glue the hot path would run.
        let Some(qp) = g.as_mut() else { return Err(VerbsError::Destroyed { what: "queue pair" }) };
        let dev = &self.dev;
        if dev.is_dead() {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError }.into());
        }
        f(qp, dev)
    }

    /// `ibv_post_send`: the QP's lock only.
    pub(crate) fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.with_live(|qp, dev| Ok(qp.post_send(&dev.mmio, wrs)?))
    }

    /// `ibv_post_recv`: the QP's lock only.
    pub(crate) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.with_live(|qp, dev| Ok(qp.post_recv(&dev.mmio, wrs)?))
    }

    /// `ibv_post_send` of a list the caller translates itself: `f` pushes each work request into the core's
    /// batch, which rings the doorbell once when `f` returns. The QP's lock only; allocates nothing.
    pub(crate) fn with_send_batch<R>(&self, f: impl FnOnce(&mut SendBatch<'_, AnyMmio>) -> R) -> Result<R> {
        self.with_live(|qp, dev| {
            let mut b = qp.send_batch(&dev.mmio);
            let r = f(&mut b);
            // The batch rings (drops) while the lock is held.
            drop(b);
            Ok(r)
        })
    }

    /// [`QpObj::with_send_batch`] with `f` monomorphized for the device's register access (one match per call).
    #[inline]
    pub(crate) fn with_send_batch_each<F: SendBatchFn>(&self, f: F) -> Result<F::Out> {
        struct Run<'q, F>(&'q mut mlx5_core::qp::Qp, F);
        impl<F: SendBatchFn> MmioFn for Run<'_, F> {
            type Out = F::Out;
            #[inline(always)]
            fn call<M: Mmio + ?Sized>(self, m: &M) -> F::Out {
                let mut b = self.0.send_batch(m);
                let r = self.1.run(&mut b);
                // The batch rings (drops) here, while the caller holds the QP's lock.
                drop(b);
                r
            }
        }
        self.with_live(|qp, dev| Ok(dev.mmio.with(Run(qp, f))))
    }

    /// The drop-in's posts: `f` on the core's QP itself under its lock, monomorphized for the device's register
    /// access (one match per call) or, `BARRIER_ONLY` (a receive post: its only register-side step is a barrier,
    /// the same for every backend on x86-64), run once with the access as it is. `LOCKED` for a context whose
    /// queues lock; else one set single-threaded, whose locks are taken and let go with a store each
    /// ([`SpinLock::lock_single`](crate::spin::SpinLock::lock_single)). A destroyed QP or dead device is answered
    /// by `f` itself: no error is made and matched on the way out.
    #[inline]
    pub(crate) fn with_qp_each_or<F: QpFnOr, const LOCKED: bool, const BARRIER_ONLY: bool>(&self, f: F) -> F::Out {
        if LOCKED {
            Self::run_or::<F, BARRIER_ONLY>(&mut self.ring.lock_as::<true>(), &self.dev, f)
        } else {
            Self::run_or::<F, BARRIER_ONLY>(&mut self.ring.lock_single(), &self.dev, f)
        }
    }

    /// [`QpObj::with_qp_each_or`] with the QP's lock held.
    #[inline(always)]
    fn run_or<F: QpFnOr, const BARRIER_ONLY: bool>(
        ring: &mut Option<mlx5_core::qp::Qp>,
        dev: &DeviceShared,
        f: F,
    ) -> F::Out {
        struct Run<'q, F>(&'q mut mlx5_core::qp::Qp, F);
        impl<F: QpFn> MmioFn for Run<'_, F> {
            type Out = F::Out;
            #[inline(always)]
            fn call<M: Mmio + ?Sized>(self, m: &M) -> F::Out {
                self.1.run(self.0, m)
            }
        }
        let Some(qp) = ring.as_mut() else { return f.unavailable(false) };
        if dev.is_dead() {
            return f.unavailable(true);
        }
        if BARRIER_ONLY {
            f.run(qp, &dev.mmio)
        } else {
            dev.mmio.with(Run(qp, f))
        }
    }

    /// [`QpObj::with_recv_batch`] with `f` monomorphized for the device's register access.
    #[inline]
    pub(crate) fn with_recv_batch_each<F: RecvBatchFn>(&self, f: F) -> Result<F::Out> {
        struct Run<'q, F>(&'q mut mlx5_core::qp::Qp, F);
        impl<F: RecvBatchFn> MmioFn for Run<'_, F> {
            type Out = F::Out;
            #[inline(always)]
            fn call<M: Mmio + ?Sized>(self, m: &M) -> F::Out {
                let mut b = self.0.recv_batch(m);
                let r = self.1.run(&mut b);
                drop(b);
                r
            }
        }
        self.with_live(|qp, dev| Ok(dev.mmio.with(Run(qp, f))))
    }

    /// `ibv_post_recv` of a list the caller translates itself, as [`QpObj::with_send_batch`].
    pub(crate) fn with_recv_batch<R>(&self, f: impl FnOnce(&mut RecvBatch<'_, AnyMmio>) -> R) -> Result<R> {
        self.with_live(|qp, dev| {
            let mut b = qp.recv_batch(&dev.mmio);
            let r = f(&mut b);
            // The batch rings (drops) while the lock is held.
            drop(b);
            Ok(r)
        })
    }

    /// `ibv_destroy_qp`: out of the CQs' tables (control, CQ, then QP lock), then DESTROY_QP. Idempotent.
    pub(crate) fn destroy(&self) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        let (first, second) = cq_lock_order(&self.send_cq, &self.recv_cq);
        let mut g1 = first.ring.lock();
        let mut g2 = second.map(|c| c.ring.lock());
        let Some(qp) = self.ring.lock().take() else { return Ok(()) };
        g1.qps.remove(&self.qpn);
        if let Some(g) = &mut g2 {
            g.qps.remove(&self.qpn);
        }
        if let Some(s) = &self.srq {
            let g = if Arc::ptr_eq(first, &self.recv_cq) { &mut *g1 } else { g2.as_deref_mut().unwrap_or(&mut *g1) };
            if let Some(e) = g.srqs.get_mut(&s.srqn()) {
                e.1 -= 1;
                if e.1 == 0 {
                    g.srqs.remove(&s.srqn());
                }
            }
        }
        g1.settle();
        if let Some(g) = &mut g2 {
            g.settle();
        }
        drop((g1, g2));
        c.unroute_qp(self.qpn);
        let (hca, delay) = c.parts();
        if let Err(e) = hca.destroy_qp(qp, delay) {
            // Firmware may still hold the QP, and with it the PD and CQs: they stay counted as used.
            c.orphan_qps.push(e.obj);
            return Err(VerbsError::Destroy(e.error));
        }
        // Its completions not yet polled name a QP that is gone (libmlx5 cleans them at destroy too).
        self.clean_cqs();
        self.pd.users.fetch_sub(1, Ordering::AcqRel);
        self.send_cq.users.fetch_sub(1, Ordering::AcqRel);
        self.recv_cq.users.fetch_sub(1, Ordering::AcqRel);
        if let Some(s) = &self.srq {
            s.users.fetch_sub(1, Ordering::AcqRel);
        }
        Ok(())
    }
}

/// Destroys the QP when the last typed handle goes (a transition moves it from one handle to the next).
#[derive(Debug)]
struct QpHandle(Arc<QpObj>);

impl Drop for QpHandle {
    fn drop(&mut self) {
        if let Err(e) = self.0.destroy() {
            log::error!("destroy QP {:#x}: {e}", self.0.qpn);
        }
    }
}

/// A refused transition: the QP, still in its old state, and why.
#[derive(Debug)]
pub struct TransitionError<'a, S> {
    pub qp: QueuePair<'a, S>,
    pub error: VerbsError,
}

/// A queue pair (`ibv_qp`) in state `S`. Borrows its PD and CQs; destroyed on drop. `Send` and `Sync`: posts
/// take only the QP's own lock, so one thread may post sends while another posts receives.
#[derive(Debug)]
pub struct QueuePair<'a, S> {
    ctx: &'a Context,
    h: QpHandle,
    qp_type: QpType,
    _borrows: PhantomData<(&'a ProtectionDomain<'a>, &'a CompletionQueue<'a>, S)>,
}

/// What `ibv_create_qp` takes (`ibv_qp_init_attr`): the CQs, an SRQ to receive through, the queue sizes,
/// whether every send is signaled, and the caller's `qp_context`.
#[derive(Debug, Clone, Copy)]
pub struct QpInitAttr<'a, 'ctx> {
    pub qp_type: QpType,
    pub send_cq: &'a CompletionQueue<'ctx>,
    pub recv_cq: &'a CompletionQueue<'ctx>,
    /// Receive through this SRQ (`init_attr.srq`): the QP has no receive queue of its own (`max_recv_wr` and
    /// `max_recv_sge` are granted as 0) and its receive completions name the SRQ's work requests.
    pub srq: Option<&'a SharedReceiveQueue<'a>>,
    pub cap: QpCap,
    /// `sq_sig_all`: every send completes, whatever its `SIGNALED` flag.
    pub sq_sig_all: bool,
    /// Returned by [`QueuePair::qp_context`].
    pub qp_context: u64,
}

impl<'a, 'ctx> QpInitAttr<'a, 'ctx> {
    /// A QP of `qp_type` on these CQs with `cap`, no SRQ, sends signaled as their flags say, context 0.
    pub fn new(
        qp_type: QpType,
        send_cq: &'a CompletionQueue<'ctx>,
        recv_cq: &'a CompletionQueue<'ctx>,
        cap: QpCap,
    ) -> Self {
        QpInitAttr { qp_type, send_cq, recv_cq, srq: None, cap, sq_sig_all: false, qp_context: 0 }
    }
}

impl<'ctx> ProtectionDomain<'ctx> {
    /// `ibv_create_qp`: a QP in RESET completing sends on `send_cq` and receives on `recv_cq`.
    pub fn create_qp<'a>(
        &'a self,
        qp_type: QpType,
        send_cq: &'a CompletionQueue<'ctx>,
        recv_cq: &'a CompletionQueue<'ctx>,
        cap: QpCap,
    ) -> Result<QueuePair<'a, Reset>> {
        self.create_qp_with(QpInitAttr::new(qp_type, send_cq, recv_cq, cap))
    }

    /// `ibv_create_qp` with every attribute of [`QpInitAttr`] (an SRQ, `sq_sig_all`, `qp_context`).
    ///
    /// ```
    /// use mlx5_verbs::{Context, QpCap, QpInitAttr, QpType, SrqInitAttr};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let cq = ctx.create_cq(16)?;
    /// let srq = pd.create_srq(SrqInitAttr { max_wr: 16, max_sge: 1, srq_limit: 0 })?;
    /// let cap = QpCap { max_send_wr: 4, max_send_sge: 1, ..QpCap::default() };
    /// let attr = QpInitAttr { srq: Some(&srq), sq_sig_all: true, qp_context: 42, ..QpInitAttr::new(QpType::Rc, &cq, &cq, cap) };
    /// let qp = pd.create_qp_with(attr)?;
    /// assert_eq!((qp.qp_context(), qp.cap().max_recv_wr, qp.srqn()), (42, 0, Some(srq.srqn())));
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn create_qp_with<'a>(&'a self, a: QpInitAttr<'a, 'ctx>) -> Result<QueuePair<'a, Reset>> {
        let attr = CoreQpInitAttr { qp_type: a.qp_type, cap: a.cap, sq_sig_all: a.sq_sig_all };
        let srq = a.srq.map(|s| &s.obj);
        let obj = QpObj::create(&self.obj, &a.send_cq.obj, &a.recv_cq.obj, attr, srq, a.qp_context)?;
        Ok(QueuePair { ctx: self.context(), h: QpHandle(Arc::new(obj)), qp_type: a.qp_type, _borrows: PhantomData })
    }
}

impl Context {
    /// What a peer needs to connect to `qp` on this device: QPN, LID, GID and (RoCE) MAC, as `rc_pingpong`
    /// exchanges them. The MAC is the one in the GID's EUI-64.
    pub fn remote_qp<S>(&self, qp: &QueuePair<'_, S>) -> Result<RemoteQp> {
        let port = self.query_port()?;
        let gid = self.query_gid(0)?;
        Ok(RemoteQp { qpn: qp.qpn(), psn: 0, lid: port.lid, gid, mac: crate::context::mac_of_gid(&gid) })
    }
}

impl<'a, S> QueuePair<'a, S> {
    /// The QP without borrows (what the extended builder posts through).
    pub(crate) fn obj(&self) -> &Arc<QpObj> {
        &self.h.0
    }

    pub fn qpn(&self) -> u32 {
        self.h.0.qpn
    }

    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The capabilities granted (at least those requested).
    pub fn cap(&self) -> QpCap {
        self.h.0.cap
    }

    /// The `qp_context` given at creation.
    pub fn qp_context(&self) -> u64 {
        self.h.0.qp_context
    }

    /// The SRQ it receives through, if any.
    pub fn srqn(&self) -> Option<u32> {
        self.h.0.srq.as_ref().map(|s| s.srqn())
    }

    /// The state firmware reports (`ibv_query_qp`); differs from `S` when the device moved the QP to an error
    /// state.
    pub fn query_state(&self) -> Result<QpState> {
        self.h.0.query_state()
    }

    fn modify<T>(
        self,
        attr: &QpAttr,
        mask: QpAttrMask,
    ) -> std::result::Result<QueuePair<'a, T>, TransitionError<'a, S>> {
        match self.h.0.modify(attr, mask) {
            Ok(()) => {
                let QueuePair { ctx, h, qp_type, .. } = self;
                Ok(QueuePair { ctx, h, qp_type, _borrows: PhantomData })
            }
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }

    /// Moves the QP to the error state from any state: outstanding work completes with flush errors.
    pub fn to_error(self) -> std::result::Result<QueuePair<'a, ErrState>, TransitionError<'a, S>> {
        let attr = QpAttr { qp_state: QpState::Err, ..QpAttr::default() };
        self.modify(&attr, QpAttrMask::STATE)
    }

    /// Moves the QP back to RESET from any state; its queues start empty.
    pub fn reset(self) -> std::result::Result<QueuePair<'a, Reset>, TransitionError<'a, S>> {
        let attr = QpAttr { qp_state: QpState::Reset, ..QpAttr::default() };
        self.modify(&attr, QpAttrMask::STATE)
    }

    /// `ibv_destroy_qp`, returning firmware's error.
    pub fn destroy(self) -> Result<()> {
        self.h.0.destroy()
    }
}

impl<'a> QueuePair<'a, Reset> {
    /// RESET → INIT.
    pub fn to_init(self, a: InitAttr) -> std::result::Result<QueuePair<'a, Init>, TransitionError<'a, Reset>> {
        self.modify(&a.attr, a.mask)
    }

    /// RESET → INIT → RTR → RTS towards `peer` with rc_pingpong's parameters, granting `remote` rights. On error
    /// the QP is destroyed.
    pub fn connect_rc(self, peer: RemoteQp, remote: Access) -> Result<QueuePair<'a, Rts>> {
        self.to_init(InitAttr::rc(remote))
            .map_err(|e| e.error)?
            .to_rtr(RtrAttr::rc(peer).max_dest_rd_atomic(16))
            .map_err(|e| e.error)?
            .to_rts(RtsAttr::rc(0).max_rd_atomic(16))
            .map_err(|e| e.error)
    }

    /// RESET → INIT → RTR → RTS for a UD QP accepting `qkey`.
    pub fn activate_ud(self, qkey: u32) -> Result<QueuePair<'a, Rts>> {
        self.to_init(InitAttr::ud(qkey))
            .map_err(|e| e.error)?
            .to_rtr(RtrAttr::ud())
            .map_err(|e| e.error)?
            .to_rts(RtsAttr::ud(0))
            .map_err(|e| e.error)
    }
}

impl<'a> QueuePair<'a, Init> {
    /// INIT → RTR. For RC the address comes from `RtrAttr::rc`'s remote: a GRH with the remote GID and MAC on
    /// RoCE, the remote LID on InfiniBand.
    pub fn to_rtr(self, a: RtrAttr) -> std::result::Result<QueuePair<'a, Rtr>, TransitionError<'a, Init>> {
        let mut attr = a.attr;
        if let Some(r) = a.remote {
            let grh = Grh { dgid: r.gid, hop_limit: a.hop_limit, sgid_index: a.sgid_index, ..Grh::default() };
            attr.ah_attr = match self.ctx.link_layer() {
                // RoCE is routed by GID: always a GRH.
                LinkLayer::Ethernet => AhAttr { grh: Some(grh), dmac: r.mac, port_num: 1, ..AhAttr::default() },
                LinkLayer::InfiniBand => {
                    let across = match self.ctx.query_gid(a.sgid_index.into()) {
                        Ok(mine) => crosses_subnet(&mine, &r.gid),
                        Err(error) => return Err(TransitionError { qp: self, error }),
                    };
                    let grh = (a.global || across).then_some(grh);
                    AhAttr { dlid: r.lid, grh, port_num: 1, ..AhAttr::default() }
                }
            };
        }
        self.modify(&attr, a.mask)
    }
}

impl<'a> QueuePair<'a, Rtr> {
    /// RTR → RTS.
    pub fn to_rts(self, a: RtsAttr) -> std::result::Result<QueuePair<'a, Rts>, TransitionError<'a, Rtr>> {
        self.modify(&a.attr, a.mask)
    }
}

/// States in which sends may be posted: RTS, and ERR, where (as the IB spec says) they are accepted and
/// complete with `WR_FLUSH_ERR`.
pub trait CanSend {}
impl CanSend for Rts {}
impl CanSend for ErrState {}

impl<S: CanSend> QueuePair<'_, S> {
    /// `ibv_post_send`: posts every request and rings the doorbell once. Allocates nothing and takes only the
    /// QP's lock. On error, the requests before `PostError::index` are posted. In ERR the requests are flushed.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.h.0.post_send(wrs)
    }
}

impl<S: CanRecv> QueuePair<'_, S> {
    /// `ibv_post_recv`. Allocates nothing and takes only the QP's lock. In ERR the requests are flushed; a QP
    /// on an SRQ has no receive queue (post to the SRQ).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.h.0.post_recv(wrs)
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::mr::MrObj;

    /// `Context::set_single_threaded`: QPs and CQs made after it take single-threaded locks, those made before
    /// keep theirs, and a loopback SEND posts and completes through them.
    #[test]
    fn queues_made_after_set_single_threaded_lock_as_single_threaded() {
        use crate::{wr, Access, WorkCompletion};
        let ctx = Context::open_sim().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let before = ctx.create_cq(4).unwrap();
        // SAFETY: this test uses the context's queues from its own thread only.
        unsafe { ctx.set_single_threaded() };
        let cq = ctx.create_cq(16).unwrap();
        assert!(before.obj.ring.needs_lock(), "made before: locks");
        assert!(!cq.obj.ring.needs_lock());
        let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let mut buf = ctx.alloc_buffer(4096).unwrap();
        buf[..5].copy_from_slice(b"hello");
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap).unwrap();
        assert!(!qp.h.0.ring.needs_lock());
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        qp.post_recv(&[wr::recv(1, &[mr.sge(2048, 2048)])]).unwrap();
        qp.post_send(&[wr::send(2, &[mr.sge(0, 5)])]).unwrap();
        let mut wc = [WorkCompletion::default(); 4];
        assert_eq!(cq.poll_until(&mut wc, 2, std::time::Duration::from_secs(5)).unwrap(), 2);
        assert_eq!(mr.read_vec(2048, 5), b"hello");
        assert!(!qp.h.0.ring.is_held() && !cq.obj.ring.is_held(), "every guard released");
    }

    /// A QP and CQ made in one thread and used in another: their locks are biased to the thread that posts and
    /// polls (not the maker, whose control-path locks take no bias), and a later post from the maker still
    /// excludes it and completes.
    #[test]
    fn queues_are_biased_to_the_thread_that_posts_and_polls() {
        use crate::{wr, Access, WorkCompletion};
        let ctx = Context::open_sim().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let mut buf = ctx.alloc_buffer(4096).unwrap();
        buf[..5].copy_from_slice(b"hello");
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap).unwrap();
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        assert!(!qp.h.0.ring.owned_here() && !cq.obj.ring.owned_here(), "the maker takes no bias");
        let exchange = |id: u64| {
            let mut wc = [WorkCompletion::default(); 4];
            qp.post_recv(&[wr::recv(id, &[mr.sge(2048, 2048)])]).unwrap();
            qp.post_send(&[wr::send(id + 1, &[mr.sge(0, 5)])]).unwrap();
            assert_eq!(cq.poll_until(&mut wc, 2, std::time::Duration::from_secs(5)).unwrap(), 2);
            assert!(wc[..2].iter().all(|w| w.status == crate::WcStatus::Success));
            let mut ids = [wc[0].wr_id, wc[1].wr_id];
            ids.sort();
            assert_eq!(ids, [id, id + 1]);
        };
        std::thread::scope(|s| {
            s.spawn(|| {
                exchange(10);
                let biased = crate::spin::bias_available();
                assert_eq!(qp.h.0.ring.owned_here(), biased, "the poster owns the QP's lock");
                assert_eq!(cq.obj.ring.owned_here(), biased, "the poller owns the CQ's lock");
            });
        });
        // The maker visits: it still posts and polls (the owner is shut out while it does).
        exchange(20);
        assert_eq!(mr.read_vec(2048, 5), b"hello");
        assert!(!qp.h.0.ring.is_held() && !cq.obj.ring.is_held(), "every guard released");
    }

    /// The objects without borrows, as a C caller holds them: destroying a PD or CQ still in use is refused with
    /// `Busy` (`EBUSY`) and works once its users are gone.
    #[test]
    fn destroying_a_pd_or_cq_in_use_is_busy() {
        let ctx = Context::open_sim().unwrap();
        let pd = PdObj::alloc(&ctx.shared).unwrap();
        let cq = CqObj::create(&ctx.shared, mlx5_core::hca::CqAttr { cqe: 8, ..Default::default() }, 0, None).unwrap();
        let mut buf = ctx.alloc_buffer(4096).unwrap();
        let mr = MrObj::reg(&pd, buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE).unwrap();
        let attr = CoreQpInitAttr {
            qp_type: QpType::Rc,
            cap: QpCap { max_send_wr: 1, max_recv_wr: 1, ..QpCap::default() },
            sq_sig_all: false,
        };
        let qp = QpObj::create(&pd, &cq, &cq, attr, None, 0).unwrap();
        assert!(matches!(pd.dealloc(), Err(VerbsError::Busy { users: 2, .. })));
        assert!(matches!(cq.destroy(false), Err(VerbsError::Busy { users: 2, .. })), "send and receive side");
        qp.destroy().unwrap();
        qp.destroy().unwrap();
        cq.destroy(true).unwrap();
        assert!(matches!(pd.dealloc(), Err(VerbsError::Busy { users: 1, .. })));
        mr.dereg().unwrap();
        pd.dealloc().unwrap();
        assert!(pd.dealloc().is_ok(), "a second dealloc finds nothing to do");
    }

    /// As `ibv_destroy_srq`: an SRQ with QPs attached is `Busy` (and its PD too); once they are gone it goes.
    #[test]
    fn destroying_an_srq_with_qps_attached_is_busy() {
        let ctx = Context::open_sim().unwrap();
        let pd = PdObj::alloc(&ctx.shared).unwrap();
        let cq = CqObj::create(&ctx.shared, mlx5_core::hca::CqAttr { cqe: 8, ..Default::default() }, 0, None).unwrap();
        let srq = SrqObj::create(&pd, mlx5_core::hca::SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 0 }).unwrap();
        let attr = CoreQpInitAttr {
            qp_type: QpType::Rc,
            cap: QpCap { max_send_wr: 1, ..QpCap::default() },
            sq_sig_all: false,
        };
        let a = QpObj::create(&pd, &cq, &cq, attr, Some(&srq), 1).unwrap();
        let b = QpObj::create(&pd, &cq, &cq, attr, Some(&srq), 2).unwrap();
        assert_eq!(cq.ring.lock().srqs.get(&srq.srqn()).map(|e| e.1), Some(2), "one table entry for both QPs");
        assert!(matches!(srq.destroy(), Err(VerbsError::Busy { what: "shared receive queue", users: 2 })));
        assert!(matches!(pd.dealloc(), Err(VerbsError::Busy { users: 3, .. })), "two QPs and the SRQ");
        a.destroy().unwrap();
        assert!(matches!(srq.destroy(), Err(VerbsError::Busy { users: 1, .. })));
        b.destroy().unwrap();
        assert!(cq.ring.lock().srqs.is_empty(), "the CQ forgets the SRQ with its last QP");
        srq.destroy().unwrap();
        srq.destroy().unwrap();
        assert!(matches!(srq.post_recv(&[]), Err(VerbsError::Destroyed { .. })));
        cq.destroy(true).unwrap();
        pd.dealloc().unwrap();
    }

    /// The poll's one-QP path is taken exactly while a CQ has one QP and no SRQ: its `single` ring follows QPs
    /// and SRQs coming and going, on the send and the receive CQ alike.
    #[test]
    fn a_cq_keeps_its_single_qp_as_qps_come_and_go() {
        let ctx = Context::open_sim().unwrap();
        let pd = PdObj::alloc(&ctx.shared).unwrap();
        let attr8 = mlx5_core::hca::CqAttr { cqe: 8, ..Default::default() };
        let (cq, rcq) =
            (CqObj::create(&ctx.shared, attr8, 0, None).unwrap(), CqObj::create(&ctx.shared, attr8, 0, None).unwrap());
        let srq = SrqObj::create(&pd, mlx5_core::hca::SrqAttr { max_wr: 4, max_sge: 1, srq_limit: 0 }).unwrap();
        let attr = CoreQpInitAttr {
            qp_type: QpType::Rc,
            cap: QpCap { max_send_wr: 1, max_recv_wr: 1, ..QpCap::default() },
            sq_sig_all: false,
        };
        let single = |c: &CqObj| c.ring.lock().single.clone();
        assert!(single(&cq).is_none(), "no QP yet");
        let a = QpObj::create(&pd, &cq, &rcq, attr, None, 1).unwrap();
        assert!(single(&cq).is_some_and(|r| Arc::ptr_eq(&r, &a.ring)), "the send CQ's one QP");
        assert!(single(&rcq).is_some_and(|r| Arc::ptr_eq(&r, &a.ring)), "the receive CQ's one QP");
        let b = QpObj::create(&pd, &cq, &cq, attr, None, 2).unwrap();
        assert!(single(&cq).is_none(), "two QPs complete on it");
        assert!(single(&rcq).is_some_and(|r| Arc::ptr_eq(&r, &a.ring)));
        a.destroy().unwrap();
        assert!(single(&cq).is_some_and(|r| Arc::ptr_eq(&r, &b.ring)), "one QP again");
        assert!(single(&rcq).is_none(), "no QP left");
        b.destroy().unwrap();
        assert!(single(&cq).is_none());
        let c = QpObj::create(&pd, &rcq, &rcq, attr, Some(&srq), 3).unwrap();
        assert!(single(&rcq).is_none(), "a QP on an SRQ goes through the table");
        c.destroy().unwrap();
        srq.destroy().unwrap();
        cq.destroy(true).unwrap();
        rcq.destroy(true).unwrap();
        pd.dealloc().unwrap();
    }
}

/// Work on a send batch, monomorphized for the device's register access
/// ([`RawQp::post_send_each`](crate::raw::RawQp::post_send_each)): the drop-in's `ibv_post_send` walks the
/// program's list in it.
pub trait SendBatchFn {
    type Out;
    fn run<M: Mmio + ?Sized>(self, b: &mut SendBatch<'_, M>) -> Self::Out;
}

/// Work on the core's QP with the device's own register access ([`RawQp::post_each_or`](crate::raw::RawQp::post_each_or)),
/// under the QP's lock.
pub trait QpFn {
    type Out;
    fn run<M: Mmio + ?Sized>(self, qp: &mut mlx5_core::qp::Qp, m: &M) -> Self::Out;
}

/// A [`QpFn`] that answers for itself when it cannot run, so a post returns its own result and no error is made:
/// the drop-in's posts ([`RawQp::post_each_or`](crate::raw::RawQp::post_each_or)).
pub trait QpFnOr: QpFn {
    /// The answer when the QP is destroyed (`dead` false) or its device dead (`dead` true).
    fn unavailable(self, dead: bool) -> Self::Out;
}

/// Work on a receive batch, as [`SendBatchFn`].
pub trait RecvBatchFn {
    type Out;
    fn run<M: Mmio + ?Sized>(self, b: &mut RecvBatch<'_, M>) -> Self::Out;
}

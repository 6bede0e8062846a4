//! Queue pairs (`ibv_qp`) whose states are types, their attributes, and the datapath's posts.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use mlx5_core::cq::LinkLayer;
use mlx5_core::hca::QpInitAttr;
use mlx5_core::mkey::Access;
use mlx5_core::qp::{
    required_attrs, AhAttr, Grh, Mtu, PostError, PostErrorKind, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr,
    SendWr,
};

use crate::context::Context;
use crate::cq::{CompletionQueue, CqObj, QpCell};
use crate::error::{Result, VerbsError};
use crate::event::lock;
use crate::pd::{PdObj, ProtectionDomain};

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

/// What the peer of an RC QP (or the target of an exchange) is: QPN, first PSN, and its address on the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteQp {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub mac: [u8; 6],
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
        RtrAttr { attr, mask: required(QpType::Rc, QpState::Init, QpState::Rtr), remote: Some(remote) }
    }

    /// A UD QP: nothing but the state.
    pub fn ud() -> Self {
        let attr = QpAttr { qp_state: QpState::Rtr, ..QpAttr::default() };
        RtrAttr { attr, mask: required(QpType::Ud, QpState::Init, QpState::Rtr), remote: None }
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
    send_cq: Arc<CqObj>,
    recv_cq: Arc<CqObj>,
    qpn: u32,
    cap: QpCap,
    ring: QpCell,
}

impl QpObj {
    /// `ibv_create_qp`: locks the control path, then both CQs (ascending CQN), then creates the QP in RESET and
    /// enters it into the CQs' tables.
    pub(crate) fn create(
        pd: &Arc<PdObj>,
        send_cq: &Arc<CqObj>,
        recv_cq: &Arc<CqObj>,
        attr: QpInitAttr,
    ) -> Result<QpObj> {
        let mut c = pd.ctx.dev.control();
        let (first, second) = if send_cq.cqn() <= recv_cq.cqn() { (send_cq, recv_cq) } else { (recv_cq, send_cq) };
        let mut g1 = lock(&first.ring);
        let mut g2 = (!Arc::ptr_eq(first, second)).then(|| lock(&second.ring));
        let pd_guard = lock(&pd.pd);
        let p = pd_guard.as_ref().ok_or_else(|| VerbsError::Invalid("protection domain deallocated".into()))?;
        let destroyed = || VerbsError::Invalid("CQ already destroyed".into());
        let qp = {
            let c1 = g1.cq.as_ref().ok_or_else(destroyed)?;
            let c2 = match &g2 {
                Some(g) => g.cq.as_ref().ok_or_else(destroyed)?,
                None => c1,
            };
            let (s, r) = if Arc::ptr_eq(first, send_cq) { (c1, c2) } else { (c2, c1) };
            let (hca, delay) = c.parts();
            hca.create_qp(p, s, r, attr, delay)?
        };
        let (qpn, cap) = (qp.qpn(), qp.cap());
        let ring: QpCell = Arc::new(Mutex::new(Some(qp)));
        g1.qps.insert(qpn, ring.clone());
        if let Some(g) = &mut g2 {
            g.qps.insert(qpn, ring.clone());
        }
        pd.users.fetch_add(1, Ordering::AcqRel);
        send_cq.users.fetch_add(1, Ordering::AcqRel);
        recv_cq.users.fetch_add(1, Ordering::AcqRel);
        c.route_qp(qpn, pd.ctx.id);
        Ok(QpObj { pd: pd.clone(), send_cq: send_cq.clone(), recv_cq: recv_cq.clone(), qpn, cap, ring })
    }

    /// `ibv_modify_qp`.
    pub(crate) fn modify(&self, attr: &QpAttr, mask: QpAttrMask) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        let mut g = lock(&self.ring);
        let qp = g.as_mut().ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        let (hca, delay) = c.parts();
        Ok(hca.modify_qp(qp, attr, mask, delay)?)
    }

    /// `ibv_query_qp`'s state.
    pub(crate) fn query_state(&self) -> Result<QpState> {
        let mut c = self.pd.ctx.dev.control();
        let g = lock(&self.ring);
        let qp = g.as_ref().ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        let (hca, delay) = c.parts();
        Ok(hca.query_qp(qp, delay)?.state)
    }

    /// `ibv_post_send`: the QP's lock only. A dead device fails the post as `Hca::post_send` does.
    pub(crate) fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut g = lock(&self.ring);
        let qp = g.as_mut().ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        let dev = &self.pd.ctx.dev;
        if dev.is_dead() {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError }.into());
        }
        Ok(qp.post_send(&dev.mmio, wrs)?)
    }

    /// `ibv_post_recv`: the QP's lock only.
    pub(crate) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let mut g = lock(&self.ring);
        let qp = g.as_mut().ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        let dev = &self.pd.ctx.dev;
        if dev.is_dead() {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError }.into());
        }
        Ok(qp.post_recv(&dev.mmio, wrs)?)
    }

    /// `ibv_destroy_qp`: out of the CQs' tables (control, CQ, then QP lock), then DESTROY_QP. Idempotent.
    pub(crate) fn destroy(&self) -> Result<()> {
        let mut c = self.pd.ctx.dev.control();
        let (first, second) = if self.send_cq.cqn() <= self.recv_cq.cqn() {
            (&self.send_cq, &self.recv_cq)
        } else {
            (&self.recv_cq, &self.send_cq)
        };
        let mut g1 = lock(&first.ring);
        let mut g2 = (!Arc::ptr_eq(first, second)).then(|| lock(&second.ring));
        let Some(qp) = lock(&self.ring).take() else { return Ok(()) };
        g1.qps.remove(&self.qpn);
        if let Some(g) = &mut g2 {
            g.qps.remove(&self.qpn);
        }
        drop((g1, g2));
        c.unroute_qp(self.qpn);
        let (hca, delay) = c.parts();
        if let Err(e) = hca.destroy_qp(qp, delay) {
            // Firmware may still hold the QP, and with it the PD and CQs: they stay counted as used.
            c.orphan_qps.push(e.obj);
            return Err(VerbsError::Destroy(e.error));
        }
        self.pd.users.fetch_sub(1, Ordering::AcqRel);
        self.send_cq.users.fetch_sub(1, Ordering::AcqRel);
        self.recv_cq.users.fetch_sub(1, Ordering::AcqRel);
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

impl<'ctx> ProtectionDomain<'ctx> {
    /// `ibv_create_qp`: a QP in RESET completing sends on `send_cq` and receives on `recv_cq`.
    pub fn create_qp<'a>(
        &'a self,
        qp_type: QpType,
        send_cq: &'a CompletionQueue<'ctx>,
        recv_cq: &'a CompletionQueue<'ctx>,
        cap: QpCap,
    ) -> Result<QueuePair<'a, Reset>> {
        let attr = QpInitAttr { qp_type, cap, sq_sig_all: false };
        let obj = QpObj::create(&self.obj, &send_cq.obj, &recv_cq.obj, attr)?;
        Ok(QueuePair { ctx: self.context(), h: QpHandle(Arc::new(obj)), qp_type, _borrows: PhantomData })
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
            attr.ah_attr = match self.ctx.link_layer() {
                LinkLayer::Ethernet => AhAttr {
                    grh: Some(Grh { dgid: r.gid, hop_limit: 64, ..Grh::default() }),
                    dmac: r.mac,
                    port_num: 1,
                    ..AhAttr::default()
                },
                LinkLayer::InfiniBand => AhAttr { dlid: r.lid, port_num: 1, ..AhAttr::default() },
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

impl QueuePair<'_, Rts> {
    /// `ibv_post_send`: posts every request and rings the doorbell once. Allocates nothing and takes only the
    /// QP's lock. On error, the requests before `PostError::index` are posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        self.h.0.post_send(wrs)
    }
}

impl<S: CanRecv> QueuePair<'_, S> {
    /// `ibv_post_recv`. Allocates nothing and takes only the QP's lock.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.h.0.post_recv(wrs)
    }
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::mr::MrObj;

    /// The objects without borrows, as a C caller holds them: destroying a PD or CQ still in use is refused with
    /// `Busy` (`EBUSY`) and works once its users are gone.
    #[test]
    fn destroying_a_pd_or_cq_in_use_is_busy() {
        let ctx = Context::open_sim().unwrap();
        let pd = PdObj::alloc(&ctx.shared).unwrap();
        let cq = CqObj::create(&ctx.shared, mlx5_core::hca::CqAttr { cqe: 8, ..Default::default() }).unwrap();
        let mut buf = ctx.alloc_buffer(4096).unwrap();
        let mr = MrObj::reg(&pd, buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE).unwrap();
        let attr = QpInitAttr {
            qp_type: QpType::Rc,
            cap: QpCap { max_send_wr: 1, max_recv_wr: 1, ..QpCap::default() },
            sq_sig_all: false,
        };
        let qp = QpObj::create(&pd, &cq, &cq, attr).unwrap();
        assert!(matches!(pd.dealloc(), Err(VerbsError::Busy { users: 2, .. })));
        assert!(matches!(cq.destroy(), Err(VerbsError::Busy { users: 2, .. })), "send and receive side");
        qp.destroy().unwrap();
        qp.destroy().unwrap();
        cq.destroy().unwrap();
        assert!(matches!(pd.dealloc(), Err(VerbsError::Busy { users: 1, .. })));
        mr.dereg().unwrap();
        pd.dealloc().unwrap();
        assert!(pd.dealloc().is_ok(), "a second dealloc finds nothing to do");
    }
}

//! Completion queues (`ibv_cq`): polling without the control mutex, the completion channel's arming and
//! acknowledgement.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use mlx5_core::cq::{Cq, CqeError, Notify, WcSink, WorkCompletion, WrTable};
use mlx5_core::hca::{poll_cq_into, CqAttr};
use mlx5_core::qp::Qp;
use mlx5_core::srq::Srq;

use crate::backend::{AnyHca, DeviceKind};
use crate::context::{Context, ContextShared};
use crate::error::{Result, VerbsError};
use crate::event::{lock, ChannelShared};
use crate::shared::{CqEventTarget, CqRoute, DeviceShared};
use crate::spin::{SpinGuard, SpinLock};

/// A QP's ring behind its own lock (a spin lock, as rdma-core's queues: [`crate::spin`]), shared by the QP and the CQs it completes on; `None` once destroyed.
pub(crate) type QpCell = Arc<SpinLock<Option<Qp>>>;

/// An SRQ's ring behind its own mutex, shared by the SRQ and the CQs its QPs complete receives on.
pub(crate) type SrqCell = Arc<Mutex<Option<Srq>>>;

/// A QP completing on a CQ: its ring and, when it receives through an SRQ, that SRQ's number.
#[derive(Debug)]
pub(crate) struct QpEntry {
    pub(crate) cell: QpCell,
    pub(crate) srqn: Option<u32>,
}

/// Bad CQEs one poll steps over (reporting the first on the next call) before it returns: bounds a poll on a
/// device that writes nothing but bad entries.
const MAX_BAD_PER_POLL: u32 = 64;

/// What a CQ's mutex guards: the ring, the QPs completing on it by QPN, and the SRQs those QPs receive through.
#[derive(Debug)]
pub(crate) struct CqRing {
    /// The CQ until destroyed.
    pub(crate) cq: Option<Cq>,
    pub(crate) qps: HashMap<u32, QpEntry, QpnHash>,
    /// By SRQN, with the number of this CQ's QPs attached to each.
    pub(crate) srqs: HashMap<u32, (SrqCell, usize), QpnHash>,
    /// A bad CQE met after good completions: reported by the next poll, so a poll returning fewer completions
    /// than asked still means the CQ is empty.
    pending: Option<CqeError>,
    /// The ring of the one QP on this CQ when there is exactly one and no SRQ (see [`CqObj::poll_into`]); kept
    /// by [`CqRing::settle`] whenever `qps` or `srqs` change.
    pub(crate) single: Option<QpCell>,
}

impl CqRing {
    /// Sets `single` from the tables: called after every change of `qps` or `srqs`.
    pub(crate) fn settle(&mut self) {
        self.single = match (self.qps.len(), self.srqs.is_empty()) {
            (1, true) => self.qps.values().next().map(|e| e.cell.clone()),
            _ => None,
        };
    }
}

/// The work-request tables of a CQ's QPs and SRQs, looked up by QPN when a CQE names one. The CQ's lock is held;
/// a QP's is taken for one lookup, an SRQ's for one `srq_done` (lock order CQ → QP → SRQ; the QP's SRQ is known
/// from the CQ's table, so an SRQ receive takes no QP lock).
struct QpTable<'a> {
    qps: &'a HashMap<u32, QpEntry, QpnHash>,
    srqs: &'a HashMap<u32, (SrqCell, usize), QpnHash>,
    /// The QP the last CQE named: consecutive CQEs mostly name the same one (libmlx5 keeps `cur_rsc` alike).
    last: Option<(u32, &'a QpEntry)>,
    /// That QP's ring, its lock held until a CQE names another QP or the poll ends: one lock per run of CQEs,
    /// not per CQE (the CQ's lock is held throughout, so the order stays CQ → QP).
    held: Option<(u32, SpinGuard<'a, Option<Qp>>)>,
    /// The held QP's number while its ring is live, else [`NO_QPN`]: a send CQE naming it takes `ring` after one
    /// compare (the two `Option`s above are checked only when the held QP changes).
    send_qpn: u32,
    /// The same for receive CQEs: [`NO_QPN`] also when the held QP receives through an SRQ.
    recv_qpn: u32,
    /// The held QP's ring (inside `held`'s guard) while `send_qpn` is not [`NO_QPN`]; null otherwise.
    ring: *mut Qp,
}

/// A number no CQE names (QP numbers are 24 bits): the fast path's compare then never matches.
const NO_QPN: u32 = u32::MAX;

impl<'a> QpTable<'a> {
    fn new(qps: &'a HashMap<u32, QpEntry, QpnHash>, srqs: &'a HashMap<u32, (SrqCell, usize), QpnHash>) -> Self {
        QpTable { qps, srqs, last: None, held: None, send_qpn: NO_QPN, recv_qpn: NO_QPN, ring: std::ptr::null_mut() }
    }

    #[inline(always)]
    fn qp(&mut self, qpn: u32) -> Option<&'a QpEntry> {
        match self.last {
            Some((n, q)) if n == qpn => Some(q),
            _ => self.find(qpn),
        }
    }

    /// The table lookup when a CQE names another QP than the last (out of line: runs of CQEs name one QP).
    #[inline(never)]
    fn find(&mut self, qpn: u32) -> Option<&'a QpEntry> {
        let q = self.qps.get(&qpn)?;
        self.last = Some((qpn, q));
        Some(q)
    }

    /// The ring of QP `qpn`, locked (the lock kept for the next CQE); out of line, the fast paths being in
    /// [`QpTable::send_done`] and [`QpTable::recv_done`].
    #[inline(never)]
    fn ring(&mut self, qpn: u32) -> Option<&mut Qp> {
        if self.held.as_ref().is_none_or(|(n, _)| *n != qpn) {
            // The previous QP's lock goes first: two QP locks are never held together.
            self.release();
            let q = self.qp(qpn)?;
            let (_, guard) = self.held.insert((qpn, q.cell.lock_as::<false>()));
            // A destroyed QP's ring is `None`: the fast paths then keep matching nothing.
            if let Some(ring) = guard.as_mut() {
                self.ring = ring;
                self.send_qpn = qpn;
                self.recv_qpn = if q.srqn.is_none() { qpn } else { NO_QPN };
            }
        }
        // SAFETY: as in `send_done`: `send_qpn` is `qpn` only while `held` keeps this QP's live ring locked, and
        // `ring` points into it.
        (self.send_qpn == qpn).then(|| unsafe { &mut *self.ring })
    }

    /// Gives back the held QP's lock; the fast paths match nothing until [`QpTable::ring`] takes another.
    fn release(&mut self) {
        self.send_qpn = NO_QPN;
        self.recv_qpn = NO_QPN;
        self.ring = std::ptr::null_mut();
        self.held = None;
    }

    /// A receive CQE of a QP other than the held one, or of one that receives through an SRQ.
    #[inline(never)]
    fn recv_other(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        let q = self.qp(qpn)?;
        match q.srqn {
            // As the core's `WithSrqs`: the CQE's WQE counter names a WQE of the QP's SRQ.
            Some(s) => lock(&self.srqs.get(&s)?.0).as_mut()?.srq_done(wqe_counter).ok(),
            None => self.ring(qpn)?.recv_done(qpn, srqn, wqe_counter),
        }
    }
}

/// Hashes a QP or SRQ number for the CQ's tables: the numbers are the device's, so no flooding to defend against,
/// and a multiply is what a lookup per CQE can afford (SipHash cost more than the rest of the CQE's handling).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct QpnHash;

impl std::hash::BuildHasher for QpnHash {
    type Hasher = QpnHasher;
    fn build_hasher(&self) -> QpnHasher {
        QpnHasher(0)
    }
}

/// See [`QpnHash`].
#[derive(Debug)]
pub(crate) struct QpnHasher(u64);

impl std::hash::Hasher for QpnHasher {
    fn finish(&self) -> u64 {
        // Fibonacci hashing: the high bits, which hashbrown uses for its control bytes, depend on every key bit.
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | u64::from(*b)).rotate_left(5);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 ^= u64::from(n);
    }
}

// The per-CQE methods inline into the core's poll loop (instantiated in the drop-in's crate): a call each cost
// more than the lookup's fast path.
impl WrTable for QpTable<'_> {
    #[inline(always)]
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        if qpn == self.send_qpn {
            // SAFETY: `send_qpn` names a QP only while `held` keeps that QP's lock and its ring is live, and `ring`
            // points into that guard's value (set together in `ring`, cleared together in `release`); the guard
            // is not otherwise used while this borrow lives.
            return unsafe { &mut *self.ring }.send_done(qpn, wqe_counter);
        }
        self.ring(qpn)?.send_done(qpn, wqe_counter)
    }
    #[inline(always)]
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        if qpn == self.recv_qpn {
            // SAFETY: as in `send_done`; `recv_qpn` names the held QP only when it has no SRQ.
            return unsafe { &mut *self.ring }.recv_done(qpn, srqn, wqe_counter);
        }
        self.recv_other(qpn, srqn, wqe_counter)
    }
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        // Every QP's lock is taken below, the held one's too.
        self.release();
        self.qps.values().find_map(|q| q.cell.lock().as_mut().and_then(|q| WrTable::flush_one(q, cqn, dead)))
    }
    fn recv_srqn(&self, qpn: u32) -> Option<u32> {
        self.qps.get(&qpn)?.srqn
    }
}

/// A completion queue without borrows. `users` counts the QPs completing on it (changed under the control mutex).
#[derive(Debug)]
pub(crate) struct CqObj {
    pub(crate) ctx: Arc<ContextShared>,
    cqn: u32,
    cq_context: u64,
    pub(crate) ring: SpinLock<CqRing>,
    /// Set by a CQ error event: the device writes no more CQEs here.
    failed: Arc<AtomicBool>,
    pub(crate) users: AtomicUsize,
    /// Completion events handed out and not acknowledged; `acked` is notified when it falls.
    unacked: Mutex<u32>,
    acked: Condvar,
    /// The channel it reports to, kept open while the CQ lives.
    _channel: Option<Arc<ChannelShared>>,
}

impl CqObj {
    pub(crate) fn create(
        ctx: &Arc<ContextShared>,
        attr: CqAttr,
        cq_context: u64,
        channel: Option<(u64, Option<Arc<ChannelShared>>)>,
    ) -> Result<Arc<CqObj>> {
        let mut c = ctx.dev.control();
        let (hca, delay) = c.parts();
        let cq = hca.create_cq(attr, delay)?;
        let cqn = cq.cqn();
        let failed = Arc::new(AtomicBool::new(false));
        let (channel_id, channel) = match channel {
            Some((id, ch)) => (Some(id), ch),
            None => (None, None),
        };
        let ring =
            CqRing { cq: Some(cq), qps: HashMap::default(), srqs: HashMap::default(), pending: None, single: None };
        let obj = Arc::new(CqObj {
            ctx: ctx.clone(),
            cqn,
            cq_context,
            ring: ctx.queue_lock(ring),
            failed: failed.clone(),
            users: AtomicUsize::new(0),
            unacked: Mutex::new(0),
            acked: Condvar::new(),
            _channel: channel,
        });
        let target: Arc<dyn CqEventTarget> = obj.clone();
        let weak: Weak<dyn CqEventTarget> = Arc::downgrade(&target);
        c.route_cq(cqn, CqRoute { ctx: ctx.id, failed, channel: channel_id, obj: weak });
        Ok(obj)
    }

    pub(crate) fn cqn(&self) -> u32 {
        self.cqn
    }

    /// `ibv_poll_cq`. Takes this CQ's lock and the locks of the QPs and SRQs its CQEs name, never the control
    /// mutex; the device state it needs is two atomic loads, made only when the ring is empty.
    ///
    /// Fewer completions than `wc` holds means the CQ is empty: a bad CQE met after good completions is stepped
    /// over and reported by the next call, and the software flush of a dead device or failed CQ is asked for
    /// within the same call once the ring is drained.
    pub(crate) fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        self.poll_into(wc)
    }

    /// [`CqObj::poll`] into any [`WcSink`]: the drop-in writes `ibv_wc` straight from each CQE.
    #[inline]
    pub(crate) fn poll_into<S: WcSink + ?Sized>(&self, wc: &mut S) -> Result<usize> {
        let mut r = self.ring.lock_as::<false>();
        let CqRing { cq, qps, srqs, pending, single } = &mut *r;
        if let Some(e) = pending.take() {
            return Err(VerbsError::Cqe(e));
        }
        // Made only when needed: the error has drop glue the hot path would run.
        let Some(cq) = cq.as_mut() else { return Err(VerbsError::Destroyed { what: "completion queue" }) };
        // One QP on this CQ, with its own receive queue (a CQ per QP, or one QP's send and receive CQ): when a
        // completion is there, its ring is locked once and is the table itself, as in the core's own poll (no
        // lookup per CQE). A CQE naming another QP is then unknown, as the table would find it. Checked before
        // the lock, so an empty poll does not take the QP's lock from a thread posting on it.
        if let Some(cell) = single.as_ref().filter(|_| cq.ready()) {
            let mut ring = cell.lock_as::<false>();
            if let Some(qp) = ring.as_mut() {
                return self.poll_with(cq, qp, pending, wc);
            }
        }
        let mut table = QpTable::new(qps, srqs);
        self.poll_with(cq, &mut table, pending, wc)
    }

    /// The poll loop over `table`, the CQ's lock held: completions into `wc`, a bad CQE met after good ones kept
    /// in `pending`, and the flush of a dead device or failed CQ once the ring is drained.
    #[inline(always)]
    fn poll_with<S: WcSink + ?Sized, T: WrTable + ?Sized>(
        &self,
        cq: &mut Cq,
        table: &mut T,
        pending: &mut Option<CqeError>,
        wc: &mut S,
    ) -> Result<usize> {
        let dev = &self.ctx.dev;
        let cap = wc.capacity();
        // Once the device is dead or the CQ failed, outstanding work requests complete here as flushed.
        let stopped = || {
            let dead = dev.is_dead();
            (dead || self.failed.load(Ordering::Acquire)).then_some(dead)
        };
        // The first pass fills `wc` from its start (no offset added per completion); it is usually the only one.
        // An error with nothing returned yet is this call's result.
        let mut n = match poll_cq_into(&dev.mmio, cq, table, wc, stopped) {
            Ok(k) if k == 0 || k == cap => return Ok(k),
            Ok(k) => k,
            Err(e) => return Err(VerbsError::Cqe(e)),
        };
        let mut bad = 0;
        while n < cap {
            let mut rest = Offset { sink: &mut *wc, at: n, cap: cap - n };
            match poll_cq_into(&dev.mmio, cq, table, &mut rest, stopped) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) => {
                    // The completions already taken go back now; the first bad entry is reported next.
                    pending.get_or_insert(e);
                    bad += 1;
                    if bad >= MAX_BAD_PER_POLL {
                        break;
                    }
                }
            }
        }
        Ok(n)
    }

    pub(crate) fn req_notify(&self, notify: Notify) -> Result<()> {
        let mut c = self.ctx.dev.control();
        let r = self.ring.lock();
        let cq = r.cq.as_ref().ok_or(VerbsError::Destroyed { what: "completion queue" })?;
        Ok(c.hca().req_notify_cq(cq, notify)?)
    }

    pub(crate) fn moderate(&self, cq_count: u16, cq_period: u16) -> Result<()> {
        let mut c = self.ctx.dev.control();
        let r = self.ring.lock();
        let cq = r.cq.as_ref().ok_or(VerbsError::Destroyed { what: "completion queue" })?;
        let (hca, delay) = c.parts();
        Ok(hca.modify_cq(cq, cq_count, cq_period, delay)?)
    }

    pub(crate) fn ack_events(&self, n: u32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let mut c = self.ctx.dev.control();
        let r = self.ring.lock();
        let mut unacked = lock(&self.unacked);
        if n > *unacked {
            return Err(VerbsError::Invalid(format!("{n} completion events to acknowledge, {} taken", *unacked)));
        }
        if let Some(cq) = r.cq.as_ref() {
            c.hca().ack_cq_events(cq, n)?;
        }
        *unacked -= n;
        drop(unacked);
        self.acked.notify_all();
        Ok(())
    }

    /// Completion events taken and not acknowledged yet.
    pub(crate) fn unacked_events(&self) -> u32 {
        *lock(&self.unacked)
    }

    /// `ibv_destroy_cq`: refused with [`VerbsError::Busy`] while QPs complete on it. With `wait`, first waits
    /// until every completion event taken for it is acknowledged, as libibverbs' `ibv_destroy_cq` does;
    /// without, acknowledges them (the drop path: a destructor must not block on another thread's progress).
    pub(crate) fn destroy(&self, wait: bool) -> Result<()> {
        if wait {
            let mut u = lock(&self.unacked);
            while *u > 0 {
                u = self.acked.wait(u).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
        let mut c = self.ctx.dev.control();
        let users = self.users.load(Ordering::Acquire);
        if users > 0 {
            return Err(VerbsError::Busy { what: "completion queue", users });
        }
        let Some(cq) = self.ring.lock().cq.take() else { return Ok(()) };
        let queued = c.unroute_cq(self.cqn);
        let (hca, delay) = c.parts();
        let mut u = lock(&self.unacked);
        if *u + queued > 0 {
            // The core refuses to destroy a CQ with events outstanding; the drop path gives them back, and so
            // are the events that arrived after the caller's last ibv_get_cq_event and were never handed out.
            let _ = hca.ack_cq_events(&cq, *u + queued);
            *u = 0;
        }
        drop(u);
        self.acked.notify_all();
        if let Err(e) = hca.destroy_cq(cq, delay) {
            c.orphan_cqs.push(e.obj);
            return Err(VerbsError::Destroy(e.error));
        }
        Ok(())
    }
}

impl CqEventTarget for CqObj {
    fn cqn(&self) -> u32 {
        self.cqn
    }
    fn cq_context(&self) -> u64 {
        self.cq_context
    }
    fn event_taken(&self) {
        *lock(&self.unacked) += 1;
    }
    fn ack_dropped(&self, hca: &mut AnyHca) {
        if let Some(cq) = self.ring.lock().cq.as_ref() {
            let _ = hca.ack_cq_events(cq, 1);
        }
    }
    fn ack(&self, n: u32) -> Result<()> {
        self.ack_events(n)
    }
}

/// Waits up to `timeout` for the next completion event of channel `ch` of `dev`. On VFIO it sleeps on the EQ's
/// interrupt; on the simulator it polls the EQ.
pub(crate) fn wait_cq_event(dev: &DeviceShared, ch: u64, timeout: Duration) -> Result<Option<Arc<dyn CqEventTarget>>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(t) = dev.control().next_cq_event(ch)? {
            return Ok(Some(t));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        match &dev.kind {
            DeviceKind::Vfio(v) => match &v.irqs {
                Some(irqs) => {
                    // Any vector: each completion EQ interrupts on its own, and the async EQ (a fatal error)
                    // on vector 0. Bounded: another context's thread may take the interrupt and route this
                    // channel's event.
                    irqs.wait_any(left.min(Duration::from_millis(10)))?;
                }
                None => std::thread::sleep(left.min(Duration::from_micros(50))),
            },
            #[cfg(feature = "sim")]
            DeviceKind::Sim(_) => std::thread::sleep(left.min(Duration::from_micros(50))),
        }
    }
}

/// A completion channel (`ibv_comp_channel`): CQs created on it report their completion events here, and its
/// descriptor ([`CompChannel::fd`]) is readable while one waits. A context may have several; each also has a
/// default channel of its own ([`Context::get_cq_event`]), which [`Context::create_cq`] uses.
#[derive(Debug)]
pub struct CompChannel<'ctx> {
    ctx: &'ctx Context,
    shared: Arc<ChannelShared>,
}

/// One completion event (`ibv_get_cq_event`): the CQ it is for and the `cq_context` the CQ was created with.
/// Acknowledge it with [`CqEvent::ack`] or [`CompletionQueue::ack_events`]; `ibv_destroy_cq` waits for that.
#[derive(Debug)]
pub struct CqEvent {
    target: Arc<dyn CqEventTarget>,
}

impl CqEvent {
    /// The CQ's number.
    pub fn cqn(&self) -> u32 {
        self.target.cqn()
    }

    /// The value given as `cq_context` when the CQ was created.
    pub fn cq_context(&self) -> u64 {
        self.target.cq_context()
    }

    /// Acknowledges this event (`ibv_ack_cq_events` with 1). Fails only when it was acknowledged already
    /// through the CQ.
    pub fn ack(self) -> Result<()> {
        self.target.ack(1)
    }
}

impl Context {
    /// `ibv_create_comp_channel`: a new completion channel of this context.
    pub fn create_comp_channel(&self) -> Result<CompChannel<'_>> {
        let shared = Arc::new(ChannelShared::new(self.dev().new_context_id()));
        self.dev().control().add_channel(&shared);
        Ok(CompChannel { ctx: self, shared })
    }

    /// `ibv_create_cq` for at least `cqe` completions, with 64-byte CQEs, on completion vector 0, reporting to the
    /// context's default channel ([`Context::get_cq_event`]).
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue<'_>> {
        self.create_cq_with(CqAttr { cqe, ..CqAttr::default() })
    }

    /// [`Context::create_cq`] with the core's attributes (CQE size, overrun, completion vector).
    pub fn create_cq_with(&self, attr: CqAttr) -> Result<CompletionQueue<'_>> {
        let ch = Some((self.shared.id, None));
        Ok(CompletionQueue { _ctx: self, obj: CqObj::create(&self.shared, attr, 0, ch)? })
    }

    /// `ibv_create_cq(context, cqe, cq_context, channel, comp_vector)`: a CQ for at least `cqe` completions whose
    /// completion events go to `channel` (none: the CQ raises no events) carrying `cq_context`, on the completion
    /// EQ of `comp_vector` (below [`Context::num_comp_vectors`], else `EINVAL`).
    ///
    /// ```
    /// use mlx5_verbs::Context;
    /// let ctx = Context::open_sim()?;
    /// let ch = ctx.create_comp_channel()?;
    /// let last = ctx.num_comp_vectors()? - 1;
    /// let cq = ctx.create_cq_on(16, 0xfeed, Some(&ch), last)?;
    /// assert_eq!(cq.cq_context(), 0xfeed);
    /// assert!(ctx.create_cq_on(16, 0, None, last + 1).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn create_cq_on(
        &self,
        cqe: u32,
        cq_context: u64,
        channel: Option<&CompChannel<'_>>,
        comp_vector: u16,
    ) -> Result<CompletionQueue<'_>> {
        if let Some(ch) = channel {
            if !Arc::ptr_eq(&ch.ctx.shared, &self.shared) {
                return Err(VerbsError::Invalid("the completion channel belongs to another context".into()));
            }
        }
        let vectors = self.num_comp_vectors()?;
        if comp_vector >= vectors {
            return Err(VerbsError::Invalid(format!("completion vector {comp_vector} of {vectors}")));
        }
        let attr = CqAttr { cqe, comp_vector, ..CqAttr::default() };
        let ch = channel.map(|c| (c.shared.id, Some(c.shared.clone())));
        Ok(CompletionQueue { _ctx: self, obj: CqObj::create(&self.shared, attr, cq_context, ch)? })
    }

    /// The context's default completion channel (`ibv_get_cq_event`): waits up to `timeout` for a completion
    /// event of an armed CQ made with [`Context::create_cq`] and returns its CQN. Acknowledge it with
    /// [`CompletionQueue::ack_events`].
    pub fn get_cq_event(&self, timeout: Duration) -> Result<Option<u32>> {
        Ok(wait_cq_event(self.dev(), self.shared.id, timeout)?.map(|t| t.cqn()))
    }

    /// `ibv_context.num_comp_vectors`: completion vectors a CQ may name (one completion EQ each).
    pub fn num_comp_vectors(&self) -> Result<u16> {
        Ok(self.dev().control().hca().num_comp_vectors().max(1))
    }
}

impl CompChannel<'_> {
    /// The channel's descriptor (`ibv_comp_channel.fd`, an `eventfd`): readable while a completion event waits,
    /// for `poll`/`epoll`. The device's service thread moves events to it without any call.
    pub fn fd(&self) -> Option<i32> {
        self.shared.raw_fd()
    }

    /// `ibv_get_cq_event`: waits up to `timeout` for the next completion event of a CQ on this channel.
    pub fn get_cq_event(&self, timeout: Duration) -> Result<Option<CqEvent>> {
        Ok(wait_cq_event(self.ctx.dev(), self.shared.id, timeout)?.map(|target| CqEvent { target }))
    }

    /// `ibv_destroy_comp_channel`: refused with [`VerbsError::Busy`] while CQs report to it.
    pub fn destroy(self) -> Result<()> {
        let mut c = self.ctx.dev().control();
        let users = c.channel_users(self.shared.id);
        if users > 0 {
            return Err(VerbsError::Busy { what: "completion channel", users });
        }
        c.remove_channel(self.shared.id);
        Ok(())
    }
}

impl Drop for CompChannel<'_> {
    fn drop(&mut self) {
        // CQs still on the channel keep its descriptor; their events stay queued under its id until they go.
        let mut c = self.ctx.dev().control();
        if c.channel_users(self.shared.id) == 0 {
            c.remove_channel(self.shared.id);
        }
    }
}

/// A completion queue (`ibv_cq`). `Send` and `Sync`: it may be polled on one thread while others post to its
/// QPs, or polled from several (each poll takes the CQ's own lock).
#[derive(Debug)]
pub struct CompletionQueue<'ctx> {
    _ctx: &'ctx Context,
    pub(crate) obj: Arc<CqObj>,
}

impl CompletionQueue<'_> {
    pub fn cqn(&self) -> u32 {
        self.obj.cqn()
    }

    /// The value given as `cq_context` at creation (0 for [`Context::create_cq`]).
    pub fn cq_context(&self) -> u64 {
        self.obj.cq_context
    }

    /// Completion events taken for this CQ and not acknowledged yet.
    pub fn unacked_events(&self) -> u32 {
        self.obj.unacked_events()
    }

    /// `ibv_poll_cq`: fills the front of `wc` with completions, returns how many. Fewer than `wc.len()` means the
    /// CQ is empty (a bad CQE found after good completions is returned as [`VerbsError::Cqe`] by the next call; the
    /// software flush of a dead device or failed CQ follows the last CQE in the same call). Allocates nothing and
    /// takes no lock but the CQ's (and, for each CQE, its QP's or SRQ's).
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

    /// `ibv_modify_cq` with `IBV_CQ_MODERATE`: the device raises an armed CQ's event once `cq_count`
    /// completions have come or `cq_period` microseconds have passed since its last event (0 turns either
    /// off). Refused when the device has no `cq_moderation`, or for a period past the 12-bit field.
    pub fn modify_moderation(&self, cq_count: u16, cq_period: u16) -> Result<()> {
        self.obj.moderate(cq_count, cq_period)
    }

    /// `ibv_ack_cq_events`: `n` events taken for this CQ are handled.
    pub fn ack_events(&self, n: u32) -> Result<()> {
        self.obj.ack_events(n)
    }

    /// `ibv_destroy_cq`, returning firmware's error. As libibverbs, it first waits until every completion event
    /// taken for the CQ is acknowledged (by another thread's [`CqEvent::ack`]); dropping the CQ instead
    /// acknowledges them and destroys it at once.
    pub fn destroy(self) -> Result<()> {
        self.obj.destroy(true)
    }
}

impl Drop for CompletionQueue<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.obj.destroy(false) {
            log::error!("destroy CQ {:#x}: {e}", self.obj.cqn());
        }
    }
}

/// The entries of a sink from `at` on: a poll that resumes after a stepped-over CQE fills the rest.
struct Offset<'a, S: WcSink + ?Sized> {
    sink: &'a mut S,
    at: usize,
    cap: usize,
}

impl<S: WcSink + ?Sized> WcSink for Offset<'_, S> {
    type Out = S::Out;
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.cap
    }
    #[inline(always)]
    fn fill(
        &mut self,
        i: usize,
        decode: impl FnOnce(&mut S::Out) -> std::result::Result<bool, CqeError>,
    ) -> std::result::Result<bool, CqeError> {
        self.sink.fill(self.at + i, decode)
    }
}

//! The state one opened device shares between its contexts and objects: the HCA behind the control-path mutex,
//! the register window the datapath uses without it, the dead-device flag, event routing, and the service thread
//! that ticks health (Linux's `poll_health` timer) and drains the async EQ while nobody else does.
//!
//! Locking (see ARCHITECTURE.md): the control mutex guards the [`Hca`](mlx5_core::hca::Hca), the waiting delay
//! and the routing tables; each CQ, QP and SRQ has its own mutex over its ring. Locks are taken in the order
//! control → CQ (two CQs by ascending CQN) → QP → SRQ, never the other way; the datapath (post, poll) takes only
//! its object's lock (and, polling, the locks of the QPs and SRQs its CQEs name), never the control mutex.

use std::collections::{HashMap, VecDeque};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mlx5_core::cq::{Cq, LinkLayer};
use mlx5_core::hca::{AsyncEvent, HcaState};
use mlx5_core::qp::Qp;
use mlx5_core::vport::{QueryHcaVportContext, QueryNicVportContext};

use crate::backend::{AnyDelay, AnyHca, AnyMmio, DeviceKind};
use crate::event::{lock, ChannelShared, EventQueue};

/// How often the service thread drains the async EQ, so events reach a waiting `poll` on the event descriptor
/// without the application calling in.
const EVENT_POLL: Duration = Duration::from_millis(50);

/// What routes an event naming a CQ.
#[derive(Debug)]
pub(crate) struct CqRoute {
    pub(crate) ctx: u64,
    /// The CQ's failed flag, set by a CQ error event; its poll then completes what the device will not.
    pub(crate) failed: Arc<AtomicBool>,
    /// The completion channel its completion events go to (`None`: the CQ was made without one and its events
    /// are dropped, as a CQ without a channel has nowhere to report them).
    pub(crate) channel: Option<u64>,
    /// The CQ, to count the events handed out for it.
    pub(crate) obj: Weak<dyn CqEventTarget>,
}

/// What a completion event names: a CQ counting the events handed out for it (`ibv_ack_cq_events` balances
/// them; `ibv_destroy_cq` waits for that).
pub(crate) trait CqEventTarget: Send + Sync + std::fmt::Debug {
    /// The CQ's number.
    fn cqn(&self) -> u32;
    /// The caller's value given at creation (`cq_context`).
    fn cq_context(&self) -> u64;
    /// One event of this CQ was handed out.
    fn event_taken(&self);
    /// An event nobody can take (the CQ has no channel): acknowledged at once, under the control mutex.
    fn ack_dropped(&self, hca: &mut AnyHca);
    /// `ibv_ack_cq_events`.
    fn ack(&self, n: u32) -> Result<(), crate::error::VerbsError>;
}

/// Everything the control path changes, behind one mutex.
pub(crate) struct Control {
    /// The HCA; `None` only once torn down.
    pub(crate) hca: Option<AnyHca>,
    pub(crate) delay: AnyDelay,
    /// Each context's event queue, by context id.
    listeners: Vec<(u64, Weak<EventQueue>)>,
    cq_routes: HashMap<u32, CqRoute>,
    qp_routes: HashMap<u32, u64>,
    srq_routes: HashMap<u32, u64>,
    /// Completion events taken from the HCA for each completion channel's CQs and not handed out yet.
    cq_events: HashMap<u64, VecDeque<u32>>,
    /// Each completion channel's descriptor, to wake a `poll` on it when an event is queued.
    channels: HashMap<u64, Weak<ChannelShared>>,
    /// Process memory mapped for the device, shared by the memory regions over it.
    pub(crate) maps: crate::backend::UserMaps,
    /// Objects firmware did not confirm destroying: kept (never freed) until the function is disabled.
    pub(crate) orphan_cqs: Vec<Cq>,
    pub(crate) orphan_qps: Vec<Qp>,
    fatal_sent: bool,
    /// A simulated device in in-line mode, whose clock (and so its heartbeat) moves only when the driver waits:
    /// the service thread moves it by the host time that passed, as a real device's would.
    #[cfg(feature = "sim")]
    sim_clock: Option<(mlx5_sim::SimDevice, Instant)>,
}

impl Control {
    /// The HCA, present from bring-up until the last context and object are gone.
    pub(crate) fn hca(&mut self) -> &mut AnyHca {
        self.hca.as_mut().expect("the HCA lives as long as any context or object")
    }

    /// The HCA and the delay its commands wait with.
    pub(crate) fn parts(&mut self) -> (&mut AnyHca, &mut AnyDelay) {
        (self.hca.as_mut().expect("the HCA lives as long as any context or object"), &mut self.delay)
    }

    pub(crate) fn route_cq(&mut self, cqn: u32, route: CqRoute) {
        self.cq_routes.insert(cqn, route);
    }

    /// Forgets a CQ being destroyed. Returns how many of its completion events were queued for a channel and
    /// not handed out: taken from the HCA, they still count there as unacknowledged.
    pub(crate) fn unroute_cq(&mut self, cqn: u32) -> u32 {
        if let Some(r) = self.cq_routes.remove(&cqn) {
            self.drop_events_of(r.ctx, Named::Cq(cqn));
        }
        let mut queued = 0;
        for q in self.cq_events.values_mut() {
            let before = q.len();
            q.retain(|&c| c != cqn);
            queued += (before - q.len()) as u32;
        }
        queued
    }

    pub(crate) fn route_qp(&mut self, qpn: u32, ctx: u64) {
        self.qp_routes.insert(qpn, ctx);
    }

    /// Forgets a QP being destroyed, with its async events not taken yet.
    pub(crate) fn unroute_qp(&mut self, qpn: u32) {
        if let Some(ctx) = self.qp_routes.remove(&qpn) {
            self.drop_events_of(ctx, Named::Qp(qpn));
        }
    }

    pub(crate) fn route_srq(&mut self, srqn: u32, ctx: u64) {
        self.srq_routes.insert(srqn, ctx);
    }

    /// Forgets an SRQ being destroyed, with its async events not taken yet.
    pub(crate) fn unroute_srq(&mut self, srqn: u32) {
        if let Some(ctx) = self.srq_routes.remove(&srqn) {
            self.drop_events_of(ctx, Named::Srq(srqn));
        }
    }

    /// Takes the async events naming a destroyed object out of its context's queue, as the kernel's uverbs does
    /// at destroy: one taken later would name an object that is gone (libibverbs gives `element` NULL, which
    /// programs dereference) or a new object that reuses its number.
    fn drop_events_of(&self, ctx: u64, obj: Named) {
        if let Some(q) = self.listeners.iter().find(|(id, _)| *id == ctx).and_then(|(_, w)| w.upgrade()) {
            q.purge(|e| named(e) == Some(obj));
        }
    }

    /// A context closed: its pending completion events (of its default channel) go with it.
    pub(crate) fn forget(&mut self, ctx: u64) {
        self.cq_events.remove(&ctx);
        self.listeners.retain(|(id, w)| *id != ctx && w.strong_count() > 0);
    }

    pub(crate) fn add_channel(&mut self, ch: &Arc<ChannelShared>) {
        self.channels.retain(|_, w| w.strong_count() > 0);
        self.channels.insert(ch.id, Arc::downgrade(ch));
    }

    /// A completion channel closed: its pending events go with it.
    pub(crate) fn remove_channel(&mut self, id: u64) {
        self.channels.remove(&id);
        self.cq_events.remove(&id);
    }

    /// Whether a completion channel has CQs routed to it (`ibv_destroy_comp_channel` refuses with EBUSY then).
    pub(crate) fn channel_users(&self, id: u64) -> usize {
        self.cq_routes.values().filter(|r| r.channel == Some(id)).count()
    }

    /// Moves the HCA's pending completion events to the channels of their CQs, waking a `poll` on each.
    pub(crate) fn dispatch_cq_events(&mut self) -> Result<(), mlx5_core::hca::Error> {
        loop {
            let (hca, delay) = self.parts();
            let Some(cqn) = hca.get_cq_event(delay)? else { return Ok(()) };
            let Some(ch) = self.cq_routes.get(&cqn).and_then(|r| r.channel) else {
                // Without a channel nobody can take the event: it is acknowledged here so the CQ stays balanced.
                if let Some(obj) = self.cq_routes.get(&cqn).and_then(|r| r.obj.upgrade()) {
                    obj.ack_dropped(self.hca());
                }
                continue;
            };
            self.cq_events.entry(ch).or_default().push_back(cqn);
            if let Some(c) = self.channels.get(&ch).and_then(Weak::upgrade) {
                c.signal();
            }
        }
    }

    pub(crate) fn listen(&mut self, ctx: u64, q: &Arc<EventQueue>) {
        self.listeners.retain(|(_, w)| w.strong_count() > 0);
        self.listeners.push((ctx, Arc::downgrade(q)));
    }

    /// Moves the HCA's pending completion events to their channels and takes the oldest of channel `ch` (a
    /// context's id is its default channel), with its CQ, whose count of unacknowledged events it raises.
    pub(crate) fn next_cq_event(&mut self, ch: u64) -> Result<Option<Arc<dyn CqEventTarget>>, mlx5_core::hca::Error> {
        let failure = self.dispatch_cq_events().err();
        while let Some(q) = self.cq_events.get_mut(&ch) {
            let Some(cqn) = q.pop_front() else { break };
            if q.is_empty() {
                if let Some(c) = self.channels.get(&ch).and_then(Weak::upgrade) {
                    c.clear();
                }
            }
            // A CQ destroyed since its event was queued took the event with it.
            if let Some(obj) = self.cq_routes.get(&cqn).and_then(|r| r.obj.upgrade()) {
                obj.event_taken();
                return Ok(Some(obj));
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }

    fn send_to(&self, ctx: u64, e: AsyncEvent) {
        if let Some(q) = self.listeners.iter().find(|(id, _)| *id == ctx).and_then(|(_, w)| w.upgrade()) {
            q.push(e);
        }
    }

    fn broadcast(&self, e: AsyncEvent) {
        for q in self.listeners.iter().filter_map(|(_, w)| w.upgrade()) {
            q.push(e);
        }
    }

    /// Sends one event where the kernel's uverbs would: to the owner of the CQ or QP it names, else to every
    /// context of the device.
    /// Events naming an object that is not routed (destroyed, or never made here) are dropped, as Linux drops
    /// events for objects it no longer knows.
    fn route(&mut self, e: AsyncEvent) {
        match named(&e) {
            Some(Named::Cq(cqn)) => {
                if let Some(r) = self.cq_routes.get(&cqn) {
                    r.failed.store(true, Ordering::Release);
                    self.send_to(r.ctx, e);
                }
            }
            Some(Named::Qp(qpn)) => {
                if let Some(&ctx) = self.qp_routes.get(&qpn) {
                    self.send_to(ctx, e);
                }
            }
            Some(Named::Srq(srqn)) => {
                if let Some(&ctx) = self.srq_routes.get(&srqn) {
                    self.send_to(ctx, e);
                }
            }
            None if e == AsyncEvent::DeviceFatal => {
                // A fatal error reaches the user once, whether firmware reported it or the health check found it.
                if !self.fatal_sent {
                    self.fatal_sent = true;
                    self.broadcast(e);
                }
            }
            // Unaffiliated events reach every context.
            None => self.broadcast(e),
        }
    }

    /// After every use of the HCA: publishes a dead HCA to the datapath (before the event that says so) and routes
    /// the async events the HCA collected.
    fn settle(&mut self, dead: &AtomicBool) {
        let Some(hca) = self.hca.as_mut() else { return };
        let is_dead = !matches!(hca.state(), HcaState::Up);
        if is_dead {
            dead.store(true, Ordering::Release);
        }
        while let Some(e) = self.hca.as_mut().and_then(|h| h.get_async_event()) {
            self.route(e);
        }
        if is_dead {
            // Whatever found the failure, Linux's `mlx5_enter_error_state` raises MLX5_DEV_EVENT_SYS_ERROR, which
            // mlx5_ib's `mlx5_ib_handle_event` dispatches as IB_EVENT_DEVICE_FATAL.
            self.route(AsyncEvent::DeviceFatal);
        }
    }
}

/// The object an async event names, if it names one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Named {
    Cq(u32),
    Qp(u32),
    Srq(u32),
}

fn named(e: &AsyncEvent) -> Option<Named> {
    match *e {
        AsyncEvent::CqError { cqn, .. } => Some(Named::Cq(cqn)),
        AsyncEvent::QpError { qpn, .. }
        | AsyncEvent::CommEst { qpn }
        | AsyncEvent::SqDrained { qpn }
        | AsyncEvent::PathMig { qpn }
        | AsyncEvent::PathMigErr { qpn }
        | AsyncEvent::LastWqeReached { qpn } => Some(Named::Qp(qpn)),
        AsyncEvent::SrqLimitReached { srqn } => Some(Named::Srq(srqn)),
        _ => None,
    }
}

/// One opened device (an HCA), shared by its contexts and objects through `Arc` and torn down when the last goes.
pub(crate) struct DeviceShared {
    core: Arc<DevCore>,
    /// The register window for the datapath (doorbells, CQ polling), used without the control mutex.
    pub(crate) mmio: AnyMmio,
    pub(crate) kind: DeviceKind,
    pub(crate) link: LinkLayer,
    next_ctx: AtomicU64,
    /// The node GUID, once asked for.
    node_guid: OnceLock<u64>,
    service: Service,
    /// The device entry's gate, held up while this HCA lives; dropped after [`Drop for DeviceShared`]'s teardown
    /// (fields drop after the body, unwinding too), which lets the next open of the device bring it up.
    up: OnceLock<UpToken>,
    /// Run once the HCA is torn down, before the gate is lowered (a `wire=connect` device unplugs its wire, so
    /// the next bring-up plugs a new one in).
    after_teardown: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// Whether a device's HCA is up, from its bring-up until its teardown has finished. An open that finds no live
/// HCA waits here first: the last context's drop may still be tearing the previous one down (its weak handle
/// no longer upgrades), and a bring-up meeting that half-done teardown would fail (ENABLE_HCA in a bad state).
#[derive(Debug, Default)]
pub(crate) struct UpGate {
    up: Mutex<bool>,
    down: Condvar,
}

impl UpGate {
    /// Waits until no HCA of the device is up.
    pub(crate) fn wait_down(&self) {
        let mut up = lock(&self.up);
        while *up {
            up = self.down.wait(up).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// Holds an [`UpGate`] up; lowers it when dropped.
#[derive(Debug)]
struct UpToken(Arc<UpGate>);

impl Drop for UpToken {
    fn drop(&mut self) {
        *lock(&self.0.up) = false;
        self.0.down.notify_all();
    }
}

/// What the service thread shares with the device: the control path and the dead flag. The thread holds this, not
/// the device, so the last context to close is always the one that tears the device down, before its close returns.
struct DevCore {
    control: Mutex<Control>,
    /// Set once the HCA is in internal error: posts fail and polls flush without asking the HCA.
    dead: AtomicBool,
}

impl DevCore {
    fn control(&self) -> ControlGuard<'_> {
        ControlGuard { g: lock(&self.control), dead: &self.dead }
    }

    /// One wake-up of the service thread: the health timer on the thread's clock (the core polls when its 2 s
    /// interval has passed, [`HEALTH_POLL_INTERVAL_MS`](mlx5_core::health::HEALTH_POLL_INTERVAL_MS)), and the async EQ drained.
    fn service_tick(&self, now_ms: u64) {
        let mut c = self.control();
        #[cfg(feature = "sim")]
        if let Some((dev, last)) = &mut c.sim_clock {
            let now = Instant::now();
            dev.advance_ns(u64::try_from((now - *last).as_nanos()).unwrap_or(u64::MAX));
            *last = now;
        }
        let Some(hca) = c.hca.as_mut() else { return };
        // A failure moves the HCA to internal error, which the control guard then publishes.
        let _ = hca.health_tick(now_ms);
        let (hca, delay) = c.parts();
        // A dead HCA refuses to drain; its state is what the guard publishes.
        let _ = hca.process_events(delay);
        // Completion events reach their channels' descriptors without any call, as the async events do.
        let _ = c.dispatch_cq_events();
    }
}

impl std::fmt::Debug for DeviceShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceShared").field("kind", &self.kind).field("link", &self.link).finish_non_exhaustive()
    }
}

/// The control mutex held: settles the HCA's state and events when released.
pub(crate) struct ControlGuard<'a> {
    g: MutexGuard<'a, Control>,
    dead: &'a AtomicBool,
}

impl Deref for ControlGuard<'_> {
    type Target = Control;
    fn deref(&self) -> &Control {
        &self.g
    }
}

impl DerefMut for ControlGuard<'_> {
    fn deref_mut(&mut self) -> &mut Control {
        &mut self.g
    }
}

impl Drop for ControlGuard<'_> {
    fn drop(&mut self) {
        self.g.settle(self.dead);
    }
}

impl DeviceShared {
    /// Wraps a brought-up HCA and starts its service thread.
    pub(crate) fn start(hca: AnyHca, delay: AnyDelay, kind: DeviceKind, link: LinkLayer) -> Arc<DeviceShared> {
        #[cfg(feature = "sim")]
        let sim_clock = match &kind {
            DeviceKind::Sim(d) if d.config().mode == mlx5_sim::Mode::Inline => Some((d.clone(), Instant::now())),
            _ => None,
        };
        let control = Control {
            hca: Some(hca),
            delay,
            listeners: Vec::new(),
            cq_routes: HashMap::new(),
            qp_routes: HashMap::new(),
            srq_routes: HashMap::new(),
            cq_events: HashMap::new(),
            channels: HashMap::new(),
            maps: crate::backend::UserMaps::default(),
            orphan_cqs: Vec::new(),
            orphan_qps: Vec::new(),
            fatal_sent: false,
            #[cfg(feature = "sim")]
            sim_clock,
        };
        let core = Arc::new(DevCore { control: Mutex::new(control), dead: AtomicBool::new(false) });
        let dev = Arc::new(DeviceShared {
            core: core.clone(),
            mmio: kind.datapath_mmio(),
            kind,
            link,
            next_ctx: AtomicU64::new(1),
            node_guid: OnceLock::new(),
            service: Service::default(),
            up: OnceLock::new(),
            after_teardown: Mutex::new(None),
        });
        dev.service.spawn(core);
        dev
    }

    /// The control path: the HCA and what goes with it.
    pub(crate) fn control(&self) -> ControlGuard<'_> {
        self.core.control()
    }

    /// Whether the HCA is known to be in internal error (one load; the datapath's only look at device state).
    /// Inlined: the drop-in's posts call it from another crate, where an out-of-line call cost more than the load.
    #[inline]
    pub(crate) fn is_dead(&self) -> bool {
        self.core.dead.load(Ordering::Acquire)
    }

    /// The node GUID as mlx5_ib's `mlx5_query_node_guid` reads it: from the HCA vport context on InfiniBand, the
    /// NIC vport context on Ethernet. One command the first time, remembered after.
    pub(crate) fn node_guid(&self) -> Result<u64, mlx5_core::hca::Error> {
        if let Some(g) = self.node_guid.get() {
            return Ok(*g);
        }
        let mut c = self.control();
        let (hca, delay) = c.parts();
        let guid = match self.link {
            LinkLayer::InfiniBand => hca.exec(&mut QueryHcaVportContext { port_num: 1 }, delay)?.node_guid,
            LinkLayer::Ethernet => hca.exec(&mut QueryNicVportContext, delay)?.node_guid,
        };
        Ok(*self.node_guid.get_or_init(|| guid))
    }

    /// Holds `gate` up until this HCA's teardown has finished.
    pub(crate) fn hold_up(&self, gate: &Arc<UpGate>) {
        *lock(&gate.up) = true;
        if self.up.set(UpToken(gate.clone())).is_err() {
            log::error!("an HCA held its device's gate twice");
        }
    }

    /// Runs `f` once this HCA's teardown has finished, before an open waiting for it may bring the device up
    /// (a simulated device's wire is unplugged there; nothing else needs it).
    #[cfg(feature = "sim")]
    pub(crate) fn after_teardown(&self, f: Box<dyn FnOnce() + Send>) {
        *lock(&self.after_teardown) = Some(f);
    }

    pub(crate) fn new_context_id(&self) -> u64 {
        self.next_ctx.fetch_add(1, Ordering::Relaxed)
    }
}

impl Drop for DeviceShared {
    fn drop(&mut self) {
        self.service.stop();
        // The service thread has stopped (joined above), so nothing else holds the control mutex.
        let mut c = lock(&self.core.control);
        if let Some(hca) = c.hca.take() {
            // Teardown disables the function, so the queues still held (orphans) can no longer be reached by the
            // device; their memory is released with it.
            if let Err(e) = hca.teardown(&mut c.delay) {
                log::error!("teardown: {e}");
            }
        }
        c.orphan_cqs.clear();
        c.orphan_qps.clear();
        drop(c);
        if let Some(f) = lock(&self.after_teardown).take() {
            f();
        }
    }
}

/// The service thread of one device and how to stop it.
#[derive(Debug, Default)]
struct Service {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Service {
    fn spawn(&self, dev: Arc<DevCore>) {
        let stop = self.stop.clone();
        let t = std::thread::Builder::new().name("mlx5-verbs-svc".into()).spawn(move || {
            let start = Instant::now();
            loop {
                {
                    let (m, cv) = &*stop;
                    let g = lock(m);
                    let (g, _) = cv.wait_timeout(g, EVENT_POLL).unwrap_or_else(std::sync::PoisonError::into_inner);
                    if *g {
                        return;
                    }
                }
                dev.service_tick(u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX));
            }
        });
        match t {
            Ok(t) => *lock(&self.thread) = Some(t),
            Err(e) => log::error!("no service thread (health is then checked only while commands wait): {e}"),
        }
    }

    fn stop(&self) {
        *lock(&self.stop.0) = true;
        self.stop.1.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            // A thread never joins itself: were the last context dropped on the service thread, it ends on its own.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(all(test, feature = "sim", target_os = "linux"))]
mod tests {
    use std::time::Duration;

    use crate::{Access, AsyncEvent, Context, QpCap, QpInitAttr, QpType, SrqInitAttr};

    /// Waits (at most `limit`) until `fd` is readable.
    fn readable_within(fd: i32, limit: Duration) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = i32::try_from(limit.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        n == 1 && p.revents & libc::POLLIN != 0
    }

    /// As the kernel's uverbs: an object's async events not taken when it is destroyed go with it (UCX's
    /// rc_verbs teardown took LAST_WQE_REACHED of a destroyed QP, with a NULL QP, and crashed).
    #[test]
    fn a_destroyed_qp_takes_its_queued_async_events_with_it() {
        let ctx = Context::open_sim().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(8).unwrap();
        let srq = pd.create_srq(SrqInitAttr { max_wr: 4, max_sge: 1, srq_limit: 0 }).unwrap();
        let cap = QpCap { max_send_wr: 1, max_send_sge: 1, ..QpCap::default() };
        let qp =
            pd.create_qp_with(QpInitAttr { srq: Some(&srq), ..QpInitAttr::new(QpType::Rc, &cq, &cq, cap) }).unwrap();
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        let qp = qp.to_error().map_err(|e| e.error).unwrap();
        // The service thread queues LAST_WQE_REACHED; the descriptor says so.
        assert!(readable_within(ctx.async_fd().unwrap(), Duration::from_secs(10)), "no event queued");
        drop(qp);
        assert_eq!(ctx.get_async_event(Duration::ZERO), None, "an event of a destroyed QP was handed out");
        assert!(!readable_within(ctx.async_fd().unwrap(), Duration::ZERO), "the descriptor still says an event waits");
        // A QP of the same context still gets its own events.
        let qp =
            pd.create_qp_with(QpInitAttr { srq: Some(&srq), ..QpInitAttr::new(QpType::Rc, &cq, &cq, cap) }).unwrap();
        let qpn = qp.qpn();
        let me = ctx.remote_qp(&qp).unwrap();
        let _qp = qp.connect_rc(me, Access::default()).unwrap().to_error().map_err(|e| e.error).unwrap();
        assert_eq!(ctx.get_async_event(Duration::from_secs(10)), Some(AsyncEvent::LastWqeReached { qpn }));
    }
}

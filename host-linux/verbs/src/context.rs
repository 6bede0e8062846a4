//! An open device (`ibv_context`): port and GID queries, the completion channel, async events. Several contexts
//! may share one device (see [`Device::open`](crate::Device::open)); each has its own async events and
//! completion events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mlx5_core::cq::LinkLayer;
use mlx5_core::hca::{GidType, PortAttr};

use crate::backend::{AnyDma, DeviceKind};
use crate::error::Result;
use crate::event::{AsyncEvent, EventQueue};
use crate::shared::DeviceShared;
use crate::spin::SpinLock;

/// What a context is, without borrows: its device, its id among the device's contexts, its async events. Every
/// object holds one, so the device stays up while anything made from it lives.
#[derive(Debug)]
pub(crate) struct ContextShared {
    pub(crate) dev: Arc<DeviceShared>,
    pub(crate) id: u64,
    pub(crate) events: Arc<EventQueue>,
    /// Set by [`Context::set_single_threaded`]: queues made after it lock with no locked instruction.
    pub(crate) single_threaded: AtomicBool,
}

impl ContextShared {
    /// The lock of a queue (a QP's or CQ's ring) made now: single-threaded once the context was set so.
    pub(crate) fn queue_lock<T>(&self, v: T) -> SpinLock<T> {
        if self.single_threaded.load(Ordering::Relaxed) {
            // SAFETY: the program promised one thread at a time on this context's queues
            // (`Context::set_single_threaded`, an unsafe fn whose caller vouches for it).
            unsafe { SpinLock::new_single_threaded(v) }
        } else {
            SpinLock::new(v)
        }
    }
}

impl Drop for ContextShared {
    fn drop(&mut self) {
        // Runs when the last object of the context lets go of it, never under the control mutex: objects release
        // their context only after their own destroy returned.
        self.dev.control().forget(self.id);
    }
}

/// An open, brought-up device (`ibv_context`). `Send` and `Sync`: verbs may be called from any thread; objects
/// made from it borrow it, so it outlives them.
#[derive(Debug)]
pub struct Context {
    pub(crate) shared: Arc<ContextShared>,
}

impl Context {
    /// A new context on an opened device.
    pub(crate) fn attach(dev: Arc<DeviceShared>) -> Context {
        let id = dev.new_context_id();
        let events = Arc::new(EventQueue::new());
        dev.control().listen(id, &events);
        Context { shared: Arc::new(ContextShared { dev, id, events, single_threaded: AtomicBool::new(false) }) }
    }

    /// QPs and CQs made from this context from now on guard their rings as rdma-core's mlx5 provider does under
    /// `MLX5_SINGLE_THREADED=1`: an in-use flag set and cleared with plain stores, no locked instruction (a post
    /// or poll saves one, or two for a poll that completes a QP's work). An overlap the flag catches is logged
    /// and waited out as for a held lock.
    ///
    /// # Safety
    /// No two threads use one of those QPs or CQs (post, poll, arm, modify, destroy) at the same time, and no
    /// thread polls a CQ while another uses a QP whose completions go to it: the program's promise, as with
    /// rdma-core's variable.
    pub unsafe fn set_single_threaded(&self) {
        self.shared.single_threaded.store(true, Ordering::Relaxed);
    }

    pub(crate) fn dev(&self) -> &DeviceShared {
        &self.shared.dev
    }

    /// The device underneath (the simulator handle gives tests access to its counters).
    pub fn device(&self) -> &DeviceKind {
        &self.shared.dev.kind
    }

    pub fn link_layer(&self) -> LinkLayer {
        self.shared.dev.link
    }

    /// Whether the device is known dead (health failure, device gone): posts fail and outstanding work requests
    /// complete with `WR_FLUSH_ERR`.
    pub fn is_dead(&self) -> bool {
        self.dev().is_dead()
    }

    /// The device's node GUID (`ibv_get_device_guid`, `ibv_query_device`'s `node_guid`), as firmware reports it.
    ///
    /// ```
    /// let ctx = mlx5_verbs::Context::open_sim()?;
    /// assert_eq!(ctx.node_guid()?, mlx5_sim::SimConfig::default().node_guid);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn node_guid(&self) -> Result<u64> {
        Ok(self.dev().node_guid()?)
    }

    /// `ibv_query_port` for port 1.
    pub fn query_port(&self) -> Result<PortAttr> {
        let mut c = self.dev().control();
        let (hca, delay) = c.parts();
        Ok(hca.query_port(delay)?)
    }

    /// `MAD_IFC` on `port` (`mlx5_MAD_IFC`): hands `mad` to the device's own agents (the SMA for an SMP) and
    /// returns their response, whose MAD status says whether the agent took it. An error is the command's own.
    pub fn mad_ifc(
        &self,
        port: u8,
        flags: mlx5_core::mad_ifc::MadIfcFlags,
        mad: &[u8; mlx5_core::mad_ifc::MAD_LEN],
    ) -> Result<mlx5_core::mad_ifc::MadReply> {
        let mut c = self.dev().control();
        let (hca, delay) = c.parts();
        Ok(hca.mad_ifc(port, flags, mad, delay)?)
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, index: u16) -> Result<[u8; 16]> {
        let mut c = self.dev().control();
        let (hca, delay) = c.parts();
        Ok(hca.query_gid(index, delay)?)
    }

    /// `ibv_query_gid_ex`: the GID at `index` with its type (InfiniBand, RoCE v1 or v2).
    pub fn query_gid_ex(&self, index: u16) -> Result<([u8; 16], GidType)> {
        let mut c = self.dev().control();
        let (hca, delay) = c.parts();
        Ok(hca.query_gid_ex(index, delay)?)
    }

    /// Adds a port address (IPv6, or IPv4 mapped as `::ffff:a.b.c.d`) to the RoCE GID table as a v1 and a v2
    /// entry in the first free indices, as Linux does when the netdev gains it. Returns the two indices.
    ///
    /// ```
    /// use mlx5_verbs::{Context, GidType};
    /// let ctx = Context::open_sim()?;
    /// // 0 and 1 hold the link-local GID (v1, v2), 2 and 3 the simulated host's 192.168.1.10; 10.0.0.1 goes next.
    /// let v4 = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
    /// assert_eq!(ctx.add_gid_address(v4)?, [4, 5]);
    /// assert_eq!(ctx.query_gid_ex(5)?, (v4, GidType::RoceV2));
    /// assert_eq!(ctx.del_gid_address(v4)?, 2);
    /// assert!(ctx.query_gid(4).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn add_gid_address(&self, addr: [u8; 16]) -> Result<[u16; 2]> {
        let mut c = self.dev().control();
        let (hca, delay) = c.parts();
        Ok(hca.add_roce_address(addr, delay)?)
    }

    /// Removes a port address from the RoCE GID table (each entry holding it is cleared). Returns how many were.
    pub fn del_gid_address(&self, addr: [u8; 16]) -> Result<usize> {
        let mut c = self.dev().control();
        let (hca, delay) = c.parts();
        Ok(hca.del_roce_address(addr, delay)?)
    }

    /// `ibv_get_async_event`: the next asynchronous event of this context (an error of one of its CQs or QPs, or
    /// a device-wide event such as a port change or [`AsyncEvent::DeviceFatal`]), waiting up to `timeout`. Each
    /// event taken is acknowledged with [`Context::ack_async_event`].
    ///
    /// ```
    /// use std::time::Duration;
    /// let ctx = mlx5_verbs::Context::open_sim()?;
    /// assert_eq!(ctx.get_async_event(Duration::from_millis(1)), None);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn get_async_event(&self, timeout: Duration) -> Option<AsyncEvent> {
        self.shared.events.pop(timeout, || {
            let mut c = self.dev().control();
            let (hca, delay) = c.parts();
            // A dead HCA drains nothing; the guard still publishes what it knows.
            let _ = hca.process_events(delay);
        })
    }

    /// `ibv_ack_async_event`: one event taken with [`Context::get_async_event`] is handled.
    pub fn ack_async_event(&self, _event: &AsyncEvent) -> Result<()> {
        self.shared.events.ack()
    }

    /// Events taken and not acknowledged yet.
    pub fn unacked_async_events(&self) -> usize {
        self.shared.events.unacked()
    }

    /// Async events dropped because the context did not take them (the oldest go first).
    pub fn async_events_dropped(&self) -> u64 {
        self.shared.events.dropped()
    }

    /// A descriptor that is readable while an async event waits (`ibv_context::async_fd`, an `eventfd`), for
    /// `poll`/`epoll`; `None` where eventfd does not exist. The device's service thread drains its event queue
    /// every few tens of milliseconds, so an event arrives without any call into the context.
    pub fn async_fd(&self) -> Option<i32> {
        self.shared.events.raw_fd()
    }

    /// DMA memory outstanding `(regions, bytes)`: after every object is dropped only the HCA's own remain.
    pub fn dma_outstanding(&self) -> (usize, usize) {
        self.device().dma_outstanding()
    }

    pub(crate) fn dma(&self) -> AnyDma {
        self.device().dma()
    }
}

/// The MAC address in a link-local GID (RoCE), as [`RemoteQp::mac`](crate::RemoteQp::mac) carries it.
pub fn mac_of_gid(gid: &[u8; 16]) -> [u8; 6] {
    // A link-local GID carries the MAC as a modified EUI-64: flip the U/L bit, drop ff:fe.
    [gid[8] ^ 2, gid[9], gid[10], gid[13], gid[14], gid[15]]
}

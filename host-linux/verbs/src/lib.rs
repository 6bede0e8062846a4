//! `mlx5-verbs`: a safe, verbs-shaped API over the core, for a Linux process: open a device (simulated, or a
//! ConnectX through VFIO), then protection domains, memory regions, completion queues with a completion channel,
//! and RC / UD queue pairs whose states are types.
//!
//! It is not libibverbs: there is no kernel uverbs device, no provider plugin and no C ABI; the process owns the
//! whole function through `mlx5-vfio`. The simulated devices come with the `sim` feature (on by default); without
//! it only VFIO devices can be opened and `mlx5-sim` is not built.
//!
//! Lifetimes carry verbs' ordering rules, so breaking them does not compile: a [`ProtectionDomain`] cannot be
//! dropped while a [`MemoryRegion`] or [`QueuePair`] made from it lives, a [`DmaBuffer`] cannot be dropped (freed)
//! while a memory region covers it, and a [`CompletionQueue`] outlives the QPs that complete on it. Every object
//! is destroyed on drop (errors are logged; an object firmware did not let go of is kept, never freed under the
//! device); `destroy()` does the same and returns the error.
//!
//! ```
//! use mlx5_verbs::{wr, Context, InitAttr, RtrAttr, RtsAttr, QpCap, QpType, Access, WorkCompletion};
//!
//! let ctx = Context::open_sim()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(16)?;
//! let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
//! let mut buf = ctx.alloc_buffer(4096)?;
//! buf[..5].copy_from_slice(b"hello");
//! let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;
//!
//! // A QP connected to itself (loopback) is enough to show the life cycle.
//! let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap)?;
//! let me = ctx.remote_qp(&qp)?;
//! let qp = qp.to_init(InitAttr::rc(Access::default())).map_err(|e| e.error)?;
//! let qp = qp.to_rtr(RtrAttr::rc(me)).map_err(|e| e.error)?;
//! let qp = qp.to_rts(RtsAttr::rc(0)).map_err(|e| e.error)?;
//!
//! qp.post_recv(&[wr::recv(1, &[mr.sge(2048, 2048)])])?;
//! qp.post_send(&[wr::send(2, &[mr.sge(0, 5)])])?;
//! let mut wc = [WorkCompletion::default(); 4];
//! let n = cq.poll_until(&mut wc, 2, std::time::Duration::from_secs(5))?;
//! assert_eq!(n, 2);
//! assert_eq!(mr.read_vec(2048, 5), b"hello");
//! # Ok::<(), mlx5_verbs::VerbsError>(())
//! ```
//!
//! What does not compile (each is a verbs rule):
//!
//! A PD cannot go while a memory region made from it lives (`ibv_dealloc_pd` would fail with EBUSY):
//! ```compile_fail,E0505
//! use mlx5_verbs::{Access, Context};
//! let ctx = Context::open_sim()?;
//! let pd = ctx.alloc_pd()?;
//! let mut buf = ctx.alloc_buffer(64)?;
//! let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;
//! drop(pd);
//! drop(mr);
//! # Ok::<(), mlx5_verbs::VerbsError>(())
//! ```
//! Registered memory can be neither freed nor touched directly while the device may reach it:
//! ```compile_fail,E0505
//! use mlx5_verbs::{Access, Context};
//! let ctx = Context::open_sim()?;
//! let pd = ctx.alloc_pd()?;
//! let mut buf = ctx.alloc_buffer(64)?;
//! let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;
//! drop(buf);
//! drop(mr);
//! # Ok::<(), mlx5_verbs::VerbsError>(())
//! ```
//! ```compile_fail,E0502
//! use mlx5_verbs::{Access, Context};
//! let ctx = Context::open_sim()?;
//! let pd = ctx.alloc_pd()?;
//! let mut buf = ctx.alloc_buffer(64)?;
//! let mr = pd.register(&mut buf, Access::LOCAL_WRITE)?;
//! let first = buf[0];
//! drop(mr);
//! # Ok::<(), mlx5_verbs::VerbsError>(())
//! ```
//! A CQ outlives the QPs that complete on it:
//! ```compile_fail,E0505
//! use mlx5_verbs::{Context, QpCap, QpType};
//! let ctx = Context::open_sim()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(8)?;
//! let qp = pd.create_qp(QpType::Rc, &cq, &cq, QpCap { max_send_wr: 1, max_recv_wr: 1, ..QpCap::default() })?;
//! drop(cq);
//! drop(qp);
//! # Ok::<(), mlx5_verbs::VerbsError>(())
//! ```
//! Sends are posted only in RTS (here the QP is still in RESET):
//! ```compile_fail,E0599
//! use mlx5_verbs::{wr, Context, QpCap, QpType};
//! let ctx = Context::open_sim()?;
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(8)?;
//! let qp = pd.create_qp(QpType::Rc, &cq, &cq, QpCap { max_send_wr: 1, max_recv_wr: 1, ..QpCap::default() })?;
//! qp.post_send(&[wr::send_inline(1, b"early")])?;
//! # Ok::<(), mlx5_verbs::VerbsError>(())
//! ```

use std::cell::{RefCell, RefMut};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use mlx5_core::cq::LinkLayer;
use mlx5_core::cq::{Cq, WrTable};
pub use mlx5_core::cq::{Notify, WcFlags, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::{DelayNs, Dma, DmaError, DmaRegion, DmaView, Mmio};
use mlx5_core::hca::{Config, Error as HcaError, Hca};
pub use mlx5_core::hca::{CqAttr, GidType, PortAttr};
use mlx5_core::hca::{Pd, QpInitAttr};
pub use mlx5_core::mkey::Access;
use mlx5_core::mkey::Mr;
use mlx5_core::qp::{required_attrs, Qp, QpAttr, QpAttrMask};
pub use mlx5_core::qp::{
    Ah, AhAttr, Grh, Mtu, PostError, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest,
};
pub use mlx5_core::trace::{CmdRecord, CmdTrace};
#[cfg(feature = "sim")]
use mlx5_sim::{SimConfig, SimDelay, SimDevice, SimDma, SimMmio};

use mlx5_vfio::{Bdf, StdDelay, Vfio, VfioError, VfioOptions};

/// What a verbs call can fail with. Each message is one line naming what failed and why.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// The driver or firmware refused (firmware status name and syndrome included).
    #[error("{0}")]
    Hca(#[from] HcaError),
    #[error("bring-up failed: {0}")]
    Bringup(String),
    #[error("post failed at work request {}: {:?}", .0.index, .0.kind)]
    Post(PostError),
    #[error("{0}")]
    Vfio(#[from] VfioError),
    #[error("out of DMA memory: {0}")]
    Dma(DmaError),
    #[error("bad completion queue entry: {0}")]
    Cqe(String),
    #[error("{0}")]
    Invalid(String),
    #[error("destroy failed, object kept: {0}")]
    Destroy(HcaError),
}

impl From<PostError> for VerbsError {
    fn from(e: PostError) -> Self {
        VerbsError::Post(e)
    }
}

pub type Result<T> = std::result::Result<T, VerbsError>;

// ---------------------------------------------------------------------------------------------------------------
// The device behind a context

/// Register access for either device: one match per access, nothing next to a register's latency.
#[derive(Debug, Clone)]
pub enum AnyMmio {
    #[cfg(feature = "sim")]
    Sim(SimMmio),
    Vfio(Arc<Vfio>),
}

macro_rules! each_mmio {
    ($self:ident, $m:ident => $e:expr) => {
        match $self {
            #[cfg(feature = "sim")]
            AnyMmio::Sim($m) => $e,
            AnyMmio::Vfio(v) => {
                let $m = &v.bar;
                $e
            }
        }
    };
}

impl Mmio for AnyMmio {
    fn read32(&self, off: usize) -> u32 {
        each_mmio!(self, m => m.read32(off))
    }
    fn write32(&self, off: usize, v: u32) {
        each_mmio!(self, m => m.write32(off, v))
    }
    fn read64(&self, off: usize) -> u64 {
        each_mmio!(self, m => m.read64(off))
    }
    fn write64(&self, off: usize, v: u64) {
        each_mmio!(self, m => m.write64(off, v))
    }
    fn dma_wmb(&self) {
        each_mmio!(self, m => m.dma_wmb())
    }
    fn wmb(&self) {
        each_mmio!(self, m => m.wmb())
    }
    fn wc_start(&self) {
        each_mmio!(self, m => m.wc_start())
    }
    fn wc_flush(&self) {
        each_mmio!(self, m => m.wc_flush())
    }
    fn dma_rmb(&self) {
        each_mmio!(self, m => m.dma_rmb())
    }
    fn mb(&self) {
        each_mmio!(self, m => m.mb())
    }
}

/// DMA memory for either device.
#[derive(Debug, Clone)]
pub enum AnyDma {
    #[cfg(feature = "sim")]
    Sim(SimDma),
    Vfio(Arc<Vfio>),
}

// SAFETY: forwards to the simulator's or the VFIO allocator, each of which upholds the contract.
unsafe impl Dma for AnyDma {
    fn alloc(&self, len: usize, align: usize) -> std::result::Result<DmaRegion, DmaError> {
        match self {
            #[cfg(feature = "sim")]
            AnyDma::Sim(d) => d.alloc(len, align),
            AnyDma::Vfio(v) => v.dma.alloc(len, align),
        }
    }
    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        match self {
            #[cfg(feature = "sim")]
            AnyDma::Sim(d) => d.iova_of(cpu, len),
            AnyDma::Vfio(v) => v.dma.iova_of(cpu, len),
        }
    }
    unsafe fn free(&self, region: DmaRegion) {
        // SAFETY: the caller's duties pass through unchanged.
        unsafe {
            match self {
                #[cfg(feature = "sim")]
                AnyDma::Sim(d) => d.free(region),
                AnyDma::Vfio(v) => v.dma.free(region),
            }
        }
    }
}

/// Waiting for either device: simulated time, or the host's clock.
#[derive(Debug)]
pub enum AnyDelay {
    #[cfg(feature = "sim")]
    Sim(SimDelay),
    Std(StdDelay),
}

impl DelayNs for AnyDelay {
    fn delay_ns(&mut self, ns: u32) {
        match self {
            #[cfg(feature = "sim")]
            AnyDelay::Sim(d) => d.delay_ns(ns),
            AnyDelay::Std(d) => d.delay_ns(ns),
        }
    }
}

/// A command tracer a context hands every firmware command to (the `mlx5` tool's `--trace`), from bring-up to
/// teardown.
pub type Tracer = Box<dyn CmdTrace + Send>;

/// The context's tracer, if any. Without one a firmware command costs one untaken branch; the datapath never
/// reaches it.
struct MaybeTrace(Option<Tracer>);

impl CmdTrace for MaybeTrace {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        if let Some(t) = &mut self.0 {
            t.record(rec);
        }
    }
}

type AnyHca = Hca<AnyMmio, AnyDma, MaybeTrace>;

/// The work-request tables of every QP of a context, looked up by QPN when a CQE names one.
struct QpTable<'a>(&'a mut HashMap<u32, Qp>);

impl WrTable for QpTable<'_> {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        self.0.get_mut(&qpn)?.send_done(qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        self.0.get_mut(&qpn)?.recv_done(qpn, srqn, wqe_counter)
    }
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        self.0.values_mut().find_map(|q| WrTable::flush_one(q, cqn, dead))
    }
}

struct Inner {
    hca: Option<AnyHca>,
    delay: AnyDelay,
    cqs: HashMap<u32, Cq>,
    qps: HashMap<u32, Qp>,
    /// Objects firmware did not confirm destroying: kept (never freed) until the function is disabled.
    orphan_cqs: Vec<Cq>,
    orphan_qps: Vec<Qp>,
}

/// Which device a context drives: the simulated ConnectX or a real one through VFIO. The `mlx5` tool's device
/// choice (`--device`) is this type too.
#[derive(Debug, Clone)]
pub enum DeviceKind {
    #[cfg(feature = "sim")]
    Sim(SimDevice),
    Vfio(Arc<Vfio>),
}

impl DeviceKind {
    /// DMA memory the device's allocator has handed out and not taken back, `(regions, bytes)`.
    pub fn dma_outstanding(&self) -> (usize, usize) {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => d.dma_outstanding(),
            DeviceKind::Vfio(v) => v.dma.outstanding(),
        }
    }
}

/// An open, brought-up device (`ibv_context`). Single-threaded: objects made from it borrow it.
pub struct Context {
    inner: RefCell<Inner>,
    kind: DeviceKind,
    link: LinkLayer,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("kind", &self.kind).field("link", &self.link).finish_non_exhaustive()
    }
}

impl Context {
    /// Opens a simulated ConnectX-5 (RoCE, in-line firmware) and brings it up.
    ///
    /// ```
    /// let ctx = mlx5_verbs::Context::open_sim()?;
    /// assert_eq!(ctx.query_port()?.state, 4); // IB_PORT_ACTIVE
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim() -> Result<Context> {
        Self::open_sim_device(SimDevice::new(SimConfig::default()))
    }

    /// Brings up a given simulated device (for a chosen configuration, or one wired to another).
    #[cfg(feature = "sim")]
    pub fn open_sim_device(dev: SimDevice) -> Result<Context> {
        Self::open_sim_device_with(dev, None)
    }

    /// [`Context::open_sim_device`] handing every firmware command, bring-up and teardown included, to `trace`
    /// when there is one.
    ///
    /// ```
    /// use mlx5_verbs::{CmdRecord, CmdTrace, Context};
    /// struct Count(std::sync::Arc<std::sync::atomic::AtomicUsize>);
    /// impl CmdTrace for Count {
    ///     fn record(&mut self, _: &CmdRecord<'_>) {
    ///         self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ///     }
    /// }
    /// let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    /// let dev = mlx5_sim::SimDevice::new(mlx5_sim::SimConfig::default());
    /// drop(Context::open_sim_device_with(dev, Some(Box::new(Count(n.clone()))))?);
    /// assert!(n.load(std::sync::atomic::Ordering::Relaxed) > 30);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim_device_with(dev: SimDevice, trace: Option<Tracer>) -> Result<Context> {
        let delay = AnyDelay::Sim(dev.delay());
        // The simulated host's addresses become GID entries, as a Linux host's netdev addresses do.
        let c = dev.config();
        let cfg = Config { ipv4_addrs: c.ipv4_addrs, ipv6_addrs: c.ipv6_addrs, ..Config::default() };
        Self::bring_up(AnyMmio::Sim(dev.mmio()), AnyDma::Sim(dev.dma()), delay, DeviceKind::Sim(dev), trace, cfg)
    }

    /// Two simulated ConnectX-5s joined by a simulated wire, with distinct MACs / GUIDs / LIDs: two hosts on a
    /// laptop.
    ///
    /// ```
    /// let (a, b) = mlx5_verbs::Context::open_sim_pair()?;
    /// assert_ne!(a.query_gid(0)?, b.query_gid(0)?);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim_pair() -> Result<(Context, Context)> {
        Self::open_sim_pair_with(SimConfig::default())
    }

    /// [`Context::open_sim_pair`] with both devices configured as `base` (e.g. threaded firmware); the second
    /// gets the next GUID, MAC and LID.
    ///
    /// ```
    /// use mlx5_sim::{Mode, SimConfig};
    /// let threaded = SimConfig { mode: Mode::Threaded, ..SimConfig::default() };
    /// let (a, b) = mlx5_verbs::Context::open_sim_pair_with(threaded)?;
    /// assert_ne!(a.query_gid(0)?, b.query_gid(0)?);
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    #[cfg(feature = "sim")]
    pub fn open_sim_pair_with(base: SimConfig) -> Result<(Context, Context)> {
        let second = base.next_host();
        let (da, db) = (SimDevice::new(base), SimDevice::new(second));
        da.connect(&db);
        Ok((Self::open_sim_device(da)?, Self::open_sim_device(db)?))
    }

    /// Opens the ConnectX at `bdf` through VFIO (bound to vfio-pci) and brings it up.
    pub fn open_vfio(bdf: Bdf) -> Result<Context> {
        Self::open_vfio_with(bdf, None)
    }

    /// [`Context::open_vfio`] handing every firmware command to `trace` when there is one.
    pub fn open_vfio_with(bdf: Bdf, trace: Option<Tracer>) -> Result<Context> {
        let v = Arc::new(Vfio::open(bdf, VfioOptions::default())?);
        let delay = AnyDelay::Std(StdDelay);
        Self::bring_up(
            AnyMmio::Vfio(v.clone()),
            AnyDma::Vfio(v.clone()),
            delay,
            DeviceKind::Vfio(v),
            trace,
            Config::default(),
        )
    }

    /// `"sim"` for the simulator, else a PCI address for VFIO. Without the `sim` feature `"sim"` is refused as
    /// not being a PCI address.
    pub fn open(spec: &str) -> Result<Context> {
        #[cfg(feature = "sim")]
        if spec == "sim" {
            return Self::open_sim();
        }
        Self::open_vfio(spec.parse()?)
    }

    fn bring_up(
        mmio: AnyMmio,
        dma: AnyDma,
        mut delay: AnyDelay,
        kind: DeviceKind,
        trace: Option<Tracer>,
        cfg: Config,
    ) -> Result<Context> {
        let mut hca = Hca::bring_up(mmio, dma, MaybeTrace(trace), &mut delay, cfg)
            .map_err(|e| VerbsError::Bringup(e.to_string()))?;
        let link = match hca.query_port(&mut delay) {
            Ok(p) => p.link_layer,
            Err(e) => {
                let _ = hca.teardown(&mut delay);
                return Err(e.into());
            }
        };
        Ok(Context {
            inner: RefCell::new(Inner {
                hca: Some(hca),
                delay,
                cqs: HashMap::new(),
                qps: HashMap::new(),
                orphan_cqs: Vec::new(),
                orphan_qps: Vec::new(),
            }),
            kind,
            link,
        })
    }

    fn inner(&self) -> RefMut<'_, Inner> {
        self.inner.borrow_mut()
    }

    /// The device underneath (the simulator handle gives tests access to its counters).
    pub fn device(&self) -> &DeviceKind {
        &self.kind
    }

    pub fn link_layer(&self) -> LinkLayer {
        self.link
    }

    /// `ibv_query_port` for port 1.
    pub fn query_port(&self) -> Result<PortAttr> {
        let mut i = self.inner();
        let Inner { hca, delay, .. } = &mut *i;
        Ok(hca.as_mut().expect("HCA present").query_port(delay)?)
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, index: u16) -> Result<[u8; 16]> {
        let mut i = self.inner();
        let Inner { hca, delay, .. } = &mut *i;
        Ok(hca.as_mut().expect("HCA present").query_gid(index, delay)?)
    }

    /// `ibv_query_gid_ex`: the GID at `index` with its type (InfiniBand, RoCE v1 or v2).
    pub fn query_gid_ex(&self, index: u16) -> Result<([u8; 16], GidType)> {
        let mut i = self.inner();
        let Inner { hca, delay, .. } = &mut *i;
        Ok(hca.as_mut().expect("HCA present").query_gid_ex(index, delay)?)
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
        let mut i = self.inner();
        let Inner { hca, delay, .. } = &mut *i;
        Ok(hca.as_mut().expect("HCA present").add_roce_address(addr, delay)?)
    }

    /// Removes a port address from the RoCE GID table (each entry holding it is cleared). Returns how many were.
    pub fn del_gid_address(&self, addr: [u8; 16]) -> Result<usize> {
        let mut i = self.inner();
        let Inner { hca, delay, .. } = &mut *i;
        Ok(hca.as_mut().expect("HCA present").del_roce_address(addr, delay)?)
    }

    /// What a peer needs to connect to `qp` on this device: QPN, LID, GID and (RoCE) MAC, as `rc_pingpong`
    /// exchanges them. The MAC is the one in the GID's EUI-64.
    pub fn remote_qp<S>(&self, qp: &QueuePair<'_, S>) -> Result<RemoteQp> {
        let port = self.query_port()?;
        let gid = self.query_gid(0)?;
        Ok(RemoteQp { qpn: qp.qpn, psn: 0, lid: port.lid, gid, mac: mac_of_gid(&gid) })
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain<'_>> {
        let mut i = self.inner();
        let Inner { hca, delay, .. } = &mut *i;
        let pd = hca.as_mut().expect("HCA present").alloc_pd(delay)?;
        Ok(ProtectionDomain { ctx: self, pd: Some(pd) })
    }

    /// DMA memory the device can reach, zero-filled, page aligned. Registered with [`ProtectionDomain::register`]
    /// it becomes a memory region.
    pub fn alloc_buffer(&self, len: usize) -> Result<DmaBuffer<'_>> {
        let dma = self.dma();
        let region = dma.alloc(len.max(1), 4096).map_err(VerbsError::Dma)?;
        Ok(DmaBuffer { dma, region: ManuallyDrop::new(region), len, leaked: false, _ctx: PhantomData })
    }

    fn dma(&self) -> AnyDma {
        match &self.kind {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyDma::Sim(d.dma()),
            DeviceKind::Vfio(v) => AnyDma::Vfio(v.clone()),
        }
    }

    /// `ibv_create_cq` for at least `cqe` completions, with 64-byte CQEs.
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue<'_>> {
        self.create_cq_with(CqAttr { cqe, ..CqAttr::default() })
    }

    pub fn create_cq_with(&self, attr: CqAttr) -> Result<CompletionQueue<'_>> {
        let mut i = self.inner();
        let Inner { hca, delay, cqs, .. } = &mut *i;
        let cq = hca.as_mut().expect("HCA present").create_cq(attr, delay)?;
        let cqn = cq.cqn();
        cqs.insert(cqn, cq);
        Ok(CompletionQueue { ctx: self, cqn })
    }

    /// The completion channel (`ibv_get_cq_event`): waits up to `timeout` for a completion event of an armed CQ
    /// and returns its CQN. On VFIO it sleeps on the EQ's interrupt; on the simulator it polls the EQ.
    pub fn get_cq_event(&self, timeout: Duration) -> Result<Option<u32>> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let mut i = self.inner();
                let Inner { hca, delay, .. } = &mut *i;
                if let Some(cqn) = hca.as_mut().expect("HCA present").get_cq_event(delay)? {
                    return Ok(Some(cqn));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            match &self.kind {
                DeviceKind::Vfio(v) => match &v.irqs {
                    Some(irqs) => {
                        irqs.wait(0, left)?;
                    }
                    None => std::thread::sleep(left.min(Duration::from_micros(50))),
                },
                #[cfg(feature = "sim")]
                DeviceKind::Sim(_) => std::thread::sleep(left.min(Duration::from_micros(50))),
            }
        }
    }

    /// DMA memory outstanding `(regions, bytes)`: after every object is dropped only the HCA's own remain.
    pub fn dma_outstanding(&self) -> (usize, usize) {
        self.kind.dma_outstanding()
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        let i = self.inner.get_mut();
        let Some(hca) = i.hca.take() else { return };
        // Teardown disables the function, so the queues still in the maps (and any orphan) can no longer be
        // reached by the device; their memory is released with it.
        if let Err(e) = hca.teardown(&mut i.delay) {
            log::error!("teardown: {e}");
        }
        i.cqs.clear();
        i.qps.clear();
        i.orphan_cqs.clear();
        i.orphan_qps.clear();
    }
}

/// The MAC address in a link-local GID (RoCE), as [`RemoteQp::mac`] carries it.
pub fn mac_of_gid(gid: &[u8; 16]) -> [u8; 6] {
    // A link-local GID carries the MAC as a modified EUI-64: flip the U/L bit, drop ff:fe.
    [gid[8] ^ 2, gid[9], gid[10], gid[13], gid[14], gid[15]]
}

// ---------------------------------------------------------------------------------------------------------------
// PD, buffers, MRs

/// A protection domain (`ibv_pd`). Memory regions and QPs borrow it, so it outlives them.
#[derive(Debug)]
pub struct ProtectionDomain<'ctx> {
    ctx: &'ctx Context,
    pd: Option<Pd>,
}

impl<'ctx> ProtectionDomain<'ctx> {
    fn pd(&self) -> &Pd {
        self.pd.as_ref().expect("PD present until drop")
    }

    pub fn pdn(&self) -> u32 {
        self.pd().pdn()
    }

    pub fn context(&self) -> &'ctx Context {
        self.ctx
    }

    /// `ibv_reg_mr` over a whole buffer. The buffer stays borrowed (and so allocated) while the region lives;
    /// its bytes are reached through the region's `read` / `write`.
    ///
    /// ```
    /// use mlx5_verbs::{Access, Context};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let mut buf = ctx.alloc_buffer(8192)?;
    /// let mr = pd.register(&mut buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    /// assert_eq!(mr.len(), 8192);
    /// assert_ne!(mr.lkey(), 0);
    /// // Remote write without local write is refused, as verbs refuses it.
    /// drop(mr);
    /// assert!(pd.register(&mut buf, Access::REMOTE_WRITE).is_err());
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn register<'a>(&'a self, buf: &'a mut DmaBuffer<'ctx>, access: Access) -> Result<MemoryRegion<'a>> {
        let mut i = self.ctx.inner();
        let Inner { hca, delay, .. } = &mut *i;
        let mr =
            hca.as_mut().expect("HCA present").reg_mr(self.pd(), buf.region.cpu().as_ptr(), buf.len, access, delay)?;
        Ok(MemoryRegion { pd: self, mr: Some(mr), region: buf.region.view(), len: buf.len, leaked: &mut buf.leaked })
    }

    /// `ibv_create_qp`: a QP in RESET completing sends on `send_cq` and receives on `recv_cq`.
    pub fn create_qp<'a>(
        &'a self,
        qp_type: QpType,
        send_cq: &'a CompletionQueue<'ctx>,
        recv_cq: &'a CompletionQueue<'ctx>,
        cap: QpCap,
    ) -> Result<QueuePair<'a, Reset>> {
        let mut i = self.ctx.inner();
        let Inner { hca, delay, cqs, qps, .. } = &mut *i;
        let (s, r) = (cqs.get(&send_cq.cqn), cqs.get(&recv_cq.cqn));
        let (Some(s), Some(r)) = (s, r) else { return Err(VerbsError::Invalid("CQ already destroyed".into())) };
        let attr = QpInitAttr { qp_type, cap, sq_sig_all: false };
        let qp = hca.as_mut().expect("HCA present").create_qp(self.pd(), s, r, attr, delay)?;
        let qpn = qp.qpn();
        let cap = qp.cap();
        qps.insert(qpn, qp);
        Ok(QueuePair { ctx: self.ctx, qpn, qp_type, cap, _borrows: PhantomData })
    }

    /// `ibv_create_ah` for UD sends.
    pub fn create_ah(&self, attr: &AhAttr) -> AddressHandle<'_> {
        AddressHandle { ah: Ah::new(attr, self.ctx.link), _pd: PhantomData }
    }

    /// `ibv_dealloc_pd`, returning firmware's error.
    pub fn destroy(mut self) -> Result<()> {
        self.dealloc()
    }

    fn dealloc(&mut self) -> Result<()> {
        let Some(pd) = self.pd.take() else { return Ok(()) };
        let mut i = self.ctx.inner();
        let Inner { hca, delay, .. } = &mut *i;
        hca.as_mut().expect("HCA present").dealloc_pd(pd, delay).map_err(|e| VerbsError::Destroy(e.error))
    }
}

impl Drop for ProtectionDomain<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.dealloc() {
            log::error!("dealloc PD: {e}");
        }
    }
}

/// An address handle for UD sends (`ibv_ah`).
#[derive(Debug)]
pub struct AddressHandle<'pd> {
    ah: Ah,
    _pd: PhantomData<&'pd ()>,
}

impl AddressHandle<'_> {
    /// A UD destination through this handle.
    pub fn dest(&self, remote_qpn: u32, remote_qkey: u32) -> UdDest<'_> {
        UdDest { ah: &self.ah, remote_qpn, remote_qkey }
    }
}

/// DMA memory of a context. While no memory region covers it, it is an ordinary byte slice (`Deref`); a region
/// borrows it mutably, so it can be neither touched directly nor freed while the device may reach it.
pub struct DmaBuffer<'ctx> {
    dma: AnyDma,
    /// `ManuallyDrop` only so that `drop` can move it into `Dma::free`.
    region: ManuallyDrop<DmaRegion>,
    len: usize,
    /// Set when deregistration failed: the key may still exist, so the memory is never given back.
    leaked: bool,
    _ctx: PhantomData<&'ctx Context>,
}

impl std::fmt::Debug for DmaBuffer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaBuffer").field("len", &self.len).field("iova", &self.region.iova()).finish()
    }
}

impl Deref for DmaBuffer<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region is live for self's lifetime and holds at least len bytes; no memory region covers it
        // while this shared borrow exists (registering takes &mut), so the device does not write it.
        unsafe { std::slice::from_raw_parts(self.region.cpu().as_ptr(), self.len) }
    }
}

impl DerefMut for DmaBuffer<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for deref, and &mut self makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.region.cpu().as_ptr(), self.len) }
    }
}

impl Drop for DmaBuffer<'_> {
    fn drop(&mut self) {
        if self.leaked {
            return;
        }
        // SAFETY: `drop` runs once and nothing reads `self.region` after this.
        let region = unsafe { ManuallyDrop::take(&mut self.region) };
        // SAFETY: the region came from this allocator and no memory key covers it any more (a region borrowing it
        // has been dropped and deregistered; a failed deregistration sets `leaked`).
        unsafe { self.dma.free(region) };
    }
}

/// Where a remote buffer is: its address and rkey, for RDMA and atomics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteBuf {
    pub addr: u64,
    pub rkey: u32,
}

/// A registered memory region (`ibv_mr`). Borrows its PD and its buffer.
pub struct MemoryRegion<'a> {
    pd: &'a ProtectionDomain<'a>,
    mr: Option<Mr>,
    region: DmaView<'a>,
    len: usize,
    /// The buffer's `leaked` flag: borrowing it mutably keeps the whole buffer borrowed (so neither touched nor
    /// freed) for as long as the region lives, and lets a failed deregistration keep the memory forever.
    leaked: &'a mut bool,
}

impl std::fmt::Debug for MemoryRegion<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion").field("mr", &self.mr).finish()
    }
}

impl MemoryRegion<'_> {
    fn mr(&self) -> &Mr {
        self.mr.as_ref().expect("MR present until drop")
    }

    pub fn lkey(&self) -> u32 {
        self.mr().lkey
    }

    pub fn rkey(&self) -> u32 {
        self.mr().rkey
    }

    /// The region's first virtual address (what a peer puts in `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.mr().addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A scatter/gather entry for `len` bytes at `offset`.
    ///
    /// # Panics
    /// When the range is outside the region (a caller bug; the device would refuse it with a protection error).
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        assert!(offset.checked_add(len as usize).is_some_and(|e| e <= self.len()), "SGE outside the region");
        Sge { addr: self.addr() + offset as u64, length: len, lkey: self.lkey() }
    }

    /// The remote view of `offset` in this region, for a peer's RDMA.
    pub fn remote(&self, offset: usize) -> RemoteBuf {
        RemoteBuf { addr: self.addr() + offset as u64, rkey: self.rkey() }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(VerbsError::Invalid(format!(
                "{len} bytes at {offset} are outside a {}-byte region",
                self.len()
            )));
        }
        Ok(())
    }

    /// Copies `data` into the region at `offset`. Volatile: the device may read it concurrently.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        let p = self.region.ptr_at(offset, data.len());
        for (i, b) in data.iter().enumerate() {
            // SAFETY: p..p+len is inside the live region (checked above).
            unsafe { p.add(i).write_volatile(*b) };
        }
        Ok(())
    }

    /// Copies bytes out of the region at `offset`. Volatile: the device may be writing it.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        let p = self.region.ptr_at(offset, out.len());
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: p..p+len is inside the live region (checked above).
            *b = unsafe { p.add(i).read_volatile() };
        }
        Ok(())
    }

    /// `len` bytes at `offset` as a new vector (a convenience for tests and examples).
    ///
    /// # Panics
    /// When the range is outside the region.
    pub fn read_vec(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.read(offset, &mut v).expect("range inside the region");
        v
    }

    /// `ibv_dereg_mr`, returning firmware's error (the buffer is then never freed).
    pub fn destroy(mut self) -> Result<()> {
        self.dereg()
    }

    fn dereg(&mut self) -> Result<()> {
        let Some(mr) = self.mr.take() else { return Ok(()) };
        let mut i = self.pd.ctx.inner();
        let Inner { hca, delay, .. } = &mut *i;
        hca.as_mut().expect("HCA present").dereg_mr(mr, delay).map_err(|e| {
            *self.leaked = true;
            VerbsError::Destroy(e.error)
        })
    }
}

impl Drop for MemoryRegion<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.dereg() {
            log::error!("dereg MR: {e}; its buffer is kept");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Completion queues

/// A completion queue (`ibv_cq`).
#[derive(Debug)]
pub struct CompletionQueue<'ctx> {
    ctx: &'ctx Context,
    cqn: u32,
}

impl CompletionQueue<'_> {
    pub fn cqn(&self) -> u32 {
        self.cqn
    }

    /// `ibv_poll_cq`: fills the front of `wc` with completions, returns how many. Allocates nothing.
    pub fn poll(&self, wc: &mut [WorkCompletion]) -> Result<usize> {
        let mut i = self.ctx.inner();
        let Inner { hca, cqs, qps, .. } = &mut *i;
        let hca = hca.as_ref().expect("HCA present");
        let cq = cqs.get_mut(&self.cqn).ok_or_else(|| VerbsError::Invalid("CQ destroyed".into()))?;
        // Through the HCA: once the device is dead, outstanding work requests complete here as flushed.
        hca.poll_cq(cq, &mut QpTable(qps), wc).map_err(|e| VerbsError::Cqe(e.to_string()))
    }

    /// Polls until `want` completions arrived or `timeout` passed; returns how many were written to `wc`.
    pub fn poll_until(&self, wc: &mut [WorkCompletion], want: usize, timeout: Duration) -> Result<usize> {
        let want = want.min(wc.len());
        let deadline = Instant::now() + timeout;
        let mut n = 0;
        while n < want {
            n += self.poll(&mut wc[n..want])?;
            if n < want && Instant::now() >= deadline {
                break;
            }
        }
        Ok(n)
    }

    /// `ibv_req_notify_cq`: the next completion (or the next solicited one) raises an event on the channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        let mut i = self.ctx.inner();
        let Inner { hca, cqs, .. } = &mut *i;
        let cq = cqs.get(&self.cqn).ok_or_else(|| VerbsError::Invalid("CQ destroyed".into()))?;
        let notify = if solicited_only { Notify::Solicited } else { Notify::NextComp };
        Ok(hca.as_mut().expect("HCA present").req_notify_cq(cq, notify)?)
    }

    /// `ibv_ack_cq_events`.
    pub fn ack_events(&self, n: u32) -> Result<()> {
        let mut i = self.ctx.inner();
        let Inner { hca, cqs, .. } = &mut *i;
        let cq = cqs.get(&self.cqn).ok_or_else(|| VerbsError::Invalid("CQ destroyed".into()))?;
        Ok(hca.as_mut().expect("HCA present").ack_cq_events(cq, n)?)
    }

    /// `ibv_destroy_cq`, returning firmware's error.
    pub fn destroy(self) -> Result<()> {
        let r = self.destroy_inner();
        std::mem::forget(self);
        r
    }

    fn destroy_inner(&self) -> Result<()> {
        let mut i = self.ctx.inner();
        let Inner { hca, delay, cqs, orphan_cqs, .. } = &mut *i;
        let Some(cq) = cqs.remove(&self.cqn) else { return Ok(()) };
        hca.as_mut().expect("HCA present").destroy_cq(cq, delay).map_err(|e| {
            orphan_cqs.push(e.obj);
            VerbsError::Destroy(e.error)
        })
    }
}

impl Drop for CompletionQueue<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_inner() {
            log::error!("destroy CQ {:#x}: {e}", self.cqn);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Queue pairs

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

/// A refused transition: the QP, still in its old state, and why.
#[derive(Debug)]
pub struct TransitionError<'a, S> {
    pub qp: QueuePair<'a, S>,
    pub error: VerbsError,
}

/// A queue pair (`ibv_qp`) in state `S`. Borrows its PD and CQs; destroyed on drop.
#[derive(Debug)]
pub struct QueuePair<'a, S> {
    ctx: &'a Context,
    qpn: u32,
    qp_type: QpType,
    cap: QpCap,
    _borrows: PhantomData<(&'a ProtectionDomain<'a>, &'a CompletionQueue<'a>, S)>,
}

impl<'a, S> QueuePair<'a, S> {
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The capabilities granted (at least those requested).
    pub fn cap(&self) -> QpCap {
        self.cap
    }

    /// The state firmware reports (`ibv_query_qp`); differs from `S` when the device moved the QP to an error
    /// state.
    pub fn query_state(&self) -> Result<QpState> {
        let mut i = self.ctx.inner();
        let Inner { hca, delay, qps, .. } = &mut *i;
        let qp = qps.get(&self.qpn).ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        Ok(hca.as_mut().expect("HCA present").query_qp(qp, delay)?.state)
    }

    fn modify<T>(
        self,
        attr: &QpAttr,
        mask: QpAttrMask,
    ) -> std::result::Result<QueuePair<'a, T>, TransitionError<'a, S>> {
        let r = {
            let mut i = self.ctx.inner();
            let Inner { hca, delay, qps, .. } = &mut *i;
            match qps.get_mut(&self.qpn) {
                Some(qp) => {
                    hca.as_mut().expect("HCA present").modify_qp(qp, attr, mask, delay).map_err(VerbsError::from)
                }
                None => Err(VerbsError::Invalid("QP destroyed".into())),
            }
        };
        match r {
            Ok(()) => {
                let me = ManuallyDrop::new(self);
                Ok(QueuePair { ctx: me.ctx, qpn: me.qpn, qp_type: me.qp_type, cap: me.cap, _borrows: PhantomData })
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
        let r = self.destroy_inner();
        std::mem::forget(self);
        r
    }

    fn destroy_inner(&self) -> Result<()> {
        let mut i = self.ctx.inner();
        let Inner { hca, delay, qps, orphan_qps, .. } = &mut *i;
        let Some(qp) = qps.remove(&self.qpn) else { return Ok(()) };
        hca.as_mut().expect("HCA present").destroy_qp(qp, delay).map_err(|e| {
            orphan_qps.push(e.obj);
            VerbsError::Destroy(e.error)
        })
    }
}

impl<S> Drop for QueuePair<'_, S> {
    fn drop(&mut self) {
        if let Err(e) = self.destroy_inner() {
            log::error!("destroy QP {:#x}: {e}", self.qpn);
        }
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
            attr.ah_attr = match self.ctx.link {
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
    /// `ibv_post_send`: posts every request and rings the doorbell once. Allocates nothing. On error, the
    /// requests before `PostError::index` are posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut i = self.ctx.inner();
        let Inner { hca, qps, .. } = &mut *i;
        let qp = qps.get_mut(&self.qpn).ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        Ok(hca.as_ref().expect("HCA present").post_send(qp, wrs)?)
    }
}

impl<S: CanRecv> QueuePair<'_, S> {
    /// `ibv_post_recv`. Allocates nothing.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let mut i = self.ctx.inner();
        let Inner { hca, qps, .. } = &mut *i;
        let qp = qps.get_mut(&self.qpn).ok_or_else(|| VerbsError::Invalid("QP destroyed".into()))?;
        Ok(hca.as_ref().expect("HCA present").post_recv(qp, wrs)?)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Work-request builders

/// Builders for work requests: each returns a signaled request; chain [`WrExt`](wr::WrExt) methods to change flags.
///
/// ```
/// use mlx5_verbs::{wr, wr::WrExt, RemoteBuf, Sge};
/// let sg = [Sge { addr: 0x1000, length: 64, lkey: 7 }];
/// let w = wr::rdma_write(9, &sg, RemoteBuf { addr: 0x2000, rkey: 8 }).unsignaled();
/// assert_eq!(w.wr_id, 9);
/// ```
pub mod wr {
    use super::{RecvWr, RemoteBuf, SendFlags, SendOp, SendWr, Sge, UdDest};

    fn base<'a>(wr_id: u64, op: SendOp, sg_list: &'a [Sge]) -> SendWr<'a> {
        SendWr { wr_id, op, sg_list, flags: SendFlags::SIGNALED, inline: None, ud: None }
    }

    pub fn send(wr_id: u64, sg: &[Sge]) -> SendWr<'_> {
        base(wr_id, SendOp::Send, sg)
    }

    pub fn send_imm(wr_id: u64, sg: &[Sge], imm: u32) -> SendWr<'_> {
        base(wr_id, SendOp::SendImm { imm }, sg)
    }

    /// A SEND whose payload travels inside the WQE: `data` may be reused as soon as the post returns.
    pub fn send_inline(wr_id: u64, data: &[u8]) -> SendWr<'_> {
        SendWr { inline: Some(data), ..base(wr_id, SendOp::Send, &[]) }
    }

    /// A UD SEND to `dest`.
    pub fn ud_send<'a>(wr_id: u64, sg: &'a [Sge], dest: UdDest<'a>) -> SendWr<'a> {
        SendWr { ud: Some(dest), ..base(wr_id, SendOp::Send, sg) }
    }

    pub fn rdma_write(wr_id: u64, sg: &[Sge], to: RemoteBuf) -> SendWr<'_> {
        base(wr_id, SendOp::RdmaWrite { remote_addr: to.addr, rkey: to.rkey }, sg)
    }

    pub fn rdma_write_imm(wr_id: u64, sg: &[Sge], to: RemoteBuf, imm: u32) -> SendWr<'_> {
        base(wr_id, SendOp::RdmaWriteImm { remote_addr: to.addr, rkey: to.rkey, imm }, sg)
    }

    pub fn rdma_read(wr_id: u64, sg: &[Sge], from: RemoteBuf) -> SendWr<'_> {
        base(wr_id, SendOp::RdmaRead { remote_addr: from.addr, rkey: from.rkey }, sg)
    }

    /// 8-byte fetch-and-add at `at`; the old value lands in `sg`.
    pub fn fetch_add(wr_id: u64, sg: &[Sge], at: RemoteBuf, add: u64) -> SendWr<'_> {
        base(wr_id, SendOp::AtomicFetchAdd { remote_addr: at.addr, rkey: at.rkey, add }, sg)
    }

    /// 8-byte compare-and-swap at `at`; the old value lands in `sg`.
    pub fn cmp_swap(wr_id: u64, sg: &[Sge], at: RemoteBuf, compare: u64, swap: u64) -> SendWr<'_> {
        base(wr_id, SendOp::AtomicCmpSwp { remote_addr: at.addr, rkey: at.rkey, compare, swap }, sg)
    }

    pub fn recv(wr_id: u64, sg: &[Sge]) -> RecvWr<'_> {
        RecvWr { wr_id, sg_list: sg }
    }

    /// Flag changes on a send request.
    pub trait WrExt {
        /// No completion unless it fails (a later signaled one retires it).
        fn unsignaled(self) -> Self;
        fn solicited(self) -> Self;
        fn fenced(self) -> Self;
    }

    impl WrExt for SendWr<'_> {
        fn unsignaled(mut self) -> Self {
            self.flags = SendFlags(self.flags.0 & !SendFlags::SIGNALED.0);
            self
        }
        fn solicited(mut self) -> Self {
            self.flags = self.flags | SendFlags::SOLICITED;
            self
        }
        fn fenced(mut self) -> Self {
            self.flags = self.flags | SendFlags::FENCE;
            self
        }
    }
}

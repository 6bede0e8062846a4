//! The device behind a context: register access, DMA memory and waiting for either a simulated ConnectX or one
//! through VFIO, and the command tracer.

use std::sync::Arc;

use mlx5_core::hal::{DelayNs, Dma, DmaError, DmaRegion, Mmio};
use mlx5_core::hca::Hca;
use mlx5_core::trace::{CmdRecord, CmdTrace};
#[cfg(feature = "sim")]
use mlx5_sim::{SimDelay, SimDevice, SimDma, SimMmio};
use mlx5_vfio::{StdDelay, Vfio};

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

/// The device's tracer, if any. Without one a firmware command costs one untaken branch; the datapath never
/// reaches it.
pub(crate) struct MaybeTrace(pub(crate) Option<Tracer>);

impl CmdTrace for MaybeTrace {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        if let Some(t) = &mut self.0 {
            t.record(rec);
        }
    }
}

pub(crate) type AnyHca = Hca<AnyMmio, AnyDma, MaybeTrace>;

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

    pub(crate) fn mmio(&self) -> AnyMmio {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyMmio::Sim(d.mmio()),
            DeviceKind::Vfio(v) => AnyMmio::Vfio(v.clone()),
        }
    }

    pub(crate) fn dma(&self) -> AnyDma {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyDma::Sim(d.dma()),
            DeviceKind::Vfio(v) => AnyDma::Vfio(v.clone()),
        }
    }

    pub(crate) fn delay(&self) -> AnyDelay {
        match self {
            #[cfg(feature = "sim")]
            DeviceKind::Sim(d) => AnyDelay::Sim(d.delay()),
            DeviceKind::Vfio(_) => AnyDelay::Std(StdDelay),
        }
    }
}

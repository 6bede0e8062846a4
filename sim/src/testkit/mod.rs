//! The shared test kit, compiled only with the `test-utils` feature (and for the simulator's own unit tests): the
//! fakes, recording mocks, counting allocator and simulator fixtures that the cross-crate tests, the benchmarks,
//! the fuzz targets and the soak build on, so each is written once.
//!
//! - [`HeapDma`]: heap memory as a [`Dma`](mlx5_core::hal::Dma), with bus addresses packed, scripted, guarded
//!   (fuzzing, with a bounded pool) or equal to the CPU address (benchmarks).
//! - [`RegFile`]: a BAR that is a register file (logged writes, hooks that let a test play the device).
//! - [`mocks`]: recording wrappers for any `Mmio` / `Dma`, and [`MemMmio`](mocks::MemMmio), the plain-memory BAR
//!   the datapath is measured against.
//! - [`alloc_count`]: the per-thread counting global allocator behind the no-allocation checks.
//! - [`Node`]: a brought-up simulated HCA with a PD and a registered buffer, RC QPs connected on it, and a teardown
//!   that checks nothing leaked; [`RcPair`]: two such devices on the wire with a connected RC QP each.

pub mod alloc_count;
/// The Ethernet objects' fixture over `submit` (unit tests only, for the same reason).
#[cfg(test)]
pub(crate) mod eth;
mod fixture;
mod heap_dma;
pub mod mocks;
mod regfile;
/// The simulator's own unit tests' command submitter (it names crate items, so it is not part of the kit).
#[cfg(test)]
pub(crate) mod submit;
mod wire;

pub use fixture::{Node, RcOpts, RcPair, SimHca};
pub use heap_dma::{HeapDma, Iovas};
pub use regfile::{RegFile, Write, BAR_LEN, UAR_OFF};
pub use wire::{wire_stream, WireStats};

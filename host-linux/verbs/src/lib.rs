//! `mlx5-verbs`: a safe, verbs-shaped API over the core, for a Linux process: open a device (simulated, or a
//! ConnectX through VFIO), then protection domains, memory regions, completion queues with a completion channel,
//! and RC / UD queue pairs whose states are types.
//!
//! It is not libibverbs: there is no kernel uverbs device, no provider plugin and no C ABI; the process owns the
//! whole function through `mlx5-vfio`. The simulated devices come with the `sim` feature (on by default); without
//! it only VFIO devices can be opened and `mlx5-sim` is not built. [`devices`] lists the process's devices
//! (`mlx5_0`, ...); opening one twice shares its HCA.
//!
//! Verbs are thread-safe: [`Context`], [`ProtectionDomain`], [`MemoryRegion`], [`CompletionQueue`] and
//! [`QueuePair`] are `Send` and `Sync`. Commands (create, modify, destroy, queries) go through one control mutex
//! per device; posting takes only the QP's own lock and polling only the CQ's (and the locks of the QPs its
//! completions name), so one thread per QP posts and polls without contention. Each context receives async
//! events ([`Context::get_async_event`], pollable through [`Context::async_fd`]); a service thread per device
//! checks its health every 2 s, as Linux's health timer does, so a dead device is noticed without commands.
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

mod ah;
mod backend;
mod context;
mod cq;
mod cq_ex;
mod device;
pub mod devinfo;
mod error;
mod event;
mod fork;
mod gsi;
mod mr;
mod pd;
mod qp;
mod qp_ex;
pub mod raw;
mod shared;
mod smi;
mod spin;
mod srq;
pub mod tracefile;
mod usermem;
/// Registrations of the process's own memory, through `raw`: above both the memory check and the objects.
#[cfg(all(test, feature = "sim", target_os = "linux"))]
mod usermem_tests;
pub mod wr;

pub use ah::AddressHandle;
pub use backend::{AnyDelay, AnyDma, AnyMmio, DeviceKind, HostTables, MmioFn, Tracer, VecTable};
pub use context::{mac_of_gid, Context};
pub use cq::{CompChannel, CompletionQueue, CqEvent};
pub use cq_ex::{CompletionQueueEx, CqInitAttrEx};
pub use device::{
    cache_line_size, devices, drain_wires, host_config, log_wire_recoveries, scan_vfio_pci, Device, DeviceRegistry,
    DeviceSpec, DEVICES_ENV, MELLANOX_VENDOR_ID,
};
#[cfg(feature = "sim")]
pub use device::{vde_identity, WireSpec};
pub use error::{BadMemory, BadMemoryKind, Result, VerbsError};
pub use event::AsyncEvent;
pub use fork::generation as fork_generation;
pub use fork::generation_now as fork_generation_now;
pub use gsi::{GmpReply, GsiClient};
pub use mlx5_core::ah::{AhFromWcError, GRH_BYTES};
pub use mlx5_core::cq::CqeError;
pub use mlx5_core::cq::{CqEx, ExPoll, ExPoller, WcExFlags};
pub use mlx5_core::cq::{LinkLayer, Notify, WcFlags, WcOpcode, WcStatus, WorkCompletion};
pub use mlx5_core::eq::QpErrorKind;
pub use mlx5_core::hca::{CqAttr, GidType, PortAttr, SrqAttr};
pub use mlx5_core::mad_ifc::{MadIfcFlags, MadReply, MadStatus, MadStatusCode, MAD_LEN};
pub use mlx5_core::mkey::Access;
pub use mlx5_core::qp::{
    Ah, AhAttr, Grh, Mtu, PostError, PostErrorKind, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
    UdDest,
};
pub use mlx5_core::qp::{QpEx, QpExError, SendOpsFlags, WrBatch};
pub use mlx5_core::trace::{CmdRecord, CmdTrace};
pub use mlx5_rdmacm::gmp::GmpCounters;
pub use mr::{DmaBuffer, MemoryRegion, RemoteBuf, Rereg, ReregFailure};
pub use pd::ProtectionDomain;
pub use qp::{
    CanRecv, CanSend, ErrState, Init, InitAttr, QpInitAttr, QueuePair, RemoteQp, Reset, Rtr, RtrAttr, Rts, RtsAttr,
    TransitionError,
};
pub use qp::{QpFn, QpFnOr, RecvBatchFn, SendBatchFn};
pub use qp_ex::QpWrBatch;
pub use smi::{SmiAgent, SmiOutcome, SmiStats};
pub use srq::{SharedReceiveQueue, SrqAttrMask, SrqInitAttr};

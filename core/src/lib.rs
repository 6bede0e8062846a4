//! `mlx5-core`: the hardware-facing half of an mlx5 (NVIDIA ConnectX) driver, `no_std` and without alloc.
//!
//! It encodes firmware commands from the exact PRM layouts ([`prm`]), drives the command queue ([`cmdq`]) and
//! (in later layers) brings the HCA up and runs queues, all against the abstract [`hal`] traits so the same code
//! runs in a Linux process over VFIO, in a unikernel, in SmartNIC firmware, or against `mlx5-sim`.
#![no_std]
#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod ah;
pub mod buf;
pub mod caps;
pub mod cmd;
pub mod cmdq;
pub mod cq;
pub mod dbr;
pub mod eq;
// The kernel's golden vectors through the encoders, without std (tests only).
#[cfg(any(test, feature = "testlist"))]
mod golden;
pub mod hal;
pub mod hca;
pub mod health;
pub mod init;
pub mod mad_ifc;
pub mod mkey;
#[cfg(feature = "mock")]
pub mod mock;
pub mod pages;
pub mod pd;
pub mod port;
pub mod prm;
pub mod qcounter;
pub mod qp;
pub mod reg;
pub mod smp_route;
pub mod srq;
pub mod table;
#[cfg(feature = "testlist")]
pub mod testlist;
pub mod trace;
pub mod uar;
pub mod vport;

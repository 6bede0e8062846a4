//! The simulated ConnectX ([`mlx5_sim::SimDevice`]) as a PCI function of a QEMU machine, behind
//! `-device x-pci-proxy-dev,fd=N` (QEMU's multi-process "remote device" protocol, `hw/remote`).
//!
//! QEMU forwards every config-space and BAR access of the proxy function over a UNIX stream socket and waits
//! for the answer; it shares guest RAM as memfd file descriptors (SYNC_SYSMEM), which this server maps and hands
//! to the simulator, so the device DMAs straight into guest memory at guest-physical addresses. The proxy has no
//! MSI or MSI-X and raises INTx only through KVM irqfds: a driver of this function polls.
//!
//! Layers: `msg` (the message format and its socket I/O, fds included), `config` (config space: a 32-bit BAR0,
//! the PCI Express capability with function-level reset), `memory` (guest RAM regions, bounds-checked), `server`
//! (requests to the simulator, device reset, the poll loop).

pub mod config;
pub mod memory;
pub mod msg;
pub mod server;

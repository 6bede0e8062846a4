//! A bridge that presents the simulated ConnectX ([`mlx5_sim::SimDevice`]) to User-Mode Linux as a PCI device,
//! so NVIDIA's own `mlx5_core` and `mlx5_ib` drive it.
//!
//! UML's `virt-pci` (`CONFIG_UML_PCI_OVER_VIRTIO`) is a vhost-user front end: it connects to our UNIX socket,
//! shares its RAM file (SET_MEM_TABLE) and sends config-space and BAR accesses on virtqueue 0; we send interrupts
//! (op MSI with the MSI-X data word) on virtqueue 1. The simulator's DMA reaches UML physical addresses through
//! the shared mapping ([`mlx5_sim::SimDevice::map_guest_memory`]).
//!
//! Layers: `guest` (bounds-checked guest memory), `vring` (split virtqueues), `vhost` (the socket protocol), `pci`
//! (config space, BAR sizing, MSI-X), `device` (requests to the simulator), `barfile` (user doorbells through the
//! BAR file), `server` (the event loop).

pub mod barfile;
pub mod device;
pub mod guest;
pub mod pci;
pub mod server;
pub mod vhost;
pub mod vring;

//! `mlx5-host`: the Linux side of the driver. The VFIO shim (`vfio`: BAR mapping, IOMMU-backed DMA, MSI-X /
//! MSI into eventfds, sysfs binding) runs the core on a real ConnectX; the rest serves the `mlx5` tool on either
//! a VFIO device or the simulated one (command-trace sinks, devinfo, the RC ping-pong, the firmware tour).

pub mod decode;
pub mod devinfo;
pub mod perftest;
pub mod pingpong;
pub mod remote_pingpong;
pub mod tour;
pub mod tracefile;
pub mod verbs;
pub mod vfio;

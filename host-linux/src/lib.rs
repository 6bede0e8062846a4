//! `mlx5-host`: the Linux side of the driver. Today it provides the command-trace sinks and opens the simulated
//! device for the `mlx5` tool; the VFIO shim (BAR mapping, IOMMU DMA, MSI-X) lands here next.

pub mod devinfo;
pub mod pingpong;
pub mod tour;
pub mod tracefile;

//! Simulated mlx5 device.

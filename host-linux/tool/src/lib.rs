//! `mlx5-tool`: the pieces of the `mlx5` command-line tool, on a VFIO device or the simulated one: command-trace
//! sinks (`tracefile`) and their decoder (`decode`), `ibv_devinfo` (`devinfo`), the firmware tour (`tour`), the
//! RC ping-pong over the core's traits (`pingpong`), the two-process one (`remote_pingpong`) and the UD one
//! (`ud_pingpong`) over the verbs API, and the perftest-like bench (`perftest`). The binary is `src/bin/mlx5.rs`.
//!
//! It is not a library for applications: programs use `mlx5-verbs` (or the core directly); this crate's API is
//! whatever the tool and the workspace's tests need.

pub mod cli;
pub mod decode;
pub mod devinfo;
pub mod perftest;
pub mod pingpong;
pub mod remote_pingpong;
pub mod tour;
pub mod tracefile;
pub mod ud_pingpong;

//! `mlx5-tool`: the pieces of the `mlx5` command-line tool, on a VFIO device or the simulated one: the decoder of
//! command traces (`decode`), the firmware tour (`tour`), the RC ping-pong over the core's traits (`pingpong`),
//! the two-process one (`remote_pingpong`, its peers' message in `exchange`) and the UD one (`ud_pingpong`)
//! over the verbs API, and the perftest-like bench (`perftest`). The binary is `src/bin/mlx5.rs`.
//!
//! What a command fails with is `error::ToolError`.
//!
//! The trace sinks (`mlx5_verbs::tracefile`) and the `ibv_devinfo` report (`mlx5_verbs::devinfo`) live in the
//! verbs crate: the drop-in libibverbs writes and answers them too, and a library does not depend on a tool.
//!
//! It is not a library for applications: programs use `mlx5-verbs` (or the core directly); this crate's API is
//! whatever the tool and the workspace's tests need.

pub mod cli;
pub mod decode;
pub mod error;
pub mod exchange;
pub mod perftest;
pub mod pingpong;
pub mod remote_pingpong;
pub mod tour;
pub mod ud_pingpong;

//! `mlx5-rdmacm`: the connection manager the drop-in `librdmacm.so.1` is to run over the drop-in libibverbs, kept
//! free of I/O so every exchange is testable without a device.
//!
//! Layers, each importing only those before it: `mad.rs` (the MAD and its common header, checked as bytes a peer
//! sent), `cm.rs` (IBTA chapter 12's messages in the CM class), `engine.rs` (the CM state machine: listeners,
//! connections by communication ID, retries and timeouts on the caller's clock, and the answers the spec gives to
//! what does not fit).

pub mod cm;
pub mod engine;
pub mod mad;

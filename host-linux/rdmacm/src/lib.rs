//! `mlx5-rdmacm`: the connection manager the drop-in `librdmacm.so.1` is to run over the drop-in libibverbs, kept
//! free of I/O so every exchange is testable without a device.
//!
//! Layers, each importing only those before it: `mad.rs` (the MAD and its common header, checked as bytes a peer
//! sent), `smp.rs` (what of QP0's traffic a channel adapter hands its subnet management agent, and the
//! directed-route hop rules for the request and its response), `gmp.rs` (transactions of general management
//! packets: each request matched to its response by transaction ID, sent again after its timeout, given up after
//! its retries), `cm.rs` (IBTA chapter 12's messages in the CM class), `ip.rs` (rdma_cm's service IDs and the IP header
//! in a REQ's private data, as Linux's `cma.c` writes them), `engine.rs` (the CM state machine: listeners,
//! connections by communication ID, retries and timeouts on the caller's clock, and the answers the spec gives to
//! what does not fit).

pub mod cm;
pub mod engine;
pub mod gmp;
pub mod ip;
pub mod mad;
pub mod smp;

//! The Ethernet (NIC) datapath, the device side of the objects in `fw/` (`tir.rs`, `rqt.rs`, `flow_table.rs`):
//! `classify.rs` reads a received frame's outer headers into the match image NIC receive steering compares and
//! picks the RQ a TIR delivers to, `rss.rs` is the Toeplitz hash an RSS TIR spreads flows with, `send.rs` parses
//! the Ethernet send WQE and does what it asks (checksum offload, LSO), `rx_cqe.rs` builds a received packet's
//! CQE (header types, OK bits, checksum, RSS hash), and `engine.rs` runs them: an SQ's WQEs onto the wire,
//! a received frame that is not RoCE through steering into its RQ.

pub(crate) mod classify;
pub(crate) mod engine;
pub(crate) mod rss;
pub(crate) mod rx_cqe;
pub(crate) mod send;

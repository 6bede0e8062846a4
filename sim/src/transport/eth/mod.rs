//! The Ethernet (NIC) datapath, the device side of the objects in `fw/` (`tir.rs`, `rqt.rs`, `flow_table.rs`):
//! `classify.rs` reads a received frame's outer headers into the match image NIC receive steering compares and
//! picks the RQ a TIR delivers to, `rss.rs` is the Toeplitz hash an RSS TIR spreads flows with, `send.rs` parses
//! the Ethernet send WQE and does what it asks (checksum offload, LSO), `rx_cqe.rs` builds a received packet's
//! CQE (header types, OK bits, checksum, RSS hash).
//!
//! Not written yet (issue 35): the SQ doorbell running `send.rs` (gathering through the data segments' keys,
//! send CQEs), the RQ receive into the ring with RX CQEs, and the port's demultiplexing that hands non-RoCE
//! frames to `classify`; until then nothing outside the tests calls this module.
#![cfg_attr(not(test), allow(dead_code))]

pub(crate) mod classify;
pub(crate) mod rss;
pub(crate) mod rx_cqe;
pub(crate) mod send;

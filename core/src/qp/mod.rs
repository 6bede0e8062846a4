//! Queue pairs (PRM CREATE_QP / RST2INIT / INIT2RTR / RTR2RTS / RTS2RTS / 2ERR / 2RST / QUERY_QP / DESTROY_QP;
//! mlx5_ib `qp.c` and `wr.c`, rdma-core `providers/mlx5/qp.c` and `verbs.c`).
//!
//! One buffer holds the receive queue (from byte 0) and the send queue (right after it). Send WQEs are made of
//! 16-byte segments in 64-byte basic blocks (BBs) and may wrap from the end of the SQ to its start; receive WQEs
//! are arrays of data segments. The driver's own bookkeeping (`wr_id` per WQE, which WQE a completion retires up
//! to) lives in a host-only array, allocated from the DMA allocator because the core has no heap; the device never
//! sees it.

pub(crate) mod attr;
pub(crate) mod cmd;
pub(crate) mod ex;
pub(crate) mod ring;
pub(crate) mod size;
pub(crate) mod wr;

pub use attr::*;
pub use cmd::*;
pub use ex::*;
pub use ring::*;
pub use size::*;
pub use wr::*;

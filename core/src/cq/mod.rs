//! Completion queues (PRM CREATE_CQ / DESTROY_CQ / QUERY_CQ / MODIFY_CQ; Linux `cq.c`, mlx5_ib `cq.c`
//! `mlx5_poll_one`, rdma-core `mlx5_poll_cq`).
//!
//! The ring: `2^log_nent` CQEs of 64 or 128 bytes, owned by the device until it writes one, then by software until
//! the consumer index published in the doorbell record passes it. A CQE at index `n` is software's when its opcode
//! is not `MLX5_CQE_INVALID` and its owner bit equals bit `log_nent` of `n` (`get_sw_cqe`): the device writes
//! owner 0 on its first pass over the ring, 1 on the second, and so on. Buffers start with every `op_own` at 0xF1
//! (invalid opcode, owner 1), so nothing is software-owned before the device writes.

mod cmd;
pub(crate) mod cqe;
pub(crate) mod ex;
pub(crate) mod ring;
pub(crate) mod wc;

pub use cmd::*;
pub use cqe::*;
pub use ex::*;
pub use ring::*;
pub use wc::*;

//! The objects every benchmark runs on: the test kit's [`Env`] (`mlx5_sim::testkit::Node`: a brought-up simulated
//! HCA with a PD and one registered buffer) and connected RC QP pairs on its loopback.

use mlx5_core::cq::Cq;
use mlx5_core::mkey::Access;
use mlx5_core::qp::{Qp, QpCap};
use mlx5_sim::testkit::RcOpts;
pub use mlx5_sim::testkit::{Node as Env, SimHca};
use mlx5_sim::{Mode, SimConfig};

/// Bytes of the registered buffer.
pub const MEM: usize = 1 << 20;

/// A device in `mode`, brought up, with its PD and buffer.
pub fn new(mode: Mode) -> Env {
    Env::new(SimConfig { mode, ..SimConfig::default() }, MEM)
}

/// A CQ of at least `cqe` entries and two RC QPs on it (remote read and write), connected to each other on the
/// loopback and in RTS.
pub fn pair(env: &mut Env, cap: QpCap, cqe: u32) -> (Cq, Qp, Qp) {
    let o = RcOpts { access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE, ..RcOpts::default() };
    env.rc_pair(cap, cqe, &o)
}

//! What a verbs call can fail with.

use mlx5_core::cq::CqeError;
use mlx5_core::hal::DmaError;
use mlx5_core::hca::Error as HcaError;
use mlx5_core::qp::PostError;
use mlx5_vfio::VfioError;

/// What a verbs call can fail with. Each message is one line naming what failed and why.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// The driver or firmware refused (firmware status name and syndrome included).
    #[error("{0}")]
    Hca(#[from] HcaError),
    #[error("bring-up failed: {0}")]
    Bringup(String),
    #[error("post failed at work request {}: {:?}", .0.index, .0.kind)]
    Post(PostError),
    #[error("{0}")]
    Vfio(#[from] VfioError),
    #[error("out of DMA memory: {0}")]
    Dma(DmaError),
    /// The device wrote a completion entry the driver cannot accept (it is consumed; polling goes on after it).
    #[error("bad completion queue entry: {0}")]
    Cqe(CqeError),
    /// The object was destroyed already (its handle outlived it, as a C caller's may).
    #[error("{what} already destroyed")]
    Destroyed {
        /// Which kind of object.
        what: &'static str,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("destroy failed, object kept: {0}")]
    Destroy(HcaError),
    /// The object is still in use (`EBUSY`): a PD with memory regions or QPs, a CQ with QPs completing on it.
    #[error("{what} is still in use by {users} object(s)")]
    Busy {
        /// What was to be destroyed.
        what: &'static str,
        /// How many objects still refer to it.
        users: usize,
    },
}

impl From<PostError> for VerbsError {
    fn from(e: PostError) -> Self {
        VerbsError::Post(e)
    }
}

/// A verbs call's result.
pub type Result<T> = std::result::Result<T, VerbsError>;

//! What a verbs call can fail with.

use mlx5_core::ah::AhFromWcError;
use mlx5_core::cq::{CqeError, UnsupportedWcFlags};
use mlx5_core::hal::DmaError;
use mlx5_core::hca::{BringupError, Error as HcaError};
use mlx5_core::qp::{PostError, QpExError};
use mlx5_vfio::VfioError;

/// What a verbs call can fail with. Each message is one line naming what failed and why.
#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    /// The driver or firmware refused (firmware status name and syndrome included).
    #[error("{0}")]
    Hca(#[from] HcaError),
    /// The HCA did not come up: the core's error (the step, the cause and the cleanup's outcome) is the source.
    #[error("bring-up failed: {0}")]
    Bringup(#[source] BringupError),
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
    /// The guest NIC a `wire=qemu` device connects to could not be reached (`EINVAL`, as `Invalid`).
    #[error("the guest NIC at {}: {source}", .path.display())]
    GuestNic {
        /// QEMU's socket.
        path: std::path::PathBuf,
        /// Why the connection failed.
        #[source]
        source: std::io::Error,
    },
    /// A `wire=vde` device could not plug into its VDE fabric (`ENODEV`).
    #[cfg(feature = "sim")]
    #[error("the simulated port's VDE fabric: {0}")]
    Fabric(#[source] mlx5_sim::vde::VdeError),
    /// `create_cq_ex` asked for completion fields the core cannot fill (`EINVAL`, as `Invalid`).
    #[error("create_cq_ex: {0}")]
    CqExFlags(#[source] UnsupportedWcFlags),
    /// `create_qp_ex` asked for send operations the QP type cannot do (`EINVAL`, as `Invalid`).
    #[error("create_qp_ex: {0}")]
    QpEx(#[source] QpExError),
    /// `init_ah_from_wc` could not make an address from the completion (`EINVAL`, as `Invalid`).
    #[error("init_ah_from_wc: {0}")]
    AhFromWc(#[source] AhFromWcError),
    /// Process memory that cannot be registered with the access asked (`EFAULT`, or `EINVAL` for a range that
    /// wraps): what the kernel's `ib_umem_get` refuses when it pins the pages.
    #[error("{0}")]
    BadMemory(#[from] BadMemory),
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

/// Why a range of process memory cannot be registered, as the kernel's `ib_umem_get` finds it when it pins the
/// pages with the access asked (every page mapped and readable; writable for local write, remote write or remote
/// atomic access).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{len} bytes at {addr:#x}: {why}")]
pub struct BadMemory {
    /// The range's first byte.
    pub addr: usize,
    /// Its length.
    pub len: usize,
    /// What is wrong with it.
    pub why: BadMemoryKind,
}

/// What is wrong with a range of process memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadMemoryKind {
    /// The range (rounded out to whole pages) wraps around the address space (`EINVAL`, as `ib_umem_get`).
    #[error("the range wraps around the address space")]
    Wraps,
    /// More than 2^32 pages (`EINVAL`, as `ib_umem_get`).
    #[error("the range spans more than 2^32 pages")]
    TooManyPages,
    /// The range reaches past the end of user space (`TASK_SIZE`).
    #[error("the range reaches past the end of user space ({end:#x})")]
    PastUserSpace {
        /// Where user space ends.
        end: usize,
    },
    /// A page of the range is not mapped.
    #[error("page {page:#x} is not mapped")]
    Unmapped {
        /// The page.
        page: usize,
    },
    /// A page of the range is mapped without read permission.
    #[error("page {page:#x} is not readable")]
    NotReadable {
        /// The page.
        page: usize,
    },
    /// A page is mapped read-only and the access asked lets the device write it.
    #[error("page {page:#x} is read-only and the access asked needs write (local write, remote write or atomic)")]
    NotWritable {
        /// The page.
        page: usize,
    },
}

impl From<PostError> for VerbsError {
    fn from(e: PostError) -> Self {
        VerbsError::Post(e)
    }
}

/// A verbs call's result.
pub type Result<T> = std::result::Result<T, VerbsError>;

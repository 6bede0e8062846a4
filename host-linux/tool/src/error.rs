//! What a `mlx5` command can fail with. Each message is one line, the same the tool printed when its errors were
//! strings; an error from a lower layer (verbs, the core, VFIO, I/O) is carried as the source, not formatted
//! into text. The binary prints `mlx5: MESSAGE` and exits 1, except for [`ToolError::Usage`], which is printed
//! with the usage text and exits with [`mlx5_args::USAGE_EXIT`].

use std::io;
use std::path::PathBuf;

use mlx5_core::cmdq::CmdError;
use mlx5_core::cq::CqeError;
use mlx5_core::hal::DmaError;
use mlx5_core::hca::{BringupError, Error as HcaError};
use mlx5_core::qp::PostError;
use mlx5_sim::WireError;
use mlx5_verbs::tracefile::{TraceError, TraceFileError};
use mlx5_verbs::VerbsError;
use mlx5_vfio::VfioError;

use crate::decode::DecodeError;
use crate::exchange::DestError;
use crate::perftest::BenchError;
use crate::tour::TourError;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// An argument the command or the device cannot take (a `--size` above its largest message), found before
    /// anything is allocated or waited for: a usage error.
    #[error("{0}")]
    Usage(String),
    /// What the run itself found wrong (a timeout, a wrong byte, memory left after teardown, a peer gone).
    #[error("{0}")]
    Run(String),
    /// A verbs call failed: what the tool was doing, and the verbs error.
    #[error("{what}: {source}")]
    Verbs {
        what: &'static str,
        #[source]
        source: VerbsError,
    },
    /// A device could not be listed or opened through the verbs API.
    #[error(transparent)]
    Open(#[from] VerbsError),
    /// A call of the ping-pong over the core's traits failed: what it was doing, and the core's error.
    #[error("{what}: {source}")]
    Core {
        what: String,
        #[source]
        source: CoreError,
    },
    /// The HCA did not come up.
    #[error(transparent)]
    Bringup(#[from] BringupError),
    /// The HCA's teardown failed.
    #[error("teardown failed: {0}")]
    Teardown(#[source] HcaError),
    /// The device query of `devinfo` failed.
    #[error("query failed: {0}")]
    Query(#[source] HcaError),
    /// The firmware tour's command queue could not be made.
    #[error("command queue: {0}")]
    CmdQueue(#[source] CmdError),
    /// The firmware tour stopped.
    #[error(transparent)]
    Tour(#[from] TourError),
    /// A benchmark failed.
    #[error(transparent)]
    Bench(#[from] BenchError),
    /// VFIO or sysfs refused (a PCI address, a bind, an open).
    #[error(transparent)]
    Vfio(#[from] VfioError),
    /// The trace file could not be created.
    #[error(transparent)]
    TraceFile(#[from] TraceFileError),
    /// The trace could not be written.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A trace could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The `--pcap` file could not be created.
    #[error("--pcap {}: {source}", .path.display())]
    Pcap {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The simulated wire or the guest NIC could not be plugged in.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The simulated port could not plug into its VDE fabric.
    #[error(transparent)]
    Fabric(#[from] mlx5_sim::vde::VdeError),
    /// A socket of the two-process ping-pong failed, as the OS says it.
    #[error("{what}: {source}")]
    Socket {
        what: String,
        #[source]
        source: io::Error,
    },
    /// Talking to the peer of the two-process ping-pong failed, said in plain words.
    #[error("{what}: {}", peer_why(.source))]
    Peer {
        what: String,
        #[source]
        source: io::Error,
    },
    /// A UD message size larger than one packet (in the one-process UD ping-pong: a run error, as before).
    #[error(transparent)]
    UdSize(#[from] SizeError),
    /// `--client` is not `HOST:PORT` (a run error, as it always was).
    #[error(transparent)]
    Client(#[from] BadClient),
    /// The peer's exchange message was refused.
    #[error(transparent)]
    Dest(#[from] DestError),
    /// Standard output could not be written.
    #[error("failed to write output: {0}")]
    Output(#[source] io::Error),
}

/// A `--client` that is not `HOST:PORT` (or `HOST`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--client: {spec:?} is not HOST:PORT")]
pub struct BadClient {
    /// What was given.
    pub spec: String,
}

/// A `--size` a UD message cannot have: larger than one packet of the port's active MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("--size {size} is larger than the port's active MTU ({mtu} bytes); a UD message is one packet")]
pub struct SizeError {
    /// The size asked for.
    pub size: usize,
    /// The active MTU in bytes.
    pub mtu: usize,
}

/// The core's errors met by the ping-pong over its traits. The post and completion errors implement `Display`
/// but not `Error`, so they are held as they are.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Hca(#[from] HcaError),
    #[error(transparent)]
    Dma(#[from] DmaError),
    #[error("{0}")]
    Post(PostError),
    #[error("{0}")]
    Cqe(CqeError),
}

impl From<PostError> for CoreError {
    fn from(e: PostError) -> Self {
        CoreError::Post(e)
    }
}

impl From<CqeError> for CoreError {
    fn from(e: CqeError) -> Self {
        CoreError::Cqe(e)
    }
}

/// A socket error in plain words rather than errno text.
fn peer_why(e: &io::Error) -> String {
    use io::ErrorKind as K;
    match e.kind() {
        K::WouldBlock | K::TimedOut => "the peer sent nothing within the timeout".into(),
        K::UnexpectedEof => "the peer closed the connection".into(),
        K::ConnectionRefused => "connection refused (nobody listening)".into(),
        K::ConnectionReset | K::BrokenPipe => "the peer closed the connection".into(),
        _ => e.to_string(),
    }
}

/// A command's result.
pub type Result<T> = std::result::Result<T, ToolError>;

//! `mlx5-ibverbs`: a drop-in `libibverbs.so.1` with the ABI of Debian bookworm's rdma-core 44, over
//! `mlx5-verbs`. Unmodified verbs programs (`ibv_devinfo`, `ibv_rc_pingpong`, ...) loaded with
//! `LD_LIBRARY_PATH=target/libibverbs` run on a simulated ConnectX (or a ConnectX bound to vfio-pci), with no
//! kernel RDMA stack. `cargo xtask libibverbs` links the static library with the exact version script.
//!
//! - Devices: `MLX5_RS_DEVICES` (a comma list of `mlx5-verbs` device specs, default `sim`); see
//!   [`mlx5_verbs::DeviceSpec`]. `sim:wire=listen:ADDR:PORT` / `sim:wire=connect:HOST:PORT` join two processes'
//!   simulated ports. `MLX5_RS_LOG=info|debug` logs to stderr; `MLX5_RS_TRACE=FILE` writes the firmware-command
//!   trace as JSON lines. `MLX5_RS_FAULTS=KIND@MS,...` (`device_gone`, `health_failure`, `health_stall`) injects
//!   faults into a simulated device that many milliseconds after its first open.
//! - Every export of the real library exists with its version node ([`SYMBOLS`]); what is not implemented
//!   fails with `EOPNOTSUPP` (NULL + errno, or the positive error), never a NULL function pointer a program calls.
//! - Objects are the C structure followed by the Rust state (`#[repr(C)]`, C part first), so the pointer a
//!   program holds is the object's address. No panic crosses the C boundary: every entry runs under
//!   an internal guard (`catch_unwind`).

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub use mlx5_ibverbs_abi as abi;
mod context;
mod device;
mod faults;
mod objects;
mod post;
mod queue;
#[cfg(test)]
mod reliability_tests;
mod signals;
mod strings;
mod stubs;
#[cfg(test)]
mod tests;
mod uobject;

/// Every default-version export of Debian bookworm's `libibverbs.so.1.14.44.0`, one `name VERSION` a line
/// (from `objdump -T`). `cargo xtask libibverbs` makes the version script from it and checks the linked
/// library's exports against it.
pub const SYMBOLS: &str = include_str!("../symbols.txt");

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = e };
}

/// Whether the program made descriptor `fd` non-blocking (`O_NONBLOCK`, with `fcntl`): a call that waits on
/// it (`ibv_get_cq_event`, `ibv_get_async_event`) then returns -1 with `EAGAIN` when nothing is pending, as
/// libibverbs' read of the descriptor would.
pub(crate) fn is_nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL takes no pointer; a closed descriptor gives -1.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

/// Runs an exported function's body: a panic is caught, logged, and turned into `on_panic` with errno `EIO`,
/// so no unwinding crosses into C. Inlined into each entry point: one frame per call, not two (the datapath
/// entries pay for every instruction).
#[inline(always)]
pub(crate) fn guard<R>(name: &str, on_panic: R, f: impl FnOnce() -> R) -> R {
    log_init();
    guard_datapath(name, on_panic, f)
}

/// [`guard`] for the datapath entries (posts, polls), without the logger's one-time set-up: their objects come
/// only from calls through [`guard`], which set it up, so the check would be paid per call for nothing.
#[inline(always)]
pub(crate) fn guard_datapath<R>(name: &str, on_panic: R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => caught(name, on_panic),
    }
}

/// What a caught panic leaves: a log line, errno `EIO`, the entry point's failure value.
#[cold]
#[inline(never)]
fn caught<R>(name: &str, on_panic: R) -> R {
    // The datapath's guard skips the set-up; a panic is rare enough to make sure here.
    log_init();
    log::error!("{name}: internal error (panic caught)");
    set_errno(libc::EIO);
    on_panic
}

/// A logger to stderr, at the level `MLX5_RS_LOG` names (off unless set): a program's stdout is never
/// touched.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!("libibverbs(mlx5-rs) {}: {}", r.level(), r.args());
        }
    }
    fn flush(&self) {}
}

fn log_init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let level = match std::env::var("MLX5_RS_LOG").as_deref() {
            Ok("error") => log::LevelFilter::Error,
            Ok("warn") => log::LevelFilter::Warn,
            Ok("info") => log::LevelFilter::Info,
            Ok("debug") => log::LevelFilter::Debug,
            Ok("trace") => log::LevelFilter::Trace,
            _ => return,
        };
        if log::set_logger(&StderrLog).is_ok() {
            log::set_max_level(level);
        }
    });
}

/// The errno for a verbs error, as the kernel's uverbs would return it.
pub(crate) fn errno_of(e: &mlx5_verbs::VerbsError) -> c_int {
    use mlx5_verbs::{PostErrorKind, VerbsError as E};
    match e {
        E::Busy { .. } => libc::EBUSY,
        E::Invalid(_) | E::Destroyed { .. } => libc::EINVAL,
        E::CqExFlags(_) | E::QpEx(_) | E::AhFromWc(_) | E::GuestNic { .. } => libc::EINVAL,
        // ib_umem_get: a range that wraps or is too long is EINVAL, a page it cannot pin EFAULT.
        E::BadMemory(m) => match m.why {
            mlx5_verbs::BadMemoryKind::Wraps | mlx5_verbs::BadMemoryKind::TooManyPages => libc::EINVAL,
            _ => libc::EFAULT,
        },
        E::Dma(_) => libc::ENOMEM,
        E::Post(p) => match p.kind {
            // libmlx5's post_send answers ENOMEM for a full queue and for inline data over the QP's maximum.
            PostErrorKind::QueueFull { .. } | PostErrorKind::InlineTooLong { .. } => libc::ENOMEM,
            PostErrorKind::DeviceError => libc::EIO,
            _ => libc::EINVAL,
        },
        E::Hca(h) | E::Destroy(h) => hca_errno(h),
        E::Bringup(_) | E::Vfio(_) | E::Cqe(_) => libc::EIO,
        E::Fabric(_) => libc::ENODEV,
    }
}

/// `mlx5_cmd_status_to_err` for a firmware status, EIO for a dead device, EINVAL for refused arguments.
fn hca_errno(h: &mlx5_core::hca::Error) -> c_int {
    use mlx5_core::cmdq::CmdError;
    use mlx5_core::hca::Error as H;
    match h {
        H::Dma(_) | H::Pages(_) | H::Dbr(_) => libc::ENOMEM,
        H::Health(_) | H::InternalError { .. } => libc::EIO,
        H::NotSupported { .. } => libc::EOPNOTSUPP,
        H::Cmd(CmdError::Status { status, .. }) => status_errno(status.raw()),
        H::Cmd(_) => libc::EIO,
        _ => libc::EINVAL,
    }
}

/// Linux's `mlx5_cmd_status_to_err`.
fn status_errno(status: u8) -> c_int {
    match status {
        0x0 => 0,
        0x2 | 0x3 | 0x5 | 0x9 | 0xa | 0x10 | 0x30 | 0x40 => libc::EINVAL,
        0x6 => libc::EBUSY,
        0x8 => libc::ENOMEM,
        0xf => libc::EAGAIN,
        _ => libc::EIO,
    }
}

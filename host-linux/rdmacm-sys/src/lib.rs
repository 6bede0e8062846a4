//! `mlx5-rdmacm-sys`: a drop-in `librdmacm.so.1` with the ABI of Debian bookworm's rdma-core 44, over the drop-in
//! `libibverbs.so.1`. Unmodified rdma_cm programs (`rping`, `ucmatose`, `udaddy`, perftest's `-R`) connect
//! without a kernel: the IBTA CM of `mlx5-rdmacm` runs in the process, its MADs on the port's GSI QP (QP1, which
//! the drop-in libibverbs creates through its private export `mlx5_rs_create_gsi_qp`).
//!
//! - Addresses: a simulated port has the IPv4 addresses of its simulated host (`SimConfig::next_host`: host N is
//!   192.168.1.(10+N), which `MLX5_RS_DEVICES=sim:host=N` selects); an address names the host whose port has it,
//!   so its GID (RoCE: `::ffff:IP`) or LID (InfiniBand) follows with no neighbour discovery. `127.0.0.1`,
//!   `localhost` and the wildcard name the process's own port (as Linux binds loopback to the first device).
//! - Every export of the real library exists at its version node ([`SYMBOLS`]); what is not provided (rsockets,
//!   multicast, SRQs on an ID, ECE, `rdma_notify`) fails with `ENOSYS` and one log line.
//! - One thread per process runs the CM: it polls the GSI QP's completions, retransmits and times out on a 1 ms
//!   clock, and queues events on the channels; a channel's descriptor is an eventfd counting
//!   the events not yet taken.
//! - No panic crosses the C boundary (`guard`).

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub mod abi;
mod addr;
mod agent;
mod api;

/// Every default-version export of Debian bookworm's `librdmacm.so.1.3.44.0` (`objdump -T`), one `name VERSION`
/// a line; `cargo xtask librdmacm` makes the version script from it and checks the linked library against it.
pub const SYMBOLS: &str = include_str!("../symbols.txt");

/// Sets the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: `__errno_location` returns the calling thread's errno slot, valid for the thread's life.
    unsafe { *libc::__errno_location() = e };
}

/// -1 with `errno` set: rdma_cm's way of failing.
pub(crate) fn fail(e: c_int) -> c_int {
    set_errno(e);
    -1
}

/// Runs an exported function's body: a panic is caught, logged, and turned into `on_panic` with errno `EIO`.
pub(crate) fn guard<R>(name: &str, on_panic: R, f: impl FnOnce() -> R) -> R {
    log_init();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            log::error!("{name}: internal error (panic caught)");
            set_errno(libc::EIO);
            on_panic
        }
    }
}

/// A logger to stderr at the level `MLX5_RS_LOG` names; warnings (what is not provided) are shown by default.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!("librdmacm(mlx5-rs) {}: {}", r.level(), r.args());
        }
    }
    fn flush(&self) {}
}

fn log_init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let level = match std::env::var("MLX5_RS_LOG").as_deref() {
            Ok("error") => log::LevelFilter::Error,
            Ok("info") => log::LevelFilter::Info,
            Ok("debug") => log::LevelFilter::Debug,
            Ok("trace") => log::LevelFilter::Trace,
            _ => log::LevelFilter::Warn,
        };
        // The process may hold another logger (the drop-in libibverbs' own): then ours stays unset.
        if log::set_logger(&StderrLog).is_ok() {
            log::set_max_level(level);
        }
    });
}

#[cfg(test)]
mod tests;

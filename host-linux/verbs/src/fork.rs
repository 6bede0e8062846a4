//! `fork()`: a child has a copy of its parent's memory but none of its threads, so nothing the parent's devices
//! run on (the service thread, a simulated device's firmware and wire threads, a lock one of them held at the
//! fork) exists in it. As rdma-core lets a child list and open devices and get working ones, while objects
//! inherited from the parent are not usable there, each process works on a device list of its own generation: a
//! `pthread_atfork` child handler moves the generation on, the next listing makes a fresh list, and the parent's
//! list and objects are never touched again (not even dropped: a drop would join threads that do not exist).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Forks since the library was first used, as this process counts them (0 in the process that started it).
static GENERATION: AtomicU64 = AtomicU64::new(0);

#[cfg(target_os = "linux")]
extern "C" fn in_child() {
    // Async-signal-safe: one atomic add, nothing else, in the child right after the fork.
    GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// The process's fork generation: it changes in a child once the library was used before the fork. The first
/// call registers the fork handler, so a process that never used the library has nothing to reset.
#[inline]
pub fn generation() -> u64 {
    static REGISTER: Once = Once::new();
    // Every datapath call asks (inlined: after the first call, one load and a compare).
    REGISTER.call_once(|| {
        #[cfg(target_os = "linux")]
        // SAFETY: registers a plain function that only touches an atomic; nothing is captured.
        unsafe {
            if libc::pthread_atfork(None, None, Some(in_child)) != 0 {
                log::warn!("pthread_atfork failed: a forked child cannot open devices");
            }
        }
    });
    GENERATION.load(Ordering::Acquire)
}

/// [`generation`] without registering the fork handler: one load, for the datapath's checks on objects made
/// after a [`generation`] call in this process or its parent (the handler is then registered, and a forked
/// child keeps it).
#[inline(always)]
pub fn generation_now() -> u64 {
    GENERATION.load(Ordering::Acquire)
}

//! A global allocator that counts the heap allocations a thread makes while it has the counter armed: the
//! benchmarks and the no-allocation test install it (`#[global_allocator]`) to prove the datapath allocates
//! nothing. Arming and counting are per thread, so tests running in parallel in one binary never see each other's
//! allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Install with `#[global_allocator] static A: mlx5_sim::testkit::alloc_count::Counting = Counting;`.
#[derive(Debug)]
pub struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    // `try_with`: the allocator may run while this thread's locals are being destroyed; nothing is armed then.
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches no allocation (const
// thread-locals of `Cell`s need no lazy initialisation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract is passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Armed until dropped.
#[derive(Debug)]
pub struct Armed(());

/// Counts this thread's allocations until the guard is dropped.
pub fn arm() -> Armed {
    ARMED.with(|a| a.set(true));
    Armed(())
}

impl Drop for Armed {
    fn drop(&mut self) {
        ARMED.with(|a| a.set(false));
    }
}

/// Allocations this thread made while armed, so far.
pub fn count() -> u64 {
    COUNT.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counting_is_per_thread() {
        // Without the allocator installed nothing is counted; the point here is that another thread's counter
        // starts at zero and stays its own.
        let _armed = arm();
        COUNT.with(|c| c.set(5));
        let other = std::thread::spawn(count).join().unwrap();
        assert_eq!((count(), other), (5, 0));
    }
}

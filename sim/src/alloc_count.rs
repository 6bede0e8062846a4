//! A global allocator that counts the heap allocations a thread makes while it has the counter armed: the
//! benchmarks and the no-allocation test install it (`#[global_allocator]`) to prove the datapath allocates
//! nothing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Install with `#[global_allocator] static A: mlx5_sim::alloc_count::Counting = mlx5_sim::alloc_count::Counting;`.
#[derive(Debug)]
pub struct Counting;

static COUNT: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        COUNT.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; counting touches no allocation.
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

/// Allocations counted so far (by every thread, while armed).
pub fn count() -> u64 {
    COUNT.load(Ordering::Relaxed)
}

//! A spin lock for the rings the datapath takes on every call (a QP's), as rdma-core's mlx5 provider guards its
//! queues with `pthread_spin_lock`: taking it is one locked compare-and-swap, releasing it one plain store. A
//! `std::sync::Mutex` releases with a locked swap (it must see whether a waiter sleeps), which waits for every
//! store before it (the WQE, the doorbell) to drain: the post's largest single cost after its stores.
//!
//! A thread that finds it held spins briefly, then yields to the scheduler between tries: the control path holds
//! a QP's lock across a firmware command, which may take long enough that spinning alone would waste the CPU
//! its holder needs.

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// Tries that only spin before a waiter starts yielding.
const SPINS: u32 = 64;

/// A value behind a spin lock.
pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    v: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard exists at a time (the flag's acquire/release
// pair orders one holder's accesses before the next's), so it moves between threads as with a Mutex.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) const fn new(v: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), v: UnsafeCell::new(v) }
    }

    /// Takes the lock (waiting for it if held).
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_contended();
        }
        SpinGuard { l: self, _t: PhantomData }
    }

    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        let mut tries = 0u32;
        loop {
            // Read-only while held: the line stays shared until the holder's release.
            while self.locked.load(Ordering::Relaxed) {
                if tries < SPINS {
                    std::hint::spin_loop();
                    tries += 1;
                } else {
                    std::thread::yield_now();
                }
            }
            if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return;
            }
        }
    }
}

impl<T> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not taken: a Debug print must not wait for the datapath.
        f.debug_struct("SpinLock").field("locked", &self.locked.load(Ordering::Relaxed)).finish_non_exhaustive()
    }
}

/// The lock held; released when dropped (also while a panic unwinds: no poisoning, as the drop-in ignored it).
pub(crate) struct SpinGuard<'a, T> {
    l: &'a SpinLock<T>,
    /// Shared between threads only when `T` is `Sync` (a guard hands out `&T`), as `MutexGuard`.
    _t: PhantomData<&'a mut T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the one holder (see `Sync` above).
        unsafe { &*self.l.v.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the one holder, and `&mut self` makes this the one borrow through it.
        unsafe { &mut *self.l.v.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.l.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_across_threads() {
        // Two threads each add 1 a hundred thousand times with a non-atomic read-modify-write under the lock:
        // any overlap would lose an update.
        let l = Arc::new(SpinLock::new(0u64));
        let t: Vec<_> = (0..2)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..100_000 {
                        let mut g = l.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for h in t {
            h.join().unwrap();
        }
        assert_eq!(*l.lock(), 200_000);
    }

    #[test]
    fn a_panic_while_held_releases_it() {
        let l = Arc::new(SpinLock::new(1u32));
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            let _g = l2.lock();
            panic!("held");
        })
        .join();
        assert!(r.is_err());
        // Taken again at once: the guard's drop ran while the panic unwound.
        assert_eq!(*l.lock(), 1);
    }
}

//! A spin lock for the rings the datapath takes on every call (a QP's), as rdma-core's mlx5 provider guards its
//! queues with `pthread_spin_lock`: taking it is one locked compare-and-swap, releasing it one plain store. A
//! `std::sync::Mutex` releases with a locked swap (it must see whether a waiter sleeps), which waits for every
//! store before it (the WQE, the doorbell) to drain: the post's largest single cost after its stores.
//!
//! Like rdma-core's `mlx5_spinlock`, a lock can be made for a program that promised one thread at a time
//! (`MLX5_SINGLE_THREADED=1`): it then takes no locked instruction, only an in-use flag (a plain load and store)
//! that catches most overlaps. An overlap it catches is logged and then waited out as for a held lock (rdma-core
//! aborts); one it misses is the program's broken promise, as there.
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
    /// False for a single-threaded program's lock ([`SpinLock::new_single_threaded`]).
    need_lock: bool,
    v: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and one guard exists at a time (the flag's acquire/release
// pair orders one holder's accesses before the next's), so it moves between threads as with a Mutex. A lock
// without `need_lock` is made only by the unsafe `new_single_threaded`, whose caller vouches that no two threads
// take it at once.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) const fn new(v: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), need_lock: true, v: UnsafeCell::new(v) }
    }

    /// A lock taken with no locked instruction, as rdma-core's locks under `MLX5_SINGLE_THREADED=1`.
    ///
    /// # Safety
    /// No two threads take it at the same time (the program's promise).
    pub(crate) const unsafe fn new_single_threaded(v: T) -> Self {
        SpinLock { locked: AtomicBool::new(false), need_lock: false, v: UnsafeCell::new(v) }
    }

    /// Takes the lock (waiting for it if held).
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        self.lock_as::<false>()
    }

    /// [`SpinLock::lock`] for a caller that knows its lock takes a locked instruction (`LOCKED`): then the mode is
    /// not tested (one load and branch fewer). With `LOCKED` false the mode is read, as `lock` does; either way a
    /// lock made to lock always does.
    #[inline]
    pub(crate) fn lock_as<const LOCKED: bool>(&self) -> SpinGuard<'_, T> {
        if LOCKED || self.need_lock {
            if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
                self.lock_contended();
            }
        } else if self.locked.load(Ordering::Relaxed) {
            self.overlap();
        } else {
            // One thread at a time (the maker's promise): nothing to order against another holder.
            self.locked.store(true, Ordering::Relaxed);
        }
        SpinGuard { l: self, _t: PhantomData }
    }

    /// Whether it takes a locked instruction (false: made by `new_single_threaded`).
    #[cfg(test)]
    pub(crate) fn needs_lock(&self) -> bool {
        self.need_lock
    }

    /// Whether a guard holds it now.
    #[cfg(test)]
    pub(crate) fn is_held(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }

    /// A single-threaded lock found held: two threads at once, which the program promised never to do. Said
    /// once, then waited out as for a held lock.
    #[cold]
    #[inline(never)]
    fn overlap(&self) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            log::error!(
                "multithreading violation: MLX5_SINGLE_THREADED=1 is set, but two threads used one queue at once \
                 (unset it for a program that shares queues between threads)"
            )
        });
        self.lock_contended();
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
    fn a_single_threaded_lock_guards_one_thread() {
        // SAFETY: only this thread takes it.
        let l = unsafe { SpinLock::new_single_threaded(0u32) };
        for _ in 0..3 {
            *l.lock() += 1;
        }
        assert_eq!(*l.lock(), 3);
        assert!(!l.locked.load(Ordering::Relaxed), "released when the guard drops");
    }

    #[test]
    fn a_caught_overlap_on_a_single_threaded_lock_waits_for_the_holder() {
        use std::sync::mpsc::channel;
        // SAFETY: the promise is broken on purpose, in the one way the flag catches: the second thread starts
        // only once the first holds the lock, so its load sees the flag set.
        let l = Arc::new(unsafe { SpinLock::new_single_threaded(0u32) });
        let (held_tx, held_rx) = channel();
        let l2 = l.clone();
        let holder = std::thread::spawn(move || {
            let mut g = l2.lock();
            held_tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            *g = 7;
        });
        held_rx.recv().unwrap();
        // Waits until the holder stored 7 and let go.
        let v = *l.lock();
        holder.join().unwrap();
        assert_eq!(v, 7);
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

//! What every object of a context shares, below the context and the objects: the handle a closed context
//! releases ([`Held`]), the kinds in the order a close destroys them ([`Kind`]), the count of async events a
//! destroy waits for ([`AsyncCount`]), and a lock that outlives a panicked holder. The kernel's uverbs keeps the
//! same for each `ib_uobject`.

use std::cell::UnsafeCell;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An object's (or context's) Rust handle, which holds the device. A context closed with the object alive
/// releases it ([`crate::objects::release_leftovers`]) while the C struct around it stays as a shell; dropping
/// the struct then leaves it alone, so it is dropped once either way.
pub(crate) struct Held<T> {
    v: UnsafeCell<ManuallyDrop<T>>,
    released: AtomicBool,
}

// SAFETY: shared access is to `&T` only (`T: Sync`); the one mutation, `release`, runs once, when no other
// access may happen (its caller's promise), and may drop `T` on another thread (`T: Send`).
unsafe impl<T: Send + Sync> Sync for Held<T> {}

impl<T> Held<T> {
    pub(crate) fn new(v: T) -> Self {
        Held { v: UnsafeCell::new(ManuallyDrop::new(v)), released: AtomicBool::new(false) }
    }

    /// Drops the handle now (once).
    ///
    /// # Safety
    /// Nothing borrows the handle now or will read it again: its context is closed, so every entry point refuses
    /// the object before reaching it.
    pub(crate) unsafe fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            // SAFETY: the caller's promise: no other access; `released` makes this happen once.
            unsafe { ManuallyDrop::drop(&mut *self.v.get()) };
        }
    }
}

impl<T> Deref for Held<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: only `release` mutates, when nothing reads any more (its caller's promise).
        unsafe { &*self.v.get() }
    }
}

impl<T> Drop for Held<T> {
    fn drop(&mut self) {
        if !*self.released.get_mut() {
            // SAFETY: not released, so still there; dropped once, here.
            unsafe { ManuallyDrop::drop(self.v.get_mut()) };
        }
    }
}

/// What an object is, in the order a closed context's leftovers are destroyed: Linux's uverbs order, each before
/// what it uses (QPs, SRQs, CQs, MRs, AHs, PDs); thread domains and completion channels last, which have no
/// firmware object (a channel's descriptor stays the program's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Qp,
    Srq,
    Cq,
    Mr,
    Ah,
    ParentDomain,
    Pd,
    Td,
    Channel,
}

/// The async events handed out for one CQ, QP or SRQ and those acknowledged (libibverbs' `events_completed`,
/// mirrored in the C struct). Destroying the object waits until every event handed out is acknowledged, so no
/// event a program holds names a freed object.
#[derive(Debug, Default)]
pub(crate) struct AsyncCount {
    /// (handed out, acknowledged).
    n: Mutex<(u32, u32)>,
    acked: Condvar,
}

impl AsyncCount {
    /// An event naming the object is handed out (under the context's object map lock).
    pub(crate) fn handed_out(&self) {
        let mut n = lock(&self.n);
        n.0 = n.0.wrapping_add(1);
    }

    /// One event is acknowledged; `mirror` gets the acknowledged count while the object cannot go yet (its
    /// destroy may free it as soon as this returns). An acknowledgement with none outstanding is a program
    /// error and counts nothing.
    pub(crate) fn ack(&self, mirror: impl FnOnce(u32)) {
        let mut n = lock(&self.n);
        if n.1 != n.0 {
            n.1 = n.1.wrapping_add(1);
        }
        mirror(n.1);
        drop(n);
        self.acked.notify_all();
    }

    /// Waits until every event handed out is acknowledged, then runs `remove` under the map lock `objs`, so
    /// no event naming the object can be handed out after it.
    pub(crate) fn retire<M>(&self, objs: &Mutex<M>, remove: impl FnOnce(&mut M)) {
        loop {
            let mut m = lock(objs);
            let n = lock(&self.n);
            if n.0 == n.1 {
                remove(&mut m);
                return;
            }
            drop(m);
            // Bounded waits: the map lock is retaken each time.
            drop(self.acked.wait_timeout(n, Duration::from_millis(50)).unwrap_or_else(PoisonError::into_inner));
        }
    }
}

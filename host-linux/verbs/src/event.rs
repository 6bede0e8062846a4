//! Asynchronous events for the user (`ibv_get_async_event` / `ibv_ack_async_event`): each context has a queue
//! that wakes a blocked [`Context::get_async_event`](crate::Context::get_async_event) and, on Linux, makes an
//! `eventfd` readable, so an application can `poll`/`epoll` it with its other descriptors.
//!
//! The events are the core's [`AsyncEvent`] as they are, so an event type the core learns reaches the user
//! without a change here. As the kernel's uverbs does (`ib_uverbs_cq_event_handler`,
//! `ib_uverbs_qp_event_handler`, `ib_uverbs_event_handler`), an event naming a CQ or QP goes to the context that
//! made the object and every other event to every context of the device.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

pub use mlx5_core::hca::AsyncEvent;

use crate::error::{Result, VerbsError};

/// More events than this waiting in one context drop the oldest (and are counted), as the core's own queue does.
const MAX_QUEUED: usize = 1024;

/// Locks a mutex, taking over the state of a thread that panicked while holding it: every state guarded here is
/// consistent between statements, so a panic elsewhere does not make it unusable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<AsyncEvent>,
    /// Events handed out and not acknowledged yet.
    unacked: usize,
    dropped: u64,
}

/// One context's async events.
#[derive(Debug)]
pub(crate) struct EventQueue {
    q: Mutex<Queue>,
    ready: Condvar,
    fd: Option<EventFd>,
}

impl EventQueue {
    pub(crate) fn new() -> Self {
        EventQueue { q: Mutex::new(Queue::default()), ready: Condvar::new(), fd: EventFd::new() }
    }

    /// Queues an event and wakes whoever waits for one (a blocked caller, a `poll` on the descriptor).
    pub(crate) fn push(&self, e: AsyncEvent) {
        let mut q = lock(&self.q);
        if q.events.len() >= MAX_QUEUED {
            q.events.pop_front();
            q.dropped += 1;
        }
        q.events.push_back(e);
        if let Some(fd) = &self.fd {
            fd.signal();
        }
        drop(q);
        self.ready.notify_all();
    }

    /// Takes the oldest event, waiting up to `timeout` for one; `refill` is called before each wait so the caller
    /// can drain the device's event queue into this one.
    pub(crate) fn pop(&self, timeout: Duration, mut refill: impl FnMut()) -> Option<AsyncEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.try_pop() {
                return Some(e);
            }
            refill();
            let q = lock(&self.q);
            if !q.events.is_empty() {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            // Short waits: on a device without interrupts the queue fills only when somebody drains the EQ.
            let step = left.min(Duration::from_millis(1));
            drop(self.ready.wait_timeout(q, step).unwrap_or_else(PoisonError::into_inner));
        }
    }

    fn try_pop(&self) -> Option<AsyncEvent> {
        let mut q = lock(&self.q);
        let e = q.events.pop_front()?;
        q.unacked += 1;
        if q.events.is_empty() {
            if let Some(fd) = &self.fd {
                fd.clear();
            }
        }
        Some(e)
    }

    /// Takes out the queued events that `gone` says name a destroyed object, as the kernel's uverbs drops an
    /// object's queued events at its destroy (`ib_uverbs_release_uevent`): no event taken later names an object
    /// that no longer exists (or a new one that reuses its number). Returns how many went.
    pub(crate) fn purge(&self, gone: impl Fn(&AsyncEvent) -> bool) -> usize {
        let mut q = lock(&self.q);
        let before = q.events.len();
        q.events.retain(|e| !gone(e));
        if q.events.is_empty() {
            if let Some(fd) = &self.fd {
                fd.clear();
            }
        }
        before - q.events.len()
    }

    pub(crate) fn ack(&self) -> Result<()> {
        let mut q = lock(&self.q);
        if q.unacked == 0 {
            return Err(VerbsError::Invalid("no async event to acknowledge".into()));
        }
        q.unacked -= 1;
        Ok(())
    }

    pub(crate) fn unacked(&self) -> usize {
        lock(&self.q).unacked
    }

    pub(crate) fn dropped(&self) -> u64 {
        lock(&self.q).dropped
    }

    pub(crate) fn raw_fd(&self) -> Option<i32> {
        self.fd.as_ref().map(|f| f.0)
    }
}

/// What the control path knows of a completion channel: its id and its descriptor, readable while a completion
/// event waits on it.
#[derive(Debug)]
pub(crate) struct ChannelShared {
    pub(crate) id: u64,
    fd: Option<EventFd>,
}

impl ChannelShared {
    pub(crate) fn new(id: u64) -> Self {
        ChannelShared { id, fd: EventFd::new() }
    }

    pub(crate) fn signal(&self) {
        if let Some(fd) = &self.fd {
            fd.signal();
        }
    }

    pub(crate) fn clear(&self) {
        if let Some(fd) = &self.fd {
            fd.clear();
        }
    }

    pub(crate) fn raw_fd(&self) -> Option<i32> {
        self.fd.as_ref().map(|f| f.0)
    }
}

/// An `eventfd`: readable while the queue holds events. It is made blocking, so the `O_NONBLOCK` flag is the
/// program's alone to set (`fcntl`), as on the kernel's uverbs descriptors; the driver's own reads never block.
#[derive(Debug)]
struct EventFd(i32);

#[cfg(target_os = "linux")]
impl EventFd {
    fn new() -> Option<Self> {
        // SAFETY: eventfd takes no pointers; the returned descriptor is owned by the value made from it.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        (fd >= 0).then_some(EventFd(fd))
    }

    fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to a descriptor this value owns. A full counter
        // (EAGAIN) already reads as readable, so the result is not needed.
        let _ = unsafe { libc::write(self.0, one.as_ptr().cast(), one.len()) };
    }

    fn clear(&self) {
        // Read only a non-zero counter: the descriptor may be blocking. Its owner's lock is held, so nothing
        // else of the driver reads it between the check and the read.
        let mut p = libc::pollfd { fd: self.0, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        if unsafe { libc::poll(&mut p, 1, 0) } != 1 || p.revents & libc::POLLIN == 0 {
            return;
        }
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer from a descriptor this value owns.
        let _ = unsafe { libc::read(self.0, buf.as_mut_ptr().cast(), buf.len()) };
    }
}

#[cfg(not(target_os = "linux"))]
impl EventFd {
    fn new() -> Option<Self> {
        None
    }
    fn signal(&self) {}
    fn clear(&self) {}
}

impl Drop for EventFd {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        // SAFETY: the descriptor is owned by this value and closed once, here.
        unsafe {
            libc::close(self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    fn readable(fd: i32) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n == 1 && p.revents & libc::POLLIN != 0
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn the_descriptor_is_readable_exactly_while_events_wait() {
        let q = EventQueue::new();
        let fd = q.raw_fd().expect("eventfd");
        assert!(!readable(fd));
        q.push(AsyncEvent::DeviceFatal);
        q.push(AsyncEvent::PortActive { port: 1 });
        assert!(readable(fd));
        assert_eq!(q.pop(Duration::ZERO, || {}), Some(AsyncEvent::DeviceFatal));
        assert!(readable(fd), "one event still waits");
        assert_eq!(q.pop(Duration::ZERO, || {}), Some(AsyncEvent::PortActive { port: 1 }));
        assert!(!readable(fd));
        assert_eq!(q.unacked(), 2);
        q.ack().unwrap();
        q.ack().unwrap();
        assert!(q.ack().is_err(), "nothing left to acknowledge");
    }

    #[test]
    fn a_wait_ends_at_its_timeout_or_when_the_refill_brings_an_event() {
        let q = EventQueue::new();
        assert_eq!(q.pop(Duration::from_millis(5), || {}), None);
        let mut calls = 0;
        let got = q.pop(Duration::from_secs(5), || {
            calls += 1;
            if calls == 3 {
                q.push(AsyncEvent::CqError { cqn: 7, syndrome: 1 });
            }
        });
        assert_eq!(got, Some(AsyncEvent::CqError { cqn: 7, syndrome: 1 }));
        assert_eq!(calls, 3);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_purge_takes_out_only_the_events_it_names_and_clears_the_descriptor_when_none_is_left() {
        let q = EventQueue::new();
        let fd = q.raw_fd().expect("eventfd");
        q.push(AsyncEvent::LastWqeReached { qpn: 5 });
        q.push(AsyncEvent::CommEst { qpn: 6 });
        q.push(AsyncEvent::QpError { qpn: 5, kind: mlx5_core::eq::QpErrorKind::AccessError });
        let gone =
            |e: &AsyncEvent| matches!(e, AsyncEvent::LastWqeReached { qpn: 5 } | AsyncEvent::QpError { qpn: 5, .. });
        assert_eq!(q.purge(gone), 2);
        assert!(readable(fd), "the event of QP 6 still waits");
        assert_eq!(q.pop(Duration::ZERO, || {}), Some(AsyncEvent::CommEst { qpn: 6 }));
        q.push(AsyncEvent::SqDrained { qpn: 5 });
        assert_eq!(q.purge(|e| matches!(e, AsyncEvent::SqDrained { qpn: 5 })), 1);
        assert!(!readable(fd), "nothing waits");
        assert_eq!(q.pop(Duration::ZERO, || {}), None);
        assert_eq!(q.unacked(), 1, "a purged event was never handed out");
    }

    #[test]
    fn a_full_queue_drops_the_oldest_and_counts_it() {
        let q = EventQueue::new();
        for cqn in 0..(MAX_QUEUED as u32 + 2) {
            q.push(AsyncEvent::CqError { cqn, syndrome: 1 });
        }
        assert_eq!(q.dropped(), 2);
        assert_eq!(q.pop(Duration::ZERO, || {}), Some(AsyncEvent::CqError { cqn: 2, syndrome: 1 }));
    }
}

//! Signals and the library's waits. libibverbs' `ibv_get_cq_event` and `ibv_get_async_event` are a `read()` of a
//! uverbs descriptor: a signal whose handler lacks `SA_RESTART` ends them with `EINTR`, and programs rely on it
//! (qperf ends every test with `SIGALRM` while blocked there). This library has no kernel descriptor to block
//! on, so its waits look for an event, then sleep one short step in a `read()` of a timer descriptor, which the
//! kernel interrupts or restarts exactly as it does the uverbs `read()`. A signal that arrives while a look runs
//! is held (all signals blocked for the look) and found with `sigpending`, so none slips between look and sleep.
//! The library's own threads are made with every signal blocked ([`quiet`]), so a program's signal reaches a
//! program thread, as it does when the library has no threads.

use std::cell::RefCell;
use std::ffi::c_int;
use std::time::Duration;

/// Runs `f` on a thread of its own that blocks every signal, so the threads `f` starts (a device's service and
/// wire threads) inherit that mask and keep it. The calling thread waits with its own mask, so a program's
/// signal is handled at once even while `f` waits (a wire connecting for up to its `connect_timeout`). `None`
/// when no thread could be started.
pub(crate) fn quiet<R: Send>(f: impl FnOnce() -> R + Send) -> Option<R> {
    std::thread::scope(|s| {
        let old = block_all();
        let t = std::thread::Builder::new().name("mlx5-rs-open".into()).spawn_scoped(s, f);
        restore(&old);
        match t.ok()?.join() {
            Ok(r) => Some(r),
            // The caller's guard turns the panic into its error return.
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

/// Looks with `look` until it finds something, sleeping `step` between looks. `Err(EINTR)` when a handler
/// without `SA_RESTART` ran meanwhile (the program's signal interrupted the wait).
pub(crate) fn wait_for<T>(step: Duration, mut look: impl FnMut() -> Option<T>) -> Result<T, c_int> {
    loop {
        let old = block_all();
        let found = look();
        let arrived = pending_unblocked(&old);
        // Delivers what arrived during the look: its handlers run here.
        restore(&old);
        if let Some(v) = found {
            return Ok(v);
        }
        if arrived.iter().any(|&s| interrupts(s)) {
            return Err(libc::EINTR);
        }
        sleep(step)?;
    }
}

fn block_all() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; both sets are initialized by sigfillset/pthread_sigmask before use.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    }
}

fn restore(old: &libc::sigset_t) {
    // SAFETY: `old` is the mask pthread_sigmask returned.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
}

/// The signals pending for this thread or the process that the mask `old` does not block.
fn pending_unblocked(old: &libc::sigset_t) -> Vec<c_int> {
    // SAFETY: sigset_t is plain data, filled by sigpending before it is read.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: one writable set.
    if unsafe { libc::sigpending(&mut set) } != 0 {
        return Vec::new();
    }
    (1..=libc::SIGRTMAX())
        .filter(|&s| {
            // SAFETY: sigismember reads initialized sets.
            unsafe { libc::sigismember(&set, s) == 1 && libc::sigismember(old, s) != 1 }
        })
        .collect()
}

/// Whether delivering `sig` ends a blocking `read()` with `EINTR`: a handler is installed without `SA_RESTART`.
/// A default or ignored disposition ends nothing (or the process).
fn interrupts(sig: c_int) -> bool {
    // SAFETY: sigaction is plain data; a null new action only reads the current one.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::sigaction(sig, std::ptr::null(), &mut act) } != 0 {
        return false;
    }
    act.sa_sigaction != libc::SIG_DFL && act.sa_sigaction != libc::SIG_IGN && act.sa_flags & libc::SA_RESTART == 0
}

/// A thread's timer descriptor, remade in a forked child (the parent's would be shared with it).
struct Timer {
    pid: libc::pid_t,
    fd: c_int,
}

impl Drop for Timer {
    fn drop(&mut self) {
        // SAFETY: the descriptor is this value's; in a forked child closing it leaves the parent's open.
        unsafe { libc::close(self.fd) };
    }
}

thread_local! {
    static TIMER: RefCell<Option<Timer>> = const { RefCell::new(None) };
}

/// Sleeps `step` in a `read()` of a timer descriptor: `Err(EINTR)` when a handler without `SA_RESTART` ran.
/// Without a descriptor (the program is at its descriptor limit) the sleep cannot be interrupted.
fn sleep(step: Duration) -> Result<(), c_int> {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let fd = TIMER.with(|t| {
        let mut t = t.borrow_mut();
        if t.as_ref().is_none_or(|t| t.pid != pid) {
            // SAFETY: no pointers; the descriptor is owned by the Timer made from it.
            let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
            *t = (fd >= 0).then_some(Timer { pid, fd });
        }
        t.as_ref().map(|t| t.fd)
    });
    let Some(fd) = fd else {
        std::thread::sleep(step);
        return Ok(());
    };
    let spec = libc::itimerspec {
        it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
        it_value: libc::timespec {
            tv_sec: step.as_secs() as libc::time_t,
            // At least 1 ns: a zero value would disarm the timer and the read would never end.
            tv_nsec: libc::c_long::from(step.subsec_nanos().max(u32::from(step.as_secs() == 0))),
        },
    };
    // SAFETY: a valid itimerspec; no old value asked for.
    if unsafe { libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut()) } != 0 {
        std::thread::sleep(step);
        return Ok(());
    }
    let mut buf = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live local buffer.
    if unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) } < 0 {
        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        if e == libc::EINTR {
            return Err(libc::EINTR);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    static RAN: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_usr(_: c_int) {
        RAN.store(true, Ordering::SeqCst);
    }

    extern "C" fn on_urg(_: c_int) {}

    fn install(sig: c_int, restart: bool) {
        let handler = if sig == libc::SIGURG { on_urg as extern "C" fn(c_int) } else { on_usr };
        // SAFETY: a plain handler that at most stores an atomic; sigaction is plain data.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = handler as usize;
            act.sa_flags = if restart { libc::SA_RESTART } else { 0 };
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }

    /// A signal raised while a look runs (qperf's SIGALRM landing outside the sleep) ends the wait with EINTR
    /// once its handler has run; with SA_RESTART the wait goes on until the look finds something.
    #[test]
    fn a_signal_during_a_look_interrupts_unless_sa_restart() {
        install(libc::SIGUSR1, false);
        let mut looks = 0;
        let r = wait_for(Duration::from_micros(50), || {
            looks += 1;
            // SAFETY: raise sends a signal to this thread; the handler is installed above.
            unsafe { libc::raise(libc::SIGUSR1) };
            None::<()>
        });
        assert_eq!((r, looks, RAN.swap(false, Ordering::SeqCst)), (Err(libc::EINTR), 1, true));

        install(libc::SIGUSR2, true);
        let mut looks = 0;
        let r = wait_for(Duration::from_micros(50), || {
            looks += 1;
            // SAFETY: as above.
            unsafe { libc::raise(libc::SIGUSR2) };
            (looks == 3).then_some(7)
        });
        assert_eq!((r, looks, RAN.swap(false, Ordering::SeqCst)), (Ok(7), 3, true));
    }

    /// A signal that arrives during the sleep ends the wait with EINTR: another thread sends it to this one
    /// only once this one is waiting (its first look done), whose handler has no SA_RESTART.
    #[test]
    fn a_signal_during_the_sleep_interrupts() {
        install(libc::SIGURG, false);
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() } as usize;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let sender = std::thread::spawn(move || {
            rx.recv().unwrap();
            // The waiter sleeps in steps of 10 s: the signal lands in the read of its timer, not in a look.
            std::thread::sleep(Duration::from_millis(50));
            // SAFETY: the waiting thread lives until the wait returns, which needs this signal.
            unsafe { libc::pthread_kill(me as libc::pthread_t, libc::SIGURG) };
        });
        let mut looks = 0;
        let r = wait_for(Duration::from_secs(10), || {
            looks += 1;
            if looks == 1 {
                tx.send(()).unwrap();
            }
            None::<()>
        });
        sender.join().unwrap();
        assert_eq!((r, looks), (Err(libc::EINTR), 1));
    }

    /// Threads that `quiet`'s work starts block every signal, so a program's signal goes to its own threads; the
    /// caller's mask is as it was.
    #[test]
    fn threads_started_by_quiet_work_block_every_signal() {
        let t = quiet(|| {
            std::thread::spawn(|| {
                // SAFETY: sigset_t is plain data, filled by pthread_sigmask.
                let mut cur: libc::sigset_t = unsafe { std::mem::zeroed() };
                // SAFETY: a null new set only reads the mask.
                unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur) };
                // SAFETY: reads an initialized set.
                unsafe { libc::sigismember(&cur, libc::SIGALRM) == 1 && libc::sigismember(&cur, libc::SIGINT) == 1 }
            })
        })
        .unwrap();
        assert!(t.join().unwrap());
        // SAFETY: as above, for the calling thread.
        let mut cur: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur) };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::sigismember(&cur, libc::SIGALRM) }, 0);
    }
}

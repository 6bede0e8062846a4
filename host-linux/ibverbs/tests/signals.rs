//! Issue 29 (qperf): libibverbs' blocking `ibv_get_cq_event` and `ibv_get_async_event` are a `read()` that a
//! signal handler without `SA_RESTART` ends with `EINTR`; qperf stops every test with `SIGALRM` while blocked
//! there and hung on this library, which kept waiting. And the library's own threads must not take a program's
//! signals: a process signal that runs its handler on a library thread interrupts nothing of the program's.

use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use mlx5_ibverbs::abi::*;

mod common;
use common::*;

static HANDLED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(_: c_int) {
    HANDLED.fetch_add(1, Ordering::SeqCst);
}

/// Installs a handler for `sig` without `SA_RESTART`, as qperf installs its `SIGALRM` handler.
fn install(sig: c_int) {
    // SAFETY: the handler only counts; sigaction is plain data.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_signal as extern "C" fn(c_int) as usize;
        act.sa_flags = 0;
        assert_eq!(libc::sigaction(sig, &act, std::ptr::null_mut()), 0);
    }
}

/// Opens the first device (the default simulated one).
fn open() -> usize {
    // SAFETY: a device of the library's list.
    let ctx = unsafe { ibv_open_device(first_device()) };
    assert!(!ctx.is_null());
    ctx as usize
}

/// Runs `wait` on a thread of its own and sends that thread `sig` every 10 ms until `wait` returns; its result
/// and errno, or `None` when it has not returned after 1,000 signals (the defect: the test fails, not hangs).
fn signalled(sig: c_int, wait: impl FnOnce() -> c_int + Send + 'static) -> Option<(c_int, c_int)> {
    let (tid_tx, tid_rx) = mpsc::channel();
    let (res_tx, res_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        // SAFETY: pthread_self has no preconditions.
        tid_tx.send(unsafe { libc::pthread_self() } as usize).unwrap();
        let r = wait();
        // SAFETY: the calling thread's errno slot.
        let e = unsafe { *libc::__errno_location() };
        let _ = res_tx.send((r, e));
        // Lives until no more signals are sent to it.
        let _ = done_rx.recv();
    });
    let tid = tid_rx.recv().unwrap();
    let mut got = None;
    for _ in 0..1000 {
        // SAFETY: the thread lives until `done_tx` goes, after the last signal.
        unsafe { libc::pthread_kill(tid as libc::pthread_t, sig) };
        if let Ok(r) = res_rx.recv_timeout(Duration::from_millis(10)) {
            got = Some(r);
            break;
        }
    }
    // On failure the waiter stays blocked: leaving it keeps the test from hanging.
    if got.is_some() {
        drop(done_tx);
    } else {
        std::mem::forget(done_tx);
    }
    got
}

#[test]
fn a_blocking_get_cq_event_ends_with_eintr_when_a_signal_handler_runs() {
    install(libc::SIGUSR1);
    let ctx = open();
    // SAFETY: a channel of the open context.
    let ch = unsafe { ibv_create_comp_channel(ctx as *mut ibv_context) } as usize;
    assert_ne!(ch, 0);
    let before = HANDLED.load(Ordering::SeqCst);
    let got = signalled(libc::SIGUSR1, move || {
        let (mut cq, mut cq_ctx) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live channel (no CQ on it: nothing ever arrives), writable out pointers.
        unsafe { ibv_get_cq_event(ch as *mut ibv_comp_channel, &mut cq, &mut cq_ctx) }
    });
    assert_eq!(got, Some((-1, libc::EINTR)), "ibv_get_cq_event must end as libibverbs' read() does");
    assert!(HANDLED.load(Ordering::SeqCst) > before, "the program's handler ran");
    // SAFETY: made above, destroyed once.
    unsafe {
        assert_eq!(ibv_destroy_comp_channel(ch as *mut ibv_comp_channel), 0);
        assert_eq!(ibv_close_device(ctx as *mut ibv_context), 0);
    }
}

#[test]
fn a_blocking_get_async_event_ends_with_eintr_when_a_signal_handler_runs() {
    install(libc::SIGUSR2);
    let ctx = open();
    let got = signalled(libc::SIGUSR2, move || {
        // SAFETY: ibv_async_event is plain data.
        let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
        // SAFETY: an open context with no events pending; a writable event.
        unsafe { ibv_get_async_event(ctx as *mut ibv_context, &mut ev) }
    });
    assert_eq!(got, Some((-1, libc::EINTR)), "ibv_get_async_event must end as libibverbs' read() does");
    // SAFETY: opened above.
    assert_eq!(unsafe { ibv_close_device(ctx as *mut ibv_context) }, 0);
}

/// The signals blocked by thread `tid` of this process (`SigBlk` of its status), and its name.
fn thread(tid: &str) -> Option<(String, u64)> {
    let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    let blk = status.lines().find_map(|l| l.strip_prefix("SigBlk:"))?;
    Some((comm.trim().to_string(), u64::from_str_radix(blk.trim(), 16).ok()?))
}

#[test]
fn the_librarys_threads_block_every_signal() {
    let ctx = open();
    let ours: Vec<(String, u64)> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter_map(|e| thread(&e.file_name().to_string_lossy()))
        .filter(|(name, _)| name.starts_with("mlx5-"))
        .collect();
    assert!(!ours.is_empty(), "the open device runs threads (its service thread at least)");
    // Bit n-1 stands for signal n: SIGALRM (qperf's timer) and SIGINT among them.
    let alrm_int = (1u64 << (libc::SIGALRM - 1)) | (1u64 << (libc::SIGINT - 1));
    for (name, blk) in &ours {
        assert_eq!(blk & alrm_int, alrm_int, "thread {name} blocks SIGALRM and SIGINT (SigBlk {blk:x})");
    }
    // SAFETY: opened above.
    assert_eq!(unsafe { ibv_close_device(ctx as *mut ibv_context) }, 0);
}

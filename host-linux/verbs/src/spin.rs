//! A spin lock for the rings the datapath takes on every call (a QP's, a CQ's), as rdma-core's mlx5 provider
//! guards its queues with `pthread_spin_lock`, but biased to the thread that uses the queue.
//!
//! Most programs post and poll a queue from one thread. The first thread to take a lock on the datapath becomes
//! its owner: from then on it takes and releases it with plain loads and stores (an in-use flag), no locked
//! instruction, which on this machine's CPUs costs about as much as a one-WR post's stores. Any other thread
//! takes the lock word with a compare-and-swap and then shuts the owner out: it raises `blocked`, makes every
//! thread of the process pass a full memory barrier (`membarrier(2)`, the heavy side of an asymmetric Dekker
//! pair whose light side is the owner's compiler fence), and waits for the owner's flag to clear. After a few
//! such visits the bias is revoked for good and the lock is a plain spin lock for everyone. Without
//! `membarrier` the lock is a plain spin lock from the start. The control path (`lock`) never takes the bias,
//! so a program that makes a QP in one thread and posts from another biases it to the poster.
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
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicU32, AtomicUsize, Ordering};

/// Tries that only spin before a waiter starts yielding.
const SPINS: u32 = 64;
/// `owner` of a lock no thread has taken on the datapath yet.
const UNOWNED: usize = 0;
/// `owner` of a lock that is a plain spin lock for good.
const REVOKED: usize = usize::MAX;
/// What [`thread_id`] answers where no bias is taken: never an owner.
#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
const NO_THREAD: usize = 1;
/// Visits by other threads an owner's bias outlives; the next one revokes it (each visit costs a `membarrier`).
const VISITS: u32 = 4;

/// A value behind a spin lock.
pub(crate) struct SpinLock<T> {
    /// The lock word: taken with a compare-and-swap by every holder but the owner (or, made single-threaded, the
    /// in-use flag).
    locked: AtomicBool,
    /// False for a single-threaded program's lock ([`SpinLock::new_single_threaded`]).
    need_lock: bool,
    /// The thread the lock is biased to (its thread pointer), [`UNOWNED`] or [`REVOKED`]. Changed only by a
    /// holder of the word.
    owner: AtomicUsize,
    /// Set while the owner holds the lock through its bias.
    in_use: AtomicBool,
    /// Raised by another thread that holds the word and has shut the owner out; left raised once revoked.
    blocked: AtomicBool,
    /// Visits by other threads so far (changed only by a holder of the word).
    visits: AtomicU32,
    /// Visits the bias outlives ([`VISITS`]; more in a test that hammers the owner's barrier).
    max_visits: u32,
    v: UnsafeCell<T>,
}

// A guard's tag fits below the lock's alignment.
const _: () = assert!(std::mem::align_of::<SpinLock<()>>() > HELD_BITS);

// SAFETY: the value is reached only through a guard, and one guard exists at a time: holders of the word exclude
// each other (its acquire/release pair orders one holder's accesses before the next's); the owner's flag and a
// visitor's `blocked` exclude each other as a Dekker pair, the visitor's `membarrier` ordering the owner's store
// before its load on the hardware (see `lock_slow`), and the flag's release/acquire orders the owner's accesses
// before a visitor's. A lock without `need_lock` is made only by the unsafe `new_single_threaded`, whose caller
// vouches that no two threads take it at once.
unsafe impl<T: Send> Sync for SpinLock<T> {}

/// How a guard holds its lock, which says how it lets go: the low two bits of the guard's lock address (one
/// word for the guard, as a plain lock's guard: a post keeps it live across its whole loop).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(usize)]
enum Held {
    /// The owner, through its bias: its flag.
    Owner = 0,
    /// The word (also a single-threaded lock's flag).
    Word = 1,
    /// The word, with the owner shut out: `blocked`, then the word.
    Visit = 2,
}

/// The tag bits of a guard's lock address ([`Held`]); the lock is aligned to its `AtomicUsize`.
const HELD_BITS: usize = 3;

impl<T> SpinLock<T> {
    pub(crate) const fn new(v: T) -> Self {
        Self::with_owner(v, true, UNOWNED)
    }

    /// A lock taken with no locked instruction, as rdma-core's locks under `MLX5_SINGLE_THREADED=1`.
    ///
    /// # Safety
    /// No two threads take it at the same time (the program's promise).
    pub(crate) const unsafe fn new_single_threaded(v: T) -> Self {
        Self::with_owner(v, false, REVOKED)
    }

    /// A lock that never takes a bias: a plain spin lock, as every lock is where `membarrier` is missing.
    #[cfg(test)]
    pub(crate) const fn new_unbiased(v: T) -> Self {
        Self::with_owner(v, true, REVOKED)
    }

    const fn with_owner(v: T, need_lock: bool, owner: usize) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            need_lock,
            owner: AtomicUsize::new(owner),
            in_use: AtomicBool::new(false),
            blocked: AtomicBool::new(false),
            visits: AtomicU32::new(0),
            max_visits: VISITS,
            v: UnsafeCell::new(v),
        }
    }

    /// Takes the lock for the control path (waiting for it if held): the owner's bias is used, never taken.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        self.acquire::<false, false>()
    }

    /// Takes the lock for the datapath: the first thread to do so becomes its owner. `LOCKED`: the caller knows
    /// its lock is not single-threaded, so the mode is not tested (one load and branch fewer); with `LOCKED`
    /// false it is read. Either way a lock made to lock always does.
    #[inline]
    pub(crate) fn lock_as<const LOCKED: bool>(&self) -> SpinGuard<'_, T> {
        self.acquire::<true, LOCKED>()
    }

    #[inline(always)]
    fn acquire<const CLAIM: bool, const LOCKED: bool>(&self) -> SpinGuard<'_, T> {
        if LOCKED || self.need_lock {
            let me = thread_id();
            if self.owner.load(Ordering::Relaxed) == me && !self.in_use.load(Ordering::Relaxed) {
                self.in_use.store(true, Ordering::Relaxed);
                // The light side of the Dekker pair: only the compiler is kept from moving the load above the
                // store; a visitor's membarrier does the hardware's part.
                compiler_fence(Ordering::SeqCst);
                if !self.blocked.load(Ordering::Acquire) {
                    return SpinGuard::new(self, Held::Owner);
                }
                // A visitor holds it (or the bias is revoked): wait for the word as any other thread.
                self.in_use.store(false, Ordering::Release);
            }
            let how = self.lock_slow(me, CLAIM);
            return SpinGuard::new(self, how);
        }
        if self.locked.load(Ordering::Relaxed) {
            self.overlap();
        } else {
            // One thread at a time (the maker's promise): nothing to order against another holder.
            self.locked.store(true, Ordering::Relaxed);
        }
        SpinGuard::new(self, Held::Word)
    }

    /// Takes the lock for the datapath of a caller that expects it single-threaded (its context was set so): a
    /// lock made so ([`SpinLock::new_single_threaded`]) is taken with its flag, as [`SpinLock::lock_as`] does; one
    /// that locks is taken out of line with its word alone. Either way its guard lets go with one store, so no
    /// mode is kept to test.
    #[inline(always)]
    pub(crate) fn lock_single(&self) -> SingleGuard<'_, T> {
        if self.need_lock {
            self.lock_word_only();
        } else if self.locked.load(Ordering::Relaxed) {
            self.overlap();
        } else {
            // One thread at a time (the maker's promise): nothing to order against another holder.
            self.locked.store(true, Ordering::Relaxed);
        }
        SingleGuard(self)
    }

    /// [`SpinLock::lock_single`] on a lock that locks: the word, held so that letting go of it alone releases the
    /// lock. Another thread's bias is revoked for good (its owner shut out as by a visit, `blocked` left raised);
    /// this thread's own bias, or none, needs only the word.
    #[cold]
    #[inline(never)]
    fn lock_word_only(&self) {
        self.take_word();
        // Read under the word, which every change of `owner` is made under: current.
        let owner = self.owner.load(Ordering::Relaxed);
        if owner == REVOKED || owner == UNOWNED {
            return;
        }
        let revoke = owner != thread_id();
        self.end_bias_hold(revoke);
        if revoke {
            self.owner.store(REVOKED, Ordering::Relaxed);
        }
    }

    /// With the word held: shuts another thread's bias out (`shut_out`), then waits until the owner's hold
    /// through its bias, if any, ends (for the owner itself: a hold the word cannot see, as from a signal handler
    /// that interrupted it, is waited for as a spin lock would).
    fn end_bias_hold(&self, shut_out: bool) {
        if shut_out {
            // The heavy side of the Dekker pair: after the barrier either the owner's flag is seen here, or every
            // owner's later load of `blocked` sees it raised.
            self.blocked.store(true, Ordering::Relaxed);
            barrier::heavy();
        }
        let mut tries = 0u32;
        while self.in_use.load(Ordering::Acquire) {
            backoff(&mut tries);
        }
    }

    /// Whether it takes a locked instruction (false: made by `new_single_threaded`).
    #[cfg(test)]
    pub(crate) fn needs_lock(&self) -> bool {
        self.need_lock
    }

    /// Whether a guard holds it now.
    #[cfg(test)]
    pub(crate) fn is_held(&self) -> bool {
        self.locked.load(Ordering::Relaxed) || self.in_use.load(Ordering::Relaxed)
    }

    /// Whether the calling thread owns it (takes it with no locked instruction).
    #[cfg(test)]
    pub(crate) fn owned_here(&self) -> bool {
        self.owner.load(Ordering::Relaxed) == thread_id()
    }

    /// Whether its bias is revoked for good.
    #[cfg(test)]
    pub(crate) fn revoked(&self) -> bool {
        self.owner.load(Ordering::Relaxed) == REVOKED
    }

    /// Any thread but the owner (or the owner while shut out): the word, then the owner's bias taken, kept, shut
    /// out for this visit, or revoked.
    #[cold]
    #[inline(never)]
    fn lock_slow(&self, me: usize, claim: bool) -> Held {
        self.take_word();
        // Read under the word, which every change of `owner` is made under: current.
        let owner = self.owner.load(Ordering::Relaxed);
        if owner == REVOKED {
            return Held::Word;
        }
        if owner == UNOWNED {
            if claim && barrier::ready() {
                self.owner.store(me, Ordering::Relaxed);
            }
            return Held::Word;
        }
        let visit = owner != me;
        self.end_bias_hold(visit);
        if !visit {
            return Held::Word;
        }
        let v = self.visits.load(Ordering::Relaxed) + 1;
        self.visits.store(v, Ordering::Relaxed);
        if v > self.max_visits {
            // Shared by several threads: a plain spin lock from now on. `blocked` stays raised, so an owner that
            // read its bias before this store still backs off.
            self.owner.store(REVOKED, Ordering::Relaxed);
            return Held::Word;
        }
        Held::Visit
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
        self.take_word();
    }

    /// Takes the word, spinning and then yielding while it is held.
    fn take_word(&self) {
        let mut tries = 0u32;
        loop {
            if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return;
            }
            // Read-only while held: the line stays shared until the holder's release.
            while self.locked.load(Ordering::Relaxed) {
                backoff(&mut tries);
            }
        }
    }
}

/// Whether locks take a bias in this process (`membarrier(2)` works).
#[cfg(test)]
pub(crate) fn bias_available() -> bool {
    barrier::ready()
}

/// One wait of a spinning thread: a spin hint for the first tries, then a yield to the scheduler.
fn backoff(tries: &mut u32) {
    if *tries < SPINS {
        std::hint::spin_loop();
        *tries += 1;
    } else {
        std::thread::yield_now();
    }
}

/// The calling thread's thread pointer: unique among live threads, read with one instruction (the x86-64 TLS ABI
/// keeps the thread control block's address in its first word; aarch64 keeps it in `TPIDR_EL0`).
#[inline(always)]
fn thread_id() -> usize {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        let p: usize;
        // SAFETY: reads the word at %fs:0, which the ABI makes the thread control block's own address in every
        // thread; no other state is touched.
        unsafe {
            std::arch::asm!("mov {}, qword ptr fs:[0]", out(reg) p, options(nostack, readonly, preserves_flags, pure))
        };
        p
    }
    #[cfg(all(target_os = "linux", target_arch = "aarch64"))]
    {
        let p: usize;
        // SAFETY: reads the thread pointer register; no memory or other state is touched.
        unsafe { std::arch::asm!("mrs {}, tpidr_el0", out(reg) p, options(nomem, nostack, preserves_flags, pure)) };
        p
    }
    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    {
        // No bias is ever taken here (`barrier::ready` is false), so `owner` is never a thread.
        NO_THREAD
    }
}

/// The heavy side of the owner's barrier: `membarrier(2)`, registered once per process.
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod barrier {
    use std::ffi::{c_int, c_long};
    use std::sync::OnceLock;

    // The commands of <linux/membarrier.h>.
    const CMD_QUERY: c_int = 0;
    const CMD_GLOBAL: c_int = 1;
    const CMD_PRIVATE_EXPEDITED: c_int = 1 << 3;
    const CMD_REGISTER_PRIVATE_EXPEDITED: c_int = 1 << 4;

    fn membarrier(cmd: c_int) -> c_long {
        // SAFETY: membarrier takes no pointers; an unknown command or a kernel without it answers -1.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as std::ffi::c_uint, 0 as c_int) }
    }

    /// Whether biased locks may be made: the kernel has the expedited private barrier and this process is
    /// registered for it (once).
    pub(super) fn ready() -> bool {
        static READY: OnceLock<bool> = OnceLock::new();
        *READY.get_or_init(|| {
            let cmds = membarrier(CMD_QUERY);
            let ok = cmds > 0
                && cmds & c_long::from(CMD_PRIVATE_EXPEDITED) != 0
                && membarrier(CMD_REGISTER_PRIVATE_EXPEDITED) == 0;
            if !ok {
                log::debug!("membarrier(2) without the expedited private barrier: queue locks are plain spin locks");
            }
            ok
        })
    }

    /// Every running thread of the process passes a full memory barrier before this returns.
    pub(super) fn heavy() {
        if membarrier(CMD_PRIVATE_EXPEDITED) == 0 {
            return;
        }
        // A child of fork(2) starts unregistered.
        if membarrier(CMD_REGISTER_PRIVATE_EXPEDITED) == 0 && membarrier(CMD_PRIVATE_EXPEDITED) == 0 {
            return;
        }
        if membarrier(CMD_GLOBAL) == 0 {
            return;
        }
        // It worked when the bias was taken: without it the owner cannot be kept out, and going on could corrupt
        // a queue.
        log::error!(
            "membarrier(2) failed ({}): a biased queue lock cannot be taken safely",
            std::io::Error::last_os_error()
        );
        std::process::abort();
    }
}

#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
mod barrier {
    pub(super) fn ready() -> bool {
        false
    }
    pub(super) fn heavy() {
        unreachable!("no lock is biased without membarrier")
    }
}

impl<T> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not taken: a Debug print must not wait for the datapath.
        f.debug_struct("SpinLock")
            .field("locked", &self.locked.load(Ordering::Relaxed))
            .field("biased", &!matches!(self.owner.load(Ordering::Relaxed), UNOWNED | REVOKED))
            .finish_non_exhaustive()
    }
}

/// The lock held; released when dropped (also while a panic unwinds: no poisoning, as the drop-in ignored it).
pub(crate) struct SpinGuard<'a, T> {
    /// The lock, its address tagged with how it is held ([`Held`]).
    l: *const SpinLock<T>,
    /// Borrows the lock for `'a`, and is shared between threads only when `T` is `Sync` (a guard hands out `&T`),
    /// as `MutexGuard`.
    _t: PhantomData<(&'a SpinLock<T>, &'a mut T)>,
}

impl<'a, T> SpinGuard<'a, T> {
    #[inline(always)]
    fn new(l: &'a SpinLock<T>, how: Held) -> Self {
        let p: *const SpinLock<T> = l;
        SpinGuard { l: p.map_addr(|a| a | how as usize), _t: PhantomData }
    }

    #[inline(always)]
    fn lock(&self) -> &'a SpinLock<T> {
        // SAFETY: the tag cleared, the address of a lock borrowed for `'a` (`new`), with its provenance.
        unsafe { &*self.l.map_addr(|a| a & !HELD_BITS) }
    }

    #[inline(always)]
    fn how(&self) -> usize {
        self.l.addr() & HELD_BITS
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the one holder (see `Sync` above).
        unsafe { &*self.lock().v.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the one holder, and `&mut self` makes this the one borrow through it.
        unsafe { &mut *self.lock().v.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        let l = self.lock();
        match self.how() {
            h if h == Held::Owner as usize => l.in_use.store(false, Ordering::Release),
            h if h == Held::Word as usize => l.locked.store(false, Ordering::Release),
            _ => {
                // A visit: the owner may come back in as soon as `blocked` falls; others wait for the word.
                l.blocked.store(false, Ordering::Release);
                l.locked.store(false, Ordering::Release);
            }
        }
    }
}

/// A single-threaded lock held ([`SpinLock::lock_single`]); released when dropped, also while a panic unwinds.
pub(crate) struct SingleGuard<'a, T>(&'a SpinLock<T>);

impl<T> Deref for SingleGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the one holder (see `Sync` above).
        unsafe { &*self.0.v.get() }
    }
}

impl<T> DerefMut for SingleGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the one holder, and `&mut self` makes this the one borrow through it.
        unsafe { &mut *self.0.v.get() }
    }
}

impl<T> Drop for SingleGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.0.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Adds 1 under `g` with a non-atomic read-modify-write: two holders at once would lose an update.
    fn add_one(mut g: impl DerefMut<Target = u64>) {
        let v = *g;
        std::hint::black_box(&v);
        *g = v + 1;
    }

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
                        add_one(l.lock());
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
    fn the_first_datapath_thread_owns_it_and_takes_it_without_the_word() {
        let l = SpinLock::new(0u32);
        // The control path never takes the bias.
        *l.lock() += 1;
        assert!(!l.owned_here() && !l.revoked());
        {
            let mut g = l.lock_as::<true>();
            *g += 1;
        }
        assert_eq!(l.owned_here(), barrier::ready(), "owned by the first datapath taker where membarrier works");
        let g = l.lock_as::<true>();
        assert!(l.is_held());
        // The owner holds it by its flag: the word stays free (a plain spin lock holds the word).
        assert_eq!(l.locked.load(Ordering::Relaxed), !barrier::ready());
        drop(g);
        assert!(!l.is_held());
        // A control-path lock by the owner goes through its bias too.
        let g = l.lock();
        assert_eq!(l.locked.load(Ordering::Relaxed), !barrier::ready());
        drop(g);
        assert_eq!(*l.lock(), 2);
    }

    #[test]
    fn a_plain_spin_lock_never_takes_a_bias() {
        let l = SpinLock::new_unbiased(0u32);
        for _ in 0..3 {
            *l.lock_as::<true>() += 1;
        }
        assert!(!l.owned_here() && l.revoked());
        assert_eq!(*l.lock(), 3);
    }

    #[test]
    fn a_visitor_shuts_the_owner_out_and_the_bias_is_revoked_after_a_few_visits() {
        use std::sync::mpsc::channel;
        if !barrier::ready() {
            // Without membarrier(2) there is no bias to test (the plain lock is tested above).
            return;
        }
        let l = Arc::new(SpinLock::new(0u32));
        drop(l.lock_as::<true>());
        assert!(l.owned_here());
        for visit in 1..=VISITS + 1 {
            let (held_tx, held_rx) = channel();
            let l2 = l.clone();
            let visitor = std::thread::spawn(move || {
                let mut g = l2.lock();
                assert!(!l2.owned_here());
                held_tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(20));
                *g += 1;
            });
            held_rx.recv().unwrap();
            // The owner waits for the visitor: it sees the visitor's increment.
            let v = *l.lock_as::<true>();
            visitor.join().unwrap();
            assert_eq!(v, visit);
            assert_eq!(l.revoked(), visit > VISITS, "visit {visit}");
        }
        // Revoked: the former owner takes the word too.
        let g = l.lock_as::<true>();
        assert!(l.locked.load(Ordering::Relaxed));
        drop(g);
    }

    #[test]
    fn an_owner_and_its_visitors_never_overlap() {
        // On many fresh locks, the owner adds 1 two thousand times through its bias while another thread adds 1
        // through the word until the bias is revoked and a few times after: a non-atomic read-modify-write, so any
        // overlap of the Dekker pair would lose an update.
        const OWNER_ADDS: u64 = 2_000;
        const VISITOR_ADDS: u64 = VISITS as u64 + 3;
        for _ in 0..100 {
            let l = Arc::new(SpinLock::new(0u64));
            drop(l.lock_as::<true>());
            let start = Arc::new(std::sync::Barrier::new(2));
            let (l2, s2) = (l.clone(), start.clone());
            let visitor = std::thread::spawn(move || {
                s2.wait();
                for _ in 0..VISITOR_ADDS {
                    add_one(l2.lock_as::<true>());
                }
            });
            start.wait();
            for _ in 0..OWNER_ADDS {
                add_one(l.lock_as::<true>());
            }
            visitor.join().unwrap();
            assert_eq!(*l.lock(), OWNER_ADDS + VISITOR_ADDS);
            assert_eq!(l.revoked(), barrier::ready(), "revoked after its visits where it was biased");
        }
    }

    #[test]
    fn an_owner_and_a_visitor_hammering_it_never_overlap() {
        // One lock whose bias outlives every visit: the owner and a visitor each add 1 many times, the visitor's
        // every take a membarrier against the owner's plain flag (the Dekker pair under load).
        if !barrier::ready() {
            return;
        }
        let mut l = SpinLock::new(0u64);
        l.max_visits = u32::MAX;
        let l = Arc::new(l);
        drop(l.lock_as::<true>());
        let visitor_adds = 20_000u64;
        let done = Arc::new(AtomicBool::new(false));
        let start = Arc::new(std::sync::Barrier::new(2));
        let (l2, d2, s2) = (l.clone(), done.clone(), start.clone());
        let visitor = std::thread::spawn(move || {
            s2.wait();
            for _ in 0..visitor_adds {
                add_one(l2.lock_as::<true>());
            }
            d2.store(true, Ordering::Relaxed);
        });
        // The owner adds for as long as the visitor runs.
        start.wait();
        let mut owner_adds = 0u64;
        while !done.load(Ordering::Relaxed) {
            add_one(l.lock_as::<true>());
            owner_adds += 1;
        }
        visitor.join().unwrap();
        assert!(l.owned_here(), "still biased");
        assert_eq!(*l.lock(), owner_adds + visitor_adds);
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
    fn lock_single_takes_a_single_threaded_lock_by_its_flag() {
        // SAFETY: only this thread takes it.
        let l = unsafe { SpinLock::new_single_threaded(0u32) };
        {
            let mut g = l.lock_single();
            *g += 1;
            assert!(l.locked.load(Ordering::Relaxed));
        }
        assert!(!l.locked.load(Ordering::Relaxed), "released when the guard drops");
        assert_eq!(*l.lock(), 1);
    }

    #[test]
    fn lock_single_on_a_lock_that_locks_excludes_and_revokes_another_threads_bias() {
        // Another thread owns the lock's bias and adds through it while this thread adds through `lock_single`
        // (a caller that expected a single-threaded lock): a non-atomic read-modify-write, so any overlap would
        // lose an update. Afterwards the bias is revoked and both threads take the word.
        let l = Arc::new(SpinLock::new(0u64));
        let owned = Arc::new(std::sync::Barrier::new(2));
        let start = Arc::new(std::sync::Barrier::new(2));
        let (l2, o2, s2) = (l.clone(), owned.clone(), start.clone());
        const ADDS: u64 = 20_000;
        let owner = std::thread::spawn(move || {
            drop(l2.lock_as::<true>());
            let biased = l2.owned_here();
            o2.wait();
            s2.wait();
            for _ in 0..ADDS {
                add_one(l2.lock_as::<true>());
            }
            biased
        });
        owned.wait();
        start.wait();
        for _ in 0..ADDS {
            add_one(l.lock_single());
        }
        let biased = owner.join().unwrap();
        assert_eq!(biased, barrier::ready(), "the other thread owned it where membarrier works");
        assert_eq!(*l.lock(), 2 * ADDS);
        assert!(l.revoked() || !biased, "another thread's bias is revoked");
        assert!(!l.is_held());
    }

    #[test]
    fn lock_single_on_this_threads_own_bias_keeps_it() {
        let l = SpinLock::new(0u32);
        drop(l.lock_as::<true>());
        *l.lock_single() += 1;
        assert!(!l.is_held());
        assert_eq!(l.owned_here(), barrier::ready(), "still this thread's");
        *l.lock_as::<true>() += 1;
        assert_eq!(*l.lock(), 2);
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

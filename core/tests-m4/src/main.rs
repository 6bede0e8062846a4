//! `mlx5-core`'s device-free unit tests without std: on a Cortex-M4F (`thumbv7em-none-eabihf`, QEMU's
//! `mps2-an386`, output and exit status through semihosting), and the same list on the host.
//!
//! The tests are `mlx5_core::testlist` (feature `testlist`): every `#[test]` of the core that does not need std,
//! as plain functions that panic on failure. Both builds print `test NAME ... ok|FAILED` per test and end with
//! `N passed, N failed`; the exit status is non-zero when one failed. `cargo xtask cortex-m` runs both and
//! checks the counts agree.
//!
//! On the M4 a panic cannot unwind, so a failed test ends in the panic handler, which records the failure in
//! RAM the image does not cover (`_runner_state`, `memory.x`) and resets the core (SYSRESETREQ); the runner
//! starts again and goes on with the next test. Passing tests cost no reset, and a hard fault is a failure
//! like a panic. `#[should_panic]` tests pass through the same path when the message holds what they expect.
//!
//! Board tests ([`BOARD_TESTS`], `board.rs`), which both runs append to the core's list: the firmware example's
//! command-only `run_with` against an expectation mock of its bring-up recorded on the simulator.
#![cfg_attr(target_os = "none", no_std)]
#![cfg_attr(target_os = "none", no_main)]

use mlx5_core::testlist::{self, Test};

mod board;

/// Tests of this board beyond the core's unit tests, run after them.
const BOARD_TESTS: &[Test] = board::TESTS;

/// The `i`th test of the whole run: the core's list, then [`BOARD_TESTS`] (with `selftest`: [`selftest::TESTS`]).
fn test_at(i: usize) -> Option<&'static Test> {
    if cfg!(feature = "selftest") {
        return selftest::TESTS.get(i);
    }
    testlist::tests().chain(BOARD_TESTS.iter()).nth(i)
}

fn total() -> usize {
    if cfg!(feature = "selftest") {
        return selftest::TESTS.len();
    }
    testlist::count() + BOARD_TESTS.len()
}

/// Planted failures, to show the harness reports each and goes on (`cargo xtask cortex-m` expects exactly
/// `2 passed, 3 failed` with the three `fails_*` tests named, and a failing exit status).
mod selftest {
    use mlx5_core::testlist::Test;

    fn fails_an_assertion() {
        let two = core::hint::black_box(2);
        assert_eq!(two + 2, 5, "planted failure");
    }

    fn fails_to_panic() {}

    /// A permanently undefined instruction: a UsageFault, escalated to HardFault (on the host, a panic).
    fn fails_with_a_fault() {
        #[cfg(target_os = "none")]
        // SAFETY: UDF raises an exception on purpose; the fault handler records the failure and resets.
        unsafe {
            core::arch::asm!("udf #0")
        };
        #[cfg(not(target_os = "none"))]
        panic!("planted fault");
    }

    fn panics_as_expected() {
        let v = core::hint::black_box([1u8, 2]);
        assert!(v[0] > v[1], "first greater than second");
    }

    fn passes_after_the_failures() {
        assert_eq!(core::hint::black_box(2) + 2, 4);
    }

    pub(super) const TESTS: &[Test] = &[
        Test { name: "selftest::fails_an_assertion", run: fails_an_assertion, should_panic: None },
        Test { name: "selftest::fails_to_panic", run: fails_to_panic, should_panic: Some("") },
        Test { name: "selftest::fails_with_a_fault", run: fails_with_a_fault, should_panic: None },
        Test { name: "selftest::panics_as_expected", run: panics_as_expected, should_panic: Some("first greater") },
        Test { name: "selftest::passes_after_the_failures", run: passes_after_the_failures, should_panic: None },
    ];
}

/// What a `#[should_panic]` test's panic message must contain, checked the same way on both runs.
fn expected_panic(message: &str, expected: &str) -> bool {
    message.contains(expected)
}

#[cfg(target_os = "none")]
mod m4 {
    //! The bare-metal runner.

    use super::{expected_panic, test_at, total};
    use core::fmt::Write;
    use core::panic::PanicInfo;
    use cortex_m_rt::{entry, exception, ExceptionFrame};
    use mlx5_core::testlist;

    /// ARM semihosting (the `BKPT 0xAB` call QEMU answers with `-semihosting-config enable=on`).
    mod semihosting {
        const SYS_WRITE0: u32 = 0x04;
        const SYS_EXIT: u32 = 0x18;
        /// `SYS_EXIT` reasons: QEMU exits 0 for the first, 1 for any other.
        const ADP_STOPPED_APPLICATION_EXIT: usize = 0x2_0026;
        const ADP_STOPPED_RUN_TIME_ERROR_UNKNOWN: usize = 0x2_0023;

        fn call(op: u32, arg: usize) -> u32 {
            let r;
            // SAFETY: a semihosting call reads at most the memory `arg` points to (a NUL-terminated string the
            // caller keeps alive) and writes only r0; the debugger or QEMU handles the breakpoint.
            unsafe {
                core::arch::asm!("bkpt #0xab", inout("r0") op => r, in("r1") arg, options(nostack, preserves_flags))
            };
            r
        }

        /// Text to the host's console.
        pub(super) struct Console;

        impl core::fmt::Write for Console {
            fn write_str(&mut self, s: &str) -> core::fmt::Result {
                // SYS_WRITE0 takes a NUL-terminated string: copied out a piece at a time.
                let mut buf = [0u8; 129];
                for chunk in s.as_bytes().chunks(128) {
                    buf[..chunk.len()].copy_from_slice(chunk);
                    buf[chunk.len()] = 0;
                    call(SYS_WRITE0, buf.as_ptr() as usize);
                }
                Ok(())
            }
        }

        /// Ends the QEMU run: exit status 0 when `ok`, 1 otherwise.
        pub(super) fn exit(ok: bool) -> ! {
            let reason = if ok { ADP_STOPPED_APPLICATION_EXIT } else { ADP_STOPPED_RUN_TIME_ERROR_UNKNOWN };
            call(SYS_EXIT, reason);
            // Without a semihosting host nothing ends the run: stay here.
            loop {
                core::hint::spin_loop();
            }
        }
    }

    macro_rules! out {
        ($($arg:tt)*) => {{
            let _ = write!(semihosting::Console, $($arg)*);
        }};
    }

    /// The run's progress, kept across resets in RAM no section of the image covers.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct State {
        /// [`MAGIC`] while a run is under way; anything else at power-on starts a new run.
        magic: u32,
        /// The test running or next to run.
        next: u32,
        passed: u32,
        failed: u32,
        /// 1 while test `next` runs: a panic or fault then is that test's.
        running: u32,
    }

    const MAGIC: u32 = 0x4d34_7473; // "M4ts"

    extern "C" {
        /// The first byte past RAM, below the stack's top (memory.x): where [`State`] lives.
        static _runner_state: u8;
        static _dma_arena: u8;
        static _dma_arena_end: u8;
    }

    fn state_ptr() -> *mut State {
        // Only the symbol's address is taken; nothing is read through the reference-free pointer here.
        (&raw const _runner_state).cast::<State>().cast_mut()
    }

    fn load() -> State {
        // SAFETY: `_runner_state` is 4 KiB of RAM the linker leaves to the runner (memory.x), aligned to 4 KiB;
        // a volatile read, since a reset happens between the write and this read.
        unsafe { state_ptr().read_volatile() }
    }

    fn store(s: State) {
        // SAFETY: as in `load`; nothing else uses this memory.
        unsafe { state_ptr().write_volatile(s) }
    }

    /// A system reset (AIRCR.SYSRESETREQ): the runner starts again from the vector table.
    fn reset() -> ! {
        const AIRCR: *mut u32 = 0xe000_ed0c as *mut u32;
        // SAFETY: AIRCR is the SCB's architectural register; VECTKEY 0x05fa with SYSRESETREQ asks for a reset. The
        // barriers make the state written before it visible first.
        unsafe {
            core::arch::asm!("dsb", options(nostack, preserves_flags));
            AIRCR.write_volatile(0x05fa_0004);
            core::arch::asm!("dsb", options(nostack, preserves_flags));
        }
        loop {
            core::hint::spin_loop();
        }
    }

    #[entry]
    fn main() -> ! {
        let mut st = load();
        if st.magic != MAGIC {
            st = State { magic: MAGIC, next: 0, passed: 0, failed: 0, running: 0 };
            out!("running {} tests on a Cortex-M4F (mps2-an386)\n", total());
            out!("{} tests need std and run only under cargo test (testlist::HOST_ONLY)\n", testlist::HOST_ONLY.len());
        }
        // SAFETY: the PSRAM window memory.x reserves for the arena, used by nothing else; one test at a time.
        unsafe {
            let start = (&raw const _dma_arena).cast_mut();
            let len = (&raw const _dma_arena_end) as usize - start as usize;
            testlist::set_arena(start, len);
        }
        while let Some(t) = test_at(st.next as usize) {
            st.running = 1;
            store(st);
            testlist::before_each();
            (t.run)();
            if let Some(expected) = t.should_panic {
                st.failed += 1;
                out!("test {} ... FAILED\n  did not panic (expected {expected:?})\n", t.short_name());
            } else {
                st.passed += 1;
                out!("test {} ... ok\n", t.short_name());
            }
            st.running = 0;
            st.next += 1;
            store(st);
        }
        out!("\n{} passed, {} failed\n", st.passed, st.failed);
        let ok = st.failed == 0;
        // A later reset starts a new run.
        store(State { magic: 0, ..st });
        semihosting::exit(ok)
    }

    /// A message truncated to what fits, for comparing with `#[should_panic(expected)]`.
    struct Buf {
        bytes: [u8; 512],
        len: usize,
    }

    impl Write for Buf {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            let n = s.len().min(self.bytes.len() - self.len);
            self.bytes[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }

    /// The test in progress ended abnormally: records the verdict, then resets to go on with the next test.
    fn ended(why: &dyn core::fmt::Display, message: Option<core::fmt::Arguments<'_>>) -> ! {
        let mut st = load();
        let t = match (st.magic, st.running) {
            (MAGIC, 1) => test_at(st.next as usize),
            _ => None,
        };
        let Some(t) = t else {
            out!("runner failure outside a test: {why}\n");
            semihosting::exit(false)
        };
        let mut msg = Buf { bytes: [0; 512], len: 0 };
        if let Some(m) = message {
            let _ = msg.write_fmt(m);
        }
        let text = core::str::from_utf8(&msg.bytes[..msg.len]).unwrap_or("");
        match t.should_panic {
            Some(expected) if message.is_some() && expected_panic(text, expected) => {
                st.passed += 1;
                out!("test {} - should panic ... ok\n", t.short_name());
            }
            _ => {
                st.failed += 1;
                out!("test {} ... FAILED\n  {why}\n", t.short_name());
            }
        }
        st.running = 0;
        st.next += 1;
        store(st);
        reset()
    }

    #[panic_handler]
    fn panic(info: &PanicInfo<'_>) -> ! {
        ended(info, Some(format_args!("{}", info.message())))
    }

    #[exception]
    unsafe fn HardFault(ef: &ExceptionFrame) -> ! {
        struct Fault(u32);
        impl core::fmt::Display for Fault {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "hard fault at pc {:#010x}", self.0)
            }
        }
        ended(&Fault(ef.pc()), None)
    }
}

#[cfg(not(target_os = "none"))]
fn main() -> std::process::ExitCode {
    use std::sync::Mutex;

    // The same arena size the M4 gives (memory.x: 16 MiB of PSRAM), leaked for the program's life.
    let arena: &'static mut [u8] = Box::leak(vec![0u8; 16 << 20].into_boxed_slice());
    // SAFETY: the arena is this program's, used by nothing else, and tests run one at a time.
    unsafe { testlist::set_arena(arena.as_mut_ptr(), arena.len()) };
    // A failing test's message is printed under its name, as on the M4, rather than by the default hook.
    static LAST: Mutex<String> = Mutex::new(String::new());
    std::panic::set_hook(Box::new(|info| {
        let text = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())).unwrap_or_default();
        *LAST.lock().unwrap_or_else(|e| e.into_inner()) = format!("{text}\n{at}");
    }));
    println!("running {} tests on the host", total());
    println!("{} tests need std and run only under cargo test (testlist::HOST_ONLY):", testlist::HOST_ONLY.len());
    for (name, why) in testlist::HOST_ONLY {
        println!("  {name}: {why}");
    }
    let (mut passed, mut failed) = (0usize, 0usize);
    for i in 0..total() {
        let Some(t) = test_at(i) else { break };
        testlist::before_each();
        let r = std::panic::catch_unwind(t.run);
        let last = std::mem::take(&mut *LAST.lock().unwrap_or_else(|e| e.into_inner()));
        let message = last.split_once('\n').map_or(last.as_str(), |(m, _)| m);
        match (r, t.should_panic) {
            (Ok(()), None) => {
                passed += 1;
                println!("test {} ... ok", t.short_name());
            }
            (Err(_), Some(expected)) if expected_panic(message, expected) => {
                passed += 1;
                println!("test {} - should panic ... ok", t.short_name());
            }
            (Ok(()), Some(expected)) => {
                failed += 1;
                println!("test {} ... FAILED\n  did not panic (expected {expected:?})", t.short_name());
            }
            (Err(_), _) => {
                failed += 1;
                println!("test {} ... FAILED\n  {last}", t.short_name());
            }
        }
    }
    println!("\n{passed} passed, {failed} failed");
    if failed == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

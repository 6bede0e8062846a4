//! The core's unit tests as plain functions (feature `testlist`), for a harness without std.
//!
//! The standard harness needs std, so on a microcontroller (`core/tests-m4`, run on a Cortex-M4F under QEMU by
//! `cargo xtask cortex-m`) the tests are run from [`MODULES`]: each test module is marked
//! `#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]`, which keeps its `#[test]` functions in
//! non-test builds and lists them as `TESTS`. A test that fails panics, as under `cargo test`. Tests that need
//! std (a heap) are marked `#[cfg(test)]` and stay host-only; [`HOST_ONLY`] names them and says why.
//!
//! A new test module is listed in [`MODULES`]; the host run of the same list (`cargo run -p
//! mlx5-core-tests-m4`) and the M4 run must report the same count.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// One unit test.
#[derive(Clone, Copy, Debug)]
pub struct Test {
    /// Its path, `mlx5_core::module::tests::name`.
    pub name: &'static str,
    /// The test: returns when it passes, panics when it fails.
    pub run: fn(),
    /// `#[should_panic]`: the test passes only by panicking with a message containing this text ("" for any).
    pub should_panic: Option<&'static str>,
}

impl Test {
    /// The name as `cargo test` prints it (without the crate).
    pub fn short_name(&self) -> &'static str {
        self.name.strip_prefix("mlx5_core::").unwrap_or(self.name)
    }
}

/// Every listed test module, in source order.
pub const MODULES: &[&[Test]] = &[
    crate::ah::tests::TESTS,
    crate::buf::tests::TESTS,
    crate::caps::tests::TESTS,
    crate::cmd::tests::TESTS,
    crate::cmdq::tests::TESTS,
    crate::cq::cqe::tests::TESTS,
    crate::cq::ex::tests::TESTS,
    crate::cq::ring::tests::TESTS,
    crate::cq::wc::tests::TESTS,
    crate::dbr::tests::TESTS,
    crate::eq::tests::TESTS,
    crate::golden::tests::TESTS,
    crate::hal::tests::TESTS,
    crate::hca::events::tests::TESTS,
    crate::mkey::tests::TESTS,
    crate::port::tests::TESTS,
    crate::prm::tests::TESTS,
    crate::qcounter::tests::TESTS,
    crate::qp::attr::tests::TESTS,
    crate::qp::cmd::tests::TESTS,
    crate::qp::ex::tests::TESTS,
    crate::qp::ring::tests::TESTS,
    crate::qp::size::tests::TESTS,
    crate::qp::wr::tests::TESTS,
    crate::srq::tests::TESTS,
    crate::table::tests::TESTS,
    crate::trace::tests::TESTS,
    crate::uar::tests::TESTS,
    crate::vport::tests::TESTS,
    // The expectation mock's tests (core/src/mock/, issue 33) join here when that module lands.
];

/// The core's unit tests that need std and so run only under `cargo test`, each with the reason: all three
/// exercise a pool over a growable table, which the core leaves to a host with a heap (`table::growable`, std's
/// `Vec`), at sizes past any fixed capacity.
pub const HOST_ONLY: &[(&str, &str)] = &[
    (
        "hca::events::tests::a_growable_cq_table_routes_events_for_thousands_of_cqs_in_arrival_order",
        "20,000 CQs in a std Vec table",
    ),
    (
        "dbr::tests::a_growable_table_holds_more_records_than_any_fixed_pool_and_shrinks_back",
        "79 record pages in a std Vec table",
    ),
    (
        "pages::tests::a_growable_pool_lends_past_64_mib_and_finds_every_returned_page",
        "257 firmware-page chunks (64 MiB) in a std Vec table",
    ),
];

/// Every listed test, module by module.
pub fn tests() -> impl Iterator<Item = &'static Test> {
    MODULES.iter().flat_map(|m| m.iter())
}

/// How many tests [`tests`] yields.
pub fn count() -> usize {
    MODULES.iter().map(|m| m.len()).sum()
}

/// The memory the tests' DMA allocator (`hal::tests::TestDma` outside `cargo test`) hands out: set once by the
/// harness, reused from the start by every test. Kept as a pointer, so its provenance is kept.
static ARENA_BASE: AtomicPtr<u8> = AtomicPtr::new(core::ptr::null_mut());
static ARENA_LEN: AtomicUsize = AtomicUsize::new(0);
static ARENA_TOP: AtomicUsize = AtomicUsize::new(0);
/// Bytes left free before each region.
#[cfg_attr(test, allow(dead_code))]
const GAP: usize = 64;

/// Gives the tests' DMA allocator its memory (on the M4, a board region the linker script reserves).
///
/// # Safety
///
/// `base..base + len` is writable memory that nothing else uses for as long as tests run; the harness runs one
/// test at a time and calls [`before_each`] between them.
pub unsafe fn set_arena(base: *mut u8, len: usize) {
    ARENA_BASE.store(base, Ordering::Relaxed);
    ARENA_LEN.store(len, Ordering::Relaxed);
    ARENA_TOP.store(0, Ordering::Relaxed);
}

/// Called by the harness before each test: the previous test's DMA regions are forgotten (each test makes its
/// own allocator and gives everything back or leaks it; either way its memory is free for the next).
pub fn before_each() {
    ARENA_TOP.store(0, Ordering::Relaxed);
}

/// A fresh, zeroed, `align`-aligned piece of the arena, or `None` when it does not fit (or no arena was given).
// Under `cargo test` the allocator is std's.
#[cfg_attr(test, allow(dead_code))]
pub(crate) fn arena_alloc(len: usize, align: usize) -> Option<NonNull<u8>> {
    let base = NonNull::new(ARENA_BASE.load(Ordering::Relaxed))?;
    let top = ARENA_TOP.load(Ordering::Relaxed);
    if !align.is_power_of_two() {
        return None;
    }
    // A gap of unused bytes before each region, as a heap leaves: regions are never adjacent, so no test sees
    // two allocations merge into one larger page by accident, and a small overrun hits nothing.
    let top = top.checked_add(GAP)?;
    let addr = base.as_ptr().addr().checked_add(top)?;
    let start = top + (addr.wrapping_neg() & (align - 1));
    let end = start.checked_add(len.max(1))?;
    if end > ARENA_LEN.load(Ordering::Relaxed) {
        return None;
    }
    ARENA_TOP.store(end, Ordering::Relaxed);
    // SAFETY: `start..end` lies inside the arena `set_arena`'s caller vouched for, and past every region handed
    // out since the last `before_each`, so no live region is overwritten.
    unsafe {
        let p = base.as_ptr().add(start);
        core::ptr::write_bytes(p, 0, end - start);
        NonNull::new(p)
    }
}

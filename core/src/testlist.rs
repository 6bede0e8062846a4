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
    crate::mad_ifc::tests::TESTS,
    crate::mkey::tests::TESTS,
    crate::mock::tests::TESTS,
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

/// Gives the tests' DMA allocator (`hal::tests::TestDma` outside `cargo test`) its memory: on the M4, a board
/// region the linker script reserves. Every test reuses it from the start.
///
/// # Safety
///
/// `base..base + len` is writable memory that nothing else uses for as long as tests run; the harness runs one
/// test at a time and calls [`before_each`] between them.
pub unsafe fn set_arena(base: *mut u8, len: usize) {
    // SAFETY: the caller's promise, passed on.
    unsafe { crate::hal::tests::arena::set(base, len) }
}

/// `len` zeroed bytes of the arena [`set_arena`] gave, aligned to `align`, for a board test's own device memory
/// (an expectation mock's arena); `None` when they do not fit or no arena was given.
///
/// # Safety
///
/// The slice is valid only until the next [`before_each`], which takes the arena back: the caller drops every use
/// of it (and of the regions a mock hands out from it) before its test ends.
pub unsafe fn take_arena(len: usize, align: usize) -> Option<&'static mut [u8]> {
    let p = crate::hal::tests::arena::alloc(len, align)?;
    // SAFETY: `len` fresh bytes handed out once since the last `before_each`; the caller keeps them no longer.
    Some(unsafe { core::slice::from_raw_parts_mut(p.as_ptr(), len) })
}

/// Called by the harness before each test: the previous test's DMA regions are forgotten (each test makes its
/// own allocator and gives everything back or leaks it; either way its memory is free for the next).
pub fn before_each() {
    crate::hal::tests::arena::reset();
}

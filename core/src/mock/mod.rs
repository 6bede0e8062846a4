//! Expectation mocks of the firmware command interface (feature `mock`), in the spirit of embedded-hal-mock: a
//! test lists the commands it expects, with the reply to each, and the code under test runs against a
//! [`MockDevice`] through the ordinary [`Mmio`](crate::hal::Mmio) and [`Dma`](crate::hal::Dma) traits.
//!
//! ```ignore
//! let dev: MockDevice = MockDevice::new(arena);
//! dev.expect(Expect::cmd(Opcode::CreateCq).field("cq_context.log_cq_size", 10).returns("cqn", 5))
//!    .expect(Expect::cmd(Opcode::DestroyCq).field("cqn", 5));
//! // ... the code under test runs with `&dev` as its Mmio and Dma ...
//! dev.done()?; // or dev.assert_done()
//! ```
//!
//! An expectation names the opcode, optionally `op_mod`, input fields by their PRM path inside `<opcode>_in`
//! (`cq_context.log_cq_size`, `pas[0]`, resolved through the generated name table) or the whole input message;
//! its [`Reply`] gives output fields by name (inside `<opcode>_out`) or a whole recorded output, status and
//! syndrome, a timeout (the entry is never handed back), a delivery error, or a page request posted as an EQE
//! before the command completes. The first command that departs from the script is kept as a readable message
//! (`CREATE_CQ: cq_context.log_cq_size expected 10, got 11`, `expected CREATE_CQ, got DESTROY_CQ`) and answered
//! with `BAD_OP` (syndrome [`UNEXPECTED_SYNDROME`]) so the code under test fails fast; [`MockDevice::done`]
//! reports it, or the expectations left over (`2 expectations left: DESTROY_CQ, DEALLOC_PD`). Commands a test does
//! not care about are answered only when named with [`MockDevice::allow_any`], never silently.
//!
//! The device side emulates what the core's bring-up reads of the initialization segment (firmware and command
//! interface revisions, queue geometry, `initializing` clear, a moving heartbeat, the command timeout) and the
//! command queue (entry, mailbox chains followed by their `next` pointers, ownership, delivery status). It does not
//! execute commands: every answer comes from the script. Everything is fixed-capacity (`N` expectations, `R` live
//! DMA regions, [`MAX_FIELDS`] fields each) and nothing allocates, so the same tests run on a microcontroller.

// Messages are returned by value: the mock has no heap to box them in.
#![allow(clippy::result_large_err)]

mod device;
mod expect;
mod names;

pub use device::{MockConfig, MockDevice, IOVA_BASE, MAX_ALIGN, MAX_ALLOWED, MAX_PAGE_RUNS, UNEXPECTED_SYNDROME};
pub use expect::{Ending, Expect, NamedValue, Reply, MAX_FIELDS};

use crate::prm::Opcode;

/// Characters a mock message holds (longer ones are cut).
pub const MSG_LEN: usize = 256;

/// A mock's report, without allocation.
pub type Message = heapless::String<MSG_LEN>;

/// Why [`MockDevice::done`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MockError {
    /// The first command that departed from the script (or another misuse of the device), as a message naming the
    /// command and the field.
    Unexpected(Message),
    /// The code under test stopped before these expectations were met.
    Left {
        /// How many.
        count: usize,
        /// Their opcodes, in order (`, ...` when they do not all fit).
        names: Message,
    },
}

impl core::fmt::Display for MockError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            MockError::Unexpected(m) => f.write_str(m),
            MockError::Left { count: 1, names } => write!(f, "1 expectation left: {names}"),
            MockError::Left { count, names } => write!(f, "{count} expectations left: {names}"),
        }
    }
}

impl core::error::Error for MockError {}

/// An opcode's kernel name (`CREATE_CQ`), or its number when the headers do not name it.
pub(crate) struct OpStr(Opcode);

impl core::fmt::Display for OpStr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "opcode {:#x}", self.0.raw()),
        }
    }
}

pub(crate) fn op_str(op: Opcode) -> OpStr {
    OpStr(op)
}

/// The mock's own tests and the core's bring-up, CQ, QP and teardown error paths on it: device-free and heap-free
/// (messages formatted into fixed strings, arenas from the harness), so they run on the Cortex-M4F too.
#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    #[cfg(test)]
    extern crate std;

    use core::fmt::Write as _;

    use super::*;

    use crate::hal::{DelayNs, Dma};
    use crate::hca::{BringupError, Config, Error, Hca, Step};
    use crate::prm::{CmdStatus, DeliveryStatus};

    struct NoDelay;
    impl DelayNs for NoDelay {
        fn delay_ns(&mut self, _ns: u32) {}
    }

    /// Bytes a brought-up HCA needs with a small async EQ: the queue, mailboxes, EQs and a 64-page firmware chunk.
    const ARENA: usize = 1 << 20;

    fn arena() -> &'static mut [u8] {
        sized(ARENA)
    }

    /// `len` zeroed bytes for a mock: leaked under `cargo test`, whose tests run on threads at once.
    #[cfg(test)]
    fn sized(len: usize) -> &'static mut [u8] {
        std::boxed::Box::leak(std::vec![0u8; len].into_boxed_slice())
    }

    /// `len` zeroed bytes for a mock: outside `cargo test` (the `testlist` harness, one test at a time, no heap),
    /// from the harness's DMA arena, which it takes back before the next test.
    #[cfg(not(test))]
    fn sized(len: usize) -> &'static mut [u8] {
        let p = crate::hal::tests::arena::alloc(len, MAX_ALIGN).expect("the harness's arena holds a mock's memory");
        // SAFETY: `len` fresh bytes of the arena, handed out once; the harness takes them back only between tests
        // (`testlist::before_each`), after this test and its mock, the only holder of the slice, are gone.
        unsafe { core::slice::from_raw_parts_mut(p.as_ptr(), len) }
    }

    /// A message as text, formatted without a heap.
    fn text(e: &impl core::fmt::Display) -> heapless::String<512> {
        let mut s = heapless::String::new();
        let _ = write!(s, "{e}");
        s
    }

    fn cfg() -> Config {
        Config { async_eq_nent: 64, ..Config::default() }
    }

    /// Pages the scripted firmware asks for at boot.
    const BOOT_PAGES: u64 = 4;
    const UAR: u64 = 3;

    /// `Hca::bring_up` of a small InfiniBand device (no atomics, RoCE or counters) in the core's order.
    fn bring_up() -> [Expect<'static>; 16] {
        use Opcode::*;
        [
            Expect::cmd(EnableHca),
            Expect::cmd(QueryIssi).returns("supported_issi_dw0", 0b10),
            Expect::cmd(SetIssi).field("current_issi", 1),
            Expect::cmd(QueryPages).op_mod(1).returns("num_pages", BOOT_PAGES),
            Expect::cmd(ManagePages).op_mod(1).field("input_num_entries", BOOT_PAGES),
            Expect::cmd(AccessReg),
            Expect::cmd(QueryHcaCap).op_mod(0).returns("capability.cmd_hca_cap.log_max_qp", 10),
            Expect::cmd(QueryHcaCap).op_mod(1),
            Expect::cmd(SetHcaCap).field("capability.cmd_hca_cap.log_max_qp", 10),
            Expect::cmd(QueryPages).op_mod(2),
            Expect::cmd(InitHca),
            Expect::cmd(QueryHcaCap)
                .op_mod(1)
                .returns("capability.cmd_hca_cap.log_max_cq_sz", 12)
                .returns("capability.cmd_hca_cap.log_max_eq_sz", 12),
            Expect::cmd(AllocUar).returns("uar", UAR),
            Expect::cmd(CreateEq).field("event_bitmask[0]", 1 << 0xa).returns("eq_number", 7),
            Expect::cmd(CreateEq).returns("eq_number", 8),
            Expect::cmd(CreateEq).field("event_bitmask[0]", 1 << 0xb).returns("eq_number", 9),
        ]
    }

    /// `Hca::teardown` of that device.
    fn teardown() -> [Expect<'static>; 7] {
        use Opcode::*;
        [
            Expect::cmd(DestroyEq).field("eq_number", 9),
            Expect::cmd(DestroyEq).field("eq_number", 8),
            Expect::cmd(DestroyEq).field("eq_number", 7),
            Expect::cmd(DeallocUar).field("uar", UAR),
            Expect::cmd(TeardownHca),
            Expect::cmd(ManagePages).op_mod(2).gives_back_pages(),
            Expect::cmd(DisableHca),
        ]
    }

    type Dev = MockDevice<'static, 64, 64>;

    #[test]
    fn the_core_brings_up_and_tears_down_on_its_script() {
        let dev: Dev = MockDevice::new(arena());
        dev.expect_all(bring_up()).expect_all(teardown());
        let hca: Hca<_, _> = Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).expect("bring-up");
        assert_eq!((hca.uar(), hca.issi(), hca.pages_given()), (Some(UAR as u32), 1, BOOT_PAGES as usize));
        assert_eq!(dev.pages_held(), BOOT_PAGES as usize);
        hca.teardown(&mut NoDelay).expect("teardown");
        dev.assert_done();
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
        assert!(dev.release().is_ok());
    }

    #[test]
    fn a_wrong_field_is_named_with_both_values() {
        let dev: Dev = MockDevice::new(arena());
        let mut script = bring_up();
        script[8] = Expect::cmd(Opcode::SetHcaCap).field("capability.cmd_hca_cap.log_max_qp", 12);
        dev.expect_all(script).expect_all(teardown());
        let hca: Hca<_, _> = Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).expect("bring-up");
        hca.teardown(&mut NoDelay).expect("teardown");
        assert_eq!(
            text(&dev.done().unwrap_err()),
            "SET_HCA_CAP: capability.cmd_hca_cap.log_max_qp expected 12, got 10"
        );
    }

    #[test]
    fn a_wrong_opcode_fails_the_code_under_test_at_once() {
        let dev: Dev = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca)).expect(Expect::cmd(Opcode::SetIssi));
        dev.expect(Expect::cmd(Opcode::DisableHca));
        let err = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).unwrap_err();
        // QUERY_ISSI came where SET_ISSI was expected: answered BAD_OP, which bring-up takes as ISSI 0 firmware, so
        // the next command (QUERY_PAGES) is unexpected too; only the first is reported.
        assert_eq!(text(&dev.done().unwrap_err()), "expected SET_ISSI, got QUERY_ISSI");
        assert_eq!(err.step, Step::BootPages);
        assert_eq!(dev.live_regions(), 0);
    }

    #[test]
    fn expectations_left_over_are_listed() {
        let dev: Dev = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::CreateCq))
            .expect(Expect::cmd(Opcode::DestroyCq))
            .expect(Expect::cmd(Opcode::DeallocPd));
        let e = dev.done().unwrap_err();
        assert_eq!(text(&e), "3 expectations left: CREATE_CQ, DESTROY_CQ, DEALLOC_PD");
        let one: Dev = MockDevice::new(arena());
        one.expect(Expect::cmd(Opcode::DestroyCq));
        assert_eq!(text(&one.done().unwrap_err()), "1 expectation left: DESTROY_CQ");
    }

    #[test]
    fn unknown_field_names_are_reported_not_ignored() {
        let dev: Dev = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca).field("no_such_field", 1)).expect(Expect::cmd(Opcode::DisableHca));
        let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg());
        assert_eq!(text(&dev.done().unwrap_err()), "ENABLE_HCA: enable_hca_in has no field no_such_field");
    }

    #[test]
    fn field_paths_resolve_through_nested_layouts_arrays_and_unions() {
        let cq = names::command_layout(Opcode::CreateCq, "in").unwrap();
        assert_eq!(names::resolve(cq, "cq_context.log_cq_size"), Some((16 * 8 + 99, 5)));
        assert_eq!(names::resolve(cq, "pas[2]"), Some((2176 + 128, 64)));
        assert_eq!(names::resolve(cq, "cq_context"), None, "a struct is not a value");
        assert_eq!(names::resolve(cq, "cq_context.log_cq_size.x"), None);
        assert_eq!(names::resolve(cq, "pas[x]"), None);
        let mut s: heapless::String<96> = heapless::String::new();
        assert_eq!(names::name_at(cq, 16 * 8 + 100, &mut s), Some((16 * 8 + 99, 5)));
        assert_eq!(s.as_str(), "cq_context.log_cq_size");
        let cap = names::command_layout(Opcode::QueryHcaCap, "out").unwrap();
        let (off, w) = names::resolve(cap, "capability.cmd_hca_cap.log_max_cq_sz").unwrap();
        assert_eq!((off, w), (128 + 200, 8));
        s.clear();
        assert_eq!(names::name_at(cap, off + 3, &mut s), Some((off, w)));
        assert_eq!(s.as_str(), "capability.cmd_hca_cap.log_max_cq_sz");
        assert!(names::command_layout(Opcode::AccessReg, "in").is_some());
    }

    #[test]
    fn bits_read_and_write_at_any_offset_and_width() {
        let mut b = [0u8; 16];
        assert!(names::write_bits(&mut b[..], 3, 13, 0x1abc));
        assert_eq!(names::read_bits(&b[..], 3, 13), Some(0x1abc));
        assert_eq!(b[..2], [0x1a, 0xbc]);
        assert!(names::write_bits(&mut b[..], 64, 64, u64::MAX - 1));
        assert_eq!(names::read_bits(&b[..], 64, 64), Some(u64::MAX - 1));
        assert_eq!(names::read_bits(&b[..], 120, 16), None, "past the end");
        assert!(!names::write_bits(&mut b[..], 0, 65, 0));
    }

    #[test]
    fn a_whole_input_that_differs_is_named_by_field() {
        let mut want = [0u8; 16];
        want[..2].copy_from_slice(&[0x01, 0x04]); // opcode 0x104, ENABLE_HCA
        want[11] = 5; // function_id 5
        let dev: MockDevice<'_, 4, 64> = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca).input(&want)).expect(Expect::cmd(Opcode::DisableHca));
        let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, Config { function_id: 0, ..cfg() });
        assert_eq!(text(&dev.done().unwrap_err()), "ENABLE_HCA: function_id expected 5, got 0");
    }

    #[test]
    fn a_masked_input_compares_only_the_bits_of_its_mask() {
        let mut want = [0u8; 16];
        want[..2].copy_from_slice(&[0x01, 0x04]); // ENABLE_HCA
        want[11] = 0x15; // function_id 0x15; the driver sends 0
        let mut mask = [0xffu8; 16];
        mask[11] = 0;
        let dev: MockDevice<'_, 4, 64> = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca).input(&want).input_mask(&mask));
        let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, Config { function_id: 0, ..cfg() });
        // ENABLE_HCA matched with the byte masked out; bring-up went on to the next command.
        assert_eq!(text(&dev.done().unwrap_err()), "expected no more commands, got QUERY_ISSI");

        // Only the low nibble masked out: the high one still differs and is named.
        let mut nibble = mask;
        nibble[11] = 0xf0;
        let dev: MockDevice<'_, 4, 64> = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca).input(&want).input_mask(&nibble));
        let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, Config { function_id: 0, ..cfg() });
        assert_eq!(text(&dev.done().unwrap_err()), "ENABLE_HCA: function_id expected 21, got 0");
    }

    #[test]
    fn an_input_prefix_compares_the_start_and_lets_the_rest_vary() {
        let mut want = [0u8; 10];
        want[..2].copy_from_slice(&[0x01, 0x04]); // ENABLE_HCA; function_id (bytes 10 and 11) is past these
        let dev: MockDevice<'_, 4, 64> = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca).input_prefix(&want));
        let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, Config { function_id: 5, ..cfg() });
        assert_eq!(text(&dev.done().unwrap_err()), "expected no more commands, got QUERY_ISSI");
        // A prefix longer than the input is a mismatch, as is a whole input of another length.
        let long = [0u8; 20];
        for (e, m) in [
            (
                Expect::cmd(Opcode::EnableHca).input_prefix(&long),
                "ENABLE_HCA: input length expected at least 20, got 16",
            ),
            (Expect::cmd(Opcode::EnableHca).input(&want), "ENABLE_HCA: input length expected 10, got 16"),
        ] {
            let dev: MockDevice<'_, 4, 64> = MockDevice::new(arena());
            dev.expect(e);
            let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg());
            assert_eq!(text(&dev.done().unwrap_err()), m);
        }
    }

    #[test]
    fn an_unhandled_syndrome_comes_back_as_the_commands_status() {
        let dev: Dev = MockDevice::new(arena());
        dev.expect_all(bring_up()[..5].iter().cloned());
        dev.expect(Expect::cmd(Opcode::AccessReg).fails(CmdStatus::BadParam, 0x1234));
        dev.expect(Expect::cmd(Opcode::ManagePages).op_mod(2).gives_back_pages())
            .expect(Expect::cmd(Opcode::DisableHca));
        let err: BringupError = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).unwrap_err();
        assert_eq!(err.step, Step::HcaCtrl);
        assert!(
            matches!(
                err.error,
                Error::Cmd(crate::cmdq::CmdError::Status { syndrome: 0x1234, status: CmdStatus::BadParam, .. })
            ),
            "{err:?}"
        );
        dev.assert_done();
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
    }

    #[test]
    fn a_command_that_never_completes_times_out_and_keeps_its_memory() {
        let dev: Dev = MockDevice::with_config(MockConfig { cmd_timeout_ms: 50, ..MockConfig::default() }, arena());
        dev.expect_all(bring_up()[..10].iter().cloned());
        dev.expect(Expect::cmd(Opcode::InitHca).times_out());
        dev.expect(Expect::cmd(Opcode::ManagePages).op_mod(2).gives_back_pages())
            .expect(Expect::cmd(Opcode::DisableHca));
        let err = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).unwrap_err();
        assert_eq!(err.step, Step::InitHca);
        assert!(matches!(err.error, Error::Cmd(crate::cmdq::CmdError::Timeout { waited_ms: 50, .. })), "{err:?}");
        dev.assert_done();
        // DISABLE_HCA completed, so firmware let go of the queue: everything, the hung slot's mailboxes included, is
        // back.
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
    }

    #[test]
    fn a_delivery_error_is_typed() {
        let dev: Dev = MockDevice::new(arena());
        dev.expect(Expect::cmd(Opcode::EnableHca).delivery_error(DeliveryStatus::Tok));
        let err = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).unwrap_err();
        assert!(matches!(err.error, Error::Cmd(crate::cmdq::CmdError::Delivery { status: DeliveryStatus::Tok, .. })));
        dev.assert_done();
        assert_eq!(dev.live_regions(), 0);
    }

    #[test]
    fn a_page_request_is_served_while_a_command_waits() {
        let dev: Dev = MockDevice::new(arena());
        // After the pages EQ exists: a command whose completion waits for 3 more pages.
        dev.expect_all(bring_up());
        dev.expect(Expect::cmd(Opcode::AllocPd).page_request(0, 3).returns("pd", 4));
        dev.expect(Expect::cmd(Opcode::ManagePages).op_mod(1).field("input_num_entries", 3));
        dev.expect(Expect::cmd(Opcode::DeallocPd).field("pd", 4));
        dev.expect_all(teardown());
        let mut hca: Hca<_, _> = Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).expect("bring-up");
        let pd = hca.alloc_pd(&mut NoDelay).expect("pd after its page request");
        assert_eq!((pd.pdn(), hca.pages_given(), hca.page_stats().requested), (4, 7, 3));
        hca.dealloc_pd(pd, &mut NoDelay).map_err(|e| e.error).expect("dealloc");
        hca.teardown(&mut NoDelay).expect("teardown");
        dev.assert_done();
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
    }

    #[test]
    fn allowed_commands_are_answered_anywhere_and_others_never_silently() {
        let dev: Dev = MockDevice::new(arena());
        dev.allow_any(Opcode::QueryPages, Reply::ok());
        dev.expect(Expect::cmd(Opcode::EnableHca)).expect(Expect::cmd(Opcode::DisableHca));
        let _ = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg());
        // QUERY_ISSI is neither next nor allowed.
        assert_eq!(text(&dev.done().unwrap_err()), "expected DISABLE_HCA, got QUERY_ISSI");
    }

    #[test]
    fn the_arena_allocator_reuses_freed_space_aligned_and_refuses_what_does_not_fit() {
        let dev: MockDevice<'static, 4, 4> = MockDevice::new(sized(5 * 4096 - 1));
        // Four whole pages at least, five never, whatever the memory's alignment.
        let a = dev.alloc(100, 64).unwrap();
        let b = dev.alloc(4096, 4096).unwrap();
        assert_eq!((a.iova(), b.iova() % 4096, b.cpu().as_ptr() as usize % 4096), (IOVA_BASE, 0, 0));
        assert_eq!(dev.iova_of(b.cpu().as_ptr(), 4096), Some(b.iova()));
        assert_eq!(dev.alloc(1, 8192).unwrap_err(), crate::hal::DmaError::BadAlignment { align: 8192 });
        // SAFETY: from this allocator, never shown to a device.
        unsafe { dev.free(a) };
        let c = dev.alloc(64, 8).unwrap();
        assert_eq!(c.iova(), IOVA_BASE, "the freed space is used again");
        assert!(dev.alloc(3 * 4096, 4096).is_err(), "no room after b");
        // SAFETY: as above.
        unsafe { dev.free(b) };
        // SAFETY: as above.
        unsafe { dev.free(c) };
        assert_eq!(dev.live_regions(), 0);
    }

    /// How a scripted command fails in the unwinding table.
    #[derive(Clone, Copy)]
    enum Fail {
        Status,
        Delivery,
    }

    /// Every bring-up command failing in turn: the step it is reported at and the commands that undo what came
    /// before (the teardown's, for what was done). Each row ends with no region, firmware page or object left.
    #[test]
    fn every_failing_bring_up_command_unwinds_everything() {
        let t = teardown();
        let (eq8, eq7, uar, tdn, take, dis) = (&t[1], &t[2], &t[3], &t[4], &t[5], &t[6]);
        let table: [(usize, Fail, Step, &[&Expect<'static>]); 16] = [
            (0, Fail::Status, Step::EnableHca, &[]),
            // Firmware refusing QUERY_ISSI with a status predates ISSI (ISSI 0): only a delivery error fails it.
            (1, Fail::Delivery, Step::SetIssi, &[dis]),
            (2, Fail::Status, Step::SetIssi, &[dis]),
            (3, Fail::Status, Step::BootPages, &[dis]),
            (4, Fail::Status, Step::BootPages, &[dis]),
            (5, Fail::Status, Step::HcaCtrl, &[take, dis]),
            (6, Fail::Status, Step::SetHcaCaps, &[take, dis]),
            (7, Fail::Status, Step::SetHcaCaps, &[take, dis]),
            (8, Fail::Status, Step::SetHcaCaps, &[take, dis]),
            (9, Fail::Status, Step::InitPages, &[take, dis]),
            (10, Fail::Status, Step::InitHca, &[take, dis]),
            (11, Fail::Status, Step::QueryCaps, &[tdn, take, dis]),
            (12, Fail::Status, Step::AllocUar, &[tdn, take, dis]),
            (13, Fail::Status, Step::CreateEq, &[uar, tdn, take, dis]),
            (14, Fail::Status, Step::CreateEq, &[eq7, uar, tdn, take, dis]),
            (15, Fail::Status, Step::CreateEq, &[eq8, eq7, uar, tdn, take, dis]),
        ];
        let mut mem = Some(arena());
        for (k, fail, step, unwind) in table {
            let dev: Dev = MockDevice::new(mem.take().unwrap());
            let script = bring_up();
            dev.expect_all(script[..k].iter().cloned());
            let failing = match fail {
                Fail::Status => script[k].clone().fails(CmdStatus::BadResState, 0xdead),
                Fail::Delivery => script[k].clone().delivery_error(DeliveryStatus::Fw),
            };
            dev.expect(failing).expect_all(unwind.iter().map(|e| (*e).clone()));
            let err = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).unwrap_err();
            assert_eq!(err.step, step, "row {k}");
            assert_eq!(err.cleanup, None, "row {k}");
            if let Err(e) = dev.done() {
                panic!("row {k} ({:?} failing): {e}", script[k].opcode());
            }
            assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0), "row {k}");
            assert!(dev.allocations() > 0);
            mem = Some(dev.release().unwrap_or_else(|_| panic!("row {k}: a region is still live")));
        }
    }

    /// CREATE_CQ (with the completion EQ its vector needs first) and DESTROY_CQ failing: what was allocated for the
    /// CQ goes back, and a refused destroy keeps the CQ (and its memory) for a later one.
    #[test]
    fn cq_create_and_destroy_failures_leak_nothing() {
        use Opcode::*;
        let dev: Dev = MockDevice::new(arena());
        dev.expect_all(bring_up());
        let mut hca: Hca<_, _> = Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).expect("bring-up");
        let base = dev.live_regions();

        // The completion EQ fails: nothing of the CQ was allocated yet.
        dev.expect(Expect::cmd(CreateEq).field("event_bitmask[0]", 0).fails(CmdStatus::BadParam, 1));
        hca.create_cq(crate::hca::CqAttr::default(), &mut NoDelay).unwrap_err();
        assert_eq!(dev.live_regions(), base);

        // CREATE_CQ fails: ring and doorbell record freed (the record page stays in the pool until teardown).
        dev.expect(Expect::cmd(CreateEq).returns("eq_number", 10));
        dev.expect(
            Expect::cmd(CreateCq)
                .field("cq_context.log_cq_size", 8)
                .field("cq_context.c_eqn_or_apu_element", 10)
                .fails(CmdStatus::BadParam, 2),
        );
        hca.create_cq(crate::hca::CqAttr::default(), &mut NoDelay).unwrap_err();
        let with_eq = dev.live_regions();

        // Created, a destroy refused, then destroyed.
        dev.expect(Expect::cmd(CreateCq).returns("cqn", 0x21));
        dev.expect(Expect::cmd(DestroyCq).field("cqn", 0x21).fails(CmdStatus::BadResState, 3));
        dev.expect(Expect::cmd(DestroyCq).field("cqn", 0x21));
        let cq = hca.create_cq(crate::hca::CqAttr::default(), &mut NoDelay).expect("cq");
        let cq = hca.destroy_cq(cq, &mut NoDelay).unwrap_err().obj;
        hca.destroy_cq(cq, &mut NoDelay).map_err(|e| e.error).expect("destroy");
        assert!(dev.live_regions() <= with_eq + 1, "only the doorbell-record page may stay, until teardown");

        dev.expect(Expect::cmd(DestroyEq).field("eq_number", 10)).expect_all(teardown());
        hca.teardown(&mut NoDelay).expect("teardown");
        dev.assert_done();
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
    }

    /// `bring_up` of a device with RC and UD QPs and SRQs. Its 2 KiB BlueFlame registers leave one to a UAR page,
    /// so the bring-up page's goes to the first QP and the next QP's create needs ALLOC_UAR first.
    fn qp_bring_up() -> [Expect<'static>; 16] {
        let mut s = bring_up();
        s[11] = Expect::cmd(Opcode::QueryHcaCap)
            .op_mod(1)
            .returns("capability.cmd_hca_cap.log_max_cq_sz", 12)
            .returns("capability.cmd_hca_cap.rc", 1)
            .returns("capability.cmd_hca_cap.ud", 1)
            .returns("capability.cmd_hca_cap.log_max_qp_sz", 10)
            .returns("capability.cmd_hca_cap.max_wqe_sz_sq", 512)
            .returns("capability.cmd_hca_cap.max_wqe_sz_rq", 512)
            .returns("capability.cmd_hca_cap.log_max_srq_sz", 10)
            .returns("capability.cmd_hca_cap.log_bf_reg_size", 11);
        s
    }

    /// The QPs the unwinding tables create: RC, UD, and RC receiving through an SRQ (an RMP at ISSI 1).
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum QpKind {
        Rc,
        Ud,
        RcOnSrq,
    }

    const PD: u64 = 4;
    const COMP_EQ: u64 = 10;
    const CQN: u64 = 0x21;
    const RMPN: u64 = 0x31;
    /// The UAR page ALLOC_UAR gives for QP registers beyond the bring-up page's.
    const QP_UAR: u64 = 5;

    type QpHca<'d> = Hca<&'d Dev, &'d Dev>;

    /// What a QP test holds besides the QPs: PD, CQ and, for [`QpKind::RcOnSrq`], the SRQ.
    struct QpSetup {
        pd: crate::hca::Pd,
        cq: crate::cq::Cq,
        srq: Option<crate::srq::Srq>,
    }

    /// Brings the HCA up and makes a PD, a CQ (and its completion EQ) and the SRQ of `kind`.
    fn qp_setup(dev: &Dev, kind: QpKind) -> (QpHca<'_>, QpSetup) {
        use Opcode::*;
        dev.expect_all(qp_bring_up());
        let mut hca: QpHca<'_> = Hca::bring_up(dev, dev, (), &mut NoDelay, cfg()).expect("bring-up");
        dev.expect(Expect::cmd(AllocPd).returns("pd", PD));
        let pd = hca.alloc_pd(&mut NoDelay).expect("pd");
        dev.expect(Expect::cmd(CreateEq).returns("eq_number", COMP_EQ));
        dev.expect(Expect::cmd(CreateCq).returns("cqn", CQN));
        let cq = hca.create_cq(crate::hca::CqAttr::default(), &mut NoDelay).expect("cq");
        let srq = (kind == QpKind::RcOnSrq).then(|| {
            dev.expect(Expect::cmd(CreateRmp).returns("rmpn", RMPN));
            let attr = crate::hca::SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 };
            hca.create_srq(&pd, attr, &mut NoDelay).expect("srq")
        });
        (hca, QpSetup { pd, cq, srq })
    }

    fn qp_attr(kind: QpKind) -> crate::hca::QpInitAttr {
        let qp_type = if kind == QpKind::Ud { crate::qp::QpType::Ud } else { crate::qp::QpType::Rc };
        let cap =
            crate::qp::QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        crate::hca::QpInitAttr { qp_type, cap, sq_sig_all: false }
    }

    fn create_qp(hca: &mut QpHca<'_>, s: &QpSetup, kind: QpKind) -> Result<crate::qp::Qp, Error> {
        match &s.srq {
            Some(srq) => hca.create_qp_with_srq(&s.pd, &s.cq, &s.cq, qp_attr(kind), srq, &mut NoDelay),
            None => hca.create_qp(&s.pd, &s.cq, &s.cq, qp_attr(kind), &mut NoDelay),
        }
    }

    /// CREATE_QP of `kind` as the core sends it: its type, PD, CQs, UAR page and SRQ.
    fn create_qp_cmd(kind: QpKind, uar: u64) -> Expect<'static> {
        use crate::prm::consts;
        let st = if kind == QpKind::Ud { consts::MLX5_QP_ST_UD } else { consts::MLX5_QP_ST_RC };
        Expect::cmd(Opcode::CreateQp)
            .field("qpc.st", st.into())
            .field("qpc.pd", PD)
            .field("qpc.cqn_snd", CQN)
            .field("qpc.cqn_rcv", CQN)
            .field("qpc.uar_page", uar)
            .field("qpc.srqn_rmpn_xrqn", if kind == QpKind::RcOnSrq { RMPN } else { 0 })
    }

    /// What a QP's create and destroy must leave as they found it: `(DMA regions, doorbell records in use, dedicated
    /// BlueFlame registers in use, UAR pages held for them, firmware pages held)`.
    fn usage(dev: &Dev, hca: &QpHca<'_>) -> (usize, usize, usize, usize, usize) {
        let (bf_used, bf_pages) = hca.bfreg_usage();
        (dev.live_regions(), hca.dbr_usage().1, bf_used, bf_pages, dev.pages_held())
    }

    /// Destroys the setup and tears down (`extra_uar`: a QP page ALLOC_UAR gave), expecting every command in
    /// order; afterwards no region or firmware page is left.
    fn qp_finish(dev: &Dev, mut hca: QpHca<'_>, s: QpSetup, extra_uar: bool) {
        use Opcode::*;
        if let Some(srq) = s.srq {
            dev.expect(Expect::cmd(DestroyRmp).field("rmpn", RMPN));
            hca.destroy_srq(srq, &mut NoDelay).map_err(|e| e.error).expect("destroy srq");
        }
        dev.expect(Expect::cmd(DestroyCq).field("cqn", CQN));
        hca.destroy_cq(s.cq, &mut NoDelay).map_err(|e| e.error).expect("destroy cq");
        dev.expect(Expect::cmd(DeallocPd).field("pd", PD));
        hca.dealloc_pd(s.pd, &mut NoDelay).map_err(|e| e.error).expect("dealloc pd");
        let t = teardown();
        dev.expect(Expect::cmd(DestroyEq).field("eq_number", COMP_EQ)).expect_all(t[..3].iter().cloned());
        if extra_uar {
            dev.expect(Expect::cmd(DeallocUar).field("uar", QP_UAR));
        }
        dev.expect_all(t[3..].iter().cloned());
        hca.teardown(&mut NoDelay).expect("teardown");
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
    }

    /// Every command a QP's create issues failing in turn, for RC, UD and a QP on an SRQ. A QP already holds the
    /// bring-up page's BlueFlame register, so the create asks for a UAR page (ALLOC_UAR) before CREATE_QP, and
    /// firmware may ask for pages while CREATE_QP runs (MANAGE_PAGES give). Each row: the error names the failing
    /// command and its syndrome (or delivery status); afterwards no DMA region, doorbell record or BlueFlame
    /// register is left but what the device may still use; the next create succeeds on what the failed one gave
    /// back; the QP's destroy and the teardown return everything.
    #[test]
    fn every_failing_qp_create_command_unwinds_everything() {
        use Opcode::*;
        let alloc_uar = || Expect::cmd(AllocUar).returns("uar", QP_UAR);
        let refused = |e: Expect<'static>, syndrome| e.fails(CmdStatus::BadParam, syndrome);
        let give = || Expect::cmd(ManagePages).op_mod(1).field("input_num_entries", 2);
        // (row, the create's commands, its error, whether the UAR page was allocated, regions and records the
        // device may still hold (kept until DISABLE_HCA), firmware pages it keeps).
        type Row = (&'static str, [Option<Expect<'static>>; 3], Option<&'static str>, bool, usize, usize);
        let table = |kind: QpKind| -> [Row; 6] {
            let qp = || create_qp_cmd(kind, QP_UAR).returns("qpn", 0x41);
            [
                // Refused: the QP shares the bring-up page's register (8-byte doorbells), as with no UAR left.
                (
                    "ALLOC_UAR refused",
                    [
                        Some(refused(Expect::cmd(AllocUar), 0xa1)),
                        Some(create_qp_cmd(kind, UAR).returns("qpn", 0x41)),
                        None,
                    ],
                    None,
                    false,
                    0,
                    0,
                ),
                (
                    "ALLOC_UAR undelivered",
                    [Some(Expect::cmd(AllocUar).delivery_error(DeliveryStatus::Fw)), None, None],
                    Some("ALLOC_UAR(0x802) delivery error FW(0x6)"),
                    false,
                    0,
                    0,
                ),
                (
                    "CREATE_QP refused",
                    [Some(alloc_uar()), Some(refused(qp(), 0xc1)), None],
                    Some("CREATE_QP(0x500) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0xc1)"),
                    true,
                    0,
                    0,
                ),
                // Firmware may have created it: the queue buffer and the record stay until DISABLE_HCA.
                (
                    "CREATE_QP undelivered",
                    [Some(alloc_uar()), Some(qp().delivery_error(DeliveryStatus::Fw)), None],
                    Some("CREATE_QP(0x500) delivery error FW(0x6)"),
                    true,
                    1,
                    0,
                ),
                // The page request refused is not the create's failure; firmware then fails CREATE_QP.
                (
                    "MANAGE_PAGES refused",
                    [Some(alloc_uar()), Some(refused(qp().page_request(0, 2), 0xc2)), Some(refused(give(), 0xe1))],
                    Some("CREATE_QP(0x500) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0xc2)"),
                    true,
                    0,
                    0,
                ),
                // Pages given are firmware's until it gives them back (at teardown here).
                (
                    "CREATE_QP refused after its pages",
                    [Some(alloc_uar()), Some(refused(qp().page_request(0, 2), 0xc3)), Some(give())],
                    Some("CREATE_QP(0x500) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0xc3)"),
                    true,
                    0,
                    2,
                ),
            ]
        };
        let mut mem = Some(arena());
        for kind in [QpKind::Rc, QpKind::Ud, QpKind::RcOnSrq] {
            for (row, script, error, paged, held, fw_pages) in table(kind) {
                let dev: Dev = MockDevice::new(mem.take().unwrap());
                let (mut hca, s) = qp_setup(&dev, kind);
                // The first QP takes the bring-up page's only register.
                dev.expect(create_qp_cmd(kind, UAR).returns("qpn", 0x40));
                let first = create_qp(&mut hca, &s, kind).expect("first qp");
                let base = usage(&dev, &hca);

                dev.expect_all(script.into_iter().flatten());
                let qp = match (create_qp(&mut hca, &s, kind), error) {
                    (Err(e), Some(want)) => {
                        assert_eq!(text(&e), want, "{kind:?}, {row}");
                        let (regions, dbr, bf, pages, fw) = base;
                        let now = usage(&dev, &hca);
                        // The queue buffer (one region here) and its doorbell record, when the device may hold them.
                        let want = (regions + held, dbr + held, bf, pages + paged as usize, fw + fw_pages);
                        assert_eq!(now, want, "{kind:?}, {row}");
                        if let Err(e) = dev.done() {
                            panic!("{kind:?}, {row}: {e}");
                        }
                        // The next create uses what this one gave back: the new page's register, no ALLOC_UAR.
                        if !paged {
                            dev.expect(alloc_uar());
                        }
                        dev.expect(create_qp_cmd(kind, QP_UAR).returns("qpn", 0x41));
                        let qp = create_qp(&mut hca, &s, kind).unwrap_or_else(|e| panic!("{kind:?}, {row}: {e}"));
                        assert!(!qp.bfreg().is_shared(), "{kind:?}, {row}");
                        qp
                    }
                    (Ok(qp), None) => {
                        assert!(qp.bfreg().is_shared(), "{kind:?}, {row}");
                        assert_eq!(hca.bfreg_usage(), (base.2, base.3), "{kind:?}, {row}");
                        qp
                    }
                    (r, _) => panic!("{kind:?}, {row}: {:?}", r.map(|q| q.qpn())),
                };
                let extra_uar = hca.bfreg_usage().1 > 1;
                dev.expect(Expect::cmd(DestroyQp).field("qpn", 0x41));
                hca.destroy_qp(qp, &mut NoDelay).map_err(|e| e.error).expect("destroy qp");
                let (regions, dbr, bf, _, fw) = base;
                assert_eq!(
                    usage(&dev, &hca),
                    (regions + held, dbr + held, bf, base.3 + extra_uar as usize, fw + fw_pages)
                );
                dev.expect(Expect::cmd(DestroyQp).field("qpn", 0x40));
                hca.destroy_qp(first, &mut NoDelay).map_err(|e| e.error).expect("destroy first qp");
                qp_finish(&dev, hca, s, extra_uar);
                if let Err(e) = dev.done() {
                    panic!("{kind:?}, {row}: {e}");
                }
                mem = Some(dev.release().unwrap_or_else(|_| panic!("{kind:?}, {row}: a region is still live")));
            }
        }
    }

    /// Each modify step (RST2INIT, INIT2RTR, RTR2RTS) and DESTROY_QP refused, for RC, UD and a QP on an SRQ. A
    /// refused modify names the command and syndrome and leaves the QP in its state, so the step can be retried. A
    /// refused destroy gives the QP back with all it holds (its buffer, doorbell record and BlueFlame register: the
    /// device may still use them), and a later destroy frees them.
    #[test]
    fn qp_modify_and_destroy_failures_keep_the_qp_and_leak_nothing() {
        use crate::qp::{required_attrs, AhAttr, QpAttr, QpState};
        use Opcode::*;
        const QPN: u64 = 0x40;
        let mut mem = Some(arena());
        for kind in [QpKind::Rc, QpKind::Ud, QpKind::RcOnSrq] {
            let dev: Dev = MockDevice::new(mem.take().unwrap());
            let (mut hca, s) = qp_setup(&dev, kind);
            let base = usage(&dev, &hca);
            dev.expect(create_qp_cmd(kind, UAR).returns("qpn", QPN));
            let mut qp = create_qp(&mut hca, &s, kind).expect("qp");
            let held = usage(&dev, &hca);
            assert_eq!((held.1, held.2), (base.1 + 1, base.2 + 1), "{kind:?}: a record and a register");

            let ty = qp_attr(kind).qp_type;
            let attr =
                QpAttr { dest_qp_num: 0x99, ah_attr: AhAttr { dlid: 2, ..AhAttr::default() }, ..QpAttr::default() };
            let steps = [
                (QpState::Reset, QpState::Init, Rst2initQp, "RST2INIT_QP(0x502)", 0x51),
                (QpState::Init, QpState::Rtr, Init2rtrQp, "INIT2RTR_QP(0x503)", 0x52),
                (QpState::Rtr, QpState::Rts, Rtr2rtsQp, "RTR2RTS_QP(0x504)", 0x53),
            ];
            for (from, to, op, name, syndrome) in steps {
                let mask = required_attrs(ty, from, to).expect("a transition of the table");
                let a = QpAttr { qp_state: to, ..attr };
                dev.expect(Expect::cmd(op).field("qpn", QPN).fails(CmdStatus::BadResState, syndrome));
                let e = hca.modify_qp(&mut qp, &a, mask, &mut NoDelay).unwrap_err();
                let mut want: heapless::String<96> = heapless::String::new();
                let _ = write!(want, "{name} op_mod(0x0) failed, status BAD_RES_STATE(0x9), syndrome ({syndrome:#x})");
                assert_eq!(text(&e), want.as_str(), "{kind:?}");
                assert_eq!((qp.state(), usage(&dev, &hca)), (from, held), "{kind:?}: {name} refused");
                dev.expect(Expect::cmd(op).field("qpn", QPN));
                hca.modify_qp(&mut qp, &a, mask, &mut NoDelay).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
                assert_eq!(qp.state(), to, "{kind:?}");
            }

            dev.expect(Expect::cmd(DestroyQp).field("qpn", QPN).fails(CmdStatus::BadResState, 0x5f));
            let refused = hca.destroy_qp(qp, &mut NoDelay).unwrap_err();
            assert_eq!(
                text(&refused.error),
                "DESTROY_QP(0x501) op_mod(0x0) failed, status BAD_RES_STATE(0x9), syndrome (0x5f)",
                "{kind:?}"
            );
            let qp = refused.obj;
            assert_eq!((qp.qpn(), qp.state(), usage(&dev, &hca)), (QPN as u32, QpState::Rts, held), "{kind:?}");
            dev.expect(Expect::cmd(DestroyQp).field("qpn", QPN));
            hca.destroy_qp(qp, &mut NoDelay).map_err(|e| e.error).expect("destroy qp");
            assert_eq!(usage(&dev, &hca), base, "{kind:?}: all the QP held is back");
            qp_finish(&dev, hca, s, false);
            if let Err(e) = dev.done() {
                panic!("{kind:?}: {e}");
            }
            mem = Some(dev.release().unwrap_or_else(|_| panic!("{kind:?}: a region is still live")));
        }
    }

    /// Whether `e` is the allocator's `NoMemory`, directly (`doorbell_page`: false) or through the doorbell-record
    /// pool's new page (true).
    fn no_memory(e: &Error, doorbell_page: bool) -> bool {
        use crate::dbr::DbrError;
        use crate::hal::DmaError;
        match e {
            Error::Dma(DmaError::NoMemory { .. }) => !doorbell_page,
            Error::Dbr(DbrError::Dma(DmaError::NoMemory { .. })) => doorbell_page,
            _ => false,
        }
    }

    /// Every allocation of a CQ's create failing in turn: the completion EQ's buffer on first use, then the ring
    /// and the doorbell-record page. Each fails with the allocator's error before any command is sent (the script
    /// would name it), and what was allocated before it goes back.
    #[test]
    fn every_failing_cq_allocation_frees_what_came_before() {
        use crate::hca::CqAttr;
        use Opcode::*;
        let dev: Dev = MockDevice::new(arena());
        dev.expect_all(bring_up());
        let mut hca: Hca<_, _> = Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).expect("bring-up");
        let base = (dev.live_regions(), hca.dbr_usage());
        assert_eq!(base.1, (0, 0));

        dev.limit_allocations(Some(0));
        let e = hca.create_cq(CqAttr::default(), &mut NoDelay).unwrap_err();
        assert!(no_memory(&e, false), "the EQ's buffer: {e:?}");
        assert_eq!(((dev.live_regions(), hca.dbr_usage()), hca.comp_eq()), (base, None));
        dev.limit_allocations(None);

        // A CQ made and destroyed: its EQ stays, the record page goes back with its last record, and the command
        // queue has the mailboxes CREATE_CQ needs, so only the CQ's own memory is allocated below.
        dev.expect(Expect::cmd(CreateEq).returns("eq_number", COMP_EQ));
        dev.expect(Expect::cmd(CreateCq).returns("cqn", CQN)).expect(Expect::cmd(DestroyCq).field("cqn", CQN));
        let cq = hca.create_cq(CqAttr::default(), &mut NoDelay).expect("cq");
        hca.destroy_cq(cq, &mut NoDelay).map_err(|e| e.error).expect("destroy cq");
        let base = (dev.live_regions(), hca.dbr_usage());
        assert_eq!(base.1, (0, 0));

        dev.expect(Expect::cmd(CreateCq).returns("cqn", CQN));
        let mut k = 0;
        let cq = loop {
            dev.limit_allocations(Some(k));
            match hca.create_cq(CqAttr::default(), &mut NoDelay) {
                Ok(cq) => break cq,
                Err(e) => {
                    assert!(no_memory(&e, k == 1), "allocation {k}: {e:?}");
                    assert_eq!((dev.live_regions(), hca.dbr_usage()), base, "allocation {k}");
                }
            }
            k += 1;
        };
        assert_eq!(k, 2, "the ring, then the record page");
        dev.limit_allocations(None);
        dev.expect(Expect::cmd(DestroyCq).field("cqn", CQN));
        hca.destroy_cq(cq, &mut NoDelay).map_err(|e| e.error).expect("destroy cq");
        assert_eq!((dev.live_regions(), hca.dbr_usage()), base);
        dev.expect(Expect::cmd(DestroyEq).field("eq_number", COMP_EQ)).expect_all(teardown());
        hca.teardown(&mut NoDelay).expect("teardown");
        dev.assert_done();
        assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0));
    }

    /// Every allocation of a QP's create failing in turn, for RC, UD and a QP on an SRQ: the ring, the shadow array
    /// and a new doorbell-record page (the page in use is filled first, so the QP's record needs one). Each fails
    /// with the allocator's error before CREATE_QP, gives back what came before and the BlueFlame register.
    #[test]
    fn every_failing_qp_allocation_frees_what_came_before() {
        use crate::dbr::DbRec;
        const QPN: u64 = 0x40;
        let mut mem = Some(arena());
        for kind in [QpKind::Rc, QpKind::Ud, QpKind::RcOnSrq] {
            let dev: Dev = MockDevice::new(mem.take().unwrap());
            let (mut hca, s) = qp_setup(&dev, kind);
            let mut fill: heapless::Vec<DbRec, 64> = heapless::Vec::new();
            while hca.dbr_usage().1 < 64 {
                assert!(fill.push(hca.dbr.alloc(&dev).expect("a record")).is_ok());
            }
            assert_eq!(hca.dbr_usage(), (1, 64), "{kind:?}: one page, full");
            let base = usage(&dev, &hca);

            dev.expect(create_qp_cmd(kind, UAR).returns("qpn", QPN));
            let mut k = 0;
            let qp = loop {
                dev.limit_allocations(Some(k));
                match create_qp(&mut hca, &s, kind) {
                    Ok(qp) => break qp,
                    Err(e) => {
                        assert!(no_memory(&e, k == 2), "{kind:?}, allocation {k}: {e:?}");
                        assert_eq!(usage(&dev, &hca), base, "{kind:?}, allocation {k}");
                    }
                }
                k += 1;
            };
            assert_eq!(k, 3, "{kind:?}: the ring, the shadow array, then the record page");
            dev.limit_allocations(None);
            assert!(!qp.bfreg().is_shared(), "{kind:?}: the register given back is taken again");
            dev.expect(Expect::cmd(Opcode::DestroyQp).field("qpn", QPN));
            hca.destroy_qp(qp, &mut NoDelay).map_err(|e| e.error).expect("destroy qp");
            assert_eq!(usage(&dev, &hca), base, "{kind:?}");
            for r in fill {
                // SAFETY: records of this pool, never given to the device.
                unsafe { hca.dbr.free(&dev, r) }.expect("a record of the pool");
            }
            qp_finish(&dev, hca, s, false);
            if let Err(e) = dev.done() {
                panic!("{kind:?}: {e}");
            }
            mem = Some(dev.release().unwrap_or_else(|_| panic!("{kind:?}: a region is still live")));
        }
    }

    /// An SRQ's create failing at each allocation (the ring, the shadow array, the first doorbell-record page)
    /// and at its command, CREATE_RMP at ISSI 1 and CREATE_SRQ at ISSI 0. Refused, everything is back. Undelivered,
    /// firmware may have made it: the ring and the record stay until DISABLE_HCA and only the host's shadow array
    /// goes back; teardown returns the rest.
    #[test]
    fn srq_create_failures_free_what_the_device_cannot_hold() {
        use Opcode::*;
        let mut mem = Some(arena());
        for issi in [1, 0] {
            let dev: Dev = MockDevice::new(mem.take().unwrap());
            // At ISSI 0 firmware offers only ISSI 0, and SET_ISSI is not sent.
            let script = qp_bring_up().into_iter().enumerate().filter_map(|(i, e)| match (issi, i) {
                (0, 1) => Some(Expect::cmd(QueryIssi).returns("supported_issi_dw0", 0b01)),
                (0, 2) => None,
                _ => Some(e),
            });
            dev.expect_all(script);
            let mut hca: QpHca<'_> = Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg()).expect("bring-up");
            assert_eq!(hca.issi(), issi);
            dev.expect(Expect::cmd(AllocPd).returns("pd", PD));
            let pd = hca.alloc_pd(&mut NoDelay).expect("pd");
            let attr = crate::hca::SrqAttr { max_wr: 16, max_sge: 1, srq_limit: 0 };
            let now = |hca: &QpHca<'_>| (dev.live_regions(), hca.dbr_usage());
            let base = now(&hca);
            assert_eq!(base.1, (0, 0));

            for k in 0..3 {
                dev.limit_allocations(Some(k));
                let e = hca.create_srq(&pd, attr, &mut NoDelay).unwrap_err();
                assert!(no_memory(&e, k == 2), "ISSI {issi}, allocation {k}: {e:?}");
                assert_eq!(now(&hca), base, "ISSI {issi}, allocation {k}");
            }
            dev.limit_allocations(None);

            let (create, name, destroy, field) = match issi {
                1 => (CreateRmp, "CREATE_RMP(0x90c)", DestroyRmp, "rmpn"),
                _ => (CreateSrq, "CREATE_SRQ(0x700)", DestroySrq, "srqn"),
            };
            let mut want: heapless::String<96> = heapless::String::new();
            dev.expect(Expect::cmd(create).fails(CmdStatus::BadParam, 0xd1));
            let e = hca.create_srq(&pd, attr, &mut NoDelay).unwrap_err();
            let _ = write!(want, "{name} op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0xd1)");
            assert_eq!(text(&e), want.as_str());
            assert_eq!(now(&hca), base, "ISSI {issi}, refused: all back");

            dev.expect(Expect::cmd(create).delivery_error(DeliveryStatus::Fw));
            let e = hca.create_srq(&pd, attr, &mut NoDelay).unwrap_err();
            want.clear();
            let _ = write!(want, "{name} delivery error FW(0x6)");
            assert_eq!(text(&e), want.as_str());
            let kept = (base.0 + 2, (1, 1));
            assert_eq!(now(&hca), kept, "ISSI {issi}, undelivered: the ring (one region) and the record stay");

            dev.expect(Expect::cmd(create).returns(field, RMPN)).expect(Expect::cmd(destroy).field(field, RMPN));
            let srq = hca.create_srq(&pd, attr, &mut NoDelay).expect("srq");
            hca.destroy_srq(srq, &mut NoDelay).map_err(|e| e.error).expect("destroy srq");
            assert_eq!(now(&hca), kept, "ISSI {issi}");
            dev.expect(Expect::cmd(DeallocPd).field("pd", PD)).expect_all(teardown());
            hca.dealloc_pd(pd, &mut NoDelay).map_err(|e| e.error).expect("dealloc pd");
            hca.teardown(&mut NoDelay).expect("teardown");
            if let Err(e) = dev.done() {
                panic!("ISSI {issi}: {e}");
            }
            assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0), "ISSI {issi}");
            mem = Some(dev.release().unwrap_or_else(|_| panic!("ISSI {issi}: a region is still live")));
        }
    }

    /// MAD_IFC's input as mlx5_ib builds it: opcode 0x50d, `op_mod` 3 (both keys ignored), port 1 and a
    /// directed-route Set(PortInfo) from byte 16.
    static MAD_IFC_IN: [u8; crate::prm::ifc::mad_ifc_in::SIZE_BYTES] = {
        let mut b = [0u8; crate::prm::ifc::mad_ifc_in::SIZE_BYTES];
        b[0] = 0x05;
        b[1] = 0x0d;
        b[7] = 3;
        b[11] = 1;
        let m = 16;
        b[m] = 1;
        b[m + 1] = 0x81;
        b[m + 2] = 1;
        b[m + 3] = 0x02;
        b[m + 17] = 0x15;
        b
    };

    /// MAD_IFC's response: a directed-route GetResp(PortInfo) with status "invalid field" and the direction bit.
    static MAD_IFC_OUT: [u8; crate::prm::ifc::mad_ifc_out::SIZE_BYTES] = {
        let mut b = [0u8; crate::prm::ifc::mad_ifc_out::SIZE_BYTES];
        let m = 16;
        b[m] = 1;
        b[m + 1] = 0x81;
        b[m + 2] = 1;
        b[m + 3] = 0x81;
        b[m + 4] = 0x80;
        b[m + 5] = 0x1c;
        b[m + 17] = 0x15;
        b
    };

    /// The SMI QP (QP0) as mlx5_ib makes it for `ib_mad`: CREATE_QP with `st` QP0, then RST2INIT, INIT2RTR and
    /// RTR2RTS each with MTU 256, 256-byte messages and no optional-parameter bit (`opt_mask` has no QP0 column);
    /// MAD_IFC carries the MAD and the port and its reply is the response MAD with the agent's status, while a
    /// refused MAD_IFC is the command's error by name and syndrome.
    #[test]
    fn the_smi_qp_and_mad_ifc_go_out_as_mlx5_ib_sends_them() {
        use crate::mad_ifc::{MadIfcFlags, MadStatusCode, MAD_LEN};
        use crate::prm::consts;
        use crate::qp::{required_attrs, QpAttr, QpState, QpType};
        use Opcode::*;
        const QPN: u64 = 0x48;
        let dev: Dev = MockDevice::new(arena());
        let (mut hca, s) = qp_setup(&dev, QpKind::Ud);
        let base = usage(&dev, &hca);
        let special = |e: Expect<'static>| {
            e.field("qpn", QPN)
                .field("opt_param_mask", 0)
                .field("qpc.st", consts::MLX5_QP_ST_QP0.into())
                .field("qpc.mtu", consts::IB_MTU_256.into())
                .field("qpc.log_msg_max", 8)
        };
        dev.expect(
            Expect::cmd(CreateQp)
                .field("qpc.st", consts::MLX5_QP_ST_QP0.into())
                .field("qpc.pd", PD)
                .field("qpc.cqn_snd", CQN)
                .returns("qpn", QPN),
        );
        let attr = crate::hca::QpInitAttr { qp_type: QpType::Smi, ..qp_attr(QpKind::Ud) };
        let mut qp = hca.create_qp(&s.pd, &s.cq, &s.cq, attr, &mut NoDelay).expect("qp0");
        assert_eq!(qp.qp_type(), QpType::Smi);
        dev.expect(special(Expect::cmd(Rst2initQp)).field("qpc.primary_address_path.vhca_port_num", 1));
        dev.expect(special(Expect::cmd(Init2rtrQp)));
        dev.expect(special(Expect::cmd(Rtr2rtsQp)));
        let a = QpAttr { port_num: 1, qkey: 0, ..QpAttr::default() };
        for (from, to) in [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)]
        {
            let mask = required_attrs(QpType::Smi, from, to).expect("a transition of the table");
            hca.modify_qp(&mut qp, &QpAttr { qp_state: to, ..a }, mask, &mut NoDelay).expect("modify qp0");
        }

        let mut mad = [0u8; MAD_LEN];
        mad[..4].copy_from_slice(&[1, 0x81, 1, 0x02]);
        mad[17] = 0x15;
        dev.expect(
            Expect::cmd(MadIfc).op_mod(3).field("port", 1).input(&MAD_IFC_IN).reply(Reply::ok().output(&MAD_IFC_OUT)),
        );
        let r = hca.mad_ifc(1, MadIfcFlags::LOCAL, &mad, &mut NoDelay).expect("the command completes");
        assert_eq!((r.method(), r.status().code(), r.status().0 & 0x8000), (0x81, MadStatusCode::InvalidField, 0x8000));
        assert_eq!(r.mad[17], 0x15);
        dev.expect(Expect::cmd(MadIfc).op_mod(0).field("port", 2).fails(CmdStatus::BadParam, 0x3c));
        let e = hca.mad_ifc(2, MadIfcFlags::default(), &mad, &mut NoDelay).unwrap_err();
        assert_eq!(text(&e), "MAD_IFC(0x50d) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0x3c)");

        dev.expect(Expect::cmd(DestroyQp).field("qpn", QPN));
        hca.destroy_qp(qp, &mut NoDelay).map_err(|e| e.error).expect("destroy qp0");
        assert_eq!(usage(&dev, &hca), base);
        qp_finish(&dev, hca, s, false);
        dev.assert_done();
    }
}

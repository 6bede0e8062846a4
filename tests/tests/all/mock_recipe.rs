//! The README's recipe, "Unit-testing firmware commands on mocks": a firmware author's own bring-up (the core's
//! `Hca::bring_up`, one CQ, its destroy and the teardown) tested against an expectation mock, passing, and each
//! kind of mistake the mock catches with its exact message.

use mlx5_core::hal::DelayNs;
use mlx5_core::hca::{Config, CqAttr, Error, Hca};
use mlx5_core::mock::{Expect, MockConfig, MockDevice};
use mlx5_core::prm::{CmdStatus, Opcode::*};

/// The firmware's delay; the mock answers at the doorbell, so nothing needs to wait.
struct NoDelay;
impl DelayNs for NoDelay {
    fn delay_ns(&mut self, _ns: u32) {}
}

/// The code under test: bring the function up, make a CQ of `cqe` entries, destroy it, tear down.
fn firmware_main(dev: &MockDevice<'static>, cqe: u32, destroy: bool) -> Result<u32, Error> {
    let cfg = Config { async_eq_nent: 64, ..Config::default() };
    let mut hca: Hca<_, _> = Hca::bring_up(dev, dev, (), &mut NoDelay, cfg).map_err(|e| e.error)?;
    let cq = hca.create_cq(CqAttr { cqe, ..CqAttr::default() }, &mut NoDelay)?;
    let cqn = cq.cqn();
    if destroy {
        hca.destroy_cq(cq, &mut NoDelay).map_err(|e| e.error)?;
    }
    hca.teardown(&mut NoDelay)?;
    Ok(cqn)
}

/// A 1 MiB arena for the mock's DMA memory (a `static` buffer on the chip).
fn arena() -> &'static mut [u8] {
    Box::leak(vec![0u8; 1 << 20].into_boxed_slice())
}

/// What the core's bring-up sends to a small InfiniBand device, with the replies that make it one.
fn bring_up() -> Vec<Expect<'static>> {
    vec![
        Expect::cmd(EnableHca),
        Expect::cmd(QueryIssi).returns("supported_issi_dw0", 0b10),
        Expect::cmd(SetIssi).field("current_issi", 1),
        Expect::cmd(QueryPages).op_mod(1).returns("num_pages", 4),
        Expect::cmd(ManagePages).op_mod(1).field("input_num_entries", 4),
        Expect::cmd(AccessReg),
        Expect::cmd(QueryHcaCap).op_mod(0),
        Expect::cmd(QueryHcaCap).op_mod(1),
        Expect::cmd(SetHcaCap),
        Expect::cmd(QueryPages).op_mod(2),
        Expect::cmd(InitHca),
        Expect::cmd(QueryHcaCap).op_mod(1).returns("capability.cmd_hca_cap.log_max_cq_sz", 16),
        Expect::cmd(AllocUar).returns("uar", 3),
        Expect::cmd(CreateEq).returns("eq_number", 7),
        Expect::cmd(CreateEq).returns("eq_number", 8),
        Expect::cmd(CreateEq).returns("eq_number", 9),
    ]
}

/// The CQ: its completion EQ on first use, then CREATE_CQ of 1,024 entries on it.
fn create_cq() -> Vec<Expect<'static>> {
    vec![
        Expect::cmd(CreateEq).field("event_bitmask[0]", 0).returns("eq_number", 10),
        Expect::cmd(CreateCq)
            .field("cq_context.log_cq_size", 10)
            .field("cq_context.c_eqn_or_apu_element", 10)
            .returns("cqn", 0x40),
    ]
}

fn teardown() -> Vec<Expect<'static>> {
    [10, 9, 8, 7]
        .map(|eqn| Expect::cmd(DestroyEq).field("eq_number", eqn))
        .into_iter()
        .chain([
            Expect::cmd(DeallocUar).field("uar", 3),
            Expect::cmd(TeardownHca),
            Expect::cmd(ManagePages).op_mod(2).gives_back_pages(),
            Expect::cmd(DisableHca),
        ])
        .collect()
}

fn script(dev: &MockDevice<'static>) {
    dev.expect_all(bring_up()).expect_all(create_cq());
    dev.expect(Expect::cmd(DestroyCq).field("cqn", 0x40)).expect_all(teardown());
}

#[test]
fn mock_recipe_the_bring_up_passes() {
    let dev = MockDevice::new(arena());
    script(&dev);
    assert_eq!(firmware_main(&dev, 1023, true).unwrap(), 0x40);
    dev.assert_done();
    assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0), "every DMA region and firmware page came back");
}

#[test]
fn mock_recipe_catches_a_wrong_field() {
    let dev = MockDevice::new(arena());
    script(&dev);
    // 2,047 entries round up to 2,048: log_cq_size 11.
    firmware_main(&dev, 2047, true).unwrap();
    assert_eq!(dev.done().unwrap_err().to_string(), "CREATE_CQ: cq_context.log_cq_size expected 10, got 11");
}

#[test]
fn mock_recipe_catches_a_missing_command() {
    let dev = MockDevice::new(arena());
    script(&dev);
    // The CQ is never destroyed: teardown's first DESTROY_EQ comes where DESTROY_CQ was expected.
    let _ = firmware_main(&dev, 1023, false);
    assert_eq!(dev.done().unwrap_err().to_string(), "expected DESTROY_CQ, got DESTROY_EQ");
}

#[test]
fn mock_recipe_catches_an_unhandled_syndrome() {
    let dev = MockDevice::new(arena());
    dev.expect_all(bring_up()).expect(create_cq()[0].clone());
    dev.expect(Expect::cmd(CreateCq).fails(CmdStatus::BadParam, 0x1234)).expect_all(teardown());
    // The firmware returns the error without tearing the HCA down: the error names the command and syndrome,
    // and the mock the teardown that never came.
    let e = firmware_main(&dev, 1023, true).unwrap_err();
    assert_eq!(e.to_string(), "CREATE_CQ(0x400) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0x1234)");
    assert_eq!(
        dev.done().unwrap_err().to_string(),
        "8 expectations left: DESTROY_EQ, DESTROY_EQ, DESTROY_EQ, DESTROY_EQ, DEALLOC_UAR, TEARDOWN_HCA, MANAGE_PAGES, DISABLE_HCA"
    );
}

#[test]
fn mock_recipe_catches_a_command_timeout() {
    let dev = MockDevice::with_config(MockConfig { cmd_timeout_ms: 100, ..MockConfig::default() }, arena());
    dev.expect_all(bring_up()).expect(create_cq()[0].clone());
    dev.expect(Expect::cmd(CreateCq).times_out());
    let e = firmware_main(&dev, 1023, true).unwrap_err();
    assert_eq!(e.to_string(), "CREATE_CQ(0x400) timed out after 100 ms");
    dev.assert_done();
}

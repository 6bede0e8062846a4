//! Bring-up under injected faults: every fault at every bring-up step ends in a typed error naming the step, and
//! the cleanup the bring-up runs on failure returns every DMA allocation. When firmware is alive it also gets
//! every page back and the function ends disabled; when it is dead or gone the pages it held are abandoned (freed
//! without its cooperation, never under a live device). A device that fails after bring-up moves the HCA to
//! internal error, where nothing reaches the device and teardown finishes locally. Page requests that arrive
//! while a command waits on slot 0 are served on the last slot.
//!
//! Everything runs in in-line mode (virtual time: a 60 s command timeout or a 120 s pre-init wait costs nothing)
//! except the page-request case, which also runs threaded.

use mlx5_core::cmdq::CmdError;
use mlx5_core::hal::Mmio;
use mlx5_core::hca::{BringupError, Config, Error, Hca, HcaState as CoreState, Step, FW_PRE_INIT_TIMEOUT_MS};
use mlx5_core::health::HealthFailure;
use mlx5_core::init::QueryIssi;
use mlx5_core::pd::{alloc_pd, dealloc_pd};
use mlx5_core::prm::{c, consts, CmdStatus, HealthSyndrome, Opcode};
use mlx5_sim::testkit::SimHca;
use mlx5_sim::{syndrome, ExecutedCmd, Fault, HcaState as SimState, Health, Mode, SimConfig, SimDevice, SimEvent};

/// Linux's default command timeout, which the simulator's default `cmd_exec_to` does not change.
const CMD_TIMEOUT_MS: u32 = 60_000;
const SYNDROME: u32 = 0x1234_5678;
/// Pages the default simulated device asks for at boot, at init and (through the EQ) after INIT_HCA.
const BOOT_PAGES: usize = 8;
const INIT_PAGES: usize = 16;
const REGULAR_PAGES: usize = 4;
/// The command slot reserved for MANAGE_PAGES (32 slots).
const PAGES_SLOT: u8 = 31;

/// Every opcode the bring-up sends, with the step that sends it first and the pages firmware holds by then.
const STEPS: &[(u16, Step, usize)] = &[
    (consts::MLX5_CMD_OP_ENABLE_HCA, Step::EnableHca, 0),
    (consts::MLX5_CMD_OP_QUERY_ISSI, Step::SetIssi, 0),
    (consts::MLX5_CMD_OP_SET_ISSI, Step::SetIssi, 0),
    (consts::MLX5_CMD_OP_QUERY_PAGES, Step::BootPages, 0),
    (consts::MLX5_CMD_OP_MANAGE_PAGES, Step::BootPages, 0),
    (consts::MLX5_CMD_OP_ACCESS_REG, Step::HcaCtrl, BOOT_PAGES),
    (consts::MLX5_CMD_OP_QUERY_HCA_CAP, Step::SetHcaCaps, BOOT_PAGES),
    (consts::MLX5_CMD_OP_SET_HCA_CAP, Step::SetHcaCaps, BOOT_PAGES),
    (consts::MLX5_CMD_OP_INIT_HCA, Step::InitHca, BOOT_PAGES + INIT_PAGES),
    (consts::MLX5_CMD_OP_SET_DRIVER_VERSION, Step::DriverVersion, BOOT_PAGES + INIT_PAGES),
    (consts::MLX5_CMD_OP_ALLOC_UAR, Step::AllocUar, BOOT_PAGES + INIT_PAGES),
    (consts::MLX5_CMD_OP_CREATE_EQ, Step::CreateEq, BOOT_PAGES + INIT_PAGES),
];

/// Refusals Linux carries on after: QUERY_ISSI (firmware before ISSI: ISSI 0) and SET_DRIVER_VERSION
/// (informational). Their timeouts still fail the bring-up.
const TOLERATED: &[u16] = &[consts::MLX5_CMD_OP_QUERY_ISSI, consts::MLX5_CMD_OP_SET_DRIVER_VERSION];

/// The statuses each step is failed with.
const STATUSES: &[u8] = &[
    consts::MLX5_CMD_STAT_BAD_PARAM_ERR,
    consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR,
    consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR,
    consts::MLX5_CMD_STAT_NO_RES_ERR,
    consts::MLX5_CMD_STAT_BAD_OP_ERR,
    consts::MLX5_CMD_STAT_INT_ERR,
];

fn name(op: u16) -> &'static str {
    Opcode::from_raw(op).name().unwrap_or("UNKNOWN")
}

fn bring_up(dev: &SimDevice) -> Result<SimHca, BringupError> {
    Hca::bring_up(dev.mmio(), dev.dma(), (), &mut dev.delay(), Config::default())
}

/// Runs a bring-up that must fail.
fn bring_up_err(dev: &SimDevice, case: &str) -> BringupError {
    match bring_up(dev) {
        Ok(hca) => panic!("{case}: bring-up succeeded (state {:?})", hca.state()),
        Err(e) => e,
    }
}

fn freed_device_owned(dev: &SimDevice) -> Vec<SimEvent> {
    dev.events().into_iter().filter(|e| matches!(e, SimEvent::FreedDeviceOwned { .. })).collect()
}

fn bad_frees(dev: &SimDevice) -> Vec<SimEvent> {
    dev.events().into_iter().filter(|e| matches!(e, SimEvent::BadFree { .. })).collect()
}

/// (b): every DMA allocation went back, none while firmware owned pages in it, none twice, and the device never
/// touched memory that was not live.
fn assert_no_leak(dev: &SimDevice, case: &str) {
    assert_eq!(dev.dma_outstanding(), (0, 0), "{case}: DMA regions still allocated");
    assert_eq!(freed_device_owned(dev), [], "{case}: memory freed while firmware owned pages in it");
    assert_eq!(bad_frees(dev), [], "{case}: bad frees");
    assert_eq!(dev.dma_faults(), [], "{case}: device DMA faults");
}

/// (c): a live firmware got every page back and the function ended disabled.
fn assert_alive_clean(dev: &SimDevice, case: &str) {
    assert_eq!(dev.health(), Health::Ok, "{case}: firmware should still be alive");
    assert_eq!(dev.pages_owned(), 0, "{case}: pages left with firmware");
    assert_eq!(dev.pages_abandoned(), 0, "{case}: pages abandoned on a live firmware");
    assert_eq!(dev.hca_state(), SimState::Disabled, "{case}: function not disabled");
}

/// (d): a dead or vanished firmware kept `held` pages, which the driver freed as abandoned (never under a live
/// device).
fn assert_dead_clean(dev: &SimDevice, case: &str, held: usize) {
    assert_ne!(dev.health(), Health::Ok, "{case}: firmware should be dead or gone");
    assert_eq!(dev.pages_abandoned(), held, "{case}: pages abandoned");
    assert_eq!(dev.pages_owned(), 0, "{case}: pages firmware still owns");
    assert_eq!(freed_device_owned(dev), [], "{case}: memory freed under the device");
}

fn executed_since(dev: &SimDevice, n: usize) -> Vec<ExecutedCmd> {
    dev.executed()[n..].to_vec()
}

fn ops(cmds: &[ExecutedCmd]) -> Vec<Opcode> {
    cmds.iter().map(|c| Opcode::from_raw(c.opcode)).collect()
}

/// The first error the cleanup met: none, except where the hung opcode is one the cleanup itself needs.
fn expect_hang_cleanup(op: u16) -> Option<Error> {
    (op == consts::MLX5_CMD_OP_MANAGE_PAGES)
        .then_some(Error::Cmd(CmdError::Timeout { opcode: Opcode::ManagePages, waited_ms: CMD_TIMEOUT_MS }))
}

/// Case 1: a command that never completes, at every step: a typed timeout at that step, and the cleanup finishes on
/// the slots that are still free.
#[test]
fn timeout_at_each_step() {
    for &(op, step, _) in STEPS {
        timeout_case(op, step);
    }
}

fn timeout_case(op: u16, step: Step) {
    let case = format!("hang on {}", name(op));
    let dev = SimDevice::default();
    dev.inject(Fault::Hang { opcode: op });
    let err = bring_up_err(&dev, &case);
    let opcode = Opcode::from_raw(op);
    assert_eq!(err.step, step, "{case}: step");
    assert_eq!(err.error, Error::Cmd(CmdError::Timeout { opcode, waited_ms: CMD_TIMEOUT_MS }), "{case}: error");
    assert_eq!(err.cleanup, expect_hang_cleanup(op), "{case}: cleanup");
    let hung_slot = if op == consts::MLX5_CMD_OP_MANAGE_PAGES { PAGES_SLOT } else { 0 };
    assert!(
        dev.events().contains(&SimEvent::Hung { slot: hung_slot, opcode: op }),
        "{case}: the command hung on slot {hung_slot}"
    );
    assert_eq!(dev.health(), Health::Ok, "{case}: firmware stays alive");
    // (b): the hung slot is released once the function is disabled (or given up on), so nothing leaks.
    assert_no_leak(&dev, &case);

    let executed = dev.executed();
    let disabled_on = executed.iter().find(|c| c.opcode == Opcode::DisableHca.raw()).map(|c| c.slot);
    match op {
        consts::MLX5_CMD_OP_ENABLE_HCA => {
            // Nothing was enabled, so there was nothing to undo.
            assert_eq!(disabled_on, None, "{case}: DISABLE_HCA without ENABLE_HCA");
            assert_alive_clean(&dev, &case);
        }
        consts::MLX5_CMD_OP_MANAGE_PAGES => {
            // The boot MANAGE_PAGES(give) hung on the pages slot, so the driver counts the 8 pages as given
            // (firmware never answered, so it might hold them). The cleanup's MANAGE_PAGES(take) went to slot 0
            // (the pages slot is still held) and hung as well; reclaiming stops there and DISABLE_HCA, on slot 1,
            // resets the function, after which the driver frees the pages as abandoned.
            assert!(
                dev.events().contains(&SimEvent::Hung { slot: 0, opcode: op }),
                "{case}: the cleanup's take hung on slot 0"
            );
            assert_eq!(disabled_on, Some(1), "{case}: DISABLE_HCA went to the next free slot");
            assert_eq!(dev.pages_owned(), 0, "{case}: firmware never executed the give");
            assert_eq!(dev.hca_state(), SimState::Disabled, "{case}: the function was disabled");
            assert!(!executed.iter().any(|c| c.opcode == op), "{case}: no MANAGE_PAGES completed");
        }
        _ => {
            // Slot 0 stays with firmware; the cleanup ran on slot 1 (pages still on the pages slot).
            assert_eq!(disabled_on, Some(1), "{case}: DISABLE_HCA went to the next free slot");
            assert_alive_clean(&dev, &case);
            let first = executed.iter().position(|c| c.slot == 1).unwrap();
            for c in &executed[first..] {
                let want = if c.opcode == Opcode::ManagePages.raw() { PAGES_SLOT } else { 1 };
                assert_eq!(c.slot, want, "{case}: cleanup command {:?}", Opcode::from_raw(c.opcode));
            }
            assert_eq!(executed.last().map(|c| c.opcode), Some(Opcode::DisableHca.raw()), "{case}: last");
        }
    }
}

/// Case 2: each error status at each step: the status and syndrome come back unchanged, named as the kernel prints
/// them, and the cleanup is complete.
#[test]
fn error_status_at_each_step() {
    for &(op, step, _) in STEPS {
        if TOLERATED.contains(&op) {
            continue;
        }
        for &st in STATUSES {
            let status = CmdStatus::from_raw(st);
            let case = format!("{} failing with {status:?}", name(op));
            let dev = SimDevice::default();
            dev.inject(Fault::Status { opcode: op, status: st, syndrome: SYNDROME, times: 1 });
            let err = bring_up_err(&dev, &case);
            let opcode = Opcode::from_raw(op);
            assert_eq!(err.step, step, "{case}: step");
            let Error::Cmd(CmdError::Status { opcode: got_op, op_mod, status: got_st, syndrome: got_syn }) = err.error
            else {
                panic!("{case}: expected a command status error, got {:?}", err.error);
            };
            assert_eq!((got_op, got_st, got_syn), (opcode, status, SYNDROME), "{case}: error");
            assert_eq!(err.cleanup, None, "{case}: cleanup");
            // The failed command is in firmware's record with the same status, syndrome and op_mod.
            let failed: Vec<ExecutedCmd> = dev.executed().into_iter().filter(|c| c.status != 0).collect();
            assert_eq!(failed.len(), 1, "{case}: exactly one command failed: {failed:?}");
            assert_eq!(
                (failed[0].opcode, failed[0].op_mod, failed[0].status, failed[0].syndrome),
                (op, op_mod, st, SYNDROME),
                "{case}: firmware's record"
            );
            // Kernel wording (`mlx5_cmd_out_err`), after the step.
            let text = err.to_string();
            let want = format!(
                "bring-up failed at {step}: {}(0x{op:x}) op_mod(0x{op_mod:x}) failed, status {}(0x{st:x}), \
                 syndrome (0x12345678)",
                name(op),
                status.name().unwrap()
            );
            assert_eq!(text, want, "{case}: Display");
            assert!(text.contains(status.name().unwrap()) && text.contains("0x12345678"), "{case}: {text}");
            assert_no_leak(&dev, &case);
            assert_alive_clean(&dev, &case);
        }
    }
}

/// How a health fault shows.
#[derive(Clone, Copy, Debug)]
enum Death {
    Fatal(u8),
    Stall,
    Gone,
}

const HEALTH_COUNTER: usize = c::mlx5_init_seg::HEALTH_COUNTER.off;

fn expected_failure(dev: &SimDevice, death: Death) -> HealthFailure {
    match death {
        Death::Fatal(synd) => HealthFailure::Syndrome {
            synd: HealthSyndrome::from_raw(synd),
            ext_synd: syndrome::HEALTH_EXT_SYND,
            severity: 2,
            rfr: true,
        },
        // The heartbeat froze when the firmware died and three polls saw it unchanged.
        Death::Stall => {
            HealthFailure::Stalled { counter: dev.mmio().read32(HEALTH_COUNTER), misses: consts::MAX_MISSES }
        }
        Death::Gone => HealthFailure::DeviceGone,
    }
}

/// Case 3: the firmware dies (or the device leaves the bus) while a bring-up command waits: the wait's health polls
/// find it within bounded virtual time, the HCA moves to internal error and the cleanup finishes locally,
/// abandoning the pages firmware held.
#[test]
fn health_failure_mid_bring_up() {
    let hw_fatal = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_HW_FATAL_ERR;
    let fw_internal = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR;
    let cases: &[(u16, Death)] = &[
        (consts::MLX5_CMD_OP_QUERY_PAGES, Death::Fatal(hw_fatal)),
        (consts::MLX5_CMD_OP_SET_HCA_CAP, Death::Fatal(fw_internal)),
        (consts::MLX5_CMD_OP_INIT_HCA, Death::Fatal(hw_fatal)),
        (consts::MLX5_CMD_OP_SET_DRIVER_VERSION, Death::Fatal(fw_internal)),
        (consts::MLX5_CMD_OP_ENABLE_HCA, Death::Stall),
        (consts::MLX5_CMD_OP_ACCESS_REG, Death::Stall),
        (consts::MLX5_CMD_OP_INIT_HCA, Death::Stall),
        (consts::MLX5_CMD_OP_ALLOC_UAR, Death::Stall),
        (consts::MLX5_CMD_OP_QUERY_ISSI, Death::Gone),
        (consts::MLX5_CMD_OP_QUERY_HCA_CAP, Death::Gone),
        (consts::MLX5_CMD_OP_SET_DRIVER_VERSION, Death::Gone),
        (consts::MLX5_CMD_OP_ALLOC_UAR, Death::Gone),
        (consts::MLX5_CMD_OP_CREATE_EQ, Death::Fatal(hw_fatal)),
        (consts::MLX5_CMD_OP_CREATE_EQ, Death::Stall),
        (consts::MLX5_CMD_OP_CREATE_EQ, Death::Gone),
    ];
    for &(op, death) in cases {
        health_case(op, death);
    }
}

fn health_case(op: u16, death: Death) {
    let case = format!("{death:?} on {}", name(op));
    let &(_, step, held) = STEPS.iter().find(|s| s.0 == op).unwrap();
    let dev = SimDevice::default();
    let opcode = op;
    dev.inject(match death {
        Death::Fatal(synd) => Fault::Fatal { opcode, synd },
        Death::Stall => Fault::Stall { opcode },
        Death::Gone => Fault::DeviceGone { opcode },
    });
    let err = bring_up_err(&dev, &case);
    let failure = expected_failure(&dev, death);
    assert_eq!(err.step, step, "{case}: step");
    assert_eq!(err.error, Error::Health(failure), "{case}: error");
    assert_eq!(err.cleanup, None, "{case}: a local cleanup meets no error");
    assert!(err.to_string().contains("device health failure"), "{case}: {err}");
    // Health is polled every 2 s of waiting: a syndrome or an all-ones read is seen at the first poll, a stalled
    // heartbeat at the fourth (the first poll only records the counter, then three misses). In-line, nothing else
    // took time.
    let limit_ms = match death {
        Death::Stall => 8_100,
        _ => 2_100,
    };
    let now_ms = dev.now_ns() / 1_000_000;
    assert!(now_ms < limit_ms, "{case}: detected after {now_ms} ms of device time (limit {limit_ms} ms)");
    // Nothing reached the device after the failure: the cleanup was local (no DISABLE_HCA, no doorbell).
    assert!(!dev.executed().iter().any(|c| c.opcode == Opcode::DisableHca.raw()), "{case}: DISABLE_HCA sent");
    assert!(
        !dev.events().iter().any(|e| matches!(e, SimEvent::DoorbellWhileDead { .. } | SimEvent::WriteWhileGone { .. })),
        "{case}: the driver rang a dead device"
    );
    assert_no_leak(&dev, &case);
    assert_dead_clean(&dev, &case, held);
}

/// Case 4: the device fails after a successful bring-up: health reports it once, then the HCA is in internal error:
/// new commands fail at once without reaching the device, destroy-type commands complete locally, and teardown
/// returns every page and every allocation without firmware.
#[test]
fn failure_after_bring_up() {
    let synd = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_ICM_PAGE_ERR;
    for death in [Death::Fatal(synd), Death::Gone] {
        let case = format!("{death:?} after bring-up");
        let dev = SimDevice::default();
        let mut d = dev.delay();
        let mut hca = bring_up(&dev).unwrap();
        let pd = hca.exec(&mut alloc_pd(), &mut d).unwrap();
        hca.poll_health().unwrap();
        let given = hca.pages_given();
        assert_eq!(given, BOOT_PAGES + INIT_PAGES + REGULAR_PAGES, "{case}: pages given at bring-up");
        match death {
            Death::Fatal(s) => dev.fail_health(s),
            Death::Gone => dev.device_gone(),
            Death::Stall => unreachable!(),
        }
        let failure = expected_failure(&dev, death);
        assert_eq!(hca.poll_health(), Err(Error::Health(failure)), "{case}: poll_health");
        assert_eq!(hca.state(), CoreState::InternalError(failure), "{case}: state");
        // Reported again, not re-polled.
        assert_eq!(hca.poll_health(), Err(Error::Health(failure)), "{case}: poll_health again");

        let n = dev.executed().len();
        let events = dev.events().len();
        let t0 = dev.now_ns();
        assert_eq!(
            hca.exec(&mut QueryIssi, &mut d).unwrap_err(),
            Error::InternalError { cause: failure, opcode: Opcode::QueryIssi },
            "{case}: a new command"
        );
        assert_eq!(
            hca.process_events(&mut d),
            Err(Error::InternalError { cause: failure, opcode: Opcode::ManagePages }),
            "{case}: process_events"
        );
        hca.exec_destroy(dealloc_pd(pd), &mut d).unwrap();
        assert_eq!(dev.executed().len(), n, "{case}: nothing reached the device");
        assert_eq!(dev.events().len(), events, "{case}: no doorbell rang (no DoorbellWhileDead/WriteWhileGone)");
        assert_eq!(dev.now_ns(), t0, "{case}: nothing waited");

        let rep = hca.teardown(&mut d).unwrap();
        assert!(rep.local_only, "{case}: {rep:?}");
        assert_eq!(rep.first_error, None, "{case}: {rep:?}");
        assert_eq!(rep.pages_abandoned, given, "{case}: {rep:?}");
        assert_eq!(dev.executed().len(), n, "{case}: teardown sent nothing");
        assert_no_leak(&dev, &case);
        assert_dead_clean(&dev, &case, given);
    }
}

/// Case 5: a command on slot 0 that needs pages: the page request is answered on the last slot while it waits, then
/// the command completes; pages firmware offers back are taken; teardown returns everything.
fn pages_while_slot0_waits(mode: Mode) {
    let case = format!("{mode:?}");
    let dev = SimDevice::new(SimConfig { mode, ..SimConfig::default() });
    let mut d = dev.delay();
    let mut hca = bring_up(&dev).unwrap();
    let before = hca.page_stats();
    let given = hca.pages_given();
    let n = dev.executed().len();
    dev.inject(Fault::NeedPages { opcode: consts::MLX5_CMD_OP_ALLOC_PD, pages: 5 });
    let pd = hca.exec(&mut alloc_pd(), &mut d).unwrap();
    assert!(
        dev.events().contains(&SimEvent::WaitingForPages { slot: 0, opcode: Opcode::AllocPd.raw(), pages: 5 }),
        "{case}: ALLOC_PD waited for pages"
    );
    let cmds = executed_since(&dev, n);
    assert_eq!(ops(&cmds), [Opcode::ManagePages, Opcode::AllocPd], "{case}: {cmds:?}");
    let give = cmds[0];
    assert_eq!((give.slot, give.op_mod, give.status), (PAGES_SLOT, consts::MLX5_PAGES_GIVE, 0), "{case}");
    assert_eq!((cmds[1].slot, cmds[1].status), (0, 0), "{case}: ALLOC_PD completed on slot 0 after the give");
    let after = hca.page_stats();
    assert_eq!(after.requested, before.requested + 5, "{case}: {after:?}");
    assert_eq!(after.page_requests, before.page_requests + 1, "{case}: {after:?}");
    assert_eq!(hca.pages_given(), given + 5, "{case}");
    assert_eq!(dev.pages_owned(), given + 5, "{case}");

    // Firmware offers three pages back.
    let n = dev.executed().len();
    dev.request_pages(-3);
    hca.process_events(&mut d).unwrap();
    let cmds = executed_since(&dev, n);
    assert_eq!(ops(&cmds), [Opcode::ManagePages], "{case}: {cmds:?}");
    assert_eq!((cmds[0].slot, cmds[0].op_mod, cmds[0].status), (PAGES_SLOT, consts::MLX5_PAGES_TAKE, 0));
    assert_eq!(hca.pages_given(), given + 2, "{case}");
    assert_eq!(dev.pages_owned(), given + 2, "{case}");
    assert_eq!(hca.page_stats().reclaimed, before.reclaimed + 3, "{case}");

    hca.exec_destroy(dealloc_pd(pd), &mut d).unwrap();
    let rep = hca.teardown(&mut d).unwrap();
    assert!(!rep.local_only, "{case}: {rep:?}");
    assert_eq!(rep.pages_abandoned, 0, "{case}: {rep:?}");
    assert_no_leak(&dev, &case);
    assert_alive_clean(&dev, &case);
}

#[test]
fn page_request_served_while_slot0_waits_inline() {
    pages_while_slot0_waits(Mode::Inline);
}

#[test]
fn page_request_served_while_slot0_waits_threaded() {
    pages_while_slot0_waits(Mode::Threaded);
}

/// Case 6: firmware never leaves pre-initializing: the bring-up gives up after Linux's 120 s, before anything was
/// allocated or written.
#[test]
fn pre_init_timeout() {
    let dev = SimDevice::new(SimConfig { init_delay_ms: u32::MAX, ..SimConfig::default() });
    let err = bring_up_err(&dev, "pre-init");
    assert_eq!(
        err,
        BringupError {
            step: Step::PreInitializing,
            error: Error::FwInitTimeout { state: "pre-initializing", waited_ms: FW_PRE_INIT_TIMEOUT_MS },
            cleanup: None,
        }
    );
    assert_eq!(
        err.to_string(),
        "bring-up failed at wait for firmware (pre-initializing): firmware over 120000 ms in pre-initializing \
         state, aborting"
    );
    let waited_ms = dev.now_ns() / 1_000_000;
    assert!((120_000..120_010).contains(&waited_ms), "waited {waited_ms} ms");
    assert_eq!(dev.dma_outstanding(), (0, 0));
    assert!(!dev.events().iter().any(|e| matches!(e, SimEvent::CmdqAddress { .. })), "queue address written");
    assert_eq!(dev.executed(), []);
    assert_eq!(dev.hca_state(), SimState::Disabled);
}

#[test]
fn refusals_linux_tolerates_do_not_fail_the_bring_up() {
    for &op in TOLERATED {
        for &st in STATUSES {
            let case = format!("{} refused with status {st:#x}", name(op));
            let dev = SimDevice::default();
            dev.inject(Fault::Status { opcode: op, status: st, syndrome: SYNDROME, times: 1 });
            let hca = bring_up(&dev).unwrap_or_else(|e| panic!("{case}: {e}"));
            let sent: Vec<u16> = dev.executed().iter().map(|c| c.opcode).collect();
            if op == consts::MLX5_CMD_OP_QUERY_ISSI {
                assert_eq!(hca.issi(), 0, "{case}: ISSI 0");
                assert!(!sent.contains(&{ consts::MLX5_CMD_OP_SET_ISSI }), "{case}: no SET_ISSI");
            } else {
                assert_eq!(hca.issi(), 1, "{case}");
            }
            let mut d = dev.delay();
            hca.teardown(&mut d).unwrap_or_else(|e| panic!("{case}: teardown: {e}"));
            assert_no_leak(&dev, &case);
            assert_alive_clean(&dev, &case);
        }
    }
}

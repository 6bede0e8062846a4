//! End to end: the unmodified core's command queue and encoders against the simulated firmware engine.
//! Every implemented command round-trips; long mailbox chains, faults and firmware errors each end in the
//! expected typed error, without a panic or a hang.

use mlx5_core::cmd::Pas;
use mlx5_core::cmdq::{CmdError, CmdQueue, Command, SlotKind};
use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::init::{enable_hca, init_hca, CapMode, CapType, QueryHcaCap};
use mlx5_core::pages::{ManagePagesGive, ManagePagesTake, FW_PAGE_SIZE};
use mlx5_core::pd::alloc_pd;
use mlx5_core::prm::{ifc, CmdStatus, DeliveryStatus, MsgBuf, Opcode};
use mlx5_sim::testkit::mocks::{BarrierKind, MmioAccess, RecordingMmio};
use mlx5_sim::{Fault, Mode, SimConfig, SimDevice, SimDma, SimMmio};
use mlx5_tool::tour::{run_tour, TourError};

/// Any command, written as raw header fields and lengths, for probing firmware checks.
struct Raw {
    opcode: u16,
    op_mod: u16,
    inlen: usize,
    outlen: usize,
}

impl Command for Raw {
    type In = ifc::mbox_in::Bits;
    type Out = ifc::mbox_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::from_raw(self.opcode)
    }
    fn inlen(&self) -> usize {
        self.inlen
    }
    fn outlen(&self) -> usize {
        self.outlen
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        msg.set(ifc::mbox_in::OPCODE, self.opcode.into());
        msg.set(ifc::mbox_in::OP_MOD, self.op_mod.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

fn setup(cfg: SimConfig) -> (SimDevice, CmdQueue<SimMmio, SimDma>) {
    let dev = SimDevice::new(cfg);
    let q = CmdQueue::new(dev.mmio(), dev.dma(), ()).unwrap();
    (dev, q)
}

fn status(err: CmdError) -> (CmdStatus, u32) {
    match err {
        CmdError::Status { status, syndrome, .. } => (status, syndrome),
        e => panic!("expected a command status error, got {e:?}"),
    }
}

/// Opcodes the tour runs, in order (what a driver sends, minus the EQ-driven page requests of later issues).
const TOUR: &[Opcode] = &[
    Opcode::EnableHca,
    Opcode::QueryIssi,
    Opcode::SetIssi,
    Opcode::QueryPages,
    Opcode::ManagePages,
    Opcode::QueryHcaCap,
    Opcode::QueryHcaCap,
    Opcode::SetHcaCap,
    Opcode::QueryPages,
    Opcode::ManagePages,
    Opcode::InitHca,
    Opcode::AllocUar,
    Opcode::AllocPd,
    Opcode::CreateEq,
    Opcode::CreateCq,
    Opcode::DestroyCq,
    Opcode::DestroyEq,
    Opcode::DeallocPd,
    Opcode::DeallocUar,
    Opcode::TeardownHca,
    Opcode::ManagePages,
    Opcode::DisableHca,
];

fn tour_in(mode: Mode) {
    let (dev, mut q) = setup(SimConfig { mode, ..SimConfig::default() });
    let mut delay = dev.delay();
    let report = run_tour(&mut q, &mut delay).unwrap();
    assert_eq!(report.pages_given, 24);
    assert_eq!(report.pages_taken, 24);
    assert_eq!(dev.pages_owned(), 0);
    let ops: Vec<Opcode> = dev.executed().iter().map(|c| Opcode::from_raw(c.opcode)).collect();
    assert_eq!(ops, TOUR);
    assert!(dev.executed().iter().all(|c| c.status == 0 && c.delivery == 0));
    // MANAGE_PAGES went to the reserved last slot, everything else to slot 0.
    for c in dev.executed() {
        let want = if c.opcode == Opcode::ManagePages.raw() { 31 } else { 0 };
        assert_eq!(c.slot, want, "{:?}", Opcode::from_raw(c.opcode));
    }
    drop(q);
    assert_eq!(dev.dma_outstanding(), (0, 0), "every DMA region returned");
    assert!(dev.dma_faults().is_empty());
}

#[test]
fn every_implemented_command_round_trips_inline() {
    tour_in(Mode::Inline);
}

#[test]
fn every_implemented_command_round_trips_threaded() {
    tour_in(Mode::Threaded);
}

#[test]
fn signed_commands_round_trip_when_firmware_checks_signatures() {
    let (dev, mut q) = setup(SimConfig { checksum: true, ..SimConfig::default() });
    q.set_checksum(true);
    run_tour(&mut q, &mut dev.delay()).unwrap();
    assert!(dev.executed().iter().all(|c| c.delivery == 0));
}

#[test]
fn unsigned_mailboxes_are_refused_by_checking_firmware() {
    let (dev, mut q) = setup(SimConfig { checksum: true, ..SimConfig::default() });
    let mut delay = dev.delay();
    q.exec(&mut enable_hca(0), &mut delay).unwrap();
    // QUERY_HCA_CAP's output spans mailboxes; without block signatures firmware rejects the entry.
    let err = q.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, &mut delay).unwrap_err();
    assert_eq!(err, CmdError::Delivery { opcode: Opcode::QueryHcaCap, status: DeliveryStatus::Signat });
}

fn alloc_pages(dma: &SimDma, n: usize) -> Vec<DmaRegion> {
    (0..n).map(|_| dma.alloc(FW_PAGE_SIZE, FW_PAGE_SIZE).unwrap()).collect()
}

/// 1,000 page addresses: 8,016 input bytes, a chain of 16 mailbox blocks in each direction.
#[test]
fn thousand_pages_through_mailbox_chains() {
    let (dev, mut q) = setup(SimConfig::default());
    let mut delay = dev.delay();
    let dma = dev.dma();
    q.exec(&mut enable_hca(0), &mut delay).unwrap();
    let regions = alloc_pages(&dma, 1000);
    let pages: Vec<u64> = regions.iter().map(|r| r.iova()).collect();
    let give = ManagePagesGive { function_id: 0, pages: Pas::List(&pages) };
    assert_eq!(give.inlen().saturating_sub(16).div_ceil(512), 16);
    q.exec(&mut ManagePagesGive { function_id: 0, pages: Pas::List(&pages) }, &mut delay).unwrap();
    assert_eq!(dev.pages_owned(), 1000);

    let mut back = vec![0u64; 1000];
    let n = q.exec(&mut ManagePagesTake { function_id: 0, pages: &mut back[..] }, &mut delay).unwrap();
    assert_eq!(n, 1000);
    assert_eq!(dev.pages_owned(), 0);
    let mut given = pages.clone();
    given.sort_unstable();
    back.sort_unstable();
    assert_eq!(back, given, "firmware returned exactly the pages it was given");
    for r in regions {
        // SAFETY: firmware returned every page (checked above), so nothing accesses them any more.
        unsafe { dma.free(r) };
    }
}

#[test]
fn firmware_errors_are_typed() {
    let (dev, mut q) = setup(SimConfig::default());
    let mut delay = dev.delay();
    // Before ENABLE_HCA firmware refuses object commands.
    let (st, _) = status(q.exec(&mut alloc_pd(), &mut delay).unwrap_err());
    assert_eq!(st, CmdStatus::BadSysState);
    q.exec(&mut enable_hca(0), &mut delay).unwrap();
    // Unknown opcode.
    let err = q.exec(&mut Raw { opcode: 0x7777, op_mod: 0, inlen: 16, outlen: 16 }, &mut delay).unwrap_err();
    assert_eq!(status(err).0, CmdStatus::BadOp);
    assert!(err.to_string().starts_with("UNKNOWN(0x7777) op_mod(0x0) failed, status BAD_OP(0x2)"), "{err}");
    // Input shorter than CREATE_CQ's layout.
    let err = q.exec(&mut Raw { opcode: Opcode::CreateCq.raw(), op_mod: 0, inlen: 16, outlen: 16 }, &mut delay);
    assert_eq!(status(err.unwrap_err()).0, CmdStatus::BadInpLen);
    // Output shorter than QUERY_HCA_CAP's.
    let err = q.exec(&mut Raw { opcode: Opcode::QueryHcaCap.raw(), op_mod: 1, inlen: 16, outlen: 16 }, &mut delay);
    assert_eq!(status(err.unwrap_err()).0, CmdStatus::BadOutpLen);
    // INIT_HCA before any page was given.
    let (st, _) = status(q.exec(&mut init_hca(), &mut delay).unwrap_err());
    assert_eq!(st, CmdStatus::BadSysState);
    // Each failure is in the firmware's record with the same status.
    let last = dev.executed().last().copied().unwrap();
    assert_eq!((last.opcode, last.status), (Opcode::InitHca.raw(), CmdStatus::BadSysState.raw()));
}

#[test]
fn injected_status_and_syndrome_surface_unchanged() {
    let (dev, mut q) = setup(SimConfig::default());
    let mut delay = dev.delay();
    q.exec(&mut enable_hca(0), &mut delay).unwrap();
    dev.inject(Fault::Status { opcode: Opcode::QueryHcaCap.raw(), status: 0x3, syndrome: 0x12345678, times: 1 });
    let err = q.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, &mut delay).unwrap_err();
    assert_eq!(
        err,
        CmdError::Status { opcode: Opcode::QueryHcaCap, op_mod: 0, status: CmdStatus::BadParam, syndrome: 0x12345678 }
    );
    // `times: 1`: the next one succeeds.
    q.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, &mut delay).unwrap();
    // A status the headers do not name keeps its value.
    dev.inject(Fault::Status { opcode: Opcode::QueryHcaCap.raw(), status: 0x77, syndrome: 1, times: 1 });
    let err = q.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, &mut delay).unwrap_err();
    assert_eq!(status(err).0, CmdStatus::Unknown(0x77));
}

#[test]
fn delivery_fault_is_typed() {
    let (dev, mut q) = setup(SimConfig::default());
    dev.inject(Fault::Delivery { opcode: Opcode::EnableHca.raw(), status: DeliveryStatus::BadBlkNum.raw() });
    let err = q.exec(&mut enable_hca(0), &mut dev.delay()).unwrap_err();
    assert_eq!(err, CmdError::Delivery { opcode: Opcode::EnableHca, status: DeliveryStatus::BadBlkNum });
}

/// A command firmware never completes times out after Linux's default 60 s (virtual time: instant here), and the
/// slot stays reserved instead of being reused under firmware's feet.
#[test]
fn hung_command_times_out_and_keeps_its_slot() {
    let (dev, mut q) = setup(SimConfig::default());
    let mut delay = dev.delay();
    dev.inject(Fault::Hang { opcode: Opcode::EnableHca.raw() });
    let start = dev.now_ns();
    let err = q.exec(&mut enable_hca(0), &mut delay).unwrap_err();
    assert_eq!(err, CmdError::Timeout { opcode: Opcode::EnableHca, waited_ms: 60_000 });
    let waited = (dev.now_ns() - start) / 1_000_000;
    assert!((60_000..60_010).contains(&waited), "waited {waited} ms of device time");
    assert_eq!(q.exec(&mut alloc_pd(), &mut delay).unwrap_err(), CmdError::SlotBusy { slot: 0 });
    // The pages slot is independent and still works.
    let slot = q.slot(SlotKind::Pages);
    assert!(!q.is_posted(slot));
}

#[test]
fn delayed_completion_is_waited_for() {
    let (dev, mut q) = setup(SimConfig::default());
    let mut delay = dev.delay();
    dev.inject(Fault::Delay { opcode: Opcode::EnableHca.raw(), ms: 5 });
    let start = dev.now_ns();
    q.exec(&mut enable_hca(0), &mut delay).unwrap();
    let waited_us = (dev.now_ns() - start) / 1000;
    // Completed once 5 ms had passed, and no later than one backoff step (1 ms) after that.
    assert!((5_000..=6_000).contains(&waited_us), "waited {waited_us} us");
}

#[test]
fn malformed_outputs_are_rejected() {
    let (dev, mut q) = setup(SimConfig::default());
    let mut delay = dev.delay();
    let dma = dev.dma();
    q.exec(&mut enable_hca(0), &mut delay).unwrap();
    let regions = alloc_pages(&dma, 4);
    let pages: Vec<u64> = regions.iter().map(|r| r.iova()).collect();
    q.exec(&mut ManagePagesGive { function_id: 0, pages: Pas::List(&pages) }, &mut delay).unwrap();
    // output_num_entries (byte 8..12 of the output) claims 0x01000004 pages: more than the output holds.
    let off = ifc::manage_pages_out::OUTPUT_NUM_ENTRIES.off as usize / 8;
    dev.inject(Fault::CorruptOutput { opcode: Opcode::ManagePages.raw(), offset: off, value: 1 });
    let mut back = [0u64; 4];
    let err = q.exec(&mut ManagePagesTake { function_id: 0, pages: &mut back[..] }, &mut delay).unwrap_err();
    assert!(matches!(err, CmdError::OutputTooShort { opcode: Opcode::ManagePages, .. }), "{err:?}");
    dev.clear_faults();
    // Firmware did hand those pages over (the driver refused to believe the output), so give it more.
    let more: Vec<u64> = alloc_pages(&dma, 4).iter().map(|r| r.iova()).collect();
    q.exec(&mut ManagePagesGive { function_id: 0, pages: Pas::List(&more) }, &mut delay).unwrap();
    // A page address that is not 4 KiB aligned.
    let pas = ifc::manage_pages_out::PAS.byte_off() + 7;
    dev.inject(Fault::CorruptOutput { opcode: Opcode::ManagePages.raw(), offset: pas, value: 0x08 });
    let err = q.exec(&mut ManagePagesTake { function_id: 0, pages: &mut back[..] }, &mut delay).unwrap_err();
    assert!(matches!(err, CmdError::Malformed { what: "page address", .. }), "{err:?}");
}

/// The doorbell sequence as the device sees it: a store barrier, then one write of only the slot's bit, and the
/// doorbell register is never read.
#[test]
fn doorbell_sequence_seen_by_a_recording_mock() {
    let dev = SimDevice::new(SimConfig::default());
    let mmio = RecordingMmio::new(dev.mmio());
    let mut q = CmdQueue::new(&mmio, dev.dma(), ()).unwrap();
    mmio.clear();
    q.exec(&mut enable_hca(0), &mut dev.delay()).unwrap();
    let dbell = mlx5_core::prm::c::mlx5_init_seg::CMD_DBELL.off;
    let log = mmio.log();
    let at = log.iter().position(|a| matches!(a, MmioAccess::Write32 { off, .. } if *off == dbell)).unwrap();
    assert_eq!(log[at], MmioAccess::Write32 { off: dbell, val: 1 });
    assert_eq!(log[at - 1], MmioAccess::Barrier(BarrierKind::Wmb), "wmb right before the doorbell");
    assert!(!log.iter().any(|a| matches!(a, MmioAccess::Read32 { off, .. } if *off == dbell)));
    // The completion was observed through the ownership byte, followed by a read barrier.
    assert!(log[at..].contains(&MmioAccess::Barrier(BarrierKind::DmaRmb)));
}

#[test]
fn tour_failure_cleans_up() {
    let (dev, mut q) = setup(SimConfig::default());
    dev.inject(Fault::Status { opcode: Opcode::CreateCq.raw(), status: 0x3, syndrome: 0xabc, times: 0 });
    let err = run_tour(&mut q, &mut dev.delay()).unwrap_err();
    assert!(matches!(err, TourError::Cmd { step: "create CQ", .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "create CQ: CREATE_CQ(0x400) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0xabc)"
    );
    assert_eq!(dev.pages_owned(), 0, "firmware gave every page back before the memory was freed");
    drop(q);
    assert_eq!(dev.dma_outstanding(), (0, 0), "no DMA memory leaked on the error path");
}

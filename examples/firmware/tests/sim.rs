//! The firmware's `run()` (the very function the thumbv7em image calls) against the simulated ConnectX: it must
//! bring the HCA up, connect two RC QPs on the port's loopback (RoCE and InfiniBand), carry two SENDs and an RDMA
//! WRITE with the completions and bytes `run` reports matching what was posted, and leave nothing behind; a
//! failing command, a failed completion and a down port each end in a named error after the same teardown. And
//! the firmware's arena must be big enough for that sequence: every allocation the run makes is replayed on an
//! `Arena` of the image's size.

use std::cell::RefCell;
use std::collections::HashMap;
use std::mem::MaybeUninit;

use mlx5_core::cq::{LinkLayer, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::{Dma, DmaError, DmaRegion};
use mlx5_core::prm::{Field, Opcode};
use mlx5_core::qp::QpState;
use mlx5_core::trace::{CmdRecord, CmdTrace};
use mlx5_firmware_example::arena::Arena;
use mlx5_firmware_example::{fnv1a, pattern, run, run_with, Options, RunError, TRANSFERS};
use mlx5_firmware_example::{BUF_BYTES, COMPLETIONS, RECV_WR_ID, SEND_WR_ID};
use mlx5_sim::{Fault, Mode, PortType, SimConfig, SimDevice};

/// The completions `run` must report: QP A's SENDs and RDMA WRITE in posting order, QP B's two receives.
fn expected_completions(qa: u32, qb: u32) -> Vec<(u64, WcStatus, WcOpcode, u32, u32)> {
    // (wr_id, status, opcode, qp_num, byte_len of the receives)
    vec![
        (SEND_WR_ID, WcStatus::Success, WcOpcode::Send, qa, 0),
        (SEND_WR_ID + 1, WcStatus::Success, WcOpcode::Send, qa, 0),
        (SEND_WR_ID + 2, WcStatus::Success, WcOpcode::RdmaWrite, qa, 0),
        (RECV_WR_ID, WcStatus::Success, WcOpcode::Recv, qb, 256),
        (RECV_WR_ID + 1, WcStatus::Success, WcOpcode::Recv, qb, 2000),
    ]
}

/// What each target area must hold, computed here from the source pattern rather than taken from `run`.
fn expected_digests() -> Vec<u32> {
    TRANSFERS
        .iter()
        .map(|t| {
            let mut area = vec![0u8; t.room];
            for (k, b) in area.iter_mut().take(t.len as usize).enumerate() {
                *b = pattern(t.src + k);
            }
            fnv1a(&area)
        })
        .collect()
}

/// Checks the device's side after a run: the command order, every command OK, nothing left allocated, every
/// firmware page back, no DMA fault.
fn assert_clean(dev: &SimDevice, order: &[Opcode]) {
    let ops: Vec<u16> = dev.executed().iter().map(|c| c.opcode).collect();
    let pos = |op: Opcode| ops.iter().position(|&o| o == op.raw()).unwrap_or_else(|| panic!("{op:?} not sent"));
    for w in order.windows(2) {
        assert!(pos(w[0]) < pos(w[1]), "{:?} before {:?} in {ops:x?}", w[0], w[1]);
    }
    assert!(dev.executed().iter().all(|c| c.status == 0 && c.delivery == 0), "every command OK");
    assert_eq!(dev.dma_outstanding(), (0, 0), "no DMA memory left");
    assert_eq!(dev.pages_owned(), 0, "firmware returned every page");
    assert!(dev.dma_faults().is_empty(), "{:?}", dev.dma_faults());
}

const LIFE: [Opcode; 16] = [
    Opcode::EnableHca,
    Opcode::InitHca,
    Opcode::AllocPd,
    Opcode::CreateMkey,
    Opcode::CreateCq,
    Opcode::CreateQp,
    Opcode::Rst2initQp,
    Opcode::Init2rtrQp,
    Opcode::Rtr2rtsQp,
    Opcode::QueryQp,
    Opcode::DestroyQp,
    Opcode::DestroyCq,
    Opcode::DestroyMkey,
    Opcode::DeallocPd,
    Opcode::TeardownHca,
    Opcode::DisableHca,
];

fn check_traffic_run(cfg: SimConfig) {
    let link = if cfg.port_type == PortType::Ib { LinkLayer::InfiniBand } else { LinkLayer::Ethernet };
    let dev = SimDevice::new(cfg);
    let report = run(dev.mmio(), dev.dma(), (), &mut dev.delay()).expect("run succeeds on the simulator");
    assert_eq!(report.fw_rev, (16, 35, 2000));
    assert_eq!(report.link_layer, link);
    assert_eq!(report.qp_state, QpState::Rts);
    let [qa, qb] = report.qpns;
    assert_ne!(qa, qb);
    let got: Vec<_> = report
        .completions
        .iter()
        .map(|w| (w.wr_id, w.status, w.opcode, w.qp_num, if w.opcode == WcOpcode::Recv { w.byte_len } else { 0 }))
        .collect();
    assert_eq!(got, expected_completions(qa, qb));
    // Each receive names the sender.
    assert!(report.completions[TRANSFERS.len()..].iter().all(|w| w.src_qp == qa), "{:?}", report.completions);
    assert_eq!(report.digests.to_vec(), expected_digests(), "the bytes that landed");
    assert!(report.pages_reclaimed > 0, "{report:?}");
    assert_clean(&dev, &LIFE);
    // Both QPs went RESET -> INIT -> RTR -> RTS, and the device carried the three messages A sent.
    let count = |op: Opcode| dev.executed().iter().filter(|c| c.opcode == op.raw()).count();
    assert_eq!([Opcode::Rst2initQp, Opcode::Init2rtrQp, Opcode::Rtr2rtsQp].map(count), [2, 2, 2]);
    assert_eq!([Opcode::CreateQp, Opcode::DestroyQp, Opcode::CreateCq, Opcode::DestroyCq].map(count), [2; 4]);
}

#[test]
fn run_sends_and_writes_over_a_roce_loopback_checks_completions_and_data_and_tears_down() {
    check_traffic_run(SimConfig::default());
}

#[test]
fn run_sends_and_writes_over_an_ib_loopback_checks_completions_and_data_and_tears_down() {
    check_traffic_run(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
}

#[test]
fn run_on_a_threaded_device_waits_for_the_completions() {
    check_traffic_run(SimConfig { mode: Mode::Threaded, ..SimConfig::default() });
}

/// The address path of each INIT2RTR_QP `run` sends: (`src_addr_index`, `rlid`, `rmac`).
#[derive(Default)]
struct RtrPaths(Vec<(u32, u32, u64)>);

impl CmdTrace for RtrPaths {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        use mlx5_core::prm::ifc::{ads, init2rtr_qp_in, qpc};
        if rec.opcode == Opcode::Init2rtrQp {
            let path = qpc::PRIMARY_ADDRESS_PATH.at(init2rtr_qp_in::QPC);
            let f = |field: Field| rec.input.get(field.at(path));
            let rmac = u64::from(f(ads::RMAC_47_32)) << 32 | u64::from(f(ads::RMAC_31_0));
            self.0.push((f(ads::SRC_ADDR_INDEX), f(ads::RLID), rmac));
        }
    }
}

#[test]
fn the_loopback_is_addressed_by_the_roce_v2_gid_on_ethernet_and_by_lid_on_infiniband() {
    // RoCE: GID index 1, the link-local RoCE v2 entry (Linux's table order: v1 at 0, v2 at 1), to the port's own
    // MAC (mlx5_ib's mlx5_set_path leaves the grh bit and rlid alone on RoCE).
    let cfg = SimConfig::default();
    let mac = cfg.mac.iter().fold(0u64, |a, &b| a << 8 | u64::from(b));
    let dev = SimDevice::new(cfg);
    let mut paths = RtrPaths::default();
    run(dev.mmio(), dev.dma(), &mut paths, &mut dev.delay()).expect("run on RoCE");
    assert_eq!(paths.0, [(1, 0, mac); 2]);
    // InfiniBand: the port's own LID, no MAC.
    let dev = SimDevice::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
    let mut paths = RtrPaths::default();
    run(dev.mmio(), dev.dma(), &mut paths, &mut dev.delay()).expect("run on IB");
    let lid = paths.0[0].1;
    assert_ne!(lid, 0);
    assert_eq!(paths.0, [(0, lid, 0); 2]);
}

#[test]
fn without_traffic_run_connects_and_tears_down_with_commands_only() {
    let dev = SimDevice::new(SimConfig::default());
    let opts = Options { traffic: false, ..Options::default() };
    let report = run_with(dev.mmio(), dev.dma(), (), &mut dev.delay(), opts).expect("run succeeds");
    assert_eq!(report.qp_state, QpState::Rts);
    assert_eq!(report.completions, [WorkCompletion::default(); COMPLETIONS]);
    assert_eq!(report.digests, [0; TRANSFERS.len()]);
    assert_clean(&dev, &LIFE);
}

#[test]
fn a_failing_step_cleans_up_and_says_which() {
    for (op, what) in [(Opcode::Rst2initQp, "RST2INIT_QP"), (Opcode::Init2rtrQp, "INIT2RTR_QP")] {
        let dev = SimDevice::new(SimConfig::default());
        dev.inject(Fault::Status { opcode: op.raw(), status: 3, syndrome: 0x1234, times: 1 });
        let err = run(dev.mmio(), dev.dma(), (), &mut dev.delay()).unwrap_err();
        assert!(matches!(err, RunError::Step { what: w, .. } if w == what), "{err:?}");
        assert!(err.to_string().starts_with(&format!("{what} failed")), "{err}");
        // Both QPs, both CQs, the key and the PD were destroyed and the HCA torn down all the same.
        let count = |o: Opcode| dev.executed().iter().filter(|c| c.opcode == o.raw()).count();
        assert_eq!([Opcode::DestroyQp, Opcode::DestroyCq].map(count), [2, 2]);
        for o in [Opcode::DestroyMkey, Opcode::DeallocPd, Opcode::DisableHca] {
            assert_eq!(count(o), 1, "{o:?}");
        }
        assert_eq!(dev.dma_outstanding(), (0, 0));
        assert_eq!(dev.pages_owned(), 0);
    }
}

#[test]
fn a_wrong_key_is_a_failed_completion_named_and_everything_is_still_torn_down() {
    // CREATE_MKEY's answer with the low byte of mkey_index (output byte 11) changed: the driver's lkey and rkey
    // name a key that does not exist, so the first SEND completes with a local protection error.
    let dev = SimDevice::new(SimConfig::default());
    dev.inject(Fault::CorruptOutput { opcode: Opcode::CreateMkey.raw(), offset: 11, value: 0x7e });
    let err = run(dev.mmio(), dev.dma(), (), &mut dev.delay()).unwrap_err();
    match err {
        RunError::Completion { index: 0, wr_id, status, .. } => {
            assert_eq!(wr_id, SEND_WR_ID);
            assert_ne!(status, WcStatus::Success);
        }
        e => panic!("expected the first completion refused, got {e:?}"),
    }
    assert!(err.to_string().starts_with("completion 0 unexpected"), "{err}");
    let ops: Vec<u16> = dev.executed().iter().map(|c| c.opcode).collect();
    for op in [Opcode::DestroyQp, Opcode::DestroyCq, Opcode::DeallocPd, Opcode::DisableHca] {
        assert!(ops.contains(&op.raw()), "{op:?} missing from {ops:x?}");
    }
    // DESTROY_MKEY of the key the driver was told about fails (no such key), so the buffer the real key still
    // covers is kept, never freed while the device may write it; every other region and page came back.
    let destroy = dev.executed().into_iter().find(|c| c.opcode == Opcode::DestroyMkey.raw()).expect("DESTROY_MKEY");
    assert_ne!(destroy.status, 0);
    assert_eq!(dev.dma_outstanding(), (1, BUF_BYTES));
    assert_eq!(dev.pages_owned(), 0);
}

#[test]
fn a_port_that_is_down_is_named_before_anything_is_posted() {
    let dev = SimDevice::new(SimConfig::default());
    dev.set_port_up(false);
    let err = run(dev.mmio(), dev.dma(), (), &mut dev.delay()).unwrap_err();
    assert!(matches!(err, RunError::PortDown { state: 1 }), "{err:?}");
    assert_clean(&dev, &[Opcode::CreateQp, Opcode::DestroyQp, Opcode::DisableHca]);
}

/// The image's arena size (`ARENA_BYTES` in src/main.rs).
const ARENA_BYTES: usize = 2 << 20;

/// The simulator's allocator, with every allocation and free mirrored on a firmware `Arena`: the run must never
/// need more than the arena can give.
struct Mirror<'a> {
    sim: mlx5_sim::SimDma,
    arena: &'a Arena,
    map: RefCell<HashMap<u64, DmaRegion>>,
    failed: RefCell<Vec<(usize, usize, DmaError)>>,
}

// SAFETY: every region returned is the simulator's (which honours the contract); the arena only keeps books.
unsafe impl Dma for Mirror<'_> {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        let r = self.sim.alloc(len, align)?;
        match self.arena.alloc(len, align) {
            Ok(a) => {
                self.map.borrow_mut().insert(r.iova(), a);
            }
            Err(e) => self.failed.borrow_mut().push((len, align, e)),
        }
        Ok(r)
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        self.sim.iova_of(cpu, len)
    }

    unsafe fn free(&self, region: DmaRegion) {
        if let Some(a) = self.map.borrow_mut().remove(&region.iova()) {
            // SAFETY: `a` came from the arena for this region and is freed once; no device sees the arena.
            unsafe { self.arena.free(a) };
        }
        // SAFETY: the caller's duties are passed through.
        unsafe { self.sim.free(region) };
    }
}

#[test]
fn the_firmware_arena_is_big_enough_for_run() {
    let mem = Box::leak(vec![MaybeUninit::<u8>::uninit(); ARENA_BYTES].into_boxed_slice());
    // SAFETY: no device reaches this arena; it only mirrors the simulator's allocations.
    let arena: Arena = unsafe { Arena::new(mem) };
    let dev = SimDevice::new(SimConfig::default());
    let mirror = Mirror { sim: dev.dma(), arena: &arena, map: RefCell::default(), failed: RefCell::default() };
    run(dev.mmio(), &mirror, (), &mut dev.delay()).expect("run succeeds");
    assert!(mirror.failed.borrow().is_empty(), "the arena refused {:?}", mirror.failed.borrow());
    let s = arena.stats();
    assert_eq!((s.live_regions, s.live_bytes), (0, 0), "{s:?}");
    assert!(s.peak_bytes <= ARENA_BYTES, "{s:?}");
    println!("arena peak {} KiB of {} KiB", s.peak_bytes / 1024, ARENA_BYTES / 1024);
}

#[test]
fn the_hca_fits_a_microcontroller_stack() {
    // `run` keeps the HCA on the stack; with the firmware's small tables it must stay far below the 256 KiB of
    // SRAM (stack and all) the image is linked for.
    let size = std::mem::size_of::<mlx5_firmware_example::FwHca<mlx5_sim::SimMmio, mlx5_sim::SimDma, ()>>();
    println!("FwHca is {size} bytes");
    assert!(size < 64 * 1024, "{size}");
}

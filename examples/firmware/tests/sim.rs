//! The firmware's `run()` (the very function the thumbv7em image calls) against the simulated ConnectX: it must
//! bring the HCA up, create PD / CQ / RC QP, reach INIT, and leave nothing behind. And the firmware's arena must be
//! big enough for that sequence: every allocation the run makes is replayed on an `Arena` of the image's size.

use std::cell::RefCell;
use std::collections::HashMap;
use std::mem::MaybeUninit;

use mlx5_core::hal::{Dma, DmaError, DmaRegion};
use mlx5_core::prm::Opcode;
use mlx5_core::qp::QpState;
use mlx5_firmware_example::arena::Arena;
use mlx5_firmware_example::{run, RunError};
use mlx5_sim::{Fault, SimConfig, SimDevice};

#[test]
fn run_brings_up_creates_pd_cq_qp_reaches_init_and_tears_down() {
    let dev = SimDevice::new(SimConfig::default());
    let report = run(dev.mmio(), dev.dma(), (), &mut dev.delay()).expect("run succeeds on the simulator");
    assert_eq!(report.fw_rev, (16, 35, 2000));
    assert_eq!(report.qp_state, QpState::Init);
    assert!(report.pages_reclaimed > 0, "{report:?}");

    let ops: Vec<u16> = dev.executed().iter().map(|c| c.opcode).collect();
    let pos = |op: Opcode| ops.iter().position(|&o| o == op.raw()).unwrap_or_else(|| panic!("{op:?} not sent"));
    let order = [
        Opcode::EnableHca,
        Opcode::InitHca,
        Opcode::AllocPd,
        Opcode::CreateCq,
        Opcode::CreateQp,
        Opcode::Rst2initQp,
        Opcode::QueryQp,
        Opcode::DestroyQp,
        Opcode::DestroyCq,
        Opcode::DeallocPd,
        Opcode::TeardownHca,
        Opcode::DisableHca,
    ];
    for w in order.windows(2) {
        assert!(pos(w[0]) < pos(w[1]), "{:?} before {:?} in {ops:x?}", w[0], w[1]);
    }
    assert!(dev.executed().iter().all(|c| c.status == 0 && c.delivery == 0), "every command OK");
    assert_eq!(dev.dma_outstanding(), (0, 0), "no DMA memory left");
    assert_eq!(dev.pages_owned(), 0, "firmware returned every page");
    assert!(dev.dma_faults().is_empty(), "{:?}", dev.dma_faults());
}

#[test]
fn a_failing_step_cleans_up_and_says_which() {
    let dev = SimDevice::new(SimConfig::default());
    dev.inject(Fault::Status { opcode: Opcode::Rst2initQp.raw(), status: 3, syndrome: 0x1234, times: 1 });
    let err = run(dev.mmio(), dev.dma(), (), &mut dev.delay()).unwrap_err();
    assert!(matches!(err, RunError::Step { what: "RST2INIT_QP", .. }), "{err:?}");
    assert!(err.to_string().starts_with("RST2INIT_QP failed"), "{err}");
    // The QP, CQ and PD were destroyed and the HCA torn down all the same.
    let ops: Vec<u16> = dev.executed().iter().map(|c| c.opcode).collect();
    for op in [Opcode::DestroyQp, Opcode::DestroyCq, Opcode::DeallocPd, Opcode::DisableHca] {
        assert!(ops.contains(&op.raw()), "{op:?} missing from {ops:x?}");
    }
    assert_eq!(dev.dma_outstanding(), (0, 0));
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

//! Regressions found by the fuzz targets in `fuzz/` (see FUZZING.md): each test feeds the input that failed, in
//! the form the core sees it, and checks the property the target asserted.

use mlx5_core::cq::CqeSize;
use mlx5_core::eq::{Eqe, Event};
use mlx5_core::hca::{Config, Hca};
use mlx5_core::prm::{c, EventType};
use mlx5_core::verbs::CqAttr;
use mlx5_sim::{SimConfig, SimDevice};

type SimHca = Hca<mlx5_sim::SimMmio, mlx5_sim::SimDma>;

/// `eqe` target (`hca_events`, artifact `leak-92dbcd25…`): a page-request EQE for a function firmware then refuses
/// pages for arrived just before a DESTROY_CQ. The command completed, but the events served right after it failed
/// (MANAGE_PAGES answered BAD_PARAM) and `Hca::exec` returned that failure as DESTROY_CQ's own: `destroy_cq`
/// handed the CQ back as not destroyed while firmware had destroyed it, and its ring leaked. A command that
/// completed is reported as completed.
#[test]
fn refused_page_request_does_not_fail_the_command_that_completed() {
    let dev = SimDevice::new(SimConfig::default());
    let mut d = dev.delay();
    let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let cq = hca.create_cq(CqAttr { cqe: 15, cqe_size: CqeSize::B64, overrun_ignore: false }, &mut d).unwrap();
    // Firmware asks pages for function 0x4858 (the fuzz input's bytes), then refuses them (BAD_FUNCTION).
    let e = Eqe::emit(&Event::PageRequest { function_id: 0x4858, ec_function: false, num_pages: 0x2cf5 });
    let mut data = [0u8; mlx5_sim::EQE_DATA_LEN];
    data.copy_from_slice(&e.0[c::mlx5_eqe::DATA.off..c::mlx5_eqe::DATA.end()]);
    assert!(dev.post_event(EventType::PageRequest.raw(), 0, data).is_some());
    let before = dev.object_counts();
    hca.destroy_cq(cq, &mut d).map_err(|e| e.error).expect("DESTROY_CQ completed, so destroy_cq succeeds");
    assert_ne!(dev.object_counts(), before, "firmware destroyed the CQ");
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0), "every DMA allocation returned");
}

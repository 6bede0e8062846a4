//! `mlx5-core` reused on bare metal: the three traits the core needs, implemented for a Cortex-M class
//! microcontroller with a PCIe root complex, and [`run`], a bring-up → PD → CQ → RC QP → INIT → teardown sequence
//! generic over those traits.
//!
//! * [`mmio::Bar`]: `Mmio` over BAR 0 at a fixed CPU address (raw-pointer volatile, big endian, the 64-bit doorbell
//!   on a 32-bit core explained where it is written);
//! * [`arena::Arena`]: `Dma` from a static arena (bump pointer and a `heapless` free list; iova = CPU address);
//! * [`delay::CycleDelay`]: `DelayNs` from the DWT cycle counter.
//!
//! The binary (`src/main.rs`) wires them to fixed addresses for `thumbv7em-none-eabihf`. On the host the same
//! [`run`] runs against `mlx5_sim::SimDevice` (`tests/sim.rs`), which is the proof that the firmware's code path is
//! the real driver's.

#![cfg_attr(not(test), no_std)]

pub mod arena;
pub mod delay;
pub mod mmio;

use mlx5_core::hal::{DelayNs, Dma, Mmio};
use mlx5_core::hca::{BringupError, Config, Error, Fixed, Hca};
use mlx5_core::hca::{CqAttr, Pd, QpInitAttr};
use mlx5_core::qp::{QpAttr, QpAttrMask, QpCap, QpState, QpType};
use mlx5_core::trace::CmdTrace;

/// Firmware-page chunks the HCA may hold (64 pages of 4 KiB each; see `mlx5_core::pages::CHUNK_PAGES`). Sized for
/// the arena, not for a ConnectX's appetite: a real adapter's QUERY_PAGES answer decides what a product needs.
pub const FW_PAGE_CHUNKS: usize = 4;
/// CQs the HCA tracks completion events for.
pub const MAX_CQS: usize = 4;

/// The HCA as this firmware instantiates it: small fixed tables instead of the host's defaults.
pub type FwHca<M, D, T> = Hca<M, D, T, Fixed<FW_PAGE_CHUNKS, MAX_CQS>>;

/// How the firmware brings the function up: Linux's sequence, with event queues sized for a microcontroller.
pub fn config() -> Config {
    Config {
        driver_version: concat!("mlx5-firmware-example,", env!("CARGO_PKG_VERSION")),
        // 64 usable entries each (+ MLX5_NUM_SPARE_EQE, rounded up to a power of two): 12 KiB per EQ instead of
        // the host's 1 MiB-class completion EQ.
        async_eq_nent: 64,
        comp_eq_nent: 64,
        ..Config::default()
    }
}

/// What [`run`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub fw_rev: (u16, u16, u16),
    pub pdn: u32,
    pub cqn: u32,
    pub qpn: u32,
    /// The QP's state as QUERY_QP reported it after the RESET → INIT transition.
    pub qp_state: QpState,
    pub pages_reclaimed: usize,
}

/// Where [`run`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunError {
    BringUp(BringupError),
    /// A verbs step (`what`) failed; everything created before it was destroyed and the HCA torn down.
    Step {
        what: &'static str,
        error: Error,
    },
    /// Teardown reported an error (its report still returned every page it could).
    Teardown(Error),
}

impl core::fmt::Display for RunError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RunError::BringUp(e) => write!(f, "{e}"),
            RunError::Step { what, error } => write!(f, "{what} failed: {error}"),
            RunError::Teardown(e) => write!(f, "teardown failed: {e}"),
        }
    }
}

fn step(what: &'static str) -> impl FnOnce(Error) -> RunError {
    move |error| RunError::Step { what, error }
}

/// Brings the HCA up (Linux's order: `Hca::bring_up`), allocates a PD, creates a CQ and an RC QP on it, moves the
/// QP RESET → INIT and checks the state with QUERY_QP, then destroys everything in reverse and tears the HCA down.
/// Whatever fails, what was created is destroyed and the HCA torn down before the error is returned.
pub fn run<M: Mmio, D: Dma, T: CmdTrace>(
    mmio: M,
    dma: D,
    trace: T,
    delay: &mut impl DelayNs,
) -> Result<Report, RunError> {
    let mut hca: FwHca<M, D, T> = Hca::bring_up(mmio, dma, trace, delay, config()).map_err(RunError::BringUp)?;
    let fw_rev = hca.fw_rev();
    let objects = with_hca(&mut hca, delay);
    let down = hca.teardown(delay);
    let (pdn, cqn, qpn, qp_state) = objects?;
    let down = down.map_err(RunError::Teardown)?;
    if let Some(e) = down.first_error {
        return Err(RunError::Teardown(e));
    }
    Ok(Report { fw_rev, pdn, cqn, qpn, qp_state, pages_reclaimed: down.pages_reclaimed })
}

type Objects = (u32, u32, u32, QpState);

fn with_hca<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    delay: &mut impl DelayNs,
) -> Result<Objects, RunError> {
    let pd = hca.alloc_pd(delay).map_err(step("ALLOC_PD"))?;
    let r = with_pd(hca, &pd, delay);
    let freed = hca.dealloc_pd(pd, delay).map_err(|e| RunError::Step { what: "DEALLOC_PD", error: e.error });
    let r = r?;
    freed?;
    Ok(r)
}

fn with_pd<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    pd: &Pd,
    delay: &mut impl DelayNs,
) -> Result<Objects, RunError> {
    let cq = hca.create_cq(CqAttr { cqe: 15, ..CqAttr::default() }, delay).map_err(step("CREATE_CQ"))?;
    let cqn = cq.cqn();
    let r = (|| {
        let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: true };
        let mut qp = hca.create_qp(pd, &cq, &cq, attr, delay).map_err(step("CREATE_QP"))?;
        let qpn = qp.qpn();
        let init = QpAttr { qp_state: QpState::Init, ..QpAttr::default() };
        let mask = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
        let moved = hca.modify_qp(&mut qp, &init, mask, delay).map_err(step("RST2INIT_QP"));
        let state = match moved {
            Ok(()) => hca.query_qp(&qp, delay).map(|q| q.state).map_err(step("QUERY_QP")),
            Err(e) => Err(e),
        };
        let destroyed = hca.destroy_qp(qp, delay).map_err(|e| RunError::Step { what: "DESTROY_QP", error: e.error });
        let state = state?;
        destroyed?;
        Ok((pd.pdn(), cqn, qpn, state))
    })();
    let destroyed = hca.destroy_cq(cq, delay).map_err(|e| RunError::Step { what: "DESTROY_CQ", error: e.error });
    let r = r?;
    destroyed?;
    Ok(r)
}

//! A walk through every firmware command the core implements, in the order a driver uses them: enable the
//! function, agree on ISSI, give boot pages, read and set the general capabilities, give init pages, INIT_HCA,
//! allocate a UAR and a PD, create an EQ and a CQ on it, then undo everything and take every page back.
//!
//! It is generic over the core's traits, so the same walk runs on the simulator and (later) over VFIO.

use mlx5_core::cmd::Pas;
use mlx5_core::cmdq::{CmdError, CmdQueue, Command};
use mlx5_core::cq::{destroy_cq, CqContext, CqeSize, CreateCq};
use mlx5_core::eq::{destroy_eq, CreateEq, EqContext};
use mlx5_core::hal::{DelayNs, Dma, DmaError, DmaRegion, Mmio};
use mlx5_core::init::{
    disable_hca, enable_hca, init_hca, set_issi, teardown_hca, CapMode, CapType, QueryHcaCap, QueryIssi, SetHcaCap,
};
use mlx5_core::pages::{ManagePagesGive, ManagePagesTake, PageStage, QueryPages, FW_PAGE_SIZE};
use mlx5_core::pd::{alloc_pd, dealloc_pd};
use mlx5_core::prm::{consts, ifc, EventType, MsgBuf};
use mlx5_core::trace::CmdTrace;
use mlx5_core::uar::{alloc_uar, dealloc_uar};

/// What the tour did, for printing.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TourReport {
    pub issi: u16,
    pub boot_pages: i32,
    pub init_pages: i32,
    pub pages_given: usize,
    pub pages_taken: usize,
    pub log_max_qp: u32,
    pub log_max_cq_sz: u32,
    pub uar: u32,
    pub pd: u32,
    pub eqn: u8,
    pub cqn: u32,
}

/// Why the tour stopped.
#[derive(Debug, thiserror::Error)]
pub enum TourError {
    #[error("{step}: {source}")]
    Cmd {
        step: &'static str,
        #[source]
        source: CmdError,
    },
    #[error("{step}: {source}")]
    Dma {
        step: &'static str,
        #[source]
        source: DmaError,
    },
    #[error("firmware returned {taken} of the {given} pages it was given")]
    PagesNotReturned { given: usize, taken: usize },
}

/// Tracks host memory handed to the device so every page is returned exactly once, on success or error.
struct Memory<'d, D: Dma> {
    dma: &'d D,
    regions: Vec<DmaRegion>,
}

impl<'d, D: Dma> Memory<'d, D> {
    /// Allocates `len` bytes and returns their bus address; the region stays here until `release`.
    fn alloc(&mut self, step: &'static str, len: usize) -> Result<u64, TourError> {
        let r = self.dma.alloc(len, FW_PAGE_SIZE).map_err(|source| TourError::Dma { step, source })?;
        let iova = r.iova();
        self.regions.push(r);
        Ok(iova)
    }

    fn pages(&mut self, step: &'static str, n: usize) -> Result<Vec<u64>, TourError> {
        (0..n).map(|_| self.alloc(step, FW_PAGE_SIZE)).collect()
    }

    /// Frees everything. Only called once the device no longer owns any of it (the function is disabled).
    fn release(&mut self) {
        for r in self.regions.drain(..) {
            // SAFETY: each region came from this allocator once; the caller has disabled the function (or
            // taken the pages back), so the device no longer accesses them.
            unsafe { self.dma.free(r) };
        }
    }
}

fn run<M: Mmio, D: Dma, T: CmdTrace, C: Command>(
    q: &mut CmdQueue<M, D, T>,
    delay: &mut impl DelayNs,
    step: &'static str,
    mut cmd: C,
) -> Result<C::Output, TourError> {
    q.exec(&mut cmd, delay).map_err(|source| TourError::Cmd { step, source })
}

fn give<M: Mmio, D: Dma, T: CmdTrace>(
    q: &mut CmdQueue<M, D, T>,
    delay: &mut impl DelayNs,
    mem: &mut Memory<'_, impl Dma>,
    stage: PageStage,
    step: &'static str,
    given: &mut usize,
) -> Result<i32, TourError> {
    let want = run(q, delay, step, QueryPages { stage })?.num_pages;
    if want > 0 {
        let pages = mem.pages(step, want as usize)?;
        run(q, delay, step, ManagePagesGive { function_id: 0, pages: Pas::List(&pages) })?;
        *given += pages.len();
    }
    Ok(want)
}

/// Runs the tour. On error the function is disabled and host memory released before returning.
pub fn run_tour<M: Mmio, D: Dma + Clone, T: CmdTrace>(
    q: &mut CmdQueue<M, D, T>,
    delay: &mut impl DelayNs,
) -> Result<TourReport, TourError> {
    let dma = q.dma().clone();
    let mut mem = Memory { dma: &dma, regions: Vec::new() };
    let mut report = TourReport::default();
    let result = tour(q, delay, &mut mem, &mut report);
    if result.is_err() {
        // Best effort, in Linux's teardown order: stop the HCA, take back what firmware holds, disable the
        // function. Only then is the memory free to release.
        let _ = q.exec(&mut teardown_hca(), delay);
        let _ = reclaim(q, delay, &mut report);
        let _ = q.exec(&mut disable_hca(0), delay);
    }
    mem.release();
    result.map(|()| report)
}

fn tour<M: Mmio, D: Dma, T: CmdTrace>(
    q: &mut CmdQueue<M, D, T>,
    delay: &mut impl DelayNs,
    mem: &mut Memory<'_, impl Dma>,
    r: &mut TourReport,
) -> Result<(), TourError> {
    run(q, delay, "enable HCA", enable_hca(0))?;
    let issi = run(q, delay, "query ISSI", QueryIssi)?;
    r.issi = if issi.supports(1) { 1 } else { 0 };
    if r.issi == 1 {
        run(q, delay, "set ISSI", set_issi(1))?;
    }
    r.boot_pages = give(q, delay, mem, PageStage::Boot, "boot pages", &mut r.pages_given)?;
    let max = run(q, delay, "query max caps", QueryHcaCap { cap: CapType::General, mode: CapMode::Max })?;
    let cur = run(q, delay, "query current caps", QueryHcaCap { cap: CapType::General, mode: CapMode::Current })?;
    r.log_max_qp = max.get(ifc::cmd_hca_cap::LOG_MAX_QP);
    r.log_max_cq_sz = max.get(ifc::cmd_hca_cap::LOG_MAX_CQ_SZ);
    run(q, delay, "set caps", SetHcaCap { cap: CapType::General, block: &cur })?;
    r.init_pages = give(q, delay, mem, PageStage::Init, "init pages", &mut r.pages_given)?;
    run(q, delay, "init HCA", init_hca())?;

    r.uar = run(q, delay, "allocate UAR", alloc_uar())?;
    r.pd = run(q, delay, "allocate PD", alloc_pd())?;

    // An EQ of 128 EQEs (8 KiB, two 4 KiB pages) for command completions and page requests.
    let eq_pages = mem.pages("EQ buffer", 2)?;
    let mask = (1u64 << EventType::Cmd.raw()) | (1u64 << EventType::PageRequest.raw());
    let eq = CreateEq {
        uid: 0,
        ctx: EqContext { log_eq_size: 7, uar_page: r.uar, ..EqContext::default() },
        event_bitmask: [mask, 0, 0, 0],
        pas: Pas::List(&eq_pages),
    };
    r.eqn = run(q, delay, "create EQ", eq)?;
    // A CQ of 256 64-byte CQEs (16 KiB, four pages) with its doorbell record.
    let cq_pages = mem.pages("CQ buffer", 4)?;
    let dbr = mem.alloc("CQ doorbell record", 64)?;
    let cq = CreateCq {
        ctx: CqContext {
            cqe_sz: CqeSize::B64,
            log_cq_size: 8,
            uar_page: r.uar,
            c_eqn: r.eqn.into(),
            dbr_addr: dbr,
            ..CqContext::default()
        },
        pas: Pas::List(&cq_pages),
    };
    r.cqn = run(q, delay, "create CQ", cq)?;

    run(q, delay, "destroy CQ", destroy_cq(r.cqn))?;
    run(q, delay, "destroy EQ", destroy_eq(r.eqn))?;
    run(q, delay, "deallocate PD", dealloc_pd(r.pd))?;
    run(q, delay, "deallocate UAR", dealloc_uar(r.uar))?;
    run(q, delay, "teardown HCA", teardown_hca())?;
    reclaim(q, delay, r)?;
    run(q, delay, "disable HCA", disable_hca(0))?;
    Ok(())
}

/// Takes every given page back, in batches as `reclaim_pages` does; stops if firmware returns none.
fn reclaim<M: Mmio, D: Dma, T: CmdTrace>(
    q: &mut CmdQueue<M, D, T>,
    delay: &mut impl DelayNs,
    r: &mut TourReport,
) -> Result<(), TourError> {
    let mut buf = vec![0u64; consts::MLX5_CMD_DATA_BLOCK_SIZE as usize / 8];
    while r.pages_taken < r.pages_given {
        let n = run(q, delay, "reclaim pages", ManagePagesTake { function_id: 0, pages: &mut buf[..] })?;
        if n == 0 {
            return Err(TourError::PagesNotReturned { given: r.pages_given, taken: r.pages_taken });
        }
        r.pages_taken += n;
    }
    Ok(())
}

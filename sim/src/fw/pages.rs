//! Firmware pages: the boot, init and regular page needs, MANAGE_PAGES (give, take) and QUERY_PAGES, the page
//! balance page requests report, and pages a dead firmware still owned (the kernel's `pagealloc.c`).

use std::collections::BTreeSet;

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use super::hca::HcaState;
use super::reply::{bad_param, err, rd, rd16, CmdErr};
use super::syndrome;
use crate::config::SimConfig;
use crate::dma::DmaSpace;

/// Firmware pages are 4 KiB.
pub(super) const FW_PAGE: u64 = consts::MLX5_ADAPTER_PAGE_SIZE as u64;

/// The pages firmware owns and the needs it reports, as MANAGE_PAGES and QUERY_PAGES see them.
#[derive(Debug)]
pub(crate) struct Pages {
    owned: BTreeSet<u64>,
    boot: i64,
    init: i64,
    regular: i64,
    /// The configured init and regular needs, restored by TEARDOWN_HCA.
    cfg: (i64, i64),
    /// Needed pages firmware has offered back (negative page requests), for the next MANAGE_PAGES(take).
    returnable: u64,
    /// Pages accepted by MANAGE_PAGES(give), ever: commands waiting for pages count what each give adds.
    pub(crate) given: u64,
    /// Pages the driver freed while a dead firmware still owned them.
    abandoned: usize,
}

impl Pages {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        Self {
            owned: BTreeSet::new(),
            boot: cfg.boot_pages.into(),
            init: cfg.init_pages.into(),
            regular: cfg.regular_pages.into(),
            cfg: (cfg.init_pages.into(), cfg.regular_pages.into()),
            returnable: 0,
            given: 0,
            abandoned: 0,
        }
    }

    /// Disabling resets the function: firmware lets go of every page it still held; returns how many.
    pub(super) fn release_all(&mut self) -> usize {
        let n = self.owned.len();
        self.owned.clear();
        n
    }

    /// The needs grown while running end with it; a later INIT_HCA starts from the configured ones.
    pub(super) fn reset_needs(&mut self) {
        (self.init, self.regular) = self.cfg;
        self.returnable = 0;
    }

    pub(crate) fn owned(&self) -> usize {
        self.owned.len()
    }

    /// Firmware-owned pages inside `iova..iova + len`.
    pub(crate) fn pages_in(&self, iova: u64, len: u64) -> usize {
        self.owned.range(iova..iova.saturating_add(len)).count()
    }

    /// Pages needed before INIT_HCA.
    pub(super) fn startup_pages(&self) -> i64 {
        self.boot.max(0) + self.init.max(0)
    }

    /// Every page firmware needs to run: startup pages plus the regular need.
    pub(super) fn need(&self) -> i64 {
        self.startup_pages() + self.regular
    }

    /// Pages firmware still wants (negative: pages it would return), as QUERY_PAGES(regular) reports.
    pub(crate) fn page_balance(&self) -> i64 {
        self.need() - self.returnable as i64 - self.owned.len() as i64
    }

    /// The accounting of a page request: a positive one grows the need of the current stage (regular once
    /// initialized, init before), a negative one marks needed pages returnable.
    pub(crate) fn account_page_request(&mut self, state: HcaState, num_pages: i32) {
        let n = i64::from(num_pages);
        if n > 0 {
            if state == HcaState::Initialized {
                self.regular += n;
            } else {
                self.init += n;
            }
        } else {
            let most = self.need().max(0) as u64;
            self.returnable = self.returnable.saturating_add(n.unsigned_abs()).min(most);
        }
    }

    /// Forgets the pages in `iova..iova + len` a dead firmware owned: the driver freed them.
    pub(crate) fn abandon(&mut self, iova: u64, len: u64) {
        let gone: Vec<u64> = self.owned.range(iova..iova.saturating_add(len)).copied().collect();
        for pa in &gone {
            self.owned.remove(pa);
        }
        self.abandoned += gone.len();
    }

    pub(crate) fn abandoned(&self) -> usize {
        self.abandoned
    }

    pub(super) fn query_pages(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_pages_in as i;
        use ifc::query_pages_out as o;
        if rd(inp, i::FUNCTION_ID) != 0 || rd(inp, i::EMBEDDED_CPU_FUNCTION) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let owned = self.owned.len() as i64;
        let boot = self.boot.max(0);
        let init = self.startup_pages();
        // Boot and init requests never go negative; the regular count does when firmware has pages to spare.
        // The init need is reported only once the boot pages are in: firmware cannot use init pages before.
        let owed = match rd16(inp, ifc::mbox_in::OP_MOD) {
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES => (boot - owned).max(0),
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES if owned < boot => 0,
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES => (init - owned).max(0),
            consts::MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES => self.page_balance(),
            _ => return Err(bad_param(syndrome::BAD_OP_MOD)),
        };
        let owed = owed.clamp(i32::MIN.into(), i32::MAX.into()) as i32;
        out.set(o::FUNCTION_ID, 0);
        out.set(o::NUM_PAGES, owed as u32);
        Ok(())
    }

    pub(super) fn manage_pages(
        &mut self,
        state: HcaState,
        dma: &DmaSpace,
        inp: &[u8],
        out: &mut [u8],
        outlen: usize,
    ) -> Result<(), CmdErr> {
        use ifc::manage_pages_in as i;
        use ifc::manage_pages_out as o;
        if rd(inp, i::FUNCTION_ID) != 0 || rd(inp, i::EMBEDDED_CPU_FUNCTION) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let n = u64::from(rd(inp, i::INPUT_NUM_ENTRIES));
        let pas_bytes = n * u64::from(i::PAS.elem_bits / 8);
        match rd16(inp, ifc::mbox_in::OP_MOD) {
            consts::MLX5_PAGES_CANT_GIVE => Ok(()),
            consts::MLX5_PAGES_GIVE => {
                if (inp.len() as u64) < i::PAS.byte_off() as u64 + pas_bytes {
                    return Err(err(CmdStatus::BadInpLen, syndrome::BAD_INPUT_LEN));
                }
                // Validate every page before taking any, so a failed command changes nothing.
                let mut new = BTreeSet::new();
                for k in 0..n as u32 {
                    let pa = inp.get64(i::PAS.elem(k));
                    if !pa.is_multiple_of(FW_PAGE) {
                        return Err(bad_param(syndrome::PAGE_MISALIGNED));
                    }
                    if !dma.is_mapped(pa, FW_PAGE as usize) {
                        return Err(bad_param(syndrome::PAGE_NOT_MAPPED));
                    }
                    if self.owned.contains(&pa) || !new.insert(pa) {
                        return Err(bad_param(syndrome::PAGE_ALREADY_OWNED));
                    }
                }
                self.given += new.len() as u64;
                self.owned.extend(new);
                Ok(())
            }
            consts::MLX5_PAGES_TAKE => {
                if (outlen as u64) < o::PAS.byte_off() as u64 + pas_bytes {
                    return Err(err(CmdStatus::BadOutpLen, syndrome::BAD_OUTPUT_LEN));
                }
                // An initialized HCA keeps what it needs to run: it returns the pages it offered back plus those
                // above its need. Before INIT_HCA and after TEARDOWN_HCA it returns everything.
                let owned = self.owned.len() as u64;
                let (keep, above) = if state == HcaState::Initialized {
                    let need = self.need().max(0) as u64;
                    (need.saturating_sub(self.returnable), owned.saturating_sub(need))
                } else {
                    (0, owned)
                };
                let count = n.min(owned.saturating_sub(keep)) as u32;
                for k in 0..count {
                    let Some(pa) = self.owned.pop_first() else { break };
                    out.set64(o::PAS.elem(k), pa);
                }
                // Pages above the need come back first; the rest were offered back and leave the need with it.
                let offered = u64::from(count).saturating_sub(above);
                if state == HcaState::Initialized && offered > 0 {
                    self.returnable -= offered.min(self.returnable);
                    self.regular -= offered as i64;
                }
                out.set(o::OUTPUT_NUM_ENTRIES, count);
                Ok(())
            }
            _ => Err(bad_param(syndrome::BAD_OP_MOD)),
        }
    }
}

//! Protection domains and UAR pages: ALLOC_PD / DEALLOC_PD and ALLOC_UAR / DEALLOC_UAR (the kernel's
//! `mlx5_core_alloc_pd`, `mlx5_cmd_alloc_uar`).

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::reply::{bad_param, err, rd, CmdErr};
use super::{alloc_id_set, syndrome, Firmware};

impl Firmware {
    pub(crate) fn uar_allocated(&self, uar: u32) -> bool {
        self.uars.contains(&uar)
    }

    pub(super) fn alloc_pd(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        let limit = 1u32 << self.caps.gen(ifc::cmd_hca_cap::LOG_MAX_PD).min(24);
        let pd = alloc_id_set(&self.pds, &mut self.next_pd, 1, limit)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.pds.insert(pd);
        out.set(ifc::alloc_pd_out::PD, pd);
        Ok(())
    }

    pub(super) fn dealloc_pd(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let pd = rd(inp, ifc::dealloc_pd_in::PD);
        if !self.pds.contains(&pd) {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        if self.mkeys.values().any(|m| m.pd == pd) || self.qps.values().any(|q| q.pd == pd) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.pds.remove(&pd);
        Ok(())
    }

    pub(super) fn alloc_uar(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        let hi = self.uar_first.saturating_add(self.uar_count);
        let uar = alloc_id_set(&self.uars, &mut self.next_uar, self.uar_first, hi)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.uars.insert(uar);
        out.set(ifc::alloc_uar_out::UAR, uar);
        Ok(())
    }

    pub(super) fn dealloc_uar(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let uar = rd(inp, ifc::dealloc_uar_in::UAR);
        if !self.uars.contains(&uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        let qp_uses = self.qps.values().any(|q| q.uar == uar);
        if qp_uses || self.eqs.values().any(|e| e.uar == uar) || self.cqs.values().any(|c| c.uar == uar) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.uars.remove(&uar);
        Ok(())
    }
}

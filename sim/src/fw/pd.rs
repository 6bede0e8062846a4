//! Protection domains and UAR pages: ALLOC_PD / DEALLOC_PD and ALLOC_UAR / DEALLOC_UAR (the kernel's
//! `mlx5_core_alloc_pd`, `mlx5_cmd_alloc_uar`).

use std::ops::{Deref, DerefMut};

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::ids::IdSet;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// The protection domains.
#[derive(Debug)]
pub(crate) struct PdTable(IdSet);

impl Deref for PdTable {
    type Target = IdSet;
    fn deref(&self) -> &IdSet {
        &self.0
    }
}

impl DerefMut for PdTable {
    fn deref_mut(&mut self) -> &mut IdSet {
        &mut self.0
    }
}

impl PdTable {
    pub(crate) fn new() -> Self {
        PdTable(IdSet::new(1))
    }

    pub(super) fn alloc(&mut self, caps: &Caps, out: &mut [u8]) -> Result<(), CmdErr> {
        let limit = 1u32 << caps.gen(ifc::cmd_hca_cap::LOG_MAX_PD).min(24);
        let pd = self.take(1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        out.set(ifc::alloc_pd_out::PD, pd);
        Ok(())
    }

    pub(super) fn dealloc(&mut self, in_use: &dyn Fn(u32) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let pd = rd(inp, ifc::dealloc_pd_in::PD);
        if !self.contains(pd) {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        if in_use(pd) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.give_back(pd);
        Ok(())
    }
}

/// The allocated UAR pages (BAR page numbers, after the initialization segment): `count` pages from page `first`.
#[derive(Debug)]
pub(crate) struct UarTable {
    ids: IdSet,
    first: u32,
    count: u32,
}

impl Deref for UarTable {
    type Target = IdSet;
    fn deref(&self) -> &IdSet {
        &self.ids
    }
}

impl DerefMut for UarTable {
    fn deref_mut(&mut self) -> &mut IdSet {
        &mut self.ids
    }
}

impl UarTable {
    /// `count` pages from page `first` of the BAR.
    pub(crate) fn new(first: u32, count: u32) -> Self {
        UarTable { ids: IdSet::new(first), first, count }
    }

    pub(super) fn alloc(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        let hi = self.first.saturating_add(self.count);
        let uar = self.ids.take(self.first, hi).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        out.set(ifc::alloc_uar_out::UAR, uar);
        Ok(())
    }

    pub(super) fn dealloc(&mut self, in_use: &dyn Fn(u32) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let uar = rd(inp, ifc::dealloc_uar_in::UAR);
        if !self.contains(uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        if in_use(uar) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.ids.give_back(uar);
        Ok(())
    }
}

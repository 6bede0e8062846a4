//! Protection domains and UAR pages: ALLOC_PD / DEALLOC_PD and ALLOC_UAR / DEALLOC_UAR (the kernel's
//! `mlx5_core_alloc_pd`, `mlx5_cmd_alloc_uar`).

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::reply::{bad_param, err, rd, CmdErr};
use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};

use super::alloc_id_set;
use super::caps::Caps;
use super::syndrome;

/// The protection domains, and the number ALLOC_PD tries next.
#[derive(Debug)]
pub(crate) struct PdTable {
    set: BTreeSet<u32>,
    next: u32,
}

impl Deref for PdTable {
    type Target = BTreeSet<u32>;
    #[inline]
    fn deref(&self) -> &BTreeSet<u32> {
        &self.set
    }
}

impl DerefMut for PdTable {
    #[inline]
    fn deref_mut(&mut self) -> &mut BTreeSet<u32> {
        &mut self.set
    }
}

impl PdTable {
    pub(crate) fn new() -> Self {
        PdTable { set: BTreeSet::new(), next: 1 }
    }

    pub(super) fn alloc(&mut self, caps: &Caps, out: &mut [u8]) -> Result<(), CmdErr> {
        let limit = 1u32 << caps.gen(ifc::cmd_hca_cap::LOG_MAX_PD).min(24);
        let pd =
            alloc_id_set(&self.set, &mut self.next, 1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.set.insert(pd);
        out.set(ifc::alloc_pd_out::PD, pd);
        Ok(())
    }

    pub(super) fn dealloc(&mut self, in_use: &dyn Fn(u32) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let pd = rd(inp, ifc::dealloc_pd_in::PD);
        if !self.set.contains(&pd) {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        if in_use(pd) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.set.remove(&pd);
        Ok(())
    }
}

/// The allocated UAR pages (BAR page numbers, after the initialization segment), and the page ALLOC_UAR tries
/// next.
#[derive(Debug)]
pub(crate) struct UarTable {
    set: BTreeSet<u32>,
    next: u32,
    first: u32,
    count: u32,
}

impl Deref for UarTable {
    type Target = BTreeSet<u32>;
    #[inline]
    fn deref(&self) -> &BTreeSet<u32> {
        &self.set
    }
}

impl DerefMut for UarTable {
    #[inline]
    fn deref_mut(&mut self) -> &mut BTreeSet<u32> {
        &mut self.set
    }
}

impl UarTable {
    /// `count` pages from page `first` of the BAR.
    pub(crate) fn new(first: u32, count: u32) -> Self {
        UarTable { set: BTreeSet::new(), next: first, first, count }
    }

    pub(super) fn alloc(&mut self, out: &mut [u8]) -> Result<(), CmdErr> {
        let hi = self.first.saturating_add(self.count);
        let uar = alloc_id_set(&self.set, &mut self.next, self.first, hi)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.set.insert(uar);
        out.set(ifc::alloc_uar_out::UAR, uar);
        Ok(())
    }

    pub(super) fn dealloc(&mut self, in_use: &dyn Fn(u32) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let uar = rd(inp, ifc::dealloc_uar_in::UAR);
        if !self.set.contains(&uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        if in_use(uar) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.set.remove(&uar);
        Ok(())
    }
}

//! Transport interface sends: CREATE_TIS / DESTROY_TIS. mlx5e makes one TIS per traffic class in its transport
//! domain; every SQ names one (`sqc.tis_num_0`), so a TIS an SQ still uses cannot be destroyed.

use std::collections::BTreeMap;

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// One TIS: its transport domain.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tis {
    pub(crate) td: u32,
}

/// The TIS table.
#[derive(Debug, Default)]
pub(crate) struct TisTable {
    pub(crate) map: BTreeMap<u32, Tis>,
    next: u32,
}

impl TisTable {
    pub(crate) fn new() -> Self {
        Self { map: BTreeMap::new(), next: 1 }
    }

    pub(super) fn create(
        &mut self,
        caps: &Caps,
        td_exists: &dyn Fn(u32) -> bool,
        inp: &[u8],
        out: &mut [u8],
    ) -> Result<(), CmdErr> {
        use ifc::tisc as t;
        let ctx = ifc::create_tis_in::CTX;
        let td = rd(inp, t::TRANSPORT_DOMAIN.at(ctx));
        if !td_exists(td) {
            return Err(bad_param(syndrome::TD_INVALID));
        }
        let limit = 1u32 << caps.gen(ifc::cmd_hca_cap::LOG_MAX_TIS).min(24);
        let tisn =
            alloc_id(&self.map, &mut self.next, 1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.map.insert(tisn, Tis { td });
        out.set(ifc::create_tis_out::TISN, tisn);
        Ok(())
    }

    pub(super) fn destroy(&mut self, in_use: &dyn Fn(u32) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let tisn = rd(inp, ifc::destroy_tis_in::TISN);
        if !self.map.contains_key(&tisn) {
            return Err(bad_param(syndrome::TIS_INVALID));
        }
        if in_use(tisn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&tisn);
        Ok(())
    }
}

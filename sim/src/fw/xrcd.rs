//! XRC domains: ALLOC_XRCD / DEALLOC_XRCD. The general capability `xrc` advertises them, and `mlx5_ib` allocates
//! two at probe (its device-resources stage) whenever it is set; the simulator advertised `xrc` without the
//! commands, which failed Linux's probe (found under UML). XRC SRQs name a domain (fw/srq.rs); destroying a
//! domain one still names is not refused yet.

use std::ops::{Deref, DerefMut};

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::ids::IdSet;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// The XRC domains.
#[derive(Debug)]
pub(crate) struct XrcdTable(IdSet);

impl Deref for XrcdTable {
    type Target = IdSet;
    fn deref(&self) -> &IdSet {
        &self.0
    }
}

impl DerefMut for XrcdTable {
    fn deref_mut(&mut self) -> &mut IdSet {
        &mut self.0
    }
}

impl XrcdTable {
    pub(crate) fn new() -> Self {
        Self(IdSet::new(1))
    }

    pub(super) fn alloc(&mut self, caps: &Caps, out: &mut [u8]) -> Result<(), CmdErr> {
        if caps.gen(ifc::cmd_hca_cap::XRC) == 0 {
            return Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE));
        }
        let limit = 1u32 << caps.gen(ifc::cmd_hca_cap::LOG_MAX_XRCD).min(24);
        let x = self.take(1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        out.set(ifc::alloc_xrcd_out::XRCD, x);
        Ok(())
    }

    pub(super) fn dealloc(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let x = rd(inp, ifc::dealloc_xrcd_in::XRCD);
        if !self.give_back(x) {
            return Err(bad_param(syndrome::XRCD_INVALID));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::submit::Harness;
    use mlx5_core::prm::consts;

    #[test]
    fn xrcds_are_allocated_distinct_and_freed_once() {
        let mut h = Harness::inline();
        h.bring_up();
        let (a, b) = (h.alloc_xrcd(), h.alloc_xrcd());
        assert_ne!(a, b);
        let mut inp = vec![0u8; ifc::dealloc_xrcd_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DEALLOC_XRCD.into());
        inp.set(ifc::dealloc_xrcd_in::XRCD, a);
        assert_eq!(h.cmd(&inp, ifc::dealloc_xrcd_out::SIZE_BYTES).0, 0);
        assert_eq!(h.cmd(&inp, ifc::dealloc_xrcd_out::SIZE_BYTES).1, syndrome::XRCD_INVALID);
    }
}

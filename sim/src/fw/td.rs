//! Transport domains: ALLOC_TRANSPORT_DOMAIN / DEALLOC_TRANSPORT_DOMAIN. The general capability
//! `log_max_transport_domain` advertises them, and `mlx5_ib` allocates one for every user context it opens
//! (`mlx5_ib_alloc_transport_domain`, on either link layer); the simulator advertised the capability without the
//! commands, so `ibv_open_device` would have failed (found reading the kernel for the UML run).

use std::ops::{Deref, DerefMut};

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::ids::IdSet;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// The transport domains.
#[derive(Debug)]
pub(crate) struct TdTable(IdSet);

impl Deref for TdTable {
    type Target = IdSet;
    fn deref(&self) -> &IdSet {
        &self.0
    }
}

impl DerefMut for TdTable {
    fn deref_mut(&mut self) -> &mut IdSet {
        &mut self.0
    }
}

impl TdTable {
    pub(crate) fn new() -> Self {
        Self(IdSet::new(1))
    }

    pub(super) fn alloc(&mut self, caps: &Caps, out: &mut [u8]) -> Result<(), CmdErr> {
        let log_max = caps.gen(ifc::cmd_hca_cap::LOG_MAX_TRANSPORT_DOMAIN);
        if log_max == 0 {
            return Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE));
        }
        let limit = 1u32 << log_max.min(24);
        let td = self.take(1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        out.set(ifc::alloc_transport_domain_out::TRANSPORT_DOMAIN, td);
        Ok(())
    }

    /// `in_use`: a TIS or TIR still belongs to the domain (firmware keeps it until they go).
    pub(super) fn dealloc(&mut self, in_use: &dyn Fn(u32) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let td = rd(inp, ifc::dealloc_transport_domain_in::TRANSPORT_DOMAIN);
        if !self.contains(td) {
            return Err(bad_param(syndrome::TD_INVALID));
        }
        if in_use(td) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.give_back(td);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::submit::Harness;
    use mlx5_core::prm::consts;

    #[test]
    fn transport_domains_are_allocated_distinct_and_freed_once() {
        let mut h = Harness::inline();
        h.bring_up();
        let alloc = |h: &mut Harness| {
            let (s, syn, out) = h.simple(
                consts::MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN,
                0,
                ifc::alloc_transport_domain_in::SIZE_BYTES,
                ifc::alloc_transport_domain_out::SIZE_BYTES,
            );
            assert_eq!((s, syn), (0, 0));
            MsgBuf::get(&out[..], ifc::alloc_transport_domain_out::TRANSPORT_DOMAIN)
        };
        let (a, b) = (alloc(&mut h), alloc(&mut h));
        assert_ne!(a, b);
        assert_ne!(a, 0);
        let mut inp = vec![0u8; ifc::dealloc_transport_domain_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DEALLOC_TRANSPORT_DOMAIN.into());
        inp.set(ifc::dealloc_transport_domain_in::TRANSPORT_DOMAIN, a);
        assert_eq!(h.cmd(&inp, ifc::dealloc_transport_domain_out::SIZE_BYTES).1, 0);
        // Freed once: a second free, or one never allocated, is refused.
        assert_eq!(h.cmd(&inp, ifc::dealloc_transport_domain_out::SIZE_BYTES).1, syndrome::TD_INVALID);
        inp.set(ifc::dealloc_transport_domain_in::TRANSPORT_DOMAIN, b + 100);
        assert_eq!(h.cmd(&inp, ifc::dealloc_transport_domain_out::SIZE_BYTES).1, syndrome::TD_INVALID);
    }
}

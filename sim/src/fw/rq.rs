//! Receive queues: CREATE_RQ / MODIFY_RQ / QUERY_RQ / DESTROY_RQ. An RQ is a cyclic ring of receive WQEs with
//! its own CQ; mlx5e opens one per channel and a drop RQ, and reaches them through TIRs and RQTs. An RQ a TIR
//! or an RQT still names cannot be destroyed.

use std::collections::BTreeMap;

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;
use super::wq::{self, Wq};
use crate::dma::DmaSpace;

/// One RQ: state, CQ and ring.
#[derive(Debug, Clone)]
pub(crate) struct Rq {
    pub(crate) state: u32,
    pub(crate) cqn: u32,
    pub(crate) user_index: u32,
    pub(crate) wq: Wq,
    /// The WQE counter: the next receive WQE to take (16 bits, as the CQE's `wqe_counter`).
    pub(crate) ci: u16,
    /// `vsd`: VLAN stripping disabled (mlx5e sets it when `rxvlan` is off). Otherwise a received frame's
    /// 802.1Q tag is taken out of the packet and reported in the CQE.
    pub(crate) vsd: bool,
}

/// What an RQ command checks in the rest of the firmware.
pub(crate) struct RqFw<'a> {
    pub(crate) caps: &'a Caps,
    pub(crate) cq_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) pd_exists: &'a dyn Fn(u32) -> bool,
    /// The UMEMs a ring may live on.
    pub(crate) umems: &'a super::umem::UmemTable,
    pub(crate) in_use: &'a dyn Fn(u32) -> bool,
}

/// Whether an RQ or SQ may go from `cur` to `next` (RST, RDY and ERR). Any state may go to RST or ERR: mlx5_ib
/// moves a raw packet QP's queues together (`modify_raw_packet_qp`), so its RST2INIT takes the SQ from RST to
/// RST, and a QP in INIT or RTR going to ERR takes its SQ from RST to ERR. Only RST and RDY go to RDY (mlx5e's
/// `mlx5e_modify_rq_state` and `mlx5e_modify_sq`, the raw packet QP's RTR2RTS and RTS2RTS); ERR must go
/// through RST first.
pub(crate) fn state_move_ok(cur: u32, next: u32) -> bool {
    use consts::{MLX5_RQC_STATE_ERR as ERR, MLX5_RQC_STATE_RDY as RDY, MLX5_RQC_STATE_RST as RST};
    matches!((cur, next), (_, RST) | (_, ERR) | (RST, RDY) | (RDY, RDY))
}

/// The RQ table.
#[derive(Debug, Default)]
pub(crate) struct RqTable {
    pub(crate) map: BTreeMap<u32, Rq>,
    next: u32,
}

impl RqTable {
    pub(crate) fn new() -> Self {
        Self { map: BTreeMap::new(), next: 1 }
    }

    pub(super) fn create(&mut self, fw: &RqFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::rqc as r;
        let ctx = ifc::create_rq_in::CTX;
        // Only an RQ whose ring is in host memory (not an RMP's) and that starts in RST.
        if rd(inp, r::MEM_RQ_TYPE.at(ctx)) != 0 || rd(inp, r::STATE.at(ctx)) != consts::MLX5_RQC_STATE_RST {
            return Err(bad_param(syndrome::WQ_CONTEXT));
        }
        let cqn = rd(inp, r::CQN.at(ctx));
        if !(fw.cq_exists)(cqn) {
            return Err(bad_param(syndrome::CQ_INVALID));
        }
        let wq_sub = r::WQ.at(ctx);
        let log_max = fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_WQ_SZ);
        let wq = wq::parse(dma, inp, wq_sub, ifc::wq::PAS.at(wq_sub), log_max, fw.pd_exists, fw.umems)?;
        let limit = 1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_RQ).min(24);
        let rqn = alloc_id(&self.map, &mut self.next, 1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let user_index = rd(inp, r::USER_INDEX.at(ctx));
        let vsd = rd(inp, r::VSD.at(ctx)) != 0;
        self.map.insert(rqn, Rq { state: consts::MLX5_RQC_STATE_RST, cqn, user_index, wq, ci: 0, vsd });
        out.set(ifc::create_rq_out::RQN, rqn);
        Ok(())
    }

    pub(super) fn modify(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_rq_in as i;
        let rq = self.map.get_mut(&rd(inp, i::RQN)).ok_or(bad_param(syndrome::RQ_INVALID))?;
        let (cur, next) = (rd(inp, i::RQ_STATE), rd(inp, ifc::rqc::STATE.at(i::CTX)));
        // The driver names the state it believes the RQ is in; firmware refuses a stale one.
        if cur != rq.state || !state_move_ok(cur, next) {
            return Err(err(CmdStatus::BadResState, syndrome::WQ_STATE));
        }
        rq.state = next;
        // mlx5e's `mlx5e_modify_rq_vsd` names the field in the bitmask (toggling rxvlan).
        let mask = inp.get64(ifc::modify_rq_in::MODIFY_BITMASK);
        if mask & u64::from(consts::MLX5_MODIFY_RQ_IN_MODIFY_BITMASK_VSD) != 0 {
            rq.vsd = rd(inp, ifc::rqc::VSD.at(i::CTX)) != 0;
        }
        // A queue back in RST starts its ring over (mlx5e's recovery resets its counters too).
        if next == consts::MLX5_RQC_STATE_RST {
            rq.ci = 0;
        }
        Ok(())
    }

    /// The RQ's state, CQ and user index in an `rqc` at `ctx` of `out` (QUERY_RQ).
    pub(super) fn query(&self, rqn: u32, ctx: mlx5_core::prm::Sub, out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::rqc as r;
        let rq = self.map.get(&rqn).ok_or(bad_param(syndrome::RQ_INVALID))?;
        out.set(r::STATE.at(ctx), rq.state);
        out.set(r::CQN.at(ctx), rq.cqn);
        out.set(r::USER_INDEX.at(ctx), rq.user_index);
        out.set(r::VSD.at(ctx), rq.vsd.into());
        let wq = r::WQ.at(ctx);
        out.set(ifc::wq::WQ_TYPE.at(wq), consts::MLX5_WQ_TYPE_CYCLIC);
        out.set(ifc::wq::PD.at(wq), rq.wq.pd);
        out.set(ifc::wq::LOG_WQ_STRIDE.at(wq), rq.wq.log_stride);
        out.set(ifc::wq::LOG_WQ_SZ.at(wq), rq.wq.log_size);
        out.set(ifc::wq::LOG_WQ_PG_SZ.at(wq), rq.wq.page_shift - consts::MLX5_ADAPTER_PAGE_SHIFT);
        out.set(ifc::wq::PAGE_OFFSET.at(wq), rq.wq.page_offset());
        out.set64(ifc::wq::DBR_ADDR.at(wq), rq.wq.dbr_addr);
        Ok(())
    }

    pub(super) fn destroy(&mut self, fw: &RqFw, inp: &[u8]) -> Result<(), CmdErr> {
        let rqn = rd(inp, ifc::destroy_rq_in::RQN);
        if !self.map.contains_key(&rqn) {
            return Err(bad_param(syndrome::RQ_INVALID));
        }
        if (fw.in_use)(rqn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&rqn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fw::syndrome as syn;
    use crate::testkit::eth::Eth;
    use consts::{MLX5_CMD_STAT_BAD_PARAM_ERR as BAD_PARAM, MLX5_CMD_STAT_BAD_RES_STATE_ERR as BAD_RES};
    use consts::{MLX5_RQC_STATE_ERR as ERR, MLX5_RQC_STATE_RDY as RDY, MLX5_RQC_STATE_RST as RST};

    #[test]
    fn rq_and_sq_are_created_moved_queried_and_destroyed_as_mlx5e_drives_them() {
        let mut e = Eth::new();
        let (s, y, tisn) = e.tis();
        assert_eq!((s, y), (0, 0));
        let (s, y, rqn) = e.rq();
        assert_eq!((s, y), (0, 0));
        let (s, y, sqn) = e.sq_with(tisn, |_| {});
        assert_eq!((s, y), (0, 0));
        for sq in [false, true] {
            let n = if sq { sqn } else { rqn };
            assert_eq!(e.modify_wq(sq, n, RST, RDY), (0, 0));
            // A stale current state is refused, and so is a move the PRM does not allow.
            assert_eq!(e.modify_wq(sq, n, RST, RDY), (BAD_RES, syn::WQ_STATE));
            assert_eq!(e.modify_wq(sq, n, RDY, ERR), (0, 0));
            assert_eq!(e.modify_wq(sq, n, ERR, RDY), (BAD_RES, syn::WQ_STATE));
            assert_eq!(e.modify_wq(sq, n, ERR, RST), (0, 0));
            // A raw packet QP's RST2INIT leaves its SQ in RST (RST to RST), and its 2ERR from INIT moves an SQ
            // still in RST to ERR; an unknown state is refused.
            assert_eq!(e.modify_wq(sq, n, RST, RST), (0, 0));
            assert_eq!(e.modify_wq(sq, n, RST, ERR), (0, 0));
            assert_eq!(e.modify_wq(sq, n, ERR, ERR), (0, 0));
            assert_eq!(e.modify_wq(sq, n, ERR, 2), (BAD_RES, syn::WQ_STATE));
            assert_eq!(e.modify_wq(sq, n, ERR, RST), (0, 0));
        }
        // QUERY_RQ reports the state and the CQ.
        let mut q = vec![0u8; ifc::query_rq_in::SIZE_BYTES];
        q.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_RQ.into());
        q.set(ifc::query_rq_in::RQN, rqn);
        let (s, _, out) = e.r.h.cmd(&q, ifc::query_rq_out::SIZE_BYTES);
        assert_eq!(s, 0);
        let ctx = ifc::query_rq_out::RQ_CONTEXT;
        assert_eq!(MsgBuf::get(&out[..], ifc::rqc::STATE.at(ctx)), RST);
        assert_eq!(MsgBuf::get(&out[..], ifc::rqc::CQN.at(ctx)), e.cq.cqn);
        // The TIS an SQ sends through, and the CQ of either queue, stay until the queue goes.
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIS, ifc::destroy_tis_in::TISN, tisn), (BAD_RES, syn::IN_USE));
        let cqn = e.cq.cqn;
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_CQ, ifc::destroy_cq_in::CQN, cqn), (BAD_RES, syn::IN_USE));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_SQ, ifc::destroy_sq_in::SQN, sqn), (0, 0));
        assert_eq!(
            e.destroy(consts::MLX5_CMD_OP_DESTROY_SQ, ifc::destroy_sq_in::SQN, sqn),
            (BAD_PARAM, syn::SQ_INVALID)
        );
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIS, ifc::destroy_tis_in::TISN, tisn), (0, 0));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, rqn), (0, 0));
        assert_eq!(
            e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, rqn),
            (BAD_PARAM, syn::RQ_INVALID)
        );
    }

    #[test]
    fn malformed_rq_and_sq_contexts_are_refused_with_their_syndromes() {
        let mut e = Eth::new();
        let (_, _, tisn) = e.tis();
        let wq = ifc::rqc::WQ.at(ifc::create_rq_in::CTX);
        type Edit = Box<dyn FnOnce(&mut Vec<u8>)>;
        let cases: Vec<(Edit, u32)> = vec![
            (Box::new(move |i| i.set(ifc::wq::WQ_TYPE.at(wq), consts::MLX5_WQ_TYPE_LINKED_LIST)), syn::WQ_TYPE),
            (Box::new(move |i| i.set(ifc::wq::LOG_WQ_STRIDE.at(wq), 3)), syn::WQ_SIZE),
            (Box::new(move |i| i.set(ifc::wq::LOG_WQ_SZ.at(wq), 31)), syn::WQ_SIZE),
            (Box::new(move |i| i.set64(ifc::wq::DBR_ADDR.at(wq), 0x1000_0000_0000)), syn::WQ_DBR),
            (Box::new(move |i| i.set(ifc::wq::PD.at(wq), 999)), syn::PD_INVALID),
            (Box::new(|i| i.set(ifc::rqc::CQN.at(ifc::create_rq_in::CTX), 999)), syn::CQ_INVALID),
            (Box::new(|i| i.set(ifc::rqc::STATE.at(ifc::create_rq_in::CTX), RDY)), syn::WQ_CONTEXT),
            // A ring whose pages the input does not list.
            (Box::new(move |i| i.truncate(ifc::wq::PAS.at(wq).byte_off())), syn::PAS_TOO_FEW),
        ];
        for (edit, want) in cases {
            let (s, y, _) = e.rq_with(edit);
            assert_eq!((s, y), (BAD_PARAM, want));
        }
        let (s, y, _) = e.sq_with(tisn + 100, |_| {});
        assert_eq!((s, y), (BAD_PARAM, syn::TIS_INVALID));
        let (s, y, _) = e.sq_with(tisn, |i| i.set(ifc::sqc::TIS_LST_SZ.at(ifc::create_sq_in::CTX), 2));
        assert_eq!((s, y), (BAD_PARAM, syn::TIS_INVALID));
        // A ring may start inside its first page (mlx5_ib's raw packet QP); its pages must cover the offset too.
        e.page_offset = 16;
        let (s, y, _) = e.rq_with(move |i| i.truncate(ifc::wq::PAS.at(wq).byte_off() + 8));
        assert_eq!((s, y), (BAD_PARAM, syn::PAS_TOO_FEW));
        let (s, y, rqn) = e.rq();
        assert_eq!((s, y), (0, 0));
        let mut q = vec![0u8; ifc::query_rq_in::SIZE_BYTES];
        q.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_RQ.into());
        q.set(ifc::query_rq_in::RQN, rqn);
        let (_, _, out) = e.r.h.cmd(&q, ifc::query_rq_out::SIZE_BYTES);
        assert_eq!(MsgBuf::get(&out[..], ifc::wq::PAGE_OFFSET.at(ifc::rqc::WQ.at(ifc::query_rq_out::RQ_CONTEXT))), 16);
        e.page_offset = 0;
        // The refusals left the device usable: a well-formed RQ still goes through.
        assert_eq!(e.rq().0, 0);
        // The transport domain stays while a TIS belongs to it.
        let td = e.td;
        let f = ifc::dealloc_transport_domain_in::TRANSPORT_DOMAIN;
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DEALLOC_TRANSPORT_DOMAIN, f, td), (BAD_RES, syn::IN_USE));
    }
}

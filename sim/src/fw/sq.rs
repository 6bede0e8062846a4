//! Send queues: CREATE_SQ / MODIFY_SQ / QUERY_SQ / DESTROY_SQ. An SQ is a cyclic ring of Ethernet send WQEs
//! with its own CQ, sending through one TIS (`tis_num_0`); mlx5e opens one per channel and traffic class, and
//! mlx5_core one for its write-combining test.

use std::collections::BTreeMap;

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, CmdErr};
use super::rq::state_move_ok;
use super::syndrome;
use super::wq::{self, Wq};
use crate::dma::DmaSpace;

/// One SQ: state, CQ, TIS, the inline mode its WQEs must honour, and its ring.
#[derive(Debug, Clone)]
pub(crate) struct Sq {
    pub(crate) state: u32,
    pub(crate) cqn: u32,
    /// The TIS (0 with none: `tis_lst_sz` 0).
    pub(crate) tisn: u32,
    pub(crate) min_wqe_inline_mode: u32,
    pub(crate) user_index: u32,
    pub(crate) wq: Wq,
    /// The producer counter the last doorbell read from the doorbell record (in 64-byte basic blocks).
    pub(crate) pi: u16,
    /// The next basic block to execute.
    pub(crate) ci: u16,
}

/// What an SQ command checks in the rest of the firmware.
pub(crate) struct SqFw<'a> {
    pub(crate) caps: &'a Caps,
    pub(crate) cq_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) pd_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) tis_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) uar_exists: &'a dyn Fn(u32) -> bool,
    /// The UMEMs a ring may live on.
    pub(crate) umems: &'a super::umem::UmemTable,
}

/// The first SQN and the end of the 24-bit number space.
const SQN_FIRST: u32 = 1 << 23;
const SQN_END: u32 = 1 << 24;

/// The SQ table.
#[derive(Debug, Default)]
pub(crate) struct SqTable {
    pub(crate) map: BTreeMap<u32, Sq>,
    next: u32,
}

impl SqTable {
    pub(crate) fn new() -> Self {
        Self { map: BTreeMap::new(), next: SQN_FIRST }
    }

    pub(super) fn create(&mut self, fw: &SqFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::sqc as s;
        let ctx = ifc::create_sq_in::CTX;
        if rd(inp, s::STATE.at(ctx)) != consts::MLX5_SQC_STATE_RST {
            return Err(bad_param(syndrome::WQ_CONTEXT));
        }
        let cqn = rd(inp, s::CQN.at(ctx));
        if !(fw.cq_exists)(cqn) {
            return Err(bad_param(syndrome::CQ_INVALID));
        }
        // At most one TIS per SQ (`log_max_tis_per_sq` 0). mlx5_core's write-combining test makes its SQ with
        // none (`tis_lst_sz` 0): it only sends NOPs.
        let tis_lst_sz = rd(inp, s::TIS_LST_SZ.at(ctx));
        let tisn = if tis_lst_sz == 0 { 0 } else { rd(inp, s::TIS_NUM_0.at(ctx)) };
        let tis_ok = match tis_lst_sz {
            0 => true,
            1 => (fw.tis_exists)(tisn),
            _ => false,
        };
        if !tis_ok {
            return Err(bad_param(syndrome::TIS_INVALID));
        }
        let wq_sub = s::WQ.at(ctx);
        let log_max = fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_WQ_SZ);
        let wq = wq::parse(dma, inp, wq_sub, ifc::wq::PAS.at(wq_sub), log_max, fw.pd_exists, fw.umems)?;
        if !(fw.uar_exists)(wq.uar_page) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        // SQs and QPs share the send doorbell, which names a 24-bit number: SQNs come from the top half of
        // that space (QPNs count up from 0x100 and reach it only after 8 million QPs).
        let limit = SQN_FIRST + (1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_SQ).min(23));
        let sqn = alloc_id(&self.map, &mut self.next, SQN_FIRST, limit.min(SQN_END))
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let sq = Sq {
            state: consts::MLX5_SQC_STATE_RST,
            cqn,
            tisn,
            min_wqe_inline_mode: rd(inp, s::MIN_WQE_INLINE_MODE.at(ctx)),
            user_index: rd(inp, s::USER_INDEX.at(ctx)),
            wq,
            pi: 0,
            ci: 0,
        };
        self.map.insert(sqn, sq);
        out.set(ifc::create_sq_out::SQN, sqn);
        Ok(())
    }

    pub(super) fn modify(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_sq_in as i;
        let sq = self.map.get_mut(&rd(inp, i::SQN)).ok_or(bad_param(syndrome::SQ_INVALID))?;
        let (cur, next) = (rd(inp, i::SQ_STATE), rd(inp, ifc::sqc::STATE.at(i::CTX)));
        if cur != sq.state || !state_move_ok(cur, next) {
            return Err(err(CmdStatus::BadResState, syndrome::WQ_STATE));
        }
        sq.state = next;
        // A queue back in RST starts its ring over (mlx5e_reset_txqsq_cc_pc does the same on its side).
        if next == consts::MLX5_SQC_STATE_RST {
            (sq.pi, sq.ci) = (0, 0);
        }
        Ok(())
    }

    /// The SQ's state, CQ, TIS and ring in an `sqc` at `ctx` of `out` (QUERY_SQ).
    pub(super) fn query(&self, sqn: u32, ctx: mlx5_core::prm::Sub, out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::sqc as s;
        let sq = self.map.get(&sqn).ok_or(bad_param(syndrome::SQ_INVALID))?;
        out.set(s::STATE.at(ctx), sq.state);
        out.set(s::CQN.at(ctx), sq.cqn);
        out.set(s::TIS_LST_SZ.at(ctx), u32::from(sq.tisn != 0));
        out.set(s::TIS_NUM_0.at(ctx), sq.tisn);
        out.set(s::MIN_WQE_INLINE_MODE.at(ctx), sq.min_wqe_inline_mode);
        out.set(s::USER_INDEX.at(ctx), sq.user_index);
        let wq = s::WQ.at(ctx);
        out.set(ifc::wq::WQ_TYPE.at(wq), consts::MLX5_WQ_TYPE_CYCLIC);
        out.set(ifc::wq::PD.at(wq), sq.wq.pd);
        out.set(ifc::wq::UAR_PAGE.at(wq), sq.wq.uar_page);
        out.set(ifc::wq::LOG_WQ_STRIDE.at(wq), sq.wq.log_stride);
        out.set(ifc::wq::LOG_WQ_SZ.at(wq), sq.wq.log_size);
        out.set(ifc::wq::LOG_WQ_PG_SZ.at(wq), sq.wq.page_shift - consts::MLX5_ADAPTER_PAGE_SHIFT);
        out.set(ifc::wq::PAGE_OFFSET.at(wq), sq.wq.page_offset());
        out.set64(ifc::wq::DBR_ADDR.at(wq), sq.wq.dbr_addr);
        Ok(())
    }

    pub(super) fn destroy(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let sqn = rd(inp, ifc::destroy_sq_in::SQN);
        self.map.remove(&sqn).map(|_| ()).ok_or(bad_param(syndrome::SQ_INVALID))
    }
}

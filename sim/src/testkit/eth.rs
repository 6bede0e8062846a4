//! The Ethernet objects' test fixture: a brought-up device with the NIC half offered (`eth_netdev`), a
//! transport domain and a CQ, and the commands mlx5e sends (TIS, RQ, SQ, RQT, TIR, flow tables, groups and
//! entries) built from the PRM layouts as the kernel builds them. Each returns (status, syndrome, object number).

use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::prm::{consts, ifc, MsgBuf, Sub};

use super::submit::{Rdma, TCq};
use crate::config::SimConfig;

const PAGE: usize = 4096;

/// A device ready for Ethernet objects.
pub(crate) struct Eth {
    pub r: Rdma,
    pub td: u32,
    pub cq: TCq,
    /// Rings and doorbell records of the RQs and SQs made, kept alive for the device.
    pub mem: Vec<DmaRegion>,
}

/// (status, syndrome, the object number the reply carries).
pub(crate) type Reply = (u8, u32, u32);

impl Eth {
    pub fn new() -> Self {
        let mut r = Rdma::new(SimConfig { eth_netdev: true, ..SimConfig::default() });
        let (s, _, out) = r.h.simple(
            consts::MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN,
            0,
            ifc::alloc_transport_domain_in::SIZE_BYTES,
            ifc::alloc_transport_domain_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        let td = MsgBuf::get(&out[..], ifc::alloc_transport_domain_out::TRANSPORT_DOMAIN);
        let cq = r.cq(6);
        Self { r, td, cq, mem: Vec::new() }
    }

    fn msg(opcode: u16, len: usize) -> Vec<u8> {
        let mut inp = vec![0u8; len];
        inp.set(ifc::mbox_in::OPCODE, opcode.into());
        inp
    }

    /// Sends `inp`; the reply's object number is read at `id`.
    pub fn send(&mut self, inp: &[u8], outlen: usize, id: mlx5_core::prm::Field) -> Reply {
        let (s, syn, out) = self.r.h.cmd(inp, outlen);
        (s, syn, MsgBuf::get(&out[..], id))
    }

    /// A command whose only argument is one object number (the DESTROY family, DEALLOC_TRANSPORT_DOMAIN).
    pub fn destroy(&mut self, opcode: u16, field: mlx5_core::prm::Field, n: u32) -> (u8, u32) {
        let mut inp = Self::msg(opcode, ifc::destroy_tir_in::SIZE_BYTES.max(ifc::destroy_rqt_in::SIZE_BYTES));
        inp.set(field, n);
        let (s, syn, _) = self.r.h.cmd(&inp, 16);
        (s, syn)
    }

    pub fn tis(&mut self) -> Reply {
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_TIS, ifc::create_tis_in::SIZE_BYTES);
        inp.set(ifc::tisc::TRANSPORT_DOMAIN.at(ifc::create_tis_in::CTX), self.td);
        self.send(&inp, ifc::create_tis_out::SIZE_BYTES, ifc::create_tis_out::TISN)
    }

    /// A cyclic ring of `2^log_sz` strides of `2^log_stride` bytes at `wq` of `inp`, with its doorbell record.
    fn ring(&mut self, inp: &mut Vec<u8>, wq: Sub, log_stride: u32, log_sz: u32) {
        use ifc::wq as w;
        let bytes = (1usize << (log_stride + log_sz)).next_multiple_of(PAGE);
        let buf = self.r.h.dma.alloc(bytes, PAGE).unwrap();
        let dbr = self.r.h.dma.alloc(64, 64).unwrap();
        let pas = w::PAS.at(wq);
        inp.resize(pas.byte_off() + 8 * (bytes / PAGE), 0);
        inp.set(w::WQ_TYPE.at(wq), consts::MLX5_WQ_TYPE_CYCLIC);
        inp.set(w::PD.at(wq), self.r.pd);
        inp.set(w::UAR_PAGE.at(wq), self.r.uar);
        inp.set(w::LOG_WQ_STRIDE.at(wq), log_stride);
        inp.set(w::LOG_WQ_SZ.at(wq), log_sz);
        inp.set64(w::DBR_ADDR.at(wq), dbr.iova());
        for k in 0..bytes / PAGE {
            inp.set64(pas.elem(k as u32), buf.iova() + (k * PAGE) as u64);
        }
        self.mem.push(buf);
        self.mem.push(dbr);
    }

    /// CREATE_RQ as mlx5e sends it (cyclic, 64-byte strides), after `edit` changes the input.
    pub fn rq_with(&mut self, edit: impl FnOnce(&mut Vec<u8>)) -> Reply {
        let ctx = ifc::create_rq_in::CTX;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_RQ, ifc::create_rq_in::SIZE_BYTES);
        inp.set(ifc::rqc::CQN.at(ctx), self.cq.cqn);
        inp.set(ifc::rqc::STATE.at(ctx), consts::MLX5_RQC_STATE_RST);
        self.ring(&mut inp, ifc::rqc::WQ.at(ctx), 6, 6);
        edit(&mut inp);
        self.send(&inp, ifc::create_rq_out::SIZE_BYTES, ifc::create_rq_out::RQN)
    }

    pub fn rq(&mut self) -> Reply {
        self.rq_with(|_| {})
    }

    /// CREATE_SQ through TIS `tisn` as mlx5e sends it, after `edit`.
    pub fn sq_with(&mut self, tisn: u32, edit: impl FnOnce(&mut Vec<u8>)) -> Reply {
        let ctx = ifc::create_sq_in::CTX;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_SQ, ifc::create_sq_in::SIZE_BYTES);
        inp.set(ifc::sqc::CQN.at(ctx), self.cq.cqn);
        inp.set(ifc::sqc::TIS_LST_SZ.at(ctx), 1);
        inp.set(ifc::sqc::TIS_NUM_0.at(ctx), tisn);
        self.ring(&mut inp, ifc::sqc::WQ.at(ctx), 6, 6);
        edit(&mut inp);
        self.send(&inp, ifc::create_sq_out::SIZE_BYTES, ifc::create_sq_out::SQN)
    }

    /// MODIFY_RQ (`sq` false) or MODIFY_SQ from state `cur` to `next`.
    pub fn modify_wq(&mut self, sq: bool, n: u32, cur: u32, next: u32) -> (u8, u32) {
        let mut inp;
        if sq {
            use ifc::modify_sq_in as i;
            inp = Self::msg(consts::MLX5_CMD_OP_MODIFY_SQ, i::SIZE_BYTES);
            inp.set(i::SQN, n);
            inp.set(i::SQ_STATE, cur);
            inp.set(ifc::sqc::STATE.at(i::CTX), next);
        } else {
            use ifc::modify_rq_in as i;
            inp = Self::msg(consts::MLX5_CMD_OP_MODIFY_RQ, i::SIZE_BYTES);
            inp.set(i::RQN, n);
            inp.set(i::RQ_STATE, cur);
            inp.set(ifc::rqc::STATE.at(i::CTX), next);
        }
        let (s, syn, _) = self.r.h.cmd(&inp, 16);
        (s, syn)
    }

    /// CREATE_RQT over `rqns` (max size `max`).
    pub fn rqt(&mut self, max: u32, rqns: &[u32]) -> Reply {
        let ctx = ifc::create_rqt_in::RQT_CONTEXT;
        let list = ifc::rqtc::RQ_NUM.at(ctx);
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_RQT, list.byte_off() + 4 * rqns.len());
        inp.set(ifc::rqtc::RQT_MAX_SIZE.at(ctx), max);
        inp.set(ifc::rqtc::RQT_ACTUAL_SIZE.at(ctx), rqns.len() as u32);
        for (k, &rqn) in rqns.iter().enumerate() {
            inp.set(list.elem(k as u32), rqn);
        }
        self.send(&inp, ifc::create_rqt_out::SIZE_BYTES, ifc::create_rqt_out::RQTN)
    }

    /// CREATE_TIR: direct to RQ `n`, or (`indirect`) Toeplitz RSS over RQT `n`.
    pub fn tir(&mut self, indirect: bool, n: u32) -> Reply {
        use ifc::tirc as t;
        let ctx = ifc::create_tir_in::CTX;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_TIR, ifc::create_tir_in::SIZE_BYTES);
        inp.set(t::TRANSPORT_DOMAIN.at(ctx), self.td);
        if indirect {
            inp.set(t::DISP_TYPE.at(ctx), consts::MLX5_TIRC_DISP_TYPE_INDIRECT);
            inp.set(t::INDIRECT_TABLE.at(ctx), n);
            inp.set(t::RX_HASH_FN.at(ctx), consts::MLX5_RX_HASH_FN_TOEPLITZ);
        } else {
            inp.set(t::INLINE_RQN.at(ctx), n);
        }
        self.send(&inp, ifc::create_tir_out::SIZE_BYTES, ifc::create_tir_out::TIRN)
    }

    /// CREATE_FLOW_TABLE (NIC receive) at `level` of `2^log_size` entries, missing to `miss` (or the default).
    pub fn table(&mut self, level: u32, log_size: u32, miss: Option<u32>) -> Reply {
        use ifc::create_flow_table_in as i;
        use ifc::flow_table_context as c;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_FLOW_TABLE, i::SIZE_BYTES);
        inp.set(i::TABLE_TYPE, consts::MLX5_FLOW_TABLE_TYPE_NIC_RX);
        inp.set(c::LEVEL.at(i::FLOW_TABLE_CONTEXT), level);
        inp.set(c::LOG_SIZE.at(i::FLOW_TABLE_CONTEXT), log_size);
        if let Some(m) = miss {
            inp.set(c::TABLE_MISS_ACTION.at(i::FLOW_TABLE_CONTEXT), consts::MLX5_FLOW_TABLE_MISS_ACTION_FWD);
            inp.set(c::TABLE_MISS_ID.at(i::FLOW_TABLE_CONTEXT), m);
        }
        self.send(&inp, ifc::create_flow_table_out::SIZE_BYTES, ifc::create_flow_table_out::TABLE_ID)
    }

    pub fn set_root(&mut self, table: u32) -> (u8, u32) {
        use ifc::set_flow_table_root_in as i;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_SET_FLOW_TABLE_ROOT, i::SIZE_BYTES);
        inp.set(i::TABLE_TYPE, consts::MLX5_FLOW_TABLE_TYPE_NIC_RX);
        inp.set(i::TABLE_ID, table);
        let (s, syn, _) = self.r.h.cmd(&inp, 16);
        (s, syn)
    }

    /// CREATE_FLOW_GROUP of indexes `start..=end` matching the outer-header fields `crit` sets (in a
    /// `fte_match_set_lyr_2_4`), e.g. the ethertype.
    pub fn group(&mut self, table: u32, start: u32, end: u32, crit: impl FnOnce(&mut [u8])) -> Reply {
        use ifc::create_flow_group_in as i;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_CREATE_FLOW_GROUP, i::SIZE_BYTES);
        inp.set(i::TABLE_TYPE, consts::MLX5_FLOW_TABLE_TYPE_NIC_RX);
        inp.set(i::TABLE_ID, table);
        inp.set(i::START_FLOW_INDEX, start);
        inp.set(i::END_FLOW_INDEX, end);
        inp.set(i::MATCH_CRITERIA_ENABLE, 1 << consts::MLX5_CREATE_FLOW_GROUP_IN_MATCH_CRITERIA_ENABLE_OUTER_HEADERS);
        let outer = ifc::fte_match_param::OUTER_HEADERS.at(i::MATCH_CRITERIA);
        crit(&mut inp[outer.off..outer.off + outer.len]);
        self.send(&inp, ifc::create_flow_group_out::SIZE_BYTES, ifc::create_flow_group_out::GROUP_ID)
    }

    /// SET_FLOW_TABLE_ENTRY (a new entry) at `index` of group `group`: `dests` as (destination type, id), none
    /// for a drop; `value` sets the outer-header fields to match.
    pub fn fte(
        &mut self,
        table: u32,
        group: u32,
        index: u32,
        dests: &[(u32, u32)],
        value: impl FnOnce(&mut [u8]),
    ) -> (u8, u32) {
        use ifc::flow_context as f;
        use ifc::set_fte_in as i;
        let ctx = i::FLOW_CONTEXT;
        let list = f::DESTINATION.at(ctx);
        let dsz = ifc::dest_format_struct::SIZE_BYTES;
        let mut inp = Self::msg(consts::MLX5_CMD_OP_SET_FLOW_TABLE_ENTRY, list.byte_off() + dests.len() * dsz);
        inp.set(i::TABLE_TYPE, consts::MLX5_FLOW_TABLE_TYPE_NIC_RX);
        inp.set(i::TABLE_ID, table);
        inp.set(i::FLOW_INDEX, index);
        inp.set(f::GROUP_ID.at(ctx), group);
        let action = if dests.is_empty() {
            consts::MLX5_FLOW_CONTEXT_ACTION_DROP
        } else {
            consts::MLX5_FLOW_CONTEXT_ACTION_FWD_DEST
        };
        inp.set(f::ACTION.at(ctx), action);
        inp.set(f::DESTINATION_LIST_SIZE.at(ctx), dests.len() as u32);
        for (k, &(ty, id)) in dests.iter().enumerate() {
            let d = Sub::new(list.byte_off() + k * dsz, dsz);
            inp.set(ifc::dest_format_struct::DESTINATION_TYPE.at(d), ty);
            inp.set(ifc::dest_format_struct::DESTINATION_ID.at(d), id);
        }
        let outer = ifc::fte_match_param::OUTER_HEADERS.at(f::MATCH_VALUE.at(ctx));
        value(&mut inp[outer.off..outer.off + outer.len]);
        let (s, syn, _) = self.r.h.cmd(&inp, ifc::set_fte_out::SIZE_BYTES);
        (s, syn)
    }
}

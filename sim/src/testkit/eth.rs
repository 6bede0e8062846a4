//! The Ethernet objects' test fixture: a brought-up device with the NIC half offered (`eth_netdev`), a
//! transport domain and a CQ, and the commands mlx5e sends (TIS, RQ, SQ, RQT, TIR, flow tables, groups and
//! entries) built from the PRM layouts as the kernel builds them. Each returns (status, syndrome, object number).

use mlx5_core::hal::{Dma, DmaRegion, Mmio};
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
    /// The `page_offset` (1/64ths of a page) the next rings start at, as mlx5_ib's raw packet QP gives them.
    pub page_offset: u32,
    /// The `user_index` the next RQs and SQs get (mlx5_ib gives a raw packet QP's its QP's).
    pub user_index: u32,
}

/// (status, syndrome, the object number the reply carries).
pub(crate) type Reply = (u8, u32, u32);

impl Eth {
    pub fn new() -> Self {
        Self::with_mac(SimConfig::default().mac)
    }

    /// A device whose port has MAC `mac`.
    pub fn with_mac(mac: [u8; 6]) -> Self {
        let mut r = Rdma::new(SimConfig { eth_netdev: true, mac, ..SimConfig::default() });
        let (s, _, out) = r.h.simple(
            consts::MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN,
            0,
            ifc::alloc_transport_domain_in::SIZE_BYTES,
            ifc::alloc_transport_domain_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        let td = MsgBuf::get(&out[..], ifc::alloc_transport_domain_out::TRANSPORT_DOMAIN);
        let cq = r.cq(6);
        Self { r, td, cq, mem: Vec::new(), page_offset: 0, user_index: 0 }
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

    /// A cyclic ring of `2^log_sz` strides of `2^log_stride` bytes at `wq` of `inp`, with its doorbell record;
    /// it starts `page_offset` 64ths into its first page.
    fn ring(&mut self, inp: &mut Vec<u8>, wq: Sub, log_stride: u32, log_sz: u32) {
        use ifc::wq as w;
        let bytes = (self.ring_off() + (1usize << (log_stride + log_sz))).next_multiple_of(PAGE);
        let buf = self.r.h.dma.alloc(bytes, PAGE).unwrap();
        let dbr = self.r.h.dma.alloc(64, 64).unwrap();
        let pas = w::PAS.at(wq);
        inp.resize(pas.byte_off() + 8 * (bytes / PAGE), 0);
        inp.set(w::WQ_TYPE.at(wq), consts::MLX5_WQ_TYPE_CYCLIC);
        inp.set(w::PD.at(wq), self.r.pd);
        inp.set(w::UAR_PAGE.at(wq), self.r.uar);
        inp.set(w::LOG_WQ_STRIDE.at(wq), log_stride);
        inp.set(w::LOG_WQ_SZ.at(wq), log_sz);
        inp.set(w::PAGE_OFFSET.at(wq), self.page_offset);
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
        inp.set(ifc::rqc::USER_INDEX.at(ctx), self.user_index);
        self.ring(&mut inp, ifc::rqc::WQ.at(ctx), 6, 6);
        edit(&mut inp);
        self.send(&inp, ifc::create_rq_out::SIZE_BYTES, ifc::create_rq_out::RQN)
    }

    /// Where a ring made now starts in its first page, in bytes.
    fn ring_off(&self) -> usize {
        self.page_offset as usize * PAGE / 64
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
        inp.set(ifc::sqc::USER_INDEX.at(ctx), self.user_index);
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

/// An SQ or RQ made ready, with its ring and doorbell record.
pub(crate) struct TWq {
    pub n: u32,
    pub ring: DmaRegion,
    pub dbr: DmaRegion,
    /// The producer counter (basic blocks for an SQ, WQEs for an RQ).
    pub pi: u16,
    /// Where the ring starts in `ring`, in bytes.
    pub off: usize,
}

impl Eth {
    /// The ring and doorbell record `ring` made last.
    fn last_ring(&mut self) -> (DmaRegion, DmaRegion) {
        let dbr = self.mem.pop().unwrap();
        (self.mem.pop().unwrap(), dbr)
    }

    /// An SQ through a fresh TIS, moved to RDY (64-entry ring of 64-byte basic blocks).
    pub fn ready_sq(&mut self) -> TWq {
        let (_, _, tisn) = self.tis();
        let (s, y, n) = self.sq_with(tisn, |_| {});
        assert_eq!((s, y), (0, 0), "CREATE_SQ");
        let (ring, dbr) = self.last_ring();
        assert_eq!(self.modify_wq(true, n, consts::MLX5_SQC_STATE_RST, consts::MLX5_SQC_STATE_RDY), (0, 0));
        TWq { n, ring, dbr, pi: 0, off: self.ring_off() }
    }

    /// An RQ moved to RDY, and a root flow table sending every frame to it through a direct TIR.
    pub fn ready_rq_steered(&mut self) -> TWq {
        let (s, y, n) = self.rq();
        assert_eq!((s, y), (0, 0), "CREATE_RQ");
        let (ring, dbr) = self.last_ring();
        assert_eq!(self.modify_wq(false, n, consts::MLX5_RQC_STATE_RST, consts::MLX5_RQC_STATE_RDY), (0, 0));
        let (_, _, tirn) = self.tir(false, n);
        let (_, _, root) = self.table(0, 1, None);
        let (_, _, g) = self.group(root, 0, 0, |_| {});
        assert_eq!(self.fte(root, g, 0, &[(consts::MLX5_IFC_FLOW_DESTINATION_TYPE_TIR, tirn)], |_| {}), (0, 0));
        assert_eq!(self.set_root(root), (0, 0));
        TWq { n, ring, dbr, pi: 0, off: self.ring_off() }
    }

    /// Posts a receive WQE of one data segment (`len` bytes at `addr` through `lkey`) and moves the RQ's head.
    pub fn post_rx(&mut self, rq: &mut TWq, len: u32, lkey: u32, addr: u64) {
        use mlx5_core::prm::c::mlx5_wqe_data_seg as d;
        let mut seg = [0u8; d::SIZE];
        d::BYTE_COUNT.put_be(&mut seg, 0, len);
        d::LKEY.put_be(&mut seg, 0, lkey);
        seg[d::ADDR.off..d::ADDR.off + 8].copy_from_slice(&addr.to_be_bytes());
        // 64-byte strides, 64 of them.
        super::submit::put(&rq.ring, rq.off + usize::from(rq.pi % 64) * 64, &seg);
        rq.pi = rq.pi.wrapping_add(1);
        self.r.h.mmio.wmb();
        super::submit::put(&rq.dbr, 0, &u32::from(rq.pi).to_be_bytes());
    }

    /// Writes the send WQE `wqe` (its control segment's index, SQN and `ds` filled in here) at the SQ's
    /// producer counter, moves the counter and rings the doorbell (BlueFlame register 0, first 8 bytes).
    /// Returns the WQE's index.
    pub fn post_tx(&mut self, sq: &mut TWq, wqe: &[u8]) -> u16 {
        use mlx5_core::prm::c::mlx5_wqe_ctrl_seg as cs;
        let index = sq.pi;
        let mut w = wqe.to_vec();
        let op = cs::OPMOD_IDX_OPCODE.get_be(&w, 0) & 0xff;
        cs::OPMOD_IDX_OPCODE.put_be(&mut w, 0, u32::from(index) << 8 | op);
        let ds = cs::QPN_DS.get_be(&w, 0) & 0x3f;
        cs::QPN_DS.put_be(&mut w, 0, sq.n << 8 | ds);
        let nbb = w.len().div_ceil(64).max(1);
        w.resize(nbb * 64, 0);
        for k in 0..nbb {
            let slot = usize::from(index.wrapping_add(k as u16) % 64) * 64;
            super::submit::put(&sq.ring, sq.off + slot, &w[64 * k..64 * k + 64]);
        }
        sq.pi = sq.pi.wrapping_add(nbb as u16);
        self.r.h.mmio.wmb();
        super::submit::put(&sq.dbr, 4, &u32::from(sq.pi).to_be_bytes());
        self.r.h.mmio.wmb();
        let off = crate::mmio::SimMmio::uar_offset(self.r.uar) + consts::MLX5_BF_OFFSET as usize;
        let v = u64::from_be_bytes(w[..8].try_into().unwrap());
        self.r.h.mmio.write64(off, v);
        index
    }
}

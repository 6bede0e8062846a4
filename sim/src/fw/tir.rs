//! Transport interface receives: CREATE_TIR / MODIFY_TIR / DESTROY_TIR. A TIR is where NIC receive steering
//! delivers: straight to one RQ (`disp_type` direct, `inline_rqn`) or spread over an RQT by a hash of the
//! fields its selector names (indirect; Toeplitz with the TIR's key, as mlx5e's RSS TIRs ask). A TIR a flow
//! entry still forwards to cannot be destroyed.

use std::collections::BTreeMap;

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf, Sub};

use super::caps::Caps;
use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// Bytes of the Toeplitz key (`rx_hash_toeplitz_key`: ten dwords).
pub(crate) const TOEPLITZ_KEY_LEN: usize = 40;

/// Where a TIR delivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dispatch {
    /// One RQ.
    Direct { rqn: u32 },
    /// An RQT, with a hash function (`MLX5_RX_HASH_FN_*`) over the selected fields.
    Indirect { rqtn: u32, hash_fn: u32 },
}

/// One TIR.
#[derive(Debug, Clone)]
pub(crate) struct Tir {
    pub(crate) td: u32,
    pub(crate) dispatch: Dispatch,
    pub(crate) toeplitz_key: [u8; TOEPLITZ_KEY_LEN],
    /// `rx_hash_field_selector_outer`: L3 type, L4 type and the selected fields (`MLX5_HASH_FIELD_SEL_*`).
    pub(crate) l3_prot_type: u32,
    pub(crate) l4_prot_type: u32,
    pub(crate) selected_fields: u32,
    pub(crate) self_lb_block: u32,
}

/// What a TIR command checks in the rest of the firmware.
pub(crate) struct TirFw<'a> {
    pub(crate) caps: &'a Caps,
    pub(crate) td_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) rq_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) rqt_exists: &'a dyn Fn(u32) -> bool,
    /// A flow entry forwards to this TIR.
    pub(crate) in_use: &'a dyn Fn(u32) -> bool,
}

/// The TIR table.
#[derive(Debug, Default)]
pub(crate) struct TirTable {
    pub(crate) map: BTreeMap<u32, Tir>,
    next: u32,
}

/// The dispatch a `tirc` at `ctx` asks for, checked against the RQs and RQTs that exist.
fn dispatch(fw: &TirFw, inp: &[u8], ctx: Sub) -> Result<Dispatch, CmdErr> {
    use ifc::tirc as t;
    match rd(inp, t::DISP_TYPE.at(ctx)) {
        consts::MLX5_TIRC_DISP_TYPE_DIRECT => {
            let rqn = rd(inp, t::INLINE_RQN.at(ctx));
            if !(fw.rq_exists)(rqn) {
                return Err(bad_param(syndrome::RQ_INVALID));
            }
            Ok(Dispatch::Direct { rqn })
        }
        consts::MLX5_TIRC_DISP_TYPE_INDIRECT => {
            let rqtn = rd(inp, t::INDIRECT_TABLE.at(ctx));
            if !(fw.rqt_exists)(rqtn) {
                return Err(bad_param(syndrome::RQT_INVALID));
            }
            let hash_fn = rd(inp, t::RX_HASH_FN.at(ctx));
            if !matches!(
                hash_fn,
                consts::MLX5_RX_HASH_FN_NONE | consts::MLX5_RX_HASH_FN_INVERTED_XOR8 | consts::MLX5_RX_HASH_FN_TOEPLITZ
            ) {
                return Err(bad_param(syndrome::TIR_HASH));
            }
            Ok(Dispatch::Indirect { rqtn, hash_fn })
        }
        _ => Err(bad_param(syndrome::TIR_HASH)),
    }
}

/// The hash part of a `tirc` at `ctx` into `tir`.
fn read_hash(inp: &[u8], ctx: Sub, tir: &mut Tir) {
    use ifc::rx_hash_field_select as h;
    use ifc::tirc as t;
    let key = t::RX_HASH_TOEPLITZ_KEY.at(ctx);
    let at = key.byte_off();
    tir.toeplitz_key.copy_from_slice(&inp[at..at + TOEPLITZ_KEY_LEN]);
    let sel = t::RX_HASH_FIELD_SELECTOR_OUTER.at(ctx);
    tir.l3_prot_type = rd(inp, h::L3_PROT_TYPE.at(sel));
    tir.l4_prot_type = rd(inp, h::L4_PROT_TYPE.at(sel));
    tir.selected_fields = rd(inp, h::SELECTED_FIELDS.at(sel));
}

impl TirTable {
    pub(crate) fn new() -> Self {
        Self { map: BTreeMap::new(), next: 1 }
    }

    pub(super) fn create(&mut self, fw: &TirFw, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::tirc as t;
        let ctx = ifc::create_tir_in::CTX;
        let td = rd(inp, t::TRANSPORT_DOMAIN.at(ctx));
        if !(fw.td_exists)(td) {
            return Err(bad_param(syndrome::TD_INVALID));
        }
        let dispatch = dispatch(fw, inp, ctx)?;
        let mut tir = Tir {
            td,
            dispatch,
            toeplitz_key: [0; TOEPLITZ_KEY_LEN],
            l3_prot_type: 0,
            l4_prot_type: 0,
            selected_fields: 0,
            self_lb_block: rd(inp, t::SELF_LB_BLOCK.at(ctx)),
        };
        read_hash(inp, ctx, &mut tir);
        let limit = 1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_TIR).min(24);
        let tirn =
            alloc_id(&self.map, &mut self.next, 1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.map.insert(tirn, tir);
        out.set(ifc::create_tir_out::TIRN, tirn);
        Ok(())
    }

    pub(super) fn modify(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_tir_bitmask as b;
        use ifc::modify_tir_in as i;
        let tir = self.map.get_mut(&rd(inp, i::TIRN)).ok_or(bad_param(syndrome::TIR_INVALID))?;
        let (hash, self_lb, merge) = (
            rd(inp, b::HASH.at(i::BITMASK)),
            rd(inp, b::SELF_LB_EN.at(i::BITMASK)),
            rd(inp, b::PACKET_MERGE.at(i::BITMASK)),
        );
        // No LRO is offered (the capabilities report none), so packet merging cannot be turned on.
        if merge != 0 && rd(inp, ifc::tirc::PACKET_MERGE_MASK.at(i::CTX)) != 0 {
            return Err(bad_param(syndrome::TIR_HASH));
        }
        if hash != 0 {
            if let Dispatch::Indirect { hash_fn, .. } = &mut tir.dispatch {
                let f = rd(inp, ifc::tirc::RX_HASH_FN.at(i::CTX));
                if f > consts::MLX5_RX_HASH_FN_TOEPLITZ {
                    return Err(bad_param(syndrome::TIR_HASH));
                }
                *hash_fn = f;
            }
            read_hash(inp, i::CTX, tir);
        }
        if self_lb != 0 {
            tir.self_lb_block = rd(inp, ifc::tirc::SELF_LB_BLOCK.at(i::CTX));
        }
        Ok(())
    }

    pub(super) fn destroy(&mut self, fw: &TirFw, inp: &[u8]) -> Result<(), CmdErr> {
        let tirn = rd(inp, ifc::destroy_tir_in::TIRN);
        if !self.map.contains_key(&tirn) {
            return Err(bad_param(syndrome::TIR_INVALID));
        }
        if (fw.in_use)(tirn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&tirn);
        Ok(())
    }

    /// Whether a TIR delivers through RQT `rqtn`.
    pub(crate) fn uses_rqt(&self, rqtn: u32) -> bool {
        self.map.values().any(|t| matches!(t.dispatch, Dispatch::Indirect { rqtn: r, .. } if r == rqtn))
    }

    /// Whether a TIR delivers straight to RQ `rqn`.
    pub(crate) fn uses_rq(&self, rqn: u32) -> bool {
        self.map.values().any(|t| t.dispatch == Dispatch::Direct { rqn })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fw::syndrome as syn;
    use crate::testkit::eth::Eth;
    use consts::{MLX5_CMD_STAT_BAD_PARAM_ERR as BAD_PARAM, MLX5_CMD_STAT_BAD_RES_STATE_ERR as BAD_RES};

    #[test]
    fn a_tir_over_a_destroyed_rqt_or_rq_is_refused_and_an_rqt_in_use_stays() {
        let mut e = Eth::new();
        let (_, _, a) = e.rq();
        let (_, _, b) = e.rq();
        let (s, y, rqtn) = e.rqt(4, &[a, b, a, b]);
        assert_eq!((s, y), (0, 0));
        let (s, y, rss) = e.tir(true, rqtn);
        assert_eq!((s, y), (0, 0));
        let (s, y, direct) = e.tir(false, a);
        assert_eq!((s, y), (0, 0));
        // In use: the RQT under an RSS TIR, an RQ in an RQT or under a direct TIR.
        let rqt_f = ifc::destroy_rqt_in::RQTN;
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQT, rqt_f, rqtn), (BAD_RES, syn::IN_USE));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, b), (BAD_RES, syn::IN_USE));
        let tir_f = ifc::destroy_tir_in::TIRN;
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIR, tir_f, rss), (0, 0));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQT, rqt_f, rqtn), (0, 0));
        // A TIR over the destroyed RQT, an RQT of an unknown RQ, and a TIR to an unknown RQ.
        let (s, y, _) = e.tir(true, rqtn);
        assert_eq!((s, y), (BAD_PARAM, syn::RQT_INVALID));
        let (s, y, _) = e.rqt(2, &[a, b + 100]);
        assert_eq!((s, y), (BAD_PARAM, syn::RQ_INVALID));
        let (s, y, _) = e.tir(false, b + 100);
        assert_eq!((s, y), (BAD_PARAM, syn::RQ_INVALID));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIR, tir_f, direct), (0, 0));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIR, tir_f, direct), (BAD_PARAM, syn::TIR_INVALID));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, b), (0, 0));
    }

    #[test]
    fn rqt_sizes_and_short_lists_are_refused() {
        let mut e = Eth::new();
        let (_, _, a) = e.rq();
        // More entries than the table's size, a size of 0, and a size above log_max_rqt_size.
        assert_eq!(e.rqt(1, &[a, a]).1, syn::RQT_SIZE);
        assert_eq!(e.rqt(0, &[a]).1, syn::RQT_SIZE);
        assert_eq!(e.rqt(1, &[]).1, syn::RQT_SIZE);
        // An actual size whose list the input does not carry.
        let ctx = ifc::create_rqt_in::RQT_CONTEXT;
        let mut inp = vec![0u8; ifc::create_rqt_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_RQT.into());
        inp.set(ifc::rqtc::RQT_MAX_SIZE.at(ctx), 64);
        inp.set(ifc::rqtc::RQT_ACTUAL_SIZE.at(ctx), 64);
        let (s, y, _) = e.r.h.cmd(&inp, ifc::create_rqt_out::SIZE_BYTES);
        assert_eq!((s, y), (consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR, syn::BAD_INPUT_LEN));
        // MODIFY_RQT moves the table to another RQ (mlx5e's redirect to its drop RQ).
        let (_, _, drop_rq) = e.rq();
        let (_, _, rqtn) = e.rqt(2, &[a, a]);
        let list = ifc::rqtc::RQ_NUM.at(ifc::modify_rqt_in::CTX);
        let mut m = vec![0u8; list.byte_off() + 4];
        m.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_MODIFY_RQT.into());
        m.set(ifc::modify_rqt_in::RQTN, rqtn);
        m.set(ifc::rqt_bitmask::RQN_LIST.at(ifc::modify_rqt_in::BITMASK), 1);
        m.set(ifc::rqtc::RQT_ACTUAL_SIZE.at(ifc::modify_rqt_in::CTX), 1);
        m.set(list.elem(0), drop_rq);
        assert_eq!(e.r.h.cmd(&m, ifc::modify_rqt_out::SIZE_BYTES).1, 0);
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, a), (0, 0));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, drop_rq).1, syn::IN_USE);
    }
}

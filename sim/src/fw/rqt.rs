//! RQ tables: CREATE_RQT / MODIFY_RQT / DESTROY_RQT. An RQT is the indirection table an RSS TIR hashes into:
//! `rqt_actual_size` RQ numbers (mlx5e repeats its channels' RQs over the table, and points it at the drop RQ
//! while its channels are closed). An RQT a TIR still uses cannot be destroyed.

use std::collections::BTreeMap;

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf, Sub};

use super::caps::Caps;
use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// One RQT: the RQs in table order.
#[derive(Debug, Clone)]
pub(crate) struct Rqt {
    pub(crate) max_size: u32,
    pub(crate) rqns: Vec<u32>,
}

/// What an RQT command checks in the rest of the firmware.
pub(crate) struct RqtFw<'a> {
    pub(crate) caps: &'a Caps,
    pub(crate) rq_exists: &'a dyn Fn(u32) -> bool,
    /// A TIR hashes into this RQT.
    pub(crate) in_use: &'a dyn Fn(u32) -> bool,
}

/// The RQT table.
#[derive(Debug, Default)]
pub(crate) struct RqtTable {
    pub(crate) map: BTreeMap<u32, Rqt>,
    next: u32,
}

/// The RQ list of an `rqtc` at `ctx` of `inp`, of at most `max` entries, each an RQ that exists.
fn rq_list(fw: &RqtFw, inp: &[u8], ctx: Sub, max: u32) -> Result<Vec<u32>, CmdErr> {
    use ifc::rqtc as r;
    // Only RQs are listed (list_q_type 0); SQ lists are for transmit steering, which is not modelled.
    if rd(inp, r::LIST_Q_TYPE.at(ctx)) != 0 || rd(inp, r::RQ_VHCA_ID_FORMAT.at(ctx)) != 0 {
        return Err(bad_param(syndrome::RQT_SIZE));
    }
    let n = rd(inp, r::RQT_ACTUAL_SIZE.at(ctx));
    if n == 0 || n > max {
        return Err(bad_param(syndrome::RQT_SIZE));
    }
    let list = r::RQ_NUM.at(ctx);
    // The list is the command's flexible tail: an input that ends before it is short, not a bad value.
    if inp.len() < list.byte_off() + 4 * n as usize {
        return Err(err(CmdStatus::BadInpLen, syndrome::BAD_INPUT_LEN));
    }
    let mut rqns = Vec::with_capacity(n as usize);
    for k in 0..n {
        let rqn = rd(inp, list.elem(k)) & 0xff_ffff;
        if !(fw.rq_exists)(rqn) {
            return Err(bad_param(syndrome::RQ_INVALID));
        }
        rqns.push(rqn);
    }
    Ok(rqns)
}

impl RqtTable {
    pub(crate) fn new() -> Self {
        Self { map: BTreeMap::new(), next: 1 }
    }

    pub(super) fn create(&mut self, fw: &RqtFw, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        let ctx = ifc::create_rqt_in::RQT_CONTEXT;
        let max_size = rd(inp, ifc::rqtc::RQT_MAX_SIZE.at(ctx));
        if max_size == 0 || max_size > 1 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_RQT_SIZE).min(24) {
            return Err(bad_param(syndrome::RQT_SIZE));
        }
        let rqns = rq_list(fw, inp, ctx, max_size)?;
        let limit = 1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_RQT).min(24);
        let rqtn =
            alloc_id(&self.map, &mut self.next, 1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.map.insert(rqtn, Rqt { max_size, rqns });
        out.set(ifc::create_rqt_out::RQTN, rqtn);
        Ok(())
    }

    pub(super) fn modify(&mut self, fw: &RqtFw, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_rqt_in as i;
        let rqtn = rd(inp, i::RQTN);
        let max = self.map.get(&rqtn).ok_or(bad_param(syndrome::RQT_INVALID))?.max_size;
        // The RQ list is the only field MODIFY_RQT changes.
        if rd(inp, ifc::rqt_bitmask::RQN_LIST.at(i::BITMASK)) == 0 {
            return Err(bad_param(syndrome::FIELD_SELECT));
        }
        let rqns = rq_list(fw, inp, i::CTX, max)?;
        if let Some(t) = self.map.get_mut(&rqtn) {
            t.rqns = rqns;
        }
        Ok(())
    }

    pub(super) fn destroy(&mut self, fw: &RqtFw, inp: &[u8]) -> Result<(), CmdErr> {
        let rqtn = rd(inp, ifc::destroy_rqt_in::RQTN);
        if !self.map.contains_key(&rqtn) {
            return Err(bad_param(syndrome::RQT_INVALID));
        }
        if (fw.in_use)(rqtn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&rqtn);
        Ok(())
    }

    /// Whether an RQT lists RQ `rqn`.
    pub(crate) fn uses_rq(&self, rqn: u32) -> bool {
        self.map.values().any(|t| t.rqns.contains(&rqn))
    }
}

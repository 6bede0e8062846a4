//! Packet pacing: SET_PP_RATE_LIMIT writes or clears one entry of the rate limit table that the QoS capability
//! page (`packet_pacing`, `packet_pacing_rate_table_size`, `packet_pacing_min_rate`/`max_rate`) advertises.
//! Linux's `mlx5_core` (`rl.c`) owns the table: it hands out indices 1 to size - 1 (0 means "no limit"), writes an
//! entry when a user first asks for its rate (mlx5_ib's `MLX5_IB_METHOD_PP_OBJ_ALLOC`, rdma-core's
//! `mlx5dv_pp_alloc`) and clears it with rate 0 on the last free. With `packet_pacing_uid` each entry carries the
//! `uid` of the DevX context it was written for.
//!
//! The table is kept and checked; no send queue in the simulator is paced by it (the datapath has no clock that
//! would make a rate mean anything), so an SQ or QP naming an index only names it.

use mlx5_core::prm::ifc;

use super::caps::Caps;
use super::reply::{bad_param, rd, rd16, CmdErr};
use super::syndrome;

/// One written entry of the rate limit table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Kilobits per second.
    pub(crate) rate: u32,
    pub(crate) burst: u32,
    pub(crate) typical_size: u32,
    /// The DevX context the entry was written for (0: the kernel's).
    pub(crate) uid: u16,
}

/// The rate limit table: index -> entry (unwritten or cleared entries are absent).
#[derive(Debug, Default)]
pub(crate) struct PpTable {
    entries: std::collections::BTreeMap<u16, Entry>,
}

impl PpTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn clear(&mut self) {
        self.entries.clear();
    }

    #[cfg(test)]
    pub(crate) fn get(&self, index: u16) -> Option<&Entry> {
        self.entries.get(&index)
    }

    /// SET_PP_RATE_LIMIT: rate 0 clears the entry, anything else must lie in the advertised range.
    pub(super) fn set(&mut self, caps: &Caps, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::qos_cap as q;
        use ifc::set_pp_rate_limit_context as c;
        use ifc::set_pp_rate_limit_in as i;
        if caps.gen(ifc::cmd_hca_cap::QOS) == 0 || caps.qos(q::PACKET_PACING) == 0 {
            return Err(bad_param(syndrome::CAP_NOT_SET));
        }
        let index = rd16(inp, i::RATE_LIMIT_INDEX);
        if index == 0 || u32::from(index) >= caps.qos(q::PACKET_PACING_RATE_TABLE_SIZE) {
            return Err(bad_param(syndrome::PP_INDEX));
        }
        let uid = rd16(inp, i::UID);
        if uid != 0 && caps.qos(q::PACKET_PACING_UID) == 0 {
            return Err(bad_param(syndrome::PP_UID));
        }
        // Another context's entry is not this context's to change (the kernel's uid 0 may).
        if let Some(e) = self.entries.get(&index) {
            if uid != 0 && e.uid != uid {
                return Err(bad_param(syndrome::UID_MISMATCH));
            }
        }
        let rate = rd(inp, c::RATE_LIMIT.at(i::CTX));
        let burst = rd(inp, c::BURST_UPPER_BOUND.at(i::CTX));
        let typical_size = rd(inp, c::TYPICAL_PACKET_SIZE.at(i::CTX));
        if rate == 0 {
            self.entries.remove(&index);
            return Ok(());
        }
        let (min, max) = (caps.qos(q::PACKET_PACING_MIN_RATE), caps.qos(q::PACKET_PACING_MAX_RATE));
        if !(min..=max).contains(&rate) {
            return Err(bad_param(syndrome::PP_RATE));
        }
        if (burst != 0 && caps.qos(q::PACKET_PACING_BURST_BOUND) == 0)
            || (typical_size != 0 && caps.qos(q::PACKET_PACING_TYPICAL_SIZE) == 0)
        {
            return Err(bad_param(syndrome::PP_RATE));
        }
        self.entries.insert(index, Entry { rate, burst, typical_size, uid });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::device::lock;
    use crate::testkit::submit::Harness;
    use mlx5_core::prm::{consts, MsgBuf};

    fn set_pp(h: &mut Harness, uid: u16, index: u32, rate: u32, burst: u32) -> u32 {
        use ifc::set_pp_rate_limit_in as i;
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_SET_PP_RATE_LIMIT.into());
        inp.set(i::UID, uid.into());
        inp.set(i::RATE_LIMIT_INDEX, index);
        inp.set(ifc::set_pp_rate_limit_context::RATE_LIMIT.at(i::CTX), rate);
        inp.set(ifc::set_pp_rate_limit_context::BURST_UPPER_BOUND.at(i::CTX), burst);
        h.cmd(&inp, ifc::set_pp_rate_limit_out::SIZE_BYTES).1
    }

    fn create_uctx(h: &mut Harness) -> u16 {
        let mut inp = vec![0u8; ifc::create_uctx_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_UCTX.into());
        let (s, _, out) = h.cmd(&inp, ifc::create_uctx_out::SIZE_BYTES);
        assert_eq!(s, 0);
        MsgBuf::get(&out[..], ifc::create_uctx_out::UID) as u16
    }

    fn up() -> Harness {
        let mut h = Harness::new(SimConfig::default());
        h.bring_up();
        h
    }

    #[test]
    fn entries_are_written_and_cleared_within_the_advertised_table_and_range() {
        let mut h = up();
        assert_eq!(set_pp(&mut h, 0, 1, 100, 0), 0);
        assert_eq!(set_pp(&mut h, 0, 2, 100, 0), 0);
        let e = lock(&h.dev.shared).fw.pps.get(1).copied();
        assert_eq!(e, Some(Entry { rate: 100, burst: 0, typical_size: 0, uid: 0 }));
        // Rate 0 clears the entry (Linux's last free).
        assert_eq!(set_pp(&mut h, 0, 1, 0, 0), 0);
        assert_eq!(lock(&h.dev.shared).fw.pps.len(), 1);
        // Index 0 means "no limit" and cannot be written; the table has `packet_pacing_rate_table_size` entries.
        assert_eq!(set_pp(&mut h, 0, 0, 100, 0), syndrome::PP_INDEX);
        let size = lock(&h.dev.shared).fw.caps.qos(ifc::qos_cap::PACKET_PACING_RATE_TABLE_SIZE);
        assert_eq!(set_pp(&mut h, 0, size, 100, 0), syndrome::PP_INDEX);
        assert_eq!(set_pp(&mut h, 0, size - 1, 100, 0), 0);
        // Outside [min, max], or a burst bound the caps do not offer.
        assert_eq!(set_pp(&mut h, 0, 3, u32::MAX, 0), syndrome::PP_RATE);
        assert_eq!(set_pp(&mut h, 0, 3, 100, 64), syndrome::PP_RATE);
    }

    #[test]
    fn a_contexts_entry_is_its_own_and_a_dead_uid_is_refused() {
        let mut h = up();
        assert_eq!(set_pp(&mut h, 7, 1, 100, 0), syndrome::UID_INVALID);
        let (a, b) = (create_uctx(&mut h), create_uctx(&mut h));
        assert_eq!(set_pp(&mut h, a, 1, 100, 0), 0);
        assert_eq!(set_pp(&mut h, b, 1, 0, 0), syndrome::UID_MISMATCH);
        assert_eq!(set_pp(&mut h, a, 1, 0, 0), 0);
    }

    #[test]
    fn without_the_qos_caps_the_command_is_refused() {
        let mut h = up();
        lock(&h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::QOS, 0);
        assert_eq!(set_pp(&mut h, 0, 1, 100, 0), syndrome::CAP_NOT_SET);
    }
}

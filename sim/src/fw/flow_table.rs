//! NIC receive steering: CREATE/MODIFY/DESTROY_FLOW_TABLE, CREATE/DESTROY_FLOW_GROUP,
//! SET/DELETE_FLOW_TABLE_ENTRY and SET_FLOW_TABLE_ROOT, as Linux's fs_core drives them for mlx5e (its TTC, L2
//! and VLAN tables). A table holds groups (a range of flow indexes and the header fields they match) and
//! entries (a match value, and drop or forward to TIRs or to deeper tables); a table's miss goes to a deeper
//! table or to the default (drop). Only outer-header matching is modelled (fs_core's NIC tables use nothing
//! else); a group asking for more is refused rather than silently matched.

use std::collections::BTreeMap;

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf, Sub};

use super::caps::Caps;
use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, rd8, CmdErr};
use super::syndrome;

/// Bytes of a `fte_match_param` (a group's criteria, an entry's value).
pub(crate) const MATCH_LEN: usize = ifc::fte_match_param::SIZE_BYTES;

/// Where an entry or a miss sends a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dest {
    Tir(u32),
    Table(u32),
}

/// Where steering sent a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Steer {
    /// No root, a drop rule, or a miss with nowhere to go (the default miss drops on NIC receive).
    Drop,
    /// A TIR, with the entry's flow tag (it goes into the RX CQE).
    Tir { tirn: u32, flow_tag: u32 },
}

/// A flow group: flow indexes `start..=end`, matching the masked fields of `criteria` (outer headers only).
#[derive(Debug, Clone)]
pub(crate) struct Group {
    pub(crate) start: u32,
    pub(crate) end: u32,
    pub(crate) criteria: Vec<u8>,
}

/// A flow table entry: its group, value, action bits (`MLX5_FLOW_CONTEXT_ACTION_*`) and destinations.
#[derive(Debug, Clone)]
pub(crate) struct Fte {
    pub(crate) group: u32,
    pub(crate) value: Vec<u8>,
    pub(crate) action: u32,
    pub(crate) flow_tag: u32,
    pub(crate) dests: Vec<Dest>,
}

/// A NIC receive flow table.
#[derive(Debug, Clone)]
pub(crate) struct FlowTable {
    pub(crate) level: u32,
    pub(crate) log_size: u32,
    /// The table a miss goes to; `None`: the default miss (drop).
    pub(crate) miss: Option<u32>,
    pub(crate) groups: BTreeMap<u32, Group>,
    pub(crate) entries: BTreeMap<u32, Fte>,
}

/// What a steering command checks in the rest of the firmware.
pub(crate) struct FlowFw<'a> {
    pub(crate) caps: &'a Caps,
    pub(crate) tir_exists: &'a dyn Fn(u32) -> bool,
}

/// Every flow table of the NIC receive domain, and its root.
#[derive(Debug, Default)]
pub(crate) struct FlowTables {
    pub(crate) tables: BTreeMap<u32, FlowTable>,
    pub(crate) root: Option<u32>,
    next_table: u32,
    next_group: u32,
    /// Group ids are unique over all tables, as firmware numbers them.
    group_count: BTreeMap<u32, u32>,
}

/// The common header of the steering commands: NIC receive only, and this function's own vport.
fn check_domain(
    inp: &[u8],
    other_vport: mlx5_core::prm::Field,
    table_type: mlx5_core::prm::Field,
) -> Result<(), CmdErr> {
    if rd(inp, other_vport) != 0 {
        return Err(bad_param(syndrome::BAD_FUNCTION));
    }
    if rd8(inp, table_type) != consts::MLX5_FLOW_TABLE_TYPE_NIC_RX as u8 {
        return Err(bad_param(syndrome::FT_TYPE));
    }
    Ok(())
}

impl FlowTables {
    pub(crate) fn new() -> Self {
        Self { next_table: 1, next_group: 1, ..Self::default() }
    }

    fn table(&self, id: u32) -> Result<&FlowTable, CmdErr> {
        self.tables.get(&id).ok_or(bad_param(syndrome::FT_INVALID))
    }

    /// A miss of a table at `level` may go to `miss` only if it exists and is deeper.
    fn miss_target(&self, level: u32, ctx: Sub, inp: &[u8]) -> Result<Option<u32>, CmdErr> {
        use ifc::flow_table_context as c;
        match rd(inp, c::TABLE_MISS_ACTION.at(ctx)) {
            consts::MLX5_FLOW_TABLE_MISS_ACTION_DEF => Ok(None),
            consts::MLX5_FLOW_TABLE_MISS_ACTION_FWD => {
                let id = rd(inp, c::TABLE_MISS_ID.at(ctx));
                if self.table(id)?.level <= level {
                    return Err(bad_param(syndrome::FT_LEVEL));
                }
                Ok(Some(id))
            }
            _ => Err(bad_param(syndrome::FT_MISS)),
        }
    }

    pub(super) fn create_table(&mut self, caps: &Caps, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_flow_table_in as i;
        use ifc::flow_table_context as c;
        use ifc::flow_table_prop_layout as p;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        let ctx = i::FLOW_TABLE_CONTEXT;
        // Features fs_core asks for only when the capabilities offer them, and they offer none of these.
        let extras = [c::REFORMAT_EN, c::DECAP_EN, c::SW_OWNER, c::TERMINATION_TABLE, c::RTC_VALID];
        if extras.iter().any(|&f| rd(inp, f.at(ctx)) != 0) {
            return Err(bad_param(syndrome::FT_MISS));
        }
        let level = rd(inp, c::LEVEL.at(ctx));
        let log_size = rd(inp, c::LOG_SIZE.at(ctx));
        if level > caps.nic_rx(p::MAX_FT_LEVEL) || log_size > caps.nic_rx(p::LOG_MAX_FT_SIZE) {
            return Err(bad_param(syndrome::FT_LEVEL));
        }
        let miss = self.miss_target(level, ctx, inp)?;
        let limit = 1u32 << caps.nic_rx(p::LOG_MAX_FT_NUM).min(24);
        let id = alloc_id(&self.tables, &mut self.next_table, 1, limit)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let t = FlowTable { level, log_size, miss, groups: BTreeMap::new(), entries: BTreeMap::new() };
        self.tables.insert(id, t);
        out.set(ifc::create_flow_table_out::TABLE_ID, id);
        Ok(())
    }

    pub(super) fn modify_table(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_flow_table_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        let id = rd(inp, i::TABLE_ID);
        let level = self.table(id)?.level;
        // Only the miss can change (fs_core's connect of a new table into the chain); LAG tables are not modelled.
        if rd(inp, i::MODIFY_FIELD_SELECT) != consts::MLX5_MODIFY_FLOW_TABLE_MISS_TABLE_ID {
            return Err(bad_param(syndrome::FIELD_SELECT));
        }
        let miss = self.miss_target(level, i::FLOW_TABLE_CONTEXT, inp)?;
        if let Some(t) = self.tables.get_mut(&id) {
            t.miss = miss;
        }
        Ok(())
    }

    pub(super) fn destroy_table(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::destroy_flow_table_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        let id = rd(inp, i::TABLE_ID);
        let t = self.table(id)?;
        // Firmware refuses to drop a table that still holds groups, is the root, or that another table's miss or
        // an entry reaches: the packets steered there would have nowhere to go.
        let reached = self
            .tables
            .values()
            .any(|o| o.miss == Some(id) || o.entries.values().any(|e| e.dests.contains(&Dest::Table(id))));
        if !t.groups.is_empty() || self.root == Some(id) || reached {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.tables.remove(&id);
        Ok(())
    }

    pub(super) fn set_root(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::set_flow_table_root_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        if rd(inp, i::TABLE_OF_OTHER_VPORT) != 0 || rd(inp, i::UNDERLAY_QPN) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        // op_mod 1 disconnects the root (fs_core, when its last NIC table goes).
        match rd(inp, ifc::mbox_in::OP_MOD) {
            0 => {
                let id = rd(inp, i::TABLE_ID);
                self.table(id)?;
                self.root = Some(id);
            }
            1 => self.root = None,
            _ => return Err(bad_param(syndrome::BAD_OP_MOD)),
        }
        Ok(())
    }

    pub(super) fn create_group(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_flow_group_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        let tid = rd(inp, i::TABLE_ID);
        let t = self.table(tid)?;
        let (start, end) = (rd(inp, i::START_FLOW_INDEX), rd(inp, i::END_FLOW_INDEX));
        let size = 1u64 << t.log_size;
        if start > end || u64::from(end) >= size || t.groups.values().any(|g| start <= g.end && g.start <= end) {
            return Err(bad_param(syndrome::FG_RANGE));
        }
        let enable = rd(inp, i::MATCH_CRITERIA_ENABLE);
        let outer = 1 << consts::MLX5_CREATE_FLOW_GROUP_IN_MATCH_CRITERIA_ENABLE_OUTER_HEADERS;
        let crit = i::MATCH_CRITERIA;
        let criteria = inp[crit.off..crit.off + MATCH_LEN].to_vec();
        // Outer headers only: any other section enabled, or a mask outside the outer headers, is refused.
        let outer_hdrs = ifc::fte_match_param::OUTER_HEADERS;
        let beyond = criteria
            .iter()
            .enumerate()
            .any(|(k, &b)| b != 0 && !(outer_hdrs.off..outer_hdrs.off + outer_hdrs.len).contains(&k));
        if enable & !outer != 0 || beyond || rd(inp, i::GROUP_TYPE) != 0 {
            return Err(bad_param(syndrome::FG_CRITERIA));
        }
        let gid = alloc_id(&self.group_count, &mut self.next_group, 1, 1 << 24)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.group_count.insert(gid, tid);
        if let Some(t) = self.tables.get_mut(&tid) {
            t.groups.insert(gid, Group { start, end, criteria });
        }
        out.set(ifc::create_flow_group_out::GROUP_ID, gid);
        Ok(())
    }

    pub(super) fn destroy_group(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::destroy_flow_group_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        let (tid, gid) = (rd(inp, i::TABLE_ID), rd(inp, i::GROUP_ID));
        let t = self.tables.get_mut(&tid).ok_or(bad_param(syndrome::FT_INVALID))?;
        if !t.groups.contains_key(&gid) {
            return Err(bad_param(syndrome::FG_INVALID));
        }
        if t.entries.values().any(|e| e.group == gid) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        t.groups.remove(&gid);
        self.group_count.remove(&gid);
        Ok(())
    }

    pub(super) fn set_fte(&mut self, fw: &FlowFw, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::flow_context as f;
        use ifc::set_fte_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        // fs_core sets `ignore_flow_level` only with the capability of that name, which is not offered.
        if rd(inp, i::IGNORE_FLOW_LEVEL) != 0 {
            return Err(bad_param(syndrome::FT_LEVEL));
        }
        let tid = rd(inp, i::TABLE_ID);
        let t = self.table(tid)?;
        let index = rd(inp, i::FLOW_INDEX);
        let ctx = i::FLOW_CONTEXT;
        let gid = rd(inp, f::GROUP_ID.at(ctx));
        let g = t.groups.get(&gid).ok_or(bad_param(syndrome::FG_INVALID))?;
        if !(g.start..=g.end).contains(&index) {
            return Err(bad_param(syndrome::FG_RANGE));
        }
        // op_mod 0 adds an entry at a free index; 1 changes an existing one.
        let modify = match rd(inp, ifc::mbox_in::OP_MOD) {
            0 if t.entries.contains_key(&index) => return Err(bad_param(syndrome::FTE_EXISTS)),
            0 => false,
            1 if !t.entries.contains_key(&index) => return Err(bad_param(syndrome::FTE_INVALID)),
            1 => true,
            _ => return Err(bad_param(syndrome::BAD_OP_MOD)),
        };
        let action = rd(inp, f::ACTION.at(ctx));
        let (drop, fwd) = (consts::MLX5_FLOW_CONTEXT_ACTION_DROP, consts::MLX5_FLOW_CONTEXT_ACTION_FWD_DEST);
        // Drop or forward, exactly one of them: counters, header rewrites and the rest are not modelled.
        if action != drop && action != fwd {
            return Err(bad_param(syndrome::FTE_ACTION));
        }
        let n = rd(inp, f::DESTINATION_LIST_SIZE.at(ctx));
        let max = 1u32 << fw.caps.nic_rx(ifc::flow_table_prop_layout::LOG_MAX_DESTINATION).min(16);
        if rd(inp, f::FLOW_COUNTER_LIST_SIZE.at(ctx)) != 0 || (action == fwd) != (n > 0) || n > max {
            return Err(bad_param(syndrome::FTE_ACTION));
        }
        let list = f::DESTINATION.at(ctx);
        let dsz = ifc::dest_format_struct::SIZE_BYTES;
        if inp.len() < list.byte_off() + n as usize * dsz {
            return Err(err(CmdStatus::BadInpLen, syndrome::BAD_INPUT_LEN));
        }
        let mut dests = Vec::with_capacity(n as usize);
        for k in 0..n as usize {
            let d = Sub::new(list.byte_off() + k * dsz, dsz);
            let id = rd(inp, ifc::dest_format_struct::DESTINATION_ID.at(d));
            dests.push(match rd(inp, ifc::dest_format_struct::DESTINATION_TYPE.at(d)) {
                consts::MLX5_IFC_FLOW_DESTINATION_TYPE_TIR if (fw.tir_exists)(id) => Dest::Tir(id),
                consts::MLX5_IFC_FLOW_DESTINATION_TYPE_TIR => return Err(bad_param(syndrome::TIR_INVALID)),
                consts::MLX5_IFC_FLOW_DESTINATION_TYPE_FLOW_TABLE => {
                    // A forward goes deeper, never back up or sideways (no loops), as fs_core's levels promise.
                    let d = self.tables.get(&id).ok_or(bad_param(syndrome::FT_INVALID))?;
                    if d.level <= t.level {
                        return Err(bad_param(syndrome::FT_LEVEL));
                    }
                    Dest::Table(id)
                }
                _ => return Err(bad_param(syndrome::FTE_ACTION)),
            });
        }
        let v = f::MATCH_VALUE.at(ctx);
        // The value is kept masked by the group's criteria: only the fields the group matches count.
        let value: Vec<u8> = inp[v.off..v.off + MATCH_LEN].iter().zip(&g.criteria).map(|(a, m)| a & m).collect();
        let fte = Fte { group: gid, value, action, flow_tag: rd(inp, f::FLOW_TAG.at(ctx)), dests };
        if let Some(t) = self.tables.get_mut(&tid) {
            if modify {
                // A change keeps the entry's match: only action, tag and destinations move.
                if let Some(e) = t.entries.get_mut(&index) {
                    (e.action, e.flow_tag, e.dests) = (fte.action, fte.flow_tag, fte.dests);
                }
            } else {
                t.entries.insert(index, fte);
            }
        }
        Ok(())
    }

    pub(super) fn delete_fte(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::delete_fte_in as i;
        check_domain(inp, i::OTHER_VPORT, i::TABLE_TYPE)?;
        let t = self.tables.get_mut(&rd(inp, i::TABLE_ID)).ok_or(bad_param(syndrome::FT_INVALID))?;
        t.entries.remove(&rd(inp, i::FLOW_INDEX)).map(|_| ()).ok_or(bad_param(syndrome::FTE_INVALID))
    }

    /// Where NIC receive steering sends a packet whose header fields are `pkt` (a `fte_match_param` image: the
    /// frame's outer headers as `fte_match_set_lyr_2_4` lays them out): from the root, the first entry (lowest
    /// flow index) whose masked fields equal its value decides; a table nothing matches takes its miss. Bounded:
    /// every step goes to a deeper table, so a walk visits each table at most once.
    pub(crate) fn steer(&self, pkt: &[u8; MATCH_LEN]) -> Steer {
        let Some(mut id) = self.root else { return Steer::Drop };
        for _ in 0..=self.tables.len() {
            let Some(t) = self.tables.get(&id) else { return Steer::Drop };
            let hit = t.entries.values().find(|e| {
                t.groups
                    .get(&e.group)
                    .is_some_and(|g| pkt.iter().zip(&g.criteria).map(|(b, m)| b & m).eq(e.value.iter().copied()))
            });
            let next = match hit {
                Some(e) if e.action == consts::MLX5_FLOW_CONTEXT_ACTION_DROP => return Steer::Drop,
                // fs_core's NIC rules forward to one destination; the first one is where the packet goes.
                Some(e) => match e.dests.first() {
                    Some(&Dest::Tir(tirn)) => return Steer::Tir { tirn, flow_tag: e.flow_tag },
                    Some(&Dest::Table(next)) => next,
                    None => return Steer::Drop,
                },
                None => match t.miss {
                    Some(next) => next,
                    None => return Steer::Drop,
                },
            };
            id = next;
        }
        Steer::Drop
    }

    /// Whether an entry forwards to TIR `tirn`.
    pub(crate) fn forwards_to_tir(&self, tirn: u32) -> bool {
        self.tables.values().any(|t| t.entries.values().any(|e| e.dests.contains(&Dest::Tir(tirn))))
    }

    /// Number of tables, groups and entries (teardown's count of live objects).
    pub(crate) fn len(&self) -> usize {
        self.tables.values().map(|t| 1 + t.groups.len() + t.entries.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fw::syndrome as syn;
    use crate::testkit::eth::Eth;
    use consts::{MLX5_CMD_STAT_BAD_PARAM_ERR as BAD_PARAM, MLX5_CMD_STAT_BAD_RES_STATE_ERR as BAD_RES};
    use consts::{MLX5_IFC_FLOW_DESTINATION_TYPE_FLOW_TABLE as TO_TABLE, MLX5_IFC_FLOW_DESTINATION_TYPE_TIR as TO_TIR};
    use ifc::fte_match_set_lyr_2_4 as l2;

    /// A packet's match image with its ethertype and IP protocol.
    fn pkt(ethertype: u32, proto: u32) -> [u8; MATCH_LEN] {
        let mut p = [0u8; MATCH_LEN];
        let o = ifc::fte_match_param::OUTER_HEADERS;
        p[..].set(l2::ETHERTYPE.at(o), ethertype);
        p[..].set(l2::IP_PROTOCOL.at(o), proto);
        p
    }

    #[test]
    fn the_capabilities_open_mlx5e_s_gate_only_when_the_nic_half_is_offered() {
        use ifc::flow_table_prop_layout as p;
        let mut e = Eth::new();
        let gate = e.r.h.dev.with_fw(|fw| {
            let c = &fw.caps;
            (c.gen(ifc::cmd_hca_cap::NIC_FLOW_TABLE), c.nic_rx(p::MAX_FT_LEVEL), c.nic_rx(p::LOG_MAX_FT_SIZE))
        });
        assert_eq!(gate.0, 1);
        assert!(gate.1 >= 12 && gate.2 >= 16, "fs_core's NIC RX priority and L2 table need these: {gate:?}");
        let (s, _, _) = e.r.h.simple(
            consts::MLX5_CMD_OP_QUERY_HCA_CAP,
            (consts::MLX5_CAP_FLOW_TABLE << 1) | consts::HCA_CAP_OPMOD_GET_CUR as u16,
            ifc::query_hca_cap_in::SIZE_BYTES,
            ifc::query_hca_cap_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        // The default device (no NIC half) keeps the gate shut and the SQ count at zero.
        let d = crate::testkit::submit::Harness::inline();
        let g = |f| d.dev.with_fw(|fw| fw.caps.gen(f));
        assert_eq!((g(ifc::cmd_hca_cap::NIC_FLOW_TABLE), g(ifc::cmd_hca_cap::LOG_MAX_SQ)), (0, 0));
        // Its flow table capabilities are answered, and say there are none.
        let mut d = d;
        d.bring_up();
        let (s, _, out) = d.simple(
            consts::MLX5_CMD_OP_QUERY_HCA_CAP,
            (consts::MLX5_CAP_FLOW_TABLE << 1) | consts::HCA_CAP_OPMOD_GET_CUR as u16,
            ifc::query_hca_cap_in::SIZE_BYTES,
            ifc::query_hca_cap_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        let cap = ifc::query_hca_cap_out::CAPABILITY;
        assert!(out[cap.off..cap.off + cap.len].iter().all(|&b| b == 0));
        assert_eq!(d.dev.with_fw(|fw| fw.caps.nic_rx(p::MAX_FT_LEVEL)), 0);
    }

    #[test]
    fn steering_walks_from_the_root_through_entries_and_misses_to_a_tir() {
        let mut e = Eth::new();
        let (_, _, rq) = e.rq();
        let (_, _, tir_ip) = e.tir(false, rq);
        let (_, _, tir_any) = e.tir(false, rq);
        // A TTC-like table (level 1): IPv4/TCP to one TIR, the rest to another through its miss.
        let (s, y, any) = e.table(2, 4, None);
        assert_eq!((s, y), (0, 0));
        let (_, _, ttc) = e.table(1, 4, Some(any));
        let (s, y, g) = e.group(ttc, 0, 7, |c| {
            c.set(l2::ETHERTYPE, 0xffff);
            c.set(l2::IP_PROTOCOL, 0xff);
        });
        assert_eq!((s, y), (0, 0));
        assert_eq!(
            e.fte(ttc, g, 0, &[(TO_TIR, tir_ip)], |v| {
                v.set(l2::ETHERTYPE, 0x0800);
                v.set(l2::IP_PROTOCOL, 6);
            }),
            (0, 0)
        );
        // An explicit drop of ARP (0x0806).
        assert_eq!(e.fte(ttc, g, 1, &[], |v| v.set(l2::ETHERTYPE, 0x0806)), (0, 0));
        let (_, _, ga) = e.group(any, 0, 0, |_| {});
        assert_eq!(e.fte(any, ga, 0, &[(TO_TIR, tir_any)], |_| {}), (0, 0));
        // A root table (level 0) forwarding everything to the TTC table.
        let (_, _, root) = e.table(0, 1, None);
        let (_, _, gr) = e.group(root, 0, 0, |_| {});
        assert_eq!(e.fte(root, gr, 0, &[(TO_TABLE, ttc)], |_| {}), (0, 0));
        let steer = |e: &Eth, p| e.r.h.dev.with_fw(|fw| fw.flows.steer(&p));
        assert_eq!(steer(&e, pkt(0x0800, 6)), Steer::Drop, "no root yet");
        assert_eq!(e.set_root(root), (0, 0));
        assert_eq!(steer(&e, pkt(0x0800, 6)), Steer::Tir { tirn: tir_ip, flow_tag: 0 });
        assert_eq!(steer(&e, pkt(0x0800, 17)), Steer::Tir { tirn: tir_any, flow_tag: 0 });
        assert_eq!(steer(&e, pkt(0x86dd, 6)), Steer::Tir { tirn: tir_any, flow_tag: 0 });
        assert_eq!(steer(&e, pkt(0x0806, 0)), Steer::Drop);
        // The TIR an entry forwards to stays; an entry to a destroyed TIR is refused.
        let tf = ifc::destroy_tir_in::TIRN;
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIR, tf, tir_ip), (BAD_RES, syn::IN_USE));
        let (_, _, spare) = e.tir(false, rq);
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_TIR, tf, spare), (0, 0));
        let r = e.fte(ttc, g, 2, &[(TO_TIR, spare)], |v| v.set(l2::ETHERTYPE, 0x86dd));
        assert_eq!(r, (BAD_PARAM, syn::TIR_INVALID));
        // A forward up the levels (the TTC table back to the root) is refused.
        assert_eq!(e.fte(ttc, g, 2, &[(TO_TABLE, root)], |v| v.set(l2::ETHERTYPE, 0x86dd)), (BAD_PARAM, syn::FT_LEVEL));
        // A table with groups, a table a miss reaches, or the root cannot go.
        let tbl = ifc::destroy_flow_table_in::TABLE_ID;
        for t in [ttc, any, root] {
            let mut inp = vec![0u8; ifc::destroy_flow_table_in::SIZE_BYTES];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_FLOW_TABLE.into());
            inp.set(tbl, t);
            assert_eq!(e.r.h.cmd(&inp, 16).1, syn::IN_USE);
        }
    }

    #[test]
    fn malformed_groups_and_entries_are_refused() {
        let mut e = Eth::new();
        let (_, _, t) = e.table(1, 3, None);
        let (_, _, g) = e.group(t, 0, 3, |c| c.set(l2::ETHERTYPE, 0xffff));
        // Ranges: overlapping, beyond the table's 8 entries, reversed.
        assert_eq!(e.group(t, 3, 4, |_| {}).1, syn::FG_RANGE);
        assert_eq!(e.group(t, 4, 8, |_| {}).1, syn::FG_RANGE);
        assert_eq!(e.group(t, 6, 5, |_| {}).1, syn::FG_RANGE);
        // An entry outside its group, at a taken index, forwarding without destinations, to an unknown table.
        assert_eq!(e.fte(t, g, 4, &[], |_| {}).1, syn::FG_RANGE);
        assert_eq!(e.fte(t, g, 0, &[], |_| {}), (0, 0));
        assert_eq!(e.fte(t, g, 0, &[], |_| {}).1, syn::FTE_EXISTS);
        assert_eq!(e.fte(t, g, 1, &[(TO_TABLE, t + 50)], |_| {}).1, syn::FT_INVALID);
        assert_eq!(e.fte(t, g + 50, 1, &[], |_| {}).1, syn::FG_INVALID);
        // A group with entries stays; a size above the capability and a miss to a shallower table are refused.
        let mut inp = vec![0u8; ifc::destroy_flow_group_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_FLOW_GROUP.into());
        inp.set(ifc::destroy_flow_group_in::TABLE_ID, t);
        inp.set(ifc::destroy_flow_group_in::GROUP_ID, g);
        assert_eq!(e.r.h.cmd(&inp, 16).1, syn::IN_USE);
        assert_eq!(e.table(1, 24, None).1, syn::FT_LEVEL);
        assert_eq!(e.table(0, 3, Some(t)).0, 0);
        assert_eq!(e.table(2, 3, Some(t)).1, syn::FT_LEVEL);
        // A destination list the input does not carry: the list is the command's tail.
        let mut inp = vec![0u8; ifc::flow_context::DESTINATION.at(ifc::set_fte_in::FLOW_CONTEXT).byte_off()];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_SET_FLOW_TABLE_ENTRY.into());
        inp.set(ifc::set_fte_in::TABLE_ID, t);
        inp.set(ifc::set_fte_in::FLOW_INDEX, 2);
        let ctx = ifc::set_fte_in::FLOW_CONTEXT;
        inp.set(ifc::flow_context::GROUP_ID.at(ctx), g);
        inp.set(ifc::flow_context::ACTION.at(ctx), consts::MLX5_FLOW_CONTEXT_ACTION_FWD_DEST);
        inp.set(ifc::flow_context::DESTINATION_LIST_SIZE.at(ctx), 4);
        let (s, y, _) = e.r.h.cmd(&inp, 16);
        assert_eq!((s, y), (consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR, syn::BAD_INPUT_LEN));
        // Another table type is not modelled.
        let mut inp = vec![0u8; ifc::create_flow_table_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_FLOW_TABLE.into());
        inp.set(ifc::create_flow_table_in::TABLE_TYPE, consts::MLX5_FLOW_TABLE_TYPE_FDB);
        assert_eq!(e.r.h.cmd(&inp, 16).1, syn::FT_TYPE);
    }
}

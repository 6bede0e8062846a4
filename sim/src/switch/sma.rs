//! The switch's subnet management agent (IBTA vol. 1, 14.2.5 and 18.2.4): what a ConnectX-class switch answers
//! about itself. NodeInfo (NodeType 2), NodeDescription, SwitchInfo, PortInfo of port 0 (the management port,
//! which holds the switch's LID) and of each external port, LinearForwardingTable, MulticastForwardingTable,
//! PKeyTable, SLtoVLMappingTable, VLArbitrationTable and GUIDInfo. The SMP, NodeInfo and PortInfo layouts are
//! the firmware SMA's (`fw/mad_ifc.rs`); the switch-only attributes are laid out here. Anything else gets the MAD
//! status a switch gives (0x000c, unsupported method/attribute), never a panic.

use crate::fw::mad_ifc::{
    MadStatus, NodeInfo, PortInfo, Smp, ATTR_GUID_INFO, ATTR_NODE_DESC, ATTR_NODE_INFO, ATTR_PKEY_TABLE,
    ATTR_PORT_INFO, ATTR_SL_TO_VL_TABLE, ATTR_VL_ARB_TABLE, CLASS_SUBN_DIRECTED_ROUTE, METHOD_GET, METHOD_GET_RESP,
    METHOD_SET, METHOD_TRAP_REPRESS, SMP_DATA_LEN, STATUS_DIRECTION,
};

/// Switch-only attributes (IBTA 14.2.5).
pub(crate) const ATTR_SWITCH_INFO: u16 = 0x0012;
pub(crate) const ATTR_LINEAR_FT: u16 = 0x0019;
pub(crate) const ATTR_MULTICAST_FT: u16 = 0x001b;

/// LinearFDBCap: every unicast LID (0x0000-0xbfff), as Mellanox switches report it.
pub(crate) const LINEAR_FDB_CAP: usize = 0xc000;
/// Entries of one LinearForwardingTable block.
pub(crate) const LFT_BLOCK: usize = 64;
/// MulticastFDBCap: multicast LIDs 0xc000 up to 0xc3ff.
pub(crate) const MCAST_FDB_CAP: usize = 1024;
/// Entries of one MulticastForwardingTable block (16-bit port masks).
const MFT_BLOCK: usize = 32;
/// PartitionEnforcementCap (external ports) and NodeInfo:PartitionCap (port 0): one block of P_Keys.
const PKEYS: usize = 32;
/// An LFT entry no SM programmed (IBTA 18.2.4.3.1: 255 drops the packet).
pub(crate) const UNPROGRAMMED: u8 = 0xff;

/// NodeInfo facts: a switch (type 2) of Mellanox (OUI 00:02:c9), a Switch-IB device id.
const NODE_TYPE_SWITCH: u8 = 2;
const VENDOR_ID_MELLANOX: u32 = 0x0002c9;
const DEVICE_ID_SWITCH_IB: u16 = 0xcb20;
/// Port states (PortInfo:PortState) and physical states (PortPhysicalState).
const DOWN: u8 = 1;
const INIT: u8 = 2;
const ARMED: u8 = 3;
const ACTIVE: u8 = 4;
const PHYS_POLLING: u8 = 2;
const PHYS_LINK_UP: u8 = 5;
/// VLCap 4 (VL0-VL7); VLArbitration capacities 8 and 8, so blocks 1 and 3 exist (as the HCA's).
const VL_CAP: u8 = 4;
const VL_ARB_CAP: u8 = 8;
/// The IB MTU code of 4096 bytes (MTUCap and NeighborMTU).
const MTU_4096: u8 = 5;
/// Link width 4x and speed EDR (PortInfo's encodings: LinkSpeed SDR with LinkSpeedExt EDR), what the simulated
/// HCA ports report, with IsExtendedSpeedsSupported (CapabilityMask bit 14) so LinkSpeedExt* count.
const WIDTH_4X: u8 = 2;
const SPEED_SDR: u8 = 1;
const SPEED_EXT_EDR: u8 = 2;
const CAP_EXTENDED_SPEEDS: u32 = 1 << 14;
/// Distinct (method, attribute, status) answers other than success remembered, at most.
const MAX_STATUSES: usize = 32;
/// The largest unicast LID.
const MAX_UNICAST_LID: u16 = 0xbfff;

/// One port of the switch: 0 is the management port, 1..=N the external ones.
#[derive(Debug, Clone)]
pub(crate) struct SwPort {
    pub(crate) state: u8,
    pub(crate) phys: u8,
    pub(crate) info: PortInfo,
    pub(crate) pkeys: [u16; PKEYS],
    /// VLArbitration blocks 1 (low, entries 0-31) and 3 (high, entries 0-31).
    vl_arb: [[u8; SMP_DATA_LEN]; 2],
}

/// SwitchInfo (IBTA 14.2.5.4) as this switch keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SwitchInfo {
    pub(crate) linear_fdb_top: u16,
    pub(crate) default_port: u8,
    pub(crate) default_mcast_primary: u8,
    pub(crate) default_mcast_not_primary: u8,
    /// LifeTimeValue (5 bits).
    pub(crate) life_time: u8,
    /// PortStateChange: set when an external port's link went up or down; an SM clears it by writing 1.
    pub(crate) port_state_change: bool,
    pub(crate) mcast_fdb_top: u16,
}

impl SwitchInfo {
    /// The 64 bytes of the attribute: LinearFDBCap, RandomFDBCap, MulticastFDBCap, LinearFDBTop (bytes 0-7),
    /// the default ports (8-10), LifeTimeValue | PortStateChange | OptimizedSLtoVL (11), LIDsPerPort (12-13),
    /// PartitionEnforcementCap (14-15), the enforcement capabilities and EnhancedPort0 (16), MulticastFDBTop
    /// (18-19).
    fn emit(&self) -> [u8; SMP_DATA_LEN] {
        let mut d = [0u8; SMP_DATA_LEN];
        d[0..2].copy_from_slice(&(LINEAR_FDB_CAP as u16).to_be_bytes());
        d[4..6].copy_from_slice(&(MCAST_FDB_CAP as u16).to_be_bytes());
        d[6..8].copy_from_slice(&self.linear_fdb_top.to_be_bytes());
        d[8] = self.default_port;
        d[9] = self.default_mcast_primary;
        d[10] = self.default_mcast_not_primary;
        d[11] = (self.life_time & 0x1f) << 3 | u8::from(self.port_state_change) << 2;
        d[14..16].copy_from_slice(&(PKEYS as u16).to_be_bytes());
        d[18..20].copy_from_slice(&self.mcast_fdb_top.to_be_bytes());
        d
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// The switch as its SMA sees it: identity, ports, SwitchInfo and the forwarding tables.
#[derive(Debug)]
pub(crate) struct SwitchSma {
    pub(crate) node_guid: u64,
    desc: [u8; SMP_DATA_LEN],
    /// Port 0 and the external ports.
    pub(crate) ports: Vec<SwPort>,
    pub(crate) info: SwitchInfo,
    /// The LinearForwardingTable: the output port of each unicast LID ([`UNPROGRAMMED`]: none).
    pub(crate) lft: Vec<u8>,
    /// The MulticastForwardingTable's port masks (ports 0-15: one position).
    mft: Vec<u16>,
    /// SLtoVL of each (input, output) port pair: (N+1)^2 tables of 8 bytes.
    sl2vl: Vec<[u8; 8]>,
    /// The SMPs answered with a status other than success: (method, attribute, status, how many), at most
    /// [`MAX_STATUSES`] kinds (later kinds are counted in the last).
    pub(crate) statuses: Vec<(u8, u16, u16, u64)>,
}

impl SwitchSma {
    /// A switch of `external` ports (1 to 15, so one MFT position holds every port), all linked up (in Init,
    /// waiting for an SM), port 0 Active without a LID.
    pub(crate) fn new(node_guid: u64, external: u8, description: &str) -> SwitchSma {
        let external = external.clamp(1, 15);
        let mut desc = [0u8; SMP_DATA_LEN];
        let d = description.as_bytes();
        let n = d.len().min(SMP_DATA_LEN);
        desc[..n].copy_from_slice(&d[..n]);
        let ports = (0..=external)
            .map(|p| {
                let mut pkeys = [0u16; PKEYS];
                pkeys[0] = 0xffff;
                let info = PortInfo {
                    gid_prefix: 0xfe80_0000_0000_0000,
                    local_port_num: p,
                    link_width_enabled: WIDTH_4X,
                    link_width_supported: WIDTH_4X,
                    link_width_active: WIDTH_4X,
                    link_speed_supported: SPEED_SDR,
                    link_down_default_state: PHYS_POLLING,
                    link_speed_active: SPEED_SDR,
                    link_speed_enabled: SPEED_SDR,
                    neighbor_mtu: MTU_4096,
                    vl_cap: VL_CAP,
                    vl_arb_high_cap: VL_ARB_CAP,
                    vl_arb_low_cap: VL_ARB_CAP,
                    mtu_cap: MTU_4096,
                    operational_vls: 1,
                    guid_cap: 1,
                    resp_time_value: 8,
                    capability_mask: CAP_EXTENDED_SPEEDS,
                    link_speed_ext_active: SPEED_EXT_EDR,
                    link_speed_ext_supported: SPEED_EXT_EDR,
                    link_speed_ext_enabled: SPEED_EXT_EDR,
                    ..PortInfo::default()
                };
                let state = if p == 0 { ACTIVE } else { INIT };
                SwPort { state, phys: PHYS_LINK_UP, info, pkeys, vl_arb: [[0; SMP_DATA_LEN]; 2] }
            })
            .collect::<Vec<_>>();
        let all = usize::from(external) + 1;
        SwitchSma {
            node_guid,
            desc,
            ports,
            info: SwitchInfo {
                linear_fdb_top: 0,
                default_port: 0,
                default_mcast_primary: 0,
                default_mcast_not_primary: 0,
                life_time: 0,
                port_state_change: false,
                mcast_fdb_top: 0,
            },
            lft: vec![UNPROGRAMMED; LINEAR_FDB_CAP],
            mft: vec![0; MCAST_FDB_CAP],
            sl2vl: vec![[0; 8]; all * all],
            statuses: Vec::new(),
        }
    }

    /// External ports.
    pub(crate) fn external(&self) -> u8 {
        (self.ports.len() - 1) as u8
    }

    /// The switch's LID (port 0's; 0 until an SM gives one).
    pub(crate) fn lid(&self) -> u16 {
        self.ports[0].info.lid
    }

    /// Whether external port `p` passes packets (its link is up and an SM made it Active).
    pub(crate) fn forwards(&self, p: u8) -> bool {
        self.ports.get(usize::from(p)).is_some_and(|x| p != 0 && x.state == ACTIVE)
    }

    /// Whether external port `p`'s link is up (SMPs cross a link in Init already).
    pub(crate) fn linked(&self, p: u8) -> bool {
        self.ports.get(usize::from(p)).is_some_and(|x| p != 0 && x.phys == PHYS_LINK_UP)
    }

    /// External port `p`'s cable went away (`up` false) or came back: Down/Polling, or Init/LinkUp; either
    /// way PortStateChange is set, as a switch tells the SM its topology changed.
    pub(crate) fn set_link(&mut self, p: u8, up: bool) {
        if let Some(x) = self.ports.get_mut(usize::from(p)).filter(|_| p != 0) {
            let (state, phys) = if up { (INIT, PHYS_LINK_UP) } else { (DOWN, PHYS_POLLING) };
            if (x.state, x.phys) != (state, phys) {
                (x.state, x.phys) = (state, phys);
                self.info.port_state_change = true;
            }
        }
    }

    /// The response to `req`, which came in on port `in_port` (NodeInfo and PortInfo's LocalPortNum): method
    /// GetResp with the status and the attribute as it now is, the direction bit set on a directed-route SMP.
    /// `None` for a TrapRepress (no response).
    pub(crate) fn answer(&mut self, req: &Smp, in_port: u8) -> Option<Smp> {
        if req.method == METHOD_TRAP_REPRESS {
            return None;
        }
        let mut rsp = req.clone();
        rsp.method = METHOD_GET_RESP;
        let status = match self.answer_into(req, in_port, &mut rsp.data) {
            Ok(()) => MadStatus::Success,
            Err(s) => s,
        };
        rsp.status = status as u16;
        if status != MadStatus::Success {
            let k = (req.method, req.attr_id, status as u16);
            let full = self.statuses.len() >= MAX_STATUSES;
            match self.statuses.iter().position(|s| (s.0, s.1, s.2) == k) {
                Some(i) => self.statuses[i].3 += 1,
                None if !full => self.statuses.push((k.0, k.1, k.2, 1)),
                None => {
                    if let Some(last) = self.statuses.last_mut() {
                        last.3 += 1;
                    }
                }
            }
        }
        if req.mgmt_class == CLASS_SUBN_DIRECTED_ROUTE {
            rsp.status |= STATUS_DIRECTION;
        }
        Some(rsp)
    }

    fn node_info(&self, in_port: u8) -> NodeInfo {
        NodeInfo {
            base_version: 1,
            class_version: 1,
            node_type: NODE_TYPE_SWITCH,
            num_ports: self.external(),
            system_image_guid: self.node_guid,
            node_guid: self.node_guid,
            // A switch has one port GUID, port 0's.
            port_guid: self.node_guid,
            partition_cap: PKEYS as u16,
            device_id: DEVICE_ID_SWITCH_IB,
            revision: 0,
            local_port_num: in_port,
            vendor_id: VENDOR_ID_MELLANOX,
        }
    }

    /// The port named by an attribute modifier's port number, or status 0x1c.
    fn port_index(&self, p: u32) -> Result<usize, MadStatus> {
        let p = p as usize;
        if p < self.ports.len() {
            Ok(p)
        } else {
            Err(MadStatus::InvalidField)
        }
    }

    fn port_info(&self, p: usize, in_port: u8) -> PortInfo {
        let x = &self.ports[p];
        // A switch's LID, LMC and SM LID are port 0's (IBTA 14.2.5.6): the external ports report them too.
        let base = &self.ports[0].info;
        PortInfo {
            port_state: x.state,
            port_phys_state: x.phys,
            lid: base.lid,
            lmc: base.lmc,
            master_sm_lid: base.master_sm_lid,
            master_sm_sl: base.master_sm_sl,
            local_port_num: in_port,
            ..x.info
        }
    }

    /// A Set(PortInfo) of port `p`, checked first: `Err` changes nothing.
    fn set_port_info(&mut self, p: usize, want: &PortInfo) -> Result<(), MadStatus> {
        if want.lid > MAX_UNICAST_LID || want.master_sm_lid > MAX_UNICAST_LID {
            return Err(MadStatus::InvalidField);
        }
        if want.operational_vls > VL_CAP || (want.neighbor_mtu != 0 && want.neighbor_mtu > MTU_4096) {
            return Err(MadStatus::InvalidField);
        }
        if !matches!(want.port_phys_state, 0 | PHYS_POLLING | PHYS_LINK_UP) {
            return Err(MadStatus::InvalidField);
        }
        let x = &self.ports[p];
        let state = match (p, want.port_state) {
            (_, 0) => x.state,
            // Port 0 is the switch itself: always Active; writing its state back changes nothing.
            (0, s) if s <= ACTIVE => x.state,
            // Down: an external link retrains and comes back in Init (its cable is still in).
            (_, DOWN) if x.phys == PHYS_LINK_UP => INIT,
            (_, DOWN) => DOWN,
            // IBTA Table 148: Armed from Init, Active from Armed (and each from itself), on a link that is up.
            (_, ARMED) if x.phys == PHYS_LINK_UP && matches!(x.state, INIT | ARMED) => ARMED,
            (_, ACTIVE) if x.phys == PHYS_LINK_UP && matches!(x.state, ARMED | ACTIVE) => ACTIVE,
            _ => return Err(MadStatus::InvalidField),
        };
        if p == 0 {
            let b = &mut self.ports[0].info;
            b.lid = want.lid;
            b.lmc = want.lmc;
            b.master_sm_lid = want.master_sm_lid;
            b.master_sm_sl = want.master_sm_sl;
            b.subnet_timeout = want.subnet_timeout;
            b.m_key = want.m_key;
            b.m_key_lease_period = want.m_key_lease_period;
            b.m_key_protect_bits = want.m_key_protect_bits;
            b.gid_prefix = want.gid_prefix;
        }
        let x = &mut self.ports[p];
        x.state = state;
        if want.neighbor_mtu != 0 {
            x.info.neighbor_mtu = want.neighbor_mtu;
        }
        if want.operational_vls != 0 {
            x.info.operational_vls = want.operational_vls;
        }
        x.info.vl_high_limit = want.vl_high_limit;
        x.info.hoq_life = want.hoq_life;
        x.info.enforcement = want.enforcement;
        Ok(())
    }

    fn answer_into(&mut self, req: &Smp, in_port: u8, data: &mut [u8; SMP_DATA_LEN]) -> Result<(), MadStatus> {
        if req.base_version != 1 || req.class_version != 1 {
            return Err(MadStatus::BadVersion);
        }
        let set = match req.method {
            METHOD_GET => false,
            METHOD_SET => true,
            _ => return Err(MadStatus::UnsupportedMethod),
        };
        let m = req.attr_mod;
        match (req.attr_id, set) {
            (ATTR_NODE_INFO, false) => *data = self.node_info(in_port).emit(),
            (ATTR_NODE_DESC, false) => *data = self.desc,
            (ATTR_SWITCH_INFO, _) => {
                if set {
                    let d = &req.data;
                    let i = &mut self.info;
                    i.linear_fdb_top = be16(d, 6).min((LINEAR_FDB_CAP - 1) as u16);
                    (i.default_port, i.default_mcast_primary, i.default_mcast_not_primary) = (d[8], d[9], d[10]);
                    i.life_time = d[11] >> 3;
                    // PortStateChange is cleared by writing 1 (IBTA 14.2.5.4).
                    if d[11] & 0x04 != 0 {
                        i.port_state_change = false;
                    }
                    i.mcast_fdb_top = be16(d, 18);
                }
                *data = self.info.emit();
            }
            (ATTR_PORT_INFO, _) => {
                // Bit 31: the SM handles extended speeds; the port number in bits 7:0.
                let p = self.port_index(m & 0x7fff_ffff)?;
                if set {
                    self.set_port_info(p, &PortInfo::parse(&req.data))?;
                }
                *data = self.port_info(p, in_port).emit();
            }
            (ATTR_LINEAR_FT, _) => {
                let block = m as usize;
                if block >= LINEAR_FDB_CAP / LFT_BLOCK {
                    return Err(MadStatus::InvalidField);
                }
                let at = block * LFT_BLOCK;
                if set {
                    self.lft[at..at + LFT_BLOCK].copy_from_slice(&req.data[..LFT_BLOCK]);
                }
                data.copy_from_slice(&self.lft[at..at + LFT_BLOCK]);
            }
            (ATTR_MULTICAST_FT, _) => {
                // Bits 31:28 the port-mask position (ports 16k..16k+15), bits 8:0 the block of 32 entries.
                let (position, block) = (m >> 28, (m & 0x1ff) as usize);
                if position != 0 || block >= MCAST_FDB_CAP / MFT_BLOCK || m & 0x0fff_fe00 != 0 {
                    return Err(MadStatus::InvalidField);
                }
                let at = block * MFT_BLOCK;
                for k in 0..MFT_BLOCK {
                    if set {
                        self.mft[at + k] = be16(&req.data, 2 * k);
                    }
                    data[2 * k..2 * k + 2].copy_from_slice(&self.mft[at + k].to_be_bytes());
                }
            }
            (ATTR_PKEY_TABLE, _) => {
                // The port in bits 31:16, the block in 15:0: one block each here.
                let p = self.port_index(m >> 16)?;
                if m & 0xffff != 0 {
                    return Err(MadStatus::InvalidField);
                }
                for k in 0..PKEYS {
                    if set {
                        self.ports[p].pkeys[k] = be16(&req.data, 2 * k);
                    }
                    data[2 * k..2 * k + 2].copy_from_slice(&self.ports[p].pkeys[k].to_be_bytes());
                }
            }
            (ATTR_SL_TO_VL_TABLE, _) => {
                // A switch's table per (input port in bits 15:8, output port in bits 7:0).
                let (i, o) = (self.port_index((m >> 8) & 0xff)?, self.port_index(m & 0xff)?);
                if m >> 16 != 0 {
                    return Err(MadStatus::InvalidField);
                }
                let at = i * self.ports.len() + o;
                if set {
                    if req.data[..8].iter().flat_map(|b| [b >> 4, b & 0xf]).any(|vl| vl >= 8 && vl != 15) {
                        return Err(MadStatus::InvalidField);
                    }
                    self.sl2vl[at].copy_from_slice(&req.data[..8]);
                }
                *data = [0; SMP_DATA_LEN];
                data[..8].copy_from_slice(&self.sl2vl[at]);
            }
            (ATTR_VL_ARB_TABLE, _) => {
                // The block in bits 31:16 (1 and 3 exist with capacities of 8), the output port in 15:0.
                let p = self.port_index(m & 0xffff)?;
                let slot = match m >> 16 {
                    1 => 0,
                    3 => 1,
                    _ => return Err(MadStatus::InvalidField),
                };
                if set {
                    self.ports[p].vl_arb[slot] = req.data;
                }
                *data = self.ports[p].vl_arb[slot];
            }
            (ATTR_GUID_INFO, false) => {
                // Port 0's one GUID, the switch's.
                if m != 0 {
                    return Err(MadStatus::InvalidField);
                }
                *data = [0; SMP_DATA_LEN];
                data[..8].copy_from_slice(&self.node_guid.to_be_bytes());
            }
            _ => return Err(MadStatus::UnsupportedMethodAttr),
        }
        Ok(())
    }
}

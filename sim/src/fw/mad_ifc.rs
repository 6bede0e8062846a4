//! MAD_IFC: the firmware's subnet management agent (SMA). `mlx5_ib`'s `process_mad` hands it every SMP that
//! arrives on QP0 (and its own local queries); the SMA answers NodeInfo, NodeDescription, PortInfo (Get and Set:
//! LID, SM LID, the logical state INIT -> ARMED -> ACTIVE), GUIDInfo, PKeyTable, SLtoVLMappingTable and
//! VLArbitrationTable of the one port, over the port state in `fw/port.rs`.
//!
//! The SMP and attribute layouts are the IBTA's (volume 1, 14.2.1.2 and 14.2.5), as Linux's
//! `include/rdma/ib_smi.h` and opensm read them; they are not PRM layouts, so they are laid out here, each field
//! named once. A malformed SMP is answered with the MAD status a real SMA gives, never a command failure: the
//! command fails only for what the PRM checks (the port, the link layer).

use mlx5_core::prm::{consts, ifc};

use super::ib_vport::{self, GID_ENTRIES, NODE_DESC};
use super::port::{PortModel, PKEY_ENTRIES};
use super::reply::{bad_param, rd, CmdErr};
use super::syndrome;
use crate::config::PortType;
use crate::events::SimEvent;

/// Bytes of a MAD (IBTA 13.4.1) and of an SMP's attribute data.
pub(crate) const MAD_LEN: usize = 256;
pub(crate) const SMP_DATA_LEN: usize = 64;
/// Hops a directed-route path holds (`IB_SMP_MAX_PATH_HOPS`).
pub(crate) const MAX_PATH_HOPS: usize = 64;

/// Management classes (IBTA 13.4.4).
pub(crate) const CLASS_SUBN_LID_ROUTED: u8 = 0x01;
pub(crate) const CLASS_SUBN_DIRECTED_ROUTE: u8 = 0x81;

/// Methods (IBTA 13.4.5).
pub(crate) const METHOD_GET: u8 = 0x01;
pub(crate) const METHOD_SET: u8 = 0x02;
pub(crate) const METHOD_GET_RESP: u8 = 0x81;
pub(crate) const METHOD_TRAP_REPRESS: u8 = 0x07;

/// Subnet management attributes (IBTA 14.2.5).
pub(crate) const ATTR_NODE_DESC: u16 = 0x0010;
pub(crate) const ATTR_NODE_INFO: u16 = 0x0011;
pub(crate) const ATTR_GUID_INFO: u16 = 0x0014;
pub(crate) const ATTR_PORT_INFO: u16 = 0x0015;
pub(crate) const ATTR_PKEY_TABLE: u16 = 0x0016;
pub(crate) const ATTR_SL_TO_VL_TABLE: u16 = 0x0017;
pub(crate) const ATTR_VL_ARB_TABLE: u16 = 0x0018;

/// The direction bit of a directed-route SMP's status word: set in responses (IBTA 14.2.1.2).
pub(crate) const STATUS_DIRECTION: u16 = 0x8000;

/// The MAD status codes an SMA answers with (IBTA 13.4.7, Table 113; `IB_MGMT_MAD_STATUS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum MadStatus {
    Success = 0x0000,
    /// The base or class version (or the class itself) is not supported.
    BadVersion = 0x0004,
    /// The method is not supported by the class.
    UnsupportedMethod = 0x0008,
    /// The method and attribute combination is not supported.
    UnsupportedMethodAttr = 0x000c,
    /// A field of the attribute or the attribute modifier is invalid.
    InvalidField = 0x001c,
}

/// Why bytes are not an SMP at all (too short to carry the header, or not a subnet management class).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SmpError {
    /// Fewer than [`MAD_LEN`] bytes.
    Truncated { len: usize },
    /// A management class other than the two subnet management ones.
    NotSubnetClass { class: u8 },
}

impl core::fmt::Display for SmpError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Truncated { len } => write!(f, "an SMP is {MAD_LEN} bytes, got {len}"),
            Self::NotSubnetClass { class } => write!(f, "management class {class:#04x} is not subnet management"),
        }
    }
}

impl std::error::Error for SmpError {}

/// A subnet management packet (IBTA 14.2.1.1 LID-routed and 14.2.1.2 directed-route; `struct ib_smp`). The
/// directed-route fields are carried either way; a LID-routed SMP has them reserved (zero).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Smp {
    pub(crate) base_version: u8,
    pub(crate) mgmt_class: u8,
    pub(crate) class_version: u8,
    pub(crate) method: u8,
    pub(crate) status: u16,
    pub(crate) hop_ptr: u8,
    pub(crate) hop_cnt: u8,
    pub(crate) tid: u64,
    pub(crate) attr_id: u16,
    pub(crate) attr_mod: u32,
    pub(crate) m_key: u64,
    pub(crate) dr_slid: u16,
    pub(crate) dr_dlid: u16,
    pub(crate) data: [u8; SMP_DATA_LEN],
    pub(crate) initial_path: [u8; MAX_PATH_HOPS],
    pub(crate) return_path: [u8; MAX_PATH_HOPS],
}

/// Byte offsets of the SMP's fields (`struct ib_smp`).
mod off {
    pub(super) const BASE_VERSION: usize = 0;
    pub(super) const MGMT_CLASS: usize = 1;
    pub(super) const CLASS_VERSION: usize = 2;
    pub(super) const METHOD: usize = 3;
    pub(super) const STATUS: usize = 4;
    pub(super) const HOP_PTR: usize = 6;
    pub(super) const HOP_CNT: usize = 7;
    pub(super) const TID: usize = 8;
    pub(super) const ATTR_ID: usize = 16;
    pub(super) const ATTR_MOD: usize = 20;
    pub(super) const M_KEY: usize = 24;
    pub(super) const DR_SLID: usize = 32;
    pub(super) const DR_DLID: usize = 34;
    pub(super) const DATA: usize = 64;
    pub(super) const INITIAL_PATH: usize = 128;
    pub(super) const RETURN_PATH: usize = 192;
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(v)
}

impl Smp {
    /// Reads an SMP from the first [`MAD_LEN`] bytes of `b`; only the length and the class are checked here,
    /// versions and methods are the SMA's to answer.
    pub(crate) fn parse(b: &[u8]) -> Result<Self, SmpError> {
        let b = b.get(..MAD_LEN).ok_or(SmpError::Truncated { len: b.len() })?;
        let class = b[off::MGMT_CLASS];
        if class != CLASS_SUBN_LID_ROUTED && class != CLASS_SUBN_DIRECTED_ROUTE {
            return Err(SmpError::NotSubnetClass { class });
        }
        let mut data = [0u8; SMP_DATA_LEN];
        data.copy_from_slice(&b[off::DATA..off::DATA + SMP_DATA_LEN]);
        let mut initial_path = [0u8; MAX_PATH_HOPS];
        initial_path.copy_from_slice(&b[off::INITIAL_PATH..off::INITIAL_PATH + MAX_PATH_HOPS]);
        let mut return_path = [0u8; MAX_PATH_HOPS];
        return_path.copy_from_slice(&b[off::RETURN_PATH..off::RETURN_PATH + MAX_PATH_HOPS]);
        Ok(Self {
            base_version: b[off::BASE_VERSION],
            mgmt_class: class,
            class_version: b[off::CLASS_VERSION],
            method: b[off::METHOD],
            status: be16(b, off::STATUS),
            hop_ptr: b[off::HOP_PTR],
            hop_cnt: b[off::HOP_CNT],
            tid: be64(b, off::TID),
            attr_id: be16(b, off::ATTR_ID),
            attr_mod: be32(b, off::ATTR_MOD),
            m_key: be64(b, off::M_KEY),
            dr_slid: be16(b, off::DR_SLID),
            dr_dlid: be16(b, off::DR_DLID),
            data,
            initial_path,
            return_path,
        })
    }

    /// The SMP as its [`MAD_LEN`] bytes (reserved bytes zero).
    pub(crate) fn emit(&self) -> [u8; MAD_LEN] {
        let mut b = [0u8; MAD_LEN];
        b[off::BASE_VERSION] = self.base_version;
        b[off::MGMT_CLASS] = self.mgmt_class;
        b[off::CLASS_VERSION] = self.class_version;
        b[off::METHOD] = self.method;
        b[off::STATUS..off::STATUS + 2].copy_from_slice(&self.status.to_be_bytes());
        b[off::HOP_PTR] = self.hop_ptr;
        b[off::HOP_CNT] = self.hop_cnt;
        b[off::TID..off::TID + 8].copy_from_slice(&self.tid.to_be_bytes());
        b[off::ATTR_ID..off::ATTR_ID + 2].copy_from_slice(&self.attr_id.to_be_bytes());
        b[off::ATTR_MOD..off::ATTR_MOD + 4].copy_from_slice(&self.attr_mod.to_be_bytes());
        b[off::M_KEY..off::M_KEY + 8].copy_from_slice(&self.m_key.to_be_bytes());
        b[off::DR_SLID..off::DR_SLID + 2].copy_from_slice(&self.dr_slid.to_be_bytes());
        b[off::DR_DLID..off::DR_DLID + 2].copy_from_slice(&self.dr_dlid.to_be_bytes());
        b[off::DATA..off::DATA + SMP_DATA_LEN].copy_from_slice(&self.data);
        b[off::INITIAL_PATH..off::INITIAL_PATH + MAX_PATH_HOPS].copy_from_slice(&self.initial_path);
        b[off::RETURN_PATH..off::RETURN_PATH + MAX_PATH_HOPS].copy_from_slice(&self.return_path);
        b
    }
}

/// NodeInfo (IBTA 14.2.5.3): what kind of node this is and its GUIDs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NodeInfo {
    pub(crate) base_version: u8,
    pub(crate) class_version: u8,
    /// 1: channel adapter.
    pub(crate) node_type: u8,
    pub(crate) num_ports: u8,
    pub(crate) system_image_guid: u64,
    pub(crate) node_guid: u64,
    pub(crate) port_guid: u64,
    pub(crate) partition_cap: u16,
    pub(crate) device_id: u16,
    pub(crate) revision: u32,
    pub(crate) local_port_num: u8,
    /// 24 bits: the IEEE OUI.
    pub(crate) vendor_id: u32,
}

impl NodeInfo {
    pub(crate) fn emit(&self) -> [u8; SMP_DATA_LEN] {
        let mut d = [0u8; SMP_DATA_LEN];
        d[0] = self.base_version;
        d[1] = self.class_version;
        d[2] = self.node_type;
        d[3] = self.num_ports;
        d[4..12].copy_from_slice(&self.system_image_guid.to_be_bytes());
        d[12..20].copy_from_slice(&self.node_guid.to_be_bytes());
        d[20..28].copy_from_slice(&self.port_guid.to_be_bytes());
        d[28..30].copy_from_slice(&self.partition_cap.to_be_bytes());
        d[30..32].copy_from_slice(&self.device_id.to_be_bytes());
        d[32..36].copy_from_slice(&self.revision.to_be_bytes());
        d[36] = self.local_port_num;
        d[37..40].copy_from_slice(&self.vendor_id.to_be_bytes()[1..]);
        d
    }

    #[cfg(test)]
    pub(crate) fn parse(d: &[u8; SMP_DATA_LEN]) -> Self {
        Self {
            base_version: d[0],
            class_version: d[1],
            node_type: d[2],
            num_ports: d[3],
            system_image_guid: be64(d, 4),
            node_guid: be64(d, 12),
            port_guid: be64(d, 20),
            partition_cap: be16(d, 28),
            device_id: be16(d, 30),
            revision: be32(d, 32),
            local_port_num: d[36],
            vendor_id: be32(d, 36) & 0x00ff_ffff,
        }
    }
}

/// PortInfo (IBTA 14.2.5.6; `struct ib_port_info`): the fields this SMA reports or takes, each unpacked from
/// its nibble or bit group. Fields a channel adapter leaves zero (diag code, error thresholds, ...) are not
/// carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct PortInfo {
    pub(crate) m_key: u64,
    pub(crate) gid_prefix: u64,
    pub(crate) lid: u16,
    pub(crate) master_sm_lid: u16,
    pub(crate) capability_mask: u32,
    pub(crate) m_key_lease_period: u16,
    pub(crate) local_port_num: u8,
    pub(crate) link_width_enabled: u8,
    pub(crate) link_width_supported: u8,
    pub(crate) link_width_active: u8,
    pub(crate) link_speed_supported: u8,
    /// 1 Down, 2 Init, 3 Armed, 4 Active; 0 in a Set: no change.
    pub(crate) port_state: u8,
    /// 2 Polling, 3 Disabled, 5 LinkUp; 0 in a Set: no change.
    pub(crate) port_phys_state: u8,
    pub(crate) link_down_default_state: u8,
    pub(crate) m_key_protect_bits: u8,
    pub(crate) lmc: u8,
    pub(crate) link_speed_active: u8,
    pub(crate) link_speed_enabled: u8,
    /// IB MTU code (1 256 .. 5 4096).
    pub(crate) neighbor_mtu: u8,
    pub(crate) master_sm_sl: u8,
    pub(crate) vl_cap: u8,
    pub(crate) init_type: u8,
    pub(crate) vl_high_limit: u8,
    pub(crate) vl_arb_high_cap: u8,
    pub(crate) vl_arb_low_cap: u8,
    pub(crate) init_type_reply: u8,
    pub(crate) mtu_cap: u8,
    pub(crate) vl_stall_count: u8,
    pub(crate) hoq_life: u8,
    pub(crate) operational_vls: u8,
    /// PartitionEnforcementInbound/Outbound, FilterRawInbound/Outbound, as their four bits.
    pub(crate) enforcement: u8,
    pub(crate) m_key_violations: u16,
    pub(crate) p_key_violations: u16,
    pub(crate) q_key_violations: u16,
    pub(crate) guid_cap: u8,
    pub(crate) client_reregister: bool,
    pub(crate) subnet_timeout: u8,
    pub(crate) resp_time_value: u8,
    pub(crate) capability_mask2: u16,
    pub(crate) link_speed_ext_active: u8,
    pub(crate) link_speed_ext_supported: u8,
    pub(crate) link_speed_ext_enabled: u8,
}

impl PortInfo {
    pub(crate) fn emit(&self) -> [u8; SMP_DATA_LEN] {
        let mut d = [0u8; SMP_DATA_LEN];
        d[0..8].copy_from_slice(&self.m_key.to_be_bytes());
        d[8..16].copy_from_slice(&self.gid_prefix.to_be_bytes());
        d[16..18].copy_from_slice(&self.lid.to_be_bytes());
        d[18..20].copy_from_slice(&self.master_sm_lid.to_be_bytes());
        d[20..24].copy_from_slice(&self.capability_mask.to_be_bytes());
        d[26..28].copy_from_slice(&self.m_key_lease_period.to_be_bytes());
        d[28] = self.local_port_num;
        d[29] = self.link_width_enabled;
        d[30] = self.link_width_supported;
        d[31] = self.link_width_active;
        d[32] = (self.link_speed_supported << 4) | (self.port_state & 0xf);
        d[33] = (self.port_phys_state << 4) | (self.link_down_default_state & 0xf);
        d[34] = (self.m_key_protect_bits << 6) | (self.lmc & 0x7);
        d[35] = (self.link_speed_active << 4) | (self.link_speed_enabled & 0xf);
        d[36] = (self.neighbor_mtu << 4) | (self.master_sm_sl & 0xf);
        d[37] = (self.vl_cap << 4) | (self.init_type & 0xf);
        d[38] = self.vl_high_limit;
        d[39] = self.vl_arb_high_cap;
        d[40] = self.vl_arb_low_cap;
        d[41] = (self.init_type_reply << 4) | (self.mtu_cap & 0xf);
        d[42] = (self.vl_stall_count << 5) | (self.hoq_life & 0x1f);
        d[43] = (self.operational_vls << 4) | (self.enforcement & 0xf);
        d[44..46].copy_from_slice(&self.m_key_violations.to_be_bytes());
        d[46..48].copy_from_slice(&self.p_key_violations.to_be_bytes());
        d[48..50].copy_from_slice(&self.q_key_violations.to_be_bytes());
        d[50] = self.guid_cap;
        d[51] = (u8::from(self.client_reregister) << 7) | (self.subnet_timeout & 0x1f);
        d[52] = self.resp_time_value & 0x1f;
        d[60..62].copy_from_slice(&self.capability_mask2.to_be_bytes());
        d[62] = (self.link_speed_ext_active << 4) | (self.link_speed_ext_supported & 0xf);
        d[63] = self.link_speed_ext_enabled & 0x1f;
        d
    }

    pub(crate) fn parse(d: &[u8; SMP_DATA_LEN]) -> Self {
        Self {
            m_key: be64(d, 0),
            gid_prefix: be64(d, 8),
            lid: be16(d, 16),
            master_sm_lid: be16(d, 18),
            capability_mask: be32(d, 20),
            m_key_lease_period: be16(d, 26),
            local_port_num: d[28],
            link_width_enabled: d[29],
            link_width_supported: d[30],
            link_width_active: d[31],
            link_speed_supported: d[32] >> 4,
            port_state: d[32] & 0xf,
            port_phys_state: d[33] >> 4,
            link_down_default_state: d[33] & 0xf,
            m_key_protect_bits: d[34] >> 6,
            lmc: d[34] & 0x7,
            link_speed_active: d[35] >> 4,
            link_speed_enabled: d[35] & 0xf,
            neighbor_mtu: d[36] >> 4,
            master_sm_sl: d[36] & 0xf,
            vl_cap: d[37] >> 4,
            init_type: d[37] & 0xf,
            vl_high_limit: d[38],
            vl_arb_high_cap: d[39],
            vl_arb_low_cap: d[40],
            init_type_reply: d[41] >> 4,
            mtu_cap: d[41] & 0xf,
            vl_stall_count: d[42] >> 5,
            hoq_life: d[42] & 0x1f,
            operational_vls: d[43] >> 4,
            enforcement: d[43] & 0xf,
            m_key_violations: be16(d, 44),
            p_key_violations: be16(d, 46),
            q_key_violations: be16(d, 48),
            guid_cap: d[50],
            client_reregister: d[51] & 0x80 != 0,
            subnet_timeout: d[51] & 0x1f,
            resp_time_value: d[52] & 0x1f,
            capability_mask2: be16(d, 60),
            link_speed_ext_active: d[62] >> 4,
            link_speed_ext_supported: d[62] & 0xf,
            link_speed_ext_enabled: d[63] & 0x1f,
        }
    }
}

/// The PortInfo:CapabilityMask bit that says LinkSpeedExt* are valid (IsExtendedSpeedsSupported, bit 14).
const CAP_EXTENDED_SPEEDS: u32 = 1 << 14;
/// NodeInfo facts of a ConnectX-5: a channel adapter of Mellanox (OUI 00:02:c9) with one port here.
const NODE_TYPE_CA: u8 = 1;
const VENDOR_ID_MELLANOX: u32 = 0x0002c9;
/// VLArbitrationTable capacities (PortInfo:VLArbitrationHighCap / LowCap): 8 entries each, so block 1 (low
/// priority, entries 0-31) and block 3 (high priority, 0-31) exist and blocks 2 and 4 (entries 32-63) do not.
pub(crate) const VL_ARB_HIGH_CAP: u8 = 8;
pub(crate) const VL_ARB_LOW_CAP: u8 = 8;
/// PortInfo:VLCap 4: VL0-VL7, what PVLC's `vl_hw_cap` 8 says.
const VL_CAP: u8 = 4;
/// The largest unicast LID (IBTA 4.1.3: 0xc000-0xfffe multicast, 0xffff permissive).
const MAX_UNICAST_LID: u16 = 0xbfff;
/// PortInfo's attribute modifier bit 31: the SM supports extended link speeds (IBTA 14.2.5.6).
const PORT_INFO_SM_EXT_SPEEDS: u32 = 1 << 31;
/// P_Keys per PKeyTable block and GUIDs per GUIDInfo block.
const PKEYS_PER_BLOCK: usize = 32;
const GUIDS_PER_BLOCK: usize = 8;

/// IB link width of a PTYS width bit (IBTA PortInfo:LinkWidth* encoding: 1 1x, 2 4x, 4 8x, 8 12x, 16 2x).
fn ib_width(ptys: u16) -> u8 {
    match u32::from(ptys) {
        consts::MLX5_PTYS_WIDTH_1X => 1,
        consts::MLX5_PTYS_WIDTH_2X => 16,
        consts::MLX5_PTYS_WIDTH_4X => 2,
        consts::MLX5_PTYS_WIDTH_8X => 4,
        consts::MLX5_PTYS_WIDTH_12X => 8,
        _ => 2,
    }
}

/// (LinkSpeedActive, LinkSpeedExtActive) of an `IB_SPEED_*` bit: SDR/DDR/QDR in the first (1, 2, 4), FDR and
/// above in the second (1 FDR, 2 EDR, 4 HDR, 8 NDR) with the first at SDR, as `mlx5_query_mad_ifc_port` reads
/// them. FDR10 is a vendor extension (ExtendedPortInfo) and reads as QDR here.
fn ib_speed(proto: u16) -> (u8, u8) {
    match u32::from(proto) {
        consts::IB_SPEED_SDR => (1, 0),
        consts::IB_SPEED_DDR => (2, 0),
        consts::IB_SPEED_QDR | consts::IB_SPEED_FDR10 => (4, 0),
        consts::IB_SPEED_FDR => (1, 1),
        consts::IB_SPEED_HDR => (1, 4),
        consts::IB_SPEED_NDR => (1, 8),
        _ => (1, 2),
    }
}

/// The port's PortInfo as a Get returns it.
pub(crate) fn port_info(port: &PortModel) -> PortInfo {
    let s = &port.sma;
    let i = &port.info;
    let (speed, ext) = ib_speed(i.ib_proto_oper);
    let width = ib_width(i.ib_link_width_oper);
    let (state, phys) = if port.up {
        (port.ib_state, consts::IB_PORT_PHYS_STATE_LINK_UP as u8)
    } else {
        (consts::IB_PORT_DOWN as u8, consts::IB_PORT_PHYS_STATE_POLLING as u8)
    };
    let mtu = mlx5_core::port::mtu_to_ib_mtu(port.oper_mtu).unwrap_or(5);
    PortInfo {
        m_key: s.m_key,
        gid_prefix: s.gid_prefix,
        lid: port.lid,
        master_sm_lid: port.sm_lid,
        capability_mask: i.cap_mask1 | CAP_EXTENDED_SPEEDS,
        m_key_lease_period: s.m_key_lease_period,
        local_port_num: 1,
        link_width_enabled: width,
        link_width_supported: width,
        link_width_active: width,
        link_speed_supported: speed,
        port_state: state,
        port_phys_state: phys,
        // LinkDownDefaultState 2: Polling.
        link_down_default_state: 2,
        m_key_protect_bits: s.m_key_protect_bits,
        lmc: i.lmc,
        link_speed_active: speed,
        link_speed_enabled: speed,
        neighbor_mtu: s.neighbor_mtu.min(mtu),
        master_sm_sl: i.sm_sl,
        vl_cap: VL_CAP,
        init_type: 0,
        vl_high_limit: s.vl_high_limit,
        vl_arb_high_cap: VL_ARB_HIGH_CAP,
        vl_arb_low_cap: VL_ARB_LOW_CAP,
        init_type_reply: i.init_type_reply,
        mtu_cap: mtu,
        vl_stall_count: 0,
        hoq_life: s.hoq_life,
        operational_vls: s.operational_vls,
        enforcement: s.enforcement,
        m_key_violations: 0,
        p_key_violations: 0,
        q_key_violations: port.qkey_viol_cntr,
        guid_cap: GID_ENTRIES as u8,
        client_reregister: false,
        subnet_timeout: i.subnet_timeout,
        // 2^(8+1) us... IBTA 13.4.6.2's default RespTimeValue 8.
        resp_time_value: 8,
        capability_mask2: i.cap_mask2 as u16,
        link_speed_ext_active: ext,
        link_speed_ext_supported: ext,
        link_speed_ext_enabled: ext,
    }
}

/// The port's NodeInfo.
pub(crate) fn node_info(port: &PortModel) -> NodeInfo {
    NodeInfo {
        base_version: 1,
        class_version: 1,
        node_type: NODE_TYPE_CA,
        num_ports: 1,
        system_image_guid: port.node_guid,
        node_guid: port.node_guid,
        port_guid: port.node_guid,
        partition_cap: PKEY_ENTRIES as u16,
        device_id: port.device_id,
        revision: 0,
        local_port_num: 1,
        vendor_id: VENDOR_ID_MELLANOX,
    }
}

/// What a Set(PortInfo) asks, checked before anything changes: `Err` leaves the port as it was.
fn check_port_info_set(port: &PortModel, req: &PortInfo) -> Result<(), MadStatus> {
    if req.lid > MAX_UNICAST_LID || req.master_sm_lid > MAX_UNICAST_LID {
        return Err(MadStatus::InvalidField);
    }
    let state = u32::from(req.port_state);
    let cur = u32::from(port.ib_state);
    let ok_state = match state {
        0 => true,
        consts::IB_PORT_DOWN => true,
        // IBTA 14.2.5.6 Table 148: Armed from Init, Active from Armed (and each from itself).
        consts::IB_PORT_ARMED => port.up && matches!(cur, consts::IB_PORT_INIT | consts::IB_PORT_ARMED),
        consts::IB_PORT_ACTIVE => port.up && matches!(cur, consts::IB_PORT_ARMED | consts::IB_PORT_ACTIVE),
        _ => false,
    };
    if !ok_state {
        return Err(MadStatus::InvalidField);
    }
    // PortPhysicalState: 0 no change, 2 Polling (the link retrains: it is up again at once here), 5 LinkUp (what
    // a Get returned, written back: no change). Disabled (3) is not modelled and refused, as is the rest.
    if !matches!(req.port_phys_state, 0 | 2 | 5) {
        return Err(MadStatus::InvalidField);
    }
    let mtu_cap = mlx5_core::port::mtu_to_ib_mtu(port.max_mtu).unwrap_or(5);
    if req.neighbor_mtu != 0 && req.neighbor_mtu > mtu_cap {
        return Err(MadStatus::InvalidField);
    }
    if req.operational_vls > VL_CAP {
        return Err(MadStatus::InvalidField);
    }
    Ok(())
}

/// Applies a checked Set(PortInfo) and queues the PORT_CHANGE events a ConnectX posts for what changed.
fn set_port_info(port: &mut PortModel, req: &PortInfo) {
    let mut events = Vec::new();
    if req.lid != port.lid {
        port.lid = req.lid;
        events.push(consts::MLX5_PORT_CHANGE_SUBTYPE_LID);
    }
    port.sm_lid = req.master_sm_lid;
    port.info.sm_sl = req.master_sm_sl;
    port.info.lmc = req.lmc;
    port.info.subnet_timeout = req.subnet_timeout;
    let s = &mut port.sma;
    s.m_key = req.m_key;
    s.m_key_lease_period = req.m_key_lease_period;
    s.m_key_protect_bits = req.m_key_protect_bits;
    s.gid_prefix = req.gid_prefix;
    if req.neighbor_mtu != 0 {
        s.neighbor_mtu = req.neighbor_mtu;
    }
    if req.operational_vls != 0 {
        s.operational_vls = req.operational_vls;
    }
    s.vl_high_limit = req.vl_high_limit;
    s.hoq_life = req.hoq_life;
    s.enforcement = req.enforcement;
    if req.client_reregister {
        events.push(consts::MLX5_PORT_CHANGE_SUBTYPE_CLIENT_REREG);
    }
    let before = port.ib_state;
    match u32::from(req.port_state) {
        // Down: the link retrains and comes back in Init, as a port with its cable still in does.
        consts::IB_PORT_DOWN if port.up => port.ib_state = consts::IB_PORT_INIT as u8,
        s @ (consts::IB_PORT_ARMED | consts::IB_PORT_ACTIVE) => port.ib_state = s as u8,
        _ => {}
    }
    if before != port.ib_state {
        let active = u32::from(port.ib_state) == consts::IB_PORT_ACTIVE;
        if active {
            events.push(consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE);
        } else if u32::from(before) == consts::IB_PORT_ACTIVE {
            events.push(consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN);
        }
    }
    port.pending_change.extend(events);
}

/// Answers one SMP: the response SMP (method GetResp, the status, the attribute as it now is). `None` for a
/// TrapRepress, which has no response.
pub(crate) fn answer(port: &mut PortModel, req: &Smp) -> Option<Smp> {
    let mut rsp = req.clone();
    rsp.method = METHOD_GET_RESP;
    let status = match answer_into(port, req, &mut rsp.data) {
        Ok(()) => MadStatus::Success,
        Err(s) => s,
    };
    if req.method == METHOD_TRAP_REPRESS {
        return None;
    }
    rsp.status = status as u16;
    if req.mgmt_class == CLASS_SUBN_DIRECTED_ROUTE {
        rsp.status |= STATUS_DIRECTION;
    }
    Some(rsp)
}

fn answer_into(port: &mut PortModel, req: &Smp, data: &mut [u8; SMP_DATA_LEN]) -> Result<(), MadStatus> {
    if req.base_version != 1 || req.class_version != 1 {
        return Err(MadStatus::BadVersion);
    }
    let set = match req.method {
        METHOD_GET => false,
        METHOD_SET => true,
        // The SMA sends no traps, so a repress has nothing to stop.
        METHOD_TRAP_REPRESS => return Ok(()),
        _ => return Err(MadStatus::UnsupportedMethod),
    };
    let m = req.attr_mod;
    match (req.attr_id, set) {
        (ATTR_NODE_INFO, false) => *data = node_info(port).emit(),
        (ATTR_NODE_DESC, false) => {
            *data = [0; SMP_DATA_LEN];
            data[..NODE_DESC.len()].copy_from_slice(NODE_DESC);
        }
        (ATTR_PORT_INFO, _) => {
            // A channel adapter's PortInfo: port 0 (the one the SMP came in on) or its number in bits 7:0. Bit 31
            // says the SM handles extended link speeds (opensm sets it in its Sets); bits 30:8 are reserved.
            if m & !PORT_INFO_SM_EXT_SPEEDS > 1 {
                return Err(MadStatus::InvalidField);
            }
            if set {
                let want = PortInfo::parse(&req.data);
                check_port_info_set(port, &want)?;
                set_port_info(port, &want);
            }
            let mut pi = port_info(port);
            pi.client_reregister = false;
            *data = pi.emit();
        }
        (ATTR_GUID_INFO, false) => {
            let block = m as usize;
            if block >= GID_ENTRIES / GUIDS_PER_BLOCK {
                return Err(MadStatus::InvalidField);
            }
            *data = [0; SMP_DATA_LEN];
            for k in 0..GUIDS_PER_BLOCK {
                // GUIDInfo carries the interface ID half of each GID (entry 0: the port GUID).
                let g = ib_vport::gid(port, block * GUIDS_PER_BLOCK + k);
                data[8 * k..8 * k + 8].copy_from_slice(&g[8..]);
            }
        }
        (ATTR_PKEY_TABLE, _) => {
            let block = (m & 0xffff) as usize;
            if block >= PKEY_ENTRIES / PKEYS_PER_BLOCK {
                return Err(MadStatus::InvalidField);
            }
            let base = block * PKEYS_PER_BLOCK;
            if set {
                let mut changed = false;
                for k in 0..PKEYS_PER_BLOCK {
                    let v = be16(&req.data, 2 * k);
                    changed |= port.pkeys[base + k] != v;
                    port.pkeys[base + k] = v;
                }
                if changed {
                    port.pending_change.push(consts::MLX5_PORT_CHANGE_SUBTYPE_PKEY);
                }
            }
            for k in 0..PKEYS_PER_BLOCK {
                data[2 * k..2 * k + 2].copy_from_slice(&port.pkeys[base + k].to_be_bytes());
            }
        }
        (ATTR_SL_TO_VL_TABLE, _) => {
            if set {
                // Each SL must map to an operational data VL or to VL15 (dropped).
                let bad = req.data[..8].iter().flat_map(|b| [b >> 4, b & 0xf]).any(|vl| vl >= 8 && vl != 15);
                if bad {
                    return Err(MadStatus::InvalidField);
                }
                port.sma.sl_to_vl.copy_from_slice(&req.data[..8]);
            }
            *data = [0; SMP_DATA_LEN];
            data[..8].copy_from_slice(&port.sma.sl_to_vl);
        }
        (ATTR_VL_ARB_TABLE, _) => {
            // Upper 16 bits: the block; a channel adapter ignores the port in the lower ones.
            let block = (m >> 16) as usize;
            // Blocks 2 and 4 hold entries 32-63, beyond this port's capacities of 8.
            if !matches!(block, 1 | 3) {
                return Err(MadStatus::InvalidField);
            }
            if set {
                port.sma.vl_arb[block - 1] = req.data;
            }
            *data = port.sma.vl_arb[block - 1];
        }
        _ => return Err(MadStatus::UnsupportedMethodAttr),
    }
    Ok(())
}

/// MAD_IFC: `op_mod` bit 0 ignores the M_Key and bit 1 the B_Key (`mlx5_MAD_IFC`); the M_Key is not checked
/// here either way. The command fails for a port that is not the function's or a link layer without an SMA;
/// a MAD the SMA cannot take is answered in the response MAD with its status.
pub(super) fn mad_ifc(
    port: &mut PortModel,
    events: &mut Vec<SimEvent>,
    inp: &[u8],
    out: &mut [u8],
) -> Result<(), CmdErr> {
    use ifc::mad_ifc_in as i;
    use ifc::mad_ifc_out as o;
    if port.port_type != PortType::Ib || !ib_vport::own_port(rd(inp, i::PORT)) {
        return Err(bad_param(syndrome::BAD_PORT));
    }
    let mad_off = i::MAD.byte_off();
    let mad = inp.get(mad_off..mad_off + MAD_LEN).ok_or(bad_param(syndrome::BAD_INPUT_LEN))?;
    let rsp_off = o::RESPONSE_MAD_PACKET.byte_off();
    let rsp = out.get_mut(rsp_off..rsp_off + MAD_LEN).ok_or(bad_param(syndrome::BAD_OUTPUT_LEN))?;
    match Smp::parse(mad) {
        Ok(req) => {
            if let Some(r) = answer(port, &req) {
                let status = r.status & !STATUS_DIRECTION;
                if status != MadStatus::Success as u16 {
                    events.push(SimEvent::SmpStatus { attr_id: req.attr_id, method: req.method, status });
                }
                rsp.copy_from_slice(&r.emit());
            }
        }
        Err(_) => {
            // Another class (performance, vendor, congestion): not this SMA's; the MAD comes back with
            // "class not supported".
            rsp.copy_from_slice(mad);
            rsp[off::METHOD] = METHOD_GET_RESP;
            rsp[off::STATUS..off::STATUS + 2].copy_from_slice(&(MadStatus::BadVersion as u16).to_be_bytes());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use mlx5_core::prm::{consts, ifc, MsgBuf};

    use super::*;
    use crate::config::SimConfig;
    use crate::events::SimEvent;
    use crate::fw::reply::rd;
    use crate::testkit::submit::Harness;

    /// A directed-route Get(NodeInfo) as opensm's first sweep sends it to its own port (hop count 0, permissive
    /// DrSLID/DrDLID), byte for byte.
    fn dr_get_node_info_bytes() -> [u8; MAD_LEN] {
        let mut b = [0u8; MAD_LEN];
        b[..8].copy_from_slice(&[0x01, 0x81, 0x01, 0x01, 0x00, 0x00, 0x00, 0x00]);
        b[8..16].copy_from_slice(&[0, 0, 0, 0, 0x12, 0x34, 0x56, 0x78]);
        b[16..24].copy_from_slice(&[0x00, 0x11, 0, 0, 0, 0, 0, 0]);
        b[32..36].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        b
    }

    #[test]
    fn smp_parses_and_emits_the_same_bytes() {
        let b = dr_get_node_info_bytes();
        let smp = Smp::parse(&b).unwrap();
        assert_eq!((smp.base_version, smp.mgmt_class, smp.class_version, smp.method), (1, 0x81, 1, METHOD_GET));
        assert_eq!((smp.hop_ptr, smp.hop_cnt, smp.tid), (0, 0, 0x1234_5678));
        assert_eq!((smp.attr_id, smp.attr_mod, smp.m_key), (ATTR_NODE_INFO, 0, 0));
        assert_eq!((smp.dr_slid, smp.dr_dlid), (0xffff, 0xffff));
        assert_eq!(smp.emit(), b);
        // Every field lands where ib_smi.h puts it.
        let mut s = smp.clone();
        s.status = 0x801c;
        s.hop_ptr = 2;
        s.hop_cnt = 3;
        s.attr_mod = 0x0102_0304;
        s.m_key = 0x0a0b_0c0d_0e0f_1011;
        s.initial_path[1] = 7;
        s.return_path[63] = 9;
        s.data[0] = 0x55;
        let e = s.emit();
        assert_eq!(&e[4..8], &[0x80, 0x1c, 2, 3]);
        assert_eq!(&e[20..24], &[1, 2, 3, 4]);
        assert_eq!(&e[24..32], &[0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10, 0x11]);
        assert_eq!((e[64], e[129], e[255]), (0x55, 7, 9));
        assert_eq!(Smp::parse(&e).unwrap(), s);
    }

    #[test]
    fn short_or_foreign_mads_are_typed_errors() {
        let b = dr_get_node_info_bytes();
        assert_eq!(Smp::parse(&b[..255]), Err(SmpError::Truncated { len: 255 }));
        assert_eq!(Smp::parse(&[]), Err(SmpError::Truncated { len: 0 }));
        let mut perf = b;
        perf[1] = 0x04;
        let e = Smp::parse(&perf).unwrap_err();
        assert_eq!(e, SmpError::NotSubnetClass { class: 4 });
        assert!(e.to_string().contains("0x04"));
    }

    #[test]
    fn node_info_and_port_info_fixtures_both_ways() {
        // NodeInfo of a one-port CA, vendor 00:02:c9, device 0x1017 (IBTA 14.2.5.3 offsets).
        let mut d = [0u8; SMP_DATA_LEN];
        d[..4].copy_from_slice(&[1, 1, 1, 1]);
        d[4..12].copy_from_slice(&0x1111_2222_3333_4444u64.to_be_bytes());
        d[12..20].copy_from_slice(&0x5555_6666_7777_8888u64.to_be_bytes());
        d[20..28].copy_from_slice(&0x9999_aaaa_bbbb_ccccu64.to_be_bytes());
        d[28..32].copy_from_slice(&[0x00, 0x80, 0x10, 0x17]);
        d[32..36].copy_from_slice(&[0, 0, 0, 3]);
        d[36..40].copy_from_slice(&[1, 0x00, 0x02, 0xc9]);
        let ni = NodeInfo::parse(&d);
        assert_eq!((ni.node_type, ni.num_ports, ni.partition_cap, ni.device_id), (1, 1, 128, 0x1017));
        assert_eq!((ni.node_guid, ni.port_guid, ni.revision), (0x5555_6666_7777_8888, 0x9999_aaaa_bbbb_cccc, 3));
        assert_eq!((ni.local_port_num, ni.vendor_id), (1, 0x0002c9));
        assert_eq!(ni.emit(), d);

        // PortInfo: LID 0x0005, SM LID 0x0001, 4x EDR, Active/LinkUp, LMC 0, MTU 4096, VL0-7 (ib_port_info).
        let mut p = [0u8; SMP_DATA_LEN];
        p[8..16].copy_from_slice(&0xfe80_0000_0000_0000u64.to_be_bytes());
        p[16..20].copy_from_slice(&[0x00, 0x05, 0x00, 0x01]);
        p[20..24].copy_from_slice(&0x0001_4028u32.to_be_bytes());
        p[28..44].copy_from_slice(&[1, 2, 2, 2, 0x14, 0x52, 0x03, 0x11, 0x55, 0x40, 0, 8, 8, 0x05, 0x1f, 0x41]);
        p[48..52].copy_from_slice(&[0, 7, 128, 0x92]);
        p[52] = 8;
        p[60..64].copy_from_slice(&[0x00, 0x20, 0x22, 0x02]);
        let pi = PortInfo::parse(&p);
        assert_eq!((pi.lid, pi.master_sm_lid, pi.capability_mask), (5, 1, 0x0001_4028));
        assert_eq!((pi.link_width_active, pi.link_speed_supported, pi.port_state), (2, 1, 4));
        assert_eq!((pi.port_phys_state, pi.link_down_default_state, pi.lmc), (5, 2, 3));
        assert_eq!((pi.neighbor_mtu, pi.master_sm_sl, pi.vl_cap, pi.mtu_cap), (5, 5, 4, 5));
        assert_eq!((pi.vl_stall_count, pi.hoq_life, pi.operational_vls, pi.enforcement), (0, 0x1f, 4, 1));
        assert_eq!((pi.q_key_violations, pi.guid_cap, pi.client_reregister, pi.subnet_timeout), (7, 128, true, 18));
        assert_eq!((pi.capability_mask2, pi.link_speed_ext_active, pi.link_speed_ext_enabled), (0x20, 2, 2));
        assert_eq!(pi.emit(), p);
    }

    fn ib(sm: bool) -> Harness {
        let mut h = Harness::new(SimConfig { port_type: PortType::Ib, subnet_manager: sm, ..SimConfig::default() });
        h.bring_up();
        h
    }

    /// MAD_IFC of `mad` on `port`: the command's status and syndrome, and the response MAD.
    fn mad_ifc_on(h: &mut Harness, port: u32, mad: &[u8; MAD_LEN]) -> (u8, u32, [u8; MAD_LEN]) {
        use ifc::mad_ifc_in as i;
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_MAD_IFC.into());
        // As mlx5_MAD_IFC sends its own queries: M_Key and B_Key ignored.
        inp.set(i::OP_MOD, 3);
        inp.set(i::PORT, port);
        inp[i::MAD.byte_off()..i::MAD.byte_off() + MAD_LEN].copy_from_slice(mad);
        let (s, y, out) = h.cmd(&inp, ifc::mad_ifc_out::SIZE_BYTES);
        let off = ifc::mad_ifc_out::RESPONSE_MAD_PACKET.byte_off();
        let mut rsp = [0u8; MAD_LEN];
        rsp.copy_from_slice(&out[off..off + MAD_LEN]);
        (s, y, rsp)
    }

    fn smp(class: u8, method: u8, attr_id: u16, attr_mod: u32, data: [u8; SMP_DATA_LEN]) -> Smp {
        let mut s = Smp::parse(&dr_get_node_info_bytes()).unwrap();
        s.mgmt_class = class;
        s.method = method;
        s.attr_id = attr_id;
        s.attr_mod = attr_mod;
        s.data = data;
        s
    }

    /// The response SMP of `req` through MAD_IFC on port 1 (the command itself must succeed).
    fn ask(h: &mut Harness, req: &Smp) -> Smp {
        let (s, y, rsp) = mad_ifc_on(h, 1, &req.emit());
        assert_eq!((s, y), (0, 0), "MAD_IFC failed");
        Smp::parse(&rsp).unwrap()
    }

    fn get(h: &mut Harness, attr_id: u16, attr_mod: u32) -> Smp {
        ask(h, &smp(CLASS_SUBN_LID_ROUTED, METHOD_GET, attr_id, attr_mod, [0; SMP_DATA_LEN]))
    }

    fn set(h: &mut Harness, attr_id: u16, attr_mod: u32, data: [u8; SMP_DATA_LEN]) -> Smp {
        ask(h, &smp(CLASS_SUBN_LID_ROUTED, METHOD_SET, attr_id, attr_mod, data))
    }

    #[test]
    fn get_node_info_node_description_and_guid_info_as_a_connectx5_answers() {
        let mut h = ib(false);
        let req = Smp::parse(&dr_get_node_info_bytes()).unwrap();
        let r = ask(&mut h, &req);
        // A directed-route response: GetResp, the direction bit, the transaction kept.
        assert_eq!((r.method, r.status, r.tid), (METHOD_GET_RESP, STATUS_DIRECTION, 0x1234_5678));
        let ni = NodeInfo::parse(&r.data);
        let guid = SimConfig::default().node_guid;
        assert_eq!((ni.node_type, ni.num_ports, ni.node_guid, ni.port_guid), (1, 1, guid, guid));
        assert_eq!((ni.device_id, ni.vendor_id, ni.partition_cap, ni.local_port_num), (0x1017, 0x0002c9, 128, 1));

        let r = get(&mut h, ATTR_NODE_DESC, 0);
        assert_eq!(r.status, 0);
        assert_eq!(&r.data[..NODE_DESC.len()], NODE_DESC);
        assert!(r.data[NODE_DESC.len()..].iter().all(|&b| b == 0));

        let r = get(&mut h, ATTR_GUID_INFO, 0);
        assert_eq!(r.status, 0);
        assert_eq!(r.data[..8], guid.to_be_bytes());
        assert!(r.data[8..].iter().all(|&b| b == 0));
        // 128 GUIDs: blocks 0-15; block 16 does not exist.
        assert_eq!(get(&mut h, ATTR_GUID_INFO, 15).status, 0);
        assert_eq!(get(&mut h, ATTR_GUID_INFO, 16).status, MadStatus::InvalidField as u16);
    }

    /// QUERY_HCA_VPORT_CONTEXT's (port state, LID, SM LID) and QUERY_VPORT_STATE's state.
    fn vport(h: &mut Harness) -> (u32, u32, u32, u32) {
        use ifc::hca_vport_context as v;
        let (s, _, out) = h.simple(
            consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT,
            0,
            ifc::query_hca_vport_context_in::SIZE_BYTES,
            ifc::query_hca_vport_context_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        let b = ifc::query_hca_vport_context_out::HCA_VPORT_CONTEXT;
        assert_eq!(rd(&out, v::HAS_SMI.at(b)), 1);
        let (s, _, st) = h.simple(
            consts::MLX5_CMD_OP_QUERY_VPORT_STATE,
            consts::MLX5_VPORT_STATE_OP_MOD_VNIC_VPORT,
            ifc::query_vport_state_in::SIZE_BYTES,
            ifc::query_vport_state_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        let vs = rd(&st, ifc::query_vport_state_out::STATE);
        (rd(&out, v::PORT_STATE.at(b)), rd(&out, v::LID.at(b)), rd(&out, v::SM_LID.at(b)), vs)
    }

    fn port_changes(h: &Harness, eqn: u8) -> Vec<u8> {
        h.dev
            .events()
            .iter()
            .filter_map(|e| match *e {
                SimEvent::Eqe { eqn: n, event_type, sub_type }
                    if n == eqn && event_type == consts::MLX5_EVENT_TYPE_PORT_CHANGE =>
                {
                    Some(sub_type)
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_subnet_manager_assigns_the_lid_and_moves_the_port_init_armed_active() {
        let mut h = ib(true);
        let uar = h.alloc_uar();
        let (s, eqn, _eq) = h.create_eq(uar, 4, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
        assert_eq!(s, 0);
        let (down, up) = (consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_DOWN, consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_UP);
        // No SM yet: Init, no LID, the vport down.
        assert_eq!(vport(&mut h), (consts::IB_PORT_INIT, 0, 0, down));
        let mut pi = PortInfo::parse(&get(&mut h, ATTR_PORT_INFO, 0).data);
        assert_eq!((pi.port_state, pi.port_phys_state, pi.lid), (2, 5, 0));
        assert_eq!((pi.vl_cap, pi.mtu_cap, pi.link_width_active, pi.link_speed_ext_active), (4, 5, 2, 2));
        assert_eq!((pi.vl_arb_high_cap, pi.vl_arb_low_cap, pi.guid_cap), (8, 8, 128));
        // opensm's first Set: LID, SM LID and the rest, state unchanged (0).
        pi.lid = 0x0007;
        pi.master_sm_lid = 0x0001;
        pi.port_state = 0;
        pi.operational_vls = 4;
        // opensm's Set names port 1 with bit 31 (it handles extended link speeds); found under UML, refused before.
        let r = set(&mut h, ATTR_PORT_INFO, 0x8000_0001, pi.emit());
        assert_eq!(r.status, 0);
        let now = PortInfo::parse(&r.data);
        assert_eq!((now.lid, now.master_sm_lid, now.port_state, now.operational_vls), (7, 1, 2, 4));
        assert_eq!(vport(&mut h), (consts::IB_PORT_INIT, 7, 1, down));
        // Active straight from Init is refused, and nothing changes.
        pi.port_state = 4;
        assert_eq!(set(&mut h, ATTR_PORT_INFO, 1, pi.emit()).status, MadStatus::InvalidField as u16);
        assert_eq!(vport(&mut h).0, consts::IB_PORT_INIT);
        pi.port_state = 3;
        assert_eq!(PortInfo::parse(&set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).data).port_state, 3);
        assert_eq!(vport(&mut h), (consts::IB_PORT_ARMED, 7, 1, down));
        pi.port_state = 4;
        assert_eq!(PortInfo::parse(&set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).data).port_state, 4);
        assert_eq!(vport(&mut h), (consts::IB_PORT_ACTIVE, 7, 1, up));
        // mlx5_ib hears of the LID and of the port going active.
        let want = [consts::MLX5_PORT_CHANGE_SUBTYPE_LID, consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE];
        assert_eq!(port_changes(&h, eqn), want);
        // Active again is no change and no event; Down retrains the link back to Init.
        assert_eq!(set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).status, 0);
        assert_eq!(port_changes(&h, eqn).len(), 2);
        pi.port_state = 1;
        assert_eq!(PortInfo::parse(&set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).data).port_state, 2);
        assert_eq!(port_changes(&h, eqn).last(), Some(&consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN));
    }

    #[test]
    fn an_invalid_port_info_set_gets_status_0x1c_and_changes_nothing() {
        let mut h = ib(true);
        let before = get(&mut h, ATTR_PORT_INFO, 0).data;
        let base = PortInfo::parse(&before);
        type Spoil = fn(&mut PortInfo);
        let bad: [(&str, Spoil); 7] = [
            ("multicast LID", |p| p.lid = 0xc000),
            ("permissive LID", |p| p.lid = 0xffff),
            ("multicast SM LID", |p| p.master_sm_lid = 0xc001),
            ("state Init", |p| p.port_state = 2),
            ("state 6", |p| p.port_state = 6),
            ("NeighborMTU above MTUCap", |p| p.neighbor_mtu = 6),
            ("OperationalVLs above VLCap", |p| p.operational_vls = 5),
        ];
        for (what, f) in bad {
            let mut p = base;
            p.lid = 9;
            f(&mut p);
            let r = set(&mut h, ATTR_PORT_INFO, 0, p.emit());
            assert_eq!(r.status, MadStatus::InvalidField as u16, "{what}");
            assert_eq!(get(&mut h, ATTR_PORT_INFO, 0).data, before, "{what} changed the port");
        }
        // PortInfo of port 2 (a one-port CA), or with a reserved modifier bit.
        assert_eq!(get(&mut h, ATTR_PORT_INFO, 2).status, MadStatus::InvalidField as u16);
        assert_eq!(get(&mut h, ATTR_PORT_INFO, 0x100).status, MadStatus::InvalidField as u16);
    }

    #[test]
    fn pkey_sl2vl_and_vlarb_tables_get_and_set() {
        let mut h = ib(false);
        let r = get(&mut h, ATTR_PKEY_TABLE, 0);
        assert_eq!((r.status, &r.data[..4]), (0, &[0xff, 0xff, 0, 0][..]));
        // opensm writes the default partition and one more into block 0.
        let mut d = [0u8; SMP_DATA_LEN];
        d[..4].copy_from_slice(&[0xff, 0xff, 0x80, 0x02]);
        assert_eq!(set(&mut h, ATTR_PKEY_TABLE, 0, d).data, d);
        // QUERY_HCA_VPORT_PKEY (how mlx5_ib reads P_Keys with ib_virt) sees the SM's table.
        {
            use ifc::query_hca_vport_pkey_in as i;
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_VPORT_PKEY.into());
            inp.set(i::PKEY_INDEX, 1);
            let (s, _, out) = h.cmd(&inp, ifc::query_hca_vport_pkey_out::SIZE_BYTES + 4);
            assert_eq!(s, 0);
            let e = mlx5_core::prm::Sub::new(ifc::query_hca_vport_pkey_out::PKEY.byte_off(), ifc::pkey::SIZE_BYTES);
            assert_eq!(rd(&out, ifc::pkey::PKEY.at(e)), 0x8002);
        }
        assert_eq!(get(&mut h, ATTR_PKEY_TABLE, 3).status, 0);
        assert_eq!(get(&mut h, ATTR_PKEY_TABLE, 4).status, MadStatus::InvalidField as u16);

        // SLtoVL: SL n to VL n % 8, then a VL beyond VL7 (not 15) refused.
        let mut m = [0u8; SMP_DATA_LEN];
        m[..8].copy_from_slice(&[0x01, 0x23, 0x45, 0x67, 0x01, 0x23, 0x45, 0x6f]);
        assert_eq!(set(&mut h, ATTR_SL_TO_VL_TABLE, 0, m).data, m);
        let mut bad = m;
        bad[0] = 0x81;
        assert_eq!(set(&mut h, ATTR_SL_TO_VL_TABLE, 0, bad).status, MadStatus::InvalidField as u16);
        assert_eq!(get(&mut h, ATTR_SL_TO_VL_TABLE, 0).data, m);

        // VLArb: blocks 1 (low 0-31) and 3 (high 0-31) exist at capacities 8/8.
        let mut a = [0u8; SMP_DATA_LEN];
        a[..4].copy_from_slice(&[0x00, 0x40, 0x01, 0x40]);
        assert_eq!(set(&mut h, ATTR_VL_ARB_TABLE, 1 << 16, a).data, a);
        assert_eq!(get(&mut h, ATTR_VL_ARB_TABLE, 3 << 16).data, [0; SMP_DATA_LEN]);
        assert_eq!(get(&mut h, ATTR_VL_ARB_TABLE, 1 << 16).data, a);
        for block in [0, 2, 4, 5] {
            assert_eq!(get(&mut h, ATTR_VL_ARB_TABLE, block << 16).status, MadStatus::InvalidField as u16);
        }
    }

    #[test]
    fn what_the_sma_does_not_serve_gets_the_status_a_real_sma_gives() {
        let mut h = ib(false);
        let unsup = MadStatus::UnsupportedMethodAttr as u16;
        // SMInfo (the SM's, not the SMA's), SwitchInfo and LinearForwardingTable (a switch's), a vendor attribute.
        for attr in [0x0020, 0x0012, 0x0019, 0xff00] {
            assert_eq!(get(&mut h, attr, 0).status, unsup, "attribute {attr:#x}");
        }
        // Each refusal is recorded for the harness (the UML bridge reports them).
        let refused = SimEvent::SmpStatus { attr_id: 0x0012, method: METHOD_GET, status: unsup };
        assert!(h.dev.events().contains(&refused));
        // Read-only attributes.
        for attr in [ATTR_NODE_INFO, ATTR_NODE_DESC, ATTR_GUID_INFO] {
            assert_eq!(set(&mut h, attr, 0, [0; SMP_DATA_LEN]).status, unsup, "Set of {attr:#x}");
        }
        // Send (0x03) and a response method are not SMA methods.
        for method in [0x03, METHOD_GET_RESP] {
            let r = ask(&mut h, &smp(CLASS_SUBN_LID_ROUTED, method, ATTR_NODE_INFO, 0, [0; SMP_DATA_LEN]));
            assert_eq!((r.method, r.status), (METHOD_GET_RESP, MadStatus::UnsupportedMethod as u16));
        }
        let mut v = smp(CLASS_SUBN_DIRECTED_ROUTE, METHOD_GET, ATTR_NODE_INFO, 0, [0; SMP_DATA_LEN]);
        v.base_version = 2;
        assert_eq!(ask(&mut h, &v).status, STATUS_DIRECTION | MadStatus::BadVersion as u16);
        v.base_version = 1;
        v.class_version = 2;
        assert_eq!(ask(&mut h, &v).status, STATUS_DIRECTION | MadStatus::BadVersion as u16);
        // A performance-management MAD is no SMP: class not supported.
        let mut perf = dr_get_node_info_bytes();
        perf[1] = 0x04;
        let (s, _, rsp) = mad_ifc_on(&mut h, 1, &perf);
        assert_eq!((s, rsp[3], &rsp[4..6]), (0, METHOD_GET_RESP, &[0x00, 0x04][..]));
        // A TrapRepress gets no response: the output MAD stays zero.
        let tr = smp(CLASS_SUBN_LID_ROUTED, METHOD_TRAP_REPRESS, 0x0002, 0, [0; SMP_DATA_LEN]);
        let (s, _, rsp) = mad_ifc_on(&mut h, 1, &tr.emit());
        assert_eq!((s, rsp), (0, [0; MAD_LEN]));
    }

    #[test]
    fn mad_ifc_refuses_another_port_and_an_ethernet_function() {
        let mut h = ib(false);
        let b = dr_get_node_info_bytes();
        assert_eq!(mad_ifc_on(&mut h, 2, &b).1, syndrome::BAD_PORT);
        assert_eq!(mad_ifc_on(&mut h, 0, &b).0, 0);
        let mut e = Harness::new(SimConfig { port_type: PortType::Eth, ..SimConfig::default() });
        e.bring_up();
        assert_eq!(mad_ifc_on(&mut e, 1, &b).1, syndrome::BAD_PORT);
    }

    #[test]
    fn arbitrary_smps_get_an_answer_never_a_panic() {
        // Every byte of the header and data varied (a fixed generator, so a failure repeats); the command always
        // completes and every answer is a GetResp of the same transaction.
        let mut h = ib(true);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in 0..3000 {
            let mut b = [0u8; MAD_LEN];
            for c in b.chunks_mut(8) {
                c.copy_from_slice(&next().to_be_bytes()[..c.len()]);
            }
            b[0] = if n % 7 == 0 { b[0] } else { 1 };
            b[1] = if n % 2 == 0 { CLASS_SUBN_LID_ROUTED } else { CLASS_SUBN_DIRECTED_ROUTE };
            b[2] = if n % 5 == 0 { b[2] } else { 1 };
            b[3] = [METHOD_GET, METHOD_SET, b[3]][n % 3];
            b[17] = [0x10, 0x11, 0x14, 0x15, 0x16, 0x17, 0x18, b[17]][n % 8];
            b[16] = if n % 8 == 7 { b[16] } else { 0 };
            let (s, _, rsp) = mad_ifc_on(&mut h, 1, &b);
            assert_eq!(s, 0);
            if b[3] != METHOD_TRAP_REPRESS {
                assert_eq!((rsp[3], &rsp[8..16]), (METHOD_GET_RESP, &b[8..16]));
            }
        }
        // The port still answers.
        assert_eq!(get(&mut h, ATTR_NODE_INFO, 0).status, 0);
    }

    /// One IB device of a two-port cable for the QP0 tests: waiting for an SM, no LID.
    fn sm_port(guid: u64) -> crate::testkit::submit::Rdma {
        let cfg = SimConfig {
            port_type: PortType::Ib,
            subnet_manager: true,
            node_guid: guid,
            mode: crate::config::Mode::Inline,
            ..SimConfig::default()
        };
        crate::testkit::submit::Rdma::new(cfg)
    }

    #[test]
    fn qp0_carries_smps_over_the_cable_to_the_partners_sma_and_back() {
        use crate::testkit::submit::{Bell, QpSpec, TAv, Wqe};
        const SEND: u8 = consts::MLX5_OPCODE_SEND;
        const GRH: usize = 40;
        let (mut a, mut b) = (sm_port(0x2001), sm_port(0x2002));
        let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
        // The SMI QPs, as mlx5_ib creates them (st QP0) and ib_mad brings them to RTS.
        let qp0 = QpSpec { st: consts::MLX5_QP_ST_QP0, ..QpSpec::ud() };
        let mut a0 = a.qp(qp0, a_cq.cqn, a_cq.cqn);
        let mut b0 = b.qp(qp0, b_cq.cqn, b_cq.cqn);
        a.ready_ud(&a0, 0);
        b.ready_ud(&b0, 0);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        a.h.dev.connect(&b.h.dev);
        // Each side receives into offset 1024 (GRH room first); sends from offset 0.
        let recv = |r: &crate::testkit::submit::Rdma, q: &mut _, m: &crate::testkit::submit::Mr| {
            r.post_recv(q, &[(m.addr() + 1024, (GRH + MAD_LEN) as u32, m.key)]);
        };
        // A directed-route SMP leaves with the permissive DLID (hop count 1: one hop, to the cable's other end).
        let to_partner = TAv { dqpn: 0, qkey: 0, rlid: crate::wire::PERMISSIVE_LID, ..TAv::default() };
        let send = |r: &crate::testkit::submit::Rdma, q: &mut _, m: &crate::testkit::submit::Mr, s: &Smp| {
            m.write(0, &s.emit());
            r.post_send(q, &Wqe::new(SEND).av(&to_partner).data(MAD_LEN as u32, m.key, m.addr()), Bell::Db);
        };
        let mut req = Smp::parse(&dr_get_node_info_bytes()).unwrap();
        req.hop_cnt = 1;
        req.hop_ptr = 1;
        req.initial_path[1] = 1;
        recv(&b, &mut b0, &mb);
        send(&a, &mut a0, &ma, &req);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        // B's QP0 has it, from QP0, and B's driver hands it to MAD_IFC as mlx5_ib's process_mad does.
        let e = b.poll(&mut b_cq).expect("the SMP crossed the cable");
        assert_eq!((e.qpn(), e.flags_rqpn() & 0xff_ffff, e.byte_cnt()), (b0.qpn, 0, (GRH + MAD_LEN) as u32));
        // Sent to the permissive LID, from it (A has no LID yet): ib_mad answers to that SLID.
        assert_eq!(e.slid(), crate::wire::PERMISSIVE_LID);
        let got: [u8; MAD_LEN] = mb.read(1024 + GRH, MAD_LEN).try_into().unwrap();
        assert_eq!(got, req.emit());
        let (s, _, rsp) = mad_ifc_on(&mut b.h, 1, &got);
        assert_eq!(s, 0);
        // The reply goes back the same way, to A's QP0.
        recv(&a, &mut a0, &ma);
        send(&b, &mut b0, &mb, &Smp::parse(&rsp).unwrap());
        assert_eq!(b.poll(&mut b_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let e = a.poll(&mut a_cq).expect("the reply crossed back");
        assert_eq!(e.flags_rqpn() & 0xff_ffff, 0);
        let back = Smp::parse(&ma.read(1024 + GRH, MAD_LEN)).unwrap();
        assert_eq!((back.method, back.status, back.tid), (METHOD_GET_RESP, STATUS_DIRECTION, req.tid));
        assert_eq!(NodeInfo::parse(&back.data).node_guid, 0x2002);

        // The SM (on A) gives B LID 0x12 over the cable; B's SMA takes it and the wire routes to it.
        let mut pi = PortInfo::parse(&get(&mut b.h, ATTR_PORT_INFO, 0).data);
        pi.lid = 0x12;
        pi.master_sm_lid = 0x11;
        pi.port_state = 0;
        let give_lid = Smp { method: METHOD_SET, attr_id: ATTR_PORT_INFO, data: pi.emit(), ..req.clone() };
        recv(&b, &mut b0, &mb);
        send(&a, &mut a0, &ma, &give_lid);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert!(b.poll(&mut b_cq).is_some());
        let (s, _, rsp) = mad_ifc_on(&mut b.h, 1, &mb.read(1024 + GRH, MAD_LEN).try_into().unwrap());
        assert_eq!((s, PortInfo::parse(&Smp::parse(&rsp).unwrap().data).lid), (0, 0x12));
        // The SM's own port takes LID 0x11 through its local SMA.
        let mut own = PortInfo::parse(&get(&mut a.h, ATTR_PORT_INFO, 0).data);
        own.lid = 0x11;
        own.port_state = 0;
        assert_eq!(set(&mut a.h, ATTR_PORT_INFO, 0, own.emit()).status, 0);
        // A LID-routed Get(NodeInfo) to 0x12 now reaches B, from A's LID; B answers to that SLID, from its own.
        let lr = Smp { mgmt_class: CLASS_SUBN_LID_ROUTED, hop_cnt: 0, hop_ptr: 0, ..req.clone() };
        recv(&b, &mut b0, &mb);
        ma.write(0, &lr.emit());
        let lid_routed = |rlid| Wqe::new(SEND).av(&TAv { rlid, ..to_partner });
        a.post_send(&mut a0, &lid_routed(0x12).data(MAD_LEN as u32, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.poll(&mut b_cq).expect("the LID-routed SMP reached B at its new LID");
        assert_eq!(e.slid(), 0x11);
        recv(&a, &mut a0, &ma);
        mb.write(0, &lr.emit());
        b.post_send(&mut b0, &lid_routed(e.slid()).data(MAD_LEN as u32, mb.key, mb.addr()), Bell::Db);
        assert_eq!(b.poll(&mut b_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(a.poll(&mut a_cq).expect("B answers").slid(), 0x12);
        // A LID nobody holds goes nowhere.
        let nobody = TAv { rlid: 0x13, ..to_partner };
        a.post_send(&mut a0, &Wqe::new(SEND).av(&nobody).data(MAD_LEN as u32, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert!(a.h.dev.events().iter().any(|e| matches!(e, SimEvent::UdDropped { dqpn: 0, .. })));
    }

    #[test]
    fn a_lid_the_sma_assigns_reaches_the_device_of_another_process_over_the_link() {
        use crate::testkit::submit::{Bell, QpSpec, Rdma, TAv, Wqe};
        use std::time::{Duration, Instant};
        const WAIT: Duration = Duration::from_secs(5);
        let cfg = |guid| SimConfig {
            port_type: PortType::Ib,
            subnet_manager: true,
            node_guid: guid,
            mode: crate::config::Mode::Threaded,
            ..SimConfig::default()
        };
        let (mut a, mut b) = (Rdma::new(cfg(0x4001)), Rdma::new(cfg(0x4002)));
        let at = a.h.dev.wire_listen("127.0.0.1:0").expect("listen");
        b.h.dev.wire_connect(&at.to_string(), WAIT).expect("connect");
        assert!(a.h.dev.wire_wait_peer(WAIT));
        let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
        let qp0 = QpSpec { st: consts::MLX5_QP_ST_QP0, ..QpSpec::ud() };
        let mut a0 = a.qp(qp0, a_cq.cqn, a_cq.cqn);
        let mut b0 = b.qp(qp0, b_cq.cqn, b_cq.cqn);
        a.ready_ud(&a0, 0);
        b.ready_ud(&b0, 0);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        let mut pi = PortInfo::parse(&get(&mut b.h, ATTR_PORT_INFO, 0).data);
        pi.lid = 0x22;
        pi.port_state = 0;
        assert_eq!(set(&mut b.h, ATTR_PORT_INFO, 0, pi.emit()).status, 0);
        // The update crosses the link on its own; a LID-routed SMP to 0x22 then finds B.
        let lr = Smp { mgmt_class: CLASS_SUBN_LID_ROUTED, ..Smp::parse(&dr_get_node_info_bytes()).unwrap() };
        ma.write(0, &lr.emit());
        let to_b = TAv { dqpn: 0, qkey: 0, rlid: 0x22, ..TAv::default() };
        let end = Instant::now() + WAIT;
        let got = loop {
            b.post_recv(&mut b0, &[(mb.addr() + 1024, 40 + MAD_LEN as u32, mb.key)]);
            a.post_send(&mut a0, &Wqe::new(consts::MLX5_OPCODE_SEND).av(&to_b).data(256, ma.key, ma.addr()), Bell::Db);
            assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
            std::thread::sleep(Duration::from_millis(20));
            if let Some(e) = b.poll(&mut b_cq) {
                break Some(e);
            }
            if Instant::now() > end {
                break None;
            }
        };
        let e = got.expect("the LID-routed SMP reached B's new LID across the link");
        assert_eq!(e.flags_rqpn() & 0xff_ffff, 0);
        assert_eq!(&mb.read(1024 + 40, MAD_LEN)[..], &lr.emit()[..]);
    }
}

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

use super::ib_vport::{self, GID_ENTRIES, NODE_DESC, PKEY_ENTRIES};
use super::port::PortModel;
use super::reply::{bad_param, rd, CmdErr};
use super::syndrome;
use crate::config::PortType;

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
/// Blocks of the VLArbitrationTable (attribute modifier 1-4: low 0-31, low 32-63, high 0-31, high 32-63).
pub(crate) const VL_ARB_BLOCKS: usize = 4;
/// PortInfo:VLCap 4: VL0-VL7, what PVLC's `vl_hw_cap` 8 says.
const VL_CAP: u8 = 4;
/// The largest unicast LID (IBTA 4.1.3: 0xc000-0xfffe multicast, 0xffff permissive).
const MAX_UNICAST_LID: u16 = 0xbfff;
/// P_Keys per PKeyTable block and GUIDs per GUIDInfo block.
const PKEYS_PER_BLOCK: usize = 32;
const GUIDS_PER_BLOCK: usize = 8;

/// The SMA's part of the port: what subnet management sets that no PRM command reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SmaState {
    pub(crate) m_key: u64,
    pub(crate) m_key_lease_period: u16,
    pub(crate) m_key_protect_bits: u8,
    pub(crate) gid_prefix: u64,
    pub(crate) neighbor_mtu: u8,
    pub(crate) operational_vls: u8,
    pub(crate) vl_high_limit: u8,
    pub(crate) hoq_life: u8,
    pub(crate) enforcement: u8,
    /// SLtoVLMappingTable: 16 SLs, a nibble each.
    pub(crate) sl_to_vl: [u8; 8],
    /// VLArbitrationTable blocks 1-4 (only 1 and 3 within the capacities above).
    pub(crate) vl_arb: [[u8; SMP_DATA_LEN]; VL_ARB_BLOCKS],
}

impl Default for SmaState {
    fn default() -> Self {
        Self {
            m_key: 0,
            m_key_lease_period: 0,
            m_key_protect_bits: 0,
            gid_prefix: ib_vport::LINK_LOCAL_PREFIX,
            neighbor_mtu: 5,
            // Until a subnet manager says otherwise, VL0 only (IBTA 14.2.5.6: OperationalVLs 1).
            operational_vls: 1,
            vl_high_limit: 0,
            hoq_life: 0,
            enforcement: 0,
            sl_to_vl: [0; 8],
            vl_arb: [[0; SMP_DATA_LEN]; VL_ARB_BLOCKS],
        }
    }
}

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
            // A channel adapter's PortInfo: modifier 0 (the port the SMP came in on) or its port number.
            if m > 1 {
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
pub(super) fn mad_ifc(port: &mut PortModel, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
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
mod tests;

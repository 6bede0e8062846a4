//! Vport queries (PRM "Vport Commands"; Linux `vport.c`): QUERY_VPORT_STATE, QUERY_NIC_VPORT_CONTEXT (Ethernet),
//! QUERY_HCA_VPORT_CONTEXT (InfiniBand), and the port attributes verbs users see (`ibv_query_port`).

use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, MsgBuf, Opcode};

/// Operational and administrative state of this function's vNIC vport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VportState {
    /// `MLX5_QUERY_VPORT_STATE_OUT_STATE_UP` (1) or `_DOWN` (0).
    pub state: u8,
    /// Administrative state.
    pub admin_state: u8,
}

impl VportState {
    /// Whether the operational state is up.
    pub fn is_up(&self) -> bool {
        u32::from(self.state) == consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_UP
    }
}

/// `QUERY_VPORT_STATE` for the own vNIC vport (`mlx5_query_vport_state` with `MLX5_VPORT_STATE_OP_MOD_VNIC_VPORT`).
#[derive(Debug, Clone, Copy, Default)]
pub struct QueryVportState;

impl Command for QueryVportState {
    type In = ifc::query_vport_state_in::Bits;
    type Out = ifc::query_vport_state_out::Bits;
    type Output = VportState;
    fn opcode(&self) -> Opcode {
        Opcode::QueryVportState
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryVportState, consts::MLX5_VPORT_STATE_OP_MOD_VNIC_VPORT);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<VportState, CmdError> {
        Ok(VportState {
            state: out.get(ifc::query_vport_state_out::STATE) as u8,
            admin_state: out.get(ifc::query_vport_state_out::ADMIN_STATE) as u8,
        })
    }
}

/// The parts of `nic_vport_context` the driver reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NicVportContext {
    /// RoCE is enabled on the port.
    pub roce_en: bool,
    /// Port MTU in bytes (the Ethernet MTU the vport was configured with).
    pub mtu: u16,
    /// System image GUID.
    pub system_image_guid: u64,
    /// Port GUID.
    pub port_guid: u64,
    /// Node GUID.
    pub node_guid: u64,
    /// The port's MAC address.
    pub permanent_address: [u8; 6],
    /// Q_Key violations counted on the vport (`mlx5_query_nic_vport_qkey_viol_cntr`).
    pub qkey_violation_counter: u16,
}

/// `QUERY_NIC_VPORT_CONTEXT` for the own vport (`mlx5_query_nic_vport_context`).
#[derive(Debug, Clone, Copy, Default)]
pub struct QueryNicVportContext;

impl Command for QueryNicVportContext {
    type In = ifc::query_nic_vport_context_in::Bits;
    type Out = ifc::query_nic_vport_context_out::Bits;
    type Output = NicVportContext;
    fn opcode(&self) -> Opcode {
        Opcode::QueryNicVportContext
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryNicVportContext, 0);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<NicVportContext, CmdError> {
        use ifc::nic_vport_context as n;
        let base = ifc::query_nic_vport_context_out::NIC_VPORT_CONTEXT;
        let mac_sub = n::PERMANENT_ADDRESS.at(base);
        let hi = out.get(ifc::mac_address_layout::MAC_ADDR_47_32.at(mac_sub));
        let lo = out.get(ifc::mac_address_layout::MAC_ADDR_31_0.at(mac_sub));
        let mut mac = [0u8; 6];
        mac[..2].copy_from_slice(&(hi as u16).to_be_bytes());
        mac[2..].copy_from_slice(&lo.to_be_bytes());
        Ok(NicVportContext {
            roce_en: out.get(n::ROCE_EN.at(base)) != 0,
            mtu: out.get(n::MTU.at(base)) as u16,
            system_image_guid: out.get64(n::SYSTEM_IMAGE_GUID.at(base)),
            port_guid: out.get64(n::PORT_GUID.at(base)),
            node_guid: out.get64(n::NODE_GUID.at(base)),
            permanent_address: mac,
            qkey_violation_counter: out.get(n::QKEY_VIOLATION_COUNTER.at(base)) as u16,
        })
    }
}

/// The parts of `hca_vport_context` the driver reads (InfiniBand ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HcaVportContext {
    /// Physical port state.
    pub port_physical_state: u8,
    /// `IB_PORT_*` (4 = active).
    pub port_state: u8,
    /// Virtual port state.
    pub vport_state: u8,
    /// System image GUID.
    pub system_image_guid: u64,
    /// Port GUID.
    pub port_guid: u64,
    /// Node GUID.
    pub node_guid: u64,
    /// `cap_mask1`: the port capability mask.
    pub cap_mask1: u32,
    /// LID.
    pub lid: u16,
    /// LID mask count.
    pub lmc: u8,
    /// The subnet manager's LID.
    pub sm_lid: u16,
    /// The subnet manager's SL.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// `cap_mask2`: the second capability mask (valid when `cap_mask1` has `IsCapabilityMask2Supported`).
    pub cap_mask2: u32,
    /// `init_type_reply` (PortInfo:InitTypeReply).
    pub init_type_reply: u8,
    /// Q_Key violations counted on the port.
    pub qkey_violation_counter: u16,
    /// P_Key violations counted on the port.
    pub pkey_violation_counter: u16,
    /// The subnet requires a GRH on every packet (`grh_required`).
    pub grh_required: bool,
}

/// `QUERY_HCA_VPORT_CONTEXT` for `port_num` of the own vport (`mlx5_query_hca_vport_context`).
#[derive(Debug, Clone, Copy)]
pub struct QueryHcaVportContext {
    /// The port (1).
    pub port_num: u8,
}

impl Command for QueryHcaVportContext {
    type In = ifc::query_hca_vport_context_in::Bits;
    type Out = ifc::query_hca_vport_context_out::Bits;
    type Output = HcaVportContext;
    fn opcode(&self) -> Opcode {
        Opcode::QueryHcaVportContext
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryHcaVportContext, 0);
        msg.set(ifc::query_hca_vport_context_in::PORT_NUM, self.port_num.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<HcaVportContext, CmdError> {
        use ifc::hca_vport_context as h;
        let base = ifc::query_hca_vport_context_out::HCA_VPORT_CONTEXT;
        let g = |f: crate::prm::Field| out.get(f.at(base));
        Ok(HcaVportContext {
            port_physical_state: g(h::PORT_PHYSICAL_STATE) as u8,
            port_state: g(h::PORT_STATE) as u8,
            vport_state: g(h::VPORT_STATE) as u8,
            system_image_guid: out.get64(h::SYSTEM_IMAGE_GUID.at(base)),
            port_guid: out.get64(h::PORT_GUID.at(base)),
            node_guid: out.get64(h::NODE_GUID.at(base)),
            cap_mask1: g(h::CAP_MASK1),
            lid: g(h::LID) as u16,
            lmc: g(h::LMC) as u8,
            sm_lid: g(h::SM_LID) as u16,
            sm_sl: g(h::SM_SL) as u8,
            subnet_timeout: g(h::SUBNET_TIMEOUT) as u8,
            cap_mask2: g(h::CAP_MASK2),
            init_type_reply: g(h::INIT_TYPE_REPLY) as u8,
            qkey_violation_counter: g(h::QKEY_VIOLATION_COUNTER) as u16,
            pkey_violation_counter: g(h::PKEY_VIOLATION_COUNTER) as u16,
            grh_required: g(h::GRH_REQUIRED) != 0,
        })
    }
}

/// Bytes RoCE headers take out of an Ethernet MTU (`iboe_get_mtu`, ib_verbs.h): GRH 40, UDP 8, BTH 12, XRC
/// extension 4, AtomicETH 28, ICRC 4. Protocol header sizes, not device layouts.
pub const ROCE_HEADER_BYTES: u32 = 40 + 8 + 12 + 4 + 28 + 4;

/// IB MTU enum values and their sizes in bytes (`enum ib_mtu`).
const IB_MTUS: [(u8, u32); 5] = [
    (consts::IB_MTU_256, 256),
    (consts::IB_MTU_512, 512),
    (consts::IB_MTU_1024, 1024),
    (consts::IB_MTU_2048, 2048),
    (consts::IB_MTU_4096, 4096),
];

/// The IB MTU enum (`IB_MTU_256` .. `IB_MTU_4096`) for a payload of `bytes`, rounding down; 0 if below 256.
pub fn ib_mtu_enum(bytes: u32) -> u8 {
    IB_MTUS.iter().rev().find(|&&(_, b)| bytes >= b).map_or(0, |&(e, _)| e)
}

/// Bytes of an IB MTU enum value (0 when not a valid value).
pub fn ib_mtu_bytes(e: u8) -> u32 {
    IB_MTUS.iter().find(|&&(v, _)| v == e).map_or(0, |&(_, b)| b)
}

/// The RoCE path MTU an Ethernet MTU allows (`iboe_get_mtu`).
pub fn iboe_mtu(eth_mtu: u32) -> u8 {
    ib_mtu_enum(eth_mtu.saturating_sub(ROCE_HEADER_BYTES))
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn ib_mtu_enum_rounds_down_to_a_supported_size() {
        assert_eq!(ib_mtu_enum(4096), consts::IB_MTU_4096);
        assert_eq!(ib_mtu_enum(4095), consts::IB_MTU_2048);
        assert_eq!(ib_mtu_enum(256), consts::IB_MTU_256);
        assert_eq!(ib_mtu_enum(255), 0);
        assert_eq!(ib_mtu_enum(u32::MAX), consts::IB_MTU_4096);
    }

    #[test]
    fn ib_mtu_bytes_inverts_the_enum() {
        for bytes in [256, 512, 1024, 2048, 4096] {
            assert_eq!(ib_mtu_bytes(ib_mtu_enum(bytes)), bytes);
        }
        assert_eq!(ib_mtu_bytes(0), 0);
        assert_eq!(ib_mtu_bytes(6), 0);
    }

    #[test]
    fn iboe_mtu_takes_the_roce_headers_out_of_the_ethernet_mtu() {
        // 1500-byte Ethernet leaves room for a 1024-byte RoCE path MTU; 9000 for 4096.
        assert_eq!(iboe_mtu(1500), consts::IB_MTU_1024);
        assert_eq!(iboe_mtu(9000), consts::IB_MTU_4096);
        assert_eq!(iboe_mtu(2048 + ROCE_HEADER_BYTES), consts::IB_MTU_2048);
        assert_eq!(iboe_mtu(2048 + ROCE_HEADER_BYTES - 1), consts::IB_MTU_1024);
        assert_eq!(iboe_mtu(0), 0);
    }
}

/// The RoCE version of a GID table entry (`roce_version` of `roce_addr_layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoceVersion {
    /// RoCE v1 (`MLX5_ROCE_VERSION_1`): the GRH rides directly on Ethernet.
    V1,
    /// RoCE v2 (`MLX5_ROCE_VERSION_2`): UDP/IP encapsulation.
    V2,
}

/// One RoCE GID table entry (`roce_addr_layout`), as `mlx5_core_roce_gid_set` programs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoceGid {
    /// The GID: an IPv6 address, or an IPv4 address mapped as `::ffff:a.b.c.d`.
    pub gid: [u8; 16],
    /// RoCE v1 or v2.
    pub version: RoceVersion,
    /// The VLAN the entry belongs to, if any.
    pub vlan: Option<u16>,
    /// The source MAC of the entry's netdev.
    pub mac: [u8; 6],
}

impl RoceGid {
    /// Whether the GID is an IPv4-mapped address (`::ffff:a.b.c.d`).
    pub fn is_ipv4(&self) -> bool {
        self.gid[..10] == [0; 10] && self.gid[10..12] == [0xff, 0xff]
    }

    /// `roce_l3_type`: Linux sets it for v2 entries only (IPv4 for a mapped address, IPv6 otherwise); v1 keeps 0.
    pub fn l3_type(&self) -> u32 {
        match self.version {
            RoceVersion::V2 if !self.is_ipv4() => consts::MLX5_ROCE_L3_TYPE_IPV6,
            _ => consts::MLX5_ROCE_L3_TYPE_IPV4,
        }
    }

    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B, base: crate::prm::Sub) {
        use ifc::roce_addr_layout as r;
        msg.write_bytes(base.off + r::SOURCE_L3_ADDRESS.byte_off(), &self.gid);
        if let Some(id) = self.vlan {
            msg.set(r::VLAN_VALID.at(base), 1);
            msg.set(r::VLAN_ID.at(base), id.into());
        }
        let m = self.mac;
        msg.set(r::SOURCE_MAC_47_32.at(base), u16::from_be_bytes([m[0], m[1]]).into());
        msg.set(r::SOURCE_MAC_31_0.at(base), u32::from_be_bytes([m[2], m[3], m[4], m[5]]));
        msg.set(r::ROCE_L3_TYPE.at(base), self.l3_type());
        let v = match self.version {
            RoceVersion::V1 => consts::MLX5_ROCE_VERSION_1,
            RoceVersion::V2 => consts::MLX5_ROCE_VERSION_2,
        };
        msg.set(r::ROCE_VERSION.at(base), v);
    }

    /// Reads an entry; `None` for an empty (all-zero) one. An unknown `roce_version` is a device error.
    fn decode<B: MsgBuf + ?Sized>(out: &B, base: crate::prm::Sub) -> Result<Option<Self>, CmdError> {
        use ifc::roce_addr_layout as r;
        let mut gid = [0u8; 16];
        out.read_bytes(base.off + r::SOURCE_L3_ADDRESS.byte_off(), &mut gid);
        if gid == [0; 16] {
            return Ok(None);
        }
        let version = match out.get(r::ROCE_VERSION.at(base)) {
            consts::MLX5_ROCE_VERSION_1 => RoceVersion::V1,
            consts::MLX5_ROCE_VERSION_2 => RoceVersion::V2,
            v => {
                return Err(CmdError::Malformed {
                    opcode: Opcode::QueryRoceAddress,
                    what: "roce_version",
                    value: v.into(),
                })
            }
        };
        let vlan = (out.get(r::VLAN_VALID.at(base)) != 0).then(|| out.get(r::VLAN_ID.at(base)) as u16);
        let hi = (out.get(r::SOURCE_MAC_47_32.at(base)) as u16).to_be_bytes();
        let lo = out.get(r::SOURCE_MAC_31_0.at(base)).to_be_bytes();
        let mac = [hi[0], hi[1], lo[0], lo[1], lo[2], lo[3]];
        Ok(Some(Self { gid, version, vlan, mac }))
    }
}

/// `SET_ROCE_ADDRESS` (`mlx5_core_roce_gid_set`): programs entry `index` of port 1's GID table, or deletes it
/// when `entry` is `None`: Linux's delete zeroes the address and MAC but still names the deleted entry's type
/// (`roce_version`, and `roce_l3_type` IPv6 for a v2 entry), from `deleted`.
#[derive(Debug, Clone, Copy)]
pub struct SetRoceAddress {
    /// The GID table index.
    pub index: u16,
    /// The entry, or `None` to delete.
    pub entry: Option<RoceGid>,
    /// The type of the entry being deleted (read only when `entry` is `None`).
    pub deleted: RoceVersion,
}

impl Command for SetRoceAddress {
    type In = ifc::set_roce_address_in::Bits;
    type Out = ifc::set_roce_address_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::SetRoceAddress
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::SetRoceAddress, 0);
        msg.set(ifc::set_roce_address_in::ROCE_ADDRESS_INDEX, self.index.into());
        let sub = ifc::set_roce_address_in::ROCE_ADDRESS;
        match &self.entry {
            Some(e) => e.encode(msg, sub),
            None if self.deleted == RoceVersion::V2 => {
                use ifc::roce_addr_layout as r;
                msg.set(r::ROCE_VERSION.at(sub), consts::MLX5_ROCE_VERSION_2);
                msg.set(r::ROCE_L3_TYPE.at(sub), consts::MLX5_ROCE_L3_TYPE_IPV6);
            }
            // A deleted v1 entry is all zeros (version 1 and L3 type IPv4 are both 0).
            None => {}
        }
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// `QUERY_ROCE_ADDRESS`: reads entry `index` of port 1's GID table (`None` when empty).
#[derive(Debug, Clone, Copy)]
pub struct QueryRoceAddress {
    /// The GID table index.
    pub index: u16,
}

impl Command for QueryRoceAddress {
    type In = ifc::query_roce_address_in::Bits;
    type Out = ifc::query_roce_address_out::Bits;
    type Output = Option<RoceGid>;
    fn opcode(&self) -> Opcode {
        Opcode::QueryRoceAddress
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryRoceAddress, 0);
        msg.set(ifc::query_roce_address_in::ROCE_ADDRESS_INDEX, self.index.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<Option<RoceGid>, CmdError> {
        RoceGid::decode(out, ifc::query_roce_address_out::ROCE_ADDRESS)
    }
}

//! Port attributes as verbs reports them (`ibv_query_port`): the PTYS and PVLC registers and the translations
//! mlx5_ib applies to what the device reports (`translate_active_width`, `translate_max_vl_num`, `translate_eth_*_proto_oper`,
//! `mlx5_mtu_to_ib_mtu`, `mlx5_to_sw_pkey_sz`, `mlx5_get_gid_table_len`). Pure functions over register bytes.

use crate::prm::{consts, ifc, MsgBuf};
use crate::reg::AccessReg;

/// `IB_PORT_CM_SUP` (`ib_port_capability_mask_bits`, IBTA PortInfo:CapabilityMask bit 16): mlx5_ib sets it on a
/// RoCE port with RoCE enabled. A protocol bit, not a device layout.
pub const PORT_CAP_CM_SUP: u32 = 1 << 16;
/// `IB_PORT_CAP_MASK2_SUP` (bit 15): `cap_mask2` is valid.
pub const PORT_CAP_MASK2_SUP: u32 = 1 << 15;
/// `IB_UVERBS_PCF_IP_BASED_GIDS` (bit 26): uverbs sets it for ports whose GIDs are IP based (RoCE).
pub const PORT_CAP_IP_BASED_GIDS: u32 = 1 << 26;
/// `IBV_QPF_GRH_REQUIRED` (`ibv_port_attr.flags`): the subnet requires a GRH.
pub const QPF_GRH_REQUIRED: u8 = 1 << 0;

/// A read of PTYS for `local_port` (1-based) and `proto_mask` (`MLX5_PTYS_IB` or `MLX5_PTYS_EN`), as
/// `mlx5_query_port_ptys` reads it.
pub fn ptys_read(local_port: u8, proto_mask: u8, data: &mut [u8; ifc::ptys_reg::SIZE_BYTES]) -> AccessReg<'_> {
    *data = [0; ifc::ptys_reg::SIZE_BYTES];
    data.set(ifc::ptys_reg::LOCAL_PORT, local_port.into());
    data.set(ifc::ptys_reg::PROTO_MASK, proto_mask.into());
    AccessReg { register_id: consts::MLX5_REG_PTYS, argument: 0, write: false, data }
}

/// A read of PVLC (the port's virtual lanes) for `local_port`, as `mlx5_query_port_pvlc` reads it.
pub fn pvlc_read(local_port: u8, data: &mut [u8; ifc::pvlc_reg::SIZE_BYTES]) -> AccessReg<'_> {
    *data = [0; ifc::pvlc_reg::SIZE_BYTES];
    data.set(ifc::pvlc_reg::LOCAL_PORT, local_port.into());
    AccessReg { register_id: consts::MLX5_REG_PVLC, argument: 0, write: false, data }
}

/// `ibv_port_attr.max_vl_num` (IBA PortInfo:VLCap: 1 = VL0, 2 = VL0-1, 3 = VL0-3, 4 = VL0-7, 5 = VL0-14) from PVLC
/// `vl_hw_cap`, which counts data VLs (1, 2, 4, 8 or 15), as mlx5_ib's `translate_max_vl_num` maps it. `None` for
/// any other count (mlx5_ib fails the port query with -EINVAL).
pub fn max_vl_num(vl_hw_cap: u32) -> Option<u8> {
    match vl_hw_cap {
        1 => Some(1),
        2 => Some(2),
        4 => Some(3),
        8 => Some(4),
        15 => Some(5),
        _ => None,
    }
}

/// The operational parts of PTYS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortTypeSpeed {
    /// `eth_proto_capability` (legacy Ethernet protocols).
    pub eth_proto_capability: u32,
    /// `ext_eth_proto_capability`: non-zero when the device speaks the extended protocol list.
    pub ext_eth_proto_capability: u32,
    /// `eth_proto_oper` (one `MLX5E_PROT_MASK` bit).
    pub eth_proto_oper: u32,
    /// `ext_eth_proto_oper`.
    pub ext_eth_proto_oper: u32,
    /// `ib_link_width_oper` (`MLX5_PTYS_WIDTH_*`).
    pub ib_link_width_oper: u16,
    /// `ib_proto_oper`: one bit, the `IB_SPEED_*` value itself.
    pub ib_proto_oper: u16,
}

impl PortTypeSpeed {
    /// Reads the register bytes.
    pub fn parse(data: &[u8; ifc::ptys_reg::SIZE_BYTES]) -> Self {
        use ifc::ptys_reg as p;
        Self {
            eth_proto_capability: data.get(p::ETH_PROTO_CAPABILITY),
            ext_eth_proto_capability: data.get(p::EXT_ETH_PROTO_CAPABILITY),
            eth_proto_oper: data.get(p::ETH_PROTO_OPER),
            ext_eth_proto_oper: data.get(p::EXT_ETH_PROTO_OPER),
            ib_link_width_oper: data.get(p::IB_LINK_WIDTH_OPER) as u16,
            ib_proto_oper: data.get(p::IB_PROTO_OPER) as u16,
        }
    }

    /// `(active_speed, active_width)` of an Ethernet port as `mlx5_query_port_roce` derives them: 4X QDR unless
    /// the operational protocol is one mlx5_ib knows (the extended list when the device reports it).
    pub fn eth_speed_width(&self) -> (u16, u8) {
        let ext = self.ext_eth_proto_capability != 0;
        let oper = if ext { self.ext_eth_proto_oper } else { self.eth_proto_oper };
        let found = if ext { eth_ext_speed_width(oper) } else { eth_legacy_speed_width(oper) };
        found.unwrap_or((consts::IB_SPEED_QDR as u16, consts::IB_WIDTH_4X as u8))
    }
}

/// `MLX5E_PROT_MASK`.
const fn prot(bit: u32) -> u32 {
    1 << bit
}

const SDR: u16 = consts::IB_SPEED_SDR as u16;
const DDR: u16 = consts::IB_SPEED_DDR as u16;
const QDR: u16 = consts::IB_SPEED_QDR as u16;
const FDR: u16 = consts::IB_SPEED_FDR as u16;
const EDR: u16 = consts::IB_SPEED_EDR as u16;
const HDR: u16 = consts::IB_SPEED_HDR as u16;
const NDR: u16 = consts::IB_SPEED_NDR as u16;
const W1: u8 = consts::IB_WIDTH_1X as u8;
const W2: u8 = consts::IB_WIDTH_2X as u8;
const W4: u8 = consts::IB_WIDTH_4X as u8;
const W8: u8 = consts::IB_WIDTH_8X as u8;

/// `translate_eth_legacy_proto_oper`: `(IB_SPEED_*, IB_WIDTH_*)` of a legacy Ethernet protocol bit.
pub fn eth_legacy_speed_width(oper: u32) -> Option<(u16, u8)> {
    use consts::*;
    let table: [(&[u32], u16, u8); 7] = [
        (&[MLX5E_1000BASE_CX_SGMII, MLX5E_1000BASE_KX, MLX5E_100BASE_TX, MLX5E_1000BASE_T], SDR, W1),
        (
            &[
                MLX5E_10GBASE_T,
                MLX5E_10GBASE_CX4,
                MLX5E_10GBASE_KX4,
                MLX5E_10GBASE_KR,
                MLX5E_10GBASE_CR,
                MLX5E_10GBASE_SR,
                MLX5E_10GBASE_ER,
            ],
            QDR,
            W1,
        ),
        (&[MLX5E_25GBASE_CR, MLX5E_25GBASE_KR, MLX5E_25GBASE_SR], EDR, W1),
        (&[MLX5E_40GBASE_CR4, MLX5E_40GBASE_KR4, MLX5E_40GBASE_SR4, MLX5E_40GBASE_LR4], QDR, W4),
        (&[MLX5E_50GBASE_CR2, MLX5E_50GBASE_KR2, MLX5E_50GBASE_SR2], HDR, W1),
        (&[MLX5E_56GBASE_R4], FDR, W4),
        (&[MLX5E_100GBASE_CR4, MLX5E_100GBASE_SR4, MLX5E_100GBASE_KR4, MLX5E_100GBASE_LR4], EDR, W4),
    ];
    table.iter().find(|(bits, _, _)| bits.iter().any(|&b| prot(b) == oper)).map(|&(_, s, w)| (s, w))
}

/// `translate_eth_ext_proto_oper`: `(IB_SPEED_*, IB_WIDTH_*)` of an extended Ethernet protocol bit.
pub fn eth_ext_speed_width(oper: u32) -> Option<(u16, u8)> {
    use consts::*;
    let table: [(&[u32], u16, u8); 15] = [
        (&[MLX5E_SGMII_100M, MLX5E_1000BASE_X_SGMII], SDR, W1),
        (&[MLX5E_5GBASE_R], DDR, W1),
        (&[MLX5E_10GBASE_XFI_XAUI_1], QDR, W1),
        (&[MLX5E_40GBASE_XLAUI_4_XLPPI_4], QDR, W4),
        (&[MLX5E_25GAUI_1_25GBASE_CR_KR], EDR, W1),
        (&[MLX5E_50GAUI_2_LAUI_2_50GBASE_CR2_KR2], EDR, W2),
        (&[MLX5E_50GAUI_1_LAUI_1_50GBASE_CR_KR], HDR, W1),
        (&[MLX5E_CAUI_4_100GBASE_CR4_KR4], EDR, W4),
        (&[MLX5E_100GAUI_2_100GBASE_CR2_KR2], HDR, W2),
        (&[MLX5E_100GAUI_1_100GBASE_CR_KR], NDR, W1),
        (&[MLX5E_200GAUI_4_200GBASE_CR4_KR4], HDR, W4),
        (&[MLX5E_200GAUI_2_200GBASE_CR2_KR2], NDR, W2),
        (&[MLX5E_400GAUI_8_400GBASE_CR8], HDR, W8),
        (&[MLX5E_400GAUI_4_400GBASE_CR4_KR4], NDR, W4),
        (&[MLX5E_800GAUI_8_800GBASE_CR8_KR8], NDR, W8),
    ];
    table.iter().find(|(bits, _, _)| bits.iter().any(|&b| prot(b) == oper)).map(|&(_, s, w)| (s, w))
}

/// `translate_active_width`: the `IB_WIDTH_*` of a PTYS `ib_link_width_oper`, its lowest width bit winning as in
/// mlx5_ib's if-chain. Anything else, 0 included (a port whose link is down reports no width), is 4X: mlx5_ib
/// logs it at debug level and answers 4X, so `ibv_query_port` works on a port that is not up.
pub fn ib_active_width(ptys_width: u16) -> u8 {
    use consts::*;
    let table = [
        (MLX5_PTYS_WIDTH_1X, IB_WIDTH_1X),
        (MLX5_PTYS_WIDTH_2X, IB_WIDTH_2X),
        (MLX5_PTYS_WIDTH_4X, IB_WIDTH_4X),
        (MLX5_PTYS_WIDTH_8X, IB_WIDTH_8X),
        (MLX5_PTYS_WIDTH_12X, IB_WIDTH_12X),
    ];
    let w = u32::from(ptys_width);
    table.iter().find(|&&(p, _)| w & p != 0).map_or(IB_WIDTH_4X as u8, |&(_, ib)| ib as u8)
}

/// `mlx5_mtu_to_ib_mtu`: the `IB_MTU_*` of a PMTU value in bytes, only for the exact sizes (`None` otherwise).
pub fn mtu_to_ib_mtu(bytes: u16) -> Option<u8> {
    let e = crate::vport::ib_mtu_enum(bytes.into());
    (e != 0 && crate::vport::ib_mtu_bytes(e) == u32::from(bytes)).then_some(e)
}

/// `mlx5_to_sw_pkey_sz`: P_Key table entries of the encoded `pkey_table_size` (0 past the largest encoding).
pub fn pkey_table_len(encoded: u8) -> u16 {
    if encoded > consts::MLX5_MAX_LOG_PKEY_TABLE {
        0
    } else {
        (consts::MLX5_MIN_PKEY_TABLE_SIZE << encoded) as u16
    }
}

/// `mlx5_get_gid_table_len`: GID entries of the encoded `gid_table_size` (8 << n, 0 past 4).
pub fn gid_table_len(encoded: u16) -> u16 {
    /// Largest encoding `mlx5_get_gid_table_len` accepts.
    const MAX_ENCODED: u16 = 4;
    if encoded > MAX_ENCODED {
        0
    } else {
        8 << encoded
    }
}

/// Bytes mlx5e adds to the netdev MTU to program the port (`MLX5E_SW2HW_MTU`: Ethernet header 14, VLAN tag 4,
/// FCS 4). Protocol sizes, not device layouts.
pub const ETH_HW_MTU_OVERHEAD: u16 = 14 + 4 + 4;

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn pvlc_read_names_the_port_and_vl_counts_map_to_vlcap() {
        let mut d = [0xffu8; ifc::pvlc_reg::SIZE_BYTES];
        let r = pvlc_read(1, &mut d);
        assert_eq!((r.register_id, r.write), (consts::MLX5_REG_PVLC, false));
        assert_eq!(MsgBuf::get(&r.data[..], ifc::pvlc_reg::LOCAL_PORT), 1);
        assert_eq!(MsgBuf::get(&r.data[..], ifc::pvlc_reg::VL_HW_CAP), 0);
        assert_eq!([1, 2, 4, 8, 15].map(max_vl_num), [Some(1), Some(2), Some(3), Some(4), Some(5)]);
        // Counts between the VLCap steps, and 0, are not reported by mlx5_ib either.
        assert_eq!([0, 3, 5, 7, 14].map(max_vl_num), [None; 5]);
    }

    #[test]
    fn eth_speeds_follow_mlx5_ib_tables() {
        assert_eq!(eth_legacy_speed_width(prot(consts::MLX5E_100GBASE_CR4)), Some((EDR, W4)));
        assert_eq!(eth_legacy_speed_width(prot(consts::MLX5E_25GBASE_SR)), Some((EDR, W1)));
        assert_eq!(eth_legacy_speed_width(0), None);
        // Two bits at once is not one protocol.
        assert_eq!(eth_legacy_speed_width(prot(consts::MLX5E_10GBASE_KR) | prot(consts::MLX5E_10GBASE_CR)), None);
        assert_eq!(eth_ext_speed_width(prot(consts::MLX5E_400GAUI_8_400GBASE_CR8)), Some((HDR, W8)));
        // An unknown protocol stays 4X QDR, as mlx5_query_port_roce presets it.
        let p = PortTypeSpeed { eth_proto_oper: 1 << 17, ..PortTypeSpeed::default() };
        assert_eq!(p.eth_speed_width(), (QDR, W4));
        // With the extended capability the extended operational field is read.
        let p = PortTypeSpeed {
            ext_eth_proto_capability: 1,
            ext_eth_proto_oper: prot(consts::MLX5E_100GAUI_1_100GBASE_CR_KR),
            eth_proto_oper: prot(consts::MLX5E_10GBASE_KR),
            ..PortTypeSpeed::default()
        };
        assert_eq!(p.eth_speed_width(), (NDR, W1));
    }

    #[test]
    fn widths_mtus_and_table_sizes() {
        assert_eq!(ib_active_width(consts::MLX5_PTYS_WIDTH_4X as u16), W4);
        assert_eq!(ib_active_width(consts::MLX5_PTYS_WIDTH_12X as u16), consts::IB_WIDTH_12X as u8);
        // Several bits: the lowest wins, as in mlx5_ib's if-chain (1X | 2X is 1X).
        assert_eq!(ib_active_width(3), consts::IB_WIDTH_1X as u8);
        // No width (a port whose link is down) or an unknown bit: mlx5_ib's default, 4X.
        assert_eq!(ib_active_width(0), W4);
        assert_eq!(ib_active_width(1 << 7), W4);
        assert_eq!(mtu_to_ib_mtu(4096), Some(consts::IB_MTU_4096));
        assert_eq!(mtu_to_ib_mtu(1500), None);
        assert_eq!(pkey_table_len(0), 128);
        assert_eq!(pkey_table_len(5), 4096);
        assert_eq!(pkey_table_len(6), 0);
        assert_eq!(gid_table_len(4), 128);
        assert_eq!(gid_table_len(5), 0);
    }

    #[test]
    fn ptys_read_names_port_and_protocol() {
        let mut data = [0xffu8; ifc::ptys_reg::SIZE_BYTES];
        let r = ptys_read(1, consts::MLX5_PTYS_EN as u8, &mut data);
        assert_eq!((r.register_id, r.write), (consts::MLX5_REG_PTYS, false));
        let d: &[u8] = r.data;
        assert_eq!(MsgBuf::get(d, ifc::ptys_reg::LOCAL_PORT), 1);
        assert_eq!(MsgBuf::get(d, ifc::ptys_reg::PROTO_MASK), consts::MLX5_PTYS_EN);
        assert_eq!(MsgBuf::get(d, ifc::ptys_reg::ETH_PROTO_OPER), 0);
    }
}

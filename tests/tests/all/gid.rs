//! The RoCE GID table: SET_ROCE_ADDRESS and QUERY_ROCE_ADDRESS as `mlx5_ib` sends them, and the simulated
//! firmware's checks.

use mlx5_core::cmdq::CmdError;
use mlx5_core::hca::{Config, Error, Hca};
use mlx5_core::prm::{consts, ifc, MsgBuf};
use mlx5_core::vport::{RoceGid, RoceVersion};
use mlx5_sim::{syndrome, SimConfig, SimDevice};

/// `::ffff:192.168.1.10`.
const V4_GID: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 1, 10];

/// A field of a stored `roce_addr_layout` image.
fn field(img: &[u8], f: mlx5_core::prm::Field) -> u32 {
    MsgBuf::get(img, f)
}

#[test]
fn set_query_and_delete_roce_gids() {
    let cfg = SimConfig::default();
    let dev = SimDevice::new(cfg.clone());
    let mut d = dev.delay();
    let mut hca: Hca<_, _> = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let mac = cfg.mac;
    let v1 = RoceGid { gid: V4_GID, version: RoceVersion::V1, vlan: None, mac };
    let v2 = RoceGid { gid: V4_GID, version: RoceVersion::V2, vlan: Some(7), mac };
    let before = dev.executed().len();
    hca.set_roce_gid(2, Some(v1), &mut d).unwrap();
    hca.set_roce_gid(3, Some(v2), &mut d).unwrap();
    let log = dev.executed();
    let ops: Vec<u16> = log[before..].iter().map(|c| c.opcode).collect();
    assert_eq!(ops, [consts::MLX5_CMD_OP_SET_ROCE_ADDRESS; 2]);
    assert!(log[before..].iter().all(|c| c.status == 0));

    // The stored images, field by field.
    use ifc::roce_addr_layout as r;
    for (index, version, l3, vlan) in [
        (2, consts::MLX5_ROCE_VERSION_1, consts::MLX5_ROCE_L3_TYPE_IPV4, None),
        (3, consts::MLX5_ROCE_VERSION_2, consts::MLX5_ROCE_L3_TYPE_IPV4, Some(7)),
    ] {
        let img = dev.roce_address(index).unwrap();
        let at = r::SOURCE_L3_ADDRESS.byte_off();
        assert_eq!(img[at..at + 16], V4_GID);
        assert_eq!(field(&img, r::ROCE_VERSION), version);
        assert_eq!(field(&img, r::ROCE_L3_TYPE), l3);
        assert_eq!(field(&img, r::VLAN_VALID), u32::from(vlan.is_some()));
        assert_eq!(field(&img, r::VLAN_ID), vlan.unwrap_or(0u32));
        assert_eq!(field(&img, r::SOURCE_MAC_47_32), u32::from(u16::from_be_bytes([mac[0], mac[1]])));
        assert_eq!(field(&img, r::SOURCE_MAC_31_0), u32::from_be_bytes([mac[2], mac[3], mac[4], mac[5]]));
    }

    // Read back with their types; an unprogrammed index is empty.
    assert_eq!(hca.query_roce_gid(2, &mut d).unwrap(), Some(v1));
    assert_eq!(hca.query_roce_gid(3, &mut d).unwrap(), Some(v2));
    assert_eq!(hca.query_roce_gid(4, &mut d).unwrap(), None);

    // An IPv6 v2 entry carries the IPv6 L3 type.
    let v6 = RoceGid {
        gid: [0x20, 0x01, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        version: RoceVersion::V2,
        vlan: None,
        mac,
    };
    hca.set_roce_gid(5, Some(v6), &mut d).unwrap();
    assert_eq!(field(&dev.roce_address(5).unwrap(), r::ROCE_L3_TYPE), consts::MLX5_ROCE_L3_TYPE_IPV6);
    assert_eq!(hca.query_roce_gid(5, &mut d).unwrap(), Some(v6));

    // Deleting writes an all-zero entry.
    hca.set_roce_gid(3, None, &mut d).unwrap();
    assert_eq!(dev.roce_address(3).unwrap(), [0; ifc::roce_addr_layout::SIZE_BYTES]);
    assert_eq!(hca.query_roce_gid(3, &mut d).unwrap(), None);

    // An index past the table is refused with its syndrome.
    let e = hca.set_roce_gid(256, Some(v1), &mut d).unwrap_err();
    assert!(matches!(e, Error::Cmd(CmdError::Status { syndrome: s, .. }) if s == syndrome::GID_INDEX), "{e:?}");
    let last = *dev.executed().last().unwrap();
    assert_eq!((last.status, last.syndrome), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::GID_INDEX));
    hca.teardown(&mut d).unwrap();
}

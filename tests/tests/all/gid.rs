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

    // Deleting a v1 entry writes all zeros; a v2 one keeps its type (v2, IPv6) with address and MAC zeroed.
    hca.set_roce_gid(2, None, &mut d).unwrap();
    assert_eq!(dev.roce_address(2).unwrap(), [0; ifc::roce_addr_layout::SIZE_BYTES]);
    assert_eq!(hca.query_roce_gid(2, &mut d).unwrap(), None);
    hca.del_roce_gid(3, RoceVersion::V2, &mut d).unwrap();
    let mut want = [0u8; ifc::roce_addr_layout::SIZE_BYTES];
    want[..].set(r::ROCE_VERSION, consts::MLX5_ROCE_VERSION_2);
    want[..].set(r::ROCE_L3_TYPE, consts::MLX5_ROCE_L3_TYPE_IPV6);
    assert_eq!(dev.roce_address(3).unwrap(), want);
    assert_eq!(hca.query_roce_gid(3, &mut d).unwrap(), None);

    // An index past the table is refused with its syndrome.
    let e = hca.set_roce_gid(256, Some(v1), &mut d).unwrap_err();
    assert!(matches!(e, Error::Cmd(CmdError::Status { syndrome: s, .. }) if s == syndrome::GID_INDEX), "{e:?}");
    let last = *dev.executed().last().unwrap();
    assert_eq!((last.status, last.syndrome), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::GID_INDEX));
    hca.teardown(&mut d).unwrap();
}

/// `192.168.1.10` and `2001:db8::1`, the port's configured addresses.
static V4: [[u8; 4]; 1] = [[192, 168, 1, 10]];
static V6: [[u8; 16]; 1] = [[0x20, 0x01, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]];

#[test]
fn bring_up_programs_every_entry_in_linux_order() {
    use mlx5_core::hca::{link_local_gid, mac_to_eui64, GidType};
    let cfg = SimConfig::default();
    let dev = SimDevice::new(cfg.clone());
    let mut d = dev.delay();
    let hcfg = Config { ipv4_addrs: &V4, ipv6_addrs: &V6, ..Config::default() };
    let mut hca: Hca<_, _> = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, hcfg).unwrap();
    // The tail of bring-up: the port MAC, then one SET_ROCE_ADDRESS per entry.
    let log = dev.executed();
    let tail: Vec<u16> = log[log.len() - 7..].iter().map(|c| c.opcode).collect();
    let mut want = vec![consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT];
    want.extend([consts::MLX5_CMD_OP_SET_ROCE_ADDRESS; 6]);
    assert_eq!(tail, want);
    let ll = link_local_gid(mac_to_eui64(cfg.mac));
    let table = [
        (ll, GidType::RoceV1, consts::MLX5_ROCE_L3_TYPE_IPV4),
        (ll, GidType::RoceV2, consts::MLX5_ROCE_L3_TYPE_IPV6),
        (V4_GID, GidType::RoceV1, consts::MLX5_ROCE_L3_TYPE_IPV4),
        (V4_GID, GidType::RoceV2, consts::MLX5_ROCE_L3_TYPE_IPV4),
        (V6[0], GidType::RoceV1, consts::MLX5_ROCE_L3_TYPE_IPV4),
        (V6[0], GidType::RoceV2, consts::MLX5_ROCE_L3_TYPE_IPV6),
    ];
    use ifc::roce_addr_layout as r;
    for (i, (gid, ty, l3)) in table.into_iter().enumerate() {
        // What firmware stored, field by field.
        let img = dev.roce_address(i).unwrap();
        let at = r::SOURCE_L3_ADDRESS.byte_off();
        assert_eq!(img[at..at + 16], gid, "entry {i}");
        let version = if ty == GidType::RoceV1 { consts::MLX5_ROCE_VERSION_1 } else { consts::MLX5_ROCE_VERSION_2 };
        assert_eq!((field(&img, r::ROCE_VERSION), field(&img, r::ROCE_L3_TYPE)), (version, l3), "entry {i}");
        assert_eq!(field(&img, r::VLAN_VALID), 0);
        assert_eq!(
            field(&img, r::SOURCE_MAC_31_0),
            u32::from_be_bytes([cfg.mac[2], cfg.mac[3], cfg.mac[4], cfg.mac[5]])
        );
        // And what ibv_query_gid_ex reports.
        assert_eq!(hca.query_gid_ex(i as u16, &mut d).unwrap(), (gid, ty), "entry {i}");
    }
    assert!(hca.query_gid(6, &mut d).is_err());

    // Removing the IPv4 address clears its two entries; adding it back reprograms them.
    let before = dev.executed().len();
    assert_eq!(hca.del_roce_address(V4_GID, &mut d).unwrap(), 2);
    assert!(hca.query_gid(2, &mut d).is_err() && hca.query_gid(3, &mut d).is_err());
    assert_eq!(field(&dev.roce_address(3).unwrap(), r::ROCE_VERSION), consts::MLX5_ROCE_VERSION_2);
    let entries: Vec<RoceGid> = mlx5_core::hca::gid_table(cfg.mac, &V4, &[]).collect();
    hca.set_roce_gid(2, Some(entries[2]), &mut d).unwrap();
    hca.set_roce_gid(3, Some(entries[3]), &mut d).unwrap();
    let ops: Vec<u16> = dev.executed()[before..].iter().map(|c| c.opcode).collect();
    assert_eq!(ops.iter().filter(|&&o| o == consts::MLX5_CMD_OP_SET_ROCE_ADDRESS).count(), 4);
    // The add API finds the same two free entries again after a delete.
    assert_eq!(hca.del_roce_address(V4_GID, &mut d).unwrap(), 2);
    assert_eq!(hca.add_roce_address(V4_GID, &mut d).unwrap(), [2, 3]);
    assert_eq!(hca.query_gid_ex(3, &mut d).unwrap(), (V4_GID, GidType::RoceV2));
    hca.teardown(&mut d).unwrap();
}

#[test]
fn rtr_refuses_an_unprogrammed_source_gid_and_rc_runs_over_a_v2_ipv4_entry() {
    use mlx5_core::cq::{WcOpcode, WcStatus, WorkCompletion};
    use mlx5_core::qp::{required_attrs, QpAttr, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr};
    use mlx5_sim::testkit::{Node, RcOpts};
    let mut n = Node::new(SimConfig::default(), 1 << 16);
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let cq = n.cq(16);
    let mut a = n.qp(QpType::Rc, &cq, cap, false);
    let mut b = n.qp(QpType::Rc, &cq, cap, false);

    // The simulated host has 192.168.1.10, so bring-up programmed indices 0..4; index 4 is empty and INIT2RTR
    // is refused with BAD_PARAM and its syndrome.
    let ip = n.dev.config().ipv4_addrs[0];
    let mapped = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, ip[0], ip[1], ip[2], ip[3]];
    assert_eq!(n.hca.query_gid_ex(3, &mut n.d).unwrap(), (mapped, mlx5_core::hca::GidType::RoceV2));
    let mut ah = n.ah_attr();
    if let Some(g) = ah.grh.as_mut() {
        g.sgid_index = 4;
    }
    let o = RcOpts::default();
    let attr = QpAttr {
        qp_access_flags: o.access,
        path_mtu: o.path_mtu,
        dest_qp_num: b.qpn(),
        ah_attr: ah,
        max_dest_rd_atomic: o.rd_atomic,
        min_rnr_timer: o.min_rnr_timer,
        ..QpAttr::default()
    };
    let m = required_attrs(QpType::Rc, QpState::Reset, QpState::Init).unwrap();
    n.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Init, ..attr }, m, &mut n.d).unwrap();
    let m = required_attrs(QpType::Rc, QpState::Init, QpState::Rtr).unwrap();
    let e = n.hca.modify_qp(&mut a, &QpAttr { qp_state: QpState::Rtr, ..attr }, m, &mut n.d).unwrap_err();
    assert!(matches!(e, Error::Cmd(CmdError::Status { syndrome: s, .. }) if s == syndrome::GID_NOT_SET), "{e:?}");
    let last = *n.dev.executed().last().unwrap();
    assert_eq!(last.opcode, consts::MLX5_CMD_OP_INIT2RTR_QP);
    assert_eq!((last.status, last.syndrome), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::GID_NOT_SET));
    n.hca.destroy_qp(a, &mut n.d).unwrap();
    let mut a = n.qp(QpType::Rc, &cq, cap, false);

    // An RC ping-pong over the v2 IPv4 entry (index 3) works.
    if let Some(g) = ah.grh.as_mut() {
        g.sgid_index = 3;
    }
    let (qa, qb) = (a.qpn(), b.qpn());
    n.connect_rc(&mut a, qb, ah, &o);
    n.connect_rc(&mut b, qa, ah, &o);
    let mut cq = cq;
    let msg: Vec<u8> = (0..512u32).map(|k| (k * 7) as u8).collect();
    n.put(0, &msg);
    for from in [0, 1] {
        let (src, dst) = if from == 0 { (&mut a, &mut b) } else { (&mut b, &mut a) };
        let rsge = [n.sge(0x8000, 512)];
        n.hca.post_recv(dst, &[RecvWr { wr_id: 1, sg_list: &rsge }]).unwrap();
        let ssge = [n.sge(0, 512)];
        let wr =
            SendWr { wr_id: 2, op: SendOp::Send, sg_list: &ssge, flags: SendFlags::SIGNALED, inline: None, ud: None };
        n.hca.post_send(src, &[wr]).unwrap();
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::default(); 4];
        for _ in 0..100_000 {
            let qps: &mut [&mut mlx5_core::qp::Qp] = &mut [&mut *src, &mut *dst];
            let k = cq.poll(n.hca.mmio(), qps, &mut wc).unwrap();
            got.extend_from_slice(&wc[..k]);
            if got.len() >= 2 {
                break;
            }
        }
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|w| w.status == WcStatus::Success), "{got:?}");
        assert!(got.iter().any(|w| w.opcode == WcOpcode::Recv && w.byte_len == 512));
        assert_eq!(n.bytes(0x8000, 512), msg);
        n.put(0x8000, &[0; 512]);
    }
    n.hca.destroy_qp(a, &mut n.d).unwrap();
    n.hca.destroy_qp(b, &mut n.d).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).unwrap();
    n.finish();
}

/// `ibv_create_ah` on RoCE through the driver (`create_ib_ah`): a v2 source entry gives the address the UDP
/// source port of its flow label and an ECN-capable traffic class, a v1 entry neither; the rate is mapped for the
/// device (`mlx5r_ib_rate`) and a RoCE address without a GRH is refused.
#[test]
fn address_handles_follow_the_source_gid_type() {
    use mlx5_core::prm::c::mlx5_av as v;
    use mlx5_core::qp::{AhAttr, Grh};
    let mut n = mlx5_sim::testkit::Node::new(mlx5_sim::SimConfig::default(), 4096);
    let ah = |n: &mut mlx5_sim::testkit::Node, sgid_index: u8| {
        let grh = Grh { flow_label: 0x12345, traffic_class: 0x60, sgid_index, hop_limit: 64, ..Grh::default() };
        let attr = AhAttr { static_rate: 3, grh: Some(grh), dmac: n.dev.config().mac, ..AhAttr::default() };
        *n.hca.create_ah(&attr).expect("create_ah").av()
    };
    // Entries 0 and 1 are the link-local GID as RoCE v1 and v2.
    let (v1, v2) = (ah(&mut n, 0), ah(&mut n, 1));
    let sport = |a: &[u8]| u16::from_be_bytes([a[v::UDP_SPORT.off], a[v::UDP_SPORT.off + 1]]);
    assert_eq!((sport(&v1), sport(&v2)), (0xc000, 0xe341));
    assert_eq!((v1[v::TCLASS.off], v2[v::TCLASS.off]), (0x60, 0x62));
    // IB_RATE_10_GBPS (3 in the enum) is 8 in the device's encoding.
    assert_eq!(v2[v::STAT_RATE_SL.off] >> 4, 8, "rate mapped as mlx5r_ib_rate");
    assert!(n.hca.create_ah(&AhAttr { grh: None, ..AhAttr::default() }).is_err());
    n.finish();
}

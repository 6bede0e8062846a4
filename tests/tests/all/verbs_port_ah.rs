//! `ibv_query_port` with every field of `ibv_port_attr`, from the commands mlx5_ib uses (QUERY_HCA_VPORT_CONTEXT,
//! PTYS, PMTU and PVLC on InfiniBand; PTYS, QUERY_NIC_VPORT_CONTEXT, QUERY_VPORT_STATE and PMTU on Ethernet), and
//! address handles as objects: `ibv_create_ah`, `ibv_init_ah_from_wc` / `ibv_create_ah_from_wc` answering a UD
//! sender as `ibv_ud_pingpong`'s server does.

use std::time::Duration;

use mlx5_core::hca::{Config, Hca};
use mlx5_core::port::{PORT_CAP_CM_SUP, PORT_CAP_IP_BASED_GIDS, PORT_CAP_MASK2_SUP, QPF_GRH_REQUIRED};
use mlx5_core::prm::consts;
use mlx5_sim::{PortInfo, PortType, SimConfig, SimDevice};
use mlx5_verbs::{
    wr, Access, AhAttr, Context, Grh, LinkLayer, QpCap, QpType, WcFlags, WcStatus, WorkCompletion, GRH_BYTES,
};

fn query(cfg: SimConfig) -> mlx5_core::hca::PortAttr {
    let ib = cfg.port_type == PortType::Ib;
    let dev = SimDevice::new(cfg);
    let mut d = dev.delay();
    let mut hca: Hca<_, _> = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let before = dev.executed().len();
    let p = hca.query_port(&mut d).unwrap();
    // The commands mlx5_ib sends for ibv_query_port, in its order (ACCESS_REG reads have op_mod 1): PTYS, then
    // the NIC vport context (and here the vport state and PMTU in place of the netdev) on Ethernet; the HCA vport
    // context, PTYS, PMTU and PVLC on InfiniBand.
    let sent: Vec<(u16, u16)> = dev.executed()[before..].iter().map(|c| (c.opcode, c.op_mod)).collect();
    let reg = (consts::MLX5_CMD_OP_ACCESS_REG, 1);
    let want = if ib {
        vec![(consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT, 0), reg, reg, reg]
    } else {
        vec![
            reg,
            (consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT, 0),
            (consts::MLX5_CMD_OP_QUERY_VPORT_STATE, consts::MLX5_VPORT_STATE_OP_MOD_VNIC_VPORT),
            reg,
        ]
    };
    assert_eq!(sent, want);
    hca.teardown(&mut d).unwrap();
    p
}

#[test]
fn query_port_on_ethernet_follows_mlx5_query_port_roce() {
    let p = query(SimConfig::default());
    assert_eq!(p.link_layer, LinkLayer::Ethernet);
    assert_eq!((p.state, p.phys_state), (consts::IB_PORT_ACTIVE as u8, consts::IB_PORT_PHYS_STATE_LINK_UP as u8));
    // max_mtu is IB_MTU_4096 on RoCE; the active MTU is PMTU's 1500 less mlx5e's 22 bytes of L2, less the RoCE
    // headers: 1024.
    assert_eq!((p.max_mtu, p.active_mtu), (consts::IB_MTU_4096, consts::IB_MTU_1024));
    // The simulated port runs 100GBASE-CR4: 4X EDR in verbs' terms (translate_eth_legacy_proto_oper).
    assert_eq!((p.active_width, p.active_speed), (consts::IB_WIDTH_4X as u8, consts::IB_SPEED_EDR as u8));
    assert_eq!(p.active_speed_ex, consts::IB_SPEED_EDR);
    assert_eq!(p.port_cap_flags, PORT_CAP_CM_SUP | PORT_CAP_IP_BASED_GIDS);
    // RoCE: the GID table is the RoCE address table; one P_Key; no LIDs or subnet manager.
    assert_eq!((p.gid_tbl_len, p.pkey_tbl_len), (256, 1));
    assert_eq!(p.max_msg_sz, 1 << 30);
    assert_eq!((p.lid, p.sm_lid, p.lmc, p.sm_sl, p.subnet_timeout, p.init_type_reply), (0, 0, 0, 0, 0, 0));
    assert_eq!((p.bad_pkey_cntr, p.qkey_viol_cntr, p.flags, p.port_cap_flags2, p.max_vl_num), (0, 0, 0, 0, 0));

    // A link that is down, on a 25 GbE protocol and a 9000-byte MTU.
    let info = PortInfo { eth_proto_oper: 1 << consts::MLX5E_25GBASE_SR, ..PortInfo::default() };
    let p = query(SimConfig { port_up: false, port_mtu: 9000, port_info: info, ..SimConfig::default() });
    assert_eq!((p.state, p.phys_state), (consts::IB_PORT_DOWN as u8, consts::IB_PORT_PHYS_STATE_DISABLED as u8));
    assert_eq!(p.active_mtu, consts::IB_MTU_4096);
    // PTYS reports no operational protocol while the link is down: mlx5_ib's 4X QDR default.
    assert_eq!((p.active_width, p.active_speed), (consts::IB_WIDTH_4X as u8, consts::IB_SPEED_QDR as u8));
    let p = query(SimConfig { port_mtu: 9000, port_info: info, ..SimConfig::default() });
    assert_eq!((p.active_width, p.active_speed), (consts::IB_WIDTH_1X as u8, consts::IB_SPEED_EDR as u8));
}

#[test]
fn query_port_on_infiniband_follows_mlx5_query_hca_port() {
    let info = PortInfo {
        lmc: 2,
        sm_sl: 5,
        subnet_timeout: 17,
        init_type_reply: 3,
        grh_required: true,
        ib_link_width_oper: consts::MLX5_PTYS_WIDTH_12X as u16,
        ib_proto_oper: consts::IB_SPEED_HDR as u16,
        ..PortInfo::default()
    };
    let cfg = SimConfig { port_type: PortType::Ib, lid: 9, port_mtu: 2048, port_info: info, ..SimConfig::default() };
    let p = query(cfg.clone());
    assert_eq!(p.link_layer, LinkLayer::InfiniBand);
    assert_eq!((p.state, p.phys_state), (consts::IB_PORT_ACTIVE as u8, consts::IB_PORT_PHYS_STATE_LINK_UP as u8));
    // MTUs from PMTU (max 4096, operational 2048), not a constant.
    assert_eq!((p.max_mtu, p.active_mtu), (consts::IB_MTU_4096, consts::IB_MTU_2048));
    assert_eq!((p.lid, p.sm_lid, p.lmc, p.sm_sl, p.subnet_timeout, p.init_type_reply), (9, 1, 2, 5, 17, 3));
    assert_eq!((p.active_width, p.active_speed), (consts::IB_WIDTH_12X as u8, consts::IB_SPEED_HDR as u8));
    assert_eq!(p.port_cap_flags, PortInfo::default().cap_mask1);
    // cap_mask2 is passed on because cap_mask1 says it is supported.
    assert_ne!(p.port_cap_flags & PORT_CAP_MASK2_SUP, 0);
    assert_eq!(u32::from(p.port_cap_flags2), PortInfo::default().cap_mask2);
    assert_eq!(p.flags, QPF_GRH_REQUIRED);
    // gid_table_size 4 encodes 128 entries, pkey_table_size 0 encodes 128 (mlx5_get_gid_table_len,
    // mlx5_to_sw_pkey_sz).
    assert_eq!((p.gid_tbl_len, p.pkey_tbl_len, p.max_msg_sz), (128, 128, 1 << 30));
    // PVLC's vl_hw_cap 8 (data VLs 0-7) is VLCap 4, IBV_VL_0_7.
    assert_eq!(p.max_vl_num, 4);

    let no_mask2 = PortInfo { cap_mask1: PORT_CAP_CM_SUP, ..info };
    let p = query(SimConfig { port_info: no_mask2, ..cfg.clone() });
    assert_eq!((p.port_cap_flags, p.port_cap_flags2), (PORT_CAP_CM_SUP, 0));

    // Widths as mlx5_ib's translate_active_width reads them: the lowest bit wins (1X | 2X is 1X), and no width,
    // which a port whose link is down reports, is its default 4X, so the port can be queried while down.
    let mixed = PortInfo { ib_link_width_oper: 3, ..info };
    assert_eq!(query(SimConfig { port_info: mixed, ..cfg.clone() }).active_width, consts::IB_WIDTH_1X as u8);
    let p = query(SimConfig { port_up: false, ..cfg });
    assert_eq!((p.state, p.active_width), (1, consts::IB_WIDTH_4X as u8), "IBV_PORT_DOWN, 4X");
}

const QKEY: u32 = 0x1111_1111;

fn wait(cq: &mlx5_verbs::CompletionQueue<'_>, n: usize) -> Vec<WorkCompletion> {
    let mut wc = vec![WorkCompletion::default(); n];
    let got = cq.poll_until(&mut wc, n, Duration::from_secs(5)).unwrap();
    wc.truncate(got);
    wc
}

/// The client knows the server's address; the server learns the client's from each request (its completion and
/// GRH) and answers through `create_ah_from_wc`, as a UD server does. Also: a wrong Q_Key is counted in
/// `qkey_viol_cntr`.
fn ud_reply_with_ah_from_wc(base: SimConfig) {
    let (a, b) = Context::open_sim_pair_with(base).unwrap();
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (cq_a, cq_b) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let size = 256usize;
    let (mut buf_a, mut buf_b) =
        (a.alloc_buffer(2 * size + GRH_BYTES).unwrap(), b.alloc_buffer(2 * size + GRH_BYTES).unwrap());
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE).unwrap();
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE).unwrap();
    let qa = pd_a.create_qp(QpType::Ud, &cq_a, &cq_a, cap).unwrap().activate_ud(QKEY).unwrap();
    let qb = pd_b.create_qp(QpType::Ud, &cq_b, &cq_b, cap).unwrap().activate_ud(QKEY).unwrap();
    let rb = b.remote_qp(&qb).unwrap();
    let to_b = match a.link_layer() {
        LinkLayer::Ethernet => AhAttr {
            grh: Some(Grh { dgid: rb.gid, hop_limit: 64, ..Grh::default() }),
            dmac: rb.mac,
            port_num: 1,
            ..AhAttr::default()
        },
        LinkLayer::InfiniBand => AhAttr { dlid: rb.lid, port_num: 1, ..AhAttr::default() },
    };
    let ah_to_b = pd_a.create_ah(&to_b).unwrap();
    let recv_len = (size + GRH_BYTES) as u32;
    for i in 0..3u8 {
        let ping = vec![i.wrapping_mul(7) ^ 0x5a; size];
        mr_a.write(0, &ping).unwrap();
        qb.post_recv(&[wr::recv(1, &[mr_b.sge(size, recv_len)])]).unwrap();
        qa.post_recv(&[wr::recv(1, &[mr_a.sge(size, recv_len)])]).unwrap();
        qa.post_send(&[wr::ud_send(2, &[mr_a.sge(0, size as u32)], ah_to_b.dest(rb.qpn, QKEY))]).unwrap();
        let wc = wait(&cq_b, 1);
        assert_eq!((wc.len(), wc[0].status, wc[0].byte_len), (1, WcStatus::Success, recv_len));
        assert_eq!(mr_b.read_vec(size + GRH_BYTES, size), ping);
        // The server's reply address, from nothing but the completion and the GRH room.
        let grh: [u8; GRH_BYTES] = mr_b.read_vec(size, GRH_BYTES).try_into().unwrap();
        let has_grh = wc[0].wc_flags.contains(WcFlags::GRH);
        let attr = b.init_ah_from_wc(1, &wc[0], has_grh.then_some(&grh)).unwrap();
        match b.link_layer() {
            LinkLayer::Ethernet => {
                let g = attr.grh.expect("RoCE replies are routed by GID");
                assert_eq!(g.dgid, a.query_gid(0).unwrap(), "the sender's GID");
                assert_eq!(b.query_gid(g.sgid_index.into()).unwrap(), rb.gid, "our GID the packet was sent to");
            }
            LinkLayer::InfiniBand => assert_eq!(attr.dlid, a.query_port().unwrap().lid),
        }
        let ah_to_a = pd_b.create_ah_from_wc(&wc[0], has_grh.then_some(&grh), 1).unwrap();
        assert_eq!(ah_to_a.attr().dlid, attr.dlid);
        mr_b.write(0, &ping).unwrap();
        qb.post_send(&[wr::ud_send(3, &[mr_b.sge(0, size as u32)], ah_to_a.dest(wc[0].src_qp, QKEY))]).unwrap();
        let wa = wait(&cq_a, 2);
        assert!(wa.iter().all(|w| w.status == WcStatus::Success), "{wa:?}");
        assert_eq!(mr_a.read_vec(size + GRH_BYTES, size), ping, "pong {i}");
        assert_eq!(wait(&cq_b, 1)[0].wr_id, 3);
        ah_to_a.destroy();
    }
    // A datagram with the wrong Q_Key is dropped and counted (IBA Q_Key violation counter).
    assert_eq!(b.query_port().unwrap().qkey_viol_cntr, 0);
    qb.post_recv(&[wr::recv(1, &[mr_b.sge(size, recv_len)])]).unwrap();
    qa.post_send(&[wr::ud_send(4, &[mr_a.sge(0, size as u32)], ah_to_b.dest(rb.qpn, QKEY + 1))]).unwrap();
    assert_eq!(wait(&cq_a, 1)[0].status, WcStatus::Success);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while b.query_port().unwrap().qkey_viol_cntr == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.query_port().unwrap().qkey_viol_cntr, 1);
}

#[test]
fn ud_server_replies_through_ah_from_wc_on_roce() {
    ud_reply_with_ah_from_wc(SimConfig::default());
}

#[test]
fn ud_server_replies_through_ah_from_wc_on_infiniband() {
    ud_reply_with_ah_from_wc(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
}

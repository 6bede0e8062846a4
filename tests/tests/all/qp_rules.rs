//! Queue-pair rules that need no device: queue sizing as rdma-core computes it, the verbs state-transition table,
//! address vectors and control segments.

use mlx5_core::cq::LinkLayer;
use mlx5_core::prm::{c, consts};
use mlx5_core::qp::{
    check_modify, ctrl_seg, qp_sizes, Ah, AhAttr, Grh, ModifyError, QpAttr, QpAttrMask, QpCap, QpState, QpType,
    SizeError,
};

/// ConnectX-5 limits: 512-byte send WQEs, 512-byte receive WQEs, 2^15 WQEs.
fn sizes(ty: QpType, cap: QpCap) -> Result<mlx5_core::qp::QpSizes, SizeError> {
    qp_sizes(ty, &cap, 512, 512, 15)
}

#[test]
fn queues_are_sized_as_rdma_core_sizes_them() {
    // RC, 1 SGE, no inline: 48 bytes of overhead + 16 = 64, one BB per WQE.
    let s = sizes(
        QpType::Rc,
        QpCap { max_send_wr: 100, max_recv_wr: 100, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
    )
    .unwrap();
    assert_eq!((s.sq_wqe_size, s.sq_wqe_cnt, s.rq_wqe_cnt, s.rq_wqe_shift), (64, 128, 128, 4));
    assert_eq!(
        s.cap,
        QpCap { max_send_wr: 128, max_recv_wr: 128, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 12 }
    );
    // Inline 64 bytes dominates 2 SGEs: 48 + 4 + 64 = 116 -> 128 bytes (2 BBs) per WQE.
    let s = sizes(
        QpType::Rc,
        QpCap { max_send_wr: 10, max_recv_wr: 3, max_send_sge: 2, max_recv_sge: 3, max_inline_data: 64 },
    )
    .unwrap();
    assert_eq!((s.sq_wqe_size, s.sq_wqe_cnt), (128, 32));
    assert_eq!(s.cap, QpCap { max_send_wr: 16, max_recv_wr: 4, max_send_sge: 5, max_recv_sge: 4, max_inline_data: 76 });
    assert_eq!((s.rq_wqe_shift, s.rq_bytes(), s.sq_bytes()), (6, 4 * 64, 32 * 64));
    // UD: the 48-byte datagram segment is part of the overhead.
    let s = sizes(
        QpType::Ud,
        QpCap { max_send_wr: 1, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
    )
    .unwrap();
    assert_eq!((s.sq_wqe_size, s.cap.max_send_sge, s.cap.max_inline_data), (128, 4, 60));
    // Limits.
    assert_eq!(
        sizes(QpType::Rc, QpCap { max_send_wr: 1, max_send_sge: 30, ..QpCap::default() }),
        Err(SizeError::SendWqeTooBig { bytes: 576, max: 512 })
    );
    assert_eq!(
        sizes(QpType::Rc, QpCap { max_send_wr: 1 << 15, max_send_sge: 2, ..QpCap::default() }),
        Err(SizeError::TooManyWqes { wqes: 1 << 16, max: 1 << 15 })
    );
    assert_eq!(
        sizes(QpType::Rc, QpCap { max_send_wr: 1, max_recv_wr: 1, max_recv_sge: 33, ..QpCap::default() }),
        Err(SizeError::RecvWqeTooBig { bytes: 1024, max: 512 })
    );
    // No work requests ask for no queue (rdma-core's receive-only QP and zero-length RQ).
    let s = sizes(QpType::Rc, QpCap::default()).unwrap();
    assert_eq!((s.sq_wqe_cnt, s.rq_wqe_cnt, s.cap), (0, 0, QpCap::default()));
}

fn rc_rtr_mask() -> QpAttrMask {
    QpAttrMask::STATE
        | QpAttrMask::AV
        | QpAttrMask::PATH_MTU
        | QpAttrMask::DEST_QPN
        | QpAttrMask::RQ_PSN
        | QpAttrMask::MAX_DEST_RD_ATOMIC
        | QpAttrMask::MIN_RNR_TIMER
}

#[test]
fn transitions_follow_the_verbs_table() {
    use QpState::{Init, Reset, Rtr, Rts};
    let to = |s| QpAttr { qp_state: s, ..QpAttr::default() };
    let init = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::ACCESS_FLAGS;
    let rts = QpAttrMask::STATE
        | QpAttrMask::TIMEOUT
        | QpAttrMask::RETRY_CNT
        | QpAttrMask::RNR_RETRY
        | QpAttrMask::SQ_PSN
        | QpAttrMask::MAX_QP_RD_ATOMIC;
    assert_eq!(check_modify(QpType::Rc, Reset, &to(Init), init), Ok(()));
    assert_eq!(check_modify(QpType::Rc, Init, &to(Rtr), rc_rtr_mask()), Ok(()));
    assert_eq!(check_modify(QpType::Rc, Rtr, &to(Rts), rts), Ok(()));
    // Skipping a state, or going back, is refused.
    assert_eq!(
        check_modify(QpType::Rc, Reset, &to(Rtr), rc_rtr_mask()),
        Err(ModifyError::BadTransition { from: Reset, to: Rtr })
    );
    assert_eq!(check_modify(QpType::Rc, Rts, &to(Init), init), Err(ModifyError::BadTransition { from: Rts, to: Init }));
    // A required attribute missing, or one the transition does not take.
    let no_psn = QpAttrMask(rc_rtr_mask().0 & !QpAttrMask::RQ_PSN.0);
    assert_eq!(
        check_modify(QpType::Rc, Init, &to(Rtr), no_psn),
        Err(ModifyError::MissingAttr { missing: QpAttrMask::RQ_PSN.0 })
    );
    assert_eq!(
        check_modify(QpType::Rc, Reset, &to(Init), init | QpAttrMask::SQ_PSN),
        Err(ModifyError::ExtraAttr { extra: QpAttrMask::SQ_PSN.0 })
    );
    // UD needs a Q_Key instead of access flags, and only a send PSN for RTS.
    let ud_init = QpAttrMask::STATE | QpAttrMask::PKEY_INDEX | QpAttrMask::PORT | QpAttrMask::QKEY;
    assert_eq!(check_modify(QpType::Ud, Reset, &to(Init), ud_init), Ok(()));
    assert!(matches!(check_modify(QpType::Ud, Reset, &to(Init), init), Err(ModifyError::MissingAttr { .. })));
    assert_eq!(check_modify(QpType::Ud, Init, &to(Rtr), QpAttrMask::STATE), Ok(()));
    assert_eq!(check_modify(QpType::Ud, Rtr, &to(Rts), QpAttrMask::STATE | QpAttrMask::SQ_PSN), Ok(()));
    // Any state to ERR or RESET, with nothing else.
    for from in [Reset, Init, Rtr, Rts, QpState::Err] {
        assert_eq!(check_modify(QpType::Rc, from, &to(QpState::Err), QpAttrMask::STATE), Ok(()));
        assert_eq!(check_modify(QpType::Rc, from, &to(Reset), QpAttrMask::STATE), Ok(()));
    }
    // Values out of range.
    let bad = QpAttr { qp_state: Rts, rnr_retry: 8, ..QpAttr::default() };
    assert_eq!(check_modify(QpType::Rc, Rtr, &bad, rts), Err(ModifyError::BadValue { what: "rnr_retry", value: 8 }));
    let bad = QpAttr { qp_state: Init, port_num: 2, ..QpAttr::default() };
    assert_eq!(check_modify(QpType::Rc, Reset, &bad, init), Err(ModifyError::BadValue { what: "port_num", value: 2 }));
    let bad = QpAttr { qp_state: Rtr, rq_psn: 1 << 24, ..QpAttr::default() };
    assert!(matches!(check_modify(QpType::Rc, Init, &bad, rc_rtr_mask()), Err(ModifyError::BadValue { .. })));
}

#[test]
fn address_vectors_for_both_link_layers() {
    use c::mlx5_av as v;
    let grh = Grh {
        dgid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        flow_label: 0x12345,
        sgid_index: 3,
        hop_limit: 64,
        traffic_class: 0x20,
    };
    let ib = Ah::new(
        &AhAttr { dlid: 0x1234, sl: 9, src_path_bits: 0x81, static_rate: 2, ..AhAttr::default() },
        LinkLayer::InfiniBand,
    );
    let av = ib.av();
    assert_eq!(v::RLID.get_be(av, 0), 0x1234);
    assert_eq!((av[v::STAT_RATE_SL.off], av[v::FL_MLID.off]), (0x29, 0x01));
    assert_eq!(v::GRH_GID_FL.get_be(av, 0), 0, "no GRH asked");
    let roce =
        Ah::new(&AhAttr { sl: 5, grh: Some(grh), dmac: [2, 3, 4, 5, 6, 7], ..AhAttr::default() }, LinkLayer::Ethernet);
    let av = roce.av();
    assert_eq!(&av[v::RGID.off..v::RGID.end()], &grh.dgid);
    assert_eq!(v::GRH_GID_FL.get_be(av, 0), 1 << 30 | 3 << 20 | 0x12345);
    assert_eq!((av[v::HOP_LIMIT.off], av[v::TCLASS.off], av[v::STAT_RATE_SL.off]), (64, 0x20, 5 << 1));
    assert_eq!(&av[v::RMAC.off..v::RMAC.end()], &[2, 3, 4, 5, 6, 7]);
    assert_eq!(v::UDP_SPORT.get_be(av, 0), 0xc000);
}

#[test]
fn control_segment_layout() {
    // The immediate is network order (ibv_send_wr.imm_data, __be32): its bytes are copied as they are.
    let imm = 0xdead_beef_u32.to_be();
    let s = ctrl_seg(0x1234, consts::MLX5_OPCODE_SEND_IMM, 0xabcdef, 4, consts::MLX5_WQE_CTRL_CQ_UPDATE, imm);
    assert_eq!(s, [0x00, 0x12, 0x34, 0x0b, 0xab, 0xcd, 0xef, 0x04, 0, 0, 0, 0x08, 0xde, 0xad, 0xbe, 0xef]);
}

#[test]
fn query_port_and_default_gid_on_both_link_layers() {
    use mlx5_core::hca::{Config, Hca};
    use mlx5_sim::{PortType, SimConfig, SimDevice};
    let cfg = SimConfig::default();
    let dev = SimDevice::new(cfg.clone());
    let mut d = dev.delay();
    let mut hca: Hca<_, _> = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let p = hca.query_port(&mut d).unwrap();
    // 1500-byte Ethernet MTU less the RoCE headers: the largest IB MTU that fits is 1024.
    assert_eq!((p.state, p.active_mtu, p.link_layer, p.lid), (4, 3, LinkLayer::Ethernet, 0));
    let gid = hca.query_gid(0, &mut d).unwrap();
    let m = cfg.mac;
    assert_eq!(gid, [0xfe, 0x80, 0, 0, 0, 0, 0, 0, m[0] ^ 2, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]]);
    // Index 1 is the same link-local GID as RoCE v2; nothing is programmed past it without addresses.
    use mlx5_core::hca::GidType;
    assert_eq!(hca.query_gid_ex(0, &mut d).unwrap(), (gid, GidType::RoceV1));
    assert_eq!(hca.query_gid_ex(1, &mut d).unwrap(), (gid, GidType::RoceV2));
    assert!(hca.query_gid(2, &mut d).is_err());
    hca.teardown(&mut d).unwrap();

    let cfg = SimConfig { port_type: PortType::Ib, ..SimConfig::default() };
    let dev = SimDevice::new(cfg.clone());
    let mut d = dev.delay();
    let mut hca: Hca<_, _> = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let p = hca.query_port(&mut d).unwrap();
    assert_eq!((p.state, p.link_layer, p.lid), (4, LinkLayer::InfiniBand, 1));
    let gid = hca.query_gid(0, &mut d).unwrap();
    assert_eq!(gid[..8], [0xfe, 0x80, 0, 0, 0, 0, 0, 0]);
    assert_eq!(u64::from_be_bytes(gid[8..].try_into().unwrap()), cfg.node_guid);
    hca.teardown(&mut d).unwrap();
}

//! The HCA bring-up against the simulated firmware: Linux's exact command order, page accounting to zero, the
//! async EQ (owner bits, event mask, consumer-index updates, arming) and the events it carries.

use mlx5_core::eq::{Eqe, Event};
use mlx5_core::hca::{Config, Hca, HcaState};
use mlx5_core::prm::{consts, EventType};
use mlx5_core::reg::HOST_ENDIANNESS_LEN;
use mlx5_sim::testkit::SimHca;
use mlx5_sim::{ExecutedCmd, HcaState as SimHcaState, Mode, PortType, SimConfig, SimDevice, SimEvent, EQE_DATA_LEN};

fn up(dev: &SimDevice) -> SimHca {
    let mut d = dev.delay();
    Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap_or_else(|e| panic!("bring-up: {e}"))
}

fn opcodes(cmds: &[ExecutedCmd]) -> Vec<(u16, u16)> {
    cmds.iter().map(|c| (c.opcode, c.op_mod)).collect()
}

/// `QUERY_HCA_CAP` op_mod: capability type << 1 | (1 = current, 0 = max).
const fn cap(ty: u16, cur: bool) -> (u16, u16) {
    (consts::MLX5_CMD_OP_QUERY_HCA_CAP, (ty << 1) | cur as u16)
}
const fn set_cap(ty: u16) -> (u16, u16) {
    (consts::MLX5_CMD_OP_SET_HCA_CAP, ty << 1)
}
const fn op(o: u16, m: u16) -> (u16, u16) {
    (o, m)
}

/// Linux 6.12's bring-up for this device, function by function (main.c, fw.c, pagealloc.c, eq.c).
fn linux_order(port: PortType) -> Vec<(u16, u16)> {
    use consts::*;
    let eth = port == PortType::Eth;
    let mut v = vec![
        // mlx5_function_enable: mlx5_core_enable_hca, mlx5_core_set_issi, mlx5_satisfy_startup_pages(boot).
        op(MLX5_CMD_OP_ENABLE_HCA, 0),
        op(MLX5_CMD_OP_QUERY_ISSI, 0),
        op(MLX5_CMD_OP_SET_ISSI, 0),
        op(MLX5_CMD_OP_QUERY_PAGES, MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES),
        op(MLX5_CMD_OP_MANAGE_PAGES, MLX5_PAGES_GIVE),
        // mlx5_function_open: set_hca_ctrl (host endianness register, write = op_mod 0).
        op(MLX5_CMD_OP_ACCESS_REG, 0),
        // set_hca_cap: handle_hca_cap (general max, cur, set), handle_hca_cap_atomic.
        cap(MLX5_CAP_GENERAL, false),
        cap(MLX5_CAP_GENERAL, true),
        set_cap(MLX5_CAP_GENERAL),
        cap(MLX5_CAP_ATOMIC, false),
        cap(MLX5_CAP_ATOMIC, true),
        set_cap(MLX5_CAP_ATOMIC),
    ];
    if eth {
        // handle_hca_cap_roce: sw_r_roce_src_udp_port is supported but off, so it is set.
        v.extend([cap(MLX5_CAP_ROCE, false), cap(MLX5_CAP_ROCE, true), set_cap(MLX5_CAP_ROCE)]);
    }
    v.extend([
        // handle_hca_cap_2: read; no software vhca id on this device, so nothing is set.
        cap(MLX5_CAP_GENERAL_2, false),
        cap(MLX5_CAP_GENERAL_2, true),
        // mlx5_satisfy_startup_pages(init), mlx5_cmd_init_hca, mlx5_set_driver_version.
        op(MLX5_CMD_OP_QUERY_PAGES, MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES),
        op(MLX5_CMD_OP_MANAGE_PAGES, MLX5_PAGES_GIVE),
        op(MLX5_CMD_OP_INIT_HCA, 0),
        op(MLX5_CMD_OP_SET_DRIVER_VERSION, 0),
        // mlx5_query_hca_caps (current values): general, general 2, [Ethernet offloads], ODP, atomic, [RoCE].
        cap(MLX5_CAP_GENERAL, true),
        cap(MLX5_CAP_GENERAL_2, true),
    ]);
    if eth {
        v.push(cap(MLX5_CAP_ETHERNET_OFFLOADS, true));
    }
    v.extend([cap(MLX5_CAP_ODP, true), cap(MLX5_CAP_ATOMIC, true)]);
    if eth {
        v.push(cap(MLX5_CAP_ROCE, true));
    }
    v.extend([
        // mlx5_load: mlx5_get_uars_page, then create_async_eqs (command, async, pages EQ); firmware then asks for
        // its regular pages on the pages EQ. Completion EQs come with the first CQ of each vector.
        op(MLX5_CMD_OP_ALLOC_UAR, 0),
        op(MLX5_CMD_OP_CREATE_EQ, 0),
        op(MLX5_CMD_OP_CREATE_EQ, 0),
        op(MLX5_CMD_OP_CREATE_EQ, 0),
        op(MLX5_CMD_OP_MANAGE_PAGES, MLX5_PAGES_GIVE),
        // mlx5_ib's counters stage: the port's Q counter set (the device reports max_qp_cnt).
        op(MLX5_CMD_OP_ALLOC_Q_COUNTER, 0),
    ]);
    if eth {
        // mlx5_ib on a RoCE port: the port MAC, then add_gid -> set_roce_addr for the default GIDs (the
        // link-local address as RoCE v1 at index 0 and v2 at index 1; the default config has no IP address).
        v.extend([
            op(MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT, 0),
            op(MLX5_CMD_OP_SET_ROCE_ADDRESS, 0),
            op(MLX5_CMD_OP_SET_ROCE_ADDRESS, 0),
        ]);
    }
    v
}

fn linux_teardown() -> Vec<(u16, u16)> {
    use consts::*;
    vec![
        // mlx5_ib_dealloc_counters, before mlx5_core unloads.
        op(MLX5_CMD_OP_DEALLOC_Q_COUNTER, 0),
        // destroy_async_eqs: pages, async, then command EQ.
        op(MLX5_CMD_OP_DESTROY_EQ, 0),
        op(MLX5_CMD_OP_DESTROY_EQ, 0),
        op(MLX5_CMD_OP_DESTROY_EQ, 0),
        op(MLX5_CMD_OP_DEALLOC_UAR, 0),
        op(MLX5_CMD_OP_TEARDOWN_HCA, 0),
        op(MLX5_CMD_OP_MANAGE_PAGES, MLX5_PAGES_TAKE),
        op(MLX5_CMD_OP_DISABLE_HCA, 0),
    ]
}

#[test]
fn bring_up_follows_linux_order_and_accounts_pages_to_zero() {
    for (port, mode) in [(PortType::Eth, Mode::Inline), (PortType::Ib, Mode::Inline), (PortType::Eth, Mode::Threaded)] {
        let cfg = SimConfig { port_type: port, mode, ..SimConfig::default() };
        let (boot, init, regular) = (cfg.boot_pages as usize, cfg.init_pages as usize, cfg.regular_pages as usize);
        let dev = SimDevice::new(cfg);
        let hca = up(&dev);
        let cmds = dev.executed();
        assert_eq!(opcodes(&cmds), linux_order(port), "{port:?} {mode:?}");
        assert!(cmds.iter().all(|c| c.status == 0 && c.delivery == 0), "{port:?}: every command succeeded");
        // MANAGE_PAGES always on the reserved last slot, everything else on slot 0.
        for c in &cmds {
            let want = if c.opcode == consts::MLX5_CMD_OP_MANAGE_PAGES { 31 } else { 0 };
            assert_eq!(c.slot, want, "{port:?}: slot of {:#x}", c.opcode);
        }
        let st = hca.page_stats();
        assert_eq!((st.boot, st.init, st.requested), (boot, init, regular), "{port:?}");
        assert_eq!(hca.pages_given(), boot + init + regular);
        assert_eq!(dev.pages_owned(), boot + init + regular);
        assert_eq!(dev.hca_state(), SimHcaState::Initialized);

        let n = cmds.len();
        let mut d = dev.delay();
        let rep = hca.teardown(&mut d).unwrap();
        assert_eq!(opcodes(&dev.executed()[n..]), linux_teardown(), "{port:?}: teardown order");
        assert_eq!(rep.pages_reclaimed, boot + init + regular);
        assert_eq!((rep.pages_abandoned, rep.local_only), (0, false));
        assert_eq!(dev.pages_owned(), 0, "{port:?}: firmware holds no page");
        assert_eq!(dev.dma_outstanding(), (0, 0), "{port:?}: every DMA allocation returned");
        assert_eq!(dev.hca_state(), SimHcaState::Disabled);
        assert!(!dev.events().iter().any(|e| matches!(e, SimEvent::FreedDeviceOwned { .. })));
    }
}

#[test]
fn firmware_sees_what_linux_sets() {
    let dev = SimDevice::default();
    let hca = up(&dev);
    // set_hca_ctrl writes MLX5_SET_HOST_ENDIANNESS into `he`: 0 on a little-endian host, 0x80 on a big-endian one.
    let want = if cfg!(target_endian = "little") { 0x00 } else { 0x80 };
    assert_eq!(dev.host_endianness(), Some(want));
    assert_eq!(HOST_ENDIANNESS_LEN, 16);
    assert!(dev.driver_version().is_some_and(|v| v.starts_with("Rust,mlx5-core,")));
    let g = hca.caps().general;
    // Linux's default profile: log_max_qp capped at 18, pkey table of 128, signatures off.
    assert_eq!(g.log_max_qp, 18);
    assert_eq!(g.pkey_table_size, 0);
    assert_eq!(g.cmdif_checksum, 0);
    assert!(hca.caps().roce_version.is_some() && hca.caps().atomic_operations.is_some());
    let mut d = dev.delay();
    hca.teardown(&mut d).unwrap();
}

#[test]
fn async_eq_is_armed_subscribed_and_drained() {
    let dev = SimDevice::default();
    let mut hca = up(&dev);
    let eqn = hca.eqn().expect("an async EQ");
    let info = dev.eq_info(eqn).unwrap();
    // MLX5_ASYNC_EVENT_MASK; no DCT_DRAINED, as the simulated device reports no `dct` (no DC transport).
    let want = [
        EventType::PathMig,
        EventType::CommEst,
        EventType::SqDrained,
        EventType::CqError,
        EventType::WqCatasError,
        EventType::PathMigFailed,
        EventType::PortChange,
        EventType::WqInvalReqError,
        EventType::WqAccessError,
        EventType::SrqCatasError,
        EventType::SrqLastWqe,
        EventType::SrqRqLimit,
    ]
    .iter()
    .fold(0u64, |m, t| m | (1 << t.raw()));
    assert_eq!(info.event_bitmask, [want, 0, 0, 0], "Linux's async mask for these capabilities");
    // MLX5_NUM_ASYNC_EQE (4096) usable entries plus MLX5_NUM_SPARE_EQE, rounded up.
    assert_eq!(info.nent, 8192);
    assert!(info.armed, "armed after the last drain");
    assert_eq!(info.ci, info.pi, "every EQE consumed");
    assert_eq!(info.overruns, 0);
    // Command completions and the page request went to EQs of their own, and were drained there.
    for (eqn, what) in [(hca.cmd_eqn().unwrap(), "command"), (hca.pages_eqn().unwrap(), "pages")] {
        let i = dev.eq_info(eqn).unwrap();
        assert!(i.pi > 0 && i.ci == i.pi && i.armed, "{what} EQ: {i:?}");
    }
    assert!(hca.events().command > 0 && hca.events().page_request > 0);

    // A port change and a CQ error are counted, and the EQ is armed again after the drain.
    let mut port = [0u8; EQE_DATA_LEN];
    let img = Eqe::emit(&Event::PortChange { port: 1, sub_type: consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN });
    port.copy_from_slice(&img.0[32..32 + EQE_DATA_LEN]);
    assert_eq!(dev.post_event(EventType::PortChange.raw(), consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN, port), Some(eqn));
    let img = Eqe::emit(&Event::CqError { cqn: 0x1a, syndrome: 1 });
    let mut cqe = [0u8; EQE_DATA_LEN];
    cqe.copy_from_slice(&img.0[32..32 + EQE_DATA_LEN]);
    dev.post_event(EventType::CqError.raw(), 0, cqe);
    let mut d = dev.delay();
    hca.process_events(&mut d).unwrap();
    let ev = hca.events();
    assert_eq!(ev.port_change, 1);
    assert_eq!(ev.last_port_change, Some((1, consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN)));
    assert_eq!((ev.cq_error, ev.last_cq_error), (1, Some((0x1a, 1))));
    assert_eq!(hca.get_async_event(), Some(mlx5_core::hca::AsyncEvent::PortErr { port: 1 }));
    let info = dev.eq_info(eqn).unwrap();
    assert!(info.armed && info.ci == info.pi);
    hca.teardown(&mut d).unwrap();
}

#[test]
fn consumer_index_is_published_at_least_every_128_eqes() {
    let dev = SimDevice::default();
    let mut hca = up(&dev);
    let eqn = hca.eqn().unwrap();
    let before = dev.events().len();
    // 300 EQEs land before the driver looks: one drain must publish its progress on the way.
    for i in 0..300u32 {
        let img = Eqe::emit(&Event::CqError { cqn: i, syndrome: 1 });
        let mut data = [0u8; EQE_DATA_LEN];
        data.copy_from_slice(&img.0[32..32 + EQE_DATA_LEN]);
        dev.post_event(EventType::CqError.raw(), 0, data);
    }
    let mut d = dev.delay();
    hca.process_events(&mut d).unwrap();
    let doorbells: Vec<(u32, bool)> = dev.events()[before..]
        .iter()
        .filter_map(|e| match *e {
            SimEvent::EqDoorbell { eqn: n, ci, arm } if n == eqn => Some((ci, arm)),
            _ => None,
        })
        .collect();
    let base = doorbells[0].0 - 128;
    assert_eq!(
        doorbells,
        vec![(base + 128, false), (base + 256, false), (base + 300, true)],
        "updates without arming every MLX5_NUM_SPARE_EQE entries, then one arming update"
    );
    assert_eq!(hca.events().cq_error, 300);
    assert_eq!(dev.eq_info(eqn).unwrap().overruns, 0);
    hca.teardown(&mut d).unwrap();
}

#[test]
fn health_is_quiet_on_a_healthy_device() {
    let dev = SimDevice::default();
    let mut hca = up(&dev);
    let mut d = dev.delay();
    // Four health-timer ticks with the heartbeat moving in between: no failure.
    for _ in 0..4 {
        embedded_hal::delay::DelayNs::delay_ms(&mut d, 2_000);
        hca.poll_health().unwrap();
    }
    assert_eq!(hca.state(), HcaState::Up);
    hca.teardown(&mut d).unwrap();
}

#[test]
fn eq_doorbell_is_ordered_after_the_eqe_loads() {
    use mlx5_sim::testkit::mocks::{BarrierKind, MmioAccess, RecordingMmio};
    let dev = SimDevice::default();
    let rec = RecordingMmio::new(dev.mmio());
    let mut d = dev.delay();
    let hca: Hca<&RecordingMmio<mlx5_sim::SimMmio>, mlx5_sim::SimDma> =
        Hca::bring_up(&rec, dev.dma(), (), &mut d, Config::default()).unwrap();
    let eq_db = hca.uar().unwrap() as usize * 4096 + consts::MLX5_EQ_DOORBELL_OFFSET as usize;
    let log = rec.log();
    let mut seen = 0;
    for (i, a) in log.iter().enumerate() {
        if let MmioAccess::Write32 { off, .. } = *a {
            if off == eq_db || off == eq_db + 8 {
                // The full barrier comes right before every EQ doorbell.
                assert_eq!(log[i - 1], MmioAccess::Barrier(BarrierKind::Mb), "access {i}");
                seen += 1;
            }
        }
    }
    assert!(seen >= 2, "armed after creation and after draining ({seen} doorbells)");
    hca.teardown(&mut d).unwrap();
}

#[test]
fn port_queries_round_trip_through_the_firmware() {
    use mlx5_core::reg::{paos_read, pmtu_read, PortMtu, PortStatus};
    use mlx5_core::vport::{QueryHcaVportContext, QueryNicVportContext, QueryVportState};
    let cfg = SimConfig::default();
    let dev = SimDevice::new(cfg.clone());
    let mut hca = up(&dev);
    let mut d = dev.delay();
    let nic = hca.exec(&mut QueryNicVportContext, &mut d).unwrap();
    assert_eq!((nic.node_guid, nic.system_image_guid, nic.permanent_address), (cfg.node_guid, cfg.node_guid, cfg.mac));
    assert_eq!((nic.mtu, nic.roce_en), (cfg.port_mtu, true));
    assert!(hca.exec(&mut QueryVportState, &mut d).unwrap().is_up());
    let mut data = [0u8; mlx5_core::prm::ifc::pmtu_reg::SIZE_BYTES];
    hca.exec(&mut pmtu_read(1, &mut data), &mut d).unwrap();
    assert_eq!(PortMtu::parse(&data).oper_mtu, cfg.port_mtu);
    let mut data = [0u8; mlx5_core::prm::ifc::paos_reg::SIZE_BYTES];
    hca.exec(&mut paos_read(1, &mut data), &mut d).unwrap();
    assert_eq!(PortStatus::parse(&data).oper_status as u32, consts::MLX5_PORT_UP);
    hca.teardown(&mut d).unwrap();

    // InfiniBand: the HCA vport context carries the port state, LID and GUIDs.
    let cfg = SimConfig { port_type: PortType::Ib, port_up: false, ..SimConfig::default() };
    let dev = SimDevice::new(cfg.clone());
    let mut hca = up(&dev);
    let mut d = dev.delay();
    let h = hca.exec(&mut QueryHcaVportContext { port_num: 1 }, &mut d).unwrap();
    assert_eq!((h.port_state as u32, h.lid, h.node_guid), (consts::IB_PORT_DOWN, 1, cfg.node_guid));
    hca.teardown(&mut d).unwrap();
}

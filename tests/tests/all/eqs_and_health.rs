//! Event queues as Linux 6.12 makes them (`create_async_eqs`, `create_comp_eq`), every async event verbs defines
//! that the simulated device produces reaching `get_async_event` with its object, and health watched on the
//! caller's clock (`Hca::health_tick`), independent of commands.

use embedded_hal::delay::DelayNs;
use mlx5_core::cmdq::CmdError;
use mlx5_core::cq::{CqeFields, Notify, WcStatus, WorkCompletion};
use mlx5_core::eq::{CreateEq, EqContext, Eqe, Event, QpEventKind};
use mlx5_core::hca::{AsyncEvent, Config, CqAttr, Error, Hca, HcaState};
use mlx5_core::health::HealthFailure;
use mlx5_core::init::{CapMode, CapType, QueryHcaCap};
use mlx5_core::prm::{consts, ifc, CmdStatus, EventType, MsgBuf};
use mlx5_core::qp::{required_attrs, PostErrorKind, QpAttr, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr};
use mlx5_sim::testkit::{Node, RcOpts, SimHca};
use mlx5_sim::{syndrome, SimConfig, SimDevice, SimEvent, EQE_DATA_LEN};

fn up_with(dev: &SimDevice, cfg: Config) -> SimHca {
    let mut d = dev.delay();
    Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, cfg).unwrap_or_else(|e| panic!("bring-up: {e}"))
}

/// Entries of an EQ made for `nent` usable ones (`MLX5_NUM_SPARE_EQE` more, rounded up to a power of two).
fn ring(nent: u32) -> u32 {
    (nent + consts::MLX5_NUM_SPARE_EQE).next_power_of_two()
}

fn bit(t: u8) -> u64 {
    1 << t
}

#[test]
fn bring_up_creates_the_command_async_and_pages_eqs_with_linux_sizes_and_masks() {
    let dev = SimDevice::default();
    let mut hca = up_with(&dev, Config::default());
    let (cmd, asy, pages) = (hca.cmd_eqn().unwrap(), hca.eqn().unwrap(), hca.pages_eqn().unwrap());
    assert!(cmd < asy && asy < pages, "created in Linux's order: command, async, pages ({cmd}, {asy}, {pages})");
    let info = |eqn| dev.eq_info(eqn).unwrap();
    assert_eq!(info(cmd).nent, ring(consts::MLX5_NUM_CMD_EQE));
    assert_eq!(info(asy).nent, ring(consts::MLX5_NUM_ASYNC_EQE));
    assert_eq!(info(pages).nent, ring(1));
    assert_eq!(info(cmd).event_bitmask, [bit(consts::MLX5_EVENT_TYPE_CMD), 0, 0, 0]);
    assert_eq!(info(pages).event_bitmask, [bit(consts::MLX5_EVENT_TYPE_PAGE_REQUEST), 0, 0, 0]);

    // The async mask, type by type, from the capabilities the device advertises (gather_async_events_mask).
    let mut d = dev.delay();
    let max = hca.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, &mut d).unwrap();
    let cur = hca.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Current }, &mut d).unwrap();
    use ifc::cmd_hca_cap as g;
    let on = |f| cur.get(f) != 0;
    let eth = cur.get(g::PORT_TYPE) == consts::MLX5_CAP_PORT_TYPE_ETH;
    let mut want = 0u64;
    for t in 0..64u8 {
        let subscribed = match t {
            consts::MLX5_EVENT_TYPE_PATH_MIG
            | consts::MLX5_EVENT_TYPE_COMM_EST
            | consts::MLX5_EVENT_TYPE_SQ_DRAINED
            | consts::MLX5_EVENT_TYPE_CQ_ERROR
            | consts::MLX5_EVENT_TYPE_WQ_CATAS_ERROR
            | consts::MLX5_EVENT_TYPE_PATH_MIG_FAILED
            | consts::MLX5_EVENT_TYPE_WQ_INVAL_REQ_ERROR
            | consts::MLX5_EVENT_TYPE_WQ_ACCESS_ERROR
            | consts::MLX5_EVENT_TYPE_PORT_CHANGE
            | consts::MLX5_EVENT_TYPE_SRQ_CATAS_ERROR
            | consts::MLX5_EVENT_TYPE_SRQ_LAST_WQE
            | consts::MLX5_EVENT_TYPE_SRQ_RQ_LIMIT => true,
            consts::MLX5_EVENT_TYPE_NIC_VPORT_CHANGE => on(g::VPORT_GROUP_MANAGER) && eth,
            consts::MLX5_EVENT_TYPE_GENERAL_EVENT => on(g::GENERAL_NOTIFICATION_EVENT),
            consts::MLX5_EVENT_TYPE_PORT_MODULE_EVENT => on(g::PORT_MODULE_EVENT),
            consts::MLX5_EVENT_TYPE_FPGA_ERROR | consts::MLX5_EVENT_TYPE_FPGA_QP_ERROR => on(g::FPGA),
            consts::MLX5_EVENT_TYPE_DCT_DRAINED => max.get(g::DCT) != 0,
            consts::MLX5_EVENT_TYPE_TEMP_WARN_EVENT => on(g::TEMP_WARN_EVENT),
            consts::MLX5_EVENT_TYPE_MONITOR_COUNTER => on(g::MAX_NUM_OF_MONITOR_COUNTERS),
            consts::MLX5_EVENT_TYPE_VHCA_STATE_CHANGE => max.get(g::VHCA_STATE) != 0,
            _ => false,
        };
        if subscribed {
            want |= bit(t);
        }
    }
    assert_eq!(info(asy).event_bitmask, [want, 0, 0, 0]);
    assert_eq!(hca.async_event_mask(), [want, 0, 0, 0]);
    // Internal errors are not subscribed: Linux learns of them from the health poll.
    assert_eq!(want & bit(consts::MLX5_EVENT_TYPE_INTERNAL_ERROR), 0);
    // No DC transport is modelled (`dct` 0), so DCT_DRAINED is left out as Linux leaves it out then.
    assert_eq!(want & bit(consts::MLX5_EVENT_TYPE_DCT_DRAINED), 0);
    // Completion EQs come with the first CQ of their vector, as `mlx5_comp_eqn_get` makes them.
    assert_eq!((hca.comp_eq(), hca.num_comp_vectors()), (None, 1));
    hca.teardown(&mut d).unwrap();
}

#[test]
fn create_eq_asking_for_an_event_the_caps_do_not_offer_is_bad_param() {
    let dev = SimDevice::default();
    let mut hca = up_with(&dev, Config::default());
    let mut d = dev.delay();
    let buf = mlx5_core::hal::Dma::alloc(&dev.dma(), 4096, 4096).unwrap();
    // The simulated device offers no temperature warnings (`temp_warn_event` 0).
    for t in [consts::MLX5_EVENT_TYPE_TEMP_WARN_EVENT, consts::MLX5_EVENT_TYPE_GPIO_EVENT] {
        let mut cmd = CreateEq {
            uid: 0,
            ctx: EqContext { log_eq_size: 6, uar_page: hca.uar().unwrap(), ..EqContext::default() },
            event_bitmask: [bit(consts::MLX5_EVENT_TYPE_PORT_CHANGE) | bit(t), 0, 0, 0],
            pas: mlx5_core::cmd::Pas::Contiguous { base: buf.iova(), count: 1 },
        };
        match hca.exec(&mut cmd, &mut d) {
            Err(Error::Cmd(CmdError::Status { status, syndrome: s, .. })) => {
                assert_eq!((status, s), (CmdStatus::BadParam, syndrome::EQ_EVENT_TYPE), "type {t}");
            }
            r => panic!("type {t}: {r:?}"),
        }
    }
    // A type in a word beyond the first is refused the same way.
    let mut cmd = CreateEq {
        uid: 0,
        ctx: EqContext { log_eq_size: 6, uar_page: hca.uar().unwrap(), ..EqContext::default() },
        event_bitmask: [0, 1, 0, 0],
        pas: mlx5_core::cmd::Pas::Contiguous { base: buf.iova(), count: 1 },
    };
    assert!(matches!(
        hca.exec(&mut cmd, &mut d),
        Err(Error::Cmd(CmdError::Status { status: CmdStatus::BadParam, syndrome: syndrome::EQ_EVENT_TYPE, .. }))
    ));
    // SAFETY: every CREATE_EQ over the buffer was refused, so the device never used it.
    unsafe { mlx5_core::hal::Dma::free(&dev.dma(), buf) };
    hca.teardown(&mut d).unwrap();
}

#[test]
fn a_cq_on_vector_1_raises_its_completion_event_on_the_eq_of_vector_1() {
    let dev = SimDevice::default();
    let mut hca = up_with(&dev, Config { num_comp_vectors: 2, ..Config::default() });
    let mut d = dev.delay();
    assert_eq!(hca.num_comp_vectors(), 2);
    let cq0 = hca.create_cq(CqAttr { cqe: 7, ..CqAttr::default() }, &mut d).unwrap();
    let cq1 = hca.create_cq(CqAttr { cqe: 7, comp_vector: 1, ..CqAttr::default() }, &mut d).unwrap();
    let (eq0, eq1) = (hca.comp_eqn_of(0).unwrap(), hca.comp_eqn_of(1).unwrap());
    let pages_eq = hca.pages_eqn().unwrap();
    assert_ne!(eq0, eq1);
    assert_eq!((dev.cq_info(cq0.cqn()).unwrap().eqn, dev.cq_info(cq1.cqn()).unwrap().eqn), (eq0, eq1));
    let info = dev.eq_info(eq1).unwrap();
    assert_eq!((info.nent, info.event_bitmask), (ring(consts::MLX5_COMP_EQ_SIZE), [0; 4]));
    // Only vectors on offer.
    let e = hca.create_cq(CqAttr { cqe: 7, comp_vector: 2, ..CqAttr::default() }, &mut d).unwrap_err();
    assert!(matches!(e, Error::BadSize { what: "completion vector", requested: 2, max: 1 }), "{e:?}");

    hca.req_notify_cq(&cq1, Notify::NextComp).unwrap();
    let cqe = CqeFields {
        opcode: consts::MLX5_CQE_REQ,
        wqe_opcode: consts::MLX5_OPCODE_SEND,
        qpn: 0x42,
        ..CqeFields::default()
    };
    let before = dev.events().len();
    dev.post_cqe(cq1.cqn(), cqe.emit().0).unwrap();
    let fired: Vec<SimEvent> =
        dev.events()[before..].iter().copied().filter(|e| matches!(e, SimEvent::CompletionEvent { .. })).collect();
    assert_eq!(fired, vec![SimEvent::CompletionEvent { cqn: cq1.cqn(), eqn: eq1 }]);
    assert_eq!(dev.eq_info(eq1).unwrap().pi, 1);
    assert_eq!(dev.eq_info(eq0).unwrap().pi, 0, "nothing on vector 0's EQ");
    // get_cq_event drains every completion EQ.
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), Some(cq1.cqn()));
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), None);
    hca.ack_cq_events(&cq1, 1).unwrap();
    hca.destroy_cq(cq0, &mut d).unwrap();
    hca.destroy_cq(cq1, &mut d).unwrap();
    let n = dev.executed().len();
    hca.teardown(&mut d).unwrap();
    // mlx5_eq_table_destroy: both completion EQs, then pages, async and command EQ.
    let destroyed = dev.executed()[n..].iter().filter(|c| c.opcode == consts::MLX5_CMD_OP_DESTROY_EQ).count();
    assert_eq!(destroyed, 5);
    assert!([eq0, eq1, pages_eq].iter().all(|&e| dev.eq_info(e).is_none()), "every EQ destroyed");
}

#[test]
fn completion_eqs_interrupt_after_the_control_vector_when_the_host_has_more_than_one() {
    for (num_irqs, want) in [(1u16, [0u16, 0, 0]), (3, [1, 2, 1])] {
        let dev = SimDevice::default();
        let mut hca = up_with(&dev, Config { num_comp_vectors: 3, num_irqs, ..Config::default() });
        let mut d = dev.delay();
        for eqn in [hca.cmd_eqn().unwrap(), hca.eqn().unwrap(), hca.pages_eqn().unwrap()] {
            assert_eq!(dev.eq_info(eqn).unwrap().intr, 0, "control EQs share vector 0");
        }
        let mut cqs = Vec::new();
        for v in 0..3u16 {
            cqs.push(hca.create_cq(CqAttr { cqe: 1, comp_vector: v, ..CqAttr::default() }, &mut d).unwrap());
        }
        let got: Vec<u16> = (0..3).map(|v| dev.eq_info(hca.comp_eqn_of(v).unwrap()).unwrap().intr).collect();
        assert_eq!(got, want, "{num_irqs} vectors");
        for cq in cqs {
            hca.destroy_cq(cq, &mut d).unwrap();
        }
        hca.teardown(&mut d).unwrap();
    }
}

#[test]
fn completion_vectors_are_capped_by_the_eqs_the_device_allows() {
    // A device of 16 EQs (a ConnectX-4 or the default simulated device has 256, more than the core's 32 vectors).
    let object_limits = mlx5_sim::ObjectLimits { log_max_eq: 4, ..Default::default() };
    let dev = SimDevice::new(mlx5_sim::SimConfig { object_limits, ..Default::default() });
    let mut hca = up_with(&dev, Config { num_comp_vectors: 100, ..Config::default() });
    let mut d = dev.delay();
    let max = hca.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Current }, &mut d).unwrap();
    let log_max_eq = max.get(ifc::cmd_hca_cap::LOG_MAX_EQ);
    // `get_num_eqs`: 1 << log_max_eq less the three async EQs (the simulated device reports no max_num_eqs).
    assert_eq!(u32::from(hca.num_comp_vectors()), (1 << log_max_eq) - 3);
    hca.teardown(&mut d).unwrap();
    let dev = SimDevice::default();
    let hca = up_with(&dev, Config { num_comp_vectors: 100, ..Config::default() });
    assert_eq!(usize::from(hca.num_comp_vectors()), mlx5_core::hca::MAX_COMP_VECTORS, "the core's own bound");
    hca.teardown(&mut dev.delay()).unwrap();
    let dev = SimDevice::default();
    let hca = up_with(&dev, Config { num_comp_vectors: 0, ..Config::default() });
    assert_eq!(hca.num_comp_vectors(), 1, "at least one vector");
    hca.teardown(&mut dev.delay()).unwrap();
}

/// The next async event after draining the EQs.
fn next_event(n: &mut Node) -> Option<AsyncEvent> {
    n.hca.process_events(&mut n.d).unwrap();
    n.hca.get_async_event()
}

#[test]
fn port_changes_reach_get_async_event_as_their_verbs_events() {
    let mut n = Node::new(SimConfig::default(), 4096);
    let asy = n.hca.eqn();
    assert_eq!(n.dev.set_port_up(false), asy);
    assert_eq!(next_event(&mut n), Some(AsyncEvent::PortErr { port: 1 }));
    // The port state the queries report followed the link.
    assert_eq!(n.hca.query_port(&mut n.d).unwrap().state, consts::IB_PORT_DOWN as u8);
    assert_eq!(n.dev.set_port_up(false), None, "no change, no event");
    assert_eq!(n.dev.set_port_up(true), asy);
    assert_eq!(next_event(&mut n), Some(AsyncEvent::PortActive { port: 1 }));
    assert_eq!(n.hca.query_port(&mut n.d).unwrap().state, consts::IB_PORT_ACTIVE as u8);
    for (sub, want) in [
        (consts::MLX5_PORT_CHANGE_SUBTYPE_LID, AsyncEvent::LidChange { port: 1 }),
        (consts::MLX5_PORT_CHANGE_SUBTYPE_PKEY, AsyncEvent::PkeyChange { port: 1 }),
        (consts::MLX5_PORT_CHANGE_SUBTYPE_GUID, AsyncEvent::GidChange { port: 1 }),
        (consts::MLX5_PORT_CHANGE_SUBTYPE_CLIENT_REREG, AsyncEvent::ClientReregister { port: 1 }),
        (consts::MLX5_PORT_CHANGE_SUBTYPE_INITIALIZED, AsyncEvent::PortErr { port: 1 }),
    ] {
        assert_eq!(n.dev.port_change(sub), asy);
        assert_eq!(next_event(&mut n), Some(want), "sub-type {sub}");
    }
    assert_eq!(next_event(&mut n), None);
    assert_eq!(n.hca.events().port_change, 7);
    n.finish();
}

fn recv(wr_id: u64, sge: &[mlx5_core::qp::Sge]) -> RecvWr<'_> {
    RecvWr { wr_id, sg_list: sge }
}

fn send(wr_id: u64, sge: &[mlx5_core::qp::Sge]) -> SendWr<'_> {
    SendWr { wr_id, op: SendOp::Send, sg_list: sge, flags: SendFlags::SIGNALED, inline: None, ud: None }
}

const CAP: QpCap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };

#[test]
fn the_first_packet_to_an_rc_qp_in_rtr_raises_comm_est_once() {
    let mut n = Node::new(SimConfig::default(), 4096);
    let mut cq = n.cq(31);
    let mut a = n.qp(QpType::Rc, &cq, CAP, false);
    let mut b = n.qp(QpType::Rc, &cq, CAP, false);
    let ah = n.ah_attr();
    let o = RcOpts::default();
    n.connect_rc(&mut a, b.qpn(), ah, &o);
    // b only to RTR: it receives but does not send yet.
    let attr = QpAttr {
        qp_access_flags: o.access,
        path_mtu: o.path_mtu,
        dest_qp_num: a.qpn(),
        ah_attr: ah,
        min_rnr_timer: o.min_rnr_timer,
        max_dest_rd_atomic: o.rd_atomic,
        ..QpAttr::default()
    };
    for (f, t) in [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr)] {
        let m = required_attrs(QpType::Rc, f, t).unwrap();
        n.hca.modify_qp(&mut b, &QpAttr { qp_state: t, ..attr }, m, &mut n.d).unwrap();
    }
    assert_eq!(next_event(&mut n), None, "nothing before a packet arrives");
    let buf = [n.sge(0, 64)];
    n.hca.post_recv(&mut b, &[recv(1, &buf), recv(2, &buf)]).unwrap();
    n.hca.post_send(&mut a, &[send(0xa1, &buf)]).unwrap();
    assert_eq!(next_event(&mut n), Some(AsyncEvent::CommEst { qpn: b.qpn() }));
    n.hca.post_send(&mut a, &[send(0xa2, &buf)]).unwrap();
    assert_eq!(next_event(&mut n), None, "once per RTR");
    // Both messages arrived: two receive and two send completions, all successful.
    let mut wc = [WorkCompletion::default(); 8];
    let k = n.hca.poll_cq(&mut cq, &mut [&mut a, &mut b][..], &mut wc).unwrap();
    assert_eq!(k, 4);
    assert!(wc[..k].iter().all(|w| w.status == WcStatus::Success), "{:?}", &wc[..k]);
    n.hca.destroy_qp(a, &mut n.d).unwrap();
    n.hca.destroy_qp(b, &mut n.d).unwrap();
    n.hca.destroy_cq(cq, &mut n.d).unwrap();
    n.finish();
}

#[test]
fn affiliated_qp_events_name_their_qp() {
    // The simulated device has no alternate paths and no SQD state, so these are posted as firmware would post
    // them; COMM_EST, port changes and QP errors are produced by the device itself (tests above, flush tests).
    let mut n = Node::new(SimConfig::default(), 4096);
    let asy = n.hca.eqn();
    for (kind, want) in [
        (QpEventKind::PathMigrated, AsyncEvent::PathMig { qpn: 0x11 }),
        (QpEventKind::SqDrained, AsyncEvent::SqDrained { qpn: 0x11 }),
        (QpEventKind::PathMigFailed, AsyncEvent::PathMigErr { qpn: 0x11 }),
        (QpEventKind::CommEst, AsyncEvent::CommEst { qpn: 0x11 }),
    ] {
        let img = Eqe::emit(&Event::QpEvent { qpn: 0x11, kind });
        let mut data = [0u8; EQE_DATA_LEN];
        data.copy_from_slice(&img.0[32..32 + EQE_DATA_LEN]);
        assert_eq!(n.dev.post_event(kind.event_type().raw(), 0, data), asy, "{kind:?} goes to the async EQ");
        assert_eq!(next_event(&mut n), Some(want));
    }
    assert_eq!(n.hca.events().qp_event, 4);
    // An event of a type no EQ subscribes to is dropped by the device.
    assert_eq!(n.dev.post_event(EventType::InternalError.raw(), 0, [0; EQE_DATA_LEN]), None);
    n.finish();
}

/// Moves device time and the caller's clock together by `ms`, then ticks.
fn tick_after(n: &mut Node, now: &mut u64, ms: u32) -> Result<(), Error> {
    n.d.delay_ms(ms);
    *now += u64::from(ms);
    n.hca.health_tick(*now)
}

#[test]
fn a_fatal_syndrome_is_device_fatal_within_one_tick_after_two_seconds() {
    let mut n = Node::new(SimConfig::default(), 4096);
    let mut now = 0u64;
    tick_after(&mut n, &mut now, 2_000).unwrap();
    let synd = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR;
    n.dev.fail_health(synd);
    // Not due yet: nothing is read, nothing changes.
    tick_after(&mut n, &mut now, 1_999).unwrap();
    assert_eq!((n.hca.state(), n.hca.get_async_event()), (HcaState::Up, None));
    let e = tick_after(&mut n, &mut now, 1).unwrap_err();
    assert!(matches!(e, Error::Health(HealthFailure::Syndrome { .. })), "{e:?}");
    assert!(matches!(n.hca.state(), HcaState::InternalError(HealthFailure::Syndrome { .. })));
    assert_eq!(n.hca.get_async_event(), Some(AsyncEvent::DeviceFatal));
    // Once: later ticks report the failure again but queue nothing more.
    assert!(tick_after(&mut n, &mut now, 2_000).is_err());
    assert_eq!(n.hca.get_async_event(), None);
    n.finish();
}

#[test]
fn a_stalled_heartbeat_is_fatal_after_three_missed_beats_not_before() {
    let mut n = Node::new(SimConfig::default(), 4096);
    let mut now = 0u64;
    // Healthy ticks: the heartbeat moves between them.
    for _ in 0..3 {
        tick_after(&mut n, &mut now, 2_000).unwrap();
    }
    n.dev.stall_health();
    for miss in 1..3 {
        tick_after(&mut n, &mut now, 2_000).unwrap_or_else(|e| panic!("miss {miss} is not fatal yet: {e}"));
        assert_eq!(n.hca.state(), HcaState::Up);
        assert_eq!(n.hca.get_async_event(), None);
    }
    let e = tick_after(&mut n, &mut now, 2_000).unwrap_err();
    assert!(matches!(e, Error::Health(HealthFailure::Stalled { misses: 3, .. })), "{e:?}");
    assert_eq!(n.hca.get_async_event(), Some(AsyncEvent::DeviceFatal));
    n.finish();
}

#[test]
fn after_death_posts_fail_with_the_device_error_and_outstanding_wrs_flush() {
    let mut n = Node::new(SimConfig::default(), 4096);
    let (mut cq, mut a, mut b) = n.rc_pair(CAP, 31, &RcOpts::default());
    let buf = [n.sge(0, 64)];
    n.hca.post_recv(&mut b, &[recv(0xb1, &buf), recv(0xb2, &buf)]).unwrap();
    n.dev.device_gone();
    let mut now = 0u64;
    assert!(matches!(tick_after(&mut n, &mut now, 2_000), Err(Error::Health(HealthFailure::DeviceGone))));
    assert_eq!(n.hca.get_async_event(), Some(AsyncEvent::DeviceFatal));
    let e = n.hca.post_send(&mut a, &[send(0xa1, &buf)]).unwrap_err();
    assert_eq!((e.index, e.kind), (0, PostErrorKind::DeviceError));
    let e = n.hca.post_recv(&mut b, &[recv(0xb3, &buf)]).unwrap_err();
    assert_eq!((e.index, e.kind), (0, PostErrorKind::DeviceError));
    let mut wc = [WorkCompletion::default(); 8];
    let k = n.hca.poll_cq(&mut cq, &mut [&mut a, &mut b][..], &mut wc).unwrap();
    let got: Vec<(u64, WcStatus)> = wc[..k].iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, vec![(0xb1, WcStatus::WrFlushErr), (0xb2, WcStatus::WrFlushErr)]);
    assert_eq!(n.hca.poll_cq(&mut cq, &mut [&mut a, &mut b][..], &mut wc).unwrap(), 0, "nothing twice");
    n.drop_pair(cq, a, b);
    n.finish();
}

#[test]
fn the_health_tick_reads_no_register_until_it_is_due() {
    use mlx5_sim::testkit::mocks::{MmioAccess, RecordingMmio};
    let dev = SimDevice::default();
    let rec = RecordingMmio::new(dev.mmio());
    let mut d = dev.delay();
    let mut hca: Hca<&RecordingMmio<mlx5_sim::SimMmio>, mlx5_sim::SimDma> =
        Hca::bring_up(&rec, dev.dma(), (), &mut d, Config::default()).unwrap();
    hca.health_tick(2_000).unwrap();
    rec.clear();
    for now in [2_001, 2_500, 3_999] {
        hca.health_tick(now).unwrap();
    }
    assert!(rec.log().is_empty(), "not due: no MMIO at all ({:?})", rec.log());
    d.delay_ms(2_000);
    hca.health_tick(4_000).unwrap();
    let reads = rec.log().iter().filter(|a| matches!(a, MmioAccess::Read32 { .. })).count();
    assert!(reads > 0, "due: the health buffer and counter are read");
    hca.teardown(&mut d).unwrap();
}

#[test]
fn a_tcp_peer_going_away_is_port_err_and_coming_back_is_port_active() {
    use std::time::{Duration, Instant};
    let cfg = SimConfig::default();
    let mut n = Node::new(cfg.clone(), 4096);
    let at = n.dev.wire_listen("127.0.0.1:0").unwrap().to_string();
    let wait = Duration::from_secs(20);
    // Polls the EQs until an async event arrives (the link's reader runs on its own thread).
    let until_event = |n: &mut Node| {
        let end = Instant::now() + wait;
        loop {
            if let Some(e) = next_event(n) {
                return e;
            }
            assert!(Instant::now() < end, "no async event");
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let peer = SimDevice::new(cfg.next_host());
    peer.wire_connect(&at, wait).unwrap();
    assert!(n.dev.wire_wait_peer(wait));
    // The port was already up: plugging in changes nothing.
    assert_eq!(next_event(&mut n), None);
    drop(peer);
    assert_eq!(until_event(&mut n), AsyncEvent::PortErr { port: 1 });
    let peer = SimDevice::new(cfg.next_host());
    peer.wire_connect(&at, wait).unwrap();
    assert_eq!(until_event(&mut n), AsyncEvent::PortActive { port: 1 });
    drop(peer);
    assert_eq!(until_event(&mut n), AsyncEvent::PortErr { port: 1 });
    n.finish();
}

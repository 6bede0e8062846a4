//! Regressions found by the fuzz targets in `fuzz/` (see FUZZING.md): each test feeds the input that failed, in
//! the form the core sees it, and checks the property the target asserted.

use mlx5_core::cq::CqeSize;
use mlx5_core::cq::LinkLayer;
use mlx5_core::eq::{Eqe, Event};
use mlx5_core::hca::CqAttr;
use mlx5_core::hca::{Config, Hca};
use mlx5_core::hca::{Pd, QpInitAttr};
use mlx5_core::prm::{c, EventType};
use mlx5_core::qp::{
    qp_sizes, Ah, AhAttr, Grh, PostError, PostErrorKind, Qp, QpAttr, QpAttrMask as M, QpCap, QpState, QpType,
};
use mlx5_core::qp::{SendFlags, SendOp, SendWr, UdDest};
use mlx5_sim::testkit::SimHca;
use mlx5_sim::{SimConfig, SimDevice};

/// `eqe` target (`hca_events`, artifact `leak-92dbcd25…`): a page-request EQE for a function firmware then refuses
/// pages for arrived just before a DESTROY_CQ. The command completed, but the events served right after it failed
/// (MANAGE_PAGES answered BAD_PARAM) and `Hca::exec` returned that failure as DESTROY_CQ's own: `destroy_cq`
/// handed the CQ back as not destroyed while firmware had destroyed it, and its ring leaked. A command that
/// completed is reported as completed.
#[test]
fn refused_page_request_does_not_fail_the_command_that_completed() {
    let dev = SimDevice::new(SimConfig::default());
    let mut d = dev.delay();
    let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let cq = hca
        .create_cq(CqAttr { cqe: 15, cqe_size: CqeSize::B64, overrun_ignore: false, comp_vector: 0 }, &mut d)
        .unwrap();
    // Firmware asks pages for function 0x4858 (the fuzz input's bytes), then refuses them (BAD_FUNCTION).
    let e = Eqe::emit(&Event::PageRequest { function_id: 0x4858, ec_function: false, num_pages: 0x2cf5 });
    let mut data = [0u8; mlx5_sim::EQE_DATA_LEN];
    data.copy_from_slice(&e.0[c::mlx5_eqe::DATA.off..c::mlx5_eqe::DATA.end()]);
    assert!(dev.post_event(EventType::PageRequest.raw(), 0, data).is_some());
    let before = dev.object_counts();
    hca.destroy_cq(cq, &mut d).map_err(|e| e.error).expect("DESTROY_CQ completed, so destroy_cq succeeds");
    assert_ne!(dev.object_counts(), before, "firmware destroyed the CQ");
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0), "every DMA allocation returned");
}

/// `wqe_build` target (artifact `crash-7d157d7c…`, input `41 0a`): a UD QP asking for no send SGEs and no inline
/// data. Its WQE is exactly the control and datagram segments (64 bytes, one BB), so no inline header fits, and the
/// granted `max_inline_data` was computed as `64 - 64 - 4`: a subtraction overflow (a panic in debug builds, about
/// 4 GiB of "allowed" inline data in release builds, which `post_send` would then have copied around the ring).
#[test]
fn ud_qp_without_sges_or_inline_grants_no_inline_data() {
    let cap = QpCap { max_send_wr: 10, max_recv_wr: 1, max_send_sge: 0, max_recv_sge: 1, max_inline_data: 0 };
    let s = qp_sizes(QpType::Ud, &cap, 512, 512, 16).unwrap();
    assert_eq!(s.sq_wqe_size, 64);
    assert_eq!((s.cap.max_send_sge, s.cap.max_inline_data), (0, 0));
    // Whatever is granted fits the WQE: control + datagram + inline header + data.
    for ty in [QpType::Ud, QpType::Rc] {
        for sge in 0..4 {
            for inline in [0, 1, 12, 13, 60, 200] {
                let cap = QpCap { max_send_sge: sge, max_inline_data: inline, ..cap };
                let s = qp_sizes(ty, &cap, 1024, 1024, 16).unwrap();
                assert!(s.cap.max_inline_data >= inline && s.cap.max_send_sge >= sge, "{ty:?} {cap:?}: {s:?}");
                let overhead = if ty == QpType::Ud { 64 } else { 48 };
                if s.cap.max_inline_data > 0 {
                    assert!(overhead + 4 + s.cap.max_inline_data <= s.sq_wqe_size, "{ty:?} {cap:?}: {s:?}");
                }
                assert!(overhead + 16 * s.cap.max_send_sge <= s.sq_wqe_size, "{ty:?} {cap:?}: {s:?}");
            }
        }
    }

    // End to end: such a QP on the simulator, ready to send, refuses inline data instead of building a WQE larger
    // than its queue's.
    let mut u = UdQp::new(cap);
    assert_eq!((u.qp.cap().max_inline_data, u.qp.sizes().sq_wqe_size), (0, 64));
    let data = [0u8; 100];
    let r = u.send_inline(&data);
    assert_eq!(r, Err(PostError { index: 0, kind: PostErrorKind::InlineTooLong { bytes: 100, max: 0 } }));
    assert_eq!((u.qp.sq_outstanding(), u.qp.sq_cur_post()), (0, 0), "nothing posted");
    u.finish();
}

/// `wqe_build` target (artifact `crash-b0f5e98a…`, input `f7 00 00 00 00 00 00 af 00 00 0a 0a 00 00 00 00 2e`): an
/// empty inline list on that same 64-byte-WQE UD QP. The driver wrote an inline segment header for no data, making an
/// 80-byte (two-BB) WQE in a queue sized for one BB per WQE, so `max_send_wr` such requests could overrun the
/// ring. Linux (`set_data_inl_seg`) and rdma-core write no segment for no inline data; neither does the driver now.
#[test]
fn empty_inline_data_adds_no_segment() {
    let cap = QpCap { max_send_wr: 10, max_recv_wr: 1, max_send_sge: 0, max_recv_sge: 1, max_inline_data: 0 };
    let mut u = UdQp::new(cap);
    u.send_inline(&[]).unwrap();
    assert_eq!((u.qp.sq_outstanding(), u.qp.sq_cur_post()), (1, 1), "one WQE of one BB");
    let mut ctrl = [0u8; 16];
    u.qp.read_sq(0, &mut ctrl);
    assert_eq!(ctrl[7] & 0x3f, 4, "control + datagram segments: 4 x 16 bytes");
    u.finish();
}

/// A UD QP of the simulated device in RTS, with an address handle to itself.
struct UdQp {
    dev: SimDevice,
    d: mlx5_sim::SimDelay,
    hca: SimHca,
    pd: Pd,
    cq: mlx5_core::cq::Cq,
    qp: Qp,
    ah: Ah,
}

impl UdQp {
    fn new(cap: QpCap) -> Self {
        let dev = SimDevice::new(SimConfig::default());
        let mut d = dev.delay();
        let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
        let pd = hca.alloc_pd(&mut d).unwrap();
        let cq = hca
            .create_cq(CqAttr { cqe: 15, cqe_size: CqeSize::B64, overrun_ignore: false, comp_vector: 0 }, &mut d)
            .unwrap();
        let attr = QpInitAttr { qp_type: QpType::Ud, cap, sq_sig_all: false };
        let mut qp = hca.create_qp(&pd, &cq, &cq, attr, &mut d).unwrap();
        let a = QpAttr { qkey: 0x1111, ..QpAttr::default() };
        for (s, m) in [
            (QpState::Init, M::STATE | M::PKEY_INDEX | M::PORT | M::QKEY),
            (QpState::Rtr, M::STATE),
            (QpState::Rts, M::STATE | M::SQ_PSN),
        ] {
            hca.modify_qp(&mut qp, &QpAttr { qp_state: s, ..a }, m, &mut d).unwrap();
        }
        let gid = hca.query_gid(0, &mut d).unwrap();
        let ah_attr = AhAttr {
            grh: Some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
            dmac: dev.config().mac,
            port_num: 1,
            ..AhAttr::default()
        };
        let ah = Ah::new(&ah_attr, LinkLayer::Ethernet);
        UdQp { dev, d, hca, pd, cq, qp, ah }
    }

    fn send_inline(&mut self, data: &[u8]) -> Result<(), PostError> {
        let wr = SendWr {
            wr_id: 1,
            op: SendOp::Send,
            sg_list: &[],
            flags: SendFlags::SIGNALED,
            inline: Some(data),
            ud: Some(UdDest { ah: &self.ah, remote_qpn: self.qp.qpn(), remote_qkey: 0x1111 }),
        };
        self.hca.post_send(&mut self.qp, &[wr])
    }

    fn finish(mut self) {
        let d = &mut self.d;
        self.hca.destroy_qp(self.qp, d).map_err(|e| e.error).unwrap();
        self.hca.destroy_cq(self.cq, d).map_err(|e| e.error).unwrap();
        self.hca.dealloc_pd(self.pd, d).map_err(|e| e.error).unwrap();
        self.hca.teardown(d).unwrap();
        assert_eq!(self.dev.dma_outstanding(), (0, 0));
    }
}

/// The waiting side of the first regression (found by reading the path the `eqe` crash went through): firmware
/// holds a CREATE_CQ until it gets pages, asks for them, then refuses the MANAGE_PAGES that brings them. The
/// refusal used to end the CREATE_CQ's wait as a `Status` error of MANAGE_PAGES, which `create_cq` takes for
/// firmware's refusal of the CREATE and so freed the CQ buffer while the CREATE was still with firmware. The wait
/// goes on now: CREATE_CQ times out (its slot stays taken) and the buffer is kept until the function is disabled.
#[test]
fn refused_page_give_does_not_end_a_waiting_create() {
    use mlx5_core::cmdq::CmdError;
    use mlx5_core::hca::Error;
    use mlx5_core::prm::{consts, Opcode};
    use mlx5_sim::{Fault, SimEvent};
    let dev = SimDevice::new(SimConfig::default());
    let mut d = dev.delay();
    let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    dev.inject(Fault::NeedPages { opcode: consts::MLX5_CMD_OP_CREATE_CQ, pages: 4 });
    let mp = consts::MLX5_CMD_OP_MANAGE_PAGES;
    dev.inject(Fault::Status { opcode: mp, status: 0x03, syndrome: 0x1234, times: 1 });
    let r = hca.create_cq(CqAttr { cqe: 15, cqe_size: CqeSize::B64, overrun_ignore: false, comp_vector: 0 }, &mut d);
    match r {
        Err(Error::Cmd(CmdError::Timeout { opcode: Opcode::CreateCq, .. })) => {}
        other => panic!("CREATE_CQ must keep waiting past the refused give, got {:?}", other.map(|c| c.cqn())),
    }
    let freed_under_device =
        dev.events().into_iter().any(|e| matches!(e, SimEvent::FreedDeviceOwned { .. } | SimEvent::BadFree { .. }));
    assert!(!freed_under_device, "no memory freed under the device");
    let _ = hca.teardown(&mut d);
    assert_eq!(dev.dma_outstanding(), (0, 0), "the kept buffer is freed once the function is disabled");
}

/// `eqe` target (`image`, artifact `crash-b2cfbe53…`): a WQ_INVAL_REQ_ERROR EQE for a queue that is not a QP
/// decodes as `Event::Other`, but `Eqe::emit` of that `Other` left the queue-type byte zero, which names a QP, so the
/// image it made decoded as `QpError`: emit and decode disagreed. Emit now names a non-QP queue for such an `Other`.
#[test]
fn an_other_queue_error_event_emits_as_other() {
    for ty in [EventType::WqCatasError, EventType::WqInvalReqError, EventType::WqAccessError] {
        let mut img = [0u8; 64];
        img[c::mlx5_eqe::TYPE.off] = ty.raw();
        img[c::mlx5_eqe::SUB_TYPE.off] = 0x10;
        // The queue is an RQ (type 1), not a QP.
        img[c::mlx5_eqe::DATA.off + c::mlx5_eqe_qp_srq::TYPE.off] = 1;
        let ev = Eqe(img).event();
        assert_eq!(ev, Event::Other { event_type: ty.raw(), sub_type: 0x10 });
        assert_eq!(Eqe::emit(&ev).event(), ev);
        // A QP's error still round-trips as itself.
        img[c::mlx5_eqe::DATA.off + c::mlx5_eqe_qp_srq::TYPE.off] = 0;
        let qp = Eqe(img).event();
        assert!(matches!(qp, Event::QpError { .. }), "{qp:?}");
        assert_eq!(Eqe::emit(&qp).event(), qp);
    }
}

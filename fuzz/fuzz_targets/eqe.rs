//! EQEs as the device writes them: `Eqe::event` on arbitrary images, `EqRing` over a ring a device fills either
//! correctly or with arbitrary bytes anywhere, and (when the input asks for it) the HCA's own EQ consumer
//! (`Hca::process_events`) over arbitrary async events posted by the simulated device.
//!
//! Asserted: no panic; a decoded event agrees with the bytes (type, sub-type, 24-bit CQ numbers, 4-bit port) and
//! `Eqe::emit` of it decodes back to the same event; the ring hands out an entry only when its owner bit matches
//! the pass, exactly as the device wrote it, one consumer-index step per entry; every EQ doorbell is one 32-bit
//! write of `ci & 0xffffff | eqn << 24` at UAR + 0x40 (arm) or + 0x48, and a drain never runs 128 entries
//! without one; a well-behaved device's EQEs come back exactly once, in order. On the HCA: events are typed,
//! completion events name only CQs that exist, and teardown still returns every page and every DMA allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_core::cq::{CqeFields, Notify};
use mlx5_core::eq::{eq_doorbell_value, EqError, EqRing, Eqe, Event, EQE_SIZE};
use mlx5_core::hal::Dma;
use mlx5_core::hca::{AsyncEvent, CqAttr};
use mlx5_core::hca::{Config, Hca};
use mlx5_core::prm::{c, consts, EventType};
use mlx5_fuzz::{bytes, flag, int, HeapDma, RegFile, Unstructured, Write, UAR_OFF};
use mlx5_sim::{SimConfig, SimDevice, EQE_DATA_LEN};

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let images = int(&mut u, 0u8..=3);
    for _ in 0..images {
        image(&Eqe(bytes::<EQE_SIZE>(&mut u)));
    }
    if flag(&mut u) {
        hca_events(&mut u);
    } else {
        ring(&mut u);
    }
});

/// One image: the decoded event agrees with its bytes and survives a round trip through `emit`.
fn image(e: &Eqe) {
    let ty = e.0[c::mlx5_eqe::TYPE.off];
    let sub = e.0[c::mlx5_eqe::SUB_TYPE.off];
    let ev = e.event();
    assert_eq!(e.event_type().raw(), ty);
    let want_type = match ev {
        Event::Completion { cqn } => {
            assert!(cqn <= 0xff_ffff);
            EventType::Comp
        }
        Event::Command { .. } => EventType::Cmd,
        Event::PageRequest { .. } => EventType::PageRequest,
        Event::CqError { cqn, .. } => {
            assert!(cqn <= 0xff_ffff);
            EventType::CqError
        }
        Event::PortChange { port, sub_type } => {
            assert!(port <= 0xf);
            assert_eq!(sub_type, sub);
            EventType::PortChange
        }
        Event::InternalError => EventType::InternalError,
        Event::QpError { qpn, kind } => {
            assert!(qpn <= 0xff_ffff);
            assert_eq!(e.0[c::mlx5_eqe::DATA.off + c::mlx5_eqe_qp_srq::TYPE.off], consts::MLX5_EVENT_QUEUE_TYPE_QP);
            kind.event_type()
        }
        Event::QpEvent { qpn, kind } => {
            assert!(qpn <= 0xff_ffff);
            assert_eq!(e.0[c::mlx5_eqe::DATA.off + c::mlx5_eqe_qp_srq::TYPE.off], consts::MLX5_EVENT_QUEUE_TYPE_QP);
            kind.event_type()
        }
        Event::SrqLimit { srqn } => {
            assert!(srqn <= 0xff_ffff);
            EventType::SrqRqLimit
        }
        Event::SrqLastWqe { qpn } => {
            assert!(qpn <= 0xff_ffff);
            assert_eq!(e.0[c::mlx5_eqe::DATA.off + c::mlx5_eqe_qp_srq::TYPE.off], consts::MLX5_EVENT_QUEUE_TYPE_QP);
            EventType::SrqLastWqe
        }
        Event::Other { event_type, sub_type } => {
            assert_eq!((event_type, sub_type), (ty, sub));
            let handled = [
                EventType::Comp,
                EventType::Cmd,
                EventType::PageRequest,
                EventType::CqError,
                EventType::PortChange,
                EventType::InternalError,
                EventType::SrqRqLimit,
            ];
            assert!(!handled.iter().any(|t| t.raw() == ty), "type {ty:#x} left undecoded");
            // QP events of other queue types (RQ, SQ, DCT) name objects the driver never creates.
            let qp_events = [
                EventType::WqCatasError,
                EventType::WqInvalReqError,
                EventType::WqAccessError,
                EventType::PathMig,
                EventType::CommEst,
                EventType::SqDrained,
                EventType::PathMigFailed,
                EventType::SrqLastWqe,
            ];
            if qp_events.iter().any(|t| t.raw() == ty) {
                let queue_type = e.0[c::mlx5_eqe::DATA.off + c::mlx5_eqe_qp_srq::TYPE.off];
                assert_ne!(queue_type, consts::MLX5_EVENT_QUEUE_TYPE_QP, "a QP error left undecoded");
            }
            EventType::from_raw(ty)
        }
    };
    assert_eq!(want_type.raw(), ty);
    let back = Eqe::emit(&ev);
    assert_eq!(back.event(), ev, "emit/event round trip");
}

fn ring(u: &mut Unstructured<'_>) {
    let log_nent = int(u, 0u8..=9);
    // SAFETY: declared before everything that holds its regions, so dropped last.
    let mem = unsafe { HeapDma::for_fuzzing(None) };
    let bar = RegFile::new();
    // Sometimes a buffer too short for the ring, which init_buf must refuse.
    let short = int(u, 0u8..=15) == 0;
    let len = if short { EqRing::buf_len(log_nent) - EQE_SIZE } else { EqRing::buf_len(log_nent) };
    let buf = mem.alloc(len.max(1), 4096).expect("ring memory");
    match EqRing::init_buf(&buf, log_nent) {
        Ok(()) => assert!(!short),
        Err(EqError::BadSize { log_eq_size }) => {
            assert!(short);
            assert_eq!(log_eq_size, log_nent);
            return;
        }
    }
    let eqn = int(u, 0u8..=u8::MAX);
    let buf_iova = buf.iova();
    let mut eq = EqRing::new(buf, log_nent, eqn, UAR_OFF);
    let nent = eq.nent();
    let doorbell = UAR_OFF + consts::MLX5_EQ_DOORBELL_OFFSET as usize;
    let mut pi = 0u32;
    let mut expected = std::collections::VecDeque::new();
    let mut hostile = false;
    // The consumer index last published, and doorbell writes checked so far.
    let mut published = 0u32;
    let mut seen_writes = 0usize;
    for _ in 0..512 {
        if u.is_empty() {
            break;
        }
        match int(u, 0u8..=7) {
            0..=2 => {
                // A well-behaved device: the next entry, owner bit of this pass, never overrunning.
                if pi.wrapping_sub(eq.cons_index()) >= nent {
                    continue;
                }
                let mut img = bytes::<EQE_SIZE>(u);
                img[c::mlx5_eqe::OWNER.off] = ((pi >> log_nent) & 1) as u8;
                let at = buf_iova + u64::from(pi & (nent - 1)) * EQE_SIZE as u64;
                assert!(mem.try_write(at, &img));
                expected.push_back(img);
                pi = pi.wrapping_add(1);
            }
            3 => {
                let at = int(u, 0u32..=u32::MAX) & (nent - 1);
                let img = bytes::<EQE_SIZE>(u);
                assert!(mem.try_write(buf_iova + u64::from(at) * EQE_SIZE as u64, &img));
                hostile = true;
            }
            4..=6 => {
                // Drain what is there, as the HCA does: at most one ring's worth.
                let burst = int(u, 1u32..=2 * nent);
                for _ in 0..burst {
                    let ci = eq.cons_index();
                    let slot = u64::from(ci & (nent - 1)) * EQE_SIZE as u64;
                    let before = mem.try_read(buf_iova + slot, EQE_SIZE).expect("ring");
                    let owner = before[c::mlx5_eqe::OWNER.off];
                    let got = eq.next(&bar);
                    let ours = (u32::from(owner) ^ (ci >> log_nent)) & 1 == 0;
                    match got {
                        Some(e) => {
                            assert!(ours, "entry {ci} handed out with owner {owner}");
                            assert_eq!(e.0.as_slice(), before.as_slice(), "entry copied as the device wrote it");
                            assert_eq!(eq.cons_index(), ci.wrapping_add(1));
                            image(&e);
                            if !hostile {
                                assert_eq!(Some(e.0), expected.pop_front(), "EQEs in the order written");
                            }
                        }
                        None => {
                            assert!(!ours, "entry {ci} with owner {owner} is software's but was not handed out");
                            assert_eq!(eq.cons_index(), ci);
                            if !hostile {
                                assert!(expected.is_empty(), "{} EQEs written but not handed out", expected.len());
                            }
                        }
                    }
                    check_doorbells(&bar, &mut seen_writes, &mut published, eqn, doorbell, eq.cons_index());
                    if got.is_none() {
                        break;
                    }
                }
            }
            _ => {
                let arm = flag(u);
                let w0 = bar.writes_len();
                eq.update_ci(&bar, arm);
                let off = if arm { doorbell } else { doorbell + 8 };
                let want = Write { off, value: eq_doorbell_value(eqn, eq.cons_index()).into(), width: 4 };
                assert_eq!(bar.writes_since(w0), [want]);
                check_doorbells(&bar, &mut seen_writes, &mut published, eqn, doorbell, eq.cons_index());
            }
        }
    }
}

/// Every new BAR write is an EQ doorbell carrying the EQ number and a consumer index the driver had reached, and
/// the driver never holds 128 consumed entries unpublished.
fn check_doorbells(bar: &RegFile<'_>, seen: &mut usize, published: &mut u32, eqn: u8, doorbell: usize, ci: u32) {
    for w in bar.writes_since(*seen) {
        assert!(w.off == doorbell || w.off == doorbell + 8, "write at {:#x}", w.off);
        assert_eq!(w.width, 4);
        assert_eq!((w.value >> 24) as u8, eqn, "doorbell names the EQ");
        let v = w.value as u32 & 0xff_ffff;
        // Checked after every call: the published index is exactly where the consumer is.
        assert_eq!(v, ci & 0xff_ffff, "doorbell publishes the consumer index");
        *published = v;
    }
    *seen = bar.writes_len();
    let unpublished = (ci & 0xff_ffff).wrapping_sub(*published) & 0xff_ffff;
    assert!(unpublished < consts::MLX5_NUM_SPARE_EQE, "{unpublished} EQEs consumed without a doorbell");
}

/// The HCA's consumer: arbitrary async events from the simulated device, drained by `process_events`.
fn hca_events(u: &mut Unstructured<'_>) {
    let dev = SimDevice::new(SimConfig::default());
    let mut d = dev.delay();
    // A pool of 16 chunks (1024 firmware pages): an arbitrary page request costs megabytes, not 64 MiB, per input.
    let mut hca: Hca<mlx5_sim::SimMmio, mlx5_sim::SimDma, (), mlx5_core::hca::Fixed<16>> =
        Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).expect("bring-up on a good device");
    let cq = hca.create_cq(CqAttr { cqe: 15, ..CqAttr::default() }, &mut d).expect("create_cq");
    let types = [
        EventType::PageRequest.raw(),
        EventType::Cmd.raw(),
        EventType::PortChange.raw(),
        EventType::CqError.raw(),
        EventType::InternalError.raw(),
        EventType::CommEst.raw(),
        EventType::PathMig.raw(),
    ];
    let mut got_events = 0u32;
    for _ in 0..32 {
        if u.is_empty() {
            break;
        }
        match int(u, 0u8..=5) {
            0..=2 => {
                let ty = types[int(u, 0usize..=types.len() - 1)];
                let sub = int(u, 0u8..=u8::MAX);
                let mut data = bytes::<EQE_DATA_LEN>(u);
                if ty == EventType::PageRequest.raw() && flag(u) {
                    // Mostly small requests for this function, so pages really move.
                    data.fill(0);
                    let n = int(u, -64i32..=64);
                    let e = Eqe::emit(&Event::PageRequest { function_id: 0, ec_function: false, num_pages: n });
                    data.copy_from_slice(&e.0[c::mlx5_eqe::DATA.off..c::mlx5_eqe::DATA.end()]);
                }
                dev.post_event(ty, sub, data);
            }
            3 => {
                // A real completion event: arm, then the device completes something on the CQ.
                let _ = hca.req_notify_cq(&cq, Notify::NextComp);
                let f = CqeFields { opcode: consts::MLX5_CQE_REQ, qpn: 0x77, ..CqeFields::default() };
                let _ = dev.post_cqe(cq.cqn(), f.emit().0);
            }
            _ => {
                let r = hca.process_events(&mut d);
                if r.is_err() {
                    // Typed; the HCA may have given up on the device.
                    continue;
                }
                while let Ok(Some(cqn)) = hca.get_cq_event(&mut d) {
                    assert_eq!(cqn, cq.cqn(), "completion event for a CQ that does not exist");
                    got_events += 1;
                    if got_events > 64 {
                        break;
                    }
                }
                while let Some(ev) = hca.get_async_event() {
                    match ev {
                        AsyncEvent::PortActive { port }
                        | AsyncEvent::PortErr { port }
                        | AsyncEvent::LidChange { port }
                        | AsyncEvent::PkeyChange { port }
                        | AsyncEvent::GidChange { port }
                        | AsyncEvent::ClientReregister { port } => assert!(port <= 0xf),
                        AsyncEvent::QpError { qpn, .. }
                        | AsyncEvent::CommEst { qpn }
                        | AsyncEvent::SqDrained { qpn }
                        | AsyncEvent::PathMig { qpn }
                        | AsyncEvent::PathMigErr { qpn } => assert!(qpn <= 0xff_ffff),
                        _ => {}
                    }
                }
            }
        }
    }
    if got_events > 0 {
        let _ = hca.ack_cq_events(&cq, got_events);
    }
    // Whatever the events said, the CQ can be destroyed: its ring and record go back.
    if let Err(e) = hca.destroy_cq(cq, &mut d) {
        panic!("destroy_cq after arbitrary events: {:?}", e.error);
    }
    if hca.teardown(&mut d).is_ok() {
        assert_eq!(dev.dma_outstanding(), (0, 0), "teardown returned every DMA allocation");
    }
}

//! Completion queues, memory regions and completion events end to end: the core against the simulated firmware.

use std::collections::HashMap;

use mlx5_core::cq::{Cq, CqeFields, CqeSize, Notify, WcFlags, WcOpcode, WcStatus, WorkCompletion, WrTable};
use mlx5_core::hca::{AsyncEvent, CqAttr};
use mlx5_core::hca::{Config, Error, Hca};
use mlx5_core::mkey::Access;
use mlx5_core::prm::consts;
use mlx5_sim::testkit::SimHca;
use mlx5_sim::{MkeyAccess, MkeyFault, PortType, SimConfig, SimDelay, SimDevice, SimEvent};

fn up(dev: &SimDevice) -> (SimHca, SimDelay) {
    let mut d = dev.delay();
    let hca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap_or_else(|e| panic!("{e}"));
    (hca, d)
}

/// Brought up, with the completion EQ in place (its 128 KiB ring is one allocation), and from then on the DMA
/// allocator grants at most `max` bytes at a time, so CQ rings come in fragments.
fn up_fragmented(dev: &SimDevice, max: Option<usize>) -> (SimHca, SimDelay) {
    let (mut hca, mut d) = up(dev);
    let cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    hca.destroy_cq(cq, &mut d).unwrap();
    dev.set_dma_max_contig(max);
    (hca, d)
}

const QPN: u32 = 0x123;

/// Work-request ids as a QP would keep them: send WQE `n` was posted with wr_id `0x5000_0000 + n`, receives get
/// ids in posting order.
#[derive(Default)]
struct Wrs {
    recv_tail: u64,
    unknown: u32,
}

impl WrTable for Wrs {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        (qpn == QPN).then_some(0x5000_0000 + u64::from(wqe_counter))
    }
    fn recv_done(&mut self, qpn: u32, _srqn: u32, _wqe_counter: u16) -> Option<u64> {
        if qpn != QPN {
            self.unknown += 1;
            return None;
        }
        self.recv_tail += 1;
        Some(0x7000_0000 + self.recv_tail - 1)
    }
    fn flush_one(&mut self, _cqn: u32, _dead: bool) -> Option<WorkCompletion> {
        // These tests never put the HCA in internal error or a CQ in error with a QP in ERR.
        None
    }
}

fn send_cqe(counter: u16) -> [u8; 64] {
    CqeFields {
        opcode: consts::MLX5_CQE_REQ,
        wqe_opcode: consts::MLX5_OPCODE_SEND,
        qpn: QPN,
        wqe_counter: counter,
        ..CqeFields::default()
    }
    .emit()
    .0
}

fn poll_all(hca: &SimHca, cq: &mut Cq, wrs: &mut Wrs, batch: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut wc = vec![WorkCompletion::default(); batch];
    loop {
        let n = cq.poll(hca.mmio(), wrs, &mut wc).unwrap();
        out.extend_from_slice(&wc[..n]);
        if n < batch {
            return out;
        }
    }
}

#[test]
fn cq_sizes_from_one_to_the_cap_limit_with_both_cqe_sizes() {
    let dev = SimDevice::new(SimConfig { log_max_cq_sz: 12, ..SimConfig::default() });
    let (mut hca, mut d) = up(&dev);
    let before = dev.dma_outstanding();
    for cqe_size in [CqeSize::B64, CqeSize::B128] {
        let mut cqes: Vec<u32> = (1..=12).map(|l| (1u32 << l) - 1).collect();
        cqes.extend([1, 2, 5, 100, 4000]);
        for cqe in cqes {
            let cq = hca.create_cq(CqAttr { cqe, cqe_size, overrun_ignore: false, comp_vector: 0 }, &mut d).unwrap();
            let nent = (cqe + 1).next_power_of_two();
            assert_eq!(cq.nent(), nent, "cqe {cqe}");
            let info = dev.cq_info(cq.cqn()).unwrap();
            assert_eq!((info.nent, info.cqe_size as usize), (nent, cqe_size.bytes()));
            assert_eq!(info.eqn, hca.comp_eq().unwrap());
            // Every entry starts invalid with owner 1, in the 64-byte image of each CQE.
            for i in 0..nent as usize {
                let off = i * cqe_size.bytes() + cqe_size.bytes() - 1;
                let (r, o) = cq.buf().locate(off);
                assert_eq!(r.read_volatile_u8(o), 0xf1, "cqe {i} of {nent}");
            }
            hca.destroy_cq(cq, &mut d).unwrap();
        }
        // Beyond the limit: refused before any command is sent.
        let sent = dev.executed().len();
        let e =
            hca.create_cq(CqAttr { cqe: 4096, cqe_size, overrun_ignore: false, comp_vector: 0 }, &mut d).unwrap_err();
        assert_eq!(e, Error::BadSize { what: "CQ entries", requested: 4096, max: 4095 });
        assert!(matches!(hca.create_cq(CqAttr { cqe: 0, ..CqAttr::default() }, &mut d), Err(Error::BadSize { .. })));
        assert_eq!(dev.executed().len(), sent);
    }
    // Every ring buffer and doorbell record went back (the completion EQ stays until teardown).
    assert_eq!(hca.dbr_usage(), (0, 0));
    let eq_bytes = 64 * 2048;
    assert_eq!(dev.dma_outstanding(), (before.0 + 1, before.1 + eq_bytes));
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn page_size_follows_the_dma_layout() {
    // (largest contiguous allocation, CQ entries) -> (log_page_size, pas entries)
    let cases: [(Option<usize>, u32, u32, usize); 5] = [
        // 64 KiB contiguous and aligned: one 64 KiB page.
        (None, 1023, 4, 1),
        // 2 MiB contiguous: one 2 MiB page.
        (None, 32767, 9, 1),
        // At most 16 KiB per allocation: four 16 KiB fragments, each aligned, scattered (guard pages between).
        (Some(16 << 10), 1023, 2, 4),
        // 4 KiB allocations only: 16 scattered 4 KiB pages.
        (Some(4 << 10), 1023, 0, 16),
        // A buffer smaller than a page still takes one.
        (Some(4 << 10), 3, 0, 1),
    ];
    for (max, cqe, log_pg, npas) in cases {
        let dev = SimDevice::default();
        let (mut hca, mut d) = up_fragmented(&dev, max);
        let mut cq = hca.create_cq(CqAttr { cqe, ..CqAttr::default() }, &mut d).unwrap();
        let info = dev.cq_info(cq.cqn()).unwrap();
        assert_eq!((info.log_page_size, info.npas), (log_pg, npas), "max {max:?} cqe {cqe}");
        // The device writes through those pages where the driver reads: a full lap and a half.
        let mut wrs = Wrs::default();
        let n = cq.nent() * 3 / 2;
        let mut seen = 0u32;
        for i in 0..n {
            dev.post_cqe(cq.cqn(), send_cqe(i as u16)).unwrap();
            if (i + 1) % cq.nent().min(7) == 0 || i + 1 == n {
                for w in poll_all(&hca, &mut cq, &mut wrs, 16) {
                    assert_eq!(w.wr_id, 0x5000_0000 + u64::from(seen as u16));
                    seen += 1;
                }
            }
        }
        assert_eq!(seen, n);
        hca.destroy_cq(cq, &mut d).unwrap();
        hca.teardown(&mut d).unwrap();
        assert_eq!(dev.dma_outstanding(), (0, 0));
    }
}

/// Ten laps of the ring, in bursts that never overrun it, polled in batches of every size: each completion
/// arrives once, in order.
fn stream(cqe_size: CqeSize, max_contig: Option<usize>) {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up_fragmented(&dev, max_contig);
    let mut cq = hca.create_cq(CqAttr { cqe: 63, cqe_size, overrun_ignore: false, comp_vector: 0 }, &mut d).unwrap();
    let nent = cq.nent();
    let total = 10 * nent + 7;
    let mut wrs = Wrs::default();
    let mut posted = 0u32;
    let mut got: Vec<u64> = Vec::new();
    let mut burst = 1u32;
    let mut batch = 1usize;
    while got.len() < total as usize {
        let room = nent - (posted - got.len() as u32);
        for _ in 0..burst.min(room).min(total - posted) {
            // Alternate sends and receives so both decoding paths run.
            let cqe = if posted.is_multiple_of(2) {
                send_cqe(posted as u16)
            } else {
                CqeFields {
                    opcode: consts::MLX5_CQE_RESP_SEND,
                    qpn: QPN,
                    byte_cnt: posted,
                    flags_rqpn: 0x77,
                    ..CqeFields::default()
                }
                .emit()
                .0
            };
            dev.post_cqe(cq.cqn(), cqe).unwrap();
            posted += 1;
        }
        // `ready` sees an entry exactly while one is unpolled, on every lap (owner bit) and fragment.
        assert_eq!(cq.ready(), posted as usize > got.len(), "ready before a poll");
        let mut wc = vec![WorkCompletion::default(); batch];
        let n = cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap();
        assert_eq!(cq.ready(), posted as usize > got.len() + n, "ready after a poll of {n}");
        for w in &wc[..n] {
            let i = got.len() as u32;
            if i.is_multiple_of(2) {
                assert_eq!((w.opcode, w.wr_id), (WcOpcode::Send, 0x5000_0000 + u64::from(i as u16)));
            } else {
                assert_eq!((w.opcode, w.byte_len, w.src_qp), (WcOpcode::Recv, i, 0x77));
                assert_eq!(w.wr_id, 0x7000_0000 + u64::from(i / 2));
            }
            assert_eq!(w.status, WcStatus::Success);
            got.push(w.wr_id);
        }
        // The consumer index reached the doorbell record, which is what the device checks for room.
        assert_eq!(dev.cq_info(cq.cqn()).unwrap().ci, cq.cons_index() & 0xff_ffff);
        burst = burst % 37 + 5;
        batch = batch % 19 + 1;
    }
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut [WorkCompletion::default(); 4]).unwrap(), 0);
    assert_eq!(dev.cq_info(cq.cqn()).unwrap().overruns, 0);
    assert_eq!(posted, total);
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}

#[test]
fn ten_laps_lose_and_duplicate_nothing() {
    stream(CqeSize::B64, None);
    stream(CqeSize::B128, None);
    stream(CqeSize::B64, Some(4096));
    stream(CqeSize::B128, Some(4096));
}

#[test]
fn every_error_syndrome_maps_as_the_kernel_maps_it() {
    let table: [(u8, WcStatus); 13] = [
        (consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR, WcStatus::LocLenErr),
        (consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR, WcStatus::LocQpOpErr),
        (consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR, WcStatus::LocProtErr),
        (consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR, WcStatus::WrFlushErr),
        (consts::MLX5_CQE_SYNDROME_MW_BIND_ERR, WcStatus::MwBindErr),
        (consts::MLX5_CQE_SYNDROME_BAD_RESP_ERR, WcStatus::BadRespErr),
        (consts::MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR, WcStatus::LocAccessErr),
        (consts::MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR, WcStatus::RemInvReqErr),
        (consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR, WcStatus::RemAccessErr),
        (consts::MLX5_CQE_SYNDROME_REMOTE_OP_ERR, WcStatus::RemOpErr),
        (consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR, WcStatus::RetryExcErr),
        (consts::MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR, WcStatus::RnrRetryExcErr),
        (consts::MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR, WcStatus::RemAbortErr),
    ];
    let known: HashMap<u8, WcStatus> = table.iter().map(|&(s, w)| (s, w)).collect();
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let mut cq = hca.create_cq(CqAttr { cqe: 1023, ..CqAttr::default() }, &mut d).unwrap();
    let mut wrs = Wrs::default();
    for syndrome in 0..=255u8 {
        for (opcode, req) in [(consts::MLX5_CQE_REQ_ERR, true), (consts::MLX5_CQE_RESP_ERR, false)] {
            let f = CqeFields {
                opcode,
                qpn: QPN,
                wqe_counter: 0x4242,
                syndrome,
                vendor_err: syndrome ^ 0x5a,
                // Bytes a good CQE would carry must not leak into an error completion.
                byte_cnt: 0xdead,
                flags_rqpn: 0x00ab_cdef,
                ..CqeFields::default()
            };
            dev.post_cqe(cq.cqn(), f.emit().0).unwrap();
            let mut wc = [WorkCompletion::default(); 2];
            assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 1);
            let want_status = known.get(&syndrome).copied().unwrap_or(WcStatus::GeneralErr);
            let wr_id = if req { 0x5000_4242 } else { 0x7000_0000 + wrs.recv_tail - 1 };
            let want = WorkCompletion {
                wr_id,
                status: want_status,
                vendor_err: u32::from(syndrome ^ 0x5a),
                qp_num: QPN,
                ..WorkCompletion::default()
            };
            assert_eq!(wc[0], want, "syndrome {syndrome:#x} req {req}");
            assert_eq!(want_status.raw(), {
                let s = known.get(&syndrome).map_or(consts::IB_WC_GENERAL_ERR, |s| s.raw());
                s
            });
        }
    }
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}

#[test]
fn good_completions_carry_every_field() {
    let dev = SimDevice::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
    let (mut hca, mut d) = up(&dev);
    let mut cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let mut wrs = Wrs::default();
    let req = |wqe_opcode: u8, byte_cnt| CqeFields {
        opcode: consts::MLX5_CQE_REQ,
        wqe_opcode,
        qpn: QPN,
        wqe_counter: 9,
        byte_cnt,
        ..CqeFields::default()
    };
    let resp = |opcode: u8| CqeFields {
        opcode,
        qpn: QPN,
        byte_cnt: 1500,
        imm_inval_pkey: 0x1122_3344,
        // GRH present, SL 5, source QP 0x000abc.
        flags_rqpn: (1 << 28) | (5 << 24) | 0xabc,
        slid: 0x0017,
        ml_path: 3,
        hds_ip_ext: (consts::CQE_L3_OK | consts::CQE_L4_OK) as u8,
        ..CqeFields::default()
    };
    use WcOpcode::*;
    let cases: Vec<(CqeFields, WcOpcode, u32, WcFlags)> = vec![
        (req(consts::MLX5_OPCODE_SEND, 77), Send, 0, WcFlags::default()),
        (req(consts::MLX5_OPCODE_SEND_IMM, 77), Send, 0, WcFlags::WITH_IMM),
        (req(consts::MLX5_OPCODE_RDMA_WRITE, 77), RdmaWrite, 0, WcFlags::default()),
        (req(consts::MLX5_OPCODE_RDMA_WRITE_IMM, 77), RdmaWrite, 0, WcFlags::WITH_IMM),
        (req(consts::MLX5_OPCODE_RDMA_READ, 4096), RdmaRead, 4096, WcFlags::default()),
        (req(consts::MLX5_OPCODE_ATOMIC_CS, 0), CompSwap, 8, WcFlags::default()),
        (req(consts::MLX5_OPCODE_ATOMIC_FA, 0), FetchAdd, 8, WcFlags::default()),
        (req(consts::MLX5_OPCODE_ATOMIC_MASKED_CS, 0), MaskedCompSwap, 8, WcFlags::default()),
        (req(consts::MLX5_OPCODE_ATOMIC_MASKED_FA, 0), MaskedFetchAdd, 8, WcFlags::default()),
        (req(0x1f, 0), Unknown(0x1f), 0, WcFlags::default()),
        (resp(consts::MLX5_CQE_RESP_SEND), Recv, 1500, WcFlags::IP_CSUM_OK | WcFlags::GRH),
        (resp(consts::MLX5_CQE_RESP_SEND_IMM), Recv, 1500, WcFlags::WITH_IMM | WcFlags::GRH),
        (resp(consts::MLX5_CQE_RESP_SEND_INV), Recv, 1500, WcFlags::WITH_INV | WcFlags::GRH),
        (resp(consts::MLX5_CQE_RESP_WR_IMM), RecvRdmaWithImm, 1500, WcFlags::WITH_IMM | WcFlags::GRH),
    ];
    for (f, opcode, byte_len, flags) in cases {
        dev.post_cqe(cq.cqn(), f.emit().0).unwrap();
        let mut wc = [WorkCompletion::default(); 1];
        assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 1);
        let w = wc[0];
        assert_eq!(
            (w.opcode, w.byte_len, w.wc_flags, w.status, w.qp_num),
            (opcode, byte_len, flags, WcStatus::Success, QPN)
        );
        if matches!(opcode, Recv | RecvRdmaWithImm) {
            // InfiniBand: SLID and SL come from the CQE.
            assert_eq!((w.src_qp, w.sl, w.slid, w.dlid_path_bits, w.pkey_index), (0xabc, 5, 0x17, 3, 0));
            let inv = flags.contains(WcFlags::WITH_INV);
            assert_eq!(
                (w.imm_data, w.invalidated_rkey),
                if inv {
                    (0, 0x1122_3344)
                } else if flags.contains(WcFlags::WITH_IMM) {
                    // ibv_wc.imm_data is __be32: the CQE's bytes unchanged.
                    (0x1122_3344u32.to_be(), 0)
                } else {
                    (0, 0)
                }
            );
        } else {
            assert_eq!(w.wr_id, 0x5000_0009);
        }
    }
    // A completion for a QP nobody has is an error of its own; the CQE is consumed, nothing else lost.
    dev.post_cqe(cq.cqn(), send_cqe(1)).unwrap();
    let mut bad = req(consts::MLX5_OPCODE_SEND, 0);
    bad.qpn = 0x999;
    dev.post_cqe(cq.cqn(), bad.emit().0).unwrap();
    dev.post_cqe(cq.cqn(), send_cqe(2)).unwrap();
    let mut wc = [WorkCompletion::default(); 4];
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 1);
    let e = cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap_err();
    assert!(matches!(e, mlx5_core::cq::CqeError::UnknownQp { qpn: 0x999, .. }), "{e:?}");
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 1);
    assert_eq!(wc[0].wr_id, 0x5000_0002);
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}

/// As rdma-core's mlx5: the SL and source LID are the CQE's on every link layer (on RoCE the SL field carries the
/// packet type); a tagged receive reports its VLAN.
#[test]
fn roce_receives_read_the_vlan_tag_and_the_cqe_sl() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let mut cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let f = CqeFields {
        opcode: consts::MLX5_CQE_RESP_SEND,
        qpn: QPN,
        slid: 0x55,
        l4_l3_hdr_type: 1,
        // PCP 6, VLAN 0x123.
        vlan_info: (6 << 13) | 0x123,
        // RoCE v2 over IPv4: packet type 0xa in bits 27:24.
        flags_rqpn: (2 << 28) | (0xa << 24) | 0x42,
        ..CqeFields::default()
    };
    dev.post_cqe(cq.cqn(), f.emit().0).unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(cq.poll(hca.mmio(), &mut Wrs::default(), &mut wc).unwrap(), 1);
    let w = wc[0];
    assert_eq!((w.slid, w.sl, w.vlan_id, w.src_qp), (0x55, 0xa, Some(0x123), 0x42));
    assert!(w.wc_flags.contains(WcFlags::GRH));
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}

#[test]
fn armed_cqs_raise_events_and_solicited_only_waits_for_a_solicited_one() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let mut cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let other = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let mut wrs = Wrs::default();
    let mut wc = [WorkCompletion::default(); 8];
    let cqn = cq.cqn();

    // Not armed: a completion raises no event.
    dev.post_cqe(cqn, send_cqe(0)).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), None);
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 1);

    // Armed for the next completion: one event, then disarmed.
    hca.req_notify_cq(&cq, Notify::NextComp).unwrap();
    dev.post_cqe(cqn, send_cqe(1)).unwrap();
    dev.post_cqe(cqn, send_cqe(2)).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), Some(cqn));
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), None);
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 2);

    // The arm doorbell carries the event count so far as its sequence number, and the consumer index.
    hca.req_notify_cq(&cq, Notify::Solicited).unwrap();
    assert_eq!(
        dev.events().iter().rev().find(|e| matches!(e, SimEvent::CqDoorbell { .. })),
        Some(&SimEvent::CqDoorbell { cqn, sn: 1, solicited: true, ci: 3 })
    );
    // Solicited only: a plain completion does not fire, a solicited one does.
    dev.post_cqe(cqn, send_cqe(3)).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), None);
    let mut sol = CqeFields { opcode: consts::MLX5_CQE_RESP_SEND, qpn: QPN, ..CqeFields::default() };
    sol.solicited = true;
    dev.post_cqe(cqn, sol.emit().0).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), Some(cqn));
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 2);

    // An error completion fires a solicited-only arm too.
    hca.req_notify_cq(&cq, Notify::Solicited).unwrap();
    let err = CqeFields { opcode: consts::MLX5_CQE_REQ_ERR, qpn: QPN, syndrome: 0x5, ..CqeFields::default() };
    dev.post_cqe(cqn, err.emit().0).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), Some(cqn));

    // Arming while completions are already waiting fires at once (no lost wake-up).
    hca.req_notify_cq(&cq, Notify::NextComp).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), Some(cqn));
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 1);
    assert_eq!(wc[0].status, WcStatus::WrFlushErr);

    // Events of another CQ are its own.
    hca.req_notify_cq(&other, Notify::NextComp).unwrap();
    dev.post_cqe(other.cqn(), send_cqe(0)).unwrap();
    assert_eq!(hca.get_cq_event(&mut d).unwrap(), Some(other.cqn()));
    hca.ack_cq_events(&other, 1).unwrap();

    // Four events taken on `cq`: destroy waits for all to be acknowledged.
    assert_eq!(hca.events().completion, 5);
    let back = hca.destroy_cq(cq, &mut d).unwrap_err();
    assert_eq!(back.error, Error::UnackedEvents { cqn, unacked: 4 });
    let cq = back.obj;
    assert!(matches!(hca.ack_cq_events(&cq, 5), Err(Error::BadSize { .. })));
    hca.ack_cq_events(&cq, 4).unwrap();
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.destroy_cq(other, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn arm_is_the_record_then_one_64_bit_doorbell() {
    use mlx5_sim::testkit::mocks::{BarrierKind, MmioAccess, RecordingMmio};
    let dev = SimDevice::default();
    let rec = RecordingMmio::new(dev.mmio());
    let mut d = dev.delay();
    let mut hca: Hca<&RecordingMmio<mlx5_sim::SimMmio>, mlx5_sim::SimDma> =
        Hca::bring_up(&rec, dev.dma(), (), &mut d, Config::default()).unwrap();
    let cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let start = rec.log().len();
    hca.req_notify_cq(&cq, Notify::Solicited).unwrap();
    let log = rec.log()[start..].to_vec();
    let db = hca.uar().unwrap() as usize * 4096 + consts::MLX5_CQ_DOORBELL as usize;
    let value = (u64::from(consts::MLX5_CQ_DB_REQ_NOT_SOL) << 32) | u64::from(cq.cqn());
    assert_eq!(log, vec![MmioAccess::Barrier(BarrierKind::Wmb), MmioAccess::Write64 { off: db, val: value }]);
    // The record's arm dword holds the same command before the barrier.
    assert_eq!(cq.dbrec().read_be32(1), consts::MLX5_CQ_DB_REQ_NOT_SOL);
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}

#[test]
fn an_overrun_is_reported_as_a_cq_error_event() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let cq = hca.create_cq(CqAttr { cqe: 3, ..CqAttr::default() }, &mut d).unwrap();
    for i in 0..4 {
        dev.post_cqe(cq.cqn(), send_cqe(i)).unwrap();
    }
    assert!(dev.post_cqe(cq.cqn(), send_cqe(4)).is_err());
    assert_eq!(hca.get_async_event(), None);
    hca.process_events(&mut d).unwrap();
    let overrun = consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN;
    assert_eq!(hca.get_async_event(), Some(AsyncEvent::CqError { cqn: cq.cqn(), syndrome: overrun }));
    assert_eq!(hca.cq_error(&cq), Some(overrun));
    let st = hca.query_cq(&cq, &mut d).unwrap();
    assert!(st.overflowed());
    assert_eq!((st.producer_counter, st.log_cq_size), (4, 2));
    hca.destroy_cq(cq, &mut d).unwrap();

    // With overrun ignore the device keeps writing and says nothing.
    let mut cq = hca.create_cq(CqAttr { cqe: 3, overrun_ignore: true, ..CqAttr::default() }, &mut d).unwrap();
    for i in 0..6 {
        dev.post_cqe(cq.cqn(), send_cqe(i)).unwrap();
    }
    hca.process_events(&mut d).unwrap();
    assert_eq!(hca.get_async_event(), None);
    assert_eq!(hca.cq_error(&cq), None);
    assert!(!hca.query_cq(&cq, &mut d).unwrap().overflowed());
    let _ = cq.poll(hca.mmio(), &mut Wrs::default(), &mut [WorkCompletion::default(); 8]);
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}

#[test]
fn moderation_query_and_resize_keep_pending_completions() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let mut cq = hca.create_cq(CqAttr { cqe: 7, ..CqAttr::default() }, &mut d).unwrap();
    hca.modify_cq(&cq, 16, 50, &mut d).unwrap();
    let st = hca.query_cq(&cq, &mut d).unwrap();
    assert_eq!((st.cq_max_count, st.cq_period, st.c_eqn), (16, 50, u32::from(hca.comp_eq().unwrap())));
    assert!(matches!(hca.modify_cq(&cq, 1, 4096, &mut d), Err(Error::BadSize { .. })));

    let mut wrs = Wrs::default();
    let mut wc = [WorkCompletion::default(); 64];
    // Go around once so the resize happens mid-ring with wrapped owner bits.
    for i in 0..6 {
        dev.post_cqe(cq.cqn(), send_cqe(i)).unwrap();
    }
    assert_eq!(cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap(), 6);
    for i in 6..12 {
        dev.post_cqe(cq.cqn(), send_cqe(i)).unwrap();
    }
    // Too small for the six waiting completions: firmware refuses, nothing changes.
    let e = hca.resize_cq(&mut cq, 3, &mut d).unwrap_err();
    assert!(matches!(e, Error::Cmd(mlx5_core::cmdq::CmdError::Status { .. })), "{e}");
    assert_eq!(cq.nent(), 8);
    hca.resize_cq(&mut cq, 100, &mut d).unwrap();
    assert_eq!((cq.nent(), dev.cq_info(cq.cqn()).unwrap().nent), (128, 128));
    // The six waiting completions come first, then what the device writes into the new ring.
    let mut expect = 6u16;
    for i in 12..140u16 {
        dev.post_cqe(cq.cqn(), send_cqe(i)).unwrap();
        if i % 40 == 0 || i == 139 {
            let n = cq.poll(hca.mmio(), &mut wrs, &mut wc).unwrap();
            for w in &wc[..n] {
                assert_eq!(w.wr_id, 0x5000_0000 + u64::from(expect));
                expect += 1;
            }
        }
    }
    assert_eq!(expect, 140);
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn resize_preserves_order_exactly() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let mut cq = hca.create_cq(CqAttr { cqe: 7, cqe_size: CqeSize::B128, ..CqAttr::default() }, &mut d).unwrap();
    let mut wrs = Wrs::default();
    let mut next = 0u16;
    let mut expect = 0u16;
    let check = |cq: &mut Cq, hca: &SimHca, wrs: &mut Wrs, expect: &mut u16| {
        let mut wc = [WorkCompletion::default(); 256];
        let n = cq.poll(hca.mmio(), wrs, &mut wc).unwrap();
        for w in &wc[..n] {
            assert_eq!(w.wr_id, 0x5000_0000 + u64::from(*expect));
            *expect += 1;
        }
    };
    for size in [15u32, 255, 31, 7] {
        // Leave a few completions waiting at every resize.
        for _ in 0..5 {
            dev.post_cqe(cq.cqn(), send_cqe(next)).unwrap();
            next += 1;
        }
        hca.resize_cq(&mut cq, size, &mut d).unwrap();
        for _ in 0..2 {
            dev.post_cqe(cq.cqn(), send_cqe(next)).unwrap();
            next += 1;
        }
        check(&mut cq, &hca, &mut wrs, &mut expect);
    }
    assert_eq!(expect, next);
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn doorbell_records_share_pages_one_cache_line_each() {
    for (line_128, per_page) in [(false, 64usize), (true, 32)] {
        let dev = SimDevice::default();
        let mut d = dev.delay();
        let cfg = Config { cache_line_128: line_128, ..Config::default() };
        let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, cfg).unwrap();
        let stride = if line_128 { 128 } else { 64 };
        let mut cqs: Vec<Cq> =
            (0..per_page + 3).map(|_| hca.create_cq(CqAttr { cqe: 1, ..CqAttr::default() }, &mut d).unwrap()).collect();
        assert_eq!(hca.dbr_usage(), (2, per_page + 3));
        let mut addrs: Vec<u64> = cqs.iter().map(|c| c.dbrec().iova()).collect();
        for a in &addrs {
            assert_eq!(a % stride as u64, 0, "each record on its own cache line");
        }
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), per_page + 3);
        // The first page fills before a second is taken: its records are the first `per_page`.
        let page0 = cqs[0].dbrec().iova() & !4095;
        assert!(cqs[..per_page].iter().all(|c| c.dbrec().iova() & !4095 == page0));
        assert!(cqs[per_page..].iter().all(|c| c.dbrec().iova() & !4095 != page0));
        // A record freed in the first page is the next one handed out, ahead of the second page's free slots.
        let freed = cqs.remove(5);
        let slot = freed.dbrec().iova();
        hca.destroy_cq(freed, &mut d).unwrap();
        let again = hca.create_cq(CqAttr { cqe: 1, ..CqAttr::default() }, &mut d).unwrap();
        assert_eq!(again.dbrec().iova(), slot);
        cqs.push(again);
        // Emptying the second page returns it to the allocator.
        let dma_before = dev.dma_outstanding().0;
        let (first, second): (Vec<Cq>, Vec<Cq>) = cqs.into_iter().partition(|c| c.dbrec().iova() & !4095 == page0);
        assert_eq!((first.len(), second.len()), (per_page, 3));
        for cq in second {
            hca.destroy_cq(cq, &mut d).unwrap();
        }
        let cqs = first;
        assert_eq!(hca.dbr_usage(), (1, per_page));
        // 3 ring buffers and 1 record page fewer.
        assert_eq!(dev.dma_outstanding().0, dma_before - 4);
        for cq in cqs {
            hca.destroy_cq(cq, &mut d).unwrap();
        }
        assert_eq!(hca.dbr_usage(), (0, 0));
        hca.teardown(&mut d).unwrap();
        assert_eq!(dev.dma_outstanding(), (0, 0));
    }
}

#[test]
fn memory_regions_translate_and_enforce_access() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let pd = hca.alloc_pd(&mut d).unwrap();
    let dma = dev.dma();
    let region = mlx5_core::hal::Dma::alloc(&dma, 5 * 4096, 4096).unwrap();
    // A range inside the region, not page aligned.
    // SAFETY: 100 bytes into a 20 KiB region.
    let addr = unsafe { region.cpu().as_ptr().add(100) };
    let len = 3 * 4096;
    let mr = hca.reg_mr(&pd, addr, len, Access::LOCAL_WRITE | Access::REMOTE_READ, &mut d).unwrap();
    let va = addr as u64;
    assert_eq!((mr.lkey, mr.addr, mr.length), (mr.rkey, va, len as u64));
    // The page size is bounded by where the CPU and bus addresses stop agreeing (at least 4 KiB, since both are
    // 4 KiB aligned) and by the span of the range (no page larger than needed to cover it in one).
    let agree = (region.cpu().as_ptr() as u64 ^ region.iova()).trailing_zeros();
    let span = 64 - ((va + len as u64 - 1) ^ va).leading_zeros();
    assert_eq!(mr.page_shift, agree.min(span).min(30));
    assert!(mr.page_shift >= 12);
    let pieces = dev.mkey_access(mr.rkey, Some(pd.pdn()), va + 10, 5000, MkeyAccess::REMOTE_READ).unwrap();
    assert_eq!(pieces.iter().map(|p| p.1).sum::<u64>(), 5000);
    assert_eq!(pieces[0].0, region.iova() + 110);
    // Rights it was not given, ranges it does not cover, another PD, a stale key.
    assert_eq!(
        dev.mkey_access(mr.rkey, Some(pd.pdn()), va, 8, MkeyAccess::REMOTE_WRITE),
        Err(MkeyFault::AccessDenied(MkeyAccess::REMOTE_WRITE))
    );
    assert_eq!(
        dev.mkey_access(mr.rkey, Some(pd.pdn()), va + len as u64 - 4, 8, MkeyAccess::LOCAL_READ),
        Err(MkeyFault::OutOfBounds)
    );
    assert_eq!(
        dev.mkey_access(mr.rkey, Some(pd.pdn()), va - 1, 8, MkeyAccess::LOCAL_READ),
        Err(MkeyFault::OutOfBounds)
    );
    assert_eq!(dev.mkey_access(mr.rkey, Some(pd.pdn() + 1), va, 8, MkeyAccess::LOCAL_READ), Err(MkeyFault::PdMismatch));
    assert_eq!(
        dev.mkey_access(mr.rkey ^ 0xff, Some(pd.pdn()), va, 8, MkeyAccess::LOCAL_READ),
        Err(MkeyFault::VariantMismatch)
    );

    // Memory the DMA layer does not know cannot be registered, and no command is sent for it.
    let stack = [0u8; 4096];
    let sent = dev.executed().len();
    let e = hca.reg_mr(&pd, stack.as_ptr(), stack.len(), Access::LOCAL_WRITE, &mut d).unwrap_err();
    assert!(matches!(e, Error::NotDmaMemory { .. }), "{e}");
    // Past the end of a region is not inside it either.
    let e = hca.reg_mr(&pd, addr, 5 * 4096, Access::LOCAL_WRITE, &mut d).unwrap_err();
    assert!(matches!(e, Error::NotDmaMemory { .. }), "{e}");
    // Remote write without local write is refused, as verbs does.
    let e = hca.reg_mr(&pd, addr, 64, Access::REMOTE_WRITE, &mut d).unwrap_err();
    assert!(matches!(e, Error::BadAccess { .. }), "{e}");
    assert_eq!(dev.executed().len(), sent);

    // A physical-address key covers any bus address.
    let all = hca.reg_dma_mr(&pd, Access::ALL, &mut d).unwrap();
    assert_eq!(
        dev.mkey_access(all.lkey, Some(pd.pdn()), region.iova(), 4096, MkeyAccess::REMOTE_ATOMIC).unwrap(),
        vec![(region.iova(), 4096)]
    );

    // The PD cannot go while keys use it; once they are gone it can.
    let keep = hca.dealloc_pd(pd, &mut d).unwrap_err();
    let pd = keep.obj;
    let key = mr.lkey;
    hca.dereg_mr(mr, &mut d).unwrap();
    assert_eq!(dev.mkey_access(key, Some(pd.pdn()), va, 8, MkeyAccess::LOCAL_READ), Err(MkeyFault::UnknownKey));
    hca.dereg_mr(all, &mut d).unwrap();
    assert_eq!(dev.mkey_count(), 0);
    hca.dealloc_pd(pd, &mut d).unwrap();
    // SAFETY: the keys over the region are destroyed.
    unsafe { mlx5_core::hal::Dma::free(&dma, region) };
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn large_aligned_regions_get_large_pages() {
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let pd = hca.alloc_pd(&mut d).unwrap();
    let dma = dev.dma();
    let region = mlx5_core::hal::Dma::alloc(&dma, 4 << 20, 2 << 20).unwrap();
    let mr = hca.reg_mr(&pd, region.cpu().as_ptr(), region.len(), Access::LOCAL_WRITE, &mut d).unwrap();
    // Both the CPU and bus addresses are 2 MiB aligned: 2 MiB pages (4 MiB spans two, so not one 4 MiB page
    // unless the CPU address happens to be 4 MiB aligned too).
    assert!(mr.page_shift >= 21, "page shift {}", mr.page_shift);
    let pieces = dev.mkey_access(mr.lkey, Some(pd.pdn()), mr.addr, mr.length, MkeyAccess::LOCAL_WRITE).unwrap();
    assert_eq!(pieces, vec![(region.iova(), 4 << 20)]);
    hca.dereg_mr(mr, &mut d).unwrap();
    hca.dealloc_pd(pd, &mut d).unwrap();
    // SAFETY: the key over the region is destroyed.
    unsafe { mlx5_core::hal::Dma::free(&dma, region) };
    hca.teardown(&mut d).unwrap();
}

#[test]
fn teardown_with_a_live_cq_still_disables_and_a_dead_device_destroys_locally() {
    // A CQ the caller never destroyed: the completion EQ cannot go (firmware still has a CQ on it), teardown says
    // so, disables the function anyway, and only the caller's ring is still allocated.
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    // The caller keeps this CQ to the end; its ring is never freed under the device.
    let live_cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let ring = (live_cq.buf().nfrags(), live_cq.buf().len());
    let e = hca.teardown(&mut d).unwrap_err();
    assert!(matches!(e, Error::Cmd(mlx5_core::cmdq::CmdError::Status { .. })), "{e}");
    assert_eq!(dev.hca_state(), mlx5_sim::HcaState::Disabled);
    assert_eq!(dev.dma_outstanding(), ring);

    // After a health failure destroys complete locally and everything is returned.
    let dev = SimDevice::default();
    let (mut hca, mut d) = up(&dev);
    let pd = hca.alloc_pd(&mut d).unwrap();
    let cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR);
    assert!(hca.poll_health().is_err());
    assert!(matches!(hca.create_cq(CqAttr::default(), &mut d), Err(Error::InternalError { .. })));
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.dealloc_pd(pd, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn the_uar_page_has_four_blueflame_registers() {
    let dev = SimDevice::default();
    let (hca, mut d) = up(&dev);
    let uar = hca.uar_page().unwrap();
    assert_eq!(uar.index, hca.uar().unwrap());
    // The simulated ConnectX-5 reports log_bf_reg_size 9: 512-byte registers of two 256-byte buffers.
    assert_eq!((uar.bf, uar.bf_reg_size), (true, 512));
    let mut r = uar.bfreg(2).unwrap();
    let base = uar.index as usize * 4096 + consts::MLX5_BF_OFFSET as usize + 2 * 512;
    assert_eq!((r.next_offset(), r.next_offset(), r.next_offset()), (base, base + 256, base));
    assert!(uar.bfreg(4).is_none());
    hca.teardown(&mut d).unwrap();
}

/// `Cq::clean` (libmlx5's `__mlx5_cq_clean`): one QP's unpolled CQEs leave the ring, the others' stay in order,
/// across the ring's wrap, with both CQE sizes and a fragmented ring; the ring keeps working after.
#[test]
fn clean_takes_one_qps_cqes_out_and_keeps_the_others_in_order() {
    const OTHER: u32 = 0x456;
    for (cqe_size, max_contig) in [(CqeSize::B64, None), (CqeSize::B128, None), (CqeSize::B128, Some(4096))] {
        let dev = SimDevice::default();
        let (mut hca, mut d) = up_fragmented(&dev, max_contig);
        let mut cq =
            hca.create_cq(CqAttr { cqe: 63, cqe_size, overrun_ignore: false, comp_vector: 0 }, &mut d).unwrap();
        let nent = cq.nent();
        let mut wrs = Wrs::default();
        // Most of a lap polled, so what follows wraps.
        for i in 0..nent - 10 {
            dev.post_cqe(cq.cqn(), send_cqe(i as u16)).unwrap();
        }
        assert_eq!(poll_all(&hca, &mut cq, &mut wrs, 8).len(), (nent - 10) as usize);
        // Every third CQE is a receive of the other QP.
        let total = nent - 4;
        for k in 0..total {
            let cqe = if k % 3 == 0 {
                CqeFields {
                    opcode: consts::MLX5_CQE_RESP_SEND,
                    qpn: OTHER,
                    wqe_counter: k as u16,
                    ..CqeFields::default()
                }
                .emit()
                .0
            } else {
                send_cqe(k as u16)
            };
            dev.post_cqe(cq.cqn(), cqe).unwrap();
        }
        let mut recvs = Vec::new();
        let removed = cq.clean(hca.mmio(), OTHER, |c| recvs.push(c));
        let others: Vec<u16> = (0..total).filter(|k| k % 3 == 0).map(|k| k as u16).collect();
        assert_eq!(removed as usize, others.len());
        recvs.sort_unstable();
        assert_eq!(recvs, others, "each removed receive's WQE counter");
        assert_eq!(dev.cq_info(cq.cqn()).unwrap().ci, cq.cons_index() & 0xff_ffff);
        let got: Vec<u64> = poll_all(&hca, &mut cq, &mut wrs, 5).iter().map(|w| w.wr_id).collect();
        let want: Vec<u64> = (0..total).filter(|k| k % 3 != 0).map(|k| 0x5000_0000 + u64::from(k as u16)).collect();
        assert_eq!(got, want);
        assert_eq!(wrs.unknown, 0, "no CQE of the other QP reached the poll");
        // Nothing to clean now, and a whole lap more goes through.
        assert_eq!(cq.clean(hca.mmio(), OTHER, |_| panic!("nothing left")), 0);
        for i in 0..nent {
            dev.post_cqe(cq.cqn(), send_cqe(i as u16)).unwrap();
        }
        assert_eq!(poll_all(&hca, &mut cq, &mut wrs, 7).len(), nent as usize);
        assert_eq!(dev.cq_info(cq.cqn()).unwrap().overruns, 0);
        hca.destroy_cq(cq, &mut d).unwrap();
        hca.teardown(&mut d).unwrap();
    }
}

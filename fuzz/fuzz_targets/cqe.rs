//! CQEs as the device writes them: `decode_cqe` on arbitrary 64-byte images, then `Cq::poll` (and `Cq::arm`,
//! `Cq::switch_buffers`) over a ring of 64- or 128-byte CQEs, in one fragment or several, that a device fills
//! either correctly (each CQE must then come back exactly once, in order) or with arbitrary bytes anywhere.
//!
//! Asserted: no panic; a decoded completion is well-formed and names the `wr_id` the work-request table gave for
//! the QP and WQE counter the CQE carries; errors are typed and point at the CQE that caused them; a poll never
//! returns more than asked, never consumes more than one ring, returns exactly the completions the table handed
//! out (never one twice, never one skipped) and publishes its consumer index; the arm doorbell is one 64-bit write
//! of `sn << 28 | cmd | ci` and the CQ number.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_core::buf::QueueBuf;
use mlx5_core::cq::Cqe;
use mlx5_core::cq::{
    decode_cqe, Cq, CqeError, CqeFields, CqeOpcode, CqeSize, LinkLayer, Notify, WcFlags, WcOpcode, WcStatus,
    WorkCompletion, CQE64_SIZE, CQ_DOORBELL,
};
use mlx5_core::dbr::DbrPool;
use mlx5_core::prm::consts;
use mlx5_fuzz::{assert_wc_well_formed, bytes, flag, int, HeapDma, RegFile, Table, Unstructured, Write, UAR_OFF};

const QPN: u32 = 0x1a2b;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let images = int(&mut u, 0u8..=3);
    for _ in 0..images {
        single(&mut u);
    }
    ring(&mut u);
});

fn link(u: &mut Unstructured<'_>) -> LinkLayer {
    if flag(u) {
        LinkLayer::InfiniBand
    } else {
        LinkLayer::Ethernet
    }
}

/// One arbitrary image through `decode_cqe`.
fn single(u: &mut Unstructured<'_>) {
    let cqe = Cqe(bytes::<CQE64_SIZE>(u));
    let link = link(u);
    let cqn = int(u, 0u32..=0xff_ffff);
    let index = int(u, 0u32..=u32::MAX);
    let mut table = match int(u, 0u8..=2) {
        0 => Table::new(Vec::new(), true),
        1 => Table::new(vec![cqe.qpn()], false),
        _ => Table::new(Vec::new(), false),
    };
    let r = decode_cqe(&cqe, cqn, index, link, &mut table);
    check_decode(&cqe, cqn, index, link, &table, &r);
    // Decoding is a function of the image: the same bytes decode the same way again.
    let mut again = Table::new(table.known.clone(), table.all_known);
    let r2 = decode_cqe(&cqe, cqn, index, link, &mut again);
    assert_eq!(
        r.map(|o| o.map(|w| (w.status, w.opcode, w.byte_len))),
        r2.map(|o| o.map(|w| (w.status, w.opcode, w.byte_len)))
    );
}

fn check_decode(
    cqe: &Cqe,
    cqn: u32,
    index: u32,
    _link: LinkLayer,
    table: &Table,
    r: &Result<Option<WorkCompletion>, CqeError>,
) {
    let compressed = cqe.format() == consts::MLX5_COMPRESSED;
    let op = cqe.opcode();
    match *r {
        Err(CqeError::BadOpcode { cqn: c, op_own, index: i }) => {
            assert_eq!((c, op_own, i), (cqn, cqe.op_own(), index));
            assert!(
                compressed || matches!(op, CqeOpcode::Resize | CqeOpcode::Invalid | CqeOpcode::Unknown(_)),
                "{op:?} refused"
            );
            assert!(table.lookups.is_empty(), "a refused CQE still retired a work request");
        }
        Err(CqeError::UnknownQp { cqn: c, qpn, index: i }) => {
            assert_eq!((c, i), (cqn, index));
            assert!(!compressed);
            assert_eq!(table.lookups.len(), 1);
            let l = table.lookups[0];
            assert_eq!((l.qpn, l.answer), (qpn, None));
            assert!(qpn <= 0xff_ffff);
        }
        // The table names no SRQ for any QP, so no CQE can name an SRQ WQE it lacks.
        Err(CqeError::BadSrqWqe { qpn, .. }) => panic!("QP {qpn:#x} has no SRQ here"),
        Ok(None) => {
            assert!(!compressed && op == CqeOpcode::SigErr, "{op:?} decoded to nothing");
            assert!(table.lookups.is_empty());
        }
        Ok(Some(wc)) => {
            assert!(!compressed, "a compressed CQE decoded");
            assert_wc_well_formed(&wc);
            assert_eq!(table.lookups.len(), 1, "one completion, one lookup");
            let l = table.lookups[0];
            assert_eq!(Some(wc.wr_id), l.answer);
            assert_eq!((wc.qp_num, l.qpn, l.wqe_counter), (cqe.qpn(), cqe.qpn(), cqe.wqe_counter()));
            match op {
                CqeOpcode::Req => {
                    assert!(l.send);
                    assert_eq!(wc.status, WcStatus::Success);
                    assert_eq!(wc.wc_flags.0 & !WcFlags::WITH_IMM.0, 0);
                    let want_len = match wc.opcode {
                        WcOpcode::RdmaRead => cqe.byte_cnt(),
                        WcOpcode::CompSwap
                        | WcOpcode::FetchAdd
                        | WcOpcode::MaskedCompSwap
                        | WcOpcode::MaskedFetchAdd => 8,
                        WcOpcode::Send | WcOpcode::RdmaWrite => 0,
                        WcOpcode::Unknown(o) => {
                            assert_eq!(o, cqe.wqe_opcode());
                            0
                        }
                        WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => panic!("requester CQE decoded as a receive"),
                    };
                    assert_eq!(wc.byte_len, want_len);
                }
                CqeOpcode::RespWrImm | CqeOpcode::RespSend | CqeOpcode::RespSendImm | CqeOpcode::RespSendInv => {
                    assert!(!l.send);
                    assert_eq!(wc.status, WcStatus::Success);
                    let want = if op == CqeOpcode::RespWrImm { WcOpcode::RecvRdmaWithImm } else { WcOpcode::Recv };
                    assert_eq!(wc.opcode, want);
                    assert_eq!(wc.byte_len, cqe.byte_cnt());
                    assert_eq!(wc.src_qp, cqe.flags_rqpn() & 0xff_ffff);
                    // As rdma-core's mlx5 reads them on every link layer (on RoCE the sl carries the packet type).
                    assert_eq!((wc.sl, wc.slid), (((cqe.flags_rqpn() >> 24) & 0xf) as u8, cqe.slid()));
                    let with_imm = matches!(op, CqeOpcode::RespWrImm | CqeOpcode::RespSendImm);
                    assert_eq!(wc.wc_flags.contains(WcFlags::WITH_IMM), with_imm);
                    assert_eq!(wc.wc_flags.contains(WcFlags::WITH_INV), op == CqeOpcode::RespSendInv);
                }
                CqeOpcode::ReqErr | CqeOpcode::RespErr => {
                    assert_eq!(l.send, op == CqeOpcode::ReqErr);
                    assert_eq!(wc.status, WcStatus::from_syndrome(cqe.err_syndrome()));
                    assert_eq!(wc.vendor_err, u32::from(cqe.vendor_err()));
                    assert_eq!(wc.qp_num, cqe.err_qpn());
                }
                other => panic!("{other:?} decoded to a completion"),
            }
        }
    }
}

/// The harness's view of a CQ ring: where the device writes, and what it wrote in order.
struct Device {
    /// Producer index of a well-behaved device.
    pi: u32,
    /// WQE counters (tags) of the well-formed CQEs written and not yet polled, oldest first.
    expected: std::collections::VecDeque<u16>,
    /// Something other than a well-behaved device touched the ring: only the generic properties hold.
    hostile: bool,
}

fn entry_iova(cq: &Cq, index: u32) -> u64 {
    let stride = cq.cqe_size().bytes();
    let (r, o) = cq.buf().locate(((index & (cq.nent() - 1)) as usize) * stride);
    r.iova() + o as u64
}

fn good_cqe(u: &mut Unstructured<'_>, tag: u16, owner: u8) -> Cqe {
    let ops = [
        consts::MLX5_CQE_REQ,
        consts::MLX5_CQE_RESP_WR_IMM,
        consts::MLX5_CQE_RESP_SEND,
        consts::MLX5_CQE_RESP_SEND_IMM,
        consts::MLX5_CQE_RESP_SEND_INV,
        consts::MLX5_CQE_REQ_ERR,
        consts::MLX5_CQE_RESP_ERR,
    ];
    let f = CqeFields {
        opcode: ops[int(u, 0usize..=ops.len() - 1)] as u8,
        owner,
        solicited: flag(u),
        wqe_opcode: int(u, 0u8..=u8::MAX),
        qpn: QPN,
        wqe_counter: tag,
        byte_cnt: int(u, 0u32..=u32::MAX),
        imm_inval_pkey: int(u, 0u32..=u32::MAX),
        flags_rqpn: int(u, 0u32..=u32::MAX),
        srqn: 0,
        slid: int(u, 0u16..=u16::MAX),
        ml_path: int(u, 0u8..=u8::MAX),
        hds_ip_ext: int(u, 0u8..=u8::MAX),
        l4_l3_hdr_type: int(u, 0u8..=u8::MAX),
        vlan_info: int(u, 0u16..=u16::MAX),
        syndrome: int(u, 0u8..=u8::MAX),
        vendor_err: int(u, 0u8..=u8::MAX),
        timestamp: int(u, 0u64..=u64::MAX),
    };
    f.emit()
}

fn ring(u: &mut Unstructured<'_>) {
    let size = if flag(u) { CqeSize::B128 } else { CqeSize::B64 };
    let log_nent = int(u, 0u8..=7);
    // Rings above 4 KiB come in 4 KiB fragments when the allocator has no larger pieces.
    // SAFETY: declared before everything that holds its regions, so dropped last.
    let mem = unsafe { HeapDma::for_fuzzing(flag(u).then_some(4096)) };
    let bar = RegFile::new();
    let buf = QueueBuf::alloc(&mem, size.bytes() << log_nent).expect("ring memory");
    Cq::init_buf(&buf, log_nent, size);
    let mut pool = DbrPool::<1>::new(64);
    let dbrec = pool.alloc(&mem).expect("doorbell record");
    let cqn = int(u, 0u32..=0xff_ffff);
    let link = link(u);
    let mut cq = Cq::new(buf, dbrec, cqn, log_nent, size, UAR_OFF, link);
    let mut table = Table::new(vec![QPN], false);
    let mut dev = Device { pi: 0, expected: Default::default(), hostile: false };

    for _ in 0..256 {
        if u.is_empty() {
            break;
        }
        match int(u, 0u8..=7) {
            // A well-behaved device completes the next WQE (never overrunning the consumer).
            0..=2 => {
                if dev.pi.wrapping_sub(cq.cons_index()) >= cq.nent() {
                    continue;
                }
                let tag = dev.pi as u16;
                let owner = ((dev.pi >> cq.log_nent()) & 1) as u8;
                let cqe = good_cqe(u, tag, owner);
                let mut img = vec![0u8; size.bytes()];
                let n = img.len();
                img[n - CQE64_SIZE..].copy_from_slice(&cqe.0);
                img[..n - CQE64_SIZE].fill(0xa5);
                assert!(mem.try_write(entry_iova(&cq, dev.pi), &img));
                dev.pi = dev.pi.wrapping_add(1);
                dev.expected.push_back(tag);
            }
            // A device writing arbitrary bytes into any entry.
            3 => {
                let at = int(u, 0u32..=u32::MAX);
                let img = bytes::<128>(u);
                let iova = entry_iova(&cq, at);
                assert!(mem.try_write(iova, &img[..size.bytes()]));
                if flag(u) {
                    table.known.push(int(u, 0u32..=0xff_ffff));
                }
                dev.hostile = true;
            }
            // Only an owner byte flipped.
            4 => {
                let at = int(u, 0u32..=u32::MAX);
                let op_own = int(u, 0u8..=u8::MAX);
                let iova = entry_iova(&cq, at) + size.bytes() as u64 - 1;
                assert!(mem.try_write(iova, &[op_own]));
                dev.hostile = true;
            }
            5 | 6 => poll(u, &bar, &mut cq, &mut table, &mut dev),
            _ => {
                if flag(u) {
                    arm(u, &bar, &cq);
                } else {
                    resize(u, &mem, &bar, &mut cq, &mut dev);
                }
            }
        }
    }
    // Whatever is left in a well-behaved ring comes out, in order.
    if !dev.hostile {
        let left = dev.expected.len();
        let mut got = 0;
        let mut wc = [WorkCompletion::default(); 16];
        while got < left {
            let l0 = table.lookups.len();
            let n = cq.poll(&bar, &mut table, &mut wc).expect("a well-behaved ring polls cleanly");
            assert!(n > 0, "{} completions written but not returned", left - got);
            let tags: Vec<u16> = table.lookups[l0..].iter().map(|l| l.wqe_counter).collect();
            let want: Vec<u16> = dev.expected.drain(..n).collect();
            assert_eq!(tags, want);
            got += n;
        }
        assert_eq!(cq.poll(&bar, &mut table, &mut wc), Ok(0), "nothing beyond what the device wrote");
    }
}

fn poll(u: &mut Unstructured<'_>, bar: &RegFile<'_>, cq: &mut Cq, table: &mut Table, dev: &mut Device) {
    let k = int(u, 0usize..=8);
    let mut wc = [WorkCompletion::default(); 8];
    let ci0 = cq.cons_index();
    let l0 = table.lookups.len();
    let r = cq.poll(bar, table, &mut wc[..k]);
    let consumed = cq.cons_index().wrapping_sub(ci0);
    assert!(consumed <= cq.nent(), "one poll consumed {consumed} entries of a {}-entry ring", cq.nent());
    let answers: Vec<u64> = table.lookups[l0..].iter().filter_map(|l| l.answer).collect();
    match r {
        Ok(n) => {
            assert!(n <= k);
            assert!(consumed as usize >= n);
            let ids: Vec<u64> = wc[..n].iter().map(|w| w.wr_id).collect();
            assert_eq!(ids, answers, "completions returned are exactly the work requests retired");
            for w in &wc[..n] {
                assert_wc_well_formed(w);
            }
        }
        Err(e) => {
            assert!(answers.is_empty(), "an error poll retired work requests it did not return");
            assert!(consumed >= 1);
            let (c, i) = match e {
                CqeError::UnknownQp { cqn, index, .. }
                | CqeError::BadOpcode { cqn, index, .. }
                | CqeError::BadSrqWqe { cqn, index, .. } => (cqn, index),
            };
            assert_eq!((c, i), (cq.cqn(), cq.cons_index().wrapping_sub(1)), "the error names the CQE consumed");
        }
    }
    if consumed > 0 {
        assert_eq!(cq.dbrec().read_be32(0), cq.cons_index() & 0xff_ffff, "consumer index published");
    }
    if !dev.hostile {
        let n = r.expect("a well-behaved ring polls cleanly");
        assert_eq!(n, k.min(dev.expected.len()));
        assert_eq!(consumed as usize, n);
        let tags: Vec<u16> = table.lookups[l0..].iter().map(|l| l.wqe_counter).collect();
        let want: Vec<u16> = dev.expected.drain(..n).collect();
        assert_eq!(tags, want, "completions in the order the device wrote them");
    }
}

fn arm(u: &mut Unstructured<'_>, bar: &RegFile<'_>, cq: &Cq) {
    let sn = int(u, 0u32..=u32::MAX);
    let (notify, cmd) = if flag(u) {
        (Notify::Solicited, consts::MLX5_CQ_DB_REQ_NOT_SOL)
    } else {
        (Notify::NextComp, consts::MLX5_CQ_DB_REQ_NOT)
    };
    let w0 = bar.writes_len();
    cq.arm(bar, sn, notify);
    let v = ((sn & 3) << 28) | cmd | (cq.cons_index() & 0xff_ffff);
    assert_eq!(cq.dbrec().read_be32(1), v);
    let want = Write { off: UAR_OFF + CQ_DOORBELL, value: (u64::from(v) << 32) | u64::from(cq.cqn()), width: 8 };
    assert_eq!(bar.writes_since(w0), [want]);
}

fn resize(u: &mut Unstructured<'_>, mem: &HeapDma, bar: &RegFile<'_>, cq: &mut Cq, dev: &mut Device) {
    let new_log = int(u, 0u8..=7);
    let size = cq.cqe_size();
    let Ok(nb) = QueueBuf::alloc(mem, size.bytes() << new_log) else { return };
    Cq::init_buf(&nb, new_log, size);
    let ci0 = cq.cons_index();
    // The old buffer is dropped, not freed: `HeapDma` reclaims it at the end.
    let _old = cq.switch_buffers(bar, nb, new_log);
    assert_eq!(cq.log_nent(), new_log);
    assert_eq!(cq.cons_index(), ci0.wrapping_add(1), "the resize CQE is skipped");
    assert_eq!(cq.dbrec().read_be32(0), cq.cons_index() & 0xff_ffff);
    // The well-behaved model does not follow a resize: from here on only the generic properties are checked.
    dev.hostile = true;
    dev.expected.clear();
}

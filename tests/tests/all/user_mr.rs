//! Memory registration of ordinary process memory (`Dma::map_user` + `Hca::reg_user_mr`): heap buffers at odd
//! offsets and lengths carry RC SEND, RDMA WRITE and READ at their CPU address or any other `iova`; the MTT page
//! size follows the memory's layout (read back from the CREATE_MKEY input); re-registration, relaxed ordering,
//! deregistration and the refusals.

use std::ptr::NonNull;

use mlx5_core::cq::{Cq, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::hca::{Config, Error, Hca, Rereg};
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::prm::{ifc, MsgBuf, Opcode};
use mlx5_core::qp::{Qp, QpCap, RecvWr, SendFlags, SendOp, SendWr, Sge};
use mlx5_core::trace::{CmdRecord, CmdTrace};
use mlx5_sim::testkit::{Node, RcOpts};
use mlx5_sim::{MkeyAccess, MkeyFault, SimConfig, SimDevice, SimDma, SimMmio};

/// The CREATE_MKEY inputs an HCA sent, in order.
#[derive(Default)]
struct Mkeys(Vec<Vec<u8>>);

impl CmdTrace for Mkeys {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        if rec.opcode != Opcode::CreateMkey {
            return;
        }
        let (m, mut v, mut off) = (rec.input, Vec::new(), 0);
        while off < m.len() {
            let c = m.chunk(off);
            let n = c.len().min(m.len() - off);
            v.extend_from_slice(&c[..n]);
            off += n;
        }
        self.0.push(v);
    }
}

/// The mkc fields of a CREATE_MKEY input: (start_addr, len, log_page_size, translations_octword_size, RO write,
/// RO read).
fn mkc(input: &[u8]) -> (u64, u64, u32, u32, u32, u32) {
    use ifc::mkc as m;
    let at = |f: mlx5_core::prm::Field| f.at(ifc::create_mkey_in::MEMORY_KEY_MKEY_ENTRY);
    (
        MsgBuf::get64(input, at(m::START_ADDR)),
        MsgBuf::get64(input, at(m::LEN)),
        MsgBuf::get(input, at(m::LOG_PAGE_SIZE)),
        MsgBuf::get(input, at(m::TRANSLATIONS_OCTWORD_SIZE)),
        MsgBuf::get(input, at(m::RELAXED_ORDERING_WRITE)),
        MsgBuf::get(input, at(m::RELAXED_ORDERING_READ)),
    )
}

/// MTT entry `i` of a CREATE_MKEY input.
fn mtt(input: &[u8], i: usize) -> u64 {
    MsgBuf::read_u64(input, ifc::create_mkey_in::KLM_PAS_MTT.byte_off() + 8 * i)
}

type TracedHca = Hca<SimMmio, SimDma, Mkeys>;

fn up(cfg: SimConfig) -> (SimDevice, TracedHca, mlx5_sim::SimDelay) {
    let dev = SimDevice::new(cfg);
    let mut d = dev.delay();
    let hca = Hca::bring_up(dev.mmio(), dev.dma(), Mkeys::default(), &mut d, Config::default()).expect("bring-up");
    (dev, hca, d)
}

/// A heap buffer with room for `len` bytes starting `off` bytes past an address aligned to exactly `align` (and not
/// to `2 * align`). Returns the buffer and that address; every access goes through pointers derived from it.
fn heap(len: usize, align: usize, off: usize) -> (Vec<u8>, NonNull<u8>) {
    let mut v = vec![0u8; len + off + 3 * align];
    let start = v.as_ptr() as usize;
    let at = start.next_multiple_of(2 * align) + align + off - start;
    let p = NonNull::new(v.as_mut_ptr().wrapping_add(at)).unwrap();
    (v, p)
}

/// Maps `len` bytes at `p` for the device.
fn map(dma: &SimDma, p: NonNull<u8>, len: usize) -> DmaRegion {
    // SAFETY: every caller keeps the buffer behind `p` alive until the region is freed, and maps it once.
    unsafe { dma.map_user(p, len) }.expect("map_user")
}

/// Copies `len` bytes at `p + off`.
fn read(p: NonNull<u8>, off: usize, len: usize) -> Vec<u8> {
    // SAFETY: inside a live test buffer; read after the device work that wrote it completed.
    unsafe { std::slice::from_raw_parts(p.as_ptr().add(off), len).to_vec() }
}

/// Writes `data` at `p + off`.
fn write(p: NonNull<u8>, off: usize, data: &[u8]) {
    // SAFETY: inside a live test buffer; no device work uses these bytes while they are written.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p.as_ptr().add(off), data.len()) };
}

/// Polls until one completion arrives (bounded), routing it to the QPs on the CQ.
fn poll1(n: &Node, cq: &mut Cq, qps: &mut [&mut Qp]) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    for _ in 0..10_000 {
        if cq.poll(n.hca.mmio(), qps, &mut wc).unwrap() == 1 {
            return wc[0];
        }
    }
    panic!("no completion");
}

fn wr(wr_id: u64, op: SendOp, sge: &[Sge]) -> SendWr<'_> {
    SendWr { wr_id, op, sg_list: sge, flags: SendFlags::SIGNALED, inline: None, ud: None }
}

fn cap() -> QpCap {
    QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 0 }
}

#[test]
fn a_heap_buffer_at_an_odd_offset_carries_send_write_and_read_at_any_iova() {
    let mut n = Node::new(SimConfig::default(), 1 << 16);
    let (mut cq, mut a, mut b) = n.rc_pair(cap(), 63, &RcOpts::default());
    let dma = n.dev.dma();
    // The remote buffer: 40 001 bytes from 13 bytes into a page. The local one: a plain Vec.
    let (rv, rp) = heap(40_001, 4096, 13);
    let rlen = 40_001;
    let remote = map(&dma, rp, rlen);
    let mut lv = vec![0u8; 9_999];
    let lp = NonNull::new(lv.as_mut_ptr()).unwrap();
    let local = map(&dma, lp, lv.len());
    let all = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    let rmr = n.hca.reg_user_mr(&n.pd, remote.view(), None, all, &mut n.d).unwrap();
    let lmr = n.hca.reg_user_mr(&n.pd, local.view(), None, Access::LOCAL_WRITE, &mut n.d).unwrap();
    assert_eq!((rmr.addr, rmr.dma, rmr.length), (rp.as_ptr() as u64, remote.iova(), rlen as u64));
    // The same memory behind a second key at a virtual address of its own (the same offset in the page).
    let iova = 0x5555_0000_0000 + (rp.as_ptr() as u64 & 0xfff);
    let imr = n.hca.reg_user_mr(&n.pd, remote.view(), Some(iova), all, &mut n.d).unwrap();
    assert_eq!((imr.addr, imr.length), (iova, rlen as u64));
    let lsge = |off: usize, len: u32| Sge { addr: lp.as_ptr() as u64 + off as u64, length: len, lkey: lmr.lkey };
    let data: Vec<u8> = (0..7_001u32).map(|k| (k * 7 + 3) as u8).collect();
    write(lp, 0, &data);

    // SEND into the user buffer.
    let rsge = [Sge { addr: rmr.addr + 100, length: 8_000, lkey: rmr.lkey }];
    n.hca.post_recv(&mut b, &[RecvWr { wr_id: 10, sg_list: &rsge }]).unwrap();
    n.hca.post_send(&mut a, &[wr(1, SendOp::Send, &[lsge(0, 7_001)])]).unwrap();
    let w1 = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    let w2 = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    let recv = if w1.wr_id == 10 { w1 } else { w2 };
    assert_eq!((recv.status, recv.byte_len), (WcStatus::Success, 7_001));
    assert!([w1, w2].iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(read(rp, 100, 7_001), data);

    // RDMA WRITE at the CPU address, and at the custom iova.
    let op = SendOp::RdmaWrite { remote_addr: rmr.addr + 20_000, rkey: rmr.rkey };
    n.hca.post_send(&mut a, &[wr(2, op, &[lsge(0, 5_000)])]).unwrap();
    let w = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    assert_eq!((w.wr_id, w.opcode, w.status), (2, WcOpcode::RdmaWrite, WcStatus::Success));
    assert_eq!(read(rp, 20_000, 5_000), data[..5_000]);
    let op = SendOp::RdmaWrite { remote_addr: iova + 35_000, rkey: imr.rkey };
    n.hca.post_send(&mut a, &[wr(3, op, &[lsge(1, 5_001)])]).unwrap();
    let w = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    assert_eq!((w.wr_id, w.status), (3, WcStatus::Success));
    assert_eq!(read(rp, 35_000, 5_001), data[1..5_002], "the custom iova reaches the same bytes");

    // RDMA READ back from both addresses into the local buffer.
    let op = SendOp::RdmaRead { remote_addr: rmr.addr + 100, rkey: rmr.rkey };
    n.hca.post_send(&mut a, &[wr(4, op, &[lsge(8_000, 1_999)])]).unwrap();
    let w = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    assert_eq!((w.opcode, w.byte_len, w.status), (WcOpcode::RdmaRead, 1_999, WcStatus::Success));
    assert_eq!(read(lp, 8_000, 1_999), data[..1_999]);
    let op = SendOp::RdmaRead { remote_addr: iova + rlen as u64 - 1_000, rkey: imr.rkey };
    n.hca.post_send(&mut a, &[wr(5, op, &[lsge(7_001, 1_000)])]).unwrap();
    let w = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    assert_eq!(w.status, WcStatus::Success);
    assert_eq!(read(lp, 7_001, 1_000), read(rp, rlen - 1_000, 1_000), "the last byte of the key is reachable");

    // One byte past the end is the remote side's access error, and nothing is written.
    let op = SendOp::RdmaWrite { remote_addr: rmr.addr + rlen as u64 - 4, rkey: rmr.rkey };
    let before = read(rp, rlen - 4, 4);
    n.hca.post_send(&mut a, &[wr(6, op, &[lsge(0, 5)])]).unwrap();
    let w = poll1(&n, &mut cq, &mut [&mut a, &mut b]);
    assert_eq!((w.wr_id, w.status), (6, WcStatus::RemAccessErr));
    assert_eq!(read(rp, rlen - 4, 4), before);
    assert!(n.dev.dma_faults().is_empty(), "refused by the key, not by the IOMMU");

    n.drop_pair(cq, a, b);
    for mr in [rmr, lmr, imr] {
        n.hca.dereg_mr(mr, &mut n.d).map_err(|e| e.error).unwrap();
    }
    // SAFETY: the keys over them are destroyed; each region is freed once.
    unsafe {
        dma.free(remote);
        dma.free(local);
    }
    n.finish();
    drop((rv, lv));
}

#[test]
fn the_mtt_page_size_follows_the_layout_of_the_memory() {
    let (dev, mut hca, mut d) = up(SimConfig::default());
    let pd = hca.alloc_pd(&mut d).unwrap();
    let dma = dev.dma();
    // (alignment of the buffer's page, offset, length, iova) -> (page shift, pages).
    let custom = 0x10_0000_1000;
    let cases: [(usize, usize, usize, Option<u64>, u32, u64); 4] = [
        (4096, 0x10, 10_000, None, 12, 3),
        (1 << 16, 0, 256 << 10, None, 16, 4),
        (2 << 20, 0, 2 << 20, None, 21, 1),
        // The same 64 KiB-aligned memory at an iova that agrees with it only below 8 KiB: 4 KiB pages.
        (1 << 16, 0, 256 << 10, Some(custom), 12, 64),
    ];
    for (k, &(align, off, len, iova, shift, pages)) in cases.iter().enumerate() {
        let (v, p) = heap(len, align, off);
        let r = map(&dma, p, len);
        let mr = hca.reg_user_mr(&pd, r.view(), iova, Access::LOCAL_WRITE, &mut d).unwrap();
        let va = iova.unwrap_or(p.as_ptr() as u64);
        assert_eq!((mr.page_shift, mr.addr, mr.length), (shift, va, len as u64), "case {k}");
        let input = hca.cmdq().tracer().0.last().cloned().expect("CREATE_MKEY traced");
        let octwords = pages.div_ceil(2) as u32;
        assert_eq!(mkc(&input), (va, len as u64, shift, octwords, 0, 0), "case {k}");
        // The entries are the bus addresses of the pages, from the one holding the first byte.
        let page = 1u64 << shift;
        for i in 0..pages as usize {
            assert_eq!(mtt(&input, i), (r.iova() & !(page - 1)) + i as u64 * page, "case {k} entry {i}");
        }
        // The key translates the last byte to the last byte of the mapping.
        let last = dev.mkey_access(mr.lkey, Some(pd.pdn()), va + len as u64 - 1, 1, MkeyAccess::LOCAL_WRITE);
        assert_eq!(last, Ok(vec![(r.iova() + len as u64 - 1, 1)]), "case {k}");
        hca.dereg_mr(mr, &mut d).map_err(|e| e.error).unwrap();
        // SAFETY: the key is destroyed; freed once.
        unsafe { dma.free(r) };
        drop(v);
    }
    hca.dealloc_pd(pd, &mut d).map_err(|e| e.error).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
}

#[test]
fn relaxed_ordering_is_accepted_and_set_only_where_the_device_has_it() {
    for cap in [false, true] {
        let (dev, mut hca, mut d) = up(SimConfig { relaxed_ordering: cap, ..SimConfig::default() });
        let pd = hca.alloc_pd(&mut d).unwrap();
        let (v, p) = heap(5000, 4096, 7);
        let r = map(&dev.dma(), p, 5000);
        let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::RELAXED_ORDERING;
        let mr = hca.reg_user_mr(&pd, r.view(), None, access, &mut d).unwrap();
        assert!(mr.access.contains(Access::RELAXED_ORDERING));
        let input = hca.cmdq().tracer().0.last().cloned().unwrap();
        let (.., ro_w, ro_r) = mkc(&input);
        assert_eq!((ro_w, ro_r), (u32::from(cap), u32::from(cap)), "with the capability: {cap}");
        // Without the flag, never.
        let plain = hca.reg_user_mr(&pd, r.view(), None, Access::LOCAL_WRITE, &mut d).unwrap();
        let input = hca.cmdq().tracer().0.last().cloned().unwrap();
        assert_eq!(mkc(&input).4 + mkc(&input).5, 0);
        for mr in [mr, plain] {
            hca.dereg_mr(mr, &mut d).map_err(|e| e.error).unwrap();
        }
        // SAFETY: the keys are destroyed; freed once.
        unsafe { dev.dma().free(r) };
        hca.dealloc_pd(pd, &mut d).map_err(|e| e.error).unwrap();
        hca.teardown(&mut d).unwrap();
        drop(v);
    }
}

#[test]
fn rereg_moves_a_key_to_new_memory_pd_and_access_and_retires_the_old_key() {
    let (dev, mut hca, mut d) = up(SimConfig::default());
    let pd = hca.alloc_pd(&mut d).unwrap();
    let pd2 = hca.alloc_pd(&mut d).unwrap();
    let dma = dev.dma();
    let (va, pa) = heap(6000, 4096, 5);
    let (vb, pb) = heap(20_000, 1 << 16, 0);
    let ra = map(&dma, pa, 6000);
    let rb = map(&dma, pb, 20_000);
    let ro = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let rw = ro | Access::REMOTE_WRITE;
    let check = |key: u32, pd: u32, va: u64, len: u64, a: MkeyAccess| dev.mkey_access(key, Some(pd), va, len, a);
    let mr = hca.reg_user_mr(&pd, ra.view(), None, ro, &mut d).unwrap();
    let old = mr.rkey;
    let a_va = pa.as_ptr() as u64;

    // Refused requests keep the old key, untouched.
    let sent = dev.executed().len();
    let e = hca.rereg_mr(mr, Rereg::default(), &mut d).unwrap_err();
    assert!(matches!((&e.error, &e.new), (Error::NothingToRereg, None)), "{}", e.error);
    let e = hca.rereg_mr(e.mr, Rereg { access: Some(Access::REMOTE_WRITE), ..Rereg::default() }, &mut d).unwrap_err();
    assert!(matches!(e.error, Error::BadAccess { .. }), "{}", e.error);
    let odd = Some((rb.view(), Some(0x7000_0000_0123)));
    let e = hca.rereg_mr(e.mr, Rereg { translation: odd, ..Rereg::default() }, &mut d).unwrap_err();
    assert!(matches!(e.error, Error::IovaMismatch { .. }), "{}", e.error);
    assert_eq!(dev.executed().len(), sent, "refused before any command");
    let mr = e.mr;
    assert_eq!(check(old, pd.pdn(), a_va, 6000, MkeyAccess::REMOTE_READ).map(|p| p.len()), Ok(1));

    // New memory and access: a new key over B; A's key is gone.
    let req = Rereg { translation: Some((rb.view(), None)), access: Some(rw), ..Rereg::default() };
    let mr = hca.rereg_mr(mr, req, &mut d).unwrap();
    assert_ne!(mr.rkey, old);
    // 20 000 bytes from a 64 KiB boundary fit one 32 KiB page: no larger page is needed.
    assert_eq!((mr.addr, mr.length, mr.access, mr.page_shift), (pb.as_ptr() as u64, 20_000, rw, 15));
    assert_eq!(check(old, pd.pdn(), a_va, 8, MkeyAccess::LOCAL_READ), Err(MkeyFault::UnknownKey));
    let b_va = pb.as_ptr() as u64;
    assert_eq!(check(mr.rkey, pd.pdn(), b_va, 20_000, MkeyAccess::REMOTE_WRITE), Ok(vec![(rb.iova(), 20_000)]));

    // The PD alone: same range and translation, new key in the new PD.
    let old = mr.rkey;
    let before = (mr.addr, mr.dma, mr.length, mr.page_shift);
    let mr = hca.rereg_mr(mr, Rereg { pd: Some(&pd2), ..Rereg::default() }, &mut d).unwrap();
    assert_eq!((mr.pd, (mr.addr, mr.dma, mr.length, mr.page_shift)), (pd2.pdn(), before));
    assert_eq!(check(old, pd.pdn(), b_va, 8, MkeyAccess::LOCAL_READ), Err(MkeyFault::UnknownKey));
    assert_eq!(check(mr.rkey, pd.pdn(), b_va, 8, MkeyAccess::LOCAL_READ), Err(MkeyFault::PdMismatch));
    assert!(check(mr.rkey, pd2.pdn(), b_va, 8, MkeyAccess::REMOTE_WRITE).is_ok());
    // Access alone, back to read-only.
    let mr = hca.rereg_mr(mr, Rereg { access: Some(ro), ..Rereg::default() }, &mut d).unwrap();
    let denied = check(mr.rkey, pd2.pdn(), b_va, 8, MkeyAccess::REMOTE_WRITE);
    assert_eq!(denied, Err(MkeyFault::AccessDenied(MkeyAccess::REMOTE_WRITE)));
    assert_eq!(dev.mkey_count(), 1, "one key at a time");

    hca.dereg_mr(mr, &mut d).map_err(|e| e.error).unwrap();
    // SAFETY: no key covers them any more; each freed once.
    unsafe {
        dma.free(ra);
        dma.free(rb);
    }
    for pd in [pd, pd2] {
        hca.dealloc_pd(pd, &mut d).map_err(|e| e.error).unwrap();
    }
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
    drop((va, vb));
}

#[test]
fn after_dereg_and_unmap_the_device_cannot_reach_the_memory() {
    let mut n = Node::new(SimConfig::default(), 1 << 16);
    let (mut cq, mut a, mut b) = n.rc_pair(cap(), 63, &RcOpts::default());
    let dma = n.dev.dma();
    let (v, p) = heap(3000, 4096, 99);
    let r = map(&dma, p, 3000);
    let mr = n.hca.reg_user_mr(&n.pd, r.view(), None, Access::LOCAL_WRITE | Access::REMOTE_WRITE, &mut n.d).unwrap();
    // A physical-address key reaches any mapped bus address: while mapped, the memory is reachable through it.
    let pa = n.hca.reg_dma_mr(&n.pd, Access::LOCAL_WRITE | Access::REMOTE_WRITE, &mut n.d).unwrap();
    let iova = r.iova();
    let src = Sge { addr: n.addr(0), length: 16, lkey: n.mr.lkey };
    n.put(0, b"sixteen bytes..!");
    let op = SendOp::RdmaWrite { remote_addr: iova, rkey: pa.rkey };
    n.hca.post_send(&mut a, &[wr(1, op, &[src])]).unwrap();
    assert_eq!(poll1(&n, &mut cq, &mut [&mut a, &mut b]).status, WcStatus::Success);
    assert_eq!(read(p, 0, 16), b"sixteen bytes..!");

    // Deregistered and unmapped: the same write is refused, and the process memory stays as it was.
    let key = mr.rkey;
    n.hca.dereg_mr(mr, &mut n.d).map_err(|e| e.error).unwrap();
    // SAFETY: its key is destroyed; freed once.
    unsafe { dma.free(r) };
    assert_eq!(n.dev.mkey_access(key, None, p.as_ptr() as u64, 1, MkeyAccess::LOCAL_READ), Err(MkeyFault::UnknownKey));
    assert_eq!(n.dev.mkey_access(pa.rkey, None, iova, 16, MkeyAccess::LOCAL_READ), Err(MkeyFault::NotMapped { iova }));
    write(p, 0, &[0u8; 16]);
    n.hca.post_send(&mut a, &[wr(2, op, &[src])]).unwrap();
    assert_eq!(poll1(&n, &mut cq, &mut [&mut a, &mut b]).status, WcStatus::RemAccessErr);
    assert_eq!(read(p, 0, 16), [0u8; 16]);

    n.drop_pair(cq, a, b);
    n.hca.dereg_mr(pa, &mut n.d).map_err(|e| e.error).unwrap();
    n.finish();
    drop(v);
}

#[test]
fn registrations_the_device_cannot_take_are_refused_before_any_command() {
    let (dev, mut hca, mut d) = up(SimConfig::default());
    let pd = hca.alloc_pd(&mut d).unwrap();
    let dma = dev.dma();
    let (v, p) = heap(100, 4096, 0x40);
    let r = map(&dma, p, 100);
    let sent = dev.executed().len();
    let reg = |hca: &mut TracedHca, view, iova, access, d: &mut mlx5_sim::SimDelay| {
        hca.reg_user_mr(&pd, view, iova, access, d).map(|mr: Mr| mr.lkey)
    };
    let lw = Access::LOCAL_WRITE;
    let e = reg(&mut hca, r.slice(0, 0).unwrap(), None, lw, &mut d).unwrap_err();
    assert!(matches!(e, Error::BadSize { requested: 0, .. }), "{e}");
    let e = reg(&mut hca, r.view(), Some(u64::MAX - 50), lw, &mut d).unwrap_err();
    assert_eq!(e, Error::IovaOverflow { iova: u64::MAX - 50, len: 100 });
    let e = reg(&mut hca, r.view(), Some(0x1000), lw, &mut d).unwrap_err();
    assert_eq!(e, Error::IovaMismatch { iova: 0x1000, dma: r.iova() });
    let e = reg(&mut hca, r.view(), None, Access::REMOTE_WRITE, &mut d).unwrap_err();
    assert!(matches!(e, Error::BadAccess { .. }), "{e}");
    let e = reg(&mut hca, r.view(), None, Access(lw.0 | 0x40), &mut d).unwrap_err();
    assert!(matches!(e, Error::NotSupported { .. }), "{e}");
    assert_eq!(dev.executed().len(), sent);
    // Memory that cannot be made reachable is refused by the mapping itself.
    // SAFETY: a refused mapping touches nothing.
    let again = unsafe { dma.map_user(p, 100) };
    assert!(matches!(again, Err(mlx5_core::hal::DmaError::Unreachable { len: 100, .. })));
    // SAFETY: never registered; freed once.
    unsafe { dma.free(r) };
    hca.dealloc_pd(pd, &mut d).map_err(|e| e.error).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
    drop(v);
}

#[test]
fn rereg_failures_never_lose_a_live_key() {
    use mlx5_core::prm::consts;
    use mlx5_sim::Fault;
    let (dev, mut hca, mut d) = up(SimConfig::default());
    let pd = hca.alloc_pd(&mut d).unwrap();
    let dma = dev.dma();
    let (v, p) = heap(8192, 4096, 0);
    let r = map(&dma, p, 8192);
    let va = p.as_ptr() as u64;
    let rights = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let mr = hca.reg_user_mr(&pd, r.view(), None, rights, &mut d).unwrap();
    let old = mr.lkey;
    let bad = consts::MLX5_CMD_STAT_BAD_PARAM_ERR;
    // Firmware refuses the new key: the old one is handed back, still live.
    let refuse = |opcode: u16| Fault::Status { opcode, status: bad, syndrome: 0x1234, times: 1 };
    dev.inject(refuse(consts::MLX5_CMD_OP_CREATE_MKEY));
    let e = hca.rereg_mr(mr, Rereg { access: Some(Access::LOCAL_WRITE), ..Rereg::default() }, &mut d).unwrap_err();
    assert!(e.new.is_none() && matches!(e.error, Error::Cmd(_)), "{}", e.error);
    assert_eq!(e.mr.lkey, old);
    assert!(dev.mkey_access(old, Some(pd.pdn()), va, 8192, MkeyAccess::REMOTE_READ).is_ok());
    // Firmware refuses to destroy the old key: both come back, both live, and the old one can go later.
    dev.inject(refuse(consts::MLX5_CMD_OP_DESTROY_MKEY));
    let e = hca.rereg_mr(e.mr, Rereg { access: Some(Access::LOCAL_WRITE), ..Rereg::default() }, &mut d).unwrap_err();
    let new = e.new.expect("the new key was made");
    assert_eq!(e.mr.lkey, old);
    assert_eq!(dev.mkey_count(), 2);
    assert!(dev.mkey_access(new.lkey, Some(pd.pdn()), va, 8192, MkeyAccess::LOCAL_WRITE).is_ok());
    hca.dereg_mr(e.mr, &mut d).map_err(|e| e.error).unwrap();
    // An all-IOVA key stays one when only its access changes.
    let all = hca.reg_dma_mr(&pd, Access::LOCAL_WRITE, &mut d).unwrap();
    let all = hca.rereg_mr(all, Rereg { access: Some(rights), ..Rereg::default() }, &mut d).unwrap();
    assert_eq!((all.addr, all.length, all.page_shift), (0, u64::MAX, 0));
    assert_eq!(dev.mkey_access(all.lkey, None, r.iova(), 8, MkeyAccess::REMOTE_READ), Ok(vec![(r.iova(), 8)]));
    for mr in [new, all] {
        hca.dereg_mr(mr, &mut d).map_err(|e| e.error).unwrap();
    }
    // SAFETY: no key covers it; freed once.
    unsafe { dma.free(r) };
    hca.dealloc_pd(pd, &mut d).map_err(|e| e.error).unwrap();
    hca.teardown(&mut d).unwrap();
    assert_eq!(dev.dma_outstanding(), (0, 0));
    drop(v);
}

//! Memory registration of ordinary process memory through the verbs API (`ibv_reg_mr`, `ibv_reg_mr_iova`,
//! `ibv_rereg_mr`, `ibv_dereg_mr`): heap memory at odd offsets carries RDMA at its address or another iova;
//! registrations over overlapping memory share one device mapping, which goes with the last of them; memory the
//! device cannot reach is a typed error.

use std::time::Duration;

use mlx5_core::hal::DmaError;
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, QueuePair, Rereg, Rts, VerbsError, WcStatus, WorkCompletion};

const CAP: QpCap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 2, max_recv_sge: 2, max_inline_data: 0 };

/// One signaled request's completion on `cq`.
fn one(cq: &mlx5_verbs::CompletionQueue<'_>) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(cq.poll_until(&mut wc, 1, Duration::from_secs(5)).unwrap(), 1);
    wc[0]
}

/// An RC QP connected to itself.
fn loopback<'a>(
    ctx: &'a Context,
    pd: &'a mlx5_verbs::ProtectionDomain<'a>,
    cq: &'a mlx5_verbs::CompletionQueue<'a>,
) -> QueuePair<'a, Rts> {
    let qp = pd.create_qp(QpType::Rc, cq, cq, CAP).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    qp.connect_rc(me, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ).unwrap()
}

#[test]
fn heap_memory_at_odd_offsets_carries_rdma_write_and_read_at_its_address_or_an_iova() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(16).unwrap();
    let qp = loopback(&ctx, &pd, &cq);
    let mut src = vec![0u8; 20_000];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8;
    }
    let expect = src[5..12_005].to_vec();
    let mut dst = vec![0u8; 30_000];
    let mut back = vec![0u8; 13_000];
    let src_at = src[5..].as_ptr() as u64;
    let s = pd.reg_mr(&mut src[5..12_005], Access::LOCAL_WRITE).unwrap();
    assert_eq!(s.addr(), src_at, "ibv_reg_mr: the iova is the address");
    // The target at an iova of the caller's choosing, agreeing with the address within a page.
    let at = dst[777..].as_ptr() as u64;
    let iova = 0x7000_0000_0000 + (at & 0xfff);
    let d = pd
        .reg_mr_iova(&mut dst[777..12_777], iova, Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    assert_eq!(d.addr(), iova);
    assert_eq!(ctx.user_mappings(), 2);
    qp.post_send(&[wr::rdma_write(1, &[s.sge(0, 12_000)], d.remote(0))]).unwrap();
    assert_eq!(one(&cq).status, WcStatus::Success);
    assert_eq!(d.read_vec(0, 12_000), expect);
    let b = pd.reg_mr(&mut back[3..12_003], Access::LOCAL_WRITE | Access::RELAXED_ORDERING).unwrap();
    qp.post_send(&[wr::rdma_read(2, &[b.sge(0, 12_000)], d.remote(0))]).unwrap();
    assert_eq!(one(&cq).status, WcStatus::Success);
    assert_eq!(b.read_vec(0, 12_000), expect);
    drop((s, d, b));
    assert_eq!(ctx.user_mappings(), 0, "each mapping goes with its region");
    assert_eq!(&dst[777..12_777], &expect[..], "the memory is the caller's again");
    assert_eq!(&back[3..12_003], &expect[..]);
}

#[test]
fn overlapping_registrations_share_one_mapping_which_goes_with_the_last() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let data = vec![9u8; 3 * 4096];
    let whole = pd.reg_mr_readonly(&data, Access::REMOTE_READ).unwrap();
    let part = pd.reg_mr_readonly(&data[100..5000], Access::default()).unwrap();
    let same = pd.reg_mr_readonly(&data, Access::default()).unwrap();
    assert_eq!(ctx.user_mappings(), 1, "three keys, one mapping");
    assert_ne!(whole.lkey(), part.lkey());
    assert_eq!(part.addr(), data[100..].as_ptr() as u64);
    assert!(part.write(0, b"x").is_err(), "memory borrowed shared is not written through its region");
    let part = part.rereg(Rereg { access: Some(Access::LOCAL_WRITE), ..Rereg::default() }).unwrap_err().mr;
    assert_eq!(part.read_vec(0, 2), [9, 9]);
    drop(whole);
    drop(same);
    assert_eq!(ctx.user_mappings(), 1, "still used by the part");
    drop(part);
    assert_eq!(ctx.user_mappings(), 0);

    // A range reaching past a live mapping cannot share it and cannot be mapped twice: refused, nothing kept.
    let mut raw = vec![0u8; 8192];
    let p = raw.as_mut_ptr();
    // SAFETY: `raw` outlives both regions (they are dropped below) and nothing reads it while they live.
    let first = unsafe { pd.reg_mr_raw(p, 4096, None, Access::LOCAL_WRITE) }.unwrap();
    // SAFETY: as above.
    let inside = unsafe { pd.reg_mr_raw(p.wrapping_add(10), 100, None, Access::LOCAL_WRITE) }.unwrap();
    // SAFETY: as above.
    let across = unsafe { pd.reg_mr_raw(p.wrapping_add(4000), 1000, None, Access::LOCAL_WRITE) };
    assert!(matches!(across, Err(VerbsError::Invalid(_))), "{across:?}");
    assert_eq!(ctx.user_mappings(), 1);
    drop((first, inside));
    assert_eq!(ctx.user_mappings(), 0);
    drop(raw);
}

#[test]
fn memory_the_device_cannot_reach_and_empty_ranges_are_typed_errors() {
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    // Bytes the device already reaches through a DMA buffer cannot be mapped a second time.
    let mut buf = ctx.alloc_buffer(4096).unwrap();
    let e = pd.reg_mr(&mut buf[..100], Access::LOCAL_WRITE).unwrap_err();
    assert!(matches!(e, VerbsError::Dma(DmaError::Unreachable { len: 100, .. })), "{e}");
    assert!(e.to_string().contains("cannot be made reachable by the device"), "{e}");
    assert!(matches!(pd.reg_mr(&mut [], Access::LOCAL_WRITE), Err(VerbsError::Invalid(_))));
    // Remote write without local write is refused, as verbs refuses it, and the mapping is given back.
    let mut mem = vec![0u8; 64];
    assert!(pd.reg_mr(&mut mem, Access::REMOTE_WRITE).is_err());
    assert!(pd.reg_mr_readonly(&mem, Access::REMOTE_WRITE).is_err());
    assert_eq!(ctx.user_mappings(), 0);
}

#[test]
fn rereg_changes_memory_pd_and_access_with_new_keys() {
    let ctx = Context::open_sim().unwrap();
    let (pd, pd2) = (ctx.alloc_pd().unwrap(), ctx.alloc_pd().unwrap());
    let cq = ctx.create_cq(16).unwrap();
    let mut a = vec![1u8; 4096];
    let mut b = vec![2u8; 6000];
    let mr = pd.reg_mr(&mut a, Access::LOCAL_WRITE).unwrap();
    let old = mr.lkey();
    let mr = mr.rereg(Rereg { access: Some(Access::LOCAL_WRITE | Access::REMOTE_READ), ..Rereg::default() }).unwrap();
    assert_ne!(mr.lkey(), old, "a new key replaces the old one");
    assert!(mr.access().contains(Access::REMOTE_READ));
    // Nothing to change is refused (ib_uverbs_rereg_mr), and the region comes back registered.
    let failed = mr.rereg(Rereg::default()).unwrap_err();
    let mr = failed.mr;
    assert_eq!(mr.len(), 4096);
    // New memory and another PD: the old mapping goes, the new one is used by a QP of the new PD.
    let mr = mr.rereg(Rereg { memory: Some((&mut b[1000..], None)), pd: Some(&pd2), ..Rereg::default() }).unwrap();
    assert_eq!((mr.len(), ctx.user_mappings()), (5000, 1));
    let qp = loopback(&ctx, &pd2, &cq);
    let mut dst = vec![0u8; 5000];
    let d = pd2.reg_mr(&mut dst, Access::LOCAL_WRITE | Access::REMOTE_WRITE).unwrap();
    qp.post_send(&[wr::rdma_write(1, &[mr.sge(0, 5000)], d.remote(0))]).unwrap();
    assert_eq!(one(&cq).status, WcStatus::Success);
    assert_eq!(d.read_vec(0, 5000), vec![2u8; 5000]);
    drop((qp, d, mr));
    assert_eq!(ctx.user_mappings(), 0);
}

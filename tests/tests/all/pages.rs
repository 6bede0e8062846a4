//! The firmware page pool: chunks from the DMA trait, bitmaps per chunk, pending gives, returns checked against
//! what was given, and chunks freed only when firmware holds none of their pages.

use std::collections::BTreeSet;

use mlx5_core::cmd::Pas;
use mlx5_core::pages::{FwPages, PagesError, CHUNK_PAGES, FW_PAGE_SIZE, RECLAIM_BATCH};
use mlx5_sim::testkit::HeapDma;

fn pending(pool: &FwPages<4>) -> Vec<u64> {
    let mut v = Vec::new();
    match pool.pending_pages() {
        Pas::Source(s) => s.each(&mut |i, a| {
            assert_eq!(i, v.len());
            v.push(a)
        }),
        other => panic!("expected a page source, got {other:?}"),
    }
    v
}

#[test]
fn reserve_give_return_and_free_chunks() {
    let dma = HeapDma::default();
    let mut pool = FwPages::<4>::new();
    pool.reserve(&dma, 100).unwrap();
    assert_eq!((pool.pending(), pool.chunks(), dma.outstanding()), (100, 2, 2));
    let addrs = pending(&pool);
    assert_eq!(addrs.len(), 100);
    assert!(addrs.iter().all(|a| a % FW_PAGE_SIZE as u64 == 0), "page aligned");
    assert_eq!(addrs.iter().collect::<BTreeSet<_>>().len(), 100, "distinct");
    // A second reservation while one is pending is refused.
    assert_eq!(pool.reserve(&dma, 1), Err(PagesError::Busy));
    pool.commit();
    assert_eq!((pool.given(), pool.pending()), (100, 0));

    // Firmware returns the first chunk's 64 pages: that chunk goes back, the other stays.
    for &a in &addrs[..CHUNK_PAGES] {
        assert!(pool.release(a));
    }
    // Twice, or an address never given, is refused and changes nothing.
    assert!(!pool.release(addrs[0]));
    assert!(!pool.release(0xdead_0000));
    assert!(!pool.release(addrs[CHUNK_PAGES] + 8), "inside a page, not a page address");
    pool.free_empty(&dma);
    assert_eq!((pool.given(), pool.chunks(), dma.outstanding()), (36, 1, 1));

    // Free pages of held chunks are used before new chunks are allocated.
    pool.reserve(&dma, 28).unwrap();
    assert_eq!(pool.chunks(), 1);
    let more = pending(&pool);
    assert!(more.iter().all(|a| !addrs[CHUNK_PAGES..].contains(a)), "no page is given twice");
    pool.commit();
    assert_eq!(pool.given(), 64);
    for &a in addrs[CHUNK_PAGES..].iter().chain(&more) {
        assert!(pool.release(a));
    }
    pool.free_empty(&dma);
    assert_eq!((pool.given(), pool.chunks(), dma.outstanding()), (0, 0, 0));
}

#[test]
fn cancel_returns_unused_chunks_and_capacity_is_enforced() {
    let dma = HeapDma::default();
    let mut pool = FwPages::<2>::new();
    assert_eq!(FwPages::<2>::capacity_pages(), 2 * CHUNK_PAGES);
    pool.reserve(&dma, 70).unwrap();
    pool.cancel(&dma);
    assert_eq!((pool.pending(), pool.chunks(), dma.outstanding()), (0, 0, 0));
    assert_eq!(pool.reserve(&dma, 2 * CHUNK_PAGES + 1), Err(PagesError::Exhausted { capacity_pages: 128 }));
    assert_eq!(dma.outstanding(), 0, "a refused reservation allocates nothing");
    pool.reserve(&dma, 10).unwrap();
    pool.commit();
    assert_eq!(pool.abandon_all(&dma), 10);
    assert_eq!((pool.given(), dma.outstanding()), (0, 0));
}

#[test]
fn reclaim_batch_is_linux_optimal_reclaimed_pages() {
    // (16 inline output bytes + 12 mailbox blocks of 512 - the 16-byte manage_pages_out header) / 8 per address.
    assert_eq!(RECLAIM_BATCH, (16 + 12 * 512 - 16) / 8);
}

//! Focused cases: exact page ids for allocation order, fork and truncate copy-on-write, free,
//! and each error. (`properties.rs` covers random operation sequences.)

use kvpark_core::{KvError, KvPool};

/// A pool with sequence `seq` already holding `n` cells.
fn pool_with(n_cells: usize, page_size: usize, seq: u64, n: usize) -> KvPool {
    let mut pool = KvPool::new(n_cells, page_size).unwrap();
    pool.add_sequence(seq).unwrap();
    pool.reserve(seq, n).unwrap();
    pool
}

#[test]
fn geometry_must_be_whole_pages() {
    for (n_cells, page_size) in [(0, 16), (16, 0), (20, 16), (0, 0)] {
        assert_eq!(
            KvPool::new(n_cells, page_size),
            Err(KvError::BadGeometry { n_cells, page_size })
        );
    }
    let pool = KvPool::new(48, 16).unwrap();
    assert_eq!(
        (pool.n_cells(), pool.n_pages(), pool.page_size()),
        (48, 3, 16)
    );
    assert_eq!(pool.cells_free(), 48);
}

#[test]
fn allocation_is_lifo_and_reset_starts_over() {
    let mut pool = KvPool::new(5 * 4, 4).unwrap();
    pool.add_sequence(1).unwrap();
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.reserve(1, 8).unwrap(), vec![0, 1]);
    assert_eq!(pool.reserve(2, 4).unwrap(), vec![2]);
    assert_eq!(pool.free_sequence(1).unwrap(), 8);
    // Freed tail first, so its pages come back out in its logical order.
    assert_eq!(pool.reserve(2, 16).unwrap(), vec![0, 1, 3]);
    pool.reset();
    assert!(pool.sequences().is_empty());
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.reserve(2, 4).unwrap(), vec![0]);
}

#[test]
fn reserve_is_all_or_nothing() {
    let mut pool = pool_with(3 * 16, 16, 1, 17);
    let before = pool.clone();
    let err = pool.reserve(1, 49).unwrap_err();
    assert_eq!(
        err,
        KvError::PoolFull {
            needed: 2,
            free: 1,
            page_size: 16
        }
    );
    assert_eq!(
        err.to_string(),
        "pool full: needed 2 pages (32 cells), 1 free (16 cells)"
    );
    assert_eq!(pool, before);
    assert_eq!(pool.pages_needed(1, 49).unwrap(), 2);
    assert_eq!(pool.pages_needed(1, 3).unwrap(), 0);
    assert_eq!(
        pool.reserve(1, 16),
        Err(KvError::WouldShrink {
            seq: 1,
            len: 17,
            requested: 16
        })
    );
    assert_eq!(pool.reserve(9, 1), Err(KvError::UnknownSequence(9)));
    assert_eq!(pool.reserve(1, 48).unwrap(), vec![2]);
    assert_eq!(pool.cells_free(), 0);
}

#[test]
fn fork_shares_full_pages_and_copies_a_partial_one() {
    let mut pool = pool_with(4 * 4, 4, 1, 8);
    assert_eq!(pool.fork(1, 2).unwrap(), vec![]);
    assert_eq!(pool.page_table(2).unwrap(), &[0, 1]);
    assert_eq!(pool.page_refcount(1), Ok(2));
    assert_eq!(pool.cells_used(), 8);

    // Each grows into a page of its own.
    assert_eq!(pool.reserve(1, 9).unwrap(), vec![2]);
    assert_eq!(pool.fork(1, 3).unwrap(), vec![(2, 3)]);
    assert_eq!(pool.page_table(3).unwrap(), &[0, 1, 3]);
    assert_eq!(pool.page_refcount(0), Ok(3));
    assert_eq!(pool.seq_len(3), Ok(9));

    // No page left for the next copy: nothing changes.
    let before = pool.clone();
    assert!(matches!(
        pool.fork(1, 4),
        Err(KvError::PoolFull {
            needed: 1,
            free: 0,
            ..
        })
    ));
    assert_eq!(pool, before);
    // A fork of full pages needs no page.
    assert_eq!(pool.fork(2, 4).unwrap(), vec![]);
    pool.check_integrity().unwrap();
}

#[test]
fn fork_errors() {
    let mut pool = pool_with(64, 16, 1, 3);
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.fork(7, 8), Err(KvError::UnknownSequence(7)));
    assert_eq!(pool.fork(1, 2), Err(KvError::SequenceExists(2)));
    assert_eq!(pool.fork(1, 1), Err(KvError::SequenceExists(1)));
    assert_eq!(pool.fork(2, 3).unwrap(), vec![]); // an empty sequence holds no page
    assert_eq!(pool.page_table(3).unwrap(), &[] as &[u32]);
}

#[test]
fn truncate_releases_pages_and_copies_a_shared_partial_tail() {
    let mut pool = pool_with(6 * 4, 4, 1, 12); // pages [0, 1, 2]
    pool.fork(1, 2).unwrap();
    assert_eq!(pool.truncate(1, 12).unwrap(), vec![]); // no-op
    assert_eq!(pool.truncate(1, 8).unwrap(), vec![]); // page 2 still held by 2
    assert_eq!(pool.page_refcount(2), Ok(1));
    assert_eq!(pool.truncate(1, 5).unwrap(), vec![(1, 3)]);
    assert_eq!(pool.page_table(1).unwrap(), &[0, 3]);
    assert_eq!(pool.page_table(2).unwrap(), &[0, 1, 2]);
    // 1's tail is now private: no copy.
    assert_eq!(
        pool.truncate(1, 6).err(),
        Some(KvError::WouldGrow {
            seq: 1,
            len: 5,
            requested: 6
        })
    );
    assert_eq!(pool.truncate(1, 5).unwrap(), vec![]);
    assert_eq!(pool.truncate(1, 0).unwrap(), vec![]);
    assert_eq!(pool.page_table(1).unwrap(), &[] as &[u32]);
    assert_eq!(pool.cells_used(), 12);
    pool.check_integrity().unwrap();
}

#[test]
fn truncate_copy_may_reuse_a_page_it_releases() {
    // Full pool: 1 holds [0, 1]; 2 shares 0 and holds 2 alone.
    let mut pool = pool_with(3 * 4, 4, 1, 8);
    pool.fork(1, 2).unwrap();
    pool.truncate(2, 4).unwrap();
    pool.reserve(2, 8).unwrap();
    assert_eq!(pool.page_table(2).unwrap(), &[0, 2]);
    assert_eq!(pool.cells_free(), 0);
    // Truncating 2 into shared page 0 needs a copy; releasing page 2 makes room for it.
    assert_eq!(pool.truncate(2, 3).unwrap(), vec![(0, 2)]);
    assert_eq!(pool.page_table(2).unwrap(), &[2]);
    pool.check_integrity().unwrap();

    // Same with nothing to release: PoolFull, unchanged.
    pool.reserve(2, 4).unwrap();
    pool.free_sequence(2).unwrap();
    pool.fork(1, 3).unwrap();
    pool.add_sequence(4).unwrap();
    pool.reserve(4, 4).unwrap();
    assert_eq!(pool.cells_free(), 0);
    let before = pool.clone();
    assert!(matches!(pool.truncate(3, 6), Err(KvError::PoolFull { .. })));
    assert_eq!(pool, before);
}

#[test]
fn free_returns_only_pages_nobody_else_holds() {
    let mut pool = pool_with(8 * 4, 4, 1, 10); // [0, 1, 2]
    pool.fork(1, 2).unwrap(); // shares 0, 1; copies 2 into 3
    assert_eq!(pool.cells_freed_by(&[1]), Ok(4));
    assert_eq!(pool.cells_freed_by(&[1, 1, 2]), Ok(16));
    assert_eq!(pool.cells_freed_by(&[]), Ok(0));
    assert_eq!(
        pool.cells_freed_by(&[1, 5]),
        Err(KvError::UnknownSequence(5))
    );
    assert_eq!(pool.free_sequence(1), Ok(4));
    assert_eq!(pool.free_sequence(1), Err(KvError::UnknownSequence(1)));
    assert_eq!(pool.page_refcount(0), Ok(1));
    assert_eq!(pool.free_sequence(2), Ok(12));
    assert_eq!(pool.cells_used(), 0);
    pool.check_integrity().unwrap();
}

#[test]
fn occupancy_counts_whole_pages_once() {
    let mut pool = pool_with(8 * 16, 16, 1, 33); // 3 pages, the last with 1 cell
    assert_eq!(pool.cells_used(), 48);
    pool.fork(1, 2).unwrap();
    assert_eq!(pool.cells_used(), 64); // pages 0 and 1 once, two private tails
    assert!(pool.can_fit(64));
    assert!(!pool.can_fit(65)); // 5 pages
    assert!(pool.can_fit(0));
    assert_eq!(
        pool.page_refcount(8),
        Err(KvError::UnknownPage {
            page: 8,
            n_pages: 8
        })
    );
}

#[test]
fn slot_mapping_and_export_step() {
    let mut pool = pool_with(4 * 4, 4, 1, 6); // [0, 1]
    pool.fork(1, 2).unwrap(); // [0, 2]
    assert_eq!(pool.slot_mapping(1, 2, 4).unwrap(), vec![2, 3, 4, 5]);
    assert_eq!(pool.slot_mapping(2, 4, 2).unwrap(), vec![8, 9]);
    assert!(pool.slot_mapping(2, 6, 0).unwrap().is_empty());
    let out_of_range = KvError::OutOfRange {
        seq: 2,
        start: 5,
        count: 2,
        len: 6,
    };
    assert_eq!(pool.slot_mapping(2, 5, 2), Err(out_of_range.clone()));
    assert!(pool.slot_mapping(2, 1, usize::MAX).is_err()); // no overflow
    let (slots, tables) = pool.export_step(&[2, 1], &[5, 0], &[1, 2]).unwrap();
    assert_eq!(slots, vec![9, 0, 1]);
    assert_eq!(tables, vec![vec![0, 2], vec![0, 1]]);
    assert_eq!(
        pool.export_step(&[1], &[0, 0], &[1]),
        Err(KvError::LengthMismatch {
            seq_ids: 1,
            starts: 2,
            counts: 1
        })
    );
    assert_eq!(
        pool.export_step(&[1, 2], &[0, 5], &[1, 2]),
        Err(out_of_range)
    );
    assert_eq!(pool.export_step(&[], &[], &[]).unwrap(), (vec![], vec![]));
}

#[test]
fn released_pages_leave_the_pool_and_their_positions_stay() {
    let mut pool = pool_with(6 * 4, 4, 1, 10); // [0, 1, 2]
    pool.fork(1, 2).unwrap(); // shares 0 and 1, copies 2 into 3
    assert_eq!(pool.release_before(1, 9).unwrap(), 0); // 2 still holds pages 0 and 1
    assert_eq!(pool.release_before(2, 9).unwrap(), 8); // now nobody does
    assert_eq!(pool.release_before(2, 6).unwrap(), 0); // never takes a page back
    assert_eq!(pool.released_cells(2).unwrap(), 8);
    assert_eq!(pool.cells_used(), 8);
    let (slots, tables) = pool.export_step(&[1, 2], &[8, 9], &[2, 1]).unwrap();
    assert_eq!(slots, vec![8, 9, 13]);
    assert_eq!(tables, vec![vec![-1, -1, 2], vec![-1, -1, 3]]);
    let released = KvError::Released {
        seq: 2,
        pos: 7,
        released: 2,
    };
    assert_eq!(pool.slot_mapping(2, 7, 2), Err(released));
    assert!(matches!(pool.truncate(1, 5), Err(KvError::Released { .. })));
    assert_eq!(pool.truncate(1, 8).unwrap(), vec![]); // to the released edge: page 2 goes
    assert_eq!(pool.page_table(1).unwrap(), &[] as &[u32]);
    assert!(pool.release_before(2, 11).is_err()); // past its end
    pool.check_integrity().unwrap();

    // an empty sequence spans released positions only: a swap comes back into its later pages
    pool.add_sequence(5).unwrap();
    assert_eq!(pool.release_before(5, 10).unwrap(), 0);
    assert_eq!(
        (pool.seq_len(5).unwrap(), pool.released_cells(5).unwrap()),
        (8, 8)
    );
    assert_eq!(pool.pages_needed(5, 10).unwrap(), 1);
    pool.reserve(5, 10).unwrap();
    assert_eq!(pool.slot_mapping(5, 8, 2).unwrap().len(), 2);
    pool.check_integrity().unwrap();
}

//! Prefix hits in a sliding pool (`KvPool::set_window`): a sequence releases its pages behind
//! the window as it goes, they are cached and evicted under pressure, and a later sequence with
//! the same tokens still finds the pages of its last window, where a strict pool (an evicted
//! page unregisters its successors) finds only the start of the chain.

use kvpark_core::KvPool;

const SALT: u64 = 42;
const PS: usize = 4;
const WINDOW: usize = 6;

/// A pool of `n_pages` pages of 4 cells, the cache on, sliding over `WINDOW` or not.
fn pool(n_pages: usize, sliding: bool) -> KvPool {
    let mut pool = KvPool::with_prefix_cache(n_pages * PS, PS, SALT).unwrap();
    if sliding {
        pool.set_window(WINDOW);
    }
    pool
}

/// Computes `tokens` into new sequence `seq` a page a step, registering each page and
/// releasing what falls behind the window of the next row, as the scheduler does.
fn slide_through(pool: &mut KvPool, seq: u64, tokens: &[u32]) {
    pool.add_sequence(seq).unwrap();
    for end in (PS..=tokens.len()).step_by(PS) {
        pool.reserve(seq, end).unwrap();
        pool.register_tokens(seq, &tokens[end - PS..end]).unwrap();
        pool.release_before(seq, (end + 1).saturating_sub(WINDOW))
            .unwrap();
        pool.check_integrity().unwrap();
    }
}

#[test]
fn a_window_hit_needs_only_the_last_window_and_outlives_the_pages_before_it() {
    let long: Vec<u32> = (0..40).collect(); // ten pages
    let mut hits = Vec::new();
    for sliding in [true, false] {
        let mut pool = pool(8, sliding);
        slide_through(&mut pool, 1, &long);
        assert!(pool.page_table(1).unwrap().len() <= 3); // its window and the row's page
        pool.free_sequence(1).unwrap();
        // another sequence takes five pages: the oldest cached ones (the first released) go
        slide_through(&mut pool, 2, &(100..120).collect::<Vec<u32>>());
        pool.free_sequence(2).unwrap();
        pool.check_integrity().unwrap();
        let hit = pool.cached_prefix(&long, 39);
        pool.add_sequence(3).unwrap();
        let got = pool.match_prefix(3, &long, 39).unwrap();
        assert_eq!(got, hit.tokens);
        if sliding {
            // it holds the pages of the window before its hit, and no earlier one
            let first = pool.released_cells(3).unwrap();
            assert_eq!(first, (got + 1).saturating_sub(WINDOW) / PS * PS);
            assert_eq!(pool.page_table(3).unwrap().len(), (got - first) / PS);
        }
        hits.push(got);
        // it goes on from its hit: its next pages register and chain on
        let end = (got + PS).min(40);
        pool.reserve(3, end).unwrap();
        pool.register_tokens(3, &long[got..end]).unwrap();
        pool.check_integrity().unwrap();
        pool.free_sequence(3).unwrap();
        pool.check_integrity().unwrap();
    }
    // strict, an evicted page takes its successors' registrations with it (the sequence's own
    // later pages among them): only the chain's start is found; sliding, its end is
    assert!(hits[0] >= 32 && hits[1] < hits[0], "{hits:?}");
}

#[test]
fn an_orphan_stays_findable_and_the_pool_stays_whole() {
    let mut pool = pool(6, true);
    let a: Vec<u32> = (0..16).collect();
    slide_through(&mut pool, 1, &a);
    pool.free_sequence(1).unwrap();
    // fill the pool so that eviction takes the first cached pages, parents of the others
    slide_through(&mut pool, 2, &(50..62).collect::<Vec<u32>>());
    pool.check_integrity().unwrap();
    // the orphans of `a`, later in its chain, are found by key
    let hit = pool.cached_prefix(&a, 16);
    assert_eq!(hit.tokens % PS, 0);
    assert!(hit.tokens >= 8, "{hit:?}");
    pool.reset();
    pool.check_integrity().unwrap();
    assert_eq!(pool.window(), Some(WINDOW));
}

//! The prefix cache rule by rule, through the public API, on pools small enough to name every
//! page: registration, hits, races, eviction order, truncate / fork / reset, the off switch,
//! and the planner reading cached cells as free.

use kvpark_core::planner::{plan, Action, PlannerConfig, RamView, RequestState, RequestView};
use kvpark_core::{KvError, KvPool, PrefixHit};

const SALT: u64 = 42;

/// A pool of `n_pages` pages of 4 cells with the cache on.
fn pool(n_pages: usize) -> KvPool {
    KvPool::with_prefix_cache(n_pages * 4, 4, SALT).unwrap()
}

/// Adds `seq`, computes `tokens` into it (reserve, then register) and checks the pool.
fn compute(pool: &mut KvPool, seq: u64, tokens: &[u32]) -> usize {
    pool.add_sequence(seq).unwrap();
    pool.reserve(seq, tokens.len()).unwrap();
    let newly = pool.register_tokens(seq, tokens).unwrap();
    pool.check_integrity().unwrap();
    newly
}

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

#[test]
fn with_the_cache_off_nothing_is_registered_or_cached() {
    let mut pool = KvPool::new(32, 4).unwrap();
    assert_eq!(pool.prefix_cache_salt(), None);
    assert_eq!(compute(&mut pool, 1, &tokens(0..9)), 0);
    assert_eq!(pool.registered_len(1), Ok(0));
    assert_eq!(pool.free_sequence(1), Ok(12));
    assert_eq!((pool.cells_cached(), pool.cells_free()), (0, 32));
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.match_prefix(2, &tokens(0..9), 8), Ok(0));
    assert_eq!(pool.cached_prefix(&tokens(0..9), 9), PrefixHit::default());
    assert!(pool.eviction_order().is_empty());
}

#[test]
fn a_released_full_page_stays_cached_and_a_new_sequence_takes_it() {
    let mut pool = pool(8);
    assert_eq!(compute(&mut pool, 1, &tokens(0..10)), 2); // pages 0, 1 full; 2 partly used
    assert!(pool.page_key(0).unwrap().is_some() && pool.page_key(2).unwrap().is_none());
    assert_eq!(pool.free_sequence(1), Ok(12)); // freed counts cached pages too
    assert_eq!((pool.cells_used(), pool.cells_cached()), (0, 8));
    assert_eq!(pool.cells_free(), 32); // cached cells count as free
    assert_eq!(pool.eviction_order(), vec![1, 0]); // the chain's end goes first

    let hit = pool.cached_prefix(&tokens(0..10), 9);
    assert_eq!(
        hit,
        PrefixHit {
            tokens: 8,
            cached_cells: 8
        }
    );
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.match_prefix(2, &tokens(0..10), 9), Ok(8));
    assert_eq!(pool.page_table(2).unwrap(), &[0, 1]);
    assert_eq!((pool.seq_len(2), pool.registered_len(2)), (Ok(8), Ok(8)));
    assert_eq!((pool.cells_used(), pool.cells_cached()), (8, 0));
    assert_eq!(pool.page_refcount(0), Ok(1));
    pool.check_integrity().unwrap();
    // The rest is computed and registered as usual, chaining on.
    pool.reserve(2, 12).unwrap();
    assert_eq!(pool.register_tokens(2, &[8, 9, 50, 51]), Ok(1));
    pool.check_integrity().unwrap();
}

#[test]
fn the_last_prompt_token_is_never_covered() {
    let mut pool = pool(8);
    compute(&mut pool, 1, &tokens(0..8));
    pool.free_sequence(1).unwrap();
    // 8 tokens, 2 full pages cached, but max_tokens = 7: only the first page.
    assert_eq!(pool.cells_to_admit(&tokens(0..8), 7, 8), 4 + 4); // hit page cached + 1 new
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.match_prefix(2, &tokens(0..8), 7), Ok(4));
}

#[test]
fn decoded_tokens_register_page_by_page_as_they_fill() {
    let mut pool = pool(8);
    pool.add_sequence(1).unwrap();
    pool.reserve(1, 3).unwrap();
    assert_eq!(pool.register_tokens(1, &[7, 8, 9]), Ok(0));
    for (n, token) in (4..=9).zip(10..) {
        pool.reserve(1, n).unwrap();
        let newly = pool.register_tokens(1, &[token]).unwrap();
        assert_eq!(newly, usize::from(n % 4 == 0), "at {n} cells");
    }
    assert_eq!(pool.registered_len(1), Ok(9));
    pool.check_integrity().unwrap();
}

#[test]
fn registration_never_passes_the_cells_held_and_a_failure_changes_nothing() {
    let mut pool = pool(8);
    pool.add_sequence(1).unwrap();
    pool.reserve(1, 4).unwrap();
    let before = pool.clone();
    let err = KvError::OutOfRange {
        seq: 1,
        start: 0,
        count: 5,
        len: 4,
    };
    assert_eq!(pool.register_tokens(1, &tokens(0..5)), Err(err));
    assert_eq!(
        pool.register_step(&[1, 1], &[tokens(0..3), tokens(3..5)])
            .unwrap_err(),
        KvError::OutOfRange {
            seq: 1,
            start: 3,
            count: 2,
            len: 4
        }
    );
    assert!(matches!(
        pool.register_step(&[1], &[]),
        Err(KvError::RegisterMismatch { .. })
    ));
    assert_eq!(
        pool.register_tokens(9, &[1]),
        Err(KvError::UnknownSequence(9))
    );
    assert_eq!(pool, before);
    assert_eq!(
        pool.register_step(&[1, 1], &[tokens(0..3), tokens(3..4)]),
        Ok(1)
    );
}

#[test]
fn match_prefix_needs_an_empty_known_sequence() {
    let mut pool = pool(4);
    assert_eq!(
        pool.match_prefix(3, &[1], 1),
        Err(KvError::UnknownSequence(3))
    );
    pool.add_sequence(3).unwrap();
    pool.reserve(3, 1).unwrap();
    assert_eq!(
        pool.match_prefix(3, &[1], 1),
        Err(KvError::NotEmpty { seq: 3, len: 1 })
    );
}

#[test]
fn the_first_of_two_copies_is_registered_the_second_is_freed_but_chains_on() {
    let mut pool = pool(8);
    // Both compute the same first page at once; 2 goes on with its own second page.
    pool.add_sequence(1).unwrap();
    pool.add_sequence(2).unwrap();
    pool.reserve(1, 4).unwrap(); // page 0
    pool.reserve(2, 8).unwrap(); // pages 1, 2
    assert_eq!(pool.register_tokens(1, &tokens(0..4)), Ok(1));
    let mut two = tokens(0..4);
    two.extend(100..104);
    assert_eq!(pool.register_tokens(2, &two), Ok(1)); // only its second page is new
    assert!(pool.page_key(1).unwrap().is_none()); // 2's copy of page 0 is private
    assert_eq!(pool.page_key(1).unwrap(), None);
    pool.check_integrity().unwrap();
    assert_eq!(pool.free_sequence(2), Ok(8));
    assert_eq!(pool.cells_cached(), 4); // page 2 cached, page 1 freed
                                        // A third request with 2's tokens finds page 0 (1's) then page 2 (2's, chained on 0).
    pool.add_sequence(3).unwrap();
    assert_eq!(pool.match_prefix(3, &two, 8), Ok(8));
    assert_eq!(pool.page_table(3).unwrap(), &[0, 2]);
    pool.check_integrity().unwrap();
}

#[test]
fn allocation_takes_the_free_list_then_the_least_recently_cached_leaf() {
    let mut pool = pool(5);
    compute(&mut pool, 1, &tokens(0..8)); // pages 0, 1
    compute(&mut pool, 2, &tokens(50..54)); // page 2
    pool.free_sequence(1).unwrap(); // 1 cached, then 0
    pool.free_sequence(2).unwrap(); // 2 cached
    assert_eq!(pool.eviction_order(), vec![1, 0, 2]);
    pool.add_sequence(3).unwrap();
    // Free pages 3 and 4 go first (LIFO, as without the cache), then 1, 0, 2.
    assert_eq!(pool.reserve(3, 20).unwrap(), vec![3, 4, 1, 0, 2]);
    assert_eq!(pool.cells_cached(), 0);
    assert_eq!(pool.cached_prefix(&tokens(0..8), 8).tokens, 0); // evicted: unregistered
    pool.check_integrity().unwrap();
}

#[test]
fn a_cached_page_whose_successor_is_cached_goes_after_it_even_if_older() {
    let mut pool = pool(8);
    // 1 computes pages 0, 1; 2 computes the same first page at once (its private page 2) and
    // then its own page 3, registered as a successor of page 0.
    pool.add_sequence(1).unwrap();
    pool.add_sequence(2).unwrap();
    pool.reserve(1, 8).unwrap();
    pool.reserve(2, 8).unwrap();
    pool.register_tokens(1, &tokens(0..8)).unwrap();
    let mut two = tokens(0..4);
    two.extend(100..104);
    pool.register_tokens(2, &two).unwrap();
    pool.free_sequence(1).unwrap(); // page 1 cached, then page 0 (older than 3 will be)
    pool.free_sequence(2).unwrap(); // page 3 cached; page 2 freed
                                    // Pure LRU would give [1, 0, 3]: page 0 waits for its successor 3.
    assert_eq!(pool.eviction_order(), vec![1, 3, 0]);
    pool.check_integrity().unwrap();
}

#[test]
fn a_sequence_taking_a_cached_page_moves_it_back_to_the_lru_end_when_released() {
    let mut pool = pool(6);
    compute(&mut pool, 1, &tokens(0..4)); // page 0
    compute(&mut pool, 2, &tokens(10..14)); // page 1
    pool.free_sequence(1).unwrap();
    pool.free_sequence(2).unwrap();
    assert_eq!(pool.eviction_order(), vec![0, 1]);
    pool.add_sequence(3).unwrap();
    assert_eq!(pool.match_prefix(3, &tokens(0..5), 4), Ok(4)); // takes page 0
    assert_eq!(pool.eviction_order(), vec![1]);
    pool.free_sequence(3).unwrap();
    assert_eq!(pool.eviction_order(), vec![1, 0]);
}

#[test]
fn truncate_into_a_registered_page_copies_it_and_the_original_stays_findable() {
    let mut pool = pool(8);
    compute(&mut pool, 1, &tokens(0..8)); // pages 0, 1 registered
    assert_eq!(pool.truncate(1, 6), Ok(vec![(1, 2)])); // page 1 held by 1 alone, registered
    assert_eq!(pool.page_table(1).unwrap(), &[0, 2]);
    assert_eq!(pool.registered_len(1), Ok(6));
    assert_eq!(pool.cells_cached(), 4); // page 1 is cached, unchanged
    assert_eq!(pool.cached_prefix(&tokens(0..8), 8).tokens, 8);
    // New tokens for positions 6, 7 register a page of their own content.
    pool.reserve(1, 8).unwrap();
    assert_eq!(pool.register_tokens(1, &[60, 70]), Ok(1));
    pool.check_integrity().unwrap();
    // Truncating to a page boundary keeps the kept pages registered.
    assert_eq!(pool.truncate(1, 4), Ok(vec![]));
    assert_eq!(
        (pool.registered_len(1), pool.page_key(0).unwrap().is_some()),
        (Ok(4), true)
    );
    pool.check_integrity().unwrap();
}

#[test]
fn a_fork_shares_the_registration_and_chains_on_from_it() {
    let mut pool = pool(8);
    compute(&mut pool, 1, &tokens(0..6)); // page 0 registered, page 1 partly used
    assert_eq!(pool.fork(1, 2), Ok(vec![(1, 2)]));
    assert_eq!(pool.registered_len(2), Ok(6));
    pool.reserve(2, 8).unwrap();
    assert_eq!(pool.register_tokens(2, &[6, 7]), Ok(1)); // page 2 full: registered
    pool.reserve(1, 8).unwrap();
    assert_eq!(pool.register_tokens(1, &[6, 9]), Ok(1)); // another content: page 1
    pool.check_integrity().unwrap();
    pool.free_sequence(1).unwrap();
    pool.free_sequence(2).unwrap();
    assert_eq!(pool.cells_cached(), 12);
}

#[test]
fn reset_drops_the_cached_pages_and_keeps_the_cache_on() {
    let mut pool = pool(4);
    compute(&mut pool, 1, &tokens(0..8));
    pool.free_sequence(1).unwrap();
    pool.reset();
    assert_eq!(pool, KvPool::with_prefix_cache(16, 4, SALT).unwrap());
    assert_eq!(pool.prefix_cache_salt(), Some(SALT));
}

#[test]
fn pages_are_found_only_under_the_salt_they_were_registered_with() {
    let mut a = KvPool::with_prefix_cache(16, 4, 1).unwrap();
    let mut b = KvPool::with_prefix_cache(16, 4, 2).unwrap();
    compute(&mut a, 1, &tokens(0..4));
    compute(&mut b, 1, &tokens(0..4));
    assert_ne!(a.page_key(0).unwrap(), b.page_key(0).unwrap());
}

#[test]
fn a_hit_held_by_another_sequence_costs_no_room() {
    let mut pool = pool(8);
    compute(&mut pool, 1, &tokens(0..8)); // held
    assert_eq!(
        pool.cached_prefix(&tokens(0..9), 8),
        PrefixHit {
            tokens: 8,
            cached_cells: 0
        }
    );
    assert_eq!(pool.cells_to_admit(&tokens(0..9), 8, 9), 4); // just the third page
    assert_eq!(pool.cells_to_admit(&tokens(50..59), 8, 9), 12); // no hit
}

// ---------------------------------------------------------------------------------- planner

fn running(id: u64, next: usize) -> RequestView {
    RequestView {
        seq_ids: vec![id],
        next_cells: vec![(id, next)],
        slot: id as u32,
        ..RequestView::new(id, id, RequestState::Running)
    }
}

#[test]
fn evicting_cached_pages_comes_before_parking_anyone() {
    // 8 pages: 1 and 2 hold a page each, 5 pages are cached. The step needs 2 more pages.
    let mut pool = pool(8);
    compute(&mut pool, 9, &tokens(100..120));
    pool.free_sequence(9).unwrap();
    compute(&mut pool, 1, &tokens(0..4));
    compute(&mut pool, 2, &tokens(10..14));
    assert_eq!((pool.cells_used(), pool.cells_cached()), (8, 20));
    let cfg = PlannerConfig {
        ram_budget: Some(0),
        ..PlannerConfig::default()
    };
    let views = [running(1, 5), running(2, 5)];
    let actions = plan(&pool, &views, &RamView::default(), &cfg, 0).unwrap();
    assert_eq!(actions, []);
    for seq in [1, 2] {
        pool.reserve(seq, 5).unwrap(); // evicts cached pages
    }
    pool.check_integrity().unwrap();
    // The same pool with those cells held instead of cached parks one.
    let mut held = pool.clone();
    held.add_sequence(9).unwrap();
    held.reserve(9, held.cells_free()).unwrap();
    let views = [running(1, 9), running(2, 9)];
    let actions = plan(&held, &views, &RamView::default(), &cfg, 0).unwrap();
    assert!(
        matches!(actions[..], [Action::Park { id: 2, .. }]),
        "{actions:?}"
    );
}

#[test]
fn sharing_a_cached_prefix_does_not_make_a_request_unparkable() {
    // 1 computed a 2-page prompt; 2 took it from the cache and has a page of its own.
    let mut pool = pool(6);
    compute(&mut pool, 1, &tokens(0..9));
    pool.add_sequence(2).unwrap();
    assert_eq!(pool.match_prefix(2, &tokens(0..9), 8), Ok(8));
    pool.reserve(2, 9).unwrap();
    // Both need a page for the step: 4 + 2 + margin (1 page) > 6 pages.
    let cfg = PlannerConfig {
        ram_budget: Some(0),
        ..PlannerConfig::default()
    };
    let views = [running(1, 13), running(2, 13)];
    let actions = plan(&pool, &views, &RamView::default(), &cfg, 0).unwrap();
    assert!(
        matches!(actions[..], [Action::Park { id: 2, .. }]),
        "{actions:?}"
    );
    // Parking 2 frees only its own page; the shared prefix stays with 1.
    assert_eq!(pool.cells_freed_by(&[2]), Ok(4));
}

#[test]
fn a_parked_request_whose_prefix_is_still_cached_resumes_where_a_full_restore_would_not() {
    // 12 pages. 2 was parked by recompute after computing 20 tokens (5 full pages, registered,
    // so cached); 3 has since taken those 5 pages from the cache; 1 holds 2 pages.
    let mut pool = pool(12);
    compute(&mut pool, 2, &tokens(0..20));
    pool.free_sequence(2).unwrap();
    let replay = tokens(0..21);
    // Taking cached pages costs room as fresh pages would: the hit changes nothing yet.
    assert_eq!(pool.cells_to_admit(&replay, 20, 21), 24);
    pool.add_sequence(3).unwrap();
    assert_eq!(pool.match_prefix(3, &replay, 20), Ok(20));
    compute(&mut pool, 1, &tokens(50..58));
    // Now the pages are held by 3: 2 only needs a page for its last token.
    let cost = pool.cells_to_admit(&replay, 20, 21);
    assert_eq!(cost, 4);
    let parked = |resume_cells| RequestView {
        resume_cells,
        parked_at_ms: Some(0),
        slot: 2,
        ..RequestView::new(2, 2, RequestState::Parked(kvpark_core::ParkMode::Recompute))
    };
    let mut third = running(3, 20);
    third.arrival = 0;
    let (cfg, ram) = (PlannerConfig::default(), RamView::default());
    // 28 used + 8 margin: the whole replay (24) does not fit 48, the cost after the hit does.
    let views = [running(1, 8), parked(21), third.clone()];
    assert_eq!(plan(&pool, &views, &ram, &cfg, 0).unwrap(), []);
    let views = [running(1, 8), parked(cost), third];
    assert_eq!(
        plan(&pool, &views, &ram, &cfg, 0).unwrap(),
        [Action::Resume { id: 2 }]
    );
}

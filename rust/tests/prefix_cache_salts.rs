//! Per-request cache salts: a sequence's pages are found only by sequences of the same salt,
//! through every path that takes pages by hash (admission, fork, truncate, resume) and with the
//! pool's invariants checked after each step.

use kvpark_core::{KvPool, PrefixHit};

/// A pool of `n_pages` pages of 4 cells with the cache on.
fn pool(n_pages: usize) -> KvPool {
    KvPool::with_prefix_cache(n_pages * 4, 4, 7).unwrap()
}

/// Adds `seq` under `salt`, takes its cached prefix, computes the rest of `tokens` and checks
/// the pool; returns the tokens the cache supplied.
fn admit(pool: &mut KvPool, seq: u64, salt: u64, tokens: &[u32]) -> usize {
    let max_hit = tokens.len() - 1;
    let promised = pool.cached_prefix_salted(tokens, max_hit, salt).tokens;
    pool.add_salted_sequence(seq, salt).unwrap();
    let hit = pool.match_prefix(seq, tokens, max_hit).unwrap();
    assert_eq!(
        hit, promised,
        "match_prefix took other than cached_prefix_salted said"
    );
    pool.reserve(seq, tokens.len()).unwrap();
    pool.register_tokens(seq, &tokens[hit..]).unwrap();
    pool.check_integrity().unwrap();
    hit
}

fn prompt() -> Vec<u32> {
    (100..113).collect() // three full pages and one token
}

#[test]
fn pages_are_shared_within_a_salt_and_never_across() {
    let mut pool = pool(32);
    assert_eq!(admit(&mut pool, 1, 5, &prompt()), 0);
    pool.free_sequence(1).unwrap();
    assert_eq!(pool.cells_cached(), 12);
    // no salt and another salt see nothing; the same salt takes all three pages
    assert_eq!(admit(&mut pool, 2, 0, &prompt()), 0);
    assert_eq!(admit(&mut pool, 3, 6, &prompt()), 0);
    assert_eq!(admit(&mut pool, 4, 5, &prompt()), 12);
    // the unsalted and the salt-6 copies are registered under their own roots, so all three
    // coexist: 3 page chains of 3 pages, none shared across salts
    for seq in [2, 3, 4] {
        pool.free_sequence(seq).unwrap();
    }
    assert_eq!(pool.cells_cached(), 36);
    pool.check_integrity().unwrap();
    assert_eq!(pool.cached_prefix(&prompt(), 12).tokens, 12);
    assert_eq!(pool.cached_prefix_salted(&prompt(), 12, 6).tokens, 12);
    assert_eq!(
        pool.cached_prefix_salted(&prompt(), 12, 8),
        PrefixHit::default()
    );
}

#[test]
fn admission_room_counts_only_the_salt_own_hit() {
    let mut pool = pool(32);
    admit(&mut pool, 1, 5, &prompt());
    pool.free_sequence(1).unwrap();
    // 16 cells: 4 pages; the salt's 3 cached pages cost room as fresh ones do, no salt: 4 fresh
    assert_eq!(pool.cells_to_admit_salted(&prompt(), 12, 16, 5), 16);
    assert_eq!(pool.cells_to_admit_salted(&prompt(), 12, 16, 9), 16);
    pool.add_salted_sequence(2, 5).unwrap();
    assert_eq!(pool.match_prefix(2, &prompt(), 12).unwrap(), 12);
    // held by sequence 2 now: another sequence of salt 5 needs only its own 4th page
    assert_eq!(pool.cells_to_admit_salted(&prompt(), 12, 16, 5), 4);
    assert_eq!(pool.cells_to_admit_salted(&prompt(), 12, 16, 9), 16);
}

#[test]
fn a_fork_and_a_truncate_keep_the_salt() {
    let mut pool = pool(32);
    let long: Vec<u32> = (0..10).collect();
    admit(&mut pool, 1, 5, &long);
    pool.fork(1, 2).unwrap();
    // the child continues past the parent's tail: the page it fills registers under salt 5
    pool.reserve(2, 12).unwrap();
    pool.register_tokens(2, &[10, 11]).unwrap();
    pool.check_integrity().unwrap();
    let twelve: Vec<u32> = (0..13).collect();
    assert_eq!(pool.cached_prefix_salted(&twelve, 12, 5).tokens, 12);
    assert_eq!(pool.cached_prefix(&twelve, 12).tokens, 0);
    // truncated back into page 1 and regrown with other tokens: still salt 5's
    pool.truncate(2, 5).unwrap();
    pool.reserve(2, 8).unwrap();
    pool.register_tokens(2, &[50, 51, 52]).unwrap();
    pool.check_integrity().unwrap();
    let other = [0, 1, 2, 3, 4, 50, 51, 52, 9];
    assert_eq!(pool.cached_prefix_salted(&other, 8, 5).tokens, 8);
    assert_eq!(pool.cached_prefix_salted(&other, 8, 6).tokens, 0);
}

#[test]
fn a_resume_finds_its_own_pages_again() {
    let mut pool = pool(32);
    admit(&mut pool, 1, 5, &prompt());
    // a recompute park: dropped, then back in a fresh sequence of the same salt
    pool.free_sequence(1).unwrap();
    pool.add_salted_sequence(1, 5).unwrap();
    assert_eq!(pool.match_prefix(1, &prompt(), 12).unwrap(), 12);
    pool.check_integrity().unwrap();
    // the same resume under another salt would have replayed everything
    pool.add_salted_sequence(2, 4).unwrap();
    assert_eq!(pool.match_prefix(2, &prompt(), 12).unwrap(), 0);
}

#[test]
fn salt_zero_is_the_unsalted_cache_and_a_salt_with_the_cache_off_is_nothing() {
    let mut pool = pool(32);
    admit(&mut pool, 1, 0, &prompt());
    pool.free_sequence(1).unwrap();
    assert_eq!(admit(&mut pool, 2, 0, &prompt()), 12);
    let mut off = KvPool::new(64, 4).unwrap();
    off.add_salted_sequence(1, 5).unwrap();
    off.reserve(1, 13).unwrap();
    assert_eq!(off.register_tokens(1, &prompt()), Ok(0));
    off.check_integrity().unwrap();
}

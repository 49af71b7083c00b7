//! Property tests of the prefix cache: random operations (grow, register late, prefix hits,
//! truncate, fork, free, reset) on a small pool with the cache on, checked after every step
//! against a shadow of what every cell holds and brute-force recounts; and, with the cache off,
//! allocation against a model of the plain LIFO free list.
//!
//! The shadow writes into each cell the *content* of its position (a hash of every token up to
//! it, which is what K and V depend on) and each sequence must read back exactly its own: a
//! cached page handed out while held, a page written while registered, or a hit on pages of
//! other tokens all break that.

use std::collections::{BTreeMap, BTreeSet};

use kvpark_core::{KvPool, PageId, SeqId};
use proptest::prelude::*;

const MAX_ID: SeqId = 5;

#[derive(Debug, Clone)]
enum Op {
    Add(SeqId),
    /// Reserve `k` more cells and compute them from token stream `q`; registered at once if
    /// the flag says so, else later (two sequences computing the same page at once).
    Grow(SeqId, usize, u32, bool),
    /// Register every computed token not registered yet.
    Register(SeqId),
    /// `match_prefix` with stream `q`'s first `n` tokens on an empty sequence (added first if
    /// it does not exist).
    Match(SeqId, u32, usize),
    Shrink(SeqId, usize),
    Fork(SeqId, SeqId),
    Free(SeqId),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0..MAX_ID;
    let stream = prop::sample::select(vec![0u32, 0, 0, 1, 2]);
    prop_oneof![
        2 => id.clone().prop_map(Op::Add),
        6 => (id.clone(), 1..9usize, stream.clone(), prop::bool::weighted(0.7))
            .prop_map(|(s, k, q, now)| Op::Grow(s, k, q, now)),
        2 => id.clone().prop_map(Op::Register),
        4 => (id.clone(), stream, 0..24usize).prop_map(|(s, q, n)| Op::Match(s, q, n)),
        1 => (id.clone(), 0..6usize).prop_map(|(s, k)| Op::Shrink(s, k)),
        2 => (id.clone(), id.clone()).prop_map(|(p, c)| Op::Fork(p, c)),
        3 => id.prop_map(Op::Free),
        1 => Just(Op::Reset),
    ]
}

fn scenario() -> impl Strategy<Value = (usize, usize, Vec<Op>)> {
    (1..=4usize, 2..=10usize, prop::collection::vec(op(), 1..80))
}

/// Token `pos` of stream `q`: sequences that grow from the same streams share their prefix.
fn token(q: u32, pos: usize) -> u32 {
    q * 10_000 + pos as u32
}

/// The content of a position: splitmix64's finaliser (a bijection) of the content before it plus
/// the token times an odd constant. The model finds a page's parent by content, so contents must
/// not collide: the earlier `(before ^ token) * K` gave 1 both for token 0 after 0 and for token 1
/// after 1, and a page looked like the parent of its own sibling (saved in proptest-regressions).
fn content(before: u64, token: u32) -> u64 {
    let mut z = before
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(token).wrapping_mul(0xD1B5_4A32_D192_ED03));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug, Clone, Default)]
struct SeqShadow {
    tokens: Vec<u32>,
    /// `content[j]`: the content of position j.
    content: Vec<u64>,
    registered: usize,
}

impl SeqShadow {
    fn push(&mut self, token: u32) {
        let before = self.content.last().copied().unwrap_or(0);
        self.tokens.push(token);
        self.content.push(content(before, token));
    }
}

struct Shadow {
    ps: usize,
    /// Per cell: (content before it, its content).
    cells: Vec<Option<(u64, u64)>>,
    seqs: BTreeMap<SeqId, SeqShadow>,
    /// Per cached page: when it became cached, by the test's clock.
    cached_at: BTreeMap<PageId, u64>,
    clock: u64,
}

impl Shadow {
    /// A pool of `n_pages` pages of `ps` cells with nothing computed.
    fn empty(ps: usize, n_pages: usize) -> Self {
        Self {
            ps,
            cells: vec![None; ps * n_pages],
            seqs: BTreeMap::new(),
            cached_at: BTreeMap::new(),
            clock: 0,
        }
    }

    fn write(&mut self, pool: &KvPool, seq: SeqId, from: usize) {
        let s = &self.seqs[&seq];
        for (i, slot) in pool
            .slot_mapping(seq, from, s.tokens.len() - from)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            let j = from + i;
            let before = if j == 0 { 0 } else { s.content[j - 1] };
            self.cells[slot] = Some((before, s.content[j]));
        }
    }

    fn copy(&mut self, copies: &[(PageId, PageId)]) {
        for &(src, dst) in copies {
            for o in 0..self.ps {
                self.cells[dst as usize * self.ps + o] = self.cells[src as usize * self.ps + o];
            }
        }
    }

    /// A page's (content before its first cell, content of its last cell).
    fn ends(&self, page: PageId) -> (Option<u64>, Option<u64>) {
        let base = page as usize * self.ps;
        (
            self.cells[base].map(|c| c.0),
            self.cells[base + self.ps - 1].map(|c| c.1),
        )
    }
}

/// The eviction order the rules give, from the shadow alone, in groups: a page, then the
/// cached pages that go with it (its registered descendants, found by content: a page's
/// parent is the registered page whose last cell holds the content before its first).
fn model_eviction(pool: &KvPool, shadow: &Shadow) -> Vec<Vec<PageId>> {
    let mut registered: BTreeSet<PageId> = (0..pool.n_pages() as PageId)
        .filter(|&p| pool.page_key(p as usize).unwrap().is_some())
        .collect();
    let mut cached: BTreeSet<PageId> = shadow.cached_at.keys().copied().collect();
    let successors = |of: PageId, among: &BTreeSet<PageId>| -> Vec<PageId> {
        let last = shadow.ends(of).1;
        among
            .iter()
            .copied()
            .filter(|&d| d != of && shadow.ends(d).0 == last)
            .collect()
    };
    let mut groups = Vec::new();
    while !cached.is_empty() {
        let leaf = cached
            .iter()
            .copied()
            .filter(|&c| successors(c, &cached).is_empty())
            .min_by_key(|c| (shadow.cached_at[c], *c))
            .expect("a chain has an end");
        let mut group = vec![leaf];
        let mut stack = vec![leaf];
        while let Some(p) = stack.pop() {
            registered.remove(&p);
            for d in successors(p, &registered) {
                stack.push(d);
                if cached.contains(&d) {
                    group.push(d);
                }
            }
            registered.remove(&p);
        }
        for p in &group {
            cached.remove(p);
        }
        groups.push(group);
    }
    groups
}

fn check(pool: &KvPool, shadow: &Shadow) -> Result<(), TestCaseError> {
    let ps = pool.page_size();
    pool.check_integrity()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut holders: BTreeMap<PageId, usize> = BTreeMap::new();
    for seq in pool.sequences() {
        for &p in pool.page_table(seq).unwrap() {
            *holders.entry(p).or_default() += 1;
        }
    }
    // Occupancy: used + cached + free = pool, each from a recount.
    let order = pool.eviction_order();
    let cached: BTreeSet<PageId> = order.iter().copied().collect();
    prop_assert_eq!(
        cached.len(),
        order.len(),
        "a page twice in the eviction order"
    );
    prop_assert_eq!(pool.cells_used(), holders.len() * ps);
    prop_assert_eq!(pool.cells_cached(), cached.len() * ps);
    prop_assert_eq!(pool.cells_free(), pool.n_cells() - holders.len() * ps);
    for &p in &cached {
        prop_assert!(!holders.contains_key(&p), "cached page {} is held", p);
        prop_assert!(pool.page_key(p as usize).unwrap().is_some());
    }
    // Hash -> page is one-to-one over registered pages.
    let keys: Vec<u64> = (0..pool.n_pages())
        .filter_map(|p| pool.page_key(p).unwrap())
        .collect();
    prop_assert_eq!(keys.iter().collect::<BTreeSet<_>>().len(), keys.len());
    // Every sequence reads back its own content.
    for (&seq, s) in &shadow.seqs {
        let slots = pool.slot_mapping(seq, 0, s.content.len()).unwrap();
        let read: Vec<Option<u64>> = slots
            .iter()
            .map(|&c| shadow.cells[c].map(|c| c.1))
            .collect();
        let want: Vec<Option<u64>> = s.content.iter().copied().map(Some).collect();
        prop_assert_eq!(read, want, "sequence {} reads back other K/V", seq);
    }
    // Eviction: LRU among the leaves, a page's registered successors with it.
    let mut at = 0;
    for group in model_eviction(pool, shadow) {
        let mut got = order[at..at + group.len()].to_vec();
        prop_assert_eq!(got[0], group[0], "eviction order {:?}", order);
        got.sort_unstable();
        let mut want = group.clone();
        want.sort_unstable();
        prop_assert_eq!(got, want);
        at += group.len();
    }
    Ok(())
}

/// Applies `op` if it is valid for the pool (invalid calls are the other tests' business);
/// returns the pages released, in the order the pool releases them.
fn apply(pool: &mut KvPool, shadow: &mut Shadow, op: &Op) -> Result<Vec<PageId>, TestCaseError> {
    let ps = pool.page_size();
    let has = |pool: &KvPool, s| pool.has_sequence(s);
    let mut released = Vec::new();
    match *op {
        Op::Add(s) if !has(pool, s) => {
            pool.add_sequence(s).unwrap();
            shadow.seqs.insert(s, SeqShadow::default());
        }
        Op::Grow(s, k, q, now) if has(pool, s) => {
            let before = pool.clone();
            let len = pool.seq_len(s).unwrap();
            let had = pool.page_table(s).unwrap().len();
            if let Ok(new_pages) = pool.reserve(s, len + k) {
                // The free list first, then cached pages in eviction order.
                let free_list = (before.cells_free() - before.cells_cached()) / ps;
                let from_free = new_pages.len().min(free_list);
                for &p in &new_pages[..from_free] {
                    prop_assert_eq!(before.page_refcount(p as usize), Ok(0));
                    prop_assert_eq!(before.page_key(p as usize), Ok(None));
                }
                let evicted = new_pages.len() - from_free;
                prop_assert_eq!(&new_pages[from_free..], &before.eviction_order()[..evicted]);
                prop_assert_eq!(&pool.page_table(s).unwrap()[had..], &new_pages[..]);
                let seq = shadow.seqs.get_mut(&s).unwrap();
                for j in len..len + k {
                    seq.push(token(q, j));
                }
                shadow.write(pool, s, len);
                if now {
                    return apply(pool, shadow, &Op::Register(s));
                }
            }
        }
        Op::Register(s) if has(pool, s) => {
            let seq = shadow.seqs.get_mut(&s).unwrap();
            pool.register_tokens(s, &seq.tokens[seq.registered..])
                .unwrap();
            seq.registered = seq.tokens.len();
        }
        Op::Match(s, q, n) if pool.seq_len(s).unwrap_or(0) == 0 => {
            if !has(pool, s) {
                apply(pool, shadow, &Op::Add(s))?;
            }
            let tokens: Vec<u32> = (0..n).map(|j| token(q, j)).collect();
            let max = n.saturating_sub(1);
            let hit = pool.cached_prefix(&tokens, max);
            let cost = pool.cells_to_admit(&tokens, max, n);
            let free = pool.cells_free();
            let covered = pool.match_prefix(s, &tokens, max).unwrap();
            prop_assert_eq!(covered, hit.tokens);
            prop_assert!(covered <= max && covered % ps == 0);
            // What the hit took out of the cache is what cells_to_admit charged for it.
            prop_assert_eq!(free - pool.cells_free(), hit.cached_cells);
            prop_assert_eq!(cost, n.div_ceil(ps) * ps - covered + hit.cached_cells);
            let seq = shadow.seqs.get_mut(&s).unwrap();
            *seq = SeqShadow::default();
            for &t in &tokens[..covered] {
                seq.push(t);
            }
            seq.registered = covered;
        }
        Op::Shrink(s, k) if has(pool, s) => {
            let len = pool.seq_len(s).unwrap();
            let n = len.saturating_sub(k);
            let table = pool.page_table(s).unwrap().to_vec();
            if let Ok(copies) = pool.truncate(s, n) {
                released.extend(table[n.div_ceil(ps)..].iter().rev());
                released.extend(copies.iter().map(|c| c.0));
                shadow.copy(&copies);
                let seq = shadow.seqs.get_mut(&s).unwrap();
                seq.tokens.truncate(n);
                seq.content.truncate(n);
                seq.registered = seq.registered.min(n);
            }
        }
        Op::Fork(p, c) if has(pool, p) && !has(pool, c) => {
            if let Ok(copies) = pool.fork(p, c) {
                shadow.copy(&copies);
                let seq = shadow.seqs[&p].clone();
                shadow.seqs.insert(c, seq);
            }
        }
        Op::Free(s) if has(pool, s) => {
            released.extend(pool.page_table(s).unwrap().iter().rev());
            pool.free_sequence(s).unwrap();
            shadow.seqs.remove(&s);
        }
        Op::Reset => {
            pool.reset();
            shadow.seqs.clear();
        }
        _ => {}
    }
    Ok(released)
}

/// After an op: pages that left the cache drop their time; pages that entered get the next
/// times, in the order the op released them.
fn update_times(pool: &KvPool, shadow: &mut Shadow, released: &[PageId]) {
    let cached: BTreeSet<PageId> = pool.eviction_order().into_iter().collect();
    shadow.cached_at.retain(|p, _| cached.contains(p));
    for &p in released {
        if cached.contains(&p) && !shadow.cached_at.contains_key(&p) {
            shadow.cached_at.insert(p, shadow.clock);
            shadow.clock += 1;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// No page owned twice, no cached page held or handed out while held, hash -> page
    /// one-to-one, occupancy = recount, every hit gives the right K/V, eviction LRU leaves
    /// first, allocation free list first then eviction order.
    #[test]
    fn random_operations_keep_every_cache_invariant((ps, n_pages, ops) in scenario()) {
        let mut pool = KvPool::with_prefix_cache(ps * n_pages, ps, 99).unwrap();
        let mut shadow = Shadow::empty(ps, n_pages);
        for op in &ops {
            let released = apply(&mut pool, &mut shadow, op)?;
            update_times(&pool, &mut shadow, &released);
            check(&pool, &shadow)?;
        }
    }

    /// With the cache off, registration and hits do nothing and pages come and go through a
    /// LIFO free list exactly as before the cache existed.
    #[test]
    fn with_the_cache_off_allocation_is_the_plain_lifo_free_list((ps, n_pages, ops) in scenario()) {
        let mut pool = KvPool::new(ps * n_pages, ps).unwrap();
        let mut free: Vec<PageId> = (0..n_pages as PageId).rev().collect();
        let mut shadow = Shadow::empty(ps, n_pages);
        for op in &ops {
            let before = pool.clone();
            let released = apply(&mut pool, &mut shadow, op)?;
            prop_assert_eq!(pool.cells_cached(), 0);
            if let Op::Reset = op {
                free = (0..n_pages as PageId).rev().collect();
                continue;
            }
            for p in released {
                if pool.page_refcount(p as usize) == Ok(0) {
                    free.push(p);
                }
            }
            for seq in pool.sequences() {
                let had = before.page_table(seq).map(<[_]>::to_vec).unwrap_or_default();
                for &p in pool.page_table(seq).unwrap() {
                    if !had.contains(&p) && before.page_refcount(p as usize) == Ok(0) {
                        prop_assert_eq!(free.pop(), Some(p), "{:?}", op);
                    }
                }
            }
            let mut want = free.clone();
            want.sort_unstable();
            let mut got: Vec<PageId> = (0..n_pages as PageId)
                .filter(|&p| pool.page_refcount(p as usize) == Ok(0))
                .collect();
            got.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }
}

//! Property tests: random operation sequences on a small pool, with unknown ids and calls that
//! must fail, checked after every operation against brute-force recounts and a shadow model.
//!
//! The shadow model writes a distinct token value into every cell a sequence grows into, does
//! the page copies `fork` and `truncate` return, and checks that each sequence still reads back
//! exactly its tokens: copy-on-write is right only if no sequence ever writes into a cell that
//! another one reads.

use std::collections::{BTreeMap, BTreeSet};

use kvpark_core::{KvError, KvPool, PageId, SeqId};
use proptest::prelude::*;

/// Ids 0..MAX_ID, so that unknown ids and existing children come up often.
const MAX_ID: SeqId = 6;

#[derive(Debug, Clone)]
enum Op {
    Add(SeqId),
    /// `reserve(seq, n)` with an absolute `n`: often shrinks or overflows the pool.
    Reserve(SeqId, usize),
    /// `reserve(seq, seq_len + k)`.
    Grow(SeqId, usize),
    /// `truncate(seq, n)` with an absolute `n`: often grows.
    Truncate(SeqId, usize),
    /// `truncate(seq, seq_len - k)`.
    Shrink(SeqId, usize),
    Fork(SeqId, SeqId),
    Free(SeqId),
    /// `release_before(seq, seq_len - k)`: the pages behind a sliding window go.
    Release(SeqId, usize),
    Reset,
}

fn op(max_cells: usize) -> impl Strategy<Value = Op> {
    let id = 0..MAX_ID;
    let n = 0..max_cells + 8;
    prop_oneof![
        2 => id.clone().prop_map(Op::Add),
        1 => (id.clone(), n.clone()).prop_map(|(s, n)| Op::Reserve(s, n)),
        4 => (id.clone(), 0..12usize).prop_map(|(s, k)| Op::Grow(s, k)),
        1 => (id.clone(), n).prop_map(|(s, n)| Op::Truncate(s, n)),
        2 => (id.clone(), 0..12usize).prop_map(|(s, k)| Op::Shrink(s, k)),
        3 => (id.clone(), id.clone()).prop_map(|(p, c)| Op::Fork(p, c)),
        1 => id.clone().prop_map(Op::Free),
        2 => (id, 0..12usize).prop_map(|(s, k)| Op::Release(s, k)),
        1 => Just(Op::Reset),
    ]
}

/// A pool geometry, then operations, each with a random set of ids (duplicates and unknown ids
/// included) to ask `cells_freed_by` about.
fn scenario() -> impl Strategy<Value = (usize, usize, Vec<(Op, Vec<SeqId>)>)> {
    (1..=5usize, 1..=10usize).prop_flat_map(|(page_size, n_pages)| {
        let steps = prop::collection::vec(
            (
                op(page_size * n_pages),
                prop::collection::vec(0..MAX_ID, 0..5),
            ),
            1..60,
        );
        (Just(page_size), Just(n_pages), steps)
    })
}

/// The pool's contents as the runner would see them: one token value per cell.
struct Shadow {
    page_size: usize,
    cells: Vec<Option<u64>>,
    /// Each sequence's tokens in logical order: what it must read back.
    tokens: BTreeMap<SeqId, Vec<u64>>,
    next_token: u64,
}

impl Shadow {
    fn copy_pages(&mut self, copies: &[(PageId, PageId)]) {
        let ps = self.page_size;
        for &(src, dst) in copies {
            let (src, dst) = (src as usize * ps, dst as usize * ps);
            let page: Vec<_> = self.cells[src..src + ps].to_vec();
            self.cells[dst..dst + ps].copy_from_slice(&page);
        }
    }

    /// Writes fresh tokens into `seq`'s positions `from..` (after a successful reserve).
    fn write(&mut self, pool: &KvPool, seq: SeqId, from: usize) {
        let len = pool.seq_len(seq).unwrap();
        for slot in pool.slot_mapping(seq, from, len - from).unwrap() {
            self.cells[slot] = Some(self.next_token);
            self.tokens.get_mut(&seq).unwrap().push(self.next_token);
            self.next_token += 1;
        }
    }
}

/// Brute force from the page tables: page -> the sequences holding it.
fn holders(pool: &KvPool) -> BTreeMap<PageId, BTreeSet<SeqId>> {
    let mut holders: BTreeMap<PageId, BTreeSet<SeqId>> = BTreeMap::new();
    for seq in pool.sequences() {
        for &page in pool.page_table(seq).unwrap() {
            holders.entry(page).or_default().insert(seq);
        }
    }
    holders
}

fn check(pool: &KvPool, shadow: &Shadow, subset: &[SeqId]) -> Result<(), TestCaseError> {
    let ps = pool.page_size();
    pool.check_integrity()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;

    let holders = holders(pool);
    prop_assert_eq!(pool.cells_used(), holders.len() * ps);
    prop_assert_eq!(pool.cells_free(), pool.n_cells() - holders.len() * ps);
    for (&page, seqs) in &holders {
        prop_assert_eq!(
            pool.page_refcount(page as usize).unwrap() as usize,
            seqs.len()
        );
    }

    let set: BTreeSet<SeqId> = subset.iter().copied().collect();
    match set.iter().find(|&&s| !pool.has_sequence(s)) {
        Some(&unknown) => prop_assert_eq!(
            pool.cells_freed_by(subset),
            Err(KvError::UnknownSequence(unknown))
        ),
        None => {
            let freed = holders.values().filter(|h| h.is_subset(&set)).count();
            prop_assert_eq!(pool.cells_freed_by(subset), Ok(freed * ps));
        }
    }

    let free_pages = pool.cells_free() / ps;
    for n in [0, 1, ps, ps + 1, pool.cells_free(), pool.cells_free() + 1] {
        prop_assert_eq!(pool.can_fit(n), n.div_ceil(ps) <= free_pages);
    }

    let seqs: Vec<SeqId> = shadow.tokens.keys().copied().collect();
    prop_assert_eq!(pool.sequences(), seqs.clone());
    // each sequence reads back what it holds: its positions after those it released
    let starts: Vec<usize> = seqs
        .iter()
        .map(|&s| pool.released_cells(s).unwrap())
        .collect();
    let lens: Vec<usize> = seqs.iter().map(|&s| pool.seq_len(s).unwrap()).collect();
    let counts: Vec<usize> = lens.iter().zip(&starts).map(|(l, s)| l - s).collect();
    let (slots, tables) = pool.export_step(&seqs, &starts, &counts).unwrap();
    let mut slots = slots.into_iter();
    for (i, (seq, tokens)) in shadow.tokens.iter().enumerate() {
        let released = starts[i] / ps;
        let held = pool.page_table(*seq).unwrap().iter().map(|&p| i64::from(p));
        let table: Vec<i64> = std::iter::repeat(-1).take(released).chain(held).collect();
        prop_assert_eq!(&tables[i], &table);
        prop_assert_eq!(table.len(), lens[i].div_ceil(ps));
        let read: Vec<Option<u64>> = slots
            .by_ref()
            .take(counts[i])
            .map(|s| shadow.cells[s])
            .collect();
        let want: Vec<Option<u64>> = tokens[starts[i]..].iter().copied().map(Some).collect();
        prop_assert_eq!(read, want, "sequence {} reads back other tokens", seq);
    }
    Ok(())
}

/// Applies `op`; on success updates the shadow, on failure checks the pool is unchanged and the
/// failure was the right one.
fn apply(pool: &mut KvPool, shadow: &mut Shadow, op: &Op) -> Result<(), TestCaseError> {
    let before = pool.clone();
    let ps = pool.page_size();
    let free_pages = pool.cells_free() / ps;
    let len = |pool: &KvPool, s: SeqId| pool.seq_len(s).unwrap_or(0);
    let result: Result<(), KvError> = match *op {
        Op::Add(s) => pool.add_sequence(s).map(|()| {
            shadow.tokens.insert(s, Vec::new());
        }),
        Op::Reserve(s, n) | Op::Grow(s, n) => {
            let old = len(pool, s);
            let n = if matches!(op, Op::Grow(..)) {
                old + n
            } else {
                n
            };
            let had = pool.page_table(s).map(<[_]>::len).unwrap_or(0);
            let released = pool.released_cells(s).unwrap_or(0) / ps;
            let result = pool.reserve(s, n);
            if let Ok(new_pages) = &result {
                prop_assert_eq!(&pool.page_table(s).unwrap()[had..], &new_pages[..]);
                for &page in new_pages {
                    prop_assert_eq!(before.page_refcount(page as usize), Ok(0));
                }
                shadow.write(pool, s, old);
            } else if let Err(KvError::PoolFull { needed, free, .. }) = result {
                prop_assert_eq!(needed, n.div_ceil(ps) - had - released);
                prop_assert!(needed > free && free == free_pages);
            }
            result.map(drop)
        }
        Op::Truncate(s, n) | Op::Shrink(s, n) => {
            let old = len(pool, s);
            let n = if matches!(op, Op::Shrink(..)) {
                old.saturating_sub(n)
            } else {
                n
            };
            let result = pool.truncate(s, n);
            if let Ok(copies) = &result {
                prop_assert!(copies.len() <= 1);
                shadow.copy_pages(copies);
                shadow.tokens.get_mut(&s).unwrap().truncate(n);
            }
            result.map(drop)
        }
        Op::Fork(p, c) => {
            let result = pool.fork(p, c);
            if let Ok(copies) = &result {
                prop_assert_eq!(copies.len(), usize::from(len(pool, p) % ps != 0));
                shadow.copy_pages(copies);
                let tokens = shadow.tokens[&p].clone();
                shadow.tokens.insert(c, tokens);
            }
            result.map(drop)
        }
        Op::Free(s) => {
            let would_free = before.cells_freed_by(&[s]);
            let result = pool.free_sequence(s);
            if let Ok(freed) = result {
                prop_assert_eq!(Ok(freed), would_free);
                prop_assert_eq!(pool.cells_used(), before.cells_used() - freed);
                shadow.tokens.remove(&s);
            }
            result.map(drop)
        }
        Op::Release(s, k) => {
            let old = len(pool, s);
            let pos = old.saturating_sub(k);
            let would_free = before.cells_freed_by(&[s]);
            let result = pool.release_before(s, pos);
            if let Ok(freed) = result {
                prop_assert_eq!(pool.seq_len(s), Ok(old));
                prop_assert!(freed <= would_free.unwrap());
                prop_assert_eq!(pool.cells_used(), before.cells_used() - freed);
                let released = pool.released_cells(s).unwrap();
                prop_assert_eq!(
                    released,
                    (pos / ps * ps).max(before.released_cells(s).unwrap())
                );
            }
            result.map(drop)
        }
        Op::Reset => {
            pool.reset();
            shadow.tokens.clear();
            prop_assert_eq!(&*pool, &KvPool::new(pool.n_cells(), ps).unwrap());
            Ok(())
        }
    };
    if let Err(err) = result {
        prop_assert_eq!(
            &*pool,
            &before,
            "failed {:?} ({}) changed the pool",
            op,
            err
        );
        let unknown = |s: SeqId| !before.has_sequence(s);
        match (op, &err) {
            (Op::Add(s), _) => prop_assert_eq!(err, KvError::SequenceExists(*s)),
            (Op::Fork(p, _), KvError::UnknownSequence(u)) => prop_assert!(u == p && unknown(*p)),
            (Op::Fork(_, c), KvError::SequenceExists(e)) => prop_assert_eq!(c, e),
            (Op::Fork(p, _), KvError::PoolFull { .. }) => {
                prop_assert!(len(pool, *p) % ps != 0 && free_pages == 0)
            }
            (_, KvError::UnknownSequence(u)) => prop_assert!(unknown(*u)),
            (
                Op::Reserve(..) | Op::Grow(..),
                KvError::WouldShrink { .. } | KvError::PoolFull { .. },
            ) => {}
            (
                Op::Truncate(..),
                KvError::WouldGrow { .. } | KvError::PoolFull { .. } | KvError::Released { .. },
            ) => {}
            (Op::Shrink(..), KvError::PoolFull { .. } | KvError::Released { .. }) => {}
            _ => prop_assert!(false, "{:?} failed with {:?}", op, err),
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_operations_keep_every_invariant((page_size, n_pages, steps) in scenario()) {
        let mut pool = KvPool::new(page_size * n_pages, page_size).unwrap();
        let mut shadow = Shadow {
            page_size,
            cells: vec![None; page_size * n_pages],
            tokens: BTreeMap::new(),
            next_token: 0,
        };
        for (op, subset) in &steps {
            apply(&mut pool, &mut shadow, op)?;
            check(&pool, &shadow, subset)?;
        }
    }

    #[test]
    fn slot_mapping_matches_the_page_table(
        page_size in 1..=8usize,
        len in 0..100usize,
        start in 0..110usize,
        count in 0..110usize,
    ) {
        let mut pool = KvPool::new(page_size * 16, page_size).unwrap();
        pool.add_sequence(3).unwrap();
        let len = len.min(pool.n_cells());
        pool.reserve(3, len).unwrap();
        let table = pool.page_table(3).unwrap().to_vec();
        match pool.slot_mapping(3, start, count) {
            Ok(slots) => {
                prop_assert!(start + count <= len);
                for (i, slot) in slots.into_iter().enumerate() {
                    let pos = start + i;
                    prop_assert_eq!(slot, table[pos / page_size] as usize * page_size + pos % page_size);
                }
            }
            Err(err) => {
                prop_assert!(start + count > len);
                prop_assert_eq!(err, KvError::OutOfRange { seq: 3, start, count, len });
            }
        }
    }
}

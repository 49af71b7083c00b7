//! The pool: all cells, grouped in pages of `page_size` cells, each page with a reference count
//! (the number of page tables holding it), and a free list of the pages nobody holds.
//!
//! ```text
//!   n_pages = 6, page_size = 4
//!   page        0    1    2    3    4    5
//!   ref count   2    1    1    0    1    0      free list (a stack): [5, 3]  -> next page out: 3
//!   seq 7      [0,   1]                         len 7: page 1 holds 3 of its 4 cells
//!   seq 9      [0,        2,        4]          len 9: forked from 7 when 7 held 4 cells
//! ```
//!
//! Page 0 is shared: both sequences hold it, so it returns to the free list only when both let
//! go. A shared page is always full in every table that holds it (copy-on-write keeps it so: see
//! `fork` and `truncate` in `sequences.rs`), so appending to a sequence never writes into a
//! cell that another sequence reads.
//!
//! Allocation order is deterministic: the free list is a LIFO stack. A fresh (or reset) pool
//! hands out pages 0, 1, 2, …; a released page is the next one handed out. Sequences release
//! their pages tail first, so a freed sequence's pages come back out in its logical order.
//!
//! With the prefix cache on ([`KvPool::with_prefix_cache`]) a released full page whose token
//! ids were registered is not freed but *cached*: held by no sequence, findable by the hash
//! chain of its tokens, evicted (LRU, leaves first) only when the free list is empty. See
//! [`prefix`] for the rules and the calls the engine makes.
//!
//! Files: this one holds the pool and its integrity check; `allocator.rs` the ref counts, free
//! list and eviction; [`sequences`] the calls on one sequence's page table (add, reserve,
//! truncate, fork, free, slot mappings); [`prefix`] registration and prefix hits, over
//! `page_key.rs` (the hash chain), `cached_pages.rs` (the index of registered pages) and
//! `token_chain.rs` (what each sequence registered); `cache_integrity.rs` the cache's
//! invariants; `occupancy.rs` (beside this module) the queries the planner reads.

mod allocator;
mod cache_integrity;
mod cached_pages;
mod page_key;
mod prefix;
mod sequences;
mod token_chain;
mod window_hit;

use std::collections::BTreeMap;

use crate::error::{KvError, KvResult};
use crate::ids::{PageId, SeqId};
use crate::page_table::{pages_for, PageTable};

pub(crate) use allocator::PageAllocator;
pub use prefix::PrefixHit;
use token_chain::TokenChain;

/// The KV cell pool: pages with ref counts, a free list, and each sequence's page table.
///
/// Only one owner mutates it (the engine thread). Every fallible call either succeeds or returns
/// a [`KvError`] having changed nothing. Sequence ids are chosen by the caller; page ids are
/// `0..n_pages`; the cell of page `p` at offset `o` has the flat index `p * page_size + o`.
///
/// ```
/// use kvpark_core::KvPool;
/// let mut pool = KvPool::new(64, 16).unwrap(); // 4 pages
/// pool.add_sequence(1).unwrap();
/// assert_eq!(pool.reserve(1, 20).unwrap(), vec![0, 1]); // 20 cells need 2 pages
/// assert_eq!(pool.slot_mapping(1, 15, 2).unwrap(), vec![15, 16]);
/// assert_eq!(pool.cells_used(), 32); // the partly used page counts in full
/// pool.check_integrity().unwrap();
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPool {
    pub(crate) pages: PageAllocator,
    pub(crate) tables: BTreeMap<SeqId, PageTable>,
    /// Per sequence, the token ids registered so far and the chain of its full pages; empty
    /// with the prefix cache off.
    pub(crate) chains: BTreeMap<SeqId, TokenChain>,
    /// The sliding window every sequence's rows attend over (`set_window`), if any.
    pub(crate) window: Option<usize>,
}

impl KvPool {
    /// A pool of `n_cells` cells in pages of `page_size`, every page free, no sequence.
    ///
    /// Fails with [`KvError::BadGeometry`] unless both are positive and `n_cells` is a whole
    /// number of pages (at most 2**32 of them).
    pub fn new(n_cells: usize, page_size: usize) -> KvResult<Self> {
        Self::build(n_cells, page_size, None)
    }

    /// `new`, with the prefix cache on when `salt` is given.
    fn build(n_cells: usize, page_size: usize, salt: Option<u64>) -> KvResult<Self> {
        let bad = KvError::BadGeometry { n_cells, page_size };
        if page_size == 0 || n_cells == 0 || n_cells % page_size != 0 {
            return Err(bad);
        }
        let n_pages = n_cells / page_size;
        if n_pages - 1 > PageId::MAX as usize {
            return Err(bad);
        }
        Ok(Self {
            pages: PageAllocator::new(n_pages, page_size, salt),
            tables: BTreeMap::new(),
            chains: BTreeMap::new(),
            window: None,
        })
    }

    /// Cells per page.
    pub fn page_size(&self) -> usize {
        self.pages.page_size()
    }

    /// Pages in the pool.
    pub fn n_pages(&self) -> usize {
        self.pages.n_pages()
    }

    /// Cells in the pool.
    pub fn n_cells(&self) -> usize {
        self.pages.n_pages() * self.pages.page_size()
    }

    /// How many page tables hold `page` (0: it is free).
    pub fn page_refcount(&self, page: usize) -> KvResult<u32> {
        if page < self.n_pages() {
            Ok(self.pages.refcount(page as PageId))
        } else {
            Err(KvError::UnknownPage {
                page,
                n_pages: self.n_pages(),
            })
        }
    }

    /// Drops every sequence and every cached page; the pool is then as if new (page 0 is handed
    /// out first; the prefix cache stays on or off, with its salt).
    pub fn reset(&mut self) {
        self.tables.clear();
        self.chains.clear();
        self.pages.reset();
    }

    /// Checks every invariant of the pool, in O(pool); for tests and debugging, not the hot path.
    ///
    /// Fails with [`KvError::Integrity`] naming the first broken invariant of: the free list
    /// holds only pages in range, none twice; no page is both free and held; free + used pages ==
    /// total; each page's ref count == the number of page tables holding it; no page twice in
    /// one table; a sequence of `len` cells holds exactly `ceil(len / page_size)` pages; a shared
    /// page is full in every table holding it (copy-on-write); and with the prefix cache on, the
    /// cache's invariants (`cache_integrity.rs`).
    pub fn check_integrity(&self) -> KvResult<()> {
        let fail = |msg: String| Err(KvError::Integrity(msg));
        let n_pages = self.n_pages();
        let page_size = self.page_size();
        let refcounts = &self.pages.refcounts;

        let mut is_free = vec![false; n_pages];
        for &page in &self.pages.free {
            let p = page as usize;
            if p >= n_pages {
                return fail(format!("free list holds page {page}, outside 0..{n_pages}"));
            }
            if is_free[p] {
                return fail(format!("free list holds page {page} twice"));
            }
            is_free[p] = true;
            if refcounts[p] != 0 {
                return fail(format!(
                    "page {page} is both free and held (ref count {})",
                    refcounts[p]
                ));
            }
        }

        let mut holders = vec![0u32; n_pages];
        // The index of the last table seen holding each page, to find a page twice in one table.
        let mut last_table = vec![usize::MAX; n_pages];
        for (i, (seq, table)) in self.tables.iter().enumerate() {
            let expected = pages_for(table.len, page_size);
            if table.span() != expected {
                return fail(format!(
                    "sequence {seq} holds {} cells in {} pages and {} released; it needs \
                     exactly {expected}",
                    table.len,
                    table.pages.len(),
                    table.released
                ));
            }
            for &page in &table.pages {
                let p = page as usize;
                if p >= n_pages {
                    return fail(format!(
                        "sequence {seq} holds page {page}, outside 0..{n_pages}"
                    ));
                }
                if is_free[p] {
                    return fail(format!(
                        "page {page} is both free and held (by sequence {seq})"
                    ));
                }
                if last_table[p] == i {
                    return fail(format!(
                        "page {page} is twice in the page table of sequence {seq}"
                    ));
                }
                last_table[p] = i;
                holders[p] += 1;
            }
        }

        for (p, (&count, &held_by)) in refcounts.iter().zip(&holders).enumerate() {
            if count != held_by {
                return fail(format!(
                    "ref count of page {p} is {count} but {held_by} page tables hold it"
                ));
            }
        }
        let used = refcounts.iter().filter(|&&c| c > 0).count();
        let free = self.pages.free.len();
        let cached = self.pages.cached_pages();
        if used + free + cached != n_pages {
            return fail(format!(
                "free ({free}) + cached ({cached}) + used ({used}) pages != total ({n_pages}): \
                 a page is lost"
            ));
        }

        for (seq, table) in &self.tables {
            if let Some(&tail) = table.pages.last() {
                let count = refcounts[tail as usize];
                if table.len % page_size != 0 && count > 1 {
                    return fail(format!(
                        "sequence {seq}'s partly used tail page {tail} is shared \
                         (ref count {count}): it needed a copy-on-write"
                    ));
                }
            }
        }
        self.check_prefix_cache().map_err(KvError::Integrity)
    }
}

#[cfg(test)]
mod tests {
    //! Each invariant of `check_integrity`, broken on purpose.
    use super::*;

    /// Sequences 1 (20 cells: pages 0, 1) and 2 (forked from 1 at 16 cells: page 0 shared).
    fn two_sequences() -> KvPool {
        let mut pool = KvPool::new(64, 16).unwrap();
        pool.add_sequence(1).unwrap();
        pool.reserve(1, 16).unwrap();
        pool.fork(1, 2).unwrap();
        pool.reserve(1, 20).unwrap();
        pool.check_integrity().unwrap();
        pool
    }

    fn table_of(pages: Vec<PageId>, len: usize) -> PageTable {
        PageTable {
            pages,
            len,
            released: 0,
        }
    }

    fn broken(pool: &KvPool) -> String {
        match pool.check_integrity() {
            Err(KvError::Integrity(msg)) => msg,
            other => panic!("expected an integrity error, got {other:?}"),
        }
    }

    #[test]
    fn free_list_out_of_range() {
        let mut pool = two_sequences();
        pool.pages.free.push(9);
        assert!(broken(&pool).contains("outside 0..4"));
    }

    #[test]
    fn free_list_duplicate() {
        let mut pool = two_sequences();
        let top = *pool.pages.free.last().unwrap();
        pool.pages.free.push(top);
        assert!(broken(&pool).contains("twice"));
    }

    #[test]
    fn free_and_held() {
        let mut pool = two_sequences();
        pool.pages.free.push(1);
        assert!(broken(&pool).contains("both free and held"));
    }

    #[test]
    fn refcount_mismatch() {
        let mut pool = two_sequences();
        pool.pages.refcounts[0] = 3;
        assert!(broken(&pool).contains("ref count of page 0 is 3 but 2"));
    }

    #[test]
    fn page_lost() {
        let mut pool = two_sequences();
        pool.pages.free.pop();
        assert!(broken(&pool).contains("a page is lost"));
    }

    #[test]
    fn page_twice_in_one_table() {
        let mut pool = two_sequences();
        let table = pool.tables.get_mut(&1).unwrap();
        *table = table_of(vec![0, 0], 20);
        pool.pages.refcounts[0] = 3;
        pool.pages.refcounts[1] = 0;
        pool.pages.free.push(1);
        assert!(broken(&pool).contains("twice in the page table of sequence 1"));
    }

    #[test]
    fn len_beyond_capacity() {
        let mut pool = two_sequences();
        *pool.tables.get_mut(&2).unwrap() = table_of(vec![0], 17);
        assert!(broken(&pool).contains("needs exactly 2"));
    }

    #[test]
    fn shared_partial_tail() {
        let mut pool = two_sequences();
        *pool.tables.get_mut(&2).unwrap() = table_of(vec![0], 10);
        assert!(broken(&pool).contains("copy-on-write"));
    }
}

//! Occupancy: pure queries the preemption planner reads, never its own estimates.
//!
//! Counted in whole pages: a cell shared by several sequences counts once, and a partly used
//! page counts in full, because that is what allocation can hand out. A cached page (prefix
//! cache: held by no sequence, still findable) is not used: it is reported apart by
//! `cells_cached` and counts as free, since allocation evicts it when nothing else is free; so
//! the planner, which reads `cells_used`, parks nobody while evicting cached pages would do.

use crate::error::KvResult;
use crate::ids::{PageId, SeqId};
use crate::page_table::pages_for;
use crate::pool::KvPool;

impl KvPool {
    /// Cells in pages held by at least one sequence (pages with ref count > 0, × `page_size`).
    pub fn cells_used(&self) -> usize {
        self.pages.used_pages() * self.page_size()
    }

    /// Cells an allocation can take: free pages plus cached ones (a cached page is evicted
    /// when the free list is empty), × `page_size`. `cells_used() + cells_free() == n_cells()`.
    pub fn cells_free(&self) -> usize {
        self.pages.free_pages() * self.page_size()
    }

    /// Cells in cached pages: held by no sequence, findable by their tokens' hash chain until
    /// evicted (part of [`cells_free`](Self::cells_free); 0 with the prefix cache off).
    pub fn cells_cached(&self) -> usize {
        self.pages.cached_pages() * self.page_size()
    }

    /// Cells that removing exactly the sequences `seq_ids` would free: their pages all of whose
    /// holders are in the set, × `page_size` (whether they would then be free or cached). A sequence given twice counts once; an unknown one
    /// is a [`KvError::UnknownSequence`](crate::KvError::UnknownSequence).
    /// Costs O(pages of the given sequences · log), not O(pool).
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::new(64, 16).unwrap();
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 32).unwrap(); // pages [0, 1]
    /// pool.fork(1, 2).unwrap(); // shares both
    /// pool.reserve(2, 33).unwrap(); // + page 2
    /// assert_eq!(pool.cells_freed_by(&[1]).unwrap(), 0); // 2 still holds pages 0 and 1
    /// assert_eq!(pool.cells_freed_by(&[2, 2]).unwrap(), 16); // only page 2
    /// assert_eq!(pool.cells_freed_by(&[1, 2]).unwrap(), 48);
    /// ```
    pub fn cells_freed_by(&self, seq_ids: &[SeqId]) -> KvResult<usize> {
        let mut seqs = seq_ids.to_vec();
        seqs.sort_unstable();
        seqs.dedup();
        let mut held: Vec<PageId> = Vec::new();
        for &seq in &seqs {
            held.extend_from_slice(self.page_table(seq)?);
        }
        // After sorting, each page's run length is how many of the given sequences hold it
        // (a page is at most once in one table); it is freed if that is every holder.
        held.sort_unstable();
        let freed = held
            .chunk_by(|a, b| a == b)
            .filter(|run| run.len() == self.pages.refcount(run[0]) as usize)
            .count();
        Ok(freed * self.page_size())
    }

    /// Whether `n_cells` more cells, rounded up to whole pages, fit in the free and cached
    /// pages.
    pub fn can_fit(&self, n_cells: usize) -> bool {
        pages_for(n_cells, self.page_size()) <= self.pages.free_pages()
    }
}

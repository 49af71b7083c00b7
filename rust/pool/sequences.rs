//! The sequence operations of [`KvPool`]: add, grow, truncate, fork and free a sequence's page
//! table, plus the flat export the runner needs for a step.
//!
//! Copy-on-write keeps one rule: a page shared by several tables is full in each of them.
//! Appending then only ever writes into a private partly used tail page or a fresh page. The two
//! calls that could break the rule, `fork` of a partly used tail and `truncate` into a shared
//! page, give the sequence a private page instead and return `(src, dst)` page pairs the runner
//! must copy (all `page_size` cells of `src` into `dst`) before the next step writes there.
//!
//! ```text
//!   fork(7 -> 9), seq 7 holds 6 cells, page_size 4:
//!     seq 7  [0, 1]       page 0 full: shared (ref count 2)
//!     seq 9  [0, 2]       page 1 partly used: copied, returns [(1, 2)]
//! ```

use super::KvPool;
use crate::error::{KvError, KvResult};
use crate::ids::{PageId, SeqId};
use crate::page_table::{pages_for, PageTable};

impl KvPool {
    pub(super) fn table(&self, seq: SeqId) -> KvResult<&PageTable> {
        self.tables.get(&seq).ok_or(KvError::UnknownSequence(seq))
    }

    /// Adds sequence `seq`, holding no cell. Fails if it exists.
    pub fn add_sequence(&mut self, seq: SeqId) -> KvResult<()> {
        if self.tables.contains_key(&seq) {
            return Err(KvError::SequenceExists(seq));
        }
        self.tables.insert(seq, PageTable::default());
        Ok(())
    }

    /// Whether sequence `seq` exists.
    pub fn has_sequence(&self, seq: SeqId) -> bool {
        self.tables.contains_key(&seq)
    }

    /// Every sequence id, ascending.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.tables.keys().copied().collect()
    }

    /// Cells (tokens) sequence `seq` holds.
    pub fn seq_len(&self, seq: SeqId) -> KvResult<usize> {
        Ok(self.table(seq)?.len)
    }

    /// Sequence `seq`'s pages in logical order: those it holds, after any it released.
    pub fn page_table(&self, seq: SeqId) -> KvResult<&[PageId]> {
        Ok(&self.table(seq)?.pages)
    }

    /// Cells at the start of sequence `seq` that it released (`release_before`): whole pages.
    pub fn released_cells(&self, seq: SeqId) -> KvResult<usize> {
        Ok(self.table(seq)?.released * self.page_size())
    }

    /// Extra pages sequence `seq` needs to span `n_tokens` cells in all (0 if it does already).
    pub fn pages_needed(&self, seq: SeqId, n_tokens: usize) -> KvResult<usize> {
        let have = self.table(seq)?.span();
        Ok(pages_for(n_tokens, self.page_size()).saturating_sub(have))
    }

    /// Gives back the pages of sequence `seq` that lie wholly before logical position `pos`
    /// (they fell behind the sliding window every layer attends over, so no row will read them
    /// again) and returns the cells that went back to the pool: pages no other sequence holds,
    /// free again or cached if registered. The positions stay the sequence's (its length and
    /// registered tokens do not change); only their cells are gone: a slot mapping of them
    /// fails with [`KvError::Released`], and the runner's page tables show `-1` there.
    ///
    /// On an empty sequence it releases positions it never held: its length becomes `pos`
    /// rounded down to a page (how a swap park of a sequence with released pages comes back,
    /// into its later pages only). Fails with [`KvError::OutOfRange`] if `pos` passes the end
    /// of a sequence holding cells.
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::new(64, 4).unwrap();
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 10).unwrap(); // pages [0, 1, 2]
    /// assert_eq!(pool.release_before(1, 9).unwrap(), 8); // pages 0 and 1: wholly before 9
    /// assert_eq!((pool.seq_len(1).unwrap(), pool.released_cells(1).unwrap()), (10, 8));
    /// assert_eq!(pool.page_table(1).unwrap(), &[2]);
    /// assert_eq!(pool.slot_mapping(1, 8, 2).unwrap(), vec![8, 9]);
    /// assert!(pool.slot_mapping(1, 7, 1).is_err());
    /// pool.reserve(1, 13).unwrap(); // grows at its tail as always
    /// assert_eq!(pool.page_table(1).unwrap(), &[2, 0]); // page 0 was the first freed
    /// pool.check_integrity().unwrap();
    /// ```
    pub fn release_before(&mut self, seq: SeqId, pos: usize) -> KvResult<usize> {
        let page_size = self.pages.page_size();
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        let upto = pos / page_size;
        if table.len == 0 {
            table.released = upto;
            table.len = upto * page_size;
            return Ok(0);
        }
        if pos > table.len {
            return Err(KvError::OutOfRange {
                seq,
                start: pos,
                count: 0,
                len: table.len,
            });
        }
        let n = upto.saturating_sub(table.released);
        let mut freed = 0;
        // the later page first, so they come back out of the free list in logical order
        for page in table.pages.drain(..n).rev() {
            freed += usize::from(self.pages.release(page));
        }
        table.released += n;
        Ok(freed * page_size)
    }

    /// Grows sequence `seq` to hold `n_tokens` cells in all and returns the pages it took, in
    /// logical order. All or nothing: [`KvError::PoolFull`] if too few pages are free.
    /// Fails with [`KvError::WouldShrink`] if `n_tokens < seq_len(seq)`.
    ///
    /// ```
    /// # use kvpark_core::{KvError, KvPool};
    /// let mut pool = KvPool::new(32, 16).unwrap(); // 2 pages
    /// pool.add_sequence(1).unwrap();
    /// assert_eq!(pool.reserve(1, 5).unwrap(), vec![0]);
    /// assert!(pool.reserve(1, 16).unwrap().is_empty()); // still fits page 0
    /// assert!(matches!(pool.reserve(1, 33), Err(KvError::PoolFull { needed: 2, free: 1, .. })));
    /// assert_eq!(pool.seq_len(1).unwrap(), 16); // unchanged by the failure
    /// ```
    pub fn reserve(&mut self, seq: SeqId, n_tokens: usize) -> KvResult<Vec<PageId>> {
        let page_size = self.pages.page_size();
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if n_tokens < table.len {
            return Err(KvError::WouldShrink {
                seq,
                len: table.len,
                requested: n_tokens,
            });
        }
        let have = table.pages.len();
        let needed = pages_for(n_tokens, page_size) - table.span();
        self.pages.ensure_free(needed)?;
        debug_assert!(
            n_tokens == table.len
                || table.len % page_size == 0
                || table
                    .pages
                    .last()
                    .is_some_and(|&p| self.pages.refcount(p) == 1 && !self.pages.is_registered(p)),
            "sequence {seq} would write into a shared or registered page"
        );
        for _ in 0..needed {
            table.pages.push(self.pages.alloc());
        }
        table.len = n_tokens;
        Ok(table.pages[have..].to_vec())
    }

    /// Keeps the first `n_tokens` cells of sequence `seq` and releases the pages it no longer
    /// needs (ref count -1; a page nobody holds is free again).
    ///
    /// If the new tail page is partly used and shared (or registered in the prefix cache), the
    /// sequence gets a private copy of it (copy-on-write) and the call returns `[(src, dst)]`,
    /// the page copy the runner must do; else `[]`. Registered tokens past `n_tokens` are
    /// forgotten. [`KvError::PoolFull`] if no page is left for the copy (a page this call
    /// releases counts as free). Fails with [`KvError::WouldGrow`] if `n_tokens > seq_len(seq)`.
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::new(64, 4).unwrap();
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 8).unwrap(); // pages [0, 1], both full
    /// pool.fork(1, 2).unwrap(); // 2 shares both pages
    /// assert_eq!(pool.truncate(1, 6).unwrap(), vec![(1, 2)]); // page 1 now partly used: copied
    /// assert_eq!(pool.page_table(1).unwrap(), &[0, 2]);
    /// assert_eq!(pool.truncate(1, 4).unwrap(), vec![]); // page 2 released, page 0 full
    /// assert_eq!(pool.page_refcount(2).unwrap(), 0);
    /// assert_eq!(pool.page_table(2).unwrap(), &[0, 1]); // the fork is untouched
    /// ```
    pub fn truncate(&mut self, seq: SeqId, n_tokens: usize) -> KvResult<Vec<(PageId, PageId)>> {
        let page_size = self.pages.page_size();
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if n_tokens > table.len {
            return Err(KvError::WouldGrow {
                seq,
                len: table.len,
                requested: n_tokens,
            });
        }
        let span = pages_for(n_tokens, page_size);
        if span < table.released || (span == table.released && n_tokens % page_size != 0) {
            return Err(KvError::Released {
                seq,
                pos: n_tokens,
                released: table.released,
            });
        }
        // the held pages kept
        let keep = span - table.released;
        // A registered page is copied too: other sequences may find it by its key, so its
        // cells must never change (it stays registered, held by others or cached).
        let copy_tail = n_tokens % page_size != 0 && {
            let tail = table.pages[keep - 1];
            self.pages.refcount(tail) > 1 || self.pages.is_registered(tail)
        };
        if copy_tail {
            let released = table.pages[keep..]
                .iter()
                .filter(|&&p| self.pages.refcount(p) == 1)
                .count();
            if self.pages.free_pages() + released == 0 {
                return Err(KvError::PoolFull {
                    needed: 1,
                    free: 0,
                    page_size,
                });
            }
        }
        for page in table.pages.drain(keep..).rev() {
            self.pages.release(page);
        }
        table.len = n_tokens;
        if let Some(chain) = self.chains.get_mut(&seq) {
            chain.truncate(n_tokens, page_size);
        }
        if !copy_tail {
            return Ok(Vec::new());
        }
        let src = table.pages[keep - 1];
        let dst = self.pages.alloc();
        // Allocating may evict a cached page, and with it the keys of the pages its chain ran on
        // to: `src` may have lost its key here, and held by this sequence alone it is then its
        // own to write in place. The fresh page goes back; no copy.
        if self.pages.refcount(src) == 1 && !self.pages.is_registered(src) {
            self.pages.release(dst);
            return Ok(Vec::new());
        }
        let registered = self.pages.is_registered(src);
        let freed = self.pages.release(src);
        debug_assert!(!freed || registered, "copied page {src} was not shared");
        table.pages[keep - 1] = dst;
        Ok(vec![(src, dst)])
    }

    /// Adds sequence `child` holding the same cells as `parent` (prefix sharing for `n > 1`):
    /// the child shares the parent's full pages (ref count +1 each). A partly used last page is
    /// not shared: the child gets a fresh page, and the call returns `[(src, dst)]`, the page
    /// copy the runner must do; else `[]`. The child has the parent's registered tokens.
    ///
    /// Fails with [`KvError::UnknownSequence`] for an unknown parent, [`KvError::SequenceExists`]
    /// if `child` exists, and [`KvError::PoolFull`] if no page is free for the copy.
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::new(64, 16).unwrap();
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 20).unwrap(); // pages [0, 1]; page 1 holds 4 cells
    /// assert_eq!(pool.fork(1, 2).unwrap(), vec![(1, 2)]);
    /// assert_eq!(pool.page_table(2).unwrap(), &[0, 2]);
    /// assert_eq!(pool.page_refcount(0).unwrap(), 2);
    /// assert_eq!(pool.cells_used(), 48); // page 0 counted once
    /// ```
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> KvResult<Vec<(PageId, PageId)>> {
        let page_size = self.pages.page_size();
        let parent_table = self
            .tables
            .get(&parent)
            .ok_or(KvError::UnknownSequence(parent))?;
        if self.tables.contains_key(&child) {
            return Err(KvError::SequenceExists(child));
        }
        let copy_tail = parent_table.len % page_size != 0;
        if copy_tail {
            self.pages.ensure_free(1)?;
        }
        let mut child_table = parent_table.clone();
        let shared = child_table.pages.len() - usize::from(copy_tail);
        for &page in &child_table.pages[..shared] {
            self.pages.retain(page);
        }
        let mut copies = Vec::new();
        if copy_tail {
            let src = child_table.pages[shared];
            let dst = self.pages.alloc();
            child_table.pages[shared] = dst;
            copies.push((src, dst));
        }
        self.tables.insert(child, child_table);
        if let Some(chain) = self.chains.get(&parent) {
            self.chains.insert(child, chain.clone());
        }
        Ok(copies)
    }

    /// Removes sequence `seq` and returns the cells that went back to the pool: its pages that
    /// no other sequence holds, × `page_size` (free again, or cached if registered).
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::new(64, 16).unwrap();
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 40).unwrap(); // pages [0, 1, 2]
    /// pool.fork(1, 2).unwrap(); // shares 0 and 1, copies 2 into 3
    /// assert_eq!(pool.free_sequence(1).unwrap(), 16); // only page 2 was 1's alone
    /// assert_eq!(pool.free_sequence(2).unwrap(), 48);
    /// assert_eq!(pool.cells_free(), 64);
    /// ```
    pub fn free_sequence(&mut self, seq: SeqId) -> KvResult<usize> {
        let table = self
            .tables
            .remove(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        self.chains.remove(&seq);
        let mut freed = 0;
        for &page in table.pages.iter().rev() {
            freed += usize::from(self.pages.release(page));
        }
        Ok(freed * self.pages.page_size())
    }

    /// Flat cell indices (`page * page_size + offset`) of sequence `seq`'s logical positions
    /// `start..start + count`. Fails with [`KvError::OutOfRange`] past `seq_len(seq)`.
    pub fn slot_mapping(&self, seq: SeqId, start: usize, count: usize) -> KvResult<Vec<usize>> {
        let mut slots = Vec::new();
        self.push_slots(seq, start, count, &mut slots)?;
        Ok(slots)
    }

    /// Appends the slot mapping of `seq`'s positions `start..start + count` to `slots`.
    fn push_slots(
        &self,
        seq: SeqId,
        start: usize,
        count: usize,
        slots: &mut Vec<usize>,
    ) -> KvResult<&PageTable> {
        let table = self.table(seq)?;
        let end = start
            .checked_add(count)
            .filter(|&end| end <= table.len)
            .ok_or(KvError::OutOfRange {
                seq,
                start,
                count,
                len: table.len,
            })?;
        let page_size = self.page_size();
        let first = table.released;
        if count > 0 && start / page_size < first {
            return Err(KvError::Released {
                seq,
                pos: start,
                released: first,
            });
        }
        slots.extend((start..end).map(|pos| {
            table.pages[pos / page_size - first] as usize * page_size + pos % page_size
        }));
        Ok(table)
    }

    /// Everything the runner needs for one step, in one call: the slot mappings of all items
    /// (`seq_ids[i]`, positions `starts[i]..starts[i] + counts[i]`) concatenated in item order,
    /// and each item's page table over all its logical pages, `-1` for each released one.
    /// Fails as [`slot_mapping`](Self::slot_mapping) does, or with
    /// [`KvError::LengthMismatch`] if the three lists differ in length.
    pub fn export_step(
        &self,
        seq_ids: &[SeqId],
        starts: &[usize],
        counts: &[usize],
    ) -> KvResult<(Vec<usize>, Vec<Vec<i64>>)> {
        if seq_ids.len() != starts.len() || seq_ids.len() != counts.len() {
            return Err(KvError::LengthMismatch {
                seq_ids: seq_ids.len(),
                starts: starts.len(),
                counts: counts.len(),
            });
        }
        let mut slots = Vec::new();
        let mut page_tables = Vec::with_capacity(seq_ids.len());
        for ((&seq, &start), &count) in seq_ids.iter().zip(starts).zip(counts) {
            let table = self.push_slots(seq, start, count, &mut slots)?;
            let released = std::iter::repeat(-1).take(table.released);
            page_tables.push(
                released
                    .chain(table.pages.iter().map(|&p| p.into()))
                    .collect(),
            );
        }
        Ok((slots, page_tables))
    }
}

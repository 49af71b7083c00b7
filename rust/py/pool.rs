//! `kvpark._core.KvPool`: the [`KvPool`] behind a Python class, method for method.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::{KvPool, PageId, SeqId};

/// The KV cell pool: pages of `page_size` cells with ref counts, and each sequence's page table.
///
/// Sequence ids are ints >= 0 chosen by the caller; page ids are 0..n_pages; the cell of page p
/// at offset o has the flat index p * page_size + o. Free pages are handed out LIFO: a fresh
/// pool gives 0, 1, 2, ...; a released page is the next one given. Every failing call changes
/// nothing. Unknown sequence: KeyError; too few free pages: PoolFullError; other bad
/// arguments: ValueError.
///
/// With prefix_cache_salt set, full pages whose token ids were registered stay cached when
/// released (held by no sequence, findable by the hash chain of their tokens) until their room
/// is needed; see register_tokens, match_prefix and docs/preemption.md.
#[pyclass(name = "KvPool", module = "kvpark._core")]
pub(super) struct PyKvPool(pub(super) KvPool);

#[pymethods]
impl PyKvPool {
    /// ValueError unless page_size > 0, n_cells > 0 and n_cells is a multiple of page_size.
    /// prefix_cache_salt (0..2**64): turn the prefix cache on, under this salt (it stands for
    /// the model, dtype and exact-mode tiling: pages are found only under the same salt).
    /// window: every sequence's rows attend over their last `window` positions only, so a
    /// prefix hit needs only the pages of the window before it (set_window).
    #[new]
    #[pyo3(signature = (n_cells, page_size = 16, prefix_cache_salt = None, window = None))]
    fn new(
        n_cells: usize,
        page_size: usize,
        prefix_cache_salt: Option<u64>,
        window: Option<usize>,
    ) -> PyResult<Self> {
        let mut pool = match prefix_cache_salt {
            Some(salt) => KvPool::with_prefix_cache(n_cells, page_size, salt)?,
            None => KvPool::new(n_cells, page_size)?,
        };
        match window {
            Some(0) => return Err(PyValueError::new_err("a window of no positions")),
            Some(w) => pool.set_window(w),
            None => {}
        }
        Ok(Self(pool))
    }

    /// The window the pool's sequences slide over; None where they attend to everything.
    #[getter]
    fn window(&self) -> Option<usize> {
        self.0.window()
    }

    /// The prefix cache's salt; None when it is off.
    #[getter]
    fn prefix_cache_salt(&self) -> Option<u64> {
        self.0.prefix_cache_salt()
    }

    /// Cells per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.0.page_size()
    }

    /// Pages in the pool.
    #[getter]
    fn n_pages(&self) -> usize {
        self.0.n_pages()
    }

    /// Cells in the pool.
    #[getter]
    fn n_cells(&self) -> usize {
        self.0.n_cells()
    }

    /// Add a sequence holding no cell. ValueError if it exists. With a nonzero cache_salt its
    /// pages are found only by sequences of the same salt, and it finds only theirs.
    #[pyo3(signature = (seq_id, cache_salt = 0))]
    fn add_sequence(&mut self, seq_id: SeqId, cache_salt: u64) -> PyResult<()> {
        Ok(self.0.add_salted_sequence(seq_id, cache_salt)?)
    }

    /// Whether the sequence exists.
    fn has_sequence(&self, seq_id: SeqId) -> bool {
        self.0.has_sequence(seq_id)
    }

    /// Every sequence id, ascending.
    fn sequences(&self) -> Vec<SeqId> {
        self.0.sequences()
    }

    /// Cells (tokens) the sequence spans, released ones included.
    fn seq_len(&self, seq_id: SeqId) -> PyResult<usize> {
        Ok(self.0.seq_len(seq_id)?)
    }

    /// Cells at the start of the sequence it released (release_before): whole pages.
    fn released_cells(&self, seq_id: SeqId) -> PyResult<usize> {
        Ok(self.0.released_cells(seq_id)?)
    }

    /// Gives back the sequence's pages wholly before position pos (behind every layer's
    /// sliding window); returns the cells that went back to the pool. On an empty sequence its
    /// length becomes pos rounded down to a page, all released. ValueError past the end.
    fn release_before(&mut self, seq_id: SeqId, pos: usize) -> PyResult<usize> {
        Ok(self.0.release_before(seq_id, pos)?)
    }

    /// The sequence's pages in logical order: those it holds, after any it released.
    fn page_table(&self, seq_id: SeqId) -> PyResult<Vec<PageId>> {
        Ok(self.0.page_table(seq_id)?.to_vec())
    }

    /// Extra pages the sequence needs to hold n_tokens cells in all (0 if it does already).
    fn pages_needed(&self, seq_id: SeqId, n_tokens: usize) -> PyResult<usize> {
        Ok(self.0.pages_needed(seq_id, n_tokens)?)
    }

    /// Grow the sequence to hold n_tokens cells in all; return the new page ids.
    ///
    /// All or nothing: PoolFullError changes nothing. ValueError if n_tokens < seq_len.
    fn reserve(&mut self, seq_id: SeqId, n_tokens: usize) -> PyResult<Vec<PageId>> {
        Ok(self.0.reserve(seq_id, n_tokens)?)
    }

    /// Keep the first n_tokens cells; release the pages no longer needed.
    ///
    /// A partly used new tail page shared with another sequence is replaced by a private copy:
    /// returns [(src_page, dst_page)], the page copy the runner must do, else [].
    /// PoolFullError (nothing changed) if no page is left for the copy; ValueError if
    /// n_tokens > seq_len.
    fn truncate(&mut self, seq_id: SeqId, n_tokens: usize) -> PyResult<Vec<(PageId, PageId)>> {
        Ok(self.0.truncate(seq_id, n_tokens)?)
    }

    /// Add sequence child sharing parent's full pages (ref counts +1).
    ///
    /// A partly used last page is not shared: the child gets a fresh page and the call returns
    /// [(src_page, dst_page)], the page copy the runner must do, else []. KeyError if parent is
    /// unknown, ValueError if child exists, PoolFullError (nothing changed) if no page is free.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> PyResult<Vec<(PageId, PageId)>> {
        Ok(self.0.fork(parent, child)?)
    }

    /// Remove the sequence; return the cells that went back to the pool (pages nobody else
    /// holds, times page_size).
    fn free_sequence(&mut self, seq_id: SeqId) -> PyResult<usize> {
        Ok(self.0.free_sequence(seq_id)?)
    }

    /// Flat cell indices page * page_size + offset of logical positions start..start+count.
    ///
    /// ValueError if start + count > seq_len.
    fn slot_mapping(&self, seq_id: SeqId, start: usize, count: usize) -> PyResult<Vec<usize>> {
        Ok(self.0.slot_mapping(seq_id, start, count)?)
    }

    /// One call per step: (concatenated slot mappings of every (seq_id, start, count) item,
    /// each item's page table).
    ///
    /// Errors as slot_mapping; ValueError if the three lists differ in length.
    fn export_step(
        &self,
        seq_ids: Vec<SeqId>,
        starts: Vec<usize>,
        counts: Vec<usize>,
    ) -> PyResult<(Vec<usize>, Vec<Vec<i64>>)> {
        Ok(self.0.export_step(&seq_ids, &starts, &counts)?)
    }

    /// Cells in pages held by at least one sequence: a shared cell once, a partly used page in
    /// full.
    fn cells_used(&self) -> usize {
        self.0.cells_used()
    }

    /// Cells an allocation can take: free pages plus cached ones (evicted when needed).
    fn cells_free(&self) -> usize {
        self.0.cells_free()
    }

    /// Cells that removing exactly these sequences would free (pages all of whose holders are
    /// among them). A sequence given twice counts once; KeyError for an unknown one.
    fn cells_freed_by(&self, seq_ids: Vec<SeqId>) -> PyResult<usize> {
        Ok(self.0.cells_freed_by(&seq_ids)?)
    }

    /// Whether n_cells more cells, rounded up to whole pages, fit in the free and cached pages.
    fn can_fit(&self, n_cells: usize) -> bool {
        self.0.can_fit(n_cells)
    }

    /// Cells in cached pages: held by no sequence, findable until evicted (part of
    /// cells_free; 0 with the prefix cache off).
    fn cells_cached(&self) -> usize {
        self.0.cells_cached()
    }

    /// Tell the pool the token ids of the sequence's next cells, once a step has written their
    /// K and V (prompt and decoded rows alike); every page this fills is registered. Returns
    /// the pages newly registered. ValueError (nothing changed) if the registered tokens
    /// would pass seq_len. With the prefix cache off: checks the same, registers nothing.
    fn register_tokens(&mut self, seq_id: SeqId, tokens: Vec<u32>) -> PyResult<usize> {
        Ok(self.0.register_tokens(seq_id, &tokens)?)
    }

    /// register_tokens for every (seq_ids[i], tokens[i]) in order, in one call per step; all
    /// or nothing. ValueError if the lists differ in length.
    fn register_step(&mut self, seq_ids: Vec<SeqId>, tokens: Vec<Vec<u32>>) -> PyResult<usize> {
        Ok(self.0.register_step(&seq_ids, &tokens)?)
    }

    /// Tokens of the sequence registered so far (0 with the prefix cache off).
    fn registered_len(&self, seq_id: SeqId) -> PyResult<usize> {
        Ok(self.0.registered_len(seq_id)?)
    }

    /// Pure: (tokens covered, cached cells) of the longest chain of whole registered pages
    /// matching the start of tokens[:max_tokens], among pages of cache_salt. Cached cells:
    /// those of the hit held by no sequence now, which cost room when taken.
    #[pyo3(signature = (tokens, max_tokens, cache_salt = 0))]
    fn cached_prefix(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
        cache_salt: u64,
    ) -> (usize, usize) {
        let hit = self.0.cached_prefix_salted(&tokens, max_tokens, cache_salt);
        (hit.tokens, hit.cached_cells)
    }

    /// Pure: the room (free or cached cells) a new sequence holding n_cells cells takes after
    /// attaching its cached prefix of tokens[:max_tokens] (pages of cache_salt). For the admission check against
    /// cells_free() and a parked request's resume_cells.
    #[pyo3(signature = (tokens, max_tokens, n_cells, cache_salt = 0))]
    fn cells_to_admit(
        &self,
        tokens: Vec<u32>,
        max_tokens: usize,
        n_cells: usize,
        cache_salt: u64,
    ) -> usize {
        self.0
            .cells_to_admit_salted(&tokens, max_tokens, n_cells, cache_salt)
    }

    /// Attach to the empty sequence the longest chain of whole registered pages matching the
    /// start of tokens[:max_tokens]; return the tokens covered (its new seq_len; 0: no hit).
    /// Takes no free page. Pass max_tokens = len(prompt) - 1 for a prompt, the computed count
    /// for a swap resume. ValueError if the sequence holds cells; 0 with the cache off.
    fn match_prefix(
        &mut self,
        seq_id: SeqId,
        tokens: Vec<u32>,
        max_tokens: usize,
    ) -> PyResult<usize> {
        Ok(self.0.match_prefix(seq_id, &tokens, max_tokens)?)
    }

    /// The page's key in the hash chain if it is registered (held or cached), else None.
    /// ValueError if not in 0..n_pages.
    fn page_key(&self, page: usize) -> PyResult<Option<u64>> {
        Ok(self.0.page_key(page)?)
    }

    /// The cached pages in the order eviction would take them (least recently cached leaf
    /// first). O(cached); for tests and debugging.
    fn eviction_order(&self) -> Vec<PageId> {
        self.0.eviction_order()
    }

    /// How many page tables hold the page (0: free). ValueError if not in 0..n_pages.
    fn page_refcount(&self, page: usize) -> PyResult<u32> {
        Ok(self.0.page_refcount(page)?)
    }

    /// Check every invariant of the pool in O(pool); RuntimeError naming the broken one.
    fn check_integrity(&self) -> PyResult<()> {
        Ok(self.0.check_integrity()?)
    }

    /// Drop every sequence and cached page; the pool is then as if new (the cache stays on).
    fn reset(&mut self) {
        self.0.reset();
    }

    fn __repr__(&self) -> String {
        format!(
            "KvPool(n_cells={}, page_size={}, cells_used={}, cells_cached={}, sequences={})",
            self.0.n_cells(),
            self.0.page_size(),
            self.0.cells_used(),
            self.0.cells_cached(),
            self.0.sequences().len()
        )
    }
}

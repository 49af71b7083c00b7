//! Page tables: each sequence's pages in logical order and the cells it holds. A leaf: the
//! pool (`pool/sequences.rs`) grows, truncates, forks and frees them, keeping copy-on-write.

use crate::ids::PageId;

/// Pages needed to hold `n_cells` cells: `ceil(n_cells / page_size)`.
pub(crate) fn pages_for(n_cells: usize, page_size: usize) -> usize {
    n_cells.div_ceil(page_size)
}

/// One sequence's pages in logical order and the cells it holds: logical position `i` lives in
/// `pages[i / page_size - released]` at offset `i % page_size`. The first `released` pages were
/// given back (they fell behind every layer's sliding window: `KvPool::release_before`), so
/// `pages` holds exactly `ceil(len / page_size) - released` pages (the pool's sequence
/// operations keep it so; `check_integrity` checks it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PageTable {
    /// The pages it holds, in logical order: those after its released ones.
    pub(crate) pages: Vec<PageId>,
    /// Cells (tokens) the sequence spans, released ones included.
    pub(crate) len: usize,
    /// Pages from the start given back: their positions hold no cell any more.
    pub(crate) released: usize,
}

impl PageTable {
    /// Logical pages, released ones included: `ceil(len / page_size)`.
    pub(crate) fn span(&self) -> usize {
        self.released + self.pages.len()
    }
}

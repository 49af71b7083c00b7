//! Page tables: each sequence's pages in logical order and the cells it holds. A leaf: the
//! pool (`pool/sequences.rs`) grows, truncates, forks and frees them, keeping copy-on-write.

use crate::ids::PageId;

/// Pages needed to hold `n_cells` cells: `ceil(n_cells / page_size)`.
pub(crate) fn pages_for(n_cells: usize, page_size: usize) -> usize {
    n_cells.div_ceil(page_size)
}

/// One sequence's pages in logical order and the cells it holds: logical position `i` lives in
/// `pages[i / page_size]` at offset `i % page_size`. Holds exactly `ceil(len / page_size)` pages
/// (the pool's sequence operations keep it so; `check_integrity` checks it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PageTable {
    /// The pages, in logical order.
    pub(crate) pages: Vec<PageId>,
    /// Cells (tokens) the sequence holds.
    pub(crate) len: usize,
}

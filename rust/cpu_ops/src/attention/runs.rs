//! Runs of entries: consecutive attention entries of one sequence at consecutive positions (a
//! prompt chunk's rows), each entry's cells the previous entry's and one more (less the first,
//! where a sliding window has moved on). A task takes a block of a run's entries and reads each
//! K and V row once for all of them, instead of once per entry.
//!
//! ```text
//!   entry i    cells (positions 0..)            union of the block, and each entry's range in it
//!   5          c0 c1 c2 c3 c4 c5                c0 c1 c2 c3 c4 c5 c6 c7
//!   6          c0 c1 c2 c3 c4 c5 c6             [0, 6)  [0, 7)  [0, 8)        no window
//!   7          c0 c1 c2 c3 c4 c5 c6 c7
//! ```
//!
//! A run changes no entry's arithmetic: each entry still makes its scores, its softmax and its
//! weighted sum over its own cells, in their order (`block.rs`).

use super::DecodeAttention;

/// Entries per block: how many rows share one read of each K and V row.
pub(super) const BLOCK_ENTRIES: usize = 8;

/// A block of entries `entries` of one run, and where each one's cells start in the block's
/// union (`starts[i]` for entry `entries.start + i`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Block {
    pub(super) entries: std::ops::Range<usize>,
    pub(super) starts: [usize; BLOCK_ENTRIES],
}

/// Whether entry `b` continues entry `b - 1`: its cells are the tail of the previous entry's
/// (all of them, or all but the first few) followed by one more.
fn continues(a: &DecodeAttention<'_>, b: usize) -> bool {
    let (prev, ctx) = (a.context[b - 1] as usize, a.context[b] as usize);
    if ctx < 2 || ctx > prev + 1 {
        return false;
    }
    let mine = &a.cells[b * a.stride..][..ctx - 1];
    let theirs = &a.cells[(b - 1) * a.stride + prev + 1 - ctx..][..ctx - 1];
    mine == theirs
}

/// The step's entries cut into blocks: runs of continuing entries, each cut into blocks of at
/// most [`BLOCK_ENTRIES`]; an entry that continues none is a block of its own.
pub(super) fn blocks(a: &DecodeAttention<'_>) -> Vec<Block> {
    let mut out: Vec<Block> = Vec::new();
    for b in 0..a.rows.len() {
        let joins = b > 0 && continues(a, b);
        match out.last_mut() {
            Some(last) if joins && last.entries.len() < BLOCK_ENTRIES => {
                let i = last.entries.len();
                let prev = a.context[b - 1] as usize;
                // the previous entry's start, moved on by the cells this one drops
                last.starts[i] = last.starts[i - 1] + prev + 1 - a.context[b] as usize;
                last.entries.end = b + 1;
            }
            _ => out.push(Block {
                entries: b..b + 1,
                starts: [0; BLOCK_ENTRIES],
            }),
        }
    }
    out
}

impl Block {
    /// The cells of the block's union, in order: the first entry's, then the last cell of each
    /// later one.
    pub(super) fn union(&self, a: &DecodeAttention<'_>, out: &mut Vec<i64>) {
        out.clear();
        let first = self.entries.start;
        out.extend_from_slice(&a.cells[first * a.stride..][..a.context[first] as usize]);
        for b in first + 1..self.entries.end {
            out.push(a.cells[b * a.stride + a.context[b] as usize - 1]);
        }
    }

    /// Entry `b`'s cells as a range of the union.
    pub(super) fn range(&self, a: &DecodeAttention<'_>, b: usize) -> std::ops::Range<usize> {
        let start = self.starts[b - self.entries.start];
        start..start + a.context[b] as usize
    }
}

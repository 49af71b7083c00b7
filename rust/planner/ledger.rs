//! The planner's cell arithmetic: what the pool holds, what the next step adds, what the
//! victims chosen so far free and what the resumes so far take, all in cells of whole pages.
//!
//! ```text
//!   occupied = used - freed(leaving) + step(still running) + resumed
//!   fits(more) <=> occupied + more + margin <= n_cells      (margin 0 when occupied == 0)
//! ```
//!
//! `freed` is always `pool.cells_freed_by(every sequence leaving)`, recomputed over the whole
//! set, never a sum of per-victim figures: a page two victims share is freed only once both
//! leave, and a page shared with a resident is never freed.

use crate::error::KvResult;
use crate::ids::SeqId;
use crate::page_table::pages_for;
use crate::pool::KvPool;

pub(super) struct Ledger<'p> {
    pool: &'p KvPool,
    /// The margin in cells, a whole number of pages.
    margin: usize,
    /// `pool.cells_used()` in the snapshot.
    used: usize,
    /// Cells the next step adds for the requests still running.
    step: usize,
    /// Step cells of the requests that left.
    step_removed: usize,
    /// Cells charged for the resumes decided so far.
    resumed: usize,
    /// Every sequence of the requests that left (parked or failed by this plan).
    leaving: Vec<SeqId>,
    /// `pool.cells_freed_by(leaving)`.
    freed: usize,
    /// Running + Restoring requests still running.
    running: usize,
    /// Reused for the what-if queries.
    scratch: Vec<SeqId>,
}

impl<'p> Ledger<'p> {
    pub(super) fn new(pool: &'p KvPool, margin_cells: usize, step: usize, running: usize) -> Self {
        Self {
            pool,
            margin: pages_for(margin_cells, pool.page_size()) * pool.page_size(),
            used: pool.cells_used(),
            step,
            step_removed: 0,
            resumed: 0,
            leaving: Vec::new(),
            freed: 0,
            running,
            scratch: Vec::new(),
        }
    }

    pub(super) fn n_cells(&self) -> usize {
        self.pool.n_cells()
    }

    /// `cells` rounded up to whole pages.
    pub(super) fn pages_of(&self, cells: usize) -> usize {
        pages_for(cells, self.pool.page_size()) * self.pool.page_size()
    }

    /// Requests still running (Running or Restoring, not parked or failed by this plan).
    pub(super) fn running(&self) -> usize {
        self.running
    }

    /// Cells held or about to be taken after the decisions so far.
    pub(super) fn occupied(&self) -> usize {
        self.used - self.freed + self.step + self.resumed
    }

    /// Cells by which the pool would be over (margin included) if `less` cells left and `more`
    /// came in; 0 if it fits. The margin is waived when nothing else is resident.
    pub(super) fn over_by(&self, less: usize, more: usize) -> usize {
        let others = self.occupied().saturating_sub(less);
        let margin = if others == 0 { 0 } else { self.margin };
        (others + more + margin).saturating_sub(self.n_cells())
    }

    /// The shortfall of the step as decided so far, with `more` cells on top.
    pub(super) fn shortfall(&self, more: usize) -> usize {
        self.over_by(0, more)
    }

    /// Cells freed by parking so far plus the step cells of those parked: what the victims
    /// have gained.
    pub(super) fn gained(&self) -> usize {
        self.freed + self.step_removed
    }

    /// Cells `seqs` alone would free (their pages nobody else holds).
    pub(super) fn alone_cells(&self, seqs: &[SeqId]) -> KvResult<usize> {
        self.pool.cells_freed_by(seqs)
    }

    /// Cells that `seqs` leaving too would free on top of what is freed already.
    pub(super) fn freed_with(&mut self, seqs: &[SeqId]) -> KvResult<usize> {
        if seqs.is_empty() {
            return Ok(0);
        }
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.leaving);
        self.scratch.extend_from_slice(seqs);
        Ok(self.pool.cells_freed_by(&self.scratch)? - self.freed)
    }

    /// A running request leaves (parked or failed): its sequences and its step.
    pub(super) fn leave(&mut self, seqs: &[SeqId], step_cells: usize) -> KvResult<()> {
        self.leaving.extend_from_slice(seqs);
        self.freed = self.pool.cells_freed_by(&self.leaving)?;
        self.step -= step_cells;
        self.step_removed += step_cells;
        self.running -= 1;
        Ok(())
    }

    /// A parked request comes back taking `cells` (whole pages).
    pub(super) fn admit(&mut self, cells: usize) {
        self.resumed += cells;
        self.running += 1;
    }
}

//! Admission, the rows of a step and the planner's view of the requests.

use kvpark_core::{ParkMode, RequestState, RequestView, SeqId};

use super::{pages_for, tokens, Phase, Sim};
use crate::{Outcome, Violation};

impl Sim {
    pub(super) fn admit(&mut self) {
        let ps = self.cfg.page_size;
        let mut order: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| self.reqs[i].phase == Phase::Waiting)
            .filter(|&i| self.reqs[i].spec.arrival_step <= self.step)
            .collect();
        order.sort_by_key(|&i| self.reqs[i].arrival);
        for i in order {
            let spec = &self.reqs[i].spec;
            if pages_for(spec.prompt_len, ps) > self.pool.n_pages() || spec.n > self.cfg.parallel {
                self.reqs[i].phase = Phase::Done(Outcome::Refused);
                continue;
            }
            let parked = self
                .reqs
                .iter()
                .any(|r| matches!(r.phase, Phase::Parked(_)));
            let free_slots = self.slot_owner.iter().filter(|s| s.is_none()).count();
            let decoding: usize = self
                .reqs
                .iter()
                .filter(|r| r.phase == Phase::Running)
                .map(|r| r.seqs.len())
                .sum();
            let mut seq = tokens::prompt(spec, i);
            // The last prompt token is always computed: its row gives the first logits.
            let max_hit = spec.prompt_len - 1;
            let hit = self.pool.cached_prefix(&seq.tokens, max_hit).tokens;
            let rows = (spec.prompt_len - hit).min(self.cfg.max_batch_tokens);
            let room = self.pool.cells_to_admit(&seq.tokens, max_hit, hit + rows);
            let fits = self.pool.can_fit(room + decoding * ps);
            if parked || free_slots < spec.n || !fits || !self.family_room(i) {
                return; // head of line: nobody passes it
            }
            let n = spec.n;
            for _ in 0..n {
                let slot = self.slot_owner.iter().position(|s| s.is_none()).unwrap();
                self.slot_owner[slot] = Some(i);
                self.reqs[i].slots.push(slot as u32);
            }
            seq.id = self.new_seq();
            self.pool.add_sequence(seq.id).unwrap();
            seq.computed = self
                .pool
                .match_prefix(seq.id, &seq.tokens, max_hit)
                .unwrap();
            self.report.hit_tokens += seq.computed as u64;
            if seq.computed != hit {
                self.wrong_hits += 1; // a violation at the end of the step
            }
            let req = &mut self.reqs[i];
            req.admit_hit = seq.computed;
            req.seqs.push(seq);
            req.phase = Phase::Running;
        }
    }

    /// Whether head `i` may start: a family joins the running families only if all of them can
    /// reach their peaks at once, since a forked family is never parked (the Python
    /// scheduler's `StepCells.family_room`); alone it always may.
    fn family_room(&self, i: usize) -> bool {
        let ps = self.cfg.page_size;
        let families: Vec<usize> = self
            .running()
            .into_iter()
            .filter(|&j| self.reqs[j].family())
            .collect();
        if !self.reqs[i].family() || families.is_empty() {
            return true;
        }
        let peaks: usize = families.iter().map(|&j| self.reqs[j].peak_cells(ps)).sum();
        peaks + self.reqs[i].peak_cells(ps) <= self.cfg.n_cells
    }

    pub(super) fn new_seq(&mut self) -> SeqId {
        self.next_seq += 1;
        self.next_seq
    }

    /// Running requests in arrival order.
    pub(super) fn running(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| self.reqs[i].phase == Phase::Running)
            .collect();
        order.sort_by_key(|&i| self.reqs[i].arrival);
        order
    }

    /// Tentative rows of the running requests: decodes first, then chunks oldest first.
    ///
    /// The "next rows" rule, mirrored here on purpose: the simulator is a test oracle, so it
    /// re-derives the rule of the Python scheduler (`Scheduler.next_rows` in
    /// python/kvpark/sched/scheduler.py, and `_next_rows` in python/kvpark/preempt/views.py for
    /// the `resume_cells` of `views` below) rather than sharing code with it. Keep the two in
    /// step when the rule changes.
    pub(super) fn schedule_running(&mut self) {
        let mut budget = self.cfg.max_batch_tokens;
        let order = self.running();
        for &i in &order {
            for s in &mut self.reqs[i].seqs {
                s.rows = 0;
                if s.known - s.computed == 1 && budget > 0 {
                    s.rows = 1;
                    budget -= 1;
                }
            }
        }
        self.chunks(&order, budget);
    }

    /// Rows for the requests resumed this step, from what the running ones left.
    pub(super) fn schedule_resumed(&mut self, resumed: &[usize]) {
        let used: usize = self
            .reqs
            .iter()
            .filter(|r| r.phase == Phase::Running)
            .flat_map(|r| r.seqs.iter())
            .map(|s| s.rows)
            .sum();
        let mut order = resumed.to_vec();
        order.sort_by_key(|&i| self.reqs[i].arrival);
        for &i in &order {
            for s in &mut self.reqs[i].seqs {
                s.rows = 0;
            }
        }
        self.chunks(&order, self.cfg.max_batch_tokens.saturating_sub(used));
    }

    fn chunks(&mut self, order: &[usize], mut budget: usize) {
        for &i in order {
            for s in &mut self.reqs[i].seqs {
                let pending = s.known - s.computed;
                if s.rows == 0 && pending > 0 {
                    s.rows = pending.min(budget);
                    budget -= s.rows;
                }
            }
        }
    }

    // ------------------------------------------------------------------ the planner's view

    pub(super) fn views(&self) -> Vec<RequestView> {
        let mut views = Vec::new();
        // Reversed, so that the planner cannot lean on the order it is given.
        for r in self.reqs.iter().rev() {
            let state = match r.phase {
                Phase::Running => RequestState::Running,
                Phase::Parked(mode) => RequestState::Parked(mode),
                Phase::Waiting | Phase::Done(_) => continue,
            };
            // The next-rows rule again (see `schedule_running`): a swap comes back with its
            // cells plus one step's rows, a recompute with its whole replay.
            let resume_cells = match r.phase {
                Phase::Parked(ParkMode::Swap) => r
                    .seqs
                    .iter()
                    .map(|s| s.computed + (s.known - s.computed).min(self.cfg.max_batch_tokens))
                    .sum(),
                Phase::Parked(ParkMode::Recompute) => r.seqs.iter().map(|s| s.known).sum(),
                _ => 0,
            };
            let running = r.phase == Phase::Running;
            views.push(RequestView {
                id: r.id,
                arrival: r.arrival,
                state,
                seq_ids: if running { r.seq_ids() } else { Vec::new() },
                next_cells: if running {
                    r.seqs.iter().map(|s| (s.id, s.computed + s.rows)).collect()
                } else {
                    Vec::new()
                },
                resume_cells,
                state_bytes: r.computed_cells() as u64 * self.cfg.bytes_per_cell,
                parks: r.parks,
                parked_at_ms: r.parked_at_ms,
                resumed_at_ms: r.resumed_at_ms,
                tokens_since_resume: r.tokens_since_resume,
                family: r.family(),
                refused: false,
                slot: r.slots[0],
            });
        }
        views
    }

    pub(super) fn index_of(&self, id: u64) -> Result<usize, Violation> {
        match self.reqs.iter().position(|r| r.id == id) {
            Some(i) => Ok(i),
            None => self.fail(format!("action names unknown request {id}")),
        }
    }
}

//! Reservations, token progress and the invariants checked every step.

use kvpark_core::{choose_victims, Action, ParkMode, Policy, RamView};

use super::{tokens, violation, Event, Phase, Seq, Sim};
use crate::{Outcome, Violation};

impl Sim {
    pub(super) fn check_ram(&self) -> Result<(), Violation> {
        let held: u64 = self.buffers.iter().sum();
        let budget = self.cfg.planner.ram_budget.unwrap_or(u64::MAX);
        if held > budget {
            return self.fail(format!(
                "park buffers hold {held} bytes, over the {budget} budget"
            ));
        }
        for r in &self.reqs {
            if r.phase == Phase::Parked(ParkMode::Swap) {
                let bytes = r.computed_cells() as u64 * self.cfg.bytes_per_cell;
                if self.buffers[r.slots[0] as usize] < bytes {
                    return self.fail(format!("request {}'s buffer lost its state", r.id));
                }
            }
        }
        Ok(())
    }

    /// Cells the scheduled rows need beyond what is free.
    fn step_shortfall(&self) -> usize {
        let ps = self.cfg.page_size;
        let pages: usize = self
            .reqs
            .iter()
            .filter(|r| r.phase == Phase::Running)
            .flat_map(|r| r.seqs.iter())
            .map(|s| self.pool.pages_needed(s.id, s.computed + s.rows).unwrap())
            .sum();
        (pages * ps).saturating_sub(self.pool.cells_free())
    }

    /// With the lookahead on, the step must fit unless nobody could have been parked.
    pub(super) fn check_fits(&self) -> Result<(), Violation> {
        if !self.cfg.planner.park_ahead || self.step_shortfall() == 0 {
            return Ok(());
        }
        let running = self.running();
        // A victim must gain something: cells only it holds (a page it shares with a family's
        // prompt or another request's cached prefix frees nothing) or cells its step needs.
        let parkable = running.iter().any(|&i| {
            let r = &self.reqs[i];
            let held = self.pool.cells_freed_by(&r.seq_ids()).unwrap();
            let step: usize = r
                .seqs
                .iter()
                .map(|s| self.pool.pages_needed(s.id, s.computed + s.rows).unwrap())
                .sum();
            !r.family() && held + step > 0
        });
        if running.len() >= 2 && parkable {
            return self.fail(format!(
                "the plan left the step {} cells short with a victim available",
                self.step_shortfall()
            ));
        }
        Ok(())
    }

    /// Reserves every scheduled row. A reservation that fails parks by `choose_victims`; with
    /// no victim the request sits the step out (its rows wait; a family, which is never parked,
    /// or anyone with the lookahead finding none) while the others run and free cells. Only
    /// when no row runs at all does the newest such request fail with the context error: the
    /// Python scheduler's rule (`Scheduler.schedule`).
    pub(super) fn reserve_rows(&mut self) -> Result<(), Violation> {
        let mut stalled: Vec<usize> = Vec::new();
        loop {
            let order = self.running();
            let mut failed = None;
            for &i in order.iter().filter(|i| !stalled.contains(i)) {
                for s in &self.reqs[i].seqs {
                    if self.pool.reserve(s.id, s.computed + s.rows).is_err() {
                        failed = Some(i);
                        break;
                    }
                }
                if failed.is_some() {
                    break;
                }
            }
            let Some(i) = failed else {
                return self.settle_stalled(&stalled);
            };
            let views = self.views();
            let ram = RamView {
                slot_buffer_capacity: self.buffers.clone(),
            };
            let short = self.step_shortfall();
            let actions = match choose_victims(&self.pool, &views, &ram, &self.cfg.planner, short) {
                Ok(a) => a,
                Err(e) => return self.fail(format!("choose_victims failed: {e}")),
            };
            if actions.is_empty() {
                // The rows of a request that sits out wait; cells its earlier sequences took
                // stay reserved for the next step, as the Python scheduler's do.
                for s in &mut self.reqs[i].seqs {
                    s.rows = 0;
                }
                stalled.push(i);
                continue;
            }
            for action in actions {
                if matches!(action, Action::Park { .. }) {
                    self.report.late_parks += 1;
                }
                self.apply(action, &mut Vec::new())?;
            }
            self.check_ram()?;
        }
    }

    /// After the reservations: if requests sat out and no row runs, the newest of them fails
    /// (a real overflow: nothing else can free a cell), which must not be a request that fits
    /// the pool alone beside other parkable ones.
    fn settle_stalled(&mut self, stalled: &[usize]) -> Result<(), Violation> {
        let running = self.running();
        let rows_run = running
            .iter()
            .any(|&j| self.reqs[j].seqs.iter().any(|s| s.rows > 0));
        let Some(&i) = stalled.iter().max_by_key(|&&j| self.reqs[j].arrival) else {
            return Ok(());
        };
        if rows_run {
            return Ok(());
        }
        let r = &self.reqs[i];
        if r.family() && r.peak_cells(self.cfg.page_size) <= self.cfg.n_cells {
            // admission kept room for every running family's peak; anyone else can be parked
            return self.fail(format!(
                "context error for family {}, which fits alone, beside {} others",
                r.id,
                running.len() - 1
            ));
        }
        if !r.family() && r.peak_cells(self.cfg.page_size) <= self.cfg.n_cells {
            let families = running.iter().filter(|&&j| self.reqs[j].family()).count();
            if running.len() - families > 1 {
                return self.fail(format!(
                    "context error for request {}, which fits alone, beside {} others",
                    r.id,
                    running.len() - 1
                ));
            }
        }
        self.report.fails += 1;
        self.end(i, Outcome::ContextError);
        Ok(())
    }

    /// Computes the rows, samples where a sequence caught up, forks families after the prompt,
    /// ends finished requests.
    pub(super) fn advance(&mut self) -> Result<(), Violation> {
        for i in self.running() {
            let mut sampled = false;
            for s in &mut self.reqs[i].seqs {
                // The step writes the rows' K/V, then the engine registers their tokens.
                self.cells
                    .write(&self.pool, s, s.computed, s.computed + s.rows);
                if self.cfg.prefix_cache && s.rows > 0 {
                    let rows = &s.tokens[s.computed..s.computed + s.rows];
                    if let Err(e) = self.pool.register_tokens(s.id, rows) {
                        return violation(self.step, format!("register failed: {e}"));
                    }
                }
                let (from, rows) = (s.computed as u64, s.rows as u64);
                self.work.rows += rows;
                self.work.positions += rows * from + rows * rows.saturating_sub(1) / 2;
                s.computed += s.rows;
                if s.rows > 0 && s.computed == s.known {
                    let before = s.content.last().copied().unwrap_or(0);
                    s.push(tokens::next_token(before, s.branch));
                    s.generated += 1;
                    sampled = true;
                }
                s.rows = 0;
            }
            if !sampled {
                continue;
            }
            self.tokens += 1;
            if self.reqs[i].seqs[0].generated == 1 && self.reqs[i].seqs.len() == 1 {
                self.events.push(Event::FirstToken(i));
            }
            let r = &mut self.reqs[i];
            r.tokens_since_resume = r.tokens_since_resume.saturating_add(1);
            if r.family() && r.seqs.len() == 1 {
                let parent = r.seqs[0].clone();
                for k in 1..r.spec.n {
                    let child = self.new_seq();
                    let Ok(copies) = self.pool.fork(parent.id, child) else {
                        // No page for the copy of the partly used tail: a family overflows.
                        self.report.fails += 1;
                        self.end(i, Outcome::ContextError);
                        break;
                    };
                    self.cells.copy(self.cfg.page_size, &copies);
                    self.reqs[i].seqs.push(Seq {
                        id: child,
                        branch: k as u64,
                        ..parent.clone()
                    });
                }
                if self.reqs[i].phase != Phase::Running {
                    continue;
                }
            }
            let r = &self.reqs[i];
            if r.seqs.iter().all(|s| s.generated >= r.spec.output_len) {
                self.end(i, Outcome::Finished);
            }
        }
        Ok(())
    }

    /// Every resident sequence reads back its own K/V (no page written while another reads
    /// it, no cached page handed out while held, no hit on other tokens' pages), and every hit
    /// was the one `cached_prefix` promised.
    pub(super) fn check_contents(&self) -> Result<(), Violation> {
        if self.wrong_hits > 0 {
            return self.fail("match_prefix covered other than cached_prefix said".to_string());
        }
        for r in self.reqs.iter().filter(|r| r.phase == Phase::Running) {
            for s in &r.seqs {
                if let Some(j) = self.cells.wrong_at(&self.pool, s, s.computed) {
                    return self.fail(format!(
                        "sequence {} of request {} reads other K/V at position {j}",
                        s.id, r.id
                    ));
                }
            }
        }
        Ok(())
    }

    /// Progress within `stall_bound` steps; the parked head resumes within `head_bound`.
    pub(super) fn check_progress(&mut self) -> Result<(), Violation> {
        let ended = self
            .reqs
            .iter()
            .filter(|r| matches!(r.phase, Phase::Done(_)))
            .count() as u64;
        let progress = self.tokens + ended;
        let active = self.reqs.iter().any(|r| match r.phase {
            Phase::Running | Phase::Parked(_) => true,
            Phase::Waiting => r.spec.arrival_step <= self.step,
            Phase::Done(_) => false,
        });
        if !active || progress > self.last_progress {
            self.stall = 0;
        } else {
            self.stall += 1;
        }
        self.last_progress = progress;
        self.report.max_stall = self.report.max_stall.max(self.stall);
        if self.stall > self.stall_bound {
            return self.fail(format!("no progress for {} steps", self.stall));
        }

        let now = self.now_ms();
        let head = (0..self.reqs.len())
            .filter(|&i| matches!(self.reqs[i].phase, Phase::Parked(_)))
            .min_by_key(|&i| {
                let r = &self.reqs[i];
                let parked_at = match self.cfg.planner.policy {
                    Policy::Fcfs => 0,
                    Policy::Cost => r.parked_at_ms.unwrap_or(now),
                };
                (parked_at, r.arrival, r.id)
            });
        self.head = match (head, self.head) {
            (Some(h), Some((was, since))) if h == was => Some((h, since)),
            (Some(h), _) => Some((h, self.step)),
            (None, _) => None,
        };
        if let Some((h, since)) = self.head {
            let waited = self.step - since;
            self.report.max_head_wait = self.report.max_head_wait.max(waited);
            if waited > self.head_bound {
                return self.fail(format!(
                    "head request {} parked for {waited} steps",
                    self.reqs[h].id
                ));
            }
        }
        Ok(())
    }
}

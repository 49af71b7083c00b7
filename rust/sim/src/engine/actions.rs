//! The plan's actions applied to the pool, the slots and the park buffers, each checked.

use kvpark_core::planner::BUFFER_ALIGN;
use kvpark_core::{Action, ParkMode};

use super::{Event, Phase, Sim};
use crate::{Outcome, Violation};

impl Sim {
    pub(super) fn apply(
        &mut self,
        action: Action,
        resumed: &mut Vec<usize>,
    ) -> Result<(), Violation> {
        match action {
            Action::Fail { id } => {
                let i = self.index_of(id)?;
                let r = &self.reqs[i];
                if !matches!(r.phase, Phase::Running | Phase::Parked(_)) {
                    return self.fail(format!("Fail of request {id} in {:?}", r.phase));
                }
                if !r.family() && r.peak_cells(self.cfg.page_size) <= self.cfg.n_cells {
                    return self.fail(format!("Fail of request {id}, which fits the pool alone"));
                }
                self.report.fails += 1;
                self.end(i, Outcome::ContextError);
            }
            Action::ReleaseBuffer { slot } => {
                let s = slot as usize;
                if s >= self.buffers.len() || self.buffers[s] == 0 {
                    return self.fail(format!("ReleaseBuffer of slot {slot}, which holds none"));
                }
                if let Some(owner) = self.slot_owner[s] {
                    if self.reqs[owner].phase == Phase::Parked(ParkMode::Swap) {
                        return self
                            .fail(format!("ReleaseBuffer of slot {slot}: it holds a state"));
                    }
                }
                self.buffers[s] = 0;
                self.report.releases += 1;
            }
            Action::Park {
                id,
                mode,
                buffer_capacity,
                head,
            } => {
                let i = self.index_of(id)?;
                let running = self.running().len();
                if head.is_none() && running < 2 {
                    return self.fail(format!("Park of request {id}, the only one running"));
                }
                self.park(i, mode, buffer_capacity)?;
            }
            Action::Resume { id } => {
                let i = self.index_of(id)?;
                self.resume(i)?;
                resumed.push(i);
            }
            Action::Rotate {
                victim,
                mode,
                buffer_capacity,
                head,
            } => {
                let v = self.index_of(victim)?;
                let h = self.index_of(head)?;
                self.park(v, mode, buffer_capacity)?;
                self.resume(h)?;
                resumed.push(h);
                self.report.rotations += 1;
            }
        }
        Ok(())
    }

    fn park(&mut self, i: usize, mode: ParkMode, capacity: u64) -> Result<(), Violation> {
        let r = &self.reqs[i];
        if r.phase != Phase::Running || r.family() {
            return self.fail(format!(
                "Park of request {} ({:?}, n={})",
                r.id, r.phase, r.spec.n
            ));
        }
        let bytes = r.computed_cells() as u64 * self.cfg.bytes_per_cell;
        match mode {
            ParkMode::Swap => {
                if capacity < bytes || capacity % BUFFER_ALIGN != 0 {
                    return self.fail(format!(
                        "swap of {bytes} bytes into a {capacity}-byte buffer"
                    ));
                }
                self.buffers[r.slots[0] as usize] = capacity;
                self.report.swaps += 1;
            }
            ParkMode::Recompute => self.report.recomputes += 1,
        }
        let now = self.now_ms();
        let r = &mut self.reqs[i];
        for s in &mut r.seqs {
            self.pool.free_sequence(s.id).unwrap();
            if mode == ParkMode::Recompute {
                s.computed = 0;
            }
            s.rows = 0;
        }
        r.phase = Phase::Parked(mode);
        r.parks += 1;
        r.parked_at_ms = Some(now);
        Ok(())
    }

    fn resume(&mut self, i: usize) -> Result<(), Violation> {
        let now = self.now_ms();
        let Phase::Parked(mode) = self.reqs[i].phase else {
            return self.fail(format!(
                "Resume of request {} in {:?}",
                self.reqs[i].id, self.reqs[i].phase
            ));
        };
        for k in 0..self.reqs[i].seqs.len() {
            let s = &self.reqs[i].seqs[k];
            self.pool.add_sequence(s.id).unwrap();
            // Pages still cached are taken by their tokens' hash: a swap copies back only the
            // rest, a recompute replays only the rest (at least its last token).
            let (tokens, max_hit) = match mode {
                ParkMode::Swap => (&s.tokens[..s.computed], s.computed),
                ParkMode::Recompute => (&s.tokens[..], s.known - 1),
            };
            let hit = self.pool.match_prefix(s.id, tokens, max_hit).unwrap();
            self.report.hit_tokens += hit as u64;
            if mode == ParkMode::Swap {
                if let Err(e) = self.pool.reserve(s.id, s.computed) {
                    return self.fail(format!(
                        "restore of request {} failed: {e}",
                        self.reqs[i].id
                    ));
                }
                // The copy back, then its pages are registered like computed ones.
                let s = &self.reqs[i].seqs[k];
                self.cells.write(&self.pool, s, hit, s.computed);
                if self.cfg.prefix_cache {
                    self.pool
                        .register_tokens(s.id, &s.tokens[hit..s.computed])
                        .unwrap();
                }
            } else {
                self.reqs[i].seqs[k].computed = hit;
            }
        }
        let r = &mut self.reqs[i];
        r.phase = Phase::Running;
        r.resumed_at_ms = Some(now);
        r.tokens_since_resume = 0;
        self.report.resumes += 1;
        Ok(())
    }

    /// Frees everything of request `i` but its slots' park buffers (kept for the next park).
    pub(super) fn end(&mut self, i: usize, outcome: Outcome) {
        for s in &self.reqs[i].seqs {
            if self.pool.has_sequence(s.id) {
                self.pool.free_sequence(s.id).unwrap();
            }
        }
        for &slot in &self.reqs[i].slots {
            self.slot_owner[slot as usize] = None;
        }
        let r = &mut self.reqs[i];
        r.seqs.clear();
        r.slots.clear();
        r.phase = Phase::Done(outcome);
        self.events.push(Event::Ended(i, outcome));
    }
}

//! Resume (head of line) and rotation: which parked request comes back, and when a long wait
//! earns it the cells of residents.
//!
//! Parked requests are tried in the policy's order and only the head is ever tried: a head
//! that does not fit blocks everyone behind it, so its wait is bounded by the residents ahead
//! of it. A head that has waited `rotate_after_ms` is owed the cells: residents not protected
//! by the cooldown are parked for it, and it comes back in the same plan.

use super::victim::Candidate;
use super::{Action, Planner, Policy, RequestState};
use crate::error::KvResult;

impl Planner<'_> {
    /// Resumes parked requests in order while the head fits; at most one rotation.
    pub(super) fn resume(&mut self, now_ms: u64) -> KvResult<()> {
        let mut order: Vec<usize> = (0..self.requests.len())
            .filter(|&i| !self.gone[i] && matches!(self.requests[i].state, RequestState::Parked(_)))
            .collect();
        order.sort_unstable_by_key(|&i| {
            let r = self.requests[i];
            let parked_at = match self.cfg.policy {
                Policy::Fcfs => 0,
                Policy::Cost => r.parked_at_ms.unwrap_or(now_ms),
            };
            (parked_at, r.arrival, r.id)
        });
        let mut rotated = false;
        for head in order {
            let need = self.ledger.pages_of(self.requests[head].resume_cells);
            if self.ledger.over_by(0, need) == 0 {
                self.out.push(Action::Resume {
                    id: self.requests[head].id,
                });
                self.ledger.admit(need);
                continue;
            }
            if rotated || !self.may_rotate(head, now_ms) || !self.rotate(head, need, now_ms)? {
                break;
            }
            rotated = true;
        }
        Ok(())
    }

    /// Whether `head` has waited long enough, and no park copy is in flight (a park still
    /// copying holds its cells, so a rotation now would only park another resident on top).
    fn may_rotate(&self, head: usize, now_ms: u64) -> bool {
        let waited = self.requests[head]
            .parked_at_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= self.cfg.rotate_after_ms);
        waited
            && !self
                .requests
                .iter()
                .any(|r| r.state == RequestState::Parking)
    }

    /// Whether request `i` resumed too recently to be rotated out: until it has decoded
    /// `rotate_min_tokens` tokens, or one token and `rotate_min_ms`.
    fn protected(&self, i: usize, now_ms: u64) -> bool {
        let r = self.requests[i];
        let Some(resumed_at) = r.resumed_at_ms else {
            return false;
        };
        let aged = r.tokens_since_resume >= 1
            && now_ms.saturating_sub(resumed_at) >= self.cfg.rotate_min_ms;
        r.tokens_since_resume < self.cfg.rotate_min_tokens && !aged
    }

    /// Parks residents so that `head` (needing `need` cells) fits, then resumes it. Prefers
    /// the unstarved residents if they alone can make room. Returns false, having done
    /// nothing, if even all candidates together cannot.
    fn rotate(&mut self, head: usize, need: usize, now_ms: u64) -> KvResult<bool> {
        let protected: Vec<bool> = (0..self.requests.len())
            .map(|i| self.protected(i, now_ms))
            .collect();
        let all = self.candidates(|i| !protected[i])?;
        let fresh = self.unstarved(&all);
        let mut set = if fresh.len() < all.len() && self.makes_room(&fresh, need)? {
            fresh
        } else if self.makes_room(&all, need)? {
            all
        } else {
            return Ok(false);
        };
        let head_id = self.requests[head].id;
        loop {
            // Gains change as victims leave (a page shared with an earlier victim): recompute.
            for c in &mut set {
                c.gain = self.ledger.freed_with(&self.requests[c.index].seq_ids)?
                    + self.step_cells[c.index];
            }
            let maker = set
                .iter()
                .filter(|c| self.ledger.over_by(c.gain, need) == 0)
                .min_by_key(|c| self.fewest_cells(c))
                .copied();
            if let Some(c) = maker {
                let (mode, buffer_capacity) = self.park(c.index)?;
                self.out.push(Action::Rotate {
                    victim: self.requests[c.index].id,
                    mode,
                    buffer_capacity,
                    head: head_id,
                });
                self.ledger.admit(need);
                return Ok(true);
            }
            // None makes room alone: the largest goes first, then look again.
            let largest = set
                .iter()
                .max_by_key(|c| (c.gain, self.newest(c)))
                .copied()
                .expect("the whole set makes room, so its last member does");
            set.retain(|c| c.index != largest.index);
            let (mode, buffer_capacity) = self.park(largest.index)?;
            self.out.push(Action::Park {
                id: self.requests[largest.index].id,
                mode,
                buffer_capacity,
                head: Some(head_id),
            });
        }
    }

    /// Whether parking every one of `set` would let `need` cells in.
    fn makes_room(&mut self, set: &[Candidate], need: usize) -> KvResult<bool> {
        if set.is_empty() {
            return Ok(false);
        }
        let mut seqs = Vec::new();
        let mut step = 0;
        for c in set {
            seqs.extend_from_slice(&self.requests[c.index].seq_ids);
            step += self.step_cells[c.index];
        }
        let gain = self.ledger.freed_with(&seqs)? + step;
        Ok(self.ledger.over_by(gain, need) == 0)
    }
}

//! Pressure parks: who is parked when the step does not fit (the choice of victims, by the
//! policy's order and the cells each frees).

use std::cmp::Reverse;

use super::{Action, Ledger, Planner, Policy, RequestState};
use crate::error::KvResult;

/// A request that may be parked, with what parking it gains: the cells it frees on top of the
/// victims so far plus the cells its step would have added.
#[derive(Debug, Clone, Copy)]
pub(super) struct Candidate {
    pub(super) index: usize,
    pub(super) gain: usize,
}

impl Planner<'_> {
    /// Parks victims while `shortfall(ledger)` is not 0, never the last running request;
    /// returns how many it parked.
    pub(super) fn park_for_pressure(
        &mut self,
        shortfall: impl Fn(&Ledger) -> usize,
    ) -> KvResult<usize> {
        let mut parks = 0;
        loop {
            let short = shortfall(&self.ledger);
            if short == 0 || self.ledger.running() < 2 {
                return Ok(parks);
            }
            let candidates = self.candidates(|_| true)?;
            let Some(victim) = self.pick_victim(&candidates, short) else {
                return Ok(parks);
            };
            let (mode, buffer_capacity) = self.park(victim)?;
            self.out.push(Action::Park {
                id: self.requests[victim].id,
                mode,
                buffer_capacity,
                head: None,
            });
            parks += 1;
        }
    }

    /// Requests that may be parked and that `keep` accepts, each with its gain; those with
    /// nothing to gain are left out (parking them cannot help). Ascending by id.
    pub(super) fn candidates(&mut self, keep: impl Fn(usize) -> bool) -> KvResult<Vec<Candidate>> {
        let mut out = Vec::new();
        for index in 0..self.requests.len() {
            let r = self.requests[index];
            if self.gone[index]
                || r.state != RequestState::Running
                || r.family
                || r.refused
                || !keep(index)
            {
                continue;
            }
            let gain = self.ledger.freed_with(&r.seq_ids)? + self.step_cells[index];
            if gain > 0 {
                out.push(Candidate { index, gain });
            }
        }
        Ok(out)
    }

    /// The candidates that are not starved (parked `starved_parks` times), if there are any;
    /// else all of them.
    pub(super) fn unstarved(&self, candidates: &[Candidate]) -> Vec<Candidate> {
        let fresh: Vec<Candidate> = candidates
            .iter()
            .copied()
            .filter(|c| self.requests[c.index].parks < self.cfg.starved_parks)
            .collect();
        if fresh.is_empty() {
            candidates.to_vec()
        } else {
            fresh
        }
    }

    /// Sort key: the newest request is the greatest (arrival, then id).
    pub(super) fn newest(&self, c: &Candidate) -> (u64, u64) {
        let r = self.requests[c.index];
        (r.arrival, r.id)
    }

    /// Sort key: fewest cells first, ties to the newest.
    pub(super) fn fewest_cells(&self, c: &Candidate) -> (usize, Reverse<(u64, u64)>) {
        (c.gain, Reverse(self.newest(c)))
    }

    /// The victim for a shortfall of `short` cells, by the policy, after the starvation guard.
    fn pick_victim(&self, candidates: &[Candidate], short: usize) -> Option<usize> {
        let pool = self.unstarved(candidates);
        let pick = match self.cfg.policy {
            Policy::Fcfs => pool.iter().max_by_key(|c| self.newest(c)),
            Policy::Cost => pool
                .iter()
                .filter(|c| c.gain >= short)
                .min_by_key(|c| self.fewest_cells(c))
                .or_else(|| pool.iter().min_by_key(|c| self.fewest_cells(c))),
        };
        pick.map(|c| c.index)
    }
}

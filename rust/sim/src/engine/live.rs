//! A simulation driven from outside, a step at a time: one replica of `replicas.rs`. Requests
//! are pushed as they arrive (admitted from the next step on), the caller sets the clock each
//! step (its step-time model, not `ms_per_step`), and each step says what it did: the rows it
//! computed and their positions (what the step costs), the requests that got their first token
//! or ended. Every invariant of [`crate::run`] is checked each step as there.

use kvpark_core::KvPool;

use super::{bounds, tokens, Req, Sim};
use crate::{Outcome, Report, SimConfig, SimRequest, Violation, Workload};

/// What happened to a request (its index in push order) during a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    FirstToken(usize),
    Ended(usize, Outcome),
}

/// The rows a step computed, and the sum of their positions (each row attends over its
/// position's cells: what attention costs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Work {
    pub(crate) rows: u64,
    pub(crate) positions: u64,
}

impl Sim {
    /// An engine with nothing to do yet.
    pub(crate) fn idle(cfg: SimConfig) -> Result<Self, Violation> {
        Sim::new(&Workload {
            config: cfg,
            requests: Vec::new(),
        })
    }

    /// Adds a request that arrives now (it may be admitted at the next step); its index.
    pub(crate) fn push(&mut self, mut spec: SimRequest) -> usize {
        spec.arrival_step = self.step;
        let i = self.reqs.len();
        let mut req = Req::waiting(spec);
        req.arrival = i as u64;
        req.id = 1_000_000_000 - i as u64; // against arrival order, as `Sim::new` does
        self.reqs.push(req);
        let specs: Vec<SimRequest> = self.reqs.iter().map(|r| r.spec.clone()).collect();
        (self.head_bound, self.stall_bound) = bounds(&self.cfg, &specs);
        i
    }

    /// Runs one step at `now_ms`: its work and what happened to which request.
    pub(crate) fn step_at(&mut self, now_ms: u64) -> Result<(Work, Vec<Event>), Violation> {
        self.clock_ms = Some(now_ms);
        self.work = Work::default();
        self.one_step()?;
        self.step += 1;
        Ok((self.work, std::mem::take(&mut self.events)))
    }

    pub(crate) fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub(crate) fn report(&self) -> &Report {
        &self.report
    }

    /// Prompt tokens request `i`'s admission took from cached pages.
    pub(crate) fn admit_hit(&self, i: usize) -> usize {
        self.reqs[i].admit_hit
    }

    /// The tokens of `spec`'s prompt (`tokens.rs`): what a router hashes to find the replica
    /// holding its prefix.
    pub(crate) fn prompt_tokens(spec: &SimRequest) -> Vec<u32> {
        tokens::prompt(spec, 0).tokens
    }
}

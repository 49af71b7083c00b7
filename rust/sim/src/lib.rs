//! kvpark-sim: a deterministic workload simulator for kvpark-core's planner and pool, for the
//! planner tests (`rust/tests/planner_props.rs`) and the fuzzer (`fuzz/`); a workspace crate
//! that is never published and never shipped. It plays the engine's part with no model: requests
//! arrive, are admitted into slots, compute their prompt in chunks, decode one token per step,
//! fork into `n` sequences after the prompt, and finish; every step it asks the planner, applies
//! the actions to the pool and the park buffers, schedules rows within `max_batch_tokens`,
//! reserves their cells and advances the tokens.
//!
//! It is also the oracle: [`run`] returns a [`Violation`] the moment one of these breaks:
//! the pool's integrity (no page has two owners, ref counts, free + used), a reservation the
//! planner said would fit, the RAM budget, a swap buffer smaller than its state, an action that
//! names the wrong request (a family or last running request parked for pressure, a resume of a
//! request that is not parked, an idle buffer given back while it holds a state), a context
//! error for a request that fits the pool alone (a family too: it is never parked, so admission
//! keeps room for every running family's peak), progress (some token generated or request ended) within a bound,
//! a parked head resuming within a bound, and every request ending.
//!
//! Engine behaviour modelled (the Python side's, as the planner expects it):
//! - admission is FIFO and head of line, only while nothing is parked, only if the first chunk
//!   plus a page per decoding sequence is free, and a family only if the running families' peaks
//!   and its own fit the pool together (or none runs); a prompt longer than the pool, or a request
//!   wanting more sequences than there are slots, is refused;
//! - rows: decodes first, then prompt and replay chunks oldest first, within the row budget;
//!   a request resumed by the plan runs in the same step with the rows left over (the Python
//!   scheduler's "next rows" rule, re-derived here on purpose as the oracle: see `engine/rows.rs`);
//! - swap park keeps the computed count; recompute park drops it and replays prompt plus
//!   generated tokens; `resume_cells` is the restored cells plus the next rows (swap) or all the
//!   tokens to replay (recompute);
//! - a reservation that fails anyway (the lookahead off, or families only) parks by
//!   [`choose_victims`](kvpark_core::choose_victims); with no victim the request sits the step
//!   out while the others run, and only when no row runs at all does the newest such request
//!   fail with the context error.
//!
//! With the prefix cache on ([`SimConfig::prefix_cache`]) requests draw prompts from a few
//! shared streams, admissions and resumes take what is cached (`match_prefix`; a swap copies
//! back and a recompute replays only the rest), and every step registers the tokens it
//! computed. The oracle then also keeps a shadow of every cell's content (a hash of the tokens
//! up to it: what K/V depend on) and fails a run where a resident sequence reads other K/V: a
//! cached page handed out while held, a page written while shared or registered, a hit on
//! another prompt's pages. The planner's `resume_cells` stay the full count (a hit page costs
//! room as a fresh one: cached pages count as free; see docs/preemption.md).
//!
//! Replicas ([`run_fleet`], `replicas.rs`): several such engines behind a router, on a
//! multi-turn chat workload, each on its own clock with a step-time model fitted to kvpark's
//! measured steps: prefix hit rate, parks and time to first token per routing policy
//! (docs/scale-out.md; `cargo run --release -p kvpark-sim --example routing` prints the table).
//!
//! Files: this one holds the public types and [`run`]; `workload.rs` decodes a workload from the
//! fuzzer's bytes; `replicas.rs` the fleet and its router; `engine/` is the simulation (`mod.rs` the state and the step,
//! `rows.rs` admission, rows and the planner's view, `actions.rs` the plan's actions,
//! `checks.rs` reservations, token progress and the invariants, `tokens.rs` token ids and the
//! cell contents).

mod engine;
mod replicas;
mod workload;

pub use replicas::{run_fleet, Conversations, Fleet, FleetReport, Routing, StepCost};

use std::fmt;

use kvpark_core::PlannerConfig;

/// The engine's settings for a simulation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    pub n_cells: usize,
    pub page_size: usize,
    /// Slots; a request takes `n` of them from admission to its end, parked or not.
    pub parallel: usize,
    /// Rows per step (prompt chunks included); at least `parallel`.
    pub max_batch_tokens: usize,
    /// Bytes of a swapped state per computed cell.
    pub bytes_per_cell: u64,
    /// The clock advances this much per step.
    pub ms_per_step: u64,
    pub planner: PlannerConfig,
    /// The pool's prefix cache: admissions and resumes take what is cached, every step
    /// registers the tokens it computed.
    pub prefix_cache: bool,
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    pub prompt_len: usize,
    /// Tokens each sequence generates (at least 1).
    pub output_len: usize,
    /// The step it arrives at.
    pub arrival_step: u64,
    /// Sequences after the prompt (`n > 1`: a family sharing the prompt's pages).
    pub n: usize,
    /// The prompt's first `prefix_len` tokens are those of shared stream `prefix_id` (0: a
    /// prompt of its own). A prompt that is all shared stream decodes the stream's next tokens,
    /// so a later request with a longer prefix of it hits the pages this one decoded.
    pub prefix_id: u32,
    pub prefix_len: usize,
}

/// A configuration and its requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub config: SimConfig,
    pub requests: Vec<SimRequest>,
}

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Finished,
    /// The context error: it cannot fit (or a family overflowed).
    ContextError,
    /// Its prompt is longer than the pool, or it wants more sequences than there are slots:
    /// refused before admission.
    Refused,
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Per request, in workload order.
    pub outcomes: Vec<Option<Outcome>>,
    pub steps: u64,
    pub swaps: u64,
    pub recomputes: u64,
    pub resumes: u64,
    pub rotations: u64,
    pub releases: u64,
    pub fails: u64,
    /// Parks after a failed reservation (by `choose_victims`).
    pub late_parks: u64,
    /// Longest run of steps one request was the parked head.
    pub max_head_wait: u64,
    /// Longest run of steps without a token generated or a request ended.
    pub max_stall: u64,
    /// Tokens taken from cached pages (admissions and resumes).
    pub hit_tokens: u64,
}

/// A broken invariant, at a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub step: u64,
    pub what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {}: {}", self.step, self.what)
    }
}

impl std::error::Error for Violation {}

/// Runs `workload` to the end; the report, or the first violation.
pub fn run(workload: &Workload) -> Result<Report, Violation> {
    engine::Sim::new(workload)?.run()
}

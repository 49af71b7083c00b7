//! A deterministic workload simulator for the planner and the pool (cargo feature `sim`; the
//! crate's own tests always have it). It plays the engine's part with no model: requests
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
//! error for a request that fits the pool alone (families excepted: they are never parked, so
//! two of them can overflow), progress (some token generated or request ended) within a bound,
//! a parked head resuming within a bound, and every request ending.
//!
//! Engine behaviour modelled (the Python side's, as the planner expects it):
//! - admission is FIFO and head of line, only while nothing is parked, only if the first chunk
//!   plus a page per decoding sequence is free; a prompt longer than the pool, or a request
//!   wanting more sequences than there are slots, is refused;
//! - rows: decodes first, then prompt and replay chunks oldest first, within the row budget;
//!   a request resumed by the plan runs in the same step with the rows left over;
//! - swap park keeps the computed count; recompute park drops it and replays prompt plus
//!   generated tokens; `resume_cells` is the restored cells plus the next rows (swap) or all the
//!   tokens to replay (recompute);
//! - a reservation that fails anyway (the lookahead off, or families only) parks by
//!   [`choose_victims`], else fails the request with the context error.

use std::fmt;

use crate::page_table::pages_for;
use crate::planner::{
    choose_victims, plan, Action, ParkMode, PlannerConfig, Policy, RamView, RequestState,
    RequestView,
};
use crate::pool::KvPool;
use crate::SeqId;

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
    Sim::new(workload)?.run()
}

impl Workload {
    /// A small workload decoded from arbitrary bytes (for the fuzzer): every byte string gives
    /// a valid one; missing bytes read as 0.
    pub fn from_bytes(data: &[u8]) -> Self {
        let mut bytes = data.iter().copied();
        let mut next = move || usize::from(bytes.next().unwrap_or(0));
        let page_size = [1, 2, 4, 8, 16][next() % 5];
        let n_pages = 2 + next() % 40;
        let parallel = 1 + next() % 6;
        let max_batch_tokens = parallel + next() % 64;
        let flags = next();
        let bytes_per_cell = 1 + (next() as u64) * 97;
        let budget = match (flags >> 2) % 4 {
            0 => None,
            1 => Some(0),
            2 => Some((1 + next() as u64 % 8) * 64 * 1024),
            _ => Some(next() as u64 * 4096),
        };
        let ms_per_step = 10 + (next() as u64 % 20) * 10;
        let n_requests = 1 + next() % 10;
        let mut arrival_step = 0;
        let requests = (0..n_requests)
            .map(|_| {
                arrival_step += (next() % 8) as u64;
                let n_byte = next();
                SimRequest {
                    prompt_len: 1 + next() % (n_pages * page_size + 8),
                    output_len: 1 + next() % 48,
                    arrival_step,
                    n: if n_byte % 8 == 7 {
                        2 + (n_byte >> 3) % 2
                    } else {
                        1
                    },
                }
            })
            .collect();
        Workload {
            config: SimConfig {
                n_cells: n_pages * page_size,
                page_size,
                parallel,
                max_batch_tokens,
                bytes_per_cell,
                ms_per_step,
                planner: PlannerConfig {
                    policy: if flags & 1 == 0 {
                        Policy::Fcfs
                    } else {
                        Policy::Cost
                    },
                    park_ahead: flags & 2 == 0,
                    ram_budget: budget,
                    ..PlannerConfig::default()
                },
            },
            requests,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
    Parked(ParkMode),
    Done(Outcome),
}

#[derive(Debug, Clone)]
struct Seq {
    id: SeqId,
    /// Prompt plus generated tokens.
    known: usize,
    /// Tokens whose cells are in the pool (`known - 1` between decode steps).
    computed: usize,
    generated: usize,
    /// Rows this step.
    rows: usize,
}

#[derive(Debug, Clone)]
struct Req {
    spec: SimRequest,
    id: u64,
    arrival: u64,
    phase: Phase,
    seqs: Vec<Seq>,
    slots: Vec<u32>,
    parks: u32,
    parked_at_ms: Option<u64>,
    resumed_at_ms: Option<u64>,
    tokens_since_resume: u32,
}

impl Req {
    fn family(&self) -> bool {
        self.spec.n > 1
    }

    /// Cells it holds at its largest: prompt plus output but the last token (never computed).
    /// A family's children share the prompt's full pages, each with its own tail.
    fn peak_cells(&self, page_size: usize) -> usize {
        let last = self.spec.prompt_len + self.spec.output_len - 1;
        let shared = self.spec.prompt_len / page_size;
        pages_for(last, page_size) * page_size * self.spec.n
            - shared * page_size * (self.spec.n - 1)
    }

    fn seq_ids(&self) -> Vec<SeqId> {
        self.seqs.iter().map(|s| s.id).collect()
    }

    fn computed_cells(&self) -> usize {
        self.seqs.iter().map(|s| s.computed).sum()
    }
}

struct Sim {
    cfg: SimConfig,
    pool: KvPool,
    reqs: Vec<Req>,
    /// Per slot: the request (index) holding it.
    slot_owner: Vec<Option<usize>>,
    /// Per slot: park buffer capacity.
    buffers: Vec<u64>,
    next_seq: SeqId,
    step: u64,
    report: Report,
    head: Option<(usize, u64)>,
    stall: u64,
    /// Tokens sampled so far (a family's step counts once).
    tokens: u64,
    /// `tokens` + ended requests at the last check.
    last_progress: u64,
    head_bound: u64,
    stall_bound: u64,
}

fn violation<T>(step: u64, what: String) -> Result<T, Violation> {
    Err(Violation { step, what })
}

impl Sim {
    fn new(w: &Workload) -> Result<Self, Violation> {
        let cfg = w.config.clone();
        let Ok(pool) = KvPool::new(cfg.n_cells, cfg.page_size) else {
            return violation(
                0,
                format!("bad geometry {} / {}", cfg.n_cells, cfg.page_size),
            );
        };
        let mut order: Vec<usize> = (0..w.requests.len()).collect();
        order.sort_by_key(|&i| (w.requests[i].arrival_step, i));
        let mut reqs: Vec<Req> = w
            .requests
            .iter()
            .map(|spec| Req {
                spec: spec.clone(),
                id: 0,
                arrival: 0,
                phase: Phase::Waiting,
                seqs: Vec::new(),
                slots: Vec::new(),
                parks: 0,
                parked_at_ms: None,
                resumed_at_ms: None,
                tokens_since_resume: 0,
            })
            .collect();
        for (rank, &i) in order.iter().enumerate() {
            reqs[i].arrival = rank as u64;
            // Ids run against arrival order, so a tie-break on the id cannot pass for one on
            // the arrival.
            reqs[i].id = 1_000_000 - rank as u64;
        }
        let ms = cfg.ms_per_step.max(1);
        let p = &cfg.planner;
        let longest = w
            .requests
            .iter()
            .map(|r| r.prompt_len + r.output_len * r.n)
            .max()
            .unwrap_or(0) as u64;
        let total: u64 = w
            .requests
            .iter()
            .map(|r| (r.prompt_len + r.output_len * r.n) as u64)
            .sum();
        let head_bound = p.rotate_after_ms.div_ceil(ms)
            + p.rotate_min_ms.div_ceil(ms)
            + u64::from(p.rotate_min_tokens)
            + 2 * longest
            + 16;
        Ok(Self {
            slot_owner: vec![None; cfg.parallel],
            buffers: vec![0; cfg.parallel],
            pool,
            reqs,
            next_seq: 1,
            step: 0,
            report: Report::default(),
            head: None,
            stall: 0,
            tokens: 0,
            last_progress: 0,
            head_bound,
            stall_bound: head_bound + total + 16,
            cfg,
        })
    }

    fn fail<T>(&self, what: String) -> Result<T, Violation> {
        violation(self.step, what)
    }

    fn now_ms(&self) -> u64 {
        self.step * self.cfg.ms_per_step
    }

    fn run(mut self) -> Result<Report, Violation> {
        loop {
            if self.reqs.iter().all(|r| matches!(r.phase, Phase::Done(_))) {
                self.report.steps = self.step;
                self.report.outcomes = self
                    .reqs
                    .iter()
                    .map(|r| match r.phase {
                        Phase::Done(o) => Some(o),
                        _ => None,
                    })
                    .collect();
                return Ok(self.report);
            }
            self.one_step()?;
            self.step += 1;
        }
    }

    fn one_step(&mut self) -> Result<(), Violation> {
        self.admit();
        self.schedule_running();
        let views = self.views();
        let ram = RamView {
            slot_buffer_capacity: self.buffers.clone(),
        };
        let actions = match plan(&self.pool, &views, &ram, &self.cfg.planner, self.now_ms()) {
            Ok(a) => a,
            Err(e) => return self.fail(format!("plan failed: {e}")),
        };
        let mut resumed = Vec::new();
        for action in actions {
            self.apply(action, &mut resumed)?;
        }
        self.check_ram()?;
        self.schedule_resumed(&resumed);
        self.check_fits()?;
        self.reserve_rows()?;
        self.advance()?;
        if let Err(e) = self.pool.check_integrity() {
            return self.fail(e.to_string());
        }
        self.check_progress()
    }

    // ------------------------------------------------------------------ admission and rows

    fn admit(&mut self) {
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
            let rows = spec.prompt_len.min(self.cfg.max_batch_tokens);
            let fits = self.pool.can_fit((pages_for(rows, ps) + decoding) * ps);
            if parked || free_slots < spec.n || !fits {
                return; // head of line: nobody passes it
            }
            let n = spec.n;
            for _ in 0..n {
                let slot = self.slot_owner.iter().position(|s| s.is_none()).unwrap();
                self.slot_owner[slot] = Some(i);
                self.reqs[i].slots.push(slot as u32);
            }
            let seq = self.new_seq();
            self.pool.add_sequence(seq).unwrap();
            let req = &mut self.reqs[i];
            req.seqs.push(Seq {
                id: seq,
                known: req.spec.prompt_len,
                computed: 0,
                generated: 0,
                rows: 0,
            });
            req.phase = Phase::Running;
        }
    }

    fn new_seq(&mut self) -> SeqId {
        self.next_seq += 1;
        self.next_seq
    }

    /// Running requests in arrival order.
    fn running(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.reqs.len())
            .filter(|&i| self.reqs[i].phase == Phase::Running)
            .collect();
        order.sort_by_key(|&i| self.reqs[i].arrival);
        order
    }

    /// Tentative rows of the running requests: decodes first, then chunks oldest first.
    fn schedule_running(&mut self) {
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
    fn schedule_resumed(&mut self, resumed: &[usize]) {
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

    fn views(&self) -> Vec<RequestView> {
        let mut views = Vec::new();
        // Reversed, so that the planner cannot lean on the order it is given.
        for r in self.reqs.iter().rev() {
            let state = match r.phase {
                Phase::Running => RequestState::Running,
                Phase::Parked(mode) => RequestState::Parked(mode),
                Phase::Waiting | Phase::Done(_) => continue,
            };
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

    fn index_of(&self, id: u64) -> Result<usize, Violation> {
        match self.reqs.iter().position(|r| r.id == id) {
            Some(i) => Ok(i),
            None => self.fail(format!("action names unknown request {id}")),
        }
    }

    // ------------------------------------------------------------------ actions

    fn apply(&mut self, action: Action, resumed: &mut Vec<usize>) -> Result<(), Violation> {
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
                if capacity < bytes || capacity % crate::planner::BUFFER_ALIGN != 0 {
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
            if mode == ParkMode::Swap {
                if let Err(e) = self.pool.reserve(s.id, s.computed) {
                    return self.fail(format!(
                        "restore of request {} failed: {e}",
                        self.reqs[i].id
                    ));
                }
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
    fn end(&mut self, i: usize, outcome: Outcome) {
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
    }

    // ------------------------------------------------------------------ checks

    fn check_ram(&self) -> Result<(), Violation> {
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
    fn check_fits(&self) -> Result<(), Violation> {
        if !self.cfg.planner.park_ahead || self.step_shortfall() == 0 {
            return Ok(());
        }
        let running = self.running();
        let parkable = running.iter().any(|&i| {
            let r = &self.reqs[i];
            !r.family() && (r.computed_cells() > 0 || r.seqs.iter().any(|s| s.rows > 0))
        });
        if running.len() >= 2 && parkable {
            return self.fail(format!(
                "the plan left the step {} cells short with a victim available",
                self.step_shortfall()
            ));
        }
        Ok(())
    }

    /// Reserves every scheduled row. A reservation that fails parks by `choose_victims`, else
    /// fails the request with the context error.
    fn reserve_rows(&mut self) -> Result<(), Violation> {
        loop {
            let order = self.running();
            let mut failed = None;
            for &i in &order {
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
                return Ok(());
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
                let r = &self.reqs[i];
                if !r.family() && r.peak_cells(self.cfg.page_size) <= self.cfg.n_cells {
                    let running = order.len();
                    let families = order.iter().filter(|&&j| self.reqs[j].family()).count();
                    if running - families > 1 {
                        return self.fail(format!(
                            "context error for request {}, which fits alone, beside {} others",
                            r.id,
                            running - 1
                        ));
                    }
                }
                self.report.fails += 1;
                self.end(i, Outcome::ContextError);
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

    /// Computes the rows, samples where a sequence caught up, forks families after the prompt,
    /// ends finished requests.
    fn advance(&mut self) -> Result<(), Violation> {
        for i in self.running() {
            let mut sampled = false;
            for s in &mut self.reqs[i].seqs {
                s.computed += s.rows;
                if s.rows > 0 && s.computed == s.known {
                    s.known += 1;
                    s.generated += 1;
                    sampled = true;
                }
                s.rows = 0;
            }
            if !sampled {
                continue;
            }
            self.tokens += 1;
            let r = &mut self.reqs[i];
            r.tokens_since_resume = r.tokens_since_resume.saturating_add(1);
            if r.family() && r.seqs.len() == 1 {
                let parent = r.seqs[0].clone();
                for _ in 1..r.spec.n {
                    let child = self.new_seq();
                    if self.pool.fork(parent.id, child).is_err() {
                        // No page for the copy of the partly used tail: a family overflows.
                        self.report.fails += 1;
                        self.end(i, Outcome::ContextError);
                        break;
                    }
                    self.reqs[i].seqs.push(Seq {
                        id: child,
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

    /// Progress within `stall_bound` steps; the parked head resumes within `head_bound`.
    fn check_progress(&mut self) -> Result<(), Violation> {
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

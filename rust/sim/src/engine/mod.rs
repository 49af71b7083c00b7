//! The simulation's state, its setup and its step loop; the steps' parts are in `rows.rs`,
//! `actions.rs` and `checks.rs`; `live.rs` drives it a step at a time from outside (the
//! replicas of `replicas.rs`).

mod actions;
mod checks;
mod live;
mod rows;
mod tokens;

pub(crate) use live::{Event, Work};

use kvpark_core::{plan, KvPool, ParkMode, RamView, SeqId};

use crate::{Outcome, Report, SimConfig, SimRequest, Violation, Workload};

/// Pages needed to hold `n_cells` cells: `ceil(n_cells / page_size)`, as the pool counts them.
fn pages_for(n_cells: usize, page_size: usize) -> usize {
    n_cells.div_ceil(page_size)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
    Parked(ParkMode),
    Done(Outcome),
}

#[derive(Debug, Clone, Default)]
struct Seq {
    id: SeqId,
    /// Prompt plus generated tokens (`tokens.len()`).
    known: usize,
    /// Tokens whose cells are in the pool (`known - 1` between decode steps).
    computed: usize,
    generated: usize,
    /// Rows this step.
    rows: usize,
    /// Its token ids and each position's content (`tokens.rs`).
    tokens: Vec<u32>,
    content: Vec<u64>,
    /// Which pick it makes after each token: 0 greedy (a family's first sequence), else its
    /// index in the family.
    branch: u64,
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
    /// Prompt tokens its admission took from cached pages.
    admit_hit: usize,
}

impl Req {
    /// A request that has not arrived yet; `arrival` (its rank in arrival order) and `id` are
    /// set by whoever adds it.
    fn waiting(spec: SimRequest) -> Self {
        Req {
            spec,
            id: 0,
            arrival: 0,
            phase: Phase::Waiting,
            seqs: Vec::new(),
            slots: Vec::new(),
            parks: 0,
            parked_at_ms: None,
            resumed_at_ms: None,
            tokens_since_resume: 0,
            admit_hit: 0,
        }
    }

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

pub(crate) struct Sim {
    cfg: SimConfig,
    pool: KvPool,
    /// What every cell holds: each running sequence must read back its own.
    cells: tokens::Cells,
    /// Hits by `match_prefix` that differed from what `cached_prefix` promised.
    wrong_hits: u64,
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
    /// The clock when the caller sets it (`live.rs`); else `step * ms_per_step`.
    clock_ms: Option<u64>,
    /// What the steps did, for a caller that drives them (`live.rs`).
    events: Vec<Event>,
    work: Work,
}

/// The oracle's bounds for `requests`: steps the parked head may wait, and steps without
/// progress.
fn bounds(cfg: &SimConfig, requests: &[SimRequest]) -> (u64, u64) {
    let ms = cfg.ms_per_step.max(1);
    let p = &cfg.planner;
    let cells = |r: &SimRequest| (r.prompt_len + r.output_len * r.n) as u64;
    let longest = requests.iter().map(cells).max().unwrap_or(0);
    let total: u64 = requests.iter().map(cells).sum();
    let head_bound = p.rotate_after_ms.div_ceil(ms)
        + p.rotate_min_ms.div_ceil(ms)
        + u64::from(p.rotate_min_tokens)
        + 2 * longest
        + 16;
    (head_bound, head_bound + total + 16)
}

fn violation<T>(step: u64, what: String) -> Result<T, Violation> {
    Err(Violation { step, what })
}

impl Sim {
    pub(crate) fn new(w: &Workload) -> Result<Self, Violation> {
        let cfg = w.config.clone();
        let pool = if cfg.prefix_cache {
            KvPool::with_prefix_cache(cfg.n_cells, cfg.page_size, 0x5EED)
        } else {
            KvPool::new(cfg.n_cells, cfg.page_size)
        };
        let Ok(pool) = pool else {
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
            .map(|spec| Req::waiting(spec.clone()))
            .collect();
        for (rank, &i) in order.iter().enumerate() {
            reqs[i].arrival = rank as u64;
            // Ids run against arrival order, so a tie-break on the id cannot pass for one on
            // the arrival.
            reqs[i].id = 1_000_000 - rank as u64;
        }
        let (head_bound, stall_bound) = bounds(&cfg, &w.requests);
        Ok(Self {
            slot_owner: vec![None; cfg.parallel],
            buffers: vec![0; cfg.parallel],
            cells: tokens::Cells(vec![0; cfg.n_cells]),
            wrong_hits: 0,
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
            stall_bound,
            clock_ms: None,
            events: Vec::new(),
            work: Work::default(),
            cfg,
        })
    }

    fn fail<T>(&self, what: String) -> Result<T, Violation> {
        violation(self.step, what)
    }

    fn now_ms(&self) -> u64 {
        self.clock_ms.unwrap_or(self.step * self.cfg.ms_per_step)
    }

    pub(crate) fn run(mut self) -> Result<Report, Violation> {
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
        self.check_contents()?;
        self.check_progress()
    }
}

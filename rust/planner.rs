//! The preemption planner: pure and deterministic. Given a snapshot of the requests,
//! the pool (read only through its occupancy queries), the `--preempt-ram` budget with the park
//! buffers held per slot, the policy and the clock, it returns the actions for this step: give
//! idle park buffers back, park victims (swap or recompute), resume parked requests, rotate a
//! resident out for an aged head, fail what can never fit. It runs once per step, before the
//! batch is built, when every request is at a token boundary; it mutates nothing.
//!
//! Everything is counted in cells of whole pages: `used` is [`KvPool::cells_used`], a request's
//! next step adds `pool.pages_needed(seq, n)` pages per sequence (a step that crosses a page
//! boundary costs a whole page), and what parking a set of requests frees is
//! [`KvPool::cells_freed_by`] of all their sequences together, so a page two victims share is
//! freed once both are out and a page shared with a resident is never counted as freed.
//!
//! Cached pages (the prefix cache) are not in `used`: the pool evicts them when the free list
//! is empty, so they are room, and the planner parks nobody while evicting them would do. A
//! request sharing pages it took from the cache is no `family` and may be parked; parking it
//! frees only its pages nobody else holds. A parked request's `resume_cells` stay the full
//! count (a cached hit page costs room as a fresh one; see docs/preemption.md, "Prefix cache").
//!
//! # Policy
//!
//! | rule | `fcfs` (default) | `cost` |
//! |---|---|---|
//! | when to park | `used + step + margin > pool` (margin: `margin_cells` rounded up to a page); park until it fits | same |
//! | who may be a victim | a `Running` request that is not in an `n > 1` family, not `refused`, frees at least one cell (held or needed by its step), and is not the only running request (`Running` + `Restoring` >= 2 at each pick) | same |
//! | which victim | the newest (highest `arrival`, then highest `id`) | the single one whose gain covers the shortfall with the fewest cells, else the smallest; repeat. Gain = cells it frees + cells its step would add. Ties: newest |
//! | starvation guard | a request with `parks >= starved_parks` (3) is passed over while another candidate exists | same |
//! | swap or recompute | swap if the state fits `ram_budget` after giving back idle park buffers (slots not holding a swapped state, never the victim's own; largest first, ties lowest slot); else recompute. `None`: no limit; `Some(0)` or a 0-byte state: recompute | same |
//! | buffer size (swap) | kept if it holds the state; else grown to `round64K(max(need, 1.5 cap))` if `held - cap + 2 new <= budget`, else `round64K(need)` | same |
//! | resume order | oldest `arrival` first (then `id`) | earliest `parked_at_ms` first (then `arrival`, `id`) |
//! | admission | head of line: only the head is tried and nobody passes it. `used + step + resumed + head + margin <= pool`; the margin is waived when nothing else is resident. Resume as many as fit, in order. None in a step that parked for pressure | same |
//! | rotation | once per step, when the head does not fit, has waited `>= rotate_after_ms` (2 s), and no park copy is in flight: park the resident (`Running`, not family, not refused, not protected) that makes room with the fewest freed cells; if none does alone, the largest first and repeat. Protected: resumed and fewer than 32 tokens decoded since, unless 1 token and 2 s. Swap or recompute by the plain budget check (the head's state still counts: both are held at once). A lone resident may be rotated | same |
//! | fail | a `Running` request whose cells after its step exceed the whole pool, a parked one whose `resume_cells` do: the context error | same |
//!
//! Without the lookahead (`park_ahead: false`, `KVPARK_PREEMPT_PLANNER=off`) [`plan`] parks
//! nothing for pressure, and [`choose_victims`] picks victims by the same rules when a step has
//! actually failed to allocate.
//!
//! Every choice has an explicit total order, so the output depends only on the set of requests,
//! never on the order of the slice. The async states `Parking` and `Restoring` are in flight:
//! neither victims nor resumable, their cells counted as the pool reports them (a `Restoring`
//! request's step is charged like a running one's), and a `Parking` one holds off rotation.

mod budget;
mod ledger;
mod resume;
mod victim;

pub use budget::{round_up_buffer, BUFFER_ALIGN};

use std::collections::BTreeSet;

use crate::error::{KvError, KvResult};
use crate::ids::SeqId;
use crate::pool::KvPool;

use budget::Ram;
use ledger::Ledger;

/// Which request is parked for pressure, and in which order parked ones resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Policy {
    /// Park the newest running request, resume the oldest parked first (vLLM's order).
    #[default]
    Fcfs,
    /// Park the single request that covers the shortfall with the fewest cells, else the
    /// smallest; resume in park-time order.
    Cost,
}

/// How a park keeps a request's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkMode {
    /// Its cells are copied to a host park buffer and restored on resume.
    Swap,
    /// Its cells are dropped; its tokens are replayed as prompt rows on resume.
    Recompute,
}

/// Where a request stands, as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestState {
    /// Resident (it may hold no cell yet) and taking part in the next step.
    Running,
    /// Holds no cell; its state is in its slot's park buffer (swap) or its tokens (recompute).
    Parked(ParkMode),
    /// In flight: a swap copy out is running; its cells are still held. Not a victim, not
    /// resumable; no rotation while one is in flight.
    Parking,
    /// In flight: a copy back is running into cells already held. Not a victim, not resumable;
    /// its next step is charged like a running request's.
    Restoring,
}

/// One request in the snapshot the planner reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestView {
    /// The engine's request key; also the last tie-breaker. Unique in a snapshot.
    pub id: u64,
    /// Arrival order: lower is older.
    pub arrival: u64,
    pub state: RequestState,
    /// Its sequences in the pool (empty while parked: a parked request's are not read).
    pub seq_ids: Vec<SeqId>,
    /// Running or Restoring: per sequence, the cells it would hold after the next step. The
    /// planner charges `pool.pages_needed(seq, cells)` pages for each.
    pub next_cells: Vec<(SeqId, usize)>,
    /// Parked: the cells it needs to come back and run one step (restored or replayed tokens
    /// plus the next rows), charged as whole pages of a fresh sequence.
    pub resume_cells: usize,
    /// Bytes a swap park of it would hold now (or holds, if parked by swap).
    pub state_bytes: u64,
    /// Parks so far (the starvation guard reads it).
    pub parks: u32,
    /// When it was parked (parked requests); `None` reads as "now".
    pub parked_at_ms: Option<u64>,
    /// When it last resumed; `None`: never parked, never protected from rotation.
    pub resumed_at_ms: Option<u64>,
    /// Tokens decoded since it last resumed.
    pub tokens_since_resume: u32,
    /// A member of an `n > 1` family sharing pages: never a victim.
    pub family: bool,
    /// Its prompt will be refused: never a victim (it gets its own error).
    pub refused: bool,
    /// Its slot; park buffers are kept per slot. Unique in a snapshot.
    pub slot: u32,
}

impl RequestView {
    /// A request with no sequence, no cells and no history; set the other fields with struct
    /// update syntax: `RequestView { seq_ids: vec![7], ..RequestView::new(1, 1, state) }`.
    pub fn new(id: u64, arrival: u64, state: RequestState) -> Self {
        Self {
            id,
            arrival,
            state,
            seq_ids: Vec::new(),
            next_cells: Vec::new(),
            resume_cells: 0,
            state_bytes: 0,
            parks: 0,
            parked_at_ms: None,
            resumed_at_ms: None,
            tokens_since_resume: 0,
            family: false,
            refused: false,
            slot: 0,
        }
    }
}

/// The planner's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannerConfig {
    pub policy: Policy,
    /// Headroom kept free after a step, rounded up to whole pages (default 8 cells).
    pub margin_cells: usize,
    /// `--preempt-ram` in bytes: `None` no limit, `Some(0)` every park recomputes.
    pub ram_budget: Option<u64>,
    /// A parked head waiting this long that does not fit triggers a rotation (2000).
    pub rotate_after_ms: u64,
    /// A resumed request is protected from rotation until it has decoded this many tokens
    /// (32) ...
    pub rotate_min_tokens: u32,
    /// ... or one token and this long since it resumed (2000).
    pub rotate_min_ms: u64,
    /// Parks after which a request is passed over while another candidate exists (3).
    pub starved_parks: u32,
    /// Park ahead of the step for pressure (true); false is `KVPARK_PREEMPT_PLANNER=off`:
    /// `plan` only fails, resumes and rotates, and [`choose_victims`] parks after a failed
    /// allocation.
    pub park_ahead: bool,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Fcfs,
            margin_cells: 8,
            ram_budget: None,
            rotate_after_ms: 2000,
            rotate_min_tokens: 32,
            rotate_min_ms: 2000,
            starved_parks: 3,
            park_ahead: true,
        }
    }
}

/// The host RAM side of the snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RamView {
    /// Per slot, the capacity of the park buffer it keeps (0: none). A buffer is idle when its
    /// slot holds no swapped state. A slot past the end holds none. Their sum is what is held
    /// against the budget.
    pub slot_buffer_capacity: Vec<u64>,
}

/// One thing to do, in list order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Give this idle park buffer back, so that the next swap park fits the budget.
    ReleaseBuffer { slot: u32 },
    /// Park request `id`. Swap: into its slot's buffer, (re)sized to `buffer_capacity`;
    /// recompute: `buffer_capacity` is 0. `head`: a rotation park making room for that parked
    /// request, which a later `Rotate` in the same list resumes.
    Park {
        id: u64,
        mode: ParkMode,
        buffer_capacity: u64,
        head: Option<u64>,
    },
    /// Put parked request `id` back (restore or replay).
    Resume { id: u64 },
    /// Park `victim` (as `Park` would), then resume `head`.
    Rotate {
        victim: u64,
        mode: ParkMode,
        buffer_capacity: u64,
        head: u64,
    },
    /// Request `id` cannot fit even an empty pool: fail it with the context error.
    Fail { id: u64 },
}

/// Plans this step: see the module documentation for the rules. Fails only on a bad snapshot:
/// [`KvError::UnknownSequence`] for a sequence the pool does not have, or a duplicate request
/// id or slot.
///
/// ```
/// use kvpark_core::planner::{plan, Action, ParkMode, PlannerConfig, RamView, RequestState, RequestView};
/// use kvpark_core::KvPool;
///
/// let mut pool = KvPool::new(64, 16).unwrap(); // 4 pages
/// for seq in [1, 2] {
///     pool.add_sequence(seq).unwrap();
///     pool.reserve(seq, 16).unwrap(); // a full page each
/// }
/// let running = |id: u64| RequestView {
///     seq_ids: vec![id],
///     next_cells: vec![(id, 17)], // the next step crosses a page boundary
///     slot: id as u32,
///     ..RequestView::new(id, id, RequestState::Running)
/// };
/// // 32 used + 32 for the step + a 16-cell margin > 64: park the newest, by recompute
/// // (budget 0).
/// let cfg = PlannerConfig { ram_budget: Some(0), ..PlannerConfig::default() };
/// let actions = plan(&pool, &[running(1), running(2)], &RamView::default(), &cfg, 0).unwrap();
/// assert_eq!(
///     actions,
///     [Action::Park { id: 2, mode: ParkMode::Recompute, buffer_capacity: 0, head: None }]
/// );
/// ```
pub fn plan(
    pool: &KvPool,
    requests: &[RequestView],
    ram: &RamView,
    cfg: &PlannerConfig,
    now_ms: u64,
) -> KvResult<Vec<Action>> {
    let mut planner = Planner::new(pool, requests, ram, cfg)?;
    planner.fail_never_fits()?;
    let mut parked_for_pressure = 0;
    if cfg.park_ahead {
        parked_for_pressure = planner.park_for_pressure(|ledger| ledger.shortfall(0))?;
    }
    if parked_for_pressure == 0 {
        planner.resume(now_ms)?;
    }
    Ok(planner.out)
}

/// Victims for a step that has failed to allocate `shortfall_cells` cells (the lookahead is
/// off): parks by the same rules as [`plan`] (eligibility, policy, starvation guard, swap or
/// recompute) until the victims' gain covers the shortfall or nobody is left. A victim's gain
/// counts the cells its `next_cells` would add, so pass those for the failed step's rows (or
/// leave them empty). Emits only `ReleaseBuffer` and `Park`.
pub fn choose_victims(
    pool: &KvPool,
    requests: &[RequestView],
    ram: &RamView,
    cfg: &PlannerConfig,
    shortfall_cells: usize,
) -> KvResult<Vec<Action>> {
    let mut planner = Planner::new(pool, requests, ram, cfg)?;
    planner.park_for_pressure(|ledger| shortfall_cells.saturating_sub(ledger.gained()))?;
    Ok(planner.out)
}

/// One planning pass: the snapshot sorted by id, the cell ledger, the RAM model and the
/// actions so far. The rules live in `victim.rs` (pressure parks), `resume.rs` (resume and
/// rotation) and `budget.rs` (swap or recompute).
struct Planner<'a> {
    cfg: &'a PlannerConfig,
    /// The snapshot, ascending by id.
    requests: Vec<&'a RequestView>,
    /// Per request: cells its next step adds (Running and Restoring), in whole pages.
    step_cells: Vec<usize>,
    /// Per request: failed or parked by this plan.
    gone: Vec<bool>,
    ledger: Ledger<'a>,
    ram: Ram,
    out: Vec<Action>,
}

impl<'a> Planner<'a> {
    fn new(
        pool: &'a KvPool,
        requests: &'a [RequestView],
        ram: &RamView,
        cfg: &'a PlannerConfig,
    ) -> KvResult<Self> {
        let mut sorted: Vec<&RequestView> = requests.iter().collect();
        sorted.sort_unstable_by_key(|r| r.id);
        if let Some(pair) = sorted.windows(2).find(|w| w[0].id == w[1].id) {
            return Err(KvError::DuplicateRequest(pair[0].id));
        }
        let mut slots = BTreeSet::new();
        if let Some(r) = sorted.iter().find(|r| !slots.insert(r.slot)) {
            return Err(KvError::DuplicateSlot(r.slot));
        }
        let page_size = pool.page_size();
        let mut step_cells = Vec::with_capacity(sorted.len());
        let mut running = 0;
        let mut step = 0;
        for r in &sorted {
            let mut cells = 0;
            if matches!(r.state, RequestState::Running | RequestState::Restoring) {
                running += 1;
                for &(seq, n) in &r.next_cells {
                    cells += pool.pages_needed(seq, n)? * page_size;
                }
            }
            if let Some(&seq) = r.seq_ids.iter().find(|&&s| !pool.has_sequence(s)) {
                if !matches!(r.state, RequestState::Parked(_)) {
                    return Err(KvError::UnknownSequence(seq));
                }
            }
            step += cells;
            step_cells.push(cells);
        }
        let ledger = Ledger::new(pool, cfg.margin_cells, step, running);
        Ok(Self {
            cfg,
            gone: vec![false; sorted.len()],
            ram: Ram::new(ram, cfg.ram_budget, &sorted),
            requests: sorted,
            step_cells,
            ledger,
            out: Vec::new(),
        })
    }

    /// `Fail` for every running request whose cells after its step exceed the whole pool and
    /// every parked one whose resume does; ascending by id. Their cells leave the ledger.
    fn fail_never_fits(&mut self) -> KvResult<()> {
        let n_cells = self.ledger.n_cells();
        for i in 0..self.requests.len() {
            let r = self.requests[i];
            let never_fits = match r.state {
                RequestState::Running => {
                    self.ledger.alone_cells(&r.seq_ids)? + self.step_cells[i] > n_cells
                }
                RequestState::Parked(_) => self.ledger.pages_of(r.resume_cells) > n_cells,
                RequestState::Parking | RequestState::Restoring => false,
            };
            if never_fits {
                if r.state == RequestState::Running {
                    self.ledger.leave(&r.seq_ids, self.step_cells[i])?;
                }
                self.gone[i] = true;
                self.out.push(Action::Fail { id: r.id });
            }
        }
        Ok(())
    }

    /// Parks request `i`: swap or recompute by the budget (emitting any `ReleaseBuffer` first),
    /// its cells and step leave the ledger. Returns the mode and buffer capacity.
    fn park(&mut self, i: usize) -> KvResult<(ParkMode, u64)> {
        let r = self.requests[i];
        let (mode, capacity) = self.ram.choose(r, &mut self.out);
        self.ledger.leave(&r.seq_ids, self.step_cells[i])?;
        self.gone[i] = true;
        Ok((mode, capacity))
    }
}

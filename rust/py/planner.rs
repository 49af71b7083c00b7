//! The planner's Python classes: `RequestView` (a request in the snapshot), `Action` (what
//! the plan says to do), `Planner` (the configuration, with `plan` and `choose_victims`) and
//! `round_up_buffer`, plus the parsing of park modes and RAM budgets they share.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::pool::PyKvPool;
use crate::planner::{self, Action, ParkMode, PlannerConfig, Policy, RamView, RequestState};
use crate::{RequestView, SeqId};

fn park_mode_name(mode: ParkMode) -> &'static str {
    match mode {
        ParkMode::Swap => "swap",
        ParkMode::Recompute => "recompute",
    }
}

fn parse_park_mode(mode: &str) -> PyResult<ParkMode> {
    match mode {
        "swap" => Ok(ParkMode::Swap),
        "recompute" => Ok(ParkMode::Recompute),
        _ => Err(PyValueError::new_err(format!(
            "park mode '{mode}' is not one of 'swap', 'recompute'"
        ))),
    }
}

/// -1 (no limit) or a byte count >= 0.
fn parse_budget(bytes: i64) -> PyResult<Option<u64>> {
    match bytes {
        -1 => Ok(None),
        b if b >= 0 => Ok(Some(b as u64)),
        b => Err(PyValueError::new_err(format!(
            "ram budget {b} is neither -1 (no limit) nor a byte count >= 0"
        ))),
    }
}

/// One request in the planner's snapshot (keyword arguments only; read-only fields).
///
/// state: "running" | "parked" | "parking" | "restoring"; mode ("swap" | "recompute") is given
/// exactly when state is "parked". next_cells: per sequence, the cells it would hold after the
/// next step (running, restoring). resume_cells: cells a parked request needs to come back and
/// run one step. state_bytes: what a swap park of it holds. ValueError on a bad state or mode.
#[pyclass(name = "RequestView", module = "kvpark._core", frozen)]
pub(super) struct PyRequestView(RequestView);

#[pymethods]
impl PyRequestView {
    #[new]
    #[pyo3(signature = (
        *, id, arrival, state = "running", mode = None, seq_ids = Vec::new(),
        next_cells = Vec::new(), resume_cells = 0, state_bytes = 0, parks = 0,
        parked_at_ms = None, resumed_at_ms = None, tokens_since_resume = 0, family = false,
        refused = false, slot = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        id: u64,
        arrival: u64,
        state: &str,
        mode: Option<&str>,
        seq_ids: Vec<SeqId>,
        next_cells: Vec<(SeqId, usize)>,
        resume_cells: usize,
        state_bytes: u64,
        parks: u32,
        parked_at_ms: Option<u64>,
        resumed_at_ms: Option<u64>,
        tokens_since_resume: u32,
        family: bool,
        refused: bool,
        slot: u32,
    ) -> PyResult<Self> {
        let state = match (state, mode) {
            ("running", None) => RequestState::Running,
            ("parked", Some(mode)) => RequestState::Parked(parse_park_mode(mode)?),
            ("parking", None) => RequestState::Parking,
            ("restoring", None) => RequestState::Restoring,
            ("parked", None) => {
                return Err(PyValueError::new_err("a parked request needs its mode"));
            }
            ("running" | "parking" | "restoring", Some(_)) => {
                return Err(PyValueError::new_err(format!(
                    "mode is given only for a parked request, not a {state} one"
                )));
            }
            _ => {
                return Err(PyValueError::new_err(format!(
                    "state '{state}' is not one of 'running', 'parked', 'parking', 'restoring'"
                )));
            }
        };
        Ok(Self(RequestView {
            id,
            arrival,
            state,
            seq_ids,
            next_cells,
            resume_cells,
            state_bytes,
            parks,
            parked_at_ms,
            resumed_at_ms,
            tokens_since_resume,
            family,
            refused,
            slot,
        }))
    }

    #[getter]
    fn id(&self) -> u64 {
        self.0.id
    }

    #[getter]
    fn arrival(&self) -> u64 {
        self.0.arrival
    }

    /// "running" | "parked" | "parking" | "restoring".
    #[getter]
    fn state(&self) -> &'static str {
        match self.0.state {
            RequestState::Running => "running",
            RequestState::Parked(_) => "parked",
            RequestState::Parking => "parking",
            RequestState::Restoring => "restoring",
        }
    }

    /// "swap" | "recompute" for a parked request, else None.
    #[getter]
    fn mode(&self) -> Option<&'static str> {
        match self.0.state {
            RequestState::Parked(mode) => Some(park_mode_name(mode)),
            _ => None,
        }
    }

    #[getter]
    fn seq_ids(&self) -> Vec<SeqId> {
        self.0.seq_ids.clone()
    }

    #[getter]
    fn next_cells(&self) -> Vec<(SeqId, usize)> {
        self.0.next_cells.clone()
    }

    #[getter]
    fn resume_cells(&self) -> usize {
        self.0.resume_cells
    }

    #[getter]
    fn state_bytes(&self) -> u64 {
        self.0.state_bytes
    }

    #[getter]
    fn parks(&self) -> u32 {
        self.0.parks
    }

    #[getter]
    fn parked_at_ms(&self) -> Option<u64> {
        self.0.parked_at_ms
    }

    #[getter]
    fn resumed_at_ms(&self) -> Option<u64> {
        self.0.resumed_at_ms
    }

    #[getter]
    fn tokens_since_resume(&self) -> u32 {
        self.0.tokens_since_resume
    }

    #[getter]
    fn family(&self) -> bool {
        self.0.family
    }

    #[getter]
    fn refused(&self) -> bool {
        self.0.refused
    }

    #[getter]
    fn slot(&self) -> u32 {
        self.0.slot
    }

    fn __repr__(&self) -> String {
        let mode = self
            .mode()
            .map_or(String::new(), |m| format!(", mode='{m}'"));
        format!(
            "RequestView(id={}, arrival={}, state='{}'{mode}, slot={})",
            self.0.id,
            self.0.arrival,
            self.state(),
            self.0.slot
        )
    }
}

/// One planner action (read-only), in list order.
///
/// kind "release_buffer": give slot's idle park buffer back (request None). "park": park
/// request by mode into a buffer of buffer_capacity bytes (0 for recompute); head is set when
/// the park makes room for that parked request, which a later "rotate" resumes. "resume": put
/// request back. "rotate": park request (the victim) as "park" would, then resume head.
/// "fail": request can never fit: fail it with the context error.
#[pyclass(name = "Action", module = "kvpark._core", frozen, eq)]
#[derive(PartialEq)]
pub(super) struct PyAction(Action);

#[pymethods]
impl PyAction {
    /// "release_buffer" | "park" | "resume" | "rotate" | "fail".
    #[getter]
    fn kind(&self) -> &'static str {
        match self.0 {
            Action::ReleaseBuffer { .. } => "release_buffer",
            Action::Park { .. } => "park",
            Action::Resume { .. } => "resume",
            Action::Rotate { .. } => "rotate",
            Action::Fail { .. } => "fail",
        }
    }

    /// The request it acts on (the victim for "rotate"); None for "release_buffer".
    #[getter]
    fn request(&self) -> Option<u64> {
        match self.0 {
            Action::ReleaseBuffer { .. } => None,
            Action::Park { id, .. } | Action::Resume { id } | Action::Fail { id } => Some(id),
            Action::Rotate { victim, .. } => Some(victim),
        }
    }

    /// "swap" | "recompute" for "park" and "rotate", else None.
    #[getter]
    fn mode(&self) -> Option<&'static str> {
        match self.0 {
            Action::Park { mode, .. } | Action::Rotate { mode, .. } => Some(park_mode_name(mode)),
            _ => None,
        }
    }

    /// Bytes of the park buffer to use for a swap; 0 otherwise.
    #[getter]
    fn buffer_capacity(&self) -> u64 {
        match self.0 {
            Action::Park {
                buffer_capacity, ..
            }
            | Action::Rotate {
                buffer_capacity, ..
            } => buffer_capacity,
            _ => 0,
        }
    }

    /// The slot whose buffer "release_buffer" gives back, else None.
    #[getter]
    fn slot(&self) -> Option<u32> {
        match self.0 {
            Action::ReleaseBuffer { slot } => Some(slot),
            _ => None,
        }
    }

    /// The parked request a "rotate" (or a rotation "park") makes room for, else None.
    #[getter]
    fn head(&self) -> Option<u64> {
        match self.0 {
            Action::Rotate { head, .. } => Some(head),
            Action::Park { head, .. } => head,
            _ => None,
        }
    }

    fn __repr__(&self) -> String {
        let mut fields = vec![format!("kind='{}'", self.kind())];
        if let Some(request) = self.request() {
            fields.push(format!("request={request}"));
        }
        if let Some(mode) = self.mode() {
            fields.push(format!(
                "mode='{mode}', buffer_capacity={}",
                self.buffer_capacity()
            ));
        }
        if let Some(slot) = self.slot() {
            fields.push(format!("slot={slot}"));
        }
        if let Some(head) = self.head() {
            fields.push(format!("head={head}"));
        }
        format!("Action({})", fields.join(", "))
    }
}

/// The preemption planner: pure and deterministic, it reads the pool's occupancy and a
/// snapshot of the requests and returns the actions for this step (see docs/preemption.md).
///
/// policy: "fcfs" | "cost". margin_cells: headroom kept free, rounded up to a page.
/// ram_budget_bytes: --preempt-ram in bytes, -1 no limit, 0 every park recomputes. A parked
/// head that has waited rotate_after_ms rotates a resident out; a resumed request is protected
/// until rotate_min_tokens tokens, or one token and rotate_min_ms. A request parked
/// starved_parks times is passed over while another candidate exists. park_ahead=False
/// (KVPARK_PREEMPT_PLANNER=off): plan() parks nothing for pressure; choose_victims() does it
/// after a failed allocation. ValueError on a bad policy or budget.
#[pyclass(name = "Planner", module = "kvpark._core", frozen)]
pub(super) struct PyPlanner(PlannerConfig);

fn snapshot(requests: &[PyRef<'_, PyRequestView>]) -> Vec<RequestView> {
    requests.iter().map(|r| r.0.clone()).collect()
}

fn actions(actions: Vec<Action>) -> Vec<PyAction> {
    actions.into_iter().map(PyAction).collect()
}

#[pymethods]
impl PyPlanner {
    #[new]
    #[pyo3(
        signature = (
            policy = "fcfs", margin_cells = 8, ram_budget_bytes = -1, rotate_after_ms = 2000,
            rotate_min_tokens = 32, rotate_min_ms = 2000, starved_parks = 3, park_ahead = true
        ),
        // pyo3 renders the -1 default as `...`; spell the signature out for stubtest.
        text_signature = "(policy='fcfs', margin_cells=8, ram_budget_bytes=-1, \
            rotate_after_ms=2000, rotate_min_tokens=32, rotate_min_ms=2000, starved_parks=3, \
            park_ahead=True)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        policy: &str,
        margin_cells: usize,
        ram_budget_bytes: i64,
        rotate_after_ms: u64,
        rotate_min_tokens: u32,
        rotate_min_ms: u64,
        starved_parks: u32,
        park_ahead: bool,
    ) -> PyResult<Self> {
        let policy = match policy {
            "fcfs" => Policy::Fcfs,
            "cost" => Policy::Cost,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "policy '{policy}' is not one of 'fcfs', 'cost'"
                )))
            }
        };
        Ok(Self(PlannerConfig {
            policy,
            margin_cells,
            ram_budget: parse_budget(ram_budget_bytes)?,
            rotate_after_ms,
            rotate_min_tokens,
            rotate_min_ms,
            starved_parks,
            park_ahead,
        }))
    }

    /// "fcfs" | "cost".
    #[getter]
    fn policy(&self) -> &'static str {
        match self.0.policy {
            Policy::Fcfs => "fcfs",
            Policy::Cost => "cost",
        }
    }

    #[getter]
    fn margin_cells(&self) -> usize {
        self.0.margin_cells
    }

    /// -1: no limit.
    #[getter]
    fn ram_budget_bytes(&self) -> i64 {
        self.0
            .ram_budget
            .map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX))
    }

    #[getter]
    fn rotate_after_ms(&self) -> u64 {
        self.0.rotate_after_ms
    }

    #[getter]
    fn rotate_min_tokens(&self) -> u32 {
        self.0.rotate_min_tokens
    }

    #[getter]
    fn rotate_min_ms(&self) -> u64 {
        self.0.rotate_min_ms
    }

    #[getter]
    fn starved_parks(&self) -> u32 {
        self.0.starved_parks
    }

    #[getter]
    fn park_ahead(&self) -> bool {
        self.0.park_ahead
    }

    /// The actions for this step. slot_buffer_capacity: per slot, the park buffer it keeps (a
    /// slot past the end keeps none). KeyError for a sequence the pool does not have;
    /// ValueError for a request id or slot given twice.
    fn plan(
        &self,
        pool: &PyKvPool,
        requests: Vec<PyRef<'_, PyRequestView>>,
        slot_buffer_capacity: Vec<u64>,
        now_ms: u64,
    ) -> PyResult<Vec<PyAction>> {
        let ram = RamView {
            slot_buffer_capacity,
        };
        let planned = planner::plan(&pool.0, &snapshot(&requests), &ram, &self.0, now_ms)?;
        Ok(actions(planned))
    }

    /// Victims for a step that failed to allocate shortfall_cells cells: "release_buffer" and
    /// "park" actions, by the same rules as plan(). Errors as plan().
    fn choose_victims(
        &self,
        pool: &PyKvPool,
        requests: Vec<PyRef<'_, PyRequestView>>,
        slot_buffer_capacity: Vec<u64>,
        shortfall_cells: usize,
    ) -> PyResult<Vec<PyAction>> {
        let ram = RamView {
            slot_buffer_capacity,
        };
        let chosen = planner::choose_victims(
            &pool.0,
            &snapshot(&requests),
            &ram,
            &self.0,
            shortfall_cells,
        )?;
        Ok(actions(chosen))
    }

    fn __repr__(&self) -> String {
        format!(
            "Planner(policy='{}', margin_cells={}, ram_budget_bytes={}, park_ahead={})",
            self.policy(),
            self.0.margin_cells,
            self.ram_budget_bytes(),
            if self.0.park_ahead { "True" } else { "False" }
        )
    }
}

/// The capacity a slot's park buffer takes for a need-byte state: kept if cap holds it, else
/// grown by half again rounded up to 64 KiB if held - cap + 2 * grown <= budget, else need
/// rounded up to 64 KiB. held counts every slot's buffer, this one's included; budget -1: no
/// limit. ValueError on a bad budget.
#[pyfunction]
pub(super) fn round_up_buffer(need: u64, cap: u64, held: u64, budget: i64) -> PyResult<u64> {
    Ok(planner::round_up_buffer(
        need,
        cap,
        held,
        parse_budget(budget)?,
    ))
}

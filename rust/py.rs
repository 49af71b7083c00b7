//! The Python module `kvpark._core`: THE ONLY FILE THAT USES PYO3.
//!
//! A thin wrapper: each method converts plain Python values (ints, lists of ints, short
//! strings) and calls the same-named [`KvPool`] or planner function. Errors become Python
//! exceptions in one place, the `From<KvError> for PyErr` impl below. The stub
//! `python/kvpark/_core.pyi` mirrors this file and `mypy.stubtest` checks the two agree.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::planner::{self, Action, ParkMode, PlannerConfig, Policy, RamView, RequestState};
use crate::{KvError, KvPool, PageId, RequestView, SeqId};

create_exception!(
    kvpark._core,
    PoolFullError,
    PyException,
    "Not enough free pages in the pool; the call changed nothing. The message says how many \
     pages were needed and how many are free."
);

impl From<KvError> for PyErr {
    fn from(err: KvError) -> Self {
        let msg = err.to_string();
        match err {
            KvError::UnknownSequence(_) => PyKeyError::new_err(msg),
            KvError::PoolFull { .. } => PoolFullError::new_err(msg),
            KvError::Integrity(_) => PyRuntimeError::new_err(msg),
            KvError::BadGeometry { .. }
            | KvError::SequenceExists(_)
            | KvError::WouldShrink { .. }
            | KvError::WouldGrow { .. }
            | KvError::OutOfRange { .. }
            | KvError::LengthMismatch { .. }
            | KvError::UnknownPage { .. }
            | KvError::DuplicateRequest(_)
            | KvError::DuplicateSlot(_) => PyValueError::new_err(msg),
        }
    }
}

/// The KV cell pool: pages of `page_size` cells with ref counts, and each sequence's page table.
///
/// Sequence ids are ints >= 0 chosen by the caller; page ids are 0..n_pages; the cell of page p
/// at offset o has the flat index p * page_size + o. Free pages are handed out LIFO: a fresh
/// pool gives 0, 1, 2, ...; a released page is the next one given. Every failing call changes
/// nothing. Unknown sequence: KeyError; too few free pages: PoolFullError; other bad
/// arguments: ValueError.
#[pyclass(name = "KvPool", module = "kvpark._core")]
struct PyKvPool(KvPool);

#[pymethods]
impl PyKvPool {
    /// ValueError unless page_size > 0, n_cells > 0 and n_cells is a multiple of page_size.
    #[new]
    #[pyo3(signature = (n_cells, page_size = 16))]
    fn new(n_cells: usize, page_size: usize) -> PyResult<Self> {
        Ok(Self(KvPool::new(n_cells, page_size)?))
    }

    /// Cells per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.0.page_size()
    }

    /// Pages in the pool.
    #[getter]
    fn n_pages(&self) -> usize {
        self.0.n_pages()
    }

    /// Cells in the pool.
    #[getter]
    fn n_cells(&self) -> usize {
        self.0.n_cells()
    }

    /// Add a sequence holding no cell. ValueError if it exists.
    fn add_sequence(&mut self, seq_id: SeqId) -> PyResult<()> {
        Ok(self.0.add_sequence(seq_id)?)
    }

    /// Whether the sequence exists.
    fn has_sequence(&self, seq_id: SeqId) -> bool {
        self.0.has_sequence(seq_id)
    }

    /// Every sequence id, ascending.
    fn sequences(&self) -> Vec<SeqId> {
        self.0.sequences()
    }

    /// Cells (tokens) the sequence holds.
    fn seq_len(&self, seq_id: SeqId) -> PyResult<usize> {
        Ok(self.0.seq_len(seq_id)?)
    }

    /// The sequence's pages in logical order.
    fn page_table(&self, seq_id: SeqId) -> PyResult<Vec<PageId>> {
        Ok(self.0.page_table(seq_id)?.to_vec())
    }

    /// Extra pages the sequence needs to hold n_tokens cells in all (0 if it does already).
    fn pages_needed(&self, seq_id: SeqId, n_tokens: usize) -> PyResult<usize> {
        Ok(self.0.pages_needed(seq_id, n_tokens)?)
    }

    /// Grow the sequence to hold n_tokens cells in all; return the new page ids.
    ///
    /// All or nothing: PoolFullError changes nothing. ValueError if n_tokens < seq_len.
    fn reserve(&mut self, seq_id: SeqId, n_tokens: usize) -> PyResult<Vec<PageId>> {
        Ok(self.0.reserve(seq_id, n_tokens)?)
    }

    /// Keep the first n_tokens cells; release the pages no longer needed.
    ///
    /// A partly used new tail page shared with another sequence is replaced by a private copy:
    /// returns [(src_page, dst_page)], the page copy the runner must do, else [].
    /// PoolFullError (nothing changed) if no page is left for the copy; ValueError if
    /// n_tokens > seq_len.
    fn truncate(&mut self, seq_id: SeqId, n_tokens: usize) -> PyResult<Vec<(PageId, PageId)>> {
        Ok(self.0.truncate(seq_id, n_tokens)?)
    }

    /// Add sequence child sharing parent's full pages (ref counts +1).
    ///
    /// A partly used last page is not shared: the child gets a fresh page and the call returns
    /// [(src_page, dst_page)], the page copy the runner must do, else []. KeyError if parent is
    /// unknown, ValueError if child exists, PoolFullError (nothing changed) if no page is free.
    fn fork(&mut self, parent: SeqId, child: SeqId) -> PyResult<Vec<(PageId, PageId)>> {
        Ok(self.0.fork(parent, child)?)
    }

    /// Remove the sequence; return the cells that went back to the pool (pages nobody else
    /// holds, times page_size).
    fn free_sequence(&mut self, seq_id: SeqId) -> PyResult<usize> {
        Ok(self.0.free_sequence(seq_id)?)
    }

    /// Flat cell indices page * page_size + offset of logical positions start..start+count.
    ///
    /// ValueError if start + count > seq_len.
    fn slot_mapping(&self, seq_id: SeqId, start: usize, count: usize) -> PyResult<Vec<usize>> {
        Ok(self.0.slot_mapping(seq_id, start, count)?)
    }

    /// One call per step: (concatenated slot mappings of every (seq_id, start, count) item,
    /// each item's page table).
    ///
    /// Errors as slot_mapping; ValueError if the three lists differ in length.
    fn export_step(
        &self,
        seq_ids: Vec<SeqId>,
        starts: Vec<usize>,
        counts: Vec<usize>,
    ) -> PyResult<(Vec<usize>, Vec<Vec<PageId>>)> {
        Ok(self.0.export_step(&seq_ids, &starts, &counts)?)
    }

    /// Cells in pages held by at least one sequence: a shared cell once, a partly used page in
    /// full.
    fn cells_used(&self) -> usize {
        self.0.cells_used()
    }

    /// Cells in free pages.
    fn cells_free(&self) -> usize {
        self.0.cells_free()
    }

    /// Cells that removing exactly these sequences would free (pages all of whose holders are
    /// among them). A sequence given twice counts once; KeyError for an unknown one.
    fn cells_freed_by(&self, seq_ids: Vec<SeqId>) -> PyResult<usize> {
        Ok(self.0.cells_freed_by(&seq_ids)?)
    }

    /// Whether n_cells more cells, rounded up to whole pages, fit in the free pages.
    fn can_fit(&self, n_cells: usize) -> bool {
        self.0.can_fit(n_cells)
    }

    /// How many page tables hold the page (0: free). ValueError if not in 0..n_pages.
    fn page_refcount(&self, page: usize) -> PyResult<u32> {
        Ok(self.0.page_refcount(page)?)
    }

    /// Check every invariant of the pool in O(pool); RuntimeError naming the broken one.
    fn check_integrity(&self) -> PyResult<()> {
        Ok(self.0.check_integrity()?)
    }

    /// Drop every sequence; the pool is then as if new.
    fn reset(&mut self) {
        self.0.reset();
    }

    fn __repr__(&self) -> String {
        format!(
            "KvPool(n_cells={}, page_size={}, cells_used={}, sequences={})",
            self.0.n_cells(),
            self.0.page_size(),
            self.0.cells_used(),
            self.0.sequences().len()
        )
    }
}

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
struct PyRequestView(RequestView);

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
struct PyAction(Action);

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
struct PyPlanner(PlannerConfig);

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
fn round_up_buffer(need: u64, cap: u64, held: u64, budget: i64) -> PyResult<u64> {
    Ok(planner::round_up_buffer(
        need,
        cap,
        held,
        parse_budget(budget)?,
    ))
}

// ---- kvpark-cpu-ops: block-weight matmuls and paged decode attention on the CPU ----
//
// These take raw addresses because the stable ABI of Python 3.10 has no buffer protocol. They
// are private: their Python wrappers (`kvpark.ops.block_weights`, `cpu_attention`, `norm`) check
// every tensor's dtype, device, contiguity and size before they pass `tensor.data_ptr()` here.

fn cpu_ops_err(err: kvpark_cpu_ops::ShapeError) -> PyErr {
    PyValueError::new_err(err.0)
}

/// y[rows, n] = x[rows, k] @ W.T for 4-bit block weights (qs [n, k/2] u8, scale and offset
/// [n, k/32] f32), all C-contiguous CPU memory at the given addresses. Private: see
/// kvpark.ops.block_weights, which checks the tensors behind the addresses.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _blockmm_q4(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    let blocks = n * k / kvpark_cpu_ops::BLOCK;
    // SAFETY: the caller (kvpark.ops.block_weights) passes live, contiguous tensors of exactly
    // these sizes and dtypes; `y` does not overlap the inputs.
    let (x, qs, scale, offset, y) = unsafe {
        (
            std::slice::from_raw_parts(x as *const f32, rows * k),
            std::slice::from_raw_parts(qs as *const u8, n * k / 2),
            std::slice::from_raw_parts(scale as *const f32, blocks),
            std::slice::from_raw_parts(offset as *const f32, blocks),
            std::slice::from_raw_parts_mut(y as *mut f32, rows * n),
        )
    };
    let w = kvpark_cpu_ops::Q4Weights {
        qs,
        scale,
        offset,
        n,
        k,
    };
    py.detach(|| kvpark_cpu_ops::matmul_q4(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// y[rows, n] = x[rows, k] @ W.T for 8-bit block weights (qs [n, k] i8, scale [n, k/32] f32).
/// Private: see kvpark.ops.block_weights.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _blockmm_q8(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4.
    let (x, qs, scale, y) = unsafe {
        (
            std::slice::from_raw_parts(x as *const f32, rows * k),
            std::slice::from_raw_parts(qs as *const i8, n * k),
            std::slice::from_raw_parts(scale as *const f32, n * k / kvpark_cpu_ops::BLOCK),
            std::slice::from_raw_parts_mut(y as *mut f32, rows * n),
        )
    };
    let w = kvpark_cpu_ops::Q8Weights { qs, scale, n, k };
    py.detach(|| kvpark_cpu_ops::matmul_q8(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// Decode attention read in place from the paged pool: q [rows, heads, head_dim] f32, k and v
/// [cells, kv_heads, head_dim] f32 (n_kv_values each), cells [seqs, stride] i64, context and
/// rows [seqs] i64, out like q (only the sequences' rows written). Private: see
/// kvpark.ops.cpu_attention, which checks the tensors behind the addresses.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _decode_attention(
    py: Python<'_>,
    q: usize,
    n_q_values: usize,
    k: usize,
    v: usize,
    n_kv_values: usize,
    cells: usize,
    seqs: usize,
    stride: usize,
    context: usize,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4; `out` does not overlap the inputs.
    let (q, k, v, cells, context, rows, out) = unsafe {
        (
            std::slice::from_raw_parts(q as *const f32, n_q_values),
            std::slice::from_raw_parts(k as *const f32, n_kv_values),
            std::slice::from_raw_parts(v as *const f32, n_kv_values),
            std::slice::from_raw_parts(cells as *const i64, seqs * stride),
            std::slice::from_raw_parts(context as *const i64, seqs),
            std::slice::from_raw_parts(rows as *const i64, seqs),
            std::slice::from_raw_parts_mut(out as *mut f32, n_q_values),
        )
    };
    let a = kvpark_cpu_ops::DecodeAttention {
        q,
        k,
        v,
        cells,
        stride,
        context,
        rows,
        heads,
        kv_heads,
        head_dim,
    };
    py.detach(|| kvpark_cpu_ops::decode_attention(a, out))
        .map_err(cpu_ops_err)
}

/// RMSNorm of rows = n_values / d: x [rows, d] f32, weight [d] f32, out like x. Private: see
/// kvpark.ops.norm, which checks the tensors behind the addresses.
#[pyfunction]
fn _rms_norm(
    x: usize,
    n_values: usize,
    weight: usize,
    d: usize,
    eps: f32,
    out: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4; `out` does not overlap `x` or `weight`.
    let (x, weight, out) = unsafe {
        (
            std::slice::from_raw_parts(x as *const f32, n_values),
            std::slice::from_raw_parts(weight as *const f32, d),
            std::slice::from_raw_parts_mut(out as *mut f32, n_values),
        )
    };
    kvpark_cpu_ops::rms_norm(x, weight, eps, out).map_err(cpu_ops_err)
}

/// How many threads the CPU kernels (block matmuls, decode attention) use (1: the calling
/// thread only).
#[pyfunction]
fn _cpu_set_threads(n: usize) {
    kvpark_cpu_ops::set_threads(n);
}

/// The CPU features the kernels see, `(cpu, effective)`: each a dict of flag -> bool plus
/// `"isa"` (plain, avx2 or avx512); `effective` is `cpu` under the cap in `KVPARK_CPU_ISA`.
/// Raises ValueError for a value that variable cannot hold.
#[pyfunction]
fn _cpu_features(py: Python<'_>) -> PyResult<(Py<PyDict>, Py<PyDict>)> {
    use kvpark_cpu_ops::isa::{effective, Features, Isa, ISA_VAR};
    if let Ok(text) = std::env::var(ISA_VAR) {
        Isa::parse_cap(&text).map_err(PyValueError::new_err)?;
    }
    let as_dict = |f: Features| -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        d.set_item("isa", f.level().name())?;
        d.set_item("avx2", f.avx2)?;
        d.set_item("fma", f.fma)?;
        d.set_item("avx512f", f.avx512f)?;
        d.set_item("avx512bw", f.avx512bw)?;
        d.set_item("avx512vl", f.avx512vl)?;
        d.set_item("avx512_bf16", f.avx512_bf16)?;
        d.set_item("avx512_vnni", f.avx512_vnni)?;
        Ok(d.unbind())
    };
    Ok((as_dict(Features::detect())?, as_dict(effective())?))
}

/// kvpark's KV cell pool, page tables, occupancy queries and preemption planner, from the Rust
/// crate kvpark-core.
#[pymodule]
#[pyo3(name = "_core")]
fn kvpark_core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyKvPool>()?;
    m.add_class::<PyRequestView>()?;
    m.add_class::<PyAction>()?;
    m.add_class::<PyPlanner>()?;
    m.add_function(wrap_pyfunction!(round_up_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q4, m)?)?;
    m.add_function(wrap_pyfunction!(_blockmm_q8, m)?)?;
    m.add_function(wrap_pyfunction!(_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(_cpu_features, m)?)?;
    m.add("PoolFullError", m.py().get_type::<PoolFullError>())?;
    Ok(())
}

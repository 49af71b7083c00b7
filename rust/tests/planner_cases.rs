//! The planner's rules, one by one, on small hand-built snapshots with the exact actions
//! expected. (`planner_props.rs` drives it through random workloads.) The helpers that build the
//! snapshots are here; the cases are in `planner_cases/`, one topic a file.

use kvpark_core::planner::{round_up_buffer, BUFFER_ALIGN};
use kvpark_core::{
    choose_victims, plan, Action, KvError, KvPool, ParkMode, PlannerConfig, Policy, RamView,
    RequestState, RequestView, SeqId,
};

#[path = "planner_cases/inputs.rs"]
mod inputs;
#[path = "planner_cases/park_mode.rs"]
mod park_mode;
#[path = "planner_cases/resume.rs"]
mod resume;
#[path = "planner_cases/rotation.rs"]
mod rotation;
#[path = "planner_cases/victims.rs"]
mod victims;
#[path = "planner_cases/when_to_park.rs"]
mod when_to_park;

const K: u64 = 1024;
const SWAP: RequestState = RequestState::Parked(ParkMode::Swap);
const RECOMPUTE: RequestState = RequestState::Parked(ParkMode::Recompute);

/// A pool of `n_cells` in pages of `page_size`, sequence `seq` holding `cells`, for each pair.
fn pool(n_cells: usize, page_size: usize, seqs: &[(SeqId, usize)]) -> KvPool {
    let mut pool = KvPool::new(n_cells, page_size).unwrap();
    for &(seq, cells) in seqs {
        pool.add_sequence(seq).unwrap();
        pool.reserve(seq, cells).unwrap();
    }
    pool
}

/// A running request with one sequence (id `seq`) whose next step brings it to `next` cells.
/// Its slot is `seq`, its arrival `arrival`.
fn running(id: u64, arrival: u64, seq: SeqId, next: usize) -> RequestView {
    RequestView {
        seq_ids: vec![seq],
        next_cells: vec![(seq, next)],
        slot: seq as u32,
        ..RequestView::new(id, arrival, RequestState::Running)
    }
}

/// A parked request needing `resume_cells`, parked at `parked_at_ms`, in slot `slot`.
fn parked(
    id: u64,
    arrival: u64,
    state: RequestState,
    resume_cells: usize,
    at: u64,
    slot: u32,
) -> RequestView {
    RequestView {
        resume_cells,
        parked_at_ms: Some(at),
        parks: 1,
        slot,
        ..RequestView::new(id, arrival, state)
    }
}

fn recompute_only() -> PlannerConfig {
    PlannerConfig {
        ram_budget: Some(0),
        ..PlannerConfig::default()
    }
}

fn park(id: u64) -> Action {
    Action::Park {
        id,
        mode: ParkMode::Recompute,
        buffer_capacity: 0,
        head: None,
    }
}

fn swap(id: u64, buffer_capacity: u64) -> Action {
    Action::Park {
        id,
        mode: ParkMode::Swap,
        buffer_capacity,
        head: None,
    }
}

fn no_ram() -> RamView {
    RamView::default()
}

fn none() -> Vec<Action> {
    Vec::new()
}

/// Three requests of one page each in a 4-page pool, each about to cross into a second page.
fn three_crossing() -> (KvPool, Vec<RequestView>) {
    let pool = pool(64, 16, &[(1, 16), (2, 16), (3, 16)]);
    // Ids run against arrival: fcfs must read the arrival.
    let reqs = vec![
        running(30, 1, 1, 17),
        running(20, 2, 2, 17),
        running(10, 3, 3, 17),
    ];
    (pool, reqs)
}

/// Residents of 300, 1500 and 600 cells (arrivals 1, 2, 3), page size 4, and a margin that
/// leaves the pool `short` cells short.
fn three_residents(short: usize) -> (KvPool, Vec<RequestView>, PlannerConfig) {
    let p = pool(2408, 4, &[(1, 300), (2, 1500), (3, 600)]);
    let reqs = vec![
        running(1, 1, 1, 300),
        running(2, 2, 2, 1500),
        running(3, 3, 3, 600),
    ];
    let cfg = PlannerConfig {
        policy: Policy::Cost,
        margin_cells: 8 + short,
        ..recompute_only()
    };
    (p, reqs, cfg)
}

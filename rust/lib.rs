//! kvpark-core: kvpark's KV cell pool, page tables, occupancy queries and preemption planner,
//! in plain Rust.
//!
//! Vocabulary (SPEC §1): a *cell* holds one token's K and V; a *page* is `page_size`
//! consecutive cells, the unit of allocation; a sequence's *page table* lists its pages in
//! logical order; the *pool* is all cells. [`KvPool`] holds all of it. The [`planner`] reads
//! the pool's occupancy and a snapshot of the requests and decides who to *park* (swap or
//! recompute), *resume*, *rotate* or fail; `sim` (cargo feature `sim`) drives both through
//! random workloads for the tests and the fuzzer.
//!
//! The core knows nothing of Python: `py.rs`, built only with the cargo feature `python`, is
//! the one file that uses pyo3: it wraps [`KvPool`] as `kvpark._core.KvPool` and the planner as
//! `kvpark._core.Planner`, `RequestView`, `Action` and `round_up_buffer`.

mod error;
mod occupancy;
mod page_table;
pub mod planner;
mod pool;
#[cfg(feature = "python")]
mod py;
#[cfg(any(test, feature = "sim"))]
pub mod sim;

pub use error::{KvError, KvResult};
pub use planner::{
    choose_victims, plan, Action, ParkMode, PlannerConfig, Policy, RamView, RequestState,
    RequestView,
};
pub use pool::KvPool;

/// A sequence id, chosen by the caller.
pub type SeqId = u64;

/// A page id, in `0..n_pages`.
pub type PageId = u32;

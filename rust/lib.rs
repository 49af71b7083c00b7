//! kvpark-core: kvpark's KV cell pool, page tables, occupancy queries and preemption planner,
//! in plain Rust.
//!
//! Vocabulary: a *cell* holds one token's K and V; a *page* is `page_size`
//! consecutive cells, the unit of allocation; a sequence's *page table* lists its pages in
//! logical order; the *pool* is all cells. [`KvPool`] holds all of it. With the prefix cache
//! on ([`KvPool::with_prefix_cache`]) a full page is also addressed by the hash chain of its
//! tokens, and a *cached page* (held by no sequence, still findable) waits for reuse until its
//! room is needed. The [`planner`] reads
//! the pool's occupancy and a snapshot of the requests and decides who to *park* (swap or
//! recompute), *resume*, *rotate* or fail; the workspace crate `kvpark-sim` (`rust/sim/`, not
//! published) drives both through random workloads for the tests and the fuzzer.
//!
//! Modules, each using only those after it: `py` (Python), [`planner`], `occupancy`, `pool`
//! (the pool, its allocator and its sequence operations), `page_table`, `error`, `ids`.
//!
//! The core knows nothing of Python: `py/`, built only with the cargo feature `python`, is
//! the one place that uses pyo3: it wraps [`KvPool`] as `kvpark._core.KvPool` and the planner
//! as `kvpark._core.Planner`, `RequestView`, `Action` and `round_up_buffer`, and exposes the CPU
//! kernels of kvpark-cpu-ops.

mod error;
mod ids;
mod occupancy;
mod page_table;
pub mod planner;
mod pool;
#[cfg(feature = "python")]
mod py;

pub use error::{KvError, KvResult};
pub use ids::{PageId, SeqId};
pub use planner::{
    choose_victims, plan, Action, ParkMode, PlannerConfig, Policy, RamView, RequestState,
    RequestView,
};
pub use pool::{KvPool, PrefixHit};

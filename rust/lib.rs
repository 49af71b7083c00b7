//! kvpark-core: kvpark's KV cell pool, page tables and occupancy queries, in plain Rust.
//!
//! Vocabulary (SPEC §1): a *cell* holds one token's K and V; a *page* is `page_size`
//! consecutive cells, the unit of allocation; a sequence's *page table* lists its pages in
//! logical order; the *pool* is all cells. [`KvPool`] holds all of it.
//!
//! The core knows nothing of Python: `py.rs`, built only with the cargo feature `python`, is
//! the one file that uses pyo3 and wraps [`KvPool`] as `kvpark._core.KvPool`.

mod error;
mod occupancy;
mod page_table;
mod pool;
#[cfg(feature = "python")]
mod py;

pub use error::{KvError, KvResult};
pub use pool::KvPool;

/// A sequence id, chosen by the caller.
pub type SeqId = u64;

/// A page id, in `0..n_pages`.
pub type PageId = u32;

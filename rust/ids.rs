//! The ids every module shares (a leaf: it imports nothing).

/// A sequence id, chosen by the caller.
pub type SeqId = u64;

/// A page id, in `0..n_pages`.
pub type PageId = u32;

//! Every way a call into the core can fail, as one enum.
//!
//! Each variant carries plain numbers, not a formatted message: the message is built by
//! `Display` only when someone reads it, so a failed call on the hot path formats nothing.
//! The Python binding (`py/errors.rs`) maps each variant to one Python exception, in one
//! function.

use std::fmt;

use crate::ids::SeqId;

/// The error of every fallible [`KvPool`](crate::KvPool) and planner call. A call that returns an error has
/// changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvError {
    /// `n_cells` is zero, `page_size` is zero, `n_cells` is not a whole number of pages, or the
    /// pool would have more pages than a [`PageId`](crate::PageId) can name.
    BadGeometry { n_cells: usize, page_size: usize },
    /// No sequence has this id.
    UnknownSequence(SeqId),
    /// A sequence with this id exists already.
    SequenceExists(SeqId),
    /// Not enough free pages: `needed` pages were asked for, `free` are free.
    PoolFull {
        needed: usize,
        free: usize,
        page_size: usize,
    },
    /// `reserve` was asked for fewer cells than the sequence holds (use `truncate`).
    WouldShrink {
        seq: SeqId,
        len: usize,
        requested: usize,
    },
    /// `truncate` was asked to keep more cells than the sequence holds (use `reserve`).
    WouldGrow {
        seq: SeqId,
        len: usize,
        requested: usize,
    },
    /// Logical positions `start..start + count` reach past the `len` cells the sequence holds.
    OutOfRange {
        seq: SeqId,
        start: usize,
        count: usize,
        len: usize,
    },
    /// Logical position `pos` of the sequence lies in its first `released` pages, which were
    /// given back (`release_before`): it holds no cell there.
    Released {
        seq: SeqId,
        pos: usize,
        released: usize,
    },
    /// The parallel lists of `export_step` differ in length.
    LengthMismatch {
        seq_ids: usize,
        starts: usize,
        counts: usize,
    },
    /// A page id outside `0..n_pages`.
    UnknownPage { page: usize, n_pages: usize },
    /// `check_integrity` found a broken invariant; the message names it.
    Integrity(String),
    /// `match_prefix` was given a sequence that already holds `len` cells.
    NotEmpty { seq: SeqId, len: usize },
    /// The parallel lists of `register_step` differ in length.
    RegisterMismatch { seq_ids: usize, token_lists: usize },
    /// Two requests in a planner snapshot have this id.
    DuplicateRequest(u64),
    /// Two requests in a planner snapshot have this slot.
    DuplicateSlot(u32),
}

/// The result of every fallible [`KvPool`](crate::KvPool) call.
pub type KvResult<T> = Result<T, KvError>;

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadGeometry { n_cells, page_size } => write!(
                f,
                "bad pool geometry: n_cells={n_cells}, page_size={page_size} \
                 (both must be > 0, n_cells a multiple of page_size, at most 2**32 pages)"
            ),
            Self::UnknownSequence(seq) => write!(f, "unknown sequence {seq}"),
            Self::SequenceExists(seq) => write!(f, "sequence {seq} exists already"),
            Self::PoolFull {
                needed,
                free,
                page_size,
            } => write!(
                f,
                "pool full: needed {needed} pages ({} cells), {free} free ({} cells)",
                needed * page_size,
                free * page_size
            ),
            Self::WouldShrink {
                seq,
                len,
                requested,
            } => write!(
                f,
                "reserve({seq}, {requested}) would shrink sequence {seq} from {len} cells; \
                 use truncate"
            ),
            Self::WouldGrow {
                seq,
                len,
                requested,
            } => write!(
                f,
                "truncate({seq}, {requested}) would grow sequence {seq} from {len} cells; \
                 use reserve"
            ),
            Self::OutOfRange {
                seq,
                start,
                count,
                len,
            } => write!(
                f,
                "positions {start}..{start}+{count} are out of range: sequence {seq} holds \
                 {len} cells"
            ),
            Self::Released { seq, pos, released } => write!(
                f,
                "position {pos} of sequence {seq} lies in its first {released} pages, which \
                 it released (they fell behind its sliding window)"
            ),
            Self::LengthMismatch {
                seq_ids,
                starts,
                counts,
            } => write!(
                f,
                "export_step lists differ in length: {seq_ids} seq_ids, {starts} starts, \
                 {counts} counts"
            ),
            Self::UnknownPage { page, n_pages } => {
                write!(f, "page {page} is out of range 0..{n_pages}")
            }
            Self::NotEmpty { seq, len } => write!(
                f,
                "match_prefix needs an empty sequence: sequence {seq} holds {len} cells"
            ),
            Self::RegisterMismatch {
                seq_ids,
                token_lists,
            } => write!(
                f,
                "register_step lists differ in length: {seq_ids} seq_ids, {token_lists} \
                 token lists"
            ),
            Self::Integrity(msg) => write!(f, "integrity: {msg}"),
            Self::DuplicateRequest(id) => {
                write!(f, "request {id} is twice in the planner snapshot")
            }
            Self::DuplicateSlot(slot) => {
                write!(
                    f,
                    "slot {slot} is held by two requests in the planner snapshot"
                )
            }
        }
    }
}

impl std::error::Error for KvError {}

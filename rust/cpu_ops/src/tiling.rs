//! How a product is cut up: rows of `x` taken together, output columns computed side by side,
//! and output columns handed to a thread at a time. None of them changes a bit of a result.

/// Rows of `x` multiplied together against one expanded weight block.
pub const ROW_TILE: usize = 8;
/// Output columns handed to a thread at a time.
pub(crate) const COLUMN_CHUNK: usize = 16;
/// Output columns computed side by side (a multiple of it divides [`COLUMN_CHUNK`]).
pub(crate) const COLUMN_GROUP: usize = 4;

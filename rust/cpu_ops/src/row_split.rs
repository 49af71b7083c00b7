//! Row-wise work between the products (norms, activations, residual adds, rope, quantising the
//! activations) split over the kernel threads by rows, where a step has enough of them.
//!
//! Why: each of those ran on the calling thread alone while the helpers spun, which is cheap at a
//! decode step's few rows but not at a prompt's: in a 448-token prompt (SmolLM2, AVX2, two
//! threads) the helper waited through 20 % of a Q4_0 prefill and 9 % of an F32 one, most of it
//! on quantising, SwiGLU and the norms. Every row is computed as before, by one thread, so the
//! split changes no bit.

use crate::threads::parallel_above;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::OnceLock;

/// Values (rows times width) from which row-wise work is split: below it a call's hand-off
/// (~1-2 µs on a VM) costs more than the half it saves. A decode step's eight rows of 576 or
/// 1,536 stay on the caller; a prompt's rows go to the team.
const MIN_SPLIT_VALUES: usize = 32 * 1024;

/// Calls `f` on ranges of rows that together cover `0..rows` once, on the kernel threads where
/// `rows * width` values make it worth it, else once on the caller (always with
/// `KVPARK_CPU_ROW_SPLIT=off`: the same bits, for measuring).
pub(crate) fn for_rows(rows: usize, width: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    if !enabled() {
        return f(0..rows);
    }
    parallel_above(rows, rows * width, MIN_SPLIT_VALUES, f);
}

/// Whether row-wise work may be split: `KVPARK_CPU_ROW_SPLIT`, read once.
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("KVPARK_CPU_ROW_SPLIT").as_deref() != Ok("off"))
}

/// A row-major matrix `[rows, width]` whose rows several threads may borrow at once, each range
/// by one thread only (as [`for_rows`] hands them out).
pub(crate) struct SharedRows<'a, T> {
    ptr: *mut T,
    rows: usize,
    width: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: threads borrow disjoint rows (their own ranges); the caller reads nothing until all
// are done.
unsafe impl<T: Send> Sync for SharedRows<'_, T> {}

impl<'a, T> SharedRows<'a, T> {
    /// `values` as rows of `width` (its length a multiple of it).
    pub(crate) fn new(values: &'a mut [T], width: usize) -> Self {
        assert!(width > 0 && values.len().is_multiple_of(width));
        Self {
            ptr: values.as_mut_ptr(),
            rows: values.len() / width,
            width,
            _borrow: PhantomData,
        }
    }

    /// Rows `r` as one slice.
    ///
    /// # Safety
    /// No other borrow of these rows is alive: each range is handed to one thread only.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn rows(&self, r: Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.rows,
            "rows {r:?} of {}",
            self.rows
        );
        // SAFETY: in bounds (checked); the caller promises the rows are borrowed once.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.add(r.start * self.width),
                (r.end - r.start) * self.width,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_visited_once_whatever_the_split() {
        crate::set_threads(2);
        for (rows, width) in [(3, 4), (448, 576), (64, 1536)] {
            let mut v = vec![0u32; rows * width];
            let shared = SharedRows::new(&mut v, width);
            for_rows(rows, width, &|r| {
                // SAFETY: for_rows hands each range to one thread.
                let mine = unsafe { shared.rows(r.clone()) };
                for (i, row) in mine.chunks_exact_mut(width).enumerate() {
                    row.iter_mut().for_each(|x| *x += (r.start + i) as u32 + 1);
                }
            });
            for (i, row) in v.chunks_exact(width).enumerate() {
                assert!(row.iter().all(|&x| x == i as u32 + 1), "row {i} of {rows}");
            }
        }
    }

    #[test]
    fn a_split_called_from_inside_a_split_runs_on_its_own_thread() {
        crate::set_threads(2);
        let (rows, width) = (64, 1024); // each level large enough to split on its own
        let mut v = vec![0u32; rows * width];
        let shared = SharedRows::new(&mut v, width);
        for_rows(rows, width, &|r| {
            // SAFETY: for_rows hands each range to one thread.
            let mine = unsafe { shared.rows(r.clone()) };
            let inner = SharedRows::new(mine, width);
            for_rows(r.len(), 64 * width, &|i| {
                // SAFETY: as above, within this range.
                let row = unsafe { inner.rows(i) };
                row.iter_mut().for_each(|x| *x += 1);
            });
        });
        assert!(v.iter().all(|&x| x == 1));
    }
}

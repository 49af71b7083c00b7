//! Asking for the next group of columns' weights while a side-by-side kernel (`wide.rs`,
//! `wide_avx2.rs`) works on this group's: a share per block, spread over the work, so that the
//! requests neither come in one burst nor come late.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};

use crate::weights::{Q8Packing, Weights, BLOCK};

/// Rows up to which a call asks during its first tile, into L2 ([`Fetch::for_rows`]): decode
/// steps of a few chats.
const L2_ROWS: usize = 16;

/// When a call asks for the next group, and into which cache level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fetch {
    /// A share per block as the group is transposed, into L1.
    Transposing,
    /// A share per block as the group's first tile of rows multiplies it, into L2.
    FirstTile,
}

impl Fetch {
    /// [`Fetch::FirstTile`] up to [`L2_ROWS`] rows, [`Fetch::Transposing`] above.
    ///
    /// Why: at decode sizes the product streams its weights from memory. Asked for during the
    /// transposition, the group's requests came in one burst that filled the core's queue of
    /// misses (`perf` put an eighth to a sixth of an eight-row Q8_0 step's kernel samples under
    /// `KVPARK_CPU_ISA=avx2` on those prefetches) and then left memory idle through the tiles.
    /// Spread over the first tile they arrive at the rate memory gives them, in time for the next
    /// transposition (eight rows: its step 5-9 % shorter; spread over every tile, it was no
    /// better). Into L2, because a prefetch into L1 holds one of its few fill buffers until its
    /// line arrives (as the dense kernels found, `dense/mod.rs`). At prompt sizes the product is
    /// bound by its arithmetic, the tiles are many and long, and a 448-token Q8_0 prefill ran
    /// ~4 % slower into L2 and ~5 % slower spread over its tiles: the burst into L1 stays.
    pub(super) fn for_rows(rows: usize) -> Fetch {
        if rows <= L2_ROWS {
            Fetch::FirstTile
        } else {
            Fetch::Transposing
        }
    }
}

/// The next group's bytes of each of a matrix's per-column arrays (quants, scales, offsets),
/// and when to ask for them.
#[derive(Clone, Copy, Debug)]
pub(super) struct NextGroup {
    /// Each array's next group as lines, so that a block's share is a multiply and two bounds.
    /// Why: with the weights in cache (nothing to wait for) an eight-row AVX2 Q8 product that
    /// asked for nothing ran 3-8 % faster than one working out each share from byte ranges
    /// through a stepped iterator; as line counts about 2 % of that came back (one thread,
    /// alternated four times).
    regions: [Region; 3],
    fetch: Fetch,
}

/// One array's next group: where it starts, how many lines it spans, and how many of them each
/// block asks for (the last blocks' shares may be short or empty).
#[derive(Clone, Copy, Debug)]
struct Region {
    first: *const u8,
    lines: usize,
    per_block: usize,
}

impl NextGroup {
    /// The group of `columns` columns from `c0` of `w` in the row layout, multiplied by `rows`
    /// rows. A packed matrix's arrays are read in place by kernels that ask for themselves: none.
    pub(super) fn new(w: &Weights<'_>, c0: usize, columns: usize, rows: usize) -> NextGroup {
        let blocks = w.k() / BLOCK;
        // the array at `p` holding `per` bytes a block of each column
        let region = |p: *const u8, per: usize| {
            let bytes = columns * blocks * per;
            // wrapping_add forms the address without UB; the next group follows this one
            let first = p.wrapping_add(c0 * blocks * per + bytes);
            let per_block = bytes.div_ceil(blocks).div_ceil(64);
            Region {
                first,
                lines: bytes.div_ceil(64),
                per_block,
            }
        };
        let none = Region {
            first: std::ptr::null(),
            lines: 0,
            per_block: 0,
        };
        let regions = match w {
            Weights::Q4(w) if !w.packed => [
                region(w.qs.as_ptr(), 16),
                region(w.scale.as_ptr().cast(), 4),
                region(w.offset.as_ptr().cast(), 4),
            ],
            Weights::Q8(w) if w.packed == Q8Packing::Rows => [
                region(w.qs.as_ptr().cast(), BLOCK),
                region(w.scale.as_ptr().cast(), 4),
                w.offset.map_or(none, |o| region(o.as_ptr().cast(), 4)),
            ],
            Weights::Q6(w) if !w.packed => [
                region(w.qs.as_ptr().cast(), BLOCK),
                region(w.scale.as_ptr().cast(), 8),
                none,
            ],
            Weights::Iq4(w) => [
                region(w.qs.as_ptr(), 16),
                region(w.scale.as_ptr().cast(), 4),
                none,
            ],
            _ => [none; 3],
        };
        NextGroup {
            regions,
            fetch: Fetch::for_rows(rows),
        }
    }

    /// Block `b`'s share, where the call asks as it transposes.
    #[inline(always)]
    pub(super) fn transposing(&self, b: usize) {
        if self.fetch == Fetch::Transposing {
            self.lines(b).for_each(|at| {
                // SAFETY: a prefetch never faults.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(at) }
            });
        }
    }

    /// Block `b`'s share, where the call asks as its first tile multiplies (the tile of rows from
    /// 0; later tiles ask nothing).
    #[inline(always)]
    pub(super) fn first_tile(&self, b: usize) {
        if self.fetch == Fetch::FirstTile {
            self.lines(b).for_each(|at| {
                // SAFETY: a prefetch never faults.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(at) }
            });
        }
    }

    /// The lines of block `b`'s share of every array's next group (none past its end).
    #[inline(always)]
    fn lines(&self, b: usize) -> impl Iterator<Item = *const i8> + '_ {
        self.regions.iter().flat_map(move |r| {
            let from = (b * r.per_block).min(r.lines);
            let to = (from + r.per_block).min(r.lines);
            (from..to).map(move |line| r.first.wrapping_add(64 * line).cast())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Q8Weights;

    #[test]
    fn decode_steps_ask_during_the_first_tile_and_prompts_while_transposing() {
        assert_eq!(Fetch::for_rows(1), Fetch::FirstTile);
        assert_eq!(Fetch::for_rows(8), Fetch::FirstTile);
        assert_eq!(Fetch::for_rows(L2_ROWS + 1), Fetch::Transposing);
        assert_eq!(Fetch::for_rows(448), Fetch::Transposing);
    }

    #[test]
    fn the_blocks_shares_ask_for_each_line_of_the_next_group_once() {
        // 24 columns of 18 blocks (k = 576), a group of 8 from column 8: the next is 16..24
        let (n, k) = (24, 576);
        let blocks = k / BLOCK;
        let qs = vec![0i8; n * k];
        let scale = vec![0f32; n * blocks];
        let offset = vec![0f32; n * blocks];
        let w = Weights::Q8(Q8Weights {
            qs: &qs,
            scale: &scale,
            offset: Some(&offset),
            n,
            k,
            low: None,
            packed: Q8Packing::Rows,
        });
        let next = NextGroup::new(&w, 8, 8, 8);
        let mut asked: Vec<usize> = (0..blocks)
            .flat_map(|b| next.lines(b))
            .map(|p| p as usize)
            .collect();
        let total = asked.len();
        asked.sort_unstable();
        asked.dedup();
        assert_eq!(asked.len(), total, "a line asked for twice");
        // every line of each array's columns 16..24, and nothing else
        let mut want = Vec::new();
        for (p, bytes) in [
            (qs.as_ptr() as usize + 16 * k, 8 * k),
            (scale.as_ptr() as usize + 16 * blocks * 4, 8 * blocks * 4),
            (offset.as_ptr() as usize + 16 * blocks * 4, 8 * blocks * 4),
        ] {
            want.extend((0..bytes).step_by(64).map(|line| p + line));
        }
        want.sort_unstable();
        assert_eq!(asked, want);
    }
}

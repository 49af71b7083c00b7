//! Asking for the next group of columns' weights while a side-by-side kernel (`wide.rs`,
//! `wide_avx2.rs`) transposes this group's: a share per block, so that the requests spread over
//! the transposition, into L1 or L2 by the call's rows.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};

/// Rows up to which a call asks into L2 ([`Fetch::for_rows`]): decode steps of a few chats.
const L2_ROWS: usize = 16;

/// The cache level a call's prefetches ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fetch {
    L1,
    L2,
}

impl Fetch {
    /// L2 up to [`L2_ROWS`] rows, L1 above.
    ///
    /// Why: at decode sizes the product streams its weights from memory, and a prefetch into L1
    /// holds one of the core's few L1 fill buffers until its line arrives (`perf` put a sixth of
    /// an eight-row Q8_0 step's kernel samples under `KVPARK_CPU_ISA=avx2` on those
    /// prefetches); into L2 the requests queue in L2's larger table, and the transposition's
    /// loads find the lines one level down (as the dense kernels found, `dense/mod.rs`). At
    /// prompt sizes the product is bound by its arithmetic, and a 448-token Q8_0 prefill ran
    /// ~4 % slower into L2, so L1 stays there.
    pub(super) fn for_rows(rows: usize) -> Fetch {
        if rows <= L2_ROWS {
            Fetch::L2
        } else {
            Fetch::L1
        }
    }
}

/// Asks for block `b`'s share (of `blocks`) of the `group_bytes` that follow the group at `p`:
/// the next group's, which lies right after it.
#[inline(always)]
pub(super) fn next_group(p: *const u8, group_bytes: usize, b: usize, blocks: usize, fetch: Fetch) {
    let share = group_bytes.div_ceil(blocks).next_multiple_of(64);
    let next = p.wrapping_add(group_bytes);
    for line in (b * share..((b + 1) * share).min(group_bytes)).step_by(64) {
        let at = next.wrapping_add(line) as *const i8;
        // SAFETY: a prefetch never faults, and wrapping_add forms the address without UB.
        unsafe {
            match fetch {
                Fetch::L1 => _mm_prefetch(at, _MM_HINT_T0),
                Fetch::L2 => _mm_prefetch(at, _MM_HINT_T1),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_steps_ask_into_l2_and_prompts_into_l1() {
        assert_eq!(Fetch::for_rows(1), Fetch::L2);
        assert_eq!(Fetch::for_rows(8), Fetch::L2);
        assert_eq!(Fetch::for_rows(L2_ROWS + 1), Fetch::L1);
        assert_eq!(Fetch::for_rows(448), Fetch::L1);
    }
}

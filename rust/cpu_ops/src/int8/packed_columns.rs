//! Which kernel multiplies a matrix packed at load ([`crate::packed`]: 4-bit, q6, q5): the
//! in-place readers of that layout where they run, the others on groups unpacked into the row
//! layout.

#[cfg(target_arch = "x86_64")]
use super::{avx2, side_by_side, vnni, wide, wide_avx2_packed, wide_packed};
use super::{Activations, I8Kernel};
#[cfg(target_arch = "x86_64")]
use crate::packed::PACK;
use crate::threads::Output;
use crate::weights::Weights;

/// Output columns `cols` of every row of a packed `w`: whole groups on the kernel that reads
/// the layout as it lies for this CPU and kind (AVX-512 VNNI: `wide_packed.rs`; AVX2:
/// `side_by_side_packed.rs` for q4, `wide_avx2_packed.rs` for q6 and q5), for any number of rows;
/// the rest, and every column where those kernels cannot run or are off, unpacked a group at a
/// time for the others (same bits, slower: the loader packs only the kinds the CPU's kernels
/// read in place).
pub(super) fn columns(
    kernel: I8Kernel,
    a: &Activations<'_>,
    w: Weights<'_>,
    cols: std::ops::Range<usize>,
    y: &Output,
) {
    let mut c = cols.start;
    #[cfg(target_arch = "x86_64")]
    if kernel == I8Kernel::Avx512Vnni && wide::on() {
        while c.is_multiple_of(wide::COLUMNS) && c + wide::COLUMNS <= cols.end {
            // SAFETY: the kernel runs here (matmul_i8 checked), the group lies inside the
            // matrix, starts a packed group, and `a` was quantised for `w`.
            unsafe {
                if a.rows >= wide_packed::SPLIT_ROWS {
                    wide::group(a, w, c, y)
                } else {
                    wide_packed::group(a, w, c, y)
                }
            };
            c += wide::COLUMNS;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if kernel != I8Kernel::Plain && wide::on() && wide_avx2_packed::takes(&w) {
        // q6 and q5: one row a whole packed group at a time, more each half of a group
        while a.rows == 1 && c.is_multiple_of(PACK) && c + PACK <= cols.end {
            // SAFETY: as below, for a whole group and one row.
            unsafe { wide_avx2_packed::one_row(a, w, c, y) };
            c += PACK;
        }
        while c.is_multiple_of(side_by_side::GROUP) && c + side_by_side::GROUP <= cols.end {
            // SAFETY: the kernel runs here (matmul_i8 checked: AVX2 and FMA at least), the
            // half lies inside the packed matrix, and `a` was quantised for `w`.
            unsafe { wide_avx2_packed::group(a, w, c, y) };
            c += side_by_side::GROUP;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if let Weights::Q4(q4) = w {
        if kernel != I8Kernel::Plain && side_by_side::enabled() {
            // one row: a whole packed group at a time
            while a.rows == 1 && c.is_multiple_of(PACK) && c + PACK <= cols.end {
                // SAFETY: as below, for a whole group and one row.
                unsafe {
                    match kernel {
                        I8Kernel::Avx512Vnni => vnni::packed_one_row(a, q4, c, y),
                        _ => avx2::packed_one_row(a, q4, c, y),
                    }
                }
                c += PACK;
            }
            // the eight-column 4-bit kernel, each half of a packed group in place (split once
            // into its buffer for many rows)
            let split = a.rows >= wide_packed::SPLIT_ROWS;
            while c.is_multiple_of(side_by_side::GROUP) && c + side_by_side::GROUP <= cols.end {
                // SAFETY: the kernel runs here (matmul_i8 checked), the half lies inside the
                // packed matrix, and `a` was quantised for `w`.
                unsafe {
                    match (kernel, split) {
                        (I8Kernel::Avx512Vnni, false) => vnni::packed_group(a, q4, c, y),
                        (I8Kernel::Avx512Vnni, true) => vnni::group(a, q4, c, y),
                        (_, false) => avx2::packed_group(a, q4, c, y),
                        (_, true) => avx2::group(a, q4, c, y),
                    }
                }
                c += side_by_side::GROUP;
            }
        }
    }
    crate::packed::unpacked_columns(w, a.rows, c..cols.end, y, &|w, c, y| {
        super::columns(kernel, a, w, c, y)
    })
}

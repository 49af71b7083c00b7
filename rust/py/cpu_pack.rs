//! Packing a matrix as the loader holds it (row layout) into the layouts the CPU decoder's
//! side-by-side kernels read in place (kvpark_cpu_ops::packed, packed_q5, packed_q5_blocks):
//! raw addresses, as in cpu.rs. Private: see kvpark.model.block_packing, which makes the arrays.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvpark_cpu_ops::Q8Packing;

use super::errors::cpu_ops_err;

/// Packs a 4-bit matrix (qs [n, k/2] u8, scale and offset [n, k/32] f32, row layout) into the
/// arrays at `out_*` (the same sizes) in the layout of kvpark_cpu_ops::packed, which the
/// decoder's side-by-side kernels read without transposing. `n` a multiple of 16. Private: see
/// kvpark.model.gguf_blocks.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _cpu_pack_q4(
    py: Python<'_>,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    k: usize,
    out_qs: usize,
    out_scale: usize,
    out_offset: usize,
) -> PyResult<()> {
    if k % kvpark_cpu_ops::BLOCK != 0 || qs == 0 || out_qs == 0 {
        return Err(PyValueError::new_err(format!(
            "cannot pack a [{n}, {k}] matrix"
        )));
    }
    let blocks = n * k / kvpark_cpu_ops::BLOCK;
    // SAFETY: the caller (kvpark.model.gguf_blocks) passes live, C-contiguous arrays of
    // exactly these sizes and dtypes, the outputs fresh ones that overlap no input.
    let (w, out) = unsafe {
        let w = kvpark_cpu_ops::Q4Weights {
            qs: std::slice::from_raw_parts(qs as *const u8, n * k / 2),
            scale: std::slice::from_raw_parts(scale as *const f32, blocks),
            offset: std::slice::from_raw_parts(offset as *const f32, blocks),
            n,
            k,
            packed: false,
        };
        let out = (
            std::slice::from_raw_parts_mut(out_qs as *mut u8, n * k / 2),
            std::slice::from_raw_parts_mut(out_scale as *mut f32, blocks),
            std::slice::from_raw_parts_mut(out_offset as *mut f32, blocks),
        );
        (w, out)
    };
    py.detach(|| kvpark_cpu_ops::pack_q4(w, out.0, out.1, out.2))
        .map_err(cpu_ops_err)
}

/// Packs a q6 matrix (qs [n, k] i8, scale [n, k/16] f32, row layout) into the arrays at
/// `out_*` (compact: `kvpark_cpu_ops::q6_packed_lengths`), as [`_cpu_pack_q4`] does; a
/// ValueError where its quants or scales are not a K-quant's. Private: see
/// kvpark.model.gguf_blocks.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _cpu_pack_q6(
    py: Python<'_>,
    qs: usize,
    scale: usize,
    n: usize,
    k: usize,
    out_qs: usize,
    out_scale: usize,
) -> PyResult<()> {
    if k % kvpark_cpu_ops::BLOCK != 0 || qs == 0 || out_qs == 0 {
        return Err(PyValueError::new_err(format!(
            "cannot pack a [{n}, {k}] matrix"
        )));
    }
    let scales = n * k / kvpark_cpu_ops::Q6_GROUP;
    let (packed_qs, packed_d) = kvpark_cpu_ops::q6_packed_lengths(n, k);
    // SAFETY: as for _cpu_pack_q4.
    let (w, out_qs, out_scale) = unsafe {
        let w = kvpark_cpu_ops::Q6Weights {
            qs: std::slice::from_raw_parts(qs as *const i8, n * k),
            scale: std::slice::from_raw_parts(scale as *const f32, scales),
            n,
            k,
            low: None,
            packed: false,
        };
        (
            w,
            std::slice::from_raw_parts_mut(out_qs as *mut i8, packed_qs),
            std::slice::from_raw_parts_mut(out_scale as *mut f32, packed_d),
        )
    };
    py.detach(|| kvpark_cpu_ops::pack_q6(w, out_qs, out_scale))
        .map_err(cpu_ops_err)
}

/// Packs a Q5_K matrix as the loader holds it (q8 blocks: qs [n, k] i8 in 0..32, scale and
/// offset [n, k/32] f32, row layout) compact into the arrays at `out_*`
/// (`kvpark_cpu_ops::q5_packed_lengths`: the quants and int8 values, the `d` and the `dmin`);
/// a ValueError where it is not a Q5_K's. Private: see kvpark.model.gguf_blocks.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _cpu_pack_q5(
    py: Python<'_>,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    k: usize,
    out_qs: usize,
    out_scale: usize,
    out_offset: usize,
) -> PyResult<()> {
    if k % kvpark_cpu_ops::BLOCK != 0 || qs == 0 || out_qs == 0 || offset == 0 {
        return Err(PyValueError::new_err(format!(
            "cannot pack a [{n}, {k}] matrix"
        )));
    }
    let blocks = n * k / kvpark_cpu_ops::BLOCK;
    let (packed_qs, values) = kvpark_cpu_ops::q5_packed_lengths(n, k);
    // SAFETY: as for _cpu_pack_q4.
    let (w, out) = unsafe {
        let w = kvpark_cpu_ops::Q8Weights {
            qs: std::slice::from_raw_parts(qs as *const i8, n * k),
            scale: std::slice::from_raw_parts(scale as *const f32, blocks),
            offset: Some(std::slice::from_raw_parts(offset as *const f32, blocks)),
            n,
            k,
            low: None,
            packed: Q8Packing::Rows,
        };
        let out = (
            std::slice::from_raw_parts_mut(out_qs as *mut i8, packed_qs),
            std::slice::from_raw_parts_mut(out_scale as *mut f32, values),
            std::slice::from_raw_parts_mut(out_offset as *mut f32, values),
        );
        (w, out)
    };
    py.detach(|| kvpark_cpu_ops::pack_q5(w, out.0, out.1, out.2))
        .map_err(cpu_ops_err)
}

/// Packs a Q5_0 or Q5_1 matrix as the loader holds it (q8 blocks: qs [n, k] i8 in `low..low +
/// 32`, scale and offset [n, k/32] f32 or offset 0 for none, row layout) compact into the
/// arrays at `out_*` (`kvpark_cpu_ops::q5b_packed_lengths`: the quants less `low`, the scales,
/// the offsets where it has them); a ValueError where a quant lies outside that window.
/// Private: see kvpark.model.block_packing.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _cpu_pack_q5_blocks(
    py: Python<'_>,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    k: usize,
    low: i8,
    out_qs: usize,
    out_scale: usize,
    out_offset: usize,
) -> PyResult<()> {
    if k % kvpark_cpu_ops::BLOCK != 0
        || qs == 0
        || out_qs == 0
        || (offset == 0) != (out_offset == 0)
    {
        return Err(PyValueError::new_err(format!(
            "cannot pack a [{n}, {k}] matrix"
        )));
    }
    let blocks = n * k / kvpark_cpu_ops::BLOCK;
    let (packed_qs, values) = kvpark_cpu_ops::q5b_packed_lengths(n, k);
    // SAFETY: as for _cpu_pack_q4.
    let (w, out) = unsafe {
        let w = kvpark_cpu_ops::Q8Weights {
            qs: std::slice::from_raw_parts(qs as *const i8, n * k),
            scale: std::slice::from_raw_parts(scale as *const f32, blocks),
            offset: (offset != 0).then(|| std::slice::from_raw_parts(offset as *const f32, blocks)),
            n,
            k,
            low: Some(low),
            packed: Q8Packing::Rows,
        };
        let out = (
            std::slice::from_raw_parts_mut(out_qs as *mut i8, packed_qs),
            std::slice::from_raw_parts_mut(out_scale as *mut f32, values),
            (out_offset != 0)
                .then(|| std::slice::from_raw_parts_mut(out_offset as *mut f32, values)),
        );
        (w, out)
    };
    py.detach(|| kvpark_cpu_ops::pack_q5_blocks(w, out.0, out.1, out.2))
        .map_err(cpu_ops_err)
}

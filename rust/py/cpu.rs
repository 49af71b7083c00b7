//! kvpark-cpu-ops: block-weight matmuls, paged decode attention and RMSNorm on the CPU.
//!
//! These take raw addresses because the stable ABI of Python 3.10 has no buffer protocol. They
//! are private: their Python wrappers (`kvpark.model.ops.block_weights`, `cpu_attention`, `norm`) check
//! every tensor's dtype, device, contiguity and size before they pass `tensor.data_ptr()` here.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::cpu_ops_err;

/// y[rows, n] = x[rows, k] @ W.T for 4-bit block weights (qs [n, k/2] u8, scale and offset
/// [n, k/32] f32), all C-contiguous CPU memory at the given addresses. Private: see
/// kvpark.model.ops.block_weights, which checks the tensors behind the addresses.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _blockmm_q4(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    // SAFETY: the caller (kvpark.model.ops.block_weights) passes live, contiguous tensors of exactly
    // these sizes and dtypes; `y` does not overlap the inputs.
    let (x, w, y) = unsafe { q4_operands(x, rows, k, qs, scale, offset, n, y) };
    py.detach(|| kvpark_cpu_ops::matmul_q4(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// y[rows, n] = x[rows, k] @ W.T for 8-bit block weights (qs [n, k] i8, scale [n, k/32] f32,
/// offset [n, k/32] f32 or 0 for none: weight = scale * q + offset). Private: see
/// kvpark.model.ops.block_weights.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _blockmm_q8(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4.
    let (x, w, y) = unsafe { q8_operands(x, rows, k, qs, scale, offset, n, y) };
    py.detach(|| kvpark_cpu_ops::matmul_q8(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// _blockmm_q4 through int8 activations (kvpark_cpu_ops::int8: x rounded to int8 per block of
/// 32, integer dot products, the same bits on every CPU path). Private, like _blockmm_q4.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _blockmm_q4_i8(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    if offset == 0 {
        return Err(PyValueError::new_err("4-bit block weights need offsets"));
    }
    // SAFETY: as in _blockmm_q4.
    let (x, w, y) = unsafe { q4_operands(x, rows, k, qs, scale, offset, n, y) };
    py.detach(|| kvpark_cpu_ops::matmul_q4_i8(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// _blockmm_q8 through int8 activations (see _blockmm_q4_i8); offset 0 for none.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _blockmm_q8_i8(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4.
    let (x, w, y) = unsafe { q8_operands(x, rows, k, qs, scale, offset, n, y) };
    py.detach(|| kvpark_cpu_ops::matmul_q8_i8(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// y[rows, n] = x[rows, k] @ W.T for Q6_K weights unpacked (qs [n, k] i8, scale [n, k/16] f32:
/// weight = scale * q, a scale per 16 weights). Private: see kvpark.model.ops.block_weights.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _blockmm_q6(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4.
    let (x, w, y) = unsafe { q6_operands(x, rows, k, qs, scale, n, y) };
    py.detach(|| kvpark_cpu_ops::matmul_q6(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// _blockmm_q6 through int8 activations (see _blockmm_q4_i8).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _blockmm_q6_i8(
    py: Python<'_>,
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    n: usize,
    y: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4.
    let (x, w, y) = unsafe { q6_operands(x, rows, k, qs, scale, n, y) };
    py.detach(|| kvpark_cpu_ops::matmul_q6_i8(x, rows, w, y))
        .map_err(cpu_ops_err)
}

/// The slices of a Q6 product at these addresses.
///
/// # Safety
/// As for [`q4_operands`].
unsafe fn q6_operands<'a>(
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    n: usize,
    y: usize,
) -> (&'a [f32], kvpark_cpu_ops::Q6Weights<'a>, &'a mut [f32]) {
    let w = kvpark_cpu_ops::Q6Weights {
        qs: std::slice::from_raw_parts(qs as *const i8, n * k),
        scale: std::slice::from_raw_parts(scale as *const f32, n * k / kvpark_cpu_ops::Q6_GROUP),
        n,
        k,
        low: None, // one call: not worth a pass over its quants,
        packed: false,
    };
    let x = std::slice::from_raw_parts(x as *const f32, rows * k);
    (
        x,
        w,
        std::slice::from_raw_parts_mut(y as *mut f32, rows * n),
    )
}

/// The slices of a 4-bit product at these addresses.
///
/// # Safety
/// Live, contiguous memory of the sizes the shapes give (see _blockmm_q4); `y` overlaps no input.
#[allow(clippy::too_many_arguments)]
unsafe fn q4_operands<'a>(
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> (&'a [f32], kvpark_cpu_ops::Q4Weights<'a>, &'a mut [f32]) {
    let blocks = n * k / kvpark_cpu_ops::BLOCK;
    let w = kvpark_cpu_ops::Q4Weights {
        qs: std::slice::from_raw_parts(qs as *const u8, n * k / 2),
        scale: std::slice::from_raw_parts(scale as *const f32, blocks),
        offset: std::slice::from_raw_parts(offset as *const f32, blocks),
        n,
        k,
        packed: false,
    };
    let x = std::slice::from_raw_parts(x as *const f32, rows * k);
    (
        x,
        w,
        std::slice::from_raw_parts_mut(y as *mut f32, rows * n),
    )
}

/// The slices of an 8-bit product at these addresses (`offset` 0: none).
///
/// # Safety
/// As for [`q4_operands`].
#[allow(clippy::too_many_arguments)]
unsafe fn q8_operands<'a>(
    x: usize,
    rows: usize,
    k: usize,
    qs: usize,
    scale: usize,
    offset: usize,
    n: usize,
    y: usize,
) -> (&'a [f32], kvpark_cpu_ops::Q8Weights<'a>, &'a mut [f32]) {
    let blocks = n * k / kvpark_cpu_ops::BLOCK;
    let w = kvpark_cpu_ops::Q8Weights {
        qs: std::slice::from_raw_parts(qs as *const i8, n * k),
        scale: std::slice::from_raw_parts(scale as *const f32, blocks),
        offset: (offset != 0).then(|| std::slice::from_raw_parts(offset as *const f32, blocks)),
        n,
        k,
        low: None, // one call: not worth a pass over its quants
        packed: kvpark_cpu_ops::Q8Packing::Rows,
    };
    let x = std::slice::from_raw_parts(x as *const f32, rows * k);
    (
        x,
        w,
        std::slice::from_raw_parts_mut(y as *mut f32, rows * n),
    )
}

/// Decode attention read in place from the paged pool: q [rows, heads, head_dim] f32, k and v
/// [cells, kv_heads, head_dim] of kv_dtype (0 f32, 1 bf16, 2 f16; n_kv_values each), cells
/// [seqs, stride] i64, context and rows [seqs] i64, out like q (only the sequences' rows
/// written). See kvpark.model.ops.cpu_attention (private), which checks the tensors behind the
/// addresses.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub(super) fn _decode_attention(
    py: Python<'_>,
    q: usize,
    n_q_values: usize,
    k: usize,
    v: usize,
    n_kv_values: usize,
    kv_dtype: u8,
    cells: usize,
    seqs: usize,
    stride: usize,
    context: usize,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    out: usize,
) -> PyResult<()> {
    if kv_dtype > 2 {
        return Err(PyValueError::new_err(format!(
            "kv_dtype {kv_dtype}: use 0 (f32), 1 (bf16) or 2 (f16)"
        )));
    }
    // SAFETY: as in _blockmm_q4; `out` does not overlap the inputs.
    let (q, k, v, cells, context, rows, out) = unsafe {
        (
            std::slice::from_raw_parts(q as *const f32, n_q_values),
            kv_values(k, n_kv_values, kv_dtype),
            kv_values(v, n_kv_values, kv_dtype),
            std::slice::from_raw_parts(cells as *const i64, seqs * stride),
            std::slice::from_raw_parts(context as *const i64, seqs),
            std::slice::from_raw_parts(rows as *const i64, seqs),
            std::slice::from_raw_parts_mut(out as *mut f32, n_q_values),
        )
    };
    let a = kvpark_cpu_ops::DecodeAttention {
        q,
        k,
        v,
        cells,
        stride,
        context,
        rows,
        heads,
        kv_heads,
        head_dim,
    };
    py.detach(|| kvpark_cpu_ops::decode_attention(a, out))
        .map_err(cpu_ops_err)
}

/// RMSNorm of rows = n_values / d: x [rows, d] f32, weight [d] f32, out like x. Private: see
/// kvpark.model.ops.norm, which checks the tensors behind the addresses.
#[pyfunction]
pub(super) fn _rms_norm(
    x: usize,
    n_values: usize,
    weight: usize,
    d: usize,
    eps: f32,
    out: usize,
) -> PyResult<()> {
    // SAFETY: as in _blockmm_q4; `out` does not overlap `x` or `weight`.
    let (x, weight, out) = unsafe {
        (
            std::slice::from_raw_parts(x as *const f32, n_values),
            std::slice::from_raw_parts(weight as *const f32, d),
            std::slice::from_raw_parts_mut(out as *mut f32, n_values),
        )
    };
    kvpark_cpu_ops::rms_norm(x, weight, eps, out).map_err(cpu_ops_err)
}

/// How many threads the CPU kernels (block matmuls, decode attention) use (1: the calling
/// thread only).
#[pyfunction]
pub(super) fn _cpu_set_threads(n: usize) {
    kvpark_cpu_ops::set_threads(n);
}

/// The CPU features the kernels see, `(cpu, effective)`: each a dict of flag -> bool plus
/// `"isa"` (plain, avx2 or avx512); `effective` is `cpu` under the cap in `KVPARK_CPU_ISA`.
/// Raises ValueError for a value that variable cannot hold.
#[pyfunction]
pub(super) fn _cpu_features(py: Python<'_>) -> PyResult<(Py<PyDict>, Py<PyDict>)> {
    use kvpark_cpu_ops::isa::{effective, Features, Isa, ISA_VAR};
    if let Ok(text) = std::env::var(ISA_VAR) {
        Isa::parse_cap(&text).map_err(PyValueError::new_err)?;
    }
    let as_dict = |f: Features| -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        d.set_item("isa", f.level().name())?;
        d.set_item("avx2", f.avx2)?;
        d.set_item("fma", f.fma)?;
        d.set_item("avx512f", f.avx512f)?;
        d.set_item("avx512bw", f.avx512bw)?;
        d.set_item("avx512vl", f.avx512vl)?;
        d.set_item("avx512_bf16", f.avx512_bf16)?;
        d.set_item("avx512_vnni", f.avx512_vnni)?;
        Ok(d.unbind())
    };
    Ok((as_dict(Features::detect())?, as_dict(effective())?))
}

/// # Safety
/// `at` is the address of `n` live values of the kind `dtype` names (0 f32, 1 bf16, 2 f16).
unsafe fn kv_values<'a>(at: usize, n: usize, dtype: u8) -> kvpark_cpu_ops::KvValues<'a> {
    use kvpark_cpu_ops::KvValues;
    match dtype {
        0 => KvValues::F32(std::slice::from_raw_parts(at as *const f32, n)),
        1 => KvValues::Bf16(std::slice::from_raw_parts(at as *const u16, n)),
        _ => KvValues::F16(std::slice::from_raw_parts(at as *const u16, n)),
    }
}

//! The pool's K and V values and how the attention kernel reads them: f32 as stored, bf16
//! widened by a shift where each value is used, f16 widened row by row into f32 (F16C's
//! `vcvtph2ps` where the CPU has it, [`f16_to_f32`] otherwise). Every widening is exact, so a
//! 16-bit pool gives the kernel's result on an f32 pool holding the same values, bit for bit,
//! whichever path converts.

/// The pool's K or V values, `[cells, kv_heads, head_dim]`: f32; bf16 (the upper half of an f32's
/// bits); or IEEE f16 (1 sign, 5 exponent, 10 fraction bits), as torch stores them.
#[derive(Clone, Copy, Debug)]
pub enum KvValues<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl KvValues<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            KvValues::F32(x) => x.len(),
            KvValues::Bf16(x) | KvValues::F16(x) => x.len(),
        }
    }

    /// Whether `other` holds values of the same kind.
    pub(super) fn same_kind(&self, other: &KvValues<'_>) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// One value as the kernel's arithmetic reads it, widened to f32 where it is used.
pub(super) trait KvElem: Copy {
    fn widen(self) -> f32;
    /// A row as f32: itself, or widened (exactly) into `buf` once, so that the query heads
    /// sharing a KV head do not widen it again each.
    fn widened<'s>(src: &'s [Self], buf: &'s mut [f32]) -> &'s [f32];
}

impl KvElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[inline(always)]
    fn widened<'s>(src: &'s [f32], _buf: &'s mut [f32]) -> &'s [f32] {
        src
    }
}

/// A bf16 value's bits.
impl KvElem for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[inline(always)]
    fn widened<'s>(src: &'s [u16], buf: &'s mut [f32]) -> &'s [f32] {
        let buf = &mut buf[..src.len()];
        for (o, &x) in buf.iter_mut().zip(src) {
            *o = x.widen();
        }
        buf
    }
}

/// K or V of the pool as the kernel reads it: one cell's row of `head_dim` values at a time.
pub(super) trait Rows: Copy + Sync {
    /// The `len` values from `at`: in place, or widened into `buf` (at least `len` long).
    fn row<'s>(&'s self, at: usize, len: usize, buf: &'s mut [f32]) -> &'s [f32];
    /// The `len` values from `at` widened (or copied) into `dst`: a tile's row, written once.
    fn row_into(&self, at: usize, len: usize, dst: &mut [f32]);
    /// Asks for the cache lines of the `len` values from `at`.
    fn prefetch(&self, at: usize, len: usize);
}

/// f32 or bf16 values: f32 rows read where they lie, bf16 rows widened once into the buffer.
#[derive(Clone, Copy)]
pub(super) struct InPlace<'a, T>(pub &'a [T]);

impl<T: KvElem + Sync> Rows for InPlace<'_, T> {
    #[inline(always)]
    fn row<'s>(&'s self, at: usize, len: usize, buf: &'s mut [f32]) -> &'s [f32] {
        T::widened(&self.0[at..][..len], buf)
    }
    #[inline(always)]
    fn row_into(&self, at: usize, len: usize, dst: &mut [f32]) {
        for (o, &x) in dst[..len].iter_mut().zip(&self.0[at..][..len]) {
            *o = x.widen();
        }
    }
    #[inline(always)]
    fn prefetch(&self, at: usize, len: usize) {
        prefetch_row(self.0, at, len)
    }
}

/// f16 values, each row widened by [`f16_to_f32`].
#[derive(Clone, Copy)]
pub(super) struct F16Plain<'a>(pub &'a [u16]);

impl Rows for F16Plain<'_> {
    #[inline(always)]
    fn row<'s>(&'s self, at: usize, len: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let buf = &mut buf[..len];
        for (o, &h) in buf.iter_mut().zip(&self.0[at..][..len]) {
            *o = f16_to_f32(h);
        }
        buf
    }
    #[inline(always)]
    fn row_into(&self, at: usize, len: usize, dst: &mut [f32]) {
        self.row(at, len, dst);
    }
    #[inline(always)]
    fn prefetch(&self, at: usize, len: usize) {
        prefetch_row(self.0, at, len)
    }
}

/// f16 values, each row widened by F16C. Made only where the CPU has F16C and `KVPARK_CPU_ISA`
/// lets it run ([`F16cRows::new`]).
#[derive(Clone, Copy)]
pub(super) struct F16cRows<'a> {
    values: &'a [u16],
    /// Sixteen values a conversion (AVX-512F) rather than eight: half the conversions and
    /// stores, which were the most of an eight-row decode's attention time after the dots.
    wide: bool,
}

impl<'a> F16cRows<'a> {
    pub(super) fn new(values: &'a [u16]) -> Option<Self> {
        let f = crate::isa::effective();
        let wide = f.level() == crate::isa::Isa::Avx512;
        (cfg!(target_arch = "x86_64") && f.f16c).then_some(F16cRows { values, wide })
    }
}

impl Rows for F16cRows<'_> {
    #[inline(always)]
    fn row<'s>(&'s self, at: usize, len: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let buf = &mut buf[..len];
        let src = &self.values[at..][..len];
        if self.wide {
            // SAFETY: `wide` is set only where the CPU runs AVX-512F (`new`).
            unsafe { widen_f16c_512(src, buf) };
        } else {
            // SAFETY: an F16cRows exists only where the CPU has F16C (`new`).
            unsafe { widen_f16c(src, buf) };
        }
        buf
    }
    #[inline(always)]
    fn row_into(&self, at: usize, len: usize, dst: &mut [f32]) {
        self.row(at, len, dst);
    }
    #[inline(always)]
    fn prefetch(&self, at: usize, len: usize) {
        prefetch_row(self.values, at, len)
    }
}

/// [`widen_f16c`] sixteen values at a time (the same exact conversion, so the same bits).
///
/// # Safety
/// The CPU must have AVX-512F (and so F16C); `dst` is as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx,f16c")]
unsafe fn widen_f16c_512(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm512_cvtph_ps, _mm512_storeu_ps};
    assert_eq!(src.len(), dst.len()); // the stores below rely on it
    let whole = src.len() - src.len() % 16;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..whole).step_by(16) {
        let halves = _mm256_loadu_si256(s.add(i) as *const __m256i);
        _mm512_storeu_ps(d.add(i), _mm512_cvtph_ps(halves));
    }
    widen_f16c(&src[whole..], &mut dst[whole..]);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn widen_f16c_512(src: &[u16], dst: &mut [f32]) {
    widen_f16c(src, dst)
}

/// `dst[i] = src[i]` widened from f16, eight at a time by `vcvtph2ps`, the tail by
/// [`f16_to_f32`] (both exact: the same bits).
///
/// # Safety
/// The CPU must have F16C (and so AVX); `dst` is as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
pub(super) unsafe fn widen_f16c(src: &[u16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    assert_eq!(src.len(), dst.len()); // the stores below rely on it
    let (s8, d8) = (src.chunks_exact(8), dst.chunks_exact_mut(8));
    let (s_tail, d_tail) = (s8.remainder(), d8.into_remainder());
    for (d, &h) in d_tail.iter_mut().zip(s_tail) {
        *d = f16_to_f32(h);
    }
    // by index over raw pointers: the zip of two chunk iterators kept its bookkeeping in the
    // loop (`perf` put more samples on it than on the conversions; 2-3 % of an eight-row
    // decode's attention)
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for i in (0..src.len() - src.len() % 8).step_by(8) {
        let halves = _mm_loadu_si128(s.add(i) as *const __m128i);
        _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(halves));
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn widen_f16c(src: &[u16], dst: &mut [f32]) {
    for (d, &h) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(h);
    }
}

/// An f16's value as an f32 (exact: every f16 is an f32). Subnormals come out normalised,
/// infinities as infinities, and a NaN keeps its sign and payload with the quiet bit set, as
/// `vcvtph2ps` makes it. Without branches, so that a row's loop vectorises.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    const REBIAS: u32 = (127 - 15) << 23;
    let sign = u32::from(h & 0x8000) << 16;
    let mag = u32::from(h & 0x7fff) << 13; // exponent and fraction in an f32's places
    let exp = mag & 0x0f80_0000;
    let bits = if exp == 0x0f80_0000 {
        // infinity or NaN: all exponent bits set, a NaN made quiet
        let quiet = u32::from(mag & 0x007f_e000 != 0) << 22;
        mag | 0x7f80_0000 | quiet
    } else if exp == 0 {
        // zero or subnormal, frac * 2^-24: 2^-14 * 1.frac less 2^-14, an exact subtraction of
        // two normal f32s (whatever the rounding mode, flush-to-zero included)
        let one = f32::from_bits(REBIAS + (1 << 23));
        (f32::from_bits(mag + REBIAS + (1 << 23)) - one).to_bits()
    } else {
        mag + REBIAS
    };
    f32::from_bits(sign | bits)
}

/// Asks for the cache lines of `values[at..at + len]`; a no-op off x86-64.
#[inline(always)]
fn prefetch_row<T>(values: &[T], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let row = &values[at..at + len];
        let per_line = 64 / std::mem::size_of::<T>();
        for line in (0..len).step_by(per_line) {
            // SAFETY: the address lies inside `row`, and a prefetch never faults anyway.
            unsafe { _mm_prefetch(row.as_ptr().add(line) as *const i8, _MM_HINT_T0) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, at, len);
}

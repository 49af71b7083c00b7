//! One layer's K or V cells, written by the step that computes them and read by its attention.

use crate::attention::KvValues;

/// A layer's K (or V) pool, `[cells, kv_heads, head_dim]`, in the pool's dtype.
#[derive(Debug)]
pub enum KvCells<'a> {
    F32(&'a mut [f32]),
    /// bfloat16 as its bits: each value rounded to nearest, ties to even, as torch's
    /// `.to(torch.bfloat16)` does, so a cell holds the bits the torch runner would store.
    Bf16(&'a mut [u16]),
    /// float16 as its bits, rounded to nearest, ties to even (torch's `.to(torch.float16)`).
    F16(&'a mut [u16]),
}

impl KvCells<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            KvCells::F32(x) => x.len(),
            KvCells::Bf16(x) | KvCells::F16(x) => x.len(),
        }
    }

    /// Writes `values` (one cell's `kv_heads * head_dim` values) at cell `cell`.
    pub(crate) fn store(&mut self, cell: usize, values: &[f32]) {
        let w = values.len();
        match self {
            KvCells::F32(x) => x[cell * w..(cell + 1) * w].copy_from_slice(values),
            KvCells::Bf16(x) => {
                for (o, v) in x[cell * w..(cell + 1) * w].iter_mut().zip(values) {
                    *o = bf16_bits(*v);
                }
            }
            KvCells::F16(x) => {
                for (o, v) in x[cell * w..(cell + 1) * w].iter_mut().zip(values) {
                    *o = f16_bits(*v);
                }
            }
        }
    }

    pub(crate) fn values(&self) -> KvValues<'_> {
        match self {
            KvCells::F32(x) => KvValues::F32(x),
            KvCells::Bf16(x) => KvValues::Bf16(x),
            KvCells::F16(x) => KvValues::F16(x),
        }
    }
}

/// `v` rounded to bfloat16 (nearest, ties to even; a NaN stays a quiet NaN).
pub fn bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    if v.is_nan() {
        return ((u >> 16) as u16) | 0x0040;
    }
    let bias = 0x7FFF + ((u >> 16) & 1);
    (u.wrapping_add(bias) >> 16) as u16
}

/// `v` rounded to float16 (nearest, ties to even; overflow to infinity, a NaN to a quiet NaN).
///
/// Normal results: rebias the exponent and round the 13 dropped mantissa bits by adding
/// `0xFFF` plus the kept part's lowest bit (ties go to even), letting a carry run into the
/// exponent. Subnormal results: one f32 addition of `2^-1` lands the value's bits, rounded by the
/// FPU to the f16 subnormal grid (2^-24), in the low mantissa bits.
pub fn f16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let a = bits & 0x7FFF_FFFF;
    let out = if a >= 0x4780_0000 {
        // |v| >= 65536: infinity, or a NaN (kept quiet, payload dropped)
        if a > 0x7F80_0000 {
            0x7E00
        } else {
            0x7C00
        }
    } else if a < 0x3880_0000 {
        // |v| < 2^-14: a subnormal half (or zero); 2^-1 + |v| rounds |v| to a multiple of 2^-24
        let magic = 0.5f32;
        (f32::from_bits(a) + magic)
            .to_bits()
            .wrapping_sub(magic.to_bits()) as u16
    } else {
        let odd = (a >> 13) & 1;
        let rebiased = a.wrapping_sub((127 - 15) << 23);
        let rounded = rebiased + 0xFFF + odd;
        // a carry past 0x7BFF... lands on 0x7C00, infinity, as rounding 65520 and above must
        (rounded >> 13) as u16
    };
    sign | out
}

#[cfg(test)]
mod tests {
    use super::{bf16_bits, f16_bits};

    fn widen(h: u16) -> f64 {
        let (sign, exp, man) = (
            (h >> 15) & 1,
            ((h >> 10) & 0x1F) as i32,
            f64::from(h & 0x3FF),
        );
        let mag = if exp == 0 {
            man * 2f64.powi(-24)
        } else {
            (1.0 + man / 1024.0) * 2f64.powi(exp - 15)
        };
        if sign == 1 {
            -mag
        } else {
            mag
        }
    }

    #[test]
    fn f16_rounds_to_nearest_even_over_every_half() {
        for h in 0u16..0x7C00 {
            let v = widen(h);
            assert_eq!(f16_bits(v as f32), h, "{v} itself");
            assert_eq!(f16_bits(-v as f32), h | 0x8000, "-{v}");
            let next = widen(h + 1); // 0x7C00: the first past the largest finite, 65536
            let mid = (v + next) / 2.0; // exact in f32: one more bit than the half's mantissa
            let even = if h % 2 == 0 { h } else { h + 1 };
            assert_eq!(f16_bits(mid as f32), even, "the tie {mid}");
            let below = f32::from_bits((mid as f32).to_bits() - 1);
            let above = f32::from_bits((mid as f32).to_bits() + 1);
            assert_eq!(f16_bits(below), h, "just below {mid}");
            assert_eq!(f16_bits(above), h + 1, "just above {mid}");
        }
        assert_eq!(f16_bits(f32::INFINITY), 0x7C00);
        assert_eq!(f16_bits(1e9), 0x7C00);
        assert_eq!(f16_bits(-0.0), 0x8000);
        assert_eq!(f16_bits(f32::NAN) & 0x7E00, 0x7E00);
    }

    #[test]
    fn rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3F80);
        // halfway between 0x3F80 and 0x3F81: ties to the even one
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(bf16_bits(-2.5), 0xC020);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
        assert!(f32::from_bits(u32::from(bf16_bits(f32::NAN)) << 16).is_nan());
    }
}

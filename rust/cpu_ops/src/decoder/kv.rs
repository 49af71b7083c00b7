//! One layer's K or V cells, written by the step that computes them and read by its attention.

use crate::KvValues;

/// A layer's K (or V) pool, `[cells, kv_heads, head_dim]`, in the pool's dtype.
#[derive(Debug)]
pub enum KvCells<'a> {
    F32(&'a mut [f32]),
    /// bfloat16 as its bits: each value rounded to nearest, ties to even, as torch's
    /// `.to(torch.bfloat16)` does, so a cell holds the bits the torch runner would store.
    Bf16(&'a mut [u16]),
}

impl KvCells<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            KvCells::F32(x) => x.len(),
            KvCells::Bf16(x) => x.len(),
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
        }
    }

    pub(crate) fn values(&self) -> KvValues<'_> {
        match self {
            KvCells::F32(x) => KvValues::F32(x),
            KvCells::Bf16(x) => KvValues::Bf16(x),
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

#[cfg(test)]
mod tests {
    use super::bf16_bits;

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

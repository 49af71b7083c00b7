//! The embedding lookup: one token's row of the embedding matrix, in whatever form the model
//! holds it.

use crate::dense;
use crate::iq4::IQ4_TABLE;
use crate::weights::{Q8Packing, Weights, BLOCK};

/// Row `r` of a dense matrix widened, or of a block matrix dequantised bitwise as `BlockWeight.dequantize` does it
/// (`q * scale` for 8-bit blocks, `scale * nibble + offset` for 4-bit ones: the product is
/// exact, so the one rounding of an FMA is the one rounding of the sum; `scale * q` for Q6).
pub(super) fn embed_row(w: Weights<'_>, r: usize, out: &mut [f32]) {
    if let Weights::Dense(d) = w {
        return dense::row(d, r, out); // each value widened exactly
    }
    const B: usize = BLOCK;
    let blocks = w.k() / B;
    for (b, o) in out.chunks_exact_mut(B).enumerate() {
        let at = r * blocks + b;
        match w {
            Weights::Q8(w) if w.packed != Q8Packing::Rows => {
                let (qs, s, off) = crate::packed_q5::either_block(&w, r, b);
                for (v, q) in o.iter_mut().zip(qs) {
                    // as the row layout's below (no offset: one product, its zero's sign kept)
                    *v = match w.offset {
                        None => f32::from(q) * s,
                        Some(_) => s.mul_add(f32::from(q), off),
                    };
                }
            }
            Weights::Q8(w) => {
                let (s, off) = (w.scale[at], w.offset.map(|o| o[at]));
                for (v, q) in o.iter_mut().zip(&w.qs[at * B..(at + 1) * B]) {
                    *v = match off {
                        None => f32::from(*q) * s,
                        Some(off) => s.mul_add(f32::from(*q), off),
                    };
                }
            }
            Weights::Q4(w) => {
                let (bytes, s, off) = if w.packed {
                    crate::packed::q4_block(&w, r, b)
                } else {
                    let bytes = w.qs[at * B / 2..(at + 1) * B / 2].try_into();
                    (bytes.expect("16 bytes a block"), w.scale[at], w.offset[at])
                };
                for (i, q) in bytes.iter().enumerate() {
                    o[i] = s.mul_add(f32::from(q & 0x0F), off);
                    o[i + B / 2] = s.mul_add(f32::from(q >> 4), off);
                }
            }
            Weights::Iq4(w) => {
                // as the q8 blocks it equals: `q * scale`
                let s = w.scale[at];
                for (i, q) in w.qs[at * B / 2..(at + 1) * B / 2].iter().enumerate() {
                    o[i] = f32::from(IQ4_TABLE[usize::from(q & 0x0F)]) * s;
                    o[i + B / 2] = f32::from(IQ4_TABLE[usize::from(q >> 4)]) * s;
                }
            }
            Weights::Q6(w) => {
                let (qs, scales) = if w.packed {
                    crate::packed::q6_block(&w, r, b)
                } else {
                    let qs = w.qs[at * B..(at + 1) * B].try_into();
                    let scales = w.scale[2 * at..2 * at + 2].try_into();
                    (qs.expect("32 quants"), scales.expect("2 scales"))
                };
                for (i, (v, q)) in o.iter_mut().zip(qs).enumerate() {
                    *v = scales[i / (B / 2)] * f32::from(q);
                }
            }
            Weights::Dense(_) => unreachable!("looked up above"),
        }
    }
}

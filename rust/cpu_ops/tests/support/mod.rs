//! Random block weights and activations for the int8 tests, with the awkward blocks mixed in.
#![allow(dead_code)] // each test file uses its own part

use kvpark_cpu_ops::{
    narrow_low, pack_q4, pack_q5, pack_q5_blocks, pack_q6, q5_packed_lengths, q5b_packed_lengths,
    q6_packed_lengths, Q4Weights, Q6Weights, Q8Packing, Q8Weights, Weights, BLOCK, Q6_GROUP,
};

pub fn lcg(seed: &mut u64) -> u32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 33) as u32
}

/// Uniform in [-1, 1).
pub fn unit(seed: &mut u64) -> f32 {
    lcg(seed) as f32 / (1u64 << 31) as f32 * 2.0 - 1.0
}

/// A block weight matrix in any block format, owning its arrays.
pub struct Matrix {
    pub kind: Kind,
    pub qs: Vec<u8>,
    pub scale: Vec<f32>,
    pub offset: Option<Vec<f32>>,
    pub n: usize,
    pub k: usize,
    /// The narrow kinds' `Q8Weights::low`.
    pub low: Option<i8>,
    /// In a layout packed at load ([`Matrix::packed`]): `kvpark_cpu_ops::packed`'s for 4-bit and
    /// q6 kinds, `packed_q5`'s for Q5K, `packed_q5_blocks`' for Q5 and Q5Offset.
    pub packed: bool,
}

/// What kind of weights [`matrix`] makes.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// Q4_1: any offset.
    Q4,
    /// Q4_0 as the loader stores it: offset = -8 scale.
    Q4Signed,
    Q8,
    /// Q8 with per-block offsets (a repacked K-quant).
    Q8Offset,
    /// Q6_K unpacked: any int8 quants (Q6_K's are in [-32, 31]), a scale per 16 weights.
    Q6,
    /// Q8 whose quants span 32 values (as Q5_0's, -16..16), at a random place in the i8 range.
    Q5,
    /// The same with offsets (as Q5_1's, 0..32).
    Q5Offset,
    /// Q6 whose quants span 64 values (as Q6_K's, -32..32), at a random place in the i8 range.
    Q6Narrow,
    /// Q6 as the loader makes it from Q6_K (quants in -32..32, int8 scales up to -128) or Q3_K
    /// (-4..4, scales in -32..32): each run of eight blocks' scales an f16-like `d` times int8s,
    /// what `pack_q6` stores compact.
    Q6K,
    /// Q8 with offsets as the loader makes it from Q5_K: quants in 0..32, each run of eight
    /// blocks' scales an f16-like `d` times int8s and offsets a `dmin` times int8s, what
    /// `pack_q5` stores compact.
    Q5K,
}

pub const KINDS: [Kind; 8] = [
    Kind::Q4,
    Kind::Q4Signed,
    Kind::Q8,
    Kind::Q8Offset,
    Kind::Q6,
    Kind::Q5,
    Kind::Q5Offset,
    Kind::Q6Narrow,
];

pub fn matrix(kind: Kind, n: usize, k: usize, seed: &mut u64) -> Matrix {
    let blocks = n * k / BLOCK;
    let q4 = matches!(kind, Kind::Q4 | Kind::Q4Signed);
    let bytes = if q4 { n * k / 2 } else { n * k };
    let q3 = lcg(seed).is_multiple_of(2); // a Q6K matrix from Q3_K
    let span: u32 = match kind {
        Kind::Q5 | Kind::Q5Offset => 32,
        Kind::Q6Narrow => 64,
        Kind::Q6K if q3 => 8,
        Kind::Q6K => 64,
        Kind::Q5K => 32,
        _ => 256,
    };
    // a window of `span` values anywhere in the i8 range, its ends included sometimes
    let least = match lcg(seed) % 4 {
        _ if matches!(kind, Kind::Q6K) => -(span as i32) / 2,
        _ if matches!(kind, Kind::Q5K) => 0,
        0 => -128,
        1 => 128 - span as i32,
        _ => (lcg(seed) % (257 - span)) as i32 - 128,
    };
    let qs: Vec<u8> = (0..bytes)
        .map(|_| (least + (lcg(seed) % span) as i32) as i8 as u8)
        .collect();
    // SAFETY: u8 and i8 have the same size and alignment, and every bit pattern is valid.
    let signed = unsafe { std::slice::from_raw_parts(qs.as_ptr() as *const i8, qs.len()) };
    let low = if span < 256 {
        narrow_low(signed, span as i16)
    } else {
        None
    };
    let scales = if matches!(kind, Kind::Q6 | Kind::Q6Narrow | Kind::Q6K) {
        2 * blocks
    } else {
        blocks
    };
    let mut scale: Vec<f32> = (0..scales).map(|_| unit(seed) / 16.0).collect();
    if let Kind::Q6K | Kind::Q5K = kind {
        // per column and run of eight blocks: d with an 11-bit significand (sometimes 0, either
        // sign), times int8s (Q6_K's extremes -128 and 127 included sometimes)
        let per = if let Kind::Q6K = kind { 2 } else { 1 };
        for run in scale
            .chunks_mut(per * (k / BLOCK))
            .flat_map(|c| c.chunks_mut(8 * per))
        {
            let d = match lcg(seed) % 8 {
                0 => 0.0,
                _ => (lcg(seed) % 2048) as f32 * 2f32.powi(-18 - (lcg(seed) % 8) as i32),
            };
            let d = if lcg(seed).is_multiple_of(2) { d } else { -d };
            for v in run.iter_mut() {
                let sc = match lcg(seed) % 8 {
                    0 => -128,
                    1 => 127,
                    2 => 0,
                    _ if q3 => (lcg(seed) % 64) as i32 - 32,
                    _ => (lcg(seed) % 256) as i32 - 128,
                };
                *v = d * sc as f32; // exact: 11 bits times 8
            }
        }
    }
    let offset = match kind {
        Kind::Q4 | Kind::Q8Offset | Kind::Q5Offset => {
            Some((0..blocks).map(|_| unit(seed)).collect())
        }
        // Q5_K's: -(dmin * m), m in 0..64, a dmin per column and run of eight blocks
        Kind::Q5K => {
            let mut offset = vec![0.0f32; blocks];
            for run in offset.chunks_mut(k / BLOCK).flat_map(|c| c.chunks_mut(8)) {
                let dmin = (lcg(seed) % 2048) as f32 * 2f32.powi(-20 - (lcg(seed) % 4) as i32);
                for v in run.iter_mut() {
                    *v = -(dmin * (lcg(seed) % 64) as f32); // exact: 11 bits times 6
                }
            }
            Some(offset)
        }
        Kind::Q4Signed => Some(scale.iter().map(|s| -8.0 * s).collect()),
        Kind::Q8 | Kind::Q6 | Kind::Q6Narrow | Kind::Q6K | Kind::Q5 => None,
    };
    Matrix {
        kind,
        qs,
        scale,
        offset,
        n,
        k,
        low,
        packed: false,
    }
}

impl Matrix {
    pub fn view(&self) -> Weights<'_> {
        // SAFETY: u8 and i8 have the same size and alignment, and every bit pattern is valid for
        // both.
        let signed =
            unsafe { std::slice::from_raw_parts(self.qs.as_ptr() as *const i8, self.qs.len()) };
        let (n, k) = (self.n, self.k);
        match self.kind {
            Kind::Q4 | Kind::Q4Signed => Weights::Q4(Q4Weights {
                qs: &self.qs,
                scale: &self.scale,
                offset: self.offset.as_deref().expect("Q4 has offsets"),
                n,
                k,
                packed: self.packed,
            }),
            Kind::Q8 | Kind::Q8Offset | Kind::Q5 | Kind::Q5Offset | Kind::Q5K => {
                Weights::Q8(Q8Weights {
                    qs: signed,
                    scale: &self.scale,
                    offset: self.offset.as_deref(),
                    n,
                    k,
                    low: self.low,
                    packed: match self.kind {
                        _ if !self.packed => Q8Packing::Rows,
                        Kind::Q5K => Q8Packing::Q5Super,
                        _ => Q8Packing::Q5Blocks,
                    },
                })
            }
            Kind::Q6 | Kind::Q6Narrow | Kind::Q6K => Weights::Q6(Q6Weights {
                qs: signed,
                scale: &self.scale,
                n,
                k,
                low: self.low,
                packed: self.packed,
            }),
        }
    }

    /// The same matrix packed (`pack_q4`, `pack_q6`, `pack_q5`; Q5 and Q5Offset
    /// `pack_q5_blocks`): its columns a multiple of sixteen.
    pub fn packed(&self) -> Matrix {
        let (mut qs, mut scale) = (vec![0; self.qs.len()], vec![0.0; self.scale.len()]);
        if let Weights::Q6(_) = self.view() {
            let (q, d) = q6_packed_lengths(self.n, self.k);
            (qs, scale) = (vec![0; q], vec![0.0; d]);
        }
        if let (Kind::Q5 | Kind::Q5Offset, Weights::Q8(w)) = (self.kind, self.view()) {
            let (q, values) = q5b_packed_lengths(self.n, self.k);
            let (mut qs, mut scale) = (vec![0u8; q], vec![0.0; values]);
            let mut offset = w.offset.map(|_| vec![0.0; values]);
            // SAFETY: u8 and i8 have the same size and alignment, every bit pattern valid.
            let signed = unsafe { std::slice::from_raw_parts_mut(qs.as_mut_ptr().cast(), q) };
            pack_q5_blocks(w, signed, &mut scale, offset.as_deref_mut()).unwrap();
            return Matrix {
                qs,
                scale,
                offset,
                packed: true,
                ..*self
            };
        }
        if let Weights::Q8(w) = self.view() {
            let (q, d) = q5_packed_lengths(self.n, self.k);
            let (mut qs, mut scale, mut offset) = (vec![0u8; q], vec![0.0; d], vec![0.0; d]);
            // SAFETY: u8 and i8 have the same size and alignment, every bit pattern valid.
            let signed = unsafe { std::slice::from_raw_parts_mut(qs.as_mut_ptr().cast(), q) };
            pack_q5(w, signed, &mut scale, &mut offset).unwrap();
            return Matrix {
                qs,
                scale,
                offset: Some(offset),
                packed: true,
                ..*self
            };
        }
        let offset = match self.view() {
            Weights::Q4(w) => {
                let mut offset = vec![0.0; self.scale.len()];
                pack_q4(w, &mut qs, &mut scale, &mut offset).unwrap();
                Some(offset)
            }
            Weights::Q6(w) => {
                // SAFETY: u8 and i8 have the same size and alignment, every bit pattern valid.
                let signed =
                    unsafe { std::slice::from_raw_parts_mut(qs.as_mut_ptr().cast(), qs.len()) };
                pack_q6(w, signed, &mut scale).unwrap();
                None
            }
            _ => panic!("only 4-bit and q6 matrices are packed"),
        };
        Matrix {
            qs,
            scale,
            offset,
            packed: true,
            ..*self
        }
    }

    /// Whether a block updates its lane twice in the int8 combine (an offset term, or Q6's two
    /// halves).
    pub fn two_updates(&self) -> bool {
        self.offset.is_some() || matches!(self.kind, Kind::Q6 | Kind::Q6Narrow | Kind::Q6K)
    }

    /// Weight `i` of column `c` as `(scale, quant, offset)`: weight = scale * quant + offset.
    pub fn parts(&self, c: usize, i: usize) -> (f64, f64, f64) {
        let at = c * self.k / BLOCK + i / BLOCK;
        let q = match self.kind {
            Kind::Q4 | Kind::Q4Signed => {
                let byte = self.qs[at * 16 + i % 16];
                f64::from(if i % BLOCK < 16 {
                    byte & 0x0f
                } else {
                    byte >> 4
                })
            }
            _ => f64::from(self.qs[c * self.k + i] as i8),
        };
        let o = self.offset.as_ref().map_or(0.0, |o| f64::from(o[at]));
        let s = match self.kind {
            Kind::Q6 | Kind::Q6Narrow | Kind::Q6K => self.scale[(c * self.k + i) / Q6_GROUP],
            _ => self.scale[at],
        };
        (f64::from(s), q, o)
    }
}

/// Activations `[rows, k]`, each block drawn from `styles` kinds (0..`STYLES`): 0 ordinary,
/// 1 all zero, 2 one nonzero, 3 large, 4 tiny, 5 too small to quantise (below 1.5e-36),
/// 6 magnitudes spread over 40 decades, 7 near f32::MAX (products may overflow).
pub fn activations(rows: usize, k: usize, styles: u32, seed: &mut u64) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * k);
    for _ in 0..rows * k / BLOCK {
        let style = lcg(seed) % styles;
        let one = lcg(seed) as usize % BLOCK;
        for i in 0..BLOCK {
            let u = unit(seed);
            x.push(match style {
                0 => u,
                1 => 0.0,
                2 => {
                    if i == one {
                        u * 1e3
                    } else {
                        0.0
                    }
                }
                3 => u * 1e30,
                4 => u * 1e-30,
                5 => u * 1e-37,
                6 => u * 10f32.powi((lcg(seed) % 41) as i32 - 20),
                _ => u * 3e38,
            });
        }
    }
    x
}

pub const STYLES: u32 = 8;
/// The styles whose products stay finite.
pub const FINITE_STYLES: u32 = 7;

/// Equal bits, or both NaN (a NaN's payload is not part of the contract).
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

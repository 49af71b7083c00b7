//! The three dense value formats and how one value widens to f32: f32 as it is, bf16 by a shift
//! (its bits are an f32's upper half), f16 exactly (subnormals, infinities and NaNs included).

use crate::attention::f16_to_f32;

/// A dense value format: the type its values are stored as and their exact f32 value.
pub(crate) trait Format: Copy + Send + Sync + 'static {
    type Raw: Copy + Sync;
    fn widen(raw: Self::Raw) -> f32;
}

/// f32 values.
#[derive(Clone, Copy)]
pub(crate) struct F32;
/// IEEE f16 bits.
#[derive(Clone, Copy)]
pub(crate) struct F16;
/// bf16 bits.
#[derive(Clone, Copy)]
pub(crate) struct Bf16;

impl Format for F32 {
    type Raw = f32;
    #[inline(always)]
    fn widen(raw: f32) -> f32 {
        raw
    }
}

impl Format for F16 {
    type Raw = u16;
    #[inline(always)]
    fn widen(raw: u16) -> f32 {
        f16_to_f32(raw)
    }
}

impl Format for Bf16 {
    type Raw = u16;
    #[inline(always)]
    fn widen(raw: u16) -> f32 {
        f32::from_bits(u32::from(raw) << 16)
    }
}

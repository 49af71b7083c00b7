//! Which instruction set the kernels run: what the CPU has, narrowed by `KVPARK_CPU_ISA`.
//!
//! Detected at run time, never at build time (`target-cpu=native` would tie the wheel to the
//! machine that built it). The variable lets a developer on one CPU family run, test and time
//! the code another family gets: `avx2` caps an AVX-512 machine at the AVX2 path, `plain` turns
//! every SIMD path off. A cap wider than the CPU has is no cap: the CPU's own set is used.

use std::sync::OnceLock;

/// The environment variable that caps the instruction set (`auto`, `avx512`, `avx2`, `plain`).
pub const ISA_VAR: &str = "KVPARK_CPU_ISA";

/// Instruction-set levels, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust, no intrinsics.
    Plain,
    /// AVX2 and FMA.
    Avx2,
    /// AVX-512 (F, BW, VL) on top of AVX2.
    Avx512,
}

impl Isa {
    /// The variable's spelling of this level.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Plain => "plain",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Parses a value of [`ISA_VAR`]; `auto` (or empty) is no cap.
    pub fn parse_cap(text: &str) -> Result<Option<Isa>, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(None),
            "avx512" => Ok(Some(Isa::Avx512)),
            "avx2" => Ok(Some(Isa::Avx2)),
            "plain" => Ok(Some(Isa::Plain)),
            other => Err(format!(
                "{ISA_VAR}={other:?}: use auto, avx512, avx2 or plain"
            )),
        }
    }
}

/// The CPU features the kernels and kvpark's defaults care about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub avx2: bool,
    pub fma: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512_bf16: bool,
    pub avx512_vnni: bool,
    /// F16C's f16 -> f32 conversions (float16 KV cells), with the OS saving AVX registers.
    pub f16c: bool,
}

impl Features {
    /// What this CPU has, whatever the cap.
    pub fn detect() -> Features {
        #[cfg(target_arch = "x86_64")]
        {
            Features {
                avx2: is_x86_feature_detected!("avx2"),
                fma: is_x86_feature_detected!("fma"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512bw: is_x86_feature_detected!("avx512bw"),
                avx512vl: is_x86_feature_detected!("avx512vl"),
                avx512_bf16: is_x86_feature_detected!("avx512bf16"),
                avx512_vnni: is_x86_feature_detected!("avx512vnni"),
                // std reports F16C from CPUID alone; its 256-bit form needs AVX state saved too
                f16c: is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Features::default()
        }
    }

    /// The widest level these features allow.
    pub fn level(&self) -> Isa {
        if self.avx2 && self.fma && self.avx512f && self.avx512bw && self.avx512vl {
            Isa::Avx512
        } else if self.avx2 && self.fma {
            Isa::Avx2
        } else {
            Isa::Plain
        }
    }

    /// These features with everything above `cap` turned off.
    pub fn capped(self, cap: Isa) -> Features {
        let mut f = self;
        if cap < Isa::Avx512 {
            f.avx512f = false;
            f.avx512bw = false;
            f.avx512vl = false;
            f.avx512_bf16 = false;
            f.avx512_vnni = false;
        }
        if cap < Isa::Avx2 {
            f.avx2 = false;
            f.fma = false;
            f.f16c = false;
        }
        f
    }
}

/// What the kernels use: the CPU's features under the cap in [`ISA_VAR`] (read once; a value the
/// variable cannot hold counts as no cap here: the Python side refuses it at start-up).
pub fn effective() -> Features {
    static EFFECTIVE: OnceLock<Features> = OnceLock::new();
    *EFFECTIVE.get_or_init(|| {
        let cap = std::env::var(ISA_VAR)
            .ok()
            .and_then(|v| Isa::parse_cap(&v).ok().flatten());
        let cpu = Features::detect();
        cap.map_or(cpu, |c| cpu.capped(c))
    })
}

/// Whether the AVX2 and FMA paths may run.
pub fn avx2() -> bool {
    effective().level() >= Isa::Avx2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_only_narrows() {
        let all = Features {
            avx2: true,
            fma: true,
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            avx512_bf16: true,
            avx512_vnni: true,
            f16c: true,
        };
        assert_eq!(all.level(), Isa::Avx512);
        assert!(all.capped(Isa::Avx2).f16c && !all.capped(Isa::Plain).f16c);
        assert_eq!(all.capped(Isa::Avx2).level(), Isa::Avx2);
        assert!(!all.capped(Isa::Avx2).avx512_bf16);
        assert_eq!(all.capped(Isa::Plain).level(), Isa::Plain);
        let avx2_only = all.capped(Isa::Avx2);
        assert_eq!(avx2_only.capped(Isa::Avx512), avx2_only);
    }

    #[test]
    fn the_variable_parses() {
        assert_eq!(Isa::parse_cap("auto"), Ok(None));
        assert_eq!(Isa::parse_cap(" AVX2 "), Ok(Some(Isa::Avx2)));
        assert_eq!(Isa::parse_cap("plain"), Ok(Some(Isa::Plain)));
        assert!(Isa::parse_cap("sse").is_err());
    }
}

use std::sync::OnceLock;

/// The instruction set the kernels run with, chosen once at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F, BW and VL (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and later).
    Avx512,
    /// AVX2 with FMA and F16C (Haswell, Zen and later).
    Avx2,
    /// Plain Rust, vectorised by the compiler for the baseline target.
    Portable,
}

impl Isa {
    /// The best set this CPU has, or the one named by `EMBER_CPU_ISA` (`avx512`, `avx2`,
    /// `portable`) when the CPU has it: a way to test and compare the slower paths.
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let best = Self::available()[0];
            match std::env::var("EMBER_CPU_ISA")
                .ok()
                .and_then(|name| Self::from_name(&name))
            {
                Some(wanted) if Self::available().contains(&wanted) => wanted,
                _ => best,
            }
        })
    }

    /// Every set this CPU can run, best first.
    pub fn available() -> Vec<Isa> {
        let mut sets = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                sets.push(Isa::Avx512);
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                sets.push(Isa::Avx2);
            }
        }
        sets.push(Isa::Portable);
        sets
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "avx512" => Some(Isa::Avx512),
            "avx2" => Some(Isa::Avx2),
            "portable" | "scalar" => Some(Isa::Portable),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

//! Rotary position embedding tables.

use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::config::{Llama3RopeScaling, ModelConfig};
use crate::error::Result;

/// cos and sin of every (position, frequency) pair, computed once for the whole context, as
/// transformers computes them and as llama.cpp does (the f16-cache path imitates llama.cpp).
pub struct RopeTable {
    cos: Buffer,
    sin: Buffer,
    ggml_cos: Buffer,
    ggml_sin: Buffer,
    pub positions: usize,
}

impl RopeTable {
    pub fn new(config: &ModelConfig, positions: usize, owner: &BufferOwner) -> Result<Self> {
        let inv_freq = inverse_frequencies(config);
        let half = inv_freq.len();
        let mut cos = owner.alloc(BufferKind::Scratch, "rope cos", positions * half * 4)?;
        let mut sin = owner.alloc(BufferKind::Scratch, "rope sin", positions * half * 4)?;
        {
            let (c, s) = (cos.as_mut_slice::<f32>(), sin.as_mut_slice::<f32>());
            for pos in 0..positions {
                for (i, &f) in inv_freq.iter().enumerate() {
                    // The angle is an f32 product, as transformers computes it.
                    let angle = (pos as f32 * f) as f64;
                    c[pos * half + i] = angle.cos() as f32;
                    s[pos * half + i] = angle.sin() as f32;
                }
            }
        }
        let mut ggml_cos = owner.alloc(BufferKind::Scratch, "rope cos", positions * half * 4)?;
        let mut ggml_sin = owner.alloc(BufferKind::Scratch, "rope sin", positions * half * 4)?;
        {
            let (c, s) = (
                ggml_cos.as_mut_slice::<f32>(),
                ggml_sin.as_mut_slice::<f32>(),
            );
            for pos in 0..positions {
                ggml_angles(config, pos, |i, cos, sin| {
                    c[pos * half + i] = cos;
                    s[pos * half + i] = sin;
                });
            }
        }
        Ok(RopeTable {
            cos,
            sin,
            ggml_cos,
            ggml_sin,
            positions,
        })
    }

    /// cos and sin as transformers computes them, or (`ggml`) as llama.cpp does.
    pub fn tables(&self, ggml: bool) -> (&[f32], &[f32]) {
        if ggml {
            (self.ggml_cos.as_slice(), self.ggml_sin.as_slice())
        } else {
            (self.cos.as_slice(), self.sin.as_slice())
        }
    }
}

/// cos and sin of position `pos`'s angles as llama.cpp's `ggml_rope_cache_init` computes them:
/// `theta_scale = powf(base, -2/d)`, the angle of pair `i` by `i` f32 multiplications of the
/// position by it, and libm's `cosf`/`sinf` (which Rust's f32 methods call). Llama 3 scaling
/// (per-frequency factors in GGUF) is not supported by GGUF loading, so it is not applied.
fn ggml_angles(config: &ModelConfig, pos: usize, mut put: impl FnMut(usize, f32, f32)) {
    let d = config.head_dim;
    let theta_scale = (config.rope_theta as f32).powf(-2.0 / d as f32);
    let mut theta = pos as f32;
    for i in 0..d / 2 {
        put(i, theta.cos(), theta.sin());
        theta *= theta_scale;
    }
}

/// `1 / theta^(2i/d)` for `i < d/2`, with Llama 3 scaling applied when configured.
pub fn inverse_frequencies(config: &ModelConfig) -> Vec<f32> {
    let d = config.head_dim;
    (0..d / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / d as f32;
            let f = 1.0 / (config.rope_theta as f32).powf(exponent) as f64;
            match &config.rope_scaling {
                Some(s) => llama3_scale(f, s) as f32,
                None => f as f32,
            }
        })
        .collect()
}

/// Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
fn llama3_scale(inv_freq: f64, s: &Llama3RopeScaling) -> f64 {
    let low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
    if wavelen < high_freq_wavelen {
        inv_freq
    } else if wavelen > low_freq_wavelen {
        inv_freq / s.factor
    } else {
        let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}

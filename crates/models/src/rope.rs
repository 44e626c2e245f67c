//! Rotary position embedding tables.

use ember_tensor::{Buffer, BufferKind, BufferOwner};

use crate::config::{Llama3RopeScaling, ModelConfig};
use crate::error::Result;

/// cos and sin of every (position, frequency) pair, computed once for the whole context.
pub struct RopeTable {
    cos: Buffer,
    sin: Buffer,
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
        Ok(RopeTable {
            cos,
            sin,
            positions,
        })
    }

    pub fn cos(&self) -> &[f32] {
        self.cos.as_slice()
    }

    pub fn sin(&self) -> &[f32] {
        self.sin.as_slice()
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

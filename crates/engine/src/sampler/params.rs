//! A request's sampling settings and their checks.

/// Per-request sampling settings. The default is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus sampling mass; 1 = off.
    pub top_p: f32,
    /// Drop tokens with p < min_p * p_max; 0 = off.
    pub min_p: f32,
    /// Fixed seed for reproducible draws; `None` seeds from entropy.
    pub seed: Option<u64>,
    /// Penalties on tokens already seen, applied to the logits before any of the above
    /// (greedy picks included).
    pub penalties: Penalties,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            penalties: Penalties::default(),
        }
    }
}

/// Penalties on repeating tokens (the default: none).
///
/// For each token `t` seen `c > 0` times: `logit /= repetition` when positive, else `logit *=
/// repetition` (CTRL's, as transformers, vLLM and llama.cpp apply it); then `logit -=
/// presence + c · frequency` (OpenAI's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Penalties {
    /// 1 = off; above 1 discourages repeats.
    pub repetition: f32,
    /// 0 = off; in [-2, 2].
    pub presence: f32,
    /// 0 = off; in [-2, 2].
    pub frequency: f32,
    /// Which tokens count. `None`, as OpenAI and vLLM count them: presence and frequency over
    /// the reply, repetition over the prompt and the reply. `Some(n)`, as llama.cpp's
    /// `repeat_last_n`: all three over the last `n` tokens of prompt and reply (0 = off).
    pub last_n: Option<usize>,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties::NONE
    }
}

impl Penalties {
    pub const NONE: Penalties = Penalties {
        repetition: 1.0,
        presence: 0.0,
        frequency: 0.0,
        last_n: None,
    };

    /// Whether any logit can change.
    pub fn any(&self) -> bool {
        self.last_n != Some(0)
            && (self.repetition != 1.0 || self.presence != 0.0 || self.frequency != 0.0)
    }
}

/// An out-of-range sampling parameter; names the field.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    MinP(f32),
    #[error("repetition_penalty must be a finite number > 0, got {0}")]
    RepetitionPenalty(f32),
    #[error("presence_penalty must be in [-2, 2], got {0}")]
    PresencePenalty(f32),
    #[error("frequency_penalty must be in [-2, 2], got {0}")]
    FrequencyPenalty(f32),
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), SamplingError> {
        // Written so that NaN fails every check.
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(SamplingError::MinP(self.min_p));
        }
        let p = &self.penalties;
        if !(p.repetition.is_finite() && p.repetition > 0.0) {
            return Err(SamplingError::RepetitionPenalty(p.repetition));
        }
        if !(-2.0..=2.0).contains(&p.presence) {
            return Err(SamplingError::PresencePenalty(p.presence));
        }
        if !(-2.0..=2.0).contains(&p.frequency) {
            return Err(SamplingError::FrequencyPenalty(p.frequency));
        }
        Ok(())
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        // A NaN temperature (unvalidated params) also goes to argmax.
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }
}

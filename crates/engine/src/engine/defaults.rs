//! The sampling a request gets for the parameters it leaves out: what the model's authors
//! ship (a Hugging Face checkpoint's `generation_config.json`, as vLLM takes it), llama-server's
//! defaults for a GGUF file (which carries none), or the OpenAI API's own (temperature 1,
//! nothing cut) when a checkpoint names none.

use std::fmt;
use std::path::Path;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::sampler::{Penalties, SamplingParams};

/// Where a model's sampling defaults came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultsSource {
    /// The checkpoint's `generation_config.json` named some of them.
    GenerationConfig,
    /// A GGUF model: llama-server's defaults.
    LlamaServer,
    /// The OpenAI API's: temperature 1, no top-k, top-p or min-p.
    OpenAi,
}

impl fmt::Display for DefaultsSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DefaultsSource::GenerationConfig => "the checkpoint's generation_config.json",
            DefaultsSource::LlamaServer => "llama-server's defaults for a GGUF model",
            DefaultsSource::OpenAi => "the OpenAI API's defaults",
        })
    }
}

/// The sampling a request gets for what it leaves out, and where it came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub params: SamplingParams,
    pub source: DefaultsSource,
}

/// The OpenAI API's defaults: temperature 1, nothing cut.
pub const OPENAI_DEFAULTS: SamplingParams = SamplingParams {
    temperature: 1.0,
    top_k: 0,
    top_p: 1.0,
    min_p: 0.0,
    seed: None,
    penalties: Penalties::NONE,
};

/// llama-server's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
pub const LLAMA_SERVER_DEFAULTS: SamplingParams = SamplingParams {
    temperature: 0.8,
    top_k: 40,
    top_p: 0.95,
    min_p: 0.05,
    seed: None,
    penalties: Penalties::NONE,
};

/// The defaults of the model at `path`: a GGUF file (`gguf`) gets llama-server's; a checkpoint
/// directory its `generation_config.json`'s `temperature`, `top_k`, `top_p`, `min_p` and
/// `repetition_penalty` over
/// the OpenAI API's (`do_sample: false` meaning greedy), where the file names any.
pub(super) fn sampling_defaults(dir: &Path, gguf: bool) -> Result<SamplingDefaults> {
    if gguf {
        return Ok(SamplingDefaults {
            params: LLAMA_SERVER_DEFAULTS,
            source: DefaultsSource::LlamaServer,
        });
    }
    let path = dir.join("generation_config.json");
    let openai = SamplingDefaults {
        params: OPENAI_DEFAULTS,
        source: DefaultsSource::OpenAi,
    };
    if !path.exists() {
        return Ok(openai);
    }
    let text = std::fs::read_to_string(&path)?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::GenerationConfig(format!("{}: {e}", path.display())))?;
    let Some(params) = from_generation_config(&value) else {
        return Ok(openai);
    };
    params
        .validate()
        .map_err(|e| Error::GenerationConfig(format!("{}: {e}", path.display())))?;
    Ok(SamplingDefaults {
        params,
        source: DefaultsSource::GenerationConfig,
    })
}

/// The sampling a `generation_config.json` asks for, or `None` when it names none of it.
fn from_generation_config(value: &Value) -> Option<SamplingParams> {
    let number = |name: &str| value.get(name).and_then(Value::as_f64);
    let mut params = OPENAI_DEFAULTS;
    let mut named = false;
    if let Some(t) = number("temperature") {
        params.temperature = t as f32;
        named = true;
    }
    if let Some(k) = value.get("top_k").and_then(Value::as_i64) {
        params.top_k = usize::try_from(k).unwrap_or(0);
        named = true;
    }
    if let Some(p) = number("top_p") {
        params.top_p = p as f32;
        named = true;
    }
    if let Some(p) = number("min_p") {
        params.min_p = p as f32;
        named = true;
    }
    // As vLLM takes it: over the prompt and the reply.
    if let Some(p) = number("repetition_penalty") {
        params.penalties.repetition = p as f32;
        named = true;
    }
    // transformers samples only with `do_sample`; without it a generation is greedy.
    if value.get("do_sample").and_then(Value::as_bool) == Some(false) {
        params.temperature = 0.0;
        named = true;
    }
    named.then_some(params)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn generation_config_fields_override_the_openai_defaults() {
        let qwen3 = json!({"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95});
        let p = from_generation_config(&qwen3).unwrap();
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.min_p),
            (0.6, 20, 0.95, 0.0)
        );
        let greedy = json!({"do_sample": false, "temperature": 0.7});
        assert_eq!(from_generation_config(&greedy).unwrap().temperature, 0.0);
        let qwen25 = json!({"repetition_penalty": 1.05, "temperature": 0.7});
        assert_eq!(
            from_generation_config(&qwen25)
                .unwrap()
                .penalties
                .repetition,
            1.05
        );
        let top_p_only = json!({"top_p": 0.9, "eos_token_id": [1, 2]});
        let p = from_generation_config(&top_p_only).unwrap();
        assert_eq!((p.temperature, p.top_p), (1.0, 0.9));
        // Token ids only: nothing about sampling.
        assert_eq!(from_generation_config(&json!({"eos_token_id": 2})), None);
    }

    #[test]
    fn a_gguf_model_gets_llama_servers_defaults_and_a_bare_checkpoint_openais() {
        let d = sampling_defaults(Path::new("/nonexistent"), true).unwrap();
        assert_eq!(d.source, DefaultsSource::LlamaServer);
        assert_eq!(d.params, LLAMA_SERVER_DEFAULTS);
        let d = sampling_defaults(Path::new("/nonexistent"), false).unwrap();
        assert_eq!(
            (d.source, d.params),
            (DefaultsSource::OpenAi, OPENAI_DEFAULTS)
        );
    }
}

//! Checkpoint layouts beyond one aligned file: sharded, misaligned, and F16.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::Scratch;
use ember_engine::{Engine, EngineOptions};
use ember_tensor::BufferKind;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name)
}

/// A copy of a fixture without its weights file, and the weights it had.
fn copy_without_weights(name: &str, tag: &str) -> (Scratch, Tensors) {
    let src = fixture(name);
    let dst = Scratch::new(&format!("format-{tag}"), "");
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "model.safetensors" {
            std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes)
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    (dst, tensors)
}

fn write(path: &Path, tensors: &Tensors) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn load(dir: &Path) -> Engine {
    Engine::load(
        dir,
        &EngineOptions {
            threads: Some(2),
            context: Some(128),
            prefill_chunk: Some(16),
            kv_dtype: None,
            ..EngineOptions::default()
        },
    )
    .unwrap()
}

/// Logits after each of several tokens of a prompt, for comparing two loads of one model.
fn trace(engine: &mut Engine) -> Vec<Vec<f32>> {
    let prompt = engine.encode_prompt("The quick brown fox jumps").unwrap();
    let mut out = vec![engine.prefill(&prompt).unwrap().to_vec()];
    for token in [5u32, 17, 42] {
        out.push(engine.step(token).unwrap().to_vec());
    }
    out
}

#[test]
fn sharded_checkpoint_gives_the_same_bits() {
    let (dir, tensors) = copy_without_weights("qwen3moe-f32", "shards");
    let names: Vec<&String> = tensors.keys().collect();
    let (mut first, mut second) = (Tensors::new(), Tensors::new());
    for (i, (name, tensor)) in tensors.iter().enumerate() {
        let shard = if i % 2 == 0 { &mut first } else { &mut second };
        shard.insert(name.clone(), tensor.clone());
    }
    write(&dir.join("model-00001-of-00002.safetensors"), &first);
    write(&dir.join("model-00002-of-00002.safetensors"), &second);
    let weight_map: serde_json::Map<String, Value> = names
        .iter()
        .map(|n| {
            let file = if first.contains_key(*n) {
                "model-00001-of-00002.safetensors"
            } else {
                "model-00002-of-00002.safetensors"
            };
            ((*n).clone(), json!(file))
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();

    let mut sharded = load(&dir);
    assert_eq!(
        sharded
            .buffers()
            .iter()
            .filter(|b| b.kind == BufferKind::Weights)
            .count(),
        2,
        "both shards mapped"
    );
    let mut single = load(&fixture("qwen3moe-f32"));
    assert_eq!(trace(&mut sharded), trace(&mut single));
}

#[test]
fn misaligned_tensors_are_copied_and_give_the_same_bits() {
    let (dir, tensors) = copy_without_weights("qwen3-bf16", "misaligned");
    // Hand-written file whose data section starts at an odd offset: every bf16 tensor in it
    // is misaligned for its element type.
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, (dtype, shape, bytes)) in &tensors {
        let dtype_name = format!("{dtype:?}");
        header.insert(name.clone(), json!({"dtype": dtype_name, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}));
        data.extend_from_slice(bytes);
    }
    let mut header_text = Value::Object(header).to_string();
    if (8 + header_text.len()).is_multiple_of(2) {
        header_text.push(' ');
    }
    let mut file = (header_text.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header_text.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();

    let mut misaligned = load(&dir);
    let repacked: usize = misaligned
        .buffers()
        .iter()
        .filter(|b| b.kind == BufferKind::Repacked && b.label.contains("realigned"))
        .count();
    assert!(
        repacked > 0,
        "misaligned matrices are copied into listed buffers"
    );
    let mut aligned = load(&fixture("qwen3-bf16"));
    assert_eq!(trace(&mut misaligned), trace(&mut aligned));
}

#[test]
fn f16_checkpoint_tracks_the_f32_reference() {
    let (dir, tensors) = copy_without_weights("qwen3-f32", "f16");
    let converted: Tensors = tensors
        .into_iter()
        .map(|(name, (_, shape, bytes))| {
            let halves: Vec<u8> = bytes
                .chunks_exact(4)
                .flat_map(|b| {
                    half::f16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes()
                })
                .collect();
            (name, (Dtype::F16, shape, halves))
        })
        .collect();
    write(&dir.join("model.safetensors"), &converted);
    let config = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"float32\"", "\"float16\"");
    std::fs::write(dir.join("config.json"), config).unwrap();

    // Rounding the weights to f16 (11-bit significand) moves these small models' log-probs by
    // a few thousandths; 0.02 leaves room while still catching a wrong conversion, which
    // would move them by whole units.
    let mut f16 = load(&dir);
    let mut f32 = load(&fixture("qwen3-f32"));
    for (a, b) in trace(&mut f16).iter().zip(trace(&mut f32)) {
        let (la, lb) = (log_softmax(a), log_softmax(&b));
        let worst = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 0.02, "f16 log-probs differ from f32 by {worst}");
    }
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    logits.iter().map(|&l| l - max - sum.ln() as f32).collect()
}

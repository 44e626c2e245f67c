//! A checkpoint ember cannot serve fails at load with one message naming the file and the
//! tensor or field at fault, never a panic.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{Scratch, assert_names, load_error};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const TENSOR: &str = "model.layers.1.self_attn.k_proj.weight";

/// A fresh copy of the qwen3-f32 golden fixture that a test may break.
fn copy_fixture(tag: &str) -> Scratch {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen3-f32");
    let dst = Scratch::new(&format!("bad-{tag}"), "");
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    dst
}

/// Rewrites model.safetensors, letting `edit` change the tensor list.
fn rewrite_weights(
    dir: &Path,
    edit: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, (dtype, shape, data))| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

#[test]
fn missing_directory() {
    let msg = load_error(Path::new("/nonexistent/ember-model"));
    assert_names(
        &msg,
        &["/nonexistent/ember-model", "no such model directory"],
    );
}

#[test]
fn unknown_architecture() {
    let dir = copy_fixture("arch");
    let config = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("Qwen3ForCausalLM", "MambaForCausalLM");
    std::fs::write(dir.join("config.json"), config).unwrap();
    assert_names(
        &load_error(&dir),
        &["config.json", "MambaForCausalLM", "Qwen3ForCausalLM"],
    );
}

#[test]
fn bad_json_config() {
    let dir = copy_fixture("json");
    std::fs::write(
        dir.join("config.json"),
        "{\"architectures\": [\"Qwen3ForCausalLM\"], ",
    )
    .unwrap();
    assert_names(&load_error(&dir), &["config.json", "invalid JSON"]);
}

#[test]
fn wrong_field_type() {
    let dir = copy_fixture("field");
    let config = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"hidden_size\": 64", "\"hidden_size\": \"64\"");
    std::fs::write(dir.join("config.json"), config).unwrap();
    assert_names(&load_error(&dir), &["config.json", "hidden_size"]);
}

#[test]
fn missing_tensor() {
    let dir = copy_fixture("missing");
    rewrite_weights(&dir, |t| {
        t.remove(TENSOR);
    });
    assert_names(&load_error(&dir), &["model.safetensors", TENSOR, "missing"]);
}

#[test]
fn wrong_shape() {
    let dir = copy_fixture("shape");
    rewrite_weights(&dir, |t| {
        let entry = t.get_mut(TENSOR).unwrap();
        entry.1 = vec![entry.1[0] / 2, entry.1[1] * 2];
    });
    assert_names(&load_error(&dir), &["model.safetensors", TENSOR, "shape"]);
}

#[test]
fn unsupported_dtype() {
    let dir = copy_fixture("dtype");
    rewrite_weights(&dir, |t| t.get_mut(TENSOR).unwrap().0 = Dtype::I32);
    assert_names(&load_error(&dir), &["model.safetensors", TENSOR, "I32"]);
}

#[test]
fn truncated_weights() {
    let dir = copy_fixture("truncated");
    let path = dir.join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    assert_names(&load_error(&dir), &["model.safetensors", "truncated"]);
}

#[test]
fn missing_tokenizer() {
    let dir = copy_fixture("tokenizer");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert_names(&load_error(&dir), &["tokenizer.json"]);
}

#[test]
fn missing_weights_file() {
    let dir = copy_fixture("weights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert_names(&load_error(&dir), &["model.safetensors"]);
}

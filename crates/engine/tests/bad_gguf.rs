//! A GGUF file ember cannot serve fails at load with a message naming the file and what is
//! unsupported (architecture, tensor type) or broken (magic, truncation).

mod common;

use common::{Scratch, assert_names, load_error};

/// A minimal GGUF v3 writer: string/u32 metadata and one tensor description.
struct Gguf {
    metadata: Vec<(String, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

impl Gguf {
    fn new(arch: &str) -> Self {
        let mut g = Gguf {
            metadata: Vec::new(),
            tensors: Vec::new(),
        };
        g.str("general.architecture", arch);
        g.u32(&format!("{arch}.embedding_length"), 32);
        g.u32(&format!("{arch}.block_count"), 1);
        g.u32(&format!("{arch}.attention.head_count"), 4);
        g.u32(&format!("{arch}.feed_forward_length"), 64);
        g.u32(&format!("{arch}.vocab_size"), 8);
        g
    }

    fn str(&mut self, key: &str, value: &str) {
        let mut v = 8u32.to_le_bytes().to_vec();
        v.extend(string(value));
        self.metadata.push((key.into(), v));
    }

    fn strings(&mut self, key: &str, values: &[&str]) {
        let mut v = 9u32.to_le_bytes().to_vec();
        v.extend_from_slice(&8u32.to_le_bytes());
        v.extend_from_slice(&(values.len() as u64).to_le_bytes());
        for value in values {
            v.extend(string(value));
        }
        self.metadata.push((key.into(), v));
    }

    fn u32(&mut self, key: &str, value: u32) {
        let mut v = 4u32.to_le_bytes().to_vec();
        v.extend_from_slice(&value.to_le_bytes());
        self.metadata.push((key.into(), v));
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            out.extend(string(key));
            out.extend_from_slice(value);
        }
        let mut offset = 0u64;
        for (name, dims, kind, data) in &self.tensors {
            out.extend(string(name));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&kind.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += data.len().div_ceil(32) as u64 * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        for (_, _, _, data) in &self.tensors {
            out.extend_from_slice(data);
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
        }
        out
    }

    fn write(&self, tag: &str) -> Scratch {
        let path = Scratch::new(&format!("bad-{tag}"), ".gguf");
        std::fs::write(&path, self.bytes()).unwrap();
        path
    }
}

#[test]
fn unsupported_architecture() {
    let path = Gguf::new("mamba").write("arch");
    assert_names(
        &load_error(&path),
        &[".gguf", "mamba", "general.architecture"],
    );
}

#[test]
fn unsupported_tensor_type() {
    let mut g = Gguf::new("llama");
    g.str("tokenizer.ggml.model", "gpt2");
    g.strings(
        "tokenizer.ggml.tokens",
        &["a", "b", "c", "d", "e", "f", "g", "h"],
    );
    // Q5_0 (ggml type 6): 32 elements in 22 bytes.
    g.tensors
        .push(("token_embd.weight".into(), vec![32, 8], 6, vec![0; 8 * 22]));
    let message = load_error(&g.write("type"));
    assert_names(&message, &[".gguf", "token_embd.weight", "Q5_0"]);
}

#[test]
fn not_gguf_and_truncated() {
    let path = Scratch::new("bad-magic", ".gguf");
    std::fs::write(&path, b"GGML not really").unwrap();
    assert_names(&load_error(&path), &[".gguf", "GGUF"]);

    let mut g = Gguf::new("llama");
    g.tensors.push((
        "token_embd.weight".into(),
        vec![32, 8],
        0,
        vec![0; 32 * 8 * 4],
    ));
    let mut bytes = g.bytes();
    bytes.truncate(bytes.len() - 100);
    let path = Scratch::new("bad-truncated", ".gguf");
    std::fs::write(&path, bytes).unwrap();
    assert_names(
        &load_error(&path),
        &[".gguf", "token_embd.weight", "truncated"],
    );
}

//! Op-by-op comparison of ember's CPU kernels with llama.cpp's, on llama.cpp's own inputs.
//!
//! `cargo run --release -p ember-engine --example llamacpp_ops -- MODEL DUMP_DIR STEPS`
//!
//! `DUMP_DIR` is written by `scripts/llamacpp_dump` (llama.cpp's every graph node of a prompt
//! and `STEPS - 1` greedy decode steps). For each layer and op this feeds llama.cpp's input
//! tensor to ember's kernel and prints the largest difference from llama.cpp's output, with
//! how many elements differ at all: an op that imitates llama.cpp's arithmetic exactly shows 0.
//! Then ember's own forward pass runs the same tokens and its logits are compared.
//! `VERBOSE=1` prints every layer's line; `ROWS=Qcur-0 NROWS=5` splits one result's count of
//! differing elements by row (`NROWS` rows).

use std::path::{Path, PathBuf};

use ember_tensor::ThreadPool;
use ember_tensor::cpu::{self, AttentionShape, KvSlice, MatRef, PagedKv};

fn read(dir: &Path, name: &str) -> Vec<f32> {
    let path = dir.join(format!("{name}.f32"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// (max abs diff, elements that differ, max abs of the reference).
fn diff(ours: &[f32], theirs: &[f32]) -> (f32, usize, f32) {
    assert_eq!(ours.len(), theirs.len(), "length");
    let mut max = 0f32;
    let mut n = 0;
    let mut amax = 0f32;
    for (a, b) in ours.iter().zip(theirs) {
        let d = (a - b).abs();
        if a.to_bits() != b.to_bits() {
            n += 1;
        }
        max = max.max(d);
        amax = amax.max(b.abs());
    }
    (max, n, amax)
}

/// The dump's `index.txt`: file stems in graph order, with each node's name and op.
struct Index(Vec<(String, String, String)>);

impl Index {
    fn read(dir: &Path) -> Index {
        let text = std::fs::read_to_string(dir.join("index.txt")).expect("index.txt");
        Index(
            text.lines()
                .filter(|l| !l.contains(" skipped "))
                .map(|l| {
                    let path = l.split(' ').next().unwrap();
                    let stem = Path::new(path).file_stem().unwrap().to_string_lossy();
                    let op = l.rsplit(' ').next().unwrap().to_string();
                    let name = l[path.len() + 1..].split(" f32 ").next().unwrap();
                    let name = name.split(" f16 ").next().unwrap().to_string();
                    (stem.to_string(), name, op)
                })
                .collect(),
        )
    }

    /// The stem of the node named `name` computed by `op`.
    fn stem(&self, name: &str, op: &str) -> String {
        self.0
            .iter()
            .find(|(_, n, o)| n == name && o == op)
            .unwrap_or_else(|| panic!("no {op} node named {name}"))
            .0
            .clone()
    }

    /// The stem of the node after the one named `name`.
    fn after(&self, name: &str) -> String {
        let at = self.0.iter().position(|(_, n, _)| n == name).unwrap();
        self.0[at + 1].0.clone()
    }
}

struct Report {
    rows: Vec<(String, f32, usize, usize, f32)>,
}

impl Report {
    /// Rows of a result: 5 per prompt token in the first step's dumps, else 1.
    fn row_len(&self, len: usize) -> usize {
        let rows = std::env::var("NROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        len / rows
    }

    fn add(&mut self, name: &str, ours: &[f32], theirs: &[f32]) {
        let (d, n, amax) = diff(ours, theirs);
        if let Some(want) = std::env::var_os("ROWS")
            && want.to_string_lossy() == name
        {
            let rows = ours.len() / self.row_len(ours.len());
            for (r, (a, b)) in ours
                .chunks(ours.len() / rows)
                .zip(theirs.chunks(ours.len() / rows))
                .enumerate()
            {
                let n = a
                    .iter()
                    .zip(b)
                    .filter(|(x, y)| x.to_bits() != y.to_bits())
                    .count();
                println!("   {name} row {r}: {n}/{} differ", a.len());
            }
        }
        self.rows.push((name.to_string(), d, n, theirs.len(), amax));
    }
}

fn matmul(pool: &ThreadPool, x: &[f32], m: usize, w: &MatRef<'_>) -> Vec<f32> {
    let mut y = vec![0f32; m * w.rows];
    let mut scratch = vec![0f32; cpu::matmul_scratch_len(pool.n_threads(), m, w.cols)];
    cpu::matmul(pool, x, m, w, &mut y, &mut scratch);
    y
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = PathBuf::from(&args[1]);
    let dump = PathBuf::from(&args[2]);
    let steps: usize = args.get(3).map_or(1, |s| s.parse().unwrap());
    let verbose = std::env::var_os("VERBOSE").is_some();
    let options = ember_engine::EngineOptions {
        threads: Some(2),
        context: Some(512),
        prefill_chunk: Some(512),
        ..Default::default()
    };
    let mut engine = ember_engine::Engine::load(&model, &options).expect("loading");
    let pool = ThreadPool::new(2);
    // The model's weights, loaded a second time on a CPU backend of this tool's own, so its
    // kernels can be called one by one.
    let owner = ember_tensor::BufferOwner::new();
    let gguf = ember_checkpoint::GgufFile::open(&model, &owner).expect("opening the GGUF");
    let config = ember_models::ModelConfig::from_gguf(&gguf).expect("the GGUF's config");
    let backend = ember_models::CpuBackend::new(
        &config,
        ThreadPool::new(1),
        &owner,
        1,
        512,
        1,
        ember_models::Arithmetic::LlamaCpp,
    )
    .expect("a CPU backend");
    let model_weights =
        ember_models::Transformer::load(&backend, config, &gguf, 512).expect("loading weights");
    let t = &model_weights;
    let c = t.config.clone();
    let (hidden, hd) = (c.hidden_size, c.head_dim);
    let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let eps = c.rms_norm_eps;
    let mut keys: Vec<Vec<u16>> = vec![Vec::new(); c.num_hidden_layers];
    let mut values: Vec<Vec<u16>> = vec![Vec::new(); c.num_hidden_layers];
    let mut tokens_per_step = Vec::new();
    let mut pos0 = 0;
    for step in 0..steps {
        let dir = dump.join(step.to_string());
        let embd = read(&dir, "embd");
        let n = embd.len() / hidden;
        tokens_per_step.push(n);
        let mut r = Report { rows: Vec::new() };
        let index = Index::read(&dir);
        for (i, layer) in t.layers.iter().enumerate() {
            let input = if i == 0 {
                embd.clone()
            } else {
                read(&dir, &format!("l_out-{}", i - 1))
            };
            let m = input.len() / hidden;
            let mut h = vec![0f32; input.len()];
            cpu::rms_norm(&pool, &input, layer.input_norm.as_slice(), eps, &mut h);
            r.add(
                &format!("attn_norm-{i}"),
                &h,
                &read(&dir, &format!("attn_norm-{i}")),
            );
            let a = &layer.attention;
            let attn_norm = read(&dir, &format!("attn_norm-{i}"));
            // Projections (and biases, added as ggml_add does) against llama.cpp's results.
            let mut proj = |name: &str, lin_w: &MatRef<'_>, bias: Option<&[f32]>| {
                let mut y = matmul(&pool, &attn_norm, m, lin_w);
                r.add(
                    &format!("{name}-{i}"),
                    &y,
                    &read(&dir, &index.stem(&format!("{name}-{i}"), "MUL_MAT")),
                );
                if let Some(b) = bias {
                    let before = read(&dir, &index.stem(&format!("{name}-{i}"), "MUL_MAT"));
                    y = before;
                    cpu::add_bias(&mut y, b);
                    r.add(
                        &format!("{name}bias-{i}"),
                        &y,
                        &read(&dir, &index.stem(&format!("{name}-{i}"), "ADD")),
                    );
                }
                read(
                    &dir,
                    &index.stem(
                        &format!("{name}-{i}"),
                        if bias.is_some() { "ADD" } else { "MUL_MAT" },
                    ),
                )
            };
            let q_in = proj(
                "Qcur",
                &a.q.weight.as_mat(),
                a.q.bias.as_ref().map(|b| b.as_slice()),
            );
            let k_in = proj(
                "Kcur",
                &a.k.weight.as_mat(),
                a.k.bias.as_ref().map(|b| b.as_slice()),
            );
            let vcur = proj(
                "Vcur",
                &a.v.weight.as_mat(),
                a.v.bias.as_ref().map(|b| b.as_slice()),
            );
            let qr_ref = read(&dir, &index.stem(&format!("Qcur-{i}"), "ROPE"));
            let kr_ref = read(&dir, &index.stem(&format!("Kcur-{i}"), "ROPE"));
            let (cos, sin) = rope_tables(&c, pos0 + n);
            let tables = cpu::RopeTables {
                cos: &cos,
                sin: &sin,
                layout: if c.rope_interleaved {
                    cpu::RopeLayout::Pairs
                } else {
                    cpu::RopeLayout::Halves
                },
                fused: true,
            };
            let mut qr = q_in.clone();
            cpu::rope_in_place(&pool, &mut qr, nh, hd, pos0, tables);
            r.add(&format!("Qrope-{i}"), &qr, &qr_ref);
            let mut kr = k_in.clone();
            cpu::rope_in_place(&pool, &mut kr, nkv, hd, pos0, tables);
            r.add(&format!("Krope-{i}"), &kr, &kr_ref);
            // Attention over the f16 cache built from llama.cpp's keys and values.
            keys[i].extend(kr_ref.iter().map(|&x| half::f16::from_f32(x).to_bits()));
            values[i].extend(vcur.iter().map(|&x| half::f16::from_f32(x).to_bits()));
            let mut out = vec![0f32; m * nh * hd];
            let shape = AttentionShape {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            let mut scratch = vec![0f32; cpu::attention_scratch_len(2, pos0 + n, shape)];
            cpu::causal_attention(
                &pool,
                &qr_ref,
                PagedKv::contiguous(KvSlice::F16(&keys[i]), KvSlice::F16(&values[i]), nkv * hd),
                pos0,
                n,
                shape,
                1.0 / (hd as f32).sqrt(),
                &mut out,
                &mut scratch,
            );
            r.add(
                &format!("kqv_out-{i}"),
                &out,
                &read(&dir, &format!("kqv_out-{i}")),
            );
            let kqv_out = read(&dir, &format!("kqv_out-{i}"));
            let o = matmul(&pool, &kqv_out, n, &a.o.weight.as_mat());
            let attn_out_name = index.after(&format!("kqv_out-{i}"));
            r.add(&format!("attn_out-{i}"), &o, &read(&dir, &attn_out_name));
            // The last layer keeps only the rows that produce logits.
            let ffn_inp_ref = read(&dir, &format!("ffn_inp-{i}"));
            let m = ffn_inp_ref.len() / hidden;
            let attn_out = read(&dir, &attn_out_name);
            let mut ffn_inp = input[(n - m) * hidden..].to_vec();
            cpu::add_assign(&mut ffn_inp, &attn_out[(n - m) * hidden..]);
            r.add(&format!("ffn_inp-{i}"), &ffn_inp, &ffn_inp_ref);
            let mut h = vec![0f32; ffn_inp_ref.len()];
            cpu::rms_norm(
                &pool,
                &ffn_inp_ref,
                layer.post_attention_norm.as_slice(),
                eps,
                &mut h,
            );
            r.add(
                &format!("ffn_norm-{i}"),
                &h,
                &read(&dir, &format!("ffn_norm-{i}")),
            );
            let ffn_norm = read(&dir, &format!("ffn_norm-{i}"));
            let mlp = layer.feed_forward.dense().expect("a dense MLP");
            let gate = matmul(&pool, &ffn_norm, m, &mlp.gate.weight.as_mat());
            r.add(
                &format!("ffn_gate-{i}"),
                &gate,
                &read(&dir, &format!("ffn_gate-{i}")),
            );
            let up = matmul(&pool, &ffn_norm, m, &mlp.up.weight.as_mat());
            r.add(
                &format!("ffn_up-{i}"),
                &up,
                &read(&dir, &format!("ffn_up-{i}")),
            );
            let mut g = read(&dir, &format!("ffn_gate-{i}"));
            cpu::silu_mul(&pool, &mut g, &read(&dir, &format!("ffn_up-{i}")));
            r.add(
                &format!("ffn_swiglu-{i}"),
                &g,
                &read(&dir, &format!("ffn_swiglu-{i}")),
            );
            let swiglu = read(&dir, &format!("ffn_swiglu-{i}"));
            let down = matmul(&pool, &swiglu, m, &mlp.down.weight.as_mat());
            r.add(
                &format!("ffn_out-{i}"),
                &down,
                &read(&dir, &format!("ffn_out-{i}")),
            );
            let mut l_out = ffn_inp_ref.clone();
            cpu::add_assign(&mut l_out, &read(&dir, &format!("ffn_out-{i}")));
            r.add(
                &format!("l_out-{i}"),
                &l_out,
                &read(&dir, &format!("l_out-{i}")),
            );
        }
        let last = read(&dir, &format!("l_out-{}", c.num_hidden_layers - 1));
        let mut h = vec![0f32; last.len()];
        cpu::rms_norm(&pool, &last, t.norm.as_slice(), eps, &mut h);
        r.add("result_norm", &h, &read(&dir, "result_norm"));
        let logits = matmul(&pool, &read(&dir, "result_norm"), 1, &t.lm_head().as_mat());
        r.add("result_output", &logits, &read(&dir, "result_output"));

        println!("== step {step} ({n} tokens at {pos0})");
        // Summaries per op kind: worst layer.
        let mut kinds: Vec<String> = Vec::new();
        for row in &r.rows {
            let kind = row.0.split('-').next().unwrap().to_string();
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
        for kind in &kinds {
            let rows: Vec<_> = r
                .rows
                .iter()
                .filter(|row| row.0.split('-').next().unwrap() == kind)
                .collect();
            let worst = rows
                .iter()
                .max_by(|a, b| (a.1 / a.4.max(1e-30)).total_cmp(&(b.1 / b.4.max(1e-30))))
                .unwrap();
            let differing: usize = rows.iter().map(|r| r.2).sum();
            let total: usize = rows.iter().map(|r| r.3).sum();
            println!(
                "{kind:>14}: {differing:>7}/{total:<8} elements differ; worst {} max|d| {:.3e} (max|ref| {:.3e})",
                worst.0, worst.1, worst.4
            );
        }
        if verbose {
            for row in &r.rows {
                println!(
                    "   {:>16} max|d| {:.3e} differ {}/{} max|ref| {:.3e}",
                    row.0, row.1, row.2, row.3, row.4
                );
            }
        }
        pos0 += n;
    }

    // ember's own forward over the same tokens: logits against llama.cpp's.
    let ids = read_token_ids(&dump);
    let mut at = 0;
    for (step, &n) in tokens_per_step.iter().enumerate() {
        let dir = dump.join(step.to_string());
        let ours = if step == 0 {
            engine.prefill(&ids[..n]).expect("prefill").to_vec()
        } else {
            engine.step(ids[at]).expect("step").to_vec()
        };
        at += n;
        let theirs = read(&dir, "logits");
        let (d, _, _) = diff(&ours, &theirs);
        let top = |l: &[f32]| {
            let mut idx: Vec<usize> = (0..l.len()).collect();
            idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
            (idx[0], l[idx[0]], idx[1], l[idx[1]])
        };
        println!(
            "step {step}: ember top {:?}, llama.cpp top {:?}, max|d| over logits {d:e}",
            top(&ours),
            top(&theirs)
        );
    }
}

/// Token ids of each step: the prompt's from `ids.txt`, then each step's greedy choice.
fn read_token_ids(dump: &Path) -> Vec<u32> {
    std::fs::read_to_string(dump.join("ids.txt"))
        .expect("ids.txt")
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

/// ember's llama.cpp-style rotary tables (rope.rs `ggml_angles`, not public).
fn rope_tables(c: &ember_models::ModelConfig, positions: usize) -> (Vec<f32>, Vec<f32>) {
    let d = c.head_dim;
    let theta_scale = (c.rope_theta as f32).powf(-2.0 / d as f32);
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for pos in 0..positions {
        let mut theta = pos as f32;
        for _ in 0..d / 2 {
            cos.push(theta.cos());
            sin.push(theta.sin());
            theta *= theta_scale;
        }
    }
    (cos, sin)
}

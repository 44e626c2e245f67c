//! What the CUDA kernels reach on this machine's GPU, against its own ceilings.
//!
//! `cargo run --release -p ember-tensor --example cuda_probe`
//!
//! Prints the device, the device-to-device copy bandwidth (bytes read plus written), decode
//! matvec bandwidth per weight type and shape as a share of that copy rate, a bf16 decode
//! layer's four fused products at the qwen3-0.6b and qwen3-8b shapes, flash-decoding
//! attention bandwidth, and cuBLASLt GEMM TFLOP/s: medians of several timed runs after a
//! warm-up. Weights rotate over enough copies to pass ~1 GiB per run, so the 60 MB L2 cannot
//! serve them.
//!
//! `cuda_probe products [BATCHES…]`: the batch-invariant GEMM's tiles against cuBLASLt.
//! `cuda_probe collectives`: tensor parallelism's all-reduce (NCCL's all-gather and the sums
//! in rank order) among every GPU of the machine, µs a call by message size.

use std::process::ExitCode;

use ember_tensor::cpu::AttentionShape;
use ember_tensor::cuda::{
    self, CudaDevice, CudaError, DevMat, DeviceBuffer, DeviceElem, Epilogue, Float, Gemm,
    MatvecNorm, MatvecOutput, SlicedGemm, matvec_bytes,
};
use ember_tensor::{BufferKind, BufferOwner};
use half::{bf16, f16};

const REPEATS: usize = 9;
/// Bytes of weights one timed run sweeps at least.
const SWEEP_BYTES: usize = 1 << 30;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_probe: {e}");
            ExitCode::FAILURE
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median milliseconds of `work` over [`REPEATS`] runs, after one warm-up run.
fn time(
    device: &CudaDevice,
    mut work: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    work()?;
    let mut ms = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        ms.push(device.time_ms(&mut work)? as f64);
    }
    Ok(median(ms))
}

struct Probe {
    device: CudaDevice,
    owner: BufferOwner,
    seed: u64,
}

impl Probe {
    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer, CudaError> {
        self.owner
            .alloc_device(BufferKind::Scratch, "probe", &self.device, bytes)
    }

    /// A buffer of `n` random values in [-1, 1), as `T`.
    fn random<T: DeviceElem>(
        &mut self,
        n: usize,
        convert: impl Fn(f32) -> T,
    ) -> Result<DeviceBuffer, CudaError> {
        let data: Vec<T> = (0..n)
            .map(|_| {
                self.seed = self
                    .seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                convert(((self.seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
            })
            .collect();
        let mut buf = self.alloc(n * size_of::<T>())?;
        buf.upload(&data)?;
        Ok(buf)
    }

    /// `first` and as many copies of it as pass [`SWEEP_BYTES`] (at least two in all), so
    /// a run over them all reads each from HBM, never from L2.
    fn sweep(&self, first: DeviceBuffer) -> Result<Vec<DeviceBuffer>, CudaError> {
        let bytes = first.len();
        let copies = SWEEP_BYTES.div_ceil(bytes).max(2);
        let mut all = vec![first];
        for _ in 1..copies {
            let mut w = self.alloc(bytes)?;
            self.device
                .copy(all[0].as_slice::<u8>(), &mut w.as_mut_slice::<u8>())?;
            all.push(w);
        }
        Ok(all)
    }

    fn copy_bandwidth(&self) -> Result<f64, CudaError> {
        let bytes = 2usize << 30;
        let src = self.alloc(bytes)?;
        let mut dst = self.alloc(bytes)?;
        self.device.fill_bytes(&mut dst.as_mut_slice::<u8>(), 1)?;
        let ms = time(&self.device, || {
            self.device
                .copy(src.as_slice::<u8>(), &mut dst.as_mut_slice::<u8>())
        })?;
        Ok(2.0 * bytes as f64 / ms / 1e6)
    }

    /// GB/s of `batch`-row matvecs over `rows × cols` weights of `dtype`.
    fn matvec(
        &mut self,
        dtype: Float,
        rows: usize,
        cols: usize,
        batch: usize,
    ) -> Result<f64, CudaError> {
        let first = match dtype {
            Float::F32 => self.random(rows * cols, |x| x)?,
            Float::Bf16 => self.random(rows * cols, bf16::from_f32)?,
            Float::F16 => self.random(rows * cols, f16::from_f32)?,
        };
        let weights = self.sweep(first)?;
        let copies = weights.len();
        let x = self.random(batch * cols, |v| v)?;
        let mut y = self.alloc(batch * rows * 4)?;
        let ms = time(&self.device, || {
            for w in &weights {
                let ty = match dtype {
                    Float::F32 => ember_tensor::DType::F32,
                    Float::Bf16 => ember_tensor::DType::BF16,
                    Float::F16 => ember_tensor::DType::F16,
                };
                let mat = DevMat::new(ty, w.as_slice::<u8>(), rows, cols)?;
                cuda::matvec(
                    &self.device,
                    &mat,
                    x.as_slice(),
                    batch,
                    &mut y.as_mut_slice(),
                    false,
                )?;
            }
            Ok(())
        })?;
        let bytes = copies * matvec_bytes(dtype, rows, cols, batch);
        Ok(bytes as f64 / ms / 1e6)
    }

    /// Microseconds per launch of each of a bf16 decode layer's four products as the model
    /// fuses them (q/k/v with the input norm, o into the residual, gate/up with the norm and
    /// SwiGLU, down into the residual), each launched back to back over as many layers' weights
    /// as pass [`SWEEP_BYTES`], and of the four in a layer's order (attention left out); with
    /// the bytes each moves.
    fn layer_products(
        &mut self,
        shape: &LayerShape,
    ) -> Result<Vec<(&'static str, f64, usize)>, CudaError> {
        let LayerShape {
            hidden,
            q_rows,
            kv_rows,
            inter,
            ..
        } = *shape;
        // (rows, cols) of q, k, v, o, gate, up, down.
        let mats = [
            (q_rows, hidden),
            (kv_rows, hidden),
            (kv_rows, hidden),
            (hidden, q_rows),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
        ];
        let layer_bytes: usize = mats.iter().map(|(r, c)| r * c * 2).sum();
        let layers = SWEEP_BYTES.div_ceil(layer_bytes).max(2);
        // Random weights for the first layer, copies of them for the rest.
        let mut weights: Vec<Vec<DeviceBuffer>> = Vec::with_capacity(layers);
        for l in 0..layers {
            let mut layer = Vec::with_capacity(mats.len());
            for (i, &(rows, cols)) in mats.iter().enumerate() {
                if l == 0 {
                    layer.push(self.random(rows * cols, bf16::from_f32)?);
                    continue;
                }
                let mut w = self.alloc(rows * cols * 2)?;
                self.device
                    .copy(weights[0][i].as_slice::<u8>(), &mut w.as_mut_slice::<u8>())?;
                layer.push(w);
            }
            weights.push(layer);
        }
        let x = self.random(q_rows.max(inter).max(hidden), |v| v * 0.1)?;
        let norm = self.random(hidden, |v| 1.0 + 0.1 * v)?;
        // An output per matrix (o and down would share the residual in a model).
        let mut ys = Vec::with_capacity(mats.len());
        for &(rows, _) in &mats {
            ys.push(self.alloc(rows * 4)?);
        }
        let device = self.device.clone();
        let product = |layer: &[DeviceBuffer], ys: &mut [DeviceBuffer], p: usize| {
            let (_, which, with_norm, epilogue) = LAYER_PRODUCTS[p];
            let ws = which
                .iter()
                .map(|&i| {
                    let (rows, cols) = mats[i];
                    DevMat::new(
                        ember_tensor::DType::BF16,
                        layer[i].as_slice::<u8>(),
                        rows,
                        cols,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            let mut outs: Vec<_> = ys
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| which.contains(i))
                .zip(&ws)
                .map(|((_, y), w)| MatvecOutput {
                    w,
                    bias: None,
                    y: y.as_mut_slice(),
                })
                .collect();
            let norm = with_norm.then(|| MatvecNorm {
                weight: norm.as_slice(),
                eps: 1e-6,
            });
            let x = x.as_slice().slice(0..ws[0].cols);
            cuda::matvec_fused(&device, &mut outs, x, 1, norm, epilogue)
        };
        let mut results = Vec::new();
        for (p, &(name, which, ..)) in LAYER_PRODUCTS.iter().enumerate() {
            let ms = time(&self.device, || {
                for layer in &weights {
                    product(layer, &mut ys, p)?;
                }
                Ok(())
            })?;
            let bytes = which.iter().map(|&i| mats[i].0 * mats[i].1 * 2).sum();
            results.push((name, ms * 1e3 / layers as f64, bytes));
        }
        let ms = time(&self.device, || {
            for layer in &weights {
                for p in 0..LAYER_PRODUCTS.len() {
                    product(layer, &mut ys, p)?;
                }
            }
            Ok(())
        })?;
        results.push(("the four in order", ms * 1e3 / layers as f64, layer_bytes));
        Ok(results)
    }

    /// Microseconds a product `[m, k] · W[n, k]ᵀ` of bf16 takes (into f32), each run over
    /// enough copies of W to pass [`SWEEP_BYTES`] so L2 cannot serve them: by `product`.
    fn product_us(
        &mut self,
        m: usize,
        n: usize,
        k: usize,
        mut product: impl FnMut(
            cuda::DevSlice<'_, bf16>,
            &DevMat<'_>,
            &mut cuda::DevSliceMut<'_, f32>,
        ) -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        let first = self.random(n * k, bf16::from_f32)?;
        let weights = self.sweep(first)?;
        let copies = weights.len();
        let a = self.random(m * k, bf16::from_f32)?;
        let mut out = self.alloc(m * n * 4)?;
        let ms = time(&self.device, || {
            for w in &weights {
                let mat = DevMat::from_slice(w.as_slice::<bf16>(), n, k)?;
                product(a.as_slice::<bf16>(), &mat, &mut out.as_mut_slice::<f32>())?;
            }
            Ok(())
        })?;
        Ok(ms * 1e3 / copies as f64)
    }

    fn gemm(
        &mut self,
        gemm: &Gemm,
        m: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<f64, CudaError> {
        let a = self.random(m * k, bf16::from_f32)?;
        let w = self.random(n * k, bf16::from_f32)?;
        let mat = DevMat::from_slice(w.as_slice::<bf16>(), n, k)?;
        let mut out = self.alloc(m * n * if f32_out { 4 } else { 2 })?;
        let ms = time(&self.device, || {
            if f32_out {
                gemm.matmul(
                    a.as_slice::<bf16>(),
                    &mat,
                    &mut out.as_mut_slice::<f32>(),
                    false,
                )
            } else {
                gemm.matmul(
                    a.as_slice::<bf16>(),
                    &mat,
                    &mut out.as_mut_slice::<bf16>(),
                    false,
                )
            }
        })?;
        Ok(2.0 * (m * n * k) as f64 / ms / 1e9)
    }

    /// A KV pool of `layers` layers' caches of `positions`, laid out as the model's (blocks of
    /// [`POOL_BLOCK`] positions, every layer's keys and values of a block together, random
    /// values), and a table listing its blocks in order.
    fn pool<T: DeviceElem>(
        &mut self,
        layers: usize,
        positions: usize,
        kv_row: usize,
        from_f32: fn(f32) -> T,
    ) -> Result<ProbePool, CudaError> {
        let blocks = positions.div_ceil(POOL_BLOCK);
        let pool = self.random(blocks * layers * 2 * POOL_BLOCK * kv_row, from_f32)?;
        let mut table = self.alloc(blocks * 4)?;
        let ids: Vec<i32> = (0..blocks as i32).collect();
        table.upload(&ids)?;
        Ok(ProbePool {
            pool,
            table,
            layers,
            kv_row,
        })
    }

    /// GB/s of one decode step's attention over a bf16 cache of `context` positions, and µs:
    /// launched back to back over as many layers' caches as make 256 MiB (each its own, as in
    /// a model, so that short contexts are not read from L2), at least 8 launches. `precision`
    /// picks the kernel: f32 products or the tensor cores.
    fn attention(
        &mut self,
        shape: AttentionShape,
        context: usize,
        precision: cuda::AttentionPrecision,
    ) -> Result<(f64, f64), CudaError> {
        let kv_row = shape.n_kv_heads * shape.head_dim;
        let kv = context * kv_row;
        let layers = ((256 << 20) / (2 * kv * 2)).clamp(1, 64);
        let launches = layers.max(8);
        let pool = self.pool(layers, context, kv_row, bf16::from_f32)?;
        let q = self.random(shape.n_heads * shape.head_dim, |x| x)?;
        let mut scratch = self.alloc(cuda::attention_decode_scratch_len(shape) * 4)?;
        cuda::attention_decode_scratch_reset(&self.device, shape, &mut scratch.as_mut_slice())?;
        let mut out = self.alloc(shape.n_heads * shape.head_dim * 4)?;
        let ms = time(&self.device, || {
            for i in 0..launches {
                cuda::attention_decode(
                    &self.device,
                    q.as_slice(),
                    pool.cache::<bf16>(i % layers),
                    cuda::Position::Host(context),
                    shape,
                    0.088,
                    precision,
                    &mut scratch.as_mut_slice(),
                    &mut out.as_mut_slice(),
                )?;
            }
            Ok(())
        })? / launches as f64;
        Ok((2.0 * kv as f64 * 2.0 / ms / 1e6, ms * 1e3))
    }

    /// TFLOP/s and µs of a prompt chunk's causal attention: `n` queries after `pos0` cached
    /// positions, over a cache of `kv` type; the FLOPs counted are those the causal mask
    /// leaves (two products of 2·head_dim each per query and key it sees).
    fn prompt_attention<T: cuda::FloatElem>(
        &mut self,
        shape: AttentionShape,
        pos0: usize,
        n: usize,
        from_f32: fn(f32) -> T,
        precision: cuda::AttentionPrecision,
    ) -> Result<(f64, f64), CudaError> {
        let kv_row = shape.n_kv_heads * shape.head_dim;
        let pool = self.pool(1, pos0 + n, kv_row, from_f32)?;
        let q = self.random(n * shape.n_heads * shape.head_dim, |x| x)?;
        let mut out = self.alloc(n * shape.n_heads * shape.head_dim * 4)?;
        let mut scratch = self.alloc(cuda::attention_prefill_scratch_len(shape) * 4)?;
        let ms = time(&self.device, || {
            cuda::attention_prefill(
                &self.device,
                q.as_slice(),
                pool.cache::<T>(0),
                pos0,
                n,
                shape,
                0.088,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
        })?;
        let seen = (n * pos0 + n * (n + 1) / 2) as f64;
        let flops = 4.0 * seen * (shape.n_heads * shape.head_dim) as f64;
        Ok((flops / ms / 1e9, ms * 1e3))
    }
}

/// Positions a probe pool's block holds, as the model's.
const POOL_BLOCK: usize = 16;

/// See [`Probe::pool`].
struct ProbePool {
    pool: DeviceBuffer,
    table: DeviceBuffer,
    layers: usize,
    kv_row: usize,
}

impl ProbePool {
    /// Layer `layer`'s cache.
    fn cache<T: cuda::FloatElem>(&self, layer: usize) -> cuda::PagedCache<'_, T> {
        let rows = POOL_BLOCK * self.kv_row;
        cuda::PagedCache {
            pool: self.pool.as_slice(),
            keys_offset: layer * 2 * rows,
            values_offset: layer * 2 * rows + rows,
            table: self.table.as_slice(),
            block_size: POOL_BLOCK,
            block_stride: self.layers * 2 * rows,
        }
    }
}

/// A decode layer's products as the model fuses them: name, the matrices (q, k, v, o, gate,
/// up, down: 0..7), whether the input norm is inside, and the epilogue.
const LAYER_PRODUCTS: [(&str, &[usize], bool, Epilogue); 4] = [
    ("q/k/v + norm", &[0, 1, 2], true, Epilogue::Store),
    ("o + residual", &[3], false, Epilogue::Accumulate),
    ("gate/up + norm + swiglu", &[4, 5], true, Epilogue::SwiGlu),
    ("down + residual", &[6], false, Epilogue::Accumulate),
];

/// A dense decode layer's product shapes.
struct LayerShape {
    name: &'static str,
    hidden: usize,
    /// Rows of q (heads · head_dim), of k and of v.
    q_rows: usize,
    kv_rows: usize,
    inter: usize,
}

/// `cuda_probe products [M...]`: every batch-invariant tile (split and not) against the plan
/// it would pick and cuBLASLt, at qwen3-8b's product shapes, for each batch M.
fn products(probe: &mut Probe, copy: f64, batches: &[usize]) -> Result<(), CudaError> {
    let mut sliced = SlicedGemm::new(&probe.device, &probe.owner)?;
    let gemm = Gemm::new(&probe.device, &probe.owner)?;
    println!("\nproducts, bf16 weights streamed from HBM, µs (share of copy rate for the weights)");
    let shapes = [
        ("q/o", 4096, 4096),
        ("q/k/v", 6144, 4096),
        ("k/v", 1024, 4096),
        ("gate/up", 12288, 4096),
        ("down", 4096, 12288),
        ("head", 151936, 4096),
    ];
    for (name, n, k) in shapes {
        for &m in batches {
            let bound_us = (n * k * 2) as f64 / copy * 2.0 / 1e3;
            let line = |label: String, us: f64| {
                println!(
                    "{name:<8} m {m:>4} {label:<14} {us:>9.1} µs {:>5.2}",
                    bound_us / us
                );
            };
            let us = probe.product_us(m, n, k, |a, w, y| gemm.matmul(a, w, y, false))?;
            line("cublas".into(), us);
            sliced.force_tile(None);
            let us = probe.product_us(m, n, k, |a, w, y| sliced.matmul(a, w, y, false))?;
            line("planned".into(), us);
            // The head's every tile takes minutes: the plan and cuBLASLt only.
            let tiles = if name == "head" {
                Vec::new()
            } else {
                sliced.tiles()
            };
            for tile in tiles {
                for split in [false, true].into_iter().filter(|&s| !s || tile.splits()) {
                    sliced.force_tile(Some((tile, split)));
                    let us = probe.product_us(m, n, k, |a, w, y| sliced.matmul(a, w, y, false))?;
                    line(
                        format!("{}{}", tile.name(), if split { " split" } else { "" }),
                        us,
                    );
                }
            }
            sliced.force_tile(None);
        }
    }
    Ok(())
}

fn run() -> Result<(), CudaError> {
    let device = CudaDevice::open(0)?;
    println!("device: {}", device.info());
    let started = std::time::Instant::now();
    device.load_all()?;
    println!("kernels ready in {:.2?}", started.elapsed());
    let mut probe = Probe {
        device,
        owner: BufferOwner::new(),
        seed: 1,
    };

    let copy = probe.copy_bandwidth()?;
    println!("device-to-device copy: {copy:.0} GB/s (read + write)");
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("collectives") {
        return collectives(&probe.device);
    }
    if args.first().map(String::as_str) == Some("products") {
        let batches: Vec<usize> = args[1..].iter().filter_map(|a| a.parse().ok()).collect();
        let batches = if batches.is_empty() {
            vec![1, 4, 16, 64, 256]
        } else {
            batches
        };
        return products(&mut probe, copy, &batches);
    }

    println!("\nmatvec (decode), weights streamed from HBM:");
    println!(
        "{:<6} {:>15} {:>5} {:>9} {:>8}",
        "dtype", "rows×cols", "batch", "GB/s", "of copy"
    );
    let shapes = [
        (1024, 4096),
        (4096, 4096),
        (12288, 4096),
        (4096, 12288),
        (151936, 1024),
    ];
    let runs = [
        (Float::Bf16, 1),
        (Float::Bf16, 4),
        (Float::Bf16, 8),
        (Float::F16, 1),
        (Float::F32, 1),
    ];
    for (rows, cols) in shapes {
        for (dtype, batch) in runs {
            let gbs = probe.matvec(dtype, rows, cols, batch)?;
            println!(
                "{:<6} {:>15} {:>5} {:>9.0} {:>7.0}%",
                dtype.to_string(),
                format!("{rows}×{cols}"),
                batch,
                gbs,
                100.0 * gbs / copy
            );
        }
    }

    println!("\nattention_decode, bf16 cache (qwen3-8b heads 32/8×128):");
    let shape = AttentionShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    };
    for precision in [
        cuda::AttentionPrecision::F32,
        cuda::AttentionPrecision::Bf16,
    ] {
        for context in [512, 2048, 4096, 32768] {
            let (gbs, us) = probe.attention(shape, context, precision)?;
            println!(
                "{precision:?} context {context:>6}: {us:>7.1} µs, {gbs:>5.0} GB/s ({:.0}% of copy)",
                100.0 * gbs / copy
            );
        }
    }

    println!("\nattention_prefill, tensor cores (qwen3-8b heads 32/8×128), causal FLOPs:");
    // The last two: a chat's next turn, a few dozen tokens over a long cache (split keys).
    for (pos0, n) in [
        (0, 512),
        (1536, 512),
        (0, 2048),
        (0, 8192),
        (8208, 78),
        (16384, 30),
    ] {
        let (tf, us) = probe.prompt_attention(
            shape,
            pos0,
            n,
            bf16::from_f32,
            cuda::AttentionPrecision::Bf16,
        )?;
        let (tf32, us32) =
            probe.prompt_attention(shape, pos0, n, |x| x, cuda::AttentionPrecision::Bf16)?;
        println!(
            "{n:>5} queries after {pos0:>5}: bf16 cache {us:>7.1} µs {tf:>4.0} TFLOP/s, \
             f32 cache {us32:>7.1} µs {tf32:>4.0} TFLOP/s"
        );
    }

    for shape in [
        LayerShape {
            name: "qwen3-0.6b",
            hidden: 1024,
            q_rows: 2048,
            kv_rows: 1024,
            inter: 3072,
        },
        LayerShape {
            name: "qwen3-8b",
            hidden: 4096,
            q_rows: 4096,
            kv_rows: 1024,
            inter: 12288,
        },
    ] {
        println!(
            "\n{} decode layer products (bf16, batch 1), µs a launch:",
            shape.name
        );
        for (name, us, bytes) in probe.layer_products(&shape)? {
            let gbs = bytes as f64 / us / 1e3;
            println!(
                "{name:<24} {us:>7.1} µs {gbs:>6.0} GB/s ({:.0}% of copy)",
                100.0 * gbs / copy
            );
        }
    }

    println!("\ncuBLASLt bf16 GEMM (f32 accumulate), out = a[m,k]·W[n,k]ᵀ:");
    let gemm = Gemm::new(&probe.device, &probe.owner)?;
    for (m, n, k) in [
        (2048, 4096, 4096),
        (2048, 12288, 4096),
        (2048, 4096, 12288),
        (8192, 8192, 8192),
    ] {
        let bf = probe.gemm(&gemm, m, n, k, false)?;
        let f = probe.gemm(&gemm, m, n, k, true)?;
        println!("{m}×{n}×{k}: {bf:.0} TFLOP/s bf16 out, {f:.0} TFLOP/s f32 out");
    }
    Ok(())
}

/// Microseconds a call of the rank-order all-reduce takes among every GPU of the machine, for
/// a decode step's messages (a hidden row of qwen3-8b, 4096 f32, for 1 to 64 sequences) and a
/// prompt chunk's: each rank's thread enqueues the calls back to back, timed on its stream.
fn collectives(lead: &CudaDevice) -> Result<(), CudaError> {
    const CALLS: usize = 200;
    let gpus = lead.info().count;
    let mut devices = vec![lead.clone()];
    for ordinal in 1..gpus {
        let device = CudaDevice::open(ordinal)?;
        device.load_all()?;
        devices.push(device);
    }
    lead.load_all()?;
    let group = cuda::NcclGroup::new(&devices)?;
    println!(
        "\nall-reduce in rank order among {gpus} GPU(s), NCCL {}{}:",
        cuda::nccl_version()?,
        if gpus == 1 {
            " (one rank: the all-gather is a copy; no link is crossed)"
        } else {
            ""
        }
    );
    println!("{:>10} {:>10} {:>12}", "values", "bytes", "µs a call");
    let owner = BufferOwner::new();
    let ranks = devices.len();
    for rows in [1usize, 8, 64, 512] {
        let len = rows * 4096;
        let per_rank: Vec<Result<f64, CudaError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = devices
                .iter()
                .enumerate()
                .map(|(rank, device)| {
                    let (group, owner) = (&group, &owner);
                    scope.spawn(move || -> Result<f64, CudaError> {
                        let f32s = |label: &str, n: usize| {
                            owner.alloc_device(BufferKind::Scratch, label, device, n * 4)
                        };
                        let mut values = f32s("values", len)?;
                        let mut gathered = f32s("gathered", len * ranks)?;
                        let mut call = || {
                            group.all_reduce_in_rank_order(
                                rank,
                                device,
                                &mut values.as_mut_slice(),
                                &mut gathered.as_mut_slice(),
                            )
                        };
                        call()?;
                        device.synchronize()?;
                        let ms = device.time_ms(|| (0..CALLS).try_for_each(|_| call()))?;
                        Ok(ms as f64 * 1000.0 / CALLS as f64)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread"))
                .collect()
        });
        let worst = per_rank
            .into_iter()
            .collect::<Result<Vec<f64>, _>>()?
            .into_iter()
            .fold(0f64, f64::max);
        println!("{len:>10} {:>10} {worst:>12.1}", len * 4);
    }
    Ok(())
}

//! The model, its backend and its KV pool behind one object, so the engine's code is the same
//! on every device: one dynamic call per forward pass, nothing per kernel. Which blocks of the
//! pool a sequence holds is the engine's business ([`crate::kv`]): every pass is given its
//! sequence's [`BlockTable`].

mod tensor_parallel;

use std::time::Instant;

use ember_models::{
    Backend, BlockTable, CpuBackend, CudaBackend, KvLayout, KvStore, Logits, ModelConfig,
    PassInput, SequencePass, Transformer,
};
use ember_tensor::cuda::CudaDevice;
use ember_tensor::{BufferKind, BufferOwner, cpu};

use crate::bench::median;
use crate::error::Result;

pub(crate) use tensor_parallel::{AbortGroup, TensorParallelRunner};

pub(crate) trait Runner: Send {
    /// Runs `tokens` after `seq`'s positions (its blocks must cover them) and returns the
    /// requested logits.
    fn forward(&mut self, seq: &mut BlockTable, tokens: &[u32], logits: Logits) -> Result<&[f32]>;
    /// One pass over several sequences ([`Transformer::run_batch`]), its logits (one after
    /// another, each sequence's as its [`Logits`] asks) left where they were made; returns
    /// their rows.
    fn forward_batch(&mut self, seqs: &mut [SequencePass<'_, '_>]) -> Result<usize>;
    /// The first `rows` rows of the last pass's logits, on the host.
    fn logits(&mut self, rows: usize) -> Result<&[f32]>;
    /// The greedy pick of each of the first `rows` rows of the last pass's logits, made where
    /// they are.
    fn greedy_tokens(&mut self, rows: usize) -> Result<Vec<u32>>;
    /// A forward pass of a non-empty `tokens` that returns the greedy choice after the last,
    /// leaving its logits where they are (on the device, for a GPU).
    fn forward_greedy(&mut self, seq: &mut BlockTable, tokens: &[u32]) -> Result<u32>;
    /// A pass whose greedy pick is enqueued, not waited for ([`Transformer::forward_ahead`]).
    fn forward_ahead(&mut self, seq: &mut BlockTable, input: PassInput<'_>) -> Result<()>;
    /// The oldest pick of [`Runner::forward_ahead`] not yet read.
    fn read_pick(&mut self) -> Result<u32>;
    fn config(&self) -> &ModelConfig;
    /// Tokens one forward pass takes at most.
    fn max_batch(&self) -> usize;
    /// Rows of logits one pass can give.
    fn logit_rows(&self) -> usize;
    /// The pool's block geometry.
    fn kv_layout(&self) -> KvLayout;
    /// The KV pool's storage: its blocks and host tier, and the copies between them.
    fn kv(&mut self) -> &mut dyn KvStore;
    /// Positions the rotary tables (and so any sequence) may reach.
    fn context(&self) -> usize;
    fn weight_bytes_per_token(&self) -> usize;
    /// Compute threads (CPU), or 1 for a device that runs on its own.
    fn threads(&self) -> usize;
    /// What runs the model, for logs and reports: "cpu (avx512, 2 threads)", "cuda (NVIDIA H200 …)".
    fn device_label(&self) -> String;
    /// The memory bandwidth that bounds decode, in GB/s, measured over `bytes` made through
    /// `owner`: a CPU read pass, or a device-to-device copy (read plus written) on a GPU.
    fn measure_bandwidth(&self, owner: &BufferOwner, bytes: usize, passes: usize) -> Result<f64>;
    /// Starts or stops a GPU profiler's capture ([`CudaDevice::profiler_capture`]); nothing on
    /// the CPU.
    fn profiler_capture(&self, on: bool) -> Result<()>;
}

pub(crate) struct ModelRunner<B: Backend> {
    pub backend: B,
    pub model: Transformer<B>,
    pub kv: B::Kv,
    /// Positions a sequence may reach: the context the rotary tables were made for.
    pub context: usize,
}

impl<B: Backend> ModelRunner<B> {
    fn forward_pass(
        &mut self,
        seq: &mut BlockTable,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<&[f32]> {
        Ok(self
            .model
            .forward(&mut self.backend, &mut self.kv, seq, tokens, logits)?)
    }
}

macro_rules! shared_runner_methods {
    () => {
        fn forward(
            &mut self,
            seq: &mut BlockTable,
            tokens: &[u32],
            logits: Logits,
        ) -> Result<&[f32]> {
            self.forward_pass(seq, tokens, logits)
        }

        fn forward_batch(&mut self, seqs: &mut [SequencePass<'_, '_>]) -> Result<usize> {
            Ok(self
                .model
                .run_batch(&mut self.backend, &mut self.kv, seqs)?)
        }

        fn logits(&mut self, rows: usize) -> Result<&[f32]> {
            let vocab = self.model.config.vocab_size;
            Ok(self.backend.logits(rows * vocab)?)
        }

        fn greedy_tokens(&mut self, rows: usize) -> Result<Vec<u32>> {
            let vocab = self.model.config.vocab_size;
            Ok(self.backend.greedy_tokens(rows, vocab)?)
        }

        fn forward_greedy(&mut self, seq: &mut BlockTable, tokens: &[u32]) -> Result<u32> {
            Ok(self
                .model
                .forward_greedy(&mut self.backend, &mut self.kv, seq, tokens)?)
        }

        fn forward_ahead(&mut self, seq: &mut BlockTable, input: PassInput<'_>) -> Result<()> {
            Ok(self
                .model
                .forward_ahead(&mut self.backend, &mut self.kv, seq, input)?)
        }

        fn read_pick(&mut self) -> Result<u32> {
            Ok(self.backend.read_pick()?)
        }

        fn config(&self) -> &ModelConfig {
            &self.model.config
        }

        fn max_batch(&self) -> usize {
            self.backend.max_batch()
        }

        fn logit_rows(&self) -> usize {
            self.backend.logit_rows()
        }

        fn kv_layout(&self) -> KvLayout {
            *self.kv.layout()
        }

        fn kv(&mut self) -> &mut dyn KvStore {
            &mut self.kv
        }

        fn context(&self) -> usize {
            self.context
        }

        fn weight_bytes_per_token(&self) -> usize {
            self.model.weight_bytes_per_token()
        }
    };
}

impl Runner for ModelRunner<CpuBackend> {
    shared_runner_methods!();

    fn threads(&self) -> usize {
        self.backend.pool().n_threads()
    }

    fn device_label(&self) -> String {
        let types = self.backend.quantized_types();
        let kernels = match types.is_empty() {
            true => String::new(),
            false => format!("; {}", cpu::quant_kernels(&types)),
        };
        format!(
            "cpu ({}, {} threads{kernels})",
            cpu::Isa::detect().name(),
            self.threads()
        )
    }

    fn measure_bandwidth(&self, owner: &BufferOwner, bytes: usize, passes: usize) -> Result<f64> {
        let probe = owner.alloc(BufferKind::Scratch, "bandwidth probe", bytes)?;
        let data = probe.as_slice::<f32>();
        let mut rates = Vec::with_capacity(passes);
        let mut sink = 0f32;
        for _ in 0..passes.max(1) {
            let start = Instant::now();
            sink += cpu::read_sum(self.backend.pool(), data);
            rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
        std::hint::black_box(sink);
        Ok(median(&rates))
    }

    fn profiler_capture(&self, _on: bool) -> Result<()> {
        Ok(())
    }
}

impl Runner for ModelRunner<CudaBackend> {
    shared_runner_methods!();

    fn threads(&self) -> usize {
        1
    }

    fn device_label(&self) -> String {
        format!("cuda ({})", self.backend.device().info())
    }

    fn measure_bandwidth(&self, owner: &BufferOwner, bytes: usize, passes: usize) -> Result<f64> {
        let device: &CudaDevice = self.backend.device();
        let alloc = |label| owner.alloc_device(BufferKind::Scratch, label, device, bytes);
        let (src, mut dst) = (
            alloc("bandwidth probe source")?,
            alloc("bandwidth probe copy")?,
        );
        let mut rates = Vec::with_capacity(passes);
        for _ in 0..passes.max(1) {
            let ms = device
                .time_ms(|| device.copy(src.as_slice::<u8>(), &mut dst.as_mut_slice::<u8>()))?;
            rates.push(2.0 * bytes as f64 / (ms as f64 / 1e3) / 1e9);
        }
        Ok(median(&rates))
    }

    fn profiler_capture(&self, on: bool) -> Result<()> {
        Ok(self.backend.device().profiler_capture(on)?)
    }
}

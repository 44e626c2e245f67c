//! The kernel sources and the typed handles that name their entry points.
//!
//! One `.cu` file per op family ([`Module`]), compiled as a whole by NVRTC on first use. Code
//! names a kernel by [`Kernel`], never by a string: the symbol is formatted in one place,
//! [`Kernel::symbol`], from the same names the `.cu` macros paste together.

use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::sliced_gemm::SlicedTile;

/// Prepended to every module: 16-bit float conversions, warp and block reductions, loads.
const COMMON: &str = include_str!("kernels/common.cuh");
/// Prepended to the modules that multiply on the tensor cores.
const MMA: &str = include_str!("kernels/mma.cuh");
/// The CUDA-core decode attention, also the first half of the tensor-core one's module.
const DECODE: &str = include_str!("kernels/attention_decode.cu");
/// The batch-invariant prompt attention, the last part of the tensor-core decode module.
const PROMPT_ROWS: &str = include_str!("kernels/attention_prompt_rows.cu");

/// A folder whose kernel files replace the built-in ones of the same name (a development aid:
/// kernel variants compared on a GPU machine with one binary, no rebuild). Files it lacks
/// stay built in; the disk cache is keyed by the source, so variants never mix.
const SOURCE_DIR_VAR: &str = "EMBER_KERNEL_SOURCE_DIR";

/// `file`'s text from [`SOURCE_DIR_VAR`]'s folder when it is set and holds the file, else the
/// built-in `text`.
fn kernel_file(file: &str, text: &'static str) -> Cow<'static, str> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = std::env::var_os(SOURCE_DIR_VAR).filter(|v| !v.is_empty())?;
        tracing::warn!(
            "kernel sources from {} where it has them ({SOURCE_DIR_VAR})",
            PathBuf::from(&dir).display()
        );
        Some(PathBuf::from(dir))
    });
    file_from(dir.as_deref(), file, text)
}

fn file_from(dir: Option<&Path>, file: &str, text: &'static str) -> Cow<'static, str> {
    match dir.map(|d| std::fs::read_to_string(d.join(file))) {
        Some(Ok(replaced)) => Cow::Owned(replaced),
        _ => Cow::Borrowed(text),
    }
}

/// Stages and keys a tile of the tensor-core prompt attention (`MMA_STAGES`, `MMA_KEYS` in
/// attention_mma.cu), which size its shared memory.
const PREFILL_MMA_STAGES: usize = 2;
const PREFILL_MMA_KEYS: usize = 64;
/// Keys of a chunk the batch-invariant prompt attention stages (`DEC_MIN_KEYS_PER_SPLIT`).
const PROMPT_ROWS_CHUNK: usize = 128;

/// One source file of kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Matvec,
    RmsNorm,
    Rope,
    Elementwise,
    Embedding,
    Argmax,
    Attention,
    /// Decode attention over a cache of one element type: a module each, so that a first
    /// load compiles the three at once (together they took half a minute).
    AttentionDecode(Float),
    /// Decode attention on the tensor cores over a 16-bit cache: compute capability 8.0 and
    /// later. Its source follows attention_decode.cu, whose chunking and merge it shares, and
    /// attention_prompt_rows.cu (prompt rows with its arithmetic) follows it.
    AttentionDecodeMma(Float),
    /// Tensor-core attention (mma.sync with bf16 operands): compute capability 8.0 and later.
    AttentionMma,
    Moe,
    /// Routed experts' prompt products on the tensor cores: compute capability 8.0 and later.
    ExpertsMma,
    /// Batch-invariant products on the tensor cores: compute capability 8.0 and later.
    SlicedGemm,
}

impl Module {
    pub const ALL: [Module; 16] = [
        Module::Matvec,
        Module::RmsNorm,
        Module::Rope,
        Module::Elementwise,
        Module::Embedding,
        Module::Argmax,
        Module::Attention,
        Module::AttentionDecode(Float::F32),
        Module::AttentionDecode(Float::Bf16),
        Module::AttentionDecode(Float::F16),
        Module::AttentionDecodeMma(Float::Bf16),
        Module::AttentionDecodeMma(Float::F16),
        Module::AttentionMma,
        Module::Moe,
        Module::ExpertsMma,
        Module::SlicedGemm,
    ];

    /// The file name without `.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Module::Matvec => "matvec",
            Module::RmsNorm => "rms_norm",
            Module::Rope => "rope",
            Module::Elementwise => "elementwise",
            Module::Embedding => "embedding",
            Module::Argmax => "argmax",
            Module::Attention => "attention",
            Module::AttentionDecode(Float::F32) => "attention_decode_f32",
            Module::AttentionDecode(Float::Bf16) => "attention_decode_bf16",
            Module::AttentionDecode(Float::F16) => "attention_decode_f16",
            Module::AttentionDecodeMma(Float::Bf16) => "attention_decode_mma_bf16",
            Module::AttentionDecodeMma(Float::F16) => "attention_decode_mma_f16",
            // Never built: the f32 cache has no tensor-core form.
            Module::AttentionDecodeMma(Float::F32) => "attention_decode_mma_f32",
            Module::AttentionMma => "attention_mma",
            Module::Moe => "moe",
            Module::ExpertsMma => "experts_mma",
            Module::SlicedGemm => "sliced_gemm",
        }
    }

    /// The module's own file: its name and built-in text (the decode attention modules are
    /// instances of one file each).
    fn file(self) -> (&'static str, &'static str) {
        macro_rules! file {
            ($name:literal) => {
                ($name, include_str!(concat!("kernels/", $name)))
            };
        }
        match self {
            Module::Matvec => file!("matvec.cu"),
            Module::RmsNorm => file!("rms_norm.cu"),
            Module::Rope => file!("rope.cu"),
            Module::Elementwise => file!("elementwise.cu"),
            Module::Embedding => file!("embedding.cu"),
            Module::Argmax => file!("argmax.cu"),
            Module::Attention => file!("attention.cu"),
            Module::AttentionDecode(_) => ("attention_decode.cu", DECODE),
            Module::AttentionDecodeMma(_) => file!("attention_decode_mma.cu"),
            Module::AttentionMma => file!("attention_mma.cu"),
            Module::Moe => file!("moe.cu"),
            Module::ExpertsMma => file!("experts_mma.cu"),
            Module::SlicedGemm => file!("sliced_gemm.cu"),
        }
    }

    /// The module's own files in order: its file, then for the tensor-core decode module the
    /// prompt rows' kernels, which take its steps and merges.
    fn own_files(self) -> Vec<(&'static str, &'static str)> {
        let mut files = vec![self.file()];
        if let Module::AttentionDecodeMma(_) = self {
            files.push(("attention_prompt_rows.cu", PROMPT_ROWS));
        }
        files
    }

    /// The oldest compute capability the module compiles for.
    pub fn min_compute_capability(self) -> (i32, i32) {
        match self {
            Module::AttentionMma
            | Module::ExpertsMma
            | Module::AttentionDecodeMma(_)
            | Module::SlicedGemm => (8, 0),
            // __match_any_sync groups a warp's pairs by expert.
            Module::Moe => (7, 0),
            _ => (5, 0),
        }
    }

    /// The value of `#define NAME value` in the module's source: for tests that hold the host's
    /// copies of a kernel's constants to the kernel's.
    #[cfg(test)]
    pub(crate) fn define(self, name: &str) -> usize {
        let prefix = format!("#define {name} ");
        let source = self.source();
        let line = source
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("no #define {name} in {}.cu", self.name()));
        line[prefix.len()..]
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("#define {name}: {e}"))
    }

    /// The whole program NVRTC compiles.
    pub fn source(self) -> String {
        let common = kernel_file("common.cuh", COMMON);
        let mma = kernel_file("mma.cuh", MMA);
        let decode = kernel_file("attention_decode.cu", DECODE);
        let header = match self {
            Module::AttentionMma | Module::ExpertsMma | Module::SlicedGemm => mma.into_owned(),
            // The tensor-core decode kernel reuses the other's chunking, rope and merge.
            Module::AttentionDecodeMma(_) => format!("{mma}\n{decode}"),
            _ => String::new(),
        };
        // The decode attention files define their kernels for the cache type the module names.
        let instances = match self {
            Module::AttentionDecode(kv) => format!("ATTENTION_DECODE_ALL({kv}, {})\n", kv.c_type()),
            Module::AttentionDecodeMma(kv) => format!(
                "ATTENTION_DECODE_MMA_ALL({kv}, {c})\nATTENTION_PROMPT_ROWS_ALL({kv}, {c})\n",
                c = kv.c_type()
            ),
            _ => String::new(),
        };
        let body: Vec<_> = self
            .own_files()
            .into_iter()
            .map(|(name, text)| kernel_file(name, text))
            .collect();
        format!("{common}\n{header}\n{}\n{instances}", body.join("\n"))
    }
}

/// An element type the kernels read or write: 32-bit floats and the two 16-bit formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Float {
    F32,
    Bf16,
    F16,
}

impl Float {
    /// The suffix the `.cu` macros give each instantiation.
    pub fn tag(self) -> &'static str {
        match self {
            Float::F32 => "f32",
            Float::Bf16 => "bf16",
            Float::F16 => "f16",
        }
    }

    /// The type common.cuh gives it.
    pub fn c_type(self) -> &'static str {
        match self {
            Float::F32 => "float",
            Float::Bf16 => "bf16_t",
            Float::F16 => "f16_t",
        }
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            Float::F32 => 4,
            Float::Bf16 | Float::F16 => 2,
        }
    }
}

impl fmt::Display for Float {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.tag())
    }
}

/// One kernel entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `batch` in 1..=8; `norm`: the form with the RMS norm inside.
    Matvec {
        weights: Float,
        batch: u8,
        norm: bool,
    },
    /// Routed experts' products, tiles of `batch` (1 or 8) pairs; `norm`: the form with the
    /// RMS norm inside.
    MatvecExperts {
        weights: Float,
        batch: u8,
        norm: bool,
    },
    RmsNorm {
        out: Float,
    },
    Rope,
    /// `input`: gate's and up's type (f32 or bf16); `out` f32 or bf16.
    SiluMul {
        input: Float,
        out: Float,
    },
    Add,
    /// Ranks' partial sums gathered end to end, added in rank order.
    SumParts,
    /// Rows of a product of matrices laid end to end cut into their outputs by columns.
    SplitColumns,
    Convert {
        from: Float,
        to: Float,
    },
    Embedding {
        table: Float,
    },
    Argmax,
    /// `width` = values of a head each lane holds: 2, 4 or 8 (head_dim up to 64, 128, 256);
    /// `rows` = query heads a block takes for its kv head: 1, 2, 4 or 8; `rope`: the form that
    /// rotates the step's queries and key and stores its key and value itself.
    AttentionDecode {
        kv: Float,
        width: u8,
        rows: u8,
        rope: bool,
    },
    /// Decode attention on the tensor cores: a 16-bit cache, heads of 64 or 128, eight query
    /// heads a block; `rope` as for [`Kernel::AttentionDecode`].
    AttentionDecodeMma {
        kv: Float,
        head_dim: u16,
        rope: bool,
    },
    /// Prompt rows with the bits [`Kernel::AttentionDecodeMma`] gives them as decode rows, a
    /// chunk of keys read once for a tile of rows (the batch-invariant prompt attention).
    AttentionPromptRowsMma {
        kv: Float,
        head_dim: u16,
    },
    /// Merges the chunks of [`Kernel::AttentionPromptRowsMma`]'s rows.
    AttentionPromptRowsMerge {
        kv: Float,
    },
    /// `width` as for [`Kernel::AttentionDecode`].
    AttentionPrefill {
        kv: Float,
        width: u8,
    },
    KvStore {
        kv: Float,
    },
    /// Prompt attention on the tensor cores, heads of `head_dim` 64 or 128.
    AttentionPrefillMma {
        kv: Float,
        head_dim: u16,
    },
    /// Merges the key splits of either prompt attention.
    AttentionPrefillCombine,
    MoeRoute,
    MoeCombine,
    /// `swiglu`: gate and up together, silu(gate) · up written.
    ExpertsMma {
        swiglu: bool,
    },
    /// Batch-invariant products of 16-bit `weights` in blocks of `tile`; `split`: one block
    /// per slice of the row length, the last of a tile adding them up.
    SlicedGemm {
        weights: Float,
        tile: SlicedTile,
        split: bool,
    },
}

impl Kernel {
    pub fn module(self) -> Module {
        match self {
            Kernel::Matvec { .. } | Kernel::MatvecExperts { .. } => Module::Matvec,
            Kernel::RmsNorm { .. } => Module::RmsNorm,
            Kernel::Rope => Module::Rope,
            Kernel::SiluMul { .. }
            | Kernel::Add
            | Kernel::SumParts
            | Kernel::Convert { .. }
            | Kernel::SplitColumns => Module::Elementwise,
            Kernel::Embedding { .. } => Module::Embedding,
            Kernel::Argmax => Module::Argmax,
            Kernel::AttentionPrefill { .. }
            | Kernel::AttentionPrefillCombine
            | Kernel::KvStore { .. } => Module::Attention,
            Kernel::AttentionDecode { kv, .. } => Module::AttentionDecode(kv),
            Kernel::AttentionDecodeMma { kv, .. }
            | Kernel::AttentionPromptRowsMma { kv, .. }
            | Kernel::AttentionPromptRowsMerge { kv } => Module::AttentionDecodeMma(kv),
            Kernel::AttentionPrefillMma { .. } => Module::AttentionMma,
            Kernel::MoeRoute | Kernel::MoeCombine => Module::Moe,
            Kernel::ExpertsMma { .. } => Module::ExpertsMma,
            Kernel::SlicedGemm { .. } => Module::SlicedGemm,
        }
    }

    /// The most dynamic shared memory a block of this kernel takes (the attention tiles; the
    /// product's stages and x).
    pub fn dynamic_smem_bytes(self) -> Option<usize> {
        match self {
            Kernel::AttentionPrefill { width, .. } => {
                // Key tile (rows padded by one), value tile, 16 query rows: see attention.cu.
                let row = width as usize * 32;
                Some((32 * (row + 1) + 32 * row + 16 * row) * 4)
            }
            Kernel::AttentionPrefillMma { head_dim, .. } => {
                // Two stages of a key and a value tile, rows of 16-bit values padded by 8: see
                // attention_mma.cu.
                Some(PREFILL_MMA_STAGES * 2 * PREFILL_MMA_KEYS * (head_dim as usize + 8) * 2)
            }
            Kernel::AttentionPromptRowsMma { head_dim, .. } => {
                // A chunk of 128 keys and its values, 16-bit: see attention_prompt_rows.cu.
                Some(2 * PROMPT_ROWS_CHUNK * head_dim as usize * 2)
            }
            Kernel::SlicedGemm { tile, .. } => Some(tile.smem_bytes()),
            _ => None,
        }
    }

    /// Every entry point the modules define (each instantiation the Rust side can name).
    pub fn all() -> Vec<Kernel> {
        let floats = [Float::F32, Float::Bf16, Float::F16];
        let mut kernels = vec![
            Kernel::Rope,
            Kernel::Add,
            Kernel::SumParts,
            Kernel::SplitColumns,
            Kernel::Argmax,
            Kernel::AttentionPrefillCombine,
            Kernel::MoeRoute,
            Kernel::MoeCombine,
            Kernel::ExpertsMma { swiglu: false },
            Kernel::ExpertsMma { swiglu: true },
        ];
        for f in floats {
            if f != Float::F32 {
                kernels.push(Kernel::AttentionPromptRowsMerge { kv: f });
            }
            kernels.push(Kernel::Embedding { table: f });
            kernels.push(Kernel::KvStore { kv: f });
            for batch in 1..=8 {
                for norm in [false, true] {
                    kernels.push(Kernel::Matvec {
                        weights: f,
                        batch,
                        norm,
                    });
                }
            }
            for batch in [1, 8] {
                for norm in [false, true] {
                    kernels.push(Kernel::MatvecExperts {
                        weights: f,
                        batch,
                        norm,
                    });
                }
            }
            for head_dim in [64, 128] {
                kernels.push(Kernel::AttentionPrefillMma { kv: f, head_dim });
                if f != Float::F32 {
                    for rope in [false, true] {
                        kernels.push(Kernel::AttentionDecodeMma {
                            kv: f,
                            head_dim,
                            rope,
                        });
                    }
                    kernels.push(Kernel::AttentionPromptRowsMma { kv: f, head_dim });
                }
            }
            for width in [2, 4, 8] {
                for rows in [1, 2, 4, 8] {
                    for rope in [false, true] {
                        kernels.push(Kernel::AttentionDecode {
                            kv: f,
                            width,
                            rows,
                            rope,
                        });
                    }
                }
                kernels.push(Kernel::AttentionPrefill { kv: f, width });
            }
        }
        for out in [Float::F32, Float::Bf16] {
            kernels.push(Kernel::RmsNorm { out });
            for input in [Float::F32, Float::Bf16] {
                kernels.push(Kernel::SiluMul { input, out });
            }
        }
        for weights in [Float::Bf16, Float::F16] {
            for tile in SlicedTile::ALL {
                for split in [false, true].into_iter().filter(|&s| !s || tile.splits()) {
                    kernels.push(Kernel::SlicedGemm {
                        weights,
                        tile,
                        split,
                    });
                }
            }
        }
        for to in floats {
            kernels.push(Kernel::Convert {
                from: Float::F32,
                to,
            });
        }
        for from in [Float::Bf16, Float::F16] {
            kernels.push(Kernel::Convert {
                from,
                to: Float::F32,
            });
        }
        kernels
    }

    /// The `extern "C"` name in the module.
    pub fn symbol(self) -> String {
        match self {
            Kernel::Matvec {
                weights,
                batch,
                norm,
            } => format!(
                "matvec_{weights}_b{batch}{}",
                if norm { "_norm" } else { "" }
            ),
            Kernel::MatvecExperts {
                weights,
                batch,
                norm,
            } => format!(
                "matvec_{weights}_b{batch}_experts{}",
                if norm { "_norm" } else { "" }
            ),
            Kernel::RmsNorm { out } => format!("rms_norm_{out}"),
            Kernel::Rope => "rope".into(),
            Kernel::SiluMul { input, out } => format!("silu_mul_{input}_{out}"),
            Kernel::Add => "add_f32".into(),
            Kernel::SumParts => "sum_parts_f32".into(),
            Kernel::SplitColumns => "split_columns_f32".into(),
            Kernel::Convert { from, to } => format!("convert_{from}_{to}"),
            Kernel::Embedding { table } => format!("embedding_{table}"),
            Kernel::Argmax => "argmax".into(),
            Kernel::AttentionDecode {
                kv,
                width,
                rows,
                rope,
            } => {
                let rope = if rope { "rope_" } else { "" };
                format!("attention_decode_{rope}{kv}_e{width}_r{rows}")
            }
            Kernel::AttentionDecodeMma { kv, head_dim, rope } => {
                let rope = if rope { "rope_" } else { "" };
                format!("attention_decode_mma_{rope}{kv}_d{head_dim}")
            }
            Kernel::AttentionPromptRowsMma { kv, head_dim } => {
                format!("attention_prompt_rows_mma_{kv}_d{head_dim}")
            }
            Kernel::AttentionPromptRowsMerge { kv } => format!("attention_prompt_rows_merge_{kv}"),
            Kernel::AttentionPrefill { kv, width } => format!("attention_prefill_{kv}_e{width}"),
            Kernel::KvStore { kv } => format!("kv_store_{kv}"),
            Kernel::AttentionPrefillCombine => "attention_prefill_combine".into(),
            Kernel::AttentionPrefillMma { kv, head_dim } => {
                format!("attention_prefill_mma_{kv}_d{head_dim}")
            }
            Kernel::MoeRoute => "moe_route".into(),
            Kernel::MoeCombine => "moe_combine".into(),
            Kernel::ExpertsMma { swiglu } => {
                format!("experts_mma_bf16{}", if swiglu { "_swiglu" } else { "" })
            }
            Kernel::SlicedGemm {
                weights,
                tile,
                split,
            } => format!(
                "sliced_gemm_{weights}_{}{}",
                tile.name(),
                if split { "_split" } else { "" }
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt attention's shared memory is sized on the host from the kernel's tiling.
    #[test]
    fn prefill_tiles_match_the_kernel() {
        let m = Module::AttentionMma;
        assert_eq!(m.define("MMA_STAGES"), PREFILL_MMA_STAGES);
        assert_eq!(m.define("MMA_KEYS"), PREFILL_MMA_KEYS);
        assert_eq!(m.define("MMA_PAD"), 8);
    }

    /// A source folder replaces the files it holds and only those.
    #[test]
    fn a_source_folder_replaces_the_files_it_holds() {
        let dir = std::env::temp_dir().join(format!("ember-kernel-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("matvec.cu"), "// a variant").unwrap();
        let (name, text) = Module::Matvec.file();
        assert_eq!(file_from(Some(&dir), name, text), "// a variant");
        let (name, text) = Module::RmsNorm.file();
        assert_eq!(file_from(Some(&dir), name, text), text);
        assert_eq!(file_from(None, "matvec.cu", text), text);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Kernels are launched to overlap the one before (`CudaDevice::launch_kernel`), which is
    /// safe only because each waits for it first: every kernel body calls
    /// `grid_dependency_wait()`.
    #[test]
    fn every_kernel_waits_for_the_one_before() {
        for module in Module::ALL {
            let body: String = module.own_files().iter().map(|(_, text)| *text).collect();
            let body = body.as_str();
            let mut kernels = 0;
            for (at, _) in body.match_indices("__global__") {
                let open = at + body[at..].find('{').expect("a kernel body");
                let mut depth = 0;
                let close = body[open..]
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += match c {
                            '{' => 1,
                            '}' => -1,
                            _ => 0,
                        };
                        depth == 0
                    })
                    .map(|(i, _)| open + i)
                    .expect("a closed kernel body");
                assert!(
                    body[open..close].contains("grid_dependency_wait();"),
                    "a kernel of {}.cu does not call grid_dependency_wait(): {}",
                    module.name(),
                    &body[at..open]
                );
                kernels += 1;
            }
            assert!(kernels > 0, "no kernel found in {}.cu", module.name());
        }
    }

    /// Every symbol the Rust side can name is defined in its module's source (by a macro
    /// whose pasted name we look for piece by piece, or spelled out).
    #[test]
    fn every_kernel_symbol_is_in_its_source() {
        for k in Kernel::all() {
            let source = k.module().source();
            let symbol = k.symbol();
            let direct =
                source.contains(&format!(" {symbol}(")) || source.contains(&format!("{symbol},"));
            let pasted = match k {
                Kernel::Matvec { weights, batch, .. } => {
                    source.contains("NAME##_norm(")
                        && source.contains(&format!("matvec_##T##_b{batch},"))
                        && source.contains(&format!("MATVEC_ALL_BATCHES({weights},"))
                }
                Kernel::MatvecExperts { weights, batch, .. } => {
                    source.contains("NAME##_experts(")
                        && source.contains("NAME##_experts_norm(")
                        && source.contains(&format!("MATVEC_EXPERTS(matvec_##T##_b{batch},"))
                        && source.contains(&format!("MATVEC_ALL_BATCHES({weights},"))
                }
                Kernel::AttentionPrefill { kv, width } => {
                    source.contains(&format!("ATTENTION(T, KV, {width})"))
                        && source.contains(&format!("ATTENTION_ALL_WIDTHS({kv},"))
                }
                Kernel::AttentionDecode {
                    kv,
                    width,
                    rows,
                    rope,
                } => {
                    let name = if rope {
                        "attention_decode_rope_##T##_e##E##_r##ROWS, KV, E, ROWS, true)"
                    } else {
                        "attention_decode_##T##_e##E##_r##ROWS, KV, E, ROWS, false)"
                    };
                    source.contains(&format!("ATTENTION_DECODE_ENTRY({name}"))
                        && source.contains(&format!("ATTENTION_DECODE(T, KV, E, {rows})"))
                        && source.contains(&format!("ATTENTION_DECODE_ALL_ROWS(T, KV, {width})"))
                        && source.contains(&format!("ATTENTION_DECODE_ALL({kv},"))
                }
                Kernel::AttentionDecodeMma { kv, head_dim, rope } => {
                    let name = if rope {
                        "attention_decode_mma_rope_##T##_d##D, KV, D, true)"
                    } else {
                        "attention_decode_mma_##T##_d##D, KV, D, false)"
                    };
                    source.contains(&format!("ATTENTION_DECODE_MMA_ENTRY({name}"))
                        && source.contains(&format!("ATTENTION_DECODE_MMA(T, KV, {head_dim})"))
                        && source.contains(&format!("ATTENTION_DECODE_MMA_ALL({kv},"))
                }
                Kernel::AttentionPromptRowsMma { kv, head_dim } => {
                    source.contains("attention_prompt_rows_mma_##T##_d##D(")
                        && source.contains(&format!("ATTENTION_PROMPT_ROWS_MMA(T, KV, {head_dim})"))
                        && source.contains(&format!("ATTENTION_PROMPT_ROWS_ALL({kv},"))
                }
                Kernel::AttentionPromptRowsMerge { kv } => {
                    source.contains("attention_prompt_rows_merge_##T(")
                        && source.contains(&format!("ATTENTION_PROMPT_ROWS_ALL({kv},"))
                }
                Kernel::AttentionPrefillMma { kv, head_dim } => {
                    source.contains(&format!("ATTENTION_MMA(T, KV, {head_dim})"))
                        && source.contains(&format!("ATTENTION_MMA_ALL_DIMS({kv},"))
                }
                Kernel::KvStore { kv } => {
                    source.contains("kv_store_##T(") && source.contains(&format!("KV_STORE({kv},"))
                }
                Kernel::SlicedGemm {
                    weights,
                    tile,
                    split,
                } => {
                    let name = if split {
                        "sliced_gemm_##tname##_##tile##_split("
                    } else {
                        "sliced_gemm_##tname##_##tile("
                    };
                    source.contains(name)
                        && source.contains(&format!(
                            "{}(tname, T, {},",
                            tile.kernel_table(),
                            tile.name()
                        ))
                        && source.contains(&format!("SLICED_GEMM_ALL({weights},"))
                }
                _ => false,
            };
            assert!(
                direct || pasted,
                "{symbol} not found in {}.cu",
                k.module().name()
            );
        }
    }
}

use std::process::ExitCode;

use anyhow::{Context, bail};
use ember_engine::synthetic::{Shape, SyntheticDtype, write_checkpoint};

use crate::args::GenCheckpointArgs;

pub fn run(args: GenCheckpointArgs) -> anyhow::Result<ExitCode> {
    let Some(shape) = Shape::from_name(&args.shape) else {
        bail!(
            "unknown shape `{}`; choose one of {}",
            args.shape,
            Shape::NAMES.join(", ")
        );
    };
    let Some(dtype) = SyntheticDtype::from_name(&args.dtype) else {
        bail!("unknown dtype `{}`; choose bf16, f16 or f32", args.dtype);
    };
    let start = std::time::Instant::now();
    write_checkpoint(shape, dtype, &args.out)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let bytes = std::fs::metadata(args.out.join("model.safetensors"))
        .map(|m| m.len())
        .unwrap_or(0);
    eprintln!(
        "wrote {} ({}, {}, {:.2} GB of weights) in {:.1} s",
        args.out.display(),
        args.shape,
        args.dtype,
        bytes as f64 / 1e9,
        start.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

//! Every CUDA op against the CPU kernels or a scalar f64 reference, on random data with odd
//! sizes. Each test that needs a GPU prints "skipped: no CUDA" and returns when
//! `CudaDevice::open(0)` fails, so the suite passes on machines without one.
//!
//! Tolerances (relative to the reference, or absolute where values are O(1)):
//! - f32 sums of f32 or 16-bit inputs: 1e-5 relative (f32 rounding over k ≤ 4096 terms);
//! - 16-bit outputs: half an ulp of the format on top (bf16 4e-3, f16 5e-4 relative);
//! - attention: 1e-4 absolute (f32 sums, fast exponentials, outputs O(1));
//! - conversions and gathers: bit-exact.

use std::sync::Arc;

use ember_residency::{Bound, Membership, RegionKind, ResidencySet, TestBackend};
use ember_tensor::cpu::{self, AttentionShape, RopeLayout, RopeTables};
use ember_tensor::cuda::{
    self, AttentionPrecision, CudaDevice, CudaError, DevMat, DeviceBuffer, DeviceElem, Epilogue,
    ExpertRoad, FloatElem, Gemm, MatvecNorm, MatvecOutput, Module, PagedCache, PagedCacheMut,
    Position, RopeHeads, RopeNorm, SlicedGemm, compile,
};
use ember_tensor::{BufferKind, BufferOwner, Location, ThreadPool};
use half::{bf16, f16};

mod attention;
mod collectives;
mod elementwise;
mod moe;
mod products;
mod prompt_rows;

fn device() -> Option<CudaDevice> {
    match CudaDevice::open(0) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("skipped: no CUDA ({e})");
            None
        }
    }
}

/// A small deterministic generator: uniform values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// A float type on both sides: converts to and from f32 as the device does.
trait Elem: FloatElem {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Elem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

fn round<T: Elem>(x: &[f32]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v)).collect()
}

fn widen<T: Elem>(x: &[T]) -> Vec<f32> {
    x.iter().map(|&v| v.to_f32()).collect()
}

struct Ctx {
    device: CudaDevice,
    owner: BufferOwner,
}

impl Ctx {
    fn new() -> Option<Ctx> {
        device().map(|device| Ctx {
            device,
            owner: BufferOwner::new(),
        })
    }

    fn upload<T: DeviceElem>(&self, data: &[T]) -> DeviceBuffer {
        let mut buf = self
            .owner
            .alloc_device(
                BufferKind::Scratch,
                "test input",
                &self.device,
                size_of_val(data),
            )
            .unwrap();
        buf.upload(data).unwrap();
        buf
    }

    /// An output buffer of `n` elements, every byte 0xff (NaN as f32), so an element the
    /// kernel never wrote shows.
    fn poisoned<T: DeviceElem>(&self, n: usize) -> DeviceBuffer {
        let mut buf = self
            .owner
            .alloc_device(
                BufferKind::Scratch,
                "test output",
                &self.device,
                n * size_of::<T>(),
            )
            .unwrap();
        self.device
            .fill_bytes(&mut buf.as_mut_slice::<u8>(), 0xff)
            .unwrap();
        buf
    }

    fn download<T: DeviceElem + Default>(&self, buf: &DeviceBuffer) -> Vec<T> {
        let mut out = vec![T::default(); buf.len() / size_of::<T>()];
        buf.download(&mut out).unwrap();
        out
    }
}

/// ‖got − want‖ / ‖want‖, failing on any NaN.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|v| !v.is_nan()), "NaN in the output");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w) * (g as f64 - w);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

fn max_abs_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            assert!(!g.is_nan(), "NaN in the output (reference {w})");
            (g as f64 - w).abs()
        })
        .fold(0.0, f64::max)
}

/// The bit patterns of `x`, for comparisons that must be exact.
fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Rotary tables `[positions, head_dim / 2]` (cos, sin) for a frequency base.
fn rope_tables(positions: usize, head_dim: usize, base: f64) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let (mut cos, mut sin) = (vec![0f32; positions * half], vec![0f32; positions * half]);
    for p in 0..positions {
        for i in 0..half {
            let angle = p as f64 / base.powf(2.0 * i as f64 / head_dim as f64);
            cos[p * half + i] = angle.cos() as f32;
            sin[p * half + i] = angle.sin() as f32;
        }
    }
    (cos, sin)
}

#[test]
fn open_without_the_libraries_names_the_missing_one() {
    match CudaDevice::open(0) {
        Err(e @ CudaError::Unavailable { .. }) => {
            let message = e.to_string();
            assert!(
                message.starts_with("CUDA unavailable: lib") && message.ends_with("not found"),
                "{message}"
            );
            println!("as expected here: {message}");
        }
        Err(e) => println!("libraries present, but: {e}"),
        Ok(d) => println!("skipped: CUDA present ({})", d.info()),
    }
    // Probing says the same thing, as a value.
    match CudaDevice::probe() {
        Ok(info) => assert!(info.arch().starts_with("sm_")),
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}

/// NVRTC needs no GPU: wherever the library loads, every kernel source must compile, for
/// Hopper (with its wgmma kernels) and, for the module whose wgmma kernels become traps
/// elsewhere, Ampere. And ptxas must not serialise a kernel's wgmma steps (a wait after each:
/// C7520), which it does silently where it cannot prove their warpgroup runs them together:
/// the TMA tile ran at 0.77 of its speed so until its roles' branch was made warp-uniform.
/// One pass, several modules at once as a device's first load compiles them, the longest
/// first (on CI's two cores the two checks apart took four minutes).
#[test]
fn every_module_compiles_with_nvrtc() {
    if !compile::nvrtc_present() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must install NVRTC (.ci/run: nvidia-cuda-nvrtc)"
        );
        println!("skipped: no NVRTC");
        return;
    }
    let mut jobs: Vec<(Module, &str)> = Module::ALL.into_iter().map(|m| (m, "sm_90a")).collect();
    jobs.push((Module::SlicedGemm, "sm_80"));
    jobs.sort_by_cached_key(|&(m, _)| std::cmp::Reverse(m.source().len()));
    let hopper = |m: Module, arch: &str| arch == "sm_90a" && m.source().contains("wgmma.mma_async");
    assert!(
        jobs.iter().any(|&(m, arch)| hopper(m, arch)),
        "no module multiplies by wgmma"
    );
    let results = compile::in_parallel(&jobs, |(module, arch)| {
        let extra: &[&str] = if hopper(module, arch) {
            &["-Xptxas=-v"]
        } else {
            &[]
        };
        compile::compile_with_log(&module.source(), module, arch, extra)
    });
    for ((module, arch), result) in jobs.into_iter().zip(results) {
        let (cubin, log) = result.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{} gave no CUBIN for {arch}",
            module.name()
        );
        if hopper(module, arch) {
            // ptxas spoke (-v), so no C7520 below means none, not no report.
            assert!(
                log.contains("registers"),
                "{}: no ptxas report",
                module.name()
            );
        }
        let serialised: Vec<&str> = log.lines().filter(|l| l.contains("C7520")).collect();
        assert!(
            serialised.is_empty(),
            "{}.cu: ptxas serialises wgmma:\n{}",
            module.name(),
            serialised.join("\n")
        );
    }
}

#[test]
fn device_buffers_are_listed_and_counted_by_the_residency_set() {
    let Some(ctx) = Ctx::new() else { return };
    let owner = &ctx.owner;
    let host = owner.alloc(BufferKind::Weights, "host", 4096).unwrap();
    let dev = owner
        .alloc_device(BufferKind::KvCache, "kv", &ctx.device, 1 << 20)
        .unwrap();
    let info = owner.list().into_iter().find(|b| b.id == dev.id()).unwrap();
    assert_eq!(
        info.location,
        Location::Device {
            ordinal: ctx.device.ordinal()
        }
    );
    assert_eq!(info.addr as u64, dev.device_ptr());
    assert_eq!(info.region().kind, RegionKind::Device);

    let regions = owner
        .list()
        .iter()
        .map(|b| (b.id.raw(), b.region()))
        .collect();
    let (set, report) = ResidencySet::establish(
        Arc::new(TestBackend::new()),
        Bound::fixed(1 << 30, "a test bound"),
        regions,
    );
    assert!(report.held);
    assert_eq!(report.device_bytes, 1 << 20);
    owner.attach_residency(Arc::clone(&set));
    let later = owner
        .alloc_device(BufferKind::Activations, "act", &ctx.device, 4096)
        .unwrap();
    assert_eq!(set.membership(later.id().raw()), Membership::Staged);
    drop(later);
    drop(dev);
    assert_eq!(set.stats().device_bytes, 0, "device buffers left the set");
    assert_eq!(owner.list().len(), 1);
    drop(host);
}

/// Whether the driver knows `addr` as page-locked host memory.
fn page_locked(ctx: &Ctx, addr: usize) -> bool {
    ctx.device.synchronize().unwrap(); // the context is current on this thread
    let mut flags = 0u32;
    // SAFETY: only asks the driver about an address; `flags` is a valid out pointer.
    let rc = unsafe { cudarc::driver::sys::cuMemHostGetFlags(&mut flags, addr as *mut _) };
    rc == cudarc::driver::sys::CUresult::CUDA_SUCCESS
}

#[test]
fn staging_buffers_are_page_locked_while_the_set_holds_them() {
    let Some(ctx) = Ctx::new() else { return };
    let owner = &ctx.owner;
    let held = owner
        .alloc_staging(BufferKind::Activations, "logits (host)", 10_000)
        .unwrap();
    let plain = owner.alloc(BufferKind::Activations, "plain", 4096).unwrap();
    let addr = |b: &ember_tensor::Buffer| b.bytes().as_ptr() as usize;
    assert!(!page_locked(&ctx, addr(&held)), "not locked before the set");
    let regions = owner
        .list()
        .iter()
        .map(|b| (b.id.raw(), b.region()))
        .collect();
    let backend = Arc::new(cuda::CudaResidency::new(ctx.device.clone()));
    let (set, report) =
        ResidencySet::establish(backend, Bound::fixed(1 << 30, "a test bound"), regions);
    assert!(report.held, "{}", report.line());
    owner.attach_residency(Arc::clone(&set));
    assert!(page_locked(&ctx, addr(&held)), "registered with the driver");
    assert!(
        !page_locked(&ctx, addr(&plain)),
        "plain host memory is mlocked, not registered"
    );

    // Copies through it work, and a staging buffer made later is registered at the commit.
    let mut later = owner
        .alloc_staging(BufferKind::Activations, "pass inputs (host)", 64)
        .unwrap();
    assert_eq!(set.membership(later.id().raw()), Membership::Staged);
    set.commit();
    assert!(page_locked(&ctx, addr(&later)));
    let values: Vec<i32> = (0..16).collect();
    later.as_mut_slice::<i32>()[..16].copy_from_slice(&values);
    let mut dev = ctx.poisoned::<i32>(16);
    ctx.device
        .upload(&mut dev.as_mut_slice(), &later.as_slice::<i32>()[..16])
        .unwrap();
    assert_eq!(ctx.download::<i32>(&dev), values);

    // Leaving the set (before the free) unregisters: freeing a registered buffer would be a
    // driver error the release reports.
    drop(later);
    set.leave(held.id().raw()).unwrap();
    assert!(!page_locked(&ctx, addr(&held)), "unregistered when it left");
    drop(held);
    drop(plain);
}

#[test]
fn uploads_downloads_and_slices_round_trip() {
    let Some(ctx) = Ctx::new() else { return };
    let data: Vec<u32> = (0..1001).collect();
    let mut buf = ctx.upload(&data);
    assert_eq!(ctx.download::<u32>(&buf), data);
    ctx.device
        .upload(&mut buf.as_mut_slice::<u32>().slice_mut(10..13), &[7, 8, 9])
        .unwrap();
    let mut part = [0u32; 5];
    ctx.device
        .download(buf.as_slice::<u32>().slice(9..14), &mut part)
        .unwrap();
    assert_eq!(part, [9, 7, 8, 9, 13]);
    let mut copy = ctx.poisoned::<u32>(1001);
    ctx.device
        .copy(buf.as_slice::<u32>(), &mut copy.as_mut_slice())
        .unwrap();
    assert_eq!(ctx.download::<u32>(&copy)[10..13], [7, 8, 9]);
    assert!(
        buf.upload(&vec![0u32; 1002]).is_err(),
        "an upload past the end is an error"
    );
}

#[test]
fn bad_arguments_are_errors_that_name_the_op() {
    let Some(ctx) = Ctx::new() else { return };
    let w = ctx.upload(&[bf16::ZERO; 64]);
    let x = ctx.upload(&[0f32; 8]);
    let mut y = ctx.poisoned::<f32>(8);
    let mat = DevMat::from_slice(w.as_slice::<bf16>(), 8, 8).unwrap();
    let err = cuda::matvec(
        &ctx.device,
        &mat,
        x.as_slice(),
        9,
        &mut y.as_mut_slice(),
        false,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("matvec: x has 8 values for batch 9"),
        "{err}"
    );
    assert!(DevMat::new(ember_tensor::DType::Q4_0, w.as_slice::<u8>(), 8, 8).is_err());
    let shape = AttentionShape {
        n_heads: 4,
        n_kv_heads: 4,
        head_dim: 512,
    };
    let mut scratch = ctx.poisoned::<f32>(8);
    let empty: [f32; 0] = [];
    let paged = attention::Paged::new(&ctx, &empty, &empty, 4 * 512, 1);
    let err = cuda::attention_decode(
        &ctx.device,
        x.as_slice(),
        paged.cache::<f32>(),
        Position::Host(1),
        shape,
        1.0,
        AttentionPrecision::F32,
        &mut scratch.as_mut_slice(),
        &mut y.as_mut_slice(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("head_dim 512"), "{err}");
}

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
    Position, RopeHeads, RopeNorm, SlicedGemm, SlicedTile, compile,
};
use ember_tensor::{BufferKind, BufferOwner, Location, ThreadPool};
use half::{bf16, f16};

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

#[test]
fn every_module_compiles_with_nvrtc() {
    // NVRTC needs no GPU: wherever the library loads, every kernel source must compile.
    if !compile::nvrtc_present() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must install NVRTC (.ci/run: nvidia-cuda-nvrtc)"
        );
        println!("skipped: no NVRTC");
        return;
    }
    // Several at once, as a device's first load compiles them.
    let cubins = compile::in_parallel(&Module::ALL, |module| {
        compile::compile_cubin(&module.source(), module, "sm_90")
    });
    assert_eq!(cubins.len(), Module::ALL.len());
    for (module, cubin) in Module::ALL.into_iter().zip(cubins) {
        let cubin = cubin.unwrap_or_else(|e| panic!("{e}"));
        assert!(
            cubin.starts_with(b"\x7fELF"),
            "{} gave no CUBIN",
            module.name()
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

/// `y = W·x (+ y)` in f64 from the weights as stored.
fn matvec_reference(
    w: &[f32],
    x: &[f32],
    y0: Option<&[f32]>,
    rows: usize,
    cols: usize,
) -> Vec<f64> {
    let batch = x.len() / cols;
    let mut y = vec![0f64; batch * rows];
    for b in 0..batch {
        for r in 0..rows {
            let dot: f64 = (0..cols)
                .map(|c| w[r * cols + c] as f64 * x[b * cols + c] as f64)
                .sum();
            y[b * rows + r] = dot + y0.map_or(0.0, |y0| y0[b * rows + r] as f64);
        }
    }
    y
}

fn check_matvec<T: Elem>(ctx: &Ctx, rng: &mut Rng, rows: usize, cols: usize, batch: usize) {
    let w: Vec<T> = round(&rng.vec(rows * cols));
    let x = rng.vec(batch * cols);
    let wbuf = ctx.upload(&w);
    let xbuf = ctx.upload(&x);
    let mat = DevMat::from_slice(wbuf.as_slice::<T>(), rows, cols).unwrap();
    let wf = widen(&w);

    let mut y = ctx.poisoned::<f32>(batch * rows);
    cuda::matvec(
        &ctx.device,
        &mat,
        xbuf.as_slice(),
        batch,
        &mut y.as_mut_slice(),
        false,
    )
    .unwrap();
    let got = ctx.download::<f32>(&y);
    let err = rel_err(&got, &matvec_reference(&wf, &x, None, rows, cols));
    assert!(
        err < 1e-5,
        "matvec {} {rows}×{cols} batch {batch}: error {err:e}",
        T::FLOAT
    );

    // Accumulating into what is there.
    let y0 = rng.vec(batch * rows);
    let mut y = ctx.upload(&y0);
    cuda::matvec(
        &ctx.device,
        &mat,
        xbuf.as_slice(),
        batch,
        &mut y.as_mut_slice(),
        true,
    )
    .unwrap();
    let err = rel_err(
        &ctx.download::<f32>(&y),
        &matvec_reference(&wf, &x, Some(&y0), rows, cols),
    );
    assert!(err < 1e-5, "accumulating matvec: error {err:e}");
}

#[test]
fn matvec_matches_f64_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(1);
    // Vectorised (cols a multiple of 8) and scalar (odd cols) paths, 1 to 8 warps sharing a
    // row (short to long rows), odd row counts, every batch size.
    for (rows, cols) in [(37, 13), (75, 256), (65, 2048), (1001, 1032), (4096, 4096)] {
        for batch in [1, 2, 3, 5, 8] {
            check_matvec::<bf16>(&ctx, &mut rng, rows, cols, batch);
        }
        check_matvec::<f16>(&ctx, &mut rng, rows, cols, 1);
        check_matvec::<f16>(&ctx, &mut rng, rows, cols, 4);
        check_matvec::<f32>(&ctx, &mut rng, rows, cols, 1);
        check_matvec::<f32>(&ctx, &mut rng, rows, cols, 7);
    }
    for batch in [4, 6, 7] {
        check_matvec::<bf16>(&ctx, &mut rng, 129, 520, batch);
    }
    // Long rows, whole and odd (8 warps a row, some lanes a step short), at batch 1.
    for (rows, cols) in [(300, 12288), (77, 5000), (41, 40000)] {
        check_matvec::<bf16>(&ctx, &mut rng, rows, cols, 1);
        check_matvec::<f32>(&ctx, &mut rng, rows, cols, 1);
    }
    // Longer batches: whole blocks of 8 rows in one launch, then the rest.
    for batch in [13, 16, 21] {
        check_matvec::<bf16>(&ctx, &mut rng, 129, 520, batch);
        check_matvec::<f32>(&ctx, &mut rng, 65, 2048, batch);
    }
}

/// `rms_norm(x[b]) · g` in f64.
fn normed_reference(x: &[f32], g: &[f32], eps: f64) -> Vec<f32> {
    let cols = g.len();
    x.chunks(cols)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
            let s = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(g)
                .map(move |(&v, &g)| (v as f64 * s * g as f64) as f32)
        })
        .collect()
}

/// One launch for q, k and v with the RMS norm inside (and biases), and for gate and up with
/// SwiGLU after: each output as the unfused steps give it.
///
/// `scale` multiplies the row counts (many blocks, groups straddling matrices far in).
fn check_fused_matvec<T: Elem>(ctx: &Ctx, rng: &mut Rng, cols: usize, batch: usize, scale: usize) {
    let eps = 1e-6;
    let (x, g) = (rng.vec(batch * cols), rng.vec(cols));
    let (xbuf, gbuf) = (ctx.upload(&x), ctx.upload(&g));
    let normed = normed_reference(&x, &g, eps as f64);
    let norm = MatvecNorm {
        weight: gbuf.as_slice(),
        eps,
    };
    // Row counts that leave groups straddling two matrices.
    let shapes = [37 * scale, 11 * scale, 11 * scale];
    let ws: Vec<Vec<T>> = shapes.iter().map(|&r| round(&rng.vec(r * cols))).collect();
    let biases: Vec<Option<Vec<f32>>> =
        vec![Some(rng.vec(shapes[0])), None, Some(rng.vec(shapes[2]))];
    let wbufs: Vec<DeviceBuffer> = ws.iter().map(|w| ctx.upload(w)).collect();
    let bbufs: Vec<Option<DeviceBuffer>> = biases
        .iter()
        .map(|b| b.as_ref().map(|b| ctx.upload(b)))
        .collect();
    let mats: Vec<DevMat<'_>> = wbufs
        .iter()
        .zip(shapes)
        .map(|(w, rows)| DevMat::from_slice(w.as_slice::<T>(), rows, cols).unwrap())
        .collect();
    let mut ys: Vec<DeviceBuffer> = shapes
        .iter()
        .map(|&r| ctx.poisoned::<f32>(batch * r))
        .collect();
    let mut outputs: Vec<MatvecOutput<'_, '_>> = mats
        .iter()
        .zip(&bbufs)
        .zip(&mut ys)
        .map(|((w, b), y)| MatvecOutput {
            w,
            bias: b.as_ref().map(|b| b.as_slice()),
            y: y.as_mut_slice(),
        })
        .collect();
    cuda::matvec_fused(
        &ctx.device,
        &mut outputs,
        xbuf.as_slice(),
        batch,
        Some(norm),
        Epilogue::Store,
    )
    .unwrap();
    drop(outputs);
    for (i, &rows) in shapes.iter().enumerate() {
        let mut want = matvec_reference(&widen(&ws[i]), &normed, None, rows, cols);
        if let Some(b) = &biases[i] {
            for (k, v) in want.iter_mut().enumerate() {
                *v += b[k % rows] as f64;
            }
        }
        let err = rel_err(&ctx.download::<f32>(&ys[i]), &want);
        assert!(
            err < 1e-5,
            "fused matvec {} output {i} of {cols} cols, batch {batch}: error {err:e}",
            T::FLOAT
        );
    }

    // SwiGLU over gate and up.
    let rows = 45 * scale;
    let (gate, up): (Vec<T>, Vec<T>) = (round(&rng.vec(rows * cols)), round(&rng.vec(rows * cols)));
    let (gbuf_w, ubuf_w) = (ctx.upload(&gate), ctx.upload(&up));
    let gm = DevMat::from_slice(gbuf_w.as_slice::<T>(), rows, cols).unwrap();
    let um = DevMat::from_slice(ubuf_w.as_slice::<T>(), rows, cols).unwrap();
    let (mut gy, mut uy) = (
        ctx.poisoned::<f32>(batch * rows),
        ctx.poisoned::<f32>(batch * rows),
    );
    let mut outputs = [
        MatvecOutput {
            w: &gm,
            bias: None,
            y: gy.as_mut_slice(),
        },
        MatvecOutput {
            w: &um,
            bias: None,
            y: uy.as_mut_slice(),
        },
    ];
    cuda::matvec_fused(
        &ctx.device,
        &mut outputs,
        xbuf.as_slice(),
        batch,
        Some(norm),
        Epilogue::SwiGlu,
    )
    .unwrap();
    let gs = matvec_reference(&widen(&gate), &normed, None, rows, cols);
    let us = matvec_reference(&widen(&up), &normed, None, rows, cols);
    let want: Vec<f64> = gs
        .iter()
        .zip(&us)
        .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    let err = rel_err(&ctx.download::<f32>(&gy), &want);
    assert!(
        err < 1e-5,
        "SwiGLU matvec {} of {cols} cols, batch {batch}: error {err:e}",
        T::FLOAT
    );
}

#[test]
fn fused_matvec_matches_the_unfused_steps() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(11);
    // Scalar (odd) and vectorised columns, short and long rows.
    for cols in [13, 256, 1032, 4096] {
        for batch in [1, 3, 8] {
            check_fused_matvec::<bf16>(&ctx, &mut rng, cols, batch, 1);
        }
        check_fused_matvec::<f32>(&ctx, &mut rng, cols, 2, 1);
        check_fused_matvec::<f16>(&ctx, &mut rng, cols, 5, 1);
    }
    // Thousands of rows, short and long.
    for cols in [1024, 4096, 12288] {
        check_fused_matvec::<bf16>(&ctx, &mut rng, cols, 1, 64);
        check_fused_matvec::<bf16>(&ctx, &mut rng, cols, 2, 64);
    }
}

/// The two products of 16-bit activations and weights: cuBLASLt's and the batch-invariant one.
trait Product {
    fn run<I: FloatElem, O: FloatElem>(
        &mut self,
        a: cuda::DevSlice<'_, I>,
        w: &DevMat<'_>,
        out: &mut cuda::DevSliceMut<'_, O>,
        accumulate: bool,
    ) -> Result<(), CudaError>;
}

macro_rules! product {
    ($gemm:ty) => {
        impl Product for $gemm {
            fn run<I: FloatElem, O: FloatElem>(
                &mut self,
                a: cuda::DevSlice<'_, I>,
                w: &DevMat<'_>,
                out: &mut cuda::DevSliceMut<'_, O>,
                accumulate: bool,
            ) -> Result<(), CudaError> {
                self.matmul(a, w, out, accumulate)
            }
        }
    };
}
product!(Gemm);
product!(SlicedGemm);

fn check_gemm<I: Elem, O: Elem + Default>(
    ctx: &Ctx,
    gemm: &mut impl Product,
    rng: &mut Rng,
    m: usize,
    n: usize,
    k: usize,
) {
    let a: Vec<I> = round(&rng.vec(m * k));
    let w: Vec<I> = round(&rng.vec(n * k));
    let (abuf, wbuf) = (ctx.upload(&a), ctx.upload(&w));
    let mat = DevMat::from_slice(wbuf.as_slice::<I>(), n, k).unwrap();
    let (af, wf) = (widen(&a), widen(&w));
    // out = a·Wᵀ is m matvecs of W.
    let want = matvec_reference(&wf, &af, None, n, k);
    let mut out = ctx.poisoned::<O>(m * n);
    gemm.run(
        abuf.as_slice::<I>(),
        &mat,
        &mut out.as_mut_slice::<O>(),
        false,
    )
    .unwrap();
    let got = widen(&ctx.download::<O>(&out));
    let tolerance = if O::FLOAT == cuda::Float::F32 {
        1e-5
    } else {
        4e-3
    };
    let err = rel_err(&got, &want);
    assert!(
        err < tolerance,
        "gemm {m}×{n}×{k} of {} into {}: error {err:e}",
        I::FLOAT,
        O::FLOAT
    );

    let c0: Vec<O> = round(&rng.vec(m * n));
    let mut out = ctx.upload(&c0);
    gemm.run(
        abuf.as_slice::<I>(),
        &mat,
        &mut out.as_mut_slice::<O>(),
        true,
    )
    .unwrap();
    let want: Vec<f64> = want
        .iter()
        .zip(widen(&c0))
        .map(|(w, c)| w + c as f64)
        .collect();
    let err = rel_err(&widen(&ctx.download::<O>(&out)), &want);
    assert!(err < tolerance, "accumulating gemm: error {err:e}");
}

#[test]
fn gemm_matches_f64_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut gemm = Gemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut sliced = SlicedGemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut rng = Rng(2);
    for (m, n, k) in [(37, 72, 136), (64, 256, 512), (300, 1000, 1024), (5, 8, 8)] {
        check_gemm::<bf16, f32>(&ctx, &mut gemm, &mut rng, m, n, k);
        check_gemm::<bf16, bf16>(&ctx, &mut gemm, &mut rng, m, n, k);
    }
    // The batch-invariant product: every tile, split or not, k not a multiple of a step.
    for (m, n, k) in [
        (1, 72, 136),
        (37, 72, 136),
        (64, 256, 512),
        (300, 1000, 1024),
        (5, 8, 8),
        (1, 4096, 1024),
        (700, 200, 4104),
    ] {
        check_gemm::<bf16, f32>(&ctx, &mut sliced, &mut rng, m, n, k);
        check_gemm::<bf16, bf16>(&ctx, &mut sliced, &mut rng, m, n, k);
        check_gemm::<f16, f32>(&ctx, &mut sliced, &mut rng, m, n, k);
    }
}

/// A row of the batch-invariant product is the same bits whatever batch it comes in: every
/// tile, slices split across blocks or summed in one, a batch of one or of 1200.
#[test]
fn sliced_gemm_gives_a_row_the_same_bits_in_every_batch() {
    let Some(ctx) = Ctx::new() else { return };
    let mut sliced = SlicedGemm::new(&ctx.device, &ctx.owner).unwrap();
    let mut rng = Rng(21);
    // 4096 rows of 1024 take slices of 128: 8 of them, split in blocks up to 128 tokens.
    let (n, k, most) = (4096, 1024, 1200);
    let a: Vec<bf16> = round(&rng.vec(most * k));
    let w: Vec<bf16> = round(&rng.vec(n * k));
    let (abuf, wbuf) = (ctx.upload(&a), ctx.upload(&w));
    let mat = DevMat::from_slice(wbuf.as_slice::<bf16>(), n, k).unwrap();
    let run = |sliced: &mut SlicedGemm, first: usize, m: usize| -> Vec<u32> {
        let mut out = ctx.poisoned::<f32>(m * n);
        let x = abuf.as_slice::<bf16>().slice(first * k..(first + m) * k);
        sliced
            .matmul(x, &mat, &mut out.as_mut_slice::<f32>(), false)
            .unwrap();
        bits(&ctx.download::<f32>(&out))
    };
    let all = run(&mut sliced, 0, most);
    for (first, m) in [
        (0, 1),
        (5, 1),
        (1199, 1),
        (0, 3),
        (2, 8),
        (1, 9),
        (7, 32),
        (0, 40),
        (3, 64),
        (0, 65),
        (100, 600),
    ] {
        let got = run(&mut sliced, first, m);
        assert!(
            got == all[first * n..(first + m) * n],
            "rows {first}..{} alone differ from the same rows in a batch of {most}",
            first + m
        );
    }
    // Every tile, its slices split across blocks or summed in one, whatever the batch.
    for tile in SlicedTile::ALL {
        for split in [false, true] {
            sliced.force_tile(Some((tile, split)));
            for (first, m) in [(0, 1), (3, 64), (100, 300)] {
                let got = run(&mut sliced, first, m);
                assert!(
                    got == all[first * n..(first + m) * n],
                    "rows {first}..{} by {} (split {split}) differ from the planned batch of \
                     {most}",
                    first + m,
                    tile.name()
                );
            }
        }
    }
}

#[test]
fn rms_norm_matches_cpu() {
    let Some(ctx) = Ctx::new() else { return };
    let pool = ThreadPool::new(1);
    let mut rng = Rng(3);
    for (rows, d) in [(5, 1000), (3, 4096), (1, 13)] {
        let x = rng.vec(rows * d);
        let add = rng.vec(rows * d);
        let w = rng.vec(d);
        let eps = 1e-6;
        let (xbuf, wbuf) = (ctx.upload(&x), ctx.upload(&w));
        let mut want = vec![0f32; rows * d];
        cpu::rms_norm(&pool, &x, &w, eps, &mut want);
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();

        let mut out = ctx.poisoned::<f32>(rows * d);
        cuda::rms_norm(
            &ctx.device,
            xbuf.as_slice(),
            wbuf.as_slice(),
            eps,
            &mut out.as_mut_slice::<f32>(),
        )
        .unwrap();
        let err = rel_err(&ctx.download::<f32>(&out), &want64);
        assert!(err < 1e-5, "rms_norm {rows}×{d}: error {err:e}");

        let mut out16 = ctx.poisoned::<bf16>(rows * d);
        cuda::rms_norm(
            &ctx.device,
            xbuf.as_slice(),
            wbuf.as_slice(),
            eps,
            &mut out16.as_mut_slice::<bf16>(),
        )
        .unwrap();
        let err = rel_err(&widen(&ctx.download::<bf16>(&out16)), &want64);
        assert!(err < 4e-3, "rms_norm to bf16: error {err:e}");

        let mut inplace = ctx.upload(&x);
        cuda::rms_norm_in_place(
            &ctx.device,
            &mut inplace.as_mut_slice(),
            wbuf.as_slice(),
            eps,
        )
        .unwrap();
        let err = rel_err(&ctx.download::<f32>(&inplace), &want64);
        assert!(err < 1e-5, "rms_norm in place: error {err:e}");

        // Fused residual add: x becomes x + add, out its norm.
        let mut xs = ctx.upload(&x);
        let addbuf = ctx.upload(&add);
        let mut out = ctx.poisoned::<f32>(rows * d);
        cuda::add_rms_norm(
            &ctx.device,
            &mut xs.as_mut_slice(),
            addbuf.as_slice(),
            wbuf.as_slice(),
            eps,
            &mut out.as_mut_slice::<f32>(),
        )
        .unwrap();
        let sum: Vec<f32> = x.iter().zip(&add).map(|(a, b)| a + b).collect();
        assert_eq!(ctx.download::<f32>(&xs), sum, "the residual add is exact");
        cpu::rms_norm(&pool, &sum, &w, eps, &mut want);
        let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
        let err = rel_err(&ctx.download::<f32>(&out), &want64);
        assert!(err < 1e-5, "add_rms_norm: error {err:e}");
    }
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
fn rope_matches_cpu_in_both_layouts_with_and_without_the_head_norm() {
    let Some(ctx) = Ctx::new() else { return };
    let pool = ThreadPool::new(1);
    let mut rng = Rng(4);
    for (n_heads, head_dim) in [(3, 64), (5, 128), (2, 20)] {
        let (rows, pos0, positions) = (7, 5, 40);
        let (cos, sin) = rope_tables(positions, head_dim, 1e6);
        let (cbuf, sbuf) = (ctx.upload(&cos), ctx.upload(&sin));
        let norm_w = rng.vec(head_dim);
        let nbuf = ctx.upload(&norm_w);
        for layout in [RopeLayout::Halves, RopeLayout::Pairs] {
            for with_norm in [false, true] {
                let x = rng.vec(rows * n_heads * head_dim);
                let mut want = x.clone();
                if with_norm {
                    cpu::rms_norm_in_place(&pool, &mut want, &norm_w, 1e-6);
                }
                let tables = RopeTables {
                    cos: &cos,
                    sin: &sin,
                    layout,
                    // transformers' rotation, which the CUDA kernel computes.
                    fused: false,
                };
                cpu::rope_in_place(&pool, &mut want, n_heads, head_dim, pos0, tables);
                let norm = with_norm.then(|| RopeNorm {
                    weight: nbuf.as_slice(),
                    eps: 1e-6,
                });
                // The position known on the host, and read on the device (a graph's step).
                let pos_buf = ctx.upload(&[pos0 as i32]);
                let mut results = Vec::new();
                for pos in [Position::Host(pos0), Position::Device(pos_buf.as_slice())] {
                    let mut xbuf = ctx.upload(&x);
                    cuda::rope(
                        &ctx.device,
                        &mut xbuf.as_mut_slice(),
                        n_heads,
                        head_dim,
                        pos,
                        cbuf.as_slice(),
                        sbuf.as_slice(),
                        layout,
                        norm,
                    )
                    .unwrap();
                    results.push(ctx.download::<f32>(&xbuf));
                }
                let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                let err = max_abs_err(&results[0], &want64);
                assert!(
                    err < 1e-5,
                    "rope {layout:?} norm {with_norm} {n_heads}×{head_dim}: error {err:e}"
                );
                assert!(
                    bits(&results[0]) == bits(&results[1]),
                    "rope {layout:?} norm {with_norm}: a device position changed the result"
                );

                // Queries and keys in one launch: each as its own launch gives it.
                let (kv_heads, kx) = (1, rng.vec(rows * head_dim));
                let mut kbuf_alone = ctx.upload(&kx);
                cuda::rope(
                    &ctx.device,
                    &mut kbuf_alone.as_mut_slice(),
                    kv_heads,
                    head_dim,
                    Position::Host(pos0),
                    cbuf.as_slice(),
                    sbuf.as_slice(),
                    layout,
                    norm,
                )
                .unwrap();
                let (mut qbuf, mut kbuf) = (ctx.upload(&x), ctx.upload(&kx));
                cuda::rope_qk(
                    &ctx.device,
                    RopeHeads {
                        x: qbuf.as_mut_slice(),
                        n_heads,
                        norm,
                    },
                    Some(RopeHeads {
                        x: kbuf.as_mut_slice(),
                        n_heads: kv_heads,
                        norm,
                    }),
                    head_dim,
                    Position::Device(pos_buf.as_slice()),
                    cbuf.as_slice(),
                    sbuf.as_slice(),
                    layout,
                )
                .unwrap();
                assert!(bits(&ctx.download::<f32>(&qbuf)) == bits(&results[0]));
                assert!(
                    bits(&ctx.download::<f32>(&kbuf)) == bits(&ctx.download::<f32>(&kbuf_alone))
                );
            }
        }
    }
}

#[test]
fn silu_mul_add_and_convert() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(5);
    let n = 1_000_003;
    let gate: Vec<f32> = rng.vec(n).iter().map(|v| v * 8.0).collect();
    let up = rng.vec(n);
    let (gbuf, ubuf) = (ctx.upload(&gate), ctx.upload(&up));
    let want: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(&g, &u)| g as f64 / (1.0 + (-g as f64).exp()) * u as f64)
        .collect();
    let mut out = ctx.poisoned::<f32>(n);
    cuda::silu_mul(
        &ctx.device,
        gbuf.as_slice::<f32>(),
        ubuf.as_slice::<f32>(),
        &mut out.as_mut_slice::<f32>(),
    )
    .unwrap();
    let err = rel_err(&ctx.download::<f32>(&out), &want);
    assert!(err < 1e-6, "silu_mul: error {err:e}");
    let mut out16 = ctx.poisoned::<bf16>(n);
    cuda::silu_mul(
        &ctx.device,
        gbuf.as_slice::<f32>(),
        ubuf.as_slice::<f32>(),
        &mut out16.as_mut_slice::<bf16>(),
    )
    .unwrap();
    let err = rel_err(&widen(&ctx.download::<bf16>(&out16)), &want);
    assert!(err < 4e-3, "silu_mul to bf16: error {err:e}");
    // bf16 inputs (a prompt's gate/up GEMM outputs), on 16 bytes and off them (one by one).
    let (gate16, up16) = (round::<bf16>(&gate), round::<bf16>(&up));
    let want16: Vec<f64> = widen(&gate16)
        .iter()
        .zip(widen(&up16))
        .map(|(&g, u)| g as f64 / (1.0 + (-g as f64).exp()) * u as f64)
        .collect();
    let (g16, u16) = (ctx.upload(&gate16), ctx.upload(&up16));
    for first in [0, 1] {
        let mut out = ctx.poisoned::<bf16>(n - first);
        cuda::silu_mul(
            &ctx.device,
            g16.as_slice::<bf16>().slice(first..n),
            u16.as_slice::<bf16>().slice(first..n),
            &mut out.as_mut_slice::<bf16>(),
        )
        .unwrap();
        let err = rel_err(&widen(&ctx.download::<bf16>(&out)), &want16[first..]);
        assert!(err < 4e-3, "silu_mul bf16 from {first}: error {err:e}");
    }
    let mut g = ctx.upload(&gate);
    cuda::silu_mul_in_place(&ctx.device, &mut g.as_mut_slice(), ubuf.as_slice()).unwrap();
    assert_eq!(ctx.download::<f32>(&g), ctx.download::<f32>(&out));

    let mut x = ctx.upload(&gate);
    cuda::add(&ctx.device, &mut x.as_mut_slice(), ubuf.as_slice()).unwrap();
    let sum: Vec<f32> = gate.iter().zip(&up).map(|(a, b)| a + b).collect();
    assert_eq!(ctx.download::<f32>(&x), sum);

    // Conversions round to nearest even exactly as `half` does, NaN and infinities included.
    let mut values = rng.vec(10_001);
    values.extend([
        f32::NAN,
        f32::INFINITY,
        -0.0,
        1e-40,
        65504.0,
        70000.0,
        3.0e38,
    ]);
    let vbuf = ctx.upload(&values);
    let mut b = ctx.poisoned::<bf16>(values.len());
    cuda::convert(
        &ctx.device,
        vbuf.as_slice::<f32>(),
        &mut b.as_mut_slice::<bf16>(),
    )
    .unwrap();
    let got_b = ctx.download::<bf16>(&b);
    let want_b: Vec<u16> = values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    assert_eq!(
        got_b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want_b
    );
    let mut h = ctx.poisoned::<f16>(values.len());
    cuda::convert(
        &ctx.device,
        vbuf.as_slice::<f32>(),
        &mut h.as_mut_slice::<f16>(),
    )
    .unwrap();
    let got_h: Vec<u16> = ctx
        .download::<f16>(&h)
        .iter()
        .map(|v| v.to_bits())
        .collect();
    for ((g, v), x) in got_h
        .iter()
        .zip(values.iter().map(|&v| f16::from_f32(v).to_bits()))
        .zip(&values)
    {
        // NaN payloads may differ; any NaN is right for a NaN.
        assert!(
            *g == v || (x.is_nan() && f16::from_bits(*g).is_nan()),
            "f16 of {x}: {g:#x} vs {v:#x}"
        );
    }
    let mut back = ctx.poisoned::<f32>(values.len());
    cuda::convert(
        &ctx.device,
        b.as_slice::<bf16>(),
        &mut back.as_mut_slice::<f32>(),
    )
    .unwrap();
    let back = ctx.download::<f32>(&back);
    for (g, w) in back.iter().zip(&got_b) {
        assert!(g.to_bits() == w.to_f32().to_bits() || g.is_nan());
    }
    assert!(
        cuda::convert(
            &ctx.device,
            b.as_slice::<bf16>(),
            &mut h.as_mut_slice::<f16>()
        )
        .is_err(),
        "bf16 to f16 is not built and says so"
    );
}

#[test]
fn embedding_gathers_rows_and_marks_bad_ids() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(6);
    let (vocab, hidden) = (100, 70);
    let table_f = rng.vec(vocab * hidden);
    let tokens: Vec<u32> = vec![0, 99, 42, 42, 100, 7];
    let tbuf = ctx.upload(&tokens);
    fn check<T: Elem>(
        ctx: &Ctx,
        table_f: &[f32],
        tokens: &[u32],
        tbuf: &DeviceBuffer,
        hidden: usize,
    ) {
        let table: Vec<T> = round(table_f);
        let table_buf = ctx.upload(&table);
        let mut out = ctx.poisoned::<f32>(tokens.len() * hidden);
        cuda::embedding(
            &ctx.device,
            table_buf.as_slice::<T>(),
            hidden,
            tbuf.as_slice(),
            &mut out.as_mut_slice(),
        )
        .unwrap();
        let got = ctx.download::<f32>(&out);
        for (i, &t) in tokens.iter().enumerate() {
            let row = &got[i * hidden..(i + 1) * hidden];
            if t as usize * hidden >= table.len() {
                assert!(row.iter().all(|v| v.is_nan()), "bad id {t} gives NaN");
            } else {
                assert_eq!(
                    row,
                    widen(&table[t as usize * hidden..(t as usize + 1) * hidden])
                );
            }
        }
    }
    check::<f32>(&ctx, &table_f, &tokens, &tbuf, hidden);
    check::<bf16>(&ctx, &table_f, &tokens, &tbuf, hidden);
    check::<f16>(&ctx, &table_f, &tokens, &tbuf, hidden);
}

#[test]
fn argmax_takes_the_lowest_index_on_ties_and_never_nan() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(7);
    let vocab = 151_936;
    let rows = 5;
    let mut logits = rng.vec(rows * vocab);
    // Row 1: a tie between a late and an early index, and a NaN above both.
    logits[vocab + 150_000] = 5.0;
    logits[vocab + 1234] = 5.0;
    logits[vocab + 17] = f32::NAN;
    // Row 2: all NaN. Row 3: the maximum at the very end. Row 4: NaN, then only -inf.
    logits[2 * vocab..3 * vocab].fill(f32::NAN);
    logits[4 * vocab - 1] = 9.0;
    logits[4 * vocab..].fill(f32::NEG_INFINITY);
    logits[4 * vocab] = f32::NAN;
    let lbuf = ctx.upload(&logits);
    let mut out = ctx.poisoned::<u32>(rows);
    let mut scratch = ctx.upload(&vec![0u32; cuda::argmax_scratch_len(rows)]);
    // The host's rule, row by row, is what greedy sampling means everywhere.
    let want: Vec<u32> = logits.chunks(vocab).map(cpu::argmax).collect();
    assert_eq!(want[1..], [1234, 0, vocab as u32 - 1, 1]);
    // Twice: the first launch leaves the tickets as it found them.
    for _ in 0..2 {
        cuda::argmax(
            &ctx.device,
            lbuf.as_slice(),
            vocab,
            &mut out.as_mut_slice(),
            None,
            &mut scratch.as_mut_slice(),
        )
        .unwrap();
        assert_eq!(ctx.download::<u32>(&out), want);
    }
    let row_words = cuda::argmax_scratch_len(1);
    let tickets_left = ctx.download::<u32>(&scratch);
    assert!(
        tickets_left
            .chunks(row_words)
            .all(|row| row[row_words - 1] == 0)
    );

    // Rows of one chunk and of a few: ties between chunks and within one, -inf only.
    for n in [1, 5, 2048, 2049, 6000] {
        let mut small = rng.vec(3 * n);
        small[n - 1] = 7.0;
        small[n..2 * n].fill(f32::NEG_INFINITY);
        small[2 * n..].fill(1.0);
        let buf = ctx.upload(&small);
        let mut picks = ctx.poisoned::<u32>(3);
        let want: Vec<u32> = small.chunks(n).map(cpu::argmax).collect();
        let (logits, picks_out) = (buf.as_slice(), &mut picks.as_mut_slice());
        cuda::argmax(
            &ctx.device,
            logits,
            n,
            picks_out,
            None,
            &mut scratch.as_mut_slice(),
        )
        .unwrap();
        assert_eq!(ctx.download::<u32>(&picks), want, "rows of {n}");
    }

    // Fed to the next step: a pass of 3 tokens at 40.. becomes a one-token pass at 43 of
    // row 3's pick, read back through an event as the engine reads picks it ran ahead of.
    let row3 = lbuf.as_slice::<f32>().slice(3 * vocab..4 * vocab);
    let mut pick = ctx.poisoned::<u32>(1);
    let mut feed = ctx.upload(&[40i32, 43, 7, 8, 9]);
    cuda::argmax(
        &ctx.device,
        row3,
        vocab,
        &mut pick.as_mut_slice(),
        Some(&mut feed.as_mut_slice()),
        &mut scratch.as_mut_slice(),
    )
    .unwrap();
    let mut host = [0u32];
    let event = ctx.device.new_event().unwrap();
    // SAFETY: `host` is read only after the event, and outlives it.
    unsafe { ctx.device.download_async(pick.as_slice(), &mut host) }.unwrap();
    ctx.device.mark(&event).unwrap();
    event.wait().unwrap();
    assert_eq!(host, [want[3]]);
    assert_eq!(ctx.download::<i32>(&feed), [43, 44, want[3] as i32, 8, 9]);
    // One row only: the next step takes one token.
    let err = cuda::argmax(
        &ctx.device,
        lbuf.as_slice(),
        vocab,
        &mut out.as_mut_slice(),
        Some(&mut feed.as_mut_slice()),
        &mut scratch.as_mut_slice(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("one row"), "{err}");
    // Scratch for fewer rows than asked for is refused, not overrun.
    let err = cuda::argmax(
        &ctx.device,
        lbuf.as_slice(),
        vocab,
        &mut out.as_mut_slice(),
        None,
        &mut scratch
            .as_mut_slice()
            .slice_mut(0..cuda::argmax_scratch_len(1)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("scratch"), "{err}");
}

/// Causal attention in f64 over the cache as stored: query `i` (at position `pos0 + i`)
/// sees positions `..=pos0 + i`.
fn attention_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    n: usize,
    shape: AttentionShape,
    scale: f32,
) -> Vec<f64> {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim: d,
    } = shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * d;
    let mut out = vec![0f64; n * n_heads * d];
    for i in 0..n {
        for h in 0..n_heads {
            let off = (h / group) * d;
            let qh = &q[(i * n_heads + h) * d..][..d];
            let scores: Vec<f64> = (0..=pos0 + i)
                .map(|t| {
                    (0..d)
                        .map(|e| qh[e] as f64 * k[t * kv_row + off + e] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::MIN, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = weights.iter().sum();
            // Key-outer: a long cache (thousands of keys) stays quick to check.
            let o = &mut out[(i * n_heads + h) * d..][..d];
            for (t, w) in weights.iter().enumerate() {
                let vt = &v[t * kv_row + off..][..d];
                for (o, &x) in o.iter_mut().zip(vt) {
                    *o += w / z * x as f64;
                }
            }
        }
    }
    out
}

/// Positions a test pool's block holds.
const BLOCK: usize = 16;

/// A sequence's keys and values as a KV pool holds them: blocks of [`BLOCK`] positions laid out
/// `[keys, values][BLOCK][kv_row]` (one layer), the sequence's blocks in reverse pool order
/// behind a foreign block 0, and NaN wherever the sequence has no row.
struct Paged {
    pool: DeviceBuffer,
    table: DeviceBuffer,
    kv_row: usize,
    blocks: usize,
}

/// Writes `k` and `v` (`[positions, kv_row]`) at positions `0..` of the sequence whose blocks
/// `table` lists, in a pool of blocks laid out `[keys (BLOCK rows), values (BLOCK rows)]`.
fn write_rows<T: Elem>(pool: &mut [T], table: &[i32], kv_row: usize, k: &[T], v: &[T]) {
    let per_block = 2 * BLOCK * kv_row;
    for t in 0..k.len() / kv_row {
        let at = table[t / BLOCK] as usize * per_block + (t % BLOCK) * kv_row;
        pool[at..at + kv_row].copy_from_slice(&k[t * kv_row..(t + 1) * kv_row]);
        let at = at + BLOCK * kv_row;
        pool[at..at + kv_row].copy_from_slice(&v[t * kv_row..(t + 1) * kv_row]);
    }
}

impl Paged {
    /// `k` and `v` (`[rows, kv_row]`) at positions `0..rows`, in a table covering `capacity`.
    fn new<T: Elem>(ctx: &Ctx, k: &[T], v: &[T], kv_row: usize, capacity: usize) -> Paged {
        let blocks = capacity.div_ceil(BLOCK);
        let stride = 2 * BLOCK * kv_row;
        let mut pool = vec![T::from_f32(f32::NAN); (blocks + 1) * stride];
        let table: Vec<i32> = (0..blocks).map(|i| (blocks - i) as i32).collect();
        write_rows(&mut pool, &table, kv_row, k, v);
        Paged {
            pool: ctx.upload(&pool),
            table: ctx.upload(&table),
            kv_row,
            blocks,
        }
    }

    fn cache<T: Elem>(&self) -> PagedCache<'_, T> {
        PagedCache {
            pool: self.pool.as_slice(),
            keys_offset: 0,
            values_offset: BLOCK * self.kv_row,
            table: self.table.as_slice(),
            block_size: BLOCK,
            block_stride: 2 * BLOCK * self.kv_row,
        }
    }

    fn cache_mut<T: Elem>(&mut self) -> PagedCacheMut<'_, T> {
        PagedCacheMut {
            pool: self.pool.as_mut_slice(),
            keys_offset: 0,
            values_offset: BLOCK * self.kv_row,
            table: self.table.as_slice(),
            block_size: BLOCK,
            block_stride: 2 * BLOCK * self.kv_row,
        }
    }

    /// The sequence's keys and values back in position order, every position the table covers.
    fn rows<T: Elem + Default>(&self, ctx: &Ctx) -> (Vec<T>, Vec<T>) {
        let pool = ctx.download::<T>(&self.pool);
        let (kv_row, stride) = (self.kv_row, 2 * BLOCK * self.kv_row);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for t in 0..self.blocks * BLOCK {
            let at = (self.blocks - t / BLOCK) * stride + (t % BLOCK) * kv_row;
            k.extend_from_slice(&pool[at..at + kv_row]);
            v.extend_from_slice(&pool[at + BLOCK * kv_row..at + BLOCK * kv_row + kv_row]);
        }
        (k, v)
    }
}

fn check_attention<T: Elem>(
    ctx: &Ctx,
    rng: &mut Rng,
    shape: AttentionShape,
    pos0: usize,
    n: usize,
) {
    let AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    } = shape;
    let positions = pos0 + n;
    let kv_len = positions * n_kv_heads * head_dim;
    // Keys scaled up so some scores are large and the softmax is far from uniform.
    let k: Vec<T> = round(&rng.vec(kv_len).iter().map(|x| x * 3.0).collect::<Vec<_>>());
    let v: Vec<T> = round(&rng.vec(kv_len));
    let q = rng.vec(n * n_heads * head_dim);
    let (kf, vf) = (widen(&k), widen(&v));
    let scale = 1.0 / (head_dim as f32).sqrt();
    let kv_row = n_kv_heads * head_dim;
    let (cache, qbuf) = (Paged::new(ctx, &k, &v, kv_row, positions), ctx.upload(&q));
    let what = format!("{} cache, {shape:?}, pos0 {pos0}, n {n}", T::FLOAT);

    let want = attention_reference(&q, &kf, &vf, pos0, n, shape, scale);
    // f32 throughout, then on the tensor cores (heads of 64 and 128) with bf16 operands and
    // so a bf16-sized error.
    let mut split_scratch = ctx.poisoned::<f32>(cuda::attention_prefill_scratch_len(shape));
    for precision in [AttentionPrecision::F32, AttentionPrecision::Bf16] {
        let mut out = ctx.poisoned::<f32>(n * n_heads * head_dim);
        cuda::attention_prefill(
            &ctx.device,
            qbuf.as_slice(),
            cache.cache::<T>(),
            pos0,
            n,
            shape,
            scale,
            precision,
            &mut split_scratch.as_mut_slice(),
            &mut out.as_mut_slice(),
        )
        .unwrap();
        let got = ctx.download::<f32>(&out);
        let (err, bound) = match precision {
            AttentionPrecision::F32 => (max_abs_err(&got, &want), 1e-4),
            AttentionPrecision::Bf16 => (rel_err(&got, &want), 2e-2),
        };
        assert!(
            err < bound,
            "attention_prefill {precision:?}, {what}: error {err:e}"
        );
    }

    // Decode: the last query alone over every position, in f32 and (a 16-bit cache, heads of
    // 64 or 128) on the tensor cores with 16-bit queries and probabilities.
    let q_last = &q[(n - 1) * n_heads * head_dim..];
    let want = attention_reference(q_last, &kf, &vf, positions - 1, 1, shape, scale);
    let qbuf = ctx.upload(q_last);
    // The context read on the device, over a table with poisoned positions past it (as a
    // graph's table is, sized for the whole context): the same bits as the host's context.
    let padded = Paged::new(ctx, &k, &v, kv_row, positions + 40);
    let context_buf = ctx.upload(&[positions as i32]);
    // One scratch for all: each launch must leave its tickets zero for the next.
    let mut scratch = ctx.poisoned::<f32>(cuda::attention_decode_scratch_len(shape));
    cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut scratch.as_mut_slice()).unwrap();
    for precision in [AttentionPrecision::F32, AttentionPrecision::Bf16] {
        let mut results = Vec::new();
        for (context, paged) in [
            (Position::Host(positions), &cache),
            (Position::Device(context_buf.as_slice()), &padded),
        ] {
            let mut out = ctx.poisoned::<f32>(n_heads * head_dim);
            cuda::attention_decode(
                &ctx.device,
                qbuf.as_slice(),
                paged.cache::<T>(),
                context,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
            results.push(ctx.download::<f32>(&out));
        }
        let (err, bound) = match precision {
            AttentionPrecision::F32 => (max_abs_err(&results[0], &want), 1e-4),
            AttentionPrecision::Bf16 => (rel_err(&results[0], &want), 2e-2),
        };
        assert!(
            err < bound,
            "attention_decode {precision:?}, {what}: error {err:e}"
        );
        assert!(
            bits(&results[0]) == bits(&results[1]),
            "attention_decode {precision:?}, {what}: a context read on the device changed the result"
        );
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The decode step's fused path (queries and the new key normalised and rotated, the key and
/// value stored, inside the attention kernel) gives what rope_qk, kv_store and
/// attention_decode give one after the other: the same stored row and the same output, bit for
/// bit, for either layout, with and without the norms, from the
/// first position to many chunks; a context read on the device gives the same bits.
#[test]
fn attention_decode_rope_matches_rope_then_store_then_attention() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(11);
    fn check<T: Elem + Default>(
        ctx: &Ctx,
        rng: &mut Rng,
        shape: AttentionShape,
        pos: usize,
        layout: RopeLayout,
        with_norm: bool,
        precision: AttentionPrecision,
    ) {
        let AttentionShape {
            n_heads,
            n_kv_heads,
            head_dim,
        } = shape;
        let (kv_dim, capacity) = (n_kv_heads * head_dim, pos + 9);
        let (cos, sin) = rope_tables(capacity + 4, head_dim, 1e4);
        let (cbuf, sbuf) = (ctx.upload(&cos), ctx.upload(&sin));
        let norm_w: Vec<f32> = rng.vec(head_dim).iter().map(|x| 1.0 + 0.5 * x).collect();
        let nbuf = ctx.upload(&norm_w);
        let norm = with_norm.then(|| RopeNorm {
            weight: nbuf.as_slice(),
            eps: 1e-6,
        });
        let q = rng.vec(n_heads * head_dim);
        let k: Vec<f32> = rng.vec(kv_dim).iter().map(|x| x * 3.0).collect();
        let v = rng.vec(kv_dim);
        // Earlier positions filled, the step's own and later ones poisoned.
        let mut cache: Vec<f32> = rng.vec(pos * kv_dim).iter().map(|x| x * 3.0).collect();
        cache.resize(capacity * kv_dim, f32::NAN);
        let mut values = rng.vec(pos * kv_dim);
        values.resize(capacity * kv_dim, f32::NAN);
        let (cache, values) = (round::<T>(&cache), round::<T>(&values));
        let scale = 1.0 / (head_dim as f32).sqrt();
        let what = format!(
            "{} cache, {shape:?}, pos {pos}, {layout:?}, norm {with_norm}, {precision:?}",
            T::FLOAT
        );

        // One after the other.
        let (mut qb, mut kb, vb) = (ctx.upload(&q), ctx.upload(&k), ctx.upload(&v));
        let mut paged = Paged::new(ctx, &cache, &values, kv_dim, capacity);
        cuda::rope_qk(
            &ctx.device,
            RopeHeads {
                x: qb.as_mut_slice(),
                n_heads,
                norm,
            },
            Some(RopeHeads {
                x: kb.as_mut_slice(),
                n_heads: n_kv_heads,
                norm,
            }),
            head_dim,
            Position::Host(pos),
            cbuf.as_slice(),
            sbuf.as_slice(),
            layout,
        )
        .unwrap();
        cuda::kv_store(
            &ctx.device,
            kb.as_slice(),
            vb.as_slice(),
            &mut paged.cache_mut::<T>(),
            kv_dim,
            Position::Host(pos),
        )
        .unwrap();
        let mut scratch = ctx.poisoned::<f32>(cuda::attention_decode_scratch_len(shape));
        cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut scratch.as_mut_slice())
            .unwrap();
        let mut want = ctx.poisoned::<f32>(n_heads * head_dim);
        cuda::attention_decode(
            &ctx.device,
            qb.as_slice(),
            paged.cache::<T>(),
            Position::Host(pos + 1),
            shape,
            scale,
            precision,
            &mut scratch.as_mut_slice(),
            &mut want.as_mut_slice(),
        )
        .unwrap();
        let want = ctx.download::<f32>(&want);
        let (want_k, want_v) = paged.rows::<T>(ctx);

        // Fused, the context known on the host and read on the device.
        let (qb, kb) = (ctx.upload(&q), ctx.upload(&k));
        let context_buf = ctx.upload(&[pos as i32 + 1]);
        let mut outs = Vec::new();
        for context in [
            Position::Host(pos + 1),
            Position::Device(context_buf.as_slice()),
        ] {
            let mut paged = Paged::new(ctx, &cache, &values, kv_dim, capacity);
            let mut out = ctx.poisoned::<f32>(n_heads * head_dim);
            let rope = cuda::DecodeRope {
                k_new: kb.as_slice(),
                v_new: vb.as_slice(),
                q_norm: norm,
                k_norm: norm,
                cos: cbuf.as_slice(),
                sin: sbuf.as_slice(),
                layout,
            };
            cuda::attention_decode_rope(
                &ctx.device,
                qb.as_slice(),
                rope,
                &mut paged.cache_mut::<T>(),
                context,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
            let (got_k, got_v) = paged.rows::<T>(ctx);
            let (got_k, got_v) = (widen(&got_k), widen(&got_v));
            // Earlier positions untouched, later ones never written (still NaN).
            let row = pos * kv_dim..(pos + 1) * kv_dim;
            assert!(
                bits(&got_v) == bits(&widen(&want_v)),
                "{what}: stored values"
            );
            assert!(
                bits(&got_k[..row.start]) == bits(&widen(&want_k[..row.start])),
                "{what}"
            );
            assert!(
                got_k[row.end..].iter().all(|x| x.is_nan()),
                "{what}: wrote past the step"
            );
            assert!(
                bits(&got_k[row.clone()]) == bits(&widen(&want_k[row])),
                "{what}: stored key"
            );
            outs.push(ctx.download::<f32>(&out));
        }
        // The same bits: a prompt row (rotated by rope_qk, stored, attending as a decode row
        // under --batch-invariant) must get those of the same position decoded.
        assert!(bits(&outs[0]) == bits(&want), "{what}: output");
        assert!(
            bits(&outs[0]) == bits(&outs[1]),
            "{what}: a context read on the device changed the result"
        );
    }
    let shape = |n_heads, n_kv_heads, head_dim| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    for (s, pos) in [
        (shape(32, 8, 128), 0),
        (shape(32, 8, 128), 37),
        (shape(16, 8, 128), 300),
        (shape(32, 4, 128), 4004),
        (shape(6, 2, 64), 70),
        (shape(20, 1, 80), 130),
    ] {
        for layout in [RopeLayout::Halves, RopeLayout::Pairs] {
            for with_norm in [false, true] {
                let f32 = AttentionPrecision::F32;
                check::<f32>(&ctx, &mut rng, s, pos, layout, with_norm, f32);
                // 16-bit caches on the tensor cores too (heads of 64 and 128).
                for precision in [f32, AttentionPrecision::Bf16] {
                    check::<bf16>(&ctx, &mut rng, s, pos, layout, with_norm, precision);
                }
                check::<f16>(
                    &ctx,
                    &mut rng,
                    s,
                    pos,
                    layout,
                    with_norm,
                    AttentionPrecision::Bf16,
                );
            }
        }
    }
    // Heads whose halves would split a lane's values take the two ops instead.
    // (100: four values a lane, halves of 50.)
    assert!(!cuda::attention_decode_rope_fits(100, RopeLayout::Halves));
    assert!(cuda::attention_decode_rope_fits(100, RopeLayout::Pairs));
    assert!(cuda::attention_decode_rope_fits(128, RopeLayout::Halves));
}

/// Keys and values land at their positions of the sequence's blocks, converted, in one
/// launch; the position read on the device writes the same; rows past the table are dropped,
/// never written out of it.
#[test]
fn kv_store_writes_rows_at_their_positions() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(9);
    fn check<T: Elem + Default>(ctx: &Ctx, rng: &mut Rng) {
        // Two blocks; the rows straddle them.
        let (kv_dim, capacity, rows, pos0) = (24, 2 * BLOCK, 3, BLOCK - 1);
        let (k, v) = (rng.vec(rows * kv_dim), rng.vec(rows * kv_dim));
        let (kb, vb) = (ctx.upload(&k), ctx.upload(&v));
        let pos_buf = ctx.upload(&[pos0 as i32]);
        let empty: [T; 0] = [];
        for pos in [Position::Host(pos0), Position::Device(pos_buf.as_slice())] {
            let mut paged = Paged::new(ctx, &empty, &empty, kv_dim, capacity);
            cuda::kv_store(
                &ctx.device,
                kb.as_slice(),
                vb.as_slice(),
                &mut paged.cache_mut::<T>(),
                kv_dim,
                pos,
            )
            .unwrap();
            let (kc, vc) = paged.rows::<T>(ctx);
            let at = pos0 * kv_dim..(pos0 + rows) * kv_dim;
            let what = T::FLOAT;
            assert_eq!(widen(&kc[at.clone()]), widen(&round::<T>(&k)), "{what}");
            assert_eq!(widen(&vc[at.clone()]), widen(&round::<T>(&v)), "{what}");
            assert!(widen(&kc[..at.start]).iter().all(|x| x.is_nan()));
            assert!(widen(&vc[at.end..]).iter().all(|x| x.is_nan()));
            // The foreign block is untouched.
            let pool = widen(&ctx.download::<T>(&paged.pool));
            assert!(pool[..2 * BLOCK * kv_dim].iter().all(|x| x.is_nan()));
        }
        // Past the table: the host refuses, the device drops the rows that do not fit.
        let mut paged = Paged::new(ctx, &empty, &empty, kv_dim, capacity);
        let late = capacity - 2;
        let err = cuda::kv_store(
            &ctx.device,
            kb.as_slice(),
            vb.as_slice(),
            &mut paged.cache_mut::<T>(),
            kv_dim,
            Position::Host(late),
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("33 positions in a table of 2 blocks of 16"),
            "{err}"
        );
        let late_buf = ctx.upload(&[late as i32]);
        cuda::kv_store(
            &ctx.device,
            kb.as_slice(),
            vb.as_slice(),
            &mut paged.cache_mut::<T>(),
            kv_dim,
            Position::Device(late_buf.as_slice()),
        )
        .unwrap();
        let (kc, _) = paged.rows::<T>(ctx);
        let kc = widen(&kc);
        assert_eq!(
            kc[late * kv_dim..],
            widen(&round::<T>(&k[..2 * kv_dim]))[..]
        );
        let pool = widen(&ctx.download::<T>(&paged.pool));
        assert!(pool[..2 * BLOCK * kv_dim].iter().all(|x| x.is_nan()));
    }
    check::<f32>(&ctx, &mut rng);
    check::<bf16>(&ctx, &mut rng);
    check::<f16>(&ctx, &mut rng);
}

#[test]
fn attention_matches_f64_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(8);
    let shape = |n_heads, n_kv_heads, head_dim| AttentionShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    // Odd head widths (padded lanes), groups of 1 to 20 (more than one block of rows), short
    // and long contexts (one split, many splits).
    let cases = [
        (shape(6, 2, 20), 0, 7),
        (shape(6, 2, 20), 30, 1),
        (shape(8, 8, 64), 3, 33),
        (shape(32, 8, 128), 0, 50),
        (shape(32, 8, 128), 4000, 5),
        (shape(12, 2, 80), 100, 17),
        (shape(20, 1, 128), 64, 16),
        (shape(4, 2, 256), 700, 3),
        // Several tensor-core blocks of queries, with and without earlier positions.
        (shape(8, 2, 64), 0, 130),
        (shape(16, 8, 128), 37, 300),
        // Short chunks over long caches, whose keys split (a chat's next turn): both kernels.
        (shape(32, 8, 128), 8200, 78),
        (shape(8, 2, 64), 2000, 130),
        (shape(6, 2, 20), 1500, 3),
    ];
    for (s, pos0, n) in cases {
        check_attention::<f32>(&ctx, &mut rng, s, pos0, n);
        check_attention::<bf16>(&ctx, &mut rng, s, pos0, n);
    }
    check_attention::<f16>(&ctx, &mut rng, shape(32, 8, 128), 1000, 9);
    check_attention::<f16>(&ctx, &mut rng, shape(8, 2, 64), 70, 150);
    // Three tiles of keys before the queries, a chunk ending one key into a tile.
    check_attention::<bf16>(&ctx, &mut rng, shape(4, 4, 128), 192, 129);
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
    let paged = Paged::new(&ctx, &empty, &empty, 4 * 512, 1);
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

/// One token's routing in f64: softmax over its router logits, the top-k (ties to the lower
/// index), and their weights, renormalised with `normalize`.
fn reference_routes(row: &[f32], routing: cuda::Routing) -> Vec<(usize, f64)> {
    let max = row.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
    let exp: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
    let chosen = &order[..routing.top_k];
    let total: f64 = chosen.iter().map(|&e| exp[e] / sum).sum();
    let weight = |e: usize| {
        let p = exp[e] / sum;
        if routing.normalize { p / total } else { p }
    };
    chosen.iter().map(|&e| (e, weight(e))).collect()
}

/// Where [`cuda::moe_route`] writes, poisoned until it does.
struct RouteBuffers {
    ids: DeviceBuffer,
    weights: DeviceBuffer,
    order: DeviceBuffer,
    tiles: DeviceBuffer,
}

impl RouteBuffers {
    fn new(ctx: &Ctx, routing: &cuda::Routing, tokens: usize, road: ExpertRoad) -> Self {
        let pairs = tokens * routing.top_k;
        RouteBuffers {
            ids: ctx.poisoned::<i32>(pairs),
            weights: ctx.poisoned::<f32>(pairs),
            order: ctx.poisoned::<i32>(pairs),
            tiles: ctx.poisoned::<i32>(routing.tiles_len(tokens, road)),
        }
    }

    fn routes(&mut self, road: ExpertRoad) -> cuda::Routes<'_> {
        cuda::Routes {
            ids: self.ids.as_mut_slice(),
            weights: self.weights.as_mut_slice(),
            order: self.order.as_mut_slice(),
            tiles: self.tiles.as_mut_slice(),
            road,
        }
    }
}

/// The epsilon of the RMS norm inside the MoE tests' gate/up products.
const MOE_NORM_EPS: f32 = 1e-6;

/// A mixture-of-experts layer in f64: softmax over the router logits, the top-k (ties to the
/// lower index), weights renormalised with `normalize`, and the weighted sum of each chosen
/// expert's SwiGLU MLP added to `x` (standing for the residual), the experts reading
/// `rms_norm(x) · norm` where a norm weight is given, else `x`. Returns the experts chosen per
/// token and the residual after the layer.
#[allow(clippy::too_many_arguments)]
fn moe_reference(
    logits: &[f32],
    x: &[f32],
    gate_up: &[f32],
    down: &[f32],
    routing: cuda::Routing,
    hidden: usize,
    width: usize,
    norm: Option<&[f32]>,
) -> (Vec<i32>, Vec<f64>) {
    let experts = routing.experts;
    let tokens = logits.len() / experts;
    // The output is added to the residual, which is `x` here.
    let (mut ids, mut out) = (Vec::new(), x.iter().map(|&v| v as f64).collect::<Vec<_>>());
    for t in 0..tokens {
        let xt = &x[t * hidden..(t + 1) * hidden];
        for (e, weight) in reference_routes(&logits[t * experts..(t + 1) * experts], routing) {
            ids.push(e as i32);
            let dot = |w: &[f32], v: &[f64]| -> f64 {
                w.iter().zip(v).map(|(&a, &b)| a as f64 * b).sum::<f64>()
            };
            let mut xd: Vec<f64> = xt.iter().map(|&v| v as f64).collect();
            if let Some(g) = norm {
                let mean_square = xd.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                let scale = 1.0 / (mean_square + MOE_NORM_EPS as f64).sqrt();
                for (v, &g) in xd.iter_mut().zip(g) {
                    *v *= scale * g as f64;
                }
            }
            let act: Vec<f64> = (0..width)
                .map(|i| {
                    let g = dot(&gate_up[(e * 2 * width + i) * hidden..][..hidden], &xd);
                    let u = dot(
                        &gate_up[(e * 2 * width + width + i) * hidden..][..hidden],
                        &xd,
                    );
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            for h in 0..hidden {
                out[t * hidden + h] +=
                    weight * dot(&down[(e * hidden + h) * width..][..width], &act);
            }
        }
    }
    (ids, out)
}

/// Runs a MoE layer on the device: route, gate and up with SwiGLU (the RMS norm by `norm`'s
/// weight inside, where given), down, combine into a residual that starts as `x`. Returns the
/// experts chosen per pair, the tile list and order, and the residual.
struct MoeRun {
    ids: Vec<i32>,
    tiles: Vec<i32>,
    order: Vec<i32>,
    out: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run_moe(
    ctx: &Ctx,
    logits: &[f32],
    x: &[f32],
    (gate_up, down): (&DeviceBuffer, &DeviceBuffer),
    routing: cuda::Routing,
    (hidden, width): (usize, usize),
    road: cuda::ExpertRoad,
    norm: Option<&DeviceBuffer>,
) -> MoeRun {
    let (experts, k) = (routing.experts, routing.top_k);
    let tokens = logits.len() / experts;
    let pairs = tokens * k;
    let gate_up_mat =
        DevMat::from_slice(gate_up.as_slice::<bf16>(), experts * 2 * width, hidden).unwrap();
    let down_mat = DevMat::from_slice(down.as_slice::<bf16>(), experts * hidden, width).unwrap();
    let first: Vec<Vec<DevMat<'_>>> = (0..experts)
        .map(|e| {
            let base = e * 2 * width;
            vec![
                gate_up_mat.slice_rows(base..base + width),
                gate_up_mat.slice_rows(base + width..base + 2 * width),
            ]
        })
        .collect();
    let second: Vec<Vec<DevMat<'_>>> = (0..experts)
        .map(|e| vec![down_mat.slice_rows(e * hidden..(e + 1) * hidden)])
        .collect();
    // SAFETY: the weight buffers outlive the tables (all live until this function returns).
    let (gate_up_table, down_table) = unsafe {
        (
            cuda::ExpertTable::new(&ctx.device, &ctx.owner, "gate/up", &first).unwrap(),
            cuda::ExpertTable::new(&ctx.device, &ctx.owner, "down", &second).unwrap(),
        )
    };
    let logits_buf = ctx.upload(logits);
    let x_buf = ctx.upload(x);
    let mut buffers = RouteBuffers::new(ctx, &routing, tokens, road);
    let mut act = ctx.poisoned::<f32>(pairs * width);
    let mut expert_out = ctx.poisoned::<f32>(pairs * hidden);
    let mut out = ctx.upload(x);
    let mut routes = buffers.routes(road);
    let dev = &ctx.device;
    cuda::moe_route(dev, logits_buf.as_slice(), tokens, &routing, &mut routes).unwrap();
    let t = routes.tiles(&routing, tokens);
    let norm = norm.map(|g| MatvecNorm {
        weight: g.as_slice(),
        eps: MOE_NORM_EPS,
    });
    if road == cuda::ExpertRoad::TensorCores {
        assert!(norm.is_none(), "experts_mma has no norm form");
        let (act_out, x) = (&mut act.as_mut_slice(), x_buf.as_slice());
        cuda::experts_mma(dev, &gate_up_table, t, x, k, act_out).unwrap();
        let out = &mut expert_out.as_mut_slice();
        cuda::experts_mma(dev, &down_table, t, act.as_slice(), 1, out).unwrap();
    } else {
        let (act_out, x) = (&mut act.as_mut_slice(), x_buf.as_slice());
        cuda::matvec_experts(dev, &gate_up_table, t, x, k, norm, act_out).unwrap();
        let out = &mut expert_out.as_mut_slice();
        cuda::matvec_experts(dev, &down_table, t, act.as_slice(), 1, None, out).unwrap();
    }
    let w = routes.weights.as_slice();
    cuda::moe_combine(
        dev,
        expert_out.as_slice(),
        w,
        k,
        &mut out.as_mut_slice(),
        hidden,
    )
    .unwrap();
    MoeRun {
        ids: ctx.download(&buffers.ids),
        tiles: ctx.download(&buffers.tiles),
        order: ctx.download(&buffers.order),
        out: ctx.download(&out),
    }
}

/// Routing alone, for every size of expert set the kernel keeps in registers (up to 128, 256,
/// 512 and 1024 experts a token): the experts chosen and their weights, for one token (decode's
/// one-warp routing) and for a few.
#[test]
fn moe_routing_takes_every_size_of_expert_set() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(5);
    for experts in [60, 200, 512, 1024] {
        let routing = cuda::Routing {
            experts,
            top_k: 8,
            normalize: true,
        };
        for tokens in [1, 5] {
            let logits: Vec<f32> = rng.vec(tokens * experts).iter().map(|v| v * 4.0).collect();
            let (want_ids, want_weights): (Vec<i32>, Vec<f64>) = logits
                .chunks(experts)
                .flat_map(|row| reference_routes(row, routing))
                .map(|(e, weight)| (e as i32, weight))
                .unzip();
            let road = if tokens == 1 {
                ExpertRoad::Decode
            } else {
                ExpertRoad::Matvec
            };
            let logits_buf = ctx.upload(&logits);
            let mut buffers = RouteBuffers::new(&ctx, &routing, tokens, road);
            let logits = logits_buf.as_slice();
            let mut routes = buffers.routes(road);
            cuda::moe_route(&ctx.device, logits, tokens, &routing, &mut routes).unwrap();
            let what = format!("{experts} experts, {tokens} tokens");
            assert_eq!(ctx.download::<i32>(&buffers.ids), want_ids, "{what}");
            let got = ctx.download::<f32>(&buffers.weights);
            let err = rel_err(&got, &want_weights);
            assert!(err < 1e-5, "{what}: weights off by {err:e}");
        }
    }
}

#[test]
fn moe_routes_on_the_device_and_matches_the_reference() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(11);
    // Tiny (the golden fixtures' shape), and Qwen3-30B-A3B's routing (128 experts, top 8)
    // over narrow experts; one token (decode: a tile per pair) and batches (tiles of 8, and
    // of 64 on the tensor cores).
    for (experts, top_k, normalize, hidden, width) in
        [(8, 2, false, 64, 32), (128, 8, true, 256, 96)]
    {
        let routing = cuda::Routing {
            experts,
            top_k,
            normalize,
        };
        let gate_up: Vec<bf16> = round(&rng.vec(experts * 2 * width * hidden));
        let down: Vec<bf16> = round(&rng.vec(experts * hidden * width));
        let (gate_up_f, down_f) = (widen(&gate_up), widen(&down));
        let (gate_up_buf, down_buf) = (ctx.upload(&gate_up), ctx.upload(&down));
        let norm: Vec<f32> = rng.vec(hidden).iter().map(|v| 0.5 + v.abs()).collect();
        let norm_buf = ctx.upload(&norm);
        let roads = |tokens: usize| match tokens {
            1 => vec![ExpertRoad::Decode],
            2..=8 => vec![ExpertRoad::Matvec],
            _ => vec![ExpertRoad::Matvec, ExpertRoad::TensorCores],
        };
        // 300 tokens of top 2 of 8: each expert's pairs fill more than one tile of 64.
        // One token twice: with ties, and with its experts picked out of index order (which
        // decode's one-warp routing must sort as the batch routing does).
        for (case, tokens) in [1, 1, 3, 37, 300].into_iter().enumerate() {
            let mut logits: Vec<f32> = rng.vec(tokens * experts).iter().map(|v| v * 4.0).collect();
            // The last token's logits all equal: the lowest indices win the ties.
            let ties = case != 1;
            if ties {
                logits[(tokens - 1) * experts..].fill(0.5);
            } else {
                // A permutation of the experts' order (3 is prime to their count).
                for (e, l) in logits.iter_mut().enumerate() {
                    *l = ((e * 3) % experts) as f32 * 0.05;
                }
            }
            let x = rng.vec(tokens * hidden);
            // Gate/up read x as it is, or (the matrix-vector roads) normalise it themselves.
            let cases = roads(tokens).into_iter().flat_map(|road| {
                let normed = (road != ExpertRoad::TensorCores).then_some((road, true));
                [(road, false)].into_iter().chain(normed)
            });
            for (road, normed) in cases {
                let (norm, norm_buf) = if normed {
                    (Some(&norm[..]), Some(&norm_buf))
                } else {
                    (None, None)
                };
                let (ids, want) = moe_reference(
                    &logits, &x, &gate_up_f, &down_f, routing, hidden, width, norm,
                );
                let tail: Vec<i32> = (0..top_k as i32).collect();
                let last = &ids[(tokens - 1) * top_k..];
                if ties {
                    assert_eq!(last, &tail[..], "reference ties");
                } else {
                    assert!(!last.is_sorted(), "{last:?}: experts picked in index order");
                }
                let weights = (&gate_up_buf, &down_buf);
                let shape = (hidden, width);
                let run = run_moe(&ctx, &logits, &x, weights, routing, shape, road, norm_buf);
                let what = format!(
                    "{experts} experts top {top_k}, {tokens} tokens, {road:?}, norm {normed}"
                );
                assert_eq!(run.ids, ids, "{what}: experts chosen");
                // The tensor cores take x and the activations rounded to bf16.
                let tolerance = if road == ExpertRoad::TensorCores {
                    1e-2
                } else {
                    1e-5
                };
                let err = rel_err(&run.out, &want);
                assert!(err < tolerance, "{what}: error {err:e}");

                // The tiles: each expert's pairs in pair order, experts ascending, every
                // pair once.
                let tile_rows = road.tile_rows();
                let mut seen = Vec::new();
                for tile in run.tiles[1..].chunks(3).take(run.tiles[0] as usize) {
                    let (e, first, n) = (tile[0], tile[1] as usize, tile[2] as usize);
                    assert!((1..=tile_rows).contains(&n), "{what}: tile of {n}");
                    for &p in &run.order[first..first + n] {
                        assert_eq!(ids[p as usize], e, "{what}: pair {p} in expert {e}'s tile");
                        seen.push((e, p));
                    }
                }
                let mut sorted = seen.clone();
                sorted.sort();
                assert_eq!(seen, sorted, "{what}: tiles out of order");
                assert_eq!(seen.len(), tokens * top_k, "{what}: pairs in tiles");

                // A token's output alone is its output in the batch, bit for bit, on the same
                // road (and on the decode road, for the matrix-vector one).
                if tokens > 1 {
                    let t = tokens / 2;
                    let mut alone_roads = vec![road];
                    if road == ExpertRoad::Matvec {
                        alone_roads.push(ExpertRoad::Decode);
                    }
                    for alone_road in alone_roads {
                        let alone = run_moe(
                            &ctx,
                            &logits[t * experts..(t + 1) * experts],
                            &x[t * hidden..(t + 1) * hidden],
                            weights,
                            routing,
                            shape,
                            alone_road,
                            norm_buf,
                        );
                        assert_eq!(
                            bits(&alone.out),
                            bits(&run.out[t * hidden..(t + 1) * hidden]),
                            "{what}: token {t} alone on {alone_road:?}"
                        );
                    }
                }
            }
        }
    }
}

/// Several sequences in one pool, each over its own blocks: a table of `stride` entries per
/// sequence, laid end to end, and the pool's blocks dealt out to them in reverse.
struct PagedSequences {
    pool: DeviceBuffer,
    tables: DeviceBuffer,
    kv_row: usize,
    stride: usize,
}

impl PagedSequences {
    /// Sequence `s` holds `keys[s]` and `values[s]` (`[positions, kv_row]`) at `0..`.
    fn new<T: Elem>(
        ctx: &Ctx,
        keys: &[Vec<T>],
        values: &[Vec<T>],
        kv_row: usize,
        stride: usize,
    ) -> Self {
        let per_block = 2 * BLOCK * kv_row;
        let total = keys.len() * stride;
        let mut pool = vec![T::from_f32(f32::NAN); (total + 1) * per_block];
        let tables: Vec<i32> = (0..total).map(|i| (total - i) as i32).collect();
        for (s, (k, v)) in keys.iter().zip(values).enumerate() {
            write_rows(&mut pool, &tables[s * stride..], kv_row, k, v);
        }
        PagedSequences {
            pool: ctx.upload(&pool),
            tables: ctx.upload(&tables),
            kv_row,
            stride,
        }
    }

    /// Sequence `seq`'s cache alone, or every sequence's (`None`: all the tables).
    fn cache_mut<T: Elem>(&mut self, seq: Option<usize>) -> PagedCacheMut<'_, T> {
        let tables = match seq {
            Some(s) => self
                .tables
                .as_slice()
                .slice(s * self.stride..(s + 1) * self.stride),
            None => self.tables.as_slice(),
        };
        PagedCacheMut {
            pool: self.pool.as_mut_slice(),
            keys_offset: 0,
            values_offset: BLOCK * self.kv_row,
            table: tables,
            block_size: BLOCK,
            block_stride: 2 * BLOCK * self.kv_row,
        }
    }
}

/// A decode launch over many sequences' rows (`DecodeRows`: each row its own context and
/// blocks, read on the device; blocks then take several chunks each) gives every row the
/// bits of its own launch, plain and fused (the new key rotated and stored by the kernel),
/// on the CUDA cores and the tensor cores, for contexts from one key to thousands.
#[test]
fn attention_decode_over_many_rows_gives_each_its_bits_alone() {
    let Some(ctx) = Ctx::new() else { return };
    let mut rng = Rng(23);
    fn check<T: Elem + Default>(
        ctx: &Ctx,
        rng: &mut Rng,
        contexts: &[usize],
        precision: AttentionPrecision,
        fused: bool,
    ) {
        let shape = AttentionShape {
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
        };
        let (q_dim, kv_dim) = (
            shape.n_heads * shape.head_dim,
            shape.n_kv_heads * shape.head_dim,
        );
        let seqs = contexts.len();
        let stride = contexts.iter().max().unwrap().div_ceil(BLOCK) + 1;
        let keys: Vec<Vec<T>> = contexts
            .iter()
            .map(|&c| {
                round::<T>(
                    &rng.vec(c * kv_dim)
                        .iter()
                        .map(|x| x * 3.0)
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        let values: Vec<Vec<T>> = contexts
            .iter()
            .map(|&c| round::<T>(&rng.vec(c * kv_dim)))
            .collect();
        // The pass's rows: sequence s's decode row at row 2s + 1 (the even rows another
        // sequence's prompt would hold), at position context - 1.
        let rows = 2 * seqs + 1;
        let q = rng.vec(rows * q_dim);
        let k_new: Vec<f32> = rng.vec(rows * kv_dim).iter().map(|x| x * 3.0).collect();
        let v_new = rng.vec(rows * kv_dim);
        let mut row_pos = vec![0i32; rows];
        let mut row_seq = vec![0i32; rows];
        let decode: Vec<i32> = (0..seqs).map(|s| 2 * s as i32 + 1).collect();
        for (s, &c) in contexts.iter().enumerate() {
            row_pos[2 * s + 1] = c as i32 - 1;
            row_seq[2 * s + 1] = s as i32;
        }
        let (qb, kb, vb) = (ctx.upload(&q), ctx.upload(&k_new), ctx.upload(&v_new));
        let (pos_b, seq_b, rows_b) = (
            ctx.upload(&row_pos),
            ctx.upload(&row_seq),
            ctx.upload(&decode),
        );
        let max_context = contexts.iter().max().unwrap() + 1;
        let (cos, sin) = rope_tables(max_context, shape.head_dim, 1e4);
        let (cbuf, sbuf) = (ctx.upload(&cos), ctx.upload(&sin));
        let rope = |k, v| decode_rope(k, v, cbuf.as_slice(), sbuf.as_slice());
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let what = format!(
            "{} cache, {contexts:?}, {precision:?}, fused {fused}",
            T::FLOAT
        );
        // A fused step's cache: the step's own position not written yet.
        let (keys, values): (Vec<Vec<T>>, Vec<Vec<T>>) = if fused {
            let cut = |x: &Vec<T>| x[..x.len() - kv_dim].to_vec();
            (
                keys.iter().map(cut).collect(),
                values.iter().map(cut).collect(),
            )
        } else {
            (keys, values)
        };

        let slab = cuda::attention_decode_scratch_len(shape);
        let mut scratch = ctx.poisoned::<f32>(slab * seqs);
        cuda::attention_decode_scratch_reset(&ctx.device, shape, &mut scratch.as_mut_slice())
            .unwrap();
        let mut together = PagedSequences::new(ctx, &keys, &values, kv_dim, stride);
        let mut out = ctx.poisoned::<f32>(rows * q_dim);
        let many = cuda::DecodeRows {
            rows: rows_b.as_slice(),
            row_pos: pos_b.as_slice(),
            row_seq: seq_b.as_slice(),
            table_stride: stride,
        };
        if fused {
            cuda::attention_decode_rope(
                &ctx.device,
                qb.as_slice(),
                rope(kb.as_slice(), vb.as_slice()),
                &mut together.cache_mut::<T>(None),
                many,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
        } else {
            cuda::attention_decode(
                &ctx.device,
                qb.as_slice(),
                together.cache_mut::<T>(None).as_ref(),
                many,
                shape,
                scale,
                precision,
                &mut scratch.as_mut_slice(),
                &mut out.as_mut_slice(),
            )
            .unwrap();
        }
        let got = ctx.download::<f32>(&out);
        let got_pool = bits(&widen(&ctx.download::<T>(&together.pool)));

        let mut alone = PagedSequences::new(ctx, &keys, &values, kv_dim, stride);
        for (s, &c) in contexts.iter().enumerate() {
            let row = 2 * s + 1;
            let (qs, ks, vs) = (
                row * q_dim..(row + 1) * q_dim,
                row * kv_dim..(row + 1) * kv_dim,
                row * kv_dim..(row + 1) * kv_dim,
            );
            let mut one = ctx.poisoned::<f32>(q_dim);
            let q_row = qb.as_slice().slice(qs.clone());
            if fused {
                let r = rope(kb.as_slice().slice(ks), vb.as_slice().slice(vs));
                cuda::attention_decode_rope(
                    &ctx.device,
                    q_row,
                    r,
                    &mut alone.cache_mut::<T>(Some(s)),
                    Position::Host(c),
                    shape,
                    scale,
                    precision,
                    &mut scratch.as_mut_slice(),
                    &mut one.as_mut_slice(),
                )
                .unwrap();
            } else {
                cuda::attention_decode(
                    &ctx.device,
                    q_row,
                    alone.cache_mut::<T>(Some(s)).as_ref(),
                    Position::Host(c),
                    shape,
                    scale,
                    precision,
                    &mut scratch.as_mut_slice(),
                    &mut one.as_mut_slice(),
                )
                .unwrap();
            }
            let want = ctx.download::<f32>(&one);
            assert!(
                bits(&got[qs]) == bits(&want),
                "{what}: sequence {s} (context {c}) differs from its launch alone"
            );
        }
        // The rows between were left alone; the stored keys and values are the same.
        assert!(
            got[..q_dim].iter().all(|x| x.is_nan()),
            "{what}: wrote a row not asked for"
        );
        let alone_pool = bits(&widen(&ctx.download::<T>(&alone.pool)));
        assert!(
            got_pool == alone_pool,
            "{what}: the pools differ after the step"
        );
    }
    // Few rows (a block a chunk, as alone) and many (blocks taking several chunks each).
    let few = [1, 700];
    let many: Vec<usize> = (0..24)
        .map(|i| [1, 31, 33, 97, 600, 2100, 5000][i % 7] + i)
        .collect();
    for contexts in [&few[..], &many[..]] {
        for fused in [false, true] {
            check::<bf16>(&ctx, &mut rng, contexts, AttentionPrecision::Bf16, fused);
            check::<bf16>(&ctx, &mut rng, contexts, AttentionPrecision::F32, fused);
            check::<f32>(&ctx, &mut rng, contexts, AttentionPrecision::F32, fused);
        }
    }
}

/// The step's keys and values with the tables that rotate them (no norms).
fn decode_rope<'a>(
    k_new: cuda::DevSlice<'a, f32>,
    v_new: cuda::DevSlice<'a, f32>,
    cos: cuda::DevSlice<'a, f32>,
    sin: cuda::DevSlice<'a, f32>,
) -> cuda::DecodeRope<'a> {
    cuda::DecodeRope {
        k_new,
        v_new,
        q_norm: None,
        k_norm: None,
        cos,
        sin,
        layout: RopeLayout::Halves,
    }
}

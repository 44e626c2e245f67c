#!/usr/bin/env python3
"""Does Hopper's wgmma give an output element the bits mma.sync gives it? (issue 22)

The batch-invariant products hold every row to one sum order: k steps of 16, each an
mma.sync.m16n8k16 adding into one f32 accumulator, whatever the tile. A wgmma kernel could
join that family only if each wgmma.m64nNk16 step adds the same bits as mma.sync's, for every N
(else every sm_90 tile must move to wgmma together). This runs both over the same 64 × K and
K × 256 bf16 operands on a GPU, k step by k step, and compares the f32 results bit for bit:
mma.sync for all 256 columns, wgmma (A in registers, B from shared memory, no swizzle) at
N = 8 ... 256, and (SS) A from shared memory too, for bf16 and f16. Each wgmma run also reports its distance to an f64 product, so a wrong shared
memory layout (garbage) is told from a genuine difference in rounding (close, not equal); the
two readings of the descriptor's byte offsets are both tried, each in its own process.

    python3 scripts/wgmma_bits.py [K]        # on the GPU machine (PyTorch, the driver's libcuda)

Needs only PyTorch (for memory and the reference) and the NVRTC PyTorch brings.
"""

import ctypes
import glob
import os
import subprocess
import sys

SOURCE = r"""
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 pack2(const u16* p) { return (u32)p[0] | ((u32)p[1] << 16); }

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (no swizzle).
__device__ __forceinline__ u64 descriptor(const void* smem, int lbo, int sbo) {
    const u32 addr = (u32)__cvta_generic_to_shared(smem);
    return (u64)((addr >> 4) & 0x3fff) | ((u64)((lbo >> 4) & 0x3fff) << 16) |
           ((u64)((sbo >> 4) & 0x3fff) << 32);
}

// A [64, K] row-major, B [NB, K] row-major (column n of the K x NB product is row n), D [64, NB].
// Warp w: rows 16w .. 16w + 15, every 8 columns in turn, k steps of 16 into one accumulator.
extern "C" __global__ void mma_sync_ref_TYPE(const u16* A, const u16* B, float* D, int K, int NB) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int n0 = 0; n0 < NB; n0 += 8) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        for (int k0 = 0; k0 < K; k0 += 16) {
            const u16* r0 = A + (size_t)(16 * warp + g) * K + k0;
            const u16* r8 = r0 + (size_t)8 * K;
            const u16* bc = B + (size_t)(n0 + g) * K + k0;
            const u32 a0 = pack2(r0 + 2 * t), a1 = pack2(r8 + 2 * t);
            const u32 a2 = pack2(r0 + 2 * t + 8), a3 = pack2(r8 + 2 * t + 8);
            const u32 b0 = pack2(bc + 2 * t), b1 = pack2(bc + 2 * t + 8);
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.TYPE.TYPE.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                "{%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
        float* d0 = D + (size_t)(16 * warp + g) * NB + n0 + 2 * t;
        d0[0] = c[0];
        d0[1] = c[1];
        d0[(size_t)8 * NB] = c[2];
        d0[(size_t)8 * NB + 1] = c[3];
    }
}

// One warpgroup: D[:, :N] = A · B[:N]^T by wgmma.m64nNk16 steps, B's k step in shared memory as
// 8x8 core matrices (8 rows of 16 bytes each, 128 bytes), core (n block nb, k block kb) at
// nb * 256 + kb * 128 bytes; A from registers (the mma.sync fragment) or, with SS, from shared
// memory in the same layout (m blocks for n blocks). The descriptor's two byte offsets `lbo`
// and `sbo` as given (the layout is read one way or the other).

template <int N>
__device__ __forceinline__ void wgmma_step_TYPE(float* d, const u32* a, u64 desc);
template <int N>
__device__ __forceinline__ void wgmma_step_ss_TYPE(float* d, u64 adesc, u64 bdesc);

WGMMA_STEPS

template <int N, bool SS>
__device__ __forceinline__ void wgmma_run_TYPE(const u16* A, const u16* B, float* D, int K, int NB,
                                               int lbo, int sbo) {
    __shared__ __align__(128) unsigned char bs[16384];
    __shared__ __align__(128) unsigned char as[2048];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    float d[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
    for (int k0 = 0; k0 < K; k0 += 16) {
        __syncthreads();
        for (int i = tid; i < N * 2; i += 128) {
            const int n = i >> 1, kb = i & 1;
            const uint4 v = *(const uint4*)(B + (size_t)n * K + k0 + 8 * kb);
            *(uint4*)(bs + (n >> 3) * 256 + kb * 128 + (n & 7) * 16) = v;
        }
        if (SS) {
            const int m = tid >> 1, kb = tid & 1;
            const uint4 v = *(const uint4*)(A + (size_t)m * K + k0 + 8 * kb);
            *(uint4*)(as + (m >> 3) * 256 + kb * 128 + (m & 7) * 16) = v;
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        if (SS) {
            wgmma_step_ss_TYPE<N>(d, descriptor(as, lbo, sbo), descriptor(bs, lbo, sbo));
        } else {
            const u16* r0 = A + (size_t)(16 * warp + g) * K + k0;
            const u16* r8 = r0 + (size_t)8 * K;
            const u32 a[4] = {pack2(r0 + 2 * t), pack2(r8 + 2 * t), pack2(r0 + 2 * t + 8),
                              pack2(r8 + 2 * t + 8)};
            wgmma_step_TYPE<N>(d, a, descriptor(bs, lbo, sbo));
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        float* d0 = D + (size_t)(16 * warp + g) * NB + 8 * j + 2 * t;
        d0[0] = d[4 * j];
        d0[1] = d[4 * j + 1];
        d0[(size_t)8 * NB] = d[4 * j + 2];
        d0[(size_t)8 * NB + 1] = d[4 * j + 3];
    }
}

WGMMA_ENTRIES
"""

WIDTHS = [8, 16, 32, 64, 128, 256]


def steps():
    out = []
    for n in WIDTHS:
        regs = n // 2
        d = ",".join(f"%{i}" for i in range(regs))
        a = ",".join(f"%{regs + i}" for i in range(4))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
        out.append(
            f"template <> __device__ __forceinline__ void wgmma_step_TYPE<{n}>(float* d, const u32* a, u64 desc) {{\n"
            f'    asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 5}, 0;\\n"\n'
            f'        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.TYPE.TYPE {{{d}}}, {{{a}}}, %{regs + 4}, p, 1, 1, 0; }}"\n'
            f"        : {outs}\n"
            f'        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));\n'
            "}\n"
            f"template <> __device__ __forceinline__ void wgmma_step_ss_TYPE<{n}>(float* d, u64 adesc, u64 bdesc) {{\n"
            f'    asm volatile("{{ .reg .pred p; setp.ne.b32 p, %{regs + 2}, 0;\\n"\n'
            f'        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.TYPE.TYPE {{{d}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0; }}"\n'
            f"        : {outs}\n"
            f'        : "l"(adesc), "l"(bdesc), "r"(1));\n'
            "}\n"
        )
    return "\n".join(out)


def entries():
    return "\n".join(
        f'extern "C" __global__ void __launch_bounds__(128) wgmma_{mode}_n{n}_TYPE(const u16* A, const u16* B, float* D, int K, int NB, int lbo, int sbo) {{ wgmma_run_TYPE<{n}, {str(mode == "ss").lower()}>(A, B, D, K, NB, lbo, sbo); }}'
        for n in WIDTHS
        for mode in ["rs", "ss"]
    )


def nvrtc_lib():
    """NVRTC from PyTorch's wheels (or a toolkit), its builtins loaded first from the same
    folder: NVRTC opens them by name, which LD_LIBRARY_PATH would otherwise have to find."""
    import nvidia

    folders = [os.path.join(base, sub) for base in nvidia.__path__
               for sub in ["cu13/lib", "cuda_nvrtc/lib", "cu12/lib"]]
    folders += sorted(glob.glob("/usr/local/cuda*/lib64"))
    for folder in folders:
        found = sorted(glob.glob(os.path.join(folder, "libnvrtc.so*")))
        if found:
            for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
                ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(found[0])
    return ctypes.CDLL("libnvrtc.so")


def compile_cubin(arch):
    body = SOURCE.replace("WGMMA_STEPS", steps()).replace("WGMMA_ENTRIES", entries())
    head, rest = body.split("// A [64, K] row-major", 1)
    rest = "// A [64, K] row-major" + rest
    src = head + "".join(rest.replace("TYPE", t) for t in ["bf16", "f16"])
    nv = nvrtc_lib()
    prog = ctypes.c_void_p()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"wgmma_bits.cu", 0, None, None) == 0
    opts = [b"--std=c++17", f"--gpu-architecture={arch}".encode()]
    status = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    if status:
        sys.exit("NVRTC: " + log.value.decode())
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetCUBIN(prog, cubin)
    return cubin.raw


def run(n, lbo, sbo, k, mode, dtype):
    """One wgmma width and operand mode against mma.sync, in this process; prints one line."""
    import torch

    torch.manual_seed(7)
    kind = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    a = (torch.randn(64, k) * torch.exp(torch.randn(64, k))).to(kind).cuda()
    b = (torch.randn(256, k) * torch.exp(torch.randn(256, k))).to(kind).cuda()
    cuda = ctypes.CDLL("libcuda.so.1")
    cubin = compile_cubin("sm_90a")
    module = ctypes.c_void_p()
    assert cuda.cuModuleLoadData(ctypes.byref(module), cubin) == 0, "cuModuleLoadData"

    def launch(name, out, *ints):
        f = ctypes.c_void_p()
        assert cuda.cuModuleGetFunction(ctypes.byref(f), module, name.encode()) == 0, name
        ptrs = [ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()), ctypes.c_void_p(out.data_ptr())]
        vals = ptrs + [ctypes.c_int(x) for x in ints]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = cuda.cuLaunchKernel(f, 1, 1, 1, 128, 1, 1, 0, stream, params, None)
        assert rc == 0, f"{name}: cuLaunchKernel {rc}"
        torch.cuda.synchronize()

    ref = torch.zeros(64, 256, dtype=torch.float32, device="cuda")
    launch(f"mma_sync_ref_{dtype}", ref, k, 256)
    got = torch.full((64, 256), float("nan"), dtype=torch.float32, device="cuda")
    launch(f"wgmma_{mode}_n{n}_{dtype}", got, k, 256, lbo, sbo)
    exact = (a.double() @ b.double().T)[:, :n]
    scale = exact.abs().max().item()
    err_w = ((got[:, :n].double() - exact).abs().max() / scale).item()
    err_m = ((ref[:, :n].double() - exact).abs().max() / scale).item()
    same = (got[:, :n].view(torch.int32) == ref[:, :n].view(torch.int32)).float().mean().item()
    print(f"{dtype} {mode} n{n:<3} lbo {lbo:3} sbo {sbo:3}: wgmma vs f64 {err_w:.2e} "
          f"(mma.sync {err_m:.2e}), bits equal to mma.sync: {same * 100:.2f}%", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--compile":
        print(len(compile_cubin("sm_90a")), "bytes of cubin")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        n, lbo, sbo, k = map(int, sys.argv[2:6])
        run(n, lbo, sbo, k, sys.argv[6], sys.argv[7])
        return
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    # The descriptor read both ways at one width, then every width, both operand modes and
    # both 16-bit types the way that matches.
    cases = [(8, 256, 128, "rs", "bf16")]
    cases += [(n, 128, 256, mode, dtype) for dtype in ["bf16", "f16"] for mode in ["rs", "ss"]
              for n in WIDTHS]
    for n, lbo, sbo, mode, dtype in cases:
        args = [str(x) for x in (n, lbo, sbo, k)] + [mode, dtype]
        r = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True,
                           text=True, timeout=120)
        line = r.stdout.strip() or (r.stderr.strip().splitlines() or ["no output"])[-1]
        print(line if r.returncode == 0 else f"{dtype} {mode} n{n} lbo {lbo} sbo {sbo}: failed: {line}",
              flush=True)


if __name__ == "__main__":
    main()

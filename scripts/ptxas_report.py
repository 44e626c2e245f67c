#!/usr/bin/env python3
"""Registers, stack and spills of each kernel in a CUDA source, from NVRTC's ptxas (-v), with
no GPU: what a kernel change does to occupancy and local memory before any device time.

    LD_LIBRARY_PATH=<nvidia cu13 lib> python3 scripts/ptxas_report.py sliced_gemm.cu [FILTER] [--arch sm_90]

The file is read from crates/tensor/src/cuda/kernels/ (or `EMBER_KERNEL_SOURCE_DIR`) after
common.cuh and mma.cuh, as kernels.rs prepends them to the tensor-core modules; modules that
need more (the decode attention's instances) are not covered. NVRTC comes from PyPI's
`nvidia-cuda-nvrtc` wheel (`python3 -c 'import nvidia, os; print(os.path.join(
list(nvidia.__path__)[0], "cu13", "lib"))'` is its library folder).
"""

import ctypes
import glob
import os
import sys

KERNELS = os.path.join(os.path.dirname(__file__), "..", "crates", "tensor", "src", "cuda", "kernels")


def nvrtc():
    import nvidia

    lib = os.path.join(list(nvidia.__path__)[0], "cu13", "lib")
    return ctypes.CDLL(sorted(glob.glob(os.path.join(lib, "libnvrtc.so*")))[0])


def main(args):
    arch = "sm_90"
    if "--arch" in args:
        i = args.index("--arch")
        arch = args[i + 1]
        del args[i : i + 2]
    if not args:
        sys.exit(__doc__)
    module, only = args[0], (args[1] if len(args) > 1 else "")
    custom = os.environ.get("EMBER_KERNEL_SOURCE_DIR")

    def read(name):
        for folder in [custom, KERNELS]:
            if folder and os.path.exists(os.path.join(folder, name)):
                return open(os.path.join(folder, name)).read()
        sys.exit(f"no {name}")

    src = "\n".join(read(f) for f in ["common.cuh", "mma.cuh", module])
    nv = nvrtc()
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), module.encode(), 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--std=c++17", f"--gpu-architecture={arch}".encode(), b"-Xptxas=-v"]
    status = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    log = log.value.decode()
    if status:
        sys.exit(log)
    kernel, usage = None, {}
    for line in log.splitlines():
        if "Compiling entry function" in line:
            kernel = line.split("'")[1]
        elif kernel and "Used" in line:
            usage.setdefault(kernel, []).append(line.split(":", 1)[1].strip())
        elif kernel and "stack frame" in line:
            usage.setdefault(kernel, []).append(line.split(".", 1)[1].strip() if "ptxas" in line else line.strip())
    for kernel, lines in sorted(usage.items()):
        if only in kernel:
            print(f"{kernel:<48} {'; '.join(lines)}")


if __name__ == "__main__":
    main(sys.argv[1:])

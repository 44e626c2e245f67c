#!/usr/bin/env python3
"""Makes crates/tensor/tests/fixtures/quant/: a few blocks of each ggml quantized type and the
floats gguf-py's numpy reference dequantizes them to, so ember's decoder is checked against an
implementation it shares no code with.

    pip install gguf numpy && python3 scripts/make_quant_fixtures.py

Per type NAME (lower case): NAME.bin holds the raw blocks, NAME.f32 the expected values
(little-endian f32). Blocks are random bytes with chosen f16 scales (zero, tiny, ordinary,
huge) plus, where gguf-py can quantize the type, a block quantized from random floats.
"""

import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "tensor", "tests", "fixtures", "quant")

# ggml type, block bytes, byte offsets of its f16 scale fields
TYPES = {
    "q8_0": (T.Q8_0, 34, [0]),
    "q4_0": (T.Q4_0, 18, [0]),
    "q4_1": (T.Q4_1, 20, [0, 2]),
    "q4_k": (T.Q4_K, 144, [0, 2]),
    "q5_k": (T.Q5_K, 176, [0, 2]),
    "q6_k": (T.Q6_K, 210, [208]),
}


def f16_bytes(v: float) -> bytes:
    return np.array([v], dtype="<f2").tobytes()


def main() -> None:
    rng = np.random.default_rng(20240601)
    os.makedirs(OUT, exist_ok=True)
    for name, (qtype, size, scale_offsets) in TYPES.items():
        blocks = []
        # Scales (first field, second field): ordinary, huge with tiny (subnormal f16), zero
        # with negative. The 256-element types get fewer blocks to keep the fixture small.
        pairs = [(0.013, 0.009), (60000.0, 6e-8), (0.0, -0.5)]
        if size < 100:
            pairs += [(6e-8, 60000.0), (-0.5, 0.0)]
        for pair in pairs:
            raw = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
            for off, scale in zip(scale_offsets, pair):
                raw[off : off + 2] = f16_bytes(scale)
            blocks.append(bytes(raw))
        # Every quantized value at its maximum (all bits set), ordinary scales.
        raw = bytearray(b"\xff" * size)
        for off in scale_offsets:
            raw[off : off + 2] = f16_bytes(0.25)
        if qtype == T.Q6_K:
            raw[192:208] = bytes([0x7F] * 8 + [0x80] * 8)  # scales +127 and -128
        blocks.append(bytes(raw))
        if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
            x = rng.standard_normal(32).astype(np.float32)
            blocks.append(quants.quantize(x.reshape(1, 32), qtype).tobytes())
        data = b"".join(blocks)
        values = quants.dequantize(np.frombuffer(data, dtype=np.uint8).reshape(len(blocks), size), qtype)
        values = np.asarray(values, dtype="<f4").reshape(-1)
        with open(os.path.join(OUT, f"{name}.bin"), "wb") as f:
            f.write(data)
        with open(os.path.join(OUT, f"{name}.f32"), "wb") as f:
            f.write(values.tobytes())
        print(f"{name}: {len(blocks)} blocks, {len(data)} bytes, {values.size} values")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Adds each step's router gaps to the mixture-of-experts golden fixtures made before
`make_golden.py` recorded them itself (it now does, with the same function).

For every completion of a MoE fixture, the reference model (loaded as `make_golden.py` loads
it: stored dtype, upcast to float32) is run teacher-forced over the prompt and the recorded
greedy tokens, and for each recorded step this writes `router_gaps`: the smallest gap, over the
MoE layers, between the k-th and (k+1)-th router logit at the positions whose routing that
step's logits see first hand (every prompt position for step 0, the step's own position after).

A gap below what an engine's own rounding moves a router logit lets it pick another expert
there, a legitimate difference that the golden test must not call a bug: on CUDA's bf16-GEMM
prompt road, engine activations carry bf16 rounding. Nothing else in the fixtures changes.

Usage: python3 scripts/golden_router_gaps.py   (needs torch and transformers)
"""

import json

import torch
from transformers import Qwen3MoeForCausalLM

from make_golden import OUT_DIR, load_reference, step_router_gaps, to_json


def main():
    for fixture in sorted(OUT_DIR.glob("qwen3moe-*")):
        path = fixture / "expected.json"
        expected = json.loads(path.read_text(encoding="utf-8"))
        stored = getattr(torch, expected["dtype"])
        model = load_reference(fixture, Qwen3MoeForCausalLM, stored)
        top_k = model.config.num_experts_per_tok
        for case in expected["completions"]:
            case["router_gaps"] = step_router_gaps(
                model, case["input_ids"], case["generated_ids"], top_k
            )
        text = to_json(expected) + "\n"
        assert json.loads(text) == expected
        path.write_text(text, encoding="utf-8")
        low = min(g for c in expected["completions"] for g in c["router_gaps"])
        print(f"{fixture.name}: smallest step router gap {low:.4g}")


if __name__ == "__main__":
    main()

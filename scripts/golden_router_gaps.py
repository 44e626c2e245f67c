#!/usr/bin/env python3
"""Adds each step's router gaps to the mixture-of-experts golden fixtures.

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

from make_golden import OUT_DIR, load_reference, to_json


@torch.no_grad()
def step_gaps(model, prompt: list, generated: list, top_k: int) -> list:
    gaps = []  # per layer: [positions] gap

    def hook(_mod, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        logits = logits.float().reshape(-1, logits.shape[-1])
        top = torch.topk(logits, top_k + 1, dim=-1).values
        gaps.append(top[:, top_k - 1] - top[:, top_k])

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    ids = prompt + generated[:-1]  # the last token's own step is never run
    model(torch.tensor([ids], dtype=torch.long))
    for h in handles:
        h.remove()
    per_position = torch.stack(gaps).min(dim=0).values  # over layers
    n = len(prompt)
    steps = [float(per_position[:n].min())]
    steps += [float(per_position[n + s - 1]) for s in range(1, len(generated))]
    return steps


def main():
    for fixture in sorted(OUT_DIR.glob("qwen3moe-*")):
        path = fixture / "expected.json"
        expected = json.loads(path.read_text(encoding="utf-8"))
        stored = getattr(torch, expected["dtype"])
        model = load_reference(fixture, Qwen3MoeForCausalLM, stored)
        top_k = model.config.num_experts_per_tok
        for case in expected["completions"]:
            case["router_gaps"] = step_gaps(model, case["input_ids"], case["generated_ids"], top_k)
        text = to_json(expected) + "\n"
        assert json.loads(text) == expected
        path.write_text(text, encoding="utf-8")
        low = min(g for c in expected["completions"] for g in c["router_gaps"])
        print(f"{fixture.name}: smallest step router gap {low:.4g}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The same decode benchmark as `ember bench decode`, in PyTorch + transformers, on a GPU.

Loads a Hugging Face checkpoint (e.g. one written by `ember gen-checkpoint`) in bf16, prefills a
fixed pseudo-random prompt, then greedily decodes with a static KV cache, eager and (when it
works here) with torch.compile. Prints one JSON line per mode with medians, to be read beside
`ember bench decode --device cuda --json` run on the same checkpoint in the same session.

    python3 scripts/torch_decode_bench.py CHECKPOINT_DIR [--prompt-tokens 512] [--decode-tokens 128]
        [--repeats 3] [--modes eager,generate,compile]
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def prompt_ids(n, vocab):
    state, ids = 0x12345678, []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        ids.append((state >> 33) % vocab)
    return ids


def run(model, ids, decode_tokens, repeats):
    from transformers import StaticCache

    prefill, decode = [], []
    for _ in range(repeats):
        cache = StaticCache(config=model.config, max_batch_size=1,
                            max_cache_len=len(ids) + decode_tokens + 1,
                            device="cuda", dtype=torch.bfloat16)
        x = torch.tensor([ids], device="cuda")
        pos = torch.arange(len(ids), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            logits = model(x, past_key_values=cache, cache_position=pos, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        prefill.append(len(ids) / (time.perf_counter() - t))
        t = time.perf_counter()
        with torch.no_grad():
            for i in range(decode_tokens):
                p = torch.tensor([len(ids) + i], device="cuda")
                logits = model(token, past_key_values=cache, cache_position=p, use_cache=True).logits
                token = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        decode.append(decode_tokens / (time.perf_counter() - t))
    return statistics.median(prefill), statistics.median(decode)


def run_generate(model, ids, decode_tokens, repeats):
    """transformers' own generate() with a static cache, which compiles the forward pass by
    itself: decode rate from the difference of a 1-token and a (1 + decode)-token generation."""
    x = torch.tensor([ids], device="cuda")

    def timed(new_tokens):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(decode_tokens + 1)  # compile and warm up
    prefill, decode = [], []
    for _ in range(repeats):
        first = timed(1)
        whole = timed(decode_tokens + 1)
        prefill.append(len(ids) / first)
        decode.append(decode_tokens / (whole - first))
    return statistics.median(prefill), statistics.median(decode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="eager,generate,compile",
                    help="comma-separated: eager, generate (generate() with a static cache, which "
                         "transformers compiles), compile (torch.compile reduce-overhead)")
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.bfloat16).cuda().eval()
    ids = prompt_ids(a.prompt_tokens, model.config.vocab_size)
    # "compile" last: torch.compile with CUDA graphs has crashed the process here (torch
    # 2.11 on the H200 machine: a segfault, December 2026).
    order = ["eager", "generate", "compile"]
    wanted = a.modes.split(",")
    modes = [m for m in order if m in wanted]
    for mode in modes:
        try:
            if mode == "generate":
                pp, tg = run_generate(model, ids, a.decode_tokens, a.repeats)
                print(json.dumps({"torch": torch.__version__, "mode": mode,
                                  "checkpoint": a.checkpoint, "prefill_tok_s": round(pp, 1),
                                  "decode_tok_s": round(tg, 2)}), flush=True)
                continue
            if mode == "compile":
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
                run(model, ids[:16], 4, 1)  # compile before timing
            pp, tg = run(model, ids, a.decode_tokens, a.repeats)
            print(json.dumps({"torch": torch.__version__, "mode": mode, "checkpoint": a.checkpoint,
                              "prefill_tok_s": round(pp, 1), "decode_tok_s": round(tg, 2)}), flush=True)
        except Exception as e:  # a mode that fails here is reported, not fatal
            print(json.dumps({"mode": mode, "error": f"{type(e).__name__}: {e}"[:300]}), flush=True)


if __name__ == "__main__":
    main()

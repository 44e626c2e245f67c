#!/usr/bin/env python3
"""Record llama.cpp reference continuations for real GGUF models.

For every GGUF model given on the command line this writes
crates/engine/tests/fixtures/llamacpp/<model-name>.json, where <model-name> is
the file name lower-cased with the quantisation suffix joined by '-', e.g.

    models/SmolLM2-135M-Instruct.Q4_1.gguf
        -> crates/engine/tests/fixtures/llamacpp/smollm2-135m-instruct-q4_1.json
    models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf
        -> crates/engine/tests/fixtures/llamacpp/qwen2.5-coder-1.5b-instruct-q4_k_m.json

What is recorded (see the "format" key in each file):

  * llama-cpp-python's version and the llama.cpp commit it vendors, the
    model's sha256 / size, n_vocab, BOS/EOS ids, the effective add_bos flag and
    the GGUF's scalar metadata (including tokenizer.chat_template);
  * for each of PROMPTS (raw text, no chat template): the prompt's token ids
    (llama.tokenize(prompt, add_bos=<model's add_bos>, special=False)), the 48
    greedily chosen token ids (argmax over the last-position logits after each
    llama.eval, i.e. temperature 0 / top_k 1 / no repetition penalty; EOS does
    not stop the loop), their decoded text, and per step the top-2 token ids,
    their logits and the top1-top2 margin, so a divergence in another engine can
    be judged against how close llama.cpp's own choice was;
  * a cross-check: llama.generate(temp=0, top_k=1, repeat_penalty=1.0) must give
    the same 48 ids as the argmax loop (recorded as "generate_matches_argmax");
  * with --tokenizer-extras (default for SmolLM2 models): the tokenisation of
    TOKENIZER_EXTRAS with special=True and special=False.

No full logit arrays are stored, so each file stays small.

Needs `pip install llama-cpp-python` (builds llama.cpp from source) and the
models from scripts/fetch-model:

    scripts/fetch-model smollm2
    scripts/fetch-model qwen2.5-coder-1.5b
    python3 scripts/record_llamacpp.py models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf

Model construction follows the fixtures' contract exactly:
Llama(model_path, n_ctx=512, n_threads=2, n_batch=1, n_ubatch=1, seed=0, logits_all=False,
verbose=False).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "crates", "engine", "tests", "fixtures", "llamacpp")

N_GEN = 48
N_CTX = 512
N_THREADS = 2
N_BATCH = 1

# llama.cpp commit vendored by each llama-cpp-python release we have used
# (from the release's CHANGELOG / the sdist's vendor/llama.cpp/.git).
LLAMA_CPP_COMMITS = {
    "0.3.36": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
}

PROMPTS = [
    ("capital", "The capital of France is"),
    ("code", "def fibonacci(n):"),
    ("story", "Once upon a time,"),
    ("counting", "1, 2, 3, 4, 5, 6,"),
    ("list", "Here is a list of fruits:\n1. Apple\n2. Banana\n3."),
    ("question", "Q: What is the boiling point of water at sea level in degrees Celsius?\nA:"),
    ("non_ascii", "Le café est"),
    (
        "paragraph",
        "The Industrial Revolution began in Great Britain in the late eighteenth century "
        "and spread to continental Europe and North America during the nineteenth. It "
        "replaced hand production with machines, new chemical processes and iron "
        "production, and it made steam power and the factory system common. Historians "
        "still argue about its causes, but most agree that one of its most important "
        "consequences was",
    ),
]

TOKENIZER_EXTRAS = [
    ("chat_markup", "<|im_start|>user\nHi<|im_end|>\n"),
    ("emoji", "Hello 👋 world 🌍🚀! 😀"),
    ("accents", "Crème brûlée, naïve façade, Ångström, ñandú, Straße"),
    ("whitespace_digits", "  two leading spaces\n\n\ttab\r\nCRLF 1234567 3.14159   trailing  "),
    ("cjk_mixed", "東京タワー は 333m です。 Привет, мир! x<|endoftext|>y"),
]


def model_name_for(path: str) -> str:
    stem = os.path.basename(path)
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    stem = stem.lower()
    if "." in stem:
        base, quant = stem.rsplit(".", 1)
        if re.fullmatch(r"(q\d.*|f16|f32|bf16|iq\d.*)", quant):
            stem = f"{base}-{quant}"
    return stem


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def last_logits(llama, llama_cpp) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llama._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llama.n_vocab(),)).copy()


def as_text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


def rnd(x) -> float:
    return round(float(x), 5)


def greedy_argmax(llama, llama_cpp, prompt_ids):
    """Greedy loop over llama.eval + argmax of the last position's logits."""
    llama.reset()
    llama.eval(prompt_ids)
    out = {"ids": [], "top1_logit": [], "top2_id": [], "top2_logit": [], "margin": []}
    for step in range(N_GEN):
        logits = last_logits(llama, llama_cpp)
        top2 = np.argpartition(-logits, 2)[:2]
        top2 = top2[np.argsort(-logits[top2], kind="stable")]
        best = int(np.argmax(logits))  # lowest id on an exact tie
        second = int(top2[1]) if int(top2[0]) == best else int(top2[0])
        out["ids"].append(best)
        out["top1_logit"].append(rnd(logits[best]))
        out["top2_id"].append(second)
        out["top2_logit"].append(rnd(logits[second]))
        out["margin"].append(rnd(logits[best] - logits[second]))
        if step + 1 < N_GEN:
            llama.eval([best])
    return out


def greedy_generate(llama, prompt_ids):
    llama.reset()
    ids = []
    for tok in llama.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0, reset=True):
        ids.append(int(tok))
        if len(ids) == N_GEN:
            break
    return ids


def record(path: str, tokenizer_extras: bool | None) -> str:
    import llama_cpp
    from llama_cpp import Llama

    t0 = time.time()
    # One token per batch: llama.cpp then computes every prompt token with its one-token
    # kernels, the arithmetic ember uses for every row (a row's result must not depend on how
    # a prompt is split, so that a prompt resumed from ember's cache equals a cold one).
    llama = Llama(model_path=path, n_ctx=N_CTX, n_threads=N_THREADS, seed=0,
                  n_batch=N_BATCH, n_ubatch=N_BATCH, logits_all=False, verbose=False)
    md = dict(llama.metadata)
    add_bos = bool(llama._model.add_bos_token())
    eos = int(llama.token_eos())
    name = model_name_for(path)
    if tokenizer_extras is None:
        tokenizer_extras = name.startswith("smollm2")

    version = llama_cpp.__version__
    fixture = {
        "format": "ember llama.cpp reference v1: greedy (argmax) continuations, "
                  "raw prompts, no chat template; logits are llama.cpp's raw "
                  "last-position logits (rounded to 5 decimals); margin = top1 - top2",
        "generator": "scripts/record_llamacpp.py",
        "llama_cpp_python_version": version,
        "llama_cpp_commit": LLAMA_CPP_COMMITS.get(version, "unknown"),
        "llama_cpp_system_info": as_text(llama_cpp.llama_print_system_info()).strip(),
        "machine": platform.machine(),
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "n_batch": N_BATCH,
                     "n_ubatch": N_BATCH, "seed": 0, "logits_all": False,
                     "temperature": 0.0, "top_k": 1, "repeat_penalty": 1.0,
                     "n_generate": N_GEN, "stop_at_eos": False},
        "model": {
            "file": os.path.basename(path),
            "name": name,
            "sha256": sha256_of(path),
            "size": os.path.getsize(path),
            "n_vocab": int(llama.n_vocab()),
            "bos_id": int(llama.token_bos()),
            "eos_id": eos,
            "add_bos": add_bos,
            "add_bos_metadata": md.get("tokenizer.ggml.add_bos_token"),
            "chat_template": md.get("tokenizer.chat_template"),
            "metadata": {k: v for k, v in sorted(md.items())
                         if k != "tokenizer.chat_template"},
        },
        "prompts": [],
    }

    for key, prompt in PROMPTS:
        prompt_ids = llama.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=False)
        g = greedy_argmax(llama, llama_cpp, prompt_ids)
        gen_ids = greedy_generate(llama, prompt_ids)
        entry = {
            "name": key,
            "prompt": prompt,
            "prompt_ids": [int(t) for t in prompt_ids],
            "generated_ids": g["ids"],
            "generated_text": as_text(llama.detokenize(g["ids"])),
            "first_eos_index": g["ids"].index(eos) if eos in g["ids"] else None,
            "generate_matches_argmax": gen_ids == g["ids"],
            "min_margin": min(g["margin"]),
            "min_margin_step": int(np.argmin(g["margin"])),
            "top1_logit": g["top1_logit"],
            "top2_id": g["top2_id"],
            "top2_logit": g["top2_logit"],
            "margin": g["margin"],
        }
        if gen_ids != g["ids"]:
            entry["generate_ids"] = gen_ids
        fixture["prompts"].append(entry)
        print(f"  {key:10s} prompt {len(prompt_ids):3d} tok, min margin {entry['min_margin']:.4f} "
              f"at step {entry['min_margin_step']:2d}, generate==argmax: "
              f"{entry['generate_matches_argmax']}, text: {entry['generated_text'][:60]!r}",
              file=sys.stderr)

    if tokenizer_extras:
        extras = []
        for key, text in TOKENIZER_EXTRAS:
            ids_sp = [int(t) for t in llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)]
            ids_nosp = [int(t) for t in llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)]
            extras.append({
                "name": key,
                "text": text,
                "add_bos": add_bos,
                "ids_special": ids_sp,
                "ids_no_special": ids_nosp,
                "detokenized_special": as_text(llama.detokenize(ids_sp, special=True)),
            })
        fixture["tokenizer_extras"] = extras

    os.makedirs(OUT_DIR, exist_ok=True)
    out = os.path.join(OUT_DIR, f"{name}.json")
    with open(out, "w", encoding="utf-8") as f:
        f.write(dumps(fixture))
        f.write("\n")
    print(f"wrote {out} ({os.path.getsize(out):,} bytes, {time.time() - t0:.0f} s)", file=sys.stderr)
    del llama
    return out


def dumps(obj, indent: int = 0) -> str:
    """JSON with objects indented but lists of scalars kept on one line."""
    pad = "  " * (indent + 1)
    end = "  " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {dumps(v, indent + 1)}"
                 for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, list):
        if all(not isinstance(v, (dict, list)) for v in obj):
            return "[" + ", ".join(json.dumps(v, ensure_ascii=False) for v in obj) + "]"
        return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in obj) + "\n" + end + "]"
    return json.dumps(obj, ensure_ascii=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="GGUF model files")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--tokenizer-extras", dest="extras", action="store_true", default=None,
                   help="also record the extra tokenizer strings (default: SmolLM2 only)")
    g.add_argument("--no-tokenizer-extras", dest="extras", action="store_false")
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        sys.exit("record_llamacpp.py: llama_cpp not importable: pip install llama-cpp-python")
    for path in args.models:
        if not os.path.isfile(path):
            sys.exit(f"record_llamacpp.py: no such model file: {path} (see scripts/fetch-model)")
        print(f"recording {path}", file=sys.stderr)
        record(path, args.extras)


if __name__ == "__main__":
    main()

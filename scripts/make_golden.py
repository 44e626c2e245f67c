#!/usr/bin/env python3
"""Generate the "golden" test fixtures for ember's engine crate.

For each of nine tiny, randomly initialised Hugging Face checkpoints
(Qwen3, Qwen3-MoE, Qwen2, Llama 3, each stored as float32 and as bfloat16;
and a bfloat16 Qwen3 with heads of 128, for CUDA's tensor-core decode)
this script writes, under crates/engine/tests/fixtures/golden/<name>/:

  * the checkpoint exactly as `save_pretrained` lays it out (config.json,
    generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, chat_template.jinja, ...), and
  * expected.json: transformers' own reference outputs for that checkpoint
    (tokenisation, greedy completions with top-5 log-probs and top1-top2
    margins, rendered chat templates, decodes).

The reference always runs in float32 on CPU: the saved checkpoint is loaded
back from disk (bf16 checkpoints are loaded as bf16 and then `.float()`-ed)
and a manual greedy loop recomputes the full sequence at every step.

Everything is deterministic (fixed seeds, a small built-in corpus for the
byte-level BPE tokenizers).  Seeds are searched deterministically until the
greedy top1-top2 log-prob margin is >= MIN_MARGIN at every recorded step
(and, for MoE, the router's k-th vs (k+1)-th expert gap is not a near-tie).

Rerun (needs `pip install torch transformers`; no network / HF hub needed):

    python3 scripts/make_golden.py              # all nine fixtures (~10 s on CPU)
    python3 scripts/make_golden.py qwen3moe     # only fixtures whose name contains an argument

Existing fixture directories are deleted and rewritten.  Output is byte-for-byte
reproducible with the same transformers / torch / tokenizers versions (the
versions used are recorded in every expected.json).
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "crates" / "engine" / "tests" / "fixtures" / "golden"

NEW_TOKENS = 12  # greedy tokens generated per completion prompt
TOP_K = 5  # top log-probs recorded per step
MIN_MARGIN = 2e-3  # min top1-top2 log-prob margin accepted at any step
MIN_ROUTER_MARGIN = 1e-3  # min gap between k-th and (k+1)-th router logit (MoE)
MAX_SEED_TRIES = 200
LEARNED_VOCAB = 400  # BPE vocab (256 bytes + merges); specials are appended after
QWEN_CONFIG_VOCAB = 416  # Qwen configs pad vocab_size past len(tokenizer)

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)  # reproducible reductions on CPU

# --------------------------------------------------------------------------
# Tokenizer corpus and prompts
# --------------------------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog did not seem to mind.",
    "Once upon a time, in a small village by the sea, there lived an old "
    "fisherman and his wife. Every morning he went out in his little boat, and "
    "every evening he came back with the day's catch.",
    "Language models read text as a sequence of tokens. Each token is mapped to "
    "a vector, and the model predicts the next token from the ones before it.",
    "In 1969, two astronauts walked on the Moon. The mission lasted 8 days, 3 "
    "hours and 18 minutes; the crew returned safely on July 24.",
    "Hello, world! How are you today? I'm fine, thanks -- and you?",
    "Prices: $3.50, $12.99, 100%, 42, 7, 0.001, 2+2=4, (a+b)*c, x^2, [1, 2, 3].",
    "She said: \"Don't worry; we'll be there at 10:30.\" He replied, 'OK!'",
    "We met at a café in Paris. It was a naïve idea, but the crème brûlée was good.",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "Emoji are bytes too 🙂 🚀 ✨ and so are accents: déjà vu, Zürich, São Paulo.",
    "Thinking step by step: first add the numbers, then divide by two. "
    "The answer is the average.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "user: What is the capital of France?\nassistant: The capital of France is Paris.",
    "A system prompt tells the assistant how to behave. Be helpful, honest and brief.",
    "The weather was cold and grey, so they stayed inside and read their books. "
    "Later in the afternoon the rain stopped, the sun came out, and the children "
    "ran outside to play in the garden with the dog.",
    "To make bread, mix flour, water, salt and yeast. Let the dough rest for two "
    "hours, then shape it and bake it in a hot oven for about forty minutes.",
    "The small model has three layers, four heads and a tiny vocabulary. It is not "
    "trained, so its answers are random, but they are the same every time.",
    "Numbers and dates: 2024-01-15, 3.14159, 1,000,000, #42, 50/50, v1.2.3.",
    "Questions? Answers! Lists: apples, oranges, pears; colours: red, green, blue.",
    "He walked to the station, bought a ticket and waited for the train. When it "
    "finally arrived, it was full, so he stood by the door all the way home.",
]

PROMPTS = [
    "The quick brown fox",
    "Hello, world! 123",
    "We met at a café in 日本 🙂 naïve, cafe\u0301",  # last é is decomposed (NFC test)
    "Once upon a time, in a small village by the sea, there lived an old "
    "fisherman and his wife. Every morning he went out in his little boat.",
    "<think>\nAdd the numbers.\n</think>\n\nThe answer is",
]

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>"]  # added, but NOT special (as in Qwen3)
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# --------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------

# Qwen3-style ChatML (no tool support): strips <think> blocks from assistant
# turns before the last user query, keeps them after it, and honours
# enable_thinking=false by pre-filling an empty think block.
QWEN3_CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content.strip() + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif not (message.role == "system" and loop.first) %}
        {{- raise_exception('Unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Qwen2 / Qwen2.5-style plain ChatML with a default system message.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-3-Instruct template (as shipped with Meta-Llama-3-8B-Instruct).
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

QWEN3_CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "chat_template_kwargs": {},
    },
    {
        "messages": [
            {"role": "user", "content": "Name a fruit."},
            {
                "role": "assistant",
                "content": "<think>\nThe user wants any fruit.\n</think>\n\nApple.",
            },
            {"role": "user", "content": "Another one, in 日本語 please 🙂"},
        ],
        "chat_template_kwargs": {},
    },
    {
        "messages": [{"role": "user", "content": "Hello, café!"}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    {
        # Assistant turn after the last user query keeps its reasoning
        # (reasoning_content field, stripped of surrounding newlines).
        "messages": [
            {"role": "system", "content": "Think first."},
            {"role": "user", "content": "Why is the sky blue?"},
            {
                "role": "assistant",
                "reasoning_content": "\nRayleigh scattering.\n",
                "content": "\nBecause of scattering.",
            },
        ],
        "chat_template_kwargs": {"enable_thinking": True},
    },
]

GENERIC_CHATS = [
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        "chat_template_kwargs": {},
    },
    {
        "messages": [
            {"role": "user", "content": "  Name a fruit.  "},
            {"role": "assistant", "content": "<think>\nAny fruit.\n</think>\n\nApple."},
            {"role": "user", "content": "Another one, in 日本語 please 🙂\n"},
        ],
        "chat_template_kwargs": {},
    },
    {
        "messages": [{"role": "user", "content": "Hello, café!"}],
        "chat_template_kwargs": {},
    },
]

# --------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------


def _train_bpe(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def make_qwen_tokenizer(chat_template: str, eos: str, real_qwen2_pipeline: bool) -> PreTrainedTokenizerFast:
    """Byte-level BPE, no BOS; specials appended after the learned vocab.

    real_qwen2_pipeline=False: a bare ByteLevel pre-tokenizer (GPT-2 regex
    built in, use_regex=True), no normalizer.
    real_qwen2_pipeline=True: exactly what real Qwen2/2.5/3 tokenizer.json files
    use (NFC normalizer, Split on the Qwen regex, ByteLevel(use_regex=False)).
    transformers 5 reloads model_type "qwen2" checkpoints with Qwen2Tokenizer,
    which rebuilds this pipeline regardless of tokenizer.json, so qwen2 fixtures
    must use it for AutoTokenizer and tokenizer.json to agree.
    """
    tok = Tokenizer(models.BPE())
    if real_qwen2_pipeline:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    _train_bpe(tok, LEARNED_VOCAB)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN_ADDED])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    fast.chat_template = chat_template
    return fast


def make_llama_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3 style: regex Split + ByteLevel, BOS added by the post-processor."""
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    _train_bpe(tok, LEARNED_VOCAB)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in LLAMA_SPECIALS])
    bos = "<|begin_of_text|>"
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token="<|eot_id|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    fast.chat_template = LLAMA3_CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------
# Model construction helpers
# --------------------------------------------------------------------------


def randomize_(model: torch.nn.Module, std: float, seed: int) -> None:
    """Deterministically overwrite every parameter.

    Matrices/embeddings ~ N(0, std); norm weights ~ 1 + 0.1 N(0, 1) (so a
    missing norm is visible); biases ~ N(0, std) (non-zero on purpose).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(std * noise)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def eos_list(gen_cfg: GenerationConfig) -> list:
    e = gen_cfg.eos_token_id
    return list(e) if isinstance(e, (list, tuple)) else [e]


# --------------------------------------------------------------------------
# Reference recorder
# --------------------------------------------------------------------------


class RouterProbe:
    """Records the smallest gap between the k-th and (k+1)-th router logit.

    A near-tie there would let tiny numeric differences pick another expert.
    """

    def __init__(self, model, top_k: int):
        self.top_k = top_k
        self.min_gap = float("inf")
        self.handles = []
        for name, mod in model.named_modules():
            if name.endswith("mlp.gate"):
                self.handles.append(mod.register_forward_hook(self._hook))

    def _hook(self, _mod, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out  # router logits first
        logits = logits.float().reshape(-1, logits.shape[-1])
        top = torch.topk(logits, self.top_k + 1, dim=-1).values
        gap = (top[:, self.top_k - 1] - top[:, self.top_k]).min().item()
        self.min_gap = min(self.min_gap, gap)

    def close(self):
        for h in self.handles:
            h.remove()


def to_json(obj, indent: int = 0) -> str:
    """Pretty JSON, but with lists of numbers (ids, top-k pairs) kept on one line."""
    pad = " " * indent
    if isinstance(obj, dict) and obj:
        items = [f"{pad}  {json.dumps(k)}: {to_json(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(x, (dict, str)) for x in obj):
        items = [pad + "  " + to_json(x, indent + 2) for x in obj]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


@torch.no_grad()
def greedy(model, input_ids: list) -> dict:
    """Manual greedy loop with full recomputation; eos is ignored."""
    ids = list(input_ids)
    generated, tops, margins = [], [], []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([ids], dtype=torch.long)).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        vals, idxs = torch.topk(logprobs, TOP_K)
        tops.append([[int(i), float(v)] for i, v in zip(idxs, vals)])
        margins.append(float(vals[0] - vals[1]))
        nxt = int(idxs[0])
        generated.append(nxt)
        ids.append(nxt)
    return {"generated_ids": generated, "top_logprobs": tops, "margins": margins}


@torch.no_grad()
def step_router_gaps(model, prompt: list, generated: list, top_k: int) -> list:
    """Per recorded step, the smallest gap over the MoE layers between the k-th and (k+1)-th
    router logit at the positions whose routing that step's logits see first hand: every
    prompt position for step 0, the step's own position after. The golden test does not hold
    a bf16-activation run to the tolerance where this is below what its rounding moves a
    router logit (another expert may be picked there, legitimately)."""
    gaps = []  # per layer: [positions]

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


def load_reference(path: Path, model_cls, stored_dtype: torch.dtype):
    """Load the checkpoint from disk as stored and upcast to float32."""
    model = model_cls.from_pretrained(path, dtype=stored_dtype, attn_implementation="eager")
    loaded = {p.dtype for p in model.parameters()}
    assert loaded == {stored_dtype}, f"loaded dtypes {loaded}, expected {stored_dtype}"
    return model.float().eval()


def record(name: str, model_cls, config, tokenizer, gen_cfg, stored_dtype, std, chats, seed0):
    """Search seeds until margins are comfortable, then write the fixture."""
    out = OUT_DIR / name
    moe_top_k = getattr(config, "num_experts_per_tok", None)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]

    for seed in range(seed0, seed0 + MAX_SEED_TRIES):
        torch.manual_seed(seed)
        config.initializer_range = std
        model = model_cls(config)
        randomize_(model, std, seed)
        model = model.to(stored_dtype)
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out, safe_serialization=True)
        gen_cfg.save_pretrained(out)
        tokenizer.save_pretrained(out)

        ref = load_reference(out, model_cls, stored_dtype)
        probe = RouterProbe(ref, moe_top_k) if moe_top_k else None
        completions = []
        for prompt, ids in zip(PROMPTS, prompt_ids):
            completions.append({"prompt": prompt, "input_ids": ids, **greedy(ref, ids)})
        if probe:
            probe.close()
            for c in completions:
                c["router_gaps"] = step_router_gaps(ref, c["input_ids"], c["generated_ids"], moe_top_k)
        min_margin = min(m for c in completions for m in c["margins"])
        router_gap = probe.min_gap if probe else None
        ok = min_margin >= MIN_MARGIN and (router_gap is None or router_gap >= MIN_ROUTER_MARGIN)
        print(f"  {name}: seed {seed} min margin {min_margin:.4g}"
              + (f" router gap {router_gap:.4g}" if probe else "")
              + ("" if ok else "  -> retry"))
        if ok:
            break
    else:
        sys.exit(f"{name}: no seed with margin >= {MIN_MARGIN}")

    chat_records = []
    for case in chats:
        kwargs = case.get("chat_template_kwargs", {})
        agp = case.get("add_generation_prompt", True)
        rendered = tokenizer.apply_chat_template(
            case["messages"], tokenize=False, add_generation_prompt=agp, **kwargs
        )
        chat_records.append({
            "messages": case["messages"],
            "add_generation_prompt": agp,
            "chat_template_kwargs": kwargs,
            "rendered": rendered,
            "input_ids": tokenizer(rendered, add_special_tokens=False)["input_ids"],
        })

    special_ids = sorted(tokenizer.all_special_ids)
    added_ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_ADDED if t in tokenizer.get_vocab()]
    decode_lists = [
        prompt_ids[2],
        special_ids + prompt_ids[0] + special_ids,
        added_ids + prompt_ids[1],
        chat_records[1]["input_ids"],
    ] + [c["generated_ids"] for c in completions]
    decodes = [{"ids": ids, "text": tokenizer.decode(ids, skip_special_tokens=True)} for ids in decode_lists]

    expected = {
        "architecture": config.architectures[0] if config.architectures else model_cls.__name__,
        "dtype": str(stored_dtype).replace("torch.", ""),
        "reference_dtype": "float32",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": seed,
        "init_std": std,
        "min_margin": min_margin,
        **({"min_router_margin": router_gap} if router_gap is not None else {}),
        "completions": completions,
        "chats": chat_records,
        "decodes": decodes,
        "eos_token_ids": eos_list(gen_cfg),
    }
    text = to_json(expected) + "\n"
    assert json.loads(text) == expected
    (out / "expected.json").write_text(text, encoding="utf-8")
    return expected


# --------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------


def qwen3(dtype: torch.dtype, suffix: str, name="qwen3", hidden=64, layers=3, head_dim=32, seed0=1000):
    tok = make_qwen_tokenizer(QWEN3_CHAT_TEMPLATE, eos="<|im_end|>", real_qwen2_pipeline=False)
    eot, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen3Config(
        vocab_size=QWEN_CONFIG_VOCAB,  # > len(tokenizer), as in real Qwen checkpoints
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        architectures=["Qwen3ForCausalLM"],
    )
    gen = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
    return record(f"{name}-{suffix}", Qwen3ForCausalLM, config, tok, gen, dtype, 0.25, QWEN3_CHATS, seed0)


def qwen3_hd128(dtype: torch.dtype, suffix: str):
    """Qwen3 with real heads of 128, the size CUDA's tensor-core decode attention takes."""
    return qwen3(dtype, suffix, name="qwen3-hd128", hidden=128, layers=2, head_dim=128, seed0=5000)


def qwen3moe(dtype: torch.dtype, suffix: str):
    tok = make_qwen_tokenizer(QWEN3_CHAT_TEMPLATE, eos="<|im_end|>", real_qwen2_pipeline=False)
    eot, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen3MoeConfig(
        vocab_size=QWEN_CONFIG_VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=(dtype == torch.float32),  # f32: True, bf16: False
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        architectures=["Qwen3MoeForCausalLM"],
    )
    gen = GenerationConfig(bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)  # single int
    return record(f"qwen3moe-{suffix}", Qwen3MoeForCausalLM, config, tok, gen, dtype, 0.25, QWEN3_CHATS, 2000)


def qwen2(dtype: torch.dtype, suffix: str):
    tok = make_qwen_tokenizer(QWEN2_CHAT_TEMPLATE, eos="<|im_end|>", real_qwen2_pipeline=True)
    eot, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2Config(
        vocab_size=QWEN_CONFIG_VOCAB,
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=160,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        architectures=["Qwen2ForCausalLM"],
    )
    gen = GenerationConfig(bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)  # single int
    return record(f"qwen2-{suffix}", Qwen2ForCausalLM, config, tok, gen, dtype, 0.2, GENERIC_CHATS, 3000)


def llama(dtype: torch.dtype, suffix: str):
    tok = make_llama_tokenizer()
    bos, eot_text, eot_id = tok.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    )
    config = LlamaConfig(
        vocab_size=len(tok),  # exact, as in real Llama 3
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=128,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos,
        eos_token_id=eot_text,
        architectures=["LlamaForCausalLM"],
    )
    gen = GenerationConfig(bos_token_id=bos, eos_token_id=[eot_text, eot_id])  # list
    return record(f"llama-{suffix}", LlamaForCausalLM, config, tok, gen, dtype, 0.25, GENERIC_CHATS, 4000)


def main(only=None):
    """Write all fixtures (or only those whose name contains a CLI argument)."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    runs = [
        (family, dtype, suffix)
        for family in (qwen3, qwen3moe, qwen2, llama)
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))
    ]
    # Heads of 128 matter only where CUDA decodes over a 16-bit cache: bf16 alone.
    runs.append((qwen3_hd128, torch.bfloat16, "bf16"))
    for family, dtype, suffix in runs:
        if only and not any(o in f"{family.__name__}-{suffix}" for o in only):
            continue
        family(dtype, suffix)
    total = sum(f.stat().st_size for f in OUT_DIR.rglob("*") if f.is_file())
    print(f"wrote {OUT_DIR.relative_to(ROOT)} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main(sys.argv[1:])

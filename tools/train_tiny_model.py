#!/usr/bin/env python
"""Train the bundled tiny Qwen2-architecture model on the CPython standard library.

    python tools/train_tiny_model.py --out minivllm/assets/tiny-qwen2-stdlib [--steps N] [--seed S]

Everything is deterministic (seeded, fixed file order, fixed data order, 2 threads) and
needs no network: the training text is the standard library source of the interpreter
running this script (PSF license). The script

1. collects the stdlib ``.py`` files (skipping tests, idlelib, site-packages, data tables),
   and holds out every file whose path hash falls in a fixed bucket (~5%);
2. builds ChatML question/answer pairs from the same files with ``ast`` (docstrings of
   public functions/classes/methods, and "write a function" pairs with the source);
3. trains a byte-level BPE tokenizer (``tokenizers``, Qwen2 pre-tokenizer regex) and adds
   Qwen's special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` after the BPE vocab;
4. trains ``transformers.Qwen2ForCausalLM`` in fp32 (AdamW, linear warmup + cosine);
5. saves a standard HF checkpoint (weights in bfloat16 like real Qwen), reloads it with
   ``AutoModelForCausalLM``/``AutoTokenizer`` and reports held-out loss of the *shipped*
   weights plus a few greedy samples in ``training_report.json``.

Stopping criterion is the step count, never wall time, so the result does not depend on
machine load (only on torch version / CPU kernels, and only in the last bits).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import shutil
import sysconfig
import time
from pathlib import Path

# Under CPU contention (other processes on the same 2 cores) OpenMP's default spin-waiting makes
# torch 3-4x slower; passive waiting does not change results. Must be set before importing torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_SYSTEM = "You are a helpful assistant."
# Qwen2's pre-tokenizer split regex (same as transformers' Qwen2Tokenizer / Qwen's tokenizer.json).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5-Instruct's ChatML template without the tools section.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Directories (any path component) and files that are not "ordinary library code".
SKIP_DIRS = {
    "test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib-dynload",
    "encodings",  # mostly generated codec tables
    "pydoc_data",  # one huge generated string
    "ensurepip", "turtledemo", "lib2to3", "distutils",
}
SKIP_FILE_PREFIXES = ("_sysconfigdata",)
MAX_FILE_BYTES = 400_000

ARCH = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
BPE_VOCAB = 4000  # BPE tokens (incl. the 256 byte alphabet); specials come after
VOCAB_PAD_MULTIPLE = 64


# --------------------------------------------------------------------------- data


def stdlib_files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(SKIP_FILE_PREFIXES):
                continue
            p = Path(dirpath) / name
            if p.stat().st_size <= MAX_FILE_BYTES:
                out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relpath: str) -> bool:
    return int(hashlib.md5(relpath.encode()).hexdigest(), 16) % 20 == 0


def module_name(relpath: str) -> str:
    parts = relpath[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _first_paragraph(doc: str, limit: int = 400) -> str | None:
    para = doc.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines()).strip()
    if len(para) < 12 or len(para) > limit or para.startswith((">>>", "..", ":")):
        return None
    return para


def _first_sentence(para: str) -> str:
    s = para.split(". ")[0].rstrip(".")
    return s[:1].lower() + s[1:]


def chat_pairs(relpath: str, source: str) -> list[tuple[str, str]]:
    """Deterministic (question, answer) pairs from one stdlib module, via ``ast`` only."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    mod = module_name(relpath)
    if any(p.startswith("_") for p in mod.split(".")):
        return []
    pairs: list[tuple[str, str]] = []

    def h(s: str) -> int:
        return int(hashlib.md5(s.encode()).hexdigest(), 16)

    def add_doc(qual: str, node, kind: str):
        doc = ast.get_docstring(node, clean=True)
        para = _first_paragraph(doc) if doc else None
        if not para:
            return
        q = [
            f"What does `{qual}` do?",
            f"Explain `{qual}`.",
            f"What is `{qual}` used for?",
            f"Describe the {kind} `{qual}` from the Python standard library.",
        ][h(qual) % 4]
        pairs.append((q, para))
        return para

    mod_doc = ast.get_docstring(tree, clean=True)
    para = _first_paragraph(mod_doc) if mod_doc else None
    if para:
        pairs.append((f"What is the `{mod}` module?", para))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            para = add_doc(f"{mod}.{node.name}", node, "function")
            seg = ast.get_source_segment(source, node)
            if para and seg and len(seg) <= 700 and not node.decorator_list:
                pairs.append(
                    ((f"Write a Python function `{node.name}` that does the following: "
                      f"{_first_sentence(para)}."), f"```python\n{seg}\n```")
                )
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            add_doc(f"{mod}.{node.name}", node, "class")
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                    add_doc(f"{mod}.{node.name}.{sub.name}", sub, "method")
    return pairs


def chatml(q: str, a: str) -> str:
    return (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
            f"<|im_start|>assistant\n{a}<|im_end|>\n")


def load_corpus(root: Path):
    code = {"train": [], "heldout": []}
    chat = {"train": [], "heldout": []}
    for p in stdlib_files(root):
        rel = p.relative_to(root).as_posix()
        try:
            src = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        split = "heldout" if is_heldout(rel) else "train"
        code[split].append(src)
        chat[split].extend(chatml(q, a) for q, a in chat_pairs(rel, src))
    return code, chat


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]):
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # Exactly Qwen2's pipeline. NFC is kept because transformers 5.x *always* rebuilds a qwen2
    # tokenizer as Qwen2Tokenizer (NFC + this regex + ByteLevel) whatever tokenizer_class says;
    # with NFC in tokenizer.json too, `tokenizers` and `transformers` agree token for token.
    # Byte-level means no <unk>: decode(encode(s)) == s for every NFC-normalized string.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids right after the BPE vocab, as in Qwen
    return tok


# --------------------------------------------------------------------------- packing


def pack(docs: list[str], tok, eot: int, seq_len: int) -> torch.Tensor:
    """Concatenate ``doc + <|endoftext|>`` for every doc and cut into (N, seq_len) rows."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.no_grad()
def eval_loss(model, rows: torch.Tensor, bs: int = 16) -> float:
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(rows), bs):
        x = rows[i: i + bs]
        out = model(input_ids=x, labels=x)
        k = x.numel() - x.shape[0]
        tot += out.loss.item() * k
        n += k
    model.train()
    return tot / n


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="minivllm/assets/tiny-qwen2-stdlib")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--chat-per-batch", type=int, default=2, help="chat rows per batch (2/8 = 25%%)")
    ap.add_argument("--eval-every", type=int, default=250)
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    t0 = time.time()
    root = Path(sysconfig.get_paths()["stdlib"])
    code, chat = load_corpus(root)
    print(f"stdlib {root} (Python {platform.python_version()}): "
          f"{len(code['train'])} train files, {len(code['heldout'])} held-out files, "
          f"{len(chat['train'])} train chat pairs, {len(chat['heldout'])} held-out chat pairs", flush=True)

    tok = train_tokenizer(code["train"] + chat["train"])
    n_tok = tok.get_vocab_size()
    eot, im_start, im_end = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    vocab_size = -(-n_tok // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    if vocab_size == n_tok:
        vocab_size += VOCAB_PAD_MULTIPLE
    print(f"tokenizer: {n_tok} tokens (specials {eot},{im_start},{im_end}), config vocab_size {vocab_size} "
          f"[{time.time() - t0:.0f}s]", flush=True)

    T = args.seq_len
    code_tr, code_ho = pack(code["train"], tok, eot, T), pack(code["heldout"], tok, eot, T)
    chat_tr, chat_ho = pack(chat["train"], tok, eot, T), pack(chat["heldout"], tok, eot, T)
    print(f"rows of {T}: code {len(code_tr)} train / {len(code_ho)} held-out, "
          f"chat {len(chat_tr)} train / {len(chat_ho)} held-out [{time.time() - t0:.0f}s]", flush=True)
    g = torch.Generator().manual_seed(args.seed)
    code_tr = code_tr[torch.randperm(len(code_tr), generator=g)]
    chat_tr = chat_tr[torch.randperm(len(chat_tr), generator=g)]
    code_ho = code_ho[torch.randperm(len(code_ho), generator=g)[:48]]
    chat_ho = chat_ho[torch.randperm(len(chat_ho), generator=g)[:16]]

    config = Qwen2Config(
        vocab_size=vocab_size, **ARCH, hidden_act="silu", max_position_embeddings=4096,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        attention_dropout=0.0, initializer_range=0.02, bos_token_id=eot, eos_token_id=im_end,
        pad_token_id=eot,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params {ARCH}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(50, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    B, n_chat = args.batch_size, args.chat_per_batch
    n_code = B - n_chat
    history = []
    t_train = time.time()
    ema = None
    for step in range(args.steps):
        ci = [(step * n_code + j) % len(code_tr) for j in range(n_code)]
        hi = [(step * n_chat + j) % len(chat_tr) for j in range(n_chat)]
        x = torch.cat([code_tr[ci], chat_tr[hi]])
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(f"step {step:5d} loss {loss.item():.3f} ema {ema:.3f} lr {lr_at(step):.2e} "
                  f"{el:.0f}s ({el / (step + 1):.2f}s/step)", flush=True)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            ho = eval_loss(model, code_ho), eval_loss(model, chat_ho)
            history.append({"step": step + 1, "train_loss_ema": round(ema, 4),
                            "heldout_code_loss": round(ho[0], 4), "heldout_chat_loss": round(ho[1], 4)})
            print(f"  eval @ {step + 1}: held-out code {ho[0]:.3f} chat {ho[1]:.3f}", flush=True)
    train_wall = time.time() - t_train

    # ---------------------------------------------------------------- save (bf16, like Qwen)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=False,
    )
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes `dtype` and nests rope_theta in `rope_parameters`; also write the
    # top-level keys Qwen2.5's own config.json has, so non-HF readers find them where they expect.
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    cfg["torch_dtype"] = cfg["dtype"]
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 4096,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")

    # ---------------------------------------------------------------- reload + report
    hf_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(out)
    probe = "def f(x):\n\t    return x  # ünïcödé ✓ 日本語 🐍 e\u0301<|im_end|>\n<|endoftext|>  1234\r\n"
    assert hf_tok.encode(probe) == tok.encode(probe).ids, "transformers and tokenizers disagree"
    ho_final = eval_loss(hf_model, code_ho), eval_loss(hf_model, chat_ho)
    print(f"shipped (bf16 -> fp32) held-out: code {ho_final[0]:.3f} chat {ho_final[1]:.3f}", flush=True)

    samples = {}
    prompts = {
        "def ": "def ",
        "import os\\n": "import os\n",
        "class Foo:...": "class Foo:\n    def __init__(self",
        "chat: textwrap.dedent": hf_tok.apply_chat_template(
            [{"role": "user", "content": "What does `textwrap.dedent` do?"}],
            tokenize=False, add_generation_prompt=True),
        "chat: write is_prime": hf_tok.apply_chat_template(
            [{"role": "user", "content": "Write a Python function `is_prime` that does the following: "
                                         "return True if n is a prime number."}],
            tokenize=False, add_generation_prompt=True),
    }
    for name, prompt in prompts.items():
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        samples[name] = hf_tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        print(f"--- {name!r}\n{prompt}{samples[name]}", flush=True)

    size = sum(f.stat().st_size for f in out.iterdir())
    report = {
        "steps": args.steps,
        "seed": args.seed,
        "batch_size": B,
        "seq_len": T,
        "chat_fraction": n_chat / B,
        "tokens_seen": args.steps * B * T,
        "params": n_params,
        "train_loss_ema_final": round(ema, 4),
        "heldout_code_loss_fp32": history[-1]["heldout_code_loss"],
        "heldout_chat_loss_fp32": history[-1]["heldout_chat_loss"],
        "heldout_code_loss": round(ho_final[0], 4),
        "heldout_chat_loss": round(ho_final[1], 4),
        "eval_history": history,
        "train_wall_time_s": round(train_wall, 1),
        "total_wall_time_s": round(time.time() - t0, 1),
        "data_source": f"CPython {platform.python_version()} standard library sources ({root.name}), PSF license",
        "files": {"train": len(code["train"]), "heldout": len(code["heldout"])},
        "chat_pairs": {"train": len(chat["train"]), "heldout": len(chat["heldout"])},
        "tokenizer_tokens": n_tok,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "samples_greedy": samples,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out} ({size / 1e6:.2f} MB); train {train_wall:.0f}s, total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()

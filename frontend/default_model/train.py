"""Train the tiny Llama that `pagedserve launch` serves when no --model is given.

Why this model: the first command in the README must give a working server on a CPU laptop in
seconds, and readable output beats random noise. So we bundle a ~1.3M-parameter Llama trained on
text we may lawfully ship: the Python standard library's own source (PSF license), read from the
local interpreter's `Lib/` directory. It writes Python-looking text, nothing more.

The shipped weights came from (writes into this directory, next to this script; ~1 min on a GPU):

    python frontend/default_model/train.py --device cuda --max-steps 2500

On a CPU, `--minutes 8` (the default budget, 2 threads) gets a few hundred steps: a weaker but
still Python-looking model. Past ~2500 steps of batch 16 the model starts to memorize the ~1.2M
token corpus and its loss on unseen stdlib code rises again, so more steps are not better.

The corpus is every top-level `Lib/*.py` file of the running interpreter, sorted by name, skipping
files over --max-file-kb and stopping at --max-corpus-mb. Sub-packages (e.g. `json/`) are never
trained on, so the test may use them as held-out text. Seeds are fixed; with a wall-clock budget
the step count depends on the machine, so pass --max-steps to repeat a run step for step.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
# Every turn is `<|role|>\n{content}\n`, except that an assistant turn ends with `</s>` (the EOS the
# engine stops on). The generation prompt is `<|assistant|>\n`. BOS is in the template, so encode
# the rendered text with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--lib-dir", default=os.path.dirname(os.__file__), help="stdlib source dir")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget (> 0)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--max-file-kb", type=int, default=150)
    p.add_argument("--max-corpus-mb", type=float, default=5.0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="e.g. cuda: same recipe, many more steps")
    p.add_argument("--eval-every", type=int, default=200, help="held-out loss every N steps")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def collect_files(lib_dir: str, max_file_kb: int, max_corpus_mb: float) -> list[Path]:
    """Top-level stdlib modules in name order: deterministic for a given Python version."""
    files, total = [], 0
    for path in sorted(Path(lib_dir).glob("*.py")):
        size = path.stat().st_size
        if size > max_file_kb * 1024:
            continue
        if total + size > max_corpus_mb * 1e6:
            break
        files.append(path)
        total += size
    if not files:
        raise SystemExit(f"no stdlib .py files under {lib_dir!r}; pass --lib-dir")
    print(f"corpus: {len(files)} files, {total / 1e6:.2f} MB ({files[0].name} .. {files[-1].name})")
    return files


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte string round-trips, so no input is ever `<unk>`."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    # add_special_tokens=True prepends BOS, as the model saw at the start of every file.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All files as one stream, each as `<s> file </s>`."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend([tokenizer.bos_token_id, *enc.ids, tokenizer.eos_token_id])
    print(f"tokens: {len(ids):,} ({sum(map(len, texts)) / len(ids):.2f} chars/token)")
    return torch.tensor(ids, dtype=torch.long)


def build_model(tokenizer: PreTrainedTokenizerFast, hidden_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")
    return model


def lr_at(frac: float, step: int, peak: float, warmup: int = 100) -> float:
    """Linear warmup by step, then cosine decay by the fraction of the budget spent."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(
    model: LlamaForCausalLM, ids: torch.Tensor, held_out_ids: torch.Tensor, args: argparse.Namespace
) -> float:
    """AdamW on random `context`-token windows until the wall budget or --max-steps runs out."""
    ids = ids.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    budget_s, start, step, ema = args.minutes * 60, time.monotonic(), 0, None
    model.train()
    while True:
        elapsed = time.monotonic() - start
        frac = elapsed / budget_s  # the fraction of the budget spent, whichever runs out first
        if args.max_steps is not None:
            frac = max(frac, step / args.max_steps)
        if frac >= 1.0:
            break
        starts = torch.randint(0, len(ids) - args.context, (args.batch_size,), generator=gen)
        batch = torch.stack([ids[s : s + args.context] for s in starts.tolist()])  # [B, S]
        batch = batch.to(args.device)
        for group in opt.param_groups:
            group["lr"] = lr_at(frac, step, args.lr)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.eval_every == 0:
            print(
                f"step {step:6d}  {elapsed:6.0f}s  lr {opt.param_groups[0]['lr']:.2e}  "
                f"loss {loss.item():.3f}  ema {ema:.3f}  "
                f"held-out {held_out_loss(model, held_out_ids):.3f}",
                flush=True,
            )
        step += 1
    print(f"done: {step} steps, final train loss (ema) {ema:.3f}")
    return ema


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, ids: torch.Tensor) -> float:
    """Mean next-token loss on a file never trained on; leaves the model in train mode."""
    model.eval()
    loss = model(input_ids=ids, labels=ids).loss.item()
    model.train()
    return loss


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: str) -> None:
    """bfloat16 safetensors (tied embeddings are stored once) plus tokenizer and EOS config."""
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for name in sorted(os.listdir(out)):
        print(f"  {name:28s} {os.path.getsize(os.path.join(out, name)):>9,} bytes")


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    files = collect_files(args.lib_dir, args.max_file_kb, args.max_corpus_mb)
    texts = [f.read_text(encoding="utf-8") for f in files]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    ids = encode_corpus(tokenizer, texts)
    held_out = (Path(args.lib_dir) / "json" / "decoder.py").read_text(encoding="utf-8")
    # Windows as long as the training context: RoPE positions beyond it are never trained.
    held_out_ids = tokenizer.backend_tokenizer.encode(held_out).ids[: 4 * args.context]
    held_out_ids = torch.tensor(held_out_ids, device=args.device).view(4, args.context)  # [4, S]
    model = build_model(tokenizer, args.hidden_size).to(args.device)
    train(model, ids, held_out_ids, args)
    print(f"held-out loss on json/decoder.py: {held_out_loss(model, held_out_ids):.3f}")
    save(model.cpu(), tokenizer, args.out)


if __name__ == "__main__":
    main()

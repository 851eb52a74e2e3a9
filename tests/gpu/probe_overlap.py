"""Probe (issue 18, W5): can a mixed step's decode attention run *beside* its prompt attention?

A W5 mixed step attends 24 decode rows at 16k tokens (memory-bound: ~0.55 ms a layer at 2.95
TB/s) and an 8,192-token prompt chunk (compute-bound: FA4, ~1.8 ms a layer), one after the
other. This times one step's 32 layers of both, eagerly as the runner runs them, for prompt chunks
of 8,192, 4,096 and 2,048 tokens:

- `serial`: decode part, then prompt part, on one stream (today);
- `side-hi` / `side-lo`: the decode part on a side stream of high / normal priority, forked
  before the prompt part; `side-hi-late`: forked after the prompt part is launched;
- `green-N`: the decode part on a stream of a CUDA green context of N SMs (the decode kernel
  then holds at most N SMs; the prompt part keeps the others and takes the N back when done),
  with the decode split count chosen for N SMs, its K/V loads marked evict-first (so it does
  not flush the prompt part's K/V out of L2); `-deep`: with 4 pipeline stages;
- `*-evict`: the same with evict-first K/V loads;
- `gemm` / `gemm+green-N`: the chunk's gate/up GEMM alone and beside the decode part on N SMs
  (what overlapping decode attention with the next GEMM would give; not wired in the runner).

Prints ms per step (32 layers) and the saving against `serial`. Run on a GPU:
`python tests/gpu/probe_overlap.py [--json PATH]` (FA4 when it imports, else Triton prompts).

Result on an H100 (three runs, 2026-11-24; `STEPS="fa4-install overlap-probe"`; the third
with this timer, the first two with an eager event loop of the same median): no overlap pays.
- Side streams: -4.9% to +4.5% of `serial` (8k chunk: serial 106-107 ms, side-hi 109-111;
  evict-first loads 104-106); the same spread between runs, so noise-sized at best. In the
  engine (the decode part forked on a high-priority stream) W5 ran 48.1 s against 48.5 s.
- Green contexts: the decode kernel needs nearly every SM to reach memory speed (17.5-17.7 ms
  on 132 SMs; 40 on 32, 23 on 48 or 64, 21-22 on 80: ~30-50 GB/s an SM with cp.async loads, 4
  stages do not change it), and the prompt part on fewer SMs loses what the decode part gains:
  green-48 to green-80 are -4.2% to +1.0%, green-32 -7% to -42%.
- Beside the chunk's gate/up GEMM instead, against GEMM + decode one after the other: -4.8% to
  +6.6% on a side stream or 48-80 SMs, worse on fewer.
So a W5 mixed step's attention is as fast in series as overlapped on this GPU: an overlap would
need a decode kernel that streams at memory speed from a third of the SMs (TMA bulk loads).
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedserve.benchmarks.kernels.bench_kernels import HKV, HQ, D, random_batch
from pagedserve.kernels.attention.triton import (
    _launch_config,
    choose_num_splits,
    triton_paged_attention,
)

LAYERS = 32
DECODE_ROWS, DECODE_CTX = 24, 16400
CHUNKS = (8192, 4096, 2048)
GREEN_SMS = (32, 48, 64, 80)
# The decode kernel's own launch config with evict-first K/V loads, and with 4 pipeline stages.
EVICT = {**_launch_config(16, False), "KV_EVICT": "evict_first"}
DEEP = {**EVICT, "num_stages": 4}
_GREEN_CONTEXTS: list = []


def step_ms(fn) -> float:
    """Median GPU ms of `fn` (one step's layers) over ~7 eager calls (triton's do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=1, rep=700, return_mode="median")


def green_stream(num_sms: int) -> torch.cuda.Stream | None:
    """A stream whose kernels run on at most `num_sms` SMs (a green context), or None."""
    try:
        from torch.cuda.green_contexts import GreenContext

        ctx = GreenContext.create(num_sms=num_sms, device_id=0)
        if hasattr(ctx, "Stream"):
            stream = ctx.Stream()
        else:  # older torch: a stream made while the green context is current
            ctx.set_context()
            stream = torch.cuda.Stream()
            ctx.pop_context()
        _GREEN_CONTEXTS.append(ctx)  # a context must outlive its stream
        return stream
    except Exception as e:  # noqa: BLE001 - report and go on without green contexts
        print(f"  green context of {num_sms} SMs: {type(e).__name__}: {e}")
        return None


def run_chunk(chunk, prompt_attn, decode, sides, greens) -> dict[str, float]:
    """Every variant of one step with a prompt chunk of `chunk` tokens at 8k tokens of context."""
    scale = D**-0.5
    pq, pkv, pmeta = random_batch([8192], [chunk], HQ, HKV, D, 16, torch.bfloat16, "cuda", 1)
    w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) / 64
    x = torch.randn(chunk, 4096, device="cuda", dtype=torch.bfloat16)
    main_stream = torch.cuda.current_stream()

    def prompt():
        return prompt_attn(pq, pkv, pmeta, scale)

    def gemm():
        return x @ w.t()

    def alone(fn):
        return lambda: [fn() for _ in range(LAYERS)]

    def serial():
        for _ in range(LAYERS):
            decode()
            prompt()

    def forked(stream, splits=None, late=False, other=prompt, launch=None):
        def step():
            for _ in range(LAYERS):
                if late:
                    other()
                stream.wait_stream(main_stream)
                with torch.cuda.stream(stream):
                    decode(splits, launch)
                if not late:
                    other()
                main_stream.wait_stream(stream)

        return step

    r = {"decode": step_ms(alone(decode)), "prompt": step_ms(alone(prompt))}
    r["serial"] = step_ms(serial)
    r["side-hi"] = step_ms(forked(sides["hi"]))
    r["side-lo"] = step_ms(forked(sides["lo"]))
    r["side-hi-late"] = step_ms(forked(sides["hi"], late=True))
    r["decode-evict"] = step_ms(alone(lambda: decode(None, EVICT)))
    r["side-hi-evict"] = step_ms(forked(sides["hi"], launch=EVICT))
    r["gemm"] = step_ms(alone(gemm))
    r["gemm+side-hi-evict"] = step_ms(forked(sides["hi"], other=gemm, launch=EVICT))
    for n, stream in greens.items():
        splits = choose_num_splits(DECODE_ROWS, HKV, 1, DECODE_CTX, n)
        for tag, launch in (("", EVICT), ("-deep", DEEP)):
            with torch.cuda.stream(stream):
                r[f"decode@{n}{tag}"] = step_ms(alone(lambda s=splits, c=launch: decode(s, c)))
            r[f"green-{n}{tag}"] = step_ms(forked(stream, splits, launch=launch))
        r[f"gemm+green-{n}"] = step_ms(forked(stream, splits, other=gemm, launch=EVICT))
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    args = p.parse_args()
    from pagedserve.kernels.attention.flash import flash_attn_available

    prompt_attn, prompt_name = triton_paged_attention, "triton"
    if flash_attn_available():
        from pagedserve.kernels.attention.flash import flash_paged_attention

        prompt_attn, prompt_name = flash_paged_attention, "fa4"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dq, dkv, dmeta = random_batch(
        [DECODE_CTX - 1] * DECODE_ROWS, [1] * DECODE_ROWS, HQ, HKV, D, 16, torch.bfloat16, "cuda"
    )

    def decode(splits=None, launch=None):
        return triton_paged_attention(dq, dkv, dmeta, D**-0.5, num_splits=splits, launch=launch)

    sides = {"hi": torch.cuda.Stream(priority=-1), "lo": torch.cuda.Stream(priority=0)}
    greens = {n: s for n in GREEN_SMS if n < sms and (s := green_stream(n)) is not None}
    rows = []
    for chunk in CHUNKS:
        r = {"chunk": chunk, "prompt_backend": prompt_name}
        r.update(run_chunk(chunk, prompt_attn, decode, sides, greens))
        rows.append(r)
        base = r["serial"]
        print(f"chunk {chunk} ({prompt_name} prompt), ms per step of {LAYERS} layers:")
        for k, v in r.items():
            if not isinstance(v, float):
                continue
            saving = ""
            if k.startswith(("side", "green", "gemm+")):
                ref = r["gemm"] + r["decode"] if k.startswith("gemm+") else base
                saving = f"saves {ref - v:+.2f} ({(ref - v) / ref:+.1%})"
            print(f"  {k:<16} {v:8.2f}  {saving}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f)


if __name__ == "__main__":
    main()

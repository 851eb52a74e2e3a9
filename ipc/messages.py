"""Every message that crosses a process boundary, as msgspec Structs encoded with msgpack.

Hot-path messages are `array_like` (encoded as arrays, not maps) and `gc=False`. Each direction has
one tagged union so a receiver decodes with a single typed decoder and dispatches on the type.
Only token ids, block ids and small numbers travel here; tensors never do.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

_HOT = dict(array_like=True, omit_defaults=True, gc=False)
MAX_N = 128  # choices per request: each is an engine request, so this bounds one HTTP request
MAX_CACHE_SALT = 1024  # characters: every choice's SamplingParams carries it to the core
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default max_logprobs); the core enforces it
# Integers must fit msgpack (64 bits) and the workers' tensors; bounds keep a client's huge number
# a 400 instead of an encoding error on an IO thread.
_I32 = 2**31
_I64 = 2**63


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A grammar the output must follow, shaped like vLLM's StructuredOutputsParams: exactly one
    of `json` (a JSON schema, as text or a dict), `json_object`, `regex`, `choice`, `grammar`
    (EBNF) or `structural_tag` (xgrammar's structural tag, as JSON text).

    JSON is compact by default (no whitespace outside strings, as OpenAI's structured outputs):
    a small model given free whitespace tends to loop on newlines. `any_whitespace` allows it.
    `after_token_id`: the grammar applies only after this token was generated (the end of a
    reasoning model's thinking, `</think>`); None: from the first token. The sampling worker
    ranks compile it (xgrammar) and mask each step's logits with it.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    any_whitespace: bool = False
    after_token_id: int | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in _GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        _check(
            len(kinds) == 1,
            "structured_outputs needs exactly one of " + ", ".join(_GRAMMAR_KINDS)
            + (f" (got {', '.join(kinds)})" if kinds else ""),
        )  # fmt: skip
        _check(self.choice is None or len(self.choice) > 0, "choice must not be empty")

    @property
    def key(self) -> str:
        """Which compiled grammar this is (the same for every request with the same grammar)."""
        spec = msgspec.structs.replace(self, after_token_id=None)
        return hashlib.sha1(msgspec.msgpack.encode(spec)).hexdigest()


_GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request, shaped like vLLM's SamplingParams.

    `stop` strings are handled by the client (it owns text); everything else travels to the core
    (stop ids, lengths) and to the workers (the sampling itself).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs besides the sampled token's
    # top-N logprobs per prompt token besides the prompt token's own (vLLM's prompt_logprobs):
    # computed with the prompt's prefill, which then skips the prefix-cache lookup
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    # vLLM's request field: salts the prefix cache, so only requests with the same salt share KV
    # blocks (the core hashes it into the first block's hash)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}")
        _check(self.seed is None or -_I64 <= self.seed < _I64, "seed must fit in 64 bits")
        _check(  # choice i samples with seed + i
            self.seed is None or self.seed + self.n - 1 < _I64, "seed + n - 1 must fit in 64 bits"
        )
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(0 <= self.top_k < _I32, "top_k must be -1 (off), 0 (off) or positive")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1")
        _check(self.max_tokens is None or self.max_tokens < _I32, "max_tokens is too large")
        _check(0 <= self.min_tokens < _I32, "min_tokens must be >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
        )
        _check(self.logprobs is None or 0 <= self.logprobs < _I32, "logprobs must be >= 0")
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs < _I32,
            "prompt_logprobs must be >= 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]")
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty must be > 0",
        )
        _check(
            self.cache_salt is None or valid_cache_salt(self.cache_salt),
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters",
        )
        if self.logit_bias:
            _check(all(_finite(v) for v in self.logit_bias.values()), "logit_bias must be finite")
        if self.stop_token_ids:
            ok = all(0 <= t < _I32 for t in self.stop_token_ids)
            _check(ok, "stop_token_ids must be token ids (>= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def valid_cache_salt(salt: object) -> bool:
    """A non-empty string of at most MAX_CACHE_SALT characters that UTF-8 can encode (a lone
    surrogate cannot cross ipc)."""
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT:
        return False
    try:
        salt.encode()
    except UnicodeEncodeError:
        return False
    return True


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A LoRA adapter a request runs with, as vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`. `lora_int_id` (>= 1) names it inside the engine: the prefix cache and the
    workers' slots key on it, so one id must name one adapter while requests use it."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.lora_name, str) and self.lora_name != "", "lora_name is empty")
        _check(0 < self.lora_int_id < _I32, "lora_int_id must be in [1, 2**31)")
        _check(self.lora_path != "", f"LoRA adapter {self.lora_name!r}: lora_path is empty")


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A pooling request (`--runner pooling`), shaped like vLLM's PoolingParams: the task it
    runs (`embed` | `classify`, the engine's), `dimensions` (Matryoshka models: the vector's
    first N floats, normalized after the cut), `normalize` (None: the model's choice)."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        _check(self.task in ("embed", "classify"), f"pooling task {self.task!r}: embed or classify")
        _check(self.dimensions is None or 0 < self.dimensions < _I32, "dimensions must be >= 1")


class TokenLogprobs(msgspec.Struct, **_HOT):
    """Logprobs at one position: index 0 is the sampled token, then the top-N by logprob."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each token in the full distribution


# ---------------------------------------------------------------- client -> core
class ClientHello(msgspec.Struct, tag=True, **_HOT):
    """First message of a client: where the core sends this client's outputs."""

    client_index: int
    output_address: str


class AddRequest(msgspec.Struct, tag=True, **_HOT):
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int] = []  # each ends the request (unless ignore_eos); none: no EOS
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first (vLLM's convention)
    client_index: int = 0
    lora: LoRARequest | None = None  # None: the base model
    pooling: PoolingParams | None = None  # a pooling engine's request (its vector, no tokens)


class AbortRequests(msgspec.Struct, tag=True, **_HOT):
    req_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag=True, **_HOT):
    pass


class ShutdownEngine(msgspec.Struct, tag=True, **_HOT):
    pass


ClientMessage = ClientHello | AddRequest | AbortRequests | ResetPrefixCache | ShutdownEngine


# ---------------------------------------------------------------- core -> client
class SchedulerStats(msgspec.Struct, **_HOT):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_unfinished: int = 0  # requests the scheduler tracks (running + waiting; 0 when idle)
    num_swapped: int = 0  # preempted requests whose KV waits in the host tier
    kv_swap_out_bytes: int = 0  # cumulative, device -> host (swaps and spills), all ranks
    kv_swap_in_bytes: int = 0  # cumulative, host -> device (resumes and host hits), all ranks
    host_cache_hits: int = 0  # cumulative prefix-cache hits served by the host tier, in tokens
    running_lora_adapters: dict[str, int] = {}  # adapter name -> running requests
    waiting_lora_adapters: dict[str, int] = {}  # adapter name -> waiting requests
    lora_loads: int = 0  # cumulative: adapters the workers read into their host pool
    lora_evictions: int = 0  # cumulative: adapters evicted from the workers' device slots
    # speculative decoding, cumulative (vLLM's spec_decode_* counters)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class RequestDelta(msgspec.Struct, **_HOT):
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # "stop" | "length" | "abort" | "rejected" (queue full) | "invalid" (refused: see `error`)
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    first_scheduled_time: float = 0.0  # when the core first scheduled it (queue time)
    error: str | None = None  # why the core refused the request ("invalid")
    # With its first token, when it asked for prompt_logprobs: one entry per prompt token after
    # the first (the prompt token, then the top-N)
    prompt_logprobs: list[TokenLogprobs] | None = None
    # A pooling request's result (it finishes with it): float32, little-endian
    pooled: bytes | None = None


class EngineReady(msgspec.Struct, tag=True, **_HOT):
    num_blocks: int
    block_size: int
    max_model_len: int


class EngineOutputs(msgspec.Struct, tag=True, **_HOT):
    outputs: list[RequestDelta]
    stats: SchedulerStats | None = None


class EngineDead(msgspec.Struct, tag=True, **_HOT):
    message: str


CoreToClient = EngineReady | EngineOutputs | EngineDead


# ---------------------------------------------------------------- core -> workers
class NewRequest(msgspec.Struct, **_HOT):
    """A request the workers' persistent batch does not hold yet (new, or resumed after
    preemption: then `output_token_ids` carries what it generated so far)."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingParams
    num_computed_tokens: int
    output_token_ids: list[int] = []
    eos_token_ids: list[int] = []
    # KV cache groups 1.. (models that mix windowed and global layers): their block tables, as
    # `block_ids` is group 0's.
    group_block_ids: list[list[int]] = []
    lora: LoRARequest | None = None  # the adapter its rows run with (None: the base model)
    # Models with recurrent state (linear attention): the request's state slot while it runs.
    state_slot: int | None = None
    pooling: PoolingParams | None = None  # a pooling request: its vector when its prompt is done


class CachedDelta(msgspec.Struct, **_HOT):
    """What changed for a request already in the persistent batch since the last plan."""

    req_id: str
    new_token_ids: list[int]  # tokens sampled since the last plan, to append
    new_block_ids: list[int]
    num_computed_tokens: int
    new_group_block_ids: list[list[int]] = []  # KV cache groups 1.., as in NewRequest
    # the request's blocks that new_block_ids follow (None: all the workers hold); set once after
    # the core freed blocks at its tail (the ones only rejected drafts had used)
    num_blocks_before: int | None = None


class StepPlan(msgspec.Struct, tag=True, **_HOT):
    """One step, as a delta against the workers' persistent batch.

    `finished_ids` leave the batch first (finished, aborted or preempted), then `new_requests` join
    and `cached` update; the step runs `num_scheduled_tokens[i]` tokens of `scheduled_ids[i]`.
    """

    step_id: int
    scheduled_ids: list[str]
    num_scheduled_tokens: list[int]
    new_requests: list[NewRequest] = []
    cached: list[CachedDelta] = []
    finished_ids: list[str] = []
    # Speculative decoding: draft tokens a scheduled request verifies this step; it runs
    # `1 + len(drafts)` tokens (its last known token, then the drafts)
    draft_token_ids: dict[str, list[int]] = {}
    # Host KV tier (core/kv_tier.py): block copies the workers run before the forward, in this
    # order: (device block, host block) pairs out, then (host block, device block) pairs in.
    kv_to_host: list[tuple[int, int]] = []
    kv_from_host: list[tuple[int, int]] = []
    # ... and beside the forward, (device block, host block) pairs it does not write
    kv_to_host_ahead: list[tuple[int, int]] = []
    # ... or, with a draft model (the workers draft), how many drafts it proposes for a row
    num_model_drafts: dict[str, int] = {}
    # ... or, with ngram on one pipeline stage, at most how many drafts the sampling ranks
    # propose for a row from the tokens they just sampled (core/spec_decode/decoder.py): the
    # row is planned with `1 + k` tokens from where it would be if every draft in flight were
    # accepted, and the workers run it from where it is (`1 + len(drafts)` tokens)
    num_sampler_drafts: dict[str, int] = {}


class InitCache(msgspec.Struct, tag=True, **_HOT):
    num_blocks: int
    num_host_blocks: int = 0  # the host KV tier's blocks (0: off)


class ShutdownWorkers(msgspec.Struct, tag=True, **_HOT):
    pass


class CompileGrammar(msgspec.Struct, tag=True, **_HOT):
    """Sampling ranks: drop the grammars `drop_keys`, then compile this one off the step loop
    and answer with GrammarCompiled. The core schedules no request of this grammar before every
    sampling rank has answered, and decides alone which grammars the ranks hold
    (core/grammar_gate.py): a rank never drops one by itself."""

    key: str
    spec: StructuredOutputs
    drop_keys: list[str] = []


class LoadLoRA(msgspec.Struct, tag=True, **_HOT):
    """Every rank: drop the adapters `drop_ids` from the host pool, then read `lora` into it off
    the step loop and answer with LoRALoaded. The core schedules no request of this adapter before
    every rank has answered, and decides alone which adapters the pools hold (core/lora_gate.py)."""

    lora: LoRARequest
    drop_ids: list[int] = []


CoreToWorker = StepPlan | InitCache | ShutdownWorkers | CompileGrammar | LoadLoRA


# ---------------------------------------------------------------- workers -> core
class WorkerReady(msgspec.Struct, tag=True, **_HOT):
    """Sent after weights load (`num_blocks` this rank can hold) and again after InitCache."""

    rank: int
    num_blocks: int
    phase: str  # "profiled" | "cache_ready"
    seconds: float = 0.0
    timings: dict[str, float] = {}  # seconds per start-up step of this phase, in order
    # Host KV tier: "profiled" says how many host blocks --kv-offloading-size holds on this rank;
    # "cache_ready" what the rank measured for the preemption cost model (worker/host_tier.py)
    num_host_blocks: int = 0
    block_bytes: int = 0  # one block's bytes on this rank
    swap_s_per_block: float = 0.0  # one block copied out and one in, averaged
    recompute_s_per_token: float = 0.0  # one token's forward on this rank's layers


class StepResult(msgspec.Struct, tag=True, **_HOT):
    """Sent by the driver rank only. Aligned with the plan's `scheduled_ids`: an empty list where
    a request only advanced its prefill and sampled nothing; several ids where it verified
    drafts (the accepted ones, then one sampled after them). `logprobs`: one per sampled id."""

    step_id: int
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per scheduled request asking for prompt_logprobs: an entry per prompt token this step
    # scored (those after the step's prompt positions, in order; an empty list: none)
    prompt_logprobs: list[list[TokenLogprobs]] | None = None
    # Per scheduled request, a pooling request's vector once its prompt is done (float32,
    # little-endian; None: not done or not pooling)
    pooled: list[bytes | None] | None = None
    # LoRA (cumulative, this rank): adapters read into the host pool, evicted from device slots
    lora_loads: int = 0
    lora_evictions: int = 0
    # Per scheduled request, the drafts the sampling ranks proposed and verified for it where
    # the plan left them to (`StepPlan.num_sampler_drafts`; empty: no such row)
    num_drafts: list[int] = []


class WorkerError(msgspec.Struct, tag=True, **_HOT):
    rank: int
    message: str


class GrammarCompiled(msgspec.Struct, tag=True, **_HOT):
    """One sampling rank holds the compiled grammar `key` (or says why it could not)."""

    rank: int
    key: str
    error: str | None = None


class LoRALoaded(msgspec.Struct, tag=True, **_HOT):
    """One rank holds adapter `lora_int_id` in its host pool (or says why it could not)."""

    rank: int
    lora_int_id: int
    error: str | None = None


WorkerToCore = WorkerReady | StepResult | WorkerError | GrammarCompiled | LoRALoaded

"""When a row speculates, with which drafts, and what its verification taught.

Where the drafts come from:
- ngram with one pipeline stage (`after_sampling`): the sampling ranks draft, right after they
  sample (worker/sampler_drafts.py; vLLM's way): they hold each row's tokens as soon as they are
  sampled, the core only when a result comes back. The core plans a speculating row with `1 + k`
  tokens (`StepPlan.num_sampler_drafts`) without knowing its drafts, from where the row would be if
  every draft in flight were accepted (`num_computed_tokens` counts them: optimistic), so it plans
  the row again before its result returns, as async scheduling does for a plain row. The workers run
  the row from where it really is, with the drafts they found (maybe none). Each result says how
  many drafts a row verified (`StepResult.num_drafts`) and brings the accepted ones plus one; the
  core moves `num_computed_tokens` back by the planned slots that were not kept. It never exceeds
  the real end by more than the slots planned in flight (`RowSpec.ahead`), so the blocks past it
  that `_free_rejected` gives back hold no position a plan in flight runs.
- suffix, and ngram with pipeline stages: the core drafts from the token ids it holds when it
  plans, budgets `1 + k` tokens and allocates their slots exactly, and the plan carries the
  drafts to every rank (a first pipeline stage embeds them). Such a row drafts from its last
  known token, so it waits for its result before its next plan, but only while its known tokens
  already draft something; elsewhere it decodes plainly ahead of its result (`_in_sight`).
- A draft model or EAGLE head runs in the workers (worker/draft_model.py, worker/eagle.py): the
  core decides only how many drafts a row verifies (`StepPlan.num_model_drafts`) and keeps `k`
  placeholder drafts meanwhile; it waits for its result like a core-drafted row.
The workers verify all `k + 1` positions in one forward and return the accepted tokens plus one
(worker/spec_verify.py); the core moves `num_computed_tokens` back over the rejected drafts
(their KV slots are rewritten by the next step) and frees the blocks only they had spilled into
(`_free_rejected` in core/step_results.py).

Speculation turns itself off where it cannot pay:
- for the whole step while `disable_by_batch_size` requests are running or waiting;
- for a row (back to plain decoding, async scheduling included) after `MAX_MISSES` steps in a
  row without a draft (core drafting: such a step may have waited for its result; a sampler
  drafted row's step without drafts is a plain one that waited for nothing, so it does not
  count), or when its last verifications accepted on average fewer than
  `MIN_ACCEPTED` tokens; it tries again after a back-off that doubles each time
  (`MIN_BACKOFF`..`MAX_BACKOFF` output tokens) and resets when speculation pays again;
- never for constrained rows (structured outputs: drafts would bypass the grammar).
A row with sampler drafts in flight is planned again only with drafts; where it may not (turned
off, no room), it waits for its results first, so that a plain step starts where it really is.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.core.request import Request
from pagedserve.core.spec_decode.ngram import NgramProposer
from pagedserve.core.spec_decode.suffix import SuffixProposer
from pagedserve.speculative_config import SpeculativeConfig

MAX_MISSES = 4
WINDOW = 8  # verifications weighed for the acceptance rule
MIN_WINDOW = 4  # verifications before the rule applies
MIN_ACCEPTED = 0.5  # accepted tokens per verification below which a row stops speculating
MIN_BACKOFF, MAX_BACKOFF = 16, 256


@dataclass
class RowSpec:
    """One request's speculation state (on `Request.spec`)."""

    proposer: NgramProposer | SuffixProposer | None  # None: the workers draft
    drafts: list[int] = field(default_factory=list)  # in flight (verified by a planned step)
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))  # accepted each
    misses: int = 0  # steps in a row planned without a draft
    off_until: int = 0  # output tokens before which the row does not speculate
    backoff: int = MIN_BACKOFF
    tail_freed: bool = False  # blocks at its tail were freed since the last plan (deltas.py)
    ahead: int = 0  # draft slots of plans in flight that the sampling ranks fill (optimistic)

    @property
    def num_planned(self) -> int:
        """Draft slots in flight: the core's drafts, or the sampling ranks'."""
        return len(self.drafts) + self.ahead

    def forget_inflight(self) -> None:
        """The row was preempted: the results of its plans in flight will be dropped."""
        self.drafts = []
        self.ahead = 0


@dataclass
class SpecStats:
    """Cumulative, vLLM's spec_decode_* counters."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def token_proposer(c: SpeculativeConfig) -> NgramProposer | SuffixProposer:
    """A new row's proposer for the methods that draft from token ids (ngram, suffix)."""
    if c.method == "ngram":
        return NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max)
    return SuffixProposer(c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_spec_factor)


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, after_sampling: bool = False
    ) -> None:
        """`after_sampling`: the sampling ranks draft (ngram, one pipeline stage)."""
        self.config = config
        self.max_model_len = max_model_len
        self.after_sampling = after_sampling
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def _new_row(self, req: Request) -> RowSpec:
        in_workers = self.config.in_workers or self.after_sampling
        req.spec = RowSpec(None if in_workers else token_proposer(self.config))
        return req.spec

    def is_busy(self, num_requests: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is not None and num_requests >= limit

    def drafts_for(self, req: Request, budget: int, busy: bool) -> list[int] | None:
        """The drafts `req` verifies if planned now (maybe none: a plain step; zeros: the
        workers fill them in); None: skip it this step, it waits for a result in flight."""
        if req.sampling.structured_outputs is not None:
            return []
        if req.num_computed_tokens < req.num_tokens - 1:
            return []  # prompt (or recomputed output) left to compute
        row = req.spec if req.spec is not None else self._new_row(req)
        plain = None if row.ahead else []  # sampler drafts in flight: wait for them
        if busy or req.num_output_tokens < row.off_until:
            return plain
        if self.after_sampling:
            k = min(self.config.num_speculative_tokens, budget - 1, self._room(req))
            return [0] * k if k > 0 else plain
        if req.num_placeholders:  # wait for that token only where a draft is in sight
            return None if self._in_sight(req, row) else []
        k = min(self.config.num_speculative_tokens, budget - 1, self._room(req))
        if k <= 0:
            return []
        if row.proposer is None:  # the workers' draft model fills them in
            return [0] * k
        drafts = row.proposer.propose(req.all_token_ids, k)
        self._count_miss(req, row, bool(drafts))
        return drafts

    def _count_miss(self, req: Request, row: RowSpec, drafted: bool) -> None:
        row.misses = 0 if drafted else row.misses + 1
        if row.misses >= MAX_MISSES:
            self._back_off(req, row)

    def planned(self, req: Request, drafts: list[int]) -> None:
        """A plan verifies `drafts` for `req` (zeros where the workers draft)."""
        if self.after_sampling:
            req.spec.ahead += len(drafts)
        else:
            req.spec.drafts = list(drafts)

    def _in_sight(self, req: Request, row: RowSpec) -> bool:
        """Whether the tokens known so far already draft something (a copy is under way), so
        that the row waits for its token in flight and drafts after it. Elsewhere it decodes
        that step plainly, async scheduling included: on a GPU a step that waits for its result
        costs about three plain ones for a small model, so waiting for a draft that rarely
        comes costs more than speculation saves (chat). A draft model always drafts."""
        return row.proposer is None or bool(row.proposer.propose(req.all_token_ids, 1))

    def _room(self, req: Request) -> int:
        """Drafts that can still be used: the step's outputs (accepted + 1) stay within
        max_tokens and max_model_len, counting the tokens in flight as if every draft were
        accepted (then a row near its end waits for its results)."""
        known = req.num_tokens + req.num_placeholders + req.spec.num_planned
        room = self.max_model_len - known - 1
        max_tokens = req.sampling.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - (known - req.num_prompt_tokens) - 1)
        return room

    def _back_off(self, req: Request, row: RowSpec) -> None:
        row.off_until = req.num_output_tokens + row.backoff
        row.backoff = min(2 * row.backoff, MAX_BACKOFF)
        row.misses = 0
        row.recent.clear()

    def verified(self, req: Request, num_sampled: int, planned: int = 0, drafted: int = 0) -> int:
        """A current result brought `num_sampled` tokens for `req`, whose plan left `planned`
        draft slots to the sampling ranks, which filled `drafted` of them (0, 0: the core's
        drafts, if any): move its computed tokens back over the slots not kept, count, and
        apply the acceptance rule. Returns how many slots were rejected."""
        row = req.spec
        accepted = num_sampled - 1
        if row is None or not (planned or row.drafts):
            return 0
        if planned:
            assert 0 <= accepted <= drafted <= planned, (req, num_sampled, drafted, planned)
            row.ahead -= planned
            k = drafted
        else:
            k, planned = len(row.drafts), len(row.drafts)
            assert 0 <= accepted <= k, (req, num_sampled, row.drafts)
            row.drafts = []
        req.num_computed_tokens -= planned - accepted
        if k:
            self._count(req, row, k, accepted)
        return planned - accepted

    def _count(self, req: Request, row: RowSpec, k: int, accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += k
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1
        row.recent.append(accepted)
        if len(row.recent) >= MIN_WINDOW:
            if sum(row.recent) < MIN_ACCEPTED * len(row.recent):
                self._back_off(req, row)
            else:
                row.backoff = MIN_BACKOFF

"""Forward calls over policy-managed KV stores, each followed by the policy's eviction: the part of
`Engine` every one of its operations (prefill, decode, batches, packed calls, scoring) runs on.

One call, top to bottom (docs/architecture.md, "Data flow of one forward call"): the policy
prepares the call and bounds the store's capacity; with `select="vote"` recall, a vote pass
first; the model runs on the new token(s) (one graph per decode step with `compile`) -> the
store appends their keys/values and the call's measurements are folded into the policy's
statistics -> the last logits give the confidence `c` -> after a prefilled chunk, the maxima
pass the policy asks for (KVzip's reconstruction pass) -> the policy evicts down to this
call's budget and a `CallRecord` notes the call. A row's prompt is prefilled chunk by chunk
through the same path; only its last chunk gates the budget with its confidence.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from agent_kv.errors import TurnCancelled
from agent_kv.kv.cache import StoreCache
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.confidence import confidence
from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.kv_memory import KVMemory
from agent_kv.kv.policies import Policy
from agent_kv.kv.store import KVStore
from agent_kv.runtime.engine.decode_graph import DecodeGraph
from agent_kv.runtime.engine.model_call import run_call
from agent_kv.runtime.engine.sequence import CallRecord

VOTE = CallPlan(recall=True, vote=True)
"""The plan of a vote pass (`agent_kv.kv.cold_tier`, "Choosing pages across layers"): each
layer's cold pages scored and voted for (`RecallTier.vote`), its tokens not kept."""


class CallRunner:
    """Runs a causal LM's forward calls over stores a `Policy` manages, the policy evicting
    after each (`Engine` builds its operations on these).

    Args:
        model: a transformers causal LM loaded with `attn_implementation="agent_kv"`.
        tokenizer: its tokenizer (a policy's maxima pass may tokenize text with it).
        policy: the KV policy applied after every forward call that names no other.
        prefill_chunk: tokens per prefill forward call.
        decode_graph: runs the decode steps it takes as one graph each, or None to run every
            call eagerly.
        mixed_precision: the stores keep age-based mixed precision (`Int8Config`).

    Attributes:
        kv_memory: how far a sequence's KV may grow under a policy (`KVMemory`): each call's
            store bound, and a turn's byte bound that the session store reserves.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        policy: Policy,
        prefill_chunk: int,
        decode_graph: DecodeGraph | None,
        mixed_precision: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.prefill_chunk = prefill_chunk
        self.decode_graph = decode_graph
        self.kv_memory = KVMemory.for_model(model.config, prefill_chunk, mixed_precision)
        self._encoded: dict[str, list[int]] = {}  # text a policy's maxima pass tokenized

    def _forward(
        self,
        cache: StoreCache,
        rows: range,
        chunks: list[list[int]],
        all_positions: bool = False,
        policy: Policy | None = None,
    ) -> torch.Tensor:
        """One model call: `chunks[i]` (equal lengths `n`) for row `rows[i]` of the cache's
        store, whose capacity `policy` (default: the engine's) bounds. Returns float32 logits
        after each row's last token, `[len(rows), vocab]`, or with `all_positions` after every
        token, `[len(rows), n, vocab]`."""
        store = cache.store
        plan = self._prepare(policy or self.policy, store)
        n = len(chunks[0])
        self._vote(cache, rows, chunks, plan)
        if (
            self.decode_graph is not None
            and not all_positions
            and self.decode_graph.takes(store, rows, n, plan)
        ):
            return self.decode_graph.decode(cache, [chunk[0] for chunk in chunks], plan)
        call = ForwardCall.open(store, rows, n, plan)
        input_ids = torch.tensor(chunks, device=store.device)
        logits = run_call(self.model, cache, call, input_ids, 0 if all_positions else 1)
        return logits.float() if all_positions else logits[:, -1].float()

    def _vote(
        self, cache: StoreCache, rows: range, chunks: list[list[int]], plan: CallPlan
    ) -> None:
        """Before a multi-token call under `plan` that recalls with `select="vote"`: the vote
        pass, the last `ColdConfig.queries` tokens of each of `chunks` fed where they will
        stand, their tokens not kept, every layer's votes held for the call
        (`agent_kv.kv.cold_tier`, "Choosing pages across layers")."""
        store = cache.store
        n = len(chunks[0])
        if not plan.recall or n < 2 or not store.recall.due(n, rows[0]):
            return
        config = store.recall.tier.config
        if config.select != "vote":
            return
        tail = min(n, config.queries)
        call = ForwardCall.open(store, rows, tail, VOTE, ahead=n - tail)
        input_ids = torch.tensor([chunk[n - tail :] for chunk in chunks], device=store.device)
        run_call(self.model, cache, call, input_ids)

    def _prepare(self, policy: Policy, store: KVStore) -> CallPlan:
        """Before a forward call: the policy's plan for it (`Policy.prepare`), and the store's
        capacity bounded by the policy's bound (`KVMemory.bound_store`)."""
        plan = policy.prepare(store)
        self.kv_memory.bound_store(store, policy)
        return plan

    def _prefill_row(
        self,
        cache: StoreCache,
        row: int,
        token_ids: list[int],
        records: list[CallRecord],
        fed: Callable[[list[int], torch.Tensor], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> torch.Tensor:
        """Feed one row's tokens chunk by chunk, calling `fed(chunk, [vocab] logits)` after
        each; returns `[vocab]` logits after the last. Raises `TurnCancelled` when `cancel`
        is set before a chunk."""
        for start in range(0, len(token_ids), self.prefill_chunk):
            check_cancel(cancel)
            chunk = token_ids[start : start + self.prefill_chunk]
            last_chunk = start + self.prefill_chunk >= len(token_ids)
            logits = self._forward(cache, range(row, row + 1), [chunk])  # [1, vocab]
            self._after_chunk(self.policy, cache, row, chunk, logits, last_chunk, records)
            if fed is not None:
                fed(chunk, logits[0])
        return logits[0]

    def _after_chunk(
        self,
        policy: Policy,
        cache: StoreCache,
        row: int,
        chunk: list[int],
        logits: torch.Tensor,
        last_chunk: bool,
        records: list[CallRecord],
    ) -> None:
        """What follows a forward call of `chunk` on `row`: the maxima pass `policy` asks for
        (`Policy.maxima_pass_tokens`), then its eviction with the confidence of `logits`
        `[1, vocab]`. Inside a prompt the
        logits after a chunk boundary say nothing about the reply: only the last chunk's
        confidence gates the budget (`last_chunk`; otherwise the no-signal budget).
        """
        tokens = policy.maxima_pass_tokens(chunk, self._encode)
        if tokens:
            self._maxima_pass(policy, cache, row, tokens)
        self._apply_policy(
            cache.store, range(row, row + 1), logits, [last_chunk], [records], policy
        )

    def _encode(self, text: str) -> list[int]:
        """`text`'s token ids (no special tokens), tokenized once per engine."""
        if text not in self._encoded:
            self._encoded[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._encoded[text]

    def _maxima_pass(self, policy: Policy, cache: StoreCache, row: int, tokens: list[int]):
        """A maxima pass of `tokens` over `row` (`CallPlan.maxima_pass`): every stored token's
        largest attention from them folded into `policy`'s statistics that take maxima; the
        pass's own tokens are never kept, so the cache is as before but for those columns. The
        pass's rotary positions follow the row's, moved back as far as needed to stay inside
        the model's trained context (only at its very end do they overlap the row's last
        tokens)."""
        store = cache.store
        start = store.next_position(row)
        if store.max_positions:
            start = max(min(start, store.max_positions - len(tokens)), 0)
        plan = CallPlan(statistics=policy.statistics, maxima_pass=True)
        call = ForwardCall.open(store, range(row, row + 1), len(tokens), plan, start=start)
        run_call(self.model, cache, call, torch.tensor([tokens], device=store.device))

    def _apply_policy(
        self,
        store: KVStore,
        rows: range,
        logits: torch.Tensor,
        gated: list[bool],
        records: list[list[CallRecord]],
        policy: Policy | None = None,
    ) -> None:
        """Confidence from `logits` `[len(rows), vocab]`, one eviction by `policy` (default:
        the engine's) per row, one `CallRecord` appended to each row's `records`."""
        policy = policy or self.policy
        confs = [float(c) for c in confidence(logits)]
        gates = [c if g else None for c, g in zip(confs, gated, strict=True)]
        appended = [store.nbytes(row) for row in rows]
        for i, row in enumerate(rows):
            evicted = policy.evict(store, gates[i], rows=range(row, row + 1))
            records[i].append(
                CallRecord(
                    seen_tokens=store.seen(row),
                    appended_kv_live_bytes=appended[i],
                    kv_live_bytes=store.nbytes(row),
                    kv_allocated_bytes=store.figures.call_allocated_bytes // store.batch,
                    cold_kv_bytes=store.recall.nbytes(row),
                    confidence=confs[i],
                    gated=gated[i],
                    budget=policy.budget(gates[i]),
                    evicted=evicted,
                )
            )


def check_cancel(cancel: threading.Event | None) -> None:
    """Raise `TurnCancelled` when `cancel` is set (a turn's caller went away)."""
    if cancel is not None and cancel.is_set():
        raise TurnCancelled("the turn was cancelled: its caller went away")

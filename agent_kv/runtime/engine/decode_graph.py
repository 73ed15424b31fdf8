"""One graph per decode step: the model call on one new token per row, the store's attention
read and the commit of the new tokens and statistics, run as a single compiled (CPU) or
captured (CUDA) graph.

A decode step over a store a policy bounds (`KVStore.bound_capacity`) has static shapes
between the store's refits of its capacities: it reads every segment at its capacity (or the
bound), masked by length tensors
(`ForwardCall(static=True)`), and synchronises nothing. `DecodeGraph` runs such steps:
- on CUDA, as a CUDA graph (`torch.cuda.CUDAGraph`) captured once per store and capacities (the last
  `CAPTURES_PER_STORE` kept) and replayed: one launch from the host per step, the kernels as the
  eager step issues them; the first step of each capture runs eagerly and warms the kernels up;
- on CPU, through `torch.compile` with `kernels.cpu_compile.backend` (inductor, products with
  a few rows fused into multiply-reduce loops), one graph for every session of the same
  capacities (a capacity change compiles once more, with dynamic shapes from then on); the
  graph computes what the commit writes (`ForwardCall.fold`) and the writes run after it, in
  place: inductor copies a whole buffer that one graph both reads and writes.
The eager step (`compile=False` on the engine, `--no-compile`) is the same function uncompiled:
the oracle the compiled one is tested against.

Steps the graph does not take run eagerly (`DecodeGraph.takes`): prefill chunks, steps of some
rows only, stores without a policy's bound (full KV), rerotate positions (rotation tables
follow host lengths), a cold tier (recall inserts tokens mid-call) and reconstruction passes.
Sliding-window layers, logit soft-capping and attention sinks (Mistral, Gemma-2/3, gpt-oss)
are taken: their masks come from the positions the store keeps and the call's origin tensor,
all tensor operations; dropping the tokens that left a window runs after the step, on the
host (`KVStore.note_appended`).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from agent_kv.kv.cache import StoreCache
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.forward_call import CallTensors, ForwardCall
from agent_kv.kv.store import KVStore
from kernels import cpu_compile

CAPTURES_PER_STORE = 4
"""CUDA graphs kept per store, one per set of capacities: a steady decode moves between a few
(its capacities follow its live tokens, `agent_kv.kv.store`), each captured once."""


def decode_logits(
    model: torch.nn.Module,
    cache: StoreCache,
    input_ids: torch.Tensor,
    tensors: CallTensors,
    plan: CallPlan,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One static decode step over every row of `cache`'s store, measuring what `plan` says:
    the model on `input_ids` `[B, 1]` and what its commit writes (`ForwardCall.fold`), with
    nothing written yet. Returns float32 logits `[B, vocab]` and the fold. Tensor operations
    only: what the graph runs."""
    store = cache.store
    call = ForwardCall(store, range(store.batch), 1, tensors, plan, static=True)
    out = model(
        input_ids=input_ids,
        position_ids=tensors.position_ids,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
        kv_call=call,
    )
    return out.logits[:, -1].float(), call.fold()


def decode_step(
    model: torch.nn.Module,
    cache: StoreCache,
    input_ids: torch.Tensor,
    tensors: CallTensors,
    plan: CallPlan,
) -> torch.Tensor:
    """`decode_logits` and the writes of its fold: one whole static decode step (what a
    CUDA graph captures). Returns float32 logits `[B, vocab]`."""
    logits, folded = decode_logits(model, cache, input_ids, tensors, plan)
    store = cache.store
    ForwardCall(store, range(store.batch), 1, tensors, plan, static=True).write(folded)
    return logits


class DecodeGraph:
    """Runs an engine's static decode steps as one graph each (module docstring).

    Args:
        model: the engine's model.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._compiled = None
        self._captured: dict[tuple, _Captured] = {}

    @staticmethod
    def takes(store: KVStore, rows: range, n: int, plan: CallPlan) -> bool:
        """Whether a call of `n` tokens for `rows` of `store` under `plan` runs as a graph:
        one token for every row of a store whose FP capacity a policy bounds
        (`KVStore.fp_bounded`; full KV's growing read is faster through torch's eager
        attention than as a compiled loop: `benchmarks/decode_latency.py`), original
        positions, no cold tier, no reconstruction or vote pass."""
        return (
            n == 1
            and store.fp_bounded
            and rows == range(store.batch)
            and store.rotary is None
            and not plan.recall
            and plan.keeps_tokens
        )

    def decode(self, cache: StoreCache, tokens: list[int], plan: CallPlan) -> torch.Tensor:
        """Decode one token per row (`tokens`, one per row of the store) under `plan`:
        float32 logits `[B, vocab]`, the store moved on as an eager step would."""
        store = cache.store
        call = ForwardCall.open(store, range(store.batch), 1, plan, static=True)
        input_ids = torch.tensor([[t] for t in tokens], device=store.device)
        if store.device.type == "cuda":
            logits = self._replay(cache, input_ids, call.tensors, plan)
            call.close({})  # the captured step wrote its fold already
        else:
            _mark_dynamic(store, call.tensors)
            logits, folded = self._compile()(self.model, cache, input_ids, call.tensors, plan)
            call.close(folded)  # in place, outside the graph (`ForwardCall.fold`)
        return logits

    def _compile(self):
        if self._compiled is None:
            # fullgraph: a graph break (a host synchronisation, an unsupported call) is an
            # error, not a silent fallback to eager pieces
            self._compiled = torch.compile(
                decode_logits, backend=cpu_compile.backend, fullgraph=True
            )
        return self._compiled

    def _replay(
        self, cache: StoreCache, input_ids: torch.Tensor, tensors: CallTensors, plan: CallPlan
    ):
        """The step through the store's captured CUDA graph: captured at the second step of a
        store and capacity (the first runs eagerly, loading every kernel), replayed after."""
        store = cache.store
        key = (id(store), store.fp.capacity, store.q.capacity, store.scales.capacity,
               store.q["keys"].dtype, plan)  # fmt: skip
        captured = self._captured.get(key)
        if captured is None:
            mine = [k for k in self._captured if k[0] == id(store)]
            for old in mine[: max(0, len(mine) + 1 - CAPTURES_PER_STORE)]:  # the oldest go
                del self._captured[old]
            self._captured[key] = _Captured.pending()
            return decode_step(self.model, cache, input_ids, tensors, plan)
        if captured.graph is None:
            captured.capture(self.model, cache, input_ids, tensors, plan)
        return captured.replay(input_ids, tensors)


def _mark_dynamic(store: KVStore, tensors: CallTensors) -> None:
    """Trace the store's capacities and the call's read widths as symbolic sizes: one graph
    serves every capacity and every bound (pins change between turns), compiled once."""
    for table in (store.fp, store.q, store.scales):
        for name, spec in table.specs.items():
            torch._dynamo.maybe_mark_dynamic(table[name], spec.slot_dim)
    torch._dynamo.maybe_mark_dynamic(tensors.q_slots, 0)
    torch._dynamo.maybe_mark_dynamic(tensors.fp_slots, 0)


class _Captured:
    """A CUDA graph of `decode_logits` and its static inputs and output."""

    def __init__(self):
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, CallTensors] | None = None
        self.output: torch.Tensor | None = None

    @classmethod
    def pending(cls) -> _Captured:
        """Not captured yet: the next step captures."""
        return cls()

    def capture(
        self, model, cache, input_ids: torch.Tensor, tensors: CallTensors, plan: CallPlan
    ) -> None:
        """Record one step on static copies of the inputs (nothing runs while recording)."""
        static = CallTensors(
            **{field.name: getattr(tensors, field.name).clone() for field in fields(tensors)}
        )
        self.inputs = (input_ids.clone(), static)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = decode_step(model, cache, self.inputs[0], static, plan)

    def replay(self, input_ids: torch.Tensor, tensors: CallTensors) -> torch.Tensor:
        """Copy this step's inputs into the static ones, replay, return a copy of the
        logits."""
        static_ids, static = self.inputs
        static_ids.copy_(input_ids, non_blocking=True)
        for field in fields(tensors):
            getattr(static, field.name).copy_(getattr(tensors, field.name), non_blocking=True)
        self.graph.replay()
        return self.output.clone()

"""One graph per decode step: the compiled step equals the eager one (its oracle), traces with
no graph break (so no host synchronisation), and compiles once, whatever the capacities and
read widths (they are symbolic sizes)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent_kv.kv.attention import register_attention
from agent_kv.kv.forward_call import ForwardCall
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.decode_graph import DecodeGraph, decode_logits
from agent_kv.runtime.engine.engine import Engine


class _Tokenizer:
    eos_token_id = None


@pytest.fixture(scope="module")
def tiny_model():
    """A random-weight Llama of 2 layers, GQA (4 query heads on 2 KV heads)."""
    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        attn_implementation="agent_kv",
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _engines(model, name: str, params: dict, int8: Int8Config | None):
    return [
        Engine(model, _Tokenizer(), make_policy(name, **params), 64, int8, compile=compile)
        for compile in (False, True)
    ]


@pytest.mark.parametrize(
    "name,params,int8",
    [
        ("conf-kv", {"budget": 96, "protect_recent": 16}, Int8Config(fp_window=16, group=8)),
        ("h2o", {"budget": 64, "sinks": 4}, None),
    ],
)
def test_the_compiled_step_equals_the_eager_one(tiny_model, name, params, int8):
    eager, compiled = _engines(tiny_model, name, params, int8)
    runs = [(engine, engine.new_sequence()) for engine in (eager, compiled)]
    prompt = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    for engine, sequence in runs:
        engine.prefill(sequence, prompt)
    for _ in range(40):  # several evictions and INT8 groups
        token = int(runs[0][1].last_logits.argmax())
        for engine, sequence in runs:
            engine.prefill(sequence, [token])
        torch.testing.assert_close(
            runs[1][1].last_logits, runs[0][1].last_logits, atol=1e-4, rtol=0
        )
    (_, e), (_, c) = runs
    assert e.store.lengths() == c.store.lengths()
    assert e.store.quantized_lengths() == c.store.quantized_lengths()
    assert all(
        torch.equal(e.store.live_positions(layer), c.store.live_positions(layer))
        for layer in range(e.store.num_layers)
    )
    assert c.store.figures.evicted_tokens > 0
    if int8 is not None:
        assert c.store.figures.quantized_tokens > 0


def test_full_kv_decodes_eagerly(tiny_model):
    """Full KV's store has no bound: its steps stay eager, where torch's
    attention reads a growing cache faster than a compiled loop (`DecodeGraph.takes`)."""
    full, budgeted = (
        _engines(tiny_model, name, params, None)[1]
        for name, params in [("full", {}), ("conf-kv", {"budget": 96, "protect_recent": 16})]
    )
    takes = []
    for engine in (full, budgeted):
        sequence = engine.new_sequence()
        engine.prefill(sequence, list(range(100)))
        plan = engine.policy.prepare(sequence.store)
        takes.append(DecodeGraph.takes(sequence.store, range(1), 1, plan))
    assert takes == [False, True]


def test_the_step_traces_into_one_graph_and_compiles_once(tiny_model):
    _, engine = _engines(tiny_model, "conf-kv", {"budget": 96, "protect_recent": 16}, None)
    sequence = engine.new_sequence()
    engine.prefill(sequence, [t % 128 for t in range(200)])
    store = sequence.store
    call = ForwardCall.open(store, range(1), 1, static=True)
    explained = torch._dynamo.explain(decode_logits)(
        tiny_model, sequence.cache, torch.tensor([[5]]), call.tensors, call.plan
    )
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    engine.prefill(sequence, [5])  # compiles
    first = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    capacity = (store.fp.capacity, store.q.capacity)
    capacities = set()
    for token in range(60):  # evictions every evict_slack + 1 tokens: the capacity follows
        engine.prefill(sequence, [token % 128])
        capacities.add(store.fp.capacity)
    assert store.figures.evicted_tokens > 0 and len(capacities) <= 2
    # the first change of capacity compiles once more, with symbolic sizes; never again
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= first + 1
    widths = set()
    for turn in range(3):  # each turn pins more: a larger bound, capacity and read width
        seen = store.seen_tokens
        store.pins.pin(seen, seen + 40 * (turn + 1))
        engine.prefill(sequence, [t % 128 for t in range(50 * (turn + 1))])
        for token in range(3):
            engine.prefill(sequence, [token])
        widths.add(store.decode_widths()["fp"])
    assert len(widths) == 3 and store.fp.capacity > capacity[0]
    # the capacities and widths are symbolic sizes in the graph: still the one graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_step_over_shared_prefix_blocks_compiles_to_the_eager_one(tiny_model):
    """From the same state (a session reading another's shared blocks), each compiled decode
    step equals the eager one; compared step by step from copies, since two sessions run
    apart may flip a near-tie eviction and drift (the second session's prefill differs by
    ~1e-7 between the two engines)."""
    params = {"budget": 96, "protect_recent": 16}
    eager, compiled = (
        Engine(
            tiny_model,
            _Tokenizer(),
            make_policy("conf-kv", **params),
            64,
            compile=compile,
            share_prefixes=True,
        )  # fmt: skip
        for compile in (False, True)
    )
    generator = torch.Generator().manual_seed(2)
    system = torch.randint(0, 128, (100,), generator=generator).tolist()  # 3 whole blocks
    sessions = []
    for first in (5, 9):  # the second session reads the first one's blocks
        sequence = eager.new_sequence()
        sequence.store.pins.pin(0, len(system))
        eager.prefill(sequence, system + [first] * 120)
        sessions.append(sequence)
    sequence = sessions[1]
    assert sequence.store.prefix.tokens == 96 and sequence.steps[0].seen_tokens > 96
    compiled_steps = 0
    for _ in range(40):
        token = int(sequence.last_logits.argmax())
        twin = copy.deepcopy(sequence)
        assert twin.store.prefix.views()[0].run is sequence.store.prefix.views()[0].run
        eager.prefill(sequence, [token])
        plan = compiled.policy.prepare(twin.store)
        compiled_steps += DecodeGraph.takes(twin.store, range(1), 1, plan)
        compiled.prefill(twin, [token])
        torch.testing.assert_close(twin.last_logits, sequence.last_logits, atol=1e-4, rtol=0)
        assert twin.store.lengths() == sequence.store.lengths()
    assert compiled_steps == 40 and sequence.store.figures.evicted_tokens > 0
    assert eager.prefix_cache.blocks == 3


def test_warm_up_compiles_what_later_sessions_need(tiny_model):
    """After `warm_up` (the server's, before it says it is ready), sessions of their own
    tokens and sessions reading shared prefix blocks of other lengths compile nothing more."""
    torch._dynamo.reset()  # the graphs earlier tests compiled are not the warm-up's
    engine = Engine(
        tiny_model, _Tokenizer(), make_policy("conf-kv", budget=96, protect_recent=16), 64,
        compile=True, share_prefixes=True,
    )  # fmt: skip
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    engine.warm_up()
    warmed = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert warmed > before
    generator = torch.Generator().manual_seed(3)
    for system_tokens in (0, 100, 170):  # no shared blocks, 3 blocks, 5 blocks
        system = torch.randint(0, 128, (system_tokens,), generator=generator).tolist()
        for first in (5, 9):  # the second session reads the first one's blocks
            sequence = engine.new_sequence()
            sequence.store.pins.pin(0, len(system))
            engine.prefill(sequence, system + [first] * 40)
            for token in range(3):
                engine.prefill(sequence, [token])
        assert sequence.store.prefix.tokens == system_tokens // 32 * 32
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == warmed

"""Model families through the store's attention: tiny random-weight models of each family
(fp32, built in code, nothing downloaded), run through agent_kv and through transformers' own
eager attention, must give the same logits (atol 1e-4).

- Full KV: transformers' eager model with its own `DynamicCache` (its sliding-window layers
  and masks) is the reference; agent_kv prefills 40 tokens in chunks of 16 and decodes 30.
- A budgeted policy (`window`, 4 sinks, no slack) on the full-attention layers: the reference
  is one eager forward over the whole sequence with an explicit mask per layer type, which
  says what each query sees when every call's policy eviction keeps the sinks and the newest
  tokens up to the budget, and sliding layers keep their window.
- Sliding-window layers hold their window and no more after every call; global layers hold
  their budget; pins in sliding layers go once out of the window.
- The features bite (the reference with one turned off differs), the PyTorch kernels match a
  dense oracle with soft-capping, sinks and windows, the Triton dispatcher falls back for
  them, and the decode step still traces into one graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import transformers
from transformers import DynamicCache

from agent_kv.errors import ConfigError
from agent_kv.kv.attention import register_attention
from agent_kv.kv.attention_windows import attention_windows
from agent_kv.kv.forward_call import ForwardCall, append_kv
from agent_kv.kv.policies import make_policy
from agent_kv.kv.rope import Rotary
from agent_kv.kv.store import Int8Config, KVStore
from agent_kv.runtime.engine.decode_graph import decode_logits
from agent_kv.runtime.engine.engine import Engine
from kernels.softmax_extras import SoftmaxExtras
from kernels.torch_attention import (
    Segment,
    fused_attention,
    sampled_mass,
    segmented_attention,
    single_pass_attention,
)

VOCAB = 256
PROMPT = 40
CHUNK = 16
DECODE = 30
ATOL = 1e-4


class _Tokenizer:
    eos_token_id = None


@dataclass(frozen=True)
class Family:
    """A tiny config of one family and the per-layer windows it must give the store."""

    config: str
    model: str
    windows: tuple[int | None, ...]
    overrides: dict = field(default_factory=dict)


SMALL = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "initializer_range": 0.2,
}  # fmt: skip
FAMILIES = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", (None,) * 4),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", (None,) * 4),
    "qwen2-window": Family(
        "Qwen2Config", "Qwen2ForCausalLM", (None, None, 8, 8),
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    ),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", (None,) * 4),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", (None,) * 4, {"pad_token_id": 0}),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", (None,) * 4),
    "mistral": Family("MistralConfig", "MistralForCausalLM", (None,) * 4, {"sliding_window": None}),
    "mistral-window": Family(
        "MistralConfig", "MistralForCausalLM", (16,) * 4, {"sliding_window": 16}
    ),
    "gemma2": Family(
        "Gemma2Config", "Gemma2ForCausalLM", (8, None, 8, None),
        {"sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 1.0},
    ),
    "gemma3": Family(
        "Gemma3TextConfig", "Gemma3ForCausalLM", (8, 8, 8, 8, 8, None),
        {"sliding_window": 8, "query_pre_attn_scalar": 16, "num_hidden_layers": 6},
    ),
    "gpt-oss": Family(
        "GptOssConfig", "GptOssForCausalLM", (8, None, 8, None),
        {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
         "max_position_embeddings": 131072},
    ),
}  # fmt: skip
SLIDING = [name for name, family in FAMILIES.items() if any(family.windows)]


def _classes(family: Family):
    config_cls = getattr(transformers, family.config, None)
    model_cls = getattr(transformers, family.model, None)
    assert config_cls is not None and model_cls is not None, (
        f"transformers {transformers.__version__} has no {family.model}: every family here "
        "is in the pinned version"
    )
    return config_cls, model_cls


_BUILT: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def _models(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`(eager reference, agent_kv model)` of a family, the same random weights (seed 0)."""
    if name not in _BUILT:
        register_attention()
        family = FAMILIES[name]
        config_cls, model_cls = _classes(family)
        settings = {**SMALL, **family.overrides}
        torch.manual_seed(0)
        reference = model_cls(config_cls(**settings, attn_implementation="eager")).eval()
        ours = model_cls(config_cls(**settings, attn_implementation="agent_kv")).eval()
        ours.load_state_dict(reference.state_dict())
        _BUILT[name] = (reference, ours)
    return _BUILT[name]


def _tokens(count: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_windows(store: KVStore, budget: int | None = None) -> None:
    """Every sliding layer holds at most its window past `attention_window_slack` (exactly the last
    `window - 1` positions with no slack); with a budget, each global layer exactly it."""
    seen = store.seen_tokens
    for layer, window in enumerate(store.attention_windows):
        held = store.length(layer)
        if window is not None:
            assert held <= window - 1 + store.attention_window_slack
            if store.attention_window_slack == 0:
                assert store.live_positions(layer).tolist() == list(
                    range(max(seen - window + 1, 0), seen)
                )
        elif budget is not None:
            assert held == min(seen, budget)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_store_takes_each_layers_window_from_the_config(name):
    _, ours = _models(name)
    assert KVStore.for_model(ours).attention_windows == FAMILIES[name].windows
    assert attention_windows(ours.config) == FAMILIES[name].windows


@pytest.mark.parametrize("name", list(FAMILIES))
def test_full_kv_matches_transformers_with_its_own_cache(name):
    reference, ours = _models(name)
    engine = Engine(ours, _Tokenizer(), make_policy("full"), prefill_chunk=CHUNK)
    sequence = engine.new_sequence()
    prompt = _tokens(PROMPT)
    got = engine.prefill(sequence, prompt)  # 3 chunks, past the window
    cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        want = reference(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for _ in range(DECODE):
        token = int(want.argmax())
        got = engine.prefill(sequence, [token])
        with torch.no_grad():
            want = reference(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        _check_windows(sequence.store)
    assert sequence.store.figures.evicted_tokens == 0


def _visible(total: int, starts: torch.Tensor, window: int | None, budget: int, sinks: int):
    """`[total, total]` bool: may the query at p see the key at k, when p's call began at
    `starts[p]`: causal, within the window (a sliding layer), or (a global layer) among the
    call's own tokens, the sinks or the newest `budget - sinks` before the call."""
    p = torch.arange(total)[:, None]
    k = torch.arange(total)[None, :]
    causal = k <= p
    if window is not None:
        return causal & (k > p - window)
    start = starts[:, None]
    return causal & ((k >= start) | (k < sinks) | (k >= start - (budget - sinks)))


def _mask(visible: torch.Tensor) -> torch.Tensor:
    """An additive `[1, 1, n, n]` float32 mask for the eager attention."""
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("budget", [24, 128])
@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma2", "gemma3", "gpt-oss"])
def test_a_budget_on_the_global_layers_matches_an_explicit_mask(name, budget):
    reference, ours = _models(name)
    sinks = 4
    policy = make_policy("window", budget=budget, sinks=sinks, evict_slack=0)
    engine = Engine(ours, _Tokenizer(), policy, prefill_chunk=CHUNK)
    sequence = engine.new_sequence()
    sequence.store.attention_window_slack = 0
    tokens = _tokens(PROMPT + DECODE, seed=2)
    total = len(tokens)
    starts = torch.arange(total)  # a decode token starts its own call
    starts[:PROMPT] = torch.arange(PROMPT) // CHUNK * CHUNK
    windows = FAMILIES[name].windows
    window = next((w for w in windows if w is not None), None)
    masks = {
        "full_attention": _mask(_visible(total, starts, None, budget, sinks)),
        "sliding_attention": _mask(_visible(total, starts, window, budget, sinks)),
    }
    if all(w is None for w in windows):
        mask = masks["full_attention"]
    elif all(w is not None for w in windows):
        mask = masks["sliding_attention"]
    else:
        mask = masks
    with torch.no_grad():
        want = reference(torch.tensor([tokens]), attention_mask=mask).logits[0]
    for start in range(0, PROMPT, CHUNK):
        got = engine.prefill(sequence, tokens[start : min(start + CHUNK, PROMPT)])
        _check_windows(sequence.store, budget)
    torch.testing.assert_close(got, want[PROMPT - 1], atol=ATOL, rtol=0)
    for position in range(PROMPT, total):
        got = engine.prefill(sequence, [tokens[position]])
        torch.testing.assert_close(got, want[position], atol=ATOL, rtol=0)
        _check_windows(sequence.store, budget)
    evicts = any(w is None for w in windows) and budget < total
    assert (sequence.store.figures.evicted_tokens > 0) == evicts
    assert (sequence.store.figures.attention_window_dropped > 0) == (window is not None)


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_pins_stay_in_global_layers_and_leave_sliding_ones_with_the_window(name):
    _, ours = _models(name)
    engine = Engine(ours, _Tokenizer(), make_policy("window", budget=16, sinks=0), CHUNK)
    sequence = engine.new_sequence()
    sequence.store.pins.pin(0, 4)
    engine.prefill(sequence, _tokens(PROMPT))
    for token in _tokens(10, seed=3):
        engine.prefill(sequence, [token])
    store = sequence.store
    for layer, window in enumerate(store.attention_windows):
        positions = set(store.live_positions(layer).tolist())
        assert ({0, 1, 2, 3} <= positions) == (window is None)


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss", "mistral-window"])
def test_rerotate_positions_match_transformers_under_full_kv(name):
    """Under full KV the rerotated positions of every layer keep the original distances
    (a sliding layer holds consecutive tokens), so the logits are transformers' own."""
    reference, ours = _models(name)
    engine = Engine(ours, _Tokenizer(), make_policy("full"), CHUNK, rerotate=True)
    sequence = engine.new_sequence()
    sequence.store.attention_window_slack = 0
    tokens = _tokens(PROMPT + 10, seed=4)
    engine.prefill(sequence, tokens[:PROMPT])
    for token in tokens[PROMPT:]:
        got = engine.prefill(sequence, [token])
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_rerotate_is_refused_for_one_rotary_per_layer_type():
    _, ours = _models("gemma3")
    with pytest.raises(ConfigError, match="one per layer type"):
        Rotary.from_model(ours)


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss", "mistral-window"])
def test_each_feature_changes_the_reference(name):
    """The comparisons above would catch an ignored feature: turning it off in the
    reference moves the logits far past the tolerance."""
    reference, _ = _models(name)
    ids = torch.tensor([_tokens(PROMPT + DECODE)])
    with torch.no_grad():
        base = reference(ids).logits
        changes = []
        attention = [layer.self_attn for layer in reference.model.layers]
        if name == "gemma2":
            caps = [module.attn_logit_softcapping for module in attention]
            for module in attention:
                module.attn_logit_softcapping = None
            changes.append(reference(ids).logits)
            for module, cap in zip(attention, caps, strict=True):
                module.attn_logit_softcapping = cap
        if name == "gpt-oss":
            sinks = [module.sinks.clone() for module in attention]
            for module in attention:
                module.sinks.fill_(-1e4)
            changes.append(reference(ids).logits)
            for module, saved in zip(attention, sinks, strict=True):
                module.sinks.copy_(saved)
        window = reference.config.sliding_window
        reference.config.sliding_window = 10_000
        changes.append(reference(ids).logits)
        reference.config.sliding_window = window
    for changed in changes:
        assert (changed - base).abs().max() > 1e-2


def test_int8_mixed_precision_trims_quantized_window_tokens():
    _, ours = _models("gemma2")
    int8 = Int8Config(fp_window=4, group=2)
    engine = Engine(ours, _Tokenizer(), make_policy("window", budget=24, sinks=4), CHUNK, int8)
    sequence = engine.new_sequence()
    sequence.store.attention_window_slack = 0
    engine.prefill(sequence, _tokens(PROMPT))
    for token in _tokens(DECODE, seed=5):
        logits = engine.prefill(sequence, [token])
        _check_windows(sequence.store)
    assert torch.isfinite(logits).all()
    assert sequence.store.figures.quantized_tokens > 0


def test_a_store_without_the_models_windows_is_refused():
    _, ours = _models("mistral-window")
    store = KVStore.for_model(ours, attention_windows=(None,) * 4)
    call = ForwardCall.open(store, range(1), 3)
    with pytest.raises(ValueError, match="sliding window of 16 tokens"):
        ours(input_ids=torch.tensor([[1, 2, 3]]), position_ids=call.tensors.position_ids,
             kv_call=call, use_cache=False)  # fmt: skip


def test_layer_types_agent_kv_does_not_run_are_refused():
    config = transformers.LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ConfigError, match="chunked_attention"):
        attention_windows(config)
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)
    with pytest.raises(ConfigError, match="bidirectional"):
        attention_windows(gemma3)


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_the_decode_step_with_windows_softcap_and_sinks_traces_into_one_graph(name):
    _, ours = _models(name)
    engine = Engine(ours, _Tokenizer(), make_policy("window", budget=24, sinks=4), CHUNK)
    sequence = engine.new_sequence()
    engine.prefill(sequence, _tokens(PROMPT))
    store = sequence.store
    call = ForwardCall.open(store, range(1), 1, static=True)
    explained = torch._dynamo.explain(decode_logits)(
        ours, sequence.cache, torch.tensor([[5]]), call.tensors, call.plan
    )
    assert explained.graph_break_count == 0 and explained.graph_count == 1


# -- the PyTorch kernels against a dense oracle ------------------------------------------------


def _oracle(query, keys, values, scaling, visible, extras):
    """Dense attention `[B, q, Hq, D]` and per-token mass `[B, Hkv, L]`: GQA by repetition,
    soft-cap, mask, softmax with the sink column, the sink's share dropped."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    logits = extras.cap(query @ k.transpose(-1, -2) * scaling)
    logits = logits.masked_fill(~visible, float("-inf"))  # [B, Hq, q, L]
    if extras.sinks is not None:
        sink = extras.sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = (probs @ v).transpose(1, 2)
    mass = probs.sum(dim=2).view(keys.shape[0], keys.shape[1], group, -1).sum(dim=2)
    return out, mass


def _windowed_call(window: int = 5):
    """Query `[2, 4, 6, D]` over a stored segment of 10 slots (row lengths 10 and 7) and the
    6 new tokens, original positions: stored 0..9 (row 1: 0..6), queries from 10 (row 1: 7);
    a window of `window` tokens."""
    torch.manual_seed(3)
    batch, q_heads, kv_heads, q_len, width, dim = 2, 4, 2, 6, 10, 8
    query = torch.randn(batch, q_heads, q_len, dim)
    stored_k, stored_v = torch.randn(2, batch, kv_heads, width, dim).unbind(0)
    new_k, new_v = torch.randn(2, batch, kv_heads, q_len, dim).unbind(0)
    lengths = torch.tensor([10, 7])
    positions = torch.arange(width).expand(batch, -1)
    queries = lengths[:, None] + torch.arange(q_len)  # [B, q]
    stored_window = positions[:, None, None, :] > (queries - window)[:, None, :, None]
    offsets = torch.arange(q_len)
    new_window = (offsets[None, :] > offsets[:, None] - window)[None, None]
    segments = [
        Segment(stored_k, stored_v, lengths, window=stored_window),
        Segment(new_k, new_v, torch.full((batch,), q_len), causal=True, window=new_window),
    ]
    # the oracle's view: one dense row per batch row, the stored slots past a length masked
    keys = torch.cat([stored_k, new_k], dim=2)
    values = torch.cat([stored_v, new_v], dim=2)
    live = torch.arange(width)[None, None, :] < lengths[:, None, None]  # [B, 1, W]
    stored_visible = live & stored_window[:, 0]
    new_visible = (offsets[None, :] <= offsets[:, None]) & new_window[0, 0]
    visible = torch.cat([stored_visible, new_visible.expand(batch, -1, -1)], dim=-1)[:, None]
    return query, segments, keys, values, visible


@pytest.mark.parametrize(
    "extras",
    [SoftmaxExtras(), SoftmaxExtras(softcap=0.7), SoftmaxExtras(sinks=torch.randn(4)),
     SoftmaxExtras(softcap=2.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))],
)  # fmt: skip
def test_every_read_path_applies_windows_softcap_and_sinks(extras):
    query, segments, keys, values, visible = _windowed_call()
    want_out, want_mass = _oracle(query, keys, values, 0.4, visible, extras)
    for out, mass in (
        single_pass_attention(query, segments, 0.4, extras),
        segmented_attention(query, segments, 0.4, block=4, extras=extras),
    ):
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.cat(mass, dim=-1), want_mass, atol=1e-5, rtol=1e-5)
    fused = fused_attention(query, segments, 0.4, extras=extras)
    torch.testing.assert_close(fused, want_out, atol=1e-5, rtol=1e-5)
    sampled = sampled_mass(query, torch.arange(6), segments, 0.4, extras=extras)
    torch.testing.assert_close(torch.cat(sampled, dim=-1), want_mass, atol=1e-5, rtol=1e-5)
    if extras.sinks is not None:  # the sink's share goes to no token
        assert (want_mass.sum(dim=-1) < 2 * 6).all()


def test_the_triton_path_falls_back_for_what_it_does_not_implement(monkeypatch):
    pytest.importorskip("triton")
    from kernels import dispatch, triton_attention

    query, segments, *_ = _windowed_call()
    plain = [Segment(s.keys, s.values, s.lengths, s.causal) for s in segments]
    assert "sliding-window" in triton_attention.unsupported(query, segments)
    assert "soft-capping" in triton_attention.unsupported(query, plain, SoftmaxExtras(1.0))
    sinks = SoftmaxExtras(sinks=torch.zeros(4))
    assert "sinks" in triton_attention.unsupported(query, plain, sinks)
    monkeypatch.setenv(dispatch.ENV, "triton")
    extras = SoftmaxExtras(softcap=1.0, sinks=torch.ones(4))
    got = dispatch.decode_attention(query, segments, 0.4, extras)
    want = single_pass_attention(query, segments, 0.4, extras)
    torch.testing.assert_close(got[0], want[0])


def test_the_compiled_decode_step_equals_the_eager_one_with_windows_and_softcap():
    _, ours = _models("gemma2")
    policy = {"budget": 24, "sinks": 4}
    engines = [
        Engine(ours, _Tokenizer(), make_policy("window", **policy), CHUNK, compile=compile)
        for compile in (False, True)
    ]
    runs = [(engine, engine.new_sequence()) for engine in engines]
    for engine, sequence in runs:
        engine.prefill(sequence, _tokens(PROMPT))
    for token in _tokens(45, seed=6):  # past several window trims (slack 32) and evictions
        eager, compiled = (engine.prefill(sequence, [token]) for engine, sequence in runs)
        torch.testing.assert_close(compiled, eager, atol=ATOL, rtol=0)
    (_, eager_run), (_, compiled_run) = runs
    assert compiled_run.store.lengths() == eager_run.store.lengths()
    assert (
        compiled_run.store.figures.attention_window_dropped > 0
        and compiled_run.store.figures.evicted_tokens > 0
    )


def test_a_saved_store_keeps_its_windows_and_what_they_dropped():
    store = KVStore(2, 1, 4, attention_windows=(3, None))
    store.attention_window_slack = 0
    append_kv(store, torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))
    assert store.lengths() == [2, 5] and store.figures.attention_window_dropped == 3
    assert store.segments.changed_at == [5]  # the window layer cannot go back before position 5
    saved = KVStore.from_state(store.state())
    assert saved.attention_windows == (3, None) and saved.figures.attention_window_dropped == 3
    assert saved.attention_window_slack == 0
    assert saved.lengths() == [2, 5]
    assert saved.live_positions(0).tolist() == [3, 4]

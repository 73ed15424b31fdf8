"""Weight formats (`--weights`): each format's products against fp32's on a tiny random-weight
Qwen2 (the bundled models' family, built in code), through agent_kv's engine; the fp16 pack
inside a compiled graph; the KV store stays float32 under every format."""

from __future__ import annotations

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from agent_kv.errors import ConfigError
from agent_kv.kv.attention import register_attention
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.weight_formats import (
    WEIGHT_FORMATS,
    apply_weight_format,
    check_weight_format,
    load_dtype,
    weight_format,
)
from kernels.gguf_blocks import int4_groups
from kernels.packed_linear import PackedLinear, packed_linear
from kernels.quantized_linear import Int4Linear, Int8Linear
from tests.conftest import torch_seed

CONFIG = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "attn_implementation": "agent_kv",
}  # fmt: skip
PROMPT = list(range(7, 7 + 150))
# Relative L2 error of the last logits against fp32: fp16 rounds each weight (2^-11 relative),
# bf16 rounds weights and activations (2^-8), INT8 rounds weights to 1/254 of their row's
# range and its packed decode product rounds activations to bf16.
TOLERANCE = {"fp32": 0.0, "fp16": 2e-3, "int8": 5e-2, "gguf": 5e-2, "bf16": 5e-2}


class _Tokenizer:
    eos_token_id = None


def tiny_qwen(weights: str) -> torch.nn.Module:
    register_attention()
    with torch_seed(0):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG)).eval()
    model.to(load_dtype(weights))
    return apply_weight_format(model, weights)


def run_logits(model: torch.nn.Module, policy: str) -> tuple[torch.Tensor, torch.dtype]:
    """Prefill `PROMPT` in chunks of 64, decode 8 tokens; the last logits `[vocab]` and the
    store's dtype."""
    params = {} if policy == "full" else {"budget": 48, "protect_recent": 8}
    built = make_policy(policy, **params)
    engine = Engine(model, _Tokenizer(), built, prefill_chunk=64)
    sequence = engine.new_sequence()
    engine.prefill(sequence, PROMPT)
    for token in range(20, 28):
        logits = engine.prefill(sequence, [token])
    return logits, sequence.store.dtype


@pytest.mark.parametrize("policy", ["full", "conf-kv"])
@pytest.mark.parametrize("weights", [w for w in WEIGHT_FORMATS if w != "fp32"])
def test_format_logits_close_to_fp32(weights, policy):
    reference, _ = run_logits(tiny_qwen("fp32"), policy)
    logits, kv_dtype = run_logits(tiny_qwen(weights), policy)
    error = float((logits - reference).norm() / reference.norm())
    assert 0 < error < TOLERANCE[weights], error  # > 0: the format did change the products
    assert kv_dtype == torch.float32


@pytest.mark.parametrize("weights", ["fp16", "int8"])
def test_packs_replace_every_linear_and_drop_fp32_weights(weights):
    model = tiny_qwen(weights)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    kind = PackedLinear if weights == "fp16" else Int8Linear
    packed = [m for m in model.modules() if isinstance(m, kind)]
    assert len(packed) == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head
    held = sum(p.numel() for p in model.parameters())
    assert (
        held == CONFIG["vocab_size"] * CONFIG["hidden_size"] + (2 * 3 + 1) * CONFIG["hidden_size"]
    )  # embeddings and norms only


def test_gguf_format_of_float_weights_holds_int8_rows():
    """A model directory has no 4-bit blocks: `gguf` holds every linear layer as INT8 rows."""
    model = tiny_qwen("gguf")
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 3 * 7 + 1
    assert weight_format(model) == "gguf"


def test_packed_linear_matches_linear_with_bias_and_batch_dims():
    with torch_seed(1):
        linear = torch.nn.Linear(96, 40)
        x = torch.randn(2, 5, 96)
    packed = PackedLinear(linear, "fp16")
    expected = linear(x)
    out = packed(x)
    assert out.shape == (2, 5, 40)
    assert float((out - expected).norm() / expected.norm()) < 1e-3
    with torch.no_grad():
        rounded = torch.nn.functional.linear(x, linear.weight.half().float(), linear.bias)
    torch.testing.assert_close(out, rounded, atol=1e-4, rtol=1e-4)  # fp16 weights, fp32 math


def test_packed_linear_compiles_into_one_graph():
    with torch_seed(2):
        linear = torch.nn.Linear(64, 32)
        x = torch.randn(3, 64)
    packed = PackedLinear(linear, "fp16")
    compiled = torch.compile(lambda t: torch.relu(packed(t)) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(packed(x)) * 2)
    traced = torch.fx.experimental.proxy_tensor.make_fx(
        lambda t: packed_linear(t, packed.handle, 32), tracing_mode="fake"
    )(x)
    ops = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.agent_kv.packed_linear.default]  # one opaque call


def test_packed_linear_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32 CPU layer"):
        PackedLinear(torch.nn.Linear(8, 8).to(torch.bfloat16), "fp16")
    with pytest.raises(ValueError, match="unknown pack"):
        PackedLinear(torch.nn.Linear(8, 8), "int4")


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="fp32, bf16, fp16, int8, gguf"):
        check_weight_format("int3")
    assert load_dtype("bf16") == torch.bfloat16 and load_dtype("fp16") == torch.float32


def tiny_qwen_int4() -> torch.nn.Module:
    """`tiny_qwen` with every linear layer's weight put through GGUF's Q4_0 blocks and held as
    an `Int4Linear` (the `gguf` format's layer for 4-bit tensors)."""
    model = tiny_qwen("fp32")

    def replace(module: torch.nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                weight = child.weight.detach().numpy()
                raw = gguf_quantize(weight, GGMLQuantizationType.Q4_0)
                groups = int4_groups(raw, "Q4_0", tuple(weight.shape))
                bias = None if child.bias is None else child.bias.detach()
                setattr(module, name, Int4Linear(groups, bias))
            else:
                replace(child)

    replace(model)
    return model


@pytest.mark.parametrize("weights", ["fp16", "int8", "int4"])
def test_decode_graph_equals_eager_step(weights):
    """`--compile` with packed weights: the decode step is one graph (the packed products are
    opaque calls inside it) and gives the eager step's logits."""
    model = tiny_qwen_int4() if weights == "int4" else tiny_qwen(weights)
    results = []
    for compile in (False, True):
        policy = make_policy("conf-kv", budget=48, protect_recent=8)
        engine = Engine(model, _Tokenizer(), policy, prefill_chunk=64, compile=compile)
        sequence = engine.new_sequence()
        engine.prefill(sequence, PROMPT)
        results.append(torch.stack([engine.prefill(sequence, [t]) for t in range(20, 26)]))
    torch.testing.assert_close(results[1], results[0], atol=1e-3, rtol=1e-3)


def test_int8_is_weight_only():
    """INT8 weights with one scale per row, activations unquantized: an outlier input feature
    leaves the other rows' products as accurate as before (fbgemm's dynamic INT8, the format's
    former product, quantized the whole call's input with one scale)."""
    with torch_seed(3):
        linear = torch.nn.Linear(64, 16, bias=False)
        x = torch.randn(4, 64)
    packed = Int8Linear(linear.weight.detach(), None)
    with torch.no_grad():
        expected = linear(x)
        error = float((packed(x) - expected).norm() / expected.norm())
        outlier = x.clone()
        outlier[0, 0] = 200.0
        worse = packed(outlier)[1:] - linear(outlier)[1:]
        worse_error = float(worse.norm() / expected[1:].norm())
    assert 1e-4 < error < 1e-2
    assert worse_error < 2 * error

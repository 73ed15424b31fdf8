"""The Triton kernels against the PyTorch path, run by Triton's interpreter on CPU tensors:
decode attention with the attention mass (`kernels.triton_attention` vs
`kernels.torch_attention.segmented_attention` and the dense oracle `attention_with_mass`),
quantize-on-append (`kernels.triton_store_ops` vs `kernels.int8` and `kernels.fp8`), and the
dispatcher (`kernels.dispatch`).

Tolerances: float32 attention output atol = rtol = 1e-4 and mass atol = rtol = 1e-5 (the
kernels sum in another order than the reference); a bfloat16 output within one bf16 step
(atol 1e-2); quantized codes, scales and the store's buffers bit-identical.

Triton reads `TRITON_INTERPRET` when a `@triton.jit` function is defined, so `conftest.py`
sets it before anything imports triton.language; this module checks that it took effect.
"""

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(tl.zeros, InterpretedFunction):
    pytest.fail(
        "triton.language was imported before TRITON_INTERPRET=1 was set, so Triton's "
        "interpreter cannot run: run pytest with TRITON_INTERPRET=1 in the environment",
        pytrace=False,
    )

from agent_kv.kv.attention import store_attention  # noqa: E402
from agent_kv.kv.call_plan import CallPlan  # noqa: E402
from agent_kv.kv.forward_call import ForwardCall, append_kv  # noqa: E402
from agent_kv.kv.policies.conf_kv import AttentionEma  # noqa: E402
from agent_kv.kv.store import Int8Config, KVStore  # noqa: E402
from kernels import dispatch, fp8, int8, triton_attention, triton_store_ops  # noqa: E402
from kernels.formats import QUANT_FORMATS  # noqa: E402
from kernels.torch_attention import Segment, attention_with_mass, segmented_attention  # noqa: E402

OUT_TOL = {"atol": 1e-4, "rtol": 1e-4}
MASS_TOL = {"atol": 1e-5, "rtol": 1e-5}
GROUP = 16


def quantized_segment(gen, batch, kv_heads, head_dim, lengths, fmt) -> Segment:
    """A quantized segment `max(lengths)` slots wide whose rows kept a random subset of the
    tokens quantized in runs of `GROUP` (as after eviction: each slot keeps its run's scale
    row, so `scale_index` is increasing with gaps)."""
    width = max(lengths)
    tokens = (width // GROUP + 2) * GROUP
    parts = {name: [] for name in ("keys", "values", "key_scales", "value_scales", "index")}
    for _ in range(batch):
        codes, scales = QUANT_FORMATS[fmt].quantize(
            torch.randn(kv_heads, tokens, head_dim, generator=gen) * 3, GROUP
        )
        value_codes, value_scales = QUANT_FORMATS[fmt].quantize(
            torch.randn(kv_heads, tokens, head_dim, generator=gen), GROUP
        )
        kept = torch.randperm(tokens, generator=gen)[:width].sort().values
        parts["keys"].append(codes[:, kept])
        parts["values"].append(value_codes[:, kept])
        parts["key_scales"].append(scales)
        parts["value_scales"].append(value_scales)
        parts["index"].append(kept // GROUP)
    stacked = {name: torch.stack(tensors) for name, tensors in parts.items()}
    return Segment(
        stacked["keys"], stacked["values"], lengths, False,
        stacked["key_scales"], stacked["value_scales"], stacked["index"],
    )  # fmt: skip


def fp_segment(gen, batch, kv_heads, head_dim, lengths, dtype) -> Segment:
    """The causal FP segment; slots past a row's length hold large garbage, which must not
    leak into the softmax."""
    shape = (batch, kv_heads, max(lengths), head_dim)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for row, length in enumerate(lengths):
        keys[row, :, length:] = 1e4
        values[row, :, length:] = -1e4
    return Segment(keys.to(dtype), values.to(dtype), lengths, causal=True)


CASES = {
    # name: (batch, kv_heads, group, q_len, head_dim, quantized format, split)
    "b1-gqa1-q1-d64-int8": (1, 2, 1, 1, 64, "int8", None),
    "b3-gqa3-q4-d64-int8-split": (3, 2, 3, 4, 64, "int8", 64),
    "b3-gqa4-q1-d128-int8-split": (3, 2, 4, 1, 128, "int8", 64),
    "b1-gqa4-q4-d128-fp8": (1, 2, 4, 4, 128, "fp8", None),
    "b3-gqa3-q1-d128-fp8-split": (3, 1, 3, 1, 128, "fp8", 64),
    "b1-gqa3-q4-d64-fp-only": (1, 2, 3, 4, 64, None, None),
    "b3-gqa1-q4-d128-fp-only-split": (3, 2, 1, 4, 128, None, 64),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decode_attention_matches_reference(case):
    batch, kv_heads, group, q_len, head_dim, fmt, split = case
    gen = torch.Generator().manual_seed(sum(case[:5]))
    fp_lengths = torch.randint(q_len, 90, (batch,), generator=gen).tolist()
    segments = [fp_segment(gen, batch, kv_heads, head_dim, fp_lengths, torch.float32)]
    if fmt is not None:
        q_lengths = torch.randint(0, 200, (batch,), generator=gen).tolist()
        q_lengths[0] = 200  # the widest row; others ragged (possibly empty)
        segments.insert(0, quantized_segment(gen, batch, kv_heads, head_dim, q_lengths, fmt))
    query = torch.randn(batch, kv_heads * group, q_len, head_dim, generator=gen)
    scaling = head_dim**-0.5

    out, masses = triton_attention.segmented_attention(query, segments, scaling, split=split)
    ref_out, ref_masses = segmented_attention(query, segments, scaling)

    assert out.shape == (batch, q_len, kv_heads * group, head_dim) and out.dtype == query.dtype
    torch.testing.assert_close(out, ref_out, **OUT_TOL)
    for mass, ref_mass, segment in zip(masses, ref_masses, segments, strict=True):
        assert mass.dtype == torch.float32 and mass.shape == ref_mass.shape
        torch.testing.assert_close(mass, ref_mass, **MASS_TOL)
        for row, length in enumerate(segment.lengths):
            assert bool((mass[row, :, length:] == 0).all())
    # the dense oracle, row by row, over the segments read whole and joined
    for row in range(batch):
        keys, values = dense_row(segments, row)
        dense_out, dense_mass = attention_with_mass(query[row : row + 1], keys, values, scaling)
        torch.testing.assert_close(out[row : row + 1], dense_out, **OUT_TOL)
        lengths = [segment.lengths[row] for segment in segments]
        parts = [m[row : row + 1, :, :n] for m, n in zip(masses, lengths, strict=True)]
        torch.testing.assert_close(torch.cat(parts, -1), dense_mass, **MASS_TOL)


def dense_row(segments: list[Segment], row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's live slots of every segment, read whole (dequantized) and joined: the float32
    keys and values `[1, Hkv, L, D]` the dense oracle sees."""
    parts = [(s.read(0, s.keys.shape[2]), s.lengths[row]) for s in segments]
    keys = torch.cat([k[row : row + 1, :, :n] for (k, _), n in parts], 2)
    values = torch.cat([v[row : row + 1, :, :n] for (_, v), n in parts], 2)
    return keys, values


def test_bfloat16_queries_and_fp_segment():
    gen = torch.Generator().manual_seed(5)
    lengths = [70, 33]
    segments = [
        quantized_segment(gen, 2, 2, 64, [100, 64], "int8"),
        fp_segment(gen, 2, 2, 64, lengths, torch.bfloat16),
    ]
    query = torch.randn(2, 8, 1, 64, generator=gen).to(torch.bfloat16)
    out, masses = triton_attention.segmented_attention(query, segments, 0.125)
    ref_out, ref_masses = segmented_attention(query, segments, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    for mass, ref_mass in zip(masses, ref_masses, strict=True):
        torch.testing.assert_close(mass, ref_mass, **MASS_TOL)


def test_refusals_and_errors():
    gen = torch.Generator().manual_seed(6)
    fp = fp_segment(gen, 1, 2, 16, [20], torch.float32)
    query = torch.randn(1, 4, 17, 16, generator=gen)
    assert "17 queries" in triton_attention.unsupported(query, [fp])
    with pytest.raises(ValueError, match="does not take 17 queries"):
        triton_attention.segmented_attention(query, [fp], 0.25)
    rotated = Segment(fp.keys, fp.values, [20], causal=True, cos=fp.keys[:, 0], sin=fp.keys[:, 1])
    assert "rerotate" in triton_attention.unsupported(query[:, :, :1], [rotated])
    not_causal = Segment(fp.keys, fp.values, [20])
    with pytest.raises(ValueError, match="must be causal"):
        triton_attention.segmented_attention(query[:, :, :1], [not_causal], 0.25)
    with pytest.raises(ValueError, match="multiple of 64"):
        triton_attention.segmented_attention(query[:, :, :1], [fp], 0.25, split=100)
    with pytest.raises(ValueError, match="cannot share"):
        triton_attention.segmented_attention(torch.randn(1, 3, 1, 16), [fp], 0.25)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_groups_is_bit_identical(fmt, dtype):
    gen = torch.Generator().manual_seed(7)
    # channels spanning 8 orders of magnitude (e4m3 subnormals, outliers), 80 of them (not a
    # multiple of the kernel's channel block), an all-zero run, exact ties
    x = torch.randn(3, 96, 80, generator=gen) * torch.logspace(-6, 2, 80)
    x[0, :GROUP, 5] = 0.0
    x[1, :GROUP, 7] = torch.tensor([127.0, 0.5, -2.5, 1.5] * (GROUP // 4))
    x = x.to(dtype)
    reference = {"int8": int8.quantize_groups, "fp8": fp8.quantize_groups}[fmt]
    codes, scales = triton_store_ops.quantize_groups(x, GROUP, QUANT_FORMATS[fmt].dtype)
    ref_codes, ref_scales = reference(x, GROUP)
    assert codes.dtype == ref_codes.dtype and scales.dtype == ref_scales.dtype
    assert torch.equal(codes.view(torch.int8), ref_codes.view(torch.int8))
    assert torch.equal(scales, ref_scales)
    with pytest.raises(ValueError, match="groups of 32"):
        triton_store_ops.quantize_groups(x[:, :40], 32)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        triton_store_ops.quantize_groups(x, GROUP, torch.float16)


def _spy_on_triton(monkeypatch) -> list[int]:
    calls = []
    kernel = triton_attention.segmented_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_attention, "segmented_attention", spy)
    return calls


def test_dispatcher_switch(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    segments = [
        quantized_segment(gen, 3, 2, 64, [80, 0, 45], "int8"),
        fp_segment(gen, 3, 2, 64, [30, 12, 4], torch.float32),
    ]
    query = torch.randn(3, 6, 4, 64, generator=gen)
    calls = _spy_on_triton(monkeypatch)
    results = {}
    for mode in ("torch", "triton", "auto"):
        monkeypatch.setenv("AGENT_KV_KERNELS", mode)
        results[mode] = dispatch.decode_attention(query, segments, 0.125)
    assert len(calls) == 1  # only the forced mode: auto on CPU tensors is the PyTorch path
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **OUT_TOL)
    for mass, ref_mass in zip(results["triton"][1], results["torch"][1], strict=True):
        torch.testing.assert_close(mass, ref_mass, **MASS_TOL)
    # rerotate segments fall back to the PyTorch path even when triton is forced
    monkeypatch.setenv("AGENT_KV_KERNELS", "triton")
    fp = segments[1]
    rotated = Segment(fp.keys, fp.values, fp.lengths, True, cos=fp.keys[:, 0], sin=fp.keys[:, 1])
    dispatch.decode_attention(query, [rotated], 0.125)
    assert len(calls) == 1
    monkeypatch.setenv("AGENT_KV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="AGENT_KV_KERNELS='cuda': use one of auto, triton, torch"):
        dispatch.decode_attention(query, segments, 0.125)


def test_store_attention_decode_branch_uses_the_switch(monkeypatch):
    """A decode step through the registered attention function, on a real store with an
    INT8 segment: forced Triton and PyTorch give the same output and the same scores."""
    gen = torch.Generator().manual_seed(10)
    layer = torch.nn.Module()
    layer.layer_idx = 0
    calls = _spy_on_triton(monkeypatch)
    results = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("AGENT_KV_KERNELS", mode)
        store = KVStore(1, 2, 64, batch=2, int8=Int8Config(fp_window=16, group=GROUP))
        keys = torch.randn(2, 2, 48, 64, generator=torch.Generator().manual_seed(48))
        append_kv(store, keys, keys.flip(-1), range(2))
        store.precision.quantize_stale()
        assert store.q.lengths[0] == [32, 32]
        # the decode step's own token is the call's last, causal segment (committed after)
        call = ForwardCall.open(store, range(2), 1, CallPlan(statistics=(AttentionEma(),)))
        keys = torch.randn(2, 2, 1, 64, generator=torch.Generator().manual_seed(1))
        query = torch.randn(2, 8, 1, 64, generator=gen.manual_seed(11))
        out, _ = store_attention(layer, query, keys, keys.flip(-1), None, kv_call=call)
        call.close()
        scores = torch.stack([store.live_meta("scores", 0, row) for row in range(2)])
        results[mode] = out, scores
    assert len(calls) == 1
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **OUT_TOL)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], **MASS_TOL)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_store_writes_through_the_switch_are_bit_identical(monkeypatch, fmt):
    """Quantize-on-append inside `KVStore` under forced Triton and PyTorch, with compactions
    after it: every buffer ends bit-identical."""
    stores = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("AGENT_KV_KERNELS", mode)
        store = KVStore(1, 2, 64, batch=2)
        keys = torch.randn(2, 2, 96, 64, generator=torch.Generator().manual_seed(12))
        append_kv(store, keys, keys * 0.5, range(2))
        store.precision.quantize_slots(0, 1, torch.arange(8, 40), GROUP, fmt)
        store.compact(0, torch.tensor([0, 3, 5, 20, 40, 41, 90, 95]), row=1)
        store.compact(0, torch.arange(0, 96, 3), row=0)
        stores[mode] = store
    buffers = {
        "keys": ("fp", "keys"), "values": ("fp", "values"),
        "q_keys": ("q", "keys"), "q_values": ("q", "values"),
        "key_scales": ("scales", "keys"), "value_scales": ("scales", "values"),
    }  # fmt: skip
    for name, (table, field) in buffers.items():
        triton_buffer, torch_buffer = (
            getattr(stores["triton"], table)[field],
            getattr(stores["torch"], table)[field],
        )
        assert torch.equal(triton_buffer.view(torch.uint8), torch_buffer.view(torch.uint8)), name
    assert stores["triton"].q.lengths[0] == stores["torch"].q.lengths[0] == [0, 4]

"""Weights read straight from GGUF files: the tensor index, the 4-bit blocks read exactly, the
packed linear layers' two paths, and a bundled model loaded in every format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models.model_loading import load_model
from kernels.gguf_blocks import Int4Groups, dequantize, int4_groups
from kernels.gguf_file import read_tensors
from kernels.quantized_linear import (
    PACKED_ROWS,
    Int4Linear,
    Int8Embedding,
    int8_rows,
)
from tests.conftest import torch_seed


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_4bit_blocks_read_exactly(kind):
    weights = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    raw = gguf_quantize(weights, GGMLQuantizationType[kind])
    groups = int4_groups(raw, kind, (64, 256))
    reference = gguf_dequantize(raw, GGMLQuantizationType[kind])
    assert torch.equal(groups.dequantize(), torch.from_numpy(reference))
    assert int(groups.codes.max()) == 15 and int(groups.codes.min()) == 0


def test_q4_k_of_the_default_model_read_exactly():
    tensors = read_tensors(bundled_models.resolve(bundled_models.DEFAULT_MODEL))
    q4_k = [t for t in tensors.values() if t.kind == "Q4_K"]
    assert len(q4_k) == 12  # half the layers' ffn_down (Q4_K_M)
    tensor = q4_k[0]
    groups = int4_groups(tensor.raw, tensor.kind, tensor.shape)
    assert torch.equal(groups.dequantize(), dequantize(tensor.raw, tensor.kind, tensor.shape))


def test_tensor_index_of_smollm():
    tensors = read_tensors(bundled_models.resolve("smollm2-135m"))
    assert len(tensors) == 272
    embedding = tensors["token_embd.weight"]
    assert (embedding.kind, embedding.shape) == ("Q8_0", (49152, 576))
    assert tensors["blk.0.attn_q.weight"].kind == "Q4_1"
    norm = dequantize(
        *[getattr(tensors["output_norm.weight"], a) for a in ("raw", "kind", "shape")]
    )
    assert norm.shape == (576,) and float(norm.abs().sum()) > 0


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_tensors(path)


def _groups(n: int, k: int) -> Int4Groups:
    with torch_seed(1):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = torch.rand(n, k // 32) / 50 + 1e-3
        offset = -8 * scale + torch.randn(n, k // 32) / 500
    return Int4Groups(codes, scale, offset)


def test_int4_linear_packed_and_dequantized_paths_agree():
    groups = _groups(128, 256)
    layer = Int4Linear(groups, bias=torch.arange(128.0))
    # The layer's weight is the groups' with scale and zero rounded to bf16.
    exact = groups.dequantize()
    assert float((layer.dequantized(torch.float32) - exact).abs().max()) < 2**-8 * float(
        exact.abs().max()
    )
    with torch_seed(2):
        x = torch.randn(2, PACKED_ROWS + 8, 256)
    reference = x @ exact.T + torch.arange(128.0)
    decode = layer(x[:, :3])  # 6 rows: the packed product
    prefill = layer(x)  # 80 rows: de-quantized
    for out, ref in ((decode, reference[:, :3]), (prefill, reference)):
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert 0 < float((out - ref).norm() / ref.norm()) < 1e-2


def test_int4_linear_refuses_rows_off_the_pack_blocks():
    with pytest.raises(ValueError, match="rows in multiples of"):
        Int4Linear(_groups(40, 64), None)


def test_int8_rows_in_chunks_equal_one_pass():
    with torch_seed(4):
        weight = torch.randn(100, 48)
    codes, scale = int8_rows(weight, chunk_rows=7)
    whole, whole_scale = int8_rows(weight, chunk_rows=1000)
    assert torch.equal(codes, whole) and torch.equal(scale, whole_scale)
    assert float((codes.float() * scale[:, None] - weight).abs().max()) <= float(scale.max()) / 2
    table = Int8Embedding(weight)
    ids = torch.tensor([[3, 99], [0, 3]])
    assert torch.allclose(table(ids), weight[ids], atol=float(scale.max()) / 2 + 1e-7)


@pytest.fixture(scope="module")
def smollm_fp32_gguf():
    return load_model("smollm2-135m", weights="fp32")


def test_gguf_format_holds_the_file_blocks_and_follows_fp32(smollm_fp32_gguf):
    loaded = load_model("smollm2-135m", weights="gguf")
    model = loaded.model
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("Int4Linear") == 30 * 7  # every layer's Q4_1 products
    assert kinds.count("Int8Linear") == 1  # the output layer, tied to the Q8_0 embedding
    assert isinstance(model.get_input_embeddings(), Int8Embedding)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    ids = loaded.tokenizer("The licence grants every user the right to copy", return_tensors="pt")
    for each in (model, smollm_fp32_gguf.model):
        each.set_attn_implementation("sdpa")  # a plain forward, without the KV store
    with torch.no_grad():
        mine = model(ids.input_ids).logits[0]
        reference = smollm_fp32_gguf.model(ids.input_ids).logits[0]
    assert 0 < float((mine - reference).norm() / reference.norm()) < 0.1
    agree = (mine.argmax(-1) == reference.argmax(-1)).float().mean()
    assert float(agree) >= 0.8
    assert loaded.source.suffix == ".gguf" and loaded.weights == "gguf"
    smollm_fp32_gguf.model.set_attn_implementation("agent_kv")


def _one_tensor_gguf(path, kind: GGMLQuantizationType) -> None:
    """A GGUF file holding one 32x64 tensor `blk.0.ffn_up.weight` of type `kind`."""
    from gguf import GGUFWriter

    weights = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    writer = GGUFWriter(str(path), "llama")
    raw = gguf_quantize(weights, kind)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unknown_tensor_type_is_refused_with_its_tensor(tmp_path):
    path = tmp_path / "odd.gguf"
    _one_tensor_gguf(path, GGMLQuantizationType.Q8_0)
    tensor = read_tensors(path)["blk.0.ffn_up.weight"]
    assert (tensor.kind, tensor.shape) == ("Q8_0", (32, 64))
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # past the dimension count and both dims
    data[at : at + 4] = (999).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tensor blk.0.ffn_up.weight has an unknown type 999"):
        read_tensors(path)


def test_a_type_the_gguf_package_cannot_read_is_named():
    raw = np.zeros(292, dtype=np.uint8)  # one Q8_K block of 256 weights
    with pytest.raises(ValueError, match="the gguf package cannot read Q8_K tensors"):
        dequantize(raw, "Q8_K", (1, 256))

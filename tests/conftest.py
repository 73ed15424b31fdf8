"""Shared fixtures: SmolLM2-135M is loaded once per test session; a live server on it serves
each module that asks. Where a tokenizer's special tokens or chat template matter (tools,
templates), `qwen_tokenizer` and `tiny_qwen` stand for the default model: its real tokenizer
and template, behind a tiny random-weight model.

`TRITON_INTERPRET=1` is set here, before anything imports `triton.language` (transformers'
modeling code does): Triton reads it when a `@triton.jit` function is defined, and the kernel
tests (`test_triton_kernels.py`) run the kernels in Triton's interpreter on CPU tensors.
Everything else is unaffected: on CPU tensors the dispatcher's default picks PyTorch.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from agent_kv.runtime.models.model_loading import LoadedModel, load_model  # noqa: E402


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct (`smollm2-135m`, fp32, CPU), attention through the KV
    store: named, not the default model, so the suite stays on the small model."""
    return load_model("smollm2-135m", weights="fp32")


@pytest.fixture(scope="session")
def smollm_directory():
    """SmolLM2's weights de-quantized into a Hugging Face directory, written once into the
    cache (`model_loading.transformers_directory`): transformers' own path, the reference the
    engine is checked against."""
    from agent_kv.runtime.models.model_loading import transformers_directory

    return transformers_directory("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama(smollm):
    """A 2-layer Llama with random weights (seed 0), SmolLM2's vocabulary, special tokens and
    8192-token context, attention through the KV store: behind SmolLM2's tokenizer it serves
    the same API as SmolLM2 at a fraction of its compute (the shape of requests and replies,
    not what the model writes). Its replies run to `max_tokens`."""
    import transformers

    return _tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, smollm.model.config)


@pytest.fixture(scope="session")
def brief_tiny_llama(smollm):
    """`tiny_llama`'s network with an output layer that ends strings, numbers and turns early
    (`_ending_bias`), as `tiny_qwen` does: for tool calls and structured output behind
    SmolLM2's tokenizer."""
    import transformers

    model = _tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, smollm.model.config)
    return _ending_bias(model, smollm.tokenizer)


def _tiny(config_class, model_class, cfg):
    """A 2-layer model of `model_class` with random weights (seed 0) and the vocabulary,
    special tokens and context of the config `cfg`, attention through the KV store."""
    from agent_kv.kv.attention import register_attention

    register_attention()
    config = config_class(
        vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id, attn_implementation="agent_kv",
    )  # fmt: skip
    with torch_seed(0):
        return model_class(config).eval()


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The real default model (Qwen2.5-Coder-0.5B, ~4 GB), loaded once: for `slow` tests."""
    return load_model()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The default model's (Qwen2.5-Coder-0.5B's) tokenizer and chat template, loaded without
    its weights: `<tool_call>` and `</tool_call>` are single added tokens in it."""
    from agent_kv.runtime.models.model_loading import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen(qwen_tokenizer):
    """A 2-layer Qwen2 with random weights (seed 0) on the default model's vocabulary, special
    tokens and context, attention through the KV store: behind `qwen_tokenizer` it serves
    requests in the default model's tokens and template at a fraction of its compute (the
    shape of requests and replies, not what the model writes). Its output layer ends strings,
    numbers and turns early (`_ending_bias`)."""
    import transformers

    from agent_kv.runtime.models.model_loading import model_config

    model = _tiny(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, model_config())
    return _ending_bias(model, qwen_tokenizer)


def _ending_bias(model, tokenizer):
    """`model` (a `_tiny` one) with an output layer tied to its embeddings and a bias toward
    the tokens of `tokenizer` that end a JSON string (`"`, +15), a number (`}` and `,`, +12)
    and a turn (`<|im_end|>`, +20): sampled or greedy, its replies and call arguments end
    within a few tokens, as a trained model's do (without it, a string under a grammar runs to
    `max_tokens`)."""
    import torch

    config = model.config
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids('"')] = 15.0
        head.bias[tokenizer.convert_tokens_to_ids(["}", ","])] = 12.0
        head.bias[tokenizer.convert_tokens_to_ids("<|im_end|>")] = 20.0
    model.lm_head = head
    return model


@contextlib.contextmanager
def torch_seed(seed: int) -> Iterator[None]:
    """Run the block under torch's global RNG seeded with `seed`, then restore its state."""
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free 127.0.0.1 port in a thread; yields its root
    URL and stops it on exit."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def live_service(smollm):
    """`(root URL, ChatService)` of a uvicorn on 127.0.0.1 serving SmolLM2-135M as
    "smollm2-135m" (conf-kv, budget 256), running in a thread for the module. The server's
    modules are imported here, so that a broken API fails only the tests that use it."""
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.serving.chat_service import ChatService
    from api.app import create_app

    engine = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256))
    service = ChatService(engine)
    with serving(create_app(service, "smollm2-135m")) as url:
        yield url, service


@pytest.fixture(scope="module")
def live_server(live_service) -> str:
    """The root URL of `live_service`."""
    return live_service[0]


def pytest_collection_modifyitems(items):
    """Tests on a live server (a `live_...` fixture) keep their sockets in a run that disables them
    (`--disable-socket` of pytest-socket, which langchain-tests installs). A module's
    `CASE_MARKS`, `{test name with its parameters: mark}`, marks single cases of an inherited
    parametrized test, which its class may not override (langchain-tests forbids it)."""
    for item in items:
        if any(name.startswith("live_") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.enable_socket)
        module = getattr(item, "module", None)
        if (mark := getattr(module, "CASE_MARKS", {}).get(item.name)) is not None:
            item.add_marker(mark)

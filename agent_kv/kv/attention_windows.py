"""Which decoder layers of a transformers model attend through a sliding window, and how wide.

transformers (5.x) says it two ways, and its attention modules pass the result to the
attention function as the `sliding_window` keyword (`agent_kv.kv.attention` checks that the
two agree):
- `config.layer_types`, one entry per layer, `"sliding_attention"` (window
  `config.sliding_window`) or `"full_attention"`: Gemma-2 (alternating, from layer 0),
  Gemma-3 (5 sliding to 1 full), gpt-oss (alternating), Qwen2/Qwen3 (`use_sliding_window`,
  from `max_window_layers` on), Cohere2;
- no `layer_types` and a `config.sliding_window`: every layer (Mistral, Phi-3).
The window follows transformers' masks (`masking_utils.sliding_window_overlay`): a query at
position `p` sees the keys at positions `p - window < k <= p`, `window` keys including its own.
"""

from __future__ import annotations

from agent_kv.errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"


def attention_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding window in tokens, or None for a full-attention layer.

    Args:
        config: a transformers model config (`num_hidden_layers`, and `layer_types` and
            `sliding_window` when the family has them).

    Raises:
        ConfigError: a layer type other than full or sliding attention (chunked attention,
            linear attention...), a window that is not a positive whole number, or
            bidirectional attention (Gemma-3's `use_bidirectional_attention`, an encoder
            setting): agent_kv runs causal full- and sliding-window layers only.
    """
    family = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(
            f"{family}: use_bidirectional_attention is set; agent_kv serves causal decoders "
            "only: load the model with use_bidirectional_attention=False"
        )
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [FULL if window is None else SLIDING] * layers
    unknown = sorted(set(types[:layers]) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(
            f"{family}: layer types {', '.join(unknown)} are not implemented by agent_kv's "
            f"attention (it runs {FULL} and {SLIDING} layers); use another backend for "
            "this model"
        )
    if SLIDING in types[:layers] and window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(
                f"{family}: sliding_window must be a positive number of tokens, got {window!r}"
            )
    return tuple(window if kind == SLIDING else None for kind in types[:layers])

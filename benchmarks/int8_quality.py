"""INT8 storage quality: dequantization error of a real cache, and the perplexity it costs.

Text: the licence texts every Debian system ships in /usr/share/common-licenses (GPL, LGPL,
GFDL, MPL, Apache), concatenated; `--text FILE` for another.

Part 1, error: the keys and values of a full-precision cache over the text, per layer,
quantized as the store does (`kernels.int8`: groups of 32 tokens, one float16 scale per KV
head and channel) and dequantized; mean and max absolute error, and the mean error relative
to the mean absolute value.

Part 2, perplexity: teacher-forced over the first N tokens (`Engine.score`, 16 tokens per
call), each policy once with every token in the model's dtype and once with INT8 mixed
precision. `full` keeps every token, so its INT8 row quantizes all but the newest W: the
pure storage cost. `window` keeps the same tokens in both precisions.

    .venv/bin/python benchmarks/int8_quality.py --tokens 2048 4096
"""

from __future__ import annotations

import argparse
import math

from agent_kv.evals.texts import licence_text
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from kernels.int8 import dequantize, quantize_groups


def error_table(engine_full: Engine, ids: list[int], group: int) -> None:
    session = engine_full.new_sequence()
    engine_full.score(session, ids)
    print(f"\nDequantization error over {len(ids)} tokens, groups of {group} (per layer, then all)")
    print(
        f"{'layer':>6} {'K mean':>8} {'K max':>8} {'K rel':>7} "
        f"{'V mean':>8} {'V max':>8} {'V rel':>7}"
    )
    totals = {"K": [0.0, 0.0, 0.0], "V": [0.0, 0.0, 0.0]}  # sum |err|, max |err|, sum |x|
    count = 0
    store = session.store
    for idx in range(store.num_layers):
        n = store.fp.lengths[idx][0] // group * group
        row = []
        for label, tensor in (("K", store.fp["keys"][idx]), ("V", store.fp["values"][idx])):
            x = tensor[0, :, :n].float()  # [H, n, D]
            q, scales = quantize_groups(x, group)
            err = (dequantize(q, scales.repeat_interleave(group, dim=1)) - x).abs()
            row += [err.mean().item(), err.max().item(), (err.mean() / x.abs().mean()).item()]
            totals[label][0] += err.sum().item()
            totals[label][1] = max(totals[label][1], err.max().item())
            totals[label][2] += x.abs().sum().item()
        count += x.numel()
        if idx % 5 == 0 or idx == store.num_layers - 1:
            print(_error_row(idx, row))
    summary = []
    for label in ("K", "V"):
        total_err, max_err, total_abs = totals[label]
        summary += [total_err / count, max_err, total_err / total_abs]
    print(_error_row("all", summary))


def _error_row(label, values: list[float]) -> str:
    """mean, max, relative for K then V."""
    cells = [f"{v:>7.2%}" if i % 3 == 2 else f"{v:>8.4f}" for i, v in enumerate(values)]
    return f"{label:>6} " + " ".join(cells)


def perplexity(engine: Engine, ids: list[int]) -> tuple[float, str]:
    """Perplexity of `ids` from an empty cache, and the peak KV as `allocated/live` MB."""
    session = engine.new_sequence()
    log_probs = engine.score(session, ids)
    store = session.store
    peak = f"{store.figures.peak_allocated_bytes / 1e6:.1f}/{store.figures.peak_bytes / 1e6:.1f}"
    return math.exp(-log_probs.mean().item()), peak


def perplexity_table(loaded, ids_by_length: dict[int, list[int]], args) -> None:
    int8 = Int8Config(fp_window=args.fp_window, group=args.group)
    print(
        f"\nPerplexity, FP vs INT8 (W={args.fp_window}, group {args.group}); "
        "peak KV in MB allocated/live"
    )
    print(
        f"{'tokens':>7} {'policy':>16} {'FP ppl':>8} {'INT8 ppl':>9} {'delta':>7} "
        f"{'FP MB':>11} {'INT8 MB':>11}"
    )
    for length, ids in ids_by_length.items():
        for name, budget in (("full", None), ("window", args.budget), ("conf-kv", args.budget)):
            params = {} if budget is None else {"budget": budget}
            results = []
            for precision in (None, int8):
                engine = Engine(
                    loaded.model, loaded.tokenizer, make_policy(name, **params), int8=precision
                )
                results.append(perplexity(engine, ids))
            (fp, fp_peak), (q, q_peak) = results
            label = name if budget is None else f"{name} {budget}"
            print(
                f"{length:>7} {label:>16} {fp:>8.3f} {q:>9.3f} {q - fp:>+7.3f} "
                f"{fp_peak:>11} {q_peak:>11}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--fp-window", type=int, default=128)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--text", help="a text file instead of the licence texts")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    loaded = load_model(args.model)
    ids = loaded.tokenizer(licence_text(args.text), add_special_tokens=False)["input_ids"]
    if len(ids) < max(args.tokens):
        parser.error(f"the text has {len(ids)} tokens, fewer than {max(args.tokens)}")
    print(f"model {loaded.name}; text of {len(ids)} tokens")
    full = Engine(loaded.model, loaded.tokenizer, make_policy("full"))
    error_table(full, ids[: min(args.tokens)], args.group)
    perplexity_table(loaded, {n: ids[:n] for n in args.tokens}, args)


if __name__ == "__main__":
    main()

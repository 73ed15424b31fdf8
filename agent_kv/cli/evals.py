"""`agent-kv eval`: the papers' experiments (`agent_kv.evals`) on a model, from the command
line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agent_kv.cli.common import fail, writable_dir
from agent_kv.cli.options import ModelOption, RecallParamOption, ThreadsOption, WeightsOption
from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.kv.policy_names import check_policy_name
from agent_kv.kv.policy_spec import parse_params
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS, check_weight_format


def _eval_policies(text: str, experiments: list[str]) -> list[str]:
    """The policy names of `eval --policies`, checked without torch.

    Raises:
        ConfigError: an empty list, an unknown name, or an experiment without a policy list.
    """
    from agent_kv.evals import POLICY_EXPERIMENTS  # torch: imported by the command, not at start

    others = [name for name in experiments if name not in POLICY_EXPERIMENTS]
    if others:
        raise ConfigError(
            f"--policies applies to {' and '.join(POLICY_EXPERIMENTS)}, not {', '.join(others)}"
        )
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--policies needs at least one policy name")
    for name in names:
        check_policy_name(name)
    return names


def _eval_recall(items: list[str] | None):
    """The cold tier's settings for the `+recall` policies of an experiment (`--recall-param`),
    or None for the defaults.

    Raises:
        ConfigError: a malformed item or an invalid setting.
    """
    if not items:
        return None
    from agent_kv.kv.cold_tier import ColdConfig  # torch: imported by the command, not at start

    return ColdConfig.from_params(parse_params(items, "--recall-param"))


def _needle_lengths(text: str | None, names: list[str]) -> tuple[int, ...] | None:
    """`--lengths` as whole numbers of tokens, or None.

    Raises:
        ConfigError: the option given without needle, or a length that is not a whole
            number >= 64.
    """
    if text is None:
        return None
    if "needle" not in names:
        raise ConfigError("--lengths applies to needle only")
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--lengths takes comma-separated whole numbers, got {text!r}") from None
    if min(lengths) < 64:
        raise ConfigError(f"--lengths must be >= 64 tokens each, got {text!r}")
    return lengths


def eval_command(
    experiment: Annotated[
        str,
        typer.Argument(help="perplexity, ablations, needle, mechanistic, latency, arkv, or all."),
    ],
    out: Annotated[
        Path, typer.Option(help="Results directory; each experiment writes OUT/NAME.")
    ] = Path("runs/eval"),
    quick: Annotated[
        bool, typer.Option(help="The small size: minutes on two CPU cores (what CI runs).")
    ] = False,
    text: Annotated[
        Path | None,
        typer.Option(help="A long text file instead of the Debian licence texts."),
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated policies for needle or arkv instead of their own list (e.g. "
            "kvzip,h2o+recall; arkv keeps full, its reference)."
        ),
    ] = None,
    recall_param: RecallParamOption = None,
    lengths: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated context lengths in tokens for needle instead of its own "
            "(each past the model's context runs with rerotate positions)."
        ),
    ] = None,
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: ThreadsOption = None,
) -> None:
    """Rerun the papers' experiments (docs/methods.md): print each table and write summary.md,
    results.json and plots under --out."""
    # torch: imported by the command, not at start
    from agent_kv.evals import experiment_names, run_experiments
    from agent_kv.evals.texts import licence_text
    from agent_kv.runtime.models.model_loading import load_model

    try:
        thread_setting.choose(threads)
        names = experiment_names(experiment)
        bundled_models.locate(model)
        check_weight_format(weights)
        chosen = None
        if policies is not None:
            chosen = _eval_policies(policies, names)
        recall = _eval_recall(recall_param)
        needle_lengths = _needle_lengths(lengths, names)
        body = licence_text(text)
        writable_dir(out)
    except (ValueError, AgentKVError) as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot read the text {err.filename}: {err.strerror}")
    try:
        loaded = load_model(model, weights)
        text_ids = loaded.tokenizer(body, add_special_tokens=False)["input_ids"]
        reports = run_experiments(
            names, loaded, text_ids, out, quick, policies=chosen, recall=recall,
            lengths=needle_lengths,
        )  # fmt: skip
    except AgentKVError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot write under {out}: {err.strerror or err}")
    for report in reports:
        typer.echo(report.markdown())

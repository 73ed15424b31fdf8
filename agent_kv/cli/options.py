"""The options more than one command takes, as annotated types: each command's signature
names one per option (`policy: PolicyOption = "conf-kv"`), so the option reads the same, with
the same help, wherever it appears."""

from __future__ import annotations

from typing import Annotated

import typer

from agent_kv.kv.policy_names import declared_policies
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting

ModeOption = Annotated[
    str,
    typer.Option(
        help="free (the agent navigates: every step its own action) or scripted "
        "(scripted navigation, free answer: a recall task's reference actions are "
        "replayed into the cache and the model gives only the final stop [answer])."
    ),
]
PolicyOption = Annotated[
    str,
    typer.Option(
        help=f"KV policy: {', '.join(declared_policies())}; NAME+recall adds a cold tier with "
        "recall (see --recall); docs/policies.md describes each."
    ),
]
BudgetOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Unpinned tokens per layer: conf-kv's uncertain budget N_low (the confident "
        "budget N_high is half), the window, the h2o/snapkv/random budget, or ARKV's bytes per "
        "layer counted in full-precision tokens. Default: the policy's own.",
    ),
]
ParamOption = Annotated[
    list[str] | None,
    typer.Option(
        "--param",
        help="A policy parameter as KEY=VALUE, repeatable (e.g. --param quantized=int8 "
        "--param gamma=0.5).",
    ),
]
BudgetBytesOption = Annotated[
    str | None,
    typer.Option(
        help="The budget as KV bytes over all layers (e.g. 38MB), converted to tokens for the "
        "model and precision; instead of --budget."
    ),
]
Int8Option = Annotated[
    bool,
    typer.Option(
        "--int8/--no-int8",
        help="Mixed precision (CONF-KV §4): tokens older than the FP window are stored as INT8.",
    ),
]
FpWindowOption = Annotated[
    int | None,
    typer.Option(
        min=0, help="With --int8: newest unpinned tokens kept at full precision (default 128)."
    ),
]
PositionsOption = Annotated[
    str,
    typer.Option(
        help="original (keys keep their positions) or rerotate (StreamingLLM in-cache "
        "positions, for episodes past the model's context)."
    ),
]
RecallOption = Annotated[
    bool,
    typer.Option(
        "--recall/--no-recall",
        help="Keep evicted tokens in a cold tier (host memory, INT8 pages) and recall the "
        "pages a new message's queries attend back into the cache (also: a policy name ending "
        "in +recall).",
    ),
]
RecallParamOption = Annotated[
    list[str] | None,
    typer.Option(
        "--recall-param",
        help="A cold-tier setting as KEY=VALUE, repeatable: page_tokens (16), pages recalled "
        "per layer (8), queries that score them (32), every N decode tokens (0: off), "
        "cap_bytes (256MiB, e.g. 64MB), fmt (int8 or fp8), score (exact or digest), select "
        "(layer, or vote: the layers choose pages together), distances (original or "
        "in_cache, rerotate mode).",
    ),
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        help=f"A bundled model ({', '.join(bundled_models.MODELS)}; `agent-kv models` lists "
        "them, `agent-kv models install NAME` installs one), a Hugging Face model directory or "
        f"a .gguf file. Default: {bundled_models.DEFAULT_MODEL}.",
    ),
]
WeightsOption = Annotated[
    str,
    typer.Option(
        help="How the model holds its weights: gguf (a GGUF file's 4-bit blocks as packed INT4 "
        "groups, its other tensors INT8 per row), int8 (INT8 per row, weight-only), fp16 "
        "(fbgemm fp16 packs, fp32 math), bf16 (bfloat16 model) or fp32. Read straight from "
        "the GGUF file; a model directory takes all but gguf. The KV cache stays fp32. "
        'docs/models.md, "Weights", has the measurements behind the default.',
    ),
]
MaxStepsOption = Annotated[int, typer.Option(min=1, help="Actions before an episode is cut off.")]
MaxObsTokensOption = Annotated[int, typer.Option(min=64, help="Observation length cap in tokens.")]
PrefillChunkOption = Annotated[int, typer.Option(min=1, help="Tokens per prefill forward call.")]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help=f"Torch CPU threads for the model (default ${thread_setting.ENV}, else "
        f"{thread_setting.DEFAULT}: more threads stall when other processes share the cores).",
    ),
]
CompileOption = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Run each decode step as one graph (torch.compile on CPU: a first compile of "
        "about a minute; a CUDA graph on a GPU); --no-compile runs every step eagerly. "
        "Default: on for serve and on a GPU, off otherwise.",
    ),
]
AgentOption = Annotated[
    str,
    typer.Option(
        help="How the agent writes actions: text (click [12], VisualWebArena's format) or "
        "tools (each browser action a function tool with a JSON schema; one call per step, "
        "the next page coming back as its result)."
    ),
]
ConstrainOption = Annotated[
    bool,
    typer.Option(
        "--constrain/--no-constrain",
        help="Decode each action under the page's action grammar (ids on the page, open tabs), "
        "so every reply parses; --no-constrain decodes freely, to compare.",
    ),
]
PinRepliesOption = Annotated[
    str,
    typer.Option(
        help="Which of the agent's own replies no policy evicts: none, notes (the note a "
        "scripted reply begins with, `note [fact]`) or all (every reply, actions and notes).",
    ),
]
PagePinsOption = Annotated[
    str,
    typer.Option(
        help="How much of the page the agent acts on no policy evicts: whole, or elements (its "
        "tab and URL lines and interactive elements; its text is left to the policy).",
    ),
]
PinExamplesOption = Annotated[
    bool,
    typer.Option(
        "--pin-examples/--no-pin-examples",
        help="Pin the example turns of the prompt for the whole episode (the default); "
        "--no-pin-examples leaves them to the policy like the history.",
    ),
]
ObservationOption = Annotated[
    str,
    typer.Option(
        help="accessibility_tree (the page as text, and a screenshot) or som (set-of-marks: "
        "the interactive elements as text, and a screenshot with numbered boxes on them)."
    ),
]

"""The docs' policy table (docs/policies.md), rendered from the policy classes: one row per
policy of `POLICIES`, in its order, with what the policy keeps (`Policy.summary`, its
`Policy.paper` in parentheses) and its parameters with their defaults (its dataclass fields).

A policy's parameters are its own: the fields every policy shares (`protect_recent`, `sinks`,
`evict_slack`) are listed only where the policy changes their defaults and evicts at all. A
policy derived from another registered policy that has parameters is written as that one's,
`with` the defaults it changes and `plus` the fields it adds (`conf-kv-l`: "`conf-kv`'s, plus
`pyramid` (0.5)").
"""

from __future__ import annotations

import dataclasses

from agent_kv.kv.policies.base import Policy
from agent_kv.kv.policies.registry import POLICIES
from agent_kv.kv.policy_names import is_policy_class

HEADER = ("policy", "keeps", "parameters (defaults)")
"""The table's columns."""


def policy_table() -> str:
    """The markdown table of every policy in `POLICIES`, a header and one line per policy,
    each line ending in a newline."""
    lines = [_row(HEADER), _row(("---",) * len(HEADER))]
    lines += [_row(policy_row(cls)) for cls in POLICIES.values()]
    return "".join(line + "\n" for line in lines)


def policy_row(cls: type[Policy]) -> tuple[str, str, str]:
    """One policy's cells: its name, what it keeps (with its paper, if any) and its
    parameters."""
    paper = vars(cls).get("paper")
    keeps = cls.summary if paper is None else f"{cls.summary} ({paper})"
    return f"`{cls.name}`", keeps, _parameters(cls)


def _parameters(cls: type[Policy]) -> str:
    """The parameters cell (module docstring)."""
    parent = _parent(cls)
    if parent is not None and _own_fields(parent):
        inherited = _defaults(parent)
        changed = [f for f in _own_fields(cls) if f.name in inherited]
        added = [f for f in _own_fields(cls) if f.name not in inherited]
        words = [f"`{parent.name}`'s"]
        words += [f"with {_listed(changed)}"] if changed else []
        words += [f"plus {_listed(added)}"] if added else []
        return ", ".join(words)
    return _listed(_own_fields(cls)) or "none"


def _own_fields(cls: type[Policy]) -> list[dataclasses.Field]:
    """The fields the table lists for `cls`: those of its own kind first, then the shared
    ones whose defaults it changes (none for a policy that evicts nothing); for a policy
    derived from another, only those it adds or whose defaults differ from its parent's."""
    parent = _parent(cls)
    shared = _defaults(Policy)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    own = [f for f in fields if f.name not in shared]
    if cls.evicts:
        own += [f for f in fields if f.name in shared and f.default != shared[f.name]]
    if parent is None:
        return own
    inherited = _defaults(parent)
    return [f for f in own if inherited.get(f.name, dataclasses.MISSING) != f.default]


def _parent(cls: type[Policy]) -> type[Policy] | None:
    """The nearest registered policy `cls` derives from, if any."""
    return next((base for base in cls.__mro__[1:] if is_policy_class(base)), None)


def _defaults(cls: type) -> dict[str, object]:
    """Each init field of the dataclass `cls` and its default (`MISSING` for none)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.init}


def _listed(fields: list[dataclasses.Field]) -> str:
    """ "`tau` (0.6), `quantized` (`fp8`)": each field with its default."""
    return ", ".join(f"`{f.name}`{_shown_default(f.default)}" for f in fields)


def _shown_default(value: object) -> str:
    """` (512)`, ` (`fp8`)` for text, nothing for a field without a default."""
    if value is dataclasses.MISSING:
        return ""
    return f" (`{value}`)" if isinstance(value, str) else f" ({value})"


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cells) + " |"

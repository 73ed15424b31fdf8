"""The KV policies' names and the suffixes a name may carry, without importing the policies
(they import torch: 0.8 s in a fresh process, against 0.05 s for the whole command line), so
the command line refuses an unknown name before anything heavy loads.

The names are read from the source of the modules in `agent_kv/kv/policies/`
(`declared_policies`): the classes that set `name` in their own body, with their `order` and
`evicts` inherited as Python inherits them. These are the classes, and the rule, by
which importing the package fills its registry (`agent_kv.kv.policies.registry`), so nothing
lists the policies by hand; a policy's `name`, `order` and `evicts` are literals in its
class body, and a test checks that both ways find the same policies in the same order.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pkgutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from agent_kv.errors import ConfigError

POLICY_PACKAGE = "agent_kv.kv.policies"
"""The package whose modules define the policies."""
DECLARED_ATTRIBUTES = ("name", "order", "evicts")
"""The class attributes `read_policies` takes from the source, literals each."""
RECALL_SUFFIX = "+recall"
"""A policy name ending in it runs that policy with a cold tier and query-aware recall
(`agent_kv.kv.policies.cold_recall`), e.g. `h2o+recall`."""
REENCODE_SUFFIX = "+reencode"
"""A policy name ending in it runs that policy on an engine that encodes the tokens the cache
keeps again, without the evicted history, before a new message once the cache has evicted as
many tokens as it holds since the last time (`agent_kv.runtime.engine.engine.Engine.reencode`), e.g.
`window+reencode`."""


def is_policy_class(cls: type) -> bool:
    """Whether the class `cls` is a policy of its own: it sets `name` to a str in its own body
    (a class that only inherits a name, or has none, such as a shared base, is not one)."""
    return isinstance(vars(cls).get("name"), str)


@functools.cache
def declared_policies() -> dict[str, bool]:
    """Each policy's name and whether it evicts (`Policy.evicts`), in the order
    of `agent_kv.kv.policies.POLICIES`, read from the package's modules without importing them
    (`read_policies`; about 20 ms, once per process)."""
    spec = importlib.util.find_spec(POLICY_PACKAGE)  # imports agent_kv.kv, not the policies
    return read_policies(spec.submodule_search_locations)


def read_policies(directories: Iterable[str]) -> dict[str, bool]:
    """The policies the modules in `directories` define, by name, each mapped to whether it
    evicts (`Policy.evicts`), in listing order (`order`, then name), read from their source.

    Each class is rebuilt as a stand-in of its own name with the literal values its body
    assigns to `DECLARED_ATTRIBUTES` and, as bases, the stand-ins of its bases defined in
    these modules (found through the modules' `from ... import` of each other); a base from
    elsewhere (`ABC`) is left out. Python's own inheritance then answers each attribute, as it
    does for the real classes.

    Raises:
        SyntaxError: a module that does not parse.
    """
    trees = {
        info.name: ast.parse((Path(info.module_finder.path) / f"{info.name}.py").read_bytes())
        for info in pkgutil.iter_modules(list(directories))
        if not info.ispkg
    }
    classes = {
        (module, node.name): node
        for module, tree in trees.items()
        for node in tree.body
        if isinstance(node, ast.ClassDef)
    }
    local = {module: _local_names(module, tree) for module, tree in trees.items()}
    built: dict[tuple[str, str], type] = {}

    def resolve(module: str, name: str) -> tuple[str, str] | None:
        """The class a name of `module` stands for, following re-exports; None if none."""
        target = local[module].get(name)
        for _ in range(len(trees)):
            if target is None or target in classes:
                return target
            target = local.get(target[0], {}).get(target[1])
        return None

    def build(key: tuple[str, str]) -> type:
        if key not in built:
            module, node = key[0], classes[key]
            bases = [resolve(module, base.id) for base in node.bases if isinstance(base, ast.Name)]
            parents = tuple(build(base) for base in bases if base is not None)
            built[key] = type(node.name, parents, _declared_values(node))
        return built[key]

    policies = [cls for cls in map(build, classes) if is_policy_class(cls)]
    policies.sort(key=lambda cls: (cls.order, cls.name))
    return {cls.name: cls.evicts for cls in policies}


def _local_names(module: str, tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Each name a module binds to a class of the package: `(module, class name)` for those
    it defines and those it imports from a sibling module."""
    names = {node.name: (module, node.name) for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        if node.level == 1:
            source = node.module
        elif node.level == 0 and node.module.startswith(POLICY_PACKAGE + "."):
            source = node.module.removeprefix(POLICY_PACKAGE + ".")
        else:
            continue
        names |= {alias.asname or alias.name: (source, alias.name) for alias in node.names}
    return names


def _declared_values(node: ast.ClassDef) -> dict:
    """The literal values a class body assigns to `DECLARED_ATTRIBUTES`."""
    values = {}
    for statement in node.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        if (
            isinstance(target, ast.Name)
            and target.id in DECLARED_ATTRIBUTES
            and isinstance(value, ast.Constant)
        ):
            values[target.id] = value.value
    return values


def split_recall(name: str) -> tuple[str, bool]:
    """`("h2o", True)` for `"h2o+recall"`, `("h2o", False)` for `"h2o"` (a
    `REENCODE_SUFFIX` is split off first: `split_reencode`)."""
    if name.endswith(RECALL_SUFFIX):
        return name[: -len(RECALL_SUFFIX)], True
    return name, False


def split_reencode(name: str) -> tuple[str, bool]:
    """`("window", True)` for `"window+reencode"`, `("window", False)` for `"window"`."""
    if name.endswith(REENCODE_SUFFIX):
        return name[: -len(REENCODE_SUFFIX)], True
    return name, False


def base_policy(name: str) -> str:
    """The policy's own name without its suffixes: `"h2o"` for `"h2o+recall"`, `"window"` for
    `"window+reencode"`."""
    return split_recall(split_reencode(name)[0])[0]


def check_policy_name(name: str, policies: Mapping[str, bool] | None = None) -> None:
    """Raise ConfigError (naming the choices) unless `name` is a policy's name, with or without
    `RECALL_SUFFIX` or `REENCODE_SUFFIX` (not both: re-encoding starts a fresh cache, which
    holds no cold tier; neither for a policy that takes no budget: it evicts nothing).

    Args:
        name: the name as given.
        policies: each policy's name and whether it evicts, in listing order; default
            `declared_policies()` (read without importing the policies).
    """
    policies = declared_policies() if policies is None else policies
    unsuffixed, reencode = split_reencode(name)
    base, recall = split_recall(unsuffixed)
    if base not in policies:
        raise ConfigError(
            f"unknown policy {name!r}: choose one of {', '.join(policies)} (add "
            f"{RECALL_SUFFIX} to keep evicted tokens in a cold tier and recall them, or "
            f"{REENCODE_SUFFIX} to encode the kept tokens again without the evicted history)"
        )
    if recall and not policies[base]:
        raise ConfigError(f"policy {base!r} evicts nothing: there is nothing to recall")
    if reencode and not policies[base]:
        raise ConfigError(f"policy {base!r} evicts nothing: there is nothing to re-encode")
    if reencode and recall:
        raise ConfigError(
            f"{name!r}: re-encoding starts a fresh cache without the cold tier that recall "
            "reads; choose one of the two"
        )

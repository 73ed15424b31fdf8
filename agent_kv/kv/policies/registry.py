"""The policies by name: a subclass of `Policy` that sets its own `name` registers itself here
as it is defined (`Policy.__init_subclass__`), and the package imports every module in
`agent_kv/kv/policies/` (`agent_kv.kv.policies.discover`), so a new policy is one module and
nothing lists the policies by hand. Everything that names them derives from this registry:
`make_policy`, the docs' table (`agent_kv.kv.policies.table`), the API's policy names; the
command line's early check reads the same classes from their source without importing them
(`agent_kv.kv.policy_names`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class PolicyRegistry(Mapping[str, type]):
    """The registered policy classes (subclasses of `agent_kv.kv.policies.base.Policy`, which
    imports this module to register them) by name, in listing order: by each class's `order`,
    then by name (the order of `POLICIES`, the docs' table and every listing of names)."""

    def __init__(self) -> None:
        self._classes: dict[str, type] = {}

    def add(self, cls: type) -> None:
        """Register `cls` under `cls.name`; a class defined again in the same module under the
        same qualified name (a reloaded module) replaces its earlier self.

        Raises:
            TypeError: another class holds the name, or `cls` sets no `summary` of its own
                (the docs' row of every policy says what it keeps).
        """
        held = self._classes.get(cls.name)
        if held is not None and _origin(held) != _origin(cls):
            raise TypeError(f"policy name {cls.name!r} is taken by {_origin(held)}")
        if not isinstance(vars(cls).get("summary"), str):
            raise TypeError(f"policy {cls.name!r} ({_origin(cls)}) sets no summary of its own")
        self._classes[cls.name] = cls

    def __getitem__(self, name: str) -> type:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        ordered = sorted(self._classes.values(), key=lambda cls: (cls.order, cls.name))
        return iter([cls.name for cls in ordered])

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        return f"PolicyRegistry({', '.join(self)})"


def _origin(cls: type) -> str:
    """`module.QualifiedName` of a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


POLICIES = PolicyRegistry()
"""Every policy class by name (`agent_kv.kv.policies` imports every module first)."""

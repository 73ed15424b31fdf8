"""Text observations: the accessibility tree as VisualWebArena renders it, one node a line.

    Tab 0 (current): Blue road bike | Classifieds
    URL: http://127.0.0.1:41234/listing/1
    [7] RootWebArea 'Blue road bike | Classifieds' focused: True
    \t[15] link 'Classifieds'
    \t[3] textbox 'Search' required: False
    ...

The tree comes from CDP `Accessibility.getFullAXTree`; element ids are the nodes'
`backendDOMNodeId`s, which the browser env uses to act on them. Pruning follows
VisualWebArena's `TextObervationProcessor`: ignored nodes and nodes without a name or role are
dropped (their children move up a level), unnamed structural nodes without properties are
dropped, and a StaticText line whose text already appears in one of the three lines before it is
dropped (here only when that line is not itself StaticText, so two list items with the same
text both stay). On top of that: InlineTextBox and ListMarker nodes and unnamed
main/form/article/region/status nodes are dropped, and properties that repeat the URL, point at
other nodes or describe live regions are left out.
The whole page is rendered, not only the viewport (the bundled sites keep pages short).
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

IGNORED_PROPERTIES = frozenset(
    {
        "focusable",
        "editable",
        "readonly",
        "level",
        "settable",
        "multiline",
        "invalid",
        "url",
        "labelledby",
        "describedby",
        "controls",
        "owns",
        "flowto",
        "activedescendant",
        "details",
        "errormessage",
        "live",
        "atomic",
        "relevant",
        "busy",
    }
)
"""AX properties never rendered (VisualWebArena's list plus URL, node-reference and live-region
ones)."""

UNNAMED_PRUNED_ROLES = frozenset(
    {
        "generic",
        "img",
        "list",
        "strong",
        "paragraph",
        "banner",
        "navigation",
        "Section",
        "LabelText",
        "Legend",
        "listitem",
        "main",
        "form",
        "article",
        "region",
        "contentinfo",
        "group",
        "status",
        "none",
    }
)
"""Roles dropped when the node has neither a name nor rendered properties."""

ALWAYS_PRUNED_ROLES = frozenset({"InlineTextBox", "ListMarker"})
_STATIC_TEXT = re.compile(r"\[\d+\] StaticText (.+)", re.DOTALL)


@dataclass(frozen=True)
class AXElement:
    """One rendered node: `id` is the number shown in brackets, the node's CDP backendDOMNodeId."""

    id: int
    role: str
    name: str


@dataclass(frozen=True)
class AXTree:
    """A rendered accessibility tree.

    Attributes:
        text: the tree, one node a line, children indented by one tab per level.
        elements: id -> element for every rendered line (ids are unique).
    """

    text: str
    elements: dict[int, AXElement]

    def find(self, role: str, name: str) -> AXElement | None:
        """The first element (in reading order) with exactly this role and name, or None."""
        for element in self.elements.values():
            if element.role == role and element.name == name:
                return element
        return None


def _property_text(prop: dict[str, Any]) -> str | None:
    """`name: value` for one AX property, or None when it is ignored or has no plain value."""
    if prop.get("name") in IGNORED_PROPERTIES:
        return None
    value = prop.get("value", {})
    if "value" not in value or value["value"] is None:
        return None
    return f"{prop['name']}: {value['value']}"


def render_ax_tree(nodes: Sequence[dict[str, Any]]) -> AXTree:
    """Render CDP `Accessibility.getFullAXTree` nodes (root first) as VisualWebArena text.

    Returns an empty tree for an empty node list.
    """
    if not nodes:
        return AXTree(text="", elements={})
    by_id = {node["nodeId"]: node for node in nodes}
    lines: list[str] = []
    elements: dict[int, AXElement] = {}
    # Depth-first, children in order; each stack entry is (AX node id, depth).
    stack: list[tuple[str, int]] = [(nodes[0]["nodeId"], 0)]
    while stack:
        node_id, depth = stack.pop()
        node = by_id[node_id]
        element = _element_line(node)
        if element is not None:
            backend_id, role, name, line = element
            if backend_id not in elements:
                lines.append("\t" * depth + line)
                elements[backend_id] = AXElement(backend_id, role, name)
        child_depth = depth + 1 if element is not None else depth
        children = [child for child in node.get("childIds", []) if child in by_id]
        stack.extend((child, child_depth) for child in reversed(children))
    kept = _drop_repeated_static_text(lines)
    kept_ids = {int(line.strip()[1:].split("]", 1)[0]) for line in kept}
    return AXTree(
        text="\n".join(kept),
        elements={i: e for i, e in elements.items() if i in kept_ids},
    )


def _element_line(node: dict[str, Any]) -> tuple[int, str, str, str] | None:
    """(backend id, role, name, line) when `node` is rendered, else None."""
    if node.get("ignored") or "name" not in node or "role" not in node:
        return None
    backend_id = node.get("backendDOMNodeId")
    role = node["role"].get("value", "")
    name = node["name"].get("value", "")
    if backend_id is None or not role or role in ALWAYS_PRUNED_ROLES:
        return None
    properties = [text for prop in node.get("properties", []) if (text := _property_text(prop))]
    if not name.strip() and not properties and role in UNNAMED_PRUNED_ROLES:
        return None
    if not name.strip() and role == "listitem":
        return None
    line = f"[{backend_id}] {role} {name!r}"
    if properties:
        line += " " + " ".join(properties)
    return backend_id, role, name, line


def _drop_repeated_static_text(lines: list[str]) -> list[str]:
    """VisualWebArena's clean-up: drop StaticText already shown in the previous three lines
    (here: in one of those that is not itself StaticText, so equal texts of two list items
    both stay)."""
    kept: list[str] = []
    for line in lines:
        match = _STATIC_TEXT.search(line)
        if match:
            text = match.group(1)[1:-1]
            earlier = [prev for prev in kept[-3:] if not _STATIC_TEXT.search(prev)]
            if not text or any(text in previous for previous in earlier):
                continue
        kept.append(line)
    return kept


def tab_line(titles: Sequence[str], current: int) -> str:
    """VisualWebArena's tab list: 'Tab 0 (current): Home | Tab 1: Search'."""
    return " | ".join(
        f"Tab {i} (current): {title}" if i == current else f"Tab {i}: {title}"
        for i, title in enumerate(titles)
    )


def observation_text(titles: Sequence[str], current: int, url: str, tree: AXTree) -> str:
    """The full text observation: tab list line, URL line, then the tree."""
    return f"{tab_line(titles, current)}\nURL: {url}\n{tree.text}"

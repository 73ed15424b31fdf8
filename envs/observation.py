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
`main_content(text)` cuts an observation text down to the page's main content (no tab and URL
lines, menus or forms): an observation format the recall runner offers
(`agent_kv.harness.scripted_episode`).

Set-of-marks (SoM): `interactive_elements(tree)` picks the tree's interactive elements (roles in
INTERACTIVE_ROLES), `draw_marks(png, marks)` draws a numbered box per element on a screenshot
(the label is the element's id, as in the tree text) and `marks_text(marks)` lists them as
`[id] role 'name'`, one a line.
"""

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw, ImageFont

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


CHROME_ROLES = frozenset({"navigation", "form", "search", "banner", "contentinfo"})
"""Roles whose subtree `main_content` drops: site menus and forms (search, comment, cart)."""
_TREE_LINE = re.compile(r"^(\t*)\[\d+\] (\S+) ")


def main_content(text: str) -> str:
    """The page's main content of an observation text (`observation_text`'s format): the tab
    and URL lines, the RootWebArea line and every subtree whose root has a role in
    CHROME_ROLES are dropped, and the lines under the root move up one level. An error line
    ("ERROR: ...") stays first. Element ids are kept, so actions still name the elements
    shown; the dropped ones (menu links, form fields) stay actionable by id or reference.
    """
    kept: list[str] = []
    dropping_below: int | None = None  # depth of the chrome subtree being dropped
    for line in text.split("\n"):
        if line.startswith(("Tab ", "URL: ")):
            continue
        match = _TREE_LINE.match(line)
        if match is None:
            if dropping_below is None:
                kept.append(line)  # an error line, or a wrapped line of the one before
            continue
        depth, role = len(match.group(1)), match.group(2)
        if dropping_below is not None and depth > dropping_below:
            continue
        dropping_below = None
        if role in CHROME_ROLES:
            dropping_below = depth
        elif role != "RootWebArea":
            kept.append(line[1:] if depth else line)
    return "\n".join(kept)


INTERACTIVE_ROLES = frozenset(
    {
        "button",
        "checkbox",
        "combobox",
        "link",
        "listbox",
        "menuitem",
        "menuitemcheckbox",
        "menuitemradio",
        "option",
        "radio",
        "searchbox",
        "slider",
        "spinbutton",
        "switch",
        "tab",
        "textbox",
        "treeitem",
    }
)
"""Roles marked in set-of-marks screenshots (elements an action can target)."""

MARK_COLOUR = (230, 0, 0)
LABEL_TEXT_COLOUR = (255, 255, 255)


@dataclass(frozen=True)
class Mark:
    """One set-of-marks box: the element and its box (left, top, right, bottom) in
    screenshot pixels."""

    element: AXElement
    box: tuple[float, float, float, float]


def interactive_elements(tree: AXTree) -> list[AXElement]:
    """The tree's elements whose role is in INTERACTIVE_ROLES, in reading order."""
    return [element for element in tree.elements.values() if element.role in INTERACTIVE_ROLES]


def draw_marks(png: bytes, marks: Sequence[Mark]) -> bytes:
    """`png` with a box and a numbered label (the element id) drawn for each mark, as PNG.

    Raises:
        PIL.UnidentifiedImageError: `png` is not an image.
    """
    image = Image.open(io.BytesIO(png)).convert("RGB")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    for mark in marks:
        left, top, right, bottom = mark.box
        draw.rectangle((left, top, right, bottom), outline=MARK_COLOUR, width=2)
        label = str(mark.element.id)
        text_left, text_top, text_right, text_bottom = draw.textbbox((0, 0), label, font=font)
        width, height = text_right - text_left + 4, text_bottom - text_top + 4
        x = left
        y = top - height if top - height >= 0 else top
        draw.rectangle((x, y, x + width, y + height), fill=MARK_COLOUR)
        draw.text((x + 2 - text_left, y + 2 - text_top), label, fill=LABEL_TEXT_COLOUR, font=font)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def marks_text(marks: Sequence[Mark]) -> str:
    """The marked elements, one `[id] role 'name'` line each, in the order given."""
    return "\n".join(
        f"[{mark.element.id}] {mark.element.role} {mark.element.name!r}" for mark in marks
    )

"""How much of the page the agent acts on is pinned (`AgentConfig.page_pins`, `--page-pins`):
a setting checked before anything heavy is imported.

"whole" pins the latest observation whole while it is the latest (`AGENT_PIN_RULES`).
"elements" pins only its tab and URL lines and its interactive elements (the accessibility
tree's links, buttons, form fields and the like: the lines an action can name), and leaves its
text (headings, static text, prices, comments) to the policy like any older page: the pinned
floor of a bounded cache is then the page's controls, not the whole page, which a 1,200-token
page otherwise fills alone.
"""

from __future__ import annotations

from agent_kv.errors import ConfigError

PAGE_PINS = ("whole", "elements")
"""What `page_pins` can pin of the latest page."""

INTERACTIVE_ROLES = (
    "link",
    "button",
    "textbox",
    "searchbox",
    "combobox",
    "listbox",
    "option",
    "checkbox",
    "radio",
    "switch",
    "slider",
    "spinbutton",
    "menuitem",
    "tab",
)
"""Accessibility roles an action can act on (`envs.actions`: click, type, hover, select)."""

ELEMENT_PATTERNS = (
    r"\[\d+\] (?:" + "|".join(INTERACTIVE_ROLES) + r")\b[^\n]*",
    r"(?m)^(?:Tab \d+[^\n]*|URL: [^\n]*)",
)
"""RE2 patterns of what "elements" pins in an observation: each interactive element's line
from its `[id]` on, and the tab and URL lines."""


def check_page_pins(value: str) -> None:
    """Raises ConfigError for a `page_pins` setting outside `PAGE_PINS`."""
    if value not in PAGE_PINS:
        raise ConfigError(f"page_pins must be one of {', '.join(PAGE_PINS)}, got {value!r}")

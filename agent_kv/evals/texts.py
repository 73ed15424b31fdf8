"""Long local texts for benchmarks and evaluations (never downloaded).

`licence_text` is the licence texts every Debian system ships in /usr/share/common-licenses
(GPL, LGPL, GFDL, MPL, Apache, Artistic), concatenated: about 31,700 SmolLM2 tokens.
"""

from __future__ import annotations

from pathlib import Path

LICENCE_DIR = Path("/usr/share/common-licenses")
LICENCES = [
    "GPL-3", "GPL-2", "LGPL-2.1", "LGPL-3", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "Artistic",
]  # fmt: skip


def licence_text(path: str | Path | None = None) -> str:
    """The text of `path`, or by default the concatenated Debian licence texts.

    Raises:
        FileNotFoundError: the file, or a licence text, is missing.
    """
    if path:
        return Path(path).read_text()
    return "\n\n".join((LICENCE_DIR / name).read_text() for name in LICENCES)

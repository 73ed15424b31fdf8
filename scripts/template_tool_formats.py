"""Which tool-call format agent_kv learns from each chat template in a folder of `.jinja`
files: the template's own Hermes layout, the generic format, or a refusal and its reason.

    .venv/bin/python scripts/template_tool_formats.py DIR [--model qwen2.5-coder-0.5b]

Each template is put on a copy of the bundled model's tokenizer (`--model`), so markers that
are added tokens in that vocabulary show as tokens. A folder of public templates: the
`models/templates/` of llama.cpp, shipped inside the llama-cpp-python source distribution on
PyPI (`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.16`, then untar it:
`vendor/llama.cpp/models/templates/`). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

from agent_kv.errors import ToolFormatError
from agent_kv.runtime.models.model_loading import load_tokenizer
from agent_kv.runtime.replies.tool_call_format import template_takes_tools, tool_call_format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("templates", type=Path, help="a folder of .jinja chat templates")
    parser.add_argument("--model", default=None, help="the bundled model whose tokenizer to use")
    args = parser.parse_args()
    base = load_tokenizer(args.model)
    print("| template | format |")
    print("| --- | --- |")
    for path in sorted(args.templates.glob("*.jinja")):
        tokenizer = copy.copy(base)
        tokenizer.chat_template = path.read_text()
        try:
            fmt = tool_call_format(tokenizer)
        except ToolFormatError as err:
            print(f"| {path.stem} | refused: {str(err)[:140]} |")
            continue
        kind = "its own" if template_takes_tools(tokenizer) else "generic"
        tokens = ", ".join(f"{text} = {token}" for text, token in fmt.added_tokens) or "none"
        print(
            f"| {path.stem} | {kind}: open {fmt.open!r}, close {fmt.close!r}, between calls "
            f"{fmt.separator!r}, after text {fmt.text_separator!r}, added tokens {tokens}, "
            f"parallel {fmt.parallel} |"
        )


if __name__ == "__main__":
    main()

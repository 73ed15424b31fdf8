"""browser-use, unmodified, against `agent-kv serve`: one agent run on a bundled site, and what
each of its requests reused of the session's cache.

browser-use pins its own versions of pydantic, httpx and mcp, which would downgrade this
project's, so it runs from a virtual environment of its own, not from the test extra:

    python3 -m venv /tmp/browser-use-venv
    /tmp/browser-use-venv/bin/pip install browser-use==0.13.14
    .venv/bin/agent-kv sites &              # prints the sites' URLs
    .venv/bin/agent-kv serve --port 8011 --drop-image-parts &
    /tmp/browser-use-venv/bin/python scripts/browser_use_run.py --server http://127.0.0.1:8011 \
        --url http://127.0.0.1:PORT/ --task "Open the first listing and say its title."

The run names its session (`X-Session-Id`), keeps browser-use's default `use_vision=True`
(the server drops the screenshots, as `--drop-image-parts` says) and long timeouts for a CPU.
Each request's reuse is read from the replies' `usage.prompt_tokens_details.cached_tokens`
and `kv.rebuild`, which the script's HTTP hook prints after each step.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
from browser_use import Agent, BrowserProfile, BrowserSession, ChatOpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="http://127.0.0.1:8000")
    parser.add_argument("--url", required=True, help="the page the agent starts on")
    parser.add_argument("--task", required=True)
    parser.add_argument("--session", default="browser-use")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    turns: list[dict] = []

    async def record(response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            await response.aread()
            body = json.loads(response.content)
            turns.append(
                {
                    "status": response.status_code,
                    "prompt_tokens": body.get("usage", {}).get("prompt_tokens"),
                    "cached_tokens": body.get("usage", {})
                    .get("prompt_tokens_details", {})
                    .get("cached_tokens"),
                    "rebuild": body.get("kv", {}).get("rebuild"),
                    "image_parts_dropped": body.get("kv", {}).get("image_parts_dropped"),
                    "error": body.get("error"),
                }
            )
            print(json.dumps(turns[-1]), flush=True)

    llm = ChatOpenAI(
        model="agent-kv",
        base_url=f"{args.server}/v1",
        api_key="unused",
        default_headers={"X-Session-Id": args.session},
        timeout=900,
        max_retries=0,
        http_client=httpx.AsyncClient(timeout=900, event_hooks={"response": [record]}),
    )
    browser = BrowserSession(
        browser_profile=BrowserProfile(executable_path=args.chromium, headless=True)
    )
    agent = Agent(
        task=f"Start at {args.url}. {args.task}",
        llm=llm,
        browser_session=browser,
        llm_timeout=900,
        step_timeout=1200,
    )
    history = asyncio.run(agent.run(max_steps=args.max_steps))
    print(
        json.dumps(
            {
                "steps": len(history.history),
                "done": history.is_done(),
                "errors": [str(e) for e in history.errors() if e],
                "requests": len(turns),
            }
        )
    )


if __name__ == "__main__":
    main()

"""Tool calls on a real model, through the server's route: forced calls over varied schemas,
and how often the model opens a call on its own with the reply grammar on and off.

    .venv/bin/python benchmarks/tool_calls_default_model.py [--model qwen2.5-coder-0.5b]
        [--requests 50] [--prompts 50] [--out FILE.json]

- **forced**: `--requests` seeded requests (temperature 0.7, seed = the request's index) to
  `/v1/chat/completions` (in process, over httpx's ASGI transport), alternating
  `tool_choice` `required` and a named function, each offering two or three of `TOOLS`
  (strings, enums, bounded integers and numbers, booleans, arrays, nested objects, optional
  fields); a request passes when it answers 200 with `finish_reason` `tool_calls` and calls
  whose arguments validate against their tool's schema (`jsonschema`).
- **auto**: `--prompts` prompts that ask for one tool ("... Use the tool."), each offered all
  of `TOOLS`, decoded greedily (160 tokens at most) from the same chat-templated prompt twice:
  under the `auto` reply grammar and with no grammar. A reply *opens a call* when it starts
  with the format's opening marker; *makes a call* when `parse_reply` finds a complete call
  of the asked tool in it in the model's format; and *makes a call, JSON text read* when it
  does so reading a call written as JSON text too (`call_check`, as the server does).

Prints a table of counts and writes the records as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import httpx
import jsonschema

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_call_format import tool_call_format
from agent_kv.runtime.replies.tool_calls import ReplySpec, Tool, ToolChoice, call_check, parse_reply
from agent_kv.serving.chat_service import ChatService
from api.app import create_app


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": parameters}}  # fmt: skip


TOOLS = [
    _tool("get_weather", "The weather forecast for a city.",
          {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
           "units": {"enum": ["metric", "imperial"]}}, ["city", "days"]),
    _tool("search_products", "Search the shop's products.",
          {"query": {"type": "string", "maxLength": 60},
           "max_price": {"type": "number", "minimum": 0},
           "in_stock": {"type": "boolean"}}, ["query"]),
    _tool("book_flight", "Book a flight.",
          {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "passengers": {"type": "array", "maxItems": 4,
                          "items": {"type": "object",
                                    "properties": {"name": {"type": "string"},
                                                   "age": {"type": "integer", "minimum": 0}},
                                    "required": ["name"]}}}, ["origin", "destination"]),
    _tool("send_email", "Send an email.",
          {"to": {"type": "string"}, "subject": {"type": "string"},
           "body": {"type": "string"}, "cc": {"type": "array", "items": {"type": "string"}}},
          ["to", "subject", "body"]),
    _tool("convert_currency", "Convert an amount between currencies.",
          {"amount": {"type": "number"}, "from": {"enum": ["USD", "EUR", "GBP", "JPY"]},
           "to": {"enum": ["USD", "EUR", "GBP", "JPY"]}}, ["amount", "from", "to"]),
    _tool("create_event", "Create a calendar event.",
          {"title": {"type": "string"},
           "when": {"type": "object",
                    "properties": {"date": {"type": "string"}, "hour": {"type": "integer",
                                   "minimum": 0, "maximum": 23}}, "required": ["date"]},
           "reminder": {"type": "boolean"}}, ["title", "when"]),
]  # fmt: skip
ASKS = {
    "get_weather": "What is the weather in {x} for the next 3 days?",
    "search_products": "Find me a {x} under 50 dollars.",
    "book_flight": "Book a flight from {x} to Paris for one adult.",
    "send_email": "Email bob@example.com that the {x} meeting moved to Friday.",
    "convert_currency": "How much is 120 {x} in euros?",
    "create_event": "Put a {x} on my calendar for 2026-12-24 at 9.",
}
FILLERS = {
    "get_weather": ["Paris", "Oslo", "Lima", "Cairo", "Kyoto", "Quito", "Perth", "Accra"],
    "search_products": ["red bike", "desk lamp", "phone case", "kettle", "yoga mat"],
    "book_flight": ["JFK", "LHR", "NRT", "SFO", "MAD", "GRU"],
    "send_email": ["budget", "design", "hiring", "launch", "weekly"],
    "convert_currency": ["USD", "GBP", "JPY", "dollars"],
    "create_event": ["dentist visit", "team lunch", "call with Ann", "gym session"],
}


def prompts(count: int) -> list[tuple[str, str]]:
    """`count` (tool name, user message) pairs, cycling through the tools and fillers."""
    names = list(ASKS)
    out = []
    for i in range(count):
        name = names[i % len(names)]
        fill = FILLERS[name][(i // len(names)) % len(FILLERS[name])]
        out.append((name, ASKS[name].format(x=fill) + " Use the tool."))
    return out


def schema_of(name: str) -> dict:
    return next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]


async def forced(service: ChatService, model: str, count: int) -> list[dict]:
    """The forced-call requests (module docstring); one record each."""
    app = create_app(service, model)
    records = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as c:
        for i, (name, ask) in enumerate(prompts(count)):
            start = TOOLS.index(next(t for t in TOOLS if t["function"]["name"] == name))
            offered = [TOOLS[(start + k) % len(TOOLS)] for k in range(2 + i % 2)]
            choice = "required" if i % 2 == 0 else {"type": "function", "function": {"name": name}}
            body = {"model": model, "messages": [{"role": "user", "content": ask}],
                    "tools": offered, "tool_choice": choice, "temperature": 0.7, "seed": i,
                    "max_tokens": 160}  # fmt: skip
            began = time.perf_counter()
            response = await c.post("/v1/chat/completions", json=body)
            seconds = round(time.perf_counter() - began, 2)
            record = {"i": i, "choice": "required" if i % 2 == 0 else "named", "tool": name,
                      "status": response.status_code, "s": seconds}  # fmt: skip
            if response.status_code == 200:
                choice_out = response.json()["choices"][0]
                calls = choice_out["message"].get("tool_calls") or []
                record["finish_reason"] = choice_out["finish_reason"]
                record["calls"] = [
                    (c["function"]["name"], c["function"]["arguments"]) for c in calls
                ]
                valid = bool(calls) and choice_out["finish_reason"] == "tool_calls"
                for called, arguments in record["calls"]:
                    try:
                        jsonschema.validate(json.loads(arguments), schema_of(called))
                    except (jsonschema.ValidationError, ValueError):
                        valid = False
                    if record["choice"] == "named" and called != name:
                        valid = False
                record["ok"] = valid
            else:
                record["ok"], record["error"] = False, response.text[:300]
            records.append(record)
            print(json.dumps(record), flush=True)
    return records


def auto(engine: Engine, count: int) -> list[dict]:
    """The auto-versus-no-grammar replies (module docstring); one record per prompt."""
    tools = tuple(
        Tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
        for t in TOOLS
    )
    spec = ReplySpec(tools, ToolChoice("auto"))
    fmt = tool_call_format(engine.tokenizer)
    check = call_check(spec, fmt, engine.grammars)
    base = SamplingParams(max_new_tokens=160, temperature=0.0)
    records = []
    for name, ask in prompts(count):
        messages = [{"role": "user", "content": ask}]
        prompt = render_chat(engine.tokenizer, messages, tools, generation_prompt=True)
        ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        record = {"tool": name, "prompt_tokens": len(ids)}
        for mode, params in (("grammar", replace(base, grammar=spec.grammar(fmt))),
                             ("free", base)):  # fmt: skip
            reply = engine.generate(engine.new_sequence(), ids, params)
            _, calls = parse_reply(reply.text, spec, fmt)
            _, read = parse_reply(reply.text, spec, fmt, check)
            record[mode] = {"opens": reply.text.startswith(fmt.marker), "calls": len(calls),
                            "named": [c.name for c in calls], "read": [c.name for c in read],
                            "text": reply.text[:160]}  # fmt: skip
        records.append(record)
        print(json.dumps(record), flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    loaded = load_model(args.model)
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("full"))
    forced_records = asyncio.run(forced(ChatService(engine), args.model, args.requests))
    auto_records = auto(engine, args.prompts)
    ok = sum(r["ok"] for r in forced_records)
    print(f"\nforced calls ({args.model}): {ok} of {len(forced_records)} answered 200 with valid "
          f"calls ({sum(r['status'] == 200 for r in forced_records)} answered 200)")  # fmt: skip
    print("| auto, greedy | opens a call | calls the asked tool | the same, JSON text read |")
    print("| --- | --- | --- | --- |")
    n = len(auto_records)
    for mode in ("grammar", "free"):
        opens = sum(r[mode]["opens"] for r in auto_records)
        asked = sum(r["tool"] in r[mode]["named"] for r in auto_records)
        read = sum(r["tool"] in r[mode]["read"] for r in auto_records)
        print(f"| {mode} | {opens} of {n} | {asked} of {n} | {read} of {n} |")
    if args.out:
        args.out.write_text(json.dumps({"forced": forced_records, "auto": auto_records}, indent=1))


if __name__ == "__main__":
    main()

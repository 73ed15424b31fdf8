"""The names KV byte figures had before each name took one meaning, and `current_names`, which
reads records written with them: saved sessions, traces and results files. The old names are
accepted for one release, then this module goes."""

from __future__ import annotations

from typing import Any

RENAMED = {
    "kv_bytes": "kv_live_bytes",
    "appended_kv_bytes": "appended_kv_live_bytes",
    "allocated_kv_bytes": "kv_allocated_bytes",
    "peak_kv_bytes": "peak_kv_allocated_bytes",
    "full_kv_bytes": "full_kv_allocated_bytes",
}
"""Old name -> new name, as per-call records (`CallRecord`), a trace's `step_NNN.json` and
episode records (`summary.json`, `results.jsonl`) used them: `kv_bytes` was live,
`peak_kv_bytes` and `full_kv_bytes` allocated (the API's `kv_bytes`, `peak_kv_bytes` and
`full_kv_bytes`, all live, are aliases of their own: `serving.chat_service.KVReport`)."""


def current_names(record: dict[str, Any]) -> dict[str, Any]:
    """`record` (a step or episode record, bytes) with each old name of `RENAMED` replaced by
    its new one, the keys in their order; an old key is dropped when the new one is there
    too. Accepts the old names for one release."""
    return {
        RENAMED.get(key, key): value
        for key, value in record.items()
        if key not in RENAMED or RENAMED[key] not in record
    }

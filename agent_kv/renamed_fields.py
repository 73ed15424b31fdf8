"""The names saved fields had before each name took one meaning, and `current_names`, which
reads records written with them: KV byte figures of saved sessions, traces and results files
(`RENAMED`), and the per-token statistics columns of a saved store (`RENAMED_STORE_FIELDS`).
The old names are accepted for one release, then this module goes."""

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

RENAMED_STORE_FIELDS = {"window_mass": "observation_mass"}
"""Old name -> new name of a store segment's saved columns (`KVStore.state`, each table's
fields): SnapKV's observation-window mass was `window_mass`, a name it shared with the
sliding-window layers and the window policy."""


def current_names(record: dict[str, Any], renamed: dict[str, str] = RENAMED) -> dict[str, Any]:
    """`record` (a step or episode record, bytes, or a saved table's columns) with each old
    name of `renamed` (`RENAMED` unless given) replaced by its new one, the keys in their
    order; an old key is dropped when the new one is there too. Accepts the old names for one
    release."""
    return {
        renamed.get(key, key): value
        for key, value in record.items()
        if key not in renamed or renamed[key] not in record
    }

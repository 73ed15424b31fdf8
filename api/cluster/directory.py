"""The replicas' latest reports, kept by one Ray actor.

Each replica (`api.cluster.replica.ReplicaServer`) reports every `REPORT_PERIOD_S` seconds:
the sessions it knows and its Prometheus metrics. The gateway reads the reports of the
replicas still reporting for `GET /sessions` (which replica holds each session) and
`GET /metrics` (per replica and summed). A replica silent for `STALE_AFTER_S` seconds is left
out: it died, or was drained.
"""

from __future__ import annotations

import time

REPORT_PERIOD_S = 0.5
"""Seconds between a replica's reports."""
STALE_AFTER_S = 5.0
"""Seconds after which a replica that has not reported is left out."""


class ReplicaDirectory:
    """The latest report of each replica (run as a named Ray actor, `api.cluster.launch`).

    Args:
        stale_after_s: seconds after which a replica's report no longer counts.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, stale_after_s: float = STALE_AFTER_S, clock=time.monotonic):
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._reports: dict[str, tuple[float, dict]] = {}

    def report(self, replica_id: str, report: dict) -> None:
        """Keep `report` as the latest of `replica_id` (see `ReplicaServer.report`)."""
        self._reports[replica_id] = (self.clock(), report)

    def withdraw(self, replica_id: str) -> None:
        """Forget `replica_id` (it is shutting down)."""
        self._reports.pop(replica_id, None)

    def live(self) -> dict[str, dict]:
        """The latest report of each replica that reported in the last `stale_after_s`
        seconds, by replica id (the others are forgotten)."""
        now = self.clock()
        for replica_id, (at, _) in list(self._reports.items()):
            if now - at > self.stale_after_s:
                del self._reports[replica_id]
        return {replica_id: report for replica_id, (_, report) in self._reports.items()}

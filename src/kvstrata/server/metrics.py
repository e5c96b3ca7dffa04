"""Worker stats in the Prometheus text exposition format (version 0.0.4).

Stats are a nested dict (the store's plus the worker's). Numbers at the top become
``kvstrata_<name>``; a dict of dicts such as ``{"tiers": {"memory": {"used": ...}}}`` becomes
``kvstrata_tier_used{tier="memory"}``. Monotonic counts get the ``_total`` suffix and type counter.
"""

from __future__ import annotations

import numbers
from typing import Any

from kvstrata.stat_names import STORE_COUNTERS, TIER_COUNTERS

# Stats that only grow (Prometheus counters): the store's own (kvstrata.stat_names.STORE_COUNTERS, kept apart
# from the store package, which imports torch: `kvstrata status --prometheus` must not), plus the worker's; the
# rest are gauges.
WORKER_COUNTERS = frozenset(
    {
        "requests",
        "request_errors",
        "local_hits",
        "connections",
        "lane_requests_polled",
        "lane_wakeups",
        "lane_poll_spells",
        "lane_poll_kicks",
        "puts",
        "gets",
        "deletes",
        "bytes_written",
        "bytes_read",
        # the device-object broker's (kvstrata.devobj.broker.COUNTERS), under "device_objects"
        "device_objects_published",
        "device_objects_registered",
        "device_objects_broadcasts",
        "device_objects_received",
        "device_objects_reads",
        "device_objects_timeouts",
        "device_objects_receives_failed",
        "device_objects_offer_fates_taken",
        "device_objects_offer_fates_not_taken",
    }
)


# A tier's counters by their full stat name, as a tier's stat is looked up (tier_retired_segments).
COUNTERS = WORKER_COUNTERS | frozenset(STORE_COUNTERS) | frozenset(f"tier_{name}" for name in TIER_COUNTERS)


def counters() -> frozenset[str]:
    return COUNTERS


# Leaves that are byte counts get the ``_bytes`` unit suffix Prometheus asks for.
BYTES = frozenset({"used", "capacity", "mapped", "free", "size", "reserved"})

#: ``# HELP`` text of the metrics, by their stat's name (the path below the prefix, before any unit suffix)
HELP = {
    "hits": "reads of keys found, the clients' own from shared memory included",
    "local_hits": "reads the clients served from shared memory without asking the worker",
    "misses": "reads of keys not found (or expired, or corrupt on SSD)",
    "objects": "objects stored (visible versions)",
    "evictions": "evictable objects dropped to make room in DRAM",
    "spills": "objects moved out of DRAM to live on SSD only",
    "promotions": "objects brought back from SSD into DRAM when read",
    "flushes": "write-back objects written to SSD",
    "expired": "objects dropped when their TTL ran out",
    "corrupt": "SSD files that failed their checksum (quarantined, never served)",
    "dirty": "write-back objects not yet on SSD",
    "leases": "leases clients hold (zero-copy views, cached reads, copies in flight)",
    "creates_in_progress": "objects being written, not yet sealed",
    "clients": "clients connected",
    "connections": "client connections accepted since start",
    "requests": "requests served",
    "request_errors": "requests refused as invalid or failed in the worker (misses and timeouts not counted)",
    "uptime_seconds": "seconds since the worker started",
    "reserved": "memory-tier bytes held in clients' write reservations",
    "tier_used": "bytes used in the tier",
    "tier_capacity": "the tier's size",
    "tier_reserved": "bytes reserved in the tier for writes under way (SSD: files being written, write-back data)",
    "tier_mapped": "bytes of shared memory mapped for the tier (retired segments not counted)",
    "tier_files": "files in the SSD tier",
    "tier_segments": "shared-memory segments of the tier in use",
    "tier_fragmentation": "1 - largest free block / free bytes, in the worst segment (0: free space in one piece)",
    "carved": "objects committed out of clients' write reservations (host<->device writes with no request each)",
    "reservations": "write reservations granted to clients",
    "reserved_bytes": "bytes in clients' write reservations not committed yet",
    "device_loads": "objects loaded into the HBM tier",
    "device_evictions": "objects dropped from the HBM tier",
    "device_object_connections": "connections of device-object links (part of the clients counted in clients)",
    "lane_requests_polled": "requests answered from clients' shared-memory request pages by the polling thread",
    "lane_poll_spells": "polling spells the lane poller began",
    "lane_poll_kicks": "times a client woke the lane poller, having found its request page unpolled",
    "lane_wakeups": "lane requests a client had to wake a sleeping worker thread for",
    "tier_retired_segments": "empty segments whose memory went back, to map a value larger than a segment",
}


def _singular(name: str) -> str:
    return name[:-1] if name.endswith("s") else name


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in str(name)).strip("_").lower()


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def to_prometheus(stats: dict[str, Any], prefix: str = "kvstrata") -> str:
    """Render ``stats`` as Prometheus text; non-numeric leaves are skipped."""
    samples: dict[str, list[tuple[str, float]]] = {}

    def add(name: str, labels: dict[str, str], value: float) -> None:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        samples.setdefault(name, []).append((f"{{{label_text}}}" if label_text else "", value))

    def walk(path: list[str], labels: dict[str, str], node: Any) -> None:
        value = _number(node)
        if value is not None:
            add("_".join([prefix, *path]), labels, value)
            return
        if not isinstance(node, dict):
            return
        if path and node and all(isinstance(v, dict) for v in node.values()):
            label = _singular(path[-1])  # {"tiers": {"memory": {...}}} -> tier="memory"
            for key, child in node.items():
                walk([*path[:-1], label], {**labels, label: str(key)}, child)
            return
        for key, child in node.items():
            walk([*path, _sanitize(key)], labels, child)

    walk([], {}, stats)
    lines = []
    for name, rows in sorted(samples.items()):
        base = name.rsplit("_", 1)[-1]
        stat = name.removeprefix(prefix + "_")
        # a tier's stats carry the store's names (tier_spills ...); elsewhere only the full name says
        is_counter = stat in counters() or (stat.startswith("tier_") and base in counters())
        metric = f"{name}_bytes" if base in BYTES else name
        metric = f"{metric}_total" if is_counter and not metric.endswith("_total") else metric
        lines.append(f"# HELP {metric} {HELP.get(stat, 'kvstrata worker stat ' + stat.replace('_', ' '))}")
        lines.append(f"# TYPE {metric} {'counter' if is_counter else 'gauge'}")
        for label_text, value in rows:
            lines.append(f"{metric}{label_text} {_format(value)}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)

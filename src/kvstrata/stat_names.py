"""Names of the store's stats that only grow, in a module that imports nothing.

The worker's Prometheus text (:mod:`kvstrata.server.metrics`) types them as counters; ``kvstrata status
--prometheus`` renders that text, and must not import the store package (which imports the engine, and torch)
to learn these names. :mod:`kvstrata.store.config` takes them from here.
"""

from __future__ import annotations

STORE_COUNTERS = (  # stats that only grow; the worker's metrics export them as counters
    "hits",
    "misses",
    "evictions",
    "spills",
    "promotions",
    "expired",
    "corrupt",
    "flushes",
    "device_loads",
    "device_evictions",
    "reservations",  # write reservations granted (store.reservations)
    "carved",  # objects committed out of write reservations
)

TIER_COUNTERS = (  # a tier's stats (store.stats()["tiers"][name]) that only grow: kvstrata_tier_<name>_total
    "retired_segments",  # the memory tier's segments emptied for a value larger than a segment (never un-retired)
)

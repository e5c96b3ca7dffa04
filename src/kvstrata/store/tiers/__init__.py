"""Storage tiers behind small interfaces: DRAM (shared segments), SSD (files), HBM (a CUDA buffer)."""

from kvstrata.store.tiers.base import BlockTier, Location, Tier
from kvstrata.store.tiers.disk import DiskTier
from kvstrata.store.tiers.memory import MemoryTier

__all__ = ["BlockTier", "DiskTier", "Location", "MemoryTier", "Tier"]

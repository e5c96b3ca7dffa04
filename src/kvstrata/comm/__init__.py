"""Collectives for tensors: the hybrid all-gather (device collective + NUMA-aware host path at once)."""

from kvstrata.comm.hybrid import HybridAllGather, Token
from kvstrata.comm.oeccl import init_oeccl, oeccl_allgather, oeccl_cleanup, wait_event_on_stream

__all__ = ["HybridAllGather", "Token", "init_oeccl", "oeccl_allgather", "oeccl_cleanup", "wait_event_on_stream"]

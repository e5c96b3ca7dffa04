"""Integrations: kvstrata's stores and operators as an inference engine or a training job uses them.

:class:`PrefixKVCache` offloads a paged KV cache's blocks and loads cached prompt prefixes back
(:mod:`kvstrata.integrations.prefix_cache`). :func:`save_state_dict` / :func:`load_state_dict` hand a model's
weights or a checkpoint from one process to any number of others, straight into their tensors
(:mod:`kvstrata.integrations.checkpoint`).
"""

from kvstrata.integrations.checkpoint import (
    CheckpointInfo,
    checkpoint_manifest,
    delete_checkpoint,
    load_state_dict,
    save_state_dict,
)
from kvstrata.integrations.prefix_cache import PrefixCacheStats, PrefixKVCache, SaveResult

__all__ = [
    "CheckpointInfo",
    "PrefixCacheStats",
    "PrefixKVCache",
    "SaveResult",
    "checkpoint_manifest",
    "delete_checkpoint",
    "load_state_dict",
    "save_state_dict",
]

"""Integrations: kvstrata's stores and operators as an inference engine uses them.

:class:`PrefixKVCache` offloads a paged KV cache's blocks and loads cached prompt prefixes back
(:mod:`kvstrata.integrations.prefix_cache`).
"""

from kvstrata.integrations.prefix_cache import PrefixCacheStats, PrefixKVCache, SaveResult

__all__ = ["PrefixCacheStats", "PrefixKVCache", "SaveResult"]

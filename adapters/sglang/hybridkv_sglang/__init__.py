"""hybridkv for SGLang 0.5.23.

* ``--radix-cache-backend hybridkv``: :class:`~hybridkv_sglang.radix_cache.HybridKVRadixCache`,
  hybridkv's window-safe prefix tree driving SGLang's own SWA pools
  (registered through the ``sglang.srt.plugins`` entry point, see :mod:`.plugin`);
  with ``--enable-hierarchical-cache`` (or ``$HYBRIDKV_L2_BYTES`` / ``$HYBRIDKV_L3``) it
  has hybridkv's L2 host and L3 storage tiers below it (:mod:`.tiers`).
* ``--hicache-storage-backend dynamic`` with ``module_path=hybridkv_sglang.storage``,
  ``class_name=HybridKVStorage``: hybridkv's L3 backends as a ``HiCacheStorage``.
* ``--swa-full-tokens-ratio`` for the hybridkv backend: :func:`~hybridkv_sglang.split.plan_swa_split`
  (``python -m hybridkv_sglang.split``).

Importing this package does not import SGLang; the submodules do.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]

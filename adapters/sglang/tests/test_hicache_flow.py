"""SGLang 0.5.23 HiCache on CPU (``hicache_flow``): a prefix evicted from the
device pools is matched on the host tier, loaded back by ``init_load_back``
and its K/V tags (written on device, copied D->H, then H->D) are the request's
own.  A few seconds; the Mooncake replay is ``benchmarks/peers/in_engine.sh --tiers``."""

from __future__ import annotations

import numpy as np
import pytest

import conftest

conftest.publish_test_server_args()

import hicache_flow as hf  # noqa: E402
from sglang_flow import Pools  # noqa: E402

PAGE, WINDOW = 64, 128


def _prompts() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(10, 50_000, size=1_500) for _ in range(3))
    # a, then b and c push a off the device, then a's next turn quotes a
    return [a, b, c, np.concatenate([a, rng.integers(10, 50_000, size=200)])]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prefix_is_loaded_back_from_host_with_its_own_kv(policy):
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(**hf.hicache_server_args(4.0, policy))
    override.install()
    try:
        with hf.cpu_transfer_ops():
            pools = Pools(full_tokens=PAGE * 40, swa_tokens=PAGE * 32, page_size=PAGE, max_reqs=4,
                          max_context=4_096)
            cache = hf.build_hicache(pools, WINDOW)
            driver = hf.HiCacheDriver(cache, pools, WINDOW, chunk=1_024, max_live=1)
            stats = driver.run([(p, 8, None) for p in _prompts()])
            cache.check_hicache_events()
            cache.sanity_check()
    finally:
        override.restore()
    assert stats.rejected == 0
    assert driver.tiers.load_backs == 1 and driver.tiers.host_hits_verified == 1
    assert driver.tiers.host_hit_tokens == 1_472  # a's 1,500 tokens, whole pages below the last token
    assert stats.hit_tokens == driver.tiers.device_hit_tokens + driver.tiers.host_hit_tokens


def test_a_transfer_that_moves_nothing_is_caught(monkeypatch):
    """The oracle covers loaded-back hits: with copies dropped, the hit's K/V
    on device are not the request's and the run stops."""
    from sglang.srt.runtime_context import get_context

    monkeypatch.setattr(hf, "cpu_transfer_kv_direct", lambda *a, **k: None)
    override = get_context().override_server_args(**hf.hicache_server_args(4.0))
    override.install()
    try:
        with hf.cpu_transfer_ops(), pytest.raises(hf.PseudoHitError, match="full KV of position 0"):
            pools = Pools(full_tokens=PAGE * 40, swa_tokens=PAGE * 32, page_size=PAGE, max_reqs=4,
                          max_context=4_096)
            cache = hf.build_hicache(pools, WINDOW)
            hf.HiCacheDriver(cache, pools, WINDOW, chunk=1_024, max_live=1).run([(p, 8, None) for p in _prompts()])
    finally:
        override.restore()

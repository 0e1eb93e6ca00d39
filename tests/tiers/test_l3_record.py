"""The core's L3 record is the StoreIndex the vLLM connector keeps (one record of
L3 for every host): the read-ahead asks the store only what the record cannot
answer, a failed put leaves the record, a key the store lost is a clamped miss
that leaves it too, so both are written again.  Checked with a real file
backend and the reference model (every hit's tokens verified)."""

from __future__ import annotations

from pathlib import Path

from .faulty import FaultyBackend, Probed
from .reference import SPEC, drop_l1_and_l2, prompts, run, tiered
from hybridkv.tiers.payload import swa_key
from hybridkv.tiers.storage import open_backend


def keys_of(cache, ps: list) -> list[bytes]:  # noqa: ANN001
    co = cache.lower_tiers
    return [k for ns, t in ps for k in co.page_keys(t, ns, (len(t) - 1) // SPEC.page_size)]


def served_once(store, n: int, seed: int):  # noqa: ANN001, ANN201
    """A cache over ``store`` that served ``n`` prompts, its L3 writes flushed:
    ``(cache, prompts, their full page keys)``."""
    cache = tiered(store)
    ps = prompts(n, seed=seed)
    run(cache, ps)
    assert cache.flush(10)
    return cache, ps, keys_of(cache, ps)


def test_a_cache_reads_its_own_l3_pages_back_without_asking_the_store_about_them(tmp_path: Path):
    store = Probed(open_backend(f"file://{tmp_path / 'l3'}"))
    cache, ps, written = served_once(store, 3, seed=21)
    try:
        record = cache.lower_tiers.l3_record
        assert record.held(written).all()  # queued here, so known without a probe
        drop_l1_and_l2(cache)
        store.asked.clear()
        out = run(cache, ps)  # everything comes back from L3, verified token by token
        st = cache.stats()
        assert out["hit_tokens"] == 3 * 40 and st["l3_hit_tokens"] == 3 * 40, (out, st)
        # the store was asked only about keys the record had no answer for: no full
        # page this cache wrote, and only SWA keys it never wrote (windows it kept)
        assert not set(store.asked) & set(written), len(store.asked)
        assert not set(store.asked) & {swa_key(k) for k in written if record.held([swa_key(k)])[0]}
        assert st["l3_record_answered_keys"] >= len(written), st
    finally:
        cache.close()


def test_a_failed_put_leaves_the_record_so_the_page_is_written_again(tmp_path: Path):
    store = FaultyBackend(open_backend(f"file://{tmp_path / 'l3'}"))
    store.fail.add("put")
    cache, ps, written = served_once(store, 2, seed=22)
    try:
        record = cache.lower_tiers.l3_record
        assert not record.held(written).any()  # the puts raised: nothing counts as stored
        assert cache.stats()["l3_record_lost_keys"] >= len(written)
        store.fail.clear()
        drop_l1_and_l2(cache)
        run(cache, ps)  # recomputed, backed up again: this time L3 takes the pages
        assert cache.flush(10)
        assert record.held(written).all() and all(store.inner.exists(written))
        drop_l1_and_l2(cache)
        out = run(cache, ps)
        assert out["hit_tokens"] == 2 * 40 and cache.stats()["l3_hit_tokens"] == 2 * 40
    finally:
        cache.close()


def test_a_page_the_store_lost_is_a_clamped_miss_and_written_again(tmp_path: Path):
    store = Probed(open_backend(f"file://{tmp_path / 'l3'}"))
    cache, ps, written = served_once(store, 1, seed=23)
    try:
        drop_l1_and_l2(cache)
        store.inner.delete(written[5:6])  # the store evicts a page behind this cache's back
        out = run(cache, ps)  # the record still holds it: the read misses there, the hit stops there
        st = cache.stats()
        assert out["hit_tokens"] <= 5 * SPEC.page_size and st["l3_clamped_pages"] >= 1, (out, st)
        assert st["l3_record_lost_keys"] >= 1
        # out of the record, so the recomputed page was written again (not skipped as known)
        assert cache.flush(10) and store.inner.exists(written[5:6]) == [True]
    finally:
        cache.close()

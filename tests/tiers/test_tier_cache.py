"""TieredCache: hits across L1/L2/L3 with a page-content oracle, write policies,
the four consistency-repair cases, clamping to what was actually loaded."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hybridkv.pools import arena_page_bytes
from hybridkv import AttnKind, CacheConfig, ModelSpec
from hybridkv.spec import KVShape
from hybridkv.tiers.payload import swa_key
from hybridkv.tiers.storage import open_backend
from hybridkv.tiers.tiered import TierConfig, TieredCache

SPEC = ModelSpec("tiny-tier", ("full", "swa", "swa"), 8, KVShape(1, 4, 4), KVShape(2, 4, 4),
                 dtype="float32", page_size=4)
FPB, SPB = arena_page_bytes(SPEC, "full"), arena_page_bytes(SPEC, "swa")
W = SPEC.window


def values(tokens: np.ndarray) -> np.ndarray:
    """KV value of each position: a chained function of the whole prefix (exact in float32)."""
    out = np.empty(len(tokens), dtype=np.float64)
    acc = 7
    for i, t in enumerate(tokens.tolist()):
        acc = (acc * 131 + t + 1) % 1_000_003
        out[i] = acc
    return out


def write_all(kb: Any, slots: np.ndarray, vals: np.ndarray) -> None:
    """Every layer of one kind: K and V of token ``slots[i]`` all equal ``vals[i]``."""
    lay = kb.layout
    t = torch.tensor(vals, dtype=kb.k.dtype)
    for li in range(lay.num_layers):
        kb.write(li, slots, t[:, None, None].expand(len(vals), lay.heads, lay.k_dim),
                 t[:, None, None].expand(len(vals), lay.heads, lay.v_dim))


def read_means(kb: Any, slots: np.ndarray, which: int) -> np.ndarray:
    """``[layers, n]`` mean of K (``which`` 0) or V (1) of each token slot, per layer."""
    return np.stack([kb.read(li, slots)[which].mean(dim=(1, 2)).numpy()
                     for li in range(kb.layout.num_layers)])


def run(cache: TieredCache, tokens: np.ndarray, ns: str = "default") -> dict[str, Any]:
    """Drive one prompt; check that every hit position reads the right KV."""
    req = cache.begin(tokens, ns)
    h = req.prefix_len
    v = values(tokens)
    buf = cache.pool.buffers
    if h:
        fs = cache.full_slots(req, 0, h)
        assert np.array_equal(read_means(buf.full, fs, 0), np.tile(v[:h], (1, 1))), "full KV"
        ss = cache.swa_slots(req, max(0, h - W), h)
        assert np.array_equal(read_means(buf.swa, ss, 1), np.tile(-v[max(0, h - W):h], (2, 1))), "SWA KV"
    n = len(tokens) - req.computed
    full, swa = cache.allocate(req, n)
    new = v[req.computed:req.computed + n]
    write_all(buf.full, full, new)
    write_all(buf.swa, swa, -new)
    cache.commit(req, n)
    tiers = dict(req.extra["tiers"])
    cache.finish(req)
    cache.check_invariants()
    return {"hit": h, **tiers}


def make(tmp_path: Path | None = None, *, l1_pages: int = 12, l2_pages: int = 200, l3: Any = None,
         policy: str = "write_through", checkpoint: int = 0, **kw: Any) -> TieredCache:
    return TieredCache(SPEC, CacheConfig(budget_bytes=l1_pages * (FPB + SPB), device="cpu",
                                         swa_checkpoint=checkpoint),
                       tiers=TierConfig(l2_bytes=l2_pages * (FPB + SPB), l3=l3, write_policy=policy, **kw))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_l2_serves_what_l1_evicted_with_right_content(policy):
    cache = make(policy=policy)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 5000, 41) for _ in range(5)]
    first = [run(cache, p) for p in prompts]
    assert all(r["hit"] == 0 for r in first)
    second = [run(cache, p) for p in prompts]
    assert all(r["hit"] == 40 for r in second)  # ((41 - 1) // 4) pages
    st = cache.stats()
    assert st["l2_hit_tokens"] > 0 and st["tier_errors"] == 0
    assert st["l1_hit_tokens"] + st["l2_hit_tokens"] + st["l3_hit_tokens"] == st["hit_tokens"]
    assert st["bytes_h2d"] > 0 and st["bytes_d2h"] > 0
    if policy == "write_back":  # nothing reached L2 before L1 had to evict it
        assert st["l1_to_l2_full_pages"] <= st["evicted_tokens"] // SPEC.page_size


def test_lower_hit_pages_reports_the_window_safe_l2_hit_without_loading():
    """What a host engine that loads at admission asks at match (SGLang's host_hit_length)."""
    cache = make(l1_pages=40)
    p = np.random.default_rng(11).integers(0, 5000, 33)
    run(cache, p)  # 8 pages, written through to L2
    co = cache.lower_tiers
    ext = np.append(p, 0).astype(np.int32)  # one token past the matchable key
    cache.tree.evict(swa_pages=cache.tree.evictable_swa_pages())  # L1: full KV, no window
    assert co.lower_hit_pages(ext, "default", 0, wait_l3=False) == 8  # L2's SWA completes it
    cache.tree.evict(full_pages=cache.tree.full_pages_cached)
    assert cache.tree.full_pages_cached == 0
    assert co.lower_hit_pages(ext, "default", 0, wait_l3=False) == 8
    assert co.lower_hit_pages(ext, "default", 5, wait_l3=False) == 3
    assert co.lower_hit_pages(ext, "default", 8, wait_l3=False) == 0
    assert cache.tree.full_pages_cached == 0 and co.counters["l2_to_l1_full_pages"] == 0  # nothing loaded
    # the hit stops where L2 lost the window's SWA
    lost = [swa_key(k) for k in cache._page_keys(p, "default", 8)[6:8]]
    assert co.host.discard(lost, swa=True) == 2
    assert co.lower_hit_pages(ext, "default", 0, wait_l3=False) == 6  # pages 4, 5 hold the window of 6
    co.resident = lambda *a: 1 / 0  # a tier fault is a miss, counted
    assert co.lower_hit_pages(ext, "default", 0, wait_l3=False) == 0 and co.counters["tier_errors"] == 1


def test_without_l2_room_the_l1_answer_stands():
    cache = make(l2_pages=1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 5000, 41) for _ in range(5)]
    for p in prompts * 2:
        run(cache, p)
    assert cache.stats()["tier_errors"] == 0


def test_repair_host_swa_completes_device_window():
    """Case 2: L1 has the full KV of a prefix but its SWA was evicted; L2 has the SWA."""
    cache = make(l1_pages=40)
    rng = np.random.default_rng(3)
    p = rng.integers(0, 5000, 33)
    run(cache, p)
    # drop every SWA page in L1 (full KV stays): the tree evicts SWA before full
    cache.tree.evict(swa_pages=cache.tree.evictable_swa_pages())
    assert cache.tree.swa_pages_cached == 0 and cache.tree.full_pages_cached > 0
    assert cache.match(p).length == 0  # L1 alone: no window, no hit
    r = run(cache, p)
    assert r["hit"] == 32 and r["l1_hit_tokens"] == 32
    assert cache.stats()["repair_swa_h2d_pages"] >= SPEC.window_pages


def test_repair_device_swa_backed_up_at_prefill_end():
    """Case 1 (write-back): the host holds a prefix's full KV but not its SWA;
    prefill end copies the device's SWA down."""
    cache = make(l1_pages=40, policy="write_back")
    rng = np.random.default_rng(4)
    p = rng.integers(0, 5000, 33)
    run(cache, p)
    keys = cache._page_keys(p, "default", 8)
    # put the full KV into L2 only (as an earlier write-back of full pages would)
    pages = np.array([cache.tree.iter_nodes().__next__().full[i] for i in range(8)])
    cache.lower_tiers.backup.store_l2(AttnKind.FULL, pages, keys, None)
    assert (cache.host.lookup_swa([swa_key(k) for k in keys]) < 0).all()
    q = np.concatenate([p, rng.integers(0, 5000, 8)])
    run(cache, q)
    assert cache.stats()["repair_swa_d2h_pages"] > 0
    have = cache.host.lookup_swa([swa_key(k) for k in keys]) >= 0
    assert have[-SPEC.window_pages:].all()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("checkpoint", [0, 16])
def test_l2_anchors_follow_the_sequence_as_it_grows(policy, checkpoint):
    """A conversation's earlier tails stop being anchored in L2 once a later turn
    has moved past them (the L1 tree moves a leaf's tail anchor the same way):
    L2 keeps the latest tail, the window the latest hit ended at and the
    checkpoints anchored, the rest becomes plain SWA, given up first."""
    cache = make(l1_pages=60, l2_pages=400, policy=policy, checkpoint=checkpoint)
    rng = np.random.default_rng(12)
    turns = [rng.integers(0, 5000, 41)]
    for _ in range(3):
        turns.append(np.concatenate([turns[-1], rng.integers(0, 5000, 24)]))
    for t in turns:
        run(cache, t)
        if policy == "write_back":  # L1 gives everything up: write-back stores it in L2
            cache.tree.evict(full_pages=cache.tree.evictable_full_pages(),
                             swa_pages=cache.tree.evictable_swa_pages())
    keys = cache._page_keys(turns[-1], "default", len(turns[-1]) // 4)
    held = cache.host.lookup_swa([swa_key(k) for k in keys]) >= 0
    anchored = cache.host.anchored_swa([swa_key(k) for k in keys])
    n, wp, hit = len(keys), SPEC.window_pages, (len(turns[-2]) - 1) // 4
    want = np.zeros(n, bool)
    want[n - wp - 1:] = True  # the last tail (with the exact-repeat page)
    want[hit - wp:hit] = True  # the window the last hit ended at
    if checkpoint:
        kp = checkpoint // 4
        for end in range(kp, n + 1, kp):
            want[end - wp:end] = True
    assert np.array_equal(anchored, want & held), (np.flatnonzero(anchored), np.flatnonzero(want & held))
    assert held[hit - wp:hit].all() and held[n - wp - 1:].all()
    assert cache.stats()["l2_demoted_swa_pages"] > 0
    # plain SWA goes first under pressure: the kept windows survive, and the last turn still hits
    cache.host.alloc(0, cache.host.num_swa_pages - int(anchored.sum()))
    assert (cache.host.lookup_swa([swa_key(k) for k in keys]) >= 0)[want & held].all()


class CountingBackend:
    """A real file backend that records touches and can drop values on read."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.touched: list[bytes] = []
        self.vanish_on_get = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, keys):  # noqa: ANN001, ANN201
        if self.vanish_on_get:  # evicted between exists() and get()
            self.inner.delete(keys)
        return self.inner.get(keys)

    def touch(self, keys):  # noqa: ANN001, ANN201
        self.touched.extend(keys)
        return self.inner.touch(keys)


def test_l3_survives_restart_and_content_is_real(tmp_path):
    url = f"file://{tmp_path / 'l3'}"
    a = make(l3=url)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 5000, 41) for _ in range(3)]
    for p in prompts:
        run(a, p)
    assert a.flush(10)
    assert a.stats()["l3_write_pages_ok"] > 0
    a.close()
    b = make(l3=url)  # fresh L1 and L2: only L3 remembers
    res = [run(b, p) for p in prompts]
    assert all(r["hit"] == 40 and r["l3_hit_tokens"] == 40 for r in res)
    st = b.stats()
    assert st["bytes_l3_read"] > 0 and st["l3_backend_corrupt"] == 0
    b.close()


def test_l3_value_gone_between_exists_and_get_is_a_clamped_miss(tmp_path):
    backend = CountingBackend(open_backend(f"file://{tmp_path / 'l3'}"))
    a = make(l3=backend)
    rng = np.random.default_rng(6)
    p = rng.integers(0, 5000, 41)
    run(a, p)
    a.flush(10)
    a.close()
    backend.vanish_on_get = True
    b = make(l3=backend)
    r = run(b, p)  # content checked inside run(): never garbage
    assert r["hit"] == 0 and b.stats()["l3_clamped_pages"] > 0
    b.close()


def test_corrupt_l3_value_is_never_served(tmp_path):
    url = f"file://{tmp_path / 'l3'}"
    a = make(l3=url)
    rng = np.random.default_rng(7)
    p = rng.integers(0, 5000, 41)
    run(a, p)
    a.flush(10)
    a.close()
    for f in (tmp_path / "l3").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            data = bytearray(f.read_bytes())
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
    b = make(l3=url)
    r = run(b, p)
    assert r["hit"] < 40 and b.stats()["l3_backend_corrupt"] > 0
    b.close()


def test_repair_hot_prefix_touches_l3_rate_limited(tmp_path):
    """Case 3: prefixes served from L1/L2 touch their L3 keys, at most once per interval."""
    backend = CountingBackend(open_backend(f"file://{tmp_path / 'l3'}"))
    cache = make(l1_pages=40, l3=backend, touch_interval_s=3600)
    rng = np.random.default_rng(8)
    p = rng.integers(0, 5000, 41)
    run(cache, p)
    run(cache, p)
    cache.flush(10)
    keys = cache._page_keys(p, "default", 10)
    assert set(keys) <= set(backend.touched)
    n = len(backend.touched)
    run(cache, p)  # within the interval: no second touch
    cache.flush(10)
    assert len(backend.touched) == n and cache.stats()["l3_touches_skipped"] > 0
    cache.close()


def test_repair_checkpoints_apply_in_l3(tmp_path):
    """Case 4: only tail and checkpoint SWA windows go to L3; a later prompt that
    ends between them is served up to the checkpoint."""
    url = f"file://{tmp_path / 'l3'}"
    a = TieredCache(SPEC, CacheConfig(budget_bytes=60 * (FPB + SPB), device="cpu", swa_checkpoint=16,
                                      retention="dense"),
                    tiers=TierConfig(l2_bytes=200 * (FPB + SPB), l3=url))
    rng = np.random.default_rng(9)
    p = rng.integers(0, 5000, 49)  # 12 pages; checkpoints every 4 pages
    run(a, p)
    a.flush(10)
    st = a.stats()
    assert st["l1_to_l2_swa_pages"] == 12  # dense retention: L2 gets every SWA page
    assert st["l3_write_pages_ok"] < 12 + 12  # but L3 only the anchored SWA pages
    a.close()
    b = make(l1_pages=60, l3=url, checkpoint=16)
    q = np.concatenate([p[:40], rng.integers(0, 5000, 9)])  # diverges inside page 10
    r = run(b, q)
    assert r["hit"] == 32 and r["l3_hit_tokens"] == 32  # page 8 = checkpoint at 32 tokens
    b.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_window_that_ends_a_hit_reaches_l3(tmp_path, policy):
    """A shared prefix whose window is no request's tail nor a checkpoint: once a
    hit ends there, its SWA window is anchored and written to L3, so after L1
    and L2 are emptied L3 alone serves the prefix (write-through used to keep
    that window in L2 only: 0 L3 hit tokens in ``hybridkv verify``)."""
    from hybridkv.eval.tier_verify import flush_l2
    cache = TieredCache(SPEC, CacheConfig(budget_bytes=60 * (FPB + SPB), device="cpu", retention="dense"),
                        tiers=TierConfig(l2_bytes=200 * (FPB + SPB), l3=f"file://{tmp_path / 'l3'}",
                                         write_policy=policy))
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 5000, 32)  # 8 pages; every prompt continues past its window
    a, b, c = (np.concatenate([prefix, rng.integers(0, 5000, 25)]) for _ in range(3))
    run(cache, a)
    assert run(cache, b)["hit"] == 32  # from L1: the hit ends at the shared prefix
    cache.tree.evict(full_pages=cache.tree.evictable_full_pages(), swa_pages=cache.tree.evictable_swa_pages())
    assert cache.flush(10)
    flush_l2(cache)
    r = run(cache, c)
    assert r["hit"] == 32 and r["l3_hit_tokens"] == 32
    st = cache.stats()
    assert st["tier_errors"] == 0 and st["l3_backend_corrupt"] == 0
    cache.close()

def test_l3_down_degrades_to_l1_l2(caplog):
    from .conftest import free_port
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'hybridkv[redis]')")
    url = f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=0.2&socket_timeout=0.2"
    cache = make(l3=url, l3_timeout_s=2.0)
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, 5000, 41) for _ in range(4)]
    with caplog.at_level(logging.WARNING):
        res = [run(cache, p) for p in prompts * 2]
    assert [r["hit"] for r in res[4:]] == [40] * 4
    st = cache.stats()
    assert st["tier_errors"] == 0 and (st["l3_backend_errors"] + st["l3_backend_skipped"]) > 0
    cache.close()


def test_tier_config_rejects_bad_arguments():
    with pytest.raises(ValueError, match="l2_bytes"):
        TierConfig(l2_bytes=0)
    with pytest.raises(TypeError, match="l2_bytes"):
        TierConfig(l2_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="write_policy"):
        TierConfig(l2_bytes=10, write_policy="sometimes")
    with pytest.raises(TypeError, match="l3"):
        TierConfig(l2_bytes=10, l3=42)
    with pytest.raises(TypeError, match="tiers"):
        TieredCache(SPEC, CacheConfig(budget_bytes=40 * (FPB + SPB)), tiers=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("copies_first", [True, False])
def test_write_through_l2_gives_up_its_copies_of_l1_pages_first_and_gets_them_back(copies_first):
    """Under write-through L2 holds a copy of what L1 cached; its copies of pages L1
    still holds go first (they cost nothing while L1 keeps them), and when L1 frees
    such a page L2 lacks, it is copied down again (repair case 1), so the prompts hit
    from L2, content-checked, after L1 is emptied.  Without the rule L2 keeps its
    copies and L1's frees copy nothing."""
    cache = make(l1_pages=12, l2_pages=16)
    host = cache.lower_tiers.host
    host.l1_copies_first = copies_first
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 5000, 20)
    prompts = [np.concatenate([shared, rng.integers(0, 5000, 21)]) for _ in range(5)]
    for p in prompts:
        run(cache, p)
    st = cache.stats()
    assert (st["l2_evicted_l1_copy_pages"] > 0) == copies_first
    down = st["l1_to_l2_full_pages"]
    cache.tree.evict(full_pages=cache.tree.evictable_full_pages(), swa_pages=cache.tree.evictable_swa_pages())
    cache.check_invariants()
    assert (cache.stats()["l1_to_l2_full_pages"] > down) == copies_first
    assert run(cache, prompts[-1])["hit"] == 40  # from L2, content-checked by run()


@pytest.mark.parametrize("backup", [True, False])
def test_repair_device_swa_backed_up_when_l1_frees_it_under_write_back(monkeypatch, backup):
    """Case 1 (write-back), the L1-free trigger (``L2Backup.on_l1_free``): L2 holds a prefix's
    full KV but not its SWA; when the L1 tree evicts the SWA pages (full KV stays in L1) they
    are copied to L2 before the pool hands them out again, so once L1 is emptied the prompt
    hits whole from L2, content-checked by run() (L1's bytes zeroed first: L2's copies serve it).
    With the trigger a no-op for SWA (``backup=False``) L2 never gets the window: no hit."""
    from hybridkv.tiers.backup import L2Backup

    if not backup:
        real = L2Backup.on_l1_free
        monkeypatch.setattr(L2Backup, "on_l1_free", lambda self, kind, pages, names:
                            None if kind is AttnKind.SWA else real(self, kind, pages, names))
    cache = make(l1_pages=40, policy="write_back")
    p = np.random.default_rng(13).integers(0, 5000, 33)
    run(cache, p)
    keys = cache._page_keys(p, "default", 8)
    swa_keys = [swa_key(k) for k in keys]
    node = next(iter(cache.tree.iter_nodes()))
    cache.lower_tiers.backup.store_l2(AttnKind.FULL, np.array([node.full[i] for i in range(8)]), keys, None)
    assert (cache.host.lookup_full(keys) >= 0).all() and (cache.host.lookup_swa(swa_keys) < 0).all()
    before = cache.stats()
    cache.tree.evict(swa_pages=cache.tree.evictable_swa_pages())  # L1 frees the window, keeps the full KV
    assert cache.tree.swa_pages_cached == 0 and cache.tree.full_pages_cached > 0
    have = cache.host.lookup_swa(swa_keys) >= 0
    assert have[-SPEC.window_pages:].all() == backup and have.any() == backup
    down = cache.stats()["l1_to_l2_swa_pages"] - before["l1_to_l2_swa_pages"]
    assert (down >= SPEC.window_pages) == backup and (down == 0) != backup
    cache.tree.evict(full_pages=cache.tree.evictable_full_pages())
    assert cache.tree.full_pages_cached == 0
    for kb in (cache.pool.buffers.full, cache.pool.buffers.swa):  # L1's bytes are gone: only L2's copies are left
        kb.k.zero_()
        kb.v.zero_()
    r = run(cache, p)
    assert r["hit"] == 32 * backup and r["l2_hit_tokens"] == 32 * backup
    assert cache.stats()["tier_errors"] == 0

"""Chained page keys: prefix identity, isolation by namespace / model / kind, bad input."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from hybridkv.tiers.keys import KEY_BYTES, key_hex, model_fingerprint, page_keys

FP = model_fingerprint("mimo-v2.5|FSSSS|W128|bf16|P64", "full")


def _reference(tokens: np.ndarray, page: int, namespace: str, fingerprint: str) -> list[bytes]:
    """Independent spelling of the documented construction."""
    def lp(b: bytes) -> bytes:
        return len(b).to_bytes(8, "little") + b
    prev = hashlib.blake2b(b"seed" + lp(namespace.encode()) + lp(fingerprint.encode()),
                           digest_size=16, person=b"hybridkv-page").digest()
    out = []
    for i in range(len(tokens) // page):
        chunk = tokens[i * page:(i + 1) * page].astype("<i4").tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16, person=b"hybridkv-page").digest()
        out.append(prev)
    return out


def test_matches_documented_construction():
    t = np.random.default_rng(0).integers(0, 150_000, 1000).astype(np.int64)
    keys = page_keys(t, 64, namespace="tenant-a", fingerprint=FP)
    assert keys == _reference(t, 64, "tenant-a", FP)
    assert len(keys) == 1000 // 64 and all(len(k) == KEY_BYTES for k in keys)


def test_only_full_pages_and_prefix_sharing():
    a = np.arange(300, dtype=np.int32)
    b = a.copy()
    b[200] = 7  # diverge inside page 3
    ka = page_keys(a, 64, namespace="n", fingerprint=FP)
    kb = page_keys(b, 64, namespace="n", fingerprint=FP)
    assert len(ka) == 4  # 300 // 64; the partial tail page has no key
    assert ka[:3] == kb[:3] and ka[3] != kb[3]
    # chained: the same page content after a different prefix gets another key
    c = np.concatenate([np.full(64, 9, np.int32), a[64:128]])
    assert page_keys(c, 64, namespace="n", fingerprint=FP)[1] != ka[1]


def test_dtype_int32_and_int64_agree():
    t = np.arange(256)
    assert page_keys(t.astype(np.int32), 64, namespace="n", fingerprint=FP) == \
        page_keys(t.astype(np.int64), 64, namespace="n", fingerprint=FP)


def test_namespace_fingerprint_and_kind_isolate():
    t = np.arange(128, dtype=np.int32)
    base = page_keys(t, 64, namespace="a", fingerprint=FP)
    assert page_keys(t, 64, namespace="b", fingerprint=FP)[0] != base[0]
    other_model = model_fingerprint("gemma-3-27b|...|P64", "full")
    assert page_keys(t, 64, namespace="a", fingerprint=other_model)[0] != base[0]
    swa = model_fingerprint("mimo-v2.5|FSSSS|W128|bf16|P64", "swa")
    assert swa != FP and page_keys(t, 64, namespace="a", fingerprint=swa)[0] != base[0]
    # length-prefixed seed: ("ab","c") and ("a","bc") differ
    assert page_keys(t, 64, namespace="ab", fingerprint="c") != page_keys(t, 64, namespace="a", fingerprint="bc")


def test_model_fingerprint_of_mappings_is_canonical():
    d1 = {"layers": "FSSS", "heads": {"full": 4, "swa": 8}, "dtype": "bf16"}
    d2 = {"dtype": "bf16", "heads": {"swa": 8, "full": 4}, "layers": "FSSS"}
    assert model_fingerprint(d1, "swa") == model_fingerprint(d2, "SWA")
    assert model_fingerprint(d1, "swa").startswith("swa:")
    assert model_fingerprint(d1, "swa") != model_fingerprint({**d1, "dtype": "fp8"}, "swa")


def test_parent_extends_the_chain():
    t = np.arange(64 * 7, dtype=np.int32)
    keys = page_keys(t, 64, namespace="n", fingerprint=FP)
    tail = page_keys(t[3 * 64:], 64, namespace="n", fingerprint=FP, parent=keys[2])
    assert tail == keys[3:]


def test_key_hex():
    assert key_hex(b"\x00\xff") == "00ff"
    with pytest.raises(TypeError, match="key"):
        key_hex("00ff")  # type: ignore[arg-type]


@pytest.mark.parametrize("tokens, page, exc, word", [
    ([1, 2, 3], 1, TypeError, "tokens"),
    (np.zeros((2, 64), np.int32), 64, ValueError, "tokens"),
    (np.zeros(64, np.float32), 64, TypeError, "tokens"),
    (np.zeros(64, np.uint16), 64, TypeError, "tokens"),
    (np.array([1, -5], np.int64), 1, ValueError, "tokens"),
    (np.array([2**31], np.int64), 1, ValueError, "tokens"),
    (np.zeros(64, np.int32), 0, ValueError, "page_size"),
    (np.zeros(64, np.int32), 2.0, TypeError, "page_size"),
])
def test_bad_input(tokens, page, exc, word):
    with pytest.raises(exc, match=word):
        page_keys(tokens, page, namespace="n", fingerprint=FP)


def test_bad_names_and_parent():
    t = np.zeros(64, np.int32)
    with pytest.raises(TypeError, match="namespace"):
        page_keys(t, 64, namespace=None, fingerprint=FP)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fingerprint"):
        page_keys(t, 64, namespace="n", fingerprint=b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parent"):
        page_keys(t, 64, namespace="n", fingerprint=FP, parent=b"short")
    with pytest.raises(ValueError, match="kind"):
        model_fingerprint("x", "local")
    with pytest.raises(TypeError, match="description"):
        model_fingerprint(42, "full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="description"):
        model_fingerprint("", "full")


def test_does_not_mutate_tokens():
    t = np.arange(128, dtype=np.int64)
    before = t.copy()
    page_keys(t, 64, namespace="n", fingerprint=FP)
    assert np.array_equal(t, before)

"""Chained page keys for L2/L3 storage.

A page key names the *prefix* that ends with that page, not the page alone:
two sequences share key ``i`` iff they share their first ``(i + 1) * page_size``
tokens, the same namespace (tenant / cache salt) and the same model
fingerprint.  That is what makes a stored page reusable: KV of a token depends
on every token before it.

Construction (BLAKE2b, 16-byte digests, ``person=b"hybridkv-page"`` for domain
separation)::

    seed = H(b"seed" || len(namespace) || namespace || len(fingerprint) || fingerprint)
    h_0  = H(seed || page_0 as little-endian int32)
    h_i  = H(h_{i-1} || page_i as little-endian int32)

Keys are raw ``bytes`` of :data:`KEY_BYTES` bytes (use :func:`key_hex` for a
printable form).  Only full pages get keys: a trailing partial page has none.

The full-attention value and the SWA value of the same page are different
objects in storage, so they must have different keys: pass a per-kind
fingerprint from :func:`model_fingerprint` (``kind="full"`` or ``"swa"``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import numpy as np

from .._validate import check_int
from ..radix.types import parent_keys  # the chain's parent links (PageNames uses it too)

__all__ = ["KEY_BYTES", "KINDS", "page_keys", "parent_keys", "model_fingerprint", "key_hex"]

#: Length of every page key in bytes (BLAKE2b digest size).  128 bits keeps
#: the birthday bound far beyond any cache size (2**64 pages).
KEY_BYTES = 16
#: Accepted values of ``kind`` in :func:`model_fingerprint`.
KINDS = ("full", "swa")
_PERSON = b"hybridkv-page"  # BLAKE2b personalisation: keys never collide with other blake2b uses
_INT32_MAX = np.iinfo(np.int32).max


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes, so ("ab", "c") and ("a", "bc") seed differently."""
    return len(data).to_bytes(8, "little") + data


def _check_str(name: str, value: object) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value.encode("utf-8")


def _seed(namespace: str, fingerprint: str) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    h.update(b"seed")
    h.update(_lp(_check_str("namespace", namespace)))
    h.update(_lp(_check_str("fingerprint", fingerprint)))
    return h.digest()


def _token_bytes(tokens: object) -> memoryview:
    """Validate ``tokens`` and return them as little-endian int32 bytes."""
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"tokens must be a numpy.ndarray, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"tokens must have dtype int32 or int64, got {tokens.dtype}")
    if tokens.size:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0:
            raise ValueError(f"tokens must be non-negative token ids, found {lo}")
        if hi > _INT32_MAX:
            raise ValueError(f"tokens must fit in int32, found {hi}")
    # One vectorised conversion; per-page slices below are views, not copies.
    return memoryview(np.ascontiguousarray(tokens, dtype="<i4")).cast("B")


def page_keys(tokens: np.ndarray, page_size: int, *, namespace: str, fingerprint: str,
              parent: bytes | None = None) -> list[bytes]:
    """Chained keys of every full page of ``tokens``.

    Args:
        tokens: 1-D ``int32`` or ``int64`` array of non-negative token ids (< 2**31).
        page_size: tokens per page (>= 1).
        namespace: tenant / cache salt; different namespaces never share a key.
        fingerprint: model (and KV kind) fingerprint, see :func:`model_fingerprint`.
        parent: key of the page that precedes ``tokens[0]``, to extend a chain
            computed earlier: ``page_keys(t[k*P:], P, ..., parent=keys[k-1])``
            equals ``page_keys(t, P, ...)[k:]``.  The parent already carries
            its namespace and fingerprint, so those two arguments are then only
            validated.  ``None`` starts a new chain.

    Returns:
        ``len(tokens) // page_size`` keys of :data:`KEY_BYTES` bytes each; key
        ``i`` identifies ``tokens[: (i + 1) * page_size]`` (plus ``parent``).

    Does not mutate ``tokens``.  Complexity: O(len(tokens)) bytes hashed, one
    hashlib call per page.
    """
    page_size = check_int(page_size, "page_size", 1)
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
        raise ValueError(f"parent must be None or a {KEY_BYTES}-byte key")
    data = _token_bytes(tokens)
    seed = _seed(namespace, fingerprint)  # validates namespace/fingerprint even when unused
    prev = seed if parent is None else parent
    stride = int(page_size) * 4
    n_pages = len(data) // stride
    keys: list[bytes] = []
    for i in range(n_pages):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=_PERSON)
        h.update(data[i * stride:(i + 1) * stride])
        prev = h.digest()
        keys.append(prev)
    return keys


def key_hex(key: bytes) -> str:
    """Printable lowercase hex form of a key (``2 * len(key)`` characters)."""
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    return bytes(key).hex()


def model_fingerprint(description: str | Mapping[str, Any], kind: str) -> str:
    """Fingerprint of a model's stored KV layout for one attention ``kind``.

    Args:
        description: a string (e.g. ``ModelSpec.fingerprint()``: layer kinds,
            heads, dims, dtype, page size) or a JSON-serialisable mapping of the
            same facts; mappings are canonicalised (sorted keys), so key order
            does not matter.
        kind: ``"full"`` or ``"swa"``; the two kinds of the same model get
            different fingerprints, hence different page keys.

    Returns:
        ``"<kind>:<32 hex chars>"``.  Pure function, O(len(description)).
    """
    if isinstance(description, str):
        canon = description
    elif isinstance(description, Mapping):
        try:
            canon = json.dumps(description, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"description must be JSON-serialisable: {exc}") from None
    else:
        raise TypeError(f"description must be a str or a mapping, got {type(description).__name__}")
    if not canon:
        raise ValueError("description must not be empty")
    if not isinstance(kind, str) or kind.lower() not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    kind = kind.lower()
    h = hashlib.blake2b(digest_size=16, person=b"hybridkv-model")
    h.update(_lp(kind.encode()))
    h.update(_lp(canon.encode("utf-8")))
    return f"{kind}:{h.hexdigest()}"

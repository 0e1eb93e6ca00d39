"""A real L3 backend with injected faults: delays, exceptions (test helper)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any


class FaultyBackend:
    """Delegates to ``inner``; ``delay[op]`` seconds before an op, ``fail`` ops raise.

    Records calls per op and the threads they ran on.  Ops: exists, get, put, touch.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.delay: dict[str, float] = {}
        self.fail: set[str] = set()
        self.calls: Counter = Counter()
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _op(self, name: str, fn: Any, *args: Any) -> Any:
        with self._lock:
            self.calls[name] += 1
            self.threads.add(threading.current_thread().name)
        d = self.delay.get(name, 0.0)
        if d:
            time.sleep(d)
        if name in self.fail:
            raise RuntimeError(f"injected {name} fault")
        return fn(*args)

    def exists(self, keys):  # noqa: ANN001, ANN201
        return self._op("exists", self.inner.exists, keys)

    def get(self, keys):  # noqa: ANN001, ANN201
        return self._op("get", self.inner.get, keys)

    def put(self, keys, values):  # noqa: ANN001, ANN201
        return self._op("put", self.inner.put, keys, values)

    def touch(self, keys):  # noqa: ANN001, ANN201
        return self._op("touch", self.inner.touch, keys)


class Probed(FaultyBackend):
    """A :class:`FaultyBackend` that remembers every key ``exists`` was asked about."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.asked: list[bytes] = []

    def exists(self, keys):  # noqa: ANN001, ANN201
        with self._lock:
            self.asked += list(keys)
        return super().exists(keys)

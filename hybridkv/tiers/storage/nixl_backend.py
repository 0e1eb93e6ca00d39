"""NIXL POSIX L3 backend: page files written and read by NIXL transfers.

URL: ``nixl+posix:///abs/dir`` or ``nixl+posix:rel/dir`` (options as for the
file backend, plus ``agent_name``).

The directory layout, atomic publish (temp file + ``os.replace``), LRU index,
size cap and verification are the :class:`.FileBackend`'s; only the data
movement differs: each write registers the header and payload memory (DRAM)
and the open temp file (FILE) with a local NIXL agent that has the POSIX
backend, posts one WRITE transfer of both descriptors and waits for it; reads
post one READ transfer that scatters the header into a scratch area and the
payload straight into the caller's buffer (zero-copy :meth:`get_into`).  This
is the path a GDS-capable deployment would take with ``backends=["GDS"]`` and
device memory; on CPU the POSIX plugin moves DRAM <-> file.

Registrations are per call (cheap for POSIX: ~0.1 ms) and the agent is
serialised by a lock.  A transfer that reports ``ERR`` (e.g. a short file) or
does not finish within ``xfer_timeout_s`` raises inside the backend and
becomes a counted miss.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import numpy as np

from .file_backend import FileBackend
from .framing import HEADER_SIZE

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as exc:  # pragma: no cover - optional dependency
    raise ImportError("the nixl backend needs NIXL: pip install 'hybridkv[nixl]'") from exc

__all__ = ["NixlPosixBackend"]

_agent_ids = itertools.count()


def _addr(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class NixlPosixBackend(FileBackend):
    """File-per-page store whose I/O goes through a NIXL agent (POSIX plugin).

    Args:
        root: directory (created if missing).
        agent_name: NIXL agent name (default: unique per process and object).
        xfer_timeout_s: seconds to wait for one transfer before it is a fault.
        **opts: :class:`.FileBackend` options (``max_bytes``, ``fsync``, breaker...).
    """

    scheme = "nixl+posix"
    zero_copy = True

    def __init__(self, root: str | os.PathLike[str], *, agent_name: str | None = None,
                 xfer_timeout_s: float = 10.0, **opts: Any) -> None:
        name = agent_name or f"hybridkv-{os.getpid()}-{next(_agent_ids)}"
        if not isinstance(name, str):
            raise TypeError(f"agent_name must be a str, got {type(name).__name__}")
        self._agent_lock = threading.Lock()
        self._agent = nixl_agent(name, nixl_agent_config(backends=["POSIX"]))
        if "POSIX" not in getattr(self._agent, "backends", {"POSIX": None}):
            raise RuntimeError("NIXL could not instantiate its POSIX backend")
        self.agent_name = name
        self._xfer_timeout = float(xfer_timeout_s)
        super().__init__(root, **opts)

    def _xfer(self, op: str, fd: int, views: list[memoryview]) -> int:
        """One NIXL transfer between ``views`` (DRAM) and ``fd`` from offset 0."""
        views = [v for v in views if v.nbytes]
        if not views:
            return 0
        dram = [(_addr(v), v.nbytes, 0) for v in views]
        offsets = np.concatenate(([0], np.cumsum([v.nbytes for v in views])[:-1])).tolist()
        files = [(int(o), v.nbytes, fd) for o, v in zip(offsets, views)]
        agent = self._agent
        with self._agent_lock:
            dreg = agent.register_memory([(a, n, d, "") for a, n, d in dram], "DRAM")
            try:
                freg = agent.register_memory([(0, sum(v.nbytes for v in views), fd, "")], "FILE")
                try:
                    handle = agent.initialize_xfer(op, agent.get_xfer_descs(dram, "DRAM"),
                                                   agent.get_xfer_descs(files, "FILE"), self.agent_name)
                    try:
                        self._wait(handle)
                    finally:
                        agent.release_xfer_handle(handle)
                finally:
                    agent.deregister_memory(freg)
            finally:
                agent.deregister_memory(dreg)
        return sum(v.nbytes for v in views)

    def _wait(self, handle: Any) -> None:
        state = self._agent.transfer(handle)
        deadline = time.monotonic() + self._xfer_timeout
        while state != "DONE":
            state = self._agent.check_xfer_state(handle)
            if state == "ERR":
                raise OSError("NIXL transfer failed")
            if state != "DONE" and time.monotonic() > deadline:
                raise TimeoutError(f"NIXL transfer did not finish in {self._xfer_timeout} s")

    # ---------------------------------------------------------- FileBackend I/O
    def _write_file(self, fd: int, header: bytes, payload: memoryview) -> None:
        # NIXL reads from registered memory: make the header a stable buffer.
        self._xfer("WRITE", fd, [memoryview(bytearray(header)), payload])

    def _read_framed(self, fd: int, header: memoryview, payload: memoryview) -> tuple[int, int | None]:
        # One transfer scatters header and payload; the base hashes the payload after.
        got = self._read_file(fd, [header, payload])
        return max(0, got - HEADER_SIZE), None

    def _read_file(self, fd: int, views: list[memoryview]) -> int:
        size = os.fstat(fd).st_size
        want, left = [], size
        for v in views:  # never ask NIXL for bytes past EOF (that is an I/O error)
            take = min(v.nbytes, left)
            if take:
                want.append(v[:take])
            left -= take
        return self._xfer("READ", fd, want)

    def _close(self) -> None:
        super()._close()
        self._agent = None

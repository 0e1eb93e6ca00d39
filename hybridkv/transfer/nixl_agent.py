"""NIXL transfer agent: move KV pages between processes (P->D, remote host pools).

Each process wraps its pools (the per-kind ``k``/``v`` tensors of the fixed
layout) in a :class:`NixlPageAgent`.  The agents swap a small JSON "info"
record over a loopback TCP socket (NIXL agent metadata, base64, plus the
address layout of every pool), after which either side can ``write_pages``
into or ``read_pages`` from the other with one-sided NIXL transfers (UCX on
CPU memory, or GPU memory where UCX has CUDA support).

Nothing received from a peer is unpickled: the info record is JSON, and the
remote descriptor lists are rebuilt locally from the peer's layout (so
NIXL's pickle-based descriptor serialisation is never used).

Descriptors: one (address, length) per page run (page x layer x K/V), with
runs that are adjacent on both sides merged, so contiguous page ranges
move as one descriptor.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from . import _layout as L

log = logging.getLogger(__name__)

INFO_VERSION = 1
_MAX_INFO_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorLayout:
    """Where one pool tensor lives: the numbers a peer needs to address pages."""

    addr: int
    layer_stride: int  # bytes
    run_bytes: int  # bytes of one page of one layer
    nbytes: int
    dev_id: int
    mem: str  # "DRAM" | "VRAM"


@dataclass(frozen=True)
class PoolLayout:
    """Layout of one kind's (k, v) pool as exchanged with peers."""

    layers: int
    num_pages: int
    heads: int
    k_dim: int
    v_dim: int
    dtype: str
    k: TensorLayout
    v: TensorLayout

    def geometry(self) -> tuple:
        return (self.layers, self.heads, self.k_dim, self.v_dim, self.dtype)


def _tensor_layout(t: torch.Tensor, page_size: int) -> TensorLayout:
    es = t.element_size()
    return TensorLayout(
        addr=t.data_ptr(), layer_stride=t.stride(0) * es,
        run_bytes=page_size * t.shape[2] * t.shape[3] * es,
        nbytes=t.numel() * es, dev_id=max(t.get_device(), 0),
        mem="VRAM" if t.device.type == "cuda" else "DRAM",
    )


def _pool_from_json(d: Mapping[str, Any]) -> PoolLayout:
    return PoolLayout(
        **{k: d[k] for k in ("layers", "num_pages", "heads", "k_dim", "v_dim", "dtype")},
        k=TensorLayout(**d["k"]), v=TensorLayout(**d["v"]),
    )


def run_descriptors(local: PoolLayout, remote: PoolLayout, local_pages: np.ndarray,
                    remote_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 ``(addr, len, dev)`` uint64 arrays for both sides, adjacent runs merged.

    Entry order is (tensor, layer, page).  O(n * layers), vectorised.
    """
    loc, rem, lens = [], [], []
    for lt, rt in ((local.k, remote.k), (local.v, remote.v)):
        layers = np.arange(local.layers, dtype=np.int64)[:, None]
        loc.append((lt.addr + layers * lt.layer_stride
                    + local_pages[None, :] * lt.run_bytes).ravel())
        rem.append((rt.addr + layers * rt.layer_stride
                    + remote_pages[None, :] * rt.run_bytes).ravel())
        lens.append(np.full(loc[-1].size, lt.run_bytes, dtype=np.int64))
    la, ra, ln = (np.concatenate(x) if x else np.empty(0, np.int64) for x in (loc, rem, lens))
    if la.size == 0:
        empty = np.empty((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    # A run starts a new descriptor unless it continues the previous one on
    # both sides (same tensor pair guaranteed by equal run lengths + adjacency).
    cont = np.zeros(la.size, dtype=bool)
    cont[1:] = (la[1:] == la[:-1] + ln[:-1]) & (ra[1:] == ra[:-1] + ln[:-1])
    starts = np.flatnonzero(~cont)
    merged_len = np.add.reduceat(ln, starts)

    def table(addrs: np.ndarray, dev: int) -> np.ndarray:
        out = np.empty((starts.size, 3), dtype=np.uint64)
        out[:, 0] = addrs[starts].astype(np.uint64)
        out[:, 1] = merged_len.astype(np.uint64)
        out[:, 2] = dev
        return out

    return table(la, local.k.dev_id), table(ra, remote.k.dev_id)


def prepare_ucx_env() -> None:
    """Keep UCX's InfiniBand module out on hosts without RDMA devices.

    Why: with libibverbs installed but no IB device, the IB module of the
    UCX bundled in the nixl 1.5.1 wheels loads libnl-route, whose library
    destructor segfaults at process exit (exit code 139 after all work
    succeeded).  Without devices the module has nothing to offer, so it is
    excluded via ``UCX_MODULES=^ib``; an explicit ``UCX_MODULES`` wins.
    """
    if "UCX_MODULES" in os.environ:
        return
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib) and os.listdir(ib):
        return
    os.environ["UCX_MODULES"] = "^ib"
    log.debug("no RDMA devices: set UCX_MODULES=^ib")


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the metadata connection early")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    if n > _MAX_INFO_BYTES:
        raise ValueError(f"peer info of {n} bytes exceeds the {_MAX_INFO_BYTES} byte limit")
    return _recv_exact(sock, n)


class NixlPageAgent:
    """A NIXL agent that owns registered KV pools and moves pages with peers.

    Args:
        name: unique agent name (peers address each other by it).
        pools: ``{kind: (k, v)}`` tensors in the fixed layout; each tensor must
            be contiguous (it is registered as one region).
        page_size: tokens per page (equal on both sides).
        backends: NIXL backends to create (default UCX).

    Thread-safe: calls into NIXL are serialised by a lock.
    """

    def __init__(self, name: str, pools: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 page_size: int, *, backends: Sequence[str] = ("UCX",)) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty string")
        if not isinstance(pools, Mapping) or not pools:
            raise ValueError("pools must be a non-empty mapping kind -> (k, v)")
        self.page_size = L.check_page_size(page_size)
        self.name = name
        self._pools: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layouts: dict[str, PoolLayout] = {}
        for kind, pair in pools.items():
            self._layouts[kind] = self._check_pool(kind, pair)
            self._pools[kind] = (pair[0], pair[1])
        from nixl._api import nixl_agent, nixl_agent_config  # optional dependency

        prepare_ucx_env()  # before the agent loads its UCX plugin
        self._lock = threading.RLock()
        self._agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self._reg = [self._agent.register_memory([t]) for p in self._pools.values() for t in p]
        self._peers: dict[str, dict[str, PoolLayout]] = {}
        self._server: Optional[socket.socket] = None
        self._server_thread: Optional[threading.Thread] = None
        self._closed = False

    def _check_pool(self, kind: str, pair: object) -> PoolLayout:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"pools[{kind!r}] must be a (k, v) pair")
        k, v = pair
        g = L.check_kv(k, v, f"pools[{kind!r}].")
        num_pages = L.check_slots(g, self.page_size, f"pools[{kind!r}].k")
        for t, n in ((k, "k"), (v, "v")):
            if not t.is_contiguous():
                raise ValueError(f"pools[{kind!r}].{n} must be contiguous to be registered")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"pools[{kind!r}].{n} is on {t.device}; need cpu or cuda")
        return PoolLayout(g.num_layers, num_pages, g.heads, g.k_dim, g.v_dim, str(g.dtype),
                          _tensor_layout(k, self.page_size), _tensor_layout(v, self.page_size))

    # -- metadata exchange ---------------------------------------------------
    def local_info(self) -> bytes:
        """JSON record a peer needs: agent metadata + pool layouts.  O(pools)."""
        with self._lock:
            md = self._agent.get_agent_metadata()
        pools = {kind: {**{f: getattr(p, f) for f in ("layers", "num_pages", "heads",
                                                    "k_dim", "v_dim", "dtype")},
                        "k": p.k.__dict__, "v": p.v.__dict__}
                 for kind, p in self._layouts.items()}
        return json.dumps({"version": INFO_VERSION, "name": self.name,
                           "page_size": self.page_size, "pools": pools,
                           "metadata": base64.b64encode(md).decode("ascii")}).encode()

    def add_peer(self, info: bytes) -> str:
        """Load a peer's info record; returns its agent name.

        Raises ``ValueError`` if the record is malformed or a pool of a kind
        both sides have differs in geometry or page size.
        """
        try:
            rec = json.loads(info)
            if rec.get("version") != INFO_VERSION:
                raise ValueError(f"unsupported info version {rec.get('version')!r}")
            peer_pools = {k: _pool_from_json(p) for k, p in rec["pools"].items()}
            md = base64.b64decode(rec["metadata"], validate=True)
            page_size = int(rec["page_size"])
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            # ValueError covers bad JSON, bad base64 and the version check.
            raise ValueError(f"info is not a valid peer record: {exc}") from exc
        if page_size != self.page_size:
            raise ValueError(f"peer page_size {page_size} differs from ours {self.page_size}")
        for kind, pool in peer_pools.items():
            mine = self._layouts.get(kind)
            if mine is not None and mine.geometry() != pool.geometry():
                raise ValueError(f"peer pool {kind!r} geometry {pool.geometry()} differs "
                                 f"from ours {mine.geometry()}")
        with self._lock:
            name = self._agent.add_remote_agent(md)
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = peer_pools
        return name

    def serve_info(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Answer info exchanges on ``host:port`` in a thread; returns the port.

        Each connection: receive the peer's info, register it, send ours.
        """
        if self._server is not None:
            raise RuntimeError("serve_info() already running")
        srv = socket.create_server((host, port))
        srv.settimeout(0.2)
        self._server = srv
        self._server_thread = threading.Thread(target=self._serve, args=(srv,),
                                               name=f"nixl-info-{self.name}", daemon=True)
        self._server_thread.start()
        return int(srv.getsockname()[1])

    def _serve(self, srv: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(10.0)
                    self.add_peer(_recv_frame(conn))
                    _send_frame(conn, self.local_info())
                except Exception as exc:  # a bad peer must not kill the server
                    log.warning("NIXL info exchange failed: %s", exc)

    def connect(self, host: str, port: int, timeout: float = 10.0) -> str:
        """Exchange info with a peer's :meth:`serve_info`; returns its name."""
        with socket.create_connection((host, port), timeout=timeout) as sock:
            _send_frame(sock, self.local_info())
            return self.add_peer(_recv_frame(sock))

    # -- transfers ----------------------------------------------------------
    def write_pages(self, peer: str, kind: str, local_pages: L.PageIndex,
                    remote_pages: L.PageIndex, *, notif: bytes = b"",
                    timeout: float = 30.0) -> int:
        """Write local pages ``local_pages[i]`` into the peer's ``remote_pages[i]``.

        All layers, K and V, of pool ``kind``.  Returns bytes moved.  Blocks
        until done; ``notif`` reaches the peer after the data.  Raises
        ``RuntimeError`` on transfer failure or timeout.
        """
        return self._xfer("WRITE", peer, kind, local_pages, remote_pages, notif, timeout)

    def read_pages(self, peer: str, kind: str, local_pages: L.PageIndex,
                   remote_pages: L.PageIndex, *, notif: bytes = b"",
                   timeout: float = 30.0) -> int:
        """Read the peer's ``remote_pages[i]`` into local ``local_pages[i]``."""
        return self._xfer("READ", peer, kind, local_pages, remote_pages, notif, timeout)

    def _plan(self, op: str, peer: str, kind: str, local_pages: L.PageIndex,
              remote_pages: L.PageIndex) -> tuple[np.ndarray, np.ndarray, PoolLayout, PoolLayout]:
        if peer not in self._peers:
            raise ValueError(f"peer {peer!r} is unknown; connect() or add_peer() first")
        if kind not in self._layouts or kind not in self._peers[peer]:
            raise ValueError(f"kind {kind!r} is not a pool on both sides")
        mine, theirs = self._layouts[kind], self._peers[peer][kind]
        li = L.as_index(local_pages, "local_pages")
        ri = L.as_index(remote_pages, "remote_pages")
        if li.numel() != ri.numel():
            raise ValueError(f"local_pages has {li.numel()} entries but remote_pages "
                             f"has {ri.numel()}")
        L.check_range(li, mine.num_pages, "local_pages")
        L.check_range(ri, theirs.num_pages, "remote_pages")
        L.check_unique(ri if op == "WRITE" else li,
                       "remote_pages" if op == "WRITE" else "local_pages")
        loc, rem = run_descriptors(mine, theirs, li.numpy(), ri.numpy())
        return loc, rem, mine, theirs

    def _xfer(self, op: str, peer: str, kind: str, local_pages: L.PageIndex,
              remote_pages: L.PageIndex, notif: bytes, timeout: float) -> int:
        loc, rem, mine, theirs = self._plan(op, peer, kind, local_pages, remote_pages)
        if loc.shape[0] == 0:
            return 0
        with self._lock:
            ldesc = self._agent.get_xfer_descs(loc, mine.k.mem)
            rdesc = self._agent.get_xfer_descs(rem, theirs.k.mem)
            handle = self._agent.initialize_xfer(op, ldesc, rdesc, peer, notif)
        try:
            deadline = time.monotonic() + timeout
            with self._lock:
                state = self._agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL {op} of {loc.shape[0]} runs to {peer!r} "
                                       f"timed out after {timeout} s")
                time.sleep(0.0002)
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} to {peer!r} failed (state {state})")
        finally:
            with self._lock:
                self._agent.release_xfer_handle(handle)
        return int(loc[:, 1].sum())

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a standalone notification to ``peer`` (ordered after earlier writes)."""
        if peer not in self._peers:
            raise ValueError(f"peer {peer!r} is unknown; connect() or add_peer() first")
        with self._lock:
            self._agent.send_notif(peer, msg)

    @property
    def peers(self) -> list[str]:
        """Names of the peers whose info has been loaded."""
        return list(self._peers)

    def layout(self, kind: str) -> PoolLayout:
        """The exchanged layout of local pool ``kind``."""
        if kind not in self._layouts:
            raise ValueError(f"kind {kind!r} is not a local pool")
        return self._layouts[kind]

    def wait_notif(self, peer: str, tag: bytes, timeout: float = 30.0) -> bytes:
        """Block until a notification from ``peer`` starting with ``tag`` arrives."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                notifs = self._agent.update_notifs()
                for msg in notifs.get(peer, []):
                    if msg.startswith(tag):
                        notifs[peer].remove(msg)
                        return msg
            if time.monotonic() > deadline:
                raise TimeoutError(f"no notification {tag!r} from {peer!r} in {timeout} s")
            time.sleep(0.001)

    def close(self) -> None:
        """Stop the info server, forget peers, deregister memory.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        if self._server_thread is not None:
            self._server_thread.join(timeout=2)
        with self._lock:
            for peer in list(self._peers):
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception as exc:  # peer may already be gone
                    log.debug("remove_remote_agent(%s): %s", peer, exc)
            self._peers.clear()
            for reg in self._reg:
                self._agent.deregister_memory(reg)
            self._reg.clear()

    def __enter__(self) -> "NixlPageAgent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

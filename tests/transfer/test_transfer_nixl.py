"""NIXL agent: two processes on loopback, UCX on CPU memory, bytes checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nixl", reason="nixl not installed (pip install nixl; CI installs it)")

from _transfer_nixl_peer import GEOMETRY, PAGE_SIZE, make_pools, page_bytes  # noqa: E402

from hybridkv.transfer.nixl_agent import NixlPageAgent, run_descriptors  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PEER_SEED, TEST_SEED = 11, 22
# kind -> [(test page, peer page)]: written test -> peer.
WRITES = {"full": [[1, 0], [3, 2], [4, 3], [5, 4], [11, 9]], "swa": [[9, 1], [0, 7]]}
READS = {"full": ([6, 7, 8], [10, 11, 5]), "swa": ([2], [4])}


@pytest.fixture
def peer() -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_transfer_nixl_peer.py"), "--seed", str(PEER_SEED),
         "--verify-seed", str(TEST_SEED), "--pages", json.dumps(WRITES), "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for s in (proc.stdout, proc.stderr):
        if s is not None:
            s.close()


def _read_marker(proc: subprocess.Popen, prefixes: tuple[str, ...],
                 timeout: float = 60.0) -> str:
    """Next stdout line of the peer starting with one of ``prefixes``.

    NIXL logs to stdout too, so other lines are skipped.
    """
    box: list[str] = []

    def scan() -> None:
        for line in proc.stdout:
            if line.startswith(prefixes):
                box.append(line)
                return

    t = threading.Thread(target=scan, daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"peer printed no {prefixes} line (exit code {proc.poll()})"
    return box[0]


def test_write_then_read_pages_between_two_processes(peer: subprocess.Popen) -> None:
    port = int(_read_marker(peer, ("PORT ",)).split()[1])
    pools = make_pools(TEST_SEED)
    peer_pools = make_pools(PEER_SEED)
    with NixlPageAgent("test", pools, PAGE_SIZE) as agent:
        name = agent.connect("127.0.0.1", port)
        assert name == "peer"
        moved = 0
        for kind, pairs in WRITES.items():
            src, dst = zip(*pairs)
            last = kind == list(WRITES)[-1]
            moved += agent.write_pages(name, kind, list(src), list(dst),
                                       notif=b"written" if last else b"")
        layers, _, heads, kd, vd = GEOMETRY["full"]
        assert moved >= len(WRITES["full"]) * layers * PAGE_SIZE * heads * (kd + vd) * 2
        for kind, (local, remote) in READS.items():
            agent.read_pages(name, kind, local, remote)
            for lp, rp in zip(local, remote):
                assert page_bytes(pools, kind, lp) == page_bytes(peer_pools, kind, rp)
        out = _read_marker(peer, ("VERIFY",))
        agent.send_notif(name, b"bye")
    assert out.startswith("VERIFY OK"), out + peer.stderr.read()
    assert peer.wait(timeout=30) == 0


def test_descriptors_merge_adjacent_runs() -> None:
    pools = make_pools(1)
    with NixlPageAgent("merge-check", pools, PAGE_SIZE) as agent:
        lay = agent.layout("full")
        loc, rem = run_descriptors(lay, lay, np.array([2, 3, 4, 9]), np.array([5, 6, 7, 0]))
        layers = GEOMETRY["full"][0]
        # pages 2,3,4 -> 5,6,7 are one run per (tensor, layer); page 9 -> 0 another.
        assert loc.shape == (2 * layers * 2, 3) and rem.shape == loc.shape
        assert int(loc[:, 1].sum()) == 4 * layers * (lay.k.run_bytes + lay.v.run_bytes)
        k = pools["full"][0]
        assert int(loc[0, 0]) == k.data_ptr() + 2 * lay.k.run_bytes
        assert int(rem[0, 0]) == k.data_ptr() + 5 * lay.k.run_bytes


def test_argument_errors() -> None:
    pools = make_pools(2)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        NixlPageAgent("bad", pools, 3)
    with NixlPageAgent("a", pools, PAGE_SIZE) as a, NixlPageAgent("b", pools, PAGE_SIZE) as b:
        with pytest.raises(ValueError, match="peer 'b' is unknown"):
            a.write_pages("b", "full", [0], [0])
        assert a.add_peer(b.local_info()) == "b"
        with pytest.raises(ValueError, match="remote_pages holds page 99"):
            a.write_pages("b", "full", [0], [99])
        with pytest.raises(ValueError, match="remote_pages holds a page more than once"):
            a.write_pages("b", "full", [0, 1], [2, 2])
        with pytest.raises(ValueError, match="kind 'mla'"):
            a.read_pages("b", "mla", [0], [0])
        with pytest.raises(ValueError, match="not a valid peer record"):
            a.add_peer(b"{}")
    other = {"full": (torch.zeros(2, 8, 2, 4, dtype=torch.bfloat16),
                      torch.zeros(2, 8, 2, 4, dtype=torch.bfloat16))}
    with NixlPageAgent("c", pools, PAGE_SIZE) as c, NixlPageAgent("d", other, PAGE_SIZE) as d:
        with pytest.raises(ValueError, match="geometry"):
            c.add_peer(d.local_info())

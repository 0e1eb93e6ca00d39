"""Second process for the NIXL test: owns pools, serves its info, verifies writes.

Run: python _transfer_nixl_peer.py --seed S --verify-seed T --pages JSON
Prints "PORT <n>" once ready; after the "written" notification from the
test agent it checks every written page against the test's pools (rebuilt
from --verify-seed), prints VERIFY OK / VERIFY FAIL and exits 0 / 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from hybridkv.transfer.nixl_agent import NixlPageAgent

PAGE_SIZE = 4
# kind -> (layers, pages, heads, k_dim, v_dim); MiMo-like K/V dims differ.
GEOMETRY = {"full": (2, 12, 2, 12, 8), "swa": (3, 10, 3, 12, 8)}


def make_pools(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic random-bit bf16 pools (same seed -> same bytes)."""
    gen = torch.Generator().manual_seed(seed)
    pools = {}
    for kind, (layers, pages, heads, kd, vd) in GEOMETRY.items():
        ts = []
        for dim in (kd, vd):
            n = layers * pages * PAGE_SIZE * heads * dim * 2
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
            ts.append(raw.view(torch.bfloat16).view(layers, pages * PAGE_SIZE, heads, dim))
        pools[kind] = (ts[0], ts[1])
    return pools


def page_bytes(pools: dict, kind: str, page: int) -> bytes:
    k, v = pools[kind]
    sl = slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE)
    return k[:, sl].contiguous().view(torch.uint8).numpy().tobytes() + \
        v[:, sl].contiguous().view(torch.uint8).numpy().tobytes()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--verify-seed", type=int, required=True)
    ap.add_argument("--pages", required=True, help='{"kind": [[src, dst], ...]}')
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    pools = make_pools(args.seed)
    untouched = {k: {p: page_bytes(pools, k, p) for p in range(GEOMETRY[k][1])} for k in pools}
    expected = make_pools(args.verify_seed)
    plan = json.loads(args.pages)
    with NixlPageAgent("peer", pools, PAGE_SIZE) as agent:
        print(f"PORT {agent.serve_info()}", flush=True)
        deadline = time.monotonic() + args.timeout
        while "test" not in agent.peers and time.monotonic() < deadline:
            time.sleep(0.01)
        agent.wait_notif("test", b"written", timeout=args.timeout)
        bad = []
        written = {k: {d for _, d in pairs} for k, pairs in plan.items()}
        for kind, pairs in plan.items():
            for src, dst in pairs:
                if page_bytes(pools, kind, dst) != page_bytes(expected, kind, src):
                    bad.append(f"{kind} page {dst} != test page {src}")
            for p, before in untouched[kind].items():
                if p not in written[kind] and page_bytes(pools, kind, p) != before:
                    bad.append(f"{kind} page {p} changed but was not written")
        print("VERIFY OK" if not bad else "VERIFY FAIL " + "; ".join(bad), flush=True)
        # Stay until the test has read back from us.
        agent.wait_notif("test", b"bye", timeout=args.timeout)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

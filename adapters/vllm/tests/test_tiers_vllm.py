"""benchmarks/peers/tiers_vllm.py on a tiny synthetic trace: a prompt comes
back after unrelated prompts have pushed it out of the device cache, so its
hit must come from the host tier, in vLLM's own CPU offload (through its real
Scheduler and OffloadingConnector) and in hybridkv's L2 alike."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import tiers_vllm  # noqa: E402
from hybridkv.eval.traces import TraceRequest  # noqa: E402
from hybridkv.spec import AttnKind, KVShape, ModelSpec  # noqa: E402

PAGE = 64
BLOCKS = 17  # hash blocks of 64 tokens per prompt: 1,088 tokens
SPEC = ModelSpec("tiny-hybrid", (AttnKind.FULL, AttnKind.SWA), 128, full=KVShape(1, 128, 128),
                 swa=KVShape(1, 128, 128), page_size=PAGE)
PAGE_BYTES = PAGE * 512  # one layer's page: 64 tokens x 512 bytes (bf16 K + V, 1 head of 128)
DEVICE = 40 * PAGE_BYTES  # 40 pages of one layer: less than the fillers need
HOST = 4000 * PAGE_BYTES  # everything fits


def _trace(fillers: int) -> list[TraceRequest]:
    def req(first: int, t: float) -> TraceRequest:
        return TraceRequest("default", t, BLOCKS * PAGE, 1, tuple(range(first, first + BLOCKS)), PAGE)
    reqs = [req(1, 0.0)]
    reqs += [req(1000 * (k + 1), 1.0 + k) for k in range(fillers)]
    reqs.append(req(1, 10.0))  # the first prompt again
    return reqs


@pytest.fixture(scope="module", autouse=True)
def _own_environment():  # noqa: ANN202
    """The drivers set VLLM_LOGGING_LEVEL=WARNING for their own runs; later tests start
    servers that inherit this process's environment (and must log at INFO): restore it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def vllm_rows() -> dict[str, dict]:
    """vLLM on the trace with 4 fillers (the prompt was evicted from the device)
    and with none (it is still on the device), at the server's default retention."""
    meta = tiers_vllm.preset_meta(SPEC)
    out = {}
    for name, fillers in (("evicted", 4), ("resident", 0)):
        seqs = tiers_vllm.materialize(_trace(fillers))
        out[name] = tiers_vllm.run_vllm(seqs, meta, DEVICE, HOST, retention=0)
    return out


def test_vllm_offload_hit_after_device_eviction(vllm_rows: dict[str, dict]) -> None:
    ev, res = vllm_rows["evicted"], vllm_rows["resident"]
    # a vLLM block holds one page of each layer of a group (1 here): 40 blocks shared by both groups
    assert ev["num_gpu_blocks"] == 40
    # Only the repeat can hit (the fillers share nothing); it misses the device
    # and the CPU tier supplies all but the last (partial) page of the prompt.
    assert ev["l1_hit_tokens"] == 0
    assert ev["l2_hit_tokens"] == (BLOCKS - 1) * PAGE
    assert ev["hit_tokens"] == ev["l2_hit_tokens"]
    # Without the fillers the device still holds it: a device hit, no load.
    assert res["l1_hit_tokens"] == (BLOCKS - 1) * PAGE
    assert res["l2_hit_tokens"] == 0
    assert ev["input_tokens"] == 6 * BLOCKS * PAGE


def test_hybridkv_l2_hit_after_device_eviction(tmp_path: Path) -> None:
    l2 = tiers_vllm.run_hybridkv(_trace(4), SPEC, DEVICE, HOST, "l2", tmp_path)
    l1 = tiers_vllm.run_hybridkv(_trace(4), SPEC, DEVICE, 0, "l1", tmp_path)
    assert l1["hit_tokens"] == 0  # the device alone lost the prompt
    assert l2["l1_hit_tokens"] == 0
    assert l2["l2_hit_tokens"] >= (BLOCKS - 1) * PAGE
    assert l2["token_hit_rate"] == l2["hit_tokens"] / l2["input_tokens"]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tiers"):
        tiers_vllm.run_hybridkv(_trace(0), SPEC, DEVICE, HOST, "l4", Path("."))
    with pytest.raises(ValueError, match="device_bytes"):
        tiers_vllm.run_vllm(tiers_vllm.materialize(_trace(0)), tiers_vllm.preset_meta(SPEC), 0, HOST, 0)


def test_hybridkv_in_vllm_hits_from_its_connectors_l2_after_device_eviction() -> None:
    """Through vLLM's scheduler with hybridkv's prefix cache and connector (the served
    stack, worker stood in): the evicted prompt comes back from L2; without the
    connector it misses.  The store is probed once per new key, never for the repeat."""
    import tiers_vllm_connector as tc

    seqs, meta = tiers_vllm.materialize(_trace(4)), tiers_vllm.preset_meta(SPEC)
    alone = tc.run_hybridkv_vllm(seqs, meta, DEVICE, HOST, tiers=False)
    tiers = tc.run_hybridkv_vllm(seqs, meta, DEVICE, HOST, tiers=True)
    assert alone["num_gpu_blocks"] == tiers["num_gpu_blocks"] == 40
    assert alone["hit_tokens"] == 0
    assert tiers["l1_hit_tokens"] == 0 and tiers["l3_hit_tokens"] == 0
    assert tiers["l2_hit_tokens"] == (BLOCKS - 1) * PAGE
    record = tiers["store_record"]
    # five distinct prompts probed (their keys are unknown), the repeat answered from the record
    assert record["probes"] == 5 and record["lost_keys"] == 0
    assert record["known_keys"] >= 5 * (BLOCKS - 1)
    with pytest.raises(ValueError, match="host_bytes"):
        tc.run_hybridkv_vllm(seqs, meta, DEVICE, 0, tiers=True)

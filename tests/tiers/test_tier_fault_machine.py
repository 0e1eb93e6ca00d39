"""Fault injection over TieredCache (issue 14, item 2): a hypothesis state machine.

Requests run through the reference model (every logit of the cached path must
equal a dense forward: a pseudo-hit is a mismatch) while, at random steps, the
L3 backend raises or turns slow, stored L3 files are corrupted, page copies
raise, payload decoding raises, L1 is flushed and L2 is dropped.  After every
step: the ownership invariants of L1 and L2 hold (no page leaked or owned
twice, registrations match the tree) and no request is left live.  Bounded:
a few examples of a few tens of steps with a 50 ms L3 budget.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv import CacheConfig
from hybridkv.eval.model.reference import ReferenceModel, tiny_spec
from hybridkv.eval.model.verify import verify_requests
from hybridkv.eval.tier_verify import flush_l2
from hybridkv.tiers.storage import open_backend
from hybridkv.tiers.tiered import TierConfig, TieredCache

from .faulty import FaultyBackend

torch.set_num_threads(1)
SPEC = tiny_spec()
MODEL = ReferenceModel(SPEC, seed=0)
FPB, SPB = SPEC.bytes_per_page("full"), SPEC.bytes_per_page("swa")
OPS = ("exists", "get", "put", "touch")


class TierFaultMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["write_through", "write_back"]), l1=st.integers(24, 60),
                l2=st.integers(20, 120), checkpoint=st.sampled_from([0, 16]), seed=st.integers(0, 2**16))
    def setup(self, policy, l1, l2, checkpoint, seed):
        self.dir = Path(tempfile.mkdtemp(prefix="hkv-fault-"))
        self.backend = FaultyBackend(open_backend(f"file://{self.dir / 'l3'}", breaker_threshold=3,
                                                  breaker_cooldown_s=0.05, warn_interval_s=60.0))
        self.cache = TieredCache(
            SPEC, CacheConfig(budget_bytes=l1 * (FPB + SPB), device="cpu", swa_checkpoint=checkpoint),
            tiers=TierConfig(l2_bytes=l2 * (FPB + SPB), l3=self.backend, write_policy=policy,
                             l3_timeout_s=0.05, l3_read_breaker=(3, 0.05)))
        self.rng = np.random.default_rng(seed)
        self.bases = [self.rng.integers(0, 64, 80).astype(np.int32) for _ in range(3)]
        self.fault = {"copy": False, "decode": False}
        real_copy, real_decode = self.cache.lower_tiers.copy, self.cache.codec.decode

        def copy(*a, **k):
            if self.fault["copy"]:
                raise RuntimeError("injected copy fault")
            return real_copy(*a, **k)

        def decode(*a, **k):
            if self.fault["decode"]:
                raise RuntimeError("injected decode fault")
            return real_decode(*a, **k)

        self.cache.lower_tiers.copy = copy
        self.cache.codec.decode = decode
        self.requests = 0

    def teardown(self):
        if hasattr(self, "cache"):
            self.backend.delay.clear()
            self.backend.fail.clear()
            self.cache.close()
            self.backend.inner.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ workload
    @rule(base=st.integers(0, 2), cut=st.integers(2, 80), tail=st.integers(0, 9), prefetch=st.booleans(),
          inject=st.sampled_from(["none", "none", "copy", "decode", "l3_raise", "l3_slow"]))
    def request(self, base, cut, tail, prefetch, inject):
        """One request (chunked prefill + a decode step), with a fault during just this request."""
        tokens = np.concatenate([self.bases[base][:cut], self.rng.integers(0, 64, tail)]).astype(np.int32)
        saved = (dict(self.fault), set(self.backend.fail), dict(self.backend.delay))
        if inject in self.fault:
            self.fault[inject] = True
        elif inject == "l3_raise":
            self.backend.fail.update(OPS)
        elif inject == "l3_slow":
            self.backend.delay.update(dict.fromkeys(OPS, 0.08))
        try:
            if prefetch:
                self.cache.prefetch(tokens, "default")
            out = verify_requests([("default", tokens)], self.cache, MODEL, chunk=16, decode_tokens=1)
        finally:
            self.fault.update(saved[0])
            self.backend.fail.clear()
            self.backend.fail.update(saved[1])
            self.backend.delay.clear()
            self.backend.delay.update(saved[2])
        assert out["mismatched_requests"] == 0, ("pseudo-hit", out)
        self.requests += 1

    @rule()
    def evict_l1(self):
        tree = self.cache.tree
        tree.evict(full_pages=tree.evictable_full_pages(), swa_pages=tree.evictable_swa_pages())

    @rule()
    def drop_l2(self):
        self.cache.flush(5)
        flush_l2(self.cache)

    # -------------------------------------------------------------- faults
    @rule(op=st.sampled_from(OPS), mode=st.sampled_from(["ok", "raise", "slow"]))
    def backend_fault(self, op, mode):
        self.backend.fail.discard(op)
        self.backend.delay.pop(op, None)
        if mode == "raise":
            self.backend.fail.add(op)
        elif mode == "slow":
            self.backend.delay[op] = 0.08

    @rule(which=st.sampled_from(["copy", "decode"]), on=st.booleans())
    def internal_fault(self, which, on):
        self.fault[which] = on

    @rule(pick=st.integers(0, 10**6), offset=st.integers(0, 10**6))
    def corrupt_l3_file(self, pick, offset):
        self.cache.flush(5)
        files = sorted(p for p in (self.dir / "l3").rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            return
        path = files[pick % len(files)]
        data = bytearray(path.read_bytes())
        if data:
            data[offset % len(data)] ^= 0x5A
            path.write_bytes(bytes(data))

    # ---------------------------------------------------------- invariants
    @invariant()
    def whole(self):
        if not hasattr(self, "cache"):
            return
        with self.cache._mutex:  # the L3 read worker lands pages in L2 under the same lock
            self.cache.check_invariants()
        assert not self.cache._live, "a request was left live"


TierFaultMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("HKV_FAULT_EXAMPLES", "12")), stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much], derandomize=True)
test_tier_faults_state_machine = TierFaultMachine.TestCase

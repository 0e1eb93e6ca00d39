"""``hybridkv verify`` sizes torch's intra-op threads to its work (one for the tiny
float64 model: more threads spin against each other and against any other process,
26-52 s for ``--quick`` with one core busy instead of a few) and gives the caller its
thread count back."""

from __future__ import annotations

import pytest
import torch

from hybridkv.eval.model.reference import ReferenceModel, tiny_spec, torch_threads
from hybridkv.eval.model.verify import run_verify, scaled_prompts, small_cache, verify_requests


@pytest.fixture
def four_threads():
    """The caller runs with 4 intra-op threads (more than the work is worth); restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def test_torch_threads_caps_then_restores_also_after_an_error(four_threads):
    with torch_threads(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 4
    with torch_threads(64) as n:  # never more than the caller had
        assert n == 4 and torch.get_num_threads() == 4
    with pytest.raises(RuntimeError, match="boom"):
        with torch_threads(2):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_torch_threads_rejects_a_bad_count_and_changes_nothing(bad, exc, four_threads):
    with pytest.raises(exc, match="^n must"):
        with torch_threads(bad):
            pass
    assert torch.get_num_threads() == 4


def test_threads_grow_with_the_work_and_the_verify_model_needs_one():
    model = ReferenceModel(tiny_spec())
    longest = max(len(t) for _, t in scaled_prompts(None, 60)) + 3
    assert model.threads_for(longest) == 1  # the verify prompts: a few hundred tokens at most
    counts = [model.threads_for(n) for n in (256, 2048, 8192)]
    assert counts == sorted(counts) and counts[-1] > counts[0] >= 1
    with pytest.raises(ValueError, match="tokens"):
        model.threads_for(0)


class _Recording(ReferenceModel):
    """The reference model, noting torch's thread count at every forward."""

    seen: set[int]

    def forward_cached(self, *args, **kwargs):
        self.seen.add(torch.get_num_threads())
        return super().forward_cached(*args, **kwargs)

    def forward_dense(self, *args, **kwargs):
        self.seen.add(torch.get_num_threads())
        return super().forward_dense(*args, **kwargs)


@pytest.mark.parametrize("wanted", [1, 3])
def test_verify_runs_on_the_threads_its_work_is_worth_and_restores_them(wanted, four_threads, monkeypatch):
    spec = tiny_spec()
    model = _Recording(spec)
    model.seen = set()
    monkeypatch.setattr(model, "threads_for", lambda tokens: wanted)
    out = verify_requests(scaled_prompts(None, 4), small_cache(spec), model)
    assert out["mismatched_requests"] == 0
    assert model.seen == {wanted}
    assert torch.get_num_threads() == 4


@pytest.mark.parametrize("job", ["verify", "tier verify"])
def test_the_verify_jobs_run_single_threaded_and_restore(job, four_threads, monkeypatch):
    seen: set[int] = set()
    dense = ReferenceModel.forward_dense

    def forward_dense(self, tokens):
        seen.add(torch.get_num_threads())
        return dense(self, tokens)

    monkeypatch.setattr(ReferenceModel, "forward_dense", forward_dense)
    if job == "verify":
        out = run_verify(requests=3)
    else:
        from hybridkv.eval.tier_verify import run_tier_verify
        out = run_tier_verify(requests=3, l2_gb=1.0)
    assert out["mismatched_requests"] == 0
    assert seen == {1} and torch.get_num_threads() == 4

"""StoreIndex: what an L3 store holds as far as one engine knows (hybridkv.tiers.index).

Lookups answer from the record and probe only keys with no answer; answers are
recorded (present for good, absent for a TTL); a lost key is absent until
stored again; a probe that fails is a miss, never an error; the record stays
within its bound.  Checked against a real file backend."""

from __future__ import annotations

import threading

import pytest

from hybridkv.tiers.index import Known, StoreIndex
from hybridkv.tiers.storage import open_backend


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class CountingProbe:
    def __init__(self, backend) -> None:  # noqa: ANN001
        self.backend, self.calls, self.keys = backend, 0, 0

    def __call__(self, keys: list[bytes]) -> list[bool]:
        self.calls += 1
        self.keys += len(keys)
        return self.backend.exists(keys)


@pytest.fixture()
def store(tmp_path):  # noqa: ANN001, ANN201
    backend = open_backend(f"file://{tmp_path}/l3")
    yield backend
    backend.close()


def _k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_known_keys_are_answered_without_a_probe(store):
    store.put([_k(1), _k(2)], [b"a" * 8, b"b" * 8])
    probe, clock = CountingProbe(store), Clock()
    idx = StoreIndex(probe, absent_ttl_s=2.0, clock=clock)
    assert idx.present([_k(1), _k(2), _k(3)]).tolist() == [True, True, False]
    assert (probe.calls, probe.keys) == (1, 3)
    # the same lookup again: every key has an answer (present, or absent within the TTL)
    assert idx.present([_k(1), _k(2), _k(3)]).tolist() == [True, True, False]
    assert probe.calls == 1
    assert idx.state(_k(1)) is Known.STORED and idx.state(_k(3)) is None


def test_an_absent_answer_expires_so_another_engines_write_becomes_visible(store):
    probe, clock = CountingProbe(store), Clock()
    idx = StoreIndex(probe, absent_ttl_s=2.0, clock=clock)
    assert idx.present([_k(5)]).tolist() == [False]
    store.put([_k(5)], [b"x" * 8])  # written by someone else
    clock.t = 1.0
    assert idx.present([_k(5)]).tolist() == [False]  # still trusted
    clock.t = 2.5
    assert idx.present([_k(5)]).tolist() == [True]
    assert probe.calls == 2


def test_queued_keys_count_as_present_and_lost_keys_do_not(store):
    probe, clock = CountingProbe(store), Clock()
    idx = StoreIndex(probe, absent_ttl_s=2.0, clock=clock)
    idx.queued([_k(7), _k(8)])
    assert idx.present([_k(7), _k(8)]).tolist() == [True, True]
    assert probe.calls == 0
    idx.lost([_k(8)])  # its write was dropped: a load found it missing
    assert idx.present([_k(7), _k(8)]).tolist() == [True, False]
    assert probe.calls == 0  # absent within the TTL
    idx.stored([_k(8)])
    assert idx.present([_k(8)]).tolist() == [True]
    idx.stored([_k(9)])
    idx.queued([_k(9)])  # queuing again does not demote a stored key
    assert idx.state(_k(9)) is Known.STORED
    assert idx.stats()["lost_keys"] == 1


def test_a_failing_probe_is_a_miss_and_is_not_recorded():
    calls = []

    def down(keys: list[bytes]) -> list[bool]:
        calls.append(len(keys))
        raise ConnectionError("store down")

    idx = StoreIndex(down)
    assert idx.present([_k(1), _k(2)]).tolist() == [False, False]
    assert idx.present([_k(1)]).tolist() == [False]
    assert calls == [2, 1]  # not remembered as absent: asked again
    assert idx.stats()["probe_errors"] == 2
    short = StoreIndex(lambda keys: [True])  # a probe answering for fewer keys than asked
    assert short.present([_k(1), _k(2)]).tolist() == [False, False]
    assert short.stats()["probe_errors"] == 1


def test_no_probe_means_only_what_this_engine_queued_counts():
    idx = StoreIndex(None)
    idx.queued([_k(1)])
    assert idx.present([_k(1), _k(2)]).tolist() == [True, False]
    assert idx.present([_k(2)], probe=False).tolist() == [False]


def test_the_record_stays_within_its_bound(store):
    idx = StoreIndex(CountingProbe(store), bound=4)
    idx.queued([_k(i) for i in range(10)])
    assert len(idx) == 4
    assert [idx.state(_k(i)) for i in (5, 6, 9)] == [None, Known.QUEUED, Known.QUEUED]
    idx.lost([_k(i) for i in range(100, 110)])
    assert idx.stats()["absent_keys"] == 4


@pytest.mark.parametrize("kw, match", [({"bound": 0}, "bound"), ({"bound": True}, "bound"),
                                       ({"absent_ttl_s": -1}, "absent_ttl_s"),
                                       ({"absent_ttl_s": "2"}, "absent_ttl_s")])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        StoreIndex(None, **kw)
    with pytest.raises(TypeError, match="probe"):
        StoreIndex(42)


def test_due_touch_names_known_keys_at_most_once_per_interval():
    clock = Clock()
    idx = StoreIndex(None, clock=clock)
    idx.queued([_k(1), _k(2)])
    assert idx.due_touch([_k(1), _k(2), _k(3)], 10.0) == [_k(1), _k(2)]  # _k(3): not in the store
    clock.t = 5.0
    assert idx.due_touch([_k(1), _k(2)], 10.0) == []
    clock.t = 10.5
    assert idx.due_touch([_k(2)], 10.0) == [_k(2)]


def test_the_leading_run_probes_up_to_the_first_absent_key(store):
    """A lookup's hit is the leading run: probing stops at the first absent key, in
    chunks that grow, and known keys (or keys a faster tier holds) are not asked."""
    import numpy as np

    store.put([_k(i) for i in range(40)], [b"v" * 8] * 40)
    probe, clock = CountingProbe(store), Clock()
    idx = StoreIndex(probe, absent_ttl_s=2.0, clock=clock)
    keys = [_k(i) for i in range(1000, 1300)]  # a new prompt: nothing stored
    assert idx.leading(keys, first=4, grow=4) == 0
    assert (probe.calls, probe.keys) == (1, 4)  # present() would ask all 300
    assert idx.leading(keys, first=4, grow=4) == 0 and probe.calls == 1  # absent, within the TTL
    # 40 stored, then absent: chunks of 4, 16, 64 (the last one ends at the first absent key)
    keys = [_k(i) for i in range(100)]
    assert idx.leading(keys, first=4, grow=4) == 40
    assert (probe.calls, probe.keys) == (4, 4 + 4 + 16 + 64)
    assert idx.leading(keys, first=4, grow=4) == 40 and probe.calls == 4  # all answered now
    # a key a faster tier holds is not asked and counts as present
    held = np.zeros(3, dtype=bool)
    held[0] = True
    fresh = [_k(2000), _k(1), _k(2001)]
    assert idx.leading(fresh, held, first=4) == 2 and probe.keys == 88 + 1  # only _k(2001) asked
    # the same answers as present() over the leading run, for any run length
    for n in (0, 1, 17, 40, 41, 99):
        other = StoreIndex(store.exists, absent_ttl_s=2.0, clock=clock)
        flags = other.present(keys[:n])
        run = int(np.argmin(flags)) if not flags.all() else n
        assert StoreIndex(store.exists, clock=clock).leading(keys[:n]) == run


def test_a_failing_probe_ends_the_leading_run_unrecorded():
    def boom(keys):  # noqa: ANN001, ANN202
        raise ConnectionError("store down")

    idx = StoreIndex(boom)
    assert idx.leading([_k(1), _k(2)]) == 0
    assert idx.counters["probe_errors"] == 1 and idx.state(_k(1)) is None
    idx.queued([_k(1)])
    assert idx.leading([_k(1), _k(2)]) == 1  # what this engine queued still counts
    assert StoreIndex(None).leading([_k(1)]) == 0


@pytest.mark.parametrize("kw, match", [({"first": 0}, "first"), ({"grow": -1}, "grow"),
                                       ({"first": True}, "first"), ({"held": [True]}, "held")])
def test_leading_names_a_bad_argument(kw, match):
    import numpy as np

    idx = StoreIndex(None)
    if "held" in kw:
        kw = {"held": np.array(kw["held"])}
    with pytest.raises(ValueError, match=match):
        idx.leading([_k(1), _k(2)], **kw)
    assert idx.stats()["probes"] == 0 and len(idx) == 0


def test_held_answers_from_the_record_only():
    probe = CountingProbe(None)
    idx = StoreIndex(probe)
    idx.queued([_k(1)])
    idx.stored([_k(2)])
    idx.lost([_k(2)])
    assert idx.held([_k(1), _k(2), _k(3)]).tolist() == [True, False, False]
    assert probe.calls == 0 and idx.stats()["answered_keys"] == 0  # not a lookup: nothing counted


def test_a_probe_runs_without_the_lock_so_other_threads_go_on():
    started, release = threading.Event(), threading.Event()

    def slow_probe(keys: list[bytes]) -> list[bool]:
        started.set()
        assert release.wait(10)
        return [False] * len(keys)

    idx = StoreIndex(slow_probe)
    lookup = threading.Thread(target=lambda: idx.present([_k(1)]))
    lookup.start()
    assert started.wait(10)
    writer = threading.Thread(target=lambda: idx.queued([_k(2)]))  # the engine thread records a write
    writer.start()
    writer.join(2)
    try:
        assert not writer.is_alive(), "the record's lock was held across the probe"
        assert idx.held([_k(2), _k(1)]).tolist() == [True, False]
    finally:
        release.set()
        lookup.join(10)
    assert idx.present([_k(1)], probe=False).tolist() == [False]  # the probe's answer, recorded
    assert idx.stats()["probes"] == 1


def test_deferred_keys_are_collected_not_probed_nor_recorded(store):
    """With a ``deferred`` list nothing is probed: the keys with no answer are
    collected and count as absent for this answer only (not recorded: a later
    probing call still asks them)."""
    store.put([_k(i) for i in range(10)], [b"v" * 8] * 10)
    probe = CountingProbe(store)
    idx = StoreIndex(probe, clock=Clock())
    idx.queued([_k(0)])
    deferred: list[bytes] = []
    assert idx.present([_k(0), _k(1), _k(50)], deferred=deferred).tolist() == [True, False, False]
    assert deferred == [_k(1), _k(50)] and probe.calls == 0
    deferred = []
    assert idx.leading([_k(i) for i in range(10)], first=4, deferred=deferred) == 1
    assert deferred == [_k(1), _k(2), _k(3), _k(4)] and probe.calls == 0  # the first chunk's unknown keys
    assert idx.leading([_k(i) for i in range(10)], first=4) == 10 and probe.calls > 0  # asked now
    deferred = []
    assert idx.leading([_k(i) for i in range(10)], first=4, deferred=deferred) == 10 and not deferred

"""A backend that stops answering logs one WARNING, DEBUG for every further fault, and
INFO when it answers again (library users get one line per outage, not one per call)."""

from __future__ import annotations

import logging

from hybridkv.tiers.storage.file_backend import FileBackend

LOGGER = "hybridkv.tiers.storage"


class _Switchable(FileBackend):
    """A file backend whose calls raise ``ConnectionError`` while ``down`` is set."""

    down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    def _get(self, keys):  # noqa: ANN001, ANN202
        self._check()
        return super()._get(keys)

    def _put(self, keys, headers, payloads):  # noqa: ANN001, ANN202
        self._check()
        return super()._put(keys, headers, payloads)

    def _exists(self, keys):  # noqa: ANN001, ANN202
        self._check()
        return super()._exists(keys)


def _records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_one_warning_per_outage_debug_for_the_rest(tmp_path, caplog):
    b = _Switchable(tmp_path, breaker_threshold=2, breaker_cooldown_s=0.0, warn_interval_s=0.0)
    key = [b"k" * 16]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert b.put(key, [b"v1"]) == [True]
        b.down = True
        for _ in range(10):
            assert b.get(key) == [None] and b.put(key, [b"v"]) == [False] and b.exists(key) == [False]
        warnings = _records(caplog, logging.WARNING)
        assert len(warnings) == 1
        msg = warnings[0].getMessage()
        assert "file backend unreachable" in msg and "ConnectionError" in msg and "breaker" not in msg
        assert warnings[0].l3_unreachable.startswith("ConnectionError: Error 111")
        assert len(_records(caplog, logging.DEBUG)) >= 9  # the further faults, at DEBUG
        b.down = False
        assert b.put(key, [b"v2"]) == [True]
        assert [r.getMessage() for r in _records(caplog, logging.INFO)] == ["file backend answers again"]
        b.down = True
        assert b.get(key) == [None]
        assert len(_records(caplog, logging.WARNING)) == 2  # a second outage is news again
    assert b.stats()["read_keys_failed"] >= 11
    b.close()


def test_healthy_backend_logs_nothing(tmp_path, caplog):
    b = FileBackend(tmp_path)
    key = [b"h" * 16]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert b.put(key, [b"v"]) == [True] and bytes(b.get(key)[0]) == b"v"
    assert not [r for r in caplog.records if r.name == LOGGER]
    b.close()

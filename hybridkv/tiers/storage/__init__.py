"""L3 storage backends for KV pages (file, redis, mooncake, nixl).

Use :func:`open_backend` with a URL; code against :class:`StorageBackend`.
Every value is framed and verified (:mod:`.framing`); faults degrade to
misses (:class:`BaseBackend`).  Backends whose client package is missing are
only imported when their URL is opened.
"""

from .base import STAT_NAMES, BaseBackend, CircuitBreaker, StorageBackend, backend_lacks
from .file_backend import FileBackend
from .framing import FrameError
from .url import SCHEMES, open_backend

__all__ = ["StorageBackend", "BaseBackend", "CircuitBreaker", "FileBackend", "FrameError",
           "open_backend", "SCHEMES", "STAT_NAMES", "backend_lacks"]

"""The SWA/full memory split for SGLang's pools under the hybridkv backend.

SGLang sizes a hybrid SWA model's KV memory with one knob,
``--swa-full-tokens-ratio`` R (SWA tokens per full token, ``0 < R <= 1``,
default 0.8): ``full = bytes / (full_bytes_per_token + R * swa_bytes_per_token)``
and ``swa = R * full``.  Its own tree keeps SWA for every cached token, so its
best R is large.  hybridkv's tree keeps full KV broadly and SWA only where a
hit can end, so the SWA pool needs only

* what running requests hold: the window plus one decode page each and the
  prefill chunks in flight, ``O(W + chunk)`` per request (SGLang's own worst
  case, ``compute_swa_request_cap``), and
* two W-token windows per cached sequence: its tail (the next turn quotes the
  answer) and where its prompt ended (the next turn diverges there when the
  answer is not quoted verbatim, e.g. reasoning stripped by the chat template):
  ``2 * full * W / L`` for a cache whose sequences average L full tokens.
  Chunk boundaries and retention checkpoints keep their windows while room
  allows; the tree evicts them first.

:func:`plan_swa_split` returns the pool sizes and the R to pass to SGLang::

    python -m hybridkv_sglang.split --kv-gb 594 --preset mimo-v2.5-pro \\
        --chunked-prefill-size 8192 --max-running-requests 64
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

__all__ = ["SwaSplit", "plan_swa_split", "live_swa_tokens", "pools_at_ratio", "DEFAULT_TOKENS_PER_WINDOW"]

#: L: cached full tokens per retained W-token window when the workload is unknown
DEFAULT_TOKENS_PER_WINDOW = 4096


@dataclass(frozen=True)
class SwaSplit:
    """Pool sizes in tokens and SGLang's ``--swa-full-tokens-ratio`` for them."""

    full_tokens: int
    swa_tokens: int
    live_swa_tokens: int

    @property
    def swa_full_tokens_ratio(self) -> float:
        return self.swa_tokens / self.full_tokens

    def kv_bytes(self, full_bytes_per_token: int, swa_bytes_per_token: int) -> int:
        return self.full_tokens * full_bytes_per_token + self.swa_tokens * swa_bytes_per_token


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def live_swa_tokens(*, window: int, chunked_prefill_size: int, max_running_requests: int,
                    page_size: int = 1, prefill_chunks_in_flight: int = 2) -> int:
    """SWA slots running requests can hold at once (SGLang's ``compute_swa_request_cap``
    without speculative decoding): per request the window, one eviction step and a
    decode page, plus the prefill chunks in flight."""
    _check_positive(window=window, chunked_prefill_size=chunked_prefill_size,
                    max_running_requests=max_running_requests, page_size=page_size,
                    prefill_chunks_in_flight=prefill_chunks_in_flight)
    per_request = window + 1 + 2 * page_size
    return per_request * max_running_requests + prefill_chunks_in_flight * chunked_prefill_size + page_size


def plan_swa_split(kv_bytes: int, full_bytes_per_token: int, swa_bytes_per_token: int, *, window: int,
                   chunked_prefill_size: int, max_running_requests: int, page_size: int = 1,
                   prefill_chunks_in_flight: int = 2, tokens_per_window: int = DEFAULT_TOKENS_PER_WINDOW,
                   windows_per_sequence: int = 2) -> SwaSplit:
    """Split ``kv_bytes`` into full and SWA pools for hybridkv's tree.

    ``swa = live + windows_per_sequence * full * window / tokens_per_window`` and
    ``full * full_bytes_per_token + swa * swa_bytes_per_token <= kv_bytes``.
    ``tokens_per_window`` (L) is the typical prompt length of the workload (the
    full tokens one cached sequence adds); ``windows_per_sequence`` the windows
    kept per cached sequence (tail and prompt end).  Raises ValueError when the live SWA alone does not fit.
    The ratio is capped at SGLang's maximum of 1.0.
    """
    _check_positive(kv_bytes=kv_bytes, full_bytes_per_token=full_bytes_per_token,
                    swa_bytes_per_token=swa_bytes_per_token, tokens_per_window=tokens_per_window,
                    windows_per_sequence=windows_per_sequence)
    live = live_swa_tokens(window=window, chunked_prefill_size=chunked_prefill_size,
                           max_running_requests=max_running_requests, page_size=page_size,
                           prefill_chunks_in_flight=prefill_chunks_in_flight)
    live = -(-live // page_size) * page_size
    per_window = windows_per_sequence * window / tokens_per_window
    per_full = full_bytes_per_token + swa_bytes_per_token * per_window
    full = int((kv_bytes - live * swa_bytes_per_token) // per_full) // page_size * page_size
    if full <= 0:
        raise ValueError(f"kv_bytes={kv_bytes} cannot hold the {live} SWA tokens running requests need "
                         f"({live * swa_bytes_per_token} bytes): lower max_running_requests or "
                         "chunked_prefill_size, or give more memory")
    swa = live + int(full * per_window)
    swa = min(-(-swa // page_size) * page_size, full)
    # page rounding may overshoot by a page: give it back from the full pool
    while full * full_bytes_per_token + swa * swa_bytes_per_token > kv_bytes and full > page_size:
        full -= page_size
        swa = min(swa, full)
    return SwaSplit(full, swa, live)


def pools_at_ratio(kv_bytes: int, full_bytes_per_token: int, swa_bytes_per_token: int, ratio: float,
                   page_size: int = 1) -> tuple[int, int]:
    """SGLang's own sizing for ``--swa-full-tokens-ratio ratio``: ``(full, swa)`` tokens."""
    _check_positive(kv_bytes=kv_bytes, ratio=ratio)
    if ratio > 1.0:
        raise ValueError(f"SGLang accepts --swa-full-tokens-ratio in (0, 1], got {ratio}")
    full = int(kv_bytes // (full_bytes_per_token + ratio * swa_bytes_per_token)) // page_size * page_size
    swa = int(full * ratio) // page_size * page_size
    return full, swa


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybridkv_sglang.split", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-gb", type=float, required=True, help="KV memory per rank in GB (1e9 bytes)")
    ap.add_argument("--preset", default="mimo-v2.5-pro", help="hybridkv model preset (bytes per token, window)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (KV heads are split over it)")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--tokens-per-window", type=int, default=DEFAULT_TOKENS_PER_WINDOW,
                    help="typical prompt length of the workload (L)")
    ap.add_argument("--windows-per-sequence", type=int, default=2, help="SWA windows kept per cached sequence")
    args = ap.parse_args(argv)
    from hybridkv.spec import ModelSpec

    spec = ModelSpec.preset(args.preset, page_size=args.page_size)
    fb = math.ceil(spec.bytes_per_token_full / args.tp)
    sb = math.ceil(spec.bytes_per_token_swa / args.tp)
    split = plan_swa_split(int(args.kv_gb * 1e9), fb, sb, window=spec.window,
                           chunked_prefill_size=args.chunked_prefill_size,
                           max_running_requests=args.max_running_requests, page_size=args.page_size,
                           tokens_per_window=args.tokens_per_window,
                           windows_per_sequence=args.windows_per_sequence)
    print(f"full pool {split.full_tokens} tokens, SWA pool {split.swa_tokens} tokens "
          f"({split.live_swa_tokens} for running requests)")
    print(f"--swa-full-tokens-ratio {split.swa_full_tokens_ratio:.4f}")


if __name__ == "__main__":
    main()

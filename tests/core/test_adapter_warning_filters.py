"""The adapter suites hide the third-party warnings a newcomer would read as problems
(torch's TorchScript deprecation, SGLang's CUDA-only quantization notes), each by its
message, and nothing else: a warning of ours, or any other deprecation, still shows."""

from __future__ import annotations

import builtins
import re
import warnings
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency has the same API
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = ("vllm", "sglang")

# What the suites printed before the filters (pytest's warnings summary), per adapter.
KNOWN = {
    "vllm": [("`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or `torch.export`.",
              DeprecationWarning)],
    "sglang": [("`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or `torch.export`.",
                DeprecationWarning),
               ("Only CUDA, HIP and XPU support AWQ currently.", UserWarning),
               ("Only CUDA, MUSA and NPU support GGUF quantization currently.", UserWarning),
               ("Only CUDA and MUSA support GGUF quantization currently.", UserWarning)],
}
# Must stay visible: ours (hybridkv logs "hybridkv: ..." lines; a warning would read so)
# and other third-party deprecations that may matter one day.
VISIBLE = [("hybridkv: groups differ in page bytes; L2 disabled", UserWarning),
           ("hybridkv_vllm.connector is deprecated", DeprecationWarning),
           ("`torch.cuda.amp.autocast(args...)` is deprecated", FutureWarning),
           ("Only CUDA supports this hybridkv kernel", RuntimeWarning),
           ("pkg_resources is deprecated as an API", DeprecationWarning)]


def _filters(adapter: str) -> list[str]:
    data = tomllib.loads((ROOT / "adapters" / adapter / "pyproject.toml").read_text())
    return data["tool"]["pytest"]["ini_options"].get("filterwarnings", [])


def _shown(filters: list[str], message: str, category: type[Warning]) -> bool:
    """Whether a warning passes ``filters`` (pytest's ini syntax, last one wins as in pytest)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for f in filters:
            action, msg, cat = (f.split(":") + ["", ""])[:3]
            warnings.filterwarnings(action, message=msg, category=getattr(builtins, cat) if cat else Warning)
        warnings.warn(message, category)
    return bool(seen)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_filter_ignores_a_message_not_a_whole_category(adapter):
    filters = _filters(adapter)
    assert filters, adapter
    for f in filters:
        action, msg, cat = (f.split(":") + ["", ""])[:3]
        assert action == "ignore" and cat in ("DeprecationWarning", "UserWarning"), f
        assert len(msg) > 15 and re.compile(msg), f  # a message, not "" (which is every warning)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_the_known_third_party_warnings_are_hidden(adapter):
    filters = _filters(adapter)
    for message, category in KNOWN[adapter]:
        assert not _shown(filters, message, category), (adapter, message)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_ours_and_other_warnings_still_show(adapter):
    filters = _filters(adapter)
    for message, category in VISIBLE:
        assert _shown(filters, message, category), (adapter, message)

"""Model specifications: which layers are full attention, which are sliding window.

A :class:`ModelSpec` is a frozen description of everything the cache needs to
know about a model: the attention kind of every layer, the window W, the KV
shape of each kind, the dtype and the page size.  The cache never branches on
model names; it branches on :class:`AttnKind` values held by the spec.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ._validate import check_int

__all__ = ["AttnKind", "KVGroupSpec", "KVShape", "ModelSpec", "PRESETS", "preset_names", "window_pages"]


def window_pages(window: int, page_size: int) -> int:
    """Pages that can overlap a ``window``-token window ending on a page boundary:
    ``ceil(window / page_size)``.  The one definition every layer uses."""
    return -(-window // page_size)


_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "fp32": "float32", "float": "float32", "fp64": "float64",
                  "double": "float64", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


class AttnKind(str, enum.Enum):
    """Attention kind of a layer: whole sequence or the last W tokens."""

    FULL = "full"
    SWA = "swa"


@dataclass(frozen=True)
class KVShape:
    """Per-layer KV shape of one attention kind (per token)."""

    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "k_head_dim", "v_head_dim"):
            object.__setattr__(self, name, check_int(getattr(self, name), name, 1))

    def elems_per_token(self) -> int:
        """Number of K plus V elements one layer stores per token."""
        return self.num_kv_heads * (self.k_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV group: the layers that share an attention window and a KV shape.

    A model is a list of groups (:attr:`ModelSpec.groups`), as vLLM's KV-cache
    groups are: one full-attention group (``window is None``) and one group per
    distinct sliding window.  A hit ending at ``L`` is usable by a sliding group
    only if that group holds KV for ``[L - window, L)``; a full group needs
    ``[0, L)``.

    Attributes:
        window: tokens a layer of the group attends back to; None: full attention.
        layers: indices of the group's layers, ascending.
        shape: per-layer, per-token KV shape.
    """

    window: int | None
    layers: tuple[int, ...]
    shape: KVShape

    @property
    def sliding(self) -> bool:
        """True for a sliding-window group."""
        return self.window is not None

    @property
    def kind(self) -> AttnKind:
        return AttnKind.SWA if self.window is not None else AttnKind.FULL

    @property
    def name(self) -> str:
        """``"full"`` or ``"swa-W"``: unique within a model."""
        return "full" if self.window is None else f"swa-{self.window}"

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes one token costs across the group's layers (K and V)."""
        return len(self.layers) * self.shape.elems_per_token() * dtype_bytes

    def window_pages(self, page_size: int) -> int:
        """Pages that can overlap the window ending on a page boundary (0: full)."""
        return window_pages(self.window, page_size) if self.window is not None else 0


def _canonical_dtype(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"dtype {dtype} is not supported")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or torch.dtype, got {type(dtype).__name__}")
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return name


@dataclass(frozen=True)
class ModelSpec:
    """What the KV cache needs to know about a hybrid-SWA model.

    Attributes:
        name: preset or model name (informational; part of the fingerprint).
        layer_kinds: attention kind of every layer, in layer order.
        window: sliding window W in tokens; a SWA layer at position i attends to
            positions (i - W, i].  The cache keeps the W tokens before a hit end.
        full: KV shape of full-attention layers.
        swa: KV shape of sliding-window layers.
        dtype: KV dtype name (``"bfloat16"``...).
        page_size: tokens per page; every pool and tree operation is page aligned.
        layer_windows: per-layer sliding windows when they differ between
            sliding layers (an entry per layer, 0 for full layers); empty: every
            sliding layer attends ``window`` tokens.  ``window`` is then the
            largest of them (the lead group's); each sliding group keeps KV
            for its own window (:mod:`hybridkv.pools.groups`).
    """

    name: str
    layer_kinds: tuple[AttnKind, ...]
    window: int
    full: KVShape
    swa: KVShape
    dtype: str = "bfloat16"
    page_size: int = 64
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        kinds = tuple(AttnKind(k) for k in self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        if not kinds:
            raise ValueError("layer_kinds must name at least one layer")
        for name in ("window", "page_size"):
            object.__setattr__(self, name, check_int(getattr(self, name), name, 1))
        if not isinstance(self.full, KVShape) or not isinstance(self.swa, KVShape):
            raise TypeError("full and swa must be KVShape instances")
        object.__setattr__(self, "layer_windows", _check_layer_windows(self.layer_windows, kinds, self.window))

    # ------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of full-attention layers."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is AttnKind.FULL)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        """Indices of sliding-window layers."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is AttnKind.SWA)

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` in tokens; None for a full-attention layer."""
        if self.layer_kinds[layer] is AttnKind.FULL:
            return None
        return self.layer_windows[layer] if self.layer_windows else self.window

    @property
    def groups(self) -> tuple[KVGroupSpec, ...]:
        """The model's KV groups: the full group first (if the model has full
        layers), then one sliding group per distinct window, smallest first."""
        by_window: dict[int | None, list[int]] = {}
        for i in range(self.num_layers):
            by_window.setdefault(self.layer_window(i), []).append(i)
        order = sorted(by_window, key=lambda w: -1 if w is None else w)
        return tuple(KVGroupSpec(w, tuple(by_window[w]), self.full if w is None else self.swa) for w in order)

    @property
    def sliding_groups(self) -> tuple[KVGroupSpec, ...]:
        """The sliding-window groups, smallest window first; the last (largest
        window) is the *lead* group; the tree's nodes and the requests hold a
        page id per group (the lead's SWA ids, and each other group's beside
        them: :attr:`~hybridkv.radix.node.TreeNode.side`)."""
        return tuple(g for g in self.groups if g.sliding)

    def group_page_bytes(self, group: KVGroupSpec) -> int:
        """Bytes one page of ``group`` costs (all its layers, K and V)."""
        return group.bytes_per_token(self.dtype_bytes) * self.page_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def shape(self, kind: AttnKind | str) -> KVShape:
        """KV shape of ``kind``."""
        return self.full if AttnKind(kind) is AttnKind.FULL else self.swa

    def layers(self, kind: AttnKind | str) -> tuple[int, ...]:
        """Layer indices of ``kind``."""
        return self.full_layers if AttnKind(kind) is AttnKind.FULL else self.swa_layers

    def bytes_per_token(self, kind: AttnKind | str) -> int:
        """Bytes one token costs across all layers of ``kind`` (K and V)."""
        return len(self.layers(kind)) * self.shape(kind).elems_per_token() * self.dtype_bytes

    @property
    def bytes_per_token_full(self) -> int:
        return self.bytes_per_token(AttnKind.FULL)

    @property
    def bytes_per_token_swa(self) -> int:
        return self.bytes_per_token(AttnKind.SWA)

    def bytes_per_page(self, kind: AttnKind | str) -> int:
        return self.bytes_per_token(kind) * self.page_size

    @property
    def window_pages(self) -> int:
        """Pages that can overlap a W-token window ending on a page boundary."""
        return window_pages(self.window, self.page_size)

    def with_page_size(self, page_size: int) -> "ModelSpec":
        return dataclasses.replace(self, page_size=page_size)

    def fingerprint(self) -> str:
        """A string that changes whenever stored KV would not be interchangeable."""
        kinds = "".join("F" if k is AttnKind.FULL else "S" for k in self.layer_kinds)
        windows = f"|LW{','.join(map(str, self.layer_windows))}" if self.layer_windows else ""
        return (f"{self.name}|{kinds}|W{self.window}{windows}|F{self.full.num_kv_heads}x{self.full.k_head_dim}"
                f"/{self.full.v_head_dim}|S{self.swa.num_kv_heads}x{self.swa.k_head_dim}"
                f"/{self.swa.v_head_dim}|{self.dtype}|P{self.page_size}")

    # ------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str, *, page_size: int | None = None,
               dtype: str | None = None) -> "ModelSpec":
        """A shipped preset (see :data:`PRESETS`); raises ValueError for unknown names."""
        if not isinstance(name, str):
            raise TypeError(f"preset name must be a str, got {type(name).__name__}")
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()}")
        spec = PRESETS[name]
        changes: dict[str, Any] = {}
        if page_size is not None:
            changes["page_size"] = page_size
        if dtype is not None:
            changes["dtype"] = dtype
        return dataclasses.replace(spec, **changes) if changes else spec

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, page_size: int = 64,
                       name: str | None = None) -> "ModelSpec":
        """Build a spec from a Hugging Face ``config.json`` dict.

        Per-layer windows: ``sliding_window`` may be one int or a list with an
        entry per layer (None or 0 for full layers; with ``layer_types`` the
        entries of full layers are ignored).  Understands ``layer_types`` (``"full_attention"`` / ``"sliding_attention"``,
        gpt-oss, Gemma-3, recent transformers), MiMo's ``hybrid_layer_pattern``
        (0 = full, 1 = SWA) with ``swa_num_key_value_heads`` / ``swa_head_dim`` /
        ``swa_v_head_dim``, Gemma's ``sliding_window_pattern`` (every N-th layer
        global) and nested ``text_config``.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        cfg = dict(config)
        if "text_config" in cfg and isinstance(cfg["text_config"], Mapping):
            merged = dict(cfg["text_config"])
            for key in ("torch_dtype", "name_or_path"):
                merged.setdefault(key, cfg.get(key))
            cfg = merged
        n_layers = cfg.get("num_hidden_layers")
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError("config['num_hidden_layers'] must be a positive int")
        kinds = _layer_kinds_from_config(cfg, n_layers)
        window, layer_windows = _windows_from_config(cfg, kinds)
        heads = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
        if not heads:
            raise ValueError("config needs 'num_key_value_heads' or 'num_attention_heads'")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        v_dim = cfg.get("v_head_dim") or head_dim
        full = KVShape(int(heads), int(head_dim), int(v_dim))
        swa = KVShape(int(cfg.get("swa_num_key_value_heads") or heads),
                      int(cfg.get("swa_head_dim") or head_dim),
                      int(cfg.get("swa_v_head_dim") or v_dim))
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        return cls(name=name or str(cfg.get("model_type") or cfg.get("name_or_path") or "hf-model"),
                   layer_kinds=kinds, window=window, full=full, swa=swa,
                   dtype=str(dtype), page_size=page_size, layer_windows=layer_windows)


def _check_layer_windows(windows: object, kinds: tuple[AttnKind, ...], window: int) -> tuple[int, ...]:
    """``windows`` as a tuple of ints (0 for full layers), validated against the kinds;
    () when every sliding layer uses ``window`` (so uniform specs compare equal)."""
    if not isinstance(windows, (tuple, list)):
        raise TypeError(f"layer_windows must be a tuple of ints, got {type(windows).__name__}")
    if not windows:
        return ()
    if len(windows) != len(kinds):
        raise ValueError(f"layer_windows has {len(windows)} entries for {len(kinds)} layers")
    out = []
    for i, (w, k) in enumerate(zip(windows, kinds)):
        w = check_int(w, f"layer_windows[{i}]")
        if k is AttnKind.FULL:
            out.append(0)
        elif w < 1:
            raise ValueError(f"layer_windows[{i}] must be >= 1 for a sliding layer, got {w}")
        else:
            out.append(w)
    sliding = [w for w in out if w]
    if sliding and max(sliding) != window:
        raise ValueError(f"window must be the largest of layer_windows ({max(sliding)}), got {window}")
    return () if len(set(sliding)) <= 1 else tuple(out)


def _windows_from_config(cfg: Mapping[str, Any], kinds: tuple[AttnKind, ...]) -> tuple[int, tuple[int, ...]]:
    """``(window, layer_windows)`` of a HF config: ``sliding_window`` (or MiMo's
    ``swa_window_size``) as one int or as a per-layer list."""
    raw = cfg.get("sliding_window") or cfg.get("swa_window_size") or cfg.get("sliding_window_size")
    if isinstance(raw, (list, tuple)):
        if len(raw) != len(kinds):
            raise ValueError(f"config['sliding_window'] has {len(raw)} entries for {len(kinds)} layers")
        per_layer = []
        for i, (w, k) in enumerate(zip(raw, kinds)):
            if k is AttnKind.FULL:
                per_layer.append(0)
            elif not isinstance(w, int) or isinstance(w, bool) or w < 1:
                raise ValueError(f"config['sliding_window'][{i}] must be a positive int for sliding layer {i}, "
                                 f"got {w!r}")
            else:
                per_layer.append(w)
        sliding = [w for w in per_layer if w]
        return (max(sliding) if sliding else 1), (tuple(per_layer) if sliding else ())
    if AttnKind.SWA in kinds and not raw:
        raise ValueError("config has sliding-window layers but no 'sliding_window'")
    return int(raw or 1), ()


def _layer_kinds_from_config(cfg: Mapping[str, Any], n_layers: int) -> tuple[AttnKind, ...]:
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != n_layers:
            raise ValueError("config['layer_types'] length differs from num_hidden_layers")
        out = []
        for t in types:
            if t in ("full_attention", "global", "full"):
                out.append(AttnKind.FULL)
            elif t in ("sliding_attention", "sliding_window", "local", "swa"):
                out.append(AttnKind.SWA)
            else:
                raise ValueError(f"config['layer_types'] has unknown entry {t!r}")
        return tuple(out)
    if cfg.get("hybrid_layer_pattern"):
        pattern = list(cfg["hybrid_layer_pattern"])
        if len(pattern) != n_layers:
            raise ValueError("config['hybrid_layer_pattern'] length differs from num_hidden_layers")
        return tuple(AttnKind.SWA if int(p) == 1 else AttnKind.FULL for p in pattern)
    if cfg.get("sliding_window_pattern"):
        every = int(cfg["sliding_window_pattern"])
        return tuple(AttnKind.FULL if (i + 1) % every == 0 else AttnKind.SWA for i in range(n_layers))
    per_layer = cfg.get("sliding_window")
    if isinstance(per_layer, (list, tuple)):  # one window per layer, None or 0 for full layers
        if len(per_layer) != n_layers:
            raise ValueError(f"config['sliding_window'] has {len(per_layer)} entries for {n_layers} layers")
        return tuple(AttnKind.SWA if w else AttnKind.FULL for w in per_layer)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        return tuple(AttnKind.SWA for _ in range(n_layers))
    return tuple(AttnKind.FULL for _ in range(n_layers))


def _kinds(n: int, full: Sequence[int]) -> tuple[AttnKind, ...]:
    full_set = set(full)
    return tuple(AttnKind.FULL if i in full_set else AttnKind.SWA for i in range(n))


#: Shipped presets.  MiMo-V2.5-Pro's full-layer positions are not public: we
#: assume layer 0 and every 7th layer after it (0, 7, ..., 63), i.e. 10 full +
#: 60 SWA.  Only the counts matter for memory accounting and hit rates.
PRESETS: dict[str, ModelSpec] = {
    "mimo-v2-flash": ModelSpec(
        "mimo-v2-flash", _kinds(48, [0, 5, 11, 17, 23, 29, 35, 41, 47]), 128,
        full=KVShape(4, 192, 128), swa=KVShape(8, 192, 128)),
    "mimo-v2.5": ModelSpec(
        "mimo-v2.5", _kinds(48, [0, 5, 11, 17, 23, 29, 35, 41, 47]), 128,
        full=KVShape(4, 192, 128), swa=KVShape(8, 192, 128)),
    "mimo-v2.5-pro": ModelSpec(
        "mimo-v2.5-pro", _kinds(70, range(0, 70, 7)), 128,
        full=KVShape(8, 192, 128), swa=KVShape(8, 192, 128)),
    # gpt-oss: layer_types alternate sliding (even) / full (odd), window 128.
    "gpt-oss-120b": ModelSpec(
        "gpt-oss-120b", _kinds(36, range(1, 36, 2)), 128,
        full=KVShape(8, 64, 64), swa=KVShape(8, 64, 64)),
    # Gemma-3: 5 local layers per global one (every 6th layer global), window 1024.
    "gemma-3-27b": ModelSpec(
        "gemma-3-27b", _kinds(62, range(5, 62, 6)), 1024,
        full=KVShape(16, 128, 128), swa=KVShape(16, 128, 128)),
}


def preset_names() -> list[str]:
    """Names accepted by :meth:`ModelSpec.preset`."""
    return sorted(PRESETS)

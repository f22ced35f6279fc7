"""Hugging Face ``config.json`` -> the attention specs a model's layers need.

A decoder model's layers fall into a few *kinds* (Gemma-2 alternates sliding-window and global
layers; gpt-oss alternates sliding and full layers, all with sinks); each kind needs one
:class:`~jitattn.spec.AttentionSpec`. :func:`load_model_config` reads the attention fields of a
config (field names as Hugging Face writes them; see ``examples/models/``) and returns the kinds
with their specs and layer indices; :func:`model_specs` returns just the distinct specs, which is
what ``jitattn warmup`` compiles.

How the fields map (all models here are decoders: every spec is ``causal=True``):

- heads: ``num_attention_heads`` (BLOOM/GPT-2 ``n_head``, MPT ``n_heads``) -> ``num_qo_heads``;
  ``num_key_value_heads`` (default: ``num_attention_heads``) -> ``num_kv_heads``.
- ``head_dim``, else ``hidden_size / num_attention_heads`` -> ``head_dim_qk`` (= ``head_dim_vo``).
- ``sm_scale``: ``query_pre_attn_scalar ** -0.5`` when present (Gemma; Gemma-2-27B has head_dim
  128 but scalar 144), else ``head_dim ** -0.5``.
- ``attn_logit_softcapping`` -> ``logits_soft_cap`` (null or absent: 0, off).
- ``sliding_window = W``: Hugging Face lets a query at ``i`` see keys ``j`` with ``i - j < W``;
  the spec's convention is ``p - j <= window_left``, so ``window_left = W - 1``.
- Which layers slide: explicit ``layer_types`` win over every rule; Gemma-2: even layers (layer
  0 slides); Gemma-3 (or any config with ``sliding_window_pattern``): layer ``i`` is global when
  ``(i + 1) % P == 0`` (``P`` default 6); Qwen2 / Qwen3: layers ``i >= max_window_layers`` when
  ``use_sliding_window`` is true (its default there is false), none otherwise (Qwen2-MoE: the even
  layers ``i < max_window_layers``); otherwise
  (Mistral, Phi-3, ...) every layer when ``sliding_window`` is not null (and
  ``use_sliding_window`` is not false), none when it is.
- Features the config has no key for come from the model type (:data:`IMPLIED_FEATURES`):
  ALiBi for BLOOM, MPT and Falcon with ``alibi: true``; sinks for gpt-oss.
- dtype: the ``dtype`` argument, else the config's ``torch_dtype`` / ``dtype``, else bfloat16.

- Tensor parallelism (``tensor_parallel_size=N``): each rank runs ``num_attention_heads / N`` query
  heads and ``num_key_value_heads / N`` KV heads, or one KV head (replicated) when there are fewer
  KV heads than ranks, as vLLM shards them (:func:`per_rank_heads`); heads that do not divide are
  an error. The specs are the per-rank ones: what a rank's kernels run.

Only the model types in :data:`MODEL_TYPES` are mapped (their attention is standard MHA/GQA/MQA
with the features above) and the multi-head latent attention (MLA) types of :data:`MLA_MODEL_TYPES`;
another ``model_type`` is an error listing them, rather than a guess. MLA fields on another model
type are an error too.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; :func:`mla_layer_kinds`): every layer has two
kinds, each listing every layer, as serving engines run them:

- ``"mla_decode"``: the absorbed form over the latent cache, a latent spec
  (``kv_storage="latent"``): ``num_qo_heads`` = ``num_attention_heads`` per rank, one KV head,
  ``head_dim_qk = kv_lora_rank + qk_rope_head_dim`` (576), ``head_dim_vo = kv_lora_rank`` (512),
  the ``page_size`` / ``kv_dtype`` arguments;
- ``"mla_prefill"``: the un-absorbed MHA of prefill (and chunked prefill) on ragged K/V
  (``kv_storage="ragged"``): ``num_attention_heads`` query and KV heads per rank,
  ``head_dim_qk = qk_nope_head_dim + qk_rope_head_dim`` (192), ``head_dim_vo = v_head_dim`` (128),
  16-bit K/V (decompressed from the latent by ``kv_b_proj``).

Both take ``sm_scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale ** 2`` when the
rope scaling is not the default one (YaRN) and has ``mscale_all_dim``, with ``mscale = 0.1 *
mscale_all_dim * ln(factor) + 1``: ``yarn_get_mscale`` / ``yarn_apply_mscale`` of transformers'
``modeling_deepseek_v3.py`` (also vLLM's and SGLang's ``deepseek_v2.py``). ``factor`` must be a finite
number >= 1 (transformers' YaRN rule) and ``mscale_all_dim`` a finite number >= 0.
``num_key_value_heads`` is not read (MLA has no separate KV heads).

A multimodal config whose attention fields sit under ``text_config`` (Gemma-3, Llava, ...) is read
from there. Missing fields are not filled from Hugging Face's class defaults: they raise.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jitattn.spec import QO_DTYPES, AttentionSpec, normalize_dtype

FULL = "full_attention"
SLIDING = "sliding_attention"
#: Layer kinds a ``layer_types`` entry may name (Hugging Face's spelling).
LAYER_TYPES = (FULL, SLIDING)

#: model_type -> spec features its config has no key for (the generic path would miss them).
IMPLIED_FEATURES: dict[str, Callable[[Mapping[str, Any]], dict[str, bool]]] = {
    "bloom": lambda cfg: {"alibi": True},
    # HF's MPT always applies ALiBi; its attn_config.alibi defaults to true.
    "mpt": lambda cfg: {"alibi": bool((cfg.get("attn_config") or {}).get("alibi", True))},
    "falcon": lambda cfg: {"alibi": bool(cfg.get("alibi", False))},
    "gpt_oss": lambda cfg: {"sinks": True},
}

#: The model types jitattn maps: their attention is the generic MHA/GQA/MQA of this module's rules,
#: plus what :data:`IMPLIED_FEATURES` adds. Another type is refused (its attention may differ).
MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2",
    "gemma3", "gemma3_text", "gpt_oss", "bloom", "mpt", "falcon",
)

#: Multi-head latent attention (DeepSeek-style): the model types mapped by :func:`mla_layer_kinds`, and
#: the fields that mark a config as MLA (refused on another model type).
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
#: The MLA fields every MLA config must have (positive ints).
MLA_REQUIRED = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: The two layer kinds of an MLA model (each lists every layer).
MLA_DECODE, MLA_PREFILL = "mla_decode", "mla_prefill"

#: Generic fields and the other names configs use for them, in lookup order.
_ALIASES = {
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
}
_DEFAULT_SLIDING_WINDOW_PATTERN = 6  # Gemma-3


@dataclass(frozen=True)
class LayerKind:
    """Layers of a model that share one attention spec.

    Attributes:
        name: the Hugging Face layer type, ``"full_attention"`` or ``"sliding_attention"``; for an MLA
            model :data:`MLA_DECODE` or :data:`MLA_PREFILL`.
        spec: the spec every layer of this kind needs.
        layers: 0-based indices of those layers, ascending.
    """

    name: str
    spec: AttentionSpec
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelAttention:
    """The attention a model needs, per layer kind, as read from its ``config.json``.

    Attributes:
        model_type: the config's ``model_type`` (of ``text_config`` for multimodal configs).
        name: the config's ``_name_or_path`` when present, else the file stem (or the model type
            for a dict input).
        num_layers: ``num_hidden_layers``.
        layer_kinds: one entry per layer kind, in order of each kind's first layer; their
            ``layers`` partition ``range(num_layers)`` (an MLA model: its two kinds list every layer each).
        tensor_parallel_size: the ranks the heads are split over; the specs hold one rank's heads.
    """

    model_type: str
    name: str
    num_layers: int
    layer_kinds: tuple[LayerKind, ...]
    tensor_parallel_size: int = 1

    def specs(self) -> list[AttentionSpec]:
        """The distinct specs, in order of the first layer that needs each."""
        out: list[AttentionSpec] = []
        for kind in self.layer_kinds:
            if kind.spec not in out:
                out.append(kind.spec)
        return out


def per_rank_heads(num_qo_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> tuple[int, int]:
    """``(query heads, KV heads)`` one rank runs when a model's heads are split over
    ``tensor_parallel_size`` ranks, as vLLM shards them: query heads divide evenly; KV heads divide
    evenly too, or, when there are fewer KV heads than ranks, each rank holds one (replicated, the
    ranks a multiple of the KV heads). Llama-3-70B (64 / 8) at TP 8: ``(8, 1)``; at TP 16: ``(4, 1)``.

    Raises:
        ValueError: a head count or ``tensor_parallel_size`` is not a positive int, or the heads do not
            split over it (the message names the numbers).
    """
    for name, n in (("num_attention_heads", num_qo_heads), ("num_key_value_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r}: expected a positive int")
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r}: expected a positive int")
    if num_qo_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp}: num_attention_heads={num_qo_heads} does not divide over "
                         f"{tp} ranks; expected a divisor of {num_qo_heads}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp}: num_key_value_heads={num_kv_heads} does not divide over "
                             f"{tp} ranks (with at least as many KV heads as ranks, each rank takes an equal share)")
        return num_qo_heads // tp, num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp}: {tp} ranks are not a multiple of num_key_value_heads="
                         f"{num_kv_heads} (with fewer KV heads than ranks, each KV head is replicated over an "
                         f"equal number of ranks)")
    return num_qo_heads // tp, 1


def load_model_config(config: str | os.PathLike | dict, *, dtype: str | None = None,
                      kv_layout: str = "NHD", page_size: int = 16, kv_dtype: str | None = None,
                      tensor_parallel_size: int = 1) -> ModelAttention:
    """Map a Hugging Face ``config.json`` to its layer kinds and their specs (module doc: how).

    Args:
        config: path to a ``config.json`` (or to the model directory holding it), or the parsed dict.
        dtype: ``"float16"`` / ``"bfloat16"`` (or a torch dtype) for every spec; overrides the
            config's ``torch_dtype`` / ``dtype``.
        kv_layout, page_size: passed to every spec (see :class:`~jitattn.spec.AttentionSpec`).
        kv_dtype: the KV cache's dtype for every spec, e.g. ``"float8_e4m3fn"`` for an FP8 cache (a
            serving choice the config does not record); None: the q dtype.
        tensor_parallel_size: ranks the heads are split over; the specs get one rank's heads
            (:func:`per_rank_heads`).

    Raises:
        FileNotFoundError: ``config`` is a path that does not exist, or a directory without config.json.
        ValueError: invalid JSON; a required field missing or invalid; a ``model_type`` not in
            :data:`MODEL_TYPES` or :data:`MLA_MODEL_TYPES`; MLA fields that are missing, invalid or do
            not fit (:func:`mla_layer_kinds`), or present on a non-MLA model type; a float32 config
            without a ``dtype`` argument; heads that do not split over
            ``tensor_parallel_size``; or a spec the kernels cannot serve (e.g. head_dim 72):
            AttentionSpec's message, prefixed with the config and the layer kind. Each message
            names the source.
    """
    raw, source = _read_config(config)
    cfg = _attention_fields(raw)
    model_type = _model_type(cfg, source)
    _reject_unsupported(cfg, model_type, source)
    num_layers = _int_field(cfg, "num_hidden_layers", source)
    if model_type in MLA_MODEL_TYPES:
        kinds = mla_layer_kinds(cfg, num_layers, source, q_dtype=_dtype(raw, cfg, dtype, source), page_size=page_size,
                                kv_layout=kv_layout, kv_dtype=kv_dtype, tensor_parallel_size=tensor_parallel_size)
        return ModelAttention(model_type, _model_name(raw, config), num_layers, kinds, tensor_parallel_size)
    base = _base_spec_args(cfg, model_type, source)
    try:
        base["num_qo_heads"], base["num_kv_heads"] = per_rank_heads(base["num_qo_heads"], base["num_kv_heads"],
                                                                    tensor_parallel_size)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    base.update(q_dtype=_dtype(raw, cfg, dtype, source), kv_layout=kv_layout, page_size=page_size, kv_dtype=kv_dtype)
    types = _layer_types(cfg, model_type, num_layers, source)
    kinds = tuple(_layer_kind(name, layers, base, cfg, source) for name, layers in _group(types))
    return ModelAttention(model_type, _model_name(raw, config), num_layers, kinds, tensor_parallel_size)


def model_specs(config: str | os.PathLike | dict, **kwargs: Any) -> list[AttentionSpec]:
    """The distinct specs a model needs: ``load_model_config(config, **kwargs).specs()``.

    Takes the same arguments and raises the same errors as :func:`load_model_config`.
    """
    return load_model_config(config, **kwargs).specs()


# ---- reading -----------------------------------------------------------------------------------
def _read_config(config: str | os.PathLike | Mapping) -> tuple[Mapping[str, Any], str]:
    """The parsed config and a label for error messages (the path, or a dict's name)."""
    if isinstance(config, Mapping):
        label = config.get("_name_or_path") or config.get("model_type") or "?"
        return config, f"config dict ({label})"
    path = Path(config)
    if path.is_dir():  # a Hugging Face model directory (a snapshot): its config.json
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: a directory without config.json (expected a Hugging Face config.json "
                                    f"file, or the model directory holding one)")
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: model config not found (expected a Hugging Face config.json file)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); expected a Hugging Face config.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level is a {type(data).__name__}; expected a JSON object (config.json)")
    return data, str(path)


def _attention_fields(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The mapping holding the attention fields: ``text_config`` for multimodal configs."""
    text = raw.get("text_config")
    if isinstance(text, Mapping) and not any(_has(raw, n) for n in _ALIASES["num_attention_heads"]):
        return {"model_type": raw.get("model_type"), **text}
    return raw


def _model_name(raw: Mapping[str, Any], config: Any) -> str:
    if raw.get("_name_or_path"):
        return str(raw["_name_or_path"])
    return str(raw.get("model_type")) if isinstance(config, Mapping) else Path(config).stem


def _has(cfg: Mapping[str, Any], key: str) -> bool:
    return cfg.get(key) is not None


def _model_type(cfg: Mapping[str, Any], source: str) -> str:
    if "model_type" not in cfg:
        raise ValueError(f"{source}: missing field model_type (it decides implied features such as ALiBi and sinks)")
    value = cfg["model_type"]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{source}: model_type={value!r}: expected a non-empty string (it decides implied "
                         f"features such as ALiBi and sinks)")
    return value


def _reject_unsupported(cfg: Mapping[str, Any], model_type: str, source: str) -> None:
    """Raise for attention the specs cannot express, or a model type not known to map, rather than
    map it to a wrong spec."""
    mla = [f"{f}={cfg[f]!r}" for f in MLA_FIELDS if _has(cfg, f)]
    if mla and model_type not in MLA_MODEL_TYPES:
        raise ValueError(f"{source}: model_type={model_type!r} with {', '.join(mla)}: multi-head latent attention "
                         f"fields on a model type jitattn maps as standard MHA/GQA; MLA is mapped for "
                         f"{', '.join(MLA_MODEL_TYPES)}")
    if model_type not in MODEL_TYPES + MLA_MODEL_TYPES:
        raise ValueError(f"{source}: model_type={model_type!r} is not a model type jitattn maps (its attention "
                         f"may differ from standard MHA/GQA in ways the config does not say); known: "
                         f"{', '.join(MODEL_TYPES + MLA_MODEL_TYPES)}")


# ---- fields ------------------------------------------------------------------------------------
def _lookup(cfg: Mapping[str, Any], field: str) -> tuple[str, Any]:
    """(name found, value) for a generic field or one of its aliases; value None if absent."""
    for name in _ALIASES.get(field, (field,)):
        if _has(cfg, name):
            return name, cfg[name]
    return field, None


def _int_field(cfg: Mapping[str, Any], field: str, source: str) -> int:
    """A required positive int field, or ValueError naming it (and its aliases) and the source."""
    name, value = _lookup(cfg, field)
    if value is None:
        names = "/".join(_ALIASES.get(field, (field,)))
        raise ValueError(f"{source}: missing field {names}: expected a positive int")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {name}={value!r}: expected a positive int")
    return value


def _number_field(cfg: Mapping[str, Any], field: str, source: str) -> float | None:
    """An optional positive number field (None when absent or null)."""
    value = cfg.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{source}: {field}={value!r}: expected a positive number or null")
    return float(value)


def _head_dim(cfg: Mapping[str, Any], num_heads: int, source: str) -> int:
    """``head_dim``, else ``hidden_size / num_attention_heads`` (which must divide evenly)."""
    if _has(cfg, "head_dim"):
        return _int_field(cfg, "head_dim", source)
    hidden = _int_field(cfg, "hidden_size", source)
    if hidden % num_heads:
        raise ValueError(f"{source}: hidden_size={hidden} is not a multiple of num_attention_heads={num_heads}; "
                         f"add head_dim to the config")
    return hidden // num_heads


def _num_kv_heads(cfg: Mapping[str, Any], model_type: str, num_heads: int, source: str) -> int:
    """``num_key_value_heads``, defaulting to ``num_attention_heads`` (Falcon: its own fields)."""
    if model_type == "falcon":  # HF FalconAttention: multi_query wins unless new_decoder_architecture
        if cfg.get("multi_query", True) and not cfg.get("new_decoder_architecture", False):
            return 1
        return _int_field(cfg, "num_kv_heads", source) if _has(cfg, "num_kv_heads") else num_heads
    if _has(cfg, "num_key_value_heads"):
        return _int_field(cfg, "num_key_value_heads", source)
    return num_heads


def _base_spec_args(cfg: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """AttentionSpec arguments every layer kind shares (all but the window and dtype/layout)."""
    num_heads = _int_field(cfg, "num_attention_heads", source)
    head_dim = _head_dim(cfg, num_heads, source)
    scalar = _number_field(cfg, "query_pre_attn_scalar", source)
    args: dict[str, Any] = dict(
        num_qo_heads=num_heads,
        num_kv_heads=_num_kv_heads(cfg, model_type, num_heads, source),
        head_dim_qk=head_dim,
        causal=True,
        sm_scale=(scalar if scalar is not None else head_dim) ** -0.5,
        logits_soft_cap=_number_field(cfg, "attn_logit_softcapping", source) or 0.0,
    )
    args.update(IMPLIED_FEATURES.get(model_type, lambda _: {})(cfg))
    return args


def _dtype(raw: Mapping[str, Any], cfg: Mapping[str, Any], override: Any, source: str) -> str:
    """The argument, else the config's ``torch_dtype`` / ``dtype``, else bfloat16."""
    if override is not None:
        return normalize_dtype(override, field="dtype", allowed=QO_DTYPES)
    field, value = next(((k, c[k]) for c in (cfg, raw) for k in ("torch_dtype", "dtype") if _has(c, k)),
                        ("torch_dtype", None))
    if value is None:
        return "bfloat16"
    if str(value) in ("float32", "torch.float32", "float", "fp32"):
        raise ValueError(f"{source}: {field}={value!r}: the kernels take float16 or bfloat16; choose the serving "
                         f"dtype: --dtype bfloat16 (or float16) on the command line, dtype=\"bfloat16\" in Python")
    try:
        return normalize_dtype(value, field=field, allowed=QO_DTYPES)
    except ValueError as err:
        raise ValueError(f"{source}: {err}; or choose the serving dtype: --dtype bfloat16 on the command line, "
                         f"dtype=\"bfloat16\" in Python") from None


# ---- layer kinds -------------------------------------------------------------------------------
#: Model types whose sliding layers follow ``use_sliding_window`` (default false) and
#: ``max_window_layers``, as Hugging Face's configs set ``layer_types``: Qwen2 / Qwen3 slide layers
#: ``i >= max_window_layers``, Qwen2-MoE the even layers ``i < max_window_layers``.
_MAX_WINDOW_LAYERS_TYPES = ("qwen2", "qwen3", "qwen2_moe")


def _layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int, source: str) -> list[str]:
    """Each layer's kind: explicit ``layer_types``, else the model type's sliding rule."""
    if cfg.get("layer_types") is not None:
        return _explicit_layer_types(cfg["layer_types"], num_layers, source)
    if model_type == "gemma2":
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    if model_type in ("gemma3", "gemma3_text") or _has(cfg, "sliding_window_pattern"):
        period = cfg.get("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN)
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"{source}: sliding_window_pattern={period!r}: expected a positive int")
        return [FULL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]
    if model_type in _MAX_WINDOW_LAYERS_TYPES:
        # Hugging Face's Qwen2 / Qwen3: use_sliding_window defaults to false; when true, only the
        # layers from max_window_layers on slide (the first max_window_layers are full).
        if not (_has(cfg, "sliding_window") and cfg.get("use_sliding_window", False) is True):
            return [FULL] * num_layers
        first = cfg.get("max_window_layers")
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"{source}: max_window_layers={first!r}: with use_sliding_window=true, "
                             f"{model_type} needs an int >= 0 (layers from it on slide)")
        if model_type == "qwen2_moe":  # its own rule: even layers below max_window_layers
            return [SLIDING if i % 2 == 0 and i < first else FULL for i in range(num_layers)]
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    slides = _has(cfg, "sliding_window") and cfg.get("use_sliding_window", True) is not False
    return [SLIDING if slides else FULL] * num_layers


def _explicit_layer_types(types: Any, num_layers: int, source: str) -> list[str]:
    if not isinstance(types, list) or len(types) != num_layers:
        got = len(types) if isinstance(types, list) else type(types).__name__
        raise ValueError(f"{source}: layer_types has {got} entries: expected a list of num_hidden_layers="
                         f"{num_layers} entries")
    for i, name in enumerate(types):
        if name not in LAYER_TYPES:
            raise ValueError(f"{source}: layer_types[{i}]={name!r}: expected one of {LAYER_TYPES}")
    return list(types)


def _group(types: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, layer indices) per distinct kind, in order of first layer."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(types):
        groups.setdefault(name, []).append(i)
    return [(name, tuple(layers)) for name, layers in groups.items()]


def _window_left(cfg: Mapping[str, Any], source: str) -> int:
    """``sliding_window - 1``: HF's ``i - j < W`` as the spec's ``p - j <= window_left``."""
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{source}: sliding_window={window!r}: sliding_attention layers need a positive int")
    return window - 1


def _layer_kind(name: str, layers: tuple[int, ...], base: dict[str, Any], cfg: Mapping[str, Any],
                source: str) -> LayerKind:
    """Build one kind's spec; AttentionSpec's ValueError gains the source and the kind."""
    window_left = _window_left(cfg, source) if name == SLIDING else -1
    try:
        spec = AttentionSpec(**base, window_left=window_left)
    except ValueError as err:
        raise ValueError(f"{source}: layer kind {name!r} (layers {_span(layers)}): {err}") from err
    return LayerKind(name, spec, layers)


def _span(layers: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, layers[:6]))
    return shown + (f", ... ({len(layers)} layers)" if len(layers) > 6 else "")


# ---- multi-head latent attention ---------------------------------------------------------------
def mla_sm_scale(cfg: Mapping[str, Any], source: str) -> float:
    """An MLA config's softmax scale (module doc): ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``,
    times ``mscale ** 2`` under a non-default rope scaling with ``mscale_all_dim`` (transformers'
    ``yarn_apply_mscale``, ``modeling_deepseek_v3.py``). Reads ``rope_scaling``, else ``rope_parameters``.

    Raises:
        ValueError: a head dim missing or not a positive int; a rope scaling that is not an object, or
            a YaRN one whose ``mscale_all_dim`` is not a finite number >= 0, or (with ``mscale_all_dim``
            nonzero) whose ``factor`` is not a finite number >= 1, naming ``rope_scaling.<field>``.
    """
    qk = _int_field(cfg, "qk_nope_head_dim", source) + _int_field(cfg, "qk_rope_head_dim", source)
    name = "rope_scaling" if _has(cfg, "rope_scaling") else "rope_parameters"
    rope = cfg.get(name)
    if rope is None:
        return qk ** -0.5
    if not isinstance(rope, Mapping):
        raise ValueError(f"{source}: {name}={rope!r}: expected an object or null")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default" or rope.get("mscale_all_dim") is None:
        return qk ** -0.5
    all_dim = _yarn_number(rope, name, "mscale_all_dim", 0, source)
    if all_dim == 0:
        return qk ** -0.5
    factor = _yarn_number(rope, name, "factor", 1, source)
    mscale = 0.1 * all_dim * math.log(factor) + 1.0
    return qk ** -0.5 * mscale * mscale


def _yarn_number(rope: Mapping[str, Any], name: str, field: str, least: int, source: str) -> float:
    """A YaRN field of ``rope`` (the config's ``name`` object): a finite number >= ``least``, else ValueError."""
    value = rope.get(field)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < least:
        raise ValueError(f"{source}: {name}.{field}={value!r}: expected a finite number >= {least} (YaRN: factor >= 1, "
                         f"mscale_all_dim >= 0; the softmax scale is (0.1 * mscale_all_dim * ln(factor) + 1) ** 2)")
    return float(value)


def mla_layer_kinds(cfg: Mapping[str, Any], num_layers: int, source: str, *, q_dtype: str, page_size: int = 16,
                    kv_layout: str = "NHD", kv_dtype: str | None = None,
                    tensor_parallel_size: int = 1) -> tuple[LayerKind, LayerKind]:
    """The two layer kinds of an MLA config (module doc): :data:`MLA_DECODE` (the latent spec) and
    :data:`MLA_PREFILL` (the ragged MHA spec), each over every layer, with one rank's heads.

    Raises:
        ValueError: a field of :data:`MLA_REQUIRED` missing or not a positive int; ``v_head_dim`` above
            ``qk_nope_head_dim`` (no MLA model's layout); heads that do not split over the ranks; or a
            spec field AttentionSpec refuses (its message, with the source and the kind).
    """
    missing = [f for f in MLA_REQUIRED if not _has(cfg, f)]
    if missing:
        raise ValueError(f"{source}: multi-head latent attention config without {', '.join(missing)}: an MLA "
                         f"config needs {', '.join(MLA_REQUIRED)} (positive ints)")
    rank, nope, rope, v = (_int_field(cfg, f, source) for f in MLA_REQUIRED)
    if v > nope:
        raise ValueError(f"{source}: v_head_dim={v} > qk_nope_head_dim={nope}: in DeepSeek-style MLA the value head "
                         f"is no wider than the query/key head's no-rope part (DeepSeek-V2/V3, Kimi-K2: 128 / 128)")
    heads = _int_field(cfg, "num_attention_heads", source)
    try:
        heads = per_rank_heads(heads, heads, tensor_parallel_size)[0]
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    scale = mla_sm_scale(cfg, source)
    shared = dict(num_qo_heads=heads, q_dtype=q_dtype, causal=True, sm_scale=scale)
    decode = dict(shared, num_kv_heads=1, head_dim_qk=rank + rope, head_dim_vo=rank, kv_storage="latent",
                  page_size=page_size, kv_layout=kv_layout, kv_dtype=kv_dtype)
    prefill = dict(shared, num_kv_heads=heads, head_dim_qk=nope + rope, head_dim_vo=v, kv_storage="ragged")
    layers = tuple(range(num_layers))
    out = []
    for name, args in ((MLA_DECODE, decode), (MLA_PREFILL, prefill)):
        try:
            out.append(LayerKind(name, AttentionSpec(**args), layers))
        except ValueError as err:
            raise ValueError(f"{source}: layer kind {name!r} (kv_lora_rank={rank}, qk_nope_head_dim={nope}, "
                             f"qk_rope_head_dim={rope}, v_head_dim={v}): {err}") from err
    return out[0], out[1]


# ---- cross-check with transformers -------------------------------------------------------------
@dataclass(frozen=True)
class ConfigDifference:
    """One field on which jitattn's reading of a config and transformers' ``AutoConfig`` disagree.

    Attributes:
        field: the spec field (``num_kv_heads``, ``window_left``, ...) or ``num_layers`` / ``q_dtype``.
        layers: the 0-based layers where the two differ this way (empty for model-wide fields).
        jitattn: the value :func:`load_model_config` gives.
        transformers: the value transformers' config class gives.
        source: the transformers attributes that value comes from.
    """

    field: str
    layers: tuple[int, ...]
    jitattn: Any
    transformers: Any
    source: str

    def __str__(self) -> str:
        where = f" (layers {_span(self.layers)})" if self.layers else ""
        return (f"{self.field}{where}: jitattn reads {self.jitattn!r}, transformers {self.transformers!r} "
                f"(from {self.source})")


#: What transformers' modeling code for these model types always applies, with no config key
#: (BloomModel and MptModel always build an ALiBi bias; GptOssAttention always has ``sinks``).
_TRANSFORMERS_MODEL_FEATURES: dict[str, dict[str, bool]] = {
    "bloom": {"alibi": True},
    "mpt": {"alibi": True},
    "gpt_oss": {"sinks": True},
}


def compare_with_transformers(config: str | os.PathLike | dict, *, dtype: str | None = None
                              ) -> list[ConfigDifference]:
    """Read ``config`` with transformers' ``AutoConfig`` too and list where it disagrees with jitattn.

    transformers' config classes are the authority on what a model runs: their class defaults fill
    fields a ``config.json`` leaves out, their attribute maps rename fields (BLOOM's ``n_head``), and
    their ``__post_init__`` derives ``layer_types`` (Gemma-2, Gemma-3, Qwen2, ...). Compared, per layer:
    ``num_qo_heads``, ``num_kv_heads``, ``head_dim_qk`` / ``head_dim_vo``, ``sm_scale`` (from
    ``query_pre_attn_scalar``), ``logits_soft_cap`` (``attn_logit_softcapping``), ``window_left`` (from
    ``layer_types`` / ``sliding_window``), ``alibi`` (Falcon's ``alibi``; always for BLOOM and MPT) and
    ``sinks`` (always for gpt-oss); and ``num_layers`` and, without ``dtype``, the config's dtype. Only
    fields the config class declares count (a stray key transformers ignores is not read there).
    RoPE (``rope_scaling`` / ``rope_parameters``) is not compared: no spec field holds it. An MLA config
    compares each of its two kinds, every layer, with the heads, head dims and softmax ``scaling`` of
    transformers' own attention module built for the config on the meta device (its YaRN mscale included).

    Reads local files only (no hub access); a file or dict is copied as ``config.json`` into a
    temporary directory, since ``AutoConfig`` reads a directory.

    Args:
        config: as :func:`load_model_config`: a ``config.json`` path, its directory, or the parsed dict.
        dtype: as :func:`load_model_config` (then the dtype is not compared).

    Returns:
        The differences, empty when both readings agree.

    Raises:
        ImportError: transformers is not installed (``pip install transformers``).
        ValueError: jitattn refuses the config (:func:`load_model_config`'s errors), or transformers
            cannot read it (e.g. a ``model_type`` it does not know), naming the config.
        FileNotFoundError: as :func:`load_model_config`.
    """
    import tempfile

    try:
        from transformers import AutoConfig
    except ImportError:
        raise ImportError("compare_with_transformers needs transformers (pip install transformers)") from None
    ours = load_model_config(config, dtype=dtype)
    raw, source = _read_config(config)
    with tempfile.TemporaryDirectory(prefix="jitattn-config-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(dict(raw)), encoding="utf-8")
        try:
            hf = AutoConfig.from_pretrained(str(folder), local_files_only=True).get_text_config(decoder=True)
        except Exception as err:  # its validators raise their own classes (e.g. StrictDataclassClassValidationError)
            raise ValueError(f"{source}: transformers' AutoConfig cannot read it: {err}") from None
    mla = ours.model_type in MLA_MODEL_TYPES
    theirs, num_layers, hf_dtype = _mla_transformers_reading(hf, ours) if mla else \
        _transformers_reading(hf, ours.model_type)

    out = []
    if num_layers != ours.num_layers:
        out.append(ConfigDifference("num_layers", (), ours.num_layers, num_layers, "num_hidden_layers"))
    first = ours.layer_kinds[0].spec
    if dtype is None and hf_dtype is not None and hf_dtype != first.q_dtype:
        out.append(ConfigDifference("q_dtype", (), first.q_dtype, hf_dtype, "dtype"))
    spec_of = {i: kind.spec for kind in ours.layer_kinds for i in kind.layers}
    # (layer, our spec, their reading): an MLA model's layers are compared once per kind
    triples = ([(i, kind.spec, layer) for kind in ours.layer_kinds
                for i, layer in enumerate(theirs[kind.name][:ours.num_layers])]
               if mla else [(i, spec_of[i], layer) for i, layer in enumerate(theirs[:ours.num_layers])])
    found: dict[tuple[str, Any, Any, str], list[int]] = {}
    for i, spec, layer in triples:
        for name, (value, origin) in layer.items():
            mine = getattr(spec, name)
            same = (math.isclose(mine, value, rel_tol=1e-12) if isinstance(value, float) else mine == value)
            if not same:
                found.setdefault((name, mine, value, origin), []).append(i)
    out += [ConfigDifference(name, tuple(dict.fromkeys(layers)), mine, value, origin)
            for (name, mine, value, origin), layers in found.items()]
    return out


def _mla_transformers_reading(hf: Any, ours: ModelAttention
                              ) -> tuple[dict[str, list[dict[str, tuple[Any, str]]]], int, str | None]:
    """:func:`_transformers_reading` of an MLA config, per kind (:data:`MLA_DECODE` / :data:`MLA_PREFILL`):
    the heads, head dims and ``scaling`` of transformers' own attention module for the config, built on
    the meta device (no weights), so the softmax scale is the one its model code computes."""
    import importlib

    import torch

    module = importlib.import_module(type(hf).__module__.replace(".configuration_", ".modeling_"))
    cls = getattr(module, type(hf).__name__.removesuffix("Config") + "Attention")
    with torch.device("meta"):
        attn = cls(hf, layer_idx=0)
    scale = (float(attn.scaling), f"{cls.__name__}.scaling")
    heads = (attn.num_heads, "num_attention_heads")
    decode = {"num_qo_heads": heads, "num_kv_heads": (1, "MLA: one latent row per token"),
              "head_dim_qk": (hf.kv_lora_rank + hf.qk_rope_head_dim, "kv_lora_rank + qk_rope_head_dim"),
              "head_dim_vo": (hf.kv_lora_rank, "kv_lora_rank"), "sm_scale": scale}
    prefill = {"num_qo_heads": heads, "num_kv_heads": (attn.num_heads, "num_attention_heads (K/V per head)"),
               "head_dim_qk": (attn.qk_head_dim, f"{cls.__name__}.qk_head_dim"),
               "head_dim_vo": (hf.v_head_dim, "v_head_dim"), "sm_scale": scale}
    n = hf.num_hidden_layers
    hf_dtype = getattr(hf, "dtype", None)
    return ({MLA_DECODE: [decode] * n, MLA_PREFILL: [prefill] * n}, n,
            str(hf_dtype).removeprefix("torch.") if hf_dtype is not None else None)


def _transformers_reading(hf: Any, model_type: str) -> tuple[list[dict[str, tuple[Any, str]]], int, str | None]:
    """Per layer, spec field -> (value, the transformers attributes it comes from); the layer
    count; the dtype name (None when the config has none)."""
    import dataclasses

    declared = ({f.name for f in dataclasses.fields(hf)} | set(getattr(hf, "attribute_map", {}))
                if dataclasses.is_dataclass(hf) else set(vars(hf)))

    def attr(name: str) -> Any:
        return getattr(hf, name, None) if name in declared or hasattr(type(hf), name) else None

    heads = hf.num_attention_heads
    if model_type == "falcon":  # FalconAttention: one KV head unless new_decoder_architecture or not multi_query
        kv = (hf.num_kv_heads if hf.new_decoder_architecture or not hf.multi_query else 1,
              "num_kv_heads, multi_query, new_decoder_architecture")
    else:
        kv = (attr("num_key_value_heads") or heads, "num_key_value_heads")
    head_dim = attr("head_dim") or hf.hidden_size // heads
    scalar = attr("query_pre_attn_scalar")
    shared: dict[str, tuple[Any, str]] = {
        "num_qo_heads": (heads, "num_attention_heads"),
        "num_kv_heads": kv,
        "head_dim_qk": (head_dim, "head_dim"),
        "head_dim_vo": (head_dim, "head_dim"),
        "sm_scale": (float(scalar if scalar is not None else head_dim) ** -0.5, "query_pre_attn_scalar, head_dim"),
        "logits_soft_cap": (float(attr("attn_logit_softcapping") or 0.0), "attn_logit_softcapping"),
    }
    always = _TRANSFORMERS_MODEL_FEATURES.get(model_type, {})
    for feature, value in always.items():
        shared[feature] = (value, f"{type(hf).__name__}'s model code")
    if model_type == "falcon":
        shared["alibi"] = (bool(hf.alibi), "alibi")
    window, types = attr("sliding_window"), attr("layer_types")
    num_layers = hf.num_hidden_layers
    if types is None:  # no per-layer kinds: transformers slides every layer when sliding_window is set
        types = [SLIDING if window else FULL] * num_layers
    layers = []
    for kind in types:
        left = window - 1 if kind == SLIDING and window else -1
        layers.append({**shared, "window_left": (left, "layer_types, sliding_window")})
    hf_dtype = getattr(hf, "dtype", None)
    return layers, num_layers, (str(hf_dtype).removeprefix("torch.") if hf_dtype is not None else None)

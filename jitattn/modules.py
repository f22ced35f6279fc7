"""The module protocol: what the cache, the build and the command line ask of a compiled module.

A *module* is one rendered CUDA source compiled to one cubin per arch: an attention kernel set for
one :class:`~jitattn.spec.AttentionSpec`, or a utility module such as ``merge_state``
(:class:`~jitattn.merge_module.MergeModule`), ``append_kv`` (:class:`~jitattn.append_kv_module.AppendKvModule`). Every kind satisfies :class:`KernelModule`, and
:data:`KINDS` holds, per kind, how to read it back from its JSON and how to render it. The cache,
the build and the CLI go through :func:`render`, :func:`from_json` and :func:`kind_of` only, so a
new kind of module is one row of :data:`KINDS`, not a new switch.

A module's JSON names its kind in ``"kind"``; an attention spec's JSON has no ``kind`` field
(it is the default, :data:`ATTENTION`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from jitattn import append_kv_module as _append
from jitattn import merge_module as _merge
from jitattn import render as _render
from jitattn.spec import AttentionSpec

#: The kind of an attention spec (its JSON carries no ``kind`` field).
ATTENTION = "attention"


@runtime_checkable
class KernelModule(Protocol):
    """A compiled module as the cache sees it: hashable, with a canonical JSON form.

    Members:
        name: readable, filesystem-safe, unique per canonical JSON (``merge_state_bf16_1a2b3c4d``).
        canonical_json(): sorted keys, no whitespace: what the cache key hashes and what
            ``jitattn warmup --spec`` takes back.
        to_json(): the same as a dict (``"kind"`` names a non-attention kind).
        describe(): one line for people (tables, errors).
    """

    @property
    def name(self) -> str: ...

    def canonical_json(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ModuleKind:
    """One kind of module: its Python type, how to read its JSON and how to render its source.

    Attributes:
        name: the ``"kind"`` its JSON carries (:data:`ATTENTION` carries none).
        type: the class whose instances are this kind.
        from_json: JSON dict -> module; raises ValueError / TypeError / KeyError on bad input.
        render: module -> :class:`~jitattn.render.RenderedSource`.
        kernel_names: role -> the entry point's name in the cubin (``{"decode": "jitattn_decode", ...}``).
    """

    name: str
    type: type
    from_json: Callable[[Mapping[str, Any]], KernelModule]
    render: Callable[[Any], _render.RenderedSource]
    kernel_names: Mapping[str, str]


#: Every module kind, by name.
KINDS: dict[str, ModuleKind] = {k.name: k for k in (
    ModuleKind(ATTENTION, AttentionSpec, AttentionSpec.from_json, _render.render, _render.KERNEL_NAMES),
    ModuleKind(_merge.KIND, _merge.MergeModule, _merge.MergeModule.from_json, _merge.MergeModule.render,
               _merge.KERNEL_NAMES),
    ModuleKind(_append.KIND, _append.AppendKvModule, _append.AppendKvModule.from_json, _append.AppendKvModule.render,
               _append.KERNEL_NAMES),
)}
_BY_TYPE = {k.type: k for k in KINDS.values()}


def kind_of(module: KernelModule) -> ModuleKind:
    """The kind of ``module``.

    Raises:
        TypeError: not an instance of a kind in :data:`KINDS`.
    """
    kind = _BY_TYPE.get(type(module))
    if kind is None:
        raise TypeError(f"{type(module).__name__} is not a jitattn module kind; known: "
                        f"{', '.join(k.type.__name__ for k in KINDS.values())}")
    return kind


def from_json(data: Mapping[str, Any]) -> KernelModule:
    """The module a JSON dict describes (its ``"kind"``, default :data:`ATTENTION`).

    Raises:
        ValueError: an unknown ``kind`` (the known ones are listed), or the kind's own error for
            bad fields (TypeError / KeyError too, as the kind's ``from_json`` raises them).
    """
    name = data.get("kind", ATTENTION) if isinstance(data, Mapping) else ATTENTION
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"kind={name!r}: unknown module kind; expected one of {sorted(KINDS)} "
                         f"(an attention spec has no kind field)")
    return kind.from_json(data)


def render(module: KernelModule) -> _render.RenderedSource:
    """The CUDA source of ``module``, rendered by its kind's renderer.

    Raises:
        TypeError: not a module kind. FileNotFoundError: the templates are missing.
    """
    return kind_of(module).render(module)

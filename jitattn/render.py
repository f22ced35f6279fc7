"""Render: an AttentionSpec becomes one CUDA source file, its functors injected.

The templates (``templates/`` in a checkout, ``jitattn/templates`` in a wheel) are plain CUDA
headers plus one jinja2 file, ``attention.cu.j2``, which substitutes only types, constants and the
functor expressions; tile shapes live in the headers' traits structs.

The kernel arguments travel as one ``__grid_constant__`` struct. :data:`BASE_FIELDS` plus the
variant's parameters define it; the same list renders the C++ struct and gives the host its byte
layout (:func:`params_layout`), and the rendered source ``static_assert``\\ s the size, so the two
sides cannot drift apart.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from jitattn.spec import AttentionSpec
from jitattn.variant import builtin_symbols, builtin_transforms, structural_mask, trace_hook

TEMPLATE_NAME = "attention.cu.j2"
RENDERED_FILE = "kernel.cu"

CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float8_e4m3fn": "__nv_fp8_e4m3"}

#: Kernel entry points in every rendered module (one module per spec, so plain names suffice).
KERNEL_NAMES = {
    "decode": "jitattn_decode",
    "prefill": "jitattn_prefill",
    "geometry": "jitattn_geometry",
}


@dataclass(frozen=True)
class Field:
    """One member of the kernel's ``Params`` struct.

    ``kind`` is the host-side packing: ``ptr`` (8-byte device address), ``i64``, ``i32`` or ``f32``.
    """

    name: str
    kind: str
    cuda_type: str
    doc: str = ""

    @property
    def size(self) -> int:
        return 8 if self.kind in ("ptr", "i64") else 4


#: Fixed members; ``{q}``, ``{kv}``, ``{o}`` are replaced by the spec's element types. Strides are in elements.
BASE_FIELDS: tuple[Field, ...] = (
    Field("q", "ptr", "const {q}*", "(total_q, num_qo_heads, head_dim_qk)"),
    Field("kv_cache", "ptr", "const {kv}*", "paged cache, NHD or HND"),
    Field("o", "ptr", "{o}*", "(total_q, num_qo_heads, head_dim_vo)"),
    Field("lse", "ptr", "float*", "(total_q, num_qo_heads) natural log, or null"),
    Field("block_table", "ptr", "const int*", "(batch, block_table_stride)"),
    Field("seq_lens", "ptr", "const int*", "(batch,)"),
    Field("query_start_loc", "ptr", "const int*", "(batch + 1,)"),
    Field("sinks", "ptr", "const float*", "(num_qo_heads,) or null"),
    Field("alibi_slopes", "ptr", "const float*", "(num_qo_heads,) or null"),
    Field("k", "ptr", "const {kv}*", "ragged K (total_kv, num_kv_heads, head_dim_qk), last dim contiguous"),
    Field("v", "ptr", "const {kv}*", "ragged V (total_kv, num_kv_heads, head_dim_vo), last dim contiguous"),
    Field("kv_start_loc", "ptr", "const int*", "ragged: (batch + 1,) cumulative KV lengths"),
    Field("query_positions", "ptr", "const int*",
          "explicit positions: (total_q,) each query token's position in its sequence's key frame"),
    Field("functor_batch", "ptr", "const int*", "explicit positions: (total_q,) the batch index its hooks see"),
    Field("position_offset", "ptr", "const int*",
          "explicit positions: (batch,) added to the query and key positions the hooks see"),
    Field("partial_o", "ptr", "float*", "split-KV workspace (num_splits, batch, num_qo_heads, head_dim_vo)"),
    Field("partial_lse", "ptr", "float*", "split-KV workspace (num_splits, batch, num_qo_heads), base 2"),
    Field("split_counters", "ptr", "int*",
          "split-KV: zeroed int per (sequence, kv head); the last split merges"),
    Field("q_stride_token", "i64", "long long", "elements between consecutive query tokens"),
    Field("q_stride_head", "i64", "long long", "elements between consecutive query heads (prefill)"),
    Field("k_stride_token", "i64", "long long", "ragged: elements between consecutive K tokens"),
    Field("k_stride_head", "i64", "long long", "ragged: elements between consecutive K heads"),
    Field("v_stride_token", "i64", "long long", "ragged: elements between consecutive V tokens"),
    Field("v_stride_head", "i64", "long long", "ragged: elements between consecutive V heads"),
    Field("kv_stride_page", "i64", "long long", "elements between consecutive pages"),
    Field("kv_stride_kv", "i64", "long long", "elements from a page's K to its V"),
    Field("block_table_stride", "i32", "int", "elements between block_table rows"),
    Field("batch_size", "i32", "int"),
    Field("total_q", "i32", "int", "rows of q; query_start_loc entries past it mark a sequence invalid"),
    Field("num_pages", "i32", "int", "pages in kv_cache; block_table entries past it mark a sequence invalid"),
    Field("total_kv", "i32", "int", "ragged: rows of k and v; kv_start_loc entries past it mark a sequence invalid"),
    Field("num_splits", "i32", "int", "split-KV factor of the decode launch"),
    Field("prefill_skip_decode_rows", "i32", "int", "1: the prefill kernel leaves one-query sequences to decode"),
    Field("k_scale", "f32", "float", "FP8 cache: K = stored * k_scale (1 otherwise)"),
    Field("v_scale", "f32", "float", "FP8 cache: V = stored * v_scale (1 otherwise)"),
)


def params_fields(spec: AttentionSpec) -> tuple[Field, ...]:
    """All ``Params`` members for a spec, 8-byte members first (so the layout has no holes)."""
    types = {"q": CTYPES[spec.q_dtype], "kv": CTYPES[spec.kv_dtype], "o": CTYPES[spec.o_dtype]}
    base = [Field(f.name, f.kind, f.cuda_type.format(**types), f.doc) for f in BASE_FIELDS]
    extra = []
    for p in spec.params:
        kind = "ptr" if not p.is_scalar else ("i32" if p.dtype == "int32" else "f32")
        extra.append(Field(p.name, kind, p.cuda_type, f"variant parameter {p.dtype}{list(p.shape)}"))
        if not p.is_scalar:  # bounds of the checked reads (jitattn::read_param)
            extra.append(Field(f"{p.name}__numel", "i32", "int", f"elements of {p.name}"))
    fields = base + extra
    return tuple(sorted(fields, key=lambda f: -f.size))  # stable: declared order within a size


def stride_fields(tensor: str, *dims: str, docs: dict[str, str] | None = None) -> tuple[Field, ...]:
    """The ``<tensor>_stride_<dim>`` members (``long long``, in elements) of a fixed module's ``Params``,
    in the order of ``dims``; ``docs`` gives a dim's comment."""
    return tuple(Field(f"{tensor}_stride_{d}", "i64", "long long", (docs or {}).get(d, "")) for d in dims)


def typed_fields(fields: Iterable[Field], **types: str) -> tuple[Field, ...]:
    """A fixed module's ``Params`` members (``merge_state``, ``append_kv``) with their element-type
    placeholders (``{t}``, ``{s}``...) filled from ``types``, 8-byte members first (so the layout has no holes)."""
    typed = [Field(f.name, f.kind, f.cuda_type.format(**types), f.doc) for f in fields]
    return tuple(sorted(typed, key=lambda f: -f.size))  # stable: declared order within a size


def render_fixed(template_name: str, fields: tuple[Field, ...], names: dict[str, str], **values: Any) -> RenderedSource:
    """A fixed module's source: ``template_name`` rendered with its ``Params`` members (``fields``,
    ``params_size``), its kernel entry points (``names``) and the template's other ``values``.

    Raises:
        FileNotFoundError: the templates are missing.
    """
    _, size = params_layout(fields)
    text = template(template_name).render(fields=fields, params_size=size, names=names, **values)
    return RenderedSource(text, fields, size, dict(names))


def params_layout(fields: tuple[Field, ...]) -> tuple[list[tuple[Field, int]], int]:
    """Byte offset of each field and the struct size (C rules: natural alignment, size rounded to 8)."""
    offset, placed = 0, []
    for f in fields:
        offset = -(-offset // f.size) * f.size
        placed.append((f, offset))
        offset += f.size
    return placed, -(-offset // 8) * 8


@dataclass(frozen=True)
class RenderedSource:
    """A rendered kernel source and what the host needs to call it."""

    text: str
    fields: tuple[Field, ...]
    params_size: int
    names: dict[str, str]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def template_dir() -> Path:
    """The templates: ``jitattn/templates`` in an installed wheel, ``templates/`` in a checkout.

    Raises:
        FileNotFoundError: neither exists (a broken install), with both paths.
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / TEMPLATE_NAME).is_file():
            return candidate
    raise FileNotFoundError(
        f"jitattn templates not found: looked for {TEMPLATE_NAME} in {here / 'templates'} and "
        f"{here.parent / 'templates'}; reinstall jitattn")


@lru_cache(maxsize=None)
def _template_files_digest(directory: str) -> tuple[tuple[str, str], ...]:
    out = []
    for path in sorted(Path(directory).iterdir()):
        if path.suffix in (".cuh", ".j2", ".h", ".cu"):
            out.append((path.name, hashlib.sha256(path.read_bytes()).hexdigest()))
    return tuple(out)


def template_hashes() -> dict[str, str]:
    """sha256 of every template and header file: part of the cache key, so editing one rebuilds."""
    return dict(_template_files_digest(str(template_dir())))


def _cfloat(x: float) -> str:
    return f"{float(x):.9e}f"


def _cbool(x: bool) -> str:
    return "true" if x else "false"


def template(name: str):
    """The jinja2 template ``name`` of :func:`template_dir`, in jitattn's environment (strict
    undefined names; ``cfloat`` / ``cbool`` / ``ctype`` helpers): what every module kind renders from.

    Raises:
        jinja2.TemplateNotFound: no such template.
    """
    return _environment(str(template_dir())).get_template(name)


@lru_cache(maxsize=4)
def _environment(directory: str):
    import jinja2  # here, not at import: a serving node that only loads cached kernels never renders

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(directory), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.globals.update(cfloat=_cfloat, cbool=_cbool, ctype=CTYPES)
    return env


_RESTORE = re.compile(r'^#line __RESTORE_LINE__ "__RENDERED_FILE__"$')


def _restore_line_directives(text: str) -> str:
    """After a functor's ``#line 1 "<functor>"``, point nvcc back at the rendered file's true lines."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if _RESTORE.match(line):
            lines[i] = f'#line {i + 2} "{RENDERED_FILE}"'
    return "\n".join(lines)


@dataclass(frozen=True)
class Functor:
    """One expression injected into the Spec struct: its name (for errors) and its C++ text."""

    name: str
    expr: str


def functors(spec: AttentionSpec) -> dict[str, object]:
    """Every functor the kernels call for ``spec``: the built-in ones (soft-cap, ALiBi, the causal /
    window bounds, traced from jitattn/variant.py) and the variant's hooks.

    Returns:
        ``transform_chain`` (list of Functor, applied in order to the logit), ``structural_mask``,
        ``logits_mask``, ``query_transform``, ``key_transform``, ``output_transform`` (Functor or
        None) and ``softmax`` (bool).
    """
    chain = [Functor(name, trace_hook("logits_transform", fn, builtin_symbols()))
             for name, fn in builtin_transforms(spec)]
    variant = spec.variant
    hooks = dict(variant.cuda) if variant else {}
    if "logits_transform" in hooks:
        chain.append(Functor("logits_transform", hooks["logits_transform"]))
    bounds = structural_mask(spec.causal, spec.window_left, spec.window_right)
    out: dict[str, object] = {
        "transform_chain": chain,
        "structural_mask": Functor("structural_mask", trace_hook("logits_mask", bounds, {})) if bounds else None,
        "softmax": variant.softmax if variant else True,
    }
    for hook in ("logits_mask", "query_transform", "key_transform", "output_transform"):
        out[hook] = Functor(hook, hooks[hook]) if hook in hooks else None
    return out


#: Names a compile error can point at (the ``#line`` file names of the injected functors).
FUNCTOR_NAMES = ("soft_cap", "alibi", "logits_transform", "logits_mask", "structural_mask", "query_transform",
                 "key_transform", "output_transform")


def render(spec: AttentionSpec) -> RenderedSource:
    """Render the CUDA source of one spec (decode and prefill kernels in one module; a latent (MLA) spec's
    module holds its decode kernel only, templates/mla_decode.cuh).

    The attention kind's renderer; :func:`jitattn.modules.render` renders a module of any kind.

    Raises:
        FileNotFoundError: the templates are missing.
        jinja2.TemplateError: a broken template (a bug in jitattn, not in the spec).
    """
    fields = params_fields(spec)
    _, size = params_layout(fields)
    context = {"spec": spec, "fields": fields, "params_size": size, "names": KERNEL_NAMES, **functors(spec)}
    text = template(TEMPLATE_NAME).render(**context)
    return RenderedSource(_restore_line_directives(text), fields, size, dict(KERNEL_NAMES))


def functor_at(text: str, line: int) -> str | None:
    """The functor whose ``>>> functor`` region of the rendered text holds 1-based ``line``, if any."""
    current = None
    for i, content in enumerate(text.split("\n"), start=1):
        if "// >>> functor " in content:
            current = content.split("// >>> functor ", 1)[1].split()[0]
        elif "// <<< functor " in content:
            current = None
        if i == line:
            return current
    return None

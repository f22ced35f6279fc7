"""Hugging Face transformers: ``attn_implementation="jitattn"``.

Usage::

    from jitattn.integrations.transformers import PagedCache  # registers "jitattn" with transformers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="jitattn", dtype=torch.bfloat16)
    cache = PagedCache(model.config, max_batch_size=8, max_cache_len=4096)  # optional: see below
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

Importing this module registers :func:`attention_forward` in transformers' ``AttentionInterface``
and a padding-mask builder in its ``AttentionMaskInterface`` (both under the name ``"jitattn"``;
:func:`register` registers other names). Checked against transformers 5.17 (the device's) and
5.24 (CPU tests).

Each call maps the attention module's arguments to an :class:`~jitattn.spec.AttentionSpec`:
heads and head dim from the tensors (GQA from ``key``'s head count), ``scaling`` -> ``sm_scale``,
``softcap`` -> ``logits_soft_cap``, ``sliding_window=W`` -> ``window_left=W-1`` (transformers masks
``kv_idx > q_idx - W``), ``s_aux`` (gpt-oss sinks) -> ``sinks``, ``is_causal`` (module attribute or
keyword) -> ``causal``, the query dtype -> ``q_dtype`` (float16 or bfloat16 only: jitattn's specs
take no float32), ``kv_layout="NHD"``, ``page_size=``:data:`PAGE_SIZE`. The selector picks the
backend for that spec on the query's device (``jit`` on a supported GPU; on the CPU ``sdpa`` for
plain attention, else ``reference``), logged once per layer kind, and the call goes through the
:mod:`jitattn.ops` custom op, so ``torch.compile`` does not break the graph on it.

Packing the dense ``(B, H, N, D)`` tensors into jitattn's paged call: queries become
``(B*N, H, D)`` rows; the keys and values (the cache's full ``(B, H_kv, L, D)`` states) are copied
into one paged cache of ``ceil(L / PAGE_SIZE)`` pages per sequence. That copy is one extra read
and write of the layer's KV per call, on every decode step too.

With a :class:`PagedCache` (``past_key_values=`` / ``cache=`` of ``generate`` or ``forward``) there is
no copy: each layer keeps an NHD paged cache, a block table and per-sequence lengths. The cache's
``update`` only records the step's new K/V and returns them; this attention function recognises
them (by identity), writes them into the pages with one :func:`jitattn.append_kv` (slots from the
sequence lengths; padded tokens, known from the mask, get slot -1 and are not stored) and runs the
paged call on the pages, the step's tokens as the queries. Left or right padding is handled this way
(each sequence's pages hold only its real tokens; with padding, finding the valid query rows is
a device sync). Sliding-window layers keep every page (the kernel applies the window; memory is
that of a full layer). Not supported with it: beam search, cropping / assisted decoding,
``torch.compile`` of the step (``is_compileable`` is False), and attention implementations other
than this one (the cache raises at the next ``update`` when its K/V were not read here).

Padding (copying path): with no padding transformers passes no mask and the packing has no host
sync. With a 2D padding mask each sequence's valid keys must form one contiguous run (left or right
padding, as ``generate`` makes); they are gathered on the host (a device sync), padded query rows get
output 0. Not supported (raise): a mask with holes, dropout in training, ``output_attentions``
weights (None is returned), sliding-window static caches (their ring buffer breaks positions), and
masks beyond causal / sliding / padding (e.g. Gemma-3's bidirectional image-token masks, packed
sequences) are not translated.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from jitattn.backends import DeviceInfo
from jitattn.kv_write import append_kv
from jitattn.ops import register_spec, spec_from_json
from jitattn.runtime import plan, run
from jitattn.selector import select_cached
from jitattn.spec import AttentionSpec

NAME = "jitattn"
#: Tokens per page of the paged view built from the dense K/V (part of the spec: one kernel per value).
PAGE_SIZE = 16
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def register(name: str = NAME) -> str:
    """Register the attention function and its mask builder with transformers under ``name``; return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                 mask_function: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
                 ) -> torch.Tensor | None:
    """transformers' mask hook: None without padding, else bool ``(batch, kv_length)``, True for real tokens.

    Columns ``kv_offset ... kv_offset + kv_length - 1`` of the 2D mask are the keys this layer sees
    (a sliding layer's cache holds only the last ones); keys past the mask (empty static-cache
    slots) are padding.
    """
    if attention_mask is None:
        return None
    mask = attention_mask[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    if mask.shape[1] < kv_length:
        mask = F.pad(mask, (0, kv_length - mask.shape[1]), value=False)
    if bool(mask.all()):
        return None
    return mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, is_causal: bool | None = None, **kwargs: Any
                      ) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: query ``(B, H, N, D)``, key/value ``(B, H_kv, L, D)`` -> ``(B, N, H, D)``.

    When key/value are the new states a :class:`PagedLayer` just recorded (``L == N``), they are
    appended to its pages and the pages are read; otherwise key/value are the whole history and are
    copied into a paged cache for the call.

    Raises:
        NotImplementedError: dropout while training; a padding mask with holes; a mask longer than
            the keys in a way jitattn cannot align.
        ValueError: a float32 model (jitattn takes float16 / bfloat16), or a spec jitattn rejects
            (e.g. head_dim 72), with AttentionSpec's message.
        jitattn.selector.NoBackendError: no backend serves the layer on this device.
    """
    if dropout and module.training:
        raise NotImplementedError(f"jitattn: attention dropout={dropout} in training is not supported")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    paged = _PENDING.get(id(key))
    page_size = paged.page_size if paged is not None and paged.pending_key is key else PAGE_SIZE
    text = _spec_text(query.shape[1], key.shape[1], query.shape[-1], query.dtype, scaling, softcap,
                      sliding_window, bool(causal), s_aux is not None, page_size)
    batch, _, n, _ = query.shape
    backend = _backend(text, query.device, "decode" if n == 1 else "prefill")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"jitattn: expected no mask or a 2D padding mask (from the 'jitattn' mask "
                                  f"hook), got shape {tuple(attention_mask.shape)}")
    sinks = s_aux.float().contiguous() if s_aux is not None else None
    if paged is not None and paged.pending_key is key:  # a PagedCache layer: append the new tokens, read the pages
        packed = paged.append_and_pack(query, key, value, attention_mask)
        if _runs_planned(backend, query):
            out = paged.run_planned(spec_from_json(text), packed[0], sinks, n)
            return _unpad(out, packed[5], batch, n), None
    elif attention_mask is None:
        packed = _pack_dense(query, key, value)
    else:
        packed = _pack_padded(query, key, value, attention_mask)
    q, kv_cache, block_table, seq_lens, qsl, rows = packed
    out, _ = torch.ops.jitattn.paged_attention(q, kv_cache, block_table, seq_lens, qsl, text, backend, sinks, None,
                                               [], [], False, 1 if n == 1 else -1)
    return _unpad(out, rows, batch, n), None


def _runs_planned(backend: str, query: torch.Tensor) -> bool:
    """Whether a PagedCache layer runs through the step's plan (the jit kernels, eagerly) rather than the op."""
    return backend == "jit" and query.is_cuda and not torch.compiler.is_compiling()


def _unpad(out: torch.Tensor, rows: torch.Tensor | None, batch: int, n: int) -> torch.Tensor:
    """The call's rows ``(total_q, H, D)`` as ``(B, N, H, D)``; with ``rows`` (padded), padding rows are 0."""
    if rows is not None:
        full = out.new_zeros(batch * n, *out.shape[1:])
        full[rows] = out
        out = full
    return out.view(batch, n, *out.shape[1:])


@torch.compiler.assume_constant_result
def _spec_text(num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, scaling: float | None,
               softcap: float | None, sliding_window: int | None, causal: bool, sinks: bool,
               page_size: int = PAGE_SIZE) -> str:
    if dtype not in _DTYPES:
        raise ValueError(f"jitattn: the model runs in {dtype}; jitattn's kernels take float16 or bfloat16: load the "
                         f"model with dtype=torch.bfloat16 (or float16)")
    return _layer_spec(num_qo_heads, num_kv_heads, head_dim, _DTYPES[dtype], scaling, softcap, sliding_window, causal,
                       sinks, page_size)[0]


@functools.lru_cache(maxsize=256)  # every layer of every step asks: build and register each spec once
def _layer_spec(num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: str, scaling: float | None,
                softcap: float | None, sliding_window: int | None, causal: bool, sinks: bool,
                page_size: int) -> tuple[str, AttentionSpec]:
    spec = AttentionSpec(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                         q_dtype=dtype, page_size=page_size, causal=causal,
                         window_left=sliding_window - 1 if sliding_window else -1,
                         logits_soft_cap=float(softcap or 0.0), sm_scale=scaling, sinks=sinks)
    return register_spec(spec), spec  # the spec is kept alive with its text


@torch.compiler.assume_constant_result
def _backend(spec_text: str, device: torch.device, phase: str) -> str:
    return select_cached(spec_from_json(spec_text), DeviceInfo.from_torch(device), phase).name


def _pages(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(B, L, H_kv, D)`` K and V -> NHD pages ``(B * ceil(L/P), 2, P, H_kv, D)``, sequence b's pages contiguous."""
    batch, length, heads, dim = k.shape
    n = -(-length // PAGE_SIZE)
    pad = n * PAGE_SIZE - length
    if pad:
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
    kv = torch.stack((k.reshape(batch, n, PAGE_SIZE, heads, dim), v.reshape(batch, n, PAGE_SIZE, heads, dim)), dim=2)
    return kv.reshape(batch * n, 2, PAGE_SIZE, heads, dim)


def _pack_dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """No padding: every sequence has all L keys and brings the last N as queries. No host sync."""
    batch, heads, n, dim = query.shape
    length = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * n, heads, dim)  # (B*N, H, D)
    kv_cache = _pages(key.transpose(1, 2), value.transpose(1, 2))
    pages = kv_cache.shape[0] // batch
    dev = query.device
    block_table = torch.arange(batch * pages, dtype=torch.int32, device=dev).view(batch, pages)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev)
    return q, kv_cache, block_table, seq_lens, qsl, None


def _pack_padded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor):
    """A 2D padding mask: each sequence keeps its contiguous run of valid keys and the queries inside it."""
    batch, heads, n, dim = query.shape
    length = key.shape[2]
    if mask.shape != (batch, length):
        raise NotImplementedError(f"jitattn: padding mask of shape {tuple(mask.shape)} does not match the keys "
                                  f"({batch}, {length})")
    runs = _valid_runs(mask.cpu())
    first_query = length - n  # key slot of query row 0
    dev = query.device
    rows, q_counts, parts, page_counts = [], [], [], []
    for b, (s, e) in enumerate(runs):
        a = max(s, first_query)
        count = max(0, e - a)
        rows.append(torch.arange(a - first_query, a - first_query + count) + b * n)
        q_counts.append(count)
        parts.append(_pages(key[b:b + 1, :, s:e].transpose(1, 2), value[b:b + 1, :, s:e].transpose(1, 2)))
        page_counts.append(parts[-1].shape[0])
    row_idx = torch.cat(rows).to(dev)
    q = query.transpose(1, 2).reshape(batch * n, heads, dim)[row_idx]  # (valid rows, H, D)
    kv_cache = torch.cat(parts)
    width = max(max(page_counts), 1)
    table = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for b, count in enumerate(page_counts):
        table[b, :count] = torch.arange(start, start + count, dtype=torch.int32)
        start += count
    seq_lens = torch.tensor([e - s for s, e in runs], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, *torch.tensor(q_counts).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return q, kv_cache, table.to(dev), seq_lens, qsl, row_idx


def _valid_runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each row's valid keys; NotImplementedError when they are not contiguous."""
    runs = []
    for b, row in enumerate(mask):
        idx = torch.nonzero(row).flatten()
        if idx.numel() == 0:
            runs.append((0, 0))
            continue
        s, e = int(idx[0]), int(idx[-1]) + 1
        if idx.numel() != e - s:
            raise NotImplementedError(f"jitattn: sequence {b}'s padding mask has holes (valid keys {s}..{e - 1} with "
                                      f"{e - s - idx.numel()} masked inside); only left or right padding is supported")
        runs.append((s, e))
    return runs


# ---- a paged KV cache for generate -----------------------------------------------------------------
#: id(new key states) -> the PagedLayer whose update returned them, until the attention function reads them.
_PENDING: dict[int, "PagedLayer"] = {}


class _Step:
    """What the layers of one :class:`PagedCache` on one device share: one block table and ``seq_lens``
    (every layer stores the same tokens at the same slots), and per forward the new tokens' slots, the
    paged call's metadata and, on the jit backend, its :func:`jitattn.plan`: made by the step's first layer
    there, reused by the others (FlashInfer's plan-once-per-step, run-per-layer). A model split over
    devices has one per device.

    Without a padding mask a forward's metadata depends only on ``(batch, n)``: its ``query_start_loc`` and its
    plan (which reads nothing on the host, so ``seq_lens`` advancing in place keeps it valid, as a CUDA graph
    replay would) are kept in ``kept`` and reused by every later decode step of that shape."""

    def __init__(self):
        self.block_table: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.first_slot: torch.Tensor | None = None  # int64 (max_batch_size, 1): sequence b's first slot
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, list]] = {}
        self.forget()

    def forget(self) -> None:
        """Drop the last forward's metadata."""
        self.key: tuple | None = None
        self.slots = self.qsl = self.rows = None
        self.block_table_rows = self.seq_lens_rows = None  # the forward's batch rows of block_table / seq_lens
        self.plans: list = [None]  # the forward's plan, in a list shared with ``kept`` when it is kept

    def reset(self) -> None:
        """Drop everything planned (a new ``generate`` after :meth:`PagedCache.reset`)."""
        self.kept.clear()
        self.forget()


def _token_rows(states: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)`` states as ``(B * N, H, D)`` token rows (a view where the strides allow: always for N == 1)."""
    batch, heads, n, dim = states.shape
    if n == 1:
        return states.squeeze(2)  # one op where transpose + reshape are two, on every layer of a decode step
    return states.transpose(1, 2).reshape(batch * n, heads, dim)


def _cache_layer_base():
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


class PagedLayer(_cache_layer_base()):
    """One layer of a :class:`PagedCache`: an NHD paged cache ``(num_pages, 2, page_size, H_kv, D)``, the
    block table ``(max_batch_size, pages_per_seq)`` int32 (sequence ``b`` owns pages ``b * pages_per_seq``
    onwards), and ``seq_lens`` int32 ``(max_batch_size,)``: the tokens stored per sequence (padding
    tokens are not stored, so a left-padded row holds fewer than :meth:`get_seq_length`).

    ``update`` only records the new key / value states and returns them; the attention function
    (``attn_implementation="jitattn"``) recognises them, writes them into the pages with
    :func:`jitattn.append_kv` (skipping padded tokens, which it knows from the mask) and runs the paged
    call over the pages. Allocated on the first ``update`` (heads, head dim, dtype, device from the
    key states). Sliding-window layers keep every page (the kernel applies the window).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False  # every layer keeps all its positions: full-length masks for all

    def __init__(self, max_batch_size: int, max_cache_len: int, page_size: int,
                 dtype: torch.dtype | None = None, device: torch.device | None = None,
                 steps: dict[torch.device, _Step] | None = None):
        super().__init__()
        self.steps = steps if steps is not None else {}  # shared by the cache's layers, one per device
        self.step = _Step()
        self.max_batch_size, self.max_cache_len, self.page_size = max_batch_size, max_cache_len, page_size
        self.pages_per_seq = -(-max_cache_len // page_size)
        self.dtype, self.device = dtype, device
        self.cumulative_length = 0  # positions seen, padding included (what generate counts)
        self.kv_cache: torch.Tensor | None = None
        self.block_table: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.pending_key: torch.Tensor | None = None
        self.pending_value: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        if self.dtype is not None and key_states.dtype != self.dtype:
            raise ValueError(f"PagedCache: dtype={self.dtype}, but the model's key states are {key_states.dtype}")
        if self.device is not None and key_states.device != torch.device(self.device):
            raise ValueError(f"PagedCache: device={self.device}, but the model's key states are on "
                             f"{key_states.device}")
        if value_states.shape[-1] != dim:
            raise ValueError(f"PagedCache: value head dim {value_states.shape[-1]} != key head dim {dim}; the "
                             f"paged layout keeps K and V of one head dim")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.kv_cache = torch.zeros(self.max_batch_size * self.pages_per_seq, 2, self.page_size, heads, dim,
                                    dtype=self.dtype, device=self.device)
        self.keys, self.values = self.kv_cache[:, 0], self.kv_cache[:, 1]
        step = self.step = self.steps.setdefault(self.device, self.step)
        if step.block_table is None:
            step.block_table = torch.arange(self.max_batch_size * self.pages_per_seq, dtype=torch.int32,
                                            device=self.device).view(self.max_batch_size, self.pages_per_seq)
            step.seq_lens = torch.zeros(self.max_batch_size, dtype=torch.int32, device=self.device)
            # the block table is the identity (sequence b owns pages b * pages_per_seq onwards), so a position's
            # slot is the sequence's first slot plus the position: one add where a gather of pages would be four
            step.first_slot = (torch.arange(self.max_batch_size, dtype=torch.int64, device=self.device)
                               * (self.pages_per_seq * self.page_size)).unsqueeze(1)
        self.block_table, self.seq_lens = step.block_table, step.seq_lens
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the new ``(B, H_kv, N, D)`` key / value states; return them (the attention function
        appends them to the pages). Raises ValueError past ``max_batch_size`` or ``max_cache_len``."""
        batch, _, n, _ = key_states.shape
        if batch > self.max_batch_size:
            raise ValueError(f"PagedCache: batch of {batch} sequences, but max_batch_size={self.max_batch_size}")
        if self.cumulative_length + n > self.max_cache_len:
            raise ValueError(f"PagedCache: {self.cumulative_length} cached + {n} new tokens exceed "
                             f"max_cache_len={self.max_cache_len}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += n
        self.pending_key, self.pending_value = key_states, value_states
        _PENDING[id(key_states)] = self
        return key_states, value_states

    def append_and_pack(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: torch.Tensor | None):
        """Append the pending tokens (one :func:`jitattn.append_kv`) and return the paged call's inputs
        ``(q, kv_cache, block_table, seq_lens, query_start_loc, rows)`` (``rows``: the valid query rows
        of the ``B * N`` ones when ``mask`` marks padding, else None). The step's first layer works out
        the slots and the metadata (and advances the shared ``seq_lens``); the others reuse them."""
        _PENDING.pop(id(key), None)
        self.pending_key = self.pending_value = None
        batch, heads, n, dim = query.shape
        step = self.step
        # every layer of a forward has seen the same positions: that count names the step
        if step.key != (self.cumulative_length, batch, n):
            self._plan_step(step, batch, n, mask, query.device)
        append_kv(_token_rows(key), _token_rows(value), self.kv_cache, step.slots)
        q = _token_rows(query)
        if step.rows is not None:
            q = q[step.rows]
        return q, self.kv_cache, step.block_table_rows, step.seq_lens_rows, step.qsl, step.rows

    def _plan_step(self, step: _Step, batch: int, n: int, mask: torch.Tensor | None, dev: torch.device) -> None:
        step.forget()
        step.block_table_rows, step.seq_lens_rows = self.block_table[:batch], self.seq_lens[:batch]
        past = step.seq_lens_rows.unsqueeze(1)
        if mask is None:
            pos = past if n == 1 else past + torch.arange(n, device=dev, dtype=torch.int32)
            step.slots = (step.first_slot[:batch] + pos).reshape(-1)  # positions < max_cache_len: in the sequence
            step.seq_lens_rows += n
            kept = step.kept.get((batch, n))
            if kept is None:
                kept = step.kept[(batch, n)] = (torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=dev),
                                                [None])
            step.qsl, step.plans = kept
        else:
            if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < n:
                raise NotImplementedError(f"jitattn: PagedCache expects a (batch, kv_length) padding mask, got "
                                          f"{tuple(mask.shape)} for {batch} sequences of {n} new tokens")
            valid = mask[:, -n:].to(device=dev, dtype=torch.bool)
            pos = past.long() + valid.long().cumsum(1) - 1  # padded tokens are not stored
            slots = step.first_slot[:batch] + pos.clamp_(min=0)
            added = valid.sum(1, dtype=torch.int32)
            step.seq_lens_rows += added
            step.slots = torch.where(valid, slots, torch.full_like(slots, -1)).reshape(-1)
            step.rows = torch.nonzero(valid.reshape(-1)).flatten()
            step.qsl = F.pad(added.cumsum(0, dtype=torch.int32), (1, 0))
        step.key = (self.cumulative_length, batch, n)

    def run_planned(self, spec: AttentionSpec, q: torch.Tensor, sinks: torch.Tensor | None, n: int) -> torch.Tensor:
        """The jit kernels on this step's metadata through the step's :func:`jitattn.plan` (made by the
        first layer that runs, for its spec; another spec, a sliding layer's, is planned on first use;
        without a padding mask, kept for the later steps of the same shape)."""
        step = self.step
        if step.plans[0] is None:
            step.plans[0] = plan(spec, step.block_table_rows, step.seq_lens_rows, step.qsl, total_q=q.shape[0],
                                 max_query_len=n)
        return run(q, self.kv_cache, step.plans[0], spec=spec, sinks=sinks)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        super().reset()
        if self.seq_lens is not None:
            self.seq_lens.zero_()
        self.step.reset()
        self.pending_key = self.pending_value = None

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("PagedCache: beam search, cropping and batch reordering are not supported "
                                  "(greedy or sampled generate only)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


def _cache_base():
    from transformers.cache_utils import Cache

    return Cache


class PagedCache(_cache_base()):
    """A transformers ``Cache`` that keeps each layer's K/V in jitattn's paged layout (:class:`PagedLayer`).

    Usage::

        cache = PagedCache(model.config, max_batch_size=8, max_cache_len=4096)
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

    with a model loaded with ``attn_implementation="jitattn"``: each step every layer writes its new
    tokens once (:func:`jitattn.append_kv`) and the kernels read the pages; nothing of the history is
    copied. Left / right padding from ``generate``'s attention mask is handled (padded tokens are not
    stored, so each sequence's pages hold only its real tokens). A checkpoint whose generation config
    names a ``cache_implementation`` (Gemma-2's ``"hybrid"``) needs
    ``model.generation_config.cache_implementation = None`` first: ``generate`` refuses both.

    Args:
        config: the model's config (its text config's ``num_hidden_layers`` layers).
        max_batch_size: the most sequences one ``generate`` call may bring.
        max_cache_len: the most positions (prompt, padding and new tokens) a sequence may reach.
        page_size: tokens per page (part of the spec: one kernel per value).
        dtype, device: when given, checked against the model's key states (else taken from them);
            ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        ValueError: a bad size or dtype here; in ``update``, a batch over ``max_batch_size`` or a
            length over ``max_cache_len``.
        RuntimeError: a layer's new K/V were not read by jitattn's attention function (the model does
            not run ``attn_implementation="jitattn"``).
    """

    def __init__(self, config: Any, max_batch_size: int, max_cache_len: int, *, page_size: int = PAGE_SIZE,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len),
                            ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedCache: {name}={value!r}; expected a positive int")
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"PagedCache: dtype={dtype}; jitattn's kernels take torch.float16 or torch.bfloat16")
        text = config.get_text_config(decoder=True)
        steps: dict[torch.device, _Step] = {}
        layers = [PagedLayer(max_batch_size, max_cache_len, page_size, dtype,
                             torch.device(device) if device is not None else None, steps)
                  for _ in range(text.num_hidden_layers)]
        super().__init__(layers=layers)
        self._max_batch_size, self._max_cache_len, self.page_size = max_batch_size, max_cache_len, page_size

    # Own properties: transformers up to 5.17 defines both on Cache as read-only (deprecated) properties.
    @property
    def max_batch_size(self) -> int:
        """The most sequences one ``generate`` call may bring."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        """The most positions a sequence may reach."""
        return self._max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # the layer run before this one (the last one, before layer 0) and this one: the attention function has
        # read their new K/V unless the model bypasses it (one check per call, not one per layer per call)
        for i in {(layer_idx - 1) % len(self.layers), layer_idx % len(self.layers)}:
            if self.layers[i].pending_key is not None:
                raise RuntimeError(f"PagedCache: layer {i}'s new K/V were not read by jitattn's attention function; "
                                   f"load the model with attn_implementation=\"{NAME}\" to use a PagedCache")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


register()

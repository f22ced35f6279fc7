"""The generate case: attention time per decode step of a small transformers model, three ways (issue 19).

The model (:func:`small_config`) keeps a config's attention as it is (query and KV heads, head dim,
softmax scale, sliding windows and which layers slide, soft-caps) and shrinks the rest: a few layers,
hidden size 512, vocabulary 1024, random weights, bfloat16. One batch of ``batch`` random prompts of
``context`` tokens is prefilled (not timed), then ``warmup + steps`` decode steps of one token per
sequence run with fixed random tokens, the same for every implementation:

- ``jitattn``: ``attn_implementation="jitattn"`` with a
  :class:`jitattn.integrations.transformers.PagedCache` (each token appended once with ``append_kv``,
  the kernels read the pages);
- ``jitattn-copying``: the same model with transformers' default ``DynamicCache``: every call copies
  the layer's whole history into a fresh paged cache (today's integration without a PagedCache);
- ``sdpa``: ``attn_implementation="sdpa"`` with a ``DynamicCache``, where it serves the model: not
  with a soft-cap (Gemma-2), which torch SDPA has no form of (:func:`sdpa_problem`; a "skipped" row).

Attention time per step: on each layer, a CUDA event when the cache's ``update`` is called (the
``DynamicCache`` concatenates the history there; the ``PagedCache`` only records the new K/V) and one
when the attention function (transformers' ``AttentionInterface`` entry, wrapped for the run)
returns; the layers' intervals are summed per step, and the figure is the median over the ``steps``
steps after ``warmup``. Everything between those two events counts, so a host that cannot keep up
(eager calls, no CUDA graph) shows as well as GPU time; the projections, MLP and logits are outside.
The whole step (events around the model's forward) is in the note. On the CPU (the tests) the
events are ``time.perf_counter`` readings.

Error: the logits of every decode step against an fp32 ``attn_implementation="eager"`` model with
the same weights on the same tokens (relative, norm-wise), so a fast wrong answer shows as WRONG.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import statistics
import time
from typing import Any, Iterator

import torch

from jitattn.bench.cases import ANCHORS, BenchCase, GenerateSetup, model_config_path
from jitattn.bench.report import MAX_REL_ERR, STEP_UNIT, Result, one_line
from jitattn.testing import relative_error

#: The three ways, in row order: (attn_implementation, cache).
IMPLS = {"jitattn": ("jitattn", "paged"), "jitattn-copying": ("jitattn", "dynamic"), "sdpa": ("sdpa", "dynamic")}
#: The small model's sizes outside attention (attention keeps the config's).
VOCAB = 1024
NOTES = {"jitattn": "PagedCache: each token appended once (append_kv), the kernels read the pages",
         "jitattn-copying": "DynamicCache: each call copies the layer's history into a fresh paged cache",
         "sdpa": "DynamicCache, torch SDPA"}
#: Issue 19's targets, on the jitattn row: (other row, the ratio jitattn / other must be <= this, text).
TARGETS = (("jitattn-copying", 0.5, "<= 0.5x"), ("sdpa", 1.0, "< 1x"))


def small_config(setup: GenerateSetup) -> Any:
    """The transformers config of ``setup.model``'s config file with its attention kept and the rest shrunk.

    Raises:
        ImportError: transformers is not installed.
        OSError: the config file is missing (:func:`jitattn.bench.cases.model_config_path`).
    """
    from transformers import AutoConfig

    raw = json.loads(model_config_path(setup.model).read_text())
    heads = raw["num_attention_heads"]
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "rope_scaling")}
    need = setup.context + setup.warmup + setup.steps
    fields.update(num_hidden_layers=setup.layers, hidden_size=setup.hidden_size,
                  intermediate_size=2 * setup.hidden_size, vocab_size=VOCAB,
                  head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                  max_position_embeddings=max(raw.get("max_position_embeddings", 0), need),
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if setup.window and raw.get("sliding_window"):
        fields["sliding_window"] = setup.window
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(config: Any, attn_implementation: str, dtype: torch.dtype, device: str,
                state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """A model of ``config`` in eval mode on ``device``: random weights, or ``state``'s.

    Raises:
        ValueError: transformers does not serve the model with ``attn_implementation`` (its message).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                             dtype=dtype)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device).eval()


class StepTimer:
    """Marks around each decode step and each layer's attention (cache update to attention output).

    CUDA events on a CUDA device (read after one synchronize at the end), ``time.perf_counter`` on the
    CPU. Marks outside a step (the prefill) are not taken.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []
        self._layers: list[tuple[Any, Any]] | None = None
        self._begin: Any = None
        self._open: Any = None

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def step_begin(self) -> None:
        self._layers, self._begin = [], self.mark()

    def step_end(self) -> None:
        self.steps.append((self._begin, self.mark(), self._layers))
        self._layers = None

    def attention_begin(self) -> None:
        if self._layers is not None:
            self._open = self.mark()

    def attention_end(self) -> None:
        if self._layers is not None:
            self._layers.append((self._open, self.mark()))

    def times(self) -> list[tuple[float, float, int]]:
        """Per step: ``(attention ms summed over layers, whole step ms, layers timed)``."""
        if self.cuda:
            torch.cuda.synchronize()
        return [(sum(self._ms(a, b) for a, b in layers), self._ms(begin, end), len(layers))
                for begin, end, layers in self.steps]


@contextlib.contextmanager
def timed_attention(attn_implementation: str, timer: StepTimer) -> Iterator[None]:
    """Wrap transformers' attention function for ``attn_implementation`` so that it marks its return.

    A local override of transformers' ``ALL_ATTENTION_FUNCTIONS`` (what the attention modules look up
    on every call), removed on exit.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    real = ALL_ATTENTION_FUNCTIONS[attn_implementation]

    def timed(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        timer.attention_end()
        return result

    ALL_ATTENTION_FUNCTIONS[attn_implementation] = timed
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[attn_implementation]


def timed_cache(cache: Any, timer: StepTimer) -> Any:
    """``cache`` with its ``update`` marking the start of a layer's attention (an instance attribute)."""
    real = cache.update

    def update(*args: Any, **kwargs: Any) -> Any:
        timer.attention_begin()
        return real(*args, **kwargs)

    cache.update = update
    return cache


def make_cache(kind: str, model: torch.nn.Module, setup: GenerateSetup) -> Any:
    """A :class:`~jitattn.integrations.transformers.PagedCache` (``"paged"``) or a ``DynamicCache``."""
    if kind == "paged":
        from jitattn.integrations.transformers import PagedCache

        return PagedCache(model.config, max_batch_size=setup.batch,
                          max_cache_len=setup.context + setup.warmup + setup.steps)
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def decode(model: torch.nn.Module, cache: Any, prompt: torch.Tensor, tokens: torch.Tensor,
           timer: StepTimer | None = None) -> torch.Tensor:
    """Prefill ``prompt`` ``(B, context)``, then one decode step per column of ``tokens`` ``(B, n)``.

    Returns float32 logits ``(n, B, vocab)`` of the decode steps; ``timer`` marks each step.
    """
    names = inspect.signature(model.forward).parameters
    kw = {"cache" if "cache" in names else "past_key_values": cache, "use_cache": True}
    out = []
    with torch.no_grad():
        model(input_ids=prompt, **kw)
        for i in range(tokens.shape[1]):
            if timer is not None:
                timer.step_begin()
            logits = model(input_ids=tokens[:, i:i + 1], **kw).logits[:, -1]
            if timer is not None:
                timer.step_end()
            out.append(logits.float())
    return torch.stack(out)


def time_impl(model: torch.nn.Module, attn_implementation: str, cache: Any, setup: GenerateSetup,
              prompt: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """Run :func:`decode` with the marks on; ``(logits, attention ms per step, whole step ms)``, medians
    over the steps after ``setup.warmup``.

    Raises:
        RuntimeError: a step timed another number of layers than the model has.
    """
    timer = StepTimer(prompt.device)
    with timed_attention(attn_implementation, timer):
        logits = decode(model, timed_cache(cache, timer), prompt, tokens, timer)
    times = timer.times()[setup.warmup:]
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if any(n != layers for _, _, n in times):
        raise RuntimeError(f"timed {[n for _, _, n in times]} attention calls per step, expected {layers}")
    return logits, statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def run_generate_case(case: BenchCase, *, seed: int = 0, check: bool = True, anchors: tuple[str, ...] = ANCHORS,
                      device: str = "cuda") -> list[Result]:
    """The three ways of the module doc on one small model and one batch; a row each, in :data:`IMPLS` order.

    ``sdpa`` runs when it is among ``anchors``. A missing transformers is one skipped row, a failing
    implementation a failed row; a failure building the model or the reference raises (the run's
    :func:`jitattn.bench.run.run_case_safely` makes it a row).
    """
    setup = case.generate
    try:
        import jitattn.integrations.transformers  # noqa: F401  (registers attn_implementation="jitattn")

        config = small_config(setup)
    except ImportError as exc:
        return [Result.not_run(case.name, "jitattn", STEP_UNIT, "skipped",
                               f"transformers is not installed ({one_line(exc, 80)})")]
    torch.manual_seed(seed)
    base = build_model(config, "jitattn", torch.bfloat16, device)
    state = base.state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, VOCAB, (setup.batch, setup.context), generator=gen).to(device)
    tokens = torch.randint(3, VOCAB, (setup.batch, setup.warmup + setup.steps), generator=gen).to(device)
    ref = None
    if check:
        reference = build_model(config, "eager", torch.float32, device, state)
        ref = decode(reference, make_cache("dynamic", reference, setup), prompt, tokens)
        del reference
    results = []
    for impl, (attn, cache_kind) in IMPLS.items():
        if impl == "sdpa" and "sdpa" not in anchors:
            continue
        results.append(_time_one(case, impl, attn, cache_kind, base, config, state, setup, prompt, tokens, ref))
        if device == "cuda":
            torch.cuda.empty_cache()
    _add_targets(results)
    return results


def sdpa_problem(config: Any) -> str | None:
    """Why ``attn_implementation="sdpa"`` does not serve the model (None when it does): a soft-cap, which
    torch SDPA has no form of; some transformers releases refuse the model, others drop the cap silently."""
    cap = getattr(config.get_text_config(decoder=True), "attn_logit_softcapping", None)
    if cap:
        return f"torch SDPA has no soft-cap (attn_logit_softcapping={cap:g}): transformers' sdpa would drop it"
    return None


def _time_one(case: BenchCase, impl: str, attn: str, cache_kind: str, base: torch.nn.Module, config: Any,
              state: dict, setup: GenerateSetup, prompt: torch.Tensor, tokens: torch.Tensor,
              ref: torch.Tensor | None) -> Result:
    """One implementation's row (skipped when the attention cannot serve the model, failed when it raises)."""
    problem = sdpa_problem(config) if attn == "sdpa" else None
    if problem:
        return Result.not_run(case.name, impl, STEP_UNIT, "skipped", problem)
    try:
        model = base if attn == "jitattn" else build_model(config, attn, torch.bfloat16, str(prompt.device), state)
    except ValueError as exc:  # transformers: this model does not support that attention implementation
        return Result.not_run(case.name, impl, STEP_UNIT, "skipped", one_line(exc))
    try:
        logits, attn_ms, step_ms = time_impl(model, attn, make_cache(cache_kind, model, setup), setup, prompt, tokens)
    except Exception as exc:  # noqa: BLE001 - a failing implementation is a row, not a crash
        return Result.not_run(case.name, impl, STEP_UNIT, "failed", one_line(exc))
    err = math.nan if ref is None else relative_error(logits, ref)
    note = f"{NOTES[impl]}; whole step {step_ms:.3f} ms; median of {setup.steps} steps"
    if err > MAX_REL_ERR:
        note = f"WRONG (rel err > {MAX_REL_ERR:g}); {note}"
    return Result(case.name, impl, attn_ms, math.nan, attn_ms * 1e3, STEP_UNIT, err, note)


def _add_targets(results: list[Result]) -> None:
    """Issue 19's targets, measured, first in the jitattn row's note: jitattn / copying and jitattn / sdpa."""
    rows = {r.impl: r for r in results if r.status == "ok"}
    mine = rows.get("jitattn")
    if mine is None:
        return
    parts = []
    for other, bound, text in TARGETS:
        if other in rows:
            ratio = mine.ms / rows[other].ms
            met = ratio <= bound if bound < 1 else ratio < bound
            parts.append(f"{ratio:.2f}x {other} (target {text}: {'met' if met else 'not met'})")
    if parts:
        mine.note = f"{'; '.join(parts)}; {mine.note}"

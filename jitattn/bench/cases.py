"""The case catalogue: which spec and batch shape each benchmark case runs. Needs no torch.

A case is a spec and a batch (``q_lens[b]`` queries against ``kv_lens[b]`` keys). The catalogue:
DESIGN.md's six anchor-table cases, the fast-decode targets, the mixed batch, the paged-vs-ragged
pair, the shared-prefix (cascade) batches, the host-cost probes, the ``generate`` decode steps of small
transformers models (:class:`GenerateSetup`), the multi-head latent attention (MLA) decode cases
(:func:`mla_cases`), then a decode and a prefill case for every paged layer kind (a decode case for a
latent one) of every example model config (:data:`MODEL_CONFIG_DIRS`; or the configs given).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jitattn.spec import AttentionSpec

REPO = Path(__file__).resolve().parents[2]
#: The example model configs whose layer kinds are benchmarked by default: ``jitattn/model_configs`` in
#: an installed wheel (pyproject.toml force-includes examples/models there), ``examples/models`` in a
#: checkout; the wheel's copy wins, as with the templates (:func:`jitattn.render.template_dir`).
MODEL_CONFIG_DIRS = (Path(__file__).resolve().parents[1] / "model_configs", REPO / "examples" / "models")
#: H200 L2 is 60 MB: a decode case reads at least twice that, so it measures HBM, not L2.
MIN_DECODE_BYTES = 128 * 10**6
#: Model decode batches start at 64 sequences and double (up to this) until they read MIN_DECODE_BYTES.
MAX_DECODE_BATCH = 1024
MODEL_KV_LEN = 4096
MODEL_PREFILL_BATCH = 2
#: Prefill cases with more sequences than this check their error on the first sequence only.
FULL_CHECK_MAX_SEQS = 2
ANCHORS = ("sdpa", "flex", "flashinfer")
#: Bytes per element of each KV dtype the specs take (jitattn.spec.KV_DTYPES), for byte counts without torch.
KV_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
#: Back-to-back eager calls per trial of a host case (issue 18's probe: synchronised only at the end).
HOST_CALLS = 2000
#: The generate cases' models (issue 19): a Llama-3-8B layer shape and a Gemma-2-9B one (example configs).
GENERATE_MODELS = ("llama-3-8b", "gemma-2-9b")


class BenchUsageError(SystemExit):
    """A bad argument (``--case``, ``--model``, ``--from-json``): the message names it and the value.

    A SystemExit, so a script calling :func:`jitattn.bench.main` stops without a traceback;
    ``jitattn bench`` prints it as ``jitattn: error: ...`` and exits 2 (a usage error).
    """


@dataclass(frozen=True)
class GenerateSetup:
    """A ``generate`` decode-step case (:mod:`jitattn.bench.generate`): a small random-weight transformers
    model of an example config's attention, ``batch`` prompts of ``context`` tokens prefilled, then
    ``warmup`` decode steps and ``steps`` timed ones.

    Attributes:
        model: the example config's file stem (:func:`model_config_path`).
        layers, hidden_size: the small model's (heads, head dims, windows and soft-caps are the config's).
        window: a sliding window to use instead of the config's (None: the config's; the CPU tests
            shrink it so that their short sequences cross it).
    """

    model: str
    batch: int = 8
    context: int = 4096
    layers: int = 4
    hidden_size: int = 512
    warmup: int = 4
    steps: int = 32
    window: int | None = None


@dataclass
class BenchCase:
    """One benchmark case: a spec and a batch shape (q_lens[b] queries against kv_lens[b] keys)."""

    name: str
    spec: AttentionSpec
    q_lens: list[int]
    kv_lens: list[int]
    phase: str  # "prefill", "decode" or "mixed" (prefill chunks and decode rows in one call; FLOP units); a
    # host case's "append": append_kv of one new token per sequence (issue 19)
    # Also time the same batch from contiguous varlen K/V (a ragged spec): "jitattn-ragged", so the
    # paged row's ratio is paged / contiguous (issue #6: within 10%).
    ragged_twin: bool = False
    # phase "cascade": (R requests, P shared prefix keys, s own suffix keys); q_lens / kv_lens are the
    # un-split batch's (1 query, P + s keys each)
    cascade: tuple[int, int, int] | None = None
    # A host-cost case: microseconds per eager call of each way to call attention (issue #18), not GPU rates.
    host: bool = False
    # phase "generate": attention us per decode step of a small transformers model, three ways (issue #19)
    generate: GenerateSetup | None = None

    @property
    def is_decode(self) -> bool:
        return self.phase in ("decode", "cascade")

    @property
    def check_seqs(self) -> int:
        """Sequences whose rows the reference checks: all, except prefill cases of > 2 sequences (the
        first) and latent (MLA) cases of more than :data:`MLA_CHECK_SEQS` (that many)."""
        if self.phase == "prefill" and len(self.q_lens) > FULL_CHECK_MAX_SEQS:
            return 1
        if self.spec.latent and len(self.q_lens) > MLA_CHECK_SEQS:
            return MLA_CHECK_SEQS
        return len(self.q_lens)

    def describe(self) -> str:
        """``64 x (1 q, 4096 kv), <spec>`` for --list and the JSON."""
        shape = (f"{len(self.q_lens)} x ({self.q_lens[0]} q, {self.kv_lens[0]} kv)"
                 if len(set(self.q_lens)) == 1 and len(set(self.kv_lens)) == 1 else f"{len(self.q_lens)} sequences")
        kind = f"host us per call, {self.phase}" if self.host else self.phase
        if self.spec.latent:
            kind = f"{self.phase} in {latent_unit(self.spec)}"
        if self.generate is not None:
            g = self.generate
            kind = (f"generate: attention us per decode step, {g.model} at {g.layers} layers, {g.steps} steps "
                    f"after {g.warmup}")
        return f"{kind}, {shape}, {self.spec.describe()}"


def design_cases() -> list[BenchCase]:
    """The six cases of the anchor table in DESIGN.md, same shapes."""
    hd128 = AttentionSpec(32, 8, 128)
    gemma = AttentionSpec(16, 8, 256, logits_soft_cap=50.0, window_left=4095, sm_scale=256 ** -0.5)
    phi3 = AttentionSpec(32, 32, 96)
    return [
        BenchCase("prefill-hd128-causal-b4x8192", hd128, [8192] * 4, [8192] * 4, "prefill"),
        BenchCase("prefill-gemma2-9b-b2x8192", gemma, [8192] * 2, [8192] * 2, "prefill"),
        BenchCase("prefill-phi3-hd96-b4x8192", phi3, [8192] * 4, [8192] * 4, "prefill"),
        BenchCase("decode-hd128-b64x4096", hd128, [1] * 64, [4096] * 64, "decode"),
        BenchCase("decode-gemma2-9b-b64x8192", gemma, [1] * 64, [8192] * 64, "decode"),
        BenchCase("decode-hd128-b1x32768", hd128, [1], [32768], "decode"),
    ]


def decode_target_cases() -> list[BenchCase]:
    """Extra decode cases of the fast-decode targets: gpt-oss sliding layer, page sizes 1/16/64, FP8 KV."""
    gpt_oss = AttentionSpec(64, 8, 64, window_left=127, sinks=True)
    out = [BenchCase("decode-gpt-oss-sliding-b256x8192", gpt_oss, [1] * 256, [8192] * 256, "decode")]
    for ps in (1, 16, 64):
        out.append(BenchCase(f"decode-hd128-b64x4096-page{ps}", AttentionSpec(32, 8, 128, page_size=ps),
                             [1] * 64, [4096] * 64, "decode"))
    # FP8 (e4m3) KV with per-tensor k_scale / v_scale: half the bytes of the page16 case above, so
    # the same time would show half the TB/s; the target is a ratio of times against that case.
    out.append(BenchCase("decode-hd128-b64x4096-fp8", AttentionSpec(32, 8, 128, kv_dtype="float8_e4m3fn"),
                         [1] * 64, [4096] * 64, "decode"))
    return out


def ragged_cases() -> list[BenchCase]:
    """The first design case timed from the paged cache (page 16) and from contiguous K/V, one run."""
    return [BenchCase("prefill-hd128-causal-b4x8192-vs-ragged", AttentionSpec(32, 8, 128), [8192] * 4,
                      [8192] * 4, "prefill", ragged_twin=True)]


def head_dim_cases() -> list[BenchCase]:
    """Head dims that are multiples of 8 only (72: SigLIP; 88), on the padded tiles: the hd128 design shapes, and
    the decode from an HND cache too (a KV head's rows contiguous; NHD interleaves 144- / 176-byte pieces of the
    heads, which share DRAM sectors: BENCHMARKS.md)."""
    out = []
    for d in (72, 88):
        spec = AttentionSpec(32, 8, d)
        out.append(BenchCase(f"prefill-hd{d}-causal-b4x8192", spec, [8192] * 4, [8192] * 4, "prefill"))
        out.append(BenchCase(f"decode-hd{d}-b64x4096", spec, [1] * 64, [4096] * 64, "decode"))
        out.append(BenchCase(f"decode-hd{d}-b64x4096-hnd", spec.replace(kv_layout="HND"), [1] * 64, [4096] * 64,
                             "decode"))
    return out


def mixed_cases() -> list[BenchCase]:
    """Issue #6's mixed batch: 4 prefill chunks of 2048 and 60 decode rows (4096 keys each), one call.

    Prefill sequences come first, so ``jitattn-separate`` (the same batch as one prefill call and
    one decode call, :func:`jitattn.bench.run.split_batch`) writes the same output rows.
    """
    hd128 = AttentionSpec(32, 8, 128)
    return [BenchCase("mixed-hd128-4x2048-prefill+60x4096-decode", hd128, [2048] * 4 + [1] * 60,
                      [2048] * 4 + [4096] * 60, "mixed")]


def cascade_cases() -> list[BenchCase]:
    """Issue #9's shared-prefix decode batches: R requests share a P-key prefix and add s keys each.

    ``jitattn`` is the cascade (:func:`jitattn.cascade.cascade_attention`, use_cascade=True); the anchor
    ``jitattn-plain`` is the same batch through the plain decode call (each request's block table
    holding the shared prefix pages, then its own; a prefix that ends mid-page has its last page copied
    per request). TB/s counts the un-split batch's bytes, R (P + s) keys: the cascade's rate is what
    the plain path would need to match it.
    """
    hd128 = AttentionSpec(32, 8, 128)
    out = []
    for r, p, s in ((50, 1000, 100), (64, 8192, 256)):
        out.append(BenchCase(f"cascade-hd128-r{r}-p{p}-s{s}", hd128, [1] * r, [p + s] * r, "cascade", cascade=(r, p, s)))
    return out


def host_cases() -> list[BenchCase]:
    """Issue #18's host-cost probes: microseconds per eager call, :data:`HOST_CALLS` calls back to back.

    The decode probe: 32/8 heads, hd 128, page 16, one sequence of 512 keys. The mixed probe: two
    prefill rows of 64 queries and 30 decode rows, 512 keys each, in one call. The inputs are so
    small that the GPU idles: the figure is what the host spends per call (checks, packing, launch).

    And issue 19's append probe (phase ``"append"``, :func:`jitattn.bench.host.run_append_case`):
    ``append_kv`` of a decode step, one new token for each of 64 sequences of 512 keys (8 KV heads, hd 128,
    bf16, an NHD cache of page 16), beside ``index_copy_`` of the same 262 KB.
    """
    hd128 = AttentionSpec(32, 8, 128)
    return [BenchCase("host-decode-hd128-b1x512", hd128, [1], [512], "decode", host=True),
            BenchCase("host-mixed-hd128-2x64-prefill+30-decode", hd128, [64] * 2 + [1] * 30, [512] * 32, "mixed",
                      host=True),
            BenchCase("host-append-kv-b64-h8-hd128", hd128, [1] * 64, [512] * 64, "append", host=True)]


def generate_case(setup: GenerateSetup) -> BenchCase:
    """The case of ``setup``: ``generate-<model>-b<batch>x<context>``; its spec is the config's first
    layer kind's (Gemma-2: the sliding one; every kind runs).

    Raises:
        OSError / ValueError: the config is missing or invalid.
    """
    from jitattn.models import load_model_config

    spec = load_model_config(model_config_path(setup.model)).layer_kinds[0].spec
    if setup.window and spec.window_left >= 0:
        spec = spec.replace(window_left=setup.window - 1)
    n, b = setup.context, setup.batch
    return BenchCase(f"generate-{setup.model}-b{b}x{n}", spec, [1] * b, [n] * b, "generate", generate=setup)


def generate_cases() -> list[BenchCase]:
    """Issue 19's decode-step cases: batch 8, 4096-token context, each of :data:`GENERATE_MODELS` found."""
    return [generate_case(GenerateSetup(m)) for m in GENERATE_MODELS if model_config_path(m).is_file()]


# ---- multi-head latent attention (MLA) decode (issue 20) ----------------------------------------
#: DeepSeek-V3's MLA fields (tests/models/deepseek-v3.json) that set the cases' softmax scale
#: (:func:`jitattn.models.mla_sm_scale`: 192 ** -0.5 times the YaRN mscale ** 2).
DEEPSEEK_V3_MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                   "rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": 1.0}}
#: FlashMLA's page (block) size, which vLLM's MLA backends use; FlashInfer's MLA wrapper takes any.
MLA_PAGE_SIZE = 64
#: A latent case checks the rows of its first this many sequences (64 x 128 heads x 4096 keys in fp32 is slow).
MLA_CHECK_SEQS = 4
#: H200 bf16 dense tensor-core peak over HBM bandwidth (989 TFLOP/s / 4.8 TB/s): a latent case doing
#: at least this many FLOPs per byte of cache is compute-bound and reports TFLOP/s, else TB/s.
H200_FLOP_PER_BYTE = 206


def mla_spec(num_qo_heads: int, kv_dtype: str | None = None) -> AttentionSpec:
    """DeepSeek-V3's MLA decode spec with ``num_qo_heads`` heads per rank: 576 / 512, one latent row per token,
    page :data:`MLA_PAGE_SIZE`, bf16 queries, the cache in ``kv_dtype`` (None: bf16)."""
    from jitattn.models import mla_sm_scale

    rank, rope = DEEPSEEK_V3_MLA["kv_lora_rank"], DEEPSEEK_V3_MLA["qk_rope_head_dim"]
    return AttentionSpec(num_qo_heads, 1, rank + rope, head_dim_vo=rank, q_dtype="bfloat16", kv_dtype=kv_dtype,
                         kv_storage="latent", page_size=MLA_PAGE_SIZE,
                         sm_scale=mla_sm_scale(DEEPSEEK_V3_MLA, "DeepSeek-V3"))


def mla_cases() -> list[BenchCase]:
    """Issue 20's MLA decode cases, DeepSeek-V3's dims: the TP8 shape (16 heads) 128 x 4096 keys, bf16 and FP8
    caches, and the TP1 shape (128 heads) 64 x 4096 keys."""
    n = MODEL_KV_LEN
    return [BenchCase(f"decode-mla-tp8-h16-b128x{n}", mla_spec(16), [1] * 128, [n] * 128, "decode"),
            BenchCase(f"decode-mla-tp1-h128-b64x{n}", mla_spec(128), [1] * 64, [n] * 64, "decode"),
            BenchCase(f"decode-mla-tp8-h16-b128x{n}-fp8", mla_spec(16, "float8_e4m3fn"), [1] * 128, [n] * 128,
                      "decode")]


def latent_unit(spec: AttentionSpec) -> str:
    """A latent case's unit: "TFLOP/s" when it does at least :data:`H200_FLOP_PER_BYTE` FLOPs
    (2 x (head_dim_qk + head_dim_vo) per query head and key) per byte of latent row, else "TB/s"."""
    flops = 2 * (spec.head_dim_qk + spec.head_dim_vo) * spec.num_qo_heads
    return "TFLOP/s" if flops >= H200_FLOP_PER_BYTE * spec.head_dim_qk * KV_ELEMENT_BYTES[spec.kv_dtype] else "TB/s"


def visible_decode_keys(spec: AttentionSpec, kv_len: int) -> int:
    """Keys a decode query (at position ``kv_len - 1``) can see: every key, or the ``window_left + 1`` last."""
    return kv_len if spec.window_left < 0 else min(kv_len, spec.window_left + 1)


def decode_kv_bytes(spec: AttentionSpec, batch: int, kv_len: int) -> int:
    """Bytes of K and V a decode batch of ``batch`` x (1 query, ``kv_len`` keys) must read (window applied);
    a latent spec's row once (V is its prefix)."""
    dims = spec.head_dim_qk + (0 if spec.latent else spec.head_dim_vo)
    row = spec.num_kv_heads * dims * KV_ELEMENT_BYTES[spec.kv_dtype]
    return batch * visible_decode_keys(spec, kv_len) * row


def decode_batch_size(spec: AttentionSpec, kv_len: int = MODEL_KV_LEN) -> int:
    """64 sequences, doubled until the batch reads MIN_DECODE_BYTES (> 2 x L2), at most MAX_DECODE_BATCH.

    A narrow window (gpt-oss: 128 keys) reads little per sequence, so its batch grows: 64 x 4096
    of gpt-oss sliding reads 17 MB and would run from L2.
    """
    batch = 64
    while decode_kv_bytes(spec, batch, kv_len) < MIN_DECODE_BYTES and batch < MAX_DECODE_BATCH:
        batch *= 2
    return batch


def model_cases(config: str | os.PathLike) -> list[BenchCase]:
    """A decode and a prefill case for every paged layer kind of a Hugging Face config, a decode case
    for every latent (MLA) one.

    Decode: :func:`decode_batch_size` x (1 query, 4096 keys); prefill: 2 x 4096 queries over 4096
    keys. Names: ``decode-<model>-<kind>-b<B>x4096``, ``prefill-<model>-<kind>-b2x4096`` with
    kind ``full``, ``sliding`` or ``mla`` (a latent kind: DeepSeek's ``mla_decode``).

    A ragged kind (DeepSeek's un-absorbed ``mla_prefill``) gets no case: the cases time a cache.

    Raises:
        OSError / ValueError: the config is missing or invalid (:func:`jitattn.models.load_model_config`),
            or none of its layer kinds is paged or latent.
    """
    from jitattn.models import load_model_config

    model = load_model_config(config)
    label = Path(model.name).name.lower() or Path(config).stem
    timed = [k for k in model.layer_kinds if k.spec.kv_storage in ("paged", "latent")]
    if not timed:
        kinds = ", ".join(f"{k.name} (kv_storage={k.spec.kv_storage!r})" for k in model.layer_kinds)
        raise ValueError(f"no bench case for its layer kinds {kinds}: model cases time a paged or a latent (MLA) "
                         f"cache")
    out = []
    for kind in timed:
        short = kind.name.split("_")[0]
        b, n = decode_batch_size(kind.spec), MODEL_KV_LEN
        out.append(BenchCase(f"decode-{label}-{short}-b{b}x{n}", kind.spec, [1] * b, [n] * b, "decode"))
        if kind.spec.latent:  # MLA decode only: prefill runs un-absorbed, on the ragged kind
            continue
        p = MODEL_PREFILL_BATCH
        out.append(BenchCase(f"prefill-{label}-{short}-b{p}x{n}", kind.spec, [n] * p, [n] * p, "prefill"))
    return out


def model_config_dir() -> Path | None:
    """The first of :data:`MODEL_CONFIG_DIRS` that exists (None: neither, a broken install)."""
    return next((d for d in MODEL_CONFIG_DIRS if d.is_dir()), None)


def model_config_path(stem: str) -> Path:
    """The example config ``<stem>.json`` (it may not exist: the caller checks)."""
    return (model_config_dir() or MODEL_CONFIG_DIRS[0]) / f"{stem}.json"


def example_model_configs() -> list[Path]:
    """The example model configs (:data:`MODEL_CONFIG_DIRS`), sorted by name."""
    found = model_config_dir()
    return sorted(found.glob("*.json")) if found is not None else []


def all_cases(models: list[Path] | None = None) -> list[BenchCase]:
    """DESIGN.md's six, the decode targets, hd72 / hd88, mixed, ragged, cascade, host, generate and MLA cases, then
    every layer kind of every model (default: :func:`example_model_configs`)."""
    out = (design_cases() + decode_target_cases() + head_dim_cases() + mixed_cases() + ragged_cases() + cascade_cases()
           + host_cases() + generate_cases() + mla_cases())
    for config in example_model_configs() if models is None else models:
        out += model_cases(config)
    return out


def select_cases(names: list[str] | tuple[str, ...] | None, models: list[str] | tuple[str, ...] | None
                 ) -> list[BenchCase]:
    """Cases whose name contains any ``names`` entry, plus every case of each ``models`` config.

    Neither given: every case of :func:`all_cases`. Duplicates (same name) are dropped.

    Raises:
        BenchUsageError: a ``--case`` that matches nothing, or a ``--model`` config that is missing
            or invalid (the message names it).
    """
    if not names and not models:
        return all_cases()
    chosen: list[BenchCase] = []
    if names:
        pool = all_cases()
        for sel in names:
            hits = [c for c in pool if sel in c.name]
            if not hits:
                raise BenchUsageError(f"--case {sel!r} matches no case; `jitattn bench --list` shows them")
            chosen += hits
    for config in models or []:
        try:
            chosen += model_cases(config)
        except (OSError, ValueError) as exc:
            raise BenchUsageError(f"--model {config}: {exc}") from exc
    unique: dict[str, BenchCase] = {}
    for c in chosen:
        unique.setdefault(c.name, c)
    return list(unique.values())


def list_cases(cases: list[BenchCase]) -> str:
    """One line per case: the name, then what it runs."""
    width = max((len(c.name) for c in cases), default=0)
    return "\n".join(f"{c.name:<{width}}  {c.describe()}" for c in cases)


def distinct_specs(cases: list[BenchCase]) -> list[tuple[AttentionSpec, set[str]]]:
    """Each distinct spec of ``cases`` (first-seen order) with the phases it is benchmarked in."""
    found: dict[AttentionSpec, set[str]] = {}
    for c in cases:
        found.setdefault(c.spec, set()).add(c.phase)
    return list(found.items())

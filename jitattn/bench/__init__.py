"""Benchmark: jitattn against the anchors, side by side, in one process, on the same inputs.

A performance claim counts only as a ratio measured in one run (these machines are noisy). Each
case times jitattn and every anchor installed here on the same random inputs (CUDA events, median
after warm-up), and reports each one's error against the fp32 reference, so a fast wrong answer
shows as wrong.

Anchors: torch SDPA (flash and cuDNN backends; plain causal/full cases only), FlexAttention
(torch.compile'd once per case, the variant written as score_mod / mask_mod) and FlashInfer
(paged prefill / decode wrappers on the same paged cache) when ``import flashinfer`` works. An
anchor that cannot express a case shows as a "skipped" row with the reason; one that raises shows
as a "failed" row with the error. Nothing an anchor does stops the run.

Units: prefill in TFLOP/s with 4 x head_dim FLOPs per visible (query, key) pair per query head;
decode in TB/s of K and V bytes the case must read (keys inside the window only); MLA decode cases in
TB/s of latent rows read, or TFLOP/s at 2 x (576 + 512) FLOPs per query head and key where compute-bound
(:mod:`~jitattn.bench.mla`: jitattn, torch SDPA and FlashInfer's MLA wrapper); host cases in
microseconds per eager call; generate cases in attention microseconds per decode step of a small
transformers model (needs transformers). Times in ms.

The package: :mod:`~jitattn.bench.cases` (the catalogue), :mod:`~jitattn.bench.harness` (timing),
:mod:`~jitattn.bench.anchors` (SDPA, Flex, FlashInfer on :mod:`jitattn.backends`),
:mod:`~jitattn.bench.run` (jitattn's runners and one case end to end), :mod:`~jitattn.bench.mla`
(the MLA decode rows), :mod:`~jitattn.bench.host`
(the host-cost case), :mod:`~jitattn.bench.generate` (the transformers decode-step case),
:mod:`~jitattn.bench.compile_figures` and :mod:`~jitattn.bench.warm_load`
(compile and load costs), :mod:`~jitattn.bench.report` (tables, JSON, BENCHMARKS.md). The command
line is ``jitattn bench`` (:mod:`jitattn.cli`); ``--list``, ``--from-json`` and ``--help`` need no
torch, ``--compile-only`` without a GPU measures the nvcc figures only.
"""

from __future__ import annotations

from dataclasses import dataclass

from jitattn.bench.cases import ANCHORS, BenchUsageError, list_cases, select_cases

__all__ = ["ANCHORS", "BenchOptions", "BenchUsageError", "main"]


@dataclass(frozen=True)
class BenchOptions:
    """What ``jitattn bench`` was asked to do (one field per option; defaults as the command's).

    Attributes:
        cases: case name substrings (``--case``); with ``models`` empty too, every case.
        models: Hugging Face config paths (``--model``): the cases of :func:`~jitattn.bench.cases.model_cases`
            (a decode and a prefill case per paged layer kind, a decode case per latent kind, none for a ragged one).
        anchors: the anchors to run, a subset of :data:`ANCHORS` in that order (``--anchors``).
        json: write environment, cases, results and compile figures here after every case (``--json``).
        md: replace the "Latest" section of this BENCHMARKS.md (``--md``).
        check: check each output against the fp32 reference (``--no-check`` turns it off).
        host_profile: cProfile the host side of each jitattn call instead of timing (``--host-profile``).
        compile: also measure compile figures (``--compile``; implied by ``compile_only``).
        compile_only: measure compile figures and nothing else (``--compile-only``).
        list: print the selected cases and stop (``--list``).
        from_json: run nothing; render these earlier ``--json`` files, merged in order (``--from-json``).
        seed: the input seed (``--seed``).
    """

    cases: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    anchors: tuple[str, ...] = ANCHORS
    json: str | None = None
    md: str | None = None
    check: bool = True
    host_profile: bool = False
    compile: bool = False
    compile_only: bool = False
    list: bool = False
    from_json: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = sorted(set(self.anchors) - set(ANCHORS))
        if unknown:
            raise BenchUsageError(f"--anchors: unknown {unknown}; expected a subset of {list(ANCHORS)}")
        object.__setattr__(self, "anchors", tuple(a for a in ANCHORS if a in self.anchors))
        object.__setattr__(self, "compile", self.compile or self.compile_only)

    @classmethod
    def parse_anchors(cls, text: str) -> tuple[str, ...]:
        """``"flex,sdpa"`` -> ``("flex", "sdpa")``; ``""`` -> ``()`` (jitattn alone)."""
        return tuple(a.strip() for a in text.split(",") if a.strip())

    def to_argv(self) -> list[str]:
        """The ``jitattn bench`` arguments that give these options (the command the environment records)."""
        out: list[str] = []
        for flag, values in (("--case", self.cases), ("--model", self.models)):
            for value in values:
                out += [flag, value]
        if self.anchors != ANCHORS:
            out += ["--anchors", ",".join(self.anchors)]
        for flag, path in (("--json", self.json), ("--md", self.md)):
            if path:
                out += [flag, path]
        flags = (("--no-check", not self.check), ("--host-profile", self.host_profile),
                 ("--compile-only", self.compile_only), ("--compile", self.compile and not self.compile_only),
                 ("--list", self.list))
        out += [flag for flag, on in flags if on]
        for path in self.from_json:
            out += ["--from-json", path]
        if self.seed:
            out += ["--seed", str(self.seed)]
        return out


def main(options: BenchOptions) -> str:
    """Run what ``options`` ask and print the table(s); returns the printed text.

    ``--from-json`` and ``--list`` need no torch; anything else imports :mod:`jitattn.bench.run`.

    Raises:
        BenchUsageError: a bad ``--case``, ``--model`` or ``--from-json`` (the message names it).
        SystemExit: no CUDA device, unless ``list``, ``from_json`` or ``compile_only``.
    """
    if options.from_json:
        from jitattn.bench import report

        env, results, figures = report.merge_runs([report.read_json(p) for p in options.from_json])
        return _finish(options, env, results, figures)
    cases = select_cases(options.cases, options.models)
    if options.list:
        print(list_cases(cases))
        return list_cases(cases)
    from jitattn.bench.run import profile_host, require_gpu, run

    require_gpu(options)
    if options.host_profile:
        text = "\n".join(profile_host(c) for c in cases)
        print(text)
        return text
    return _finish(options, *run(options, cases))


def _finish(options: BenchOptions, env: dict, results: list, figures: list) -> str:
    from jitattn.bench import report

    text = report.render(results, figures)
    print(text, end="")
    if options.md:
        report.write_benchmarks_md(results, env, options.md, figures)
    return text

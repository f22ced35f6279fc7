"""The ``jitattn`` command line, run as a real process (``python -m jitattn``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jitattn import AttentionSpec, Param, Variant
from jitattn.cache import KernelCache, MissingKernelError
from jitattn.cli import default_jobs, parse_spec_arg
from jitattn.append_kv_module import AppendKvModule
from jitattn.merge_module import MergeModule
from jitattn.models import model_specs
from tests.test_cache import REAL_NVCC, compile_calls, fake_nvcc

REPO = Path(__file__).resolve().parent.parent
GEMMA = REPO / "examples" / "models" / "gemma-2-9b.json"
SMALL = AttentionSpec(8, 2, 64)


def jitattn(*args: str, cache: Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_")}
    full = {**clean, "PYTHONPATH": str(REPO), "JITATTN_CACHE_DIR": str(cache), **(env or {})}
    return subprocess.run([sys.executable, "-m", "jitattn", *args], capture_output=True, text=True, env=full,
                          cwd=cwd, timeout=600)


def summary(proc: subprocess.CompletedProcess) -> str:
    return next(ln for ln in proc.stdout.splitlines() if ln.startswith("compiled "))


# ---- warmup ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_warmup_twice_second_run_all_cached_without_nvcc(tmp_path):
    nvcc, log = fake_nvcc(tmp_path, "record")
    env = {"JITATTN_NVCC": str(nvcc)}
    first = jitattn("warmup", "--model", "examples/models/gemma-2-9b.json", "--arch", "sm_90a", cache=tmp_path / "c",
                    env=env)
    assert first.returncode == 0, first.stderr
    assert summary(first).startswith("compiled 4, cached 0, failed 0 in ")  # 2 layer kinds + merge_state + append_kv
    for spec in [*model_specs(GEMMA), MergeModule("bfloat16"), AppendKvModule("bfloat16")]:
        assert spec.name in first.stdout
    assert "gemma-2-9b/sliding_attention" in first.stdout and "gemma-2-9b/full_attention" in first.stdout
    assert "gemma-2-9b/merge_state" in first.stdout and "gemma-2-9b/append_kv" in first.stdout
    assert len(compile_calls(log)) == 4 and all("sm_90a" in c for c in compile_calls(log))
    assert "4 specs x 1 archs (sm_90a)" in first.stderr

    refusing, log2 = fake_nvcc(tmp_path, "no-compile")
    second = jitattn("warmup", "--model", str(GEMMA), "--arch", "90a", cache=tmp_path / "c",
                     env={"JITATTN_NVCC": str(refusing)})
    assert second.returncode == 0, second.stderr
    assert summary(second).startswith("compiled 0, cached 4, failed 0 in ")
    assert compile_calls(log2) == []


def test_warmup_cascade_adds_each_paged_specs_explicit_position_twin(tmp_path):
    """--cascade: each layer kind's twin (query_positions='explicit') is built right after it (fake nvcc)."""
    nvcc, log = fake_nvcc(tmp_path, "record")
    proc = jitattn("warmup", "--model", str(GEMMA), "--cascade", "--arch", "sm_90a", cache=tmp_path / "c",
                   env={"JITATTN_NVCC": str(nvcc)})
    assert proc.returncode == 0, proc.stderr
    assert summary(proc).startswith("compiled 6, cached 0, failed 0 in ")  # 2 kinds, their 2 twins, merge, append_kv
    for spec in model_specs(GEMMA):
        assert spec.replace(query_positions="explicit").name in proc.stdout
    assert "gemma-2-9b/sliding_attention (cascade)" in proc.stdout


def test_cascade_targets_include_the_merge_module_for_a_spec_alone():
    """The cascade merges its passes' states with the merge_state kernel of spec.o_dtype: a --spec (no model,
    whose merge module was the only one added) with --cascade left it out of warmup and cache export."""
    from jitattn.cli import collect_targets
    spec = AttentionSpec(8, 2, 64, q_dtype="float16")
    targets = collect_targets([], [spec.canonical_json()], dtype=None, page_size=16, kv_layout="NHD", cascade=True)
    assert [t.spec for t in targets] == [spec, spec.replace(query_positions="explicit"), MergeModule("float16")]
    plain = collect_targets([], [spec.canonical_json()], dtype=None, page_size=16, kv_layout="NHD")
    assert [t.spec for t in plain] == [spec]


@pytest.mark.slow
def test_warmup_default_archs_jobs_and_dedup(tmp_path):
    proc = jitattn("warmup", "-m", str(GEMMA), "-m", str(GEMMA), "--spec", SMALL.canonical_json(), "-j", "1",
                   cache=tmp_path / "c", env={"JITATTN_ARCHS": "sm_80"})
    assert proc.returncode == 0, proc.stderr
    assert summary(proc).startswith("compiled 5, cached 0, failed 0")  # the model twice: 2 specs + merge + append_kv
    assert "5 specs x 1 archs (sm_80), -j 1" in proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if "sm_80" in ln]
    assert len(rows) == 5
    assert "gemma-2-9b/sliding_attention, gemma-2-9b/sliding_attention" in proc.stdout
    assert "--spec #1" in proc.stdout


@pytest.mark.slow
def test_warmup_runs_the_command_a_missing_kernel_error_prints(tmp_path, monkeypatch):
    variant = Variant("scaled", logits_transform="logits * temp", params=(Param("temp", "float32"),))
    spec = AttentionSpec(12, 4, 96, sinks=True, window_left=127, variant=variant, kv_layout="HND")
    root = tmp_path / "c"
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    with pytest.raises(MissingKernelError) as info:
        KernelCache(root=root, layers=()).get_or_build(spec, "sm_90a")
    command = next(ln.strip() for ln in str(info.value).splitlines() if ln.strip().startswith("jitattn warmup"))
    argv = shlex.split(command)
    assert argv[:2] == ["jitattn", "warmup"]
    proc = jitattn(*argv[1:], cache=root, env={"JITATTN_DISABLE_JIT": "1"})  # warmup compiles even so
    assert proc.returncode == 0, proc.stderr
    assert summary(proc).startswith("compiled 1, cached 0, failed 0")
    assert "JITATTN_DISABLE_JIT=1 is set; warmup is the build step" in proc.stderr
    entry, built = KernelCache(root=root, layers=()).get_or_build(spec, "sm_90a")
    assert not built and entry.spec == spec


@pytest.mark.slow
def test_warmup_model_with_an_fp8_kv_cache(tmp_path):
    """``--kv-dtype float8_e4m3fn`` builds a model's FP8-cache kernels (what a serving node with an FP8 KV
    cache loads); without it warmup --model builds the 16-bit ones only."""
    nvcc, log = fake_nvcc(tmp_path, "record")
    proc = jitattn("warmup", "--model", str(GEMMA), "--kv-dtype", "fp8", "--arch", "sm_90a", cache=tmp_path / "c",
                   env={"JITATTN_NVCC": str(nvcc)})
    assert proc.returncode == 0, proc.stderr
    fp8 = model_specs(GEMMA, kv_dtype="float8_e4m3fn")
    assert all(s.kv_dtype == "float8_e4m3fn" for s in fp8)
    for spec in fp8:
        assert spec.name in proc.stdout
        assert KernelCache(root=tmp_path / "c", layers=()).find(spec, "sm_90a") is not None
    assert len(compile_calls(log)) == 4  # 2 layer kinds + merge_state + append_kv (bf16 into fp8)


@pytest.mark.slow
def test_warmup_spec_from_files(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(SMALL.to_json(), indent=2))
    many = tmp_path / "many.json"
    many.write_text(json.dumps([{"num_qo_heads": 4, "num_kv_heads": 4, "head_dim_qk": 64},
                                SMALL.replace(page_size=1).to_json()]))
    proc = jitattn("warmup", "--spec", str(one), "--spec", str(many), "--arch", "sm_80", cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    assert summary(proc).startswith("compiled 3, cached 0, failed 0")
    assert parse_spec_arg(str(one)) == [SMALL]
    assert parse_spec_arg(str(many))[0] == AttentionSpec(4, 4, 64)


@pytest.mark.slow
def test_failed_kernel_exits_1_with_nvcc_message_and_others_still_build(tmp_path):
    typo = AttentionSpec(8, 2, 64, variant=Variant("typo", logits_transform="logits + undefined_thing"))
    proc = jitattn("warmup", "--spec", typo.canonical_json(), "--spec", SMALL.canonical_json(), "--arch", "sm_80",
                   cache=tmp_path / "c")
    assert proc.returncode == 1
    assert summary(proc).startswith("compiled 1, cached 0, failed 1")
    assert f"FAILED {typo.name} sm_80 (needed by --spec #1)" in proc.stderr
    assert 'identifier "undefined_thing" is undefined' in proc.stderr
    assert "(functor logits_transform, line 1 of the expression)" in proc.stderr
    kept = tmp_path / "c" / "v1" / "failed"
    assert any(kept.glob("*/kernel.cu")) and str(kept) in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- user errors: one line, exit 2 -------------------------------------------------------------
BAD_ARGS = [
    ((), {}, r"nothing to build: pass --model CONFIG.json and/or --spec JSON_OR_FILE"),
    (("--model", "nope/config.json"), {}, r"nope/config.json: model config not found"),
    (("--model", "pyproject.toml"), {}, r"pyproject.toml: not valid JSON"),
    (("--spec", "{num_qo_heads: 8"), {}, r"--spec: not valid JSON"),
    (("--spec", "specs/missing.json"), {}, r"--spec 'specs/missing.json': no such file, and not JSON text"),
    (("--spec", '{"num_qo_heads": 8, "num_kv_heads": 3, "head_dim_qk": 64}'), {},
     r"--spec: invalid spec: num_qo_heads=8, num_kv_heads=3: num_kv_heads must divide num_qo_heads"),
    (("--spec", '{"num_qo_heads": 8}'), {}, r"--spec: invalid spec: .*missing required fields \[.num_kv_heads., .head_dim_qk.\]"),
    (("--spec", '{"num_qo_heads": 8, "num_kv_heads": 8, "head_dim_qk": 64, "nope": 1}'), {},
     r"--spec: invalid spec: AttentionSpec.from_json: unknown fields \['nope'\]"),
    (("--spec", "[1, 2]"), {}, r"--spec \[0\]: expected a JSON object with AttentionSpec fields, got int"),
    (("--spec", "[]"), {}, r"--spec: an empty list; --spec needs at least one AttentionSpec object"),
    (("--model", str(GEMMA), "--arch", "sm_75"), {}, r"--arch='sm_75': sm_75 is below sm_80, which jitattn needs"),
    (("--model", str(GEMMA), "--tensor-parallel-size", "3"), {},
     r"gemma-2-9b.json: tensor_parallel_size=3: num_attention_heads=16 does not divide over 3 ranks"),
    # a spec alone never reaches the heads' split, which refused a bad count: 0 ranks were accepted
    (("--spec", '{"num_qo_heads": 8, "num_kv_heads": 8, "head_dim_qk": 64}', "--tp", "0"), {},
     r"Invalid value for '--tensor-parallel-size' / '--tp': .*1"),
    # the model options, named at parsing (they were blamed on a layer kind of the model)
    (("--model", str(GEMMA), "--kv-layout", "nhd"), {},
     r"Invalid value for '--kv-layout': 'nhd': expected one of NHD, HND \(upper case"),
    (("--model", str(GEMMA), "--dtype", "float32"), {},
     r"Invalid value for '--dtype': 'float32': expected one of float16, bfloat16 \(or an alias: fp16, bf16\)"),
    (("--model", str(GEMMA), "--page-size", "0"), {},
     r"Invalid value for '--page-size': 0: expected tokens per page in \[1, 1024\]"),
    (("--model", str(GEMMA), "--kv-dtype", "float8_e5m2"), {},
     r"Invalid value for '--kv-dtype': 'float8_e5m2': expected one of float16, bfloat16, float8_e4m3fn"),
    (("--model", str(GEMMA)), {"JITATTN_NVCC": "/nonexistent/nvcc"},
     r"cannot run nvcc at '/nonexistent/nvcc' .*set JITATTN_NVCC / CUDA_HOME"),
    (("--model", str(GEMMA)), {"JITATTN_ARCHS": "sm_80,volta"}, r"JITATTN_ARCHS='volta': unknown target arch"),
    # read before any work: DISABLE_JIT was read unguarded (a traceback), LOCK_TIMEOUT only at a build (a
    # "failed" kernel, exit 1)
    (("--model", str(GEMMA)), {"JITATTN_DISABLE_JIT": "maybe"},
     r"JITATTN_DISABLE_JIT='maybe': expected one of 1/0, true/false"),
    (("--model", str(GEMMA)), {"JITATTN_LOCK_TIMEOUT": "abc"}, r"JITATTN_LOCK_TIMEOUT='abc': expected a number"),
]


@pytest.mark.parametrize("args,env,match", BAD_ARGS, ids=[m[:40] for _, _, m in BAD_ARGS])
def test_user_errors_exit_2_with_one_clear_line(tmp_path, args, env, match):
    import re

    proc = jitattn("warmup", *args, cache=tmp_path / "c", env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("jitattn: error: ") and re.search(match, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_unwritable_cache_root_exits_2(tmp_path):
    """JITATTN_CACHE_DIR names the unwritable root: the fix is to point it elsewhere, not to set it."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = jitattn("warmup", "--spec", SMALL.canonical_json(), cache=blocker / "cache")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"jitattn: error: cache root {blocker / 'cache'} is not writable")
    assert "JITATTN_CACHE_DIR is set to this root: point it at a writable directory" in proc.stderr
    assert "set JITATTN_CACHE_DIR" not in proc.stderr


def test_float32_config_error_names_the_command_line_option(tmp_path):
    config = tmp_path / "llama-fp32.json"
    config.write_text(json.dumps({**json.loads((REPO / "examples" / "models" / "llama-3-8b.json").read_text()),
                                  "torch_dtype": "float32"}))
    proc = jitattn("select", "--model", str(config), "--device", "h100", cache=tmp_path / "c")
    assert proc.returncode == 2 and "--dtype bfloat16" in proc.stderr, proc.stderr


def test_bad_option_value_is_a_usage_error(tmp_path):
    proc = jitattn("warmup", "-j", "0", "--model", str(GEMMA), cache=tmp_path / "c")
    assert proc.returncode == 2, proc.stderr
    # One line in the form of every other usage error (typer's min= bound printed a boxed usage text).
    assert proc.stderr.strip() == "jitattn: error: --jobs 0: expected a number of compiles >= 1 (or leave it out " \
                                  "for the default)", proc.stderr



@pytest.mark.parametrize("args, message", [
    (("warmup", "-j", "abc"), "Invalid value for '--jobs' / '-j'"),
    (("warmup", "--page-size", "16k"), "Invalid value for '--page-size'"),
    (("warmup", "--nope"), "No such option: --nope"),
    (("frobnicate",), "No such command 'frobnicate'"),
    (("cache", "ls", "--jsn"), "No such option: --jsn"),
    (("select", "--model"), "Option '--model' requires an argument"),
])
def test_command_line_parse_errors_are_one_line(tmp_path, args, message):
    """A value click cannot parse, an unknown option or command: one `jitattn: error:` line and exit 2,
    like every other usage error (click printed its usage text, a hint and the error on four lines)."""
    proc = jitattn(*args, "--model", str(GEMMA), cache=tmp_path / "c") if args[0] == "warmup" else \
        jitattn(*args, cache=tmp_path / "c")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jitattn: error: ") and message in lines[0], proc.stderr


def test_no_arguments_still_prints_the_help(tmp_path):
    proc = jitattn(cache=tmp_path)
    assert "warmup" in proc.stdout + proc.stderr and "jitattn: error" not in proc.stderr

def test_default_jobs_is_at_least_one():
    assert 1 <= default_jobs() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("cores,free_gib,jobs", [(2, 20, 2), (64, 20, 10), (16, 3, 1), (8, 0, 1), (1, 100, 1)])
def test_default_jobs_from_cores_and_memory(monkeypatch, cores, free_gib, jobs):
    from jitattn import cli

    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(cli, "_available_gib", lambda: free_gib)
    assert default_jobs() == jobs  # one compile per core, at most one per 2 GiB of free memory


def copying_nvcc(tmp_path: Path, sleep: float) -> tuple[Path, Path]:
    """A stand-in nvcc that records how many compiles run at once, sleeps, and writes a fake cubin.

    Returns the script and the log of concurrent compiles (one count per compile, taken as it starts).
    """
    running, counts = tmp_path / "running", tmp_path / "concurrency.log"
    running.mkdir()
    script = tmp_path / "nvcc-copy"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then exec "{REAL_NVCC}" --version; fi
prev=""; out=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
touch "{running}/$$"
ls "{running}" | wc -l >> "{counts}"
sleep {sleep}
printf 'not a real cubin' > "$out"
rm -f "{running}/$$"
""")
    script.chmod(0o755)
    return script, counts


@pytest.mark.parametrize("jobs,specs", [("2", 4), ("1", 2), (None, 3)])
def test_warmup_runs_at_most_j_compiles_at_once(tmp_path, jobs, specs):
    # Each fake compile lasts 2 s, so compiles started together overlap even on a loaded box.
    nvcc, counts = copying_nvcc(tmp_path, sleep=2.0)
    spec_file = tmp_path / "specs.json"
    spec_file.write_text(json.dumps([SMALL.replace(page_size=2 ** i).to_json() for i in range(specs)]))
    args = ["warmup", "--spec", str(spec_file), "--arch", "sm_80"] + (["-j", jobs] if jobs else [])
    proc = jitattn(*args, cache=tmp_path / "c", env={"JITATTN_NVCC": str(nvcc)})
    assert proc.returncode == 0, proc.stderr
    if jobs:
        cap = int(jobs)
    else:  # the default follows the cores and the memory available at that moment (read by the child)
        cap = int(re.search(r"-j (\d+)", proc.stderr).group(1))
        assert 1 <= cap <= (os.cpu_count() or 1), proc.stderr
    assert f"{specs} specs x 1 archs (sm_80), -j {cap}" in proc.stderr
    seen = [int(n) for n in counts.read_text().split()]
    assert len(seen) == specs and max(seen) == min(cap, specs), seen  # the cap is reached, never passed


# ---- cache ls ----------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [("ls",), ("verify",), ("prune", "--dry-run")])
@pytest.mark.parametrize("variable", ["JITATTN_CACHE_DIR", "JITATTN_CACHE_PATH"])
def test_cache_commands_refuse_a_file_as_the_cache(tmp_path, command, variable):
    """A root or layer that is a file read as an empty cache ('no cache entries', exit 0)."""
    afile = tmp_path / "not-a-cache.tar"
    afile.write_bytes(b"x")
    env = {variable: str(afile)}
    proc = jitattn("cache", *command, cache=afile if variable == "JITATTN_CACHE_DIR" else tmp_path / "c", env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip() == f"jitattn: error: {variable}: {afile} is a file, not a cache directory"


@pytest.mark.slow
def test_cache_ls_lists_every_layer_with_status(tmp_path):
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    a, _ = KernelCache(root=rw, layers=()).get_or_build(SMALL, "sm_80")
    b, _ = KernelCache(root=ro, layers=()).get_or_build(SMALL.replace(page_size=32), "sm_90a")
    env = {"JITATTN_CACHE_PATH": str(ro)}
    proc = jitattn("cache", "ls", cache=rw, env=env)
    assert proc.returncode == 0, proc.stderr
    for entry, layer in ((a, f"{rw} (writable)"), (b, f"{ro} (read-only)")):
        row = next(ln for ln in proc.stdout.splitlines() if entry.key[:12] in ln)
        assert entry.manifest["name"] in row and entry.arch in row and layer in row and "ok" in row
    assert "2 entries" in proc.stdout

    rows = json.loads(jitattn("cache", "ls", "--json", cache=rw, env=env).stdout)
    assert [(r["key"], r["layer"], r["status"]) for r in rows] == [(a.key, "writable", "ok"), (b.key, "read-only", "ok")]
    assert rows[0]["size"] > 10_000 and rows[0]["build_seconds"] > 0 and rows[0]["arch"] == "sm_80"
    assert rows[0]["path"] == str(a.path) and rows[0]["name"] == SMALL.name

    b.cubin.write_bytes(b"\x7fELF broken")
    rows = json.loads(jitattn("cache", "ls", "--json", cache=rw, env=env).stdout)
    assert "does not match its sha256" in rows[1]["status"]
    table = jitattn("cache", "ls", cache=rw, env=env).stdout
    assert f"corrupt {b.key[:12]} ({b.path}): artifact kernel.sm_90a.cubin does not match its sha256" in table


def test_cache_ls_empty(tmp_path):
    proc = jitattn("cache", "ls", cache=tmp_path / "empty")
    assert proc.returncode == 0 and proc.stdout.startswith(f"no cache entries in {tmp_path / 'empty'}")
    assert json.loads(jitattn("cache", "ls", "--json", cache=tmp_path / "empty").stdout) == []


# ---- other verbs -------------------------------------------------------------------------------
def test_bench_without_gpu_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: jitattn bench would run")
    proc = jitattn("bench", "--case", "decode", cache=tmp_path / "c")
    assert proc.returncode == 2
    assert proc.stderr.startswith("jitattn: error: jitattn bench runs kernels on a CUDA GPU, and cannot here:")


def test_bench_names_an_unknown_case_before_the_missing_gpu(tmp_path):
    """``bench --case nope`` on a machine without a GPU: the unknown case is the error (exit 2), since a
    GPU would not fix it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = jitattn("bench", "--case", "nope", cache=tmp_path / "c")
    assert proc.returncode == 2
    assert proc.stderr.startswith("jitattn: error: --case 'nope' matches no case")


def test_bench_model_help_says_which_kinds_get_cases():
    """A DeepSeek config gives one latent decode case and none for its ragged mla_prefill kind: the help says so."""
    from typer.main import get_command

    from jitattn.cli import app

    help_text = next(p.help for p in get_command(app).commands["bench"].params if p.name == "model")
    assert "a decode and a prefill case per paged layer kind, a decode case per latent (MLA) kind, none for a " \
           "ragged kind" in help_text


def test_bench_forwards_its_arguments(monkeypatch):
    from typer.testing import CliRunner

    from jitattn import bench as bench_module
    from jitattn import cli

    seen = []
    monkeypatch.setattr(cli, "gpu_problem", lambda: None)
    monkeypatch.setattr(bench_module, "main", seen.append)
    result = CliRunner().invoke(cli.app, ["bench", "--case", "decode", "--no-check"])
    assert result.exit_code == 0, result.output
    assert seen == [bench_module.BenchOptions(cases=("decode",), check=False)]


def test_version_and_help(tmp_path):
    import jitattn as pkg

    assert jitattn("--version", cache=tmp_path).stdout.strip() == f"jitattn {pkg.__version__}"
    helptext = jitattn("--help", cache=tmp_path).stdout
    for verb in ("warmup", "cache", "select", "bench"):
        assert verb in helptext
    cache_help = jitattn("cache", "--help", cache=tmp_path).stdout
    for verb in ("ls", "verify", "prune", "clear", "export", "import"):
        assert verb in cache_help


# ---- select ------------------------------------------------------------------------------------
def test_select_names_a_backend_per_layer_kind_without_a_gpu(tmp_path):
    proc = jitattn("select", "--model", str(GEMMA), "--device", "h100", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gemma-2-9b (gemma2, 42 layers) on h100")
    assert "| sliding_attention | 21 (0, 2, 4, 6, ...) | jit |" in proc.stdout
    data = json.loads(jitattn("select", "-m", str(GEMMA), "-d", "sm_90", "--phase", "decode", "--json", cache=tmp_path).stdout)
    assert data["ok"] is True and data["phase"] == "decode"
    assert [(k["layer_kind"], k["backend"]) for k in data["layer_kinds"]] == [("sliding_attention", "jit"),
                                                                            ("full_attention", "jit")]


def test_select_with_an_fp8_kv_cache(tmp_path):
    proc = jitattn("select", "-m", str(GEMMA), "-d", "h100", "--kv-dtype", "float8_e4m3fn", "--json", cache=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [k["backend"] for k in data["layer_kinds"]] == ["jit", "jit"]
    assert all(k["spec"]["kv_dtype"] == "float8_e4m3fn" for k in data["layer_kinds"])
    assert any(r.startswith("flex: kv_dtype=float8_e4m3fn not supported") for r in data["layer_kinds"][0]["passed_over"])


def test_select_exit_codes(tmp_path):
    forced = jitattn("select", "-m", str(GEMMA), "--device", "cpu", "--backend", "jit", cache=tmp_path)
    assert forced.returncode == 1, forced.stderr  # jit cannot serve on a CPU: the table says why
    assert "| sliding_attention | 21 (0, 2, 4, 6, ...) | none |" in forced.stdout
    bad = jitattn("select", "-m", str(GEMMA), "--device", "tpu", cache=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("jitattn: error: device='tpu': unknown device")


def _without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """Environment for a child in which ``modules`` cannot be imported (a finder on sys.meta_path that
    raises ModuleNotFoundError for them, as a machine without them would)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(f"""import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {set(modules)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
sys.meta_path.insert(0, _Blocked())
""")
    return {"PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}


def test_select_on_a_named_device_works_without_torch(tmp_path):
    """The planning command for a serving node runs on a build box that has no torch."""
    proc = jitattn("select", "--model", str(GEMMA), "--device", "h100", "--json", cache=tmp_path / "c",
                   env=_without(tmp_path, "torch"))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [k["backend"] for k in data["layer_kinds"]] == ["jit", "jit"]
    probe = jitattn("select", "--model", str(GEMMA), cache=tmp_path / "c", env=_without(tmp_path, "torch"))
    assert probe.returncode == 2 and "torch is not installed to find the current one" in probe.stderr, probe.stderr


def test_bench_without_torch_exits_2_with_one_line(tmp_path):
    """bench --compile-only loads torch; without it, one line (--list needs no torch:
    tests/test_bench.py::test_list_and_help_need_no_torch)."""
    proc = jitattn("bench", "--compile-only", cache=tmp_path / "cache", env=_without(tmp_path, "torch"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("jitattn: error: `jitattn bench` needs torch"), proc.stderr


def test_no_numpy_warning_from_torch_on_a_command(tmp_path):
    """torch warns "Failed to initialize NumPy" at import when its NumPy bridge cannot load; a
    command that loads torch (select without --device looks for the current GPU) must not print it."""
    proc = jitattn("select", "--model", str(GEMMA), "--device", "cpu", cache=tmp_path / "c",
                   env=_without(tmp_path, "numpy"))
    plain = jitattn("select", "--model", str(GEMMA), cache=tmp_path / "c", env=_without(tmp_path, "numpy"))
    for p in (proc, plain):
        assert p.returncode in (0, 1), p.stderr
        assert "NumPy" not in p.stderr, p.stderr


def test_bench_help_is_the_bench_option_list(tmp_path):
    proc = jitattn("bench", "--help", cache=tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    assert "--case" in proc.stdout and "--list" in proc.stdout, proc.stdout
    assert "`jitattn bench --help`" not in proc.stdout


def test_verbose_logs_each_compile_command_and_cache_decision(tmp_path):
    """JITATTN_VERBOSE=1: the compile command (a stand-in nvcc writes the cubin) and each decision
    (miss, published, then a hit in the second run) go to stderr."""
    nvcc, _ = copying_nvcc(tmp_path, sleep=0.0)
    env = {"JITATTN_NVCC": str(nvcc), "JITATTN_VERBOSE": "1"}
    args = ["warmup", "--spec", SMALL.canonical_json(), "--arch", "sm_80"]
    first = jitattn(*args, cache=tmp_path / "c", env=env)
    assert first.returncode == 0, first.stderr
    assert re.search(rf"\[jitattn\] miss {SMALL.name} for sm_80", first.stderr), first.stderr
    assert re.search(rf"\[jitattn\] compile sm_80 in .*: {re.escape(str(nvcc))} -O3 .*-gencode=arch=compute_80,"
                     rf"code=sm_80 -o kernel.sm_80.cubin kernel.cu", first.stderr), first.stderr
    assert f"[jitattn] published {SMALL.name} for sm_80 as {tmp_path / 'c'}" in first.stderr
    second = jitattn(*args, cache=tmp_path / "c", env=env)
    assert re.search(rf"\[jitattn\] hit {SMALL.name} for sm_80: {tmp_path / 'c'}/v1/entries/", second.stderr)
    quiet = jitattn(*args, cache=tmp_path / "c", env={"JITATTN_NVCC": str(nvcc)})
    assert "[jitattn]" not in quiet.stderr

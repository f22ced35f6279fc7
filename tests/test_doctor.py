"""``jitattn doctor`` and the serving-node checks around it: what a node without nvcc can serve.

Entries are published without compiling (:mod:`tests.fake_entries`); one slow test warms a TP-8
Llama-3-70B-shaped model with the real nvcc and checks that the kernels are found.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jitattn.append_kv_module import AppendKvModule
from jitattn.cache import KernelCache, MissingKernelError
from jitattn.doctor import diagnose
from jitattn.merge_module import MergeModule
from jitattn.models import load_model_config
from jitattn.spec import AttentionSpec
from tests.fake_entries import flip_cubin, publish_fake
from tests.test_cli import jitattn

REPO = Path(__file__).resolve().parent.parent
LLAMA_8B = REPO / "examples" / "models" / "llama-3-8b.json"
LLAMA_70B = Path(__file__).resolve().parent / "models" / "llama-3-70b.json"
SMALL = AttentionSpec(8, 2, 64)


def model_modules(config: Path, **kwargs) -> list:
    """What warm-up builds for the model: its specs, merge_state and append_kv (llama: one of each)."""
    model = load_model_config(config, **kwargs)
    return [*model.specs(), MergeModule(model.layer_kinds[0].spec.o_dtype),
            AppendKvModule(model.layer_kinds[0].spec.q_dtype)]


def no_gpu(monkeypatch) -> None:
    """The doctor asks the driver for GPUs; these tests check the no-GPU (build box) reading."""
    from jitattn import doctor
    from jitattn.doctor import Driver

    monkeypatch.setattr(doctor, "find_driver", lambda: Driver(None, (), "no NVIDIA driver (test)"))


# ---- the library ---------------------------------------------------------------------------------
def test_doctor_says_ok_only_when_every_kernel_is_cached_for_every_arch(tmp_path, monkeypatch):
    no_gpu(monkeypatch)
    cache = KernelCache(root=tmp_path / "c", layers=())
    wanted = model_modules(LLAMA_8B)
    for module in wanted:
        publish_fake(cache, module, "sm_90a")
    report = diagnose([LLAMA_8B], ["sm_90a"], cache=cache)
    assert report.ok and report.warmup_command is None
    assert [k.name for k in report.models[0].kernels] == [m.name for m in wanted]
    both = diagnose([LLAMA_8B], ["sm_80", "sm_90a"], cache=cache)
    assert not both.ok  # a node without a GPU checks each arch it ships for
    assert all(set(k.found) == {"sm_90a"} for k in both.models[0].kernels)
    assert both.warmup_command == f"jitattn warmup --model {LLAMA_8B} --arch sm_80 --arch sm_90a"


def test_doctor_checks_the_append_kv_module_warmup_builds(tmp_path):
    """A node with the attention and merge_state kernels but no append_kv fails doctor (export would too)."""
    root = tmp_path / "c"
    cache = KernelCache(root=root, layers=())
    spec, merge, append = model_modules(LLAMA_8B)
    for module in (spec, merge):
        publish_fake(cache, module, "sm_90a")
    proc = jitattn("doctor", "--model", str(LLAMA_8B), "--arch", "sm_90a", cache=root,
                   env={"JITATTN_DISABLE_JIT": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    kernels = json.loads(jitattn("doctor", "--model", str(LLAMA_8B), "--arch", "sm_90a", "--json", cache=root,
                                 env={"JITATTN_DISABLE_JIT": "1"}).stdout)["models"][0]["kernels"]
    assert [(k["name"], k["served"]) for k in kernels] == [(spec.name, True), (merge.name, True), (append.name, False)]
    publish_fake(cache, append, "sm_90a")
    assert jitattn("doctor", "--model", str(LLAMA_8B), "--arch", "sm_90a", cache=root,
                   env={"JITATTN_DISABLE_JIT": "1"}).returncode == 0


def test_doctor_on_a_gpu_node_takes_any_arch_the_gpu_runs(tmp_path, monkeypatch):
    from jitattn import doctor
    from jitattn.doctor import Driver, Gpu

    monkeypatch.setattr(doctor, "find_driver", lambda: Driver("13.0", (Gpu(0, "NVIDIA H200", (9, 0)),)))
    cache = KernelCache(root=tmp_path / "c", layers=())
    for module in model_modules(LLAMA_8B):
        publish_fake(cache, module, "sm_90")  # not the best arch, but one an H200 runs
    report = diagnose([LLAMA_8B], cache=cache)
    assert report.archs == ("sm_90a", "sm_90") and report.any_arch and report.ok


def test_doctor_on_a_node_of_two_gpu_kinds_needs_an_arch_each_runs(tmp_path, monkeypatch):
    """An A100 and an H100 in one node: an sm_80 build runs on the A100 only (cubins do not cross major
    versions), so the node is not served until an arch the H100 runs is cached too."""
    from jitattn import doctor
    from jitattn.doctor import Driver, Gpu

    gpus = (Gpu(0, "NVIDIA A100", (8, 0)), Gpu(1, "NVIDIA H100", (9, 0)))
    monkeypatch.setattr(doctor, "find_driver", lambda: Driver("13.0", gpus))
    cache = KernelCache(root=tmp_path / "c", layers=())
    for module in model_modules(LLAMA_8B):
        publish_fake(cache, module, "sm_80")
    report = diagnose([LLAMA_8B], cache=cache)
    assert report.any_arch and not report.ok
    assert report.warmup_command == f"jitattn warmup --model {LLAMA_8B} --arch sm_80 --arch sm_90a"
    for module in model_modules(LLAMA_8B):
        publish_fake(cache, module, "sm_90")
    assert diagnose([LLAMA_8B], cache=cache).ok


def test_doctor_reports_corrupt_entries_of_every_layer(tmp_path, monkeypatch):
    no_gpu(monkeypatch)
    image = KernelCache(root=tmp_path / "image", layers=())
    entries = [publish_fake(image, m, "sm_90a") for m in model_modules(LLAMA_8B)]
    flip_cubin(entries[0])
    cache = KernelCache(root=tmp_path / "rw", layers=(tmp_path / "image",))
    report = diagnose([LLAMA_8B], ["sm_90a"], cache=cache)
    writable, layer = report.layers
    assert (writable.kind, writable.exists, writable.entries) == ("writable", False, 0)
    assert (layer.kind, layer.entries, len(layer.corrupt)) == ("read-only", 3, 1)
    assert layer.corrupt[0].startswith(f"{entries[0].path}: artifact kernel.sm_90a.cubin does not match its sha256")
    assert [k.served for k in report.models[0].kernels] == [False, True, True] and not report.ok
    assert entries[0].path.exists()  # the doctor never moves anything


def test_doctor_leaves_a_corrupt_entry_of_the_writable_root_in_place(tmp_path, monkeypatch):
    no_gpu(monkeypatch)
    cache = KernelCache(root=tmp_path / "c", layers=())
    entry = publish_fake(cache, model_modules(LLAMA_8B)[0], "sm_90a")
    flip_cubin(entry)
    report = diagnose([LLAMA_8B], ["sm_90a"], cache=cache)
    assert not report.ok and len(report.layers[0].corrupt) == 1
    assert entry.path.exists() and not (tmp_path / "c" / "v1" / "quarantine").exists()


def test_doctor_with_every_model_served_still_fails_on_a_corrupt_entry(tmp_path, monkeypatch):
    no_gpu(monkeypatch)
    cache = KernelCache(root=tmp_path / "c", layers=())
    for module in model_modules(LLAMA_8B):
        publish_fake(cache, module, "sm_90a")
    flip_cubin(publish_fake(cache, model_modules(LLAMA_8B)[0], "sm_80"))  # an arch this check does not ask for
    report = diagnose([LLAMA_8B], ["sm_90a"], cache=cache)
    assert report.models[0].ok and not report.ok and len(report.corrupt) == 1
    assert report.warmup_command is None  # nothing is missing: the corrupt entry is the whole finding


def test_cli_doctor_exit_codes_json_and_the_fill_command(tmp_path):
    root = tmp_path / "c"
    cache = KernelCache(root=root, layers=())
    for module in model_modules(LLAMA_70B, tensor_parallel_size=8):
        publish_fake(cache, module, "sm_90a")
    env = {"JITATTN_ARCHS": "sm_90a"}
    ok = jitattn("doctor", "--model", str(LLAMA_70B), "--tensor-parallel-size", "8", "--arch", "sm_90a",
                 cache=root, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok: this node can serve every model with JITATTN_DISABLE_JIT=1" in ok.stdout
    assert "h8x1_d128_bf16" in ok.stdout  # the per-rank spec: 8 query heads, 1 KV head
    gap = jitattn("doctor", "--model", str(LLAMA_70B), "--arch", "sm_90a", cache=root, env=env)  # no --tp: 64/8
    assert gap.returncode == 1
    assert f"jitattn warmup --model {LLAMA_70B} --arch sm_90a" in gap.stdout
    data = json.loads(jitattn("doctor", "--model", str(LLAMA_70B), "--tp", "8", "--arch", "sm_90a", "--json",
                              cache=root, env=env).stdout)
    assert data["ok"] is True and data["models"][0]["tensor_parallel_size"] == 8
    assert data["nvcc"]["path"] and data["layers"][0]["entries"] == 3
    assert data["torch"]["version"]  # installed in the test venv


def test_cli_doctor_without_a_model_fails_on_a_corrupt_entry_and_names_it(tmp_path):
    """No --model: the cache itself is the health check, so a corrupt entry fails it (exit 1, as a gap does)."""
    root = tmp_path / "c"
    cache = KernelCache(root=root, layers=())
    good, _, bad = (publish_fake(cache, m, "sm_90a") for m in model_modules(LLAMA_8B))
    assert jitattn("doctor", cache=root).returncode == 0  # every entry verifies
    flip_cubin(bad)
    proc = jitattn("doctor", cache=root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"corrupt, not loaded: {bad.path}: artifact kernel.sm_90a.cubin does not match its sha256" in proc.stdout
    assert "NOT OK: 1 cache entry is corrupt" in proc.stdout and str(good.path) not in proc.stdout
    data = json.loads(jitattn("doctor", "--json", cache=root).stdout)
    assert data["ok"] is False and data["layers"][0]["corrupt"][0].startswith(f"{bad.path}: ")
    assert bad.path.exists()  # reported, never moved


def _drop(*keys):
    def edit(m):
        for k in keys:
            holder, name = (m["key_inputs"], k.split(".")[1]) if k.startswith("key_inputs.") else (m, k)
            del holder[name]
        return m
    return edit


@pytest.mark.parametrize("edit, problem", [
    (_drop("artifacts"), "manifest.json lacks key 'artifacts'"),
    (_drop("key", "key_inputs.arch"), "manifest.json lacks keys 'key', 'key_inputs.arch'"),
    (lambda m: [m], "manifest.json is not a JSON object (a list)"),
], ids=["no-artifacts", "no-key-no-arch", "a-list"])
def test_cli_a_manifest_missing_keys_is_named_with_the_fix_and_no_traceback(tmp_path, edit, problem):
    """doctor, cache ls and cache export on an entry whose manifest lacks what readers take from it:
    the entry's path, manifest.json, the missing keys and what to run; never a KeyError."""
    root = tmp_path / "c"
    entry = publish_fake(KernelCache(root=root, layers=()), SMALL, "sm_90a")
    manifest = entry.path / "manifest.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    fix = "`jitattn cache verify` moves those of the writable root to quarantine, and the next request (or " \
          "`jitattn warmup`) rebuilds them"
    doctor = jitattn("doctor", cache=root)
    assert doctor.returncode == 1 and "Traceback" not in doctor.stderr, doctor.stderr
    assert f"corrupt, not loaded: {entry.path}: {problem} (written by another jitattn version, or altered)" \
        in doctor.stdout, doctor.stdout
    assert fix in doctor.stdout and "KeyError" not in doctor.stdout
    ls = jitattn("cache", "ls", cache=root)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, ls.stderr
    assert f"({entry.path}): {problem}" in ls.stdout and fix in ls.stdout
    [row] = json.loads(jitattn("cache", "ls", "--json", cache=root).stdout)
    assert row["status"].startswith(problem)
    export = jitattn("cache", "export", "-o", str(tmp_path / "out.tar"), "--spec", SMALL.canonical_json(),
                     "--arch", "sm_90a", cache=root)
    assert export.returncode != 0 and "Traceback" not in export.stderr, export.stderr
    assert f"{SMALL.name} sm_90a" in export.stderr and "jitattn warmup --spec" in export.stderr
    assert not (tmp_path / "out.tar").exists()


def test_cli_doctor_without_torch_says_so(tmp_path):
    from tests.test_cli import _without

    proc = jitattn("doctor", "--json", cache=tmp_path / "c", env=_without(tmp_path, "torch"))
    assert proc.returncode == 0, proc.stderr  # no model asked for: nothing is missing
    data = json.loads(proc.stdout)
    assert data["torch"]["version"] is None
    text = jitattn("doctor", cache=tmp_path / "c", env=_without(tmp_path, "torch")).stdout
    assert "torch not installed" in text


def test_cli_doctor_without_torch_says_a_latent_kind_needs_it(tmp_path):
    """A latent decode kind the MLA kernel does not take (DeepSeek-V3 with kv_lora_rank 480: head dims 544 / 480,
    not multiples of 64) has no kernel to ship: the torch backends serve it, so a node without torch is told
    that serving it needs torch."""
    from tests.test_cli import _without

    deepseek = json.loads((Path(__file__).resolve().parent / "models" / "deepseek-v3.json").read_text())
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**deepseek, "kv_lora_rank": 480}))
    proc = jitattn("doctor", "--model", str(config), "--arch", "sm_90a", "--json", cache=tmp_path / "c",
                   env=_without(tmp_path, "torch"))
    [model] = json.loads(proc.stdout)["models"]
    [latent] = [k for k in model["kernels"] if "latent" in k["name"]]
    assert latent["note"].endswith("served by the sdpa backend on sm_90a, which needs torch: not installed here "
                                   "(pip install 'jitattn[torch]' where it serves)"), latent["note"]
    text = jitattn("doctor", "--model", str(config), "--arch", "sm_90a", cache=tmp_path / "c",
                   env=_without(tmp_path, "torch")).stdout
    assert "which needs torch: not installed here" in text
    with_torch = json.loads(jitattn("doctor", "--model", str(config), "--arch", "sm_90a", "--json",
                                    cache=tmp_path / "c").stdout)
    assert all("needs torch" not in k["note"] for k in with_torch["models"][0]["kernels"])


def test_cli_doctor_with_nvcc_missing(tmp_path):
    proc = jitattn("doctor", "--json", cache=tmp_path / "c", env={"JITATTN_NVCC": "/nonexistent/nvcc"})
    data = json.loads(proc.stdout)
    assert data["nvcc"]["version"] is None and "cannot run nvcc at '/nonexistent/nvcc'" in data["nvcc"]["error"]


# ---- select and misses on a node that may not compile -----------------------------------------------
def test_select_under_disable_jit_passes_jit_over_when_the_kernel_is_missing(tmp_path):
    env = {"JITATTN_DISABLE_JIT": "1"}
    proc = jitattn("select", "--model", str(LLAMA_8B), "--device", "h100", "--json", cache=tmp_path / "c", env=env)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)["layer_kinds"]
    assert row["backend"] != "jit"
    (reason,) = [r for r in row["passed_over"] if r.startswith("jit:")]
    assert reason.startswith("jit: missing kernel: h32x8_d128_bf16") and "sm_90a or sm_90" in reason
    assert "JITATTN_DISABLE_JIT=1 forbids compiling it; fill it with: jitattn warmup --spec '" in reason
    cache = KernelCache(root=tmp_path / "c", layers=())
    publish_fake(cache, load_model_config(LLAMA_8B).specs()[0], "sm_90a")
    again = jitattn("select", "--model", str(LLAMA_8B), "--device", "h100", "--json", cache=tmp_path / "c", env=env)
    assert json.loads(again.stdout)["layer_kinds"][0]["backend"] == "jit"


@pytest.mark.parametrize("how", ["flipped cubin", "broken manifest"])
def test_disable_jit_miss_reports_a_corrupt_entry_as_corrupt(tmp_path, monkeypatch, how):
    """The runtime looks with find() first (which moves a corrupt entry to quarantine) and only then
    asks get_or_build(): the error must still say the kernel was there, corrupt."""
    spec = load_model_config(LLAMA_8B).specs()[0]
    cache = KernelCache(root=tmp_path / "c", layers=())
    entry = publish_fake(cache, spec, "sm_90a")
    if how == "flipped cubin":
        flip_cubin(entry)
    else:
        (entry.path / "manifest.json").write_text('{"key": ')
    monkeypatch.setenv("JITATTN_DISABLE_JIT", "1")
    assert cache.find(spec, "sm_90a") is None
    with pytest.raises(MissingKernelError) as info:
        cache.get_or_build(spec, "sm_90a")
    message = str(info.value)
    assert "is cached only as corrupt entries" in message and "not cached" not in message, message
    assert "corrupt, not loaded:" in message and str(tmp_path / "c" / "v1" / "quarantine") in message
    assert info.value.corrupt and info.value.module == spec and info.value.arch == "sm_90a"
    assert f"jitattn warmup --spec '{spec.canonical_json()}' --arch sm_90a" in message
    with pytest.raises(MissingKernelError) as again:  # a second process: only quarantine remembers it
        KernelCache(root=tmp_path / "c", layers=()).get_or_build(spec, "sm_90a")
    assert str(again.value).count("corrupt, not loaded:") == 1 and "(quarantined)" in str(again.value)


def test_missing_kernel_and_trace_errors_are_importable_from_the_package():
    import jitattn
    from jitattn import MissingKernelError as Missing
    from jitattn import TraceError
    from jitattn.trace import TraceError as Original

    assert Missing is MissingKernelError and TraceError is Original
    assert {"MissingKernelError", "TraceError"} <= set(jitattn.__all__)


# ---- the TP-8 warm-up, compiled ------------------------------------------------------------------
@pytest.mark.slow
def test_tp8_llama_70b_warmup_is_found_under_disable_jit(tmp_path):
    """warmup --tensor-parallel-size 8 builds the per-rank kernels (8/1 heads); a node with
    JITATTN_DISABLE_JIT=1 and no nvcc then finds every one (doctor: exit 0; cache export: all there)."""
    root = tmp_path / "c"
    built = jitattn("warmup", "--model", str(LLAMA_70B), "--tensor-parallel-size", "8", "--arch", "sm_90a",
                    cache=root)
    assert built.returncode == 0, built.stderr
    assert "h8x1_d128_bf16" in built.stdout
    serving = {"JITATTN_DISABLE_JIT": "1", "JITATTN_NVCC": "/nonexistent/nvcc"}
    doctor = jitattn("doctor", "--model", str(LLAMA_70B), "--tp", "8", "--arch", "sm_90a", cache=root, env=serving)
    assert doctor.returncode == 0, doctor.stdout
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**serving, "JITATTN_CACHE_DIR": str(root)}.items():
            mp.setenv(k, v)
        for module in model_modules(LLAMA_70B, tensor_parallel_size=8):
            entry, compiled = KernelCache().get_or_build(module, "sm_90a")
            assert not compiled and entry.cubin.read_bytes()[:4] == b"\x7fELF"
    archive = tmp_path / "tp8.tar.gz"
    export = jitattn("cache", "export", "-o", str(archive), "--model", str(LLAMA_70B), "--tp", "8", "--arch", "sm_90a",
                     cache=root, env=serving)
    assert export.returncode == 0, export.stderr
    assert os.path.getsize(archive) > 0


@pytest.mark.gpu
def test_doctor_finds_the_gpus_torch_sees():
    """The driver query (ctypes on libcuda, no torch) agrees with torch on count, name and capability."""
    import torch

    from jitattn.doctor import find_driver

    driver = find_driver()
    assert driver.version and not driver.error
    assert len(driver.gpus) == torch.cuda.device_count()
    for gpu in driver.gpus:
        assert gpu.name == torch.cuda.get_device_name(gpu.index)
        assert gpu.capability == tuple(torch.cuda.get_device_capability(gpu.index))

"""Render and build: constants and functors in the rendered source, #line mapping, the Params layout,
real nvcc compiles for sm_80 and sm_90a, readable compile errors, arch names."""

from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path

import pytest

from jitattn import AttentionSpec, Param, Variant
from jitattn.build import (ARCHS, BuildError, CompileError, archs_for_capability, build, cubin_name, ninja_file,
                           normalize_arch, write_if_different)
from jitattn.cache import KernelCache
from jitattn.render import (BASE_FIELDS, FUNCTOR_NAMES, KERNEL_NAMES, RENDERED_FILE, functor_at, params_fields, params_layout,
                            render, template_dir, template_hashes)

REL_BIAS = Variant(
    name="rel_bias",
    logits_transform="logits + bias[qo_head] * fminf((float)(qo_idx - kv_idx), max_dist)",
    logits_mask="(kv_idx % stride) != 7",
    params=(Param("bias", "float32", ("num_qo_heads",)), Param("max_dist", "float32"), Param("stride", "int32"),
            Param("table", "bfloat16", ("*",))),
)
FEATURES = AttentionSpec(24, 8, 96, q_dtype="float16", kv_layout="HND", page_size=7, causal=False, window_left=31,
                         window_right=17, logits_soft_cap=30.0, sm_scale=0.125, alibi=True, sinks=True,
                         variant=REL_BIAS)


def constants(text: str) -> dict[str, str]:
    return dict(re.findall(r"static constexpr \w+ (k\w+) = ([^;]+);", text))


# ---- rendering ---------------------------------------------------------------------------------
def test_constants_are_injected():
    text = render(FEATURES).text
    c = constants(text)
    assert c["kNumQoHeads"] == "24" and c["kNumKvHeads"] == "8" and c["kGroupSize"] == "3"
    assert c["kHeadDimQK"] == c["kHeadDimVO"] == "96" and c["kPageSize"] == "7"
    assert c["kLayoutHND"] == "true" and c["kCausal"] == "false"
    assert (c["kWindowLeft"], c["kWindowRight"]) == ("31", "17")
    assert float(c["kSmScale"].rstrip("f")) == 0.125
    for flag in ("kHasSinks", "kHasTransform", "kHasMask", "kSoftmax"):
        assert c[flag] == "true", flag
    for flag in ("kHasQTransform", "kHasKTransform", "kHasOutTransform"):
        assert c[flag] == "false", flag
    assert "using DTypeQ = __half;" in text
    # soft-cap and ALiBi are built-in functors, traced from jitattn/variant.py, applied before the user's
    assert text.index("// >>> functor soft_cap") < text.index("// >>> functor alibi") < text.index(
        "// >>> functor logits_transform")
    assert "3.000000000e+01f * jitattn::fast_tanh((logits * 3.333333333e-02f))" in text
    assert "params.alibi_slopes[qo_head]" in text
    assert "((qo_idx - kv_idx) <= 31) && ((kv_idx - qo_idx) <= 17)" in text  # the window bounds functor


def test_plain_spec_has_only_the_causal_bound_and_bf16_types():
    text = render(AttentionSpec(32, 8, 128)).text
    c = constants(text)
    assert c["kCausal"] == "true" and c["kWindowLeft"] == "-1"
    assert c["kHasTransform"] == c["kHasMask"] == c["kHasSinks"] == "false"
    assert float(c["kSmScale"].rstrip("f")) == pytest.approx(128 ** -0.5, rel=1e-8)
    assert "using DTypeKV = __nv_bfloat16;" in text
    assert re.findall(r"// >>> functor (\w+)", text) == ["structural_mask"]
    assert "return static_cast<bool>((kv_idx <= qo_idx));" in text
    assert ">>> functor" not in render(AttentionSpec(32, 8, 128, causal=False)).text


def test_scale_is_rendered_to_float_precision():
    text = render(AttentionSpec(16, 8, 128, sm_scale=144 ** -0.5)).text
    assert float(constants(text)["kSmScale"].rstrip("f")) == pytest.approx(144 ** -0.5, rel=1e-9)


def test_functors_are_injected_with_params_in_scope():
    text = render(FEATURES).text
    assert f"logits = static_cast<float>({REL_BIAS.logits_transform});" in text
    assert f"return static_cast<bool>({REL_BIAS.logits_mask});" in text
    for p in REL_BIAS.params:
        assert f"const auto {p.name} = params.{p.name};" in text


def test_line_directives_point_back_to_the_functor_and_the_rendered_file():
    text = render(FEATURES).text
    lines = text.split("\n")
    restores = 0
    for i, line in enumerate(lines, start=1):
        m = re.match(r'#line (\d+) "(.*)"$', line)
        if not m:
            continue
        if m.group(2) == RENDERED_FILE:  # the next line is reported as its true line number
            assert int(m.group(1)) == i + 1
            restores += 1
        else:  # the functor's own expression is "line 1" of its name
            assert m.group(2) in FUNCTOR_NAMES and m.group(1) == "1"
            if m.group(2) in ("logits_transform", "logits_mask"):
                assert getattr(REL_BIAS, m.group(2)) in lines[i]  # the expression itself follows
            assert functor_at(text, i + 1) == m.group(2)
    assert restores == 5  # soft_cap, alibi, logits_transform, logits_mask, structural_mask
    assert "__RESTORE_LINE__" not in text and "__RENDERED_FILE__" not in text
    assert functor_at(text, 1) is None


def test_rendering_is_deterministic_and_spec_dependent():
    assert render(FEATURES).text == render(FEATURES).text
    assert render(FEATURES).sha256 != render(FEATURES.replace(page_size=8)).sha256
    assert render(FEATURES).names == KERNEL_NAMES


# ---- the Params struct -------------------------------------------------------------------------
_CTYPE = {"ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


@pytest.mark.parametrize("spec", [AttentionSpec(32, 8, 128), FEATURES], ids=["plain", "variant"])
def test_params_layout_matches_c_rules(spec):
    fields = params_fields(spec)
    placed, size = params_layout(fields)

    class CStruct(ctypes.Structure):  # the platform C ABI: natural alignment, same as nvcc's
        _fields_ = [(f.name, _CTYPE[f.kind]) for f in fields]

    assert size == ctypes.sizeof(CStruct)
    for f, offset in placed:
        assert offset == getattr(CStruct, f.name).offset, f.name
    sizes = [f.size for f in fields]
    assert sizes == sorted(sizes, reverse=True)  # 8-byte members first: no padding holes
    assert [f.name for f in fields if f.size == 8][:3] == ["q", "kv_cache", "o"]  # declared order within a size


@pytest.mark.parametrize("spec", [AttentionSpec(32, 8, 128), FEATURES], ids=["plain", "variant"])
def test_rendered_struct_is_the_field_list(spec):
    source = render(spec)
    body = re.search(r"struct Params \{\n(.*?)\n\};", source.text, re.S).group(1)
    members = re.findall(r"^\s*(.+?) (\w+);", body, re.M)
    assert [(t, n) for t, n in members] == [(f.cuda_type, f.name) for f in source.fields]
    assert f"static_assert(sizeof(Params) == {source.params_size}," in source.text
    assert source.params_size == params_layout(source.fields)[1]


def test_variant_params_extend_the_base_fields():
    names = {f.name for f in params_fields(FEATURES)}
    tensors = {f"{p.name}__numel" for p in REL_BIAS.params if not p.is_scalar}  # bounds of checked reads
    assert names == {f.name for f in BASE_FIELDS} | {p.name for p in REL_BIAS.params} | tensors
    kinds = {f.name: (f.kind, f.cuda_type) for f in params_fields(FEATURES)}
    assert kinds["bias"] == ("ptr", "const float* __restrict__")
    assert kinds["max_dist"] == ("f32", "float") and kinds["stride"] == ("i32", "int")
    assert kinds["table"] == ("ptr", "const __nv_bfloat16* __restrict__")
    assert kinds["q"][1] == "const __half*"


# ---- templates ---------------------------------------------------------------------------------
def test_templates_are_found_and_hashed():
    directory = template_dir()
    assert (directory / "attention.cu.j2").is_file()
    hashes = template_hashes()
    assert {"attention.cu.j2", "common.cuh", "decode.cuh", "prefill.cuh", "prefill_sm90.cuh"} <= set(hashes)
    assert all(len(h) == 64 for h in hashes.values())


# ---- arch names --------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,name", [("sm_80", "sm_80"), ("80", "sm_80"), ("sm80", "sm_80"), ("8.0", "sm_80"),
                                      ("90a", "sm_90a"), ("SM_90A", "sm_90a"), ("9.0a", "sm_90a"),
                                      ("compute_86", "sm_86"), (" sm_89 ", "sm_89"), ("100a", "sm_100a"),
                                      ("12.0", "sm_120")])
def test_normalize_arch(raw, name):
    assert normalize_arch(raw) == name


@pytest.mark.parametrize("raw", ["sm_90b", "hopper", "", "sm_", "sm_81"])
def test_normalize_arch_rejects_unknown(raw):
    with pytest.raises(ValueError, match=rf"--arch={raw!r}: unknown target arch; expected one of"):
        normalize_arch(raw, field="--arch")


@pytest.mark.parametrize("raw,name", [("sm_75", "sm_75"), ("7.0", "sm_70"), ("sm_61", "sm_61")])
def test_an_arch_below_sm_80_says_so(raw, name):
    with pytest.raises(ValueError, match=rf"--arch={raw!r}: {name} is below sm_80, which jitattn needs; expected"):
        normalize_arch(raw, field="--arch")


@pytest.mark.parametrize("cap,archs", [((9, 0), ["sm_90a", "sm_90"]), ((8, 0), ["sm_80"]),
                                       ((8, 6), ["sm_86", "sm_80"]), ((8, 9), ["sm_89", "sm_86", "sm_80"]),
                                       ((10, 0), ["sm_100a"]), ((12, 0), ["sm_120"]), ((7, 5), [])])
def test_archs_for_capability(cap, archs):
    assert archs_for_capability(*cap) == archs


def test_every_arch_has_a_gencode():
    for name, gencode in ARCHS.items():
        assert gencode == f"arch=compute_{name[3:]},code={name}"


# ---- build -------------------------------------------------------------------------------------
def test_ninja_file_has_one_edge_per_arch():
    text = ninja_file(["sm_80", "sm_90a"], "/opt/cuda/bin/nvcc")
    assert "nvcc = /opt/cuda/bin/nvcc" in text
    assert f"build {cubin_name('sm_80')}: cubin {RENDERED_FILE}" in text
    assert "gencode = arch=compute_90a,code=sm_90a" in text
    assert f"-I{template_dir()}" in text


def test_write_if_different_keeps_mtime(tmp_path):
    path = tmp_path / "f.txt"
    assert write_if_different(path, "a")
    mtime = path.stat().st_mtime_ns
    assert not write_if_different(path, "a")
    assert path.stat().st_mtime_ns == mtime
    assert write_if_different(path, "b") and path.read_text() == "b"


def elf_sm(cubin: Path) -> int:
    """The SM version a cubin is built for (ELF e_flags bits 8-15, as cuobjdump reports it)."""
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF", f"{cubin} is not an ELF cubin"
    return (struct.unpack_from("<I", data, 48)[0] >> 8) & 0xFF


@pytest.mark.slow
@pytest.mark.parametrize("arch,sm", [("sm_80", 80), ("sm_90a", 90)])
def test_real_nvcc_build_for_each_arch(tmp_path, arch, sm):
    result = build(render(FEATURES), arch, tmp_path)
    assert result.cubin == tmp_path / cubin_name(arch) and result.cubin.stat().st_size > 10_000
    assert elf_sm(result.cubin) == sm
    data = result.cubin.read_bytes()
    for name in KERNEL_NAMES.values():  # every entry point and the geometry table are in the binary
        assert name.encode() in data, name
    assert f"Compiling entry function '{KERNEL_NAMES['decode']}' for '{arch}'" in result.log  # ptxas -v
    assert result.seconds > 0


def _typo_variant(where: str) -> AttentionSpec:
    if where == "logits_transform":
        v = Variant("typo", logits_transform="logits + biass[qo_head]", params=(Param("bias", "float32", ("*",)),))
    else:
        v = Variant("typo", logits_mask="kv_idx <= qo_idx && undefined_fn(kv_idx)")
    return AttentionSpec(8, 2, 64, variant=v)


@pytest.mark.slow
@pytest.mark.parametrize("where,ident", [("logits_transform", "biass"), ("logits_mask", "undefined_fn")])
def test_functor_typo_raises_compile_error_naming_the_functor(tmp_path, where, ident):
    cache = KernelCache(root=tmp_path, layers=())
    with pytest.raises(CompileError) as info:
        cache.get_or_build(_typo_variant(where), "sm_80")
    err = info.value
    assert err.functor == where and err.line == 1 and err.arch == "sm_80"
    message = str(err)
    assert f'identifier "{ident}" is undefined' in message  # nvcc's own words
    assert f"(functor {where}, line 1 of the expression)" in message
    assert str(err.source_path) in message
    # The rendered file outlives the failed build, so the user can open it.
    assert err.source_path.is_file() and err.source_path.name == RENDERED_FILE
    assert ident in err.source_path.read_text()
    assert "failed" in err.source_path.parts
    assert "error" in err.nvcc_output
    assert not list(tmp_path.glob("v1/entries/*/*"))  # nothing published


@pytest.mark.slow
def test_type_error_in_functor_is_reported_at_the_functor(tmp_path):
    v = Variant("bad_type", logits_transform="logits + params")  # `params` is the struct, not a number
    with pytest.raises(CompileError) as info:
        build(render(AttentionSpec(8, 2, 64, variant=v)), "sm_80", tmp_path)
    assert info.value.functor == "logits_transform"
    assert (tmp_path / RENDERED_FILE).is_file()


def test_missing_nvcc_is_a_build_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JITATTN_NVCC", str(tmp_path / "no-nvcc"))
    with pytest.raises(BuildError, match=r"cannot run nvcc at '.*no-nvcc'.*set JITATTN_NVCC / CUDA_HOME"):
        build(render(AttentionSpec(8, 2, 64)), "sm_80", tmp_path / "b")


def test_wgmma_rows_are_generated():
    """templates/wgmma_sm90_rows.cuh is templates/gen_wgmma_sm90.py's output (regenerate it, do not edit it),
    with one row per N = 16, 32, ..., 256, and wgmma_sm90.cuh includes it."""
    import importlib.util

    path = template_dir() / "gen_wgmma_sm90.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (template_dir() / "wgmma_sm90_rows.cuh").read_text() == gen.rows_text()
    rows = [line for line in gen.rows_text().splitlines() if line.startswith("JITATTN_WGMMA_BF16_F16(")]
    assert [int(line.split("(", 1)[1].split(",", 1)[0]) for line in rows] == list(range(16, 257, 16))
    assert rows[4].startswith("JITATTN_WGMMA_BF16_F16(80, ") and rows[4].endswith("JITATTN_WGMMA_D8(32))")  # 40 accumulators
    assert '"%128, %129", "%130", "{%128, %129, %130, %131}, %132", "%133"' in rows[-1]  # N = 256: 128 accumulators
    assert '#include "wgmma_sm90_rows.cuh"' in (template_dir() / "wgmma_sm90.cuh").read_text()

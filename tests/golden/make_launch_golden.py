"""Record the kernel launches of the one-call path before plan/run (commit a351357) as launches.json.

Run it once with the old tree's jitattn on the path (it reads this checkout's tests/launch_cases.py):

    git worktree add /tmp/jitattn-a351357 a351357
    PYTHONPATH=/tmp/jitattn-a351357 python tests/golden/make_launch_golden.py

It builds the old ``JitKernel`` on the CPU without a cubin (the attributes its ``__init__`` would set,
from the fixed geometry of tests/launch_cases.py), lets ``check_paged_call`` / ``check_ragged_call``
skip only their CUDA-device requirement, replaces the module's ``launch`` by a recorder, and runs every
case of tests/launch_cases.py through ``paged_attention`` / ``ragged_attention`` as a caller would.
Pointer fields are written as the name of the tensor they point to (``out``, ``lse``, an argument's
name, ``default_slopes``, ``split_counters``; ``scratch`` for a buffer the call allocated itself).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from jitattn import runtime
from jitattn.reference import default_alibi_slopes
from jitattn.render import params_fields

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/launch_cases.py of this checkout
import launch_cases as lc  # noqa: E402


def _old_kernel(spec):
    kernel = object.__new__(runtime.JitKernel)
    kernel.spec, kernel.device = spec, torch.device("cpu")
    kernel._packer, kernel._field_order = runtime.params_packer(spec)
    kernel.geometry = {**lc.GEOMETRY, "params_size": kernel._packer.size}
    kernel._num_sms, kernel._decode_blocks_per_sm = lc.NUM_SMS, lc.DECODE_BLOCKS_PER_SM
    kernel._default_slopes = default_alibi_slopes(spec, "cpu") if spec.alibi else None
    kernel._split_counters, kernel._retired_counters, kernel._unzeroed_counters = {}, [], set()
    kernel.mixed_on_two_streams, kernel._side_streams = False, {}
    launches = []

    def launch(name, grid, block, smem, args, stream):
        launches.append({"kernel": name, "grid": list(grid), "block": block, "smem": smem, "stream": stream,
                         "fields": dict(zip(kernel._field_order, kernel._packer.unpack(args)))})

    kernel._module = SimpleNamespace(launch=launch)
    return kernel, launches


def main() -> None:
    if "a351357" not in runtime.__file__ and "--any-tree" not in sys.argv:
        sys.exit(f"{runtime.__file__}: run this with the a351357 tree first on PYTHONPATH (or pass --any-tree)")
    real_paged, real_ragged = runtime.check_paged_call, runtime.check_ragged_call
    runtime.check_paged_call = lambda *a, **kw: real_paged(*a, **{**kw, "for_kernel": False})
    runtime.check_ragged_call = lambda *a, **kw: real_ragged(*a, **{**kw, "for_kernel": False})
    torch.cuda.current_stream = lambda device=None: SimpleNamespace(cuda_stream=lc.STREAM)
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    record = {}
    for name, case in lc.cases().items():
        kernel, launches = _old_kernel(case.spec)
        fn = kernel.paged_attention if case.kind == "paged" else kernel.ragged_attention
        result = case.call(fn)
        extra = {"default_slopes": kernel._default_slopes,
                 **{"split_counters": t for t in kernel._split_counters.values()}}
        names = lc.pointer_names(case, result, extra)
        ptrs = {f.name for f in params_fields(case.spec) if f.kind == "ptr"}
        for launch in launches:
            launch["fields"] = lc.symbolic(launch["fields"], ptrs, names)
        record[name] = launches
    path = Path(__file__).with_name("launches.json")
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"{path}: {sum(map(len, record.values()))} launches of {len(record)} cases")


if __name__ == "__main__":
    main()

"""The torch dtypes of the spec's dtype names, and the spec's default ALiBi slopes.

A bottom module (it imports only torch and the spec layer), shared by the runtime, the reference,
the checks and the backends.
"""

from __future__ import annotations

import torch

from jitattn.spec import AttentionSpec
from jitattn.variant import alibi_slopes

#: Spec dtype name -> torch dtype: the q / KV / output dtypes, and the int / float metadata and parameters.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "int32": torch.int32, "int64": torch.int64,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a spec dtype name (``"bfloat16"`` -> ``torch.bfloat16``).

    Raises:
        KeyError: a name no spec field takes.
    """
    return TORCH_DTYPES[name]


def default_alibi_slopes(spec: AttentionSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard ALiBi slopes (Press et al. 2022) for ``spec.num_qo_heads`` heads: float32 ``(num_qo_heads,)``."""
    return torch.tensor(alibi_slopes(spec.num_qo_heads), dtype=torch.float32, device=device)

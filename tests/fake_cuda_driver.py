"""A fake CUDA driver library, built here with the C compiler: the entry points jitattn.cuda_driver binds,
with cuda.h's signatures, recording what they were given (``rec``: the integer arguments; ``params``: the
launch's struct bytes). tests/test_cuda_driver.py checks the binding against it; tools/host_cost_cpu.py
times the binding's per-layer calls on it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
typedef int CUresult;
typedef void *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
/* Recorded calls: rec[0..] = the integer arguments of the last call; params = the launch's struct bytes. */
long long rec[16];
unsigned char params[32];
CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  if (memcmp(image, "BAD", 3) == 0) return 200;              /* CUDA_ERROR_INVALID_IMAGE */
  *module = (CUmodule)(uintptr_t)(0x10000 + strlen((const char *)image));
  return 0;
}
CUresult cuModuleUnload(CUmodule m) { rec[0] = (long long)(uintptr_t)m; return 0; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  if (strcmp(name, "missing") == 0) return 500;                /* CUDA_ERROR_NOT_FOUND */
  *f = (CUfunction)((uintptr_t)m + 0x100 + strlen(name));
  return 0;
}
CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name) {
  *dptr = 0x7f0000000000ULL + (uintptr_t)m;                   /* above 2^32: a truncated pointer shows */
  *bytes = ((size_t)1 << 33) + strlen(name);                  /* above 2^32: a 32-bit size_t shows */
  return 0;
}
CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value) {
  rec[0] = (long long)(uintptr_t)f; rec[1] = attrib; rec[2] = value; return 0;
}
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, CUfunction f, int block, size_t smem) {
  rec[0] = (long long)(uintptr_t)f; rec[1] = block; rec[2] = (long long)smem;
  *n = 2048 / block;
  return 0;
}
typedef struct {                                               /* CUlaunchConfig, as cuda.h lays it out */
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  void *attrs;
  unsigned numAttrs;
} CUlaunchConfig;
/* rec[9]: 1 when no launch attributes and no `extra` were passed */
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **kernel_params, void **extra) {
  rec[0] = (long long)(uintptr_t)f; rec[1] = c->gridDimX; rec[2] = c->gridDimY; rec[3] = c->gridDimZ;
  rec[4] = c->blockDimX; rec[5] = c->blockDimY; rec[6] = c->blockDimZ; rec[7] = c->sharedMemBytes;
  rec[8] = (long long)(uintptr_t)c->hStream; rec[9] = extra == NULL && c->attrs == NULL && c->numAttrs == 0;
  memcpy(params, kernel_params[0], sizeof(params));
  return c->gridDimX == 0 ? 1 : 0;                              /* CUDA_ERROR_INVALID_VALUE */
}
typedef void *CUevent;
CUresult cuEventCreate(CUevent *e, unsigned flags) {
  rec[0] = flags; *e = (CUevent)(uintptr_t)0x5E0000000001ULL; return 0;
}
CUresult cuEventDestroy_v2(CUevent e) { rec[0] = (long long)(uintptr_t)e; return 0; }
/* rec[10..12]: the event and stream recorded, then rec[13..15]: the waiting stream, the event, the flags */
CUresult cuEventRecord(CUevent e, CUstream s) {
  rec[10] = (long long)(uintptr_t)e; rec[11] = (long long)(uintptr_t)s; rec[12] = 1;
  return s == (CUstream)(uintptr_t)0xBAD ? 201 : 0;               /* CUDA_ERROR_INVALID_CONTEXT */
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
  rec[13] = (long long)(uintptr_t)s; rec[14] = (long long)(uintptr_t)e; rec[15] = flags; return 0;
}
CUresult cuGetErrorName(CUresult e, const char **s) {
  *s = e == 200 ? "CUDA_ERROR_INVALID_IMAGE" : e == 500 ? "CUDA_ERROR_NOT_FOUND"
     : e == 1 ? "CUDA_ERROR_INVALID_VALUE" : e == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : NULL;
  return *s ? 0 : 1;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
  *s = e == 200 ? "device kernel image is invalid" : e == 500 ? "named symbol not found"
     : e == 1 ? "invalid argument" : e == 201 ? "invalid device context" : NULL;
  return *s ? 0 : 1;
}
"""


def build(directory: Path) -> Path | None:
    """Compile :data:`SOURCE` into ``directory/libfakecuda.so``; None without a C compiler on Linux."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        return None
    (directory / "fake_cuda.c").write_text(SOURCE)
    lib = directory / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(directory / "fake_cuda.c")], check=True)
    return lib

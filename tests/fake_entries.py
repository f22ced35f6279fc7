"""Cache entries published without nvcc, for the tests of what finds them (doctor, select, misses).

The entry is complete and verifies (every artifact has its sha256 in the manifest), and its key
inputs are the real ones for the spec with a stand-in nvcc banner: a lookup under
``JITATTN_DISABLE_JIT=1`` (any nvcc) finds it; the cubin inside is not a real one.
"""

from __future__ import annotations

import json
from pathlib import Path

from jitattn import modules
from jitattn.cache import MANIFEST, CacheEntry, KernelCache, key_inputs, sha256_file, spec_key

FAKE_NVCC = "Cuda compilation tools, release 0.0 (a test's stand-in)"


def publish_fake(cache: KernelCache, module, arch: str) -> CacheEntry:
    """Publish ``(module, arch)`` into ``cache``'s writable root as a verified entry with a fake cubin."""
    source = modules.render(module)
    inputs = key_inputs(module, source, arch, nvcc=FAKE_NVCC)
    path = cache.entry_dir(inputs.key)
    path.mkdir(parents=True)
    (path / "kernel.cu").write_text(source.text)
    (path / f"kernel.{inputs.arch}.cubin").write_bytes(b"\x7fELF not a real cubin")
    manifest = {"key": inputs.key, "source_key": inputs.source_key, "spec_key": spec_key(module, arch),
                "key_inputs": inputs.to_json(), "name": module.name, "created": "2000-01-01T00:00:00+0000",
                "artifacts": {p.name: sha256_file(p) for p in sorted(path.iterdir())}, "build_seconds": 0.0}
    (path / MANIFEST).write_text(json.dumps(manifest))
    cache.add_markers(manifest)
    return CacheEntry(inputs.key, path, manifest)


def flip_cubin(entry: CacheEntry) -> Path:
    """Corrupt an entry's cubin (one byte changed): its sha256 no longer matches the manifest."""
    cubin = next(entry.path.glob("kernel.*.cubin"))
    data = bytearray(cubin.read_bytes())
    data[0] ^= 0xFF
    cubin.write_bytes(bytes(data))
    return cubin

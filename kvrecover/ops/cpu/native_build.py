"""Our C kernels (`ops/cpu/csrc/`), compiled at first use with the system C compiler.

`load_library("paged_attention")` compiles `csrc/paged_attention.c` with
`cc -O3 -march=native` into the kvrecover cache folder (`cache_dir.cache_root()
/ "kernels"`) and loads it with ctypes. The file name carries a digest of the
source and the headers beside it (`kvr_common.h`), the compiler and its
version, the flags and the CPU's feature flags, so a changed source, header,
compiler or machine builds anew; a file lock keeps two processes from compiling
at once, and the build lands under its final name by an atomic rename. When no
compiler is found or the build fails, it returns None after one warning and the
caller falls back to its torch implementation; it does the same, without
building, when the caller passes `allowed=False` (`EngineArgs.native_kernels`,
whose default `native_kernels_default` reads from `KVRECOVER_NATIVE_KERNELS`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from kvrecover.cache_dir import cache_root

SOURCE_DIR = Path(__file__).parent / "csrc"
# No fast-math and no FMA contraction in the portable path: every sum is in
# the order the source writes it (the AVX-512 path is explicit intrinsics).
# -fopenmp: the kernels use torch's OpenMP runtime (libgomp.so.1, loaded by torch first).
CFLAGS = ("-O3", "-march=native", "-std=gnu11", "-ffp-contract=off", "-fopenmp", "-shared",
          "-fPIC")
DISABLE_ENV = "KVRECOVER_NATIVE_KERNELS"  # "0": native_kernels defaults to False
BUILD_TIMEOUT_S = 120

_loaded: dict[str, ctypes.CDLL | None] = {}


def native_kernels_default() -> bool:
    """What `native_kernels=None` means: True unless `KVRECOVER_NATIVE_KERNELS=0` (the one
    place that reads the variable; `ops.backend.select_backend` asks it)."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


def load_library(name: str, allowed: bool = True,
                 source_dir: Path = SOURCE_DIR) -> ctypes.CDLL | None:
    """The compiled `csrc/<name>.c` (or `<source_dir>/<name>.c`: another package's C
    file; built on first use, then cached), or None after one warning when it cannot
    be built or is not `allowed` (nothing is built then)."""
    if not allowed:
        warnings.warn(f"native_kernels=False ({DISABLE_ENV}=0 by default): the C kernel "
                      f"{name!r} is off, using the slower torch fallback", RuntimeWarning,
                      stacklevel=3)
        return None
    if source_dir != SOURCE_DIR:
        key = str(source_dir / name)
        if key not in _loaded:
            _loaded[key] = _build_and_load(name, source_dir)
        return _loaded[key]
    if name not in _loaded:
        _loaded[name] = _build_and_load(name)
    return _loaded[name]


def _build_and_load(name: str, source_dir: Path = SOURCE_DIR) -> ctypes.CDLL | None:
    source = source_dir / f"{name}.c"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn(f"no C compiler (cc) found: the kernel {name!r} falls back to torch ops "
                      "(slower); install build-essential", RuntimeWarning, stacklevel=3)
        return None
    try:
        path = _build(source, compiler)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        warnings.warn(f"building the C kernel {name!r} failed ({error}); falling back to torch "
                      "ops (slower)", RuntimeWarning, stacklevel=3)
        return None


def _build(source: Path, compiler: str) -> Path:
    """Compile `source` unless a build for this source, compiler and CPU exists."""
    folder = cache_root() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{source.stem}-{_build_key(source, compiler)}.so"
    if target.exists():
        return target
    with open(folder / f"{source.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same file
        if target.exists():
            return target
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            result = subprocess.run([compiler, *CFLAGS, str(source), "-o", partial, "-lm"],
                                    capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise OSError(f"{compiler} exited with {result.returncode}: "
                              f"{result.stderr.strip()[-2000:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
    return target


def _build_key(source: Path, compiler: str) -> str:
    """A digest of everything the machine code depends on."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S).stdout
    digest = hashlib.sha256()
    headers = [header.read_bytes() for header in sorted(source.parent.glob("*.h"))]
    for part in (source.read_bytes(), *headers, compiler.encode(), version.encode(),
                 " ".join(CFLAGS).encode(), platform.machine().encode(), cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def cpu_flags() -> str:
    """The CPU's feature flags (`-march=native` compiles for exactly these)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()

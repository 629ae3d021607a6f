"""What runs where: the code a build of jax_ep._C carries (SASS and PTX per architecture), the
code a GPU of a given compute capability runs from it, and whether the CUDA driver runs the
CUDA runtime linked into it. Pure functions of strings and numbers.
"""

from __future__ import annotations

import re

from jax_ep.system import cuda_driver
from jax_ep.system.records import BuiltCode

# The driver a CUDA runtime of each major version needs (the runtime is linked into jax_ep._C).
_MIN_DRIVER_FOR_CUDA_MAJOR = {11: "450", 12: "525", 13: "580"}

def parse_cc(text: str | None) -> tuple[int, int] | None:
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def _arch_tokens(archs: str) -> list[str]:
    return [t for t in re.split(r"[;,\s]+", archs.strip()) if t]


def parse_architectures(archs: str) -> BuiltCode:
    """The SASS and PTX of `archs`: "sm_N" / "compute_N" entries (what jax_ep._C reports) or
    CMake's CUDA_ARCHITECTURES syntax ("N" = SASS and PTX, "N-real" = SASS, "N-virtual" = PTX)."""
    sass, ptx, unknown = [], [], []
    for token in _arch_tokens(archs):
        match = re.fullmatch(r"(sm_|compute_)?(\d+[af]?)(-real|-virtual)?", token)
        if not match or (match.group(1) and match.group(3)):
            unknown.append(token)
            continue
        prefix, arch, kind = match.groups()
        if prefix != "compute_" and kind != "-virtual":
            sass.append(arch)
        if prefix != "sm_" and kind != "-real":
            ptx.append(arch)
    dedupe = lambda items: tuple(dict.fromkeys(items))
    return BuiltCode(dedupe(sass), dedupe(ptx), dedupe(unknown))


def _arch_cc(arch: str) -> tuple[tuple[int, int], str]:
    """"90a" -> ((9, 0), "a")."""
    major, minor = divmod(int(arch.rstrip("af")), 10)
    return (major, minor), arch[-1] if arch[-1] in "af" else ""


def _sass_runs(arch: str, cc: tuple[int, int]) -> bool:
    """SASS of sm_N runs on its major version from minor N%10 on; "a" on N exactly."""
    target, suffix = _arch_cc(arch)
    return cc == target if suffix == "a" else cc[0] == target[0] and cc[1] >= target[1]


def _ptx_runs(arch: str, cc: tuple[int, int]) -> bool:
    """PTX of compute_N is JIT-compiled for every later GPU; "a" / "f" PTX for N / its family."""
    target, suffix = _arch_cc(arch)
    if suffix == "a":
        return cc == target
    if suffix == "f":
        return cc[0] == target[0] and cc[1] >= target[1]
    return cc >= target


def code_for(archs: str, cc: tuple[int, int]) -> str | None:
    """The code of `archs` that a GPU of compute capability `cc` runs: "sm_N" (SASS; the
    newest that runs) or, without SASS for it, "compute_N" (PTX the driver JIT-compiles; the
    newest that runs, as the driver picks); None when nothing runs on it."""
    code = parse_architectures(archs)
    newest = lambda items: max(items, key=lambda a: _arch_cc(a)[0], default=None)
    sass = newest([a for a in code.sass if _sass_runs(a, cc)])
    if sass is not None:
        return f"sm_{sass}"
    ptx = newest([a for a in code.ptx if _ptx_runs(a, cc)])
    return None if ptx is None else f"compute_{ptx}"


def arch_supports(archs: str, cc: tuple[int, int]) -> bool | None:
    """Whether code built for `archs` (see `parse_architectures`) runs on compute capability
    `cc`: "90" (SASS + PTX) runs on 9.x natively and on newer GPUs through PTX JIT; "90-real"
    on 9.x only; "90-virtual" on >= 9.0; "90a" on exactly 9.0; "100f" on 10.x. Returns None when
    nothing listed runs on it but some entry is unknown ("native", "all")."""
    if code_for(archs, cc) is not None:
        return True
    return None if parse_architectures(archs).unknown else False


def describe_architectures(archs: str) -> str:
    """ "sm_80 sm_90 compute_90" -> "sm_80, sm_90 + PTX compute_90"."""
    code = parse_architectures(archs)
    parts = [", ".join([f"sm_{a}" for a in code.sass] + list(code.unknown))]
    if code.ptx:
        parts.append("PTX " + ", ".join(f"compute_{a}" for a in code.ptx))
    text = " + ".join(p for p in parts if p)
    return text or "no architecture"


def cmake_architectures(archs: str) -> str:
    """The CMake list of the same code: "sm_80 sm_90 compute_90" -> "80-real;90"."""
    code = parse_architectures(archs)
    entries = [a if a in code.ptx else f"{a}-real" for a in code.sass]
    entries += [f"{a}-virtual" for a in code.ptx if a not in code.sass]
    return ";".join(entries + list(code.unknown))


def cuda_version_text(version: int) -> str:
    return cuda_driver.format_cuda_version(version)


def driver_problem(driver_cuda_version: int | None, runtime_version: int | None) -> str | None:
    """Why the driver cannot run a jax_ep._C built with CUDA runtime `runtime_version`
    (CUDART_VERSION, linked in), or None when it can or a version is unknown.

    The driver must support the runtime's major version (a CUDA 13 build needs a CUDA 13 driver,
    r580 or newer). An older minor version of the same major runs the module's SASS (CUDA's
    minor-version compatibility) but cannot JIT-compile its PTX; `decide_backend` reports that
    per GPU, for the GPUs that would run PTX.
    """
    if driver_cuda_version is None or runtime_version is None:
        return None
    if driver_cuda_version // 1000 >= runtime_version // 1000:
        return None
    major = runtime_version // 1000
    minimum = _MIN_DRIVER_FOR_CUDA_MAJOR.get(major)
    driver_text = f"CUDA {major}.0 or newer" + (f" (r{minimum}+)" if minimum else "")
    return (
        f"the CUDA driver supports CUDA {cuda_version_text(driver_cuda_version)}, but jax_ep._C "
        f"was built with CUDA {cuda_version_text(runtime_version)} (its CUDA runtime is linked "
        f"in), which needs a driver of {driver_text}: update the driver, or build jax_ep with "
        f"a CUDA {driver_cuda_version // 1000} toolkit (CUDACXX=<that toolkit>/bin/nvcc pip "
        f"install .)"
    )

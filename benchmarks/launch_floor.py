"""What one custom call costs a jitted program, by the kind of kernel it launches (one GPU).

    python benchmarks/launch_floor.py [--repeats 50] [--out DIR]

Builds ``launch_floor.cu`` (nvcc, against jax's FFI headers) into a temporary library and times
chains of 8, 12, 16 and 20 calls of each handler in one jitted program (XLA's default flags: one
CUDA graph; a chain of 4 would run thunk by thunk, below ``xla_gpu_graph_min_graph_size``), as
``bench_step.py`` times layers: per call, the slope of the programs' median wall times. The
handlers copy a small array with one kernel launched as: a tiny plain kernel (XLA's own floor
for a custom call), the low-latency kernels' shape (all SMs but 8, 512 threads) launched
plainly, the same launched cooperatively as ours are, and cooperatively with 1 KiB of
arguments. A chain of XLA's own elementwise ops is the reference. Writes
``<machine>-<date>-launch_floor.json``; the figures of one H200 are in docs/performance.md
(``benchmarks/results/1xH200-launch_floor.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import bench_records as br
import bench_timing as bt  # benchmarks/ is sys.path[0]
import jax
import jax.numpy as jnp
from bench_step import slope, slope_stderr

HANDLERS = {"tiny plain kernel": "LaunchFloorTiny", "wide, plain": "LaunchFloorWide",
            "wide, cooperative": "LaunchFloorCoop",
            "wide, cooperative, 1 KiB args": "LaunchFloorCoopArgs"}
CHAINS = (8, 12, 16, 20)


def build(workdir):
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    lib = os.path.join(workdir, "liblaunch_floor.so")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_floor.cu")
    subprocess.run([nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-arch=native",
                    "-I", jax.ffi.include_dir(), source, "-o", lib], check=True,
                   capture_output=True, text=True)
    return lib


def chain(target, calls):
    def program(x):
        for _ in range(calls):
            if target is None:
                x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)  # one XLA kernel each
            else:
                x = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        return x
    return jax.jit(program)


def median_wall_us(fn, x, repeats):
    for _ in range(3):
        bt.wall_us(fn, x)
    return statistics.median(bt.wall_us(fn, x) for _ in range(repeats))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=50,
                   help="timed calls of each program, whose median counts (default 50)")
    br.add_out_argument(p)
    br.add_note_argument(p)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        lib = ctypes.cdll.LoadLibrary(build(workdir))
    for target in HANDLERS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                    platform="CUDA")
    x = jnp.ones((4096,), jnp.float32)
    rows = []
    for label, target in [("XLA elementwise op", None), *HANDLERS.items()]:
        walls = [median_wall_us(chain(target, n), x, args.repeats) for n in CHAINS]
        rows.append({"call": label, "target": target, "per_call_us": slope(CHAINS, walls),
                     "per_call_us_stderr": slope_stderr(CHAINS, walls), "calls": list(CHAINS),
                     "wall_us": walls})
        print(f"{label:<32} {rows[-1]['per_call_us']:6.2f} +- "
              f"{rows[-1]['per_call_us_stderr']:4.2f} us per call", flush=True)
    path = os.path.join(args.out, f"{br.machine_name()}-{br.today()}-launch_floor.json")
    br.write_json(path, {**br.result_header(sys.argv[1:], args.note, __file__), "records": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

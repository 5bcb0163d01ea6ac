"""Registers and spills of ``fixed_budget_decode``'s kernel, compiled for a GPU without one.

``python -m benchmarks.tools.registers`` (no ``TRITON_INTERPRET``; about a minute) compiles the fused step through
the whole CUDA compiler (TTIR -> PTX -> ptxas) for the configurations the GPU runs (bf16 / fp16 / float32
caches, int8 / fp8 codes, uniform and packed layouts, sm_90 and sm_80) with the host's launch options, runs the
ptxas that ships with Triton with ``-v`` on the PTX, and prints one line per kernel: registers per thread and
spill bytes.  ``tests/kernels/test_decode_kernel.py::test_kernels_compile_for_gpu`` runs it (the type and layout
errors the interpreter does not see); docs/DESIGN.md section 9 quotes its figures.  A Triton without the
compiler API or ptxas prints why and exits 0.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import warnings

# (name, cache dtype, arch, G, head_dim, stage-1 warps as the host launches them, packed, 8-bit codes): the GPU
# benchmark's shapes (head_dim 128) and odd ones (G = 8 and 2, head_dim 64), every layout and slot dtype
CONFIGS = (
    ("bf16 uniform", "bf16", 90, 4, 128, 4, False, None),
    ("bf16 packed", "bf16", 90, 4, 128, 4, True, None),
    ("fp32 uniform", "fp32", 90, 1, 128, 8, False, None),
    ("int8 uniform", "bf16", 90, 4, 128, 4, False, "i8"),
    ("fp8 packed", "bf16", 90, 4, 128, 4, True, "fp8e4nv"),
    ("bf16 uniform", "bf16", 80, 4, 128, 4, False, None),
    ("fp16 uniform G8 D64", "fp16", 80, 8, 64, 4, False, None),
    ("fp32 packed G2 D64", "fp32", 80, 2, 64, 8, True, None),
    ("int8 packed G8 D64", "fp16", 80, 8, 64, 4, True, "i8"),
)


def _signature(fn, types: dict, consts: dict) -> dict:
    return {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}


def main() -> int:
    warnings.filterwarnings("ignore")  # (Triton's one-time notes on compile options)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: the interpreter does not compile")
        return 0
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import ASTSource
        from triton.compiler import compile as tcompile
    except Exception as exc:  # pragma: no cover - depends on the Triton release
        print(f"Triton's compiler API is not reachable here: {exc!r}")
        return 0
    import triton

    from kvpop_kernels import decode as dm

    rows = []
    for name, dt, arch, G, D, warps, packed, codes in CONFIGS:
        kv = "*" + (codes or dt)
        ptrs = dict(Q="*" + dt, OUT="*" + dt, KN="*" + dt, VN="*" + dt, KC=kv, VC=kv, SP="*i32", PR="*fp32", LP="*fp32",
                    POS="*i64", META="*i64", MID_O="*fp32", MID_L="*fp32", MID_C="*fp32", CV="*fp32", VLV="*fp32",
                    CP="*fp32", CT="*i32", CJ="*i32", CNT="*i32", LSE="*fp32", KS="*fp32", VS="*fp32",
                    qk_scale="fp32")
        c1 = dict(G=G, G_PAD=16, G_P2=triton.next_power_of_2(G), BLOCK_D=D, BLOCK_N=32,
                  BLOCK_S=dm.merge_block(32, G, D), UPCAST=dt == "fp32", PACKED=packed, QUANT=codes is not None,
                  FP8=codes == "fp8e4nv")
        stages, c1["APART"] = dm.arch_options(arch)
        opts1 = {"num_warps": warps, "num_stages": stages}
        for stage, fn, consts, opts in (("step", dm._decode_step, c1, opts1),):
            try:
                kernel = tcompile(ASTSource(fn=fn, signature=_signature(fn, ptrs, consts), constexprs=consts),
                                  target=GPUTarget("cuda", arch, 32), options=opts)
            except Exception as exc:
                if "ptxas" in str(exc) and "not found" in str(exc).lower():  # a Triton without its ptxas
                    print(f"ptxas is not shipped with this Triton: {exc}")
                    return 0
                raise
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(kernel.asm["ptx"])
            try:
                res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}",
                                      f.name, "-o", os.devnull], capture_output=True, text=True, check=True)
            except (OSError, subprocess.CalledProcessError) as exc:
                print(f"ptxas did not run: {exc}")
                return 0
            finally:
                os.unlink(f.name)
            regs = re.search(r"Used (\d+) registers", res.stderr)  # (the kernel's, listed first)
            # spills summed over the kernel and the functions it calls (the combine, where it is not inlined)
            spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
            rows.append((f"sm_{arch} {name}", stage, regs.group(1) if regs else "?",
                         f"{sum(int(a) for a, _ in spill)}/{sum(int(b) for _, b in spill)}" if spill else "?"))
    print(f"{'configuration':30s} {'kernel':8s} {'registers':>9s} {'spill st/ld bytes':>18s}")
    for cfg, stage, regs, spill in rows:
        print(f"{cfg:30s} {stage:8s} {regs:>9s} {spill:>18s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

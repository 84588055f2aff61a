"""Compiles the impl="triton" kernels (attention's, and the post-norm sub-layers' end,
model/add_norm_kernels.py) to Triton's IR for a Hopper GPU (sm_90), which
needs no GPU, with their float arguments typed as a launcher types them, and prints, as
JSON, each kernel's IR lines that compute in float64 or the error that stopped it.

Run as a script, without TRITON_INTERPRET (the interpreter has no IR):

    python tests/attention/triton_ir.py fp64

Why: Triton's own launcher types a Python float as fp32, torch.compile's as fp64, and a
kernel that multiplies its scores by an fp64 scale computes them in float64 (or, in the
forward kernel, fails to compile). tests/attention/test_triton.py reads the output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

from transduce.attention import triton_kernels  # noqa: E402
from transduce.model import add_norm_kernels  # noqa: E402

KERNELS = [(triton_kernels, ["forward_kernel", "dkdv_kernel", "dq_kernel", "keep_mask_kernel"]),
           (add_norm_kernels, ["add_norm_forward_kernel", "add_norm_backward_kernel",
                               "add_norm_keep_mask_kernel"])]
CONSTANTS = {"HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 64, "CAUSAL": True,
             "HAS_MASK": True, "SEGMENTS": True, "DROPOUT": True, "HAS_BIAS": True,
             "PRECISION": "ieee", "BIAS_GRAD": True}
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "DO": "*bf16",
            "DQ": "*bf16", "DKV": "*bf16", "Mask": "*i8", "Keep": "*i8",
            "QNum": "*i32", "KNum": "*i32", "Bias": "*fp32", "Lse": "*fp32",
            "Delta": "*fp32", "DBias": "*fp32",
            # the add-norm kernels': a float32 residual, a bfloat16 sub-layer output
            "X": "*fp32", "Y": "*bf16", "W": "*fp32", "B": "*fp32", "Mean": "*fp32",
            "Rstd": "*fp32", "Seed": "*i64", "DOut": "*fp32", "DX": "*fp32", "DY": "*bf16",
            "DW": "*fp32", "DB": "*fp32"}
FLOATS = {"qk_scale", "scale", "dropout_p", "eps"}
# Where float64 may appear: the arguments, and their one conversion to float32.
ALLOWED = ("tt.func public @", "tt.func private @transduce.attention.triton_kernels._float32",
           "tt.call @transduce.attention.triton_kernels._float32", "arith.truncf")


def signature(kernel, float_type: str) -> tuple[dict, dict]:
    """-> (the argument types by name, the constexpr values by argument position)."""
    types, constants = {}, {}
    for position, name in enumerate(kernel.arg_names):
        if name in CONSTANTS:
            types[name] = "constexpr"
            constants[(position,)] = CONSTANTS[name]
        else:
            types[name] = POINTERS.get(name) or (float_type if name in FLOATS else "i32")
    return types, constants


def float64_lines(kernel, float_type: str) -> list[str]:
    """The kernel's IR lines that hold float64 beyond its arguments' conversion."""
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    options = backend.parse_options({})
    module = ASTSource(kernel, *signature(kernel, float_type)).make_ir(
        target, options, backend.get_codegen_implementation(options),
        backend.get_module_map(), context)
    lines = [line.strip() for line in str(module).splitlines() if "f64" in line]
    return [line for line in lines if not operation(line).startswith(ALLOWED)]


def operation(line: str) -> str:
    """'%3 = arith.mulf %1, %2 : f64' -> 'arith.mulf %1, %2 : f64'."""
    return line.split(" = ", 1)[1] if line.startswith("%") else line


def main(float_type: str) -> None:
    found = {}
    for module, names in KERNELS:
        for name in names:
            try:
                found[name] = float64_lines(getattr(module, name), float_type)
            except Exception as error:   # a kernel Triton refuses to compile
                found[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}"
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])

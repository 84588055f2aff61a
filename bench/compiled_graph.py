"""What torch.compile makes of a packed training step, read on a machine without a GPU.

Compiles the model and its loss (train/objective.py, as `transduce train --compile
--pack-length` steps them) forward and backward, as far as Inductor's post-grad passes:
the graphs that it then turns into kernels. Counts their operators and lists the copies
(clones, concatenations), which no profile of a CUDA run names by their cause.

No GPU is needed: with impl "triton", Inductor only reads the kernels' IR (which tensors
each writes), and Triton makes IR for any target it is given; this script gives it an
sm_90 (Hopper) target, launches nothing, and stops each graph before code generation
(its outputs are empty tensors of the right shapes). The tensors are CPU tensors under
CPU bfloat16 autocast, so device-specific rewrites may differ from a CUDA compile; the
graph's structure (what is copied where, what each kernel writes) does not.

    python bench/compiled_graph.py --preset base --impl triton [--graphs DIR]
    python bench/compiled_graph.py --preset tiny --impl triton     # tests/attention/test_triton.py

Prints JSON: per graph ("forward", "backward"), each operator's count, every clone and
concatenation with its input's and output's shapes and strides, and the Triton kernels
left functional (that is, given copies of their output buffers rather than the buffers).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from transduce.config import preset  # noqa: E402
from transduce.data.packing import sentence_numbers  # noqa: E402
from transduce.model import build_model  # noqa: E402
from transduce.train.objective import SequenceObjective  # noqa: E402

COPIES = ("aten.clone.default", "aten.cat.default", "aten.copy.default", "aten.copy_.default")


class Hopper:
    """A Triton driver that names an sm_90 target and has no device."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def pretend_hopper() -> None:
    """Lets Dynamo and Inductor treat Triton kernels as on a GPU, and impl "triton" and
    its add-norm kernels run on CPU tensors (whose launches never happen here)."""
    import torch.utils._triton

    from transduce.attention import triton_flash, triton_kernels
    from transduce.model import add_norm
    triton.runtime.driver.set_active(Hopper())
    torch.utils._triton.has_triton = lambda: True
    triton_flash.kernels_for = add_norm.kernels_for = lambda device: triton_kernels
    add_norm._kernels_run_on = lambda device: True


def packed_batch(vocab: int, rows: int, length: int, sentence: int) -> tuple:
    """Rows of `length` tokens packed with pairs of `sentence` tokens (the last short)."""
    generator = torch.Generator().manual_seed(0)
    lengths = [[sentence] * (length // sentence) + ([length % sentence] if length % sentence
                                                    else [])] * rows
    segments = (sentence_numbers(lengths, length), sentence_numbers(lengths, length))
    src, tgt_in, tgt_out = (torch.randint(4, vocab, (rows, length), generator=generator)
                            for _ in range(3))
    return src, tgt_in, tgt_out, segments


def graphs_of_a_step(preset_name: str, impl: str, rows: int, length: int,
                     attention_dropout: float | None) -> dict:
    """preset's packed training step -> {"forward": graph, "backward": graph}, traced
    whole (fullgraph: a break fails it)."""
    from torch._inductor import compile_fx
    graphs = {}

    def stop_before_codegen(gm, example_inputs, **settings):
        compile_fx._recursive_post_grad_passes(gm, is_inference=False)
        graphs["backward" if settings.get("is_backward") else "forward"] = gm
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        metas = [o.meta["val"] if isinstance(o, torch.fx.Node) else o for o in outputs]

        def empty_outputs(args):
            args.clear()
            return [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype)
                    if isinstance(m, torch.Tensor) else m for m in metas]
        empty_outputs._boxed_call = True
        return empty_outputs

    def backend(gm, example_inputs):
        return compile_fx.compile_fx(gm, example_inputs, inner_compile=stop_before_codegen)

    vocab = 1000
    torch.manual_seed(0)
    overrides = {} if attention_dropout is None else {"attention_dropout": attention_dropout}
    model = build_model(preset(preset_name, src_vocab_size=vocab, tgt_vocab_size=vocab,
                               attention_impl=impl, **overrides)).train()
    objective = SequenceObjective(model, language_model=False, label_smoothing=0.1)
    step = torch.compile(objective, dynamic=False, fullgraph=True, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = step(*packed_batch(vocab, rows, length, sentence=max(1, length // 4)))
    loss.backward()
    return graphs


def summary(gm: torch.fx.GraphModule) -> dict:
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    counts = collections.Counter(str(n.target) for n in calls)
    return {"operators": dict(counts.most_common()),
            "copies": [copy_of(n) for n in calls if str(n.target) in COPIES],
            "functional_triton_kernels": counts.get("triton_kernel_wrapper_functional", 0)}


def copy_of(node: torch.fx.Node) -> dict:
    sources = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    return {"op": str(node.target), "name": node.name,
            "inputs": [layout(s) for s in sources if isinstance(s, torch.fx.Node)],
            "output": layout(node), "users": sorted({str(u.target) for u in node.users})}


def layout(node: torch.fx.Node) -> dict:
    value = node.meta["val"]
    return {"from": str(node.target), "shape": list(value.shape), "stride": list(value.stride())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--impl", default="triton", choices=["triton", "sdpa", "flash"])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--length", type=int, default=64, help="tokens a packed row")
    parser.add_argument("--attention-dropout", type=float, help="instead of the preset's")
    parser.add_argument("--graphs", type=Path, help="also write each graph's code here")
    args = parser.parse_args()
    pretend_hopper()
    graphs = graphs_of_a_step(args.preset, args.impl, args.rows, args.length,
                              args.attention_dropout)
    if args.graphs:
        args.graphs.mkdir(parents=True, exist_ok=True)
        for name, gm in graphs.items():
            (args.graphs / f"{args.preset}-{args.impl}-{name}.py").write_text(gm.code)
    print(json.dumps({name: summary(gm) for name, gm in graphs.items()}, indent=1))


if __name__ == "__main__":
    main()

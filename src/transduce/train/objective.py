"""A translation model or a language model and its loss as one module: what the
training loop steps, compiles and wraps for DistributedDataParallel.

Why one module: torch.compile of the model alone left the loss outside the graph, and
the loss selected the target positions that are not padding, a shape only the data
knows, so a GPU had to report it to the host in the middle of every step. Compiled
together, the loss projects every position and weighs padding by zero (train/loss.py,
every_row), and a step's forward and backward are each one graph with no pause in
them, which CUDA graphs can replay. Uncompiled, it is the model and the loss as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from transduce.data.tokenizer import PAD_ID
from transduce.train.loss import label_smoothed_nll, projected_label_smoothed_nll


class SequenceObjective(torch.nn.Module):
    """forward -> the label-smoothed loss summed over the scored target tokens (float32,
    the one output with a gradient). pad_id: what the loss takes as padding
    (train/loss.py; None for a vocabulary that pads with eos, whose batches mark the
    targets not scored with IGNORE)."""

    def __init__(self, model: torch.nn.Module, language_model: bool, label_smoothing: float,
                 pad_id: int | None = PAD_ID):
        super().__init__()
        self.model = model
        self.language_model = language_model
        self.label_smoothing = label_smoothing
        self.pad_id = pad_id

    def forward(self, src: Tensor | None, tgt_in: Tensor, tgt_out: Tensor,
                segments: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """src (B, S) or None for a language model; tgt_in, tgt_out (B, T); segments
        the source's and target's sentence numbers (B, S), (B, T) of packed pairs."""
        if self.language_model and self.model.config.logit_softcap is not None:
            # Capped logits (Gemma 2's): the loss's own gradient (softmax - q) would
            # skip the cap's, so the logits are formed and autograd takes them.
            return label_smoothed_nll(self.model(tgt_in), tgt_out, self.label_smoothing,
                                      self.pad_id)[0]
        if self.language_model:
            hidden = self.model(tgt_in, project=False)                          # (B, T, C)
        elif segments is not None:
            hidden = self.model(src, tgt_in, project=False, segments=segments)
        else:
            hidden = self.model(src, tgt_in, project=False)
        output = self.model.output_proj
        loss, _ = projected_label_smoothed_nll(hidden, output.weight, tgt_out,
                                               self.label_smoothing, self.pad_id,
                                               bias=output.bias)
        return loss

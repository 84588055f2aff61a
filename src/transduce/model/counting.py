"""Parameter counts that a decoding copy keeps: its packed and int8 weights are buffers,
not parameters (model/packed.py), so counting its parameters would miss most of them."""

from __future__ import annotations


class CountedParameters:
    """Mixed into each model class beside nn.Module."""

    source_parameters: int | None = None   # set on a decoding copy: its source's count

    def num_parameters(self) -> int:
        """Parameters, a tied matrix counted once; a LoRA run's frozen weights too."""
        if self.source_parameters is not None:
            return self.source_parameters
        return sum(p.numel() for p in self.parameters())

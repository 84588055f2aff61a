"""Position information: sinusoidal (the paper; fairseq's variant, NLLB's), learned, and
rotary (RoPE).

Sinusoidal and learned encodings are added to the scaled token embeddings; rotary
positions rotate the queries and keys inside self-attention instead, so that q.k
depends on the relative position only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(num_positions: int, d_model: int) -> Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)).

    -> (num_positions, d_model) float32
    """
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]
    rates = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64)
                      * (-math.log(10000.0) / d_model))                 # 10000^(-2i/d)
    angles = positions * rates                                           # (P, ceil(d/2))
    table = torch.empty(num_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.float()


FAIRSEQ_OFFSET = 2      # fairseq counts positions from its pad id (1) + 1


def fairseq_table(num_positions: int, d_model: int) -> Tensor:
    """fairseq's sinusoids (NLLB's, M2M-100's) for positions 0 .. num_positions - 1:
    [sin | cos] of (position + 2) * 10000^(-k / (d/2 - 1)), k < d/2 (a zero column for an
    odd d). Computed in float32 as fairseq and transformers compute them: the models
    were trained on these roundings. -> (num_positions, d_model) float32"""
    half = d_model // 2
    rates = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(FAIRSEQ_OFFSET, FAIRSEQ_OFFSET + num_positions,
                          dtype=torch.float32)[:, None] * rates[None]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return torch.cat([table, table.new_zeros(num_positions, d_model % 2)], dim=1)


def sines_first_permutation(d_model: int) -> Tensor:
    """Our dimension 2i (sin) -> i, our 2i + 1 (cos) -> d/2 + i: the layout of tables
    that put all the sines first (Marian's, Pegasus's). Returns perm with
    their_vector = our_vector[perm]; ours = theirs[perm.argsort()]."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def check_range(start: int, length: int, max_positions: int) -> None:
    if torch.jit.is_tracing():   # an ONNX trace would freeze the sizes it compares
        return
    if start + length > max_positions:
        raise ValueError(f"positions {start}..{start + length - 1} exceed max_positions="
                         f"{max_positions}; raise ModelConfig.max_positions or shorten the input")


def _check_positions(positions: Tensor, max_positions: int) -> None:
    """Per-token positions (B, T) within the table. Not while torch.compile captures a
    graph: reading the largest would break it in two (packed training's positions stay
    below its rows' length, which the run's configuration checks)."""
    if positions.numel() and not torch.jit.is_tracing() and not torch.compiler.is_compiling():
        check_range(0, int(positions.max()) + 1, max_positions)


class TablePositions(nn.Module):
    """What the additive encodings share: the vectors of positions start .. start + T - 1
    (every row alike), or of each row's own positions (B, T) (left-padded prompts)."""

    max_positions: int

    def _table(self) -> Tensor:
        raise NotImplementedError

    def forward(self, length: int, start: int = 0) -> Tensor:
        """-> (length, d_model), the encodings of positions start .. start + length - 1."""
        check_range(start, length, self.max_positions)
        return self._table()[start:start + length]

    def lookup(self, positions: Tensor) -> Tensor:
        """positions (B, T) -> (B, T, d_model)."""
        _check_positions(positions, self.max_positions)
        return self._table()[positions]


class ComputedTable(TablePositions):
    """A fixed encoding: the table is derived from its size, so it is neither saved nor
    trained."""

    def __init__(self, table: Tensor):
        super().__init__()
        self.max_positions = table.shape[0]
        self.register_buffer("table", table, persistent=False)

    def _table(self) -> Tensor:
        return self.table


class SinusoidalPositionalEncoding(ComputedTable):
    """The paper's fixed encoding."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__(sinusoidal_table(max_positions, d_model))


class FairseqPositionalEncoding(ComputedTable):
    """fairseq's fixed encoding (fairseq_table), as NLLB and M2M-100 add it."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__(fairseq_table(max_positions, d_model))


class LearnedPositionalEmbedding(TablePositions):
    """One trained vector per position (the paper's Table 3, row E)."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        self.max_positions = max_positions
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model ** -0.5)

    def _table(self) -> Tensor:
        return self.embedding.weight


def rotary_frequencies(head_dim: int, base: float = 10000.0, scaling: str = "none",
                       factor: float = 8.0, low_freq_factor: float = 1.0,
                       high_freq_factor: float = 4.0, original_positions: int = 8192,
                       rotary_dims: int | None = None) -> Tensor:
    """The D/2 rotation rates base^(-2i/D), float64, stretched for a longer context:
    "linear" divides every rate by `factor` (positions m / factor); "llama3" (Llama 3.1)
    divides the rates of wavelengths 2 pi / rate above original_positions /
    low_freq_factor by `factor`, keeps those below original_positions /
    high_freq_factor, and blends linearly in 1 / wavelength between. rotary_dims (R):
    the first R/2 rates are base^(-2i/R), so stretched, and the others 0 (pairs that do
    not turn: ModelConfig.rotary_dims)."""
    dims = head_dim if rotary_dims is None else rotary_dims
    rates = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    if scaling == "linear":
        rates = rates / factor
    elif scaling == "llama3":
        wavelength = 2 * math.pi / rates
        blend = ((original_positions / wavelength - low_freq_factor)
                 / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)  # 0: long, 1: short
        rates = (1 - blend) * rates / factor + blend * rates
    return torch.cat([rates, rates.new_zeros((head_dim - dims) // 2)])


def partial_rotary_order(head_dim: int, rotary_dims: int) -> Tensor:
    """Where each of our features of a head comes from in the layout of GPT-NeoX, Phi
    and transformers (the rotated features first, pairs (i, i + R/2), then the others):
    ours[j] = theirs[order[j]], so that our pairs (j, j + D/2) are theirs and the first
    R/2 of them the rotated ones (rotary_frequencies). Queries and keys reordered alike
    give the same scores. -> order (D,)."""
    half, rotated = head_dim // 2, rotary_dims // 2
    others = torch.arange(rotary_dims, head_dim)                  # D - R, split in two
    return torch.cat([torch.arange(rotated), others[:half - rotated],
                      torch.arange(rotated, rotary_dims), others[half - rotated:]])


def interleaved_pairs_order(head_dim: int, rotary_dims: int) -> Tensor:
    """Where each feature of a head in GPT-NeoX's layout (partial_rotary_order's
    "theirs") comes from in GPT-J's, which rotates the first R features in adjacent pairs
    (2i, 2i + 1): neox[j] = gptj[order[j]] -> order (D,)."""
    return torch.cat([torch.arange(0, rotary_dims, 2), torch.arange(1, rotary_dims, 2),
                      torch.arange(rotary_dims, head_dim)])


def heads_in_rotary_order(rows: Tensor, head_dim: int, rotary_dims: int | None, *,
                          to_theirs: bool = False, interleaved: bool = False) -> Tensor:
    """A query or key projection's rows (H * D, ...) (or a norm's (D,)), each head's
    features put in our order from that of GPT-NeoX, Phi and transformers
    (partial_rotary_order), or from GPT-J's and CodeGen's adjacent pairs (interleaved:
    interleaved_pairs_order), or back (to_theirs) -> the same shape."""
    order = partial_rotary_order(head_dim, rotary_dims or head_dim)
    if interleaved:
        order = interleaved_pairs_order(head_dim, rotary_dims or head_dim)[order]
    if to_theirs:
        order = order.argsort()
    return rows.reshape(-1, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021), "rotate half" layout: dimension i is paired with i + D/2,
    and the pair at position m is rotated by the angle m * base^(-2i/D) (the rates of
    rotary_frequencies, which may be given instead)."""

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0,
                 inv_freq: Tensor | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions need an even head size, got {head_dim}")
        self.max_positions = max_positions
        if inv_freq is None:
            inv_freq = rotary_frequencies(head_dim, base)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)                     # (P, D)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, start: int | Tensor = 0) -> Tensor:
        """x (B, H, T, D), positions start .. start + T - 1, or each row's own positions
        start (B, T) -> rotated (B, H, T, D)."""
        if isinstance(start, Tensor) and start.dim() == 2:   # (an ONNX trace's sizes are 0-D)
            _check_positions(start, self.max_positions)
            cos, sin = self.cos[start].unsqueeze(1), self.sin[start].unsqueeze(1)  # (B, 1, T, D)
        else:
            length = x.shape[-2]
            check_range(start, length, self.max_positions)
            cos, sin = self.cos[start:start + length], self.sin[start:start + length]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        rotated_half = torch.cat([-second, first], dim=-1)
        return x * cos + rotated_half * sin

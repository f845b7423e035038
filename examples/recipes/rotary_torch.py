"""Recipe: rotary-embedding-torch's RotaryEmbedding.rotate_queries_or_keys checked as it is (rotary_torch.yaml),
as the rope op with ``layout: interleaved`` (the library rotates pairs (2k, 2k + 1)). The library makes its
own angles from the head width, its base (theta) and the positions, so the factory builds it from the
scenario's d_head (or rotary_dim), base and position_offset, and the tool's cos/sin tables are not passed.
The wrapper only names the method to call: the library's forward() returns the angles, not the rotated x.

Tested with rotary-embedding-torch 0.9.1 (torch 2.13.0)."""
import torch
from rotary_embedding_torch import RotaryEmbedding


class Rotate(torch.nn.Module):  # x [B, H, n, d]: the library's default sequence axis is -2
    def __init__(self, rotary, offset):
        super().__init__()
        self.rotary, self.offset = rotary, offset

    def forward(self, x):
        return self.rotary.rotate_queries_or_keys(x, offset=self.offset)


def rotary(d_head, rotary_dim, base, position_offset):  # features past rotary_dim pass through, as in the tool
    return Rotate(RotaryEmbedding(rotary_dim or d_head, theta=base), position_offset)


class RotateFromZero(Rotate):  # broken: the positions start at 0 whatever the offset (a KV cache's new rows)
    def forward(self, x):
        return self.rotary.rotate_queries_or_keys(x)


def rotary_offset_dropped(d_head, rotary_dim, base, position_offset):
    return RotateFromZero(RotaryEmbedding(rotary_dim or d_head, theta=base), position_offset)

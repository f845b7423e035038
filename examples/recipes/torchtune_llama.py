"""Recipe: torchtune's RMSNorm, RotaryPositionalEmbeddings and MultiHeadAttention (the attention of its Llama
builders) checked as they are, with their weights (torchtune_llama.yaml).

- RMSNorm: the module as built; its ``scale`` is the tool's gamma.
- RotaryPositionalEmbeddings pairs features (2k, 2k + 1) (layout interleaved) and takes x as [b, s, n_h, h_d]:
  the wrapper transposes the tool's [B, H, n, d] and passes the scenario's positions as input_pos.
- MultiHeadAttention with bias-free nn.Linear projections and no RoPE (the op attention-projections has
  none): its mask is [b, s, s] (True = attend) shared by the heads, so the wrapper passes the tool's
  per-head keep-mask of one head; query head h reads KV head h // (Hq / Hkv), the tool's default.

Tested with torchtune 0.6.1 and torchao 0.11.0 (torch 2.13.0)."""
import torch
from torchtune.modules import MultiHeadAttention, RMSNorm, RotaryPositionalEmbeddings


def rmsnorm(d_model, eps):
    return RMSNorm(d_model, eps=eps)


class Rope(torch.nn.Module):  # the tool's x [B, H, n, d] as the library's [b, s, n_h, h_d]
    def __init__(self, rope, positions):
        super().__init__()
        self.rope, self.positions = rope, positions

    def forward(self, x):
        return self.rope(x.transpose(1, 2), input_pos=self.positions.expand(x.shape[0], -1)).transpose(1, 2)


def rope(d_head, n, base, position_offset):
    positions = torch.arange(position_offset, position_offset + n)[None]
    return Rope(RotaryPositionalEmbeddings(d_head, max_seq_len=position_offset + n, base=base), positions)


class SelfAttention(torch.nn.Module):  # the library's mask: [b, s, s], True = attend, one for every head
    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, x, visible):
        return self.attention(x, x, mask=visible[:, 0])


def attention(d_model, heads_q, heads_kv, d_head):
    def linear(n_in, n_out):
        return torch.nn.Linear(n_in, n_out, bias=False)
    return SelfAttention(MultiHeadAttention(
        embed_dim=d_model, num_heads=heads_q, num_kv_heads=heads_kv, head_dim=d_head,
        q_proj=linear(d_model, heads_q * d_head), k_proj=linear(d_model, heads_kv * d_head),
        v_proj=linear(d_model, heads_kv * d_head), output_proj=linear(heads_q * d_head, d_model)))


class RopeHeadsAsPositions(Rope):  # broken: [B, H, n, d] given as it is, so the library rotates by head index
    def forward(self, x):
        return self.rope(x)


def rope_untransposed(d_head, n, base, position_offset):
    return RopeHeadsAsPositions(RotaryPositionalEmbeddings(d_head, max_seq_len=position_offset + n, base=base),
                                None)

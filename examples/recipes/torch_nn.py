"""Recipe: torch.nn.MultiheadAttention checked as it is, with its weights: the fused in_proj_weight
[3 d_model, d_model] is concat(w_q.T, w_k.T, w_v.T) and out_proj.weight is w_o.T (torch_nn.yaml). The
subclass only maps the call: the tool's visible (True = key visible, per head) becomes the module's
attn_mask (True = hidden, [B * heads, n_q, n_k])."""
import torch


class MultiheadAttention(torch.nn.MultiheadAttention):
    def forward(self, x, visible):
        return super().forward(x, x, x, attn_mask=~visible.flatten(0, 1), need_weights=False)[0]


def multihead_attention(d_model, heads_q):
    return MultiheadAttention(d_model, heads_q, bias=False, batch_first=True)


class KeepMask(MultiheadAttention):  # broken: the tool's keep-mask passed as it is (the module hides True)
    def forward(self, x, visible):
        mask = visible.flatten(0, 1)
        return torch.nn.MultiheadAttention.forward(self, x, x, x, attn_mask=mask, need_weights=False)[0]


def multihead_attention_keep_mask(d_model, heads_q):
    return KeepMask(d_model, heads_q, bias=False, batch_first=True)

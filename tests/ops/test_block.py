"""The transformer block (ops/block.py): its backward against torch autograd (RMSNorm, RoPE as HF's
rotate_half, SDPA, SwiGLU), which also checks attention-projections as its middle."""
import pytest

from gradcheck_cli.ops import OPS

from helpers import assert_close, make


def test_block_and_projections_against_torch_autograd():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    sc = make(op="block", batch=2, n_q=4, d_model=8, d_ff=6, d_head=4, heads_q=2, heads_kv=1,
              mask={"causal": "lower-right"}, rope_layout="half")
    p = OPS["block"].problem(sc)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.inputs.items()}

    def norm(x, gamma):
        return gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def rope_t(x):  # HF's rotate_half formulation
        inv = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4))
        emb = torch.cat([torch.outer(torch.arange(4, dtype=torch.float64), inv)] * 2, dim=-1)
        return x * emb.cos() + torch.cat([-x[..., 2:], x[..., :2]], dim=-1) * emb.sin()

    def split_t(z, h):
        return z.view(2, 4, h, -1).transpose(1, 2)

    h1 = norm(t["x"], t["gamma1"])
    q, k, v = rope_t(split_t(h1 @ t["w_q"], 2)), rope_t(split_t(h1 @ t["w_k"], 1)), split_t(h1 @ t["w_v"], 1)
    o = F.scaled_dot_product_attention(q, k.expand(2, 2, 4, 4), v.expand(2, 2, 4, 4),
                                       attn_mask=torch.tensor(sc.visible))
    h = t["x"] + o.transpose(1, 2).reshape(2, 4, 8) @ t["w_o"]
    h2 = norm(h, t["gamma2"])
    y = h + (F.silu(h2 @ t["w1"]) * (h2 @ t["w3"])) @ t["w2"]
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    assert_close(p.gradients, {k: v.grad.numpy() for k, v in t.items()}, rtol=1e-9)

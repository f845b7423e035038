"""Recipe: timm's ViT Attention (timm.layers.Attention, what timm.models.vision_transformer builds) checked as
it is, with its weights (timm_vit.yaml): the fused qkv.weight [3 H d, d_model] is concat(w_q.T, w_k.T, w_v.T)
and proj.weight is w_o.T. Built with qkv_bias=False and proj_bias=False (timm's default proj_bias=True adds a
bias the op has not got; it can be turned off, so nothing is zeroed). Its attn_mask is SDPA's (bool, True =
attend, [B, H, n, n] as the tool's), so the call maps visible to attn_mask and no adapter is needed.

timm 1.0.x imports torchvision when it is imported (timm/layers/create_norm.py, norm_act.py), so without
torchvision ``import timm`` fails; then this recipe loads timm's own timm/layers/attention.py (which needs no
torchvision) from the installed package under a private package name, without running timm's __init__.

Tested with timm 1.0.31 (torch 2.13.0, torchvision not installed)."""
import importlib
import importlib.util
import sys
from pathlib import Path

try:
    from timm.layers import Attention
except ImportError:  # no torchvision: timm's attention module from its source file, as it is
    if importlib.util.find_spec("timm") is None:
        raise  # timm itself is not installed (pip install timm): nothing to load its source from
    _layers = Path(importlib.util.find_spec("timm").submodule_search_locations[0]) / "layers"
    _spec = importlib.util.spec_from_file_location("_timm_layers", _layers / "__init__.py",
                                                   submodule_search_locations=[str(_layers)])
    sys.modules.setdefault("_timm_layers", importlib.util.module_from_spec(_spec))  # its __init__ is not run
    Attention = importlib.import_module("_timm_layers.attention").Attention


def attention(d_model, heads_q, d_head):
    return Attention(d_model, num_heads=heads_q, attn_head_dim=d_head, qkv_bias=False, proj_bias=False)


def attention_default_bias(d_model, heads_q, d_head):  # broken: timm's default proj_bias=True left on
    return Attention(d_model, num_heads=heads_q, attn_head_dim=d_head, qkv_bias=False)

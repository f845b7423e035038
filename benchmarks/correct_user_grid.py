"""A random grid of CORRECT user implementations of the ops beyond attention (layernorm, rmsnorm, rope,
swiglu, infonce; in torch and JAX also attention-projections, self and cross, and the whole block) in the
three flavours (NumPy: examples/my_*.py; torch: examples/torch_ops.py; JAX: examples/jax_ops.py), plus JAX
attention (examples/jax_attention.py) and modules with weights (the mapping form of implementation: a torch
SwiGLU module with a frozen extra parameter, a JAX function with its params pytree, and RMSNorm/LayerNorm
modules whose factories take the scenario's eps, in torch and JAX): no run may FAIL, and
inconclusive verdicts are listed with their checks. Shapes, eps, rotary dims, offsets, bases, masks, GQA,
dtypes and check modes are drawn at random.

    python benchmarks/correct_user_grid.py [--count 300] [--seed 0] [--flavour numpy|torch|jax|all]

Exit 1 when any scenario FAILs. Flavours whose framework is not installed are skipped.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import random
import sys
from pathlib import Path

import yaml

from gradcheck_cli import checker, scenario

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SOURCES = {"numpy": lambda op: f"my_{op}:{op}", "torch": lambda op: f"torch_ops:{op}",
           "jax": lambda op: f"jax_ops:{op}"}


def _attention_shape(rng: random.Random, self_attention: bool) -> dict:
    hkv = rng.randint(1, 2)
    n_q = rng.randint(1, 6)
    n_k = n_q if self_attention else rng.randint(n_q, n_q + 5)
    masks = [{}, {"causal": "lower-right"}, {"causal": "lower-right", "window": [2, 0]}]
    return dict(heads_q=hkv * rng.randint(1, 2), heads_kv=hkv, n_q=n_q, n_k=n_k, d_head=rng.randint(1, 8),
                mask=rng.choice(masks))


def draw(rng: random.Random, flavour: str, i: int) -> dict:
    """The keys of one correct scenario."""
    ops = ["layernorm", "rmsnorm", "rope", "swiglu", "infonce"]
    if flavour != "numpy":
        ops += ["attention-projections", "block", "module", "norm-module"]
    if flavour == "jax":
        ops.append("attention")
    op = rng.choice(ops)
    keys = {"name": f"s{i}", "op": op, "dtype": rng.choice(["float64", "float32"]), "seed": rng.randrange(10**6),
            "batch": rng.randint(1, 3)}
    if flavour != "numpy":
        keys["backend"] = flavour
    if op in ("layernorm", "rmsnorm", "norm-module"):
        keys.update(n=rng.randint(1, 5), d_model=rng.randint(2, 24), eps=rng.choice([0.0, 1e-6, 1e-5, 0.1]))
    elif op == "rope":
        d = 2 * rng.randint(1, 8)
        keys.update(heads=rng.randint(1, 3), n=rng.randint(1, 9), d_head=d, rotary_dim=2 * rng.randint(1, d // 2),
                    position_offset=rng.randint(0, 500), base=rng.choice([10000.0, 500000.0, 10.0]))
    elif op in ("swiglu", "module"):
        keys.update(n=rng.randint(1, 4), d_model=rng.randint(1, 10), d_ff=rng.randint(1, 16))
    elif op == "infonce":
        keys.update(batch=rng.randint(2, 5), dim=rng.randint(2, 12), hard_negatives=rng.randint(0, 2),
                    learn_temperature=rng.random() < 0.5, temperature=rng.choice([0.05, 0.1, 1.0]))
    elif op == "attention-projections":
        cross = flavour == "torch" and rng.random() < 0.3
        keys.update(_attention_shape(rng, not cross), d_model=rng.randint(2, 12),
                    **({"source": "cross"} if cross else {}))
        if keys["mask"].get("causal") and cross:
            keys["mask"] = {}
    elif op == "block":
        keys.update(_attention_shape(rng, True), d_model=rng.randint(2, 10), d_ff=rng.randint(2, 12))
        keys["d_head"] = 2 * rng.randint(1, 4)  # the RoPE pairs
    else:
        keys.update(_attention_shape(rng, False))
    if op == "module":  # a module with weights: the mapping form
        keys["op"] = "swiglu"
        keys["implementation"] = (
            {"factory": "torch_ops:SwiGLU", "weights": {"gate.weight": "w1.T", "up.weight": "w3.T",
                                                         "down.weight": "w2.T"}} if flavour == "torch" else
            {"factory": "jax_ops:swiglu_with_params", "weights": {"mlp.gate": "w1", "mlp.up": "w3", "mlp.down": "w2"}})
    elif op == "norm-module":  # a norm module whose factory takes the scenario's eps
        keys["op"] = rng.choice(["rmsnorm", "layernorm"])
        torch_weights = {"weight": "gamma"} if keys["op"] == "rmsnorm" else {"weight": "gamma", "bias": "beta"}
        keys["implementation"] = (
            {"factory": f"torch_ops:{keys['op']}_module", "weights": torch_weights} if flavour == "torch" else
            {"factory": f"jax_ops:{keys['op']}_with_params",
             "weights": {"scale": "gamma"} if keys["op"] == "rmsnorm" else {"scale": "gamma", "bias": "beta"}})
    elif op == "attention":
        keys["implementation"] = "jax_attention:attention"
    elif op in ("attention-projections", "block"):
        name = "cross_attention" if keys.get("source") == "cross" else op.replace("-", "_")
        keys["implementation"] = f"{'torch_ops' if flavour == 'torch' else 'jax_ops'}:{name}"
    else:
        keys["implementation"] = SOURCES[flavour](op)
    if rng.random() < 0.2:
        keys["check"] = {"mode": rng.choice(["sample", "directional"])}
    return keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flavour", choices=["numpy", "torch", "jax", "all"], default="all")
    args = parser.parse_args()
    flavours = ["numpy", "torch", "jax"] if args.flavour == "all" else [args.flavour]
    flavours = [f for f in flavours if f == "numpy" or importlib.util.find_spec(f) is not None]
    rng = random.Random(args.seed)
    tally, odd = collections.Counter(), []
    for i in range(args.count):
        flavour = flavours[i % len(flavours)]
        keys = draw(rng, flavour, i)
        sc = scenario.loads(yaml.safe_dump({"scenarios": [keys]}), base_dir=EXAMPLES)[0]
        result = checker.run_scenario(sc)
        label = keys["op"] + (" (module)" if isinstance(keys["implementation"], dict) else "")
        tally[(flavour, label, keys["dtype"], str(result.verdict))] += 1
        if result.verdict != "pass":
            odd.append((str(result.verdict), keys, [(c.name, c.verdict) for c in result.checks if c.verdict != "pass"]))
    for key, count in sorted(tally.items()):
        print(*key, count)
    for verdict, keys, checks in odd:
        print(verdict.upper(), keys, checks)
    failed = sum(count for key, count in tally.items() if key[-1] == "fail")
    print(f"{sum(tally.values())} scenarios: {failed} FAIL, "
          f"{sum(c for k, c in tally.items() if k[-1] == 'inconclusive')} inconclusive")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

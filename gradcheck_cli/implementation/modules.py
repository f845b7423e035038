"""The module form of ``implementation:``: a factory that builds the user's module (a ``torch.nn.Module``, a
flax module with its variables, or a JAX function with its params pytree), a map from the module's
parameters to the op's tensors, and what the module is called with::

    implementation:
      factory: "hf_llama:mlp_module"          # module:attribute, called with the scenario sizes it names
      weights:                                # module parameter <- expression of the op's tensors
        gate_proj.weight: w1.T                # nn.Linear keeps [out, in]: the transpose of the op's [in, out]
        up_proj.weight: w3.T
        down_proj.weight: w2.T
      call: [x]                               # positional (a list) or keyword (a mapping) arguments

An expression is a tensor name, ``name.T`` (the last two axes swapped) or ``concat(e1, e2, ...)`` (joined
along axis 0, e.g. a fused qkv weight ``concat(w_q.T, w_k.T, w_v.T)``), itself optionally transposed. A
parameter of another rank with as many elements takes the expression reshaped in row-major order (flax's
DenseGeneral kernels [d_model, heads, d_head] from w_q [d_model, heads * d_head], the tool's head split);
one of the same rank must match its shape exactly (a missing ``.T`` is an error, never a silent reshape).
Every op tensor must reach the module, through a weight or through ``call``; the module's other
parameters keep the values the factory gave them, are not differentiated and are listed in the report.

This module parses and validates the form (the loader, without importing anything) and calls the
factory; the flavours (``flavours.torch``, ``flavours.jax``) turn the module into the one callable
f(*inputs, *args) their interface takes.
"""
from __future__ import annotations

import difflib
import inspect
import re
import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from .failures import ImplementationFailure

#: The keys of the mapping form of ``implementation:``.
KEYS = ("factory", "weights", "call")

_TOKEN = re.compile(r"\s*(concat\(|[A-Za-z_]\w*|\.T\b|,|\))")

#: The deepest nesting of ``concat(`` an expression may have (a fused weight needs one or two): bounded
#: before the recursive parser runs, so no expression can exhaust Python's stack.
MAX_DEPTH = 32


@dataclass(frozen=True)
class Expr:
    """A weight expression: a tensor (``name``) or ``concat`` of ``parts``, transposed when ``transpose``."""
    name: str | None = None
    parts: tuple[Expr, ...] = ()
    transpose: bool = False

    def tensors(self) -> tuple[str, ...]:
        return (self.name,) if self.name else tuple(t for p in self.parts for t in p.tensors())

    def evaluate(self, values: dict, transpose, concat):
        """The expression on ``values`` (tensor name -> array), with the framework's ``transpose`` (last two
        axes) and ``concat`` (a list along axis 0)."""
        out = values[self.name] if self.name else concat([p.evaluate(values, transpose, concat) for p in self.parts])
        return transpose(out) if self.transpose else out

    def __str__(self) -> str:
        body = self.name or f"concat({', '.join(map(str, self.parts))})"
        return body + (".T" if self.transpose else "")


def _short(text: str) -> str:
    """``text`` quoted, cut to a readable length (an expression of megabytes is not repeated back)."""
    return repr(text) if len(text) <= 80 else repr(text[:60]) + f"... ({len(text):,} characters)"


def parse_expr(text: str) -> Expr:
    """Parse a weight expression; raises ValueError saying what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected an expression of the op's tensors (e.g. 'w1.T'), got {reprlib.repr(text)}")
    tokens, pos, clean = [], 0, text.strip()
    while pos < len(clean):
        m = _TOKEN.match(clean, pos)
        if not m:
            raise ValueError(f"cannot read {_short(clean[pos:])} in {_short(clean)}: an expression is a tensor name, "
                             "name.T, or concat(a, b, ...), optionally followed by .T")
        tokens.append(m.group(1))
        pos = m.end()
    depth = 0
    for token in tokens:
        depth += (token == "concat(") - (token == ")")
        if depth > MAX_DEPTH:
            raise ValueError(f"concat( is nested more than {MAX_DEPTH} deep in {_short(clean)}: a fused weight "
                             "needs one concat(a, b, ...)")

    def expr(i: int) -> tuple[Expr, int]:
        if i >= len(tokens):
            raise ValueError(f"{_short(clean)} ends too early")
        if tokens[i] == "concat(":
            parts, i = [], i + 1
            while True:
                part, i = expr(i)
                parts.append(part)
                if i < len(tokens) and tokens[i] == ",":
                    i += 1
                    continue
                if i < len(tokens) and tokens[i] == ")":
                    i += 1
                    break
                raise ValueError(f"concat( in {_short(clean)} needs its closing parenthesis")
            node = Expr(parts=tuple(parts))
        elif re.fullmatch(r"[A-Za-z_]\w*", tokens[i]):
            node, i = Expr(name=tokens[i]), i + 1
        else:
            raise ValueError(f"unexpected {tokens[i]!r} in {_short(clean)}")
        if i < len(tokens) and tokens[i] == ".T":
            node, i = Expr(node.name, node.parts, True), i + 1
        return node, i

    node, end = expr(0)
    if end != len(tokens):
        raise ValueError(f"unexpected {tokens[end]!r} in {_short(clean)}")
    return node


@dataclass(frozen=True)
class ModuleSpec:
    """The parsed mapping form: the factory's ``module:attribute``, the weights (parameter path ->
    expression, in the YAML's order), and the call: names of the op's tensors and arguments, positional, or
    keyword when ``keywords`` names them."""
    factory: str
    weights: tuple[tuple[str, Expr], ...] = ()
    call: tuple[str, ...] = ()
    keywords: tuple[str, ...] | None = None

    @property
    def mapped(self) -> tuple[str, ...]:
        """The op tensors the weights use."""
        return tuple(dict.fromkeys(t for _, e in self.weights for t in e.tensors()))


def suggest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest of ``choices``, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def sizes(sc, attention: bool) -> dict[str, Any]:
    """What a factory may ask for by name: the scenario's sizes and settings (its op's own keys, the batch,
    dtype and device, and for the attention family heads_q, heads_kv, n_q, n_k, d_head, d_value and
    scale)."""
    out: dict[str, Any] = {"batch": sc.batch, "dtype": sc.dtype, "device": sc.device}
    if attention:
        out.update(heads_q=sc.heads_q, heads_kv=sc.heads_kv, n_q=sc.n_q, n_k=sc.n_k, d_head=sc.d_head,
                   d_value=sc.d_value, scale=sc.scale)
    out.update(dict(sc.params))
    return out


def _parameters(factory):
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return None


def taken(factory, available: dict[str, Any]) -> set[str]:
    """The names of ``available`` that ``factory`` is called with (all of them when it takes ``**kwargs``)."""
    params = _parameters(factory)
    if params is None:
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(available)
    return {name for name, p in params.items() if name in available and p.kind is not inspect.Parameter.VAR_POSITIONAL}


def build(factory, available: dict[str, Any], spec: str):
    """Call ``factory`` with the keyword arguments it names, taken from ``available`` (all of them when it
    takes ``**kwargs``: ``taken``). Raises ImplementationFailure for a parameter the scenario does not have or
    for anything the factory raises."""
    params = _parameters(factory) or {}
    for name, p in params.items():
        if (p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) and name not in available
                and p.default is inspect.Parameter.empty):
            raise ImplementationFailure(
                f"the factory {spec} asks for {name!r}{suggest(name, available)}, which the scenario does not "
                f"have; a factory may ask for: {', '.join(available)}")
    kwargs = {name: available[name] for name in taken(factory, available)}
    from . import guarded
    return guarded(f"the factory {spec}", lambda: factory(**kwargs))


def frozen(named, mapped, unread, nonzero) -> tuple[list[str], list[str]]:
    """The module's parameters no weight maps (``named``: (name, value) pairs; ``mapped``: the mapped names),
    each as its name or 'name (why it is not read)' (``unread(value)``: None for a dense array), and those of
    them that are not zero (``nonzero(value)``, asked of dense ones only: an empty or sparse parameter is
    listed, never reduced)."""
    listed, nonzeros = [], []
    for name, value in named:
        if name in mapped:
            continue
        why = unread(value)
        listed.append(name if why is None else f"{name} ({why})")
        if why is None and nonzero(value):
            nonzeros.append(name)
    return listed, nonzeros


def check_names(spec: ModuleSpec, tensors: tuple[str, ...], args: tuple[str, ...]) -> list[tuple[str, str]]:
    """What is wrong with ``spec`` for an op whose scenario has ``tensors`` and passes ``args``: a list of
    (key, message)."""
    problems = []
    for path, e in spec.weights:
        for t in e.tensors():
            if t not in tensors:
                problems.append((f"weights.{path}", f"{t!r} is not a tensor of this scenario{suggest(t, tensors)}; "
                                                    f"its tensors: {', '.join(tensors)}"))
    for name in spec.call:
        if name not in tensors + args:
            problems.append(("call", f"{name!r} is not a tensor or argument of this op{suggest(name, tensors + args)}; "
                                     f"tensors: {', '.join(tensors)}; arguments: {', '.join(args) or 'none'}"))
        elif name in spec.mapped:
            problems.append(("call", f"{name!r} is mapped to a weight and passed in call: give it one way"))
    missing = [t for t in tensors if t not in spec.mapped and t not in spec.call]
    if missing and not problems:
        problems.append(("weights", f"tensor(s) {', '.join(missing)} reach the module neither through a weight nor "
                                    "through call: their gradients could not be checked; every tensor of the op goes "
                                    "to the module once, as a weight (weights: {param: expression}) or as an argument "
                                    "(call: [...])"))
    return problems


def fitted(expr_shape: tuple, param_shape: tuple, path: str, expr: Expr) -> tuple | None:
    """The shape ``expr`` is reshaped to for parameter ``path`` (None: it fits as it is). Raises
    ImplementationFailure when it cannot fit."""
    if tuple(expr_shape) == tuple(param_shape):
        return None
    size = int(np.prod(expr_shape))
    if len(expr_shape) != len(param_shape) and size == int(np.prod(param_shape)):
        return tuple(param_shape)
    hint = (f"; did you mean {expr}.T?" if expr.name and not expr.transpose and len(expr_shape) == 2
            and tuple(expr_shape[::-1]) == tuple(param_shape) else "")
    raise ImplementationFailure(f"weight {path} of the module is {list(param_shape)}, but {expr} is {list(expr_shape)}"
                                + hint)


def expression_shape(expr: Expr, shapes: dict) -> tuple:
    """The shape of ``expr`` on tensors of ``shapes``."""
    return tuple(expr.evaluate({t: np.empty(s) for t, s in shapes.items()}, lambda a: np.swapaxes(a, -1, -2),
                               lambda parts: np.concatenate(parts, 0)).shape)

"""The identity stage, which every stage extends (the package docstring says what each method means)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .... import masks
from ...registry import Fault, Param

#: Every slice of a grid: the whole score matrix.
ALL = slice(None)


class Stage:
    """An elementwise map of the scores (module docstring). Subclasses override what differs from the identity.
    A stage with a parameter whose gradient is checked (an additive bias) names it ``param`` (the input's name)
    and gives its ``values``, the same stage with them replaced (``moved``: perturbed copies carry extra leading
    axes), the gradient of a block of them from the gradient at its output (``param_grad``) and how block
    gradients add up (``param_add``)."""
    name = "identity"
    param: str | None = None
    param_kwarg: str | None = None  # the keyword a user's code is passed the parameter's values as
    #: keyword arguments whose first axis is the batch's (a bias [B|1, ...]): stacked with the inputs' copies
    batched_kwargs: tuple[str, ...] = ()
    #: the keyword arguments passed in the inputs' dtype (a bias); the others' arrays in float64 or float32
    input_dtype_kwargs: tuple[str, ...] = ()
    #: a stage that joins each row's normaliser (a sink's logit, :meth:`logits`) instead of mapping the scores
    normaliser = False
    #: a stage that weights the softmax's output (dropout's keep mask, ``weights``) instead of mapping the scores
    post_softmax = False

    def logits(self):
        """A normaliser stage's logit per query head, [..., Hq] (perturbed copies first); None for the others."""
        return None

    def values(self):
        return None

    def moved(self, x):
        return self

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return None

    def param_add(self, total, block, rows=ALL, cols=ALL):
        total[..., rows, cols] += block

    def param_terms(self, t, rows=ALL, cols=ALL, power: int = 1):
        """The size of the terms of the parameter's gradient on a block from ``t``, those of the gradient at the
        stage's output (``power`` 2: their squares): :meth:`param_grad` where it only adds them up."""
        return self.param_grad(t, None, rows, cols)

    def lead(self) -> tuple:
        """The leading axes of the parameter's values before the query rows and keys (perturbed copies, then its
        [B|1, H|1]): what a block of its values broadcasts the scores to."""
        return self.values().shape[:-2]

    def block_index(self) -> np.ndarray:
        """The block of the output each entry of the parameter moves alone, as an index per entry (the rounding
        model's ``Blocks``): a score-shaped parameter's entries of one (b, h, i) move row i of O in the batch
        elements and heads it is broadcast over."""
        shape = self.values().shape
        return np.broadcast_to(np.arange(int(np.prod(shape[:-1]))).reshape(shape[:-1] + (1,)), shape)

    def block_sums(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` [..., B, Hq, n_q] (terms of L summed over each row of O) summed by :meth:`block_index`'s
        blocks -> [..., P]."""
        shape, first = self.values().shape, rows.ndim - 3
        axes = tuple(first + i for i in range(2) if shape[-4 + i] == 1 and rows.shape[first + i] != 1)
        return (rows.sum(axis=axes, keepdims=True) if axes else rows).reshape(rows.shape[:-3] + (-1,))

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return s

    def slope(self, s, rows=ALL, cols=ALL, xp=np):
        return None

    def bend(self, s, rows=ALL, cols=ALL, xp=np):
        return None

    def error(self, size, s, rows=ALL, cols=ALL):
        return size

    def slope_size(self, s, size, rows=ALL, cols=ALL):
        return None

    def bound(self, b: float) -> float:
        return b

    @property
    def kwargs(self) -> dict:
        return {}

    @property
    def label(self) -> str:
        return self.name

    @property
    def key(self) -> tuple:
        """What tells this stage from another of its kind exactly (its values, not a rounded label): the key of a
        compiled program that holds it."""
        return (type(self).__name__, self.label)


@dataclass(frozen=True)
class Registration:
    """One stage module as the op sees it: its scenario key, how a scenario makes the stage, its faults and
    each fault's wrong stage (``wrong[fault](stage, visible) -> (stage, visible the softmax uses)``)."""
    key: str
    param: Param
    make: Callable[[Any], Stage | None]
    faults: Mapping[str, Fault]
    wrong: Mapping[str, Callable]
    backward_only: tuple[str, ...] = ()  # faults whose wrong stage only the backward uses (it recomputes the scores)
    applies: Callable[[Any, str], str | None] | None = None  # why a fault cannot apply to a scenario (None: it can)
    validate: Callable[[dict, dict], list] | None = None  # (key, message, hint) for values wrong together (Op.validate)
    passes: str = ""  # what a user's code is passed, for ``attn-gradcheck ops`` (``softcap=``)
    normaliser: bool = False  # joins the softmax's normaliser (sinks): always last, not in the ``stages:`` order
    #: known mistakes of the stage's backward (no CLI switch): name -> (what it gets wrong, stage -> the wrong stage
    #: the backward then uses), candidate causes of a failed check (``hints.known``)
    mistakes: Mapping[str, tuple[str, Callable]] = field(default_factory=dict)
    #: known mistakes of the stage's forward: name -> (what it gets wrong, (stage, scenario) -> the wrong stage, or
    #: None where the mistake changes nothing in that scenario), named when a user's O equals that forward's
    forward_mistakes: Mapping[str, tuple[str, Callable]] = field(default_factory=dict)


#: What the stages do not cover yet (``attn-gradcheck ops`` lists it; ``gradient_limits`` refuses a scenario that
#: asks for it, with its key).
LIMITS = ("a stage parameter's gradient (bias.grad, relative_bias.grad, alibi.grad, sinks.grad) is checked in "
          "float64 and float32, on the NumPy engines and your NumPy, torch and JAX code: not yet on the torch closed "
          "forms, in half precision, or along check.mode jvp / hvp (the stages themselves are)",
          "the variants apply to op attention: not yet to attention-projections or block")


def gradient_limits(key: str, what: str, attention: dict) -> list:
    """(key, message, hint) where the gradient of a stage's parameter (``what``: "the bias") is not built yet: the
    JVP/HVP along it, the torch closed forms, half precision (``Registration.validate`` of a stage with one)."""
    mode, fix = attention["mode"], f"set {key}.grad: false (it is then fixed)"
    if mode in ("jvp", "hvp"):
        return [(f"{key}.grad", f"the {mode.upper()} along {what} is not built: check.mode {mode} takes {what} "
                                "without its gradient", f"{fix} for this scenario")]
    if attention["backend"] == "torch" and not attention["implementation"]:
        return [(f"{key}.grad", f"the gradient of {what} runs on the NumPy engines (naive, tiled) and NumPy, torch and "
                                "JAX implementations for now, not the torch closed forms", f"{fix}, or backend: numpy")]
    if attention["dtype"] in ("float16", "bfloat16"):
        return [(f"{key}.grad", f"the gradient of {what} is checked in float64 and float32, not {attention['dtype']} "
                                "yet", f"{fix}, or dtype: float32")]
    return []


def positions(n_q: int, n_k: int, offset: bool = True, documents=None) -> tuple[np.ndarray, np.ndarray]:
    """(each query's position, each key's) for the stages whose values depend on them (ALiBi, T5's buckets): a
    query at its lower-right aligned diagonal, i + n_k - n_q (i without the ``offset``), a key at j. In a packed
    batch (``documents``: (query lengths, key lengths)) each document's own, as FlashAttention's varlen takes
    them: query i' of a document of L_q queries and L_k keys at i' + L_k - L_q, key j' at j'."""
    i, j = np.arange(n_q), np.arange(n_k)
    if documents is None:
        return i + (n_k - n_q if offset else 0), j
    dq, q0, k0, lq, lk = masks.document_layout(n_q, documents)
    dk = masks.document_of(n_k, documents, keys=True)
    return i - q0[dq] + ((lk - lq)[dq] if offset else 0), j - k0[dk]


def added(s, b, xp=np):
    """s + b, b a block of a stage's values (NumPy, or a torch tensor: a leaf of autograd, the plain peer's) in
    ``xp`` beside s, in s's dtype (on its device)."""
    if xp is np:
        return s + b.astype(s.dtype, copy=False)
    if xp.__name__ == "torch":
        return s + (b.to(s.dtype) if isinstance(b, xp.Tensor) else xp.as_tensor(b, dtype=s.dtype, device=s.device))
    return s + xp.asarray(b, dtype=s.dtype)


def block(visible, rows, cols, like, xp=np):
    """The visible set's block (``visible`` an array [B, Hq, n_q, n_k] or a callable ``visible(rows, cols)``), as
    an array of ``xp`` beside ``like`` (a torch tensor goes to its device)."""
    vis = visible(rows, cols) if callable(visible) else visible[..., rows, cols]
    if xp is np:
        return vis
    if hasattr(like, "device") and xp.__name__ == "torch":
        return xp.as_tensor(np.ascontiguousarray(vis), device=like.device)
    return xp.asarray(vis)

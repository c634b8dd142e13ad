"""Modules users put in models."""
import math
from typing import Optional

import torch
from torch import nn

from . import _checks, _recompute, _traced
from ._ops.sharding import is_dtensor
from .cake_rmsnorm_train import cake_rmsnorm


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm`` on the fused cakeops kernels: the same arguments, defaults, parameter
    and state dict (``load_state_dict`` works both ways).

    ``normalized_shape``: the hidden size, an int or a 1-tuple (the last dim; cakeops normalizes one dim).
    ``eps``: None takes torch's default, ``torch.finfo(x.dtype).eps`` of each input. ``elementwise_affine=False``:
    no weight (the kernels then scale by ones). ``forward(x)`` returns ``y``; ``forward(x, residual)`` adds first
    and returns ``(y, h_new)`` with ``h_new = x + residual`` -- the pre-norm transformer's residual stream, in one
    pass over memory. ``deterministic``: the weight gradient's reduction (fixed order, or atomics when False).
    """

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True, *,
                 deterministic: bool = True, device=None, dtype=None):
        super().__init__()
        if not isinstance(normalized_shape, (int, tuple, list, torch.Size)):
            raise ValueError(f"normalized_shape: expected the hidden size, an int >= 1, got {normalized_shape!r}")
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise NotImplementedError(f"normalized_shape: cakeops normalizes the last dim only, got "
                                      f"{normalized_shape!r}; reshape the input so the normalized dims are one, or "
                                      f"use torch.nn.RMSNorm")
        if isinstance(shape[0], bool) or not isinstance(shape[0], int) or shape[0] < 1:
            raise ValueError(f"normalized_shape: expected the hidden size, an int >= 1, got {normalized_shape!r}")
        if eps is not None:
            eps = _checks.positive_float("eps", eps)
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.deterministic = deterministic
        self._ones = {}  # the no-weight form's scale, per (device, dtype) of the input: see _unit_weight
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        """The weight to ones, as torch.nn.RMSNorm's (e.g. after ``to_empty`` of a model built on the meta device;
        FSDP2-sharded weights too); nothing without a weight."""
        if self.weight is not None:
            with torch.no_grad():
                nn.init.ones_(self.weight)

    def _unit_weight(self, x: torch.Tensor) -> torch.Tensor:
        """Ones for the no-weight form, made for the input's device and dtype. Not a buffer: a buffer built on the
        meta device stays there through ``load_state_dict(assign=True)`` (no state to load) and holds whatever the
        memory held after ``to_empty``."""
        if _traced.through_ops():  # traced, or fake / watched under a mode: made in place, never cached
            return torch.ones(self.normalized_shape, device=x.device, dtype=x.dtype)
        if is_dtensor(x):  # as a replicated parameter would be
            from torch.distributed.tensor import DTensor, Replicate

            ones = torch.ones(self.normalized_shape, device=x.device, dtype=x.dtype)
            return DTensor.from_local(ones, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
        key = (x.device, x.dtype)
        if key not in self._ones:
            self._ones[key] = torch.ones(self.normalized_shape, device=x.device, dtype=x.dtype)
        return self._ones[key]

    @property
    def hidden_size(self) -> int:
        return self.normalized_shape[0]

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.normalized_shape[0]:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"RMSNorm: expected an input [..., {self.normalized_shape[0]}] (normalized_shape), "
                             f"got {got}; build it with the input's last dim as normalized_shape")
        eps = self.eps
        if eps is None:  # torch's default; a non-float x gets cake_rmsnorm's dtype error, not torch.finfo's
            eps = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 1e-6
        w = self.weight if self.weight is not None else self._unit_weight(x)
        return cake_rmsnorm(x, w, eps, residual, self.deterministic)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"deterministic={self.deterministic}")


class _Mapping(nn.Module):
    """A module owning an mHC mapping (``fn``, ``scale``, ``base``), which ``keep_fp32_mapping`` keeps FP32 through
    model casts."""

    keep_fp32_mapping = False

    def _own_mapping(self, logits: int, groups: int, width: int, device, dtype) -> None:
        """The parameters fn [logits, width], scale [groups], base [logits] (FP32 unless ``dtype``), initialised by
        the module's ``reset_parameters``."""
        like = dict(device=device, dtype=dtype or torch.float32)
        self.fn = nn.Parameter(torch.empty(logits, width, **like))
        self.scale = nn.Parameter(torch.empty(groups, **like))
        self.base = nn.Parameter(torch.empty(logits, **like))
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        if not self.keep_fp32_mapping or getattr(self, "fn", None) is None:
            return super()._apply(fn, recurse)
        mapping = (self.fn, self.scale, self.base)
        before = [p.data for p in mapping]
        super()._apply(fn, recurse)
        for p, old in zip(mapping, before):
            if p.dtype != old.dtype:  # a cast: keep the FP32 values (not re-widened rounded ones), follow the device
                p.data = old.to(p.device)
        return self


class MHC(_Mapping):
    """One mHC layer around a branch: ``X [..., n, C] -> [..., n, C]`` = prepare -> ``branch(U)`` -> finish.

    ``n_streams``: n, 2, 4 or 8 (other n raise NotImplementedError here, at construction).
    Owns the mapping ``fn [2n + n*n, n*C]``, the group ``scale [3]`` and ``base [2n + n*n]`` (FP32 parameters).
    Initialised so the layer starts as a plain residual block: group scales 0.01 (the projection barely moves
    the logits), pre gates at 1/n (U is the mean of the streams), post gates at 1 (every stream receives the
    branch output) and a mixing matrix near the identity (diagonal logits 4).
    The branch sees ``U`` with the leading dims of X: ``[..., C]``.

    Arguments are checked here, at construction: ``hidden_size`` an int >= 1, ``sinkhorn_iters`` an int in 1..64,
    ``rms_eps`` / ``hc_eps`` finite floats > 0, the flags bools. ``dtype``: the mapping's dtype (FP32 by default).

    Mixed precision: the mapping may be cast with the model (``model.to(torch.bfloat16)``, FSDP2's
    ``MixedPrecisionPolicy``); the ops compute in FP32 whatever its dtype and return its gradients in its dtype.
    ``keep_fp32_mapping=True`` keeps fn, scale and base FP32 through ``model.to(dtype)`` / ``.half()`` /
    ``.bfloat16()`` (a cast of the model leaves their values and dtype alone, a move takes them along), for
    optimizers that should update FP32 mapping weights -- bf16 storage rounds ``base``'s logit offsets (~4) to
    steps of 1/32. An FSDP2 policy casts the compute copy only, so there the sharded FP32 parameters stay FP32
    without the flag.
    """

    def __init__(self, branch: nn.Module, hidden_size: int, n_streams: int = 4, *, sinkhorn_iters: int = 20,
                 rms_eps: float = 1e-5, hc_eps: float = 1e-6, deterministic: bool = True, save_stats: bool = True,
                 keep_fp32_mapping: bool = False, device=None, dtype=None):
        super().__init__()
        from . import _mhc_args
        from .meta import mhc_layout as layout

        _mhc_args.n_streams("n_streams", n_streams)
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1 (C, the width of each stream), got {hidden_size!r}")
        if not callable(branch):
            raise TypeError(f"branch: expected an nn.Module (or a callable) mapping [..., C] to [..., C], "
                            f"got {type(branch).__name__}")
        n, C = n_streams, hidden_size
        self.branch = branch
        self.hidden_size, self.n_streams = C, n
        self.rms_eps, self.hc_eps, self.sinkhorn_iters = _mhc_args.hparams(rms_eps, hc_eps, sinkhorn_iters)
        self.deterministic = _mhc_args.flag("deterministic", deterministic)
        self.save_stats = _mhc_args.flag("save_stats", save_stats)
        self.keep_fp32_mapping = _mhc_args.flag("keep_fp32_mapping", keep_fp32_mapping)
        self._recompute = None  # the stream-recompute plan shared with its group's layers (recompute_mhc)
        self._own_mapping(layout.n_logits(n), 3, n * C, device, dtype)

    def reset_parameters(self) -> None:
        """The mapping's start, as built: fn ~ N(0, 1/(n*C)), group scales 0.01, ``base`` for pre gates 1/n, post
        gates 1 and a mixing matrix near the identity. For models built on the meta device (``to_empty``, then
        this), FSDP2-sharded parameters included; the branch keeps its own parameters."""
        n = self.n_streams
        base = torch.zeros(self.base.shape, device=self.base.device)
        base[:n] = -math.log(n - 1)  # sigmoid(.) = 1/n
        base[2 * n:] = 4.0 * torch.eye(n, device=base.device).reshape(-1)  # post logits stay 0: 2*sigmoid(0) = 1
        with torch.no_grad():
            nn.init.normal_(self.fn, std=(n * self.hidden_size) ** -0.5)
            nn.init.constant_(self.scale, 0.01)
            _copy_whole(self.base, base)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        from .cake_mhc_train import _prepare, cake_mhc_train_finish

        n, C = self.n_streams, self.hidden_size
        if not isinstance(X, torch.Tensor) or X.dim() < 3 or tuple(X.shape[-2:]) != (n, C):
            got = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            hint = ""
            if isinstance(X, torch.Tensor) and X.dim() >= 3 and X.shape[-1] == C and X.shape[-2] != n:
                hint = (f"; if its dim -2 holds {X.shape[-2]} residual streams, this MHC was built for "
                        f"n_streams={n} (build it with n_streams={X.shape[-2]}); if {got} is a hidden state "
                        f"[..., {C}] not yet widened, widen it first with cakeops.nn.StreamExpand({n})")
            elif isinstance(X, torch.Tensor) and X.dim() >= 1 and X.shape[-1] == C:
                hint = f"; widen the stream first with cakeops.nn.StreamExpand({n})"
            elif isinstance(X, torch.Tensor) and X.dim() >= 3 and X.shape[-2] == n:
                hint = (f"; its hidden size {X.shape[-1]} is not the hidden_size={C} this MHC was built with "
                        f"(build it with hidden_size={X.shape[-1]}, or check what feeds it)")
            raise ValueError(f"MHC: expected the residual streams [..., {n}, {C}] (n_streams, hidden_size), "
                             f"got {got}{hint}")
        plan = self._recompute
        U, handle = _prepare(X, self.fn, self.scale, self.base, self.rms_eps, self.hc_eps, self.sinkhorn_iters,
                             self.save_stats, None, None, self.deterministic, recompute=plan)
        B = self.branch(U)
        if not isinstance(B, torch.Tensor) or B.shape != U.shape:
            got = tuple(B.shape) if isinstance(B, torch.Tensor) else type(B).__name__
            raise ValueError(f"MHC: the branch must map [..., {C}] to [..., {C}]: given {tuple(U.shape)}, "
                             f"it returned {got}")
        if B.dtype not in _checks.FLOAT_DTYPES:  # (another float dtype than U's is fine: autocast's bf16 branch)
            raise ValueError(f"MHC: the branch must return bfloat16, float16 or float32: given {_dtype(U)}, it "
                             f"returned {_dtype(B)}; cast its output (or the model) to one of them")
        return cake_mhc_train_finish(X, B, handle)  # X's shape, not a view: FSDP2 hooks a module's outputs

    @property
    def recompute_group(self) -> int:
        """The stream-recompute group size set by ``recompute_mhc`` (1: the layer keeps its streams)."""
        return 1 if self._recompute is None else self._recompute.group_size

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, n_streams={self.n_streams}, sinkhorn_iters={self.sinkhorn_iters}, "
                f"rms_eps={self.rms_eps}, hc_eps={self.hc_eps}" + _flags(self, deterministic=True, save_stats=True,
                                                                         keep_fp32_mapping=False, recompute_group=1))


def default_group_size(n_streams: int, n_layers: Optional[int] = None) -> int:
    """``recompute_mhc``'s group size where none is given: n + 2 layers (6 at n = 4); where ``n_layers`` is known,
    the groups that asks for share the layers evenly (8 layers at n = 4: two groups of 4; design.md §6)."""
    return _recompute.default_group_size(n_streams, n_layers)


def recompute_mhc(module: nn.Module, group_size: Optional[int] = None) -> nn.Module:
    """Stream recompute (DeepSeek's mHC paper, §4.3.2): the ``MHC`` layers inside ``module`` (itself included)
    keep their residual streams for the backward only once per group of ``group_size`` consecutive layers, in
    forward order; the backward rebuilds the others' streams with the mHC kernels alone (never the branch),
    bit-identical to the forward, so gradients are bitwise those without it. Each layer still keeps its branch
    output and its per-token record; a group that starts at the output of a ``StreamExpand`` inside ``module``
    keeps StreamExpand's input h (the n streams are n copies of it) instead. Returns ``module``.

    ``group_size``: an int >= 1; None takes n + 2 layers (6 at n = 4), the groups sharing the L layers found evenly
    (8 layers: two groups of 4; design.md §6 has the trade-off); 1 turns recompute off again (every layer keeps its
    own streams). Shown in each layer's repr.
    A group followed in the forward by at least as many layers as its own rebuilds all its layers' streams in one
    pass when its backward starts; the last groups, whose backward runs at the step's peak, one layer at a time.

    Groups form at run time: a layer joins its predecessor's group only when its input is that layer's output,
    unchanged, so a group never spans a pipeline-stage boundary or any op between layers. Layers inside
    ``torch.utils.checkpoint`` (or other saved-tensor hooks) keep their streams through the checkpoint, which
    already keeps only its region's input. Groups may span FSDP2 units and DDP buckets: the rebuild reads no
    parameter. Under ``torch.compile`` (and dispatch modes) the same groups form along the traced graph's data
    flow and the compiled backward rebuilds the streams (``cakeops::mhc_rebuild``; the gradients of the model
    compiled without recompute, bit for bit in Inductor's deterministic mode, ``torch._inductor.config.deterministic
    = True``: outside it Inductor picks some kernel configurations by timing, and any two compiles may differ in the
    last bits); with DTensor streams the layers keep their streams, with the same gradients. Eager, a second
    backward through one graph (``retain_graph=True``) raises; turn recompute off for that (compiled, it works).

    >>> blocks = torch.nn.Sequential(*(MHC(torch.nn.Linear(32, 32), 32) for _ in range(12)))
    >>> recompute_mhc(blocks)[0].recompute_group
    6
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module holding cakeops.nn.MHC layers, got {type(module).__name__}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise TypeError(f"group_size: expected an int >= 1 or None (the default, n + 2 layers), got "
                        f"{type(group_size).__name__}")
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1 (1 turns recompute off) or None, got {group_size}")
    layers = [m for m in module.modules() if isinstance(m, MHC)]
    if not layers:
        raise ValueError(f"module: {type(module).__name__} holds no cakeops.nn.MHC layer; recompute_mhc rebuilds "
                         f"the residual streams of MHC layers (pass the model that contains them)")
    if group_size is None:
        group_size = default_group_size(layers[0].n_streams, len(layers))
    plan = None if group_size == 1 else StreamRecompute(group_size)
    for layer in layers:
        layer._recompute = plan
    for expand in (m for m in module.modules() if isinstance(m, StreamExpand)):
        expand._recompute = plan is not None
    return module


class StreamRecompute(_recompute.RecomputePlan):
    """Stream recompute for the functional API: one object shared by consecutive mHC layers, given as
    ``recompute=`` to each layer's ``cake_mhc_train_prepare`` (and to ``stream_expand`` where the streams are
    made), does what ``recompute_mhc`` does for ``MHC`` modules: groups of at most ``group_size`` consecutive
    layers (a layer joins when its X is the previous layer's finish output, unchanged) keep only the group's first
    input X -- or StreamExpand's h -- plus each layer's branch output and record; the backward rebuilds the other
    streams with the mHC kernels alone, bitwise, so gradients equal those without it bit for bit. Eager and
    compiled alike (the custom ops form the same groups along the traced graph).

    ``group_size``: an int >= 2 (1 would keep every layer's streams: pass no object instead); ``recompute_mhc``
    takes n + 2 layers by default (6 at n = 4), a good choice here too.

    >>> plan = StreamRecompute(4)
    >>> X = stream_expand(torch.randn(3, 32, requires_grad=True), 4, recompute=plan)
    >>> from cakeops.cake_mhc_train import cake_mhc_train_prepare, cake_mhc_train_finish
    >>> fn, scale, base = torch.randn(24, 128) * 0.1, torch.ones(3), torch.zeros(24)
    >>> U, handle = cake_mhc_train_prepare(X, fn, scale, base, recompute=plan)
    >>> cake_mhc_train_finish(X, torch.tanh(U), handle).shape
    torch.Size([3, 4, 32])
    """

    def __init__(self, group_size: int = 4):
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size: expected an int >= 2, got {type(group_size).__name__}")
        if group_size < 2:
            raise ValueError(f"group_size: expected an int >= 2 (a group of 1 keeps every layer's streams: give "
                             f"no StreamRecompute instead), got {group_size}")
        super().__init__(group_size)

    def __repr__(self) -> str:
        return f"StreamRecompute(group_size={self.group_size})"


def _copy_whole(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.copy_(value)`` for a whole-parameter ``value``, also when ``param`` is a DTensor (FSDP2 shards):
    every rank computes the same ``value`` and keeps its own shard of it (no communication)."""
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def _flags(module, **defaults) -> str:
    """", name=value" for each flag that differs from its default (a repr shows what was chosen)."""
    return "".join(f", {k}={getattr(module, k)}" for k, default in defaults.items() if getattr(module, k) != default)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


class StreamExpand(nn.Module):
    """``[..., C] -> [..., n, C]``: the embedding copied into n residual streams (backward: the sum over streams).
    ``n_streams``: 2, 4 or 8, the mHC layers' n (others raise NotImplementedError at construction)."""

    def __init__(self, n_streams: int = 4):
        super().__init__()
        from . import _mhc_args

        self.n_streams = _mhc_args.n_streams("n_streams", n_streams)
        self._recompute = False  # set by recompute_mhc: the first group's streams are rebuilt from h

    def extra_repr(self) -> str:
        return f"n_streams={self.n_streams}"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _expand(h, self.n_streams, getattr(self, "_recompute", False))


def stream_expand(h: torch.Tensor, n_streams: int = 4, *, recompute: Optional["StreamRecompute"] = None
                  ) -> torch.Tensor:
    """``[..., C] -> [..., n, C]``: ``StreamExpand`` as a function, h copied into ``n_streams`` (2, 4 or 8)
    contiguous residual streams (backward: the sum over the streams).

    ``recompute``: the ``StreamRecompute`` given to the mHC layers' ``cake_mhc_train_prepare``; with it the first
    group of stream recompute is rooted here: it keeps h (C values per token) instead of the n streams, and the
    backward rebuilds the first layer's streams from h too (the same bits). Eager and under torch.compile (the
    ``cakeops::stream_expand`` custom op) alike. Without it (None) a plain copy, as ``h.unsqueeze(-2).expand(...)
    .contiguous()``.

    >>> stream_expand(torch.randn(2, 5, 32), 4).shape
    torch.Size([2, 5, 4, 32])
    """
    from . import _mhc_args

    n = _mhc_args.n_streams("n_streams", n_streams)
    if recompute is not None and not isinstance(recompute, _recompute.RecomputePlan):
        raise TypeError(f"recompute: expected the cakeops.nn.StreamRecompute of the mHC layers (or None), got "
                        f"{type(recompute).__name__}")
    return _expand(h, n, recompute is not None, "stream_expand")


def _expand(h: torch.Tensor, n: int, rooted: bool, who: str = "StreamExpand") -> torch.Tensor:
    if not isinstance(h, torch.Tensor) or h.dim() < 1:
        got = f"shape {tuple(h.shape)}" if isinstance(h, torch.Tensor) else type(h).__name__
        raise ValueError(f"{who}: expected a hidden state [..., C] (at least 1 dim) to copy into the "
                         f"{n} residual streams, got {got}")
    rooting = rooted and torch.is_grad_enabled()
    # compiled / dispatch modes: the op notes its output for the ops' groups (DTensor layers keep their
    # streams: the op has no sharding rule, so a DTensor h takes the plain path)
    if rooting and _traced.through_ops() and not is_dtensor(h):
        return torch.ops.cakeops.stream_expand(h, n)
    X = _recompute.stream_copies(h, n).contiguous()
    if rooting:
        _recompute.expanded.note(X, h)
    return X


class MHCHead(_Mapping):
    """``[..., n, C] -> [..., C]``: the model's final collapse of the residual streams.

    ``gated=False`` (the default, ``MHCHead()``): the mean of the streams (cakeops head op), no parameters, no
    other argument needed. ``gated=True``: DeepSeek-V4's hc_head, ``Y = sum_i g_i * X_i`` with per-token gates
    ``g_i = sigmoid(rstd * (fn_i . x) * scale + base_i) + hc_eps`` (``x`` the token's n streams flattened,
    ``rstd = 1/sqrt(mean(x^2) + rms_eps)``; cakeops.cake_mhc_train.cake_mhc_train_gated_head). It then needs
    ``hidden_size`` (C) and owns the parameters ``fn [n, n*C]``, ``scale [1]`` and ``base [n]``, initialised so
    the head starts as (nearly) the plain mean: fn ~ N(0, 1/(n*C)), scale 0.01 (the projection barely moves the
    gates) and base = -log(n - 1), so every gate starts at sigmoid(base) + hc_eps = 1/n + hc_eps.
    ``n_streams``: 2, 4 or 8 (checked at construction; others raise NotImplementedError); None (the default)
    lets the plain head take n from each input and gives the gated head 4. ``rms_eps``, ``hc_eps`` finite floats
    > 0; ``deterministic=False`` sums the parameter gradients with atomics. ``dtype``: the parameters' dtype (FP32
    by default; the math is FP32 either way and their gradients come back in their dtype). ``keep_fp32_mapping``:
    fn, scale and base stay FP32 through ``model.to(dtype)`` / ``.half()`` / ``.bfloat16()``, as ``MHC``'s (bf16
    would round base's -log(3) to -1.1016).
    """

    def __init__(self, n_streams: Optional[int] = None, *, gated: bool = False, hidden_size: Optional[int] = None,
                 rms_eps: float = 1e-5, hc_eps: float = 1e-6, deterministic: bool = True,
                 keep_fp32_mapping: bool = False, device=None, dtype=None):
        super().__init__()
        from . import _mhc_args

        if not isinstance(gated, bool):
            raise TypeError(f"gated: expected a bool, got {type(gated).__name__}")
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
        self.gated = gated
        self.deterministic = deterministic
        self.n_streams = None if n_streams is None else _mhc_args.n_streams("n_streams", n_streams)
        keep_fp32_mapping = _mhc_args.flag("keep_fp32_mapping", keep_fp32_mapping)
        if not gated:
            for name, given in (("hidden_size", hidden_size is not None), ("keep_fp32_mapping", keep_fp32_mapping)):
                if given:
                    raise ValueError(f"{name}: the plain head (gated=False) has no parameters and takes no "
                                     f"{name}; pass gated=True for the gated head, or leave {name} out")
            return
        self.keep_fp32_mapping = keep_fp32_mapping
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: the gated head needs the hidden size C, an int >= 1, got {hidden_size!r}")
        self.rms_eps = _checks.positive_float("rms_eps", rms_eps)
        self.hc_eps = _checks.positive_float("hc_eps", hc_eps)
        n, C = self.n_streams or 4, hidden_size
        self.hidden_size, self.n_streams = C, n
        self._own_mapping(n, 1, n * C, device, dtype)

    def reset_parameters(self) -> None:
        """The gated head's start, as built (fn ~ N(0, 1/(n*C)), scale 0.01, base -log(n - 1)); nothing for the
        plain head. For models built on the meta device (``to_empty``, then this), FSDP2-sharded parameters
        included."""
        if not self.gated:
            return
        with torch.no_grad():
            nn.init.normal_(self.fn, std=(self.n_streams * self.hidden_size) ** -0.5)
            nn.init.constant_(self.scale, 0.01)
            nn.init.constant_(self.base, -math.log(self.n_streams - 1))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        from .cake_mhc_train import cake_mhc_train_gated_head, cake_mhc_train_head

        if not self.gated:
            n = self.n_streams
            if n is not None and isinstance(X, torch.Tensor) and X.dim() >= 3 and X.shape[-2] != n:
                raise ValueError(f"MHCHead: expected the residual streams [..., {n}, C] (n_streams), "
                                 f"got {tuple(X.shape)}")
            return cake_mhc_train_head(X)  # [..., C], the op's own output, not a view (FSDP2 hooks module outputs)
        n, C = self.n_streams, self.hidden_size
        if not isinstance(X, torch.Tensor) or X.dim() < 3 or tuple(X.shape[-2:]) != (n, C):
            got = tuple(X.shape) if isinstance(X, torch.Tensor) else type(X).__name__
            hint = ""
            if isinstance(X, torch.Tensor) and X.dim() >= 3:
                wrong = [f"{k}={v} (the input has {w})" for k, v, w in
                         (("n_streams", n, X.shape[-2]), ("hidden_size", C, X.shape[-1])) if v != w]
                hint = f"; this head was built with {' and '.join(wrong)}: build it to match the model's streams"
            raise ValueError(f"MHCHead: expected the residual streams [..., {n}, {C}] (n_streams, hidden_size), "
                             f"got {got}{hint}")
        return cake_mhc_train_gated_head(X, self.fn, self.scale, self.base, rms_eps=self.rms_eps,
                                         hc_eps=self.hc_eps, deterministic=self.deterministic)

    def extra_repr(self) -> str:
        if not self.gated:
            return "" if self.n_streams is None else f"n_streams={self.n_streams}"
        return (f"gated=True, hidden_size={self.hidden_size}, n_streams={self.n_streams}, rms_eps={self.rms_eps}, "
                f"hc_eps={self.hc_eps}" + _flags(self, deterministic=True, keep_fp32_mapping=False))

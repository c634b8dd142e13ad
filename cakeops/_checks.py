"""Argument checks shared by the public functions: errors name the argument and what was expected."""
import math
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def tensor(name: str, t, *, dtypes: Optional[Iterable[torch.dtype]] = None, ndim: Optional[int] = None,
           min_ndim: Optional[int] = None, shape: Optional[Sequence[int]] = None,
           device: Optional[torch.device] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            hint = ""
            if t.dtype == torch.float64 and torch.float32 in dtypes:  # a model.double(): say what to do
                hint = "; float64 is not supported (the math is FP32 inside): cast it with .float()"
            raise ValueError(f"{name}: expected dtype in ({names}), got {str(t.dtype).replace('torch.', '')}{hint}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def positive_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    v = float(v)
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) a float argument is symbolic, and a
    # comparison becomes a guard on its value where math.isfinite cannot be traced (NaN fails both comparisons)
    if not 0.0 < v < math.inf:
        raise ValueError(f"{name}: expected a finite value > 0, got {v}")
    return v


def same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (the device of {ref_name}), got {t.device}")


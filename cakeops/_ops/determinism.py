"""Honour ``torch.use_deterministic_algorithms`` the way PyTorch's own ops do."""
import warnings

import torch

_warned = set()


def alert_not_deterministic(what: str) -> None:
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (f"{what} uses atomic adds and is not deterministic, but torch.use_deterministic_algorithms(True) "
               "is set; pass deterministic=True for a fixed-order reduction.")
    if torch.is_deterministic_algorithms_warn_only_enabled():
        if what not in _warned:
            _warned.add(what)
            warnings.warn(message, UserWarning, stacklevel=3)
        return
    raise RuntimeError(message)

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


# ---------------------------------------------------------------------------------------------
# FlashInfer 0.7.4's ``deterministic=`` keyword on the public entry points
# ---------------------------------------------------------------------------------------------
_fallback_warned = False


def _nondeterministic_requested(deterministic, entry: str) -> bool:
    """deterministic is False (a bool: TypeError otherwise)."""
    if deterministic is True:
        return False
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool ({entry}), got {type(deterministic).__name__}")
    return True


def resolve_deterministic(deterministic, entry: str) -> bool:
    """The mode an mHC entry point runs (``flashinfer.experimental.cake.cake_mhc_train``'s rule): ``deterministic``
    must be a bool (TypeError otherwise); True runs the deterministic path; False runs the non-deterministic one,
    except while ``torch.use_deterministic_algorithms(True)`` is in effect: then the call runs the deterministic
    path and a UserWarning says so, once per process (for every entry point together, as FlashInfer's).

    The common call (``deterministic=True``) costs one type check. Only the public functions resolve: the ops'
    own check (``alert_not_deterministic``) still raises for a non-deterministic backward that runs under the
    deterministic algorithms, e.g. the backward of a layer prepared with deterministic=False before they were
    enabled."""
    global _fallback_warned
    if not _nondeterministic_requested(deterministic, entry):
        return True
    if not torch.are_deterministic_algorithms_enabled():
        return False
    if not _fallback_warned:
        _fallback_warned = True
        warnings.warn(f"{entry}: deterministic=False runs the deterministic path because torch's deterministic "
                      "algorithms are enabled (torch.use_deterministic_algorithms(True)); this warning is shown "
                      "once", UserWarning, stacklevel=3)
    return True


def refuse_nondeterministic(deterministic, entry: str, fallback: str) -> bool:
    """The mode an RMSNorm entry point runs (``flashinfer.cake_rmsnorm_train``'s rule, stricter than mHC's):
    ``deterministic`` must be a bool; False while ``torch.use_deterministic_algorithms(True)`` is in effect raises
    RuntimeError, or with ``warn_only=True`` warns (once per entry point) and runs the deterministic path
    (``fallback`` says what runs). Returns the deterministic flag to run with."""
    if not _nondeterministic_requested(deterministic, entry):
        return True
    if not torch.are_deterministic_algorithms_enabled():
        return False
    message = (f"{entry}(deterministic=False) sums the weight gradient with atomics, in a scheduling-dependent "
               "order, but torch.use_deterministic_algorithms(True) is in effect; call it with deterministic=True")
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise RuntimeError(message)
    if entry not in _warned:
        _warned.add(entry)
        warnings.warn(f"{message}; running {fallback}", UserWarning, stacklevel=3)
    return True

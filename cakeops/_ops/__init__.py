"""torch.library custom ops of cakeops (namespace ``cakeops``); importing registers them all."""
from . import mhc, mhc_gated_head, mhc_recompute, rmsnorm  # noqa: F401
from . import flops  # noqa: F401  (its FLOP formulas, registered when a call meets a dispatch mode)
from . import inductor
from .inductor import register_fallbacks_if_inductor_loaded

register_fallbacks_if_inductor_loaded()  # Inductor already imported before cakeops: register now
inductor.stamp_compile_caches()  # torch.compile's caches keyed on this cakeops code

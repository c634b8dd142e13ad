"""torch.library custom ops of cakeops (namespace ``cakeops``); importing registers them all."""
from . import mhc, mhc_gated_head, rmsnorm  # noqa: F401
from . import inductor
from .inductor import register_fallbacks_if_inductor_loaded

register_fallbacks_if_inductor_loaded()  # Inductor already imported before cakeops: register now
if inductor.traces_bodies():  # compiled graphs then hold the bodies: cache keys must see the sources
    inductor.stamp_compile_caches()

"""torch.library custom ops of cakeops (namespace ``cakeops``); importing registers them all."""
from . import mhc, rmsnorm  # noqa: F401

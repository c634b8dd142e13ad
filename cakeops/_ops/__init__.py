"""torch.library custom ops of cakeops (namespace ``cakeops``); importing registers them all."""
from . import rmsnorm  # noqa: F401

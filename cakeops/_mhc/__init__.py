"""The mHC layer's code behind its public module ``cakeops.cake_mhc_train`` (which re-exports it), top down:
``autograd`` and ``gated_head`` (autograd) -> ``functions`` (FlashInfer-style functions and their checks) ->
``workspace`` (workspace sizes and carving, support queries). Nothing here is imported by this package file."""

"""Fake (meta) implementations of the cakeops custom ops, and the mHC stats layout.

Pure torch, never imports triton: the shape logic of every op, readable without the kernels.
Installed inside the cakeops distribution as ``cakeops.meta``.
"""

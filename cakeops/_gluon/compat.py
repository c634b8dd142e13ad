"""The Gluon names cakeops' kernels use, one source for triton 3.6 through 3.8.

Imported only where ``triton.experimental.gluon`` imports (``cakeops._gluon.available`` guards the launch). The
kernels write with triton 3.6's names, which 3.8 keeps as aliases (``tma.async_copy_global_to_shared`` /
``async_copy_shared_to_global``; 3.8 calls them ``async_load`` / ``async_store``), and pass ``mbarrier.expect`` its
byte count positionally (3.6 names the keyword ``bytes``, 3.7 ``bytes_per_cta``). What has no common name is here:
the CTA-wide barrier, ``gl.thread_barrier`` up to 3.6 and ``gl.barrier`` from 3.7, neither an alias of the other
(``../shared/research/gluon_hopper.md`` §3 lists the breaks, each checked by compiling).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, mma_v2, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # Gluon's host descriptor, not triton.tools'

# bar.sync over the CTA: every warp's shared-memory accesses before it are done and visible after it
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

__all__ = ["gluon", "gl", "TensorDescriptor", "cta_barrier", "fence_async_shared", "mbarrier", "mma_v2", "tma",
           "warpgroup_mma", "warpgroup_mma_wait"]

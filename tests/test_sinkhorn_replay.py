"""The backward's Sinkhorn replay computes the forward's bits: both kernels call mhc_math.sinkhorn, the replay
with RECORD; a probe kernel runs both modes on the logits of a real forward_prepare record and compares them
with the comb that forward_prepare stored, bit for bit (GPU or interpreter)."""
import pytest
import torch
import triton
import triton.language as tl

from cakeops._triton.mhc_columns import MIX, STATS_WIDTH
from cakeops._triton.mhc_backward_finish import FinishConfig
from cakeops._triton.mhc_math import SINKHORN_TILE, sinkhorn
from cakeops.cake_mhc_train import cake_mhc_train_forward_prepare
from cakeops.meta.mhc_layout import layout_for
from conftest import DEVICE


@triton.jit
def _probe_kernel(STATS, SCALE, BASE, OUT_FWD, OUT_REPLAY, SCR, T, hc_eps, iters,
                  N: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    j = tl.arange(0, N)
    ij = j[:, None] * N + j[None, :]
    rows = t.to(tl.int64)[:, None, None] * STATS_WIDTH(N)
    mix_res = tl.load(STATS + rows + MIX(N) + 2 * N + ij[None, :, :], mask=t_ok[:, None, None], other=0.0)
    base_res = tl.load(BASE + 2 * N + ij)[None, :, :]
    STEP: tl.constexpr = BLOCK_T * N * N
    scr = SCR + tl.program_id(0).to(tl.int64) * (2 * iters - 1) * STEP + (tl.arange(0, BLOCK_T)[:, None, None] * (N * N)
                                                                        + ij[None, :, :])
    fwd, _ = sinkhorn(mix_res, tl.load(SCALE + 2), base_res, hc_eps, iters, SCR, 0, False)
    replay, _ = sinkhorn(mix_res, tl.load(SCALE + 2), base_res, hc_eps, iters, scr, STEP, True)
    out = t.to(tl.int64)[:, None, None] * (N * N) + ij[None, :, :]
    tl.store(OUT_FWD + out, fwd, mask=t_ok[:, None, None])
    tl.store(OUT_REPLAY + out, replay, mask=t_ok[:, None, None])


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("hc_eps", [1e-6, 0.05])
@pytest.mark.parametrize("N", [4, pytest.param(2, id="n2"), pytest.param(8, id="n8")])
def test_replay_is_bitwise_the_forward(triton_kernels, iters, hc_eps, N):
    if N != 4 and (iters, hc_eps) != (20, 0.05):
        pytest.skip("n = 2 and 8: one (iters, hc_eps) pair keeps the runtime modest")
    g = torch.Generator().manual_seed(1000 + iters + N)
    L = layout_for(N)
    N_LOGITS, COMB = L.N_LOGITS, L.COMB
    T, C = 13, 16
    block_t, warps = SINKHORN_TILE  # the tile of both kernels: the sums over 4 then run in the same order
    X = torch.randn(T, N, C, generator=g).to(DEVICE, torch.float32)
    fn = (torch.randn(N_LOGITS, N * C, generator=g) * 0.3).to(DEVICE)
    scale = torch.tensor([0.5, 0.5, 3.0], device=DEVICE)  # logits far from uniform: the Sinkhorn has work to do
    base = torch.randn(N_LOGITS, generator=g).to(DEVICE)
    _, stats = cake_mhc_train_forward_prepare(X, fn, scale, base, hc_eps=hc_eps, sinkhorn_iters=iters)
    programs = triton.cdiv(T, block_t)
    fwd = torch.full((T, N * N), float("nan"), device=DEVICE)
    replay = torch.full_like(fwd, float("nan"))
    scratch = torch.empty(programs * (2 * iters - 1) * block_t * N * N, device=DEVICE)
    _probe_kernel[(programs,)](stats, scale, base, fwd, replay, scratch, T, hc_eps, iters, N=N, BLOCK_T=block_t,
                               num_warps=warps)
    stored = stats[:, COMB:COMB + N * N]
    assert torch.equal(replay, fwd)
    assert torch.equal(fwd, stored)
    assert not torch.allclose(stored, torch.full_like(stored, 1.0 / N), atol=1e-2)  # a comb far from uniform


def test_backward_runs_the_sinkhorn_on_the_forward_tile():
    from cakeops._triton.mhc_prepare import PrepareConfig

    assert (PrepareConfig().gates_block_t, PrepareConfig().gates_warps) == SINKHORN_TILE
    assert (FinishConfig().dlogits_block_t, FinishConfig().dlogits_warps) == SINKHORN_TILE
    for cfg in list(PrepareConfig.candidates()) + list(FinishConfig.candidates()):  # the tuner keeps the tile too
        tile = (cfg.gates_block_t, cfg.gates_warps) if isinstance(cfg, PrepareConfig) else (cfg.dlogits_block_t,
                                                                                             cfg.dlogits_warps)
        assert tile == SINKHORN_TILE, cfg

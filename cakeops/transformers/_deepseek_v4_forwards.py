"""The forwards ``apply_cakeops_to_deepseek_v4`` binds onto Hugging Face's DeepSeek-V4 modules (transformers
5.23 - 5.25; HF's math: research/hf_deepseek_v4.md).

Each is a plain function of ``self`` -- HF's own module, whose parameters, names and init stay as they are -- and
reads every constant from that module, which HF built from the model's config (``rms_norm_eps`` through the norms'
eps, ``hc_eps``, ``hc_sinkhorn_iters``, ``hc_mult``): never cakeops' defaults (rms_eps 1e-5 there, 1e-6 in V4).
Only the public cakeops API is used (cake_rmsnorm_train, cake_mhc_train, nn), so eager runs the autograd.Functions
and torch.compile traces the custom ops, with no graph break.

The model forward is HF's ``DeepseekV4Model.forward`` line for line except for the stream expansion, which goes
through ``cakeops.nn.stream_expand`` so that stream recompute can keep the embedding's output h instead of its n
copies; it takes the cache under the name the installed transformers uses (5.25 renamed ``past_key_values`` to
``cache``).
"""
import inspect
from typing import Optional

import torch

from ..cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_gated_head, cake_mhc_train_prepare
from ..cake_rmsnorm_train import cake_rmsnorm
from ..nn import StreamRecompute, default_group_size, stream_expand

SUPPORTED_HC_MULT = (2, 4, 8)
RECOMPUTE_KWARG = "cakeops_recompute"  # how the patched model forward hands its StreamRecompute to its layers


class Settings:
    """What one ``apply_cakeops_to_deepseek_v4`` call chose; the forwards it binds read it. ``recompute``: False,
    or the group size (an int), or True: ``nn.default_group_size`` (hc_mult + 2 layers), one plan per n made here,
    at patch time (a compiled forward then only looks one up)."""

    def __init__(self, recompute):
        self.recompute = recompute
        if recompute is False:
            self.plans = {}
        elif recompute is True:
            self.plans = {n: StreamRecompute(default_group_size(n)) for n in SUPPORTED_HC_MULT}
        else:
            self.plans = {n: StreamRecompute(recompute) for n in SUPPORTED_HC_MULT}

    def plan(self, n: int) -> Optional[StreamRecompute]:
        return self.plans.get(n)


def norm_eps(module) -> float:
    """A DeepSeek-V4 norm's eps (config.rms_norm_eps) by either attribute name: transformers 5.25 renamed the
    unweighted norm's ``eps`` to ``variance_epsilon``."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if value is not None:
            return float(value)
    raise AttributeError(f"{type(module).__name__} has neither variance_epsilon nor eps: a transformers version "
                         f"cakeops.transformers does not know; its rms_norm_eps cannot be read")


def check_hc_mult(n: int) -> int:
    if n not in SUPPORTED_HC_MULT:
        raise NotImplementedError(
            f"DeepSeek-V4 config hc_mult={n}: cakeops' mHC kernels support hc_mult in {{2, 4, 8}}; use one of "
            f"those, or apply_cakeops_to_deepseek_v4(..., hyper_connections=False, hc_head=False) to keep HF's "
            f"hyper-connections")
    return n


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4RMSNorm``: ``(weight * (x * rstd)).to(x.dtype)``, FP32 inside, one rounding (the weight may be
    FP32 with bf16 x: its grad comes back FP32)."""
    return cake_rmsnorm(hidden_states, self.weight, norm_eps(self))


def unweighted_rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4UnweightedRMSNorm`` (``q_b_norm`` on a transposed view of q; HF's hyper-connection input norms
    where those stay HF's): cake_rmsnorm with a unit weight. bf16: one rounding where HF rounds rstd first."""
    ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return cake_rmsnorm(x, ones, norm_eps(self))


def hyper_head_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4HyperHead`` (model.hc_head): the gated collapse ``sum_i (sigmoid(...) + hc_eps) X_i`` =
    cake_mhc_train_gated_head on HF's hc_fn / hc_scale / hc_base (same shapes and layout)."""
    check_hc_mult(self.hc_mult)
    return cake_mhc_train_gated_head(x, self.hc_fn, self.hc_scale, self.hc_base, rms_eps=norm_eps(self.input_norm),
                                     hc_eps=float(self.eps))


def _prepare(hc, X: torch.Tensor, plan):
    """A ``DeepseekV4HyperConnection``'s pre/post/comb and collapse: cake_mhc_train_prepare on its fn/scale/base
    (HF's layout: rows pre, post, comb row-major; column i*C + c; scale pre/post/comb)."""
    check_hc_mult(hc.hc_mult)
    return cake_mhc_train_prepare(X, hc.fn, hc.scale, hc.base, rms_eps=norm_eps(hc.input_norm),
                                  hc_eps=float(hc.hc_eps), sinkhorn_iters=int(hc.hc_sinkhorn_iters), recompute=plan)


def decoder_layer_forward(self, hidden_states: torch.Tensor, input_ids: Optional[torch.Tensor] = None, **kwargs):
    """``DeepseekV4DecoderLayer``: per branch, prepare -> branch -> finish, where HF's
    ``post[..., None] * out[..., None, :] + comb.T @ X`` is cakeops' finish. The attention takes the layer's
    keyword arguments untouched (position embeddings, mask, cache under either name, ...), the MoE its
    ``input_ids`` (hash routing)."""
    plan = kwargs.pop(RECOMPUTE_KWARG, None)
    U, handle = _prepare(self.attn_hc, hidden_states, plan)
    attn_output, _ = self.self_attn(self.input_layernorm(U), **kwargs)
    X = cake_mhc_train_finish(hidden_states, attn_output, handle)
    U, handle = _prepare(self.ffn_hc, X, plan)
    mlp_output = self.mlp(self.post_attention_layernorm(U), input_ids=input_ids)
    return cake_mhc_train_finish(X, mlp_output, handle)


def make_model_forward(settings: Settings):
    """``DeepseekV4Model.forward`` with the embedding's stream expansion through ``cakeops.nn.stream_expand``
    (rooting stream recompute at h), wrapped in the decorators HF's has (config defaults, output capture)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import capture_outputs

    # the attention's signature: HF's own whatever was patched (5.23 past_key_values, 5.25 cache)
    cache_name = "cache" if "cache" in inspect.signature(modeling.DeepseekV4Attention.forward).parameters \
        else "past_key_values"
    mask_fn = modeling.create_sliding_window_causal_mask
    mask_cache = "cache" if "cache" in inspect.signature(mask_fn).parameters else "past_key_values"

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                **kwargs):
        cache = kwargs.pop("cache", None)
        legacy = kwargs.pop("past_key_values", None)
        cache = legacy if cache is None else cache
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if use_cache and cache is None:
            cache = modeling.DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)
        if isinstance(attention_mask, dict):
            causal_mask = next(iter(attention_mask.values()))
        else:
            causal_mask = mask_fn(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                  position_ids=position_ids, **{mask_cache: cache})
        n = check_hc_mult(self.config.hc_mult)
        plan = settings.plan(n)
        hidden_states = stream_expand(inputs_embeds, n, recompute=plan)
        position_embeddings = {
            "main": self.rotary_emb(inputs_embeds, position_ids=position_ids, layer_type="main"),
            "compress": self.rotary_emb(inputs_embeds, position_ids=position_ids, layer_type="compress"),
        }
        if plan is not None:
            kwargs[RECOMPUTE_KWARG] = plan
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, position_ids=position_ids,
                                  attention_mask=causal_mask, input_ids=input_ids, **{cache_name: cache}, **kwargs)
        hidden_states = self.norm(self.hc_head(hidden_states))
        return modeling.MoeModelOutputWithPast(last_hidden_state=hidden_states, **{cache_name: cache})

    forward.__doc__ = make_model_forward.__doc__
    return merge_with_config_defaults(capture_outputs(forward))

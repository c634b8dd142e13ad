"""``apply_cakeops_to_deepseek_v4``: Hugging Face's DeepSeek-V4 on cakeops' kernels, Liger-Kernel style.

New forwards (``_deepseek_v4_forwards``) are bound onto HF's own modules -- per instance with ``types.MethodType``
for ``model=``, on the classes otherwise -- and no module is swapped, so parameter names, init, dtypes and the state
dict stay HF's (checkpoints load both ways, ``from_pretrained`` works after a class patch). Bindings are recorded so
that a second call is harmless and ``revert_cakeops_deepseek_v4`` restores HF's forwards (or whatever another
library, e.g. Liger-Kernel, had bound before).
"""
import types
import weakref
from typing import Dict, Optional

from torch import nn

from . import _deepseek_v4_forwards as fw
from ._hf import deepseek_v4_modeling

_MARK = "__cakeops_patch__"  # set on every forward function this module binds
_class_originals: Dict[type, object] = {}  # class -> its own forward before the first class patch
_instance_originals: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def _ours(fn) -> bool:
    return getattr(getattr(fn, "__func__", fn), _MARK, False)


def _marked(fn):
    setattr(fn, _MARK, True)
    return fn


def _bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__}")
    return value


def _recompute_arg(recompute):
    if isinstance(recompute, bool):
        return recompute
    if isinstance(recompute, int) and recompute >= 1:
        return False if recompute == 1 else recompute
    raise TypeError(f"recompute: expected True (groups of hc_mult + 2 layers), False, or a group size (an int >= 1), "
                    f"got {recompute!r}")


def _targets(rms_norm: bool, hyper_connections: bool, hc_head: bool, settings):
    """(HF class name, forward to bind) for each selected piece."""
    out = []
    if rms_norm:
        out += [("DeepseekV4RMSNorm", fw.rms_norm_forward),
                ("DeepseekV4UnweightedRMSNorm", fw.unweighted_rms_norm_forward)]
    if hyper_connections:
        out += [("DeepseekV4DecoderLayer", fw.decoder_layer_forward),
                ("DeepseekV4Model", fw.make_model_forward(settings))]
    if hc_head:
        out.append(("DeepseekV4HyperHead", fw.hyper_head_forward))
    return out


def _hf_class(modeling, name: str):
    """HF's own class of that name, or None where the module attribute names another library's (Liger's class
    patch sets ``DeepseekV4RMSNorm = LigerRMSNorm`` -- with ``model=`` too: the norms it then builds are Liger's)."""
    cls = getattr(modeling, name)
    return cls if cls.__module__ == modeling.__name__ else None


def _instance_of(module, modeling, name: str) -> bool:
    """``module`` is an instance of HF's class ``name`` (by name and defining module: the module attribute may
    name Liger's class by now; FSDP2's subclass of a sharded module counts)."""
    return any(c.__name__ == name and c.__module__ == modeling.__name__ for c in type(module).__mro__)


def apply_cakeops_to_deepseek_v4(model: Optional[nn.Module] = None, *, rms_norm: bool = True,
                                 hyper_connections: bool = True, hc_head: bool = True, recompute=False) -> None:
    """Run Hugging Face's DeepSeek-V4 (``transformers`` >= 5.23) on cakeops' fused kernels.

    ``model=None`` patches the classes: models built afterwards (``from_pretrained`` included) use cakeops.
    ``model=`` (a ``DeepseekV4ForCausalLM`` / ``DeepseekV4Model``) patches that instance only; other models of
    the class stay HF's. A second call is harmless; ``revert_cakeops_deepseek_v4`` undoes either.

    What is patched (a False flag leaves that piece as it is):
    - ``hyper_connections``: each decoder layer's ``attn_hc`` / ``ffn_hc`` with the layer's mixing
      (``cake_mhc_train_prepare`` -> HF's attention / MoE with their own arguments -> ``cake_mhc_train_finish``)
      and the embedding's expansion into ``hc_mult`` streams (``cakeops.nn.stream_expand``; the model forward).
    - ``hc_head``: the gated head before the final norm (``cake_mhc_train_gated_head``).
    - ``rms_norm``: every ``DeepseekV4RMSNorm`` (input / post-attention layernorms, q_a_norm, kv_norm,
      compressor and indexer norms, the final norm) and the unweighted norms (``q_b_norm``) (``cake_rmsnorm``).
    Attention, compressors, indexer, MoE, RoPE and the loss stay HF's (Liger's V4 patch may take the loss and
    norms: the two compose in either order, the last one binding a norm owns it).

    Every constant is the model's own (``rms_norm_eps``, ``hc_eps``, ``hc_sinkhorn_iters``, ``hc_mult``, read
    from the modules HF built from the config). ``hc_mult`` must be 2, 4 or 8 (NotImplementedError otherwise).
    fp32: HF's loss and gradients to rounding. bf16 (``model.to(torch.bfloat16)``, or ``from_pretrained(...,
    dtype=torch.bfloat16)``'s FP32 hyper-connection and norm weights): cakeops computes post/comb and the mixing
    in FP32 and rounds once where HF rounds post/comb to bf16 first; every gradient comes back in its
    parameter's dtype.

    ``recompute``: stream recompute (DeepSeek's mHC paper §4.3.2; ``cakeops.nn.StreamRecompute``): True keeps the
    streams of one mHC layer in ``hc_mult + 2`` (``cakeops.nn.default_group_size``; the first group rooted at the
    embedding's output h: C values per token instead of n*C), an int sets that group size, False (default) keeps
    every layer's. Gradients are bitwise those without it, eager and under ``torch.compile`` (compiled: in
    Inductor's deterministic mode, ``torch._inductor.config.deterministic = True``; outside it any two compiles may
    differ in the last bits).

    >>> from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    >>> cfg = DeepseekV4Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    ...     head_dim=16, q_lora_rank=16, o_groups=1, o_lora_rank=8, moe_intermediate_size=16, n_routed_experts=2,
    ...     num_experts_per_tok=1, index_n_heads=1, index_head_dim=8, index_topk=2, sliding_window=8,
    ...     layer_types=["sliding_attention"], mlp_layer_types=["moe"], hc_mult=4)
    >>> model = DeepseekV4ForCausalLM(cfg)
    >>> apply_cakeops_to_deepseek_v4(model)
    >>> ids = torch.randint(0, 64, (1, 8))
    >>> model(input_ids=ids, labels=ids).loss.backward()
    """
    modeling = deepseek_v4_modeling()
    for name, value in (("rms_norm", rms_norm), ("hyper_connections", hyper_connections), ("hc_head", hc_head)):
        _bool(name, value)
    recompute = _recompute_arg(recompute)
    if recompute and not hyper_connections:
        raise ValueError("recompute: stream recompute rebuilds the hyper-connection streams cakeops computes; it "
                         "needs hyper_connections=True")
    settings = fw.Settings(recompute)
    if model is None:
        for name, forward in _targets(rms_norm, hyper_connections, hc_head, settings):
            cls = _hf_class(modeling, name)
            if cls is None:
                continue
            own = cls.__dict__.get("forward")
            if cls not in _class_originals and not _ours(own):
                _class_originals[cls] = own
            cls.forward = _marked(forward)
        return
    base = _check_model(model, modeling)
    if hyper_connections or hc_head:
        fw.check_hc_mult(base.config.hc_mult)
    targets = _targets(rms_norm, hyper_connections, hc_head, settings)
    for module in model.modules():
        forward = next((f for name, f in targets if _instance_of(module, modeling, name)), None)
        if forward is None:
            continue
        current = module.__dict__.get("forward")
        if module not in _instance_originals and not _ours(current):
            _instance_originals[module] = current  # None: the class's forward
        module.forward = types.MethodType(_marked(forward), module)


def revert_cakeops_deepseek_v4(model: Optional[nn.Module] = None) -> None:
    """Undo ``apply_cakeops_to_deepseek_v4``: ``model=None`` restores the classes' forwards (models built since
    then become HF's again, unless patched per instance), ``model=`` that instance's (what was bound before, e.g.
    Liger's, else the class's). Harmless when nothing was patched."""
    if model is None:
        for cls, own in list(_class_originals.items()):
            if own is None:
                del cls.forward
            else:
                cls.forward = own
            del _class_originals[cls]
        return
    _check_model(model, deepseek_v4_modeling())
    for module in model.modules():
        if module in _instance_originals:
            before = _instance_originals.pop(module)
            if before is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before


def _check_model(model, modeling):
    """The model's ``DeepseekV4Model`` (itself, or the ``.model`` of a causal LM)."""
    if not isinstance(model, modeling.DeepseekV4PreTrainedModel):
        raise TypeError(f"model: expected a Hugging Face DeepSeek-V4 model (transformers' DeepseekV4ForCausalLM or "
                        f"DeepseekV4Model), got {type(model).__module__}.{type(model).__qualname__}; "
                        f"apply_cakeops_to_deepseek_v4 patches DeepSeek-V4 only")
    for module in model.modules():
        if isinstance(module, modeling.DeepseekV4Model):
            return module
    raise TypeError(f"model: {type(model).__name__} holds no DeepseekV4Model; pass the DeepSeek-V4 causal LM or "
                    f"its base model")

"""cakeops for Hugging Face transformers models, in Liger-Kernel's style: one ``apply_cakeops_to_<model>`` per
model, binding cakeops forwards onto the model's own modules (no module swapped: names, init, dtypes and the state
dict stay HF's). Sits above ``cakeops.nn`` and uses only the public API. Needs ``transformers`` >= 5.23
(``pip install -e ".[transformers]"``), imported only when a function is called.
"""
from .deepseek_v4 import apply_cakeops_to_deepseek_v4, revert_cakeops_deepseek_v4

__all__ = ["apply_cakeops_to_deepseek_v4", "revert_cakeops_deepseek_v4"]

"""Importing transformers' DeepSeek-V4, with the error a user can act on when it is missing or too old."""
import importlib

MIN_VERSION = "5.23"


def deepseek_v4_modeling():
    """``transformers.models.deepseek_v4.modeling_deepseek_v4``, or ImportError naming the version found."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"cakeops.transformers needs Hugging Face transformers >= {MIN_VERSION} (its DeepSeek-V4 "
                          f"model), which is not installed: pip install -e \".[transformers]\" (or pip install "
                          f"'transformers>={MIN_VERSION}')") from e
    try:
        return importlib.import_module("transformers.models.deepseek_v4.modeling_deepseek_v4")
    except ImportError as e:
        version = getattr(transformers, "__version__", "unknown")
        raise ImportError(f"cakeops.transformers.apply_cakeops_to_deepseek_v4 needs transformers >= {MIN_VERSION} "
                          f"(the deepseek_v4 model); found transformers {version}, which has no deepseek_v4 (or it "
                          f"failed to import: {e}). Upgrade: pip install -e \".[transformers]\" (or pip install "
                          f"'transformers>={MIN_VERSION}')") from e

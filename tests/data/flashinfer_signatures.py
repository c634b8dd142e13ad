"""Regenerates tests/data/flashinfer_074_signatures.json: the public signatures of FlashInfer 0.7.4's Cake RMSNorm
and mHC modules, read from the wheel's sources with ``ast`` (FlashInfer itself cannot be imported without its CUDA
builds). Run once per FlashInfer version:

    unzip -q flashinfer_python-0.7.4-py3-none-any.whl -d /tmp/fi
    python tests/data/flashinfer_signatures.py /tmp/fi/flashinfer > tests/data/flashinfer_074_signatures.json

For each module: its ``__all__`` (plus the names it re-exports from elsewhere, resolved through ``from ... import``
to the ``def`` / ``class`` that defines them), and for each function its parameters (name, kind, default as
source text), for each autograd Function class its ``forward``'s. Names bound by a module-level ``__getattr__``
(flashinfer.cake_rmsnorm_train's previous det names) are listed under "lazy". Only signatures are recorded.
"""
import ast
import json
import sys
from pathlib import Path

MODULES = {
    "cake_mhc_det_train": "cake_mhc_det_train.py",
    "cake_mhc_train": "cake_mhc_train.py",
    "experimental.cake.cake_mhc_train": "experimental/cake/cake_mhc_train.py",
    "cake_rmsnorm_train": "cake_rmsnorm_train.py",
    "cake_rmsnorm_det_train": "cake_rmsnorm_det_train.py",
}
KINDS = {"posonly": "POSITIONAL_ONLY", "args": "POSITIONAL_OR_KEYWORD", "kwonly": "KEYWORD_ONLY"}


def _params(fn: ast.FunctionDef):
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + a.defaults
    for i, (p, d) in enumerate(zip(positional, defaults)):
        kind = KINDS["posonly"] if i < len(a.posonlyargs) else KINDS["args"]
        out.append([p.arg, kind, None if d is None else ast.unparse(d)])
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL", None])
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append([p.arg, KINDS["kwonly"], None if d is None else ast.unparse(d)])
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD", None])
    return out


class Package:
    def __init__(self, root: Path):
        self.root = root
        self.trees = {}

    def tree(self, dotted: str):
        if dotted not in self.trees:
            path = self.root / (dotted.replace(".", "/") + ".py")
            if not path.exists():
                path = self.root / dotted.replace(".", "/") / "__init__.py"
            self.trees[dotted] = ast.parse(path.read_text())
        return self.trees[dotted]

    def resolve(self, dotted: str, name: str, depth=0):
        """The ast node defining ``name`` in module ``dotted`` (following ``from . import`` chains), or None."""
        if depth > 8:
            return None
        tree = self.tree(dotted)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        base = dotted.split(".")
                        is_pkg = (self.root / dotted.replace(".", "/") / "__init__.py").exists()
                        up = base[: len(base) - node.level + (1 if is_pkg else 0)] if node.level else []
                        target = ".".join(up + ([node.module] if node.module else []))
                        if not node.module and node.level:
                            target = ".".join(up + [alias.name])
                            return ("module", target)
                        return self.resolve(target, alias.name, depth + 1)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                if isinstance(node.value, ast.Name):
                    return self.resolve(dotted, node.value.id, depth + 1)
                return ("value", ast.unparse(node.value))
        return None


def _describe(node):
    if isinstance(node, ast.FunctionDef):
        return {"kind": "function", "params": _params(node)}
    if isinstance(node, ast.ClassDef):
        fwd = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "forward"), None)
        return {"kind": "class", "forward": None if fwd is None else _params(fwd)}
    return {"kind": "value"}


def main(root: str):
    pkg = Package(Path(root))
    out = {}
    for mod, _ in MODULES.items():
        tree = pkg.tree(mod)
        names = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))
        entry = {}
        for name in names:
            entry[name] = _describe(pkg.resolve(mod, name))
        lazy = {}
        for n in tree.body:
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_PREVIOUS_DET_NAMES"
                                                 for t in n.targets):
                for name in ast.literal_eval(n.value.args[0]):
                    lazy[name] = _describe(pkg.resolve("cake_rmsnorm_det_train", name))
        out[mod] = {"all": entry, "lazy": lazy}
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main(sys.argv[1])

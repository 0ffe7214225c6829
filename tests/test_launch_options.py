"""Every Triton launch states the compile options that set its bits.

A launch that leaves ``enable_fp_fusion`` to Triton gets True up to Triton 3.9 and False from 3.10 (and whatever
``TRITON_DEFAULT_FP_FUSION`` says): its bits would change with the toolchain on both sides at once, K3 would stay
0 and every stored receipt would break.  ``num_warps`` sets the layout of every ``tl.sum`` and so its order.
The test reads the source (no GPU needed): each call ``kernel[grid](...)`` of a ``@triton.jit`` / ``@gluon.jit``
function in the package, benchmarks and examples must pass ``enable_fp_fusion=FP_FUSION`` (the one shared choice,
``alignzoo.common._launch``) and a ``num_warps``, written at the call or in a dict it unpacks.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("common", "models", "weights", "sync", "serve", "benchmarks", "examples")


def _files() -> list[Path]:
    return sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py"))


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in _files()}


def _jit_names(trees) -> set[str]:
    names = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).split("(")[0].endswith("jit") for d in node.decorator_list):
                names.add(node.name)
    return names


def _base(func: ast.Subscript) -> str | None:
    v = func.value
    return v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None


def _dict_keys(node: ast.AST) -> set[str] | None:
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant)}
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "dict":
        return {k.arg for k in node.keywords if k.arg}
    return None


class _Scope:
    """What a ``**name`` or ``**f(...)`` in a launch unpacks, resolved within its module: dict literals bound to a
    name, and functions whose every return is a dict literal (the keys they all share).  Unknown -> no keys."""

    def __init__(self, tree: ast.Module):
        self.bound: dict[str, list[set[str] | None]] = {}
        self.funcs: dict[str, set[str] | None] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    self._bind(t, node.value)
            elif isinstance(node, ast.FunctionDef):
                rets = [self._keys(r.value) for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
                if rets and all(r is not None for r in rets):
                    self.funcs[node.name] = set.intersection(*rets)

    def _bind(self, target, value):
        if isinstance(target, ast.Name):
            self.bound.setdefault(target.id, []).append(value)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)

    def _keys(self, node):
        keys = _dict_keys(node)
        if keys is not None:
            return keys
        if isinstance(node, ast.IfExp):
            a, b = self._keys(node.body), self._keys(node.orelse)
            return None if a is None or b is None else a & b
        return None

    def keys(self, node: ast.AST) -> set[str]:
        if _dict_keys(node) is not None:
            return _dict_keys(node)
        if isinstance(node, ast.Name) and node.id in self.bound:
            found = [self._keys(v) if not isinstance(v, ast.Call) else self.keys(v) for v in self.bound[node.id]]
            return set.intersection(*found) if all(f is not None for f in found) else set()
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return self.funcs.get(node.func.id) or set()
        return self._keys(node) or set()


def _launches():
    trees = _trees()
    jit = _jit_names(trees)
    for path, tree in trees.items():
        scope = _Scope(tree)
        # names bound to a kernel (``kernel = _a if ws else _b``) launch like the kernel itself
        kernels = set(jit)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)} & jit:
                kernels |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and _base(node.func) in kernels:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {_base(node.func)}", node, scope


def test_the_scan_finds_the_launches():
    found = {name.split(" ")[1] for name, _, _ in _launches()}
    # one launch per family the scan must see: plain, through a variable, Gluon, sync's checksum
    assert {"_mm_merge_kernel", "kernel", "_tree_kernel", "checksum_kernel", "_slot_sum_kernel"} <= found
    assert len(found) >= 50


def test_every_launch_pins_fp_fusion_to_the_shared_choice():
    bad = []
    for name, call, _ in _launches():
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        if not (isinstance(kw.get("enable_fp_fusion"), ast.Name) and kw["enable_fp_fusion"].id == "FP_FUSION"):
            bad.append(name)
    assert bad == [], "launches that leave FP fusion to Triton or choose it alone:\n" + "\n".join(bad)


def test_every_launch_states_its_warps():
    bad = []
    for name, call, scope in _launches():
        keys = {k.arg for k in call.keywords if k.arg}
        for k in call.keywords:
            if k.arg is None:
                keys |= scope.keys(k.value)
        if "num_warps" not in keys:
            bad.append(name)
    assert bad == [], "launches that leave num_warps to Triton:\n" + "\n".join(bad)


def test_fp_fusion_is_chosen_once():
    from alignzoo.common._launch import FP_FUSION

    assert FP_FUSION is False
    elsewhere = [f"{p.relative_to(ROOT)}:{i}" for p in _files() if p.name != "_launch.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r'enable_fp_fusion"?\s*[:=]\s*(?!FP_FUSION\b)\S', line) and "``" not in line]
    assert elsewhere == [], "enable_fp_fusion set other than to FP_FUSION:\n" + "\n".join(elsewhere)


@pytest.mark.parametrize("source", ["k[(1,)](x, num_warps=4)", "k[(1,)](x, enable_fp_fusion=True, num_warps=4)"])
def test_the_check_catches_an_unpinned_launch(source, tmp_path, monkeypatch):
    mod = tmp_path / "common" / "bad.py"
    mod.parent.mkdir()
    mod.write_text(f"import triton\n\n@triton.jit\ndef k(x):\n    pass\n\ndef go(x):\n    {source}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", ("common",))
    with pytest.raises(AssertionError, match="bad.py:8 k"):
        test_every_launch_pins_fp_fusion_to_the_shared_choice()


def test_the_toolchain_defaults_left_to_triton_still_hold():
    """What no launch can state, read from Triton's own sm_90 options: a change here changes bits."""
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    from alignzoo.common._launch import FP_FUSION

    opts = make_backend(GPUTarget("cuda", 90, 32)).parse_options({"enable_fp_fusion": FP_FUSION, "num_warps": 4})
    assert opts.enable_fp_fusion is False
    # fp8 tl.dot: no fp32 promotion inside one 128-wide K block (an explicit value <= K would add them)
    assert opts.max_num_imprecise_acc_default == 2**30
    # libdevice flushes subnormals unless a launch says otherwise (the GDN and the router do)
    assert opts.enable_reflect_ftz is True
    assert opts.default_dot_input_precision == "tf32"  # never read: every fp32 dot names its precision

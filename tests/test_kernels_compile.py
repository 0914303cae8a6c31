"""Every Triton kernel the codecs launch compiles for an H100/H200 (sm_90), here.

Triton's interpreter (``test_kernels.py``) runs a kernel's Python with NumPy: it
checks what the kernel computes, not that Triton's compiler accepts it (types that
only the compiler infers, loop-carried values that change type, ops the lowering lacks).
A GPU session is short and rare, so a kernel that does not compile would waste it.
Here each codec with a kernel runs once under the interpreter while its launches are
recorded (the kernel, its arguments' types, its constexprs and launch options); then a
process without the interpreter compiles each distinct launch with Triton's own
compiler and ``ptxas`` (both in the ``triton`` wheel) for ``GPUTarget("cuda", 90, 32)``,
no GPU needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import gradzip
from gradzip.codecs import kernels

triton = pytest.importorskip("triton")
if not kernels.interpreter_on():
    pytest.skip("TRITON_INTERPRET is not set (a GPU is present): launches compile there",
                allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

#: every codec with a device kernel, as the hooks run it (encode, then decode)
SPECS = ["int8", "qsgd", "fp8", "fp8(format=e5m2)", "topk(ratio=0.01)", "randomk(ratio=0.01)",
         "ef | topk(ratio=0.01)", "signsgd(vote=false)", "efsignsgd", "onebit", "terngrad",
         "int8 | ans", "lossless", "centroid", "centroid(bits=4, bucket=100)"]
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.float64: "fp64", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
          torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


def _type(value: Any) -> Any:
    """A launch argument's Triton signature type (a constexpr's value as it is)."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected kernel argument {value!r}")


def _constexpr(value: Any) -> Any:
    """A constexpr as JSON: a Triton dtype by its name."""
    if isinstance(value, triton.language.dtype):
        return {"dtype": value.name}
    return value


def _recorded_launches() -> list[dict[str, Any]]:
    """The distinct kernel launches of ``SPECS``, run under the interpreter."""
    launches: dict[str, dict[str, Any]] = {}
    original = InterpretedFunction.run

    def record(self: InterpretedFunction, *args: Any, grid: Any, warmup: bool,
               **kwargs: Any) -> Any:
        bound = dict(zip(self.arg_names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        case = {"module": self.fn.__module__, "name": self.fn.__name__,
                "args": bound, "options": options}
        launches.setdefault(repr((case["module"], case["name"], sorted(
            (k, _type(v) if isinstance(v, torch.Tensor) else repr(v))
            for k, v in bound.items()))), case)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    InterpretedFunction.run = record  # type: ignore[method-assign]
    try:
        with kernels.interpreted():
            for spec in SPECS:
                codec = gradzip.codec(spec)
                codec.decode(codec.encode(x, "k"), "k")
    finally:
        InterpretedFunction.run = original  # type: ignore[method-assign]
    return list(launches.values())


_COMPILE = r"""
import json, sys, importlib
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failures = []
for case in json.load(sys.stdin):
    fn = getattr(importlib.import_module(case["module"]), case["name"])
    signature, constexprs = {}, {}
    for i, param in enumerate(fn.params):
        value = case["args"].get(param.name)
        if param.is_constexpr:
            if isinstance(value, dict) and "dtype" in value:
                value = tl.dtype(value["dtype"])
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[param.name] = value
    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=case["options"])
    except Exception as e:
        failures.append(f"{case['module']}.{case['name']}: {type(e).__name__}: {e}"[:2000])
print(json.dumps(failures))
"""


@pytest.fixture(scope="module")
def launches() -> list[dict[str, Any]]:
    return _recorded_launches()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_every_launched_kernel_compiles_for_sm90(launches: list[dict[str, Any]]) -> None:
    names = {c["name"] for c in launches}
    assert {"_quantize_kernel", "_dequantize_kernel", "_fp8_encode_kernel", "_pack_kernel",
            "_unpack_kernel", "_pack_trits_kernel", "_hist_kernel", "_write_kernel",
            "_encode_kernel", "_decode_kernel", "_copy_kernel", "_keys_kernel"} <= names, names
    cases = []
    for case in launches:
        fixed = _constexpr_names(case)
        cases.append({**case, "args": {k: _constexpr(v) if k in fixed else _type(v)
                                       for k, v in case["args"].items()}})
    failures = _compile(cases)
    assert not failures, "\n".join(failures)


_FRONT = r"""
import json, sys, importlib
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
options = backend.parse_options({})
failures = []
for case in json.load(sys.stdin):
    fn = getattr(importlib.import_module(case["module"]), case["name"])
    if any(p.name == case["one"] and p.do_not_specialize for p in fn.params):
        continue  # the launcher passes it as a value whatever it is
    signature, constexprs = {}, {}
    for i, param in enumerate(fn.params):
        value = case["args"].get(param.name)
        if param.is_constexpr or param.name == case["one"]:
            if isinstance(value, dict) and "dtype" in value:
                value = tl.dtype(value["dtype"])
            signature[param.name] = "constexpr"
            constexprs[(i,)] = 1 if param.name == case["one"] else value
        else:
            signature[param.name] = value
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        ASTSource(fn=fn, signature=signature, constexprs=constexprs).make_ir(
            target, options, backend.get_codegen_implementation(options),
            backend.get_module_map(), context)
    except Exception as e:
        failures.append(f"{case['module']}.{case['name']} with {case['one']} = 1: "
                        f"{type(e).__name__}: {e}"[:2000])
print(json.dumps(failures))
"""


def _specialized_to_one(launches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A case per launch and integer argument: where Triton specializes it (unless the
    kernel says ``do_not_specialize``), a value of 1 becomes a compile-time constant,
    a plain int rather than a scalar of the argument's type."""
    cases = []
    for case in launches:
        fixed = _constexpr_names(case)
        args = {k: _constexpr(v) if k in fixed else _type(v) for k, v in case["args"].items()}
        cases.extend({**case, "args": args, "one": name} for name, t in args.items()
                     if name not in fixed and t in ("i32", "i64"))
    return cases


def test_every_launched_kernel_compiles_where_an_integer_argument_is_one(
        launches: list[dict[str, Any]]) -> None:
    """A launch whose integer argument equals 1 compiles that argument as a constant:
    an ``.to`` on it then fails (a randomk seed with a round key of 1 did). Each such
    argument is either specialized safely or marked ``do_not_specialize``."""
    cases = _specialized_to_one(launches)
    assert len(cases) > 20, len(cases)
    failures = _compile(cases, script=_FRONT)
    assert not failures, "\n".join(failures)


def test_the_front_end_check_fails_where_a_constant_has_no_to(tmp_path) -> None:
    """Negative control: ``key.to`` on an argument specialized to 1 is refused."""
    (tmp_path / "one_kernels.py").write_text(_ONE)
    case = {"module": "one_kernels", "name": "_one_kernel", "one": "key",
            "args": {"x_ptr": "*i64", "key": "i32"}, "options": {}}
    failures = _compile([case], extra_path=str(tmp_path), script=_FRONT)
    assert len(failures) == 1 and "key = 1" in failures[0], failures


_ONE = """
import triton
import triton.language as tl


@triton.jit
def _one_kernel(x_ptr, key):
    tl.store(x_ptr, key.to(tl.int64))
"""


_BROKEN = """
import triton
import triton.language as tl


@triton.jit
def _broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    total = 0  # an int32 that the loop makes a float: the interpreter runs it
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(x_ptr + offs, mask=offs < n, other=0.0), 0)
    tl.store(x_ptr, total)
"""


def test_the_check_fails_for_a_kernel_only_the_compiler_refuses(tmp_path) -> None:
    """Negative control: a loop-carried value that changes type runs in the
    interpreter and fails to compile; the check reports it."""
    (tmp_path / "broken_kernels.py").write_text(_BROKEN)
    case = {"module": "broken_kernels", "name": "_broken_kernel",
            "args": {"x_ptr": "*fp32", "n": "i32", "BLOCK": 64}, "options": {}}
    failures = _compile([case], extra_path=str(tmp_path))
    assert len(failures) == 1 and "_broken_kernel" in failures[0], failures


def _compile(cases: list[dict[str, Any]], extra_path: str | None = None,
             script: str = _COMPILE) -> list[str]:
    """Compile each case for sm_90 in a process without the interpreter (``script``:
    the whole compiler, or ``_FRONT``: as far as Triton's IR): the failures."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path,
                                                          env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases),
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _constexpr_names(case: dict[str, Any]) -> set[str]:
    """The constexpr parameters of a recorded launch's kernel."""
    import importlib

    fn = getattr(importlib.import_module(case["module"]), case["name"])
    return {n for n, annotation in fn.fn.__annotations__.items()
            if "constexpr" in str(annotation)}

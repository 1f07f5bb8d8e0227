"""The Triton codec kernels, bit for bit against the torch reference (Triton's interpreter on CPU),
compiled for a CUDA target without a GPU, and the reference fallback where Triton cannot launch.

Codes, scales and flags are compared as bits; dequantized outputs too (NaNs, which only flagged
groups produce, compared as NaN). Shapes have row counts that are not multiples of the kernels'
BLOCK_R (masked tails), single rows, and group counts above one per row.
"""

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

from hilore_verl.kernels import FORMATS, GROUP_SIZES, reference
from hilore_verl.kernels.triton_codec import _store_from_f32
from hilore_verl.kernels.triton_guard import same_bits

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1, set by conftest)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(37, 128), (2, 3, 256), (1, 384)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"




def _assert_same(out, ref, y, what):
    """`out` (the kernels' QuantizedTensor) and `y` (its dequantized output) against the reference's."""
    for field in ("codes", "scales", "flags"):
        assert same_bits(getattr(out, field).cpu(), getattr(ref, field)), (what, field)
    assert same_bits(y.cpu(), reference.dequantize(ref)), what


def _x(shape, dtype, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    x.view(-1)[5] = 0.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_and_dequantize_match_the_reference(fmt, dtype):
    from hilore_verl.kernels import triton_codec

    for group_size in GROUP_SIZES:
        for shape in SHAPES:
            for stochastic in (False, True):
                x = _x(shape, dtype)
                ref = reference.quantize(x.cpu(), fmt, group_size, stochastic, seed=7)
                out = triton_codec.quantize(x, fmt, group_size, stochastic, seed=7)
                _assert_same(out, ref, triton_codec.dequantize(out), (group_size, shape))


def test_zero_and_non_finite_groups_match_the_reference():
    from hilore_verl.kernels import triton_codec

    x = _x((40, 128), torch.bfloat16)
    x[3] = 0
    x[7, 9] = float("inf")
    x[39, 100] = float("nan")
    for fmt in FORMATS:
        ref, out = reference.quantize(x.cpu(), fmt, 64), triton_codec.quantize(x, fmt, 64)
        assert same_bits(out.flags.cpu(), ref.flags) and int(out.flags.sum()) == 2
        assert same_bits(out.scales.cpu(), ref.scales) and same_bits(out.codes.cpu(), ref.codes)
        assert same_bits(triton_codec.dequantize(out).cpu(), reference.dequantize(ref))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's product, saturated
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_up_to_the_dtype_max_match_the_reference_and_decode_finite(dtype):
    from hilore_verl.kernels import triton_codec

    big = torch.finfo(dtype).max
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).clamp(-1, 1) * big
    x[0], x[1, ::2], x[2, 3] = big, -big, -big
    x = x.to(dtype).to(DEVICE)
    for fmt in FORMATS:
        ref, out = reference.quantize(x.cpu(), fmt, 64), triton_codec.quantize(x, fmt, 64)
        y = triton_codec.dequantize(out).cpu()
        assert same_bits(out.codes.cpu(), ref.codes) and same_bits(out.scales.cpu(), ref.scales)
        assert same_bits(y, reference.dequantize(ref)) and torch.isfinite(y).all(), fmt


# fp32 bit patterns for the bf16 rounding: NaNs as NVIDIA GPUs make them (0x7FFFFFFF), negative and
# signalling NaNs, +-inf, the largest finite value, and ties at even and odd bf16 mantissas.
F32_BITS = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000, 0xFFC00000, 0x7FBFFFFF, 0x7F800000, 0xFF800000,
            0x7F7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000,
            0x00008000, 0x00018000, 0x80008000, 0x00000000, 0x80000000, 0x3F800000, 0x00007FFF]


@triton.jit
def _to_bf16_kernel(X, OUT, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0).to(tl.float32, bitcast=True)
    _store_from_f32(OUT, offs, x, mask, KIND=2)


def test_fp32_to_bf16_rounding_is_torchs_and_keeps_nan():
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in F32_BITS], dtype=torch.int32)
    out = torch.zeros(len(F32_BITS), dtype=torch.int16, device=DEVICE)
    _to_bf16_kernel[(1,)](bits.to(DEVICE), out, len(F32_BITS), BLOCK=32)
    got = out.cpu().to(torch.int32) & 0xFFFF
    x = bits.view(torch.float32)
    want = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    nan = x.isnan()
    assert torch.equal(got[~nan], want[~nan]), [hex(v) for v in got[~nan].tolist()]
    assert (got[nan] == 0x7FC0).all(), [hex(v) for v in got[nan].tolist()]  # c10's bf16 NaN, as 0-d .to() gives


@pytest.mark.parametrize("fmt", FORMATS)
def test_flagged_groups_decode_to_nan_in_bf16_whatever_the_nan_bits(fmt):
    """A GPU's NaN (0x7FFFFFFF) in the product used to round to -0.0; here the scale carries it."""
    from hilore_verl.kernels import triton_codec

    x = _x((4, 128), torch.bfloat16)
    x[1, 3], x[2, 100] = float("nan"), float("inf")
    q = triton_codec.quantize(x, fmt, 64)
    for nan_bits in (0x7FFFFFFF, -1, 0x7FC00000):  # -1: 0xFFFFFFFF
        scales = q.scales.clone()
        scales[q.flags.bool()] = torch.tensor(nan_bits, dtype=torch.int32).view(torch.float32).to(scales.device)
        y = triton_codec.dequantize(dataclasses.replace(q, scales=scales)).cpu()
        assert y[1, :64].isnan().all() and y[2, 64:].isnan().all(), hex(nan_bits & 0xFFFFFFFF)
        assert same_bits(y, reference.dequantize(q.to("cpu"))), hex(nan_bits & 0xFFFFFFFF)


SEED_WITH_MIX_ONE = pow(reference._SEED_MUL, -1, 2**31)  # seed_mix(seed) == 1: the kernels' smix is 1
KERNELS = ("_quantize_kernel", "_dequantize_kernel")


def _as_jit_function(kernel):
    """The kernel as compiled mode builds it (under the interpreter: from its source and decorator arguments)."""
    from triton.runtime.jit import JITFunction

    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _kernel_args(name, fmt, kind, gs, stochastic=False, **ints):
    """Arguments by name for one kernel variant: small CPU tensors of the right dtypes (only those and
    the pointers' alignment reach the compiler), integers from `ints` (R, D, R0, G0, smix)."""
    from hilore_verl.kernels import triton_codec

    x = torch.zeros(64, dtype=(torch.float32, torch.float16, torch.int16)[kind])
    codes = torch.zeros(64, dtype=reference.SPECS[fmt].code_dtype)
    values = dict(X=x, OUT=x, CODES=codes, SCALES=torch.zeros(4), FLAGS=torch.zeros(4, dtype=torch.uint8),
                  R=37, D=4 * gs, R0=0, G0=0, smix=12345, GS=gs, BLOCK_R=triton_codec.BLOCK_R,
                  FMT=triton_codec.FMT_CODE[fmt], KIND=kind, STOCHASTIC=stochastic, QMAX=reference.QMAX[fmt])
    values.update(ints)
    return {n: values[n] for n in _as_jit_function(getattr(triton_codec, name)).arg_names}


@pytest.mark.parametrize("name", KERNELS)
def test_integer_arguments_equal_to_one_are_runtime_values_not_constants(name):
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    from hilore_verl.kernels import triton_codec

    jf = _as_jit_function(getattr(triton_codec, name))
    params = {p.name: p for p in jf.params}
    ints = [n for n in ("R", "R0", "G0", "smix") if n in params]
    assert [n for n in ints if not params[n].do_not_specialize] == []
    binder = create_function_from_signature(jf.signature, jf.params, BaseBackend)
    _, spec, _ = binder(**_kernel_args(name, "int8", 2, 64, True, R=1, R0=1, G0=1, smix=1))
    spec = dict(zip(jf.arg_names, spec))
    assert {n: spec[n] for n in ints} == {n: ("i32", None) for n in ints}  # not ("constexpr", 1)
    assert spec["D"] == ("i32", "D")  # D (a multiple of 32) keeps its 16-divisibility hint


def _cuda_ir_failures() -> dict:
    """Every kernel variant compiled to Triton IR for a CUDA target (sm_90), no GPU needed, with the
    integer arguments at 1 and past 2**31: {"failures": [...]} or {"skip": why}. Compiled mode only:
    run in a process without TRITON_INTERPRET."""
    import itertools

    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        from hilore_verl.kernels import triton_codec

        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
    except Exception as e:  # noqa: BLE001 - another Triton's internals: nothing to check against
        return {"skip": f"Triton's compiler API differs here: {type(e).__name__}: {e}"}
    failures = []
    for name, fmt, kind, gs, stochastic, ints in itertools.product(
            KERNELS, FORMATS, (0, 1, 2), GROUP_SIZES, (False, True),
            (dict(R=1, R0=1, G0=1, smix=1), dict(R=2**31 + 7, D=2**32, R0=2**31, G0=0, smix=0))):
        if name == "_dequantize_kernel" and stochastic:
            continue
        args = _kernel_args(name, fmt, kind, gs, stochastic, **ints)
        jf = getattr(triton_codec, name)
        try:
            bound, spec, options = create_function_from_signature(jf.signature, jf.params, backend)(**args)
            options, signature, constexprs, attrs = jf._pack_args(backend, options, bound, spec, options)
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            ASTSource(jf, signature, constexprs, attrs).make_ir(
                target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
        except Exception as e:  # noqa: BLE001 - collected, reported by the test
            while e.__cause__ is not None:  # the compiler's error wraps the one that named the problem
                e = e.__cause__
            failures.append(f"{name} {fmt} kind={kind} gs={gs} stochastic={stochastic} {ints}: "
                            f"{type(e).__name__}: {str(e)[-300:]}")
    return {"failures": failures}


def test_every_kernel_variant_compiles_for_cuda_with_integer_arguments_at_one_and_past_2_31():
    """What the interpreter cannot show: Triton's compiler front end, as on a GPU (a constant smix failed here)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from tests.kernels.test_triton_codecs_on_cpu import _cuda_ir_failures as f; "
            "print(json.dumps(f()))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["failures"] == [], "\n".join(result["failures"][:10])


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_with_the_seed_whose_mix_is_one_and_single_rows(fmt):
    from hilore_verl.kernels import triton_codec

    assert reference.seed_mix(SEED_WITH_MIX_ONE) == 1
    for dtype in DTYPES:
        for shape, seed in (((1, 128), SEED_WITH_MIX_ONE), ((1, 64), 3), ((37, 128), SEED_WITH_MIX_ONE)):
            x = _x(shape, dtype)
            ref = reference.quantize(x.cpu(), fmt, 32, stochastic=True, seed=seed)
            out = triton_codec.quantize(x, fmt, 32, stochastic=True, seed=seed)
            _assert_same(out, ref, triton_codec.dequantize(out), (dtype, shape))


def test_launches_stay_within_cudas_grid_limits_and_cover_every_tile():
    from hilore_verl.kernels import triton_codec

    for R, G in ((1, 1), (37, 4), (2**37 + 5, 70000), (3, 65535 * 2 + 1)):
        launches = triton_codec.launches(R, G)
        assert all(g[0] <= 2**31 - 1 and g[1] <= 65535 for _, _, g in launches), (R, G)
        blocks = triton.cdiv(R, triton_codec.BLOCK_R)
        assert sum(g[0] * g[1] for _, _, g in launches) == blocks * G, (R, G)
        assert {(r0, g0) for r0, g0, _ in launches} == {(b * 32 * (2**31 - 1), g * 65535)
                                                         for b in range(triton.cdiv(blocks, 2**31 - 1))
                                                         for g in range(triton.cdiv(G, 65535))}
    assert triton_codec.launches(37, 4) == [(0, 0, (2, 4))]  # one launch below the limits


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tensor_past_the_grid_limits_takes_several_launches_bitwise_the_reference(fmt, monkeypatch):
    from hilore_verl.kernels import triton_codec

    monkeypatch.setattr(triton_codec, "MAX_GRID", (2, 3))  # 3 row blocks x 16 groups: 2 x 6 launches
    calls = []
    real = triton_codec._launch
    monkeypatch.setattr(triton_codec, "_launch", lambda k, R, G, *a, **m: calls.append(len(triton_codec.launches(R, G)))
                        or real(k, R, G, *a, **m))
    x = _x((70, 512), torch.bfloat16)
    x[69, 500] = float("nan")
    for stochastic in (False, True):
        ref = reference.quantize(x.cpu(), fmt, 32, stochastic, seed=5)
        out = triton_codec.quantize(x, fmt, 32, stochastic, seed=5)
        _assert_same(out, ref, triton_codec.dequantize(out), stochastic)
    assert calls == [12, 12, 12, 12]


NO_COMPILER = "Failed to find C compiler. Please specify via CC environment variable or set triton.knobs.build.impl."


class _NoLauncher:
    """A kernel whose launch raises, as Triton's does where its launcher cannot be built."""

    def __init__(self, error):
        self.error = error

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise self.error
        return launch


@pytest.fixture
def fresh_status(monkeypatch):
    from hilore_verl.kernels import triton_guard

    monkeypatch.setattr(triton_guard, "_STATUS", {})
    return triton_guard


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "hilore_verl" and r.levelname == "WARNING"]


def test_the_launch_check_passes_here_and_is_cached(fresh_status):
    triton_guard = fresh_status
    assert triton_guard.triton_status(DEVICE) == (True, "")
    assert list(triton_guard._STATUS) == [triton_guard._key(DEVICE)] and triton_guard.triton_status(DEVICE)[0]
    assert triton_guard.bitwise_check(DEVICE) == (True, "")


def test_no_launcher_falls_back_to_the_reference_with_one_warning_naming_the_compiler(fresh_status, monkeypatch,
                                                                                      caplog):
    from hilore_verl.kernels import triton_codec

    triton_guard = fresh_status
    monkeypatch.delenv("CC", raising=False)  # and no gcc, clang or cc on PATH
    monkeypatch.setattr(triton_guard.shutil, "which", lambda name: None)
    for name in KERNELS:
        monkeypatch.setattr(triton_codec, name, _NoLauncher(RuntimeError(NO_COMPILER)))
    x = _x((37, 128), torch.bfloat16)
    with caplog.at_level("WARNING", logger="hilore_verl"):
        for fmt in FORMATS:
            for stochastic in (False, True):
                ref = reference.quantize(x.cpu(), fmt, 64, stochastic, seed=3)
                out = triton_guard.quantize(x, fmt, 64, stochastic, seed=3)
                _assert_same(out, ref, triton_guard.dequantize(out), fmt)
    ok, reason = triton_guard.triton_status(DEVICE)
    assert not ok and "Failed to find C compiler" in reason and "missing: a C compiler" in reason, reason
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert reason in _warnings(caplog)[0] and "use the torch reference codec instead" in _warnings(caplog)[0]


def test_a_launch_failing_after_the_check_passed_falls_back_once(fresh_status, monkeypatch, caplog):
    from hilore_verl.kernels import triton_codec

    triton_guard = fresh_status
    x = _x((4, 128), torch.float32)
    assert triton_guard.triton_status(DEVICE)[0]
    monkeypatch.setattr(triton_codec, "_quantize_kernel", _NoLauncher(RuntimeError("a compile error")))
    with caplog.at_level("WARNING", logger="hilore_verl"):
        for _ in range(3):
            out = triton_guard.quantize(x, "fp8", 32)
            assert same_bits(out.codes.cpu(), reference.quantize(x.cpu(), "fp8", 32).codes)
    assert len(_warnings(caplog)) == 1 and "a compile error" in _warnings(caplog)[0]
    assert not triton_guard.triton_status(DEVICE)[0]


def test_out_of_memory_is_raised_not_taken_for_a_missing_launcher(fresh_status, monkeypatch):
    from hilore_verl.kernels import triton_codec

    triton_guard = fresh_status
    x = _x((4, 128), torch.float32)
    assert triton_guard.triton_status(DEVICE)[0]
    monkeypatch.setattr(triton_codec, "_quantize_kernel", _NoLauncher(torch.OutOfMemoryError("out of memory")))
    with pytest.raises(torch.OutOfMemoryError):  # the runtime's retry handles it; the kernels stay in use
        triton_guard.quantize(x, "int8", 64)
    assert triton_guard.triton_status(DEVICE) == (True, "")


def test_the_reason_names_each_missing_piece(fresh_status, monkeypatch, tmp_path):
    triton_guard = fresh_status
    monkeypatch.setattr(triton_guard.sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path)})
    monkeypatch.setattr(triton_guard, "_libcuda_dirs", lambda: (_ for _ in ()).throw(AssertionError("libcuda.so")))
    monkeypatch.setattr(triton_guard.ctypes.util, "find_library", lambda name: None)
    monkeypatch.delenv("CC", raising=False)  # and no gcc, clang or cc on PATH
    monkeypatch.setattr(triton_guard.shutil, "which", lambda name: None)
    reason = triton_guard.failure_reason("cuda:0", RuntimeError(NO_COMPILER))
    assert reason.startswith("Triton cannot launch its kernels on cuda:0 (RuntimeError: Failed to find C compiler")
    assert "missing: a C compiler (Triton builds its launcher with $CC, gcc or clang)" in reason
    assert f"Python.h (looked in {tmp_path})" in reason and "libcuda.so.1 (the NVIDIA driver library)" in reason
    fixes = dict(triton_guard.missing_pieces())
    assert "install gcc or clang, or set CC" in fixes.values() and any("python3-dev" in f for f in fixes.values())
    monkeypatch.setattr(triton_guard.shutil, "which", lambda name: "/usr/bin/cc" if name == "cc" else None)
    assert "set CC=/usr/bin/cc (Triton looks for $CC, gcc, clang)" in dict(triton_guard.missing_pieces()).values()
    monkeypatch.setenv("CC", "no-such-cc")
    assert "the C compiler CC=no-such-cc (not found)" in dict(triton_guard.missing_pieces())
    monkeypatch.setattr(triton_guard.ctypes.util, "find_library", lambda name: "libcuda.so.1")
    assert any("TRITON_LIBCUDA_PATH" in f for f in dict(triton_guard.missing_pieces()).values())
    monkeypatch.setattr(triton_guard.shutil, "which", lambda name: "/usr/bin/" + name)
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setattr(triton_guard, "_libcuda_dirs", lambda: ["/usr/lib"])
    assert triton_guard.missing_pieces() == []
    assert triton_guard.failure_reason("cuda:0", RuntimeError("boom")) == \
        "Triton cannot launch its kernels on cuda:0 (RuntimeError: boom)"


def test_a_cpu_device_without_the_interpreter_is_not_a_triton_device(fresh_status, monkeypatch):
    triton_guard = fresh_status
    monkeypatch.setattr(triton_guard, "_interpreted", lambda: False)
    assert triton_guard.triton_status("cpu") == (False, "the Triton kernels run on CUDA devices only, not on cpu")

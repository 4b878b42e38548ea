"""torch.optim's contract, kept by every one of our AdamW variants on both paths.

Each test states a behaviour of ``torch.optim.AdamW`` (or of ``torch.optim.Optimizer``, which it inherits) and holds
ours to it, with torch's AdamW run alongside as the reference where a comparison means something: for every variant
in ``optimizers.VARIANTS``, on the plain-PyTorch path (``backend='torch'``) and on the Triton kernel, which runs on
CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it).
The interpreter costs ~0.15 s per launch whatever the tensor's size, so the problems are a few blocks and steps.
"""

import copy
import importlib
import inspect
import os
import pickle
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import optimizers
from conftest import REPO_ROOT


def variants() -> list:
    """The classes under test: every registered variant (read at collection time)."""
    return [v.cls for v in optimizers.VARIANTS.values()]


VARIANTS = variants()
IDS = list(optimizers.VARIANTS)
BACKENDS = ["torch", "triton"]
# Relative error of the total update against fp32 torch.optim.AdamW on these few-step problems (Variant.tol_contract:
# a margin over the largest measured here, 16-bit 0.001, 8-bit 0.018, FP8 0.019, 4-bit 0.18); a frozen or lost
# parameter gives ~1.
TOL = {v.cls: v.tol_contract for v in optimizers.VARIANTS.values()}


def _quantizes(cls) -> bool:
    return "min_quant_numel" in inspect.signature(cls.__init__).parameters


def _small(cls):
    """Quantize tensors of a few blocks too (by default those under 4096 elements keep fp32 states)."""
    return {"min_quant_numel": 64} if _quantizes(cls) else {}


def resolve(component: str) -> type:
    """The class a config's ``_component_`` path names."""
    module, _, name = component.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _grads(shapes, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]


def _stepped_twice(cls, backend, shapes, grads):
    """Fresh parameters and an optimizer of ``cls`` over them, stepped on the first two of ``grads``."""
    ps = _params(shapes)
    opt = cls(ps, lr=0.05, backend=backend, **_small(cls))
    for gs in grads[:2]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def _rel_err(got, ref, init):
    """|got - ref| / |ref - init| over all tensors: the error of the total update."""
    num = sum(float((a.detach().float() - r.detach().float()).norm() ** 2) for a, r in zip(got, ref))
    den = sum(float((r.detach().float() - x.detach().float()).norm() ** 2) for r, x in zip(ref, init))
    return (num / den) ** 0.5


def _state_tensors(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


def _assert_same_states(a, b):
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


# -------------------------------------------------------------------------------------------------------
# Triton is optional
# -------------------------------------------------------------------------------------------------------

# Run in-process and in a subprocess that cannot import Triton: a few steps of every variant on the default path.
_STEPS = """
def run(cls, **kw):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((4, 128), (40,))]
    small = "min_quant_numel" in inspect.signature(cls.__init__).parameters
    opt = cls(ps, lr=0.05, min_quant_numel=64, **kw) if small else cls(ps, lr=0.05, **kw)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in ps]
"""

_WITHOUT_TRITON = """
import importlib
import inspect
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as where Triton is not installed
import torch
import optimizers
from optimizers import _triton
assert not _triton.HAVE_TRITON
exec(STEPS)
out = {}
for name in NAMES:
    module, _, attr = name.rpartition(".")
    out[name] = run(getattr(importlib.import_module(module), attr))
try:
    optimizers.AdamW8bit([torch.nn.Parameter(torch.zeros(8))], backend="triton")
    out["error"] = None
except RuntimeError as e:
    out["error"] = str(e)
torch.save(out, OUT)
"""


def test_imports_and_steps_without_triton(tmp_path):
    """`pip install -e .` without the test extra has no Triton: the package must import and the plain path step as it
    does with Triton installed (backend='torch' here); asking for the Triton path says how to get it."""
    out_file = tmp_path / "out.pt"
    names = [v.component for v in optimizers.VARIANTS.values()]
    code = f"STEPS = {_STEPS!r}\nNAMES = {names!r}\nOUT = {str(out_file)!r}\n" + _WITHOUT_TRITON
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(out_file, weights_only=True)
    ns = {"torch": torch, "optimizers": optimizers, "inspect": inspect}
    exec(_STEPS, ns)
    for name in names:
        for a, b in zip(out[name], ns["run"](resolve(name), backend="torch")):
            assert torch.equal(a, b), name
    assert out["error"] is not None and "pip install triton" in out["error"] and "backend='torch'" in out["error"]


# -------------------------------------------------------------------------------------------------------
# param groups
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_add_param_group_after_the_first_step(cls, backend):
    """torch: a group added after some steps trains from then on like any other; its params start without state.
    Ours must train them exactly as if they had been in the optimizer from the start without a grad until then."""
    shapes = [(4, 128), (4, 128), (40,)]
    steps = 3
    grads = _grads(shapes, steps)
    new_group = {"lr": 0.02, "weight_decay": 0.3}

    def run(make, late):
        ps = _params(shapes)
        groups = [{"params": ps[:1]}] + ([] if late else [{"params": ps[1:], **new_group}])
        opt = make(groups)
        for s in range(steps):
            if late and s == 1:
                opt.add_param_group({"params": ps[1:], **new_group})
            for k, (p, g) in enumerate(zip(ps, grads[s])):
                p.grad = g.clone() if k == 0 or s >= 1 else None
            opt.step()
        return ps, opt

    ours = lambda groups: cls(groups, lr=0.05, backend=backend, **_small(cls))  # noqa: E731
    ref, _ = run(lambda groups: torch.optim.AdamW(groups, lr=0.05), late=True)
    late, opt = run(ours, late=True)
    start, _ = run(ours, late=False)
    for a, b in zip(late, start):
        assert torch.equal(a, b)
    assert [float(opt.state[p]["step"]) for p in late] == [3.0, 2.0, 2.0]
    assert _rel_err(late[1:], ref[1:], _params(shapes)[1:]) < TOL[cls]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_an_empty_param_group_is_allowed(cls, backend):
    """torch accepts a group with no params (and an optimizer whose groups are all empty) and steps the others."""
    shapes = [(4, 128), (40,)]
    grads = _grads(shapes, 2)

    def run(make, empty_first):
        ps = _params(shapes)
        opt = make([{"params": []}, {"params": ps}] if empty_first else [{"params": ps}])
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        return ps

    ours = lambda groups: cls(groups, lr=0.05, backend=backend, **_small(cls))  # noqa: E731
    ref = run(lambda groups: torch.optim.AdamW(groups, lr=0.05), True)
    got = run(ours, True)
    for a, b in zip(got, run(ours, False)):
        assert torch.equal(a, b)
    assert _rel_err(got, ref, _params(shapes)) < TOL[cls]
    for make in (lambda groups: torch.optim.AdamW(groups), ours):
        make([{"params": []}]).step()  # nothing to do


# -------------------------------------------------------------------------------------------------------
# parameters and gradients
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_complex_parameters_train_as_their_real_view(cls, backend):
    """torch.optim.AdamW updates a complex parameter as torch.view_as_real of it (real and imaginary parts are two
    independent reals, each with its own moments)."""
    g = torch.Generator().manual_seed(0)
    init = torch.randn(4, 64, dtype=torch.complex64, generator=g)  # 512 reals
    grads = [torch.randn(4, 64, dtype=torch.complex64, generator=g) for _ in range(3)]

    def run(make, real):
        p = torch.nn.Parameter(torch.view_as_real(init).clone() if real else init.clone())
        opt = make([p])
        for gr in grads:
            p.grad = torch.view_as_real(gr).clone() if real else gr.clone()
            opt.step()
        return p.detach()

    ours = lambda ps: cls(ps, lr=0.05, backend=backend, **_small(cls))  # noqa: E731
    got = run(ours, False)
    assert got.dtype == torch.complex64
    assert torch.equal(torch.view_as_real(got), run(ours, True))
    ref = run(lambda ps: torch.optim.AdamW(ps, lr=0.05), False)
    assert _rel_err([torch.view_as_real(got)], [torch.view_as_real(ref)], [torch.view_as_real(init)]) < TOL[cls]
    assert (got.imag != init.imag).all()


# One finite gradient element whose square overflows fp32 ((1 - b2) g^2 >= 3.4e38 from |g| ~ 6e20), and the largest
# finite one. torch loses that element only (its v becomes inf, so it never moves again); the rest of the tensor is
# unaffected.
HUGE = [(3, 5, 1e21), (6, 200, -3.4e38)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_a_huge_gradient_element_spoils_no_other(cls, backend):
    """One huge but finite gradient element must not make its block's scale infinite (the rest of the block would
    never move again) or write NaN anywhere: ours skips and counts it like a NaN gradient (the guard covers squares
    that overflow), and its block's other elements keep tracking torch.optim.AdamW."""
    shape, steps, at = (8, 256), 4, 1

    def run(make, bad):
        (p,) = _params([shape])
        opt = make([p])
        for s, (g,) in enumerate(_grads([shape], steps)):
            if s == at:
                for r, c, val in HUGE:
                    g[r, c] = bad if bad is not None else val
            p.grad = g
            opt.step()
        return p.detach(), opt

    ours = lambda ps: cls(ps, lr=0.05, backend=backend, **_small(cls))  # noqa: E731
    got, opt = run(ours, None)
    assert torch.isfinite(got).all()
    for key, val in opt.state[opt.param_groups[0]["params"][0]].items():
        assert torch.isfinite(val.float()).all(), key
    assert int(opt.nonfinite_count) == len(HUGE)
    nan_run, nan_opt = run(ours, float("nan"))
    assert torch.equal(got, nan_run)  # exactly as if those gradients had been NaN
    (init,) = _params([shape])
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, lr=0.05), None)
    others = torch.ones(shape, dtype=torch.bool)
    for r, c, _ in HUGE:
        others[r, c] = False
        # the huge element's own block (128 elements for 4-bit, 256 for the others: the first 128 are in both)
        lo = c // 128 * 128
        block = (slice(r, r + 1), slice(lo, lo + 128))
        keep = others[block]
        err = _rel_err([got[block][keep]], [ref[block][keep]], [init[block][keep]])
        assert err < TOL[cls], f"the rest of the block at ({r}, {c}) is {err:.2f} off fp32 AdamW"
    assert _rel_err([got[others]], [ref[others]], [init[others]]) < TOL[cls]


# -------------------------------------------------------------------------------------------------------
# copies, checkpoints, hooks
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_a_copy_steps_like_the_original(cls, backend, how):
    """copy.deepcopy(opt) and a pickle round trip (torch.save(opt), multiprocessing) give an optimizer over copies of
    the parameters that steps exactly as the original does, as torch's optimizers do."""
    shapes = [(4, 128), (40,)]
    grads = _grads(shapes, 4)
    ps, opt = _stepped_twice(cls, backend, shapes, grads)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    qs = twin.param_groups[0]["params"]
    assert all(p is not q and torch.equal(p, q) for p, q in zip(ps, qs))
    for name in ("backend", "format", "min_quant_numel", "stochastic_round", "compensate"):
        assert getattr(twin, name) == getattr(opt, name), name
    for gs in grads[2:]:
        for p, q, g in zip(ps, qs, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    _assert_same_states(_state_tensors(opt, ps), _state_tensors(twin, qs))
    assert int(twin.nonfinite_count) == int(opt.nonfinite_count)


@pytest.mark.parametrize("cls", VARIANTS + [torch.optim.AdamW], ids=IDS + ["torch.optim.AdamW"])
def test_load_state_dict_runs_registered_hooks(cls):
    """Optimizer.register_load_state_dict_pre_hook / _post_hook (and the state_dict ones): the pre hook may return
    a replacement state dict, which is what gets loaded; the post hook runs after loading. Host logic: one path."""
    kw = {"backend": "torch"} if issubclass(cls, optimizers._optimizer.LowBitAdamW) else {}
    (p,) = _params([(4, 128)])
    opt = cls([p], lr=0.05, **kw)
    p.grad = torch.ones_like(p)
    opt.step()
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd-post"))
    sd = opt.state_dict()

    def pre(o, state_dict):
        calls.append("pre")
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [dict(g, lr=0.125) for g in state_dict["param_groups"]]
        return state_dict

    opt2 = cls([torch.nn.Parameter(p.detach().clone())], lr=0.05, **kw)
    opt2.register_load_state_dict_pre_hook(pre)
    opt2.register_load_state_dict_post_hook(lambda o: calls.append(("post", o.param_groups[0]["lr"])))
    opt2.load_state_dict(sd)
    assert calls == ["sd-pre", "sd-post", "pre", ("post", 0.125)]
    assert sd["param_groups"][0]["lr"] == 0.05  # the caller's dict is left alone


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_a_step_count_saved_as_a_number_loads(cls, backend):
    """torch.optim.AdamW loads a state whose 'step' is a Python number (older checkpoints, hand-built states) as
    well as a tensor; ours must too, and continue exactly as from the tensor."""
    shapes = [(4, 128), (40,)]
    grads = _grads(shapes, 3)
    ps, opt = _stepped_twice(cls, backend, shapes, grads)
    sd = opt.state_dict()
    as_number = dict(
        sd, state={k: dict(v, step=int(v["step"]) if k == 0 else float(v["step"])) for k, v in sd["state"].items()}
    )
    torch_opt = torch.optim.AdamW(_params(shapes))
    torch_opt.load_state_dict(
        dict(
            torch_opt.state_dict(),
            state={0: {"step": 2.0, "exp_avg": torch.zeros(4, 128), "exp_avg_sq": torch.zeros(4, 128)}},
        )
    )
    out = []
    for state in (sd, as_number):
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        o = cls(qs, lr=0.05, backend=backend, **_small(cls))
        o.load_state_dict(state)
        for q, g in zip(qs, grads[2]):
            q.grad = g.clone()
        o.step()
        assert [float(o.state[q]["step"]) for q in qs] == [3.0, 3.0]
        out.append(qs)
    for a, b in zip(*out):
        assert torch.equal(a, b)


# -------------------------------------------------------------------------------------------------------
# constructor
# -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "betas", [(0.9, torch.tensor(0.99)), (torch.tensor(0.9), 0.99)], ids=["float-tensor", "tensor-float"]
)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_betas_mixing_a_float_and_a_tensor_are_refused_like_torch(cls, betas):
    p = [torch.nn.Parameter(torch.zeros(8))]
    with pytest.raises(ValueError, match="both floats or both Tensors"):
        torch.optim.AdamW(p, betas=betas)
    with pytest.raises(ValueError, match="both floats or both Tensors"):
        cls(p, betas=betas)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_betas_as_tensors_equal_betas_as_floats(cls, backend):
    """torch accepts both betas as one-element tensors; they mean the same as the floats (values exact in fp32, the
    tensors' dtype)."""
    out = []
    for betas in ((0.75, 0.9375), (torch.tensor(0.75), torch.tensor([0.9375]))):
        (p,) = _params([(4, 128)])
        opt = cls([p], lr=0.05, betas=betas, backend=backend, **_small(cls))
        for (g,) in _grads([(4, 128)], 2):
            p.grad = g
            opt.step()
        out.append(p.detach())
    assert torch.equal(*out)


# -------------------------------------------------------------------------------------------------------
# stacked experts: an expert that received no token
# -------------------------------------------------------------------------------------------------------


def _moments(opt, p) -> dict:
    """fp32 ``exp_avg`` and ``exp_avg_sq`` of ``p``'s state, shaped as ``p``: torch's own, or what ours decode to."""
    from optimizers import portable

    if isinstance(opt, torch.optim.AdamW):
        return {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
    state = opt.state_dict()
    entry, group = state["state"][0], state["param_groups"][0]
    decoded = portable.moments(entry, portable.saved_format(entry, group), p.numel())
    return {k: v.reshape(p.shape) for k, v in decoded.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", VARIANTS, ids=IDS)
def test_a_zero_gradient_slice_decays_its_moments_and_moves(cls, backend):
    """A mixture of experts holds its experts stacked, [E, rows, cols] (finetune/model/moe.py), so an expert that
    received no token in a step has a zero slice in the gradient, not a missing gradient. torch's AdamW then decays
    that slice's moments (m by beta1, v by beta2) and still moves it by the decayed momentum; every variant does the
    same, with blocks of 128 or 256 elements that run across the experts' boundaries (960 elements each)
    (docs/models.md, "Mixture of experts"). Bounds: the slice's update and moments against torch's within 1.5 x the
    variant's TOL (one expert over two idle steps: its moments' quantization error, with no gradient to average it
    out; 4-bit measures 0.35 for the update); the decay itself, as the ratio of the first moment's norms, within 5 %
    (a variant that skipped the slice, reset its moments or kept them undecayed fails one of these)."""
    shape, idle = (4, 24, 40), 1
    grads = _grads([shape], 3)
    for step in grads[1:]:  # expert 1 gets tokens at the first step only
        step[0][idle].zero_()

    def run(make):
        (p,) = _params([shape])
        opt, after = make([p]), []
        for (g,) in grads:
            p.grad = g.clone()
            opt.step()
            after.append((p.detach().clone(), _moments(opt, p)))
        return after

    ref = run(lambda ps: torch.optim.AdamW(ps, lr=0.05))
    ours = run(lambda ps: cls(ps, lr=0.05, backend=backend, **_small(cls)))
    bound = 1.5 * TOL[cls]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    moved, ref_moved = ours[2][0][idle] - ours[0][0][idle], ref[2][0][idle] - ref[0][0][idle]
    assert rel(moved, ref_moved) < bound
    for key in ("exp_avg", "exp_avg_sq"):
        assert rel(ours[2][1][key][idle], ref[2][1][key][idle]) < bound, key
    decay = float(ours[2][1]["exp_avg"][idle].norm() / ours[0][1]["exp_avg"][idle].norm())
    assert decay == pytest.approx(0.9**2, rel=0.05)

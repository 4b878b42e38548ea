"""``LowBitAdamW``: the ``torch.optim.Optimizer`` every public class derives from, choosing only its format.

It owns the parameter loop, the state (``_buckets.py``), ``state_dict`` / ``load_state_dict``, and the choice between
the two paths:

- the plain-PyTorch path (``backend="torch"``, ``_plain.py``): the kernel's math in torch ops, readable, runs
  anywhere. It is the reference the tests hold the kernel to, and the path on CPU (in cache-sized chunks, for speed
  there).
- the Triton path (``backend="triton"``, ``_launch.TritonPath``): one multi-tensor kernel launch (``_kernel.py``) per
  bucket of parameters (same device, same dtype, same format) updates every parameter of the step. No torch.compile,
  so the first step costs only Triton's compile (cached on disk afterwards).

Non-finite gradients: an element whose gradient is NaN or +-inf, or so large that its square would overflow fp32
(|g| > 2^63, ``_kernel.G_MAX``), is not updated at all (its weight, moments and error buffer keep their values) and
is counted in ``optimizer.nonfinite_count`` (a device tensor, so no host sync). torch.optim.AdamW would instead write
NaN into the weight and both moments (for a huge finite g: an inf v, and that element never moves again); with
quantized states one NaN or inf would also poison the scale of its whole block, so we never let it in.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from typing import Callable, Optional

import torch
from torch.optim import Optimizer

from . import _plain
from ._buckets import Bucket, local
from ._format import StateFormat
from ._launch import _GRAD, _NONES, TritonPath
from ._triton import HAVE_TRITON, INSTALL_HINT
from ._unquantized import FORMAT_FP32


class LowBitAdamW(TritonPath, Optimizer):
    """AdamW with the state format chosen by a subclass. Use the public classes, not this one."""

    FORMAT: StateFormat = None  # set by each public class

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        backend: str = "auto",
        min_quant_numel: int = 4096,
        stochastic_round: Optional[bool] = None,
        compensate: bool = False,
        tile_blocks: Optional[int] = None,
        num_warps: Optional[int] = None,
        programs_per_sm: Optional[int] = None,
        _format: Optional[StateFormat] = None,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"lr must be a float or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        if not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {float(lr)} (must be >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor) and b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {float(b)} (must be in [0, 1))")
        # torch.optim.AdamW's rule, in its words
        if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)):
            raise ValueError("betas must be either both floats or both Tensors")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if amsgrad:
            raise NotImplementedError(f"{type(self).__name__} does not implement amsgrad; use torch.optim.AdamW")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if backend == "triton" and not HAVE_TRITON:
            raise RuntimeError(f"backend='triton' needs Triton: {INSTALL_HINT}")
        if stochastic_round is None:
            # On unless compensate is asked for: the two are alternative cures for the same loss (see
            # docs/optimizers.md, "bf16 weights"), and without either a bf16 weight drops every update below half an
            # ulp of itself. Applies to bf16 weights only.
            stochastic_round = not compensate
        elif stochastic_round and compensate:
            raise ValueError("stochastic_round and compensate are alternatives; pick one")
        self.format = _format or self.FORMAT
        self.backend = backend
        self.min_quant_numel = int(min_quant_numel)
        self.stochastic_round = bool(stochastic_round)
        self.compensate = bool(compensate)
        self.tile_blocks = tile_blocks  # Triton tuning knobs (bench/optimizer_step.py sweeps them); None = default
        self.num_warps = num_warps
        self.programs_per_sm = programs_per_sm
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=maximize,
            state_format=self.format.name,
        )
        super().__init__(params, defaults)
        self._buckets: Optional[list[Bucket]] = None
        self._seed = 0
        self.nonfinite_count: Optional[torch.Tensor] = None

    # -- state -------------------------------------------------------------------------------------------

    def param_format(self, p: torch.Tensor) -> StateFormat:
        """The format this optimizer keeps ``p``'s state in (public: a checkpoint's conversions, optimizers.portable,
        take it per parameter)."""
        # (a DTensor's global size, so that every rank picks the same format; a complex tensor's count of reals)
        if self.format.scaled and p.numel() * (2 if p.is_complex() else 1) < self.min_quant_numel:
            return FORMAT_FP32  # tiny tensors (norms, biases): full-precision states cost nothing and lose nothing
        return self.format

    def _init_state(self) -> None:
        self._buckets = []
        self._add_buckets([p for group in self.param_groups for p in group["params"]])

    def _add_buckets(self, params: list) -> None:
        """State buffers for ``params``, which have none yet: all params at the first step, or a group added by
        ``add_param_group`` after it (in buckets of its own: the existing flat buffers cannot grow in place)."""
        groups: dict = {}
        for p in params:
            if not local(p).is_contiguous():
                raise ValueError(
                    f"{type(self).__name__} needs contiguous parameters; got one of shape "
                    f"{tuple(p.shape)} with strides {local(p).stride()}"
                )
            fmt = self.param_format(p)
            key = (local(p).device, local(p).dtype, fmt.name)
            groups.setdefault(key, (fmt, []))[1].append(p)
        new = []
        for (device, dtype, _), (fmt, ps) in groups.items():
            compensate = self.compensate and dtype in (torch.bfloat16, torch.float16)
            b = Bucket(fmt, ps, device, compensate)
            self._link_state(b)
            new.append(b)
        if self.nonfinite_count is None or (new and not self._buckets):
            # on the params' device, for the kernel's atomic add (a CPU placeholder while there are none)
            dev = local(params[0]).device if params else torch.device("cpu")
            self.nonfinite_count = torch.zeros(1, dtype=torch.int32, device=dev)
        # largest first: the big bucket's first launch is not held up by the host work of small ones
        self._buckets = sorted(self._buckets + new, key=lambda b: -b.total)
        group_index = {id(p): k for k, group in enumerate(self.param_groups) for p in group["params"]}
        for b in new:
            b.group_of = [group_index[id(p)] for p in b.params]
            b.one_group = len(set(b.group_of)) == 1

    def _link_state(self, b: Bucket) -> None:
        """``self.state[p]`` of the bucket's params: views of its buffers (and of its step counts)."""
        for i, p in enumerate(b.params):
            st = self.state[p]
            st["step"] = b.step_all[i]
            st.update(b.views(i))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and after the first step the new params get their state at once, as if they had been there
        from the start without a grad so far (torch.optim.Optimizer.__init__ calls this before our state exists)."""
        super().add_param_group(param_group)
        if getattr(self, "_buckets", None) is not None:
            self._add_buckets(self.param_groups[-1]["params"])

    # -- copies ------------------------------------------------------------------------------------------

    # Ours, beyond the defaults, state and param groups that torch.optim.Optimizer.__getstate__ keeps
    _COPIED = (
        "format",
        "backend",
        "min_quant_numel",
        "stochastic_round",
        "compensate",
        "tile_blocks",
        "num_warps",
        "programs_per_sm",
        "_buckets",
        "_seed",
        "nonfinite_count",
    )

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickle (torch.save(optimizer), multiprocessing): torch's state plus ours."""
        state = super().__getstate__()
        state.update((k, self.__dict__[k]) for k in self._COPIED)
        if self._buckets is not None:
            # self.state holds views of the buckets' buffers: pickle would write each view out as a tensor of its
            # own (twice the bytes, and no longer views). __setstate__ makes them again from the buckets.
            state["state"] = defaultdict(dict)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for b in self.__dict__.get("_buckets") or ():
            self._link_state(b)

    # -- step --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._buckets is None:
            self._init_state()
        self._seed += 1
        plain = []  # the plain path's parameters (ParamJob), updated together after the loop
        # Host work is per step and per parameter (291 tensors for Llama2-7B), on the critical path whenever the
        # GPU waits for it (~1 ms of a 16-20 ms step on the H200's host): keep it to C-level list walks. The step
        # counts are bumped and read in one op each; in the usual case (all grads present, one param group, one
        # step count) the one hyper-parameter row goes to the kernel as arguments, with no table upload, and a
        # large bucket on the GPU takes _step_early, which starts the GPU before walking most of the grads.
        for b in self._buckets:
            if self._step_early(b):
                continue
            grads = list(map(_GRAD, b.params))
            if not any(map(operator.is_, grads, _NONES)):
                active = b.all_active
                b.step_all += 1
            else:
                # As torch's AdamW: a parameter without a gradient is skipped (no moment decay, no step count); a
                # zero gradient is a step like any other. So a mixture of experts' expert that got no token (a zero
                # slice of its stacked weights' gradient: docs/models.md, "Mixture of experts") has its moments
                # decayed and moves by its momentum, in every format.
                active = tuple(i for i, g in enumerate(grads) if g is not None)
                if not active:
                    continue
                b.step_all[list(active)] += 1
                grads = [grads[i] for i in active]
            steps = b.read_steps()
            if b.one_group and len(active) == len(steps) and b.uniform_t is not None:
                rows, idx = [self._hp_row(b.group_of[0], steps[0])], None
            else:
                rows, row_of, idx = [], {}, []
                for i in active:
                    key = (b.group_of[i], steps[i])
                    r = row_of.get(key)
                    if r is None:
                        r = row_of[key] = len(rows)
                        rows.append(self._hp_row(*key))
                    idx.append(r)
            if self._use_triton(b.device):
                self._step_triton(b, active, grads, rows, idx)
            else:
                for j, i in enumerate(active):
                    if local(grads[j]).is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    hp = rows[idx[j] if idx is not None else 0]
                    st = self.state[b.params[i]]
                    plain.append(_plain.param_job(b, i, st, hp, self._seed, self.stochastic_round))
        if plain:  # every bucket's parameters, chunk by chunk (_plain.py)
            bad = _plain.step(plain)
            if bad:
                self.nonfinite_count += bad
        return loss

    def _hp_row(self, group_index: int, t: int) -> list:
        """The kernel's fp32 hyper-parameter row for a param group at step count t (see ``_adamw_kernel``)."""
        g = self.param_groups[group_index]
        b1, b2 = (float(x) for x in g["betas"])
        lr = float(g["lr"])
        return [
            lr,
            float(g["weight_decay"]),
            b1,
            b2,
            float(g["eps"]),
            lr / (1.0 - b1**t),
            1.0 / math.sqrt(1.0 - b2**t),
            -1.0 if g["maximize"] else 1.0,
        ]

    # -- checkpointing -----------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by ``state_dict()`` of the same class, on any device.

        torch's generic loader would cast the uint8 codes to the parameter dtype, so we copy each saved tensor
        into our flat buffers instead, after checking the format, parameter count and shapes. As torch's, it runs
        the hooks registered with ``register_load_state_dict_pre_hook`` (which may return a replacement for the
        state dict) and ``register_load_state_dict_post_hook``.
        """
        state_dict = state_dict.copy()  # shallow, as torch's: a pre hook may change it, the caller's stays as is
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state has {len(saved_groups)} param groups, this optimizer has {len(self.param_groups)}"
            )
        for sg, g in zip(saved_groups, self.param_groups):
            fmt = sg.get("state_format", "<none: not an optimizers.* state>")
            if fmt != self.format.name:
                raise ValueError(
                    f"cannot load optimizer state of format {fmt!r} into {type(self).__name__} (format "
                    f"{self.format.name!r}); load it with the optimizer that saved it, or start the optimizer "
                    f"state afresh"
                )
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"loaded param group has {len(sg['params'])} params, this one has {len(g['params'])}")
        if self._buckets is None:
            self._init_state()
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for sg in saved_groups for i in sg["params"]]
        for pid, p in zip(ids, params):
            saved = state_dict["state"].get(pid)
            if saved is None:
                continue
            st = self.state[p]
            for key, val in saved.items():
                if key not in st:
                    raise ValueError(
                        f"unexpected optimizer state entry {key!r} for a parameter of shape "
                        f"{tuple(p.shape)}; was it saved with other options (compensate=...)?"
                    )
                if key == "step":  # into the bucket's step tensor, of which st["step"] is a view
                    # a tensor or, as torch.optim.AdamW also takes, a number
                    step = val.detach().to("cpu", torch.float32) if isinstance(val, torch.Tensor) else float(val)
                    st["step"].copy_(torch.as_tensor(step).reshape(()))
                    continue
                if not isinstance(val, torch.Tensor):
                    raise ValueError(
                        f"optimizer state {key!r} for a parameter of shape {tuple(p.shape)} is a "
                        f"{type(val).__name__}, expected a tensor"
                    )
                if val.shape != st[key].shape or val.dtype != st[key].dtype:
                    raise ValueError(
                        f"optimizer state {key!r} for a parameter of shape {tuple(p.shape)}: saved "
                        f"{tuple(val.shape)} {val.dtype}, expected {tuple(st[key].shape)} "
                        f"{st[key].dtype}; it was saved with other options (min_quant_numel?)"
                    )
                st[key].copy_(val)
        for sg, g in zip(saved_groups, self.param_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        for b in self._buckets:
            b.read_steps()
        # The step seed (stochastic rounding's and the dithered first moment's bits) continues from the loaded step
        # count, so a resumed run rounds as the uninterrupted one did (exactly so when every step() updated every
        # parameter: the seed counts step() calls).
        self._seed = max((int(b.step_all.max()) for b in self._buckets), default=0)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def state_bytes(self) -> int:
        """Bytes held by the optimizer state on its devices (codes, scales, error buffers)."""
        return sum(b.state_bytes() for b in self._buckets or ())

"""AdamW whose two moments are kept in fewer bits: ``LowBitAdamW``.

NOTE [ low-bit optimizer state ]
AdamW keeps two moments per parameter, ``m`` and ``v``, in the parameter's dtype: twice the parameters' bytes, the
largest piece of a full fine-tune. ``LowBitAdamW(bits=16)`` keeps both in bfloat16; ``bits=8`` keeps each in
float8 (e4m3) with one float32 scale per ``block_size`` values (each block's largest magnitude maps to float8's
largest, 448), like the blockwise 8-bit optimizers of bitsandbytes and torchao. ``v`` is kept as ``sqrt(v)``, which
halves its exponent range, so a block's small second moments stay representable. Every step dequantizes a
parameter's moments to float32, runs AdamW's update there (decoupled weight decay, bias correction, as
``torch.optim.AdamW`` with ``amsgrad=False``), and quantizes them again. This changes the numerics: training is not
bitwise the standard AdamW's, and ``memtrim.verify`` reports by how much (tests measure it on a small model).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...errors import InvalidInputError

_API = "memtrim.LowBitAdamW"
_F8 = getattr(torch, "float8_e4m3fn", None)
_F8_MAX = 448.0


def _quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` (flat) → (float8 codes in (n_blocks, block), float32 scales (n_blocks,))."""
    pad = (-x.numel()) % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / _F8_MAX
    return (blocks / scale[:, None]).to(_F8), scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    return (codes.float() * scale[:, None]).flatten()[:numel]


def _check_options(options: dict[str, Any]) -> None:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    betas = options["betas"]
    if not (all(number(options[k]) and options[k] >= 0 for k in ("lr", "eps", "weight_decay"))
            and isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas)):
        raise InvalidInputError(
            f"{_API}: expected lr, eps, weight_decay finite numbers >= 0 and betas in [0, 1) (a pair), got "
            + ", ".join(f"{k}={v!r}" for k, v in options.items()) + "."
        )


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW with its moments in bfloat16 (``bits=16``) or blockwise float8 (``bits=8``): a half or a quarter of the
    state's bytes for float32 parameters (see NOTE [ low-bit optimizer state ]).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        bits: 16 or 8.
        block_size: values per float32 scale (``bits=8``).

    Raises:
        InvalidInputError: ``bits`` not 16 or 8, a bad hyperparameter, or float8 missing from this torch.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        bits: int = 8,
        block_size: int = 256,
    ) -> None:
        if bits not in (16, 8):
            raise InvalidInputError(f"{_API}: bits must be 16 or 8, got {bits!r}.")
        if bits == 8 and _F8 is None:
            raise InvalidInputError(f"{_API}: bits=8 needs torch.float8_e4m3fn (torch >= 2.1); use bits=16.")
        _check_options({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidInputError(f"{_API}: block_size must be an int >= 1, got {block_size!r}.")
        self.bits = bits
        self.block_size = block_size
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s; refuses complex parameters and bad per-group hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_options({k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
        for p in group["params"]:
            if p.is_complex():
                self.param_groups.pop()
                raise InvalidInputError(f"{_API}: complex parameters are not supported (shape {tuple(p.shape)}).")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but the moments keep their stored dtypes (bfloat16 or float8 codes and
        float32 scales): torch's would cast them to each parameter's dtype (more memory, and bfloat16 scales)."""
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device)

    def _load(self, state: dict[str, Any], name: str, numel: int) -> torch.Tensor:
        if self.bits == 16:
            return state[name].float().flatten()
        return _dequantize(state[name], state[name + "_scale"], numel)

    def _store(self, state: dict[str, Any], name: str, value: torch.Tensor, shape: torch.Size) -> None:
        if self.bits == 16:
            state[name] = value.to(torch.bfloat16).view(shape)
        else:
            state[name], state[name + "_scale"] = _quantize(value, self.block_size)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise InvalidInputError(f"{_API}: sparse gradients are not supported; use torch.optim.SparseAdam.")
                state = self.state[p]
                n = p.numel()
                if not state:
                    state["step"] = 0
                    zeros = torch.zeros(n, device=p.device)
                    self._store(state, "exp_avg", zeros, p.shape)
                    self._store(state, "exp_avg_sq_sqrt", zeros, p.shape)
                state["step"] += 1
                t = state["step"]
                grad = p.grad.float().flatten()
                m = self._load(state, "exp_avg", n).lerp_(grad, 1 - beta1)
                v = self._load(state, "exp_avg_sq_sqrt", n).square_().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
                update = (m / (1 - beta1**t)).div_(denom)
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.view(p.shape).to(p.dtype), alpha=-group["lr"])
                self._store(state, "exp_avg", m, p.shape)
                self._store(state, "exp_avg_sq_sqrt", v.sqrt_(), p.shape)
        return loss

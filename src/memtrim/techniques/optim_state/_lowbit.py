"""AdamW whose two moments are kept in fewer bits: ``LowBitAdamW``.

NOTE [ low-bit optimizer state ]
AdamW keeps two moments per parameter, ``m`` and ``v``, in the parameter's dtype: twice the parameters' bytes, the
largest piece of a full fine-tune. ``LowBitAdamW(bits=16)`` keeps both in bfloat16; ``bits=8`` keeps each in
float8 (e4m3) with one float32 scale per ``block_size`` values (each block's largest magnitude maps to float8's
largest, 448), like the blockwise 8-bit optimizers of bitsandbytes and torchao; ``bits=4`` keeps each in 4-bit codes,
two to a byte, with one float32 scale per ``block_size`` (default 128, as torchao's 4-bit AdamW) values: a block's
value is its scale times one of 16 levels. ``v`` is kept as ``sqrt(v)``, which halves its exponent range, so a
block's small second moments stay representable. The 4-bit levels:

- ``m`` (signed): a sign bit and eight magnitudes, 0, 0.05, 0.12, 0.22, 0.35, 0.5, 0.72 and 1, spaced more finely
  near zero where most of a block's values lie (torchao uses a dynamic-exponent map for the same reason). Zero is
  exact, rounding is symmetric in the sign, and a value is off by at most 0.14 of its block's largest magnitude.
- ``sqrt(v)`` (unsigned): 0, 1/15, ..., 1, but only an exact zero is coded 0; a nonzero value rounds to 1/15 at
  least. A second moment rounded to zero would make the update ``m / eps`` (the "zero-point problem" of Li et al.,
  *Memory Efficient Optimizers with 4-bit States*, 2023, which torchao avoids by leaving zero out of its map); an
  exact zero (a parameter that never had a gradient) has ``m == 0`` as well. Off by at most 1/15 of the block's
  largest value (1/30 from 1/30 up).

Rounding to nearest is deterministic (as torchao's): an ``m`` at 0 whose new gradient term, ``(1 - beta1) * grad``,
stays under half the first level (2.5% of its block's largest ``m``) is rounded back to 0 at every step, so that
element does not move until its gradient grows; this is where 4 bits differ most from AdamW (the tests measure it).

Every step dequantizes a parameter's moments to float32, runs AdamW's update there (decoupled weight decay, bias
correction, as ``torch.optim.AdamW`` with ``amsgrad=False``), and quantizes them again, a chunk of ``_CHUNK`` values
(whole blocks) at a time: the update's float32 temporaries (the moments, the denominator, the update) are about six
times a chunk's float32 bytes, not six times the parameter's (a 20000 x 64 embedding's step peaked above plain
AdamW's with them: found by an adversarial pass on 2026-12-02). Every op is elementwise and every block is quantized
whole, so the chunks change no bit. This changes the numerics:
training is not bitwise the standard AdamW's, and ``memtrim.verify`` reports by how much (tests measure it on a small
model).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ...errors import InvalidInputError
from ..optim.wrapping import refuse_sharded

_API = "memtrim.LowBitAdamW"
_F8 = getattr(torch, "float8_e4m3fn", None)
_F8_MAX = 448.0
_BLOCK_SIZE = {8: 256, 4: 128}
_CHUNK = 1 << 18  # values updated at a time (1 MiB of float32), rounded to whole blocks (and whole bytes at 4 bits)


def _quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` (flat) → (float8 codes in (n_blocks, block), float32 scales (n_blocks,))."""
    pad = (-x.numel()) % block
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, block)
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30) / _F8_MAX
    return (blocks / scale[:, None]).to(_F8), scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    return (codes.float() * scale[:, None]).flatten()[:numel]


class _Levels(NamedTuple):
    """A 4-bit map (NOTE [ low-bit optimizer state ]): ``magnitudes`` ascending from 0 to 1; a signed map spends one
    bit on the sign (code ``8 | i`` is ``-magnitudes[i]``); ``zero_exact_only``: only 0 itself rounds to 0."""

    magnitudes: tuple[float, ...]
    signed: bool
    zero_exact_only: bool

    def values(self, device: torch.device) -> torch.Tensor:
        """What each of the 16 codes stands for, in units of its block's scale."""
        mags = torch.tensor(self.magnitudes, dtype=torch.float32, device=device)
        return torch.cat((mags, -mags)) if self.signed else mags

    def bounds(self, device: torch.device) -> torch.Tensor:
        """The magnitudes where rounding goes from one level to the next (``torch.bucketize``'s boundaries)."""
        mids = [(a + b) / 2 for a, b in zip(self.magnitudes, self.magnitudes[1:])]
        return torch.tensor([0.0, *mids[1:]] if self.zero_exact_only else mids, dtype=torch.float32, device=device)


_M_LEVELS = _Levels((0.0, 0.05, 0.12, 0.22, 0.35, 0.5, 0.72, 1.0), signed=True, zero_exact_only=False)
_SQRT_V_LEVELS = _Levels(tuple(k / 15 for k in range(16)), signed=False, zero_exact_only=True)
_LEVELS = {"exp_avg": _M_LEVELS, "exp_avg_sq_sqrt": _SQRT_V_LEVELS}


def _codes_4bit(x: torch.Tensor, block: int, levels: _Levels) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` (flat, n values) → (int32 codes (n,), float32 scales (ceil(n / block),), each block's largest
    magnitude). Its float temporaries end with the call."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x, (0, (-n) % block)).view(-1, block)  # a copy, divided in place
    low, high = torch.aminmax(blocks, dim=1)
    scale = torch.maximum(high, low.neg()).clamp_min(1e-30)
    normed = blocks.div_(scale[:, None]).view(-1)[:n]
    negative = normed.signbit() if levels.signed else None
    codes = torch.bucketize(normed.abs_(), levels.bounds(x.device), out_int32=True)
    return codes if negative is None else codes.add_(negative, alpha=8), scale


def _quantize_4bit(x: torch.Tensor, block: int, levels: _Levels) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``x`` (flat, n values) → (uint8 codes (ceil(n / 2),), two a byte, the even index in the low four
    bits; float32 scales (ceil(n / block),))."""
    codes, scale = _codes_4bit(x, block, levels)
    packed = codes[0::2].to(torch.uint8)
    packed[: codes.numel() // 2].bitwise_or_(codes[1::2].to(torch.uint8).bitwise_left_shift_(4))
    return packed, scale


def _dequantize_4bit(codes: torch.Tensor, scale: torch.Tensor, numel: int, block: int, levels: _Levels) -> torch.Tensor:
    level = levels.values(codes.device)
    # byte b stands for (level[b & 15], level[b >> 4])
    by_byte = torch.stack((level.repeat(16), level.repeat_interleave(16)), dim=1)
    values = by_byte.index_select(0, codes.int()).view(-1)  # 2 * ceil(n / 2) values, scaled in place
    full = numel // block * block
    values[:full].view(-1, block).mul_(scale[: numel // block, None])
    if numel % block:
        values[full:].mul_(scale[-1])
    return values[:numel]


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


def _refuse_unimplemented(group: dict[str, Any]) -> None:
    """AdamW's options this optimizer does not implement, asked for: never ignored silently."""
    asked = [k for k in ("maximize", "amsgrad") if group.get(k)]
    if asked:
        raise InvalidInputError(
            f"{_API}: {', '.join(f'{k}=True' for k in asked)} is asked for (as an argument, in a param group, or "
            "in a loaded state_dict), which LowBitAdamW does not implement (it would train as if it were False). "
            "Expected only lr, betas, eps and weight_decay per group. Use torch.optim.AdamW there."
        )


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW with its moments in bfloat16 (``bits=16``), blockwise float8 (``bits=8``) or blockwise 4-bit codes
    (``bits=4``): a half, a quarter or an eighth (plus the scales) of the state's bytes for float32 parameters (see
    NOTE [ low-bit optimizer state ]).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        amsgrad, maximize: ``torch.optim.AdamW``'s, accepted as False only (not implemented: True raises, here, in a
            param group, or at ``step()`` where a group says so since).
        bits: 16, 8 or 4.
        block_size: values per float32 scale (``bits=8``: default 256; ``bits=4``: default 128).

    Raises:
        InvalidInputError: ``bits`` not 16, 8 or 4, a bad hyperparameter, ``amsgrad``/``maximize`` True, or float8
            missing from this torch.

    Example::

        optimizer = memtrim.LowBitAdamW(model.parameters(), lr=1e-3, bits=4)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        bits: int = 8,
        block_size: int | None = None,
    ) -> None:
        if bits not in (16, 8, 4):
            raise InvalidInputError(f"{_API}: bits must be 16, 8 or 4, got {bits!r}.")
        if bits == 8 and _F8 is None:
            raise InvalidInputError(f"{_API}: bits=8 needs torch.float8_e4m3fn (torch >= 2.1); use bits=16.")
        _check_options({"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        _refuse_unimplemented({"amsgrad": amsgrad, "maximize": maximize})  # AdamW's signature; False is what it does
        if block_size is None:
            block_size = _BLOCK_SIZE.get(bits, 1)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise InvalidInputError(f"{_API}: block_size must be an int >= 1, got {block_size!r}.")
        self.bits = bits
        self.block_size = block_size
        self._unit = math.lcm(block_size, 2)  # whole blocks, and whole bytes of two 4-bit codes
        self._chunk = self._unit * max(1, _CHUNK // self._unit)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad, "maximize": maximize})  # (as AdamW's groups hold them)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s; refuses complex parameters and bad per-group hyperparameters."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:  # a refused group is not kept: a caller that catches the error must not step it
            _check_options({k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})
            _refuse_unimplemented(group)
            refuse_sharded(group["params"], _API)
            for p in group["params"]:
                if p.is_complex():
                    raise InvalidInputError(f"{_API}: complex parameters are not supported (shape {tuple(p.shape)}).")
        except InvalidInputError:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer``'s, but the moments keep their stored dtypes (bfloat16, float8 or uint8 codes
        and float32 scales): torch's would cast them to each parameter's dtype (more memory, and bfloat16 scales).

        Raises:
            InvalidInputError: a moment whose dtype or size is not this optimizer's ``bits`` and ``block_size``.
        """
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(itertools.chain.from_iterable(g["params"] for g in self.param_groups))
        for saved_id, p in zip(saved_ids, params):  # before loading: a refused state leaves this optimizer as it was
            self._check_loaded(state_dict["state"].get(saved_id, {}), p.numel())
        super().load_state_dict(state_dict)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device)

    def _check_loaded(self, state: dict[str, Any], numel: int) -> None:
        # a state saved with other bits or another block_size would be read as wrong numbers, silently
        if not state:
            return
        blocks = -(-numel // self.block_size)
        codes = {16: (torch.bfloat16, numel), 8: (_F8, blocks * self.block_size), 4: (torch.uint8, -(-numel // 2))}
        expected: list[tuple[str, Any, int]] = [(n, *codes[self.bits]) for n in ("exp_avg", "exp_avg_sq_sqrt")]
        if self.bits != 16:
            expected += [(n + "_scale", torch.float32, blocks) for n in ("exp_avg", "exp_avg_sq_sqrt")]
        for name, dtype, size in expected:
            found = state.get(name)
            if not isinstance(found, torch.Tensor) or (found.dtype, found.numel()) != (dtype, size):
                what = "missing" if not isinstance(found, torch.Tensor) else f"{found.dtype} of {found.numel()}"
                # a plain AdamW's state (exp_avg and exp_avg_sq in the parameter's dtype) is no LowBitAdamW's
                plain = "exp_avg_sq" in state and "exp_avg_sq_sqrt" not in state
                fix = ("it is a torch.optim.AdamW's state: LowBitAdamW keeps other tensors (quantised, with scales) "
                       "and does not convert one; load it into torch.optim.AdamW, or start LowBitAdamW's state anew"
                       if plain else "load it into a LowBitAdamW with the bits and block_size it was saved with")
                raise InvalidInputError(
                    f"{_API}: load_state_dict expected {name} as {dtype} of {size} values for bits={self.bits}, "
                    f"block_size={self.block_size}, found {what}; {fix}."
                )

    def _new_state(self, state: dict[str, Any], name: str, p: torch.Tensor) -> None:
        """Zero moments for ``p``, as quantizing zeros stores them (a chunk of zeros at a time)."""
        n, block = p.numel(), self.block_size
        if self.bits == 16:
            state[name] = torch.zeros(p.shape, dtype=torch.bfloat16, device=p.device)
            return
        blocks = -(-n // block)
        state[name] = (torch.empty(blocks, block, dtype=_F8, device=p.device) if self.bits == 8
                       else torch.empty(-(-n // 2), dtype=torch.uint8, device=p.device))
        state[name + "_scale"] = torch.empty(blocks, device=p.device)
        for start in range(0, n, self._chunk):
            end = min(start + self._chunk, n)
            self._store(state, name, torch.zeros(end - start, device=p.device), start, end)

    def _load(self, state: dict[str, Any], name: str, start: int, end: int) -> torch.Tensor:
        """Values ``start:end`` of a moment (flat), in float32; ``start`` a multiple of the chunk."""
        if self.bits == 16:
            return state[name].view(-1)[start:end].float()
        blocks = slice(start // self.block_size, -(-end // self.block_size))
        scale = state[name + "_scale"][blocks]
        if self.bits == 4:
            codes = state[name][start // 2: -(-end // 2)]
            return _dequantize_4bit(codes, scale, end - start, self.block_size, _LEVELS[name])
        return _dequantize(state[name][blocks], scale, end - start)

    def _store(self, state: dict[str, Any], name: str, value: torch.Tensor, start: int, end: int) -> None:
        """Quantize ``value`` (float32, flat) into values ``start:end`` of a moment, in place."""
        if self.bits == 16:
            state[name].view(-1)[start:end].copy_(value)  # (rounds to nearest even, as .to(bfloat16))
            return
        blocks = slice(start // self.block_size, -(-end // self.block_size))
        if self.bits == 4:
            codes, scale = _quantize_4bit(value, self.block_size, _LEVELS[name])
            state[name][start // 2: start // 2 + codes.numel()].copy_(codes)
        else:
            codes, scale = _quantize(value, self.block_size)
            state[name][blocks].copy_(codes)
        state[name + "_scale"][blocks].copy_(scale)

    def _chunks(self, p: torch.Tensor) -> Iterable[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """``(start, end, the parameter's values start:end as a view, their gradient in float32, flat)`` over ``p``,
        ``start`` on whole blocks. A parameter that is not contiguous (transposed, tied as another's transpose,
        channels_last) in whole rows of its first dimension: its flat values are not one view (it was updated whole,
        and its step peaked above AdamW's: found by an adversarial pass on 2026-12-02)."""
        n, grad = p.numel(), p.grad
        assert grad is not None
        if p.is_contiguous():
            params, grads = p.view(-1), grad.reshape(-1)
            for start in range(0, n, self._chunk):
                end = min(start + self._chunk, n)
                yield start, end, params[start:end], grads[start:end].float()
            return
        row = n // p.shape[0]  # (not contiguous: at least one dimension, and elements)
        step = self._unit // math.gcd(row, self._unit)  # rows that end on whole blocks
        rows = step * max(1, self._chunk // (row * step))
        for first in range(0, p.shape[0], rows):
            last = min(first + rows, p.shape[0])
            yield first * row, last * row, p[first:last], grad[first:last].reshape(-1).float()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update of every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _refuse_unimplemented(group)  # (set on a group since it was added, or loaded from a state_dict)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise InvalidInputError(f"{_API}: sparse gradients are not supported; use torch.optim.SparseAdam.")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    self._new_state(state, "exp_avg", p)
                    self._new_state(state, "exp_avg_sq_sqrt", p)
                state["step"] += 1
                t = state["step"]
                for start, end, target, grad in self._chunks(p):
                    m = self._load(state, "exp_avg", start, end).lerp_(grad, 1 - beta1)
                    v = self._load(state, "exp_avg_sq_sqrt", start, end).square_().mul_(beta2).addcmul_(
                        grad, grad, value=1 - beta2)
                    denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
                    update = (m / (1 - beta1**t)).div_(denom)
                    if group["weight_decay"]:
                        target.mul_(1 - group["lr"] * group["weight_decay"])
                    target.add_(update.view(target.shape).to(p.dtype), alpha=-group["lr"])
                    self._store(state, "exp_avg", m, start, end)
                    self._store(state, "exp_avg_sq_sqrt", v.sqrt_(), start, end)
        return loss

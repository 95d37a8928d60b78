"""What :func:`memtrim.convert` changed and left alone: every candidate a rule found, with bytes or a reason."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...measure import format_bytes

__all__ = ["Change", "ConversionReport", "Skipped"]


@dataclass(frozen=True)
class Change:
    """One module, pair or call site converted, with the activation bytes it saved on the example inputs (None
    without example inputs), and what the converted module no longer supports (``limits``; empty where it does
    everything torch's does). ``rule`` names the registered rule that made it. ``bitwise``: training with the
    change gives torch's gradients bit for bit; False where they agree to rounding (a tensor rebuilt from another,
    or a gradient computed from the output: its ``limits`` say which). It speaks of first derivatives (``backward()``
    of a loss); where a second derivative (a gradient penalty, ``create_graph=True``) agrees to rounding only, or is
    refused, ``limits`` says so."""

    modules: tuple[str, ...]
    before: str
    after: str
    bytes_saved: int | None
    limits: tuple[str, ...] = ()
    rule: str = ""
    bitwise: bool = True


@dataclass(frozen=True)
class Skipped:
    """A candidate left alone, and why (``rule``: the registered rule that found it)."""

    modules: tuple[str, ...]
    reason: str
    rule: str = ""


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert` changed and skipped; activation bytes kept after a forward, before and after."""

    changes: list[Change]
    skipped: list[Skipped]
    activation_bytes_before: int | None
    activation_bytes_after: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_saved(self) -> int | None:
        """Activation bytes kept after a forward, before minus after (None without example inputs)."""
        if self.activation_bytes_before is None or self.activation_bytes_after is None:
            return None
        return self.activation_bytes_before - self.activation_bytes_after

    @property
    def fraction_saved(self) -> float | None:
        """``bytes_saved`` as a fraction of the bytes kept before (None without example inputs)."""
        if self.bytes_saved is None or not self.activation_bytes_before:
            return None
        return self.bytes_saved / self.activation_bytes_before

    @property
    def bitwise(self) -> bool:
        """Whether every change keeps training bitwise torch's (``Change.bitwise``)."""
        return all(c.bitwise for c in self.changes)

    def by_rule(self) -> dict[str, int]:
        """Bytes saved per rule (changes with measured bytes only)."""
        totals: dict[str, int] = {}
        for c in self.changes:
            if c.bytes_saved is not None:
                totals[c.rule] = totals.get(c.rule, 0) + c.bytes_saved
        return totals

    def __str__(self) -> str:
        lines = ["memtrim.convert"]
        if self.activation_bytes_before is not None and self.activation_bytes_after is not None:
            lines.append(f"activations kept after forward: {self.activation_bytes_before:,} B -> "
                         f"{self.activation_bytes_after:,} B ({self.fraction_saved or 0.0:.0%} fewer)")
        for c in self.changes:
            saved = "" if c.bytes_saved is None else f": saves {c.bytes_saved:,} B ({format_bytes(c.bytes_saved)})"
            limits = f" [{'; '.join(c.limits)}]" if c.limits else ""
            lines.append(f"  changed {' + '.join(c.modules)}: {c.before} -> {c.after}{saved}{limits}")
        for s in self.skipped:
            lines.append(f"  skipped {' + '.join(s.modules)}: {s.reason}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

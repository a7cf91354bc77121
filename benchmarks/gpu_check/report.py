"""What every section of the GPU check shares: its result lines, tensor comparisons, time budgets, MFU.

Pure CPU code (tested without a GPU in tests/test_gpu_check.py)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.flops import bf16_peak_flops  # the peak table the trainer's step line uses too


def throughput_fields(flops: float, tokens: int, seconds: float, device_name: str) -> str:
    """`tokens_per_s=... tflops=... mfu=...` of one step of `flops` over `tokens` in `seconds` (mfu: against
    the device's bf16 peak; `mfu=unknown` for a GPU not in the table)."""
    achieved = flops / seconds
    peak = bf16_peak_flops(device_name)
    mfu = f"{achieved / peak:.3f} (peak {peak / 1e12:.0f} TFLOP/s)" if peak else "unknown (GPU not in the peak table)"
    return f"tokens_per_s={tokens / seconds:.0f} tflops={achieved / 1e12:.1f} mfu={mfu}"


@dataclass
class Check:
    """One named comparison of a section: PASS when `ok`."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"  {'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def compare(
    name: str, got: torch.Tensor, ref: torch.Tensor, atol: float = 0.0, rtol: float = 0.0, rel_l2: float = 0.0
) -> Check:
    """`got` against `ref` (both moved to CPU FP32): max abs, max relative and relative L2 difference.

    PASS needs finite values and, with `rel_l2` > 0, ``|got - ref| / |ref|`` (L2 norms) at most `rel_l2` (for
    low precision, where a routing decision flipped by rounding moves a few elements a lot); otherwise every
    element within ``atol + rtol * |ref|`` (torch.allclose's rule)."""
    got, ref = got.detach().float().cpu().flatten(), ref.detach().float().cpu().flatten()
    if got.shape != ref.shape:
        return Check(name, False, f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    diff = (got - ref).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / ref.abs().clamp(min=1e-12)).max()) if diff.numel() else 0.0
    l2 = float(diff.norm() / ref.norm().clamp(min=1e-30))
    finite = bool(torch.isfinite(got).all())
    if rel_l2 > 0:
        ok, rule = finite and l2 <= rel_l2, f"rel_l2<={rel_l2:g}"
    else:
        ok, rule = finite and bool((diff <= atol + rtol * ref.abs()).all()), f"atol={atol:g} rtol={rtol:g}"
    return Check(name, ok, f"max_abs={max_abs:.3g} max_rel={max_rel:.3g} rel_l2={l2:.3g} ({rule})")


def guarded(section: Section, name: str, fn: Callable[[], list[Check]]) -> None:
    """Add `fn()`'s checks to `section`; an exception becomes one FAIL check with its first line, so the
    section's other checks still run."""
    try:
        section.checks.extend(fn())
    except Exception as e:
        section.checks.append(Check(name, False, first_line(e)))


@dataclass
class Section:
    """A numbered part of the check: its checks and informational lines, or the error that stopped it, or
    why it did not run (`skipped`: SKIP, not a failure; a section that knows it cannot run says so)."""

    number: int
    title: str
    budget_s: float
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    skipped: str = ""
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if self.error or not all(c.ok for c in self.checks):
            return "FAIL"
        if self.skipped:
            return "SKIP"
        return "PASS" if self.checks else "INFO"

    def lines(self) -> list[str]:
        head = f"[{self.number}] {self.title}: {self.status} ({self.seconds:.0f} s of {self.budget_s:.0f} s budget)"
        out = [head, *(c.line() for c in self.checks), *(f"  {n}" for n in self.notes)]
        if self.error:
            out.append(f"  FAIL error: {self.error}")
        elif self.skipped:
            out.append(f"  SKIP {self.skipped}")
        return out


def first_line(error: BaseException) -> str:
    """`Type: the first line of its message` (the rest of a traceback is noise in a compact report)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def run_section(section: Section, body: Callable[[Section], None], verbose: bool = False) -> Section:
    """Run `body(section)`; an exception ends the section as FAIL with its first line, never the check.
    Exceeding the budget is a FAIL of its own (the section's work is still reported)."""
    started = time.perf_counter()
    try:
        body(section)
    except Exception as e:  # every section is independent: report and go on
        section.error = first_line(e)
        if verbose:
            traceback.print_exc()
    section.seconds = time.perf_counter() - started
    if section.seconds > section.budget_s:
        section.checks.append(Check("time budget", False, f"took {section.seconds:.0f} s > {section.budget_s:.0f} s"))
    return section


def summary(sections: list[Section], total_s: float) -> str:
    """The final line: every section's status and the wall time."""
    parts = " ".join(f"[{s.number}]={s.status}" for s in sections)
    failed = sum(s.status == "FAIL" for s in sections)
    verdict = "FAIL" if failed else "PASS"
    return f"gpu-check {verdict}: {parts} ({failed} failed) in {total_s:.0f} s"

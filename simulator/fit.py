"""Fit the simulator's non-hardware constants on Table 3's 2H and 1H ETTR rows only, and print them.

    python -m simulator.fit [--sweeps N] [--out DIR] [--exclude STRATEGY]

Maximum likelihood over the 32 calibration cells (4 models x 2 MTBFs x 4 strategies, ETTR over the
run), each strategy's cells with an error variance of their own: the model captures some strategies'
mechanics better than others (MoC's least), and with one variance for all, the cells the model fits
worst would set the constants every strategy shares (an unweighted fit put a 75 s fixed restart into
every failure, against the 1-4 s per failure Table 3's MoEvement recovery times state). Profiled over the
variances, the loss is the sum over strategies of n_s log(SSE_s / n_s + e), where e is the variance of a
value rounded to three decimals (as every cell is printed), so no strategy's error is trusted below its
rounding. A coordinate search in transformed coordinates (log for positive constants, logit for the NIC
efficiency) over `--sweeps` sweeps of shrinking grids minimises it within each constant's plausible range
(`simulator.calibrated.PLAUSIBLE`: a coordinate beyond it stands for the range's end, so a constant the
cells push out of its range stays at its end, and the report says which ends bind); it prints the constants, the rms per
strategy and every calibration cell's residual, and writes the same to `fit.txt` under `--out DIR`
(default `outputs/simulator/<UTC timestamp>/`, `simulator.output`).
`simulator.calibrated.FITTED` records the printed values. `--exclude moc` (a diagnostic, not the
recorded fit) leaves a strategy's cells out of the loss, to show which cells set the constants the
strategies share.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields

from simulator.calibrated import PLAUSIBLE, Calibration
from simulator.model import run_all
from simulator.output import OutputError, output_dir, write_text
from simulator.paper_numbers import CALIBRATION_ROWS, MTBFS_MIN, STRATEGIES, TABLE3_ETTR
from simulator.setting import from_testbed
from simulator.testbed import TESTBEDS

NAMES = [f.name for f in fields(Calibration)]
START = Calibration(0.5, 0.2, 30.0, 20.0, 0.02, 0.02, 0.02, 0.02, 10.0)
ROUNDING_VARIANCE = 0.0005**2 / 3  # of a value printed to three decimals (uniform error within +-0.0005)
SWEEPS = 10


def to_calibration(x: Sequence[float]) -> Calibration:
    """The constants at coordinates `x`, each within its plausible range (`PLAUSIBLE`)."""
    eta = 1 / (1 + math.exp(-x[0]))
    values = [eta, *(math.exp(v) for v in x[1:])]
    return Calibration(*(min(max(v, PLAUSIBLE[n][0]), PLAUSIBLE[n][1]) for n, v in zip(NAMES, values)))


def to_coordinates(cal: Calibration) -> list[float]:
    eta = cal.nic_efficiency
    return [math.log(eta / (1 - eta))] + [math.log(max(1e-9, getattr(cal, n))) for n in NAMES[1:]]


def residuals(cal: Calibration, rows: Sequence[str] = CALIBRATION_ROWS) -> list[tuple[str, str, str, float]]:
    """(model, row, strategy, simulated - paper) for every cell of `rows`."""
    out = []
    for name, tb in TESTBEDS.items():
        setting = from_testbed(tb)
        for row in rows:
            sim = run_all(setting, cal, MTBFS_MIN[row] * 60)
            for strategy, paper in zip(STRATEGIES, TABLE3_ETTR[name][row]):
                out.append((name, row, strategy, sim[strategy].ettr - paper))
    return out


def loss(x: Sequence[float], exclude: Sequence[str] = ()) -> float:
    """Minus twice the log-likelihood (up to a constant) of the calibration cells (but those of `exclude`d
    strategies), each strategy's residuals Gaussian with their own variance, profiled out."""
    cells = residuals(to_calibration(x))
    total = 0.0
    for strategy in STRATEGIES:
        mine = [r[3] for r in cells if r[2] == strategy and strategy not in exclude]
        if mine:
            total += len(mine) * math.log(sum(d * d for d in mine) / len(mine) + ROUNDING_VARIANCE)
    return total


def coordinate_search(f: Callable[[Sequence[float]], float], x0: Sequence[float], sweeps: int = 6, points: int = 17):
    """Minimise f one coordinate at a time over a grid of `points` values within +-span of the current
    value, the span halving each sweep (robust to the steps that integer intervals and windows make)."""
    x, fx, span = list(x0), f(x0), 4.0
    for _ in range(sweeps):
        for i in range(len(x)):
            for v in (x[i] + span * (2 * j / (points - 1) - 1) for j in range(points)):
                trial = x[:i] + [v] + x[i + 1 :]
                ft = f(trial)
                if ft < fx:
                    x, fx = trial, ft
        span /= 2
    return x, fx


def fit(sweeps: int = SWEEPS, exclude: Sequence[str] = ()) -> tuple[Calibration, float]:
    """Coordinate search from START (transformed coordinates)."""
    x, fx = coordinate_search(lambda v: loss(v, exclude), to_coordinates(START), sweeps)
    return to_calibration(x), fx


def report(cal: Calibration, value: float) -> str:
    """The fitted constants, the rms and every calibration cell's residual, one per line."""
    cells = residuals(cal)
    lines = [f"fitted on Table 3 rows {', '.join(CALIBRATION_ROWS)} ({len(cells)} ETTR cells)"]
    for k, v in asdict(cal).items():
        lo, hi = PLAUSIBLE[k]
        lines.append(f"{k} = {v:.6g}" + (f"  (at the end of its plausible {lo:g}-{hi:g})" if v in (lo, hi) else ""))
    lines.append(f"rms = {math.sqrt(sum(c[3] ** 2 for c in cells) / len(cells)):.4f} (fit's loss {value:.3f})")
    for strategy in STRATEGIES:
        mine = [c[3] for c in cells if c[2] == strategy]
        lines.append(f"  {strategy}: rms {math.sqrt(sum(d * d for d in mine) / len(mine)):.4f}")
    lines += [f"  {model} {row} {strategy}: simulated - paper = {d:+.3f}" for model, row, strategy, d in cells]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m simulator.fit", description=__doc__.split("\n")[0])
    ap.add_argument("--sweeps", type=int, default=SWEEPS)
    ap.add_argument("--out", help="directory for fit.txt (default: outputs/simulator/<UTC timestamp>)")
    ap.add_argument(
        "--exclude",
        default="",
        help="a diagnostic: leave these strategies' cells out of the loss (comma-separated; FITTED uses all)",
    )
    args = ap.parse_args(argv)
    exclude = [s for s in args.exclude.split(",") if s]
    if bad := [s for s in exclude if s not in STRATEGIES]:
        print(f"error: --exclude: unknown {','.join(bad)} (allowed: {', '.join(STRATEGIES)})", file=sys.stderr)
        raise SystemExit(2)
    try:
        folder = output_dir(args.out)
        text = report(*fit(args.sweeps, exclude))
        text = text if not exclude else f"diagnostic: without {', '.join(exclude)}'s cells\n" + text
        print(text)
        print(f"\nwrote: {write_text(folder, 'fit.txt', text)}")
    except OutputError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

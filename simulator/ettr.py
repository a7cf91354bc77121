"""ETTR simulator's command line: checkpointing strategies under failures at cluster scale.

    python -m simulator --paper-tables [--measured ettr.csv ...] [--no-figure] [--out DIR]   every compared cell
    python -m simulator --paper [--no-figure] [--json] [--out DIR]           the paper's scale study
    python -m simulator --sensitivity [--preset P] [--mtbf-min M] [--json] [--out DIR]   what moves one result
    python -m simulator --preset 671B-16384 --mtbf-min 10 [--strategies ...] [--interval K] [--window W] [--json]
    python -m simulator --list | --profile profile.json | --window-profile gpu.json
    python -m simulator --node-loss      a node lost for good: three policies' goodput (simulator.node_loss)

`python -m simulator.ettr` is the same command. `--paper-tables`, `--paper` and `--sensitivity` print
their tables and write them, with their figures, under `--out DIR` (default
`outputs/simulator/<UTC timestamp>/`; `simulator.output`), then print one `wrote: PATH` line per file
(on stderr with `--json`, so that stdout stays one JSON document).

Every mode but --profile runs one model (`simulator.model`): `simulator.testbed` (§5.1 cluster,
Table 2 models), `simulator.setting` / `simulator.scale` (one node's view of a testbed or a preset),
`simulator.profile` (the bandwidth Algorithm 1 sees), `simulator.mechanisms` (each strategy's
checkpoint and recovery), `simulator.run` (12-hour run with Poisson failures, closed form, MoC's
Dynamic-K), `simulator.calibrated` / `simulator.fit` (constants fitted on Table 3's 2H and 1H rows).
`--host-gbs X`, `--nic-gbps X`, `--snapshot-cap-gbs X` and `--restart-s S` change its hardware and
fixed restart in --preset, --paper and --sensitivity. `simulator.measured` runs the same mechanisms on
a run measured by `benchmarks.ettr` (its `simulator` column; `--paper-tables --measured ettr.csv`);
`--profile` puts a run's measured costs through the same failure law (`simulator.calibration`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from simulator.calibrated import FITTED
from simulator.calibration import MeasuredProfile, predict_from_profile
from simulator.cluster import GB, Preset
from simulator.measured import read_csv
from simulator.model import STRATEGIES, Overrides, predict, preset_setting
from simulator.node_loss import report as node_loss_report
from simulator.output import OutputError, output_dir, write_figure, write_text
from simulator.paper import (
    FIG11_FIGURE,
    PAPER_REPORTED,
    STUDY_FIGURE,
    layout_table,
    plot_fig11,
    plot_study,
    scale_study,
    study_table,
)
from simulator.paper_numbers import FIG11_671B_10M, FIG11_MIN_MOEVEMENT_1H
from simulator.paper_tables import all_cells, render
from simulator.presets import PAPER_PRESETS, PRESETS
from simulator.profile import WindowProfile, snapshot_bandwidth
from simulator.sensitivity import best_speedup, break_even, break_even_lines, sensitivity, sensitivity_table

SENSITIVITY_PRESET, SENSITIVITY_MTBF_MIN = "671B-16384", 10.0


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, (int, str)) else f"{value:.4f}"


def _finite(value: Any) -> Any:
    """JSON has no infinity: an unbounded value (none's recovery) becomes null."""
    return None if isinstance(value, float) and math.isinf(value) else value


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m simulator", description=__doc__.split("\n")[0])
    ap.add_argument("--no-zero1", action="store_true", help="--paper-tables: FP32 state not sharded (no ZeRO-1)")
    ap.add_argument("--paper", action="store_true", help="the paper's scale study: 4 presets x MTBF 60/30/10 min")
    ap.add_argument(
        "--paper-tables", action="store_true", help="Table 3, Table 4, Figs. 1a, 11, 13, 16 beside the paper's numbers"
    )
    ap.add_argument(
        "--measured",
        action="append",
        help="--paper-tables: an ETTR benchmark's ettr.csv for our own Table 4 or, if its strategies are Figure "
        "13's variants, our own Figure 13 (repeatable; default: the committed records)",
    )
    ap.add_argument("--no-figure", action="store_true", help="--paper, --paper-tables: write the tables only")
    ap.add_argument(
        "--out",
        help="--paper, --paper-tables, --sensitivity: directory for tables and figures "
        "(default: outputs/simulator/<UTC timestamp>)",
    )
    ap.add_argument("--sensitivity", action="store_true", help="which inputs move one preset/MTBF result most")
    ap.add_argument("--preset", help="preset (see --list)")
    ap.add_argument("--mtbf-min", type=float, help="mean time between failures, minutes (inf: none)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    ap.add_argument("--interval", type=int, help="fix gemini/checkfreq/moc checkpoint interval k")
    ap.add_argument("--window", type=int, help="fix moevement's window W instead of Algorithm 1's")
    ap.add_argument("--host-gbs", type=float, help="override GPU->host copy bandwidth, GB/s")
    ap.add_argument("--nic-gbps", type=float, help="override a node's NIC line rate, Gb/s")
    ap.add_argument("--snapshot-cap-gbs", type=float, help="cap snapshot copies during training, GB/s per GPU")
    ap.add_argument("--restart-s", type=float, help="override the fixed (scope-independent) restart, seconds")
    ap.add_argument("--json", action="store_true", help="JSON instead of lines and tables")
    ap.add_argument("--list", action="store_true", help="list the presets")
    ap.add_argument("--profile", help="measured profile JSON: print predicted ETTR per strategy")
    ap.add_argument("--window-profile", help="profiled GPU JSON (simulator.profile): print Algorithm 1's W")
    ap.add_argument(
        "--node-loss",
        action="store_true",
        help="a node lost for good: elastic vs wait vs relaunch (simulator.node_loss)",
    )
    return ap.parse_args(argv)


def _run_profile(path: str, as_json: bool) -> None:
    try:
        with open(path) as f:
            profile = MeasuredProfile.from_json(f.read())
    except (OSError, ValueError, TypeError, AttributeError) as err:
        _fail(f"--profile {path}: {err}")
    predicted = predict_from_profile(profile)
    if as_json:
        print(
            json.dumps({s: {"predicted_ettr": e, "steady_ettr": profile.steady_ettr(s)} for s, e in predicted.items()})
        )
        return
    for s, e in predicted.items():
        print(f"strategy={s} predicted_ettr={e:.4f} steady_ettr={profile.steady_ettr(s):.4f}")


def _run_window_profile(path: str) -> None:
    try:
        with open(path) as f:
            profile = WindowProfile.from_json(f.read())
    except (OSError, ValueError, TypeError) as err:
        _fail(f"--window-profile {path}: {err}")
    window, o_active = profile.window()
    print(f"window={window} o_active={o_active} bandwidth_gbs={profile.bandwidth() / GB:.4f}")


def _list() -> None:
    for p in PRESETS.values():
        lay = p.layout
        print(
            f"{p.name} {'paper' if p.name in PAPER_PRESETS else 'extra'} gpus={lay.gpus} "
            f"params_b={p.model.total_params() / 1e9:.1f} stages={lay.pp} pipelines={lay.pipelines} ep={lay.ep} "
            f"micro_batches={lay.micro_batches}"
        )


def _overrides(args: argparse.Namespace) -> Overrides:
    """--host-gbs / --nic-gbps / --snapshot-cap-gbs / --restart-s, validated."""
    for flag, value in (
        ("--host-gbs", args.host_gbs),
        ("--nic-gbps", args.nic_gbps),
        ("--snapshot-cap-gbs", args.snapshot_cap_gbs),
    ):
        if value is not None and not value > 0:
            _fail(f"{flag}: needs a positive number")
    if args.restart_s is not None and not args.restart_s >= 0:
        _fail("--restart-s: needs a number of seconds >= 0")
    return Overrides(args.host_gbs, args.nic_gbps, args.snapshot_cap_gbs, args.restart_s)


def _tables(folder: Path, name: str, text: str) -> list[Path]:
    """Print `text` and write it to `folder/name`; the path in a list (figures are appended to it)."""
    print(text)
    return [write_text(folder, name, text)]


def _said_written(paths: list[Path], as_json: bool) -> None:
    """One `wrote: PATH` line per file: after a blank line on stdout, or on stderr with --json."""
    lines = "\n".join(f"wrote: {p}" for p in paths)
    if as_json:
        print(lines, file=sys.stderr)
    else:
        print("\n" + lines)


def _run_paper(args: argparse.Namespace) -> None:
    presets, overrides = list(PAPER_PRESETS.values()), _overrides(args)
    folder = output_dir(args.out)
    rows = scale_study(presets, overrides=overrides)
    if args.json:
        text = json.dumps([{**asdict(r), "speedup": r.speedup} for r in rows])
    else:
        text = layout_table(presets) + "\n\n" + study_table(rows)
    written = _tables(folder, "scale_study.json" if args.json else "scale_study.md", text)
    if not args.no_figure:
        written.append(write_figure(folder, STUDY_FIGURE, lambda path: plot_study(rows, Path(path))))
    _said_written(written, args.json)


def _run_paper_tables(args: argparse.Namespace) -> None:
    for path in args.measured or ():
        try:
            read_csv(path)
        except (OSError, ValueError) as err:
            _fail(f"--measured {path}: {err}")
    folder = output_dir(args.out)
    cells = all_cells(FITTED, zero1=not args.no_zero1, measured=args.measured)
    written = _tables(folder, "paper_tables.txt", render(cells).lstrip("\n"))
    if not args.no_figure:
        written.append(
            write_figure(folder, FIG11_FIGURE, lambda p: plot_fig11(FITTED, p, FIG11_671B_10M, FIG11_MIN_MOEVEMENT_1H))
        )
    _said_written(written, False)


def _run_sensitivity(preset: Preset, mtbf_min: float, args: argparse.Namespace) -> None:
    folder, as_json, ov = output_dir(args.out), args.json, _overrides(args)
    rows = sensitivity(preset, mtbf_min * 60, ov)
    targets = PAPER_REPORTED.get((preset.name, mtbf_min), {})
    points, best = break_even(preset, mtbf_min * 60, targets, ov), best_speedup(preset, mtbf_min * 60, ov)
    if as_json:
        rows_json = [asdict(r) for r in rows]
        text = json.dumps({"rows": rows_json, "break_even": [asdict(b) for b in points], "best_speedup": asdict(best)})
    else:
        text = "\n".join(
            [
                f"preset={preset.name} mtbf_min={mtbf_min:g}\n",
                sensitivity_table(rows),
                "\nwhere the paper's figures for this preset and MTBF (if any) would be reached:",
                *break_even_lines(points, best),
            ]
        )
    _said_written(_tables(folder, "sensitivity.json" if as_json else "sensitivity.md", text), as_json)


def _checked(args: argparse.Namespace) -> tuple[Preset, list[str]]:
    """The preset (with overrides) and strategies of a --preset or --sensitivity run, or one error line."""
    if args.preset not in PRESETS:
        _fail(f"--preset: unknown {args.preset!r} (allowed: {', '.join(PRESETS)})")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        _fail(f"--strategies: unknown {','.join(bad) or '(empty)'} (allowed: {', '.join(STRATEGIES)})")
    if args.mtbf_min is None or not args.mtbf_min > 0:
        _fail("--mtbf-min: needs a positive number of minutes (or inf)")
    for flag, value in (("--interval", args.interval), ("--window", args.window)):
        if value is not None and value < 1:
            _fail(f"{flag}: needs an integer >= 1")
    return PRESETS[args.preset], strategies


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    try:
        _dispatch(args)
    except OutputError as err:
        _fail(str(err))


def _dispatch(args: argparse.Namespace) -> None:
    """Run the one mode `args` asks for; a mode that writes makes its output directory once its other
    inputs are checked and before it computes anything."""
    if args.list:
        return _list()
    if args.node_loss:
        return print(node_loss_report())
    if args.profile:
        return _run_profile(args.profile, args.json)
    if args.window_profile:
        return _run_window_profile(args.window_profile)
    if args.paper_tables:
        return _run_paper_tables(args)
    if args.paper:
        return _run_paper(args)
    if args.sensitivity:
        args.preset = args.preset or SENSITIVITY_PRESET
        args.mtbf_min = SENSITIVITY_MTBF_MIN if args.mtbf_min is None else args.mtbf_min
    preset, strategies = _checked(args)
    if args.sensitivity:
        return _run_sensitivity(preset, args.mtbf_min, args)
    _report(preset, args.mtbf_min * 60, strategies, args)


def _report(preset: Preset, mtbf_s: float, strategies: Sequence[str], args: argparse.Namespace) -> None:
    overrides, lay = _overrides(args), preset.layout
    s = preset_setting(preset, overrides)
    results = predict(preset, mtbf_s, strategies, args.interval, args.window, overrides)
    head = {
        "preset": preset.name,
        "gpus": lay.gpus,
        "params_b": preset.model.total_params() / 1e9,
        "stages": lay.pp,
        "pipelines": lay.pipelines,
        "ep": lay.ep,
        "micro_batches": lay.micro_batches,
        "iter_s": s.iteration_s,
        "snapshot_gbs": snapshot_bandwidth(s) / GB,
        "node_state_gb": s.node_state_bytes / GB,
        "mtbf_min": mtbf_s / 60,
    }
    if args.json:
        rows = {r.strategy: {k: _finite(v) for k, v in asdict(r).items()} for r in results}
        print(json.dumps({**{k: _finite(v) for k, v in head.items()}, "strategies": rows}))
        return
    print(" ".join(f"{k}={_fmt(v)}" for k, v in head.items()))
    for r in results:
        print(
            f"strategy={r.strategy} ettr={_fmt(r.ettr)} ettr_closed={_fmt(r.ettr_closed)} overhead={_fmt(r.overhead)} "
            f"zero_loss={_fmt(r.zero_loss)} recovery_s={_fmt(r.recovery_s)} fixed_s={_fmt(r.fixed_s)} "
            f"interval={_fmt(r.interval)} "
            f"window={_fmt(r.window)} plt={_fmt(r.plt)}"
        )


if __name__ == "__main__":
    main()

"""Records which project module calls which during a localized recovery (used by tests/test_layering.py).

Put this directory on PYTHONPATH and set CALL_TRACE_DIR: each rank's main thread records, from the call of
`MoEvement.recover` (or of the `moevement/strategy.py` method CALL_TRACE_FROM names: `resume` traces the
rejoin after a real death) to its return, every call into a project module as
`caller<TAB>callee<TAB>function`, and writes the rows to `CALL_TRACE_DIR/rank<RANK>.tsv` at exit.
"""

import atexit
import os
import sys
from pathlib import Path

OUT = os.environ.get("CALL_TRACE_DIR")
START = os.environ.get("CALL_TRACE_FROM", "recover")
ROOT = str(Path(__file__).resolve().parents[2]) + os.sep

if OUT:
    rows: list[str] = []
    tracing = [False]

    def _module(code) -> str | None:
        path = code.co_filename
        if not path.startswith(ROOT) or f"{os.sep}.venv{os.sep}" in path:
            return None
        return path[len(ROOT) :]

    def _profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        callee = _module(frame.f_code)
        if callee is None:
            return
        is_recover = callee == "moevement/strategy.py" and frame.f_code.co_name == START
        if event == "return":
            tracing[0] = tracing[0] and not is_recover
            return
        tracing[0] = tracing[0] or is_recover
        if tracing[0]:
            caller = _module(frame.f_back.f_code) if frame.f_back else None
            rows.append(f"{caller}\t{callee}\t{frame.f_code.co_name}")

    def _write() -> None:
        if rows:  # a rank shell and its standby trace nothing: the trainer's file stays
            Path(OUT, f"rank{os.environ.get('RANK', '0')}.tsv").write_text("\n".join(rows))

    sys.setprofile(_profile)
    atexit.register(_write)

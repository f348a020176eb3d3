"""Runs many bad-input cases in one process, so torch is imported once instead of once a case.

    python tests/bad_input_runner.py CASES.json RESULTS.json

CASES.json is a list of {"script", "argv", "env"}. Each case runs its script as `__main__` with
that argv and those environment variables, stdout and stderr captured, and must end within
`TIMEOUT` seconds (a case that reached a rendezvous would wait there). RESULTS.json gets, per
case, {"returncode", "stdout", "stderr"}: the exit code the script asked for, or 1 with the
traceback in stderr if it raised. Cases that need a fault injected at interpreter start
(tests/faults) are not for this runner: test_bad_input launches those on their own."""

import contextlib
import io
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 30


class TimedOut(Exception):
    pass


def on_alarm(signum, frame):
    raise TimedOut(f"no exit within {TIMEOUT} s")


def run_case(case):
    saved_env = dict(os.environ)
    saved_argv = sys.argv
    os.environ.update(case["env"] or {})
    sys.argv = [str(ROOT / case["script"]), *case["argv"]]
    out = io.StringIO()
    err = io.StringIO()
    code = 0
    signal.alarm(TIMEOUT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(ROOT / case["script"]), run_name="__main__")
    except SystemExit as exit_request:
        code = exit_request.code if isinstance(exit_request.code, int) else 1
    except BaseException:
        err.write(traceback.format_exc())
        code = 1
    finally:
        signal.alarm(0)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return dict(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def main():
    cases_path, results_path = sys.argv[1], sys.argv[2]
    sys.path.insert(0, str(ROOT))
    signal.signal(signal.SIGALRM, on_alarm)
    cases = json.loads(Path(cases_path).read_text())
    results = [run_case(case) for case in cases]
    Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main()

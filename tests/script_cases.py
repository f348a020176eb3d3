"""Several runs of the scripts in ONE launch (by torchrun or by tests/fork_server.py), one after
another, each in a process group of its own, so that a test module starts its ranks once per
world size, not once per case (helpers.launch_cases). argv[1]: a JSON list of [script, [flag,
...]]; each case's rank 0 prints its RESULT line, in order. The scripts run unchanged, through
their own main()."""

import importlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

for case, (script, flags) in enumerate(json.loads(sys.argv[1])):
    # setup() prefixes the launcher's store with this variable: a fresh one per case keeps each
    # group's rendezvous keys apart from the last one's
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"case{case}"
    sys.argv = [f"{script}.py", *map(str, flags)]
    importlib.import_module(script).main()
    sys.stdout.flush()

"""A child for the zygote tests (`python -m tests.support.zygote_probe OUT [EXIT]`): writes what it was given.

OUT gets, as JSON, what a fresh `python -m` process would have of its own: argv,
working directory, sys.path[0], an environment variable, its process group, torch's
thread count and a random draw. Then it exits with EXIT (default 0), or, with
EXIT `wait`, waits until killed.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

if __name__ == "__main__":
    torch = sys.modules.get("torch")
    report = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "probe_value": os.environ.get("ZYGOTE_PROBE"),
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "torch_preloaded": torch is not None,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "random": random.random(),
    }
    # Written whole, then renamed into place: a test that waits for the file to exist never reads it half-written
    # (seen once in CI: the supervisor test read an empty file).
    target = sys.argv[1]
    if os.path.exists(target) and not os.path.isfile(target):  # /dev/null: written in place, never replaced
        partial = target
    else:
        partial = f"{target}.{os.getpid()}.partial"
    with open(partial, "w") as out:
        json.dump(report, out)
    if partial != target:
        os.replace(partial, target)
    if sys.argv[2:] == ["wait"]:
        while True:
            time.sleep(0.05)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)

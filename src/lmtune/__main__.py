"""`python -m lmtune` and `torchrun -m lmtune`."""

import os
import sys

from lmtune.cli import main
from lmtune.distributed import launched_world_size

if __name__ == "__main__":
    code = main()
    if launched_world_size() > 1:
        # A worker of a launched job has written and closed everything. Interpreter teardown can
        # still abort it ("terminate called without an active exception": gloo threads meeting
        # objects freed at exit), which the launcher would report as a crash of this rank.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)

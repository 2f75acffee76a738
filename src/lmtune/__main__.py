"""`python -m lmtune` and `torchrun -m lmtune`."""

import os
import sys

from lmtune.cli import main, run
from lmtune.parallel.launched import die_with_launcher

if __name__ == "__main__":
    # A worker of a launched job (torchrun, lmtune's launcher, an elastic restart) never outlives it.
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        run()
    die_with_launcher()
    code = main()
    # A worker of a launched job has written and closed everything. Interpreter teardown can
    # still abort it ("terminate called without an active exception": gloo threads meeting
    # objects freed at exit), which the launcher would report as a crash of this rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

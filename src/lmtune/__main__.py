"""`python -m lmtune` and `torchrun -m lmtune`."""

from lmtune.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

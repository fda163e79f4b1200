"""`python -m flashrt ...`: the `flashrt` command (flashrt/cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

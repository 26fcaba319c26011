"""`python eval.py --config ...` behaves like `refractor eval --config ...` (for Telescope users)."""

import sys

from refractor.cli import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "eval", *sys.argv[1:]]
    main()

"""`python eval.py --config ...` behaves like `refractor eval --config ...` (for Telescope users).

When the CLI has no `eval` command (standalone checkpoint evals are not implemented), this says so
instead of failing with a confusing "no such command".
"""

import sys

from refractor.cli import app, main

if __name__ == "__main__":
    if "eval" not in {c.name for c in app.registered_commands}:
        sys.exit("refractor eval (standalone checkpoint evals) is not implemented yet")
    sys.argv = [sys.argv[0], "eval", *sys.argv[1:]]
    main()

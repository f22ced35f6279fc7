"""``python -m jitattn.bench ARGS``: the same command as ``jitattn bench ARGS`` (:func:`jitattn.cli.bench`)."""

import sys

from jitattn.cli import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]], prog_name="jitattn")

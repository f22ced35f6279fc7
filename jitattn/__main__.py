"""``python -m jitattn``: the same command line as the ``jitattn`` script."""

from jitattn.cli import app

app(prog_name="jitattn")

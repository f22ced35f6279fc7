"""The package version, in a module of its own so that every other module can read it without
importing the package (``jitattn/__init__.py`` re-exports it)."""

__version__ = "0.1.0"

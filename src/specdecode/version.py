"""The package version, in a module of its own: the reports and the server read it without
importing the package's __init__ (which imports the Python API)."""

__version__ = "0.1.0"  # = pyproject.toml's version

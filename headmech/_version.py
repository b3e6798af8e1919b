"""The package version (one place; ``headmech.__version__`` re-exports it)."""

__version__ = "0.1.0"

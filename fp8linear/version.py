"""The package version (its own module: checkpoints record it without importing the package
back)."""
__version__ = "0.1.0"

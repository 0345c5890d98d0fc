"""behemoth's version: one place, read by the package face and `behemoth --version`."""

__version__ = "0.1.0"

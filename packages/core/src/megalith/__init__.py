"""megalith: parallel training core."""

__version__ = "0.1.0"

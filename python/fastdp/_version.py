"""fastdp's version, in a module of its own so that fastdp's modules can read it without importing the package."""

__version__ = "0.1.0"

"""DiLoCoX algorithm: model, data, inner/outer optimization. No sockets, no event loop."""

__version__ = "0.1.0"

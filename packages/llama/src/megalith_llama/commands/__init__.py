"""One module per CLI command, each with `register(subparsers, parent)` and `run(args) -> int`."""

"""The project's tools, each run from the repository root as ``python -m tools.<name>`` (tools/README.md)."""

"""The studies behind the docs: ``python -m tools.studies.<name>`` from the repository root (tools/README.md)."""

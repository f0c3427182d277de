"""``python -m tools.benchmarks.bench``: the phase benchmark (its options and what it prints: ``__init__.py``)."""

from tools.benchmarks.bench import main

if __name__ == "__main__":
    main()

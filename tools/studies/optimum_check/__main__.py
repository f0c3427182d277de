"""``python -m tools.studies.optimum_check``: train on an enumerable task against the closed-form optimum (its
options: ``__init__.py``)."""

from tools.studies.optimum_check import main

if __name__ == "__main__":
    main()

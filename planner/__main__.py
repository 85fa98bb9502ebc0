"""``python -m planner`` is the same as the ``dsplan`` console script."""

from planner.cli import main

if __name__ == "__main__":
    main()

"""``python -m volconv``: the same command line as ``volconv``."""

from volconv.cli import main

if __name__ == "__main__":
    main()

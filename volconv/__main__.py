"""``python -m volconv``: the same command line as ``volconv``."""

from volconv.cli import entry_point

if __name__ == "__main__":
    entry_point()

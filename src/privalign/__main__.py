"""``python -m privalign``: the command line (see ``privalign --help``)."""

from .cli import main

if __name__ == "__main__":
    main()

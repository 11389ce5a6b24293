"""``python -m privalign``: the command line (see ``privalign --help``)."""

import sys


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        from .demo import main as demo
        demo()
        return
    print("usage: privalign demo", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()

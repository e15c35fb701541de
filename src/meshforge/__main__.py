import signal
import sys


def _interrupted_early(signum, frame):  # noqa: ARG001 - signal API
    print("meshforge: interrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130)


# A Ctrl-C while the commands load is one line, not an import's traceback
signal.signal(signal.SIGINT, _interrupted_early)
from meshforge.cli import main  # noqa: E402

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()

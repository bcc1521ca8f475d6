"""Copy stdin to stdout with each line prefixed by the seconds since this script started: the stage times
of a command's own progress lines.

    /usr/bin/time -v dofla dof smollm2-135m --out /tmp/x 2>&1 | python -u bench/stamp_lines.py
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    start = time.time()
    for line in sys.stdin:
        sys.stdout.write(f"[{time.time() - start:7.1f}s] {line}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

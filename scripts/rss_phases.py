"""Peak resident memory of a command, by the progress line it was printing at the time (issue 26, point 12).

    .venv/bin/python scripts/rss_phases.py -- .venv/bin/python -m autopp profile --hf-config C.json ...

Samples the command's RSS (/proc/PID/status VmRSS) every 0.05 s while reading its stderr, and prints the overall peak
and the highest RSS seen under each progress line (the ten highest), so that a peak can be put on the unit and phase
that made it. Linux only; the sampling can miss a peak shorter than its period (/usr/bin/time -v does not).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, bufsize=1)
    last = ["(start)"]

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            for part in line.split("\r"):
                if part.strip():
                    last[0] = part.strip()[:110]
    threading.Thread(target=read, daemon=True).start()
    start, peaks = time.time(), {}  # type: ignore[var-annotated]
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS"))
        except (OSError, StopIteration):
            break
        peaks[last[0]] = max(peaks.get(last[0], 0), rss)
        time.sleep(0.05)
    top = max(peaks.values(), default=0)
    print(f"exit {proc.wait()}, {time.time() - start:.0f} s, peak RSS {top / 2**30:.2f} GiB")
    for phase, rss in sorted(peaks.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{rss / 2**30:7.2f} GiB  {phase}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

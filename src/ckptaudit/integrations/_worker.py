"""The guard's child process (``Guard(background="process")``): one JSON request per line on stdin, one answer
per line on stdout, until stdin closes.

    {"checkpoint": PATH, "report": PATH, "options": {...}}  ->  {"ok": bool, "summary": str, "codes": [...]}
                                                             or {"error": "Type: message"}

Started as ``python -m ckptaudit.integrations._worker`` (never by re-importing the training script, as
multiprocessing's spawn would), it imports no torch: the audit reads files with NumPy.
"""

from __future__ import annotations

import json
import sys

from ckptaudit.integrations.guard import audit_to_file


def main() -> int:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            answer = audit_to_file(req["checkpoint"], req["report"], req.get("options", {}))
        except Exception as exc:  # noqa: BLE001 - reported to the guard, which logs it as "not judged"
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

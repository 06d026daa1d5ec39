"""Container health check: exit 0 when ``/readyz`` answers 200, else 1 (standard library only).

``python -m attnscope.service.healthcheck [URL]``; the URL defaults to
``http://127.0.0.1:$ATTNSCOPE_PORT/readyz`` (port 8000). Used by the Dockerfile's
``HEALTHCHECK`` and docker-compose's ``healthcheck`` (the slim image has no curl). Readiness,
not liveness: the container is healthy only once the model is loaded and its probe forward passed.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    url = argv[0] if argv else f"http://127.0.0.1:{os.environ.get('ATTNSCOPE_PORT', '8000')}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT", "4"))) as r:
            ok = r.status == 200
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"not ready: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

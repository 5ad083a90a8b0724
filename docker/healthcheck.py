"""The image's HEALTHCHECK: exit 0 when `/ready` answers 200 on the address `eg2 serve` listens on.

The address comes from Settings, read exactly as the server reads it (EG2_HOST, EG2_PORT): a
wildcard host (0.0.0.0, ::) is asked on its loopback, a specific one (10.1.2.3, ::1, a name) on
itself. /ready needs no API key. Exit 1 otherwise (not ready yet, draining, or not listening).
Flags given to `eg2 serve` (`--port 9000`) are not seen here: set the address through EG2_* variables.
The request goes direct: an HTTP proxy in the container's environment is not asked for loopback.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

from app.settings import Settings

LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
TIMEOUT_S = 3.0  # below the HEALTHCHECK's --timeout, so a hung server gives a clean exit 1


def ready_url(host: str, port: int) -> str:
    host = LOOPBACK.get(host, host)
    if ":" in host:  # an IPv6 literal goes in brackets
        host = f"[{host}]"
    return f"http://{host}:{port}/ready"


def main() -> int:
    settings = Settings()
    url = ready_url(settings.host, settings.port)
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with direct.open(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:  # HTTPError (503 while loading) is a URLError
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

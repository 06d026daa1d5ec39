"""``attnscope serve`` with tests/loop_lag.py's probe on its event loop, one lag a line to a
file (conftest.start_server's ``lag_log``):

    python tests/lag_serve.py LAG_FILE serve [serve arguments]

With ``ATTNSCOPE_TEST_HOLD=PATH`` (conftest.start_server's ``hold``) every job on the device
slot first waits while PATH exists: a test holds the device for as long as it needs (a request
past its deadline with its work still to do, on any hardware), then deletes the file. A file
holding an integer K lets the first K jobs that start while it exists through, then holds the
rest (a client that
has made progress and is certainly still running, whatever the hardware).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import uvicorn

from loop_lag import probe

_serve = uvicorn.Server.serve


async def _probed_serve(self, *args, **kwargs):
    with open(LAG_FILE, "a", buffering=1, encoding="ascii") as f:
        task = asyncio.get_running_loop().create_task(probe(lambda lag: f.write(f"{lag:.6f}\n")))
        try:
            return await _serve(self, *args, **kwargs)
        finally:
            task.cancel()


def _hold_the_device(path: str) -> None:
    from attnscope.service.serving.core.slot import DeviceSlot

    run = DeviceSlot.run
    passed = [0]

    def free_passes() -> int:
        try:
            with open(path, encoding="ascii") as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    async def held_run(self, fn, *args, **kwargs):
        def held(*a):
            # the test's gate: an event, no bound on it here
            if os.path.exists(path):  # jobs count from the moment the test closes the gate
                while os.path.exists(path) and passed[0] >= free_passes():
                    time.sleep(0.01)
                passed[0] += 1
            return fn(*a)

        return await run(self, held, *args, **kwargs)

    DeviceSlot.run = held_run


if __name__ == "__main__":
    LAG_FILE = sys.argv.pop(1)
    uvicorn.Server.serve = _probed_serve
    if os.environ.get("ATTNSCOPE_TEST_HOLD"):
        _hold_the_device(os.environ["ATTNSCOPE_TEST_HOLD"])
    from attnscope.service.cli import main

    sys.exit(main())

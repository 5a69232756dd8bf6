# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Learning off the serving path: one update job at a time in a worker thread, applied at fixed points.

With `update_mode="background"` the adapter trains a SHADOW copy of the drafter (its own LoRA weights and optimizer
state) while the live drafter keeps drafting with the weights it has: drafting never sees a half-written adapter
(double buffering). The job that learns from request `t` is submitted when request `t` ends and runs while request
`t + 1` is served; its weights are copied into the live drafter when request `t + 1` ends (the serving thread waits
there only if the job is not done yet). The lag is therefore always exactly one request, whatever the machine load,
so greedy outputs stay those of plain greedy (the target verifies everything anyway) and seeded sampled outputs stay
reproducible.

torch releases the GIL inside its kernels, so on a machine with idle cores (or a GPU's idle host thread) the update
costs the serving path nothing but the final copy; on a saturated CPU both threads share the cores.
"""

import threading
import time


class BackgroundUpdates:
    """A single worker thread running one job at a time (`submit`), joined by `wait`."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.busy_seconds = 0.0  # time jobs ran in the worker
        self.wait_seconds = 0.0  # time the serving thread waited for a job

    def submit(self, job) -> None:
        """Run `job()` in the worker (after the previous job, which is waited for)."""
        self.wait()

        def run():
            start = time.perf_counter()
            try:
                job()
            except BaseException as error:  # re-raised in the serving thread by `wait`
                self._error = error
            finally:
                self.busy_seconds += time.perf_counter() - start

        self._thread = threading.Thread(target=run, name="onlinespec-update", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Wait for the running job (if any); re-raise its error. Returns the seconds waited."""
        waited = 0.0
        if self._thread is not None:
            start = time.perf_counter()
            self._thread.join()
            waited = time.perf_counter() - start
            self.wait_seconds += waited
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return waited

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


__all__ = ["BackgroundUpdates"]

"""A later pipeline stage takes its requests on a thread of its own, ahead of its forward.

Gloo moves a message only once its receive is posted (`vserve.workers.pp_comm`). A CPU stage
that took step k+1's request only after its forward of step k would post the receive of step
k+1's hidden states late, and the previous stage's transport thread, on a core busy with that
stage's next forward, would answer it milliseconds later: the pipeline would stall at every
hop. This thread takes each request as soon as the previous rank sends it (passing it on to
the next rank at once), decodes it, and posts the receive of its hidden states, so that
when the stage gets to the step its input has usually arrived.

Only where the data plane is gloo (CPU): NCCL operations of one communicator stay on one
thread, and a GPU stage's host is not busy computing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vserve.workers import messages as wire


@dataclass
class Prefetched:
    message: wire.WorkerRequest | None = None
    hidden: Callable | None = None  # waits for the posted hidden states (Execute only)
    taken_error: BaseException | None = None  # the previous rank is gone
    request_error: BaseException | None = None  # a frame that is no request, or its input's
    #                                             receive could not be posted


class RequestPrefetch:
    def __init__(self, pp, post_hidden: bool) -> None:
        self.pp = pp
        self.post_hidden = post_hidden
        self.items: queue.Queue[Prefetched] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="vserve-pp-requests")
        self.thread.start()

    def next(self) -> Prefetched:
        return self.items.get()

    def _loop(self) -> None:
        while True:
            try:
                data = self.pp.pass_request(None)
            except BaseException as exc:  # noqa: BLE001 -- the main loop decides
                self.items.put(Prefetched(taken_error=exc))
                return
            try:
                msg = wire.decode_request(data)
                hidden = None
                if self.post_hidden and isinstance(msg, wire.Execute) and not msg.so.is_empty:
                    hidden = self.pp.post_recv_hidden(msg.so)
            except BaseException as exc:  # noqa: BLE001 -- reported by the main loop
                self.items.put(Prefetched(request_error=exc))
                return
            self.items.put(Prefetched(msg, hidden))
            if isinstance(msg, wire.Shutdown):
                return

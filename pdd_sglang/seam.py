"""The one way test and benchmark aids reach serving code.

Serving code calls ``seam.aids.<point>(...)`` at a few named places. The object there by default,
:class:`Aids`, does nothing at every point (it hands back what it was given), so a production
server pays one method call per point and takes no branch of its own. Tests swap the object for
one that forces handoff points, delays or damages a copy; serving code never knows which.

Who installs aids (:func:`install`), and nobody else:

- the debug patch series (``patches/debug/``, applied by the test profile only): in every scheduler
  process it calls ``pdd_sglang.dev.debug_aids.install_for(server_args)``, which installs the aids
  its ``--pdd-debug-*`` flags ask for (the flags themselves are registered by that series too);
- a test that drives a role in-process, through ``pdd_sglang.dev.debug_aids`` or its own subclass.

Serving code never imports ``pdd_sglang.dev`` (``tests/unit/test_layout.py``), so an aid's logic
lives there and only this interface lives here. Every point runs on the thread named beside it;
on a relay or main at ``--tp-size`` > 1 each rank calls it with the same inputs, so an aid must
decide from them alone (no clock or randomness of its own) for the ranks to stay alike.

The points:

``relay_hand_off(relay, running_batch, now, hand_off) -> running_batch``
    Relay, scheduler thread, each step once main's messages are read: ``hand_off(running_batch,
    now)`` is the relay's own part of the step (answer main's pending requests, send chunks, take
    a request whose last chunk is out of the batch), which the point must call once and whose
    batch it returns. Around that call an aid may take requests out of the batch with
    ``relay._leave_batch`` (the relay then owns them: it resumes, finishes or aborts them), abort
    one with ``relay._abort``, and take rooms out of ``relay.pending`` for the call, putting them
    back after it (main's request then waits for a later step); it writes no other relay table.
``main_wan_kv_landed(main, req, start)``
    Main, scheduler thread: ``req``'s KV from position ``start`` crossed the WAN and is about to
    be hashed for ``--pdd-enable-kv-digest`` (it may be changed in place, as damage would).
``main_staged_kv(req, view)``
    Main, its landing thread: a record of ``req``'s packed WAN copy (``view``, the record's frame
    in its staging slot, :mod:`pdd_sglang.kv_codec.wire`) has arrived, its header checked, and is
    about to be decoded into its pages (it may be changed in place, as damage would).
``before_send(work)``
    Prefill, a sender thread, before it writes one :class:`~pdd_sglang.prefill.room.Work` (one
    chunk to one destination; ``work.role`` says which). May sleep: it holds that sender only.
``wan_engine_opened(engine)``
    Prefill, scheduler thread, once per WAN engine right after it opened and before any copy: an
    aid may adapt that engine (a benchmark's Mooncake-synchronous wait).
"""

from __future__ import annotations

from typing import Any, Callable


class Aids:
    """No aid: every point leaves serving as it is. Aids subclass this and override points."""

    def relay_hand_off(self, relay: Any, running_batch: Any, now: float,
                       hand_off: Callable[[Any, float], Any]) -> Any:
        return hand_off(running_batch, now)

    def main_wan_kv_landed(self, main: Any, req: Any, start: int) -> None:
        return None

    def main_staged_kv(self, req: Any, view: Any) -> None:
        return None

    def before_send(self, work: Any) -> None:
        return None

    def wan_engine_opened(self, engine: Any) -> None:
        return None


aids: Aids = Aids()  # read at each call (``seam.aids.x``), so an install reaches every caller


def install(new: Aids) -> Aids:
    """Make ``new`` the aids every point calls; the ones it replaces (to put back after a test)."""
    global aids
    previous, aids = aids, new
    return previous

"""Ctrl-C inside a wrapper's forward always reaches its caller, even where Python itself drops it.

NOTE [an interrupt a finalizer swallowed]
A SIGINT raises KeyboardInterrupt in whatever Python code the main thread runs next. When that code is a finalizer
(a weakref callback, a ``__del__``, a generator closed by the garbage collector: a dead ``threading.Thread`` leaving
``threading``'s WeakSet is one that runs during a step), Python cannot raise out of it: it reports "Exception
ignored in ..." through ``sys.unraisablehook`` and drops the interrupt, and the forward returns as if no Ctrl-C had
come. So while the outermost forward of the main thread runs, ``sys.unraisablehook`` is a ``Watch`` that keeps such a
KeyboardInterrupt (every other report goes to the hook it replaced), and the forward raises it when it ends. The
forward puts the replaced hook back as the first statement of its ``finally``, with no call before it: an interrupt
can land on the first line of any function, and a watch left installed would outlive the forward.
"""

import sys
import threading

__all__ = ["Watch", "watch"]


class Watch:
    """``sys.unraisablehook`` while a forward runs: keeps the KeyboardInterrupt a finalizer could not raise."""

    __slots__ = ("previous", "interrupt")

    def __init__(self, previous):
        self.previous = previous  # the hook it replaced, put back by the forward
        self.interrupt = None  # the first KeyboardInterrupt swallowed, or None

    def __call__(self, unraisable):
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            if self.interrupt is None:
                self.interrupt = unraisable.exc_value if unraisable.exc_value is not None else KeyboardInterrupt()
            return
        self.previous(unraisable)

    def raise_swallowed(self):
        """Raises the interrupt a finalizer swallowed while the forward ran, if any."""
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is not None:
            raise interrupt


def watch():
    """Installs a Watch for a forward about to run in the main thread, and returns it; None elsewhere (only the main
    thread receives SIGINT) and inside a forward that already watches."""
    if threading.current_thread() is not threading.main_thread() or type(sys.unraisablehook) is Watch:
        return None
    installed = sys.unraisablehook = Watch(sys.unraisablehook)
    return installed

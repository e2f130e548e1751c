"""Devices and streams, as every layer names them: device entries (``devices``: ``"cpu"``, ints, ``"cuda:k"``) and
the caller's CUDA streams carried to the threads that act for it (``streams``); and Ctrl-C that the interpreter drops
in a finalizer, raised at the end of the forward it landed in (``interrupts``)."""

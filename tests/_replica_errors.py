"""The text parallel_apply re-raises for an exception in a replica (upstream's ExceptionWrapper): shared by tests."""


class ReplicaError:
    """The "Caught" line, then the replica's traceback, whose frames are not compared, ending in `last_line`."""

    def __init__(self, type_name, replica, last_line, device="cpu"):
        self.head = [f"Caught {type_name} in replica {replica} on device {device}.",
                     "Original Traceback (most recent call last):"]
        self.last_line = last_line

    def matches(self, text):
        lines = str(text).splitlines()
        return (lines[:2] == self.head and all(line.startswith("  ") for line in lines[2:-1])
                and lines[-1] == self.last_line)

    def check(self, error):
        assert self.matches(error), str(error)

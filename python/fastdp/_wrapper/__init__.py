"""What the wrapper decides outside a step: which class a construction builds under a distributed launch
(``launch``), the checkpoint keys it saves and loads (``checkpoint``), upstream's checks (``checks``), and torch's
class as a base for ``isinstance`` only (``upstream``)."""

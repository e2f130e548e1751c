"""What the wrapper decides outside a step: which class a construction builds under a distributed launch
(``launch``), and the checkpoint keys it saves and loads (``checkpoint``)."""

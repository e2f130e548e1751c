"""Seeing each replica's step: recording (``recorder``: the measurements one step makes, read by the report and by
the time-balanced split alike) apart from reporting (``report``: numbers, advice, the printed and exported forms;
``plot``: its picture)."""

"""The C core from Python: the calls into ``fastdp._C`` with their streams and scratch (``core``), which
implementation serves each data move (``route``), torch's own implementation when the core cannot (``fallback``),
where the run-time libraries are (``libs``) and what fastdp can do on this machine (``info``)."""

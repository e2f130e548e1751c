"""Where a contract test puts its tensors. By default on emulated "cpu" devices; in the simulated-device contract run
(tests/sim/contract.py, run by tests/test_sim_contract.py) on simulated CUDA devices, so that the same test bodies
check the Python layer's CUDA paths through the real C core, against the same torch CPU references.

``devices(n)``: a device list of n entries (distinct simulated devices while there are enough, then repeated ids);
``on(t, k)``: host tensor t on the k-th of those devices (same values, shape and strides); ``dest()``: where a sum or
a gather goes."""

SIM = None  # the simulated devices' bridge (tests/sim/simcuda.py Bridge), set by tests/sim/contract.py


def devices(n):
    return ["cpu"] * n if SIM is None else [k % SIM.sim.ndev for k in range(n)]


def on(t, k=0):
    return t if SIM is None else SIM.tensor(t, k % SIM.sim.ndev)


def dest():
    return "cpu" if SIM is None else 0

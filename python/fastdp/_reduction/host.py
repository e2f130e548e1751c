"""Where a host bucket's sum runs: on one reducer thread per process while the thread that runs backward goes on
(the core releases the GIL while it adds), or at once on the calling thread for the last bucket of a backward
(nothing is left to overlap). Each started sum is a job its backward holds (the reducer's _Backward)."""

import os
import queue
import threading
import time
import weakref

from . import sums
from .jobs import HostJob

__all__ = ["HOST_THREAD", "timed_sum"]


class _HostThread:
    """One thread per process that sums host buckets in the order their nodes started them. Made on first use, and
    again in a forked child (threads do not survive a fork)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue = None
        self._pid = None

    def launch(self, bucket, grads, taken):
        job = HostJob()
        self._tasks().put((weakref.ref(job), bucket, grads, taken))  # the job is its backward's (_Backward)
        return job

    def _tasks(self):
        with self._lock:
            if self._pid != os.getpid():
                self._queue = queue.SimpleQueue()
                self._pid = os.getpid()
                threading.Thread(target=self._run, args=(self._queue,), name="fastdp-reducer", daemon=True).start()
            return self._queue

    @staticmethod
    def _run(tasks):
        while True:
            ref, bucket, grads, taken = tasks.get()
            value = error = None
            try:
                value = timed_sum(bucket, grads, taken)
            except BaseException as e:  # handed to the delivery node, which raises it in backward
                error = e
            del bucket, grads, taken
            job = ref()
            if job is not None:  # else its backward failed: nobody waits, and the sum is dropped here
                job.value, job.error = value, error
                done = job.done
                del job
                done.set()
            del value, error


HOST_THREAD = _HostThread()


def timed_sum(bucket, grads, taken):
    """The bucket's sum on the host, timed for the step's recorder when one records."""
    recorder = bucket.reducer.recorder
    if recorder is None:
        return sums.bucket_sum(bucket, grads, taken, None)
    began = time.perf_counter_ns()
    result = sums.bucket_sum(bucket, grads, taken, None)
    recorder.record("reduce", None, began, time.perf_counter_ns(), bucket.numel * bucket.itemsize, bucket=bucket.index)
    return result

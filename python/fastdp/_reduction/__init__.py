"""The gradient reduction: each bucket's readiness, where and when its sum runs, the work in flight, and what
``no_sync()`` keeps. One owner: the reducer (``reducer``); nothing outside this folder changes a bucket's reduction
state."""

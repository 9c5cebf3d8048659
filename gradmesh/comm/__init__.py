"""Gradient communication: the one place data-parallel gradients are averaged.

`reducer` holds the reducer interface and the wrappers every job installs (byte counting,
timing, in-place recovery's guard); `hooks` plugs a reducer into DDP; `flat` averages the
gradients of model-parallel ranks over the data axis with the same reducer; `p2p` times
pipeline stages' sends and receives.
"""

from gradmesh.comm.reducer import CommCounter, Counted, Guarded, MeanAllReduce, Reducer, Timed, build_reducer

__all__ = ["CommCounter", "Counted", "Guarded", "MeanAllReduce", "Reducer", "Timed", "build_reducer"]

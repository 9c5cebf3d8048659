"""Strategies: functions applied to a plain model, one row each in the registry (`registry`).

`registry` is the table (importable without torch); `compose` applies a plan's rows in their
fixed order; `data`, `sharded`, `tensor` and `pipeline` hold the strategies themselves; `state`
the optimizer-state view checkpoints use.
"""

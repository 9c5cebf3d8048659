"""The training loop: draw the global batch, hand it to the step engine, hand the outcome to the
services. `trainer` is the public API (Trainer, init, Session); `services` the after-step
interface; `build` assembles a run; `finish` ends one."""

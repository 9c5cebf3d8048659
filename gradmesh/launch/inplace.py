"""The launcher of in-place recovery: workers that outlive a failed peer.

torch elastic's agent stops every worker when one fails (and restarts them all); in-place
recovery needs the opposite policy, which the agent does not offer. So under
`--recovery inplace` gradmesh starts the workers of this one machine itself and hosts the job's
c10d store in the launcher — in no worker, so the loss of rank 0 does not take the store with
it. When a worker dies, the launcher does not stop the others: it publishes the new membership
(the original ranks still alive) under a new generation in the store, and the survivors build
a new process group from it (`gradmesh.fault.inplace`) and carry on.
"""

import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from gradmesh.fault.inplace import publish_members


def _describe(rank: int, code: int) -> str:
    if code < 0:
        return f"worker rank {rank} was killed by {signal.Signals(-code).name}"
    return f"worker rank {rank} exited with code {code}"


def run_inplace(nproc: int, target: list[str], collective_timeout: float) -> int:
    """Run `target` on nproc local workers; a failed worker is dropped, not fatal, while others live."""
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    publish_members(store, 0, list(range(nproc)))
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True",
                GRADMESH_INPLACE="1", GRADMESH_COLLECTIVE_TIMEOUT=str(collective_timeout))
    workers = {rank: subprocess.Popen([sys.executable, *target], env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)))
               for rank in range(nproc)}
    alive, generation, finished = set(workers), 0, 0
    try:
        while alive:
            time.sleep(0.02)
            for rank in sorted(alive):
                code = workers[rank].poll()
                if code is None:
                    continue
                alive.discard(rank)
                if code == 0:
                    finished += 1
                    continue
                generation += 1
                publish_members(store, generation, sorted(alive))
                carry = f"ranks {', '.join(map(str, sorted(alive)))} carry on in place" if alive else "no worker is left"
                print(f"gradmesh: {_describe(rank, code)}; {carry}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        for worker in workers.values():
            worker.terminate()
        raise
    if finished == 0:
        print("gradmesh: every worker failed; their tracebacks, if they left any, are above", file=sys.stderr)
        return 1
    return 0

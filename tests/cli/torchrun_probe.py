"""``kvpop train`` under torchrun, reporting on stderr how many FSDP/DDP-wrapped modules are still alive when
the process group is left (``tests/cli/test_cli_train.py``): a group torn down while a sharded model still held
it once aborted in gloo's teardown after a finished run."""
import gc
import sys

import kvpop.training.distributed as D

_leave = D.finish_process


def _counted(started: bool) -> None:
    gc.collect()
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    alive = sum(1 for o in gc.get_objects() if isinstance(o, (FSDPModule, DistributedDataParallel)))
    print(f"torchrun_probe: wrapped modules alive when the group is left: {alive}", file=sys.stderr)
    _leave(started)


D.finish_process = _counted

if __name__ == "__main__":
    from kvpop.cli import main

    sys.exit(main(sys.argv[1:]))

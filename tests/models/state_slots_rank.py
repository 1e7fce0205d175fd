"""A tensor-parallel rank (`kvrecover.worker.rank_worker`) whose model runner reports
the recurrent-state slot limit in `KVRECOVER_TEST_RANK_STATE_SLOTS`, as a GPU with less
free memory than rank 0's would (`ModelRunner.state_slot_limit`): the tests start it
in place of the real rank module (`parallel_runner.RANK_MODULE`)."""

from __future__ import annotations

import os
import sys

from kvrecover.worker import rank_worker
from kvrecover.worker.model_runner import ModelRunner

if __name__ == "__main__":
    slots = int(os.environ["KVRECOVER_TEST_RANK_STATE_SLOTS"])
    ModelRunner.state_slot_limit = property(lambda runner: slots)  # type: ignore[assignment]
    code = rank_worker.run_rank(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

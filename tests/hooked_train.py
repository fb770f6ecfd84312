"""``python tests/hooked_train.py [overrides]``: ``python -m nano_hybrid.train`` with test-only faults injected.

The faults are monkeypatches set from environment variables (the product code has no test hooks):

- ``NANO_HYBRID_TEST_KILL_DURING_SAVE=N``: SIGKILL the trainer after every rank wrote checkpoint step N,
  before it is published (a crash in the middle of a save);
- ``NANO_HYBRID_TEST_SAVE_ERRNO=N:ENOSPC``: the write of checkpoint step N writes part of a file, then fails
  with that errno (a disk that fills up, an I/O error, a permission change);
- ``NANO_HYBRID_TEST_FREE_BYTES=B``: the checkpoint filesystem reports B bytes free (storage preflight).
"""

from __future__ import annotations

import errno
import os
import signal
import sys


def install_faults() -> None:
    from nano_hybrid import storage
    from nano_hybrid.checkpoint import layout, mcore_io

    kill_step = os.environ.get("NANO_HYBRID_TEST_KILL_DURING_SAVE")
    if kill_step:
        publish = layout.publish

        def publish_or_die(root, ckpt, meta, cfg_yaml, keep_last):
            if str(meta["iteration"]) == kill_step:
                print(f"[test] SIGKILL during save of step {kill_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return publish(root, ckpt, meta, cfg_yaml, keep_last)

        layout.publish = publish_or_die

    save_errno = os.environ.get("NANO_HYBRID_TEST_SAVE_ERRNO")
    if save_errno:
        step, name = save_errno.split(":")
        write_state = mcore_io.write_state

        def write_state_or_fail(ckpt, state):
            if int(state["train_state"]["step"]) == int(step):
                with open(ckpt / "__0_0.distcp", "wb") as f:
                    f.write(b"\0" * 4096)
                code = getattr(errno, name)
                raise OSError(code, os.strerror(code), str(ckpt / "__0_0.distcp"))
            return write_state(ckpt, state)

        mcore_io.write_state = write_state_or_fail

    free = os.environ.get("NANO_HYBRID_TEST_FREE_BYTES")
    if free:
        storage.free_bytes = lambda path: int(free)


if __name__ == "__main__":
    install_faults()
    from nano_hybrid.train import main

    sys.exit(main(sys.argv[1:]))

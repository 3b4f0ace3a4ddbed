"""A torchrun entry point for test_multiprocess.py: ``python -m fastformer.train``, except that the process
writing the checkpoint of update DIE_AT (first argument) writes half of the file and is then killed
(SIGKILL: no cleanup, no exception handler runs), as a power cut or an OOM kill would."""
import io
import os
import signal
import sys

import torch

from fastformer.train import main

DIE_AT = int(sys.argv[1])
torch_save = torch.save


def save_half_then_die(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == DIE_AT:
        whole = io.BytesIO()
        torch_save(obj, whole, *args, **kwargs)
        f.write(whole.getbuffer()[: whole.tell() // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    torch_save(obj, f, *args, **kwargs)


torch.save = save_half_then_die
main(sys.argv[2:])

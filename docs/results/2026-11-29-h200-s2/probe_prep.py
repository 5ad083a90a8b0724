# The preprocessing probe run on the H200 host (16 cores) on 2026-11-29 ~23:18 UTC, from the repo root:
#   python3 probe_prep.py   (with the .whl wheels installed as the device README says)
# Its output is probe_prep.txt. The timing part of that untracked script, recreated after the run
# (a cProfile printout at its end is left out).
import os, time, sys
import torch
from eg2_runtime.tools.demo_model import write_demo_model
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions
from eg2_runtime.tools import samples
d = write_demo_model("/tmp/tinyprobe", size="tiny", seed=0, dtype="bfloat16")
e = Engine.from_dir(d, device="cpu")
o = PrepareOptions()
print("cpus", os.cpu_count(), "torch threads", torch.get_num_threads(), os.sched_getaffinity(0).__len__())
for kind, data in [("audio", samples.wav(9.3)), ("image", samples.png(640, 480)), ("video", samples.mp4(8))]:
    it = Item((MediaPart(kind, data),))
    for _ in range(2): e.prepare(it, o)
    t = time.perf_counter(); [e.prepare(it, o) for _ in range(5)]; one = (time.perf_counter() - t) / 5 * 1e3
    for threads in (1, 4, 8, 16):
        e.options = type(e.options)(prepare_threads=threads); e._pool = None
        e.prepare_many([it] * 16, o)
        t = time.perf_counter(); e.prepare_many([it] * 16, o); many = (time.perf_counter() - t) * 1e3
        print(f"{kind}: one {one:.1f} ms; 16 on {threads} threads {many:.1f} ms ({many/16:.1f} per item)")

"""Scratch: time waits by call site and train_step phases (not committed)."""
import atexit, collections, os, sys, time, traceback
import torch
from scripts.bench import bench_step

waits = collections.Counter(); counts = collections.Counter()
orig = None
def wait(self):
    if self.done:
        return orig(self)
    t = time.perf_counter()
    orig(self)
    dt = time.perf_counter() - t
    st = traceback.extract_stack(limit=6)[:-1]
    key = " < ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in reversed(st[-4:]))
    import inspect
    fr = inspect.currentframe().f_back
    u = fr.f_locals.get("self")
    key = f"{getattr(u, 'name', '?')}: " + key
    waits[key] += dt; counts[key] += 1

phases = collections.Counter()
orig_ts = bench_step.OurEngine.train_step
def train_step(self, inputs, labels):
    global orig
    if orig is None:
        from zeropp.comm import streams
        orig = streams.Pending.wait; streams.Pending.wait = wait
    t0 = time.perf_counter()
    loss = bench_step._loss(self.engine, inputs, labels)
    t1 = time.perf_counter()
    self.engine.backward(loss)
    t2 = time.perf_counter()
    self.engine.step()
    t3 = time.perf_counter()
    if phases["skip"] == 0:
        phases["skip"] = 1; waits.clear(); counts.clear(); return loss.item()
    phases["fwd"] += t1 - t0; phases["bwd"] += t2 - t1; phases["step"] += t3 - t2; phases["n"] += 1
    return loss.item()
bench_step.OurEngine.train_step = train_step

def dump():
    rank = os.environ.get("RANK")
    with open(f"/tmp/prof/{'_'.join(a for a in sys.argv if a.startswith('zero'))}_rank{rank}.txt", "w") as f:
        n = phases["n"] or 1
        f.write(" ".join(f"{k}={v/n:.3f}" for k, v in phases.items() if k not in ("n", "skip")) + f" n={n}\n")
        for k, v in waits.most_common(30):
            f.write(f"{v/n:8.3f}s/it {counts[k]/n:6.1f}x  {k}\n")
atexit.register(dump)
if __name__ == "__main__":
    sys.exit(bench_step.main())

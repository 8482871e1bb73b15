"""The serving check: three modules on the paths the planner chooses for them
(LSTM 256 and LSTM 1024 at batch 1, GRU 256 at batch 20), each called from 4
Python threads, every thread on its own CUDA stream with inputs of its own,
20 calls each. Prints, per module and path, the worst relative error of any
call against torch's module on the same inputs (TF32 off), and exits non-zero
above 1e-5.

    PYTHONPATH=. python scripts/concurrency_check.py
"""

import sys
import threading

import torch

import persistrnn

THREADS, CALLS, STEPS, BOUND = 4, 20, 50, 1e-5


def check(cls, size, batch):
    torch.manual_seed(0)
    theirs = getattr(torch.nn, cls.__name__)(size, size).cuda().eval()
    ours = persistrnn.from_torch(theirs)
    plan = ours.plan_for(batch)
    worst = [0.0] * THREADS

    def work(i):
        stream = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(i)
        with torch.cuda.stream(stream), torch.no_grad():
            pairs = []
            for _ in range(CALLS):
                x = torch.randn(STEPS, batch, size, device="cuda", generator=gen)
                pairs.append((ours(x)[0], theirs(x)[0]))
            stream.synchronize()
            worst[i] = max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in pairs)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return plan, max(worst)


def main() -> int:
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    failed = False
    print(f"{'module':<22} {'batch':>5}  {'path':<40} worst rel. error ({THREADS} threads x {CALLS} calls)")
    for cls, size, batch in ((persistrnn.LSTM, 256, 1), (persistrnn.LSTM, 1024, 1), (persistrnn.GRU, 256, 20)):
        plan, err = check(cls, size, batch)
        path = plan.path + (f" {plan.config.sync}x{plan.config.blocks}" if plan.config else "")
        print(f"{cls.__name__}({size}, {size}){'':<10} {batch:>5}  {path:<40} {err:.2e}")
        failed |= not err <= BOUND
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

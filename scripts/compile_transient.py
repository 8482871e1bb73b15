"""What a compiled persistrnn call costs in the seconds after its compile:
per half-second window, host µs per compiled call (back to back, no GPU
wait), ms per call by CUDA events, the eager module's ms in the same window,
the host's busy cores (from /proc/stat), this process's live descendants
(inductor's compile workers, which ``torch.compile`` starts on its first use
where Triton is installed), and how many of the window's compiled calls took
the Python path (``persistrnn.ops.forward``) rather than the native replay.

    PYTHONPATH=. python scripts/compile_transient.py [--batch 1] [--seconds 12] [--wait-pool] [--no-gc]

``--wait-pool`` waits for inductor's worker pool to be ready before the
windows start (what ``bench compile`` does before it times).
"""

import argparse
import os
import sys
import threading
import time
import traceback

import torch

import persistrnn


def busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def descendants() -> int:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo, seen = [os.getpid()], 0
    while todo:
        for kid in children.get(todo.pop(), []):
            seen += 1
            todo.append(kid)
    return seen


def cuda_ms(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--wait-pool", action="store_true")
    ap.add_argument("--no-gc", action="store_true", help="gc.freeze() and gc.disable() before the windows")
    args = ap.parse_args()
    torch._dynamo.config.allow_rnn = True
    python_calls = [0]
    python_forward = persistrnn.ops.forward

    def counted(*a, **k):
        python_calls[0] += 1
        return python_forward(*a, **k)

    persistrnn.ops.forward = counted
    model = persistrnn.LSTM(128, 128, num_layers=2).cuda().eval()
    x = torch.randn(50, args.batch, 128, device="cuda")
    with torch.no_grad():
        for _ in range(20):  # plan, capture, native replay bound
            model(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        compiled = torch.compile(model, fullgraph=True)
        compiled(x)
        torch.cuda.synchronize()
        print(f"compile + first call {time.perf_counter() - t0:.2f} s, descendants {descendants()}")
        if args.wait_pool:
            from torch._inductor.async_compile import AsyncCompile

            t1 = time.perf_counter()
            AsyncCompile.wait_pool_ready()
            print(f"pool ready after {time.perf_counter() - t1:.2f} s more")
        if args.no_gc:
            import gc

            gc.collect()
            gc.freeze()
            gc.disable()
        print("t s | busy cores | descendants | threads | python loop us | compiled host us | Python-path calls "
              "| compiled ms | eager ms")
        begin = time.perf_counter()
        while time.perf_counter() - begin < args.seconds:
            b0, t0_ = busy_jiffies()
            w0 = time.perf_counter()
            loop = time.perf_counter()
            sum(range(20000))  # pure Python: slow when another thread holds the GIL
            loop = (time.perf_counter() - loop) * 1e6
            python_calls[0] = 0
            h0 = time.perf_counter()
            for _ in range(100):
                compiled(x)
            host = (time.perf_counter() - h0) / 100 * 1e6
            slow = python_calls[0]
            torch.cuda.synchronize()
            ms_c = cuda_ms(lambda: compiled(x), 50)
            ms_e = cuda_ms(lambda: model(x), 50)
            while time.perf_counter() - w0 < 0.5:
                time.sleep(0.01)
            b1, t1_ = busy_jiffies()
            cores = os.cpu_count() * (b1 - b0) / max(t1_ - t0_, 1)
            print(f"{w0 - begin:5.1f} | {cores:5.1f} | {descendants():3d} | {threading.active_count():3d} "
                  f"| {loop:6.0f} | {host:7.1f} | {slow:3d} | {ms_c:.4f} | {ms_e:.4f}")
        for ident, frame in sys._current_frames().items():  # what the other threads were doing at the end
            if ident != threading.get_ident():
                name = next((t.name for t in threading.enumerate() if t.ident == ident), "?")
                print(f"thread {name}:", " <- ".join(f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)})"
                                                   for f, _ in traceback.walk_stack(frame))[:600])


if __name__ == "__main__":
    main()

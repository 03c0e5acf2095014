"""Page faults and 8-row decode steps of ``LLM.generate`` called from several depths, with its
loop started from the frame room (``call_with_frame_room``, notebook 03) and without it.

    python bench/experiments/frame_chunk_ab.py --model M [--depths 0,3,6,9,12] [--rounds 2]

Why this exists: CPython 3.11+ keeps a thread's frames in mapped chunks and unmaps a chunk
when its first frame returns, so a step loop whose call tree straddles a chunk boundary maps
and unmaps one many times a step. Whether it does depends on how deep the loop's caller is.
Each (depth, arm) runs in a process of its own, one after the other (two at once would share
the machine's two cores), and prints its minor page faults per step (a count: the same on
any machine) and its median 8-row step (a time: compare only the two arms of one depth).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time


def child(model: str, depth: int, room: bool, rounds: int) -> dict:
    """One process: the compiled engine, generate() ``depth`` frames deep, ``rounds`` times."""
    import minivllm.engine as engine_module
    from minivllm import LLM, SamplingParams

    if not room:  # the bare loop: generate steps from wherever its caller happens to be
        engine_module.call_with_frame_room = lambda fn, *args: fn(*args)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(128)]}
               for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = LLM(model)
    llm.engine.runner.wait_until_compiled()
    steps: list[tuple[int, int, float]] = []
    real_step = llm.engine.step

    def timed_step():
        start = time.perf_counter()
        out = real_step()
        steps.append((len(llm.engine.scheduler.running), len(llm.engine.scheduler.waiting),
                      time.perf_counter() - start))
        return out

    llm.engine.step = timed_step

    def at_depth(n: int):
        return llm.generate(prompts, params, use_tqdm=False) if n == 0 else at_depth(n - 1)

    at_depth(depth)  # warm-up
    faults, step_ms = [], []
    for _ in range(rounds):
        steps.clear()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        at_depth(depth)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / len(steps))
        step_ms.append(statistics.median(s * 1e3 for n, w, s in steps if n == 8 and w == 0))
    return {"faults_per_step": statistics.median(faults),
            "step_ms": statistics.median(step_ms)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--depths", default="0,3,6,9,12")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)  # "depth,room" in a spawned process
    args = p.parse_args(argv)
    if args.child:
        depth, room = args.child.split(",")
        print(json.dumps(child(args.model, int(depth), room == "1", args.rounds)), flush=True)
        return []
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for room in (False, True):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--rounds",
                                  str(args.rounds), "--child", f"{depth},{int(room)}"],
                                 capture_output=True, text=True, check=True)
            row = {"depth": depth, "frame_room": room, **json.loads(out.stdout.splitlines()[-1])}
            print(f"depth +{depth:<3} {'frame room' if room else 'bare loop ':<10}  "
                  f"{row['faults_per_step']:7.1f} faults/step  8-row step {row['step_ms']:.1f} ms",
                  flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()

"""KVCMAS's gate decisions on the served trace's tasks, run through an HF ``Session`` instead of vLLM.

    OMP_NUM_THREADS=1 python docs/results/serving_gates_session.py     # ~4 min on one core

The same documents as ``hf-kvshare bench serve --shared-tokens 1024 --agents 4 --tasks 5
--output-tokens 8 --warmup-tasks 3`` (repeat 0: its warm-up tasks, then the timed tasks of the first
QPS), the method with the options serving states (``serving_options("kvcmas")``), each task its own
Session, one task after the other, in the workflow's layout (``TaskSpec.to_workflow``: the shared
texts inside one user message per turn; the served requests put each segment in a message of its
own). Prints, per task, each agent's PH provenance (``corr``: corrected, ``dens``: the gate fell
back to dense) and the first characters of its reply. Not a benchmark.
"""

from __future__ import annotations

import torch

from hf_kvshare import Session, get_method, load_model
from hf_kvshare.bench import serve as sb
from hf_kvshare.evaluation.workflow import run_workflow
from hf_kvshare.serving.host import serving_options

torch.set_num_threads(1)
model, tok = load_model()
workload = sb.ServeTrace(shared_tokens=1024, agents=4, tasks=5, output_tokens=8)
options, _ = serving_options("kvcmas")
method = get_method("kvcmas", **options)
tasks = [("warm-up", t) for t in sb.warmup_tasks(workload, 3, tok, 0, 0)]
tasks += [("timed", t) for t in workload.task_specs(tok, sb.run_seed(0, "run", 0, 0))]
for kind, task in tasks:
    turns = run_workflow(Session(model, tok, method), task.to_workflow(tok))
    rows = [(t.agent, [s.provenance[:4] for s in t.segments if s.kind == "PH"], t.text[:30]) for t in turns]
    print(kind, rows, flush=True)

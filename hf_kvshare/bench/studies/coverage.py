"""Coverage study: reconstruction coverage of selective recomputation and the recomputation methods' fidelity.

    python -m hf_kvshare.bench study coverage --rho 0.9 0.8 --calibration 2 --out runs/studies --threads 1

The KVCMAS paper's Table 2 (:func:`~hf_kvshare.evaluation.coverage.reconstruction_coverage`, collected
by :class:`Coverage`) on the requests after the ``--calibration`` ones, which profile DroidSpeak offline.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ...evaluation import collect_transitions, reconstruction_coverage
from ...methods import DroidSpeak, RelayCaching
from ..runner import write_json
from . import TableCollector, run_study, study_options

#: the workload when none is given (``--workload ...`` replaces all of these)
WORKLOAD = {"workload": "humaneval", "limit": 8, "max_new_tokens": 32}


class Coverage(TableCollector):
    """Reconstruction coverage at each rho over the recorded requests' reuse transitions; also
    ``coverage.json`` (DroidSpeak's layer profile and every report)."""

    name, title = "coverage", "Reconstruction coverage (share of the reuse error the selection removes)"
    columns = [
        ("rho", "rho", "g"),
        ("criterion", "criterion", ""),
        ("selects", "selects", ""),
        ("budget", "budget", ".3f"),
        ("coverage", "coverage", ".3f"),
        ("random_coverage", "random coverage", ".3f"),
        ("relative_coverage", "relative coverage", ".2f"),
    ]

    def __init__(self, rhos: Sequence[float], profile: Path, random_trials: int = 64) -> None:
        super().__init__()
        self.rhos, self.profile, self.random_trials = list(rhos), profile, random_trials
        self.workflows: list = []

    def collect(self, runner, task, index, run) -> None:
        self.workflows.append(task.to_workflow(runner.tokenizer))

    def finish(self, runner) -> None:
        model, tok = runner.model, runner.tokenizer
        droidspeak, relaycaching = DroidSpeak(layer_profile=self.profile), RelayCaching()
        band = relaycaching.band_layers(model.config.num_hidden_layers)
        hidden = [band[0]] if band[0] > 0 else []
        transitions = collect_transitions(model, tok, self.workflows, hidden, runner.progress)
        options = dict(droidspeak=droidspeak, relaycaching=relaycaching, transitions=transitions)
        options.update(random_trials=self.random_trials, progress=runner.progress)
        reports = {}
        for rho in self.rhos:
            reports[str(rho)] = reconstruction_coverage(
                model, tok, self.workflows, rho=rho, **options
            ).to_dict()
            self.rows += [{"rho": rho, **c} for c in reports[str(rho)]["criteria"].values()]
        coverage = {"layer_profile": droidspeak.layer_profile, "coverage": reports}
        write_json(runner.dir / "coverage.json", coverage)
        super().finish(runner)


def main(argv: list[str] | None = None) -> int:
    from .. import __main__ as cli
    from ..command import load_bench_model, load_options, save_profile
    from ..methods import MethodSpec
    from ..workloads import make_workload

    argv = shown = list(sys.argv[1:] if argv is None else argv)
    study = argparse.ArgumentParser(prog=f"{cli.PROG} study coverage", add_help=False, allow_abbrev=False)
    study.add_argument("--part", nargs="+", choices=("coverage", "methods"), default=["coverage", "methods"])
    study.add_argument("--rho", metavar="RHO", type=float, nargs="+", default=[0.9, 0.8], help="reuse ratios")
    study.add_argument("--calibration", type=int, default=2, help="requests for DroidSpeak's offline profile")
    study.add_argument("--random-trials", type=int, default=64, help="random selections per transition")
    options, argv = study.parse_known_args(argv)
    if min(options.rho) < 0 or max(options.rho) > 1 or min(options.calibration, options.random_trials) < 1:
        study.error("--rho values must be in [0, 1]; --calibration and --random-trials >= 1")
    if {"-h", "--help"} & set(argv):
        study.print_help()  # then bench run's options
    defaults = {} if "--workload" in argv else dict(WORKLOAD)
    defaults.update({} if "--offset" in argv else {"offset": options.calibration})
    run = study_options("coverage", argv, defaults)

    # DroidSpeak's offline profile on the first requests, apart from the measured ones
    params = {**run.workload_params(), "offset": 0, "limit": options.calibration}
    shared = run.shared_tokens[0] if run.shared_tokens else None
    workload = make_workload(run.workload, **params, shared_tokens=shared)
    if workload.visual:
        raise SystemExit(
            f"error: --workload {workload.name} puts images in the prompts; the coverage study (its "
            "DroidSpeak profile) runs text workloads only"
        )
    profile = Path(run.out) / "calibration" / f"droidspeak__{workload.tag()}__profile.json"
    model, tok = load_bench_model(run.model, run.dtype, run.device, {}, run.threads, **load_options(run))
    tasks = workload.tasks(tok, run.seed)
    meta = {"workload": workload.name, "workload_params": workload.params(), "model": run.model}
    save_profile(model, tok, tasks, MethodSpec("droidspeak"), profile, meta, not run.no_progress)
    del model
    print(f"DroidSpeak's layer profile on {len(tasks)} request(s) of {workload.tag()}: {profile}")

    if "--methods" not in argv:
        run.methods = ["nonshared"] if "methods" not in options.part else ["fullshared"]
        for rho in options.rho if "methods" in options.part else []:
            ds = f"droidspeak:layer_profile={profile},rho={rho}"
            run.methods += [f"cacheblend:rho={rho}", ds, f"relaycaching:rho={rho}"]
    collectors = [Coverage(options.rho, profile, options.random_trials)] if "coverage" in options.part else []
    return run_study("coverage", run, collectors, __doc__.split("\n\n")[0], shown)


if __name__ == "__main__":
    raise SystemExit(main())

"""The live sweep of speculation policies on the real pair: plain, fixed k and adaptive arms side
by side per concurrency and workload (``python -m specdec.evals.controller_sweep.sweep``)."""

"""`python -m specdec.evals.gpu_check OUT_DIR [--cpu-smoke]`: see `check`."""

from specdec.evals.gpu_check.check import main

raise SystemExit(main())

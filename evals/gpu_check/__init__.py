"""The one-shot device check of the GPU path (FlashInfer, CUDA graphs, sampling kernels, timings).

`python -m specdec.evals.gpu_check OUT_DIR` runs it; `gpu_check.sh` wraps it on a lent machine.
"""

"""DWS: Denoising Workload Surfaces, cost prediction and scheduling for block-diffusion LMs
(methods.md section 4).

Modules:
- decoding.py: confidence-threshold block decoding that records the steps each block took.
- surface.py: workload surfaces [B_max blocks x d steps], executed maps, invariants, curves.
- cost_model.py: per-deployment cost models (surface and scalar) fitted by weighted least squares.
- metrics.py: MAE, MAPE and Kendall's tau of predicted against measured costs.
- predictor.py: the prompt-only surface predictor (block head x step head).
- workload.py: DWS requests: chat prompts, their decoded workloads (labels) and timed runs.
"""

"""Data folders shipped with the package: recipes, calibration sets, eval task configs, kernels."""

"""Per-document context parallelism, one wing: each document on its own aligned CP group of the DP x CP pool
(the planner, its pricing, its units, chains and kernels, and the per-step choice against fixed CP)."""

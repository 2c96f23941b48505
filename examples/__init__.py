"""Examples for kfac_optax (a package so tests and benchmarks can import them).

Runnable scripts: mlp_classifier.py (the README's main example), convnet.py,
transformer_lm.py, lstm_lm.py, gpt2_hf_style.py, data_parallel.py. What they
share, one idea a module: datasets.py (local data), models.py (the networks),
side_by_side.py (training optimizers side by side and comparing them) and
cpu_threads.py (one OpenBLAS thread for K-FAC's LAPACK calls).
"""

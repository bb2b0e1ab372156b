"""Tools users run: the doctor, the demo, model preparation, the fidelity measurement and a `vllm serve` wrapper."""

"""The adversarial trial of issue 21 (benchmarks/adversarial.py) at its CI scale, and checks of its oracle."""

"""hybridflow: the pure library (config, batch contract, algorithms, data, rewards, models).

No prefect, ray or mlflow imports anywhere in this package (enforced by a test).
"""

__version__ = "0.1.0"

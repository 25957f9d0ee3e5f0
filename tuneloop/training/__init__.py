"""Fine-tuning: launch.py starts a job of 1..N processes, train.py is one of them."""

from tuneloop.training.launch import (
    TrainingError,
    TrainResult,
    TrainSpec,
    candidate_specs,
    launch_training,
)

__all__ = ["TrainingError", "TrainResult", "TrainSpec", "candidate_specs", "launch_training"]

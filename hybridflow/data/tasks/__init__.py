"""Task generators writing verl-format rows: GSM8K from its jsonl, arithmetic with a
difficulty knob, TinyZero's Countdown, and reasoning-gym's generators (``reasoning_gym``, imported
on use: it pulls in sympy). Each row's ``extra_info`` records how it was made."""

from hybridflow.data.tasks.arith import MAX_DIFFICULTY, make_arith
from hybridflow.data.tasks.countdown import make_countdown
from hybridflow.data.tasks.gsm8k import gsm8k_rows

__all__ = ["make_arith", "make_countdown", "gsm8k_rows", "MAX_DIFFICULTY"]

"""Same seed, same run, on the paths the demo model takes and the tiny test models do not.

Two fresh processes (two torch threads each, as the demo's policy pool) build a random model with
SmolLM2-135M's shapes (hidden 576, 9 query / 3 KV heads, MLP 1536, vocab 49152, tied
embeddings; one layer), sample 2 prompts x 8, update the policy once and sample again. On the way
they take the shared-prompt forward and backward with its KV-cache gather (micro-batches of 8 =
one prompt group), micro-batches trimmed to their longest response (responses end at seeded
lengths), the fused AdamW step and the 49152-wide LM head. One of them runs under
``torch.use_deterministic_algorithms(True)``, which raises on an operation known to be
non-deterministic. Both must agree bit for bit: the weights after the update, and the second
rollout's tokens and log-probs.

What this test missed (issue 15 item 8, found in session 7): on CPU that flag does not raise for
``index_put_(accumulate=True)``, it switches it to a sorted, deterministic kernel — so the flagged
process was always right and the default process agreed unless the race in the old KV-cache
gather's backward happened to reorder. The gather and its race have a direct test now:
tests/unit/test_shared_prefix.py::test_the_cache_gather_adds_its_gradient_in_the_same_order_every_time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import hashlib, sys
import torch
torch.set_num_threads(2)
if sys.argv[1] == "deterministic":
    torch.use_deterministic_algorithms(True)
from transformers import LlamaConfig, LlamaForCausalLM

import workers.policy as WP
from hybridflow.algorithms.sequences import position_ids_from_mask
from tasks.rollout import policy_log_probs_from_rollout
from tests.unit._worker_helpers import prompt_batch, tiny_cfg
from workers import shared_prefix

def smollm2_shaped(cfg, device):
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, num_hidden_layers=1, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.trainer.seed)
        return LlamaForCausalLM(config).float().eval()

WP.build_policy_module = smollm2_shaped
R = 16
cfg = tiny_cfg("data.prompts_per_iteration=2", "rollout.samples_per_prompt=8", f"rollout.max_response_tokens={R}",
               "rollout.temperature=0.7", "actor.mini_batch_trajectories=16", "actor.micro_batch_trajectories=8",
               "actor.lr=1e-5")
w = WP.PolicyWorker(cfg)
assert shared_prefix.shares_prompts(w.model) and w.optim.group_by_prompt
assert w.optim.optimizer.defaults["fused"]
prompts = ("12+7=", "100-1=")
gen = w.generate_sequences(prompt_batch(w.tokenizer, prompts), seed=1)
# random weights never stop: end the responses at seeded lengths (3..16 tokens)
lengths = torch.randint(3, R + 1, (len(gen),), generator=torch.Generator().manual_seed(3))
mask = (torch.arange(gen["response_ids"].shape[1])[None] < lengths[:, None]) & gen["response_mask"]
gen.set("response_mask", mask)
gen.set("response_ids", gen["response_ids"].masked_fill(~mask, 2))
gen.set("rollout_log_probs", gen["rollout_log_probs"].masked_fill(~mask, 0.0))
gen.set("position_ids", position_ids_from_mask(torch.cat([gen["prompt_mask"], mask], 1)))
batch = policy_log_probs_from_rollout(gen)
adv = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(4)).expand_as(mask)
batch.set("advantages", adv.masked_fill(~mask, 0.0).contiguous())
metrics = w.update_policy(batch, expected_version=0, batch_id="b0")
assert metrics["actor/weights_version"] == 1.0 and not metrics["actor/update_skipped"]
after = w.generate_sequences(prompt_batch(w.tokenizer, prompts), seed=2)
digest = lambda ts: hashlib.sha256(b"".join(t.detach().contiguous().numpy().tobytes() for t in ts)).hexdigest()
print("weights", digest(list(w.module.parameters())))
print("tokens", digest([after["response_ids"]]))
print("log_probs", digest([after["rollout_log_probs"]]))
"""


def test_same_seed_same_update_and_rollout_on_the_demo_models_paths():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for mode in ("default", "deterministic")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outs.append([line for line in out.splitlines() if line.startswith(("weights", "tokens", "log_probs"))])
    assert len(outs[0]) == 3
    assert outs[0] == outs[1]

